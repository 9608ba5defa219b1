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
from spmdkit.core.errors import ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import make_attr, one_mesh_dim
from spmdkit.engine.declare import Answer, Way, declare
from spmdkit.engine.facts import LocalOp, OpCost, facts
from spmdkit.engine.notation import BROADCAST, Conflict, Coshard, Notation
from spmdkit.engine.outshape import Args, Expect, UnknownShape
from spmdkit.engine.signature import parse_signature
from spmdkit.ops._absent import zero_d_absent
from spmdkit.ops._cost import by_bytes

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
    """flash_attention's letters (module docstring) in Paddle's order, each co-shard read as its
    largest mesh dim: forward merged over q, k (standing in for v) and attn_mask; reverse over
    ``q k v fixed_seed_offset attn_mask out softmax softmax_lse seed_offset``, merged over v
    (in out's place; the letters that differ replicated) and softmax_lse, the first claim kept
    (Paddle's merge sees no shapes); grad merged over q, k, v, out, softmax_lse and out_grad
    (the larger tensor wins)."""
    ma = _mask(mask, unit)
    if kind == "forward":
        return Notation([_Q, _K, _V, _ones(fso), ma], [_OUT, _SM, _LSE, None], replicated="sdte",
                        coshard=Coshard.LARGEST, sources=(0, 1, 4))  # fmt: skip
    if kind == "reverse":
        sm, lse, seed = ranks
        return Notation([_Q, _K, _V, _ones(fso), ma, _OUT, None if sm < 0 else _SM, None if lse < 0 else _LSE,
                         None if seed < 0 else "1"], [], replicated="sdte", coshard=Coshard.LARGEST, conflict=Conflict.FIRST,
                        sources=(2, 7))  # fmt: skip
    (seed,) = ranks
    return Notation([_Q, _K, _V, _OUT, _LSE, _ones(seed), ma, _OUT], [_Q, _K, _V], replicated="sdte",
                    coshard=Coshard.LARGEST, sources=(0, 1, 2, 3, 4, 7))  # fmt: skip


#: the head axis of each flash_attention tensor that has one
_HEADS = {"q": 2, "k": 2, "v": 2, "out": 2, "out_grad": 2, "softmax": 1, "softmax_lse": 1, "attn_mask": 1}


def _grouped_heads(fn: Callable[..., SpmdResult], signature: str) -> Callable[..., SpmdResult]:
    """Grouped heads (k's num_heads hk below q's): a mesh dim that does not divide hk cannot
    shard the heads, so each tensor's head entry (its co-shard read as the largest mesh dim)
    drops it before the merge, leaving the mesh dim free for the batch axis (Paddle checks
    only k's own mesh dim). What the merge then gives divides hk: every rank holds whole kv
    heads for its q heads."""
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


def _wrap(names: tuple[Any, ...], gqa: bool = True, outputs: tuple[str, ...] = ()) -> Callable[..., Any]:
    """What is registered: grouped heads (see _grouped_heads) inside, and a 0-D optional tensor
    (shape []) read as absent (spmdkit.ops._absent) outside (``outputs``: the tensors
    answered as outputs, where the generated function's are not)."""

    def wrap(fn: Callable[..., SpmdResult], signature: str, outs: Any) -> Callable[..., SpmdResult]:
        return zero_d_absent(_grouped_heads(fn, signature) if gqa else fn, signature, names, outputs or outs)

    return wrap


def _fa(q: DistTensorSpec, k: DistTensorSpec, attn_mask: DistTensorSpec | None) -> None:
    """k's num_heads divide q's; attn_mask's batch and num_heads are 1 or q's."""
    hq, hk = q.shape[2], k.shape[2]
    if hk == 0 or (hq >= 0 and hk > 0 and hq % hk != 0):
        raise ShapeMismatchError(f"q's num_heads {hq} is not a multiple of k's {hk}")
    for i, j, what in ((0, 0, "batch"), (1, 2, "num_heads")) if attn_mask is not None else ():
        m, w = attn_mask.shape[i], q.shape[j]  # type: ignore[union-attr]
        if m not in (1, w) and m >= 0 and w >= 0:
            raise ShapeMismatchError(f"attn_mask's {what} {m} is neither 1 nor q's {w}")


