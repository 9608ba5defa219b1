"""Write the text report (and the HTML page) of a fixed set of zoo presets and catalog models to a
folder, the planning time left out, so a change to spmdkit.outputs can be checked to keep them
byte-identical: run it before and after, then ``diff -r BEFORE AFTER``.

    PYTHONPATH=src python scripts/report_snapshot.py /tmp/before
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from pathlib import Path

from spmdkit.cli import main

#: (file name, CLI arguments): presets, catalog models (dense, MoE with dense layers first, MLA),
#: a pipeline and ZeRO.
CASES: list[tuple[str, list[str]]] = [
    ("tiny-llama", ["--model", "tiny-llama", "--mesh", "dp=2,tp=2"]),
    ("tiny-gpt2", ["--model", "tiny-gpt2", "--mesh", "dp=2,tp=2", "--device", "h100"]),
    ("gpt2-small-zero3", ["--model", "gpt2-small", "--mesh", "dp=4,tp=2", "--strategy", "megatron,zero3"]),
    ("llama-7b", ["--model", "llama-7b", "--mesh", "dp=2,tp=4", "--layers", "4", "--device", "h100"]),
    ("llama-7b-pp", ["--model", "llama-7b", "--mesh", "pp=2,dp=2,tp=2", "--layers", "4"]),
    ("mixtral-8x7b", ["--model", "mixtral-8x7b", "--mesh", "dp=2,tp=4", "--layers", "3", "--seq", "512"]),
    ("deepseek-v2-lite", ["--model", "deepseek-v2-lite", "--mesh", "dp=2,tp=4", "--layers", "3", "--seq", "512"]),
    ("gemma2-9b", ["--model", "gemma2-9b", "--mesh", "dp=2,tp=4", "--layers", "2", "--seq", "512"]),
]


def snapshot(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, args in CASES:
        buf = io.StringIO()
        page = folder / f"{name}.html"
        with contextlib.redirect_stdout(buf):
            rc = main(["plan", *args, "--wide", "--html", str(page)])
        text = re.sub(r", planned in [0-9.]+ s", "", buf.getvalue())
        (folder / f"{name}.txt").write_text(f"exit {rc}\n{text}")
        html = re.sub(r"planned in [0-9.]+ s", "", page.read_text()).replace(str(folder), "FOLDER")
        page.write_text(html)
        print(f"{name}: exit {rc}, {len(text.splitlines())} lines")


if __name__ == "__main__":
    snapshot(Path(sys.argv[1] if len(sys.argv) > 1 else "report_snapshot"))
