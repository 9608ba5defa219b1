"""A pipeline's estimate (:func:`spmdkit.planner.pipeline.estimate_pipeline`) for the terminal:
per stage its times and sends, per pipeline rank its memory, then the bubble and the step."""

from __future__ import annotations

from typing import Any, TextIO

from spmdkit.cost.memory import Memory, fit_verdict
from spmdkit.outputs.report import fmt_bytes, fmt_time, moe_load_note, plan_json, verdict_line, write_band
from spmdkit.outputs.tables import print_table
from spmdkit.planner.bubble import BubbleHint
from spmdkit.planner.pipeline import PipelineEstimate
from spmdkit.planner.pipeline_moe import MoeMemory
from spmdkit.planner.schedules import weight_pending
from spmdkit.program.plan import Plan


def write_pipeline(est: PipelineEstimate, out: TextIO) -> None:
    """The stages' table, the memory of each pipeline rank, the bubble and the step."""
    s = est.spec
    p, v, m = s.pp, s.virtual, s.microbatches
    out.write(f"\nPipeline: pp={p}, schedule {s.schedule}"
              + (f" ({v} virtual stages per device" + (f", microbatch groups of {s.group}" if s.group else "") + ")"
                 if v > 1 else "")
              + f", {m} microbatches; layers per stage {','.join(map(str, est.counts))}; "
              f"pp link {est.pp_link[0] * 1e6:g} us + {1 / est.pp_link[1] / 1e9 if est.pp_link[1] else 0:g} GB/s\n")
    rows = []
    for k, st in enumerate(est.stages):
        rows.append([str(k), str(k % p), str(st.layers), fmt_time(st.forward_s), fmt_time(st.backward_s),
                     fmt_bytes(st.send_bytes), fmt_time(est.send_f_s[k]), fmt_time(st.grad_sync_s),
                     fmt_time(st.optimizer_s)])
    print_table("Stages (per microbatch; the activation gradients come back as many bytes)",
                ["stage", "device", "layers", "forward", "backward", "send", "send time", "grad sync", "optimizer"],
                rows, out)
    rows = []
    for r in range(p):
        mm = est.memory[r]
        pend = weight_pending(s.schedule, p, m, r)
        rows.append([str(r), f"{est.in_flight[r]:g}" + (f" + {pend} W" if pend else ""), fmt_bytes(mm.parameters), fmt_bytes(mm.gradients),
                     fmt_bytes(mm.optimizer_states), fmt_bytes(mm.activation_peak), fmt_bytes(mm.total),
                     fmt_bytes(mm.reserved), fmt_bytes(mm.device_total)])
    print_table("Memory per device of each pipeline rank (in flight: microbatches of activations held"
                + ("; + W: microbatches holding only their deferred weight gradients' inputs" if s.schedule == "zb-h1"
                   else "") + "; reserved: "
                "with the caching allocator's reserve; on the device: with the CUDA context and NCCL buffers)",
                ["pp rank", "in flight", "parameters", "gradients", "optimizer", "activations", "allocated",
                 "reserved", "on the device"], rows, out)
    if est.moe is not None:
        write_moe_memory(est.moe, out)
    f = est.formula()
    if est.run is None:
        out.write(f"bubble (formula): {100 * f:.1f}% of the work; give --device for the step time\n")
        return
    run = est.run
    worst = max(range(p), key=lambda r: est.memory[r].device_total)
    cap = est.device_memory
    if cap:
        out.write(f"fullest pipeline rank {worst}: {fmt_bytes(est.memory[worst].device_total)}; "
                  f"{verdict_line(est.memory[worst], cap, est.device_name)}\n")
    out.write(f"pipeline: {fmt_time(run.pipeline_s)} for {m} microbatches; busiest device works "
              f"{fmt_time(max(run.busy_s))}; bubble {fmt_time(run.bubble_s)} = {100 * run.bubble_fraction:.1f}% "
              f"(formula {100 * f:.1f}%)\n")
    if run.hidden_s:
        r = max(range(p), key=lambda d: run.busy_s[d])
        a2a = sum(m * (st.a2a_forward_s + st.a2a_backward_s) for st in est.stages[r::p])
        out.write(f"ep all-to-all overlap (--ep-comm-overlap): the merged forwards and backwards (and the lone "
                  f"backwards' weight gradients) hide "
                  f"{fmt_time(run.hidden_s[r])} of the busiest device's {fmt_time(a2a)} of expert all-to-alls "
                  f"(one more warm-up forward per device)\n")
    when = "each microbatch's backward (Megatron-FSDP: its ZeRO gradients reduce-scattered in every one)" \
        if any(c.each for c in est.stages) else "the last backward"
    how = f"with the gradient reductions overlapping {when}" if est.grad_overlap else \
        "with the gradient reductions after the last backward (--no-grad-overlap)"
    out.write(f"step time: {fmt_time(est.step_serial_s)} serial, {fmt_time(est.step_overlap_s)} {how}\n")
    if (load := moe_load_note(est.moe_load)) is not None:
        out.write(load + "\n")
    if est.tokens:
        out.write(f"tokens/s: {est.tokens_per_s or 0:,.0f} ({est.tokens} tokens per step); MFU "
                  f"{100 * (est.mfu or 0):.1f}% ({est.tflops_per_gpu or 0:.0f} model TFLOP/s per GPU over "
                  f"{est.ranks} x {est.peak / 1e12:g} TFLOP/s on {est.device_name})\n")
        write_band(est.device_name, out, est.cp > 1, est.moe is not None)


