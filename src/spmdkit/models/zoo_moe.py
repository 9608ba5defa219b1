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
  (``shared.w_gate`` / ``shared.w_up`` / ``shared.w_down``) added to the output.

Megatron (tensor parallel, no expert parallelism: issue 28): the experts' gate / up stacks are
column-parallel (their moe_ffn axis sharded), the down stack row-parallel, as Megatron-Core runs
experts with expert-tensor-parallel = tp; the router is replicated; the shared experts are a
Megatron MLP.
"""

from __future__ import annotations

import math

from spmdkit.models.zoo_config import Model, ModelConfig
from spmdkit.models.zoo_layers import GATED, linear, mlp_act
from spmdkit.program.autodiff import Tape

#: the projections' outputs, after the prefix ``layers.<i>.experts.`` / ``layers.<i>.shared.``
_NAMES = {"gate.out": "gate", "up.out": "up"}


def capacity(cfg: ModelConfig) -> int:
    """Tokens an expert takes from one sequence: ``ceil(seq x top_k / experts x
    (capacity_factor or 1))``."""
    return max(1, math.ceil(cfg.seq * cfg.top_k / cfg.experts * (cfg.capacity_factor or 1.0) - 1e-9))


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
    return w


def moe_mlp(t: Tape, cfg: ModelConfig, m: Model, p: str, x: str, h: str) -> str:
    """The MoE MLP of layer prefix ``p`` on the normalised ``x`` [B, S, H], added to the
    residual stream ``h``; the stream after it (``p + "resid2"``)."""
    B, S, H, E, K, dt = cfg.batch, cfg.seq, cfg.hidden, cfg.experts, cfg.top_k, cfg.dtype
    C = capacity(cfg)
    w = moe_params(t, cfg, m, p)
    logits = linear(t, cfg, x, w["router"], None, p + "router.logits")
    (probs,) = t.op("softmax", {"x": logits}, [(p + "router.probs", [B, S, E], dt)], axis=-1)
    y, cw, si, _, _ = t.op("moe_gate_dispatch", {"x": x, "gate_logits": probs, "corr_bias": None},
                           [(p + "dispatch", [B, E, C, H], dt), (p + "dispatch.weights", [B, S, K], dt),
                            (p + "dispatch.index", [B, K, S], "int64"), (p + "dispatch.offset", [B, E], "int64"),
                            (p + "dispatch.expert", [B, S, K], "int64")], k=K, capacity=C, use_pad=True)
    assert y is not None and cw is not None and si is not None
    act = mlp_act(t, cfg, y, {"gate": w.get("gate"), "up": w["up"]}, _NAMES, p + "experts.")
    down = linear(t, cfg, act, w["down"], None, p + "experts.down")
    m.row_outputs.append(down)
    (rows,) = t.op("reshape", {"x": down}, [(p + "experts.rows", [B, E * C, H], dt)], shape=(B, E * C, H))
    # an index has no gradient: the transpose is not recorded on the tape
    (sit,) = t.b.op("transpose", {"x": si}, [(p + "dispatch.index.t", [B, S, K], "int64")], perm=(0, 2, 1))
    (out,) = t.op("moe_combine", {"x": rows, "combine_weights": cw, "scatter_index": sit},
                  [(p + "moe_out", [B, S, H], dt)])
    assert out is not None
    if cfg.shared_experts:
        sact = mlp_act(t, cfg, x, {"gate": w.get("s.gate"), "up": w["s.up"]}, _NAMES, p + "shared.")
        sdown = linear(t, cfg, sact, w["s.down"], None, p + "shared.down")
        m.row_outputs.append(sdown)
        (out,) = t.op("add", {"x": out, "y": sdown}, [(p + "moe_out.sum", [B, S, H], dt)])
    (r,) = t.op("add", {"x": h, "y": out}, [(p + "resid2", [B, S, H], dt)])
    assert r is not None
    return r


__all__ = ["capacity", "moe_mlp", "moe_params"]
