"""Automatic sharding (first slice of issue 16): an exact search over the rules with HiGHS.

Per op, candidate input shardings (replicated; one tensor axis of one input over one mesh dim;
two inputs each with one axis over two different mesh dims) are pushed through the op's forward
rule; distinct answers (required input attrs, output attrs) are the op's candidates, at most
``max_candidates``. An integer linear program picks one candidate per op: every tensor read by
an op costs the reshard (spmdkit.reshard, the cost model propagate uses) from how its producer
holds it to how the reader requires it; edges are linearised as in Alpa, over the distinct dist
attrs of each tensor. Pins are hard constraints. The choice becomes annotations for
:func:`propagate`, so the result is the usual :class:`Plan`.

The choice is realised twice, as the chosen candidates exactly (no propagation) and as
annotations run through propagate; the cheaper plan is returned (``AutoInfo.realized``).

Not done: a memory cap, merging elementwise chains, folding
identical layers, an outer search over meshes. Costs are per reader: a reshard several readers
share is counted once per reader by the ILP (the plan shares it). Compute time counts only
where a device is given.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec
from spmdkit.graph.program import Program, _flat, layout_args, op_layout
from spmdkit.graph.propagate import Plan, propagate
from spmdkit.graph.strategy import user_attrs
from spmdkit.reshard import CostModel, plan_reshard
from spmdkit.rules.registry import get_rule


@dataclass
class AutoInfo:
    """How the search went."""

    objective_s: float
    gap: float
    solve_s: float
    status: str
    candidates: int
    variables: int
    #: which realisation of the choice the plan is: "direct" (the chosen candidates as they are)
    #: or "propagate" (propagate from the chosen dist attrs as annotations)
    realized: str = "direct"
    merged: bool = False
    folded: bool = False


def _flat_attrs(v: Any) -> list[Any]:
    return list(v) if isinstance(v, tuple) else [v]


def _options(mesh: ProcessMesh, ndim: int) -> list[tuple[int, int]]:
    """(axis, mesh dim) pairs of one tensor."""
    return [(a, d) for a in range(ndim) for d in range(len(mesh.shape)) if mesh.shape[d] > 1]


class _OneOp:
    """What compute.op_cost reads of a plan, for one op under one candidate."""

    def __init__(self, prog: Program, i: int, required: dict[str, Any], outputs: list[Any]) -> None:
        self.program = prog
        self.attrs: dict[str, TensorDistAttr] = {}
        self.ops = {i: self}
        self.required = required
        self.outputs = outputs


Cand = tuple[dict[str, TensorDistAttr], dict[str, TensorDistAttr], float, Any]


def _candidates(prog: Program, i: int, mesh: ProcessMesh, limit: int, device: Any = None) -> list[Cand]:
    """(required attr per input tensor name, output attr per output tensor name, compute time on
    ``device`` or 0) per candidate."""
    op = prog.ops[i]
    rule = get_rule(op.rule)
    layout = op_layout(op, "forward")
    tparams = [p.name for p in rule.forward.params if p.is_tensor]
    names = list(dict.fromkeys(n for n in op.input_names()))
    seeds: list[dict[str, tuple[tuple[int, int], ...]]] = [{}]
    for n in names:
        for o in _options(mesh, len(prog.tensors[n].shape)):
            seeds.append({n: (o,)})
    for n1, n2 in itertools.combinations(names, 2):
        for o1 in _options(mesh, len(prog.tensors[n1].shape)):
            for o2 in _options(mesh, len(prog.tensors[n2].shape)):
                if o1[1] != o2[1]:
                    seeds.append({n1: (o1,), n2: (o2,)})
    for n in names:  # one input over two mesh dims (two axes)
        opts = _options(mesh, len(prog.tensors[n].shape))
        for o1, o2 in itertools.combinations(opts, 2):
            if o1[0] != o2[0] and o1[1] != o2[1]:
                seeds.append({n: (o1, o2)})
    out: list[Cand] = []
    seen: set[Any] = set()
    for seed in seeds:
        def get(n: str, seed: dict[str, tuple[tuple[int, int], ...]] = seed) -> DistTensorSpec:
            shape = prog.tensors[n].shape
            dm = [-1] * len(shape)
            for a, d in seed.get(n, ()):
                dm[a] = d
            return DistTensorSpec(shape, TensorDistAttr(mesh, dm))
        try:
            res = rule.infer_forward(*layout_args(layout, get))
        except SpmdError:
            continue
        req: dict[str, TensorDistAttr] = {}
        for p, r in zip(tparams, res.inputs):
            v = op.inputs.get(p)
            if v is None:
                continue
            for rn, a in zip(_flat(v), _flat_attrs(r)):
                if rn is not None and a is not None:
                    req[rn] = a
        outs: dict[str, TensorDistAttr] = {}
        for v, a in zip(op.outputs, res.outputs):
            for on, x in zip(_flat(v), _flat_attrs(a)):
                if on is not None and x is not None:
                    outs[on] = x
        key = (tuple(sorted(req.items(), key=lambda kv: kv[0])), tuple(sorted(outs.items(), key=lambda kv: kv[0])))
        if key in seen:
            continue
        seen.add(key)
        t = 0.0
        if device is not None:
            from spmdkit.graph.compute import op_cost

            shim = _OneOp(prog, i, dict(zip(tparams, res.inputs)), list(res.outputs))
            t = op_cost(shim, i).time_s(device)
        out.append((req, outs, t, res))
        if len(out) >= limit:
            break
    if not out:
        raise ProgramError(f"auto: op {i} ({op.name or op.rule}): its rule answers no candidate sharding")
    return out


def _direct(prog: Program, mesh: ProcessMesh, cost: CostModel, chosen: list[Any],
            sources: dict[str, TensorDistAttr], fixed: dict[str, TensorDistAttr]) -> Plan:
    """The plan of exactly the chosen candidates (no propagation): each op runs as its
    candidate says, its inputs resharded from how they are held."""
    from spmdkit.graph.propagate import OpPlan, Reshard

    made: dict[str, TensorDistAttr] = {}
    for n, t in prog.tensors.items():
        made[n] = fixed.get(n) or sources.get(n) or TensorDistAttr.replicated(mesh, len(t.shape))
    final = dict(made)
    held: dict[str, TensorDistAttr] = dict(fixed)
    reshards: list[Reshard] = []
    seen: set[tuple[str, TensorDistAttr]] = set()

    def reshard(n: str, a: TensorDistAttr, b: TensorDistAttr, i: int, output: bool) -> Reshard:
        t = prog.tensors[n]
        r = Reshard(n, a, b, i, output, plan_reshard(a, b, t.shape, t.itemsize, cost),
                    shared=(n, b) in seen and not output)
        seen.add((n, b))
        reshards.append(r)
        return r

    ops: list[OpPlan] = []
    for i, (op, res) in enumerate(zip(prog.ops, chosen)):
        rule = get_rule(op.rule)
        tparams = [p.name for p in rule.forward.params if p.is_tensor]
        opp = OpPlan(i, op, {}, {}, [])
        for p, req in zip(tparams, res.inputs):
            v = op.inputs.get(p)
            if v is None:
                continue
            refs = _flat(v)
            opp.given[p] = tuple(None if n is None else made[n] for n in refs) if isinstance(v, tuple) else made[v]
            opp.required[p] = req
            for rn, r in zip(refs, _flat_attrs(req)):
                if rn is not None and r is not None and made[rn] != r:
                    opp.reshards.append(reshard(rn, made[rn], r, i, False))
        for v, a in zip(op.outputs, res.outputs):
            opp.outputs.append(a)
            for on, o in zip(_flat(v), _flat_attrs(a)):
                if on is None or o is None:
                    continue
                over = prog.tensors[on].inplace_of
                target = fixed.get(on) or (made[over] if over is not None and over in op.input_names() else None)
                if target is not None and target != o:
                    opp.reshards.append(reshard(on, o, target, i, True))
                    held[on] = target
                    made[on] = final[on] = target
                else:
                    made[on] = final[on] = o
        ops.append(opp)
    return Plan(prog, mesh, final, ops, reshards, held, 0, cost)


def _quiet_highs(highspy: Any) -> Any:
    """A Highs instance whose banner (printed to fd 1 by its constructor) does not reach stdout."""
    sys.stdout.flush()
    saved = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    try:
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)
    return h


def auto_plan(prog: Program, mesh: ProcessMesh, pins: Mapping[str, Any] | None = None,
              cost: CostModel | None = None, time_limit: float = 30.0,
              max_candidates: int = 24, device: Any = None) -> tuple[Plan, AutoInfo]:
    """A plan of ``prog`` on ``mesh`` whose shardings minimise the predicted communication
    time (plus each op's compute time from compute.op_cost on ``device``, a compute.Device,
    where one is given), ``pins`` (tensor -> dims_mapping or dist attr) held as hard
    constraints."""
    try:
        import highspy
    except ImportError:
        raise ProgramError("auto: the search needs highspy (pip install 'spmdkit[auto]')") from None
    cost = cost or CostModel.default(mesh)
    fixed = user_attrs(prog, mesh, pins)
    cands = [_candidates(prog, i, mesh, max_candidates, device) for i in range(len(prog.ops))]
    producer: dict[str, int] = {}
    for i, op in enumerate(prog.ops):
        for n in op.output_names():
            producer.setdefault(n, i)
    priced: dict[Any, float] = {}

    def price(n: str, src: TensorDistAttr, dst: TensorDistAttr) -> float:
        if src == dst:
            return 0.0
        t = prog.tensors[n]
        key = (src, dst, t.shape, t.itemsize)
        p = priced.get(key)
        if p is None:
            p = priced[key] = plan_reshard(src, dst, t.shape, t.itemsize, cost).time_s
        return p

    h = _quiet_highs(highspy)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("random_seed", 0)
    x: list[list[int]] = []
    nvar = 0
    obj: dict[int, float] = {}

    def new_var(c: float, lo: float = 0.0, hi: float = 1.0, integer: bool = False) -> int:
        nonlocal nvar
        h.addVar(lo, hi)
        k = nvar
        nvar += 1
        if integer:
            h.changeColIntegrality(k, highspy.HighsVarType.kInteger)
        if c:
            obj[k] = obj.get(k, 0.0) + c
        return k

    for i, cs in enumerate(cands):
        x.append([new_var(c[2], integer=True) for c in cs])
        h.addRow(1.0, 1.0, len(cs), x[i], [1.0] * len(cs))
    # pinned outputs: their producer's candidate pays the reshard to the pin
    for n, pin in fixed.items():
        if n in producer:
            i = producer[n]
            for k, (_, outs, _, _) in enumerate(cands[i]):
                if n in outs:
                    obj[x[i][k]] = obj.get(x[i][k], 0.0) + price(n, outs[n], pin)
    # free sources: one choice among the attrs their readers ask for
    src_choice: dict[str, tuple[list[TensorDistAttr], list[int]]] = {}
    for i, op in enumerate(prog.ops):
        for n in dict.fromkeys(op.input_names()):
            if (n in producer and producer[n] < i) or n in fixed or n in src_choice:
                continue
            attrs = list(dict.fromkeys(req[n] for op2 in cands for req, _, _, _ in op2 if n in req))
            attrs = [a for a in attrs if not a.partial] or [TensorDistAttr.replicated(mesh, len(prog.tensors[n].shape))]
            vs = [new_var(0.0, integer=True) for _ in attrs]
            h.addRow(1.0, 1.0, len(vs), vs, [1.0] * len(vs))
            src_choice[n] = (attrs, vs)

    def held(n: str, reader: int) -> list[tuple[TensorDistAttr, list[int]]]:
        """How ``n`` may be held for ``reader``: (attr, the 0/1 variables whose sum says so)."""
        if n in fixed:
            return [(fixed[n], [])]
        if n in producer and producer[n] < reader:
            i = producer[n]
            groups: dict[TensorDistAttr, list[int]] = {}
            for k, (_, outs, _, _) in enumerate(cands[i]):
                a = outs.get(n) or TensorDistAttr.replicated(mesh, len(prog.tensors[n].shape))
                groups.setdefault(a, []).append(x[i][k])
            return list(groups.items())
        attrs, vs = src_choice[n]
        return [(a, [v]) for a, v in zip(attrs, vs)]

    const = 0.0

    def edge(n: str, src: list[tuple[TensorDistAttr, list[int]]], dst: list[tuple[TensorDistAttr, list[int]]]) -> None:
        """The reshard of ``n`` from how it is (one of ``src``) to how it is wanted (one of
        ``dst``); each side: (attr, the 0/1 variables whose sum says it is that attr)."""
        nonlocal const
        if len(src) == 1 and len(dst) == 1:  # both certain
            const += price(n, src[0][0], dst[0][0])
            return
        if len(dst) == 1:  # the wanted attr is certain: the cost falls on the held groups
            for a, vs in src:
                for v in vs:
                    obj[v] = obj.get(v, 0.0) + price(n, a, dst[0][0])
            return
        if len(src) == 1:  # the held attr is certain: the cost falls on the wanted groups
            for b, ys in dst:
                for y in ys:
                    obj[y] = obj.get(y, 0.0) + price(n, src[0][0], b)
            return
        e: dict[tuple[int, int], int] = {}
        for ai, (a, _) in enumerate(src):
            for bi, (b, _) in enumerate(dst):
                e[ai, bi] = new_var(price(n, a, b))
        for ai, (_, vs) in enumerate(src):  # sum_b e_ab = [held as a]
            idx = [e[ai, bi] for bi in range(len(dst))] + vs
            h.addRow(0.0, 0.0, len(idx), idx, [1.0] * len(dst) + [-1.0] * len(vs))
        for bi, (_, ys) in enumerate(dst):  # sum_a e_ab = [required as b]
            idx = [e[ai, bi] for ai in range(len(src))] + ys
            h.addRow(0.0, 0.0, len(idx), idx, [1.0] * len(src) + [-1.0] * len(ys))

    def groups(j: int, n: str, side: int) -> list[tuple[TensorDistAttr, list[int]]]:
        g: dict[TensorDistAttr, list[int]] = {}
        for k, cand in enumerate(cands[j]):
            got = cand[0] if side == 0 else cand[1]
            a = got.get(n) or TensorDistAttr.replicated(mesh, len(prog.tensors[n].shape))
            g.setdefault(a, []).append(x[j][k])
        return list(g.items())

    for j, op in enumerate(prog.ops):
        reads = list(dict.fromkeys(op.input_names()))
        for n in reads:
            edge(n, held(n, j), groups(j, n, 0))
        for n in op.output_names():  # an in-place output: back to how the tensor it overwrites is held
            over = prog.tensors[n].inplace_of
            if over is not None and over in reads and n not in fixed:
                edge(n, groups(j, n, 1), held(over, j))
    for k, c in obj.items():
        h.changeColCost(k, c)
    h.changeObjectiveSense(highspy.ObjSense.kMinimize)
    t0 = time.perf_counter()
    h.run()
    solve_s = time.perf_counter() - t0
    status = h.modelStatusToString(h.getModelStatus())
    sol = h.getSolution().col_value
    if len(sol) != nvar:
        raise ProgramError(f"auto: HiGHS found no solution ({status}) within {time_limit} s")
    info = h.getInfo()
    ann: dict[str, TensorDistAttr] = {}
    for n, (attrs, vs) in src_choice.items():
        ann[n] = attrs[max(range(len(vs)), key=lambda k: sol[vs[k]])]
    for i in range(len(prog.ops)):
        k = max(range(len(x[i])), key=lambda k: sol[x[i][k]])
        for n, a in cands[i][k][1].items():
            if producer.get(n) == i and prog.tensors[n].inplace_of is None and not a.partial:
                ann[n] = a
    ann.update(fixed)
    # two realisations of the choice, both ordinary plans: exactly the chosen candidates, and
    # propagate run from the chosen dist attrs as annotations; the cheaper is returned
    chosen = [cands[i][max(range(len(x[i])), key=lambda k: sol[x[i][k]])][3] for i in range(len(prog.ops))]
    plans = {"direct": _direct(prog, mesh, cost, chosen, {n: ann[n] for n in src_choice}, fixed),
             "propagate": propagate(prog, mesh, ann, cost)}

    def total(p: Plan) -> float:
        if device is None:
            return p.time_s
        from spmdkit.graph.compute import op_cost

        return p.time_s + sum(op_cost(p, i).time_s(device) for i in range(len(p.ops)))

    realized = min(plans, key=lambda k: total(plans[k]))
    plan = plans[realized]
    return plan, AutoInfo(objective_s=float(info.objective_function_value) + const, gap=float(info.mip_gap),
                          solve_s=solve_s, status=status, realized=realized, candidates=sum(len(c) for c in cands), variables=nvar)


__all__ = ["AutoInfo", "auto_plan"]
