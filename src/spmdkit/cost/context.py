"""Context parallelism's attention on the timeline: the ring's steps overlapped with the block
computations, the exposed communication, the causal imbalance without zig-zag, the ring's
buffers in flight. Standard library only. docs/devices.md, "Context parallelism".

A cp attention op holds q, k, v sharded on their sequence axis over the ``cp`` mesh dim
(``--cp-attention``, :mod:`spmdkit.ops.attention`):

- **ring** (Liu et al. 2023, "Ring Attention"; Transformer Engine's ``cp_comm_type="p2p"``):
  ``cp`` steps of block attention; while step ``i`` computes the local queries against the KV
  block it holds, that block is sent to the next rank and the next one received from the
  previous (send/recv of K and V: ``2 x b x s/cp x hk x d`` elements). The forward's ``cp - 1``
  transfers each run under one step's compute: the exposed part is ``max(0, comm - compute)``
  per step (:func:`ring_exposed`). The backward passes the KV blocks round again and with them
  the blocks of dK / dV being accumulated (``cp`` transfers: the last one brings each rank its
  own block's gradient back, under no compute). torch's context_parallel accumulates dK / dV in
  fp32 (``_cp_options.convert_to_f32``), Transformer Engine in the activations' dtype.
- **allgather** (Llama 3, Dubey et al. 2024 section 3.3.2; TE's ``cp_comm_type="all_gather"``):
  K and V all-gathered over cp before the attention (a reshard of the plan, cheap with GQA: hk
  heads), the local queries attend at their global positions; the backward reduce-scatters dK /
  dV. Transformer Engine runs the all-gather before the kernel ("not async, cannot be
  overlapped"), so it blocks. torch's context_parallel (``_RotateMethod.ALL_GATHER``) runs
  something else: K and V after torchtitan's ``repeat_kv`` gathered asynchronously under the
  local block, the backward's dK / dV passed round a ring, fp32 merges per step
  (:mod:`spmdkit.cost.context_torch`, under ``--framework torchtitan``).
- **alltoall** (DeepSpeed-Ulysses, Jacobs et al. 2023): reshards only (q, k, v and the output
  all-to-all'ed between sequence and heads, forward and backward), blocking, as the plan's
  reshards already price them.

Causal load balance: with zig-zag (each rank two mirrored chunks ``r`` and ``2cp - 1 - r``)
every rank and every ring step does the same work, half a block; without it, rank ``r`` does
``r + 1/2`` blocks and the ring waits for the last: the attention takes ``(2cp - 1) / cp`` of
the balanced time (:func:`causal_imbalance`, 1.75 at cp = 4, ~2x for large cp).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr, entry_dims, largest_shard
from spmdkit.engine.facts import OpCost, RingPass, facts_of
from spmdkit.program.plan import Plan

#: the attention variants of ``--cp-attention``
CP_ATTENTION = ("ring", "allgather", "alltoall")
#: the cp attention rules (spmdkit.ops.context)
CP_RULES = frozenset({"cp_attention", "cp_attention_grad"})
#: bytes per element of the dK / dV blocks a framework's ring accumulates (torch's
#: context_parallel: ``_cp_options.convert_to_f32``; Transformer Engine: the activations' dtype)
GRAD_ACCUM_ITEMSIZE = {"torchtitan": 4}


def causal_imbalance(cp: int, balanced: bool, causal: bool = True) -> float:
    """The busiest cp rank's attention work over the mean (the ring, and every rank after it,
    waits for it): 1 with zig-zag or without a causal mask; ``(2cp - 1) / cp`` for contiguous
    chunks (rank ``r`` computes ``r`` full blocks and half its diagonal one: the last rank
    ``cp - 1/2`` blocks, the mean ``cp / 2``)."""
    if cp <= 1 or balanced or not causal:
        return 1.0
    return (2 * cp - 1) / cp


def rank_blocks(cp: int, balanced: bool, causal: bool = True) -> list[float]:
    """Blocks of ``(s/cp)^2`` query-key pairs each cp rank computes (a causal diagonal block
    counts 1/2): :func:`causal_imbalance` is ``max / mean`` of these."""
    if not causal:
        return [float(cp)] * cp
    if balanced:
        return [cp / 2] * cp  # cp steps of half a block (zig-zag)
    return [r + 0.5 for r in range(cp)]


def kv_block_bytes(batch: int, seq_local: int, kv_heads: int, head_dim: int, v_head_dim: int, itemsize: int) -> int:
    """One rank's K and V block: ``b x s/cp x hk x (d + dv)`` elements."""
    return batch * seq_local * kv_heads * (head_dim + v_head_dim) * itemsize


