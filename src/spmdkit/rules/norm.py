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

from spmdkit.core.dist_attr import DimsMapping, Entry, ReduceType, TensorDistAttr, entry_dims
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.notation import (
    ALPHABET,
    BROADCAST,
    attr_as,
    common_mesh,
    fast_result,
    merge_weight,
)
from spmdkit.rules._absent import zero_d_absent
from spmdkit.rules.registry import register

_SUM = ReduceType.SUM
_make = TensorDistAttr._make

# ---------------------------------------------------------------------------
# notations (the letters are ints here: batch axis i is letter i)
# ---------------------------------------------------------------------------


def _x_axes(ndim: int, bna: int) -> tuple[str, str]:
    """(x's axes, the batch axes): ``ab1`` and ``ab`` for ndim 3, begin_norm_axis 2."""
    if ndim > len(ALPHABET):
        raise ShapeMismatchError(f"tensors of more than {len(ALPHABET)} dims are not supported")
    batch = ALPHABET[:bna]
    return batch + BROADCAST * (ndim - bna), batch


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


# ---------------------------------------------------------------------------
# the batch-letter merge on ints (what merge_letters answers for these notations)
# ---------------------------------------------------------------------------


def _merge_batch(
    dms: tuple[DimsMapping, ...], shapes: tuple[tuple[int, ...], ...], nb: int
) -> tuple[Entry, ...]:
    """The batch letters' mesh dims, for tensors whose first ``nb`` axes are the batch
    letters (the others broadcast) and whose entries are single mesh dims (after
    :func:`_single`): per letter the first tensor sharding it claims it, another tensor
    sharding it over another mesh dim takes it where it has more elements; then, in claim
    order, a mesh dim already taken is dropped (:func:`merge_letters`)."""
    if nb == 0:
        return ()
    ld = [-1] * nb
    holder = [0] * nb
    claims: list[int] = []
    weights: list[int] | None = None
    t = 0
    for dm in dms:
        for i in range(nb):
            e = dm[i]
            if e < 0:  # type: ignore[operator]
                continue
            cur = ld[i]
            if cur < 0:
                ld[i] = e  # type: ignore[assignment]
                holder[i] = t
                claims.append(i)
            elif cur != e:
                if weights is None:
                    weights = [merge_weight(s) for s in shapes]
                if weights[t] > weights[holder[i]]:
                    ld[i] = e  # type: ignore[assignment]
                    holder[i] = t
        t += 1
    if not claims:
        return (-1,) * nb
    if len(claims) == 1:
        return tuple(ld)
    final = [-1] * nb
    used = 0
    for i in claims:
        d = ld[i]
        if not (used >> d) & 1:
            final[i] = d
            used |= 1 << d
    return tuple(final)


def _mesh_of(op: str, tensors: tuple[DistTensorSpec | None, ...]) -> ProcessMesh:
    """:func:`common_mesh` (the first tensor's mesh; the same errors)."""
    first = tensors[0]
    assert first is not None
    mesh = first.dist_attr.mesh
    for t in tensors:
        if t is not None and t.dist_attr.mesh is not mesh:
            return common_mesh(op, tensors)
    return mesh


def _rep(mesh: ProcessMesh, t: DistTensorSpec | None, ndim: int) -> TensorDistAttr | None:
    """A replicated dist attr of ``ndim`` dims for the tensor (None where absent)."""
    if t is None:
        return None
    return attr_as(t.dist_attr, mesh, _REP[ndim] if ndim < len(_REP) else (-1,) * ndim)


_REP = tuple((-1,) * i for i in range(32))


