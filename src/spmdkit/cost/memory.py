"""Memory per device of a plan: parameters, gradients, optimizer states, activation peak.

Sizes are local: each tensor's largest shard under its dist attr (a partial tensor is held
whole on every rank), times its dtype's size. Parameters, optimizer states and the
parameter gradients (the gradients the optimizer ops read) are held for the whole step; an
optimizer's updated parameter overwrites its parameter (``inplace_of``) and adds nothing.
Every other tensor (activations, activation gradients, and the copies reshards make) lives
from the op that makes it to the last op that reads it; the activation peak is the largest
sum of live bytes over the program order (one linear pass over the ops).

ZeRO-3 / FSDP (a plan's ``storage``): a parameter counts at its stored shard; the copy each
phase gathers lives over its layer's ops of that phase (from the layer's first op to its last),
so one layer's gathered parameters are live at a time, once in the forward and once in the
backward. With gradient accumulation (``plan.grad_accum`` > 1) a gradient that ZeRO holds
reduce-scattered is held at its shard where the framework reduce-scatters it every micro-step
(:meth:`spmdkit.program.plan.Plan.reduced_each_microstep`: Megatron-FSDP, torchtitan's FSDP2),
and unreduced until the step's one reduction where it does not (NeMo AutoModel's
``set_requires_gradient_sync(is_optim_step)``). What FSDP2 allocates on its own streams stays
reserved in their pools (:mod:`spmdkit.cost.memory_fsdp2`): :attr:`Memory.allocator_reserve`.

``recompute`` (``none``, ``selective``, ``selective:M1,M2``, ``full``; :func:`saved_activations`): a
forward activation that a recomputed region makes and the backward reads lives from its
producer to its last forward reader, and again from the first backward op that reads any of
the region's tensors (the region is run again right before it) to its last reader. A tensor
kept as its producer's shard and gathered again for the backward (sequence parallel's norm
outputs) is held as the shard between its last forward reader and its first backward one.
:attr:`Memory.saved` is what the backward keeps (:func:`saved_activations`).

What the backward keeps of the forward and the regions it runs again (``recompute``'s modes):
:mod:`spmdkit.cost.memory_saved`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr, entry_dims
from spmdkit.cost.checkpoints import (
    MICROBATCH,
    RECOMPUTE,
    check_recompute,
    per_microbatch_mode,
    recompute_every,
    recompute_layers,
    whole_layers,
)
from spmdkit.cost.compute import fp8_layers, gathered_itemsize
from spmdkit.cost.context import regathers, ring_buffers
from spmdkit.cost.context_torch import torch_cp_ops
from spmdkit.cost.loss import FLASH_CE_BYTES, fused_loss
from spmdkit.cost.memory_cp import allgather_buffers, shared_gathers
from spmdkit.cost.memory_fsdp2 import copy_in_pool, makes_no_copy
from spmdkit.cost.memory_merged import merged_curve
from spmdkit.cost.memory_saved import (
    ActivationMemory,
    all_value_inputs,
    recompute_inputs,
    rerun_points,
    saved_activations,
    spans_with_recompute,
    storage_of,
    value_inputs,
)
from spmdkit.cost.moe import plan_loads
from spmdkit.cost.shards import local_numel
from spmdkit.program.ir import Program
from spmdkit.program.plan import Plan


@dataclass(frozen=True)
class UnevenShard:
    """A tensor axis its mesh dims do not divide: ``size`` split in ``parts`` pieces of
    ``largest`` (the first ones) down to ``smallest`` elements (Paddle's uneven split)."""

    tensor: str
    axis: int
    size: int
    parts: int
    mesh_dims: tuple[int, ...]

    @property
    def largest(self) -> int:
        return -(-self.size // self.parts)

    @property
    def smallest(self) -> int:
        return max(0, self.size - self.largest * (self.parts - 1))

    def to_json(self) -> dict[str, object]:
        return {"tensor": self.tensor, "axis": self.axis, "size": self.size, "parts": self.parts,
                "mesh_dims": list(self.mesh_dims), "largest": self.largest, "smallest": self.smallest}


def uneven_shards(plan: Plan) -> list[UnevenShard]:
    """Every (tensor, axis) of a plan sharded over mesh dims whose product does not divide the
    axis (tensors in program order). Memory counts the largest shard of each."""
    out: list[UnevenShard] = []
    mesh_shape = plan.mesh.shape
    for name, t in plan.program.tensors.items():
        attr = plan.attrs.get(name)
        if attr is None:
            continue
        for axis, (size, e) in enumerate(zip(t.shape, attr.dims_mapping)):
            dims = tuple(entry_dims(e))
            k = 1
            for d in dims:
                k *= mesh_shape[d]
            if k > 1 and size % k:
                out.append(UnevenShard(name, axis, size, k, dims))
    return out


# -- what the framework holds for the step --------------------------------------------------------

#: bytes the CUDA context takes on each GPU, outside PyTorch's caching allocator (so outside
#: ``torch.cuda.max_memory_reserved``): docs/devices.md, "Memory"
CUDA_CONTEXT_BYTES = 512 * 1024**2
#: bytes NCCL allocates per communicator (process group) outside the caching allocator
NCCL_BYTES_PER_GROUP = 256 * 1024**2
#: the caching allocator's reserve over its allocated peak (blocks cached and fragmented), as
#: a fraction of the activation peak: the memory allocated and freed over and over in a step,
#: in sizes that vary; the parameters, gradient buffers and optimizer states are allocated
#: once, before the first step, and do not fragment
ALLOCATOR_RESERVE = 0.10
def _bytes_per_element(framework: str, precision: str) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer state) bytes per parameter element under Adam, before
    ZeRO sharding. Megatron-LM (docs/api-guide/dist_optimizer.md): a 16-bit parameter, the
    gradient accumulated in fp32 ("main grads"; fp16 keeps fp16 gradients and an fp32 copy
    in the optimizer), an fp32 master copy and two fp32 moments: 2 + 4 + 12 (bf16), 2 + 2 + 16
    (fp16), 4 + 4 + 8 (fp32). torchtitan (FSDP2, MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=fp32)): fp32 parameters and gradients, two fp32 moments, all sharded;
    the bf16 copies it computes with are gathered per layer (the activation curve). NeMo
    AutoModel (its benchmark recipes: the model built in its config's bf16, FSDP2's
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, ``torch.optim.Adam``, whose
    moments take the parameter's dtype): 2 + 2 + 4, the gradient reduced in fp32 and stored in
    bf16 (unreduced under gradient accumulation: accumulated in the fp32 reduce dtype)."""
    if framework == "torchtitan":
        return 4, 4, 8
    if framework == "automodel" and precision != "fp32":
        return 2, 2, 4
    if precision == "fp32":
        return 4, 4, 8
    if precision == "fp16":
        return 2, 2, 16
    return 2, 4, 12  # bf16, and fp8 (TE keeps bf16 parameters; fp8 copies counted apart)


def state_bytes(framework: str, precision: str, grad_dtype: str | None = None,
                optimizer_dtype: str | None = None) -> tuple[int, int, int]:
    """:func:`_bytes_per_element` with ``--grad-dtype`` and ``--optimizer-dtype`` over the
    framework's defaults. ``grad_dtype``: the gradient held (and reduced) in fp32 (4 bytes) or
    bf16 (2; NVIDIA's performance recipes: NeMo 1.0's ``optim.grad_sync_dtype: bf16``, NeMo 2.0's
    ``grad_reduce_in_fp32 = False``). ``optimizer_dtype`` bf16: Adam's two moments in bf16 (4
    bytes) and no fp32 master copy, the bf16 parameter being updated in place (Apex's
    ``DistributedFusedAdam(dtype=bf16)``, NeMo's ``store_params=False`` when the optimizer's dtype
    is the model's); fp32: the framework's fp32 states (automodel: two fp32 moments, 8)."""
    pb, gb, sb = _bytes_per_element(framework, precision)
    if grad_dtype is not None:
        gb = 4 if grad_dtype == "fp32" else 2
    if optimizer_dtype == "bf16":
        sb = 4
    elif optimizer_dtype == "fp32" and framework == "automodel" and precision != "fp32":
        sb = 8  # fp32 moments beside the bf16 parameters
    return pb, gb, sb


def held_for_the_step(plan: Plan) -> dict[str, tuple[int, int, int]]:
    """Parameter -> (parameter, gradient, optimizer-state bytes) it holds for the whole step on
    one device, as ``plan.runtime.framework`` allocates them (:func:`_bytes_per_element`), each
    at its local shard: the parameter as stored (ZeRO-3 / FSDP: its shard), the gradient as
    held (ZeRO-2: reduce-scattered; with gradient accumulation the unreduced gradient, which
    is accumulated, unless the framework reduce-scatters it every micro-step), the states as the optimizer lays them out (ZeRO: sharded over dp).
    ``--precision fp8`` under Megatron-LM: Transformer Engine's fp8 copy of each linear
    weight and its transpose, one byte an element each. An update without Adam moments
    (sgd), and a parameter without an update, count the program's own tensors."""
    prog = plan.program
    attrs = plan.attrs
    rt = plan.runtime

    def numel(n: str, attr: TensorDistAttr | None = None) -> int:
        return local_numel(attr or attrs[n], prog.tensors[n].shape)

    unreduced: dict[str, int] = {}
    if plan.grad_accum > 1:
        pg = plan.param_grads()
        for r in plan.reshards:
            if r.output and not plan.reduced_each_microstep(r, pg):
                unreduced[r.tensor] = max(unreduced.get(r.tensor, 0), numel(r.tensor, r.src))
    linear = set()
    if rt.fp8 and rt.framework == "megatron":
        for op in prog.ops:
            y = op.inputs.get("y")
            if op.phase == "forward" and op.rule == "matmul" and isinstance(y, str) \
                    and prog.tensors[y].kind == "parameter" and len(prog.tensors[y].shape) == 2:
                linear.add(y)
        # not the output head: Megatron-Core's output_layer is tensor_parallel.ColumnParallelLinear (not a
        # Transformer Engine module: megatron.core.models.gpt.gpt_model at d98e8a64dd, unless mxfp8), so it keeps
        # no fp8 copy and runs in bf16, as compute prices it
        linear &= fp8_layers(prog).weights
    out: dict[str, tuple[int, int, int]] = {}
    for op in prog.ops:
        if op.phase != "optimizer":
            continue
        names = op.input_names()
        params = [n for n in names if prog.tensors[n].kind == "parameter" and not prog.tensors[n].inplace_of]
        if not params or params[0] in out:
            continue
        p = params[0]
        t = prog.tensors[p]
        grads = [n for n in names if prog.tensors[n].kind == "gradient"]
        states = [n for n in names if prog.tensors[n].kind == "optimizer_state" and not prog.tensors[n].inplace_of]
        big = [n for n in states if prog.tensors[n].shape == t.shape]
        n_grad = max(numel(grads[0]), unreduced.get(grads[0], 0)) if grads else 0
        if len(big) < 2:  # no Adam moments: the program's own tensors
            out[p] = (numel(p, plan.storage.get(p)) * t.itemsize, n_grad * (prog.tensors[grads[0]].itemsize if grads else 0),
                      sum(numel(n) * prog.tensors[n].itemsize for n in states))
            continue
        pb, gb, sb = state_bytes(rt.framework, rt.precision_of(t.dtype), rt.grad_dtype, rt.optimizer_dtype)
        small = sum(numel(n) * prog.tensors[n].itemsize for n in states if n not in big)
        fp8 = 2 * numel(p) if p in linear else 0
        if rt.framework == "automodel" and grads and unreduced.get(grads[0], 0) > numel(grads[0]):
            gb = 4  # FSDP2 accumulates the unsharded gradient in its fp32 reduce dtype
        out[p] = (numel(p, plan.storage.get(p)) * pb + fp8, n_grad * gb, numel(big[0]) * sb + small)
    return out


def communicators(plan: Plan, pp: int = 1) -> int:
    """The NCCL communicators a rank holds: one per mesh dim of more than one rank, one more
    for the pipeline's sends (``pp`` > 1)."""
    return sum(1 for s in plan.mesh.shape if s > 1) + (1 if pp > 1 else 0)


@dataclass(frozen=True)
class Memory:
    """Bytes per device. ``total``: what the step allocates at its peak (PyTorch's
    ``torch.cuda.max_memory_allocated``); ``reserved``: with the caching allocator's reserve
    (``max_memory_reserved``, what torchtitan logs as its memory); ``device_total``: with the
    CUDA context and NCCL's buffers, which no PyTorch counter sees (what the GPU must hold)."""

    parameters: int
    gradients: int
    optimizer_states: int
    activation_peak: int
    peak_op: int
    #: the activations the backward keeps
    saved: ActivationMemory | None = None
    #: the live activation bytes while each op runs (program order; the peak is their maximum)
    curve: tuple[int, ...] = field(default=(), repr=False, compare=False)
    #: the caching allocator's cached and fragmented blocks beyond the allocated peak
    allocator_reserve: int = 0
    #: the CUDA context and NCCL's buffers (outside the caching allocator)
    runtime_overhead: int = 0
    #: whose allocation conventions these are (``plan.runtime.framework``)
    framework: str = ""

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states + self.activation_peak

    @property
    def reserved(self) -> int:
        return self.total + self.allocator_reserve

    @property
    def device_total(self) -> int:
        return self.reserved + self.runtime_overhead

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"parameters": self.parameters, "gradients": self.gradients,
                             "optimizer_states": self.optimizer_states, "activation_peak": self.activation_peak,
                             "peak_op": self.peak_op, "total": self.total, "allocator_reserve": self.allocator_reserve,
                             "reserved": self.reserved, "runtime_overhead": self.runtime_overhead,
                             "device_total": self.device_total, "framework": self.framework}
        if self.saved is not None:
            d["saved_for_backward"] = {k: v for k, v in self.saved.to_json().items() if k != "tensors"}
        return d


