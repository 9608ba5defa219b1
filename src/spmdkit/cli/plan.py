"""``spmdkit plan``: plan a model's training step on a mesh and print the report."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator
from typing import Any, TextIO

from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.cost.compute import guess_tokens
from spmdkit.cost.devices import cost_model, load_device, recost
from spmdkit.cost.step import estimate_step
from spmdkit.planner.planning import (
    MAX_LAYERS,
    MAX_SIZE,
    clip_repr,
    parse_cost,
    parse_size,
    plan_hf,
    plan_model,
    plan_program,
)


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    from spmdkit.models.zoo import PRESETS

    p.add_argument("--model", default="llama-7b",
                   help=f"a preset ({', '.join(sorted(PRESETS))}); default llama-7b")
    p.add_argument("--program", help="plan a program JSON file (docs/graph.md) instead of a preset")
    p.add_argument("--hf", metavar="CLASS",
                   help="plan a HuggingFace transformers model built from --hf-config, e.g. LlamaForCausalLM "
                        "(needs spmdkit[hf])")
    p.add_argument("--hf-config", metavar="FILE|JSON", help="the --hf model's config: a config.json file or a JSON object")
    p.add_argument("--dtype", default="float32", help="the --hf model's dtype: float32 (default), bf16, fp16, float64")
    p.add_argument("--tp-plan", metavar="FILE|JSON",
                   help='megatron for --hf / --program: module-name patterns -> column, row, vocab or replicate, '
                        'tried before the defaults, e.g. \'{"*.k_proj": "replicate"}\'')
    p.add_argument("--mesh", default=None, help="named mesh dims, e.g. dp=2,tp=4 (default)")
    p.add_argument("--devices", metavar="N",
                   help="instead of --mesh: search every dp x tp x pp mesh of N devices, the strategies, ZeRO stages "
                        "and recomputation (and --auto's search per mesh) for the fastest plan that fits the memory "
                        "(graph/auto_search.py); prints the top configurations and the best plan")
    p.add_argument("--strategy", default=None,
                   help="comma list of dp, megatron (tp), sp, zero1, zero2 (zero), zero3 (fsdp); default megatron (= dp,megatron) for a preset "
                        "or --hf, none for --program")
    p.add_argument("--layers", help=f"override the preset's layer count (1 to {MAX_LAYERS})")
    p.add_argument("--batch", help=f"override the preset's batch size (1 to {MAX_SIZE})")
    p.add_argument("--seq", help=f"override the preset's sequence length (1 to {MAX_SIZE})")
    p.add_argument("--annotate", action="append", default=[], metavar="TENSOR=DIMS_MAPPING",
                   help='pin a tensor, e.g. --annotate "tokens=[0,-1]" (repeatable)')
    p.add_argument("--cost", help='link costs per mesh dim, e.g. "tp=5us/150GB,dp=20us/25GB"')
    p.add_argument("--device", help="predict the step on this GPU: a preset (a100-40gb, a100-80gb, h100, h200) "
                                    "or a JSON file (docs/devices.md); also sets the links of --cost")
    p.add_argument("--nodes-of", dest="nodes_of", metavar="N",
                   help="ranks per node (the device's, 8, by default): inner mesh dims within N ranks use NVLink")
    p.add_argument("--grad-accum", dest="grad_accum", metavar="K",
                   help="gradient accumulation: K forward/backward micro-steps per optimizer step, the gradients "
                        "accumulated and reduced once (default 1)")
    p.add_argument("--recompute", default=None, metavar="none|selective|full",
                   help="activation recomputation: selective (the attention core, Korthikanti et al. 2022) or "
                        "full (every layer, only its input kept); in the memory and the --device step (default "
                        "none; --devices tries all three)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--html", metavar="FILE",
                   help="also write the plan as one self-contained HTML page (figures of the mesh, the shardings, "
                        "communication, memory and the step's timeline; no network needed)")
    p.add_argument("--wide", action="store_true",
                   help="print the tables whole, however wide (on a terminal they are fitted to its width)")
    p.add_argument("--export", nargs=2, metavar=("dtensor|jax|paddle", "FILE"),
                   help="also write the parameters' shardings for torch DTensor (a parallelize_module plan and "
                        "placements), JAX (PartitionSpecs) or Paddle (shard_tensor placements) to FILE (docs/export.md)")
    p.add_argument("--verify", action="store_true",
                   help="also run the same plan at tiny sizes through the simulator (needs numpy)")
    p.add_argument("--auto", action="store_true",
                   help="search the shardings (an ILP over the rules' candidates, solved by HiGHS; needs highspy) "
                        "instead of a --strategy; --annotate pins are kept; minimises communication time, plus compute "
                        "time with --device")
    p.add_argument("--auto-time-limit", dest="auto_time_limit", default="60", metavar="SECONDS",
                   help="the --auto solver's time limit (default 60)")
    p.add_argument("--memory", metavar="SIZE",
                   help="memory per device the plan must fit in, e.g. 80GiB, 80GB (10^9 bytes), 512MiB or a byte "
                        "count (default: the --device's memory): the --auto search's cap; --devices rejects "
                        "configurations over it")
    p.add_argument("--explain", action="store_true",
                   help="--auto: per layer, what was chosen and what the best plan choosing otherwise there costs")
    from spmdkit.cli.pipeline import add_pipeline_arguments

    add_pipeline_arguments(p)  # a pp mesh dim: --microbatches, --schedule, --virtual-stages, --stages


#: ``--mesh`` when neither it nor ``--devices`` is given.
DEFAULT_MESH = "dp=2,tp=4"
#: The longest ``--annotate`` dims_mapping text, and the most entries one may have.
MAX_ANNOTATION_CHARS = 4096
MAX_ANNOTATION_RANK = 64


def _dims_mapping_ok(v: Any) -> bool:
    """A list of entries, each an int or a list of ints (co-shard), no bools, bounded size."""
    if not isinstance(v, list) or len(v) > MAX_ANNOTATION_RANK:
        return False
    for e in v:
        if isinstance(e, list):
            if len(e) > MAX_ANNOTATION_RANK or not all(type(x) is int for x in e):
                return False
        elif type(e) is not int:
            return False
    return True


def parse_annotations(items: list[str]) -> dict[str, Any]:
    """``["x=[0,-1]", ...]`` -> ``{"x": [0, -1]}``; ProgramError naming ``--annotate`` for a
    malformed one (no ``=``, not JSON, too long or nested, not a list of ints / int lists)."""
    out: dict[str, Any] = {}
    for it in items:
        name, eq, dm = it.partition("=")
        name = name.strip()
        if not eq or not name:
            raise ProgramError(f"--annotate {clip_repr(it)}: expected TENSOR=DIMS_MAPPING, e.g. x=[0,-1]")
        if len(dm) > MAX_ANNOTATION_CHARS:
            raise ProgramError(f"--annotate {clip_repr(name)}: the dims_mapping is {len(dm)} characters "
                               f"(at most {MAX_ANNOTATION_CHARS})")
        try:
            v = json.loads(dm)
        except (ValueError, RecursionError):
            raise ProgramError(f"--annotate {clip_repr(it)}: the dims_mapping is not JSON (e.g. [0,-1])") from None
        if not _dims_mapping_ok(v):
            raise ProgramError(f"--annotate {clip_repr(it)}: the dims_mapping must be a list of mesh dims "
                               f"(ints, -1 for none, or lists of ints), at most {MAX_ANNOTATION_RANK} entries")
        out[name] = v
    return out


def parse_tp_plan(text: str | None) -> dict[str, str] | None:
    """``--tp-plan``: a JSON object (or a file holding one) of pattern -> role."""
    import os

    from spmdkit.strategies.hf import check_patterns

    if text is None:
        return None
    if not text.lstrip().startswith("{"):
        if not os.path.isfile(text):
            raise ProgramError(f"--tp-plan {clip_repr(text)}: neither a JSON object nor an existing file")
        with open(text, encoding="utf-8") as f:
            text = f.read(1 << 20)
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        raise ProgramError(f"--tp-plan {clip_repr(text)}: not JSON (e.g. {{\"*.k_proj\": \"replicate\"}})") from None
    if not isinstance(obj, dict):
        raise ProgramError("--tp-plan: must be a JSON object of module-name pattern -> role")
    try:
        return dict(check_patterns(obj))
    except ProgramError as exc:
        raise ProgramError(f"--tp-plan: {exc}") from None


def _progress() -> Any:
    """A rich progress bar on a terminal's stderr, else None."""
    if not sys.stderr.isatty():
        return None
    try:
        from rich.progress import Progress
    except ImportError:
        return None
    bar = Progress(transient=True)
    task = bar.add_task("propagating", total=1)
    bar.start()

    def cb(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total)
        if done >= total:
            bar.stop()

    return cb


