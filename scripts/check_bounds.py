"""Check the pruned search's bounds against the plans of the configurations it plans.

Runs ``search_meshes(MODEL, DEVICES, DEVICE, overrides)`` and plans each configuration it
planned again with every recomputation mode and its least fitting ``full:K``
(``config_candidates``, as the search prices them), then checks, per configuration:

- its step bound (``search._step_bound`` with the ZeRO-3 gathers) is at most its fastest fitting
  step;
- each fitting mode's floor (``StepFloor.step``; ``full:K``: ``blocks_step``) is at most its step;
- the memory bound (every mode's, and each mode's with its kept bytes, full with its layer's
  working peak) is at most each planned mode's memory;
- the floor's working peak of a layer recomputed in full (``LayerFloor.full_peak``) is at most
  every stage's working peak under full and ``full:K``.

Prints one line a configuration and the count of those with a violation; exits 1 on any.

    PYTHONPATH=src python scripts/check_bounds.py deepseek-v3 2048 h800 batch=15360
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import replace
from typing import Any

from spmdkit.cost.devices import load_device
from spmdkit.planner.search import Config, _bounds, _floor, _model_sizes, _step_bound, config_candidates, search_meshes
from spmdkit.planner.search_blocks import blocks_k
from spmdkit.planner.search_bounds import memory_bound
from spmdkit.planner.search_config import _Job

GIB = 2**30


def violations(cfg: Config, got: list[Any], bounds: Any, floor: Any, job: _Job) -> list[str]:
    """What of ``cfg``'s bounds is above its plans (``got``: its candidates, every mode)."""
    out = []
    low = _step_bound(cfg, bounds, floor, job, gathers=True)
    best = min((c.step_s for c in got if c.fits), default=math.inf)
    if low > best:
        out.append(f"step bound {low:.4f} > {best:.4f}")
    f = floor.of(cfg) if floor is not None else None
    every = memory_bound(cfg, bounds)
    for c in got:
        rc = c.config.recompute
        kept = f.kept.get(rc, 0) if f is not None and not blocks_k(rc) else 0
        mode = memory_bound(cfg, bounds, kept, f.full_peak if f is not None and rc == "full" else 0.0)
        if max(every, mode) > c.memory:
            out.append(f"memory bound {max(every, mode) / GIB:.2f} GiB > {rc}'s {c.memory / GIB:.2f}")
        if c.fits and floor is not None:
            mine = floor.blocks_step(cfg) if blocks_k(rc) else floor.step(cfg, rc, True)
            if mine > c.step_s:
                out.append(f"{rc}'s floor {mine:.4f} > {c.step_s:.4f}")
        if cfg.pp > 1 and f is not None and rc.startswith("full") and hasattr(c.estimate, "stages"):
            wp = min(s.working_peak for s in c.estimate.stages)
            if f.full_peak > wp:
                out.append(f"{rc}: layer peak {f.full_peak / GIB:.3f} GiB > a stage's {wp / GIB:.3f}")
    return out


def main(argv: list[str]) -> int:
    warnings.simplefilter("ignore")
    model, devices, device = argv[0], int(argv[1]), argv[2]
    over = {k: int(v) for k, v in (a.split("=") for a in argv[3:])}
    result = search_meshes(model, devices, device, overrides=over)
    cfgs = sorted({replace(c.config, recompute="none") for c in result.candidates}, key=lambda c: c.label())
    mc, sizes = _model_sizes(model, over)
    dev = load_device(device)
    job = _Job(dev, sizes.tokens, ["none", "selective", "full"], result.memory_cap, None, None, None, 30.0)
    bounds = _bounds(model, mc, job)
    floor = _floor(model, mc, job, bounds)
    bad = 0
    for cfg in cfgs:
        got = config_candidates(model, cfg, dev, over, memory_cap=result.memory_cap)
        found = violations(cfg, got, bounds, floor, job)
        bad += bool(found)
        modes = " ".join(f"{c.config.recompute}:{c.step_s:.2f}{'' if c.fits else 'x'}" for c in got)
        print(f"{cfg.label()}: [{modes}] {'; '.join(found) or 'ok'}", flush=True)
    print(f"{bad} of {len(cfgs)} configurations with a bound above their plans; best {result.best.config.label() if result.best else None}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
