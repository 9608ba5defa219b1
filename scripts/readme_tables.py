#!/usr/bin/env python3
"""Regenerate the README's generated parts (between <!-- name --> and <!-- /name --> markers):
the rules table (from the registry), the golden-agreement table (from tests/golden), and the
excerpts of what `spmdkit plan` prints (each run here, the lines shown picked from its output)
with the figures quoted in the text. tests/test_readme.py fails when any is stale; a planning
time ("planned in 0.21 s") is the one figure compared loosely (:func:`comparable`)."""

from __future__ import annotations

import collections
import contextlib
import io
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from spmdkit.cli import main as spmdkit_main  # noqa: E402
from spmdkit.outputs.tables import rules_markdown  # noqa: E402


def golden_markdown() -> str:
    rows = ["| family | golden cases | from Paddle's unit tests | agree with Paddle | documented deviations |",
            "|---|---|---|---|---|"]
    tot: collections.Counter[str] = collections.Counter()
    for f in sorted((ROOT / "tests" / "golden").glob("*.jsonl")):
        items = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        n = len(items)
        pt = sum(1 for d in items if d.get("source") == "paddle-test")
        dev = sum(1 for d in items if "deviation" in d)
        rows.append(f"| {f.stem} | {n} | {pt} | {n - dev} | {dev} |")
        tot.update(n=n, pt=pt, dev=dev)
    rows.append(f"| **all** | {tot['n']} | {tot['pt']} | {tot['n'] - tot['dev']} | {tot['dev']} |")
    return "\n".join(rows)


