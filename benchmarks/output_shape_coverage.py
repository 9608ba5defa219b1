#!/usr/bin/env python3
"""How many declared output shapes that contradict the op program validation catches (issue 13).

``Program.validate`` checks each op's declared output shapes against the shapes its rule
makes from the input shapes and attributes (``spmdkit.program.shapes``), and also calls
the rule's reverse (backward) mode where it has one. This script measures it against an
independent oracle, the numpy reference of every rule (``spmdkit.sim``):

* cases: up to ``--cases`` seeded valid forward cases per rule (``spmdkit.sim.cases``),
  each made into a one-op program whose output shapes are those the numpy op produces, and
  the golden reverse-mode cases (tests/golden, whose output shapes come from Paddle);
* false alarms: a correct program that validation refuses (must be 0);
* perturbed axes: each output axis in turn made one larger; caught when validation raises
  ProgramError naming the op.

    python benchmarks/output_shape_coverage.py [--cases 20] [--seed 0] [--per-rule]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import numpy as np  # noqa: E402

from spmdkit.core.errors import ProgramError, SpmdError  # noqa: E402
from spmdkit.core.mesh import ProcessMesh  # noqa: E402
from spmdkit.engine.registry import all_rules, get_rule, is_reverse, output_params  # noqa: E402
from spmdkit.program.ir import Op, Program, Tensor  # noqa: E402
from spmdkit.program.shapes import unchecked_rules  # noqa: E402
from spmdkit.sim.cases import generate_cases, make_array  # noqa: E402
from spmdkit.sim.reference import Ctx, get_reference  # noqa: E402


@dataclass
class OneOp:
    """A one-op program of a case: its tensors (outputs with their true shapes) and the op."""

    rule: str
    source: str
    tensors: list[Tensor]
    op: Op

    def program(self, bad: tuple[str, int] | None = None) -> Program:
        ts = []
        for t in self.tensors:
            if bad is not None and t.name == bad[0]:
                shape = list(t.shape)
                shape[bad[1]] += 1
                t = Tensor(t.name, tuple(shape), t.dtype, t.kind)
            ts.append(t)
        return Program(ts, [self.op], f"{self.rule} case")

    def outputs(self) -> list[Tensor]:
        names = set(self.op.output_names())
        return [t for t in self.tensors if t.name in names]


def _op_from_args(rule_name: str, args: list[Any]) -> tuple[list[Tensor], dict[str, Any], dict[str, Any]]:
    """(input tensors, op inputs, op attrs) from a case's forward arguments."""
    rule = get_rule(rule_name)
    tensors: list[Tensor] = []
    ins: dict[str, Any] = {}
    attrs: dict[str, Any] = {}
    for p, a in zip(rule.forward.params, args):
        if p.is_tensor:
            if a is None:
                continue
            if isinstance(a, list):
                names: list[str | None] = []
                for i, t in enumerate(a):
                    if t is None:
                        names.append(None)
                    else:
                        tensors.append(Tensor(f"{p.name}_{i}", tuple(t["shape"]), kind="input"))
                        names.append(f"{p.name}_{i}")
                ins[p.name] = tuple(names)
            else:
                tensors.append(Tensor(p.name, tuple(a["shape"]), kind="input"))
                ins[p.name] = p.name
        else:
            attrs[p.name] = tuple(a) if isinstance(a, list) else a
    return tensors, ins, attrs


def _slots(prog: Program, op: Op) -> list[Any]:
    """The rule's output slots for the op: per slot None, an int (a tensor) or a count (vector)."""
    from spmdkit.program.ir import call_rule

    res = call_rule(prog, op, {}, ProcessMesh([1]))
    return [len(o) if isinstance(o, tuple) else (None if o is None else -1) for o in res.outputs]


