"""Ops whose output sizes depend on the data: nonzero and unique. Everything is replicated;
the data-dependent sizes are never checked, only the ranks.

- ``nonzero`` (NonZeroInferSpmd(x) / NonZeroInferSpmdReverse(x, out)): ``abc -> 11``: all
  replicated. The output's row count is data-dependent; the rule takes whatever shape it
  is given (2-D, second size x.ndim) and assumes nothing else about it.
- ``unique`` (UniqueInferSpmd(x, return_index, return_inverse, return_counts, axis,
  dtype)): everything replicated; out is 1-D without ``axis`` (x.ndim-D with it), index,
  inverse and counts 1-D and absent (None) unless asked for. Paddle has no backward; the
  reverse built here (x, out, indices, inverse, counts, ...) answers the same: the sizes of
  the data-dependent outputs are never checked, only their ranks.

Deviations from Paddle 3.3.1 (docs/deviations.md, ``misc-*``): conflicts Paddle raises on
(nonzero); illegal input Paddle accepts (nonzero's ``[1, 1, 1]``).
"""

from __future__ import annotations

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import InvalidArgumentError, InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import normalize_axis
from spmdkit.engine.compile import infer
from spmdkit.engine.notation import fast_result, named_mesh
from spmdkit.rules._common import replicated_plan
from spmdkit.rules.registry import register

_make = TensorDistAttr.unchecked


# ---------------------------------------------------------------------------
# nonzero, unique: replicated
# ---------------------------------------------------------------------------


def _replicated(op: str, x: DistTensorSpec, outs: tuple[int, ...]) -> SpmdResult:
    """x and outputs of ranks ``outs`` replicated (the answer needs nothing else of a call)."""
    return fast_result(*infer(replicated_plan((len(x.shape),), outs), op, (x,), (), x.dist_attr.mesh, ("x",)))


def _nonzero_check(op: str, x: DistTensorSpec) -> None:
    if len(x.shape) == 0:
        raise ShapeMismatchError(f"{op}: x must have at least 1 dim (nonzero of a 0-d tensor is undefined)")


def nonzero_forward(x: DistTensorSpec) -> SpmdResult:
    """NonZeroInferSpmd: x and out ([nnz, x.ndim], data-dependent rows) replicated."""
    _nonzero_check("nonzero", x)
    return _replicated("nonzero", x, (2,))


def nonzero_backward(x: DistTensorSpec, out: DistTensorSpec) -> SpmdResult:
    """NonZeroInferSpmdReverse: everything replicated; out's row count is not checked."""
    op = "nonzero"
    named_mesh(op, (("x", x), ("out", out)))  # raises where they disagree
    _nonzero_check(op, x)
    if len(out.shape) != 2:
        raise ShapeMismatchError(f"{op}: out must be 2-D ([nnz, x.ndim]), got {len(out.shape)} dims")
    if out.shape[1] >= 0 and out.shape[1] != len(x.shape):
        raise ShapeMismatchError(f"{op}: out's second axis has size {out.shape[1]}, x has {len(x.shape)} dims")
    return _replicated(op, x, (2,))


def _unique_axis(op: str, nd: int, axis: tuple[int, ...]) -> int | None:
    if not axis:
        return None
    if len(axis) > 1:
        raise InvalidAttributeError(f"{op}: axis must hold at most one axis, got {list(axis)}")
    if nd == 0:
        raise InvalidAttributeError(f"{op}: axis {axis[0]} given for a 0-d x")
    return normalize_axis(op, axis[0], nd)


def _unique_outs(nd: int, ax: int | None, ri: bool, rv: bool, rc: bool) -> tuple[int, ...]:
    """The ranks of out, index, inverse and counts (-1: absent)."""
    return (1 if ax is None else nd, 1 if ri else -1, 1 if rv else -1, 1 if rc else -1)


def unique_forward(
    x: DistTensorSpec, return_index: bool = False, return_inverse: bool = False, return_counts: bool = False,
    axis: tuple[int, ...] = (), dtype: object = "int64",
) -> SpmdResult:
    """UniqueInferSpmd: all replicated; out 1-D without axis; absent outputs None."""
    op = "unique"
    nd = len(x.shape)
    ax = _unique_axis(op, nd, axis)
    return _replicated(op, x, _unique_outs(nd, ax, return_index, return_inverse, return_counts))


def unique_backward(
    x: DistTensorSpec, out: DistTensorSpec, indices: DistTensorSpec | None = None,
    inverse: DistTensorSpec | None = None, counts: DistTensorSpec | None = None,
    return_index: bool = False, return_inverse: bool = False, return_counts: bool = False,
    axis: tuple[int, ...] = (), dtype: object = "int64",
) -> SpmdResult:
    """unique reverse (spmdkit): all replicated; only the outputs' ranks are checked."""
    op = "unique"
    named_mesh(op, (("x", x), ("out", out), ("indices", indices), ("inverse", inverse), ("counts", counts)))
    nd = len(x.shape)
    ax = _unique_axis(op, nd, axis)
    want = 1 if ax is None else nd
    if len(out.shape) != want:
        raise ShapeMismatchError(f"{op}: out has {len(out.shape)} dims, expected {want}")
    for name, t, flag, attr in (("indices", indices, return_index, "return_index"),
                                ("inverse", inverse, return_inverse, "return_inverse"),
                                ("counts", counts, return_counts, "return_counts")):
        if t is not None and len(t.shape) != 1:
            raise ShapeMismatchError(f"{op}: {name} must be 1-D, got {len(t.shape)} dims")
        if t is not None and not flag:
            raise InvalidArgumentError(f"{op}: {name} given but {attr} is False")
    return _replicated(op, x, _unique_outs(nd, ax, return_index, return_inverse, return_counts))




register("nonzero", nonzero_forward, "x: T", nonzero_backward, kind="reverse", outputs="out: T",
         forward_name="NonZeroInferSpmd", backward_name="NonZeroInferSpmdReverse")  # fmt: skip
_US_SIG = ("return_index: bool = False, return_inverse: bool = False, return_counts: bool = False, "
      "axis: ints = [], dtype: any = 'int64'")
register("unique", unique_forward, f"x: T, {_US_SIG}", unique_backward,
         kind="reverse", outputs="out: T, indices: T? = None, inverse: T? = None, counts: T? = None",
         forward_name="UniqueInferSpmd", backward_name="unique reverse (spmdkit)")  # fmt: skip
