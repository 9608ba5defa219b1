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

from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import numel
from spmdkit.engine.compile import Plan, compile_plan, infer
from spmdkit.engine.notation import BROADCAST, Notation, common_mesh, fast_result, letters_for
from spmdkit.rules._absent import zero_d_absent
from spmdkit.rules.registry import register

# ---------------------------------------------------------------------------
# notations: batch letters ``ab``, normalized axes ``1`` (named, replicated and blocking
# their mesh dims, where the reverse rules read them off out)
# ---------------------------------------------------------------------------

#: Paddle 3.3.1's merge: a co-sharded axis read as its largest mesh dim (coshard="largest"),
#: the larger tensor keeps an axis two shard differently, letters resolve in claim order
_COSHARD = "largest"


def _rank(t: DistTensorSpec | None) -> int:
    return -1 if t is None else len(t.shape)


def _ones(rank: int) -> str | None:
    return None if rank < 0 else BROADCAST * rank


@lru_cache(maxsize=4096)
def _plan(kind: str, nd: int, bna: int, ranks: tuple[int, ...]) -> Plan:
    """The compiled plan of one norm rule (``kind``: ln / ln_rev / ln_grad / rms / rms_rev /
    rms_grad) for x's rank, begin_norm_axis and the ranks of scale / bias (-1: absent)."""
    batch = letters_for(nd)[:bna]
    x = batch + BROADCAST * (nd - bna)
    named = letters_for(nd)  # out in the reverse rules: the normalized axes named
    params = [_ones(r) for r in ranks]
    if kind in ("ln", "rms"):
        nt = Notation([x, *params], [x, batch] + ([batch] if kind == "ln" else []), coshard=_COSHARD)
        return compile_plan(nt)
    if kind in ("ln_rev", "rms_rev"):
        stats = [batch, batch] if kind == "ln_rev" else [batch]
        nt = Notation([x, *params], [named, *stats], replicated=named[bna:], replicated_claims="block", coshard=_COSHARD)
        return compile_plan(nt, "backward")
    stats = [batch, batch] if kind == "ln_grad" else [batch]
    nt = Notation([x, *params, *stats, x], [x, *params], coshard=_COSHARD)
    return compile_plan(nt)


# ---------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------


def _bna(op: str, begin_norm_axis: int, ndim: int) -> int:
    if not 0 <= begin_norm_axis <= ndim:
        raise InvalidAttributeError(
            f"{op}: begin_norm_axis {begin_norm_axis} out of range for a {ndim}-D x (0..{ndim})"
        )
    return begin_norm_axis


def _check_param(op: str, name: str, t: DistTensorSpec | None, size: int, flat: bool = True) -> None:
    """scale / bias: 1-D of ``size`` (the product of the normalized axes); the grad rule
    also takes them in any shape of that many elements (as Paddle's C++ test does)."""
    if t is None:
        return
    if flat and len(t.shape) != 1:
        raise ShapeMismatchError(f"{op}: {name} must be 1-D, got shape {list(t.shape)}")
    n = numel(t.shape)
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


def _mesh_of(op: str, tensors: tuple[DistTensorSpec | None, ...]) -> ProcessMesh:
    """:func:`common_mesh` (the first tensor's mesh; the same errors)."""
    first = tensors[0]
    assert first is not None
    mesh = first.dist_attr.mesh
    for t in tensors:
        if t is not None and t.dist_attr.mesh is not mesh:
            return common_mesh(op, tensors)
    return mesh


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
    size = numel(x.shape[bna:])
    _check_param(op, "scale", scale, size)
    _check_param(op, "bias", bias, size)
    p = _plan("ln", nd, bna, (_rank(scale), _rank(bias)))
    return fast_result(*infer(p, op, (x, scale, bias), (), mesh, _LN_NAMES))


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
    size = numel(x.shape[bna:])
    _check_param(op, "scale", scale, size)
    _check_param(op, "bias", bias, size)
    _check_same(op, x, "x", out, "out")
    _check_stat(op, "mean", mean, x, bna)
    _check_stat(op, "variance", variance, x, bna)
    p = _plan("ln_rev", nd, bna, (_rank(scale), _rank(bias)))
    return fast_result(*infer(p, op, (x, scale, bias), (out, mean, variance), mesh, _LN_REV_NAMES))


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
    size = numel(x.shape[bna:])
    _check_param(op, "scale", scale, size, flat=False)
    _check_param(op, "bias", bias, size, flat=False)
    _check_same(op, x, "x", out_grad, "out_grad")
    _check_stat(op, "mean", mean, x, bna)
    _check_stat(op, "variance", variance, x, bna)
    p = _plan("ln_grad", nd, bna, (_rank(scale), _rank(bias)))
    return fast_result(*infer(p, op, (x, scale, bias, mean, variance, out_grad), (), mesh, _LN_GRAD_NAMES))


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
    p = _plan("rms", nd, nd - 1, (_rank(scale),))
    return fast_result(*infer(p, op, (x, scale), (), mesh, ("x", "scale")))


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
    p = _plan("rms_rev", nd, nd - 1, (_rank(scale),))
    return fast_result(*infer(p, op, (x, scale), (out, invvar), mesh, ("x", "scale", "out", "invvar")))


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
    p = _plan("rms_grad", nd, nd - 1, (_rank(scale),))
    return fast_result(*infer(p, op, (x, scale, invvar, out_grad), (), mesh, ("x", "scale", "invvar", "out_grad")))


# ---------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------

register(
    "layer_norm",
    layer_norm_forward,
    "x: T, scale: T?, bias: T?, epsilon: float = 1e-5, begin_norm_axis: int = 1",
    layer_norm_backward,
    kind="reverse",
    outputs="out: T, mean: T, variance: T",
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
    kind="reverse",
    outputs="out: T, invvar: T",
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