def write_moe_memory(mm: MoeMemory, out: TextIO) -> None:
    """The fullest rank's memory split into its experts and the rest, with the divisors
    (:class:`spmdkit.planner.pipeline_moe.MoeMemory`)."""
    local = mm.expert_elements // max(1, mm.ep)
    held = f"{mm.layers} layer{'' if mm.layers == 1 else 's'}" + (
        f" and {mm.mtp_modules} MTP module{'' if mm.mtp_modules == 1 else 's'}" if mm.mtp_modules else "")
    out.write(f"MoE memory of pipeline rank {mm.rank} ({held}, {mm.moe_layers} of them with {mm.experts} experts; "
              f"experts over ep={mm.ep}, their states over edp = {mm.edp}, the rest data parallel over "
              f"{mm.dense_dp}):\n")
    rows = [["parameters", fmt_bytes(mm.expert_parameters), fmt_bytes(mm.dense_parameters)],
            ["gradients", fmt_bytes(mm.expert_gradients), fmt_bytes(mm.dense_gradients)],
            ["optimizer states", fmt_bytes(mm.expert_states), fmt_bytes(mm.dense_states)]]
    print_table(f"  experts: {mm.expert_elements:,} elements in the rank's stacks / ep {mm.ep} = {local:,} a device",
                ["", "experts", "the rest"], rows, out)
    extra = max(0.0, mm.in_flight - 1)
    out.write(f"  activations {fmt_bytes(mm.activations)} = one microbatch's working peak {fmt_bytes(mm.working_peak)}"
              f" + {extra:g} more in flight x {fmt_bytes(mm.stash)} each keeps for its backward\n")


def pipeline_plan_json(plan: Plan, est: PipelineEstimate, memory: Memory, extra: dict[str, Any]) -> dict[str, Any]:
    """``--json`` of a pipeline plan (``extra`` with its ``pipeline``): :func:`~spmdkit.outputs.report.plan_json`
    with ``memory`` the fullest rank's, and where the device states its memory ``device_memory`` and ``fits`` beside it (the report's
    'fullest pipeline rank ...: fits with ... / does not fit by ...', as a flat plan's JSON has them)."""
    doc = plan_json(plan, memory, extra)
    if est.device_memory:
        doc["memory"].update(device_memory=est.device_memory, fits=fit_verdict(memory.device_total, est.device_memory)[0])
    return doc


__all__ = ["pipeline_plan_json", "write_moe_memory", "write_pipeline"]


def bubble_line(hint: BubbleHint, global_batch: int | None = None) -> str:
    """The one line of the bubble hint (:func:`spmdkit.planner.bubble.bubble_hint`); with the
    global batch in sequences, the one that brings the bubble under the threshold."""
    more = round(global_batch * hint.times) if global_batch else None
    return (f"hint: the pipeline's bubble ({fmt_time(hint.bubble_s)} idle on the busiest rank) is "
            f"{100 * hint.share:.1f}% of the {fmt_time(hint.step_s)} step at {hint.microbatches} microbatches, over "
            f"{100 * hint.threshold:.0f}%; a global batch {hint.times:g}x as large"
            + (f" (--global-batch {more})" if more else "")
            + f", {hint.more} microbatches of the same size, brings it to {100 * hint.more_share:.1f}% "
            f"(a step of {fmt_time(hint.more_step_s)} for {hint.times:g}x the tokens)\n")
