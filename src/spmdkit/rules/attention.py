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

from collections.abc import Callable
from typing import Any

from spmdkit.core.dist_attr import DimsMapping
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import make_attr, one_mesh_dim
from spmdkit.engine.declare import Answer, Way, generate
from spmdkit.engine.notation import BROADCAST, Notation, fast_result
from spmdkit.engine.registry import register
from spmdkit.engine.signature import reverse_signature
from spmdkit.rules._absent import zero_d_absent

Shape = tuple[int, ...]

# ---------------------------------------------------------------------------
# checks (ShapeMismatchError / InvalidAttributeError naming the op and the tensor)
# ---------------------------------------------------------------------------


def _ndim(op: str, t: DistTensorSpec, name: str, nds: tuple[int, ...], what: str) -> None:
    if len(t.shape) not in nds:
        raise ShapeMismatchError(f"{op}: {name} must be {what}, got {len(t.shape)} dims {list(t.shape)}")


def _eq(op: str, a: int, b: int, what: str) -> None:
    if a >= 0 and b >= 0 and a != b:
        raise ShapeMismatchError(f"{op}: {what} ({a} vs {b})")


def _like(op: str, name: str, t: DistTensorSpec, want: Shape, what: str) -> None:
    for i, (a, b) in enumerate(zip(t.shape, want)):
        _eq(op, a, b, f"{name} axis {i} differs from what {what} give{'s' if what == 'q' else ''}")


def _fa(op: str, q: DistTensorSpec, k: DistTensorSpec, v: DistTensorSpec, mask: DistTensorSpec | None,
        dropout: float, **more: DistTensorSpec | None) -> None:  # fmt: skip
    """dropout in [0, 1); q, k, v ``[b, s|t, h|hk, d|e]`` (hk dividing h); attn_mask
    ``[b|1, h|1, s, t]``; ``more``: out / out_grad ``[b, s, h, e]``, softmax_lse ``[b, h, s]``,
    softmax 4-D."""
    if not 0.0 <= dropout < 1.0:
        raise InvalidAttributeError(f"{op}: dropout must be in [0, 1), got {dropout}")
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
    if mask is not None:
        _ndim(op, mask, "attn_mask", (4,), "4-D [batch, heads, seq_q, seq_kv]")
        ms = mask.shape
        if ms[0] != 1:
            _eq(op, ms[0], qs[0], "attn_mask's batch is neither 1 nor q's batch")
        if ms[1] != 1:
            _eq(op, ms[1], qs[2], "attn_mask's num_heads is neither 1 nor q's num_heads")
        _eq(op, ms[2], qs[1], "attn_mask's seq_q differs from q's seq_len")
        _eq(op, ms[3], ks[1], "attn_mask's seq_kv differs from k's seq_len")
    for n, o in more.items():
        if o is None:
            continue
        if n == "softmax_lse":
            _ndim(op, o, n, (3,), "3-D [batch, heads, seq_q]")
            _like(op, n, o, (qs[0], qs[2], qs[1]), "q")
        elif n == "softmax":
            _ndim(op, o, n, (4,), "4-D [batch, heads, seq_q, seq_kv]")
        else:  # out, out_grad
            _ndim(op, o, n, (4,), "4-D [batch, seq_q, heads, head_dim_v]")
            _like(op, n, o, (qs[0], qs[1], qs[2], vs[3]), "q, k, v")


# ---------------------------------------------------------------------------
# flash_attention
# ---------------------------------------------------------------------------

_Q, _K, _V, _OUT, _SM, _LSE = "bshd", "bthd", "bthe", "bshe", "bhst", "bhs"


def _mask(rank: int, unit: int) -> str | None:
    """attn_mask ``[b|1, h|1, s, t]``: a size-1 batch / head axis broadcasts (never sharded)."""
    if rank < 0:
        return None
    return ("1" if unit & 1 else "b") + ("1" if unit & 2 else "h") + "st"


def _ones(rank: int) -> str | None:
    return None if rank < 0 else BROADCAST * rank


