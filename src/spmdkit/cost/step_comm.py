"""The communication of a training step, op by op, as the framework schedules it: which
collective blocks the op that needs it, which gradient reduction waits for a bucket
(:mod:`spmdkit.cost.buckets`), which TP collective runs under its GEMM (Transformer Engine's
userbuffers, torch's async TP: :mod:`spmdkit.cost.async_tp`, Megatron's async dgrad all-reduce),
which stored parameter's all-gather joins its layer group's prefetched one (FSDP, torchtitan's
units) and which the distributed optimizer runs under the next forward. Read by the step
(:mod:`spmdkit.cost.step`). Standard library only. docs/devices.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from spmdkit.core.dist_attr import entry_dims
from spmdkit.core.reshard import Step
from spmdkit.cost.async_tp import fused_exposed, fused_window, reduce_partials_s
from spmdkit.cost.buckets import MEGATRON_BUCKET_PARAMS, MEGATRON_BUCKET_PARAMS_PER_DP, ROOT_LAYERS
from spmdkit.cost.collectives import buffer_bytes, time_of
from spmdkit.cost.compute import fp8_gathered, local_shape
from spmdkit.cost.context import regathers
from spmdkit.cost.context_torch import TorchCpCost, torch_cp_costs, torch_cp_ops
from spmdkit.cost.devices import Device
from spmdkit.cost.float8_tp import amax_all_reduces, float8_step
from spmdkit.cost.moe import expert_all_to_all, expert_tensors, plan_loads
from spmdkit.cost.step_compute import StepCompute
from spmdkit.ops._cost import numel
from spmdkit.program.plan import Plan, Reshard
from spmdkit.program.runtime import FSDP2

#: a gradient reduction waiting for its bucket: (dtype, the reshard step, bytes per rank)
Pending = tuple[str, Step, int]

#: the exposed share of a TP collective overlapped with its GEMM is one chunk of ``n`` (the
#: pipeline's fill: Wang et al. 2022, "Overlap communication with dependent computation via
#: decomposition"; Transformer Engine's userbuffers and torch's async TP split into tp chunks)


def tp_overlap_exposed(comm_s: float, gemm_s: float, n: int) -> float:
    """The communication a TP all-gather / reduce-scatter of ``comm_s`` still exposes when it
    runs decomposed in ``n`` chunks under its GEMM of ``gemm_s``: ``max(comm, gemm) +
    min(comm, gemm) / n - gemm``."""
    n = max(1, n)
    return max(comm_s, gemm_s) + min(comm_s, gemm_s) / n - gemm_s


#: Transformer Engine's userbuffers (Megatron's ``--tp-comm-overlap``) run the reduce-scatter
#: overlaps (the forward's ``pipeline`` method after proj / fc2, the backward's ``bulk`` one under
#: the wgrad GEMMs) as kernels on ``num_sm`` SMs beside the GEMM: TE's default is 16
#: (transformer_engine/pytorch/module/base.py ``initialize_ub``: ``add_ub(..., num_sm=16)``; NeMo's
#: H100 configs 16-24); the all-gathers ring-exchange their chunks peer to peer (copy engines)
UB_COMM_SMS = 16


def ub_sm_tax(framework: str, sms: int) -> float:
    """The extra GEMM time per second of a TP reduce-scatter overlapped with it under
    ``framework`` (megatron: the GEMM keeps ``sms - UB_COMM_SMS`` of the GPU's ``sms`` while the
    collective runs, ``UB_COMM_SMS / (sms - UB_COMM_SMS)``); 0 for the others."""
    if framework != "megatron" or sms <= UB_COMM_SMS:
        return 0.0
    return UB_COMM_SMS / (sms - UB_COMM_SMS)


def overlap_exposed(comm_s: float, gemm_s: float, n: int, tax: float = 0.0) -> float:
    """:func:`tp_overlap_exposed` with the GEMM slowed while the collective runs on ``tax`` of its
    time in SMs (:func:`ub_sm_tax`): the seconds beyond the GEMM's own."""
    slow = min(comm_s, gemm_s) * tax
    return tp_overlap_exposed(comm_s, gemm_s + slow, n) + slow


def layer_groups(plan: Plan) -> list[int]:
    """Per op, the index of its run of consecutive ops with one (layer tag, phase): the unit
    FSDP gathers a block's parameters for."""
    out: list[int] = []
    prev: tuple[str, str] | None = None
    g = -1
    for op in plan.program.ops:
        key = (op.layer, op.phase)
        if key != prev:
            g += 1
            prev = key
        out.append(g)
    return out


