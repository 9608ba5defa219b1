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

from spmdkit.core.errors import InvalidArgumentError, InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.axes import normalize_axis
from spmdkit.engine.declare import Way, declare
from spmdkit.engine.notation import BROADCAST, Notation


def replicated(ins: tuple[int, ...], outs: tuple[int, ...]) -> Notation:
    """Every tensor unsharded: each labelled ``1`` per axis (rank -1: an absent tensor)."""
    return Notation([None if r < 0 else BROADCAST * r for r in ins], [None if r < 0 else BROADCAST * r for r in outs])


def _nonzero(x: DistTensorSpec, out: DistTensorSpec | None = None) -> None:
    if len(x.shape) == 0:
        raise ShapeMismatchError("x must have at least 1 dim (nonzero of a 0-d tensor is undefined)")
    if out is None:
        return
    if len(out.shape) != 2:
        raise ShapeMismatchError(f"out must be 2-D ([nnz, x.ndim]), got {len(out.shape)} dims")
    if out.shape[1] >= 0 and out.shape[1] != len(x.shape):
        raise ShapeMismatchError(f"out's second axis has size {out.shape[1]}, x has {len(x.shape)} dims")


def _unique_axis(nd: int, axis: tuple[int, ...]) -> int | None:
    if not axis:
        return None
    if len(axis) > 1:
        raise InvalidAttributeError(f"axis must hold at most one axis, got {list(axis)}")
    if nd == 0:
        raise InvalidAttributeError(f"axis {axis[0]} given for a 0-d x")
    return normalize_axis("", axis[0], nd)


def unique_notation(nd: int, ri: bool, rv: bool, rc: bool, axis: tuple[int, ...]) -> Notation:
    """x and every output replicated: out 1-D without axis (x's rank with it), index, inverse
    and counts 1-D and absent unless asked for."""
    ax = _unique_axis(nd, axis)
    return replicated((nd,), (1 if ax is None else nd, 1 if ri else -1, 1 if rv else -1, 1 if rc else -1))


def _unique_reverse(x: DistTensorSpec, out: DistTensorSpec, indices: DistTensorSpec | None,
                    inverse: DistTensorSpec | None, counts: DistTensorSpec | None, return_index: bool,
                    return_inverse: bool, return_counts: bool, axis: tuple[int, ...], dtype: object) -> None:
    """Only the outputs' ranks are checked (their sizes depend on the data)."""
    nd = len(x.shape)
    want = 1 if _unique_axis(nd, tuple(axis)) is None else nd
    if len(out.shape) != want:
        raise ShapeMismatchError(f"out has {len(out.shape)} dims, expected {want}")
    for name, t, flag, attr in (("indices", indices, return_index, "return_index"),
                                ("inverse", inverse, return_inverse, "return_inverse"),
                                ("counts", counts, return_counts, "return_counts")):
        if t is not None and len(t.shape) != 1:
            raise ShapeMismatchError(f"{name} must be 1-D, got {len(t.shape)} dims")
        if t is not None and not flag:
            raise InvalidArgumentError(f"{name} given but {attr} is False")


declare(
    "nonzero", "x: T",
    Way(lambda nd: replicated((nd,), (2,)), key="x", check="_nonzero(x)", env={"_nonzero": _nonzero},
        paddle="NonZeroInferSpmd", doc="NonZeroInferSpmd: x and out ([nnz, x.ndim], data-dependent rows) replicated."),
    reverse=Way(lambda nd, _: replicated((nd,), (2,)), check="_nonzero(x, out)", env={"_nonzero": _nonzero},
                paddle="NonZeroInferSpmdReverse",
                doc="NonZeroInferSpmdReverse: everything replicated; out's row count is not checked."),
    outputs="out: T",
)  # fmt: skip
_US_SIG = ("return_index: bool = False, return_inverse: bool = False, return_counts: bool = False, "
           "axis: ints = [], dtype: any = 'int64'")
_US_KEY = "x, return_index, return_inverse, return_counts, tuple(axis)"
declare(
    "unique", f"x: T, {_US_SIG}",
    Way(unique_notation, key=_US_KEY, paddle="UniqueInferSpmd",
        doc="UniqueInferSpmd: all replicated; out 1-D without axis; absent outputs None."),
    reverse=Way(unique_notation, key=_US_KEY, check=_unique_reverse, paddle="unique reverse (spmdkit)",
                doc="unique reverse (spmdkit): all replicated; only the outputs' ranks are checked."),
    outputs="out: T, indices: T? = None, inverse: T? = None, counts: T? = None",
)  # fmt: skip
