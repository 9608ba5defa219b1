"""What a plan prices beyond its shardings, in the ``torch`` export (docs/export.md): the
recomputation (``--recompute``), the precision (``--precision``) and the gradient accumulation
(``--grad-accum``), stated as the file's constants ``RECOMPUTE``, ``RECOMPUTE_LAYERS``,
``PRECISION`` and ``GRAD_ACCUM``; whole-layer recomputation applied, the rest named in one warning
line (:func:`not_applied`), so that the file never trains silently other than what was priced.

Whole-layer recomputation (``full``, ``full:K``, ``every:N`` of a plan without a pipeline) is
applied as torchtitan applies its full activation checkpointing (torchtitan b5bcd76,
``torchtitan/distributed/activation_checkpoint.py``: ``ActivationCheckpointing.apply`` registers
``FullAC._wrap_block(block)``, torch's ``checkpoint_wrapper(block, preserve_rng_state=True,
early_stop=False)``, in place of each block of ``model.layers``: the whole block's forward runs again,
its last ops too, which torch's default early stop would skip; ``torchtitan/models/llama3/parallelize.py``: after the
tensor-parallel styles, before FSDP): ``parallelize`` wraps each block ``RECOMPUTE_LAYERS`` names
(``"all"``: every block) once the styles are applied and before the data-parallel wrapping. The
blocks' forward collectives over tp run again in the backward (the recomputed forward), counted
there in ``PLAN_COLLECTIVES`` (:func:`recomputed_collectives`).
"""

from __future__ import annotations

import sys
import textwrap
from collections import Counter

from spmdkit.cost.memory import recompute_every, recompute_layers
from spmdkit.planner.pipeline_split import stage_layers
from spmdkit.program.layers import layer_tags
from spmdkit.program.plan import Plan


def whole_layer(mode: str) -> bool:
    """``mode`` recomputes whole layers (``full``, ``full:K``, ``every:N``): what the file applies."""
    return mode == "full" or recompute_layers(mode) is not None or recompute_every(mode) is not None


def checkpointed_layers(plan: Plan, mode: str, pipelined: bool) -> str | tuple[str, ...]:
    """``RECOMPUTE_LAYERS``: ``"all"`` (``full``: every block), the module paths of the blocks
    ``full:K`` / ``every:N`` recompute (the first K; layers N-1, 2N-1 ... from 0:
    :func:`spmdkit.planner.pipeline_split.stage_layers` on one stage), or ``()``: none applied
    (another mode, or a pipeline, whose stages the file does not checkpoint)."""
    if pipelined or not whole_layer(mode):
        return ()
    if mode == "full":
        return "all"
    tags = layer_tags(plan.program)
    got = stage_layers(plan.program, (len(tags),), mode, 1)
    return tuple(t for t in tags if got is None or t in got)


def recomputed_collectives(plan: Plan, layers: str | tuple[str, ...], forward: dict[str, int],
                           funcol: dict[str, str]) -> dict[str, int]:
    """The forward collectives over tp that the checkpointed blocks run again in the backward: the
    forward reshards over tp of a tensor made and read inside one recomputed block (torch issues a
    collective made at a block's edge in the hook of the module outside it: the embedding's, the
    head's). ``forward``: the forward's counts, to keep only names counted there."""
    if not layers:
        return {}
    tags = set(layer_tags(plan.program))
    keep = tags if layers == "all" else set(layers)
    prog = plan.program
    made = {n: i for i, op in enumerate(prog.ops) for n in op.output_names()}
    names = plan.mesh.dim_names
    c: Counter[str] = Counter()
    for r, s in plan.collectives("forward"):
        if not any(names[d] == "tp" for d in s.mesh_dims):
            continue
        src = made.get(r.tensor)
        layer = prog.ops[r.op_index].layer
        if layer in keep and src is not None and prog.ops[src].layer == layer:
            name = funcol.get(s.kind, s.kind)
            if name in forward:
                c[name] += 1
    return dict(sorted(c.items()))


