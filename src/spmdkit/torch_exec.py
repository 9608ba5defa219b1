"""Run a planned training step on torch.distributed: one process per rank (``spmdkit run``).

Each process is one rank of the plan's mesh (gloo on CPU, nccl where GPUs exist). It holds
only its own shards: every source tensor (inputs, parameters, optimizer states) is made alike
in every process (the values given to :func:`run_rank`, else the program's recorded constants
and buffers, else draws from the seed in each tensor's valid range:
:func:`spmdkit.graph.simulate.source_values`) and cut to the rank's piece as the plan
distributes it; every op runs on the rank's pieces with spmdkit's numpy reference kernel for
that op (``spmdkit.sim``), in float64; every planned reshard runs as real collectives over the mesh dim's process group,
step by step as :func:`spmdkit.reshard.plan_reshard` lays it out: ``all_reduce``,
``reduce_scatter_single``, ``all_gather_single`` (``*_tensor`` before torch 2.13), ``all_to_all_single``, and the local
``slice`` / ``to_partial`` steps.

Every collective a rank issues is recorded (kind, mesh dim, tensor, local element counts) and
checked against the plan's reshards (same kinds, same sizes, same count, same order). At the
end rank 0 gathers every tensor the step made, assembles it as the plan says it is
distributed and compares it with a single-process run of the unsharded step, and, given a
torch module (``run_rank(eager=...)``, :func:`eager_reference`), the loss and every parameter
gradient with torch eager's autograd on the same inputs and weights (:class:`EagerCheck`).

A NaN never passes: a non-finite value where the single-process value is finite fails, and so
does a single-process value that is itself non-finite (not checkable). Every process group and
collective waits at most the ``timeout`` given to :func:`init_from_env` / :func:`run_rank`; the
local launcher (:mod:`spmdkit.launch`) ends every rank when one fails, dies or stops.

Limits: the executor needs every sharded axis to split evenly over its mesh dims (the
collectives exchange equal chunks; :func:`uneven_shards` says which does not, and
:func:`run_rank` refuses such a plan before any collective); the local kernels are numpy references, not torch ops, so
this proves the plan's communication on a real engine, not its speed.

Launch: ``spmdkit run --model tiny-llama --mesh dp=2,tp=2 --nproc 4`` starts four local
processes; under ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) each process
runs its rank directly, so the same command scales to several machines.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from spmdkit.core.dist_attr import ReduceType, TensorDistAttr
from spmdkit.core.errors import ProgramError
from spmdkit.graph.propagate import Plan
from spmdkit.graph.simulate import _flat_out, loss_name, op_io, source_values, unusable
from spmdkit.launch import free_port, launch_local, port_in_use, uneven_shards
from spmdkit.reshard import Step, local_bytes, plan_reshard
from spmdkit.sim.mesh import AssembleError, arrays_close, assemble, max_abs_error, nonfinite_count, shard
from spmdkit.sim.ops import Ctx

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")

# torch >= 2.13 names the tensor collectives *_single (the *_tensor names are deprecated)
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Collective:
    """One collective a rank issued: element counts of its local buffer before and after."""

    tensor: str
    kind: str
    mesh_dim: int
    numel_in: int
    numel_out: int


@dataclass
class EagerCheck:
    """The distributed step against torch eager on the same inputs and weights: the loss and
    every parameter gradient of the module computed by torch autograd (in ``dtype``), every
    value finite, each tensor's max abs error within ``rtol`` of its scale: the largest
    magnitude of torch's tensor, for a gradient at least a thousandth of the step's largest
    gradient (a gradient that is zero in exact arithmetic, as attention's key bias, is
    rounding noise in torch's float32)."""

    dtype: str
    rtol: float
    loss: float | None = None
    checked: int = 0
    #: the largest max|spmdkit - torch| / scale over the compared tensors
    max_rel_error: float = 0.0
    failures: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class RunReport:
    """Rank 0's verdict on a distributed run."""

    world_size: int
    backend: str
    checked: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)
    loss: float | None = None
    reference_loss: float | None = None
    max_error: float = 0.0
    collectives: list[Collective] = field(default_factory=list)
    expected: list[Collective] = field(default_factory=list)
    collectives_match: bool = False
    #: tensors with a NaN or infinity in the distributed or the single-process value (failures)
    nonfinite: int = 0
    #: the loss tensor (found by its role: :func:`spmdkit.graph.simulate.loss_name`)
    loss_tensor: str | None = None
    #: assembled global values of the tensors asked for (``run_rank(keep=...)``)
    values: dict[str, np.ndarray] = field(default_factory=dict)
    #: the comparison with torch eager (``run_rank(eager=...)``), None where not asked for
    eager: EagerCheck | None = None

    @property
    def ok(self) -> bool:
        return not self.failures and self.collectives_match


