"""Rules as declarations: the engine generates a rule's functions from what it declares.

A rule declares, per mode (:class:`Way`), a *notation function of a key* (the key: tensor
ranks, attributes, size-1 masks, ... computed from the call's arguments by expressions
written in the declaration) and what the call must satisfy (tensors on one mesh, pairs of
tensors of one shape, a small ``check`` hook), and at most a small ``post`` hook for a true
special case. :func:`declare` registers the rule (its Paddle signature, outputs, Paddle
function names, kind of the backward slot) with functions :func:`generate` writes for it:
straight-line Python with the signature's real parameter names (no ``*args`` parsing per
call) that checks the call, computes the key, looks its compiled plan up in a dict (compiled
on the key's first call: once per key, never per shape) and answers through
:func:`spmdkit.engine.compiler.infer`.

    declare(
        "softmax", "x: T, axis: int = -1",
        Way(softmax_notation, key="x, axis", paddle="SoftmaxInferSpmd"),
        reverse=Way(softmax_notation, key="x, axis", same=[("x", "out")], paddle="SoftmaxInferSpmdReverse"),
        outputs="out: T",
    )

``key``: comma-separated Python expressions over the mode's parameters (and the names a
:class:`Let` binds); a bare tensor name
stands for its rank (``-1`` for an absent optional tensor; a list of tensors: the tuple of
their ranks), ``ones(t)`` for the bit mask of
its size-1 axes, and ``*f(...)`` for the items of a tuple (one such item alone: the key is
``f(...)``, which must be a tuple); the notation function receives the values in order (plus
the ``mask``, see :class:`Way`). An :class:`~spmdkit.core.errors.SpmdError` raised by a notation function or a
hook without the op's name (``"perm [1] has 1 entries for a 2-D x"``) is re-raised with it
(``"transpose: perm ..."``), so the notation functions are plain functions of the key.

The hooks (``pre``, ``check``, ``post_if``, ``out_shapes``; ``post``) are ordinary Python
functions: the generated code calls each by the names of its parameters (see :class:`Way`).
"""

from __future__ import annotations

import functools
import inspect
import keyword
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import InvalidArgumentError, InvalidMeshError, ShapeMismatchError, SpmdError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.codegen import define
from spmdkit.engine.compiler import compile_plan, infer
from spmdkit.engine.notation import Notation
from spmdkit.engine.plans import RulePlan
from spmdkit.engine.registry import register
from spmdkit.engine.shapes import NAMESPACE as SHAPE_NAMES
from spmdkit.engine.shapes import mismatch, require_lines, shape_lines
from spmdkit.engine.signature import GRAD, REVERSE, parse_signature, reverse_signature
from spmdkit.engine.tensors import check_letters, common_mesh, fast_result, named_mesh

#: what the engine answers and a post-hook returns: the inputs' and the outputs' dist attrs
Answer = tuple[Sequence[TensorDistAttr | None], Sequence[TensorDistAttr | None]]

#: compiled plans kept per generated function (a dict per mode; emptied when it holds more)
PLAN_LIMIT = 4096


@dataclass(frozen=True)
class Let:
    """A hook whose value the generated function binds to ``name`` (not a parameter's, no leading
    underscore): the hooks after it, the key expressions, ``post_if`` and ``out_shapes`` may read
    it (``Let("tgt", _target)``: reshape's resolved target shape, read by its key and its
    ``out_shapes``)."""

    name: str
    fn: Callable[..., Any]


@dataclass(frozen=True)
class PartialIn:
    """A ``post_if`` condition declared, not a hook: one of these tensor parameters is partial
    (``PartialIn("x")``: a linear op's post hook keeps x's partial status). The generated code
    reads it inline."""

    tensors: tuple[str, ...]

    def __init__(self, *tensors: str) -> None:
        object.__setattr__(self, "tensors", tensors)


#: a stage's hooks (``Way.pre``, ``Way.check``): one, or several run in order
Hooks = Callable[..., Any] | Let | Sequence[Callable[..., Any] | Let]


