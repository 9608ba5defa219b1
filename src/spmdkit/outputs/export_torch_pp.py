"""The pipeline part of the ``torch`` export (:mod:`spmdkit.outputs.export_torch`): ``PIPELINE``
(each stage's module prefixes, torch's schedule, the microbatches), the stage module and
``build_pipeline`` (``torch.distributed.pipelining``'s ``PipelineStage`` and ``Schedule1F1B`` /
``ScheduleGPipe``), and each stage's collectives (``PLAN_COLLECTIVES_BY_STAGE``).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from spmdkit.outputs.export import ExportError
from spmdkit.planner.pipeline import PipelineSpec, op_stages
from spmdkit.program.layers import layer_tags
from spmdkit.program.plan import Plan
from spmdkit.strategies.hf import parameters

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


def pipeline_doc(plan: Plan, spec: PipelineSpec, counts: tuple[int, ...]) -> dict[str, Any]:
    """``PIPELINE`` of a pipeline plan (``plan``: one microbatch's on the sub-mesh without pp):
    the module prefixes of each stage (its blocks; the embedding with the first, the final norm
    and the head with the last, as the plan cuts them: :func:`spmdkit.planner.pipeline.op_stages`),
    the schedule (torch's name), the microbatches, the layers container and the modules outside it
    (``ends``: the stages that do not hold one get an ``nn.Identity``)."""
    if spec.schedule not in SCHEDULE_CLASSES:
        raise ExportError(f"--export torch: --schedule {spec.schedule}: not exported (torch's Schedule1F1B and "
                          f"ScheduleGPipe are: one stage a rank)")
    prog = plan.program
    aliases: dict[str, str] = getattr(prog, "aliases", None) or {}
    if aliases:
        tied = ", ".join(f"{a} = {t}" for a, t in sorted(aliases.items()))
        raise ExportError(f"--export torch: a pipeline of a model with tied parameters ({tied}): the stages would "
                          f"each hold a copy and torch's pipelining does not sum their gradients; untie them")
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
    first_ends = [m for m in ends if m in stages[0]]
    if len(first_ends) > 1:
        raise ExportError(f"--export torch: a pipeline whose first stage holds {', '.join(first_ends)} besides the "
                          f"blocks: HF's model, given the hidden states on a later stage, would run all but the token "
                          f"embedding again (GPT-2's position embedding); not exported")
    return {"stages": stages, "schedule": SCHEDULE_CLASSES[spec.schedule].removeprefix("Schedule"),
            "microbatches": spec.microbatches, "layers": container, "ends": ends}


def stage_collectives(plan: Plan, counts: tuple[int, ...], microbatches: int,
                      torch_local: frozenset[str] = frozenset()) -> list[dict[str, dict[str, int]]]:
    """The plan's tp collectives of each stage per step (every microbatch), as :func:`tp_collectives`."""
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
    return [{ph: dict(sorted(c.items())) for ph, c in d.items()} for d in out]


def pipeline_lines(pipe: dict[str, Any]) -> list[str]:
    """The stage module and its builder."""
    cls = "Schedule" + pipe["schedule"]
    return ["", "", "class _Stage(torch.nn.Module):",
            "    \"\"\"One pipeline stage: the model with this stage's modules only, fed the token ids (the first",
            "    stage) or the previous stage's hidden states; returns the logits (the last) or its hidden states.\"\"\"",
            "", "    def __init__(self, hf: torch.nn.Module, first: bool) -> None:",
            "        super().__init__()", "        self.hf, self.first = hf, first", "",
            "    def forward(self, x: torch.Tensor) -> torch.Tensor:",
            "        out = self.hf(input_ids=x) if self.first else self.hf(inputs_embeds=x)",
            "        return out.logits", "", "",
            "def pipeline_stage(model: torch.nn.Module, pp_rank: int, mesh: DeviceMesh) -> torch.nn.Module:",
            "    \"\"\"The stage of ``pp_rank`` (PIPELINE[\"stages\"][pp_rank]): the other blocks dropped (this stage's",
            "    are renumbered from 0), the embedding / final norm / head it does not hold made nn.Identity; then",
            "    ``parallelize(stage.hf, mesh)``.\"\"\"",
            "    keep = set(PIPELINE[\"stages\"][pp_rank])",
            "    container = PIPELINE[\"layers\"]",
            "    blocks = model.get_submodule(container)",
            "    owner, leaf = container.rsplit(\".\", 1) if \".\" in container else (\"\", container)",
            "    setattr(model.get_submodule(owner), leaf,",
            "            torch.nn.ModuleList([b for i, b in enumerate(blocks) if f\"{container}.{i}\" in keep]))",
            "    for name in PIPELINE[\"ends\"]:",
            "        if name not in keep:",
            "            owner, leaf = name.rsplit(\".\", 1) if \".\" in name else (\"\", name)",
            "            setattr(model.get_submodule(owner), leaf, torch.nn.Identity())",
            "    return _Stage(model, first=pp_rank == 0)", "", "",
            "def build_pipeline(model: torch.nn.Module, mesh: DeviceMesh, loss_fn: Any, device: torch.device) -> Any:",
            "    \"\"\"This rank's stage parallelized and its schedule (run ``schedule.step(ids, target=labels)`` on the",
            "    first and last stage, ``schedule.step()`` between; under loss_parallel() when LOSS_PARALLEL).\"\"\"",
            "    pp = mesh[\"pp\"]",
            "    stage = pipeline_stage(model, pp.get_local_rank(), mesh)",
            "    parallelize(stage.hf, mesh)",
            "    pipe = PipelineStage(stage, pp.get_local_rank(), pp.size(), device, group=pp.get_group())",
            f"    return {cls}(pipe, n_microbatches=PIPELINE[\"microbatches\"], loss_fn=loss_fn)"]


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
            f"PLAN_COLLECTIVES = {dict((ph, dict(sorted(c.items()))) for ph, c in total.items())!r}",
            f"PLAN_COLLECTIVES_BY_STAGE = {by_stage!r}", ""]


__all__ = ["FUNCOL", "PRESENT_FN", "SCHEDULE_CLASSES", "layers_container", "pipeline_constants", "pipeline_doc",
           "pipeline_lines", "stage_collectives"]