def with_overheads(parameters: int, gradients: int, states: int, activations: int, peak_op: int, plan: Plan,
                   pp: int = 1, saved: ActivationMemory | None = None, curve: tuple[int, ...] = (),
                   pools: int = 0) -> Memory:
    """A :class:`Memory` with the allocator's reserve (:data:`ALLOCATOR_RESERVE` of the
    activation peak, and ``pools``: bytes other streams' pools hold reserved, FSDP2's:
    :mod:`spmdkit.cost.memory_fsdp2`, :mod:`spmdkit.planner.pipeline_memory`) and the CUDA
    context and NCCL buffers (:func:`communicators`) added."""
    return Memory(parameters, gradients, states, activations, peak_op, saved, curve,
                  round(ALLOCATOR_RESERVE * activations) + pools,
                  CUDA_CONTEXT_BYTES + NCCL_BYTES_PER_GROUP * communicators(plan, pp), plan.runtime.framework)


def fit_verdict(need: int, capacity: int) -> tuple[bool, str]:
    """(fits, the sentence): ``need`` bytes per device (:attr:`Memory.device_total`: the
    allocated peak with the allocator's reserve, the CUDA context and NCCL's buffers, the
    headroom real runs need) against a device of ``capacity`` bytes."""
    gib = 1024**3
    cap = f"{capacity / gib:.2f}".rstrip("0").rstrip(".")  # 80 GiB as 80, a 2 GB cap as 1.86 (it read 2)
    share = f"{100 * need / capacity:.0f}% of {cap} GiB" if capacity else "no capacity"
    if need <= capacity:
        return True, f"fits with {(capacity - need) / gib:.1f} GiB headroom ({share})"
    return False, f"does not fit by {(need - capacity) / gib:.1f} GiB ({share})"