@dataclass(frozen=True)
class Way:
    """One mode of a declared rule (forward, reverse or grad).

    * ``notation(*key) -> Notation``: the notation of a call with that key;
    * ``key``: comma-separated expressions over the mode's parameters (see the module
      docstring; default: the ranks of all its tensors), or a callable taking the mode's
      arguments and returning the key tuple;
    * ``mask``: tensors (inputs of the notation, in order) whose size-1 axes key the
      plan: their bit masks (``ones(t)``; 0 for an input between them not named) are the key's
      last item, passed to the notation function last and to
      :func:`~spmdkit.engine.compiler.compile_plan` as its ``mask``
      (for ``size1="broadcast"``);
    * ``same``: pairs of tensor names that must have one shape (sizes -1 match anything;
      checked after ``check``); every tensor must lie on the first tensor's mesh (checked
      first, always; the message names both);
    * ``letters``: check per call that every letter has one size over the tensors the plan
      merges and projects (:func:`~spmdkit.engine.notation.check_letters`);
    * ``check``: more checks (shapes, attributes), raising SpmdError subclasses that name the
      argument: a hook, or several run in order (a :class:`Let` binds its value to a name). A
      hook is an ordinary function called by its parameters' names: each takes the mode's
      parameter of that name, ``op`` the op's name, a name an earlier :class:`Let` bound its
      value; one with a default the call has no value for keeps its default
      (``def _check(op, x, y, out=None)`` serves forward and reverse);
    * ``post(ins, outs, *args) -> (ins, outs)``: a hook on the engine's answer for a true
      special case (say why where it is declared), given every parameter in order;
      ``post_if``: a hook (by name, as ``check``) where given the post hook runs only where it
      returns true, or :class:`PartialIn` (``PartialIn("x")``: where x is partial);
    * ``env``: names the ``key`` expressions may use besides the parameters and ``ones``;
    * ``wrap(fn, signature, outputs) -> fn``: what :func:`declare` registers in place of the
      generated function (a 0-D optional tensor read as absent: ``spmdkit.ops._absent.absent_0d``);
    * ``out_shapes``: a hook (by name, as ``check``) giving the outputs' shapes, passed to
      :func:`~spmdkit.engine.compiler.infer` in the forward direction (a ``flatten`` letter on
      an output needs its sizes there: the view rules);
    * ``tail``: every tensor of the call (a reverse rule's outputs too) is an input of the
      notation, compiled forward (its ``sources`` name the merged ones), and the answer's
      outputs are, for an int ``k``, the attrs of ``k`` absent tensors the notation labels
      after the call's (so never partial: the optimizers' outputs; the answer's inputs: the
      call's tensors less a reverse rule's outputs, which come after them), for a parameter's name,
      the tensors from that parameter on (the answer's inputs those before it; both flat:
      default_data_parallel's ``ins`` / ``outs``), then the notation's outputs; ``post``
      sees that flat answer;
    * ``nonempty``: list parameters that together must hold a tensor (absent items not
      counted); else InvalidArgumentError naming them, before the mesh is read;
    * ``shapes``: the tensors' ranks and the sizes that must agree, e.g. ``"x: b m k; y: b k n"``
      (:mod:`spmdkit.engine.shapes`); ``require``: conditions over the attributes (``"groups >= 1"``),
      InvalidAttributeError naming the op, the condition and the values where one is false.
      Checked after the mesh, in the order require, shapes, ``check``, ``same``;
    * ``pre``: hooks (as ``check``) run before the mesh is read (an empty list has no mesh:
      einsum checks its equation against it first);
    * ``order``: the tensor parameters (comma-separated, each once) in the order the notation
      labels them, where it is not the signature's (a reverse rule's outputs after its inputs):
      the default key, the mesh check and ``post`` follow it, and the answer is given back in
      the signature's order (cross_entropy_with_softmax's reverse merges loss before softmax;
      a grad rule whose Paddle signature puts sin / cos first is the forward rule on the grads);
      not with list parameters or ``tail``;
    * ``direction``, ``outputs``: how :func:`declare` compiles a backward slot where it is not
      the usual way: a reverse rule ``direction="forward"`` (every tensor, the outputs too, an
      input of the notation: concat / stack align them all), a grad rule
      ``direction="backward"`` with the tensors of ``outputs`` its notation's outputs, merged
      (pad's grad slot infers x from out);
    * ``paddle``: Paddle's function name of this mode; ``doc``: the generated function's
      docstring.
    """

    notation: Callable[..., Notation]
    key: str | Callable[..., tuple[Any, ...]] = ""
    mask: Sequence[str] = ()
    same: Sequence[tuple[str, str]] = ()
    letters: bool = False
    check: Hooks = ()
    post: Callable[..., Answer] | None = None
    post_if: Callable[..., Any] | PartialIn | None = None
    env: Mapping[str, Any] = field(default_factory=dict)
    wrap: Callable[[Callable[..., SpmdResult], str, Sequence[str]], Callable[..., SpmdResult]] | None = None
    out_shapes: Callable[..., Any] | None = None
    tail: int | str = 0
    nonempty: Sequence[str] = ()
    pre: Hooks = ()
    shapes: str = ""
    require: Sequence[str | tuple[str, str]] = ()
    order: str = ""
    direction: str = ""
    outputs: Sequence[str] = ()
    paddle: str = ""
    doc: str = ""


