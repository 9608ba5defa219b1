"""Attention ops: flash_attention, fused_rotary_position_embedding and their grads.

flash_attention (Paddle 3.3.1's ``flash_attention.cc``), q ``[b, s, h, d]``,
k ``[b, t, hk, d]``, v ``[b, t, hk, e]``, attn_mask ``[b|1, h|1, s, t]``::

    bshd, bthd, bthe, bhst -> bshe (out), bhst (softmax), bhs (softmax_lse), [2] (seed_offset)

with the sequence axes ``s``, ``t`` and the head dims ``d``, ``e`` replicated: only batch
``b`` and heads ``h`` may be sharded (nothing becomes partial; partial inputs are made
replicated). As Paddle, the forward merge reads k's dims_mapping in v's place (v's own
sharding is not considered; v is resharded like k). With grouped heads (``hk < h``) the
mesh dims of ``h`` must divide ``hk`` (minor dims dropped first) so that every rank holds
the kv heads its q heads use; Paddle checks only k's own mesh dim, and so answers an
uneven split of the kv heads when q brings the sharding (``fa-gqa-uneven``). A size-1
batch or head axis of attn_mask is a broadcast axis and never sharded (Paddle shards a
size-1 mask batch axis, ``fa-mask-broadcast``). fixed_seed_offset and seed_offset are
replicated (Paddle echoes fixed_seed_offset's dist attr, ``fa-seed-replicated``).

The reverse rule (FlashAttInferSpmdReverse) merges out and softmax_lse; as Paddle it
reads v's dims_mapping in out's place (a Paddle quirk, sound). It returns the outputs the
inferred inputs produce (Paddle echoes softmax and seed_offset, ``fa-reverse-echo``,
DESIGN class 4).

flash_attention_grad (FlashAttGradInferSpmd(q, k, v, out, softmax_lse, seed_offset,
attn_mask, out_grad, dropout, causal)): the same notation over q, k, v, out, out_grad and
softmax_lse (v's own mapping is used here); q_grad, k_grad, v_grad are sharded as q, k, v.

fused_rotary_position_embedding (``fused_rope.cc``), q/k/v ``[b, s, h, d]`` (time_major:
``[s, b, h, d]``), sin/cos ``[1, s, 1, d]`` or ``[s, d]``, position_ids ``[b, s]``::

    bshd, bshd, bshd, 1s1d, 1s1d, bs -> bshd, bshd, bshd

merged over q, k, v and position_ids (the reverse: over out_q, out_k, out_v). ``d`` is
replicated; ``s`` may stay sharded only when sin and cos are given and position_ids is not
(the kernel then rotates each local block by its own rows of sin/cos); otherwise ``s`` is
replicated (the kernel computes positions from 0, or looks positions up in the whole
table). sin/cos take q's sequence sharding (or none) and are replicated elsewhere: their
size-1 axes are never sharded (Paddle keeps whatever sin had there, and gives cos sin's
mapping when ``s`` is sharded, ``rope-sin-cos``). Partial inputs are made replicated.
fused_rotary_position_embedding_grad (FusedRopeGradInferSpmd(sin, cos, position_ids,
out_q_grad, out_k_grad, out_v_grad, ...)) is the forward rule run on the grads (the grad
kernel is the forward kernel with sin negated).
"""

from __future__ import annotations

from collections.abc import Iterable

from spmdkit.core.dist_attr import DimsMapping, TensorDistAttr
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import mesh_size, one_mesh_dim, replicated_like
from spmdkit.engine.memo import memo
from spmdkit.engine.notation import BROADCAST, fast_result, merge_letters, named_mesh, project
from spmdkit.rules._absent import zero_d_absent
from spmdkit.rules.registry import register, reverse_signature

Shape = tuple[int, ...]
Letters = dict[str, tuple[int, ...]]
_make = TensorDistAttr.unchecked


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _mesh(op: str, named: Iterable[tuple[str, DistTensorSpec | None]]) -> ProcessMesh:
    return named_mesh(op, named)


def _ndim(op: str, t: DistTensorSpec, name: str, nds: tuple[int, ...], what: str) -> None:
    if len(t.shape) not in nds:
        raise ShapeMismatchError(f"{op}: {name} must be {what}, got {len(t.shape)} dims {list(t.shape)}")