# -- the activation curve -------------------------------------------------------------------------


def root_reshard(plan: Plan) -> int:
    """The op after which FSDP2's root group (the parameters outside the transformer blocks:
    embedding, final norm, head) is resharded: the backward's last (0: not FSDP2). Without a
    pipeline (whose stages keep every parameter gathered: :mod:`spmdkit.planner.stage_costs`)."""
    if not plan.runtime.fsdp2:
        return 0
    return max((i for i, op in enumerate(plan.program.ops) if op.phase == "backward"), default=0)


def _transient_uses(prog: Program) -> list[tuple[str, ...]]:
    """Per op, the tensors it makes or reads the values of that are not held for the step (the
    parameters, their gradients and states, the inputs): what :func:`activation_deltas` counts."""
    param_grads, vin = prog.param_grads(), all_value_inputs(prog)
    held = {n for n, t in prog.tensors.items()
            if n in param_grads or t.inplace_of or t.kind in ("parameter", "optimizer_state", "input")}
    return [tuple(n for n in (*op.output_names(), *vin[i]) if n not in held) for i, op in enumerate(prog.ops)]


def _merge_views(uses: dict[tuple[int, str], list[int]], storage: Callable[[str, int], tuple[str, bool]],
                 split: Collection[str], nbytes: Callable[[str], int]) -> None:
    """A view lives in its base's storage (``storage``:
    :func:`~spmdkit.cost.memory_saved.storage_of`): in each group where the view is made (not a
    view a stage received), its first and last use join its base's and it is not counted again
    (not where either's life is split, ``split``)."""
    for (g, n), span in list(uses.items()):
        base = storage(n, g)[0]
        if base == n or n in split or base in split:
            continue
        life = uses.get((g, base))
        if life is not None and nbytes(n) == nbytes(base):
            life[0], life[1] = min(life[0], span[0]), max(life[1], span[1])
            del uses[(g, n)]


