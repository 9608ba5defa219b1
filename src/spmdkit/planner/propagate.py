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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel, ReshardPlan, merge_groups, plan_reshard
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import unpartial
from spmdkit.engine.cache_keys import UNCACHEABLE, value_key
from spmdkit.engine.facts import facts_of
from spmdkit.engine.memo import gc_paused, memo_enabled
from spmdkit.engine.registry import get_rule, is_reverse, output_params
from spmdkit.planner.fuse import infer_fused
from spmdkit.program.ir import Op, Program, flat_refs, layout_args
from spmdkit.program.plan import OpPlan, Plan, Reshard

MAX_ROUNDS = 4


def _flat_attrs(v: Any) -> list[Any]:
    return list(v) if isinstance(v, tuple) else [v]


class _Specs:
    """DistTensorSpec per (shape, dist attr), built once: a spec is a function of the two alone,
    so the repeated layers of a model share theirs."""

    def __init__(self, prog: Program, mesh: ProcessMesh) -> None:
        self.shapes = {n: t.shape for n, t in prog.tensors.items()}
        self.mesh = mesh
        self._cache: dict[tuple[tuple[int, ...], TensorDistAttr | None], DistTensorSpec] = {}

    def get(self, name: str, attr: TensorDistAttr | None) -> DistTensorSpec:
        shape = self.shapes[name]
        key = (shape, attr)
        s = self._cache.get(key)
        if s is None:
            s = DistTensorSpec(shape, attr if attr is not None else TensorDistAttr.replicated(self.mesh, len(shape)))
            self._cache[key] = s
        return s


#: per rule name: (the rule, per mode its params as (name, is tensor, required, default), the
#: reverse rule's params bound to the op's outputs); read once per rule, not per op
_RULE_PARAMS: dict[str, tuple[Any, ...]] = {}


def _rule_params(name: str) -> tuple[Any, ...]:
    got = _RULE_PARAMS.get(name)
    if got is None:
        rule = get_rule(name)
        bwd = rule.backward if is_reverse(rule) else None
        got = _RULE_PARAMS[name] = (
            rule, tuple((p.name, p.is_tensor, p.required, p.default) for p in rule.forward.params),
            None if bwd is None else tuple((p.name, p.is_tensor, p.required, p.default) for p in bwd.params),
            output_params(rule))
    return got


def _layout(op: Op, rule: Any, params: tuple[Any, ...], bound: Mapping[str, Any],
            shapes: Mapping[str, tuple[int, ...]]) -> tuple[list[tuple[str, Any]], tuple[str, ...], Any]:
    """(the layout :func:`spmdkit.program.ir.op_layout` gives, the tensor names it reads in
    argument order, its signature): what a rule call depends on besides its tensors' dist attrs
    (the rule, the mode, each tensor's shape where the op has one, each attribute's typed value);
    None where an attribute cannot be keyed exactly (such an op's calls are not memoised)."""
    layout: list[tuple[str, Any]] = []
    names: list[str] = []
    sig: list[Any] | None = [op.rule, params]
    attrs = op.attrs
    for name, is_tensor, required, default in params:
        if is_tensor:
            v = bound.get(name)
            if isinstance(v, (list, tuple)):
                layout.append(("vec", v))
                names.extend(n for n in v if n is not None)
                if sig is not None:
                    sig.append(tuple(None if n is None else shapes[n] for n in v))
            else:
                layout.append(("t", v))
                if v is not None:
                    names.append(v)
                if sig is not None:
                    sig.append(None if v is None else (shapes[v],))
            continue
        if name in attrs:
            a = attrs[name]
        elif required:
            raise ProgramError(f"op {op.name or op.rule}: missing attribute {name!r} of rule {rule.name}")
        else:
            a = default
        layout.append(("a", a))
        if sig is not None:
            k = value_key(a)
            if k is UNCACHEABLE:
                sig = None
            else:
                sig.append((k,))
    return layout, tuple(names), None if sig is None else tuple(sig)


