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

``recompute`` (``none``, ``selective``, ``full``; :mod:`spmdkit.cost.activations`): a
forward activation that a recomputed region makes and the backward reads lives from its
producer to its last forward reader, and again from the first backward op that reads any of
the region's tensors (the region is run again right before it) to its last reader. A tensor
kept as its producer's shard and gathered again for the backward (sequence parallel's norm
outputs) is held as the shard between its last forward reader and its first backward one.
:attr:`Memory.saved` is what the backward keeps (:func:`spmdkit.cost.activations.saved_activations`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr, entry_dims
from spmdkit.program.ir import Program


def local_numel(attr: TensorDistAttr, shape: tuple[int, ...]) -> int:
    """Elements of the largest local shard (uneven splits: the first, largest, piece)."""
    mesh_shape = attr.mesh.shape
    n = 1
    for size, e in zip(shape, attr.dims_mapping):
        k = 1
        for d in entry_dims(e):
            k *= mesh_shape[d]
        n *= -(-size // k) if k > 1 else size
    return n


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


def uneven_shards(plan: object) -> list[UnevenShard]:
    """Every (tensor, axis) of a plan sharded over mesh dims whose product does not divide the
    axis (tensors in program order). Memory counts the largest shard of each."""
    from spmdkit.program.plan import Plan

    assert isinstance(plan, Plan)
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


@dataclass(frozen=True)
class Memory:
    """Bytes per device."""

    parameters: int
    gradients: int
    optimizer_states: int
    activation_peak: int
    peak_op: int
    #: the activations the backward keeps (an :class:`spmdkit.cost.activations.ActivationMemory`)
    saved: Any = None
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


def memory_per_device(plan: object, recompute: str = "none") -> Memory:
    """Memory per device of a :class:`spmdkit.program.plan.Plan` under activation
    recomputation ``recompute`` (none, selective, full)."""
    from spmdkit.cost.activations import saved_activations, spans_with_recompute
    from spmdkit.program.plan import Plan

    assert isinstance(plan, Plan)
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
    if getattr(plan, "grad_accum", 1) > 1:
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
    stored = getattr(plan, "storage", None) or {}
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


__all__ = ["Memory", "UnevenShard", "local_numel", "memory_per_device", "uneven_shards"]
