"""The zoo's mixture-of-experts MLP (Mixtral, Qwen-MoE, DeepSeek-V2/V3).

Per MoE layer, on the normalised residual stream ``x`` [B, S, H]:

- the router ``router`` [H, experts] (replicated under every strategy, as Megatron keeps it):
  ``softmax(x @ router)`` over the experts;
- ``moe_gate_dispatch`` per sequence (the op's batch axis: each sequence is routed on its own,
  so data parallelism shards the batch and no rank sees another's tokens): each token's
  ``top_k`` experts, the tokens copied into ``[B, experts, capacity, H]`` with ``capacity =
  ceil(S x top_k / experts x capacity_factor)`` (capacity_factor None: 1, dropless under the
  uniform routing a planner assumes; a token past an expert's capacity is dropped);
- the experts: batched GEMMs ``[B, E, C, H] x [E, H, moe_ffn]`` (gate and up, ``w_gate`` /
  ``w_up``), the activation (SwiGLU for a gated config), ``x [E, moe_ffn, H]`` (``w_down``),
  so an expert computes on the tokens it receives, not on all of them: the step's FLOPs are
  ``6 x active parameters x tokens`` (top_k experts a token);
- ``moe_combine``: each token's expert outputs weighted by its gate values and summed;
- ``shared_experts`` > 0: a dense MLP of width ``shared_experts x moe_ffn`` on every token
  (``shared.w_gate`` / ``shared.w_up`` / ``shared.w_down``) added to the output; with
  ``shared_expert_gate`` scaled first by ``sigmoid(x @ shared.expert_gate)`` (``[hidden, 1]``, role
  router: replicated).

The auxiliary load-balancing loss (``aux_loss``, on by default; Switch Transformer / Mixtral's
``E x sum_i f_i P_i``, computed per sequence as Megatron-Core's ``seq_aux_loss`` and DeepSeek-V3's
sequence-wise balance loss are): per MoE layer, on the dispatch's ``expert_offset`` [B, E] and
the router's ``probs`` [B, S, E],

- the tokens each expert receives from the sequence (``f_i`` x S x K; a count, no gradient,
  dropped tokens included, as Switch counts them), from the dispatch's ``expert_offset`` [B, E]
  (cumulative counts: the histogram the dispatch makes anyway, as Megatron-Core's
  ``tokens_per_expert`` is the routing map's sum): three ``slice``-s, a ``subtract`` and a
  ``concat`` (``aux.count`` [B, E], int64), ``cast`` to float32 (``aux.f``);
- ``mean`` of ``probs`` over S (``aux.p`` [B, E]: ``P_i``), ``cast`` to float32 (``aux.p32``);
- ``multiply`` and ``sum`` over E (kept: ``aux`` [B, 1]), each sequence's loss. After the
  head: the token losses ``reshape``-d to [B, S] (``loss.token2d``) and ``concat``-ed with every
  MoE layer's ``aux`` into ``loss.terms`` [B, S + MoE layers], whose ``sum`` is ``loss``.

Every op keeps the batch axis until the last sum, so data parallelism (over dp x ep) shards it
like the token losses and the aux loss adds no collective beyond the loss's own (the scalar is
partial, as the token-loss sum is). The constant factor ``alpha x E / (S x K)`` is left out, as
the mean of the token losses is (it shards alike and costs one pass over [B]). Under context
parallelism (``cp`` > 1) each token's share ``sum_i f_i p_si`` is kept instead ([B, S, 1], the
``mean`` left out: a factor S more) and concatenated beside the token losses on a new axis
(``loss.terms`` [B, S, 1 + MoE layers]): the sequence stays split, as Megatron-Core sums the
router probabilities over the rank's own tokens (tests/test_cp_moe.py). ``aux_loss``
false: none of these ops (the HF importer's programs, which compute no aux loss in the forward,
compare with that).

Routed in chunks (``moe_chunks`` T > 1: ``--strategy megatron,sp,ep,etp=1`` builds it with T = tp,
Megatron's ETP = 1 token path where each tp rank dispatches its own sequence-parallel shard; a model
built for cp with T = cp, or cp x tp on that path: each cp rank routes its own tokens):
``x`` reshaped to ``layers.<i>.chunks`` [B, T, S/T, H]; the router, the dispatch (capacity per
chunk of S/T tokens), the experts ([B, T, E, C, H]) and the combine on it, each chunk on its own
(the moe ops' chunk axis); the output reshaped back to [B, S, H] (``moe_out.seq``). The aux
loss sums the chunks' counts (``aux.fs``) and averages their mean gate values (``aux.pc`` [B, T,
E], then ``aux.p``), the sequence's loss as without chunks; under cp each token's share is
computed on the chunks (``aux.chunks`` [B, T, S/T, 1]) and put back on the sequence (``aux``).

Megatron (tensor parallel, no expert parallelism: issue 28): the experts' gate / up stacks are
column-parallel (their moe_ffn axis sharded), the down stack row-parallel, as Megatron-Core runs
experts with expert-tensor-parallel = tp; the router is replicated; the shared experts are a
Megatron MLP.
"""

