"""The prepared check of the cost model on one lent GPU (an H100 or H200): measured against
predicted, in one short run (4 minutes of parts, plus torch's start). docs/devices.md, "Checking the model on
a lent GPU", gives the exact ``run`` command.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python3 benchmarks/device_check.py --out "$OUT"
    PYTHONPATH=src python benchmarks/device_check.py --dry-run --out /tmp/dc    # the plumbing on a CPU

Three parts, each under its own time limit (a part whose time is spent skips what is left and
says so), each row printed as it is measured and the JSON (``OUT/device_check.json``) rewritten
after every row, so a run killed at its limit still leaves the rows done; a part that fails
prints its error and the next part runs.

1. ``rates``: ``spmdkit calibrate``'s own microbenchmarks (:mod:`spmdkit.execute.calibrate`, called,
   not copied): bf16 GEMMs (the default sweep and the 1B model's own shapes), fp8 GEMMs
   (``torch._scaled_mm``), torch SDPA's flash kernel and cuDNN's (where ``SDPBackend`` has it)
   forward and backward, causal and not, head dim 128, 4k to 64k tokens, the HBM copy bandwidth and
   the eager launch overhead (a host-bound loop of tiny ops), each beside the rate the preset
   (``h100`` / ``h200``, told from the GPU's name by :func:`spmdkit.cost.devices.preset_of_gpu`)
   gives for the same shape through the cost model's own functions (``Device.gemm_rate``,
   ``Device.attention_rate``, ``Device.hbm_rate``, ``Rates.launch_s``): "model" at the
   microbenchmarks' clock (``sustained`` 1, what a short timed loop sees), "in training" at the
   preset's sustained share. The points are written as a device file (``OUT/device_measured.json``,
   as ``spmdkit calibrate`` writes it) for part 3.
2. ``open``: the open questions of docs/context.md and docs/devices.md as measurements: torch's flash
   kernel at the two shapes of torch's load-balanced ring steps (q 32,768 x kv 16,384 and q 16,384
   x kv 32,768, non-causal) and the causal 32,768 block, 32 heads (the 8 kv heads after
   torchtitan's ``repeat_kv``), head dim 128, bf16, forward and backward, against the model's rate and
   the kernel rates the torchtitan Table 2 cp rows imply (223 / 257 / 185 / 180 TFLOP/s at cp 1 / 2 /
   4 / 8, the model's 234: docs/devices.md, "Context parallelism"); and the grouped GEMM of
   Qwen3-30B-A3B's experts (hidden 2048, expert FFN 768, 8 of 128 experts a token, 4,096 tokens a
   rank over ep 8 and 16; ``torch._grouped_mm``, else a loop of GEMMs, the JSON says which) against
   ``Device.gemm_rate`` with the rows :class:`spmdkit.cost.moe.ExpertRows` gives them.
3. ``step``: one training step on one GPU end to end: a Llama-3-shaped 1.5B model (hidden 2048, 16
   layers, 32 heads, 8 kv, FFN 8192, vocab 128,256, seq 4096, batch 2) written as torchtitan's model
   code (9dec370: eager RMSNorm, complex rotary, ``repeat_kv``, SDPA, SwiGLU, the fp32 loss), FSDP2
   over one rank (fp32 parameters, bf16 compute, fp32 reduce) and torch's foreach AdamW, eager and
   then under ``torch.compile`` per block; the median step after warm-up, peak memory
   (``max_memory_allocated`` / ``max_memory_reserved``), against ``spmdkit plan --model-config ...
   --mesh dp=1 --strategy dp --framework torchtitan --recompute none --json`` (the command printed)
   with the preset and with the device file of part 1.

Without CUDA it refuses in one line (exit 2) unless ``--dry-run``, which runs every part's plumbing
on the CPU at tiny sizes (the figures mean nothing; tests/test_device_check.py runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from spmdkit.cli import main as cli_main  # noqa: E402
from spmdkit.cli.calibrate import Setup, device_file  # noqa: E402
from spmdkit.core.errors import ProgramError  # noqa: E402
from spmdkit.cost.devices import DEVICES, Device, device_from_json, preset_device, preset_of_gpu  # noqa: E402
from spmdkit.cost.measured import AttentionPoint, GemmPoint, Measured  # noqa: E402
from spmdkit.cost.moe import ExpertRows  # noqa: E402
from spmdkit.engine.facts import OpCost  # noqa: E402
from spmdkit.execute.calibrate import (  # noqa: E402
    AttentionShape,
    GemmShape,
    Timing,
    copy_bytes,
    default_gemms,
    fp8_capable,
    measure_attention,
    measure_copy,
    measure_gemm,
    measure_gemm_fp8,
    median_seconds,
    model_shapes,
)
from spmdkit.io.atomic import write_atomic  # noqa: E402
from spmdkit.planner.planning import plan_preset  # noqa: E402

#: the kernel rates (TFLOP/s) torchtitan's Table 2 cp rows imply for the flash kernels, and the
#: model's, docs/devices.md "Context parallelism" (Llama 3.1 8B, 32,768 tokens a GPU, cp 1 .. 8)
TABLE2_IMPLIED = {"cp1": 223.0, "cp2": 257.0, "cp4": 185.0, "cp8": 180.0, "model": 234.0}
#: Qwen3-30B-A3B's experts (its HF config.json: hidden_size 2048, moe_intermediate_size 768,
#: num_experts 128, num_experts_per_tok 8)
QWEN3_30B_A3B = {"hidden": 2048, "ffn": 768, "experts": 128, "top_k": 8}
#: torchtitan pads each expert's rows to a multiple of this before ``torch._grouped_mm``
#: (``ALIGN_SIZE_M`` in torchtitan's MoE ``generate_permute_indices``)
ALIGN_M = 16


@dataclass(frozen=True)
class Sizes:
    """What each part measures: the GPU's sizes, or the dry run's tiny ones."""

    dtype: str
    attention: tuple[tuple[int, int], ...]  # (seq, heads)
    head_dim: int
    ring: tuple[int, int, int]  # (long, short, heads)
    moe: dict[str, int]
    tokens: int  # a rank's microbatch of the MoE layer
    eps: tuple[int, ...]
    model: dict[str, Any]
    steps: tuple[int, int]  # warm-up, timed
    budgets: dict[str, float]
    timing: Timing
    long_timing: Timing
    launch_ops: int
    compile: bool


GPU_MODEL = {"layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8, "ffn": 8192, "vocab": 128256, "seq": 4096,
             "batch": 2, "dtype": "bfloat16", "arch": "llama", "activation": "swiglu", "attention": "flash",
             "tied_embeddings": False}
#: ``budgets``: each part's share of the run's seconds (a part's unused time passes to the next:
#: part i ends by the sum of the shares up to i); ``compile_min``: the least left to try the compile
GPU = Sizes("bf16", ((4096, 32), (16384, 8), (65536, 4)), 128, (32768, 16384, 32), QWEN3_30B_A3B, 4096, (8, 16),
            GPU_MODEL, (3, 6), {"rates": 80.0, "open": 35.0, "step": 125.0, "compile_min": 60.0},
            Timing(5, 20, 0.01), Timing(2, 5, 0.0), 20000, True)
DRY = Sizes("fp32", ((64, 2),), 16, (64, 32, 2), {"hidden": 32, "ffn": 16, "experts": 8, "top_k": 2}, 32, (2,),
            {**GPU_MODEL, "layers": 1, "hidden": 32, "heads": 2, "kv_heads": 1, "ffn": 64, "vocab": 128, "seq": 32,
             "batch": 1},
            (1, 2), {"rates": 60.0, "open": 30.0, "step": 60.0, "compile_min": 0.0}, Timing(1, 2, 0.0),
            Timing(1, 2, 0.0), 100, False)


# -- the record -------------------------------------------------------------------------------------


@dataclass
class Record:
    """The run's results, rewritten to ``OUT/device_check.json`` after every row."""

    out: Path
    data: dict[str, Any] = field(default_factory=dict)

    def save(self) -> None:
        write_atomic(str(self.out / "device_check.json"), (json.dumps(self.data, indent=1) + "\n").encode())

    def part(self, name: str) -> dict[str, Any]:
        return self.data["parts"].setdefault(name, {"status": "running", "rows": [], "notes": []})

    def row(self, part: str, row: dict[str, Any]) -> None:
        self.part(part)["rows"].append(row)
        print(_line(row), flush=True)
        self.save()

    def note(self, part: str, text: str) -> None:
        self.part(part)["notes"].append(text)
        print(f"  note: {text}", flush=True)
        self.save()