def _eq(op: str, a: int, b: int, what: str) -> None:
    if a >= 0 and b >= 0 and a != b:
        raise ShapeMismatchError(f"{op}: {what} ({a} vs {b})")


def _dm(t: DistTensorSpec | None) -> DimsMapping | None:
    return None if t is None else t.dist_attr.dims_mapping


def _shape(t: DistTensorSpec | None) -> Shape | None:
    return None if t is None else t.shape


# ---------------------------------------------------------------------------
# flash_attention
# ---------------------------------------------------------------------------

_Q, _K, _V, _OUT, _SM, _LSE = "bshd", "bthd", "bthe", "bshe", "bhst", "bhs"
_FA_REPL = frozenset("sdte")


def _mask_axes(ms: Shape, b: int, h: int) -> str:
    """attn_mask ``[b|1, h|1, s, t]``: a size-1 batch / head axis broadcasts."""
    return ("b" if ms[0] != 1 else BROADCAST) + ("h" if ms[1] != 1 else BROADCAST) + "st"


def _single(dm: DimsMapping | None, mesh_shape: Shape) -> DimsMapping | None:
    """A co-sharded entry keeps its largest mesh dim, as Paddle's ShardingMergeForTensors does."""
    return None if dm is None else one_mesh_dim(dm, mesh_shape)


def _unshard_heads(axes: str | None, dm: DimsMapping | None, hk: int, mesh_shape: Shape) -> DimsMapping | None:
    if axes is None or dm is None or "h" not in axes:
        return dm
    i = axes.index("h")
    e = dm[i]
    if isinstance(e, int) and e >= 0 and hk % mesh_shape[e] != 0:
        return (*dm[:i], -1, *dm[i + 1:])
    return dm


def _fa_letters(
    axes: tuple[str | None, ...],
    mappings: tuple[DimsMapping | None, ...],
    shapes: tuple[Shape | None, ...],
    hq: int,
    hk: int,
    mesh_shape: Shape,
) -> Letters:
    single = tuple(_single(m, mesh_shape) for m in mappings)
    if hq != hk and hk > 0:
        # grouped heads: a mesh dim that does not divide the kv heads cannot shard them
        # (dropped before the merge, so that it stays free for the batch axis)
        single = tuple(_unshard_heads(a, m, hk, mesh_shape) for a, m in zip(axes, single))
    merged = dict(merge_letters(axes, single, shapes, _FA_REPL, "", mesh_shape))
    d = merged.get("h", ())
    if d and hq != hk and hk > 0:
        # grouped heads: every rank must hold whole kv heads for its q heads
        while d and hk % mesh_size(mesh_shape, d) != 0:
            d = d[:-1]
        merged["h"] = d
    return merged


def _check_qkv(op: str, q: DistTensorSpec, k: DistTensorSpec, v: DistTensorSpec) -> tuple[int, int]:
    for n, t in (("q", q), ("k", k), ("v", v)):
        _ndim(op, t, n, (4,), "4-D [batch, seq, heads, head_dim]")
    qs, ks, vs = q.shape, k.shape, v.shape
    _eq(op, qs[0], ks[0], "q and k differ in batch size")
    _eq(op, qs[0], vs[0], "q and v differ in batch size")
    _eq(op, qs[3], ks[3], "q and k differ in head_dim")
    _eq(op, ks[1], vs[1], "k and v differ in seq_len")
    _eq(op, ks[2], vs[2], "k and v differ in num_heads")
    hq, hk = qs[2], ks[2]
    if hk == 0 or (hq >= 0 and hk > 0 and hq % hk != 0):
        raise ShapeMismatchError(f"{op}: q's num_heads {hq} is not a multiple of k's {hk}")
    return hq, hk


def _check_mask(op: str, mask: DistTensorSpec | None, q: DistTensorSpec, k: DistTensorSpec) -> str | None:
    if mask is None:
        return None
    _ndim(op, mask, "attn_mask", (4,), "4-D [batch, heads, seq_q, seq_kv]")
    ms, qs = mask.shape, q.shape
    if ms[0] != 1:
        _eq(op, ms[0], qs[0], "attn_mask's batch is neither 1 nor q's batch")
    if ms[1] != 1:
        _eq(op, ms[1], qs[2], "attn_mask's num_heads is neither 1 nor q's num_heads")
    _eq(op, ms[2], qs[1], "attn_mask's seq_q differs from q's seq_len")
    _eq(op, ms[3], k.shape[1], "attn_mask's seq_kv differs from k's seq_len")
    return _mask_axes(ms, qs[0], qs[2])