class _OpCall:
    """An op's rule and how to lay out its arguments (computed once per op): its input and output
    names, per tensor parameter the names it binds, and the signature its rule calls are
    memoised by (:func:`_layout`)."""

    __slots__ = ("bwd", "bwd_layout", "bwd_names", "bwd_sig", "bwd_tparams", "fwd", "fwd_layout", "fwd_names",
                 "fwd_sig", "in_items", "in_slots", "names", "op", "out_slots", "outs", "tparams")
    fwd_names: tuple[str, ...]
    bwd_names: tuple[str, ...]
    fwd_sig: Any  # the signature, then (interned by _Propagation) its number; None: not memoised
    bwd_sig: Any

    def __init__(self, op: Op, shapes: Mapping[str, tuple[int, ...]]) -> None:
        rule, fparams, bparams, out_params = _rule_params(op.rule)
        self.op = op
        self.fwd = rule.forward
        self.bwd = rule.backward if bparams is not None else None
        refs = {p: list(v) if isinstance(v, (list, tuple)) else [v] for p, v in op.inputs.items()}
        self.in_items = list(refs.items())
        self.names = [n for r in refs.values() for n in r if n is not None]
        self.out_slots = [list(v) if isinstance(v, (list, tuple)) else [v] for v in op.outputs]
        self.outs = [n for r in self.out_slots for n in r if n is not None]
        self.fwd_layout, self.fwd_names, self.fwd_sig = _layout(op, rule, fparams, op.inputs, shapes)
        self.tparams = [p[0] for p in fparams if p[1]]
        # per forward tensor parameter the op binds: (its position among the rule's tensor params, its names)
        self.in_slots = [(j, refs[p]) for j, p in enumerate(self.tparams) if op.inputs.get(p) is not None]
        if bparams is None:
            self.bwd_layout, self.bwd_names, self.bwd_sig, self.bwd_tparams = None, (), None, []
        else:
            bound = dict(op.inputs)
            for name, v in zip(out_params, op.outputs):
                bound[name] = v
            self.bwd_layout, self.bwd_names, self.bwd_sig = _layout(op, rule, bparams, bound, shapes)
            self.bwd_tparams = [p[0] for p in bparams if p[1]]


def _program_calls(program: Program) -> tuple[list[_OpCall], dict[str, int]]:
    """(every op's :class:`_OpCall`, a signature entering a memo key as a small int; per tensor
    how many ops read it)."""
    shapes = {n: t.shape for n, t in program.tensors.items()}
    calls = [_OpCall(op, shapes) for op in program.ops]
    ids: dict[tuple[Any, ...], int] = {}
    for c in calls:
        if c.fwd_sig is not None:
            c.fwd_sig = ids.setdefault(c.fwd_sig, len(ids))
        if c.bwd_sig is not None:
            c.bwd_sig = ids.setdefault(c.bwd_sig, len(ids))
    readers: dict[str, int] = {}
    for c in calls:
        for read in set(c.names):
            readers[read] = readers.get(read, 0) + 1
    return calls, readers


def _choice_calls(program: Program) -> dict[int, list[_OpCall]]:
    """Per op whose rule declares a ``choice`` fact (an attribute the planner sets,
    :mod:`spmdkit.engine.facts`): the op's calls under each other value of that attribute (made
    once per program: ``Program.derived``)."""
    shapes = {n: t.shape for n, t in program.tensors.items()}
    out: dict[int, list[_OpCall]] = {}
    choices = {r: facts_of(get_rule(r).name).choice for r in {op.rule for op in program.ops}}
    for i, op in enumerate(program.ops):
        ch = choices[op.rule]
        if ch is not None:
            name, values = ch
            alts = [_OpCall(replace(op, attrs={**op.attrs, name: v}), shapes) for v in values
                    if v != op.attrs.get(name, values[0])]
            if alts:
                out[i] = alts
    return out


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


