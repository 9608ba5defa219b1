"""FSDP2's copy-out and copy-in (torch/distributed/_composable/fsdp/_fsdp_collectives.py, pytorch
415cc26: foreach_all_gather_copy_out, foreach_reduce_scatter_copy_in) on the compute stream under
torch's pipelining: once a step per stage, before its first microbatch's forward and after its last
microbatch's backward (the flat step's: tests/test_fsdp_units.py, tests/test_zero.py)."""

from __future__ import annotations

import pytest

from spmdkit.cost.devices import preset_device
from spmdkit.planner.pipeline import PipelineEstimate
from spmdkit.planner.schedules import run_schedule
from spmdkit.planner.search import Config, config_candidates
from spmdkit.program.runtime import Runtime


def _one(strategy: str, framework: str = "megatron") -> PipelineEstimate:
    """llama-7b's 4 layers on pp=2 x dp=64, 16 microbatches of 64 x 256 tokens (test_fsdp_pipeline's)."""
    c = config_candidates("llama-7b", Config(64, 1, 2, strategy, "none", microbatches=16), "h100",
                          overrides={"layers": 4, "seq": 256, "batch": 64 * 16}, runtime=Runtime(framework=framework))[0]
    assert isinstance(c.estimate, PipelineEstimate)
    return c.estimate


def test_once_a_step_copies_lengthen_the_first_forward_and_the_last_backward() -> None:
    # 1F1B, 2 stages, 2 microbatches, F = 1, B = 2, free sends. Rank 0 runs F0 F1 B0 B1, rank 1
    # F0 B0 F1 B1: without copies r0 F0 [0, 1], F1 [1, 2]; r1 F0 [1, 2], B0 [2, 4], F1 [4, 5];
    # r0 B0 [4, 6]; r1 B1 [5, 7]; r0 B1 [7, 9]
    plain = run_schedule("1f1b", 2, 1, 2, [1.0, 1.0], [2.0, 2.0])
    assert plain.finish_s == pytest.approx([9.0, 7.0])
    # 0.5 s more in each stage's first forward, 0.25 s in its last backward: r0 F0 [0, 1.5], F1
    # [1.5, 2.5]; r1 F0 [1.5, 3], B0 [3, 5], F1 [5, 6]; r0 B0 [5, 7]; r1 B1 [6, 8.25]; r0 B1 [8.25, 10.5]
    once = run_schedule("1f1b", 2, 1, 2, [1.0, 1.0], [2.0, 2.0], once=[(0.5, 0.25), (0.5, 0.25)])
    assert once.finish_s == pytest.approx([10.5, 8.25])
    assert once.busy_s == pytest.approx([p + 0.75 for p in plain.busy_s])


def test_torchtitan_stages_copy_their_gathered_parameters_and_fp32_gradients_once() -> None:
    """torchtitan's ZeRO-3 under a pipeline holds each stage's parameters gathered (16-bit) and its
    gradients unsharded in fp32 over the microbatches: its copy-out reads and writes the gathered
    bytes, its copy-in the fp32 accumulated gradients into the fp32 reduce-scatter input."""
    rate = preset_device("h100").hbm_rate
    tt = _one("megatron,zero3", framework="torchtitan")
    for s in tt.stages:
        assert s.unsharded_parameters > 0
        assert s.copy_out_s == pytest.approx(2 * s.unsharded_parameters / rate)
        assert s.copy_in_s == pytest.approx(2 * s.unsharded_gradients / rate)
    assert tt.inputs is not None and tt.inputs.once == [(s.copy_out_s, s.copy_in_s) for s in tt.stages]
    # Megatron-FSDP copies in its own buffers' views (no FSDP2 copy): none
    mega = _one("megatron,zero3")
    assert all(s.copy_out_s == s.copy_in_s == 0.0 for s in mega.stages) and mega.inputs is not None
    assert mega.inputs.once is None
