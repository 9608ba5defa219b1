"""What torch's context_parallel holds while an allgather cp attention runs, beyond the plan's
tensors (``--framework torchtitan``, ``--cp-attention allgather``). Standard library only.
docs/devices.md, "Context parallelism".

torchtitan (9dec370, 2024-12-26) runs its attention under ``context_parallel`` with
``_RotateMethod.ALL_GATHER`` (``experimental.context_parallel_rotate_method = "allgather"``); torch
(1963fc8, 2024-12-23) then runs ``scaled_dot_product_attention`` as
``torch/distributed/tensor/experimental/_attention.py``'s ``_templated_ring_attention`` and its
backward ``_templated_ring_attention_backward``. What they hold, per rank:

- K and V as torchtitan's ``Attention.forward`` passes them: after ``repeat_kv`` (``n_rep`` =
  query heads / KV heads copies of each KV head), transposed, so ``key.contiguous()`` and
  ``value.contiguous()`` copy them (``K + V``, each the size of the local queries);
- ``torch.cat([key.flatten(), value.flatten()])`` for the rotater (``K + V``) and the
  ``_AllGatherRotater``'s gathered buffer of every cp rank's (``cp (K + V)``), gathered again in
  the backward (``kv_rotater``);
- forward: ``_SDPAMerger(convert_to_f32=True)``'s fp32 output accumulator (``2 Q``) and a step's
  output (``Q``);
- backward: the fp32 accumulators of dQ (``2 Q``), and of dK / dV, which travel round the ring
  (``dkv_rotater``: ``_RotateMethod.ALL_TO_ALL``, ``torch.cat`` of the fp32 dK and dV sent while
  the previous rank's is received: ``2 x 2 (K + V)``), and a step's dQ, dK, dV (``Q + K + V``).

(``Q``, ``K``, ``V``: bytes of the local queries and of the repeated local keys and values in
the activations' dtype.) The plan already counts its own all-gathered K and V (a reshard of the
un-repeated heads, ``cp`` x the local k and v): :func:`allgather_buffers` is the rest.

Under ``--compile`` with the attention recomputed (full recomputation: torchtitan's
``torch.compile(block, fullgraph=True)`` over its checkpointed block traces the forward ring and
its backward into one joint graph), the grad's ``key.contiguous()``, ``value.contiguous()``,
``torch.cat`` and ``all_gather_into_tensor`` are the forward's ops on the same saved K and V, and
AOTAutograd's partitioner runs common-subexpression elimination over the joint graph before it
splits it (``torch/_functorch/partitioners.py``, ``min_cut_rematerialization_partition``: ``if
config.cse: fx_graph_cse(...)``; ``torch/_functorch/compile_utils.py``'s ``fx_graph_cse`` merges
every ``call_function`` node of equal target and arguments except random ops, collectives
included; ``torch._functorch.config.cse = True``). The recomputed forward's gathered buffer and
contiguous copies (``(cp + 1) (K + V)``) are then the grad's: made when the layer runs again
(its forward attention before the MLP's backward, which reads its output) and held until the
grad's last step (:func:`shared_gathers`), across the layer's MLP backward, instead of living in
each pass alone. (Before pytorch/pytorch#147561, 2025-02, the partitioner recomputed
collectives in a checkpointed region like any op; torchtitan 9dec370 ran torch 1963fc8.) The
step's time drops the grad's own gather and copies under the same predicate
(:func:`spmdkit.cost.context_shared.shared_gather_costs`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from spmdkit.cost.context_torch import local_qkv, torch_cp_ops
from spmdkit.program.plan import Plan


def torch_allgather_bytes(q: int, k: int, v: int, rep: int, cp: int, backward: bool) -> int:
    """Bytes ``_templated_ring_attention`` (``backward``: its backward) holds at once beyond its
    inputs and outputs (module docstring): ``q``, ``k``, ``v`` the local bytes of the queries and
    of the un-repeated keys and values, ``rep`` torchtitan's ``repeat_kv`` factor, ``cp`` the
    ranks of the all-gather."""
    kv = rep * (k + v)
    gathered = kv + kv + cp * kv  # the contiguous copies, the rotater's cat, the gathered buffer
    if backward:
        return gathered + 2 * q + 2 * 2 * kv + q + kv
    return gathered + 2 * q + q


def allgather_buffers(plan: Plan, shared: Mapping[int, tuple[int, int]] | None = None) -> dict[int, int]:
    """Op index -> bytes torch's context_parallel holds while that allgather cp attention op (or
    its grad) runs beyond what the plan counts (its gathered un-repeated K and V), under
    ``--framework torchtitan``; empty under the other frameworks. A grad in ``shared``
    (:func:`shared_gathers`) holds neither the gathered buffer and contiguous copies (held apart
    from the layer's recomputation) nor its ``torch.cat`` (the forward's, freed after its
    all-gather): ``(cp + 2) (K + V)`` less."""
    out: dict[int, int] = {}
    for cp in torch_cp_ops(plan):
        i = cp.index
        x = local_qkv(plan, i)
        q, kv = x.q * x.itemsize, x.kv * x.itemsize
        backward = plan.program.ops[i].phase == "backward"
        own = torch_allgather_bytes(q, kv, 0, x.rep, cp.ranks, backward)
        if shared and i in shared:
            own -= (cp.ranks + 2) * x.rep * kv
        out[i] = max(0, own - cp.ranks * kv)
    return out


def shared_gathers(plan: Plan, rerun: Mapping[int, Sequence[int]]) -> dict[int, tuple[int, int]]:
    """Grad op index -> (the op from which, bytes) of the gathered K / V and the contiguous
    copies, ``(cp + 1) (K + V)``, that an allgather cp attention grad shares with its recomputed
    forward under ``--compile`` (module docstring): held from where the backward runs the forward
    op again (``rerun``: :func:`spmdkit.cost.memory_saved.rerun_points`' first map) to the grad. Empty
    when eager (the recomputation's gather is freed after the forward ring, the grad gathers
    again) and for a forward op not recomputed (its grad's gather is the grad's own)."""
    if plan.runtime.eager:
        return {}
    cps = torch_cp_ops(plan)
    ops = plan.program.ops
    again = {i: b for b, fwd in rerun.items() for i in fwd}
    made = {n: c for c in cps if ops[c.index].phase == "forward" for n in ops[c.index].output_names()}
    out: dict[int, tuple[int, int]] = {}
    for c in cps:
        if ops[c.index].phase != "backward":
            continue
        f = next((made[n] for n in ops[c.index].input_names() if n in made), None)
        if f is not None and f.index in again:
            x = local_qkv(plan, f.index)
            out[c.index] = (again[f.index], (c.ranks + 1) * x.rep_kv * x.itemsize)
    return out


__all__ = ["allgather_buffers", "shared_gathers", "torch_allgather_bytes"]
