"""``spmdkit plan --verify``: run a plan's whole training step through the simulator (numpy).

The program runs twice on the same float64 data: once unsharded (every op's numpy reference,
``spmdkit.sim``, on global arrays) and once sharded on a simulated mesh: every source tensor
(inputs, parameters, optimizer states) is split as the plan says, every op runs rank by rank
on the local pieces its rule requires, and every planned reshard moves the pieces (assembled
from the producer's dist attr, checking that replicas agree, and split to the consumer's).
Then every tensor the step makes (the loss, each gradient, each updated parameter and
optimizer state, every activation) is assembled from its ranks as the plan says it is
distributed and compared with the unsharded value. A NaN equals nothing: a non-finite value
where the unsharded one is finite is a failure, and so is a tensor whose unsharded value is
itself non-finite (not checkable, never a pass).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.graph.program import Op, Program, _flat
from spmdkit.graph.propagate import Plan
from spmdkit.rules.registry import get_rule
from spmdkit.sim.mesh import AssembleError, _close, assemble, max_abs_error, nonfinite_count, shard
from spmdkit.sim.ops import Ctx, Reference, get_reference


@dataclass
class SimReport:
    """Outcome of :func:`simulate_plan`: ``failures`` lists (tensor, what differed)."""

    checked: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)
    loss: float | None = None

    @property
    def ok(self) -> bool:
        return not self.failures


def _int_bound(prog: Program, name: str) -> int:
    """Valid ids for an integer source tensor: below every consumer's table size."""
    bound = 1 << 30
    for op in prog.ops:
        for p, v in op.inputs.items():
            if v != name:
                continue
            if op.rule in ("embedding", "lookup_table_v2", "embedding_grad", "c_embedding", "c_embedding_grad"):
                w = op.inputs.get("weight")
                if isinstance(w, str):
                    bound = min(bound, prog.tensors[w].shape[0])
            elif p == "label":
                x = op.inputs.get("x") or op.inputs.get("logits") or op.inputs.get("softmax")
                if isinstance(x, str):
                    bound = min(bound, prog.tensors[x].shape[-1])
    return 2 if bound == 1 << 30 else bound


