"""A plan: every tensor's dist attr, every op's place in it and the reshards between, as the
planner builds it (:func:`spmdkit.planner.propagate.propagate`, :func:`spmdkit.planner.auto.auto_plan`):
complete when it is made, and never changed afterwards (frozen; a plan timed otherwise is a new
one: :func:`spmdkit.cost.compute.recost`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel, ReshardPlan, Step
from spmdkit.program.ir import Op, Program
from spmdkit.program.runtime import Runtime, reduces_each_microstep


@dataclass(frozen=True)
class Reshard:
    """One planned reshard: ``tensor`` from ``src`` to ``dst`` before op ``op_index`` (an input)
    or after it (``output``); ``shared`` when an earlier reshard of the same tensor to the same
    dist attr serves it (no communication of its own)."""

    tensor: str
    src: TensorDistAttr
    dst: TensorDistAttr
    op_index: int
    output: bool
    plan: ReshardPlan
    shared: bool = False

    @property
    def bytes_per_rank(self) -> int:
        return 0 if self.shared else self.plan.bytes_per_rank

    @property
    def time_s(self) -> float:
        return 0.0 if self.shared else self.plan.time_s


@dataclass(frozen=True)
class OpPlan:
    """An op's place in the plan: the dist attrs its inputs had and needed, and its outputs'."""

    index: int
    op: Op
    given: dict[str, Any]
    required: dict[str, Any]
    outputs: list[Any]
    reshards: list[Reshard] = field(default_factory=list)


@dataclass(frozen=True)
class Plan:
    """The result of :func:`spmdkit.planner.propagate.propagate`. ``annotations``: the dist attr a tensor is held in
    right after its producer where that differs from the producer's rule: the annotations
    given, and the partial tensors reduced once for all their readers (an output reshard in
    ``reshards``)."""

    program: Program
    mesh: ProcessMesh
    attrs: dict[str, TensorDistAttr]
    ops: list[OpPlan]
    reshards: list[Reshard]
    annotations: dict[str, TensorDistAttr]
    rounds: int
    cost: CostModel
    #: tensors stored otherwise than their readers get them (ZeRO-3): name -> stored dist attr
    storage: dict[str, TensorDistAttr] = field(default_factory=dict)
    #: gradient accumulation: forward and backward run this many times per step, the parameter
    #: gradients are accumulated and reduced once, or reduce-scattered every micro-step where
    #: the framework does (:meth:`reduced_each_microstep`; ``--grad-accum``, an input of the planning)
    grad_accum: int = 1
    #: how the step runs beyond its shardings (precision, framework, TP overlap): ``--precision``,
    #: ``--framework``, ``--tp-comm-overlap``; read by the cost model
    runtime: Runtime = field(default_factory=Runtime)

    def attr(self, name: str) -> TensorDistAttr:
        return self.attrs[name]

    def param_grads(self) -> frozenset[str]:
        """The gradients the optimizer-phase ops read (the parameter gradients)."""
        return self.program.param_grads()

    def repeats(self, r: Reshard, param_grads: frozenset[str] | None = None) -> int:
        """How many times per step reshard ``r`` runs: ``grad_accum`` times in the forward and
        the backward, except a parameter gradient's reduction (reduced once, after accumulation,
        unless :meth:`reduced_each_microstep`); once in the optimizer."""
        if self.grad_accum == 1 or self.program.ops[r.op_index].phase == "optimizer":
            return 1
        pg = self.param_grads() if param_grads is None else param_grads
        if r.tensor not in pg or self.reduced_each_microstep(r, pg):
            return self.grad_accum
        return 1

    @staticmethod
    def reduce_scatters_at_producer(r: Reshard) -> bool:
        """Reshard ``r`` reduce-scatters its tensor right after the op that makes it (a ZeRO-2 /
        ZeRO-3 gradient held at its shard)."""
        return r.output and any(s.kind == "reduce_scatter" for s in r.plan.steps)

    def reduced_each_microstep(self, r: Reshard, param_grads: frozenset[str] | None = None,
                               pipeline: bool = False) -> bool:
        """Reshard ``r`` reduce-scatters a parameter gradient right after the op that makes it
        (ZeRO-2 / ZeRO-3: the gradient held at its shard) and the framework does that in every
        micro-step's backward (:func:`spmdkit.program.runtime.reduces_each_microstep`;
        ``pipeline``: the plan is one microbatch's step of a pipeline's stages, whose
        microbatches are the micro-steps); otherwise a gradient is accumulated unreduced over
        the micro-steps and reduced in the last one."""
        if not self.reduce_scatters_at_producer(r):
            return False
        pg = self.param_grads() if param_grads is None else param_grads
        return r.tensor in pg and reduces_each_microstep(self.runtime.framework, 2, pipeline=pipeline)

    def microstep_reductions(self) -> list[Reshard]:
        """The reshards that reduce a parameter gradient in every micro-step
        (:meth:`reduced_each_microstep`); none without gradient accumulation."""
        if self.grad_accum == 1:
            return []
        pg = self.param_grads()
        return [r for r in self.reshards if self.reduced_each_microstep(r, pg)]

    def collectives(self, phase: str | None = None) -> list[tuple[Reshard, Step]]:
        """(reshard, step) for every communicating step (shared reshards and free local steps
        left out), optionally of one phase (forward / backward / optimizer)."""
        out = []
        for r in self.reshards:
            if r.shared:
                continue
            if phase is not None and self.program.ops[r.op_index].phase != phase:
                continue
            for s in r.plan.steps:
                if s.bytes_per_rank > 0:
                    out.append((r, s))
        return out

    @property
    def bytes_per_rank(self) -> int:
        return sum(r.bytes_per_rank for r in self.reshards)

    @property
    def time_s(self) -> float:
        return sum(r.time_s for r in self.reshards)


__all__ = ["OpPlan", "Plan", "Reshard"]
