"""Multi-token prediction (spmdkit.models.zoo_mtp; issue 28): a tiny model with one MTP module, its
parameters and model FLOPs by hand; the module on the last pipeline stage with the embedding's copy
there; the simulator (tensor and sequence parallel, expert parallel with ZeRO-1, a pipeline) and
``spmdkit run`` on a tiny DeepSeek-V3-like model with MTP; the config field refused by name."""

from __future__ import annotations

import json

import pytest

from spmdkit.core.errors import SpmdError
from spmdkit.cost.compute import model_flops
from spmdkit.cost.memory_saved import recompute_regions
from spmdkit.models.params import count_params, parameters
from spmdkit.models.zoo import build_model, preset, tiny_like
from spmdkit.planner.pipeline_split import PipelineSpec, op_stages
from spmdkit.planner.planning import plan_model
from spmdkit.planner.stage_costs import shared_parameters
from spmdkit.sim.plan import simulate_plan

TINY = '{"base":"tiny-llama","mtp_layers":1}'


def test_the_tiny_mtp_model_by_hand() -> None:
    """tiny-llama (hidden 16, 4 heads of 4, 2 kv heads, SwiGLU 32, vocab 64, batch 4 x seq 8): one
    layer is 2 norms + q 16x16, k and v 16x8, o 16x16 + gate, up, down 16x32 = 2336; the MTP
    module adds one such layer, eh_proj [32, 16] and 3 norms (enorm, hnorm, its final norm):
    2336 + 512 + 48 = 2896, its embedding and head the model's. Model FLOPs (6 N tokens + 3 x the
    causal attention square): N counts the head once per pass through it, 1024 twice, as
    Megatron-LM's num_floating_point_operations counts the logits (mtp_num_layers + 1) times."""
    base, mtp = build_model(preset("tiny-llama")), build_model(preset(TINY))
    p0, p1 = parameters(base.program), parameters(mtp.program)
    layer = 2 * 16 + 16 * 16 + 2 * 16 * 8 + 16 * 16 + 3 * 16 * 32
    assert layer == 2336
    assert sum(p1.values()) - sum(p0.values()) == layer + 2 * 16 * 16 + 3 * 16 == 2896
    assert p1["mtp.0.eh_proj"] == 32 * 16 and "mtp.0.embed" not in p1 and "mtp.0.lm_head" not in p1
    pc = count_params(preset(TINY))
    assert (pc.mtp, pc.mtp_active, pc.total) == (2896, 2896, sum(p1.values()))
    tokens, att_layer = 4 * 8, 2 * 2 * (4 * 4 * 8 * 8 * 4) * 3  # QK^T and PV, forward + backward
    n0 = 2 * layer + 16 + 16 * 64                                # layers, final norm, head (lookup: none)
    n1 = n0 + 2896 + 16 * 64                                     # the MTP module and the head's second pass
    plan0, plan1 = plan_model("tiny-llama", "dp=1", "dp")[1], plan_model(TINY, "dp=1", "dp")[1]
    assert model_flops(plan0, tokens) == (6.0 * n0 * tokens + 2 * att_layer, n0, 2 * att_layer)
    assert model_flops(plan1, tokens) == (6.0 * n1 * tokens + 3 * att_layer, n1, 3 * att_layer) \
        == (1_996_800.0, 9632, 147_456.0)
    # the loss: the model's token losses and the module's side by side, one sum
    loss_in = mtp.program.ops[[op.rule for op in mtp.program.ops].index("sum")].inputs["x"]
    assert mtp.program.tensors[loss_in].shape == (4, 8, 2)
    assert {"mtp.0.tokens", "mtp.0.labels"} <= set(mtp.token_inputs())


