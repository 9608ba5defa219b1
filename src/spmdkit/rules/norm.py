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

from functools import lru_cache

from spmdkit.core.dist_attr import DimsMapping, Entry, entry_dims
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.notation import (
    ALPHABET,
    BROADCAST,
    Notation,
    common_mesh,
    merge_letters,
    project_all,
)
from spmdkit.rules.registry import register

# ---------------------------------------------------------------------------
# notations (cached per (ndim, begin_norm_axis, which optional tensors exist))
# ---------------------------------------------------------------------------


def _x_axes(ndim: int, bna: int) -> tuple[str, str]:
    """(x's axes, the batch axes): ``ab1`` and ``ab`` for ndim 3, begin_norm_axis 2."""
    if ndim > len(ALPHABET):
        raise ShapeMismatchError(f"tensors of more than {len(ALPHABET)} dims are not supported")
    batch = ALPHABET[:bna]
    return batch + BROADCAST * (ndim - bna), batch


@lru_cache(maxsize=1024)
def _ln_notation(ndim: int, bna: int, has_scale: bool, has_bias: bool) -> Notation:
    x, b = _x_axes(ndim, bna)
    return Notation([x, "1" if has_scale else None, "1" if has_bias else None], [x, b, b])


def _param_axes(t: DistTensorSpec | None) -> str | None:
    return None if t is None else BROADCAST * len(t.shape)


@lru_cache(maxsize=1024)
def _ln_grad_notation(ndim: int, bna: int, s: str | None, bb: str | None) -> Notation:
    x, b = _x_axes(ndim, bna)
    return Notation([x, s, bb, b, b, x], [x, s, bb])


@lru_cache(maxsize=1024)
def _rms_notation(ndim: int, has_scale: bool) -> Notation:
    x, b = _x_axes(ndim, ndim - 1)
    return Notation([x, "1" if has_scale else None], [x, b])


@lru_cache(maxsize=1024)
def _rms_grad_notation(ndim: int, has_scale: bool) -> Notation:
    x, b = _x_axes(ndim, ndim - 1)
    s = "1" if has_scale else None
    return Notation([x, s, b, x], [x, s])


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _pick(e: Entry, mesh_shape: tuple[int, ...]) -> int:
    if not isinstance(e, tuple):
        return e
    best = e[0]
    for d in e[1:]:
        if mesh_shape[d] > mesh_shape[best]:
            best = d
    return best


def _single(dm: DimsMapping, mesh_shape: tuple[int, ...]) -> DimsMapping:
    """A co-sharded entry keeps one mesh dim, as Paddle 3.3.1 does: its largest (the
    first of equal sizes): ``[[0, 1]]`` on mesh [2, 3] -> ``[1]``, on [2, 2] -> ``[0]``."""
    for e in dm:
        if isinstance(e, tuple):
            return tuple(_pick(e, mesh_shape) for e in dm)
    return dm


def _without(dm: DimsMapping, drop: frozenset[int]) -> DimsMapping:
    out: list[Entry] = []
    for e in dm:
        d = tuple(x for x in entry_dims(e) if x not in drop)
        out.append(-1 if not d else d[0] if len(d) == 1 else d)
    return tuple(out)


def _bna(op: str, begin_norm_axis: int, ndim: int) -> int:
    if not 0 <= begin_norm_axis <= ndim:
        raise InvalidAttributeError(
            f"{op}: begin_norm_axis {begin_norm_axis} out of range for a {ndim}-D x (0..{ndim})"
        )
    return begin_norm_axis


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        if s < 0:
            return -1
        n *= s
    return n


def _check_param(op: str, name: str, t: DistTensorSpec | None, size: int, flat: bool = True) -> None:
    """scale / bias: 1-D of ``size`` (the product of the normalized axes); the grad rule
    also takes them in any shape of that many elements (as Paddle's C++ test does)."""
    if t is None:
        return
    if flat and len(t.shape) != 1:
        raise ShapeMismatchError(f"{op}: {name} must be 1-D, got shape {list(t.shape)}")
    n = _numel(t.shape)
    if size >= 0 and n >= 0 and n != size:
        raise ShapeMismatchError(f"{op}: {name} has {n} elements, the normalized axes of x have {size}")


def _check_same(op: str, a: DistTensorSpec, na: str, b: DistTensorSpec, nb: str) -> None:
    if len(a.shape) != len(b.shape) or any(p != q and p >= 0 and q >= 0 for p, q in zip(a.shape, b.shape)):
        raise ShapeMismatchError(f"{op}: {nb} has shape {list(b.shape)}, {na} has {list(a.shape)}")


