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
itself NaN or infinite (not checkable, never a pass), except -inf in an activation other than
the loss (a masked attention score), which must then be -inf at the same positions.

The source values (:func:`source_values`) respect the program: values given by the caller,
then the values it records (an imported module's constants and buffers), then draws in each
tensor's valid range (:func:`int_roles`: ids below the table they index, labels below the
class count with some ignored, masks as padded 0/1).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.engine.registry import get_rule
from spmdkit.program.ir import Op, Program, RecordedValue, flat_refs
from spmdkit.program.plan import OpPlan, Plan
from spmdkit.sim.mesh import AssembleError, arrays_close, assemble, max_abs_error, nonfinite_count, shard
from spmdkit.sim.reference import Ctx, Reference, get_reference


@dataclass
class SimReport:
    """Outcome of :func:`simulate_plan`: ``failures`` lists (tensor, what differed)."""

    checked: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)
    loss: float | None = None

    @property
    def ok(self) -> bool:
        return not self.failures


#: ops that pass integer values through unchanged (ids and labels keep their meaning)
_PASS = frozenset({"reshape", "reshape2", "flatten", "slice", "strided_slice", "pad", "unsqueeze", "squeeze",
                   "transpose", "expand", "expand_as", "broadcast_to", "concat", "stack", "split", "unbind", "tile",
                   "cast", "where", "assign", "roll", "flip"})
#: ops that index a table with an integer tensor: rule -> (the ids parameter, the table parameter, its axis)
_LOOKUP = {"embedding": ("x", "weight", 0), "lookup_table_v2": ("x", "weight", 0), "c_embedding": ("x", "weight", 0),
           "embedding_grad": ("x", "weight", 0), "c_embedding_grad": ("x", "weight", 0),
           "index_select": ("index", "x", None), "gather": ("index", "x", None),
           "take_along_axis": ("index", "x", None)}
_LOSSES = frozenset({"cross_entropy_with_softmax", "c_softmax_with_cross_entropy", "cross_entropy_with_softmax_grad",
                     "c_softmax_with_cross_entropy_grad", "cross_entropy", "cross_entropy2"})


@dataclass
class IntRole:
    """What an integer or boolean source tensor is, from the ops that read it (through
    reshapes, slices, pads, casts, ``where``): ``bound``, the valid ids are ``[0, bound)``
    (token ids below an embedding's rows, labels below the class count) or None (a mask);
    ``ignore_index``, a loss's ignored label where the value reaches a loss's ``label`` that
    records one, and no lookup reads it unfiltered (a ``where`` in between)."""

    bound: int | None = None
    ignore_index: int | None = None


def _axis_size(prog: Program, op: Op, table: str, axis: int | None) -> int | None:
    t = op.inputs.get(table)
    if not isinstance(t, str) or t not in prog.tensors:
        return None
    shape = prog.tensors[t].shape
    if axis is None:
        axis = int(op.attrs.get("axis", op.attrs.get("dim", 0)) or 0)
    if not shape or not -len(shape) <= axis < len(shape):
        return None
    return shape[axis]


def int_roles(prog: Program) -> dict[str, IntRole]:
    """:class:`IntRole` of every integer or boolean source tensor of ``prog``."""
    readers: dict[str, list[tuple[Op, str]]] = {}
    for op in prog.ops:
        for p, v in op.inputs.items():
            for n in flat_refs(v):
                if n is not None:
                    readers.setdefault(n, []).append((op, p))
    made = {n for op in prog.ops for n in op.output_names()}
    out: dict[str, IntRole] = {}
    for t in prog.tensors.values():
        if t.name in made or t.inplace_of or not t.dtype.startswith(("int", "uint", "bool")):
            continue
        bound: int | None = None
        ignore: int | None = None
        unfiltered_lookup = False
        seen: set[tuple[str, bool]] = set()
        todo = [(t.name, False)]
        while todo:
            name, filtered = todo.pop()
            if (name, filtered) in seen:
                continue
            seen.add((name, filtered))
            for op, p in readers.get(name, ()):
                size: int | None = None
                look = _LOOKUP.get(op.rule)
                if look is not None and p == look[0]:
                    size = _axis_size(prog, op, look[1], look[2])
                    unfiltered_lookup |= not filtered
                elif op.rule == "one_hot" and p == "x" and isinstance(op.attrs.get("num_classes"), int):
                    size = int(op.attrs["num_classes"])
                    unfiltered_lookup |= not filtered
                elif op.rule in _LOSSES and p == "label":
                    x = next((op.inputs.get(k) for k in ("x", "logits", "softmax") if op.inputs.get(k)), None)
                    if isinstance(x, str) and prog.tensors[x].shape:
                        size = prog.tensors[x].shape[int(op.attrs.get("axis", -1))]
                    ii = op.attrs.get("ignore_index")
                    if isinstance(ii, int) and not isinstance(ii, bool) and not 0 <= ii < (size or 0):
                        ignore = ii
                elif op.rule in _PASS and (op.rule != "where" or p in ("x", "y")):
                    for o in op.output_names():
                        if prog.tensors[o].dtype.startswith(("int", "uint")):
                            todo.append((o, filtered or op.rule == "where"))
                if size is not None and size > 0:
                    bound = size if bound is None else min(bound, size)
        out[t.name] = IntRole(bound, None if unfiltered_lookup else ignore)
    return out


