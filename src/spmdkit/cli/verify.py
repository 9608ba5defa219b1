"""``spmdkit verify [RULE ...] [--cases N] [--seed S] [--mode forward|backward|both]``.

:func:`spmdkit.cli.build_parser` wires :func:`add_verify_command` into its subparsers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

from spmdkit.core.errors import SpmdError
from spmdkit.engine.registry import get_rule
from spmdkit.outputs.progress import Progress


def add_verify_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``verify`` sub-command to an argparse subparsers object."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "verify",
        help="check rule answers numerically on generated cases (numpy simulator)",
        description="Run every named rule (default: every rule with a numpy reference) on N generated "
        "cases per mode, shard the inputs as the rule says, run the op per rank, assemble the outputs "
        "as the rule claims and compare with the unsharded op. Exit status 1 if any answer is unsound.",
    )
    p.add_argument("rules", nargs="*", metavar="RULE", help="rule names (default: all verifiable rules)")
    p.add_argument("--cases", type=int, default=50, help="generated cases per rule and mode (default 50)")
    p.add_argument("--seed", type=int, default=0, help="seed of the case generator (default 0)")
    p.add_argument("--mode", choices=("forward", "backward", "both"), default="both")
    p.add_argument("--all-unsound", action="store_true", help="print every unsound case, not just the first")
    p.add_argument("--json", action="store_true", help="one JSON line per rule and mode instead of the table")
    p.set_defaults(fn=run_verify)
    return p


def run_verify(ns: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out if out is not None else sys.stdout
    try:
        from spmdkit.sim.verify import verifiable_rules, verify_rule  # (imports numpy)
    except ImportError as exc:  # numpy missing
        print(f"spmdkit verify needs numpy (pip install spmdkit[sim]): {exc}", file=sys.stderr)
        return 2
    if ns.cases < 1:  # (0 or fewer verified nothing and reported every rule sound, exit 0)
        print(f"spmdkit verify: --cases {ns.cases}: expected at least 1 generated case per rule and mode",
              file=sys.stderr)
        return 2
    names = list(ns.rules) or verifiable_rules()
    modes = ("forward", "backward") if ns.mode == "both" else (ns.mode,)
    t0 = time.perf_counter()
    reports = []
    with Progress("spmdkit verify", total=len(names)) as bar:  # stderr, a terminal only
        for name in names:
            bar.update(note=name)
            try:
                rule = get_rule(name)
            except SpmdError as exc:
                bar.close()
                print(f"spmdkit verify: {exc}", file=sys.stderr)
                return 2
            for m in modes:
                if m not in rule.modes:
                    continue
                reports.append(verify_rule(name, ns.cases, ns.seed, m))
            bar.advance()
    elapsed = time.perf_counter() - t0
    if getattr(ns, "json", False):
        for r in reports:
            row: dict[str, Any] = {"rule": r.rule, "mode": r.mode, "cases": r.cases, "sound": r.sound,
                                   "unsound": r.unsound, "rejected": r.rejected, "skipped": r.skipped,
                                   "seconds": round(r.seconds, 3), "note": r.note}
            if r.first_unsound is not None:
                row["first_unsound"] = {"detail": r.first_unsound.detail, "case": r.first_unsound.case}
            out.write(json.dumps(row) + "\n")
        return 1 if any(r.unsound for r in reports) else 0
    w = max([len(r.rule) for r in reports] + [4])
    head = f"{'rule':<{w}}  {'mode':<8}  {'cases':>5}  {'sound':>5}  {'unsound':>7}  {'rejected':>8}  {'skipped':>7}  note"
    out.write(head + "\n" + "-" * len(head) + "\n")
    tot = [0, 0, 0, 0, 0]
    for r in reports:
        note = r.note or (r.first_skipped.detail[:60] if r.first_skipped is not None else "")
        out.write(f"{r.rule:<{w}}  {r.mode:<8}  {r.cases:>5}  {r.sound:>5}  {r.unsound:>7}  {r.rejected:>8}  "
                  f"{r.skipped:>7}  {note}\n")
        for i, v in enumerate((r.cases, r.sound, r.unsound, r.rejected, r.skipped)):
            tot[i] += v
    out.write("-" * len(head) + "\n")
    out.write(f"{'total':<{w}}  {'':<8}  {tot[0]:>5}  {tot[1]:>5}  {tot[2]:>7}  {tot[3]:>8}  {tot[4]:>7}  "
              f"({elapsed:.1f} s)\n")
    bad = [r for r in reports if r.unsound]
    for rep in bad:
        shown = rep.unsound_cases if ns.all_unsound else rep.unsound_cases[:1]
        for verdict in shown:
            out.write(f"\nUNSOUND {rep.rule} {rep.mode}: {verdict.detail}\n  {verdict.case_line()}\n")
    return 1 if bad else 0


__all__ = ["add_verify_command", "run_verify"]
