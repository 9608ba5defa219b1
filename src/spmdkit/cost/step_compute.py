"""The compute of a training step: every op's cost (:func:`spmdkit.cost.compute.op_cost`) and its
time on a device (:meth:`spmdkit.cost.devices.Device.op_time`), their sums by phase, and the part
of each op's time the slowest of the step's GPUs adds; the last 8 (plan, device) pairs kept.
Read by the step (:mod:`spmdkit.cost.step`) and its communication (:mod:`spmdkit.cost.step_comm`).
Standard library only. docs/devices.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from spmdkit.cost.compute import op_cost
from spmdkit.cost.devices import Device
from spmdkit.engine.facts import OpCost
from spmdkit.engine.memo import Recent
from spmdkit.program.plan import Plan


@dataclass
class StepCompute:
    """Every op's cost and roofline time, and their sums."""

    costs: list[OpCost]
    times: list[float]
    by_phase: dict[str, float]
    uncovered: dict[str, int]
    flops: float = 0.0
    model_flops: float = 0.0
    bytes: float = 0.0
    matmul_s: float = 0.0
    memory_bound: int = 0
    #: per op, the seconds its time on the slowest of the step's GPUs adds to the median GPU's
    #: (:attr:`spmdkit.cost.devices.Device.slowdown`: tensor-core ops only), and their sums by phase
    slow: list[float] = field(default_factory=list)
    slow_by_phase: dict[str, float] = field(default_factory=dict)


#: the last (plan, device, its compute) by the pair's ids (the value keeps them): the step and a
#: pipeline's stages time the same plan on the same device one after the other, and a search
#: times a plan again after a few others (DeepSeek-V3's search at bf6b6e1: 858 computes of 572
#: plans, 3-4 times each for 110 of them); a Plan is frozen and not changed once built
_LAST: Recent[tuple[Plan, Device, StepCompute]] = Recent(8, by_id=True)


def step_compute(plan: Plan, device: Device) -> StepCompute:
    """Every op's cost and time on ``device`` (each caller gets its own sums to add to)."""
    c = _LAST.get((id(plan), id(device)), lambda: (plan, device, _compute_ops(plan, device)))[2]
    return replace(c, by_phase=dict(c.by_phase), uncovered=dict(c.uncovered), slow_by_phase=dict(c.slow_by_phase))


def _compute_ops(plan: Plan, device: Device) -> StepCompute:
    out = StepCompute([], [], {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}, {})
    times: dict[OpCost, tuple[float, float]] = {}  # an op's time is a function of its cost on the device
    solo = device.at(1) if device.slowdown > 1.0 else None  # the median GPU
    for i, op in enumerate(plan.program.ops):
        c = op_cost(plan, i)
        out.costs.append(c)
        if not c.covered:
            out.uncovered[op.rule] = out.uncovered.get(op.rule, 0) + 1
        got = times.get(c)
        if got is None:
            t = device.op_time(c)
            tensor = c.matmul or c.attention is not None
            got = times[c] = (t, t - solo.op_time(c) if solo is not None and tensor else 0.0)
        t, slow = got
        out.times.append(t)
        out.slow.append(slow)
        out.by_phase[op.phase] = out.by_phase.get(op.phase, 0.0) + t
        if slow:
            out.slow_by_phase[op.phase] = out.slow_by_phase.get(op.phase, 0.0) + slow
        out.flops += c.flops
        out.model_flops += c.model_flops
        out.bytes += c.bytes
        if c.matmul:
            out.matmul_s += t
        if c.bytes / device.hbm_bytes_per_s > c.flops / (device.matmul_peak(c.dtype) if c.matmul else
                                                          device.vector_peak) and t > 0:
            out.memory_bound += 1
    return out