def test_the_module_is_on_the_last_stage_with_a_copy_of_the_embedding() -> None:
    """Split 1, 1 over two stages: every op of the MTP module (its lookup, norms, eh_proj, layer,
    head and loss, forward and backward) on stage 1, as Megatron-Core's mtp_on_this_rank puts it
    on the last stage; the embedding is read on both, so each holds a copy whose gradients are
    all-reduced (the tied-embedding path); full recomputation runs the module's layer again."""
    m = build_model(preset(TINY))
    prog = m.program
    stages = op_stages(prog, (1, 1))
    for i, op in enumerate(prog.ops):
        names = [*op.input_names(), *op.output_names()]
        if op.phase != "optimizer" and op.layer.startswith("mtp["):
            assert stages[i] == 1, op.name
        if op.phase == "forward" and any(n.startswith("mtp.") for n in op.output_names()):
            assert stages[i] == 1, op.name
        if op.phase == "optimizer" and any(n.startswith("mtp.0.") for n in names):
            assert stages[i] == 1, op.name
    assert shared_parameters(prog, stages) == {"embed": (0, 1)}
    regions = recompute_regions(prog, "full")
    assert len(regions) == 3 and {prog.ops[i].layer for i in regions[-1]} == {"mtp[0]"}
    assert prog.ops[regions[-1][0]].rule == "fused_rms_norm" and prog.ops[regions[-1][-1]].rule == "fused_rms_norm"


def test_a_pipeline_all_reduces_the_embeddings_copies() -> None:
    """pp=2 on a tiny MTP model: the first and the last stage all-reduce the embedding's gradient
    (the time is that of the tied embedding of a gpt2 with tied_embeddings); without MTP, none."""
    from spmdkit.planner.pipeline_plan import plan_pipeline

    def tied(model: str) -> list[float]:
        from spmdkit.cost.devices import DEVICES
        from spmdkit.planner.pipeline import estimate_pipeline

        _m, plan, spec, _c, _ = plan_pipeline(model, "pp=2,dp=2", "dp", {"microbatches": 2})
        dev = DEVICES["h100"]
        est = estimate_pipeline(plan, spec, None, dev, (dev.inter.alpha_s, 1 / dev.inter.bytes_per_s), 64, 4)
        return est.tied_s

    with_mtp, without, tied_emb = tied(TINY), tied("tiny-llama"), tied('{"base":"tiny-llama","tied_embeddings":true}')
    assert without == [0.0, 0.0] and with_mtp[0] == with_mtp[1] > 0
    assert with_mtp == pytest.approx(tied_emb, rel=1e-12)


@pytest.mark.parametrize(("model", "mesh", "strategy"), [
    ("deepseek-v3", "dp=2,tp=2", "megatron,sp"),
    ("deepseek-v3", "dp=2,ep=2", "dp,ep,zero1"),
    ("deepseek-v3", "dp=2,cp=2", "dp,cp"),
    ("deepseek-v3", "dp=2,tp=2,ep=2", "megatron,sp,ep,etp=1"),
    ("qwen3-next-80b-a3b", "dp=2,ep=2", "dp,ep"),
    (TINY, "tp=2", "megatron"),
])
def test_the_tiny_mtp_models_simulate_sharded(model: str, mesh: str, strategy: str) -> None:
    """The tiny variant (what ``--verify`` simulates) keeps the MTP module; planned and run on the
    simulated ranks: the loss, every gradient and update equal the unsharded step."""
    tiny = tiny_like(preset(model)) if model != TINY else TINY
    assert preset(tiny).mtp_layers == 1
    _, plan, _ = plan_model(tiny, mesh, strategy)
    rep = simulate_plan(plan)
    assert rep.ok and rep.checked > 350, rep.failures[:3]
    assert "mtp.0.eh_proj.new" in plan.program.tensors


def test_the_tiny_mtp_pipeline_verifies() -> None:
    """``--verify`` of a DeepSeek-V3 pipeline (pp=2 over dp=2 x ep=2): the tiny model with MTP in 2
    stages, forward in stage order, 2 microbatches equal to the unsharded step, losses summed."""
    from spmdkit.sim.verify_plan import verify_pipeline

    rep = verify_pipeline("deepseek-v3", "pp=2,dp=2,ep=2", PipelineSpec(2, 2, "1f1b", 1), "dp,ep,zero1")
    assert rep["ok"] and rep["stages_in_order"] and rep["losses_sum"] and rep["checked"] > 1000, rep["text"]