def param_gather_time(plan: Plan, items: list[tuple[tuple[int, ...], float, int]]) -> float:
    """Megatron's distributed optimizer all-gathers the updated parameters in its DDP buckets
    (``max(40M, 1M x dp)`` parameters in their own dtype), one after the other: the seconds of
    those all-gathers, ``items`` as (mesh dims, bytes, itemsize)."""
    by: dict[tuple[tuple[int, ...], int], float] = {}
    for dims, b, itemsize in items:
        by[(dims, itemsize)] = by.get((dims, itemsize), 0.0) + b
    total = 0.0
    for (dims, itemsize), b in by.items():
        dp = math.prod(plan.mesh.shape[d] for d in dims)
        cap = max(MEGATRON_BUCKET_PARAMS, MEGATRON_BUCKET_PARAMS_PER_DP * dp) * itemsize
        full, rest = divmod(b, cap)
        total += full * time_of(plan.cost, "all_gather", dims, cap, plan.mesh.shape)
        total += time_of(plan.cost, "all_gather", dims, rest, plan.mesh.shape) if rest else 0.0
    return total


@dataclass
class StepComm:
    """The plan's reshards by op: the blocking ones (seconds before op i), the gradient
    reductions by the op that makes the gradient, and the seconds per phase (every collective,
    overlapped or not); the TP collectives overlapped with a GEMM (op i: (seconds, the GEMM's
    op, group size)); the stored parameters' all-gathers per layer group (FSDP prefetch:
    group -> (seconds, the group's first op that needs them))."""

    blocking: dict[int, float]
    pending: dict[int, list[Pending]]
    by_phase: dict[str, float]
    tp: dict[int, list[tuple[float, int, int, str]]] = field(default_factory=dict)
    prefetch: dict[int, tuple[float, int]] = field(default_factory=dict)
    #: the distributed optimizer's all-gathers of updated parameters (Megatron: op -> (mesh
    #: dims, bytes, itemsize)), overlapped with the next step's forward
    param_gathers: dict[int, list[tuple[tuple[int, ...], float, int]]] = field(default_factory=dict)
    #: an allgather cp attention under torch's context_parallel: its own all-gather and dK / dV
    #: ring in place of the plan's reshards (:mod:`spmdkit.cost.context_torch`): op -> its cost
    under: dict[int, TorchCpCost] = field(default_factory=dict)
    #: a TP reduce-scatter's SM share taken from the GEMM it overlaps (:func:`ub_sm_tax`)
    rs_tax: float = 0.0
    #: the gradient reductions of ``pending`` the framework runs in every micro-step's backward,
    #: not only the last one's (:meth:`spmdkit.program.plan.Plan.reduced_each_microstep`)
    pending_each: dict[int, list[Pending]] = field(default_factory=dict)
    #: (op, index in ``pending[op]``) of the reductions a pipeline's stages run in every
    #: microbatch's backward (``reduced_each_microstep`` with ``pipeline``: Megatron-FSDP's)
    pipeline_each: set[tuple[int, int]] = field(default_factory=set)
    #: torch's async TP: the seconds op i waits on the fused all-gather-matmuls /
    #: matmul-reduce-scatters beyond their GEMMs (:mod:`spmdkit.cost.async_tp`)
    fused: dict[int, float] = field(default_factory=dict)
    #: the part of ``blocking`` that is a MoE layer's expert-parallel all-to-all (its tokens
    #: dispatched or combined, or their gradients): op -> seconds (``--ep-comm-overlap``)
    ep_a2a: dict[int, float] = field(default_factory=dict)
    #: each layer group's stored-parameter all-gathers (``prefetch``'s): (tensor, mesh dims) -> bytes
    gathers: dict[int, dict[tuple[str, tuple[int, ...]], float]] = field(default_factory=dict)

    def exposed(self, i: int, times: list[float]) -> float:
        """Seconds op i waits on its blocking and TP-overlapped collectives (a reduce-scatter's
        GEMM slowed by the SMs it takes: :func:`overlap_exposed`)."""
        t = self.blocking.get(i, 0.0) + self.fused.get(i, 0.0)
        for c, j, n, kind in self.tp.get(i, ()):
            t += overlap_exposed(c, times[j], n, self.rs_tax if kind == "reduce_scatter" else 0.0)
        u = self.under.get(i)
        return t + (u.exposed_s if u is not None else 0.0)


def _producers(plan: Plan) -> dict[str, int]:
    producer: dict[str, int] = {}
    for i, op in enumerate(plan.program.ops):
        for n in op.output_names():
            producer.setdefault(n, i)
    return producer


