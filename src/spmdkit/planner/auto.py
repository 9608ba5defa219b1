"""Automatic sharding (issue 16): an exact search over the rules' own candidates, solved by HiGHS.

Candidates. Per op, seeds are pushed through the op's forward rule: for every mesh dim (of size
> 1) independently one of: nothing, every floating input partial over it, one floating input
partial over it, or one axis of one input sharded over it (the same axis on two mesh dims is a
co-shard); the product over the mesh dims (at most :data:`MAX_SEEDS`). The distinct answers
(required input dist attrs, output dist attrs) are the op's candidates, all of them (no cap
unless ``max_candidates`` is given: then the cheapest by compute time). Ops that are the same
op on the same shapes (repeated layers) share one generation. A partial output read by several
ops may also be held reduced right after its op (replicated or reduce-scattered onto a free
axis: variants of the candidate paying the reduction once, as propagate reduces it once).

Merging (Alpa): an op whose only input is made by an earlier op (a reshape, a reduction, an
elementwise op of one tensor), with no pinned or in-place output, takes no choice of its own:
its candidate is its rule's answer on its input as the producer's candidate makes it, so it
shares the producer's variables.

Folding: ops are grouped by the number in their tensors' names (``layers.3.`` -> 3; optimizer
ops by their parameter's name). Groups whose ops are the same op by op (rules, shapes, names up
to the layer number relative to the group's, pins, merging) are tied to the first of them: one
set of variables and one copy of each edge (its cost times the number of layers) for all.
The boundary between two tied layers is an edge like any other, so the choice is exact among
plans that repeat one choice per identical layer.

The program. Exactly one candidate per (unmerged, untied) op; free sources (parameters, optimizer
states, inputs) choose among the non-partial dist attrs their readers ask for. Every read costs
the reshard (spmdkit.core.reshard, the plan's cost model) from how the tensor is held to how the
reader's candidate requires it; edges between two choices are linearised as in Alpa over the
tensor's distinct dist attrs on each side (edges between the same variables share one
linearisation). In-place outputs pay the reshard back to the tensor they overwrite, pinned
outputs the reshard to the pin. With a device each candidate also costs its op's compute time
(compute.op_cost) and the collectives inside its kernel (compute.kernel_collectives).
``memory_cap``: per-device memory is linear in the choices: parameters, parameter gradients
and optimizer states (as held), the activations the backward reads (memory.value_reads)
and, per op position, the activations live there and the reshard copies the op reads (local
bytes). A choice whose realised plan (memory.memory_per_device) exceeds the cap is re-solved
with memory priced into the objective (Lagrangian relaxation of the memory rows: the kept
activations' row and the row of every position where a realised plan peaked), the price raised
until a plan fits and then bisected, at most :data:`MEMORY_ROUNDS` solves within the time limit;
the gap is then against the Lagrangian bound, so a capped plan is not proven optimal. A cap
below the least any choice holds is a ProgramError at once.

The choice is realised twice, as the chosen candidates exactly (no propagation) and as
annotations run through propagate; the cheaper plan is returned (``AutoInfo.realized``).
Costs are per reader: a reshard several readers share is counted once per reader.
"""

from __future__ import annotations

import itertools
import math
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel, plan_reshard
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.registry import get_rule
from spmdkit.planner.propagate import propagate
from spmdkit.program.ir import Program, flat_refs, layout_args, op_layout
from spmdkit.program.plan import Plan
from spmdkit.strategies.strategy import user_attrs

#: the most seeds pushed through one op's rule (the product over the mesh dims of the choices
#: per dim; a 2-D mesh never reaches it)
MAX_SEEDS = 4096
#: the most re-solves (with the memory penalty) when the cheapest plan does not fit the cap
MEMORY_ROUNDS = 8
#: the relative gap each memory-priced re-solve stops at
PENALISED_GAP = 0.01
#: the memory price is bisected until the price that fits is within this factor of one that does not
BISECT_RATIO = 2.0
#: the program's costs are microseconds (seconds are too small for the solver's tolerances)
_SCALE = 1e6

Progress = Callable[[str, int, int], None]
_FLOAT = ("float16", "bfloat16", "float32", "float64")


@dataclass
class LayerChoice:
    """``--explain``: one layer (group of ops) of the choice: what it runs as and what the best
    plan whose choice differs in that layer would cost (``runner_up_s``; None when no other
    choice exists or the solver found none in time)."""

    layer: str
    ops: int
    chosen: str
    objective_s: float
    runner_up_s: float | None
    runner_up: str

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "ops": self.ops, "chosen": self.chosen, "objective_s": self.objective_s,
                "runner_up_s": self.runner_up_s, "runner_up": self.runner_up}


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
    #: ops merged into their producer, layers tied to an identical one
    merged_ops: int = 0
    folded_layers: int = 0
    #: seconds spent making candidates (the rest of the wall time is solving and realising)
    candidates_s: float = 0.0
    memory_cap: int | None = None
    #: parameters + gradients + optimizer states + activations kept for the backward of the
    #: choice, as the integer program counts them (bytes per device)
    memory_bytes: int | None = None
    explain: list[LayerChoice] = field(default_factory=list)


def _flat_attrs(v: Any) -> list[Any]:
    return list(v) if isinstance(v, tuple) else [v]


class _OneOp:
    """What compute.op_cost reads of a plan, for one op under one candidate."""

    def __init__(self, prog: Program, i: int, required: dict[str, Any], outputs: list[Any]) -> None:
        self.program = prog
        self.attrs: dict[str, TensorDistAttr] = {}
        self.ops = {i: self}
        self.required = required
        self.outputs = outputs


Cand = tuple[dict[str, TensorDistAttr], dict[str, TensorDistAttr], float, Any]
_SlotCand = tuple[tuple[tuple[int, TensorDistAttr], ...], tuple[tuple[int, TensorDistAttr], ...], float, Any]


def _enc(v: Any, slot: Mapping[str, int]) -> Any:
    if isinstance(v, tuple):
        return tuple(None if n is None else slot[n] for n in v)
    return None if v is None else slot[v]


