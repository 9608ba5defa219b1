"""``spmdkit plan --html FILE``: the plan as one self-contained HTML page.

Everything is generated here, standard library only: inline CSS, SVG figures drawn from the
plan's numbers, and a few lines of JavaScript (sorting and filtering the reshard table); the
page loads nothing from the network. Figures:

- the mesh: every rank at its mesh coordinates, outlined by the node it is on (ranks per node:
  the device's, ``--nodes-of``, else 8), and for each mesh dim whether its groups stay inside a
  node;
- the sharding of each tensor of layer 0 (and of those outside the layers), drawn as
  ``torch.distributed.tensor.debug.visualize_sharding`` does: the global shape as a grid of
  blocks (the leading axes flattened into the rows, the last axis across), each block labelled
  with the ranks that hold it and coloured per block; a partial tensor hatched, the mesh dims
  it is partial over named;
- per layer: the communication time (forward, backward, optimizer) and the memory held
  (parameters, gradients, optimizer states, activations kept for the backward);
- the predicted step (:func:`spmdkit.cost.step.estimate_step`, its ``timeline``): the
  phases, every op's compute and the blocking communication before it in program order, the
  gradient buckets on their own stream; with a pipeline the schedule of every pp rank;
- the live memory over the step (:attr:`spmdkit.cost.memory.Memory.curve` plus what is held
  for the whole step), the peak marked;
- the reshard table (:func:`spmdkit.outputs.report.reshard_groups`), sortable and filterable;
- with ``--auto``: how the search went, the runner-ups of ``--explain`` per layer, and other
  plans to compare where a caller gives them (``alternatives``).

:func:`save_html` writes the page atomically (a temporary file in the same directory, then
renamed): an error leaves no partial file.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr, entry_dims
from spmdkit.core.errors import ProgramError
from spmdkit.core.version import __version__
from spmdkit.cost.band import error_band
from spmdkit.cost.compute import guess_tokens, kernel_collectives
from spmdkit.cost.devices import preset_device
from spmdkit.cost.memory import (
    MICROBATCH,
    Memory,
    activation_deltas,
    fit_verdict,
    held_for_the_step,
    local_numel,
    memory_per_device,
    per_microbatch_mode,
)
from spmdkit.cost.memory_saved import saved_activations
from spmdkit.cost.step import estimate_step
from spmdkit.io.atomic import output_problem, write_atomic
from spmdkit.outputs.report import fmt_bytes, fmt_time, placements, reshard_groups
from spmdkit.planner.pipeline_split import op_stages, stage_layers
from spmdkit.program.ir import Program
from spmdkit.program.layers import Layers, program_layers
from spmdkit.program.plan import Plan

PHASE_COLOURS = {"forward": "#4e79a7", "backward": "#f28e2b", "optimizer": "#59a14f", "recompute": "#b07aa1"}
COMM_COLOUR = "#e15759"
BUCKET_COLOUR = "#9c755f"
#: The most blocks drawn along one side of a tensor's grid (a larger mesh: the first ones, and a note).
MAX_BLOCKS = 64


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def rank_colour(k: int) -> str:
    """A distinct colour for the ``k``-th rank or block (golden-angle hues)."""
    palette = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
               "#9c755f", "#bab0ac"]
    if k < len(palette):
        return palette[k]
    return f"hsl({(k * 137.508) % 360:.0f}, 55%, 62%)"


def _ranges(xs: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 6]`` -> ``0-3,6``."""
    out: list[str] = []
    xs = sorted(xs)
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def _coords(shape: Sequence[int], rank: int) -> list[int]:
    c = []
    for s in reversed(shape):
        c.append(rank % s)
        rank //= s
    return c[::-1]


# -- the mesh -------------------------------------------------------------------------------------


def _mesh_svg(names: Sequence[str], shape: Sequence[int], ids: Sequence[int], per_node: int) -> str:
    cols = shape[-1]
    rows = len(ids) // cols
    cw, ch = (64, 34) if len(ids) <= 64 else (40, 22)
    pad_l, pad_t = 8, 8
    w, h = pad_l + cols * cw + 8, pad_t + rows * ch + 8
    parts = [f'<svg class="fig mesh" data-figure="mesh" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
             f'role="img" aria-label="mesh of {len(ids)} ranks">']
    for k, rid in enumerate(ids):
        r, c = divmod(k, cols)
        node = rid // per_node
        coords = ", ".join(f"{n}={v}" for n, v in zip(names, _coords(shape, k)))
        x, y = pad_l + c * cw, pad_t + r * ch
        parts.append(f'<g class="rank"><title>rank {rid} ({coords}), node {node}</title>'
                     f'<rect x="{x + 2}" y="{y + 2}" width="{cw - 4}" height="{ch - 4}" rx="4" '
                     f'fill="{rank_colour(node)}" stroke="#fff" stroke-width="1"/>'
                     f'<text x="{x + cw / 2}" y="{y + ch / 2 + 4}" text-anchor="middle" class="lbl">{rid}</text></g>')
    parts.append("</svg>")
    return "".join(parts)