def activation_deltas(plan: Plan, saved: ActivationMemory, group_of: list[int] | None = None,
                      groups: int = 1) -> list[dict[int, int]]:
    """Per group of ops (a pipeline stage; one group: the whole step), op index -> the change
    of the live transient bytes there (a tensor starts counting at the op that makes it and
    stops after the last op of the group that reads its values; recomputation, re-gathers and
    fp8 stashes split that life: :func:`spans_with_recompute`). A tensor several groups use is
    counted in each, from its first to its last use there (a stage holds what it received); a
    view is its base's storage, living from the first to the last use of either (:func:`_merge_views`).
    Copies made by reshards live from the first op that reads them to the last (the K / V an
    allgather cp attention gathers: in each pass alone, gathered again for its grad,
    :func:`spmdkit.cost.context.regathers`); an annotated output's own copy, resharded after its
    op and read again in that layout (alltoall attention's head-layout output, which its grad
    reads: Transformer Engine's ``out_part``, DeepSpeed's local attention's saved output), from
    that op to the reader (unless the op is recomputed); a ZeRO-3 /
    FSDP parameter gathered for its layer's ops of one phase lives from the start of the layer
    before (the next layer's all-gather is prefetched while one layer computes, as FSDP2 and
    DeepSpeed do) to its layer's last op. Parameter gradients, parameters and optimizer states
    are held for the step (:func:`held_for_the_step`), not counted here."""
    prog = plan.program
    attrs = plan.attrs
    grp = group_of or [0] * len(prog.ops)

    sizes: dict[str, int] = {}
    load = plan_loads(plan)  # MoE: the busiest ep rank's tokens (spmdkit.cost.moe)

    def nbytes(name: str, attr: TensorDistAttr | None = None) -> int:
        t = prog.tensors[name]
        if attr is not None:  # a gathered copy (--fsdp-float8-all-gather: 1 byte an element)
            return round(local_numel(attr, t.shape) * gathered_itemsize(plan, name) * load.get(name, 1.0))
        b = sizes.get(name)
        if b is None:
            b = sizes[name] = round(local_numel(attrs[name], t.shape) * t.itemsize * load.get(name, 1.0))
        return b

    uses: dict[tuple[int, str], list[int]] = {}
    vin = all_value_inputs(prog)
    for i, names in enumerate(prog.derived("memory.transient_uses", _transient_uses)):
        g = grp[i]
        for n in names:
            u = uses.get((g, n))
            if u is None:
                uses[(g, n)] = [i, i]
            else:
                u[1] = i
    for n, at in recompute_inputs(plan, saved).items():  # held until their region runs again
        u = uses.get((grp[at], n))
        if u is not None:
            u[1] = max(u[1], at)
    split = spans_with_recompute(plan, saved)
    _merge_views(uses, storage_of(plan, group_of), split, nbytes)
    deltas: list[dict[int, int]] = [{} for _ in range(groups)]

    def add(g: int, a: int, e: int, size: int) -> None:
        d = deltas[g]
        d[a] = d.get(a, 0) + size
        d[e + 1] = d.get(e + 1, 0) - size

    for (g, n), (lo, hi) in uses.items():
        for a, e, size in split.get(n, ((lo, hi, nbytes(n)),)):
            a, e = max(a, lo), min(e, hi)
            if a <= e:
                add(g, a, e, size)
    stored = plan.storage
    blocks, before = _layer_blocks(prog, grp) if stored else ({}, {})
    spans: dict[tuple[int, str, TensorDistAttr, str], list[int]] = {}
    root = root_reshard(plan) if groups == 1 else 0
    held_root: dict[str, tuple[int, TensorDistAttr]] = {}
    again = regathers(plan)  # a cp attention's K / V gathered again for its grad: a copy of its own
    kept = kept_output_reads(plan, saved)
    for k, r in enumerate(plan.reshards):
        if makes_no_copy(plan, r):
            continue
        if not r.output and r.tensor not in vin[r.op_index]:
            continue  # an input its op reads for the shape only (SHAPE_ONLY): no copy is made
        op = prog.ops[r.op_index]
        g = grp[r.op_index]
        if r.tensor in stored and root and not op.layer.startswith("layer"):
            # FSDP2's root group (the embedding, the final norm, the head): gathered when the
            # forward starts and not resharded until the backward ends (FSDPState._lazy_init:
            # "For the root, do not reshard after forward since for training, the parameters
            # would be freed and all-gathered immediately": post_forward_mesh_info = None)
            # (one gathered copy a parameter, however many readers reshard it)
            held_root.setdefault(r.tensor, (g, r.dst))
            continue
        elif r.tensor in stored:
            lo, hi = before[(op.layer, op.phase)], blocks[(op.layer, op.phase)][1]
            key = (g, r.tensor, r.dst, op.phase)
        else:
            # one copy per phase: the plan reshards again for a backward reader (and prices it),
            # so the forward's copy is not held to the backward
            lo = hi = r.op_index
            made = kept.get(k)
            if made is not None and grp[made] == g:
                lo = made  # held from the op that made it (run again right before the grad where recomputed)
            key = (g, r.tensor, r.dst, "again" if k in again else op.phase)
        s = spans.setdefault(key, [lo, hi])
        s[0], s[1] = min(s[0], lo), max(s[1], hi)
    for (g, n, dst, _phase), (a, e) in spans.items():
        add(g, a, e, nbytes(n, dst))
    for n, (g, dst) in held_root.items():
        add(g, 0, root, nbytes(n, dst))
    for i, size in ring_buffers(plan).items():  # ring attention's KV (and dK / dV) blocks in flight
        add(grp[i], i, i, size)
    shared = shared_gathers(plan, rerun_points(plan, saved)[0]) if torch_cp_ops(plan) and not plan.runtime.eager else {}
    for i, size in allgather_buffers(plan, shared).items():  # torch context_parallel's gathered K / V, accumulators
        add(grp[i], i, i, size)
    for i, (a, size) in shared.items():  # under --compile: the recomputed forward's gather, held to the grad
        add(grp[i], a, i, size)
    for i, j, elems in loss_spans(plan):
        held, fwd, bwd = loss_bytes(plan, i)
        add(grp[i], i, j, held * elems)
        add(grp[i], i, i, fwd * elems)
        add(grp[j], j, j, bwd * elems)
    return deltas


