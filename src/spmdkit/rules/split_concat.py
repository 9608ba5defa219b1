"""split, split_with_num, unbind, concat, stack and their grads.

Vector outputs (split, unbind, concat_grad, stack_grad) are one tuple of dist attrs in
``outputs``; vector inputs (concat, stack, the grads' out_grad lists) one tuple in ``inputs``.

* ``split(x, sections, axis)`` / ``split_with_num(x, num, axis)``: notation ``abc -> abc, abc,
  ...`` with the split axis ``b`` replicated (every piece is a contiguous range of it); every
  other axis keeps x's sharding, partial status is cleared (as in Paddle). The reverse rules
  merge the pieces' shardings axis by axis (the split axis excepted); where two pieces shard
  one axis over different mesh dims the larger piece wins (Paddle raises, DESIGN class 8).
* ``unbind(x, axis)``: ``abc -> ac, ac, ...``: the unbound axis replicated, then dropped.
* ``concat(x, axis)`` / ``stack(x, axis)``: Paddle's per-mesh-dim alignment: a mesh dim on
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

from spmdkit.core.dist_attr import DimsMapping, Entry, Partial, ReduceType, TensorDistAttr, entry_dims
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import one_mesh_dim
from spmdkit.engine.memo import memo
from spmdkit.engine.notation import common_mesh, letters_for, merge_letters
from spmdkit.engine.notation import fast_result as _fast_result
from spmdkit.rules.registry import register

Shape = tuple[int, ...]
_make = TensorDistAttr.unchecked
_INF = float("inf")
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


def _entry(d: Sequence[int]) -> Entry:
    return -1 if not d else d[0] if len(d) == 1 else tuple(d)


def _drop(dm: DimsMapping, axis: int) -> DimsMapping:
    return tuple(-1 if i == axis else e for i, e in enumerate(dm))



# -- split / unbind ---------------------------------------------------------------------------


def _split_sizes(op: str, size: int, sections: tuple[int, ...]) -> None:
    if not sections:
        raise InvalidAttributeError(f"{op}: sections is empty")
    _check_count(op, f"sections (of {len(sections)} entries)", len(sections), True)
    if any(s < -1 for s in sections) or sections.count(-1) > 1:
        raise InvalidAttributeError(f"{op}: sections {list(sections)} may hold sizes >= 0 and at most one -1")
    if size >= 0:
        known = sum(s for s in sections if s != -1)
        if (-1 not in sections and known != size) or known > size:
            raise InvalidAttributeError(f"{op}: sections {list(sections)} do not add up to the axis size {size}")


def _num(op: str, size: int, num: int) -> None:
    if num <= 0:
        raise InvalidAttributeError(f"{op}: num must be positive, got {num}")
    _check_count(op, f"num {num}", num, True)
    if size >= 0 and size % num:
        raise InvalidAttributeError(f"{op}: num {num} does not divide the axis size {size}")


def _split_fwd(x: DistTensorSpec, n: int, axis: int, unbind: bool) -> SpmdResult:
    a = x.dist_attr
    mesh = a.mesh
    dm = _drop(one_mesh_dim(a.dims_mapping, mesh.shape), axis)
    xa = _make(mesh, dm)
    oa = _make(mesh, dm[:axis] + dm[axis + 1:]) if unbind else xa
    return fast_result((xa,), ((oa,) * n,))


def split_forward(x: DistTensorSpec, sections: tuple[int, ...], axis: int) -> SpmdResult:
    """Each piece is sharded as x, the split axis replicated."""
    ax = _axis("split", axis, x.ndim)
    _split_sizes("split", x.shape[ax], sections)
    return _split_fwd(x, len(sections), ax, False)


def split_with_num_forward(x: DistTensorSpec, num: int, axis: int) -> SpmdResult:
    """Each of the num pieces is sharded as x, the split axis replicated."""
    ax = _axis("split_with_num", axis, x.ndim)
    _num("split_with_num", x.shape[ax], num)
    return _split_fwd(x, num, ax, False)


def unbind_forward(x: DistTensorSpec, axis: int = 0) -> SpmdResult:
    """Each slice is x's sharding without the unbound axis (which is replicated)."""
    ax = _axis("unbind", axis, x.ndim)
    if x.shape[ax] < 0:
        raise ShapeMismatchError(f"unbind: the size of axis {axis} of x is unknown, so is the number of outputs")
    _check_count("unbind", f"x's axis {axis} (size {x.shape[ax]})", x.shape[ax], False)
    return _split_fwd(x, x.shape[ax], ax, True)


