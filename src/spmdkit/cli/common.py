"""The steps the commands share: a model source planned (``spmdkit plan`` and ``spmdkit run``
alike, :func:`plan_source`), the step timed on a device (:func:`step_estimate`), the ``--html``
page and the ``--export`` file written, the ``--auto-time-limit`` checked, and the strategies'
notes printed (:func:`strategy_notes`)."""

from __future__ import annotations

import contextlib
import shlex
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from spmdkit.cli.request import Links, PlanRequest
from spmdkit.core.dist_attr import TensorDistAttr, entry_dims
from spmdkit.core.errors import ProgramError
from spmdkit.core.reshard import CostModel
from spmdkit.cost.compute import guess_tokens
from spmdkit.cost.devices import cost_model, load_device, recost
from spmdkit.cost.memory import Memory, recompute_every, recompute_layers
from spmdkit.cost.memory_saved import recompute_regions
from spmdkit.cost.step import StepEstimate, estimate_step
from spmdkit.models import catalog
from spmdkit.models.source import HFModel, Loaded, ModelSource, Preset, load, pad_vocab, padding_note
from spmdkit.models.zoo import ModelConfig, preset
from spmdkit.outputs.export import export_plan
from spmdkit.outputs.export_torch import export_torch
from spmdkit.outputs.export_torch_run import note as torch_export_note
from spmdkit.outputs.html import save_html
from spmdkit.planner.auto import AutoInfo
from spmdkit.planner.ep_overlap import apply_flat_overlap, check_ep_comm_overlap
from spmdkit.planner.planning import clip_repr, parse_size, plan_preset, plan_program
from spmdkit.program.ir import Program
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import Runtime
from spmdkit.strategies.context import hf_cp
from spmdkit.strategies.experts import moe_layers, tp_chunks
from spmdkit.strategies.strategy import parse_mesh, parse_strategy, strategy_items