def output_copies(plan: Plan, saved: ActivationMemory) -> dict[tuple[str, TensorDistAttr], int]:
    """(tensor, layout) -> the op that made it: an annotated output's own copy, which the op makes
    in that layout and the plan reshards after it; a later reader of that layout shares it, so it
    is kept to that reader (planner/propagate.py: alltoall attention's head-layout output, held
    for its grad: Transformer Engine's ``out_part``, DeepSpeed-Ulysses' local attention's output).
    Not where the reshard makes no copy (:func:`makes_no_copy`: a layout change over a mesh dim of
    one rank, ``dp=1``'s batch entry of a residual add's output): the op's output is that tensor;
    nor where the backward keeps the tensor as that shard and gathers it again (``saved``'s
    ``regathered``: sequence parallelism's norm output, all-gathered after its op, which Megatron
    saves sharded; a reader of the shard, DeepSeek's router beside its shared experts, reads the
    tensor already counted kept, :func:`~spmdkit.cost.memory_saved.saved_activations`)."""
    again = {(n, i) for n, i in saved.regathered}
    return {(r.tensor, r.src): r.op_index for r in plan.reshards
            if r.output and plan.annotations.get(r.tensor) == r.dst and not makes_no_copy(plan, r)
            and (r.tensor, r.op_index) not in again}


