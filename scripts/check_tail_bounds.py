"""Check that every configuration's step bound is at most its planned step, on the
configurations a LESS pruned search plans (issue 30: the step floor's tail).

The search is run with the floor's tail left out (``StepFloor.tail`` returning None: the
search as it ran before the tail, which plans more configurations); then, for each
configuration it planned, its bound as the search now computes it when its turn comes
(``search._step_bound(..., gathers=True)``: the layers' floor, ZeRO-3's gathers, each rank's
tail) is compared with its fastest fitting planned step (every recomputation mode and full:K
it priced). Prints each configuration whose bound is within 5% of the best or above its step,
the count of violations, and exits 1 on any.

    PYTHONPATH=src python scripts/check_tail_bounds.py deepseek-v3 2048 h800 batch=15360 [--main]

``--main``: the search also without a MoE model's busiest rank bound (``busiest_rank`` with
dense first layers, added with the tail): main's floor before them, which plans more.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from dataclasses import replace
from typing import Any

from spmdkit.cost.devices import load_device
from spmdkit.planner import search, search_config, search_floor
from spmdkit.planner.search_floor import StepFloor


def _no_tail(self: StepFloor, cfg: Any) -> None:
    return None


def main(argv: list[str]) -> int:
    warnings.simplefilter("ignore")
    model, devices, device = argv[0], int(argv[1]), argv[2]
    over = {k: int(v) for k, v in (a.split("=") for a in argv[3:] if "=" in a)}
    tail, busiest = StepFloor.tail, search_floor.busiest_rank
    StepFloor.tail = _no_tail  # type: ignore[method-assign]
    if "--main" in argv:
        def plain(*a: Any, **kw: Any) -> float:
            return 0.0 if kw.get("dense", a[6] if len(a) > 6 else 0) else busiest(*a, **kw)

        search_floor.busiest_rank = plain
    t0 = time.process_time()
    try:
        res = search.search_meshes(model, devices, device, overrides=over)
    finally:
        StepFloor.tail, search_floor.busiest_rank = tail, busiest  # type: ignore[method-assign]
    print(f"without the tail: {res.plans} planned, {len(res.pruned)} pruned, {time.process_time() - t0:.1f} CPU s; "
          f"best {res.best.config.label() if res.best else None} {res.best.step_s if res.best else None!r}")
    fastest: dict[Any, float] = {}
    for c in res.candidates:
        key = replace(c.config, recompute="none")
        if c.fits:
            fastest[key] = min(fastest.get(key, math.inf), c.step_s)
        else:
            fastest.setdefault(key, math.inf)
    mc, sizes = search._model_sizes(model, over)
    dev = load_device(device)
    job = search_config._Job(dev, sizes.tokens, ["none", "selective", "full"], dev.memory_bytes, None, None, None, 30.0)
    bounds = search._bounds(model, mc, job)
    floor = search._floor(model, mc, job, bounds)
    best = res.best.step_s if res.best else math.inf
    bad = 0
    for cfg, step in sorted(fastest.items(), key=lambda kv: kv[1]):
        before = search._step_bound(cfg, bounds, floor, job)
        low = search._step_bound(cfg, bounds, floor, job, gathers=True)
        over_step = low > step
        bad += over_step
        if over_step or (step < math.inf and low >= 0.95 * best) or step <= 1.02 * best:
            print(f"{cfg.label():70s} bound {before:8.3f} -> {low:8.3f} s, fastest fitting step {step:8.3f} s"
                  + ("  ABOVE ITS STEP" if over_step else "") + ("  (pruned now)" if low >= best else ""))
    pruned = sum(1 for cfg in fastest if search._step_bound(cfg, bounds, floor, job, gathers=True) >= best)
    print(f"{len(fastest)} configurations planned, {bad} bounds above their step; "
          f"{pruned} with bounds at least the best {best!r} (the tail would prune them)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
