"""torchao's rowwise float8 linear timed by torchao's published table of it (``--float8-recipe
rowwise``; :mod:`spmdkit.cost.torchao_rowwise`): torchao ``docs/static/fp8-rowwise-perf.png`` at
4c8086744 (2025-06-06, pytorch/ao#2312), "Speedup observed vs bfloat16 for LayerNorm -> Linear ->
Sigmoid fwd + bwd by forward M, K, N", dynamic row-wise scaling, PyTorch 2.8.0a0+git48807d5, H100."""

from __future__ import annotations

import math
from dataclasses import replace

from spmdkit.cost.compute import op_cost
from spmdkit.cost.devices import DEVICES, ROWWISE_TABLE_DEVICE, cost_model, recost, table_rowwise_scale
from spmdkit.cost.torchao_rowwise import (
    LN_BYTES,
    SIGMOID_BYTES,
    SPEEDUP,
    linear_costs,
    rowwise_scale,
    table_speedup,
)
from spmdkit.planner.planning import plan_model
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import Runtime

BF16 = Runtime(framework="torchtitan", compile=True)
TENSORWISE = Runtime(framework="torchtitan", precision="fp8", compile=True)
ROWWISE = replace(TENSORWISE, float8_recipe="rowwise")


def _plan(rt: Runtime, device: object = ROWWISE_TABLE_DEVICE) -> Plan:
    # llama-7b, one layer, two sequences of 2,048 over dp = 2: each rank's w_down reads (2048, 11008)
    _, plan, _ = plan_model("llama-7b", "dp=2", "dp", {"layers": 1, "seq": 2048, "batch": 2})
    return replace(recost(plan, cost_model(plan.mesh, device)), runtime=rt)


def _w_down(plan: Plan) -> tuple[int, int]:
    idx = {(op.name, op.phase): i for i, op in enumerate(plan.program.ops)}
    return idx[("layers.0.mlp_out", "forward")], idx[("grad of layers.0.mlp_out", "backward")]


def test_the_table_is_torchaos() -> None:
    # the image's cells: M = 16384, K = 8192, N = 8192: 1.33; M = 32768, K = 8192, N = 1024: 0.63;
    # M = 1024, K = 2048, N = 2048: 0.38 (its smallest); M = 32768, K = 16384, N = 32768: 1.73 (its largest)
    assert SPEEDUP[16384][8192][3] == 1.33 and SPEEDUP[32768][8192][0] == 0.63
    assert SPEEDUP[1024][2048][1] == 0.38 and SPEEDUP[32768][16384][5] == 1.73
    assert len(SPEEDUP) == 6 and all(len(r) == 6 and all(len(v) == 6 for v in r.values()) for r in SPEEDUP.values())
    assert table_speedup(16384, 8192, 8192) == 1.33
    # between two K (M = 32768, N = 4096: K = 4096 1.04, K = 8192 1.11), K = 6144 lies log2(1.5) of the way
    f = math.log2(1.5)
    assert math.isclose(table_speedup(32768, 6144, 4096), math.exp((1 - f) * math.log(1.04) + f * math.log(1.11)))
    assert math.isclose(table_speedup(32768, 6144, 4096), 1.08039, rel_tol=1e-5)
    # outside the table, its edge: torchtitan's 70B TP 8 wk (M = 16 x 8192 tokens, K = 8192, N = 8 x 128 / 8)
    # and 8B TP 8 wk (M = 12 x 8192, K = 4096, N = 128)
    assert table_speedup(131072, 8192, 128) == 0.63 and table_speedup(98304, 4096, 128) == 0.59


def test_the_scale_by_hand() -> None:
    # at a table point: the LN (no affine) moves 4 + 6 B an element of M x K, the sigmoid 4 + 6 of M x N;
    # the measured module's float8 linear F_meas = (B + L) / S - L, the scale F_meas / F
    assert (LN_BYTES, SIGMOID_BYTES) == ((4.0, 6.0), (4.0, 6.0))
    dev = ROWWISE_TABLE_DEVICE
    m, k, n = 16384, 8192, 8192
    b = sum(dev.op_time(c) for c in linear_costs(m, k, n, False))
    f = sum(dev.op_time(c) for c in linear_costs(m, k, n, True))
    ln_sig = (10 * m * k + 10 * m * n) / dev.hbm_rate
    want = ((b + ln_sig) / 1.33 - ln_sig) / f
    assert math.isclose(rowwise_scale(dev, m, k, n), want) and math.isclose(table_rowwise_scale(m, k, n), want)
    # the table device: the H100 preset at one GPU, its rated power and the microbenchmarked rates
    assert dev.rates.sustained == 1.0 and dev.rates.clock == 1.0 and dev.gpus == 1
    assert dev.rates.gemm == DEVICES["h100"].rates.gemm and dev.hbm_rate == DEVICES["h100"].hbm_rate
    # outside the table the edge's scale: the 70B TP 8 wk takes (32768, 8192, 1024)'s
    assert table_rowwise_scale(131072, 8192, 128) == table_rowwise_scale(32768, 8192, 1024) > 1.0


def test_a_planned_rowwise_linear_reproduces_the_table() -> None:
    # w_down of a rank: x (2048, 11008) -> (2048, 4096), its input read by it alone (cast in the forward,
    # re-scaled in the backward), as the table's module's linear
    rw, bf = _plan(ROWWISE), _plan(BF16)
    fwd, bwd = _w_down(rw)
    assert op_cost(rw, fwd).rowwise == op_cost(rw, bwd).rowwise == (2048, 11008, 4096)
    assert op_cost(bf, fwd).rowwise is None and op_cost(_plan(TENSORWISE), fwd).rowwise is None
    dev = ROWWISE_TABLE_DEVICE
    f = dev.op_time(op_cost(rw, fwd)) + dev.op_time(op_cost(rw, bwd))
    b = dev.op_time(op_cost(bf, fwd)) + dev.op_time(op_cost(bf, bwd))
    ln_sig = (10 * 2048 * 11008 + 10 * 2048 * 4096) / dev.hbm_rate
    # the table between K = 8192 (0.73) and K = 16384 (0.75) at M = 2048, N = 4096, log2(11008 / 8192) of the way
    g = math.log2(11008 / 8192)
    want = math.exp((1 - g) * math.log(0.73) + g * math.log(0.75))
    assert math.isclose(want, 0.73846, rel_tol=1e-5)
    assert math.isclose((b + ln_sig) / (f + ln_sig), want, rel_tol=1e-9)
    # from its parts alone (casts, rescales, GEMMs at the float8 rate) the module would be 0.96 of bf16's time
    parts = sum(dev.op_time(replace(op_cost(rw, i), rowwise=None)) for i in (fwd, bwd))
    assert (b + ln_sig) / (parts + ln_sig) > 0.9


def test_every_device_takes_the_table_devices_scale() -> None:
    # the scale is a ratio measured on the table's H100; a plan on the 700 W preset at HOPPER_SUSTAINED, or
    # any other device, multiplies its own pass times by it
    plan = _plan(ROWWISE, DEVICES["h100"])
    dev = DEVICES["h100"]
    fwd, bwd = _w_down(plan)
    for i in (fwd, bwd):
        c = op_cost(plan, i)
        assert c.rowwise is not None
        assert math.isclose(dev.op_time(c), dev.op_time(replace(c, rowwise=None)) * table_rowwise_scale(*c.rowwise))
    tw = _plan(TENSORWISE, DEVICES["h100"])
    assert all(op_cost(tw, i).rowwise is None for i in range(len(tw.program.ops)))