def kept_output_reads(plan: Plan, saved: ActivationMemory) -> dict[int, int]:
    """Reshard index -> the op whose kept output copy (:func:`output_copies`) it reads (a later
    reader sharing that layout), where that op is not run again (recomputed): the copy is held
    from that op to the reader."""
    raw = output_copies(plan, saved)
    if not raw:
        return {}
    rerun = {i for region in saved.recomputed for i in region}
    out: dict[int, int] = {}
    for k, r in enumerate(plan.reshards):
        made = raw.get((r.tensor, r.dst)) if r.shared and not r.output else None
        if made is not None and made not in rerun:
            out[k] = made
    return out


def stashed_output_copies(plan: Plan, saved: ActivationMemory, stages: list[int]) -> dict[int, int]:
    """Stage -> the bytes of the :func:`output_copies` one microbatch keeps from its forward to a
    backward reader in the same stage (not where the op that made it runs again, recomputed):
    stash beside :attr:`ActivationMemory.tensors`, which holds each tensor once in its planned
    layout. A pipeline stage holds one per microbatch in flight, as :func:`activation_deltas`
    holds it in the one microbatch's curve."""
    kept = kept_output_reads(plan, saved)
    if not kept:
        return {}
    prog = plan.program
    load = plan_loads(plan)
    vin = all_value_inputs(prog)
    out: dict[int, int] = {}
    seen: set[tuple[str, TensorDistAttr]] = set()
    for k, made in kept.items():
        r = plan.reshards[k]
        s = stages[r.op_index]
        if stages[made] != s or prog.ops[r.op_index].phase != "backward" or \
                (r.tensor, r.dst) in seen or makes_no_copy(plan, r) or r.tensor not in vin[r.op_index]:
            continue
        seen.add((r.tensor, r.dst))
        t = prog.tensors[r.tensor]
        out[s] = out.get(s, 0) + round(local_numel(r.dst, t.shape) * t.itemsize * load.get(r.tensor, 1.0))
    return out