def require_simulator() -> None:
    """``--verify`` runs the simulator (:mod:`spmdkit.sim.verify_plan`), which needs numpy: a
    ProgramError saying so where it is missing."""
    try:
        import numpy  # noqa: F401
    except ImportError as exc:
        raise ProgramError(f"--verify needs numpy (pip install 'spmdkit[sim]'): {exc}") from None


@contextlib.contextmanager
def strategy_notes(command: str) -> Iterator[None]:
    """The strategies' notes (a kv projection replicated over tp: a UserWarning starting with
    ``--``) printed as one ``spmdkit COMMAND: warning: ...`` line each on stderr, whatever
    the planning raises."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        try:
            yield
        finally:
            for w in caught:
                if issubclass(w.category, UserWarning) and str(w.message).startswith("--"):
                    print(f"spmdkit {command}: warning: {' '.join(str(w.message).split())}", file=sys.stderr)


def run_plan(ns: argparse.Namespace, out: TextIO) -> int:
    """Plan and print; a bad argument or program file is one line on stderr naming it and
    exit status 2 (no traceback); 1 when ``--verify`` finds a difference."""
    try:
        with strategy_notes("plan"):
            devices = getattr(ns, "devices", None) is not None
            for flag, given in (("--memory", getattr(ns, "memory", None) is not None),
                                ("--explain", getattr(ns, "explain", False))):
                if given and not getattr(ns, "auto", False) and not (flag == "--memory" and devices):
                    raise ProgramError(f"{flag}: applies to the --auto search and --devices; give --auto too")
            if getattr(ns, "mesh", None) is None and not devices:
                ns.mesh = DEFAULT_MESH
            from spmdkit.cli.pipeline import run_pipeline_plan, wants_pipeline
            from spmdkit.outputs.tables import fitted, terminal_width

            if getattr(ns, "html", None):
                from spmdkit.outputs.html import check_html_path

                check_html_path(ns.html)  # before planning
            if getattr(ns, "export", None):  # a bad format or folder refused before planning
                from spmdkit.outputs.export import check_target

                check_target(*ns.export)
            width = None if ns.json else terminal_width(out, getattr(ns, "wide", False))
            with fitted(out, width) as fout:
                if devices:  # the outer search: cli/devices.py
                    from spmdkit.cli.devices import run_devices

                    return run_devices(ns, fout)
                if wants_pipeline(ns):  # a pp mesh dim: cli/pipeline.py, graph/pipeline.py
                    if getattr(ns, "export", None):
                        raise ProgramError("--export: does not apply to a pipeline (pp) plan yet")
                    return run_pipeline_plan(ns, fout)
                return _run_plan(ns, fout)
    except SpmdError as exc:
        msg = " ".join(str(exc).split())
        if len(msg) > 500:
            msg = msg[:500] + "..."
        print(f"spmdkit plan: {type(exc).__name__}: {msg}", file=sys.stderr)
        return 2


def _run_plan(ns: argparse.Namespace, out: TextIO) -> int:
    from spmdkit.cost.memory import check_recompute, memory_per_device
    from spmdkit.outputs.report import plan_json, write_report

    recompute = ns.recompute = check_recompute(getattr(ns, "recompute", None) or "none")
    user = parse_annotations(ns.annotate)
    layers = parse_size("--layers", ns.layers, MAX_LAYERS)
    batch = parse_size("--batch", ns.batch, MAX_SIZE)
    seq = parse_size("--seq", ns.seq, MAX_SIZE)
    grad_accum = parse_size("--grad-accum", getattr(ns, "grad_accum", None), 1 << 20) or 1
    hf = getattr(ns, "hf", None)
    if getattr(ns, "auto", False):
        return _run_auto(ns, out, user, {"layers": layers, "batch": batch, "seq": seq}, grad_accum)
    if hf is not None and ns.program:
        raise ProgramError("--hf: give either --hf or --program, not both")
    if hf is None and getattr(ns, "hf_config", None) is not None:
        raise ProgramError("--hf-config: configures an --hf model; give --hf CLASS too")
    patterns = parse_tp_plan(getattr(ns, "tp_plan", None))
    if patterns is not None and hf is None and not ns.program:
        raise ProgramError("--tp-plan: applies to --hf or --program models (a preset has its own roles)")
    if hf is not None:
        if ns.hf_config is None:
            raise ProgramError(f"--hf {clip_repr(hf, 40)}: needs --hf-config FILE|JSON (the model's config)")
        for f, v in (("--layers", layers), ("--verify", ns.verify or None)):
            if v is not None:
                raise ProgramError(f"{f}: does not apply to --hf (set num_hidden_layers in --hf-config)")
        t0 = time.perf_counter()
        _, _, _, plan = plan_hf(hf, ns.hf_config, ns.mesh, ns.strategy, getattr(ns, "dtype", "float32"),
                                batch or 2, seq or 16, user, patterns, ns.cost, grad_accum)
        secs = time.perf_counter() - t0
        config = None
        title = f"{hf} (HuggingFace), batch {batch or 2}, seq {seq or 16}; strategy {ns.strategy or 'megatron'}"
        model_name = None
    elif ns.program:
        given = [f for f, v in (("--layers", layers), ("--batch", batch), ("--seq", seq)) if v is not None]
        if given:
            raise ProgramError(f"{given[0]}: overrides a preset's size; it does not apply to --program")
        if ns.verify:
            raise ProgramError("--verify: simulates a preset model; it does not apply to --program")
        from spmdkit.program.ir import load_program

        t0 = time.perf_counter()
        prog = load_program(ns.program)
        _, plan = plan_program(prog, ns.mesh, ns.strategy, user, patterns, ns.cost, grad_accum)
        secs = time.perf_counter() - t0
        config = None
        title = f"program {ns.program}" + (f"; strategy {ns.strategy}" if ns.strategy else "")
        model_name = None
    else:
        overrides = {"layers": layers, "batch": batch, "seq": seq}
        strategy = ns.strategy or "megatron"
        ns.strategy = strategy
        model, plan, secs = plan_model(ns.model, ns.mesh, strategy, overrides, user, ns.cost,
                                       progress=_progress(), grad_accum=grad_accum)
        c = config = model.config
        title = (f"{ns.model}: {c.arch}, {c.layers} layers, hidden {c.hidden}, {c.heads} heads"
                 f"{f' ({c.n_kv} kv)' if c.n_kv != c.heads else ''}, FFN {c.ffn}, vocab {c.vocab}, "
                 f"seq {c.seq}, batch {c.batch}, {c.dtype}; strategy {ns.strategy}")
        model_name = ns.model
    plan, est = step_estimate(ns, plan, config)
    mem = memory_per_device(plan, recompute)
    export_plan_file(ns, plan)
    verdict = None
    if ns.verify:
        require_simulator()
        from spmdkit.sim.verify_plan import verify_strategy

        verdict = verify_strategy(model_name, ns.mesh, ns.strategy, ns.cost)
    write_html(ns, plan, title, mem, est, config)
    if ns.json:
        extra: dict[str, Any] = {"title": title, "plan_seconds": secs}
        if verdict is not None:
            extra["verify"] = verdict
        out.write(json.dumps(plan_json(plan, mem, extra, est)) + "\n")
    else:
        write_report(plan, out, title, mem, secs, est)
        if verdict is not None:
            out.write("\n" + verdict["text"] + "\n")
    return 0 if verdict is None or verdict["ok"] else 1


def _run_auto(ns: argparse.Namespace, out: TextIO, user: dict[str, Any], overrides: dict[str, int | None],
              grad_accum: int) -> int:
    """``--auto``: the searched plan of a preset, a --program file or an --hf model (graph/auto.py);
    ``--verify``: a preset's plan checked on its tiny model (:func:`spmdkit.sim.verify_plan.verify_auto`)."""
    from spmdkit.cost.memory import memory_per_device
    from spmdkit.models.zoo import build_model, preset
    from spmdkit.outputs.report import plan_json, write_report
    from spmdkit.planner.auto import auto_plan
    from spmdkit.strategies.strategy import parse_mesh

    hf = getattr(ns, "hf", None)
    if ns.strategy is not None:
        raise ProgramError("--strategy: does not apply with --auto (the search chooses the shardings)")
    if hf is not None and ns.program:
        raise ProgramError("--hf: give either --hf or --program, not both")
    if hf is None and getattr(ns, "hf_config", None) is not None:
        raise ProgramError("--hf-config: configures an --hf model; give --hf CLASS too")
    if ns.verify and (hf is not None or ns.program):
        raise ProgramError(f"--verify: simulates a preset model; it does not apply to {'--hf' if hf else '--program'}")
    try:
        limit = float(ns.auto_time_limit)
    except ValueError:
        raise ProgramError(f"--auto-time-limit: {clip_repr(str(ns.auto_time_limit))} is not a number of seconds") from None
    if not 0 < limit <= 86400:
        raise ProgramError(f"--auto-time-limit: {limit:g} is not between 0 and 86400 seconds")
    mesh = parse_mesh(ns.mesh)
    config = None
    t0 = time.perf_counter()
    if hf is not None:
        if ns.hf_config is None:
            raise ProgramError(f"--hf {clip_repr(hf, 40)}: needs --hf-config FILE|JSON (the model's config)")
        if overrides.get("layers") is not None:
            raise ProgramError("--layers: does not apply to --hf (set num_hidden_layers in --hf-config)")
        from spmdkit.planner.search import import_hf_program

        b, sq = overrides.get("batch") or 2, overrides.get("seq") or 16
        prog = import_hf_program(hf, ns.hf_config, b, sq, getattr(ns, "dtype", "float32"))
        title = f"{hf} (HuggingFace), batch {b}, seq {sq}"
    elif ns.program:
        given = [f"--{k}" for k, v in overrides.items() if v is not None]
        if given:
            raise ProgramError(f"{given[0]}: overrides a preset's size; it does not apply to --program")
        from spmdkit.program.ir import load_program

        prog = load_program(ns.program)
        title = f"program {ns.program}"
    else:
        cfg = preset(ns.model)
        cfg = cfg.with_(**{k: v for k, v in overrides.items() if v is not None})
        config = cfg
        # the vocab-parallel loss: its rule also takes the class axis whole (the plain loss)
        prog = build_model(cfg, vocab_parallel_loss=True, check_rules=False).program
        title = f"{ns.model}: {cfg.arch}, {cfg.layers} layers, hidden {cfg.hidden}, seq {cfg.seq}, batch {cfg.batch}"

    device = load_device(ns.device) if getattr(ns, "device", None) else None
    cost = parse_cost(ns.cost, mesh)
    if device is not None:  # the device's links, --cost on top (as _step_estimate times the plan)
        from dataclasses import replace

        from spmdkit.core.reshard import CostModel

        nodes = parse_size("--nodes-of", getattr(ns, "nodes_of", None), 1 << 20)
        device = replace(device, ranks_per_node=nodes) if nodes else device
        cost = cost_model(mesh, device, nodes)
        if ns.cost:
            cost = CostModel.parse(ns.cost, mesh, base=cost)
    from spmdkit.planner.search import parse_memory

    cap = None if getattr(ns, "memory", None) is None else parse_memory(ns.memory)
    if cap is None and device is not None:
        cap = int(device.memory_bytes)
    from spmdkit.outputs.progress import Progress

    with Progress("plan --auto") as bar:  # a line on a terminal's stderr, nothing on a pipe
        plan, info = auto_plan(prog, mesh, user, cost, time_limit=limit, device=device, memory_cap=cap,
                               explain=bool(getattr(ns, "explain", False)),
                               progress=lambda phase, done, total: bar.update(done, total, phase), grad_accum=grad_accum)
    secs = time.perf_counter() - t0
    title += (f"; --auto: HiGHS {info.status}, gap {info.gap:.2%}, solve {info.solve_s:.2f} s, "
              f"{info.candidates} candidates, predicted {'compute + ' if device else ''}communication "
              f"{info.objective_s * 1e3:.3f} ms, realised {info.realized}, {info.merged_ops} ops merged, "
              f"{info.folded_layers} layers folded" + (f", memory cap {cap / 2**30:.2f} GiB" if cap else ""))
    plan, est = step_estimate(ns, plan, config)
    mem = memory_per_device(plan, ns.recompute)
    write_html(ns, plan, title, mem, est, config, auto=info)
    export_plan_file(ns, plan)
    verdict = None
    if ns.verify:
        require_simulator()
        from spmdkit.sim.verify_plan import verify_auto

        verdict = verify_auto(plan, ns.model, ns.cost)
    if ns.json:
        extra: dict[str, Any] = {"title": title, "plan_seconds": secs,
                 "auto": {"status": info.status, "gap": info.gap, "solve_seconds": info.solve_s,
                          "objective_seconds": info.objective_s, "candidates": info.candidates,
                          "variables": info.variables, "realized": info.realized, "merged_elementwise": info.merged,
                          "folded_layers": info.folded, "merged_ops": info.merged_ops,
                          "layers_folded": info.folded_layers, "candidates_seconds": info.candidates_s,
                          "memory_cap": cap, "memory_counted": info.memory_bytes,
                          "explain": [e.to_json() for e in info.explain]}}
        if verdict is not None:
            extra["verify"] = verdict
        out.write(json.dumps(plan_json(plan, mem, extra, est)) + "\n")
    else:
        write_report(plan, out, title, mem, secs, est)
        if info.explain:
            out.write("\n" + explain_table(info.explain) + "\n")
        if verdict is not None:
            out.write("\n" + verdict["text"] + "\n")
    return 0 if verdict is None or verdict["ok"] else 1


