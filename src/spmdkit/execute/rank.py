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
:data:`TOLERANCES`); every planned reshard runs as real collectives over the mesh dim's process group,
step by step as :func:`spmdkit.core.reshard.plan_reshard` lays it out: ``all_reduce``,
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
local launcher (:mod:`spmdkit.execute.launch`) ends every rank when one fails, dies or stops.

Limits: the executor needs every sharded axis to split evenly over its mesh dims (the
collectives exchange equal chunks; :func:`uneven_shards` says which does not, and
:func:`run_rank` refuses such a plan before any collective). Every rank times each phase
(compute, comm) and the report sets it beside the plan's prediction (:func:`predicted_timing`).

Launch: ``spmdkit run --model tiny-llama --mesh dp=2,tp=2 --nproc 4`` starts four local
processes; under ``torchrun`` (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) each process
runs its rank directly, so the same command scales to several machines.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from spmdkit.core.dist_attr import ReduceType, TensorDistAttr
from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.core.reshard import Step, local_bytes, plan_reshard
from spmdkit.cost.compute import kernel_collectives
from spmdkit.cost.devices import cost_model, load_device, recost
from spmdkit.cost.step import estimate_step
from spmdkit.execute.launch import free_port, launch_local, port_in_use, uneven_shards
from spmdkit.program.plan import Plan
from spmdkit.sim.mesh import AssembleError, arrays_close, assemble, max_abs_error, nonfinite_count, shard
from spmdkit.sim.plan import flat_values, loss_name, op_io, source_values, unusable
from spmdkit.sim.reference import Ctx

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
    #: the largest max|spmdkit - torch| / scale over the compared tensors (a gradient's relative
    #: L2 error where torch's own half-precision step was given)
    max_rel_error: float = 0.0
    #: the largest relative L2 error of torch's own half-precision step's gradients against its
    #: float32 ones (0 if not run): twice it (at least ``rtol``) bounds the half-precision comparison
    native_error: float = 0.0
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
    #: the loss tensor (found by its role: :func:`spmdkit.sim.plan.loss_name`)
    loss_tensor: str | None = None
    #: assembled global values of the tensors asked for (``run_rank(keep=...)``)
    values: dict[str, np.ndarray] = field(default_factory=dict)
    #: the comparison with torch eager (``run_rank(eager=...)``), None where not asked for
    eager: EagerCheck | None = None
    #: the kernels the ranks ran ("numpy" float64 references, or "torch" in the program's dtypes)
    kernels: str = "numpy"
    #: the untimed steps run before the timed one (0: the times include first-call overhead)
    warmup: int = 0
    #: --kernels torch: the largest error of a tensor as a fraction of its scale (:func:`_check_torch`)
    max_rel_error: float = 0.0
    #: seconds per phase (forward, backward, optimizer: compute, comm) and of the step (wall),
    #: the slowest rank's
    timing: dict[str, dict[str, float]] = field(default_factory=dict)
    #: the plan's prediction of the same (:func:`predicted_timing`) and the device it is for
    predicted: dict[str, dict[str, float]] = field(default_factory=dict)
    predicted_on: str = ""

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
        collective over the mesh dim's group, or the local slice / to_partial."""
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
            dist.all_reduce(t, op=_OPS[rt], group=g)
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
            _reduce_scatter(res, inp, op=_OPS[rt], group=g)
            out = res.movedim(0, ax)
            if rt == ReduceType.AVG:
                out = out / n
        elif st.kind == "all_gather":
            ax = st.tensor_axis
            assert ax is not None
            loc = a.movedim(ax, 0).contiguous()
            res = torch.empty((n * loc.shape[0], *loc.shape[1:]), dtype=loc.dtype, device=loc.device)
            _all_gather(res, loc, group=g)
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
            from spmdkit.execute.kernels import check_kernels

            check_kernels(prog)
        rng = np.random.default_rng(seed + 1)
        local: dict[str, Any] = {}
        made = self.made
        made.clear()
        for n, v in source_values(prog, seed, self.values).items():  # same order and draws as the simulator
            made[n] = plan.attrs[n]
            piece = shard(v, plan.attrs[n], rng)[self.rank]
            local[n] = _to_torch(piece, prog.tensors[n].dtype, self.device) if torch_kernels else piece
        moved: dict[tuple[str, TensorDistAttr, str], Any] = {}
        stored = plan.storage
        phase = [""]  # the running op's phase: a ZeRO-3 parameter is gathered again in each
        step = self.step_t if torch_kernels else self.step

        def move(n: str, dst: TensorDistAttr | None) -> Any:
            src = made[n]
            if dst is None or src == dst:
                return local[n]
            key = (n, dst, phase[0] if n in stored else "")
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
            if torch_kernels:
                outs = flat_values(_run_torch(op_plan.op, io, args, ctx))
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
                local[o] = _as_dtype(outs[k], prog.tensors[o].dtype) if torch_kernels else np.asarray(outs[k])
                made[o] = io.out_attrs[k]
                fixed = plan.annotations.get(o)
                if fixed is not None and fixed != made[o]:
                    t3 = self._clock()
                    local[o] = move(o, fixed)
                    slot["comm"] += self._clock() - t3
                    made[o] = fixed
                outputs[o] = local[o]
        timing["step"] = {"wall": self._clock() - t_start}
        return outputs


