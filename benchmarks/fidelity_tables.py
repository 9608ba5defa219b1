"""The table of runs every section of docs/fidelity.md prints (``benchmarks/fidelity.py``,
``benchmarks/fidelity_foundry.py``)."""

from __future__ import annotations

from typing import Any


def run_table(results: list[dict[str, Any]], *, unit: bool = True, memory: str = "memory GiB",
              measured_memory: bool = False) -> list[str]:
    """One markdown row a run: its id, its unit (``unit``), measured, predicted, ratio, the predicted
    memory (with the measured peak in brackets where ``measured_memory`` and the run has one) and
    whether it fits."""
    cols = ["run", *(["unit"] if unit else []), "measured", "predicted", "ratio", memory, "fits"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        mm = f" ({r['memory_measured_gib']})" if measured_memory and r.get("memory_measured_gib") else ""
        fits = "yes" if r["fits"] else "no" if r["fits"] is not None else ""
        cells = [r["id"], *([r["metric"]] if unit else []), f"{r['measured']:g}", f"{r['predicted']:.4g}",
                 f"{r['ratio']:.3f}", f"{r['memory_gib']:.1f}{mm}", fits]
        out.append("| " + " | ".join(cells) + " |")
    return out
