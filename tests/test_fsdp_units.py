"""torchtitan's FSDP2 units in the step (spmdkit.cost.step_comm.torchtitan_units, Reducer): the root
module's parameters (embedding, final norm, output) gathered once before the first op and kept
through the backward, the last block kept from its forward to its backward, the root's gradients
reduce-scattered together at the end of the backward. Hand-computed on llama-7b (vocab 32000,
hidden 4096, 2 layers), zero3 over dp=8 in one H100 node."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spmdkit.cost.collectives import Fabric, Group, collective_time
from spmdkit.cost.devices import cost_model, preset_device, recost
from spmdkit.cost.step import estimate_step
from spmdkit.cost.step_comm import communication, layer_groups, torchtitan_units
from spmdkit.cost.step_compute import step_compute
from spmdkit.planner.planning import plan_model
from spmdkit.program.runtime import Runtime

H100 = Fabric.of(450e9, 50e9)
NODE = Group(8, 8)
EMB = 32000 * 4096  # the embedding's and the output's parameters each
NORM = 4096
#: one layer's parameters: q, o (4096 x 4096), k, v (4096 x 4096 here: llama-7b has no GQA),
#: gate, up, down (4096 x 11008), two norms
LAYER = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096


def _plan(framework: str):  # type: ignore[no-untyped-def]
    dev = preset_device("h100")
    _, plan, _ = plan_model("llama-7b", "dp=8", "zero3", {"layers": 2})
    plan = recost(plan, cost_model(plan.mesh, dev))
    # one of the mesh's 8 GPUs, as estimate_step runs it (Device.lockstep: the slowest one's pace)
    return replace(plan, runtime=Runtime(framework=framework)), dev.lockstep(plan.mesh.size)


def _ag(params: int) -> float:
    return collective_time("all_gather", 2 * params, NODE, H100)  # bf16 parameters


def test_torchtitan_gathers_the_root_once_and_keeps_the_last_block() -> None:
    plan, dev = _plan("torchtitan")
    comm = communication(plan, step_compute(plan, dev), dev)
    groups = layer_groups(plan)
    tags = {groups[i]: (op.layer, op.phase) for i, op in enumerate(plan.program.ops)}
    # every group gathers its parameters (the plan's view): embedding, 2 blocks, head, forward and backward
    assert [tags[g] for g in sorted(comm.prefetch)] == [
        ("embedding", "forward"), ("layer 0", "forward"), ("layer 1", "forward"), ("head", "forward"),
        ("head", "backward"), ("layer 1", "backward"), ("layer 0", "backward"), ("embedding", "backward")]
    units = torchtitan_units(plan, comm)
    # torchtitan: the root (embedding + final norm + output) once before op 0; layer 1 not again
    assert [tags[g] for g in units] == [("embedding", "forward"), ("layer 0", "forward"), ("layer 1", "forward"),
                                        ("layer 0", "backward")]
    assert units[0] == (pytest.approx(_ag(2 * EMB + NORM)), 0)
    assert all(secs == pytest.approx(_ag(LAYER)) for g, (secs, _first) in units.items() if g)
    # another framework's units are the plan's groups
    other, _ = _plan("automodel")
    comm = communication(other, step_compute(other, dev), dev)
    assert torchtitan_units(other, comm) == comm.prefetch


def test_torchtitan_reduce_scatters_the_root_gradients_last_in_one_bucket() -> None:
    plan, dev = _plan("torchtitan")
    est = estimate_step(plan, dev, 8 * 4096)
    # layer 1's, layer 0's, then the root's: output, final norm and embedding in fp32
    assert [b.tensors for b in est.buckets] == [9, 9, 3]
    assert [b.bytes for b in est.buckets] == [4 * LAYER, 4 * LAYER, 4 * (2 * EMB + NORM)]
    root = est.buckets[-1]
    assert root.time_s == pytest.approx(collective_time("reduce_scatter", 4 * (2 * EMB + NORM), NODE, H100))
    # launched when the backward ends (the embedding's gradient, the last backward op), after
    # layer 0's on the same stream; the optimizer waits for it: all of it past the backward is exposed.
    # FSDP2's copy-in of each bucket (foreach_reduce_scatter_copy_in: the bf16 gradients read, the
    # fp32 input written) runs on the compute stream before its reduce-scatter: layer 0's from the
    # end of the embedding's gradient (the op that shows its launch), then the root's
    ci_layer, ci_root = (2 + 4) * LAYER / dev.hbm_rate, (2 + 4) * (2 * EMB + NORM) / dev.hbm_rate
    opt = next(t for t in est.timeline if plan.program.ops[t[0]].phase == "optimizer")
    last = next(t for t in reversed(est.timeline) if plan.program.ops[t[0]].phase == "backward")
    assert root.ready_s == pytest.approx(last[1] + last[2] + last[3] + last[4])
    assert est.buckets[-2].start_s == pytest.approx(max(root.ready_s + ci_layer,
                                                        est.buckets[-3].start_s + est.buckets[-3].time_s))
    assert root.start_s == pytest.approx(max(root.ready_s + ci_layer + ci_root,
                                             est.buckets[-2].start_s + est.buckets[-2].time_s))
    assert opt[1] == pytest.approx(root.start_s + root.time_s)
    assert est.exposed_s["gradient_buckets"] == pytest.approx(root.start_s + root.time_s - root.ready_s
                                                              - ci_layer - ci_root)


def test_fsdp2_copies_run_on_the_compute_stream() -> None:
    """FSDP2 (torch/distributed/_composable/fsdp/_fsdp_collectives.py, pytorch 415cc26): each
    gathered unit's copy-out (split_with_sizes_copy of the gathered buffer into the unsharded
    parameters: bf16 read and written) and each reduce-scatter's copy-in (_chunk_cat of the bf16
    gradients into the fp32 reduce-scatter input) on the compute stream, at the HBM rate; none
    under Megatron. torchtitan reduce-scatters in every micro-step (no set_requires_gradient_sync):
    under gradient accumulation each micro-step copies out and in alike."""
    plan, dev = _plan("torchtitan")
    with_copies = estimate_step(plan, dev, 8 * 4096)
    rate = dev.hbm_rate
    # gathered: the root (2 x EMB + NORM) once, layer 0 and layer 1 forward, layer 0 backward
    out = 2 * 2 * ((2 * EMB + NORM) + 3 * LAYER) / rate
    # reduce-scattered: layer 1, layer 0, the root, each read in bf16 and written in fp32
    into = (2 + 4) * (2 * LAYER + 2 * EMB + NORM) / rate
    fwd_out = 2 * 2 * ((2 * EMB + NORM) + 2 * LAYER) / rate
    base = step_compute(plan, dev).by_phase
    assert with_copies.compute_s["forward"] == pytest.approx(base["forward"] + fwd_out)
    assert with_copies.compute_s["backward"] - base["backward"] == pytest.approx(out - fwd_out + into)
    three = estimate_step(replace(plan, grad_accum=3), dev, 8 * 4096)
    assert three.compute_s["backward"] == pytest.approx(3 * with_copies.compute_s["backward"])
    mega, _ = _plan("megatron")
    assert estimate_step(mega, dev, 8 * 4096).compute_s == pytest.approx(step_compute(mega, dev).by_phase)


def test_a_tied_embedding_is_gathered_and_reduced_once_in_the_root() -> None:
    dev = preset_device("h100")
    _, plan, _ = plan_model('{"base": "llama-7b", "layers": 2, "tied_embeddings": true}', "dp=8", "zero3")
    plan = replace(recost(plan, cost_model(plan.mesh, dev)), runtime=Runtime(framework="torchtitan"))
    units = torchtitan_units(plan, communication(plan, step_compute(plan, dev), dev))
    assert units[0] == (pytest.approx(_ag(EMB + NORM)), 0)  # the table once, with the final norm
    root = estimate_step(plan, dev, 8 * 4096).buckets[-1]
    assert (root.tensors, root.bytes) == (2, 4 * (EMB + NORM))