def explain_table(rows: list[Any]) -> str:
    """``--explain``: per layer, the choice and the best plan choosing otherwise there."""
    lines = ["--explain: per layer (identical layers once), the chosen layouts (forward matmul / embedding: "
             "weight -> output dims_mapping, pN = partial over mesh dim N) and the search's objective (predicted "
             "step) of the best choice where one of them is laid out otherwise"]
    w = max(len(r.layer) for r in rows)
    lines.append(f"  {'layer'.ljust(w)}  {'ops':>4}  {'obj. ms':>9}  {'runner-up':>9}  {'+ms':>8}  chosen | runner-up")
    for r in rows:
        alt = "-" if r.runner_up_s is None else f"{r.runner_up_s * 1e3:9.3f}"
        d = "-" if r.runner_up_s is None else f"{(r.runner_up_s - r.objective_s) * 1e3:+8.3f}"
        lines.append(f"  {r.layer.ljust(w)}  {r.ops:>4}  {r.objective_s * 1e3:9.3f}  {alt:>9}  {d:>8}  "
                     f"{r.chosen or '(no matmul)'} | {r.runner_up}")
    return "\n".join(lines)


def write_html(ns: argparse.Namespace, plan: Any, title: str, mem: Any, est: Any, config: Any = None,
               mesh_text: str | None = None, recompute: str | None = None, **more: Any) -> None:
    """``--html FILE``: the page of :mod:`spmdkit.outputs.html`, written atomically; a line on stderr.
    ``mesh_text`` / ``recompute``: the full mesh and the recomputation (default ``--mesh`` /
    ``--recompute``; ``--devices`` gives those of the configuration it chose)."""
    path = getattr(ns, "html", None)
    if not path:
        return
    from spmdkit.outputs.html import save_html
    from spmdkit.strategies.strategy import parse_mesh

    nodes = parse_size("--nodes-of", getattr(ns, "nodes_of", None), 1 << 20)
    size = save_html(path, plan, title, mem, est, config=config,
                     recompute=recompute or getattr(ns, "recompute", None) or "none",
                     mesh=parse_mesh(mesh_text or ns.mesh), ranks_per_node=nodes, **more)
    print(f"spmdkit plan: wrote {path} ({size / 1024:.0f} KiB)", file=sys.stderr)


