"""Gathers and scatters along axes by an index tensor: take_along_axis, put_along_axis and
index_put, with their grads.

Notation (x ``abc``; ``1`` marks an axis that is never sharded). Partial inputs are made replicated. A co-sharded axis is read as one mesh dim, its
largest (the first of equal sizes), as Paddle 3.3.1's rules read ``dims_mapping()``.

- ``take_along_axis`` (TakeAlongAxisInferSpmd(x, index, axis)): ``a1c, abc -> abc``: x is
  never sharded on the axis, index (and out) may be; an axis where x and index differ in
  size is ``1`` in both (replicated: the kernel reads x's leading rows). Backward slot and
  ``take_along_axis_grad`` (x, index, out_grad, axis): letters from out_grad alone, x and
  x_grad ``a1c``; where out_grad / index are sharded on the axis each rank scatters only its
  part, so x_grad is partial SUM over those mesh dims of size > 1 (Paddle: not partial,
  unsound).
- ``put_along_axis`` (PutAlongAxisInferSpmd(x, index, value, axis, reduce, include_self)):
  ``a1c, a1c, a1c -> a1c``: the axis, and every axis where index or value differ from x in
  size, replicated; the other axes merged over the three. Backward slot and
  ``put_along_axis_grad`` (x, index, value, out, out_grad, ...): the same letters taken from
  out_grad alone; outputs x_grad, value_grad.
- ``index_put`` (IndexPutInferSpmd(x, indices, value, accumulate)): x's first
  ``len(indices)`` axes replicated, the rest keep their sharding; indices 1-D replicated;
  value (any rank up to that of the indexed shape ``[n, *x.shape[len(indices):]]``, onto
  which it broadcasts from the right): an axis that meets one of x's kept axes with the
  same size (not 1) is sharded as that axis, every other axis (the indexed positions, a
  size-1 axis) replicated (Paddle replicates value while x's axes stay sharded: the local
  shapes do not broadcast). A 1-D value is thus sharded as x's last axis where
  ``len(indices) < x.ndim`` and its size is not 1.
  Backward slot and ``index_put_grad`` (x, indices, value, out_grad, accumulate): x,
  out_grad and x_grad as x above; value_grad sums out_grad[indices] over the kept axes
  value does not lie along, so it is partial SUM over the mesh dims sharding those axes.
  Paddle never marks value_grad partial (unsound).

Deviations from Paddle 3.3.1 (docs/deviations.md, ``misc-*``): take_along_axis_grad's
missing partial; index_put's value broadcast, partial indices and value_grad partial; conflicts Paddle
raises on (take_along_axis); take_along_axis's negative axis (Paddle fails).
"""

from __future__ import annotations

from functools import lru_cache

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import InvalidArgumentError, InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import make_attr, normalize_axis
from spmdkit.engine.compile import Plan, compile_plan, infer
from spmdkit.engine.notation import ALPHABET, BROADCAST, Notation, fast_result, letters_for, named_mesh
from spmdkit.engine.registry import register
from spmdkit.rules._common import check_same_ndim, check_same_shape

Shape = tuple[int, ...]


# ---------------------------------------------------------------------------
# take_along_axis / put_along_axis
# ---------------------------------------------------------------------------


def _differ(ax: int, x: Shape, *others: Shape) -> int:
    """A bit per axis other than ``ax`` where one of ``others`` differs from ``x`` in size."""
    m = 0
    for i, n in enumerate(x):
        if i != ax and any(o[i] != n for o in others):
            m |= 1 << i
    return m


