"""What Megatron-LM / NeMo runs beyond the layers' GEMMs: the vocab-parallel cross-entropy over
fp32 logits (spmdkit.cost.loss: its passes counted by hand, fused and unfused), the sequence-parallel
re-gather of a linear layer's input overlapped with its dgrad GEMM (spmdkit.cost.step.dgrad_time),
and NeMo 24.07's recipes as its launcher configs set them (benchmarks/fidelity.py)."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from conftest import load_script
from spmdkit.cli import main
from spmdkit.cost import step as st
from spmdkit.cost.compute import op_cost
from spmdkit.cost.devices import DEVICES, cost_model, recost
from spmdkit.cost.loss import MEGATRON_CE
from spmdkit.cost.step_comm import UB_COMM_SMS, communication, overlap_exposed, tp_overlap_exposed, ub_sm_tax
from spmdkit.cost.step_compute import step_compute
from spmdkit.engine.facts import OpCost
from spmdkit.planner.planning import plan_model
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import Runtime

H100 = DEVICES["h100"]
ROOT = Path(__file__).resolve().parents[1]


def _loss_plan() -> tuple[Plan, int, int, int]:
    """llama-7b's head and loss at vocab 1024, 2 x 128 tokens, tp=2: (plan, loss op, its grad, local
    logit elements: 2 x 128 x 512)."""
    _, plan, _ = plan_model("llama-7b", "tp=2", "megatron", {"layers": 1, "seq": 128, "batch": 2, "vocab": 1024})
    ops = plan.program.ops
    fwd = next(i for i, op in enumerate(ops) if op.rule == "c_softmax_with_cross_entropy")
    bwd = next(i for i, op in enumerate(ops) if op.rule == "c_softmax_with_cross_entropy_grad")
    return plan, fwd, bwd, 2 * 128 * 512


def test_megatron_cross_entropy_passes_by_hand() -> None:
    # Megatron-Core's vocab_parallel_cross_entropy on bf16 logits, per local logit element: forward
    # .float() 2+4, max 4, -= 4+4, exp 4+4, sum 4, div_ 4+4 = 38; backward mul_ 4+4, cast to bf16 4+2 = 14
    assert MEGATRON_CE[False][0] == (2 + 4 + 4 + 8 + 8 + 4 + 8, 8 + 6)
    # fused (torch.compile'd pieces): float+max 2+4, sub+exp 4+4, sum 4, div 4+4 = 26; scale+cast 4+4+2 = 10
    assert MEGATRON_CE[True][0] == (6 + 8 + 4 + 8, 10)
    plan, fwd, bwd, elems = _loss_plan()
    unfused = replace(plan, runtime=Runtime(framework="megatron"))
    fused = replace(plan, runtime=Runtime(framework="megatron", ce_fusion=True))
    assert op_cost(unfused, fwd).bytes == 38 * elems and op_cost(unfused, bwd).bytes == 14 * elems
    assert op_cost(fused, fwd).bytes == 26 * elems and op_cost(fused, bwd).bytes == 10 * elems
    # AutoModel's loss on the bf16 logits keeps the op family's one pass: logits read, softmax written (+ labels)
    am = replace(plan, runtime=Runtime(framework="automodel"))
    assert 4 * elems <= op_cost(am, fwd).bytes < 5 * elems
    # on the device: at this size its six kernels' launch floor (6 x 4 us), not its bytes at 3.015 TB/s
    assert 38 * elems / (3.35e12 * 0.90) < 24e-6
    assert H100.op_time(op_cost(unfused, fwd)) == pytest.approx(6 * 4e-6)
    assert H100.op_time(op_cost(fused, bwd)) == pytest.approx(1 * 4e-6)


def test_the_loss_weighs_with_the_vocabulary_in_the_step() -> None:
    # Megatron-LM's 1.7B of 2024 (h 2048, vocab 131072, 4096 tokens): the unfused loss moves
    # 52 x 4096 x 131072 bytes = 27.9 GB a micro-step, 9.3 ms at 3.015 TB/s
    cfg = {"name": "g", "arch": "gpt2", "activation": "gelu", "attention": "flash", "layers": 1, "hidden": 2048,
           "heads": 16, "ffn": 8192, "vocab": 131072, "seq": 4096, "batch": 1, "dtype": "bf16"}
    out: dict[str, float] = {}
    for flag in ([], ["--cross-entropy-fusion"]):
        argv = ["plan", "--mesh", "dp=1", "--strategy", "dp", "--device", "h100", "--precision", "bf16",
                "--framework", "megatron", "--json", "--model-config", json.dumps(cfg), *flag]
        import contextlib
        import io
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(argv) == 0
        d = json.loads(buf.getvalue())
        out[" ".join(flag)] = d["step"]["compute_total_s"]
    elems = 4096 * 131072
    assert out[""] - out["--cross-entropy-fusion"] == pytest.approx((52 - 36) * elems / 3.015e12, rel=1e-3)


def test_dgrad_time_is_the_input_gradient_gemm_share() -> None:
    # a matmul grad's dx (4096 x 1024 x 4096) and dw (1024 x 4096 x 4096): equal FLOPs, half the op's time
    c = OpCost(4.0 * 4096 * 1024 * 4096, 0, 0, True, "bfloat16",
               gemms=((1, 4096, 4096, 1024), (1, 1024, 4096, 4096)))
    assert st.dgrad_time(c, 2e-3) == pytest.approx(1e-3)
    lop = replace(c, gemms=((1, 4096, 4096, 1024), (1, 4096, 4096, 3072)))  # dw three times dx
    assert st.dgrad_time(lop, 2e-3) == pytest.approx(0.5e-3)
    assert st.dgrad_time(OpCost(1.0, 1.0, 8.0), 1e-3) == 0.0  # not a GEMM


def test_sequence_parallel_regather_hides_under_the_dgrad_gemm() -> None:
    _, plan, _ = plan_model("llama-7b", "tp=8", "megatron,sp", {"layers": 1, "seq": 2048, "batch": 1})
    plan = recost(plan, cost_model(plan.mesh, H100))
    got: dict[str, dict[int, float]] = {}
    for fw in ("megatron", "torchtitan"):
        p = replace(plan, runtime=Runtime(framework=fw))
        comp = step_compute(p, H100)
        comm = communication(p, comp, H100)
        got[fw] = st._rerun(p, "none", comp, comm, {}).extra_at
    from spmdkit.cost.memory_saved import rerun_points, saved_activations
    _, regather = rerun_points(plan, saved_activations(plan, "none"))
    assert regather and set(got["megatron"]) == set(regather)
    comp = step_compute(replace(plan, runtime=Runtime(framework="megatron")), H100)
    for at, ks in regather.items():
        secs = sum(plan.reshards[k].plan.time_s for k in ks)
        assert got["torchtitan"][at] == pytest.approx(secs)  # no such overlap: the gather blocks
        assert got["megatron"][at] == pytest.approx(max(0.0, secs - st.dgrad_time(comp.costs[at], comp.times[at])))
        assert got["megatron"][at] < secs


# -- NeMo 24.07's recipes (benchmarks/fidelity.py) -----------------------------------------------------


def _bench() -> ModuleType:
    return load_script("fidelity_bench_mc", ROOT / "benchmarks" / "fidelity.py")


def test_nemo_runs_take_their_launcher_config(tmp_path: Path) -> None:
    fid = _bench()
    rows: dict[str, dict[str, Any]] = {r["id"]: r for r in json.loads(fid.RUNS.read_text())}
    nemo = [k for k in rows if k.startswith("nemo2407")]
    # every NeMo run has its model's launcher config
    assert all(fid.nemo_launcher(rows[k], []) is not None for k in nemo)
    case = fid.express(rows["nemo2407_h100_fp8_llama3_70b_64gpu"], tmp_path)
    assert "--tp-comm-overlap" in case.argv and "--cross-entropy-fusion" in case.argv  # ub_tp_comm_overlap: true
    case = fid.express(rows["nemo2407_h100_fp8_gpt3_5b_64gpu"], tmp_path)
    cfg = json.loads(case.argv[case.argv.index("--model-config") + 1])
    assert cfg["dropout"] == 0.1 and "--cross-entropy-fusion" not in case.argv  # hidden/attention_dropout 0.1
    case = fid.express(rows["nemo2407_h100_fp8_llama2_7b_8gpu"], tmp_path)  # tp=1: nothing to overlap
    assert "--tp-comm-overlap" not in case.argv and "dropout" not in json.loads(case.argv[-1])
    assert fid.nemo_launcher(rows["megatronlm_h100_2024_1.7b"], []) is None


def test_nemo_gpt3_175b_runs_take_their_own_launcher_configs(tmp_path: Path) -> None:
    # the 512-GPU run (GBS 2048, MBS 2) is gpt3/175b_mlperf.yaml: userbuffers TP overlap, dropout 0.0;
    # the 128-GPU run (GBS 256, MBS 1) is examples/training/gpt/h100/175b_fp8_16node.sh over gpt3/175b
    # (ub_tp_comm_overlap false, dropout 0.1)
    fid = _bench()
    rows: dict[str, dict[str, Any]] = {r["id"]: r for r in json.loads(fid.RUNS.read_text())}
    big = fid.express(rows["nemo2407_h100_fp8_gpt3_175b_512gpu"], tmp_path)
    small = fid.express(rows["nemo2407_h100_fp8_gpt3_175b_128gpu"], tmp_path)
    cfg = [json.loads(c.argv[c.argv.index("--model-config") + 1]) for c in (big, small)]
    assert "--tp-comm-overlap" in big.argv and "dropout" not in cfg[0]
    assert "--tp-comm-overlap" not in small.argv and cfg[1]["dropout"] == 0.1
    assert any("175b_mlperf.yaml" in a for a in big.assumptions)


# -- Transformer Engine's userbuffers: a reduce-scatter's SMs taken from its GEMM ------------------


def test_userbuffers_reduce_scatter_takes_sms_from_its_gemm() -> None:
    # TE's default num_sm = 16 of the H100's 132: the GEMM keeps 116, 16/116 more time while overlapped
    assert UB_COMM_SMS == 16
    tax = ub_sm_tax("megatron", 132)
    assert tax == pytest.approx(16 / 116) and ub_sm_tax("torchtitan", 132) == 0.0
    # comm 1 ms under a 2 ms GEMM in 4 chunks: the GEMM stretched by 1 ms x tax, then one chunk's
    # collective (1/4 ms) left exposed: 0.25 + tax ms beyond the GEMM's own 2 ms
    assert overlap_exposed(1e-3, 2e-3, 4, tax) == pytest.approx(0.25e-3 + 1e-3 * tax)
    assert overlap_exposed(1e-3, 2e-3, 4) == pytest.approx(tp_overlap_exposed(1e-3, 2e-3, 4))
    # the collective longer than its GEMM: the GEMM's whole time is taxed
    assert overlap_exposed(3e-3, 2e-3, 4, tax) == pytest.approx(3e-3 + (2e-3 + 2e-3 * tax) / 4 - 2e-3)


def _plan_json(*extra: str) -> dict[str, Any]:
    import contextlib
    import io
    # pp=4: Megatron-LM refuses the interleaved schedule over pp=2 with blocking sends (validate_args)
    argv = ["plan", "--model", "llama-7b", "--layers", "8", "--seq", "1024", "--mesh", "pp=4,tp=2",
            "--strategy", "megatron", "--device", "h100", "--batch", "8", "--microbatches", "8",
            "--schedule", "interleaved", "--virtual-stages", "2", "--json", *extra]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return json.loads(buf.getvalue())  # type: ignore[no-any-return]


def test_blocking_pipeline_sends_of_megatron_2021() -> None:
    from spmdkit.planner.pipeline import run_schedule
    over, block = _plan_json(), _plan_json("--no-p2p-overlap")
    p = over["pipeline"]
    stages = p["stages"]
    fwd = [s["forward_s"] for s in stages]
    bwd = [s["backward_s"] + s["recompute_s"] for s in stages]
    sf = [s["send_s"] for s in stages]
    sb = [stages[k + 1]["send_grad_s"] if k + 1 < len(stages) else 0.0 for k in range(len(stages))]
    want = run_schedule("interleaved", 4, 2, 8, fwd, bwd, sf, sb, True)
    free = run_schedule("interleaved", 4, 2, 8, fwd, bwd, sf, sb)
    assert block["pipeline"]["pipeline_s"] == pytest.approx(want.pipeline_s)
    assert over["pipeline"]["pipeline_s"] == pytest.approx(free.pipeline_s)
    assert block["pipeline"]["pipeline_s"] > over["pipeline"]["pipeline_s"]


# -- Megatron-LM's 32B of 2024: the data-parallel tail a micro-batch of one cannot hide -----------------


def test_megatron_32b_data_parallel_tail_by_hand() -> None:
    # dp 48 x tp 8 on 8-GPU nodes: each dp group has one rank a node and crosses on that rank's NIC
    # (NDR, NCCL's bus bandwidth 0.92 x 50 GB/s, not shared: the node's 8 groups have 8 NICs).
    # Every fp32 gradient bucket's reduce-scatter is NCCL's ring over 48 nodes, the faster of LL128
    # (14 + 47 x 4 us, 120/128 of the bandwidth) and Simple (8.4 + 47 x 14 us)
    import contextlib
    import io
    h, v, layers, s, t, n = 7168, 131072, 48, 4096, 8, 48
    cfg = {"name": "m32", "arch": "gpt2", "activation": "gelu", "attention": "flash", "layers": layers,
           "hidden": h, "heads": 56, "kv_heads": 56, "ffn": 4 * h, "vocab": v, "seq": s, "batch": 1,
           "dtype": "bf16", "tied_embeddings": False, "dropout": 0.1}
    argv = ["plan", "--mesh", "dp=48,tp=8", "--strategy", "dp,megatron,sp,zero1", "--device", "h100",
            "--precision", "bf16", "--framework", "megatron", "--recompute", "none", "--json", "--tp-comm-overlap",
            "--global-batch", "192", "--micro-batch", "1", "--model-config", json.dumps(cfg)]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    step = json.loads(buf.getvalue())["step"]
    rs = [b for b in step["buckets"] if b["kind"] == "reduce_scatter"]
    # a rank's parameters: the layers' tp-sharded GEMM weights and biases (qkv, fc1 column-parallel;
    # proj, fc2 row-parallel with whole biases), the norms, the vocab-parallel embedding and head,
    # the learned positions and the final norm; the tp-replicated norms' own tp all-reduce aside
    layer = (3 * h * h + 3 * h + h * h + 4 * h * h + 4 * h + 4 * h * h) / t + h + h + 4 * h
    params = layers * layer + 2 * v * h / t + s * h + 2 * h
    assert sum(b["bytes"] for b in rs) == pytest.approx(4 * params, rel=1e-3)  # fp32 (r0.8 forces it for bf16)
    bw = 0.92 * 50e9
    for b in rs:
        wire = (n - 1) / n * b["bytes"] / bw
        want = min(14e-6 + (n - 1) * 4e-6 + wire * 128 / 120, 8.4e-6 + (n - 1) * 14e-6 + wire)
        assert b["time_s"] == pytest.approx(want, rel=1e-3)
    # the parameters' bf16 all-gathers move half those bytes; the NIC's seconds for both, at
    # least, less one micro-batch's compute (the last backward hides the reduce-scatters, the
    # next step's first forward the gathers, 4 micro-batches a step): what stays exposed
    nic = (n - 1) / n * sum(b["bytes"] for b in rs) * 1.5 / bw
    exposed = step["exposed_s"]["gradient_buckets"] + step["exposed_s"]["param_gathers"]
    assert exposed >= nic - step["compute_total_s"] / 4
    # so the step is past the published 0.892 s (459.6 TFLOP/s) by more than 10% at mb = 1
    assert step["step_overlap_s"] > 1.1 * 0.892


def test_fused_weight_gradient_accumulates_into_fp32_main_grad_by_hand() -> None:
    # llama-7b's w_down at tp=2 (local [5504, 4096]) over 2 x 128 tokens: Megatron's gradient
    # accumulation fusion has its wgrad GEMM (4096 x 5504 over K = 256) read and write the fp32
    # main_grad, 8 bytes an element, besides its bf16 operands x [256, 5504] and dy [256, 4096]
    _, plan, _ = plan_model("llama-7b", "tp=2", "megatron", {"layers": 1, "seq": 128, "batch": 2, "vocab": 1024})
    i = next(j for j, op in enumerate(plan.program.ops) if op.rule == "matmul_grad" and op.inputs["y"] == "layers.0.w_down")
    elems = 5504 * 4096
    wbytes = 2 * (5504 * 256 + 256 * 4096) + 8 * elems
    fused = op_cost(plan, i)
    assert (fused.wgrad_gemms, fused.wgrad_bytes) == (1, wbytes) == (1, 185_270_272)
    torch_side = op_cost(replace(plan, runtime=Runtime(framework="torchtitan")), i)  # FSDP2 writes a bf16 gradient
    assert (torch_side.wgrad_gemms, torch_side.wgrad_bytes) == (0, 0.0)
    assert fused.bytes == torch_side.bytes - 2 * elems + 8 * elems
    # the wgrad kernel is bound by that traffic: 185.3 MB at 3.015 TB/s = 61.4 us, against its
    # 11.5 GFLOPs at the GEMM rate; the dgrad (the op's other GEMM) keeps the rest of the bytes
    bw = 3.35e12 * 0.90
    assert wbytes / bw == pytest.approx(61.45e-6, rel=1e-3)
    tw = H100.compute_time(replace(fused, gemms=fused.gemms[1:], flops=2.0 * 5504 * 4096 * 256))
    assert tw < wbytes / bw
    td = H100.compute_time(fused) - tw
    assert H100.op_time(fused) == pytest.approx(max(td, (fused.bytes - wbytes) / bw) + wbytes / bw)
    assert H100.op_time(fused) > H100.op_time(torch_side) + 30e-6
    # Megatron-FSDP (ZeRO-3 here) reduce-scatters the gradient at its producer: no fusion there
    _, z3, _ = plan_model("llama-7b", "dp=2,tp=2", "dp,megatron,zero3", {"layers": 1, "seq": 128, "batch": 4, "vocab": 1024})
    j = next(k for k, op in enumerate(z3.program.ops) if op.rule == "matmul_grad" and op.inputs["y"] == "layers.0.w_down")
    assert op_cost(z3, j).wgrad_bytes == 0.0


def test_async_dgrad_allreduce_hides_under_the_wgrad_gemms() -> None:
    """Megatron-LM's async_tensor_model_parallel_allreduce (megatron/mpu/layers at 16c90445e7,
    LinearWithGradAccumulationAndAsyncAllreduce.backward): the column-parallel linear's input
    gradient is all-reduced over tp while its weight-gradient GEMM runs, so only
    max(0, all-reduce - wgrad) blocks; q, k, v are one linear there (their dgrads summed)."""
    _, plan, _ = plan_model("llama-7b", "tp=8", "megatron", {"layers": 1, "seq": 2048, "batch": 1})
    plan = recost(plan, cost_model(plan.mesh, H100))
    ops = plan.program.ops
    comp = step_compute(replace(plan, runtime=Runtime(framework="megatron")), H100)
    got = {}
    for key, rt in (("on", Runtime(framework="megatron")),
                    ("off", Runtime(framework="megatron", tp_allreduce_overlap=False)),
                    ("titan", Runtime(framework="torchtitan"))):
        got[key] = communication(replace(plan, runtime=rt), comp, H100).blocking

    def made_by(name: str) -> int:
        return next(i for i, op in enumerate(ops) if name in op.output_names())

    cases = {"layers.0.attn_norm.out.grad.sum": ("layers.0.attn_norm.out.grad", "layers.0.attn_norm.out.grad1",
                                                 "layers.0.attn_norm.out.grad2"),
             "layers.0.mlp_norm.out.grad.sum": ("layers.0.mlp_norm.out.grad", "layers.0.mlp_norm.out.grad1")}
    for summed, parts in cases.items():
        at = next(i for i, op in enumerate(ops) if op.phase == "backward" and summed in op.input_names()
                  and op.rule != "add_n")
        ar = sum(r.plan.time_s for r in plan.reshards if r.op_index == at and r.tensor == summed)
        gemms = [made_by(p) for p in parts]
        assert all(ops[g].rule == "matmul_grad" for g in gemms)
        wgrad = sum(0.5 * comp.times[g] for g in gemms)  # dW = X^T dY: half of each GEMM backward
        assert ar > 0 and wgrad > 0
        assert got["off"][at] == pytest.approx(ar) and got["titan"][at] == pytest.approx(ar)
        assert got["on"][at] == pytest.approx(max(0.0, ar - wgrad))
        assert got["on"][at] < ar
    # the forward's all-reduces (row-parallel outputs) block either way
    fwd = [i for i in got["off"] if ops[i].phase == "forward"]
    assert fwd and all(got["on"][i] == pytest.approx(got["off"][i]) for i in fwd)


def test_no_async_tp_allreduce_flag() -> None:
    """--no-async-tp-allreduce: the backward's tp all-reduces block again (the 2021 rows use it); what
    the default hides is at most the backward's tp communication."""
    args = ["plan", "--model", "tiny-llama", "--mesh", "tp=2", "--strategy", "megatron", "--framework", "megatron",
            "--device", "h100", "--json"]
    outs = []
    for extra in ([], ["--no-async-tp-allreduce"]):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(args + extra) == 0
        outs.append(json.loads(buf.getvalue()))
    on, off = outs[0]["step"], outs[1]["step"]
    assert on["comm_s"] == off["comm_s"]  # the same collectives, fewer of their seconds exposed
    hidden = off["step_overlap_s"] - on["step_overlap_s"]
    assert 0 < hidden <= on["comm_s"]["backward"]


