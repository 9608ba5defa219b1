"""Automatic sharding (first slice of issue 16): an exact search over the rules with HiGHS.

Per op, candidate input shardings (replicated; one tensor axis of one input over one mesh dim;
two inputs each with one axis over two different mesh dims) are pushed through the op's forward
rule; distinct answers (required input attrs, output attrs) are the op's candidates, at most
``max_candidates``. An integer linear program picks one candidate per op: every tensor read by
an op costs the reshard (spmdkit.reshard, the cost model propagate uses) from how its producer
holds it to how the reader requires it; edges are linearised as in Alpa, over the distinct dist
attrs of each tensor. Pins are hard constraints. The choice becomes annotations for
:func:`propagate`, so the result is the usual :class:`Plan`.

Not done: compute time (communication only), a memory cap, merging elementwise chains, folding
identical layers, an outer search over meshes. Costs are per reader: a reshard several readers
share is counted once per reader by the ILP (propagate shares it).
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


Cand = tuple[dict[str, TensorDistAttr], dict[str, TensorDistAttr], float]


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
        out.append((req, outs, t))
        if len(out) >= limit:
            break
    if not out:
        raise ProgramError(f"auto: op {i} ({op.name or op.rule}): its rule answers no candidate sharding")
    return out


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
            for k, (_, outs, _) in enumerate(cands[i]):
                if n in outs:
                    obj[x[i][k]] = obj.get(x[i][k], 0.0) + price(n, outs[n], pin)
    # free sources: one choice among the attrs their readers ask for
    src_choice: dict[str, tuple[list[TensorDistAttr], list[int]]] = {}
    for i, op in enumerate(prog.ops):
        for n in set(op.input_names()):
            if (n in producer and producer[n] < i) or n in fixed or n in src_choice:
                continue
            attrs = list(dict.fromkeys(req[n] for op2 in cands for req, _, _ in op2 if n in req))
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
            for k, (_, outs, _) in enumerate(cands[i]):
                a = outs.get(n) or TensorDistAttr.replicated(mesh, len(prog.tensors[n].shape))
                groups.setdefault(a, []).append(x[i][k])
            return list(groups.items())
        attrs, vs = src_choice[n]
        return [(a, [v]) for a, v in zip(attrs, vs)]

    for j, op in enumerate(prog.ops):
        for n in set(op.input_names()):
            src = held(n, j)
            dst: dict[TensorDistAttr, list[int]] = {}
            for k, (req, _, _) in enumerate(cands[j]):
                a = req.get(n) or TensorDistAttr.replicated(mesh, len(prog.tensors[n].shape))
                dst.setdefault(a, []).append(x[j][k])
            if len(src) == 1 and not src[0][1]:  # a fixed source: a cost on the reader's candidates
                for b, ys in dst.items():
                    c = price(n, src[0][0], b)
                    for y in ys:
                        obj[y] = obj.get(y, 0.0) + c
                continue
            if len(src) == 1 or len(dst) == 1:
                # one side is certain: the cost falls on the other side's groups
                if len(dst) == 1:
                    b = next(iter(dst))
                    for a, vs in src:
                        for v in vs:
                            obj[v] = obj.get(v, 0.0) + price(n, a, b)
                else:
                    a = src[0][0]
                    for b, ys in dst.items():
                        for y in ys:
                            obj[y] = obj.get(y, 0.0) + price(n, a, b)
                continue
            e: dict[tuple[int, int], int] = {}
            for ai, (a, _) in enumerate(src):
                for bi, b in enumerate(dst):
                    e[ai, bi] = new_var(price(n, a, b))
            for ai, (_, vs) in enumerate(src):  # sum_b e_ab = [held as a]
                idx = [e[ai, bi] for bi in range(len(dst))] + vs
                h.addRow(0.0, 0.0, len(idx), idx, [1.0] * len(dst) + [-1.0] * len(vs))
            for bi, ys in enumerate(dst.values()):  # sum_a e_ab = [required as b]
                idx = [e[ai, bi] for ai in range(len(src))] + ys
                h.addRow(0.0, 0.0, len(idx), idx, [1.0] * len(src) + [-1.0] * len(ys))
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
    plan = propagate(prog, mesh, ann, cost)
    return plan, AutoInfo(objective_s=float(info.objective_function_value), gap=float(info.mip_gap),
                          solve_s=solve_s, status=status, candidates=sum(len(c) for c in cands), variables=nvar)


__all__ = ["AutoInfo", "auto_plan"]
