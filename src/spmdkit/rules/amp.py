"""Automatic mixed precision loss scaling: check_finite_and_unscale and update_loss_scaling.

Notation::

    check_finite_and_unscale  xs, 1 -> xs, 1        (xs keep their sharding, partial dropped; scale
                           replicated; found_infinite partial MAX over the mesh dims of the xs)
    update_loss_scaling    xs, 1, 1, 1, 1 -> xs, 1, 1, 1  (xs as given less partial; the four
                           [1] state tensors replicated)

check_finite_and_unscale's found_infinite is data-dependent: a rank's flag covers its own
shards, so it is partial MAX over the mesh dims that shard any x; update_loss_scaling needs it
(and the loss-scaling state) whole.

Deviations from Paddle 3.3.1 (``docs/deviations.md`` ``moe-amp-*``): check_finite_and_unscale and
update_loss_scaling replicate the [1] scale / state tensors (Paddle keeps them as given). Each
reverse rule (Paddle has none) infers the inputs from the outputs and returns the outputs those
inputs produce.
"""

from __future__ import annotations

from collections.abc import Sequence

from spmdkit.core.dist_attr import ReduceType, TensorDistAttr, entry_dims
from spmdkit.core.errors import InvalidArgumentError, InvalidAttributeError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.notation import named_mesh
from spmdkit.rules._common import check_int
from spmdkit.rules.registry import register

_make = TensorDistAttr.unchecked


# -- check_finite_and_unscale / update_loss_scaling -------------------------------------------------


def _scalar_state(op: str, name: str, t: DistTensorSpec, mesh: ProcessMesh) -> TensorDistAttr:
    if len(t.shape) > 1 or any(s not in (1, -1) for s in t.shape):
        raise ShapeMismatchError(f"{op}: {name} must hold one element (shape [1]), got {list(t.shape)}")
    return _make(mesh, (-1,) * len(t.shape))


def _plain(xs: Sequence[DistTensorSpec], mesh: ProcessMesh) -> tuple[TensorDistAttr, ...]:
    """Each x with its dims_mapping, partial dropped."""
    out = []
    for t in xs:
        a = t.dist_attr
        out.append(_make(mesh, a.dims_mapping) if a.partial else a)
    return tuple(out)


def _found_inf(xs: Sequence[TensorDistAttr], mesh: ProcessMesh, ndim: int) -> TensorDistAttr:
    dims = sorted({d for a in xs for e in a.dims_mapping for d in entry_dims(e)})
    return _make(mesh, (-1,) * ndim, tuple((d, ReduceType.MAX) for d in dims))


def _check_xs(op: str, xs: Sequence[DistTensorSpec], name: str = "xs") -> None:
    if not xs:
        raise InvalidArgumentError(f"{op}: {name} must hold at least one tensor")


def cfu_forward(xs: Sequence[DistTensorSpec], scale: DistTensorSpec) -> SpmdResult:
    """check_finite_and_unscale (CheckFiniteAndUnscaleSpmd): each x keeps its sharding (partial
    dropped), scale replicated; out as xs, found_infinite partial MAX over the xs' mesh dims."""
    op = "check_finite_and_unscale"
    _check_xs(op, xs)
    mesh = named_mesh(op, [*((f"xs[{i}]", t) for i, t in enumerate(xs)), ("scale", scale)])
    sc = _scalar_state(op, "scale", scale, mesh)
    xa = _plain(xs, mesh)
    return SpmdResult((xa, sc), (xa, _found_inf(xa, mesh, 1)))


def cfu_reverse(xs: Sequence[DistTensorSpec], scale: DistTensorSpec, out: Sequence[DistTensorSpec],
                found_infinite: DistTensorSpec) -> SpmdResult:
    """check_finite_and_unscale reverse (Paddle has none): each x as its out (partial dropped),
    scale replicated; the outputs those inputs produce."""
    op = "check_finite_and_unscale"
    _check_xs(op, xs)
    if len(out) != len(xs):
        raise ShapeMismatchError(f"{op}: out has {len(out)} tensors but xs has {len(xs)}")
    mesh = named_mesh(op, [*((f"xs[{i}]", t) for i, t in enumerate(xs)), ("scale", scale),
                           *((f"out[{i}]", t) for i, t in enumerate(out)), ("found_infinite", found_infinite)])
    for i, (x, o) in enumerate(zip(xs, out)):
        if len(x.shape) != len(o.shape):
            raise ShapeMismatchError(f"{op}: out[{i}] has {len(o.shape)} dims but xs[{i}] has {len(x.shape)}")
    sc = _scalar_state(op, "scale", scale, mesh)
    _scalar_state(op, "found_infinite", found_infinite, mesh)
    xa = _plain(out, mesh)
    return SpmdResult((xa, sc), (xa, _found_inf(xa, mesh, 1)))


