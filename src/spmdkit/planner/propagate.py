"""Whole-program propagation: every tensor's dist attr from a few annotations, and the reshards.

``propagate(program, mesh, annotations)`` runs sweeps over the ops until nothing changes:

1. a forward sweep in program order: each op whose inputs have a dist attr (a tensor with
   none yet counts as replicated) runs its rule's ``infer_forward``; its outputs take the
   rule's answers, except annotated tensors, which never change;
2. a backward sweep in reverse order: an op whose outputs have dist attrs and some inputs
   none (an unannotated parameter, say) runs its reverse rule (``infer_backward``) and those
   inputs take its answers; where several ops read such a tensor, the first in program order
   decides (a parameter is laid out for its forward use, not for its optimizer update).

A backward sweep only fills tensors that had no dist attr, and a forward sweep is a function
of the annotations and the filled tensors, so the sweeps reach a fixed point in a few forward
sweeps, at most ``MAX_ROUNDS`` (each op is visited a bounded number of times: the cost is
linear in the number of ops); the answer is deterministic. The last forward sweep is the plan:
where an op's rule needs an input otherwise than its producer made it, a reshard is planned
(``spmdkit.core.reshard``: collectives, bytes, time); an annotated output that the rule makes
otherwise is resharded after the op. Reshards of one tensor to one dist attr are shared by
all its consumers. A partial tensor read by several ops, one of which needs it reduced
(a residual stream read by a norm's ``square`` and its ``multiply``), is reduced once right
after its producer and every reader gets the reduced one (a sweep that finds one more such
tensor counts as not converged); one with a single reader is reduced where that reader needs it.

An output that overwrites one of its op's inputs in place (``inplace_of``: an optimizer's
updated parameter and moments) is held in that input's dist attr: the next step reads it
there. The op may still run in another layout; the engine takes the cheaper of two (by the
cost model's time, then bytes): the rule's forward answer on the inputs as they come, or the
layout the reverse rule derives from the in-place outputs' dist attrs (the update on the
parameter's layout, or on the ZeRO shards of its states), run forward from there. Whatever
the rule makes differently is resharded after the op (a replicated parameter's update on tp
shards would leave its moments and the parameter to all-gather; on the parameter's layout
only the gradient is gathered, once).

``storage`` (ZeRO-3 / FSDP): tensors stored in another dist attr than the one their readers
get (a parameter sharded over ``dp``): every forward and every backward phase gathers it again
before its readers (one reshard per phase, shared by that phase's readers only: the gathered
copy is freed after use), and the optimizer-phase ops read the stored shard.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel, ReshardPlan, plan_reshard
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.registry import get_rule, is_reverse
from spmdkit.program.ir import Op, Program, flat_refs, layout_args, op_layout
from spmdkit.program.plan import OpPlan, Plan, Reshard

MAX_ROUNDS = 4


def _flat_attrs(v: Any) -> list[Any]:
    return list(v) if isinstance(v, tuple) else [v]


class _Specs:
    """DistTensorSpec per (tensor, dist attr), built once."""

    def __init__(self, prog: Program, mesh: ProcessMesh) -> None:
        self.prog = prog
        self.mesh = mesh
        self._cache: dict[tuple[str, TensorDistAttr | None], DistTensorSpec] = {}

    def get(self, name: str, attr: TensorDistAttr | None) -> DistTensorSpec:
        key = (name, attr)
        s = self._cache.get(key)
        if s is None:
            shape = self.prog.tensors[name].shape
            s = DistTensorSpec(shape, attr if attr is not None else TensorDistAttr.replicated(self.mesh, len(shape)))
            self._cache[key] = s
        return s


class _OpCall:
    """An op's rule and how to lay out its arguments (computed once per op)."""

    __slots__ = ("bwd", "bwd_layout", "fwd", "fwd_layout", "op", "tparams")

    def __init__(self, op: Op) -> None:
        rule = get_rule(op.rule)
        self.op = op
        self.fwd = rule.forward
        self.bwd = rule.backward if is_reverse(rule) else None
        self.fwd_layout = op_layout(op, "forward")
        self.tparams = [p.name for p in self.fwd.params if p.is_tensor]
        self.bwd_layout = op_layout(op, "backward") if self.bwd is not None else None


