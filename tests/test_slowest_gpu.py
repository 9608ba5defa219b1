"""The slowest GPU of a step (``efficiency.speed_sd``, :meth:`spmdkit.cost.devices.Device.slowdown`):
GPUs of one SKU settle at different sustained speeds (Sinha et al., SC22: 8% average variation, the
box plot's whisker span of 4 interquartile ranges over the median), a synchronous step waits for the
slowest of its GPUs, so every tensor-core kernel takes ``1 + sd x E[max of n normals]`` of the median
GPU's time. The expected maximum against the published tables, the factor at 1, 8 and 128 GPUs by
hand, a plan's step growing with its GPUs at a fixed load per GPU, a device file turning it off, a
bad value refused, the JSON, the report and the pipeline's count."""

from __future__ import annotations

import io
import json
import math
from dataclasses import replace

import pytest

from spmdkit.cli import main
from spmdkit.core.errors import ProgramError
from spmdkit.cost.devices import DEVICES, cost_model, device_from_json, expected_max_normal, recost
from spmdkit.cost.rates import GPU_SPEED_SD
from spmdkit.cost.step import StepEstimate, estimate_step
from spmdkit.engine.facts import OpCost
from spmdkit.outputs.report import write_estimate
from spmdkit.planner.planning import plan_model
from spmdkit.planner.search import search_meshes

H100 = DEVICES["h100"]
#: 8% = 4 IQR / median (the artifact's plot_aggregated.py), IQR = 2 x 0.6744898 sd for a normal spread
SD = 0.08 / (4 * 2 * 0.6744898)


def test_the_expected_largest_of_n_normal_draws_is_the_tables() -> None:
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-9)  # exact
    assert expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), abs=1e-9)  # exact
    assert expected_max_normal(8) == pytest.approx(1.42360, abs=1e-5)  # Harter 1961 / Tippett 1925
    assert expected_max_normal(10) == pytest.approx(1.53875, abs=1e-5)
    assert expected_max_normal(100) == pytest.approx(2.50759, abs=1e-5)
    # 128 by another route: n x integral of x phi(x) Phi(x)^(n-1), trapezoids of 1e-3 over [-8, 8]
    n, h = 128, 1e-3
    xs = [-8 + i * h for i in range(16001)]
    f = [n * x * math.exp(-x * x / 2) / math.sqrt(2 * math.pi) * (0.5 * math.erfc(-x / math.sqrt(2))) ** (n - 1)
         for x in xs]
    assert expected_max_normal(128) == pytest.approx(h * (sum(f) - (f[0] + f[-1]) / 2), abs=1e-6)
    assert expected_max_normal(128) == pytest.approx(2.59460, abs=1e-5)


def test_the_slowdown_at_1_8_and_128_gpus_by_hand() -> None:
    assert GPU_SPEED_SD == pytest.approx(SD) and SD == pytest.approx(0.014826, abs=1e-6)
    assert H100.rates.speed_sd == GPU_SPEED_SD and DEVICES["a100-80gb"].rates.speed_sd == GPU_SPEED_SD
    assert H100.gpus == 1 and H100.slowdown == 1.0
    assert H100.at(8).slowdown == pytest.approx(1 + SD * 1.42360, abs=1e-6)  # 1.02111
    assert H100.at(128).slowdown == pytest.approx(1 + SD * 2.59460, abs=1e-6)  # 1.03847
    assert H100.at(8).slowdown == pytest.approx(1.02111, abs=1e-5)
    assert H100.at(128).slowdown == pytest.approx(1.03847, abs=1e-5)
    # one object per count (the step's caches key on it); lockstep keeps the larger count
    assert H100.at(8) is H100.at(8) and H100.at(8).at(1) is H100
    assert H100.lockstep(128).lockstep(8).gpus == 128 and H100.lockstep(8).gpus == 8


def _gemm() -> OpCost:
    m, n, k = 16384, 4096, 4096
    f = 2.0 * m * n * k
    return OpCost(f, f, 2.0 * (m * k + k * n + m * n), True, "bfloat16", gemms=((1, m, n, k),))


def test_tensor_core_kernels_take_the_slowest_gpus_time_memory_bound_ones_do_not() -> None:
    c = _gemm()
    assert H100.at(128).op_time(c) > H100.at(8).op_time(c) > H100.op_time(c)
    for n in (8, 128):
        d = H100.at(n)
        assert d.op_time(c) == pytest.approx(H100.op_time(c) * d.slowdown)
        assert d.tensor_clock == pytest.approx(H100.tensor_clock / d.slowdown)
    copy = OpCost(1e6, 1e6, 4e9, False, "float32")  # bytes-bound: HBM's clock is not the SMs'
    assert H100.at(128).op_time(copy) == H100.op_time(copy)
    # a measured GEMM is one GPU's: the slowest of the step's runs it slower all the same
    measured = device_from_json({"base": "h100", "measured": {
        "gemm": [{"m": 16384, "n": 4096, "k": 4096, "dtype": "bf16", "tflops": 700.0}]}})
    assert measured.at(128).op_time(c) == pytest.approx(c.flops / 700e12 * H100.at(128).slowdown)


