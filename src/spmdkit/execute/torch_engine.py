"""The worker of ``spmdkit run --engine torch``: one rank, started by torch's own launcher
(``python -m torch.distributed.run --standalone --nproc-per-node N -m spmdkit.execute.torch_engine
SPEC``; :mod:`spmdkit.execute.torchrun` writes SPEC and reads what rank 0 leaves).

It builds the HF model from its config (no hub), seeded the same on every rank, applies the
exported plan (``spmdkit plan ... --export torch FILE``; the file defines ``MESH_DIMS``,
``MESH_SHAPE``, ``parallelize(model, mesh) -> model``, ``PLAN_COLLECTIVES`` (functional collective
name -> count per step, or per phase), ``LOSS_PARALLEL``, ``DP_COLLECTIVES`` and ``PIPELINE``: None,
or a dict with ``microbatches``, ``build_pipeline(model, mesh, loss_fn, device) -> schedule`` (the
rank's stage cut from the model in place and parallelized) and ``PLAN_COLLECTIVES_BY_STAGE``),
trains ``steps`` steps on fixed data from the seed, and counts each step's collectives with
torch's ``CommDebugMode`` (:func:`step_collectives`: what the export says a rank issues). Rank 0
then trains the same model on the same data with the same optimizer in one process (torch
eager) and writes the report's facts as JSON.

Each step's data: ``input_ids`` and ``labels`` drawn from ``seed`` and the step's index, the
global batch ``[batch, seq]``, every label counted (no -100), so that the mean of the batch
shards' mean losses is the global batch's mean; the loss is the cross entropy of the logits
against the labels (no shift: the labels are random). The batch is split over the export's
``BATCH_DIMS``, else the dims the plan shards the token ids over (when the run planned it), else
the export's ``DATA_PARALLEL`` dim, else the mesh dims not named ``tp``, ``pp`` or ``cp``
(:func:`batch_split`).

A failure is one line in ``OUT/error.RANK`` and exit status 1; torchrun then ends every rank.
"""

from __future__ import annotations

import contextlib
import faulthandler
import importlib.machinery
import importlib.util
import json
import math
import os
import resource
import sys
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel

from spmdkit.models.hf import build

#: the mesh dims that never split the batch (the rest do, unless the export says BATCH_DIMS)
NOT_BATCH = ("tp", "pp", "cp")

#: c10d's own op names (what FSDP2 and torch.distributed's calls issue) -> the functional
#: collective's name, so that both are counted under one name
_C10D = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
         "_allgather_base_": "all_gather_into_tensor", "allgather_": "all_gather",
         "allgather_into_tensor_coalesced_": "all_gather_into_tensor",
         "_reduce_scatter_base_": "reduce_scatter_tensor", "reduce_scatter_": "reduce_scatter",
         "reduce_scatter_tensor_coalesced_": "reduce_scatter_tensor",
         "alltoall_base_": "all_to_all_single", "alltoall_": "all_to_all", "broadcast_": "broadcast",
         "send": "send", "recv_": "recv", "barrier": "barrier"}


def collective_name(op: Any) -> str:
    """The functional collective's name of an op CommDebugMode counted
    (``torch.ops._c10d_functional.all_reduce`` and ``torch.ops.c10d.allreduce_`` -> ``all_reduce``)."""
    name = str(getattr(op, "__name__", op)).split(".")[-1]
    if name == "default":
        name = str(op).split(".")[-2]
    return _C10D.get(name, name.removesuffix("_inplace"))


def expected_counts(plan: Any, pp_rank: int | None) -> dict[str, int]:
    """The collectives a rank should count per step from the export's ``PLAN_COLLECTIVES``:
    ``{name: count}`` for every rank; keyed by pipeline stage (``{0: {...}, 1: {...}}``) the pp
    rank's; keyed by phase (``{"forward": {...}, "backward": {...}}``) their sum. Names as
    :func:`collective_name` gives them (c10d's ``allreduce_`` is ``all_reduce``)."""
    if not isinstance(plan, dict):
        raise ValueError(f"PLAN_COLLECTIVES is a {type(plan).__name__}, expected a dict")
    if not plan:
        return {}
    if all(isinstance(v, int) for v in plan.values()):
        out: dict[str, int] = {}
        for k, v in plan.items():
            name = _C10D.get(str(k), str(k))
            out[name] = out.get(name, 0) + v
        return {k: v for k, v in sorted(out.items()) if v}
    if all(isinstance(k, int) or str(k).isdigit() for k in plan):
        if pp_rank is None:
            raise ValueError("PLAN_COLLECTIVES is keyed by pipeline stage but the mesh has no pp dim")
        got = {int(k): v for k, v in plan.items()}
        if pp_rank not in got:
            raise ValueError(f"PLAN_COLLECTIVES has no entry for pipeline stage {pp_rank}")
        return expected_counts(got[pp_rank], pp_rank)
    total: dict[str, int] = {}
    for part in plan.values():
        for k, v in expected_counts(part, pp_rank).items():
            total[k] = total.get(k, 0) + v
    return dict(sorted(total.items()))


