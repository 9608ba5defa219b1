"""The single-process step: the unsharded program on global arrays, what a distributed run is
checked against. With spmdkit's numpy references in float64 (:func:`global_step`,
:func:`run_program`), or with the torch kernels in the program's dtypes (:func:`global_step_torch`,
:func:`run_torch` runs one op's kernel); and the conversions between a rank's numpy pieces and
torch tensors of the program's dtypes."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import numpy as np
import torch

from spmdkit.core.mesh import ProcessMesh
from spmdkit.execute.kernels import DTYPES, NoTorchKernelError, check_kernels, get_kernel, run_kernel
from spmdkit.models.torch_import import Name
from spmdkit.planner.propagate import propagate
from spmdkit.program.ir import Op, Program
from spmdkit.program.plan import Plan
from spmdkit.sim.plan import OpIO, flat_values, op_io, source_values
from spmdkit.sim.reference import Ctx


def to_torch(a: np.ndarray, dtype: str, device: torch.device) -> torch.Tensor:
    """A numpy source piece as a torch tensor of the program's dtype on ``device``."""
    t = torch.from_numpy(np.array(a, copy=True, order="C"))
    return t.to(device=device, dtype=DTYPES.get(dtype, t.dtype))


def as_dtype(v: Any, dtype: str) -> torch.Tensor:
    """A kernel's output in its tensor's program dtype."""
    t = v if isinstance(v, torch.Tensor) else torch.as_tensor(v)
    want = DTYPES.get(dtype)
    return t.detach() if want is None or t.dtype == want else t.detach().to(want)


def run_torch(op: Op, io: OpIO, args: dict[str, Any], ctx: Ctx) -> tuple[Any, ...]:
    """One op's torch kernel on its arguments (torch tensors), without autograd's bookkeeping."""
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


def global_step(plan: Plan, seed: int, values: dict[str, Any] | None = None, kernels: str = "numpy",
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
        fb = getattr(prog, "fallbacks", {}).get(op_plan.index)
        if fb is not None:  # an imported op torch runs itself (float64 here)
            gouts = [None if r is None else r.numpy() for r in call_fallback(fb, lambda n: torch.from_numpy(
                np.asarray(glob[n])))]
        else:
            args = io.values(lambda n, req: glob[n])
            with np.errstate(all="ignore"):
                gouts = flat_values(io.ref.run(args, Ctx(plan.mesh, None, None, io.in_attrs, io.shapes, io.out_ndims,
                                                       io.out_attrs)))
        for k, o in enumerate(io.out_refs):
            if o is not None and k < len(gouts) and gouts[k] is not None:
                glob[o] = out[o] = np.asarray(gouts[k])
    return out


def _fetch(glob: dict[str, Any], feed: dict[str, Any], prog: Program, dev: torch.device, n: str, req: Any) -> Any:
    v = feed.get(n)
    return glob[n] if v is None else to_torch(np.asarray(v), prog.tensors[n].dtype, dev)


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
    prog = plan.program
    check_kernels(prog)
    dev = device or torch.device("cpu")
    glob: dict[str, Any] = {n: to_torch(v, prog.tensors[n].dtype, dev)
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
        fb = getattr(prog, "fallbacks", {}).get(op_plan.index)
        gouts = call_fallback(fb, lambda n: glob[n]) if fb is not None else \
            flat_values(run_torch(op_plan.op, io, args, Ctx(plan.mesh, None, None, io.in_attrs, io.shapes,
                                                            io.out_ndims, io.out_attrs)))
        if sync:
            torch.cuda.synchronize(dev)
        ph = op_plan.op.phase
        secs[ph] = secs.get(ph, 0.0) + time.perf_counter() - t0
        for k, o in enumerate(io.out_refs):
            if o is not None and k < len(gouts) and gouts[k] is not None:
                glob[o] = out[o] = as_dtype(gouts[k], prog.tensors[o].dtype)
    return out, secs


def call_fallback(entry: tuple[Any, Any, Any], value: Callable[[str], torch.Tensor]) -> list[Any]:
    """Run an imported program's replicated fallback op (``prog.fallbacks[i]``: the torch
    callable and its arguments, program tensors as :class:`Name`) on ``value(name)``: its outputs
    (torch tensors; None for a non-tensor output)."""
    fn, args, kwargs = entry

    def sub(v: Any) -> Any:
        if isinstance(v, Name):
            return value(v)
        if isinstance(v, (list, tuple)):
            return type(v)(sub(x) for x in v)
        return v
    with torch.no_grad():
        res = fn(*sub(args), **{k: sub(x) for k, x in kwargs.items()})
    return [r if isinstance(r, torch.Tensor) else None for r in (list(res) if isinstance(res, (list, tuple)) else [res])]


def run_program(prog: Program, values: Mapping[str, Any]) -> dict[str, Any]:
    """Run ``prog`` unsharded on the simulator's numpy references (float64) from ``values``
    (every source tensor); returns every tensor's value. A ``replicated`` fallback op of an
    imported program runs its torch op."""
    mesh = ProcessMesh([1])
    plan = propagate(prog, mesh, {})
    glob: dict[str, Any] = dict(values)
    fallbacks = getattr(prog, "fallbacks", {})
    for op_plan in plan.ops:
        io = op_io(op_plan, prog)
        if op_plan.index in fallbacks:
            got = call_fallback(fallbacks[op_plan.index], lambda n: torch.from_numpy(np.asarray(glob[n])))
            outs: list[Any] = [None if r is None else r.numpy() for r in got]
        else:
            args = io.values(lambda n, req: glob[n])
            ctx = Ctx(mesh, None, None, io.in_attrs, io.shapes, io.out_ndims, io.out_attrs)
            with np.errstate(all="ignore"):
                raw = io.ref.run(args, ctx)
            outs = []
            for v in raw:
                outs.extend(v if isinstance(v, list) else [v])
        for k, o in enumerate(io.out_refs):
            if o is not None and k < len(outs) and outs[k] is not None:
                glob[o] = np.asarray(outs[k])
    return glob


__all__ = ["STEP_GRADS", "as_dtype", "call_fallback", "global_step", "global_step_torch", "run_program", "run_torch", "to_numpy",
           "to_torch"]
