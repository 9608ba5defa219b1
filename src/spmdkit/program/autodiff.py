"""Reverse-mode differentiation over the registered grad rules.

:class:`Tape` is a :class:`~spmdkit.program.ir.ProgramBuilder` front that records forward ops
and emits their backward (grad) ops in reverse order; :data:`GRADS` maps each differentiable
forward rule to its grad rule, as the op families declare it (``facts(grad=, wrt=)`` in
:mod:`spmdkit.ops`). The built-in models (:mod:`spmdkit.models.zoo`) and the torch
importer (:mod:`spmdkit.models.torch_import`) both differentiate with it.

Gradients of a tensor read by several ops are summed with ``add_n`` (which keeps a common
partial status, as Megatron sums the partial input gradients of its column-parallel
projections before one all-reduce).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.engine.facts import facts_of
from spmdkit.engine.registry import get_rule, is_reverse, output_params, rule_names
from spmdkit.program.ir import ProgramBuilder

# -- reverse-mode differentiation over the grad rules ------------------------------------------


class _Grads(Mapping[str, tuple[str, tuple[str, ...]]]):
    """Forward rule -> (its grad rule, the forward tensor parameters whose gradients the grad rule
    returns, in order): the ``grad`` and ``wrt`` facts the op families declare beside their rules
    (:mod:`spmdkit.engine.facts`), read once the families are imported (on first use)."""

    def __init__(self) -> None:
        self._table: dict[str, tuple[str, tuple[str, ...]]] | None = None

    def _get(self) -> dict[str, tuple[str, tuple[str, ...]]]:
        if self._table is None:
            names = rule_names(include_aliases=False)  # imports the op families
            self._table = {n: (f.grad, f.wrt) for n in names
                           if (f := facts_of(n)).grad is not None and f.wrt is not None}
        return self._table

    def __getitem__(self, rule: str) -> tuple[str, tuple[str, ...]]:
        return self._get()[rule]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


#: forward rule -> (grad rule, forward tensor parameters whose gradients it returns, in order)
GRADS: Mapping[str, tuple[str, tuple[str, ...]]] = _Grads()


def _output_names(rule_name: str) -> list[str]:
    rule = get_rule(rule_name)
    return output_params(rule) if is_reverse(rule) else list(facts_of(rule_name).outputs or ("out",))


def _names(v: Any) -> list[str]:
    """The tensor names of one parameter's value (a name, a tuple of names for a vector)."""
    if isinstance(v, str):
        return [v]
    if isinstance(v, tuple):
        return [n for n in v if isinstance(n, str)]
    return []


@dataclass
class _Rec:
    rule: str
    inputs: dict[str, Any]
    outputs: list[str | None]
    attrs: dict[str, Any]
    layer: str
    #: grad-rule arguments the forward op does not have (dropout_grad's mask and p)
    grad_extra: dict[str, Any] = field(default_factory=dict)


