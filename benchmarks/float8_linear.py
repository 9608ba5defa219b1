"""What spmdkit predicts for ONE torchao float8 linear, fwd + bwd, against torchao's published
microbenchmarks of it (issue 26; docs/devices.md, "The rowwise linear's time from torchao's published
table"). A comparison, run by hand.

    PYTHONPATH=src python benchmarks/float8_linear.py [--sustained X] [--watts W] [--skip-table]

The linear is the llama MLP's down projection of a one-layer plan on one H100 (its input read by
it alone: the input cast once in the forward, re-scaled once in the backward), hidden = N, ffn = K,
seq = M, priced by :func:`spmdkit.cost.compute.op_cost` and ``Device.op_time`` exactly as a plan's
ops are, under bf16 (torchtitan, compiled), torchao's tensorwise recipe and its rowwise recipe: the
rowwise one from its parts (casts, rescales, GEMMs at the float8 rate) and as the model prices it,
scaled by the table (:mod:`spmdkit.cost.torchao_rowwise`), on the device the table was measured on
(``devices.ROWWISE_TABLE_DEVICE``: the H100 preset at sustained 1) unless ``--sustained`` /
``--watts`` say otherwise.

Tables:

- ``AO2185``: pytorch/ao PR #2185 (2025-05-08, "[Not for land] remove workaround for slow rowwise
  cutlass gemm"), its description's first table, "tensorwise w/ rescale": torchao's
  ``benchmarks/float8/bench_linear_float8.py`` (the ``name_to_shapes_70b`` shapes, M = 16384;
  ``linear(x).sum().backward()``, x requiring grad, compiled, 100 repeats), columns ``ref_time_sec``
  (bf16 nn.Linear) and ``pt_fp8_time_sec``, the rowwise-scaled Float8Linear with the slow-accum
  backward GEMMs on cuBLAS's tensorwise kernel and a rescale (float8_ops.addmm_float8_unwrapped, as
  at torchao 6243040, the runs' version). Its ``use_fast_accum`` column sets an attribute
  (``forward_config``) that no torchao code read at that commit, so its two halves are repeats.
  ffn.w2's fast_accum=False row lies past the stored excerpt.
- ``spmdkit.cost.torchao_rowwise.SPEEDUP`` (the table the model takes): torchao
  ``docs/static/fp8-rowwise-perf.png`` (added 4c8086744, 2025-06-06, pytorch/ao#2312; the table
  pytorch/torchtitan#1207's RCA reads), "Speedup observed vs bfloat16 for
  LayerNorm -> Linear -> Sigmoid fwd + bwd by forward M, K, N, dynamic row-wise scaling, PyTorch
  version 2.8.0a0+git48807d5": ``benchmarks/float8/float8_roofline.py`` (``b_fp8_e2e_spdp``, GPU kernel
  time from the profiler, compiled, recipe ``rowwise`` by ``from_recipe_name``). Transcribed from the
  image; rows M, K in 1024..32768, columns N 1024..32768. The LayerNorm (no affine) and sigmoid run in
  both: priced here as memory-bound passes (LN 4 B forward, 6 B backward an element of M x K; the
  sigmoid 4 B and 6 B of M x N, bf16), no fusion with the float8 casts (spmdkit's rule; under compile
  Inductor may fuse the input's rowwise cast into the LayerNorm and the output gradient's into the
  sigmoid's backward, which the measured column would include).
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

from spmdkit.cost import devices as dv
from spmdkit.cost.compute import op_cost
from spmdkit.cost.devices import Device, cost_model, recost
from spmdkit.cost.rates import clock_at_power
from spmdkit.cost.torchao_rowwise import LN_BYTES, SIGMOID_BYTES, SIZES, SPEEDUP
from spmdkit.planner.planning import plan_model
from spmdkit.program.runtime import Runtime

BF16 = Runtime(framework="torchtitan", compile=True)
TENSORWISE = Runtime(framework="torchtitan", precision="fp8", compile=True)
ROWWISE = replace(TENSORWISE, float8_recipe="rowwise")
RUNTIMES = {"bf16": BF16, "tensorwise": TENSORWISE, "rowwise": ROWWISE}
#: the rowwise linear from its parts (casts, rescales, GEMMs at the float8 rate), before the published
#: table scales it (``OpCost.rowwise`` None)
PARTS = "rowwise parts"

#: ao#2185, "tensorwise w/ rescale", compiled: name, (M, K, N), ref_time_sec, pt_fp8_time_sec (fast_accum
#: True rows 0-3; False rows 4-6, a repeat: use_fast_accum was read by no torchao code)
AO2185 = (
    ("attn.wqkv", (16384, 8192, 1280), 0.001954, 0.001757),
    ("attn.w0", (16384, 1024, 8192), 0.001701, 0.001193),
    ("ffn.w13", (16384, 8192, 7168), 0.009871, 0.005707),
    ("ffn.w2", (16384, 3584, 8192), 0.005192, 0.003034),
    ("attn.wqkv", (16384, 8192, 1280), 0.001973, 0.001773),
    ("attn.w0", (16384, 1024, 8192), 0.001688, 0.001196),
)

def linear_times(dev: Device, m: int, k: int, n: int) -> dict[str, tuple[float, float]]:
    """(forward, backward) seconds of one linear x (m, k) -> (m, n) on ``dev`` per recipe."""
    _, plan, _ = plan_model("llama-7b", "dp=1", "dp", {"layers": 1, "seq": m, "batch": 1, "hidden": n, "ffn": k,
                                                        "heads": 8, "kv_heads": 8})
    plan = recost(plan, cost_model(plan.mesh, dev))
    idx = {(op.name, op.phase): i for i, op in enumerate(plan.program.ops)}
    fwd, bwd = idx[("layers.0.mlp_out", "forward")], idx[("grad of layers.0.mlp_out", "backward")]
    out = {}
    for name, rt in RUNTIMES.items():
        p = replace(plan, runtime=rt)
        cf, cb = op_cost(p, fwd), op_cost(p, bwd)
        assert cf.gemms == ((1, m, n, k),), cf.gemms
        out[name] = (dev.op_time(cf), dev.op_time(cb))
        if rt is ROWWISE:
            out[PARTS] = (dev.op_time(replace(cf, rowwise=None)), dev.op_time(replace(cb, rowwise=None)))
    return out


def ln_sigmoid_time(dev: Device, m: int, k: int, n: int) -> float:
    """The LayerNorm and sigmoid of the table's module, fwd + bwd, memory-bound."""
    b = sum(LN_BYTES) * m * k + sum(SIGMOID_BYTES) * m * n
    return max(b / dev.hbm_rate, 4 * dev.rates.launch_s)


