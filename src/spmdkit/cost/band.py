"""The error band of a predicted step: how far measured training steps fell from the prediction
on the published runs of ``benchmarks/data/published-runs.json`` (written to ``band.json``
beside this module by ``benchmarks/fidelity.py --write``; tests/test_fidelity.py fails when it is
stale). Standard library only.

:func:`error_band` (device) -> :class:`Band`: for the device's GPU family (A100, H100 / H200) or
all runs, the 10th, 50th and 90th percentile of ``measured step time / predicted step time``
(above 1: the real step is slower than predicted) and the runs it rests on; a context-parallel
plan (``cp``) gets the band of the published runs with cp > 1 (long context, any GPU), a plan with
mixture-of-experts layers (``moe``) the band of the published MoE runs
(``benchmarks/data/moe-runs.json``: expert parallelism on H100s), whose predictions are the least
sure, before either.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from spmdkit.cost.devices import preset_of_gpu

BAND_FILE = Path(__file__).with_name("band.json")


@dataclass(frozen=True)
class Band:
    """``measured / predicted`` step time over ``runs`` published runs of ``family``."""

    family: str
    runs: int
    p10: float
    p50: float
    p90: float
    sources: tuple[str, ...]

    def text(self) -> str:
        """``real step 0.93-1.08 x predicted (median 1.01; 80% of 41 published H100 runs: ...)``."""
        return (f"real step {self.p10:.2f}-{self.p90:.2f} x predicted (median {self.p50:.2f}; 80% of "
                f"{self.runs} published {self.family} runs: {', '.join(self.sources)}; benchmarks/fidelity.py)")

    def to_json(self) -> dict[str, Any]:
        return {"family": self.family, "runs": self.runs, "p10": self.p10, "p50": self.p50, "p90": self.p90,
                "sources": list(self.sources)}


#: how a family is named in the band's sentence
_NAMES = {"all": "GPU", "cp": "context-parallel (cp > 1)", "moe": "mixture-of-experts"}


@cache
def _bands() -> dict[str, Band]:
    if not BAND_FILE.is_file():
        return {}
    raw = json.loads(BAND_FILE.read_text(encoding="utf-8"))
    return {k: Band(_NAMES.get(k, k), int(v["runs"]), float(v["p10"]), float(v["p50"]), float(v["p90"]),
                    tuple(v["sources"])) for k, v in raw["families"].items()}


def family_of(device_name: str) -> str:
    """A device's GPU family as the band names it: A100, H100 (H200 is an H100 with more
    memory), else all."""
    preset = preset_of_gpu(device_name, 0) or ""
    return "A100" if preset.startswith("a100") else "H100" if preset in ("h100", "h200") else "all"


def error_band(device_name: str, cp: bool = False, moe: bool = False) -> Band | None:
    """The band of the device's family (every run's where the family has fewer than 5); with
    ``moe`` (a plan with MoE layers) the band of the published MoE runs, else with ``cp`` (a
    context-parallel plan) the band of the published cp runs, each where there are 5."""
    bands = _bands()
    if moe and (m := bands.get("moe")) is not None and m.runs >= 5:
        return m
    if cp and (c := bands.get("cp")) is not None and c.runs >= 5:
        return c
    b = bands.get(family_of(device_name))
    if b is None or b.runs < 5:
        b = bands.get("all")
    return b


__all__ = ["BAND_FILE", "Band", "error_band", "family_of"]
