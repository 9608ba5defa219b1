"""``plan --devices N``: the outer search's result (:func:`spmdkit.planner.search.search_meshes`)
as a terminal table (:func:`write_search`) or JSON (:func:`search_json`)."""

from __future__ import annotations

from typing import Any, TextIO

from spmdkit.outputs.report import fmt_bytes, fmt_time
from spmdkit.outputs.tables import print_table
from spmdkit.planner.search import SearchResult


def write_search(res: SearchResult, out: TextIO, top: int = 10) -> None:
    """The top fitting configurations as a table, then what was rejected and refused."""
    rows = []
    ep = any(c.config.ep > 1 for c in res.candidates) or any(c.ep > 1 for c, _ in res.refused + res.pruned)
    for k, c in enumerate(res.fitting[:top]):
        cf = c.config
        mesh = f"{cf.dp}x{cf.ep}x{cf.tp}x{cf.pp}" if ep else f"{cf.dp}x{cf.tp}x{cf.pp}"
        rows.append([str(k + 1), mesh + (f" vp={cf.virtual}" if cf.virtual > 1 else "") + (f" m={cf.microbatches}" if cf.pp > 1 else "") + (f" accum={cf.grad_accum}" if cf.grad_accum > 1 else "")
                     + (f" cp={cf.cp}" if cf.cp > 1 else ""),
                     cf.strategy, cf.recompute, fmt_time(c.step_s), f"{100 * c.mfu:.1f}%" if c.mfu else "-",
                     fmt_bytes(c.memory), fmt_time(c.comm_s)])
    n_fit = len(res.fitting)
    over = [c for c in res.candidates if not c.fits]
    print_table(f"Top {min(top, n_fit)} of {n_fit} configurations that fit in {fmt_bytes(res.memory_cap)} per device "
           f"({res.devices} x {res.device.name}; {res.plans} plans in {res.seconds:.1f} s)",
           ["#", "dp x ep x tp x pp" if ep else "dp x tp x pp", "strategy", "recompute", "step", "MFU", "memory/device", "comm"], rows, out)
    if over:
        least = min(over, key=lambda c: c.memory)
        out.write(f"rejected over the memory cap: {len(over)} configurations (the smallest needs "
                  f"{fmt_bytes(least.memory)}: {least.config.label()})\n")
    if res.pruned:
        mem = sum(1 for _, why in res.pruned if why.startswith("over the memory cap"))
        out.write(f"pruned by bounds (spmdkit.planner.search_bounds), not planned: {len(res.pruned)} configurations "
                  f"({mem} over the memory cap by their parameters, states and kept layer inputs alone, "
                  f"{len(res.pruned) - mem} whose step cannot beat the best)\n")
    if res.refused:
        out.write(f"not planned: {len(res.refused)} configurations\n")
        for cfg, why in res.refused[:8]:
            what = cfg.mesh_text + ("" if cfg.strategy == "*" else f" {cfg.strategy}")
            out.write(f"  {what}: {why[:160]}\n")
        if len(res.refused) > 8:
            out.write(f"  ... and {len(res.refused) - 8} more\n")


def search_json(res: SearchResult, top: int = 10) -> dict[str, Any]:
    """The search as JSON: its sizes, the top fitting configurations, every refused one."""
    out: dict[str, Any] = {"devices": res.devices, "device": res.device.name, "memory_cap": res.memory_cap,
                           "seconds": res.seconds, "plans": res.plans, "fitting": len(res.fitting),
                           "over_memory_cap": sum(1 for c in res.candidates if not c.fits),
                           "top": [c.to_json() for c in res.fitting[:top]],
                           "refused": [{**cfg.to_json(), "reason": why} for cfg, why in res.refused]}
    if res.pruned:  # a search pruned by bounds (a large MoE search)
        out["pruned"] = [{**cfg.to_json(), "reason": why} for cfg, why in res.pruned]
    return out


__all__ = ["search_json", "write_search"]