class _Gen:
    """Candidates per op, generated once per distinct op (rule, attrs, argument structure,
    shapes and dtypes), kept by argument slot and renamed for each op."""

    def __init__(self, prog: Program, mesh: ProcessMesh, cost: CostModel, device: Any,
                 max_candidates: int | None) -> None:
        self.prog, self.mesh, self.cost, self.device, self.limit = prog, mesh, cost, device, max_candidates
        self.cache: dict[Any, list[_SlotCand]] = {}
        self.derived: dict[Any, _SlotCand | None] = {}
        self.keys: dict[int, tuple[Any, list[str], list[str]]] = {}
        self.dims = [d for d in range(len(mesh.shape)) if mesh.shape[d] > 1]

    def key(self, i: int) -> tuple[Any, list[str], list[str]]:
        got = self.keys.get(i)
        if got is None:
            got = self.keys[i] = self._key(i)
        return got

    def _key(self, i: int) -> tuple[Any, list[str], list[str]]:
        op = self.prog.ops[i]
        names = list(dict.fromkeys(op.input_names()))
        onames = list(dict.fromkeys(op.output_names()))
        slot = {n: k for k, n in enumerate(names)}
        oslot = {n: k for k, n in enumerate(onames)}
        t = self.prog.tensors
        k = (op.rule, repr(sorted(op.attrs.items())), tuple((p, _enc(v, slot)) for p, v in op.inputs.items()),
             tuple(_enc(v, oslot) for v in op.outputs), tuple((t[n].shape, t[n].dtype) for n in names),
             tuple((t[n].shape, t[n].dtype, t[n].inplace_of in slot) for n in onames))
        return k, names, onames

    def _answer(self, i: int, res: Any, names: list[str], onames: list[str]) -> _SlotCand:
        op = self.prog.ops[i]
        rule = get_rule(op.rule)
        tparams = [p.name for p in rule.forward.params if p.is_tensor]
        slot = {n: k for k, n in enumerate(names)}
        oslot = {n: k for k, n in enumerate(onames)}
        req: dict[int, TensorDistAttr] = {}
        for p, r in zip(tparams, res.inputs):
            v = op.inputs.get(p)
            if v is None:
                continue
            for rn, a in zip(flat_refs(v), _flat_attrs(r)):
                if rn is not None and a is not None:
                    req[slot[rn]] = a
        outs: dict[int, TensorDistAttr] = {}
        for v, a in zip(op.outputs, res.outputs):
            for on, x in zip(flat_refs(v), _flat_attrs(a)):
                if on is not None and x is not None:
                    outs[oslot[on]] = x
        t = 0.0
        if self.device is not None:
            from spmdkit.cost.compute import op_cost

            shim = _OneOp(self.prog, i, dict(zip(tparams, res.inputs)), list(res.outputs))
            t = op_cost(shim, i).time_s(self.device)
        t += self._kernel(i, dict(zip(tparams, res.inputs)))
        return tuple(sorted(req.items())), tuple(sorted(outs.items())), t, res

    def _kernel(self, i: int, required: dict[str, Any]) -> float:
        """The collectives the op's kernel runs itself (c_softmax_with_cross_entropy)."""
        from spmdkit.cost.compute import _CLASS_AXIS_ALLREDUCES, kernel_collectives

        op = self.prog.ops[i]
        if op.rule not in _CLASS_AXIS_ALLREDUCES:
            return 0.0
        shim = SimpleNamespace(program=SimpleNamespace(ops=[op], tensors=self.prog.tensors),
                               ops=[SimpleNamespace(required=required)], mesh=self.mesh, cost=self.cost)
        return sum(k.time_s for k in kernel_collectives(shim))

    def _seeds(self, names: list[str]) -> list[dict[str, tuple[list[Any], list[int]]]]:
        t = self.prog.tensors
        floats = [n for n in names if t[n].dtype in _FLOAT]
        per_dim: list[list[Any]] = []
        for _d in self.dims:
            ch: list[Any] = [None]
            if floats:
                ch.append(("p", None))
                if len(floats) > 1:
                    ch.extend(("p", n) for n in floats)
            ch.extend(("t", n, a) for n in names for a in range(len(t[n].shape)))
            if len(names) > 1:  # axis a of every input that has one (a shape-only argument follows)
                ch.extend(("a", a) for a in range(max(len(t[n].shape) for n in names)))
            per_dim.append(ch)
        out = []
        for combo in itertools.islice(itertools.product(*per_dim), MAX_SEEDS):
            seed: dict[str, tuple[list[Any], list[int]]] = {}
            for d, c in zip(self.dims, combo):
                if c is None:
                    continue
                if c[0] == "p":
                    for n in ([c[1]] if c[1] is not None else floats):
                        seed.setdefault(n, ([[] for _ in t[n].shape], []))[1].append(d)
                elif c[0] == "a":
                    for n in names:
                        if c[1] < len(t[n].shape):
                            seed.setdefault(n, ([[] for _ in t[n].shape], []))[0][c[1]].append(d)
                else:
                    _, n, a = c
                    seed.setdefault(n, ([[] for _ in t[n].shape], []))[0][a].append(d)
            out.append(seed)
        return out

    def candidates(self, i: int) -> list[Cand]:
        k, names, onames = self.key(i)
        got = self.cache.get(k)
        if got is None:
            got = self.cache[k] = self._generate(i, names, onames)
        return [({names[s]: a for s, a in req}, {onames[s]: a for s, a in outs}, t, res) for req, outs, t, res in got]

    def _generate(self, i: int, names: list[str], onames: list[str]) -> list[_SlotCand]:
        op = self.prog.ops[i]
        rule = get_rule(op.rule)
        layout = op_layout(op, "forward")
        mesh = self.mesh
        out: list[_SlotCand] = []
        seen: set[Any] = set()
        for seed in self._seeds(names):
            def get(n: str, seed: dict[str, tuple[list[Any], list[int]]] = seed) -> DistTensorSpec:
                shape = self.prog.tensors[n].shape
                s = seed.get(n)
                if s is None:
                    return DistTensorSpec(shape, TensorDistAttr.replicated(mesh, len(shape)))
                dm = [e[0] if len(e) == 1 else (tuple(e) if e else -1) for e in s[0]]
                return DistTensorSpec(shape, TensorDistAttr(mesh, dm, s[1] or None))
            try:
                res = rule.infer_forward(*layout_args(layout, get))
            except SpmdError:
                continue
            ans = self._answer(i, res, names, onames)
            key = (ans[0], ans[1])
            if key in seen:
                continue
            seen.add(key)
            out.append(ans)
        if not out:
            raise ProgramError(f"auto: op {i} ({op.name or op.rule}): its rule answers no candidate sharding")
        if self.limit is not None and len(out) > self.limit:
            keep = sorted(range(len(out)), key=lambda k: (out[k][2], k))[:self.limit]
            out = [out[k] for k in sorted(keep)]
        return out

    def follow(self, i: int, attr: TensorDistAttr) -> Cand | None:
        """Op ``i`` (one input tensor) run on that input held as ``attr``."""
        k, names, onames = self.key(i)
        dk = (k, attr)
        if dk not in self.derived:
            op = self.prog.ops[i]
            shape = self.prog.tensors[names[0]].shape
            try:
                res = get_rule(op.rule).infer_forward(*layout_args(op_layout(op, "forward"),
                                                                   lambda n: DistTensorSpec(shape, attr)))
                self.derived[dk] = self._answer(i, res, names, onames)
            except SpmdError:
                self.derived[dk] = None
        got = self.derived[dk]
        if got is None:
            return None
        req, outs, t, res = got
        return {names[s]: a for s, a in req}, {onames[s]: a for s, a in outs}, t, res


