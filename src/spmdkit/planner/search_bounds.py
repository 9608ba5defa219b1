"""Lower bounds that let the outer search (:mod:`spmdkit.planner.search`) leave a configuration
unplanned when it cannot fit or cannot be the fastest (branch and bound).

Both bounds are read off the model once, at full size on one rank (:func:`model_bounds`), and
are lower bounds of what :func:`spmdkit.cost.memory.memory_per_device` and the step models
(:func:`spmdkit.cost.step.estimate_step`, :func:`spmdkit.planner.pipeline.estimate_pipeline`)
give the configuration, under every recomputation mode:

- memory (:meth:`Bounds.memory`): the parameters, their gradients and their optimizer states a
  device must hold, at least at the program's own dtypes (every framework holds as many bytes
  or more: Megatron-LM fp32 main gradients and master weights, torchtitan fp32 parameters),
  each divided by every mesh dim the strategy could shard it over: ``tp`` under megatron (every
  parameter, as if none were replicated), ``ep`` for the expert stacks ``[E, in, out]`` under
  ``ep``, ZeRO's data-parallel ranks (``dp x ep`` for the dense parameters, ``dp`` for the
  experts: EDP) for the optimizer states (zero1+), gradients (zero2+) and parameters (zero3);
  with ``pp`` stages the fullest holds at least their average; plus the CUDA context and one
  NCCL buffer per communicator (:func:`spmdkit.cost.memory.with_overheads`), and of the
  activations each layer's input (or what a recomputation mode keeps of it) for each microbatch
  a rank holds in flight as the plan counts them (:meth:`Bounds.flights`), with the caching
  allocator's reserve (:data:`GROW`);
- the step (:meth:`Bounds.step`): every op's time is at least its FLOPs at the fastest rate
  its kind reaches (:meth:`spmdkit.cost.devices.Device.compute_time`): a GEMM at the best
  large-GEMM ceiling of the dtypes it may run in (:data:`spmdkit.cost.rates.Rates.gemm` times the
  peak: the tile, wave and K factors are at most 1; the plain peak where ``spmdkit calibrate``
  measured GEMMs), any other op at the tensor-core peak; the devices together do at least the
  FLOPs of the unsharded step, so a device works at least ``floor / N``. Under ``--strategy ...,ep``
  each MoE layer adds 2 all-to-alls forward and 2 backward that block the step
  (:mod:`spmdkit.cost.step`), carrying at least the ``T x top_k`` token copies of the layer's
  ``T`` tokens spread over the ``N`` devices (``--moe-dispatcher deepep``: each token once per
  node and rank its experts reach, :func:`spmdkit.cost.moe.reached`) over the ep group packed
  as densely into nodes as it can be (``min(ep, ranks per node)`` a node: more nodes only send
  more over the network), at the NIC's and NVLink's reached bandwidth, no latency; none where
  ``spmdkit calibrate`` measured all-to-alls. A 1F1B pipeline of ``p`` stages and ``m``
  microbatches takes at least ``(m + p - 1) / m`` of its busiest device's work (the first
  microbatch crosses every stage forward and back before the busiest device's last ``m - 1``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from spmdkit.cost.collectives import Fabric
from spmdkit.cost.compute import op_cost
from spmdkit.cost.devices import Device
from spmdkit.cost.memory import ALLOCATOR_RESERVE, CUDA_CONTEXT_BYTES, NCCL_BYTES_PER_GROUP
from spmdkit.cost.moe import MoeLayer, moe_layers, reached
from spmdkit.planner.schedules import in_flight
from spmdkit.planner.search_space import Config
from spmdkit.program.ir import Program
from spmdkit.program.layers import layer_tags, program_layers
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import Runtime


def experts_of(prog: Program) -> int:
    """The routed experts of a program's MoE layers (the expert axis of ``moe_gate_dispatch``'s
    output ``[B, E, C, H]``), 0 for a dense program."""
    for op in prog.ops:
        if op.rule == "moe_gate_dispatch" and op.phase == "forward":
            names = op.output_names()
            if names and len(prog.tensors[names[0]].shape) in (4, 5):  # 5: routed in chunks [B, T, E, C, H]
                return prog.tensors[names[0]].shape[-3]
    return 0


#: (dense parameters, expert parameters, dense states, expert states), bytes at their dtypes
Held = tuple[int, int, int, int]

#: a device's bytes for each activation byte at its peak: the caching allocator's reserve is
#: :data:`spmdkit.cost.memory.ALLOCATOR_RESERVE` of the activation peak in every plan
#: (:func:`spmdkit.cost.memory.with_overheads`)
GROW = 1.0 + ALLOCATOR_RESERVE


@dataclass(frozen=True)
class Bounds:
    """What the bounds read off the full-size step on one rank (bytes, FLOPs)."""

    layers: tuple[Held, ...]  # each numbered layer's parameters and optimizer states
    outside: Held             # the rest (embedding, final norm, head)
    flops: float              # forward + backward + optimizer FLOPs of the unsharded step
    peak: float               # the fastest tensor-core peak its ops can run at (FLOP/s)
    #: bytes of one token of a layer's input (hidden x dtype size: what every recomputation
    #: mode keeps of each layer for its backward), 0 where unknown; the global batch and seq
    token_bytes: int = 0
    batch: int = 0
    seq: int = 0
    #: one device's seconds for the whole step's ops at their kinds' fastest rates (0: use flops / peak)
    floor_s: float = 0.0
    #: the MoE layers (each with its tokens per step and bytes per token copy) and the links
    #: their all-to-alls cross (None: no all-to-all bound, e.g. measured all-to-alls)
    moe: tuple[tuple[MoeLayer, int, int], ...] = ()
    fabric: Fabric | None = None
    dispatcher: str = "alltoall"
    routing: str = "topk"
    #: the runtime's framework: a Megatron pipeline rank holds :func:`spmdkit.planner.schedules.
    #: in_flight` microbatches and one at its working peak (:meth:`flights`); torchtitan's is walked
    framework: str = "megatron"
    #: :meth:`held` by (dp, ep, tp, strategy) (not an argument: a copy ``dataclasses.replace``
    #: makes starts its own)
    memo: dict[tuple[int, int, int, str], tuple[list[float], float]] = field(
        default_factory=dict, init=False, compare=False, repr=False)

    def _held(self, h: Held, dp: int, ep: int, tp: int, strategy: str) -> float:
        st = set(strategy.split(","))
        zero = max((int(s[4]) for s in st if s in ("zero1", "zero2", "zero3")), default=0)
        t = tp if "megatron" in st else 1
        e = ep if "ep" in st else 1

        def div(stage: int, expert: bool) -> int:
            z = (dp if expert else dp * ep) if zero >= stage else 1
            return t * (e if expert else 1) * z

        dpar, epar, dst, est = h
        return (dpar / div(3, False) + epar / div(3, True) + dpar / div(2, False) + epar / div(2, True)
                + dst / div(1, False) + est / div(1, True))

    def held(self, dp: int, ep: int, tp: int, strategy: str) -> tuple[list[float], float]:
        """(each layer's parameters, gradients and optimizer states on a device, those of the
        whole model with what lies outside the layers) under ``strategy`` (kept by its degrees:
        a search asks for the same ones under every recomputation mode and bound)."""
        key = (dp, ep, tp, strategy)
        got = self.memo.get(key)
        if got is None:
            kinds: dict[Held, float] = {}  # a model's layers are of a few kinds: each computed once
            per = [kinds[h] if h in kinds else kinds.setdefault(h, self._held(h, dp, ep, tp, strategy))
                   for h in self.layers]
            got = self.memo[key] = (per, sum(per) + self._held(self.outside, dp, ep, tp, strategy))
        return list(got[0]), got[1]

    def layer_input(self, dp: int, ep: int, tp: int, pp: int, strategy: str, microbatches: int = 1) -> float:
        """One layer's input of one microbatch on one device (0 where the token bytes are not known):
        what every recomputation mode keeps at least."""
        if not (self.token_bytes and self.batch and self.seq):
            return 0.0
        m = microbatches if pp > 1 else 1
        unit = self.batch / m / (dp * ep) * self.seq * self.token_bytes
        return unit / tp if "sp" in strategy.split(",") else unit

    @staticmethod
    def overhead(dp: int, ep: int, tp: int, pp: int) -> int:
        """The bytes a device holds besides the model: the CUDA context and NCCL's buffers, one set
        per process group (dp, ep, tp and pp where above 1)."""
        groups = sum(1 for k in (dp, ep, tp) if k > 1) + (1 if pp > 1 else 0)
        return CUDA_CONTEXT_BYTES + NCCL_BYTES_PER_GROUP * groups

    def flights(self, pp: int, virtual: int, microbatches: int) -> tuple[tuple[float, ...], bool]:
        """Each pipeline rank's microbatches in flight at its peak (whole-stage units) as the
        plan's memory counts them, and whether one of them is counted at its working peak above
        the others' stash (:func:`spmdkit.planner.pipeline._rank_memory`: ``working + (flight -
        1 / v) stash``): Megatron's :func:`spmdkit.planner.schedules.in_flight` (1F1B, or
        interleaved over ``virtual`` chunks: ``p + (p - 1) / v`` on the first rank); under
        torchtitan (its order walked unit by unit, :mod:`spmdkit.planner.pipeline_memory`)
        ``min(p - r, m)``, the peak not counted."""
        m = max(1, microbatches)
        if self.framework == "torchtitan":
            return tuple(float(min(pp - r, m)) for r in range(pp)), False
        schedule = "interleaved" if virtual > 1 else "1f1b"
        return tuple(in_flight(schedule, pp, virtual, m, r) for r in range(pp)), True

    def memory(self, dp: int, ep: int, tp: int, pp: int, strategy: str, microbatches: int = 1,
               layer_bytes: float = 0.0, virtual: int = 1, peak: float = 0.0) -> int:
        """Bytes per device at least (every recomputation mode) under ``strategy`` on
        ``pp x dp x ep x tp`` (1F1B over ``microbatches`` when ``pp`` > 1, interleaved over
        ``virtual`` chunks); ``layer_bytes``: what a layer keeps of one microbatch on a device at
        least, where known (a recomputation mode's: :class:`spmdkit.planner.search_floor.LayerFloor`),
        else its input; the activations with the allocator's reserve (:data:`GROW`). ``peak``: the
        least working peak of a layer under the mode (full recomputation's:
        :attr:`spmdkit.planner.search_floor.LayerFloor.full_peak`), where the plan counts one
        microbatch at its peak beside the others' stash (:meth:`flights`)."""
        per, total = self.held(dp, ep, tp, strategy)
        unit = GROW * max(self.layer_input(dp, ep, tp, pp, strategy, microbatches), layer_bytes)
        if pp == 1:
            need = total + len(per) * unit
        else:  # rank r holds c_r layers and f_r microbatches (flights): max_r c_r (s + f_r u) with sum c_r = L
            s = min(per, default=0.0)
            flight, working = self.flights(pp, virtual, microbatches)
            need = total / pp
            for extra, less in [(0.0, 0.0)] + ([(GROW * peak, 1.0 / virtual)] if working and peak > 0 else []):
                inv = sum(1.0 / (s + (f - less) * unit) for f in flight) if s or unit else 0.0
                need = max(need, extra + len(per) / inv if inv else 0.0)
        return int(need) + self.overhead(dp, ep, tp, pp)

    def all_to_all(self, devices: int, ep: int, strategy: str) -> float:
        """Seconds one device spends at least in the MoE layers' dispatch and combine
        all-to-alls per step (module docstring) on ``devices`` devices with an ``ep`` group."""
        f = self.fabric
        if f is None or ep <= 1 or "ep" not in strategy.split(","):
            return 0.0
        per_node = min(ep, f.ranks_per_node)
        nodes = -(-ep // per_node)
        nvl, nic = f.nvlink_bps * f.nvlink_eff, f.nic_bps * f.nic_eff
        total = 0.0
        for layer, tokens, copy_bytes in self.moe:
            if layer.experts % ep:
                continue
            if self.dispatcher == "deepep":
                d_nodes, d_ranks = reached(layer, nodes, ep, self.routing)
                t = max(d_nodes * (nodes - 1) / nodes / nic, d_ranks * (ep - 1) / ep / nvl)
            else:
                k = layer.top_k
                t = k * max((per_node - 1) / ep / nvl, (ep - per_node) / ep / nic)
            total += 4 * t * copy_bytes * tokens / devices
        return total

    def step(self, devices: int, pp: int, microbatches: int, ep: int = 1, strategy: str = "",
             virtual: int = 1) -> float:
        """Seconds per step at least on ``devices`` devices (``pp`` stages, ``microbatches``;
        ``ep`` and ``strategy``: the MoE all-to-alls' bound, :meth:`all_to_all`; ``virtual`` model
        chunks a rank: interleaved 1F1B's bubble is ``(pp - 1) / virtual`` stages)."""
        work = max(self.flops / self.peak, self.floor_s) / devices + self.all_to_all(devices, ep, strategy)
        if pp > 1:
            m = max(1, microbatches)
            work *= (m + pipeline_fill(pp, virtual)) / m
        return work


def pipeline_fill(pp: int, virtual: int = 1) -> float:
    """The fill and drain of a ``pp``-stage 1F1B pipeline in microbatches of a stage's work (its
    bubble; interleaved 1F1B with ``virtual`` chunks a rank: ``(pp - 1) / virtual``)."""
    return (pp - 1) / max(1, virtual)


def model_bounds(plan: Plan, device: Device, runtime: Runtime, token_bytes: int = 0) -> Bounds:
    """The :class:`Bounds` of ``plan``, the step planned on one rank at full size
    (``token_bytes``: a layer input's bytes per token, where known)."""
    prog = plan.program
    experts = experts_of(prog)
    where = program_layers(prog).tensor_layer
    n_layers = len(layer_tags(prog))
    acc = [[0, 0, 0, 0] for _ in range(n_layers + 1)]  # the last: outside the layers
    for t in prog.tensors.values():
        if t.inplace_of or t.kind not in ("parameter", "optimizer_state"):
            continue
        expert = experts > 0 and len(t.shape) == 3 and t.shape[0] == experts
        k = (0 if t.kind == "parameter" else 2) + (1 if expert else 0)
        lay = where.get(t.name, -1)
        acc[lay if 0 <= lay < n_layers else n_layers][k] += t.numel * t.itemsize
    costs = [op_cost(plan, i) for i in range(len(prog.ops))]
    flops = sum(c.flops for c in costs)
    dtypes = {t.dtype for t in prog.tensors.values() if t.dtype.startswith(("float", "bfloat"))}
    peak = max([device.matmul_peak(d) for d in dtypes] or [device.peak["fp32"]])
    if runtime.fp8 and "fp8" in device.peak:
        peak = max(peak, device.peak["fp8"])
    # a GEMM reaches at most the best large-GEMM ceiling of its possible dtypes (none where measured)
    gemm_rate = peak
    if device.measured is None or not device.measured.gemm:
        keys = {device._key(d) for d in dtypes} | ({"fp8"} if runtime.fp8 else set())
        gemm_rate = min(peak, max([device.peak.get(k, 0.0) * device.rates.gemm.get(k, 1.0) for k in keys] or [peak]))
        gemm_rate = gemm_rate if gemm_rate > 0 else peak
    floor_s = sum(c.flops / (gemm_rate if c.matmul and c.attention is None else peak) for c in costs)
    moe: list[tuple[MoeLayer, int, int]] = []
    for layer in moe_layers(prog):
        y = prog.tensors[prog.ops[layer.dispatch].output_names()[0]]
        rows = y.shape[0] if len(y.shape) == 4 else 1
        moe.append((layer, rows * layer.tokens, int(y.shape[-1]) * y.itemsize))
    measured_a2a = device.measured is not None and any(p.op == "all_to_all" for p in device.measured.collectives)
    fabric = None if measured_a2a else Fabric.of(device.intra.bytes_per_s, device.inter.bytes_per_s,
                                                  device.ranks_per_node)
    tokens = [t.shape for t in prog.tensors.values() if t.kind == "input" and t.name in ("tokens", "input_ids")]
    batch, seq = (tokens[0][0], tokens[0][1]) if tokens and len(tokens[0]) == 2 else (0, 0)
    held = [(a[0], a[1], a[2], a[3]) for a in acc]
    return Bounds(tuple(held[:-1]), held[-1], float(flops), peak, token_bytes, batch, seq, floor_s, tuple(moe), fabric,
                  runtime.moe_dispatcher, runtime.moe_routing, runtime.framework)


def memory_bound(cfg: Config, bounds: Bounds, layer_bytes: float = 0.0, peak: float = 0.0) -> int:
    """Bytes a device of ``cfg`` needs at least (``layer_bytes``: a layer's kept bytes of one
    microbatch under a recomputation mode, where known; ``peak``: a layer's least working peak
    under it, :meth:`Bounds.memory`)."""
    # cp: ZeRO shards over dp x cp and each rank holds 1/cp of the sequences' tokens, as dp x cp ranks would
    if cfg.grad_accum > 1:  # a micro-step holds the activations of batch / accum sequences
        bounds = replace(bounds, batch=bounds.batch // cfg.grad_accum)
    return bounds.memory(cfg.dp * cfg.cp, cfg.ep, cfg.tp, cfg.pp, cfg.strategy, cfg.microbatches, layer_bytes,
                         cfg.virtual, peak) if cfg.strategy != "auto" else 0


def memory_why(cfg: Config, bounds: Bounds, cap: int) -> str | None:
    """Why ``cfg`` cannot fit in ``cap`` bytes a device (its memory bound), or None."""
    mem = memory_bound(cfg, bounds)
    if mem > cap:
        return (f"over the memory cap: its parameters, gradients, optimizer states and layer inputs kept for the "
                f"backward alone need at least {mem / 2**30:.1f} GiB a device")
    return None


def pruned_why(cfg: Config, bounds: Bounds, cap: int, best: float, low: float | None = None) -> str | None:
    """Why ``cfg`` need not be planned (its bounds; ``low``: its step bound where computed), or None."""
    why = memory_why(cfg, bounds, cap)
    if why is not None:
        return why
    if low is None:
        low = bounds.step(cfg.devices, cfg.pp, cfg.microbatches, cfg.ep, cfg.strategy, cfg.virtual)
    if low == math.inf:
        return ("over the memory cap under every recomputation mode: its parameters, gradients, optimizer states "
                "and the activations each mode keeps of its layers need more")
    if low >= best:
        return (f"its step is at least {low:.3g} s (its layers' GEMMs and blocking collectives at their shapes, "
                f"FLOPs at the fastest rates, MoE all-to-alls, the pipeline's bubble), the best found {best:.3g} s")
    return None


__all__ = ["GROW", "Bounds", "Held", "experts_of", "memory_bound", "memory_why", "model_bounds", "pipeline_fill", "pruned_why"]
