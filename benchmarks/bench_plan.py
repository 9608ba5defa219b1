#!/usr/bin/env python3
"""Planning speed: llama-70b (forward + backward + AdamW) on dp=8 x tp=8, by layer count.

    python benchmarks/bench_plan.py [--layers 8,16,32,64,80] [--strategy megatron] [--repeat 3]

Prints, per layer count, the ops of the training step, the time to build the program, the
time to propagate and plan the reshards (median of --repeat runs, rule caches cleared before
each run, so every run computes its answers), the time per op, and the time relative to the
smallest model scaled by its op count (1.00 = exactly linear); ``--device h100`` adds the time
of the step prediction (spmdkit.cost.compute: re-timing the reshards by the device's links
and costing every op), median of --repeat runs.

With a ``pp`` dim (``--mesh pp=4,dp=8,tp=8 --strategy megatron,sp --microbatches 16``) the
program is one microbatch (the preset's batch) planned on the sub-mesh without pp, and the
plan time includes the pipeline analysis (graph/pipeline.py: stages, sends, per-stage
memory); with ``--device`` the prediction includes the schedule's simulation.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from spmdkit.cost.devices import cost_model, preset_device, recost
from spmdkit.cost.memory import memory_per_device
from spmdkit.cost.step import estimate_step
from spmdkit.models.zoo import build_model, preset
from spmdkit.ops import clear_cache
from spmdkit.planner.pipeline import estimate_pipeline
from spmdkit.planner.pipeline_plan import sub_mesh_text
from spmdkit.planner.pipeline_split import PipelineSpec, parse_spec, split_layers
from spmdkit.planner.propagate import propagate
from spmdkit.strategies.strategy import annotate, parse_mesh, parse_strategy


def _counts(n: int, spec: PipelineSpec) -> tuple[int, ...] | None:
    """Layers per stage; None (balanced by the estimate) where they do not divide."""
    return None if n % (spec.pp * spec.virtual) else split_layers(n, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-70b")
    ap.add_argument("--mesh", default="dp=8,tp=8")
    ap.add_argument("--strategy", default="megatron")
    ap.add_argument("--layers", default="8,16,32,64,80")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", help="also time the step prediction on this device preset (e.g. h100)")
    ap.add_argument("--microbatches", default="1", help="with a pp mesh dim: microbatches per step")
    ap.add_argument("--schedule", default=None, help="with a pp mesh dim: gpipe, 1f1b (default), interleaved")
    a = ap.parse_args()
    full = parse_mesh(a.mesh)
    pp, sub = sub_mesh_text(full)
    piped = "pp" in full.dim_names
    spec = parse_spec(pp, a.microbatches, a.schedule) if piped else None
    mesh = parse_mesh(sub) if piped else full
    st = parse_strategy(a.strategy, mesh)
    rows = []
    for n in [int(x) for x in a.layers.split(",")]:
        cfg = preset(a.model).with_(layers=n)
        builds, plans, ests = [], [], []
        for _ in range(a.repeat):
            clear_cache()
            t0 = time.perf_counter()
            model = build_model(cfg, vocab_parallel_loss="megatron" in st, check_rules=False)
            t1 = time.perf_counter()
            plan = propagate(model.program, mesh, annotate(model, mesh, st))
            memory_per_device(plan)
            if spec is not None:
                estimate_pipeline(plan, spec, _counts(n, spec))
            t2 = time.perf_counter()
            builds.append(t1 - t0)
            plans.append(t2 - t1)
            if a.device:
                dev = preset_device(a.device)
                t3 = time.perf_counter()
                if spec is None:
                    estimate_step(recost(plan, cost_model(mesh, dev)), dev, cfg.batch * cfg.seq)
                else:
                    link = cost_model(full, dev).links[full.dim_index("pp")]
                    estimate_pipeline(recost(plan, cost_model(mesh, dev)), spec, _counts(n, spec), dev,
                                      (link.alpha_s, link.beta_s_per_byte),
                                      cfg.batch * cfg.seq * spec.microbatches, full.size)
                ests.append(time.perf_counter() - t3)
        rows.append((n, len(model.program.ops), statistics.median(builds), statistics.median(plans),
                     statistics.median(ests) if ests else None))
    base = rows[0]
    print(f"{a.model}, mesh {a.mesh}, strategy {','.join(st)} (median of {a.repeat}; caches cleared per run)")
    print(f"{'layers':>6} {'ops':>6} {'build s':>8} {'plan s':>8} {'total s':>8} {'us/op':>7} {'vs linear':>9}"
          + (f" {'predict s':>9}" if a.device else ""))
    for n, ops, b, p, e in rows:
        lin = (b + p) / ((base[2] + base[3]) * ops / base[1])
        print(f"{n:>6} {ops:>6} {b:>8.3f} {p:>8.3f} {b + p:>8.3f} {(b + p) / ops * 1e6:>7.1f} {lin:>9.2f}"
              + (f" {e:>9.3f}" if e is not None else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
