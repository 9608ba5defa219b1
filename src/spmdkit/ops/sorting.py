"""Sorting and positional scans along an axis: argsort, cummax, cummin and roll, with their
grads. The axis they act along is replicated (each output element depends on the whole axis).

Notation (x ``abc``). Partial inputs are made replicated. Except for argsort (which keeps
co-shards, as Paddle's rule does), a co-sharded axis is read as one mesh dim, its largest (the
first of equal sizes), as Paddle 3.3.1's rules read ``dims_mapping()``.

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

from collections.abc import Iterable
from functools import partial

from spmdkit.core.errors import InvalidAttributeError
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.axes import normalize_axis
from spmdkit.engine.declare import Way, declare
from spmdkit.engine.facts import facts
from spmdkit.engine.notation import Coshard, Notation, letters_for
from spmdkit.engine.outshape import same
from spmdkit.ops._common import check_same_ndim
from spmdkit.ops._cost import copy


def notation(n_in: int, n_out: int, coshard: Coshard, nd: int, axis: int, source: int = -1) -> Notation:
    """``abc, ... -> abc, ...`` (``n_in`` / ``n_out`` tensors of x's rank), the axis replicated;
    ``source``: the one input merged (-1: all)."""
    a = letters_for(nd)
    ax = normalize_axis("", axis, nd)
    return Notation([a] * n_in, [a] * n_out, replicated=a[ax : ax + 1], coshard=coshard,
                    sources=None if source < 0 else (source,))  # fmt: skip


def roll_notation(n_in: int, coshard: Coshard, nd: int, shifts: int, axis: tuple[int, ...]) -> Notation:
    """``abc(, abc) -> abc`` with the rolled axes replicated (every axis for a flattened roll);
    ``shifts``: how many shifts are given."""
    if not axis:
        if shifts != 1:
            raise InvalidAttributeError(f"without axis, shifts must have 1 entry, got {shifts}")
        rolled: Iterable[int] = range(nd)
    elif len(axis) != shifts:
        raise InvalidAttributeError(f"axis has {len(axis)} entries but shifts has {shifts} (they must be equal)")
    else:
        rolled = sorted({normalize_axis("", a, nd) for a in axis}) if nd else ()
    a = letters_for(nd)
    return Notation([a] * n_in, [a], replicated="".join(a[i] for i in rolled), coshard=coshard)


def _cum_grad_ranks(op: str, x: DistTensorSpec, indices: DistTensorSpec, out_grad: DistTensorSpec) -> None:
    check_same_ndim(op, indices, len(x.shape), "indices", "x")
    check_same_ndim(op, out_grad, len(x.shape), "out_grad", "x")


_AG_SIG = "axis: int = -1, descending: bool = False, stable: bool = False"
declare(
    "argsort", f"x: T, {_AG_SIG}",
    Way(partial(notation, 1, 2, Coshard.KEEP), key="x, axis", paddle="ArgSortInferSpmd",
        doc="ArgSortInferSpmd: x, out and indices sharded as x with the sorted axis replicated."),
    grad=Way(partial(notation, 3, 1, Coshard.KEEP), key="x, axis, 1", same=[("x", "indices"), ("x", "out_grad")],
             paddle="ArgSortGradInferSpmd",
             doc="ArgSortGradInferSpmd: indices, x, out_grad and x_grad take x's mapping, axis replicated."),
    grad_signature=f"indices: T, x: T, out_grad: T, {_AG_SIG}", grad_name="argsort_grad",
)  # fmt: skip
_CS_SIG = "axis: int = -1, dtype: any = 'int64'"
for _op, _fn in (("cummax", "CummaxInferSpmd"), ("cummin", "CumminInferSpmd")):
    declare(
        _op, f"x: T, {_CS_SIG}",
        Way(partial(notation, 1, 2, Coshard.LARGEST), key="x, axis", paddle=_fn,
            doc=f"{_fn}: out and indices sharded as x, the scanned axis replicated."),
        # the axis' size is not checked (Paddle's own unit test passes an out_grad of another size)
        grad=Way(partial(notation, 3, 1, Coshard.LARGEST), key="x, axis", check=_cum_grad_ranks,
                 paddle=_fn.replace("InferSpmd", "GradInferSpmd"),
                 doc=f"{_fn.replace('Infer', 'GradInfer')}: non-axis letters merged, axis replicated."),
        grad_signature=f"x: T, indices: T, out_grad: T, {_CS_SIG}", grad_name=f"{_op}_grad",
    )  # fmt: skip
_RS_SIG = "shifts: ints, axis: ints = []"
_ROLL_KEY = "x, len(shifts), tuple(axis)"
declare(
    "roll", f"x: T, {_RS_SIG}",
    Way(partial(roll_notation, 1, Coshard.LARGEST), key=_ROLL_KEY, paddle="RollInferSpmd",
        doc="RollInferSpmd: the rolled axes replicated (all of them for a flattened roll)."),
    grad=Way(partial(roll_notation, 2, Coshard.LARGEST), key=_ROLL_KEY, same=[("x", "out_grad")], paddle="RollGradInferSpmd",
             doc="RollGradInferSpmd: x and out_grad merged, rolled axes replicated, x_grad as x."),
    grad_signature=f"x: T, out_grad: T, {_RS_SIG}", grad_name="roll_grad",
)  # fmt: skip


# -- output shapes --------------------------------------------------------------------------------

facts("argsort", "cummax", "cummin", "roll", shape=same)


# -- cost

facts("argsort", "argsort_grad", "cummax", "cummax_grad", "cummin", "cummin_grad", "roll", "roll_grad", cost=copy)
