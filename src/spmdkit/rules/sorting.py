"""Sorting and positional scans along an axis: argsort, cummax, cummin and roll, with their
grads. The axis they act along is replicated (each output element depends on the whole axis).

Notation (x ``abc``). Partial inputs are made replicated. Except for argsort (which keeps co-shards, as
Paddle's rule does), a co-sharded axis is read as one mesh dim, its
largest (the first of equal sizes), as Paddle 3.3.1's rules read ``dims_mapping()``.

- ``argsort`` (ArgSortInferSpmd(x, axis, descending, stable)): ``abc -> abc, abc`` (out,
  indices), the sorted axis replicated, co-shards kept. Paddle registers
  ArgSortGradInferSpmd(indices, x, out_grad, ...) as its backward; it is also
  ``argsort_grad``: every tensor takes x's mapping with the axis replicated (Paddle raises
  where indices and x are sharded differently; spmdkit answers, indices are resharded).
- ``cummax`` / ``cummin`` (CummaxInferSpmd / CumminInferSpmd(x, axis, dtype)): as argsort.
  Grads (CummaxGradInferSpmd(x, indices, out_grad, axis, dtype), also the backward slot):
  ``abc, abc, abc -> abc``, the non-axis letters merged over the three tensors (a conflict
  is resolved: the larger tensor keeps its sharding), the axis replicated.
- ``roll`` (RollInferSpmd(x, shifts, axis)): ``abc -> abc`` with the rolled axes replicated
  (an empty ``axis`` rolls the flattened tensor: every axis replicated). Backward slot and
  ``roll_grad`` (RollGradInferSpmd(x, out_grad, shifts, axis)): x and out_grad merged, the
  rolled axes replicated, x_grad as x.

Deviations from Paddle 3.3.1 (docs/deviations.md, ``misc-*``): conflicts Paddle raises on
(argsort_grad, roll_grad).
"""

from __future__ import annotations

from functools import lru_cache

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import InvalidAttributeError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import normalize_axis, one_mesh_dim_per_axis
from spmdkit.engine.compile import Plan, compile_plan, infer
from spmdkit.engine.notation import Notation, fast_result, named_mesh
from spmdkit.rules._common import axis_plan, check_same_ndim, check_same_shape, letters, merge_project
from spmdkit.rules.registry import register

_make = TensorDistAttr.unchecked


# ---------------------------------------------------------------------------
# argsort, cummax, cummin: the axis replicated
# ---------------------------------------------------------------------------


def _axis_cleared(op: str, x: DistTensorSpec, axis: int, coshard: str = "keep") -> SpmdResult:
    """x -> out, indices: sharded as x with the axis replicated."""
    nd = len(x.shape)
    ax = normalize_axis(op, axis, nd)
    return fast_result(*infer(axis_plan(nd, ax, 1, 2, coshard), op, (x,), (), x.dist_attr.mesh, ("x",)))


def argsort_forward(x: DistTensorSpec, axis: int = -1, descending: bool = False, stable: bool = False) -> SpmdResult:
    """ArgSortInferSpmd: x, out and indices sharded as x with the sorted axis replicated."""
    return _axis_cleared("argsort", x, axis)


def argsort_grad(
    indices: DistTensorSpec, x: DistTensorSpec, out_grad: DistTensorSpec, axis: int = -1,
    descending: bool = False, stable: bool = False,
) -> SpmdResult:
    """ArgSortGradInferSpmd: indices, x, out_grad and x_grad take x's mapping, axis replicated."""
    op = "argsort_grad"
    named_mesh(op, (("indices", indices), ("x", x), ("out_grad", out_grad)))
    check_same_shape(op, indices, x.shape, "indices", "x")
    check_same_shape(op, out_grad, x.shape, "out_grad", "x")
    nd = len(x.shape)
    p = axis_plan(nd, normalize_axis(op, axis, nd), 3, 1, source=1)
    return fast_result(*infer(p, op, (indices, x, out_grad), (), x.dist_attr.mesh, ("indices", "x", "out_grad")))