def _check_stat(op: str, name: str, t: DistTensorSpec, x: DistTensorSpec, bna: int) -> None:
    """mean / variance / invvar: shaped ``x.shape[:begin_norm_axis]``."""
    want = x.shape[:bna]
    if len(t.shape) != bna or any(p != q and p >= 0 and q >= 0 for p, q in zip(t.shape, want)):
        raise ShapeMismatchError(f"{op}: {name} has shape {list(t.shape)}, expected x.shape[:{bna}] = {list(want)}")


def _dm(t: DistTensorSpec | None) -> DimsMapping | None:
    return None if t is None else _single(t.dist_attr.dims_mapping, t.dist_attr.mesh.shape)


def _shape(t: DistTensorSpec | None) -> tuple[int, ...] | None:
    return None if t is None else t.shape


def _infer(
    nt: Notation,
    axes: tuple[str | None, ...],
    mappings: tuple[DimsMapping | None, ...],
    shapes: tuple[tuple[int, ...] | None, ...],
    mesh: ProcessMesh,
) -> SpmdResult:
    """Merge ``mappings`` (labelled ``axes``), project onto the notation's inputs and outputs."""
    merged = merge_letters(axes, mappings, shapes, nt.replicated, nt.prune, mesh.shape)
    ins, outs = project_all(nt, merged, mesh)
    return SpmdResult(ins, outs)


# ---------------------------------------------------------------------------
# layer_norm
# ---------------------------------------------------------------------------

_LN_NAMES = ("x", "scale", "bias")
_LN_REV_NAMES = ("x", "scale", "bias", "out", "mean", "variance")
_LN_GRAD_NAMES = ("x", "scale", "bias", "mean", "variance", "out_grad")


def layer_norm_forward(
    x: DistTensorSpec,
    scale: DistTensorSpec | None,
    bias: DistTensorSpec | None,
    epsilon: float,
    begin_norm_axis: int,
) -> SpmdResult:
    """LayerNormInferSpmd: ``ab1, 1, 1 -> ab1, ab, ab`` (3-D x, begin_norm_axis 2)."""
    op = "layer_norm"
    mesh = common_mesh(op, (x, scale, bias))
    nd = len(x.shape)
    bna = _bna(op, begin_norm_axis, nd)
    size = _numel(x.shape[bna:])
    _check_param(op, "scale", scale, size)
    _check_param(op, "bias", bias, size)
    nt = _ln_notation(nd, bna, scale is not None, bias is not None)
    return _infer(nt, nt.inputs[:1], (_dm(x),), (x.shape,), mesh)


def layer_norm_backward(
    x: DistTensorSpec,
    scale: DistTensorSpec | None,
    bias: DistTensorSpec | None,
    out: DistTensorSpec,
    mean: DistTensorSpec,
    variance: DistTensorSpec,
    epsilon: float,
    begin_norm_axis: int,
) -> SpmdResult:
    """LayerNormInferSpmdReverse: x from out, mean and variance."""
    op = "layer_norm"
    mesh = common_mesh(op, (x, scale, bias, out, mean, variance))
    nd = len(x.shape)
    bna = _bna(op, begin_norm_axis, nd)
    size = _numel(x.shape[bna:])
    _check_param(op, "scale", scale, size)
    _check_param(op, "bias", bias, size)
    _check_same(op, x, "x", out, "out")
    _check_stat(op, "mean", mean, x, bna)
    _check_stat(op, "variance", variance, x, bna)
    nt = _ln_notation(nd, bna, scale is not None, bias is not None)
    odm, mdm, vdm = _dm(out), _dm(mean), _dm(variance)
    assert odm is not None and mdm is not None and vdm is not None
    blocked = _norm_dims(odm, bna)
    if blocked:
        mdm, vdm = _without(mdm, blocked), _without(vdm, blocked)
    return _infer(nt, nt.outputs, (odm, mdm, vdm), (out.shape, mean.shape, variance.shape), mesh)


def _norm_dims(dm: DimsMapping, bna: int) -> frozenset[int]:
    """The mesh dims out shards its normalized axes on: Paddle's merge lets them claim the
    mesh dim first, so mean / variance lose it."""
    s: set[int] = set()
    for e in dm[bna:]:
        s.update(entry_dims(e))
    return frozenset(s)


def layer_norm_grad(
    x: DistTensorSpec,
    scale: DistTensorSpec | None,
    bias: DistTensorSpec | None,
    mean: DistTensorSpec,
    variance: DistTensorSpec,
    out_grad: DistTensorSpec,
    epsilon: float = 1e-5,
    begin_norm_axis: int = 1,
) -> SpmdResult:
    """LayerNormGradInferSpmd: ``ab1, 1, 1, ab, ab, ab1 -> ab1, 1, 1``; scale_grad and
    bias_grad are partial SUM over the mesh dims of the batch axes."""
    op = "layer_norm_grad"
    mesh = common_mesh(op, (x, scale, bias, mean, variance, out_grad))
    nd = len(x.shape)
    bna = _bna(op, begin_norm_axis, nd)
    size = _numel(x.shape[bna:])
    _check_param(op, "scale", scale, size, flat=False)
    _check_param(op, "bias", bias, size, flat=False)
    _check_same(op, x, "x", out_grad, "out_grad")
    _check_stat(op, "mean", mean, x, bna)
    _check_stat(op, "variance", variance, x, bna)
    nt = _ln_grad_notation(nd, bna, _param_axes(scale), _param_axes(bias))
    tensors = (x, scale, bias, mean, variance, out_grad)
    return _infer(nt, nt.inputs, tuple(_dm(t) for t in tensors), tuple(_shape(t) for t in tensors), mesh)


