"""torch's context_parallel as torchtitan runs it, on the timeline: an allgather cp attention
under ``--framework torchtitan``. Standard library only. docs/devices.md, "Context parallelism".

torchtitan (9dec370, 2024-12-26: its Llama ``model.py``, ``Attention.forward``)
calls ``repeat_kv`` on K and V before ``F.scaled_dot_product_attention``, so torch's
``context_parallel`` (``_RotateMethod.ALL_GATHER``, ``experimental.context_parallel_rotate_method
= "allgather"``) sees K and V with the query heads: ``n_rep`` = query heads / KV heads times the
GQA bytes (4 for Llama 3.1 8B, 16 for 405B). torch's
``torch/distributed/tensor/experimental/_attention.py`` of that era (torch 1963fc8, 2024-12-23)
then runs, per rank (``Q``: the local queries' bytes, ``KV``: the repeated local keys' and
values', both in the activations' dtype):

- **forward** (``_templated_ring_attention``): ``key.contiguous()`` / ``value.contiguous()`` (the
  transposed repeat: a copy), then ``cp`` steps; at step 0 ``torch.cat([key, value])`` is
  all-gathered asynchronously (``_AllGatherRotater``: one ``all_gather_tensor`` of ``KV`` a rank)
  while the local block computes (the causal diagonal step), and step 1 waits for it. Every step
  ``i < cp - 1`` concatenates its K / V again for the rotater (the all-gather rotater ignores it
  after the first). Each step's output goes into ``_SDPAMerger(convert_to_f32=True)``: cast to
  fp32, then ``out - sigmoid(lse_b - lse) * (out - out_b)`` in three unfused fp32 passes (the
  zig-zag's second-half steps merge half the queries and write the whole accumulator back by
  ``_partial_update``'s ``torch.cat``); the result cast back.
- **backward** (``_templated_ring_attention_backward``): ``kv_rotater`` (the same all-gather
  again, under the step-0 backward) and ``dkv_rotater`` forced to ``_RotateMethod.ALL_TO_ALL``:
  after each step the fp32 dK / dV accumulators (``torch.cat``, ``2 KV`` bytes) are sent to the
  next rank by ``funcol.permute_tensor`` and waited for after the next step's flash backward
  (one step of overlap); ``cp`` transfers, the last waited for after no compute. It is not a
  reduce-scatter. Per step ``grad_key += grad_key_`` (fp32 += bf16; ``_partial_update``'s add and
  ``torch.cat`` on the ranks' first-half steps), the same for dQ, and the casts back at the end.

Eager (torchtitan without ``--compile``) ``funcol`` returns an ``AsyncCollectiveTensor`` waited
for at its first use, which gives the overlap above. Under ``--compile`` the ring is traced into
the block's graph (below), and traced, ``torch/distributed/_functional_collectives.py``'s
``_maybe_wrap_tensor`` calls ``wait_tensor`` at once ("wait happens immediately, which generally
forces an early sync", pytorch/pytorch#94440); Inductor moves a wait later only in
``comms.reorder_compute_and_comm_for_overlap`` (pytorch/pytorch#108091: "greedily moves waits as
late as possible"), run only under ``config.reorder_for_compute_comm_overlap``, False by default,
which torchtitan 9dec370 does not set (it sets ``_micro_pipeline_tp`` alone, for async TP). So
compiled, the gather is waited for before step 0 and each dK / dV send before the next step:
none of it overlaps.

:func:`torch_cp_costs` gives each such op its all-gather (over the cp mesh dims, by the plan's
cost model: across nodes where the cp ranks are, as under tp = 8), its dK / dV ring and what
stays exposed (:func:`torch_cp_exposed`; all of it under ``--compile``); :func:`merge_bytes` the memory-bound passes (op by op
as written without ``--compile``; under it, torchtitan's ``torch.compile(block, fullgraph=True)``
traces the ring into the block's graph and Inductor fuses each pointwise chain), timed at
the device's HBM rate as the op's ``cast_bytes``, and its flash kernels at the step's sequence
(:func:`torch_cp_op_cost`). The plan's own K / V
all-gathers and dK / dV reduce-scatters of such an op (of the un-repeated heads) are replaced by
these (:mod:`spmdkit.cost.step`). Under ``--compile`` with the attention recomputed the grad's
all-gather, ``contiguous()`` copies and first ``torch.cat`` are its recomputed forward's
(AOTAutograd's CSE of the joint graph: :func:`spmdkit.cost.memory_cp.shared_gathers`): the grad
is priced without them (:meth:`TorchCpCost.without_gather`, :func:`shared_copy_bytes`,
:func:`spmdkit.cost.context_shared.shared_gather_costs`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr, largest_shard
from spmdkit.cost.collectives import time_of
from spmdkit.cost.context import CpOp, cp_op, cp_ops
from spmdkit.engine.facts import OpCost
from spmdkit.program.plan import Plan

#: the framework whose attention runs torch's context_parallel (the others: Transformer Engine)
TORCH_CP = "torchtitan"


@dataclass(frozen=True)
class LocalQKV:
    """One cp rank's share of an attention op as torch's context_parallel sees it: the elements
    of its queries ``q``, of its keys and values as the model holds them (``kv``, the KV heads),
    the ``rep`` factor of ``repeat_kv`` (``rep_kv``: the keys and values with the query heads),
    the activations' bytes per element."""

    q: int
    kv: int
    rep: int
    itemsize: int

    @property
    def rep_kv(self) -> int:
        return self.rep * self.kv


