"""A pipeline stage without a decoder layer: Megatron-Core's embedding-only first stage and
loss-only last stage (``--pipeline-model-parallel-layout "E|t*3|...|L"``,
``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``), given
as ``--stages 0,...,0``. GPT-2 small cut to 4 layers on pp=4 x tp=2, ``--stages 0,2,2,0``: the
first stage costs what the embedding unit costs, the last what the head unit costs
(:func:`spmdkit.planner.pipeline.plan_unit_costs`), each rank's memory is its stage's bytes with
its in-flight microbatches, and the simulated step is the embedding-folded split's (2,2,0 on
pp=3) plus the extra boundary's two sends (the last stage paces both). A 0 in the middle, and
every stage 0, are refused naming ``--stages``."""

from __future__ import annotations

import json

import pytest

from spmdkit.cli import main
from spmdkit.core.errors import ProgramError
from spmdkit.cost.compute import model_flops
from spmdkit.cost.devices import preset_device
from spmdkit.planner.fold_stages import deep_pipeline, stage_copy
from spmdkit.planner.pipeline import PipelineEstimate, estimate_pipeline, plan_unit_costs
from spmdkit.planner.pipeline_plan import plan_pipeline
from spmdkit.planner.pipeline_split import PipelineSpec, op_stages, op_units, split_layers
from spmdkit.planner.stage_costs import stage_costs

M = 8  # microbatches


def _estimate(stages: str, mesh: str, schedule: str = "1f1b", virtual: int | None = None) -> PipelineEstimate:
    _model, plan, spec, counts, _s = plan_pipeline(
        "gpt2-small", mesh, "megatron", {"microbatches": M, "stages": stages, "schedule": schedule,
                                         "virtual": virtual}, {"layers": 4})
    return estimate_pipeline(plan, spec, counts, H100_8)


#: one of 8 GPUs (the pp=4,tp=2 pipeline's): the pipelines compared run at the same slowest GPU's pace
H100_8 = preset_device("h100").at(8)


@pytest.fixture(scope="module")
def ends() -> tuple[PipelineEstimate, object]:
    _model, plan, spec, counts, _s = plan_pipeline("gpt2-small", "pp=4,tp=2", "megatron",
                                                   {"microbatches": M, "stages": "0,2,2,0"}, {"layers": 4})
    return estimate_pipeline(plan, spec, counts, preset_device("h100")), plan


def test_end_stages_are_the_embedding_and_head_units(ends: tuple[PipelineEstimate, object]) -> None:
    est, plan = ends
    assert est.counts == (0, 2, 2, 0)
    dev = preset_device("h100")
    u = plan_unit_costs(plan, 4, dev)  # type: ignore[arg-type]
    assert u.layers == 4
    first, last = est.stages[0], est.stages[3]
    assert first.layers == 0 and last.layers == 0
    # the embedding unit (0) and the head unit (L + 1), to the last bit
    for st, j in ((first, 0), (last, 5)):
        assert st.forward_s == u.forward_s[j] > 0
        assert st.backward_s + st.recompute_s == u.backward_s[j] > 0
        assert st.parameters + st.gradients + st.optimizer_states == u.held[j] > 0
        assert st.weight_s == u.weight_s[j]
    # wte [50304, 768] vocab-parallel over tp=2 in bf16, wpe [1024, 768] whole: the first stage's parameters;
    # the head [50304, 768] vocab-parallel and the final norm's weight and bias [768]: the last stage's
    assert first.parameters == 50304 * 768 // 2 * 2 + 1024 * 768 * 2
    assert last.parameters == 50304 * 768 // 2 * 2 + 2 * 768 * 2
    # the first stage sends the embedding's output, [8, 1024, 768] bf16 (no sequence parallel), and gets
    # its gradient back; it keeps nothing for its backward (the lookup reads the token ids, an input)
    assert first.send_bytes == 8 * 1024 * 768 * 2 == est.stages[1].send_grad_bytes
    assert first.send_grad_bytes == 0 and first.stash_bytes == 0
    assert last.send_bytes == 0 and last.send_grad_bytes == est.stages[2].send_bytes == first.send_bytes
    assert est.send_f_s[3] == 0.0 and est.send_f_s[0] == est.send_f_s[1] > 0
    # every op in exactly one stage; the end stages hold only the embedding's / the head's ops
    stages = op_stages(plan.program, est.counts)  # type: ignore[attr-defined]
    ops = plan.program.ops  # type: ignore[attr-defined]
    assert {op.layer for op, s in zip(ops, stages) if s == 0} == {"embedding", "optimizer"}
    assert {op.layer for op, s in zip(ops, stages) if s == 3} == {"head", "optimizer"}
    assert sum(st.ops for st in est.stages) == len(ops)