def ao2185(dev: Device) -> list[str]:
    lines = ["ao#2185 (torchao bench_linear_float8.py, M = 16384, compiled): times in ms, speedup = bf16 / fp8",
             f"{'linear':10} {'M,K,N':>20} | {'bf16 meas':>9} {'pred':>6} | {'rw meas':>7} {'parts':>6} {'table':>6} | "
             f"{'spd meas':>8} {'parts':>6} {'table':>6} {'tw':>6} | parts/meas table/meas"]
    for name, (m, k, n), ref, fp8 in AO2185[:4]:
        t = {r: sum(v) for r, v in linear_times(dev, m, k, n).items()}
        spd, parts, rw, tw = ref / fp8, t["bf16"] / t[PARTS], t["bf16"] / t["rowwise"], t["bf16"] / t["tensorwise"]
        lines.append(f"{name:10} {(m, k, n)!s:>20} | {ref * 1e3:9.3f} {t['bf16'] * 1e3:6.3f} | {fp8 * 1e3:7.3f} "
                     f"{t[PARTS] * 1e3:6.3f} {t['rowwise'] * 1e3:6.3f} | {spd:8.3f} {parts:6.3f} {rw:6.3f} {tw:6.3f} | "
                     f"{parts / spd:10.3f} {rw / spd:10.3f}")
    return lines


def table(dev: Device) -> list[str]:
    lines = ["torchao fp8-rowwise-perf.png (LN -> Linear -> Sigmoid, rowwise, fwd + bwd): the rowwise linear from "
             "its parts / measured, speedup over bf16 (the model with the table reproduces every cell)",
             f"{'M':>6} {'K':>6} | " + " ".join(f"N={n:<6}" for n in SIZES)]
    ratios: dict[str, list[float]] = {"all": [], "N<=2048": [], "N>=8192, K>=4096": []}
    for m, rows in SPEEDUP.items():
        for k, meas in rows.items():
            cells = []
            for n, got in zip(SIZES, meas):
                t = linear_times(dev, m, k, n)
                extra = ln_sigmoid_time(dev, m, k, n)
                pred = (sum(t["bf16"]) + extra) / (sum(t[PARTS]) + extra)
                model = (sum(t["bf16"]) + extra) / (sum(t["rowwise"]) + extra)
                if dev is dv.ROWWISE_TABLE_DEVICE:  # where the table was measured: every cell reproduced
                    assert abs(model / got - 1.0) < 1e-9, (m, k, n, model, got)
                r = pred / got
                ratios["all"].append(r)
                if n <= 2048:
                    ratios["N<=2048"].append(r)
                if n >= 8192 and k >= 4096:
                    ratios["N>=8192, K>=4096"].append(r)
                cells.append(f"{pred:.2f}/{got:.2f}")
            lines.append(f"{m:6} {k:6} | " + " ".join(cells))
    for what, rs in ratios.items():
        q = statistics.quantiles(rs, n=10)
        lines.append(f"predicted / measured, {what} ({len(rs)} cells): median {statistics.median(rs):.3f}, "
                     f"p10 {q[0]:.3f}, p90 {q[-1]:.3f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sustained", type=float, default=None, help="the sustained share (default 1: the device the "
                    "table was measured on, devices.ROWWISE_TABLE_DEVICE; the h100 preset's is HOPPER_SUSTAINED)")
    ap.add_argument("--watts", type=float, default=None, help="a board power limit (the H100 preset's clock at it, "
                    "rates.clock_at_power); default the preset's 700 W")
    ap.add_argument("--skip-table", action="store_true", help="ao#2185's four shapes only")
    a = ap.parse_args()
    dev = dv.ROWWISE_TABLE_DEVICE
    if a.sustained is not None:
        dev = replace(dev, rates=replace(dev.rates, sustained=a.sustained))
    if a.watts is not None:
        dev = replace(dev, rates=replace(dev.rates, clock=clock_at_power(dev.rates, a.watts, dev.name)))
    print(f"H100, sustained {dev.rates.sustained}, clock {dev.rates.clock:.3f}")
    print("\n".join(ao2185(dev)))
    if not a.skip_table:
        print("\n".join(table(dev)))


if __name__ == "__main__":
    main()
