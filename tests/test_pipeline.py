"""Pipeline parallelism (graph/pipeline.py): schedules, bubble, in-flight memory, send/recv,
the llama-70b pp,dp,tp,sp plan, --verify with pp, and the one-line errors."""

from __future__ import annotations

import json

import pytest

from spmdkit.cli import main
from spmdkit.core.errors import ProgramError
from spmdkit.cost.devices import preset_device
from spmdkit.planner.pipeline import bubble_formula, estimate_pipeline, in_flight, run_schedule, schedule_order
from spmdkit.planner.pipeline_plan import plan_pipeline
from spmdkit.planner.pipeline_split import PipelineSpec, op_stages, parse_spec, split_layers


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


@pytest.mark.parametrize("schedule,p,v,m", [("gpipe", 4, 1, 8), ("1f1b", 4, 1, 8), ("1f1b", 8, 1, 3),
                                             ("interleaved", 4, 2, 8), ("interleaved", 4, 4, 12)])
def test_bubble_equals_the_formula_for_equal_stages(schedule: str, p: int, v: int, m: int) -> None:
    n = p * v
    f, b = [1.0 / v] * n, [2.0 / v] * n
    run = run_schedule(schedule, p, v, m, f, b)
    assert run.busy_s == pytest.approx([3.0 * m] * p)
    assert run.bubble_fraction == pytest.approx(bubble_formula(schedule, p, v, m), rel=1e-12)
    assert run.pipeline_s == pytest.approx(3.0 * m * (1 + bubble_formula(schedule, p, v, m)))


def test_bubble_follows_the_slowest_stage_and_the_sends() -> None:
    # one slow stage: the pipeline runs at its pace, so its bubble is no longer (p-1)/m
    run = run_schedule("1f1b", 4, 1, 8, [1.0, 1.0, 2.0, 1.0], [2.0, 2.0, 4.0, 2.0])
    assert max(run.busy_s) == pytest.approx(48.0)
    # at least its 8 x 6 of work, the forwards of stages 0-1 before it and their backwards after it
    assert run.pipeline_s >= 48.0 + 2.0 + 4.0
    assert run.pipeline_s == pytest.approx(55.0)  # + 1: stage 3's first backward is not yet back
    assert run.bubble_fraction == pytest.approx(7 / 48) and run.bubble_fraction < bubble_formula("1f1b", 4, 1, 8)
    sends = run_schedule("1f1b", 4, 1, 8, [1.0] * 4, [2.0] * 4, [0.5] * 4, [0.5] * 4)
    free = run_schedule("1f1b", 4, 1, 8, [1.0] * 4, [2.0] * 4)
    assert sends.pipeline_s > free.pipeline_s + 2 * 3 * 0.5 - 1e-9


def test_schedule_orders_do_every_unit_once() -> None:
    for sched, p, v, m in (("gpipe", 4, 1, 6), ("1f1b", 4, 1, 6), ("interleaved", 4, 3, 8)):
        for r in range(p):
            order = schedule_order(sched, p, v, m, r)
            want = {(k, c * p + r, i) for k in "FB" for c in range(v) for i in range(m)}
            assert len(order) == len(want) and set(order) == want
    # 1F1B: device 0 warms up with p-1 forwards, the last device alternates from the start
    assert [k for k, _, _ in schedule_order("1f1b", 4, 1, 8, 0)[:5]] == ["F", "F", "F", "F", "B"]
    assert [k for k, _, _ in schedule_order("1f1b", 4, 1, 8, 3)[:4]] == ["F", "B", "F", "B"]


def test_in_flight_microbatches_per_schedule() -> None:
    assert [in_flight("gpipe", 4, 1, 16, r) for r in range(4)] == [16, 16, 16, 16]
    assert [in_flight("1f1b", 4, 1, 16, r) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 4, 1, 2, r) for r in range(4)] == [2, 2, 2, 1]
    # interleaved: p + (p-1)/v stage-microbatches on the first device (Korthikanti et al. 2022, 4.2.3)
    assert in_flight("interleaved", 4, 2, 16, 0) == pytest.approx(4 + 3 / 2)
    assert in_flight("interleaved", 8, 4, 32, 0) == pytest.approx(8 + 7 / 4)
    assert in_flight("interleaved", 4, 2, 16, 3) == pytest.approx((0 + 4 + 1) / 2)


def _tiny(mesh: str, m: int, layers: int = 4, schedule: str = "1f1b", v: int | None = None) -> tuple:
    return plan_pipeline("tiny-llama", mesh, "megatron", {"microbatches": m, "schedule": schedule, "virtual": v},
                         {"layers": layers, "batch": 8})


