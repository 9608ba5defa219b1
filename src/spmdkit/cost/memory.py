"""Memory per device of a plan: parameters, gradients, optimizer states, activation peak.

Sizes are local: each tensor's largest shard under its dist attr (a partial tensor is held
whole on every rank), times its dtype's size. Parameters, optimizer states and the
parameter gradients (the gradients the optimizer ops read) are held for the whole step; an
optimizer's updated parameter overwrites its parameter (``inplace_of``) and adds nothing.
Every other tensor (activations, activation gradients, and the copies reshards make) lives
from the op that makes it to the last op that reads it; the activation peak is the largest
sum of live bytes over the program order (one linear pass over the ops).

ZeRO-3 / FSDP (a plan's ``storage``): a parameter counts at its stored shard; the copy each
phase gathers lives over its layer's ops of that phase (from the layer's first op to its last),
so one layer's gathered parameters are live at a time, once in the forward and once in the
backward. With gradient accumulation (``plan.grad_accum`` > 1) a gradient that ZeRO holds
reduce-scattered is held unreduced until the step's one reduction.

``recompute`` (``none``, ``selective``, ``full``; :func:`saved_activations`): a
forward activation that a recomputed region makes and the backward reads lives from its
producer to its last forward reader, and again from the first backward op that reads any of
the region's tensors (the region is run again right before it) to its last reader. A tensor
kept as its producer's shard and gathered again for the backward (sequence parallel's norm
outputs) is held as the shard between its last forward reader and its first backward one.
:attr:`Memory.saved` is what the backward keeps (:func:`saved_activations`).

Activations kept for the backward. :func:`saved_activations` (plan, recompute) reads the program: a forward activation is *kept
for the backward* when a backward op reads its values. Some grad rules read a forward tensor
for its shape only (``add_grad``'s x and y, ``reshape_grad``'s x_shape, ...:
:data:`SHAPE_ONLY`); those reads keep nothing. Each kept tensor is counted once, in the
layer of the earliest layer's backward op that reads it (a layer's input belongs to the
layer whose norm reads it), at its local size under the plan (the largest shard).

A tensor held gathered by an all-gather right after its producer (sequence parallel's
normalised activations, which the column-parallel projections read whole) is kept as the
shard its producer made and gathered again for the backward, as Megatron-LM does
(Korthikanti et al. 2022, section 4.2.2): :attr:`ActivationMemory.regathered` lists those
all-gathers, which :func:`spmdkit.cost.compute.estimate_step` adds to the backward.

Recomputation (``recompute``):

- ``none``: every kept tensor is held from the forward to its backward.
- ``selective``: the attention core of each layer (Korthikanti et al.: ``QK^T``, the
  scaling and mask, softmax, dropout on the probabilities and the product with V) is run
  again in the backward; its outputs are not kept, its inputs are. A core starts at a
  forward ``matmul`` / ``bmm`` of two batched activations (rank >= 3, neither a parameter:
  ``QK^T``) and takes every later forward op that reads a tensor of the core, up to and
  including the next such matmul (the product with V). ``flash_attention`` keeps no
  score-sized tensor: nothing to do.
- ``full``: every transformer layer (the ops of a layer group whose label has a number:
  ``layer 3``) is run again in the backward; only the tensors a layer reads from before it
  (its input) are kept. A program without numbered layer labels (a HuggingFace import,
  labelled by its top module) is refused with a ProgramError.

:data:`RECOMPUTE` names the modes. :func:`recompute_regions` gives the recomputed forward ops.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr, entry_dims, largest_shard
from spmdkit.core.errors import ProgramError
from spmdkit.program.ir import Program
from spmdkit.program.plan import Plan


def local_numel(attr: TensorDistAttr, shape: tuple[int, ...]) -> int:
    """Elements of the largest local shard (uneven splits: the first, largest, piece)."""
    return math.prod(largest_shard(attr.dims_mapping, shape, attr.mesh.shape))


@dataclass(frozen=True)
class UnevenShard:
    """A tensor axis its mesh dims do not divide: ``size`` split in ``parts`` pieces of
    ``largest`` (the first ones) down to ``smallest`` elements (Paddle's uneven split)."""

    tensor: str
    axis: int
    size: int
    parts: int
    mesh_dims: tuple[int, ...]

    @property
    def largest(self) -> int:
        return -(-self.size // self.parts)

    @property
    def smallest(self) -> int:
        return max(0, self.size - self.largest * (self.parts - 1))

    def to_json(self) -> dict[str, object]:
        return {"tensor": self.tensor, "axis": self.axis, "size": self.size, "parts": self.parts,
                "mesh_dims": list(self.mesh_dims), "largest": self.largest, "smallest": self.smallest}


def uneven_shards(plan: Plan) -> list[UnevenShard]:
    """Every (tensor, axis) of a plan sharded over mesh dims whose product does not divide the
    axis (tensors in program order). Memory counts the largest shard of each."""
    out: list[UnevenShard] = []
    mesh_shape = plan.mesh.shape
    for name, t in plan.program.tensors.items():
        attr = plan.attrs.get(name)
        if attr is None:
            continue
        for axis, (size, e) in enumerate(zip(t.shape, attr.dims_mapping)):
            dims = tuple(entry_dims(e))
            k = 1
            for d in dims:
                k *= mesh_shape[d]
            if k > 1 and size % k:
                out.append(UnevenShard(name, axis, size, k, dims))
    return out


RECOMPUTE = ("none", "selective", "full")

#: grad rule -> tensor parameters it reads for their shape (or dtype) only, not their values
SHAPE_ONLY: dict[str, frozenset[str]] = {
    **{r: frozenset({"x", "y"}) for r in ("add_grad", "subtract_grad", "where_grad")},
    **{r: frozenset({"x"}) for r in ("cast_grad", "concat_grad", "expand_grad", "gather_nd_grad", "index_select_grad",
                                     "mean_grad", "sum_grad", "unsqueeze_grad", "take_along_axis_grad")},
    "reshape_grad": frozenset({"x_shape"}),
    "squeeze_grad": frozenset({"xshape"}),
    "slice_grad": frozenset({"input"}),
    "embedding_grad": frozenset({"weight"}),
}

_LAYER_NUMBER = re.compile(r"\d+")


def check_recompute(mode: str) -> str:
    """``mode`` if it is one of :data:`RECOMPUTE`, else a ProgramError naming ``--recompute``."""
    if mode not in RECOMPUTE:
        shown = repr(mode[:40]) if isinstance(mode, str) else type(mode).__name__
        raise ProgramError(f"--recompute {shown}: expected one of {', '.join(RECOMPUTE)}")
    return mode


def _layer_key(layer: str) -> tuple[int, ...] | None:
    """The numbers of a transformer layer's label (``layer 3`` -> (3,)), None for others."""
    nums = _LAYER_NUMBER.findall(layer)
    return tuple(int(n) for n in nums) if nums else None


def _is_act(prog: Program, n: str) -> bool:
    return prog.tensors[n].kind == "activation"


def recompute_regions(prog: Program, mode: str) -> list[list[int]]:
    """The forward ops run again in the backward, as regions (op indices in program order):
    one per attention core (``selective``) or per transformer layer (``full``); none for
    ``none``."""
    check_recompute(mode)
    fwd = [i for i, op in enumerate(prog.ops) if op.phase == "forward"]
    if mode == "none":
        return []
    if mode == "full":
        groups: dict[str, list[int]] = {}
        for i in fwd:
            layer = prog.ops[i].layer
            if _layer_key(layer) is not None:
                groups.setdefault(layer, []).append(i)
        if not groups:
            labels = sorted({prog.ops[i].layer for i in fwd})
            raise ProgramError(f"--recompute full: no forward op is labelled with a numbered layer (the program's "
                               f"layer labels: {', '.join(repr(x) for x in labels[:8]) or 'none'}); full "
                               f"recomputation runs each numbered layer group again")
        return list(groups.values())
    regions: list[list[int]] = []
    region: list[int] | None = None
    made: set[str] = set()
    for i in fwd:
        op = prog.ops[i]
        two_acts = op.rule in ("matmul", "bmm") and all(
            isinstance(op.inputs.get(p), str) and _is_act(prog, op.inputs[p]) and len(prog.tensors[op.inputs[p]].shape) >= 3
            for p in ("x", "y"))
        if region is None:
            if two_acts:
                region, made = [i], set(op.output_names())
            continue
        if not any(n in made for n in op.input_names()):
            continue
        region.append(i)
        if two_acts:  # the product with V closes the core
            regions.append(region)
            region = None
        else:
            made.update(op.output_names())
    return regions


@dataclass
class ActivationMemory:
    """Activations kept for the backward, bytes per device. ``per_layer``: layer label ->
    bytes; ``tensors``: layer label -> [(tensor, bytes)]; ``recomputed``: the forward ops run
    again in the backward (regions, op indices); ``regathered``: tensors kept as their
    producer's shard and all-gathered again for the backward (tensor, index of the output
    reshard that gathered them in the forward)."""

    recompute: str
    per_layer: dict[str, int]
    tensors: dict[str, list[tuple[str, int]]]
    recomputed: list[list[int]] = field(default_factory=list)
    regathered: list[tuple[str, int]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.per_layer.values())

    def layer(self, label: str) -> int:
        return self.per_layer.get(label, 0)

    def to_json(self) -> dict[str, object]:
        return {"recompute": self.recompute, "total": self.total, "per_layer": dict(self.per_layer),
                "tensors": {k: [list(t) for t in v] for k, v in self.tensors.items()},
                "recomputed_ops": sum(len(r) for r in self.recomputed),
                "regathered": [t for t, _ in self.regathered]}


def value_reads(prog: Program) -> dict[str, list[int]]:
    """Forward activation -> the backward ops that read its values (program order)."""
    fwd_made: set[str] = set()
    for op in prog.ops:
        if op.phase == "forward":
            fwd_made.update(op.output_names())
    reads: dict[str, list[int]] = {}
    for i, op in enumerate(prog.ops):
        if op.phase != "backward":
            continue
        skip = SHAPE_ONLY.get(op.rule, frozenset())
        for p, v in op.inputs.items():
            if p in skip:
                continue
            for n in (v if isinstance(v, (list, tuple)) else (v,)):
                if isinstance(n, str) and n in fwd_made and _is_act(prog, n):
                    lst = reads.setdefault(n, [])
                    if not lst or lst[-1] != i:
                        lst.append(i)
    return reads


def saved_activations(plan: Plan, recompute: str = "none") -> ActivationMemory:
    """The activations ``plan``'s backward keeps, per layer (module docstring)."""
    check_recompute(recompute)
    prog = plan.program
    reads = value_reads(prog)
    # layer of a kept tensor: that of the last backward op reading it (the earliest layer)
    layer_of = {n: prog.ops[ix[-1]].layer for n, ix in reads.items()}
    kept = set(reads)
    regions = recompute_regions(prog, recompute)
    for region in regions:
        kept -= {n for i in region for n in prog.ops[i].output_names()}
    for region in regions:  # a region's inputs made before it are kept to run it again
        made = {n for i in region for n in prog.ops[i].output_names()}
        label = prog.ops[region[0]].layer
        for i in region:
            for n in prog.ops[i].input_names():
                if n not in made and _is_act(prog, n):
                    if n not in kept:
                        layer_of[n] = label
                    kept.add(n)
    gathered: dict[str, tuple[int, TensorDistAttr]] = {}
    for r in plan.reshards:
        if r.output and not r.src.partial and all(s.kind == "all_gather" for s in r.plan.steps if s.bytes_per_rank):
            gathered.setdefault(r.tensor, (r.op_index, r.src))
    per_layer: dict[str, int] = {}
    tensors: dict[str, list[tuple[str, int]]] = {}
    regathered: list[tuple[str, int]] = []
    order = {n: k for k, n in enumerate(prog.tensors)}
    for n in sorted(kept, key=order.__getitem__):
        t = prog.tensors[n]
        attr = plan.attrs[n]
        g = gathered.get(n)
        if g is not None:
            src = g[1]
            if local_numel(src, t.shape) < local_numel(attr, t.shape):
                attr = src
                regathered.append((n, g[0]))
        b = local_numel(attr, t.shape) * t.itemsize
        label = layer_of[n]
        per_layer[label] = per_layer.get(label, 0) + b
        tensors.setdefault(label, []).append((n, b))
    return ActivationMemory(recompute, per_layer, tensors, regions, regathered)


def spans_with_recompute(plan: Plan, saved: ActivationMemory) -> dict[str, list[tuple[int, int, int]]]:
    """Tensor -> [(first op, last op, bytes)] live intervals for the tensors whose life
    recomputation or a backward re-gather splits (:func:`memory_per_device`);
    other tensors live from their producer to their last reader."""
    prog = plan.program
    out: dict[str, list[tuple[int, int, int]]] = {}
    if not saved.recomputed and not saved.regathered:
        return out
    made_at: dict[str, int] = {}
    fwd_last: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, op in enumerate(prog.ops):
        for n in op.output_names():
            made_at.setdefault(n, i)
        for n in op.input_names():
            last[n] = i
            if op.phase == "forward":
                fwd_last[n] = i
    reads = value_reads(prog)
    kept = {n for lst in saved.tensors.values() for n, _ in lst}

    def size(n: str, attr: TensorDistAttr | None = None) -> int:
        t = prog.tensors[n]
        return local_numel(attr or plan.attrs[n], t.shape) * t.itemsize

    for region in saved.recomputed:
        made = [n for i in region for n in prog.ops[i].output_names()]
        dropped = [n for n in made if n in reads and n not in kept]
        if not dropped:
            continue
        again = min(reads[n][0] for n in dropped)  # the region runs again right before this op
        for n in dropped:
            a = made_at[n]
            e = max(fwd_last.get(n, a), a)
            b = size(n)
            out[n] = [(a, e, b), (again, last.get(n, again), b)] if again > e else [(a, last.get(n, a), b)]
    shards = {r.tensor: r.src for r in plan.reshards if r.output}
    for n, _ in saved.regathered:
        a = made_at[n]
        e = max(fwd_last.get(n, a), a)
        back = reads[n][0]
        full = size(n)
        if back <= e + 1:
            continue
        out[n] = [(a, e, full), (e + 1, back - 1, size(n, shards[n])), (back, last.get(n, back), full)]
    return out


def rerun_points(plan: Plan, saved: ActivationMemory) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Where the backward runs forward work again: (backward op index -> the recomputed forward
    ops run right before it, backward op index -> the indices of the output reshards whose
    all-gather runs again right before it). A region runs again before the first backward op
    that reads one of its outputs; a re-gathered tensor before its first backward reader."""
    prog = plan.program
    reads = value_reads(prog)
    rerun: dict[int, list[int]] = {}
    for region in saved.recomputed:
        firsts = [reads[n][0] for i in region for n in prog.ops[i].output_names() if n in reads]
        if firsts:
            rerun.setdefault(min(firsts), []).extend(region)
    regather: dict[int, list[int]] = {}
    out_reshards = {r.tensor: k for k, r in enumerate(plan.reshards) if r.output}
    for n, _ in saved.regathered:
        regather.setdefault(reads[n][0], []).append(out_reshards[n])
    return rerun, regather


@dataclass(frozen=True)
class Memory:
    """Bytes per device."""

    parameters: int
    gradients: int
    optimizer_states: int
    activation_peak: int
    peak_op: int
    #: the activations the backward keeps
    saved: ActivationMemory | None = None
    #: the live activation bytes while each op runs (program order; the peak is their maximum)
    curve: tuple[int, ...] = field(default=(), repr=False, compare=False)

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states + self.activation_peak

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"parameters": self.parameters, "gradients": self.gradients,
                             "optimizer_states": self.optimizer_states, "activation_peak": self.activation_peak,
                             "peak_op": self.peak_op, "total": self.total}
        if self.saved is not None:
            d["saved_for_backward"] = {k: v for k, v in self.saved.to_json().items() if k != "tensors"}
        return d


def memory_per_device(plan: Plan, recompute: str = "none") -> Memory:
    """Memory per device of a :class:`spmdkit.program.plan.Plan` under activation
    recomputation ``recompute`` (none, selective, full)."""
    saved = saved_activations(plan, recompute)
    prog: Program = plan.program
    attrs = plan.attrs

    def nbytes(name: str, attr: TensorDistAttr | None = None) -> int:
        t = prog.tensors[name]
        return local_numel(attr or attrs[name], t.shape) * t.itemsize

    param_grads = prog.param_grads()
    params = sum(nbytes(t.name) for t in prog.tensors.values() if t.kind == "parameter" and not t.inplace_of)
    states = sum(nbytes(t.name) for t in prog.tensors.values() if t.kind == "optimizer_state" and not t.inplace_of)
    grads = sum(nbytes(n) for n in param_grads)
    if plan.grad_accum > 1:
        # gradient accumulation: a gradient reduced once per step is held, and accumulated,
        # as its backward op makes it (unreduced, whole on a partial mesh dim) until then
        for r in plan.reshards:
            if r.output and r.tensor in param_grads:
                grads += max(0, nbytes(r.tensor, r.src) - nbytes(r.tensor))
    n_ops = len(prog.ops)
    first, last = prog.live_spans()
    delta = [0] * (n_ops + 1)
    split = spans_with_recompute(plan, saved)
    for n, i in first.items():
        t = prog.tensors[n]
        if n in param_grads or t.inplace_of or t.kind in ("parameter", "optimizer_state"):
            continue
        b = nbytes(n)
        for a, e, size in split.get(n, ((i, last[n], b),)):
            delta[a] += size
            delta[e + 1] -= size
    # copies made by reshards live from the first op that reads them to the last
    spans: dict[tuple[str, TensorDistAttr, str], list[int]] = {}
    stored = plan.storage
    blocks: dict[tuple[str, str], list[int]] = {}  # (layer, phase) -> its first and last op
    if stored:
        for i, op in enumerate(prog.ops):
            blk = blocks.setdefault((op.layer, op.phase), [i, i])
            blk[1] = i
    for r in plan.reshards:
        op = prog.ops[r.op_index]
        if r.tensor in stored:
            # ZeRO-3 / FSDP: gathered for its layer's ops of one phase, freed after them (one
            # layer's gathered parameters live at a time), gathered again in the next phase
            lo, hi = blocks[(op.layer, op.phase)]
            s = spans.setdefault((r.tensor, r.dst, op.phase), [lo, hi])
            s[0], s[1] = min(s[0], lo), max(s[1], hi)
            continue
        s = spans.setdefault((r.tensor, r.dst, ""), [r.op_index, r.op_index])
        s[0] = min(s[0], r.op_index)
        s[1] = max(s[1], r.op_index)
    for (n, dst, _phase), (a, b_) in spans.items():
        size = nbytes(n, dst)
        delta[a] += size
        delta[b_ + 1] -= size
    curve = []
    cur = 0
    for i in range(n_ops):
        cur += delta[i]
        curve.append(cur)
    peak, at = 0, 0
    for i, v in enumerate(curve):
        if v > peak:
            peak, at = v, i
    return Memory(params, grads, states, peak, at, saved, tuple(curve))


__all__ = ["RECOMPUTE", "SHAPE_ONLY", "ActivationMemory", "Memory", "UnevenShard", "check_recompute", "local_numel",
           "memory_per_device", "recompute_regions", "rerun_points", "saved_activations", "spans_with_recompute",
           "uneven_shards", "value_reads"]