@memo()
def _merge_pieces(
    ndim: int, axis: int, unbind: bool, mappings: tuple[DimsMapping, ...], shapes: tuple[Shape, ...],
    mesh_shape: Shape,
) -> DimsMapping:
    """Per axis, the pieces' shardings merged (co-shards reduced to one mesh dim first; where
    two pieces shard an axis over different mesh dims, the larger piece wins); a mesh dim
    that ends up on several axes (the split axis included) is dropped from all of them, as
    in Paddle. The split axis is then replicated."""
    letters = letters_for(ndim)
    axes = letters[:axis] + letters[axis + 1:] if unbind else letters
    dms = tuple(one_mesh_dim(dm, mesh_shape) for dm in mappings)
    merged = dict(merge_letters(tuple(axes for _ in dms), dms, shapes, frozenset(), "", mesh_shape))
    count: dict[int, int] = {}
    for d in merged.values():
        for md in d:
            count[md] = count.get(md, 0) + 1
    out: list[Entry] = []
    for i, c in enumerate(letters):
        d = merged.get(c, ()) if i != axis else ()
        out.append(_entry([md for md in d if count[md] == 1]))
    return tuple(out)


def _split_bwd(op: str, x: DistTensorSpec, out: tuple[DistTensorSpec, ...], n: int, axis: int,
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
    dm = _merge_pieces(x.ndim, axis, unbind, tuple(o.dist_attr.dims_mapping for o in out),
                       tuple(o.shape for o in out), mesh.shape)
    xa = _make(mesh, dm)
    oa = _make(mesh, dm[:axis] + dm[axis + 1:]) if unbind else xa
    return fast_result((xa,), ((oa,) * n,))


def split_backward(x: DistTensorSpec, out: tuple[DistTensorSpec, ...], sections: tuple[int, ...],
                   axis: int) -> SpmdResult:
    """x from the pieces: their shardings merged, the split axis replicated."""
    ax = _axis("split", axis, x.ndim)
    _split_sizes("split", x.shape[ax], sections)
    return _split_bwd("split", x, out, len(sections), ax, False)


def split_with_num_backward(x: DistTensorSpec, out: tuple[DistTensorSpec, ...], num: int, axis: int) -> SpmdResult:
    """x from the pieces: their shardings merged, the split axis replicated."""
    ax = _axis("split_with_num", axis, x.ndim)
    _num("split_with_num", x.shape[ax], num)
    return _split_bwd("split_with_num", x, out, num, ax, False)


def unbind_backward(x: DistTensorSpec, out: tuple[DistTensorSpec, ...], axis: int = 0) -> SpmdResult:
    """x from the slices: their shardings merged, the unbound axis replicated."""
    ax = _axis("unbind", axis, x.ndim)
    if x.shape[ax] < 0:
        raise ShapeMismatchError(f"unbind: the size of axis {axis} of x is unknown, so is the number of outputs")
    _check_count("unbind", f"x's axis {axis} (size {x.shape[ax]})", x.shape[ax], False)
    return _split_bwd("unbind", x, out, x.shape[ax], ax, True)


# -- concat / stack: Paddle's per-mesh-dim alignment --------------------------------------------


def _is_empty(shape: Shape, ndim: int) -> bool:
    return ndim > 1 and shape == (0,)


@memo()
def _align(
    shapes: tuple[Shape, ...], mappings: tuple[DimsMapping, ...], partials: tuple[Partial, ...],
    skip: int, ndim: int, mesh_shape: Shape,
) -> tuple[DimsMapping, Partial]:
    """One dims_mapping (and partial) for all tensors of rank ``ndim``; axis ``skip`` is never
    sharded (-1: none skipped)."""
    live = [i for i, s in enumerate(shapes) if not _is_empty(s, ndim)]
    nmesh = len(mesh_shape)
    # placement per tensor and mesh dim: ("S", axis) | ("P", reduce type) | ("R",)
    places: list[list[tuple[object, ...]]] = []
    for dm, pt in zip(mappings, partials):
        p: list[tuple[object, ...]] = [("R",)] * nmesh
        for ax, e in enumerate(dm):
            for d in entry_dims(e):
                p[d] = ("S", ax)
        for d, rt in pt:
            p[d] = ("P", rt)
        places.append(p)
    ref = live[0]
    mismatch = [any(places[i][md] != places[ref][md] for i in live) for md in range(nmesh)]
    axis_of: dict[int, int] = {}
    sharded: set[int] = set()
    partial: dict[int, ReduceType] = {}
    for md in range(nmesh):
        if mismatch[md]:
            continue
        p0 = places[ref][md]
        if p0[0] == "S":
            ax = int(p0[1])  # type: ignore[call-overload]
            if ax != skip:
                axis_of[md] = ax
                sharded.add(ax)
        elif p0[0] == "P" and p0[1] in (ReduceType.SUM, ReduceType.AVG):
            partial[md] = p0[1]  # type: ignore[assignment]
    local_size: dict[int, int] = {}  # per live tensor: its local element count (0: empty)
    if any(mismatch):
        for i in live:
            shp = shapes[i]
            n = 1
            for s in shp:
                n *= s if s >= 0 else 1
            if n == 0:
                local_size[i] = 0
                continue
            local = 1
            for a2, s in enumerate(shp):
                k = 1
                for d in entry_dims(mappings[i][a2]):
                    k *= mesh_shape[d]
                s = s if s >= 0 else 1
                local *= -(-s // k)
            local_size[i] = local
    for md in range(nmesh):
        if not mismatch[md]:
            continue
        best, best_cost = -1, _INF
        for ax in range(ndim):
            if ax == skip or ax in sharded:
                continue
            cost: float = 0  # exact int sums (huge sizes overflow a float)
            for i in live:
                shp = shapes[i]
                if 0 <= shp[ax] < mesh_shape[md]:
                    cost = _INF
                    break
                if entry_dims(mappings[i][ax]):
                    continue
                local = local_size[i]
                if local == 0:
                    continue
                cost += local * mesh_shape[md]
            if cost < best_cost:
                best, best_cost = ax, cost
        if best >= 0:
            axis_of[md] = best
            sharded.add(best)
    out: list[Entry] = []
    for ax in range(ndim):
        # a co-sharded axis keeps its highest mesh dim, as Paddle's placements give it
        dims = [md for md, a in axis_of.items() if a == ax]
        out.append(max(dims) if dims else -1)
    return tuple(out), tuple(sorted(partial.items()))


def _check_join(op: str, name: str, xs: Sequence[DistTensorSpec], axis: int | None) -> int:
    """The common rank of the non-empty tensors; sizes must agree off ``axis``."""
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
    return ndim


def _join_attrs(
    op: str, specs: Sequence[DistTensorSpec], mesh: ProcessMesh, ndim: int, skip: int
) -> tuple[DimsMapping, Partial]:
    return _align(tuple(t.shape for t in specs), tuple(t.dist_attr.dims_mapping for t in specs),
                  tuple(t.dist_attr.partial for t in specs), skip, ndim, mesh.shape)


def _per_tensor(mesh: ProcessMesh, specs: Sequence[DistTensorSpec], ndim: int, dm: DimsMapping,
                pt: Partial) -> tuple[TensorDistAttr, ...]:
    a = _make(mesh, dm, pt)
    return tuple(_make(mesh, (-1,) * t.ndim) if _is_empty(t.shape, ndim) else a for t in specs)


def _concat(op: str, xs: tuple[DistTensorSpec, ...], axis: int, name: str = "x") -> SpmdResult:
    mesh = common_mesh(op, xs)
    ndim = max(t.ndim for t in xs) if xs else 0
    ax = _axis(op, axis, ndim)
    _check_join(op, name, xs, ax)
    dm, pt = _join_attrs(op, xs, mesh, ndim, ax)
    return fast_result((_per_tensor(mesh, xs, ndim, dm, pt),), (_make(mesh, dm, pt),))


def concat_forward(x: tuple[DistTensorSpec, ...], axis: int = 0) -> SpmdResult:
    """Align the inputs mesh dim by mesh dim; the concat axis replicated; partial kept."""
    return _concat("concat", x, axis)


def _stack(op: str, xs: tuple[DistTensorSpec, ...], axis: int, name: str = "x") -> SpmdResult:
    mesh = common_mesh(op, xs)
    if not xs:
        raise ShapeMismatchError(f"{op}: {name} is an empty list")
    ndim = max(t.ndim for t in xs)
    ax = _axis(op, axis, ndim, 1) if ndim else _axis0(op, axis)
    _check_join(op, name, xs, None)
    if ndim == 0:
        ins = tuple(_make(mesh, ()) for _ in xs)
        return fast_result((ins,), (_make(mesh, (-1,)),))
    dm, pt = _join_attrs(op, xs, mesh, ndim, -1)
    return fast_result((_per_tensor(mesh, xs, ndim, dm, pt),), (_make(mesh, (*dm[:ax], -1, *dm[ax:]), pt),))


def _axis0(op: str, axis: int) -> int:
    if axis not in (0, -1):
        raise InvalidAttributeError(f"{op}: axis {axis} is out of range [-1, 1) for stacking 0-d tensors")
    return 0


def stack_forward(x: tuple[DistTensorSpec, ...], axis: int = 0) -> SpmdResult:
    """Align the inputs mesh dim by mesh dim; the new axis replicated in the output."""
    return _stack("stack", x, axis)


def concat_backward(x: tuple[DistTensorSpec, ...], output: DistTensorSpec, axis: int = 0) -> SpmdResult:
    """Every input sharded as the output, the concat axis replicated; the output returned is
    the one those inputs produce."""
    mesh = common_mesh("concat", (*x, output))
    ndim = output.ndim
    ax = _axis("concat", axis, ndim)
    _check_join("concat", "x", x, ax)
    for i, t in enumerate(x):
        if t.ndim != ndim and not _is_empty(t.shape, ndim):
            raise ShapeMismatchError(f"concat: x[{i}] has {t.ndim} dims, output has {ndim}")
    dm = _drop(one_mesh_dim(output.dist_attr.dims_mapping, mesh.shape), ax)
    a = _make(mesh, dm)
    return fast_result((tuple(_make(mesh, (-1,) * t.ndim) if t.ndim != ndim else a for t in x),), (a,))


def stack_backward(x: tuple[DistTensorSpec, ...], output: DistTensorSpec, axis: int = 0) -> SpmdResult:
    """Every input sharded as the output without the stacked axis; the output returned is the
    one those inputs produce (the stacked axis replicated)."""
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
    odm = one_mesh_dim(output.dist_attr.dims_mapping, mesh.shape)
    dm = odm[:ax] + odm[ax + 1:]
    return fast_result(((_make(mesh, dm),) * len(x),), (_make(mesh, (*dm[:ax], -1, *dm[ax:])),))


# -- grads ------------------------------------------------------------------------------------


def split_grad(out_grad: tuple[DistTensorSpec, ...], axis: int = -1) -> SpmdResult:
    """x_grad = concat(out_grad, axis)."""
    return _concat("split_grad", out_grad, axis, "out_grad")


def split_with_num_grad(out_grad: tuple[DistTensorSpec, ...], axis: int = -1) -> SpmdResult:
    """x_grad = concat(out_grad, axis)."""
    return _concat("split_with_num_grad", out_grad, axis, "out_grad")


def unbind_grad(out_grad: tuple[DistTensorSpec, ...], axis: int = 0) -> SpmdResult:
    """input_grad = stack(out_grad, axis)."""
    return _stack("unbind_grad", out_grad, axis, "out_grad")


def concat_grad(x: tuple[DistTensorSpec, ...], output_grad: DistTensorSpec, axis: int = 0) -> SpmdResult:
    """x and output_grad aligned as concat aligns its inputs; each x_grad sharded as its x."""
    op = "concat_grad"
    mesh = common_mesh(op, (*x, output_grad))
    ndim = output_grad.ndim
    ax = _axis(op, axis, ndim)
    _check_join(op, "x", (*x, output_grad), ax)
    dm, pt = _join_attrs(op, (*x, output_grad), mesh, ndim, ax)
    xs = _per_tensor(mesh, x, ndim, dm, pt)
    return fast_result((xs, _make(mesh, dm, pt)), (xs,))


def stack_grad(output_grad: DistTensorSpec, axis: int = 0) -> SpmdResult:
    """The stacked axis of output_grad replicated; every x_grad gets the other axes' sharding."""
    op = "stack_grad"
    ndim = output_grad.ndim
    ax = _axis(op, axis, ndim)
    n = output_grad.shape[ax]
    if n < 0:
        raise ShapeMismatchError(f"{op}: the size of axis {axis} of output_grad is unknown, so is the number of x_grad")
    _check_count(op, f"output_grad's axis {axis} (size {n})", n, False)
    a = output_grad.dist_attr
    dm = _drop(a.dims_mapping, ax)
    ga = _make(a.mesh, dm, a.partial)
    xa = _make(a.mesh, dm[:ax] + dm[ax + 1:], a.partial)
    return fast_result((ga,), ((xa,) * n,))


# name, forward, signature, reverse, the op's outputs, Paddle's name stem ({stem}InferSpmd[Reverse])
for _name, _fwd, _sig, _rev, _outs, _stem in (
    ("split", split_forward, "x: T, sections: ints, axis: int = 0", split_backward, "out: [T]", "Split"),
    ("split_with_num", split_with_num_forward, "x: T, num: int, axis: int = 0", split_with_num_backward, "out: [T]",
     "SplitWithNum"),
    ("unbind", unbind_forward, "x: T, axis: int = 0", unbind_backward, "out: [T]", "Unbind"),
    ("concat", concat_forward, "x: [T], axis: int = 0", concat_backward, "output: T", "Concat"),
    ("stack", stack_forward, "x: [T], axis: int = 0", stack_backward, "output: T", "Stack"),
):
    register(_name, _fwd, _sig, _rev, kind="reverse", outputs=_outs,
             forward_name=f"{_stem}InferSpmd", backward_name=f"{_stem}InferSpmdReverse")
register("split_grad", split_grad, "out_grad: [T], axis: int = -1")
register("split_with_num_grad", split_with_num_grad, "out_grad: [T], axis: int = -1")
register("unbind_grad", unbind_grad, "out_grad: [T], axis: int = 0")
register("concat_grad", concat_grad, "x: [T], output_grad: T, axis: int = 0",
         forward_name="ConcatGradInferSpmdDynamic")
register("stack_grad", stack_grad, "output_grad: T, axis: int = 0", forward_name="StackGradInferSpmd")