class TorchComm:
    """``Ctx.comm`` for torch kernels: all-reduces torch tensors over a rank's mesh-dim groups."""

    def __init__(self, rank: Rank) -> None:
        self.rank = rank

    def all_reduce(self, t: torch.Tensor, mesh_dims: tuple[int, ...], op: str) -> torch.Tensor:
        return self.rank.all_reduce_t(t, mesh_dims, op)


#: the executors' kernels: spmdkit's numpy references in float64, or torch's ops in the program's dtypes
KERNELS = ("numpy", "torch")


def _to_torch(a: np.ndarray, dtype: str, device: torch.device) -> torch.Tensor:
    """A numpy source piece as a torch tensor of the program's dtype on ``device``."""
    from spmdkit.execute.kernels import DTYPES

    t = torch.from_numpy(np.array(a, copy=True, order="C"))
    return t.to(device=device, dtype=DTYPES.get(dtype, t.dtype))


def _as_dtype(v: Any, dtype: str) -> torch.Tensor:
    """A kernel's output in its tensor's program dtype."""
    from spmdkit.execute.kernels import DTYPES

    t = v if isinstance(v, torch.Tensor) else torch.as_tensor(v)
    want = DTYPES.get(dtype)
    return t.detach() if want is None or t.dtype == want else t.detach().to(want)


def _run_torch(op: Any, io: Any, args: dict[str, Any], ctx: Ctx) -> tuple[Any, ...]:
    from spmdkit.execute.kernels import NoTorchKernelError, get_kernel, run_kernel

    kernel = get_kernel(op.rule)
    if kernel is None:
        raise NoTorchKernelError(f"op {op.name}: rule {op.rule} has no torch kernel; run with --kernels numpy")
    with torch.no_grad():
        return run_kernel(io.ref, kernel, args, ctx)


def to_numpy(t: Any) -> np.ndarray:
    """A torch tensor (or array) as numpy: half types widened to float32 (exactly)."""
    if not isinstance(t, torch.Tensor):
        return np.asarray(t)
    t = t.detach().cpu()
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()
    out: np.ndarray = t.numpy()
    return out