#: the backward rules of GEMMs with a weight: the input's gradient and the weight's, one GEMM each
#: of the same FLOPs (``dX = dY W^T``, ``dW = X^T dY``; spmdkit.planner.zero_bubble.GEMM_GRADS)
WGRAD_RULES = frozenset({"matmul_grad", "bmm_grad", "linear_v2_grad", "fused_gemm_epilogue_grad"})


def dgrad_wgrad_s(plan: Plan, times: list[float], tensor: str, producer: dict[str, int],
                  wgrads: frozenset[str]) -> float:
    """The seconds of the weight-gradient GEMMs a tensor-parallel all-reduce of the input
    gradient ``tensor`` runs beside under Megatron's ``async_tensor_model_parallel_allreduce``
    (megatron/mpu/layers ``LinearWithGradAccumulationAndAsyncAllreduce.backward`` from 16c90445e7:
    the dgrad GEMM, ``all_reduce(grad_input, async_op=True)``, the wgrad GEMM, ``handle.wait()``):
    half of each GEMM backward that made ``tensor`` (or the partial input gradients an ``add_n``
    summed into it: q, k and v are one linear in Megatron) and a weight's gradient (``wgrads``);
    0 where no such GEMM made it."""
    prog = plan.program
    j = producer.get(tensor, -1)
    if j < 0:
        return 0.0
    made = [j]
    if prog.ops[j].rule == "add_n":
        made = [producer[n] for n in prog.ops[j].input_names() if n in producer]
    return sum(0.5 * times[k] for k in made if prog.ops[k].phase == "backward" and prog.ops[k].rule in WGRAD_RULES
               and any(n in wgrads for n in prog.ops[k].output_names()))


def _partial_wgrads(plan: Plan, param_grads: frozenset[str]) -> frozenset[str]:
    """The parameter gradients and the partial ones an ``add_n`` sums into one (a tied weight's)."""
    out = set(param_grads)
    for op in reversed(plan.program.ops):
        if op.phase == "backward" and op.rule == "add_n" and any(n in out for n in op.output_names()):
            out.update(op.input_names())
    return frozenset(out)


def _adjacent_gemm(plan: Plan, comp: StepCompute, tensor: str, i: int, producer: dict[str, int],
                   readers: dict[str, list[int]]) -> int:
    """The GEMM a TP collective of ``tensor`` (at op ``i``) overlaps: op i, the op that made the
    tensor, the first op that reads it, or a GEMM feeding the sum that made it (the dgrad GEMMs
    of q, k, v summed before their reduce-scatter); -1 if none."""
    j = producer.get(tensor, -1)
    cands = [i, j, *readers.get(tensor, ())[:1]]
    if j >= 0:
        cands += [producer.get(nm, -1) for nm in plan.program.ops[j].input_names()]
    return next((c for c in cands if c >= 0 and comp.costs[c].matmul), -1)


def distributed_optimizer_grads(plan: Plan) -> dict[str, frozenset[int]]:
    """Megatron's distributed optimizer (``framework`` megatron, ZeRO-1/2: the optimizer reads a
    gradient sharded over the data-parallel dims): it reduce-scatters the gradient buffer into
    each rank's shard rather than all-reducing it (Megatron-LM docs/distrib_optimizer.md), half
    the bytes of an all-reduce. Gradient -> the mesh dims the optimizer reads it sharded over."""
    out: dict[str, frozenset[int]] = {}
    if plan.runtime.framework != "megatron":
        return out
    prog = plan.program
    for op_plan in plan.ops:
        if op_plan.op.phase != "optimizer":
            continue
        name, need = op_plan.op.inputs.get("grad"), op_plan.required.get("grad")
        if not isinstance(name, str) or need is None or prog.tensors[name].kind != "gradient":
            continue
        out[name] = frozenset(d for e in need.dims_mapping for d in entry_dims(e))
    return out


def is_grad_sync(plan: Plan, r: Reshard, s: Step, param_grads: frozenset[str]) -> bool:
    """A parameter gradient's reduction: before its optimizer update, or (ZeRO-1/2/3, the
    gradient held reduced) right after the backward op that makes it."""
    prog = plan.program
    if s.kind not in ("all_reduce", "reduce_scatter") or prog.tensors[r.tensor].kind != "gradient":
        return False
    if not r.output:
        return bool(prog.ops[r.op_index].phase == "optimizer")
    return r.tensor in param_grads


