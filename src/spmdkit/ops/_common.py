"""Shape checks shared by the rule families (errors name the op and the argument)."""

from __future__ import annotations

from spmdkit.core.errors import ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.shapes import mismatch


def check_ndim(op: str, name: str, t: DistTensorSpec, nd: int) -> None:
    if len(t.shape) != nd:
        raise ShapeMismatchError(f"{op}: {name} must be a {nd}-D tensor, got shape {list(t.shape)}")


def check_same_ndim(op: str, t: DistTensorSpec, n: int, name: str, what: str) -> None:
    if len(t.shape) != n:
        raise ShapeMismatchError(f"{op}: {name} has {len(t.shape)} dims, but {what} has {n}")


def check_same_shape(op: str, t: DistTensorSpec, shape: tuple[int, ...], name: str, what: str) -> None:
    """``t`` has ``shape`` (unknown sizes, -1, match anything)."""
    check_same_ndim(op, t, len(shape), name, what)
    i = mismatch(shape, t.shape)
    if i is not None:
        raise ShapeMismatchError(f"{op}: {name} axis {i} has size {t.shape[i]}, but {what} has {shape[i]}")


def check_like(op: str, a: DistTensorSpec, b: DistTensorSpec, na: str, nb: str) -> None:
    """``b`` has ``a``'s shape (unknown sizes, -1, match anything)."""
    i = mismatch(a.shape, b.shape)
    if i == -1:
        raise ShapeMismatchError(f"{op}: {nb} has {len(b.shape)} dims, expected {len(a.shape)} (as {na})")
    if i is not None:
        raise ShapeMismatchError(f"{op}: {na} and {nb} differ on axis {i} ({a.shape[i]} vs {b.shape[i]})")