def _global_step(plan: Plan, seed: int, values: dict[str, Any] | None = None, kernels: str = "numpy",
                 device: torch.device | None = None) -> dict[str, np.ndarray]:
    """The single-process run: the unsharded step on global arrays, with the same kernels as
    the distributed run (torch's in the program's dtypes on ``device``, or numpy's in float64)."""
    prog = plan.program
    if kernels == "torch":
        return {n: to_numpy(v) for n, v in global_step_torch(plan, seed, values, device)[0].items()}
    glob: dict[str, Any] = dict(source_values(prog, seed, values))
    out: dict[str, np.ndarray] = {}
    for op_plan in plan.ops:
        io = op_io(op_plan, prog)
        args = io.values(lambda n, req: glob[n])
        with np.errstate(all="ignore"):
            gouts = flat_values(io.ref.run(args, Ctx(plan.mesh, None, None, io.in_attrs, io.shapes, io.out_ndims,
                                                   io.out_attrs)))
        for k, o in enumerate(io.out_refs):
            if o is not None and k < len(gouts) and gouts[k] is not None:
                glob[o] = out[o] = np.asarray(gouts[k])
    return out


def _fetch(glob: dict[str, Any], feed: dict[str, Any], prog: Any, dev: torch.device, n: str, req: Any) -> Any:
    v = feed.get(n)
    return glob[n] if v is None else _to_torch(np.asarray(v), prog.tensors[n].dtype, dev)


#: grad ops whose derivative steps (a ReLU's mask): a forward value within rounding of the step
#: flips the derivative between two runs that sum in different orders, so the single-process
#: check runs them on the distributed run's forward operand (which is itself checked)
#: (the maxima and minima too: which element is the largest can flip the same way)
STEP_GRADS = frozenset({"relu_grad", "relu6_grad", "leaky_relu_grad", "hardtanh_grad", "hardsigmoid_grad",
                        "hardswish_grad", "hardshrink_grad", "clip_grad", "abs_grad", "thresholded_relu_grad",
                        "elu_grad", "selu_grad", "celu_grad", "maximum_grad", "minimum_grad", "fmax_grad",
                        "fmin_grad", "max_grad", "min_grad", "amax_grad", "amin_grad", "reduce_max_grad",
                        "reduce_min_grad"})