def test_end_stage_memory_is_hand_counted(ends: tuple[PipelineEstimate, object]) -> None:
    est, plan = ends
    # 1F1B on pp=4: rank r keeps 4 - r microbatches in flight
    assert est.in_flight == [4.0, 3.0, 2.0, 1.0]
    # the same stages priced one unit per stage (0: the embedding, 1..4 the layers, 5 the head)
    unit = stage_costs(plan, [s + 1 for s in _units(plan)], (0, 1, 1, 1, 1, 0), preset_device("h100"))  # type: ignore
    for r, (lo, hi) in enumerate(((0, 1), (1, 3), (3, 5), (5, 6))):
        st, mem = est.stages[r], est.memory[r]
        assert mem.parameters == sum(c.parameters for c in unit[lo:hi]) == st.parameters
        assert mem.gradients == sum(c.gradients for c in unit[lo:hi])
        assert mem.optimizer_states == sum(c.optimizer_states for c in unit[lo:hi])
        assert st.stash_bytes == sum(c.stash_bytes for c in unit[lo:hi])
        # one microbatch at its working peak, the others holding their stash
        assert mem.activation_peak == st.working_peak + (est.in_flight[r] - 1) * st.stash_bytes
    # the embedding-only rank: 4 in flight, yet only one embedding's working peak (nothing stashed):
    # the lookup's output, the position embedding's and their sum, each [8, 1024, 768] bf16
    assert est.memory[0].activation_peak == est.stages[0].working_peak == unit[0].working_peak == 3 * 8 * 1024 * 768 * 2
    # the head-only rank: one microbatch in flight, the head's working peak (its logits)
    assert est.memory[3].activation_peak == unit[5].working_peak > est.memory[0].activation_peak


def _units(plan: object) -> list[int]:
    return op_units(plan.program)[0]  # type: ignore[attr-defined]


def test_the_extra_stage_costs_its_sends_in_fill_and_drain(ends: tuple[PipelineEstimate, object]) -> None:
    est, _plan = ends
    folded = _estimate("2,2,0", "pp=3,tp=2")  # the embedding with the first two layers
    assert folded.stages[0].forward_s == pytest.approx(est.stages[0].forward_s + est.stages[1].forward_s, rel=1e-12)
    f = [c.forward_s for c in est.stages]
    b = [c.backward_s for c in est.stages]
    # the head stage paces the pipeline (GPT-2's 50304-token head on 1024 tokens a microbatch)
    assert f[3] + b[3] == max(x + y for x, y in zip(f, b))
    # 1F1B, blocking sends: the fill (every earlier stage's forward and send), the head stage's m
    # forwards and backwards, each of its first m - 1 backwards' send back waited on, and the drain
    fill = sum(f[:3]) + sum(est.send_f_s[:3])
    drain = sum(b[:3]) + sum(est.send_b_s[:3])
    assert est.run is not None and folded.run is not None
    assert est.run.pipeline_s == pytest.approx(fill + M * (f[3] + b[3]) + (M - 1) * est.send_b_s[2] + drain, rel=1e-12)
    # the embedding in a stage of its own: one boundary more, its two sends in the fill and the drain
    extra = est.send_f_s[0] + est.send_b_s[0]
    assert extra > 0
    assert est.run.pipeline_s - folded.run.pipeline_s == pytest.approx(extra, rel=1e-9)
    # the last rank's work is the same in both: the bubble grows by the two sends
    assert est.run.busy_s[3] == pytest.approx(folded.run.busy_s[2], rel=1e-12)


