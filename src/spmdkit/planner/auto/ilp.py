"""The integer program of the exact search (:mod:`spmdkit.planner.auto`): one-hot choices per op
(merged and tied ops share their producer's or twin's) and per free source, the reshard edges
between them linearised as in Alpa, and per-device memory as rows linear in the choices."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.mesh import ProcessMesh
from spmdkit.cost.memory import local_numel
from spmdkit.cost.memory_saved import value_reads
from spmdkit.planner.auto.candidates import Pricer, Space
from spmdkit.program.ir import Program

#: How a tensor may be held on one side of an edge: (attr, the 0/1 variables whose sum says so)
Side = list[tuple[TensorDistAttr, list[int]]]
#: A row of the program: (lower bound, upper bound, variables, coefficients)
Row = tuple[float, float, list[int], list[float]]


class Problem:
    """The variables, costs and rows; ``x[i]``: op ``i``'s one-hot variables (one per candidate),
    ``src_choice[n]``: a free source's attrs and their variables, ``const``: the cost every choice
    pays; ``mem_coef`` / ``mem_const``: the memory held for the step and kept for the backward."""

    def __init__(self, prog: Program, mesh: ProcessMesh, fixed: Mapping[str, TensorDistAttr], space: Space,
                 price: Pricer, grad_sync_weight: float) -> None:
        self.prog, self.mesh, self.fixed, self.space, self.price = prog, mesh, fixed, space, price
        self.tensors = prog.tensors
        self.costs: list[float] = []
        self.integer: list[int] = []
        self.rows: list[Row] = []
        self.const = 0.0
        self.shared: dict[Any, list[list[float]]] = {}  # (src var groups, dst var groups) -> summed prices
        self.e_vars: dict[Any, dict[tuple[int, int], int]] = {}
        self._choices()
        self._pins()
        self._sources()
        self._edges(grad_sync_weight)
        self._linearise()
        self._memory()

    def new_vars(self, k: int, is_int: bool) -> list[int]:
        start = len(self.costs)
        self.costs.extend([0.0] * k)
        if is_int:
            self.integer.extend(range(start, start + k))
        return list(range(start, start + k))

    def _choices(self) -> None:
        sp = self.space
        n_ops = len(self.prog.ops)
        self.x: list[list[int]] = [[] for _ in range(n_ops)]
        x = self.x
        for i in range(n_ops):
            if sp.chooses(i):
                x[i] = self.new_vars(len(sp.cands[i]), True)
                self.rows.append((1.0, 1.0, x[i], [1.0] * len(x[i])))
        for i in range(n_ops):
            if i in sp.parent:
                x[i] = x[sp.parent[i]]
            elif i in sp.tie:
                x[i] = x[sp.tie[i]]
        for i in range(n_ops):
            for k, c in enumerate(sp.cands[i]):
                self.costs[x[i][k]] += c[2]

    def _pins(self) -> None:
        """Pinned outputs: their producer's candidate pays the reshard to the pin."""
        producer, cands = self.space.producer, self.space.cands
        for n, pin in self.fixed.items():
            if n in producer:
                i = producer[n]
                for k, cand in enumerate(cands[i]):
                    if n in cand[1]:
                        self.costs[self.x[i][k]] += self.price(n, cand[1][n], pin)

    def _sources(self) -> None:
        """Free sources: one choice among the attrs their readers ask for (tied with a tied reader's)."""
        prog, fixed, producer, cands, tie = self.prog, self.fixed, self.space.producer, self.space.cands, self.space.tie
        self.src_choice: dict[str, tuple[list[TensorDistAttr], list[int]]] = {}
        self.src_tie: dict[str, str] = {}
        src_choice, src_tie = self.src_choice, self.src_tie
        for i in range(len(prog.ops)):
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

        def own_choice(n: str) -> None:
            attrs = list(asked.get(n, ())) or [TensorDistAttr.replicated(self.mesh, len(self.tensors[n].shape))]
            vs = self.new_vars(len(attrs), True)
            self.rows.append((1.0, 1.0, vs, [1.0] * len(vs)))
            src_choice[n] = (attrs, vs)

        for i, op in enumerate(prog.ops):
            for n in dict.fromkeys(op.input_names()):
                if (n in producer and producer[n] < i) or n in fixed or n in src_choice or n in src_tie:
                    continue
                own_choice(n)
        for n, rn in list(src_tie.items()):
            while rn in src_tie:
                rn = src_tie[rn]
            if rn in src_choice:
                src_choice[n] = src_choice[rn]
            else:  # the representative is not a free source after all: its own choice
                own_choice(n)

    # -- how a tensor is held and wanted

    def held(self, n: str, reader: int) -> Side:
        """How ``n`` may be held for ``reader``: (attr, the 0/1 variables whose sum says so)."""
        if n in self.fixed:
            return [(self.fixed[n], [])]
        producer = self.space.producer
        if n in producer and producer[n] < reader:
            return self.side(producer[n], n, 1)
        attrs, vs = self.src_choice[n]
        return [(a, [v]) for a, v in zip(attrs, vs)]

    def side(self, j: int, n: str, s: int) -> Side:
        """How op ``j``'s candidates want input ``n`` (``s`` 0) or make output ``n`` (``s`` 1)."""
        g: dict[TensorDistAttr, list[int]] = {}
        xj = self.x[j]
        for k, cand in enumerate(self.space.cands[j]):
            got_a = (cand[0] if s == 0 else cand[1]).get(n) or \
                TensorDistAttr.replicated(self.mesh, len(self.tensors[n].shape))
            g.setdefault(got_a, []).append(xj[k])
        return list(g.items())

    # -- edges

    def edge(self, n: str, src: Side, dst: Side, w: float) -> None:
        """The reshard of ``n`` from how it is held (one of ``src``) to how it is wanted (one of
        ``dst``), ``w`` times (identical layers); each side: (attr, the 0/1 variables whose sum
        says it is that attr)."""
        price, costs = self.price, self.costs
        if len(src) == 1 and len(dst) == 1:  # both certain
            self.const += w * price(n, src[0][0], dst[0][0])
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
        m = self.shared.get(key)
        if m is None:
            m = self.shared[key] = [[0.0] * len(dst) for _ in src]
        for ai, (a, _) in enumerate(src):
            for bi, (b, _) in enumerate(dst):
                m[ai][bi] += w * price(n, a, b)

    def _weights(self) -> list[int]:
        """An op tied to another whose every read is held by the same variables (or pin) as the
        other's is priced once, times the number of such copies."""
        prog, fixed, producer = self.prog, self.fixed, self.space.producer
        weight = [1] * len(prog.ops)

        def holder(n: str, reader: int) -> Any:
            if n in fixed:
                return ("pin", fixed[n])
            if n in producer and producer[n] < reader:
                return ("op", id(self.x[producer[n]]))
            return ("src", id(self.src_choice[n][1]))

        for j, r in self.space.tie.items():
            a_reads = prog.ops[j].input_names()
            b_reads = prog.ops[r].input_names()
            if len(a_reads) == len(b_reads) and all(holder(a, j) == holder(b, r) for a, b in zip(a_reads, b_reads)):
                weight[r] += 1
                weight[j] = 0
        return weight

    def _edges(self, grad_sync_weight: float) -> None:
        tensors = self.tensors
        weight = self._weights()
        for j, op in enumerate(self.prog.ops):
            w = weight[j]
            if not w:
                continue
            reads = list(dict.fromkeys(op.input_names()))
            for n in reads:
                # a gradient's reduction before its update overlaps the backward (the step's buckets)
                gw = grad_sync_weight if (op.phase == "optimizer" and tensors[n].kind == "gradient") else 1.0
                self.edge(n, self.held(n, j), self.side(j, n, 0), w * gw)
            for n in op.output_names():  # an in-place output: back to how the tensor it overwrites is held
                over = tensors[n].inplace_of
                if over is not None and over in reads and n not in self.fixed:
                    self.edge(n, self.side(j, n, 1), self.held(over, j), w)

    def _linearise(self) -> None:
        """Edges between two choices: a variable per pair of attrs, tied to both one-hots (Alpa)."""
        for (sg, dg), m in self.shared.items():
            e = self.e_vars[sg, dg] = {}
            for ai in range(len(sg)):
                for bi in range(len(dg)):
                    e[ai, bi] = self.new_vars(1, False)[0]
                    self.costs[e[ai, bi]] = m[ai][bi]
            for ai, vs in enumerate(sg):  # sum_b e_ab = [held as a]
                self.rows.append((0.0, 0.0, [e[ai, bi] for bi in range(len(dg))] + list(vs),
                                  [1.0] * len(dg) + [-1.0] * len(vs)))
            for bi, ys in enumerate(dg):  # sum_a e_ab = [required as b]
                self.rows.append((0.0, 0.0, [e[ai, bi] for ai in range(len(sg))] + list(ys),
                                  [1.0] * len(sg) + [-1.0] * len(ys)))

    # -- memory: what is held for the step (parameters, their gradients, optimizer states) and
    # the activations the backward keeps, local bytes per device, linear in the choices

    def size_terms(self, n: str, coef: dict[int, float]) -> float:
        """Add ``n``'s local bytes to ``coef`` (per variable); returns the certain part."""
        t = self.tensors[n]
        if n in self.fixed:
            return float(local_numel(self.fixed[n], t.shape) * t.itemsize)
        producer = self.space.producer
        if n in producer:
            for a, vs in self.side(producer[n], n, 1):
                b = local_numel(a, t.shape) * t.itemsize
                for v in vs:
                    coef[v] = coef.get(v, 0.0) + b
            return 0.0
        if n in self.src_choice:
            for a, v in zip(*self.src_choice[n]):
                coef[v] = coef.get(v, 0.0) + local_numel(a, t.shape) * t.itemsize
            return 0.0
        return float(t.nbytes)

    def _memory(self) -> None:
        prog, tensors = self.prog, self.tensors
        param_grads = prog.param_grads()
        held_all = [n for n, t in tensors.items() if t.kind in ("parameter", "optimizer_state") and not t.inplace_of]
        held_all += sorted(param_grads)
        self.base_coef: dict[int, float] = {}
        self.base_const = sum(self.size_terms(n, self.base_coef) for n in held_all)
        self.mem_coef = dict(self.base_coef)
        self.mem_const = self.base_const + sum(self.size_terms(n, self.mem_coef) for n in sorted(value_reads(prog)))
        self.first_op, self.last_op = prog.live_spans()
        self.transient = [n for n in self.first_op if n not in param_grads and not tensors[n].inplace_of
                          and tensors[n].kind not in ("parameter", "optimizer_state")]

    def live_row(self, at: int) -> tuple[dict[int, float], float]:
        """Memory at op ``at`` (memory.py's spans, reshards' copies left out): what is held for
        the step and the activations made before ``at`` and read at or after it."""
        coef = dict(self.base_coef)
        c = self.base_const + sum(self.size_terms(n, coef) for n in self.transient
                                  if self.first_op[n] <= at <= self.last_op[n])
        for n in dict.fromkeys(self.prog.ops[at].input_names()):  # the copies op ``at`` reads
            src, dst = self.held(n, at), self.side(at, n, 0)

            def nb(b: TensorDistAttr, t: Any = self.tensors[n]) -> float:
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
            e = self.e_vars.get((tuple(tuple(vs) for _, vs in src), tuple(tuple(ys) for _, ys in dst)), {})
            for (ai, bi), v in e.items():
                if src[ai][0] != dst[bi][0]:
                    coef[v] = coef.get(v, 0.0) + nb(dst[bi][0])
        return coef, c

    def least_memory(self) -> float:
        """A bound no choice goes below: the certain part and the least of each one-hot choice."""
        mem_coef, x = self.mem_coef, self.x
        least = self.mem_const + sum(min(mem_coef.get(v, 0.0) for v in x[i]) for i in range(len(self.prog.ops))
                                     if self.space.chooses(i) and x[i])
        least += sum(min(mem_coef.get(v, 0.0) for v in vs) for n, (_a, vs) in self.src_choice.items()
                     if self.src_tie.get(n) is None)
        return least

    def pick(self, s: list[float], i: int) -> int:
        """The candidate of op ``i`` a solution ``s`` chooses."""
        xi = self.x[i]
        return max(range(len(xi)), key=lambda k: s[xi[k]])


__all__ = ["Problem", "Row", "Side"]
