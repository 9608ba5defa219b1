"""The output shapes an op's rule makes from its input shapes and attributes (issue 13).

:func:`expected_output_shapes` answers, per output of a rule's forward mode, the global shape
the op produces, so that :meth:`spmdkit.program.ir.Program.validate` refuses a program whose
declared output shape contradicts its op. Each answer is a tuple with, per axis, the size (an
int) or ``None`` where the size is not fixed by the shapes and attributes the rule sees; a
whole output is ``None`` where nothing is checked (its rank is still checked against the rule's
answer by ``validate``). Types and conventions: :mod:`spmdkit.engine.outshape`.

The shapes are facts of the op families (:mod:`spmdkit.ops`): ``facts(<rules>, shape=fn)``
beside each rule, read here through :func:`spmdkit.engine.facts.facts_of`. A grad rule without
a shape function of its own has its outputs derived here: each has the shape of the forward
input it is the gradient of, the base rule's tensor inputs that the grad rule also takes, in
order (``<rule>_grad`` of ``<rule>``), or the grad rule's ``grad_like`` fact where that does not
say (``"="``: the shape of the grad rule's last tensor, the output gradient, for ops whose
output has their input's shape). :func:`unchecked_rules` lists, with the reason, every output
whose size is not fixed (the families' ``unchecked`` facts: data-dependent sizes, kernel
workspace).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from spmdkit.engine.facts import facts_of
from spmdkit.engine.outshape import Args, Expect, ShapeFn, UnknownShape
from spmdkit.engine.registry import Rule, all_rules, get_rule, has_rule


def _grad_sources(rule: Rule) -> Sequence[str] | None:
    """The grad rule's inputs whose shapes its outputs have (see the module doc)."""
    name = rule.name
    like = facts_of(name).grad_like
    if like is not None:
        return like
    base_name = name[: -len("_grad")]
    if not name.endswith("_grad") or not has_rule(base_name):
        return None
    mine = [p.name for p in rule.forward.params if p.is_tensor]
    return [p.name for p in get_rule(base_name).forward.params if p.is_tensor and p.name in mine]


def _grad_fn(rule: Rule) -> ShapeFn | None:
    """A grad rule's outputs, each the shape of one of its inputs (None where none is derived)."""
    srcs = _grad_sources(rule)
    if srcs is None:
        return None
    tensors = [p.name for p in rule.forward.params if p.is_tensor]
    if any(s != "=" and s not in tensors for s in srcs):
        return None

    def grad(a: Args) -> list[Expect]:
        out: list[Expect] = []
        for s in srcs:
            if s == "=":
                out.append(a.s(tensors[-1]))
            else:
                v = a.values.get(s)
                out.append(list(v) if isinstance(v, list) else v)
        return out

    return grad


_FNS: dict[str, ShapeFn | None] = {}


def shape_fn(rule: Rule) -> ShapeFn | None:
    """The shape function of a rule (None where none is declared nor derived)."""
    if rule.name in _FNS:
        return _FNS[rule.name]
    declared: ShapeFn | None = facts_of(rule.name).shape
    fn = declared or _grad_fn(rule)
    _FNS[rule.name] = fn
    return fn


def expected_output_shapes(rule: Rule, values: Mapping[str, Any], ndims: Sequence[Any]) -> list[Expect]:
    """Per forward output of ``rule``: the shape the op makes (see the module doc), or None.
    ``values``: the forward arguments by parameter name (tensors as shape tuples); ``ndims``:
    the rule's answer's output ranks (a list per vector output). Never raises for a shape
    question it cannot answer: that output is None."""
    fn = shape_fn(rule)
    if fn is None:
        return [None] * len(ndims)
    tensors = [p.name for p in rule.forward.params if p.is_tensor]
    try:
        out = list(fn(Args(values, tensors, ndims)))
    except (UnknownShape, IndexError, KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError):
        return [None] * len(ndims)
    out = out[: len(ndims)] + [None] * (len(ndims) - len(out))
    return [_agree(_clean(e), nd) for e, nd in zip(out, ndims)]


def _agree(e: Any, nd: Any) -> Any:
    """An answer whose rank differs from the rank the rule itself answers is not used (the
    rule's rank is checked separately; a disagreement is the shape function's doubt, not the
    program's error)."""
    if e is None:
        return None
    if isinstance(e, list):
        if not isinstance(nd, (list, tuple)) or len(nd) != len(e):
            return e if not isinstance(nd, (list, tuple)) else [None] * len(nd)
        return [x if x is None or n is None or len(x) == n else None for x, n in zip(e, nd)]
    if isinstance(nd, int) and len(e) != nd:
        return None
    return e


def _clean(e: Any) -> Any:
    """An answer as :data:`~spmdkit.engine.outshape.Expect`: a size that is not a non-negative
    int (a negative one from an impossible geometry, which the kernel refuses or clamps) is not
    checked."""
    if e is None:
        return None
    if isinstance(e, list):
        return [_clean(x) for x in e]
    if not isinstance(e, tuple):
        return None
    return tuple(v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None for v in e)


def unchecked_rules() -> dict[str, str]:
    """Every rule with an output whose shape is not (fully) checked, with the reason: the
    families' ``unchecked`` facts, plus rules without a shape function."""
    out: dict[str, str] = {}
    for r in {r.name: r for r in all_rules().values()}.values():
        why = facts_of(r.name).unchecked
        if why is not None:
            out[r.name] = why
        elif shape_fn(r) is None:
            out[r.name] = "no shape function declared (only the output rank is checked)"
    return out


__all__ = ["expected_output_shapes", "shape_fn", "unchecked_rules"]
