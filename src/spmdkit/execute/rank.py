"""Run a planned training step on torch.distributed: one process per rank (``spmdkit run``).

Each process is one rank of the plan's mesh (gloo on CPU, nccl where GPUs exist). It holds
only its own shards: every source tensor (inputs, parameters, optimizer states) is made alike
in every process (the values given to :func:`run_rank`, else the program's recorded constants
and buffers, else draws from the seed in each tensor's valid range:
:func:`spmdkit.sim.plan.source_values`) and cut to the rank's piece as the plan
distributes it; every op runs on the rank's pieces with spmdkit's numpy reference kernel for
that op (``spmdkit.sim``), in float64 (``kernels="numpy"``), or with torch's own ops in the
program's dtypes on the rank's device (``kernels="torch"``, :mod:`spmdkit.execute.kernels`; the
check is then against a single-process torch step within each dtype's tolerance,
:data:`spmdkit.execute.check.TOLERANCES`); every planned reshard runs as real collectives over the mesh dim's process group,
step by step as :func:`spmdkit.core.reshard.plan_reshard` lays it out: ``all_reduce``,
``reduce_scatter_single``, ``all_gather_single`` (``*_tensor`` before torch 2.13), ``all_to_all_single``, and the local
``slice`` / ``to_partial`` steps.

Every collective a rank issues is recorded (kind, mesh dim, tensor, local element counts) and
checked against the plan's reshards (same kinds, same sizes, same count, same order:
:mod:`spmdkit.execute.collectives`). At the
end rank 0 gathers every tensor the step made, assembles it as the plan says it is
distributed and compares it with a single-process run of the unsharded step
(:mod:`spmdkit.execute.single`, :mod:`spmdkit.execute.check`), and, given a torch module
(``run_rank(eager=...)``, :func:`spmdkit.execute.eager.eager_reference`), the loss and every
parameter gradient with torch eager's autograd on the same inputs and weights
(:class:`~spmdkit.execute.check.EagerCheck`).

A NaN never passes: a non-finite value where the single-process value is finite fails, and so
does a single-process value that is itself non-finite (not checkable). Every process group and
collective waits at most the ``timeout`` given to
:func:`~spmdkit.execute.collectives.init_from_env` / :func:`run_rank`; the
local launcher (:mod:`spmdkit.execute.launch`) ends every rank when one fails, dies or stops.

Limits: the executor needs every sharded axis to split evenly over its mesh dims (the
collectives exchange equal chunks; :func:`spmdkit.execute.launch.uneven_shards` says which does not, and
:func:`run_rank` refuses such a plan before any collective). Every rank times each phase
(compute, comm) and the report sets it beside the plan's prediction
(:func:`spmdkit.execute.report.predicted_timing`).

Launch: ``spmdkit run --model tiny-llama --mesh dp=2,tp=2 --nproc 4`` starts four local
processes; under ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) each process
runs its rank directly, so the same command scales to several machines.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from spmdkit.core.dist_attr import ReduceType, TensorDistAttr
from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import Step, plan_reshard, single_dim_steps
from spmdkit.execute.check import TOLERANCES, RunReport, check_numpy, check_torch, program_dtype
from spmdkit.execute.collectives import (
    COLLECTIVES,
    REDUCE_OPS,
    Collective,
    Groups,
    all_gather,
    expected_collectives,
    reduce_scatter,
)
from spmdkit.execute.eager import compare_eager
from spmdkit.execute.kernels import check_kernels
from spmdkit.execute.launch import uneven_shards
from spmdkit.execute.report import predicted_timing, slowest, this_gpu
from spmdkit.execute.single import as_dtype, call_fallback, global_step, run_torch, to_numpy, to_torch
from spmdkit.program.plan import Plan
from spmdkit.sim.mesh import shard
from spmdkit.sim.plan import flat_values, loss_name, op_io, source_values
from spmdkit.sim.reference import Ctx

#: the executors' kernels: spmdkit's numpy references in float64, or torch's ops in the program's dtypes
KERNELS = ("numpy", "torch")


class Rank:
    """One rank of a mesh on torch.distributed: its process groups, the reshard steps it
    executes on its local pieces (:meth:`step`), a kernel all-reduce (:meth:`all_reduce`, the
    ``Ctx.comm`` hook), and a planned step (:meth:`run`)."""
    def __init__(self, mesh: ProcessMesh, rank: int, device: torch.device, plan: Plan | None = None,
                 timeout: float | None = None, values: dict[str, Any] | None = None, kernels: str = "numpy") -> None:
        if kernels not in KERNELS:
            raise ProgramError(f"spmdkit run: kernels {kernels!r} is not one of {', '.join(KERNELS)}")
        self.plan = plan
        #: "numpy" (spmdkit's float64 references) or "torch" (torch's ops in the program's dtypes)
        self.kernels = kernels
        #: after :meth:`run`: seconds per phase (forward, backward, optimizer) of "compute" (the
        #: ops' kernels) and "comm" (the reshards' collectives and local steps, and the
        #: collectives inside kernels), and "step" (the whole step)
        self.timing: dict[str, dict[str, float]] = {}
        self.kernel_comm_s = 0.0
        #: source values to run on (name -> global array); the rest from :func:`spmdkit.sim.plan.source_values`
        self.values = values
        self.mesh = mesh
        self.rank = rank
        self.device = device
        self.groups = Groups(self.mesh, rank, timeout)
        self.coords = self.groups.coords
        self.record: list[Collective] = []
        self.kernel_record: list[Collective] = []
        #: after :meth:`run`: the dist attr each tensor of the step ended up with
        self.made: dict[str, TensorDistAttr] = {}
        #: after :meth:`run`: each reshard's result as this rank received it, by (tensor, dist attr
        #: it was moved to, the phase for a ZeRO-3 parameter gathered again per phase)
        self.moved: dict[tuple[str, TensorDistAttr, str], Any] = {}
        #: after :meth:`run`: an op's own output kept in the op's layout where the plan reshards it
        #: after the op (an annotated output) and a later reader of that layout shares it (cp
        #: alltoall's head-layout attention output, read by its grad), by the same keys; nothing
        #: moved it, so it is not among :attr:`moved`
        self.kept: dict[tuple[str, TensorDistAttr, str], Any] = {}

    # -- torch <-> numpy
    def _t(self, a: np.ndarray) -> torch.Tensor:
        """A torch copy (collectives work in place; the rank's numpy pieces must stay as they are)."""
        return torch.from_numpy(np.array(a, copy=True, order="C")).to(self.device)

    @staticmethod
    def _n(t: torch.Tensor) -> np.ndarray:
        return t.cpu().numpy()

    def all_reduce_t(self, t: torch.Tensor, mesh_dims: tuple[int, ...], op: str) -> torch.Tensor:
        """A torch kernel's own all-reduce (``Ctx.comm`` of ``--kernels torch``), in the tensor's
        dtype, timed as communication; recorded apart from the plan's reshards."""
        t0 = self._clock()
        out = t.clone().contiguous()
        for d in mesh_dims:
            g = self.groups.of_dim.get(d)
            if g is None:
                continue
            dist.all_reduce(out, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=g)
            self.kernel_record.append(Collective("(kernel)", "all_reduce", d, int(out.numel()), int(out.numel())))
        self.kernel_comm_s += self._clock() - t0
        return out

    def ring_pass_t(self, ts: list[torch.Tensor], mesh_dims: tuple[int, ...]) -> list[torch.Tensor]:
        """A ring kernel's own step (``Ctx.comm.ring_pass``: ring attention's kv blocks): each
        tensor sent to the next rank of the group of ``mesh_dims`` and received from the previous
        one (send / recv), timed as communication and recorded apart from the plan's reshards.
        Over several mesh dims (a sequence co-sharded ``(cp, ep)``: ``ep-from=cp``) the ring runs
        round their ranks in the co-shard's order, major dim first."""
        if not mesh_dims:
            return ts
        d = mesh_dims[0]
        n = 1
        at = 0  # this rank's place in the co-shard: (i_a, i_b, ...) read major first
        coords = list(self.coords)
        for m in mesh_dims:
            n *= self.mesh.shape[m]
            at = at * self.mesh.shape[m] + coords[m]
        if n == 1:
            return ts
        t0 = self._clock()

        def rank_at(i: int) -> int:
            want = list(coords)
            i %= n
            for m in reversed(mesh_dims):
                want[m], i = i % self.mesh.shape[m], i // self.mesh.shape[m]
            return next(r for r in range(self.mesh.size) if list(self.mesh.coords(r)) == want)

        nxt, prv = rank_at(at + 1), rank_at(at - 1)
        outs = [torch.empty_like(t) for t in ts]
        ops = []
        for t, o in zip(ts, outs):
            ops.append(dist.P2POp(dist.isend, t.contiguous(), nxt))
            ops.append(dist.P2POp(dist.irecv, o, prv))
            self.kernel_record.append(Collective("(kernel)", "send_recv", d, int(t.numel()), int(o.numel())))
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        self.kernel_comm_s += self._clock() - t0
        return outs

    def ring_pass(self, arrays: list[np.ndarray], mesh_dims: tuple[int, ...]) -> list[np.ndarray]:
        """:meth:`ring_pass_t` on numpy pieces (``--kernels numpy``)."""
        return [self._n(t) for t in self.ring_pass_t([self._t(np.asarray(a)) for a in arrays], mesh_dims)]

    def _clock(self) -> float:
        """Wall time, after the device's queued work (CUDA runs asynchronously)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _split(self, name: str, a: torch.Tensor, axis: int, n: int) -> list[torch.Tensor]:
        if a.shape[axis] % n:
            raise ProgramError(f"spmdkit run: {name} axis {axis} of local size {a.shape[axis]} does not split "
                               f"evenly over {n} ranks (the executor needs even shards)")
        return list(torch.chunk(a, n, dim=axis))

    def step(self, name: str, st: Step, a: np.ndarray) -> np.ndarray:
        """One reshard step on a numpy piece (``--kernels numpy``): :meth:`step_t` on a torch copy."""
        return self._n(self.step_t(name, st, self._t(a)))

    def step_t(self, name: str, st: Step, a: torch.Tensor) -> torch.Tensor:
        """One reshard step on this rank's local piece (a torch tensor, any dtype): the
        collective over the mesh dim's group, or the local slice / to_partial; a collective over
        several mesh dims as one over each in turn (:func:`single_dim_steps`: the same result)."""
        if len(st.mesh_dims) > 1:
            for sub in single_dim_steps(st):
                a = self.step_t(name, sub, a)
            return a
        d = st.mesh_dims[0]
        n = self.mesh.shape[d]
        g = self.groups.of_dim.get(d)
        c = self.coords[d]
        if st.kind in COLLECTIVES:
            before = int(a.numel())
        if st.kind in COLLECTIVES and n == 1:
            # a one-rank mesh dim: the collective is the identity (no group exists for it; a
            # collective on group None would run over the whole world)
            out = a.clone()
        elif st.kind == "all_reduce":
            rt = ReduceType(st.reduce_type or "sum")
            t = (a.to(torch.float64) if a.dtype == torch.bool else a).clone().contiguous()
            dist.all_reduce(t, op=REDUCE_OPS[rt], group=g)
            if rt == ReduceType.AVG:
                t = t / n
            out = t.to(torch.bool) if a.dtype == torch.bool else t
        elif st.kind == "reduce_scatter":
            rt = ReduceType(st.reduce_type or "sum")
            ax = st.tensor_axis
            assert ax is not None
            chunks = self._split(name, a, ax, n)
            inp = torch.cat([x.movedim(ax, 0) for x in chunks], dim=0).contiguous()
            res = torch.empty_like(chunks[0].movedim(ax, 0).contiguous())
            reduce_scatter(res, inp, op=REDUCE_OPS[rt], group=g)
            out = res.movedim(0, ax)
            if rt == ReduceType.AVG:
                out = out / n
        elif st.kind == "all_gather":
            ax = st.tensor_axis
            assert ax is not None
            loc = a.movedim(ax, 0).contiguous()
            res = torch.empty((n * loc.shape[0], *loc.shape[1:]), dtype=loc.dtype, device=loc.device)
            all_gather(res, loc, group=g)
            out = res.movedim(0, ax)
        elif st.kind == "all_to_all":
            src_ax, dst_ax = st.tensor_axis, st.dst_axis
            assert src_ax is not None and dst_ax is not None
            chunks = self._split(name, a, dst_ax, n)
            inp = torch.cat([x.movedim(src_ax, 0) for x in chunks], dim=0).contiguous()
            res = torch.empty_like(inp)
            dist.all_to_all_single(res, inp, group=g)
            got = torch.chunk(res, n, dim=0)
            out = torch.cat([x.movedim(0, src_ax) for x in got], dim=src_ax)
        elif st.kind == "slice":
            ax = st.tensor_axis
            assert ax is not None
            out = self._split(name, a, ax, n)[c].clone()
        elif st.kind == "to_partial":
            rt = ReduceType(st.reduce_type or "sum")
            if c == 0 or rt in (ReduceType.AVG, ReduceType.MAX, ReduceType.MIN, ReduceType.ALL):
                out = a
            else:
                out = torch.ones_like(a) if rt == ReduceType.PROD else torch.zeros_like(a)
        else:  # pragma: no cover - plan_reshard makes no other kinds
            raise ProgramError(f"spmdkit run: unknown reshard step {st.kind}")
        out = out.contiguous()
        if st.kind in COLLECTIVES:
            self.record.append(Collective(name, st.kind, d, before, int(out.numel())))
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

    def run(self, seed: int) -> dict[str, Any]:
        """Execute the step; the rank's local piece of every tensor the step makes (numpy arrays
        with ``--kernels numpy``, torch tensors in the program's dtypes with ``--kernels torch``).
        Fills :attr:`timing`."""
        plan = self.plan
        if plan is None:
            raise ProgramError("spmdkit run: this rank has no plan to run")
        prog = plan.program
        torch_kernels = self.kernels == "torch"
        if torch_kernels:
            check_kernels(prog)
        rng = np.random.default_rng(seed + 1)
        local: dict[str, Any] = {}
        made = self.made
        made.clear()
        for n, v in source_values(prog, seed, self.values).items():  # same order and draws as the simulator
            made[n] = plan.attrs[n]
            piece = shard(v, plan.attrs[n], rng)[self.rank]
            local[n] = to_torch(piece, prog.tensors[n].dtype, self.device) if torch_kernels else piece
        moved: dict[tuple[str, TensorDistAttr, str], Any] = {}
        kept: dict[tuple[str, TensorDistAttr, str], Any] = {}
        self.moved, self.kept = moved, kept
        stored = plan.storage
        fallbacks = getattr(prog, "fallbacks", None) or {}
        phase = [""]  # the running op's phase: a ZeRO-3 parameter is gathered again in each
        step = self.step_t if torch_kernels else self.step

        def move(n: str, dst: TensorDistAttr | None) -> Any:
            src = made[n]
            if dst is None or src == dst:
                return local[n]
            key = (n, dst, phase[0] if n in stored else "")
            if key in kept:
                return kept[key]
            if key not in moved:
                a = local[n]
                for st in plan_reshard(src, dst, prog.tensors[n].shape, 8, plan.cost).steps:
                    a = step(n, st, a)
                moved[key] = a
            return moved[key]

        timing: dict[str, dict[str, float]] = {}
        self.timing = timing
        comm = TorchComm(self) if torch_kernels else self
        outputs: dict[str, Any] = {}
        t_start = self._clock()
        for op_plan in plan.ops:
            phase[0] = op_plan.op.phase
            slot = timing.setdefault(phase[0], {"compute": 0.0, "comm": 0.0})
            io = op_io(op_plan, prog)
            t0 = self._clock()
            args = io.values(move)
            t1 = self._clock()
            gshapes = tuple(None if o is None else prog.tensors[o].shape for o in io.out_refs)
            ctx = Ctx(self.mesh, self.rank, self.coords, io.in_attrs, io.shapes, io.out_ndims, io.out_attrs,
                      gshapes, comm=comm)
            k0 = self.kernel_comm_s
            fb = fallbacks.get(op_plan.index)
            if fb is not None:  # an imported op with no lowering: replicated, so torch runs it whole
                named = {n: a if torch_kernels else torch.from_numpy(np.asarray(a))
                         for p, v in io.inputs.items() for n, a in _pairs(v, args.get(p))}
                got = call_fallback(fb, named.__getitem__)
                outs = got if torch_kernels else [None if r is None else r.numpy() for r in got]
            elif torch_kernels:
                outs = flat_values(run_torch(op_plan.op, io, args, ctx))
            else:
                with np.errstate(all="ignore"):
                    outs = flat_values(io.ref.run(args, ctx))
            t2 = self._clock()
            inner = self.kernel_comm_s - k0
            slot["comm"] += (t1 - t0) + inner
            slot["compute"] += (t2 - t1) - inner
            for k, o in enumerate(io.out_refs):
                if o is None or k >= len(outs) or outs[k] is None:
                    continue
                local[o] = as_dtype(outs[k], prog.tensors[o].dtype) if torch_kernels else np.asarray(outs[k])
                made[o] = io.out_attrs[k]
                fixed = plan.annotations.get(o)
                if fixed is not None and fixed != made[o]:
                    t3 = self._clock()
                    raw = local[o]
                    local[o] = move(o, fixed)
                    slot["comm"] += self._clock() - t3
                    # the op's own copy, kept for a reader of its layout (shared in the plan: propagate)
                    kept.setdefault((o, made[o], phase[0] if o in stored else ""), raw)
                    made[o] = fixed
                outputs[o] = local[o]
        timing["step"] = {"wall": self._clock() - t_start}
        return outputs


def _pairs(names: Any, vals: Any) -> list[tuple[str, Any]]:
    """(tensor name, its value) of one op parameter (a vector parameter's names and values)."""
    if isinstance(names, tuple):
        return [(n, v) for n, v in zip(names, vals or []) if n is not None]
    return [] if names is None else [(names, vals)]


class TorchComm:
    """``Ctx.comm`` for torch kernels: all-reduces torch tensors over a rank's mesh-dim groups."""
    def __init__(self, rank: Rank) -> None:
        self.rank = rank

    def all_reduce(self, t: torch.Tensor, mesh_dims: tuple[int, ...], op: str) -> torch.Tensor:
        return self.rank.all_reduce_t(t, mesh_dims, op)

    def ring_pass(self, ts: list[torch.Tensor], mesh_dims: tuple[int, ...]) -> list[torch.Tensor]:
        return self.rank.ring_pass_t(ts, mesh_dims)


def run_rank(plan: Plan, seed: int = 0, rtol: float = 1e-5, atol: float = 1e-8,
             timeout: float | None = None, values: dict[str, Any] | None = None, keep: Any = (),
             eager: Callable[[], tuple[Any, ...]] | None = None,
             eager_rtol: float = 1e-5, kernels: str = "numpy", predict_on: str | None = None,
             warmup: int = 0, phase: Callable[[str], None] | None = None) -> RunReport | None:
    """Run this process's rank of ``plan`` (the process group must be initialised, one rank per
    mesh rank; ``timeout``: seconds each mesh-dim group's collectives may wait). Rank 0 returns
    the report; the others None.

    ``values``: source tensor values (name -> global array, the same in every process: e.g.
    :func:`spmdkit.models.torch_import.torch_values` of a module's weights and inputs); the other
    sources come from :func:`spmdkit.sim.plan.source_values` with ``seed``. ``keep``:
    names whose assembled global values the report keeps (``RunReport.values``). ``eager``:
    called on rank 0, returns (dtype name, tensor name -> torch's value), e.g.
    :func:`spmdkit.execute.eager.eager_reference`; each such tensor, assembled from the ranks, must be finite and
    within ``eager_rtol`` of torch's (:class:`~spmdkit.execute.check.EagerCheck`).

    ``kernels``: "numpy" (float64 references, every tensor within ``rtol`` / ``atol`` of the
    single-process run) or "torch" (torch's ops in the program's dtypes; the single-process run
    with the same kernels and dtypes, each tensor within :data:`~spmdkit.execute.check.TOLERANCES` of its dtype,
    :func:`~spmdkit.execute.check.check_torch`). Either way the report carries the seconds per phase
    (:attr:`RunReport.timing`, the slowest rank's) and the plan's prediction of them on
    ``predict_on`` (a device preset; default: this GPU's, else h100); ``warmup`` untimed steps
    run first (torch's first calls initialise its kernels and allocators), their collectives
    not recorded. ``phase``: called with "warm-up", "step", "checking" as the run gets there
    (the launcher's progress line)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    _refuse(plan, world)
    backend = str(dist.get_backend())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if backend == "nccl" \
        else torch.device("cpu")
    me = Rank(plan.mesh, rank, device, plan, timeout, values, kernels)
    say = phase or (lambda _: None)
    pieces = _run_step(me, seed, warmup, say, world)
    if rank != 0:
        return None
    say("checking")
    rep = _report(plan, pieces, me, world, backend, kernels, warmup, predict_on, device)
    assembled: dict[str, np.ndarray] = {}
    if kernels == "torch":
        assembled = check_torch(rep, plan, pieces, me, seed, values, device)
        eager_rtol = max(eager_rtol, TOLERANCES.get(program_dtype(plan.program), eager_rtol))
        ref: dict[str, np.ndarray] = {}
    else:
        ref = global_step(plan, seed, values)
    loss = rep.loss_tensor = loss_name(plan.program)
    eager_dtype, eager_ref, eager_native, eager_error = _call_eager(eager)
    want = set(keep) | set(eager_ref)
    rep.values.update({n: v for n, v in assembled.items() if n in want})
    check_numpy(rep, plan.program, pieces, me.made, ref, want, rtol, atol)
    if eager is not None:
        rep.eager = compare_eager(rep, eager_dtype, eager_ref, loss, eager_rtol,
                                  native=eager_native if kernels == "torch" else None)
        if eager_error:
            rep.eager.failures.append(("torch eager", f"could not run the module: {eager_error}"))
        rep.failures.extend(rep.eager.failures)
    return rep


def _refuse(plan: Plan, world: int) -> None:
    """Every rank refuses alike, before any collective: a world that is not the mesh, a plan whose
    shards do not split evenly (an uneven split would hang in its collective)."""
    if world != plan.mesh.size:
        raise ProgramError(f"spmdkit run: {world} processes for a mesh of {plan.mesh.size} ranks")
    why = uneven_shards(plan)
    if why:
        raise ProgramError(f"spmdkit run: {why}")


def _run_step(me: Rank, seed: int, warmup: int, say: Callable[[str], None], world: int) -> list[Any]:
    """``warmup`` untimed steps (their collectives not recorded), then the step; rank 0 gets every
    rank's (local pieces as numpy, collectives, seconds per phase), the others an empty list."""
    if warmup > 0:
        say("warm-up")
    for _ in range(max(0, warmup)):
        me.run(seed)
        me.record.clear()
        me.kernel_record.clear()
    say("step")
    outputs = me.run(seed)
    received: dict[Any, Any] = {}
    kept: dict[Any, Any] = {}
    if me.kernels == "torch":  # what each op read: the per-op check recomputes it from these
        outputs = {n: to_numpy(v) for n, v in outputs.items()}
        received = {k: to_numpy(v) for k, v in me.moved.items()}  # what a reshard delivered
        kept = {k: to_numpy(v) for k, v in me.kept.items()}  # the ops' own copies: nothing delivered them
    pieces: list[Any] = [None] * world if me.rank == 0 else []
    dist.gather_object((outputs, me.record, me.timing, received, kept), pieces if me.rank == 0 else None, dst=0)
    return pieces


def _report(plan: Plan, pieces: list[Any], me: Rank, world: int, backend: str, kernels: str, warmup: int,
            predict_on: str | None, device: torch.device) -> RunReport:
    """The report's head: the slowest rank's seconds beside the plan's prediction, and every
    rank's collectives against the plan's."""
    rep = RunReport(world, backend)
    rep.kernels = kernels
    rep.warmup = max(0, warmup)
    rep.timing = slowest([p[2] for p in pieces])
    try:
        rep.predicted, rep.predicted_on = predicted_timing(plan, predict_on or this_gpu(device))
    except SpmdError as exc:  # the run's own check stands; the report says why there is no prediction
        rep.predicted_on = f"(no prediction: {exc})"
    rep.expected = expected_collectives(plan)
    rep.collectives = me.record
    records = [p[1] for p in pieces]
    rep.collectives_match = all(r == rep.expected for r in records)
    if not rep.collectives_match:
        bad = next(i for i, r in enumerate(records) if r != rep.expected)
        rep.failures.append(("collectives", f"rank {bad} issued {len(records[bad])} collectives, the plan "
                                            f"{len(rep.expected)}, or they differ in kind or size"))
    return rep


def _call_eager(eager: Callable[[], tuple[Any, ...]] | None
                ) -> tuple[str, dict[str, np.ndarray], dict[str, np.ndarray] | None, str]:
    """torch eager's values (``run_rank(eager=...)``): (dtype, values, torch's own half-precision
    values or None, why torch could not run the module or "")."""
    if eager is None:
        return "", {}, None, ""
    try:
        got = eager()
    except Exception as exc:  # torch could not run the module: a failure of the check, said as such
        return "", {}, None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
    return got[0], got[1], got[2] if len(got) > 2 else None, ""


__all__ = ["KERNELS", "Rank", "TorchComm", "run_rank"]
