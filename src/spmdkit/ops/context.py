"""Context-parallel attention: ``cp_attention`` and its grad (spmdkit's own op; docs/context.md).

Attention whose causal mask is given by the positions each query and key holds, so that the
sequence may be split over ranks (and permuted: the zig-zag balance) while every op but
attention stays position-independent. q ``[b, s, h, d]``, k ``[b, t, hk, d]``, v ``[b, t, hk,
e]``, q_positions ``[s]``, k_positions ``[t]`` (int64: the place of each query / key in the
original sequence)::

    out[b, i, h] = sum_j softmax_j(q_i . k_j / sqrt(d), j visible) v_j,
    j visible to i  <=>  k_positions[j] <= q_positions[i]   (causal; every j when not causal)

with the kv heads grouped as flash_attention groups them; outputs out ``[b, s, h, e]`` and
softmax_lse ``[b, h, s]`` (float32). The attribute ``variant`` says how a sharded sequence is
computed (the global op is the same for each):

- ``allgather`` (Llama 3's): ``bshd, bthd, bthe, s, t -> bshe, bhs`` with ``t``, ``d``, ``e``
  replicated: q stays sharded on its sequence, k, v and k_positions are gathered whole (the
  planner's all-gathers), each rank attends its own queries at their global positions. The grad
  (``q k v out softmax_lse q_positions k_positions out_grad -> q_grad k_grad v_grad``) gives
  q_grad sharded as q and k_grad, v_grad *partial* over the mesh dims of ``s`` (each rank's
  queries' share), reduce-scattered back onto k's sequence by the planner.
- ``ring``: ``bshd, bshd, bshe, s, s -> bshe, bhs``: q, k, v and both positions sharded alike on
  the sequence; the kernel itself passes the kv blocks (and their positions) round the ranks of
  the sequence's mesh dims (``n - 1`` send/recv steps, each overlappable with the block
  computation, online-softmax rescaling across blocks); the backward passes the blocks again
  with their dK, dV accumulators (``n`` steps: they end at their owner). The op's
  :class:`~spmdkit.engine.facts.RingPass` fact says so to the cost model.
- ``alltoall`` (DeepSpeed-Ulysses): the sequence's mesh dims are moved onto the heads (minor to
  the heads' own: ``h`` co-sharded ``(tp, cp)``) before the merge, ``s`` and ``t`` replicated:
  the planner's all-to-alls turn the sequence-sharded q, k, v into head-sharded ones and the
  output back (its consumer's layout); attention is head-parallel.

Batch and heads may be sharded in every variant (a mesh dim of the heads must divide the kv
heads, as flash_attention's grouped heads). ``balance`` (``zigzag`` or ``none``) records how the
positions were laid out (the cost of a causal ring / gather without the balance is uneven);
the rule does not read it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spmdkit.core.dist_attr import entry_dims
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import make_attr
from spmdkit.engine.declare import Way, declare
from spmdkit.engine.facts import RingPass, facts
from spmdkit.engine.notation import Coshard, Notation
from spmdkit.engine.outshape import Args, Expect, UnknownShape
from spmdkit.engine.signature import parse_signature
from spmdkit.ops.attention import _grouped_heads, attention_costs

#: the variants of cp_attention
VARIANTS = ("allgather", "ring", "alltoall")
#: how the positions were laid out
BALANCES = ("zigzag", "none")

_Q, _K, _V, _OUT, _LSE = "bshd", "bthd", "bthe", "bshe", "bhs"


def cp_notation(kind: str, variant: str) -> Notation:
    """The module docstring's letters for ``variant`` (``kind``: forward or grad)."""
    if variant not in VARIANTS:
        raise InvalidAttributeError(f"variant {variant!r} is not one of {', '.join(VARIANTS)}")
    ring = variant == "ring"
    k, v, kp = ("bshd", "bshe", "s") if ring else (_K, _V, "t")
    replicated = "de" if ring else "sdte" if variant == "alltoall" else "dte"
    if kind == "forward":
        return Notation([_Q, k, v, "s", kp], [_OUT, _LSE], replicated=replicated, coshard=Coshard.KEEP,
                        sources=(0, 1, 2))
    return Notation([_Q, k, v, _OUT, _LSE, "s", kp, _OUT], [_Q, k, v], replicated=replicated,
                    coshard=Coshard.KEEP, sources=(0, 1, 2, 3, 4, 7))


#: tensors with heads: (sequence axis, head axis)
_AXES = {"q": (1, 2), "k": (1, 2), "v": (1, 2), "out": (1, 2), "out_grad": (1, 2), "softmax_lse": (2, 1)}