def _direct(prog: Program, mesh: ProcessMesh, cost: CostModel, chosen: list[Any],
            sources: dict[str, TensorDistAttr], fixed: dict[str, TensorDistAttr],
            kept: list[dict[str, TensorDistAttr]] | None = None) -> Plan:
    """The plan of exactly the chosen candidates (no propagation): each op runs as its
    candidate says, its inputs resharded from how they are held; an output its candidate
    holds otherwise than the rule makes it (``kept``: a partial output reduced once for all its
    readers) is resharded right after the op."""
    from spmdkit.program.plan import OpPlan, Reshard

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
        opp = OpPlan(i, op, {}, {}, [])
        for p, req in zip(tparams, res.inputs):
            v = op.inputs.get(p)
            if v is None:
                continue
            refs = flat_refs(v)
            opp.given[p] = tuple(None if n is None else made[n] for n in refs) if isinstance(v, tuple) else made[v]
            opp.required[p] = req
            for rn, r in zip(refs, _flat_attrs(req)):
                if rn is not None and r is not None and made[rn] != r:
                    opp.reshards.append(reshard(rn, made[rn], r, i, False))
        for v, a in zip(op.outputs, res.outputs):
            opp.outputs.append(a)
            for on, o in zip(flat_refs(v), _flat_attrs(a)):
                if on is None or o is None:
                    continue
                over = prog.tensors[on].inplace_of
                target = fixed.get(on) or (made[over] if over is not None and over in op.input_names() else None) \
                    or (kept[i].get(on) if kept is not None else None)
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


_LAYER_NO = re.compile(r"(^|\.)(\d+)\.")


def _group_of(op: Any) -> int | None:
    """The layer number of an op: the first ``.N.`` in its outputs' names, else its inputs'."""
    for n in (*op.output_names(), *op.input_names()):
        m = _LAYER_NO.search(n)
        if m:
            return int(m.group(2))
    return None


def _canon(n: str, g: int) -> str:
    """A tensor name with its layer number made relative to group ``g``."""
    return _LAYER_NO.sub(lambda m: f"{m.group(1)}#{int(m.group(2)) - g}.", n, count=1)


def _label(prog: Program, ops: list[int]) -> str:
    op = prog.ops[ops[0]]
    g = _group_of(op)
    if g is not None:
        return f"layer {g}"
    return op.layer or op.phase


_DESCRIBED = ("matmul", "embedding", "c_embedding", "flash_attention")


def _layout_key(prog: Program, i: int, cand: Cand) -> tuple[Any, Any]:
    """What ``--explain`` shows of an op's candidate: its weight's and its output's dist attrs."""
    op = prog.ops[i]
    w = next((n for n in op.input_names() if prog.tensors[n].kind == "parameter"), None)
    return (cand[0].get(w) if w else None), cand[1].get(op.output_names()[0])


def _describe(prog: Program, ops: list[int], cands: list[list[Cand]], pick: Callable[[int], int]) -> str:
    """A short account of a layer's choice: how its matmuls' weights and outputs are laid out."""
    parts: list[str] = []
    for i in ops:
        op = prog.ops[i]
        if op.phase != "forward" or op.rule not in _DESCRIBED:
            continue
        req, outs, _t, _r = cands[i][pick(i)]
        w = next((n for n in op.input_names() if prog.tensors[n].kind == "parameter"), None)
        o = op.output_names()[0]

        def dm(a: TensorDistAttr | None) -> str:
            if a is None:
                return "?"
            s = "[" + ",".join(str(e) if not isinstance(e, tuple) else "(" + ",".join(map(str, e)) + ")"
                               for e in a.dims_mapping) + "]"
            return s + ("p" + "".join(str(d) for d, _ in a.partial) if a.partial else "")
        short = (w or o).rsplit(".", 1)[-1]
        parts.append(f"{short}:{dm(req.get(w)) if w else ''}->{dm(outs.get(o))}")
    return " ".join(parts[:8]) + (" ..." if len(parts) > 8 else "")


#: The weight of the gradient reductions before the optimizer (data-parallel synchronisation) in
#: the objective when a device is given: its step (compute.estimate_step) runs them in DDP
#: buckets beside the backward, so most of their time is hidden; 0.3 is the exposed share
#: assumed. Measured on llama-7b and gpt2-small (2 layers, h100, dp=2 x tp=4 and dp=8 x tp=8),
#: the overlapped step of the plan found with 0.3 was at most that with 1 (the serial objective)
#: and with 0 everywhere, up to 42% shorter (docs/graph.md).
GRAD_SYNC_WEIGHT = 0.3