def test_stages_and_send_bytes() -> None:
    model, plan, spec, counts, _ = _tiny("pp=2,dp=2,tp=2", 2)
    assert counts == (2, 2) and model.config.batch == 4  # batch 8 in 2 microbatches of 4
    stages = op_stages(plan.program, counts)
    prog = plan.program
    by_name = {op.name: s for op, s in zip(prog.ops, stages)}
    assert all(s == 0 for op, s in zip(prog.ops, stages) if op.layer in ("embedding", "layer 0", "layer 1"))
    assert all(s == 1 for op, s in zip(prog.ops, stages) if op.layer in ("head", "layer 2", "layer 3"))
    assert by_name["update embed"] == 0 and by_name["update lm_head"] == 1
    est = estimate_pipeline(plan, spec, counts, preset_device("h100"), (10e-6, 1 / 10e9), 8 * 8, 8)
    c = model.config
    # the residual stream leaves stage 0: [4/dp, seq, hidden] float32; its gradient comes back alike
    assert est.stages[0].send_bytes == 2 * c.seq * c.hidden * 4
    assert est.stages[1].send_grad_bytes == est.stages[0].send_bytes
    assert est.stages[1].send_bytes == 0
    assert est.send_f_s[0] == pytest.approx(10e-6 + est.stages[0].send_bytes / 10e9)
    # the two stages hold every parameter between them, each once
    whole = sum(t.numel * t.itemsize for t in prog.tensors.values()
                if t.kind == "parameter" and not t.inplace_of and t.name in ("embed", "lm_head"))
    assert est.memory[0].parameters + est.memory[1].parameters > whole // 2
    # 1F1B: stage 0 keeps 2 microbatches, stage 1 one: the extra one is stage 0's stash
    assert est.in_flight == [2, 1]
    assert est.memory[0].activation_peak == est.stages[0].working_peak + est.stages[0].stash_bytes
    assert est.memory[1].activation_peak == est.stages[1].working_peak


def test_gpipe_keeps_more_activations_than_1f1b() -> None:
    _, plan, _, counts, _ = _tiny("pp=2,dp=1,tp=2", 4)
    g = estimate_pipeline(plan, PipelineSpec(2, 4, "gpipe", 1), counts)
    o = estimate_pipeline(plan, PipelineSpec(2, 4, "1f1b", 1), counts)
    stash = o.stages[1].stash_bytes
    assert stash > 0
    assert g.memory[1].activation_peak - o.memory[1].activation_peak == 3 * stash
    assert g.run is None and o.memory[0].parameters == g.memory[0].parameters


