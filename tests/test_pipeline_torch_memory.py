"""A torchtitan pipeline rank's memory as torch.distributed.pipelining and FSDP2 hold it
(spmdkit.planner.pipeline_memory), and torch context_parallel's all-gather buffers
(spmdkit.cost.memory_cp): the schedules' unit orders, the walk, and their bytes by hand."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from spmdkit.cost import memory as mem
from spmdkit.cost.devices import preset_device
from spmdkit.cost.memory_cp import allgather_buffers, shared_gathers, torch_allgather_bytes
from spmdkit.cost.memory_saved import rerun_points, saved_activations
from spmdkit.planner.pipeline import estimate_pipeline
from spmdkit.planner.pipeline_memory import ChunkBytes, torch_order, torch_rank_memory
from spmdkit.planner.pipeline_plan import plan_pipeline
from spmdkit.planner.planning import plan_model
from spmdkit.program.runtime import Runtime


def _names(order: list[tuple[str, int, int]]) -> list[str]:
    return [f"{k}{c}.{j}" for k, c, j in order]


def test_schedule1f1b_warms_up_p_minus_r_forwards() -> None:
    # torch's Schedule1F1B: min(m, p - r) forwards, then a backward and a forward, then the backwards
    assert _names(torch_order("1f1b", 4, 1, 4, 0)) == ["F0.0", "F0.1", "F0.2", "F0.3", "B0.0", "B0.1", "B0.2", "B0.3"]
    assert _names(torch_order("1f1b", 4, 1, 4, 2)) == ["F0.0", "F0.1", "B0.0", "F0.2", "B0.1", "F0.3", "B0.2", "B0.3"]
    assert _names(torch_order("1f1b", 4, 1, 4, 3)) == ["F0.0", "B0.0", "F0.1", "B0.1", "F0.2", "B0.2", "F0.3", "B0.3"]
    assert _names(torch_order("gpipe", 4, 1, 2, 1)) == ["F0.0", "F0.1", "B0.0", "B0.1"]
    assert torch_order("zb-h1", 4, 1, 4, 0) is None


def test_interleaved_1f1b_rounds_of_microbatches() -> None:
    # p = 2, v = 2, m = 4: 2 rounds of 2 microbatches; rank 0 warms up min((v-1) 2 + 2 (p-1-0), 8) = 4
    # forwards (2 on its first stage, 2 on its second), then F and B (the backwards from its last
    # stage down, a round at a time), then the rest of the backwards
    assert _names(torch_order("interleaved", 2, 2, 4, 0)) == [
        "F0.0", "F0.1", "F1.0", "F1.1",
        "F0.2", "B1.0", "F0.3", "B1.1", "F1.2", "B0.0", "F1.3", "B0.1",
        "B1.2", "B1.3", "B0.2", "B0.3"]
    # rank 1: min(2 + 0, 8) = 2 forwards
    assert _names(torch_order("interleaved", 2, 2, 4, 1))[:4] == ["F0.0", "F0.1", "F1.0", "B1.0"]
    # 6 microbatches over p = 4: one round (6 // 4 = 1) of 6; 5 over 2 rounds does not divide
    assert len(torch_order("interleaved", 4, 2, 6, 0)) == 24
    assert torch_order("interleaved", 2, 2, 5, 0) is None


def _chunk(**kw: int) -> ChunkBytes:
    base = {"stash": 10, "working": 30, "parameters": 100, "states": 200, "gradients": 5,
            "unsharded_parameters": 50, "unsharded_gradients": 80, "input_bytes": 0, "output_bytes": 4,
            "grad_recv_bytes": 4}
    return ChunkBytes(**{**base, **kw})


def test_walk_of_a_first_stage_by_hand() -> None:
    # F0 F1 B0 B1 (p = 2, r = 0, m = 2); receive buffers 2 x (0 + 4) = 8 throughout
    # F0: 100 + 50 gathered, no gradient, 200, working 30, buffers 8           = 388
    # F1: + the stash of F0 (10), + F0's output (4)                             = 402
    # B0: + the unsharded gradients (80), F1's output (4), the stash of F1      = 486
    # B1: the stash of B0 gone                                                  = 476
    peak = torch_rank_memory([_chunk()], torch_order("1f1b", 2, 1, 2, 0), 2)
    assert peak.unit == ("B", 0, 0)
    assert (peak.parameters, peak.gradients, peak.optimizer_states) == (150, 80, 200)
    assert (peak.activations, peak.buffers) == (30 + 10 + 16, 16)
    assert peak.parameters + peak.gradients + peak.optimizer_states + peak.activations == 486
    assert peak.in_flight == 2


def test_walk_frees_a_stage_after_its_last_backward() -> None:
    # two stages, one microbatch: F0 F1 B1 B0. At B0 stage 1 is done: its gradients are reduce-
    # scattered (sharded 5 held, unsharded 80 freed) and its parameters resharded (50 freed);
    # its input gradient (7) stays in its receive buffer's .grad until the next step
    a = _chunk(working=30, output_bytes=3, grad_recv_bytes=3)
    b = _chunk(working=60, input_bytes=7, output_bytes=9, grad_recv_bytes=0)
    order = [("F", 0, 0), ("F", 1, 0), ("B", 1, 0), ("B", 0, 0)]
    peak = torch_rank_memory([a, b], order, 1)
    # receive buffers: 1 x (0 + 3) + 1 x (7 + 0) = 10
    # B1: params 200 + 100, gradients 80 + 80... stage 0 has not started its backward: 80 only;
    #     working 60 + the stash of F0 (10); buffers 10 + outputs 3 + 9              = 300+80+400+70+22 = 872
    # B0: params 200 + 50, gradients 80 + 5, working 30; buffers 10 + 3 + 9 + 7     = 250+85+400+30+29 = 794
    assert peak.unit == ("B", 1, 0)
    assert peak.parameters + peak.gradients + peak.optimizer_states + peak.activations == 872
    assert (peak.gradients, peak.buffers) == (80, 22)


def test_walk_without_fsdp_holds_the_gradients_allocated_from_the_first_backward() -> None:
    # a stage not sharded by FSDP2 (torchtitan's DDP, or no data parallelism): autograd accumulates its
    # gradients in place (param.grad) from its first backward; they were counted as FSDP2's reduce-scatter
    # pool (reserved, not allocated), so such a rank's breakdown said 'gradients 0 B'
    # F0 F1 B0 B1 (p = 2, r = 0, m = 2): receive buffers 8; at B0 (the peak): params 100, gradients 5,
    # states 200, working 30 + F1's stash 10 + outputs 8 + buffers 8
    plain = _chunk(unsharded_parameters=0, unsharded_gradients=0, fsdp=False)
    peak = torch_rank_memory([plain], torch_order("1f1b", 2, 1, 2, 0), 2)
    assert peak.unit == ("B", 0, 0)
    assert (peak.parameters, peak.gradients, peak.optimizer_states, peak.pools) == (100, 5, 200, 0)
    assert peak.activations == 30 + 10 + 16
    # at F1 (before any backward) none is held: set to None by zero_grad
    early = torch_rank_memory([plain], [("F", 0, 0), ("F", 0, 1)], 2)
    assert early.gradients == 0


def test_torchtitan_pipeline_without_fsdp_counts_its_gradients() -> None:
    pp = plan_pipeline("tiny-llama", "pp=2,dp=2", "dp", {"microbatches": 4, "schedule": "1f1b"},
                       {"layers": 4, "batch": 8})
    _model, plan, spec, counts, _ = pp
    est = estimate_pipeline(replace(plan, runtime=Runtime(framework="torchtitan")), spec, counts,
                            preset_device("h100"))
    for r, st in enumerate(est.stages):
        assert st.gradients > 0 and st.unsharded_gradients == 0
        assert est.memory[r].gradients == st.gradients  # fp32 gradients, 4 bytes a parameter element
        assert st.gradients == st.parameters  # (torchtitan: fp32 parameters and gradients)


def _tiny_titan(schedule: str, v: int | None = None) -> Any:
    pp = plan_pipeline("tiny-llama", "pp=2,dp=2", "dp,zero3", {"microbatches": 4, "schedule": schedule,
                                                                 "virtual": v}, {"layers": 4, "batch": 8})
    _model, plan, spec, counts, _ = pp
    return replace(plan, runtime=Runtime(framework="torchtitan")), spec, counts


def test_torchtitan_pipeline_rank_memory_from_its_stages() -> None:
    plan, spec, counts = _tiny_titan("1f1b")
    est = estimate_pipeline(plan, spec, counts, preset_device("h100"))
    s0, s1 = est.stages
    # rank 0 (stage 0; p = 2: F0 F1 B0 F2 B1 F3 B2 B3): its fullest unit is B2 (B0, B1 and F2 hold one
    # other microbatch's stash too, but fewer outputs): its gathered parameters, its unsharded
    # gradients and no sharded one, F3's stash, its grad-receive buffers (4 x the bytes it sends) and
    # its 4 outputs kept in output_chunks
    r0 = est.memory[0]
    assert r0.parameters == s0.parameters + s0.unsharded_parameters
    # and the last block's reduce-scatter input of the previous step (torch 1963fc8, before #144535)
    assert r0.gradients == s0.unsharded_gradients + s0.rs_held
    assert r0.activation_peak == s0.working_peak + s0.stash_bytes + 4 * s0.send_bytes + 4 * s0.send_bytes
    assert est.in_flight[0] == 2
    # rank 1 (the last stage, 1 warm-up forward): its inputs live in its 4 receive buffers (out of its
    # stash and working peak); the peak at its last backward holds 4 outputs (the logits) and 3 input
    # gradients in the receive buffers' .grad
    got = s0.send_bytes
    logits = 2 * sum(e for _, _, e in mem.loss_spans(plan))
    r1 = est.memory[1]
    assert r1.activation_peak == (s1.working_peak - got) + 4 * got + 4 * logits + 3 * got
    # megatron keeps its own rank memory (Megatron-LM's schedules, not torch's)
    mega = estimate_pipeline(replace(plan, runtime=Runtime()), spec, counts, preset_device("h100"))
    m0 = mega.stages[0]
    assert mega.memory[0].gradients == m0.gradients + m0.unsharded_gradients
    assert mega.memory[0].activation_peak == m0.working_peak + (2 - 1) * m0.stash_bytes  # min(p - r, m) = 2


def test_interleaved_walk_by_hand() -> None:
    # rank 0 of p = 2, v = 2, m = 4 (local stage 0 = stage 0, local 1 = stage 2); each stage: stash 10,
    # working 30, parameters 100 + 50 gathered, states 200, gradients 80 unsharded / 5 sharded; receive
    # buffers 4 x (0 + 4) + 4 x (4 + 4) = 48. The stash grows to 5 microbatches by F0.2; B1.0 starts
    # stage 2's gradients (80), B0.0 stage 0's (160); at B0.1: parameters 200 + 100, gradients 160,
    # states 400, working 30 + 4 others' stash 40, buffers 48 + 8 outputs x 4 + 2 input grads x 4 = 88
    a = _chunk(input_bytes=0)
    b = _chunk(input_bytes=4)
    peak = torch_rank_memory([a, b], torch_order("interleaved", 2, 2, 4, 0), 4)
    assert peak.unit == ("B", 0, 1)
    assert (peak.parameters, peak.gradients, peak.optimizer_states, peak.buffers) == (300, 160, 400, 88)
    assert peak.activations == 30 + 40 + 88 and peak.in_flight == 5 / 2
    # the 1F1B of one stage of both (m = 4, 4 warm-up forwards on rank 0 of p = 4) holds its whole
    # gradients with 3 others' stash at its first backward
    one = _chunk(stash=20, working=60, parameters=200, states=400, gradients=10, unsharded_parameters=100,
                 unsharded_gradients=160, input_bytes=0, output_bytes=4, grad_recv_bytes=4)
    first = torch_rank_memory([one], torch_order("1f1b", 4, 1, 4, 0), 4)
    assert first.unit == ("B", 0, 0) and first.gradients == 160
    assert first.activations == 60 + 3 * 20 + 16 + 16


def test_torch_allgather_bytes_by_hand() -> None:
    # local q 128, k = v = 8 (one KV head), repeat_kv 16: K + V = 256; cp = 8
    # forward: contiguous copies 256 + the rotater's cat 256 + gathered 8 x 256 + fp32 out 256 + a step's out 128
    assert torch_allgather_bytes(128, 8, 8, 16, 8, False) == 256 + 256 + 2048 + 256 + 128
    # backward: the same three 2560 + fp32 dQ 256 + fp32 dK / dV sent and received 2 x 512 + a step's grads 128 + 256
    assert torch_allgather_bytes(128, 8, 8, 16, 8, True) == 2560 + 256 + 1024 + 128 + 256


def test_allgather_buffers_on_a_cp_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    small = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "ffn": 256, "vocab": 4096, "seq": 64, "batch": 1}
    plan = plan_model("llama-7b", "cp=2", "cp", small)[1]
    assert allgather_buffers(plan) == {}  # megatron: Transformer Engine's all-gather, not torch's
    titan = replace(plan, runtime=Runtime(framework="torchtitan"))
    got = allgather_buffers(titan)
    ops = titan.program.ops
    assert len(got) == 4 and {ops[i].phase for i in got} == {"forward", "backward"}
    # local q: 1 x 32 x 4 x 32 x 2 bytes = 8192; k = v: 1 x 32 x 2 x 32 x 2 = 4096; repeat_kv 2: K + V = 16384
    q, k = 8192, 4096
    for i, size in got.items():
        assert size == torch_allgather_bytes(q, k, k, 2, 2, ops[i].phase == "backward") - 2 * (k + k)
    fwd = next(s for i, s in got.items() if ops[i].phase == "forward")
    assert fwd == 16384 + 16384 + 2 * 16384 + 3 * q - 4 * k
    # they raise the curve at their ops by that much, and nowhere else
    with_torch = mem.memory_per_device(titan, "none").curve
    monkeypatch.setattr(mem, "allgather_buffers", lambda plan, shared=None: {})
    base = mem.memory_per_device(titan, "none").curve
    assert [a - b for a, b in zip(with_torch, base)] == [got.get(j, 0) for j in range(len(base))]



def test_compiled_grad_shares_the_recomputed_forward_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchtitan --compile, full recomputation: AOTAutograd's CSE makes the grad's gathered K / V
    # and contiguous copies the recomputed forward's, held from the layer's rerun to the grad
    small = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "ffn": 256, "vocab": 4096, "seq": 64, "batch": 1}
    plan = plan_model("llama-7b", "cp=2", "cp", small)[1]
    eager = replace(plan, runtime=Runtime(framework="torchtitan"))
    titan = replace(plan, runtime=Runtime(framework="torchtitan", compile=True))
    saved = saved_activations(titan, "full")
    rerun = rerun_points(titan, saved)[0]
    assert shared_gathers(eager, rerun) == {}  # eager: the recomputation's gather is freed, the grad gathers again
    assert shared_gathers(titan, rerun_points(titan, saved_activations(titan, "none"))[0]) == {}
    got = shared_gathers(titan, rerun)
    ops = titan.program.ops
    assert len(got) == 2 and all(ops[i].rule == "cp_attention_grad" for i in got)
    kv = 16384  # repeated local K + V: 2 x (1 x 32 x 4 x 32) x 2 bytes
    for i, (a, size) in got.items():
        assert size == (2 + 1) * kv  # the gathered buffer of cp = 2 and the contiguous copies
        # from where the layer runs again (its forward attention with it), before its MLP's grads
        assert any(ops[f].rule == "cp_attention" and ops[f].layer == ops[i].layer for f in rerun[a])
        assert a < min(j for j, op in enumerate(ops) if op.rule == "swiglu_grad" and op.layer == ops[i].layer) < i
    # the grad's own buffers lose the cat, the copies and the gathered buffer: (cp + 2) x K + V
    own = allgather_buffers(titan, got)
    for i in got:
        assert own[i] == torch_allgather_bytes(8192, 4096, 4096, 2, 2, True) - 4 * kv - 2 * 8192 == 90112
    with_shared = mem.memory_per_device(titan, "full").curve
    monkeypatch.setattr(mem, "shared_gathers", lambda plan, rerun: {})
    base = mem.memory_per_device(titan, "full").curve
    want = [0] * len(base)
    for i, (a, size) in got.items():
        for j in range(a, i + 1):
            want[j] += size
        want[i] -= 4 * kv
    assert [x - y for x, y in zip(with_shared, base)] == want


def test_the_last_reduce_scatter_input_is_held_at_every_unit() -> None:
    # torch 1963fc8's run_post_backward (stage.py) calls each group's post_backward but not
    # _root_post_backward_final_callback (pytorch/pytorch#144535, 2025-01, added it), and only that
    # callback frees the last group's reduce-scatter input (FSDPCommContext.reduce_scatter_state):
    # it is held from the stage's last backward to the next step's, so at every unit of the walk
    # F0 F1 B0 B1 of the first-stage example above (486 at B0) with 7 bytes held: 493, 7 of them
    # gradients already at F0; two chunks hold one each (each model chunk is a root)
    order = torch_order("1f1b", 2, 1, 2, 0)
    peak = torch_rank_memory([_chunk(rs_held=7)], order, 2)
    assert peak.unit == ("B", 0, 0) and peak.gradients == 80 + 7
    assert peak.parameters + peak.gradients + peak.optimizer_states + peak.activations == 493
    first = torch_rank_memory([_chunk(rs_held=7)], order[:1], 2)
    assert first.gradients == 7
    two = torch_rank_memory([_chunk(rs_held=7), _chunk(input_bytes=4, rs_held=9)],
                            torch_order("interleaved", 2, 2, 4, 0), 4)
    assert two.gradients == 160 + 7 + 9


def test_the_held_reduce_scatter_input_is_the_last_blocks_fp32_gradients() -> None:
    # tiny-llama (h 16, 4 heads of 4, 2 kv heads, ffn 32): a block's parameters are wq 16x16, wk and wv
    # 16x8, wo 16x16, w1 w2 w3 16x32 and two norms of 16: 256 + 128 + 128 + 256 + 3 x 512 + 32 = 2336
    # elements, gathered whole on dp = 2; the reduce-scatter input is their gradients in the fp32
    # reduce dtype, flat: 4 x 2336 bytes. Stage 0 holds layers 0-1 (the last, layer 1, after the
    # root group in named_modules() order), stage 1 layers 2-3 with the final norm and the head (root)
    plan, spec, counts = _tiny_titan("1f1b")
    est = estimate_pipeline(plan, spec, counts, preset_device("h100"))
    assert [s.rs_held for s in est.stages] == [4 * 2336, 4 * 2336]
    assert est.memory[1].gradients >= est.stages[1].unsharded_gradients + 4 * 2336
    # AutoModel's torch has pytorch/pytorch#144535: nothing held
    auto = estimate_pipeline(replace(plan, runtime=Runtime(framework="automodel")), spec, counts,
                             preset_device("h100"))
    assert [s.rs_held for s in auto.stages] == [0, 0]