from __future__ import annotations

import math
from typing import Any

from spmdkit.models.zoo_config import Model, ModelConfig
from spmdkit.models.zoo_layers import GATED, linear, mlp_act
from spmdkit.program.autodiff import Tape

#: the projections' outputs, after the prefix ``layers.<i>.experts.`` / ``layers.<i>.shared.``
_NAMES = {"gate.out": "gate", "up.out": "up"}


def capacity(cfg: ModelConfig) -> int:
    """Tokens an expert takes from one routed chunk (a sequence, or with ``moe_chunks`` one of
    its chunks): ``ceil(tokens x top_k / experts x (capacity_factor or 1))``."""
    tokens = cfg.seq // max(1, cfg.moe_chunks)
    return max(1, math.ceil(tokens * cfg.top_k / cfg.experts * (cfg.capacity_factor or 1.0) - 1e-9))


def moe_params(t: Tape, cfg: ModelConfig, m: Model, p: str) -> dict[str, str]:
    """A MoE layer's parameters (short name -> program name) with their roles."""
    H, E, Fe, dt = cfg.hidden, cfg.experts, cfg.expert_ffn, cfg.dtype
    w: dict[str, str] = {}

    def par(key: str, name: str, shape: list[int], role: str) -> None:
        w[key] = t.param(p + name, shape, dt)
        m.roles[w[key]] = role

    par("router", "router", [H, E], "router")
    if cfg.act in GATED:
        par("gate", "experts.w_gate", [E, H, Fe], "column")
    par("up", "experts.w_up", [E, H, Fe], "column")
    par("down", "experts.w_down", [E, Fe, H], "row")
    if cfg.shared_experts:
        Fs = cfg.shared_experts * Fe
        if cfg.act in GATED:
            par("s.gate", "shared.w_gate", [H, Fs], "column")
        par("s.up", "shared.w_up", [H, Fs], "column")
        par("s.down", "shared.w_down", [Fs, H], "row")
        if cfg.shared_expert_gate:
            par("s.gate_w", "shared.expert_gate", [H, 1], "router")
    return w


def aux_loss(t: Tape, cfg: ModelConfig, m: Model, p: str, probs: str, off: str | None) -> str:
    """Layer ``p``'s per-sequence load-balancing loss [B] (module docstring), added to
    ``m.aux``; its name."""
    B, E, T = cfg.batch, cfg.experts, cfg.moe_chunks
    assert off is not None
    # the counts have no gradient: their ops are not recorded on the tape. The dispatch's
    # expert_offset [B, E] (chunked: [B, T, E]) counts each sequence's (chunk's) choices of
    # experts <= e: its differences
    lead = [B] if T == 1 else [B, T]
    cnt = off
    if E > 1:
        def cut(name: str, lo: int, hi: int) -> str:
            (o,) = t.b.op("slice", {"input": off}, [(p + name, [*lead, hi - lo], "int64")], axes=(len(lead),),
                          starts=(lo,), ends=(hi,))
            assert o is not None
            return o

        hi, lo, first = cut("aux.hi", 1, E), cut("aux.lo", 0, E - 1), cut("aux.first", 0, 1)
        (d,) = t.b.op("subtract", {"x": hi, "y": lo}, [(p + "aux.diff", [*lead, E - 1], "int64")])
        (c,) = t.b.op("concat", {"x": (first, d)}, [(p + "aux.count", [*lead, E], "int64")], axis=len(lead))
        assert c is not None
        cnt = c
    (f,) = t.b.op("cast", {"x": cnt}, [(p + "aux.f", [*lead, E], "float32")], dtype="float32")
    if T > 1:  # the sequence's counts: its chunks' summed (Megatron's tokens_per_expert, summed over tp)
        (f,) = t.b.op("sum", {"x": f}, [(p + "aux.fs", [B, E], "float32")], axis=(1,), keep_dim=False)
    if cfg.cp > 1:
        assert f is not None
        return _aux_per_token(t, cfg, m, p, probs, f)
    src: str | None = probs
    if T > 1:  # each chunk's mean first ([B, T, E]: the chunk axis stays split), then the chunks'
        (src,) = t.op("mean", {"x": probs}, [(p + "aux.pc", [B, T, E], cfg.dtype)], axis=(2,), keep_dim=False)
    (pm,) = t.op("mean", {"x": src}, [(p + "aux.p", [B, E], cfg.dtype)], axis=(1,), keep_dim=False)
    if cfg.dtype != "float32":
        (pm,) = t.op("cast", {"x": pm}, [(p + "aux.p32", [B, E], "float32")], dtype="float32")
    (fp,) = t.op("multiply", {"x": f, "y": pm}, [(p + "aux.fp", [B, E], "float32")])
    (a,) = t.op("sum", {"x": fp}, [(p + "aux", [B, 1], "float32")], axis=(1,), keep_dim=True)
    assert a is not None
    m.aux.append(a)
    return a