def fa_notation(kind: str, fso: int, mask: int, unit: int, *ranks: int) -> Notation:
    """The letters of flash_attention's tensors in Paddle's order, ``s t d e`` replicated, each
    co-shard read as its largest mesh dim:

    * forward ``q k v fixed_seed_offset attn_mask -> out softmax softmax_lse seed_offset``:
      ``bshd, bthd, bthe, 1, bhst -> bshe, bhst, bhs, 1``, merged over q, k and attn_mask (as
      Paddle, k's mapping stands in for v's: the same claims);
    * reverse, over ``q k v fixed_seed_offset attn_mask out softmax softmax_lse seed_offset``:
      merged over v (read in out's place, a Paddle quirk; the letters that differ are
      replicated) and softmax_lse, the first claim kept (Paddle's merge sees no shapes);
    * grad ``q k v out softmax_lse seed_offset attn_mask out_grad -> q_grad k_grad v_grad``:
      merged over q, k, v, out, softmax_lse and out_grad (the larger tensor wins)."""
    ma = _mask(mask, unit)
    if kind == "forward":
        return Notation([_Q, _K, _V, _ones(fso), ma], [_OUT, _SM, _LSE, None], replicated="sdte",
                        coshard="largest", sources=(0, 1, 4))  # fmt: skip
    if kind == "reverse":
        sm, lse, seed = ranks
        return Notation([_Q, _K, _V, _ones(fso), ma, _OUT, None if sm < 0 else _SM, None if lse < 0 else _LSE,
                         None if seed < 0 else "1"], [], replicated="sdte", coshard="largest", conflict="first",
                        sources=(2, 7))  # fmt: skip
    (seed,) = ranks
    return Notation([_Q, _K, _V, _OUT, _LSE, _ones(seed), ma, _OUT], [_Q, _K, _V], replicated="sdte",
                    coshard="largest", sources=(0, 1, 2, 3, 4, 7))  # fmt: skip


#: the head axis of each flash_attention tensor that has one
_HEADS = {"q": 2, "k": 2, "v": 2, "out": 2, "out_grad": 2, "softmax": 1, "softmax_lse": 1, "attn_mask": 1}


def _grouped_heads(fn: Callable[..., SpmdResult], signature: str) -> Callable[..., SpmdResult]:
    """Grouped heads (k's num_heads hk below q's): a mesh dim that does not divide hk cannot
    shard the heads, so each tensor's head entry (its co-shard read as the largest mesh dim)
    drops it before the merge, leaving the mesh dim free for the batch axis (Paddle checks
    only k's own mesh dim). What the merge then gives divides hk: every rank holds whole kv
    heads for its q heads."""
    from spmdkit.engine.signature import parse_signature

    names = [p.name for p in parse_signature(signature)]
    heads = [(i, _HEADS[n]) for i, n in enumerate(names) if n in _HEADS]
    qi, ki = names.index("q"), names.index("k")

    def call(*args: Any) -> SpmdResult:
        if len(args) <= max(qi, ki) or len(args[qi].shape) != 4 or len(args[ki].shape) != 4:
            return fn(*args)  # the checks say what is wrong
        hq, hk = args[qi].shape[2], args[ki].shape[2]
        if hq == hk or hk <= 0:
            return fn(*args)
        new = list(args)
        for i, ax in heads:
            t = args[i] if i < len(args) else None
            if t is None or len(t.shape) <= ax or (ax == 1 and names[i] == "attn_mask" and t.shape[1] == 1):
                continue
            a = t.dist_attr
            dm = one_mesh_dim(a.dims_mapping, a.mesh.shape)
            e = dm[ax] if len(dm) > ax else -1
            if isinstance(e, int) and e >= 0 and hk % a.mesh.shape[e] != 0:
                dm = (*dm[:ax], -1, *dm[ax + 1 :])
            if dm is not a.dims_mapping:
                new[i] = DistTensorSpec(t.shape, make_attr(a.mesh, dm, a.partial))
        return fn(*new)

    call.__doc__ = fn.__doc__
    return call


def _fa_seed(ins: Any, outs: Any, *args: object) -> Answer:
    """seed_offset ``[2]`` replicated (the engine would make it partial: it lacks every letter)."""
    return ins, (*outs[:3], make_attr(ins[0].mesh, (-1,)))