def _mesh_section(mesh: Any, per_node: int) -> str:
    names, shape = list(mesh.dim_names), list(mesh.shape)
    ids = list(mesh.process_ids)
    n_nodes = (max(ids) // per_node) + 1
    rows = []
    for d, (nm, s) in enumerate(zip(names, shape)):
        inside = True
        for k in range(len(ids)):
            c = _coords(shape, k)
            if c[d] != 0:
                continue
            stride = 1
            for x in shape[d + 1:]:
                stride *= x
            group = [ids[k + j * stride] for j in range(s)]
            if len({g // per_node for g in group}) > 1:
                inside = False
                break
        rows.append(f"<tr><td>{_e(nm)}</td><td>{s}</td><td>{'inside a node (NVLink)' if inside else 'across nodes'}"
                    f"</td></tr>")
    if n_nodes <= 4:
        nodes = "; ".join(f"node {n}: ranks {_ranges([i for i in ids if i // per_node == n])}" for n in range(n_nodes))
    else:
        nodes = f"node n: ranks {per_node}n to {per_node}n+{per_node - 1}"
    return (f'<section id="mesh"><h2>Mesh</h2><p>{" x ".join(f"{_e(n)}={s}" for n, s in zip(names, shape))}: '
            f'{len(ids)} ranks on {n_nodes} node{"s" if n_nodes != 1 else ""} of {per_node} ranks '
            f'(rows: {" x ".join(_e(n) for n in names[:-1]) or "-"}, columns: {_e(names[-1])}; coloured by '
            f'node). {_e(nodes)}.</p><div class="row">{_mesh_svg(names, shape, ids, per_node)}'
            f'<table class="small"><tr><th>mesh dim</th><th>size</th><th>its groups</th></tr>{"".join(rows)}'
            f'</table></div></section>')


# -- a tensor's sharding --------------------------------------------------------------------------


def shard_blocks(attr: TensorDistAttr, ndim: int) -> tuple[int, int, dict[tuple[int, int], list[int]]]:
    """(rows, columns, (row, column) -> the ranks holding that block) of a tensor of ``ndim``
    axes under ``attr``: the leading axes flattened into the rows, the last axis across."""
    mesh = attr.mesh
    shape = list(mesh.shape)
    parts = []
    for axis in range(ndim):
        k = 1
        for d in entry_dims(attr.dims_mapping[axis]):
            k *= shape[d]
        parts.append(k)
    lead = parts[:-1] if ndim >= 2 else []
    n_rows = 1
    for k in lead:
        n_rows *= k
    n_cols = parts[-1] if ndim >= 1 else 1
    blocks: dict[tuple[int, int], list[int]] = {}
    ids = list(mesh.process_ids)
    for k, rid in enumerate(ids):
        c = _coords(shape, k)
        idx = []
        for axis in range(ndim):
            i = 0
            for d in entry_dims(attr.dims_mapping[axis]):  # major to minor
                i = i * shape[d] + c[d]
            idx.append(i)
        row = 0
        for axis in range(ndim - 1 if ndim >= 2 else 0):
            row = row * parts[axis] + idx[axis]
        col = idx[-1] if ndim >= 1 else 0
        blocks.setdefault((row, col), []).append(rid)
    return n_rows, n_cols, blocks


def _tensor_svg(name: str, shape: Sequence[int], attr: TensorDistAttr) -> str:
    rows, cols, blocks = shard_blocks(attr, len(shape))
    shown_r, shown_c = min(rows, MAX_BLOCKS), min(cols, MAX_BLOCKS)
    width = 240
    cw = width / shown_c
    ch = max(10.0, min(30.0, 180 / shown_r))
    h = ch * shown_r
    partial = [(attr.mesh.dim_names[d], r.value) for d, r in attr.partial]
    parts = [f'<svg class="fig tensor" data-figure="tensor" data-tensor="{_e(name)}" data-blocks="{len(blocks)}" '
             f'width="{width + 2}" height="{h + 2:.0f}" viewBox="-1 -1 {width + 2} {h + 2:.0f}" role="img" '
             f'aria-label="sharding of {_e(name)}">']
    order = {key: k for k, key in enumerate(sorted(blocks))}
    for (r, c), ranks in sorted(blocks.items()):
        if r >= shown_r or c >= shown_c:
            continue
        x, y = c * cw, r * ch
        label = "all" if len(ranks) == attr.mesh.size and len(ranks) > 1 else _ranges(ranks)
        parts.append(f'<g class="block"><title>block ({r}, {c}): ranks {_ranges(ranks)}</title>'
                     f'<rect x="{x:.1f}" y="{y:.1f}" width="{cw:.1f}" height="{ch:.1f}" '
                     f'fill="{rank_colour(order[(r, c)])}" stroke="#fff" stroke-width="1"/>')
        if partial:
            parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{cw:.1f}" height="{ch:.1f}" fill="url(#hatch)" '
                         f'class="partial"/>')
        if cw >= 7 * len(label) + 4 and ch >= 12:
            parts.append(f'<text x="{x + cw / 2:.1f}" y="{y + ch / 2 + 4:.1f}" text-anchor="middle" '
                         f'class="lbl">{_e(label)}</text>')
        parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts)


def _sharding_section(plan: Plan) -> str:
    prog = plan.program
    layers = program_layers(prog)
    of = layers.tensor_layer
    full = sorted({k: i for i, k in reversed(list(enumerate(layers.kind)))}.values())  # the first of each structure
    names = [n for f in full for n, t in prog.tensors.items() if of.get(n) == f and not t.inplace_of
             and t.kind in ("parameter", "activation", "gradient")]
    names += [n for n, t in prog.tensors.items() if n not in of and not t.inplace_of
              and t.kind in ("input", "parameter", "activation")]
    if not names:  # a program without layers: its parameters and inputs
        names = [t.name for t in prog.tensors.values() if t.kind in ("input", "parameter") and not t.inplace_of]
    cards = []
    for n in names:
        t = prog.tensors[n]
        a = plan.attrs[n]
        local = []
        for size, e in zip(t.shape, a.dims_mapping):
            k = 1
            for d in entry_dims(e):
                k *= a.mesh.shape[d]
            local.append(-(-size // k))
        rows, cols, _ = shard_blocks(a, len(t.shape))
        partial = ", ".join(f"{a.mesh.dim_names[d]} ({r.value})" for d, r in a.partial)
        cut = " (the first 64 blocks a side)" if rows > MAX_BLOCKS or cols > MAX_BLOCKS else ""
        cards.append(f'<div class="card" data-name="{_e(n)}" data-kind="{_e(t.kind)}"><div class="name">{_e(n)}</div>'
                     f'<div class="meta">{_e(t.kind)} {_e(list(t.shape))} {_e(t.dtype)} &rarr; local '
                     f'{_e(local)}<br>{_e(placements(a))}'
                     + (f'<br><b>partial</b> over {_e(partial)}: each block is the sum of the ranks\' values'
                        if partial else "")
                     + f'{cut}</div>{_tensor_svg(n, t.shape, a)}</div>')
    more = (f" (and of layer{'s' if len(full) > 2 else ''} {', '.join(map(str, full[1:]))}, the first of another "
            f"structure)") if len(full) > 1 else ""
    return (f'<section id="sharding"><h2>Sharding</h2><p>Each tensor of layer 0{_e(more)} and those outside the layers: '
            'the global shape as a grid of blocks (leading axes flattened into the rows, the last axis across), '
            'each labelled with the ranks holding it; a hatched block is partial. '
            '<input id="tensor-filter" placeholder="filter tensors" aria-label="filter tensors"></p>'
            f'<div class="cards">{"".join(cards)}</div></section>')


# -- per layer --------------------------------------------------------------------------------------


def _layer_order(prog: Program, layers: Layers) -> Callable[[str], tuple[int, int, str]]:
    """The sort key of a layer label: the embedding and the labels the forward reaches before the
    first layer, the layers in order, the head and the labels after them, the rest by name."""
    index = {t: k for k, t in enumerate(layers.tags)}
    first_layer = next((k for k, u in enumerate(layers.op_layer) if u >= 0), len(prog.ops))
    seen: dict[str, int] = {}
    for k, op in enumerate(prog.ops):
        if op.phase == "forward":
            seen.setdefault(op.layer, k)

    def key(label: str) -> tuple[int, int, str]:
        if label in index:
            return (1, index[label], label)
        if label in ("embedding", "head"):
            return ({"embedding": 0, "head": 2}[label], 0, label)
        at = seen.get(label)
        if at is None:
            return (3, 0, label)
        return (0 if at < first_layer else 2, at + 1, label)

    return key


def tensor_layers(plan: Plan, layers: Layers | None = None) -> dict[str, str]:
    """Tensor -> the layer label it belongs to: its layer's (:func:`spmdkit.program.layers.program_layers`:
    a preset's ``layer N``, an imported model's ``model.layers.N``), else its producer's label,
    else its first reader's outside the optimizer, else that of the longest dotted prefix naming
    a tensor (``embed.moment1`` -> ``embed``'s), else ``other``."""
    prog = plan.program
    layers = layers or program_layers(prog)
    made: dict[str, str] = {}
    read: dict[str, str] = {}
    for op in prog.ops:
        if op.layer and op.layer != "optimizer":
            for n in op.output_names():
                made.setdefault(n, op.layer)
            for n in op.input_names():
                read.setdefault(n, op.layer)
    out: dict[str, str] = {}
    for n in prog.tensors:
        u = layers.tensor_layer.get(n)
        if u is not None:
            out[n] = layers.tags[u]
            continue
        label = made.get(n) or read.get(n)
        p = n
        while label is None and "." in p:
            p = p.rsplit(".", 1)[0]
            label = made.get(p) or read.get(p)
        out[n] = label or "other"
    return out


def layer_table(plan: Plan, memory: Memory) -> list[dict[str, Any]]:
    """Per layer (program order): communication seconds per phase (every reshard times its
    repeats, the collectives inside ops) and bytes held per device: parameters, gradients,
    optimizer states, activations kept for the backward."""
    prog = plan.program
    layers = program_layers(prog)
    of = tensor_layers(plan, layers)
    rows: dict[str, dict[str, Any]] = {}

    def row(label: str) -> dict[str, Any]:
        return rows.setdefault(label, {"layer": label, "forward": 0.0, "backward": 0.0, "optimizer": 0.0,
                                       "parameters": 0, "gradients": 0, "optimizer_states": 0, "activations": 0})

    pg = plan.param_grads()
    for r in plan.reshards:
        if r.shared:
            continue
        op = prog.ops[r.op_index]
        label = op.layer if op.layer and op.layer != "optimizer" else of[r.tensor]
        row(label)[op.phase if op.phase in ("forward", "backward") else "optimizer"] += r.time_s * plan.repeats(r, pg)
    for k in kernel_collectives(plan):
        op = prog.ops[k.op_index]
        row(op.layer or "other")[op.phase if op.phase in ("forward", "backward") else "optimizer"] += (
            k.time_s * (1 if op.phase == "optimizer" else plan.grad_accum))
    held = held_for_the_step(plan)  # as the framework allocates them (plan.runtime)
    for n, (p, g, st) in held.items():
        r_ = row(of[n])
        r_["parameters"] += p
        r_["gradients"] += g
        r_["optimizer_states"] += st
    for n, t in prog.tensors.items():
        if t.kind == "parameter" and not t.inplace_of and n not in held:
            row(of[n])["parameters"] += local_numel(plan.attrs[n], t.shape) * t.itemsize
    saved = getattr(memory, "saved", None)
    if saved is not None:
        for label, b in saved.per_layer.items():
            row(label or "other")["activations"] += b
    return [rows[k] for k in sorted(rows, key=_layer_order(prog, layers))]


def _hbars(fig: str, title: str, rows: list[tuple[str, list[float], str]], keys: list[tuple[str, str]],
           fmt: Any) -> str:
    """Horizontal stacked bars: (label, values per key, tooltip) rows; keys: (name, colour)."""
    top = max((sum(v) for _, v, _ in rows), default=0.0) or 1.0
    lw, bw, bh = 90, 330, 14
    h = 24 + len(rows) * (bh + 3) + 22
    w = lw + bw + 90
    parts = [f'<svg class="fig bars" data-figure="{fig}" data-rows="{len(rows)}" width="{w}" height="{h}" '
             f'viewBox="0 0 {w} {h}" role="img" aria-label="{_e(title)}"><text x="0" y="14" class="ttl">{_e(title)}'
             f'</text>']
    for k, (label, vals, tip) in enumerate(rows):
        y = 24 + k * (bh + 3)
        x = float(lw)
        parts.append(f'<g class="bar"><title>{_e(tip)}</title><text x="{lw - 4}" y="{y + bh - 3}" text-anchor="end" '
                     f'class="lbl">{_e(label)}</text>')
        for (name, colour), v in zip(keys, vals):
            if v <= 0:
                continue
            ww = bw * v / top
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{ww:.2f}" height="{bh}" fill="{colour}" '
                         f'data-key="{_e(name)}"/>')
            x += ww
        parts.append(f'<text x="{x + 4:.1f}" y="{y + bh - 3}" class="lbl">{_e(fmt(sum(vals)))}</text></g>')
    y = 24 + len(rows) * (bh + 3) + 14
    x = 0
    for name, colour in keys:
        parts.append(f'<rect x="{x}" y="{y - 9}" width="10" height="10" fill="{colour}"/>'
                     f'<text x="{x + 13}" y="{y}" class="lbl">{_e(name)}</text>')
        x += 20 + 7 * len(name)
    parts.append("</svg>")
    return "".join(parts)


def _layers_section(plan: Plan, memory: Memory) -> str:
    table = layer_table(plan, memory)
    if not table:
        return ""
    ck = [("forward", PHASE_COLOURS["forward"]), ("backward", PHASE_COLOURS["backward"]),
          ("optimizer", PHASE_COLOURS["optimizer"])]
    mk = [("parameters", "#4e79a7"), ("gradients", "#f28e2b"), ("optimizer_states", "#59a14f"),
          ("activations", "#b07aa1")]
    comm = [(r["layer"], [r[k] for k, _ in ck],
             f"{r['layer']}: " + ", ".join(f"{k} {fmt_time(r[k])}" for k, _ in ck)) for r in table]
    mem = [(r["layer"], [float(r[k]) for k, _ in mk],
            f"{r['layer']}: " + ", ".join(f"{k.replace('_', ' ')} {fmt_bytes(r[k])}" for k, _ in mk)) for r in table]
    return ('<section id="layers"><h2>Per layer</h2><p>Communication per step (every reshard and collective inside '
            'an op, by the phase it runs in; a gradient\'s reduction counts in its layer) and the memory each layer '
            'holds per device (activations: what the backward keeps).</p><div class="row">'
            + _hbars("layer-comm", "communication time per layer", comm, ck, fmt_time)
            + _hbars("layer-memory", "memory per layer, per device", mem, mk, fmt_bytes)
            + "</div></section>")


# -- the step ---------------------------------------------------------------------------------------


def _axis(x0: float, w: float, total: float, y: float, fmt: Any, ticks: int = 6) -> str:
    out = [f'<line x1="{x0}" y1="{y}" x2="{x0 + w}" y2="{y}" stroke="#888"/>']
    for k in range(ticks + 1):
        x = x0 + w * k / ticks
        out.append(f'<line x1="{x:.1f}" y1="{y}" x2="{x:.1f}" y2="{y + 4}" stroke="#888"/>'
                   f'<text x="{x:.1f}" y="{y + 15}" text-anchor="middle" class="lbl">{_e(fmt(total * k / ticks))}</text>')
    return "".join(out)


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
        parts.append(f'<text x="{x0 - 6}" y="{10 + k * (lh + 6) + 15}" text-anchor="end" class="lbl">{_e(name)}</text>')

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
                     f'height="{lh}" fill="{PHASE_COLOURS.get(ph, "#999")}" opacity="0.45"><title>{_e(ph)}: '
                     f'{fmt_time(b - a)}</title></rect>')
        if (b - a) * sx > 60:
            parts.append(f'<text x="{x0 + (a + b) / 2 * sx:.1f}" y="{lane_y(0) + 15}" text-anchor="middle" '
                         f'class="lbl">{_e(ph)}</text>')
    # compute and blocking communication per op; ops narrower than a pixel merged with their neighbours
    n_comp = n_comm = 0

    def flush(run: list[Any], lane: int, colour: str, cls: str) -> int:
        if not run:
            return 0
        a, b = run[0][1], run[-1][2]
        names = [prog.ops[i].name or prog.ops[i].rule for i, _, _ in run]
        tip = names[0] if len(run) == 1 else f"{len(run)} ops: {names[0]} ... {names[-1]}"
        parts.append(f'<rect class="{cls}" x="{x0 + a * sx:.2f}" y="{lane_y(lane)}" '
                     f'width="{max(0.6, (b - a) * sx):.2f}" height="{lh}" fill="{colour}"><title>{_e(tip)}: '
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
                     f'{_e(b.kind)} of {b.tensors} gradients, {fmt_bytes(b.bytes)}, {fmt_time(b.time_s)} (ready at '
                     f'{fmt_time(b.ready_s)})</title></rect>')
    parts.append(_axis(x0, w, end, lane_y(len(lanes)) + 2, fmt_time))
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
    parts.append(_axis(x0, w, end, 10 + p * (lh + 6) + 2, fmt_time))
    parts.append("</svg>")
    return "".join(parts)


def _step_section(plan: Plan, est: Any, assumed: str | None, pipe: Any) -> str:
    rows = "".join(f"<tr><td>{ph}</td><td>{fmt_time(est.compute_s.get(ph, 0.0))}</td>"
                   f"<td>{fmt_time(est.comm_s.get(ph, 0.0))}</td></tr>" for ph in ("forward", "backward", "optimizer"))
    rows += (f"<tr><td>gradient buckets</td><td>-</td><td>{fmt_time(est.grad_sync_s)}</td></tr>"
             f"<tr><td>collectives inside ops</td><td>-</td><td>{fmt_time(est.kernel_comm_s)}</td></tr>")
    note = f' <b>{_e(assumed)}</b>' if assumed else ""
    when = "every one reduce-scatters its ZeRO gradients" if plan.microstep_reductions() else \
        "the gradients are reduced after the last"
    accum = f" One of the {plan.grad_accum} micro-steps is drawn ({when})." if plan.grad_accum > 1 else ""
    one = " One microbatch through the whole program on the stages' sub-mesh:" if pipe is not None else ""
    out = (f'<section id="step"><h2>Predicted step</h2><p>{_e(one)} On {_e(est.device.name)}: '
           f'{fmt_time(est.step_overlap_s)} with the gradient reductions overlapping the backward '
           f'({fmt_time(est.step_serial_s)} serial).{note}{accum} Ops narrower than a pixel are drawn together; hover '
           f'for names and times.</p>{_timeline_svg(plan, est)}<table class="small"><tr><th>phase</th>'
           f'<th>compute</th><th>communication</th></tr>{rows}</table>')
    if pipe is not None and pipe.run is not None:
        s = pipe.spec
        out += (f'<h3>Pipeline schedule</h3><p>{_e(s.schedule)}, pp={s.pp}'
                + (f", {s.virtual} virtual stages per rank" if s.virtual > 1 else "")
                + (f", microbatch groups of {s.group}" if s.group else "")
                + f', {s.microbatches} microbatches: {fmt_time(pipe.run.pipeline_s)}, bubble '
                f'{100 * pipe.run.bubble_fraction:.1f}% (F: forward, B: backward, by microbatch; the timeline above '
                f'is one microbatch of the stages\' program).</p>{_pipeline_svg(pipe)}')
    return out + "</section>"


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
                         f'fill="{PHASE_COLOURS.get(ph, "#ccc")}" opacity="0.12"><title>{_e(ph)}</title></rect>')
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
                 f'{fmt_bytes(peak)} at op {ix[at] if n else 0} ({_e(peak_name)})</title></circle>'
                 f'<text x="{min(px + 8, x0 + w - 10):.1f}" y="{max(py - 6, 22):.1f}" class="lbl">peak '
                 f'{fmt_bytes(peak)} at {_e(peak_name)}</text>')
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


