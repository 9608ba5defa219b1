"""Mixture-of-experts routing: moe_combine and moe_gate_dispatch, with their grads.

Notation (letters; ``1`` a size-1 axis)::

    moe_combine            th, sk, sk -> sh          (x, combine_weights, scatter_index -> y)
                           t replicated; y partial SUM over the mesh dims of k; h replicated
                           where k is sharded (as Paddle). ``local_rows``: t keeps its sharding
                           and y is partial SUM over its mesh dims too
    moe_combine_grad       th, sk, sk, sh -> th, sk, sk   (x, combine_weights, scatter_index, grad_y ->
                           grad_x, grad_combine_weights, grad_scatter_index); t, k replicated;
                           grad_x partial SUM over s, grad_combine_weights partial SUM over h.
                           ``local_rows``: t keeps its sharding (grad_x too), grad_combine_weights
                           partial SUM over its mesh dims
    moe_gate_dispatch      sh, se, e -> ech, sk, ks, e, sk   (x, gate_logits, corr_bias -> y,
                           combine_weights, scatter_index, expert_offset, expert_id); only h may
                           stay sharded (s, e, k, c replicated); nothing partial
    moe_gate_dispatch_grad sk, ks, sk, ech, sk -> sh, se   (combine_weights, scatter_index, expert_id,
                           grad_y, grad_combine_weights -> grad_x, grad_gate_logits); k, e, c
                           replicated; nothing partial. ``local_experts``: e keeps its sharding
                           (``-> sh, sf``, f replicated), grad_x partial SUM over e's mesh dims

What the data-dependent rules assume. ``scatter_index`` holds *global* row indices:
moe_combine gathers rows of x through it (``y[i] = sum_k x[scatter_index[i, k]] *
combine_weights[i, k]``), so x's row axis (t, of size S*K) is its own letter and is replicated;
Paddle labels it with the token letter s and shards it with the tokens (sound only where each
rank's scatter_index points into its own x block with local indices). moe_gate_dispatch is
answered as one global dispatch with ``use_pad`` layout: y is ``[E, capacity, H]`` (Paddle's
``esh``, its capacity axis labelled with the token letter), tokens are placed in expert slots in
(k, token) order over all S tokens and dropped past ``capacity``; which slot a token takes, and
whether it is dropped (its combine weight zeroed, its scatter index 0), depends on every token
before it, so s (and the capacity axis) stay replicated, and the top-k over experts needs every
expert, so e stays replicated. The combine weights are the gate values of the chosen experts
(``gate_logits[i, expert_id[i, k]]``, chosen by ``gate_logits + corr_bias``); the grad kernel
scatters grad_combine_weights back to those experts.

``local_rows`` (spmdkit's, default False; Paddle has no such attribute) is what the vocab-parallel
embedding does with its table's rows: a rank holding a block of x's rows (its first row's global
index from the simulator's ``localize`` hook, the torch kernel the same) sums only the rows it
holds, its share of y, and writes only their gradient. The planner sets it where that is cheaper
than gathering the rows (the rule's ``choice`` fact, :mod:`spmdkit.planner.propagate`): experts'
rows that come back sharded over tp (ETP = 1 without ``sp``, docs/experts.md) are combined where
they are and y is reduced once, instead of the rows being all-gathered. ``local_experts``
(moe_gate_dispatch_grad, likewise) mirrors it in the backward: a rank holding a block of the
experts' slots of grad_y (its first expert from the ``localize`` hook) gathers only those into
its share of grad_x; grad_gate_logits reads no slot and is whole on every rank.

Deviations from Paddle 3.3.1 (``docs/deviations.md`` ``moe-amp-*``): moe_combine's x rows
replicated (Paddle shards them with s) and y partial over k's own mesh dim (Paddle always names
mesh dim 1); moe_combine_grad x rows replicated, grad_x partial over s, grad_combine_weights
partial over h; moe_gate_dispatch s and e replicated (Paddle shards the capacity axis of y with s
and keeps the top-k axis e sharded); its grad keeps grad_y's capacity and expert axes replicated.
Each reverse rule (Paddle has none) infers the inputs from the outputs and returns the outputs
those inputs produce.
"""

from __future__ import annotations

from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.axes import make_attr, unpartial
from spmdkit.engine.declare import Answer, Way, declare
from spmdkit.engine.facts import LocalOp, OpCost, facts
from spmdkit.engine.notation import Coshard, Notation
from spmdkit.engine.outshape import Args, Expect, UnknownShape
from spmdkit.ops._cost import numel