def _fa_split(ins: Any, outs: Any, *args: object) -> Answer:
    """The reverse, generated over all its tensors: the first five are the op's inputs."""
    return ins[:5], ins[5:]


def _wrap(names: tuple[Any, ...], gqa: bool = True, outputs: tuple[str, ...] = ()) -> Callable[..., Any]:
    """What is registered: grouped heads (see _grouped_heads) inside, and a 0-D optional tensor
    (shape []) read as absent (spmdkit.rules._absent) outside (``outputs``: the tensors
    answered as outputs, where the generated function's are not)."""

    def wrap(fn: Callable[..., SpmdResult], signature: str, outs: Any) -> Callable[..., SpmdResult]:
        return zero_d_absent(_grouped_heads(fn, signature) if gqa else fn, signature, names, outputs or outs)

    return wrap


def _reverse_signature(forward: str, outputs: str) -> str:
    """The registry's reverse signature, its optional tensors before the outputs without their
    default (Python cannot generate a default before a required parameter)."""
    sig = reverse_signature(forward, outputs)
    head, _, tail = sig.partition(outputs.split(":")[0] + ":")
    return head.replace(" = None", "") + outputs.split(":")[0] + ":" + tail


_ENV = {"_fa": _fa}
_FA_ATTRS = "dropout: float = 0.0, causal: bool = False, return_softmax: bool = False, is_test: bool = False"
_FA_FWD = "q: T, k: T, v: T, fixed_seed_offset: T? = None, attn_mask: T? = None, " + _FA_ATTRS
_FA_OUTS = "out: T, softmax: T?, softmax_lse: T?, seed_offset: T?"
_FA_KEY = "fixed_seed_offset, attn_mask, ones(attn_mask)"
_FA = Way(lambda *k: fa_notation("forward", *k), key=_FA_KEY, check="_fa(_OP, q, k, v, attn_mask, dropout)",
          env=_ENV, post=_fa_seed, wrap=_wrap(("fixed_seed_offset", "attn_mask")),
          paddle="FlashAttInferSpmdStatic",
          doc="flash_attention (FlashAttInferSpmdStatic): batch and heads sharded, the rest replicated.")
# of the outputs, only softmax may be absent (where return_softmax is false: the op makes it
# only when asked); softmax_lse and seed_offset always exist
_FA_REV = Way(lambda *k: fa_notation("reverse", *k), key=_FA_KEY + ", softmax, softmax_lse, seed_offset", env=_ENV,
              check="_fa(_OP, q, k, v, attn_mask, dropout, out=out, softmax_lse=softmax_lse, softmax=softmax)",
              post=_fa_split, paddle="FlashAttInferSpmdReverse",
              wrap=_wrap(("fixed_seed_offset", "attn_mask", ("softmax", lambda args: not args[11])),
                         outputs=("out", "softmax", "softmax_lse", "seed_offset")),
              doc="flash_attention (FlashAttInferSpmdReverse): q, k, v from out and softmax_lse; the outputs "
                  "returned are those the inferred inputs produce.")
register(
    "flash_attention", generate("flash_attention", _FA_FWD, _FA, name="flash_attention_forward"), _FA_FWD,
    # generated over all the tensors in the forward direction (it merges v and softmax_lse only)
    generate("flash_attention", _reverse_signature(_FA_FWD, _FA_OUTS), _FA_REV, name="flash_attention_backward"),
    kind="reverse", outputs=_FA_OUTS, forward_name=_FA.paddle, backward_name=_FA_REV.paddle,
)  # fmt: skip
_FA_GRAD_SIG = ("q: T, k: T, v: T, out: T, softmax_lse: T, seed_offset: T?, attn_mask: T?, out_grad: T, "
                "dropout: float = 0.0, causal: bool = False")
_FA_GRAD = Way(lambda *k: fa_notation("grad", 0, *k), key="attn_mask, ones(attn_mask), seed_offset", env=_ENV,
               check="_fa(_OP, q, k, v, attn_mask, dropout, out=out, out_grad=out_grad, softmax_lse=softmax_lse)",
               wrap=_wrap(("seed_offset", "attn_mask")), paddle="FlashAttGradInferSpmd",
               doc="flash_attention_grad (FlashAttGradInferSpmd): q_grad, k_grad, v_grad sharded as q, k, v (batch "
                   "and heads only).")
