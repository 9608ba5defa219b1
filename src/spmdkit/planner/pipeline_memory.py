"""A pipeline rank's memory as ``torch.distributed.pipelining`` and FSDP2 hold it under
``--framework torchtitan`` (torchtitan 9dec370, 2024-12-26, on torch 1963fc8, 2024-12-23: the
versions of torchtitan's ``benchmarks/llama3_h100_202412_torchtitan.md``). Standard library
only. docs/devices.md, "Memory" ("Pipelines").

The rank runs its units (forward ``F`` / full backward ``B`` of one microbatch on one of its
stages) in the order torch's schedule gives them (:func:`torch_order`), and its memory is walked
unit by unit (:func:`torch_rank_memory`):

- **Stash.** A stage keeps what its backward reads of every microbatch forwarded and not yet
  backwarded (the stage's ``stash_bytes``); the unit running holds its working peak.
- **FSDP2 with a pipeline** (``torch/distributed/pipelining/stage.py``,
  ``_PipelineStageBase.backward_maybe_with_nosync``): every backward but the stage's last runs
  with ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``, so the
  stage's gradients are accumulated unsharded (in fp32, FSDP2's ``reduce_dtype``:
  ``FSDPParam.to_accumulated_grad_if_needed``) from its first backward of the step; after its
  last backward ``run_post_backward`` reduce-scatters them (the unsharded ones are freed, the
  sharded ones made) and reshards its parameters, which torchtitan keeps gathered from its first
  forward (``apply_fsdp``: ``reshard_after_forward=False`` when pp is enabled). Before its first
  backward a stage holds no gradient (torchtitan's ``optimizers.zero_grad()`` sets them to None).
- **The stage's buffers** (``_PipelineStageBase``): a receive buffer for every microbatch's
  input activations (``_prepare_forward_infra``: ``args_recv_info[chunk_id]`` for each of the
  ``n_microbatches``, allocated at the first step and kept) and for every microbatch's output
  gradients (``_prepare_backward_infra``: ``grad_recv_info[mb_index]``); every forward's output
  in ``output_chunks`` until the step ends (``forward_one_chunk`` appends it on every stage;
  pytorch/pytorch#153383, 2025-05, kept it on the last stage only); every backward's input
  gradient in its receive buffer's ``.grad`` until the next step's ``clear_runtime_states``
  (pytorch/pytorch#164329, 2025-10, released it after the send).
- **The last reduce-scatter's input** (torch 1963fc8; pytorch/pytorch#144535, 2025-01, changed
  it): ``run_post_backward`` calls each FSDP group's ``post_backward`` but not the root's
  ``_root_post_backward_final_callback``. ``FSDPParamGroup.post_backward`` frees the previous
  group's reduce-scatter input (``comm_ctx.reduce_scatter_state``) when it starts its own and
  keeps its own there; only that callback, on a last backward, releases the last one. So the
  stage's last group's reduce-scatter input (``foreach_reduce``: its unsharded gradients in the
  fp32 reduce dtype, flat, on the default stream; :func:`spmdkit.cost.memory_fsdp2.last_group`)
  stays allocated from the stage's last backward of one step to its last backward of the next,
  through every unit of the walk, one per model chunk (each chunk is a root with its own comm
  context).
- **FSDP2's side-stream pools** (reserved, not allocated: ``torch.cuda.max_memory_reserved``,
  what torchtitan logs). The caching allocator reuses a freed block only for the stream it was
  allocated on (``CUDACachingAllocator``: a block's free-list key is its stream; under
  torchtitan's ``expandable_segments:True`` a segment per stream), so what FSDP2 allocates on
  its own streams stays reserved there. ``foreach_reduce`` allocates the reduce-scatter output,
  of which the sharded gradients are views, on the reduce-scatter stream (pytorch/pytorch#129721,
  2024-06, moved the input to the default stream and kept the output there: "we iteratively
  allocate them through backward and free them altogether after optimizer"): the sharded
  gradients freed by the next step's ``zero_grad`` stay reserved in that pool while the stage's
  unsharded ones are accumulated, so a stage whose last backward has not run reserves its
  sharded gradients' bytes too. ``foreach_all_gather`` allocates the all-gather output (one
  FSDP group's gathered parameters, flat) on the all-gather copy-in stream, and the forward
  defers freeing it to the next group's all-gather (``FSDPCommContext.all_gather_state``): two
  consecutive groups' outputs in that pool, one pool per model chunk (each chunk is an FSDP
  root with its own streams): :mod:`spmdkit.cost.memory_fsdp2`.

Schedules (``torch/distributed/pipelining/schedules.py``): ``Schedule1F1B``: ``min(m, p - r)``
forwards, then one backward and one forward until the forwards are done, then the backwards;
``ScheduleInterleaved1F1B``: ``min((v - 1) * mpr + 2 (p - 1 - r), m v)`` forwards (``mpr``: the
microbatches of a round, ``m // max(1, m // p)``; a round of ``mpr`` microbatches on one local
stage, then the next), then one forward and one backward (the backwards from the last local
stage down), then the backwards (``_get_1f1b_rank_ops``; torch's earlier form counts rounds of
``p`` microbatches, the same wherever ``m`` is a multiple of ``p``, as spmdkit's interleaved
schedule requires); ``ScheduleGPipe``: every forward, then every backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: the schedules :func:`torch_order` knows (spmdkit's names)
TORCH_SCHEDULES = ("1f1b", "interleaved", "gpipe")


@dataclass(frozen=True)
class ChunkBytes:
    """One of a rank's stages (a model chunk), bytes per device."""

    stash: int          # what one microbatch keeps for the backward
    working: int        # the working peak of one microbatch (its own stash included)
    parameters: int     # sharded (fp32 under torchtitan), always held
    states: int         # optimizer states, always held
    gradients: int      # sharded, made by the last backward's reduce-scatter
    unsharded_parameters: int  # gathered from the first forward to the last backward
    unsharded_gradients: int   # accumulated from the first backward to the last
    input_bytes: int    # one microbatch's received activations (0 on the first stage)
    output_bytes: int   # one microbatch's output (the next stage's input; the logits on the last)
    grad_recv_bytes: int  # one microbatch's output gradients received (0 on the last stage)
    gather_pool: int = 0  # FSDP2's all-gather copy-in pool: two consecutive groups' gathered parameters
    rs_held: int = 0    # the last group's reduce-scatter input, held from one step's last backward to the next's
    #: its parameters sharded by FSDP2 (ZeRO-3); False: autograd accumulates ``gradients`` in place
    #: (``param.grad``, DDP's ``no_sync`` or no data parallelism) from the stage's first backward on
    fsdp: bool = True


