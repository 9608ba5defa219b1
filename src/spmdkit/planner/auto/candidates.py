"""The candidates of the exact search (:mod:`spmdkit.planner.auto`): per op the distinct answers
of its forward rule on seeds, the merged and folded ops, the variants holding a partial output
reduced once; :func:`make_space` gathers them for the integer program."""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel, plan_reshard
from spmdkit.core.spec import DistTensorSpec
from spmdkit.cost.compute import cost_of, local_op, op_kernel_collectives
from spmdkit.engine.registry import get_rule
from spmdkit.program.ir import Op, Program, flat_refs, layout_args, op_layout

#: the most seeds pushed through one op's rule (the product over the mesh dims of the choices
#: per dim; a 2-D mesh never reaches it)
MAX_SEEDS = 4096

#: ``progress(phase, done, total)``: phase "candidates", "solve" or "explain"
Progress = Callable[[str, int, int], None]
_FLOAT = ("float16", "bfloat16", "float32", "float64")


def flat_attrs(v: Any) -> list[Any]:
    return list(v) if isinstance(v, tuple) else [v]


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
            for rn, a in zip(flat_refs(v), flat_attrs(r)):
                if rn is not None and a is not None:
                    req[slot[rn]] = a
        outs: dict[int, TensorDistAttr] = {}
        for v, a in zip(op.outputs, res.outputs):
            for on, x in zip(flat_refs(v), flat_attrs(a)):
                if on is not None and x is not None:
                    outs[oslot[on]] = x
        t = 0.0
        required = dict(zip(tparams, res.inputs))
        if self.device is not None:
            t = self.device.op_time(cost_of(local_op(self.prog, i, required, list(res.outputs), {})))
        # the collectives the op's kernel runs itself (c_softmax_with_cross_entropy)
        t += sum(k.time_s for k in op_kernel_collectives(self.prog, i, required, self.mesh, self.cost))
        return tuple(sorted(req.items())), tuple(sorted(outs.items())), t, res

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


_LAYER_NO = re.compile(r"(^|\.)(\d+)\.")


def group_of(op: Op) -> int | None:
    """The layer number of an op: the first ``.N.`` in its outputs' names, else its inputs'."""
    for n in (*op.output_names(), *op.input_names()):
        m = _LAYER_NO.search(n)
        if m:
            return int(m.group(2))
    return None


def canon(n: str, g: int) -> str:
    """A tensor name with its layer number made relative to group ``g``."""
    return _LAYER_NO.sub(lambda m: f"{m.group(1)}#{int(m.group(2)) - g}.", n, count=1)


class Pricer:
    """The time of a tensor's reshard between two dist attrs (0 when they are equal), planned once."""

    def __init__(self, prog: Program, cost: CostModel) -> None:
        self.tensors = prog.tensors
        self.cost = cost
        self.priced: dict[Any, float] = {}

    def __call__(self, n: str, src: TensorDistAttr, dst: TensorDistAttr) -> float:
        if src == dst:
            return 0.0
        t = self.tensors[n]
        key = (src, dst, t.shape, t.itemsize)
        p = self.priced.get(key)
        if p is None:
            p = self.priced[key] = plan_reshard(src, dst, t.shape, t.itemsize, self.cost).time_s
        return p


@dataclass
class Space:
    """Every op's candidates and how the ops share choices: ``parent`` (an op merged into its
    producer's choice), ``tie`` (an op of a layer tied to the same op of an identical layer),
    ``groups_ops`` (the ops of each layer number, None for the ops of none)."""

    producer: dict[str, int]
    parent: dict[int, int]
    tie: dict[int, int]
    groups_ops: dict[int | None, list[int]]
    folded_layers: int
    cands: list[list[Cand]]
    candidates_s: float

    def chooses(self, i: int) -> bool:
        """True when op ``i`` has choice variables of its own (neither merged nor tied)."""
        return i not in self.parent and i not in self.tie


