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

import math

from spmdkit.core.errors import InvalidArgumentError, InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.axes import normalize_axis
from spmdkit.engine.declare import Way, declare
from spmdkit.engine.facts import facts
from spmdkit.engine.notation import BROADCAST, Notation
from spmdkit.engine.outshape import Args, Expect, Shape, UnknownShape, axis_of
from spmdkit.ops._cost import copy


def replicated(ins: tuple[int, ...], outs: tuple[int, ...]) -> Notation:
    """Every tensor unsharded: each labelled ``1`` per axis (rank -1: an absent tensor)."""
    return Notation([None if r < 0 else BROADCAST * r for r in ins], [None if r < 0 else BROADCAST * r for r in outs])


def nonzero_notation(nd: int, cols: int = -1) -> Notation:
    """x and out ``[nnz, x.ndim]`` replicated (``cols``: the reverse's out.shape[1])."""
    if cols >= 0 and cols != nd:
        raise ShapeMismatchError(f"out's second axis has size {cols}, x has {nd} dims")
    return replicated((nd,), (2,))


def unique_notation(nd: int, ri: bool, rv: bool, rc: bool, axis: tuple[int, ...]) -> Notation:
    """x and every output replicated: out 1-D without axis (x's rank with it), index, inverse
    and counts 1-D and absent unless asked for."""
    if len(axis) > 1:
        raise InvalidAttributeError(f"axis must hold at most one axis, got {list(axis)}")
    if axis and nd == 0:
        raise InvalidAttributeError(f"axis {axis[0]} given for a 0-d x")
    if axis:
        normalize_axis("", axis[0], nd)
    return replicated((nd,), (nd if axis else 1, 1 if ri else -1, 1 if rv else -1, 1 if rc else -1))


def _unasked(given: tuple[DistTensorSpec | None, ...], flags: tuple[bool, ...]) -> None:
    """unique's reverse: an output given that was not asked for."""
    for name, attr, t, flag in zip(("indices", "inverse", "counts"), ("index", "inverse", "counts"), given, flags):
        if t is not None and not flag:
            raise InvalidArgumentError(f"{name} given but return_{attr} is False")


declare(
    "nonzero", "x: T",
    Way(nonzero_notation, key="x", shapes="x: _ ...", paddle="NonZeroInferSpmd",
        doc="NonZeroInferSpmd: x and out ([nnz, x.ndim], data-dependent rows) replicated."),
    reverse=Way(nonzero_notation, key="x, out.shape[1]", shapes="x: _ ...; out: _ _", paddle="NonZeroInferSpmdReverse",
                doc="NonZeroInferSpmdReverse: everything replicated; out's row count is not checked."),
    outputs="out: T",
)  # fmt: skip
def _unique_unasked(indices: DistTensorSpec | None, inverse: DistTensorSpec | None, counts: DistTensorSpec | None,
                    return_index: bool, return_inverse: bool, return_counts: bool) -> None:  # fmt: skip
    _unasked((indices, inverse, counts), (return_index, return_inverse, return_counts))


_US_SIG = ("return_index: bool = False, return_inverse: bool = False, return_counts: bool = False, "
           "axis: ints = [], dtype: any = 'int64'")
_US_KEY = "x, return_index, return_inverse, return_counts, tuple(axis)"
declare(
    "unique", f"x: T, {_US_SIG}",
    Way(unique_notation, key=_US_KEY, paddle="UniqueInferSpmd",
        doc="UniqueInferSpmd: all replicated; out 1-D without axis; absent outputs None."),
    reverse=Way(unique_notation, key=_US_KEY, shapes="indices: _; inverse: _; counts: _", letters=True,
                check=_unique_unasked, paddle="unique reverse (spmdkit)",
                doc="unique reverse (spmdkit): all replicated; only the outputs' ranks are checked."),
    outputs="out: T, indices: T? = None, inverse: T? = None, counts: T? = None",
)  # fmt: skip


# -- output shapes --------------------------------------------------------------------------------


def _nonzero_shape(a: Args) -> list[Expect]:
    return [(None, len(a.s("x")))]


def _unique_shape(a: Args) -> list[Expect]:
    """out, indices and counts have as many entries as distinct values (data): only their
    other axes are checked; inverse has one entry per element of x (per slice along axis)."""
    x = a.s("x")
    axes = a.a("axis") or ()
    if len(axes) > 1:
        raise UnknownShape
    if axes:
        ax = axis_of(axes[0], len(x))
        out: Shape = (*x[:ax], None, *x[ax + 1:])
        inverse: Shape = (x[ax],)
    else:
        out, inverse = (None,), (math.prod(x),)
    shapes: list[Shape] = [out, (None,), inverse, (None,)]
    return [s if a.nd(i) == len(s) else None for i, s in enumerate(shapes)]


facts("nonzero", shape=_nonzero_shape,
      unchecked="out's first axis is the number of nonzero elements (data); its second axis is checked")
facts("unique", shape=_unique_shape,
      unchecked="out's, indices' and counts' length is the number of distinct values (data); inverse and out's "
                "other axes are checked")


# -- cost

facts("nonzero", "unique", cost=copy)
