"""spmdkit.cost.rates and Device.op_time: achievable rates instead of datasheet peaks. GEMM efficiency by
shape (tile and wave quantisation worked by hand, K saturation), the presets' ceilings against their
published measurements, flash attention forward and backward by kernel, HBM at an achievable fraction,
the kernel launch floor, fp8 linear layers (the head kept in bf16, casts paid, refused on an A100), a
device file's efficiency and measured blocks, Adam's bytes per parameter, and one 22B layer against
Korthikanti et al. (2022) Table 4."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.cost.compute import fp8_weights, op_cost
from spmdkit.cost.devices import DEVICES, cost_model, device_from_json, load_device, recost
from spmdkit.cost.rates import (
    A100_RATES,
    H100_RATES,
    HOPPER_SUSTAINED,
    attention_efficiency,
    gemm_efficiency,
    tile_wave_utilisation,
)
from spmdkit.engine.facts import OpCost
from spmdkit.ops.matmul import out_shape
from spmdkit.planner.planning import plan_model
from spmdkit.planner.propagate import propagate
from spmdkit.program.ir import ProgramBuilder
from spmdkit.program.runtime import Runtime

A100, H100 = DEVICES["a100-80gb"], DEVICES["h100"]
#: the H100 at the microbenchmarks' rates (short timed loops: mamf-finder, the attention papers), before
#: the share of them sustained through training steps (Rates.sustained)
H100_BENCH = replace(H100, rates=replace(H100_RATES, sustained=1.0))


def _gemm(b: int, m: int, n: int, k: int, dtype: str = "bfloat16") -> OpCost:
    f = 2.0 * b * m * n * k
    return OpCost(f, f, 2.0 * b * (m * k + k * n + m * n), True, dtype, gemms=((b, m, n, k),))


# -- GEMMs ----------------------------------------------------------------------------------------


def test_presets_large_gemm_ceilings_are_the_published_measurements() -> None:
    # ml-engineering's MAMF table (mamf-finder, cuBLAS, bf16): A100 SXM 267.9 of 312, H100 SXM 792.1 of 989;
    # fp8 (float8_e4m3fn, torch 2.7.0+cu126): H100 SXM 1402.6 of 1979
    assert A100.rates.gemm["bf16"] * 312 == pytest.approx(267.9, abs=0.1)
    assert H100.rates.gemm["bf16"] * 989 == pytest.approx(792.1, abs=0.1)
    assert H100.rates.gemm["fp8"] * 1979 == pytest.approx(1402.6, abs=0.1)
    assert (A100.rates.sms, H100.rates.sms, DEVICES["h200"].rates.sms) == (108, 132, 132)
    assert H100.peak["fp8"] == 1979e12 and "fp8" not in A100.peak
    for dev in DEVICES.values():
        assert 0.5 < dev.rates.hbm < 1 and all(0.3 < f < 1 for f in dev.rates.gemm.values())


def test_gemm_rates_at_the_measured_shapes_are_the_cited_figures() -> None:
    # mamf-finder's best shapes (MxNxK): A100 6912x2048x16384 (27 x 16 = 432 tiles of 256x128: four full
    # waves of 108), H100 6144x2816x17920 (48 x 11 = 528 tiles of 128x256: four full waves of 132)
    assert tile_wave_utilisation(1, 6912, 2048, 108) == 1.0 and tile_wave_utilisation(1, 6144, 2816, 132) == 1.0
    assert gemm_efficiency(A100_RATES, "bf16", 1, 6912, 2048, 16384) * 312 == pytest.approx(267.9)
    assert gemm_efficiency(H100_RATES, "bf16", 1, 6144, 2816, 17920) * 989 == pytest.approx(792.1)
    # fp8 at its measured K (14336) on a full wave (11 x 12 tiles of 256x128): 1402.6
    assert gemm_efficiency(H100_RATES, "fp8", 1, 2816, 1536, 14336) * 1979 == pytest.approx(1402.6)
    # the H100 preset's rates there in training: the sustained share of the cited figures (peaks 989.5, 1979)
    assert H100.gemm_rate("bf16", 1, 6144, 2816, 17920) == pytest.approx(792.1e12 * 989.5 / 989 * HOPPER_SUSTAINED)
    assert H100.gemm_rate("fp8", 1, 2816, 1536, 14336) == pytest.approx(1402.6e12 * HOPPER_SUSTAINED)
    assert A100.gemm_rate("bf16", 1, 6912, 2048, 16384) == pytest.approx(267.9e12)  # A100: sustained 1
    # mamf's own fp8 shape, 1024x9216: 128x128 tiles, 8 x 72 = 576 in five waves of 132 (the best tiling
    # of TILES): the model gives 576 / 660 of the measured 1402.6 there (Hopper's wider tiles not modelled)
    assert gemm_efficiency(H100_RATES, "fp8", 1, 1024, 9216, 14336) * 1979 == pytest.approx(1402.6 * 576 / 660)
    # K = 4096 on the same full wave: bf16 (4096/4224) / (17920/18048) of 792.1; fp8 (K0 = 256)
    # (4096/4352) / (14336/14592) of 1402.6
    assert gemm_efficiency(H100_RATES, "bf16", 1, 6144, 2816, 4096) * 989 == \
        pytest.approx(792.1 * (4096 / 4224) / (17920 / 18048))
    assert gemm_efficiency(H100_RATES, "fp8", 1, 2816, 1536, 4096) * 1979 == \
        pytest.approx(1402.6 * (4096 / 4352) / (14336 / 14592))


def test_tile_and_wave_quantisation_by_hand() -> None:
    # 2304 x 1536: nine by twelve 256x128 tiles = 108 tiles, one full wave on 108 SMs
    assert tile_wave_utilisation(1, 2304, 1536, 108) == 1.0
    # one more column: the 256x128 tiling needs 117 tiles (two waves, half idle); 128x128 tiles make 234,
    # three waves of 108: the best, 2304*1537 useful of 3*108*128*128
    assert tile_wave_utilisation(1, 2304, 1537, 108) == pytest.approx(2304 * 1537 / (3 * 108 * 128 * 128))
    # the same output on H100 (132 SMs): 108 tiles of 256x128 fill 108 of 132 SMs
    assert tile_wave_utilisation(1, 2304, 1536, 132) == pytest.approx(108 / 132)
    # a batch counts in the waves: 2 x 54 tiles = one wave
    assert tile_wave_utilisation(2, 2304, 768, 108) == 1.0


def test_gemm_efficiency_saturates_in_k_and_falls_for_skinny_shapes() -> None:
    big = gemm_efficiency(A100_RATES, "bf16", 1, 2304, 1536, 16384)
    assert big == pytest.approx(267.9 / 312)  # a full wave at the K the ceiling was measured at
    assert gemm_efficiency(A100_RATES, "bf16", 1, 2304, 1536, 32768) == pytest.approx(big)  # capped at 1
    small_k = gemm_efficiency(A100_RATES, "bf16", 1, 2304, 1536, 128)
    # K / (K + 128) normalised at K = 16384: 0.5 / (16384 / 16512)
    assert small_k == pytest.approx(267.9 / 312 * 0.5 / (16384 / 16512))
    skinny = gemm_efficiency(A100_RATES, "bf16", 1, 16, 4096, 4096)  # 16 rows in 64-row tiles at best
    assert skinny < 0.25 * big


def test_op_time_uses_each_gemm_shape_and_the_fp8_ceiling() -> None:
    c = _gemm(1, 16384, 4096, 4096)
    eff = gemm_efficiency(H100_RATES, "bf16", 1, 16384, 4096, 4096)
    # the microbenchmarked rate, and the H100's in training: that times the sustained share
    assert H100_BENCH.op_time(c) == pytest.approx(c.flops / (989.5e12 * eff))
    assert H100.tensor_clock == HOPPER_SUSTAINED == 0.870
    assert H100.op_time(c) == pytest.approx(c.flops / (989.5e12 * eff * HOPPER_SUSTAINED))
    f8 = replace(c, fp8=True)
    eff8 = gemm_efficiency(H100_RATES, "fp8", 1, 16384, 4096, 4096)
    assert H100_BENCH.op_time(f8) == pytest.approx(f8.flops / (1979e12 * eff8))
    assert H100.op_time(f8) == pytest.approx(f8.flops / (1979e12 * eff8 * HOPPER_SUSTAINED))
    # fp8 reaches less of its (double) peak, and its K0 is twice bf16's (K = 4096 is further from saturation)
    assert eff8 / eff == pytest.approx((1402.6 / 1979) / (792.1 / 989) * ((4096 / 4352) / (14336 / 14592)) /
                                       ((4096 / 4224) / (17920 / 18048)))
    # a matmul grad's two GEMMs (dx, dw) are timed each at its own shape
    two = OpCost(c.flops * 2, c.flops * 2, c.bytes, True, "bfloat16", gemms=((1, 16384, 4096, 4096),
                                                                             (1, 4096, 4096, 16384)))
    e2 = gemm_efficiency(H100_RATES, "bf16", 1, 4096, 4096, 16384)
    assert H100.op_time(two) == pytest.approx((c.flops / (989.5e12 * eff) + c.flops / (989.5e12 * e2)) /
                                              HOPPER_SUSTAINED)


@pytest.mark.parametrize(("xs", "ys", "gemms"), [
    ([6, 5, 7], [7, 3], ((1, 30, 3, 7),)),          # a weight: x's batch folded into m (one GEMM)
    ([4, 5, 7], [4, 7, 3], ((4, 5, 3, 7),)),        # batched both sides: 4 GEMMs in one batch
    ([2, 1, 5, 7], [4, 7, 3], ((8, 5, 3, 7),)),     # broadcast batch
])
def test_matmul_declares_its_gemm(xs: list[int], ys: list[int], gemms: tuple[Any, ...]) -> None:
    b = ProgramBuilder()
    b.tensor("x", xs, "bfloat16", "input")
    b.tensor("w", ys, "bfloat16", "parameter")
    b.op("matmul", {"x": "x", "y": "w"}, [("h", list(out_shape(tuple(xs), tuple(ys), False, False)), "bfloat16")])
    c = op_cost(propagate(b.build(), ProcessMesh([1]), {}), 0)
    assert c.gemms == gemms and c.flops == sum(2 * g[0] * g[1] * g[2] * g[3] for g in gemms)


def test_matmul_grad_declares_dx_and_dw() -> None:
    b = ProgramBuilder()
    b.tensor("x", [6, 5, 7], "bfloat16", "input")
    b.tensor("w", [7, 3], "bfloat16", "parameter")
    b.tensor("dh", [6, 5, 3], "bfloat16", "input")
    b.phase = "backward"
    b.op("matmul_grad", {"x": "x", "y": "w", "out_grad": "dh"}, [("dx", [6, 5, 7], "bfloat16"),
                                                                  ("dw", [7, 3], "bfloat16")])
    c = op_cost(propagate(b.build(), ProcessMesh([1]), {}), 0)
    # dx = dh . w^T: (30 x 7) over 3; dw = x^T . dh: (7 x 3) over the 30 rows
    assert c.gemms == ((1, 30, 7, 3), (1, 7, 3, 30)) and c.flops == 2 * 2 * 30 * 7 * 3


# -- attention, memory-bound ops, launches ----------------------------------------------------------


def _attn(backward: bool, seq: int = 4096, hd: int = 128, causal: bool = False, framework: str = "") -> OpCost:
    f = 4.0 * 32 * seq * seq * hd * (0.5 if causal else 1.0) * (2.5 if backward else 1.0)
    return OpCost(f, f, 1e6, True, "bfloat16", attention=(backward, seq, hd, causal), framework=framework)


def test_flash_attention_forward_and_backward_rates() -> None:
    # FlashAttention-2 on A100, head dim 128, 16k tokens: ~0.69 of 312 forward (the paper: up to 73%)
    fwd = A100.attention_rate(_attn(False, 16384))
    assert fwd == pytest.approx(312e12 * 0.70 * 16384 / (16384 + 228))  # S0 228: FA2_A100_SHAPE
    assert 190e12 < fwd < 230e12
    assert A100.attention_rate(_attn(True, 16384)) < fwd  # the backward reaches less
    # causal: the kernel sees half the sequence; short sequences are far below the asymptote
    assert A100.attention_rate(_attn(False, 512, causal=True)) < 0.5 * 312e12
    assert attention_efficiency(A100_RATES, "fa2", False, 4096, 64, False) < \
        attention_efficiency(A100_RATES, "fa2", False, 4096, 128, False)
    # H100: Megatron-Core runs cuDNN fused attention, torchtitan torch's FlashAttention-2
    cudnn, fa2 = H100_BENCH.attention_rate(_attn(False)), H100_BENCH.attention_rate(_attn(False, framework="torchtitan"))
    assert cudnn / fa2 == pytest.approx((641.9 / (16384 / 16592)) / (329.483 / (4608 / 4816)))  # both S0 208
    assert 550e12 < cudnn < 650e12  # at the papers' rates; in training the sustained share of it
    assert H100.attention_rate(_attn(False)) == pytest.approx(cudnn * HOPPER_SUSTAINED)
    assert H100.attention_rate(_attn(False, framework="torchtitan")) == pytest.approx(fa2 * HOPPER_SUSTAINED)


def test_h100_attention_rates_at_the_measured_shapes_are_the_cited_figures() -> None:
    # torch 2.6.0.dev20241204's SDPA (flash backend) at (1, 24, 4608, 128), non-causal: 329.483 TFLOP/s
    # forward (pytorch/pytorch#142132); at head dim 128 and 16k tokens the FlashAttention-3 paper's
    # FlashAttention-2 backward 322 and cuDNN 9.1.0's forward 641.9 and backward 538.5 (cudnn-frontend's
    # benchmark of that version; bf16 peak 989.5): the rates of
    # short timed loops, which the H100 preset sustains HOPPER_SUSTAINED of through training steps
    cited = [(_attn(False, 4608, framework="torchtitan"), 329.483e12), (_attn(True, 16384, framework="torchtitan"), 322e12),
             (_attn(False, 16384, framework="megatron"), 641.9e12), (_attn(True, 16384, framework="megatron"), 538.5e12)]
    for c, figure in cited:
        assert H100_BENCH.attention_rate(c) == pytest.approx(figure)
        assert H100.attention_rate(c) == pytest.approx(figure * HOPPER_SUSTAINED)


def test_flash_attention_op_says_its_pass_and_the_framework() -> None:
    _, plan, _ = plan_model("tiny-llama", "dp=1", "dp")
    passes = {op_cost(plan, i).attention for i, op in enumerate(plan.program.ops) if "flash_attention" in op.rule}
    assert {p[0] for p in passes if p} == {False, True}
    tt = replace(plan, runtime=Runtime(framework="torchtitan"))
    i = next(i for i, op in enumerate(plan.program.ops) if op.rule == "flash_attention")
    assert op_cost(tt, i).framework == "torchtitan" and op_cost(plan, i).framework == ""


def test_memory_bound_ops_at_achievable_bandwidth_and_the_launch_floor() -> None:
    copy = OpCost(0.0, 0.0, 1e9, False, "bfloat16")
    assert H100.op_time(copy) == pytest.approx(1e9 / (0.90 * 3350e9))
    assert A100.op_time(copy) == pytest.approx(1e9 / (0.86 * 2039e9))
    tiny = OpCost(10.0, 10.0, 64.0, False, "float32")
    assert H100.op_time(tiny) == 4e-6  # one kernel: at least the launch
    assert H100.op_time(OpCost(0.0, 0.0, 0.0, False, "bfloat16", kernels=0)) == 0.0  # a view


@pytest.fixture(scope="module")
def llama_layer() -> Any:
    return plan_model("llama-7b", "tp=8", "megatron", {"layers": 1})[1]


def test_adam_reads_and_writes_30_bytes_per_parameter(llama_layer: Any) -> None:
    # bf16 parameter and gradient read, fp32 master and two moments read and written, bf16 parameter written:
    # 2 + 2 + 3 * 4 read, 2 + 3 * 4 written (+ the scalars: learning rate, beta powers): the program's own
    # update, as a framework other than Megatron runs it (Megatron's passes: tests/test_optimizer_step.py)
    prog = llama_layer.program
    own = replace(llama_layer, runtime=Runtime(framework="automodel"))
    seen = 0
    for i, op in enumerate(prog.ops):
        if op.rule == "adamw":
            n = numel_of(llama_layer, str(op.inputs["param"]))
            c = op_cost(own, i)
            assert c.bytes == pytest.approx(30 * n, abs=40) and not c.matmul
            assert H100.op_time(c) >= c.bytes / H100.hbm_rate  # memory-bound
            seen += 1
    assert seen == 12  # embedding, head, final norm, 2 norms + 7 linear weights of the layer


def numel_of(plan: Any, name: str) -> int:
    from spmdkit.cost.compute import local_shape

    t = plan.program.tensors[name]
    return math.prod(local_shape(t.shape, plan.attrs.get(name)))


# -- fp8 ------------------------------------------------------------------------------------------


def test_fp8_runs_the_linear_layers_but_not_the_head_and_pays_the_casts(llama_layer: Any) -> None:
    plan = llama_layer
    prog = plan.program
    f8 = replace(plan, runtime=Runtime(precision="fp8"))
    weights = fp8_weights(prog)
    assert len(weights) == 7  # q, k, v, o, gate, up, down; not the output head
    assert not any("head" in w or "embed" in w for w in weights)
    fwd = [i for i, op in enumerate(prog.ops) if op.rule == "matmul" and op.phase == "forward"]
    head = fwd[-1]
    assert not op_cost(f8, head).fp8 and op_cost(f8, fwd[0]).fp8
    c = op_cost(f8, fwd[0])  # q: [8 x 4096 tokens, 4096] x [4096, 512] on one of 8 ranks
    _, _, n, k = c.gemms[0]
    # the weight cast (bf16 read, fp8 copy and its transpose written); the input came from the rms norm, which
    # Transformer Engine's LayerNormLinear writes in fp8 itself
    assert c.cast_bytes == 4 * k * n
    names = [prog.ops[i].name for i in fwd]
    attn_out = fwd[names.index("layers.0.attn_out")]  # its input, the attention's output, is cast once
    ca = op_cost(f8, attn_out)
    _, m, n, k = ca.gemms[0]
    assert ca.cast_bytes == 4 * (k * n + m * k)
    grads = [i for i, op in enumerate(prog.ops) if op.rule == "matmul_grad" and op_cost(f8, i).fp8]
    assert len(grads) == 7
    g = op_cost(f8, grads[0])
    assert g.cast_bytes == 4 * g.gemms[0][1] * g.gemms[0][3]  # the output gradient: m x n
    layer_fp8 = sum(H100.op_time(op_cost(f8, i)) for i in fwd[:-1])
    layer_bf16 = sum(H100.op_time(op_cost(plan, i)) for i in fwd[:-1])
    assert 0.5 * layer_bf16 < layer_fp8 < 0.8 * layer_bf16  # faster GEMMs despite the casts
    with pytest.raises(ProgramError, match=r"--precision fp8: NVIDIA A100 SXM4 80GB has no fp8"):
        A100.op_time(c)
    with pytest.raises(ProgramError, match="--precision fp8"):
        A100.check_precision("fp8")
    A100.check_precision("bf16")


# -- device files ---------------------------------------------------------------------------------


def test_efficiency_round_trips_and_overrides(tmp_path: Path) -> None:
    for dev in DEVICES.values():
        r = device_from_json(dev.to_json()).rates  # a dtype the file does not give: the generic rates'
        assert replace(r, gemm={k: r.gemm[k] for k in dev.rates.gemm}) == dev.rates
    mine = device_from_json({"base": "h100", "efficiency": {"gemm": {"bf16": 0.7}, "hbm": 0.8, "launch_us": 2,
                                                            "attention_kernel": {"torchtitan": "cudnn"}}})
    assert mine.rates.gemm["bf16"] == 0.7 and mine.rates.gemm["fp8"] == 1402.6 / 1979 and mine.hbm_rate == 0.8 * 3350e9
    assert mine.rates.launch_s == pytest.approx(2e-6) and mine.rates.attention_kernel["torchtitan"] == "cudnn"
    with pytest.raises(ProgramError, match="attention_kernel"):
        device_from_json({"base": "a100", "efficiency": {"attention_kernel": {"megatron": "cudnn"}}})
    # gemm_k: the K the user's ceiling was measured at (K saturation 1 there)
    at4k = device_from_json({"base": "h100", "efficiency": {"gemm": {"bf16": 0.75}, "gemm_k": {"bf16": 4096}}})
    assert at4k.rates.gemm_k == {**H100_RATES.gemm_k, "bf16": 4096}
    assert gemm_efficiency(at4k.rates, "bf16", 1, 6144, 2816, 4096) == pytest.approx(0.75)
    with pytest.raises(ProgramError, match=r"^--device efficiency.gemm_k.bf16: expected a K of at least 1, got 0$"):
        device_from_json({"base": "h100", "efficiency": {"gemm_k": {"bf16": 0}}})
    with pytest.raises(ProgramError, match=r"^--device efficiency.gemm_k: expected an object of "):
        device_from_json({"base": "h100", "efficiency": {"gemm_k": {"int4": 4096}}})


def test_measured_block_overrides_the_model(tmp_path: Path) -> None:
    pts = [{"m": 4096, "n": 4096, "k": 4096, "dtype": "bf16", "tflops": 700.0},
           {"m": 16384, "n": 16384, "k": 16384, "dtype": "bf16", "tflops": 760.0}]
    att = [{"batch": 1, "heads": 32, "seq": 4096, "head_dim": 128, "causal": True, "dtype": "bf16",
            "fwd_tflops": 500.0, "bwd_tflops": 400.0}]
    f = tmp_path / "mine.json"
    f.write_text(json.dumps({"base": "h100", "measured": {"gemm": pts, "attention": att, "hbm_gb_per_s": 2800}}))
    dev = load_device(str(f))
    exact = _gemm(1, 4096, 4096, 4096)
    assert dev.op_time(exact) == pytest.approx(exact.flops / 700e12)
    mid = _gemm(1, 8192, 8192, 8192)  # equally far from both in log space: their mean
    assert dev.op_time(mid) == pytest.approx(mid.flops / 730e12)
    assert dev.attention_rate(_attn(True, causal=True)) == 400e12
    assert dev.op_time(OpCost(0.0, 0.0, 2.8e9, False, "bfloat16")) == pytest.approx(1e-3)
    # fp8 was not measured: the model's rate, the sustained share of it
    f8 = replace(exact, fp8=True)
    assert dev.op_time(f8) == pytest.approx(f8.flops / (1979e12 * HOPPER_SUSTAINED *
                                                        gemm_efficiency(H100_RATES, "fp8", 1, 4096, 4096, 4096)))


def test_a_device_files_sustained_share_scales_the_modelled_rates_not_the_measured() -> None:
    c = _gemm(1, 16384, 4096, 4096)
    at90 = device_from_json({"base": "h100", "efficiency": {"sustained": 0.9}})
    assert at90.rates.sustained == 0.9 and at90.tensor_clock == 0.9
    assert at90.op_time(c) == pytest.approx(H100_BENCH.op_time(c) / 0.9)
    assert at90.attention_rate(_attn(False)) == pytest.approx(H100_BENCH.attention_rate(_attn(False)) * 0.9)
    assert at90.peak == H100.peak and at90.hbm_rate == H100.hbm_rate  # MFU's peak and HBM unchanged
    assert device_from_json(at90.to_json()).rates == at90.rates
    assert device_from_json({"base": "a100-80gb"}).rates.sustained == 1.0
    for bad, shown in ((0, "0"), (1.5, "1.5"), ("x", '"x"')):
        with pytest.raises(ProgramError, match=rf"^--device efficiency.sustained: expected a fraction of the peak in "
                                               rf"\(0, 1\], got {shown}$"):
            device_from_json({"base": "h100", "efficiency": {"sustained": bad}})
    # a measured GEMM and attention pass are what the machine ran: not scaled; an unmeasured dtype is
    att = [{"batch": 1, "heads": 32, "seq": 4096, "head_dim": 128, "causal": False, "dtype": "bf16",
            "fwd_tflops": 500.0, "bwd_tflops": 400.0}]
    measured = device_from_json({"base": "h100", "efficiency": {"sustained": 0.5}, "measured": {
        "gemm": [{"m": 16384, "n": 4096, "k": 4096, "dtype": "bf16", "tflops": 700.0}], "attention": att}})
    assert measured.op_time(c) == pytest.approx(c.flops / 700e12)
    assert measured.attention_rate(_attn(False)) == 500e12
    f8 = replace(c, fp8=True)
    assert measured.op_time(f8) == pytest.approx(H100_BENCH.op_time(f8) / 0.5)


def test_a_power_limit_and_the_sustained_share_multiply() -> None:
    c = _gemm(1, 16384, 4096, 4096)
    clock = 835.5 / 989.5 + (1 - 835.5 / 989.5) * (500 - 400) / 300  # clock_at_power: NVIDIA's rated SKUs
    at500 = device_from_json({"base": "h100", "power_limit_w": 500})
    assert at500.rates.clock == pytest.approx(clock) and at500.rates.sustained == HOPPER_SUSTAINED
    assert at500.tensor_clock == pytest.approx(clock * HOPPER_SUSTAINED)
    assert at500.op_time(c) == pytest.approx(H100_BENCH.op_time(c) / (clock * HOPPER_SUSTAINED))
    both = device_from_json({"base": "h100", "power_limit_w": 500, "efficiency": {"sustained": 0.9}})
    assert both.tensor_clock == pytest.approx(clock * 0.9)
    assert both.op_time(c) == pytest.approx(H100_BENCH.op_time(c) / (clock * 0.9))


# -- a measured layer -----------------------------------------------------------------------------


def test_one_22b_layer_within_ten_percent_of_korthikanti_table_4() -> None:
    """Korthikanti et al. 2022, Table 4: one 22B layer (h 6144, 64 heads, seq 2048, micro-batch 4) on
    tp=8 A100s: 7.7 ms forward, 11.9 ms backward. The layer's ops (the gpt2 arch materialises the
    scores, as Megatron did in 2022) with their blocking communication."""
    _, plan, _ = plan_model("gpt-dropout-22b", "tp=8", "megatron", {"layers": 1, "batch": 4})
    plan = recost(plan, cost_model(plan.mesh, A100))
    comm: dict[int, float] = {}
    for r in plan.reshards:
        comm[r.op_index] = comm.get(r.op_index, 0.0) + r.plan.time_s
    t = {"forward": 0.0, "backward": 0.0}
    for i, op in enumerate(plan.program.ops):
        if op.layer == "layer 0":
            t[op.phase] += A100.op_time(op_cost(plan, i)) + comm.get(i, 0.0)
    assert t["forward"] + t["backward"] == pytest.approx(19.6e-3, rel=0.10)
    assert t["forward"] == pytest.approx(7.7e-3, rel=0.10) and t["backward"] == pytest.approx(11.9e-3, rel=0.12)