def run_constants(plan: Plan, mode: str, layers: str | tuple[str, ...]) -> list[str]:
    """The file's lines stating what the plan priced beyond its shardings."""
    return ["#: What the plan priced beyond its shardings (docs/export.md). RECOMPUTE: --recompute; RECOMPUTE_LAYERS:",
            "#: the blocks parallelize wraps in torch's checkpoint_wrapper (\"all\": every block; as torchtitan's full",
            "#: activation checkpointing), () where the file applies none of it (a warning said so). PRECISION:",
            "#: --precision (None: the model's own dtype; build the model in it, fp8 is not applied). GRAD_ACCUM:",
            "#: --grad-accum, the micro-steps per optimizer step (a training loop runs them; the file does not).",
            f"RECOMPUTE = {mode!r}", f"RECOMPUTE_LAYERS = {layers!r}",
            f"PRECISION = {plan.runtime.precision!r}", f"GRAD_ACCUM = {plan.grad_accum!r}", ""]


def priced_doc(plan: Plan, mode: str, layers: str | tuple[str, ...]) -> list[str]:
    """The file docstring's paragraph on what the plan priced beyond its shardings."""
    ckpt = ("applied: parallelize wraps every block in checkpoint_wrapper" if layers == "all" else
            f"applied: parallelize wraps {', '.join(layers)} in checkpoint_wrapper" if layers else "not applied")
    rc = "none" if mode == "none" else f"{mode} ({ckpt})"
    precision = plan.runtime.precision or "the model's own dtype"
    return textwrap.wrap(f"Priced with: recompute {rc} (RECOMPUTE, RECOMPUTE_LAYERS); precision {precision} "
                         f"(PRECISION{', not applied: convert the linears to float8 yourself' if precision == 'fp8' else ''}); "
                         f"{plan.grad_accum} micro-step{'s' if plan.grad_accum > 1 else ''} per optimizer step "
                         f"(GRAD_ACCUM{': the training loop runs them' if plan.grad_accum > 1 else ''}).", 100)


def checkpoint_fn(container: str) -> list[str]:
    """The file's ``_checkpoint_layers(model)``."""
    return [
        "", "", "def _checkpoint_layers(model: torch.nn.Module) -> None:",
        "    \"\"\"Wrap each block RECOMPUTE_LAYERS names (\"all\": every block) in torch's checkpoint_wrapper, in",
        "    place, as torchtitan's full activation checkpointing (FullAC): its forward runs again in the backward.\"\"\"",
        f"    layers = model.get_submodule({container!r})",
        "    for idx, block in list(layers.named_children()):",
        f"        if RECOMPUTE_LAYERS == \"all\" or f\"{container}.{{idx}}\" in RECOMPUTE_LAYERS:",
        "            layers.register_module(idx, checkpoint_wrapper(block, preserve_rng_state=True, early_stop=False))"]


CHECKPOINT_IMPORT = "from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper"


def not_applied(plan: Plan, mode: str, pipelined: bool) -> str | None:
    """The one warning line naming what the plan priced that the ``torch`` file does not apply, and
    what to do instead; None when it applies all of it."""
    out = []
    if mode != "none" and not checkpointed_layers(plan, mode, pipelined):
        why = "a pipeline's stages are not checkpointed" if pipelined and whole_layer(mode) else \
            "only whole-layer recompute (full, full:K, every:N) is"
        out.append(f"--recompute {mode} ({why}: checkpoint those modules in your training loop, or the memory "
                   f"priced is not what runs)")
    if plan.runtime.precision == "fp8":
        out.append("--precision fp8 (the file runs the linears in the model's dtype: convert them with torchao's "
                   "float8 (convert_to_float8_training) yourself)")
    if plan.grad_accum > 1:
        out.append(f"--grad-accum {plan.grad_accum} (parallelize applies one micro-step's shardings: run "
                   f"{plan.grad_accum} micro-steps per optimizer step in your loop; spmdkit run --engine torch runs one)")
    if not out:
        return None
    return "--export torch: the file does not apply " + "; ".join(out)


def note(plan: Plan, mode: str, pipelined: bool, command: str) -> None:
    """Print :func:`not_applied` as one ``spmdkit COMMAND: warning:`` line on stderr, if any."""
    line = not_applied(plan, mode, pipelined)
    if line:
        print(f"spmdkit {command}: warning: {line}", file=sys.stderr)


__all__ = ["CHECKPOINT_IMPORT", "checkpoint_fn", "checkpointed_layers", "not_applied", "note", "priced_doc",
           "recomputed_collectives", "run_constants", "whole_layer"]
