"""A pipeline stage's costs for one microbatch: its ops' times (forward, backward, ZB-H1's
weight-gradient part, recomputation, optimizer), its parameters, gradients and optimizer
states as the framework holds them, the activations it stashes and sends, its working peak,
and its gradient reductions (:func:`stage_costs`; the stages of
:mod:`spmdkit.planner.pipeline`, or one unit per layer for :mod:`spmdkit.planner.partition`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from spmdkit.core.reshard import Step
from spmdkit.cost.buckets import Bucket, Reducer
from spmdkit.cost.compute import gathered_itemsize
from spmdkit.cost.devices import Device
from spmdkit.cost.memory import activation_deltas, held_for_the_step, local_numel, peak_of, stashed_output_copies
from spmdkit.cost.memory_fsdp2 import gather_sizes, gathered_numels, last_group, pair_peak
from spmdkit.cost.memory_saved import ActivationMemory, all_value_inputs, kept_storage, rerun_points, saved_activations
from spmdkit.cost.step import OpComm, op_communication, shared_gather_savings
from spmdkit.cost.step_comm import param_gather_time
from spmdkit.planner.chunk_ops import chunk_ops
from spmdkit.planner.chunk_plan import ChunkOps
from spmdkit.planner.zero_bubble import weight_shares, weight_stash
from spmdkit.program.ir import Program
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import reduces_each_microstep

#: a gradient reduction of a stage: (share of its backward done when made, dtype, reduction,
#: bytes, layer), :attr:`StageCost.grads`
Grad = tuple[float, str, Step, int, str]


@dataclass
class StageCost:
    """One virtual stage, for one microbatch (times in s, bytes per device)."""

    layers: int
    ops: int = 0
    forward_s: float = 0.0
    backward_s: float = 0.0
    grad_sync_s: float = 0.0
    #: the seconds of ``each``'s reductions in one microbatch (serial), as ``grad_sync_s``
    each_s: float = 0.0
    optimizer_s: float = 0.0
    send_bytes: int = 0       # activations sent to the next stage (its gradients come back alike)
    send_grad_bytes: int = 0  # gradients sent to the previous stage
    #: the parts of send_bytes / send_grad_bytes that ``--pp-scatter-gather`` sends as Megatron-LM
    #: of 2021-2022 does: 1/t a tp rank, all-gathered over tp after the receive (:func:`scattered`)
    send_gathered: int = 0
    send_grad_gathered: int = 0
    parameters: int = 0
    gradients: int = 0
    optimizer_states: int = 0
    stash_bytes: int = 0      # what one microbatch keeps for the backward
    recompute_s: float = 0.0  # the forward ops --recompute runs again in the backward
    weight_s: float = 0.0     # the part of backward_s that makes the weight gradients (ZB-H1's W)
    #: the parts of forward_s / backward_s that wait on the experts' all-to-alls over ep (dispatch
    #: and combine; --ep-comm-overlap hides them under another microbatch's computation)
    a2a_forward_s: float = 0.0
    a2a_backward_s: float = 0.0
    wstash_bytes: int = 0     # what one microbatch keeps from its input gradients to its W
    working_peak: int = 0     # the liveness peak of one microbatch through the stage
    #: torchtitan's FSDP2 under a pipeline: the stage's parameters held gathered (16-bit) and
    #: their gradients accumulated unsharded (fp32) over the microbatches
    unsharded_parameters: int = 0
    unsharded_gradients: int = 0
    #: what FSDP2's all-gather copy-in stream keeps reserved for the stage (its model chunk's root):
    #: two consecutive groups' gathered parameters (:func:`spmdkit.cost.memory_fsdp2.pair_peak`)
    gather_pool: int = 0
    #: torch 1963fc8's pipelining under FSDP2 (before pytorch/pytorch#144535): the reduce-scatter
    #: input of the stage's last FSDP group (its unsharded fp32 gradients, flat), which the chunk's
    #: FSDP comm context keeps from the stage's last backward to the next step's
    #: (:mod:`spmdkit.planner.pipeline_memory`)
    rs_held: int = 0
    #: FSDP2's copies of those, once a step on the compute stream: the gathered parameters copied
    #: out before the first microbatch's forward, the fp32 gradients copied into the reduce-scatter
    #: input after the last microbatch's backward (:func:`stage_costs`)
    copy_out_s: float = 0.0
    copy_in_s: float = 0.0
    peak_op: int = 0
    flops: float = 0.0
    #: the local gradient bytes of the parameters it holds a copy of that other stages read too (a tied
    #: embedding and LM head: :func:`shared_parameters`), all-reduced among those stages once per step
    tied_bytes: int = 0
    #: the parameter gradients' reductions: (share of the stage's backward done when the
    #: gradient is made, its dtype, the reduction, its bytes, its layer); timed in buckets
    grads: list[tuple[float, str, Step, int, str]] = field(default_factory=list, repr=False)
    #: those of ``grads`` the framework reduces in every microbatch's backward, not only the
    #: last one's (Megatron-FSDP's ZeRO-2/3 reduce-scatters: ``reduced_each_microstep``)
    each: list[tuple[float, str, Step, int, str]] = field(default_factory=list, repr=False)
    #: --ep-comm-overlap: its ops as Megatron-Core's merged schedule's nodes (:mod:`spmdkit.planner.chunk_ops`)
    chunk: ChunkOps | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("grads", "each", "chunk")}
        if self.chunk is not None:
            out["chunk"] = asdict(self.chunk)
        return out


def stage_costs(plan: Plan, stages: list[int], counts: tuple[int, ...], device: Device | None = None,
                recompute: str = "none", oc: OpComm | None = None,
                only: Collection[str] | None = None) -> list[StageCost]:
    """Per stage: parameters, gradients and states, the stash and working peak of one
    microbatch, the bytes sent, and (``device``) the times. ``recompute`` (none, selective,
    full; :func:`spmdkit.cost.memory_saved.saved_activations`): the activations a recomputed region makes are not
    stashed (they are made again), and its ops' times go to ``recompute_s``. ``oc``: the ops'
    times on ``device`` when already computed (:func:`spmdkit.cost.step.op_communication`).
    ``only``: the layer labels whose regions ``recompute`` runs again (``full:K``), else all."""
    saved = saved_activations(plan, recompute, only)
    out = [StageCost(c) for c in counts]
    nbytes = _LocalBytes(plan)
    param_grads = _held_for_the_step(plan, stages, out, nbytes)
    shared = shared_parameters(plan.program, stages)
    copies = _shared_copies(plan, shared, param_grads, out, nbytes)

    def transient(nm: str) -> bool:
        t = plan.program.tensors[nm]
        return not (nm in param_grads or t.inplace_of or t.kind in ("parameter", "optimizer_state"))

    _stash_and_sends(plan, stages, out, nbytes, transient, saved)
    for s, d in enumerate(activation_deltas(plan, saved, stages, len(out))):
        out[s].working_peak, out[s].peak_op, _ = peak_of(d)
    shares = weight_shares(plan, param_grads)
    for s, b in enumerate(weight_stash(plan, stages, len(out), saved, shares, nbytes)):
        out[s].wstash_bytes = b
    if device is not None:
        oc = oc or op_communication(plan, device)
        # under --compile, a recomputed allgather cp attention's grad shares its K / V gather
        # (held in memory by activation_deltas above): one mechanism, in the times too
        cut = shared_gather_savings(plan, device, oc, rerun_points(plan, saved)[0]) if oc.under else {}
        _stage_times(plan, stages, out, oc, {j for r in saved.recomputed for j in r}, shares, copies, cut)
        if plan.runtime.fsdp2:
            _fsdp2_copies(plan, out, device.hbm_rate)
    return out


def _fsdp2_copies(plan: Plan, out: list[StageCost], rate: float) -> None:
    """FSDP2's copies under torch's pipelining, once a step (the flat step's:
    :func:`spmdkit.cost.step.fsdp2_copy_out`, :class:`spmdkit.cost.buckets.Reducer`): the gathered
    parameters read and written (``foreach_all_gather_copy_out``), each reduce-scattered gradient
    read and its reduce-dtype input written (``foreach_reduce_scatter_copy_in``), the gradient read
    in fp32 where it was accumulated unsharded in the reduce dtype (``to_accumulated_grad_if_needed``)."""
    red = Reducer(plan)
    for sc in out:
        sc.copy_out_s = 2 * sc.unsharded_parameters / rate
        for _f, dt, st, size, _layer in sc.grads:
            if st.kind == "reduce_scatter":
                wrote = red.reduced_bytes(dt, size)
                sc.copy_in_s += (wrote + (wrote if sc.unsharded_gradients else size)) / rate


def shared_parameters(prog: Any, stages: list[int]) -> dict[str, tuple[int, ...]]:
    """The parameters that forward ops of more than one stage read -> those stages (a tied
    embedding and LM head, GPT-2's ``wte``: the first stage's lookup and the last stage's head).
    Each of those stages holds its own copy, initialised equal, its gradient made from its own
    ops; the copies' gradients are all-reduced among those stages after the last microbatch's
    backward, so each runs the same update (Megatron-LM's embedding group:
    ``_allreduce_embedding_grads``)."""
    seen: dict[str, set[int]] = {}
    for i, op in enumerate(prog.ops):
        if op.phase == "forward":
            for nm in op.input_names():
                if prog.tensors[nm].kind == "parameter":
                    seen.setdefault(nm, set()).add(stages[i])
    return {nm: tuple(sorted(s)) for nm, s in seen.items() if len(s) > 1}


def _shared_copies(plan: Plan, shared: dict[str, tuple[int, ...]], param_grads: dict[str, int],
                   out: list[StageCost], nbytes: _LocalBytes) -> dict[str, tuple[str | None, tuple[int, ...]]]:
    """Count the copies of the :func:`shared_parameters` on the stages that do not update the
    plan's one parameter: its bytes, its gradient's and its optimizer states (as the framework
    holds them); each holder's ``tied_bytes``. Returns parameter -> (its gradient the optimizer
    reads, the stages holding a copy besides the one the plan's update runs on)."""
    if not shared:
        return {}
    prog = plan.program
    held = held_for_the_step(plan)
    grad_of = _updated_by(prog, set(param_grads))
    found: dict[str, tuple[str | None, tuple[int, ...]]] = {}
    for nm, where in shared.items():
        g = grad_of.get(nm)
        home = param_grads[g] if g is not None else where[0]
        p_b, g_b, st_b = held.get(nm) or (nbytes(nm), 0, 0)
        for s in where:
            out[s].tied_bytes += nbytes(g) if g is not None and g in plan.attrs else nbytes(nm)
            if s != home:
                out[s].parameters += p_b
                out[s].gradients += g_b
                out[s].optimizer_states += st_b
        found[nm] = (g, tuple(s for s in where if s != home))
    return found


def _updated_by(prog: Any, grads: set[str]) -> dict[str, str]:
    """Parameter -> the gradient (one of ``grads``) the optimizer op updating it reads; one pass
    over the optimizer ops."""
    out: dict[str, str] = {}
    for op in prog.ops:
        if op.phase != "optimizer":
            continue
        names = op.input_names()
        read = [g for g in names if g in grads]
        if not read:
            continue
        for nm in names:
            t = prog.tensors[nm]
            if t.kind == "parameter" and not t.inplace_of:
                out.setdefault(nm, read[0])
    return out


class _LocalBytes:
    """A tensor's local bytes under the plan (its largest shard), computed once."""

    def __init__(self, plan: Plan) -> None:
        self.tensors = plan.program.tensors
        self.attrs = plan.attrs
        self.sizes: dict[str, int] = {}

    def __call__(self, name: str) -> int:
        b = self.sizes.get(name)
        if b is None:
            t = self.tensors[name]
            b = self.sizes[name] = int(local_numel(self.attrs[name], t.shape) * t.itemsize)
        return b


def _held_for_the_step(plan: Plan, stages: list[int], out: list[StageCost],
                       nbytes: _LocalBytes) -> dict[str, int]:
    """Count each stage's ops, parameters, parameter gradients and optimizer states (as the
    framework holds them: :func:`spmdkit.cost.memory.held_for_the_step`); parameter gradient
    -> its stage."""
    prog = plan.program
    held = held_for_the_step(plan)
    # torchtitan under a pipeline keeps FSDP2's parameters gathered over the microbatches
    # (parallelize_llama.apply_fsdp: reshard_after_forward=False when pp is enabled) and
    # torch.distributed.pipelining accumulates their gradients unsharded until the last
    # microbatch (set_requires_gradient_sync(False)), in the fp32 reduce dtype (the rule:
    # runtime.reduces_each_microstep; Megatron-FSDP's, reduced every microbatch, stay at their shard)
    gathered: dict[str, tuple[int, int]] = {}
    if plan.runtime.fsdp2 and not reduces_each_microstep(plan.runtime.framework, 3, pipeline=True):
        # AutoModel too (reshard_after_forward=not pp_enabled)
        # --fsdp-float8-all-gather: held gathered at 1 byte an element
        gathered = {nm: (n * gathered_itemsize(plan, nm), n * 4) for nm, n in gathered_numels(plan).items()}
    grads, updated, not_updated = prog.derived("stage_costs.held", _step_reads)
    for i in range(len(prog.ops)):
        out[stages[i]].ops += 1
    param_grads = {nm: stages[i] for nm, i in grads}
    mine: dict[int, dict[str, int]] = {}  # stage -> its gathered parameters' bytes
    ugrads: dict[int, dict[str, int]] = {}  # stage -> its unsharded gradients' bytes
    for nm, i in updated:
        s = stages[i]
        p, g, st = held.get(nm) or (nbytes(nm), 0, 0)
        out[s].parameters += p
        out[s].gradients += g
        out[s].optimizer_states += st
        out[s].unsharded_parameters += gathered.get(nm, (0, 0))[0]
        out[s].unsharded_gradients += gathered.get(nm, (0, 0))[1]
        if nm in gathered:
            mine.setdefault(s, {})[nm] = gathered[nm][0]
            ugrads.setdefault(s, {})[nm] = gathered[nm][1]
    for s, got in mine.items():  # each stage's model chunk is an FSDP2 root with its own streams
        out[s].gather_pool = pair_peak(gather_sizes(prog, got))
        if plan.runtime.framework == "torchtitan":  # torch 1963fc8's pipelining (AutoModel's torch has #144535)
            out[s].rs_held = last_group(prog, ugrads[s])
    for nm, i in not_updated:  # a parameter without an update
        out[stages[i]].parameters += nbytes(nm)
    return param_grads


def _step_reads(prog: Program) -> tuple[list[tuple[str, int]], list[tuple[str, int]], list[tuple[str, int]]]:
    """(each parameter gradient with the first optimizer op reading it; each parameter with the
    first optimizer op reading it; each parameter no optimizer op reads, with its first forward
    reader): found once per program for :func:`_held_for_the_step`."""
    grads: dict[str, int] = {}
    updated: dict[str, int] = {}
    for i, op in enumerate(prog.ops):
        if op.phase == "optimizer":
            for nm in op.input_names():
                t = prog.tensors[nm]
                if t.kind == "gradient" and nm not in grads:
                    grads[nm] = i
                elif t.kind == "parameter" and not t.inplace_of and nm not in updated:
                    updated[nm] = i
    not_updated: dict[str, int] = {}
    for i, op in enumerate(prog.ops):
        if op.phase == "forward":
            for nm in op.input_names():
                if prog.tensors[nm].kind == "parameter" and nm not in updated and nm not in not_updated:
                    not_updated[nm] = i
    return list(grads.items()), list(updated.items()), list(not_updated.items())


def _stage_reads(prog: Program) -> tuple[list[tuple[int, list[str]]], list[tuple[int, list[tuple[str, int]]]]]:
    """(each backward op and the tensors it reads the values of; each forward op and the inputs
    it reads from an earlier forward op, with that op, but those made from the data and
    constants alone), found once per program for :func:`_stash_and_sends`."""
    producer: dict[str, int] = {}
    for i, op in enumerate(prog.ops):
        for nm in op.output_names():
            producer.setdefault(nm, i)
    vin = all_value_inputs(prog)
    back: list[tuple[int, list[str]]] = []
    fwd: list[tuple[int, list[tuple[str, int]]]] = []
    local: set[str] = set()  # made without a parameter, from the data and constants
    for i, op in enumerate(prog.ops):
        if op.phase == "backward":
            back.append((i, vin[i]))
        if op.phase != "forward":
            continue
        ins = op.input_names()
        if all(nm in local or (nm not in producer and prog.tensors[nm].kind != "parameter") for nm in ins):
            local.update(op.output_names())
        got = [(nm, j) for nm in ins if (j := producer.get(nm)) is not None and nm not in local
               and prog.ops[j].phase == "forward"]
        if got:
            fwd.append((i, got))
    return back, fwd


def _stash_and_sends(plan: Plan, stages: list[int], out: list[StageCost], nbytes: _LocalBytes,
                     transient: Callable[[str], bool], saved: ActivationMemory) -> None:
    """The activations crossing stages (sent forward, their gradients sent back) and the stash:
    what one microbatch keeps for the backward (``saved``: the forward tensors a backward op
    reads the values of, less those recomputation makes again, at the size they are kept in),
    held by each stage whose backward reads it (a stage keeps the input it received; Megatron-LM
    frees the output it sent), a view of a kept tensor once with it where they are one storage
    on that stage (:func:`~spmdkit.cost.memory_saved.kept_storage`: not a view received). A
    tensor made from the data and constants alone, no parameter (an imported model's attention
    mask, its rotary cos and sin) is not sent: each stage makes its own, as each stage of
    Megatron-LM makes its masks and rotary tables."""
    prog = plan.program
    crossing: dict[str, tuple[int, int]] = {}
    readers: dict[str, set[int]] = {}
    back, fwd = prog.derived("stage_costs.reads", _stage_reads)
    for i, names in back:
        b = stages[i]
        for nm in names:
            readers.setdefault(nm, set()).add(b)
    for i, ins in fwd:
        b = stages[i]
        for nm, j in ins:
            a = stages[j]
            if b > a and transient(nm):
                _lo, hi = crossing.get(nm, (a, a))
                crossing[nm] = (a, max(hi, b))
    at = kept_storage(plan, saved, stages)  # a view counts where it is its storage's first's storage there
    full = {nm: size for lst in saved.tensors.values() for nm, size in lst}
    held = {(s, at(nm, s)) for lst in saved.tensors.values() for nm, _ in lst for s in readers.get(nm, ())}
    for s, nm in held:
        out[s].stash_bytes += full[saved.shared.get(nm, nm)]
    for s, size in stashed_output_copies(plan, saved, stages).items():  # alltoall cp's head-layout output
        out[s].stash_bytes += size
    for nm, (a, b) in crossing.items():
        size = nbytes(nm)
        g = nm + ".grad"
        gsize = nbytes(g) if g in prog.tensors and g in plan.attrs else size
        split, gsplit = scattered(plan, nm), scattered(plan, g if g in plan.attrs else nm)
        for k in range(a, b):
            out[k].send_bytes += size
            out[k + 1].send_grad_bytes += gsize
            out[k].send_gathered += size if split else 0
            out[k + 1].send_grad_gathered += gsize if gsplit else 0


def tp_ranks(plan: Plan) -> int:
    """The ranks of the plan's ``tp`` mesh dim (1 without one)."""
    return plan.mesh.dim_size("tp") if "tp" in plan.mesh.dim_names else 1


def scattered(plan: Plan, name: str) -> bool:
    """``--pp-scatter-gather`` (Megatron-LM's ``scatter_gather_tensors_in_pipeline`` of 2021-2022,
    megatron/p2p_communication at de7dc40f88 and cfd2e21607): a tensor crossing stages that every
    tp rank holds whole (replicated over ``tp``, no sequence parallelism: Megatron turns it off
    under ``--sequence-parallel``, whose activations are already split) is sent as one 1/t chunk a
    rank (``split_tensor_into_1d_equal_chunks``) and all-gathered over tp after the receive
    (``gather_split_1d_tensor``)."""
    if not plan.runtime.pp_scatter_gather or tp_ranks(plan) <= 1 or name not in plan.attrs:
        return False
    tp = plan.mesh.dim_index("tp")
    attr = plan.attrs[name]
    return tp not in attr.sharded_mesh_dims() and tp not in attr.partial_dims


def _stage_times(plan: Plan, stages: list[int], out: list[StageCost], oc: OpComm, rerun: set[int],
                 shares: dict[int, float], copies: dict[str, tuple[str | None, tuple[int, ...]]],
                 shared: dict[int, float] | None = None) -> None:
    """Each stage's forward, backward, recomputation and optimizer times (each op's compute and
    the communication it waits on: :func:`spmdkit.cost.step.op_communication`, the step's own
    model), its gradient reductions (where in its backward each gradient is made) and their
    time in buckets (:class:`spmdkit.cost.buckets.Reducer`), on ``device``. A shared parameter's
    copy (``copies``: :func:`_shared_copies`) costs its stage the same update and the same
    gradient reduction, that one at the end of its backward. ``shared``: op -> the seconds its
    compute and wait are less than ``oc``'s (:func:`spmdkit.cost.step.shared_gather_savings`)."""
    shared = shared or {}
    made: list[list[tuple[float, str, Step, int, str]]] = [[] for _ in out]
    each: list[list[tuple[float, str, Step, int, str]]] = [[] for _ in out]
    gathers: list[list[tuple[tuple[int, ...], float, int]]] = [[] for _ in out]
    prog = plan.program
    also: dict[int, tuple[int, ...]] = {}  # op -> the other stages its update / reduction also runs on
    for nm, (g, others) in copies.items():
        for i, op in enumerate(prog.ops):
            if others and op.phase == "optimizer" and nm in op.input_names():
                also[i] = others
            if others and g is not None and g in op.output_names():
                also[i] = others
    late: list[list[tuple[str, Step, int, str]]] = [[] for _ in out]
    times = [0.0] * len(prog.ops)
    for i, op in enumerate(prog.ops):
        c = oc.costs[i]
        t = times[i] = oc.compute[i] + oc.wait[i] - shared.get(i, 0.0)
        sc = out[stages[i]]
        if i in rerun:
            sc.recompute_s += t
        sc.flops += c.flops
        if op.phase == "forward":
            sc.forward_s += t
            sc.a2a_forward_s += oc.ep_a2a.get(i, 0.0)
        elif op.phase == "backward":
            sc.backward_s += t
            sc.a2a_backward_s += oc.ep_a2a.get(i, 0.0)
            sc.weight_s += t * shares.get(i, 0.0)
        else:
            sc.optimizer_s += t
            for s in also.get(i, ()):
                out[s].optimizer_s += t
        for q, (dt, st, size) in enumerate(oc.pending.get(i, ())):
            made[stages[i]].append((sc.backward_s, dt, st, size, op.layer))
            if (i, q) in oc.each:
                each[stages[i]].append(made[stages[i]][-1])
            for s in also.get(i, ()) if op.phase != "optimizer" else ():
                late[s].append((dt, st, size, op.layer))
        gathers[stages[i]] += oc.param_gathers.get(i, [])
    for s, copy_grads in enumerate(late):
        made[s] += [(out[s].backward_s, dt, st, size, layer) for dt, st, size, layer in copy_grads]
    if plan.runtime.ep_comm_overlap:
        for sc, ch in zip(out, chunk_ops(prog, stages, len(out), times, oc.ep_a2a, rerun, shares)):
            sc.chunk = ch
    for sc, items in zip(out, gathers):
        # Megatron's overlap_param_gather: under the next step's first forward on the stage
        sc.optimizer_s += max(0.0, param_gather_time(plan, items) - sc.forward_s) if items else 0.0
    for sc, grads, mine in zip(out, made, each):
        sc.grads = [(at / sc.backward_s if sc.backward_s > 0 else 1.0, dt, st, size, layer)
                    for at, dt, st, size, layer in grads]
        sc.each = [(at / sc.backward_s if sc.backward_s > 0 else 1.0, dt, st, size, layer)
                   for at, dt, st, size, layer in mine]
        sc.grad_sync_s = _serial(plan, sc.grads)
        sc.each_s = _serial(plan, sc.each)


def _serial(plan: Plan, grads: list[Grad]) -> float:
    """The seconds of ``grads``' reductions in the framework's buckets, one after the other."""
    red = Reducer(plan)
    for _f, dt, st, size, layer in grads:
        red.add(dt, st, size, 0.0, layer)
    return red.flush(0.0)


def single_bucket_ranks(plan: Plan, costs: list[StageCost] | OpComm) -> bool:
    """Whether the pipeline ranks after the first reduce their stages' gradients in one bucket
    launched at the end of their last backward (:func:`reduce_gradients`'s ``single``):
    Megatron-Core DDP's, not Megatron-FSDP's (its reductions run in every microbatch's backward,
    in buckets on every rank: :attr:`StageCost.each`, from ``op_communication``'s
    :attr:`OpComm.each`, which ``costs`` may be), nor the FSDP2 frameworks'."""
    each = bool(costs.each) if isinstance(costs, OpComm) else any(c.each for c in costs)
    return plan.runtime.framework == "megatron" and not each


def reduce_gradients(plan: Plan, grads: list[tuple[float, str, Step, int, str]], end: float,
                     single: bool = False, early: list[tuple[float, float, list[Grad]]] | None = None
                     ) -> tuple[float, list[Bucket]]:
    """One pipeline device's gradient reductions, ``grads`` as (time made, dtype, reduction,
    bytes, layer): in the framework's buckets from the time each is made, or (``single``) all
    in one bucket launched at ``end``, the end of the device's last backward; (when the last is
    done, the buckets). ``early``: the reductions the microbatches before the last run in their
    own backward (:attr:`StageCost.each`: Megatron-FSDP's), as (the backward's start, its end,
    the stage's ``each``): each microbatch's in the same buckets, launched as its backward makes
    them, all on the device's one communication stream in the order they are launched (they
    overlap the work after them; the step waits for the last)."""
    red = Reducer(plan, single=single)
    for at, dt, st, size, layer in sorted(grads, key=lambda g: g[0]):
        red.add(dt, st, size, end if single else at, layer)
    done = red.flush(end)
    if not early:
        return done, red.buckets
    one: dict[int, Reducer] = {}  # a stage's one microbatch's buckets, launched at shares of its backward
    launches: list[tuple[float, Bucket]] = []
    for s0, s1, items in early:
        mb = one.get(id(items))
        if mb is None:
            mb = one[id(items)] = Reducer(plan)
            for f, dt, st, size, layer in sorted(items, key=lambda g: g[0]):
                mb.add(dt, st, size, f, layer)
            mb.flush(1.0)
        launches += [(s0 + f * (s1 - s0), replace(b, ready_s=s0 + b.ready_s * (s1 - s0)))
                     for f, b in zip(mb.launched, mb.buckets)]
    launches += list(zip(red.launched, red.buckets))
    launches.sort(key=lambda x: x[0])
    free, out = 0.0, []
    for at, b in launches:
        start = max(at, free)
        free = start + b.time_s
        out.append(replace(b, start_s=start))
    return max(end, free), out


__all__ = ["Grad", "StageCost", "reduce_gradients", "shared_parameters", "single_bucket_ranks", "stage_costs"]
