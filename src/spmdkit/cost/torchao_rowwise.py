"""The time of torchao's rowwise float8 linear (``--float8-recipe rowwise``) from torchao's own
published microbenchmark of it (issue 26; docs/devices.md, "The rowwise linear's time from torchao's
published table").

The source: torchao ``docs/static/fp8-rowwise-perf.png`` (pytorch/ao 4c8086744, 2025-06-06, PR #2312,
"Add fp8 rowwise perf table to float8 training readme"; the README's "Rowwise scaling" table, which
pytorch/torchtitan#1207's root-cause reads and torchao's ``_auto_filter_for_rowwise`` thresholds
cite), titled "Speedup observed vs bfloat16 for LayerNorm -> Linear -> Sigmoid fwd + bwd by forward M,
K, N; dynamic row-wise scaling, PyTorch version 2.8.0a0+git48807d5", on an H100. It is
``benchmarks/float8/float8_roofline.py`` at that commit (``--float8_recipe_name rowwise``,
``enable_fusion_modeling``): ``LNLinearSigmoid`` (``nn.LayerNorm(K, elementwise_affine=False)``,
``nn.Linear(K, N, bias=False)``, ``nn.Sigmoid``), compiled, bf16 against
``convert_to_float8_training(config=Float8LinearConfig.from_recipe_name("rowwise"))``, forward and
backward with a random output gradient, the GPU kernel time from the profiler
(``b_bf16_e2e_s / b_fp8_e2e_s``), M, K, N each 1024 .. 32768 (:data:`SPEEDUP`, transcribed from the
image). Its torchao is of early June 2025 (merged as fdddb2cfa, 2025-06-06): between it and the runs'
6243040 (2025-06-13) ``torchao/float8`` changed by a flag made a no-op, an export list, a docs move and
inference fixes, so the training rowwise path (``float8_linear``, ``float8_ops.addmm_float8_unwrapped``'s
cuBLAS-and-rescale backward) is the runs'; its torch a 2.8 nightly no later than that (the runs':
38410cf9).

The mechanism: the table measures the whole rowwise linear (its casts, its three GEMMs, the forward's
CUTLASS rowwise kernel and the backward's rescales) against the bf16 one, which the cost model
otherwise builds from its parts (:mod:`spmdkit.cost.torchao_casts` and the float8 GEMM rate); the
parts leave out what the microbenchmark shows at small shapes (torchtitan#1207's root cause,
b0902b29a: "attention.wk and attention.wv layers were so small that float8 rowwise conversion resulted
in approx ~40% slowdown for those layers"). So a
rowwise linear's passes (its forward and its backward op) are scaled by :func:`rowwise_scale`: at the
linear's forward (M, K, N), clamped into the table, the measured module's float8 linear time over the
modelled one,

    F_meas = (B + L) / S - L,    scale = F_meas / F,

``S`` the table's speedup (log2-trilinear between its points), ``B`` and ``F`` the device's times of
the bf16 and the rowwise linear fwd + bwd (:func:`linear_costs`, as a plan prices them), ``L`` the
LayerNorm's and sigmoid's (memory-bound: :data:`LN_BYTES`, :data:`SIGMOID_BYTES`). The measured fp8
module's gains from Inductor fusing a cast into the LayerNorm or the sigmoid's backward stay in
``F_meas`` (as in a compiled block, where a norm or a SwiGLU precedes each linear). Outside the table
(torchtitan's TP 8 shards: N = 128 for wk / wv, M up to 131072) the nearest edge's ratio is taken: the
table's speedup changes little from M = 16384 to 32768 (median +0.04, -0.20 to +0.22 by cell), and its
N = 1024 column is its smallest.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Protocol

import spmdkit.ops  # noqa: F401  (registers the matmul family, whose cost functions price the linear)
from spmdkit.cost.rates import Rates
from spmdkit.cost.torchao_casts import rowwise_cast_bytes
from spmdkit.engine.facts import LocalOp, OpCost, facts_of


class Timing(Protocol):
    """What :func:`rowwise_scale` reads of a device (:class:`spmdkit.cost.devices.Device`)."""

    @property
    def rates(self) -> Rates: ...

    @property
    def hbm_rate(self) -> float: ...

    def op_time(self, c: OpCost) -> float: ...

#: the table's M, K and N values
SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
#: torchao ``docs/static/fp8-rowwise-perf.png`` (4c8086744): the rowwise LN -> Linear -> Sigmoid's
#: speedup over bf16, fwd + bwd; ``SPEEDUP[M][K]`` lists N = 1024 .. 32768
SPEEDUP: dict[int, dict[int, tuple[float, ...]]] = {
    1024: {1024: (0.42, 0.42, 0.50, 0.51, 0.56, 0.56), 2048: (0.40, 0.38, 0.42, 0.50, 0.50, 0.56),
           4096: (0.48, 0.43, 0.46, 0.53, 0.57, 0.60), 8192: (0.45, 0.48, 0.54, 0.62, 0.60, 0.62),
           16384: (0.46, 0.48, 0.54, 0.60, 0.60, 0.61), 32768: (0.45, 0.50, 0.55, 0.60, 0.62, 0.65)},
    2048: {1024: (0.43, 0.43, 0.48, 0.55, 0.62, 0.65), 2048: (0.38, 0.45, 0.58, 0.65, 0.72, 0.75),
           4096: (0.43, 0.50, 0.68, 0.78, 0.81, 0.82), 8192: (0.46, 0.58, 0.73, 0.82, 0.87, 0.89),
           16384: (0.48, 0.62, 0.75, 0.83, 0.84, 0.85), 32768: (0.50, 0.64, 0.75, 0.84, 0.83, 0.99)},
    4096: {1024: (0.45, 0.47, 0.57, 0.66, 0.72, 0.76), 2048: (0.43, 0.53, 0.70, 0.83, 0.90, 0.91),
           4096: (0.44, 0.64, 0.84, 1.01, 1.01, 1.04), 8192: (0.53, 0.72, 0.91, 1.01, 1.07, 1.13),
           16384: (0.53, 0.74, 0.92, 1.05, 1.10, 1.18), 32768: (0.54, 0.75, 0.93, 1.02, 1.17, 1.18)},
    8192: {1024: (0.48, 0.52, 0.65, 0.77, 0.83, 0.84), 2048: (0.45, 0.64, 0.82, 1.01, 1.03, 1.06),
           4096: (0.52, 0.76, 1.00, 1.13, 1.17, 1.19), 8192: (0.59, 0.85, 1.05, 1.20, 1.31, 1.41),
           16384: (0.58, 0.82, 1.03, 1.22, 1.37, 1.40), 32768: (0.59, 0.82, 1.04, 1.30, 1.36, 1.46)},
    16384: {1024: (0.48, 0.58, 0.73, 0.86, 0.85, 0.89), 2048: (0.51, 0.70, 0.90, 1.05, 1.07, 1.15),
            4096: (0.57, 0.79, 1.02, 1.20, 1.26, 1.40), 8192: (0.61, 0.87, 1.08, 1.33, 1.39, 1.49),
            16384: (0.59, 0.83, 1.07, 1.34, 1.42, 1.55), 32768: (0.60, 0.85, 1.16, 1.35, 1.48, 1.72)},
    32768: {1024: (0.51, 0.62, 0.77, 0.87, 0.88, 0.94), 2048: (0.54, 0.73, 0.91, 1.08, 1.14, 1.27),
            4096: (0.59, 0.81, 1.04, 1.28, 1.35, 1.49), 8192: (0.63, 0.87, 1.11, 1.41, 1.50, 1.62),
            16384: (0.60, 0.83, 1.16, 1.39, 1.49, 1.73), 32768: (0.63, 0.93, 1.16, 1.48, 1.70, 1.52)},
}
#: bytes an element the module's LayerNorm moves (no affine; bf16): forward read x, write y; backward
#: read x and dy, write dx (its per-row mean and rstd left out)
LN_BYTES = (4.0, 6.0)
#: the sigmoid's: forward read, write; backward read y and dy, write dx
SIGMOID_BYTES = (4.0, 6.0)


def clamp(v: int) -> int:
    """``v`` clamped into the table's range (1024 .. 32768)."""
    return min(max(v, SIZES[0]), SIZES[-1])


