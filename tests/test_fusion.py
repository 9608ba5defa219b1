"""Kernels that do several program ops' work (spmdkit.cost.fusion) and torch's add backward
(spmdkit.ops.elementwise): each op's bytes and kernels counted by hand on a one-layer gpt2 with
dropout (hidden 64, 4 heads, seq 32, batch 2, tp=2: 2 x 32 x 64 = 4096 elements on the residual
stream, 2 x 2 x 32 x 32 = 4096 local scores), and the Korthikanti et al. 2022 Table 4 layer's
forward and backward split."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from spmdkit.cost.compute import op_cost
from spmdkit.cost.devices import DEVICES
from spmdkit.cost.fusion import fused_ops
from spmdkit.engine.facts import LocalOp
from spmdkit.ops.elementwise import _add_grad_cost
from spmdkit.planner.planning import plan_model
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import Runtime

BF16 = 2
RESID = 2 * 32 * 64  # the residual stream's elements (tp replicates it)
SCORES = 2 * 2 * 32 * 32  # batch x local heads x seq x seq


def _plan(framework: str) -> Plan:
    _, plan, _ = plan_model("gpt-dropout-small", "tp=2", "megatron",
                            {"layers": 1, "hidden": 64, "heads": 4, "ffn": 256, "vocab": 512, "seq": 32, "batch": 2})
    return replace(plan, runtime=Runtime(framework=framework))


def _op(plan: Plan, name: str) -> int:
    return next(i for i, op in enumerate(plan.program.ops) if op.name == name)


def test_add_backward_runs_no_kernel_unless_it_sums_or_casts() -> None:
    same = LocalOp("add_grad", {}, {"x": [((4, 8), 2, "bfloat16")], "y": [((4, 8), 2, "bfloat16")],
                                    "out_grad": [((4, 8), 2, "bfloat16")]},
                   [((4, 8), 2, "bfloat16"), ((4, 8), 2, "bfloat16")])
    c = _add_grad_cost(same)
    assert (c.bytes, c.kernels) == (0.0, 0) and DEVICES["h100"].op_time(c) == 0.0
    # a bias [8] broadcast over 4 rows: its gradient is out_grad summed over the rows (64 B read, 16 written)
    bias = LocalOp("add_grad", {}, {"x": [((4, 8), 2, "bfloat16")], "y": [((8,), 2, "bfloat16")],
                                    "out_grad": [((4, 8), 2, "bfloat16")]},
                   [((4, 8), 2, "bfloat16"), ((8,), 2, "bfloat16")])
    c = _add_grad_cost(bias)
    assert (c.bytes, c.kernels, c.flops) == (64 + 16, 1, 32)
    # an fp32 operand of a bf16 sum: its gradient cast (64 B read, 128 written)
    cast = LocalOp("add_grad", {}, {"x": [((4, 8), 4, "float32")], "y": [((4, 8), 2, "bfloat16")],
                                    "out_grad": [((4, 8), 2, "bfloat16")]},
                   [((4, 8), 4, "float32"), ((4, 8), 2, "bfloat16")])
    assert _add_grad_cost(cast).bytes == 64 + 128


def test_dropout_writes_its_mask_in_its_own_kernel() -> None:
    for fw in ("megatron", "torchtitan"):
        plan = _plan(fw)
        drop, mask = _op(plan, "layers.0.attn_out.dropout"), _op(plan, "layers.0.attn_out.dropout.mask")
        # native_dropout: x read, the output written, the uint8 mask written: 2 + 2 + 1 bytes an element
        assert op_cost(plan, drop).bytes == RESID * (BF16 + BF16 + 1)
        assert op_cost(plan, mask).kernels == 0 and op_cost(plan, mask).bytes == 0
        # on the attention probabilities likewise
        assert op_cost(plan, _op(plan, "layers.0.probs.dropout")).bytes == SCORES * 5


def test_megatron_fuses_scale_mask_softmax_and_its_backward() -> None:
    meg, titan = _plan("megatron"), _plan("torchtitan")
    fused = ("layers.0.scores.scaled", "layers.0.scores.masked", "grad of layers.0.scores.scaled")
    for name in fused:
        assert op_cost(meg, _op(meg, name)).kernels == 0
    # the fused kernel: the scores read, the probabilities written; its backward: the output gradient
    # and the probabilities read, the scores' gradient written
    assert op_cost(meg, _op(meg, "layers.0.probs")).bytes == SCORES * 2 * BF16
    assert op_cost(meg, _op(meg, "grad of layers.0.probs")).bytes == SCORES * 3 * BF16
    # op by op (no framework fuses them but Megatron): scale 2 + 2, the mask's add 2 + 2 (the [1, 1, 32, 32]
    # mask: 2 KiB) + 2, scale_grad 2 + 2 bytes an element
    assert op_cost(titan, _op(titan, "layers.0.scores.scaled")).bytes == SCORES * 4
    assert op_cost(titan, _op(titan, "layers.0.scores.masked")).bytes == SCORES * 4 + 32 * 32 * BF16
    assert op_cost(titan, _op(titan, "grad of layers.0.scores.scaled")).bytes == SCORES * 4
    # the mask's add_grad is torch's identity either way
    for plan in (meg, titan):
        assert op_cost(plan, _op(plan, "grad of layers.0.scores.masked")).kernels == 0


def test_megatron_sums_no_q_k_v_input_gradients() -> None:
    meg, titan = _plan("megatron"), _plan("torchtitan")
    qkv = _op(meg, "sum of layers.0.ln1.out.grad")
    assert qkv in fused_ops(meg.program, "megatron").free and op_cost(meg, qkv).kernels == 0
    # torchtitan's separate wq, wk, wv: three [2, 32, 64] gradients read, one written
    assert op_cost(titan, qkv).bytes == 4 * RESID * BF16
    # the residual stream's sum of two paths is a real add under Megatron too
    resid = _op(meg, "sum of layers.0.resid1.grad")
    assert resid not in fused_ops(meg.program, "megatron").free and op_cost(meg, resid).bytes == 3 * RESID * BF16


def test_a_router_gemm_keeps_its_sum() -> None:
    # an MoE layer: the router's GEMM and the shared expert read the same input; Megatron runs them apart
    _, plan, _ = plan_model("tiny-llama", "dp=1", "dp", {"layers": 1, "experts": 4, "top_k": 2, "shared_experts": 1})
    free = fused_ops(plan.program, "megatron").free
    sums = [i for i, op in enumerate(plan.program.ops) if op.rule == "add_n" and "mlp_norm" in op.name]
    assert sums and not any(i in free for i in sums)


def _layer_ms(plan: Plan, phase: str) -> float:
    dev = DEVICES["a100-80gb"]
    return 1e3 * sum(dev.op_time(op_cost(plan, i)) for i, op in enumerate(plan.program.ops)
                     if op.layer == "layer 0" and op.phase == phase)


@pytest.mark.parametrize("phase,fused_away", [
    # forward: scale (268.4 MB read, 268.4 written) and the mask's add (the same and the 8.4 MB mask) at
    # 0.86 x 2039 GB/s
    ("forward", (536.9 + 545.3) / 1753.5),
    # backward: scale_grad (536.9 MB) and the q/k/v input gradients' sum (3 x 100.7 MB read, 100.7 written)
    ("backward", (536.9 + 402.7) / 1753.5),
])
def test_korthikanti_table4_layer_loses_what_megatron_fuses(phase: str, fused_away: float) -> None:
    # one 22B layer (h 6144, 64 heads, seq 2048, micro-batch 4) at tp=8 on A100: Megatron's layer is the op-by-op
    # one less the fused ops' time (Table 4 measures 7.7 ms forward, 11.9 ms backward with the tp all-reduces)
    cfg: dict[str, Any] = {"layers": 1, "hidden": 6144, "heads": 64, "ffn": 24576, "vocab": 51200, "seq": 2048,
                           "batch": 4}
    _, plan, _ = plan_model("gpt-dropout-22b", "tp=8", "megatron", cfg)
    meg = replace(plan, runtime=Runtime(framework="megatron"))
    titan = replace(plan, runtime=Runtime(framework="torchtitan"))
    drop = _layer_ms(titan, phase) - _layer_ms(meg, phase)
    assert drop == pytest.approx(fused_away, rel=0.01)
