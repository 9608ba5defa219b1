"""FSDP2's side-stream pools (spmdkit.cost.memory_fsdp2, spmdkit.planner.pipeline_memory): the
all-gather copy-in stream's two consecutive groups and, under a torch pipeline, the reduce-scatter
stream's sharded gradients, reserved beside the default stream's blocks; their bytes by hand."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from spmdkit.cost.devices import preset_device
from spmdkit.cost.memory import ALLOCATOR_RESERVE, memory_per_device
from spmdkit.cost.memory_fsdp2 import copy_in_pool, gather_sizes, gathered_numels, pair_peak, param_groups
from spmdkit.planner.pipeline import estimate_pipeline
from spmdkit.planner.pipeline_memory import ChunkBytes, torch_rank_memory
from spmdkit.planner.pipeline_plan import plan_pipeline
from spmdkit.planner.planning import plan_model
from spmdkit.program.runtime import Runtime

# tiny-llama (hidden 16, 4 heads of 4, 2 kv heads, FFN 32, fp32): a layer's parameters, in elements
LAYER = 2 * 16 + 16 * 16 + 2 * 16 * 8 + 16 * 16 + 3 * 16 * 32  # two norms, q, k and v, o, gate, up, down


def _flat(framework: str, vocab: int) -> object:
    _model, plan, _ = plan_model("tiny-llama", "dp=2", "dp,zero3", {"layers": 3, "vocab": vocab})
    return replace(plan, runtime=Runtime(framework=framework))


def test_pair_peak_of_consecutive_all_gathers() -> None:
    assert pair_peak([20, 5, 5]) == 25      # the root group's buffer with the first block's
    assert pair_peak([3, 5, 7, 5]) == 12
    assert pair_peak([4]) == 4 and pair_peak([]) == 0


def test_groups_are_the_numbered_layers_and_the_root() -> None:
    plan = _flat("torchtitan", 64)
    groups = param_groups(plan.program)
    assert groups["layers.1.wq"] == "layer 1" and groups["embed"] == "" and groups["lm_head"] == ""
    # dp = 2 gathers every stored parameter whole (fp32: 4 bytes an element)
    got = gathered_numels(plan)
    assert got["layers.0.w_up"] == 16 * 32 and got["embed"] == 64 * 16
    root = (64 * 16 + 16 + 16 * 64) * 4  # embedding, final norm, head
    sizes = gather_sizes(plan.program, {n: k * 4 for n, k in got.items()})
    assert sizes == [root, LAYER * 4, LAYER * 4, LAYER * 4]


def test_copy_in_pool_joins_the_flat_reserve() -> None:
    # vocab 64: the root (8256 B) and a layer (9344 B) make less than two layers: 2 x 9344
    small = _flat("torchtitan", 64)
    assert copy_in_pool(small) == 2 * LAYER * 4 == 18688
    # vocab 512: the root's buffer (embedding and head, 65600 B) with the first layer's
    big = _flat("torchtitan", 512)
    assert copy_in_pool(big) == (512 * 16 + 16 + 16 * 512) * 4 + LAYER * 4 == 74944
    mem = memory_per_device(big)
    assert mem.allocator_reserve == round(ALLOCATOR_RESERVE * mem.activation_peak) + 74944
    assert mem.reserved == mem.total + mem.allocator_reserve
    # Megatron-LM's ZeRO is no FSDP2: no such pool
    mega = memory_per_device(_flat("megatron", 512))
    assert copy_in_pool(_flat("megatron", 512)) == 0
    assert mega.allocator_reserve == round(ALLOCATOR_RESERVE * mega.activation_peak)


def _chunk(**kw: int) -> ChunkBytes:
    base = {"stash": 10, "working": 30, "parameters": 100, "states": 200, "gradients": 5,
            "unsharded_parameters": 50, "unsharded_gradients": 80, "input_bytes": 0, "output_bytes": 4,
            "grad_recv_bytes": 4, "gather_pool": 0}
    return ChunkBytes(**{**base, **kw})


def test_walk_reserves_the_sharded_gradients_of_stages_not_done() -> None:
    # two stages, one microbatch: F0 F1 B1 B0 (test_pipeline_torch_memory's walk). Reserved beside
    # the allocated: each chunk's copy-in pool (6, 9) and the reduce-scatter pool's sharded
    # gradients of a stage whose last backward has not run (5 each); after B1 stage 1's sharded
    # gradients are allocated (counted as its gradients), so only stage 0's stay in the pool.
    a = _chunk(working=30, output_bytes=3, grad_recv_bytes=3, gather_pool=6)
    b = _chunk(working=60, input_bytes=7, output_bytes=9, grad_recv_bytes=0, gather_pool=9)
    order = [("F", 0, 0), ("F", 1, 0), ("B", 1, 0), ("B", 0, 0)]
    peak = torch_rank_memory([a, b], order, 1)
    assert peak.unit == ("B", 1, 0) and peak.pools == 6 + 9 + 5 + 5
    assert peak.parameters + peak.gradients + peak.optimizer_states + peak.activations == 872
    # stage 0 working 120: B0 is the fullest (250 + 85 + 400 + 120 + 29 = 884, + pools 20 = 904
    # against 897 at B1); stage 1's sharded gradients (5) are allocated there, among its gradients
    # (its unsharded 80 freed), and only stage 0's stay in the pool: each counted once
    late = torch_rank_memory([replace(a, working=120), b], order, 1)
    assert late.unit == ("B", 0, 0) and late.gradients == 80 + 5 and late.pools == 6 + 9 + 5


def _pipeline(framework: str) -> Any:
    _m, plan, spec, counts, _ = plan_pipeline("tiny-llama", "pp=2,dp=2", "dp,zero3",
                                              {"microbatches": 4, "schedule": "1f1b", "virtual": None},
                                              {"layers": 4, "batch": 8})
    return estimate_pipeline(replace(plan, runtime=Runtime(framework=framework)), spec, counts, preset_device("h100"))


def test_torchtitan_pipeline_reserves_fsdp2_pools() -> None:
    est = _pipeline("torchtitan")
    # each stage a model chunk of 2 layers and its root group (stage 0: the embedding, 4096 B; stage
    # 1: the final norm and the head, 4160 B): two layers' buffers (2 x 9344) are the most in a row
    for s, m, root in zip(est.stages, est.memory, (64 * 16 * 4, (16 + 16 * 64) * 4)):
        assert s.gather_pool == 2 * LAYER * 4 > root + LAYER * 4
        # the fullest unit of each rank comes before its stage's last backward: its sharded
        # gradients (fp32, dp = 2) stay in the reduce-scatter pool
        assert m.allocator_reserve == round(ALLOCATOR_RESERVE * m.activation_peak) + s.gradients + s.gather_pool
    assert est.stages[0].gradients == (64 * 16 + 2 * LAYER) * 4 // 2


def test_automodel_pipeline_reserves_the_copy_in_pools() -> None:
    # AutoModel's pipelines keep Megatron-LM's count (the sharded gradients allocated beside the
    # unsharded ones all step): only the copy-in pools join the reserve; Megatron-LM's none
    est = _pipeline("automodel")
    for s, m in zip(est.stages, est.memory):
        assert s.gather_pool == 2 * LAYER * 4
        assert m.allocator_reserve == round(ALLOCATOR_RESERVE * m.activation_peak) + s.gather_pool
    mega = _pipeline("megatron")
    assert all(s.gather_pool == 0 for s in mega.stages)
    assert all(m.allocator_reserve == round(ALLOCATOR_RESERVE * m.activation_peak) for m in mega.memory)
