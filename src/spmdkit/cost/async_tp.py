"""torch's async tensor parallelism as it runs: ``--tp-comm-overlap`` under an FSDP2 framework
(torchtitan's ``experimental.enable_async_tensor_parallel``: torch.compile's micro-pipeline TP
pass over symmetric memory). Standard library only. docs/devices.md, "Communication".

What the sources show (torch 2.6 of December 2024, the torchtitan runs' nightly):

- Which collectives are fused (``torch/_inductor/fx_passes/micro_pipeline_tp.py``): an
  all-gather whose result feeds matmuls as their left operand, gathered along a row dim
  (``fuse_all_gather_matmul``: every such consumer's B in one ``fused_all_gather_matmul``;
  "Decomposing the matmul on the K dimension is not supported": a weight gradient's ``X^T dY``
  is not fused); a reduce-scatter whose input is one matmul's output used by nothing else
  (``fuse_matmul_reduce_scatter``: a sum of matmuls, the backward's ``dX`` of q / k / v or of
  the gate and up projections, is not fused). The pass runs on the graphs torch.compile makes:
  torchtitan compiles each transformer block (``apply_compile``), not the embedding, the final
  norm, the output head or the loss, whose collectives stay NCCL's. Under float8 (torchao's
  ``Float8ColwiseParallel`` / ``Float8RowwiseParallel``) the forward's input, and the backward's
  output gradient (``NoopFwToFloat8BwDynamic`` after the output's ``redistribute``), are cast
  before their all-gathers (:mod:`spmdkit.cost.float8_tp`) and the gathered float8 tensors feed
  ``_scaled_mm`` GEMMs: fused alike (``fused_all_gather_scaled_matmul`` /
  ``fused_scaled_matmul_reduce_scatter``). Under torchao's rowwise recipe (``--float8-recipe
  rowwise``, torch 38410cf9 of June 2025) the TP is plain and the float8 casts run on the gathered
  bf16 tensor, between the all-gather and the ``_scaled_mm``: the all-gather-matmuls are not fused
  (pytorch/pytorch#149990, open: "the matmul-reduce-scatters were being fused properly ... however,
  the all-gather-matmul patterns were NOT being fused properly" with rowwise scales; the
  matmul-reduce-scatter's rowwise support is pytorch/pytorch#149247, merged 2025-03): those
  all-gathers stay NCCL's, the reduce-scatters are fused.
- How a fused op runs (``torch/distributed/_symmetric_memory/__init__.py``):
  ``_pipelined_all_gather_and_consume`` consumes the local shard first while it is copied to the
  rank's symmetric buffer, then pulls one peer's shard at a time (a copy, no SMs) and runs its
  GEMM, steps alternating between two streams (the copy of step k waits for the GEMM of step
  k - 2 on its stream; two copies do not overlap); ``_pipelined_produce_and_all2all`` computes
  the chunk each peer needs into a buffer, barrier, and the peer pulls it (the GEMM of step k
  waits for the copy of step k - 2 on its stream), the local chunk last; then
  ``_fused_matmul_reduce_scatter_impl`` sums the ``n`` stacked partials in one kernel
  (``reduce_fn(stacked_partials.view(n, M / n, N), dim=0)``). Each GEMM is one of ``n`` row
  chunks (``M / n`` rows): priced at that shape's rate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from spmdkit.cost.devices import Device
from spmdkit.engine.facts import OpCost
from spmdkit.program.plan import Plan


def all_gather_matmul_s(comm_s: float, chunk_s: float, n: int) -> float:
    """Seconds of ``fused_all_gather_matmul`` over ``n`` ranks: GEMM chunks of ``chunk_s`` (the
    local one first, at once), ``n - 1`` peer copies of ``comm_s / (n - 1)`` each (the
    all-gather's bytes over the same link); copy k starts when copy k - 1 is done and the GEMM
    of step k - 2 (its stream's last) is; GEMM k after copy k and GEMM k - 1 (the SMs)."""
    if n <= 1:
        return chunk_s
    c = comm_s / (n - 1)
    mm = [chunk_s]
    cp = 0.0
    for k in range(1, n):
        cp = max(mm[k - 2] if k >= 2 else 0.0, cp) + c
        mm.append(max(cp, mm[k - 1]) + chunk_s)
    return mm[-1]


def matmul_reduce_scatter_s(comm_s: float, chunk_s: float, n: int) -> float:
    """Seconds of ``fused_matmul_reduce_scatter``'s pipeline over ``n`` ranks (the reduction of
    the partials after it not included): steps 1 .. n - 1 each compute a peer's chunk (after
    the GEMM before, and after the copy of step k - 2 on the same stream), then that peer's
    copy of ``comm_s / (n - 1)`` (after the copy before); the local chunk last, on the stream
    of the even steps."""
    if n <= 1:
        return chunk_s
    c = comm_s / (n - 1)
    mm_end = 0.0
    cp: dict[int, float] = {0: 0.0}
    for k in range(1, n):
        mm_end = max(mm_end, cp.get(k - 2, 0.0)) + chunk_s
        cp[k] = max(mm_end, cp[k - 1]) + c
    last_even = max((k for k in cp if k % 2 == 0), default=0)
    local = max(mm_end, cp[last_even]) + chunk_s
    return max(local, cp[n - 1])


def fused_exposed(kind: str, comm_s: float, window_s: float, chunked_s: float, n: int, reduce_s: float = 0.0) -> float:
    """Seconds a fused collective adds beyond its GEMMs' own ``window_s`` (unsplit): the
    pipeline of ``n`` chunks of ``chunked_s / n`` each (``chunked_s``: the GEMMs at the
    chunks' shapes) and, for a reduce-scatter, the partials' reduction ``reduce_s``."""
    chunk = chunked_s / max(1, n)
    total = all_gather_matmul_s(comm_s, chunk, n) if kind == "all_gather" else \
        matmul_reduce_scatter_s(comm_s, chunk, n) + reduce_s
    return max(0.0, total - window_s)


def _compiled(layer: str) -> bool:
    """An op of a transformer block (torchtitan compiles each block; ``layer N`` tags)."""
    return layer.startswith("layer ")


def _chunked(c: OpCost, device: Device, gemm_ix: Sequence[int], share_s: float, n: int) -> float:
    """``share_s`` (the seconds of the op's GEMMs ``gemm_ix``) with each GEMM split into ``n``
    row chunks, each at its own shape's rate."""
    if not c.gemms:
        return share_s
    key = "fp8" if c.fp8 else device._key(c.dtype)
    full = split = 0.0
    for g in gemm_ix:
        b, m, nn, k = c.gemms[g]
        rows = max(1, math.ceil(m / n))
        full += 2.0 * b * m * nn * k / device.gemm_rate(key, b, m, nn, k)
        split += n * 2.0 * b * rows * nn * k / device.gemm_rate(key, b, rows, nn, k)
    return share_s * (split / full) if full > 0 else share_s


def _share(c: OpCost, t: float, gemm_ix: Sequence[int]) -> float:
    """The seconds of an op's GEMMs ``gemm_ix`` (their share of its time ``t`` by FLOPs)."""
    if len(c.gemms) < 2:
        return t
    f = [b * m * n * k for b, m, n, k in c.gemms]
    return t * sum(f[g] for g in gemm_ix) / sum(f) if sum(f) > 0 else t


def fused_window(plan: Plan, costs: list[OpCost], times: list[float], device: Device, i: int, tensor: str,
                 kind: str, producer: dict[str, int], readers: dict[str, list[int]], n: int) -> tuple[float, float] | None:
    """(the fused GEMMs' seconds, the same split into ``n`` row chunks) of the all-gather /
    reduce-scatter of ``tensor`` at op ``i`` that torch's micro-pipeline TP fuses; None where
    it does not (the collective stays NCCL's)."""
    ops = plan.program.ops
    if not _compiled(ops[i].layer):
        return None
    window = chunked = 0.0
    if kind == "all_gather":
        phase = ops[i].phase
        for j in readers.get(tensor, ()):
            op = ops[j]
            if j < i or op.phase != phase or not costs[j].matmul or not _compiled(op.layer):
                continue
            if costs[j].fp8 and plan.runtime.float8_rowwise:  # cast after the gather: not fused (#149990)
                continue
            role = next((k for k, v in op.inputs.items() if v == tensor), "")
            if op.phase == "forward" and role in ("x", "input"):
                ix: list[int] = list(range(len(costs[j].gemms))) or [0]
            elif role == "out_grad" and costs[j].gemms:
                # the input gradient dY W^T: dY its left operand (dW = X^T dY is not fused); under
                # torchao's float8 dY is cast to e5m2 on its shard before the gather
                # (spmdkit.cost.float8_tp), and the gathered float8 dY feeds the _scaled_mm as is
                ix = [0]
            else:
                continue
            s = _share(costs[j], times[j], ix)
            window += s
            chunked += _chunked(costs[j], device, ix, s, n)
        return (window, chunked) if window > 0 else None
    j = producer.get(tensor, -1)
    if j < 0 or not costs[j].matmul or not _compiled(ops[j].layer):
        return None  # a sum of matmuls (or no matmul) feeds it: not fused
    outs = list(ops[j].output_names())
    ix = [0] if len(costs[j].gemms) >= 2 and outs and outs[0] == tensor else list(range(len(costs[j].gemms))) or [0]
    s = _share(costs[j], times[j], ix)
    return s, _chunked(costs[j], device, ix, s, n)


def reduce_partials_s(device: Device, partial_bytes: float, n: int) -> float:
    """The reduction after ``fused_matmul_reduce_scatter``: the ``n`` stacked partials (the
    GEMM's whole output, ``partial_bytes``) read, one ``1 / n`` written, at the HBM rate."""
    return max(device.rates.launch_s, partial_bytes * (1 + 1 / max(1, n)) / device.hbm_rate)


__all__ = ["all_gather_matmul_s", "fused_exposed", "fused_window", "matmul_reduce_scatter_s", "reduce_partials_s"]
