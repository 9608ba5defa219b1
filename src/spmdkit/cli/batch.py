"""Batch semantics of ``spmdkit plan``: ``--global-batch`` (sequences per optimizer step) and
``--micro-batch`` (sequences per data-parallel rank in one forward/backward), the gradient
accumulation derived from them, as Megatron-LM's ``--global-batch-size`` / ``--micro-batch-size``
and torchtitan's ``global_batch_size`` / ``local_batch_size`` define them.

On a ``--mesh`` with ``dp`` data-parallel ranks (``dp x ep``: :func:`spmdkit.cli.common.mesh_dp`)
they become the flags the planner has: without a pp dim the plan's micro-step is
``--micro-batch x dp`` sequences (``--batch``) and ``--grad-accum`` is ``global / (micro x dp)``;
with one the step is the global batch as ``global / (micro x dp)`` microbatches (``--microbatches``).
``--micro-batch`` defaults to ``global / dp`` without a pipeline (no accumulation) and to 1 with
one (one sequence per rank per microbatch: the smallest bubble). ``--batch`` keeps its meaning
(the sequences of one micro-step over every data-parallel rank), and ``--batch B --grad-accum K``
trains ``B x K`` sequences a step: said in a warning, not silently.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

from spmdkit.cli.common import mesh_dp
from spmdkit.cli.request import PlanRequest
from spmdkit.core.errors import ProgramError
from spmdkit.planner.planning import MAX_SIZE, parse_size
from spmdkit.strategies.strategy import parse_mesh


def global_batch(req: PlanRequest) -> tuple[int | None, int | None]:
    """(``--global-batch``, ``--micro-batch``) checked, and the flags they do not go with."""
    g = parse_size("--global-batch", req.global_batch, MAX_SIZE)
    mb = parse_size("--micro-batch", req.micro_batch, MAX_SIZE)
    if g is None:
        if mb is not None:
            raise ProgramError(f"--micro-batch {mb}: give --global-batch too (sequences per optimizer step; the "
                               "gradient accumulation is derived from them)")
        return None, None
    for flag, v in (("--batch", req.batch), ("--grad-accum", req.grad_accum),
                    ("--microbatches", req.pipeline.microbatches)):
        if v is not None:
            raise ProgramError(f"{flag}: does not go with --global-batch {g} (the micro-steps are derived from "
                               "--global-batch and --micro-batch; --batch is one micro-step's sequences)")
    return g, mb


def resolve_mesh_batch(req: PlanRequest) -> PlanRequest:
    """A ``--mesh`` request's ``--global-batch`` / ``--micro-batch`` as ``--batch``,
    ``--grad-accum`` or ``--microbatches``; ``--batch`` with ``--grad-accum`` warned of."""
    g, mb = global_batch(req)
    # a pp dim or a pipeline flag (--schedule, --microbatches, ...: a pipeline of one stage without pp)
    pipeline = "pp" in parse_mesh(req.mesh_text).dim_names or req.pipeline.given()
    if req.grad_accum is not None and pipeline:
        # a pipeline accumulates over its microbatches (Megatron-LM's num_microbatches): --grad-accum
        # was accepted there, warned of, and planned as one step of --batch
        raise ProgramError(f"--grad-accum {req.grad_accum}: a pipeline accumulates the gradients over its "
                           "--microbatches (give --microbatches M, or --global-batch and --micro-batch)")
    if g is None:
        k = parse_size("--grad-accum", req.grad_accum, 1 << 20) or 1
        b = parse_size("--batch", req.batch, MAX_SIZE)
        if b is not None and k > 1:
            warnings.warn(f"--batch {b} --grad-accum {k}: --batch is the sequences of one micro-step, so a step "
                          f"trains {b} x {k} = {b * k:,} sequences; for {b} sequences per optimizer step give "
                          f"--global-batch {b} (and --micro-batch)", UserWarning, stacklevel=2)
        return req
    dp = mesh_dp(req.mesh_text, req.strategy)
    micro = mb if mb is not None else (1 if pipeline else g // dp if g % dp == 0 else None)
    if micro is None or g % (micro * dp):
        what = f"--micro-batch {mb} x " if mb is not None else ""
        raise ProgramError(f"--global-batch {g}: not a multiple of {what}the {dp} data-parallel ranks"
                           f"{f' (= {mb * dp})' if mb is not None else ''} of --mesh {req.mesh_text} (each rank "
                           f"whole sequences); e.g. --global-batch {-(-g // (dp * (mb or 1))) * dp * (mb or 1)}")
    steps = g // (micro * dp)
    if pipeline:
        return replace(req, batch=str(g), pipeline=replace(req.pipeline, microbatches=str(steps)))
    return replace(req, batch=str(micro * dp), grad_accum=str(steps) if steps > 1 else None)


__all__ = ["global_batch", "resolve_mesh_batch"]
