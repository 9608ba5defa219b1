"""The exact search's integer program (:mod:`spmdkit.planner.auto.ilp`) solved by HiGHS: the
plain solve, and under a memory cap the Lagrangian rounds (memory priced into the objective,
the price raised until a realised plan fits, then bisected)."""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.cost.memory import memory_per_device
from spmdkit.planner.auto.ilp import Problem
from spmdkit.planner.auto.realise import Realiser
from spmdkit.program.plan import Plan

#: the most re-solves (with the memory penalty) when the cheapest plan does not fit the cap
MEMORY_ROUNDS = 8
#: the relative gap each memory-priced re-solve stops at
PENALISED_GAP = 0.01
#: the memory price is bisected until the price that fits is within this factor of one that does not
BISECT_RATIO = 2.0
#: the program's costs are microseconds (seconds are too small for the solver's tolerances)
SCALE = 1e6


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


class Solver:
    """The program loaded into HiGHS (``h``; ``highspy`` and ``np`` the modules), with the
    deadline of the whole search."""

    def __init__(self, problem: Problem, highspy: Any, np: Any, time_limit: float) -> None:
        self.problem, self.highspy, self.np = problem, highspy, np
        costs, rows, integer = problem.costs, problem.rows, problem.integer
        self.nvar = nvar = len(costs)
        h = self.h = _quiet_highs(highspy)
        h.setOptionValue("random_seed", 0)
        h.setOptionValue("threads", 1)
        zeros = np.zeros(nvar)
        h.addCols(nvar, np.array(costs, dtype=np.float64) * SCALE, zeros, np.ones(nvar), 0,
                  np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int32), np.zeros(0))
        h.changeColsIntegrality(len(integer), np.array(integer, dtype=np.int32),
                                np.array([highspy.HighsVarType.kInteger] * len(integer)))
        starts: list[int] = []
        idx: list[int] = []
        vals: list[float] = []
        for _lo, _hi, ix, vx in rows:
            starts.append(len(idx))
            idx.extend(ix)
            vals.extend(vx)
        h.addRows(len(rows), np.array([r[0] for r in rows], dtype=np.float64),
                  np.array([r[1] for r in rows], dtype=np.float64), len(idx), np.array(starts, dtype=np.int32),
                  np.array(idx, dtype=np.int32), np.array(vals, dtype=np.float64))
        h.changeObjectiveSense(highspy.ObjSense.kMinimize)
        self.mem_ix = sorted(problem.mem_coef)
        self.mem_w = np.array([problem.mem_coef[v] for v in self.mem_ix])
        self.base = np.array(costs, dtype=np.float64)
        self.deadline = time.perf_counter() + float(time_limit)

    def solve(self) -> tuple[str, list[float] | None]:
        h = self.h
        h.setOptionValue("time_limit", max(1.0, self.deadline - time.perf_counter()))
        h.run()
        status = h.modelStatusToString(h.getModelStatus())
        sol = list(h.getSolution().col_value)
        if len(sol) != self.nvar or (status in ("Infeasible", "Time limit reached")
                                     and h.getInfo().primal_solution_status < 2):
            return status, None
        return status, sol

    def mem_of(self, x_: list[float]) -> float:
        return self.problem.mem_const + float(sum(w * x_[v] for v, w in zip(self.mem_ix, self.mem_w)))

    def time_of(self, x_: list[float]) -> float:
        return self.problem.const + float(self.np.dot(self.base, self.np.array(x_)))

    def memory_counted(self, sol: list[float]) -> int:
        """The memory of a solution as the program counts it (bytes per device)."""
        pb = self.problem
        return round(pb.mem_const + sum(pb.mem_coef[v] * sol[v] for v in self.mem_ix))


@dataclass
class Capped:
    """The outcome of the memory-capped rounds."""

    objective: float
    sol: list[float]
    plan: Plan
    realized: str
    status: str
    gap: float


class _Penalty:
    """The penalised memory: the rows of the kept activations and of every position where a
    realised plan peaked so far (each at most the cap: the bound stays valid)."""

    def __init__(self, solver: Solver) -> None:
        self.solver = solver
        np = solver.np
        self.rows: list[tuple[Any, Any, float]] = [(np.array(solver.mem_ix, dtype=np.int64), solver.mem_w,
                                                    solver.problem.mem_const)]
        self.peaks: set[int] = set()

    def add_peak(self, at: int) -> None:
        if at not in self.peaks:
            self.peaks.add(at)
            coef, c = self.solver.problem.live_row(at)
            ix = sorted(coef)
            np = self.solver.np
            self.rows.append((np.array(ix, dtype=np.int64), np.array([coef[v] for v in ix]), c))

    def costs(self, lam: float) -> Any:
        pen = self.solver.base.copy()
        for ix_, w_, _c in self.rows:
            self.solver.np.add.at(pen, ix_, lam * w_)
        return pen

    def slack(self, cap: int) -> float:
        return sum(cap - c_ for _i, _w, c_ in self.rows)


