"""Gathers and scatters along axes by an index tensor: take_along_axis, put_along_axis and
index_put, with their grads.

Notation (x ``abc``; ``1`` marks an axis that is never sharded). Partial inputs are made
replicated. A co-sharded axis is read as one mesh dim, its largest (the first of equal sizes), as
Paddle 3.3.1's rules read ``dims_mapping()``. A grad partial over a mesh dim of size 1 is no
reduction and is not marked (nor does Paddle).

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

from collections.abc import Sequence
from functools import partial
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.axes import make_attr, normalize_axis
from spmdkit.engine.declare import Answer, Way, declare
from spmdkit.engine.facts import facts
from spmdkit.engine.notation import BROADCAST, Coshard, Notation, letters_for
from spmdkit.engine.outshape import Args, Expect, same
from spmdkit.ops._common import check_same_ndim
from spmdkit.ops._cost import copy, lookup, scatter_grad

Shape = tuple[int, ...]


def _differ(x: Shape, *others: Shape) -> int:
    """A bit per axis where one of ``others`` differs from ``x`` in size."""
    m = 0
    for i, n in enumerate(x):
        for o in others:
            if o[i] != n:
                m |= 1 << i
                break
    return m


def _along(kind: str, nd: int, axis: int, differ: int) -> Notation:
    """take_along_axis ``a1c, abc -> abc``: an axis other than the axis where the sizes differ
    (``differ``) is ``1`` in x and index; its grad ``a1c, abc, abc -> a1c`` from out_grad alone
    (x_grad partial SUM over the letters it lacks); put_along_axis ``a1c, a1c, a1c -> a1c`` (the
    differing axes ``1`` too), its grad the five tensors from out_grad alone -> x_grad, value_grad."""
    a = letters_for(nd)
    ax = normalize_axis("", axis, nd)
    i = "".join(BROADCAST if (differ >> j) & 1 and j != ax else c for j, c in enumerate(a))
    x = i[:ax] + BROADCAST + i[ax + 1 :]
    ins, outs, src = {"take": ((x, i), (i,), None), "take_grad": ((x, i, i), (x,), (2,)),
                      "put": ((x, x, x), (x,), None), "put_grad": ((x,) * 5, (x, x), (4,))}[kind]  # fmt: skip
    return Notation(ins, outs, coshard=Coshard.LARGEST, sources=src)


def _grad_post(ins: Sequence[TensorDistAttr | None], outs: Sequence[TensorDistAttr | None], *args: object) -> Answer:
    """The grads' last output (the one that can be partial) without partial mesh dims of size 1."""
    a = outs[-1]
    if a is None or not a.partial:
        return ins, outs
    pt = tuple((d, r) for d, r in a.partial if a.mesh.shape[d] != 1)
    return ins, (*outs[:-1], make_attr(a.mesh, a.dims_mapping, pt))


def _index_put_key(x: DistTensorSpec, indices: tuple[DistTensorSpec, ...], value: DistTensorSpec) -> tuple[int, ...]:
    """Per value axis the x axis it lies along, or -1, after the checks. ``x[indices]`` has the
    indexed shape ``[n, *x.shape[k:]]`` (n the indices' length, k their number); value broadcasts
    onto it from the right (numpy rules). A value axis lies along an x axis where it meets one of
    x's kept axes with the same size (not 1); along nothing where it meets the indexed positions
    or has size 1 (a broadcast)."""
    nd, k = len(x.shape), len(indices)
    if k > nd:
        raise ShapeMismatchError(f"{k} index tensors for a {nd}-D x (at most {nd})")
    n = -2
    for i, t in enumerate(indices):
        if len(t.shape) != 1:
            raise ShapeMismatchError(f"indices[{i}] must be 1-D, got {len(t.shape)} dims")
        if n < 0:
            n = t.shape[0]
        elif 0 <= t.shape[0] != n:
            raise ShapeMismatchError(f"indices[{i}] has {t.shape[0]} entries, indices[0] has {n}")
    target, vs = (n, *x.shape[k:]), value.shape  # value broadcasts onto the indexed shape
    if len(vs) == 0:
        raise ShapeMismatchError("value must have at least 1 dim, got a 0-d value")
    if len(vs) > len(target):
        raise ShapeMismatchError(
            f"value has {len(vs)} dims, more than the {len(target)} of the indexed shape {list(target)} "
            f"(indices' length, then x's axes {k}..{nd - 1})"
        )
    off = len(target) - len(vs)
    for j, v in enumerate(vs):
        if v >= 0 and target[off + j] >= 0 and v not in (1, target[off + j]):
            raise ShapeMismatchError(
                f"value shape {list(vs)} does not broadcast onto the indexed shape {list(target)} "
                f"(value axis {j} has size {v}, the indexed shape {target[off + j]})"
            )
    # the x axis a value axis meets: k - 1 + off + j (k - 1: the indexed positions)
    return tuple(k - 1 + off + j if k - 1 + off + j >= k and v != 1 else -1 for j, v in enumerate(vs))


