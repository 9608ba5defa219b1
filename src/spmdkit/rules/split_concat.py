"""split, split_with_num, unbind, concat, stack and their grads.

Vector outputs (split, unbind, concat_grad, stack_grad) are one tuple of dist attrs in
``outputs``; vector inputs (concat, stack, the grads' out_grad lists) one tuple in ``inputs``.

* ``split(x, sections, axis)`` / ``split_with_num(x, num, axis)``: notation ``abc -> abc, abc,
  ...`` with the split axis ``b`` replicated (every piece is a contiguous range of it); every
  other axis keeps x's sharding, partial status is cleared (as in Paddle). The reverse rules
  merge the pieces' shardings axis by axis; where two pieces shard one axis over different
  mesh dims the larger piece wins (Paddle raises, DESIGN class 8); a mesh dim two axes want
  stays with the first to claim it, the split axis included, which x then has replicated.
* ``unbind(x, axis)``: ``abc -> ac, ac, ...``: the unbound axis replicated, then dropped.
* ``concat(x, axis)`` / ``stack(x, axis)``: ``abc, abc, ... -> abc`` (stack: ``-> ab1c``)
  under Paddle's per-mesh-dim alignment (the engine's ``conflict="align"``): a mesh dim on
  which every input agrees keeps its placement (a shard on a kept axis, or a SUM / AVG
  partial); a mesh dim on which they disagree goes to the kept axis of least resharding cost
  (an axis smaller than the mesh dim is never chosen). The concat axis is replicated; stack's
  new axis is replicated in the output. Partial status is kept on the inputs *and* the output
  (the op is linear); Paddle drops it on concat's output (unsound, DESIGN class 6).
  The reverse rules take the output's sharding, the joined axis replicated, for every input,
  and return the output those inputs produce (Paddle returns the requested output, DESIGN 4).
* grads: ``split_grad(out_grad, axis)`` / ``split_with_num_grad`` = concat of the out_grads,
  ``unbind_grad(out_grad, axis)`` = stack, ``concat_grad(x, output_grad, axis)`` aligns x and
  output_grad as concat does (x_grad pieces sharded as x), ``stack_grad(output_grad, axis)``
  replicates the stacked axis and gives every x_grad the rest.

Output count bound: a rule whose number of outputs comes from a size (split's sections,
split_with_num's num, unbind's axis size, stack_grad's stacked axis size; forward and
reverse alike) refuses more than :data:`MAX_OUTPUTS` (4096) outputs with an
InvalidAttributeError (num, sections) or ShapeMismatchError (a tensor's size) naming the op
and the argument, before any work: Paddle has no such bound, but an answer of millions of
identical dist attrs is never what a real program needs, and building it would take
minutes and gigabytes.

Deviations from Paddle 3.3.1 (docs/deviations.md): concat-reverse-out, stack-reverse-out,
concat-partial-input, unbind-partial-input (Paddle keeps x partial, the slices not),
split-reverse-conflict.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache, partial

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import replicated
from spmdkit.engine.compile import Plan, compile_plan, infer
from spmdkit.engine.notation import Notation, common_mesh, letters_for
from spmdkit.engine.notation import fast_result as _fast_result
from spmdkit.engine.registry import register

Shape = tuple[int, ...]
#: fast_result for answers holding vector (tuple) arguments
fast_result: Callable[..., SpmdResult] = _fast_result

#: The most outputs a split / unbind / stack_grad answers (see the module docstring).
MAX_OUTPUTS = 4096


def _check_count(op: str, what: str, n: int, attr: bool) -> None:
    """Refuse an output count past MAX_OUTPUTS (``what`` names the argument it comes from)."""
    if n > MAX_OUTPUTS:
        err = InvalidAttributeError if attr else ShapeMismatchError
        raise err(f"{op}: {what} asks for {n} outputs; at most {MAX_OUTPUTS} are answered")


def _axis(op: str, axis: int, ndim: int, extra: int = 0) -> int:
    n = ndim + extra
    if ndim == 0:
        raise ShapeMismatchError(f"{op}: x is 0-d; there is no axis {axis} to act on")
    if not -n <= axis < n:
        raise InvalidAttributeError(f"{op}: axis {axis} is out of range [{-n}, {n}) for a {ndim}-D tensor")
    return axis + n if axis < 0 else axis


# -- the notations: one tensor to its pieces, and the join of many ------------------------------


@lru_cache(maxsize=4096)
def _piece_plan(ndim: int, axis: int, drop: bool, grad: bool) -> Plan:
    """``abc -> abc`` (split's pieces, concat's inputs from its output) or ``abc -> ac`` (drop:
    unbind's slices, stack's inputs from its output, stack_grad's x_grad), the axis ``b``
    replicated. Paddle reads a co-shard as its largest mesh dim; stack_grad (``grad``) keeps
    the sharding as it is and the partial status (the op is linear)."""
    x = letters_for(ndim)
    return compile_plan(Notation([x], [x[:axis] + x[axis + 1:] if drop else x], x[axis],
                                 coshard="keep" if grad else "largest", partial="keep" if grad else "replicate"))


@lru_cache(maxsize=4096)
def _join_plan(n: int, ndim: int, axis: int, empty: int, stack: bool, grad: bool) -> Plan:
    """``abc, abc, ... -> abc`` (concat, the axis ``b`` replicated) or ``-> ab1c`` (stack, the
    new axis at ``axis``), merged by Paddle's per-mesh-dim alignment (``conflict="align"``),
    SUM / AVG partial status kept (0-d stacks keep none); concat_grad (``grad``) merges
    output_grad too and gives each x_grad its x. ``empty``: a bit per input that is Paddle's
    placeholder for an empty tensor (shape ``[0]``), which takes no part (None: replicated)."""
    x = letters_for(ndim)
    xs = [None if (empty >> i) & 1 else x for i in range(n)]
    out = x[:axis] + "1" + x[axis:] if stack else x
    nt = Notation([*xs, x] if grad else xs, xs if grad else [out], "" if stack else x[axis], conflict="align",
                  partial="linear" if ndim else "replicate")
    return compile_plan(nt)


def _fill(mesh: ProcessMesh, specs: Sequence[DistTensorSpec], attrs: Sequence[TensorDistAttr | None]
          ) -> tuple[TensorDistAttr, ...]:
    """The attrs, a placeholder's (None) replicated."""
    return tuple(replicated(mesh, t.ndim) if a is None else a for t, a in zip(specs, attrs))


# -- split / split_with_num / unbind: one tensor and its n pieces ------------------------------


def _sections(op: str, x: DistTensorSpec, sections: tuple[int, ...], axis: int) -> tuple[int, int]:
    """split's axis and piece count, the sections checked against the axis size."""
    ax = _axis(op, axis, x.ndim)
    size = x.shape[ax]
    if not sections:
        raise InvalidAttributeError(f"{op}: sections is empty")
    _check_count(op, f"sections (of {len(sections)} entries)", len(sections), True)
    if any(s < -1 for s in sections) or sections.count(-1) > 1:
        raise InvalidAttributeError(f"{op}: sections {list(sections)} may hold sizes >= 0 and at most one -1")
    if size >= 0:
        known = sum(s for s in sections if s != -1)
        if (-1 not in sections and known != size) or known > size:
            raise InvalidAttributeError(f"{op}: sections {list(sections)} do not add up to the axis size {size}")
    return ax, len(sections)


def _num(op: str, x: DistTensorSpec, num: int, axis: int) -> tuple[int, int]:
    """split_with_num's axis and piece count."""
    ax = _axis(op, axis, x.ndim)
    if num <= 0:
        raise InvalidAttributeError(f"{op}: num must be positive, got {num}")
    _check_count(op, f"num {num}", num, True)
    if x.shape[ax] >= 0 and x.shape[ax] % num:
        raise InvalidAttributeError(f"{op}: num {num} does not divide the axis size {x.shape[ax]}")
    return ax, num


def _slices(op: str, x: DistTensorSpec, axis: int, name: str = "x", what: str = "outputs") -> tuple[int, int]:
    """unbind's (stack_grad's) axis and slice count: the axis size."""
    ax = _axis(op, axis, x.ndim)
    n = x.shape[ax]
    if n < 0:
        raise ShapeMismatchError(f"{op}: the size of axis {axis} of {name} is unknown, so is the number of {what}")
    _check_count(op, f"{name}'s axis {axis} (size {n})", n, False)
    return ax, n


@lru_cache(maxsize=4096)
def _reverse_plan(n: int, ndim: int, axis: int, drop: bool) -> Plan:
    """x (``a1c``) from its n pieces (``abc`` or, unbind, ``ac``), Paddle's reverse merge: per
    axis the pieces' shardings (a co-shard read as its largest mesh dim; where two pieces shard
    an axis over different mesh dims, the larger piece wins); a mesh dim wanted by several axes
    goes to the first to claim it, the split axis ``b`` included, which no input carries, so it
    then shards nothing."""
    x = letters_for(ndim)
    piece = x[:axis] + x[axis + 1:] if drop else x
    return compile_plan(Notation([x[:axis] + "1" + x[axis + 1:]], [piece] * n, coshard="largest"), "backward")


def _split_reverse(op: str, x: DistTensorSpec, out: tuple[DistTensorSpec, ...], n: int, axis: int,
                   unbind: bool) -> SpmdResult:
    mesh = common_mesh(op, (x, *out))
    if len(out) != n:
        raise ShapeMismatchError(f"{op}: out has {len(out)} tensors, the op makes {n}")
    want = x.ndim - 1 if unbind else x.ndim
    for i, o in enumerate(out):
        if o.ndim != want:
            raise ShapeMismatchError(f"{op}: out[{i}] has {o.ndim} dims, expected {want}")
        for j in range(x.ndim):
            if j == axis:
                continue
            k = j - 1 if unbind and j > axis else j
            if o.shape[k] != x.shape[j] and o.shape[k] >= 0 and x.shape[j] >= 0:
                raise ShapeMismatchError(f"{op}: out[{i}] has size {o.shape[k]} on axis {k}, x has {x.shape[j]}")
    ins, outs = infer(_reverse_plan(n, x.ndim, axis, unbind), op, (x,), out, mesh)
    return fast_result(ins, (outs,))


def _pieces(op: str, count: Callable[..., tuple[int, int]], drop: bool, grad: bool = False
            ) -> tuple[Callable[..., SpmdResult], Callable[..., SpmdResult]]:
    """The forward rule (x and its n pieces, all alike, from the piece plan) and the reverse
    rule (x from its pieces) of a split-like op; ``count(op, x, *attrs)``: (axis, n)."""

    def forward(x: DistTensorSpec, *attrs: object) -> SpmdResult:
        ax, n = count(op, x, *attrs)
        ins, outs = infer(_piece_plan(x.ndim, ax, drop, grad), op, (x,), (), x.dist_attr.mesh)
        return fast_result(ins, ((outs[0],) * n,))

    def reverse(x: DistTensorSpec, out: tuple[DistTensorSpec, ...], *attrs: object) -> SpmdResult:
        ax, n = count(op, x, *attrs)
        return _split_reverse(op, x, out, n, ax, drop)

    return forward, reverse


# -- concat / stack ---------------------------------------------------------------------------


def _is_empty(shape: Shape, ndim: int) -> bool:
    return ndim > 1 and shape == (0,)


def _check_join(op: str, name: str, xs: Sequence[DistTensorSpec], axis: int | None) -> None:
    """Sizes must agree off ``axis`` among the non-empty tensors, which share one rank."""
    if not xs:
        raise ShapeMismatchError(f"{op}: {name} is an empty list")
    ndim = max(t.ndim for t in xs)
    first: DistTensorSpec | None = None
    for i, t in enumerate(xs):
        if _is_empty(t.shape, ndim):
            continue
        if t.ndim != ndim:
            raise ShapeMismatchError(f"{op}: {name}[{i}] has {t.ndim} dims, the others {ndim}")
        if first is None:
            first = t
            continue
        for j, (a, b) in enumerate(zip(first.shape, t.shape)):
            if j != axis and a != b and a >= 0 and b >= 0:
                raise ShapeMismatchError(f"{op}: {name}[{i}] has size {b} on axis {j}, {name}[0] has {a}")


def _join(xs: tuple[DistTensorSpec, ...], axis: int, og: DistTensorSpec | None = None, *, op: str, stack: bool,
          name: str = "x") -> SpmdResult:
    """concat / stack of ``xs`` (with concat_grad's output_grad ``og``) through the join plan."""
    every = xs if og is None else (*xs, og)
    mesh = common_mesh(op, every)  # (raises for no tensor at all)
    ndim = max(t.ndim for t in xs) if og is None else og.ndim
    if not stack:
        ax = _axis(op, axis, ndim)
    elif ndim:
        ax = _axis(op, axis, ndim, 1)
    elif axis not in (0, -1):
        raise InvalidAttributeError(f"{op}: axis {axis} is out of range [-1, 1) for stacking 0-d tensors")
    else:
        ax = 0
    _check_join(op, name, every, None if stack else ax)
    empty = 0
    for i, t in enumerate(xs):
        if _is_empty(t.shape, ndim):
            empty |= 1 << i
        elif t.ndim != ndim:  # concat_grad: x against output_grad (_check_join saw the largest rank)
            raise ShapeMismatchError(f"{op}: {name}[{i}] has {t.ndim} dims, output_grad has {ndim}")
    ins, outs = infer(_join_plan(len(xs), ndim, ax, empty, stack, og is not None), op, every, (), mesh)
    if empty:
        ins = _fill(mesh, every, ins)
    if og is None:
        return fast_result((ins,), outs)
    return fast_result((ins[:-1], ins[-1]), (_fill(mesh, xs, outs) if empty else outs,))


def concat_grad(x: tuple[DistTensorSpec, ...], output_grad: DistTensorSpec, axis: int = 0) -> SpmdResult:
    """x and output_grad aligned as concat aligns its inputs; each x_grad sharded as its x."""
    return _join(x, axis, output_grad, op="concat_grad", stack=False)


def concat_backward(x: tuple[DistTensorSpec, ...], output: DistTensorSpec, axis: int = 0) -> SpmdResult:
    """Every input sharded as the output, the concat axis replicated (split's plan, from the
    output); the output returned is the one those inputs produce."""
    mesh = common_mesh("concat", (*x, output))
    ndim = output.ndim
    ax = _axis("concat", axis, ndim)
    _check_join("concat", "x", x, ax)
    for i, t in enumerate(x):
        if t.ndim != ndim and not _is_empty(t.shape, ndim):
            raise ShapeMismatchError(f"concat: x[{i}] has {t.ndim} dims, output has {ndim}")
    ins, outs = infer(_piece_plan(ndim, ax, False, False), "concat", (output,), (), mesh)
    return fast_result((tuple(outs[0] if t.ndim == ndim else replicated(mesh, t.ndim) for t in x),), ins)


def stack_backward(x: tuple[DistTensorSpec, ...], output: DistTensorSpec, axis: int = 0) -> SpmdResult:
    """Every input sharded as the output without the stacked axis (unbind's plan, from the
    output); the output returned is the one those inputs produce (the stacked axis replicated)."""
    mesh = common_mesh("stack", (*x, output))
    ndim = output.ndim
    if ndim == 0:
        raise ShapeMismatchError("stack: output is 0-d; a stack has at least one axis")
    ax = _axis("stack", axis, ndim)
    _check_join("stack", "x", x, None)
    for i, t in enumerate(x):
        if t.ndim != ndim - 1:
            raise ShapeMismatchError(f"stack: x[{i}] has {t.ndim} dims, output has {ndim} (expected {ndim - 1})")
    if output.shape[ax] >= 0 and output.shape[ax] != len(x):
        raise ShapeMismatchError(f"stack: output has size {output.shape[ax]} on axis {ax}, x has {len(x)} tensors")
    ins, outs = infer(_piece_plan(ndim, ax, True, False), "stack", (output,), (), mesh)
    return fast_result(((outs[0],) * len(x),), ins)


# -- the declarations -------------------------------------------------------------------------

# name, (axis, count) of the pieces, unbind-like (the axis dropped), signature, Paddle's stem, doc
for _name, _count, _drop, _sig, _stem, _doc in (
    ("split", _sections, False, "x: T, sections: ints, axis: int = 0", "Split",
     "Each piece is sharded as x, the split axis replicated."),
    ("split_with_num", _num, False, "x: T, num: int, axis: int = 0", "SplitWithNum",
     "Each of the num pieces is sharded as x, the split axis replicated."),
    ("unbind", _slices, True, "x: T, axis: int = 0", "Unbind",
     "Each slice is x's sharding without the unbound axis (which is replicated)."),
):
    _fwd, _rev = _pieces(_name, _count, _drop)
    register(_name, _fwd, _sig, _rev, kind="reverse", outputs="out: [T]", doc=_doc,
             forward_name=f"{_stem}InferSpmd", backward_name=f"{_stem}InferSpmdReverse")
for _name, _stack, _rev, _stem, _doc in (
    ("concat", False, concat_backward, "Concat",
     "Align the inputs mesh dim by mesh dim; the concat axis replicated; partial kept."),
    ("stack", True, stack_backward, "Stack",
     "Align the inputs mesh dim by mesh dim; the new axis replicated in the output."),
):
    register(_name, partial(_join, op=_name, stack=_stack), "x: [T], axis: int = 0", _rev, kind="reverse",
             outputs="output: T", doc=_doc, forward_name=f"{_stem}InferSpmd", backward_name=f"{_stem}InferSpmdReverse")
# the grads of split / unbind join their out_grads as concat / stack do
for _name, _stack, _doc in (("split_grad", False, "x_grad = concat(out_grad, axis)."),
                            ("split_with_num_grad", False, "x_grad = concat(out_grad, axis)."),
                            ("unbind_grad", True, "input_grad = stack(out_grad, axis).")):
    register(_name, partial(_join, op=_name, stack=_stack, name="out_grad"),
             f"out_grad: [T], axis: int = {0 if _stack else -1}", doc=_doc)
register("concat_grad", concat_grad, "x: [T], output_grad: T, axis: int = 0", forward_name="ConcatGradInferSpmdDynamic")
register("stack_grad", _pieces("stack_grad", partial(_slices, name="output_grad", what="x_grad"), True, True)[0],
         "output_grad: T, axis: int = 0", forward_name="StackGradInferSpmd",
         doc="The stacked axis of output_grad replicated; every x_grad gets the other axes' sharding.")