register("flash_attention_grad", generate("flash_attention_grad", _FA_GRAD_SIG, _FA_GRAD), _FA_GRAD_SIG,
         forward_name=_FA_GRAD.paddle)


# ---------------------------------------------------------------------------
# fused_rotary_position_embedding
# ---------------------------------------------------------------------------


def _rope(op: str, qn: str, q: DistTensorSpec, others: list[tuple[str, DistTensorSpec | None]],
          sin: DistTensorSpec | None, cos: DistTensorSpec | None, position_ids: DistTensorSpec | None,
          time_major: bool) -> None:  # fmt: skip
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


def _rope_reverse(op: str, q: DistTensorSpec, k: Any, v: Any, out_q: DistTensorSpec, out_k: Any, out_v: Any,
                  time_major: bool) -> None:  # fmt: skip
    _rope(op, "q", q, [("k", k), ("v", v), ("out_q", out_q)], None, None, None, time_major)
    if (k is None) != (out_k is None) or (v is None) != (out_v is None):
        raise ShapeMismatchError(f"{op}: out_k / out_v must be given exactly where k / v are")


def rope_notation(kind: str, k: int, v: int, sin: int, ids: int, time_major: bool) -> Notation:
    """``bshd, bshd, bshd, 1s1d, 1s1d, bs -> bshd, bshd, bshd`` (q, k, v, sin, cos, position_ids
    -> out_q, out_k, out_v; time_major ``sbhd``; 2-D sin / cos ``sd``), each co-shard read as
    its largest mesh dim, merged over q, k, v and position_ids (the reverse: over out_q, out_k,
    out_v); every axis claims its mesh dim, and :func:`_rope_post` then unshards d (and s where
    it cannot stay sharded), as Paddle does."""
    qkv = "sbhd" if time_major else "bshd"
    table = None if sin < 0 else "1s1d" if sin == 4 else "sd"
    ts = [qkv, None if k < 0 else qkv, None if v < 0 else qkv, table, table, None if ids < 0 else "bs"]
    outs = ts[:3]
    if kind == "reverse":
        return Notation(ts, outs, coshard="largest")
    return Notation(ts, outs, coshard="largest", sources=(0, 1, 2, 5))


def _rope_post(ins: Any, outs: Any, *args: Any) -> Answer:
    """head_dim d is never sharded (the rotation pairs its halves); seq_len s stays sharded only
    with sin and cos and without position_ids (the kernel then rotates each local block by its
    own rows of sin / cos; otherwise it computes positions from 0, or looks them up in the whole
    table); sin / cos take q's sequence sharding (or none), position_ids the batch's only."""
    q, sin, ids, tm = ins[0], ins[3], ins[5], args[-2]
    bi, si = (1, 0) if tm else (0, 1)
    dm = q.dims_mapping
    keep_s = sin is not None and ids is None
    s = dm[si] if keep_s else -1
    qd: DimsMapping = (s, dm[1], dm[2], -1) if tm else (dm[0], s, dm[2], -1)
    mesh = q.mesh
    qa = make_attr(mesh, qd) if qd != dm else q
    qkv = tuple(None if t is None else qa for t in ins[:3])
    sa = None if sin is None else make_attr(mesh, (-1, s, -1, -1) if len(sin.dims_mapping) == 4 else (s, -1))
    ia = None if ids is None else make_attr(mesh, (dm[bi], -1))
    return (*qkv, sa, sa, ia), qkv


def _rope_grad_order(fn: Callable[..., SpmdResult], signature: str, outputs: Any) -> Callable[..., SpmdResult]:
    """fused_rotary_position_embedding_grad is the forward rule on the grads: generated in the
    forward's order (the merge reads out_q_grad, out_k_grad, out_v_grad, then position_ids),
    called and answered in Paddle's (sin, cos, position_ids first)."""

    def grad(sin: Any, cos: Any, position_ids: Any, out_q_grad: Any, out_k_grad: Any = None, out_v_grad: Any = None,
             *attrs: Any) -> SpmdResult:  # fmt: skip
        r: Any = fn(out_q_grad, out_k_grad, out_v_grad, sin, cos, position_ids, *attrs)
        return fast_result((*r.inputs[3:], *r.inputs[:3]), r.outputs)

    return zero_d_absent(grad, _ROPE_GRAD, ("sin", "cos", "position_ids", "out_k_grad", "out_v_grad"))