def _check_attrs(op: str, dropout: float) -> None:
    if not 0.0 <= dropout < 1.0:
        raise InvalidAttributeError(f"{op}: dropout must be in [0, 1), got {dropout}")


@memo()
def _fa_forward_plan(
    qs: Shape, ks: Shape, ma: str | None, ms: Shape | None,
    qd: DimsMapping, kd: DimsMapping, md: DimsMapping | None, mesh_shape: Shape,
) -> tuple[DimsMapping, ...]:
    # as Paddle: k's mapping stands in for v's in the merge
    letters = _fa_letters((_Q, _K, _K, ma), (qd, kd, kd, md), (qs, ks, ks, ms), qs[2], ks[2], mesh_shape)
    return (project(_Q, letters), project(_K, letters), project(_V, letters),
            project(ma, letters) if ma else (), project(_OUT, letters), project(_SM, letters),
            project(_LSE, letters))  # fmt: skip


def flash_attention_forward(
    q: DistTensorSpec,
    k: DistTensorSpec,
    v: DistTensorSpec,
    fixed_seed_offset: DistTensorSpec | None = None,
    attn_mask: DistTensorSpec | None = None,
    dropout: float = 0.0,
    causal: bool = False,
    return_softmax: bool = False,
    is_test: bool = False,
) -> SpmdResult:
    """flash_attention (FlashAttInferSpmdStatic): batch and heads sharded, the rest replicated."""
    op = "flash_attention"
    mesh = _mesh(op, [("q", q), ("k", k), ("v", v), ("fixed_seed_offset", fixed_seed_offset),
                      ("attn_mask", attn_mask)])
    _check_attrs(op, dropout)
    _check_qkv(op, q, k, v)
    ma = _check_mask(op, attn_mask, q, k)
    qd, kd, vd, mkd, od, sd, ld = _fa_forward_plan(
        q.shape, k.shape, ma, _shape(attn_mask), q.dist_attr.dims_mapping, k.dist_attr.dims_mapping,
        _dm(attn_mask), mesh.shape,
    )
    return fast_result(
        (_make(mesh, qd), _make(mesh, kd), _make(mesh, vd), replicated_like(mesh, fixed_seed_offset),
         None if attn_mask is None else _make(mesh, mkd)),
        (_make(mesh, od), _make(mesh, sd), _make(mesh, ld), _make(mesh, (-1,))),
    )  # fmt: skip


@memo()
def _fa_reverse_plan(
    qs: Shape, ks: Shape, ma: str | None, vd: DimsMapping, lse_d: DimsMapping | None, mesh_shape: Shape
) -> tuple[DimsMapping, ...]:
    # as Paddle: v's mapping stands in for out's
    letters = _fa_letters((_OUT, _LSE if lse_d is not None else None), (vd, lse_d), (None, None),
                          qs[2], ks[2], mesh_shape)
    return (project(_Q, letters), project(_K, letters), project(_V, letters),
            project(ma, letters) if ma else (), project(_OUT, letters), project(_SM, letters),
            project(_LSE, letters))  # fmt: skip


