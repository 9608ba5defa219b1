"""Megatron-FSDP (``framework`` megatron, ZeRO-2/3) under a pipeline: each stage reduce-scatters
its gradients in every microbatch's backward (``grad_reduce_every_bprop``; no pipeline check in
Megatron-LM's arguments), so the step times ``m`` microbatches' reductions on each rank's
communication stream, as the memory holds the gradients at their shard; ZeRO-1 (the distributed
optimizer) and torchtitan under a pipeline reduce once (docs/devices.md, "Gradient accumulation
under ZeRO"). Llama-7b's 4 layers on ``pp=2, dp=64`` (h100, 64 sequences of 256 a microbatch):
2 x 0.0072 s of reduce-scatters a microbatch a stage against about 0.0027 s of work."""

from __future__ import annotations

import io
import itertools
from contextlib import redirect_stdout

import pytest

from spmdkit.cli import main
from spmdkit.planner.pipeline import PipelineEstimate
from spmdkit.planner.search import Config, config_candidates
from spmdkit.planner.search_config import Candidate
from spmdkit.planner.stage_costs import reduce_gradients
from spmdkit.program.runtime import Runtime

OVER = {"layers": 4, "seq": 256}


def _one(strategy: str, m: int = 16, framework: str = "megatron") -> tuple[Candidate, PipelineEstimate]:
    c = config_candidates("llama-7b", Config(64, 1, 2, strategy, "none", microbatches=m), "h100",
                          overrides={**OVER, "batch": 64 * m}, runtime=Runtime(framework=framework))[0]
    assert isinstance(c.estimate, PipelineEstimate)
    return c, c.estimate


def test_zero2_reduces_every_microbatch_on_each_rank() -> None:
    c, est = _one("megatron,zero2")
    # every parameter gradient's reduce-scatter is a per-microbatch one, on both stages
    assert [len(s.each) for s in est.stages] == [len(s.grads) for s in est.stages] == [19, 20]
    assert all(s.each_s == pytest.approx(s.grad_sync_s) and s.each_s > 0.007 for s in est.stages)
    # the stream of rank r carries m microbatches' reductions before its optimizer: the step is
    # at least that, and the reductions (not the 1F1B schedule) set it
    assert est.run is not None
    for r, s in enumerate(est.stages):
        assert est.step_overlap_s >= 16 * s.each_s + s.optimizer_s
        assert est.run.finish_s[r] < 16 * s.each_s
    # 0.121539 / 0.158335 s before Megatron's optimizer-step passes (spmdkit.cost.optimizer_step),
    # 0.121745 / 0.158541 before the step ran at its slowest GPU's pace (128 GPUs: Device.slowdown),
    # 0.121738 / 0.158436 before each attention kernel's own shape and the sustained share 0.843,
    # 0.121685 / 0.157648 before the share 0.870, 0.121617 / 0.156650 before the share 0.864,
    # 0.121632 / 0.156867 before cuDNN's 9.1.0 level and the share 0.853, 0.121658 / 0.157258 before
    # the share 0.870
    assert est.step_overlap_s == pytest.approx(0.121617, abs=1e-6)
    assert est.step_serial_s == pytest.approx(0.156637, abs=1e-6)  # + 15 more microbatches' reductions
    z1, est1 = _one("megatron,zero1")
    assert not any(s.each for s in est1.stages)
    # reduced once: as before (0.050221 s before the optimizer-step passes and the weight gradients
    # accumulated into the fp32 main_grad, spmdkit.cost.compute.fused_wgrad: at 256 tokens a rank
    # a microbatch those GEMMs are bound by the 8 bytes a weight they read and write; 0.063816 before
    # the slowest GPU's pace, 0.063748 before each attention kernel's own shape and the sustained share 0.843,
    # 0.063232 before the share 0.870, 0.062581 before the share 0.864, 0.062722 before cuDNN's 9.1.0
    # level and the share 0.853, 0.062974 before the share 0.870)
    assert est1.step_overlap_s == pytest.approx(0.062569, abs=1e-6)
    assert c.memory < z1.memory  # the gradients at their shard (2.65 against 4.78 GB)