def test_spmdkit_run_executes_the_tiny_mtp_model() -> None:
    """``spmdkit run`` on 4 gloo ranks (dp 2 x ep 2) of the tiny DeepSeek-V3 variant with its MTP
    module: every tensor against its op run unsharded, the collectives the plan's."""
    pytest.importorskip("torch")
    from conftest import run_json

    rep = run_json("--model-config", tiny_like(preset("deepseek-v3")), "--mesh", "dp=2,ep=2", "--strategy", "dp,ep")
    assert rep["world_size"] == 4 and rep["ok"] and rep["collectives_match"] and not rep["failures"]
    assert any(c["tensor"] == "mtp.0.eh_proj.grad" for c in rep["collectives"])


@pytest.mark.parametrize(("value", "message"), [
    (-1, "--model-config mtp_layers: expected an integer from 0 to"),
    (True, "--model-config mtp_layers: expected an integer from 0 to"),
    ("1", "--model-config mtp_layers: expected an integer from 0 to"),
])
def test_a_bad_mtp_layers_is_refused_by_name(value: object, message: str) -> None:
    with pytest.raises(SpmdError, match=message):
        preset(json.dumps({"base": "tiny-llama", "mtp_layers": value}))
    with pytest.raises(SpmdError, match="model: mtp_layers must be an integer >= 0"):
        preset("tiny-llama").with_(mtp_layers=-1).check()


def test_hf_configs_map_their_mtp_depth() -> None:
    """DeepSeek-V3's num_nextn_predict_layers and Qwen3-Next's mtp_num_hidden_layers are
    mtp_layers; a dedicated MTP embedding (mtp_use_dedicated_embeddings) is named as not modelled."""
    from spmdkit.models.hf_config import hf_fields

    ds = {"model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "intermediate_size": 128, "vocab_size": 100, "n_routed_experts": 4, "num_experts_per_tok": 2,
          "moe_intermediate_size": 16, "first_k_dense_replace": 1, "kv_lora_rank": 8, "q_lora_rank": 0,
          "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "num_nextn_predict_layers": 2}
    assert hf_fields(ds)["mtp_layers"] == 2
    assert hf_fields({**ds, "num_nextn_predict_layers": 0})["mtp_layers"] == 0
    qn = {"model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 100, "num_experts": 4,
          "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
          "partial_rotary_factor": 1, "mtp_num_hidden_layers": 1}
    assert hf_fields(qn)["mtp_layers"] == 1
    with pytest.warns(UserWarning, match=r"mtp_use_dedicated_embeddings \(the MTP layer planned with the shared"):
        hf_fields({**qn, "mtp_use_dedicated_embeddings": True})


def test_the_moe_memory_line_counts_the_mtp_module_apart(capsys: pytest.CaptureFixture[str]) -> None:
    """The pipeline's MoE memory names the last rank's MTP module beside its layers: 3 layers of
    a tiny MoE with one MTP module on pp=2 split 2, 1; rank 1 holds one layer and the module, two
    MoE layers. It said '1 layers, 2 with 4 experts' (DeepSeek-V3 on pp=16: rank 15 the same)."""
    from spmdkit.cli import main

    cfg = json.dumps({"base": "tiny-llama", "experts": 4, "top_k": 2, "moe_ffn": 8, "mtp_layers": 1, "layers": 3})
    assert main(["plan", "--model-config", cfg, "--mesh", "pp=2,dp=2,ep=2", "--strategy", "dp,ep", "--batch", "8",
                 "--json"]) == 0
    mm = json.loads(capsys.readouterr().out)["pipeline"]["moe_memory"]
    assert (mm["rank"], mm["layers"], mm["mtp_modules"], mm["moe_layers"]) == (1, 1, 1, 2)
    assert main(["plan", "--model-config", cfg, "--mesh", "pp=2,dp=2,ep=2", "--strategy", "dp,ep", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "MoE memory of pipeline rank 1 (1 layer and 1 MTP module, 2 of them with 4 experts;" in out
