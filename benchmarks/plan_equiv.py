#!/usr/bin/env python3
"""Plan equivalence: the plan JSON (``--json``) and the text report of a fixed set of ``spmdkit
plan`` commands, written to a folder, and two such folders compared (for speed work that must
not change an answer: propagation, per-op cost, memory).

    python benchmarks/plan_equiv.py snapshot OUT_DIR [--tree DIR] [--only SUBSTR]
    python benchmarks/plan_equiv.py compare A B

``snapshot`` runs every command of :data:`COMMANDS` through ``spmdkit.cli.main`` in one process
(so that memo tables and rule caches carry from one command to the next, as they would in a
long-lived process: a memo keyed too loosely shows up as a difference), with ``--tree``'s
``src`` first on the path (default: this checkout); each command's stdout goes to
``OUT_DIR/NN.json`` or ``NN.txt``. Wall-clock figures are blanked (``plan_seconds``, "planned
in X s"). ``compare`` prints the commands whose outputs differ and exits 1 if any does.
Standard library only.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_H = ["--device", "h100"]
_TINY = '{"vocab_size":128,"hidden_size":32,"intermediate_size":64,"num_hidden_layers":2,' \
        '"num_attention_heads":4,"num_key_value_heads":2}'
#: (label, argv after ``plan``); each is run with ``--json`` and without
COMMANDS: list[tuple[str, list[str]]] = [
    ("preset llama-7b dp2 tp4", ["--model", "llama-7b", "--mesh", "dp=2,tp=4", "--strategy", "megatron", *_H]),
    ("preset gpt-small sp zero1", ["--model", "gpt2-small", "--mesh", "dp=4,tp=2", "--strategy", "megatron,sp,zero1",
                                   "--device", "a100-80gb"]),
    ("preset llama-70b zero3 recompute", ["--model", "llama-70b", "--layers", "4", "--mesh", "dp=8,tp=8",
                                          "--strategy", "megatron,zero3", "--recompute", "selective", *_H]),
    ("preset llama-70b grad-accum no device", ["--model", "llama-70b", "--layers", "6", "--mesh", "dp=4,tp=8",
                                               "--strategy", "megatron", "--grad-accum", "2"]),
    ("405b pp16 dp8 tp8", ["--model", "llama3.1-405b", "--mesh", "pp=16,dp=8,tp=8", "--strategy", "megatron", *_H]),
    ("deepseek-v3 dp8 tp8", ["--model", "deepseek-v3", "--mesh", "dp=8,tp=8", "--strategy", "megatron", *_H]),
    ("deepseek-v2-lite pp2 sp", ["--model", "deepseek-v2-lite", "--mesh", "pp=2,dp=2,tp=4",
                                 "--strategy", "megatron,sp,zero1", "--microbatches", "4", *_H]),
    ("mixtral-8x7b dp4 tp8 recompute full", ["--model", "mixtral-8x7b", "--mesh", "dp=4,tp=8", "--strategy",
                                             "megatron,sp", "--recompute", "full", *_H]),
    ("qwen3-30b-a3b pp4", ["--model", "qwen3-30b-a3b", "--mesh", "pp=4,dp=2,tp=4", "--strategy", "megatron",
                           "--schedule", "interleaved", "--microbatches", "8", "--layers", "16", *_H]),
    ("bloom-176b gemma2 style dp tp", ["--model", "bloom-176b", "--layers", "4", "--mesh", "dp=2,tp=8",
                                       "--strategy", "megatron", *_H]),
    ("gemma2-9b tp2", ["--model", "gemma2-9b", "--mesh", "dp=4,tp=2", "--strategy", "megatron", *_H]),
    ("gpt3-175b pp8 gpipe", ["--model", "gpt3-175b", "--mesh", "pp=8,dp=4,tp=8", "--strategy", "megatron",
                             "--schedule", "gpipe", "--microbatches", "16", *_H]),
    ("hf tiny llama", ["--hf", "LlamaForCausalLM", "--hf-config", _TINY, "--mesh", "dp=2,tp=2",
                       "--strategy", "megatron", *_H]),
    ("hf tiny llama pp2", ["--hf", "LlamaForCausalLM", "--hf-config", _TINY, "--mesh", "pp=2,tp=2",
                           "--strategy", "megatron"]),
    ("auto small", ["--model", "gpt2-small", "--layers", "2", "--mesh", "dp=2,tp=2", "--auto", *_H]),
]

_BLANK = [(re.compile(r"planned in [0-9.]+ s"), "planned in X s"),
          (re.compile(r"solved? (in )?[0-9.]+ s"), "solve X s"),
          (re.compile(r'"(\w+_seconds)": [0-9.eE+-]+'), r'"\1": 0')]


def _normal(text: str) -> str:
    for pat, rep in _BLANK:
        text = pat.sub(rep, text)
    return text


def snapshot(out_dir: Path, tree: Path, only: str | None) -> int:
    sys.path.insert(0, str(tree / "src"))
    from spmdkit.cli import main  # the tree under test

    out_dir.mkdir(parents=True, exist_ok=True)
    k = 0
    for label, argv in COMMANDS:
        for as_json in (True, False):
            k += 1
            if only and only not in label:
                continue
            buf, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
                try:
                    rc = main(["plan", *argv, *(["--json"] if as_json else [])])
                except SystemExit as exc:
                    rc = exc.code
            if as_json:  # key order and float text as written; checked to parse
                for line in buf.getvalue().splitlines():
                    json.loads(line)
            text = _normal(buf.getvalue())
            (out_dir / f"{k:02d}.{'json' if as_json else 'txt'}").write_text(
                f"# {label}: plan {' '.join(argv)}{' --json' if as_json else ''} -> exit {rc}\n{text}"
                f"# stderr\n{_normal(err.getvalue())}")
            print(f"{k:02d} exit {rc} {label}{' --json' if as_json else ''}", flush=True)
    return 0


def compare(a: Path, b: Path) -> int:
    names = sorted({p.name for p in a.iterdir()} | {p.name for p in b.iterdir()})
    bad = 0
    for n in names:
        pa, pb = a / n, b / n
        if not pa.exists() or not pb.exists():
            print(f"{n}: only in {a if pa.exists() else b}")
            bad += 1
            continue
        ta, tb = _normal(pa.read_text()), _normal(pb.read_text())
        if ta != tb:
            bad += 1
            print(f"{n}: differs ({ta.splitlines()[0]})")
            diff = list(difflib.unified_diff(ta.splitlines(), tb.splitlines(), lineterm="", n=0))
            print("\n".join(line[:300] for line in diff[:12]))
    print(f"{len(names) - bad} of {len(names)} outputs identical")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snapshot")
    s.add_argument("out", type=Path)
    s.add_argument("--tree", type=Path, default=ROOT)
    s.add_argument("--only")
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    a = ap.parse_args()
    if a.cmd == "snapshot":
        return snapshot(a.out, a.tree.resolve(), a.only)
    return compare(a.a, a.b)


if __name__ == "__main__":
    raise SystemExit(main())