def ring_exposed(comm_s: float, compute_s: float, transfers: int, tail: int = 0) -> float:
    """Seconds a ring of ``transfers`` block transfers of ``comm_s`` each, every one overlapped
    with one step's compute of ``compute_s``, leaves exposed: ``transfers x max(0, comm -
    compute)``, plus ``tail`` transfers under no compute (the backward's last dK / dV block)."""
    return max(0, transfers) * max(0.0, comm_s - compute_s) + max(0, tail) * comm_s


@dataclass(frozen=True)
class RingCost:
    """One ring attention op (forward or backward) on the timeline: its ``steps`` block
    computations of ``step_compute_s`` each (the busiest rank's), its ``transfers`` block
    transfers of ``step_comm_s`` (K and V; the backward's with dK / dV), what stays exposed."""

    op_index: int
    phase: str
    cp: int
    steps: int
    transfers: int
    block_bytes: int
    step_comm_s: float
    step_compute_s: float
    comm_s: float
    exposed_s: float
    balanced: bool
    imbalance: float

    def to_json(self) -> dict[str, Any]:
        return {"op_index": self.op_index, "phase": self.phase, "cp": self.cp, "steps": self.steps,
                "transfers": self.transfers, "block_bytes": self.block_bytes, "step_comm_s": self.step_comm_s,
                "step_compute_s": self.step_compute_s, "comm_s": self.comm_s, "exposed_s": self.exposed_s,
                "balanced": self.balanced, "imbalance": self.imbalance}


def ring_cost(op_index: int, backward: bool, cp: int, block_bytes: int, grad_block_bytes: int,
              send_s: Callable[[int], float], attention_s: float, balanced: bool) -> RingCost:
    """The ring of one attention op: ``attention_s`` its whole compute on the busiest rank
    (``cp`` steps), ``send_s(bytes)`` the seconds of one send/recv over the cp ranks. Forward:
    ``cp - 1`` transfers of the KV block, each under one step. Backward: ``cp - 1`` KV transfers
    and ``cp`` dK / dV transfers (``grad_block_bytes``), one of each per step, the last dK / dV
    under no compute."""
    step = attention_s / cp
    kv = send_s(block_bytes)
    if not backward:
        transfers = cp - 1
        per = kv
        exposed = ring_exposed(per, step, transfers)
        comm = transfers * per
        nbytes = block_bytes
    else:
        dkv = send_s(grad_block_bytes)
        transfers = cp - 1
        per = kv + dkv
        exposed = ring_exposed(per, step, transfers) + dkv
        comm = transfers * per + dkv
        nbytes = block_bytes + grad_block_bytes
    return RingCost(op_index, "backward" if backward else "forward", cp, cp, transfers + (1 if backward else 0),
                    nbytes, per, step, comm, exposed, balanced, 1.0)


# -- a plan's cp attention ------------------------------------------------------------------------


@dataclass(frozen=True)
class CpOp:
    """A cp attention op of a plan: its variant, the mesh dims its sequence is split over and
    their ranks, the zig-zag balance, causality, the ring's fact (None: not a ring)."""

    index: int
    variant: str
    dims: tuple[int, ...]
    ranks: int
    balanced: bool
    causal: bool
    ring: RingPass | None


def _seq_dims(attr: Any, axis: int) -> tuple[int, ...]:
    if not isinstance(attr, TensorDistAttr) or len(attr.dims_mapping) <= axis:
        return ()
    return entry_dims(attr.dims_mapping[axis])


def cp_op(plan: Plan, i: int) -> CpOp | None:
    """Op ``i`` as a cp attention op whose sequence the plan splits (None otherwise): the ring's
    ranks from its block inputs' sequence axis (the RingPass fact), the allgather's from q's, the
    alltoall's from the sequence axis q had before its all-to-all onto the heads (the op itself
    reads it whole: its cp degree is the ranks the sequence came split over)."""
    op = plan.program.ops[i]
    if op.rule not in CP_RULES:
        return None
    variant = str(op.attrs.get("variant", "allgather"))
    req = plan.ops[i].required
    ring = facts_of(op.rule).ring
    if ring is not None and not ring.applies(op.attrs):
        ring = None
    dims = _seq_dims(req.get(ring.blocks[0] if ring is not None else "q"), ring.axis if ring is not None else 1)
    if variant == "alltoall":  # Ulysses runs on the heads: q's sequence was split where it came from
        dims = _seq_dims(plan.ops[i].given.get("q"), 1)
    n = math.prod(plan.mesh.shape[d] for d in dims)
    if n <= 1 and variant != "alltoall":
        return None
    return CpOp(i, variant, dims, n, op.attrs.get("balance", "zigzag") != "none", bool(op.attrs.get("causal", True)),
                ring)


def cp_ops(plan: Plan) -> list[CpOp]:
    """Every cp attention op of ``plan`` whose sequence is split (:func:`cp_op`)."""
    out = []
    for i, op in enumerate(plan.program.ops):
        if op.rule in CP_RULES and (c := cp_op(plan, i)) is not None:
            out.append(c)
    return out