def source_values(prog: Program, seed: int = 0) -> dict[str, np.ndarray]:
    """Global values of the tensors no op produces (float64; ids in range)."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    made = {n for op in prog.ops for n in op.output_names()}
    for t in prog.tensors.values():
        n = t.name
        if n in made or t.inplace_of:
            continue
        shape = t.shape
        if t.dtype.startswith("int"):
            out[n] = rng.integers(0, _int_bound(prog, n), size=shape).astype(np.int64)
        elif n.endswith(".grad") and t.kind == "input":
            out[n] = np.ones(shape)
        elif n == "learning_rate":
            out[n] = np.full(shape, 0.01)
        elif n.endswith("beta1_pow"):
            out[n] = np.full(shape, 0.9)
        elif n.endswith("beta2_pow"):
            out[n] = np.full(shape, 0.999)
        elif n.endswith("moment2"):
            out[n] = rng.uniform(0.01, 0.1, size=shape)
        elif n.endswith("moment1"):
            out[n] = rng.standard_normal(shape) * 0.01
        elif n == "causal_mask":
            s = shape[-1]
            out[n] = np.where(np.tril(np.ones((s, s))) > 0, 0.0, -1e4).reshape(shape)
        elif n in ("rope.sin", "rope.cos"):
            s, d = shape[1], shape[-1]
            inv = 1.0 / (10000 ** (np.arange(0, d, 2) / d))
            f = np.outer(np.arange(s), inv)
            f = np.concatenate([f, f], axis=-1)
            out[n] = (np.sin(f) if n.endswith("sin") else np.cos(f)).reshape(shape)
        elif t.kind == "input" and not shape and not t.dtype.startswith(("int", "uint", "bool")):
            # a 0-D float input is a constant of the step (an epsilon, a scale: torch_import's
            # const_N); a program file does not carry its value, and a negative draw would make
            # rsqrt(mean + eps) NaN, a step nothing can be checked on. Positive, like the real ones.
            out[n] = np.asarray(rng.uniform(0.5, 1.5))
        elif t.kind == "parameter":
            out[n] = rng.standard_normal(shape) * 0.3 + (1.0 if len(shape) == 1 else 0.0)
        else:
            out[n] = rng.standard_normal(shape)
    return out


def _ref(op: Op) -> Reference:
    ref = get_reference(op.rule)
    if ref is None:
        raise ProgramError(f"op {op.name}: the simulator has no reference for rule {op.rule}")
    return ref


def _attrs_of(op: Op) -> dict[str, Any]:
    rule = get_rule(op.rule)
    out: dict[str, Any] = {}
    for p in rule.forward.params:
        if not p.is_tensor:
            v = op.attrs.get(p.name, None if p.required else p.default)
            out[p.name] = list(v) if isinstance(v, tuple) else v
    return out


def _flat_out(vals: Any) -> list[Any]:
    flat: list[Any] = []
    for v in vals:
        if isinstance(v, list):
            flat.extend(v)
        else:
            flat.append(v)
    return flat


@dataclass
class OpIO:
    """What running one planned op needs, whoever runs it (the simulator's global and per-rank
    runs, the torch.distributed executor): its reference, attributes, the dist attr each tensor
    input is required in, the shapes, and its outputs' dist attrs."""

    ref: Reference
    attrs: dict[str, Any]
    inputs: dict[str, Any]  # param -> tensor name, tuple of names (vector) or None
    required: dict[str, Any]
    in_attrs: dict[str, Any]
    shapes: dict[str, Any]
    out_attrs: tuple[Any, ...]
    out_ndims: tuple[int | None, ...]
    out_refs: list[str | None]

    def values(self, fetch: Any) -> dict[str, Any]:
        """The op's arguments: attributes, and ``fetch(name, required_attr)`` per tensor input
        (a list for a vector parameter, None where absent)."""
        out: dict[str, Any] = dict(self.attrs)
        for p, v in self.inputs.items():
            req = self.required.get(p)
            if isinstance(v, tuple):
                reqs = list(req) if isinstance(req, tuple) else [req] * len(v)
                out[p] = [None if n is None else fetch(n, r) for n, r in zip(v, reqs)]
            elif v is None:
                out[p] = None
            else:
                out[p] = fetch(v, req)
        for p in self.ref.tensor_params:
            out.setdefault(p, None)
        return out

    def on_rank(self, per_rank: dict[str, Any], r: int) -> dict[str, Any]:
        """One rank's arguments from :meth:`values` whose fetch returned every rank's pieces."""
        out = dict(self.attrs)
        for p in per_rank:
            if p in self.attrs:
                continue
            v = per_rank[p]
            if isinstance(self.inputs.get(p), tuple):
                out[p] = [None if pc is None else pc[r] for pc in v]
            else:
                out[p] = None if v is None else v[r]
        return out


def op_io(op_plan: Any, prog: Program) -> OpIO:
    op = op_plan.op
    ref = _ref(op)
    in_attrs: dict[str, Any] = {}
    shapes: dict[str, Any] = {}
    for p, v in op.inputs.items():
        req = op_plan.required.get(p)
        if isinstance(v, tuple):
            shapes[p] = [None if n is None else prog.tensors[n].shape for n in v]
            in_attrs[p] = tuple(req) if isinstance(req, tuple) else (req,) * len(v)
        elif v is None:
            shapes[p] = None
        else:
            shapes[p] = prog.tensors[v].shape
            in_attrs[p] = req
    for p in ref.tensor_params:
        shapes.setdefault(p, None)
    out_attrs = tuple(a for v in op_plan.outputs for a in (v if isinstance(v, tuple) else (v,)))
    out_ndims = tuple(a.ndim if isinstance(a, TensorDistAttr) else None for a in out_attrs)
    return OpIO(ref, _attrs_of(op), dict(op.inputs), dict(op_plan.required), in_attrs, shapes, out_attrs,
                out_ndims, [n for v in op.outputs for n in _flat(v)])