def _memory_section(plan: Plan, mem: Memory, recompute: str, cap: int, pipe: Any) -> str:
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
    elif not curve:
        curve = memory_per_device(plan, recompute).curve
    if not curve:
        return ""
    extra = (f' The allocated peak, {fmt_bytes(mem.total)}, grows by the caching allocator\'s reserve '
             f'({fmt_bytes(mem.allocator_reserve)}) and the CUDA context and NCCL buffers '
             f'({fmt_bytes(mem.runtime_overhead)}) to {fmt_bytes(mem.device_total)} on the device'
             + (f": {fit_verdict(mem.device_total, cap)[1]}." if cap else "."))
    return ('<section id="memory"><h2>Memory over the step</h2><p>' + _e(what) + ': what is held for the whole step '
            f'(parameters, gradients, optimizer states: {fmt_bytes(mem.parameters + mem.gradients + mem.optimizer_states)}, '
            'dashed) plus the activations live while each op runs; the peak is marked.' + _e(extra) + '</p>'
            f'{_memory_svg(plan, mem, curve, cap, idx)}{note}</section>')


# -- the reshard table ----------------------------------------------------------------------------


def _reshard_section(plan: Plan) -> str:
    groups = reshard_groups(plan)
    if not groups:
        return '<section id="reshards"><h2>Reshards</h2><p>No reshards: every op gets its inputs as their producers ' \
               'made them.</p></section>'
    cols = [("phase", "phase", None), ("layer", "layer", None), ("tensor", "tensor", None), ("where", "where", None),
            ("from -> to", "from_to", None), ("collectives", "collectives", None), ("times", "times", "times"),
            ("bytes/rank", "bytes_per_rank", "bytes_per_rank"), ("time", "time_s", "time_s")]
    head = "".join(f'<th data-col="{k}" data-num="{1 if num else 0}" tabindex="0">{_e(h)}</th>'
                   for k, (h, _, num) in enumerate(cols))
    body = []
    for g in groups:
        cells = []
        for _h, key, num in cols:
            v = g[key]
            text = (fmt_bytes(v) if key == "bytes_per_rank" else fmt_time(v) if key == "time_s"
                    else f"x{v}" if key == "times" else str(v))
            cells.append(f'<td data-v="{v:.12g}">{_e(text)}</td>' if num else f"<td>{_e(text)}</td>")
        body.append(f'<tr data-phase="{_e(g["phase"])}">{"".join(cells)}</tr>')
    phases = sorted({g["phase"] for g in groups})
    opts = "".join(f'<option value="{_e(p)}">{_e(p)}</option>' for p in phases)
    return (f'<section id="reshards"><h2>Reshards</h2><p>One row per kind of reshard (the same tensor of every layer '
            f'reshaped alike; times: how many per step). Click a header to sort; type to filter. '
            f'<input id="reshard-filter" placeholder="filter rows" aria-label="filter reshards"> '
            f'<select id="reshard-phase" aria-label="phase"><option value="">every phase</option>{opts}</select> '
            f'<span id="reshard-count">{len(groups)} of {len(groups)} rows</span></p>'
            f'<table id="reshard-table" class="sortable"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}'
            f'</tbody></table></section>')


