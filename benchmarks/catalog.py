#!/usr/bin/env python3
"""Every catalog model (``spmdkit models``) planned at full depth under megatron: its parameters,
the plan's wall time, and the memory per device at a sensible layout on H100s.

    python benchmarks/catalog.py [NAME ...] [--device h100] [--recompute full]

The layout by size (tp: 8, or the largest of 4 / 2 that divides the heads and kv heads):
under 15B parameters ``dp=8,tp=T`` (8 microbatches of one sequence); up to 150B
``pp=4,dp=8,tp=T`` (8 microbatches); beyond ``pp=16,dp=8,tp=T`` (32 microbatches), the layers
split as evenly as they go (126 layers in 16 stages: 14 of 8 and 2 of 7); strategy
``megatron,sp,zero1`` (sequence parallel, Megatron's distributed optimizer), full activation
recomputation, bf16, the model's published training context. "plan s": the ``spmdkit plan`` call in this process, model build, propagation and
the pipeline's estimate together (the first row pays the rules' warm-up). "params/dev":
the parameter bytes a device holds (with a pipeline: on the stage that needs the most memory,
the one the plan's JSON reports), against 2 bytes x params / (tp x pp) ("even"): the two differ
by the replicated norms and routers, the embedding and head stages and uneven stages. "device": everything a device holds as the framework allocates it (parameters,
gradients, distributed-optimizer states, activations, reserve), "fits": under 80 GB.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from spmdkit.cli import main
from spmdkit.models import catalog
from spmdkit.models.params import count_params
from spmdkit.models.zoo import ModelConfig, preset
from spmdkit.planner.pipeline import even_split

GB = 1e9


def tp_of(cfg: ModelConfig) -> int:
    return next(t for t in (8, 4, 2, 1) if cfg.heads % t == 0 and (cfg.mla or cfg.n_kv % t == 0)
                and cfg.expert_ffn % t == 0 and cfg.ffn % t == 0)


def layout(cfg: ModelConfig, total: int) -> tuple[int, int, int]:
    """(pp, tp, microbatches) for a model of ``total`` parameters."""
    tp = tp_of(cfg)
    if total < 15e9:
        return 1, tp, 8
    return (4, tp, 8) if total < 150e9 else (16, tp, 32)


def run(name: str, device: str, recompute: str) -> list[str]:
    cfg = preset(name)
    total = count_params(cfg).total
    pp, tp, mb = layout(cfg, total)
    mesh = f"pp={pp},dp=8,tp={tp}" if pp > 1 else f"dp=8,tp={tp}"
    argv = ["plan", "--model", name, "--mesh", mesh, "--strategy", "megatron,sp,zero1", "--device", device,
            "--recompute", recompute, "--batch", str(mb if pp > 1 else 8), "--json"]
    if pp > 1:
        argv += ["--microbatches", str(mb), "--stages", ",".join(map(str, even_split(cfg.layers, pp)))]
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    secs = time.perf_counter() - t0
    if rc != 0:
        return [name, f"{total / GB:.2f}", mesh, f"{secs:.2f}", "-", "-", "-", f"error: {err.getvalue().strip()[:80]}"]
    mem = json.loads(out.getvalue())["memory"]
    even = 2 * total / (tp * pp)
    dev = mem["device_total"]
    return [name, f"{total / GB:.2f}", mesh, f"{secs:.2f}", f"{mem['parameters'] / GB:.2f}", f"{even / GB:.2f}",
            f"{dev / GB:.1f}", "yes" if dev <= 80e9 else "no"]


def main_() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="catalog names (default: all)")
    ap.add_argument("--device", default="h100")
    ap.add_argument("--recompute", default="full", choices=("none", "selective", "full"))
    a = ap.parse_args()
    names = a.names or catalog.names()
    header = ["model", "params B", "mesh", "plan s", "params/dev GB", "even GB", "device GB", "fits 80 GB"]
    rows = [run(n, a.device, a.recompute) for n in names]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"catalog models at full depth, megatron,sp,zero1, recompute {a.recompute}, {a.device}")
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


if __name__ == "__main__":
    main_()
