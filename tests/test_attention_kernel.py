"""--attention-kernel: the flash-attention kernel a run's model code calls, where it is not the
framework's, and the ``triton`` kernel's rates (flash-attention's pre-MLIR Triton kernel, MPT's
``attn_impl: triton``), FlashAttention v1's, which its docstring compares it with, fitted to the
flash-attention repo's "FlashAttention" bars on A100 (the FlashAttention-2 paper's Figure 4) and H100
(docs/devices.md, "The pre-MLIR Triton kernel")."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.cost.devices import DEVICES
from spmdkit.cost.rates import (
    A100_RATES,
    CUDNN_H100_SHAPE,
    FA1_A100_FIG4,
    FA1_H100_PAIR,
    FA2_A100_FIG4,
    FA2_A100_SHAPE,
    FA2_H100_SHAPE,
    H100_RATES,
    H200_RATES,
    TE_ATTENTION_CONFIGS,
    TE_H100_MS,
    TRITON_A100_SHAPE,
    TRITON_H100_SHAPE,
    Rates,
    attention_efficiency,
)
from spmdkit.engine.facts import OpCost
from spmdkit.program.runtime import Runtime

A100, H100 = DEVICES["a100-80gb"], DEVICES["h100"]


def _attn(backward: bool, seq: int, hd: int = 128, causal: bool = True, kernel: str = "") -> OpCost:
    f = 4.0 * 16 * seq * seq * hd * (0.5 if causal else 1.0) * (2.5 if backward else 1.0)
    return OpCost(f, f, 1e6, True, "bfloat16", attention=(backward, seq, hd, causal), attention_kernel=kernel)


def _pair_tflops(seq: int, hd: int, causal: bool, rates: Rates = A100_RATES, peak: float = 312) -> float:
    """The model's forward + backward TFLOP/s as the figures count it: 3.5 forwards' FLOPs over the
    two passes' time at the fractions of the GPU's bf16 peak."""
    f = attention_efficiency(rates, "triton", False, seq, hd, causal)
    b = attention_efficiency(rates, "triton", True, seq, hd, causal)
    return peak * 3.5 / (1 / f + 2.5 / b)


def test_triton_rate_at_a_published_point() -> None:
    # A100, FlashAttention v1 (Figure 4 (d)), causal, head dim 128, seq 2k: the bar 69 TFLOP/s. By
    # hand: the pair's asymptote 0.3102 of 312, the causal share 0.8932, s / (s + S0) with s = 2048 / 2
    # and S0 = 136 (no head-dim term: D0 = 0): 0.3102 x 0.8932 x 1024 / 1160 x 312 = 76.31 TFLOP/s
    assert FA1_A100_FIG4[(True, 128)][2] == 69
    assert _pair_tflops(2048, 128, True) == pytest.approx(0.3102 * 0.8932 * 1024 / 1160 * 312, rel=1e-6)
    assert _pair_tflops(2048, 128, True) == pytest.approx(76.31, abs=0.01)
    # causal d 128 at 16k (the bar 83): 0.3102 x 0.8932 x 8192 / 8328 x 312 = 85.0 (it was 79.1 on
    # the "FlashAttention Triton" bars' fit, 0.3194 x 0.804 x 8192 / 8300 x 312)
    assert _pair_tflops(16384, 128, True) == pytest.approx(85.04, abs=0.01)
    # H100 (the repo's H100 figure), causal d 128 at 16k, the bar 137: 0.1559 x 0.9033 x 8192 / 8284
    # x 989.5 = 137.8, under half FlashAttention-2's 328 in the same panel
    assert FA1_H100_PAIR[(True, 128)][5] == 137
    assert _pair_tflops(16384, 128, True, H100_RATES, 989.5) == pytest.approx(137.80, abs=0.01)
    assert _pair_tflops(16384, 128, True, H100_RATES, 989.5) < 0.5 * 328
    # the split keeps the fa2 entry's forward / backward ratio on both GPUs
    for rates in (A100_RATES, H100_RATES):
        f = attention_efficiency(rates, "triton", False, 8192, 128, True)
        b = attention_efficiency(rates, "triton", True, 8192, 128, True)
        assert f / b == pytest.approx(0.70 / 0.58)
    # far below FlashAttention-2 at long causal sequences (Figure 4 (d) at 16k: 83 against 189)
    fa2 = attention_efficiency(A100_RATES, "fa2", True, 16384, 128, True)
    assert attention_efficiency(A100_RATES, "triton", True, 16384, 128, True) < 0.5 * fa2


def test_the_option_picks_the_kernel_on_the_device() -> None:
    fwd = A100.attention_rate(_attn(False, 4096, kernel="triton"))
    want = 312e12 * attention_efficiency(A100_RATES, "triton", False, 4096, 128, True) * A100.tensor_clock
    assert fwd == pytest.approx(want)
    assert fwd < 0.6 * A100.attention_rate(_attn(False, 4096))  # the framework's fa2 without the option (0.51)


def test_unknown_kernel_names_the_option_and_the_choices() -> None:
    with pytest.raises(ProgramError, match=r"--attention-kernel 'xformers': unknown kernel, expected one of "
                                           r"fa2, flash-attn, cudnn, triton"):
        Runtime(attention_kernel="xformers")
    assert issubclass(ProgramError, SpmdError)


def test_a_kernel_without_rates_on_the_gpu_is_refused() -> None:
    # cuDNN's fused attention has no A100 rates; the Triton kernel has H100 rates (FlashAttention v1's)
    with pytest.raises(ProgramError, match=r"--attention-kernel cudnn: no published rates of it on .*A100.*"
                                           r"kernels with rates there: fa2, flash-attn, triton"):
        A100.attention_rate(_attn(False, 4096, kernel="cudnn"))
    assert H100.attention_rate(_attn(False, 4096, kernel="triton")) < 0.5 * H100.attention_rate(_attn(False, 4096))


def _plan(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    from spmdkit.cli import main
    rc = main(["plan", "--model", "gpt2-small", "--mesh", "dp=2", "--strategy", "dp", "--json", *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_the_command_line_option(capsys: pytest.CaptureFixture[str]) -> None:
    import json
    rc, out, _ = _plan(["--device", "a100-80gb"], capsys)
    rc2, out2, _ = _plan(["--device", "a100-80gb", "--attention-kernel", "triton"], capsys)
    assert rc == rc2 == 0
    fa2, triton = json.loads(out)["step"], json.loads(out2)["step"]
    assert triton["compute_total_s"] > fa2["compute_total_s"]  # the Triton kernel is slower than FlashAttention-2
    rc, _, err = _plan(["--device", "a100-80gb", "--attention-kernel", "xformers"], capsys)
    assert rc != 0 and "--attention-kernel 'xformers': unknown kernel, expected one of fa2, flash-attn, cudnn, triton" in err
    rc, _, err = _plan(["--device", "a100-80gb", "--attention-kernel", "cudnn"], capsys)
    assert rc != 0 and "--attention-kernel cudnn: no published rates of it on" in err


def test_a_device_file_gives_a_kernel_its_shape() -> None:
    from spmdkit.cost.devices import device_from_json
    dev = device_from_json({"base": "h100", "efficiency": {"attention": {"triton": {"fwd": 0.3, "bwd": 0.25}},
                                                            "attention_shape": {"triton": {"s0": 100, "d0": 0,
                                                                                           "causal": 0.8}}}})
    assert dev.rates.attention_shape["triton"] == (100.0, 0.0, 0.8)
    # causal 8k: the kernel sees 4096, 4096 / 4196 of 0.3, times the causal share 0.8
    assert attention_efficiency(dev.rates, "triton", False, 8192, 64, True) == pytest.approx(0.3 * 4096 / 4196 * 0.8)
    with pytest.raises(ProgramError, match=r"efficiency\.attention_shape\.triton: expected an object with s0, d0 and "
                                           r"causal"):
        device_from_json({"base": "a100", "efficiency": {"attention_shape": {"triton": {"s0": 100}}}})
    with pytest.raises(ProgramError, match=r"efficiency\.attention_shape: unknown kernel 'flex'"):
        device_from_json({"base": "a100", "efficiency": {"attention_shape": {"flex": {"s0": 1, "d0": 1, "causal": 1}}}})


# -- each kernel's shape from its own figures (benchmarks/fit_attention.py) ------------------------------


def _fit_module() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "fit_attention.py"
    spec = importlib.util.spec_from_file_location("fit_attention_bench", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["fit_attention_bench"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(("gpu", "kernel", "preset", "rms"), [
    ("a100", "triton", TRITON_A100_SHAPE, 0.1123), ("h100", "triton", TRITON_H100_SHAPE, 0.0955),
    ("a100", "triton-fig4", (108.0, 0.0, 0.804), 0.061), ("a100", "fa2", FA2_A100_SHAPE, 0.021),
    ("h100", "fa2", FA2_H100_SHAPE, 0.038), ("h100", "cudnn", CUDNN_H100_SHAPE, 0.070)])
def test_the_fit_gives_the_preset_shape_and_reproduces_its_points(gpu: str, kernel: str, preset: tuple[float, ...],
                                                                   rms: float) -> None:
    fa = _fit_module()
    f = fa.fit(gpu, kernel)
    assert (f.s0, f.d0) == preset[:2] and f.share == pytest.approx(preset[2], abs=5e-4)
    assert f.rms == pytest.approx(rms, abs=5e-4)
    fitted = [p for p in fa.points(gpu, kernel) if p.head_dim <= 128]
    errs = [math.log(fa.model(f, p, gpu) / p.tflops) for p in fitted]
    assert math.sqrt(sum(e * e for e in errs) / len(errs)) == pytest.approx(f.rms, rel=1e-9)
    assert max(abs(e) for e in errs) < 4 * f.rms


def test_the_fa2_a100_fit_at_a_published_point() -> None:
    # Figure 4 (d), FlashAttention-2, causal, d 128, 4k: 173 TFLOP/s; the fit's pair asymptote 0.668
    # of 312 x the share 0.927 x 2048 / (2048 + 228) (D0 20 is 1 at d 128) = 173.9
    fa = _fit_module()
    f = fa.fit("a100", "fa2")
    assert FA2_A100_FIG4[(True, 128)][3] == 173
    assert fa.model(f, fa.Point("pair", True, 128, 4096, 173), "a100") == pytest.approx(173.9, abs=0.1)


def test_attention_efficiency_gives_each_kernel_its_fitted_shape() -> None:
    # fa2 on A100, forward, causal, d 64, 4k: 0.70 x 2048/2276 x (64/84)/(128/148) x 0.927 = 0.5144
    got = attention_efficiency(A100_RATES, "fa2", False, 4096, 64, True)
    assert got == pytest.approx(0.70 * 0.899824 * 0.880952 * 0.927, rel=1e-5)
    assert got == pytest.approx(0.5144, abs=1e-4)
    # cudnn on H100, backward, causal, d 128, 8k: the asymptote 538.5 / 989.5 / (16384 / 16592) =
    # 0.55112 (cuDNN 9.1.0's backward at 16k, cudnn-frontend), x 4096 / 4304 x 0.894 = 0.46889
    got = attention_efficiency(H100_RATES, "cudnn", True, 8192, 128, True)
    assert got == pytest.approx(538.5 / 989.5 / (16384 / 16592) * 4096 / 4304 * 0.894, rel=1e-9)
    assert got == pytest.approx(0.4689, abs=1e-4)
    # fa2 on H100 (and H200, the same chip), forward, non-causal, d 64, 2k: 329.483 / 989.5 / (4608 / 4816)
    # = 0.34800, x 2048 / 2256 x (64/84)/(128/148) = 0.27831
    for rates in (H100_RATES, H200_RATES):
        assert attention_efficiency(rates, "fa2", False, 2048, 64, False) == pytest.approx(0.27831, abs=1e-5)


# -- Transformer Engine's attention benchmark on H100, held out (benchmarks/fit_attention.py) ---------------


def test_te_benchmark_times_give_the_measured_tflops() -> None:
    # test_3 (b 2, h 32, kv groups 4, d 128, s 8192, causal): forward 4 x 2 x 32 x 8192^2 x 128 =
    # 2.1990e12 FLOPs, backward 2.5x, halved causal: 3.8482e12; cuDNN 9.3.0 7.4875 ms -> 513.96
    # TFLOP/s, flash-attn 2.4.2 11.8879 ms -> 323.71 (H100 SXM5, TE's notebook at 88c0c9143)
    fa = _fit_module()
    assert TE_ATTENTION_CONFIGS["test_3"] == (2, 32, 4, 128, 8192, True, False)
    assert fa.te_flops("test_3") == pytest.approx(3.5 * 4 * 2 * 32 * 8192**2 * 128 / 2)
    assert fa.te_tflops("sxm", "cudnn", "test_3") == pytest.approx(513.96, abs=0.01)
    assert fa.te_tflops("sxm", "fa2", "test_3") == pytest.approx(323.71, abs=0.01)
    # test_0 (b 2, h 16, d 64, s 512, no mask): 3.5 x 4 x 2 x 16 x 512^2 x 64 = 7.5162e9 FLOPs;
    # cuDNN 0.0340 ms -> 221.06; the PCIe card (cuDNN 9.2.0) 0.0638 ms -> 117.81
    assert fa.te_tflops("sxm", "cudnn", "test_0") == pytest.approx(221.06, abs=0.01)
    assert fa.te_tflops("pcie", "cudnn", "test_0") == pytest.approx(117.81, abs=0.01)
    assert TE_H100_MS["sxm"][("cudnn", "test_2")] == 0.9332 and ("fa2", "test_2") not in TE_H100_MS["sxm"]


def test_te_held_out_check_prices_each_point_with_the_preset_and_the_fit() -> None:
    # cuDNN at test_3, the preset: forward 641.9 / 989.5 / (16384 / 16592) x 4096 / 4304 x 0.894 of
    # 989.5 = 553.06, backward (538.5) 463.97; the pair 3.5 / (1/553.06 + 2.5/463.97) = 486.4, 0.946
    # of the measured 514.0 (the bias config is not checked: the form has no bias)
    fa = _fit_module()
    checks = {(c.sku, c.kernel, c.test): c for c in fa.held_out({k: fa.fit("h100", k) for k in ("fa2", "cudnn")})}
    assert not [k for k in checks if k[2] == "test_2"] and len(checks) == 12
    c = checks[("sxm", "cudnn", "test_3")]
    fwd = 641.9 * 16592 / 16384 * 4096 / 4304 * 0.894
    bwd = 538.5 * 16592 / 16384 * 4096 / 4304 * 0.894
    assert c.preset == pytest.approx(3.5 / (1 / fwd + 2.5 / bwd), rel=1e-9)
    assert c.preset == pytest.approx(486.4, abs=0.1) and c.measured == pytest.approx(514.0, abs=0.1)
    # the fit's own asymptotes (forward 0.6298, backward 0.5428 of 989.5) give 475.7
    assert c.fitted == pytest.approx(475.7, abs=0.1)
    # the PCIe card on its own peak, 756.5: flash-attn at test_3, the preset's fraction x 756.5
    p = checks[("pcie", "fa2", "test_3")]
    assert p.preset == pytest.approx(checks[("sxm", "fa2", "test_3")].preset / 989.5 * 756.5, rel=1e-9)


def test_with_te_the_h100_fits_move_little_and_the_default_fits_not_at_all() -> None:
    fa = _fit_module()
    assert len(fa.points("h100", "cudnn", with_te=True)) == len(fa.points("h100", "cudnn")) + 3
    f = fa.fit("h100", "cudnn", with_te=True)
    assert (f.s0, f.d0) == (228.0, 76.0) and f.share == pytest.approx(0.915, abs=5e-4)
    g = fa.fit("h100", "fa2", with_te=True)
    assert (g.s0, g.d0) == (220.0, 20.0) and g.share == pytest.approx(0.918, abs=5e-4)
    presets = fa.with_te_presets()
    # the cited 641.9 TFLOP/s at 16k over the new s / (s + 228)
    assert presets["cudnn"][1][0] == pytest.approx(641.9 / 989.5 * (16384 + 228) / 16384, rel=1e-9)
    assert H100_RATES.attention_shape["cudnn"] == CUDNN_H100_SHAPE == (208.0, 72.0, 0.894)


def test_attention_whatif_patches_the_hopper_presets_and_names_the_kernel_per_run() -> None:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "attention_whatif.py"
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location("attention_whatif_bench", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    saved = {k: DEVICES[k] for k in mod.HOPPER}
    base = mod.fidelity.foundry_argv
    try:
        mod.patch(0.838)
        r = DEVICES["h800"].rates
        assert r.attention_shape["cudnn"] == (228.0, 76.0, 0.915) and r.sustained == 0.838
        assert r.attention["cudnn"][0] == pytest.approx(641.9 / 989.5 * (16384 + 228) / 16384, rel=1e-9)
        mod.kernels(["nemo2403=fa2"], ["nemo2403_b"])
        row = {"id": "nemo2403_a", "model": {}, "parallelism": {}, "hardware": {}}
        assert mod.fidelity.foundry_argv(row, [])[-2:] == ["--attention-kernel", "fa2"]
        assert "--attention-kernel" not in mod.fidelity.foundry_argv({**row, "id": "nemo2403_b"}, [])
        assert "--attention-kernel" not in mod.fidelity.foundry_argv({**row, "id": "nemo2407_a"}, [])
    finally:
        DEVICES.update(saved)
        mod.fidelity.foundry_argv = base


def test_the_triton_presets_are_the_flashattention_v1_fits_on_both_gpus() -> None:
    # the pair asymptote each preset's passes give (3.5 over 1/f + 2.5/b) is its fit's, to 4 digits
    fa = _fit_module()
    for gpu, rates in (("a100", A100_RATES), ("h100", H100_RATES)):
        f, b = rates.attention["triton"]
        assert 3.5 / (1 / f + 2.5 / b) == pytest.approx(fa.fit(gpu, "triton").asymptotes["pair"], abs=5e-5)
    assert A100_RATES.attention_shape["triton"] == TRITON_A100_SHAPE == (136.0, 0.0, 0.8932)
    assert H100_RATES.attention_shape["triton"] == H200_RATES.attention_shape["triton"] == TRITON_H100_SHAPE


def test_llm_foundry_rows_run_the_triton_kernel_on_every_gpu() -> None:
    # MPT's attn_impl: triton on A100 and H100 alike (submit_benchmarks.py's default at all three commits)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import fidelity_foundry
    for gpu in ("A100 40GB", "A100 80GB", "H100 80GB"):
        assume: list[str] = []
        assert fidelity_foundry.attention_argv({"hardware": {"gpu": gpu}}, assume) == ["--attention-kernel", "triton"]
        assert "FlashAttention v1's rates" in assume[0]