class Tape:
    """A ProgramBuilder that records forward ops and emits their backward ops."""

    def __init__(self, b: ProgramBuilder) -> None:
        self.b = b
        self.recs: list[_Rec] = []
        self.needs_grad: set[str] = set()

    def param(self, name: str, shape: Sequence[int], dtype: str) -> str:
        self.b.tensor(name, shape, dtype, "parameter")
        self.needs_grad.add(name)
        return name

    def op(self, rule: str, inputs: Mapping[str, Any], outputs: Sequence[Any],
           grad_extra: Mapping[str, Any] | None = None, **attrs: Any) -> list[str | None]:
        """Record a forward op; ``grad_extra``: arguments of its grad rule that the forward op
        does not take (a tensor name or an attribute value by grad-rule parameter name)."""
        outs = self.b.op(rule, inputs, outputs, **attrs)
        self.recs.append(_Rec(rule, dict(inputs), outs, dict(attrs), self.b.layer, dict(grad_extra or {})))
        if any(n in self.needs_grad for v in inputs.values() for n in _names(v)):
            self.needs_grad.update(n for o in outs for n in _names(o))
        return outs

    def _grad_decl(self, x: Any, got: list[tuple[str, str]], contrib: dict[str, list[str]], rule: str) -> Any:
        """The declaration of one gradient output for input ``x`` (None where x needs none);
        the name is recorded in ``got``."""
        if not isinstance(x, str) or x not in self.needs_grad:
            return None
        b = self.b
        t = b.get(x)
        k = len(contrib.get(x, [])) + sum(1 for y, _ in got if y == x)
        gn = f"{x}.grad" if k == 0 else f"{x}.grad{k}"
        if b.has(gn) or any(g == gn for _, g in got):
            gn = f"{x}.grad.{rule}{len(self.recs)}{k}"
        got.append((x, gn))
        return (gn, t.shape, t.dtype, "gradient")

    def _replicated_grad(self, rec: _Rec, ograds: dict[str, Any], contrib: dict[str, list[str]]) -> None:
        """The backward of a ``replicated`` op (the torch importer's fallback): one more
        ``replicated`` op reading the forward inputs and the output gradients and making the
        gradients of the inputs that need one."""
        got: list[tuple[str, str]] = []
        ins = tuple(n for n in _names(rec.inputs.get("ins")) if n is not None)
        outs = [self._grad_decl(x, got, contrib, rec.rule) for x in ins]
        if not got:
            return
        reads = ins + tuple(g for v in ograds.values() for g in _names(v) if g is not None)
        self.b.op("replicated", {"ins": tuple(dict.fromkeys(reads)), "outs": (None,) * len(outs)}, outs,
                  name=f"grad of {next((n for o in rec.outputs for n in _names(o)), rec.rule)}")
        for x, gn in got:
            contrib.setdefault(x, []).append(gn)

    def backward(self, loss: str) -> dict[str, str]:
        """Emit the backward ops of every recorded op (reverse order); returns tensor -> its
        gradient for every parameter."""
        b = self.b
        b.phase = "backward"
        seed = b.tensor(f"{loss}.grad", b.get(loss).shape, b.get(loss).dtype, "input")
        contrib: dict[str, list[str]] = {loss: [seed]}
        done: dict[str, str] = {}

        def grad_of(name: str) -> str | None:
            if name in done:
                return done[name]
            parts = contrib.get(name)
            if not parts:
                return None
            if len(parts) == 1:
                done[name] = parts[0]
                return parts[0]
            t = b.get(name)
            (g,) = b.op("add_n", {"input": tuple(parts)}, [(f"{name}.grad.sum", t.shape, t.dtype, "gradient")],
                        name=f"sum of {name}.grad")
            assert g is not None
            done[name] = g
            return g

        def zeros(n: str) -> str:
            """A zero gradient for a piece of a vector output nothing reads (split_grad needs
            every piece's)."""
            t = b.get(n)
            (z,) = b.op("zeros_like", {"x": n}, [(f"{n}.grad.zero", t.shape, t.dtype, "gradient")],
                        name=f"zero grad of {n}")
            assert z is not None
            return z

        def ograd(n: Any) -> Any:
            if isinstance(n, tuple):
                gs = [None if x is None else grad_of(x) for x in n]
                if not any(gs):
                    return None
                return tuple(g if g is not None or x is None else zeros(x) for g, x in zip(gs, n))
            return grad_of(n)

        for rec in reversed(self.recs):
            b.layer = rec.layer
            out_names = _output_names(rec.rule) if rec.rule != "replicated" else [str(i) for i in range(len(rec.outputs))]
            by_out = dict(zip(out_names, rec.outputs))
            ograds = {o: ograd(n) for o, n in by_out.items() if n is not None}
            if not any(ograds.values()):
                continue
            if rec.rule == "replicated":  # an imported op with no lowering: its backward replicated as well
                self._replicated_grad(rec, ograds, contrib)
                continue
            if rec.rule not in GRADS:
                raise ProgramError(f"autodiff: no grad rule known for {rec.rule}")
            gname, wrt = GRADS[rec.rule]
            grule = get_rule(gname)
            aliases = dict(facts_of(rec.rule).grad_reads or ())
            ins: dict[str, Any] = {}
            gattrs: dict[str, Any] = {}
            for p in grule.forward.params:
                n = p.name
                if not p.is_tensor:
                    if n in rec.grad_extra:
                        gattrs[n] = rec.grad_extra[n]
                    elif n in rec.attrs:
                        gattrs[n] = rec.attrs[n]
                    continue
                src: Any = None
                if n in rec.grad_extra:
                    src = rec.grad_extra[n]
                elif n in aliases:
                    src = by_out.get(aliases[n])
                elif n in rec.inputs:
                    src = rec.inputs[n]
                elif n in by_out:
                    src = by_out[n]
                elif n.endswith("_grad") and n[:-5] in by_out:
                    src = ograds.get(n[:-5])
                elif n.startswith("grad_") and n[5:] in by_out:  # moe_gate_dispatch_grad's grad_y
                    src = ograds.get(n[5:])
                elif n.endswith("_grad") and len(ograds) == 1:  # slice: output "output", grad "out_grad"
                    src = next(iter(ograds.values()))
                elif n in ("x_shape", "xshape"):
                    src = rec.inputs.get("x")
                elif n == "inputs" and "input" in rec.inputs:
                    src = rec.inputs["input"]
                if src is None and p.required and p.kind != "T?":
                    raise ProgramError(f"autodiff: {gname} needs {n!r}, which {rec.rule} does not give")
                if src is not None:
                    ins[n] = src
            outs: list[Any] = []
            got: list[tuple[str, str]] = []
            for w in wrt:
                x = rec.inputs.get(w)
                if isinstance(x, tuple):  # a vector input (concat's x): a list of gradients
                    items = [self._grad_decl(y, got, contrib, rec.rule) for y in x]
                    outs.append(items if any(i is not None for i in items) else None)
                else:
                    outs.append(self._grad_decl(x, got, contrib, rec.rule))
            if not got:
                continue
            first = next((n for o in rec.outputs for n in _names(o)), rec.rule)
            b.op(gname, ins, outs, name=f"grad of {first}", **gattrs)
            for x, gn in got:
                contrib.setdefault(x, []).append(gn)
        grads: dict[str, str] = {}
        for name in sorted(self.needs_grad):
            if b.get(name).kind == "parameter":
                g = grad_of(name)
                if g is not None:
                    grads[name] = g
        return grads


__all__ = ["GRADS", "Tape"]
