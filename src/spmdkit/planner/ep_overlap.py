"""``--ep-comm-overlap``: what a pipeline must be for the experts' all-to-alls to overlap another
microbatch's computation, and the merged steps of a plan without a pipeline.

Megatron-Core's ``--overlap-moe-expert-parallel-comm`` (with ``--delay-wgrad-compute``) runs
each steady-state forward and backward of the interleaved schedule as one merged step, the
dispatch and combine all-to-alls of each under the other's computation (the timing:
:mod:`spmdkit.planner.schedules`; docs/experts.md, "All-to-all overlap"). Megatron-Core's
``TransformerConfig.__post_init__`` (module ``megatron.core.transformer.transformer_config``)
refuses it without expert parallelism, on an fp32 model, with a pipeline but no virtual stages, with full
recomputation (granularity, method or layer count) and with ``moe`` among the recomputed
modules; its interleaved schedule refuses microbatch-level recomputation
(``checkpoint_activations_microbatch``). :func:`check_ep_comm_overlap` refuses the same here,
each as one line naming ``--ep-comm-overlap``.

Without a pipeline (NVIDIA/Megatron-LM ae1c88296f, 2025-08-01, "Support EP A2A overlap at PP=1";
the same at d98e8a64dd): ``forward_backward_no_pipelining`` calls
``combined_1f1b_schedule_for_no_pipelining`` (``megatron/core/pipeline_parallel/combined_1f1b.py``),
which runs the first microbatch's forward alone, then ``m - 1`` merged steps (the forward of
microbatch ``i + 1`` with the backward of microbatch ``i``, inside ``no_sync_func``), then the last
microbatch's backward alone, outside ``no_sync_func`` (its gradients reduced as without the
overlap), each through ``combined_forward_backward_step`` and the same
``TransformerModelChunkSchedulePlan.run`` as the interleaved pipeline's. That is the interleaved
schedule's order on one device with one model chunk and the overlap's one extra warm-up forward
(``(p - r - 1) 2 + (v - 1) p + 1 = 1``), so :func:`flat_overlap` times it with the pipeline's own
engine (:func:`spmdkit.planner.schedules.run_schedule`, :func:`spmdkit.planner.chunk_plan.chunk_run`)
on the plan's one stage. ``TransformerConfig.__post_init__`` at ae1c88296f required PP = 1 (virtual
stages where PP > 1 since d7bf5aaaa8); its other refusals are the pipeline's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.cost.devices import Device
from spmdkit.cost.memory import MICROBATCH, recompute_layers
from spmdkit.cost.moe import a2a_compute_share, ep_degree, moe_layers
from spmdkit.cost.recompute_modules import recompute_modules
from spmdkit.cost.step import StepEstimate
from spmdkit.planner.chunk_plan import ChunkOps
from spmdkit.planner.schedules import ScheduleRun, run_schedule
from spmdkit.planner.stage_costs import stage_costs
from spmdkit.program.layers import layer_tags
from spmdkit.program.plan import Plan

FLAG = "--ep-comm-overlap"


def check_ep_comm_overlap(plan: Plan, schedule: str | None, recompute: str) -> None:
    """ProgramError naming :data:`FLAG` where the plan's pipeline (``schedule``; None: no pipeline)
    cannot merge its forwards and backwards as Megatron-Core does (module docstring); nothing where
    the flag is off."""
    if not plan.runtime.ep_comm_overlap:
        return
    if schedule is not None and schedule != "interleaved":
        raise ProgramError(f"{FLAG}: merges the steady-state forward and backward of the interleaved schedule "
                           f"(Megatron-Core requires virtual pipeline stages); --schedule {schedule} has none to "
                           f"merge (give --schedule interleaved --virtual-stages V)")
    if plan.runtime.fsdp2:
        raise ProgramError(f"{FLAG}: Megatron-Core's merged forward and backward; --framework "
                           f"{plan.runtime.framework} runs torch's "
                           f"{'pipelining schedules' if schedule else 'FSDP2 training loop'} (give --framework megatron)")
    if plan.runtime.precision == "fp32":
        raise ProgramError(f"{FLAG}: Megatron-Core runs the all-to-all overlap on a bf16 or fp16 model only "
                           f"(TransformerConfig: 'only supported with bf16 or fp16 model'); give --precision bf16")
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


@dataclass(frozen=True)
class FlatOverlap:
    """``--ep-comm-overlap`` without a pipeline (module docstring): per device, the step's
    ``microbatches`` (its gradient-accumulation micro-steps) as Megatron-Core runs them, one
    microbatch's forward and backward seconds unmerged and its expert all-to-alls, the seconds of
    the merged schedule and those it hides (``m (F + B) - merged``), the compute share beside a
    DeepEP all-to-all and the microbatch's nodes (:class:`~spmdkit.planner.chunk_plan.ChunkOps`)."""

    microbatches: int
    forward_s: float
    backward_s: float
    a2a_s: float
    merged_s: float
    hidden_s: float
    compute_share: float
    chunk: ChunkOps

    def to_json(self) -> dict[str, Any]:
        return {"schedule": "combined_1f1b_schedule_for_no_pipelining", "microbatches": self.microbatches,
                "merged_steps": max(0, self.microbatches - 1), "forward_s": self.forward_s,
                "backward_s": self.backward_s, "a2a_s": self.a2a_s, "merged_s": self.merged_s,
                "hidden_s": self.hidden_s, "compute_share": self.compute_share, "chunk": asdict(self.chunk)}


