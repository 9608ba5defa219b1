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
from functools import lru_cache

from spmdkit.core.dist_attr import ReduceType
from spmdkit.core.errors import InvalidArgumentError, InvalidAttributeError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.compile import Plan, compile_plan, infer
from spmdkit.engine.notation import BROADCAST, Notation, fast_result, named_mesh
from spmdkit.engine.registry import register
from spmdkit.rules._common import check_int

# -- check_finite_and_unscale / update_loss_scaling -------------------------------------------------

_CFU = "check_finite_and_unscale"


def _letters(ranks: tuple[int, ...]) -> list[str]:
    """Distinct letters for tensors that share no axis (any number of them: past the alphabet)."""
    out, k = [], 0
    for r in ranks:
        out.append("".join(chr(0x100 + k + i) for i in range(r)))
        k += r
    return out


@lru_cache(maxsize=1024)
def _plan(op: str, ranks: tuple[int, ...], states: tuple[int, ...], reverse: bool) -> Plan:
    """``xs..., states... [, out...] [, new states...] -> [found_infinite]``: each x its own
    letters (``taken="keep"``: the xs are updated one by one, so two of them may shard one mesh
    dim), the [1] states ``1``. check_finite_and_unscale's found_infinite lacks every x letter:
    partial MAX over the mesh dims of the xs (a rank's flag covers its own shards);
    update_loss_scaling's new state (read from the replicated state alone) is labelled among the
    inputs, so it is never partial. The reverse merges the outs alone (``sources``); every out is
    its x, updated in place."""
    xs = _letters(ranks)
    n = len(xs) + len(states)
    ins = [*xs, *(BROADCAST * r for r in states), *(xs if reverse else ())]
    outs = [BROADCAST] if op == _CFU else []
    if op != _CFU:
        ins += [BROADCAST] * 3
    src = range(n, n + len(xs)) if reverse else range(len(xs))
    return compile_plan(Notation(ins, outs, reduce=ReduceType.MAX, taken="keep", sources=src))


def _answer(op: str, xs: Sequence[DistTensorSpec], state: Sequence[DistTensorSpec], mesh: ProcessMesh,
            out: Sequence[DistTensorSpec] = ()) -> SpmdResult:
    """The plan's answer: (xs, states...) -> (out, found_infinite | the new state)."""
    n, m = len(xs), len(state)
    p = _plan(op, tuple(len(t.shape) for t in xs), tuple(len(t.shape) for t in state), bool(out))
    ins, outs = infer(p, op, (*xs, *state, *out, *((None,) * 3 if op != _CFU else ())), (), mesh)
    xa = ins[:n]
    return fast_result((xa, *ins[n : n + m]), (xa, *outs) if op == _CFU else (xa, *ins[-3:]))  # type: ignore[arg-type]


def _scalar_state(op: str, name: str, t: DistTensorSpec) -> None:
    if len(t.shape) > 1 or any(s not in (1, -1) for s in t.shape):
        raise ShapeMismatchError(f"{op}: {name} must hold one element (shape [1]), got {list(t.shape)}")


def _check_xs(op: str, xs: Sequence[DistTensorSpec], out: Sequence[DistTensorSpec] | None = None,
              ranks: bool = True) -> None:
    """xs not empty; or, given ``out``: as many outs as xs (and, with ``ranks``, of their ranks)."""
    if out is None:
        if not xs:
            raise InvalidArgumentError(f"{op}: xs must hold at least one tensor")
        return
    if len(out) != len(xs):
        raise ShapeMismatchError(f"{op}: out has {len(out)} tensors but xs has {len(xs)}")
    for i, (x, o) in enumerate(zip(xs, out) if ranks else ()):
        if len(x.shape) != len(o.shape):
            raise ShapeMismatchError(f"{op}: out[{i}] has {len(o.shape)} dims but xs[{i}] has {len(x.shape)}")


def _named(name: str, ts: Sequence[DistTensorSpec]) -> list[tuple[str, DistTensorSpec]]:
    return [(f"{name}[{i}]", t) for i, t in enumerate(ts)]


def cfu_forward(xs: Sequence[DistTensorSpec], scale: DistTensorSpec) -> SpmdResult:
    """check_finite_and_unscale (CheckFiniteAndUnscaleSpmd): each x keeps its sharding (partial
    dropped), scale replicated; out as xs, found_infinite partial MAX over the xs' mesh dims."""
    _check_xs(_CFU, xs)
    mesh = named_mesh(_CFU, [*_named("xs", xs), ("scale", scale)])
    _scalar_state(_CFU, "scale", scale)
    return _answer(_CFU, xs, (scale,), mesh)