def _layer_blocks(prog: Program, grp: list[int]) -> tuple[dict[tuple[str, str], list[int]], dict[tuple[str, str], int]]:
    """(``(layer, phase)`` -> its first and last op, ``(layer, phase)`` -> the first op of the block
    run before it in the same group of ops, itself where none): where a ZeRO-3 / FSDP parameter's
    gathered copy lives (:func:`activation_deltas`)."""
    blocks: dict[tuple[str, str], list[int]] = {}
    before: dict[tuple[str, str], int] = {}
    prev: dict[str, tuple[str, str]] = {}
    for i, op in enumerate(prog.ops):
        blk_key = (op.layer, op.phase)
        blk = blocks.get(blk_key)
        if blk is None:
            blocks[blk_key] = [i, i]
            p = prev.get(op.phase)
            before[blk_key] = blocks[p][0] if p is not None and grp[blocks[p][0]] == grp[i] else i
            prev[op.phase] = blk_key
        else:
            blk[1] = i
    return blocks, before


#: softmax cross-entropy rules: (forward, the grad rule that reads its softmax)
LOSS_RULES = frozenset({"cross_entropy_with_softmax", "c_softmax_with_cross_entropy"})
#: bytes per logit element the framework's loss holds beyond the program's 16-bit softmax:
#: (from the loss forward to its backward, at the forward only, at the backward only).
#: Megatron-LM: ``vocab_parallel_cross_entropy(logits.float())`` keeps the softmax in fp32 (+2)
#: and computes the gradient in place. torchtitan (eager): ``cross_entropy(pred.float())``
#: keeps log-softmax in fp32 (+2), its forward holds the fp32 copy of the logits (+4), its
#: backward the nll gradient and log-softmax's input gradient in fp32 (+8). NeMo AutoModel's
#: benchmark recipes (``MaskedCrossEntropy(fp32_upcast=False)``): ``cross_entropy`` on the bf16
#: logits, whose backward holds the nll gradient in bf16 (+2) beside the program's.
LOSS_BYTES = {"megatron": (2, 0, 0), "torchtitan": (2, 4, 8), "automodel": (0, 0, 2)}
#: torchtitan's loss over vocab-sharded logits (tp > 1: ``loss_parallel``, on unless
#: ``training.disable_loss_parallel``): torch's DTensor handlers
#: (``torch/distributed/tensor/parallel/loss.py``) run the cross-entropy op by op. Forward
#: ``_log_softmax``: ``shifted = x - max`` and ``exp(shifted)`` in fp32 beside the fp32 copy of
#: the logits (then ``shifted - logsumexp``): 4 bytes more than aten's one log-softmax kernel.
#: Backward ``_nll_loss_and_log_softmax_backward``: ``zeros_like(x)``, ``exp(x)`` and their sum in
#: fp32 beside the saved log-softmax (then times the gradient): 4 more than aten's nll gradient
#: and ``log_softmax_backward``.
LOSS_PARALLEL_BYTES = {"torchtitan": (2, 8, 12)}