def _batch_sum(mesh: ProcessMesh, t: DistTensorSpec | None, b: tuple[Entry, ...]) -> TensorDistAttr | None:
    """A replicated grad of ``t``'s rank, partial SUM over the batch letters' mesh dims."""
    if t is None:
        return None
    pt = sorted([d for d in b if d >= 0])  # type: ignore[operator]
    nd = len(t.shape)
    return _make(mesh, _REP[nd] if nd < len(_REP) else (-1,) * nd, tuple([(d, _SUM) for d in pt]))  # type: ignore[misc]


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
    mesh = _mesh_of(op, (x, scale, bias))
    nd = len(x.shape)
    bna = _bna(op, begin_norm_axis, nd)
    size = _numel(x.shape[bna:])
    _check_param(op, "scale", scale, size)
    _check_param(op, "bias", bias, size)
    if nd > len(ALPHABET):
        _x_axes(nd, bna)  # raises
    xa = x.dist_attr
    b = _merge_batch((_single(xa.dims_mapping, mesh.shape),), (x.shape,), bna)
    ax = attr_as(xa, mesh, b + _REP[nd - bna])
    st = _make(mesh, b)
    return fast_result((ax, _rep(mesh, scale, 1), _rep(mesh, bias, 1)), (ax, st, st))


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
    mesh = _mesh_of(op, (x, scale, bias, out, mean, variance))
    nd = len(x.shape)
    bna = _bna(op, begin_norm_axis, nd)
    size = _numel(x.shape[bna:])
    _check_param(op, "scale", scale, size)
    _check_param(op, "bias", bias, size)
    _check_same(op, x, "x", out, "out")
    _check_stat(op, "mean", mean, x, bna)
    _check_stat(op, "variance", variance, x, bna)
    if nd > len(ALPHABET):
        _x_axes(nd, bna)  # raises
    ms = mesh.shape
    odm = _single(out.dist_attr.dims_mapping, ms)
    mdm, vdm = _single(mean.dist_attr.dims_mapping, ms), _single(variance.dist_attr.dims_mapping, ms)
    blocked = _norm_dims(odm, bna)
    if blocked:
        mdm, vdm = _without(mdm, blocked), _without(vdm, blocked)
    b = _merge_batch((odm, mdm, vdm), (out.shape, mean.shape, variance.shape), bna)
    ax = attr_as(x.dist_attr, mesh, b + _REP[nd - bna])
    st = _make(mesh, b)
    return fast_result((ax, _rep(mesh, scale, 1), _rep(mesh, bias, 1)), (ax, st, st))


def _norm_dims(dm: DimsMapping, bna: int) -> frozenset[int]:
    """The mesh dims out shards its normalized axes on: Paddle's merge lets them claim the
    mesh dim first, so mean / variance lose it."""
    s: set[int] | None = None
    for e in dm[bna:]:
        if e != -1:
            if s is None:
                s = set()
            s.update(entry_dims(e))
    return _NONE if s is None else frozenset(s)


_NONE: frozenset[int] = frozenset()


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
    mesh = _mesh_of(op, (x, scale, bias, mean, variance, out_grad))
    nd = len(x.shape)
    bna = _bna(op, begin_norm_axis, nd)
    size = _numel(x.shape[bna:])
    _check_param(op, "scale", scale, size, flat=False)
    _check_param(op, "bias", bias, size, flat=False)
    _check_same(op, x, "x", out_grad, "out_grad")
    _check_stat(op, "mean", mean, x, bna)
    _check_stat(op, "variance", variance, x, bna)
    if nd > len(ALPHABET):
        _x_axes(nd, bna)  # raises
    ms = mesh.shape
    b = _merge_batch(
        (_single(x.dist_attr.dims_mapping, ms), _single(mean.dist_attr.dims_mapping, ms),
         _single(variance.dist_attr.dims_mapping, ms), _single(out_grad.dist_attr.dims_mapping, ms)),
        (x.shape, mean.shape, variance.shape, out_grad.shape),
        bna,
    )  # fmt: skip
    ax = attr_as(x.dist_attr, mesh, b + _REP[nd - bna])
    st = _make(mesh, b)
    return fast_result(
        (ax, _rep(mesh, scale, len(scale.shape)) if scale is not None else None,
         _rep(mesh, bias, len(bias.shape)) if bias is not None else None, st, st, ax),
        (ax, _batch_sum(mesh, scale, b), _batch_sum(mesh, bias, b)),
    )  # fmt: skip


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
    mesh = _mesh_of(op, (x, scale))
    nd = _rms_checks(op, x, scale)
    if nd > len(ALPHABET):
        _x_axes(nd, nd - 1)  # raises
    xa = x.dist_attr
    b = _merge_batch((_single(xa.dims_mapping, mesh.shape),), (x.shape,), nd - 1)
    ax = attr_as(xa, mesh, (*b, -1))
    return fast_result((ax, _rep(mesh, scale, 1)), (ax, _make(mesh, b)))