# every co-shard read as its largest mesh dim (Paddle's merge); letters of one size checked. A
# leading batch axis b (rank 3; spmdkit's, Paddle's ops are 2-D): each batch row is dispatched
# and combined on its own (its scatter indices point into its own rows), so b may be sharded.
# Rank 4: a chunk axis a after b (each sequence routed in chunks of S/T tokens, each chunk on
# its own: capacity per chunk, indices into the chunk's own rows), so a may be sharded too.


def _b(nd: int, labels: list[str], skip: tuple[int, ...] = ()) -> list[str]:
    """``labels`` with the batch letter b first where the call is batched (``nd`` 3), and the
    chunk letter a after it where each batch row is routed in chunks (``nd`` 4: x ``[B, T, S/T,
    H]``, every chunk of a sequence dispatched on its own, docs/experts.md ETP = 1)."""
    lead = "" if nd < 3 else "b" if nd == 3 else "ba"
    return [x if i in skip else lead + x for i, x in enumerate(labels)]


def _combine(nd: int, local_rows: bool = False) -> Notation:
    """``local_rows``: x's row axis t keeps its sharding (each rank sums the rows it holds: y
    partial SUM over t's mesh dims, as the vocab-parallel embedding's rows); else t replicated."""
    return Notation(_b(nd, ["th", "sk", "sk"]), _b(nd, ["sh"]), replicated="" if local_rows else "t",
                    coshard=Coshard.LARGEST)


def _combine_grad(nd: int, local_rows: bool = False) -> Notation:
    """``local_rows``: t keeps its sharding (each rank writes the gradient of its own rows;
    grad_combine_weights, without t, partial SUM over its mesh dims); else t replicated."""
    return Notation(_b(nd, ["th", "sk", "sk", "sh"]), _b(nd, ["th", "sk", "sk"]),
                    replicated="k" if local_rows else "tk", coshard=Coshard.LARGEST)


def _dispatch_grad(nd: int, local_experts: bool = False) -> Notation:
    """``local_experts``: grad_y's expert axis e keeps its sharding (each rank gathers the slots of
    the experts it holds: grad_x partial SUM over e's mesh dims); grad_gate_logits' expert axis is
    its own letter f, replicated (it reads no slot). Else e replicated."""
    if local_experts:
        return Notation(_b(nd, ["sk", "ks", "sk", "ech", "sk"]), _b(nd, ["sh", "sf"]), replicated="kcf",
                        coshard=Coshard.LARGEST)
    return Notation(_b(nd, ["sk", "ks", "sk", "ech", "sk"]), _b(nd, ["sh", "se"]), replicated="keck",
                    coshard=Coshard.LARGEST)


def _local_experts_post(ins: Any, outs: Any, combine_weights: DistTensorSpec, scatter_index: DistTensorSpec,
                        expert_id: DistTensorSpec, grad_y: DistTensorSpec, grad_combine_weights: DistTensorSpec,
                        k: int, capacity: int, use_pad: bool, groups: int = 1, topk_groups: int = 1,
                        local_experts: bool = False) -> Answer:
    """grad_x partial over the mesh dims of the experts a rank holds (local_experts), nothing
    else partial (grad_gate_logits reads no slot: whole on every rank)."""
    if not local_experts:
        return _no_partial(ins, outs)
    gx, ggl = outs
    e = ins[3].dims_mapping[-3]
    dims = set() if e == -1 else {e} if isinstance(e, int) else set(e)
    part = tuple((d, r) for d, r in gx.partial if d in dims) if gx is not None else ()
    return ins, (None if gx is None else TensorDistAttr.unchecked(gx.mesh, gx.dims_mapping, part),
                 None if ggl is None else unpartial(ggl))


def _dispatch(nd: int, corr_bias: int) -> Notation:
    return Notation([*_b(nd, ["sh", "se"]), "e" if corr_bias >= 0 else None], _b(nd, ["ech", "sk", "ks", "e", "sk"]),
                    replicated="seck", coshard=Coshard.LARGEST)