def ones(t: DistTensorSpec | None) -> int:
    """The size-1 axes of ``t`` as a bit mask (0 for an absent tensor)."""
    if t is None:
        return 0
    m = 0
    for i, s in enumerate(t.shape):
        if s == 1:
            m |= 1 << i
    return m


def same_shape(op: str, na: str, a: DistTensorSpec, nb: str, b: DistTensorSpec) -> None:
    """ShapeMismatchError naming ``nb`` and ``na`` where their shapes differ (-1 matches any size)."""
    if mismatch(a.shape, b.shape) is not None:
        raise ShapeMismatchError(f"{op}: {nb} has shape {list(b.shape)}, {na} has {list(a.shape)}")


def renamed(e: SpmdError, op: str) -> SpmdError:
    """``e``, or where its message does not start with ``op``, the same error naming it."""
    msg = str(e)
    if msg.startswith(op + ":"):
        return e
    try:
        return type(e)(f"{op}: {msg}")
    except TypeError:  # an error class built otherwise: kept as it is
        return e


def _list_mesh(op: str, named: tuple[tuple[str, Any, bool], ...]) -> Any:
    """The one mesh of a call with lists of tensors (``(name, value, is a list)``; absent tensors
    skipped); InvalidMeshError naming the two tensors that disagree, or that none is given."""
    try:
        return common_mesh(op, [t for _, v, is_list in named for t in (v if is_list else (v,))])
    except InvalidMeshError:
        items: list[tuple[str, Any]] = []
        for n, v, is_list in named:
            items += [(f"{n}[{i}]", t) for i, t in enumerate(v)] if is_list else [(n, v)]
        return named_mesh(op, items)


_names_cache: dict[tuple[tuple[str, int], ...], tuple[str, ...]] = {}


def _list_names(spec: tuple[tuple[str, int], ...]) -> tuple[str, ...]:
    """The tensors' names of a call, from ``(name, length of a list or -1)``: a list's items
    named ``x[0]``, ``x[1]``, ..."""
    got = _names_cache.get(spec)
    if got is None:
        out: list[str] = []
        for n, k in spec:
            out.extend([n] if k < 0 else [f"{n}[{i}]" for i in range(k)])
        got = tuple(out)
        if len(_names_cache) >= PLAN_LIMIT:
            _names_cache.clear()
        _names_cache[spec] = got
    return got


def _split(text: str) -> list[str]:
    """Comma-separated items (commas inside brackets do not split)."""
    out: list[str] = []
    depth = 0
    cur: list[str] = []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    last = "".join(cur).strip()
    if last:
        out.append(last)
    return out


def _hook_args(op: str, fn: Callable[..., Any], bound: Sequence[str]) -> str:
    """The arguments of a call of hook ``fn`` in the generated code: each of its parameters the
    value of that name (a parameter of the mode or a name bound by a :class:`Let` before it;
    ``op``: the op's name), a parameter no such name exists for left to its default."""
    out: list[str] = []
    by_name = False
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"{op}: a hook takes its arguments by name, not *{p.name} ({fn!r})")
        if p.name in bound:
            value = p.name
        elif p.name == "op":
            value = "_OP"
        elif p.default is not p.empty:
            by_name = True  # the parameters after one left out are passed by name
            continue
        else:
            raise ValueError(f"{op}: hook {fn!r} takes {p.name!r}, which is no parameter of the rule")
        if p.kind is p.POSITIONAL_ONLY and by_name:
            raise ValueError(f"{op}: hook {fn!r} takes {p.name!r} positionally after one it is not given")
        out.append(f"{p.name}={value}" if by_name or p.kind is p.KEYWORD_ONLY else value)
    return ", ".join(out)