def rms_norm_backward(
    x: DistTensorSpec,
    scale: DistTensorSpec | None,
    out: DistTensorSpec,
    invvar: DistTensorSpec,
    epsilon: float,
) -> SpmdResult:
    """RmsNormInferSpmdReverse: x from out and invvar."""
    op = "fused_rms_norm"
    mesh = _mesh_of(op, (x, scale, out, invvar))
    nd = _rms_checks(op, x, scale)
    _check_same(op, x, "x", out, "out")
    _check_stat(op, "invvar", invvar, x, nd - 1)
    if nd > len(ALPHABET):
        _x_axes(nd, nd - 1)  # raises
    ms = mesh.shape
    odm, idm = _single(out.dist_attr.dims_mapping, ms), _single(invvar.dist_attr.dims_mapping, ms)
    blocked = _norm_dims(odm, nd - 1)
    if blocked:
        idm = _without(idm, blocked)
    b = _merge_batch((odm, idm), (out.shape, invvar.shape), nd - 1)
    ax = attr_as(x.dist_attr, mesh, (*b, -1))
    return fast_result((ax, _rep(mesh, scale, 1)), (ax, _make(mesh, b)))


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
    mesh = _mesh_of(op, (x, scale, invvar, out_grad))
    nd = _rms_checks(op, x, scale)
    _check_same(op, x, "x", out_grad, "out_grad")
    _check_stat(op, "invvar", invvar, x, nd - 1)
    if nd > len(ALPHABET):
        _x_axes(nd, nd - 1)  # raises
    ms = mesh.shape
    b = _merge_batch(
        (_single(x.dist_attr.dims_mapping, ms), _single(invvar.dist_attr.dims_mapping, ms),
         _single(out_grad.dist_attr.dims_mapping, ms)),
        (x.shape, invvar.shape, out_grad.shape),
        nd - 1,
    )  # fmt: skip
    ax = attr_as(x.dist_attr, mesh, (*b, -1))
    return fast_result((ax, _rep(mesh, scale, 1), _make(mesh, b), ax), (ax, _batch_sum(mesh, scale, b)))


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
# fused_rms_norm: a 0-D scale (shape []) is read as absent (spmdkit.rules._absent)
register(
    "fused_rms_norm",
    zero_d_absent(rms_norm_forward, "x: T, scale: T?, epsilon: float = 1e-5", ("scale",)),
    "x: T, scale: T?, epsilon: float = 1e-5",
    zero_d_absent(rms_norm_backward, "x: T, scale: T?, out: T, invvar: T, epsilon: float = 1e-5", ("scale",),
                  outputs=("out", "invvar")),
    "x: T, scale: T?, out: T, invvar: T, epsilon: float = 1e-5",
    forward_name="RmsNormInferSpmd",
    backward_name="RmsNormInferSpmdReverse",
)
register(
    "rms_norm_grad",
    zero_d_absent(rms_norm_grad, "x: T, scale: T?, invvar: T, out_grad: T, epsilon: float = 1e-5", ("scale",)),
    "x: T, scale: T?, invvar: T, out_grad: T, epsilon: float = 1e-5",
    aliases=("fused_rms_norm_grad",),
    forward_name="RmsNormGradInferSpmd",
)
