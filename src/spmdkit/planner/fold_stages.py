"""Deep pipelines folded by stage: a pipeline's middle stages are alike, so one of each is planned.

With ``p`` stages (``p x v`` virtual stages) of a model of repeated layers, every virtual stage
but the first (the embedding) and the last (the final norm, the head and the loss) holds only
numbered layers, so two middle stages with as many layers are the same ops on the same shapes:
the same times, sends, gradients, held bytes, stash and liveness peak (:class:`StageCost`).
:func:`stage_copy` turns the full split (``7, 8 x 14, 7`` for Llama 3 405B's 126 layers on 16
stages) into the split of a shallow copy of the model (``7, 8, 7``: the first stage, ONE middle
stage of each distinct layer count, the last stage; 22 layers instead of 126), and
:func:`deep_pipeline` prices the full pipeline from the copy: each virtual stage's costs are its
copy stage's, and the schedule (:func:`spmdkit.planner.schedules.run_schedule`, any schedule,
interleaved included), each rank's memory (its in-flight microbatches) and each rank's gradient
reductions and optimizer are run on the full ``p`` stages by
:func:`spmdkit.planner.pipeline.estimate_pipeline` itself. Nothing is extrapolated: the stages
are the full pipeline's own.

What is not per stage, the search's communication figure (one microbatch's step over every
stage, its gradient buckets) and the model FLOPs, comes from the flat two-copy fold of
:mod:`spmdkit.planner.fold` (two copies of 2 and 3 layers). ``scripts/check_fold.py`` and
``tests/test_fold.py`` compare with the pipeline planned whole (1e-9 relative).
"""

from __future__ import annotations

from dataclasses import replace

from spmdkit.cost.devices import Device
from spmdkit.cost.memory import MICROBATCH, per_microbatch_mode, recompute_every
from spmdkit.cost.step import op_communication
from spmdkit.planner.partition import UnitCosts
from spmdkit.planner.pipeline import PipelineEstimate, estimate_pipeline
from spmdkit.planner.pipeline_split import PipelineSpec, op_stages, stage_layers
from spmdkit.planner.stage_costs import stage_costs
from spmdkit.program.plan import Plan


def stage_copy(counts: tuple[int, ...], dense: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(the shallow copy's layers per virtual stage: the first, one middle stage of each distinct
    count in order, the last; each full virtual stage's copy stage), or None where the copy
    would not be shallower (fewer than 3 stages, no middle count repeated) or reach the last
    stage (with a last stage of no layer, Megatron-Core's loss-only one, the stage before it is
    kept too: it holds the model's last layer). Where ``dense`` layers of another kind come
    first (a MoE model's dense ones: 3 of DeepSeek-V3's, which a pipeline of 1-2 layers a stage
    spreads over two), every stage up to
    the one holding the first layer of the repeated kind is kept as it is (the first of them
    reads a dense layer's output, the others a layer of its own kind's: ``fold.fold_of`` keeps
    the same ``dense + 1`` layers); the middle stages after them hold the repeated kind only."""
    n = len(counts)
    head, start = 1, counts[0]  # the stages kept as they are; the first layer after them
    while start < dense + (dense > 0) and head < n:
        start += counts[head]
        head += 1
    # the stages kept at the end: the last, and before a last stage of no layer (the loss alone) the
    # stage holding the model's last layer (its ops are not a middle layer's)
    tail = 2 if counts and counts[-1] == 0 else 1
    if n < 3 or head >= n - tail:
        return None
    mids = list(dict.fromkeys(counts[head:n - tail]))
    copy = (*counts[:head], *mids, *counts[n - tail:])
    if len(copy) >= n:
        return None
    where = (*range(head), *(head + mids.index(c) for c in counts[head:n - tail]),
             *range(len(copy) - tail, len(copy)))
    return copy, where


def copy_layers(counts: tuple[int, ...], dense: int = 0) -> int | None:
    """The layers of :func:`stage_copy`'s copy (None: not folded so)."""
    got = stage_copy(counts, dense)
    return None if got is None else sum(got[0])


def stretch_units(u: UnitCosts, layers: int, dense: int = 0) -> UnitCosts:
    """A shallow copy's per-unit costs (:func:`spmdkit.planner.pipeline.plan_unit_costs`: the
    embedding, its layers, the head) as the full model's ``layers``: the embedding, the first
    ``dense + 1`` layers and the last as they are, the layer after them repeated in between (as
    :func:`spmdkit.planner.fold.full_layer_costs`), for the search's split of the full model (``search_config._split``)."""
    k = dense + 2  # the unit of the repeated layer
    if u.layers < dense + 3:
        raise ValueError("stretch_units: the copy has too few layers to repeat one")

    def grow(t: tuple[float, ...]) -> tuple[float, ...]:
        return t[:k] + (t[k],) * (layers - u.layers) + t[k:] if t else t

    return replace(u, forward_s=grow(u.forward_s), backward_s=grow(u.backward_s), held=grow(u.held),
                   stash=grow(u.stash), transient=grow(u.transient), weight_s=grow(u.weight_s), wstash=grow(u.wstash))


def deep_pipeline(plan: Plan, spec: PipelineSpec, counts: tuple[int, ...], device: Device,
                  pp_link: tuple[float, float], tokens: int | None, ranks: int, recompute: str,
                  flops: float, dense: int = 0) -> PipelineEstimate | None:
    """The full pipeline (``spec``, ``counts`` layers per virtual stage) priced from ``plan``, a
    shallow copy of the model split as :func:`stage_copy` makes it (the copy's stages' costs
    repeated for every full stage of the same place and count); ``flops``: one microbatch's
    model FLOPs of the full model; ``dense``: its first layers of another kind. None where not
    folded so (microbatch-level recomputation needs the whole pipeline's stages)."""
    got = stage_copy(counts, dense)
    # every:N with virtual stages: a rank's count of blocks runs on over its chunks, which the copy's do not
    if got is None or recompute == MICROBATCH or (recompute_every(recompute) is not None and spec.virtual > 1):
        return None
    copy, where = got
    device = device.lockstep(ranks)  # the full pipeline's GPUs, not the copy's: the slowest sets the pace
    oc = op_communication(plan, device)  # once for every recomputation mode of the copy
    cs = stage_costs(plan, op_stages(plan.program, copy), copy, device, per_microbatch_mode(recompute), oc,
                     stage_layers(plan.program, copy, recompute, len(copy)))  # (each copy stage a rank's one chunk)
    costs = [cs[w] for w in where]
    return estimate_pipeline(plan, spec, counts, device, pp_link, tokens, ranks, recompute=recompute,
                             costs=costs, flops=flops)


__all__ = ["copy_layers", "deep_pipeline", "stage_copy", "stretch_units"]