_FA_ATTRS = "dropout: float = 0.0, causal: bool = False, return_softmax: bool = False, is_test: bool = False"
_FA_KEY = "fixed_seed_offset, attn_mask, ones(attn_mask)"
_FA_SHAPES = "q: b s h d; k: b t hk d; v: b t hk e; attn_mask: _ _ s t"
_FA_CHECK: dict[str, Any] = {"require": ("0.0 <= dropout < 1.0",), "check": _fa}
declare(
    "flash_attention", "q: T, k: T, v: T, fixed_seed_offset: T? = None, attn_mask: T? = None, " + _FA_ATTRS,
    Way(lambda *k: fa_notation("forward", *k), key=_FA_KEY, shapes=_FA_SHAPES, **_FA_CHECK, post=_fa_seed,
        wrap=_wrap(("fixed_seed_offset", "attn_mask")), paddle="FlashAttInferSpmdStatic",
        doc="flash_attention (FlashAttInferSpmdStatic): batch and heads sharded, the rest replicated."),
    # compiled over all the tensors (it merges v and softmax_lse only). Of the outputs only softmax
    # may be absent (return_softmax false: the op makes it only when asked)
    reverse=Way(lambda *k: fa_notation("reverse", *k), key=_FA_KEY + ", softmax, softmax_lse, seed_offset",
                shapes=_FA_SHAPES + "; out: b s h e; softmax: _ _ _ _; softmax_lse: b h s", **_FA_CHECK, tail="out",
                wrap=_wrap(("fixed_seed_offset", "attn_mask", ("softmax", lambda args: not args[11])),
                           outputs=("out", "softmax", "softmax_lse", "seed_offset")),
                paddle="FlashAttInferSpmdReverse",
                doc="flash_attention (FlashAttInferSpmdReverse): q, k, v from out and softmax_lse; the outputs "
                    "returned are those the inferred inputs produce."),
    outputs="out: T, softmax: T?, softmax_lse: T?, seed_offset: T?",
)  # fmt: skip
declare(
    "flash_attention_grad", "q: T, k: T, v: T, out: T, softmax_lse: T, seed_offset: T?, attn_mask: T?, out_grad: T, "
    "dropout: float = 0.0, causal: bool = False",
    Way(lambda *k: fa_notation("grad", 0, *k), key="attn_mask, ones(attn_mask), seed_offset", **_FA_CHECK,
        shapes=_FA_SHAPES + "; out: b s h e; out_grad: b s h e; softmax_lse: b h s",
        wrap=_wrap(("seed_offset", "attn_mask")), paddle="FlashAttGradInferSpmd",
        doc="flash_attention_grad (FlashAttGradInferSpmd): q_grad, k_grad, v_grad sharded as q, k, v (batch and "
            "heads only)."),
)  # fmt: skip


# ---------------------------------------------------------------------------
# fused_rotary_position_embedding
# ---------------------------------------------------------------------------


def _rope(op: str, qn: str, q: DistTensorSpec, sin: DistTensorSpec | None, cos: DistTensorSpec | None,
          position_ids: DistTensorSpec | None, time_major: bool) -> None:  # fmt: skip
    """``qn`` (4-D) has an even head_dim; position_ids (2-D) is [batch, seq] of it; sin and cos
    come together, [seq, head_dim] or [1, seq, 1, head_dim], their seq that of ``qn`` (at least
    that with position_ids)."""
    b, s, d = (q.shape[1], q.shape[0], q.shape[3]) if time_major else (q.shape[0], q.shape[1], q.shape[3])
    if d >= 0 and d % 2 != 0:
        raise ShapeMismatchError(f"{op}: {qn}'s head_dim {d} must be even")
    for i, (a, w) in enumerate(zip(position_ids.shape if position_ids is not None else (), (b, s))):
        if a != w and a >= 0 and w >= 0:
            raise ShapeMismatchError(f"{op}: position_ids' {('batch', 'seq_len')[i]} {a} differs from {qn}'s {w}")
    if (sin is None) != (cos is None):
        raise ShapeMismatchError(f"{op}: sin and cos must be given together")
    if sin is None or cos is None:
        return
    ss = sin.shape
    if len(ss) not in (2, 4) or (len(ss) == 4 and (ss[0] != 1 or ss[2] != 1)):
        raise ShapeMismatchError(f"{op}: sin must be [seq, head_dim] or [1, seq, 1, head_dim], got {list(ss)}")
    if ss != cos.shape:  # exactly (an unknown size -1 is no match here)
        raise ShapeMismatchError(f"{op}: sin {list(ss)} and cos {list(cos.shape)} differ")
    sl, sd = ss[-3 if len(ss) == 4 else 0], ss[-1]
    if sd >= 0 and d >= 0 and sd != d:
        raise ShapeMismatchError(f"{op}: sin/cos head_dim {sd} differs from {qn}'s {d}")
    if sl >= 0 and s >= 0 and (sl < s if position_ids is not None else sl != s):
        want = "shorter than" if position_ids is not None else "differs from"
        raise ShapeMismatchError(f"{op}: sin/cos seq_len {sl} {want} {qn}'s {s}")


