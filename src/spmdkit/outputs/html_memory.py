"""The memory over the step on the page of ``spmdkit plan --html`` (:mod:`spmdkit.outputs.html`):
the activations live while each op runs (:attr:`spmdkit.cost.memory.Memory.curve`) over what is
held for the whole step, the peak marked; with a pipeline, the fullest pp rank's curve and a
table of every rank."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from spmdkit.cost.memory import (
    Memory,
    activation_deltas,
    fit_verdict,
    memory_per_device,
    per_microbatch_mode,
)
from spmdkit.cost.memory_saved import saved_activations
from spmdkit.outputs.html_figures import PHASE_COLOURS, esc
from spmdkit.outputs.pipeline import write_moe_memory
from spmdkit.outputs.report import fmt_bytes
from spmdkit.planner.pipeline_split import op_stages, stage_layers
from spmdkit.program.plan import Plan


def _memory_svg(plan: Plan, mem: Memory, curve: Sequence[int], cap: int, idx: Sequence[int] | None = None) -> str:
    """The live memory while each op runs: ``curve[k]`` the activations live at op ``idx[k]``
    (default: every op of the program) over what is held for the step; the peak marked."""
    prog = plan.program
    held = mem.parameters + mem.gradients + mem.optimizer_states
    n = len(curve)
    ix = list(idx) if idx is not None else list(range(n))
    at = max(range(n), key=curve.__getitem__) if n else 0
    peak = held + (curve[at] if n else 0)
    x0, w, h0 = 80, 900, 220
    top = max([peak] + ([cap] if cap and cap < 2 * peak else [])) or 1
    sy = h0 / top
    step = max(1, n // 800)
    pts = []
    for k in range(0, n, step):
        chunk = curve[k:k + step]
        j = k + max(range(len(chunk)), key=chunk.__getitem__)  # keep each bucket's highest point
        pts.append(f"{x0 + w * j / max(1, n - 1):.1f},{10 + h0 - (held + curve[j]) * sy:.1f}")
    parts = [f'<svg class="fig memory" data-figure="memory" data-peak="{peak}" '
             f'data-points="{len(pts)}" width="{x0 + w + 200}" height="{h0 + 50}" viewBox="0 0 {x0 + w + 200} '
             f'{h0 + 50}" role="img" aria-label="memory over the step">']
    # phase bands
    start = 0
    for k in range(1, n + 1):
        if k == n or prog.ops[ix[k]].phase != prog.ops[ix[start]].phase:
            ph = prog.ops[ix[start]].phase
            parts.append(f'<rect x="{x0 + w * start / max(1, n - 1):.1f}" y="10" '
                         f'width="{max(0.5, w * (k - 1 - start) / max(1, n - 1)):.1f}" height="{h0}" '
                         f'fill="{PHASE_COLOURS.get(ph, "#ccc")}" opacity="0.12"><title>{esc(ph)}</title></rect>')
            start = k
    parts.append(f'<line x1="{x0}" y1="{10 + h0 - held * sy:.1f}" x2="{x0 + w}" y2="{10 + h0 - held * sy:.1f}" '
                 f'stroke="#888" stroke-dasharray="4 3"><title>parameters, gradients and optimizer states: '
                 f'{fmt_bytes(held)}</title></line>')
    parts.append(f'<polyline points="{" ".join(pts)}" fill="none" stroke="#4e79a7" stroke-width="1.5"/>')
    if cap and cap <= top:
        y = 10 + h0 - cap * sy
        parts.append(f'<line x1="{x0}" y1="{y:.1f}" x2="{x0 + w}" y2="{y:.1f}" stroke="#e15759"/>'
                     f'<text x="{x0 + w + 4}" y="{y + 4:.1f}" class="lbl">device {fmt_bytes(cap)}</text>')
    px = x0 + w * at / max(1, n - 1)
    py = 10 + h0 - peak * sy
    peak_name = prog.ops[ix[at]].name if n else "-"
    parts.append(f'<circle class="peak" cx="{px:.1f}" cy="{py:.1f}" r="5" fill="#e15759"><title>peak '
                 f'{fmt_bytes(peak)} at op {ix[at] if n else 0} ({esc(peak_name)})</title></circle>'
                 f'<text x="{min(px + 8, x0 + w - 10):.1f}" y="{max(py - 6, 22):.1f}" class="lbl">peak '
                 f'{fmt_bytes(peak)} at {esc(peak_name)}</text>')
    for k in range(5):
        v = top * k / 4
        y = 10 + h0 - v * sy
        parts.append(f'<text x="{x0 - 6}" y="{y + 4:.1f}" text-anchor="end" class="lbl">{fmt_bytes(v)}</text>'
                     f'<line x1="{x0 - 3}" y1="{y:.1f}" x2="{x0}" y2="{y:.1f}" stroke="#888"/>')
    parts.append(f'<text x="{x0 + w / 2}" y="{h0 + 40}" text-anchor="middle" class="lbl">ops in program order '
                 f'(forward, backward, optimizer shaded)</text></svg>')
    return "".join(parts)


def pipeline_rank_curve(plan: Plan, pipe: Any, recompute: str) -> tuple[int, list[int], list[int]]:
    """The fullest pipeline rank of ``pipe`` (by what its device holds), and the activations
    live over its ops (op indices, bytes): one microbatch through its stages plus the other
    microbatches it holds in flight, so that the curve's peak is its
    :attr:`spmdkit.cost.memory.Memory.activation_peak`. ``recompute``: the pipeline's mode
    (``full:K`` / ``every:N``: full's regions of the layers it recomputes on each stage,
    :func:`spmdkit.planner.pipeline_split.stage_layers`, as the pipeline's memory counts them)."""
    p, v = pipe.spec.pp, pipe.spec.virtual
    r = max(range(p), key=lambda k: pipe.memory[k].device_total)
    stages = op_stages(plan.program, pipe.counts)
    mine = {c * p + r for c in range(v)}
    only = stage_layers(plan.program, pipe.counts, recompute, p)
    deltas = activation_deltas(plan, saved_activations(plan, per_microbatch_mode(recompute), only), stages, p * v)
    idx = [i for i, s in enumerate(stages) if s in mine]
    cur, curve = 0, []
    for i in idx:
        cur += sum(deltas[s].get(i, 0) for s in mine)
        curve.append(cur)
    lift = pipe.memory[r].activation_peak - max(curve, default=0)  # the stash of the microbatches in flight
    return r, idx, [c + lift for c in curve]


def memory_section(plan: Plan, mem: Memory, recompute: str, cap: int, pipe: Any) -> str:
    idx: list[int] | None = None
    curve: Sequence[int] = mem.curve
    what = "Per device"
    note = ""
    if pipe is not None:
        rows = "".join(f"<tr><td>{r}</td><td>{pipe.in_flight[r]:g}</td><td>{fmt_bytes(m.parameters)}</td>"
                       f"<td>{fmt_bytes(m.gradients)}</td><td>{fmt_bytes(m.optimizer_states)}</td>"
                       f"<td>{fmt_bytes(m.activation_peak)}</td><td>{fmt_bytes(m.total)}</td>"
                       f"<td>{fmt_bytes(m.device_total)}</td></tr>"
                       for r, m in enumerate(pipe.memory))
        r, idx, curve = pipeline_rank_curve(plan, pipe, recompute)
        mem = pipe.memory[r]
        what = (f"The fullest pipeline rank, {r} (its stages' ops, one microbatch through them over the "
                f"{pipe.in_flight[r]:g} microbatches it holds in flight)")
        note = ('<p>Per pipeline rank (microbatches of activations in flight):</p><table class="small"><tr>'
                '<th>pp rank</th><th>in flight</th><th>parameters</th><th>gradients</th><th>optimizer</th>'
                f'<th>activations</th><th>allocated</th><th>on the device</th></tr>{rows}</table>')
        if pipe.moe is not None:  # the text report's breakdown of the fullest rank into experts and the rest
            buf = io.StringIO()
            write_moe_memory(pipe.moe, buf)
            note += f'<pre class="small">{esc(buf.getvalue())}</pre>'
    elif not curve:
        curve = memory_per_device(plan, recompute).curve
    if not curve:
        return ""
    extra = (f' The allocated peak, {fmt_bytes(mem.total)}, grows by the caching allocator\'s reserve '
             f'({fmt_bytes(mem.allocator_reserve)}) and the CUDA context and NCCL buffers '
             f'({fmt_bytes(mem.runtime_overhead)}) to {fmt_bytes(mem.device_total)} on the device'
             + (f": {fit_verdict(mem.device_total, cap)[1]}." if cap else "."))
    return ('<section id="memory"><h2>Memory over the step</h2><p>' + esc(what) + ': what is held for the whole step '
            f'(parameters, gradients, optimizer states: {fmt_bytes(mem.parameters + mem.gradients + mem.optimizer_states)}, '
            'dashed) plus the activations live while each op runs; the peak is marked.' + esc(extra) + '</p>'
            f'{_memory_svg(plan, mem, curve, cap, idx)}{note}</section>')


__all__ = ["memory_section", "pipeline_rank_curve"]
