"""Cost functions shared by the op families (each family declares its ops' costs with
:func:`spmdkit.engine.facts.facts` at the end of its module): memory-bound ops by their bytes,
lookups and their gradients, ops that make a tensor without reading one.

Every figure is per device, from the op's local tensors (:class:`~spmdkit.engine.facts.LocalOp`).
"""

from __future__ import annotations

from collections.abc import Iterable

from spmdkit.engine.facts import CostFn, LocalOp, OpCost


def numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def by_bytes(per_element: float) -> CostFn:
    """Memory-bound ops: every input read and output written once; ``per_element`` FLOPs per
    output element (nominal: the roofline time of these is their bytes)."""
    def cost(c: LocalOp) -> OpCost:
        f = per_element * c.out_numel
        return OpCost(f, f, c.in_bytes + c.out_bytes, False, c.dtype())
    return cost


#: ops that only move or copy data (transposes, concatenations, slices, sorts, ...): no FLOPs
copy = by_bytes(0)
#: most elementwise ops, reductions, ...: one nominal FLOP per output element
one_per_element = by_bytes(1)


def lookup(c: LocalOp) -> OpCost:
    """Lookups (embedding, index_select, gather, ...): the rows read equal the output written,
    plus the indices. (The model's FLOP count takes a parameter read by lookups alone for no
    matmul: :func:`spmdkit.cost.compute.model_flops`.)"""
    idx = sum(numel(s) * b for args in c.ins.values() for s, b, dt in args if dt.startswith(("int", "uint")))
    return OpCost(0.0, 0.0, 2 * c.out_bytes + idx, False, c.dtype())


def scatter_grad(c: LocalOp) -> OpCost:
    """Gradients of lookups: the weight (x) gradient zeroed and written, the output gradient
    read and added into it."""
    og = c.one("out_grad")
    ogb = numel(og[0]) * og[1] if og else 0
    f = float(numel(og[0])) if og else 0.0
    return OpCost(f, f, c.out_bytes + 2 * ogb, False, c.dtype())


def no_kernel(c: LocalOp) -> OpCost:
    """Ops that run no kernel (views: metadata only; empty_like: an allocation)."""
    return OpCost(0.0, 0.0, 0.0, False, c.dtype(), kernels=0)


def fill(c: LocalOp) -> OpCost:
    """Ops that write a tensor without reading one (zeros_like, full, ...)."""
    return OpCost(0.0, 0.0, c.out_bytes, False, c.dtype())


__all__ = ["by_bytes", "copy", "fill", "lookup", "no_kernel", "numel", "one_per_element", "scatter_grad"]