def test_llama_70b_pp_dp_tp_sp(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(["plan", "--model", "llama-70b", "--mesh", "pp=4,dp=8,tp=8", "--strategy", "megatron,sp",
                         "--microbatches", "16", "--device", "h100", "--json"], capsys)
    assert rc == 0, err
    res = json.loads(out)
    pp = res["pipeline"]
    assert pp["layers_per_stage"] == [20, 20, 20, 20] and pp["schedule"] == "1f1b"
    assert pp["tokens"] == 8 * 16 * 4096 and pp["ranks"] == 256
    assert [d["in_flight_microbatches"] for d in pp["devices"]] == [4, 3, 2, 1]
    assert abs(pp["bubble_fraction"] - 3 / 16) < 0.02
    assert 0.2 < pp["mfu"] < 0.8
    assert pp["step_overlap_s"] >= pp["pipeline_s"]
    # sequence parallel: the residual sent between stages is sharded over tp: [1, 4096/8, 8192] bf16
    assert pp["stages"][0]["send_bytes"] == 4096 // 8 * 8192 * 2
    mems = [d["memory"]["total"] for d in pp["devices"]]
    assert mems[0] > mems[3]  # the first stage keeps 4 microbatches, the last one


def test_verify_with_pp(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(["plan", "--model", "gpt2-small", "--mesh", "pp=2,dp=2,tp=2", "--strategy", "megatron,sp",
                         "--microbatches", "4", "--verify"], capsys)
    assert rc == 0, err
    assert "in order: yes" in out and "all equal" in out
    assert "2 microbatches of 4" in out and "the microbatch losses sum to the whole batch's loss: yes" in out


@pytest.mark.parametrize("argv,needle", [
    (["--model", "llama-7b", "--mesh", "pp=3,tp=2", "--stages", "11,11,11"],
     "--stages 11,11,11: must be 3 counts summing to the model's 32 layers (they sum to 33)"),
    (["--model", "llama-7b", "--mesh", "pp=4,tp=2", "--batch", "10", "--microbatches", "4"],
     "--microbatches 4: does not divide the batch 10"),
    (["--model", "tiny-llama", "--mesh", "pp=4,tp=2"], "2 layers cannot fill 4 stages"),
    (["--model", "llama-7b", "--mesh", "pp=4,tp=2", "--stages", "8,8,8"], "--stages: 3 stage sizes given"),
    (["--model", "llama-7b", "--mesh", "pp=4,tp=2", "--schedule", "interleaved", "--microbatches", "6"],
     "not a multiple of pp=4"),
    (["--model", "llama-7b", "--mesh", "pp=4,tp=2", "--schedule", "zigzag"], "--schedule 'zigzag': unknown"),
    # one model chunk a device is no interleaving in Megatron-LM (1F1B) and refused by torchtitan; priced as
    # interleaved it held 2 (p - r - 1) + 1 microbatches in flight, where 1F1B holds p - r
    (["--model", "llama-7b", "--mesh", "pp=4,tp=2", "--schedule", "interleaved", "--virtual-stages", "1"],
     "--virtual-stages 1: the interleaved schedule runs at least 2 model chunks a device"),
    # Megatron-LM's validate_args asserts pp > 2 for the interleaved schedule without the p2p overlap
    (["--model", "llama-7b", "--mesh", "pp=2,tp=2", "--schedule", "interleaved", "--microbatches", "4",
      "--no-p2p-overlap"],
     "--no-p2p-overlap: Megatron-LM's interleaved schedule over pp=2 needs the stage-to-stage overlap"),
    (["--model", "llama-7b", "--mesh", "pp=4,tp=2", "--microbatches", "65536", "--virtual-stages", "4"],
     "forward units to simulate"),
    (["--model", "llama-7b", "--mesh", "dp=2,pp=4,tp=2", "--annotate", "tokens=[1,-1]"],
     "mesh dim 1 is pp; a tensor cannot be sharded over the pipeline dim"),
    (["--program", "x.json", "--mesh", "pp=2,tp=2", "--batch", "4"], "--batch: overrides a preset's size"),
    # the preset is built at one microbatch: its refusal names the --batch the user gave
    (["--model", "mixtral-8x7b", "--layers", "2", "--mesh", "pp=2,dp=4,ep=8", "--strategy", "dp,ep", "--batch", "64",
      "--microbatches", "4"], "--batch 16: data parallel over dp x ep = 4 x 8 ranks needs a batch that is a multiple "
                              "of 32 (each rank whole sequences) (a microbatch: --batch 64 over --microbatches 4; "
                              "whole sequences per rank: --microbatches 2 or --batch 128)"),
])
def test_errors_are_one_line(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(["plan", *argv], capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("spmdkit plan: ProgramError:") and needle in err, err


def test_spec_and_split() -> None:
    assert parse_spec(4, "8", "interleaved", None).virtual == 2
    assert split_layers(80, PipelineSpec(4, 8, "1f1b", 1)) == (20,) * 4
    assert split_layers(10, PipelineSpec(2, 8, "1f1b", 1, (6, 4))) == (6, 4)
    with pytest.raises(ProgramError, match="--virtual-stages 2: model chunks apply to --schedule interleaved"):
        parse_spec(4, "8", "gpipe", "2")


def test_annotations_name_the_full_mesh(capsys: pytest.CaptureFixture[str]) -> None:
    # dims after pp move down by one: tokens sharded over dp (full-mesh dim 2) is dp on the sub-mesh
    rc, out, err = _run(["plan", "--model", "tiny-llama", "--layers", "2", "--mesh", "pp=2,tp=2,dp=2",
                         "--strategy", "megatron", "--annotate", "tokens=[-1,2]", "--json"], capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert res["mesh"]["dim_names"] == ["tp", "dp"]
    assert res["tensors"]["tokens"]["dims_mapping"] == [-1, 1]


def test_microbatches_without_pp_is_gradient_accumulation(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(["plan", "--model", "tiny-gpt2", "--mesh", "dp=2,tp=2", "--microbatches", "2",
                         "--device", "a100-80gb", "--json"], capsys)
    assert rc == 0, err
    pp = json.loads(out)["pipeline"]
    assert pp["pp"] == 1 and pp["bubble_fraction"] == pytest.approx(0.0, abs=1e-12)
    assert pp["tokens"] == 2 * 4 * 8 and pp["stages"][0]["send_bytes"] == 0


def test_stages_partition_the_state_of_the_step() -> None:
    from spmdkit.cost.memory import memory_per_device

    _, plan, _, counts, _ = _tiny("pp=4,dp=2,tp=2", 2, layers=8)
    whole = memory_per_device(plan)
    est = estimate_pipeline(plan, PipelineSpec(4, 2, "1f1b", 1), counts)
    for key in ("parameters", "gradients", "optimizer_states"):
        parts = [getattr(m, key) for m in est.memory]
        assert sum(parts) == getattr(whole, key) and min(parts) > 0, key
    # every op in exactly one stage, stages in program order in the forward
    assert sum(st.ops for st in est.stages) == len(plan.program.ops)


def test_interleaved_memory_counts_chunks() -> None:
    _, plan, _, counts, _ = _tiny("pp=2,dp=1,tp=2", 4, layers=4, schedule="interleaved", v=2)
    assert counts == (1, 1, 1, 1)
    est = estimate_pipeline(plan, PipelineSpec(2, 4, "interleaved", 2), counts)
    # rank 0 holds virtual stages 0 and 2: (2-0-1)*2 + (2-1)*2 + 1 = 5 chunks of half a stage
    assert est.in_flight[0] == pytest.approx(2.5)
    mine = [est.stages[0], est.stages[2]]
    stash = sum(c.stash_bytes for c in mine)
    work = max(c.working_peak for c in mine)
    assert est.memory[0].activation_peak == work + round((2.5 - 0.5) * stash)
    assert est.memory[0].parameters == mine[0].parameters + mine[1].parameters


def test_recompute_reaches_the_pipeline() -> None:
    """--recompute with pp: a recomputed region's activations leave each stage's stash (memory
    of the in-flight microbatches) and its ops' time is added to the stage's backward."""
    from spmdkit.cost.memory_saved import saved_activations

    _model, plan, spec, counts, _ = plan_pipeline("tiny-gpt-dropout", "pp=2,tp=2", "megatron", {"microbatches": 4},
                                                 {"layers": 4, "batch": 8}, None, None)
    dev = preset_device("a100-80gb")
    ests = {r: estimate_pipeline(plan, spec, counts, dev, (10e-6, 1 / 10e9), 8 * 16, 4, recompute=r)
            for r in ("none", "selective", "full")}
    for s in range(2):
        stash = {r: e.stages[s].stash_bytes for r, e in ests.items()}
        assert stash["none"] > stash["selective"] > stash["full"] > 0
        assert ests["none"].stages[s].recompute_s == 0.0
        assert 0 < ests["selective"].stages[s].recompute_s < ests["full"].stages[s].recompute_s
        # full recompute re-runs the stage's layers: about its forward time (the embedding / head aside)
        assert ests["full"].stages[s].recompute_s <= ests["full"].stages[s].forward_s
    # what leaves the stash is what the activation analysis says is not kept
    kept = {r: {n for lst in saved_activations(plan, r).tensors.values() for n, _ in lst} for r in ("none", "full")}
    assert kept["full"] < kept["none"]
    assert ests["full"].step_serial_s > ests["selective"].step_serial_s > ests["none"].step_serial_s
    assert ests["full"].memory[0].activation_peak < ests["none"].memory[0].activation_peak


def test_devices_does_not_interleave_pp2_without_the_p2p_overlap(capsys: pytest.CaptureFixture[str]) -> None:
    # plan --mesh pp=2 refuses it (test_errors_are_one_line); the search planned pp=2 x 2 chunks under
    # --no-p2p-overlap as a configuration to run, where Megatron-LM's validate_args asserts pp > 2
    argv = ["plan", "--model", "tiny-llama", "--layers", "4", "--devices", "2", "--batch", "8", "--strategy", "dp",
            "--device", "h100", "--json"]
    rc, out, err = _run([*argv, "--no-p2p-overlap"], capsys)
    search = json.loads(out)["search"]
    assert rc == 0 and {t["pp"] for t in search["top"]} == {1, 2}, err
    assert not [t for t in search["top"] if t.get("virtual_stages")]
    assert [(r["pp"], r["virtual_stages"]) for r in search["refused"]] == [(2, 2)]
    assert search["refused"][0]["reason"].startswith("--no-p2p-overlap: Megatron-LM's interleaved schedule over pp=2")
    rc, out, err = _run(argv, capsys)  # with the overlap (the default) it is planned
    assert rc == 0 and [t for t in json.loads(out)["search"]["top"] if t.get("virtual_stages") == 2]
