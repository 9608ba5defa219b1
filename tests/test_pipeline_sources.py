"""Pipelines for every model source (planner/pipeline.py): an imported HF model and a program
file cut by their layers as a preset is, the automatic split of layers that do not divide
into the stages, and the one-line errors."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from spmdkit.cli import main
from spmdkit.core.errors import ProgramError
from spmdkit.cost.devices import preset_device
from spmdkit.models.source import HFModel, Preset
from spmdkit.models.zoo import build_model, preset
from spmdkit.planner.pipeline import balanced_split, estimate_pipeline, even_split
from spmdkit.planner.pipeline_plan import plan_pipeline_source
from spmdkit.planner.pipeline_split import PipelineSpec, op_stages, split_layers
from spmdkit.program.layers import layer_tags

#: tiny-llama (hidden 16, 4 heads, 2 kv heads, FFN 32, vocab 64) as an HF config, 4 layers
TINY_LLAMA_HF = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "num_hidden_layers": 4, "vocab_size": 64, "max_position_embeddings": 64}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# -- the split -------------------------------------------------------------------------------------


def test_balanced_split_by_hand() -> None:
    # Llama 3.1 405B's 126 layers on 16 stages: a layer is 1, the embedding nearly nothing, the
    # head and loss 0.6 of a layer: the bound is 8 layers; the last stage takes 7 (7.6), the middle
    # ones 8, the first what is left: 7, 8 x 14, 7 (one layer fewer on the first and the last)
    assert balanced_split([1.0] * 126, 16, 0.01, 0.6) == (7,) + (8,) * 14 + (7,)
    assert balanced_split([1.0] * 5, 2, 0.0, 0.6) == (3, 2)       # 3 | 2.6 (2 | 3.6 is worse)
    assert balanced_split([1.0] * 5, 2, 0.0, 2.5) == (4, 1)       # 4 | 3.5 (3 | 4.5 is worse)
    assert balanced_split([3.0, 1, 1, 1, 1, 1], 2) == (2, 4)      # 4 | 4
    assert balanced_split([1.0] * 4, 4, 5.0, 5.0) == (1, 1, 1, 1)  # at least one layer each
    assert sum(balanced_split([1.0] * 126, 16)) == 126
    with pytest.raises(ProgramError, match="3 layers cannot fill 4 stages"):
        balanced_split([1.0] * 3, 4)


def test_split_layers_balances_only_what_does_not_divide() -> None:
    spec = PipelineSpec(4, 1, "1f1b", 1)
    assert split_layers(8, spec, balance=lambda n: (9,) * n) == (2, 2, 2, 2)  # even: no balancing
    assert split_layers(10, spec, balance=lambda n: (1, 3, 3, 3)) == (1, 3, 3, 3)
    assert split_layers(10, PipelineSpec(4, 1, "1f1b", 1, (4, 2, 2, 2)), balance=lambda n: (1,) * n) == (4, 2, 2, 2)
    with pytest.raises(ProgramError, match="10 layers do not divide evenly into 4 stages"):
        split_layers(10, spec)


def test_llama_405b_split_on_16_stages_beats_the_naive_one() -> None:
    """126 layers on pp=16 (Llama 3.1 405B): the automatic split is Megatron users' 7, 8 x 14, 7
    and its slowest stage and fullest device are below those of the naive split (8 x 14, 7, 7)."""
    cfg = json.dumps({"base": "llama-70b", "layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8,
                      "ffn": 53248, "vocab": 128256, "seq": 8192, "batch": 8})  # a sequence a dp rank
    got = plan_pipeline_source(Preset(cfg), "pp=16,dp=8,tp=8", "megatron", {})
    assert got.layers == 126 and got.counts is None  # left to the estimate to balance
    dev = preset_device("h100")
    auto = estimate_pipeline(got.plan, got.spec, None, dev, (20e-6, 1 / 50e9), got.tokens, 1024)
    naive = estimate_pipeline(got.plan, got.spec, tuple(even_split(126, 16)), dev, (20e-6, 1 / 50e9), got.tokens, 1024)
    assert auto.counts == (7,) + (8,) * 14 + (7,) and sum(auto.counts) == 126
    assert naive.counts == (8,) * 14 + (7, 7)
    assert auto.note is not None and "split 7,8,8,8,8,8,8,8,8,8,8,8,8,8,8,7" in auto.note
    assert "balanced by predicted time" in auto.note and naive.note is None

    def slowest(e: Any) -> float:
        return max(s.forward_s + s.backward_s for s in e.stages)

    assert slowest(auto) < slowest(naive)  # the naive first stage: 8 layers and the embedding
    assert max(m.device_total for m in auto.memory) < max(m.device_total for m in naive.memory)


# -- an imported HF model and a program file -----------------------------------------------------


@pytest.fixture(scope="module")
def hf_and_preset() -> Any:
    pytest.importorskip("torch", reason="torch is not installed")
    pytest.importorskip("transformers", reason="transformers is not installed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = plan_pipeline_source(HFModel("LlamaForCausalLM", json.dumps(TINY_LLAMA_HF), "float32", 8, 8),
                                  "pp=2,dp=2,tp=2", "megatron", {"microbatches": 2})
    pre = plan_pipeline_source(Preset("tiny-llama", 4, 8, 8), "pp=2,dp=2,tp=2", "megatron", {"microbatches": 2})
    return hf, pre


def test_hf_llama_cuts_as_the_same_preset(hf_and_preset: Any) -> None:
    """A tiny LlamaForCausalLM with 4 layers at pp=2: the same stage split, sends and per-stage
    state as tiny-llama with 4 layers (the same architecture), its activations shaped alike."""
    hf, pre = hf_and_preset
    assert layer_tags(hf.plan.program) == [f"model.layers.{i}" for i in range(4)]
    assert (hf.layers, hf.counts, hf.tokens, hf.microbatch) == (pre.layers, pre.counts, pre.tokens, pre.microbatch)
    assert hf.counts == (2, 2) and hf.tokens == 8 * 8 and hf.microbatch == 4
    dev = preset_device("h100")
    e_hf, e_pre = (estimate_pipeline(x.plan, x.spec, x.counts, dev, (10e-6, 1 / 10e9), x.tokens, 8) for x in (hf, pre))
    # the residual stream [4/dp, seq 8, hidden 16] fp32 crosses the cut, its gradient comes back;
    # the attention mask and the rotary tables are made on each stage, not sent
    assert [s.send_bytes for s in e_hf.stages] == [s.send_bytes for s in e_pre.stages] == [2 * 8 * 16 * 4, 0]
    assert [s.send_grad_bytes for s in e_hf.stages] == [0, 2 * 8 * 16 * 4]
    for key in ("parameters", "gradients", "optimizer_states"):
        assert [getattr(m, key) for m in e_hf.memory] == [getattr(m, key) for m in e_pre.memory], key
    assert e_hf.in_flight == e_pre.in_flight == [2, 1]
    for e in (e_hf, e_pre):  # the first stage keeps 2 microbatches: the most activations
        assert e.memory[0].activation_peak > e.memory[1].activation_peak
        assert e.memory[0].activation_peak == e.stages[0].working_peak + e.stages[0].stash_bytes
    # every op of a layer on its stage: embedding first, the head and the loss last
    stages = op_stages(hf.plan.program, hf.counts)
    prog = hf.plan.program
    assert {s for op, s in zip(prog.ops, stages) if op.layer in ("model.layers.0", "model.layers.1")} == {0}
    assert {s for op, s in zip(prog.ops, stages) if op.layer in ("model.layers.2", "model.layers.3", "lm_head")} == {1}
    emb = next(i for i, op in enumerate(prog.ops) if op.phase == "forward" and op.rule == "embedding")
    assert stages[emb] == 0


#: a tiny GPT2LMHeadModel: its LM head is the token embedding wte (tied)
TINY_GPT2_HF = {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 128, "n_positions": 64}


def test_tied_embedding_held_on_both_stages_and_its_gradient_all_reduced() -> None:
    """GPT-2's tied wte at pp=2 x tp=2 (megatron): the first stage looks it up, the last stage's
    head reads it. As Megatron-LM's embedding group: each stage holds a copy (its vocab shard,
    [128/2, 32] fp32 = 8192 bytes), with its gradient and AdamW's states, and the copies'
    gradients are all-reduced between the two stages once per step. By hand, per tp rank, fp32:
    a block holds ln_1 64, c_attn 32*96/2 + 96/2, c_proj 32*32/2 + 32, ln_2 64, c_fc 32*128/2 +
    128/2, mlp c_proj 128*32/2 + 32 = 6448 floats; stage 0 a block, wte's shard 2048 and wpe
    64*32 = 2048 (replicated); stage 1 a block, ln_f 64 and its copy of wte's shard 2048 (the
    plan held it on stage 0 only before: 26048 bytes)."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    from spmdkit.planner.pipeline import _step_times
    from spmdkit.planner.stage_costs import shared_parameters

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = plan_pipeline_source(HFModel("GPT2LMHeadModel", json.dumps(TINY_GPT2_HF), "float32", 4, 8),
                                   "pp=2,tp=2", "megatron", {"microbatches": 2})
    assert got.counts == (1, 1)
    assert shared_parameters(got.plan.program, op_stages(got.plan.program, got.counts)) == \
        {"transformer.wte.weight": (0, 1)}
    link = (10e-6, 1 / 10e9)  # a pp link the device does not have: alpha + bytes * beta
    est = estimate_pipeline(got.plan, got.spec, got.counts, preset_device("h100"), link, got.tokens, 4)
    assert [s.parameters for s in est.stages] == [4 * (6448 + 2048 + 2048), 4 * (6448 + 64 + 2048)]
    assert [s.gradients for s in est.stages] == [s.parameters for s in est.stages]
    # AdamW: two fp32 moments per element and two fp32 scalars (beta1_pow, beta2_pow) per parameter;
    # stage 1 holds 2048 - 64 elements fewer in one parameter more (ln_f's two, not wpe)
    assert est.stages[1].optimizer_states - est.stages[0].optimizer_states == 4 * 2 * (64 - 2048) + 4 * 2 * (3 - 2)
    assert [s.tied_bytes for s in est.stages] == [8192, 8192]
    # the ring all-reduce of 2 ranks: 2 latencies and the bytes once
    assert est.tied_s == pytest.approx([2 * 10e-6 + 8192 / 10e9] * 2, rel=1e-12)
    assert est.to_json()["devices"][1]["tied_grad_sync_s"] == est.tied_s[1]
    assert est.run is not None
    before = _step_times(got.plan, got.spec, est.stages, est.run)
    assert est.step_overlap_s - before[1] == pytest.approx(est.tied_s[0], rel=1e-9)
    assert est.step_serial_s - before[0] == pytest.approx(est.tied_s[0], rel=1e-9)