def _uls_attrs(op: str, incr_every_n_steps: object, decr_every_n_nan_or_inf: object, incr_ratio: object,
               decr_ratio: object, stop_update: object) -> None:
    check_int(op, "incr_every_n_steps", incr_every_n_steps)
    check_int(op, "decr_every_n_nan_or_inf", decr_every_n_nan_or_inf)
    for n, v in (("incr_ratio", incr_ratio), ("decr_ratio", decr_ratio)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InvalidAttributeError(f"{op}: {n} must be a number, got {v!r}")
    if not isinstance(stop_update, (bool, int, float)):
        raise InvalidAttributeError(f"{op}: stop_update must be a bool, got {stop_update!r}")


_STATE = ("found_infinite", "prev_loss_scaling", "in_good_steps", "in_bad_steps")


def _uls(op: str, xs: Sequence[DistTensorSpec], state: Sequence[DistTensorSpec],
         extra: Sequence[tuple[str, DistTensorSpec]], src: Sequence[DistTensorSpec]) -> SpmdResult:
    _check_xs(op, xs)
    mesh = named_mesh(op, [*((f"xs[{i}]", t) for i, t in enumerate(xs)), *zip(_STATE, state), *extra])
    st = tuple(_scalar_state(op, n, t, mesh) for n, t in zip(_STATE, state))
    xa = _plain(src, mesh)
    one = _make(mesh, (-1,))
    return SpmdResult((xa, *st), (xa, one, one, one))


def uls_forward(xs: Sequence[DistTensorSpec], found_infinite: DistTensorSpec, prev_loss_scaling: DistTensorSpec,
                in_good_steps: DistTensorSpec, in_bad_steps: DistTensorSpec, incr_every_n_steps: int,
                decr_every_n_nan_or_inf: int, incr_ratio: float, decr_ratio: float,
                stop_update: object = False) -> SpmdResult:
    """update_loss_scaling (UpdateLossScalingSpmd): each x keeps its sharding (partial dropped);
    found_infinite and the loss-scaling state replicated; out as xs, the new state replicated."""
    op = "update_loss_scaling"
    _uls_attrs(op, incr_every_n_steps, decr_every_n_nan_or_inf, incr_ratio, decr_ratio, stop_update)
    return _uls(op, xs, (found_infinite, prev_loss_scaling, in_good_steps, in_bad_steps), (), xs)


def uls_reverse(xs: Sequence[DistTensorSpec], found_infinite: DistTensorSpec, prev_loss_scaling: DistTensorSpec,
                in_good_steps: DistTensorSpec, in_bad_steps: DistTensorSpec, out: Sequence[DistTensorSpec],
                loss_scaling: DistTensorSpec, out_good_steps: DistTensorSpec, out_bad_steps: DistTensorSpec,
                incr_every_n_steps: int, decr_every_n_nan_or_inf: int, incr_ratio: float, decr_ratio: float,
                stop_update: object = False) -> SpmdResult:
    """update_loss_scaling reverse (Paddle has none): each x as its out (partial dropped), the
    state replicated; the outputs those inputs produce."""
    op = "update_loss_scaling"
    _uls_attrs(op, incr_every_n_steps, decr_every_n_nan_or_inf, incr_ratio, decr_ratio, stop_update)
    if len(out) != len(xs):
        raise ShapeMismatchError(f"{op}: out has {len(out)} tensors but xs has {len(xs)}")
    for i, (x, o) in enumerate(zip(xs, out)):
        if len(x.shape) != len(o.shape):
            raise ShapeMismatchError(f"{op}: out[{i}] has {len(o.shape)} dims but xs[{i}] has {len(x.shape)}")
    extra = (*((f"out[{i}]", t) for i, t in enumerate(out)), ("loss_scaling", loss_scaling),
             ("out_good_steps", out_good_steps), ("out_bad_steps", out_bad_steps))
    for n, t in extra[len(out):]:
        _scalar_state(op, n, t, found_infinite.dist_attr.mesh)
    return _uls(op, xs, (found_infinite, prev_loss_scaling, in_good_steps, in_bad_steps), extra, out)




_ULS_ATTRS = ("incr_every_n_steps: int, decr_every_n_nan_or_inf: int, incr_ratio: float, decr_ratio: float, "
              "stop_update: scalar = False")
register(
    "check_finite_and_unscale", cfu_forward, "xs: [T], scale: T", cfu_reverse,
    kind="reverse", outputs="out: [T], found_infinite: T",
    forward_name="CheckFiniteAndUnscaleSpmd", backward_name="CheckFiniteAndUnscaleSpmdReverse",
)  # fmt: skip
register(
    "update_loss_scaling", uls_forward,
    f"xs: [T], found_infinite: T, prev_loss_scaling: T, in_good_steps: T, in_bad_steps: T, {_ULS_ATTRS}",
    uls_reverse,
    kind="reverse", outputs="out: [T], loss_scaling: T, out_good_steps: T, out_bad_steps: T",
    forward_name="UpdateLossScalingSpmd", backward_name="UpdateLossScalingSpmdReverse",
)  # fmt: skip