@dataclass(frozen=True)
class RankPeak:
    """The rank's memory at its fullest unit, split as :class:`spmdkit.cost.memory.Memory` does."""

    parameters: int
    gradients: int
    optimizer_states: int
    activations: int    # stash + working + the pipelining buffers
    buffers: int        # of which the pipelining buffers
    unit: tuple[str, int, int]  # (F | B, local stage, microbatch)
    in_flight: float    # whole-stage microbatches held then (stash units over the rank's stages)
    pools: int = 0      # FSDP2's side-stream pools: reserved, not allocated (module docstring)


def torch_order(schedule: str, p: int, v: int, m: int, r: int) -> list[tuple[str, int, int]] | None:
    """Rank ``r``'s units ``(kind, local stage, microbatch)`` in the order torch's schedule runs
    them (module docstring); None where torch's schedule of that time cannot run it (an
    interleaved ``m`` that is not a multiple of its rounds) or ``schedule`` is not one of
    :data:`TORCH_SCHEDULES`."""
    if schedule == "gpipe":
        return [("F", 0, j) for j in range(m)] + [("B", 0, j) for j in range(m)]
    if schedule == "1f1b":
        warm = min(m, p - r)
        single = [("F", 0, j) for j in range(warm)]
        f = warm
        for b in range(m):
            single.append(("B", 0, b))
            if f < m:
                single.append(("F", 0, f))
                f += 1
        return single
    if schedule != "interleaved":
        return None
    rounds = max(1, m // p)
    if m % rounds:
        return None
    mpr = m // rounds
    warm = min((v - 1) * mpr + 2 * (p - 1 - r), m * v)
    fmb, bmb = [0] * v, [0] * v
    out: list[tuple[str, int, int]] = []

    def fwd(step: int) -> None:
        c = (step // mpr) % v
        out.append(("F", c, fmb[c]))
        fmb[c] += 1

    def bwd(step: int) -> None:
        c = v - 1 - ((step - warm) // mpr) % v
        out.append(("B", c, bmb[c]))
        bmb[c] += 1

    for op in range(m * v + warm):
        if op < warm:
            fwd(op)
        elif op < m * v:
            fwd(op)
            bwd(op)
        else:
            bwd(op)
    return out


def torch_rank_memory(chunks: Sequence[ChunkBytes], order: Sequence[tuple[str, int, int]], m: int) -> RankPeak:
    """The rank's memory at the unit of ``order`` where it is fullest (module docstring): the
    sharded parameters and states, each stage's gathered parameters from its first forward to
    its last backward, its unsharded gradients from its first backward to its last and its
    sharded ones after, the stash of the microbatches in flight, the unit's working peak, and the
    stage's buffers (receive buffers for ``m`` microbatches, the outputs and input gradients of
    the units done); the side-stream pools (reserved: :attr:`RankPeak.pools`) count towards the
    fullest unit."""
    v = len(chunks)
    const_p = sum(c.parameters for c in chunks)
    states = sum(c.states for c in chunks)
    recv = sum(m * (c.input_bytes + c.grad_recv_bytes) for c in chunks)
    copy_in = sum(c.gather_pool for c in chunks)
    rs_held = sum(c.rs_held for c in chunks)  # held at every unit (module docstring)
    held = 0        # stash units held (microbatches forwarded and not backwarded, over the stages)
    held_bytes = 0  # their stash
    fwd_done, bwd_done = [0] * v, [0] * v
    best: RankPeak | None = None
    best_total = -1
    for kind, c, j in order:
        ch = chunks[c]
        started = [bwd_done[i] > 0 or (kind == "B" and i == c) for i in range(v)]
        finished = [bwd_done[i] == m for i in range(v)]
        gathered = [fwd_done[i] > 0 or i == c for i in range(v)]
        act = ch.working + held_bytes - (ch.stash if kind == "B" else 0)
        buf = recv + sum(fwd_done[i] * chunks[i].output_bytes + bwd_done[i] * chunks[i].input_bytes for i in range(v))
        params = const_p + sum(chunks[i].unsharded_parameters for i in range(v) if gathered[i] and not finished[i])
        grads = sum(chunks[i].unsharded_gradients for i in range(v) if started[i] and not finished[i])
        grads += sum(chunks[i].gradients for i in range(v) if finished[i] or (started[i] and not chunks[i].fsdp))
        grads += rs_held
        pools = copy_in + sum(chunks[i].gradients for i in range(v) if not finished[i] and chunks[i].fsdp)
        total = params + grads + states + act + buf + pools
        if total > best_total:
            best_total = total
            best = RankPeak(params, grads, states, act + buf, buf, (kind, c, j), (held + (kind == "F")) / v, pools)
        if kind == "F":
            held, held_bytes = held + 1, held_bytes + ch.stash
            fwd_done[c] += 1
        else:
            held, held_bytes = held - 1, held_bytes - ch.stash
            bwd_done[c] += 1
    if best is None:
        raise ValueError("torch_rank_memory: an empty order")
    return best


__all__ = ["ChunkBytes", "RankPeak", "TORCH_SCHEDULES", "torch_order", "torch_rank_memory"]
