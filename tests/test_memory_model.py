"""Memory as the frameworks allocate it, against published figures and hand-computed values:
reads for the shape only keep nothing alive, Korthikanti et al.'s activation formulas,
Megatron-LM's bytes per parameter, fp8 stashes, the pipeline's microbatches in flight,
ZeRO over a dp that divides no axis, torchtitan's measured peaks, and the fit verdict."""

from __future__ import annotations

import random
import re
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from spmdkit.core.errors import ProgramError
from spmdkit.cost.devices import preset_device
from spmdkit.cost.memory import (
    ALLOCATOR_RESERVE,
    CUDA_CONTEXT_BYTES,
    NCCL_BYTES_PER_GROUP,
    fit_verdict,
    memory_per_device,
    with_overheads,
)
from spmdkit.cost.memory_saved import SHAPE_ONLY, saved_activations, value_spans
from spmdkit.models.zoo import ModelConfig, build_model
from spmdkit.outputs.html import render_html
from spmdkit.planner.pipeline import estimate_pipeline, in_flight, stage_costs
from spmdkit.planner.pipeline_split import PipelineSpec, op_stages, split_layers
from spmdkit.planner.planning import plan_model
from spmdkit.planner.propagate import propagate
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import Runtime
from spmdkit.sim.cases import GENERATORS, TGen, make_array, ref_global
from spmdkit.sim.reference import get_reference
from spmdkit.strategies.strategy import annotate, parse_mesh, parse_strategy, zero3_storage

GiB = 1024**3


def _plan(cfg: ModelConfig, mesh_text: str, strategy: str, runtime: Runtime | None = None,
          vocab_parallel: bool = True) -> Plan:
    mesh = parse_mesh(mesh_text)
    model = build_model(cfg, vocab_parallel_loss=vocab_parallel, check_rules=False)
    st = parse_strategy(strategy, mesh)
    ann = annotate(model, mesh, st)
    plan = propagate(model.program, mesh, ann, storage=zero3_storage(model.optimizer, ann, st))
    return replace(plan, runtime=runtime) if runtime is not None else plan


# -- reads for the shape only -----------------------------------------------------------------------


def test_shape_only_reads_need_no_values() -> None:
    """Each grad rule's SHAPE_ONLY inputs: its numpy reference gives the same outputs whatever
    their values (only their shapes matter), so memory may drop them after the forward."""
    checked = 0
    for rule, params in SHAPE_ONLY.items():
        ref = get_reference(rule)
        if ref is None or ref.family not in GENERATORS:
            continue
        for seed in range(3):
            r = random.Random(f"{rule}:{seed}")
            spec = GENERATORS[ref.family](r, [1], ref)
            rng = np.random.default_rng(seed)
            args: dict[str, Any] = {k: make_array(v.shape, v.domain or ref.domain(k), rng) if isinstance(v, TGen) else v
                                    for k, v in spec.items()}
            if ref.prepare is not None:
                ref.prepare(args)
            if not any(isinstance(args.get(p), np.ndarray) for p in params):
                continue
            base = ref_global(ref, args)
            other = dict(args)
            for p in params:
                if isinstance(args.get(p), np.ndarray):
                    other[p] = make_array(args[p].shape, ref.domain(p), np.random.default_rng(seed + 100)) + 0.5
            again = ref_global(ref, other)
            for a, b in zip(base, again):
                if a is not None:
                    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{rule}: {sorted(params)}")
            checked += 1
    assert checked >= 15


def test_narayanan_17b_activation_peak_without_shape_reads() -> None:
    """Narayanan et al. 2021 Table 1's 1.7B (micro-batch 16, seq 2048, full recomputation): the
    scaled scores QK^T/sqrt(d) (read by the mask add's grad for their shape only) no longer live
    to the backward; the activation peak is about 13 GiB (it was 105 GiB), and the run fits."""
    cfg = ModelConfig("gpt2", 24, 2304, 24, None, 9216, 51200, 2048, 32 * 16, "bfloat16")
    plan = _plan(cfg, "dp=32,tp=1", "megatron")
    mem = memory_per_device(plan, "full")
    assert 12 * GiB < mem.activation_peak < 14 * GiB
    _first, last, _fwd_last = value_spans(plan.program)
    n = "layers.0.scores.scaled"
    assert plan.program.ops[last[n]].phase == "forward"
    # one layer's recomputed activations (34 s b h + 5 a s^2 b) and the saved layer inputs at most
    s, b, h, a = 2048, 16, 2304, 24
    assert mem.activation_peak < (34 * s * b * h + 5 * a * s * s * b) + 24 * 2 * s * b * h + 4 * s * b * 51200 * 2
    assert mem.device_total < preset_device("a100-80gb").memory_bytes


