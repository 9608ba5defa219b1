"""Realising the exact search's choice (:mod:`spmdkit.planner.auto`) as a plan, twice: the chosen
candidates exactly (:func:`direct_plan`, no propagation) and the chosen dist attrs as annotations
run through propagate; :class:`Realiser` returns the cheaper (the smaller under a memory cap)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel, plan_reshard
from spmdkit.cost.compute import op_cost
from spmdkit.cost.devices import Device
from spmdkit.cost.memory import memory_per_device
from spmdkit.engine.registry import get_rule
from spmdkit.planner.auto.candidates import flat_attrs
from spmdkit.planner.auto.ilp import Problem
from spmdkit.planner.propagate import propagate
from spmdkit.program.ir import Program, flat_refs
from spmdkit.program.plan import OpPlan, Plan, Reshard


def direct_plan(prog: Program, mesh: ProcessMesh, cost: CostModel, chosen: list[Any],
                sources: dict[str, TensorDistAttr], fixed: Mapping[str, TensorDistAttr],
                kept: list[dict[str, TensorDistAttr]] | None = None) -> Plan:
    """The plan of exactly the chosen candidates (no propagation): each op runs as its
    candidate says, its inputs resharded from how they are held; an output its candidate
    holds otherwise than the rule makes it (``kept``: a partial output reduced once for all its
    readers) is resharded right after the op."""
    made: dict[str, TensorDistAttr] = {}
    for n, t in prog.tensors.items():
        made[n] = fixed.get(n) or sources.get(n) or TensorDistAttr.replicated(mesh, len(t.shape))
    final = dict(made)
    held: dict[str, TensorDistAttr] = dict(fixed)
    reshards: list[Reshard] = []
    seen: set[tuple[str, TensorDistAttr]] = set()
    planned: dict[Any, Any] = {}

    def reshard(n: str, a: TensorDistAttr, b: TensorDistAttr, i: int, output: bool) -> Reshard:
        t = prog.tensors[n]
        key = (a, b, t.shape, t.itemsize)
        p = planned.get(key)
        if p is None:
            p = planned[key] = plan_reshard(a, b, t.shape, t.itemsize, cost)
        r = Reshard(n, a, b, i, output, p, shared=(n, b) in seen and not output)
        seen.add((n, b))
        reshards.append(r)
        return r

    ops: list[OpPlan] = []
    for i, (op, res) in enumerate(zip(prog.ops, chosen)):
        rule = get_rule(op.rule)
        tparams = [p.name for p in rule.forward.params if p.is_tensor]
        given: dict[str, Any] = {}
        required: dict[str, Any] = {}
        outputs: list[Any] = []
        mine: list[Reshard] = []
        for p, req in zip(tparams, res.inputs):
            v = op.inputs.get(p)
            if v is None:
                continue
            refs = flat_refs(v)
            given[p] = tuple(None if n is None else made[n] for n in refs) if isinstance(v, tuple) else made[v]
            required[p] = req
            for rn, r in zip(refs, flat_attrs(req)):
                if rn is not None and r is not None and made[rn] != r:
                    mine.append(reshard(rn, made[rn], r, i, False))
        for v, a in zip(op.outputs, res.outputs):
            outputs.append(a)
            for on, o in zip(flat_refs(v), flat_attrs(a)):
                if on is None or o is None:
                    continue
                over = prog.tensors[on].inplace_of
                target = fixed.get(on) or (made[over] if over is not None and over in op.input_names() else None) \
                    or (kept[i].get(on) if kept is not None else None)
                if target is not None and target != o:
                    mine.append(reshard(on, o, target, i, True))
                    held[on] = target
                    made[on] = final[on] = target
                else:
                    made[on] = final[on] = o
        ops.append(OpPlan(i, op, given, required, outputs, mine))
    return Plan(prog, mesh, final, ops, reshards, held, 0, cost)


class Realiser:
    """A solution of the integer program -> (plan, "direct" | "propagate"): the cheaper of the
    two realisations (predicted communication, plus compute on a ``device``); under
    ``memory_cap`` the cheaper of those that fit, else the smaller."""

    def __init__(self, problem: Problem, cost: CostModel, device: Device | None, memory_cap: int | None) -> None:
        self.problem, self.cost, self.device, self.memory_cap = problem, cost, device, memory_cap

    def annotations(self, s: list[float]) -> dict[str, TensorDistAttr]:
        """The chosen dist attrs: of the free sources and of each op's own (non-partial) outputs."""
        pb = self.problem
        prog, cands = pb.prog, pb.space.cands
        ann: dict[str, TensorDistAttr] = {}
        for n, (attrs, vs) in pb.src_choice.items():
            ann[n] = attrs[max(range(len(vs)), key=lambda k: s[vs[k]])]
        for i in range(len(prog.ops)):
            for n, a in cands[i][pb.pick(s, i)][1].items():
                if pb.space.producer.get(n) == i and prog.tensors[n].inplace_of is None and not a.partial:
                    ann[n] = a
        ann.update(pb.fixed)
        return ann

    def total(self, p: Plan) -> float:
        if self.device is None:
            return p.time_s
        return p.time_s + sum(float(self.device.op_time(op_cost(p, i))) for i in range(len(p.ops)))

    def __call__(self, s: list[float]) -> tuple[Plan, str]:
        pb = self.problem
        prog, mesh, cands = pb.prog, pb.mesh, pb.space.cands
        n_ops = len(prog.ops)
        ann = self.annotations(s)
        chosen = [cands[i][pb.pick(s, i)][3] for i in range(n_ops)]
        plans = {"direct": direct_plan(prog, mesh, self.cost, chosen, {n: ann[n] for n in pb.src_choice}, pb.fixed,
                                       [cands[i][pb.pick(s, i)][1] for i in range(n_ops)]),
                 "propagate": propagate(prog, mesh, ann, self.cost)}
        cap = self.memory_cap
        if cap is not None:
            need = {k: memory_per_device(p).total for k, p in plans.items()}
            fits = [k for k in plans if need[k] <= cap]
            if not fits:  # neither fits: the smaller
                return plans[min(need, key=lambda k: need[k])], min(need, key=lambda k: need[k])
            plans = {k: plans[k] for k in fits}
        best = min(plans, key=lambda k: self.total(plans[k]))
        return plans[best], best


__all__ = ["Realiser", "direct_plan"]
