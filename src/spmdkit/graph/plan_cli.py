"""``spmdkit plan``: plan a model's training step on a mesh and print the report."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any, TextIO

from spmdkit.core.errors import ProgramError, SpmdError


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    from spmdkit.graph.zoo import PRESETS

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
    p.add_argument("--mesh", default="dp=2,tp=4", help="named mesh dims, e.g. dp=2,tp=4 (default)")
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
    p.add_argument("--recompute", default="none", metavar="none|selective|full",
                   help="activation recomputation: selective (the attention core, Korthikanti et al. 2022) or "
                        "full (every layer, only its input kept); in the memory and the --device step")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--verify", action="store_true",
                   help="also run the same plan at tiny sizes through the simulator (needs numpy)")
    p.add_argument("--auto", action="store_true",
                   help="search the shardings (an ILP over the rules' candidates, solved by HiGHS; needs highspy) "
                        "instead of a --strategy; --annotate pins are kept; minimises communication time, plus compute "
                        "time with --device")
    p.add_argument("--auto-time-limit", dest="auto_time_limit", default="60", metavar="SECONDS",
                   help="the --auto solver's time limit (default 60)")
    p.add_argument("--memory", metavar="SIZE",
                   help="--auto: memory per device the plan must fit in, e.g. 80GiB, 80GB (10^9 bytes), 512MiB or "
                        "a byte count (default: the --device's memory; none without --device)")
    p.add_argument("--explain", action="store_true",
                   help="--auto: per layer, what was chosen and what the best plan choosing otherwise there costs")
    from spmdkit.graph.pipeline import add_pipeline_arguments

    add_pipeline_arguments(p)  # a pp mesh dim: --microbatches, --schedule, --virtual-stages, --stages


#: The most layers ``--layers`` takes: planning is linear in the ops (~30 per layer with its
#: backward and optimizer), and 512 is over six times the largest preset (llama-70b, 80).
MAX_LAYERS = 512
#: The largest ``--batch`` / ``--seq`` (2**31 - 1, the int32 range frameworks index with).
MAX_SIZE = (1 << 31) - 1
#: The longest ``--annotate`` dims_mapping text, and the most entries one may have.
MAX_ANNOTATION_CHARS = 4096
MAX_ANNOTATION_RANK = 64


def _cut(text: str, n: int = 60) -> str:
    return repr(text) if len(text) <= n else repr(text[:n]) + f"... ({len(text)} characters)"


def _size_arg(flag: str, text: str | int | None, hi: int) -> int | None:
    """An ASCII decimal int in [1, hi] for ``flag`` (None when not given)."""
    if text is None:
        return None
    t = str(text).strip()
    if not (t.isascii() and t.isdigit() and len(t) <= 12):
        raise ProgramError(f"{flag} {_cut(str(text), 40)}: expected an integer from 1 to {hi}")
    v = int(t)
    if not 1 <= v <= hi:
        raise ProgramError(f"{flag} {v}: out of range (1 to {hi})")
    return v


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


def _annotations(items: list[str]) -> dict[str, Any]:
    """``["x=[0,-1]", ...]`` -> ``{"x": [0, -1]}``; ProgramError naming ``--annotate`` for a
    malformed one (no ``=``, not JSON, too long or nested, not a list of ints / int lists)."""
    out: dict[str, Any] = {}
    for it in items:
        name, eq, dm = it.partition("=")
        name = name.strip()
        if not eq or not name:
            raise ProgramError(f"--annotate {_cut(it)}: expected TENSOR=DIMS_MAPPING, e.g. x=[0,-1]")
        if len(dm) > MAX_ANNOTATION_CHARS:
            raise ProgramError(f"--annotate {_cut(name)}: the dims_mapping is {len(dm)} characters "
                               f"(at most {MAX_ANNOTATION_CHARS})")
        try:
            v = json.loads(dm)
        except (ValueError, RecursionError):
            raise ProgramError(f"--annotate {_cut(it)}: the dims_mapping is not JSON (e.g. [0,-1])") from None
        if not _dims_mapping_ok(v):
            raise ProgramError(f"--annotate {_cut(it)}: the dims_mapping must be a list of mesh dims "
                               f"(ints, -1 for none, or lists of ints), at most {MAX_ANNOTATION_RANK} entries")
        out[name] = v
    return out


def plan_model(model_name: str, mesh_text: str, strategy_text: str,
               overrides: Mapping[str, int | str | None] | None = None,
               user: dict[str, Any] | None = None, cost_text: str | None = None,
               progress: Any = None) -> tuple[Any, Any, float]:
    """(model, plan, seconds) for a preset on a mesh under a strategy."""
    from spmdkit.graph.propagate import propagate
    from spmdkit.graph.strategy import annotate, parse_mesh, parse_strategy, zero3_storage
    from spmdkit.graph.zoo import build_model, preset

    cfg = preset(model_name)
    mesh = parse_mesh(mesh_text)
    st = parse_strategy(strategy_text, mesh)
    if overrides:
        limits = {"layers": MAX_LAYERS, "batch": MAX_SIZE, "seq": MAX_SIZE}
        checked = {k: _size_arg(f"--{k}", v, limits.get(k, MAX_SIZE)) for k, v in overrides.items()}
        cfg = cfg.with_(**{k: v for k, v in checked.items() if v is not None})
    t0 = time.perf_counter()
    model = build_model(cfg, vocab_parallel_loss="megatron" in st, check_rules=False)
    ann = annotate(model, mesh, st, user)
    plan = propagate(model.program, mesh, ann, _cost(cost_text, mesh), progress=progress,
                     storage=zero3_storage(model.optimizer, ann, st))
    return model, plan, time.perf_counter() - t0


def plan_program(prog: Any, mesh_text: str, strategy_text: str | None, user: dict[str, Any] | None = None,
                 patterns: Any = None, cost_text: str | None = None) -> tuple[Any, Any]:
    """(program, plan) for an imported program (or a program JSON from one) under a strategy
    (:mod:`spmdkit.graph.hf_strategy`): with megatron the program is a copy whose loss is
    vocab-parallel, and the plan is over that copy."""
    from spmdkit.graph.hf_strategy import annotate_program, megatron_program, optimizer_of, regroup_partial_sums
    from spmdkit.graph.propagate import propagate
    from spmdkit.graph.strategy import parse_mesh, parse_strategy, user_attrs, zero3_storage

    mesh = parse_mesh(mesh_text)
    st = parse_strategy(strategy_text or "none", mesh)
    cost = _cost(cost_text, mesh)
    if not st:  # no strategy: the user's annotations alone, as a program file always was
        return prog, propagate(prog, mesh, user_attrs(prog, mesh, user), cost)
    if "megatron" in st:
        prog = megatron_program(prog, patterns)
    ann = annotate_program(prog, mesh, st, user, patterns)
    storage = zero3_storage(optimizer_of(prog), ann, st)
    plan = propagate(prog, mesh, ann, cost, storage=storage)
    regrouped = regroup_partial_sums(prog, plan)  # partial gradients summed before one reduction
    if regrouped is not prog:
        prog, plan = regrouped, propagate(regrouped, mesh, ann, cost, storage=storage)
    return prog, plan


def plan_hf(class_name: str, config: Any, mesh_text: str, strategy_text: str | None, dtype: str = "float32",
            batch: int = 2, seq: int = 16, user: dict[str, Any] | None = None, patterns: Any = None,
            cost_text: str | None = None) -> tuple[Any, Any, dict[str, Any], Any]:
    """(program, model, keyword inputs, plan) for the HuggingFace model ``class_name`` built
    from ``config`` (a dict, a JSON object text or a config.json path; :func:`spmdkit.hf.build`),
    its training step imported at ``batch`` x ``seq`` and planned on ``mesh_text`` under
    ``strategy_text`` (default megatron). The program is the one planned (with megatron, its
    loss made vocab-parallel); run it with ``torch_values(prog, model, (), kw)``."""
    from spmdkit.hf import dtype_name, import_hf

    dt = dtype_name(dtype)
    b = _size_arg("--batch", batch, MAX_SIZE)
    sq = _size_arg("--seq", seq, MAX_SIZE)
    assert b is not None and sq is not None
    from spmdkit.graph.strategy import parse_mesh, parse_strategy

    parse_strategy(strategy_text or "megatron", parse_mesh(mesh_text))  # refuse a bad mesh / strategy before importing
    prog, model, kw = _import_hf(import_hf, class_name, config, b, sq, dt)
    prog, plan = plan_program(prog, mesh_text, strategy_text or "megatron", user, patterns, cost_text)
    return prog, model, kw, plan


def _import_hf(import_hf: Any, class_name: str, config: Any, batch: int, seq: int, dtype: str) -> Any:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            return import_hf(class_name, config, batch=batch, seq=seq, dtype=dtype)
        except SpmdError:
            raise
        except (ValueError, TypeError, RuntimeError, IndexError, KeyError) as exc:
            msg = " ".join(str(exc).split())[:300]
            raise ProgramError(f"--hf {class_name}: the model does not import: {type(exc).__name__}: {msg}") from None


def _tp_plan(text: str | None) -> dict[str, str] | None:
    """``--tp-plan``: a JSON object (or a file holding one) of pattern -> role."""
    import os

    from spmdkit.graph.hf_strategy import check_patterns

    if text is None:
        return None
    if not text.lstrip().startswith("{"):
        if not os.path.isfile(text):
            raise ProgramError(f"--tp-plan {_cut(text)}: neither a JSON object nor an existing file")
        with open(text, encoding="utf-8") as f:
            text = f.read(1 << 20)
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        raise ProgramError(f"--tp-plan {_cut(text)}: not JSON (e.g. {{\"*.k_proj\": \"replicate\"}})") from None
    if not isinstance(obj, dict):
        raise ProgramError("--tp-plan: must be a JSON object of module-name pattern -> role")
    try:
        return dict(check_patterns(obj))
    except ProgramError as exc:
        raise ProgramError(f"--tp-plan: {exc}") from None


def _cost(text: str | None, mesh: Any) -> Any:
    import math

    from spmdkit.reshard import CostModel

    if not text:
        return CostModel.default(mesh)
    if len(text) > 4096:
        raise ProgramError(f"--cost: {len(text)} characters (at most 4096)")
    try:
        cost = CostModel.parse(text, mesh)
    except SpmdError as exc:
        msg = str(exc)
        raise ProgramError(msg if msg.startswith("--cost") else f"--cost {_cut(text)}: {msg[:300]}") from None
    except (ZeroDivisionError, ValueError, OverflowError):
        raise ProgramError(f"--cost {_cut(text)}: latency and bandwidth must be finite numbers, the "
                           f"bandwidth > 0 (e.g. tp=5us/150GB)") from None
    for link in cost.links:
        a, b = link.alpha_s, link.beta_s_per_byte
        if not (math.isfinite(a) and a >= 0 and math.isfinite(b) and b > 0):
            raise ProgramError(f"--cost {_cut(text)}: latency and bandwidth must be finite numbers, the "
                               f"bandwidth > 0 (e.g. tp=5us/150GB)")
    return cost


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
            from spmdkit.graph.pipeline import run_pipeline_plan, wants_pipeline

            for flag, given in (("--memory", getattr(ns, "memory", None) is not None),
                                ("--explain", getattr(ns, "explain", False))):
                if given and not getattr(ns, "auto", False):
                    raise ProgramError(f"{flag}: applies to the --auto search; give --auto too")
            if wants_pipeline(ns):  # a pp mesh dim: graph/pipeline.py
                return run_pipeline_plan(ns, out)
            return _run_plan(ns, out)
    except SpmdError as exc:
        msg = " ".join(str(exc).split())
        if len(msg) > 500:
            msg = msg[:500] + "..."
        print(f"spmdkit plan: {type(exc).__name__}: {msg}", file=sys.stderr)
        return 2


def _run_plan(ns: argparse.Namespace, out: TextIO) -> int:
    from spmdkit.graph.activations import check_recompute
    from spmdkit.graph.memory import memory_per_device
    from spmdkit.graph.report import plan_json, write_report

    recompute = ns.recompute = check_recompute(getattr(ns, "recompute", None) or "none")
    user = _annotations(ns.annotate)
    layers = _size_arg("--layers", ns.layers, MAX_LAYERS)
    batch = _size_arg("--batch", ns.batch, MAX_SIZE)
    seq = _size_arg("--seq", ns.seq, MAX_SIZE)
    hf = getattr(ns, "hf", None)
    if getattr(ns, "auto", False):
        return _run_auto(ns, out, user, {"layers": layers, "batch": batch, "seq": seq})
    if hf is not None and ns.program:
        raise ProgramError("--hf: give either --hf or --program, not both")
    if hf is None and getattr(ns, "hf_config", None) is not None:
        raise ProgramError("--hf-config: configures an --hf model; give --hf CLASS too")
    patterns = _tp_plan(getattr(ns, "tp_plan", None))
    if patterns is not None and hf is None and not ns.program:
        raise ProgramError("--tp-plan: applies to --hf or --program models (a preset has its own roles)")
    if hf is not None:
        if ns.hf_config is None:
            raise ProgramError(f"--hf {_cut(hf, 40)}: needs --hf-config FILE|JSON (the model's config)")
        for f, v in (("--layers", layers), ("--verify", ns.verify or None)):
            if v is not None:
                raise ProgramError(f"{f}: does not apply to --hf (set num_hidden_layers in --hf-config)")
        t0 = time.perf_counter()
        _, _, _, plan = plan_hf(hf, ns.hf_config, ns.mesh, ns.strategy, getattr(ns, "dtype", "float32"),
                                batch or 2, seq or 16, user, patterns, ns.cost)
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
        from spmdkit.graph.program import load_program

        t0 = time.perf_counter()
        prog = load_program(ns.program)
        _, plan = plan_program(prog, ns.mesh, ns.strategy, user, patterns, ns.cost)
        secs = time.perf_counter() - t0
        config = None
        title = f"program {ns.program}" + (f"; strategy {ns.strategy}" if ns.strategy else "")
        model_name = None
    else:
        overrides = {"layers": layers, "batch": batch, "seq": seq}
        strategy = ns.strategy or "megatron"
        ns.strategy = strategy
        model, plan, secs = plan_model(ns.model, ns.mesh, strategy, overrides, user, ns.cost,
                                       progress=_progress())
        c = config = model.config
        title = (f"{ns.model}: {c.arch}, {c.layers} layers, hidden {c.hidden}, {c.heads} heads"
                 f"{f' ({c.n_kv} kv)' if c.n_kv != c.heads else ''}, FFN {c.ffn}, vocab {c.vocab}, "
                 f"seq {c.seq}, batch {c.batch}, {c.dtype}; strategy {ns.strategy}")
        model_name = ns.model
    plan.grad_accum = _size_arg("--grad-accum", getattr(ns, "grad_accum", None), 1 << 20) or 1
    plan, est = _step_estimate(ns, plan, config)
    mem = memory_per_device(plan, recompute)
    verdict = None
    if ns.verify:
        verdict = _verify(ns, model_name, user)
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


def _run_auto(ns: argparse.Namespace, out: TextIO, user: dict[str, Any], overrides: dict[str, int | None]) -> int:
    """``--auto``: the searched plan of a preset or a --program file (graph/auto.py)."""
    from spmdkit.graph.auto import auto_plan
    from spmdkit.graph.memory import memory_per_device
    from spmdkit.graph.report import plan_json, write_report
    from spmdkit.graph.strategy import parse_mesh
    from spmdkit.graph.zoo import build_model, preset

    for flag, v in (("--strategy", ns.strategy), ("--hf", getattr(ns, "hf", None)), ("--verify", ns.verify or None)):
        if v is not None:
            raise ProgramError(f"{flag}: does not apply with --auto (the search chooses the shardings of a preset "
                               "or a --program file)")
    try:
        limit = float(ns.auto_time_limit)
    except ValueError:
        raise ProgramError(f"--auto-time-limit: {_cut(str(ns.auto_time_limit))} is not a number of seconds") from None
    if not 0 < limit <= 86400:
        raise ProgramError(f"--auto-time-limit: {limit:g} is not between 0 and 86400 seconds")
    mesh = parse_mesh(ns.mesh)
    config = None
    t0 = time.perf_counter()
    if ns.program:
        given = [f"--{k}" for k, v in overrides.items() if v is not None]
        if given:
            raise ProgramError(f"{given[0]}: overrides a preset's size; it does not apply to --program")
        from spmdkit.graph.program import load_program

        prog = load_program(ns.program)
        title = f"program {ns.program}"
    else:
        cfg = preset(ns.model)
        cfg = cfg.with_(**{k: v for k, v in overrides.items() if v is not None})
        config = cfg
        # the vocab-parallel loss: its rule also takes the class axis whole (the plain loss)
        prog = build_model(cfg, vocab_parallel_loss=True, check_rules=False).program
        title = f"{ns.model}: {cfg.arch}, {cfg.layers} layers, hidden {cfg.hidden}, seq {cfg.seq}, batch {cfg.batch}"
    from spmdkit.graph.compute import cost_model, load_device

    device = load_device(ns.device) if getattr(ns, "device", None) else None
    cost = _cost(ns.cost, mesh)
    if device is not None:  # the device's links, --cost on top (as _step_estimate times the plan)
        from dataclasses import replace

        from spmdkit.reshard import CostModel

        nodes = _size_arg("--nodes-of", getattr(ns, "nodes_of", None), 1 << 20)
        device = replace(device, ranks_per_node=nodes) if nodes else device
        cost = cost_model(mesh, device, nodes)
        if ns.cost:
            cost = CostModel.parse(ns.cost, mesh, base=cost)
    cap = _memory_arg(getattr(ns, "memory", None))
    if cap is None and device is not None:
        cap = int(device.memory_bytes)
    plan, info = auto_plan(prog, mesh, user, cost, time_limit=limit, device=device, memory_cap=cap,
                           explain=bool(getattr(ns, "explain", False)))
    secs = time.perf_counter() - t0
    title += (f"; --auto: HiGHS {info.status}, gap {info.gap:.2%}, solve {info.solve_s:.2f} s, "
              f"{info.candidates} candidates, predicted {'compute + ' if device else ''}communication "
              f"{info.objective_s * 1e3:.3f} ms, realised {info.realized}, {info.merged_ops} ops merged, "
              f"{info.folded_layers} layers folded" + (f", memory cap {cap / 2**30:.2f} GiB" if cap else ""))
    plan.grad_accum = _size_arg("--grad-accum", getattr(ns, "grad_accum", None), 1 << 20) or 1
    plan, est = _step_estimate(ns, plan, config)
    mem = memory_per_device(plan, ns.recompute)
    if ns.json:
        extra = {"title": title, "plan_seconds": secs,
                 "auto": {"status": info.status, "gap": info.gap, "solve_seconds": info.solve_s,
                          "objective_seconds": info.objective_s, "candidates": info.candidates,
                          "variables": info.variables, "realized": info.realized, "merged_elementwise": info.merged,
                          "folded_layers": info.folded, "merged_ops": info.merged_ops,
                          "layers_folded": info.folded_layers, "candidates_seconds": info.candidates_s,
                          "memory_cap": cap, "memory_counted": info.memory_bytes,
                          "explain": [e.to_json() for e in info.explain]}}
        out.write(json.dumps(plan_json(plan, mem, extra, est)) + "\n")
    else:
        write_report(plan, out, title, mem, secs, est)
        if info.explain:
            out.write("\n" + _explain_table(info.explain) + "\n")
    return 0


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _memory_arg(text: str | None) -> int | None:
    """``--memory``: a size such as 80GiB, 80GB (10^9 bytes), 512MiB or a byte count."""
    if text is None:
        return None
    import re

    m = re.fullmatch(r"\s*([0-9]{1,15}(?:\.[0-9]{1,9})?)\s*([A-Za-z]{0,3})\s*", str(text))
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ProgramError(f"--memory {_cut(str(text), 40)}: expected a size such as 80GiB, 80GB, 512MiB or bytes")
    v = int(float(m.group(1)) * _UNITS[unit])
    if v <= 0:
        raise ProgramError(f"--memory {_cut(str(text), 40)}: must be more than 0 bytes")
    return v


def _explain_table(rows: list[Any]) -> str:
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


def _verify(ns: argparse.Namespace, model_name: str | None, user: dict[str, Any]) -> dict[str, Any]:
    """The same strategy on the tiny model of the same arch, simulated end to end."""
    try:
        from spmdkit.graph.simulate import simulate_plan
    except ImportError as exc:  # numpy missing
        raise ProgramError(f"--verify needs numpy (pip install 'spmdkit[sim]'): {exc}") from None
    from spmdkit.graph.zoo import preset

    cfg = preset(model_name) if model_name else None
    arch = cfg.arch if cfg else "llama"
    tiny = "tiny-llama" if arch == "llama" else "tiny-gpt-dropout" if cfg and cfg.dropout else "tiny-gpt2"
    _, plan, _ = plan_model(tiny, ns.mesh, ns.strategy, None, None, ns.cost)
    rep = simulate_plan(plan)
    ok = rep.ok
    lines = [f"verify: {tiny} with the same mesh and strategy, simulated on {plan.mesh.size} ranks: "
             f"{rep.checked} tensors compared with the unsharded step (loss, every gradient, every update): "
             + ("all equal" if ok else f"{len(rep.failures)} differ")]
    for name, what in rep.failures[:10]:
        lines.append(f"  {name}: {what}")
    return {"ok": ok, "model": tiny, "checked": rep.checked, "failures": [list(f) for f in rep.failures],
            "loss": rep.loss, "text": "\n".join(lines)}


def _step_estimate(ns: argparse.Namespace, plan: Any, config: Any) -> tuple[Any, Any]:
    """``--device`` / ``--nodes-of``: the plan with its reshards timed by the device's links
    (``--cost`` applied on top) and the predicted step (None without ``--device``)."""
    device_text, nodes_text = getattr(ns, "device", None), getattr(ns, "nodes_of", None)
    if not device_text and not nodes_text:
        return plan, None
    from spmdkit.graph.compute import cost_model, estimate_step, guess_tokens, load_device, recost
    from spmdkit.reshard import CostModel

    device = load_device(str(device_text)) if device_text else None
    nodes = _size_arg("--nodes-of", nodes_text, 1 << 20)
    if device is not None and nodes:
        from dataclasses import replace

        device = replace(device, ranks_per_node=nodes)
    cost = cost_model(plan.mesh, device, nodes)
    if ns.cost:
        cost = CostModel.parse(ns.cost, plan.mesh, base=cost)  # already checked by _cost
    plan = recost(plan, cost)
    if device is None:
        return plan, None
    batch, seq = getattr(config, "batch", None), getattr(config, "seq", None)
    tokens = batch * seq if isinstance(batch, int) and isinstance(seq, int) else guess_tokens(plan.program)
    return plan, estimate_step(plan, device, tokens, getattr(ns, "recompute", None) or "none")


__all__ = ["MAX_LAYERS", "MAX_SIZE", "add_plan_arguments", "plan_hf", "plan_model", "plan_program", "run_plan"]


