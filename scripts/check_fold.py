"""Check layer folding (spmdkit.planner.fold) against planning at full depth.

For each configuration below, the search's figures (step time, memory per device, communication,
MFU, collectives, for every recomputation mode) from two shallow copies of the model are
compared with the model planned whole; prints one line per configuration and the worst
relative difference, exit 1 if any is over 1e-9 (or a configuration lists other modes).

    PYTHONPATH=src python scripts/check_fold.py [--quick] [--deep]

``--deep``: only the deep pipelines (DEEP).
"""

from __future__ import annotations

import sys
import time

from spmdkit.planner.search import Config, config_candidates
from spmdkit.program.runtime import Runtime

TOL = 1e-9
FIELDS = ("step_s", "memory", "comm_s", "mfu", "collectives")

#: (model, overrides, configurations): dense, pp (even and balanced), sp, ZeRO 1-3, recompute, cp, ep
#: (every configuration under each recomputation mode; Megatron-LM's buckets, then torchtitan's below)
CASES: list[tuple[str, dict[str, int], list[Config]]] = [
    ("llama3-8b", {"batch": 8}, [
        Config(8, 1, 1, "dp"), Config(8, 1, 1, "dp,zero1"), Config(8, 1, 1, "dp,zero2"), Config(8, 1, 1, "dp,zero3"),
        Config(4, 2, 1, "megatron"), Config(4, 2, 1, "megatron,sp,zero1"), Config(2, 4, 1, "megatron,sp,zero3"),
        Config(4, 1, 2, "dp,zero1", microbatches=2), Config(2, 2, 2, "megatron,sp,zero2", microbatches=4),
        Config(1, 2, 4, "megatron,sp", microbatches=8),
    ]),
    ("llama3-8b", {"batch": 32}, [  # gradient accumulation (--global-batch 32 --micro-batch 1)
        Config(8, 1, 1, "dp,zero1", grad_accum=4), Config(4, 2, 1, "megatron,sp,zero2", grad_accum=8),
    ]),
    ("llama3-8b", {"batch": 8, "layers": 29}, [  # layers the stages do not divide: a balanced split
        Config(4, 1, 2, "dp,zero1", microbatches=2), Config(2, 1, 3, "dp", microbatches=4),
        Config(1, 2, 4, "megatron,sp", microbatches=8),
    ]),
    ("llama3-8b", {"batch": 4, "seq": 16384}, [  # context parallelism
        Config(2, 2, 1, "megatron,sp,cp", cp=2), Config(1, 2, 1, "megatron,sp,cp,zero1", cp=4),
        Config(2, 1, 2, "dp,cp,zero2", microbatches=2, cp=2),
    ]),
    ("mixtral-8x7b", {"batch": 8}, [  # experts over ep
        Config(2, 1, 1, "dp,ep,zero1", ep=4), Config(1, 2, 1, "megatron,sp,ep", ep=4),
        Config(2, 1, 2, "dp,ep,zero2", microbatches=2, ep=2),
    ]),
    ("deepseek-v2-lite", {"batch": 8}, [  # a dense first layer, then MoE layers
        Config(2, 1, 1, "dp,ep,zero1", ep=4), Config(4, 2, 1, "megatron,sp,zero1"),
        Config(2, 1, 2, "dp,ep,zero1", microbatches=2, ep=2),
    ]),
]


#: deep pipelines, folded by stage (planner.fold_stages: the first stage, one middle stage of each
#: layer count, the last): pp 8 / 16 / 32 on 126 layers (uneven: balanced splits) and 128, interleaved vp=2
DEEP: list[tuple[str, dict[str, int], list[Config]]] = [
    ("llama3-8b", {"batch": 32, "layers": 126, "seq": 1024}, [
        Config(2, 1, 16, "dp,zero1", microbatches=16), Config(1, 2, 32, "megatron,sp", microbatches=32),
        Config(4, 1, 8, "dp,zero1", microbatches=8, virtual=2), Config(1, 1, 32, "dp", microbatches=32, virtual=2),
        Config(2, 2, 8, "megatron,sp,zero1", microbatches=16),
        # ZeRO-3 (FSDP's prefetch: folded by stage, its buckets' total time from the flat copies)
        Config(2, 1, 16, "dp,zero3", microbatches=16), Config(2, 2, 8, "megatron,sp,zero3", microbatches=16, virtual=2),
    ]),
    ("llama3-8b", {"batch": 32, "layers": 128, "seq": 1024}, [
        Config(1, 1, 32, "dp", microbatches=32), Config(2, 1, 16, "dp,zero2", microbatches=16, virtual=2),
    ]),
]

#: the same under torchtitan (FSDP2: a bucket per layer, the parameters' prefetch)
TORCHTITAN: list[tuple[str, dict[str, int], list[Config]]] = [
    ("llama3-8b", {"batch": 8}, [
        Config(8, 1, 1, "dp,zero3"), Config(4, 2, 1, "megatron,sp,zero3"), Config(4, 1, 2, "dp,zero3", microbatches=2),
        Config(8, 1, 1, "dp"),
    ]),
]


def compare(model: str, over: dict[str, int], cfg: Config,
            runtime: Runtime | None = None) -> tuple[float, int, float, float]:
    """(worst relative difference, layers of the deeper copy (0: not folded), s folded, s whole)."""
    t0 = time.perf_counter()
    folded = config_candidates(model, cfg, overrides=over, fold=True, runtime=runtime)
    t1 = time.perf_counter()
    whole = config_candidates(model, cfg, overrides=over, fold=False, runtime=runtime)
    t2 = time.perf_counter()
    if [c.config for c in folded] != [c.config for c in whole]:
        return float("inf"), 0, t1 - t0, t2 - t1
    worst = 0.0
    for f, w in zip(folded, whole):
        for k in FIELDS:
            a, b = getattr(f, k), getattr(w, k)
            if a is None or b is None:
                worst = max(worst, 0.0 if a is b else float("inf"))
                continue
            worst = max(worst, abs(a - b) / abs(b) if b else abs(a))
    return worst, max((c.folded for c in folded), default=0), t1 - t0, t2 - t1


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    worst_all, bad = 0.0, 0
    runs = [(m, o, c, None) for m, o, c in (DEEP if "--deep" in argv else CASES + DEEP)]
    if "--deep" not in argv:
        runs += [(m, o, c, Runtime(framework="torchtitan")) for m, o, c in TORCHTITAN]
    for model, over, cfgs, rt in runs:
        for cfg in cfgs[:2] if quick else cfgs:
            worst, layers, tf, tw = compare(model, over, cfg, rt)
            worst_all = max(worst_all, worst)
            bad += worst > TOL
            print(f"{model:17s} {rt.framework if rt else 'megatron':10s} {cfg.label():52s} folded to {layers:3d} layers  {tf:6.2f} s vs {tw:6.2f} s whole  "
                  f"worst {worst:.2e}{'  MISMATCH' if worst > TOL else ''}", flush=True)
    print(f"worst relative difference {worst_all:.2e} (tolerance {TOL:g}); {bad} over")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