def _make_cum(op: str, fwd_name: str):  # type: ignore[no-untyped-def]
    def forward(x: DistTensorSpec, axis: int = -1, dtype: object = "int64") -> SpmdResult:
        return _axis_cleared(op, x, axis, "largest")

    def grad(
        x: DistTensorSpec, indices: DistTensorSpec, out_grad: DistTensorSpec, axis: int = -1,
        dtype: object = "int64",
    ) -> SpmdResult:
        g = f"{op}_grad"
        mesh = named_mesh(g, (("x", x), ("indices", indices), ("out_grad", out_grad)))
        nd = len(x.shape)
        check_same_ndim(g, indices, nd, "indices", "x")
        check_same_ndim(g, out_grad, nd, "out_grad", "x")
        ax = normalize_axis(g, axis, nd)
        if nd == 0:
            a = _make(mesh, ())
            return fast_result((a, a, a), (a,))
        # the axis' size is not checked (Paddle's own unit test passes an out_grad of another size)
        s = letters(g, nd)
        n = Notation((s, s, s), (s,), replicated=s[ax])
        ins, outs = merge_project(n, (s, s, s), (one_mesh_dim_per_axis(x), one_mesh_dim_per_axis(indices), one_mesh_dim_per_axis(out_grad)), mesh)
        return fast_result(tuple(ins), tuple(outs))

    forward.__name__ = f"{op}_forward"
    forward.__doc__ = f"{fwd_name}: out and indices sharded as x, the scanned axis replicated."
    grad.__name__ = f"{op}_grad"
    grad.__doc__ = f"{fwd_name.replace('Infer', 'GradInfer')}: non-axis letters merged, axis replicated."
    return forward, grad


# ---------------------------------------------------------------------------
# roll
# ---------------------------------------------------------------------------


def _roll_axes(op: str, nd: int, shifts: tuple[int, ...], axis: tuple[int, ...]) -> frozenset[int]:
    if not axis:
        if len(shifts) != 1:
            raise InvalidAttributeError(f"{op}: without axis, shifts must have 1 entry, got {len(shifts)}")
        return frozenset(range(nd))
    if len(axis) != len(shifts):
        raise InvalidAttributeError(
            f"{op}: axis has {len(axis)} entries but shifts has {len(shifts)} (they must be equal)"
        )
    return frozenset(normalize_axis(op, a, nd) for a in axis) if nd else frozenset()


def roll_forward(x: DistTensorSpec, shifts: tuple[int, ...] = (), axis: tuple[int, ...] = ()) -> SpmdResult:
    """RollInferSpmd: the rolled axes replicated (all of them for a flattened roll)."""
    nd = len(x.shape)
    p = _roll_plan(nd, tuple(sorted(_roll_axes("roll", nd, shifts, axis))))
    return fast_result(*infer(p, "roll", (x,), (), x.dist_attr.mesh, ("x",)))


@lru_cache(maxsize=1024)
def _roll_plan(nd: int, rolled: tuple[int, ...]) -> Plan:
    """``abc -> abc``, the rolled axes replicated, each co-shard read as its largest mesh dim."""
    s = letters("roll", nd)
    return compile_plan(Notation((s,), (s,), replicated="".join(s[i] for i in rolled), coshard="largest"))


def roll_grad(
    x: DistTensorSpec, out_grad: DistTensorSpec, shifts: tuple[int, ...] = (), axis: tuple[int, ...] = ()
) -> SpmdResult:
    """RollGradInferSpmd: x and out_grad merged, rolled axes replicated, x_grad as x."""
    op = "roll_grad"
    mesh = named_mesh(op, (("x", x), ("out_grad", out_grad)))
    nd = len(x.shape)
    check_same_shape(op, out_grad, x.shape, "out_grad", "x")
    rolled = _roll_axes(op, nd, shifts, axis)
    s = letters(op, nd)
    n = Notation((s, s), (s,), replicated="".join(s[i] for i in rolled))
    ins, outs = merge_project(n, (s, s), (one_mesh_dim_per_axis(x), one_mesh_dim_per_axis(out_grad)), mesh)
    return fast_result(tuple(ins), tuple(outs))


_AG_SIG = "axis: int = -1, descending: bool = False, stable: bool = False"
register("argsort", argsort_forward, f"x: T, {_AG_SIG}", argsort_grad, f"indices: T, x: T, out_grad: T, {_AG_SIG}", kind="grad", grad_name="argsort_grad",
         forward_name="ArgSortInferSpmd", backward_name="ArgSortGradInferSpmd")  # fmt: skip
_CS_SIG = "axis: int = -1, dtype: any = 'int64'"
for _op, _fn in (("cummax", "CummaxInferSpmd"), ("cummin", "CumminInferSpmd")):
    _f, _g = _make_cum(_op, _fn)
    register(_op, _f, f"x: T, {_CS_SIG}", _g, f"x: T, indices: T, out_grad: T, {_CS_SIG}", kind="grad",
             grad_name=f"{_op}_grad", forward_name=_fn, backward_name=_fn.replace("InferSpmd", "GradInferSpmd"))
_RS_SIG = "shifts: ints, axis: ints = []"
register("roll", roll_forward, f"x: T, {_RS_SIG}", roll_grad, f"x: T, out_grad: T, {_RS_SIG}", kind="grad", grad_name="roll_grad",
         forward_name="RollInferSpmd", backward_name="RollGradInferSpmd")  # fmt: skip
