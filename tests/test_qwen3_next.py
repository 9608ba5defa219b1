"""Qwen3-Next-80B-A3B (the catalog's hybrid Gated DeltaNet model, spmdkit.models.zoo_linear):
the parameter count by hand from the shapes against the built program and the published 80B /
3B, the layer layout, tensor parallelism of the Gated DeltaNet heads, context parallelism
refused by name, and a tiny hybrid model simulated sharded against its unsharded step."""

from __future__ import annotations

import pytest

from spmdkit.core.errors import SpmdError
from spmdkit.models import catalog
from spmdkit.models.params import count_params, mismatches
from spmdkit.models.zoo import build_model, preset
from spmdkit.planner.planning import plan_preset
from spmdkit.strategies.strategy import tp_problem

NAME = "qwen3-next-80b-a3b"
H, V, L, E, K, FE = 2048, 151936, 48, 512, 10, 512


def _by_hand() -> dict[str, int]:
    """Each piece from the HF config's shapes: Gated DeltaNet (q, k: 16 x 128; v, z: 32 x 128;
    b, a: 32; the filters of width 4 over q, k, v; dt_bias, A_log; the gated norm over 128; the
    out projection), gated attention (q and its gate 16 x 256 each, k and v 2 x 256, o), the
    MoE (512 experts of 3 x 2048 x 512, the router, one shared expert of width 512 and its gate
    [2048, 1]), two norms a layer; embeddings 2 x 151936 x 2048 (untied) and the final norm."""
    kd, vd, nv = 16 * 128, 32 * 128, 32
    gdn = H * (2 * kd + 2 * vd + 2 * nv) + 4 * (2 * kd + vd) + 2 * nv + 128 + vd * H
    attn = H * (16 * 256) * 2 + 2 * H * (2 * 256) + 16 * 256 * H
    expert = 3 * H * FE
    moe = E * expert + H * E + 3 * H * FE + H
    layers = 36 * gdn + 12 * attn + L * (moe + 2 * H)
    # the MTP layer (mtp_num_hidden_layers 1, models/zoo_mtp.py): eh_proj [2H, H], enorm, hnorm and its final
    # norm, one gated attention + MoE layer; the embedding and the head shared
    mtp = 2 * H * H + 3 * H + attn + moe + 2 * H
    total = layers + 2 * V * H + H + mtp
    return {"gdn": gdn, "attn": attn, "mtp": mtp, "total": total, "active": total - (L + 1) * (E - K) * expert,
            "embedding": 2 * V * H}


def test_parameters_by_hand_and_against_the_published_figures() -> None:
    """80B total (HF model card, the main model): 79.67B counted, 0.41% under, and the MTP layer's
    1.65B beside (81.32B built); 3B activated: 3.87B with the embeddings, 3.25B without (the card's
    one-digit figure; 3.25B rounds to it), and the MTP layer's 0.07B beside."""
    want = _by_hand()
    pc = count_params(preset(NAME))
    assert pc.total == want["total"] == 81_324_856_064
    assert pc.mtp == want["mtp"] == 1_650_470_912
    assert pc.active == want["active"] == 3_946_238_720
    assert pc.total - pc.mtp == 79_674_385_152 and pc.active - pc.mtp_active == 3_874_923_264
    assert pc.embedding == want["embedding"]
    assert abs((pc.total - pc.mtp) / 80e9 - 1) < 0.02
    assert round((pc.active - pc.mtp_active - pc.embedding) / 1e9) == 3
    e = catalog.lookup(NAME)
    assert e is not None and mismatches(e, pc) == []


def test_the_hybrid_layout() -> None:
    """Layers 0-2 Gated DeltaNet, 3 gated attention (full_attention_interval 4), 36 and 12 of 48."""
    cfg = preset(NAME)
    assert [cfg.is_linear_layer(i) for i in range(8)] == [True, True, True, False] * 2
    assert sum(cfg.is_linear_layer(i) for i in range(cfg.layers)) == 36
    m = build_model(cfg.with_(layers=4, seq=128), validate=False, check_rules=False)
    ops = [(op.rule, op.outputs[0]) for op in m.program.ops]
    gdr = [o for r, o in ops if r == "gated_delta_rule"]
    assert gdr == ["layers.0.gdn.core", "layers.1.gdn.core", "layers.2.gdn.core"]
    # the 4th layer's and the MTP layer's (softmax attention, gated: models/zoo_mtp.py)
    assert [o for r, o in ops if r == "flash_attention"] == ["layers.3.attn", "mtp.0.attn"]
    assert "mtp.0.attn.gated" in m.program.tensors
    assert m.program.tensors["layers.0.gdn.core"].shape == (1, 128, 32, 128)
    assert "layers.3.attn.gated" in m.program.tensors and "layers.0.shared.gated" in m.program.tensors