@lru_cache(maxsize=4096)
def _along_plan(nd: int, ax: int, differ: int, kind: str) -> Plan:
    """take_along_axis ``a1c, abc -> abc``: x never sharded on the axis, an axis where the sizes
    differ (``differ``) ``1`` in x and index; its grad ``a1c, abc, abc -> a1c`` from out_grad
    alone, x_grad partial SUM over the mesh dims of the letters it lacks. put_along_axis
    ``a1c, a1c, a1c -> a1c`` (the differing axes ``1`` too), merged over the three; its grad the
    five tensors from out_grad alone -> x_grad, value_grad. A co-shard read as its largest mesh dim."""
    s = ALPHABET[:nd]
    i = "".join(BROADCAST if (differ >> j) & 1 else c for j, c in enumerate(s))
    x = i[:ax] + BROADCAST + i[ax + 1 :]
    nt = {"take": lambda: Notation((x, i), (i,)), "take_grad": lambda: Notation((x, i, i), (x,), sources=(2,)),
          "put": lambda: Notation((x, x, x), (x,)), "put_grad": lambda: Notation((x,) * 5, (x, x), sources=(4,))}[kind]()
    return compile_plan(nt.replace(coshard="largest"))


def _take_check(op: str, x: DistTensorSpec, index: DistTensorSpec, axis: int, value: DistTensorSpec | None = None,
                reduce: str = "assign") -> int:
    """The axis, after the checks of take_along_axis (and, given ``value``, put_along_axis)."""
    nd = len(x.shape)
    check_same_ndim(op, index, nd, "index", "x")
    if value is not None:
        check_same_ndim(op, value, nd, "value", "x")
    if nd == 0:
        raise ShapeMismatchError(f"{op}: x must have at least 1 dim")
    if nd > len(ALPHABET):
        raise ShapeMismatchError(f"{op}: tensors of more than {len(ALPHABET)} dims are not supported")
    if reduce not in _PUT_REDUCE:
        raise InvalidAttributeError(f"{op}: reduce {reduce!r} is not one of {', '.join(_PUT_REDUCE)}")
    return normalize_axis(op, axis, nd)


def take_along_axis_forward(x: DistTensorSpec, index: DistTensorSpec, axis: int = 0) -> SpmdResult:
    """TakeAlongAxisInferSpmd: ``a1c, abc -> abc``."""
    op = "take_along_axis"
    mesh = named_mesh(op, (("x", x), ("index", index)))
    ax = _take_check(op, x, index, axis)
    p = _along_plan(len(x.shape), ax, _differ(ax, x.shape, index.shape), "take")
    return fast_result(*infer(p, op, (x, index), (), mesh, ("x", "index")))


def take_along_axis_grad(
    x: DistTensorSpec, index: DistTensorSpec, out_grad: DistTensorSpec, axis: int = 0
) -> SpmdResult:
    """TakeAlongAxisGradInferSpmd: letters from out_grad; x_grad ``a1c``, partial SUM over the
    mesh dims that shard index / out_grad on the axis."""
    op = "take_along_axis_grad"
    mesh = named_mesh(op, (("x", x), ("index", index), ("out_grad", out_grad)))
    ax = _take_check(op, x, index, axis)
    check_same_ndim(op, out_grad, len(x.shape), "out_grad", "x")
    p = _along_plan(len(x.shape), ax, _differ(ax, x.shape, index.shape), "take_grad")
    ins, outs = infer(p, op, (x, index, out_grad), (), mesh, ("x", "index", "out_grad"))
    # post-hook (as index_put_grad's): no partial over a mesh dim of size 1
    return fast_result(ins, tuple(_no_unit_partial(a) for a in outs))


def _no_unit_partial(a: TensorDistAttr | None) -> TensorDistAttr | None:
    """``a`` without partial mesh dims of size 1 (a no-op reduction; Paddle does not mark them)."""
    if a is None or not a.partial:
        return a
    ms = a.mesh.shape
    pt = tuple((d, r) for d, r in a.partial if ms[d] != 1)
    return a if pt == a.partial else make_attr(a.mesh, a.dims_mapping, pt)


_PUT_REDUCE = ("assign", "add", "mul", "multiply", "amin", "amax", "mean")