# -- Korthikanti et al. 2022, Table 2 ---------------------------------------------------------------


@pytest.mark.parametrize("mesh_text,strategy", [("dp=1", "dp"), ("tp=4", "megatron"), ("tp=4", "megatron,sp")])
def test_korthikanti_activations_per_layer(mesh_text: str, strategy: str) -> None:
    """Activations a layer keeps for the backward, bytes (16-bit, 1-byte dropout masks): 34 s b h
    + 5 a s^2 b without parallelism, s b h (10 + 24/t + 5 a s/(h t)) with tensor parallelism,
    s b h/t (34 + 5 a s/h) with sequence parallelism too (Korthikanti et al. 2022, Table 2)."""
    s, b, h, a = 2048, 4, 1024, 16
    cfg = ModelConfig("gpt2", 2, h, a, None, 4 * h, 51200, s, b, "bfloat16", 0.1)
    plan = _plan(cfg, mesh_text, strategy)
    t = plan.mesh.shape[-1]
    want = {"dp": s * b * h * (34 + 5 * a * s / h),
            "megatron": s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
            "megatron,sp": s * b * h / t * (34 + 5 * a * s / h)}[strategy]
    got = saved_activations(plan, "none").per_layer["layer 1"]
    assert got == pytest.approx(want, rel=1e-3)  # the norms' fp32 mean / variance beyond the paper's count


# -- bytes per parameter --------------------------------------------------------------------------


@pytest.mark.parametrize("precision,per_param", [("fp32", (4, 4, 8)), ("fp16", (2, 2, 16)), ("bf16", (2, 4, 12))])
def test_megatron_bytes_per_parameter(precision: str, per_param: tuple[int, int, int]) -> None:
    """Megatron-LM's table (docs/api-guide/dist_optimizer.md): 16 bytes a parameter in fp32, 20
    with fp16 parameters and gradients, 18 with bf16 parameters and fp32 gradients."""
    dtype = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[precision]
    model, plan, _ = plan_model("gpt2-small", "dp=2", "dp", {"layers": 1})
    if dtype != "bfloat16":
        cfg = replace(model.config, dtype=dtype)
        plan = _plan(cfg, "dp=2", "dp", vocab_parallel=False)
    prog = plan.program
    psi = sum(t.numel for t in prog.tensors.values() if t.kind == "parameter" and not t.inplace_of)
    n_params = sum(1 for t in prog.tensors.values() if t.kind == "parameter" and not t.inplace_of)
    mem = memory_per_device(replace(plan, runtime=Runtime(precision)))
    assert (mem.parameters, mem.gradients, mem.optimizer_states - 8 * n_params) == tuple(k * psi for k in per_param)


def test_fp8_under_transformer_engine() -> None:
    """--precision fp8 with Megatron-LM / TE: each linear weight gains an fp8 copy and its
    transpose (2 bytes an element); the input of a linear layer that only the linear's
    backward reads is kept in fp8 (half of bf16). torchtitan's float8 keeps neither."""
    _model, plan, _ = plan_model("gpt2-small", "dp=2", "dp", {"layers": 1})
    bf16 = memory_per_device(replace(plan, runtime=Runtime("bf16")))
    fp8 = memory_per_device(replace(plan, runtime=Runtime("fp8")))
    prog = plan.program
    linear = {op.inputs["y"] for op in prog.ops if op.phase == "forward" and op.rule == "matmul"
              and isinstance(op.inputs.get("y"), str) and prog.tensors[op.inputs["y"]].kind == "parameter"}
    # not the output head (here the tied embedding): Megatron-Core's output_layer is a plain
    # ColumnParallelLinear, no Transformer Engine module, and keeps no fp8 copy
    head = [op.inputs["y"] for op in prog.ops if op.phase == "forward" and op.rule == "matmul"
            and op.inputs.get("y") in linear][-1]
    assert 50304 in prog.tensors[head].shape, (head, prog.tensors[head].shape)
    assert fp8.parameters - bf16.parameters == 2 * sum(prog.tensors[w].numel for w in linear - {head})
    saved16 = dict(x for lst in bf16.saved.tensors.values() for x in lst)
    saved8 = dict(x for lst in fp8.saved.tensors.values() for x in lst)
    assert saved8["layers.0.gelu"] * 2 == saved16["layers.0.gelu"]  # read only by fc2's weight gradient
    assert saved8["layers.0.fc1.out"] == saved16["layers.0.fc1.out"]  # read by gelu's backward too
    titan = memory_per_device(replace(plan, runtime=Runtime("fp8", "torchtitan")))
    assert dict(x for lst in titan.saved.tensors.values() for x in lst) == saved16


# -- the pipeline's microbatches in flight ----------------------------------------------------------