def expected_collectives(plan: Plan) -> list[Collective]:
    """The collectives the plan's reshards issue on every rank, in program order."""
    out: list[Collective] = []
    ms = plan.mesh.shape
    for rs in plan.reshards:
        if rs.shared:
            continue
        shape = plan.program.tensors[rs.tensor].shape
        for st in rs.plan.steps:
            if st.kind in COLLECTIVES:
                out.append(Collective(rs.tensor, st.kind, st.mesh_dims[0],
                                      local_bytes(st.src.dims_mapping, shape, ms, 1),
                                      local_bytes(st.dst.dims_mapping, shape, ms, 1)))
    return out


class _Groups:
    """One process group per mesh dim and fixed coordinates of the other dims; a group's
    members are ordered by their coordinate along that dim."""

    def __init__(self, mesh: Any, rank: int, timeout: float | None = None) -> None:
        from datetime import timedelta

        self.mesh = mesh
        self.rank = rank
        self.coords = mesh.coords(rank)
        self.of_dim: dict[int, Any] = {}
        for d in range(mesh.ndim):
            keyed: dict[tuple[int, ...], list[int]] = {}
            for r in range(mesh.size):
                c = mesh.coords(r)
                keyed.setdefault(tuple(c[i] for i in range(mesh.ndim) if i != d), []).append(r)
            for key in sorted(keyed):
                members = sorted(keyed[key], key=lambda r: int(mesh.coords(r)[d]))
                # every rank calls new_group; a group's collectives wait at most ``timeout`` seconds
                g = dist.new_group(members, timeout=None if timeout is None else timedelta(seconds=timeout)) \
                    if mesh.shape[d] > 1 else None
                if self.rank in members:
                    self.of_dim[d] = g


_OPS = {ReduceType.SUM: dist.ReduceOp.SUM, ReduceType.AVG: dist.ReduceOp.SUM, ReduceType.MAX: dist.ReduceOp.MAX,
        ReduceType.MIN: dist.ReduceOp.MIN, ReduceType.PROD: dist.ReduceOp.PRODUCT,
        ReduceType.ANY: dist.ReduceOp.MAX, ReduceType.ALL: dist.ReduceOp.MIN}


