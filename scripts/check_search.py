"""Check that the pruned search (the step floor of planner/search_floor.py and the bounds of
planner/search_bounds.py) finds what the exhaustive search finds.

For each search below, ``search_meshes(..., prune=False)`` (every configuration planned and
priced: the search as it ran before the floor, the default below 512 devices for a dense model)
and ``prune=True`` are run; their best configurations and its figures (step, memory per device,
communication, MFU, collectives) must be equal, and every configuration the pruned search left
unplanned for its step must be no faster in the exhaustive one than the best. Prints one line a
search and exits 1 on any difference.

    PYTHONPATH=src python scripts/check_search.py [--quick]

``--quick``: the first two searches only (a few minutes on a loaded 2-core machine).
"""

from __future__ import annotations

import sys
import time
import warnings

from spmdkit.planner.search import SearchResult, search_meshes

#: (model, devices, device, overrides)
SEARCHES: list[tuple[str, int, str, dict[str, int]]] = [
    ("llama3-8b", 8, "h100", {"batch": 8}),
    ("deepseek-v2-lite", 8, "h100", {"batch": 8}),  # a MoE that fits (Mixtral 8x7B needs more than 8 H100)
    ("llama-70b", 8, "h100", {"batch": 8}),
    ("llama3-8b", 64, "h100", {"batch": 64}),
    ("llama-70b", 64, "h100", {"batch": 64}),
    ("llama-70b", 256, "h100", {"batch": 256}),
]

FIELDS = ("step_s", "memory", "comm_s", "mfu", "collectives")


def compare(full: SearchResult, pruned: SearchResult) -> list[str]:
    """The differences between the two searches' answers (empty: none)."""
    a, b = full.best, pruned.best
    if a is None or b is None:
        return [] if a is b else [f"best: {a} vs {b}"]
    out = [] if a.config == b.config else [f"best: {a.config.label()} vs {b.config.label()}"]
    out += [f"{k}: {getattr(a, k)} vs {getattr(b, k)}" for k in FIELDS if getattr(a, k) != getattr(b, k)]
    steps: dict[str, float] = {}
    for c in full.fitting:
        key = c.config.label().split(" recompute=")[0]
        steps[key] = min(steps.get(key, float("inf")), c.step_s)
    for cfg, why in pruned.pruned:
        if why.startswith("its step is at least") and steps.get(cfg.label(), float("inf")) < a.step_s:
            out.append(f"pruned {cfg.label()} though its step {steps[cfg.label()]:.4g} s beats the best")
    return out


def main(argv: list[str]) -> int:
    warnings.simplefilter("ignore")
    bad = 0
    for model, n, dev, over in SEARCHES[:2] if "--quick" in argv else SEARCHES:
        t0 = time.process_time()
        full = search_meshes(model, n, dev, overrides=over, prune=False)
        t1 = time.process_time()
        pruned = search_meshes(model, n, dev, overrides=over, prune=True)
        t2 = time.process_time()
        diff = compare(full, pruned)
        bad += bool(diff)
        best = full.best.config.label() if full.best else "none fits"
        print(f"{model:13s} {n:4d} {dev}: {full.plans:4d} planned in {t1 - t0:7.1f} CPU s exhaustive, "
              f"{pruned.plans:4d} in {t2 - t1:7.1f} s pruned ({len(pruned.pruned)} pruned); best {best}: "
              + ("same best, same figures" if not diff else "DIFFERENT: " + "; ".join(diff)), flush=True)
    print("all equal" if not bad else f"{bad} searches differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
