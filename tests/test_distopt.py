"""Megatron's distributed optimizer reduce-scatters the gradients (half an all-reduce's bytes);
torchtitan's ZeRO-1 plan (no such optimizer) keeps the all-reduce."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spmdkit.cost.devices import cost_model, preset_device, recost
from spmdkit.cost.step import estimate_step
from spmdkit.planner.planning import plan_model
from spmdkit.program.runtime import Runtime


def _buckets(strategy: str, framework: str) -> tuple[set[str], float]:
    dev = preset_device("h100")
    _, plan, _ = plan_model("llama-7b", "dp=16,tp=8", strategy, {"layers": 2, "batch": 16})  # a sequence a dp rank
    plan = replace(recost(plan, cost_model(plan.mesh, dev)), runtime=Runtime(framework=framework))
    est = estimate_step(plan, dev, 16 * 4096)
    dp = {b for b in est.buckets if b.mesh_dims == (0,)}
    return {b.kind for b in dp}, sum(b.time_s for b in dp)


def test_distributed_optimizer_reduce_scatters() -> None:
    kinds, rs = _buckets("megatron,zero1", "megatron")
    assert kinds == {"reduce_scatter"}
    kinds_tt, ar = _buckets("megatron,zero1", "torchtitan")
    assert kinds_tt == {"all_reduce"}
    # the same gradients: a ring reduce-scatter moves half the bytes of a ring all-reduce
    assert rs == pytest.approx(ar / 2, rel=0.1)
    kinds_dp, _ = _buckets("megatron", "megatron")
    assert kinds_dp == {"all_reduce"}  # plain DDP: no optimizer shards, the gradients all-reduced


def _exposed(strategy: str, mesh: str, accum: int) -> tuple[dict[str, float], float]:
    dev = preset_device("h100")
    # one sequence of 1024 tokens a data-parallel rank: little compute to hide the gathers under
    _, plan, _ = plan_model("llama-7b", mesh, strategy, {"layers": 2, "batch": 16, "seq": 1024})
    plan = replace(recost(plan, cost_model(plan.mesh, dev)), runtime=Runtime(framework="megatron"), grad_accum=accum)
    est = estimate_step(plan, dev, 16 * 1024)
    return est.exposed_s, est.step_overlap_s - est.compute_total_s


def test_exposed_communication_by_kind() -> None:
    """``step.exposed_s`` splits the step beyond its compute: the tensor-parallel collectives that
    block each micro-step, the data-parallel buckets still running after the last backward, the
    distributed optimizer's gathers the first forward leaves, the backward's re-gathers. Megatron-
    Core reduces only in the last microbatch's backward (``forward_backward_no_pipelining`` runs the
    others under ``no_sync``) and gathers under the first forward, so with 4 microbatches the
    blocking part is 4 times one micro-step's while the gradient and gather tails stay as they were."""
    one, rest1 = _exposed("megatron,sp,zero1", "dp=16,tp=8", 1)
    four, rest4 = _exposed("megatron,sp,zero1", "dp=16,tp=8", 4)
    for ex, rest in ((one, rest1), (four, rest4)):
        assert set(ex) == {"blocking", "gradient_buckets", "param_gathers", "regathers"}
        assert sum(ex.values()) == pytest.approx(rest, rel=1e-9)
        assert all(v >= -1e-12 for v in ex.values())
    # dp=16 over 16 nodes on one NIC a rank: the fp32 reduce-scatters outlast the backward
    assert one["gradient_buckets"] > 0 and one["param_gathers"] > 0 and one["blocking"] > 0
    assert four["blocking"] == pytest.approx(4 * one["blocking"], rel=1e-9)
    assert four["regathers"] == pytest.approx(4 * one["regathers"], rel=1e-9)
    assert four["gradient_buckets"] == pytest.approx(one["gradient_buckets"], rel=1e-9)
    assert four["param_gathers"] == pytest.approx(one["param_gathers"], rel=1e-9)
    # data parallel alone, without the distributed optimizer: nothing blocks, nothing to gather
    dp, _ = _exposed("dp", "dp=16", 2)
    assert dp["blocking"] == 0 and dp["param_gathers"] == 0 and dp["regathers"] == pytest.approx(0, abs=1e-12)