def test_pipeline_stash_per_schedule() -> None:
    """1F1B: pipeline rank r holds p - r microbatches; interleaved (Megatron-LM's warm-up count
    plus one): the first rank p + (p - 1)/v stage-microbatches (Narayanan et al. 2021, Sec. 2.2).
    Each rank's activations: its working peak plus the stash of the others in flight."""
    assert [in_flight("1f1b", 4, 1, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert in_flight("interleaved", 4, 2, 8, 0) == pytest.approx(4 + 3 / 2)
    assert in_flight("gpipe", 4, 1, 8, 2) == 8
    cfg = ModelConfig("gpt2", 8, 512, 8, None, 2048, 1024, 512, 2, "bfloat16")
    plan = _plan(cfg, "dp=1,tp=2", "megatron")
    spec = PipelineSpec(4, 8, "1f1b", 1)
    counts = split_layers(8, spec)
    est = estimate_pipeline(plan, spec, counts, recompute="full")
    costs = stage_costs(plan, op_stages(plan.program, counts), counts, recompute="full")
    for r in range(4):
        assert est.memory[r].activation_peak == costs[r].working_peak + (4 - r - 1) * costs[r].stash_bytes
    # full recomputation: a middle stage stashes its two layers' inputs, s b h x 2 bytes each
    assert costs[1].stash_bytes == 2 * (512 * 2 * 512 * 2)


def test_pipeline_page_chart_agrees_with_its_card() -> None:
    """The HTML page of a pipeline plan draws the fullest pipeline rank: the chart's peak is the
    allocated peak of the rank whose memory the card shows."""
    cfg = ModelConfig("gpt2", 8, 512, 8, None, 2048, 1024, 512, 2, "bfloat16")
    plan = _plan(cfg, "dp=1,tp=2", "megatron")
    spec = PipelineSpec(4, 8, "1f1b", 1)
    dev = preset_device("h100")
    est = estimate_pipeline(plan, spec, split_layers(8, spec), dev, (2e-5, 1 / 50e9), 8 * 2 * 512, 8, recompute="full")
    worst = max(est.memory, key=lambda m: m.device_total)
    page = render_html(plan, "pp", worst, None, recompute="full", pipeline=est)
    assert int(re.search(r'data-peak="(\d+)"', page).group(1)) == worst.total  # type: ignore[union-attr]
    card = re.search(r"<div>memory per device<b>([^<]*)</b>", page).group(1)  # type: ignore[union-attr]
    assert card == f"{worst.device_total / GiB:.2f} GiB"
    assert "fits with" in page


# -- ZeRO over a dp that divides no axis ------------------------------------------------------------


def test_zero_over_a_dp_that_divides_no_axis_shards_by_bytes() -> None:
    """gpt2-small on dp=7 (768, 3072, 50257 and 1024 are not multiples of 7): ZeRO still shards
    the optimizer states (and gradients, parameters) about 1/7 each, as flat-buffer ZeRO does,
    and reduce-scatters the gradients."""
    for stage, shard in (("zero1", (1, 1, 7)), ("zero2", (1, 7, 7)), ("zero3", (7, 7, 7))):
        model, plan, _ = plan_model("gpt2-small", "dp=7", stage, {"layers": 1, "batch": 7})  # a sequence a rank
        prog = model.program
        psi = sum(t.numel for t in prog.tensors.values() if t.kind == "parameter" and not t.inplace_of)
        mem = memory_per_device(plan)
        got = (mem.parameters / psi, mem.gradients / psi, mem.optimizer_states / psi)
        assert got == pytest.approx((2 / shard[0], 4 / shard[1], 12 / shard[2]), rel=2e-3)
        kinds = {s.kind for _, s in plan.collectives("backward")}
        assert ("reduce_scatter" in kinds) == (stage != "zero1")


# -- torchtitan's measured peaks ----------------------------------------------------------------------


#: torchtitan benchmarks/llama3_h100_202412_torchtitan.md (H100 96 GB at 500 W, torch.compile on):
#: (table row, GPUs = FSDP degree, local batch, seq, recompute, float8 linears, measured GiB)
TITAN_8B = [("Table 1, FSDP, compile", 8, 2, 8192, "selective", False, 77.0),
            ("Table 3, 128 GPUs, FSDP, compile", 128, 2, 8192, "selective", False, 62.0),
            ("Table 2, 8 GPUs, seq 32768, full AC, float8", 8, 1, 32768, "full", True, 83.9)]


@pytest.mark.parametrize("row", TITAN_8B, ids=[r[0] for r in TITAN_8B])
def test_torchtitan_llama3_8b_peak_memory(row: tuple[str, int, int, int, str, bool, float]) -> None:
    """torchtitan's Llama 3.1 8B (hidden 4096, 32 layers, 32 heads, 8 kv heads, FFN 14336, vocab
    128256; FSDP2 with bf16 compute; selective = its op-level policy, full = whole layers; the
    loss in fp32): the predicted reserved peak (torch.cuda.max_memory_reserved, which torchtitan
    logs as its memory) within 10% of the measured one."""
    _name, dp, local, seq, recompute, float8, measured = row
    cfg = ModelConfig("llama", 32, 4096, 32, 8, 14336, 128256, seq, dp * local, "bfloat16")
    plan = _plan(cfg, f"dp={dp}", "fsdp", Runtime("fp8" if float8 else "bf16", "torchtitan", compile=True),
                 vocab_parallel=False)
    mem = memory_per_device(plan, recompute)
    assert mem.reserved / GiB == pytest.approx(measured, rel=0.10)


# -- the verdict ----------------------------------------------------------------------------------------


def test_a_plan_at_95_percent_of_hbm_does_not_fit() -> None:
    """What the GPU must hold: the allocated peak, the caching allocator's reserve on its
    activations, the CUDA context and one NCCL communicator per mesh dim; 95% of HBM allocated
    does not fit."""
    _, plan, _ = plan_model("tiny-llama", "dp=2,tp=2", "megatron", {})
    cap = preset_device("a100-80gb").memory_bytes
    quarter = int(0.95 * cap) // 4  # 95% of HBM allocated, half of it activations
    mem = with_overheads(quarter, quarter // 2, quarter // 2, 2 * quarter, 0, plan)
    assert mem.runtime_overhead == CUDA_CONTEXT_BYTES + 2 * NCCL_BYTES_PER_GROUP
    assert mem.reserved == mem.total + round(ALLOCATOR_RESERVE * mem.activation_peak)
    fits, text = fit_verdict(mem.device_total, cap)
    assert not fits and text.startswith("does not fit by ")
    small = with_overheads(quarter // 2, quarter // 4, quarter // 4, quarter, 0, plan)
    fits, text = fit_verdict(small.device_total, cap)
    gib = (cap - small.device_total) / GiB
    assert fits and text.startswith(f"fits with {gib:.1f} GiB headroom")


def test_microbatch_level_recomputation() -> None:
    """Korthikanti et al. 2022, App. C: each pipeline rank keeps every activation of as many of
    its in-flight microbatches as fit and recomputes the attention core of the others: its
    memory between selective's and the device's, its step no slower than selective's; a flat
    plan refuses the mode with one line naming --recompute."""
    cfg = ModelConfig("gpt2", 8, 1024, 16, None, 4096, 1024, 1024, 4, "bfloat16")
    plan = _plan(cfg, "dp=1,tp=2", "megatron,sp")
    spec = PipelineSpec(4, 8, "1f1b", 1)
    counts = split_layers(8, spec)
    dev = preset_device("a100-40gb")

    def run(rc: str, device: Any) -> Any:
        return estimate_pipeline(plan, spec, counts, device, (2e-5, 1 / 50e9), 8 * 4 * 1024, 8, recompute=rc)

    sel, none = run("selective", dev), run("none", dev)
    # a device between the two on the first rank: some of its microbatches fit whole, not all
    small = replace(dev, memory_bytes=(sel.memory[0].device_total + none.memory[0].device_total) // 2)
    sel, none, mb = run("selective", small), run("none", small), run("microbatch", small)
    share = mb.extra["microbatch_recompute"]["recomputed_share"]
    assert any(0 < s < 1 for s in share), share  # some microbatches kept whole, some recomputed
    for r in range(4):
        assert sel.memory[r].device_total <= mb.memory[r].device_total <= max(small.memory_bytes,
                                                                                sel.memory[r].device_total)
        assert mb.memory[r].device_total <= none.memory[r].device_total
    assert none.step_overlap_s <= mb.step_overlap_s <= sel.step_overlap_s
    with pytest.raises(ProgramError, match=r"--recompute microbatch: .*pipeline"):
        memory_per_device(plan, "microbatch")


def test_fit_verdict_names_the_capacity_it_judged() -> None:
    # the share's capacity was rounded to whole GiB: a 2 GB --memory cap (1.86 GiB, as the --devices table
    # says it) read '... of 2 GiB', a 512 MiB one '... of 0 GiB'; the presets keep their whole figure
    assert fit_verdict(GiB, 2 * 10**9)[1] == "fits with 0.9 GiB headroom (54% of 1.86 GiB)"
    assert fit_verdict(GiB, 512 * 2**20)[1] == "does not fit by 0.5 GiB (200% of 0.5 GiB)"
    assert fit_verdict(40 * GiB, 80 * GiB)[1] == "fits with 40.0 GiB headroom (50% of 80 GiB)"
    assert fit_verdict(40 * GiB, 141 * GiB)[1].endswith("(28% of 141 GiB)")
