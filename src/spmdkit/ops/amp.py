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
from functools import partial
from typing import Any

from spmdkit.core.dist_attr import ReduceType
from spmdkit.core.errors import ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.declare import Answer, Way, declare
from spmdkit.engine.facts import facts
from spmdkit.engine.notation import BROADCAST, Notation, Taken
from spmdkit.engine.outshape import Args, Expect
from spmdkit.ops._cost import copy

_CFU = "check_finite_and_unscale"
_ULS = "update_loss_scaling"


def notation(op: str, reverse: bool, ranks: tuple[int, ...], *states: int) -> Notation:
    """``xs..., states... [, out...] [, new states...] -> [found_infinite]``: each x its own
    letters (past the alphabet; ``taken=Taken.KEEP``: the xs are updated one by one, so two may shard
    one mesh dim), the [1] states ``1``; found_infinite lacks every x letter (partial MAX); update_loss_scaling's new
    state is labelled among the inputs (``Way.tail``), so never partial. The reverse merges the
    outs alone (``sources``), each out its x (the given found_infinite / new state unlabelled)."""
    xs, k = [], 0
    for r in ranks:
        xs.append("".join(chr(0x100 + k + i) for i in range(r)))
        k += r
    ins: list[str | None] = [*xs, *(BROADCAST * r for r in states)]
    n = len(ins)
    if reverse:
        ins += [*xs, *[None] * (1 if op == _CFU else 3)]
    if op != _CFU:
        ins += [BROADCAST] * 3
    src = range(n, n + len(xs)) if reverse else range(len(xs))
    return Notation(ins, [BROADCAST] if op == _CFU else [], reduce=ReduceType.MAX, taken=Taken.KEEP, sources=src)


def _scalar(op: str, *named: tuple[str, DistTensorSpec]) -> None:
    for name, t in named:
        if len(t.shape) > 1 or any(s not in (1, -1) for s in t.shape):
            raise ShapeMismatchError(f"{op}: {name} must hold one element (shape [1]), got {list(t.shape)}")


def _outs(op: str, xs: Sequence[DistTensorSpec], out: Sequence[DistTensorSpec]) -> None:
    """As many outs as xs, of their ranks."""
    if len(out) != len(xs):
        raise ShapeMismatchError(f"{op}: out has {len(out)} tensors but xs has {len(xs)}")
    for i, (x, o) in enumerate(zip(xs, out)):
        if len(x.shape) != len(o.shape):
            raise ShapeMismatchError(f"{op}: out[{i}] has {len(o.shape)} dims but xs[{i}] has {len(x.shape)}")


def _cfu_scalars(op: str, scale: DistTensorSpec) -> None:
    _scalar(op, ("scale", scale))


def _cfu_reverse_scalars(op: str, scale: DistTensorSpec, found_infinite: DistTensorSpec) -> None:
    _scalar(op, ("scale", scale), ("found_infinite", found_infinite))


def _uls_scalars(op: str, found_infinite: DistTensorSpec, prev_loss_scaling: DistTensorSpec,
                 in_good_steps: DistTensorSpec, in_bad_steps: DistTensorSpec) -> None:  # fmt: skip
    _scalar(op, ("found_infinite", found_infinite), ("prev_loss_scaling", prev_loss_scaling),
            ("in_good_steps", in_good_steps), ("in_bad_steps", in_bad_steps))  # fmt: skip


def _uls_reverse_scalars(op: str, loss_scaling: DistTensorSpec, out_good_steps: DistTensorSpec,
                         out_bad_steps: DistTensorSpec, found_infinite: DistTensorSpec,
                         prev_loss_scaling: DistTensorSpec, in_good_steps: DistTensorSpec,
                         in_bad_steps: DistTensorSpec) -> None:  # fmt: skip
    _scalar(op, ("loss_scaling", loss_scaling), ("out_good_steps", out_good_steps), ("out_bad_steps", out_bad_steps))
    _uls_scalars(op, found_infinite, prev_loss_scaling, in_good_steps, in_bad_steps)


def _answer(ins: Any, outs: Any, xs: Sequence[DistTensorSpec], *rest: object) -> Answer:
    """Paddle's grouping of a flat answer: ``(xs, states...), (out, found_infinite | the new
    state)``; out is xs (updated in place)."""
    n = len(xs)
    xa = tuple(ins[:n])
    return (xa, *ins[n:]), (xa, *outs[-1 if len(ins) == n + 1 else -3 :])


declare(
    _CFU, "xs: [T], scale: T",
    Way(partial(notation, _CFU, False), key="xs, scale", nonempty=("xs",), check=_cfu_scalars,
        post=lambda ins, outs, xs, scale: ((ins[0], ins[1]), (ins[0], outs[0])), paddle="CheckFiniteAndUnscaleSpmd",
        doc="check_finite_and_unscale (CheckFiniteAndUnscaleSpmd): each x keeps its sharding (partial dropped), "
            "scale replicated; out as xs, found_infinite partial MAX over the xs' mesh dims."),
    reverse=Way(partial(notation, _CFU, True), key="xs, scale", nonempty=("xs",), tail="out",
                check=(_outs, _cfu_reverse_scalars),
                post=_answer, paddle="CheckFiniteAndUnscaleSpmdReverse",
                doc="check_finite_and_unscale reverse (Paddle has none): each x as its out, scale replicated."),
    outputs="out: [T], found_infinite: T",
)  # fmt: skip
_STATES = ("found_infinite", "prev_loss_scaling", "in_good_steps", "in_bad_steps")
_NEW = ("loss_scaling", "out_good_steps", "out_bad_steps")
_ULS_KEY = "xs, " + ", ".join(_STATES)
declare(
    _ULS,
    f"xs: [T], {', '.join(n + ': T' for n in _STATES)}, incr_every_n_steps: int, "
    "decr_every_n_nan_or_inf: int, incr_ratio: float, decr_ratio: float, stop_update: scalar = False",
    Way(partial(notation, _ULS, False), key=_ULS_KEY, nonempty=("xs",), check=_uls_scalars, tail=3,
        post=_answer, paddle="UpdateLossScalingSpmd",
        doc="update_loss_scaling (UpdateLossScalingSpmd): each x keeps its sharding (partial dropped); "
            "found_infinite and the loss-scaling state replicated; out as xs, the new state replicated."),
    reverse=Way(partial(notation, _ULS, True), key=_ULS_KEY, nonempty=("xs",), tail=3,
                check=(_outs, _uls_reverse_scalars), post=_answer,
                paddle="UpdateLossScalingSpmdReverse",
                doc="update_loss_scaling reverse (Paddle has none): each x as its out, the state replicated."),
    outputs="out: [T], " + ", ".join(n + ": T" for n in _NEW),
)  # fmt: skip


# -- output shapes --------------------------------------------------------------------------------


def _cfu_shape(a: Args) -> list[Expect]:
    return [list(a.vec("xs")), None]


def _uls_shape(a: Args) -> list[Expect]:
    """outs like xs; the new loss scaling and step counts like the old ones."""
    out: list[Expect] = [list(a.vec("xs"))]
    return out + [a.opt(r) for r in ("prev_loss_scaling", "in_good_steps", "in_bad_steps")]


facts(_CFU, shape=_cfu_shape, unchecked="found_infinite is a flag whose shape the kernel picks; out is checked")
facts(_ULS, shape=_uls_shape)


# -- cost

facts(_CFU, _ULS, cost=copy)