def test_unfused_wgrad_adds_into_param_grad_as_a_kernel_of_its_own() -> None:
    """--no-wgrad-fusion (Megatron-LM before 83b1e42f30, 2022-02): the wgrad GEMM writes the bf16
    gradient and autograd's AccumulateGrad adds it into param.grad (read 2, write 1 element), a
    memory-bound kernel after the op's GEMMs; with the fusion the GEMM accumulates into main_grad."""
    _, plan, _ = plan_model("llama-7b", "tp=2", "megatron", {"layers": 1, "seq": 128, "batch": 2})
    ops = plan.program.ops
    i = next(j for j, op in enumerate(ops) if op.rule == "matmul_grad" and "layers.0.w_up.grad" in op.output_names())
    assert plan.program.tensors["layers.0.w_up"].dtype == "bfloat16"
    fused = op_cost(replace(plan, runtime=Runtime(framework="megatron")), i)
    unfused = op_cost(replace(plan, runtime=Runtime(framework="megatron", wgrad_fusion=False)), i)
    elems = 4096 * (11008 // 2)  # w_up [4096, 11008], column-parallel over tp = 2
    assert unfused.cast_bytes == 3 * 2 * elems and fused.cast_bytes == 0
    assert unfused.wgrad_bytes == 0 and fused.wgrad_bytes > 0  # one GEMM kernel pair, then the add
    assert H100.op_time(unfused) == pytest.approx(H100.op_time(replace(unfused, cast_bytes=0.0))
                                                  + 6 * elems / H100.hbm_rate)
