"""Megatron's optimizer step beyond the program's update (spmdkit.cost.optimizer_step: the bytes of
each pass counted by hand from Megatron-LM's Float16OptimizerWithFloat16Params.step)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spmdkit.cost.compute import local_shape, op_cost
from spmdkit.planner.planning import plan_model
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import Runtime


@pytest.fixture(scope="module")
def layer() -> Plan:
    return plan_model("llama-7b", "tp=8", "megatron", {"layers": 1})[1]


def _updates(plan: Plan) -> list[tuple[int, int, int]]:
    """(op, elements of its parameter's shard, of its gradient as held) per adamw update."""
    out = []
    for i, op in enumerate(plan.program.ops):
        if op.rule == "adamw":
            p, g = str(op.inputs["param"]), str(op.inputs["grad"])
            n = _numel(local_shape(plan.program.tensors[p].shape, plan.ops[i].required.get("param")))
            held = _numel(local_shape(plan.program.tensors[g].shape, plan.attrs[g]))
            out.append((i, n, held))
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_megatron_adam_bf16_reads_and_writes_42_bytes_per_parameter(layer: Plan) -> None:
    # l2 norm of the fp32 main grad 4; multi_tensor_adam: fp32 param, grad, m, v read (16), param, m, v
    # written (12); the fp32 main param copied to the bf16 one 4 + 2; the fp32 grad buffer zeroed 4
    seen = 0
    for i, n, held in _updates(layer):
        c = op_cost(layer, i)
        assert n == held
        assert c.bytes == pytest.approx(42 * n, abs=40)
        assert c.kernels == 4  # norm, adam, copy back, zero
        seen += 1
    assert seen == 12


def test_fp16_adds_the_unscale_and_16_bit_grads_their_fp32_copy(layer: Plan) -> None:
    fp16 = replace(layer, runtime=Runtime(precision="fp16"))
    half = replace(layer, runtime=Runtime(precision="fp16", grad_dtype="bf16"))
    for i, n, _held in _updates(layer):
        # + torch._amp_foreach_non_finite_check_and_unscale_: the fp32 grad read and written, 8
        assert op_cost(fp16, i).bytes == pytest.approx(50 * n, abs=40)
        # + main_param.grad = model_param.grad.float(): 2 read, 4 written; the 16-bit buffer zeroed: 2 (not 4)
        assert op_cost(half, i).bytes == pytest.approx(54 * n, abs=40)
        assert op_cost(half, i).kernels == 6


def test_other_frameworks_and_bf16_states_keep_the_programs_update(layer: Plan) -> None:
    for rt in (Runtime(framework="automodel"), Runtime(optimizer_dtype="bf16")):
        other = replace(layer, runtime=rt)
        for i, n, _held in _updates(layer):
            # bf16 parameter and gradient read, fp32 master and two moments read and written, bf16 parameter
            # written: 30 (under bf16 states the program's own tensors too)
            assert op_cost(other, i).bytes == pytest.approx(30 * n, abs=40)


def test_the_distributed_optimizer_runs_its_passes_on_the_shard_and_zeroes_the_whole_buffer() -> None:
    plan = plan_model("llama-7b", "dp=2,tp=2", "dp,megatron,zero1", {"layers": 1})[1]
    seen = 0
    for i, n, held in _updates(plan):
        if held == 2 * n:  # sharded over dp
            assert op_cost(plan, i).bytes == pytest.approx(38 * n + 4 * held, abs=40)
            seen += 1
    assert seen >= 7
