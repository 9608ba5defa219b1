"""Devices: the GPU presets (dense peak FLOP/s per dtype, HBM bandwidth, memory, the links in a
node and across nodes, the achievable rates), a device from a JSON file, the time of an op's
cost on a device, and the per-mesh-dim :class:`spmdkit.core.reshard.CostModel` of a device's
links. Standard library only. docs/devices.md.

- :class:`Device` and :data:`DEVICES` (a100-40gb, a100-80gb, h100, h200, h800): dense peak FLOP/s
  per dtype, HBM bandwidth, the links (NVLink in a node, InfiniBand across nodes) that
  :func:`cost_model` maps onto the mesh dims, and :class:`spmdkit.cost.rates.Rates` (the
  fractions of those peaks real kernels reach); :meth:`Device.op_time`: an op's time, the one
  place it is computed: ``max(flops / achievable rate, bytes / achievable bandwidth)``, at least
  the kernel launch floor, plus fp8 casts.
- :func:`load_device`: a preset name or the path of a JSON file (:func:`device_from_json`).
- :meth:`Device.lockstep`: the device as one of the ``n`` GPUs of a training step, which waits
  for the slowest of them (:meth:`Device.slowdown`, :func:`expected_max_normal`).
- :func:`recost` (plan, cost model): the plan's reshards timed by other links.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel, LinkCost, ReshardPlan, Step
from spmdkit.cost.collectives import Fabric, NcclCostModel, buffer_bytes
from spmdkit.cost.measured import Measured, parse_measured
from spmdkit.cost.rates import (
    A100_40_RATES,
    A100_RATES,
    GPU_SPEED_SD,
    H100_RATES,
    H200_RATES,
    Rates,
    RowGroup,
    attention_efficiency,
    clock_at_power,
    gemm_efficiency,
    grouped_efficiency,
    measured_attention,
    measured_gemm,
    parse_rates,
)
from spmdkit.cost.torchao_rowwise import rowwise_scale
from spmdkit.engine.facts import OpCost
from spmdkit.program.plan import Plan, Reshard

#: dtype of a program tensor -> the peak it computes a tensor-core op at
_PEAK_OF_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64",
                  "float8_e4m3fn": "fp8", "float8_e5m2": "fp8"}
PEAK_KEYS = ("bf16", "fp16", "tf32", "fp32", "fp64", "fp8")

#: the rates of a device file with no ``base`` and no ``efficiency``: the middle of the presets'
#: (docs/devices.md, "Achievable rates")
GENERIC_RATES = Rates(132, {"bf16": 0.8, "fp16": 0.8, "tf32": 0.8, "fp32": 0.95, "fp8": 0.68},
                      {"fa2": (0.6, 0.5)}, {"megatron": "fa2", "torchtitan": "fa2"}, hbm=0.88,
                      speed_sd=GPU_SPEED_SD)


def _simpson(f: Callable[[float], float], a: float, b: float, k: int) -> float:
    h = (b - a) / k
    return (f(a) + f(b) + sum((4 if i % 2 else 2) * f(a + i * h) for i in range(1, k))) * h / 3


@lru_cache(maxsize=256)
def expected_max_normal(n: int) -> float:
    """The expected largest of ``n`` independent standard normal draws (0 for one):
    ``E = int_0^inf (1 - Phi(x)^n) dx - int_-inf^0 Phi(x)^n dx``, by Simpson's rule on [0, 12]
    and [-9, 0] (Tippett 1925's and Harter 1961's tables: 0.56419 = 1/sqrt(pi) for 2, 1.42360
    for 8, 2.50759 for 100)."""
    if n <= 1:
        return 0.0

    def cdf_n(x: float) -> float:
        return (0.5 * math.erfc(-x / math.sqrt(2.0))) ** n

    return _simpson(lambda x: 1.0 - cdf_n(x), 0.0, 12.0, 6000) - _simpson(cdf_n, -9.0, 0.0, 4500)


@dataclass(frozen=True)
class Link:
    """One class of link: latency (s) and bandwidth per direction per GPU (bytes/s)."""

    alpha_s: float
    bytes_per_s: float

    def cost(self) -> LinkCost:
        return LinkCost(self.alpha_s, 1.0 / self.bytes_per_s)


@dataclass(frozen=True)
class Device:
    """A GPU: dense peak FLOP/s per dtype (tensor cores for bf16 / fp16 / tf32; fp32 and fp64
    the non-tensor rates), HBM bandwidth (bytes/s), memory (bytes), the link within a node and
    the link across nodes, ranks per node. ``tf32``: float32 matmuls run on the tensor cores
    (PyTorch's ``allow_tf32``; off by default as in PyTorch)."""

    name: str
    peak: dict[str, float]
    hbm_bytes_per_s: float
    memory_bytes: int
    intra: Link
    inter: Link
    ranks_per_node: int = 8
    tf32: bool = False
    #: what ``spmdkit calibrate`` measured on the machine (:mod:`spmdkit.cost.measured`); None
    #: for a preset
    measured: Measured | None = None
    #: the fractions of the peaks real kernels reach (:mod:`spmdkit.cost.rates`)
    rates: Rates = GENERIC_RATES
    #: the GPUs that run the training step together (:meth:`lockstep`; 1: this one alone)
    gpus: int = 1
    #: NCCL's p2p channels (``p2pnChannels``, one CTA each) on one node and across nodes, as
    #: NCCL reports them on the machine (:mod:`spmdkit.cost.nccl_p2p`); (0, 0) not known
    nccl_p2p_channels: tuple[int, int] = (0, 0)
    #: this device at other ``gpus`` (:meth:`at`), shared by all of them: one object per count,
    #: so the caches keyed by a device's id see the same one
    _at: dict[int, Device] = field(default_factory=dict, init=False, repr=False, compare=False)

    def at(self, gpus: int) -> Device:
        """This device as one of ``gpus`` GPUs running a step together (the same object for the
        same count)."""
        if gpus == self.gpus:
            return self
        got = self._at.get(gpus)
        if got is None:
            self._at.setdefault(self.gpus, self)
            got = replace(self, gpus=gpus)
            object.__setattr__(got, "_at", self._at)  # (frozen) one table for all counts
            self._at[gpus] = got
        return got

    def lockstep(self, gpus: int) -> Device:
        """This device in a step of at least ``gpus`` GPUs (the count given before stays when it
        is larger: a pipeline's stage is planned on the sub-mesh of its stage, the step runs on
        them all)."""
        return self.at(max(self.gpus, gpus))

    @property
    def slowdown(self) -> float:
        """A tensor-core kernel's time on the slowest of :attr:`gpus` GPUs over the median GPU's:
        ``1 + speed_sd x E[max of gpus standard normals]`` (:func:`expected_max_normal`). Every
        GPU's clock settles where its power management puts it under the load, and GPUs of one
        SKU settle apart (Sinha et al. 2022, :data:`spmdkit.cost.rates.GPU_SPEED_SD`); a
        synchronous step waits at its collectives for the slowest rank, so all of them run at its
        pace. 1 for one GPU."""
        return 1.0 + self.rates.speed_sd * expected_max_normal(self.gpus)

    def slowest_json(self, added_s: float | None = None) -> dict[str, Any]:
        """:attr:`slowdown` as the JSON shows it: the GPUs of the step, the spread of their
        tensor-core time (``speed_sd``), the slowest GPU's expected distance from the median in
        standard deviations, the slowdown, and (``added_s``) the compute seconds it adds."""
        return {"gpus": self.gpus, "speed_sd": self.rates.speed_sd, "expected_max_sd": expected_max_normal(self.gpus),
                "slowdown": self.slowdown, **({"compute_s": added_s} if added_s is not None else {})}

    def _key(self, dtype: str) -> str:
        key = _PEAK_OF_DTYPE.get(dtype, "fp32")
        return "tf32" if key == "fp32" and self.tf32 else key

    def matmul_peak(self, dtype: str) -> float:
        """The datasheet tensor-core peak of ``dtype`` (MFU's denominator)."""
        return self.peak.get(self._key(dtype)) or self.peak["fp32"]

    def check_precision(self, precision: str | None) -> None:
        """ProgramError where ``--precision`` asks for a peak this device has not (fp8 on an A100)."""
        if precision == "fp8" and "fp8" not in self.peak:
            raise ProgramError(f"--precision fp8: {self.name} has no fp8 tensor cores (its peak_tflops has no fp8; "
                               f"use bf16, or an H100 / H200)")

    @property
    def hbm_rate(self) -> float:
        """The bandwidth memory-bound kernels reach (bytes/s): the measured figure, else the
        datasheet's times the achievable fraction."""
        if self.measured is not None and self.measured.hbm_gb_per_s is not None:
            return self.measured.hbm_gb_per_s * G
        return self.hbm_bytes_per_s * self.rates.hbm

    def gemm_rate(self, key: str, batch: int, m: int, n: int, k: int, rows: tuple[RowGroup, ...] = ()) -> float:
        """FLOP/s of one (batch, m, n, k) GEMM of peak key ``key``: measured (interpolated), else
        the peak times :func:`spmdkit.cost.rates.gemm_efficiency` (a grouped GEMM over experts of
        unequal ``rows``: :func:`spmdkit.cost.rates.grouped_efficiency`)."""
        if self.measured is not None:
            got = measured_gemm(self.measured, key, batch * m, n, k)
            if got is not None:
                return got / self.slowdown
        peak = self.peak.get(key)
        if peak is None:
            if key == "fp8":
                self.check_precision("fp8")
            peak = self.peak["fp32"]
        eff = grouped_efficiency(self.rates, key, rows, n, k) if rows else gemm_efficiency(self.rates, key, batch, m, n, k)
        return peak * eff * self.tensor_clock

    @property
    def tensor_clock(self) -> float:
        """What scales every modelled tensor-core rate (GEMMs, flash attention): the clock under a
        power limit times the share of the microbenchmarked rates sustained through training
        (:attr:`spmdkit.cost.rates.Rates.clock`, :attr:`~spmdkit.cost.rates.Rates.sustained`),
        over the slowest GPU's :attr:`slowdown`; measured rates (``spmdkit calibrate``, one GPU)
        are taken as they are, over the :attr:`slowdown` alone."""
        return self.rates.clock * self.rates.sustained / self.slowdown

    def attention_rate(self, c: OpCost) -> float:
        """FLOP/s of a flash-attention pass (``c.attention``): measured (the nearest point), else
        the bf16 / fp16 peak times :func:`spmdkit.cost.rates.attention_efficiency` of the kernel
        the framework runs."""
        assert c.attention is not None
        backward, seq, hd, causal = c.attention
        key = self._key(c.dtype)
        if self.measured is not None:
            got = measured_attention(self.measured, key, backward, seq, hd, causal)
            if got is not None:
                return got / self.slowdown
        kernel = c.attention_kernel or self.rates.attention_kernel.get(c.framework or "megatron", "")
        if c.attention_kernel and kernel not in self.rates.attention:
            raise ProgramError(f"--attention-kernel {kernel}: no published rates of it on {self.name[:60]} (kernels "
                               f"with rates there: {', '.join(self.rates.attention)}; a device file's "
                               f"efficiency.attention may give them)")
        return self.matmul_peak(c.dtype) * attention_efficiency(self.rates, kernel, backward, seq, hd, causal) * \
            self.tensor_clock

    @property
    def vector_peak(self) -> float:
        """The rate of the non-tensor-core ops (elementwise, norms, ...): the fp32 peak."""
        return self.peak["fp32"]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "peak_tflops": {k: v / 1e12 for k, v in self.peak.items()},
                "hbm_gb_per_s": self.hbm_bytes_per_s / 1e9, "memory_gb": self.memory_bytes / 1e9,
                "intra_node": {"latency_us": self.intra.alpha_s * 1e6, "gb_per_s": self.intra.bytes_per_s / 1e9},
                "inter_node": {"latency_us": self.inter.alpha_s * 1e6, "gb_per_s": self.inter.bytes_per_s / 1e9},
                "ranks_per_node": self.ranks_per_node, "tf32": self.tf32, "efficiency": self.rates.to_json(),
                **({"measured": self.measured.to_json()} if self.measured is not None else {})}

    def compute_time(self, c: OpCost) -> float:
        """The op's FLOPs at the rate achievable for what it is: each GEMM at its shape's rate
        (fp8 where ``c.fp8``; a matmul without shapes at the dtype's large-GEMM ceiling), flash
        attention at its pass's rate, the rest at the vector (fp32) peak."""
        if c.flops == 0:
            return 0.0
        if c.attention is not None:
            return c.flops / self.attention_rate(c)
        if not c.matmul:
            return c.flops / self.vector_peak
        key = "fp8" if c.fp8 else self._key(c.dtype)
        if not c.gemms:
            if key == "fp8":
                self.check_precision("fp8")
            return c.flops / ((self.peak.get(key) or self.peak["fp32"]) * (self.rates.gemm.get(key) or 0.8) *
                              self.tensor_clock)
        total = sum(2.0 * b * m * n * k for b, m, n, k in c.gemms)
        t = sum(self._gemm_times(c, key))
        return t * (c.flops / total) if total > 0 else c.flops / self.matmul_peak(c.dtype)

    def _gemm_times(self, c: OpCost, key: str) -> list[float]:
        """Each of ``c``'s GEMMs at its shape's rate for dtype ``key`` (a grouped one's rows:
        ``c.grouped_rows``)."""
        rows = c.grouped_rows + ((),) * (len(c.gemms) - len(c.grouped_rows))
        return [2.0 * b * m * n * k / self.gemm_rate(key, b, m, n, k, r) for (b, m, n, k), r in zip(c.gemms, rows)]

    def _wgrad_time(self, c: OpCost, compute: float) -> float:
        """The compute time of ``c``'s weight-gradient GEMMs (its last ``wgrad_gemms``): their share
        of ``compute`` (:meth:`compute_time` of ``c``) by their GEMMs' times."""
        ts = self._gemm_times(c, "fp8" if c.fp8 else self._key(c.dtype))
        total = sum(ts)
        return compute * sum(ts[-c.wgrad_gemms:]) / total if total > 0 else 0.0

    def op_time(self, c: OpCost) -> float:
        """The time of an op's cost on this device, the one place it is computed:
        ``max(compute_time, bytes / hbm_rate)`` (:meth:`compute_time`, :attr:`hbm_rate`), the fp8
        casts' bytes after it (memory-bound kernels of their own), and at least the launch floor
        per kernel (a view runs none: 0); a pass of torchao's rowwise float8 linear (``c.rowwise``)
        scaled by its published microbenchmark (:func:`table_rowwise_scale`).
        Weight-gradient GEMMs that accumulate into an fp32
        main gradient (``c.wgrad_bytes``) are kernels of their own: ``max(their compute,
        wgrad_bytes / hbm_rate)`` after ``max(the rest's compute, the rest's bytes / hbm_rate)``."""
        if c.kernels == 0:
            return 0.0
        bw = self.hbm_rate
        compute = self.compute_time(c)
        if c.wgrad_bytes > 0 and 0 < c.wgrad_gemms <= len(c.gemms):
            tw = self._wgrad_time(c, compute)
            t = max(compute - tw, (c.bytes - c.wgrad_bytes) / bw) + max(tw, c.wgrad_bytes / bw)
        else:
            t = max(compute, c.bytes / bw)
        kernels = max(c.kernels, len(c.gemms))
        if c.cast_bytes:
            t += c.cast_bytes / bw
            kernels += len(c.gemms) or 1
        t = max(t, kernels * self.rates.launch_s)
        if c.rowwise is not None:  # torchao's rowwise linear: its published microbenchmark's time
            t *= table_rowwise_scale(*c.rowwise)
        return t


