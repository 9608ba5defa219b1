"""Pipeline schedules as event simulations: each device's order of work and its timeline.

:func:`schedule_order` gives device ``r``'s forwards and backwards in the order the schedule
runs them (GPipe: every forward, then every backward; 1F1B: ``p - r - 1`` warm-up forwards,
then one forward and one backward in turn, then the cool-down backwards; interleaved 1F1B:
Megatron-LM's order over ``v`` model chunks per device). :func:`run_schedule` runs those
orders against each other: a forward waits for the previous stage's forward of the same
microbatch plus the send, a backward for the next stage's backward plus the send. The bubble
is what the simulated pipeline takes beyond the busiest device's own work; with equal stages
and free sends it is exactly ``(p-1)/m`` (GPipe, 1F1B) or ``(p-1)/(v m)`` (interleaved) of
that work (:func:`bubble_formula`). :func:`in_flight` gives the microbatches of activations
a device holds at its peak under each schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spmdkit.core.errors import ProgramError

SCHEDULES = ("gpipe", "1f1b", "interleaved")
SCHEDULE_ALIASES = {"interleaved-1f1b": "interleaved", "interleaved1f1b": "interleaved", "1F1B": "1f1b",
                    "GPipe": "gpipe"}


def schedule_order(schedule: str, p: int, v: int, m: int, r: int) -> list[tuple[str, int, int]]:
    """Device ``r``'s work in order: ("F" | "B", virtual stage, microbatch)."""
    if schedule == "gpipe":
        return [("F", r, i) for i in range(m)] + [("B", r, i) for i in range(m)]
    if schedule == "1f1b":
        warm = min(p - r - 1, m)
        order = [("F", r, i) for i in range(warm)]
        for i in range(m - warm):
            order += [("F", r, warm + i), ("B", r, i)]
        return order + [("B", r, i) for i in range(m - warm, m)]
    total = m * v

    def unit(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k % (p * v)) // p
        if not forward:
            chunk = v - 1 - chunk
        return chunk * p + r, (k // (p * v)) * p + k % p

    warm = min((p - r - 1) * 2 + (v - 1) * p, total)
    order = [("F", *unit(k, True)) for k in range(warm)]
    for j in range(total - warm):
        order += [("F", *unit(warm + j, True)), ("B", *unit(j, False))]
    return order + [("B", *unit(k, False)) for k in range(total - warm, total)]


def in_flight(schedule: str, p: int, v: int, m: int, r: int) -> float:
    """Microbatches of a whole stage whose activations device ``r`` holds at its peak."""
    if schedule == "gpipe":
        return float(m)
    if schedule == "1f1b":
        return float(min(p - r, m))
    return min((p - r - 1) * 2 + (v - 1) * p + 1, m * v) / v


@dataclass
class ScheduleRun:
    finish_s: list[float]   # per device: the end of its last backward
    busy_s: list[float]     # per device: its own forward + backward work
    last_backward_s: list[float]
    #: every unit run: (device, "F" | "B", virtual stage, microbatch, start s, end s)
    units: list[tuple[int, str, int, int, float, float]] = field(default_factory=list, repr=False)

    @property
    def pipeline_s(self) -> float:
        return max(self.finish_s)

    @property
    def bubble_s(self) -> float:
        return self.pipeline_s - max(self.busy_s)

    @property
    def bubble_fraction(self) -> float:
        w = max(self.busy_s)
        return self.bubble_s / w if w > 0 else 0.0


def run_schedule(schedule: str, p: int, v: int, m: int, fwd: list[float], bwd: list[float],
                 send_f: list[float] | None = None, send_b: list[float] | None = None,
                 blocking_sends: bool | None = None) -> ScheduleRun:
    """Simulate the schedule: ``fwd[k]`` / ``bwd[k]`` the time of virtual stage ``k`` for one
    microbatch, ``send_f[k]`` / ``send_b[k]`` the time to send its output activations to stage
    ``k+1`` / the gradients of its inputs to ``k-1`` (``send_b[k]`` is stage ``k+1``'s send back
    to ``k``). ``blocking_sends`` (default: every schedule but interleaved): the sender waits for
    its send to complete before its next unit, as Megatron-LM's 1F1B does (its p2p calls wait on
    the exchange); the interleaved schedule overlaps its sends with the next unit's compute
    (Megatron's ``overlap_p2p_comm``), so there only the receiver waits."""
    if blocking_sends is None:
        blocking_sends = schedule != "interleaved"
    n = p * v
    sf = send_f or [0.0] * n
    sb = send_b or [0.0] * n
    orders = [schedule_order(schedule, p, v, m, r) for r in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    pos = [0] * p
    free = [0.0] * p
    last_b = [0.0] * p
    units: list[tuple[int, str, int, int, float, float]] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                kind, k, i = orders[r][pos[r]]
                if kind == "F":
                    dep = 0.0 if k == 0 else (None if ("F", k - 1, i) not in done else done[("F", k - 1, i)] + sf[k - 1])
                    dur = fwd[k]
                else:
                    if k == n - 1:
                        dep = done.get(("F", k, i))
                    else:
                        dep = None if ("B", k + 1, i) not in done else done[("B", k + 1, i)] + sb[k]
                    dur = bwd[k]
                if dep is None:
                    break
                start = max(free[r], dep)
                free[r] = start + dur
                units.append((r, kind, k, i, start, free[r]))
                done[(kind, k, i)] = free[r]
                if blocking_sends:
                    free[r] += (sf[k] if k < n - 1 else 0.0) if kind == "F" else (sb[k - 1] if k > 0 else 0.0)
                if kind == "B":
                    last_b[r] = dur
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # cannot happen for the three schedules; never loop forever
            raise ProgramError(f"--schedule {schedule}: the schedule deadlocks (p={p}, v={v}, m={m})")
    busy = [m * sum(fwd[c * p + r] + bwd[c * p + r] for c in range(v)) for r in range(p)]
    return ScheduleRun(free, busy, last_b, units)


def bubble_formula(schedule: str, p: int, v: int, m: int) -> float:
    return (p - 1) / (v * m) if schedule == "interleaved" else (p - 1) / m


__all__ = ["SCHEDULES", "SCHEDULE_ALIASES", "ScheduleRun", "bubble_formula", "in_flight", "run_schedule",
           "schedule_order"]