#: what torch's ``loss_parallel()`` cross entropy issues over tp (the max, the sum of
#: exponentials, the label's logit): the plan counts them inside its vocab-parallel cross entropy
LOSS_PARALLEL_COLLECTIVES = {"all_reduce": 3}


def step_collectives(exp: Any, pp_rank: int | None, pp_size: int = 1) -> dict[str, int] | None:
    """Everything a rank's step should issue by the export: ``PLAN_COLLECTIVES`` (the model's;
    under a pipeline the stage's own, ``PLAN_COLLECTIVES_BY_STAGE[pp_rank]`` where the export
    gives it), ``DP_COLLECTIVES`` (what FSDP2 issues over dp, when the export names it apart) and
    ``LOSS_COLLECTIVES`` (the loss's, outside the model; by default torch's ``loss_parallel``'s
    three all-reduces per microbatch when ``LOSS_PARALLEL``, on the stage that computes the loss).
    None when the export says it cannot tell (``DP_COLLECTIVES = None``: FSDP2 under a pipeline)."""
    model = exp.PLAN_COLLECTIVES
    by_stage = getattr(exp, "PLAN_COLLECTIVES_BY_STAGE", None)
    if pp_rank is not None and by_stage is not None:
        model = by_stage[pp_rank] if isinstance(by_stage, (list, tuple)) else by_stage
    if hasattr(exp, "DP_COLLECTIVES") and exp.DP_COLLECTIVES is None:
        return None
    parts = [model, getattr(exp, "DP_COLLECTIVES", None) or {}]
    loss = getattr(exp, "LOSS_COLLECTIVES", None)
    pipe = getattr(exp, "PIPELINE", None)
    computes_loss = pp_rank is None or pipe is None or pp_rank == pp_size - 1
    if loss is None and bool(getattr(exp, "LOSS_PARALLEL", False)) and computes_loss:
        loss = {k: v * (int(pipe["microbatches"]) if pipe else 1) for k, v in LOSS_PARALLEL_COLLECTIVES.items()}
    total: dict[str, int] = {}
    for part in (*parts, loss or {}):
        for k, v in expected_counts(part, pp_rank).items():
            total[k] = total.get(k, 0) + v
    return dict(sorted(total.items()))


def load_export(path: str) -> Any:
    """The exported plan's module (a Python file), checked for the names the worker reads."""
    loader = importlib.machinery.SourceFileLoader("spmdkit_torch_export", path)  # any file name
    spec = importlib.util.spec_from_loader("spmdkit_torch_export", loader)
    if spec is None or spec.loader is None:
        raise ValueError(f"export {path}: not a Python file")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    missing = [n for n in ("MESH_DIMS", "MESH_SHAPE", "parallelize", "PLAN_COLLECTIVES") if not hasattr(mod, n)]
    if missing:
        raise ValueError(f"export {path}: defines no {', '.join(missing)}")
    if getattr(mod, "PIPELINE", None) is not None and not hasattr(mod, "build_pipeline"):
        raise ValueError(f"export {path}: PIPELINE is set but no build_pipeline(model, mesh, loss_fn, device) is "
                         "defined (this rank's stage, parallelized, and its schedule)")
    return mod