def test_interleaved_first_and_last_virtual_stage_may_be_empty() -> None:
    # pp=2 x 2 virtual stages: rank 0 holds virtual stages 0 (the embedding alone) and 2, rank 1 stages 1 and 3
    # (the head alone)
    est = _estimate("0,2,2,0", "pp=2,tp=2", "interleaved", 2)
    assert est.counts == (0, 2, 2, 0) and est.run is not None
    assert est.stages[0].layers == 0 and est.stages[3].layers == 0
    f = [c.forward_s for c in est.stages]
    assert est.run.busy_s[0] == pytest.approx(M * sum(c.forward_s + c.backward_s for c in est.stages[0::2]), rel=1e-12)
    assert est.run.busy_s[1] == pytest.approx(M * sum(c.forward_s + c.backward_s for c in est.stages[1::2]), rel=1e-12)
    assert f[0] < f[1] and f[3] > f[2]


@pytest.mark.parametrize("stages,needle", [
    ("2,0,2,0", "--stages 2,0,2,0: stage 1 (of 0..3) holds no layer; only the first stage"),
    ("0,2,0,2", "--stages 0,2,0,2: stage 2 (of 0..3) holds no layer"),
    ("0,0,0,0", "--stages 0,0,0,0: no stage holds a decoder layer"),
    ("0,2,2,1", "--stages 0,2,2,1: must be 4 counts summing to the model's 4 layers (they sum to 5)"),
])
def test_a_middle_or_every_stage_empty_is_refused(stages: str, needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--model", "gpt2-small", "--layers", "4", "--mesh", "pp=4,tp=2", "--stages", stages])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith("spmdkit plan: ProgramError: " + needle), err


def test_virtual_stages_only_the_very_first_and_last_may_be_empty() -> None:
    spec = PipelineSpec(2, 4, "interleaved", 2, (0, 2, 2, 0))
    assert split_layers(4, spec) == (0, 2, 2, 0)
    # rank 1's first virtual stage (1) and rank 0's last (2) are middle stages
    for bad, k in (((2, 0, 2, 0), 1), ((0, 2, 0, 2), 2)):
        with pytest.raises(ProgramError, match=rf"^--stages {','.join(map(str, bad))}: stage {k} \(of 0..3\)"):
            split_layers(4, PipelineSpec(2, 4, "interleaved", 2, bad))
    # fewer layers than stages: fine when the ends hold none
    assert split_layers(2, PipelineSpec(4, 4, "1f1b", 1, (0, 1, 1, 0))) == (0, 1, 1, 0)


def test_cli_json_of_an_embedding_only_first_stage(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--model", "gpt2-small", "--layers", "4", "--mesh", "pp=4,tp=2", "--stages", "0,2,2,0",
               "--microbatches", "8", "--device", "h100", "--json"])
    out = capsys.readouterr().out
    assert rc == 0
    pp = json.loads(out)["pipeline"]
    assert pp["layers_per_stage"] == [0, 2, 2, 0] and [s["layers"] for s in pp["stages"]] == [0, 2, 2, 0]
    assert pp["step_overlap_s"] > pp["pipeline_s"] > 0


LLAMA = {"num_key_value_heads": 2, "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
         "intermediate_size": 64, "vocab_size": 128, "max_position_embeddings": 64}