# ---------------------------------------------------------------------------
# rms_norm
# ---------------------------------------------------------------------------


def _rms_checks(op: str, x: DistTensorSpec, scale: DistTensorSpec | None) -> int:
    nd = len(x.shape)
    if nd == 0:
        raise ShapeMismatchError(f"{op}: x must be at least 1-D (it normalizes the last axis)")
    _check_param(op, "scale", scale, x.shape[-1])
    return nd


def rms_norm_forward(x: DistTensorSpec, scale: DistTensorSpec | None, epsilon: float) -> SpmdResult:
    """RmsNormInferSpmd: ``ab1, 1 -> ab1, ab`` (3-D x)."""
    op = "fused_rms_norm"
    mesh = common_mesh(op, (x, scale))
    nd = _rms_checks(op, x, scale)
    nt = _rms_notation(nd, scale is not None)
    return _infer(nt, nt.inputs[:1], (_dm(x),), (x.shape,), mesh)


def rms_norm_backward(
    x: DistTensorSpec,
    scale: DistTensorSpec | None,
    out: DistTensorSpec,
    invvar: DistTensorSpec,
    epsilon: float,
) -> SpmdResult:
    """RmsNormInferSpmdReverse: x from out and invvar."""
    op = "fused_rms_norm"
    mesh = common_mesh(op, (x, scale, out, invvar))
    nd = _rms_checks(op, x, scale)
    _check_same(op, x, "x", out, "out")
    _check_stat(op, "invvar", invvar, x, nd - 1)
    nt = _rms_notation(nd, scale is not None)
    odm, idm = _dm(out), _dm(invvar)
    assert odm is not None and idm is not None
    blocked = _norm_dims(odm, nd - 1)
    if blocked:
        idm = _without(idm, blocked)
    return _infer(nt, nt.outputs, (odm, idm), (out.shape, invvar.shape), mesh)


def rms_norm_grad(
    x: DistTensorSpec,
    scale: DistTensorSpec | None,
    invvar: DistTensorSpec,
    out_grad: DistTensorSpec,
    epsilon: float = 1e-5,
) -> SpmdResult:
    """RmsNormGradInferSpmd: ``ab1, 1, ab, ab1 -> ab1, 1``; scale_grad partial SUM over the
    mesh dims of the batch axes."""
    op = "rms_norm_grad"
    mesh = common_mesh(op, (x, scale, invvar, out_grad))
    nd = _rms_checks(op, x, scale)
    _check_same(op, x, "x", out_grad, "out_grad")
    _check_stat(op, "invvar", invvar, x, nd - 1)
    nt = _rms_grad_notation(nd, scale is not None)
    tensors = (x, scale, invvar, out_grad)
    return _infer(nt, nt.inputs, tuple(_dm(t) for t in tensors), tuple(_shape(t) for t in tensors), mesh)


# ---------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------

register(
    "layer_norm",
    layer_norm_forward,
    "x: T, scale: T?, bias: T?, epsilon: float = 1e-5, begin_norm_axis: int = 1",
    layer_norm_backward,
    "x: T, scale: T?, bias: T?, out: T, mean: T, variance: T, epsilon: float = 1e-5, begin_norm_axis: int = 1",
    forward_name="LayerNormInferSpmd",
    backward_name="LayerNormInferSpmdReverse",
)
register(
    "layer_norm_grad",
    layer_norm_grad,
    "x: T, scale: T?, bias: T?, mean: T, variance: T, out_grad: T, epsilon: float = 1e-5, begin_norm_axis: int = 1",
    forward_name="LayerNormGradInferSpmd",
)
register(
    "fused_rms_norm",
    rms_norm_forward,
    "x: T, scale: T?, epsilon: float = 1e-5",
    rms_norm_backward,
    "x: T, scale: T?, out: T, invvar: T, epsilon: float = 1e-5",
    forward_name="RmsNormInferSpmd",
    backward_name="RmsNormInferSpmdReverse",
)
register(
    "rms_norm_grad",
    rms_norm_grad,
    "x: T, scale: T?, invvar: T, out_grad: T, epsilon: float = 1e-5",
    aliases=("fused_rms_norm_grad",),
    forward_name="RmsNormGradInferSpmd",
)
