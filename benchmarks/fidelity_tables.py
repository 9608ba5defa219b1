"""The table of runs every section of docs/fidelity.md prints (``benchmarks/fidelity.py``,
``benchmarks/fidelity_foundry.py``), and the section of a runs file planned apart from the
calibration (:class:`RunsSection`, :func:`runs_section`): the out-of-sample checks."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: a row of a runs file -> the group it is counted in (:attr:`RunsSection.groups`)
Grouping = Callable[[dict[str, Any]], str]


@dataclass(frozen=True)
class RunsSection:
    """A runs file planned apart from the calibration (out of ``band.json``, of the published runs'
    summary and of ``benchmarks/calibrate_sustained.py``) and its section of docs/fidelity.md:
    ``heading``, the ``intro`` lines, the summary, the error by each of ``groups`` (title, grouping;
    with the worst rows) where given, every run (its unit column where ``unit``) and, where
    ``assumptions``, each run's assumptions, then the runs not expressible."""

    path: Path
    heading: str
    intro: tuple[str, ...]
    groups: tuple[tuple[str, Grouping], ...] = ()
    unit: bool = True
    assumptions: bool = True


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


def _error_line(name: str, rs: list[dict[str, Any]]) -> str:
    errs = sorted(abs(r["ratio"] - 1) for r in rs)
    k = (len(errs) - 1) * 0.9
    lo = int(k)
    p90 = errs[lo] + (errs[min(lo + 1, len(errs) - 1)] - errs[lo]) * (k - lo)
    return (f"| {name} | {len(rs)} | {100 * statistics.median(errs):.1f}% | {100 * p90:.1f}% | "
            f"{100 * sum(e <= 0.05 for e in errs) / len(errs):.0f}% | {100 * sum(e <= 0.10 for e in errs) / len(errs):.0f}% | "
            f"{statistics.median(r['ratio'] for r in rs):.3f} |")


def group_table(results: list[dict[str, Any]], rows: list[dict[str, Any]],
                groups: tuple[tuple[str, Grouping], ...]) -> list[str]:
    """The error of ``results`` in all and by each grouping of ``groups`` (a line a group, sorted),
    then the ten worst runs; ``rows`` the runs file's rows the groupings read."""
    byid = {r["id"]: r for r in rows}
    out = ["| rows | runs | median \\|ratio - 1\\| | p90 | within 5% | within 10% | median ratio |",
           "|---|---|---|---|---|---|---|", _error_line("all", results)]
    for title, key in groups:
        by: dict[str, list[dict[str, Any]]] = {}
        for r in results:
            by.setdefault(key(byid[r["id"]]), []).append(r)
        out += [_error_line(f"{title}: {k}", rs) for k, rs in sorted(by.items())]
    worst = sorted(results, key=lambda r: -abs(r["ratio"] - 1))[:10]
    return [*out, "", "The worst rows: " + ", ".join(f"{r['id']} {r['ratio']:.3f}" for r in worst) + "."]


def runs_section(x: RunsSection, results: list[dict[str, Any]], unsupported: dict[str, list[str]],
                 rows: list[dict[str, Any]], summary: list[str]) -> list[str]:
    """docs/fidelity.md's section of the runs file of ``x`` (:class:`RunsSection`); ``summary``:
    ``fidelity.summary_lines`` of ``results``."""
    out = ["", x.heading, "", *x.intro]
    out += [f"- {line}" for line in summary]
    if x.groups and results:
        out += ["", *group_table(results, rows, x.groups)]
    out += ["", *run_table(results, unit=x.unit)]
    if x.assumptions:
        out += [""] + [f"- {r['id']}: " + "; ".join(r["assumptions"]) for r in results]
    out += [f"- unsupported {k}: {', '.join(v)}" for k, v in unsupported.items()]
    return out