def _batch_rank(op: str, **tensors: DistTensorSpec | None) -> None:
    """Every tensor 2-D, or every one 3-D (a leading batch axis of one size), or every one 4-D
    (a batch axis and a chunk axis, each of one size)."""
    given = [(n, t) for n, t in tensors.items() if t is not None]
    ranks = {len(t.shape) for _, t in given}
    if len(ranks) > 1 or not ranks <= {2, 3, 4}:
        shapes = ", ".join(f"{n} {list(t.shape)}" for n, t in given)
        raise ShapeMismatchError(f"{op}: the tensors must all be 2-D, all 3-D (a batch axis first) or all 4-D (a "
                                 f"batch and a chunk axis first), got {shapes}")
    for ax, what in ((0, "batch"), (1, "chunk")):
        if max(ranks) - 2 > ax and len({t.shape[ax] for _, t in given if t.shape[ax] >= 0}) > 1:
            raise ShapeMismatchError(f"{op}: the {what} axes differ: "
                                     + ", ".join(f"{n} {t.shape[ax]}" for n, t in given))


def _combine_post(ins: list[TensorDistAttr], outs: list[TensorDistAttr], *args: object) -> Answer:
    """As Paddle, k and h are not sharded together: where k is sharded, h is replicated."""
    if ins[1].dims_mapping[-1] == -1:
        return ins, outs
    x, y = ins[0], outs[0]
    return ((make_attr(x.mesh, (*x.dims_mapping[:-1], -1)), *ins[1:]),
            (make_attr(y.mesh, (*y.dims_mapping[:-1], -1), y.partial),))  # fmt: skip


def _combine_grad_post(ins: Any, outs: Any, *args: object) -> Answer:
    """grad_scatter_index is never partial (an index is not summed)."""
    return ins, (outs[0], outs[1], unpartial(outs[2]))


def _no_partial(ins: Any, outs: Any, *args: object) -> Answer:
    """Nothing partial: a rank holding part of h dispatches its part of every row (the
    engine would make the outputs lacking h partial over its mesh dims)."""
    return ins, tuple(None if a is None else unpartial(a) for a in outs)


def _combine_ranks(op: str, x: DistTensorSpec, combine_weights: DistTensorSpec, scatter_index: DistTensorSpec) -> None:
    _batch_rank(op, x=x, combine_weights=combine_weights, scatter_index=scatter_index)


def _combine_grad_ranks(op: str, x: DistTensorSpec, combine_weights: DistTensorSpec, scatter_index: DistTensorSpec,
                        grad_y: DistTensorSpec) -> None:
    _batch_rank(op, x=x, combine_weights=combine_weights, scatter_index=scatter_index, grad_y=grad_y)


def _dispatch_ranks(op: str, x: DistTensorSpec, gate_logits: DistTensorSpec) -> None:
    _batch_rank(op, x=x, gate_logits=gate_logits)


def _dispatch_grad_ranks(op: str, combine_weights: DistTensorSpec, scatter_index: DistTensorSpec,
                         expert_id: DistTensorSpec, grad_combine_weights: DistTensorSpec, grad_y: DistTensorSpec) -> None:
    _batch_rank(op, combine_weights=combine_weights, scatter_index=scatter_index, expert_id=expert_id,
                grad_combine_weights=grad_combine_weights)
    if len(grad_y.shape) != len(combine_weights.shape) + 1:
        raise ShapeMismatchError(f"{op}: grad_y {list(grad_y.shape)} must have one axis more than combine_weights "
                                 f"{list(combine_weights.shape)}")


_COMBINE_SHAPES = "x: ... _ _; combine_weights: ... _ _; scatter_index: ... _ _"
_DISPATCH_ATTRS = ("k >= 1", "capacity >= 0")


def _experts(op: str, gate_logits: DistTensorSpec, k: int) -> None:
    if 0 <= gate_logits.shape[-1] < k:
        raise InvalidAttributeError(f"{op}: k {k} exceeds the number of experts {gate_logits.shape[-1]}")


