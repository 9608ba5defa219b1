"""``--recompute full:K`` without a pipeline: Megatron-Core's block recomputation
(``--recompute-granularity full --recompute-method block --recompute-num-layers K``) of the whole
model, one chunk at pp = 1 (TransformerBlock ``_checkpointed_forward`` checkpoints layers 0 ..
K-1 of the chunk's ``num_layers_per_pipeline_rank``, the others run as usual)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from spmdkit.cli import main
from spmdkit.core.errors import ProgramError
from spmdkit.cost.compute import op_cost
from spmdkit.cost.devices import load_device
from spmdkit.cost.memory import check_recompute, memory_per_device
from spmdkit.cost.memory_saved import recompute_regions, saved_activations
from spmdkit.cost.step import estimate_step
from spmdkit.planner.planning import plan_model
from spmdkit.program.runtime import Runtime

#: tiny-llama (float32, batch 4, seq 8, hidden 16) at 4 layers on dp=2: 2 sequences a rank
LAYERS = 4
INPUT = 2 * 8 * 16 * 4  # a layer's input kept under full recomputation: b/dp x s x h x 4 bytes


@pytest.fixture(scope="module")
def plan():  # type: ignore[no-untyped-def]
    return plan_model("tiny-llama", "dp=2", "dp", {"layers": LAYERS})[1]


def test_full_k_keeps_the_inputs_of_the_first_k_layers_and_everything_of_the_others(plan) -> None:  # type: ignore[no-untyped-def]
    prog = plan.program
    full = recompute_regions(prog, "full")
    assert len(full) == LAYERS and recompute_regions(prog, "full:2") == full[:2]
    none, every, two = (saved_activations(plan, m) for m in ("none", "full", "full:2"))
    assert two.layers == ["layer 0", "layer 1"] and every.layers == [] and none.layers == []
    # the first K layers keep their input only (as under full), by hand
    assert two.layer("layer 0") == two.layer("layer 1") == every.layer("layer 0") == INPUT
    assert {n for n, _ in two.tensors["layer 0"]} == {"embed.out"}
    assert {n for n, _ in two.tensors["layer 1"]} == {"layers.0.resid2"}
    # the others keep what they keep without recomputation, layer 2 its input too: the output of the last
    # recomputed layer, which the checkpoint does not save but layer 2's norm, run as usual, does
    # (Megatron-Core _checkpointed_forward, block method: layer K's input_layernorm outside the checkpoint)
    assert two.layer("layer 3") == none.layer("layer 3") > 10 * INPUT
    assert two.layer("layer 2") == none.layer("layer 2")
    assert ("layers.1.resid2", INPUT) in two.tensors["layer 2"]
    assert two.layer("head") == none.layer("head")
    assert two.total == 2 * INPUT + 2 * none.layer("layer 2") + none.layer("head")
    # full: each layer keeps its input, and the final norm (no layer, not checkpointed) the last layer's
    # output, as without recomputation: the head keeps what it keeps under none
    assert every.total == LAYERS * INPUT + none.layer("head")
    assert every.layer("head") == none.layer("head") and ("layers.3.resid2", INPUT) in every.tensors["head"]
    mem = {m: memory_per_device(plan, m) for m in ("none", "full:1", "full:2", "full")}
    assert mem["full"].total < mem["full:2"].total < mem["full:1"].total < mem["none"].total
    assert mem["full:2"].saved is not None and mem["full:2"].saved.total == two.total


def test_full_k_runs_the_forward_of_the_first_k_layers_again(plan) -> None:  # type: ignore[no-untyped-def]
    dev = load_device("h100")
    est = {m: estimate_step(plan, dev, 64, m) for m in ("none", "full:1", "full:3", "full")}
    for k in (1, 3):
        mine = {f"layer {i}" for i in range(k)}
        hand = sum(op_cost(plan, j).flops for j, op in enumerate(plan.program.ops)
                   if op.phase == "forward" and op.layer in mine)
        e = est[f"full:{k}"]
        assert hand > 0 and e.recompute_flops_per_device == pytest.approx(hand, rel=1e-12)
        assert e.flops_per_device == pytest.approx(est["none"].flops_per_device + hand, rel=1e-12)
        # the layers are alike: K of the L layers' recomputation time
        assert e.compute_s["recompute"] == pytest.approx(est["full"].compute_s["recompute"] * k / LAYERS, rel=1e-9)
        assert e.recompute == f"full:{k}"
    assert est["none"].step_overlap_s < est["full:1"].step_overlap_s < est["full:3"].step_overlap_s \
        < est["full"].step_overlap_s


def _plan_json(capsys: pytest.CaptureFixture[str], recompute: str) -> dict:  # type: ignore[type-arg]
    rc = main(["plan", "--model", "tiny-llama", "--mesh", "dp=2", "--strategy", "dp", "--device", "h100",
               "--recompute", recompute, "--json"])
    assert rc == 0
    got = json.loads(capsys.readouterr().out)
    got.pop("plan_seconds")
    return got  # type: ignore[no-any-return]


def test_full_k_at_every_layer_is_full_and_the_report_names_the_layers(capsys: pytest.CaptureFixture[str]) -> None:
    # tiny-llama has 2 layers: full:2 is --recompute full, the same plan JSON
    assert _plan_json(capsys, "full:2") == _plan_json(capsys, "full")
    one = _plan_json(capsys, "full:1")
    assert one["memory"]["saved_for_backward"]["recompute"] == "full:1"
    assert one["memory"]["saved_for_backward"]["recomputed_layers"] == ["layer 0"]
    assert one["step"]["recompute"] == "full:1"
    rc = main(["plan", "--model", "tiny-llama", "--mesh", "dp=2", "--strategy", "dp", "--recompute", "full:1"])
    text = capsys.readouterr().out
    assert rc == 0 and "kept for the backward (recompute full:1: layer 0 recomputed)" in text


def test_full_k_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    assert check_recompute("full:5") == "full:5"  # without a pipeline too; K is checked against the layers
    with pytest.raises(ProgramError, match=r"^--recompute 'full:0': expected full:K with K >= 1 layers per stage$"):
        check_recompute("full:0")
    with pytest.raises(ProgramError, match=r"^--recompute microbatch: microbatch-level recomputation applies to a "
                                           r"pipeline"):
        check_recompute("microbatch")
    rc = main(["plan", "--model", "tiny-llama", "--mesh", "dp=2", "--strategy", "dp", "--recompute", "full:3"])
    assert rc == 2
    assert capsys.readouterr().err.strip() == ("spmdkit plan: ProgramError: --recompute full:3: recomputes the first 3 "
                                               "layers, but the model has 2 (give K from 1 to 2)")


def test_full_k_is_refused_where_the_framework_has_no_count_of_layers(capsys: pytest.CaptureFixture[str]) -> None:
    # torchtitan's [activation_checkpoint] (9dec370: mode none / selective / full; selective_ac_option N
    # wraps every N-th block) and NeMo AutoModel's activation_checkpointing (on or off) cannot recompute
    # the first K layers
    for fw in ("torchtitan", "automodel"):
        with pytest.raises(ProgramError, match=rf"^--recompute full:1 with --framework {fw}: {fw}'s activation "
                                               r"checkpointing has no setting that recomputes the first K layers"):
            check_recompute("full:1", framework=fw)
        assert check_recompute("full", framework=fw) == "full"
        for mesh in ("dp=2", "pp=2,dp=1"):
            rc = main(["plan", "--model", "tiny-llama", "--mesh", mesh, "--strategy", "dp", "--recompute", "full:1",
                       "--framework", fw])
            assert rc == 2
            assert capsys.readouterr().err.strip() == (
                f"spmdkit plan: ProgramError: --recompute full:1 with --framework {fw}: {fw}'s activation "
                f"checkpointing has no setting that recomputes the first K layers (Megatron-LM's --recompute-method "
                f"block); give full, selective or none, or --framework megatron")
    assert check_recompute("full:1", framework="megatron") == "full:1"


def test_full_keeps_the_last_layers_output_under_torchtitan_too(plan) -> None:  # type: ignore[no-untyped-def]
    # torchtitan wraps each block in checkpoint_wrapper; its final norm, outside them, saves its input
    titan = replace(plan, runtime=Runtime(framework="torchtitan"))
    got, mega = saved_activations(titan, "full"), saved_activations(plan, "full")
    assert got.per_layer == mega.per_layer and got.total == LAYERS * INPUT + saved_activations(plan).layer("head")