def _ulysses(fn: Callable[..., SpmdResult], signature: str) -> Callable[..., SpmdResult]:
    """Under ``variant='alltoall'``: each tensor's sequence mesh dims moved onto its heads (minor to
    the heads' own), before the merge; the positions replicated."""
    names = [p.name for p in parse_signature(signature)]
    vi = names.index("variant")
    moved = [(i, _AXES[n]) for i, n in enumerate(names) if n in _AXES]
    pos = [i for i, n in enumerate(names) if n.endswith("positions")]

    def call(*args: Any) -> SpmdResult:
        if len(args) <= vi or args[vi] != "alltoall":
            return fn(*args)
        new = list(args)
        for i, (sa, ha) in moved:
            t = args[i] if i < len(args) else None
            if not isinstance(t, DistTensorSpec) or len(t.shape) <= max(sa, ha):
                continue
            a = t.dist_attr
            dm = list(a.dims_mapping)
            dims = (*entry_dims(dm[ha]), *entry_dims(dm[sa]))
            if not entry_dims(dm[sa]):
                continue
            dm[sa] = -1
            dm[ha] = dims if len(dims) > 1 else dims[0]
            new[i] = DistTensorSpec(t.shape, make_attr(a.mesh, tuple(dm), a.partial))
        for i in pos:
            t = args[i] if i < len(args) else None
            if isinstance(t, DistTensorSpec):
                new[i] = DistTensorSpec(t.shape, make_attr(t.dist_attr.mesh, (-1,) * len(t.shape)))
        return fn(*new)

    call.__doc__ = fn.__doc__
    return call


def _wrap(fn: Callable[..., SpmdResult], signature: str, outs: Any) -> Callable[..., SpmdResult]:
    return _ulysses(_grouped_heads(fn, signature), signature)


def _check(q: DistTensorSpec, k: DistTensorSpec, q_positions: DistTensorSpec, k_positions: DistTensorSpec,
           variant: str, balance: str) -> None:
    """q's heads a multiple of k's; the positions one per query / key; known variant and balance."""
    if variant not in VARIANTS:
        raise InvalidAttributeError(f"cp_attention: variant {variant!r} is not one of {', '.join(VARIANTS)}")
    if balance not in BALANCES:
        raise InvalidAttributeError(f"cp_attention: balance {balance!r} is not one of {', '.join(BALANCES)}")
    hq, hk = q.shape[2], k.shape[2]
    if hk == 0 or (hq >= 0 and hk > 0 and hq % hk != 0):
        raise ShapeMismatchError(f"cp_attention: q's num_heads {hq} is not a multiple of k's {hk}")
    for p, t, what in ((q_positions, q, "q"), (k_positions, k, "k")):
        if len(p.shape) != 1 or (p.shape[0] != t.shape[1] and p.shape[0] >= 0 and t.shape[1] >= 0):
            raise ShapeMismatchError(f"cp_attention: {what}_positions {list(p.shape)} is not [{what}'s sequence "
                                     f"{t.shape[1]}]")


_ATTRS = "causal: bool = True, variant: str = 'allgather', balance: str = 'zigzag'"
_SHAPES = "q: b s h d; k: b t hk d; v: b t hk e; q_positions: s; k_positions: t"
declare(
    "cp_attention", "q: T, k: T, v: T, q_positions: T, k_positions: T, " + _ATTRS,
    Way(lambda variant: cp_notation("forward", variant), key="variant", shapes=_SHAPES, check=_check, wrap=_wrap,
        doc="cp_attention: attention at the given positions; the sequence sharded as the variant says "
            "(allgather: q only; ring: q, k, v, the kernel rings the kv blocks; alltoall: moved onto the heads)."),
    outputs="out: T, softmax_lse: T",
)  # fmt: skip
declare(
    "cp_attention_grad", "q: T, k: T, v: T, out: T, softmax_lse: T, q_positions: T, k_positions: T, out_grad: T, "
    + _ATTRS,
    Way(lambda variant: cp_notation("grad", variant), key="variant", check=_check, wrap=_wrap,
        shapes=_SHAPES + "; out: b s h e; out_grad: b s h e; softmax_lse: b h s",
        doc="cp_attention_grad: q_grad as q; allgather: k_grad, v_grad partial over the query sequence's mesh "
            "dims; ring: sharded as k, v (the kernel rings dK, dV back); alltoall: head-parallel."),
)  # fmt: skip


def _shape(a: Args) -> list[Expect]:
    q, v = a.s("q"), a.s("v")
    if len(q) != 4 or len(v) != 4:
        raise UnknownShape
    return [(*q[:-1], v[-1]), (q[0], q[2], q[1])]


# -- cost (cost/ reads these; the ring's communication is the RingPass fact)


#: QK^T and PV on the local shapes, causal unless the op says otherwise (on average over the
#: ranks: exactly so with the zig-zag balance). Under ``variant='ring'`` the local k is one
#: block: this is one ring step's work; the kernel runs ``n`` of them (n: the ring's ranks,
#: which cost/ knows from the RingPass fact and the mesh).
_cost, _grad_cost = attention_costs(causal=True)


facts("cp_attention", shape=_shape, grad="cp_attention_grad", wrt=("q", "k", "v"), cost=_cost, outputs=("out", "softmax_lse"),
      ring=RingPass(("k", "v", "k_positions"), 1))
facts("cp_attention_grad", grad_like=("q", "k", "v"), cost=_grad_cost,
      ring=RingPass(("k", "v", "k_positions"), 1, grads=("k_grad", "v_grad")))

__all__ = ["BALANCES", "VARIANTS", "cp_notation"]
