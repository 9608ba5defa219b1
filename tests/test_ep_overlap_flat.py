"""``--ep-comm-overlap`` without a pipeline: Megatron-Core's ``combined_1f1b_schedule_for_no_pipelining``
(NVIDIA/Megatron-LM ae1c88296f, ``megatron/core/pipeline_parallel/combined_1f1b.py``): the first
microbatch's forward alone, then the forward of microbatch ``i + 1`` merged with the backward of
microbatch ``i``, then the last backward alone, timed by the pipeline's own merged-step engine on one
stage (spmdkit.planner.ep_overlap.flat_overlap); the plan's step, report line and JSON; the refusals."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

from conftest import cli_stdout
from spmdkit.cli import main
from spmdkit.planner.chunk_plan import ChunkOps, LayerOps, chunk_run
from spmdkit.planner.schedules import schedule_order

MOE = ["plan", "--model", "mixtral-8x7b", "--layers", "2", "--seq", "1024", "--batch", "8", "--device", "h100",
       "--mesh", "dp=1,ep=4", "--strategy", "dp,ep"]

#: one MoE layer, seconds by node: forward 3 + 1 + 2 + 1 = 7, backward 1 + 2 + 1 + 1 + 3 + 1 = 9
LAYER = LayerOps(attn_f=3.0, dispatch_f=1.0, mlp_f=2.0, combine_f=1.0, combine_b=1.0, mlp_b=2.0, mlp_dw=1.0,
                 dispatch_b=1.0, attn_b=3.0, attn_dw=1.0)


def test_two_microbatches_by_hand() -> None:
    """m = 2 at PP = 1: F0 alone (7 s); F1 + B0 merged; B1 alone. The merged step in the order
    ``TransformerLayerSchedulePlan.run`` issues its nodes (comm: combine_b 0-1, dispatch_f 3-4,
    dispatch_b 5-6, combine_f 8-9; comp: attn_f 0-3, mlp_b 3-5 (after combine_b), mlp_dw 5-6,
    mlp_f 6-8, attn_b 8-11, the deferred attn_dw 11-12): 12 s. The lone backward: combine_b 0-1,
    mlp_b 1-3, mlp_dw 3-4 beside dispatch_b 3-4, attn_b 4-7, attn_dw 7-8: 8 s. 7 + 12 + 8 = 27 s
    against 2 x (7 + 9) = 32 s: 5 s hidden."""
    from spmdkit.planner.ep_overlap import flat_schedule  # (here: the other tests fail on their own without it)

    chunk = ChunkOps((LAYER,))
    assert schedule_order("interleaved", 1, 1, 2, 0, 1) == [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("B", 0, 1)]
    assert chunk_run(chunk, chunk).seconds == pytest.approx(12.0)
    assert chunk_run(None, chunk).seconds == pytest.approx(8.0)
    run = flat_schedule(chunk, 7.0, 9.0, 2)
    assert run.pipeline_s == pytest.approx(27.0)
    assert run.hidden_s == pytest.approx([5.0])
    assert [(u[1], u[3]) for u in run.units] == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    # one microbatch: its forward alone (7 s), its backward alone (8 s)
    assert flat_schedule(chunk, 7.0, 9.0, 1).pipeline_s == pytest.approx(15.0)


def _plan(*extra: str) -> dict[str, Any]:
    rc, out = cli_stdout(*MOE, "--json", *extra)
    assert rc == 0
    return dict(json.loads(out))


@pytest.mark.parametrize("m", [1, 3])
def test_the_flat_plan_hides_what_the_merged_steps_hide(m: int) -> None:
    """A 2-layer Mixtral over ep = 4, no pipeline, ``--grad-accum m``: the JSON's
    ``step.ep_comm_overlap`` gives one microbatch's nodes (adding up to its forward and backward)
    and the seconds hidden, ``m (F + B)`` less F alone, ``m - 1`` merged steps and the last
    backward alone (by :func:`chunk_run`); the step is that much shorter than without the flag
    (``--grad-accum 1``: the lone backward alone hides its dispatch under its weight gradients)."""
    d = _plan("--grad-accum", str(m), "--ep-comm-overlap")
    eo = d["step"]["ep_comm_overlap"]
    chunk = ChunkOps(tuple(LayerOps(**x) for x in eo["chunk"]["layers"]),
                     **{k: v for k, v in eo["chunk"].items() if k != "layers"})
    f, b = eo["forward_s"], eo["backward_s"]
    assert chunk.forward_s == pytest.approx(f, rel=1e-12) and chunk.backward_s == pytest.approx(b, rel=1e-12)
    assert sum(x.dispatch_f + x.combine_f + x.dispatch_b + x.combine_b for x in chunk.layers) == \
        pytest.approx(eo["a2a_s"], rel=1e-12) and eo["a2a_s"] > 0
    # NCCL's all-to-all over ep = 4 in one H100 node keeps all 32 p2p channels' SMs
    # (spmdkit.cost.nccl_p2p): the work beside it runs on 100 of the 132
    share = eo["compute_share"]
    assert share == pytest.approx((132 - 32) / 132, rel=1e-12)
    merged = f + (m - 1) * chunk_run(chunk, chunk, share).seconds + chunk_run(None, chunk, share).seconds
    assert eo["microbatches"] == m and eo["merged_steps"] == m - 1
    assert eo["merged_s"] == pytest.approx(merged, rel=1e-9)
    assert eo["hidden_s"] == pytest.approx(m * (f + b) - merged, rel=1e-9)
    # at most the all-to-alls and the combine nodes' own work (the residual add Megatron runs on
    # the communication stream, beside the other stream's work)
    after = sum(x.after_f + x.after_b for x in chunk.layers)
    assert 0 < eo["hidden_s"] <= m * (eo["a2a_s"] + after) * (1 + 1e-9)
    plain = _plan("--grad-accum", str(m))["step"]
    assert "ep_comm_overlap" not in plain
    assert plain["step_overlap_s"] - d["step"]["step_overlap_s"] == pytest.approx(eo["hidden_s"], rel=1e-9)


def test_a_merged_step_holds_about_one_layer_more() -> None:
    """Memory (spmdkit.cost.memory_merged): in a merged step the forward of microbatch ``i + 1``
    builds its layers going up while the backward of microbatch ``i`` frees its own coming down,
    the output layer's backward first (Megatron-Core's ``TransformerModelChunkSchedulePlan.run``):
    one microbatch's activations and about one layer's more. Here a layer keeps 512 MB and the
    output layer 165 MB, so the peak grows, by less than a layer and a half; with one
    microbatch there is no merged step and nothing changes."""
    def peak(m: int, *flag: str) -> tuple[int, dict[str, int]]:
        mem = _plan("--grad-accum", str(m), *flag)["memory"]
        return mem["activation_peak"], mem["saved_for_backward"]["per_layer"]

    flat, saved = peak(3)
    assert saved["layer 0"] > saved["head"]
    assert peak(1, "--ep-comm-overlap")[0] == peak(1)[0] == flat
    grown = peak(3, "--ep-comm-overlap")[0] - flat
    assert 0 < grown < 1.5 * saved["layer 0"]


def test_the_report_names_the_hidden_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*MOE, "--grad-accum", "2", "--ep-comm-overlap"]) == 0
    out = capsys.readouterr().out
    assert "ep all-to-all overlap (--ep-comm-overlap, no pipeline): 2 microbatches as Megatron-Core's " \
        "combined_1f1b_schedule_for_no_pipelining runs them (1 merged forward-and-backward step, the first forward " \
        "and the last backward alone; a lone backward hides its dispatch's all-to-all under its weight gradients) " \
        "hide" in out
    # one microbatch: no merged step, yet a hidden share (the lone backward's): the line said only '0 merged
    # forward-and-backward steps, the first forward and the last backward alone) hide 571.5 us', with no source
    assert main([*MOE, "--ep-comm-overlap"]) == 0
    assert "1 microbatch as Megatron-Core's combined_1f1b_schedule_for_no_pipelining runs them (0 merged " \
        "forward-and-backward steps, the first forward and the last backward alone; a lone backward hides its " \
        "dispatch's all-to-all under its weight gradients) hide" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--recompute", "full"], "--ep-comm-overlap: Megatron-Core refuses --recompute full"),
    (["--recompute", "full:1"], "--ep-comm-overlap: Megatron-Core refuses --recompute full"),
    (["--recompute", "selective:moe"], "--ep-comm-overlap: Megatron-Core refuses the recomputed module moe"),
    (["--framework", "torchtitan"], "--framework torchtitan runs torch's FSDP2 training loop"),
    (["--precision", "fp32"], "--ep-comm-overlap: Megatron-Core runs the all-to-all overlap on a bf16 or fp16 model only"),
    (["--mesh", "dp=4", "--strategy", "dp"], "--ep-comm-overlap: overlaps the experts' all-to-alls over ep; the "
     "experts are not expert-parallel"),
])
def test_refusals(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*MOE, *args, "--ep-comm-overlap"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_refusals_without_experts_and_under_the_search(capsys: pytest.CaptureFixture[str]) -> None:
    dense = ["plan", "--model", "llama-7b", "--layers", "2", "--seq", "1024", "--batch", "8", "--mesh", "dp=4",
             "--strategy", "dp"]
    assert main([*dense, "--ep-comm-overlap"]) == 2
    assert "--ep-comm-overlap: overlaps the experts' all-to-alls; the model has no MoE layer" in capsys.readouterr().err
    assert main(["plan", "--devices", "8", "--model", "mixtral-8x7b", "--ep-comm-overlap"]) == 2
    assert "--ep-comm-overlap: applies to one plan (--mesh with ep, with or without pp); the --devices search does " \
        "not choose it" in capsys.readouterr().err


def test_the_partner_holds_its_embedding_output_beside_the_output_layers_backward() -> None:
    """Megatron-Core's ``TransformerModelChunkSchedulePlan.run`` (d98e8a64dd,
    ``megatron/core/models/common/model_chunk_schedule_plan.py``) runs the partner's
    ``f_input = f_schedule_plan.pre_process.forward()`` before ``b_schedule_plan.post_process
    .backward(b_grad)``: at every op of the output layer's backward the partner holds its embedding
    output, 2 sequences a rank (batch 8 over dp x ep = 4) x 1,024 tokens x 4,096 x 2 bytes =
    16,777,216 (it was left out: 0); at the last layer's backward, paired with the partner's layer 0,
    at least what the partner holds at that layer's end: the activations layer 0 keeps (the embedding
    output among them) and the stream it passes on (layer 0's output, 16,777,216 bytes), which the
    partner was counted without."""
    from spmdkit.cost.memory import memory_per_device
    from spmdkit.planner.planning import plan_preset

    _, plan, _ = plan_preset("mixtral-8x7b", "dp=1,ep=4", "dp,ep", {"layers": 2, "seq": 1024, "batch": 8}, grad_accum=2)
    flat = memory_per_device(plan)
    merged = memory_per_device(replace(plan, runtime=replace(plan.runtime, ep_comm_overlap=True)))
    ops = plan.program.ops
    grown = [(op.layer, b - a) for op, a, b in zip(ops, flat.curve, merged.curve) if op.phase == "backward"]
    stream = 2 * 1024 * 4096 * 2
    assert {d for lay, d in grown if not lay.startswith("layer") and lay != "embedding"} == {stream}
    assert min(d for lay, d in grown if lay == "layer 1") >= flat.saved.layer("layer 0") + stream