def numpy_outputs(rule_name: str, tensors: list[Tensor], ins: dict[str, Any],
                  attrs: dict[str, Any]) -> list[Any] | None:
    """The shapes the numpy reference's op makes, per rule output slot (None: absent; a list
    for a vector output), or None when the reference cannot run the case."""
    ref = get_reference(rule_name)
    if ref is None:
        return None
    rule = get_rule(rule_name)
    probe = Program(tensors, [Op(rule_name, ins, (), attrs)], "probe")
    try:
        slots = _slots(probe, probe.ops[0])
    except SpmdError:
        return None
    rng = np.random.default_rng(0)
    arrays: dict[str, Any] = {}
    shapes: dict[str, Any] = {}
    by_name = {t.name: t for t in tensors}
    for p in rule.forward.params:
        if not p.is_tensor:
            continue
        v = ins.get(p.name)
        if v is None:
            arrays[p.name] = shapes[p.name] = None
        elif isinstance(v, tuple):
            shapes[p.name] = [None if x is None else by_name[x].shape for x in v]
            arrays[p.name] = [None if x is None else make_array(by_name[x].shape, ref.domain(p.name), rng)
                              for x in v]
        else:
            shapes[p.name] = by_name[v].shape
            arrays[p.name] = make_array(by_name[v].shape, ref.domain(p.name), rng)
    gargs = {**attrs, **arrays}
    try:
        if ref.prepare is not None:
            ref.prepare(gargs)
        with np.errstate(all="ignore"):
            outs = list(ref.run(gargs, Ctx(ProcessMesh([1]), shapes=shapes)))  # vector outputs as lists
    except Exception:
        return None
    if len(slots) == 1 and slots[0] is not None and slots[0] >= 0 and len(outs) != 1:
        outs = [outs]  # one vector output (split, unbind): the reference's outputs are its items
    if len(outs) != len(slots):
        return None
    result: list[Any] = []
    for s, o in zip(slots, outs):
        if s is not None and s >= 0:  # a vector output
            items = list(o) if isinstance(o, (list, tuple)) else None
            if items is None or len(items) != s:
                return None
            result.append([tuple(np.shape(x)) for x in items])
        elif o is None or s is None:
            result.append(None)
        else:
            result.append(tuple(np.shape(o)))
    return result


def _outputs(shapes: list[Any]) -> tuple[list[Any], list[Tensor]]:
    refs: list[Any] = []
    ts: list[Tensor] = []
    for k, o in enumerate(shapes):
        if isinstance(o, list):
            names = []
            for i, x in enumerate(o):
                ts.append(Tensor(f"out{k}_{i}", tuple(x)))
                names.append(f"out{k}_{i}")
            refs.append(tuple(names))
        elif o is None:
            refs.append(None)
        else:
            ts.append(Tensor(f"out{k}", tuple(o)))
            refs.append(f"out{k}")
    return refs, ts


def forward_cases(rule_name: str, n: int, seed: int) -> Iterator[OneOp]:
    """One-op programs from seeded forward cases, output shapes from the numpy reference."""
    for c in generate_cases(rule_name, n, seed, "forward"):
        tensors, ins, attrs = _op_from_args(rule_name, c["args"])
        shapes = numpy_outputs(rule_name, tensors, ins, attrs)
        if shapes is None:
            continue
        out_refs, out_tensors = _outputs(shapes)
        yield OneOp(rule_name, c["id"], tensors + out_tensors, Op(rule_name, ins, tuple(out_refs), attrs,
                                                                name=f"the_{rule_name}_op"))


