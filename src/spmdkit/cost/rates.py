"""Achievable rates: the fraction of a GPU's datasheet peak a kernel reaches, by what it is. The
roofline of :meth:`spmdkit.cost.devices.Device.op_time` divides by these rates instead of the
datasheet peaks. Standard library only. docs/devices.md, "Achievable rates".

- GEMMs (:func:`gemm_efficiency`): the large-GEMM ceiling of the dtype (cuBLAS's best measured
  rate over large shapes, a fraction of the tensor-core peak) times the *tile and wave
  quantisation* of the (batch, M, N, K) GEMM over the GPU's SMs (NVIDIA's "Matrix Multiplication
  Background User's Guide", ch. 3: the output is cut into CTA tiles, the tiles run in waves of
  one per SM; the kernel picks the tile that wastes least) times a saturating curve in K
  (``K / (K + K0)``: a tile's prologue and epilogue cost as much as ``K0`` of its main loop;
  normalised to 1 at the K of the shape the ceiling was measured at, :attr:`Rates.gemm_k`; fp8's
  ``K0`` is twice bf16's: its main loop runs at twice the rate, the prologue and epilogue do not).
- Flash attention (:func:`attention_efficiency`): forward and backward separately, a fraction of
  the bf16 peak by kernel (FlashAttention-2, cuDNN), saturating in the
  sequence length (``s / (s + S0)``, causal: half the sequence) and in the head dim, a causal
  pass at a share of the non-causal rate: ``S0``, ``D0`` and the share each kernel's own, fitted
  to its published bars (benchmarks/fit_attention.py).
- Memory-bound ops: a fraction of the datasheet HBM bandwidth (STREAM-like copy / triad).
- A power limit below the board's rated power (``clock``, a device file's ``power_limit_w``:
  :func:`clock_at_power`): the tensor cores' sustained clock, hence every GEMM and attention
  rate, scaled by the rated tensor-core peak NVIDIA gives the same GPU at that power.
- The share of those microbenchmarked rates sustained through training steps (``sustained``):
  calibrated on the published H100 runs (:data:`HOPPER_SUSTAINED`; A100: 1).
- The spread of that speed over the GPUs of one SKU (``speed_sd``, :data:`GPU_SPEED_SD`: Sinha et
  al. 2022): a step of ``n`` GPUs waits for the slowest, the expected maximum of ``n`` draws
  (:meth:`spmdkit.cost.devices.Device.slowdown`).
- Every kernel takes at least ``launch_s`` (an eager framework issues one kernel per op; a
  kernel shorter than the launch rate leaves the GPU waiting on the host).
- :class:`spmdkit.cost.measured.Measured` (``spmdkit calibrate``) overrides the model:
  :func:`measured_gemm` (log-space inverse-distance interpolation over the nearest measured
  shapes of the dtype), :func:`measured_attention` (the nearest point).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.cost.measured import Measured
from spmdkit.program.runtime import ATTENTION_KERNELS

#: the CTA tiles cuBLAS / CUTLASS choose from for tensor-core GEMMs (M x N), NVIDIA's guide §2.3;
#: each tile's relative efficiency is its operand reuse, ``TM·TN/(TM+TN)`` FLOPs per byte loaded,
#: against a 128x128 tile's (the smallest tile that keeps the tensor cores fed; a 64x64 tile moves
#: twice the operand bytes per FLOP)
TILES = ((256, 128), (128, 256), (128, 128), (256, 64), (64, 256), (128, 64), (64, 128), (64, 64))


def _reuse(tm: int, tn: int) -> float:
    return min(1.0, (tm * tn / (tm + tn)) / 64.0)


# ATTENTION_KERNELS (spmdkit.program.runtime, --attention-kernel's choices): the kernels a preset
# may give rates for. The training frameworks' kernel on a GPU generation (``Runtime.framework`` ->
# kernel, :attr:`Rates.attention_kernel`): Megatron-Core runs Transformer Engine's cuDNN fused
# attention; torchtitan runs torch's scaled_dot_product_attention, whose flash backend is
# FlashAttention-2; a run whose model code calls another kernel says so (``--attention-kernel``)


@dataclass(frozen=True)
class Rates:
    """What a GPU reaches, as fractions of its datasheet figures (docs/devices.md gives the
    source of every preset's numbers).

    ``sms``: streaming multiprocessors (the waves of a GEMM); ``gemm``: the large-GEMM ceiling per
    dtype key (bf16, fp16, tf32, fp32, fp8) as a fraction of that dtype's peak; ``gemm_k``: the K
    of the shape each ceiling was measured at (where the K saturation is 1; 2048 where not given);
    ``k0``: the K a bf16 tile's prologue and epilogue cost (fp8: twice it); ``attention``: kernel -> (forward, backward) fraction of the
    bf16 peak at head dim 128 and a long sequence; ``attention_kernel``: framework -> kernel;
    ``s0`` / ``d0``: the sequence and head dim at which attention runs at half its asymptote;
    ``attention_shape``: kernel -> (``s0``, ``d0``, causal share) where a kernel's own published
    points give them (the causal share: its causal asymptote over its non-causal one; 1 where not
    given); ``hbm``: fraction of the HBM bandwidth memory-bound kernels reach; ``launch_s``: the least
    time of a kernel."""

    sms: int
    gemm: Mapping[str, float]
    attention: Mapping[str, tuple[float, float]]
    attention_kernel: Mapping[str, str] = field(default_factory=lambda: {"megatron": "fa2", "torchtitan": "fa2"})
    hbm: float = 0.85
    launch_s: float = 4e-6
    k0: float = 128.0
    s0: float = 256.0
    d0: float = 32.0
    #: the sustained tensor-core clock as a fraction of the one the rates were measured at (the
    #: board's rated power): 1, or less under a power limit (:func:`clock_at_power`)
    clock: float = 1.0
    #: the share of the microbenchmarked tensor-core rates (``gemm``, ``attention``: short timed
    #: loops) a GPU sustains through training steps, its board power held at the limit so its
    #: clock settles lower: 1 where the published runs show no gap (A100); calibrated on the
    #: published runs of the GPU where they do (:data:`HOPPER_SUSTAINED`, docs/devices.md)
    sustained: float = 1.0
    #: (board power W, tensor-core peak at that power / the rated one) of the GPU's own SKUs,
    #: NVIDIA's datasheets; :func:`clock_at_power` interpolates them. Empty: not known
    power_points: tuple[tuple[float, float], ...] = ()
    gemm_k: Mapping[str, float] = field(default_factory=dict)
    #: the standard deviation of one GPU's tensor-core kernel time over the GPUs of the SKU, a
    #: fraction of the median GPU's (:data:`GPU_SPEED_SD`); 0: every GPU runs at the median
    speed_sd: float = 0.0
    attention_shape: Mapping[str, tuple[float, float, float]] = field(default_factory=dict)
    #: the measured cuDNN version (:data:`CUDNN_FE_H200`) whose speed-up over 9.1.0 scales the
    #: ``cudnn`` kernel's rates (:func:`cudnn_version_scale`); "" : the presets' own (cuDNN 9.1-9.3)
    cudnn_version: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"sms": self.sms, "gemm": dict(self.gemm), "clock": self.clock, "sustained": self.sustained,
                "attention": {k: {"fwd": f, "bwd": b} for k, (f, b) in self.attention.items()},
                "attention_kernel": dict(self.attention_kernel), "hbm": self.hbm, "launch_us": self.launch_s * 1e6,
                "k0": self.k0, "s0": self.s0, "d0": self.d0, "power_points": [list(p) for p in self.power_points],
                "gemm_k": dict(self.gemm_k), "speed_sd": self.speed_sd,
                "attention_shape": {k: {"s0": a, "d0": b, "causal": c} for k, (a, b, c) in self.attention_shape.items()},
                **({"cudnn_version": self.cudnn_version} if self.cudnn_version else {})}


# -- the presets (docs/devices.md, "Achievable rates", gives every source) -------------------------

#: Sinha et al., "Not All GPUs Are Created Equal: Characterizing Variability in Large-Scale,
#: Accelerator-Rich Systems" (SC22, arXiv 2208.11035 v3): over 90% of the GPUs of five clusters
#: (Summit, Vortex, Frontera, Longhorn: V100; Corona: MI60), the same application on each GPU
#: alone, "8% (max 22%) average performance variation" though the SKU is the same (manufacturing
#: variability under the chip's power management). Their variation is the box plot's whisker span
#: over the median (the authors' artifact, hal-uw/gpu_variability_sc22_artifact
#: plot_script/plot_aggregated.py: ``range = q3 + 1.5 * iqr - (q1 - 1.5 * iqr)``, ``range/q2``):
#: 4 interquartile ranges. A normal spread has an IQR of ``2 x 0.67449`` standard deviations, so
#: 8% is a standard deviation of ``0.08 / (4 x 2 x 0.67449)`` = 0.01483 of the median's time.
GPU_SPEED_SD = 0.08 / (4 * 2 * 0.6744897501960817)

#: A100 SXM4: 108 SMs (NVIDIA A100 whitepaper). bf16/fp16 ceiling 0.859 = 267.9 / 312 TFLOP/s, the
#: best cuBLAS matmul measured by ml-engineering's mamf-finder (CUDA 12.1), at 6912x2048x16384
#: (MxNxK: four full waves of 256x128 tiles, so K = 16384 is where it holds); tf32 likewise assumed.
#: FlashAttention-2 paper (Dao 2023) Fig. 4-6, head dim 128: forward up to ~0.70 of 312, backward
#: ~0.58. STREAM-like copy on A100 80GB: ~1.75 TB/s of 2.039 (0.86); 40GB: ~1.37 of 1.555 (0.88).
_A100_GEMM = 267.9 / 312
#: ``triton``: flash-attention's pre-MLIR Triton kernel (flash_attn/flash_attn_triton.py at
#: Dao-AILab/flash-attention eff9fe6b, copied into llm-foundry as
#: llmfoundry/models/layers/flash_attn_triton.py, MPT's ``attn_impl: triton``). No source times it;
#: its docstring compares it with the CUDA kernel of its day, FlashAttention (v1): "Overall Triton
#: forward + backward is slightly slower than CUDA forward + backward" (tested on A100 only). Its
#: compiler (triton 2.0.0.dev20221202; on H100 vchiley/triton's triton_pre_mlir_sm90 branch, 86c7fe23,
#: which only adds the sm_90 target and PTX 8.0 to lib/driver/llvm.cc) lowers every ``tl.dot`` on
#: sm >= 80 to mma.sync m16n8k16 (lib/codegen/selection/generator.cc ``visit_mma16816``), the
#: Ampere instruction FlashAttention v1 runs on both GPUs too (flash-attn v1.0.9 csrc/flash_attn/src/
#: fmha/gemm.h ``mma.sync.aligned.m16n8k16``; no Hopper wgmma). So its rates are
#: FlashAttention v1's, the bars "FlashAttention" of the flash-attention repo's forward + backward
#: figures (Dao-AILab/flash-attention 4f285b35, the FlashAttention-2 paper's setup: batch 16k / seq,
#: hidden 2048, fwd 4·s²·d·h, bwd 2.5x, causal halved), (causal, head dim) -> TFLOP/s at seq 512,
#: 1k, 2k, 4k, 8k, 16k; A100 80GB SXM4 (assets/flash2_a100_fwd_bwd_benchmark.png, the paper's Figure 4):
FA1_A100_FIG4 = {(False, 64): (91, 92, 104, 108, 110, 110), (False, 128): (76, 72, 76, 80, 82, 83),
                 (True, 64): (58, 70, 77, 87, 92, 97), (True, 128): (55, 62, 69, 76, 80, 83)}
#: H100 80GB SXM5 (assets/flash2_h100_fwd_bwd_benchmark.png):
FA1_H100_PAIR = {(False, 64): (157, 159, 161, 161, 166, 168), (False, 128): (127, 127, 128, 131, 137, 139),
                 (True, 64): (104, 123, 136, 138, 149, 156), (True, 128): (98, 109, 108, 126, 135, 137)}
#: The same A100 figure's bars "FlashAttention Triton": not MPT's kernel. The repo's benchmark script
#: of those figures' configs (benchmarks/benchmark_flash_attention.py, 60499abc, 2023-07-28, 11 days
#: after the figure) times OpenAI's ``triton.ops.flash_attention`` ("Install the newest triton
#: version") as "Triton", and asked whether the README's "FlashAttention Triton" bars are the v1
#: Triton kernel, Tri Dao pointed to OpenAI's Triton performance data (Dao-AILab/flash-attention#390).
#: Kept as a record (the ``triton`` rates until this was found):
TRITON_A100_FIG4 = {(False, 64): (90, 102, 98, 98, 100, 100), (False, 128): (78, 85, 90, 93, 95, 95),
                    (True, 64): (59, 75, 79, 76, 79, 80), (True, 128): (50, 61, 68, 74, 78, 80)}
#: Fitted to the 24 FlashAttention v1 points of each GPU alone (least squares in log;
#: benchmarks/fit_attention.py): the pair's non-causal asymptote of the bf16 peak, ``S0``, ``D0`` 0
#: (its head dim 64 runs faster than 128: no head-dim term) and the causal share; rms error 11.2%
#: (A100), 9.5% (H100), much of it the head dims' gap the form cannot follow (the causal d 128 points,
#: MPT's: within 5% at 8k-16k, up to 11% (A100) and 18% (H100) too fast at 1k-2k). The figures give
#: the pair only: forward over backward is taken as the ``fa2`` entry's 0.70 / 0.58 (an assumption, as
#: before), the pair's time ``1/f + 2.5/b`` over 3.5 set to the fit.
_TRITON_FB = 0.70 / 0.58


def _triton_passes(pair: float) -> tuple[float, float]:
    bwd = pair * (1 / _TRITON_FB + 2.5) / 3.5
    return _TRITON_FB * bwd, bwd


TRITON_A100 = _triton_passes(0.3102)
TRITON_A100_SHAPE = (136.0, 0.0, 0.8932)
TRITON_H100 = _triton_passes(0.1559)
TRITON_H100_SHAPE = (92.0, 0.0, 0.9033)
#: ``fa2`` on the same A100s, the same Figure 4 (the repo's assets/flash2_a100_fwd_bwd_benchmark.png),
#: the bars "FlashAttention-2", same keys and sequences (the labels of (a) 1k, (b) 512 and (b) 1k lie
#: under the legend: read from the bar heights against the labelled bars of the panel, 152.2, 151.0,
#: 172.9 TFLOP/s; (a) 1k's label shows its last digit, 3):
FA2_A100_FIG4 = {(False, 64): (132, 153, 162, 171, 175, 176), (False, 128): (151, 173, 187, 196, 201, 203),
                 (True, 64): (88, 119, 140, 156, 165, 171), (True, 128): (99, 133, 155, 173, 182, 189)}
#: fitted to those 24 points alone (benchmarks/fit_attention.py, the ``triton`` fit's form and least
#: squares): ``S0`` 228, ``D0`` 20 (head dim 64 runs at 0.88 of 128), causal share 0.927; rms
#: error 2.1%. Its pair asymptote, 0.668 of 312, is above the 0.610 the 0.70 / 0.58 entry gives
#: (``3.5 / (1/0.70 + 2.5/0.58)``), which is kept (docs/devices.md, "Each kernel's shape from its own figures")
FA2_A100_SHAPE = (228.0, 20.0, 0.927)
#: FlashAttention-2 on A100, forward / backward asymptotes (the FlashAttention-2 paper's figures)
_FA2_A100 = (0.70, 0.58)
#: ``flash-attn`` (Dao's package, as Transformer Engine's FlashAttention backend calls it) on A100:
#: the ``fa2`` entry is already Dao's own kernel (the FlashAttention-2 paper's figures are of the
#: flash-attn package), so its rates and shape are reused
A100_RATES = Rates(108, {"bf16": _A100_GEMM, "fp16": _A100_GEMM, "tf32": _A100_GEMM, "fp32": 0.95},
                   {"fa2": _FA2_A100, "flash-attn": _FA2_A100, "triton": TRITON_A100},
                   {"megatron": "fa2", "torchtitan": "fa2"}, hbm=0.86,
                   gemm_k={"bf16": 16384, "fp16": 16384, "tf32": 16384}, speed_sd=GPU_SPEED_SD,
                   attention_shape={"triton": TRITON_A100_SHAPE, "fa2": FA2_A100_SHAPE,
                                    "flash-attn": FA2_A100_SHAPE})
A100_40_RATES = Rates(108, A100_RATES.gemm, A100_RATES.attention, A100_RATES.attention_kernel, hbm=0.88,
                      gemm_k=A100_RATES.gemm_k, speed_sd=GPU_SPEED_SD, attention_shape=A100_RATES.attention_shape)
#: H100 SXM5: 132 SMs (NVIDIA H100 whitepaper). bf16 ceiling 792.1 / 989 (mamf-finder, CUDA 12.1,
#: at 6144x2816x17920: four full waves of 128x256 tiles; its torch 2.7 rerun 794.5 at
#: 2048x2048x13312). fp8 (``float8_e4m3fn``) 1402.6 / 1979 = 0.709 (mamf-finder, torch 2.7.0+cu126,
#: at 1024x9216x14336). The same table's ``Theory`` column gives the peaks as 989 / 1979.
_H100_GEMM = 792.1 / 989
_H100_FP8 = 1402.6 / 1979
_H100_GEMM_K = {"bf16": 17920, "fp16": 17920, "tf32": 17920, "fp8": 14336}
#: FlashAttention-2 on H100 80GB SXM5, forward + backward, the repo's
#: assets/flash2_h100_fwd_bwd_benchmark.png (Dao-AILab/flash-attention 4f285b35; the FlashAttention-2
#: bars, Figure 4's setup and FLOP count): (causal, head dim) -> TFLOP/s at seq 512 .. 16k:
FA2_H100_PAIR = {(False, 64): (215, 254, 274, 288, 294, 296), (False, 128): (248, 294, 320, 326, 335, 338),
                 (True, 64): (141, 192, 232, 257, 273, 284), (True, 128): (163, 221, 265, 294, 308, 328)}
#: the FlashAttention-3 paper (Shah et al. 2024, arXiv 2407.08608) on H100 80GB SXM5, bf16, batch
#: 16k / seq, hidden 2048, the same sequences: its forward figure (the repo's assets/flash3_fp16_fwd.png
#: at 7ef24848), (kernel, causal, head dim) -> TFLOP/s, the bars "FlashAttention-2" and "cuDNN":
FA3_H100_FWD = {("fa2", False, 64): (282, 306, 318, 321, 322, 324), ("fa2", True, 64): (180, 229, 262, 284, 295, 299),
                ("fa2", False, 128): (309, 350, 362, 368, 370, 370), ("fa2", True, 128): (191, 260, 298, 319, 333, 335),
                ("fa2", False, 256): (275, 313, 321, 323, 324, 326), ("fa2", True, 256): (208, 251, 278, 293, 297, 298),
                ("cudnn", False, 64): (335, 373, 395, 408, 412, 413), ("cudnn", True, 64): (225, 288, 334, 363, 379, 388),
                ("cudnn", False, 128): (497, 574, 617, 609, 600, 595), ("cudnn", True, 128): (315, 410, 484, 518, 529, 539),
                ("cudnn", False, 256): (470, 546, 580, 581, 580, 581), ("cudnn", True, 256): (308, 391, 450, 483, 497, 509)}
#: (every label checked against its bar's height: one scale per panel to 1%). Its backward figure
#: (non-causal only) is not in the repo and not read here as an image: its values as public
#: transcriptions of the paper's figure give them (head dim 128: two, which agree, and agree with the
#: 322 and 516 cited below; head dim 64: one, the other agreeing to 2k), (kernel, head dim) -> TFLOP/s:
FA3_H100_BWD = {("fa2", 64): (198, 238, 264, 279, 287, 291), ("fa2", 128): (214, 260, 291, 310, 318, 322),
                ("cudnn", 64): (266, 348, 395, 417, 432, 433), ("cudnn", 128): (305, 408, 465, 499, 518, 516)}
#: each kernel's shape fitted to its points above of head dim <= 128 (benchmarks/fit_attention.py:
#: the form caps the head-dim term at 1 above 128; an asymptote per pass, one shape): ``fa2`` (60
#: points: the pair, forward and backward) ``S0`` 208, ``D0`` 20, causal share 0.904, rms 3.8%;
#: ``cudnn`` (36 points: forward and backward) ``S0`` 208, ``D0`` 72, causal share 0.894, rms 7.0%
FA2_H100_SHAPE = (208.0, 20.0, 0.904)
CUDNN_H100_SHAPE = (208.0, 72.0, 0.894)
#: Transformer Engine's attention benchmark (NVIDIA/TransformerEngine
#: benchmarks/attention/benchmark_attention.py, ``model_configs``), bf16, layout bshd, no dropout,
#: forward + backward: test -> (batch, heads, kv groups, head dim, sequence, causal, bias). Each
#: figure below is the mean over 3 timed iterations (after 3 untimed ones) of the summed nsys
#: durations of the kernels whose names hold "cudnn" (4 a pass pair; +1 with a bias, +2 under
#: GQA) or "void flash" (4: flash-attn's forward, dot(dO, O), dq/dk/dv, the dq conversion; the
#: GQA reduction of dK, dV is a torch kernel, not counted): kernel time only, no host time, no
#: reference checks. ``test_2`` adds a trained [1, h, s, s] bias (its read and its gradient):
#: recorded, not modelled.
TE_ATTENTION_CONFIGS = {"test_0": (2, 16, 16, 64, 512, False, False), "test_1": (2, 16, 16, 128, 2048, True, False),
                        "test_2": (2, 16, 16, 128, 2048, True, True), "test_3": (2, 32, 4, 128, 8192, True, False)}
#: the times (ms) its docs/examples/attention/attention.ipynb prints, (kernel, test) -> ms, on
#: - ``sxm``: "NVIDIA H100 80GB HBM3" (H100 SXM5) at 88c0c9143 (2024-08-13, #1075; unchanged to
#:   7dbdf7b2e, 2026-07), the notebook's logs: cuDNN 9.3.0, flash-attn 2.4.2, TE 1.10.0.dev0+ee85a91;
#: - ``pcie``: "NVIDIA H100 PCIe" at 43569381c (2024-06-13, #889) .. 098e30060: cuDNN 9.2.0,
#:   flash-attn 2.4.2, TE 1.8.0.dev0 (the same script, reformatted).
TE_H100_MS = {"sxm": {("cudnn", "test_0"): 0.0340, ("fa2", "test_0"): 0.0468, ("cudnn", "test_1"): 0.3664,
                      ("fa2", "test_1"): 0.5850, ("cudnn", "test_2"): 0.9332, ("cudnn", "test_3"): 7.4875,
                      ("fa2", "test_3"): 11.8879},
              "pcie": {("cudnn", "test_0"): 0.0638, ("fa2", "test_0"): 0.0858, ("cudnn", "test_1"): 0.5415,
                       ("fa2", "test_1"): 0.7496, ("cudnn", "test_2"): 1.2302, ("cudnn", "test_3"): 12.0122,
                       ("fa2", "test_3"): 19.0716}}
#: cuDNN's fused attention by version (NVIDIA/cudnn-frontend ``benchmark/benchmark_results.csv``,
#: its ``benchmark_flash_attention.py``): bf16, head dim 128, 16 heads, batch 4 / 2 / 1 / 1 / 1 at
#: sequence 4k / 8k / 16k / 32k / 64k, one H200 with clocks locked (its README: ``nvidia-smi -ac
#: 3201,1980``, ``-pl 700``), the same FLOP count as the papers (causal halved, backward 2.5x),
#: version -> (causal, backward) -> TFLOP/s: 9.1.0 at b740542 (2024-05-07; "cudnn backend version :
#: 90100", nvcr.io/nvidia/pytorch:24.03-py3 with the apt cudnn), 9.4.0 at de355c7 (2024-09-23,
#: "Updated benchmark numbers with cudnn 9.4.0"; pytorch:24.07-py3 with the apt cudnn)
CUDNN_FE_H200 = {
    "9.1.0": {(False, False): (654.2, 668.7, 641.9, 612.6, 602.2), (False, True): (517.3, 530.4, 538.5, 536.2, 535.4),
              (True, False): (542.3, 572.9, 586.8, 577.3, 567.0), (True, True): (443.6, 463.5, 497.7, 499.7, 503.8)},
    "9.4.0": {(False, False): (704.4, 696.5, 688.0, 648.6, 635.0), (False, True): (535.1, 537.0, 546.5, 546.3, 549.3),
              (True, False): (613.5, 646.0, 650.0, 636.1, 631.2), (True, True): (438.5, 461.9, 488.6, 504.1, 508.1)}}
#: the version the Hopper presets' ``cudnn`` rates stand for: their level is its measured one
#: (``_CUDNN_H100`` below)
CUDNN_BASE_VERSION = "9.1.0"
#: Flash attention on H100 SXM5 at head dim 128 (each asymptote = the cited TFLOP/s / 989.5 / the
#: sequence saturation, the kernel's ``S0``, at the cited length, so the model gives the cited figure
#: there):
#: - ``fa2``, torch's ``scaled_dot_product_attention`` (its flash backend, FlashAttention-2; cuDNN is
#:   opt-in since pytorch/pytorch#138522, 2.5.1): forward 329.483 TFLOP/s at (batch 1, 24 heads,
#:   4608 tokens), non-causal, torch 2.6.0.dev20241204 (pytorch/pytorch#142132, tritonbench);
#:   backward FlashAttention-2's 322 at 16k (FlashAttention-3 paper, Shah et al. 2024, backward
#:   figure, head dim 128).
#: - ``cudnn``, Transformer Engine's fused attention (cuDNN): cuDNN 9.1.0's 641.9 forward, 538.5
#:   backward at 16k, non-causal (:data:`CUDNN_FE_H200`, cudnn-frontend's benchmark of that version;
#:   the FlashAttention-3 paper's cuDNN bars, 595 / 516 there, version not stated, are 0.90-0.96 of
#:   it at the same shapes and give the kernel's shape, :data:`CUDNN_H100_SHAPE`).
_FA2_H100 = (329.483 / 989.5 / (4608 / (4608 + FA2_H100_SHAPE[0])),
             322 / 989.5 / (16384 / (16384 + FA2_H100_SHAPE[0])))
_CUDNN_H100 = (CUDNN_FE_H200[CUDNN_BASE_VERSION][(False, False)][2] / 989.5 / (16384 / (16384 + CUDNN_H100_SHAPE[0])),
               CUDNN_FE_H200[CUDNN_BASE_VERSION][(False, True)][2] / 989.5 / (16384 / (16384 + CUDNN_H100_SHAPE[0])))
#: - ``flash-attn``, FlashAttention-2 as Dao's ``flash-attn`` package builds it (what Transformer
#:   Engine's ``FlashAttention`` backend calls: NeMo-Framework-Launcher 24.01-24.07's
#:   ``NVTE_FUSED_ATTN: 0``): the FlashAttention-3 paper's "FlashAttention-2" bars, non-causal head
#:   dim 128 at 16k, forward 370, backward 322 (:data:`FA3_H100_FWD`, :data:`FA3_H100_BWD`); the
#:   ``fa2`` fit's shape (the same kernel's points). torch's SDPA build (``fa2``) forwards at 329.
_FLASH_ATTN_H100 = (FA3_H100_FWD[("fa2", False, 128)][-1] / 989.5 / (16384 / (16384 + FA2_H100_SHAPE[0])),
                    FA3_H100_BWD[("fa2", 128)][-1] / 989.5 / (16384 / (16384 + FA2_H100_SHAPE[0])))


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def cudnn_version_scale(version: str, backward: bool, causal: bool) -> float:
    """A measured cuDNN ``version``'s speed over :data:`CUDNN_BASE_VERSION`'s for one pass: the
    geometric mean over the five lengths of :data:`CUDNN_FE_H200`'s ratios (the same script, GPU and
    locked clocks, so those cancel); 1 for the base version or ""."""
    if not version or version == CUDNN_BASE_VERSION:
        return 1.0
    new, old = CUDNN_FE_H200[version][(causal, backward)], CUDNN_FE_H200[CUDNN_BASE_VERSION][(causal, backward)]
    return math.exp(sum(math.log(a / b) for a, b in zip(new, old)) / len(new))


def measured_cudnn_version(given: str, where: str) -> str:
    """The measured version (:data:`CUDNN_FE_H200`) a run on cuDNN ``given`` takes: the newest one
    not newer than it; ProgramError naming ``where`` for a malformed version or one older than the
    oldest measured."""
    ok = isinstance(given, str) and all(x.isdigit() for x in given.split(".")) and 1 <= len(given.split(".")) <= 4
    if not ok:
        raise ProgramError(f"{where}: expected a cuDNN version such as \"9.4.0\", got {json.dumps(given)[:40]}")
    known = sorted(CUDNN_FE_H200, key=_version_key)
    older = [v for v in known if _version_key(v) <= _version_key(given)]
    if not older:
        raise ProgramError(f"{where}: no Hopper rates measured for cuDNN {given[:20]} (the oldest measured is "
                           f"{known[0]}; measured: {', '.join(known)})")
    return older[-1]


_H100_SHAPE = {"fa2": FA2_H100_SHAPE, "flash-attn": FA2_H100_SHAPE, "cudnn": CUDNN_H100_SHAPE,
               "triton": TRITON_H100_SHAPE}
#: GH100 (132 SMs) at two board powers, NVIDIA's datasheets: H100 SXM at 700 W, dense bf16 989.5
#: TFLOP/s (1,979 with sparsity); H100 NVL at 350-400 W, 835.5 (1,671 with sparsity): the same
#: SMs at the tensor-core clock NVIDIA rates for 400 W, 0.844 of the SXM's. torchtitan's H100
#: benchmark (benchmarks/llama3_h100_202412_torchtitan.md, footnote 2) puts its 500 W H100s
#: "between SXM and NVL" for the same reason.
HOPPER_POWER = ((400.0, 835.5 / 989.5), (700.0, 1.0))
#: the share of mamf-finder's and the attention papers' H100 rates sustained through training
#: steps (:attr:`Rates.sustained`), calibrated on the published H100 runs (docs/devices.md,
#: "Sustained rates"; 0.843 -> 0.870 with NeMo 24.07's runs on the flash-attn kernel their launcher
#: config ran, then 0.864 with the torchtitan 405B float8 rows' fp8 all-gather, then 0.853 with torchao's
#: float8 TP all-gathers of the tp = 8 float8 rows, then 0.870 with torchao's float8 casts as
#: torchtitan compiles them, benchmarks/calibrate_sustained.py unchanged)
HOPPER_SUSTAINED = 0.870
H100_RATES = Rates(132, {"bf16": _H100_GEMM, "fp16": _H100_GEMM, "tf32": _H100_GEMM, "fp32": 0.95, "fp8": _H100_FP8},
                   {"fa2": _FA2_H100, "flash-attn": _FLASH_ATTN_H100, "cudnn": _CUDNN_H100, "triton": TRITON_H100},
                   {"megatron": "cudnn", "torchtitan": "fa2"},
                   hbm=0.90, power_points=HOPPER_POWER, gemm_k=_H100_GEMM_K,
                   sustained=HOPPER_SUSTAINED, speed_sd=GPU_SPEED_SD, attention_shape=_H100_SHAPE)
#: H200 SXM5: the H100's GPU (132 SMs, the same peaks) with HBM3e at 4.8 TB/s; its larger power
#: budget holds clocks a little better (GH200 0.83): the H100's fractions, HBM ~0.88.
H200_RATES = Rates(132, H100_RATES.gemm, H100_RATES.attention, H100_RATES.attention_kernel, hbm=0.88,
                   power_points=HOPPER_POWER, gemm_k=_H100_GEMM_K, sustained=HOPPER_SUSTAINED,
                   speed_sd=GPU_SPEED_SD, attention_shape=_H100_SHAPE)


def clock_at_power(rates: Rates, watts: float, name: str) -> float:
    """The sustained tensor-core clock under a ``watts`` board power limit, as a fraction of the
    rated one: linear between the GPU's :attr:`Rates.power_points` (ProgramError outside them or
    where none are known)."""
    pts = sorted(rates.power_points)
    if not pts:
        raise ProgramError(f"--device power_limit_w: no rated power points known for {name[:60]} (give "
                           f"efficiency.clock, the sustained tensor-core clock as a fraction, instead)")
    lo, hi = pts[0][0], pts[-1][0]
    if not lo <= watts <= hi:
        raise ProgramError(f"--device power_limit_w: {watts:g} W is outside {lo:g}-{hi:g} W, the powers NVIDIA "
                           f"rates {name[:60]}'s GPU at (give efficiency.clock instead)")
    for (w0, c0), (w1, c1) in itertools.pairwise(pts):
        if w0 <= watts <= w1:
            return c0 + (c1 - c0) * (watts - w0) / (w1 - w0) if w1 > w0 else c1
    return pts[-1][1]


# -- the model ------------------------------------------------------------------------------------


@lru_cache(maxsize=65536)
def tile_wave_utilisation(batch: int, m: int, n: int, sms: int) -> float:
    """The useful share of the tensor cores' work for a ``batch`` x (m x n) output cut into the
    best of :data:`TILES`: ``m·n·batch / (waves · sms · TM·TN)`` times the tile's reuse, the tile
    that gives most (NVIDIA's guide ch. 3: tile quantisation, then wave quantisation): the
    grouped GEMM of ``batch`` experts of exactly ``m`` rows (:func:`grouped_tile_utilisation`)."""
    return _tile_utilisation(((float(m), 0.0, batch),), n, sms)


#: one group of a grouped GEMM's experts: (mean rows, standard deviation of the rows, experts)
RowGroup = tuple[float, float, int]


def expected_tiles(mean: float, sd: float, tm: int) -> float:
    """The expected ``ceil(rows / tm)`` of an expert whose rows are ``mean`` exactly (``sd`` 0) or
    a count scattered around it, taken as normal (a continuity-corrected normal approximation
    of the count): ``sum_{j >= 0} P(rows > j tm + 1/2)``, the tiles whose first row is filled."""
    if sd <= 0.0:
        return float(max(0, math.ceil(mean / tm - 1e-9)))
    lo = max(0, math.floor((mean - 8.0 * sd) / tm))
    hi = math.ceil((mean + 8.0 * sd) / tm) + 1
    tail = sum(0.5 * math.erfc((j * tm + 0.5 - mean) / (sd * math.sqrt(2.0))) for j in range(lo, hi))
    return lo + tail


@lru_cache(maxsize=4096)
def grouped_tile_utilisation(rows: tuple[RowGroup, ...], n: int, sms: int) -> float:
    """:func:`tile_wave_utilisation` of ONE grouped GEMM over experts of unequal rows (Megatron-Core's
    / Transformer Engine's grouped GEMM, torch's ``_grouped_mm``): each expert's rows padded to the
    tile, every expert's tiles in one grid over the SMs: tiles ``sum_e E[ceil(rows_e / TM)] x
    ceil(n / TN)`` (:func:`expected_tiles`), waves over ``sms``, the useful share from the real rows
    (``sum_e rows_e x n``), times the tile's reuse, the best tile's."""
    return _tile_utilisation(rows, n, sms)


def _tile_utilisation(rows: tuple[RowGroup, ...], n: int, sms: int) -> float:
    """:func:`grouped_tile_utilisation`'s count, each caller caching its own answers."""
    useful = sum(mean * count for mean, _, count in rows) * n
    best = 0.0
    for tm, tn in TILES:
        tiles = sum(expected_tiles(mean, sd, tm) * count for mean, sd, count in rows) * -(-n // tn)
        waves = max(1, math.ceil(tiles / sms - 1e-9))
        u = useful / (waves * sms * tm * tn) * _reuse(tm, tn)
        if u > best:
            best = u
    return best


#: ``K0`` of a dtype over bf16's: fp8's tensor cores run a tile's main loop at twice the rate, its
#: prologue and epilogue at the same (tilelang's fp8 8192x8192xK sweep on H800: K = 2048 reaches
#: 0.87 of K = 16384; ``K0`` = 128 would give 0.95, 256 gives 0.90)
K0_SCALE = {"fp8": 2.0}


def gemm_efficiency(rates: Rates, key: str, batch: int, m: int, n: int, k: int) -> float:
    """The fraction of the ``key`` peak a (batch, m, n, k) GEMM reaches: the ceiling, the tile and
    wave utilisation, and ``K / (K + K0)`` (normalised to 1 at :attr:`Rates.gemm_k`, the K the
    ceiling was measured at, 2048 where not given; capped at 1)."""
    return _ceiling_at_k(rates, key, k) * tile_wave_utilisation(max(batch, 1), max(m, 1), max(n, 1), rates.sms)


def _ceiling_at_k(rates: Rates, key: str, k: int) -> float:
    """The dtype's large-GEMM ceiling times ``K / (K + K0)`` (normalised at :attr:`Rates.gemm_k`)."""
    ceiling = rates.gemm.get(key) or rates.gemm.get("bf16", 0.8)
    k0 = rates.k0 * K0_SCALE.get(key, 1.0)
    kref = float(rates.gemm_k.get(key, 2048.0))
    return ceiling * min(1.0, (k / (k + k0)) / (kref / (kref + k0)))


def grouped_efficiency(rates: Rates, key: str, rows: tuple[RowGroup, ...], n: int, k: int) -> float:
    """:func:`gemm_efficiency` of a grouped GEMM over experts of unequal rows (``rows``:
    :func:`grouped_tile_utilisation`); K, the same for every expert, saturates as a GEMM's."""
    return _ceiling_at_k(rates, key, k) * grouped_tile_utilisation(rows, max(n, 1), rates.sms)


def attention_efficiency(rates: Rates, kernel: str, backward: bool, seq: int, head_dim: int, causal: bool) -> float:
    """The fraction of the bf16 peak a flash-attention pass reaches: the kernel's asymptote (head
    dim 128, long sequences) times ``s / (s + S0)`` (causal: half the sequence: the kernel skips
    the masked blocks) and ``d / (d + D0)`` normalised at d = 128 (capped at 1); ``S0``, ``D0``
    and a causal pass's share of the asymptote the kernel's own (:attr:`Rates.attention_shape`)
    where given."""
    fwd, bwd = rates.attention.get(kernel) or next(iter(rates.attention.values()))
    s0, d0, share = rates.attention_shape.get(kernel, (rates.s0, rates.d0, 1.0))
    s = max(seq / 2 if causal else seq, 1.0)
    ssat = s / (s + s0)
    dsat = min(1.0, (head_dim / (head_dim + d0)) / (128.0 / (128.0 + d0))) if d0 > 0 else 1.0
    version = cudnn_version_scale(rates.cudnn_version, backward, causal) if kernel == "cudnn" else 1.0
    return (bwd if backward else fwd) * ssat * dsat * (share if causal else 1.0) * version


def _dist(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    return math.sqrt(sum((math.log(x) - math.log(y)) ** 2 for x, y in zip(a, b)))


def measured_gemm(measured: Measured, key: str, m: int, n: int, k: int) -> float | None:
    """TFLOP/s (x1e12) of an (m, n, k) GEMM of dtype ``key`` from the measured points of that dtype:
    the exact shape, else an inverse-distance average in log(M, N, K) over the nearest four;
    None where none of the dtype was measured."""
    pts = [p for p in measured.gemm if p.dtype == key]
    if not pts:
        return None
    want = (float(max(m, 1)), float(max(n, 1)), float(max(k, 1)))
    near = sorted((_dist(want, (p.m, p.n, p.k)), p.tflops) for p in pts)[:4]
    if near[0][0] < 1e-9:
        return near[0][1] * 1e12
    w = [1.0 / d for d, _ in near]
    return sum(wi * t for wi, (_, t) in zip(w, near)) / sum(w) * 1e12


def measured_attention(measured: Measured, key: str, backward: bool, seq: int, head_dim: int,
                       causal: bool) -> float | None:
    """FLOP/s of a flash-attention pass from the nearest measured point (the same causality and
    dtype first; log distance over sequence and head dim); None where none was measured."""
    pts = [p for p in measured.attention if p.dtype == key] or list(measured.attention)
    if not pts:
        return None
    same = [p for p in pts if p.causal == causal] or pts
    p = min(same, key=lambda q: _dist((float(seq), float(head_dim)), (q.seq, q.head_dim)))
    return (p.bwd_tflops if backward else p.fwd_tflops) * 1e12


# -- a device file's "efficiency" object ----------------------------------------------------------

_FIELDS = ("sms", "gemm", "attention", "attention_kernel", "attention_shape", "hbm", "launch_us", "k0", "s0", "d0", "clock", "sustained",
           "power_points", "gemm_k", "speed_sd", "cudnn_version")
#: the largest ``speed_sd`` a device file may give (half the median GPU's time)
MAX_SPEED_SD = 0.5


def _frac(where: str, v: Any) -> float:
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(float(v)) and 0 < v <= 1
    if not ok:
        raise ProgramError(f"--device efficiency.{where}: expected a fraction of the peak in (0, 1], "
                           f"got {json.dumps(v)[:40]}")
    return float(v)


def _positive(where: str, v: Any, hi: float) -> float:
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(float(v)) and 0 <= v <= hi
    if not ok:
        raise ProgramError(f"--device efficiency.{where}: expected a number from 0 to {hi:g}, got {json.dumps(v)[:40]}")
    return float(v)


def _per_kernel(field: str, a: Any, keys: tuple[str, ...]) -> list[tuple[str, dict[str, Any]]]:
    """The entries of a device file's ``efficiency.<field>``, an object of attention kernel ->
    an object with exactly ``keys``; ProgramError naming the field, the kernel and what is wrong."""
    if not isinstance(a, dict):
        raise ProgramError(f"--device efficiency.{field}: expected an object of kernel -> {{{', '.join(keys)}}}")
    for key, v in a.items():
        if key not in ATTENTION_KERNELS:
            raise ProgramError(f"--device efficiency.{field}: unknown kernel {str(key)[:20]!r} (one of "
                               f"{', '.join(ATTENTION_KERNELS)})")
        if not isinstance(v, dict) or set(v) != set(keys):
            raise ProgramError(f"--device efficiency.{field}.{key}: expected an object with "
                               f"{', '.join(keys[:-1])} and {keys[-1]}")
    return list(a.items())


def _attention_shape(a: Any, base: Rates) -> dict[str, tuple[float, float, float]]:
    """A device file's ``efficiency.attention_shape``: kernel -> {s0, d0, causal}."""
    out = dict(base.attention_shape)
    for key, v in _per_kernel("attention_shape", a, ("s0", "d0", "causal")):
        out[key] = (_positive(f"attention_shape.{key}.s0", v["s0"], 1e9),
                    _positive(f"attention_shape.{key}.d0", v["d0"], 1e9),
                    _frac(f"attention_shape.{key}.causal", v["causal"]))
    return out


def parse_rates(obj: Any, base: Rates, peak_keys: tuple[str, ...]) -> Rates:
    """``base`` with the fields of a device file's ``"efficiency"`` object (docs/devices.md);
    ProgramError naming the field."""
    if not isinstance(obj, dict):
        raise ProgramError("--device efficiency: expected an object")
    unknown = sorted(set(obj) - set(_FIELDS))
    if unknown:
        raise ProgramError(f"--device efficiency: unknown field {unknown[0][:40]!r} (fields: {', '.join(_FIELDS)})")
    got: dict[str, Any] = {}
    if "sms" in obj:
        v = obj["sms"]
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 100_000:
            raise ProgramError(f"--device efficiency.sms: expected an integer from 1 to 100000, got {json.dumps(v)[:40]}")
        got["sms"] = v
    if "gemm" in obj:
        g = obj["gemm"]
        if not isinstance(g, dict):
            raise ProgramError(f"--device efficiency.gemm: expected an object of {', '.join(peak_keys)} -> fraction")
        gemm = dict(base.gemm)
        for key, v in g.items():
            if key not in peak_keys:
                raise ProgramError(f"--device efficiency.gemm: unknown dtype {str(key)[:20]!r} (one of "
                                   f"{', '.join(peak_keys)})")
            gemm[key] = _frac(f"gemm.{key}", v)
        got["gemm"] = gemm
    if "gemm_k" in obj:
        gk = obj["gemm_k"]
        if not isinstance(gk, dict) or not all(key in peak_keys for key in gk):
            raise ProgramError(f"--device efficiency.gemm_k: expected an object of {', '.join(peak_keys)} -> K")
        ks = {key: _positive(f"gemm_k.{key}", v, 1e9) for key, v in gk.items()}
        bad = [key for key, v in ks.items() if v < 1]
        if bad:
            raise ProgramError(f"--device efficiency.gemm_k.{bad[0]}: expected a K of at least 1, got {ks[bad[0]]:g}")
        got["gemm_k"] = {**base.gemm_k, **ks}
    if "attention" in obj:
        att = dict(base.attention)
        for key, v in _per_kernel("attention", obj["attention"], ("fwd", "bwd")):
            att[key] = (_frac(f"attention.{key}.fwd", v["fwd"]), _frac(f"attention.{key}.bwd", v["bwd"]))
        got["attention"] = att
    if "attention_kernel" in obj:
        ak = obj["attention_kernel"]
        if not isinstance(ak, dict) or not all(isinstance(v, str) and v in ATTENTION_KERNELS for v in ak.values()):
            raise ProgramError(f"--device efficiency.attention_kernel: expected an object of framework -> one of "
                               f"{', '.join(ATTENTION_KERNELS)}")
        got["attention_kernel"] = {**base.attention_kernel, **ak}
    if "attention_shape" in obj:
        got["attention_shape"] = _attention_shape(obj["attention_shape"], base)
    if "hbm" in obj:
        got["hbm"] = _frac("hbm", obj["hbm"])
    for key in ("clock", "sustained"):
        if key in obj:
            got[key] = _frac(key, obj[key])
    if "power_points" in obj:
        pp = obj["power_points"]
        if not isinstance(pp, list) or not all(isinstance(p, list) and len(p) == 2 for p in pp):
            raise ProgramError("--device efficiency.power_points: expected a list of [watts, clock fraction] pairs")
        got["power_points"] = tuple((_positive("power_points watts", w, 1e5), _frac("power_points fraction", f))
                                    for w, f in pp)
    if "speed_sd" in obj:
        v = obj["speed_sd"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_SPEED_SD:
            raise ProgramError(f"--device efficiency.speed_sd: expected the standard deviation of a GPU's tensor-core "
                               f"time over the GPUs of its SKU, a fraction from 0 to {MAX_SPEED_SD:g} of the median "
                               f"GPU's (0: none), got {json.dumps(v)[:40]}")
        got["speed_sd"] = float(v)
    if "cudnn_version" in obj:
        v = measured_cudnn_version(obj["cudnn_version"], "--device efficiency.cudnn_version")
        got["cudnn_version"] = "" if v == CUDNN_BASE_VERSION else v
    if "launch_us" in obj:
        got["launch_s"] = _positive("launch_us", obj["launch_us"], 1e6) * 1e-6
    for key in ("k0", "s0", "d0"):
        if key in obj:
            got[key] = _positive(key, obj[key], 1e9)
    new = Rates(**{**base.__dict__, **got})
    if new.cudnn_version and "cudnn" not in new.attention:
        raise ProgramError("--device efficiency.cudnn_version: the device has no cudnn attention rates to scale (the "
                           "versions' speed-ups are measured on Hopper); leave cudnn_version out")
    missing = [k for k in new.attention_kernel.values() if k not in new.attention]
    if missing:
        raise ProgramError(f"--device efficiency.attention_kernel: kernel {missing[0]!r} has no rates in "
                           f"efficiency.attention")
    return new


__all__ = ["A100_40_RATES", "A100_RATES", "ATTENTION_KERNELS", "GPU_SPEED_SD", "H100_RATES", "H200_RATES", "HOPPER_POWER", "HOPPER_SUSTAINED", "K0_SCALE", "RowGroup", "TILES",
           "TRITON_A100", "TRITON_A100_FIG4", "TRITON_A100_SHAPE", "TRITON_H100", "TRITON_H100_SHAPE", "FA1_A100_FIG4",
           "FA1_H100_PAIR", "FA2_A100_FIG4", "FA2_A100_SHAPE",
           "FA2_H100_PAIR", "FA3_H100_FWD", "FA3_H100_BWD", "FA2_H100_SHAPE", "CUDNN_H100_SHAPE",
           "TE_ATTENTION_CONFIGS", "TE_H100_MS", "CUDNN_FE_H200", "CUDNN_BASE_VERSION", "cudnn_version_scale",
           "measured_cudnn_version",
           "Rates", "attention_efficiency", "clock_at_power", "gemm_efficiency", "measured_attention", "measured_gemm", "parse_rates",
           "expected_tiles", "grouped_efficiency", "grouped_tile_utilisation", "tile_wave_utilisation"]
