"""``--attention-kernel flash-attn``: FlashAttention-2 as Dao's flash-attn package builds it (what
Transformer Engine's FlashAttention backend calls with ``NVTE_FUSED_ATTN=0``), distinct on H100 from
torch's SDPA build (``fa2``): its forward asymptote is the FlashAttention-3 paper's
"FlashAttention-2" bar (370 TFLOP/s, non-causal, head dim 128, 16k), its backward the same paper's
322 and its shape the ``fa2`` fit's (docs/devices.md, "Dao's flash-attn package")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import load_script
from spmdkit.core.errors import ProgramError
from spmdkit.cost.devices import DEVICES, device_from_json
from spmdkit.cost.rates import A100_RATES, FA3_H100_FWD, H100_RATES, H200_RATES, attention_efficiency
from spmdkit.engine.facts import OpCost


def test_h100_rate_at_the_cited_point() -> None:
    # the FlashAttention-3 paper's forward figure, FlashAttention-2, non-causal, d 128, 16k: 370 TFLOP/s
    assert FA3_H100_FWD[("fa2", False, 128)][-1] == 370
    for rates in (H100_RATES, H200_RATES):
        assert attention_efficiency(rates, "flash-attn", False, 16384, 128, False) * 989.5 == pytest.approx(370.0)
        assert attention_efficiency(rates, "flash-attn", True, 16384, 128, False) * 989.5 == pytest.approx(322.0)
    # causal, d 128, 8k, forward, by hand: 370 / 989.5 / (16384 / 16592) = 0.37867, x 4096 / 4304
    # (the fa2 fit's S0 208 over the half sequence) x 0.904 (its causal share) = 0.32578
    got = attention_efficiency(H100_RATES, "flash-attn", False, 8192, 128, True)
    assert got == pytest.approx(0.32578, abs=1e-5)
    # torch's SDPA build (fa2) forwards slower: 329.483 at 4608 tokens; the backward is the same figure
    assert got / attention_efficiency(H100_RATES, "fa2", False, 8192, 128, True) == pytest.approx(
        370 / (16384 / 16592) / (329.483 / (4608 / 4816)), rel=1e-9)
    assert H100_RATES.attention["flash-attn"][1] == H100_RATES.attention["fa2"][1]


def test_a100_reuses_the_fa2_paper_rates() -> None:
    # the FlashAttention-2 paper's A100 figures are of Dao's package: the fa2 entry is already it
    assert A100_RATES.attention["flash-attn"] == A100_RATES.attention["fa2"] == (0.70, 0.58)
    for args in ((False, 4096, 64, True), (True, 2048, 128, False)):
        assert attention_efficiency(A100_RATES, "flash-attn", *args) == attention_efficiency(A100_RATES, "fa2", *args)


def _attn(kernel: str) -> OpCost:
    f = 4.0 * 16 * 4096 * 4096 * 128 * 0.5
    return OpCost(f, f, 1e6, True, "bfloat16", attention=(False, 4096, 128, True), attention_kernel=kernel)


def test_the_option_and_the_device_file() -> None:
    h100 = DEVICES["h100"]
    fa2, dao, cudnn = (h100.attention_rate(_attn(k)) for k in ("fa2", "flash-attn", "cudnn"))
    assert fa2 < dao < cudnn
    dev = device_from_json({"base": "h100", "efficiency": {"attention": {"flash-attn": {"fwd": 0.4, "bwd": 0.3}}}})
    assert dev.rates.attention["flash-attn"] == (0.4, 0.3)
    with pytest.raises(ProgramError, match=r"efficiency\.attention: unknown kernel 'flash_attn'"):
        device_from_json({"base": "h100", "efficiency": {"attention": {"flash_attn": {"fwd": 0.4, "bwd": 0.3}}}})


def test_the_command_line_option(capsys: pytest.CaptureFixture[str]) -> None:
    from spmdkit.cli import main
    steps = {}
    for kernel in ("fa2", "flash-attn", "cudnn"):
        rc = main(["plan", "--model", "gpt2-small", "--mesh", "dp=2", "--strategy", "dp", "--json",
                   "--device", "h100", "--attention-kernel", kernel])
        assert rc == 0
        steps[kernel] = json.loads(capsys.readouterr().out)["step"]["compute_total_s"]
    assert steps["fa2"] > steps["flash-attn"] > steps["cudnn"]


def _fidelity() -> Any:
    return load_script("fidelity_bench_flash_attn", Path(__file__).resolve().parents[1] / "benchmarks" / "fidelity.py")


def test_nemo_2407_runs_are_planned_with_the_kernel_their_launcher_config_ran(tmp_path: Path) -> None:
    # NeMo-Framework-Launcher 1ab2c781 conf/config.yaml: NVTE_FUSED_ATTN: 0 (flash-attn); GPT-3 175B's
    # 128-GPU example script turns cuDNN back on, its 512-GPU mlperf yaml is left on cuDNN (inconclusive)
    fid = _fidelity()
    rows = {r["id"]: r for r in json.loads(fid.RUNS.read_text()) if r["id"].startswith("nemo2407")}
    assert len(rows) == 12
    kernels = {}
    for rid, row in rows.items():
        argv = fid.express(row, tmp_path).argv
        kernels[rid] = argv[argv.index("--attention-kernel") + 1] if "--attention-kernel" in argv else None
    assert {rid for rid, k in kernels.items() if k is None} == set(fid.NEMO_CUDNN_RUNS) == {
        "nemo2407_h100_fp8_gpt3_175b_128gpu", "nemo2407_h100_fp8_gpt3_175b_512gpu"}
    assert sum(k == "flash-attn" for k in kernels.values()) == 10
    case = fid.express(rows["nemo2407_h100_fp8_llama2_7b_8gpu"], tmp_path)
    assert any("NVTE_FUSED_ATTN: 0" in a for a in case.assumptions)
