"""benchmarks/device_check.py, the prepared check of the cost model on a lent GPU: its dry run (every
part's plumbing on the CPU at tiny sizes) and its one-line refusal where there is no CUDA GPU."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from spmdkit.cost.devices import load_device
from spmdkit.cost.rates import HOPPER_SUSTAINED
from spmdkit.execute.calibrate import AttentionShape, Timing, measure_attention

torch = pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "device_check.py"


def _script() -> Any:
    """The script as a module (registered under its name: its dataclasses look it up)."""
    if "device_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["device_check"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["device_check"]


@pytest.fixture(scope="module")
def dry(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("device_check")
    assert _script().main(["--dry-run", "--out", str(out)]) == 0
    return json.loads((out / "device_check.json").read_text()), out


def _rows(d: dict[str, Any], part: str, start: str) -> list[dict[str, Any]]:
    return [r for r in d["parts"][part]["rows"] if r["what"].startswith(start)]


def test_dry_run_runs_every_part(dry: tuple[dict[str, Any], Path]) -> None:
    d, _out = dry
    assert d["dry_run"] is True and d["preset"] == "h100" and d["device"] == "CPU (dry run)"
    for part in ("rates", "open", "step"):
        p = d["parts"][part]
        assert p["status"] == "done", (part, p.get("errors"))
        assert "errors" not in p and p["seconds"] > 0
        for r in p["rows"]:
            assert set(r) >= {"what", "measured", "unit", "model", "model_training"}
    assert _rows(d, "rates", "gemm fp32 M=64 N=64 K=64")
    assert {r["pass"] for r in _rows(d, "rates", "attention default")} == {"fwd", "bwd"}
    assert _rows(d, "rates", "HBM copy") and _rows(d, "rates", "eager launch")
    assert len(_rows(d, "open", "ring block")) == 9  # 3 blocks x (fwd, bwd, fwd + rerun + bwd)
    assert _rows(d, "open", "ring step a layer")[0]["table2_implied_tflops"]["cp4"] == 185.0
    grouped = _rows(d, "open", "grouped GEMM")
    assert len(grouped) == 8  # ep 2; balanced and random; up and down; fwd and bwd
    assert {r["how"] for r in grouped} <= {"torch._grouped_mm"} or all(r["how"].startswith("loop") for r in grouped)


def test_model_columns_are_the_cost_models_own(dry: tuple[dict[str, Any], Path]) -> None:
    """'model' is the preset at the microbenchmarks' clock, 'in training' at its sustained share
    (HOPPER_SUSTAINED on the h100 preset); the launch floor is the preset's 4 us; a random routing's
    rows spread as spmdkit.cost.moe.ExpertRows gives them: 2 of 8 experts a token, 32 tokens on each
    of 2 ep ranks, so 16 rows an expert, sd sqrt(16 x (1 - 2/8)) = sqrt(12)."""
    d, _out = dry
    g = _rows(d, "rates", "gemm fp32 M=64 N=64 K=64")[0]
    assert g["model"] / g["model_training"] == pytest.approx(1 / HOPPER_SUSTAINED)
    assert _rows(d, "rates", "eager launch")[0]["model"] == pytest.approx(4.0)
    bal = _rows(d, "open", "grouped GEMM w1 / w3 (up) ep 2: 4 experts x 16 rows (balanced) fwd")[0]
    rnd = _rows(d, "open", "grouped GEMM w1 / w3 (up) ep 2: 4 experts x ~16 rows (random top-k) fwd")[0]
    assert bal["model_rows"] == [[16.0, 0.0, 4]] and bal["rows"] == [16, 16, 16, 16]
    (mean, sd, n), = rnd["model_rows"]
    assert (mean, n) == (16.0, 4) and sd == pytest.approx(math.sqrt(12.0))
    assert all(r % 16 == 0 for r in rnd["rows"])  # torchtitan's ALIGN_SIZE_M padding


def test_dry_run_step_and_device_file(dry: tuple[dict[str, Any], Path]) -> None:
    d, out = dry
    dev = load_device(str(out / "device_measured.json"))  # loads as plan --device reads it
    assert dev.measured is not None and dev.measured.gemm and dev.measured.attention
    steps = _rows(d, "step", "eager step, plan with")
    assert [r["device"] for r in steps] == ["h100", str(out / "device_measured.json")]
    for r in steps:
        assert r["measured"] > 0 and r["plan"]["step_s"] > 0 and r["plan"]["total"] > 0
        assert r["measured_run"]["steps_timed"] == 2 and math.isfinite(r["measured_run"]["loss"])
    # the plan with the CPU's measured rates is slower than with the H100 preset
    assert steps[1]["plan"]["step_s"] > steps[0]["plan"]["step_s"]
    assert any("torch.compile not tried" in n for n in d["parts"]["step"]["notes"])


def test_refuses_in_one_line_without_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    assert _script().main(["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith("device_check: ProgramError: no CUDA GPU: torch.cuda.is_available() is False")
    assert "--dry-run" in err and not out.exists()


def test_bad_part_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _script().main(["--dry-run", "--parts", "rates,ring", "--out", str(tmp_path)]) == 2
    assert "--parts 'rates,ring': unknown part 'ring' (parts: rates, open, step)" in capsys.readouterr().err


def test_measure_attention_names_the_kernel_it_ran() -> None:
    """A kernel asked for runs only on a GPU: on the CPU torch's own choice, said as 'default'."""
    _p, kernel = measure_attention(AttentionShape(1, 2, 16, 8, True, "fp32"), torch.device("cpu"),
                                   Timing(0, 1, 0.0), "cudnn")
    assert kernel == "default"


def test_a_part_ends_by_the_shares_so_far() -> None:
    """The GPU run's shares (rates 80 s, open 35 s, step 125 s): a part's unused time passes to the
    next, and the run's deadline caps them all."""
    dc = _script()
    start = 1000.0
    ends = [dc.Budget.part(dc.GPU, p, ["rates", "open", "step"], start, start + 240.0).deadline for p in dc.PARTS]
    assert ends == [1080.0, 1115.0, 1240.0]
    assert dc.Budget.part(dc.GPU, "step", ["step"], start, start + 240.0).deadline == 1125.0
    assert dc.Budget.part(dc.GPU, "step", ["rates", "step"], start, start + 150.0).deadline == 1150.0