def flash_attention_backward(
    q: DistTensorSpec,
    k: DistTensorSpec,
    v: DistTensorSpec,
    fixed_seed_offset: DistTensorSpec | None,
    attn_mask: DistTensorSpec | None,
    out: DistTensorSpec,
    softmax: DistTensorSpec | None,
    softmax_lse: DistTensorSpec | None,
    seed_offset: DistTensorSpec | None,
    dropout: float = 0.0,
    causal: bool = False,
    return_softmax: bool = False,
    is_test: bool = False,
) -> SpmdResult:
    """flash_attention (FlashAttInferSpmdReverse): q, k, v from out and softmax_lse; the
    outputs returned are those the inferred inputs produce."""
    op = "flash_attention"
    mesh = _mesh(op, [("q", q), ("k", k), ("v", v), ("fixed_seed_offset", fixed_seed_offset),
                      ("attn_mask", attn_mask), ("out", out), ("softmax", softmax),
                      ("softmax_lse", softmax_lse), ("seed_offset", seed_offset)])
    _check_attrs(op, dropout)
    _check_qkv(op, q, k, v)
    ma = _check_mask(op, attn_mask, q, k)
    _ndim(op, out, "out", (4,), "4-D [batch, seq_q, heads, head_dim_v]")
    qs, vs = q.shape, v.shape
    for i, (a, b) in enumerate(zip(out.shape, (qs[0], qs[1], qs[2], vs[3]))):
        _eq(op, a, b, f"out axis {i} differs from what q, k, v give")
    if softmax_lse is not None:
        _ndim(op, softmax_lse, "softmax_lse", (3,), "3-D [batch, heads, seq_q]")
        for i, (a, b) in enumerate(zip(softmax_lse.shape, (qs[0], qs[2], qs[1]))):
            _eq(op, a, b, f"softmax_lse axis {i} differs from what q gives")
    if softmax is not None:
        _ndim(op, softmax, "softmax", (4,), "4-D [batch, heads, seq_q, seq_kv]")
    qd, kd, vd, mkd, od, sd, ld = _fa_reverse_plan(
        qs, k.shape, ma, v.dist_attr.dims_mapping, _dm(softmax_lse), mesh.shape
    )
    return fast_result(
        (_make(mesh, qd), _make(mesh, kd), _make(mesh, vd), replicated_like(mesh, fixed_seed_offset),
         None if attn_mask is None else _make(mesh, mkd)),
        (_make(mesh, od), None if softmax is None else _make(mesh, sd),
         None if softmax_lse is None else _make(mesh, ld), None if seed_offset is None else _make(mesh, (-1,))),
    )  # fmt: skip


@memo()
def _fa_grad_plan(
    qs: Shape, ks: Shape, ma: str | None,
    mappings: tuple[DimsMapping | None, ...], shapes: tuple[Shape | None, ...], mesh_shape: Shape,
) -> tuple[DimsMapping, ...]:
    axes = (_Q, _K, _V, _OUT, _LSE, _OUT)
    letters = _fa_letters(axes, mappings, shapes, qs[2], ks[2], mesh_shape)
    return (project(_Q, letters), project(_K, letters), project(_V, letters),
            project(ma, letters) if ma else (), project(_OUT, letters), project(_LSE, letters))  # fmt: skip


def flash_attention_grad(
    q: DistTensorSpec,
    k: DistTensorSpec,
    v: DistTensorSpec,
    out: DistTensorSpec,
    softmax_lse: DistTensorSpec,
    seed_offset: DistTensorSpec | None,
    attn_mask: DistTensorSpec | None,
    out_grad: DistTensorSpec,
    dropout: float = 0.0,
    causal: bool = False,
) -> SpmdResult:
    """flash_attention_grad (FlashAttGradInferSpmd): q_grad, k_grad, v_grad sharded as q, k, v
    (batch and heads only)."""
    op = "flash_attention_grad"
    mesh = _mesh(op, [("q", q), ("k", k), ("v", v), ("out", out), ("softmax_lse", softmax_lse),
                      ("seed_offset", seed_offset), ("attn_mask", attn_mask), ("out_grad", out_grad)])
    _check_attrs(op, dropout)
    _check_qkv(op, q, k, v)
    ma = _check_mask(op, attn_mask, q, k)
    qs, vs = q.shape, v.shape
    want_out = (qs[0], qs[1], qs[2], vs[3])
    for n, t in (("out", out), ("out_grad", out_grad)):
        _ndim(op, t, n, (4,), "4-D [batch, seq_q, heads, head_dim_v]")
        for i, (a, b) in enumerate(zip(t.shape, want_out)):
            _eq(op, a, b, f"{n} axis {i} differs from what q, k, v give")
    _ndim(op, softmax_lse, "softmax_lse", (3,), "3-D [batch, heads, seq_q]")
    for i, (a, b) in enumerate(zip(softmax_lse.shape, (qs[0], qs[2], qs[1]))):
        _eq(op, a, b, f"softmax_lse axis {i} differs from what q gives")
    ts = (q, k, v, out, softmax_lse, out_grad)
    qd, kd, vd, mkd, od, ld = _fa_grad_plan(
        qs, k.shape, ma, tuple(t.dist_attr.dims_mapping for t in ts), tuple(t.shape for t in ts), mesh.shape
    )
    qa, ka, va, oa = _make(mesh, qd), _make(mesh, kd), _make(mesh, vd), _make(mesh, od)
    return fast_result(
        (qa, ka, va, oa, _make(mesh, ld), replicated_like(mesh, seed_offset),
         None if attn_mask is None else _make(mesh, mkd), oa),
        (qa, ka, va),
    )  # fmt: skip


