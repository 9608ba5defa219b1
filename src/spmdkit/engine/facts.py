"""What an op means besides its sharding rule, declared by its family beside the rule.

An op family module (``spmdkit.ops.*``) declares its rules with :func:`spmdkit.engine.declare.declare`
and, beside each, the op's other facts with :func:`facts`:

* ``shape``: the global output shapes the op makes from its input shapes and attributes
  (``Program.validate`` refuses a program whose declared output shapes contradict its op);
* ``cost``: the op's FLOPs and bytes on one device (an :class:`OpCost`) from its local (sharded)
  tensors (a :class:`LocalOp`); ``collectives``: the all-reduces its kernel runs inside itself
  (a :class:`ClassAllReduces`; the cost model times them); ``ring``: the blocks its kernel
  passes round the ranks itself (a :class:`RingPass`: ring attention's KV blocks);
* ``wrt``: the inputs the op is differentiated against, and the grad op that does it (autodiff);
  ``grad_reads``: the grad op's parameters that read a forward output of another name;
  ``outputs``: the names of the op's outputs where no reverse rule names them (the grad op
  reads output ``o`` as ``o`` and its gradient as ``grad_o``: moe_gate_dispatch);
* ``unchecked``: why an output's shape is not (fully) checked (its size is not fixed by the
  shapes and attributes: data-dependent sizes, kernel workspace);
* ``grad_like``: for a grad rule without a ``shape``, the tensor parameter each output has the
  shape of, where deriving it from the base rule's signature does not say
  (:mod:`spmdkit.program.shapes`);
* ``choice``: an attribute the planner sets, ``(name, values)``: the rule answers otherwise
  under each value and the kernel computes every such answer (moe_combine's ``local_rows``); the
  propagation keeps the cheapest (:mod:`spmdkit.planner.propagate`).

Shape functions take and answer the types of :mod:`spmdkit.engine.outshape`.

The engine only keeps the table: it knows nothing of particular ops, and the layers above
(program, cost) read it through :func:`facts_of`. Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

#: a tensor on one device: its local (largest-shard) shape, itemsize and dtype
LocalTensor = tuple[tuple[int, ...], int, str]


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class LocalOp:
    """An op on one device, the argument of its family's cost function: its rule name (as the
    program spells it) and attributes, ``ins[param]`` (a list: a vector parameter has several;
    an absent input has no entry) and ``outs`` (per output position, None where absent)."""

    __slots__ = ("attrs", "ins", "outs", "rule")

    def __init__(self, rule: str, attrs: Mapping[str, Any], ins: dict[str, list[LocalTensor]],
                 outs: list[LocalTensor | None]) -> None:
        self.rule = rule
        self.attrs = attrs
        self.ins = ins
        self.outs = outs

    def one(self, p: str) -> LocalTensor | None:
        a = self.ins.get(p)
        return a[0] if a else None

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    @property
    def in_bytes(self) -> int:
        return sum(_numel(s) * b for args in self.ins.values() for s, b, _ in args)

    @property
    def out_bytes(self) -> int:
        return sum(_numel(o[0]) * o[1] for o in self.outs if o is not None)

    @property
    def out_numel(self) -> int:
        return sum(_numel(o[0]) for o in self.outs if o is not None)

    def first_out(self) -> LocalTensor | None:
        return next((o for o in self.outs if o is not None), None)

    def dtype(self) -> str:
        for args in self.ins.values():
            for _, _, dt in args:
                return dt
        o = self.first_out()
        return o[2] if o else "float32"


@dataclass(frozen=True)
class OpCost:
    """One op on one device: FLOPs executed, model FLOPs (without a kernel's recomputation),
    bytes read + written in device memory, whether it runs on the tensor cores (at the matmul
    peak of ``dtype``), whether its rule is costed at all, and what the device's achievable rate
    depends on (:mod:`spmdkit.cost.rates`): the GEMM shapes, the attention pass, fp8, kernels.
    (Its time on a device: :meth:`spmdkit.cost.devices.Device.op_time`.)"""

    flops: float
    model_flops: float
    bytes: float
    matmul: bool = False
    dtype: str = "float32"
    covered: bool = True
    #: the GEMMs the op runs, each ``(batch, m, n, k)`` on its local shapes (a matmul's one, its
    #: grad's two: dx and dy); the device's GEMM efficiency is taken per shape. Empty: not GEMMs
    #: (or their shapes unknown: the large-GEMM ceiling applies)
    gemms: tuple[tuple[int, int, int, int], ...] = ()
    #: per GEMM of ``gemms`` (where given): the experts' rows of a grouped GEMM whose M is the
    #: tokens an expert received, as ``(mean rows, sd, experts)`` groups
    #: (:func:`spmdkit.cost.rates.grouped_tile_utilisation`); ``()`` for a GEMM timed by its shape
    grouped_rows: tuple[tuple[tuple[float, float, int], ...], ...] = ()
    #: a flash-attention pass: ``(backward, sequence (keys), head dim, causal)``; None otherwise
    attention: tuple[bool, int, int, bool] | None = None
    #: the framework whose attention kernel runs the pass (``Runtime.framework``, set by
    #: :func:`spmdkit.cost.compute.op_cost`; the device's rates map it to a kernel; empty: megatron)
    framework: str = ""
    #: the kernel that runs the pass where the run names one (``--attention-kernel``); empty: the
    #: framework's
    attention_kernel: str = ""
    #: the GEMMs run on the fp8 tensor cores (``--precision fp8``, a linear layer's GEMM)
    fp8: bool = False
    #: bytes of the fp8 casts (and amax) the op adds: memory-bound kernels run before the GEMMs
    cast_bytes: float = 0.0
    #: kernels the op launches (0: a view, metadata only)
    kernels: int = 1
    #: the weight-gradient GEMMs, the last ``wgrad_gemms`` of ``gemms``, run as kernels of their
    #: own whose epilogue reads and writes the fp32 main gradient (Megatron's gradient
    #: accumulation fusion: :func:`spmdkit.cost.compute.fused_wgrad`); ``wgrad_bytes`` (part of
    #: ``bytes``) their operands and that gradient. 0: the op timed as one kernel
    wgrad_gemms: int = 0
    wgrad_bytes: float = 0.0
    #: a pass (forward or backward) of torchao's rowwise float8 linear: the linear's forward
    #: ``(M, K, N)``; its time is scaled by torchao's published microbenchmark of that linear
    #: (:func:`spmdkit.cost.torchao_rowwise.rowwise_scale`). None: not one
    rowwise: tuple[int, int, int] | None = None


#: a family's cost function
CostFn = Callable[[LocalOp], OpCost]


@dataclass(frozen=True)
class ClassAllReduces:
    """The all-reduces an op's kernel runs itself over the ranks sharing the class (last) axis of
    its input ``x`` (a vocab-parallel loss): one per ``(what, reduce type)`` in ``reductions``, of
    a float32 buffer of one element per row. The rows are ``x``'s without its class axis, or,
    with ``rows_of``, every element of that input (a multi-label loss's labels)."""

    reductions: tuple[tuple[str, str], ...]
    rows_of: str | None = None


@dataclass(frozen=True)
class RingPass:
    """Blocks an op's kernel passes round the ranks itself (ring attention): where the op's
    attribute ``attr`` is ``value``, the ranks sharding axis ``axis`` of the inputs ``blocks``
    (the key sequence of k and v) send their local blocks on round the ring: ``n - 1`` send/recv
    steps over those ``n`` ranks, each step's transfer overlappable with the computation of the
    block the rank already holds. ``grads``: the backward's blocks that travel with them and end
    back at their owner (dK and dV: ``n`` steps; the forward's blocks travel again too)."""

    blocks: tuple[str, ...]
    axis: int
    attr: str = "variant"
    value: str = "ring"
    grads: tuple[str, ...] = ()

    def applies(self, attrs: Mapping[str, Any]) -> bool:
        """Whether an op with these attributes runs the ring."""
        return attrs.get(self.attr) == self.value


@dataclass(frozen=True)
class OpFacts:
    """One rule's facts; a field is None where the family declares none."""

    shape: Callable[..., Any] | None = None
    cost: CostFn | None = None
    grad: str | None = None
    wrt: tuple[str, ...] | None = None
    grad_reads: tuple[tuple[str, str], ...] | None = None
    unchecked: str | None = None
    grad_like: tuple[str, ...] | None = None
    collectives: ClassAllReduces | None = None
    outputs: tuple[str, ...] | None = None
    ring: RingPass | None = None
    choice: tuple[str, tuple[Any, ...]] | None = None


_FACTS: dict[str, OpFacts] = {}


def facts(*names: str, shape: Callable[..., Any] | None = None, cost: CostFn | None = None,
          grad: str | None = None, wrt: tuple[str, ...] | None = None,
          grad_reads: tuple[tuple[str, str], ...] | None = None, unchecked: str | None = None,
          grad_like: tuple[str, ...] | None = None, collectives: ClassAllReduces | None = None,
          outputs: tuple[str, ...] | None = None, ring: RingPass | None = None,
          choice: tuple[str, tuple[Any, ...]] | None = None) -> None:
    """Declare facts of the rules ``names`` (a fact given again for a name replaces the earlier one;
    facts not given keep what an earlier call declared)."""
    if not names:
        raise ValueError("facts() needs at least one rule name")
    for name in names:
        old = _FACTS.get(name, _NONE)
        _FACTS[name] = OpFacts(shape if shape is not None else old.shape, cost if cost is not None else old.cost,
                               grad if grad is not None else old.grad, wrt if wrt is not None else old.wrt,
                               grad_reads if grad_reads is not None else old.grad_reads,
                               unchecked if unchecked is not None else old.unchecked,
                               grad_like if grad_like is not None else old.grad_like,
                               collectives if collectives is not None else old.collectives,
                               outputs if outputs is not None else old.outputs,
                               ring if ring is not None else old.ring,
                               choice if choice is not None else old.choice)


def facts_of(name: str) -> OpFacts:
    """The facts declared for rule ``name`` (the canonical name: resolve aliases first); an empty
    :class:`OpFacts` where none are."""
    return _FACTS.get(name) or _NONE


def declared() -> frozenset[str]:
    """Every rule name with facts declared."""
    return frozenset(_FACTS)


_NONE = OpFacts()

__all__ = ["ClassAllReduces", "CostFn", "LocalOp", "LocalTensor", "OpCost", "OpFacts", "RingPass", "declared", "facts",
           "facts_of"]