def cp_op_cost(plan: Plan, i: int, c: OpCost) -> OpCost:
    """``c`` (op ``i``'s cost on its local shapes) as the busiest rank runs it: a ring's ``n``
    block steps (the local shapes are one step's), and, causal without the zig-zag balance, the
    ring's or the gather's :func:`causal_imbalance` (the executed FLOPs; the model FLOPs stay the
    mean)."""
    cp = cp_op(plan, i)
    if cp is None:
        return c
    k = cp.ranks if cp.ring is not None else 1
    imb = causal_imbalance(cp.ranks, cp.balanced, cp.causal) if cp.variant != "alltoall" else 1.0
    if k == 1 and imb == 1.0:
        return c
    return replace(c, flops=c.flops * k * imb, model_flops=c.model_flops * k, bytes=c.bytes * k)


def _block_bytes(plan: Plan, i: int, names: Sequence[str], itemsize: int | None = None) -> int:
    prog = plan.program
    op = prog.ops[i]
    req = plan.ops[i].required
    total = 0
    for p in names:
        n = op.inputs.get(p)
        if not isinstance(n, str):
            continue
        t = prog.tensors[n]
        a = req.get(p)
        shape = largest_shard(a.dims_mapping, t.shape, a.mesh.shape) if isinstance(a, TensorDistAttr) else t.shape
        total += math.prod(shape) * (itemsize or t.itemsize)
    return total


def ring_costs(plan: Plan, times: Sequence[float]) -> list[RingCost]:
    """The ring of every ring attention op of ``plan``, ``times[i]`` op i's compute on the busiest
    rank (:func:`cp_op_cost`): the KV blocks (and the positions) sent on under each step, the
    backward's dK / dV blocks with them (``GRAD_ACCUM_ITEMSIZE`` of the framework), timed as one
    send/recv over the ring's mesh dims by the plan's cost model."""
    out: list[RingCost] = []
    for cp in cp_ops(plan):
        if cp.ring is None:
            continue
        i = cp.index
        blocks = _block_bytes(plan, i, cp.ring.blocks)
        grads = 0
        if cp.ring.grads:
            kv = [p for p in cp.ring.blocks if not p.endswith("positions")]
            grads = _block_bytes(plan, i, kv, GRAD_ACCUM_ITEMSIZE.get(plan.runtime.framework))

        def send(nbytes: int, dims: tuple[int, ...] = cp.dims) -> float:
            return plan.cost.collective_time("send_recv", dims, nbytes, plan.mesh.shape)

        r = ring_cost(i, bool(cp.ring.grads), cp.ranks, blocks, grads, send, times[i], cp.balanced)
        out.append(replace(r, imbalance=causal_imbalance(cp.ranks, cp.balanced, cp.causal)))
    return out


def ring_buffers(plan: Plan) -> dict[int, int]:
    """Bytes a ring attention op holds beyond its inputs and outputs while it runs: the two KV
    blocks in flight (the one received, the one sent on), and in the backward the two dK / dV
    accumulators in flight too."""
    out: dict[int, int] = {}
    for cp in cp_ops(plan):
        if cp.ring is None:
            continue
        kv = [p for p in cp.ring.blocks if not p.endswith("positions")]
        size = 2 * _block_bytes(plan, cp.index, cp.ring.blocks)
        if cp.ring.grads:
            size += 2 * _block_bytes(plan, cp.index, kv, GRAD_ACCUM_ITEMSIZE.get(plan.runtime.framework))
        out[cp.index] = size
    return out


def regathers(plan: Plan) -> frozenset[int]:
    """Indices in ``plan.reshards`` of the K / V all-gathers an allgather attention's grad reads
    shared with its forward's: both frameworks keep the local K and V and gather them again for
    the backward (Transformer Engine's AttnFuncWithCPAndKVAllGather, torch's rotater), so the
    gathered copy lives in each pass alone and the backward pays its all-gather again."""
    grads = {c.index for c in cp_ops(plan) if c.variant == "allgather" and plan.program.ops[c.index].phase == "backward"}
    if not grads:
        return frozenset()
    return frozenset(k for k, r in enumerate(plan.reshards) if r.shared and not r.output and r.op_index in grads
                     and any(s.kind == "all_gather" for s in r.plan.steps))


__all__ = ["CP_ATTENTION", "CP_RULES", "CpOp", "GRAD_ACCUM_ITEMSIZE", "cp_op", "cp_op_cost", "cp_ops",
           "regathers", "ring_buffers", "ring_costs", "RingCost", "causal_imbalance", "kv_block_bytes", "rank_blocks",
           "ring_cost", "ring_exposed"]