def catalog_batch(model: str | None, dp: int, batch: int | None) -> int | None:
    """The batch a catalog model is planned at when ``--batch`` is not given: its entry's batch
    rounded up to a multiple of ``dp`` (the mesh's ``dp`` dim, :func:`mesh_dp`; for ``--devices
    N``, N: the largest dp the search can try), so each data-parallel rank gets whole sequences
    (llama3.1-405b on dp=8: 8, one sequence per rank, as Megatron's micro-batch-size 1), not a
    batch of 1 cut into empty shards. ``batch`` when given; None (the model's own) for presets
    and configs."""
    if batch is not None or not model or catalog.lookup(model) is None:
        return batch
    return -(-preset(model).batch // dp) * dp


def mesh_dp(mesh_text: str, strategy_text: str | None = None) -> int:
    """The data-parallel ranks of the mesh: its ``dp`` dim times its ``ep`` dim (expert
    parallelism is carved out of data parallelism: outside the experts the batch is split over
    ``dp x ep``), the ``dp`` dim alone where ``strategy_text`` carves ep from the cp ranks
    (``ep-from=cp``: outside the experts ep splits the sequence); 1 without either."""
    mesh = parse_mesh(mesh_text)
    sizes = dict(zip(mesh.dim_names, mesh.shape))
    from_cp = "ep-from=cp" in {s.strip() for s in (strategy_text or "").split(",")}
    return sizes.get("dp", 1) * (1 if from_cp else sizes.get("ep", 1))


def mesh_tp(mesh_text: str) -> int:
    """The tensor-parallel ranks of the mesh: its ``tp`` dim (1 without one), what Megatron-LM pads
    the vocabulary by (``--make-vocab-size-divisible-by`` x tp)."""
    mesh = parse_mesh(mesh_text)
    return dict(zip(mesh.dim_names, mesh.shape)).get("tp", 1)


def plan_source(source: ModelSource, mesh_text: str, strategy_text: str | None, user: dict[str, Any],
                patterns: dict[str, str] | None = None, cost_text: str | None = None,
                progress: Any = None, grad_accum: int = 1) -> tuple[Loaded, Plan, float]:
    """(the loaded model, its plan, seconds) of ``source`` on a mesh under a strategy (default
    megatron for a preset or a HuggingFace model, none for a program file: its annotations
    alone); ``progress``: a preset's propagation callback; ``grad_accum``: micro-steps per
    optimizer step (``--grad-accum``), part of the plan."""
    source = pad_vocab(source, mesh_tp(mesh_text))  # --make-vocab-size-divisible-by: as Megatron pads it
    if isinstance(source, Preset):
        loaded, plan, secs = plan_preset(source.name, mesh_text, strategy_text or "megatron", source.overrides(),
                                         user, cost_text, progress, grad_accum)
        note = padding_note(source)  # the report's line saying the vocabulary was padded
        if note:
            loaded = replace(loaded, title=f"{loaded.title}\n{note}")
            plan.program.vocab_padding = source.vocab_padding  # the exports state it
        return loaded, plan, secs
    t0 = time.perf_counter()
    if isinstance(source, HFModel):
        strategy_text = strategy_text or "megatron"
        mesh = parse_mesh(mesh_text)
        st = parse_strategy(strategy_text, mesh)  # refuse a bad mesh / strategy before importing
        # cp: traced in the cp ranks' token order; megatron,sp,ep,etp=1: routed one chunk a tp rank
        source = replace(source, cp=hf_cp(mesh, st, source.seq), tp_chunks=tp_chunks(mesh, st))
    loaded = load(source)
    _prog, plan = plan_program(loaded.program, mesh_text, strategy_text, user, patterns, cost_text, grad_accum)
    return loaded, plan, time.perf_counter() - t0


def idle_dims(plan: Plan) -> list[str]:
    """The mesh dims of two or more ranks that no tensor of ``plan`` is sharded or partial over,
    held, stored or read by an op (``name=size``): their ranks repeat the same work, a dim the
    strategy accepted and did not use (``--mesh dp=2,ep=2 --strategy dp`` on a MoE model)."""
    used: set[int] = set()
    todo: list[Any] = [*plan.attrs.values(), *plan.storage.values(), *(o.required for o in plan.ops)]
    while todo:
        a = todo.pop()
        if isinstance(a, TensorDistAttr):
            used.update(d for e in a.dims_mapping for d in entry_dims(e))
            used.update(d for d, _ in a.partial)
        elif isinstance(a, dict):
            todo += a.values()
        elif isinstance(a, (list, tuple)):
            todo += a
    return [f"{n}={k}" for d, (n, k) in enumerate(zip(plan.mesh.dim_names, plan.mesh.shape)) if k > 1 and d not in used]


def warn_idle_dims(plan: Plan, strategy: str | None) -> None:
    """One warning a dim :func:`idle_dims` finds, naming it and the strategy."""
    how = f"--strategy {strategy}" if strategy else "the plan"
    for dim in idle_dims(plan):
        name, _, size = dim.partition("=")
        warnings.warn(f"--mesh {dim}: {how} shards nothing over {name}, so its {size} ranks repeat the same work "
                      f"(give a --strategy that uses {name}, or drop it from --mesh)", stacklevel=2)


def step_estimate(links: Links, plan: Plan, config: ModelConfig | None,
                  recompute: str, timed: bool = True, pipelined: bool = False) -> tuple[Plan, StepEstimate | None]:
    """``--device`` / ``--nodes-of``: the plan with its reshards timed by the device's links
    (``--cost`` applied on top) and the predicted step (None without ``--device`` or
    ``timed``); the plan carries ``--precision`` / ``--framework`` / ``--tp-comm-overlap``
    (its runtime) either way. ``--ep-comm-overlap`` on a plan without a pipeline (not
    ``pipelined``): refused as Megatron-Core refuses it, else its merged steps taken off the step
    (:func:`spmdkit.planner.ep_overlap.apply_flat_overlap`)."""
    plan = replace(plan, runtime=links.runtime())
    check_moe_flags(plan.runtime, bool(moe_layers(plan.program)))
    flat = plan.runtime.ep_comm_overlap and not pipelined
    if flat:
        check_ep_comm_overlap(plan, None, recompute)
    if not links.device and not links.nodes_of:
        return plan, None
    device = load_device(str(links.device)) if links.device else None
    nodes = parse_size("--nodes-of", links.nodes_of, 1 << 20)
    if device is not None and nodes:
        device = replace(device, ranks_per_node=nodes)
    cost = cost_model(plan.mesh, device, nodes)
    if links.cost:
        cost = CostModel.parse(links.cost, plan.mesh, base=cost)  # already checked by parse_cost
    plan = recost(plan, cost)
    if device is None or not timed:
        return plan, None
    tokens = config.batch * config.seq if config is not None else guess_tokens(plan.program)
    est = estimate_step(plan, device, tokens, recompute)
    return plan, apply_flat_overlap(plan, est, recompute) if flat else est


def check_moe_flags(rt: Runtime, moe: bool) -> None:
    """``--moe-skew``, ``--moe-histogram``, ``--moe-dispatcher`` and ``--moe-routing`` describe a
    mixture-of-experts router and its token exchange: on a model without MoE layers (not ``moe``:
    no ``moe_gate_dispatch`` op) they change nothing, so a ProgramError names the flag (as
    ``--ep-comm-overlap`` is refused there) rather than a plan that silently ignores it."""
    given = [flag for flag, on in ((f"--moe-skew {rt.moe_skew:g}", rt.moe_skew != 1.0),
                                   ("--moe-histogram", rt.moe_histogram is not None),
                                   (f"--moe-dispatcher {rt.moe_dispatcher}", rt.moe_dispatcher != "alltoall"),
                                   (f"--moe-routing {rt.moe_routing}", rt.moe_routing != "topk")) if on]
    if given and not moe:
        raise ProgramError(f"{' / '.join(given)}: describes a mixture-of-experts router and its token exchange; the "
                           f"model has no MoE layer (no moe_gate_dispatch op), so it would change nothing")


def block_recompute(prog: Program, recompute: str) -> str:
    """``--recompute full:K`` or ``every:N`` of a plan without a pipeline: ``full`` where they
    recompute every layer of ``prog`` (Megatron-Core's block method with K the layers, torchtitan's
    ``selective_ac_option = "1"``: each layer checkpointed, as full recomputation does), else
    ``recompute``; a ProgramError naming ``--recompute`` where K or N is more than its layers
    (:func:`spmdkit.cost.memory_saved.recompute_regions`)."""
    if (recompute_layers(recompute) is not None or recompute_every(recompute) is not None) and \
            len(recompute_regions(prog, recompute)) == len(recompute_regions(prog, "full")):
        return "full"
    return recompute


def require_simulator() -> None:
    """``--verify`` runs the simulator (:mod:`spmdkit.sim.verify_plan`), which needs numpy: a
    ProgramError saying so where it is missing."""
    try:
        import numpy  # noqa: F401
    except ImportError as exc:
        raise ProgramError(f"--verify needs numpy (pip install 'spmdkit[sim]'): {exc}") from None


def write_html(req: PlanRequest, plan: Plan, title: str, mem: Memory, est: StepEstimate | None,
               config: ModelConfig | None = None, mesh_text: str | None = None, recompute: str | None = None,
               **more: Any) -> None:
    """``--html FILE``: the page of :mod:`spmdkit.outputs.html`, written atomically; a line on stderr.
    ``mesh_text`` / ``recompute``: the full mesh and the recomputation (default ``--mesh`` /
    ``--recompute``; ``--devices`` gives those of the configuration it chose)."""
    path = req.outputs.html
    if not path:
        return
    nodes = parse_size("--nodes-of", req.links.nodes_of, 1 << 20)
    size = save_html(path, plan, title, mem, est, config=config, recompute=recompute or req.recompute or "none",
                     mesh=parse_mesh(mesh_text or req.mesh_text), ranks_per_node=nodes,
                     command=shlex.join(["spmdkit", *req.argv]) if req.argv else "", **more)
    print(f"spmdkit plan: wrote {path} ({size / 1024:.0f} KiB)", file=sys.stderr)


def export_plan_file(req: PlanRequest, plan: Plan, recompute: str = "none", pipeline: Any = None) -> None:
    """``--export FORMAT FILE``: the plan's shardings for another framework (:mod:`spmdkit.outputs.export`);
    ``torch``: with ``recompute`` (the plan's ``--recompute``), and a warning line naming what the file
    does not apply (:func:`spmdkit.outputs.export_torch_run.not_applied`). ``plan``: the one carrying
    the runtime (``--precision``: the file's ``PRECISION``), as :func:`step_estimate` returns it;
    ``pipeline``: a pipeline plan's (full mesh, spec, layers per stage), its stages written by the
    torch file (the callers refuse the other formats for one)."""
    if req.outputs.export:
        fmt, path = req.outputs.export
        if fmt == "torch":
            export_torch(plan, path, shlex.join(["spmdkit", *req.argv]) if req.argv else "", pipeline, recompute)
            torch_export_note(plan, recompute, pipeline is not None, "plan")
        else:
            export_plan(plan, fmt, path)


def auto_time_limit(text: str) -> float:
    """``--auto-time-limit``: seconds in (0, 86400]."""
    try:
        limit = float(text)
    except ValueError:
        raise ProgramError(f"--auto-time-limit: {clip_repr(str(text))} is not a number of seconds") from None
    if not 0 < limit <= 86400:
        raise ProgramError(f"--auto-time-limit: {limit:g} is not between 0 and 86400 seconds")
    return limit


@contextlib.contextmanager
def strategy_notes(command: str) -> Iterator[None]:
    """The strategies' notes (a kv projection replicated over tp, linear layers left
    replicated: a UserWarning starting with ``--``, or with ``configuration`` where the
    ``--devices`` search planned one) printed as one ``spmdkit COMMAND:
    warning: ...`` line each on stderr as they are raised, so before the report; other
    warnings are dropped."""

    said: set[str] = set()  # a note made again (the model read twice) printed once

    def show(message: Any, category: type[Warning], *_args: Any, **_kw: Any) -> None:
        text = " ".join(str(message).split())
        if issubclass(category, UserWarning) and text.startswith(("--", "configuration ")) and text not in said:
            said.add(text)
            print(f"spmdkit {command}: warning: {text}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.simplefilter("always", UserWarning)
        warnings.showwarning = show
        yield


def auto_items(req: PlanRequest) -> list[str]:
    """``--strategy``'s items with ``--auto`` (cp's options alone; the search checks them), flat or a
    pipeline's. ProgramError for a ``--strategy`` with no item or a ``--tp-plan``: the search chooses
    the shardings."""
    items = strategy_items(req.strategy)
    if req.strategy is not None and not items:
        raise ProgramError("--strategy: does not apply with --auto (the search chooses the shardings)")
    if req.model.tp_plan:
        raise ProgramError("--tp-plan: does not apply with --auto (the search chooses the shardings)")
    return items


def auto_json(info: AutoInfo, cap: int | None) -> dict[str, Any]:
    """The ``--json`` "auto" block of an ``--auto`` plan, flat or a pipeline's (``cap``: ``--memory``)."""
    return {"status": info.status, "gap": info.gap, "solve_seconds": info.solve_s,
            "objective_seconds": info.objective_s, "candidates": info.candidates,
            "variables": info.variables, "realized": info.realized, "merged_elementwise": info.merged,
            "folded_layers": info.folded, "merged_ops": info.merged_ops,
            "layers_folded": info.folded_layers, "candidates_seconds": info.candidates_s,
            "memory_cap": cap, "memory_counted": info.memory_bytes,
            "explain": [e.to_json() for e in info.explain]}


__all__ = ["auto_items", "auto_json", "auto_time_limit", "block_recompute", "catalog_batch", "check_moe_flags", "export_plan_file", "idle_dims", "mesh_dp", "mesh_tp", "plan_source", "warn_idle_dims", "step_estimate", "strategy_notes", "write_html"]