# ---------------------------------------------------------------------------
# fused_rotary_position_embedding
# ---------------------------------------------------------------------------


def _rope_check(
    op: str,
    qn: str,
    q: DistTensorSpec,
    others: list[tuple[str, DistTensorSpec | None]],
    sin: DistTensorSpec | None,
    cos: DistTensorSpec | None,
    position_ids: DistTensorSpec | None,
    time_major: bool,
) -> None:
    _ndim(op, q, qn, (4,), "4-D [batch, seq, heads, head_dim]")
    for n, t in others:
        if t is not None:
            _ndim(op, t, n, (4,), f"4-D, shaped as {qn}")
            for i, (a, b) in enumerate(zip(t.shape, q.shape)):
                _eq(op, a, b, f"{n} and {qn} differ on axis {i}")
    bi, si = (1, 0) if time_major else (0, 1)
    b, s, d = q.shape[bi], q.shape[si], q.shape[3]
    if d >= 0 and d % 2 != 0:
        raise ShapeMismatchError(f"{op}: {qn}'s head_dim {d} must be even")
    if position_ids is not None:
        _ndim(op, position_ids, "position_ids", (2,), "2-D [batch, seq]")
        _eq(op, position_ids.shape[0], b, f"position_ids' batch differs from {qn}'s")
        _eq(op, position_ids.shape[1], s, f"position_ids' seq_len differs from {qn}'s")
    if (sin is None) != (cos is None):
        raise ShapeMismatchError(f"{op}: sin and cos must be given together")
    if sin is None or cos is None:
        return
    _ndim(op, sin, "sin", (2, 4), "2-D [seq, head_dim] or 4-D [1, seq, 1, head_dim]")
    if sin.shape != cos.shape:
        raise ShapeMismatchError(f"{op}: sin {list(sin.shape)} and cos {list(cos.shape)} differ")
    ss = sin.shape
    if len(ss) == 4 and (ss[0] != 1 or ss[2] != 1):
        raise ShapeMismatchError(f"{op}: sin/cos must have batch and num_heads 1, got {list(ss)}")
    sl, sd = (ss[1], ss[3]) if len(ss) == 4 else (ss[0], ss[1])
    _eq(op, sd, d, f"sin/cos head_dim differs from {qn}'s")
    if position_ids is None:
        _eq(op, sl, s, f"sin/cos seq_len differs from {qn}'s (no position_ids)")
    elif sl >= 0 and s >= 0 and sl < s:
        raise ShapeMismatchError(f"{op}: sin/cos seq_len {sl} is shorter than {qn}'s {s}")


@memo()
def _rope_plan(
    mappings: tuple[DimsMapping | None, ...],
    shapes: tuple[Shape | None, ...],
    ids_axes: str | None,
    sin_nd: int,
    has_ids: bool,
    time_major: bool,
    mesh_shape: Shape,
) -> tuple[DimsMapping, DimsMapping, DimsMapping | None]:
    """(q's dims_mapping, sin/cos's, position_ids')."""
    qkv = "sbhd" if time_major else "bshd"
    axes = (qkv, qkv, qkv, ids_axes)
    single = tuple(_single(m, mesh_shape) for m in mappings)
    # as Paddle: every axis takes part in the merge (claiming its mesh dim), and head_dim
    # (and seq_len where it cannot stay sharded) is unsharded afterwards
    merged = dict(merge_letters(axes, single, shapes, frozenset(), "", mesh_shape))
    merged["d"] = ()
    if not sin_nd or has_ids:
        merged["s"] = ()
    qd = project(qkv, merged)
    sd: DimsMapping = ()
    if sin_nd:
        sd = project("1s1d" if sin_nd == 4 else "sd", merged)
    idd = None
    if has_ids:
        idd = project("bs", {"b": merged.get("b", ())})
    return qd, sd, idd