def capped_solve(solver: Solver, realise: Realiser, memory_cap: int, objective: float, sol: list[float],
                 plan: Plan) -> Capped:
    """Lagrangian relaxation of the memory row: minimise time + lam * memory, lam raised until
    the realised plan fits, then bisected; max over lam of the penalised optimum less
    lam * (cap - memory) bounds the capped optimum from below (the gap)."""
    h, np, nvar = solver.h, solver.np, solver.nvar
    best: tuple[float, list[float], Plan, str, str] | None = None
    bound = objective
    var_mem = max(solver.mem_of(sol) - solver.problem.mem_const, 1.0)
    lam, lo, hi = max(objective, 1e-12) / var_mem, 0.0, math.inf
    penalty = _Penalty(solver)
    penalty.add_peak(memory_per_device(plan).peak_op)
    h.setOptionValue("mip_rel_gap", PENALISED_GAP)  # the rounds are a heuristic: near-optimal is enough
    rounds = 0
    while rounds < MEMORY_ROUNDS and time.perf_counter() < solver.deadline:
        rounds += 1
        h.changeColsCost(nvar, np.arange(nvar, dtype=np.int32), penalty.costs(lam) * SCALE)
        st, xs = solver.solve()
        if xs is None:
            break
        hinfo = h.getInfo()
        dual = float(hinfo.mip_dual_bound) / SCALE if st != "Optimal" else \
            float(hinfo.objective_function_value) / SCALE
        bound = max(bound, dual + solver.problem.const - lam * penalty.slack(memory_cap))
        p_, r_ = realise(xs)
        got_mem = memory_per_device(p_)
        penalty.add_peak(got_mem.peak_op)
        if got_mem.total <= memory_cap:
            hi = lam
            if best is None or solver.time_of(xs) < best[0]:
                best = (solver.time_of(xs), xs, p_, r_, st)
        else:
            lo = lam
        if hi == math.inf:
            lam *= 8.0
        elif hi / max(lo, 1e-300) < BISECT_RATIO:
            break
        else:
            lam = math.sqrt(lo * hi) if lo > 0 else hi / 8.0
    h.changeColsCost(nvar, np.arange(nvar, dtype=np.int32), solver.base * SCALE)
    h.setOptionValue("mip_rel_gap", 1e-4)
    if best is None:
        raise ProgramError(_min_memory_message(solver, memory_cap, realise))
    objective, sol, plan, realized, status = best
    gap = max(0.0, (objective - bound) / objective) if objective > 0 else 0.0
    return Capped(objective, sol, plan, realized, f"{status}, memory-capped ({rounds} rounds)", gap)


def _min_memory_message(solver: Solver, cap: int, realise: Realiser) -> str:
    """The ProgramError text for a cap no plan found meets: the least memory the candidates
    allow (as the integer program counts it, and as the realised plan needs it)."""
    h, np, nvar, mem_ix = solver.h, solver.np, solver.nvar, solver.mem_ix
    mem_coef, mem_const = solver.problem.mem_coef, solver.problem.mem_const
    h.changeColsCost(nvar, np.arange(nvar, dtype=np.int32), np.zeros(nvar))
    h.changeColsCost(len(mem_ix), np.array(mem_ix, dtype=np.int32), np.array([mem_coef[v] for v in mem_ix]) / 2**20)
    h.run()
    sol = list(h.getSolution().col_value)
    least = ""
    if len(sol) == nvar:
        need = memory_per_device(realise(sol)[0]).total
        least = (f"; the smallest the search found needs {size_text(need)} (parameters, gradients, optimizer states "
                 f"and the activation peak; {size_text(mem_const + sum(mem_coef[v] * sol[v] for v in mem_ix))} "
                 "without transient activations)")
    return f"auto: --memory {size_text(cap)}: no plan the search found fits in it per device{least}"


def size_text(b: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= k:
            return f"{b / k:.2f} {unit}"
    return f"{int(b)} B"


__all__ = ["BISECT_RATIO", "MEMORY_ROUNDS", "PENALISED_GAP", "SCALE", "Capped", "Solver", "capped_solve",
           "size_text"]