declare(
    "moe_combine", "x: T, combine_weights: T, scatter_index: T, local_rows: bool = False",
    Way(_combine, key="x, local_rows", shapes=_COMBINE_SHAPES, letters=True, post=_combine_post, check=_combine_ranks,
        paddle="MoECombineInferSpmd", doc="moe_combine (MoECombineInferSpmd): rows of x replicated (gathered "
        "through scatter_index; with local_rows kept sharded, y partial SUM over their mesh dims), s and h follow "
        "the inputs; y partial SUM over k's mesh dims."),
    grad=Way(_combine_grad, key="x, local_rows", shapes=_COMBINE_SHAPES + "; grad_y: ... _ _",
             letters=True, post=_combine_grad_post, check=_combine_grad_ranks, paddle="MoECombineGradInferSpmd",
             doc="moe_combine_grad (MoECombineGradInferSpmd): x rows (unless local_rows) and k replicated; grad_x "
                 "scatters the rows a rank holds (partial SUM over s), grad_combine_weights sums over h (partial SUM "
                 "over h) and, with local_rows, over the rows' mesh dims."),
    grad_signature="x: T, combine_weights: T, scatter_index: T, grad_y: T, local_rows: bool = False",
    grad_name="moe_combine_grad",
)  # fmt: skip
declare(
    "moe_gate_dispatch", "x: T, gate_logits: T, corr_bias: T?, k: int, capacity: int, use_pad: bool, "
    "groups: int = 1, topk_groups: int = 1",
    Way(_dispatch, key="x, corr_bias", require=_DISPATCH_ATTRS,
        shapes="x: ... _ _; gate_logits: ... _ _; corr_bias: _", check=(_dispatch_ranks, _experts), letters=True,
        post=_no_partial,
        paddle="MoEGateDispatchInferSpmd", doc="moe_gate_dispatch (MoEGateDispatchInferSpmd): one global "
        "dispatch: only h keeps its sharding (x -> y); nothing partial."),
    grad=Way(_dispatch_grad, key="combine_weights, local_experts", letters=True, post=_local_experts_post,
             require=_DISPATCH_ATTRS,
             shapes="combine_weights: ... _ _; scatter_index: ... _ _; expert_id: ... _ _; grad_y: ... _ _ _; "
                    "grad_combine_weights: ... _ _", check=_dispatch_grad_ranks, paddle="MoEGateDispatchGradInferSpmd",
             doc="moe_gate_dispatch_grad (MoEGateDispatchGradInferSpmd): s and h follow the inputs; k, e and c "
                 "replicated (grad_x gathers rows of grad_y through scatter_index); nothing partial."),
    grad_signature="combine_weights: T, scatter_index: T, expert_id: T, grad_y: T, grad_combine_weights: T, "
                   "k: int, capacity: int, use_pad: bool, groups: int = 1, topk_groups: int = 1, "
                   "local_experts: bool = False",
    grad_name="moe_gate_dispatch_grad",
)  # fmt: skip


# -- output shapes / grads ----------------------------------------------------------------------


def _combine_shape(a: Args) -> list[Expect]:
    x, w = a.s("x"), a.s("combine_weights")
    if len(x) not in (2, 3, 4) or len(w) != len(x):
        raise UnknownShape
    return [(*w[:-1], x[-1])]


def _dispatch_shape(a: Args) -> list[Expect]:
    """x [S, H], gate_logits [S, E], k, capacity: y [E, capacity, H] (the padded layout, the
    rule's rank-3 answer), combine_weights and expert_id [S, k], scatter_index [k, S],
    expert_offset [E]; batched (x [B, S, H]): each with B first."""
    x, gl = a.s("x"), a.s("gate_logits")
    k, cap = a.a("k"), a.a("capacity")
    if len(x) not in (2, 3, 4) or len(gl) != len(x) or not isinstance(k, int) or not isinstance(cap, int):
        raise UnknownShape
    *b, s, e = gl
    y: Expect = (*b, e, cap, x[-1]) if a.nd(0) == len(x) + 1 else None
    return [y, (*b, s, k), (*b, k, s), (*b, e), (*b, s, k)]


def _dispatch_grad_shape(a: Args) -> list[Expect]:
    """grad_x [S, H] and grad_gate_logits [S, E] from combine_weights [S, k] and grad_y [E, C, H]
    (batched: each with B first)."""
    cw, gy = a.s("combine_weights"), a.s("grad_y")
    if len(cw) not in (2, 3, 4) or len(gy) != len(cw) + 1:
        raise UnknownShape
    return [(*cw[:-1], gy[-1]), (*cw[:-1], gy[-3])]


# autodiff: the outputs by name (no reverse rule names them); the grads of x, combine_weights and
# scatter_index (zero: a builder reads the index through an op it does not record, so none is made)
# / of x and gate_logits
facts("moe_combine", shape=_combine_shape, grad="moe_combine_grad", wrt=("x", "combine_weights", "scatter_index"),
      outputs=("y",))
facts("moe_gate_dispatch", shape=_dispatch_shape, grad="moe_gate_dispatch_grad", wrt=("x", "gate_logits"),
      outputs=("y", "combine_weights", "scatter_index", "expert_offset", "expert_id"),
      unchecked="y is checked in the padded layout only (the rule's rank-3 answer, [E, capacity, H])")