def _line(r: dict[str, Any]) -> str:
    m, p, t = r.get("measured"), r.get("model"), r.get("model_training")
    s = f"  {r['what']:<58} measured {_num(m):>9} {r.get('unit', '')}"
    if p is not None:
        s += f"   model {_num(p):>9}"
        if m and p:
            s += f" (x{m / p:.3g})"
    if t is not None:
        s += f"   in training {_num(t)}"
    return s


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.4g}" if isinstance(x, float) else str(x)


def _row(what: str, measured: float | None, unit: str, model: float | None = None,
         model_training: float | None = None, **extra: Any) -> dict[str, Any]:
    r: dict[str, Any] = {"what": what, "measured": measured, "unit": unit, "model": model,
                         "model_training": model_training}
    if measured and model:
        r["ratio"] = measured / model
    r.update(extra)
    return r


class Budget:
    """A part's time: ``left()`` seconds until ``deadline`` (monotonic clock)."""

    def __init__(self, seconds: float, run_deadline: float) -> None:
        self.deadline = min(time.monotonic() + seconds, run_deadline)

    @staticmethod
    def part(sz: Sizes, part: str, wanted: list[str], start: float, run_deadline: float) -> Budget:
        """Part ``part``'s time: until the sum of the shares of the parts run so far and its own
        from ``start``, at most the run's deadline."""
        end = start + sum(sz.budgets[p] for p in PARTS[:PARTS.index(part) + 1] if p in wanted)
        b = Budget(0.0, run_deadline)
        b.deadline = min(end, run_deadline)
        return b

    def left(self) -> float:
        return self.deadline - time.monotonic()


# -- the model's rates --------------------------------------------------------------------------------


def microbench(dev: Device) -> Device:
    """The preset as a short timed loop sees it: its rates at the microbenchmarks' clock
    (``sustained`` 1; the preset's ``clock`` and one GPU's lockstep as they are)."""
    return replace(dev, rates=replace(dev.rates, sustained=1.0))


