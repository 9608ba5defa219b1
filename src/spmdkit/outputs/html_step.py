"""The predicted step on the page of ``spmdkit plan --html`` (:mod:`spmdkit.outputs.html`): the
``timeline`` of :func:`spmdkit.cost.step.estimate_step` (the phases, every op's compute and the
blocking communication before it in program order, the gradient buckets on their own stream),
and with a pipeline the schedule of every pp rank."""

from __future__ import annotations

from typing import Any

from spmdkit.outputs.html_figures import BUCKET_COLOUR, COMM_COLOUR, PHASE_COLOURS, axis_svg, esc
from spmdkit.outputs.report import context_notes, ep_overlap_note, fmt_bytes, fmt_time, moe_load_note
from spmdkit.program.plan import Plan


def _timeline_svg(plan: Plan, est: Any) -> str:
    prog = plan.program
    tl = est.timeline
    end = max([est.step_overlap_s] + [b.start_s + b.time_s for b in est.buckets]) or 1.0
    x0, w = 180, 900
    lanes = ["phase", "compute", "blocking communication", "gradient buckets"]
    lh = 22
    h = 10 + len(lanes) * (lh + 6) + 30
    sx = w / end
    parts = [f'<svg class="fig timeline" data-figure="timeline" data-ops="{len(tl)}" data-end="{end:.9g}" '
             f'width="{x0 + w + 50}" height="{h}" viewBox="0 0 {x0 + w + 50} {h}" role="img" '
             f'aria-label="predicted timeline of one step">']
    for k, name in enumerate(lanes):
        parts.append(f'<text x="{x0 - 6}" y="{10 + k * (lh + 6) + 15}" text-anchor="end" class="lbl">{esc(name)}</text>')

    def lane_y(k: int) -> int:
        return 10 + k * (lh + 6)

    # phases
    spans: list[list[Any]] = []
    for i, start, comm, extra, comp in tl:
        ph = prog.ops[i].phase
        stop = start + comm + extra + comp
        if spans and spans[-1][0] == ph:
            spans[-1][2] = stop
        else:
            spans.append([ph, start, stop])
    for ph, a, b in spans:
        parts.append(f'<rect class="phase" x="{x0 + a * sx:.2f}" y="{lane_y(0)}" width="{max(0.5, (b - a) * sx):.2f}" '
                     f'height="{lh}" fill="{PHASE_COLOURS.get(ph, "#999")}" opacity="0.45"><title>{esc(ph)}: '
                     f'{fmt_time(b - a)}</title></rect>')
        if (b - a) * sx > 60:
            parts.append(f'<text x="{x0 + (a + b) / 2 * sx:.1f}" y="{lane_y(0) + 15}" text-anchor="middle" '
                         f'class="lbl">{esc(ph)}</text>')
    # compute and blocking communication per op; ops narrower than a pixel merged with their neighbours
    n_comp = n_comm = 0

    def flush(run: list[Any], lane: int, colour: str, cls: str) -> int:
        if not run:
            return 0
        a, b = run[0][1], run[-1][2]
        names = [prog.ops[i].name or prog.ops[i].rule for i, _, _ in run]
        tip = names[0] if len(run) == 1 else f"{len(run)} ops: {names[0]} ... {names[-1]}"
        parts.append(f'<rect class="{cls}" x="{x0 + a * sx:.2f}" y="{lane_y(lane)}" '
                     f'width="{max(0.6, (b - a) * sx):.2f}" height="{lh}" fill="{colour}"><title>{esc(tip)}: '
                     f'{fmt_time(sum(e - s for _, s, e in run))}</title></rect>')
        return 1

    comp_run: list[Any] = []
    comm_run: list[Any] = []
    for i, start, comm, extra, comp in tl:
        ph = prog.ops[i].phase
        if comm > 0:
            item = (i, start, start + comm)
            if comm_run and (item[2] - comm_run[0][1]) * sx < 1.0:
                comm_run.append(item)
            else:
                n_comm += flush(comm_run, 2, COMM_COLOUR, "comm")
                comm_run = [item]
        if extra > 0:  # recomputation and re-gathers before the op
            n_comp += flush(comp_run, 1, PHASE_COLOURS.get(ph, "#999"), "compute")
            comp_run = []
            n_comp += flush([(i, start + comm, start + comm + extra)], 1, PHASE_COLOURS["recompute"], "compute")
        if comp > 0:
            item = (i, start + comm + extra, start + comm + extra + comp)
            same = comp_run and prog.ops[comp_run[0][0]].phase == ph
            if same and (item[2] - comp_run[0][1]) * sx < 1.0:
                comp_run.append(item)
            else:
                n_comp += flush(comp_run, 1, PHASE_COLOURS.get(prog.ops[comp_run[0][0]].phase, "#999")
                                if comp_run else "#999", "compute")
                comp_run = [item]
    n_comm += flush(comm_run, 2, COMM_COLOUR, "comm")
    if comp_run:
        n_comp += flush(comp_run, 1, PHASE_COLOURS.get(prog.ops[comp_run[0][0]].phase, "#999"), "compute")
    for b in est.buckets:
        parts.append(f'<rect class="bucket" x="{x0 + b.start_s * sx:.2f}" y="{lane_y(3)}" '
                     f'width="{max(0.6, b.time_s * sx):.2f}" height="{lh}" fill="{BUCKET_COLOUR}"><title>bucket: '
                     f'{esc(b.kind)} of {b.tensors} gradients, {fmt_bytes(b.bytes)}, {fmt_time(b.time_s)} (ready at '
                     f'{fmt_time(b.ready_s)})</title></rect>')
    parts.append(axis_svg(x0, w, end, lane_y(len(lanes)) + 2, fmt_time))
    parts.append("</svg>")
    svg = "".join(parts)
    return svg.replace('data-figure="timeline"', f'data-figure="timeline" data-compute-rects="{n_comp}" '
                                                   f'data-comm-rects="{n_comm}"', 1)