def step_data(seed: int, step: int, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step ``step``: (input_ids, labels), both ``[batch, seq]``."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return ids, torch.randint(0, vocab, (batch, seq), generator=g)


def lm_loss(logits: Any, labels: torch.Tensor) -> Any:
    """Mean cross entropy of ``[b, s, vocab]`` logits against ``[b, s]`` labels (a vocab-sharded
    DTensor under ``loss_parallel``)."""
    return F.cross_entropy(logits.flatten(0, 1).float() if not _is_dtensor(logits) else logits.flatten(0, 1),
                           labels.flatten())


def _is_dtensor(x: Any) -> bool:
    return isinstance(x, DTensor)


def make_optimizer(params: Any, name: str, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=False)
    raise ValueError(f"optimizer {name!r}: expected sgd or adamw")


def eager_losses(spec: dict[str, Any], model: Any) -> list[float]:
    """torch eager: ``model`` trained ``steps`` steps on the global batches, one process."""
    opt = make_optimizer(model.parameters(), spec["optimizer"], spec["lr"])
    vocab = int(spec.get("vocab") or model.config.vocab_size)  # a padded vocabulary: tokens below the real one
    out = []
    for s in range(spec["steps"]):
        ids, labels = step_data(spec["seed"], s, spec["batch"], spec["seq"], vocab)
        loss = lm_loss(model(input_ids=ids, use_cache=False).logits, labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(float(loss.item()))
    return out


def _local_bytes(t: Any) -> int:
    if t is None:
        return 0
    if _is_dtensor(t):
        t = t.to_local()
    return int(t.numel() * t.element_size()) if isinstance(t, torch.Tensor) else 0


def state_bytes(modules: list[Any], opt: torch.optim.Optimizer) -> dict[str, int]:
    """The bytes this rank holds of the parameters, their gradients and the optimizer's state
    (local shards), counted tensor by tensor."""
    params = {id(p): p for m in modules for p in m.parameters()}
    grads = sum(_local_bytes(p.grad) for p in params.values())
    opt_b = sum(_local_bytes(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    return {"parameters": sum(_local_bytes(p) for p in params.values()), "gradients": grads, "optimizer": opt_b}


def batch_split(exp: Any, planned: list[str] | None) -> list[str]:
    """The mesh dims the batch is split over: the export's ``BATCH_DIMS``, else the plan's (what
    its token ids are sharded over, when the run planned it), else the export's ``DATA_PARALLEL``
    dim (none when it is None), else every dim not named tp, pp or cp."""
    got = getattr(exp, "BATCH_DIMS", None)
    if got is None:
        got = planned
    if got is None and hasattr(exp, "DATA_PARALLEL"):  # the export's data parallelism: None, or its dim
        dp = exp.DATA_PARALLEL
        got = [] if dp is None else [dp["mesh_dim"]]
    if got is None:
        got = [d for d in exp.MESH_DIMS if d not in NOT_BATCH]
    unknown = [d for d in got if d not in exp.MESH_DIMS]
    if unknown:
        raise ValueError(f"BATCH_DIMS {list(got)}: {', '.join(unknown)} not in MESH_DIMS {list(exp.MESH_DIMS)}")
    return list(got)


def _batch_slice(mesh: Any, dims: list[str], batch: int) -> slice:
    """This rank's rows of the global batch: split over ``dims`` (major first)."""
    n, idx = 1, 0
    for d in dims:
        size = mesh.size(mesh.mesh_dim_names.index(d))
        idx = idx * size + mesh.get_local_rank(d)
        n *= size
    if batch % n:
        raise ValueError(f"--batch {batch} does not split evenly over the batch mesh dims "
                         f"{' x '.join(dims)} ({n} shards)")
    per = batch // n
    return slice(idx * per, (idx + 1) * per)


class _NoModules:
    """In place of CommDebugMode's module tracker: the counts need none, and torch's tracker
    breaks two things here: it pops its parent once per call of a module object, so a module
    called by every layer (transformers' kernelized ``apply_rotary_pos_emb``) empties its stack,
    and its backward hooks on a stage's input make ``torch.distributed.pipelining``'s
    ``autograd.grad`` fail ("A leaf node was passed to _will_engine_execute_node")."""

    name = "Global"
    is_bw = False
    activation_checkpointing = False

    def __init__(self) -> None:
        self.module_parents_dict: dict[str, set[str]] = {"Global": set()}
        self.module_helper_dict: dict[str, Any] = {"Global": {"depth": 0}}
        self.parent_dict: dict[str, Any] = {}
        self.module_parameters_dict: dict[str, Any] = {}
        self.sharding_dict: dict[str, Any] = {}

    def __enter__(self) -> _NoModules:
        return self

    def __exit__(self, *args: Any) -> None:
        return None


def comm_debug_mode() -> Any:
    """torch's ``CommDebugMode`` counting every collective of the step (its own counts, by op),
    without its per-module tracker (:class:`_NoModules`)."""
    cm = CommDebugMode()  # type: ignore[no-untyped-call]
    cm.advanced_module_tracker = _NoModules()  # type: ignore[assignment]
    return cm


def _counts(mode: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for op, n in mode.get_comm_counts().items():
        name = collective_name(op)
        out[name] = out.get(name, 0) + int(n)
    return {k: v for k, v in sorted(out.items()) if v}


def _train(spec: dict[str, Any], exp: Any, mesh: Any, model: Any, device: torch.device
           ) -> tuple[list[float | None], list[dict[str, int]], dict[str, int]]:
    batch_dims = batch_split(exp, spec.get("batch_dims"))
    rows = _batch_slice(mesh, batch_dims, spec["batch"])
    vocab = int(spec.get("vocab") or model.config.vocab_size)  # a padded vocabulary: tokens below the real one
    pipe = getattr(exp, "PIPELINE", None)
    parallel_loss = bool(getattr(exp, "LOSS_PARALLEL", False))
    schedule = None
    if pipe is not None:
        pp_rank, pp_size = mesh.get_local_rank("pp"), mesh["pp"].size()
        first, last = pp_rank == 0, pp_rank == pp_size - 1
        schedule = exp.build_pipeline(model, mesh, lm_loss, device)  # the stage: the model, cut in place
        modules = [model]
    else:
        model = exp.parallelize(model, mesh)
        modules = [model]
    opt = make_optimizer([p for m in modules for p in m.parameters()], spec["optimizer"], spec["lr"])
    losses: list[float | None] = []
    counts: list[dict[str, int]] = []
    held: dict[str, int] = {}
    for s in range(spec["steps"]):
        ids, labels = step_data(spec["seed"], s, spec["batch"], spec["seq"], vocab)
        ids, labels = ids[rows].to(device), labels[rows].to(device)
        if schedule is not None and pipe is not None and s == 0:
            with loss_parallel() if parallel_loss else contextlib.nullcontext():
                _init_stage(schedule, pipe, first, last, ids, labels)
        mode = comm_debug_mode()
        with mode:
            with loss_parallel() if parallel_loss else contextlib.nullcontext():
                if schedule is not None:  # the last stage's microbatch losses, averaged
                    got: list[Any] = []
                    schedule.step(*([ids] if first else []), target=labels if last else None,
                                  losses=got if last else None)
                    loss = torch.stack([_full(x) for x in got]).mean() if got else None
                else:
                    loss = lm_loss(model(input_ids=ids, use_cache=False).logits, labels)
                    loss.backward()
            opt.step()
        counts.append(_counts(mode))
        held = state_bytes(modules, opt)  # after the update, the gradients still held
        opt.zero_grad(set_to_none=True)
        losses.append(None if loss is None else float(_full(loss).item()))
    return losses, counts, held


def _full(x: Any) -> torch.Tensor:
    out: torch.Tensor = x.full_tensor() if _is_dtensor(x) else x.detach()
    return out


def _init_stage(schedule: Any, pipe: dict[str, Any], first: bool, last: bool, ids: torch.Tensor,
                labels: torch.Tensor) -> None:
    """The stage's shape inference (a forward of one microbatch's metadata between the stages),
    before the counted steps: torch runs it at the first ``step`` otherwise, and its collectives
    are not the step's. (``_initialize_stage`` is the schedule's own call for it.)"""
    m = int(pipe["microbatches"])
    if ids.shape[0] % m:
        raise ValueError(f"this rank's batch of {ids.shape[0]} rows does not split into PIPELINE microbatches {m}")
    init = getattr(schedule, "_initialize_stage", None)
    if init is not None:
        mb = ids.shape[0] // m
        init((ids[:mb],) if first else (), {}, labels[:mb] if last else None)


def _peak(device: torch.device) -> dict[str, Any]:
    """What this rank's peak memory is, honestly named: the process's maximum resident set
    (everything the process touched: Python, torch's libraries, the model) on CPU; the CUDA
    caching allocator's peak of allocated bytes on a GPU."""
    out: dict[str, Any] = {"max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        out["cuda_max_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return out


def run(spec: dict[str, Any]) -> dict[str, Any] | None:
    """One rank's run; rank 0 returns the report's facts, the others None."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = spec["backend"]
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=spec["timeout"]))
    exp = load_export(spec["export"])
    shape = tuple(int(x) for x in exp.MESH_SHAPE)
    if math.prod(shape) != world:
        raise ValueError(f"the export's mesh {dict(zip(exp.MESH_DIMS, shape))} has {math.prod(shape)} ranks, "
                         f"torchrun started {world}")
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=tuple(exp.MESH_DIMS))
    model = build(spec["hf"], spec["config"], dtype=spec["dtype"], seed=spec["seed"]).to(device)
    with torch.no_grad():  # every rank's weights before the plan is applied (the same seed: equal)
        weights_sum = float(sum(p.double().sum() for p in model.parameters()))
    losses, counts, held = _train(spec, exp, mesh, model, device)
    pp_rank = mesh.get_local_rank("pp") if "pp" in exp.MESH_DIMS else None
    pp_size = mesh["pp"].size() if "pp" in exp.MESH_DIMS else 1
    mine = {"rank": rank, "losses": losses, "counts": counts, "state_bytes": held, **_peak(device),
            "expected": step_collectives(exp, pp_rank, pp_size), "pp_rank": pp_rank, "weights_sum": weights_sum}
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    dist.destroy_process_group()
    if rank != 0:
        return None
    ref = build(spec["hf"], spec["config"], dtype=spec["dtype"], seed=spec["seed"])
    eager = eager_losses(spec, ref)
    eager_state = sum(p.numel() * p.element_size() for p in ref.parameters())
    return {"world_size": world, "backend": backend, "mesh": dict(zip(exp.MESH_DIMS, shape)),
            "loss_parallel": bool(getattr(exp, "LOSS_PARALLEL", False)),
            "pipeline": getattr(exp, "PIPELINE", None), "eager": eager,
            "eager_parameter_bytes": eager_state, "ranks": every}


def _one_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0][:400] if lines else '(no message)'}"


def main(argv: list[str] | None = None) -> int:
    """The rank's run from its spec (``argv[0]``): rank 0's facts in ``OUT/result.json``, a
    failure's line in ``OUT/error.RANK``; the exit status. Run as the program (``argv`` None), the
    process then ends at once (:func:`_end_process`), without the interpreter's teardown."""
    rc = _main(sys.argv[1:] if argv is None else argv)
    if argv is None:
        _end_process(rc)
    return rc


def _end_process(rc: int) -> None:
    """``os._exit(rc)`` once stdout and stderr are flushed (what the rank had to write, it has
    written and closed: ``result.json`` atomically, or ``error.RANK``). The interpreter's teardown
    would run with gloo's C++ threads still alive: the DeviceMesh's sub-groups outlive
    ``destroy_process_group`` (4 ``pt_gloo_runloop`` and 2 ``gloo_tcp_loop`` threads on every rank
    of a 2-D mesh, counted in /proc/self/task after it), and it killed a rank at random: SIGABRT,
    ``terminate called without an active exception`` with the main thread past its last Python
    frame (a pipeline's last rank, 2 of about 105 launches under load: docs/export.md). Nothing
    of the rank's is left for an exit handler; the teardown's CPU is saved too."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _main(args: list[str]) -> int:
    warnings.simplefilter("ignore")
    faulthandler.enable()  # a rank killed by SIGABRT / SIGSEGV leaves its Python stacks in its stderr
    with open(args[0], encoding="utf-8") as f:
        spec = json.load(f)
    rank = os.environ.get("RANK", "?")
    try:
        got = run(spec)
    except Exception as exc:  # one line for the launcher; torchrun ends the other ranks
        if os.environ.get("SPMDKIT_TRACEBACK"):
            import traceback

            traceback.print_exc()
        with open(os.path.join(spec["out"], f"error.{rank}"), "w", encoding="utf-8") as f:
            f.write(_one_line(exc) + "\n")
        return 1
    if got is not None:
        tmp = os.path.join(spec["out"], "result.json.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(got, f)
        os.replace(tmp, os.path.join(spec["out"], "result.json"))
    return 0


if __name__ == "__main__":
    main()