def _mask(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A padding mask: ones, the last row's trailing quarter zero (right padding, as a padded
    batch has; every row keeps its first position)."""
    m = np.ones(shape, dtype=dtype)
    if shape and shape[-1] >= 4:
        m[(-1,) * (len(shape) - 1) + (slice(shape[-1] - shape[-1] // 4, None),)] = 0
    return m


def loss_name(prog: Program) -> str | None:
    """The step's loss tensor, by its role: an imported program's ``loss``, else the scalar
    whose gradient seeds the backward (the ``<loss>.grad`` input the autodiff adds), else a
    tensor named ``loss``; None for a step without one."""
    loss = getattr(prog, "loss", None)
    if isinstance(loss, str) and loss in prog.tensors:
        return loss
    made = {n for op in prog.ops for n in op.output_names()}
    for t in prog.tensors.values():
        if t.kind == "input" and t.name.endswith(".grad") and t.name not in made:
            base = t.name[: -len(".grad")]
            if base in made and prog.tensors[base].shape == t.shape == ():
                return base
    return "loss" if "loss" in prog.tensors else None


def recorded_array(v: RecordedValue) -> np.ndarray:
    """A :class:`~spmdkit.program.ir.RecordedValue` as a numpy array (a copy)."""
    return np.frombuffer(v.data, dtype=np.dtype(v.dtype).newbyteorder("<")).reshape(v.shape).astype(v.dtype)


def _as_value(prog: Program, name: str, v: Any, what: str) -> np.ndarray:
    t = prog.tensors[name]
    a = recorded_array(v) if isinstance(v, RecordedValue) else np.array(v, copy=True)
    if a.shape != t.shape:
        raise ProgramError(f"{what} {name!r}: shape {list(a.shape)} is not the tensor's {list(t.shape)}")
    if t.dtype == "bool":
        return a.astype(np.bool_)
    if t.dtype.startswith(("int", "uint")):
        if a.dtype.kind == "f" and not np.array_equal(a, np.round(a)):
            raise ProgramError(f"{what} {name!r}: the tensor is {t.dtype}, the value has fractions")
        return a.astype(np.int64)
    if a.dtype.kind not in "biuf":
        raise ProgramError(f"{what} {name!r}: expected numbers, got dtype {a.dtype}")
    return a.astype(np.float64)


def source_values(prog: Program, seed: int = 0, values: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
    """Global values of the tensors no op produces (floats as float64).

    ``values`` (name -> array-like) are used as given; then the program's recorded values
    (``prog.values``: an imported module's constants and buffers); the rest is drawn from
    ``seed``, each in its valid range (:func:`int_roles`): ids below the table they index,
    labels below the class count with a tenth of them (at least one, never the first) the
    loss's ``ignore_index`` where it records one, masks of ones with the last row right-padded, the loss
    gradient seed ones, optimizer scalars at their usual values, parameters and data random."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    made = {n for op in prog.ops for n in op.output_names()}
    given = dict(values or {})
    for n in given:
        if n not in prog.tensors:
            raise ProgramError(f"source value {n!r}: the program has no such tensor")
        if n in made or prog.tensors[n].inplace_of:
            raise ProgramError(f"source value {n!r}: the step makes this tensor; only source tensors take values")
    recorded = getattr(prog, "values", {}) or {}
    roles = int_roles(prog) if any(t.dtype.startswith(("int", "uint", "bool")) and t.name not in given
                                   and t.name not in recorded for t in prog.tensors.values()) else {}
    for t in prog.tensors.values():
        n = t.name
        if n in made or t.inplace_of:
            continue
        shape = t.shape
        if n in given:
            out[n] = _as_value(prog, n, given[n], "source value")
        elif n in recorded:
            out[n] = _as_value(prog, n, recorded[n], "recorded value")
        elif t.dtype.startswith(("int", "uint", "bool")):
            role = roles.get(n, IntRole())
            if role.bound is None:
                out[n] = _mask(shape, np.bool_ if t.dtype == "bool" else np.int64)
                continue
            ids = rng.integers(0, role.bound, size=shape).astype(np.int64)
            if role.ignore_index is not None and ids.size > 1:  # a tenth (at least one) ignored, the first kept
                drop = rng.choice(np.arange(1, ids.size), max(1, ids.size // 10), replace=False)
                ids.reshape(-1)[drop] = role.ignore_index
            out[n] = ids
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
            # the rows of the positions the tokens hold (context parallelism's zig-zag order)
            pos = recorded_array(recorded["cp.positions"]) if "cp.positions" in recorded else np.arange(s)
            f = np.outer(pos if len(pos) == s else np.arange(s), inv)
            f = np.concatenate([f, f], axis=-1)
            out[n] = (np.sin(f) if n.endswith("sin") else np.cos(f)).reshape(shape)
        elif t.kind == "input" and not shape:
            # a 0-D float input is a constant of the step (an epsilon, a scale: torch_import's
            # const_N) whose value the program does not record; a negative draw would make
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


def flat_values(vals: Any) -> list[Any]:
    """A reference's outputs flattened: a list output (a tensor list slot) spliced in place."""
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


def op_io(op_plan: OpPlan, prog: Program) -> OpIO:
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
    if op.rule == "replicated" and not any(shapes.get("outs") or ()):  # an imported fallback: its outputs' shapes
        shapes["outs"] = [None if n is None else prog.tensors[n].shape for v in op.outputs for n in flat_refs(v)]
    out_attrs = tuple(a for v in op_plan.outputs for a in (v if isinstance(v, tuple) else (v,)))
    if op.rule == "replicated":  # an imported fallback's outputs: replicated (the rule leaves them unset)
        outs = [n for v in op.outputs for n in flat_refs(v)]
        meshes = [a.mesh for v in in_attrs.values() for a in (v if isinstance(v, tuple) else (v,))
                  if isinstance(a, TensorDistAttr)]
        if meshes and len(outs) == len(out_attrs):
            out_attrs = tuple(a if a is not None or n is None else
                              TensorDistAttr(meshes[0], [-1] * len(prog.tensors[n].shape)) for a, n in zip(out_attrs, outs))
    out_ndims = tuple(a.ndim if isinstance(a, TensorDistAttr) else None for a in out_attrs)
    return OpIO(ref, _attrs_of(op), dict(op.inputs), dict(op_plan.required), in_attrs, shapes, out_attrs,
                out_ndims, [n for v in op.outputs for n in flat_refs(v)])


def unusable(prog: Program, name: str, value: Any, loss: str | None = None) -> int:
    """How many values of a reference tensor make it uncheckable: NaN and +inf anywhere; -inf
    too, except in an activation that is not the loss (a masked attention score: HF's masks
    fill with -inf before the softmax; such a value is compared exactly)."""
    x = np.asarray(value)
    if x.dtype.kind not in "fc":
        return 0
    t = prog.tensors.get(name)
    if t is not None and t.kind == "activation" and name != loss:
        return int(x.size - np.count_nonzero(np.isfinite(x) | (x == -np.inf)))
    return nonfinite_count(x)


def simulate_plan(plan: Plan, seed: int = 0, rtol: float = 1e-7, atol: float = 1e-9,
                  values: Mapping[str, Any] | None = None) -> SimReport:
    """Run ``plan`` sharded and unsharded and compare every tensor it makes. ``values``: source
    tensor values to use (name -> array; e.g. :func:`spmdkit.models.torch_import.torch_values` of a
    module's weights and inputs); the other sources as :func:`source_values` makes them."""
    prog = plan.program
    mesh: ProcessMesh = plan.mesh
    n_ranks = mesh.size
    rng = np.random.default_rng(seed + 1)
    glob: dict[str, Any] = dict(source_values(prog, seed, values))
    loss = loss_name(prog)
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
            gouts = flat_values(ref.run(gargs, Ctx(mesh, None, None, in_attrs, shapes, out_ndims, out_attrs)))
        gshapes = tuple(None if o is None else np.shape(o) for o in gouts)
        louts = []
        for r in range(n_ranks):
            ctx = Ctx(mesh, r, mesh.coords(r), in_attrs, shapes, out_ndims, out_attrs, gshapes)
            try:
                with np.errstate(all="ignore"):
                    louts.append(flat_values(ref.run(largs[r], ctx)))
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
            bad_ref = unusable(prog, n, glob[n], loss)
            if bad_ref:  # a step whose own value is NaN or infinite proves nothing: never a pass
                report.failures.append((n, f"after {op.name}: not checkable, the unsharded value has {bad_ref} "
                                           f"non-finite values of {glob[n].size}"))
                continue
            if not arrays_close(got, glob[n], rtol, atol):
                bad_got = nonfinite_count(got)
                err = max_abs_error(got, glob[n]) if got.shape == glob[n].shape else float("nan")
                report.failures.append((n, f"after {op.name}: differs from the unsharded value (max error {err:.3g}"
                                           + (f", {bad_got} non-finite values where it is finite)" if bad_got
                                              else ")")))
    if loss is not None and loss in glob:
        report.loss = float(np.asarray(glob[loss]).sum())
    return report


__all__ = ["IntRole", "OpIO", "SimReport", "flat_values", "int_roles", "loss_name", "op_io", "recorded_array", "simulate_plan",
           "source_values", "unusable"]