_ENV_R = {"_rope": _rope, "_rev": _rope_reverse}
_ROPE_ATTRS = "use_neox_rotary_style: bool = True, time_major: bool = False, rotary_emb_base: float = 10000.0"
_ROPE_FWD = "q: T, k: T? = None, v: T? = None, sin: T? = None, cos: T? = None, position_ids: T? = None, " + _ROPE_ATTRS
_ROPE_OUTS = "out_q: T, out_k: T? = None, out_v: T? = None"
_ROPE_GRAD = ("sin: T?, cos: T?, position_ids: T?, out_q_grad: T, out_k_grad: T? = None, out_v_grad: T? = None, "
              + _ROPE_ATTRS)
_ROPE_CHECK = "_rope(_OP, {q!r}, {q}, [({kn!r}, {k}), ({v!r}, {v})], sin, cos, position_ids, time_major)"
_ROPE = Way(lambda *k: rope_notation("forward", *k), key="k, v, sin, position_ids, bool(time_major)", env=_ENV_R,
            check=_ROPE_CHECK.format(q="q", kn="k", k="k", v="v"), post=_rope_post,
            wrap=_wrap(("k", "v", "sin", "cos", "position_ids"), gqa=False), paddle="FusedRopeInferSpmd",
            doc="fused_rotary_position_embedding (FusedRopeInferSpmd): q, k, v and the outputs alike; head_dim "
                "replicated, seq_len sharded only with sin/cos and without position_ids.")
_ROPE_REV = Way(lambda *k: rope_notation("reverse", *k), key="k, v, sin, position_ids, bool(time_major)", env=_ENV_R,
                check="_rev(_OP, q, k, v, out_q, out_k, out_v, time_major); "
                      + _ROPE_CHECK.format(q="out_q", kn="out_k", k="out_k", v="out_v"),
                post=_rope_post, paddle="FusedRopeInferSpmdReverse",
                wrap=_wrap(("k", "v", "sin", "cos", "position_ids", "out_k", "out_v"), gqa=False),
                doc="fused_rotary_position_embedding (FusedRopeInferSpmdReverse): the inputs from out_q, out_k, "
                    "out_v; the outputs are what the inputs produce.")
register(
    "fused_rotary_position_embedding", generate("fused_rotary_position_embedding", _ROPE_FWD, _ROPE, name="fused_rope"),
    _ROPE_FWD,
    generate("fused_rotary_position_embedding", _reverse_signature(_ROPE_FWD, _ROPE_OUTS), _ROPE_REV, "backward",
             ("out_q", "out_k", "out_v"), name="fused_rope_reverse"),
    kind="reverse", outputs=_ROPE_OUTS, aliases=("fused_rope",), forward_name=_ROPE.paddle,
    backward_name=_ROPE_REV.paddle,
)  # fmt: skip
_ROPE_G = Way(lambda *k: rope_notation("forward", *k), key="out_k_grad, out_v_grad, sin, position_ids, bool(time_major)",
              env=_ENV_R, check=_ROPE_CHECK.format(q="out_q_grad", kn="out_k_grad", k="out_k_grad", v="out_v_grad"), post=_rope_post,
              wrap=_rope_grad_order, paddle="FusedRopeGradInferSpmd",
              doc="fused_rotary_position_embedding_grad (FusedRopeGradInferSpmd): the forward rule on the grads.")
register(
    "fused_rotary_position_embedding_grad",
    generate("fused_rotary_position_embedding_grad",
             "out_q_grad: T, out_k_grad: T? = None, out_v_grad: T? = None, sin: T? = None, cos: T? = None, "
             "position_ids: T? = None, " + _ROPE_ATTRS, _ROPE_G, name="fused_rotary_position_embedding_grad"),
    _ROPE_GRAD, aliases=("fused_rope_grad",), forward_name=_ROPE_G.paddle,
)  # fmt: skip