def _put(op: str, ts: tuple[DistTensorSpec, ...], axis: int, reduce: str) -> SpmdResult:
    """put_along_axis (``ts``: x, index, value) or its grad (x, index, value, out, out_grad)."""
    names = ("x", "index", "value", "out", "out_grad")[: len(ts)]
    mesh = named_mesh(op, zip(names, ts))
    x, index, value = ts[:3]
    ax = _take_check(op, x, index, axis, value, reduce)
    for name, t in zip(names[3:], ts[3:]):
        check_same_shape(op, t, x.shape, name, "x")
    p = _along_plan(len(x.shape), ax, _differ(ax, x.shape, index.shape, value.shape), "put" if len(ts) < 5 else "put_grad")
    return fast_result(*infer(p, op, ts, (), mesh, names))


def put_along_axis_forward(
    x: DistTensorSpec, index: DistTensorSpec, value: DistTensorSpec, axis: int = 0,
    reduce: str = "assign", include_self: bool = True,
) -> SpmdResult:
    """PutAlongAxisInferSpmd: ``a1c, a1c, a1c -> a1c``."""
    return _put("put_along_axis", (x, index, value), axis, reduce)


def put_along_axis_grad(
    x: DistTensorSpec, index: DistTensorSpec, value: DistTensorSpec, out: DistTensorSpec,
    out_grad: DistTensorSpec, axis: int = 0, reduce: str = "assign", include_self: bool = True,
) -> SpmdResult:
    """PutAlongAxisGradInferSpmd: every tensor ``a1c``, the letters taken from out_grad."""
    return _put("put_along_axis_grad", (x, index, value, out, out_grad), axis, reduce)


# ---------------------------------------------------------------------------
# index_put
# ---------------------------------------------------------------------------


def _index_put_check(
    op: str, x: DistTensorSpec, indices: tuple[DistTensorSpec, ...], value: DistTensorSpec
) -> tuple[int, tuple[int, ...]]:
    """(number of indexed axes, per value axis the x axis it lies along or -1).

    ``x[indices]`` has the indexed shape ``[n, *x.shape[k:]]`` (n the indices' length, k their
    number); value broadcasts onto it from the right (numpy rules). A value axis lies along
    an x axis where it meets one of x's kept axes with the same size (not 1); it lies along
    nothing (-1) where it meets the indexed positions or has size 1 (a broadcast)."""
    nd = len(x.shape)
    k = len(indices)
    if k == 0:
        raise InvalidArgumentError(f"{op}: indices must hold at least one index tensor")
    if k > nd:
        raise ShapeMismatchError(f"{op}: {k} index tensors for a {nd}-D x (at most {nd})")
    n = -2
    for i, t in enumerate(indices):
        if len(t.shape) != 1:
            raise ShapeMismatchError(f"{op}: indices[{i}] must be 1-D, got {len(t.shape)} dims")
        if n == -2 or n < 0:
            n = t.shape[0]
        elif 0 <= t.shape[0] != n:
            raise ShapeMismatchError(f"{op}: indices[{i}] has {t.shape[0]} entries, indices[0] has {n}")
    target = (n, *x.shape[k:])  # the indexed shape value broadcasts onto
    vs = value.shape
    if len(vs) == 0:
        raise ShapeMismatchError(f"{op}: value must have at least 1 dim, got a 0-d value")
    if len(vs) > len(target):
        raise ShapeMismatchError(
            f"{op}: value has {len(vs)} dims, more than the {len(target)} of the indexed shape "
            f"{list(target)} (indices' length, then x's axes {k}..{nd - 1})"
        )
    off = len(target) - len(vs)
    along: list[int] = []
    for j, v in enumerate(vs):
        size = target[off + j]
        if v >= 0 and size >= 0 and v != size and v != 1:
            raise ShapeMismatchError(
                f"{op}: value shape {list(vs)} does not broadcast onto the indexed shape {list(target)} "
                f"(value axis {j} has size {v}, the indexed shape {size})"
            )
        xa = k - 1 + off + j  # the x axis this value axis meets (k - 1: the indexed positions)
        along.append(xa if xa >= k and v != 1 else -1)
    return k, tuple(along)


