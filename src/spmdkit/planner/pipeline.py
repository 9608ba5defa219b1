"""Pipeline parallelism over a ``pp`` mesh dim: stages, schedules, bubble, send/recv, memory.

A mesh with a ``pp`` dim (``--mesh pp=4,dp=8,tp=8``) splits the decoder layers into ``p`` stages
(``p * v`` virtual stages with ``--virtual-stages v``): evenly by default, balanced by cost
where they do not divide (:func:`spmdkit.planner.pipeline_split.auto_counts`: Llama 3.1 405B's
126 layers on 16 stages 7, 8 x 14, 7), or as ``--stages 20,20,20,20``. The embedding goes with
the first stage, the final norm, LM head and loss with the last; a parameter's optimizer update
with the stage of the parameter. The first and the last (virtual) stage may hold no layer
(``--stages 0,20,20,0``: Megatron-Core's embedding-only first and loss-only last stage; a middle
stage may not). Every model source is cut the same way
(:func:`spmdkit.planner.pipeline_plan.plan_pipeline_source`): its layers are the op labels that
end in a number (a preset's ``layer 3``, an imported model's ``model.layers.3``, a program
file's own), :func:`spmdkit.planner.pipeline_split.op_units`.

Planning. No tensor is ever sharded over ``pp`` (a stage holds its layers whole, and the
other stages hold none of them), so the sharding inside a stage is independent of the pp
dim: the training step of ONE microbatch (batch / m) is built and planned once, whole, on
the sub-mesh without ``pp`` (e.g. ``dp=8,tp=8``), with the same propagation as any plan.
Planning each stage alone would give the same layouts except at the cut, where the whole
program's plan simply fixes the layout the boundary activation is sent in. One propagation
keeps planning linear in the layers (llama-70b on pp=4,dp=8,tp=8: benchmarks/bench_plan.py).

Then every op gets its (virtual) stage from its ``layer`` tag, and per stage this module
sums, for one microbatch: the forward and backward time (each op's roofline time from
:func:`spmdkit.cost.compute.op_cost`, plus the blocking reshards and the collectives
inside its ops), the gradient reductions of its parameters (once per step: gradients are
accumulated over the microbatches and reduced after the last one; Megatron-FSDP's ZeRO-2/3,
which holds them at their shard, reduce-scatters them in every microbatch's backward:
``StageCost.each``, docs/devices.md, "Gradient accumulation under ZeRO"), the optimizer time, the
activations sent to the next stage in the forward and their gradients sent back in the
backward (local bytes under the plan, timed on the ``pp`` link of the device's cost model),
and its memory. The schedule (GPipe, 1F1B, interleaved 1F1B) is then run as an event
simulation over these per-stage times (:mod:`spmdkit.planner.schedules`). The layers' split
into stages: :mod:`spmdkit.planner.partition`.

Memory per device: parameters, gradients and optimizer states of its stages, as the framework
allocates them (:func:`spmdkit.cost.memory.held_for_the_step`; torchtitan under a pipeline
also keeps its FSDP2 parameters gathered and their gradients unsharded in fp32 over the
microbatches), plus the activations of the microbatches it keeps in flight: one microbatch at
its working peak (the liveness peak over the stage's ops, with recomputation, on the same
activation curve as a flat step: :func:`spmdkit.cost.memory.activation_deltas`) and ``n - 1``
more holding what the backward reads (the forward tensors a backward op reads the values
of, at the size they are kept in, in each stage whose backward reads them). ``n``: GPipe ``m``; 1F1B ``min(p - r, m)``
on device ``r``; interleaved, Megatron-LM's warm-up count plus one, ``(p - r - 1) * 2 +
(v - 1) * p + 1`` model chunks (at most ``m v``) of ``1/v`` of the stage each: on the first
device ``p + (p - 1)/v`` stage-microbatches (Narayanan et al. 2021; Korthikanti et al.
2022).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.core.reshard import Step
from spmdkit.cost.band import error_band
from spmdkit.cost.collectives import Fabric, Group, collective_time
from spmdkit.cost.compute import model_flops, op_cost
from spmdkit.cost.context import cp_ops
from spmdkit.cost.devices import Device
from spmdkit.cost.memory import (
    ALLOCATOR_RESERVE,
    MICROBATCH,
    Memory,
    loss_spans,
    per_microbatch_mode,
    recompute_every,
    recompute_layers,
    with_overheads,
)
from spmdkit.cost.moe import a2a_compute_share, load_summary
from spmdkit.cost.step import OpComm, op_communication
from spmdkit.planner.chunk_plan import ChunkOps
from spmdkit.planner.ep_overlap import check_ep_comm_overlap
from spmdkit.planner.partition import UnitCosts, balanced_split, even_split, partition, simulate_split, stage_loads
from spmdkit.planner.pipeline_memory import TORCH_SCHEDULES, ChunkBytes, torch_order, torch_rank_memory
from spmdkit.planner.pipeline_moe import MoeMemory, moe_memory
from spmdkit.planner.pipeline_split import (
    PipelineSpec,
    auto_counts,
    op_stages,
    op_units,
    split_layers,
    split_note,
    stage_layers,
)
from spmdkit.planner.schedules import (
    SCHEDULES,
    ScheduleInputs,
    ScheduleRun,
    bubble_formula,
    in_flight,
    run_schedule,
    schedule_order,
    weight_pending,
)
from spmdkit.planner.stage_costs import (
    Grad,
    StageCost,
    reduce_gradients,
    single_bucket_ranks,
    stage_costs,
    tp_ranks,
)
from spmdkit.program.plan import Plan

# -- the whole pipeline ---------------------------------------------------------------------------


@dataclass
class PipelineEstimate:
    spec: PipelineSpec
    counts: tuple[int, ...]
    stages: list[StageCost]
    pp_link: tuple[float, float]          # (latency s, s per byte)
    send_f_s: list[float]
    send_b_s: list[float]
    in_flight: list[float]
    memory: list[Memory]
    run: ScheduleRun | None = None
    #: the stages' times and sends the schedule was run from (planner.bubble runs it again)
    inputs: ScheduleInputs | None = None
    step_serial_s: float = 0.0
    step_overlap_s: float = 0.0
    tokens: int | None = None
    model_flops: float = 0.0
    ranks: int = 0
    peak: float = 0.0
    device_name: str = ""
    device_memory: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    #: the one-line note of a split chosen for layers that do not divide into the stages
    note: str | None = None
    #: a MoE plan's fullest rank split into experts and the rest (pipeline_moe.moe_memory)
    moe: MoeMemory | None = None
    #: the context-parallel degree of the stages' plan (its error band is the cp runs')
    cp: int = 1
    #: --moe-skew / --moe-histogram: the busiest ep rank's load (:func:`spmdkit.cost.moe.load_summary`)
    moe_load: dict[str, Any] | None = None
    #: per device: the all-reduce of the tied parameters' gradients among the stages holding a copy
    #: (:func:`spmdkit.planner.stage_costs.shared_parameters`), after its gradient reductions
    tied_s: list[float] = field(default_factory=list)
    #: the data-parallel gradient reductions start under the last backward (False: ``--no-grad-overlap``,
    #: after it, :func:`step_times`)
    grad_overlap: bool = True

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.step_overlap_s if self.tokens and self.step_overlap_s > 0 else None

    @property
    def mfu(self) -> float | None:
        if not self.tokens or self.step_overlap_s <= 0 or self.peak <= 0:
            return None
        return self.model_flops / (self.step_overlap_s * self.ranks * self.peak)

    @property
    def tflops_per_gpu(self) -> float | None:
        """Model FLOP/s per GPU (Narayanan et al.'s "achieved teraFLOP/s per GPU" counts the
        recomputation too; this counts the model FLOPs only)."""
        if not self.tokens or self.step_overlap_s <= 0:
            return None
        return self.model_flops / (self.step_overlap_s * self.ranks) / 1e12

    def formula(self) -> float:
        """:func:`spmdkit.planner.schedules.bubble_formula` (ZB-H1: at the stages' mean F, B, W)."""
        s, n = self.spec, max(1, len(self.stages))
        tf = sum(c.forward_s for c in self.stages) / n
        tw = sum(c.weight_s for c in self.stages) / n
        tb = sum(c.backward_s for c in self.stages) / n - tw
        times = (tf, tb, tw) if s.schedule == "zb-h1" and tf + tb + tw > 0 else None
        return bubble_formula(s.schedule, s.pp, s.virtual, s.microbatches, times)

    def to_json(self) -> dict[str, Any]:
        s = self.spec
        out: dict[str, Any] = {
            "pp": s.pp, "microbatches": s.microbatches, "schedule": s.schedule, "virtual_stages": s.virtual,
            **({"microbatch_group": s.group} if s.group is not None else {}),
            "layers_per_stage": list(self.counts), "split_note": self.note, "bubble_formula": self.formula(),
            "pp_link": {"latency_s": self.pp_link[0], "s_per_byte": self.pp_link[1]},
            "stages": [{**st.to_json(), "send_s": self.send_f_s[k], "send_grad_s": self.send_b_s[k - 1] if k else 0.0}
                       for k, st in enumerate(self.stages)],
            "devices": [{"stage": r, "in_flight_microbatches": self.in_flight[r],
                         "tied_grad_sync_s": self.tied_s[r] if self.tied_s else 0.0,
                         "weight_pending_microbatches": weight_pending(s.schedule, s.pp, s.microbatches, r),
                         "memory": self.memory[r].to_json()} for r in range(s.pp)]}
        if self.moe_load is not None:
            out["moe_load"] = self.moe_load
        if "stages_auto" in self.extra:
            out["stages_auto"] = self.extra["stages_auto"]
        if self.moe is not None:
            out["moe_memory"] = self.moe.to_json()
        if "microbatch_recompute" in self.extra:
            out["microbatch_recompute"] = self.extra["microbatch_recompute"]
        if "slowest_gpu" in self.extra:
            out["slowest_gpu"] = self.extra["slowest_gpu"]
        if self.run is not None and self.run.hidden_s:
            out["ep_comm_overlap"] = {"extra_warmup_forwards": 1, "hidden_s": self.run.hidden_s,
                                      "compute_share": self.inputs.a2a_share if self.inputs else 1.0}
        if self.run is not None:
            out.update({"pipeline_s": self.run.pipeline_s, "bubble_s": self.run.bubble_s,
                        "bubble_fraction": self.run.bubble_fraction, "busy_s": self.run.busy_s,
                        "step_serial_s": self.step_serial_s, "step_overlap_s": self.step_overlap_s,
                        "tokens": self.tokens, "tokens_per_s": self.tokens_per_s, "model_flops": self.model_flops,
                        "ranks": self.ranks, "peak_flops": self.peak, "mfu": self.mfu,
                        "model_tflops_per_gpu": self.tflops_per_gpu,
                        "error_band": band.to_json() if (band := error_band(
                            self.device_name, self.cp > 1, self.moe is not None)) is not None else None})
        return out


def estimate_pipeline(plan: Plan, spec: PipelineSpec, counts: tuple[int, ...] | None, device: Device | None = None,
                      pp_link: tuple[float, float] = (20e-6, 1 / 25e9), tokens: int | None = None,
                      ranks: int | None = None, recompute_forward: bool = False,
                      recompute: str = "none", oc: OpComm | None = None, costs: list[StageCost] | None = None,
                      flops: float | None = None) -> PipelineEstimate:
    """The pipeline of ``plan`` (ONE microbatch's step on the sub-mesh without pp).
    ``recompute_forward``: time only, each stage's forward run again before its backward (full
    activation recomputation, as Narayanan et al. 2021 train; benchmarks/megatron_table.py);
    the memory stays that of a step without recomputation. ``recompute`` (``--recompute``):
    the recomputed regions' activations leave each stage's stash and their ops' times are
    added to its backward (:func:`stage_costs`); ``microbatch`` (Korthikanti et al. 2022,
    App. C): each rank keeps every activation of as many of its in-flight microbatches as fit
    in ``device``'s memory and recomputes the attention core of the others, its backward
    paying the selective recomputation for that share of its microbatches. ``counts`` None:
    the layers split by :func:`spmdkit.planner.pipeline_split.auto_counts` (by time on ``device``, else by FLOPs), the split
    named in the estimate's ``note``; ``spec.auto`` (``--stages auto``): :func:`stages_auto`.
    ``oc``: the ops' times on ``device`` when already computed. ``costs`` (with ``counts``): the
    virtual stages' costs already made (:mod:`spmdkit.planner.fold_stages`: a deep pipeline's
    from a shallow copy of the model; ``plan`` then the copy's, no MoE split, no ``microbatch``
    recomputation) and ``flops``: the model FLOPs of one microbatch of the full model."""
    p, v, m = spec.pp, spec.virtual, spec.microbatches
    check_ep_comm_overlap(plan, spec.schedule, recompute)
    if spec.group is not None and plan.runtime.framework != "megatron":
        raise ProgramError(f"--microbatch-group {spec.group}: Megatron-Core's interleaved schedule; --framework "
                           f"{plan.runtime.framework} pipelines with torch.distributed.pipelining, whose "
                           f"ScheduleInterleaved1F1B sets its own rounds of microbatches")
    if device is not None:  # every stage's GPUs step together: the slowest of them all sets the pace
        device = device.lockstep(ranks or plan.mesh.size * p)
    if spec.auto and counts is None:
        return stages_auto(plan, spec, device, pp_link, tokens, ranks, recompute_forward, recompute)
    note = None
    stages: list[int] = []
    if costs is None:
        units = op_units(plan.program)
        if oc is None and device is not None:
            oc = op_communication(plan, device)
        if counts is None:
            times = [a + b for a, b in zip(oc.compute, oc.wait)] if oc is not None else None
            counts = split_layers(units[1], spec, balance=lambda n: auto_counts(plan, n, times, units))
            note = split_note(counts, units[1], spec, times is not None, plan.runtime.framework)
        stages = op_stages(plan.program, counts)
        costs = stage_costs(plan, stages, counts, device, per_microbatch_mode(recompute), oc,
                            stage_layers(plan.program, counts, recompute, p))
    elif counts is None or recompute == MICROBATCH:
        raise ValueError("estimate_pipeline: given costs need their counts, and not microbatch recomputation")
    n = p * v
    send = exchanger(plan, p, pp_link, device)

    tied = _sender(p, pp_link, device, "all_reduce")
    tied_s = [tied(sum(costs[c * p + r].tied_bytes for c in range(v))) for r in range(p)]
    send_f = [send(costs[k].send_bytes, costs[k].send_gathered) if k < n - 1 else 0.0 for k in range(n)]
    send_b = [send(costs[k + 1].send_grad_bytes, costs[k + 1].send_grad_gathered) if k < n - 1 else 0.0
              for k in range(n)]
    overlap = plan.runtime.ep_comm_overlap  # one more warm-up forward (planner.schedules)
    flight = [in_flight(spec.schedule, p, v, m, r, int(overlap), spec.group) for r in range(p)]
    pend = [weight_pending(spec.schedule, p, m, r) for r in range(p)]
    walk = recompute != MICROBATCH and torch_pipelining(plan, spec.schedule, p)
    mems = []
    for r in range(p):  # walked over torch's order where it runs the pipeline, else by in-flight count
        walked = _torch_rank(plan, costs, spec.schedule, p, v, m, r) if walk else None
        if walked is not None:
            mem, flight[r] = walked
        else:
            mem = _rank_memory(plan, [costs[c * p + r] for c in range(v)], flight[r], p, v, pending=pend[r])
        mems.append(mem)
    recomputed = [1.0] * p  # the share of each rank's microbatches whose recomputed regions run again
    if recompute == MICROBATCH:
        whole = stage_costs(plan, stages, counts, None, "none")
        cap = device.memory_bytes if device is not None else 0
        for r in range(p):
            chunks = max(1, round(flight[r] * v))
            mine, full = [costs[c * p + r] for c in range(v)], [whole[c * p + r] for c in range(v)]
            for kept in range(chunks, 0, -1):  # the most microbatch-chunks kept whole that fit
                got = _rank_memory(plan, mine, flight[r], p, v, kept, full, pend[r])
                if got.device_total <= cap:
                    mems[r], recomputed[r] = got, 1.0 - kept / chunks
                    break
    est = PipelineEstimate(spec, counts, costs, pp_link, send_f, send_b, flight, mems, note=note, tied_s=tied_s,
                           moe=moe_memory(plan, stages, counts, p, mems, flight, costs) if stages else None,
                           cp=max((c.ranks for c in cp_ops(plan)), default=1), moe_load=load_summary(plan))
    if recompute == MICROBATCH:
        est.extra["microbatch_recompute"] = {"recomputed_share": recomputed}
    if device is None:
        return est
    zb = spec.schedule == "zb-h1"  # the backward's B and W apart (the W's are deferred)
    bwd = [c.backward_s - (c.weight_s if zb else 0.0) + c.recompute_s * recomputed[j % p]
           + (c.forward_s if recompute_forward else 0.0) for j, c in enumerate(costs)]
    est.inputs = ScheduleInputs([c.forward_s for c in costs], bwd, send_f, send_b,
                                None if plan.runtime.p2p_overlap else True, [c.weight_s for c in costs] if zb else None,
                                [c.chunk or ChunkOps() for c in costs] if overlap else None,
                                a2a_compute_share(plan, device.rates.sms, device.nccl_p2p_channels) if overlap else 1.0,
                                [(c.copy_out_s, c.copy_in_s) for c in costs] if p > 1 and any(
                                    c.copy_out_s or c.copy_in_s for c in costs) else None)
    run = est.run = est.inputs.run(spec.schedule, p, v, m, spec.group)
    est.step_serial_s, est.step_overlap_s = _step_times(plan, spec, costs, run, tied_s)
    mb_tokens = tokens // m if tokens else 0
    mf = model_flops(plan, mb_tokens)[0] if flops is None else flops
    est.tokens, est.model_flops = tokens, mf * m if tokens else 0.0
    est.ranks = ranks or plan.mesh.size * p
    est.peak = device.matmul_peak(plan.program.param_dtype() or "float32")
    est.device_name = device.name
    est.device_memory = device.memory_bytes
    est.grad_overlap = plan.runtime.grad_overlap
    est.extra["slowest_gpu"] = device.slowest_json()
    return est


def plan_unit_costs(plan: Plan, p: int, device: Device | None = None, recompute: str = "none",
                    pp_link: tuple[float, float] = (20e-6, 1 / 25e9), oc: OpComm | None = None) -> UnitCosts:
    """The per-unit costs :func:`spmdkit.planner.partition.partition` splits (the embedding,
    each layer, the head and the loss; one microbatch of ``plan`` on ``device``, else FLOPs
    for times): :func:`stage_costs` with one stage per unit. Activation bytes carry the
    caching allocator's reserve; ``full:K`` and ``every:N`` are costed without recomputation
    (which layers they recompute depends on the split)."""
    unit, n_layers = op_units(plan.program)
    stages = [u + 1 for u in unit]
    counts = (0,) + (1,) * n_layers + (0,)
    split = recompute_layers(recompute) or recompute_every(recompute)
    mode = "none" if split else per_microbatch_mode(recompute)
    if device is not None:  # a stage of p: the pipeline's GPUs step together
        device = device.lockstep(plan.mesh.size * p)
    if device is not None and oc is None:
        oc = op_communication(plan, device)
    cs = stage_costs(plan, stages, counts, device, mode, oc)
    if device is None:  # FLOPs stand for the times
        for i, op in enumerate(plan.program.ops):
            f = op_cost(plan, i).flops
            if op.phase == "forward":
                cs[stages[i]].forward_s += f
            elif op.phase == "backward":
                cs[stages[i]].backward_s += f
    grow = 1.0 + ALLOCATOR_RESERVE
    send = exchanger(plan, p, pp_link, device)
    mid = max(cs[1:-1], key=lambda c: c.send_bytes) if device is not None else None
    return UnitCosts(
        tuple(c.forward_s for c in cs), tuple(c.backward_s + c.recompute_s for c in cs),
        tuple(float(c.parameters + c.gradients + c.optimizer_states
                    + (c.unsharded_parameters + c.unsharded_gradients if p > 1 else 0)) for c in cs),
        tuple(c.stash_bytes * grow for c in cs), tuple(max(0, c.working_peak - c.stash_bytes) * grow for c in cs),
        tuple(c.weight_s for c in cs), tuple(c.wstash_bytes * grow for c in cs),
        send(mid.send_bytes, mid.send_gathered) if mid is not None else 0.0)


def stages_auto(plan: Plan, spec: PipelineSpec, device: Device | None, pp_link: tuple[float, float],
                tokens: int | None = None, ranks: int | None = None, recompute_forward: bool = False,
                recompute: str = "none") -> PipelineEstimate:
    """``--stages auto``: the layers split by :func:`spmdkit.planner.partition.partition` (the
    slowest stage as fast as it can be within ``device``'s memory), estimated in full beside
    the default split (even, or balanced by time where the layers do not divide) and the even
    split with the first stages one layer more (torchtitan's); the fastest that fits is kept
    (the partition's wins ties), with why in ``extra["stages_auto"]`` and the note."""
    base = replace(spec, auto=False)
    oc = op_communication(plan, device) if device is not None else None
    uc = plan_unit_costs(plan, spec.pp, device, recompute, pp_link, oc)
    cap = (device.memory_bytes - with_overheads(0, 0, 0, 0, 0, plan, spec.pp).runtime_overhead
           if device is not None and device.memory_bytes else None)  # (a device file may state no memory)
    part = partition(uc, spec.pp, spec.virtual, spec.microbatches, spec.schedule, cap, group=spec.group)
    args = (device, pp_link, tokens, ranks, recompute_forward, recompute)
    got: dict[str, PipelineEstimate] = {"partition": estimate_pipeline(plan, base, part.counts, *args, oc=oc)}
    ref = estimate_pipeline(plan, base, None, *args, oc=oc)
    if ref.counts != part.counts:
        got["default"] = ref
    even = tuple(even_split(uc.layers, spec.pp * spec.virtual))
    if even not in (part.counts, ref.counts):
        got["even"] = estimate_pipeline(plan, base, even, *args, oc=oc)

    def key(e: PipelineEstimate) -> tuple[bool, float]:
        need = max(mm.device_total for mm in e.memory)
        pace = e.step_overlap_s if e.run is not None else simulate_split(uc, e.counts, spec.pp, spec.virtual,
                                                                          spec.microbatches, spec.schedule, spec.group)
        return (device is not None and 0 < device.memory_bytes < need, pace)

    def slowest(e: PipelineEstimate) -> float:
        if device is not None:
            return max(c.forward_s + c.backward_s for c in e.stages)
        return max(stage_loads(uc, e.counts, spec.pp, spec.virtual, spec.microbatches, spec.schedule, spec.group)[0])

    chosen = min(got, key=lambda k: key(got[k]))  # dicts keep order: the partition first
    best = got[chosen]
    best.spec = spec
    why: dict[str, Any] = {"partition": part.to_json(), "chosen": chosen, "counts": list(best.counts),
                           "candidates": {}}
    for name, e in [("partition", got["partition"]), ("default", ref), *[(k, v) for k, v in got.items()
                                                                          if k == "even"]]:
        why["candidates"][name] = {
            "layers_per_stage": list(e.counts), "step_s": e.step_overlap_s if e.run is not None else None,
            "slowest_stage_s": slowest(e), "pipeline_flop": None if device is not None else key(e)[1],
            "fullest_rank_bytes": max(mm.device_total for mm in e.memory), "fits": not key(e)[0]}
    best.extra["stages_auto"] = why
    best.note = _auto_note(why, device is not None)
    return best


_CANDIDATE = {"partition": "partitioned (the least slowest stage, refined by the schedule, within each rank's "
                           "memory)",
              "default": "the default split (even, balanced by time where the layers do not divide)",
              "even": "the even split, the first stages one layer more"}


def _auto_note(why: dict[str, Any], timed: bool) -> str:
    """The note of ``--stages auto``: the split kept, and each candidate's cost."""

    def one(name: str, e: dict[str, Any]) -> str:
        what = f"step {e['step_s']:.4g} s" if timed and e["step_s"] is not None else \
            f"slowest stage {e['slowest_stage_s']:.4g} FLOP, the schedule {e['pipeline_flop']:.4g} FLOP"
        return (f"{_CANDIDATE[name]} {','.join(map(str, e['layers_per_stage']))}: {what}, fullest rank "
                f"{e['fullest_rank_bytes'] / 2**30:.1f} GiB{'' if e['fits'] else ' (does not fit)'}")

    kept = ",".join(map(str, why["counts"]))
    return (f"note: --stages auto: {kept} ({why['chosen']}); "
            + "; ".join(one(k, e) for k, e in why["candidates"].items()))


def _rank_memory(plan: Plan, mine: list[StageCost], flight: float, p: int, v: int, kept: int = 0,
                 whole: list[StageCost] | None = None, pending: int = 0) -> Memory:
    """One pipeline rank's memory (its stages ``mine``, ``flight`` stage-microbatches in flight,
    held in ``round(flight * v)`` model-chunk units): the working peak of one microbatch plus
    the stash of the others. ``kept`` > 0 (microbatch-level recomputation): that many units
    keep every activation (``whole``: the stages without recomputation), the working one
    among them; the others keep ``mine``'s stash. ``pending``: microbatches whose weight
    gradients are still to run (ZB-H1's deferred W's), each keeping the stages' ``wstash``.
    FSDP2's all-gather copy-in pools (AutoModel's: :mod:`spmdkit.cost.memory_fsdp2`) join the
    reserve; its sharded gradients are counted allocated, with the unsharded ones."""
    stash = sum(c.stash_bytes for c in mine)
    units = max(1, round(flight * v))
    if kept and whole is not None:
        work = max(c.working_peak for c in whole)
        act = work + round((kept - 1) * sum(c.stash_bytes for c in whole) / v + (units - kept) * stash / v)
        peak_op = max(whole, key=lambda c: c.working_peak).peak_op
    else:
        work = max(c.working_peak for c in mine)
        act = work + round(max(0.0, flight - 1.0 / v) * stash) if v > 1 else work + round((flight - 1) * stash)
        peak_op = max(mine, key=lambda c: c.working_peak).peak_op
    act += pending * sum(c.wstash_bytes for c in mine)
    up = sum(c.unsharded_parameters for c in mine) if p > 1 else 0
    ug = sum(c.unsharded_gradients for c in mine) if p > 1 else 0
    return with_overheads(sum(c.parameters for c in mine) + up, sum(c.gradients for c in mine) + ug,
                          sum(c.optimizer_states for c in mine), act, peak_op, plan, p,
                          pools=sum(c.gather_pool for c in mine))


def torch_pipelining(plan: Plan, schedule: str, p: int) -> bool:
    """Whether a pipeline of ``plan`` runs on ``torch.distributed.pipelining`` with FSDP2
    (``--framework torchtitan``, a schedule torch had: :mod:`spmdkit.planner.pipeline_memory`)."""
    return p > 1 and plan.runtime.framework == "torchtitan" and schedule in TORCH_SCHEDULES


def _torch_rank(plan: Plan, costs: list[StageCost], schedule: str, p: int, v: int, m: int, r: int
                ) -> tuple[Memory, float] | None:
    """Rank ``r``'s memory walked over torch's order of its units
    (:func:`spmdkit.planner.pipeline_memory.torch_rank_memory`) and the whole-stage microbatches
    it holds then; None where torch's schedule cannot run it. A stage's received activations
    live in its receive buffers, so they leave its stash and working peak; FSDP2's side-stream
    pools join the allocator's reserve."""
    order = torch_order(schedule, p, v, m, r)
    if order is None:
        return None
    n = p * v
    logits = 2 * sum(e for _, _, e in loss_spans(plan))  # the last stage's output: 16-bit logits
    chunks = []
    for c in range(v):
        k = c * p + r
        s = costs[k]
        got = costs[k - 1].send_bytes if k else 0
        out = s.send_bytes if k < n - 1 else logits
        chunks.append(ChunkBytes(max(0, s.stash_bytes - got), max(0, s.working_peak - got), s.parameters,
                                 s.optimizer_states, s.gradients, s.unsharded_parameters, s.unsharded_gradients,
                                 got, out, s.send_bytes if k < n - 1 else 0, s.gather_pool, s.rs_held,
                                 fsdp=s.unsharded_gradients > 0))
    peak = torch_rank_memory(chunks, order, m)
    mine = [costs[c * p + r] for c in range(v)]
    peak_op = max(mine, key=lambda c: c.working_peak).peak_op
    mem = with_overheads(peak.parameters, peak.gradients, peak.optimizer_states, peak.activations, peak_op, plan, p,
                         pools=peak.pools)
    return mem, peak.in_flight


def _sender(p: int, pp_link: tuple[float, float], device: Device | None,
            kind: str = "send_recv") -> Callable[[int], float]:
    """The time of one pipeline send of ``b`` bytes: NCCL's send/recv
    (:func:`spmdkit.cost.collectives.collective_time`) over the device's link the pp dim
    takes (NVLink in a node, the GPU's NIC across nodes), or ``alpha + b beta`` of a link the
    device does not have (``--cost pp=...``). ``kind`` ``all_reduce``: an all-reduce of ``b``
    bytes between two stages over that link (a tied parameter's gradient: ring, ``2 alpha + b
    beta`` on a link the device does not have)."""
    alpha, beta = pp_link
    scope = None
    if device is not None:
        for where, link in (("intra_node", device.intra), ("inter_node", device.inter)):
            c = link.cost()
            if abs(c.alpha_s - alpha) <= 1e-12 and abs(c.beta_s_per_byte - beta) <= 1e-6 * beta:
                scope = where
                break
    fabric = Fabric.of(device.intra.bytes_per_s, device.inter.bytes_per_s, device.ranks_per_node,
                       device.measured) if device is not None and scope else None
    group = Group(2, 2 if scope == "intra_node" else 1)

    def send(b: int) -> float:
        if p == 1 or b == 0:
            return 0.0
        if fabric is not None:
            return collective_time(kind, b, group, fabric)
        return (2 * alpha if kind == "all_reduce" else alpha) + b * beta

    return send


def exchanger(plan: Plan, p: int, pp_link: tuple[float, float], device: Device | None
              ) -> Callable[[int, int], float]:
    """The time of one blocking pipeline exchange of ``b`` bytes of which ``g`` go scattered
    (``StageCost.send_gathered``, ``--pp-scatter-gather``: Megatron-LM 2021-2022's
    megatron/p2p_communication ``_communicate`` at de7dc40f88): each tp rank sends its 1/t chunk
    of them (``split_tensor_into_1d_equal_chunks``) with the rest, then, the receive done, the
    receivers all-gather the ``g`` bytes over the t ranks of tp on the device's links
    (``gather_split_1d_tensor``: ``torch.distributed.all_gather`` over the tp group; tp ranks
    fill a node first). Without ``g`` (or a device to time the all-gather on): :func:`_sender`."""
    send = _sender(p, pp_link, device)
    t = tp_ranks(plan)
    fabric = Fabric.of(device.intra.bytes_per_s, device.inter.bytes_per_s, device.ranks_per_node,
                       device.measured) if device is not None and t > 1 else None
    group = Group(t, min(t, device.ranks_per_node) if device is not None else t)

    def exchange(b: int, g: int = 0) -> float:
        if fabric is None or g <= 0 or p == 1:
            return send(b)
        return send(b - g + g // t) + collective_time("all_gather", g, group, fabric)

    return exchange


def _step_times(plan: Plan, spec: PipelineSpec, costs: list[StageCost], run: ScheduleRun,
                tied_s: list[float] | None = None) -> tuple[float, float]:
    """(serial, overlapped) step: each device's schedule, then its gradient reductions and its
    optimizer. Overlapped: the reductions in the framework's buckets from the time the last
    microbatch's backward makes each gradient (Megatron's ``overlap_grad_reduce``); Megatron-Core
    buckets only on the first pipeline rank and gives every other rank one bucket after its last
    backward (its reductions are off the critical path: those ranks finish first); the step
    ends when the slowest device is done (the optimizer's gradient norm spans every stage). A
    tied parameter's copies (``tied_s``) are all-reduced after the device's gradient reductions,
    before its optimizer (Megatron-LM's ``finalize_model_grads``: the data-parallel reduction,
    then the embedding group's all-reduce). Megatron-FSDP's ZeRO-2/3 (``StageCost.each``):
    every microbatch's backward launches its stage's reduce-scatters in buckets as it makes the
    gradients, on every rank, queued on the rank's one communication stream under the work
    after it (:func:`spmdkit.planner.stage_costs.reduce_gradients`'s ``early``); the serial
    step adds the ``m - 1`` earlier microbatches' reductions. Without ``Runtime.grad_overlap``
    every rank reduces in one bucket after its last backward (Megatron-LM 2021-2022's local
    DDP: ``allreduce_gradients()`` once the schedule returns)."""
    p, v = spec.pp, spec.virtual
    last: dict[int, tuple[float, float]] = {}
    early: list[list[tuple[float, float, list[Grad]]]] = [[] for _ in range(p)]
    single = single_bucket_ranks(plan, costs)
    for r, kind, k, i, start, end in run.units:
        if kind == ("W" if spec.schedule == "zb-h1" else "B"):
            if i == spec.microbatches - 1:
                last[k] = (start, end)
            elif costs[k].each:
                early[r].append((start, end, costs[k].each))
    serial, overlap = [], []
    for r in range(p):
        grads: list[tuple[float, str, Step, int, str]] = []
        for c in range(v):
            k = c * p + r
            start, end = last.get(k, (run.finish_s[r], run.finish_s[r]))
            grads += [(start + f * (end - start), dt, st, size, layer)
                      for f, dt, st, size, layer in costs[k].grads]
        o = sum(costs[c * p + r].optimizer_s for c in range(v))
        g = sum(costs[c * p + r].grad_sync_s for c in range(v))
        g += sum((spec.microbatches - 1) * costs[c * p + r].each_s for c in range(v))
        one = (single and r > 0) or not plan.runtime.grad_overlap  # --no-grad-overlap: after the backward
        done, _b = reduce_gradients(plan, grads, run.finish_s[r], one, early[r])
        t = tied_s[r] if tied_s else 0.0
        serial.append(run.finish_s[r] + g + t + o)
        overlap.append(done + t + o)
    return max(serial), max(overlap)


__all__ = ["plan_unit_costs", "stages_auto", "SCHEDULES", "PipelineEstimate", "ScheduleRun", "StageCost",
           "balanced_split", "bubble_formula", "estimate_pipeline", "even_split", "in_flight", "reduce_gradients",
           "run_schedule", "schedule_order", "stage_costs"]
