#!/usr/bin/env python3
"""The outer search's speed (``spmdkit plan --devices N``) from 8 to 16,384 devices.

    python benchmarks/bench_search.py [--sizes 8,64,512,2048,16384] [--no-fold]
    python benchmarks/bench_search.py --sizes "" --models gpt3-175b,mixtral-8x7b,deepseek-v3

One row per size (the default models and batches below; each search run once, in this
process): seconds of the search, configurations planned, candidates costed (a configuration
under each recomputation mode), how many were folded (:mod:`spmdkit.planner.fold`: planned on
two shallow copies of the model), candidates costed per second, the best configuration, its
step and MFU. The search's seconds are CPU seconds of this process and of the worker a lazy
search forks on a second core (:mod:`spmdkit.planner.search_ahead`; the machine's other jobs do
not count) and wall seconds beside them: on two idle cores the wall is what a user waits. For Llama 3 405B the published layout (tp=8, pp=16, dp=128 at 8k: 16 microbatches
of one sequence per dp rank, Megatron with sp and the distributed optimizer; Llama 3 paper,
table 4) is priced the same way beside it. ``--no-fold`` plans every configuration whole (the
search before folding). Timings are CPU seconds on whatever machine runs it: say which and how
loaded.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from spmdkit.planner.search import Config, config_candidates, search_meshes

#: devices -> (model, overrides)
ROWS = {
    8: ("llama3-8b", {"batch": 8}),
    64: ("llama-70b", {"batch": 64}),
    512: ("llama-70b", {"batch": 512}),
    2048: ("llama3-405b", {"batch": 2048, "seq": 8192}),
    16384: ("llama3-405b", {"batch": 2048, "seq": 8192}),
}
PUBLISHED = {16384: Config(128, 8, 16, "megatron,sp,zero1", microbatches=16)}
#: ``--models``: a model's search against its published layout: name -> (devices, device,
#: overrides, the published layout). GPT-3 175B: Narayanan et al. 2021 (tp=8, pp=8, dp=16 at
#: batch 1,536; one sequence a microbatch). Mixtral-8x7B: NeMo's recommended H100 BF16
#: pre-training recipe (scripts/performance/recommended_model_configs/model_configs_h100.csv at
#: NVIDIA/NeMo ae861a9c43: 64 GPUs, seq 4096, TP 1, PP 4, VP 8, EP 8, MBS 1, GBS 256; Megatron's
#: distributed optimizer)
MODELS = {
    "gpt3-175b": (1024, "a100", {"batch": 1536, "seq": 2048},
                  Config(16, 8, 8, "megatron,sp,zero1", microbatches=96)),
    "mixtral-8x7b": (64, "h100", {"batch": 256, "seq": 4096},
                     Config(2, 1, 4, "dp,ep,zero1", microbatches=16, ep=8, virtual=8)),
    # DeepSeek-V3 technical report, section 3.2: pp=16, ep=64 over 8 nodes, ZeRO-1 data
    # parallelism, 2,048 H800s, batch 15,360 x 4k (one sequence a microbatch per dp x ep rank)
    "deepseek-v3": (2048, "h800", {"batch": 15360},
                    Config(2, 1, 16, "dp,ep,zero1", microbatches=120, ep=64)),
}


def _children() -> float:
    """CPU seconds of this process's ended children (the search's worker: planner/search_ahead)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def row(n: int, fold: bool, model_name: str | None = None) -> None:
    model, over = ROWS[n] if model_name is None else (model_name, MODELS[model_name][2])
    device = "h100" if model_name is None else MODELS[model_name][1]
    t0, c0, k0 = time.perf_counter(), time.process_time(), _children()
    res = search_meshes(model, n, device, overrides=over, fold=fold)
    wall, secs = time.perf_counter() - t0, time.process_time() - c0 + _children() - k0
    folded = sum(1 for c in res.candidates if c.folded)
    best = res.best
    what = f"{best.config.label()}: {best.step_s:.3f} s, MFU {100 * (best.mfu or 0):.1f}%" if best else "none fits"
    print(f"{n:6d}  {model:12s} {over.get('batch', ''):>5}  {secs:8.1f} s  {wall:8.1f} s  {res.plans:5d} planned  "
          f"{len(res.candidates):5d} costed  {folded:5d} folded  {len(res.candidates) / secs:7.2f}/s  {what}",
          flush=True)
    pub = PUBLISHED.get(n) if model_name is None else MODELS[model_name][3]
    if pub is not None:
        # planned whole, as the search's best is (the fold agrees to rounding, not to the last bit)
        got = [c for c in config_candidates(model, pub, device, overrides=over, fold=False) if c.fits]
        if got:
            p = min(got, key=lambda c: c.step_s)
            faster = best is not None and best.step_s <= p.step_s
            print(f"        published layout {p.config.label()}: {p.step_s:.3f} s, MFU {100 * (p.mfu or 0):.1f}% "
                  f"(the search's best is {'as fast or faster' if faster else 'SLOWER'})", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8,64,512,2048,16384")
    ap.add_argument("--no-fold", action="store_true")
    ap.add_argument("--models", default="", help=f"also these models' searches: {', '.join(MODELS)}")
    a = ap.parse_args()
    warnings.simplefilter("ignore")
    print("devices model        batch   CPU s     wall s    planned          costed       folded   costed per CPU s  best")
    for n in (int(x) for x in a.sizes.split(",") if x):
        row(n, not a.no_fold)
    for name in (x for x in a.models.split(",") if x):
        row(MODELS[name][0], not a.no_fold, name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