def attention_cost(fwd_flops: float, backward: bool, keys: int, head_dim: int, causal: bool,
                   kernel: str) -> OpCost:
    """The OpCost of one flash-attention pass as the cost model builds it (``attention``:
    backward, the keys' length, head dim, causal) under torchtitan (``fa2``) or a named kernel."""
    flops = fwd_flops * (2.5 if backward else 1.0)
    return OpCost(flops, flops, 0.0, matmul=True, dtype="bfloat16", attention=(backward, keys, head_dim, causal),
                  framework="torchtitan", attention_kernel="" if kernel == "flash" else kernel)


def attention_rates(dev: Device, fwd_flops: float, keys: int, head_dim: int, causal: bool,
                    kernel: str) -> tuple[float, float, float, float]:
    """(model fwd, model bwd, in-training fwd, in-training bwd) TFLOP/s of the passes."""
    out = []
    for d in (microbench(dev), dev):
        for bwd in (False, True):
            out.append(d.attention_rate(attention_cost(fwd_flops, bwd, keys, head_dim, causal, kernel)) / 1e12)
    return out[0], out[1], out[2], out[3]


# -- part 1: rates --------------------------------------------------------------------------------------


def _gemm_rows(rec: Record, torch: Any, dv: Any, dev: Device, sz: Sizes, budget: Budget,
               shapes: list[GemmShape]) -> list[GemmPoint]:
    got: list[GemmPoint] = []
    fp8 = fp8_capable(dv)
    if dv.type == "cuda" and not fp8:
        rec.note("rates", "fp8 GEMMs not measured: torch._scaled_mm or fp8 tensor cores missing")
    for g in shapes:
        for dtype in ("bf16", "fp8") if fp8 else (sz.dtype,):
            if budget.left() <= 0:
                rec.note("rates", f"time spent: GEMM {g.m}x{g.n}x{g.k} {dtype} skipped")
                return got
            if dtype == "fp8" and (g.m % 16 or g.n % 16 or g.k % 16):
                continue
            try:
                p = (measure_gemm_fp8 if dtype == "fp8" else measure_gemm)(replace(g, dtype=dtype), dv, sz.timing)
            except (RuntimeError, TypeError, AttributeError) as exc:
                rec.note("rates", f"GEMM {g.m}x{g.n}x{g.k} {dtype}: {_one_line(exc)}")
                continue
            got.append(p)
            key = "fp8" if dtype == "fp8" else "bf16"
            rec.row("rates", _row(f"gemm {dtype} M={g.m} N={g.n} K={g.k}", p.tflops, "TFLOP/s",
                                  microbench(dev).gemm_rate(key, 1, g.m, g.n, g.k) / 1e12,
                                  dev.gemm_rate(key, 1, g.m, g.n, g.k) / 1e12, m=g.m, n=g.n, k=g.k, dtype=dtype))
    return got


def _attention_rows(rec: Record, torch: Any, dv: Any, dev: Device, sz: Sizes, budget: Budget,
                    extra: list[AttentionShape]) -> list[AttentionPoint]:
    from torch.nn.attention import SDPBackend

    kernels = ["flash"] + (["cudnn"] if dv.type == "cuda" and hasattr(SDPBackend, "CUDNN_ATTENTION") else [])
    if dv.type == "cuda" and len(kernels) == 1:
        rec.note("rates", "cuDNN attention not measured: torch's SDPBackend has no CUDNN_ATTENTION")
    shapes = [AttentionShape(1, h, s, sz.head_dim, c, sz.dtype) for s, h in sz.attention for c in (True, False)]
    shapes += [a for a in extra if a not in shapes]
    got: list[AttentionPoint] = []
    for a in shapes:
        for kernel in kernels:
            if budget.left() <= 0:
                rec.note("rates", f"time spent: attention s={a.seq} {kernel} skipped")
                return got
            timing = sz.long_timing if a.seq >= 32768 else sz.timing
            try:
                p, ran = measure_attention(a, dv, timing, kernel)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                rec.note("rates", f"attention s={a.seq} {kernel}: {_one_line(exc)}")
                continue
            if ran == "flash" or dv.type != "cuda":
                got.append(p)
            mf, mb, tf, tb = attention_rates(dev, a.fwd_flops, a.seq, a.head_dim, a.causal, kernel)
            what = f"attention {ran} b={a.batch} h={a.heads} s={a.seq} d={a.head_dim}{' causal' if a.causal else ''}"
            info = {"kernel": ran, "asked": kernel, "seq": a.seq, "heads": a.heads, "causal": a.causal}
            rec.row("rates", _row(what + " fwd", p.fwd_tflops, "TFLOP/s", mf, tf, **info, **{"pass": "fwd"}))
            rec.row("rates", _row(what + " bwd", p.bwd_tflops, "TFLOP/s", mb, tb, **info, **{"pass": "bwd"}))
    return got


def measure_launch(torch: Any, dv: Any, n: int) -> float:
    """Seconds of host time per tiny eager op (``x.add_(1)`` on one element) over ``n`` calls:
    the loop is host-bound, so this is torch's dispatch and launch overhead per kernel."""
    x = torch.zeros(1, device=dv)
    for _ in range(min(n, 200)):
        x.add_(1)
    if dv.type == "cuda":
        torch.cuda.synchronize(dv)
    t = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    if dv.type == "cuda":
        torch.cuda.synchronize(dv)
    return (time.perf_counter() - t) / n