def simulate_plan(plan: Plan, seed: int = 0, rtol: float = 1e-7, atol: float = 1e-9) -> SimReport:
    """Run ``plan`` sharded and unsharded and compare every tensor it makes."""
    prog = plan.program
    mesh: ProcessMesh = plan.mesh
    n_ranks = mesh.size
    rng = np.random.default_rng(seed + 1)
    glob: dict[str, Any] = dict(source_values(prog, seed))
    made_attr: dict[str, TensorDistAttr] = {}
    local: dict[str, list[Any]] = {}
    for n, v in glob.items():
        made_attr[n] = plan.attrs[n]
        local[n] = shard(v, plan.attrs[n], rng)
    moved: dict[tuple[str, TensorDistAttr], list[Any]] = {}
    report = SimReport()

    def move(n: str, dst: TensorDistAttr | None) -> list[Any]:
        src = made_attr[n]
        if dst is None or src == dst:
            return local[n]
        key = (n, dst)
        if key not in moved:
            try:
                g = assemble(local[n], src, prog.tensors[n].shape, rtol=rtol, atol=atol)
            except AssembleError as exc:
                raise ProgramError(f"simulate: {n} is not distributed as {src} says: {exc}") from None
            moved[key] = shard(g, dst, rng)
        return moved[key]

    for op_plan in plan.ops:
        op = op_plan.op
        io = op_io(op_plan, prog)
        ref = io.ref
        gargs = io.values(lambda n, req: glob[n])
        sharded = io.values(move)
        largs = [io.on_rank(sharded, r) for r in range(n_ranks)]
        in_attrs, shapes, out_attrs, out_ndims = io.in_attrs, io.shapes, io.out_attrs, io.out_ndims
        with np.errstate(all="ignore"):
            gouts = _flat_out(ref.run(gargs, Ctx(mesh, None, None, in_attrs, shapes, out_ndims, out_attrs)))
        gshapes = tuple(None if o is None else np.shape(o) for o in gouts)
        louts = []
        for r in range(n_ranks):
            ctx = Ctx(mesh, r, mesh.coords(r), in_attrs, shapes, out_ndims, out_attrs, gshapes)
            try:
                with np.errstate(all="ignore"):
                    louts.append(_flat_out(ref.run(largs[r], ctx)))
            except Exception as exc:  # the op cannot run on what this rank holds: the plan is wrong upstream
                report.failures.append((op.output_names()[0] if op.output_names() else op.name,
                                        f"{op.name} fails on rank {r}: {type(exc).__name__}: {exc}"))
                return report
        out_refs = io.out_refs
        for k, o in enumerate(out_refs):
            if o is None or k >= len(gouts) or gouts[k] is None:
                continue
            n = o
            a = out_attrs[k]
            glob[n] = np.asarray(gouts[k])
            local[n] = [np.asarray(louts[r][k]) for r in range(n_ranks)]
            made_attr[n] = a
            fixed = plan.annotations.get(n)
            if fixed is not None and fixed != a:
                local[n] = move(n, fixed)
                made_attr[n] = fixed
            report.checked += 1
            try:
                got = assemble(local[n], made_attr[n], glob[n].shape, rtol=rtol, atol=atol)
            except AssembleError as exc:
                report.failures.append((n, f"after {op.name}: {exc}"))
                continue
            bad_ref = nonfinite_count(glob[n])
            if bad_ref:  # a step whose own value is NaN or infinite proves nothing: never a pass
                report.failures.append((n, f"after {op.name}: not checkable, the unsharded value has {bad_ref} "
                                           f"non-finite values of {glob[n].size}"))
                continue
            if not _close(got, glob[n], rtol, atol):
                bad_got = nonfinite_count(got)
                err = max_abs_error(got, glob[n]) if got.shape == glob[n].shape else float("nan")
                report.failures.append((n, f"after {op.name}: differs from the unsharded value (max error {err:.3g}"
                                           + (f", {bad_got} non-finite values where it is finite)" if bad_got
                                              else ")")))
    if "loss" in glob:
        report.loss = float(np.asarray(glob["loss"]).sum())
    return report


__all__ = ["OpIO", "SimReport", "op_io", "simulate_plan", "source_values"]