class Rank:
    """One rank of a mesh on torch.distributed: its process groups, the reshard steps it
    executes on its local pieces (:meth:`step`), a kernel all-reduce (:meth:`all_reduce`, the
    ``Ctx.comm`` hook), and a planned step (:meth:`run`)."""

    def __init__(self, mesh: Any, rank: int, device: torch.device, plan: Plan | None = None,
                 timeout: float | None = None, values: dict[str, Any] | None = None) -> None:
        self.plan = plan
        #: source values to run on (name -> global array); the rest from :func:`source_values`
        self.values = values
        self.mesh = mesh
        self.rank = rank
        self.device = device
        self.groups = _Groups(self.mesh, rank, timeout)
        self.coords = self.groups.coords
        self.record: list[Collective] = []
        self.kernel_record: list[Collective] = []
        #: after :meth:`run`: the dist attr each tensor of the step ended up with
        self.made: dict[str, TensorDistAttr] = {}

    # -- torch <-> numpy
    def _t(self, a: np.ndarray) -> torch.Tensor:
        """A torch copy (collectives work in place; the rank's numpy pieces must stay as they are)."""
        return torch.from_numpy(np.array(a, copy=True, order="C")).to(self.device)

    @staticmethod
    def _n(t: torch.Tensor) -> np.ndarray:
        return t.cpu().numpy()

    def _split(self, name: str, a: np.ndarray, axis: int, n: int) -> list[np.ndarray]:
        if a.shape[axis] % n:
            raise ProgramError(f"spmdkit run: {name} axis {axis} of local size {a.shape[axis]} does not split "
                               f"evenly over {n} ranks (the executor needs even shards)")
        return np.split(a, n, axis=axis)

    def step(self, name: str, st: Step, a: np.ndarray) -> np.ndarray:
        d = st.mesh_dims[0]
        n = self.mesh.shape[d]
        g = self.groups.of_dim.get(d)
        c = self.coords[d]
        if st.kind in COLLECTIVES:
            before = int(a.size)
        if st.kind in COLLECTIVES and n == 1:
            # a one-rank mesh dim: the collective is the identity (no group exists for it; a
            # collective on group None would run over the whole world)
            out = a.copy()
        elif st.kind == "all_reduce":
            rt = ReduceType(st.reduce_type or "sum")
            work = a.astype(np.float64) if a.dtype == np.bool_ else a
            t = self._t(work)
            dist.all_reduce(t, op=_OPS[rt], group=g)
            out = self._n(t)
            if rt == ReduceType.AVG:
                out = out / n
            if a.dtype == np.bool_:
                out = out.astype(np.bool_)
        elif st.kind == "reduce_scatter":
            rt = ReduceType(st.reduce_type or "sum")
            ax = st.tensor_axis
            assert ax is not None
            chunks = self._split(name, a, ax, n)
            inp = self._t(np.concatenate([np.ascontiguousarray(np.moveaxis(x, ax, 0)) for x in chunks], axis=0))
            res = torch.empty_like(self._t(np.moveaxis(chunks[0], ax, 0)))
            _reduce_scatter(res, inp, op=_OPS[rt], group=g)
            out = np.moveaxis(self._n(res), 0, ax)
            if rt == ReduceType.AVG:
                out = out / n
        elif st.kind == "all_gather":
            ax = st.tensor_axis
            assert ax is not None
            loc = self._t(np.moveaxis(a, ax, 0))
            res = torch.empty((n * loc.shape[0], *loc.shape[1:]), dtype=loc.dtype, device=self.device)
            _all_gather(res, loc.contiguous(), group=g)
            out = np.moveaxis(self._n(res), 0, ax)
        elif st.kind == "all_to_all":
            src_ax, dst_ax = st.tensor_axis, st.dst_axis
            assert src_ax is not None and dst_ax is not None
            chunks = self._split(name, a, dst_ax, n)
            inp = self._t(np.concatenate([np.ascontiguousarray(np.moveaxis(x, src_ax, 0)) for x in chunks], axis=0))
            res = torch.empty_like(inp)
            dist.all_to_all_single(res, inp, group=g)
            got = np.split(self._n(res), n, axis=0)
            out = np.concatenate([np.moveaxis(x, 0, src_ax) for x in got], axis=src_ax)
        elif st.kind == "slice":
            ax = st.tensor_axis
            assert ax is not None
            out = np.array(self._split(name, a, ax, n)[c], copy=True)
        elif st.kind == "to_partial":
            rt = ReduceType(st.reduce_type or "sum")
            if c == 0 or rt in (ReduceType.AVG, ReduceType.MAX, ReduceType.MIN, ReduceType.ALL):
                out = a
            else:
                out = np.ones_like(a) if rt == ReduceType.PROD else np.zeros_like(a)
        else:  # pragma: no cover - plan_reshard makes no other kinds
            raise ProgramError(f"spmdkit run: unknown reshard step {st.kind}")
        if st.kind in COLLECTIVES:
            self.record.append(Collective(name, st.kind, d, before, int(out.size)))
        return out

    def all_reduce(self, a: np.ndarray, mesh_dims: tuple[int, ...], op: str) -> np.ndarray:
        """A kernel's own all-reduce (Ctx.comm) over the groups of ``mesh_dims``; recorded apart
        from the plan's reshards."""
        out = np.asarray(a, dtype=np.float64)
        for d in mesh_dims:
            g = self.groups.of_dim.get(d)
            if g is None:
                continue
            t = self._t(out)
            dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=g)
            out = self._n(t)
            self.kernel_record.append(Collective("(kernel)", "all_reduce", d, int(out.size), int(out.size)))
        return out

    def run(self, seed: int) -> dict[str, np.ndarray]:
        """Execute the step; the rank's local piece of every tensor the step makes."""
        plan = self.plan
        if plan is None:
            raise ProgramError("spmdkit run: this rank has no plan to run")
        prog = plan.program
        rng = np.random.default_rng(seed + 1)
        local: dict[str, np.ndarray] = {}
        made = self.made
        made.clear()
        for n, v in source_values(prog, seed, self.values).items():  # same order and draws as the simulator
            made[n] = plan.attrs[n]
            local[n] = shard(v, plan.attrs[n], rng)[self.rank]
        moved: dict[tuple[str, TensorDistAttr, str], np.ndarray] = {}
        stored = plan.storage
        phase = [""]  # the running op's phase: a ZeRO-3 parameter is gathered again in each

        def move(n: str, dst: TensorDistAttr | None) -> np.ndarray:
            src = made[n]
            if dst is None or src == dst:
                return local[n]
            key = (n, dst, phase[0] if n in stored else "")
            if key not in moved:
                a = local[n]
                for st in plan_reshard(src, dst, prog.tensors[n].shape, 8, plan.cost).steps:
                    a = self.step(n, st, a)
                moved[key] = a
            return moved[key]

        outputs: dict[str, np.ndarray] = {}
        for op_plan in plan.ops:
            phase[0] = op_plan.op.phase
            io = op_io(op_plan, prog)
            args = io.values(move)
            gshapes = tuple(None if o is None else prog.tensors[o].shape for o in io.out_refs)
            ctx = Ctx(self.mesh, self.rank, self.coords, io.in_attrs, io.shapes, io.out_ndims, io.out_attrs,
                      gshapes, comm=self)
            with np.errstate(all="ignore"):
                outs = _flat_out(io.ref.run(args, ctx))
            for k, o in enumerate(io.out_refs):
                if o is None or k >= len(outs) or outs[k] is None:
                    continue
                local[o] = np.asarray(outs[k])
                made[o] = io.out_attrs[k]
                fixed = plan.annotations.get(o)
                if fixed is not None and fixed != made[o]:
                    local[o] = move(o, fixed)
                    made[o] = fixed
                outputs[o] = local[o]
        return outputs