def cfu_reverse(xs: Sequence[DistTensorSpec], scale: DistTensorSpec, out: Sequence[DistTensorSpec],
                found_infinite: DistTensorSpec) -> SpmdResult:
    """check_finite_and_unscale reverse (Paddle has none): each x as its out (partial dropped),
    scale replicated; the outputs those inputs produce."""
    _check_xs(_CFU, xs)
    _check_xs(_CFU, xs, out, ranks=False)
    mesh = named_mesh(_CFU, [*_named("xs", xs), ("scale", scale), *_named("out", out),
                             ("found_infinite", found_infinite)])  # fmt: skip
    _check_xs(_CFU, xs, out)
    _scalar_state(_CFU, "scale", scale)
    _scalar_state(_CFU, "found_infinite", found_infinite)
    return _answer(_CFU, xs, (scale,), mesh, out)


def _uls_attrs(op: str, incr_every_n_steps: object, decr_every_n_nan_or_inf: object, incr_ratio: object,
               decr_ratio: object, stop_update: object) -> None:
    check_int(op, "incr_every_n_steps", incr_every_n_steps)
    check_int(op, "decr_every_n_nan_or_inf", decr_every_n_nan_or_inf)
    for n, v in (("incr_ratio", incr_ratio), ("decr_ratio", decr_ratio)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InvalidAttributeError(f"{op}: {n} must be a number, got {v!r}")
    if not isinstance(stop_update, (bool, int, float)):
        raise InvalidAttributeError(f"{op}: stop_update must be a bool, got {stop_update!r}")


_ULS = "update_loss_scaling"
_STATE = ("found_infinite", "prev_loss_scaling", "in_good_steps", "in_bad_steps")


def _uls(xs: Sequence[DistTensorSpec], state: Sequence[DistTensorSpec], extra: Sequence[tuple[str, DistTensorSpec]],
         out: Sequence[DistTensorSpec] = ()) -> SpmdResult:
    _check_xs(_ULS, xs)
    mesh = named_mesh(_ULS, [*_named("xs", xs), *zip(_STATE, state), *extra])
    for n, t in zip(_STATE, state):
        _scalar_state(_ULS, n, t)
    return _answer(_ULS, xs, state, mesh, out)


def uls_forward(xs: Sequence[DistTensorSpec], found_infinite: DistTensorSpec, prev_loss_scaling: DistTensorSpec,
                in_good_steps: DistTensorSpec, in_bad_steps: DistTensorSpec, incr_every_n_steps: int,
                decr_every_n_nan_or_inf: int, incr_ratio: float, decr_ratio: float,
                stop_update: object = False) -> SpmdResult:
    """update_loss_scaling (UpdateLossScalingSpmd): each x keeps its sharding (partial dropped);
    found_infinite and the loss-scaling state replicated; out as xs, the new state replicated."""
    _uls_attrs(_ULS, incr_every_n_steps, decr_every_n_nan_or_inf, incr_ratio, decr_ratio, stop_update)
    return _uls(xs, (found_infinite, prev_loss_scaling, in_good_steps, in_bad_steps), ())


def uls_reverse(xs: Sequence[DistTensorSpec], found_infinite: DistTensorSpec, prev_loss_scaling: DistTensorSpec,
                in_good_steps: DistTensorSpec, in_bad_steps: DistTensorSpec, out: Sequence[DistTensorSpec],
                loss_scaling: DistTensorSpec, out_good_steps: DistTensorSpec, out_bad_steps: DistTensorSpec,
                incr_every_n_steps: int, decr_every_n_nan_or_inf: int, incr_ratio: float, decr_ratio: float,
                stop_update: object = False) -> SpmdResult:
    """update_loss_scaling reverse (Paddle has none): each x as its out (partial dropped), the
    state replicated; the outputs those inputs produce."""
    _uls_attrs(_ULS, incr_every_n_steps, decr_every_n_nan_or_inf, incr_ratio, decr_ratio, stop_update)
    _check_xs(_ULS, xs, out)
    extra = (("loss_scaling", loss_scaling), ("out_good_steps", out_good_steps), ("out_bad_steps", out_bad_steps))
    for n, t in extra:
        _scalar_state(_ULS, n, t)
    return _uls(xs, (found_infinite, prev_loss_scaling, in_good_steps, in_bad_steps), (*_named("out", out), *extra),
                out)


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