def part_rates(rec: Record, torch: Any, dv: Any, dev: Device, sz: Sizes, budget: Budget, name: str) -> str | None:
    """Part 1; returns the device file it wrote (None where it measured nothing)."""
    plan_shapes: tuple[list[GemmShape], list[AttentionShape]] = ([], [])
    try:
        text = json.dumps({**sz.model, "layers": 1})
        plan_shapes = model_shapes(plan_preset(text, "dp=1", "dp", {}, {}, None, None, 1)[1],
                                   None if sz.dtype == "bf16" else sz.dtype)
    except Exception as exc:  # the model's shapes are extra points: the sweep goes on without them
        rec.note("rates", f"the model's own GEMM shapes not planned: {_one_line(exc)}")
    sweep = default_gemms("bf16", False) if sz.dtype == "bf16" else [GemmShape(64, 64, 64, "fp32")]
    gemms = sorted(set(sweep) | set(plan_shapes[0]))
    print(f"part 1 rates: {len(gemms)} GEMM shapes, attention at {len(sz.attention)} lengths", flush=True)
    nbytes = copy_bytes(dv.type == "cuda", sz.dtype != "bf16")  # the quick ones first: a second or less
    hbm = measure_copy(dv, nbytes, sz.timing)
    rec.row("rates", _row(f"HBM copy of {nbytes >> 20} MiB (read + write)", hbm, "GB/s", dev.hbm_rate / 1e9,
                          dev.hbm_rate / 1e9, bytes=nbytes))
    per = measure_launch(torch, dv, sz.launch_ops)
    rec.row("rates", _row(f"eager launch, host-bound loop of {sz.launch_ops} tiny ops", per * 1e6, "us/op",
                          dev.rates.launch_s * 1e6, dev.rates.launch_s * 1e6))
    gp = _gemm_rows(rec, torch, dv, dev, sz, budget, gemms)
    ap = _attention_rows(rec, torch, dv, dev, sz, budget, plan_shapes[1])
    if not gp and not ap:
        return None
    src = f"benchmarks/device_check.py, torch {torch.__version__}, {name[:60]}"
    m = Measured(src, tuple(g for g in gp if g.dtype in ("bf16", "fp8", "fp32")), tuple(ap), hbm)
    setup = Setup("", dv.type == "cuda", "nccl", 1, (), False, (), rec.data["preset"], name, (), (), False)
    obj = device_file(setup, m)
    device_from_json(obj)  # loads as plan --device reads it
    path = rec.out / "device_measured.json"
    write_atomic(str(path), (json.dumps(obj, indent=1) + "\n").encode())
    rec.note("rates", f"device file written: {path} ({len(m.gemm)} GEMM, {len(m.attention)} attention points)")
    return str(path)


# -- part 2: the open questions ------------------------------------------------------------------------


def sdpa_seconds(torch: Any, dv: Any, q_len: int, kv_len: int, heads: int, head_dim: int, causal: bool,
                 dtype: str, timing: Timing) -> tuple[float, float, str]:
    """(forward s, backward s, kernel) of ``scaled_dot_product_attention`` with ``q_len`` queries
    against ``kv_len`` keys (K and V at the query heads, as after ``repeat_kv``), flash on a GPU,
    each pass timed by calibrate's :func:`median_seconds`."""
    dt = getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[dtype])
    fn = torch.nn.functional.scaled_dot_product_attention
    q = torch.randn(1, heads, q_len, head_dim, device=dv, dtype=dt, requires_grad=True)
    k, v = (torch.randn(1, heads, kv_len, head_dim, device=dv, dtype=dt, requires_grad=True) for _ in range(2))

    def run() -> tuple[float, float]:
        def fwd() -> Any:
            with torch.no_grad():
                return fn(q, k, v, is_causal=causal)

        out = fn(q, k, v, is_causal=causal)
        g = torch.randn_like(out)
        f = median_seconds(fwd, dv, timing)
        b = median_seconds(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True), dv, timing)
        return f, b

    if dv.type != "cuda":
        return (*run(), "default")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return (*run(), "flash")


