"""Megatron-FSDP's gradient buckets are its FSDP units (spmdkit.cost.buckets.Reducer.units).

Megatron-LM 1e057005, megatron/core/distributed/custom_fsdp: under ``optim_grads_params``
(spmdkit's ZeRO-3 under ``--framework megatron``) the units are the TransformerLayers;
``_get_parameter_groups`` puts a unit's parameters of one dtype and expert-ness in one bucket
(``bucket_size`` splits only the parameters outside the units) and groups a unit's buckets by
expert-ness (``bucket_group_of_bucket``); ``_post_backward`` hands the unit's parameters to
``GradReducePipeline.reduce_gradients`` when its backward is done, which reduce-scatters each
bucket group in one ``_coalescing_manager``. ``optim_grads`` (ZeRO-2) has no units: Megatron's
``max(40M, 1M x dp)``-parameter buckets, as before. Hand-computed on llama-7b (vocab 32000, hidden
4096, 2 layers) over dp=8 in one H100 node, gradients reduced in fp32."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spmdkit.cost.collectives import Fabric, Group, collective_time
from spmdkit.cost.devices import cost_model, preset_device, recost
from spmdkit.cost.step import StepEstimate, estimate_step
from spmdkit.planner.planning import plan_model
from spmdkit.program.runtime import Runtime

H100 = Fabric.of(450e9, 50e9)
NODE = Group(8, 8)
EMB = 32000 * 4096  # the embedding's and the output's parameters each
NORM = 4096
#: one layer's parameters: q, k, v, o (4096 x 4096), gate, up, down (4096 x 11008), two norms
LAYER = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096


def _est(strategy: str, framework: str = "megatron") -> tuple[StepEstimate, dict[str, float]]:
    """The step, and when each layer's backward ends (its last backward op)."""
    dev = preset_device("h100")
    _, plan, _ = plan_model("llama-7b", "dp=8", strategy, {"layers": 2})
    plan = replace(recost(plan, cost_model(plan.mesh, dev)), runtime=Runtime(framework=framework))
    est = estimate_step(plan, dev.lockstep(plan.mesh.size), 8 * 4096)
    ends = {}
    for i, clock, blocked, extra, secs in est.timeline:
        op = plan.program.ops[i]
        if op.phase == "backward":
            ends[op.layer] = clock + blocked + extra + secs
    return est, ends


def test_a_layers_gradients_are_one_reduce_scatter_when_its_backward_ends() -> None:
    est, ends = _est("zero3")
    # the output layer's (EMB x 4 bytes, over Megatron's bucket of max(40M, 8M) parameters x 4)
    # alone; each layer's 9 tensors in one; the final norm's with the embedding's (bucket_size)
    assert [(b.tensors, b.bytes) for b in est.buckets] == [
        (1, 4 * EMB), (9, 4 * LAYER), (9, 4 * LAYER), (2, 4 * (EMB + NORM))]
    for b in est.buckets:
        assert b.kind == "reduce_scatter" and b.time_s == pytest.approx(
            collective_time("reduce_scatter", b.bytes, NODE, H100))
    # launched when the layer's backward is done, each after the one before on the one stream
    head, one, zero, root = est.buckets
    assert (one.ready_s, zero.ready_s, root.ready_s) == (
        pytest.approx(ends["layer 1"]), pytest.approx(ends["layer 0"]), pytest.approx(ends["embedding"]))
    # the stream also carries the ZeRO-3 gathers: layer 0's backward group, as it starts, prefetches
    # the embedding's (bf16), which layer 1's reduce-scatter queues behind
    assert one.start_s == pytest.approx(one.ready_s + collective_time("all_gather", 2 * EMB, NODE, H100))
    assert head.start_s + head.time_s < one.ready_s
    assert zero.start_s == pytest.approx(max(zero.ready_s, one.start_s + one.time_s))
    assert root.start_s == pytest.approx(max(root.ready_s, zero.start_s + zero.time_s))


def test_zero2_keeps_megatrons_bucket_size_where_zero3_has_units() -> None:
    """``optim_grads``: no units, so ``bucket_size`` buckets whichever layers they span; the same
    model under ``optim_grads_params`` reduces a layer at once; torchtitan's FSDP2 as before
    (tests/test_fsdp_units.py)."""
    zero2, _ = _est("zero2")
    zero3, _ = _est("zero3")
    cap = 4 * 40_000_000
    assert all(b.bytes >= cap for b in zero2.buckets)
    layer = (9, 4 * LAYER)
    assert layer not in [(b.tensors, b.bytes) for b in zero2.buckets]
    assert [(b.tensors, b.bytes) for b in zero3.buckets].count(layer) == 2
    titan, _ = _est("zero3", framework="torchtitan")
    assert [b.tensors for b in titan.buckets] == [9, 9, 3]
