"""The pipeline part of the ``torch`` export (:mod:`spmdkit.outputs.export_torch`): ``PIPELINE``
(each stage's module prefixes, torch's schedule, the microbatches), the stage module and
``build_pipeline`` (``torch.distributed.pipelining``'s ``PipelineStage`` and ``Schedule1F1B`` /
``ScheduleGPipe``), and each stage's collectives (``PLAN_COLLECTIVES_BY_STAGE``).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from spmdkit.outputs.export_common import ExportError
from spmdkit.planner.pipeline_split import PipelineSpec, op_stages
from spmdkit.planner.stage_costs import shared_parameters
from spmdkit.program.layers import layer_tags
from spmdkit.program.plan import Plan
from spmdkit.strategies.hf_program import parameters

#: a plan's collective kind -> the op CommDebugMode counts (torch's functional collectives)
FUNCOL = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor",
          "reduce_scatter": "reduce_scatter_tensor", "all_to_all": "all_to_all_single"}


def layers_container(plan: Plan) -> str | None:
    """The module holding the numbered blocks (``model.layers``, GPT-2's ``transformer.h``):
    the prefix before a number that the most module paths share."""
    mods = getattr(plan.program, "modules", None) or {}
    c = Counter(m.group(1) for path, _cls in mods.values() for m in [re.match(r"(.+?)\.\d+(\.|$)", path)] if m)
    return c.most_common(1)[0][0] if c else None


#: spmdkit's schedule -> torch.distributed.pipelining's schedule class
SCHEDULE_CLASSES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}


def pipeline_doc(plan: Plan, spec: PipelineSpec, counts: tuple[int, ...],
                 styled: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``PIPELINE`` of a pipeline plan (``plan``: one microbatch's on the sub-mesh without pp):
    the module prefixes of each stage (its blocks; the embedding with the first, the final norm
    and the head with the last, as the plan cuts them: :func:`spmdkit.planner.pipeline_split.op_stages`),
    the schedule (torch's name), the microbatches, the layers container and the modules outside it
    (``ends``: the stages that do not hold one get an ``nn.Identity``); ``tied`` (:func:`tied_copies`)
    and, for GPT-2, ``body`` (its GPT2Model, whose stage forward the file writes out: a later stage
    must not add the position embedding again). ``styled``: the modules the tp plan styles."""
    if spec.schedule not in SCHEDULE_CLASSES:
        raise ExportError(f"--export torch: --schedule {spec.schedule}: not exported (torch's Schedule1F1B and "
                          f"ScheduleGPipe are: one stage a rank)")
    prog = plan.program
    container = layers_container(plan)
    tags = layer_tags(prog)
    if container is None or not tags:
        raise ExportError("--export torch: the pipeline's program records no numbered blocks of modules (a program "
                          "JSON): export from --hf")
    stage_of_op = op_stages(prog, counts)
    stages: list[list[str]] = [[] for _ in counts]
    k = 0
    for s, c in enumerate(counts):
        stages[s] += tags[k:k + c]
        k += c
    ends: list[str] = []
    for p in parameters(prog):
        mod = p.rsplit(".", 1)[0]
        if mod.startswith(container + ".") or mod in ends:
            continue
        first = next((i for i, op in enumerate(prog.ops) if op.phase == "forward" and p in op.input_names()), None)
        if first is None:
            continue
        ends.append(mod)
        stages[stage_of_op[first]].append(mod)
    tied = tied_copies(plan, stage_of_op, styled)
    for t in tied:
        for name, s in zip(t["names"], t["stages"]):
            mod = name.rsplit(".", 1)[0]
            if mod not in ends:
                ends.append(mod)
                stages[s].append(mod)
    out = {"stages": stages, "schedule": SCHEDULE_CLASSES[spec.schedule].removeprefix("Schedule"),
           "microbatches": spec.microbatches, "layers": container, "ends": ends, "tied": tied}
    first_ends = [m for m in ends if m in stages[0]]
    if len(first_ends) > 1:
        body = container.rsplit(".", 1)[0] if "." in container else ""
        classes = {path: cls for path, cls in (getattr(prog, "modules", None) or {}).values()}
        if classes.get(body) != "GPT2Model":
            raise ExportError(f"--export torch: a pipeline whose first stage holds {', '.join(first_ends)} besides the "
                              f"blocks: HF's model, given the hidden states on a later stage, would run all but the "
                              f"token embedding again; not exported (the file writes GPT-2's stage forward out, "
                              f"not {classes.get(body) or 'this model'}'s)")
        out["body"] = body
    return out


def tied_copies(plan: Plan, stage_of_op: list[int], styled: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """The parameters read on more than one stage (:func:`spmdkit.planner.stage_costs.shared_parameters`:
    a tied embedding and LM head), each as the name its module on each stage gives it and those
    stages: every stage holds its own copy (HF's model built the same on every rank: equal), and
    the file all-reduces the copies' gradients among them after each step's backward, as the plan
    does (Megatron-LM's embedding group). Refused where the tp plan would shard one copy and not
    the other (they would not sum shard by shard)."""
    prog = plan.program
    modules: dict[int, tuple[str, str]] = getattr(prog, "modules", None) or {}
    out: list[dict[str, Any]] = []
    for p, where in shared_parameters(prog, stage_of_op).items():
        names: list[str] = []
        for s in where:
            i = next(i for i, op in enumerate(prog.ops)
                     if op.phase == "forward" and stage_of_op[i] == s and p in op.input_names())
            mod = modules.get(i, ("", ""))[0]
            if not mod:
                raise ExportError(f"--export torch: {p}: read on stages {', '.join(map(str, where))} and the program "
                                  f"records no module for its reader on stage {s}: export from --hf")
            names.append(p if p.rsplit(".", 1)[0] == mod else f"{mod}.{p.rsplit('.', 1)[1]}")
        held = [n.rsplit(".", 1)[0] in styled for n in names]
        if any(held) and not all(held):
            raise ExportError(f"--export torch: the tied {' = '.join(names)}: the tp plan styles "
                              f"{', '.join(n.rsplit('.', 1)[0] for n, h in zip(names, held) if h)} and not "
                              f"{', '.join(n.rsplit('.', 1)[0] for n, h in zip(names, held) if not h)}; the stages' "
                              f"copies would be "
                              f"sharded differently and their gradients could not be summed shard by shard")
        out.append({"names": names, "stages": list(where)})
    return out


def stage_collectives(plan: Plan, counts: tuple[int, ...], microbatches: int,
                      torch_local: frozenset[str] = frozenset()) -> list[dict[str, dict[str, int]]]:
    """The plan's tp collectives of each stage per step (every microbatch), as :func:`tp_collectives`,
    and once per step on each stage holding a tied parameter's copy, the all-reduce of the copies'
    gradients (:func:`tied_copies`)."""
    names = plan.mesh.dim_names
    stage_of_op = op_stages(plan.program, counts)
    out: list[dict[str, Counter[str]]] = [{"forward": Counter(), "backward": Counter()} for _ in counts]
    for phase in ("forward", "backward", "optimizer"):
        for r, st in plan.collectives(phase):
            if not any(names[d] == "tp" for d in st.mesh_dims):
                continue
            if phase == "optimizer" and st.kind != "all_reduce":
                continue
            if st.kind == "all_reduce" and r.tensor.removesuffix(".grad") in torch_local:
                continue
            ph = "forward" if phase == "forward" else "backward"
            out[stage_of_op[r.op_index]][ph][FUNCOL.get(st.kind, st.kind)] += microbatches
    for where in shared_parameters(plan.program, stage_of_op).values():
        for s in where:
            out[s]["backward"]["all_reduce"] += 1
    return [{ph: dict(sorted(c.items())) for ph, c in d.items()} for d in out]


def pipeline_dp_lines(pipe: dict[str, Any], dp: dict[str, Any]) -> list[str]:
    """``DP_COLLECTIVES`` under a pipeline, per stage: FSDP2's ``replicate`` all-reduces each
    group's gradients after every microbatch's backward (the stage module torch's pipelining runs
    is not itself an FSDP module, so it does not hold the reduction to the last microbatch): the
    stage's blocks, and its modules outside them (GPT-2's stage: each a group of its own; else
    the root's one group, where the stage holds any); ``fully_shard``'s gathers per microbatch
    are not counted (None)."""
    if dp["wrap"] != "replicate":
        return ["#: Under a pipeline FSDP2 gathers per microbatch as the schedule runs them: not counted here.",
                "DP_COLLECTIVES = None", ""]
    out: dict[int, dict[str, int]] = {}
    for s, mods in enumerate(pipe["stages"]):
        blocks = sum(m.startswith(pipe["layers"] + ".") for m in mods)
        ends = len(mods) - blocks
        groups = blocks + (ends if pipe.get("body") else min(ends, 1))
        out[s] = {"allreduce_": groups * pipe["microbatches"]}
    return ["#: What FSDP2's replicate issues over dp per step on each stage (its c10d ops, as CommDebugMode counts",
            "#: them): one all-reduce per group (each block, the modules outside them) after every microbatch.",
            f"DP_COLLECTIVES = {out!r}", ""]


def pipeline_imports(pipe: dict[str, Any]) -> list[str]:
    """The file's imports for the pipeline."""
    out = [f"from torch.distributed.pipelining import PipelineStage, Schedule{pipe['schedule']}"]
    out += ["from torch.distributed.tensor import DTensor"] if pipe.get("tied") else []
    return [*out, "from transformers.masking_utils import create_causal_mask"] if pipe.get("body") else out


_HF_STAGE = '''
class _Stage(torch.nn.Module):
    """One pipeline stage: the model with this stage's modules only, fed the token ids (the first
    stage) or the previous stage's hidden states; returns the logits (the last) or its hidden states."""

    def __init__(self, hf: torch.nn.Module, first: bool, last: bool) -> None:
        super().__init__()
        self.hf, self.first, self.last = hf, first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.hf(input_ids=x) if self.first else self.hf(inputs_embeds=x)
        return out.logits
'''

_GPT2_STAGE = '''
class _Stage(torch.nn.Module):
    """One pipeline stage of GPT-2, GPT2Model's forward written out for the modules this stage
    holds (HF's model, given hidden states, would add the position embedding again): the first
    stage embeds the tokens and their positions (wte(ids) + wpe(positions), dropout), every stage
    runs its blocks under HF's causal mask, the last the final norm and the head (lm_head: this
    stage's copy of the tied wte). Fed the token ids (the first stage) or the previous stage's
    hidden states; returns the logits (the last) or its hidden states."""

    def __init__(self, hf: torch.nn.Module, first: bool, last: bool) -> None:
        super().__init__()
        self.hf, self.first, self.last = hf, first, last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        body = self.hf.get_submodule(PIPELINE["body"])
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        h = body.drop(body.wte(x) + body.wpe(positions)) if self.first else x
        mask = create_causal_mask(config=self.hf.config, inputs_embeds=h, attention_mask=None, cache=None,
                                  position_ids=positions)
        for block in body.h:
            h = block(h, None, mask, position_ids=positions)
        return self.hf.lm_head(body.ln_f(h)) if self.last else h
'''

_CUT = '''

def pipeline_stage(model: torch.nn.Module, pp_rank: int, mesh: DeviceMesh) -> torch.nn.Module:
    """The stage of ``pp_rank`` (PIPELINE["stages"][pp_rank]): the other blocks dropped (this stage's
    are renumbered from 0), the embedding / final norm / head it does not hold made nn.Identity; then
    ``parallelize(stage.hf, mesh)``."""
    keep = set(PIPELINE["stages"][pp_rank])
    container = PIPELINE["layers"]
    blocks = model.get_submodule(container)
    owner, leaf = container.rsplit(".", 1) if "." in container else ("", container)
    setattr(model.get_submodule(owner), leaf,
            torch.nn.ModuleList([b for i, b in enumerate(blocks) if f"{container}.{i}" in keep]))
    for name in PIPELINE["ends"]:
        if name not in keep:
            owner, leaf = name.rsplit(".", 1) if "." in name else ("", name)
            setattr(model.get_submodule(owner), leaf, torch.nn.Identity())
    return _Stage(model, first=pp_rank == 0, last=pp_rank == len(PIPELINE["stages"]) - 1)
'''

_TIED = '''

def tied_copies(model: torch.nn.Module, mesh: DeviceMesh) -> list[tuple[torch.nn.Parameter, Any]]:
    """(this stage's copy, the group of the ranks holding a copy) of each PIPELINE["tied"] parameter
    this stage holds: the ranks of its stages at this rank's place on the other mesh dims (tp, dp),
    each holding the same shard. Every rank makes every group (torch.distributed.new_group is
    collective)."""
    pp = list(MESH_DIMS).index("pp")
    rows = mesh.mesh.movedim(pp, -1).reshape(-1, mesh.mesh.shape[pp]).tolist()
    params = dict(model.named_parameters())
    me, stage = torch.distributed.get_rank(), mesh.get_local_rank("pp")
    out = []
    for tied in PIPELINE["tied"]:
        for row in rows:
            ranks = [row[s] for s in tied["stages"]]
            group = torch.distributed.new_group(ranks)
            if me in ranks:
                out.append((params[tied["names"][tied["stages"].index(stage)]], group))
    return out


class _TiedSchedule(SCHEDULE):
    """torch's SCHEDULE, then each tied parameter's gradient (every microbatch's, accumulated on
    this stage's copy) all-reduced over the stages holding a copy (Megatron-LM's embedding group),
    so that every copy takes the same update, as the one parameter of the unpipelined model."""

    def __init__(self, stage: PipelineStage, n_microbatches: int, loss_fn: Any, tied: list[Any]) -> None:
        super().__init__(stage, n_microbatches=n_microbatches, loss_fn=loss_fn)
        self.tied = tied

    def step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().step(*args, **kwargs)
        with torch.no_grad():
            for param, group in self.tied:
                grad = param.grad
                if isinstance(grad, DTensor):  # its shard, laid out as the parameter (the lookup's comes back
                    grad = param.grad = grad.redistribute(param.device_mesh, param.placements)  # Replicate(): a slice)
                    grad = grad.to_local()
                torch.distributed.all_reduce(grad, group=group)
        return out
'''

_BUILD = '''

def build_pipeline(model: torch.nn.Module, mesh: DeviceMesh, loss_fn: Any, device: torch.device) -> Any:
    """This rank's stage parallelized and its schedule (run ``schedule.step(ids, target=labels)`` on the
    first and last stage, ``schedule.step()`` between; under loss_parallel() when LOSS_PARALLEL)."""
    pp = mesh["pp"]
    stage = pipeline_stage(model, pp.get_local_rank(), mesh)
    parallelize(stage.hf, mesh)
    pipe = PipelineStage(stage, pp.get_local_rank(), pp.size(), device, group=pp.get_group())
'''


def pipeline_lines(pipe: dict[str, Any]) -> list[str]:
    """The stage module, the cut, the tied parameters' copies and their schedule, the builder."""
    cls = "Schedule" + pipe["schedule"]
    text = (_GPT2_STAGE if pipe.get("body") else _HF_STAGE) + _CUT
    if pipe.get("tied"):
        text += _TIED.replace("SCHEDULE", cls) + _BUILD + (
            '    tied = tied_copies(stage.hf, mesh)  # before the schedule: new_group is collective\n'
            '    return _TiedSchedule(pipe, n_microbatches=PIPELINE["microbatches"], loss_fn=loss_fn, tied=tied)\n')
    else:
        text += _BUILD + f'    return {cls}(pipe, n_microbatches=PIPELINE["microbatches"], loss_fn=loss_fn)\n'
    return ["", "", *text.strip("\n").split("\n")]


PRESENT_FN = [
    "", "", "def _present(model: torch.nn.Module, plan: dict[str, Any]) -> dict[str, Any]:",
    "    \"\"\"The entries of ``plan`` naming a module this stage holds (not an nn.Identity).\"\"\"",
    "    names = [n for n, m in model.named_modules() if not isinstance(m, torch.nn.Identity)]",
    "    return {k: v for k, v in plan.items() if any(fnmatch.fnmatchcase(n, k) for n in names)}"]


def pipeline_constants(pipe: dict[str, Any], by_stage: list[Any] | None, collectives_doc: list[str]) -> list[str]:
    """The file's ``PIPELINE``, ``PLAN_COLLECTIVES`` (every stage's, summed) and
    ``PLAN_COLLECTIVES_BY_STAGE`` lines."""
    total: dict[str, Counter[str]] = {"forward": Counter(), "backward": Counter()}
    for st in by_stage or []:
        for ph, c in st.items():
            total[ph].update(c)
    return ["#: the stages (module prefixes; the blocks renumbered from 0 in each), the schedule",
            "#: (torch.distributed.pipelining's Schedule<name>), the microbatches per step",
            f"PIPELINE = {pipe!r}", "", *collectives_doc,
            "#: Under the pipeline: every microbatch of the step, each stage's own in PLAN_COLLECTIVES_BY_STAGE.",
            *(["#: And once per step, on each stage holding a copy of a tied parameter (PIPELINE[\"tied\"]), the",
               "#: all-reduce of the copies' gradients over pp (_TiedSchedule: a c10d all_reduce, counted as all_reduce)."]
              if pipe.get("tied") else []),
            f"PLAN_COLLECTIVES = {dict((ph, dict(sorted(c.items()))) for ph, c in total.items())!r}",
            f"PLAN_COLLECTIVES_BY_STAGE = {by_stage!r}", ""]


__all__ = ["FUNCOL", "PRESENT_FN", "SCHEDULE_CLASSES", "layers_container", "pipeline_constants", "pipeline_doc",
           "pipeline_dp_lines", "pipeline_imports", "pipeline_lines", "stage_collectives", "tied_copies"]