def _given_alike(k: Any, v: Any, out_k: Any, out_v: Any) -> None:
    if (k is None) != (out_k is None) or (v is None) != (out_v is None):
        raise ShapeMismatchError("out_k / out_v must be given exactly where k / v are")


def rope_notation(kind: str, k: int, v: int, sin: int, ids: int, time_major: bool) -> Notation:
    """The module docstring's letters (time_major ``sbhd``; 2-D sin / cos ``sd``), each co-shard
    read as its largest mesh dim; every axis claims its mesh dim, :func:`_rope_post` then
    unshards d (and s where it cannot stay sharded)."""
    qkv = "sbhd" if time_major else "bshd"
    table = None if sin < 0 else "1s1d" if sin == 4 else "sd"
    ts = [qkv, None if k < 0 else qkv, None if v < 0 else qkv, table, table, None if ids < 0 else "bs"]
    outs = ts[:3]
    if kind == "reverse":
        return Notation(ts, outs, coshard=Coshard.LARGEST)
    return Notation(ts, outs, coshard=Coshard.LARGEST, sources=(0, 1, 2, 5))


def _rope_post(ins: Any, outs: Any, *args: Any) -> Answer:
    """d replicated (the rotation pairs its halves), s as the module docstring says; sin / cos
    take q's sequence sharding (or none), position_ids the batch's only. With
    ``local_positions`` (spmdkit's, off by default: Paddle's answer) and position_ids given, s
    stays sharded: position_ids take q's (b, s), sin / cos whole (the ids index the table)."""
    q, sin, ids, tm, local = ins[0], ins[3], ins[5], args[-3], args[-1]
    bi, si = (1, 0) if tm else (0, 1)
    dm = q.dims_mapping
    by_ids = ids is not None and bool(local)
    keep_s = (sin is not None and ids is None) or by_ids
    s = dm[si] if keep_s else -1
    qd: DimsMapping = (s, dm[1], dm[2], -1) if tm else (dm[0], s, dm[2], -1)
    mesh = q.mesh
    qa = make_attr(mesh, qd) if qd != dm else q
    qkv = tuple(None if t is None else qa for t in ins[:3])
    ts = -1 if by_ids else s
    sa = None if sin is None else make_attr(mesh, (-1, ts, -1, -1) if len(sin.dims_mapping) == 4 else (ts, -1))
    ia = None if ids is None else make_attr(mesh, (dm[bi], s if by_ids else -1))
    return (*qkv, sa, sa, ia), qkv


#: ``local_positions`` is spmdkit's (rope-local-positions, docs/deviations.md): each rank rotates
#: its share of the sequence by the position_ids it holds (context parallelism's zig-zag order too)
_ROPE_ATTRS = ("use_neox_rotary_style: bool = True, time_major: bool = False, rotary_emb_base: float = 10000.0, "
               "local_positions: bool = False")
def _rope_q(op: str, q: DistTensorSpec, sin: DistTensorSpec | None, cos: DistTensorSpec | None,
            position_ids: DistTensorSpec | None, time_major: bool) -> None:  # fmt: skip
    _rope(op, "q", q, sin, cos, position_ids, time_major)