def auto_plan(prog: Program, mesh: ProcessMesh, pins: Mapping[str, Any] | None = None,
              cost: CostModel | None = None, time_limit: float = 30.0,
              max_candidates: int | None = None, device: Any = None, memory_cap: int | None = None,
              merge: bool = True, fold: bool = True, explain: bool = False,
              progress: Progress | None = None, grad_sync_weight: float | None = None) -> tuple[Plan, AutoInfo]:
    """A plan of ``prog`` on ``mesh`` whose shardings minimise the predicted communication
    time (plus each op's compute time from compute.op_cost on ``device``, a compute.Device,
    where one is given), ``pins`` (tensor -> dims_mapping or dist attr) held as hard
    constraints, per-device memory (parameters, gradients, optimizer states, activations kept
    for the backward) at most ``memory_cap`` bytes where given. ``cost``: the links (default
    the device's, else the planner's defaults). ``progress(phase, done, total)`` is called
    while candidates are made (phase "candidates") and the program is solved ("solve",
    "explain"). ``explain``: price, per layer, the best choice that differs there.
    ``grad_sync_weight``: the weight of a parameter gradient's reduction before its optimizer
    update in the objective (default :data:`GRAD_SYNC_WEIGHT` with a ``device``, whose step
    overlaps those reductions with the backward, else 1)."""
    if grad_sync_weight is None:
        grad_sync_weight = GRAD_SYNC_WEIGHT if device is not None else 1.0
    if not 0.0 <= grad_sync_weight <= 1.0:
        raise ProgramError(f"auto: grad_sync_weight {grad_sync_weight!r} is not between 0 and 1")
    try:
        import highspy
        import numpy as np
    except ImportError:
        raise ProgramError("auto: the search needs highspy (pip install 'spmdkit[auto]')") from None
    if memory_cap is not None and (not isinstance(memory_cap, int) or memory_cap <= 0):
        raise ProgramError(f"auto: memory_cap {memory_cap!r}: expected a positive number of bytes")
    if cost is None:
        if device is not None:
            from spmdkit.cost.compute import cost_model

            cost = cost_model(mesh, device)
        else:
            cost = CostModel.default(mesh)
    fixed = user_attrs(prog, mesh, pins)
    n_ops = len(prog.ops)
    tensors = prog.tensors

    def tick(phase: str, done: int, total: int) -> None:
        if progress is not None:
            progress(phase, done, total)

    producer: dict[str, int] = {}
    for i, op in enumerate(prog.ops):
        for n in op.output_names():
            producer.setdefault(n, i)

    # -- merging: an op of one input made by an earlier op follows its producer
    parent: dict[int, int] = {}
    if merge:
        for j, op in enumerate(prog.ops):
            names = list(dict.fromkeys(op.input_names()))
            if len(names) != 1 or names[0] in fixed or producer.get(names[0], j) >= j:
                continue
            outs = op.output_names()
            if not outs or any(n in fixed or tensors[n].inplace_of is not None for n in outs):
                continue
            parent[j] = producer[names[0]]

    # -- folding: identical layers tied to the first of them
    tie: dict[int, int] = {}
    folded_layers = 0
    groups_ops: dict[int | None, list[int]] = {}
    for i, op in enumerate(prog.ops):
        groups_ops.setdefault(_group_of(op), []).append(i)
    gen = _Gen(prog, mesh, cost, device, max_candidates)
    if fold:
        first: dict[Any, int] = {}
        for g, ix in groups_ops.items():
            if g is None:
                continue
            pos = {i: k for k, i in enumerate(ix)}
            sig = tuple((gen.key(i)[0], tuple(_canon(n, g) for n in prog.ops[i].input_names()),
                         tuple(_canon(n, g) for n in prog.ops[i].output_names()),
                         tuple(n in fixed for n in (*prog.ops[i].input_names(), *prog.ops[i].output_names())),
                         pos.get(parent[i], -1) - pos[i] if i in parent else None)
                        for i in ix)
            if sig in first:
                rep = groups_ops[first[sig]]
                for a, b in zip(ix, rep):
                    tie[a] = b
                folded_layers += 1
            else:
                first[sig] = g

    priced: dict[Any, float] = {}

    def price(n: str, src: TensorDistAttr, dst: TensorDistAttr) -> float:
        if src == dst:
            return 0.0
        t = tensors[n]
        key = (src, dst, t.shape, t.itemsize)
        p = priced.get(key)
        if p is None:
            p = priced[key] = plan_reshard(src, dst, t.shape, t.itemsize, cost).time_s
        return p

    readers: dict[str, int] = {}
    for op in prog.ops:
        for n in set(op.input_names()):
            readers[n] = readers.get(n, 0) + 1

    def reduced_variants(i: int, cs: list[Cand]) -> list[Cand]:
        """A partial output read by several ops may be reduced once, right after its op, for
        all of them (as propagate does): per candidate with such outputs, the variants holding
        them reduced (replicated, or scattered on a free axis: a reduce-scatter), the op paying
        the reduction once."""
        multi = [n for n in prog.ops[i].output_names() if readers.get(n, 0) >= 2 and n not in fixed
                 and tensors[n].inplace_of is None]
        if not multi:
            return cs
        out = list(cs)
        seen = {(tuple(sorted(c[0].items())), tuple(sorted(c[1].items()))) for c in cs}
        for c in cs:
            part = [n for n in multi if n in c[1] and c[1][n].partial]
            if not part:
                continue
            nd = max(len(tensors[n].shape) for n in part)
            for axis in (None, *range(nd)):
                outs = dict(c[1])
                extra = 0.0
                for n in part:
                    a = c[1][n]
                    dm = list(a.dims_mapping)
                    if axis is not None:
                        if len(a.partial) != 1 or axis >= len(dm) or dm[axis] != -1:
                            continue
                        dm[axis] = a.partial[0][0]
                    b = TensorDistAttr(mesh, dm)
                    outs[n] = b
                    extra += price(n, a, b)
                if outs == c[1]:
                    continue
                key = (tuple(sorted(c[0].items())), tuple(sorted(outs.items())))
                if key not in seen:
                    seen.add(key)
                    out.append((c[0], outs, c[2] + extra, c[3]))
        return out

    # -- candidates
    t_c = time.perf_counter()
    cands: list[list[Cand]] = []
    for i in range(n_ops):
        if i in parent:
            got: list[Cand] = []
            pi = parent[i]
            src = next(iter(dict.fromkeys(prog.ops[i].input_names())))
            for c in cands[pi]:
                made = c[1].get(src) or TensorDistAttr.replicated(mesh, len(tensors[src].shape))
                f = gen.follow(i, made)
                if f is None:  # the rule refuses its input as that candidate makes it: no merge
                    break
                got.append(f)
            else:
                cands.append(got)
                if i % 64 == 0:
                    tick("candidates", i, n_ops)
                continue
            del parent[i]
        cands.append(reduced_variants(i, gen.candidates(i)))
        if i % 64 == 0:
            tick("candidates", i, n_ops)
    tick("candidates", n_ops, n_ops)
    candidates_s = time.perf_counter() - t_c
    # a tie holds only where both ops are merged alike (a merge may have been undone above)
    for a, b in list(tie.items()):
        if (a in parent) != (b in parent) or len(cands[a]) != len(cands[b]):
            tie.pop(a)

    # -- variables
    costs: list[float] = []
    integer: list[int] = []
    rows: list[tuple[float, float, list[int], list[float]]] = []

    def new_vars(k: int, is_int: bool) -> list[int]:
        start = len(costs)
        costs.extend([0.0] * k)
        if is_int:
            integer.extend(range(start, start + k))
        return list(range(start, start + k))

    x: list[list[int]] = [[] for _ in range(n_ops)]
    for i in range(n_ops):
        if i not in parent and i not in tie:
            x[i] = new_vars(len(cands[i]), True)
            rows.append((1.0, 1.0, x[i], [1.0] * len(x[i])))
    for i in range(n_ops):
        if i in parent:
            x[i] = x[parent[i]]
        elif i in tie:
            x[i] = x[tie[i]]
    for i in range(n_ops):
        for k, c in enumerate(cands[i]):
            costs[x[i][k]] += c[2]

    # pinned outputs: their producer's candidate pays the reshard to the pin
    for n, pin in fixed.items():
        if n in producer:
            i = producer[n]
            for k, cand in enumerate(cands[i]):
                if n in cand[1]:
                    costs[x[i][k]] += price(n, cand[1][n], pin)
    # free sources: one choice among the attrs their readers ask for (tied with a tied reader's)
    src_choice: dict[str, tuple[list[TensorDistAttr], list[int]]] = {}
    src_tie: dict[str, str] = {}
    for i in range(n_ops):
        if i in tie:
            for na, nb_ in zip(prog.ops[i].input_names(), prog.ops[tie[i]].input_names()):
                if na not in fixed and not (na in producer and producer[na] < i) and na != nb_:
                    src_tie.setdefault(na, nb_)
    asked: dict[str, dict[TensorDistAttr, None]] = {}  # source -> the attrs its readers ask for
    for i, op in enumerate(prog.ops):
        srcs = [n for n in dict.fromkeys(op.input_names()) if not (n in producer and producer[n] < i)
                and n not in fixed]
        for n in srcs:
            d = asked.setdefault(n, {})
            for req, _, _, _ in cands[i]:
                if n in req and not req[n].partial:
                    d[req[n]] = None

    def source_attrs(n: str) -> list[TensorDistAttr]:
        return list(asked.get(n, ())) or [TensorDistAttr.replicated(mesh, len(tensors[n].shape))]

    for i, op in enumerate(prog.ops):
        for n in dict.fromkeys(op.input_names()):
            if (n in producer and producer[n] < i) or n in fixed or n in src_choice or n in src_tie:
                continue
            attrs = source_attrs(n)
            vs = new_vars(len(attrs), True)
            rows.append((1.0, 1.0, vs, [1.0] * len(vs)))
            src_choice[n] = (attrs, vs)
    for n, rn in list(src_tie.items()):
        while rn in src_tie:
            rn = src_tie[rn]
        if rn in src_choice:
            src_choice[n] = src_choice[rn]
        else:  # the representative is not a free source after all: its own choice
            attrs = source_attrs(n)
            vs = new_vars(len(attrs), True)
            rows.append((1.0, 1.0, vs, [1.0] * len(vs)))
            src_choice[n] = (attrs, vs)

    Side = list[tuple[TensorDistAttr, list[int]]]

    def held(n: str, reader: int) -> Side:
        """How ``n`` may be held for ``reader``: (attr, the 0/1 variables whose sum says so)."""
        if n in fixed:
            return [(fixed[n], [])]
        if n in producer and producer[n] < reader:
            return side(producer[n], n, 1)
        attrs, vs = src_choice[n]
        return [(a, [v]) for a, v in zip(attrs, vs)]

    def side(j: int, n: str, s: int) -> Side:
        g: dict[TensorDistAttr, list[int]] = {}
        for k, cand in enumerate(cands[j]):
            got_a = (cand[0] if s == 0 else cand[1]).get(n) or TensorDistAttr.replicated(mesh, len(tensors[n].shape))
            g.setdefault(got_a, []).append(x[j][k])
        return list(g.items())

    const = 0.0
    shared: dict[Any, list[list[float]]] = {}  # (src var groups, dst var groups) -> summed prices

    def edge(n: str, src: Side, dst: Side, w: float) -> None:
        """The reshard of ``n`` from how it is held (one of ``src``) to how it is wanted (one of
        ``dst``), ``w`` times (identical layers); each side: (attr, the 0/1 variables whose sum
        says it is that attr)."""
        nonlocal const
        if len(src) == 1 and len(dst) == 1:  # both certain
            const += w * price(n, src[0][0], dst[0][0])
            return
        if len(dst) == 1:  # the wanted attr is certain: the cost falls on the held groups
            for a, vs in src:
                p = w * price(n, a, dst[0][0])
                for v in vs:
                    costs[v] += p
            return
        if len(src) == 1:
            for b, ys in dst:
                p = w * price(n, src[0][0], b)
                for y in ys:
                    costs[y] += p
            return
        sa = {v: a for a, vs in src for v in vs}
        da = {v: b for b, ys in dst for v in ys}
        if sa.keys() == da.keys():  # one choice decides both sides (merged or tied ops)
            for v, a in sa.items():
                costs[v] += w * price(n, a, da[v])
            return
        key = (tuple(tuple(vs) for _, vs in src), tuple(tuple(ys) for _, ys in dst))
        m = shared.get(key)
        if m is None:
            m = shared[key] = [[0.0] * len(dst) for _ in src]
        for ai, (a, _) in enumerate(src):
            for bi, (b, _) in enumerate(dst):
                m[ai][bi] += w * price(n, a, b)

    # an op tied to another whose every read is held by the same variables (or pin) as the
    # other's is priced once, times the number of such copies
    weight = [1] * n_ops

    def holder(n: str, reader: int) -> Any:
        if n in fixed:
            return ("pin", fixed[n])
        if n in producer and producer[n] < reader:
            return ("op", id(x[producer[n]]))
        return ("src", id(src_choice[n][1]))

    for j, r in tie.items():
        a_reads = prog.ops[j].input_names()
        b_reads = prog.ops[r].input_names()
        if len(a_reads) == len(b_reads) and all(holder(a, j) == holder(b, r) for a, b in zip(a_reads, b_reads)):
            weight[r] += 1
            weight[j] = 0

    for j, op in enumerate(prog.ops):
        w = weight[j]
        if not w:
            continue
        reads = list(dict.fromkeys(op.input_names()))
        for n in reads:
            # a gradient's reduction before its update overlaps the backward (the step's buckets)
            gw = grad_sync_weight if (op.phase == "optimizer" and tensors[n].kind == "gradient") else 1.0
            edge(n, held(n, j), side(j, n, 0), w * gw)
        for n in op.output_names():  # an in-place output: back to how the tensor it overwrites is held
            over = tensors[n].inplace_of
            if over is not None and over in reads and n not in fixed:
                edge(n, side(j, n, 1), held(over, j), w)
    e_vars: dict[Any, dict[tuple[int, int], int]] = {}
    for (sg, dg), m in shared.items():
        e = e_vars[sg, dg] = {}
        for ai in range(len(sg)):
            for bi in range(len(dg)):
                e[ai, bi] = new_vars(1, False)[0]
                costs[e[ai, bi]] = m[ai][bi]
        for ai, vs in enumerate(sg):  # sum_b e_ab = [held as a]
            rows.append((0.0, 0.0, [e[ai, bi] for bi in range(len(dg))] + list(vs),
                         [1.0] * len(dg) + [-1.0] * len(vs)))
        for bi, ys in enumerate(dg):  # sum_a e_ab = [required as b]
            rows.append((0.0, 0.0, [e[ai, bi] for ai in range(len(sg))] + list(ys),
                         [1.0] * len(sg) + [-1.0] * len(ys)))

    # -- memory: what is held for the step (parameters, their gradients, optimizer states) and
    # the activations the backward keeps, local bytes per device, linear in the choices
    from spmdkit.cost.memory import local_numel, value_reads

    def size_terms(n: str, coef: dict[int, float]) -> float:
        """Add ``n``'s local bytes to ``coef`` (per variable); returns the certain part."""
        t = tensors[n]
        if n in fixed:
            return float(local_numel(fixed[n], t.shape) * t.itemsize)
        if n in producer:
            for a, vs in side(producer[n], n, 1):
                b = local_numel(a, t.shape) * t.itemsize
                for v in vs:
                    coef[v] = coef.get(v, 0.0) + b
            return 0.0
        if n in src_choice:
            for a, v in zip(*src_choice[n]):
                coef[v] = coef.get(v, 0.0) + local_numel(a, t.shape) * t.itemsize
            return 0.0
        return float(t.nbytes)

    param_grads = prog.param_grads()
    held_all = [n for n, t in tensors.items() if t.kind in ("parameter", "optimizer_state") and not t.inplace_of]
    held_all += sorted(param_grads)
    base_coef: dict[int, float] = {}
    base_const = sum(size_terms(n, base_coef) for n in held_all)
    mem_coef = dict(base_coef)
    mem_const = base_const + sum(size_terms(n, mem_coef) for n in sorted(value_reads(prog)))
    first_op, last_op = prog.live_spans()
    transient = [n for n in first_op if n not in param_grads and not tensors[n].inplace_of
                 and tensors[n].kind not in ("parameter", "optimizer_state")]

    def live_row(at: int) -> tuple[dict[int, float], float]:
        """Memory at op ``at`` (memory.py's spans, reshards' copies left out): what is held for
        the step and the activations made before ``at`` and read at or after it."""
        coef = dict(base_coef)
        c = base_const + sum(size_terms(n, coef) for n in transient if first_op[n] <= at <= last_op[n])
        for n in dict.fromkeys(prog.ops[at].input_names()):  # the copies op ``at`` reads
            src, dst = held(n, at), side(at, n, 0)
            def nb(b: TensorDistAttr, t: Any = tensors[n]) -> float:
                return float(local_numel(b, t.shape) * t.itemsize)
            if len(dst) == 1 or len(src) == 1:
                for a, vs in src:
                    for b, ys in dst:
                        if a != b:
                            if not vs and not ys:
                                c += nb(b)
                            for v in (vs if len(dst) == 1 else ys):
                                coef[v] = coef.get(v, 0.0) + nb(b)
                continue
            sa = {v: a for a, vs in src for v in vs}
            da = {v: b for b, ys in dst for v in ys}
            if sa.keys() == da.keys():
                for v, a in sa.items():
                    if a != da[v]:
                        coef[v] = coef.get(v, 0.0) + nb(da[v])
                continue
            e = e_vars.get((tuple(tuple(vs) for _, vs in src), tuple(tuple(ys) for _, ys in dst)), {})
            for (ai, bi), v in e.items():
                if src[ai][0] != dst[bi][0]:
                    coef[v] = coef.get(v, 0.0) + nb(dst[bi][0])
        return coef, c

    # -- the program, to HiGHS
    nvar = len(costs)
    h = _quiet_highs(highspy)
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("threads", 1)
    zeros = np.zeros(nvar)
    h.addCols(nvar, np.array(costs, dtype=np.float64) * _SCALE, zeros, np.ones(nvar), 0, np.zeros(0, dtype=np.int32),
              np.zeros(0, dtype=np.int32), np.zeros(0))
    h.changeColsIntegrality(len(integer), np.array(integer, dtype=np.int32),
                            np.array([highspy.HighsVarType.kInteger] * len(integer)))
    starts: list[int] = []
    idx: list[int] = []
    vals: list[float] = []
    for _lo, _hi, ix, vx in rows:
        starts.append(len(idx))
        idx.extend(ix)
        vals.extend(vx)
    h.addRows(len(rows), np.array([r[0] for r in rows], dtype=np.float64), np.array([r[1] for r in rows], dtype=np.float64),
              len(idx), np.array(starts, dtype=np.int32), np.array(idx, dtype=np.int32), np.array(vals, dtype=np.float64))
    h.changeObjectiveSense(highspy.ObjSense.kMinimize)
    mem_ix = sorted(mem_coef)
    mem_w = np.array([mem_coef[v] for v in mem_ix])
    base = np.array(costs, dtype=np.float64)
    deadline = time.perf_counter() + float(time_limit)

    def solve() -> tuple[str, list[float] | None]:
        h.setOptionValue("time_limit", max(1.0, deadline - time.perf_counter()))
        h.run()
        status = h.modelStatusToString(h.getModelStatus())
        sol = list(h.getSolution().col_value)
        if len(sol) != nvar or (status in ("Infeasible", "Time limit reached")
                                and h.getInfo().primal_solution_status < 2):
            return status, None
        return status, sol

    if memory_cap is not None:
        # a bound no choice goes below: the certain part and the least of each one-hot choice
        least = mem_const + sum(min(mem_coef.get(v, 0.0) for v in x[i]) for i in range(n_ops)
                                if i not in parent and i not in tie and x[i])
        least += sum(min(mem_coef.get(v, 0.0) for v in vs) for n, (_a, vs) in src_choice.items()
                     if src_tie.get(n) is None)
        if least > memory_cap:
            raise ProgramError(f"auto: --memory {_size(memory_cap)}: no plan fits in it per device: every choice "
                               f"holds at least {_size(least)} (parameters, gradients, optimizer states and the "
                               "activations kept for the backward)")
    tick("solve", 0, 1)
    t0 = time.perf_counter()
    status, sol = solve()
    if sol is None:
        raise ProgramError(f"auto: HiGHS found no solution ({status}) within {time_limit} s")
    info = h.getInfo()
    objective = float(info.objective_function_value) / _SCALE + const
    gap = float(info.mip_gap)

    def pick_of(s: list[float]) -> Callable[[int], int]:
        return lambda i: max(range(len(x[i])), key=lambda k: s[x[i][k]])

    def realise(s: list[float]) -> tuple[Plan, str]:
        pick = pick_of(s)
        ann: dict[str, TensorDistAttr] = {}
        for n, (attrs, vs) in src_choice.items():
            ann[n] = attrs[max(range(len(vs)), key=lambda k: s[vs[k]])]
        for i in range(n_ops):
            for n, a in cands[i][pick(i)][1].items():
                if producer.get(n) == i and tensors[n].inplace_of is None and not a.partial:
                    ann[n] = a
        ann.update(fixed)
        chosen = [cands[i][pick(i)][3] for i in range(n_ops)]
        plans = {"direct": _direct(prog, mesh, cost, chosen, {n: ann[n] for n in src_choice}, fixed,
                                   [cands[i][pick(i)][1] for i in range(n_ops)]),
                 "propagate": propagate(prog, mesh, ann, cost)}

        def total(p: Plan) -> float:
            if device is None:
                return p.time_s
            from spmdkit.cost.compute import op_cost

            return p.time_s + sum(op_cost(p, i).time_s(device) for i in range(len(p.ops)))

        if memory_cap is not None:
            from spmdkit.cost.memory import memory_per_device

            need = {k: memory_per_device(p).total for k, p in plans.items()}
            fits = [k for k in plans if need[k] <= memory_cap]
            if not fits:  # neither fits: the smaller
                return plans[min(need, key=lambda k: need[k])], min(need, key=lambda k: need[k])
            plans = {k: plans[k] for k in fits}
        best = min(plans, key=lambda k: total(plans[k]))
        return plans[best], best

    plan, realized = realise(sol)
    rounds = 0
    if memory_cap is not None:
        from spmdkit.cost.memory import memory_per_device

        def mem_of(x_: list[float]) -> float:
            return mem_const + float(sum(w * x_[v] for v, w in zip(mem_ix, mem_w)))

        def time_of(x_: list[float]) -> float:
            return const + float(np.dot(base, np.array(x_)))

        if memory_per_device(plan).total > memory_cap:
            # Lagrangian relaxation of the memory row: minimise time + lam * memory, lam raised
            # until the realised plan fits, then bisected; max over lam of the penalised optimum
            # less lam * (cap - memory) bounds the capped optimum from below (the gap)
            best: tuple[float, list[float], Plan, str, str] | None = None
            bound = objective
            var_mem = max(mem_of(sol) - mem_const, 1.0)
            lam, lo, hi = max(objective, 1e-12) / var_mem, 0.0, math.inf
            # the penalised memory: the rows of the kept activations and of every position
            # where a realised plan peaked so far (each at most the cap: the bound stays valid)
            pen_rows: list[tuple[np.ndarray, np.ndarray, float]] = [(np.array(mem_ix, dtype=np.int64), mem_w, mem_const)]
            peaks: set[int] = set()

            def add_peak(at: int) -> None:
                if at not in peaks:
                    peaks.add(at)
                    coef, c = live_row(at)
                    ix = sorted(coef)
                    pen_rows.append((np.array(ix, dtype=np.int64), np.array([coef[v] for v in ix]), c))

            add_peak(memory_per_device(plan).peak_op)
            h.setOptionValue("mip_rel_gap", PENALISED_GAP)  # the rounds are a heuristic: near-optimal is enough
            while rounds < MEMORY_ROUNDS and time.perf_counter() < deadline:
                rounds += 1
                pen = base.copy()
                for ix_, w_, _c in pen_rows:
                    np.add.at(pen, ix_, lam * w_)
                h.changeColsCost(nvar, np.arange(nvar, dtype=np.int32), pen * _SCALE)
                st, xs = solve()
                if xs is None:
                    break
                hinfo = h.getInfo()
                dual = float(hinfo.mip_dual_bound) / _SCALE if st != "Optimal" else \
                    float(hinfo.objective_function_value) / _SCALE
                bound = max(bound, dual + const - lam * sum(memory_cap - c_ for _i, _w, c_ in pen_rows))
                p_, r_ = realise(xs)
                got_mem = memory_per_device(p_)
                add_peak(got_mem.peak_op)
                if got_mem.total <= memory_cap:
                    hi = lam
                    if best is None or time_of(xs) < best[0]:
                        best = (time_of(xs), xs, p_, r_, st)
                else:
                    lo = lam
                if hi == math.inf:
                    lam *= 8.0
                elif hi / max(lo, 1e-300) < BISECT_RATIO:
                    break
                else:
                    lam = math.sqrt(lo * hi) if lo > 0 else hi / 8.0
            h.changeColsCost(nvar, np.arange(nvar, dtype=np.int32), base * _SCALE)
            h.setOptionValue("mip_rel_gap", 1e-4)
            if best is None:
                raise ProgramError(_min_memory_message(h, highspy, np, nvar, mem_ix, mem_coef, mem_const, memory_cap,
                                                       realise, memory_per_device))
            objective, sol, plan, realized, status = best
            gap = max(0.0, (objective - bound) / objective) if objective > 0 else 0.0
            status = f"{status}, memory-capped ({rounds} rounds)"
    solve_s = time.perf_counter() - t0
    mem_bytes = round(mem_const + sum(mem_coef[v] * sol[v] for v in mem_ix))
    result = AutoInfo(objective_s=objective, gap=gap, solve_s=solve_s, status=status,
                      candidates=sum(len(c) for i, c in enumerate(cands) if i not in parent and i not in tie),
                      variables=nvar, realized=realized, merged=bool(parent), folded=bool(folded_layers),
                      merged_ops=len(parent), folded_layers=folded_layers, candidates_s=candidates_s,
                      memory_cap=memory_cap, memory_bytes=mem_bytes)
    tick("solve", 1, 1)
    if explain:
        result.explain = _explain(prog, h, highspy, np, groups_ops, tie, parent, x, cands, sol, objective, const,
                                  tick, float(time_limit))
    return plan, result