def make_space(prog: Program, fixed: Mapping[str, TensorDistAttr], gen: _Gen, price: Pricer, merge: bool,
               fold: bool, tick: Progress) -> Space:
    """The candidates of every op, merged (Alpa) and folded (identical layers) where asked."""
    producer: dict[str, int] = {}
    for i, op in enumerate(prog.ops):
        for n in op.output_names():
            producer.setdefault(n, i)
    parent = _merges(prog, fixed, producer) if merge else {}
    groups_ops: dict[int | None, list[int]] = {}
    for i, op in enumerate(prog.ops):
        groups_ops.setdefault(group_of(op), []).append(i)
    tie, folded_layers = _folds(prog, fixed, gen, parent, groups_ops) if fold else ({}, 0)
    t_c = time.perf_counter()
    cands = _all_candidates(prog, fixed, gen, price, parent, tick)
    candidates_s = time.perf_counter() - t_c
    # a tie holds only where both ops are merged alike (a merge may have been undone above)
    for a, b in list(tie.items()):
        if (a in parent) != (b in parent) or len(cands[a]) != len(cands[b]):
            tie.pop(a)
    return Space(producer, parent, tie, groups_ops, folded_layers, cands, candidates_s)


def _merges(prog: Program, fixed: Mapping[str, TensorDistAttr], producer: dict[str, int]) -> dict[int, int]:
    """Merging: an op of one input made by an earlier op follows its producer (op -> producer)."""
    tensors = prog.tensors
    parent: dict[int, int] = {}
    for j, op in enumerate(prog.ops):
        names = list(dict.fromkeys(op.input_names()))
        if len(names) != 1 or names[0] in fixed or producer.get(names[0], j) >= j:
            continue
        outs = op.output_names()
        if not outs or any(n in fixed or tensors[n].inplace_of is not None for n in outs):
            continue
        parent[j] = producer[names[0]]
    return parent


def _folds(prog: Program, fixed: Mapping[str, TensorDistAttr], gen: _Gen, parent: dict[int, int],
           groups_ops: dict[int | None, list[int]]) -> tuple[dict[int, int], int]:
    """Folding: identical layers tied to the first of them; (op -> the op it is tied to, the
    number of layers folded)."""
    tie: dict[int, int] = {}
    folded_layers = 0
    first: dict[Any, int] = {}
    for g, ix in groups_ops.items():
        if g is None:
            continue
        pos = {i: k for k, i in enumerate(ix)}
        sig = tuple((gen.key(i)[0], tuple(canon(n, g) for n in prog.ops[i].input_names()),
                     tuple(canon(n, g) for n in prog.ops[i].output_names()),
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
    return tie, folded_layers


def _all_candidates(prog: Program, fixed: Mapping[str, TensorDistAttr], gen: _Gen, price: Pricer,
                    parent: dict[int, int], tick: Progress) -> list[list[Cand]]:
    """Every op's candidates in program order; a merged op whose rule refuses its input as one
    of its producer's candidates makes it is unmerged (removed from ``parent``)."""
    mesh, tensors = gen.mesh, prog.tensors
    n_ops = len(prog.ops)
    readers: dict[str, int] = {}
    for op in prog.ops:
        for n in set(op.input_names()):
            readers[n] = readers.get(n, 0) + 1
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
        cands.append(_reduced_variants(prog, fixed, price, readers, mesh, i, gen.candidates(i)))
        if i % 64 == 0:
            tick("candidates", i, n_ops)
    tick("candidates", n_ops, n_ops)
    return cands


def _reduced_variants(prog: Program, fixed: Mapping[str, TensorDistAttr], price: Pricer, readers: dict[str, int],
                      mesh: ProcessMesh, i: int, cs: list[Cand]) -> list[Cand]:
    """A partial output read by several ops may be reduced once, right after its op, for
    all of them (as propagate does): per candidate with such outputs, the variants holding
    them reduced (replicated, or scattered on a free axis: a reduce-scatter), the op paying
    the reduction once."""
    tensors = prog.tensors
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


__all__ = ["MAX_SEEDS", "Cand", "Pricer", "Progress", "Space", "canon", "flat_attrs", "group_of", "make_space"]
