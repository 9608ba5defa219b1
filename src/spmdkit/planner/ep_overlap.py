"""``--ep-comm-overlap``: what a pipeline must be for the experts' all-to-alls to overlap another
microbatch's computation.

Megatron-Core's ``--overlap-moe-expert-parallel-comm`` (with ``--delay-wgrad-compute``) runs
each steady-state forward and backward of the interleaved schedule as one merged step, the
dispatch and combine all-to-alls of each under the other's computation (the timing:
:mod:`spmdkit.planner.schedules`; docs/experts.md, "All-to-all overlap"). Megatron-Core's
``TransformerConfig.__post_init__`` (module ``megatron.core.transformer.transformer_config``)
refuses it without expert parallelism, with a pipeline but no virtual stages, with full
recomputation (granularity, method or layer count) and with ``moe`` among the recomputed
modules; its interleaved schedule refuses microbatch-level recomputation
(``checkpoint_activations_microbatch``). :func:`check_ep_comm_overlap` refuses the same here,
each as one line naming ``--ep-comm-overlap``.
"""

from __future__ import annotations

from spmdkit.core.errors import ProgramError
from spmdkit.cost.memory import MICROBATCH, recompute_layers
from spmdkit.cost.moe import ep_degree, moe_layers
from spmdkit.cost.recompute_modules import recompute_modules
from spmdkit.program.plan import Plan

FLAG = "--ep-comm-overlap"


def check_ep_comm_overlap(plan: Plan, schedule: str, recompute: str) -> None:
    """ProgramError naming :data:`FLAG` where the plan's pipeline cannot merge its forwards and
    backwards as Megatron-Core does (module docstring); nothing where the flag is off."""
    if not plan.runtime.ep_comm_overlap:
        return
    if schedule != "interleaved":
        raise ProgramError(f"{FLAG}: merges the steady-state forward and backward of the interleaved schedule "
                           f"(Megatron-Core requires virtual pipeline stages); --schedule {schedule} has none to "
                           f"merge (give --schedule interleaved --virtual-stages V)")
    if plan.runtime.fsdp2:
        raise ProgramError(f"{FLAG}: Megatron-Core's merged forward and backward; --framework "
                           f"{plan.runtime.framework} runs torch's pipelining schedules (give --framework megatron)")
    layers = moe_layers(plan.program)
    if not layers:
        raise ProgramError(f"{FLAG}: overlaps the experts' all-to-alls; the model has no MoE layer")
    if max(ep_degree(plan, layer) for layer in layers) < 2:
        raise ProgramError(f"{FLAG}: overlaps the experts' all-to-alls over ep; the experts are not expert-parallel "
                           f"(give --mesh with ep=E > 1 and --strategy ...,ep)")
    if recompute == "full" or recompute_layers(recompute) is not None or recompute == MICROBATCH:
        raise ProgramError(f"{FLAG}: Megatron-Core refuses --recompute {recompute[:40]} with the all-to-all overlap "
                           f"(full and microbatch-level recomputation); give selective or selective:M1,M2")
    if "moe" in (recompute_modules(recompute) or ()):
        raise ProgramError(f"{FLAG}: Megatron-Core refuses the recomputed module moe with the all-to-all overlap "
                           f"(--recompute {recompute[:60]}); recompute moe_act instead")


__all__ = ["FLAG", "check_ep_comm_overlap"]
