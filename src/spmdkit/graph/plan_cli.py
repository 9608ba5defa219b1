"""``spmdkit plan``: plan a model's training step on a mesh and print the report."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

from spmdkit.core.errors import ProgramError


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    from spmdkit.graph.zoo import PRESETS

    p.add_argument("--model", default="llama-7b",
                   help=f"a preset ({', '.join(sorted(PRESETS))}); default llama-7b")
    p.add_argument("--program", help="plan a program JSON file (docs/graph.md) instead of a preset")
    p.add_argument("--mesh", default="dp=2,tp=4", help="named mesh dims, e.g. dp=2,tp=4 (default)")
    p.add_argument("--strategy", default="megatron",
                   help="comma list of dp, megatron (tp), sp, zero; default megatron (= dp,megatron)")
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--batch", type=int, help="override the preset's batch size")
    p.add_argument("--seq", type=int, help="override the preset's sequence length")
    p.add_argument("--annotate", action="append", default=[], metavar="TENSOR=DIMS_MAPPING",
                   help='pin a tensor, e.g. --annotate "tokens=[0,-1]" (repeatable)')
    p.add_argument("--cost", help='link costs per mesh dim, e.g. "tp=5us/150GB,dp=20us/25GB"')
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--verify", action="store_true",
                   help="also run the same plan at tiny sizes through the simulator (needs numpy)")


def _annotations(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for it in items:
        name, eq, dm = it.partition("=")
        if not eq:
            raise ProgramError(f"--annotate {it!r}: expected TENSOR=DIMS_MAPPING")
        try:
            out[name.strip()] = json.loads(dm)
        except ValueError:
            raise ProgramError(f"--annotate {it!r}: the dims_mapping is not JSON (e.g. [0,-1])") from None
    return out


def plan_model(model_name: str, mesh_text: str, strategy_text: str, overrides: dict[str, int] | None = None,
               user: dict[str, Any] | None = None, cost_text: str | None = None,
               progress: Any = None) -> tuple[Any, Any, float]:
    """(model, plan, seconds) for a preset on a mesh under a strategy."""
    from spmdkit.graph.propagate import propagate
    from spmdkit.graph.strategy import annotate, parse_mesh, parse_strategy
    from spmdkit.graph.zoo import build_model, preset

    mesh = parse_mesh(mesh_text)
    st = parse_strategy(strategy_text, mesh)
    cfg = preset(model_name)
    if overrides:
        cfg = cfg.with_(**{k: v for k, v in overrides.items() if v is not None})
    t0 = time.perf_counter()
    model = build_model(cfg, vocab_parallel_loss="megatron" in st, check_rules=False)
    ann = annotate(model, mesh, st, user)
    plan = propagate(model.program, mesh, ann, _cost(cost_text, mesh), progress=progress)
    return model, plan, time.perf_counter() - t0


def _cost(text: str | None, mesh: Any) -> Any:
    from spmdkit.reshard import CostModel

    return CostModel.parse(text, mesh) if text else CostModel.default(mesh)


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


def run_plan(ns: argparse.Namespace, out: TextIO) -> int:
    from spmdkit.graph.memory import memory_per_device
    from spmdkit.graph.report import plan_json, write_report

    user = _annotations(ns.annotate)
    if ns.program:
        from spmdkit.graph.program import load_program
        from spmdkit.graph.propagate import propagate
        from spmdkit.graph.strategy import parse_mesh

        mesh = parse_mesh(ns.mesh)
        t0 = time.perf_counter()
        prog = load_program(ns.program)
        plan = propagate(prog, mesh, user, _cost(ns.cost, mesh))
        secs = time.perf_counter() - t0
        title = f"program {ns.program}"
        model_name = None
    else:
        overrides = {"layers": ns.layers, "batch": ns.batch, "seq": ns.seq}
        model, plan, secs = plan_model(ns.model, ns.mesh, ns.strategy, overrides, user, ns.cost,
                                       progress=_progress())
        c = model.config
        title = (f"{ns.model}: {c.arch}, {c.layers} layers, hidden {c.hidden}, {c.heads} heads"
                 f"{f' ({c.n_kv} kv)' if c.n_kv != c.heads else ''}, FFN {c.ffn}, vocab {c.vocab}, "
                 f"seq {c.seq}, batch {c.batch}, {c.dtype}; strategy {ns.strategy}")
        model_name = ns.model
    mem = memory_per_device(plan)
    verdict = None
    if ns.verify:
        verdict = _verify(ns, model_name, user)
    if ns.json:
        extra: dict[str, Any] = {"title": title, "plan_seconds": secs}
        if verdict is not None:
            extra["verify"] = verdict
        out.write(json.dumps(plan_json(plan, mem, extra)) + "\n")
    else:
        write_report(plan, out, title, mem, secs)
        if verdict is not None:
            out.write("\n" + verdict["text"] + "\n")
    return 0 if verdict is None or verdict["ok"] else 1


def _verify(ns: argparse.Namespace, model_name: str | None, user: dict[str, Any]) -> dict[str, Any]:
    """The same strategy on the tiny model of the same arch, simulated end to end."""
    try:
        from spmdkit.graph.simulate import simulate_plan
    except ImportError as exc:  # numpy missing
        raise ProgramError(f"--verify needs numpy (pip install 'spmdkit[sim]'): {exc}") from None
    from spmdkit.graph.zoo import preset

    arch = preset(model_name).arch if model_name else "llama"
    tiny = "tiny-llama" if arch == "llama" else "tiny-gpt2"
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


__all__ = ["add_plan_arguments", "plan_model", "run_plan"]