@gc_paused
def propagate(
    program: Program,
    mesh: ProcessMesh,
    annotations: Mapping[str, Any] | None = None,
    cost: CostModel | None = None,
    progress: Callable[[int, int], None] | None = None,
    storage: Mapping[str, Any] | None = None,
    grad_accum: int = 1,
    groups: Sequence[tuple[int, ...]] = (),
) -> Plan:
    """Every tensor's dist attr and the reshards of ``program`` on ``mesh``; ``groups``: tuples of
    mesh dims whose consecutive collectives of one kind run as one over all of them (besides
    those annotated as one co-shard: context parallelism's gradient reduction over dp x cp, a
    dense one over dp x cp x ep with ep; :func:`spmdkit.core.reshard.merge_groups`); ``annotations``:
    tensor name -> TensorDistAttr (or a dims_mapping list) that never changes; ``storage``:
    tensor -> the dist attr it is stored in, gathered to its (annotated) dist attr before the
    forward and the backward readers (ZeRO-3); ``grad_accum``: the plan's gradient
    accumulation (:attr:`spmdkit.program.plan.Plan.grad_accum`; it changes no dist attr).
    ``progress(done, total)`` is called as the sweeps go."""
    prop = _Propagation(program, mesh, annotations, cost, storage)
    if groups:
        prop.groups = sorted({*prop.groups, *(tuple(int(d) for d in g) for g in groups)})
    results, rounds = prop.sweeps(progress)
    return prop.plan(results, rounds, grad_accum)