class _Source:
    """The source of one generated rule function (:func:`generate`), written step by step: the
    tensors' roles, then the lines in the order the function runs them (arguments, mesh, checks,
    key and plan, the answer)."""

    def __init__(self, op: str, signature: str, way: Way, direction: str, outputs: Sequence[str], name: str) -> None:
        if direction not in ("forward", "backward"):
            raise ValueError(f"{op}: direction must be 'forward' or 'backward', got {direction!r}")
        self.op, self.signature, self.way, self.direction = op, signature, way, direction
        self.params = parse_signature(signature)
        self.pnames = [p.name for p in self.params]
        for n in self.pnames:
            if not n.isidentifier() or keyword.iskeyword(n) or n.startswith("_"):
                raise ValueError(f"{op}: parameter name {n!r} cannot be generated")
        self.kinds = {p.name: p.kind for p in self.params}
        self.call = ", ".join(self.pnames)
        self.bound = list(self.pnames)  # what a hook may take: the parameters, then the Let names
        self.ns: dict[str, Any] = {
            "_OP": op, "_infer": infer, "_result": fast_result, "_E": SpmdError, "_renamed": renamed,
            "_named_mesh": named_mesh, "_same": same_shape, "_ones": ones, "ones": ones, "_post": way.post,
            "_letters": check_letters, "_list_mesh": _list_mesh, "_list_names": _list_names,
            "_IAE": InvalidArgumentError, **SHAPE_NAMES, **way.env,
        }  # fmt: skip
        self.lines: list[str] = []
        self._roles(outputs)
        self.ns["_NAMES"] = tuple(self.tensors)
        self._arguments(name or op)

    def emit(self, line: str) -> None:
        self.lines.append(line)

    def _roles(self, outputs: Sequence[str]) -> None:
        """The tensors in the notation's order, which are merged outputs (a reverse rule's), which
        are list parameters, and the answer's order (the signature's)."""
        op, way, signature = self.op, self.way, self.signature
        tensors = [p.name for p in self.params if p.is_tensor]
        self.lists = [n for n in tensors if self.kinds[n] in ("[T]", "[T?]")]
        outs = list(outputs) if self.direction == "backward" and not way.tail else []
        self.sig_ins, self.sig_outs = [n for n in tensors if n not in outs], outs  # the answer's order
        if way.order:
            order = _split(way.order)
            if self.lists or way.tail or sorted(order) != sorted(tensors):
                raise ValueError(f"{op}: order {way.order!r} must name each tensor of {signature!r} once (no lists)")
            outs = [n for n in order if n in outs]
            tensors = [n for n in order if n not in outs] + outs  # the names the answer's items have
        self.permuted = bool(way.order) and tensors != self.sig_ins + self.sig_outs
        if isinstance(way.tail, str) and way.tail not in tensors:
            raise ValueError(f"{op}: tail {way.tail!r} is not a tensor parameter of {signature!r}")
        for n in outs:
            if n not in tensors:
                raise ValueError(f"{op}: output {n!r} is not a tensor parameter of {signature!r}")
        ins = [n for n in tensors if n not in outs]
        for a, b in way.same:
            if a not in tensors or b not in tensors or a in self.lists or b in self.lists:
                raise ValueError(f"{op}: same-shape pair ({a!r}, {b!r}) names no single tensor parameter")
        for n in way.mask:
            if n not in ins or n in self.lists:
                raise ValueError(f"{op}: mask tensor {n!r} is not a single input of the notation")
        self.masked = ins[: max((ins.index(n) + 1 for n in way.mask), default=0)]  # 0 for an input not named
        if [n for n in self.masked if n in way.mask] != list(way.mask):
            raise ValueError(f"{op}: mask tensors {list(way.mask)} must be in the inputs' order {ins}")
        self.tensors, self.ins, self.outs = tensors, ins, outs

    def _arguments(self, fname: str) -> None:
        """The def line: the signature's names and defaults (none before a required parameter)."""
        args = []
        last_required = max((i for i, p in enumerate(self.params) if p.required), default=-1)
        for i, p in enumerate(self.params):
            if p.required or i < last_required:  # no default before a required parameter
                args.append(p.name)
            else:
                self.ns[f"_d{i}"] = p.default
                args.append(f"{p.name}=_d{i}")
        self.emit(f"def {fname}({', '.join(args)}):")
        self.emit("    try:")

    def flat(self, names: list[str]) -> str:
        return "(" + "".join(f"*{n}, " if n in self.lists else f"{n}, " for n in names) + ")"

    def hooks(self, stage: str, hooks: Hooks) -> None:
        """Calls of the hooks of a stage (``pre``, ``check``), a :class:`Let`'s value bound to its name."""
        for k, h in enumerate((hooks,) if callable(hooks) or isinstance(hooks, Let) else hooks):
            fn = h.fn if isinstance(h, Let) else h
            if not callable(fn):
                raise TypeError(f"{self.op}: a {stage} hook is a function, got {fn!r}")
            got = self.hook(fn, f"_{stage}{k}")
            if isinstance(h, Let):
                n = h.name
                if not n.isidentifier() or keyword.iskeyword(n) or n.startswith("_") or n in self.bound or n in self.ns:
                    raise ValueError(f"{self.op}: Let name {n!r} is taken or cannot be generated")
                self.bound.append(n)
                got = f"{n} = {got}"
            self.emit(f"        {got}")

    def hook(self, fn: Callable[..., Any], var: str) -> str:
        """A call of hook ``fn`` over the bound names (a ``functools.partial``: its function called
        with the bound values first, no partial object per call)."""
        if not callable(fn):
            raise TypeError(f"{self.op}: a {var[1:]} hook is a function, got {fn!r}")
        args = _hook_args(self.op, fn, self.bound)
        if isinstance(fn, functools.partial) and not fn.keywords:  # its function called, the bound values first
            bound = []
            for i, v in enumerate(fn.args):
                self.ns[f"{var}_{i}"] = v
                bound.append(f"{var}_{i}")
            fn, args = fn.func, ", ".join([*bound, *([args] if args else [])])
        self.ns[var] = fn
        return f"{var}({args})"

    def condition(self, post_if: Callable[..., Any] | PartialIn | None) -> str:
        """The generated test of ``post_if`` ("" for none)."""
        if post_if is None:
            return ""
        if not isinstance(post_if, PartialIn):
            return self.hook(post_if, "_post_if")
        for n in post_if.tensors:
            if self.kinds.get(n) != "T":
                raise ValueError(f"{self.op}: PartialIn {n!r} is not a required tensor parameter")
        return "(" + " or ".join(f"{n}.dist_attr.partial" for n in post_if.tensors) + ")"

    def mesh(self) -> None:
        """The non-empty lists, the ``pre`` hooks, then the one mesh: the first required tensor's
        (every tensor on it; the message names both)."""
        way, lists, kinds, tensors = self.way, self.lists, self.kinds, self.tensors
        if way.nonempty:
            for n in way.nonempty:
                if n not in lists:
                    raise ValueError(f"{self.op}: nonempty {n!r} is not a list parameter")
            if len(way.nonempty) == 1 and kinds[way.nonempty[0]] == "[T]":
                cond, what = f"not {way.nonempty[0]}", f"{way.nonempty[0]} must hold at least one tensor"
            else:
                cond = f"all(t is None for t in {self.flat(list(way.nonempty))})"
                what = f"{' and '.join(way.nonempty)} hold no tensor, so no mesh"
            self.emit(f"        if {cond}: raise _IAE({what!r})")
        self.hooks("pre", way.pre)
        first = next((n for n in tensors if kinds[n] == "T"), None)
        if lists:  # a loop over the lists' items
            self.emit(f"        _mesh = _list_mesh(_OP, ({''.join(f'({n!r}, {n}, {n in lists}), ' for n in tensors)}))")
            return
        if first is None:
            self.emit(f"        _mesh = _named_mesh(_OP, ({''.join(f'({n!r}, {n}), ' for n in tensors)}))")
            return
        self.emit(f"        _mesh = {first}.dist_attr.mesh")
        pairs = "".join(f"({n!r}, {n}), " for n in tensors)
        for n in tensors:
            if n == first:
                continue
            ind = "        "
            if kinds[n] == "T?":
                self.emit(f"        if {n} is not None:")
                ind += "    "
            self.emit(f"{ind}_m = {n}.dist_attr.mesh")
            self.emit(f"{ind}if _m is not _mesh and _m != _mesh: _named_mesh(_OP, ({pairs}))")

    def checks(self) -> None:
        """``require``, ``shapes``, the ``check`` hooks, then the same-shape pairs."""
        way, kinds = self.way, self.kinds
        self.lines += require_lines(way.require, self.pnames, "        ")
        self.lines += shape_lines(self.op, way.shapes, kinds, "        ")
        self.hooks("check", way.check)
        for a, b in way.same:
            cond = f"{a}.shape != {b}.shape"
            if kinds[a] == "T?":
                cond = f"{a} is not None and {cond}"
            if kinds[b] == "T?":
                cond = f"{b} is not None and {cond}"
            self.emit(f"        if {cond}: _same(_OP, {a!r}, {a}, {b!r}, {b})")

    def key(self) -> None:
        """The key (``Way.key``; the masks last) and its plan, from the table or compiled."""
        way, tensors, kinds = self.way, self.tensors, self.kinds

        def rank(n: str) -> str:
            if n in self.lists:
                return f"tuple([-1 if t is None else len(t.shape) for t in {n}])"
            return f"len({n}.shape)" if kinds[n] == "T" else f"(-1 if {n} is None else len({n}.shape))"

        def fast_ones(item: str) -> str:
            """``ones(t)`` of a tensor parameter inlined: no call where t has no size-1 axis."""
            n = item[5:-1].strip() if item.startswith("ones(") and item.endswith(")") else ""
            if n not in tensors:
                return ""
            if kinds[n] == "T?":
                return f"(_ones({n}) if {n} is not None and 1 in {n}.shape else 0)"
            return f"(_ones({n}) if 1 in {n}.shape else 0)"

        if callable(way.key):
            self.ns["_key"] = way.key
            key_items = [f"*_key({self.call})"]
        else:
            items = _split(way.key) if way.key.strip() else list(tensors)
            key_items = [rank(k) if k in tensors else k if k.startswith("*") else fast_ones(k) or f"({k})"
                         for k in items]  # fmt: skip
        if way.mask:
            masks = "".join((fast_ones(f"ones({n})") if n in way.mask else "0") + ", " for n in self.masked)
            key_items.append(f"({masks})")
        if len(key_items) == 1 and key_items[0].startswith("*"):
            self.emit(f"        _k = {key_items[0][1:]}")  # the expression gives the whole key (a tuple)
        else:
            self.emit(f"        _k = ({''.join(k + ', ' for k in key_items)})")
        self.emit("        _p = _P.get(_k)")
        self.emit("        if _p is None: _p = _miss(_k)")

    def group(self, var: str, names: list[str]) -> str:
        """The flat answer ``var`` regrouped: a list parameter's attrs as one tuple."""
        items, off = [], "0"
        for n in names:
            if n in self.lists:
                end = f"{off} + len({n})"
                items.append(f"{var}[{off}:{end}]")
                off = end
            else:
                items.append(f"{var}[{off}]")
                off = f"{off} + 1"
        return "(" + "".join(i + ", " for i in items) + ")"

    def answer(self, outputs: Sequence[str]) -> None:
        """The per-call letter check, then the engine's answer (``tail``, lists, ``post``, ``order``)."""
        way, lists = self.way, self.lists
        tin, tout = self.flat(self.ins), self.flat(self.outs)
        shapes = f", out_shapes={self.hook(way.out_shapes, '_out_shapes')}" if way.out_shapes and not self.outs else ""
        if isinstance(way.tail, int) and way.tail:
            tin = tin[:-1] + "None, " * way.tail + ")"
        if lists:  # the tensors' names, a list's items as x[0], x[1], ...
            nm = "".join(f"({n!r}, len({n})), " if n in lists else f"({n!r}, -1), " for n in self.tensors)
            self.emit(f"        _names = _list_names(({nm}))")
        names = "_names" if lists else "_NAMES"
        if way.letters:
            if self.direction == "forward":
                self.emit(f"        _letters(_OP, _p.notation.inputs, {tin}, {names})")
            else:
                self.emit(f"        _letters(_OP, _p.notation.inputs + _p.notation.outputs, {tin} + {tout}, {names})")
        post_if = self.condition(way.post_if)
        if way.tail:
            self._tail_answer(outputs, tin, names, shapes)
        elif lists:
            self.emit(f"        _i, _o = _infer(_p, _OP, {tin}, {tout}, _mesh, {names}{shapes})")
            grouped = self.group("_o", self.outs) if any(n in lists for n in self.outs) else "_o"
            self.emit(f"        _r = {self.group('_i', self.ins)}, {grouped}")
            if way.post is not None:
                if post_if:
                    self.emit(f"        if not {post_if}: return _result(*_r)")
                self.emit(f"        _r = _post(*_r, {self.call})")
                self.emit("        return _result(tuple(_r[0]), tuple(_r[1]))")
            else:
                self.emit("        return _result(*_r)")
        elif way.post is not None or self.permuted:
            # the answer in the signature's order (``order``: the notation's is another)
            back = "tuple(_r[0]), tuple(_r[1])"
            if self.permuted:
                ins, outs = self.ins, self.outs
                back = "".join(f"_r[0][{ins.index(n)}], " for n in self.sig_ins)
                outs_back = f"({''.join(f'_r[1][{outs.index(n)}], ' for n in self.sig_outs)})" if outs else "tuple(_r[1])"
                back = f"({back}), {outs_back}"  # a forward rule's outputs: the notation's, as they are
            self.emit(f"        _r = _infer(_p, _OP, {tin}, {tout}, _mesh, _NAMES{shapes})")
            if post_if:
                self.emit(f"        if not {post_if}: return _result({back if self.permuted else '*_r'})")
            if way.post is not None:
                self.emit(f"        _r = _post(*_r, {self.call})")
            self.emit(f"        return _result({back})")
        else:
            self.emit(f"        return _result(*_infer(_p, _OP, {tin}, {tout}, _mesh, _NAMES{shapes}))")
        self.emit("    except _E as _e:")
        self.emit("        raise _renamed(_e, _OP) from None")

    def _tail_answer(self, outputs: Sequence[str], tin: str, names: str, shapes: str) -> None:
        """``tail``: every tensor an input of the notation; the answer cut where the tail starts."""
        way, ins = self.way, self.ins
        given = set(outputs) if self.direction == "backward" else set()  # a reverse rule's outputs: not answered
        before = ins[: ins.index(way.tail)] if isinstance(way.tail, str) else [n for n in ins if n not in given]
        cut = f"len({self.flat(before)})" if self.lists else str(len(before))
        start = cut if isinstance(way.tail, str) else f"-{way.tail}"
        self.emit(f"        _i, _o = _infer(_p, _OP, {tin}, (), _mesh, {names}{shapes})")
        if way.post is None:
            self.emit(f"        return _result(_i[:{cut}], _i[{start}:] + _o)")
        else:
            self.emit(f"        _r = _post(_i[:{cut}], _i[{start}:] + _o, {self.call})")
            self.emit("        return _result(tuple(_r[0]), tuple(_r[1]))")