def export_plan_file(ns: argparse.Namespace, plan: Any) -> None:
    """``--export FORMAT FILE``: the plan's shardings for another framework (spmdkit/export.py)."""
    if getattr(ns, "export", None):
        from spmdkit.outputs.export import export_plan

        export_plan(plan, ns.export[0], ns.export[1])


def step_estimate(ns: argparse.Namespace, plan: Any, config: Any) -> tuple[Any, Any]:
    """``--device`` / ``--nodes-of``: the plan with its reshards timed by the device's links
    (``--cost`` applied on top) and the predicted step (None without ``--device``)."""
    device_text, nodes_text = getattr(ns, "device", None), getattr(ns, "nodes_of", None)
    if not device_text and not nodes_text:
        return plan, None
    from spmdkit.core.reshard import CostModel

    device = load_device(str(device_text)) if device_text else None
    nodes = parse_size("--nodes-of", nodes_text, 1 << 20)
    if device is not None and nodes:
        from dataclasses import replace

        device = replace(device, ranks_per_node=nodes)
    cost = cost_model(plan.mesh, device, nodes)
    if ns.cost:
        cost = CostModel.parse(ns.cost, plan.mesh, base=cost)  # already checked by parse_cost
    plan = recost(plan, cost)
    if device is None:
        return plan, None
    batch, seq = getattr(config, "batch", None), getattr(config, "seq", None)
    tokens = batch * seq if isinstance(batch, int) and isinstance(seq, int) else guess_tokens(plan.program)
    return plan, estimate_step(plan, device, tokens, getattr(ns, "recompute", None) or "none")


__all__ = ["DEFAULT_MESH", "MAX_ANNOTATION_CHARS", "MAX_ANNOTATION_RANK", "add_plan_arguments",
           "parse_annotations", "parse_tp_plan", "require_simulator", "run_plan", "step_estimate", "strategy_notes", "write_html"]