facts("moe_gate_dispatch_grad", shape=_dispatch_grad_shape)
facts("moe_combine_grad", grad_like=("x", "combine_weights", "scatter_index"))
# the planner combines the rows where they are (local_rows) where that is cheaper than gathering them
facts("moe_combine", "moe_combine_grad", choice=("local_rows", (False, True)))
# and the dispatched tokens' gradient from the experts' slots each rank holds (local_experts)
facts("moe_gate_dispatch_grad", choice=("local_experts", (False, True)))


# -- cost: the routing is memory-bound (Megatron-Core's alltoall token dispatcher: top-k, the
# expert histogram, the permutation's sort and gather; the unpermute's weighted scatter), each
# kernel its bytes at the achievable HBM bandwidth; the expert GEMMs are their own matmul ops


def _n(c: LocalOp, name: str) -> tuple[int, int]:
    """(elements, itemsize) of input ``name`` (0, 0 where absent)."""
    t = c.one(name)
    return (numel(t[0]), t[1]) if t is not None else (0, 0)


def _out(c: LocalOp, k: int) -> tuple[int, int]:
    o = c.outs[k] if k < len(c.outs) else None
    return (numel(o[0]), o[1]) if o is not None else (0, 0)


def _dispatch_cost(c: LocalOp) -> OpCost:
    """The gate read by top-k and by the histogram, the indices written and sorted (top-k,
    argsort, offsets: 3 passes over the [S, k] ids), x read once per chosen expert (the gather
    of the permutation) and the padded [E, C, H] buffer written (capacity padding included): 5
    kernels (top-k, histogram, sort, permute, the zero fill of the padding)."""
    xn, xb = _n(c, "x")
    gn, gb = _n(c, "gate_logits")
    k = int(c.attr("k", 1))
    yn, yb = _out(c, 0)
    idx = sum(_out(c, j)[0] * _out(c, j)[1] for j in range(1, len(c.outs)))
    nbytes = xn * xb * k + 2 * gn * gb + yn * yb + 3 * idx
    return OpCost(0.0, 0.0, float(nbytes), False, c.dtype(), kernels=5)


def _dispatch_grad_cost(c: LocalOp) -> OpCost:
    """grad_y [E, C, H] read, each token's k rows gathered and summed into grad_x, the gate
    gradient scattered into [S, E]: 3 kernels."""
    gyn, gyb = _n(c, "grad_y")
    idx = sum(_n(c, p)[0] * _n(c, p)[1] for p in ("combine_weights", "scatter_index", "expert_id",
                                                  "grad_combine_weights"))
    outb = sum(_out(c, j)[0] * _out(c, j)[1] for j in range(len(c.outs)))
    return OpCost(0.0, 0.0, float(gyn * gyb + idx + outb), False, c.dtype(), kernels=3)


def _combine_cost(c: LocalOp) -> OpCost:
    """Each token's k expert rows read (of x [E x C, H]: only the routed rows), weighted and
    summed into y [S, H]: ``2 k`` FLOPs per output element; one kernel (the unpermute)."""
    yn, yb = _out(c, 0)
    k = c.one("combine_weights")
    kk = k[0][-1] if k is not None else 1
    f = 2.0 * kk * yn
    idx = sum(_n(c, p)[0] * _n(c, p)[1] for p in ("combine_weights", "scatter_index"))
    return OpCost(f, f, float(yn * yb * (kk + 1) + idx), False, c.dtype())


def _combine_grad_cost(c: LocalOp) -> OpCost:
    """grad_y read, the routed rows of x read (the combine weights' gradient: a dot per row),
    grad_x [E x C, H] zero-filled and its routed rows written: 3 kernels."""
    gyn, gyb = _n(c, "grad_y")
    cw = c.one("combine_weights")
    kk = cw[0][-1] if cw is not None else 1
    xo, xob = _out(c, 0)
    rest = sum(_out(c, j)[0] * _out(c, j)[1] for j in range(1, len(c.outs)))
    f = 2.0 * kk * gyn
    return OpCost(f, f, float(gyn * gyb * (2 * kk + 1) + xo * xob + rest), False, c.dtype(), kernels=3)


facts("moe_gate_dispatch", cost=_dispatch_cost)
facts("moe_gate_dispatch_grad", cost=_dispatch_grad_cost)
facts("moe_combine", cost=_combine_cost)
facts("moe_combine_grad", cost=_combine_grad_cost)
