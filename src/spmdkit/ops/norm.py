"""The norm family: layer_norm, fused_rms_norm and their grads.

Notation (Paddle 3.3.1's ``layer_norm.cc`` / ``rms_norm.cc``): the axes before
``begin_norm_axis`` are batch axes and keep their sharding; the normalized axes are
``1`` (never sharded), and so are the 1-D ``scale`` / ``bias`` (length
``prod(x.shape[begin_norm_axis:])``). ``mean`` / ``variance`` (``invvar`` for rms_norm)
have the batch axes only, shaped ``x.shape[:begin_norm_axis]`` (Paddle's rule gives
them ``begin_norm_axis`` dims_mapping entries; its kernels flatten them to 1-D, which
is the same tensor where ``begin_norm_axis == 1``). 3-D x, ``begin_norm_axis=2``::

    layer_norm       ab1, 1, 1 -> ab1, ab, ab           (x, scale, bias -> out, mean, variance)
    layer_norm_grad  ab1, 1, 1, ab, ab, ab1 -> ab1, 1, 1 (scale_grad / bias_grad partial SUM
                                                          over the batch axes' mesh dims)
    fused_rms_norm   ab1, 1 -> ab1, ab                   (rms_norm: begin_norm_axis = ndim - 1)
    rms_norm_grad    ab1, 1, ab, ab1 -> ab1, 1

As in Paddle 3.3.1, a co-sharded batch axis keeps one mesh dim (its largest), uneven
batch shardings are kept (each row is normalized on its own rank: sound), and every
partial input is resharded to replicated (normalizing a partial value is not the
normal of the sum). The reverse rules merge out, mean and variance (larger tensor wins
where two shard one axis over different mesh dims; Paddle raises), drop a mesh dim
that ``out`` uses on a normalized axis from mean / variance (as Paddle's merge does),
and return the outputs the inferred inputs produce (never partial).

Paddle 3.3.1 registers ``layer_norm`` and ``fused_rms_norm`` (not ``rms_norm`` nor
``fast_ln``); the grads are rules of their own (``layer_norm_grad``, ``rms_norm_grad``).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

from spmdkit.core.errors import ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.axes import numel
from spmdkit.engine.declare import Way, declare
from spmdkit.engine.facts import facts
from spmdkit.engine.notation import BROADCAST, Coshard, Notation, ReplicatedClaims, letters_for
from spmdkit.engine.outshape import Args, Expect, UnknownShape, axis_of
from spmdkit.ops._absent import absent_0d
from spmdkit.ops._cost import by_bytes


def notation(kind: str, nd: int, bna: int, *ranks: int) -> Notation:
    """The notation of one norm rule (``kind``: ln / ln_rev / ln_grad / rms / rms_rev /
    rms_grad) for x's rank, begin_norm_axis and the ranks of scale / bias (-1: absent): batch
    letters ``ab``, normalized axes ``1`` (named, replicated and blocking their mesh dims where
    the reverse rules read them off out)."""
    batch = letters_for(nd)[:bna]
    x = batch + BROADCAST * (nd - bna)
    params = [None if r < 0 else BROADCAST * r for r in ranks]
    stats = [batch, batch] if kind.startswith("ln") else [batch]
    if kind in ("ln", "rms"):
        return Notation([x, *params], [x, *stats], coshard=Coshard.LARGEST)
    if kind in ("ln_rev", "rms_rev"):
        named = letters_for(nd)  # out: the normalized axes named
        return Notation([x, *params], [named, *stats], replicated=named[bna:], replicated_claims=ReplicatedClaims.BLOCK,
                        coshard=Coshard.LARGEST)  # fmt: skip
    return Notation([x, *params, *stats, x], [x, *params], coshard=Coshard.LARGEST)


def _params(x: DistTensorSpec, begin_norm_axis: int, scale: DistTensorSpec | None, bias: DistTensorSpec | None,
            flat: bool = True) -> None:  # fmt: skip
    """layer_norm's scale / bias: 1-D of the normalized axes' element count (the grad rule also takes
    them in any shape of that many elements, as Paddle's C++ test does)."""
    tail = x.shape[begin_norm_axis:]
    if len(tail) == 1 and (scale is None or scale.shape == tail) and (bias is None or bias.shape == tail):
        return  # the common case: one normalized axis, scale and bias of its size
    size = numel(tail)
    for name, t in (("scale", scale), ("bias", bias)):
        if t is not None and flat and len(t.shape) != 1:
            raise ShapeMismatchError(f"{name} must be 1-D, got shape {list(t.shape)}")
        n = -1 if t is None else numel(t.shape)
        if size >= 0 and n >= 0 and n != size:
            raise ShapeMismatchError(f"{name} has {n} elements, the normalized axes of x have {size}")


def _stats(x: DistTensorSpec, bna: int, **stats: DistTensorSpec) -> None:
    """mean / variance / invvar: shaped ``x.shape[:begin_norm_axis]``."""
    want = x.shape[:bna]
    for name, t in stats.items():
        if t.shape == want:
            continue
        if len(t.shape) != bna or any(p != q and p >= 0 and q >= 0 for p, q in zip(t.shape, want)):
            raise ShapeMismatchError(f"{name} has shape {list(t.shape)}, expected x.shape[:{bna}] = {list(want)}")


def _ln_grad_params(x: DistTensorSpec, begin_norm_axis: int, scale: DistTensorSpec | None,
                    bias: DistTensorSpec | None) -> None:  # fmt: skip
    _params(x, begin_norm_axis, scale, bias, False)


def _ln_stats(x: DistTensorSpec, begin_norm_axis: int, mean: DistTensorSpec, variance: DistTensorSpec) -> None:
    _stats(x, begin_norm_axis, mean=mean, variance=variance)


def _rms_stats(x: DistTensorSpec, invvar: DistTensorSpec) -> None:
    _stats(x, len(x.shape) - 1, invvar=invvar)


_LN: dict[str, Any] = {"key": "x, begin_norm_axis, scale, bias", "require": ("0 <= begin_norm_axis <= len(x.shape)",)}
#: rms_norm: begin_norm_axis = ndim - 1; fused_rms_norm reads a 0-D scale (shape []) as absent
_RMS: dict[str, Any] = {"key": "x, len(x.shape) - 1, scale", "shapes": "x: ... h; scale: h", "wrap": absent_0d("scale")}

declare(
    "layer_norm", "x: T, scale: T?, bias: T?, epsilon: float = 1e-5, begin_norm_axis: int = 1",
    Way(partial(notation, "ln"), check=_params, **_LN, paddle="LayerNormInferSpmd",
        doc="LayerNormInferSpmd: ``ab1, 1, 1 -> ab1, ab, ab`` (3-D x, begin_norm_axis 2)."),
    reverse=Way(partial(notation, "ln_rev"), same=[("x", "out")], **_LN,
                check=(_params, _ln_stats),
                paddle="LayerNormInferSpmdReverse", doc="LayerNormInferSpmdReverse: x from out, mean and variance."),
    outputs="out: T, mean: T, variance: T",
)  # fmt: skip
declare(
    "layer_norm_grad",
    "x: T, scale: T?, bias: T?, mean: T, variance: T, out_grad: T, epsilon: float = 1e-5, begin_norm_axis: int = 1",
    Way(partial(notation, "ln_grad"), same=[("x", "out_grad")], **_LN,
        check=(_ln_grad_params, _ln_stats), paddle="LayerNormGradInferSpmd",
        doc="LayerNormGradInferSpmd: ``ab1, 1, 1, ab, ab, ab1 -> ab1, 1, 1``; scale_grad and bias_grad "
            "partial SUM over the mesh dims of the batch axes."),
)  # fmt: skip
declare(
    "fused_rms_norm", "x: T, scale: T?, epsilon: float = 1e-5",
    Way(partial(notation, "rms"), **_RMS, paddle="RmsNormInferSpmd",
        doc="RmsNormInferSpmd: ``ab1, 1 -> ab1, ab`` (3-D x)."),
    reverse=Way(partial(notation, "rms_rev"), same=[("x", "out")], check=_rms_stats, **_RMS,
                paddle="RmsNormInferSpmdReverse", doc="RmsNormInferSpmdReverse: x from out and invvar."),
    outputs="out: T, invvar: T",
)  # fmt: skip
declare(
    "rms_norm_grad", "x: T, scale: T?, invvar: T, out_grad: T, epsilon: float = 1e-5",
    Way(partial(notation, "rms_grad"), same=[("x", "out_grad")], check=_rms_stats, **_RMS,
        paddle="RmsNormGradInferSpmd",
        doc="RmsNormGradInferSpmd: ``ab1, 1, ab, ab1 -> ab1, 1``; scale_grad partial SUM over the mesh dims "
            "of the batch axes."),
    aliases=("fused_rms_norm_grad",),
)  # fmt: skip


# -- output shapes / grads ----------------------------------------------------------------------


def _stat_shape(x: tuple[int, ...], keep: int, nd: int | None) -> Expect:
    """A normalisation statistic over ``x.shape[:keep]``: that shape, or flattened to 1-D (the
    rule's output rank says which); None where neither fits the rank."""
    lead = x[:keep]
    if nd == len(lead):
        return lead
    if nd == 1:
        return (math.prod(lead),)
    if nd == 0 and math.prod(lead) == 1:
        return ()
    return None


def _layer_norm_shape(a: Args) -> list[Expect]:
    """out like x; mean and variance over the axes before begin_norm_axis."""
    x = a.s("x")
    b = axis_of(a.a("begin_norm_axis", 1), len(x)) if x else 0
    return [x, _stat_shape(x, b, a.nd(1)), _stat_shape(x, b, a.nd(2))]


def _rms_norm_shape(a: Args) -> list[Expect]:
    """out like x; invvar over every axis but the last."""
    x = a.s("x")
    if not x:
        raise UnknownShape
    return [x, _stat_shape(x, len(x) - 1, a.nd(1))]


facts("layer_norm", shape=_layer_norm_shape, grad="layer_norm_grad", wrt=("x", "scale", "bias"))
facts("fused_rms_norm", shape=_rms_norm_shape, grad="rms_norm_grad", wrt=("x", "scale"))
facts("rms_norm_grad", grad_like=("x", "scale"))


# -- cost

#: memory-bound, nominal FLOPs per output element
facts("layer_norm", cost=by_bytes(8))
facts("layer_norm_grad", cost=by_bytes(12))
facts("fused_rms_norm", cost=by_bytes(5))
facts("rms_norm_grad", cost=by_bytes(8))