def _rope_infer(
    op: str,
    names: tuple[str, str, str],
    q: DistTensorSpec,
    k: DistTensorSpec | None,
    v: DistTensorSpec | None,
    sin: DistTensorSpec | None,
    cos: DistTensorSpec | None,
    position_ids: DistTensorSpec | None,
    time_major: bool,
    merge_ids: bool,
) -> tuple[tuple[TensorDistAttr | None, ...], tuple[TensorDistAttr | None, ...]]:
    """((q, k, v) answers, None where absent; (sin, cos, position_ids) answers)."""
    mesh = _mesh(op, [(names[0], q), (names[1], k), (names[2], v), ("sin", sin), ("cos", cos),
                      ("position_ids", position_ids)])
    _rope_check(op, names[0], q, [(names[1], k), (names[2], v)], sin, cos, position_ids, time_major)
    has_ids = position_ids is not None
    ids_axes = "bs" if has_ids and merge_ids else None
    qd, sd, idd = _rope_plan(
        (q.dist_attr.dims_mapping, _dm(k), _dm(v), _dm(position_ids) if ids_axes else None),
        (q.shape, _shape(k), _shape(v), _shape(position_ids) if ids_axes else None),
        ids_axes, 0 if sin is None else len(sin.shape), has_ids, time_major, mesh.shape,
    )
    qa = _make(mesh, qd)
    sa = None if sin is None else _make(mesh, sd)
    ia = None if idd is None else _make(mesh, idd)
    return (qa, None if k is None else qa, None if v is None else qa), (sa, sa, ia)


def fused_rope_forward(
    q: DistTensorSpec,
    k: DistTensorSpec | None = None,
    v: DistTensorSpec | None = None,
    sin: DistTensorSpec | None = None,
    cos: DistTensorSpec | None = None,
    position_ids: DistTensorSpec | None = None,
    use_neox_rotary_style: bool = True,
    time_major: bool = False,
    rotary_emb_base: float = 10000.0,
) -> SpmdResult:
    """fused_rotary_position_embedding (FusedRopeInferSpmd): q, k, v and the outputs alike;
    head_dim replicated, seq_len sharded only with sin/cos and without position_ids."""
    qkv, tables = _rope_infer("fused_rotary_position_embedding", ("q", "k", "v"), q, k, v, sin, cos,
                                position_ids, time_major, True)
    return fast_result(qkv + tables, qkv)


def fused_rope_backward(
    q: DistTensorSpec,
    k: DistTensorSpec | None,
    v: DistTensorSpec | None,
    sin: DistTensorSpec | None,
    cos: DistTensorSpec | None,
    position_ids: DistTensorSpec | None,
    out_q: DistTensorSpec,
    out_k: DistTensorSpec | None = None,
    out_v: DistTensorSpec | None = None,
    use_neox_rotary_style: bool = True,
    time_major: bool = False,
    rotary_emb_base: float = 10000.0,
) -> SpmdResult:
    """fused_rotary_position_embedding (FusedRopeInferSpmdReverse): the inputs from out_q,
    out_k, out_v; the outputs are what the inputs produce."""
    op = "fused_rotary_position_embedding"
    _mesh(op, [("q", q), ("out_q", out_q)])
    _rope_check(op, "q", q, [("k", k), ("v", v), ("out_q", out_q)], None, None, None, time_major)
    if (k is None) != (out_k is None) or (v is None) != (out_v is None):
        raise ShapeMismatchError(f"{op}: out_k / out_v must be given exactly where k / v are")
    qkv, tables = _rope_infer(op, ("out_q", "out_k", "out_v"), out_q, out_k, out_v, sin, cos, position_ids,
                                time_major, False)
    return fast_result(qkv + tables, qkv)