def _ring_rows(rec: Record, torch: Any, dv: Any, dev: Device, sz: Sizes, budget: Budget) -> None:
    long, short, heads = sz.ring
    d = sz.head_dim
    steps = {}
    for q_len, kv_len, causal in ((long, short, False), (short, long, False), (long, long, True)):
        if budget.left() <= 0:
            rec.note("open", f"time spent: ring block q {q_len} x kv {kv_len} skipped")
            return
        f, b, kernel = sdpa_seconds(torch, dv, q_len, kv_len, heads, d, causal, sz.dtype, sz.long_timing)
        fwd_flops = 4.0 * heads * q_len * kv_len * d / (2 if causal else 1)
        mf, mb, tf, tb = attention_rates(dev, fwd_flops, kv_len, d, causal, "flash")
        what = f"ring block {kernel} q {q_len} x kv {kv_len} h={heads} d={d}{' causal' if causal else ''}"
        info = {"q": q_len, "kv": kv_len, "heads": heads, "causal": causal, "kernel": kernel}
        rec.row("open", _row(what + " fwd", fwd_flops / f / 1e12, "TFLOP/s", mf, tf, ms=f * 1e3, **info))
        rec.row("open", _row(what + " bwd", 2.5 * fwd_flops / b / 1e12, "TFLOP/s", mb, tb, ms=b * 1e3, **info))
        # a ring step a layer under full AC (the t2 rows): the forward, its rerun, the backward
        model = 4.5 * fwd_flops / (2 * fwd_flops / (mf * 1e12) + 2.5 * fwd_flops / (mb * 1e12)) / 1e12
        steps[(q_len, kv_len)] = (2 * f + b, 4.5 * fwd_flops)
        rec.row("open", _row(what + " fwd + rerun + bwd", 4.5 * fwd_flops / (2 * f + b) / 1e12, "TFLOP/s", model,
                             step_ms=(2 * f + b) * 1e3, **info))
    if len(steps) >= 2:
        slow = max(t for (q, k), (t, _) in steps.items() if q != k)
        flops = next(fl for (q, k), (_t, fl) in steps.items() if q != k)
        rec.row("open", _row("ring step a layer, the slower non-causal block (kernels only)", slow * 1e3, "ms",
                             note="docs/context.md: measured 139.9 (cp 2), 231.0 (cp 4), 229.3 (cp 8) ms; "
                                  "the model 189.3 / 185.8 / 184.7 ms (with its merges and sends)",
                             table2_implied_tflops=TABLE2_IMPLIED, kernel_tflops=flops / slow / 1e12))


