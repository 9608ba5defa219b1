"""cuDNN's version selects the Hopper ``cudnn`` attention rates (docs/devices.md, "cuDNN's version"):
a device file's ``efficiency.cudnn_version`` takes the newest version cudnn-frontend measured that is
not newer than it, and scales the kernel's rates by that version's speed over 9.1.0's, both from
cudnn-frontend's ``benchmark/benchmark_results.csv`` (H200, clocks locked: 9.1.0 at b740542, 9.4.0 at
de355c7)."""

from __future__ import annotations

import pytest

from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.cost.devices import DEVICES, device_from_json
from spmdkit.cost.rates import attention_efficiency, cudnn_version_scale, measured_cudnn_version
from spmdkit.engine.facts import OpCost

H100 = DEVICES["h100"]


def _geo(pairs: list[tuple[float, float]]) -> float:
    prod = 1.0
    for new, old in pairs:
        prod *= new / old
    return float(prod ** (1 / len(pairs)))


def test_the_94_speed_ups_are_the_csv_ratios_by_hand() -> None:
    # the CSVs' own digits (cudnn BF16 TFlops/s fwd / bwd at 4k, 8k, 16k, 32k, 64k)
    fwd_causal = _geo([(613.49, 542.3175668926519), (645.95, 572.8628678140092), (649.99, 586.8151359973481),
                       (636.08, 577.3478523124705), (631.20, 567.0220986793877)])
    bwd_full = _geo([(535.06, 517.2529813957277), (536.95, 530.3655776577822), (546.53, 538.4599964919703),
                     (546.31, 536.2343244414764), (549.29, 535.4105193525595)])
    assert fwd_causal == pytest.approx(1.1163, abs=2e-4)
    assert cudnn_version_scale("9.4.0", False, True) == pytest.approx(fwd_causal, rel=2e-4)
    assert cudnn_version_scale("9.4.0", True, False) == pytest.approx(bwd_full, rel=2e-4)
    assert cudnn_version_scale("9.1.0", True, True) == cudnn_version_scale("", False, False) == 1.0


def test_the_newest_measured_version_not_newer_is_taken() -> None:
    assert measured_cudnn_version("9.11.0", "x") == "9.4.0"  # the MoE model zoo's long-context container
    assert measured_cudnn_version("9.4.0", "x") == "9.4.0"
    assert measured_cudnn_version("9.3.0", "x") == "9.1.0"  # TE's notebook: the presets'
    assert measured_cudnn_version("9.10", "x") == "9.4.0"  # 9.10 is newer than 9.4 (not a string order)


def test_a_device_files_cudnn_version_scales_the_cudnn_rates_only() -> None:
    dev = device_from_json({"base": "h100", "efficiency": {"cudnn_version": "9.11.0"}})
    assert dev.rates.cudnn_version == "9.4.0"
    for backward in (False, True):
        for causal in (False, True):
            was = attention_efficiency(H100.rates, "cudnn", backward, 16384, 128, causal)
            now = attention_efficiency(dev.rates, "cudnn", backward, 16384, 128, causal)
            assert now == pytest.approx(was * cudnn_version_scale("9.4.0", backward, causal))
    for kernel in ("fa2", "flash-attn"):
        assert attention_efficiency(dev.rates, kernel, False, 8192, 128, True) == \
            attention_efficiency(H100.rates, kernel, False, 8192, 128, True)
    # the whole op: Megatron's causal forward at 8k, 1.1163 x the preset's time-rate
    op = OpCost(flops=1e12, model_flops=1e12, bytes=0.0, dtype="bfloat16", attention=(False, 8192, 128, True),
                framework="megatron")
    assert dev.attention_rate(op) / H100.attention_rate(op) == pytest.approx(1.1163, abs=2e-4)
    # 9.1-9.3 are the presets' own; the version survives a round trip through to_json
    assert device_from_json({"base": "h100", "efficiency": {"cudnn_version": "9.3.0"}}).rates == H100.rates
    assert device_from_json(dev.to_json()).rates.cudnn_version == "9.4.0"


def test_a_version_without_measured_rates_is_refused_naming_the_field() -> None:
    with pytest.raises(ProgramError, match=r"^--device efficiency.cudnn_version: no Hopper rates measured for "
                                           r"cuDNN 9.0.0 \(the oldest measured is 9.1.0; measured: 9.1.0, 9.4.0\)$"):
        device_from_json({"base": "h100", "efficiency": {"cudnn_version": "9.0.0"}})
    with pytest.raises(SpmdError, match=r"^--device efficiency.cudnn_version: expected a cuDNN version such as "
                                        r"\"9.4.0\", got \"nine\"$"):
        device_from_json({"base": "h100", "efficiency": {"cudnn_version": "nine"}})
    with pytest.raises(ProgramError, match="cudnn_version: expected a cuDNN version"):
        device_from_json({"base": "h100", "efficiency": {"cudnn_version": 9.4}})


def test_a_version_on_a_device_without_cudnn_rates_is_refused() -> None:
    # the A100 presets have no cudnn kernel: a version would silently change nothing
    with pytest.raises(ProgramError, match=r"^--device efficiency.cudnn_version: the device has no cudnn attention "
                                           r"rates to scale"):
        device_from_json({"base": "a100", "efficiency": {"cudnn_version": "9.4.0"}})