def test_an_imported_models_norm_head_and_embedding_gradient_go_to_the_empty_ends(
        tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    """An HF model labels its final norm and head by module (``model.norm``, ``lm_head``), not
    ``head``: they follow the last layer, so without ``op_units(ends=True)`` they would stay on the
    stage before an empty last stage (and the embedding's gradient on the stage after an empty first
    one). The export's stages follow the plan's: its 4-rank 1F1B run on gloo trains as eager
    (tests/test_run_torch_engine.py)."""
    pytest.importorskip("transformers")
    path = f"{tmp_path}/pp.py"
    rc = main(["plan", "--hf", "LlamaForCausalLM", "--hf-config", json.dumps(LLAMA), "--mesh", "pp=4,tp=1",
               "--strategy", "megatron", "--microbatches", "4", "--schedule", "1f1b", "--stages", "0,1,1,0", "--json",
               "--device", "h100", "--export", "torch", path])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    stages = json.loads(cap.out)["pipeline"]["stages"]
    # fp32: the embedding [128, 32] on the first stage; the final norm [32] and the head [128, 32] on the last
    assert [s["parameters"] for s in stages] == [128 * 32 * 4, stages[1]["parameters"], stages[1]["parameters"],
                                                 (32 + 128 * 32) * 4]
    # the hidden states sent on every boundary: a microbatch of 2 sequences of 16, [2, 16, 32] fp32
    assert [s["send_bytes"] for s in stages] == [2 * 16 * 32 * 4] * 3 + [0]
    assert [s["send_grad_bytes"] for s in stages] == [0] + [2 * 16 * 32 * 4] * 3
    assert stages[0]["stash_bytes"] == 0 and stages[3]["stash_bytes"] > 0
    # the embedding's gradient (after the first layer's backward) on the first stage; the head's forward and
    # backward on the last
    assert stages[0]["backward_s"] > 0 and stages[3]["forward_s"] > 0 and stages[3]["backward_s"] > 0
    text = open(path).read()
    assert ("PIPELINE = {'stages': [['model.embed_tokens'], ['model.layers.0'], ['model.layers.1'], "
            "['model.norm', 'lm_head']]") in text


@pytest.mark.parametrize("counts,v,copy,where", [
    ((0, 2, 2, 2, 2, 0), 1, (0, 2, 2, 0), (0, 1, 1, 1, 2, 3)),
    ((0,) + (1,) * 6 + (0,), 2, (0, 1, 1, 0), (0, 1, 1, 1, 1, 1, 2, 3)),
])
def test_a_deep_pipeline_with_empty_ends_folds_exactly(counts: tuple[int, ...], v: int, copy: tuple[int, ...],
                                                       where: tuple[int, ...]) -> None:
    """planner.fold_stages prices a deep pipeline from a shallow copy: before an empty last stage the
    stage holding the model's last layer is kept as it is (the last layer's ops are not a middle
    layer's: one op fewer in its backward), so the copy's step and memory are the whole pipeline's."""
    assert stage_copy(counts) == (copy, where)
    p, dev = len(counts) // v, preset_device("h100")
    args = {"microbatches": 2 * p, "stages": ",".join(map(str, counts)), "virtual": v}
    _m, plan, spec, c, _s = plan_pipeline("llama-7b", f"pp={p},tp=2", "megatron", args, {"layers": sum(counts), "seq": 512})
    tokens = 2 * p * 8 * 512
    whole = estimate_pipeline(plan, spec, c, dev, tokens=tokens)
    _m2, small, _s2, _c2, _t2 = plan_pipeline("llama-7b", f"pp={len(copy)},tp=2", "megatron",
                                              {"microbatches": 2, "stages": ",".join(map(str, copy))},
                                              {"layers": sum(copy), "seq": 512})
    deep = deep_pipeline(small, spec, counts, dev, (20e-6, 1 / 25e9), tokens, plan.mesh.size * p, "none",
                         model_flops(plan, 8 * 512)[0])
    assert deep is not None
    assert deep.step_overlap_s == pytest.approx(whole.step_overlap_s, rel=1e-12)
    assert [m.device_total for m in deep.memory] == [m.device_total for m in whole.memory]
    assert [st.backward_s for st in deep.stages] == pytest.approx([st.backward_s for st in whole.stages], rel=1e-12)
