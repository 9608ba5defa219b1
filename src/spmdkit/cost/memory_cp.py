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
"""

from __future__ import annotations

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


def allgather_buffers(plan: Plan) -> dict[int, int]:
    """Op index -> bytes torch's context_parallel holds while that allgather cp attention op (or
    its grad) runs beyond what the plan counts (its gathered un-repeated K and V), under
    ``--framework torchtitan``; empty under the other frameworks."""
    out: dict[int, int] = {}
    for cp in torch_cp_ops(plan):
        i = cp.index
        x = local_qkv(plan, i)
        q, kv = x.q * x.itemsize, x.kv * x.itemsize
        backward = plan.program.ops[i].phase == "backward"
        out[i] = max(0, torch_allgather_bytes(q, kv, 0, x.rep, cp.ranks, backward) - cp.ranks * kv)
    return out


__all__ = ["allgather_buffers", "torch_allgather_bytes"]
