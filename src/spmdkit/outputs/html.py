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

This module is the page: its skeleton (summary, style, script), the reshard table the script
sorts and filters, the search section, and writing it. The other sections beside it:
:mod:`spmdkit.outputs.html_mesh` (the mesh, the tensors' sharding), :mod:`spmdkit.outputs.html_step`
(the step's timeline, a pipeline's schedule), :mod:`spmdkit.outputs.html_memory` (the memory
curve), :mod:`spmdkit.outputs.html_layers` (per layer), on the shared parts of
:mod:`spmdkit.outputs.html_figures` (escaping, colours, bars, an axis).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.core.version import __version__
from spmdkit.cost.band import error_band
from spmdkit.cost.compute import guess_tokens
from spmdkit.cost.devices import preset_device
from spmdkit.cost.memory import MICROBATCH, Memory, fit_verdict, memory_per_device, per_microbatch_mode
from spmdkit.cost.step import estimate_step
from spmdkit.io.atomic import output_problem, write_atomic
from spmdkit.outputs.html_figures import COMM_COLOUR, bars_svg, esc, rank_colour
from spmdkit.outputs.html_layers import layer_table, layers_section, tensor_layers
from spmdkit.outputs.html_memory import memory_section
from spmdkit.outputs.html_mesh import mesh_section, shard_blocks, sharding_section
from spmdkit.outputs.html_step import step_section
from spmdkit.outputs.report import fmt_bytes, fmt_time, reshard_groups
from spmdkit.program.plan import Plan

# -- the reshard table ----------------------------------------------------------------------------


def _reshard_section(plan: Plan) -> str:
    groups = reshard_groups(plan)
    if not groups:
        return '<section id="reshards"><h2>Reshards</h2><p>No reshards: every op gets its inputs as their producers ' \
               'made them.</p></section>'
    cols = [("phase", "phase", None), ("layer", "layer", None), ("tensor", "tensor", None), ("where", "where", None),
            ("from -> to", "from_to", None), ("collectives", "collectives", None), ("times", "times", "times"),
            ("bytes/rank", "bytes_per_rank", "bytes_per_rank"), ("time", "time_s", "time_s")]
    head = "".join(f'<th data-col="{k}" data-num="{1 if num else 0}" tabindex="0">{esc(h)}</th>'
                   for k, (h, _, num) in enumerate(cols))
    body = []
    for g in groups:
        cells = []
        for _h, key, num in cols:
            v = g[key]
            text = (fmt_bytes(v) if key == "bytes_per_rank" else fmt_time(v) if key == "time_s"
                    else f"x{v}" if key == "times" else str(v))
            cells.append(f'<td data-v="{v:.12g}">{esc(text)}</td>' if num else f"<td>{esc(text)}</td>")
        body.append(f'<tr data-phase="{esc(g["phase"])}">{"".join(cells)}</tr>')
    phases = sorted({g["phase"] for g in groups})
    opts = "".join(f'<option value="{esc(p)}">{esc(p)}</option>' for p in phases)
    return (f'<section id="reshards"><h2>Reshards</h2><p>One row per kind of reshard (the same tensor of every layer '
            f'reshaped alike; times: how many per step). Click a header to sort; type to filter. '
            f'<input id="reshard-filter" placeholder="filter rows" aria-label="filter reshards"> '
            f'<select id="reshard-phase" aria-label="phase"><option value="">every phase</option>{opts}</select> '
            f'<span id="reshard-count">{len(groups)} of {len(groups)} rows</span></p>'
            f'<table id="reshard-table" class="sortable"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}'
            f'</tbody></table></section>')


# -- --auto -----------------------------------------------------------------------------------------


def _auto_section(auto: Any, alternatives: Sequence[tuple[str, Plan, int]], plan: Plan, memory: int) -> str:
    """--auto's solve and --explain's runner-ups; ``alternatives``: (label, plan, memory per device as
    the search priced it: its recomputation, framework and overheads), beside this plan's ``memory``
    (the page's card)."""
    if auto is None and not alternatives:
        return ""
    out = '<section id="auto"><h2>Search</h2>'
    if auto is not None:
        out += (f'<p>--auto: HiGHS {esc(auto.status)}, gap {auto.gap:.2%}, solved in {auto.solve_s:.2f} s over '
                f'{auto.candidates} candidates ({auto.variables} variables); objective '
                f'{fmt_time(auto.objective_s)}, realised as {esc(auto.realized)}.</p>')
        explain = list(getattr(auto, "explain", None) or ())
        if explain:  # --explain: per layer, the choice and the runner-up (the best plan choosing otherwise there)
            lines = "".join(
                f"<tr><td>{esc(r.layer)}</td><td>{r.ops}</td><td>{esc(r.chosen or '(no matmul)')}</td>"
                f"<td>{fmt_time(r.objective_s)}</td>"
                + ("<td>-</td><td>-</td>" if r.runner_up_s is None else
                   f"<td>{fmt_time(r.runner_up_s)}</td><td>+{fmt_time(max(0.0, r.runner_up_s - r.objective_s))}</td>")
                + f"<td>{esc(r.runner_up)}</td></tr>" for r in explain)
            out += ('<p>Runner-up plans (--explain): per layer (identical layers once), the chosen layouts of the '
                    'forward matmuls (weight -&gt; output dims_mapping, pN partial over mesh dim N) and the best plan '
                    'whose choice differs in that layer, by the search\'s objective.</p>'
                    '<table class="small" id="runner-ups"><tr><th>layer</th><th>ops</th><th>chosen</th>'
                    '<th>objective</th><th>runner-up</th><th>costs more by</th><th>runner-up layouts</th></tr>'
                    f'{lines}</table>')
    if alternatives:
        rows = [("this plan", plan, memory), *list(alternatives)]
        data = [(name, [p.time_s], f"{name}: communication {fmt_time(p.time_s)}, {fmt_bytes(p.bytes_per_rank)} per "
                                   f"rank, memory {fmt_bytes(m)}") for name, p, m in rows]
        table = "".join(f"<tr><td>{esc(name)}</td><td>{fmt_time(p.time_s)}</td><td>{fmt_bytes(p.bytes_per_rank)}</td>"
                        f"<td>{len([r for r in p.reshards if not r.shared])}</td><td>{fmt_bytes(m)}</td></tr>"
                        for name, p, m in rows)
        out += ('<p>Other plans of the same program, to compare (reshard communication per step, memory per '
                'device):</p><div class="row">'
                + bars_svg("alternatives", "reshard communication per step", data, [("communication", COMM_COLOUR)],
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
                pipeline: Any = None, auto: Any = None, alternatives: Sequence[tuple[str, Plan, int]] = (),
                command: str = "") -> str:
    """The page (a str) for ``plan``. ``estimate``: its :class:`spmdkit.cost.step.StepEstimate`
    (without one the step is predicted on an H100, and the page says so); ``mesh``: the mesh to
    draw (the full one of a pipeline; default the plan's); ``pipeline``: a
    :class:`spmdkit.planner.pipeline.PipelineEstimate`; ``auto``: the search's
    :class:`spmdkit.planner.auto.AutoInfo`; ``alternatives``: (label, plan, memory per device) of other
    plans of the same program, compared in the search section; ``command``: the command line that made the page
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
               ("step (predicted)", fmt_time(step_s)),
               # a pipeline's est is one microbatch through every stage (the step section's timeline), not its step
               ("communication" + (" (a microbatch, all stages)" if pipeline is not None else ""),
                fmt_time(est.comm_total_s)),
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
    body = [f"<h1>{esc(title or prog.name)}</h1><nav>{nav}</nav>",
            '<div class="summary">' + "".join(f"<div>{esc(k)}<b>{esc(v)}</b></div>" for k, v in summary) + "</div>",
            mesh_section(mesh, per_node), step_section(plan, est, assumed, pipeline),
            memory_section(plan, mem, given if pipeline is not None else recompute, cap, pipeline),
            layers_section(plan, mem),
            _auto_section(auto, alternatives, plan, mem.device_total), _reshard_section(plan), sharding_section(plan)]
    meta = json.dumps({"program": prog.name, "mesh": list(mesh.shape), "dim_names": list(mesh.dim_names)})
    return ('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<title>spmdkit plan: {esc(title or prog.name)}</title><style>{_CSS}</style></head>'
            f'<body data-plan="{esc(meta)}">{_HATCH}{"".join(body)}'
            f'<p class="foot">Written by spmdkit {esc(__version__)}'
            + (f": <code>{esc(command)}</code>" if command else " plan --html") + ". Self-contained: no network."
            + (f" Error band: {esc(band.text())}." if band is not None else "") + "</p>"
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