def test_untied_model_has_no_shared_parameters(hf_and_preset: Any) -> None:
    from spmdkit.planner.stage_costs import shared_parameters

    hf, _pre = hf_and_preset
    assert shared_parameters(hf.plan.program, op_stages(hf.plan.program, hf.counts)) == {}
    est = estimate_pipeline(hf.plan, hf.spec, hf.counts, None, (10e-6, 1 / 10e9))
    assert est.tied_s == [0.0, 0.0] and [s.tied_bytes for s in est.stages] == [0, 0]


def test_cli_hf_pipeline(capsys: pytest.CaptureFixture[str], hf_and_preset: Any) -> None:
    rc, out, err = _run(["plan", "--hf", "LlamaForCausalLM", "--hf-config", json.dumps(TINY_LLAMA_HF), "--seq", "8",
                         "--mesh", "pp=3,dp=2", "--strategy", "dp", "--device", "h100"], capsys)
    assert rc == 0, err
    first, title = out.splitlines()[:2]
    # 4 layers on 3 stages: the middle stage takes two
    assert first.startswith("note: 4 layers do not divide evenly into 3 stages: split 1,2,1 (balanced by predicted")
    assert title.startswith("LlamaForCausalLM (HuggingFace), 4 layers, batch 2 as 1 microbatches of 2, seq 8, float32; "
                            "strategy dp; pipeline pp=3")
    assert "layers per stage 1,2,1" in out