def _step(dp: int, device=H100):  # type: ignore[no-untyped-def]
    _, plan, _ = plan_model("llama-7b", f"dp={dp}", "dp", {"layers": 2, "batch": dp, "seq": 2048})
    plan = recost(plan, cost_model(plan.mesh, device))
    return estimate_step(plan, device, dp * 2048)


def test_a_plans_step_grows_with_its_gpus_at_a_fixed_load_per_gpu() -> None:
    e1, e8, e128 = _step(1), _step(8), _step(128)
    assert e1.device.gpus == 1 and e8.device.gpus == 8 and e128.device.gpus == 128
    assert e1.slowest_gpu_s == 0.0 < e8.slowest_gpu_s < e128.slowest_gpu_s
    # every rank computes the same (plain dp): the compute differs by the slowest GPU's share alone
    assert e8.compute_total_s - e1.compute_total_s == pytest.approx(e8.slowest_gpu_s, rel=1e-9)
    assert e128.compute_total_s - e1.compute_total_s == pytest.approx(e128.slowest_gpu_s, rel=1e-9)
    # and that share is the tensor-core time's: (slowdown - 1) of the median GPU's matmul time
    assert e128.slowest_gpu_s == pytest.approx(e1.matmul_s * (H100.at(128).slowdown - 1), rel=0.05)
    assert e1.step_overlap_s < e8.step_overlap_s < e128.step_overlap_s
    got = e128.to_json()["slowest_gpu"]
    assert got == {"gpus": 128, "speed_sd": GPU_SPEED_SD, "expected_max_sd": expected_max_normal(128),
                   "slowdown": H100.at(128).slowdown, "compute_s": e128.slowest_gpu_s}
    out = io.StringIO()
    write_estimate(e128, out)
    assert "slowest GPU: the step waits for the slowest of its 128 GPUs, expected 2.59 standard deviations " \
           "(1.48% each, efficiency.speed_sd) slower than the median one: its tensor-core kernels 1.0385 x" \
           in out.getvalue()


def test_a_device_file_sets_it_to_0_and_a_bad_value_is_refused() -> None:
    off = device_from_json({"base": "h100", "efficiency": {"speed_sd": 0}})
    assert off.rates.speed_sd == 0.0 and off.at(128).slowdown == 1.0
    e1, e128 = _step(1, off), _step(128, off)
    assert e128.slowest_gpu_s == 0.0 and e128.compute_total_s == pytest.approx(e1.compute_total_s, rel=1e-12)
    assert device_from_json(off.to_json()).rates == off.rates
    wide = device_from_json({"base": "h100", "efficiency": {"speed_sd": 0.03}})
    assert wide.at(8).slowdown == pytest.approx(1 + 0.03 * 1.42360, abs=1e-6)
    for bad, shown in ((-0.01, "-0.01"), (0.6, "0.6"), ("x", '"x"'), (True, "true"), (math.nan, "NaN")):
        with pytest.raises(ProgramError, match=r"^--device efficiency.speed_sd: expected the standard deviation of a "
                                               r"GPU's tensor-core time over the GPUs of its SKU, a fraction from 0 "
                                               rf"to 0.5 of the median GPU's \(0: none\), got {shown}$"):
            device_from_json({"base": "h100", "efficiency": {"speed_sd": bad}})


def _plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(["plan", "--model", "tiny-llama", "--device", "h100", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_the_cli_counts_the_whole_mesh_a_pipelines_too(capsys: pytest.CaptureFixture[str]) -> None:
    flat = _plan_json(capsys, "--mesh", "dp=4,tp=2")
    assert flat["step"]["slowest_gpu"]["gpus"] == 8  # type: ignore[index]
    assert flat["step"]["slowest_gpu"]["slowdown"] == pytest.approx(H100.at(8).slowdown)  # type: ignore[index]
    piped = _plan_json(capsys, "--mesh", "pp=2,dp=2,tp=2")
    assert piped["pipeline"]["slowest_gpu"]["gpus"] == 8  # type: ignore[index]
    assert "compute_s" not in piped["pipeline"]["slowest_gpu"]  # type: ignore[index,operator]
    assert replace(H100, gpus=1).slowdown == 1.0


def test_the_search_prices_every_configuration_on_all_its_gpus() -> None:
    res = search_meshes("tiny-gpt2", 4, "h100", recompute=["none"], strategies=["dp", "megatron"])
    flat = [c for c in res.candidates if isinstance(c.estimate, StepEstimate)]
    assert flat and {c.estimate.device.gpus for c in flat} == {4}  # dp=4, tp=4, dp=2 x tp=2 alike
    assert all(c.estimate.to_json()["slowest_gpu"]["slowdown"] == H100.at(4).slowdown for c in flat)
