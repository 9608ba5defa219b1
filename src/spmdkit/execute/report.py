"""The text of a run's report (:func:`format_report`), and the step's seconds per phase beside the
plan's prediction of them (:func:`predicted_timing`, :func:`format_timing`)."""

from __future__ import annotations

import torch

from spmdkit.cost.compute import kernel_collectives
from spmdkit.cost.devices import cost_model, load_device, preset_of_gpu, recost
from spmdkit.cost.step import estimate_step
from spmdkit.execute.check import TOLERANCES, RunReport
from spmdkit.program.plan import Plan


def slowest(timings: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per phase and kind, the slowest rank's seconds (a step is as slow as its slowest rank)."""
    out: dict[str, dict[str, float]] = {}
    for t in timings:
        for ph, kinds in t.items():
            slot = out.setdefault(ph, {})
            for k, v in kinds.items():
                slot[k] = max(slot.get(k, 0.0), float(v))
    return out


def this_gpu(device: torch.device) -> str:
    """The device preset of this GPU (by its name), else h100."""
    if device.type == "cuda":
        got = preset_of_gpu(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory)
        return got or "h100"
    return "h100"


def predicted_timing(plan: Plan, device_name: str) -> tuple[dict[str, dict[str, float]], str]:
    """The plan's prediction of the step on ``device_name`` (a device preset or JSON), per phase
    as the executor runs it: compute (roofline time of the ops), comm (each reshard's
    collectives in the phase of the op that needs them, and the collectives inside kernels),
    all serial (the executor overlaps nothing). Returns (seconds, the device's name)."""
    dev = load_device(device_name)
    timed = recost(plan, cost_model(plan.mesh, dev))
    est = estimate_step(timed, dev)
    prog = plan.program
    out: dict[str, dict[str, float]] = {}
    for ph, v in est.compute_s.items():
        if ph in ("forward", "backward", "optimizer"):
            out.setdefault(ph, {"compute": 0.0, "comm": 0.0})["compute"] = v
    for r in timed.reshards:
        if r.shared:
            continue
        ph = prog.ops[r.op_index].phase
        out.setdefault(ph, {"compute": 0.0, "comm": 0.0})["comm"] += r.plan.time_s
    for k in kernel_collectives(timed):
        ph = prog.ops[k.op_index].phase
        out.setdefault(ph, {"compute": 0.0, "comm": 0.0})["comm"] += k.time_s
    total = sum(v["compute"] + v["comm"] for v in out.values())
    out["step"] = {"wall": total}
    return out, dev.name


def format_report(rep: RunReport, title: str) -> str:
    kinds: dict[str, int] = {}
    for c in rep.collectives:
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    kind_text = ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())) or "none"
    first, _, notes = title.partition("\n")  # the title's warnings (--fallback replicate) under its first line
    lines = [f"spmdkit run: {first}; {rep.world_size} processes ({rep.backend})", *notes.splitlines()]
    if rep.loss is not None:
        which = f"tensor {rep.loss_tensor}; " if rep.loss_tensor not in (None, "loss") else ""
        ref = "its op run unsharded on the ranks' inputs" if rep.kernels == "torch" else "single process"
        lines.append(f"loss {rep.loss:.12g} ({which}{ref} {rep.reference_loss:.12g})")
    differ = [f for f in rep.failures if f[0] != "collectives"]
    same = "all within" if rep.kernels == "torch" else "all equal"  # torch: to each dtype's rounding
    verdict = same if not differ else f"{len(differ)} differ (first: {differ[0][0]})"
    if rep.nonfinite:
        verdict += f"; {rep.nonfinite} hold NaN or infinite values"
    if rep.kernels == "torch":
        dt = sorted({d for d in TOLERANCES})
        lines.append(f"{rep.checked} tensors checked op by op, each against its op run unsharded with the same "
                     f"torch kernel and dtypes on the inputs the ranks received (loss, every activation, gradient "
                     f"and update; every reshard against the value it moved): "
                     f"max error {rep.max_rel_error:.3g} of a tensor's scale (tolerance "
                     + ", ".join(f"{d} {TOLERANCES[d]:g}" for d in dt if d != "float64")
                     + f"), max abs error {rep.max_error:.3g}, {verdict}")
    else:
        lines.append(f"{rep.checked} tensors compared with the single-process step (loss, every gradient, "
                     f"every update, every activation): max abs error {rep.max_error:.3g} where finite, {verdict}")
    lines.append(f"collectives per rank: {len(rep.collectives)} ({kind_text}); plan: {len(rep.expected)}; "
                 + ("every rank's equal the plan's" if rep.collectives_match else "NOT equal to the plan's"))
    if rep.eager is not None:
        e = rep.eager
        head = f"torch eager ({e.dtype or '?'} autograd, same inputs and weights):"
        if e.loss is not None:
            head += f" loss {e.loss:.12g};"
        bad = len(e.failures)
        how = (f"largest relative L2 error of a gradient {e.max_rel_error:.3g} (within rtol {e.rtol:g} or twice "
               f"torch's own half-precision step's largest, {e.native_error:.3g})" if e.native_error else
               f"max error {e.max_rel_error:.3g} of each tensor's largest magnitude (rtol {e.rtol:g}; gradients: at "
               "least a thousandth of the largest gradient)")
        lines.append(f"{head} {e.checked} tensors compared (the loss and every parameter gradient): {how}, "
                     + ("all within, every value finite" if not bad else f"{bad} NOT within or not finite"))
    lines.extend(format_timing(rep))
    for name, why in rep.failures[:20]:
        lines.append(f"  {name}: {why}")
    return "\n".join(lines)


def fmt_time(s: float) -> str:
    """Seconds down to nanoseconds (a tiny model's predicted op takes a few)."""
    for unit, f in (("s", 1.0), ("ms", 1e3), ("us", 1e6)):
        if s * f >= 1:
            return f"{s * f:.2f} {unit}"
    return f"{s * 1e9:.1f} ns"


def format_timing(rep: RunReport) -> list[str]:
    """The step's seconds per phase (the slowest rank's) beside the plan's prediction."""
    if not rep.timing:
        return []
    kern = "torch kernels" if rep.kernels == "torch" else "numpy float64 references"
    first = ("" if rep.kernels != "torch" else
             "; no warm-up: includes torch's first-call overhead, --warmup 1 to exclude it" if not rep.warmup
             else f"; after {rep.warmup} untimed step{'s' if rep.warmup > 1 else ''}")
    out = [f"time per phase ({kern}, slowest rank{first}; predicted: the plan on {rep.predicted_on or '?'}, "
           "serial):"]
    out.append(f"  {'phase':<10} {'compute':>10} {'predicted':>10} {'comm':>10} {'predicted':>10}")
    for ph in ("forward", "backward", "optimizer"):
        m = rep.timing.get(ph)
        if m is None:
            continue
        pr = rep.predicted.get(ph, {})
        out.append(f"  {ph:<10} {fmt_time(m.get('compute', 0.0)):>10} {fmt_time(pr.get('compute', 0.0)):>10} "
                   f"{fmt_time(m.get('comm', 0.0)):>10} {fmt_time(pr.get('comm', 0.0)):>10}")
    wall = rep.timing.get("step", {}).get("wall")
    if wall is not None:
        out.append(f"  step       {fmt_time(wall):>10} (predicted {fmt_time(rep.predicted.get('step', {}).get('wall', 0.0))})")
    return out


__all__ = ["fmt_time", "format_report", "format_timing", "predicted_timing", "slowest", "this_gpu"]