def _min_memory_message(h: Any, highspy: Any, np: Any, nvar: int, mem_ix: list[int], mem_coef: dict[int, float],
                        mem_const: float, cap: int, realise: Any, memory_per_device: Any) -> str:
    """The ProgramError text for a cap no plan found meets: the least memory the candidates
    allow (as the integer program counts it, and as the realised plan needs it)."""
    h.changeColsCost(nvar, np.arange(nvar, dtype=np.int32), np.zeros(nvar))
    h.changeColsCost(len(mem_ix), np.array(mem_ix, dtype=np.int32), np.array([mem_coef[v] for v in mem_ix]) / 2**20)
    h.run()
    sol = list(h.getSolution().col_value)
    least = ""
    if len(sol) == nvar:
        need = memory_per_device(realise(sol)[0]).total
        least = (f"; the smallest the search found needs {_size(need)} (parameters, gradients, optimizer states and "
                 f"the activation peak; {_size(mem_const + sum(mem_coef[v] * sol[v] for v in mem_ix))} without "
                 "transient activations)")
    return f"auto: --memory {_size(cap)}: no plan the search found fits in it per device{least}"


def _size(b: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= k:
            return f"{b / k:.2f} {unit}"
    return f"{int(b)} B"


def _explain(prog: Program, h: Any, highspy: Any, np: Any, groups_ops: dict[int | None, list[int]],
             tie: dict[int, int], parent: dict[int, int], x: list[list[int]], cands: list[list[Cand]],
             sol: list[float], objective: float, const: float, tick: Progress, limit: float) -> list[LayerChoice]:
    """Per layer group (tied layers once): the choice, and the best objective with that group's
    choice excluded (a no-good cut: not all of its chosen variables at 1)."""
    def pick(i: int) -> int:
        return max(range(len(x[i])), key=lambda k: sol[x[i][k]])
    out: list[LayerChoice] = []
    groups = [(g, ix) for g, ix in groups_ops.items() if not all(i in tie for i in ix)]
    h.setOptionValue("time_limit", max(2.0, limit / max(1, len(groups))))
    for done, (_g, ix) in enumerate(groups):
        tick("explain", done, len(groups))
        # the cut: not every described op (forward matmuls, embedding, attention) keeps its
        # layout (weight and output dist attrs); a layer without one: not every choice stays
        shown = [i for i in ix if i not in parent and i not in tie and prog.ops[i].phase == "forward"
                 and prog.ops[i].rule in _DESCRIBED]
        keep: list[list[int]] = []
        for i in shown:
            mine = _layout_key(prog, i, cands[i][pick(i)])
            same = [x[i][k] for k, c in enumerate(cands[i]) if _layout_key(prog, i, c) == mine]
            if len(same) < len(x[i]):
                keep.append(same)
        if not shown:
            keep = [[x[i][pick(i)]] for i in ix if i not in parent and i not in tie and len(x[i]) > 1]
        roots = sorted({v for vs in keep for v in vs})
        label = _label(prog, ix)
        n_tied = sum(1 for gg, jx in groups_ops.items() if jx and all(j in tie for j in jx)
                     and tie[jx[0]] == ix[0])
        if n_tied:
            label += f" (and {n_tied} identical)"
        chosen = _describe(prog, ix, cands, pick)
        if not roots:
            out.append(LayerChoice(label, len(ix), chosen, objective, None, "no other candidate"))
            continue
        row = h.getNumRow()
        h.addRow(-highspy.kHighsInf, float(len(keep) - 1), len(roots), np.array(roots, dtype=np.int32),
                 np.ones(len(roots)))
        h.run()
        status = h.modelStatusToString(h.getModelStatus())
        alt = h.getSolution().col_value
        if status in ("Optimal", "Time limit reached") and len(alt) == len(sol) and h.getInfo().primal_solution_status >= 2:
            other = float(h.getInfo().objective_function_value) / _SCALE + const
            def apick(i: int, alt: Any = alt) -> int:
                return max(range(len(x[i])), key=lambda kk: alt[x[i][kk]])
            what = _describe(prog, ix, cands, apick)
            shown_parts = set(chosen.split())
            diff = " ".join(p for p in what.split() if p not in shown_parts)
            out.append(LayerChoice(label, len(ix), chosen, objective, other, diff or "other ops differ"))
        else:
            out.append(LayerChoice(label, len(ix), chosen, objective, None, f"none found ({status})"))
        h.deleteRows(1, np.array([row], dtype=np.int32))
    tick("explain", len(groups), len(groups))
    return out


__all__ = ["GRAD_SYNC_WEIGHT", "MAX_SEEDS", "AutoInfo", "LayerChoice", "Progress", "auto_plan"]