def _global_step(plan: Plan, seed: int, values: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
    """The single-process run: the unsharded step on global arrays."""
    prog = plan.program
    glob: dict[str, Any] = dict(source_values(prog, seed, values))
    out: dict[str, np.ndarray] = {}
    for op_plan in plan.ops:
        io = op_io(op_plan, prog)
        args = io.values(lambda n, req: glob[n])
        with np.errstate(all="ignore"):
            gouts = _flat_out(io.ref.run(args, Ctx(plan.mesh, None, None, io.in_attrs, io.shapes, io.out_ndims,
                                                   io.out_attrs)))
        for k, o in enumerate(io.out_refs):
            if o is not None and k < len(gouts) and gouts[k] is not None:
                glob[o] = out[o] = np.asarray(gouts[k])
    return out


def run_rank(plan: Plan, seed: int = 0, rtol: float = 1e-5, atol: float = 1e-8,
             timeout: float | None = None, values: dict[str, Any] | None = None, keep: Any = (),
             eager: Callable[[], tuple[str, dict[str, np.ndarray]]] | None = None,
             eager_rtol: float = 1e-5) -> RunReport | None:
    """Run this process's rank of ``plan`` (the process group must be initialised, one rank per
    mesh rank; ``timeout``: seconds each mesh-dim group's collectives may wait). Rank 0 returns
    the report; the others None.

    ``values``: source tensor values (name -> global array, the same in every process: e.g.
    :func:`spmdkit.torch_import.torch_values` of a module's weights and inputs); the other
    sources come from :func:`spmdkit.graph.simulate.source_values` with ``seed``. ``keep``:
    names whose assembled global values the report keeps (``RunReport.values``). ``eager``:
    called on rank 0, returns (dtype name, tensor name -> torch's value), e.g.
    :func:`eager_reference`; each such tensor, assembled from the ranks, must be finite and
    within ``eager_rtol`` of torch's (:class:`EagerCheck`)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = plan.mesh
    if world != mesh.size:
        raise ProgramError(f"spmdkit run: {world} processes for a mesh of {mesh.size} ranks")
    why = uneven_shards(plan)
    if why:  # every rank refuses alike, before any collective (an uneven split would hang in it)
        raise ProgramError(f"spmdkit run: {why}")
    backend = str(dist.get_backend())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if backend == "nccl" \
        else torch.device("cpu")
    me = Rank(mesh, rank, device, plan, timeout, values)
    outputs = me.run(seed)
    pieces: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object((outputs, me.record), pieces if rank == 0 else None, dst=0)
    if rank != 0:
        return None
    rep = RunReport(world, backend)
    rep.expected = expected_collectives(plan)
    rep.collectives = me.record
    records = [p[1] for p in pieces]
    rep.collectives_match = all(r == rep.expected for r in records)
    if not rep.collectives_match:
        bad = next(i for i, r in enumerate(records) if r != rep.expected)
        rep.failures.append(("collectives", f"rank {bad} issued {len(records[bad])} collectives, the plan "
                                            f"{len(rep.expected)}, or they differ in kind or size"))
    ref = _global_step(plan, seed, values)
    loss = rep.loss_tensor = loss_name(plan.program)
    want = set(keep)
    eager_ref: dict[str, np.ndarray] = {}
    eager_dtype, eager_error = "", ""
    if eager is not None:
        try:
            eager_dtype, eager_ref = eager()
        except Exception as exc:  # torch could not run the module: a failure of the check, said as such
            eager_error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
        want |= set(eager_ref)
    for name, g in ref.items():
        attr = me.made.get(name)
        if attr is None:
            continue
        rep.checked += 1
        try:
            got = assemble([p[0][name] for p in pieces], attr, g.shape, rtol=rtol, atol=atol)
        except (AssembleError, KeyError) as exc:
            rep.failures.append((name, f"not distributed as {attr}: {exc}"))
            continue
        if name in want:
            rep.values[name] = got
        bad_ref = unusable(plan.program, name, g, loss)
        if bad_ref:  # a reference that is NaN or infinite proves nothing: never a pass
            rep.nonfinite += 1
            rep.failures.append((name, f"not checkable: the single-process value has {bad_ref} non-finite values "
                                       f"of {g.size}"))
            continue
        if got.dtype.kind == "f" and got.shape == g.shape and g.size:
            rep.max_error = max(rep.max_error, max_abs_error(got, g))
        bad_got = nonfinite_count(got)
        if bad_got and got.shape == g.shape:  # the reference's -inf (a masked score) at the same place is equal
            bad_got = int(np.count_nonzero(~np.isfinite(got) & (got != g)))
        if bad_got:
            rep.nonfinite += 1
            rep.failures.append((name, f"{bad_got} non-finite values of {got.size} where the single-process "
                                       f"value is finite"))
        elif not arrays_close(got, g, rtol, atol):
            rep.failures.append((name, "differs from the single-process run"))
    if loss is not None and loss in ref and loss in me.made:
        rep.reference_loss = float(np.asarray(ref[loss]).sum())
        try:
            got = assemble([p[0][loss] for p in pieces], me.made[loss], ref[loss].shape, rtol=rtol, atol=atol)
            rep.loss = float(np.asarray(got).sum())
        except (AssembleError, KeyError):
            pass  # already a failure above
    if eager is not None:
        rep.eager = _compare_eager(rep, eager_dtype, eager_ref, loss, eager_rtol)
        if eager_error:
            rep.eager.failures.append(("torch eager", f"could not run the module: {eager_error}"))
        rep.failures.extend(rep.eager.failures)
    return rep


def _compare_eager(rep: RunReport, dtype: str, ref: dict[str, np.ndarray], loss: str | None,
                   rtol: float) -> EagerCheck:
    chk = EagerCheck(dtype, rtol)
    if loss is not None and loss in ref:
        chk.loss = float(np.asarray(ref[loss], dtype=np.float64).sum())
    # a gradient that is zero in exact arithmetic (attention's key bias: softmax ignores a
    # per-query constant) is torch's rounding noise: scales stop at a thousandth of the step's
    # largest gradient
    grads = [float(np.max(np.abs(np.asarray(w, dtype=np.float64)))) for n, w in ref.items()
             if n != loss and np.size(w)]
    floor = 1e-3 * max(grads, default=0.0)
    for name, want in ref.items():
        w = np.asarray(want, dtype=np.float64)
        got = rep.values.get(name)
        if got is None:
            chk.failures.append((name, "torch eager: the distributed step did not make this tensor"))
            continue
        g = np.asarray(got, dtype=np.float64)
        chk.checked += 1
        if g.shape != w.shape:
            chk.failures.append((name, f"torch eager: shape {list(g.shape)}, torch's {list(w.shape)}"))
            continue
        bad = nonfinite_count(g) + nonfinite_count(w)
        if bad:
            chk.failures.append((name, f"torch eager: {nonfinite_count(g)} non-finite values here, "
                                       f"{nonfinite_count(w)} in torch's"))
            continue
        scale = max(float(np.max(np.abs(w))) if w.size else 0.0, 0.0 if name == loss else floor)
        err = float(np.max(np.abs(g - w))) if w.size else 0.0
        rel = err / scale if scale > 0 else (0.0 if err == 0 else math.inf)
        chk.max_rel_error = max(chk.max_rel_error, rel)
        if rel > rtol:
            chk.failures.append((name, f"torch eager: max error {err:.3g} is {rel:.3g} of its scale {scale:.3g} "
                                       f"(rtol {rtol:g})"))
    return chk


def eager_reference(prog: Any, module: Any, args: Any = (), kwargs: dict[str, Any] | None = None,
                    ) -> tuple[str, dict[str, np.ndarray]]:
    """torch eager's training step of ``module`` (an :class:`~spmdkit.torch_import.ImportedProgram`'s
    module, called as it was imported): the loss and every parameter's gradient by torch
    autograd, keyed by ``prog``'s tensor names (``prog.loss``, ``prog.grads[param]``). A
    float64 module runs in float64, any other in a float32 copy (a bfloat16 / float16 model on
    its rounded weights: the numpy run computes in float64 and does not round at casts).
    Returns (the dtype torch ran in, the values)."""
    import copy

    from spmdkit.torch_import import _hf_call

    pl = getattr(prog, "loss", None)
    if not isinstance(pl, str):
        raise ProgramError("torch eager: the program has no loss (import it with training=True)")
    outs = list(getattr(prog, "outputs", []))
    if pl not in outs:
        raise ProgramError(f"torch eager: the loss {pl!r} is not an output of the module")
    p0 = next(iter(module.parameters()), None)
    dt = torch.float64 if p0 is not None and p0.dtype == torch.float64 else torch.float32
    m = module if p0 is None or p0.dtype == dt else copy.deepcopy(module).to(dt)

    def cast(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.detach().to(dt)
        if isinstance(v, (list, tuple)):
            return type(v)(cast(x) for x in v)
        if isinstance(v, dict):
            return {k: cast(x) for k, x in v.items()}
        return v

    m.zero_grad(set_to_none=True)
    with torch.enable_grad():
        out = m(*cast(tuple(args)), **cast(_hf_call(m, kwargs)))
        flat = [v for v in torch.utils._pytree.tree_flatten(out)[0] if isinstance(v, torch.Tensor)]
        if len(flat) != len(outs):
            raise ProgramError(f"torch eager: the module returned {len(flat)} tensors, the program records "
                               f"{len(outs)} outputs")
        lt = flat[outs.index(pl)]
        lt.backward()  # type: ignore[no-untyped-call]
    res: dict[str, np.ndarray] = {pl: lt.detach().double().numpy()}
    named = dict(m.named_parameters(remove_duplicate=False))
    for param, grad in prog.grads.items():
        kind, fqn = prog.sources.get(param, (None, None))
        if kind != "parameter":
            continue
        w = named.get(fqn if fqn in named else str(fqn).removeprefix("module."))
        if w is None:
            raise ProgramError(f"torch eager: the module has no parameter {fqn!r}")
        res[grad] = (w.grad if w.grad is not None else torch.zeros_like(w)).detach().double().numpy()
    m.zero_grad(set_to_none=True)
    return str(dt).removeprefix("torch."), res


def init_from_env(backend: str = "auto", timeout: float = 120.0) -> str:
    """Initialise the default process group from torchrun's environment variables; every
    collective and group of the run waits at most ``timeout`` seconds."""
    from datetime import timedelta

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, init_method="env://", timeout=timedelta(seconds=timeout))
    return backend


def format_report(rep: RunReport, title: str) -> str:
    kinds: dict[str, int] = {}
    for c in rep.collectives:
        kinds[c.kind] = kinds.get(c.kind, 0) + 1
    kind_text = ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())) or "none"
    lines = [f"spmdkit run: {title}; {rep.world_size} processes ({rep.backend})"]
    if rep.loss is not None:
        which = f"tensor {rep.loss_tensor}; " if rep.loss_tensor not in (None, "loss") else ""
        lines.append(f"loss {rep.loss:.12g} ({which}single process {rep.reference_loss:.12g})")
    differ = [f for f in rep.failures if f[0] != "collectives"]
    verdict = "all equal" if not differ else f"{len(differ)} differ (first: {differ[0][0]})"
    if rep.nonfinite:
        verdict += f"; {rep.nonfinite} hold NaN or infinite values"
    lines.append(f"{rep.checked} tensors compared with the single-process step (loss, every gradient, "
                 f"every update, every activation): max abs error {rep.max_error:.3g} where finite, {verdict}")
    lines.append(f"collectives per rank: {len(rep.collectives)} ({kind_text}); plan: {len(rep.expected)}; "
                 + ("every rank's equal the plan's" if rep.collectives_match else "NOT equal to the plan's"))
    if rep.eager is not None:
        e = rep.eager
        head = f"torch eager ({e.dtype or '?'} autograd, same inputs and weights):"
        if e.loss is not None:
            head += f" loss {e.loss:.12g};"
        bad = len(e.failures)
        lines.append(f"{head} {e.checked} tensors compared (the loss and every parameter gradient): max error "
                     f"{e.max_rel_error:.3g} of each tensor's largest magnitude (rtol {e.rtol:g}; gradients: at "
                     "least a thousandth of the largest gradient), "
                     + ("all within, every value finite" if not bad else f"{bad} NOT within or not finite"))
    for name, why in rep.failures[:20]:
        lines.append(f"  {name}: {why}")
    return "\n".join(lines)


__all__ = ["Collective", "EagerCheck", "Rank", "RunReport", "eager_reference", "expected_collectives", "format_report", "free_port",
           "init_from_env", "launch_local", "port_in_use", "run_rank", "uneven_shards"]