def _routing(torch: Any, dv: Any, tokens: int, experts: int, top_k: int, ep: int, balanced: bool,
             gen: Any) -> list[int]:
    """The rows each of a rank's ``experts / ep`` local experts receives from ``ep`` ranks of
    ``tokens`` tokens, each token to ``top_k`` distinct experts: exactly the mean (balanced) or
    drawn (random scores' top-k), each padded to :data:`ALIGN_M` as torchtitan does."""
    local = experts // ep
    if balanced:
        return [tokens * top_k * ep // experts] * local
    scores = torch.rand(tokens * ep, experts, generator=gen)
    picked = scores.topk(top_k, dim=1).indices.flatten()
    counts = torch.bincount(picked, minlength=experts)[:local].tolist()
    return [max(ALIGN_M, -(-c // ALIGN_M) * ALIGN_M) for c in counts]


def grouped_seconds(torch: Any, dv: Any, rows: list[int], k: int, n: int, dtype: Any,
                    timing: Timing) -> tuple[float, float, str]:
    """(forward s, backward s, how) of one grouped GEMM: the experts' ``rows`` x ``k`` by their own
    ``k x n`` weights; ``torch._grouped_mm`` (offsets of the rows, the weights transposed as
    torchtitan passes them), else a loop of ``torch.matmul`` per expert."""
    x = torch.randn(sum(rows), k, device=dv, dtype=dtype, requires_grad=True)
    w = torch.randn(len(rows), n, k, device=dv, dtype=dtype, requires_grad=True)
    offs = torch.tensor([sum(rows[:i + 1]) for i in range(len(rows))], device=dv, dtype=torch.int32)

    def grouped() -> Any:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

    def loop() -> Any:
        return torch.cat([xe @ we.t() for xe, we in zip(x.split(rows), w.unbind(0))])

    how, fn = "torch._grouped_mm", grouped
    try:
        if not hasattr(torch, "_grouped_mm"):
            raise AttributeError("torch has no _grouped_mm")
        fn()
    except (RuntimeError, AttributeError, TypeError) as exc:
        how, fn = f"loop of torch.matmul ({_one_line(exc)[:80]})", loop
    out = fn()
    g = torch.randn_like(out)

    def fwd() -> Any:
        with torch.no_grad():
            return fn()

    f = median_seconds(fwd, dv, timing)
    b = median_seconds(lambda: torch.autograd.grad(out, (x, w), g, retain_graph=True), dv, timing)
    return f, b, how


def _moe_rows(rec: Record, torch: Any, dv: Any, dev: Device, sz: Sizes, budget: Budget) -> None:
    h, ffn, experts, top_k = (sz.moe[k] for k in ("hidden", "ffn", "experts", "top_k"))
    dt = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    for ep in sz.eps:
        local = experts // ep
        mean = sz.tokens * top_k * ep / experts
        for balanced in (True, False):
            rows = _routing(torch, dv, sz.tokens, experts, top_k, ep, balanced, gen)
            spread = ExpertRows(None, 0.0 if balanced else top_k / experts).groups(mean, local)
            for name, k, n in (("w1 / w3 (up)", h, ffn), ("w2 (down)", ffn, h)):
                if budget.left() <= 0:
                    rec.note("open", f"time spent: grouped GEMM ep {ep} skipped")
                    return
                f, b, how = grouped_seconds(torch, dv, rows, k, n, dt, sz.timing)
                total = sum(rows)
                fl = 2.0 * total * n * k
                m = round(mean)
                tf = [d.gemm_rate("bf16", local, m, n, k, spread) for d in (microbench(dev), dev)]
                # the backward: dX (rows x n by n x k, the experts' rows spread) and dW (k x n over the rows)
                tb = [2 * fl / (fl / d.gemm_rate("bf16", local, m, k, n, spread) +
                                fl / d.gemm_rate("bf16", local, k, n, m)) for d in (microbench(dev), dev)]
                what = (f"grouped GEMM {name} ep {ep}: {local} experts x {'' if balanced else '~'}{m} rows "
                        f"({'balanced' if balanced else 'random top-k'})")
                info = {"ep": ep, "experts": local, "rows": rows, "k": k, "n": n, "how": how,
                        "routing": "balanced" if balanced else "topk", "model_rows": [list(g) for g in spread]}
                rec.row("open", _row(what + " fwd", fl / f / 1e12, "TFLOP/s", tf[0] / 1e12, tf[1] / 1e12,
                                     ms=f * 1e3, **info))
                rec.row("open", _row(what + " bwd", 2 * fl / b / 1e12, "TFLOP/s", tb[0] / 1e12, tb[1] / 1e12,
                                     ms=b * 1e3, **info))


def part_open(rec: Record, torch: Any, dv: Any, dev: Device, sz: Sizes, budget: Budget) -> None:
    print("part 2 open questions: torch's ring-step flash blocks; Qwen3-30B-A3B's grouped expert GEMMs", flush=True)
    for fn in (_ring_rows, _moe_rows):
        try:
            fn(rec, torch, dv, dev, sz, budget)
        except Exception as exc:
            _failed(rec, "open", fn.__name__, exc)


# -- part 3: a training step ---------------------------------------------------------------------------


def build_llama(torch: Any, cfg: dict[str, Any]) -> Any:
    """A Llama 3 decoder as torchtitan's ``models/llama/model.py`` (9dec370) writes it, eager:
    RMSNorm in fp32 (``x.float()``, ``pow(2).mean``, ``rsqrt``, ``type_as``, ``* weight``), the
    complex rotary (``view_as_complex`` x ``freqs_cis``), ``repeat_kv`` before SDPA (causal), SwiGLU
    ``w2(silu(w1 x) * w3 x)``, untied output."""
    nn, F = torch.nn, torch.nn.functional
    hd = cfg["hidden"] // cfg["heads"]

    class RMSNorm(nn.Module):
        def __init__(self, dim: int) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))

        def forward(self, x: Any) -> Any:
            y = x.float()
            return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * self.weight

    def rotary(x: Any, freqs: Any) -> Any:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs[None, :, None, :]).flatten(3).type_as(x)

    def repeat_kv(t: Any) -> Any:
        b, s, kv, d = t.shape
        rep = cfg["heads"] // cfg["kv_heads"]
        return t[:, :, :, None, :].expand(b, s, kv, rep, d).reshape(b, s, kv * rep, d)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            h, kv = cfg["heads"], cfg["kv_heads"]
            self.wq = nn.Linear(cfg["hidden"], h * hd, bias=False)
            self.wk = nn.Linear(cfg["hidden"], kv * hd, bias=False)
            self.wv = nn.Linear(cfg["hidden"], kv * hd, bias=False)
            self.wo = nn.Linear(h * hd, cfg["hidden"], bias=False)
            self.w1 = nn.Linear(cfg["hidden"], cfg["ffn"], bias=False)
            self.w3 = nn.Linear(cfg["hidden"], cfg["ffn"], bias=False)
            self.w2 = nn.Linear(cfg["ffn"], cfg["hidden"], bias=False)
            self.attention_norm, self.ffn_norm = RMSNorm(cfg["hidden"]), RMSNorm(cfg["hidden"])

        def forward(self, x: Any, freqs: Any) -> Any:
            b, s, _ = x.shape
            y = self.attention_norm(x)
            q = rotary(self.wq(y).view(b, s, -1, hd), freqs)
            k = rotary(self.wk(y).view(b, s, -1, hd), freqs)
            v = self.wv(y).view(b, s, -1, hd)
            k, v = repeat_kv(k), repeat_kv(v)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            x = x + self.wo(o.transpose(1, 2).reshape(b, s, -1))
            y = self.ffn_norm(x)
            return x + self.w2(F.silu(self.w1(y)) * self.w3(y))

    class Llama(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok_embeddings = nn.Embedding(cfg["vocab"], cfg["hidden"])
            self.layers = nn.ModuleList(Block() for _ in range(cfg["layers"]))
            self.norm = RMSNorm(cfg["hidden"])
            self.output = nn.Linear(cfg["hidden"], cfg["vocab"], bias=False)
            inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2).float() / hd))
            ang = torch.outer(torch.arange(cfg["seq"]).float(), inv)
            self.register_buffer("freqs_cis", torch.polar(torch.ones_like(ang), ang), persistent=False)

        def forward(self, tokens: Any) -> Any:
            x = self.tok_embeddings(tokens)
            for layer in self.layers:
                x = layer(x, self.freqs_cis)
            return self.output(self.norm(x))

    return Llama()


