"""torchao's tensorwise float8 casts under torchtitan's torch.compile (``spmdkit.cost.torchao_casts``):
each cast an amax pass (read 2 B) and a cast pass (read 2, write 1), whoever made the tensor; the
float8 weight, output gradient and input copied transposed for ``_scaled_mm`` in the backward
(``float8_ops.preprocess_addmm``: read 1, write 1); under float8 TP the block inputs and the rowwise
linears' output gradients cast on their 1/tp shard before the all-gather (torchao eab345c /
6243040). Bytes by hand on llama-7b's local TP 4 shapes; Transformer Engine's pricing unchanged."""

from __future__ import annotations

from dataclasses import replace

from spmdkit.cost.compute import op_cost
from spmdkit.cost.devices import DEVICES, cost_model, recost
from spmdkit.planner.planning import plan_model
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import Runtime

H100 = DEVICES["h100"]
SEQ, HIDDEN, FFN = 2048, 4096, 11008  # llama-7b, one sequence of 2,048


def _plan(mesh: str, strategy: str, rt: Runtime, batch: int = 1) -> Plan:
    _, plan, _ = plan_model("llama-7b", mesh, strategy, {"layers": 1, "seq": SEQ, "batch": batch})
    return replace(recost(plan, cost_model(plan.mesh, H100)), runtime=rt)


def _casts(plan: Plan) -> dict[str, float]:
    return {plan.program.ops[i].name: c.cast_bytes for i in range(len(plan.program.ops))
            if (c := op_cost(plan, i)).fp8}


def test_torchao_casts_under_float8_tp_by_hand() -> None:
    got = _casts(_plan("tp=4", "megatron,sp", Runtime(framework="torchtitan", precision="fp8")))
    wq, wdown = HIDDEN * HIDDEN // 4, FFN * HIDDEN // 4  # local weights: 4,194,304 and 11,272,192
    shard, full = SEQ * HIDDEN // 4, SEQ * HIDDEN  # the block input on its sequence shard, gathered
    swiglu = SEQ * FFN // 4  # w_down's input, hidden-sharded: 5,636,096
    # forward q: its weight (amax 2 + cast 3) and the attention norm's output cast on its shard,
    # before the float8 all-gather (once: k and v find it cast)
    assert got["layers.0.q"] == 5 * wq + 5 * shard == 31_457_280
    assert got["layers.0.k"] == got["layers.0.v"] == 5 * wq
    # forward w_down: its weight and the SwiGLU output (Transformer Engine fuses that cast: 0)
    assert got["layers.0.mlp_out"] == 5 * wdown + 5 * swiglu == 84_541_440
    # backward w_down: the weight copied transposed (2), the output gradient cast on its shard before
    # the all-gather (5) and the gathered float8 copied transposed (2), the input copied transposed (2)
    assert got["grad of layers.0.mlp_out"] == 2 * wdown + 5 * shard + 2 * full + 2 * swiglu == 61_079_552
    # backward q: the output gradient cast (5) and transposed (2) on the GEMM; the gathered input's
    # transposed copy once for q / k / v (at the first of their grads, v's)
    assert got["grad of layers.0.q"] == 2 * wq + 7 * SEQ * HIDDEN // 4 == 23_068_672
    assert got["grad of layers.0.v"] == got["grad of layers.0.q"] + 2 * full == 39_845_888


def test_torchao_casts_without_tp_by_hand() -> None:
    # dp = 2 over a batch of 2: one sequence a rank, every linear whole (t1 / t2 / t3's float8 rows)
    got = _casts(_plan("dp=2", "dp", Runtime(framework="torchtitan", precision="fp8"), batch=2))
    w, x = HIDDEN * HIDDEN, SEQ * HIDDEN
    assert got["layers.0.q"] == 5 * w + 5 * x == 125_829_120  # the norm's output cast once, for q / k / v
    assert got["layers.0.k"] == 5 * w
    assert got["layers.0.mlp_out"] == 5 * FFN * HIDDEN + 5 * SEQ * FFN == 338_165_760
    assert got["grad of layers.0.q"] == 2 * w + 7 * x == 92_274_688
    assert got["grad of layers.0.v"] == got["grad of layers.0.q"] + 2 * x  # the input's transposed copy, once


def test_transformer_engine_casts_unchanged() -> None:
    got = _casts(_plan("tp=4", "megatron,sp", Runtime(framework="megatron", precision="fp8")))
    wq = HIDDEN * HIDDEN // 4
    assert got["layers.0.q"] == 4 * wq  # the fused norm writes fp8: no input cast
    assert got["layers.0.attn_out"] == 4 * wq + 4 * SEQ * HIDDEN // 4
    assert got["grad of layers.0.q"] == 4 * SEQ * HIDDEN // 4
