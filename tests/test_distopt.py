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
    _, plan, _ = plan_model("llama-7b", "dp=16,tp=8", strategy, {"layers": 2})
    plan = replace(recost(plan, cost_model(plan.mesh, dev)), runtime=Runtime(framework=framework))
    est = estimate_step(plan, dev, 8 * 4096)
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