def _rope_out_q(op: str, out_q: DistTensorSpec, sin: DistTensorSpec | None, cos: DistTensorSpec | None,
                position_ids: DistTensorSpec | None, time_major: bool) -> None:  # fmt: skip
    _rope(op, "out_q", out_q, sin, cos, position_ids, time_major)


def _rope_out_q_grad(op: str, out_q_grad: DistTensorSpec, sin: DistTensorSpec | None, cos: DistTensorSpec | None,
                     position_ids: DistTensorSpec | None, time_major: bool) -> None:  # fmt: skip
    _rope(op, "out_q_grad", out_q_grad, sin, cos, position_ids, time_major)


def _rope_q_alone(op: str, q: DistTensorSpec, time_major: bool) -> None:
    """The reverse rule's q: 4-D with an even head_dim (sin, cos and position_ids are checked on out_q)."""
    _rope(op, "q", q, None, None, None, time_major)


#: the check of the tensor a mode merges first, by its name
_ROPE_CHECK = {"q": _rope_q, "out_q": _rope_out_q, "out_q_grad": _rope_out_q_grad}


def _rope_way(q: str, k: str, v: str, paddle: str, doc: str, check: tuple[Callable[..., None], ...] = (),
              shapes: str = "", same: tuple[tuple[str, str], ...] = (), **kw: Any) -> Way:  # fmt: skip
    """A mode of fused_rotary_position_embedding merged over ``q``, ``k``, ``v`` (of ``q``'s
    shape) and position_ids."""
    return Way(lambda *key: rope_notation("reverse" if q == "out_q" else "forward", *key),
               key=f"{k}, {v}, sin, position_ids, bool(time_major)", shapes=f"{shapes}{q}: _ _ _ _; position_ids: _ _",
               check=(*check, _ROPE_CHECK[q]), same=[*same, (q, k), (q, v)], post=_rope_post, paddle=paddle, doc=doc,
               **kw)  # fmt: skip


_ROPE_OPT = ("k", "v", "sin", "cos", "position_ids")
declare(
    "fused_rotary_position_embedding",
    "q: T, k: T? = None, v: T? = None, sin: T? = None, cos: T? = None, position_ids: T? = None, " + _ROPE_ATTRS,
    _rope_way("q", "k", "v", "FusedRopeInferSpmd", wrap=_wrap(_ROPE_OPT, gqa=False),
              doc="fused_rotary_position_embedding (FusedRopeInferSpmd): q, k, v and the outputs alike; head_dim "
                  "replicated, seq_len sharded only with sin/cos and without position_ids."),
    reverse=_rope_way("out_q", "out_k", "out_v", "FusedRopeInferSpmdReverse", shapes="q: _ _ _ _; ",
                      same=(("q", "k"), ("q", "v"), ("q", "out_q")),
                      check=(_given_alike, _rope_q_alone),
                      wrap=_wrap((*_ROPE_OPT, "out_k", "out_v"), gqa=False),
                      doc="fused_rotary_position_embedding (FusedRopeInferSpmdReverse): the inputs from out_q, "
                          "out_k, out_v; the outputs are what the inputs produce."),
    outputs="out_q: T, out_k: T? = None, out_v: T? = None", aliases=("fused_rope",),
)  # fmt: skip
# the forward rule on the grads (the grad kernel is the forward kernel with sin negated): the
# merge reads out_q_grad, out_k_grad, out_v_grad, then position_ids
declare(
    "fused_rotary_position_embedding_grad",
    "sin: T?, cos: T?, position_ids: T?, out_q_grad: T, out_k_grad: T? = None, out_v_grad: T? = None, " + _ROPE_ATTRS,
    _rope_way("out_q_grad", "out_k_grad", "out_v_grad", "FusedRopeGradInferSpmd",
              order="out_q_grad, out_k_grad, out_v_grad, sin, cos, position_ids",
              wrap=_wrap(("sin", "cos", "position_ids", "out_k_grad", "out_v_grad"), gqa=False),
              doc="fused_rotary_position_embedding_grad (FusedRopeGradInferSpmd): the forward rule on the grads."),
    aliases=("fused_rope_grad",),
)  # fmt: skip