# -- --auto -----------------------------------------------------------------------------------------


def _auto_section(auto: Any, alternatives: Sequence[tuple[str, Plan]], plan: Plan) -> str:
    if auto is None and not alternatives:
        return ""
    out = '<section id="auto"><h2>Search</h2>'
    if auto is not None:
        out += (f'<p>--auto: HiGHS {_e(auto.status)}, gap {auto.gap:.2%}, solved in {auto.solve_s:.2f} s over '
                f'{auto.candidates} candidates ({auto.variables} variables); objective '
                f'{fmt_time(auto.objective_s)}, realised as {_e(auto.realized)}.</p>')
        explain = list(getattr(auto, "explain", None) or ())
        if explain:  # --explain: per layer, the choice and the runner-up (the best plan choosing otherwise there)
            lines = "".join(
                f"<tr><td>{_e(r.layer)}</td><td>{r.ops}</td><td>{_e(r.chosen or '(no matmul)')}</td>"
                f"<td>{fmt_time(r.objective_s)}</td>"
                + ("<td>-</td><td>-</td>" if r.runner_up_s is None else
                   f"<td>{fmt_time(r.runner_up_s)}</td><td>+{fmt_time(max(0.0, r.runner_up_s - r.objective_s))}</td>")
                + f"<td>{_e(r.runner_up)}</td></tr>" for r in explain)
            out += ('<p>Runner-up plans (--explain): per layer (identical layers once), the chosen layouts of the '
                    'forward matmuls (weight -&gt; output dims_mapping, pN partial over mesh dim N) and the best plan '
                    'whose choice differs in that layer, by the search\'s objective.</p>'
                    '<table class="small" id="runner-ups"><tr><th>layer</th><th>ops</th><th>chosen</th>'
                    '<th>objective</th><th>runner-up</th><th>costs more by</th><th>runner-up layouts</th></tr>'
                    f'{lines}</table>')
    if alternatives:
        rows = [("this plan", plan), *list(alternatives)]
        mems = [memory_per_device(p) for _, p in rows]
        data = [(name, [p.time_s], f"{name}: communication {fmt_time(p.time_s)}, {fmt_bytes(p.bytes_per_rank)} per "
                                   f"rank, memory {fmt_bytes(m.total)}") for (name, p), m in zip(rows, mems)]
        table = "".join(f"<tr><td>{_e(name)}</td><td>{fmt_time(p.time_s)}</td><td>{fmt_bytes(p.bytes_per_rank)}</td>"
                        f"<td>{len([r for r in p.reshards if not r.shared])}</td><td>{fmt_bytes(m.total)}</td></tr>"
                        for (name, p), m in zip(rows, mems))
        out += ('<p>Other plans of the same program, to compare (reshard communication per step, memory per '
                'device):</p><div class="row">'
                + _hbars("alternatives", "reshard communication per step", data, [("communication", COMM_COLOUR)],
                         fmt_time)
                + '<table class="small"><tr><th>plan</th><th>communication</th><th>bytes/rank</th><th>reshards</th>'
                f'<th>memory</th></tr>{table}</table></div>')
    return out + "</section>"


