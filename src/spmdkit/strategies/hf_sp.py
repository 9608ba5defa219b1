"""``sp`` (with ``megatron``) on an imported program (:mod:`spmdkit.strategies.hf`): Megatron
sequence parallel, the residual stream sharded on its sequence over tp between the gathered inputs
of the column layers and the reduce-scattered outputs of the row layers; the MoE blocks routed
whole (their tokens gathered over tp) or one chunk a tp rank (ETP = 1). Standard library only."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from spmdkit.core.dist_attr import Entry
from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.program.ir import Program
from spmdkit.strategies.experts import chunk_entries
from spmdkit.strategies.hf_moe import block_module, moe_ends, moe_projections
from spmdkit.strategies.hf_program import data_inputs, forward_readers


def sequence_parallel(prog: Program, mesh: ProcessMesh, sharded: Mapping[str, str], dm: Any,
                      batch_dims: Entry, tp: int, cp: Entry | None = None, fold: int | None = None) -> None:
    """Megatron sequence parallel on an imported program: the residual stream (the outputs of
    the adds that take a row-parallel layer's output, and of the vocab-parallel embeddings)
    sharded on its sequence axis (1) over tp, so the row layers' partial outputs are
    reduce-scattered into it and the norms between run on sequence shards; the inputs of the
    column-parallel layers and of the LM head are gathered (sequence whole), and so are the
    gradients of the row layers' outputs in the backward step. Under ``cp`` (the sequence's entry:
    the cp mesh dim, or ``(cp, ep)`` with ``ep-from=cp``) the residual is co-sharded ``(cp, tp)``
    (``(cp, ep, tp)``) on its sequence (the cp rank's share split again over tp) and the gathered
    tensors stay on their cp share, as the zoo's (docs/context.md).
    ``batch_dims``: the batch axis' entry (``dp``, or ``(dp, ep)`` with expert parallelism:
    :func:`spmdkit.strategies.experts.batch_entry`); ``fold``: the tp dim the experts are folded
    over (ETP = 1), the MoE blocks then routed one chunk a tp rank (:func:`_moe_sequence_parallel`)."""
    size = mesh.shape[tp]
    lead = [d for d in ((batch_dims,) if isinstance(batch_dims, int) else batch_dims) if d != -1]
    fwd = [(i, op) for i, op in enumerate(prog.ops) if op.phase == "forward"]
    readers = forward_readers(prog)
    seq: list[str] = []
    row_out: list[str] = []
    gather: list[str] = []
    # a weight read through its transpose (FalconLinear's x @ W.T): the transpose -> the weight
    via = {op.output_names()[0]: op.inputs["x"] for _i, op in fwd if op.rule == "transpose"
           and isinstance(op.inputs.get("x"), str) and op.inputs["x"] in sharded}
    # the MoE blocks run whole on the gathered tokens (not under ETP = 1): a shared expert's row
    # layer inside one reduces its output whole, the block's output returned to sequence shards
    modules = getattr(prog, "modules", None) or {}
    blocks = tuple(b + "." for b in (block_module(prog, m) for m in moe_projections(prog)) if b) if fold is None else ()
    for i, op in fwd:
        y = op.inputs.get("y") if op.rule == "matmul" else op.inputs.get("weight")
        role = sharded.get(via.get(y, y)) if isinstance(y, str) else None
        if role is None:
            continue
        if role == "row" and blocks and modules.get(i, ("", ""))[0].startswith(blocks):
            continue
        if op.rule in ("embedding", "c_embedding"):
            if role == "vocab":  # a token table (not T5's per-head position bias)
                seq.append(op.output_names()[0])
        elif role in ("column", "vocab_head") or (role == "vocab" and op.rule == "matmul"):  # a tied head too
            gather.append(op.inputs["x"])
        elif role == "row":
            cur = op.output_names()[0]
            row_out.append(cur)  # reduce-scattered right after the layer (a post-norm then runs on shards)
            for _ in range(4):  # through a bias add and a reshape to the residual add
                nxt = None
                for _j, r, _p in readers.get(cur, []):
                    ins = [prog.tensors[n] for n in r.input_names()]
                    o = r.output_names()
                    if r.rule == "add" and len(ins) == 2 and all(t.kind != "parameter" for t in ins) \
                            and ins[0].shape == ins[1].shape:
                        seq.append(o[0])
                        nxt = None
                        break
                    if r.rule in ("add", "reshape") and o:
                        nxt = o[0]
                if nxt is None:
                    break
                cur = nxt
    for op in prog.ops:
        y = op.inputs.get("y")
        if op.phase == "backward" and op.rule == "matmul_grad" and isinstance(y, str) \
                and sharded.get(via.get(y, y)) == "row":
            gather.append(op.inputs["out_grad"])

    producer = {o: op for op in prog.ops if op.phase == "forward" for o in op.output_names()}

    def grads_of(n: str) -> list[str]:
        """The gradients of activation ``n`` (the importer's ``n.grad``, ``n.gradK``, and their
        sum ``n.grad.sum``)."""
        pat = re.compile(re.escape(n) + r"\.grad(\d*|\.sum)")
        return [g for g in prog.tensors if pat.fullmatch(g) and prog.tensors[g].shape == prog.tensors[n].shape]

    batch = {prog.tensors[n].shape[0] for n in data_inputs(prog) if prog.tensors[n].shape}

    def flat(shape: tuple[int, ...]) -> bool:
        return len(shape) == 2 and bool(batch) and shape[0] % max(batch) == 0 and shape[0] > max(batch)

    # a residual stream that is also flattened ([batch * seq, hidden]: OPT's MLP, GPT-2's Conv1D)
    # is cut over tp in the flattened order, batch-major: with 2 or more sequences per dp rank
    # that tp divides, the [batch, seq, hidden] tensors are cut on the batch axis to match (each
    # rank still holds 1/tp of the tokens; Megatron's [seq, batch] layout flattens seq-major)
    local = max(batch) // math.prod(mesh.shape[d] for d in lead) if batch else 1
    by_batch = cp is None and local > 1 and local % size == 0 and any(flat(prog.tensors[n].shape) for n in (*seq, *row_out))

    def shard_seq(n: str) -> None:
        shape = prog.tensors[n].shape
        if len(shape) == 3 and by_batch and shape[0] == max(batch):
            dm(n)[0] = [*lead, tp] if lead else tp
            return
        if flat(shape):
            # tokens flattened ([batch * seq, hidden], GPT-2's Conv1D): batch over dp, then seq over tp
            if (shape[0] // max(batch)) % size:
                raise ProgramError(f"--strategy sp: {n} has {shape[0] // max(batch)} tokens per sequence, not "
                                   f"divisible by tp={size}")
            dm(n)[0] = [*lead, tp] if lead else tp
            return
        if len(shape) != 3:
            return
        if shape[1] % size:
            raise ProgramError(f"--strategy sp: {n} has sequence length {shape[1]}, not divisible by tp={size}")
        d = dm(n)
        d[0], d[1] = batch_dims, (tp if cp is None else [*_dims(cp), tp])

    for n in seq:
        # the residual stream and its gradient, sequence-sharded
        shard_seq(n)
        for g in grads_of(n):
            shard_seq(g)
    for n in row_out:
        shard_seq(n)  # its gradient stays gathered: the row layer's weight gradient reads it whole
    for n in gather:
        d = dm(n)
        if lead and d:
            d[0] = batch_dims
        if cp is not None and len(d) == 3:
            d[1] = cp
        # the summed gradient of a gathered input: reduce-scattered back to sequence shards
        # (of the [batch, seq, hidden] tensor a flattened input was reshaped from)
        src = producer.get(n)
        if len(prog.tensors[n].shape) == 2 and src is not None and src.rule == "reshape" \
                and len(prog.tensors[src.inputs["x"]].shape) == 3:
            n = src.inputs["x"]
        gs = grads_of(n)
        total = n + ".grad.sum" if n + ".grad.sum" in gs else (n + ".grad" if n + ".grad" in gs else None)
        if total is not None:
            shard_seq(total)
    _moe_sequence_parallel(prog, mesh, dm, batch_dims, tp, cp, fold, frozenset(gather), shard_seq, grads_of)


def _dims(entry: Entry) -> tuple[int, ...]:
    """The mesh dims of a sharded entry (one dim or a co-shard), major first."""
    return (entry,) if isinstance(entry, int) else tuple(entry)


def _moe_sequence_parallel(prog: Program, mesh: ProcessMesh, dm: Any, batch_dims: Entry, tp: int, cp: Entry | None,
                           fold: int | None, gathered: frozenset[str], shard_seq: Callable[[str], None],
                           grads_of: Callable[[str], list[str]]) -> None:
    """The MoE blocks (:func:`spmdkit.strategies.hf_moe.moe_ends`) under ``sp``, a block with a shared
    expert too (its column layers read the same gathered tokens, its row layer's output reduced whole
    inside the block and added to the experts' before the block's output returns to sequence shards:
    torchtitan's MoE module boundary, ``PrepareModuleInputOutput`` around router, experts and shared
    experts, torchtitan 9810191^ torchtitan/models/llama4/infra/parallelize.py ``apply_moe_ep_tp``):

    - routed whole, or in cp chunks only (ETP = tp), as Megatron and torchtitan run one under tp:
      its tokens gathered before the router (every tp rank routes the whole sequence, each expert
      split over tp; their gradient reduce-scattered back), its output returned to sequence shards
      (its gradient gathered); under cp gathered over tp only: the sequence ([B, S, H]) or the
      chunks ([B, cp, S / cp, H]: each cp rank its own tokens) kept over cp;
    - routed one chunk a tp rank (ETP = 1, ``fold``: Megatron's token path): nothing gathered,
      the block's ``[B, S, H]`` ends and their gradients sequence-sharded as the residual stream
      and the chunks ``[B, T, S / T, H]`` on each rank's own chunk
      (:func:`spmdkit.strategies.experts.chunk_entries`): the tokens go to the experts by the
      all-to-all over the ep x tp group alone.

    ``cp``: the sequence's entry (``(cp, ep)`` with ``ep-from=cp``: the chunks one a cp x ep rank)."""
    seq = _dims(cp) if cp is not None else ()
    ranks = math.prod(mesh.shape[d] for d in seq)
    for moe_in, moe_out in moe_ends(prog, moe_projections(prog)):
        if not moe_in or (fold is not None and set(moe_in) & gathered):
            continue
        shape = prog.tensors[moe_in[0]].shape
        own = chunk_entries(mesh, shape[1], fold, *(seq[:2] if seq else (None,)))[0] if len(shape) == 4 else -1
        mine = fold is not None and fold in ((own,) if isinstance(own, int) else own)
        for m in (*moe_in, *moe_out):
            for t in (m, *grads_of(m)):
                shape = prog.tensors[t].shape
                if mine and len(shape) == 3:
                    shard_seq(t)
                    continue
                d = dm(t)
                d[0] = batch_dims
                if mine and len(shape) == 4:
                    d[1] = own
                elif cp is not None and (len(shape) == 3 or (len(shape) == 4 and shape[1] == ranks)):
                    d[1] = cp
        if not mine:
            for g in grads_of(moe_in[-1]):
                shard_seq(g)
            shard_seq(moe_out[-1])


__all__ = ["sequence_parallel"]