def train_step_run(torch: Any, dv: Any, cfg: dict[str, Any], compiled: bool, steps: tuple[int, int],
                   budget: Budget) -> dict[str, Any]:
    """Build, wrap (FSDP2 over one rank: fp32 parameters, bf16 compute, fp32 reduce, as torchtitan),
    and time the model's training steps; the median step (s) and the peak memory."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    gpu = dv.type == "cuda"
    mesh = init_device_mesh(dv.type, (1,))
    if gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dv)
    with torch.device(dv):
        model = build_llama(torch, cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.layers):
        if compiled:
            block = torch.compile(block, fullgraph=True)
            model.layers[i] = block
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
    gen = torch.Generator(device=dv).manual_seed(0)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), device=dv, generator=gen)
    labels = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), device=dv, generator=gen)
    times: list[float] = []
    first = None
    warm, timed = steps
    phases: list[tuple[float, float, float]] = []

    def sync() -> float:
        if gpu:
            torch.cuda.synchronize(dv)
        return time.perf_counter()

    for i in range(warm + timed):
        if times and budget.left() <= 0:
            break
        t0 = sync()
        pred = model(tokens)
        loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))
        del pred
        t1 = sync()
        loss.backward()
        t2 = sync()
        opt.step()
        opt.zero_grad()
        t3 = sync()
        if i >= warm:
            times.append(t3 - t0)
            phases.append((t1 - t0, t2 - t1, t3 - t2))
        elif i == 0:
            first = t3 - t0
    med = [statistics.median(p[j] for p in phases) for j in range(3)] if phases else [None] * 3
    out = {"step_s": statistics.median(times) if times else None, "steps_timed": len(times),
           "forward_s": med[0], "backward_s": med[1], "optimizer_s": med[2],
           "first_step_s": first, "loss": float(loss.item())}
    if gpu:
        out.update(max_allocated=torch.cuda.max_memory_allocated(dv), max_reserved=torch.cuda.max_memory_reserved(dv))
    del model, opt, loss
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    return out


def plan_command(cfg: dict[str, Any], device: str, compiled: bool) -> list[str]:
    """``spmdkit plan``'s arguments for the model on one GPU as torchtitan runs it."""
    return ["plan", "--model-config", json.dumps(cfg, separators=(",", ":")), "--mesh", "dp=1", "--strategy", "dp",
            "--device", device, "--framework", "torchtitan", "--recompute", "none",
            "--compile" if compiled else "--no-compile", "--json"]


def predicted(args: list[str]) -> dict[str, Any]:
    """``spmdkit plan``'s step time and memory, from its JSON: the command printed, then run through
    the CLI's own entry point in this process (the same parser and code as the shell command)."""
    print("  $ PYTHONPATH=src python3 -m spmdkit " + " ".join(shlex.quote(a) for a in args), flush=True)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(args)
    if rc != 0:
        raise ProgramError(f"spmdkit plan exited {rc}: {_one_line(err.getvalue())[:300]}")
    d = json.loads(out.getvalue())
    st, mem = d["step"], d["memory"]
    return {"step_s": float(st["step_overlap_s"]), "compute_s": st["compute_s"], "total": int(mem["total"]),
            "reserved": int(mem["reserved"]), "device_total": int(mem["device_total"])}


def part_step(rec: Record, torch: Any, dv: Any, sz: Sizes, budget: Budget, device_file_path: str | None) -> None:
    import torch.distributed as dist

    cfg = sz.model
    print(f"part 3 step: {json.dumps(cfg)}", flush=True)
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("nccl" if dv.type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for compiled in (False, True):
            mode = "compiled" if compiled else "eager"
            if compiled and not sz.compile:
                rec.note("step", "dry run: torch.compile not tried (the GPU run tries it after the eager step)")
                continue
            if budget.left() <= (sz.budgets["compile_min"] if compiled else 0):
                rec.note("step", f"time spent: the {mode} step skipped ({budget.left():.0f} s left of the part)")
                continue
            try:
                got = train_step_run(torch, dv, cfg, compiled, sz.steps, budget)
            except Exception as exc:
                _failed(rec, "step", f"{mode} step", exc)
                continue
            for dev_arg in [rec.data["preset"]] + ([device_file_path] if device_file_path else []):
                label = "preset" if dev_arg == rec.data["preset"] else "measured device file"
                try:
                    p = predicted(plan_command(cfg, dev_arg, compiled))
                except Exception as exc:
                    _failed(rec, "step", f"spmdkit plan ({label})", exc)
                    continue
                rec.row("step", _row(f"{mode} step, plan with {label}", got["step_s"], "s", p["step_s"],
                                     measured_run=got, plan=p, device=dev_arg))
                for phase in ("forward", "backward", "optimizer"):
                    rec.row("step", _row(f"  {mode} {phase} (synchronised apart), plan's compute", got[f"{phase}_s"],
                                         "s", float(p["compute_s"].get(phase, 0.0)) or None))
                if "max_allocated" in got:
                    rec.row("step", _row(f"{mode} peak allocated vs plan total ({label})", got["max_allocated"] / 2**30,
                                         "GiB", p["total"] / 2**30))
                    rec.row("step", _row(f"{mode} peak reserved vs plan reserved ({label})",
                                         got["max_reserved"] / 2**30, "GiB", p["reserved"] / 2**30))
    finally:
        if made:
            dist.destroy_process_group()


# -- the run ---------------------------------------------------------------------------------------------


def _one_line(exc: BaseException | str) -> str:
    text = str(exc) if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:400]


def _failed(rec: Record, part: str, what: str, exc: BaseException) -> None:
    rec.part(part).setdefault("errors", []).append({"what": what, "error": _one_line(exc),
                                                    "traceback": traceback.format_exc()[-2000:]})
    print(f"  ERROR in {part} / {what}: {_one_line(exc)}", flush=True)
    rec.save()