def flat_schedule(chunk: ChunkOps, forward_s: float, backward_s: float, m: int, share: float = 1.0) -> ScheduleRun:
    """``m`` microbatches of one model chunk (``chunk``; unmerged ``forward_s`` / ``backward_s``) in
    ``combined_1f1b_schedule_for_no_pipelining``'s order, F0; F1 + B0; ...; F(m-1) + B(m-2); B(m-1)
    (module docstring): the interleaved schedule's run on one device, one chunk and one extra
    warm-up forward (:func:`spmdkit.planner.schedules.run_schedule`)."""
    return run_schedule("interleaved", 1, 1, m, [forward_s], [backward_s], a2a=[chunk], a2a_share=share)


def flat_overlap(plan: Plan, device: Device, recompute: str) -> FlatOverlap:
    """The merged steps of ``plan`` without a pipeline (module docstring): its ops as one stage's
    (:func:`spmdkit.planner.stage_costs.stage_costs`, the chunk's nodes), its ``grad_accum``
    microbatches in Megatron-Core's PP = 1 order (F0; F1 + B0; ...; B(m-1)) through
    :func:`spmdkit.planner.schedules.run_schedule` on one device and one model chunk."""
    check_ep_comm_overlap(plan, None, recompute)
    prog = plan.program
    counts = (len(layer_tags(prog)),)
    sc = stage_costs(plan, [0] * len(prog.ops), counts, device.lockstep(plan.mesh.size), recompute)[0]
    chunk = sc.chunk or ChunkOps()
    share = a2a_compute_share(plan, device.rates.sms, device.nccl_p2p_channels)
    m = plan.grad_accum
    f, b = sc.forward_s, sc.backward_s + sc.recompute_s
    run = flat_schedule(chunk, f, b, m, share)
    return FlatOverlap(m, f, b, sc.a2a_forward_s + sc.a2a_backward_s, run.pipeline_s, run.hidden_s[0], share, chunk)


def apply_flat_overlap(plan: Plan, est: StepEstimate, recompute: str) -> StepEstimate:
    """``est`` (the flat step, :func:`spmdkit.cost.step.estimate_step`) with the merged steps'
    hidden seconds taken off its step time and its blocking communication
    (:attr:`StepEstimate.ep_overlap`); the gradient reductions stay those of the last backward,
    timed as without the overlap (module docstring)."""
    got = flat_overlap(plan, est.device, recompute)
    est.step_overlap_s -= got.hidden_s
    est.exposed_s["blocking"] = est.exposed_s.get("blocking", 0.0) - got.hidden_s
    est.ep_overlap = got.to_json()
    return est


__all__ = ["FLAG", "FlatOverlap", "apply_flat_overlap", "check_ep_comm_overlap", "flat_overlap", "flat_schedule"]