def _pipeline_svg(pipe: Any) -> str:
    run = pipe.run
    p = pipe.spec.pp
    end = run.pipeline_s or 1.0
    x0, w, lh = 90, 900, 22
    h = 10 + p * (lh + 6) + 30
    sx = w / end
    m = pipe.spec.microbatches
    parts = [f'<svg class="fig pipeline" data-figure="pipeline" data-units="{len(run.units)}" width="{x0 + w + 50}" '
             f'height="{h}" viewBox="0 0 {x0 + w + 50} {h}" role="img" aria-label="pipeline schedule">']
    for r in range(p):
        parts.append(f'<text x="{x0 - 6}" y="{10 + r * (lh + 6) + 15}" text-anchor="end" class="lbl">pp rank {r}</text>')
    for r, kind, k, i, a, b in run.units:
        y = 10 + r * (lh + 6)
        hue = (i * 360 / max(1, m)) % 360
        fill = f"hsl({hue:.0f}, 60%, {({'F': 72, 'W': 34}).get(kind, 48)}%)"
        label = f"{kind}{i}"
        parts.append(f'<rect class="unit" x="{x0 + a * sx:.2f}" y="{y}" width="{max(0.6, (b - a) * sx):.2f}" '
                     f'height="{lh}" fill="{fill}" stroke="#fff" stroke-width="0.5"><title>'
                     f'{({"F": "forward", "W": "weight gradients"}).get(kind, "backward")} of microbatch {i}, stage {k}: {fmt_time(b - a)}'
                     f'</title></rect>')
        if (b - a) * sx > 7 * len(label) + 2:
            parts.append(f'<text x="{x0 + (a + b) / 2 * sx:.1f}" y="{y + 15}" text-anchor="middle" '
                         f'class="lbl">{label}</text>')
    parts.append(axis_svg(x0, w, end, 10 + p * (lh + 6) + 2, fmt_time))
    parts.append("</svg>")
    return "".join(parts)


def step_section(plan: Plan, est: Any, assumed: str | None, pipe: Any) -> str:
    rows = "".join(f"<tr><td>{ph}</td><td>{fmt_time(est.compute_s.get(ph, 0.0))}</td>"
                   f"<td>{fmt_time(est.comm_s.get(ph, 0.0))}</td></tr>" for ph in ("forward", "backward", "optimizer"))
    if est.recompute != "none":
        rows += (f"<tr><td>recomputation ({esc(est.recompute)})</td><td>{fmt_time(est.compute_s.get('recompute', 0.0))}"
                 f"</td><td>{fmt_time(est.comm_s.get('recompute', 0.0))}</td></tr>")
    rows += (f"<tr><td>gradient buckets</td><td>-</td><td>{fmt_time(est.grad_sync_s)}</td></tr>"
             f"<tr><td>collectives inside ops</td><td>-</td><td>{fmt_time(est.kernel_comm_s)}</td></tr>")
    if est.rings:
        rows += f"<tr><td>ring attention (KV blocks passed round cp)</td><td>-</td><td>{fmt_time(est.ring_comm_s)}</td></tr>"
    rows += (f"<tr><td>total</td><td>{fmt_time(est.compute_total_s)}</td><td>{fmt_time(est.comm_total_s)}</td></tr>")
    notes = "".join(f"<p>{esc(n)}</p>" for n in [moe_load_note(est.moe_load), ep_overlap_note(est), *context_notes(est)] if n)
    note = f' <b>{esc(assumed)}</b>' if assumed else ""
    when = "every one reduce-scatters its ZeRO gradients" if plan.microstep_reductions() else \
        "the gradients are reduced after the last"
    accum = f" One of the {plan.grad_accum} micro-steps is drawn ({when})." if plan.grad_accum > 1 else ""
    one = " One microbatch through the whole program on the stages' sub-mesh:" if pipe is not None else ""
    out = (f'<section id="step"><h2>Predicted step</h2><p>{esc(one)} On {esc(est.device.name)}: '
           f'{fmt_time(est.step_overlap_s)} with the gradient reductions '
           f'{"overlapping the backward" if plan.runtime.grad_overlap else "after it (--no-grad-overlap)"} '
           f'({fmt_time(est.step_serial_s)} serial).{note}{accum} Ops narrower than a pixel are drawn together; hover '
           f'for names and times.</p>{_timeline_svg(plan, est)}<table class="small"><tr><th>phase</th>'
           f'<th>compute</th><th>communication</th></tr>{rows}</table>{notes}')
    if pipe is not None and pipe.run is not None:
        s = pipe.spec
        out += (f'<h3>Pipeline schedule</h3><p>{esc(s.schedule)}, pp={s.pp}'
                + (f", {s.virtual} virtual stages per rank" if s.virtual > 1 else "")
                + (f", microbatch groups of {s.group}" if s.group else "")
                + f', {s.microbatches} microbatches: {fmt_time(pipe.run.pipeline_s)}, bubble '
                f'{100 * pipe.run.bubble_fraction:.1f}% (F: forward, B: backward, by microbatch; the timeline above '
                f'is one microbatch of the stages\' program).</p>{_pipeline_svg(pipe)}')
    return out + "</section>"


__all__ = ["step_section"]
