"""torchtitan's step as it runs (spmdkit.cost.eager, the power limit of spmdkit.cost.rates): the eager
PyTorch ops a fused program op stands for, byte by byte from torchtitan's model code (RMSNorm, rotary,
SwiGLU, the fp32 loss, GQA's repeat_kv); --compile leaving the fused costs; a power-limited H100's
sustained tensor-core clock from NVIDIA's rated SKUs; the flags' errors."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from conftest import load_script
from spmdkit.cli import main
from spmdkit.core.errors import ProgramError
from spmdkit.cost.compute import local_op, op_cost
from spmdkit.cost.devices import DEVICES, device_from_json
from spmdkit.cost.step import estimate_step
from spmdkit.planner.planning import plan_model
from spmdkit.program.runtime import Runtime

H100 = DEVICES["h100"]
B, S, H, HEADS, KV, F = 2, 64, 128, 4, 2, 256  # tokens 128 a rank (dp=1), hidden 128, 4 heads of 32, 2 kv heads


@pytest.fixture(scope="module")
def titan() -> Any:
    overrides = {"layers": 1, "hidden": H, "heads": HEADS, "kv_heads": KV, "ffn": F, "vocab": 512, "seq": S,
                 "batch": B}
    plan = plan_model("llama-7b", "dp=1", "dp", overrides)[1]
    return plan


def _ops(plan: Any, rule: str) -> list[int]:
    return [i for i, op in enumerate(plan.program.ops) if op.rule == rule]


def _with(plan: Any, **kw: Any) -> Any:
    return replace(plan, runtime=Runtime(framework="torchtitan", **kw))


def test_eager_rms_norm_costs_torchtitans_chain_by_hand(titan: Any) -> None:
    eager, compiled, mega = _with(titan), _with(titan, compile=True), titan
    e = B * S * H  # the normed elements, bf16 (2 bytes); fp32 intermediates (4 bytes)
    fwd = _ops(titan, "fused_rms_norm")
    assert fwd
    for i in fwd:
        # x.float() 2+4 | pow 4+4 | mean 4 | x * rstd 4+4+4 | type_as 4+2 | * weight 2+2  = 36 bytes, 8 kernels
        c = op_cost(eager, i)
        assert c.bytes == 36 * e and c.kernels == 8
        assert op_cost(compiled, i) == op_cost(mega, i)  # Inductor's fused kernel: the program's own cost
        assert op_cost(mega, i).bytes < 6 * e  # fused: x read, out written, the weight and rstd
    for i in _ops(titan, "rms_norm_grad"):
        c = op_cost(eager, i)
        assert c.bytes == 92 * e and c.kernels == 12  # the autograd chain (spmdkit.cost.eager._rms_norm_grad)


def test_eager_rotary_and_swiglu_by_hand(titan: Any) -> None:
    eager = _with(titan)
    for i in _ops(titan, "fused_rotary_position_embedding"):
        lop = local_op(titan.program, i, titan.ops[i].required, titan.ops[i].outputs, titan.attrs)
        rotated = sum(n * m * h * d for o in lop.outs if o is not None for n, m, h, d in [o[0]])
        c = op_cost(eager, i)
        assert c.bytes == 20 * rotated and c.kernels == 3  # x.float() 2+4 | complex mul 4+4 | type_as 4+2
    fwd = _ops(titan, "swiglu")
    assert fwd
    for i in fwd:
        assert op_cost(eager, i).bytes == 10 * B * S * F  # silu(gate) 2+2 | * up 2+2+2
    for i in _ops(titan, "swiglu_grad"):
        assert op_cost(eager, i).bytes == 18 * B * S * F  # g * up | g * silu | silu_backward: 3 x (2+2+2)


def test_torchtitans_loss_and_repeat_kv_either_way(titan: Any) -> None:
    logits = B * S * 512
    for rt in (_with(titan), _with(titan, compile=True)):
        (ce,) = _ops(titan, "cross_entropy_with_softmax")
        assert op_cost(rt, ce).bytes == 22 * logits  # .float() 2+4 | log_softmax three fp32 reads, a write
        (ceg,) = _ops(titan, "cross_entropy_with_softmax_grad")
        assert op_cost(rt, ceg).bytes == 26 * logits  # zero fill 4 | log_softmax_backward 16 | cast back 4+2
        for i in _ops(titan, "flash_attention") + _ops(titan, "flash_attention_grad"):
            kv = B * S * KV * (H // HEADS) * 2  # K (or V) at its 2 kv heads, bf16
            assert op_cost(rt, i).cast_bytes == 2 * (kv + kv * HEADS // KV)  # K and V: read, repeated copy written
            assert op_cost(titan, i).cast_bytes == 0  # Megatron: GQA in the kernel


def test_torchtitans_foreach_adamw_by_hand_either_way(titan: Any) -> None:
    ops = _ops(titan, "adamw")
    assert ops
    for i in ops:
        lop = local_op(titan.program, i, titan.ops[i].required, titan.ops[i].outputs, titan.attrs)
        e = lop.one("master_param")[0]  # type: ignore[index]
        n = e[0] * (e[1] if len(e) > 1 else 1)
        # torch's _multi_tensor_adamw on the fp32 shard, its fp32 gradient and fp32 moments: mul_ 4+4 |
        # lerp_ 4+4+4 | mul_ 4+4 | addcmul_ 4+4+4 | sqrt 4+4 | div_ 4+4 | add_ 4+4 | addcdiv_ 4+4+4+4 = 80
        for rt in (_with(titan), _with(titan, compile=True)):
            assert op_cost(rt, i).bytes == 80 * n
        # Megatron: not torch's foreach AdamW but its mixed-precision optimizer step's passes (grad norm 4,
        # fused Adam on the fp32 copies 28, copy back to bf16 6, zeroing the bf16 grad buffer 4:
        # spmdkit.cost.optimizer_step, tests/test_optimizer_step.py), a few fp32 scalars beside
        assert op_cost(titan, i).bytes == pytest.approx(42 * n, abs=40)


def test_eager_step_is_slower_by_the_extra_traffic(titan: Any) -> None:
    dev = DEVICES["h100"]
    eager = estimate_step(_with(titan), dev, recompute="none")
    compiled = estimate_step(_with(titan, compile=True), dev, recompute="none")
    extra = sum(dev.op_time(op_cost(_with(titan), i)) - dev.op_time(op_cost(_with(titan, compile=True), i))
                for i in range(len(titan.program.ops)))
    assert extra > 0
    assert eager.compute_total_s - compiled.compute_total_s == pytest.approx(extra, rel=1e-9)


def test_power_limit_scales_the_tensor_core_rates_by_the_rated_skus() -> None:
    # NVIDIA: H100 SXM 700 W 989.5 dense bf16; H100 NVL 400 W 835.5: linear between them
    at500 = device_from_json({"base": "h100", "power_limit_w": 500})
    clock = 835.5 / 989.5 + (1 - 835.5 / 989.5) * (500 - 400) / 300
    assert at500.rates.clock == pytest.approx(clock) == pytest.approx(0.8962, abs=1e-4)
    assert device_from_json({"base": "h100", "power_limit_w": 700}).rates.clock == 1.0
    assert device_from_json({"base": "h100", "power_limit_w": 400}).rates.clock == pytest.approx(835.5 / 989.5)
    assert at500.gemm_rate("bf16", 1, 8192, 8192, 8192) == pytest.approx(clock * H100.gemm_rate("bf16", 1, 8192, 8192,
                                                                                                  8192))
    assert at500.peak == H100.peak and at500.hbm_rate == H100.hbm_rate  # MFU's peak and HBM unchanged
    assert device_from_json(at500.to_json()).rates == at500.rates
    with pytest.raises(ProgramError, match=r"power_limit_w: 300 W is outside 400-700 W"):
        device_from_json({"base": "h100", "power_limit_w": 300})
    with pytest.raises(ProgramError, match=r"power_limit_w: no rated power points known for NVIDIA A100"):
        device_from_json({"base": "a100-80gb", "power_limit_w": 300})
    with pytest.raises(ProgramError, match=r"power_limit_w: give it or efficiency.clock, not both"):
        device_from_json({"base": "h100", "power_limit_w": 500, "efficiency": {"clock": 0.9}})
    assert device_from_json({"base": "a100-80gb", "efficiency": {"clock": 0.9}}).rates.clock == 0.9


def test_compile_flag_only_under_torchtitan(capsys: Any) -> None:
    assert main(["plan", "--model", "tiny-llama", "--mesh", "dp=2", "--strategy", "dp", "--compile"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["spmdkit plan: ProgramError: --compile: applies to --framework torchtitan only "
                   "(--framework megatron runs fused Transformer Engine kernels)"]
    assert Runtime(framework="torchtitan").eager and not Runtime(framework="torchtitan", compile=True).eager
    assert not Runtime().eager and Runtime(framework="torchtitan", compile=True).to_json()["compile"] is True


def _bench() -> Any:
    return load_script("fidelity_bench_titan", Path(__file__).resolve().parents[1] / "benchmarks" / "fidelity.py")


def test_torchtitan_runs_expressed_as_they_ran(tmp_path: Path) -> None:
    fid = _bench()
    rows = [r for r in json.loads(fid.RUNS.read_text()) if r["id"].startswith("torchtitan")]
    assert len(rows) == 18
    for row in rows:
        case = fid.express(row, tmp_path)
        want = "--compile" if row["parallelism"]["torch_compile"] else "--no-compile"
        assert want in case.argv and case.argv.count("--compile") + case.argv.count("--no-compile") == 1
        dev = json.loads(Path(case.argv[case.argv.index("--device") + 1]).read_text())
        assert dev["power_limit_w"] == 500 and dev["hbm_gb_per_s"] == 2400
        if row["parallelism"]["pp"] > 1:  # torchtitan's generate_split_points: 126 layers
            stages = case.argv[case.argv.index("--stages") + 1]
            if row["parallelism"]["schedule"] == "interleaved-1F1B":  # 2 stages a rank by default
                assert case.argv[case.argv.index("--virtual-stages") + 1] == "2"
                assert stages == ",".join(["7"] + ["8"] * 14 + ["7"])
            else:
                assert stages == "15,16,16,16,16,16,16,15"
