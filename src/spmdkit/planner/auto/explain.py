"""``--explain`` of the exact search (:mod:`spmdkit.planner.auto`): per layer, what was chosen and
what the best plan whose choice differs in that layer would cost (a no-good cut, re-solved)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.planner.auto.candidates import Cand, Progress, group_of
from spmdkit.planner.auto.solve import SCALE, Solver
from spmdkit.program.ir import Program


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


def _label(prog: Program, ops: list[int]) -> str:
    op = prog.ops[ops[0]]
    g = group_of(op)
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


def explain(solver: Solver, sol: list[float], objective: float, tick: Progress, limit: float) -> list[LayerChoice]:
    """Per layer group (tied layers once): the choice, and the best objective with that group's
    choice excluded (a no-good cut: not all of its chosen variables at 1)."""
    pb = solver.problem
    prog, x, cands, const = pb.prog, pb.x, pb.space.cands, pb.const
    groups_ops, tie, parent = pb.space.groups_ops, pb.space.tie, pb.space.parent
    h, highspy, np = solver.h, solver.highspy, solver.np

    def pick(i: int) -> int:
        return pb.pick(sol, i)
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
            other = float(h.getInfo().objective_function_value) / SCALE + const
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


__all__ = ["LayerChoice", "explain"]