def _aux_per_token(t: Tape, cfg: ModelConfig, m: Model, p: str, probs: str, f: str) -> str:
    """Under context parallelism: layer ``p``'s load-balancing loss as each token's share
    ``sum_i f_i p_si`` [B, S, 1] (``aux`` summed over S is ``S x`` the per-sequence loss: a
    constant factor, as the module docstring's). The counts ``f`` are the sequence's (the
    dispatch holds the whole sequence's routing); the probabilities stay on the tokens the rank
    holds, so the loss needs no reduction of ``P`` over cp and no gather of the token losses, as
    Megatron-Core computes it (``switch_load_balancing_loss_func``: ``tokens_per_expert``
    all-reduced over the tp x cp group, ``probs`` summed over the rank's tokens only). Routed in
    cp chunks (each cp rank its own tokens) the counts are the chunks' summed (``aux.fs``): the
    one reduction, of ``[B, E]`` over cp, Megatron's all-reduce of ``tokens_per_expert``."""
    B, S, E = cfg.batch, cfg.seq, cfg.experts
    lead = [B] if cfg.moe_chunks == 1 else [B, cfg.moe_chunks]  # routed in chunks: the shares on the chunks
    s = S // cfg.moe_chunks
    ones = [1] * len(lead)
    (f3,) = t.b.op("reshape", {"x": f}, [(p + "aux.f3", [B, *ones, E], "float32")], shape=(B, *ones, E))
    p32: str | None = probs
    if cfg.dtype != "float32":
        (p32,) = t.op("cast", {"x": probs}, [(p + "aux.p32", [*lead, s, E], "float32")], dtype="float32")
    (fp,) = t.op("multiply", {"x": f3, "y": p32}, [(p + "aux.fp", [*lead, s, E], "float32")])
    name = p + ("aux" if len(lead) == 1 else "aux.chunks")
    (a,) = t.op("sum", {"x": fp}, [(name, [*lead, s, 1], "float32")], axis=(len(lead) + 1,), keep_dim=True)
    if len(lead) > 1:  # back on the sequence, beside the token losses (each rank's own tokens: no move)
        (a,) = t.op("reshape", {"x": a}, [(p + "aux", [B, S, 1], "float32")], shape=(B, S, 1))
    assert a is not None
    m.aux.append(a)
    return a


def aux_terms(t: Tape, m: Model, loss_tok: str) -> str:
    """The token losses [B, S, 1] (or [B, S, 1 + mtp_layers] with the MTP modules') and the MoE layers' load-balancing losses ``m.aux`` ([B, 1]
    each) as one tensor [B, S + MoE layers] whose sum is the step's loss: each batch row keeps
    its sequence's terms, so the sum is partial over the data-parallel dims as the token losses'
    alone is (an ``add`` of two partial scalars would reduce each first), and every MoE layer
    has the same ops (the report groups layers by them)."""
    B, S, n = m.config.batch, m.config.seq, len(m.aux)
    j = t.b.get(loss_tok).shape[-1]  # 1, or 1 + mtp_layers: the MTP modules' token losses beside (zoo_mtp)
    if m.config.cp > 1:  # each a token's share [B, S, 1]: side by side on a new axis, the sequence left split
        (terms,) = t.op("concat", {"x": (loss_tok, *m.aux)}, [("loss.terms", [B, S, j + n], "float32")], axis=2)
        assert terms is not None
        return terms
    (lt,) = t.op("reshape", {"x": loss_tok}, [("loss.token2d", [B, S * j], "float32")], shape=(B, S * j))
    (terms,) = t.op("concat", {"x": (lt, *m.aux)}, [("loss.terms", [B, S * j + n], "float32")], axis=1)
    assert terms is not None
    return terms