# -- output shapes / grads ----------------------------------------------------------------------


def _flash_attention_shape(a: Args) -> list[Expect]:
    """q [B, Sq, H, D], v [B, Sk, Hk, Dv]: out [B, Sq, H, Dv]; softmax [B, H, Sq', Sk'] and
    softmax_lse [B, H, Sq'] (the kernel may round the sequence axes: not checked); seed_offset [2]."""
    q, v = a.s("q"), a.s("v")
    if len(q) != 4 or not v:
        raise UnknownShape
    softmax: Expect = (q[0], q[2], None, None) if a.nd(1) == 4 else None
    lse: Expect = (q[0], q[2], None) if a.nd(2) == 3 else None
    return [(*q[:-1], v[-1]), softmax, lse, (2,)]


def _rope_shape(a: Args) -> list[Expect]:
    return [a.opt("q"), a.opt("k"), a.opt("v")]


facts("flash_attention", shape=_flash_attention_shape, grad="flash_attention_grad", wrt=("q", "k", "v"),
      unchecked="softmax's and softmax_lse's sequence axes (the kernel may round them up); their batch and head "
                "axes, out and seed_offset are checked")
facts("fused_rotary_position_embedding", shape=_rope_shape, grad="fused_rotary_position_embedding_grad",
      wrt=("q", "k", "v"))
facts("fused_rotary_position_embedding_grad", grad_like=("out_q_grad", "out_k_grad", "out_v_grad"))


# -- cost


def _fwd_flops(c: LocalOp, causal: bool) -> float:
    """QK^T and PV of flash attention (q [b, sq, h, d], k [b, sk, hk, d], v [b, sk, hk, dv]):
    ``2·b·h·sq·sk·(d + dv)``, halved when causal (the kernel skips the masked blocks; the
    ``causal`` attribute, ``causal`` where the op has none)."""
    q, k, v = c.one("q"), c.one("k"), c.one("v")
    assert q is not None and k is not None and v is not None
    b, sq, h, d = q[0][-4], q[0][-3], q[0][-2], q[0][-1]
    sk, dv = k[0][-3], v[0][-1]
    f = 2.0 * b * h * sq * sk * (d + dv)
    return f / 2 if c.attr("causal", causal) else f


def _pass(c: LocalOp, backward: bool, causal: bool) -> tuple[bool, int, int, bool]:
    """What the kernel's achievable rate depends on: the pass, the key sequence, the head dim,
    causality (:func:`spmdkit.cost.rates.attention_efficiency`)."""
    q, k = c.one("q"), c.one("k")
    assert q is not None and k is not None
    return backward, k[0][-3], q[0][-1], bool(c.attr("causal", causal))


def attention_costs(causal: bool) -> tuple[Callable[[LocalOp], OpCost], Callable[[LocalOp], OpCost]]:
    """(forward, backward) cost functions of an attention kernel on its local shapes, ``causal``
    where the op has no ``causal`` attribute. The forward at its own rate (FlashAttention's
    forward reaches more of the peak than its backward); the backward recomputes QK^T: five
    matmuls to the forward's two (2.5x executed), the model counts 2x (FlashAttention's own
    accounting), timed at the backward's rate."""

    def forward(c: LocalOp) -> OpCost:
        f = _fwd_flops(c, causal)
        return OpCost(f, f, c.in_bytes + c.out_bytes, True, c.dtype(), attention=_pass(c, False, causal))

    def backward(c: LocalOp) -> OpCost:
        f = _fwd_flops(c, causal)
        return OpCost(2.5 * f, 2.0 * f, c.in_bytes + c.out_bytes, True, c.dtype(), attention=_pass(c, True, causal))

    return forward, backward


_attention_cost, _attention_grad_cost = attention_costs(causal=False)


facts("flash_attention", cost=_attention_cost)
facts("flash_attention_grad", cost=_attention_grad_cost)
#: rotary embedding: memory-bound, 3 nominal FLOPs per output element (forward and grad)
facts("fused_rotary_position_embedding", "fused_rotary_position_embedding_grad", cost=by_bytes(3))
