"""Rank side of tests/test_export_torch.py: a ``--export torch`` file applied to a tiny HF model on
gloo processes (spawned by ``torch.multiprocessing``), one forward and backward compared with the
eager model on the whole batch.

Each rank builds the same seeded model twice (``spmdkit.models.hf.build``), runs the whole batch
through the plain one, imports the exported file, makes the mesh it names (``MESH_DIMS``,
``MESH_SHAPE``), calls ``parallelize(model, mesh)`` on the other and runs its dp rank's slice of the
batch (under ``loss_parallel()`` when ``LOSS_PARALLEL``), counting collectives with
``CommDebugMode``. Rank 0 puts (loss, eager loss, the largest gradient difference relative to the
gradient's largest value, where, the collectives counted in the model per phase, all of them).
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib.util
import warnings
from collections import Counter
from typing import Any


def _loss(model: Any, kw: dict[str, Any], parallel: bool) -> Any:
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    inputs = {k: v for k, v in kw.items() if k != "labels"}
    with loss_parallel() if parallel else contextlib.nullcontext():
        logits = model(**inputs).logits
        vocab = logits.shape[-1]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), kw["labels"][:, 1:].reshape(-1))
        loss.backward()
    return loss


def _counter() -> Any:
    """CommDebugMode tolerant of a module object called more than once per forward (tests/test_export.py)."""
    from torch.distributed.tensor.debug import CommDebugMode

    cm = CommDebugMode()
    tracker = cm.advanced_module_tracker
    orig = tracker._fw_set_module_hook

    def tolerant(mod: Any, inputs: Any, output: Any) -> None:
        if len(tracker.parent_list) > 1:
            orig(mod, inputs, output)

    tracker._fw_set_module_hook = tolerant
    return cm


def _name(k: Any) -> str:
    return str(k).rsplit(".", 1)[-1]


def _unfused(plan: Any, name: str, g: Any, mesh: Any) -> Any:
    """A fused weight's (or bias's) gradient in the original order of its output features (the last
    axis of a Conv1D weight [in, out], of a Linear's [out, in] the first): the export reordered them
    (FUSED_QKV, fused_order)."""
    import torch

    mod, _, leaf = name.rpartition(".")
    sizes = next((v for k, v in getattr(plan, "FUSED_QKV", {}).items() if fnmatch.fnmatchcase(mod, k)), None)
    if sizes is None:
        return g
    order = torch.tensor(plan.fused_order(sizes, mesh["tp"].size()))
    out = torch.empty_like(g)
    if leaf == "weight" and g.shape[0] != sum(sizes):  # Conv1D layout [in, out]
        out[:, order] = g
    else:
        out[order] = g
    return out


def _exported(folder: str) -> Any:
    """The exported module ``folder/plan.py``, loaded as a user would."""
    spec = importlib.util.spec_from_file_location("exported_plan", f"{folder}/plan.py")
    assert spec is not None and spec.loader is not None
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    return plan


def _models(cls: str, config: dict[str, Any], batch: int, seq: int) -> tuple[Any, Any, Any]:
    """The eager reference and the model to parallelize (the same seeded weights) and the batch
    (equal token counts per dp rank: the mean of their means is the batch's)."""
    import torch

    from spmdkit.models.hf import build, example_inputs

    ref = build(cls, config, seed=0)
    model = build(cls, config, seed=0)
    torch.manual_seed(1)
    return ref, model, example_inputs(ref, batch, seq, ignored=0.0)


def rank_cases(r: int, world: int, cases: list[tuple[str, str, dict[str, Any]]], batch: int, seq: int,
               out: Any) -> None:
    """:func:`rank_main` for several cases (folder, HF class, config) one after the other in the same
    processes, each on a process group of its own (its folder's file store): one spawn, and one
    import of torch and transformers per rank, for all of them. Rank 0 puts (folder, result) per
    case; a case that raises ends the spawn (every case's test then fails with its error)."""
    for folder, cls, config in cases:
        rank_main(r, world, folder, cls, config, batch, seq, out, tag=folder)


def rank_main(r: int, world: int, folder: str, cls: str, config: dict[str, Any], batch: int, seq: int, out: Any,
              tag: str | None = None) -> None:
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor


    plan = _exported(folder)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=r, world_size=world)
    try:
        ref, model, kw = _models(cls, config, batch, seq)
        ref_loss = _loss(ref, kw, False)
        mesh = init_device_mesh("cpu", tuple(plan.MESH_SHAPE), mesh_dim_names=tuple(plan.MESH_DIMS))
        model = plan.parallelize(model, mesh)
        dims = list(plan.MESH_DIMS)
        sliced = plan.DATA_PARALLEL is not None
        if sliced:  # this rank's slice of the batch
            n, i = plan.MESH_SHAPE[dims.index("dp")], mesh.get_local_rank("dp")
            kw = {k: v.chunk(n)[i] if torch.is_tensor(v) and v.dim() and v.shape[0] == batch else v for k, v in kw.items()}
        with _counter() as comm:
            loss = _loss(model, kw, plan.LOSS_PARALLEL)
        full = loss.full_tensor() if isinstance(loss, DTensor) else loss
        if sliced:
            full = full.detach().clone()
            dist.all_reduce(full, group=mesh.get_group("dp"))
            full = full / plan.MESH_SHAPE[dims.index("dp")]
        refp = dict(ref.named_parameters())
        worst, where = 0.0, ""
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            name = name.replace("._checkpoint_wrapped_module", "")  # a block in checkpoint_wrapper (RECOMPUTE_LAYERS)
            want = refp[name].grad
            swapped = getattr(plan, "CONV1D_AS_LINEAR", ())
            if name.endswith(".weight") and any(fnmatch.fnmatchcase(name[:-7], c) for c in swapped):
                g = g.t()  # a Conv1D swapped for the nn.Linear it equals: [out, in]
            g = _unfused(plan, name, g, mesh)
            if name.endswith(".gate_up_proj") and hasattr(plan, "gate_up_to_hf") and isinstance(p.grad, DTensor):
                g = plan.gate_up_to_hf(g, mesh["tp"].size())  # ExpertsTensorParallel's permuted bank
            rel = ((g - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
            if not rel <= worst:  # NaN counts as worst
                worst, where = rel, name
        root = type(model).__name__
        counts = comm.comm_module_counts
        per_phase = {ph: {_name(k): v for k, v in counts.get(root, {}).get(ph, {}).items() if v}
                     for ph in ("forward", "backward")}
        total = {_name(k): v for k, v in Counter(comm.get_comm_counts()).items() if v}
        if r == 0:
            result = (full.item(), ref_loss.item(), worst, where, per_phase, total)
            out.put(result if tag is None else (tag, result))
    finally:
        dist.destroy_process_group()



def pipeline_rank_main(r: int, world: int, folder: str, cls: str, config: dict[str, Any], batch: int, seq: int,
                       out: Any) -> None:
    """The same for a pipeline export (``PIPELINE``): ``build_pipeline`` on each rank, one
    ``schedule.step`` over the whole batch (its microbatches); every rank puts (rank, the loss on
    the last stage or None, the eager loss, the largest relative gradient difference of its own
    parameters, where, the collectives counted)."""
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel


    plan = _exported(folder)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=r, world_size=world)
    try:
        ref, model, kw = _models(cls, config, batch, seq)
        ref_loss = _loss(ref, {"input_ids": kw["input_ids"], "labels": kw["labels"]}, False)
        mesh = init_device_mesh("cpu", tuple(plan.MESH_SHAPE), mesh_dim_names=tuple(plan.MESH_DIMS))

        def loss_fn(logits: Any, target: Any) -> Any:
            vocab = logits.shape[-1]
            return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), target[:, 1:].reshape(-1))

        schedule = plan.build_pipeline(model, mesh, loss_fn, torch.device("cpu"))
        pp, last = mesh.get_local_rank("pp"), mesh["pp"].size() - 1
        losses: list[Any] = []

        def step(counter: Any) -> None:
            losses.clear()
            model.zero_grad()
            with counter, loss_parallel() if plan.LOSS_PARALLEL else contextlib.nullcontext():
                if pp == 0:
                    schedule.step(kw["input_ids"])
                elif pp == last:
                    schedule.step(target=kw["labels"], losses=losses)
                else:
                    schedule.step()

        # the first step infers the stages' shapes (an autograd.grad the module tracker of CommDebugMode
        # cannot run under); the second, from zero gradients, is counted
        step(contextlib.nullcontext())
        comm = _counter()
        step(comm)
        loss = None
        if losses:
            full = [x.full_tensor() if isinstance(x, DTensor) else x for x in losses]
            loss = float(torch.stack([x.detach() for x in full]).mean())
        container = plan.PIPELINE["layers"]
        mine = [t for t in plan.PIPELINE["stages"][pp] if t.startswith(container + ".")]
        refp = dict(ref.named_parameters())
        worst, where = 0.0, ""
        for name, p in model.named_parameters():
            for j, orig in enumerate(mine):
                if name.startswith(f"{container}.{j}."):
                    name = orig + name[len(f"{container}.{j}"):]
                    break
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            want = refp[name].grad
            rel = ((g - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
            if not rel <= worst:
                worst, where = rel, name
        total = {_name(k): v for k, v in Counter(comm.get_comm_counts()).items() if v}
        out.put((r, loss, ref_loss.item(), worst, where, total))
    finally:
        dist.destroy_process_group()


def cp_probe_rank_main(r: int, world: int, folder: str, out: Any) -> None:
    """torch's ``context_parallel`` on CPU: a causal SDPA of sequence-sharded q / k / v over a 1-D
    cp mesh, under the default SDPA backend and under the math backend; rank 0 puts, for each, the
    exception's type and first line, or None where it ran (the ``--export torch`` refusal of cp
    plans says it does not: ``CP_ON_CPU``)."""
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=r, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        set_rotate_method("allgather")
        got: dict[str, Any] = {}
        for name, backend in (("default", None), ("math", SDPBackend.MATH)):
            torch.manual_seed(0)
            q, k, v = (torch.randn(1, 2, 4 * world, 8) for _ in range(3))
            try:
                with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext(), \
                        context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)
                got[name] = None
            except Exception as exc:  # what torch raises is the outcome
                got[name] = (type(exc).__name__, str(exc).splitlines()[0])
        if r == 0:
            out.put(got)
        dist.barrier()  # neither rank tears its group down while the other still uses it
    finally:
        dist.destroy_process_group()


__all__ = ["cp_probe_rank_main", "pipeline_rank_main", "rank_main"]