def groups(cfg: ModelConfig) -> dict[str, Any]:
    """The dispatch's group-limited routing attrs (none for plain top-k: the op's defaults)."""
    if cfg.expert_groups <= 1 or cfg.topk_groups >= cfg.expert_groups:
        return {}
    return {"groups": cfg.expert_groups, "topk_groups": cfg.topk_groups}


def moe_mlp(t: Tape, cfg: ModelConfig, m: Model, p: str, x: str, h: str) -> str:
    """The MoE MLP of layer prefix ``p`` on the normalised ``x`` [B, S, H], added to the
    residual stream ``h``; the stream after it (``p + "resid2"``)."""
    B, S, H, E, K, dt = cfg.batch, cfg.seq, cfg.hidden, cfg.experts, cfg.top_k, cfg.dtype
    C = capacity(cfg)
    T = cfg.moe_chunks
    w = moe_params(t, cfg, m, p)
    xin: str | None = x
    lead, s = [B], S
    if T > 1:  # routed in chunks: [B, T, S/T, H], each chunk dispatched on its own (Megatron's ETP = 1 path)
        lead, s = [B, T], S // T
        (xin,) = t.op("reshape", {"x": x}, [(p + "chunks", [B, T, s, H], dt)], shape=(B, T, s, H))
    assert xin is not None
    logits = linear(t, cfg, xin, w["router"], None, p + "router.logits")
    (probs,) = t.op("softmax", {"x": logits}, [(p + "router.probs", [*lead, s, E], dt)], axis=-1)
    y, cw, si, off, _ = t.op("moe_gate_dispatch", {"x": xin, "gate_logits": probs, "corr_bias": None},
                           [(p + "dispatch", [*lead, E, C, H], dt), (p + "dispatch.weights", [*lead, s, K], dt),
                            (p + "dispatch.index", [*lead, K, s], "int64"),
                            (p + "dispatch.offset", [*lead, E], "int64"),
                            (p + "dispatch.expert", [*lead, s, K], "int64")], k=K, capacity=C, use_pad=True,
                           **groups(cfg))
    assert y is not None and cw is not None and si is not None and probs is not None
    if cfg.aux_loss:
        aux_loss(t, cfg, m, p, probs, off)
    act = mlp_act(t, cfg, y, {"gate": w.get("gate"), "up": w["up"]}, _NAMES, p + "experts.")
    down = linear(t, cfg, act, w["down"], None, p + "experts.down")
    m.row_outputs.append(down)
    (rows,) = t.op("reshape", {"x": down}, [(p + "experts.rows", [*lead, E * C, H], dt)], shape=(*lead, E * C, H))
    # an index has no gradient: the transpose is not recorded on the tape
    perm = (0, 2, 1) if T == 1 else (0, 1, 3, 2)
    (sit,) = t.b.op("transpose", {"x": si}, [(p + "dispatch.index.t", [*lead, s, K], "int64")], perm=perm)
    (out,) = t.op("moe_combine", {"x": rows, "combine_weights": cw, "scatter_index": sit},
                  [(p + "moe_out", [*lead, s, H], dt)])
    if T > 1:
        (out,) = t.op("reshape", {"x": out}, [(p + "moe_out.seq", [B, S, H], dt)], shape=(B, S, H))
    assert out is not None
    if cfg.shared_experts:
        sact = mlp_act(t, cfg, x, {"gate": w.get("s.gate"), "up": w["s.up"]}, _NAMES, p + "shared.")
        sdown = linear(t, cfg, sact, w["s.down"], None, p + "shared.down")
        m.row_outputs.append(sdown)
        if cfg.shared_expert_gate:  # scaled by sigmoid(x @ w [H, 1]) (Qwen2-MoE, Qwen3-Next)
            gl = linear(t, cfg, x, w["s.gate_w"], None, p + "shared.expert_gate.logit")
            (gs,) = t.op("sigmoid", {"x": gl}, [(p + "shared.expert_gate.sigmoid", [B, S, 1], dt)])
            (gated,) = t.op("multiply", {"x": sdown, "y": gs}, [(p + "shared.gated", [B, S, H], dt)])
            assert gated is not None
            sdown = gated
        (out,) = t.op("add", {"x": out, "y": sdown}, [(p + "moe_out.sum", [B, S, H], dt)])
    (r,) = t.op("add", {"x": h, "y": out}, [(p + "resid2", [B, S, H], dt)])
    assert r is not None
    return r


__all__ = ["aux_loss", "aux_terms", "capacity", "moe_mlp", "moe_params"]