def _local(plan: Plan, i: int, name: str) -> tuple[int, tuple[int, ...], int]:
    """(local elements, global shape, itemsize) of op ``i``'s input ``name`` as it is made (the
    sequence's ``1/cp`` shard: the op's own requirement of k and v is the plan's gathered copy)."""
    prog = plan.program
    n = prog.ops[i].inputs[name]
    t = prog.tensors[n]
    a = plan.attrs.get(n)
    shape = largest_shard(a.dims_mapping, t.shape, a.mesh.shape) if isinstance(a, TensorDistAttr) else t.shape
    return math.prod(shape), t.shape, t.itemsize


def local_qkv(plan: Plan, i: int) -> LocalQKV:
    """:class:`LocalQKV` of cp attention op ``i`` (q ``[b, s, h, d]``, k / v ``[b, t, hk, d]``):
    ``rep`` is torchtitan's ``n_rep = h / hk``."""
    q, qs, item = _local(plan, i, "q")
    k, ks, _ = _local(plan, i, "k")
    v, _, _ = _local(plan, i, "v")
    rep = max(1, qs[2] // ks[2]) if len(qs) > 2 and len(ks) > 2 and ks[2] > 0 else 1
    return LocalQKV(q, k + v, rep, item)


def merge_bytes(x: LocalQKV, cp: int, backward: bool, eager: bool = True) -> float:
    """Bytes the busiest cp rank's memory-bound passes read and write in one allgather cp
    attention op (module docstring) on ``x``'s shapes: the activations in ``x.itemsize`` bytes,
    the accumulators in fp32 (``convert_to_f32``). The busiest rank is the last: every step
    after the first is a full-query one, merged whole (zig-zag ``i <= rank``), and in the
    backward adds its step's dK / dV to the first half (``_partial_update``). ``eager``: each
    PyTorch op its own kernel (torchtitan without ``--compile``); else torchtitan's
    ``torch.compile(block, fullgraph=True)`` traces the ring into the block's graph (the functional
    collectives are traceable) and Inductor runs each chain of pointwise ops and ``torch.cat`` as
    one kernel, the rotater's unused ``torch.cat`` after the first dropped."""
    if not eager:
        return _compiled_merge_bytes(x, cp, backward)
    a, f = x.itemsize, 4
    q, kv, rest = x.q, x.rep_kv, cp - 1
    contiguous = 2 * kv * a  # key.contiguous(), value.contiguous() of the transposed repeat
    cats = rest * 2 * kv * a  # torch.cat([key, value]) for the rotater, every step but the last
    if not backward:
        repeat = (x.kv + kv) * a  # repeat_kv: read the KV heads, write the query heads
        # step 0: out.to(fp32); each later step: the cast, then (out - out_b), the product with
        # sigmoid(lse_b - lse) and the subtraction, unfused in fp32 (3 + 2 + 3 accesses); the cast back
        cast = q * (a + f)
        merges = cast + rest * (cast + 8 * q * f) + cast
        return float(repeat + contiguous + cats + merges)
    repeat = (kv + x.kv) * a  # repeat_kv's backward: the repeats summed
    zeros = (q + kv) * f  # the fp32 accumulators of dQ, dK, dV
    # step 0: grad += grad_ (read the fp32 sum and the step's gradient, write the sum) for dK / dV
    # and dQ; later steps: dK / dV by _partial_update (half of it added, then torch.cat of the
    # whole), dQ added whole
    add_kv, add_q = kv * (2 * f + a), q * (2 * f + a)
    adds = add_kv + add_q + rest * (add_kv / 2 + 2 * kv * f + add_q)
    sends = cp * 2 * kv * f  # torch.cat of the fp32 dK, dV for the dkv rotater, every step
    casts = (q + kv) * (f + a)  # grad_query.to(the dtype), the last dK / dV buffer's likewise
    return float(repeat + zeros + contiguous + cats + adds + sends + casts)


def _compiled_merge_bytes(x: LocalQKV, cp: int, backward: bool) -> float:
    """:func:`merge_bytes` under ``--compile``: one kernel per chain, each tensor read and
    written once."""
    a, f = x.itemsize, 4
    q, kv, rest = x.q, x.rep_kv, cp - 1
    if not backward:
        # repeat_kv, .contiguous() and the rotater's first cat: the KV heads read, the repeated
        # K, V and their cat written; each later step's merge: the fp32 output read and written,
        # the step's output read (step 0's cast and the cast back fused into the first and last)
        return float((x.kv + 2 * kv) * a + rest * (2 * f + a) * q)
    # .contiguous() and the first cat; step 0's gradients cast into the fp32 accumulators (the
    # zeros folded); each later step: the received fp32 dK / dV read, half of the step's added,
    # the next cat written, and dQ read, added and written; the last received dK / dV cast back
    # and summed over the repeats (repeat_kv's backward), dQ cast back
    first = 3 * kv * a + (a + f) * (kv + q)
    later = rest * ((2 * f + a / 2) * kv + (2 * f + a) * q)
    return float(first + later + f * kv + a * x.kv + (f + a) * q)


def torch_cp_op_cost(plan: Plan, i: int, c: OpCost) -> OpCost:
    """``c`` (allgather cp attention op ``i``'s cost, :func:`spmdkit.cost.context.cp_op_cost`) as
    torch's context_parallel runs it under ``--framework torchtitan``: ``cp`` flash kernels, not
    one over the gathered keys. Under the zig-zag balance step 0 is causal over the rank's two
    chunks and every later step non-causal over one chunk of keys (all queries) or two (the
    second half of the queries): each kernel's sequence is half the local tokens, as the
    attention pass of a causal op over the local keys prices it (``attention``'s sequence the
    gathered keys / cp). With the memory-bound passes (:func:`merge_bytes`) timed at the device's
    HBM rate as separate kernels (``cast_bytes``). ``c`` itself elsewhere."""
    cp = cp_op(plan, i)
    if cp is None or not runs_torch_cp(plan, cp):
        return c
    extra = merge_bytes(local_qkv(plan, i), cp.ranks, plan.program.ops[i].phase == "backward", plan.runtime.eager)
    att = c.attention
    if att is not None:
        att = (att[0], max(1, att[1] // cp.ranks), att[2], att[3])
    return replace(c, cast_bytes=c.cast_bytes + extra, attention=att)


def torch_cp_exposed(gather_s: float, dkv_s: float, step_s: float, cp: int, backward: bool,
                     traced: bool = False) -> float:
    """Seconds an allgather cp attention of ``cp`` steps of ``step_s`` waits on its
    communication under torch's context_parallel: the all-gather (``gather_s``) runs under step
    0 and step 1 waits for it; in the backward the dK / dV sends (``dkv_s`` each, on the same
    communication stream, after the gather) are issued after each step and waited for after the
    next one, the last after none. A two-stream walk of that order.

    ``traced``: the ring compiled into the block's graph (torchtitan's ``--compile``): traced, a
    functional collective is waited for where it is issued (``_maybe_wrap_tensor`` calls
    ``wait_tensor`` at once; the wait moves later only under Inductor's
    ``reorder_for_compute_comm_overlap``, off by default and not set by torchtitan): every
    transfer exposed, the gather and in the backward the ``cp`` sends."""
    if cp <= 1:
        return 0.0
    if traced:
        return gather_s + (cp * dkv_s if backward else 0.0)
    comm = gather_s  # the communication stream's clock
    clock = step_s  # step 0
    if backward:
        comm = max(comm, clock) + dkv_s  # step 0's dK / dV sent
    for i in range(1, cp):
        clock = max(clock, gather_s if i == 1 else 0.0) + step_s
        if backward:
            clock = max(clock, comm)  # the previous step's dK / dV received
            comm = clock + dkv_s
    if backward:
        clock = max(clock, comm)  # the last dK / dV: after no compute
    return max(0.0, clock - cp * step_s)


def shared_copy_bytes(x: LocalQKV) -> int:
    """Bytes of the memory-bound passes an allgather cp attention grad on ``x``'s shapes does not
    run when its K / V gather is its recomputed forward's (under ``--compile`` with the attention
    recomputed: AOTAutograd's CSE of the joint graph, :func:`spmdkit.cost.memory_cp.shared_gathers`):
    ``key.contiguous()``, ``value.contiguous()`` and the rotater's first ``torch.cat``, one
    Inductor kernel that reads the repeated K / V and writes the copies and the cat
    (:func:`_compiled_merge_bytes`' first ``3 KV``); the recomputed forward runs them, once."""
    return 3 * x.rep_kv * x.itemsize


@dataclass(frozen=True)
class TorchCpCost:
    """One allgather cp attention op under torch's context_parallel: its all-gather of the
    repeated K / V (``gather_bytes`` the gathered buffer), in the backward the ``cp`` sends of
    the fp32 dK / dV (``dkv_bytes`` each), one step's compute, the communication and what of it
    stays exposed."""

    op_index: int
    phase: str
    cp: int
    rep: int
    gather_bytes: int
    gather_s: float
    dkv_bytes: int
    dkv_s: float
    step_s: float
    comm_s: float
    exposed_s: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def without_gather(self) -> TorchCpCost:
        """This backward op with its all-gather shared with the recomputed forward's (under
        ``--compile``: :func:`shared_copy_bytes`): the ``cp`` dK / dV sends alone, each waited
        for where it is issued (traced: :func:`torch_cp_exposed`)."""
        return replace(self, gather_bytes=0, gather_s=0.0, comm_s=self.comm_s - self.gather_s,
                       exposed_s=torch_cp_exposed(0.0, self.dkv_s, self.step_s, self.cp, True, traced=True))


def runs_torch_cp(plan: Plan, cp: CpOp) -> bool:
    """Whether torch's context_parallel runs cp attention op ``cp``: an allgather one whose
    sequence is split, under ``--framework torchtitan``."""
    return plan.runtime.framework == TORCH_CP and cp.variant == "allgather" and cp.ranks > 1


def torch_cp_ops(plan: Plan) -> list[CpOp]:
    """The allgather cp attention ops torch's context_parallel runs (:func:`runs_torch_cp`)."""
    if plan.runtime.framework != TORCH_CP:
        return []
    return [c for c in cp_ops(plan) if runs_torch_cp(plan, c)]


def torch_cp_costs(plan: Plan, times: Sequence[float], ops: Sequence[CpOp] | None = None) -> dict[int, TorchCpCost]:
    """Op index -> :class:`TorchCpCost` of every allgather cp attention op under
    ``--framework torchtitan`` (``ops``: :func:`torch_cp_ops`, where the caller has them),
    ``times[i]`` op i's compute (``cp`` steps); the all-gather and the sends timed over the op's
    cp mesh dims by the plan's cost model."""
    out: dict[int, TorchCpCost] = {}
    for cp in torch_cp_ops(plan) if ops is None else ops:
        i = cp.index
        x = local_qkv(plan, i)
        backward = plan.program.ops[i].phase == "backward"
        gathered = cp.ranks * x.rep_kv * x.itemsize
        g = time_of(plan.cost, "all_gather", cp.dims, gathered, plan.mesh.shape)
        dkv = x.rep_kv * 4 if backward else 0  # convert_to_f32: the fp32 dK, dV
        d = time_of(plan.cost, "send_recv", cp.dims, dkv, plan.mesh.shape) if backward else 0.0
        step = times[i] / cp.ranks
        comm = g + cp.ranks * d
        exposed = torch_cp_exposed(g, d, step, cp.ranks, backward, traced=not plan.runtime.eager)
        out[i] = TorchCpCost(i, "backward" if backward else "forward", cp.ranks, x.rep, gathered, g, dkv, d, step,
                             comm, exposed)
    return out


__all__ = ["LocalQKV", "TORCH_CP", "TorchCpCost", "local_qkv", "merge_bytes", "runs_torch_cp", "shared_copy_bytes",
           "torch_cp_costs", "torch_cp_exposed", "torch_cp_op_cost", "torch_cp_ops"]
