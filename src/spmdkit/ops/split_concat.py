"""split, split_with_num, unbind, concat, stack and their grads.

* ``split(x, sections, axis)`` / ``split_with_num(x, num, axis)``: ``abc -> abc, abc, ...``, the
  split axis ``b`` replicated (a piece is a range of it), partial cleared (as in Paddle). Reverse
  rules merge the pieces per axis; where two shard one axis over different mesh dims the larger
  piece wins (Paddle raises, DESIGN class 8); a mesh dim two axes want stays with the first to
  claim it, the split axis included, which x then has replicated.
* ``unbind(x, axis)``: ``abc -> ac, ac, ...``: the unbound axis replicated, then dropped.
* ``concat(x, axis)`` / ``stack(x, axis)``: ``abc, abc, ... -> abc`` (stack: ``-> ab1c``)
  under Paddle's per-mesh-dim alignment (the engine's ``conflict=Conflict.ALIGN``): a mesh dim on
  which every input agrees keeps its placement (a shard on a kept axis, or a SUM / AVG
  partial); a mesh dim on which they disagree goes to the kept axis of least resharding cost
  (an axis smaller than the mesh dim is never chosen). The concat axis is replicated; stack's
  new axis is replicated in the output. Partial status is kept on the inputs *and* the output
  (the op is linear); Paddle drops it on concat's output (unsound, DESIGN class 6).
  The reverse rules take the output's sharding, the joined axis replicated, for every input,
  and return the output those inputs produce (Paddle returns the requested output, DESIGN 4).
  A tensor of shape ``[0]`` among inputs of rank 2 or more is Paddle's placeholder for an empty
  tensor: it takes no part and is answered replicated.
* grads: ``split_grad(out_grad, axis)`` / ``split_with_num_grad`` = concat of the out_grads,
  ``unbind_grad(out_grad, axis)`` = stack, ``concat_grad(x, output_grad, axis)`` aligns x and
  output_grad as concat does (x_grad pieces sharded as x), ``stack_grad(output_grad, axis)``
  replicates the stacked axis and gives every x_grad the rest.

Output count bound: where the number of outputs comes from a size (sections, num, unbind's
and stack_grad's axis size) more than :data:`MAX_OUTPUTS` (4096) are refused before any work
(InvalidAttributeError for num / sections, ShapeMismatchError for a size): Paddle has no such
bound, but millions of identical dist attrs are never what a program needs.

Deviations from Paddle 3.3.1 (docs/deviations.md): concat-reverse-out, stack-reverse-out,
concat-partial-input, unbind-partial-input (Paddle keeps x partial, the slices not),
split-reverse-conflict.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, cast

from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.axes import replicated
from spmdkit.engine.declare import Way, declare
from spmdkit.engine.facts import facts
from spmdkit.engine.notation import Conflict, Coshard, Notation, PartialMerge, letters_for
from spmdkit.engine.outshape import Args, Expect, UnknownShape, axis_of, broadcast
from spmdkit.engine.shapes import mismatch
from spmdkit.ops._cost import copy

T = DistTensorSpec
#: The most outputs a split / unbind / stack_grad answers (see the module docstring).
MAX_OUTPUTS = 4096


def _axis(axis: int, ndim: int, extra: int = 0, name: str = "x") -> int:
    """``axis`` of an ``ndim``-D tensor (``extra``: stack's new axis counts) made non-negative."""
    n = ndim + extra
    if n == 0:
        raise ShapeMismatchError(f"{name} is 0-d; there is no axis {axis} to act on")
    if -n <= axis < n:
        return axis + n if axis < 0 else axis
    raise InvalidAttributeError(f"axis {axis} is out of range [{-n}, {n}) for a {ndim}-D tensor")


def pieces(drop: bool, grad: bool, ndim: int, axis: int) -> Notation:
    """``abc -> abc`` (split) or ``abc -> ac`` (drop: unbind), ``b`` replicated, a co-shard read as
    its largest mesh dim; stack_grad (``grad``) keeps co-shards and partial status (linear)."""
    x = letters_for(ndim)
    return Notation([x], [x[:axis] + x[axis + 1:] if drop else x], x[axis],
                    coshard=Coshard.KEEP if grad else Coshard.LARGEST,
                    partial=PartialMerge.KEEP if grad else PartialMerge.REPLICATE)


def rejoin(drop: bool, n: int, ndim: int, axis: int) -> Notation:
    """x (``a1c``) from its n pieces (``abc``; unbind: ``ac``), compiled backward: the split axis
    ``b`` claims a mesh dim first wanted there, and shards nothing (no input carries it)."""
    x = letters_for(ndim)
    return Notation([x.replace(x[axis], "1")], [x.replace(x[axis], "") if drop else x] * n, coshard=Coshard.LARGEST)


def join(stack: bool, grad: bool, n: int, ndim: int, axis: int, empty: int) -> Notation:
    """``abc, abc, ... -> abc`` (concat, ``b`` replicated) or ``-> ab1c`` (stack); concat_grad
    (``grad``) merges output_grad too. ``empty``: a bit per placeholder input (None)."""
    x = letters_for(ndim)
    xs = [None if (empty >> i) & 1 else x for i in range(n)]
    out = x[:axis] + "1" + x[axis:] if stack else x
    return Notation([*xs, x] if grad else xs, xs if grad else [out], "" if stack else x[axis], conflict=Conflict.ALIGN,
                    partial=PartialMerge.LINEAR if ndim else PartialMerge.REPLICATE)


def unjoin(stack: bool, n: int, ndim: int, axis: int, empty: int) -> Notation:
    """concat's (stack's) inputs ``abc`` (``ac``) from the output ``abc``, ``b`` replicated, a
    co-shard read as its largest mesh dim. Compiled forward, the merge reading the output alone
    (``sources``): where every input is a placeholder it keeps its letters (backward drops them)."""
    x = letters_for(ndim)
    xs = [None if (empty >> i) & 1 else x[:axis] + x[axis + 1:] if stack else x for i in range(n)]
    return Notation([*xs, x], [], x[axis], coshard=Coshard.LARGEST, sources=(n,))


def _alike(ts: Sequence[T], f: Sequence[int], ndim: int, axis: int, drop: bool) -> bool:
    """Every tensor of ``ts`` has rank ``ndim`` and ``f``'s sizes off ``axis`` (``drop``: ``f`` has
    the axis, they do not): the common case, checked before the checks that name what is wrong."""
    head, tail = f[:axis], f[axis + 1:]
    for t in ts:
        s = t.shape
        if len(s) != ndim or s[:axis] != head or s[axis + 1 - drop:] != tail:
            return False
    return True


def _like(name: str, s: Sequence[int], rname: str, ref: Sequence[int], skip: int | None) -> None:
    """``s`` has ``ref``'s rank and its sizes off axis ``skip`` (unknown sizes, -1, match any)."""
    j = mismatch(ref, s, () if skip is None else (skip,))
    if j == -1:
        raise ShapeMismatchError(f"{name} has {len(s)} dims, {rname} {len(ref)}")
    if j is not None:
        raise ShapeMismatchError(f"{name} has size {s[j]} on axis {j}, {rname} has {ref[j]}")


def _sections(x: T, sections: tuple[int, ...], axis: int) -> int:
    """split's axis, the sections checked against the axis size."""
    ax = _axis(axis, len(x.shape))
    size, known = x.shape[ax], sum(s for s in sections if s != -1)
    if not 0 < len(sections) <= MAX_OUTPUTS:
        raise InvalidAttributeError(f"sections has {len(sections)} entries; 1 to {MAX_OUTPUTS} outputs are answered")
    if any(s < -1 for s in sections) or sections.count(-1) > 1:
        raise InvalidAttributeError(f"sections {list(sections)} may hold sizes >= 0 and at most one -1")
    if size >= 0 and ((-1 not in sections and known != size) or known > size):
        raise InvalidAttributeError(f"sections {list(sections)} do not add up to the axis size {size}")
    return ax


def _num(x: T, num: int, axis: int) -> int:
    """split_with_num's axis, num checked."""
    ax = _axis(axis, len(x.shape))
    if not 0 < num <= MAX_OUTPUTS:
        raise InvalidAttributeError(f"num {num} must be positive; at most {MAX_OUTPUTS} outputs are answered")
    if x.shape[ax] >= 0 and x.shape[ax] % num:
        raise InvalidAttributeError(f"num {num} does not divide the axis size {x.shape[ax]}")
    return ax


def _slices(x: T, axis: int, name: str = "x", what: str = "outputs") -> int:
    """unbind's (stack_grad's) axis, its size (the slice count) checked."""
    ax = _axis(axis, len(x.shape))
    n = x.shape[ax]
    if n < 0:
        raise ShapeMismatchError(f"the size of axis {axis} of {name} is unknown, so is the number of {what}")
    if n > MAX_OUTPUTS:
        raise ShapeMismatchError(f"{name}'s axis {axis} (size {n}) asks for {n} outputs; at most {MAX_OUTPUTS} "
                                 "are answered")
    return ax


def _pieces_key(x: T, out: Sequence[T], axis: int, n: int, drop: bool) -> tuple[int, int, int]:
    """The reverse key (n, rank, axis) of a split-like op, the n pieces checked against x."""
    if len(out) != n:
        raise ShapeMismatchError(f"out has {len(out)} tensors, the op makes {n}")
    xs = x.shape
    if not _alike(out, xs, len(xs) - drop, axis, drop):
        for i, o in enumerate(out):
            _like(f"out[{i}]", o.shape, "x", xs[:axis] + xs[axis + 1:] if drop else xs, None if drop else axis)
    return n, len(xs), axis


def _check_join(name: str, xs: Sequence[T], axis: int | None) -> None:
    """Sizes must agree off ``axis`` among the tensors other than placeholders."""
    if not xs:
        raise ShapeMismatchError(f"{name} is an empty list")
    ndim = max(len(t.shape) for t in xs)
    real = [(i, t.shape) for i, t in enumerate(xs) if ndim < 2 or t.shape != (0,)]
    for i, s in real:
        _like(f"{name}[{i}]", s, f"{name}[{real[0][0]}]", real[0][1], axis)


def _placeholders(name: str, ts: Sequence[T], ndim: int, want: int, allow: bool, other: str) -> int:
    """A bit per placeholder of ``ts`` (where ``allow``ed), the others checked to be ``want``-D."""
    empty = 0
    for i, t in enumerate(ts):
        if allow and ndim > 1 and t.shape == (0,):
            empty |= 1 << i
        elif len(t.shape) != want:
            raise ShapeMismatchError(f"{name}[{i}] has {len(t.shape)} dims, expected {want} ({other} has {ndim})")
    return empty


def _join_key(stack: bool, name: str, xs: Sequence[T], axis: int, og: T | None = None) -> tuple[int, int, int, int]:
    """(n, rank, axis, placeholder bits) of a concat / stack of ``xs`` (concat_grad: with output_grad ``og``)."""
    ndim = max(len(t.shape) for t in xs) if og is None else len(og.shape)
    ax = _axis(axis, ndim, stack)
    every = xs if og is None else (*xs, og)
    if _alike(every, every[0].shape, ndim, ndim if stack else ax, False):  # (stack: every shape alike)
        return len(xs), ndim, ax, 0
    _check_join(name, every, None if stack else ax)
    return len(xs), ndim, ax, _placeholders(name, xs, ndim, ndim, True, "output_grad")


def _unjoin_key(stack: bool, x: Sequence[T], output: T, axis: int) -> tuple[int, int, int, int]:
    """(n, rank, axis, placeholder bits) of concat's / stack's reverse rule: x against the output."""
    ndim = len(output.shape)
    ax = _axis(axis, ndim, 0, "output")
    if x and _alike(x, output.shape, ndim - stack, ax, stack) and (not stack or output.shape[ax] in (len(x), -1)):
        return len(x), ndim, ax, 0
    _check_join("x", x, None if stack else ax)
    empty = _placeholders("x", x, ndim, ndim - stack, not stack, "output")
    if stack and output.shape[ax] >= 0 and output.shape[ax] != len(x):
        raise ShapeMismatchError(f"output has size {output.shape[ax]} on axis {ax}, x has {len(x)} tensors")
    return len(x), ndim, ax, empty


def _fill(attrs: Sequence[Any], specs: Sequence[T]) -> Any:
    """The attrs, a placeholder's (None) replicated."""
    for a in attrs:
        if a is None:
            return tuple(replicated(t.dist_attr.mesh, len(t.shape)) if b is None else b for t, b in zip(specs, attrs))
    return attrs


def _filled(ins: Any, outs: Any, x: Sequence[T], *args: Any) -> Any:
    """Placeholders replicated; a reverse rule (compiled forward, no outputs): the output its inputs produce."""
    xs = _fill(ins[0], x)
    return ((xs,), outs) if len(ins) == 1 else ((xs,), (ins[1],))


# -- the declarations -------------------------------------------------------------------------

# name, its axis checked, piece count, attributes, unbind-like (the axis dropped), Paddle's stem, the
# post-hook (every piece the one piece's attr), doc
for _name, _count, _n, _attrs, _drop, _stem, _post, _doc in (
    ("split", _sections, "len(sections)", "sections: ints", False, "Split",
     lambda i, o, x, sections, axis: (i, ((o[0],) * len(sections),)),
     "Each piece is sharded as x, the split axis replicated."),
    ("split_with_num", _num, "num", "num: int", False, "SplitWithNum",
     lambda i, o, x, num, axis: (i, ((o[0],) * num,)),
     "Each of the num pieces is sharded as x, the split axis replicated."),
    ("unbind", _slices, "x.shape[axis]", "", True, "Unbind", lambda i, o, x, axis: (i, ((o[0],) * x.shape[axis],)),
     "Each slice is x's sharding without the unbound axis (which is replicated)."),
):
    _a = "".join(a.split(":")[0] + ", " for a in _attrs.split(", ") if a)  # the attributes' names
    _env = {"_count": _count, "_rev": _pieces_key}
    declare(
        _name, f"x: T, {_attrs + ', ' if _attrs else ''}axis: int = 0",
        Way(partial(pieces, _drop, False), key=f"x, _count(x, {_a}axis)", env=_env, post=cast(Any, _post),
            paddle=f"{_stem}InferSpmd", doc=_doc),
        reverse=Way(partial(rejoin, _drop), key=f"*_rev(x, out, _count(x, {_a}axis), {_n}, {_drop})", env=_env,
                    paddle=f"{_stem}InferSpmdReverse", doc=f"{_name}: x from its pieces (the larger wins a conflict)."),
        outputs="out: [T]", doc=_doc,
    )  # fmt: skip
# concat / stack: the reverse rule is compiled forward (see ``unjoin``), so generated here and registered
for _name, _stack, _doc in (
    ("concat", False, "Align the inputs mesh dim by mesh dim; the concat axis replicated; partial kept."),
    ("stack", True, "Align the inputs mesh dim by mesh dim; the new axis replicated in the output."),
):
    _sig, _stem = "x: [T], axis: int = 0", _name.capitalize()
    _fwd = Way(partial(join, _stack, False), key=partial(_join_key, _stack, "x"), post=_filled,
               paddle=f"{_stem}InferSpmd", doc=_doc)
    _rev = Way(partial(unjoin, _stack), key=partial(_unjoin_key, _stack), post=_filled, direction="forward",
               paddle=f"{_stem}InferSpmdReverse",
               doc=f"{_name}: every input sharded as the output, the joined axis replicated; the output is the one "
                   "those inputs produce.")  # fmt: skip
    declare(_name, _sig, _fwd, reverse=_rev, outputs="output: T", doc=_doc)
# the grads of split / unbind join their out_grads as concat / stack do
for _name, _stack, _doc in (("split_grad", False, "x_grad = concat(out_grad, axis)."),
                            ("split_with_num_grad", False, "x_grad = concat(out_grad, axis)."),
                            ("unbind_grad", True, "input_grad = stack(out_grad, axis).")):
    declare(_name, f"out_grad: [T], axis: int = {0 if _stack else -1}",
            Way(partial(join, _stack, False), key=partial(_join_key, _stack, "out_grad"), post=_filled, doc=_doc))
declare("concat_grad", "x: [T], output_grad: T, axis: int = 0",
        Way(partial(join, False, True), key=lambda x, og, axis: _join_key(False, "x", x, axis, og),
            post=lambda i, o, x, *a: ((_fill(i[0], x), i[1]), (_fill(o, x),)), paddle="ConcatGradInferSpmdDynamic",
            doc="x and output_grad aligned as concat aligns its inputs; each x_grad sharded as its x."))
declare("stack_grad", "output_grad: T, axis: int = 0",
        Way(partial(pieces, True, True), key="output_grad, _slices(output_grad, axis, 'output_grad', 'x_grad')",
            env={"_slices": _slices}, post=lambda i, o, og, axis: (i, ((o[0],) * og.shape[axis],)),
            paddle="StackGradInferSpmd", doc="The stacked axis replicated; each x_grad gets the other axes' sharding."))


# -- output shapes / grads ----------------------------------------------------------------------


def _concat_of(items: Sequence[tuple[int, ...] | None], ax_attr: Any) -> list[Expect]:
    """The concatenation of the present ``items`` along the axis ``ax_attr``."""
    xs = [s for s in items if s is not None]
    if not xs:
        raise UnknownShape
    nd = len(xs[0])
    ax = axis_of(ax_attr, nd)
    if any(len(s) != nd for s in xs):
        raise UnknownShape
    out = list(xs[0])
    out[ax] = sum(s[ax] for s in xs)
    return [tuple(out)]


def _stack_of(items: Sequence[tuple[int, ...] | None], ax_attr: Any) -> list[Expect]:
    """The present ``items`` (of one shape) stacked on a new axis ``ax_attr``."""
    xs = [s for s in items if s is not None]
    if not xs:
        raise UnknownShape
    s = broadcast(*xs) if len({len(x) for x in xs}) == 1 else None
    if s is None or any(x != s for x in xs):
        raise UnknownShape
    ax = axis_of(ax_attr, len(s) + 1)
    return [(*s[:ax], len(xs), *s[ax:])]


def _unbind_of(x: tuple[int, ...], ax_attr: Any) -> list[Expect]:
    """The slices of ``x`` along the axis ``ax_attr``."""
    ax = axis_of(ax_attr, len(x))
    return [[x[:ax] + x[ax + 1:] for _ in range(x[ax])]]


def _split_shape(a: Args) -> list[Expect]:
    x = a.s("x")
    ax = axis_of(a.a("axis", 0), len(x))
    secs = list(a.a("sections", ()))
    if secs.count(-1) > 1:
        raise UnknownShape
    if -1 in secs:
        secs[secs.index(-1)] = x[ax] - sum(v for v in secs if v != -1)
    return [[(*x[:ax], v, *x[ax + 1:]) for v in secs]]


def _split_with_num_shape(a: Args) -> list[Expect]:
    x = a.s("x")
    ax = axis_of(a.a("axis", 0), len(x))
    num = a.a("num")
    if not isinstance(num, int) or num <= 0 or x[ax] % num:
        raise UnknownShape
    return [[(*x[:ax], x[ax] // num, *x[ax + 1:]) for _ in range(num)]]


def _concat_shape(a: Args) -> list[Expect]:
    return _concat_of(a.vec("x"), a.a("axis", 0))


def _stack_shape(a: Args) -> list[Expect]:
    return _stack_of(a.vec("x"), a.a("axis", 0))


def _unbind_shape(a: Args) -> list[Expect]:
    return _unbind_of(a.s("x"), a.a("axis", 0))


def _split_grad_shape(a: Args) -> list[Expect]:
    """x_grad: the out_grads concatenated."""
    return _concat_of(a.vec("out_grad"), a.a("axis", -1))


def _unbind_grad_shape(a: Args) -> list[Expect]:
    """x_grad: the out_grads stacked."""
    return _stack_of(a.vec("out_grad"), a.a("axis", 0))


def _stack_grad_shape(a: Args) -> list[Expect]:
    """x_grad: output_grad's slices."""
    return _unbind_of(a.s("output_grad"), a.a("axis", 0))


facts("split", shape=_split_shape)
facts("split_with_num", shape=_split_with_num_shape)
facts("unbind", shape=_unbind_shape)
facts("concat", shape=_concat_shape)
facts("stack", shape=_stack_shape)
facts("split_grad", "split_with_num_grad", shape=_split_grad_shape)
facts("unbind_grad", shape=_unbind_grad_shape)
facts("stack_grad", shape=_stack_grad_shape)
for _name in ("split", "split_with_num", "unbind", "concat", "stack"):  # autodiff: a list of gradients
    facts(_name, grad=f"{_name}_grad", wrt=("x",))


# -- cost

facts("concat", "concat_grad", "split", "split_grad", "split_with_num", "split_with_num_grad", "stack",
      "stack_grad", "unbind", "unbind_grad", cost=copy)