def table_speedup(m: int, k: int, n: int) -> float:
    """:data:`SPEEDUP` at (m, k, n), each clamped into the table, interpolated linearly in log2 of
    M, K and N and in the log of the speedup between the eight surrounding points."""
    pos = [math.log2(clamp(v)) - math.log2(SIZES[0]) for v in (m, k, n)]
    lo = [min(int(p), len(SIZES) - 2) for p in pos]
    fr = [p - i for p, i in zip(pos, lo)]
    total = 0.0
    for corner in range(8):
        d = [(corner >> axis) & 1 for axis in range(3)]
        w = math.prod(f if bit else 1.0 - f for f, bit in zip(fr, d))
        if w > 0.0:
            mi, ki, ni = (SIZES[i + bit] for i, bit in zip(lo, d))
            total += w * math.log(SPEEDUP[mi][ki][SIZES.index(ni)])
    return math.exp(total)


def linear_costs(m: int, k: int, n: int, rowwise: bool) -> tuple[OpCost, OpCost]:
    """The forward and the backward of one linear x (m, k) -> (m, n), weight (k, n), bf16, priced by
    the matmul family's own cost functions, as a plan prices them (``matmul`` / ``matmul_grad``: the
    operands' and results' bytes, its GEMMs); ``rowwise``: torchao's rowwise recipe, its input cast in
    the forward and re-scaled in the backward (:func:`~spmdkit.cost.torchao_casts.rowwise_cast_bytes`)."""
    x, y, out = ((m, k), 2, "bfloat16"), ((k, n), 2, "bfloat16"), ((m, n), 2, "bfloat16")
    fwd_fn, bwd_fn = facts_of("matmul").cost, facts_of("matmul_grad").cost
    assert fwd_fn is not None and bwd_fn is not None  # spmdkit.ops.matmul declares both
    fwd = fwd_fn(LocalOp("matmul", {}, {"x": [x], "y": [y]}, [out]))
    bwd = bwd_fn(LocalOp("matmul_grad", {}, {"x": [x], "y": [y], "out_grad": [out]}, [x, y]))
    if not rowwise:
        return fwd, bwd
    gemm, nk = (1, m, n, k), n * k
    return (replace(fwd, fp8=True, cast_bytes=rowwise_cast_bytes(gemm, nk, grad=False, x_cast=True, x_transpose=False)),
            replace(bwd, fp8=True, cast_bytes=rowwise_cast_bytes(gemm, nk, grad=True, x_cast=False, x_transpose=True)))


def rowwise_scale(device: Timing, m: int, k: int, n: int) -> float:
    """What a rowwise float8 linear's passes are scaled by on ``device`` (the module docstring): at
    its forward (m, k, n) clamped into the table, ``F_meas / F`` with ``F_meas = (B + L) / S - L``."""
    cm, ck, cn = clamp(m), clamp(k), clamp(n)
    bf16 = sum(device.op_time(c) for c in linear_costs(cm, ck, cn, False))
    fp8 = sum(device.op_time(c) for c in linear_costs(cm, ck, cn, True))
    around = max((sum(LN_BYTES) * cm * ck + sum(SIGMOID_BYTES) * cm * cn) / device.hbm_rate,
                 4 * device.rates.launch_s)
    measured = (bf16 + around) / table_speedup(cm, ck, cn) - around
    assert measured > 0.0  # every speedup of the table is below (B + L) / L
    return measured / fp8


__all__ = ["LN_BYTES", "SIGMOID_BYTES", "SIZES", "SPEEDUP", "Timing", "clamp", "linear_costs", "rowwise_scale",
           "table_speedup"]