T = 1e12
G = 1e9
#: NVLink and InfiniBand latencies are not datasheet figures: the planner's defaults
#: (spmdkit.core.reshard: 5 us in a node, 20 us across), docs/devices.md.
_NVLINK3 = Link(5e-6, 300 * G)   # A100 SXM4: NVLink 600 GB/s bidirectional = 300 GB/s each way
_NVLINK4 = Link(5e-6, 450 * G)   # H100 / H200 SXM5: 900 GB/s bidirectional = 450 GB/s each way
_IB_HDR = Link(20e-6, 25 * G)    # DGX A100: one 200 Gb/s HDR InfiniBand port per GPU
_IB_NDR = Link(20e-6, 50 * G)    # DGX H100 / H200: one 400 Gb/s NDR ConnectX-7 port per GPU
#: H800 SXM5 (the export H100: its compute and HBM, NVLink cut to 400 GB/s bidirectional =
#: 200 GB/s each way). DeepSeek-V3's cluster (arXiv 2412.19437, section 3.1; arXiv 2505.09343,
#: section 5): 8 H800 a node on NVLink / NVSwitch, 8 x 400 Gb/s InfiniBand NICs a node (one
#: per GPU, 50 GB/s); the report measures 160 GB/s of NVLink and 50 GB/s of IB (section 3.2.2).
_NVLINK4_H800 = Link(5e-6, 200 * G)