def communication(plan: Plan, comp: StepCompute, device: Device) -> StepComm:
    """Gradient reductions (:func:`is_grad_sync`) go to the op that makes the gradient (they
    wait for a bucket); a stored parameter's all-gather (ZeRO-3 / FSDP: ``plan.storage``) joins
    its layer group's one all-gather, prefetched; under ``plan.runtime.tp_comm_overlap`` an
    activation's all-gather / reduce-scatter next to a GEMM (the op that reads it, or the one
    that made it) overlaps that GEMM (under an FSDP2 framework as torch's async TP fuses them:
    :mod:`spmdkit.cost.async_tp`); every other collective blocks the op that needs it."""
    prog = plan.program
    out = StepComm({}, {}, {"forward": 0.0, "backward": 0.0, "optimizer": 0.0})
    producer = _producers(plan)
    groups = layer_groups(plan)
    gathers: dict[int, dict[tuple[str, tuple[int, ...]], float]] = {}
    param_grads = plan.param_grads()
    overlap_tp = plan.runtime.tp_comm_overlap
    torch_tp = overlap_tp and plan.runtime.framework in FSDP2  # torch's async TP (micro-pipeline TP)
    async_ar = plan.runtime.framework == "megatron" and plan.runtime.tp_allreduce_overlap
    wgrads = _partial_wgrads(plan, param_grads) if async_ar else frozenset()
    rs_grads = distributed_optimizer_grads(plan)
    moe_a2a = bool(plan_loads(plan)) or plan.runtime.moe_dispatcher != "alltoall"
    torch_cps = torch_cp_ops(plan)
    under = {c.index: set(c.dims) for c in torch_cps}  # torch's context_parallel gathers K / V itself
    experts = expert_tensors(prog)
    again = regathers(plan)  # allgather attention's K / V gathered again for its grad
    f8 = fp8_gathered(plan)  # --fsdp-float8-all-gather: these weights gathered at 1 byte an element
    readers: dict[str, list[int]] = {}
    if overlap_tp:
        for j, op in enumerate(prog.ops):
            for nm in op.input_names():
                readers.setdefault(nm, []).append(j)
    for k, r in enumerate(plan.reshards):
        if r.shared and k not in again:
            continue
        i = r.op_index
        t = prog.tensors[r.tensor]
        for s in r.plan.steps:
            if s.bytes_per_rank == 0:
                continue
            s = float8_step(plan, r.tensor, s)  # torchao's float8 TP: gathered in float8
            if s.kind == "all_to_all" and moe_a2a:
                # MoE: the busiest ep rank's tokens, by the dispatcher (spmdkit.cost.moe.expert_all_to_all)
                s = replace(s, time_s=expert_all_to_all(plan, r.tensor, s))
            if is_grad_sync(plan, r, s, param_grads):
                size = numel(local_shape(t.shape, s.src)) * t.itemsize
                if s.kind == "all_reduce" and set(s.mesh_dims) <= rs_grads.get(r.tensor, frozenset()):
                    s = replace(s, kind="reduce_scatter")  # Megatron's distributed optimizer
                j = producer.get(r.tensor, i)
                out.pending.setdefault(j, []).append((t.dtype, s, size))
                if plan.grad_accum > 1 and plan.reduced_each_microstep(r, param_grads):
                    out.pending_each.setdefault(j, []).append((t.dtype, s, size))
                if plan.reduced_each_microstep(r, param_grads, pipeline=True):
                    out.pipeline_each.add((j, len(out.pending[j]) - 1))
                continue
            if i in under and s.kind in ("all_gather", "reduce_scatter") and set(s.mesh_dims) <= under[i]:
                continue  # the un-repeated K / V and dK / dV over cp: torch's own below
            out.by_phase[prog.ops[i].phase] += s.time_s
            n = math.prod(plan.mesh.shape[d] for d in s.mesh_dims)
            if s.kind == "all_gather" and r.tensor in plan.storage and not r.output and t.kind == "parameter":
                per = gathers.setdefault(groups[i], {})
                key = (r.tensor, s.mesh_dims)
                per[key] = per.get(key, 0.0) + buffer_bytes(s.kind, s.bytes_per_rank, n) / (t.itemsize if r.tensor in f8 else 1)
                first = out.prefetch.get(groups[i], (0.0, i))[1]
                out.prefetch[groups[i]] = (0.0, min(first, i))
                continue
            if plan.runtime.framework == "megatron" and prog.ops[i].phase == "optimizer" \
                    and s.kind == "all_gather" and t.kind == "parameter":
                out.param_gathers.setdefault(i, []).append((s.mesh_dims, buffer_bytes(s.kind, s.bytes_per_rank, n),
                                                            t.itemsize))
                continue
            if async_ar and s.kind == "all_reduce" and t.kind == "gradient" and r.tensor not in param_grads \
                    and prog.ops[i].phase == "backward":
                w = dgrad_wgrad_s(plan, comp.times, r.tensor, producer, wgrads)
                if w > 0:  # Megatron's async dgrad all-reduce beside its wgrad GEMMs
                    out.blocking[i] = out.blocking.get(i, 0.0) + max(0.0, s.time_s - w)
                    continue
            gemm = -1
            tp_act = s.kind in ("all_gather", "reduce_scatter") and t.kind in ("activation", "gradient") \
                and r.tensor not in param_grads
            if torch_tp and tp_act:
                win = fused_window(plan, comp.costs, comp.times, device, i, r.tensor, s.kind, producer, readers, n)
                if win is not None:
                    red = reduce_partials_s(device, numel(local_shape(t.shape, s.src)) * t.itemsize, n) \
                        if s.kind == "reduce_scatter" else 0.0
                    out.fused[i] = out.fused.get(i, 0.0) + fused_exposed(s.kind, s.time_s, *win, n, red)
                    continue
            elif overlap_tp and tp_act:
                gemm = _adjacent_gemm(plan, comp, r.tensor, i, producer, readers)
            if gemm >= 0:
                out.tp.setdefault(i, []).append((s.time_s, gemm, n, s.kind))
            else:
                out.blocking[i] = out.blocking.get(i, 0.0) + s.time_s
                if s.kind == "all_to_all" and r.tensor in experts:
                    out.ep_a2a[i] = out.ep_a2a.get(i, 0.0) + s.time_s
    for i, t_ in amax_all_reduces(plan).items():  # torchao's float8 TP: each sharded cast's amax over tp
        out.blocking[i] = out.blocking.get(i, 0.0) + t_
        out.by_phase[prog.ops[i].phase] += t_
    for g, per in gathers.items():
        out.prefetch[g] = (_gather_s(plan, per), out.prefetch[g][1])
    out.gathers = gathers
    out.under = torch_cp_costs(plan, comp.times, torch_cps)
    for i, u in out.under.items():
        out.by_phase[prog.ops[i].phase] += u.comm_s
    return out