def _index_put(grad: bool, nd: int, k: int, along: tuple[int, ...]) -> Notation:
    """``11c, 1, 1, c -> 11c`` (x, indices..., value -> out; here 2 indexed axes, value along x's
    last): x's indexed axes ``1``, every index ``1``, a value axis carries the letter of the x
    axis it lies along (``1``: none), merged from x alone (a co-shard read as its largest mesh
    dim). The grad adds out_grad (as x) and answers x_grad (as x) and value_grad, partial SUM over
    the letters of the kept axes value does not lie along (it sums over them)."""
    a = letters_for(nd)
    x = BROADCAST * k + a[k:]
    v = "".join(BROADCAST if i < 0 else a[i] for i in along)
    ins = [x, *[BROADCAST] * k, v, *([x] if grad else [])]
    return Notation(ins, [x, v] if grad else [x], coshard=Coshard.LARGEST, sources=(0,))


def _unit(x: DistTensorSpec) -> bool:
    """Where _grad_post can change the answer: a mesh dim of size 1."""
    return 1 in x.dist_attr.mesh.shape


def _index_rank(op: str, x: DistTensorSpec, index: DistTensorSpec) -> None:
    if len(index.shape) != len(x.shape):
        check_same_ndim(op, index, len(x.shape), "index", "x")


def _value_rank(op: str, x: DistTensorSpec, value: DistTensorSpec) -> None:
    if len(value.shape) != len(x.shape):
        check_same_ndim(op, value, len(x.shape), "value", "x")


def _out_grad_rank(op: str, x: DistTensorSpec, out_grad: DistTensorSpec) -> None:
    if len(out_grad.shape) != len(x.shape):
        check_same_ndim(op, out_grad, len(x.shape), "out_grad", "x")


_ENV = {"_differ": _differ, "_index_put_key": _index_put_key}
_TAKE_KEY = "x, axis, _differ(x.shape, index.shape)"
declare(
    "take_along_axis", "x: T, index: T, axis: int",
    Way(partial(_along, "take"), key=_TAKE_KEY, env=_ENV, shapes="x: _ ...", check=_index_rank,
        paddle="TakeAlongAxisInferSpmd", doc="TakeAlongAxisInferSpmd: ``a1c, abc -> abc``."),
    grad=Way(partial(_along, "take_grad"), key=_TAKE_KEY, env=_ENV, post=_grad_post, post_if=_unit,
             shapes="x: _ ...", check=(_index_rank, _out_grad_rank),
             paddle="TakeAlongAxisGradInferSpmd",
             doc="TakeAlongAxisGradInferSpmd: letters from out_grad; x_grad ``a1c``, partial SUM over the mesh dims "
                 "that shard index / out_grad on the axis."),
    grad_signature="x: T, index: T, out_grad: T, axis: int", grad_name="take_along_axis_grad",
)  # fmt: skip
_PS_SIG = "axis: int, reduce: str = 'assign', include_self: bool = True"
_PUT: dict[str, Any] = {
    "key": "x, axis, _differ(x.shape, index.shape, value.shape)",
    "env": _ENV,
    "shapes": "x: _ ...",
    "require": ("reduce in ('assign', 'add', 'mul', 'multiply', 'amin', 'amax', 'mean')",),
    "check": (_index_rank, _value_rank),
}
declare(
    "put_along_axis", f"x: T, index: T, value: T, {_PS_SIG}",
    Way(partial(_along, "put"), **_PUT, paddle="PutAlongAxisInferSpmd",
        doc="PutAlongAxisInferSpmd: ``a1c, a1c, a1c -> a1c``."),
    grad=Way(partial(_along, "put_grad"), **_PUT, same=[("x", "out"), ("x", "out_grad")],
             paddle="PutAlongAxisGradInferSpmd",
             doc="PutAlongAxisGradInferSpmd: every tensor ``a1c``, the letters taken from out_grad."),
    grad_signature=f"x: T, index: T, value: T, out: T, out_grad: T, {_PS_SIG}", grad_name="put_along_axis_grad",
)  # fmt: skip
_IP_KEY = "x, len(indices), _index_put_key(x, indices, value)"
declare(
    "index_put", "x: T, indices: [T], value: T, accumulate: bool = False",
    Way(partial(_index_put, False), key=_IP_KEY, env=_ENV, nonempty=("indices",),
        paddle="IndexPutInferSpmd", doc="IndexPutInferSpmd: the indexed axes replicated, indices replicated, value "
        "replicated or sharded as x's last axis where it broadcasts onto it."),
    grad=Way(partial(_index_put, True), key=_IP_KEY, env=_ENV, nonempty=("indices",), same=[("x", "out_grad")],
             post=_grad_post, post_if=_unit,
             paddle="IndexPutGradInferSpmd", doc="IndexPutGradInferSpmd: x, out_grad, x_grad as the forward's x; "
             "value_grad partial SUM over the mesh dims of the trailing axes it sums over."),
    grad_signature="x: T, indices: [T], value: T, out_grad: T, accumulate: bool = False", grad_name="index_put_grad",
)  # fmt: skip


# -- output shapes / grads ----------------------------------------------------------------------


def _take_shape(a: Args) -> list[Expect]:
    return [a.s("index")]


facts("put_along_axis", "index_put", shape=same)
facts("put_along_axis", grad="put_along_axis_grad", wrt=("x", "value"))
facts("take_along_axis", shape=_take_shape, grad="take_along_axis_grad", wrt=("x",))
facts("put_along_axis_grad", "index_put_grad", grad_like=("x", "value"))


# -- cost

facts("take_along_axis", cost=lookup)
facts("take_along_axis_grad", cost=scatter_grad)
facts("put_along_axis", "put_along_axis_grad", "index_put", "index_put_grad", cost=copy)