def _program_file(tmp_path: Path, layers: int = 4) -> Path:
    prog = build_model(preset("tiny-llama").with_(layers=layers), check_rules=False).program
    f = tmp_path / "p.json"
    f.write_text(json.dumps(prog.to_json()))
    return f


def test_cli_program_file_pipeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = _program_file(tmp_path)
    rc, out, err = _run(["plan", "--program", str(f), "--mesh", "pp=2,dp=2", "--annotate", "tokens=[1,-1]",
                         "--microbatches", "2", "--device", "h100", "--json"], capsys)
    assert rc == 0, err
    res = json.loads(out)
    pp = res["pipeline"]
    assert res["title"] == f"program {f}, 4 layers, 2 microbatches of its step; pipeline pp=2"
    assert pp["layers_per_stage"] == [2, 2] and pp["split_note"] is None
    # each microbatch is the program's step (tiny-llama: batch 4, seq 8): 2 of them
    assert pp["tokens"] == 2 * 4 * 8
    # the residual [4/dp, 8, 16] fp32 crosses the cut (tokens sharded over dp: mesh dim 1, pp being dim 0)
    assert pp["stages"][0]["send_bytes"] == 2 * 8 * 16 * 4


def test_program_without_numbered_layers_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prog = build_model(preset("tiny-llama"), check_rules=False).program.to_json()
    for op in prog["ops"]:
        op["layer"] = "block" if op["layer"].startswith("layer") else op["layer"]
    f = tmp_path / "flat.json"
    f.write_text(json.dumps(prog))
    rc, out, err = _run(["plan", "--program", str(f), "--mesh", "pp=2,dp=2"], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "--mesh pp=2: the program has no numbered layers to cut into stages" in err and "'block'" in err


# -- recompute, --devices and --verify for every source ---------------------------------------------


def test_recompute_reaches_an_imported_pipeline(hf_and_preset: Any) -> None:
    """--recompute on an imported model's pipeline, as on a preset's: full keeps less than
    selective keeps less than none, and each stage's backward pays its recomputation."""
    hf, _pre = hf_and_preset
    dev = preset_device("h100")
    ests = {r: estimate_pipeline(hf.plan, hf.spec, hf.counts, dev, (10e-6, 1 / 10e9), hf.tokens, 8, recompute=r)
            for r in ("none", "selective", "full")}
    for s in range(2):
        stash = {r: e.stages[s].stash_bytes for r, e in ests.items()}
        assert stash["none"] > stash["selective"] > stash["full"] > 0
        assert ests["none"].stages[s].recompute_s == 0.0
        assert 0 < ests["selective"].stages[s].recompute_s < ests["full"].stages[s].recompute_s
    assert ests["full"].step_serial_s > ests["selective"].step_serial_s > ests["none"].step_serial_s


def test_devices_searches_pipelines_of_an_hf_model(hf_and_preset: Any) -> None:
    """--devices on an HF model: pipelines are searched too, each microbatch the model traced again
    at one sequence per dp rank (the step's tokens unchanged), its layers split as a preset's."""
    from dataclasses import replace

    from spmdkit.models.source import load
    from spmdkit.planner.search import search_meshes

    src = HFModel("LlamaForCausalLM", json.dumps(TINY_LLAMA_HF), "float32", 4, 8)
    traced: list[int] = []

    def reload(b: int, chunks: int, cp: Any) -> Any:
        assert cp is None  # 8 tokens: no cp tried
        traced.append(b)
        assert chunks == 1  # dp only: routed whole (a dense model has no MoE block)
        return load(replace(src, batch=b)).program

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = load(src).program
        res = search_meshes(prog, 4, "h100", strategies=["dp"], recompute=["none", "full"], reload=reload)
    pipes = {(c.config.dp, c.config.tp, c.config.pp, c.config.microbatches, c.config.recompute): c
             for c in res.candidates if c.config.pp > 1}
    # (dp on dp=1 x tp=2 x pp=2 is not tried: each tp rank would run the same sequences)
    assert set(pipes) == {(dp, tp, pp, 4 // dp, r) for dp, tp, pp in ((2, 1, 2), (1, 1, 4)) for r in ("none", "full")}
    assert sorted(traced) == [1, 2]  # once per microbatch size
    one = pipes[(1, 1, 4, 4, "none")]
    assert one.estimate.counts == (1, 1, 1, 1) and one.estimate.tokens == 4 * 8
    assert one.plan.program.tensors["input_ids"].shape == (1, 8)
    assert pipes[(2, 1, 2, 2, "full")].memory < pipes[(2, 1, 2, 2, "none")].memory


@pytest.mark.parametrize("cls,config", [
    ("LlamaForCausalLM", {"hidden_size": 512, "intermediate_size": 1408, "num_attention_heads": 8,
                          "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 32000,
                          "rope_theta": 500000.0, "eos_token_id": 31999}),
    ("GPT2LMHeadModel", {"n_embd": 256, "n_layer": 4, "n_head": 8, "vocab_size": 50304, "n_positions": 1024,
                         "bos_token_id": 50256, "eos_token_id": 50256}),
])
def test_verify_hf_simulates_the_same_class_tiny(cls: str, config: dict, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers", reason="transformers is not installed")
    from spmdkit.sim.verify_plan import tiny_hf_config

    tiny = tiny_hf_config(config)
    rc, out, err = _run(["plan", "--hf", cls, "--hf-config", json.dumps(config), "--mesh", "dp=2,tp=2", "--json",
                         "--verify"], capsys)
    assert rc == 0, err
    v = json.loads(out)["verify"]
    assert v["ok"] and v["checked"] > 100 and v["model"] == cls and v["config"] == tiny
    if cls == "LlamaForCausalLM":  # the sizes shrunk, every other key kept, the token ids inside the vocab
        assert tiny == {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 128,
                        "rope_theta": 500000.0, "eos_token_id": 31999 % 128}
    else:
        assert tiny == {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 128, "n_positions": 256,
                        "bos_token_id": 50256 % 128, "eos_token_id": 50256 % 128}


def test_tiny_hf_config_keeps_the_attention_kind() -> None:
    from spmdkit.sim.verify_plan import tiny_hf_config

    # multi-head stays multi-head, multi-query stays multi-query, experts and MLA ranks shrink
    assert tiny_hf_config({"num_attention_heads": 16, "num_key_value_heads": 16})["num_key_value_heads"] == 4
    assert tiny_hf_config({"num_attention_heads": 16, "num_key_value_heads": 1})["num_key_value_heads"] == 1
    got = tiny_hf_config({"n_routed_experts": 256, "num_experts_per_tok": 8, "kv_lora_rank": 512,
                          "q_lora_rank": 1536, "first_k_dense_replace": 3, "num_hidden_layers": 61,
                          "norm_topk_prob": True, "hidden_act": "silu"})
    assert got == {"n_routed_experts": 4, "num_experts_per_tok": 2, "kv_lora_rank": 16, "q_lora_rank": 16,
                   "first_k_dense_replace": 1, "num_hidden_layers": 2, "norm_topk_prob": True, "hidden_act": "silu"}


def test_devices_searches_pipelines_of_a_program_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--devices on a program file: its pipelines run the file's step as one microbatch (a file
    cannot be traced again), 6 layers on pp=4 balanced as with --mesh."""
    f = _program_file(tmp_path, layers=6)
    rc, out, err = _run(["plan", "--program", str(f), "--devices", "4", "--strategy", "dp", "--recompute", "none",
                         "--annotate", "tokens=[0,-1]", "--json"], capsys)
    assert rc == 0, err
    res = json.loads(out)["search"]
    rows = {(c["dp"], c["tp"], c["pp"]): c for c in res["top"]}
    assert {(4, 1, 1), (2, 1, 2), (1, 1, 4)} <= set(rows)
    assert rows[(1, 1, 4)]["microbatches"] == 1 and rows[(2, 1, 2)]["microbatches"] == 1
    assert res["refused"] == []


def test_verify_with_pp_names_what_it_checks(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = _program_file(tmp_path)
    rc, out, err = _run(["plan", "--program", str(f), "--mesh", "pp=2,dp=2", "--verify"], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert "--verify: simulates a preset, catalog or --hf model; it does not apply to --program" in err


@pytest.mark.parametrize("framework", ["megatron", "torchtitan"])
def test_an_uneven_split_under_megatron_names_its_layout(capsys: pytest.CaptureFixture[str], framework: str) -> None:
    """3 layers on pp=2: Megatron-LM refuses layers its stages do not divide unless given a layout
    (d98e8a64dd megatron/training/arguments.py); the note said the split alone. torchtitan takes
    any split (its split points): no such words."""
    rc, out, err = _run(["plan", "--model", "tiny-llama", "--layers", "3", "--mesh", "pp=2", "--microbatches", "2",
                         "--strategy", "dp", "--framework", framework], capsys)
    assert rc == 0, err
    first = out.splitlines()[0]
    assert first.startswith("note: 3 layers do not divide evenly into 2 stages: split 2,1 ")
    layout = "; Megatron-LM refuses layers its stages do not divide unless given the split: " \
             "--pipeline-model-parallel-layout 'Et*2|tL'"
    assert first.endswith(layout) == (framework == "megatron"), first