def global_step_torch(plan: Plan, seed: int = 0, values: dict[str, Any] | None = None,
                      device: torch.device | None = None, optimizer_inputs: dict[str, Any] | None = None,
                      step_inputs: dict[str, Any] | None = None,
                      ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The unsharded step with torch kernels in the program's dtypes (one process, ``device``,
    CPU by default): (every tensor the step makes, seconds per phase). ``optimizer_inputs``
    (name -> global array): what the optimizer-phase ops read instead of this run's own values
    (the distributed run's gradients, so that its updates are checked on the same gradients).
    ``step_inputs`` (name -> global array): what the grad ops of :data:`STEP_GRADS` read for
    their forward-phase operands (the distributed run's, so that both take the same mask)."""
    from spmdkit.execute.kernels import check_kernels

    prog = plan.program
    check_kernels(prog)
    dev = device or torch.device("cpu")
    glob: dict[str, Any] = {n: _to_torch(v, prog.tensors[n].dtype, dev)
                            for n, v in source_values(prog, seed, values).items()}
    out: dict[str, torch.Tensor] = {}
    secs: dict[str, float] = {}
    sync = dev.type == "cuda"
    for op_plan in plan.ops:
        io = op_io(op_plan, prog)
        feed: dict[str, Any] = {}
        if optimizer_inputs is not None and op_plan.op.phase == "optimizer":
            feed = optimizer_inputs
        elif step_inputs is not None and op_plan.op.rule in STEP_GRADS:
            feed = step_inputs
        args = io.values(partial(_fetch, glob, feed, prog, dev))
        t0 = time.perf_counter()
        gouts = flat_values(_run_torch(op_plan.op, io, args, Ctx(plan.mesh, None, None, io.in_attrs, io.shapes,
                                                                io.out_ndims, io.out_attrs)))
        if sync:
            torch.cuda.synchronize(dev)
        ph = op_plan.op.phase
        secs[ph] = secs.get(ph, 0.0) + time.perf_counter() - t0
        for k, o in enumerate(io.out_refs):
            if o is not None and k < len(gouts) and gouts[k] is not None:
                glob[o] = out[o] = _as_dtype(gouts[k], prog.tensors[o].dtype)
    return out, secs


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
    :func:`eager_reference`; each such tensor, assembled from the ranks, must be finite and
    within ``eager_rtol`` of torch's (:class:`EagerCheck`).

    ``kernels``: "numpy" (float64 references, every tensor within ``rtol`` / ``atol`` of the
    single-process run) or "torch" (torch's ops in the program's dtypes; the single-process run
    with the same kernels and dtypes, each tensor within :data:`TOLERANCES` of its dtype,
    :func:`_check_torch`). Either way the report carries the seconds per phase
    (:attr:`RunReport.timing`, the slowest rank's) and the plan's prediction of them on
    ``predict_on`` (a device preset; default: this GPU's, else h100); ``warmup`` untimed steps
    run first (torch's first calls initialise its kernels and allocators), their collectives
    not recorded. ``phase``: called with "warm-up", "step", "checking" as the run gets there
    (the launcher's progress line)."""
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
    me = Rank(mesh, rank, device, plan, timeout, values, kernels)
    say = phase or (lambda _: None)
    if warmup > 0:
        say("warm-up")
    for _ in range(max(0, warmup)):
        me.run(seed)
        me.record.clear()
        me.kernel_record.clear()
    say("step")
    outputs = me.run(seed)
    if kernels == "torch":
        outputs = {n: to_numpy(v) for n, v in outputs.items()}
    pieces: list[Any] = [None] * world if rank == 0 else []
    dist.gather_object((outputs, me.record, me.timing), pieces if rank == 0 else None, dst=0)
    if rank != 0:
        return None
    say("checking")
    rep = RunReport(world, backend)
    rep.kernels = kernels
    rep.warmup = max(0, warmup)
    rep.timing = _slowest([p[2] for p in pieces])
    try:
        rep.predicted, rep.predicted_on = predicted_timing(plan, predict_on or _this_gpu(device))
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
    assembled: dict[str, np.ndarray] = {}
    if kernels == "torch":
        assembled = _check_torch(rep, plan, pieces, me, seed, values, device)
        eager_rtol = max(eager_rtol, TOLERANCES.get(program_dtype(plan.program), eager_rtol))
        ref: dict[str, np.ndarray] = {}
    else:
        ref = _global_step(plan, seed, values)
    loss = rep.loss_tensor = loss_name(plan.program)
    want = set(keep)
    eager_ref: dict[str, np.ndarray] = {}
    eager_dtype, eager_error = "", ""
    eager_native: dict[str, np.ndarray] | None = None
    if eager is not None:
        try:
            got_eager = eager()
            eager_dtype, eager_ref = got_eager[0], got_eager[1]
            eager_native = got_eager[2] if len(got_eager) > 2 else None
        except Exception as exc:  # torch could not run the module: a failure of the check, said as such
            eager_error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
        want |= set(eager_ref)
    rep.values.update({n: v for n, v in assembled.items() if n in want})
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
        rep.eager = _compare_eager(rep, eager_dtype, eager_ref, loss, eager_rtol,
                                   native=eager_native if kernels == "torch" else None)
        if eager_error:
            rep.eager.failures.append(("torch eager", f"could not run the module: {eager_error}"))
        rep.failures.extend(rep.eager.failures)
    return rep


#: ``--kernels torch``: the largest error a tensor may have against the single-process step with
#: the same kernels and dtypes, as a fraction of its scale (the largest magnitude of the
#: single-process value, at least :data:`FLOOR` of the largest of its kind: a gradient that is
#: zero in exact arithmetic is rounding noise). Sharding changes the order of sums (a
#: row-parallel matmul's partial products, a gradient's all-reduce), so two runs agree to the
#: rounding of the dtype, compounded over the step: about 10x the largest error measured on the
#: zoo's tiny models and the 12 tiny HF models (float32 3.1e-6, float16 2.2e-3; bfloat16 2x its
#: 2.8e-2), docs/torch.md.
TOLERANCES = {"float64": 1e-9, "float32": 3e-5, "float16": 1e-2, "bfloat16": 6e-2}
FLOOR = 1e-2


def program_dtype(prog: Any) -> str:
    """The dtype a program trains in: its parameters' floating dtype (float32 when it has none)."""
    for t in prog.tensors.values():
        if t.kind == "parameter" and t.dtype in TOLERANCES:
            return str(t.dtype)
    return "float32"


def _check_torch(rep: RunReport, plan: Plan, pieces: list[Any], me: Rank, seed: int,
                 values: dict[str, Any] | None, device: torch.device) -> dict[str, np.ndarray]:
    """``--kernels torch``: every tensor of the step, assembled from the ranks, against the
    single-process step with the same torch kernels in the same dtypes (on rank 0's device).
    The optimizer's updates are recomputed there from the distributed run's gradients (Adam's
    first step is ``lr * sign(g)``: a gradient element within rounding of zero may flip, so its
    update is checked on the gradient the ranks really had; the gradient itself is checked like
    every other tensor). Each tensor within :data:`TOLERANCES` of its dtype or of the program's
    (its parameters'), whichever is looser; integers and
    booleans exactly; a NaN, or an infinity the reference does not have at the same place,
    never passes. Returns the assembled values."""
    prog = plan.program
    loss = rep.loss_tensor = loss_name(prog)
    base = TOLERANCES.get(program_dtype(prog), 0.0)

    def tolerance(name: str) -> float:  # a float32 upcast in a bfloat16 model carries bfloat16's error
        return max(TOLERANCES.get(prog.tensors[name].dtype, 0.0), base)

    assembled: dict[str, np.ndarray] = {}
    for name, attr in me.made.items():
        if name not in pieces[0][0]:
            continue
        tol = tolerance(name)
        try:
            assembled[name] = assemble([p[0][name] for p in pieces], attr, prog.tensors[name].shape,
                                       rtol=tol, atol=tol)
        except (AssembleError, KeyError) as exc:
            rep.failures.append((name, f"not distributed as {attr}: {exc}"))
    made_by: dict[str, str] = {n: op.phase for op in prog.ops for n in op.output_names()}
    feed = {n: assembled[n] for op in prog.ops if op.phase == "optimizer" for n in op.input_names()
            if n in assembled and made_by.get(n) not in (None, "optimizer")}
    masks = {n: assembled[n] for op in prog.ops if op.rule in STEP_GRADS for n in op.input_names()
             if n in assembled and made_by.get(n) == "forward"}
    ref_t, _ = global_step_torch(plan, seed, values, device, optimizer_inputs=feed, step_inputs=masks)
    ref = {n: to_numpy(v) for n, v in ref_t.items()}
    largest: dict[str, float] = {}
    for n, g in ref.items():
        if g.dtype.kind == "f" and g.size:
            fin = np.isfinite(g)
            if fin.any():
                k = prog.tensors[n].kind
                largest[k] = max(largest.get(k, 0.0), float(np.max(np.abs(g[fin]))))
    worst = 0.0
    for name, g in ref.items():
        if name not in me.made:
            continue
        rep.checked += 1
        got = assembled.get(name)
        if got is None:
            continue  # a failure above
        bad_ref = unusable(prog, name, g, loss)
        if bad_ref:  # a reference that is NaN or infinite proves nothing: never a pass
            rep.nonfinite += 1
            rep.failures.append((name, f"not checkable: the single-process value has {bad_ref} non-finite values "
                                       f"of {g.size}"))
            continue
        if got.shape != g.shape:
            rep.failures.append((name, f"shape {list(got.shape)}, the single-process run's {list(g.shape)}"))
            continue
        if g.dtype.kind != "f" or got.dtype.kind != "f":
            if not np.array_equal(got, g):
                rep.failures.append((name, "differs from the single-process run (exact: integers or booleans)"))
            continue
        both = np.isfinite(g) & np.isfinite(got)
        bad_got = int(np.count_nonzero(~both & (got != g)))  # -inf where the reference has -inf is equal
        if bad_got:
            rep.nonfinite += 1
            rep.failures.append((name, f"{bad_got} non-finite values of {got.size} where the single-process "
                                       f"value is finite"))
            continue
        if not g.size or not both.any():
            continue
        err = float(np.max(np.abs(got[both].astype(np.float64) - g[both])))
        rep.max_error = max(rep.max_error, err)
        scale = max(float(np.max(np.abs(g[both]))), FLOOR * largest.get(prog.tensors[name].kind, 0.0))
        rel = err / scale if scale > 0 else (0.0 if err == 0 else math.inf)
        worst = max(worst, rel)
        tol = tolerance(name)
        if rel > tol:
            d = got[both].astype(np.float64) - g[both]
            rms = float(np.linalg.norm(d) / max(float(np.linalg.norm(g[both])), 1e-300))
            rep.failures.append((name, f"differs from the single-process run: max error {err:.3g} is {rel:.3g} of "
                                       f"its scale {scale:.3g} (tolerance {tol:g}); "
                                       f"{int(np.count_nonzero(np.abs(d) > tol * scale))} of {d.size} elements beyond, "
                                       f"relative L2 error {rms:.3g}"))
    rep.max_rel_error = worst
    if loss is not None and loss in ref:
        rep.reference_loss = float(np.asarray(ref[loss], dtype=np.float64).sum())
        if loss in assembled:
            rep.loss = float(np.asarray(assembled[loss], dtype=np.float64).sum())
    return assembled


def _slowest(timings: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per phase and kind, the slowest rank's seconds (a step is as slow as its slowest rank)."""
    out: dict[str, dict[str, float]] = {}
    for t in timings:
        for ph, kinds in t.items():
            slot = out.setdefault(ph, {})
            for k, v in kinds.items():
                slot[k] = max(slot.get(k, 0.0), float(v))
    return out


def _this_gpu(device: torch.device) -> str:
    """The device preset of this GPU (by its name), else h100."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).upper()
        mem = torch.cuda.get_device_properties(device).total_memory
        if "H200" in name:
            return "h200"
        if "H100" in name:
            return "h100"
        if "A100" in name:
            return "a100-80gb" if mem > 60 * 2**30 else "a100-40gb"
    return "h100"


def predicted_timing(plan: Plan, device_name: str) -> tuple[dict[str, dict[str, float]], str]:
    """The plan's prediction of the step on ``device_name`` (a device preset or JSON), per phase
    as the executor runs it: compute (roofline time of the ops), comm (each reshard's
    collectives in the phase of the op that needs them, and the collectives inside kernels),
    all serial (the executor overlaps nothing). Returns (seconds, the device's name)."""
    dev = load_device(device_name)
    timed = recost(plan, cost_model(plan.mesh, dev))
    est = estimate_step(timed, dev)
    prog = plan.program
    out: dict[str, dict[str, float]] = {}
    for ph, v in est.compute_s.items():
        if ph in ("forward", "backward", "optimizer"):
            out.setdefault(ph, {"compute": 0.0, "comm": 0.0})["compute"] = v
    for r in timed.reshards:
        if r.shared:
            continue
        ph = prog.ops[r.op_index].phase
        out.setdefault(ph, {"compute": 0.0, "comm": 0.0})["comm"] += r.plan.time_s
    for k in kernel_collectives(timed):
        ph = prog.ops[k.op_index].phase
        out.setdefault(ph, {"compute": 0.0, "comm": 0.0})["comm"] += k.time_s
    total = sum(v["compute"] + v["comm"] for v in out.values())
    out["step"] = {"wall": total}
    return out, dev.name


def _compare_eager(rep: RunReport, dtype: str, ref: dict[str, np.ndarray], loss: str | None,
                   rtol: float, native: dict[str, np.ndarray] | None = None) -> EagerCheck:
    """The distributed step's loss and gradients against torch eager's (float32) autograd: each
    tensor's max error within ``rtol`` of its scale. With ``native`` (torch's own step of a
    float16 / bfloat16 module in its dtype, :func:`eager_reference`): a ReLU input within the
    half dtype's rounding of zero takes the other side of the mask than in float32 and the
    gradient behind it moves (T5), in torch's own half-precision step as in spmdkit's, so a
    gradient is compared by its relative L2 error, within ``rtol`` or twice torch's own
    half-precision step's largest (over the step's gradients), whichever is larger (NaNs and
    shapes as always). The sharding itself
    is checked elementwise against the single-process step in the program's dtype
    (:func:`_check_torch`)."""
    chk = EagerCheck(dtype, rtol)
    if loss is not None and loss in ref:
        chk.loss = float(np.asarray(ref[loss], dtype=np.float64).sum())
    # a gradient that is zero in exact arithmetic (attention's key bias: softmax ignores a
    # per-query constant) is torch's rounding noise: scales stop at a thousandth of the step's
    # largest gradient
    grads = [float(np.max(np.abs(np.asarray(w, dtype=np.float64)))) for n, w in ref.items()
             if n != loss and np.size(w)]
    floor = 1e-3 * max(grads, default=0.0)

    def rel_l2(g: np.ndarray, w: np.ndarray) -> float:  # the norm stops at the floor's, like the scale
        return float(np.linalg.norm(g - w)) / max(float(np.linalg.norm(w)), floor * math.sqrt(w.size), 1e-300)

    if native is not None:  # torch's own half-precision step against its float32 one, over the gradients
        for name, want in ref.items():
            own_w = native.get(name)
            if name != loss and own_w is not None and np.shape(own_w) == np.shape(want) and np.size(want):
                own = rel_l2(np.asarray(own_w, dtype=np.float64), np.asarray(want, dtype=np.float64))
                if math.isfinite(own):  # torch's own half step overflowing gives no budget
                    chk.native_error = max(chk.native_error, own)
    budget = max(rtol, 2 * chk.native_error)
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
        if native is not None and name != loss and w.size:
            l2 = rel_l2(g, w)
            chk.max_rel_error = max(chk.max_rel_error, l2)
            if l2 > budget:
                chk.failures.append((name, f"torch eager: relative L2 error {l2:.3g}, beyond rtol {rtol:g} and "
                                           f"twice the largest of torch's own half-precision step, "
                                           f"{chk.native_error:.3g} (max error {err:.3g}, {rel:.3g} of its scale)"))
            continue
        chk.max_rel_error = max(chk.max_rel_error, rel)
        if rel > rtol:
            chk.failures.append((name, f"torch eager: max error {err:.3g} is {rel:.3g} of its scale {scale:.3g} "
                                       f"(rtol {rtol:g})"))
    return chk


def eager_reference(prog: Any, module: Any, args: Any = (), kwargs: dict[str, Any] | None = None,
                    native: bool = False, _dtype: Any = None) -> tuple[Any, ...]:
    """torch eager's training step of ``module`` (an :class:`~spmdkit.models.torch_import.ImportedProgram`'s
    module, called as it was imported): the loss and every parameter's gradient by torch
    autograd, keyed by ``prog``'s tensor names (``prog.loss``, ``prog.grads[param]``). A
    float64 module runs in float64, any other in a float32 copy (a bfloat16 / float16 model on
    its rounded weights: the numpy run computes in float64 and does not round at casts).
    Returns (the dtype torch ran in, the values); with ``native`` and a float16 / bfloat16
    module, a third item: the same values from torch's own step in the module's dtype (how far
    torch's half-precision step is from its float32 one: the error budget of the comparison)."""
    import copy

    from spmdkit.models.torch_import import hf_call_kwargs

    pl = getattr(prog, "loss", None)
    if not isinstance(pl, str):
        raise ProgramError("torch eager: the program has no loss (import it with training=True)")
    outs = list(getattr(prog, "outputs", []))
    if pl not in outs:
        raise ProgramError(f"torch eager: the loss {pl!r} is not an output of the module")
    p0 = next(iter(module.parameters()), None)
    if native and p0 is not None and p0.dtype in (torch.float16, torch.bfloat16):
        own = eager_reference(prog, module, args, kwargs, native=False, _dtype=p0.dtype)[1]
        return (*eager_reference(prog, module, args, kwargs), own)
    dt = _dtype or (torch.float64 if p0 is not None and p0.dtype == torch.float64 else torch.float32)
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
        out = m(*cast(tuple(args)), **cast(hf_call_kwargs(m, kwargs)))
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
    same = "all within" if rep.kernels == "torch" else "all equal"  # torch: to each dtype's rounding
    verdict = same if not differ else f"{len(differ)} differ (first: {differ[0][0]})"
    if rep.nonfinite:
        verdict += f"; {rep.nonfinite} hold NaN or infinite values"
    if rep.kernels == "torch":
        dt = sorted({d for d in TOLERANCES})
        lines.append(f"{rep.checked} tensors compared with the single-process step on the same torch kernels and "
                     f"dtypes (loss, every gradient, every update on the distributed gradients, every activation; "
                     f"ReLU-type grads on the distributed forward values): "
                     f"max error {rep.max_rel_error:.3g} of a tensor's scale (tolerance "
                     + ", ".join(f"{d} {TOLERANCES[d]:g}" for d in dt if d != "float64")
                     + f"), max abs error {rep.max_error:.3g}, {verdict}")
    else:
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
        how = (f"largest relative L2 error of a gradient {e.max_rel_error:.3g} (within rtol {e.rtol:g} or twice "
               f"torch's own half-precision step's largest, {e.native_error:.3g})" if e.native_error else
               f"max error {e.max_rel_error:.3g} of each tensor's largest magnitude (rtol {e.rtol:g}; gradients: at "
               "least a thousandth of the largest gradient)")
        lines.append(f"{head} {e.checked} tensors compared (the loss and every parameter gradient): {how}, "
                     + ("all within, every value finite" if not bad else f"{bad} NOT within or not finite"))
    lines.extend(format_timing(rep))
    for name, why in rep.failures[:20]:
        lines.append(f"  {name}: {why}")
    return "\n".join(lines)


def fmt_time(s: float) -> str:
    """Seconds down to nanoseconds (a tiny model's predicted op takes a few)."""
    for unit, f in (("s", 1.0), ("ms", 1e3), ("us", 1e6)):
        if s * f >= 1:
            return f"{s * f:.2f} {unit}"
    return f"{s * 1e9:.1f} ns"


def format_timing(rep: RunReport) -> list[str]:
    """The step's seconds per phase (the slowest rank's) beside the plan's prediction."""
    if not rep.timing:
        return []
    kern = "torch kernels" if rep.kernels == "torch" else "numpy float64 references"
    first = ("" if rep.kernels != "torch" else
             "; no warm-up: includes torch's first-call overhead, --warmup 1 to exclude it" if not rep.warmup
             else f"; after {rep.warmup} untimed step{'s' if rep.warmup > 1 else ''}")
    out = [f"time per phase ({kern}, slowest rank{first}; predicted: the plan on {rep.predicted_on or '?'}, "
           "serial):"]
    out.append(f"  {'phase':<10} {'compute':>10} {'predicted':>10} {'comm':>10} {'predicted':>10}")
    for ph in ("forward", "backward", "optimizer"):
        m = rep.timing.get(ph)
        if m is None:
            continue
        pr = rep.predicted.get(ph, {})
        out.append(f"  {ph:<10} {fmt_time(m.get('compute', 0.0)):>10} {fmt_time(pr.get('compute', 0.0)):>10} "
                   f"{fmt_time(m.get('comm', 0.0)):>10} {fmt_time(pr.get('comm', 0.0)):>10}")
    wall = rep.timing.get("step", {}).get("wall")
    if wall is not None:
        out.append(f"  step       {fmt_time(wall):>10} (predicted {fmt_time(rep.predicted.get('step', {}).get('wall', 0.0))})")
    return out


__all__ = ["Collective", "EagerCheck", "Rank", "RunReport", "eager_reference", "expected_collectives", "format_report", "free_port",
           "init_from_env", "launch_local", "port_in_use", "run_rank", "uneven_shards"]