def test_once_where_the_framework_reduces_once() -> None:
    """torchtitan's FSDP2 under torch's pipelining and a single microbatch reduce once: no
    reduction runs before the last microbatch."""
    _c, tt = _one("megatron,zero2", framework="torchtitan")
    # 0.059279 s before torch's foreach AdamW (80 bytes an element, not the fused 30: spmdkit.cost.eager)
    # 0.059406 before FSDP2's copy-in of each stage's reduce-scatters after its last backward
    # (tests/test_fsdp_copies.py), 0.060972 before the step ran at its slowest GPU's pace (Device.slowdown),
    # 0.060866 before each attention kernel's own shape and the sustained share 0.843, 0.060055 before
    # the share 0.870, 0.059045 before the share 0.864, 0.059264 before the share 0.853, 0.059673 before
    # the share 0.870 again
    assert not any(s.each for s in tt.stages) and tt.step_overlap_s == pytest.approx(0.059045, abs=1e-6)
    _c, single = _one("megatron,zero2", m=1)
    # 0.014411 before the optimizer passes, 0.014617 before the slowest GPU's pace, 0.014610 before
    # each attention kernel's own shape and the sustained share 0.843, 0.014557 before the share 0.870,
    # 0.014490 before the share 0.864, 0.014504 before cuDNN's 9.1.0 level and the share 0.853, 0.014531
    # before the share 0.870
    assert single.step_overlap_s == pytest.approx(0.014489, abs=1e-6)


def test_zero3_gathers_and_reduces_each_microbatch() -> None:
    """ZeRO-3: the per-microbatch parameter gathers already bound the schedule (0.132 s); its
    reduce-scatters (the same bytes as ZeRO-2's) run under it on the reductions' stream."""
    _c, est = _one("megatron,zero3")
    assert [len(s.each) for s in est.stages] == [19, 20]
    # 0.131924 before the optimizer passes, 0.132130 before the slowest GPU's pace (Device.slowdown),
    # 0.132117 before Megatron-FSDP's buckets were its units (a layer's gradients in one
    # reduce-scatter when its backward is done: Reducer.units), then 0.131997 before each attention
    # kernel's own shape and the sustained share 0.843, 0.131890 before the share 0.870, 0.131757
    # before the share 0.864, 0.131785 before cuDNN's 9.1.0 level and the share 0.853, 0.131833 before
    # the share 0.870
    assert est.step_overlap_s == pytest.approx(0.131751, abs=1e-6)
    assert est.step_overlap_s >= max(16 * s.each_s + s.optimizer_s for s in est.stages)


def test_early_reductions_queue_on_one_stream() -> None:
    """reduce_gradients' ``early``: each earlier microbatch's buckets launched as its backward
    makes them, one after the other on the stream; the last one's after them."""
    c, est = _one("megatron,zero2")
    plan = c.plan
    s = est.stages[1]
    alone, buckets = reduce_gradients(plan, [], 0.0, early=[(0.0, 1e-3, s.each)])
    busy = sum(b.time_s for b in buckets)  # about each_s (its buckets filled in another order)
    assert busy == pytest.approx(s.each_s, rel=0.05) and 0 < buckets[0].start_s < 1e-3
    assert alone == pytest.approx(buckets[0].start_s + busy)  # busy from the first launch on
    # two microbatches 1 ms apart: the second's buckets wait for the first's (each takes 7 ms)
    two, bs = reduce_gradients(plan, [], 0.0, early=[(0.0, 1e-3, s.each), (1e-3, 2e-3, s.each)])
    assert two == pytest.approx(alone + busy) and len(bs) == 2 * len(buckets)
    assert all(b.start_s >= a.start_s + a.time_s - 1e-15 for a, b in itertools.pairwise(bs))


@pytest.mark.parametrize(("strategy", "when"), [
    ("megatron,zero2", "121.62 ms with the gradient reductions overlapping each microbatch's backward (Megatron-FSDP"),
    ("megatron,zero1", "62.57 ms with the gradient reductions overlapping the last backward"),
])
def test_the_report_says_when_the_gradients_are_reduced(strategy: str, when: str) -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["plan", "--model", "llama-7b", "--layers", "4", "--mesh", "pp=2,dp=64,tp=1", "--strategy", strategy,
                   "--microbatches", "16", "--batch", "1024", "--seq", "256", "--device", "h100"])
    assert rc == 0 and when in out.getvalue()