def test_tp2_shards_the_gated_delta_net_heads() -> None:
    """Megatron tp=2 (with sp) over one period of layers: the gated delta rule's q, k, v, g, beta
    and its outputs hold 16 of the 32 value heads a rank, the filters half the channels; the
    layer's only communication is sequence parallel's gather before the projections and the
    reduce-scatter after the out projection (no gather of q / k / v)."""
    _, plan, _ = plan_preset(NAME, "dp=2,tp=2", "megatron,sp", {"layers": 4, "seq": 256, "batch": 2})
    tp = plan.mesh.dim_names.index("tp")
    op = next(o for o in plan.program.ops if o.rule == "gated_delta_rule")
    for name in [*op.inputs.values(), *op.outputs]:
        a = plan.attrs[name]
        assert a.dims_mapping[2] == tp and a.dims_mapping[1] == -1, (name, a.dims_mapping)
    assert plan.attrs["layers.0.gdn.conv_v"].dims_mapping == (-1, tp)
    assert plan.attrs["layers.0.gdn.wo"].dims_mapping == (tp, -1)
    ops = plan.program.ops
    moved = {(r.tensor, ops[r.op_index].rule) for r in plan.reshards
             if ops[r.op_index].layer == "layer 0" and ops[r.op_index].phase == "forward" and r.bytes_per_rank}
    assert {("layers.0.attn_norm.out", "fused_rms_norm"), ("layers.0.attn_out", "matmul")} <= moved
    assert not [t for t, _ in moved if t.startswith("layers.0.gdn.")], moved


def test_context_parallelism_is_refused_by_name() -> None:
    with pytest.raises(SpmdError, match=r"gated_delta_rule: --mesh cp=2 \(context parallelism\) is refused"):
        plan_preset(NAME, "dp=2,cp=2", "dp,cp", {"layers": 4, "seq": 256, "batch": 2})
    fewer = preset(NAME).with_(linear_key_heads=4, linear_value_heads=8)
    assert tp_problem(fewer, 8) == "tp=8 does not divide the model's 4 Gated DeltaNet key heads; a tp of 2 or 4 does"
    assert tp_problem(fewer, 4) is None


@pytest.mark.parametrize(("mesh", "strategy"), [("dp=2,tp=2", "megatron,sp"), ("dp=2,ep=2", "dp,ep,zero1")])
def test_the_tiny_hybrid_model_simulates_sharded(mesh: str, strategy: str) -> None:
    """The catalog model's tiny variant (what ``--verify`` simulates: a Gated DeltaNet layer with
    grouped key heads, a gated attention layer, experts with a gated shared expert), planned and
    run on the simulated ranks: loss, every gradient and update equal the unsharded step."""
    from spmdkit.models.zoo import tiny_like
    from spmdkit.planner.planning import plan_model
    from spmdkit.sim.plan import simulate_plan

    tiny = tiny_like(preset(NAME))
    cfg = preset(tiny)
    assert cfg.is_linear_layer(0) and not cfg.is_linear_layer(1) and cfg.attention_gate and cfg.shared_expert_gate
    assert cfg.linear_value_heads == 2 * cfg.linear_key_heads
    _, plan, _ = plan_model(tiny, mesh, strategy)
    rep = simulate_plan(plan)
    assert rep.ok and rep.checked > 400, rep.failures[:3]
    assert {"gated_delta_rule", "gated_delta_rule_grad", "causal_conv1d_grad"} <= {op.rule for op in plan.program.ops}


def test_spmdkit_run_executes_the_tiny_hybrid_model() -> None:
    """``spmdkit run`` on 4 gloo ranks (dp 2 x tp 2, megatron with sp) with the torch kernels:
    gated_delta_rule and causal_conv1d and their grads on each rank's heads, every tensor against
    its op run unsharded, the collectives the plan's."""
    pytest.importorskip("torch")
    from conftest import run_json
    from spmdkit.models.zoo import tiny_like

    rep = run_json("--model-config", tiny_like(preset(NAME)), "--mesh", "dp=2,tp=2", "--strategy", "megatron,sp")
    assert rep["world_size"] == 4 and rep["ok"] and rep["collectives_match"] and not rep["failures"]


#: Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (its keys that set the shapes, as published)
HF_CONFIG = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "decoder_sparse_step": 1,
             "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
             "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
             "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
             "max_position_embeddings": 262144, "mlp_only_layers": [], "moe_intermediate_size": 512,
             "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10,
             "num_hidden_layers": 48, "num_key_value_heads": 2, "partial_rotary_factor": 0.25,
             "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
             "vocab_size": 151936, "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False}


def test_the_hf_config_maps_to_the_catalog_entry() -> None:
    """``--model-config config.json`` of Qwen3-Next: the catalog's model at the config's context
    (max_position_embeddings), the partial rotary embedding named as not modelled; a layer_types
    the interval does not make is refused by name."""
    from spmdkit.core.errors import ProgramError
    from spmdkit.models.hf_config import hf_fields
    from spmdkit.models.zoo import ModelConfig

    with pytest.warns(UserWarning, match=r"not modelled: partial_rotary_factor 0.25 \(rope on the whole head\)"):
        f = hf_fields(HF_CONFIG)
    assert ModelConfig(**f) == preset(NAME).with_(name="Qwen3NextForCausalLM (HF config)", seq=262144)
    odd = {**HF_CONFIG, "layer_types": ["linear_attention", "full_attention"] * 24}
    with pytest.raises(ProgramError, match="HF key 'layer_types'"):
        hf_fields(odd)
