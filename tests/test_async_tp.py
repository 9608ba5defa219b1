"""torch's async TP as its sources run it (spmdkit.cost.async_tp): the two-stream pipelines of
torch/distributed/_symmetric_memory timed by hand, and which collectives torch.compile's
micro-pipeline TP pass fuses in a torchtitan block (forward all-gather into q / k / v, the
reduce-scatter of one matmul's output; not the backward's sum of input gradients, not the head)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spmdkit.cost import step as st
from spmdkit.cost.async_tp import (
    all_gather_matmul_s,
    fused_exposed,
    fused_window,
    matmul_reduce_scatter_s,
    reduce_partials_s,
)
from spmdkit.cost.devices import DEVICES, cost_model, recost
from spmdkit.cost.step_comm import communication
from spmdkit.cost.step_compute import step_compute
from spmdkit.planner.planning import plan_model
from spmdkit.program.runtime import Runtime

H100 = DEVICES["h100"]


def test_all_gather_matmul_pipeline_by_hand() -> None:
    # 4 ranks, copies of 1 s (comm 3 s), GEMM chunks of 2 s: local GEMM [0, 2]; copy 1 [0, 1], GEMM 1
    # [2, 4]; copy 2 after GEMM 0 [2, 3], GEMM 2 [4, 6]; copy 3 after GEMM 1 [4, 5], GEMM 3 [6, 8]
    assert all_gather_matmul_s(3.0, 2.0, 4) == pytest.approx(8.0)  # the GEMMs' 8 s: every copy hidden
    # copies of 3 s, GEMM chunks of 1 s: copies back to back [0, 3], [3, 6], [6, 9]; the last GEMM [9, 10]
    assert all_gather_matmul_s(9.0, 1.0, 4) == pytest.approx(10.0)
    assert all_gather_matmul_s(5.0, 1.0, 1) == pytest.approx(1.0)  # one rank: no copy


def test_matmul_reduce_scatter_pipeline_by_hand() -> None:
    # 4 ranks, copies of 1 s, GEMM chunks of 2 s: GEMM 1 [0, 2] copy [2, 3]; GEMM 2 [2, 4] copy [4, 5];
    # GEMM 3 [4, 6] copy [6, 7]; the local chunk after GEMM 3 and copy 2: [6, 8]
    assert matmul_reduce_scatter_s(3.0, 2.0, 4) == pytest.approx(8.0)
    # copies of 3 s, GEMMs of 1 s: GEMM 1 [0, 1] copy [1, 4]; GEMM 2 [1, 2] copy [4, 7]; GEMM 3 waits for
    # copy 1 on its stream [4, 5], copy [7, 10]; the local chunk [7, 8]: the last copy ends at 10
    assert matmul_reduce_scatter_s(9.0, 1.0, 4) == pytest.approx(10.0)
    # 2 ranks: GEMM 1 [0, 1], its copy [1, 3]; the local chunk [1, 2]
    assert matmul_reduce_scatter_s(2.0, 1.0, 2) == pytest.approx(3.0)


def test_fused_exposure_adds_the_chunks_and_the_partials_reduction() -> None:
    # GEMMs of 8 s unsplit, 8.4 s as 4 chunks; comm 3 s hidden: 0.4 s of smaller GEMMs, + 0.5 s of reduction
    assert fused_exposed("all_gather", 3.0, 8.0, 8.4, 4) == pytest.approx(0.4)
    assert fused_exposed("reduce_scatter", 3.0, 8.0, 8.4, 4, 0.5) == pytest.approx(0.9)
    # the reduction reads the n stacked partials and writes one: 1 GB x (1 + 1/4) at the achievable HBM rate
    assert reduce_partials_s(H100, 1e9, 4) == pytest.approx(1.25e9 / H100.hbm_rate)
    # a GEMM split into 8 row chunks runs each at its smaller shape's rate: never faster in sum
    plan, comp, _ = _comm(Runtime(framework="torchtitan", tp_comm_overlap=True))
    q = next(i for i, op in enumerate(plan.program.ops) if op.name == "layers.0.q")
    norm = next(i for i, op in enumerate(plan.program.ops) if op.name == "layers.0.attn_norm.out")
    producer = {n: i for i, op in enumerate(plan.program.ops) for n in op.output_names()}
    readers: dict[str, list[int]] = {}
    for j, op in enumerate(plan.program.ops):
        for n in op.input_names():
            readers.setdefault(n, []).append(j)
    win = fused_window(plan, comp.costs, comp.times, H100, norm, "layers.0.attn_norm.out", "all_gather",
                       producer, readers, 4)
    assert win is not None
    qkv = [i for i, op in enumerate(plan.program.ops) if op.name in ("layers.0.q", "layers.0.k", "layers.0.v")]
    assert q in qkv and win[0] == pytest.approx(sum(comp.times[i] for i in qkv))  # one AG feeds q, k and v
    assert win[1] >= win[0]


def _comm(rt: Runtime):  # type: ignore[no-untyped-def]
    _, plan, _ = plan_model("llama-7b", "tp=4", "megatron,sp", {"layers": 1, "seq": 2048, "batch": 1})
    plan = replace(recost(plan, cost_model(plan.mesh, H100)), runtime=rt)
    comp = step_compute(plan, H100)
    return plan, comp, communication(plan, comp, H100)


def _where(plan, ids) -> set[str]:  # type: ignore[no-untyped-def]
    return {f"{plan.program.ops[i].phase}:{plan.program.ops[i].name}" for i in ids}


def test_which_collectives_torch_fuses() -> None:
    plan, _, comm = _comm(Runtime(framework="torchtitan", tp_comm_overlap=True))
    fused = _where(plan, comm.fused)
    # forward: the norms' all-gathers into q / k / v and gate / up, the reduce-scatters of o and down
    assert {"forward:layers.0.attn_norm.out", "forward:layers.0.attn_out", "forward:layers.0.mlp_norm.out",
            "forward:layers.0.mlp_out"} <= fused
    # backward: the all-gathered output gradients of o and down feed their dgrad GEMMs
    assert {"backward:grad of layers.0.resid1", "backward:grad of layers.0.resid2"} <= fused
    # the input gradients summed over q / k / v (and gate / up) are no one matmul's output: NCCL's
    blocking = _where(plan, [i for i, t in comm.blocking.items() if t > 0])
    assert "backward:grad of layers.0.attn_norm.out" in blocking
    assert "backward:grad of layers.0.mlp_norm.out" in blocking
    # the head and the embedding are not compiled: their collectives stay NCCL's
    assert not any("final_norm" in w or "embed" in w or "logits" in w for w in fused)
    assert not comm.tp  # the Megatron decomposition is not used
    # under torchao's float8 the output gradient is cast to e5m2 on its shard before the gather
    # (Float8RowwiseParallel: NoopFwToFloat8BwDynamic after the redistribute), and the gathered float8
    # dY feeds its dgrad _scaled_mm: fused as under bf16
    plan8, _, comm8 = _comm(Runtime(framework="torchtitan", tp_comm_overlap=True, precision="fp8"))
    fused8 = _where(plan8, comm8.fused)
    assert "forward:layers.0.attn_out" in fused8
    assert {"backward:grad of layers.0.resid1", "backward:grad of layers.0.resid2"} <= fused8


def test_async_tp_hides_what_the_fused_ops_hide() -> None:
    plan, _, _ = _comm(Runtime(framework="torchtitan"))
    off, on = replace(plan, runtime=Runtime(framework="torchtitan")), \
        replace(plan, runtime=Runtime(framework="torchtitan", tp_comm_overlap=True))
    oc_off, oc_on = st.op_communication(off, H100), st.op_communication(on, H100)
    e_off, e_on = st.estimate_step(off, H100, 2048), st.estimate_step(on, H100, 2048)
    hidden = sum(oc_off.wait) - sum(oc_on.wait)
    assert hidden > 0
    assert e_off.step_overlap_s - e_on.step_overlap_s == pytest.approx(hidden, rel=1e-6)
    # the summed input gradients' reduce-scatters wait as long as without async TP
    ops = plan.program.ops
    for i, op in enumerate(ops):
        if op.phase == "backward" and op.name in ("grad of layers.0.attn_norm.out", "grad of layers.0.mlp_norm.out"):
            assert oc_on.wait[i] == pytest.approx(oc_off.wait[i]) and oc_on.wait[i] > 0


def test_async_tp_without_compile_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # torchtitan (820504e parallelize_llama) raises 'Async TP requires --training.compile'; plan priced it eager
    from spmdkit.cli import main

    argv = ["plan", "--model", "tiny-llama", "--mesh", "dp=2,tp=2", "--strategy", "megatron,sp", "--device", "h100",
            "--framework", "torchtitan", "--tp-comm-overlap"]
    for extra in ([], ["--no-compile"], ["--devices", "4"]):
        args = [a for a in argv if not (extra[:1] == ["--devices"] and a in ("--mesh", "dp=2,tp=2"))] + extra
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.strip() == ("spmdkit plan: ProgramError: --tp-comm-overlap with --framework torchtitan: torch's "
                               "async TP runs only compiled (torchtitan raises 'Async TP requires "
                               "--training.compile'); give --compile too"), err
    assert main([*argv, "--compile"]) == 0