def run(*argv: str) -> list[str]:
    """The lines ``spmdkit plan ...`` prints (wide, as on a pipe)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = spmdkit_main(list(argv))
    assert rc == 0, argv
    return out.getvalue().rstrip("\n").split("\n")


def _block(lines: list[str], start: str, end: str) -> list[str]:
    """From the first line starting with ``start`` through the next line starting with ``end``."""
    i = next(k for k, x in enumerate(lines) if x.startswith(start))
    j = next(k for k in range(i, len(lines)) if lines[k].startswith(end))
    return lines[i:j + 1]


def _first(lines: list[str], start: str) -> str:
    return next(x for x in lines if x.startswith(start))


DEMO = ("plan", "--model", "llama-7b", "--mesh", "dp=2,tp=4", "--strategy", "megatron", "--verify", "--wide")


def demo_excerpt() -> str:
    out = run(*DEMO)
    picked = [next(x for x in out if f"│ layers.*.{n} " in x and x.startswith("│ forward"))[:160]
              for n in ("attn_out", "mlp_out")]
    picked.append(next(x for x in out if "attn_norm.out.grad.sum" in x)[:160])
    body = [*out[:2], "...", *picked, "...", *_block(out, "Communication per training step", "└"), "",
            *_block(out, "Memory per device", "└"), "", _first(out, "verify:")[:160]]
    return "```\n" + "\n".join(body) + "\n```"


DEVICE = ("plan", "--model", "llama-7b", "--mesh", "dp=2,tp=4", "--strategy", "megatron", "--device", "h100")


def device_excerpt() -> str:
    out = run(*DEVICE)
    i = next(k for k, x in enumerate(out) if x.startswith("Device: "))
    return "```\n$ spmdkit " + " ".join(DEVICE) + "\n...\n" + "\n".join(out[i:]) + "\n```"


PIPE = ("plan", "--model", "llama-70b", "--mesh", "pp=4,dp=8,tp=8", "--strategy", "megatron,sp", "--microbatches",
        "16", "--device", "h100")


def pipeline_excerpt() -> str:
    out = run(*PIPE)
    body = ["$ spmdkit " + " ".join(PIPE), "...", _first(out, "Pipeline: "), "...",
            *[x for x in out if x.startswith(("pipeline: ", "step time: ", "tokens/s: "))]]
    return "```\n" + "\n".join(body) + "\n```"


SEARCH = ("plan", "--model", "llama-7b", "--devices", "8", "--device", "h100")


def search_excerpt() -> str:
    out = run(*SEARCH)
    i = next(k for k, x in enumerate(out) if x.startswith("┃ #"))
    rows = [x for x in out[i + 2:] if x.startswith("│ ")][:3]
    body = ["$ spmdkit " + " ".join(SEARCH), "...", out[i], *rows, "...",
            *[x for x in out if x.startswith("rejected over the memory cap")][:1]]
    return "```\n" + "\n".join(body) + "\n```"


MODELS = ("models", "llama3.1-405b", "mixtral-8x7b", "deepseek-v3", "bloom")
BIG = ("plan", "--model", "llama3.1-405b", "--mesh", "pp=16,dp=8,tp=8", "--strategy", "megatron", "--device", "h100")


def models_excerpt() -> str:
    """``spmdkit models`` for four entries (the source column left out: it is a URL) and the
    first lines and device memory of llama3.1-405b planned on 1,024 ranks."""
    out = run(*MODELS)
    head = next(x for x in out if x.startswith("┃ model"))
    cut = head.index("┃ source")
    ends = {"┏": "┓", "┃": "┃", "┡": "┩", "│": "│", "└": "┘"}
    table = [x[:cut] + ends[x[0]] for x in out[1:] if x[:1] in ends]
    big = run(*BIG)
    body = ["$ spmdkit " + " ".join(MODELS), out[0], *table, "", "$ spmdkit " + " ".join(BIG), *big[:3], "...",
            *[x for x in big if x.startswith("│ total on the device")][:1]]
    return "```\n" + "\n".join(body) + "\n```"


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f} GiB"


def recompute_figures() -> str:
    """The recompute paragraph's figures: gpt-dropout-22b on tp=8 under megatron,sp on A100s."""
    base = ("plan", "--model", "gpt-dropout-22b", "--mesh", "tp=8", "--strategy", "megatron,sp", "--device",
            "a100-80gb", "--json")
    got = {}
    for rc in ("none", "selective", "full"):
        d = json.loads("\n".join(run(*base, "--recompute", rc)))
        layer = d["memory"]["saved_for_backward"]["per_layer"]["layer 0"]
        got[rc] = (layer / 2**20, d["memory"]["device_total"], 100 * d["step"]["mfu"], 100 * d["step"]["hfu"])
    n, s, f = got["none"], got["selective"], got["full"]
    return (f"`spmdkit plan --model gpt-dropout-22b --mesh tp=8 --strategy megatron,sp --device a100-80gb` keeps "
            f"{n[0]:.0f} MiB per layer and needs {_gib(n[1])} at MFU {n[2]:.1f}%; `--recompute selective` keeps "
            f"{s[0]:.0f} MiB per layer, {_gib(s[1])} in all, MFU {s[2]:.1f}%; `full` {f[0]:.0f} MiB per layer, "
            f"{_gib(f[1])}, MFU {f[2]:.1f}% (HFU {f[3]:.1f}%).")


def fidelity_summary() -> str:
    """The summary of docs/fidelity.md (benchmarks/fidelity.py --write; tests/test_fidelity.py
    keeps that file current)."""
    doc = (ROOT / "docs" / "fidelity.md").read_text()
    part = doc[doc.index("## Summary"):doc.index("## Runs")]
    return "\n".join(x for x in part.splitlines() if x.startswith("- "))


TABLES = {"rules-table": rules_markdown, "fidelity-summary": fidelity_summary, "golden-table": golden_markdown, "demo-excerpt": demo_excerpt,
          "device-excerpt": device_excerpt, "pipeline-excerpt": pipeline_excerpt, "search-excerpt": search_excerpt,
          "recompute-figures": recompute_figures, "models-excerpt": models_excerpt}


def comparable(text: str) -> str:
    """``text`` with its planning and propagation times blanked (they vary from run to run)."""
    return re.sub(r"planned in [0-9.]+ s", "planned in _ s", text)


def render(text: str) -> str:
    for name, fn in TABLES.items():
        body = fn()
        text = re.sub(rf"(<!-- {name} -->\n).*?(\n<!-- /{name} -->)", lambda m, b=body: m.group(1) + b + m.group(2),
                      text, flags=re.S)
    return text


if __name__ == "__main__":
    p = ROOT / "README.md"
    p.write_text(render(p.read_text()))