def _plan_table(op: str, way: Way, direction: str) -> tuple[dict[tuple[Any, ...], RulePlan], Any, Any]:
    """A mode's table of compiled plans by key, the function compiling a key's plan into it
    (``_miss`` of the generated code), and ``plan(key)`` (errors naming the op)."""
    plans: dict[tuple[Any, ...], RulePlan] = {}
    notation = way.notation
    has_mask = bool(way.mask)
    cdir = "forward" if way.tail else direction

    def miss(k: tuple[Any, ...]) -> RulePlan:
        """The plan of key ``k``, compiled and kept (its notation's errors raised as they come)."""
        nt = notation(*k)
        mask = k[-1] + (0,) * (len(nt.inputs) - len(k[-1])) if has_mask else ()  # every input's
        p = compile_plan(nt, cdir, mask)
        if len(plans) >= PLAN_LIMIT:
            plans.clear()
        plans[k] = p
        return p

    def plan(k: tuple[Any, ...]) -> RulePlan:
        """The compiled plan of key ``k`` (errors name the op)."""
        try:
            return plans.get(k) or miss(tuple(k))
        except SpmdError as e:
            raise renamed(e, op) from None

    return plans, miss, plan


def generate(
    op: str,
    signature: str,
    way: Way,
    direction: str = "forward",
    outputs: Sequence[str] = (),
    name: str = "",
    module: str = "",
) -> Callable[..., SpmdResult]:
    """The rule function of one mode: ``signature`` its parameters (Paddle's order), ``direction``
    ``"forward"`` (forward and grad rules: every tensor an input of the notation) or
    ``"backward"`` (a reverse rule: the tensors named in ``outputs`` are the notation's
    outputs, merged; the others its inputs). A list parameter (``[T]``, ``[T?]``) stands for its
    items, in order, among the notation's tensors: a bare name in the key is the tuple of their
    ranks, errors name them ``x[0]``, ``x[1]``, ..., and the answer holds their attrs as one
    tuple (as Paddle's). The function has the signature's parameter names
    and defaults (a default before a required parameter, as in a reverse signature with an
    optional tensor before the outputs, is left out: the registry passes every argument), and a
    ``plan(key)`` attribute giving the compiled plan of a key (``way.wrap``
    applied, where declared); ``module``: the declaring module (default: the caller's)."""
    src = _Source(op, signature, way, direction, outputs, name)
    src.mesh()
    src.checks()
    src.key()
    src.answer(outputs)
    plans, miss, plan = _plan_table(op, way, direction)
    src.ns["_P"] = plans
    src.ns["_miss"] = miss
    text = "\n".join(src.lines) + "\n"
    fn: Any = define(text, f"rule {op} {direction}", name or op, src.ns)
    fn.__doc__ = way.doc or None
    fn.__qualname__ = fn.__name__
    fn.__module__ = module or sys._getframe(1).f_globals.get("__name__", "")  # the declaring module
    fn.plan = plan
    fn.source = text
    fn.way = way
    if way.wrap is not None:
        return way.wrap(fn, signature, src.sig_outs)
    return fn  # type: ignore[no-any-return]


