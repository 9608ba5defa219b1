"""The bubble hint: a pipeline whose bubble is a large share of its step, and the batch that
shrinks it.

With ``p`` stages the fill and drain cost about ``(p - 1) / v`` microbatches' time whatever the
batch, so a preset's small global batch (few microbatches per stage) leaves the devices idle for a
large share of the step. :func:`bubble_hint` says so where the bubble (the busiest pipeline rank's
idle time in the schedule, ``ScheduleRun.bubble_s``) is more than :data:`BUBBLE_SHARE` of the
predicted step, and finds the least number of microbatches (the same micro-batch size and
data-parallel degree: a larger global batch) whose bubble is under it, by running the same event
simulation (:meth:`spmdkit.planner.schedules.ScheduleInputs.run`) on the same stages' times and sends,
the step then made as the estimate makes it (each rank's gradient reductions after its last
backward, its optimizer). Interleaved 1F1B needs a multiple of ``p`` microbatches (with
``--microbatch-group N``, counts ``N`` apart: each leaves the last group the plan's). None where the
bubble is under the threshold, or more microbatches (up to :data:`MOST_TIMES` as many) do not bring
it under.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from spmdkit.planner.pipeline import PipelineEstimate, _step_times
from spmdkit.planner.schedules import ScheduleRun
from spmdkit.program.plan import Plan

#: the share of the step the bubble may take before the plan says so
BUBBLE_SHARE = 0.25
#: the most microbatches tried, as a multiple of the plan's
MOST_TIMES = 64


@dataclass(frozen=True)
class BubbleHint:
    """The bubble's share of the step now (``microbatches``, ``step_s``) and at ``more``
    microbatches (``more_step_s``), the least that bring it under ``threshold``."""

    share: float
    bubble_s: float
    microbatches: int
    step_s: float
    more: int
    more_share: float
    more_step_s: float
    threshold: float = BUBBLE_SHARE

    @property
    def times(self) -> float:
        """The global batch's multiple the hint asks for."""
        return self.more / self.microbatches

    def to_json(self) -> dict[str, Any]:
        return {"threshold": self.threshold, "bubble_share": self.share, "bubble_s": self.bubble_s,
                "microbatches": self.microbatches,
                "step_s": self.step_s, "hint_microbatches": self.more, "hint_bubble_share": self.more_share,
                "hint_step_s": self.more_step_s, "batch_times": self.times}


def _at(plan: Plan, est: PipelineEstimate, m: int) -> tuple[float, float, ScheduleRun]:
    """(the bubble's share of the step, the step) of ``est``'s pipeline at ``m`` microbatches."""
    s = est.spec
    assert est.inputs is not None
    run = est.inputs.run(s.schedule, s.pp, s.virtual, m, s.group)
    step = _step_times(plan, replace(s, microbatches=m), est.stages, run, est.tied_s)[1]
    return (run.bubble_s / step if step > 0 else 0.0), step, run


def bubble_hint(plan: Plan, est: PipelineEstimate, threshold: float = BUBBLE_SHARE) -> BubbleHint | None:
    """The hint for ``est`` (the pipeline of ``plan``, one microbatch's plan), or None (module
    docstring)."""
    if est.run is None or est.inputs is None or est.step_overlap_s <= 0:
        return None
    s = est.spec
    m = s.microbatches
    share = est.run.bubble_s / est.step_overlap_s
    if share <= threshold:
        return None
    step = (s.group or s.pp) if s.virtual > 1 else 1
    hi = (m * MOST_TIMES) // step * step
    top = _at(plan, est, hi)
    if top[0] > threshold:
        return None  # the bubble does not shrink under the threshold with the batch
    lo = m  # over the threshold at lo, under at hi: the least count under it, by bisection
    found = top
    while hi - lo > step:
        mid = lo + (hi - lo) // (2 * step) * step or lo + step
        got = _at(plan, est, mid)
        if got[0] <= threshold:
            hi, found = mid, got
        else:
            lo = mid
    return BubbleHint(share, est.run.bubble_s, m, est.step_overlap_s, hi, found[0], found[1], threshold)


__all__ = ["BUBBLE_SHARE", "BubbleHint", "MOST_TIMES", "bubble_hint"]