def loss_bytes(plan: Plan, i: int) -> tuple[int, int, int]:
    """(held, forward, backward) bytes per logit element of the loss at op ``i``
    (:data:`LOSS_BYTES`, :data:`LOSS_PARALLEL_BYTES` where its logits are vocab-sharded;
    :data:`spmdkit.cost.loss.FLASH_CE_BYTES` under ``--cross-entropy-kernel``)."""
    fw = plan.runtime.framework
    if fused_loss(plan, i):  # flash-attn's kernel, the compiled loss: the 16-bit logits saved, no fp32 copy
        return FLASH_CE_BYTES
    if fw in LOSS_PARALLEL_BYTES:
        attr = plan.attrs[plan.program.ops[i].output_names()[0]]
        if attr.dims_mapping and entry_dims(attr.dims_mapping[-1]):
            return LOSS_PARALLEL_BYTES[fw]
    return LOSS_BYTES[fw]


def loss_spans(plan: Plan) -> list[tuple[int, int, int]]:
    """(loss op, its grad op, local logit elements) for each softmax cross-entropy of ``plan``
    whose softmax is 16-bit (a float32 program's loss holds nothing more)."""
    prog = plan.program
    out = []
    readers: dict[str, int] = {}
    for i, op in enumerate(prog.ops):
        if op.phase == "backward":
            for n in value_inputs(op):
                readers.setdefault(n, i)
    for i, op in enumerate(prog.ops):
        if op.phase != "forward" or op.rule not in LOSS_RULES:
            continue
        soft = op.output_names()[0]
        t = prog.tensors[soft]
        j = readers.get(soft)
        if j is not None and t.itemsize == 2:
            out.append((i, j, local_numel(plan.attrs[soft], t.shape)))
    return out


def peak_of(deltas: dict[int, int], n_ops: int | None = None) -> tuple[int, int, list[int]]:
    """(peak bytes, the op index where it is reached, the curve over ``n_ops`` ops when given)."""
    peak, at, cur = 0, 0, 0
    curve: list[int] = []
    if n_ops is not None:
        for i in range(n_ops):
            cur += deltas.get(i, 0)
            curve.append(cur)
            if cur > peak:
                peak, at = cur, i
        return peak, at, curve
    for i in sorted(deltas):
        cur += deltas[i]
        if cur > peak:
            peak, at = cur, i
    return peak, at, curve


def memory_per_device(plan: Plan, recompute: str = "none") -> Memory:
    """Memory per device of a :class:`spmdkit.program.plan.Plan` under activation
    recomputation ``recompute`` (none, selective, full), as ``plan.runtime.framework``
    allocates it (:func:`held_for_the_step`, :func:`with_overheads`)."""
    saved = saved_activations(plan, recompute)
    prog: Program = plan.program
    held = held_for_the_step(plan)
    counted = set(held)
    params = sum(b[0] for b in held.values()) + sum(
        local_numel(plan.attrs[t.name], t.shape) * t.itemsize for t in prog.tensors.values()
        if t.kind == "parameter" and not t.inplace_of and t.name not in counted)
    grads = sum(b[1] for b in held.values())
    states = sum(b[2] for b in held.values())
    (deltas,) = activation_deltas(plan, saved)
    peak, at, curve = peak_of(deltas, len(prog.ops))
    merged = merged_curve(plan, curve)  # --ep-comm-overlap's merged steps: the partner's layers beside
    if merged is not curve:
        curve = merged
        at = max(range(len(curve)), key=curve.__getitem__)
        peak = curve[at]
    return with_overheads(params, grads, states, peak, at, plan, 1, saved, tuple(curve), copy_in_pool(plan))


__all__ = ["ALLOCATOR_RESERVE", "CUDA_CONTEXT_BYTES", "LOSS_BYTES", "LOSS_PARALLEL_BYTES", "LOSS_RULES", "loss_bytes", "MICROBATCH", "loss_spans", "per_microbatch_mode", "recompute_every", "recompute_layers", "whole_layers", "NCCL_BYTES_PER_GROUP", "RECOMPUTE", "Memory", "UnevenShard", "activation_deltas", "check_recompute", "communicators", "fit_verdict", "held_for_the_step", "kept_output_reads", "local_numel", "makes_no_copy", "memory_per_device", "output_copies", "peak_of", "root_reshard", "stashed_output_copies", "state_bytes", "uneven_shards", "with_overheads"]