def gpu_facts(torch: Any, dv: Any) -> dict[str, Any]:
    """The GPU's SMs, memory and capability (torch) and its power limit and clocks (nvidia-smi, where
    it answers): a power limit under the rated one lowers the clock every rate is scaled by."""
    p = torch.cuda.get_device_properties(dv)
    facts: dict[str, Any] = {"sms": p.multi_processor_count, "memory_bytes": p.total_memory,
                             "capability": list(torch.cuda.get_device_capability(dv)),
                             "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}
    query = "name,power.limit,power.max_limit,clocks.max.sm,clocks.sm,clocks.max.mem,driver_version"
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=15)
        facts["nvidia_smi"] = dict(zip(query.split(","), (v.strip() for v in r.stdout.splitlines()[0].split(","))))
    except (OSError, IndexError, subprocess.SubprocessError) as exc:
        facts["nvidia_smi"] = f"not read: {_one_line(exc)}"
    return facts


def check_machine(dry_run: bool, preset: str | None) -> tuple[Any, Any, str, str]:
    """(torch, the torch device, the GPU's name, the preset): ProgramError naming what is missing."""
    try:
        import torch
    except ImportError as exc:
        raise ProgramError(f"torch is not importable here ({exc}); this check runs where torch and a CUDA GPU "
                           f"are (python3 on a lent GPU)") from None
    if dry_run:
        return torch, torch.device("cpu"), "CPU (dry run)", preset or "h100"
    if not torch.cuda.is_available():
        raise ProgramError("no CUDA GPU: torch.cuda.is_available() is False; this check measures a GPU (run it on a "
                           "lent GPU), or give --dry-run to run its plumbing on the CPU")
    name = str(torch.cuda.get_device_name(0))
    found = preset or preset_of_gpu(name, int(torch.cuda.get_device_properties(0).total_memory))
    if found is None:
        raise ProgramError(f"--preset: cannot tell which preset {name[:60]!r} is; give --preset ({', '.join(DEVICES)})")
    return torch, torch.device("cuda", 0), name, found


#: the parts, in the order they run
PARTS = ("rates", "open", "step")


def run(ns: argparse.Namespace) -> int:
    torch, dv, name, preset = check_machine(ns.dry_run, ns.preset)
    Path(ns.out).mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    if dv.type == "cuda":
        torch.cuda.set_device(dv)
    else:
        torch.set_num_threads(min(2, threads))
    try:
        return _run_parts(ns, torch, dv, name, preset)
    finally:
        torch.set_num_threads(threads)


def _run_parts(ns: argparse.Namespace, torch: Any, dv: Any, name: str, preset: str) -> int:
    sz = DRY if ns.dry_run else GPU
    out = Path(ns.out)
    dev = preset_device(preset)
    rec = Record(out, {"device": name, "preset": preset, "torch": torch.__version__, "dry_run": bool(ns.dry_run),
                       "budget_s": ns.budget_s, "parts": {}})
    print(f"device_check: {name}, preset {preset}, torch {torch.__version__}{' (DRY RUN: CPU, tiny sizes)' if ns.dry_run else ''}; "
          f"results in {out / 'device_check.json'}", flush=True)
    if dv.type == "cuda":
        rec.data["gpu"] = gpu_facts(torch, dv)
        print(f"  gpu: {json.dumps(rec.data['gpu'])}", flush=True)
    rec.save()
    start = time.monotonic()
    deadline = start + ns.budget_s
    wanted = ns.parts.split(",")
    devfile = None
    for part in PARTS:
        if part not in wanted:
            continue
        rec.part(part)
        budget = Budget.part(sz, part, wanted, start, deadline)
        t = time.monotonic()
        try:
            if part == "rates":
                devfile = part_rates(rec, torch, dv, dev, sz, budget, name)
            elif part == "open":
                part_open(rec, torch, dv, dev, sz, budget)
            else:
                part_step(rec, torch, dv, sz, budget, devfile)
            rec.part(part)["status"] = "done" if budget.left() > 0 else "done (time limit reached)"
        except Exception as exc:
            rec.part(part)["status"] = "error"
            _failed(rec, part, part, exc)
        rec.part(part)["seconds"] = round(time.monotonic() - t, 2)
        rec.save()
        if dv.type == "cuda":
            torch.cuda.empty_cache()
    print(f"device_check: done; {out / 'device_check.json'}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "device_check_out"),
                    help="folder for device_check.json and device_measured.json (default $OUT)")
    ap.add_argument("--dry-run", action="store_true", help="every part's plumbing on the CPU at tiny sizes")
    ap.add_argument("--preset", help=f"the preset to compare with ({', '.join(DEVICES)}); default told from the GPU")
    ap.add_argument("--parts", default="rates,open,step", help="comma list of rates, open, step (default all)")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="the parts' time together, in seconds (240; each part has its own limit within it)")
    ns = ap.parse_args(argv)
    bad = [p for p in ns.parts.split(",") if p not in PARTS]
    try:
        if bad:
            raise ProgramError(f"--parts {ns.parts!r}: unknown part {bad[0]!r} (parts: {', '.join(PARTS)})")
        if not (math.isfinite(ns.budget_s) and ns.budget_s > 0):
            raise ProgramError(f"--budget-s {ns.budget_s}: expected a positive number of seconds")
        return run(ns)
    except ProgramError as exc:
        print(f"device_check: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
