"""Lower bounds that let the outer search (:mod:`spmdkit.planner.search`) leave a configuration
unplanned when it cannot fit or cannot be the fastest (branch and bound).

Both bounds are read off the model once, at full size on one rank (:func:`model_bounds`), and
are lower bounds of what :func:`spmdkit.cost.memory.memory_per_device` and the step models
(:func:`spmdkit.cost.step.estimate_step`, :func:`spmdkit.planner.pipeline.estimate_pipeline`)
give the configuration, under every recomputation mode:

- memory (:meth:`Bounds.memory`): the parameters, their gradients and their optimizer states a
  device must hold, at least at the program's own dtypes (every framework holds as many bytes
  or more: Megatron-LM fp32 main gradients and master weights, torchtitan fp32 parameters),
  each divided by every mesh dim the strategy could shard it over: ``tp`` under megatron (every
  parameter, as if none were replicated), ``ep`` for the expert stacks ``[E, in, out]`` under
  ``ep``, ZeRO's data-parallel ranks (``dp x ep`` for the dense parameters, ``dp`` for the
  experts: EDP) for the optimizer states (zero1+), gradients (zero2+) and parameters (zero3);
  with ``pp`` stages the fullest holds at least their average; plus the CUDA context and one
  NCCL buffer per communicator (:func:`spmdkit.cost.memory.with_overheads`), the activations
  counted as nothing;
- the step (:meth:`Bounds.step`): every op's time is at least its FLOPs at the device's
  tensor-core peak (:meth:`spmdkit.cost.devices.Device.op_time`), the devices together do at
  least the FLOPs of the unsharded step, so a device works at least ``F / (N x peak)``; a 1F1B
  pipeline of ``p`` stages and ``m`` microbatches takes at least ``(m + p - 1) / m`` of its
  busiest device's work (the first microbatch crosses every stage forward and back before the
  busiest device's last ``m - 1``).
"""

from __future__ import annotations

from dataclasses import dataclass

from spmdkit.cost.compute import op_cost
from spmdkit.cost.devices import Device
from spmdkit.cost.memory import CUDA_CONTEXT_BYTES, NCCL_BYTES_PER_GROUP
from spmdkit.program.ir import Program
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import Runtime


def experts_of(prog: Program) -> int:
    """The routed experts of a program's MoE layers (the expert axis of ``moe_gate_dispatch``'s
    output ``[B, E, C, H]``), 0 for a dense program."""
    for op in prog.ops:
        if op.rule == "moe_gate_dispatch" and op.phase == "forward":
            names = op.output_names()
            if names and len(prog.tensors[names[0]].shape) == 4:
                return prog.tensors[names[0]].shape[1]
    return 0


@dataclass(frozen=True)
class Bounds:
    """What the bounds read off the full-size step on one rank (bytes, FLOPs)."""

    dense_params: int       # parameters that are not expert stacks (bytes at their dtype)
    expert_params: int      # expert stacks [E, in, out]
    dense_states: int       # optimizer states (moments, master copies) of the dense parameters
    expert_states: int
    flops: float            # forward + backward + optimizer FLOPs of the unsharded step
    peak: float             # the fastest tensor-core peak its ops can run at (FLOP/s)

    def memory(self, dp: int, ep: int, tp: int, pp: int, strategy: str) -> int:
        """Bytes per device at least (every recomputation mode) under ``strategy`` on
        ``pp x dp x ep x tp``."""
        st = set(strategy.split(","))
        zero = max((int(s[4]) for s in st if s in ("zero1", "zero2", "zero3")), default=0)
        t = tp if "megatron" in st else 1
        e = ep if "ep" in st else 1
        dense_z, expert_z = dp * ep, dp

        def held(dense: int, expert: int, stage: int) -> float:
            return dense / (t * (dense_z if zero >= stage else 1)) + expert / (t * e * (expert_z if zero >= stage else 1))

        states = held(self.dense_params, self.expert_params, 3) + held(self.dense_params, self.expert_params, 2) \
            + held(self.dense_states, self.expert_states, 1)
        groups = sum(1 for s in (dp, ep, tp) if s > 1) + (1 if pp > 1 else 0)
        return int(states / pp) + CUDA_CONTEXT_BYTES + NCCL_BYTES_PER_GROUP * groups

    def step(self, devices: int, pp: int, microbatches: int) -> float:
        """Seconds per step at least on ``devices`` devices (``pp`` stages, ``microbatches``)."""
        work = self.flops / (devices * self.peak)
        if pp > 1:
            m = max(1, microbatches)
            work *= (m + pp - 1) / m
        return work


def model_bounds(plan: Plan, device: Device, runtime: Runtime) -> Bounds:
    """The :class:`Bounds` of ``plan``, the step planned on one rank at full size."""
    prog = plan.program
    experts = experts_of(prog)

    def is_expert(shape: tuple[int, ...]) -> bool:
        return experts > 0 and len(shape) == 3 and shape[0] == experts

    dp_ = ep_ = ds = es = 0
    for t in prog.tensors.values():
        if t.inplace_of:
            continue
        nbytes = t.numel * t.itemsize
        if t.kind == "parameter":
            if is_expert(t.shape):
                ep_ += nbytes
            else:
                dp_ += nbytes
        elif t.kind == "optimizer_state":
            if is_expert(t.shape):
                es += nbytes
            else:
                ds += nbytes
    flops = sum(op_cost(plan, i).flops for i in range(len(prog.ops)))
    dtypes = {t.dtype for t in prog.tensors.values() if t.dtype.startswith(("float", "bfloat"))}
    peak = max([device.matmul_peak(d) for d in dtypes] or [device.peak["fp32"]])
    if runtime.fp8 and "fp8" in device.peak:
        peak = max(peak, device.peak["fp8"])
    return Bounds(dp_, ep_, ds, es, float(flops), peak)


__all__ = ["Bounds", "experts_of", "model_bounds"]