class _Propagation:
    """The state of one propagation: the dist attrs found so far and the rule calls."""

    def __init__(self, program: Program, mesh: ProcessMesh, annotations: Mapping[str, Any] | None,
                 cost: CostModel | None, storage: Mapping[str, Any] | None) -> None:
        self.program = program
        self.mesh = mesh
        self.fixed = _parse_annotations(program, mesh, annotations)
        self.store = _parse_annotations(program, mesh, storage, "storage")
        for stored in self.store:
            if program.tensors[stored].kind not in ("parameter", "input", "optimizer_state"):
                raise ProgramError(f"storage for {stored!r}: only a program input (a parameter) can be stored sharded")
        self.cost = cost or CostModel.default(mesh)
        # mesh dims annotated as one co-shard (expert parallelism's batch over (dp, ep)): one
        # group of ranks, whose reductions and gathers run as one collective over both
        self.groups: list[tuple[int, ...]] = sorted({e for a in self.fixed.values() for e in a.dims_mapping
                                                     if isinstance(e, tuple) and len(e) > 1})
        self.attrs: dict[str, TensorDistAttr | None] = {n: None for n in program.tensors}
        self.attrs.update(self.fixed)
        self.specs = _Specs(program, mesh)
        # rule answers by (the call's signature, its tensors' dist attrs): the repeated layers'
        # ops call their rules on equal arguments, answered once (off with the engine's memo
        # tables: spmdkit.ops.set_cache_enabled(False))
        self.answers: dict[tuple[Any, ...], SpmdResult] | None = {} if memo_enabled() else None
        # the ops' calls and how many ops read each tensor: functions of the program alone, made
        # once per program (read only here) and shared by every plan of it
        self.calls, self.readers = program.derived("propagate.calls", _program_calls)
        # ops whose rule has an attribute the planner sets: the calls under its other values, and
        # the one each op's last forward answer came from
        self.alts: dict[int, list[_OpCall]] = program.derived("propagate.choices", _choice_calls)
        self.picked: dict[int, _OpCall] = {}
        # outputs that overwrite one of their op's inputs in place: held in that input's dist attr
        self.tied: dict[int, dict[str, str]] = {}
        for i, c in enumerate(self.calls):
            reads = set(c.names)
            for out_name in c.outs:
                over = program.tensors[out_name].inplace_of
                if over is not None and over in reads and out_name not in self.fixed:
                    self.tied.setdefault(i, {})[out_name] = over
        self.planned: dict[tuple[TensorDistAttr, TensorDistAttr, tuple[int, ...], int], ReshardPlan] = {}
        self.chosen: dict[tuple[Any, ...], SpmdResult] = {}  # repeated layers: one choice per kind of op
        self.reduced: dict[str, TensorDistAttr] = {}  # partial tensors reduced right after their producer
        self.static_keys: dict[int, tuple[Any, ...]] = {}  # per in-place op: its rule, attributes, input shapes

    # -- dist attrs and rule calls

    def plan_of(self, name: str, src: TensorDistAttr, dst: TensorDistAttr) -> ReshardPlan:
        t = self.program.tensors[name]
        key = (src, dst, t.shape, t.itemsize)
        p = self.planned.get(key)
        if p is None:
            p = plan_reshard(src, dst, t.shape, t.itemsize, self.cost)
            if self.groups:
                p = merge_groups(p, self.groups, t.shape, t.itemsize, self.cost)
            self.planned[key] = p
        return p

    def held_attr(self, n: str) -> TensorDistAttr:
        a = self.store[n] if n in self.store else self.attrs[n]
        return a if a is not None else TensorDistAttr.replicated(self.mesh, len(self.program.tensors[n].shape))

    def get(self, n: str) -> DistTensorSpec:
        return self.specs.get(n, self.attrs[n])

    def get_stored(self, n: str) -> DistTensorSpec:  # the optimizer reads a stored tensor as stored
        return self.specs.get(n, self.store[n] if n in self.store else self.attrs[n])

    def run(self, i: int, c: _OpCall, backward: bool) -> SpmdResult:
        """Op ``i``'s forward (or reverse) rule on its tensors as they are now, memoised by
        (signature, dist attrs): an answer is a function of the specs and attributes alone."""
        sig = c.bwd_sig if backward else c.fwd_sig
        answers = self.answers
        if sig is None or answers is None:
            return self._run(i, c, backward)
        attrs, store = self.attrs, self.store
        names = c.bwd_names if backward else c.fwd_names
        key: tuple[Any, ...]
        if store and c.op.phase == "optimizer":
            key = (sig, True, tuple(store[n] if n in store else attrs[n] for n in names))
        else:
            key = (sig, tuple([attrs[n] for n in names]))
        got = answers.get(key)
        if got is None:
            got = answers[key] = self._run(i, c, backward)
        return got

    def _run(self, i: int, c: _OpCall, backward: bool) -> SpmdResult:
        if self.store and c.op.phase == "optimizer":
            try:
                return infer_fused(partial(get_rule(c.op.rule).infer, "backward" if backward else "forward"),
                                   layout_args(c.bwd_layout if backward else c.fwd_layout,  # type: ignore[arg-type]
                                               self.get_stored), self.mesh)
            except SpmdError as exc:
                raise ProgramError(f"op {i} ({c.op.name or c.op.rule}): {type(exc).__name__}: {exc}") from None
        try:
            if backward:
                assert c.bwd is not None and c.bwd_layout is not None
                return infer_fused(get_rule(c.op.rule).infer_backward, layout_args(c.bwd_layout, self.get), self.mesh)
            return infer_fused(get_rule(c.op.rule).infer_forward, layout_args(c.fwd_layout, self.get), self.mesh)
        except SpmdError as exc:
            raise ProgramError(f"op {i} ({c.op.name or c.op.rule}): {type(exc).__name__}: {exc}") from None

    # -- in-place outputs: the cheaper of two layouts

    def price(self, c: _OpCall, res: SpmdResult, targets: Mapping[str, TensorDistAttr]) -> tuple[float, int]:
        """(time, bytes) of the reshards ``res`` needs: its inputs from how they are held, its
        in-place outputs to their targets."""
        t, b = 0.0, 0
        for p, req in zip(c.tparams, res.inputs):
            v = c.op.inputs.get(p)
            if v is None:
                continue
            for n, r_attr in zip(flat_refs(v), _flat_attrs(req)):
                if n is not None and r_attr is not None and self.held_attr(n) != r_attr:
                    rp = self.plan_of(n, self.held_attr(n), r_attr)
                    t, b = t + rp.time_s, b + rp.bytes_per_rank
        for v, a in zip(c.op.outputs, res.outputs):
            for n, x in zip(flat_refs(v), _flat_attrs(a)):
                if n is not None and x is not None and n in targets and targets[n] != x:
                    rp = self.plan_of(n, x, targets[n])
                    t, b = t + rp.time_s, b + rp.bytes_per_rank
        return t, b

    def in_place(self, i: int, c: _OpCall, res: SpmdResult) -> SpmdResult:
        """The cheaper of the forward answer and the layout the in-place outputs ask for."""
        targets = {n: self.held_attr(s) for n, s in self.tied[i].items()}
        if c.bwd is None or c.bwd_layout is None:
            return res
        op = c.op
        tensors, attrs = self.program.tensors, self.attrs
        static = self.static_keys.get(i)
        if static is None:
            static = self.static_keys[i] = (op.rule, repr(sorted(op.attrs.items())),
                                            tuple((tensors[n].shape, tensors[n].itemsize) for n in c.names))
        # what held_attr gives for each input is a function of its dist attr and its stored one
        store = self.store
        key = (static, tuple([attrs[n] for n in c.names]), tuple([store.get(n) for n in c.names]) if store else (),
               tuple([(targets.get(n), attrs[n]) for n in c.outs]), res)
        got = self.chosen.get(key)
        if got is None:
            got = self.chosen[key] = self._choose(c, res, targets)
        return got

    def _choose(self, c: _OpCall, res: SpmdResult, targets: dict[str, TensorDistAttr]) -> SpmdResult:
        assert c.bwd is not None and c.bwd_layout is not None
        specs, attrs, store = self.specs, self.attrs, self.store

        def get_out(n: str) -> DistTensorSpec:
            return specs.get(n, targets[n] if n in targets else attrs[n])

        try:
            back = infer_fused(get_rule(c.op.rule).infer_backward, layout_args(c.bwd_layout, get_out), self.mesh)
            req: dict[str, TensorDistAttr] = {}
            for p, a in zip([p.name for p in c.bwd.params if p.is_tensor], back.inputs):
                v = c.op.inputs.get(p)
                if v is not None:
                    for n, x in zip(flat_refs(v), _flat_attrs(a)):
                        if n is not None and x is not None:
                            req[n] = x

            def get_in(n: str) -> DistTensorSpec:
                return specs.get(n, req[n] if n in req else store[n] if n in store else attrs[n])

            alt = infer_fused(get_rule(c.op.rule).infer_forward, layout_args(c.fwd_layout, get_in), self.mesh)
        except SpmdError:
            return res  # the reverse rule has no answer here: the forward one stands
        return alt if self.price(c, alt, targets) <= self.price(c, res, targets) else res

    # -- an attribute the planner sets: the cheapest answer

    def choose(self, i: int, c: _OpCall, res: SpmdResult) -> SpmdResult:
        """The cheapest of op ``i``'s answers under each value of its rule's ``choice`` attribute,
        by (time, bytes) of the reshards of its inputs from how they are held plus the reduction
        of its partial outputs (the readers reduce them; ties: the op's own value); the call it
        came from is kept for the plan. An input a forward reader gathered is priced again for a
        backward one: the memory model does not hold a reshard's copy to the backward
        (:func:`spmdkit.cost.memory.activation_deltas`), so its reader gathers it again or
        takes the other answer."""
        best, best_cost = (c, res), self.price_reduced(c, res)
        for alt in self.alts[i]:
            got = self.run(i, alt, False)
            cost = self.price_reduced(alt, got)
            if cost < best_cost:
                best, best_cost = (alt, got), cost
        self.picked[i] = best[0]
        return best[1]

    def price_reduced(self, c: _OpCall, res: SpmdResult) -> tuple[float, int]:
        t, b = self.price(c, res, {})
        for v, a in zip(c.op.outputs, res.outputs):
            for n, x in zip(flat_refs(v), _flat_attrs(a)):
                if n is not None and x is not None and x.partial:
                    rp = self.plan_of(n, x, unpartial(x))
                    t, b = t + rp.time_s, b + rp.bytes_per_rank
        return t, b

    # -- the sweeps

    def sweeps(self, progress: Callable[[int, int], None] | None) -> tuple[list[SpmdResult | None], int]:
        """Forward and backward sweeps to the fixed point: (the last forward sweep's answers, rounds)."""
        rounds = 0
        total = len(self.calls) * 2
        while True:
            rounds += 1
            results, grew = self.forward_sweep(rounds, progress, total)
            if rounds >= MAX_ROUNDS:
                break
            filled = self.backward_sweep() or grew
            if progress is not None:
                progress(len(self.calls), total)
            if not filled:
                break
        return results, rounds

    def forward_sweep(self, rounds: int, progress: Callable[[int, int], None] | None,
                      total: int) -> tuple[list[SpmdResult | None], bool]:
        """Every op's forward rule in program order: (its answers, whether a partial tensor was
        newly reduced after its producer)."""
        attrs, fixed, reduced, readers, tied = self.attrs, self.fixed, self.reduced, self.readers, self.tied
        results: list[SpmdResult | None] = []
        grew = False
        last = rounds >= MAX_ROUNDS  # the last sweep is the plan: no new reductions
        for i, c in enumerate(self.calls):
            names = c.names
            if names:
                for n in names:
                    if attrs[n] is not None:
                        break
                else:  # no input has a dist attr yet
                    results.append(None)
                    continue
            res = self.run(i, c, False)
            if i in self.alts:
                res = self.choose(i, c, res)
            if i in tied:
                res = self.in_place(i, c, res)
            results.append(res)
            req_ins = res.inputs
            for j, refs in c.in_slots if not last else ():
                if j >= len(req_ins):
                    break
                for n, r_attr in zip(refs, (r if isinstance(r := req_ins[j], tuple) else (r,))):
                    if n is None or r_attr is None or n in fixed or n in reduced or readers.get(n, 0) < 2:
                        continue
                    a_n = attrs[n]
                    if a_n is not None and a_n.partial and not (set(a_n.partial) <= set(r_attr.partial)):
                        # a partial tensor this op needs reduced: reduce it once, after its
                        # producer, so every reader shares the one reduction
                        reduced[n] = r_attr
                        attrs[n] = r_attr
                        grew = True
            ties = tied.get(i, {})
            for refs, a in zip(c.out_slots, res.outputs):
                for n, x in zip(refs, (a if isinstance(a, tuple) else (a,))):
                    if n is not None and x is not None and n not in fixed:
                        attrs[n] = self.held_attr(ties[n]) if n in ties else \
                            reduced[n] if n in reduced and x.partial else x
            if progress is not None and i % 256 == 0:
                progress(i, total)
        return results, grew

    def backward_sweep(self) -> bool:
        """The reverse rules in reverse order, filling inputs without a dist attr; True when
        one was filled (or changed)."""
        attrs = self.attrs
        filled = False
        by_sweep: set[str] = set()  # filled in this sweep: an earlier consumer's answer wins
        for i in range(len(self.calls) - 1, -1, -1):
            c = self.calls[i]
            if c.bwd is None:
                continue
            if not any(attrs[n] is None or n in by_sweep for n in c.names) or all(attrs[n] is None for n in c.outs):
                continue
            res = self.run(i, c, True)
            ins = dict(zip(c.bwd_tparams, res.inputs))
            for p, refs in c.in_items:
                for n, x in zip(refs, (x0 if isinstance(x0 := ins.get(p), tuple) else (x0,))):
                    if n is not None and x is not None and (attrs[n] is None or n in by_sweep):
                        if attrs[n] != x:
                            attrs[n] = x
                            filled = True
                        by_sweep.add(n)
        return filled

    # -- the plan: the last forward sweep's answers against what the producers made

    def plan(self, results: list[SpmdResult | None], rounds: int, grad_accum: int) -> Plan:
        program, mesh, attrs = self.program, self.mesh, self.attrs
        for n, t in program.tensors.items():
            if attrs[n] is None:
                attrs[n] = TensorDistAttr.replicated(mesh, len(t.shape))
        final: dict[str, TensorDistAttr] = {n: a for n, a in attrs.items() if a is not None}
        final.update(self.store)
        built = _PlanBuilder(self, final)
        op_plans = [built.op_plan(i, self.picked.get(i, c), got if got is not None else self.run(i, c, False))
                    for (i, c), got in zip(enumerate(self.calls), results)]
        return Plan(program, mesh, final, op_plans, built.reshards, built.held, rounds, self.cost, dict(self.store),
                    grad_accum)