def golden_cases(per_rule: int) -> Iterator[OneOp]:
    """One-op programs from the golden reverse-mode cases (output shapes from Paddle)."""
    seen: collections.Counter[str] = collections.Counter()
    for f in sorted((ROOT / "tests" / "golden").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            d = json.loads(line)
            c = d["case"]
            if c.get("mode") != "backward" or "error" in d.get("expect", {}):
                continue
            rule = get_rule(c["rule"])
            if not is_reverse(rule) or seen[c["rule"]] >= per_rule:
                continue
            seen[c["rule"]] += 1
            outs = set(output_params(rule))
            fwd_args: list[Any] = []
            named = {p.name: a for p, a in zip(rule.backward.params, c["args"])} if rule.backward else {}
            for p in rule.forward.params:
                fwd_args.append(named.get(p.name, p.default if not p.required else None))
            tensors, ins, attrs = _op_from_args(c["rule"], fwd_args)
            out_refs: list[Any] = []
            out_tensors: list[Tensor] = []
            for k, pn in enumerate(n for n in output_params(rule) if n in outs):
                a = named.get(pn)
                if a is None:
                    out_refs.append(None)
                elif isinstance(a, list):
                    names = []
                    for i, t in enumerate(a):
                        out_tensors.append(Tensor(f"out{k}_{i}", tuple(t["shape"])))
                        names.append(f"out{k}_{i}")
                    out_refs.append(tuple(names))
                else:
                    out_tensors.append(Tensor(f"out{k}", tuple(a["shape"])))
                    out_refs.append(f"out{k}")
            case = OneOp(c["rule"], f"golden {f.name}", tensors + out_tensors,
                         Op(c["rule"], ins, tuple(out_refs), attrs, name=f"the_{c['rule']}_op"))
            # data-dependent sizes (nonzero's count) and large cases (numpy too slow) are not re-run
            small = sum(_numel(t.shape) for t in tensors) <= 50_000
            real = numpy_outputs(c["rule"], tensors, ins, attrs) if small and c["rule"] not in DATA_SIZED else None
            if real is not None:
                declared = {t.name: t.shape for t in out_tensors}
                mine = {t.name: t.shape for t in _outputs(real)[1]}
                if any(n in mine and mine[n] != s for n, s in declared.items()):
                    NOT_THE_OPS.append(f"{c['rule']}: declared {sorted(declared.items())}, the op makes "
                                       f"{sorted(mine.items())}")
                    continue
            yield case


DATA_SIZED = {"nonzero", "unique"}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for v in shape:
        n *= v
    return n


#: golden reverse cases whose output shapes are not what the op makes (Paddle's SPMD unit tests
#: give slice's output the input's shape): not valid programs, left out and counted
NOT_THE_OPS: list[str] = []


@dataclass
class Tally:
    cases: int = 0
    false_alarms: int = 0
    tried: int = 0
    caught: int = 0


def measure(case: OneOp, t: Tally, alarms: list[str]) -> None:
    """Validate the correct program (must pass) and each one-axis-larger output (must fail)."""
    try:
        get_rule(case.rule).infer_forward  # noqa: B018
        prog = case.program()
    except SpmdError:
        return
    try:
        prog.validate()
    except ProgramError as exc:
        if "contradicts" in str(exc) or "makes" in str(exc):
            t.false_alarms += 1
            alarms.append(f"{case.rule} ({case.source}): {exc}")
        return  # a case the rule itself refuses (not an output-shape question)
    t.cases += 1
    for out in case.outputs():
        for ax in range(len(out.shape)):
            t.tried += 1
            try:
                case.program((out.name, ax)).validate()
            except ProgramError as exc:
                if case.op.name in str(exc):
                    t.caught += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=20, help="seeded forward cases per rule (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--golden", type=int, default=20, help="golden reverse cases per rule (default 20)")
    ap.add_argument("--per-rule", action="store_true", help="print every rule's numbers")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    canon = sorted({r.name for r in all_rules().values()})
    per: dict[str, Tally] = {n: Tally() for n in canon}
    alarms: list[str] = []
    for name in canon:
        for case in forward_cases(name, args.cases, args.seed):
            measure(case, per[name], alarms)
    for case in golden_cases(args.golden):
        measure(case, per[get_rule(case.rule).name], alarms)
    total = Tally(sum(t.cases for t in per.values()), sum(t.false_alarms for t in per.values()),
                  sum(t.tried for t in per.values()), sum(t.caught for t in per.values()))
    measured = [n for n, t in per.items() if t.tried]
    full = [n for n in measured if per[n].caught == per[n].tried]
    part = [n for n in measured if 0 < per[n].caught < per[n].tried]
    none = [n for n in measured if per[n].caught == 0]
    unmeasured = [n for n in canon if not per[n].tried]
    print(f"rules: {len(canon)}; measured: {len(measured)} ({total.cases} correct one-op programs: "
          f"{args.cases} seeded forward cases per rule with numpy output shapes + golden reverse cases)")
    print(f"false alarms (a correct program refused): {total.false_alarms}")
    print(f"perturbed output axes: {total.tried}, caught: {total.caught} "
          f"({100.0 * total.caught / max(total.tried, 1):.1f}%)")
    print(f"  every perturbed axis caught: {len(full)} rules")
    print(f"  some axes caught: {len(part)}: " + ", ".join(f"{n} {per[n].caught}/{per[n].tried}" for n in part))
    print(f"  none caught: {len(none)}: {', '.join(none)}")
    if unmeasured:
        print(f"  not measured (no valid case): {len(unmeasured)}: {', '.join(unmeasured)}")
    print(f"golden reverse cases left out, their output shapes not the op's (numpy): {len(NOT_THE_OPS)}")
    for x in NOT_THE_OPS[:10]:
        print(f"  {x[:300]}")
    un = unchecked_rules()
    print(f"documented unchecked outputs (the op families' unchecked facts): {len(un)}")
    for n, why in sorted(un.items()):
        print(f"  {n}: {why}")
    if args.per_rule:
        for n in canon:
            t = per[n]
            print(f"{n}: cases {t.cases}, axes {t.caught}/{t.tried}, false alarms {t.false_alarms}")
    for a in alarms[:20]:
        print("FALSE ALARM:", a[:400])
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 1 if total.false_alarms else 0


if __name__ == "__main__":
    sys.exit(main())