#: Dense peaks by dtype: A100 SXM4 (40 and 80 GB alike) and H100 / H200 SXM5 (the same GPU).
_A100_PEAKS = {"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T, "fp64": 9.7 * T}
_H100_PEAKS = {"bf16": 989.5 * T, "fp16": 989.5 * T, "tf32": 494.5 * T, "fp32": 67 * T, "fp64": 34 * T,
               "fp8": 1979 * T}

#: NCCL's p2p channels on 8 H100 SXM (NVSwitch, 18 NVLinks) per node: "24 coll channels, 16 nvls
#: channels, 32 p2p channels, 32 p2p channels per peer" on one node, "16 coll channels, 16 nvls
#: channels, 16 p2p channels, 2 p2p channels per peer" on two (NCCL_DEBUG=INFO of nccl-tests on
#: p5.48xlarge: aws-samples/aws-do-eks Container-Root/eks/deployment/nccl-test/README.md at 701c554)
_H100_NCCL_P2P = (32, 16)

#: The presets (docs/devices.md gives the datasheet of every figure; dense, not sparse).
DEVICES: dict[str, Device] = {
    "a100-40gb": Device("NVIDIA A100 SXM4 40GB", dict(_A100_PEAKS), 1555 * G, 40 * 1024**3, _NVLINK3, _IB_HDR,
                        rates=A100_40_RATES),
    "a100-80gb": Device("NVIDIA A100 SXM4 80GB", dict(_A100_PEAKS), 2039 * G, 80 * 1024**3, _NVLINK3, _IB_HDR,
                        rates=A100_RATES),
    "h100": Device("NVIDIA H100 SXM5 80GB", dict(_H100_PEAKS), 3350 * G, 80 * 1024**3, _NVLINK4, _IB_NDR,
                   rates=H100_RATES, nccl_p2p_channels=_H100_NCCL_P2P),
    # memory in GiB as the other presets' (docs/devices.md "H200 SXM": 141 GiB, not 141e9 bytes)
    "h200": Device("NVIDIA H200 SXM5 141GB", dict(_H100_PEAKS), 4800 * G, 141 * 1024**3, _NVLINK4, _IB_NDR,
                   rates=H200_RATES),
    "h800": Device("NVIDIA H800 SXM5 80GB", dict(_H100_PEAKS), 3350 * G, 80 * 1024**3, _NVLINK4_H800, _IB_NDR,
                   rates=H100_RATES),
}
#: the GPU torchao's rowwise table was measured on (:mod:`spmdkit.cost.torchao_rowwise`): the H100
#: preset, one GPU at its rated power and the microbenchmarked rates (a short timed loop: sustained 1)
ROWWISE_TABLE_DEVICE = replace(DEVICES["h100"], rates=replace(H100_RATES, sustained=1.0))


@lru_cache(maxsize=4096)
def table_rowwise_scale(m: int, k: int, n: int) -> float:
    """:func:`spmdkit.cost.torchao_rowwise.rowwise_scale` on :data:`ROWWISE_TABLE_DEVICE`: what a
    pass of a rowwise float8 linear of forward (m, k, n) is scaled by, on any device (the table's
    measured time over the model's, where it was measured)."""
    return rowwise_scale(ROWWISE_TABLE_DEVICE, m, k, n)


_DEVICE_ALIASES = {"a100": "a100-80gb", "a100-80": "a100-80gb", "a100-40": "a100-40gb", "h100-sxm": "h100",
                   "h100-80gb": "h100", "h200-sxm": "h200", "h200-141gb": "h200",
                   "h800-sxm": "h800", "h800-80gb": "h800"}

_JSON_KEYS = {"name", "peak_tflops", "hbm_gb_per_s", "memory_gb", "intra_node", "inter_node", "ranks_per_node",
              "tf32", "base", "measured", "efficiency", "power_limit_w"}


def _num(what: str, v: Any, positive: bool = True, scale: float = 1.0) -> float:
    """``v * scale`` for a finite number ``v`` (> 0, or >= 0), the product finite too."""
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and (1e-9 <= v <= 1e30 or v == 0)
    x = float(v) * scale if ok else math.nan
    if not ok or not math.isfinite(x) or x < 0 or (positive and x == 0):
        raise ProgramError(f"--device {what}: expected a number from {'1e-9' if positive else '0'} to 1e30, "
                           f"got {json.dumps(v)[:40]}")
    return x


def _link(what: str, v: Any, base: Link) -> Link:
    if not isinstance(v, dict) or set(v) - {"latency_us", "gb_per_s"}:
        raise ProgramError(f"--device {what}: expected an object with latency_us and gb_per_s")
    a = _num(f"{what}.latency_us", v["latency_us"], False, 1e-6) if "latency_us" in v else base.alpha_s
    b = _num(f"{what}.gb_per_s", v["gb_per_s"], True, G) if "gb_per_s" in v else base.bytes_per_s
    return Link(a, b)


def device_from_json(obj: Any) -> Device:
    """A :class:`Device` from its JSON object (the format of :meth:`Device.to_json`; ``base``
    names a preset whose figures the others override). ProgramError naming the field."""
    if not isinstance(obj, dict):
        raise ProgramError("--device: the file must hold a JSON object")
    unknown = sorted(set(obj) - _JSON_KEYS)
    if unknown:
        raise ProgramError(f"--device: unknown field {unknown[0][:40]!r} (fields: {', '.join(sorted(_JSON_KEYS))})")
    base: Device | None = None
    if "base" in obj:
        if not isinstance(obj["base"], str):
            raise ProgramError("--device base: expected a preset name")
        key = _DEVICE_ALIASES.get(obj["base"].strip().lower(), obj["base"].strip().lower())
        if key not in DEVICES:  # (preset_device's message reads as a --device argument, not the file's field)
            raise ProgramError(f"--device base: {obj['base'][:60]!r} is not a preset (one of {', '.join(DEVICES)})")
        base = DEVICES[key]
    else:
        missing = [k for k in ("peak_tflops", "hbm_gb_per_s") if k not in obj]
        if missing:
            raise ProgramError(f"--device: missing {missing[0]!r} (or give \"base\": a preset to start from)")
    peak = dict(base.peak) if base else {}
    if "peak_tflops" in obj:
        pk = obj["peak_tflops"]
        if not isinstance(pk, dict) or not pk:
            raise ProgramError(f"--device peak_tflops: expected an object of {', '.join(PEAK_KEYS)} -> TFLOP/s")
        for k, v in pk.items():
            if k not in PEAK_KEYS:
                raise ProgramError(f"--device peak_tflops: unknown dtype {str(k)[:20]!r} (one of {', '.join(PEAK_KEYS)})")
            peak[k] = _num(f"peak_tflops.{k}", v, True, T)
    if "fp32" not in peak:
        raise ProgramError("--device peak_tflops: needs fp32 (the rate of the non-tensor-core ops)")
    hbm = _num("hbm_gb_per_s", obj["hbm_gb_per_s"], True, G) if "hbm_gb_per_s" in obj else \
        (base.hbm_bytes_per_s if base else 0.0)
    mem = int(_num("memory_gb", obj["memory_gb"], True, G)) if "memory_gb" in obj else \
        (base.memory_bytes if base else 0)
    intra = _link("intra_node", obj["intra_node"], base.intra if base else _NVLINK4) if "intra_node" in obj \
        else (base.intra if base else _NVLINK4)
    inter = _link("inter_node", obj["inter_node"], base.inter if base else _IB_NDR) if "inter_node" in obj \
        else (base.inter if base else _IB_NDR)
    rpn = obj.get("ranks_per_node", base.ranks_per_node if base else 8)
    if isinstance(rpn, bool) or not isinstance(rpn, int) or not 1 <= rpn <= 1 << 20:
        raise ProgramError(f"--device ranks_per_node: expected an integer from 1 to {1 << 20}")
    tf32 = obj.get("tf32", base.tf32 if base else False)
    if not isinstance(tf32, bool):
        raise ProgramError("--device tf32: expected true or false")
    name = obj.get("name", (base.name + " (modified)") if base else "custom device")
    if not isinstance(name, str):
        raise ProgramError("--device name: expected a string")
    measured = parse_measured(obj["measured"]) if "measured" in obj else (base.measured if base else None)
    rates = base.rates if base else GENERIC_RATES
    if "efficiency" in obj:
        rates = parse_rates(obj["efficiency"], rates, PEAK_KEYS)
    if "power_limit_w" in obj:
        if "efficiency" in obj and "clock" in obj["efficiency"]:
            raise ProgramError("--device power_limit_w: give it or efficiency.clock, not both")
        watts = _num("power_limit_w", obj["power_limit_w"])
        rates = replace(rates, clock=clock_at_power(rates, watts, base.name if base else str(name)))
    # NCCL's channels follow the machine's links: the base's, unless its node is redrawn
    nccl = base.nccl_p2p_channels if base and not {"intra_node", "ranks_per_node"} & obj.keys() else (0, 0)
    return Device(name[:100], peak, hbm, mem, intra, inter, rpn, tf32, measured, rates, nccl_p2p_channels=nccl)


def preset_of_gpu(name: str, memory_bytes: int) -> str | None:
    """The preset of a GPU by the name the driver gives it and its memory (an A100 over 60 GB is
    the 80 GB one), None when no preset is that GPU."""
    up = name.upper()
    if "H200" in up:
        return "h200"
    if "H800" in up:
        return "h800"
    if "H100" in up:
        return "h100"
    if "A100" in up:
        return "a100-80gb" if memory_bytes > 60 * 10**9 else "a100-40gb"
    return None


def preset_device(name: str) -> Device:
    key = _DEVICE_ALIASES.get(name.strip().lower(), name.strip().lower())
    try:
        return DEVICES[key]
    except KeyError:
        raise ProgramError(f"--device {name[:60]!r}: no such preset ({', '.join(DEVICES)}) and not a .json "
                           f"file") from None


def load_device(text: str) -> Device:
    """A preset name (``h100``) or the path of a JSON file (:func:`device_from_json`)."""
    if not text.strip().lower().endswith(".json"):
        return preset_device(text)
    if not os.path.isfile(text):
        raise ProgramError(f"--device {text[:100]!r}: no such file")
    try:
        with open(text, encoding="utf-8") as f:
            raw = f.read(1 << 20)
        obj = json.loads(raw)
    except (OSError, UnicodeDecodeError) as exc:
        raise ProgramError(f"--device {text[:100]!r}: cannot read it ({type(exc).__name__})") from None
    except (ValueError, RecursionError) as exc:
        raise ProgramError(f"--device {text[:100]!r}: not valid JSON ({str(exc)[:80]})") from None
    return device_from_json(obj)


def cost_model(mesh: ProcessMesh, device: Device | None = None, ranks_per_node: int | None = None) -> CostModel:
    """Links per mesh dim: walking from the innermost (last) mesh dim outwards, a dim is in a
    node while the product of the sizes so far is at most ``ranks_per_node`` (the device's by
    default), else across nodes. With a device, an :class:`~spmdkit.cost.collectives.NcclCostModel`:
    its collectives timed as NCCL runs them (:func:`spmdkit.cost.collectives.collective_time`:
    ring / tree / NVLS, hierarchical groups, bus-bandwidth efficiency by size, or the device's
    measured points). Without a device, the planner's default links (alpha-beta)."""
    rpn = ranks_per_node or (device.ranks_per_node if device else 8)
    if device is None:
        return CostModel.default(mesh, intra_node=rpn)
    links: list[LinkCost] = []
    prod = 1
    for size in reversed(mesh.shape):
        prod *= size
        links.append((device.intra if prod <= rpn else device.inter).cost())
    fabric = Fabric.of(device.intra.bytes_per_s, device.inter.bytes_per_s, rpn, device.measured)
    return NcclCostModel(tuple(reversed(links)), tuple(mesh.shape), fabric)


def _retime(s: Step, cost: CostModel, mesh: ProcessMesh) -> Step:
    if s.bytes_per_rank == 0:
        return s
    n = 1
    for d in s.mesh_dims:
        n *= mesh.shape[d]
    size = buffer_bytes(s.kind, s.bytes_per_rank, n)
    return replace(s, time_s=cost.collective_time(s.kind, s.mesh_dims, size, mesh.shape))


def recost(plan: Plan, cost: CostModel) -> Plan:
    """The plan with every reshard step timed by ``cost`` (same steps and bytes)."""
    memo: dict[int, ReshardPlan] = {}
    new: dict[int, Reshard] = {}

    def rp(p: ReshardPlan) -> ReshardPlan:
        q = memo.get(id(p))
        if q is None:
            q = ReshardPlan(tuple(_retime(s, cost, plan.mesh) for s in p.steps))
            memo[id(p)] = q
        return q

    def rs(r: Reshard) -> Reshard:
        x = new.get(id(r))
        if x is None:
            x = replace(r, plan=rp(r.plan))
            new[id(r)] = x
        return x

    ops = [replace(o, reshards=[rs(r) for r in o.reshards]) if o.reshards else o for o in plan.ops]  # (frozen)
    return replace(plan, ops=ops, reshards=[rs(r) for r in plan.reshards], cost=cost)


__all__ = ["preset_of_gpu", "DEVICES", "GENERIC_RATES", "PEAK_KEYS", "ROWWISE_TABLE_DEVICE", "Device", "Link", "cost_model",
           "device_from_json",
           "expected_max_normal", "load_device", "preset_device", "recost", "table_rowwise_scale"]