def fused_rope_grad(
    sin: DistTensorSpec | None,
    cos: DistTensorSpec | None,
    position_ids: DistTensorSpec | None,
    out_q_grad: DistTensorSpec,
    out_k_grad: DistTensorSpec | None = None,
    out_v_grad: DistTensorSpec | None = None,
    use_neox_rotary_style: bool = True,
    time_major: bool = False,
    rotary_emb_base: float = 10000.0,
) -> SpmdResult:
    """fused_rotary_position_embedding_grad (FusedRopeGradInferSpmd): the forward rule on the grads."""
    qkv, tables = _rope_infer("fused_rotary_position_embedding_grad", ("out_q_grad", "out_k_grad", "out_v_grad"),
                                out_q_grad, out_k_grad, out_v_grad, sin, cos, position_ids, time_major, True)
    return fast_result(tables + qkv, qkv)


# ---------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------

_FA_ATTRS = "dropout: float = 0.0, causal: bool = False, return_softmax: bool = False, is_test: bool = False"
# a 0-D optional tensor (shape []) is read as absent: see spmdkit.rules._absent
_FA_FWD = "q: T, k: T, v: T, fixed_seed_offset: T? = None, attn_mask: T? = None, " + _FA_ATTRS
_FA_OUTS = "out: T, softmax: T?, softmax_lse: T?, seed_offset: T?"
_FA_REV = reverse_signature(_FA_FWD, _FA_OUTS)
_FA_GRAD = ("q: T, k: T, v: T, out: T, softmax_lse: T, seed_offset: T?, attn_mask: T?, out_grad: T, "
            "dropout: float = 0.0, causal: bool = False")
register(
    "flash_attention", zero_d_absent(flash_attention_forward, _FA_FWD, ("fixed_seed_offset", "attn_mask")),
    _FA_FWD,
    # of the outputs, only softmax may be absent (where return_softmax is false: the op makes it
    # only when asked); softmax_lse and seed_offset always exist
    zero_d_absent(flash_attention_backward, _FA_REV,
                  ("fixed_seed_offset", "attn_mask", ("softmax", lambda args: not args[11])),
                  outputs=("out", "softmax", "softmax_lse", "seed_offset")),
    kind="reverse", outputs=_FA_OUTS,
    forward_name="FlashAttInferSpmdStatic", backward_name="FlashAttInferSpmdReverse",
)  # fmt: skip
register(
    "flash_attention_grad", zero_d_absent(flash_attention_grad, _FA_GRAD, ("seed_offset", "attn_mask")), _FA_GRAD,
    forward_name="FlashAttGradInferSpmd",
)  # fmt: skip
_ROPE_ATTRS = "use_neox_rotary_style: bool = True, time_major: bool = False, rotary_emb_base: float = 10000.0"
_ROPE_FWD = "q: T, k: T? = None, v: T? = None, sin: T? = None, cos: T? = None, position_ids: T? = None, " + _ROPE_ATTRS
_ROPE_OUTS = "out_q: T, out_k: T? = None, out_v: T? = None"
_ROPE_REV = reverse_signature(_ROPE_FWD, _ROPE_OUTS)
_ROPE_GRAD = ("sin: T?, cos: T?, position_ids: T?, out_q_grad: T, out_k_grad: T? = None, out_v_grad: T? = None, "
              + _ROPE_ATTRS)
register(
    "fused_rotary_position_embedding",
    zero_d_absent(fused_rope_forward, _ROPE_FWD, ("k", "v", "sin", "cos", "position_ids")), _ROPE_FWD,
    zero_d_absent(fused_rope_backward, _ROPE_REV, ("k", "v", "sin", "cos", "position_ids", "out_k", "out_v"),
                  outputs=("out_q", "out_k", "out_v")),
    kind="reverse", outputs=_ROPE_OUTS,
    aliases=("fused_rope",),
    forward_name="FusedRopeInferSpmd", backward_name="FusedRopeInferSpmdReverse",
)  # fmt: skip
register(
    "fused_rotary_position_embedding_grad",
    zero_d_absent(fused_rope_grad, _ROPE_GRAD, ("sin", "cos", "position_ids", "out_k_grad", "out_v_grad")),
    _ROPE_GRAD,
    aliases=("fused_rope_grad",),
    forward_name="FusedRopeGradInferSpmd",
)  # fmt: skip