class _PlanBuilder:
    """The reshards between what each tensor's producer made and what its readers need."""

    def __init__(self, prop: _Propagation, final: dict[str, TensorDistAttr]) -> None:
        self.prop = prop
        self.final = final
        self.made: dict[str, TensorDistAttr] = dict(final)  # what each tensor's producer gives
        self.held: dict[str, TensorDistAttr] = dict(prop.fixed)
        self.reshards: list[Reshard] = []
        self.seen: dict[tuple[str, TensorDistAttr, str], Reshard] = {}

    def _key(self, name: str, dst: TensorDistAttr, i: int) -> tuple[str, TensorDistAttr, str]:
        prop = self.prop
        return (name, dst, prop.program.ops[i].phase if name in prop.store else "")  # stored: gathered again per phase

    def reshard(self, name: str, src: TensorDistAttr, dst: TensorDistAttr, i: int, output: bool) -> Reshard:
        p = self.prop.plan_of(name, src, dst)
        key = self._key(name, dst, i)
        prev = self.seen.get(key)
        r = Reshard(name, src, dst, i, output, p, shared=prev is not None and not output)
        if prev is None:
            self.seen[key] = r
        self.reshards.append(r)
        return r

    def op_plan(self, i: int, c: _OpCall, res: SpmdResult) -> OpPlan:
        made, final, held = self.made, self.final, self.held
        fixed, reduced = self.prop.fixed, self.prop.reduced
        given: dict[str, Any] = {}
        required: dict[str, Any] = {}
        outputs: list[Any] = []
        reshards: list[Reshard] = []
        for p, req in zip(c.tparams, res.inputs):
            v = c.op.inputs.get(p)
            if v is None:
                continue
            refs = flat_refs(v)
            reqs = _flat_attrs(req)
            given[p] = tuple(None if n is None else made[n] for n in refs) if isinstance(v, tuple) else made[v]
            required[p] = req
            for n, r_attr in zip(refs, reqs):
                if n is None or r_attr is None:
                    continue
                if made[n] != r_attr:
                    reshards.append(self.reshard(n, made[n], r_attr, i, False))
        ties = self.prop.tied.get(i, {})
        for v, a in zip(c.op.outputs, res.outputs):
            outputs.append(a)
            for n, x in zip(flat_refs(v), _flat_attrs(a)):
                if n is None or x is None:
                    continue
                if n in ties:  # an in-place output: held as the tensor it overwrites
                    target = made[ties[n]]
                    if target != x:
                        reshards.append(self.reshard(n, x, target, i, True))
                        held[n] = target
                    made[n] = final[n] = target
                elif n in fixed and fixed[n] != x:
                    # an annotated output the rule makes otherwise, resharded after the op; the op's own
                    # copy is kept, a later reader of that layout shares it (the op's grad: autograd saves
                    # the output its kernel made, as the reshards' copies are kept for their readers)
                    r = self.reshard(n, x, fixed[n], i, True)
                    reshards.append(r)
                    self.seen.setdefault(self._key(n, x, i), r)
                    made[n] = fixed[n]
                elif n in reduced and x.partial and reduced[n] != x:
                    reshards.append(self.reshard(n, x, reduced[n], i, True))
                    made[n] = final[n] = held[n] = reduced[n]
                else:
                    made[n] = x
                    final[n] = x
        return OpPlan(i, c.op, given, required, outputs, reshards)


__all__ = ["MAX_ROUNDS", "propagate"]