@lru_cache(maxsize=4096)
def _index_put_plan(nd: int, k: int, along: tuple[int, ...], grad: bool) -> Plan:
    """``11c, 1, 1, c -> 11c`` (x, indices..., value -> out; here 2 indexed axes, value along x's
    last): x's indexed axes ``1``, every index ``1``, a value axis carries the letter of the x
    axis it lies along (``1``: none), merged from x alone (a co-shard read as its largest mesh
    dim). The grad adds out_grad (as x) and answers x_grad (as x) and value_grad, partial SUM over
    the letters of the kept axes value does not lie along (it sums over them)."""
    a = letters_for(nd)
    x = BROADCAST * k + a[k:]
    v = "".join(BROADCAST if i < 0 else a[i] for i in along)
    ins = [x, *[BROADCAST] * k, v, *([x] if grad else [])]
    return compile_plan(Notation(ins, [x, v] if grad else [x], coshard="largest", sources=(0,)))


def _index_put(op: str, x: DistTensorSpec, indices: tuple[DistTensorSpec, ...], value: DistTensorSpec,
               out_grad: DistTensorSpec | None = None) -> SpmdResult:
    named = (("x", x), *((f"indices[{i}]", t) for i, t in enumerate(indices)), ("value", value))
    mesh = named_mesh(op, named if out_grad is None else (*named, ("out_grad", out_grad)))
    k, along = _index_put_check(op, x, indices, value)
    if out_grad is not None:
        check_same_shape(op, out_grad, x.shape, "out_grad", "x")
    p = _index_put_plan(len(x.shape), k, along, out_grad is not None)
    a, outs = infer(p, op, (x, *indices, value, *((out_grad,) if out_grad is not None else ())), (), mesh)
    # post-hook: a partial over a mesh dim of size 1 is no reduction (Paddle does not mark it)
    return fast_result((a[0], a[1 : k + 1], *a[k + 1 :]),  # type: ignore[arg-type]
                       outs if out_grad is None else (outs[0], _no_unit_partial(outs[1])))


def index_put_forward(
    x: DistTensorSpec, indices: tuple[DistTensorSpec, ...], value: DistTensorSpec, accumulate: bool = False
) -> SpmdResult:
    """IndexPutInferSpmd: the indexed axes replicated, indices replicated, value replicated or
    sharded as x's last axis where it broadcasts onto it."""
    return _index_put("index_put", x, indices, value)


def index_put_grad(
    x: DistTensorSpec, indices: tuple[DistTensorSpec, ...], value: DistTensorSpec, out_grad: DistTensorSpec,
    accumulate: bool = False,
) -> SpmdResult:
    """IndexPutGradInferSpmd: x, out_grad, x_grad as the forward's x; value_grad partial SUM over
    the mesh dims of the trailing axes it sums over."""
    return _index_put("index_put_grad", x, indices, value, out_grad)


register("take_along_axis", take_along_axis_forward, "x: T, index: T, axis: int",
         take_along_axis_grad, "x: T, index: T, out_grad: T, axis: int", kind="grad", grad_name="take_along_axis_grad",
         forward_name="TakeAlongAxisInferSpmd", backward_name="TakeAlongAxisGradInferSpmd")  # fmt: skip
_PS_SIG = "axis: int, reduce: str = 'assign', include_self: bool = True"
register("put_along_axis", put_along_axis_forward, f"x: T, index: T, value: T, {_PS_SIG}",
         put_along_axis_grad, f"x: T, index: T, value: T, out: T, out_grad: T, {_PS_SIG}", kind="grad", grad_name="put_along_axis_grad",
         forward_name="PutAlongAxisInferSpmd", backward_name="PutAlongAxisGradInferSpmd")  # fmt: skip
register("index_put", index_put_forward, "x: T, indices: [T], value: T, accumulate: bool = False",
         index_put_grad, "x: T, indices: [T], value: T, out_grad: T, accumulate: bool = False", kind="grad", grad_name="index_put_grad",
         forward_name="IndexPutInferSpmd", backward_name="IndexPutGradInferSpmd")  # fmt: skip