def _parse_annotations(prog: Program, mesh: ProcessMesh,
                       annotations: Mapping[str, Any] | None, what: str = "annotation") -> dict[str, TensorDistAttr]:
    out: dict[str, TensorDistAttr] = {}
    for name, a in (annotations or {}).items():
        if name not in prog.tensors:
            raise ProgramError(f"{what} for {name!r}: the program has no such tensor")
        t = prog.tensors[name]
        if not isinstance(a, TensorDistAttr):
            try:
                a = TensorDistAttr(mesh, a)
            except SpmdError as exc:
                raise ProgramError(f"{what} for {name!r}: {exc}") from None
        if a.mesh != mesh:
            raise ProgramError(f"{what} for {name!r}: its mesh {list(a.mesh.shape)} is not the plan's "
                               f"{list(mesh.shape)}")
        if a.ndim != len(t.shape):
            raise ProgramError(f"{what} for {name!r}: dims_mapping has {a.ndim} entries, the tensor has shape "
                               f"{list(t.shape)}")
        out[name] = a
    return out


def propagate(
    program: Program,
    mesh: ProcessMesh,
    annotations: Mapping[str, Any] | None = None,
    cost: CostModel | None = None,
    progress: Callable[[int, int], None] | None = None,
    storage: Mapping[str, Any] | None = None,
) -> Plan:
    """Every tensor's dist attr and the reshards of ``program`` on ``mesh``; ``annotations``:
    tensor name -> TensorDistAttr (or a dims_mapping list) that never changes; ``storage``:
    tensor -> the dist attr it is stored in, gathered to its (annotated) dist attr before the
    forward and the backward readers (ZeRO-3)."""
    fixed = _parse_annotations(program, mesh, annotations)
    store = _parse_annotations(program, mesh, storage, "storage")
    for stored in store:
        if program.tensors[stored].kind not in ("parameter", "input", "optimizer_state"):
            raise ProgramError(f"storage for {stored!r}: only a program input (a parameter) can be stored sharded")
    cost = cost or CostModel.default(mesh)
    attrs: dict[str, TensorDistAttr | None] = {n: None for n in program.tensors}
    attrs.update(fixed)
    specs = _Specs(program, mesh)
    calls = [_OpCall(op) for op in program.ops]
    # outputs that overwrite one of their op's inputs in place: held in that input's dist attr
    tied: dict[int, dict[str, str]] = {}
    for i, op in enumerate(program.ops):
        reads = set(op.input_names())
        for out_name in op.output_names():
            over = program.tensors[out_name].inplace_of
            if over is not None and over in reads and out_name not in fixed:
                tied.setdefault(i, {})[out_name] = over
    planned: dict[tuple[TensorDistAttr, TensorDistAttr, tuple[int, ...], int], ReshardPlan] = {}

    def plan_of(name: str, src: TensorDistAttr, dst: TensorDistAttr) -> ReshardPlan:
        t = program.tensors[name]
        key = (src, dst, t.shape, t.itemsize)
        p = planned.get(key)
        if p is None:
            p = plan_reshard(src, dst, t.shape, t.itemsize, cost)
            planned[key] = p
        return p

    def held_attr(n: str) -> TensorDistAttr:
        a = store[n] if n in store else attrs[n]
        return a if a is not None else TensorDistAttr.replicated(mesh, len(program.tensors[n].shape))

    def get(n: str) -> DistTensorSpec:
        return specs.get(n, attrs[n])

    def get_stored(n: str) -> DistTensorSpec:  # the optimizer reads a stored tensor as stored
        return specs.get(n, store[n] if n in store else attrs[n])

    def run(i: int, c: _OpCall, backward: bool) -> SpmdResult:
        if store and c.op.phase == "optimizer":
            try:
                return get_rule(c.op.rule).infer(
                    "backward" if backward else "forward",
                    *layout_args(c.bwd_layout if backward else c.fwd_layout, get_stored))  # type: ignore[arg-type]
            except SpmdError as exc:
                raise ProgramError(f"op {i} ({c.op.name or c.op.rule}): {type(exc).__name__}: {exc}") from None
        try:
            if backward:
                assert c.bwd is not None and c.bwd_layout is not None
                return get_rule(c.op.rule).infer_backward(*layout_args(c.bwd_layout, get))
            return get_rule(c.op.rule).infer_forward(*layout_args(c.fwd_layout, get))
        except SpmdError as exc:
            raise ProgramError(f"op {i} ({c.op.name or c.op.rule}): {type(exc).__name__}: {exc}") from None

    def price(c: _OpCall, res: SpmdResult, targets: Mapping[str, TensorDistAttr]) -> tuple[float, int]:
        """(time, bytes) of the reshards ``res`` needs: its inputs from how they are held, its
        in-place outputs to their targets."""
        t, b = 0.0, 0
        for p, req in zip(c.tparams, res.inputs):
            v = c.op.inputs.get(p)
            if v is None:
                continue
            for n, r_attr in zip(flat_refs(v), _flat_attrs(req)):
                if n is not None and r_attr is not None and held_attr(n) != r_attr:
                    rp = plan_of(n, held_attr(n), r_attr)
                    t, b = t + rp.time_s, b + rp.bytes_per_rank
        for v, a in zip(c.op.outputs, res.outputs):
            for n, x in zip(flat_refs(v), _flat_attrs(a)):
                if n is not None and x is not None and n in targets and targets[n] != x:
                    rp = plan_of(n, x, targets[n])
                    t, b = t + rp.time_s, b + rp.bytes_per_rank
        return t, b

    chosen: dict[tuple[Any, ...], SpmdResult] = {}  # repeated layers: one choice per kind of op

    def in_place(i: int, c: _OpCall, res: SpmdResult) -> SpmdResult:
        """The cheaper of the forward answer and the layout the in-place outputs ask for."""
        targets = {n: held_attr(s) for n, s in tied[i].items()}
        if c.bwd is None or c.bwd_layout is None:
            return res
        op = c.op
        key = (op.rule, repr(sorted(op.attrs.items())),
               tuple((program.tensors[n].shape, program.tensors[n].itemsize, attrs[n], held_attr(n))
                     for n in op.input_names()),
               tuple((targets.get(n), attrs[n]) for n in op.output_names()), res)
        got = chosen.get(key)
        if got is None:
            got = chosen[key] = _choose(c, res, targets)
        return got

    def _choose(c: _OpCall, res: SpmdResult, targets: dict[str, TensorDistAttr]) -> SpmdResult:
        assert c.bwd is not None and c.bwd_layout is not None

        def get_out(n: str) -> DistTensorSpec:
            return specs.get(n, targets[n] if n in targets else attrs[n])

        try:
            back = get_rule(c.op.rule).infer_backward(*layout_args(c.bwd_layout, get_out))
            req: dict[str, TensorDistAttr] = {}
            for p, a in zip([p.name for p in c.bwd.params if p.is_tensor], back.inputs):
                v = c.op.inputs.get(p)
                if v is not None:
                    for n, x in zip(flat_refs(v), _flat_attrs(a)):
                        if n is not None and x is not None:
                            req[n] = x

            def get_in(n: str) -> DistTensorSpec:
                return specs.get(n, req[n] if n in req else store[n] if n in store else attrs[n])

            alt = get_rule(c.op.rule).infer_forward(*layout_args(c.fwd_layout, get_in))
        except SpmdError:
            return res  # the reverse rule has no answer here: the forward one stands
        return alt if price(c, alt, targets) <= price(c, res, targets) else res

    rounds = 0
    results: list[SpmdResult | None] = []
    total = len(calls) * 2
    reduced: dict[str, TensorDistAttr] = {}  # partial tensors reduced right after their producer
    readers: dict[str, int] = {}
    for op in program.ops:
        for read in set(op.input_names()):
            readers[read] = readers.get(read, 0) + 1
    while True:
        rounds += 1
        results = []
        grew = False
        for i, c in enumerate(calls):
            names = c.op.input_names()
            if names and all(attrs[n] is None for n in names):
                results.append(None)
                continue
            res = run(i, c, False)
            if i in tied:
                res = in_place(i, c, res)
            results.append(res)
            for p, req in zip(c.tparams, res.inputs):
                v = c.op.inputs.get(p)
                if v is None:
                    continue
                for n, r_attr in zip(flat_refs(v), _flat_attrs(req)):
                    if n is None or r_attr is None or n in fixed or n in reduced or readers.get(n, 0) < 2 \
                            or rounds >= MAX_ROUNDS:  # the last sweep is the plan: no new reductions
                        continue
                    a_n = attrs[n]
                    if a_n is not None and a_n.partial and not (set(a_n.partial) <= set(r_attr.partial)):
                        # a partial tensor this op needs reduced: reduce it once, after its
                        # producer, so every reader shares the one reduction
                        reduced[n] = r_attr
                        attrs[n] = r_attr
                        grew = True
            ties = tied.get(i, {})
            for v, a in zip(c.op.outputs, res.outputs):
                for n, x in zip(flat_refs(v), _flat_attrs(a)):
                    if n is not None and x is not None and n not in fixed:
                        attrs[n] = held_attr(ties[n]) if n in ties else \
                            reduced[n] if n in reduced and x.partial else x
            if progress is not None and i % 256 == 0:
                progress(i, total)
        if rounds >= MAX_ROUNDS:
            break
        filled = grew
        by_sweep: set[str] = set()  # filled in this sweep: an earlier consumer's answer wins
        for i in range(len(calls) - 1, -1, -1):
            c = calls[i]
            if c.bwd is None:
                continue
            unknown = [n for n in c.op.input_names() if attrs[n] is None or n in by_sweep]
            if not unknown or all(attrs[n] is None for n in c.op.output_names()):
                continue
            res = run(i, c, True)
            ins = dict(zip([p.name for p in c.bwd.params if p.is_tensor], res.inputs))
            for p, v in c.op.inputs.items():
                for n, x in zip(flat_refs(v), _flat_attrs(ins.get(p))):
                    if n is not None and x is not None and (attrs[n] is None or n in by_sweep):
                        if attrs[n] != x:
                            attrs[n] = x
                            filled = True
                        by_sweep.add(n)
        if progress is not None:
            progress(len(calls), total)
        if not filled:
            break
    # -- the plan: the last forward sweep's answers against what the producers made
    for n, t in program.tensors.items():
        if attrs[n] is None:
            attrs[n] = TensorDistAttr.replicated(mesh, len(t.shape))
    final: dict[str, TensorDistAttr] = {n: a for n, a in attrs.items() if a is not None}
    final.update(store)
    made: dict[str, TensorDistAttr] = dict(final)  # what each tensor's producer gives
    op_plans: list[OpPlan] = []
    held: dict[str, TensorDistAttr] = dict(fixed)
    reshards: list[Reshard] = []
    seen: dict[tuple[str, TensorDistAttr, str], Reshard] = {}

    def reshard(name: str, src: TensorDistAttr, dst: TensorDistAttr, i: int, output: bool) -> Reshard:
        p = plan_of(name, src, dst)
        key = (name, dst, program.ops[i].phase if name in store else "")  # stored: gathered again per phase
        prev = seen.get(key)
        r = Reshard(name, src, dst, i, output, p, shared=prev is not None and not output)
        if prev is None:
            seen[key] = r
        reshards.append(r)
        return r

    for i, c in enumerate(calls):
        got = results[i]
        res = got if got is not None else run(i, c, False)
        op_plan = OpPlan(i, c.op, {}, {}, [])
        tparams = [p.name for p in c.fwd.params if p.is_tensor]
        for p, req in zip(tparams, res.inputs):
            v = c.op.inputs.get(p)
            if v is None:
                continue
            refs = flat_refs(v)
            reqs = _flat_attrs(req)
            op_plan.given[p] = tuple(None if n is None else made[n] for n in refs) if isinstance(v, tuple) \
                else made[v]
            op_plan.required[p] = req
            for n, r_attr in zip(refs, reqs):
                if n is None or r_attr is None:
                    continue
                if made[n] != r_attr:
                    op_plan.reshards.append(reshard(n, made[n], r_attr, i, False))
        ties = tied.get(i, {})
        for v, a in zip(c.op.outputs, res.outputs):
            op_plan.outputs.append(a)
            for n, x in zip(flat_refs(v), _flat_attrs(a)):
                if n is None or x is None:
                    continue
                if n in ties:  # an in-place output: held as the tensor it overwrites
                    target = made[ties[n]]
                    if target != x:
                        op_plan.reshards.append(reshard(n, x, target, i, True))
                        held[n] = target
                    made[n] = final[n] = target
                elif n in fixed and fixed[n] != x:
                    op_plan.reshards.append(reshard(n, x, fixed[n], i, True))
                    made[n] = fixed[n]
                elif n in reduced and x.partial and reduced[n] != x:
                    op_plan.reshards.append(reshard(n, x, reduced[n], i, True))
                    made[n] = final[n] = held[n] = reduced[n]
                else:
                    made[n] = x
                    final[n] = x
        op_plans.append(op_plan)
    return Plan(program, mesh, final, op_plans, reshards, held, rounds, cost, dict(store))


__all__ = ["MAX_ROUNDS", "propagate"]