def _gather_s(plan: Plan, per: dict[tuple[str, tuple[int, ...]], float]) -> float:
    """Seconds of one unit's parameter all-gathers ((tensor, mesh dims) -> bytes): one flat
    all-gather per mesh dims, one after the other."""
    by: dict[tuple[int, ...], float] = {}
    for (_name, dims), b in per.items():
        by[dims] = by.get(dims, 0.0) + b
    return sum(time_of(plan.cost, "all_gather", dims, b, plan.mesh.shape) for dims, b in by.items())


def torchtitan_units(plan: Plan, comm: StepComm) -> dict[int, tuple[float, int]]:
    """``comm.prefetch`` as torchtitan's FSDP2 units gather in a flat step (:data:`ROOT_LAYERS`):
    the root's parameters (the embedding's, the final norm's and the output's) in one all-gather
    before the first op, kept through the backward (no gather of the head's forward or of the root's
    backward groups), and the last transformer block's kept from its forward to its backward (no
    gather of its backward group). A parameter the root's groups share (a tied embedding and output)
    is gathered once. Other frameworks, and a program without a root group: unchanged."""
    if plan.runtime.framework != "torchtitan" or not comm.prefetch:
        return comm.prefetch
    groups = layer_groups(plan)
    tag: dict[int, tuple[str, str]] = {}
    for i, op in enumerate(plan.program.ops):
        tag.setdefault(groups[i], (op.layer, op.phase))
    root = sorted(g for g in comm.prefetch if tag[g][0] in ROOT_LAYERS)
    fwd = [g for g in root if tag[g][1] == "forward"]
    if not fwd:
        return comm.prefetch
    blocks = [g for g in comm.prefetch if tag[g][1] == "forward" and tag[g][0] not in ROOT_LAYERS]
    last = (tag[max(blocks)][0], "backward") if blocks else None
    out = {g: v for g, v in comm.prefetch.items() if g not in root and tag[g] != last}
    merged: dict[tuple[str, tuple[int, ...]], float] = {}
    for g in fwd:
        for key, b in comm.gathers.get(g, {}).items():
            merged[key] = max(merged.get(key, 0.0), b)
    out[fwd[0]] = (_gather_s(plan, merged), comm.prefetch[fwd[0]][1])
    return dict(sorted(out.items()))

