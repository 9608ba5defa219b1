"""A pipeline's spec and its layers' split into stages (:mod:`spmdkit.planner.pipeline`).

:class:`PipelineSpec` (``--microbatches``, ``--schedule``, ``--virtual-stages``, ``--stages``,
``--microbatch-group``: :func:`parse_spec`), the layers per virtual stage (:func:`split_layers`:
as given, evenly, or balanced by cost, :func:`auto_counts`), each op's layer and stage
(:func:`op_units`, :func:`op_stages`: the embedding with the first stage, the final norm, the
head and the loss with the last, an optimizer update with its parameter's stage), and the layers a
recomputation that depends on the split recomputes (:func:`stage_layers`: ``full:K``,
``every:N``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.cost.checkpoints import every_blocks
from spmdkit.cost.compute import op_cost
from spmdkit.cost.memory import (
    recompute_every,
    recompute_layers,
)
from spmdkit.planner.partition import balanced_split, even_split
from spmdkit.planner.planning import parse_size
from spmdkit.planner.schedules import (
    SCHEDULE_ALIASES,
    SCHEDULES,
    check_microbatch_group,
)
from spmdkit.program.ir import Program
from spmdkit.program.layers import layer_tags
from spmdkit.program.plan import Plan

MAX_MICROBATCHES = 1 << 16
#: The most (virtual stage, microbatch) pairs a schedule simulates (about a second of Python).
MAX_UNITS = 1 << 19


@dataclass(frozen=True)
class PipelineSpec:
    pp: int
    microbatches: int
    schedule: str
    virtual: int
    stages: tuple[int, ...] | None = None  # layers per virtual stage, when given
    #: ``--stages auto``: the split :func:`spmdkit.planner.partition.partition` finds
    auto: bool = False
    #: ``--microbatch-group``: the interleaved schedule's microbatches a model chunk runs in a row
    #: (Megatron-Core's ``microbatch_group_size_per_vp_stage``); None: ``pp``, its default
    group: int | None = None


def _int(flag: str, text: Any, hi: int) -> int | None:
    return parse_size(flag, text, hi)


def parse_spec(pp: int, microbatches: Any = None, schedule: Any = None, virtual: Any = None,
               stages: Any = None, group: Any = None) -> PipelineSpec:
    m = _int("--microbatches", microbatches, MAX_MICROBATCHES) or 1
    sched = str(schedule).strip() if schedule is not None else None
    if sched is not None:
        sched = SCHEDULE_ALIASES.get(sched, sched.lower())
        if sched not in SCHEDULES:
            raise ProgramError(f"--schedule {sched[:40]!r}: unknown schedule (one of {', '.join(SCHEDULES)})")
    v = _int("--virtual-stages", virtual, 1024)
    if sched is None:
        sched = "interleaved" if v and v > 1 else "1f1b"
    if sched != "interleaved" and v not in (None, 1):
        raise ProgramError(f"--virtual-stages {v}: model chunks apply to --schedule interleaved, not {sched}")
    n = _int("--microbatch-group", group, MAX_MICROBATCHES)
    if n is not None and sched != "interleaved":
        raise ProgramError(f"--microbatch-group {n}: groups the microbatches of the interleaved schedule's model "
                           f"chunks; --schedule {sched} has none (give --schedule interleaved)")
    if sched == "interleaved":
        if v == 1:  # neither framework interleaves one chunk a device (priced, it held 1F1B's in-flight twice)
            raise ProgramError("--virtual-stages 1: the interleaved schedule runs at least 2 model chunks a device "
                               "(Megatron-LM takes 1 as no interleaving, plain 1F1B; torchtitan refuses a multi-stage "
                               "schedule with fewer than 2 stages a rank): give --virtual-stages 2 or more, or "
                               "--schedule 1f1b")
        v = v or 2
        if n is not None:
            check_microbatch_group(pp, m, n)
        elif m % pp:
            raise ProgramError(f"--schedule interleaved: --microbatches {m} is not a multiple of pp={pp} "
                               f"(Megatron-LM's interleaved schedule needs it)")
    if pp * (v or 1) * m > MAX_UNITS:
        raise ProgramError(f"--microbatches {m}: {m} microbatches x {pp * (v or 1)} stages is more than "
                           f"{MAX_UNITS:,} forward units to simulate")
    counts = None
    n = None if n == pp else n  # Megatron-Core's default, the depth-first order
    if stages is not None and str(stages).strip().lower() == "auto":
        return PipelineSpec(pp, m, sched, v or 1, None, True, n)
    if stages is not None:
        parts = [s.strip() for s in str(stages).split(",") if s.strip()]
        if not parts or not all(s.isascii() and s.isdigit() and len(s) <= 6 for s in parts):
            raise ProgramError(f"--stages {str(stages)[:60]!r}: expected layers per stage as integers, e.g. "
                               f"20,20,20,20, or auto")
        counts = tuple(int(s) for s in parts)
    return PipelineSpec(pp, m, sched, v or 1, counts, group=n)


def split_layers(n_layers: int, spec: PipelineSpec, balance: Callable[[int], tuple[int, ...]] | None = None
                 ) -> tuple[int, ...]:
    """Layers per virtual stage (``pp * virtual`` of them): ``--stages`` as given, else evenly;
    layers that do not divide evenly are split by ``balance(n)`` (:func:`balanced_split` over
    the planned costs, :func:`auto_counts`), or refused without one."""
    n = spec.pp * spec.virtual
    what = f"pp={spec.pp}" + (f" x {spec.virtual} virtual stages" if spec.virtual > 1 else "")
    if spec.stages is not None:
        return _given_stages(spec.stages, n_layers, n, what)
    if n_layers < n:
        raise ProgramError(f"--mesh {what}: {n_layers} layers cannot fill {n} stages (each needs at least one layer)")
    if n_layers % n:
        if balance is not None:
            return balance(n)
        raise ProgramError(f"--mesh {what}: {n_layers} layers do not divide evenly into {n} stages "
                           f"(give --stages, e.g. {','.join(map(str, even_split(n_layers, n)))})")
    return (n_layers // n,) * n


def _given_stages(counts: tuple[int, ...], n_layers: int, n: int, what: str) -> tuple[int, ...]:
    """``--stages`` checked: ``n`` counts summing to the model's layers, each at least one but
    the first and the last virtual stage's, which may be 0 (Megatron-Core's embedding-only
    first stage and loss-only last stage: ``--pipeline-model-parallel-layout "E|t*3|...|L"``,
    ``--account-for-embedding-in-pipeline-split``); a stage with nothing in the middle is not
    what Megatron-Core builds."""
    text = ",".join(map(str, counts))
    if len(counts) != n:
        raise ProgramError(f"--stages: {len(counts)} stage sizes given, {what} has {n} stages")
    if not any(counts):
        raise ProgramError(f"--stages {text}: no stage holds a decoder layer (only the first and the last stage "
                           f"may be 0)")
    if sum(counts) != n_layers:
        raise ProgramError(f"--stages {text}: must be {n} counts summing to the model's {n_layers} layers "
                           f"(they sum to {sum(counts)})")
    for k, c in enumerate(counts):
        if c == 0 and 0 < k < n - 1:
            raise ProgramError(f"--stages {text}: stage {k} (of 0..{n - 1}) holds no layer; only the first stage "
                               f"(the embedding alone) and the last (the final norm, the head and the loss alone) "
                               f"may be 0, a middle stage needs at least one decoder layer")
    return counts


def op_units(prog: Program, ends: bool = False) -> tuple[list[int], int]:
    """(each op's layer, the count of layers): the index in :func:`layer_tags` of its label; -1
    for the embedding (``embedding``, and an unnumbered op before the first layer's); the count
    for the head (``head``); an optimizer update its parameter's; any other op the unit of the
    op before it (the final norm, the head and the loss follow the last layer; in the backward,
    the embedding's gradient follows the first layer's). ``ends`` (a split whose first or last
    stage holds no layer: :func:`op_stages`): an unnumbered op after the last layer's forward
    or before the first of the layers' backward ops is the head's (the count), one after the
    last of the layers' backward ops the embedding's (-1), as an imported model's
    ``model.norm`` and ``lm_head`` and its embedding's gradient. Found once per program (the
    caller's list is its own copy)."""
    unit, n = prog.derived("pipeline.op_units_ends" if ends else "pipeline.op_units",
                           lambda pr: _op_units(pr, ends))
    return list(unit), n


def _op_units(prog: Program, ends: bool = False) -> tuple[list[int], int]:
    index = {t: k for k, t in enumerate(layer_tags(prog))}
    n = len(index)
    numbered = {ph: [i for i, op in enumerate(prog.ops) if op.phase == ph and op.layer in index]
                for ph in ("forward", "backward")} if ends else {}
    out: list[int] = []
    param_unit: dict[str, int] = {}
    prev = -1
    for i, op in enumerate(prog.ops):
        tag = op.layer
        u = index.get(tag)
        if u is None:
            if tag == "embedding":
                u = -1
            elif tag == "head":
                u = n
            elif op.phase == "optimizer":
                u = next((param_unit[x] for x in op.input_names() if x in param_unit), prev)
            elif numbered.get(op.phase):
                got = numbered[op.phase]
                u = (n if i > got[-1] else prev) if op.phase == "forward" else (
                    n if i < got[0] else -1 if i > got[-1] else prev)
            else:
                u = prev
        if op.phase == "forward":
            for x in op.input_names():
                if prog.tensors[x].kind == "parameter":
                    param_unit.setdefault(x, u)
        out.append(u)
        prev = u
    return out, n


def op_stages(prog: Program, counts: tuple[int, ...]) -> list[int]:
    """The virtual stage of every op of ``prog`` split ``counts`` layers a stage, from the ops'
    units it reads itself (:func:`op_units`, found once per program: the embedding with the first
    stage, the head and the loss with the last, an optimizer update with its parameter's stage);
    where the first or last stage holds no layer (a count of 0) from ``op_units(ends=True)``, so
    that stage holds the embedding or the head alone."""
    unit, n_layers = op_units(prog, ends=bool(counts) and (counts[0] == 0 or counts[-1] == 0))
    last = len(counts) - 1
    of_layer: list[int] = []
    for s, c in enumerate(counts):
        of_layer.extend([s] * c)
    of_layer.extend([last] * max(0, n_layers - len(of_layer)))
    return [0 if u < 0 else (of_layer[u] if u < n_layers else last) for u in unit]


def auto_counts(plan: Plan, n: int, op_times: list[float] | None = None,
                units: tuple[list[int], int] | None = None) -> tuple[int, ...]:
    """Layers per stage for ``n`` stages, balanced by cost (:func:`balanced_split`): each
    layer's, the embedding's and the head's forward and backward time (``op_times``, one per
    op: :func:`spmdkit.cost.step.op_communication`'s compute and wait) or, without times, their
    FLOPs (:func:`spmdkit.cost.compute.op_cost`)."""
    unit, n_layers = units if units is not None else op_units(plan.program)
    costs = [0.0] * (n_layers + 2)  # the embedding, the layers, the head
    for i, op in enumerate(plan.program.ops):
        if op.phase == "optimizer":
            continue
        costs[unit[i] + 1] += op_times[i] if op_times is not None else op_cost(plan, i).flops
    return balanced_split(costs[1:-1], n, costs[0], costs[-1])


def megatron_layout(counts: Sequence[int]) -> str | None:
    """Megatron-Core's ``--pipeline-model-parallel-layout`` for a split its default would not make
    (None for an even one): Megatron-LM asserts the layers divisible by the pipeline size unless a
    layout or first / last stage sizes are given (d98e8a64dd megatron/training/arguments.py,
    'Number of layers should be divisible by the pipeline-model-parallel size'). Its stages in
    virtual-stage order (``vpp_rank x pp + pp_rank``, as the planner counts them), ``|`` between
    them, ``E`` the embedding on the first, ``L`` the loss on the last, ``t`` a layer
    (megatron/core/transformer/pipeline_parallel_layer_layout.py ``parse_str_to_list``)."""
    if not counts or len(set(counts)) == 1:
        return None
    last = len(counts) - 1
    return "|".join(("E" if i == 0 else "") + (f"t*{n}" if n > 1 else "t" * n) + ("L" if i == last else "")
                    for i, n in enumerate(counts))


def split_note(counts: tuple[int, ...], n_layers: int, spec: PipelineSpec, timed: bool = True,
               framework: str | None = None) -> str | None:
    """The one-line note of a split chosen for layers that do not divide into the stages
    (None when they do, or ``--stages`` gave it); ``timed``: balanced by predicted time, else
    by FLOPs; ``framework`` megatron: the layout Megatron-LM needs for it (its default refuses)."""
    n = len(counts)
    if spec.stages is not None or n_layers % n == 0:
        return None
    layout = megatron_layout(counts) if framework == "megatron" else None
    return (f"note: {n_layers} layers do not divide evenly into {n} stages: split {','.join(map(str, counts))} "
            f"(balanced by {'predicted time' if timed else 'FLOPs'}: the first stage also holds the embedding, the "
            f"last the head and the loss; --stages overrides)"
            + (f"; Megatron-LM refuses layers its stages do not divide unless given the split: "
               f"--pipeline-model-parallel-layout '{layout}'" if layout else ""))


def block_layers(prog: Program, counts: tuple[int, ...], k: int) -> frozenset[str]:
    """The layer labels ``full:K`` recomputes: the first ``k`` layers of each (virtual) stage, as
    Megatron-LM's ``--recompute-method block --recompute-num-layers K`` in each model chunk."""
    tags = layer_tags(prog)
    out: list[str] = []
    a = 0
    for c in counts:
        out += tags[a:a + min(k, c)]
        a += c
    return frozenset(out)


def every_layers(prog: Program, counts: tuple[int, ...], n: int, p: int) -> frozenset[str]:
    """The layer labels ``every:N`` recomputes: on each of the ``p`` pipeline ranks, every N-th
    block of its virtual stages ``r, r + p, ...`` counted on from one stage to the next, as
    torchtitan builds a rank's model chunks (``stage_ids_this_rank(style="loop")``) and counts
    the blocks it wraps in one counter a process (:func:`spmdkit.cost.checkpoints.every_blocks`).
    A ProgramError naming ``--recompute`` where no rank holds N blocks (none is checkpointed)."""
    tags = layer_tags(prog)
    start = [sum(counts[:k]) for k in range(len(counts))]
    out: list[str] = []
    for r in range(p):
        mine = list(range(r, len(counts), p))
        for k, picked in zip(mine, every_blocks([counts[k] for k in mine], n)):
            out += [tags[start[k] + i] for i in picked]
    if not out:
        most = max(sum(counts[r::p]) for r in range(p))
        raise ProgramError(f"--recompute every:{n}: torchtitan counts the blocks of each pipeline rank and "
                           f"checkpoints its blocks {n}, {2 * n}, ...; no rank holds {n} (the most: {most}), so none "
                           f"would be (give N from 1 to {most}, or none)")
    return frozenset(out)


def stage_layers(prog: Program, counts: tuple[int, ...], mode: str, p: int) -> frozenset[str] | None:
    """The layer labels whose regions ``mode`` recomputes on a pipeline of ``p`` ranks split
    ``counts`` layers a virtual stage (``full:K``: :func:`block_layers`; ``every:N``:
    :func:`every_layers`), None for a mode that recomputes in every layer."""
    k = recompute_layers(mode)
    if k is not None:
        return block_layers(prog, counts, k)
    n = recompute_every(mode)
    return every_layers(prog, counts, n, p) if n is not None else None


__all__ = ["MAX_MICROBATCHES", "MAX_UNITS", "PipelineSpec", "auto_counts", "block_layers", "every_layers",
           "megatron_layout", "op_stages", "op_units", "parse_spec", "split_layers", "split_note", "stage_layers"]