def declare(
    name: str, signature: str, forward: Way, *, reverse: Way | None = None, outputs: str = "",
    grad: Way | None = None, grad_signature: str = "", grad_op: str = "", **kw: Any,
) -> Any:  # fmt: skip
    """Register rule ``name`` (Paddle's ``signature``) with the functions :func:`generate`
    makes from its ways: ``forward``; in the backward slot either ``reverse`` (Paddle's reverse
    rule, with the op's ``outputs``, e.g. ``"out: T"``; its signature is derived by the
    registry: the forward's tensors, the outputs, the forward's attributes) or ``grad`` (a grad
    rule in that place, with its own ``grad_signature``; ``grad_name=`` registers it as a rule
    of its own too; ``grad_op``: the op its errors name, where not ``grad_name`` or
    ``name + "_grad"``: c_embedding's grad slot names ``c_embedding``).
    A reverse or grad signature may hold an optional tensor before a required one (see
    :func:`generate`). ``kw``: the registry's ``aliases``, ``doc``, ``grad_name``,
    ``grad_aliases``. Returns the registered :class:`~spmdkit.engine.registry.Rule`."""
    if reverse is not None and grad is not None:
        raise ValueError(f"rule {name!r}: the backward slot holds a reverse rule or a grad rule, not both")
    # direction / outputs: a backward slot's (generate checks the direction's value)
    if forward.direction or forward.outputs:
        raise ValueError(f"rule {name!r}: Way(direction=, outputs=) is for a backward slot, not the forward rule")
    for w in (reverse, grad):
        if w is not None and w.outputs and not (w is grad and w.direction == "backward"):
            raise ValueError(f"rule {name!r}: Way(outputs=...) names a grad rule's outputs, with direction='backward'")
    if grad_op and grad is None:
        raise ValueError(f"rule {name!r}: grad_op {grad_op!r} without a grad rule")
    module = sys._getframe(1).f_globals.get("__name__", "")  # the rule module declaring it
    fwd = generate(name, signature, forward, "forward", name=f"{name}_forward", module=module)
    if reverse is not None:
        out_names = [p.name for p in parse_signature(outputs)] if outputs.strip() else []
        bwd = generate(name, reverse_signature(signature, outputs), reverse, reverse.direction or "backward", out_names,
                       name=f"{name}_backward", module=module)  # fmt: skip
        return register(name, fwd, signature, bwd, kind=REVERSE, outputs=outputs, forward_name=forward.paddle,
                        backward_name=reverse.paddle, **kw)  # fmt: skip
    if grad is not None:
        fname = kw.get("grad_name") or f"{name}_grad"
        g = generate(grad_op or fname, grad_signature, grad, grad.direction or "forward", grad.outputs, name=fname,
                     module=module)
        return register(name, fwd, signature, g, grad_signature, kind=GRAD, forward_name=forward.paddle,
                        backward_name=grad.paddle, **kw)  # fmt: skip
    return register(name, fwd, signature, forward_name=forward.paddle, **kw)


__all__ = ["PLAN_LIMIT", "Answer", "Hooks", "Let", "PartialIn", "Way", "declare", "generate", "ones", "renamed", "same_shape"]