# -- the page ---------------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 24px 40px;color:#222;background:#fafafa}
h1{font-size:20px;margin:18px 0 4px}h2{font-size:17px;margin:28px 0 6px;border-bottom:1px solid #ddd}
h3{font-size:15px}nav a{margin-right:12px}section{max-width:1400px}
.summary{display:flex;flex-wrap:wrap;gap:10px;margin:10px 0}.summary div{background:#fff;border:1px solid #ddd;
border-radius:6px;padding:6px 10px}.summary b{display:block;font-size:16px}
.row{display:flex;flex-wrap:wrap;gap:24px;align-items:flex-start}
.cards{display:flex;flex-wrap:wrap;gap:10px}.card{background:#fff;border:1px solid #ddd;border-radius:6px;
padding:6px;width:250px}.card .name{font-weight:600;word-break:break-all}.card .meta{font-size:12px;color:#555;
margin-bottom:4px}.card.hidden{display:none}
svg.fig{background:#fff;border:1px solid #e4e4e4;border-radius:4px}svg .lbl{font-size:11px;fill:#222}
svg .ttl{font-size:12px;font-weight:600}
table{border-collapse:collapse;background:#fff}td,th{border:1px solid #ddd;padding:3px 6px;text-align:left;
font-size:12px}th{background:#f0f0f0}table.sortable th{cursor:pointer}table.sortable th.asc:after{content:" \\25B2"}
table.sortable th.desc:after{content:" \\25BC"}tr.hidden{display:none}table.small{margin-top:6px}
"""

_JS = """
(function(){
  var errors=0;
  window.addEventListener('error',function(){errors++;document.body.setAttribute('data-errors',String(errors));});
  function rows(){return Array.prototype.slice.call(document.querySelectorAll('#reshard-table tbody tr'));}
  function refilter(){
    var q=(document.getElementById('reshard-filter')||{value:''}).value.toLowerCase();
    var ph=(document.getElementById('reshard-phase')||{value:''}).value;
    var shown=0,all=rows();
    all.forEach(function(r){var ok=r.textContent.toLowerCase().indexOf(q)>=0&&(!ph||r.getAttribute('data-phase')===ph);
      r.classList.toggle('hidden',!ok);if(ok)shown++;});
    var c=document.getElementById('reshard-count');if(c)c.textContent=shown+' of '+all.length+' rows';
    return shown;
  }
  function sortBy(th){
    var table=document.getElementById('reshard-table');if(!table)return;
    var col=+th.getAttribute('data-col'),num=th.getAttribute('data-num')==='1';
    var desc=!th.classList.contains('desc');
    table.querySelectorAll('th').forEach(function(h){h.classList.remove('asc','desc');});
    th.classList.add(desc?'desc':'asc');
    var body=table.tBodies[0],rs=rows();
    rs.sort(function(a,b){
      var x=a.cells[col],y=b.cells[col];
      var d=num?(+x.getAttribute('data-v'))-(+y.getAttribute('data-v')):x.textContent.localeCompare(y.textContent);
      return desc?-d:d;});
    rs.forEach(function(r){body.appendChild(r);});
  }
  function filterTensors(){
    var q=(document.getElementById('tensor-filter')||{value:''}).value.toLowerCase();
    document.querySelectorAll('.card').forEach(function(c){
      c.classList.toggle('hidden',c.getAttribute('data-name').toLowerCase().indexOf(q)<0);});
  }
  document.querySelectorAll('#reshard-table th').forEach(function(th){
    th.addEventListener('click',function(){sortBy(th);});
    th.addEventListener('keydown',function(e){if(e.key==='Enter')sortBy(th);});});
  ['reshard-filter','reshard-phase'].forEach(function(id){var e=document.getElementById(id);
    if(e){e.addEventListener('input',refilter);e.addEventListener('change',refilter);}});
  var tf=document.getElementById('tensor-filter');if(tf)tf.addEventListener('input',filterTensors);
  var b=document.body;
  b.setAttribute('data-svg',String(document.querySelectorAll('svg.fig').length));
  if(location.hash==='#selftest'){
    var th=document.querySelector('#reshard-table th[data-col="8"]');
    if(th){sortBy(th);var v=rows().map(function(r){return +r.cells[8].getAttribute('data-v');});
      var sorted=v.every(function(x,i){return i===0||v[i-1]>=x;});
      b.setAttribute('data-selftest-sorted',sorted?'yes':'no');
      var f=document.getElementById('reshard-filter');f.value='optimizer';
      b.setAttribute('data-selftest-filtered',String(refilter()));}
    if(tf){tf.value='wq';filterTensors();
      b.setAttribute('data-selftest-tensors',String(document.querySelectorAll('.card:not(.hidden)').length));}
  }
  b.setAttribute('data-ready','yes');
})();
"""

_HATCH = ('<svg width="0" height="0" style="position:absolute" aria-hidden="true"><defs><pattern id="hatch" '
          'width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><line x1="0" y1="0" '
          'x2="0" y2="6" stroke="#000" stroke-width="1.6" opacity="0.45"/></pattern></defs></svg>')


def render_html(plan: Plan, title: str = "", memory: Memory | None = None, estimate: Any = None, *,
                config: Any = None, recompute: str = "none", mesh: Any = None, ranks_per_node: int | None = None,
                pipeline: Any = None, auto: Any = None, alternatives: Sequence[tuple[str, Plan]] = (),
                command: str = "") -> str:
    """The page (a str) for ``plan``. ``estimate``: its :class:`spmdkit.cost.step.StepEstimate`
    (without one the step is predicted on an H100, and the page says so); ``mesh``: the mesh to
    draw (the full one of a pipeline; default the plan's); ``pipeline``: a
    :class:`spmdkit.planner.pipeline.PipelineEstimate`; ``auto``: the search's
    :class:`spmdkit.planner.auto.AutoInfo`; ``alternatives``: (label, plan) of other plans of the same
    program, compared in the search section; ``command``: the command line that made the page
    (shown with spmdkit's version at its foot)."""
    prog = plan.program
    given = recompute  # a pipeline's memory curve: the layers full:K / every:N recompute on each stage
    if pipeline is not None or recompute == MICROBATCH:  # a pipeline's modes: those of its microbatches
        recompute = per_microbatch_mode(recompute)  # (without one, full:K / every:N: the model's own layers)
    mem = memory or memory_per_device(plan, recompute)
    assumed = None
    est = estimate
    if est is None:
        batch, seq = getattr(config, "batch", None), getattr(config, "seq", None)
        tokens = batch * seq if isinstance(batch, int) and isinstance(seq, int) else guess_tokens(prog)
        est = estimate_step(plan, preset_device("h100"), tokens, recompute)
        assumed = "No --device was given: the compute is timed on an H100, the communication by the plan's links."
    per_node = ranks_per_node or est.device.ranks_per_node or 8
    mesh = mesh or plan.mesh
    cap = est.device.memory_bytes if estimate is not None else 0
    if pipeline is not None and pipeline.device_memory:
        cap = pipeline.device_memory
    step_s = est.step_overlap_s
    if pipeline is not None and pipeline.run is not None:
        step_s = pipeline.step_overlap_s
    if pipeline is not None:  # the fullest pipeline rank, as the memory section draws it
        mem = max(pipeline.memory, key=lambda m: m.device_total)
    tps = pipeline.tokens_per_s if pipeline is not None and pipeline.run is not None else est.tokens_per_s
    summary = [("ranks", str(mesh.size)), ("ops", f"{len(prog.ops)}"), ("tensors", f"{len(prog.tensors)}"),
               ("step (predicted)", fmt_time(step_s)), ("communication", fmt_time(est.comm_total_s)),
               ("memory per device", fmt_bytes(mem.device_total))]
    if tps:
        summary.append(("tokens/s", f"{tps:,.0f}"))
    if cap:
        summary.append(("fits?", fit_verdict(mem.device_total, cap)[1].split(" (")[0]))
    if est.mfu is not None and pipeline is None:
        summary.append(("MFU", f"{100 * est.mfu:.1f}%"))
    band = error_band(est.device.name, est.cp > 1, est.moe)
    if band is not None:
        summary.append(("error band", f"{band.p10:.2f}-{band.p90:.2f} x step"))
    nav = "".join(f'<a href="#{k}">{v}</a>' for k, v in (("mesh", "mesh"), ("step", "step"), ("memory", "memory"),
                                                          ("layers", "per layer"), ("reshards", "reshards"),
                                                          ("sharding", "sharding")))
    body = [f"<h1>{_e(title or prog.name)}</h1><nav>{nav}</nav>",
            '<div class="summary">' + "".join(f"<div>{_e(k)}<b>{_e(v)}</b></div>" for k, v in summary) + "</div>",
            _mesh_section(mesh, per_node), _step_section(plan, est, assumed, pipeline),
            _memory_section(plan, mem, given if pipeline is not None else recompute, cap, pipeline),
            _layers_section(plan, mem),
            _auto_section(auto, alternatives, plan), _reshard_section(plan), _sharding_section(plan)]
    meta = json.dumps({"program": prog.name, "mesh": list(mesh.shape), "dim_names": list(mesh.dim_names)})
    return ('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>spmdkit plan: {_e(title or prog.name)}</title><style>{_CSS}</style></head>'
            f'<body data-plan="{_e(meta)}">{_HATCH}{"".join(body)}'
            f'<p class="foot">Written by spmdkit {_e(__version__)}'
            + (f": <code>{_e(command)}</code>" if command else " plan --html") + ". Self-contained: no network."
            + (f" Error band: {_e(band.text())}." if band is not None else "") + "</p>"
            f"<script>{_JS}</script></body></html>\n")


def check_html_path(path: str) -> str:
    """The directory ``--html path`` goes to; a ProgramError naming ``--html`` where it cannot
    be written there (a directory, a missing directory, anything but a regular file or a new
    name: :func:`spmdkit.io.atomic.output_problem`), checked before planning."""
    d = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) and not os.path.islink(path):
        raise ProgramError(f"--html {path!r}: is a directory; give a file name, e.g. plan.html")
    if not os.path.isdir(d):
        raise ProgramError(f"--html {path!r}: the directory {d!r} does not exist")
    problem = output_problem(path)
    if problem is not None:
        raise ProgramError(f"--html {path!r}: {problem}")
    return d


def save_html(path: str, plan: Plan, title: str = "", memory: Memory | None = None, estimate: Any = None,
              **kw: Any) -> int:
    """Render the page and write it to ``path`` atomically (a temporary file beside it, renamed
    over it); the bytes written. A path that cannot be written is a ProgramError naming
    ``--html``; nothing is left behind."""
    check_html_path(path)
    text = render_html(plan, title, memory, estimate, **kw).encode("utf-8")
    try:
        write_atomic(path, text)
    except OSError as exc:
        raise ProgramError(f"--html {path!r}: cannot write it: {exc.strerror or exc}") from None
    return len(text)


__all__ = ["check_html_path", "layer_table", "rank_colour", "render_html", "save_html", "shard_blocks", "tensor_layers"]
