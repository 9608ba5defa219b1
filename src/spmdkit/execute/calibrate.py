"""The measurements of ``spmdkit calibrate`` (:mod:`spmdkit.cli.calibrate`), through torch on
the machine it runs on: GEMM rates at the shapes a plan's matmuls have on one device (or a
default sweep), attention (``scaled_dot_product_attention``, forward and backward timed apart,
flash on CUDA), the bandwidth of a large copy, and collective times over the real backend
(nccl on GPUs, gloo on CPU) in processes started by torch's own launcher
(``torch.distributed.launcher.api.elastic_launch``: torchrun's semantics, one process per rank,
RANK / LOCAL_RANK / WORLD_SIZE in each).

The shapes (:func:`model_shapes`, :func:`default_gemms`, ...) are pure Python; torch is
imported by the functions that measure. Every figure is the median of repeats after a
warm-up, timed with CUDA events on a GPU and ``time.perf_counter`` on a CPU.

FLOP conventions (docs/devices.md, "Calibrate"): a GEMM ``M x K`` by ``K x N`` is ``2MNK``;
attention forward ``4 * batch * heads * seq^2 * head_dim``, halved when causal, the backward
2.5 times the forward (FlashAttention's benchmark, ``benchmarks/benchmark_flash_attention.py``).
Collective sizes are those of :mod:`spmdkit.cost.measured` (the buffer each rank holds: the
whole tensor for all_reduce, the gathered output for all_gather, the input for reduce_scatter).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import statistics
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr, largest_shard
from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.cost.measured import AttentionPoint, CollectivePoint, GemmPoint
from spmdkit.program.ir import flat_refs
from spmdkit.program.plan import Plan


class CalibrationError(SpmdError):
    """A measurement that could not be made (a rank of the collectives failed, ...)."""


#: a program tensor's dtype -> the measured file's dtype name
DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
#: the measured file's dtype name -> torch's
TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp64": "float64"}
#: the collectives measured, in this order
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True, order=True)
class GemmShape:
    """``M x K`` times ``K x N`` in ``dtype`` (a :data:`DTYPE_NAMES` value)."""

    m: int
    n: int
    k: int
    dtype: str

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


@dataclass(frozen=True, order=True)
class AttentionShape:
    """Attention of ``heads`` heads of ``head_dim`` over ``seq`` positions, ``batch`` sequences."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    causal: bool
    dtype: str

    @property
    def fwd_flops(self) -> float:
        """FlashAttention's count: two ``seq x seq x head_dim`` matmuls per head (4 b h s^2 d),
        half of them under a causal mask."""
        f = 4.0 * self.batch * self.heads * self.seq * self.seq * self.head_dim
        return f / 2 if self.causal else f

    @property
    def bwd_flops(self) -> float:
        """Five matmuls to the forward's two: 2.5 times the forward (FlashAttention's count)."""
        return 2.5 * self.fwd_flops


# -- which shapes ----------------------------------------------------------------------------------


def _local(plan: Plan, name: str, attr: Any) -> tuple[int, ...]:
    t = plan.program.tensors[name]
    a = attr if isinstance(attr, TensorDistAttr) else plan.attrs.get(name)
    if a is None:
        return tuple(t.shape)
    return tuple(largest_shard(a.dims_mapping, tuple(t.shape), a.mesh.shape))


def _operand(plan: Plan, i: int, param: str) -> tuple[tuple[int, ...], str] | None:
    """(local shape, dtype name) of op ``i``'s operand ``param`` as the plan requires it."""
    opp = plan.ops[i]
    names = [n for n in flat_refs(opp.op.inputs.get(param)) if n is not None]
    if len(names) != 1:
        return None
    dtype = DTYPE_NAMES.get(plan.program.tensors[names[0]].dtype)
    return (_local(plan, names[0], opp.required.get(param)), dtype) if dtype else None


def model_shapes(plan: Plan, dtype: str | None = None) -> tuple[list[GemmShape], list[AttentionShape]]:
    """The distinct GEMMs and attentions of ``plan`` on one device: every ``matmul`` of an
    activation by a 2-D weight as ``(M, N, K)`` (M the activation's rows, all its leading axes)
    with its two backward GEMMs, the input gradient ``(M, K, N)`` and the weight gradient
    ``(K, N, M)``; every ``flash_attention`` as (batch, heads, seq, head_dim, causal).
    ``dtype``: measure in this dtype instead of the tensors' own (a CPU measures fp32)."""
    gemms: set[GemmShape] = set()
    atts: set[AttentionShape] = set()
    for i, opp in enumerate(plan.ops):
        rule = opp.op.rule
        if rule == "matmul":
            x, y = _operand(plan, i, "x"), _operand(plan, i, "y")
            if x is None or y is None or len(y[0]) != 2 or len(x[0]) < 1:
                continue  # an activation by an activation (eager attention's scores) is not a GEMM here
            tx = bool(opp.op.attrs.get("trans_x", False))
            ty = bool(opp.op.attrs.get("trans_y", False))
            if tx:
                continue
            k = x[0][-1]
            m = math.prod(x[0][:-1])
            n = y[0][0] if ty else y[0][1]
            dt = dtype or x[1]
            if min(m, n, k) >= 1:
                gemms.update((GemmShape(m, n, k, dt), GemmShape(m, k, n, dt), GemmShape(k, n, m, dt)))
        elif rule == "flash_attention":
            q = _operand(plan, i, "q")
            if q is None or len(q[0]) != 4:
                continue
            b, s, h, d = q[0]
            atts.add(AttentionShape(b, h, s, d, bool(opp.op.attrs.get("causal", False)), dtype or q[1]))
    return sorted(gemms), sorted(atts)


def default_gemms(dtype: str, quick: bool) -> list[GemmShape]:
    """Without a model: square GEMMs from 256 (1024 on a GPU sweep) up, and the skinny ones of a
    tensor-parallel layer (``M`` tokens by a hidden of 4096 split 8 ways)."""
    if quick:
        return [GemmShape(s, s, s, dtype) for s in (128, 256)]
    if dtype == "fp32":  # a CPU: its rate is reached at small sizes, large ones take seconds
        return [GemmShape(s, s, s, dtype) for s in (256, 512, 1024)]
    square = [GemmShape(s, s, s, dtype) for s in (1024, 2048, 4096, 8192)]
    skinny = [GemmShape(8192, 512, 4096, dtype), GemmShape(8192, 4096, 512, dtype), GemmShape(512, 4096, 8192, dtype)]
    return square + skinny


def default_attention(dtype: str, quick: bool) -> list[AttentionShape]:
    """Without a model: causal attention of 128-wide heads at 1k to 8k positions (tiny when quick)."""
    if quick:
        return [AttentionShape(1, 2, 64, 32, True, dtype)]
    if dtype == "fp32":
        return [AttentionShape(1, 4, s, 64, True, dtype) for s in (256, 512)]
    return [AttentionShape(1, 32, s, 128, True, dtype) for s in (1024, 2048, 4096, 8192)]


def collective_sizes(gpu: bool, quick: bool) -> list[int]:
    """Message sizes (bytes): 4 KiB to 256 MiB by factors of 4 on a GPU, to 16 MiB on a CPU;
    two sizes when quick."""
    if quick:
        return [1 << 12, 1 << 16]
    top = 28 if gpu else 24
    return [1 << e for e in range(12, top + 1, 2)]


def group_sizes(mesh_sizes: Sequence[int], world: int) -> tuple[list[int], list[str]]:
    """(the group sizes measured, notes on those that are not): each mesh dim's size > 1 that
    ``world`` processes can form; without a mesh (empty), 2, 4, 8, ... up to ``world``."""
    if not mesh_sizes:
        want = sorted({min(1 << e, world) for e in range(1, max(1, world).bit_length() + 1)} - {1})
    else:
        want = sorted(set(s for s in mesh_sizes if s > 1))
    notes = [f"group size {g}: needs {g} processes, this machine runs {world}; not measured"
             for g in want if g > world]
    return [g for g in want if g <= world], notes


# -- timing ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """How hard to measure: warm-up calls, timed samples (the median is kept) and the time a
    sample aims at (short calls are repeated within a sample)."""

    warmup: int = 3
    samples: int = 10
    sample_s: float = 0.02

    @staticmethod
    def of(quick: bool, gpu: bool) -> Timing:
        if quick:
            return Timing(1, 3, 0.002)
        return Timing(5, 20, 0.01) if gpu else Timing(2, 7, 0.05)


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ProgramError(f"spmdkit calibrate needs torch (pip install 'spmdkit[torch]'): {exc}") from None
    return torch


def median_seconds(fn: Callable[[], Any], device: Any, timing: Timing) -> float:
    """The median time of one call of ``fn`` on ``device`` (a torch.device): CUDA events around
    each sample on a GPU (the stream synchronised before reading them), ``perf_counter`` on a
    CPU; a sample repeats ``fn`` so that it lasts about ``timing.sample_s``."""
    torch = _torch()
    gpu = device.type == "cuda"
    for _ in range(timing.warmup):
        fn()
    if gpu:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if gpu:
        torch.cuda.synchronize(device)
    reps = max(1, min(1000, int(timing.sample_s / max(time.perf_counter() - t0, 1e-7))))
    out = []
    for _ in range(timing.samples):
        if gpu:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            torch.cuda.synchronize(device)
            out.append(a.elapsed_time(b) / 1e3 / reps)
        else:
            t = time.perf_counter()
            for _ in range(reps):
                fn()
            out.append((time.perf_counter() - t) / reps)
    return float(statistics.median(out))


def _dtype(torch: Any, name: str) -> Any:
    return getattr(torch, TORCH_DTYPES[name])


def measure_gemm(s: GemmShape, device: Any, timing: Timing) -> GemmPoint:
    """The rate of ``torch.matmul`` at shape ``s`` (TFLOP/s, ``2MNK`` per call)."""
    torch = _torch()
    dt = _dtype(torch, s.dtype)
    a = torch.randn(s.m, s.k, device=device, dtype=dt)
    b = torch.randn(s.k, s.n, device=device, dtype=dt)
    c = torch.empty(s.m, s.n, device=device, dtype=dt)
    sec = median_seconds(lambda: torch.matmul(a, b, out=c), device, timing)
    return GemmPoint(s.m, s.n, s.k, s.dtype, s.flops / sec / 1e12)


def fp8_capable(device: Any) -> bool:
    """Whether ``device`` has fp8 tensor cores (CUDA compute capability 8.9: Ada, 9.0: Hopper,
    and later) and torch offers ``torch._scaled_mm``, the fp8 GEMM Transformer Engine's
    and torchao's linear layers run."""
    torch = _torch()
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return False
    return tuple(torch.cuda.get_device_capability(device)) >= (8, 9)


def measure_gemm_fp8(s: GemmShape, device: Any, timing: Timing) -> GemmPoint:
    """The rate of an fp8 GEMM at shape ``s`` (``torch._scaled_mm``: e4m3 operands, per-tensor
    scales, a bf16 product, the first operand row-major and the second column-major as cuBLASLt
    requires; M, N, K multiples of 16). Recorded as dtype ``fp8``."""
    torch = _torch()
    f8 = torch.float8_e4m3fn
    a = torch.randn(s.m, s.k, device=device).to(f8)
    b = torch.randn(s.n, s.k, device=device).to(f8).t()
    one = torch.ones((), device=device, dtype=torch.float32)
    sec = median_seconds(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                         device, timing)
    return GemmPoint(s.m, s.n, s.k, "fp8", s.flops / sec / 1e12)


#: a kernel of :func:`measure_attention` -> torch's ``SDPBackend`` member that runs it
SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION"}


def measure_attention(s: AttentionShape, device: Any, timing: Timing,
                      kernel_name: str = "flash") -> tuple[AttentionPoint, str]:
    """(the rates of ``scaled_dot_product_attention`` forward and backward at ``s``, the kernel
    used): on a GPU the :data:`SDPA_BACKENDS` kernel ``kernel_name`` (flash, the default, or
    cudnn) where torch has it and it applies, torch's choice ("default") otherwise."""
    torch = _torch()
    fn = torch.nn.functional.scaled_dot_product_attention
    dt = _dtype(torch, s.dtype)
    q, k, v = (torch.randn(s.batch, s.heads, s.seq, s.head_dim, device=device, dtype=dt, requires_grad=True)
               for _ in range(3))
    g = torch.randn(s.batch, s.heads, s.seq, s.head_dim, device=device, dtype=dt)

    def run() -> tuple[float, float]:
        def fwd() -> Any:
            with torch.no_grad():
                return fn(q, k, v, is_causal=s.causal)

        out = fn(q, k, v, is_causal=s.causal)
        f = median_seconds(fwd, device, timing)
        b = median_seconds(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True), device, timing)
        return f, b

    kernel = "default"
    if device.type == "cuda":
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[kernel_name])]):
                f, b = run()
            kernel = kernel_name
        except (ImportError, RuntimeError, AttributeError):
            f, b = run()
    else:
        f, b = run()
    return AttentionPoint(s.batch, s.heads, s.seq, s.head_dim, s.causal, s.dtype,
                          s.fwd_flops / f / 1e12, s.bwd_flops / b / 1e12), kernel


def copy_bytes(gpu: bool, quick: bool) -> int:
    """The buffer copied to measure the memory bandwidth: 1 GiB on a GPU (64 MiB on a CPU), well
    past every cache (an H100's L2 is 50 MB); a quarter of that when quick."""
    size = (1 << 30) if gpu else (64 << 20)
    return size // 4 if quick else size


def measure_copy(device: Any, nbytes: int, timing: Timing) -> float:
    """GB/s of ``dst.copy_(src)`` of ``nbytes``: each call reads and writes ``nbytes``, so
    ``2 * nbytes`` are moved (the convention of STREAM's Copy and of NVIDIA's bandwidthTest)."""
    torch = _torch()
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    sec = median_seconds(lambda: dst.copy_(src), device, timing)
    return 2.0 * nbytes / sec / 1e9


def bus_factor(op: str, ranks: int) -> float:
    """nccl-tests' bus bandwidth over algorithm bandwidth (doc/PERFORMANCE.md): ``2(n-1)/n``
    for all_reduce, ``(n-1)/n`` for all_gather and reduce_scatter, 1 for a send/recv."""
    if op == "send_recv":
        return 1.0
    return (2.0 if op == "all_reduce" else 1.0) * (ranks - 1) / ranks


# -- collectives, one process per rank --------------------------------------------------------------


@dataclass(frozen=True)
class CollectiveJob:
    """What each rank measures: ``groups`` (sizes), ``sizes`` (bytes), over ``backend``, on
    ``device`` (``cuda`` or ``cpu``); ``p2p``: send_recv between pairs of ranks too (a pipeline's
    stages)."""

    backend: str
    device: str
    groups: tuple[int, ...]
    sizes: tuple[int, ...]
    quick: bool
    p2p: bool = False
    timeout_s: float = 300.0


def _iterations(nbytes: int, quick: bool) -> int:
    """Calls per sample, the same on every rank (a collective needs them all): many for small
    messages, one from 64 MiB up."""
    return 1 if quick else max(1, min(50, (64 << 20) // max(1, nbytes)))


def _one_op(dist: Any, torch: Any, op: str, group: Any, g: int, nbytes: int, dev: Any, dt: Any,
            rank: int, first: int) -> Callable[[], Any]:
    el = torch.tensor([], dtype=dt).element_size()
    numel = max(g, nbytes // el // g * g)
    if op == "send_recv":  # the pair's first rank sends, the other receives: one message
        buf = torch.ones(numel, device=dev, dtype=dt)
        if rank == first:
            return lambda: dist.send(buf, first + 1)
        return lambda: dist.recv(buf, first)
    if op == "all_reduce":
        buf = torch.ones(numel, device=dev, dtype=dt)
        return lambda: dist.all_reduce(buf, group=group)
    if op == "all_gather":
        out = torch.empty(numel, device=dev, dtype=dt)
        inp = torch.ones(numel // g, device=dev, dtype=dt)
        return lambda: dist.all_gather_into_tensor(out, inp, group=group)
    inp = torch.ones(numel, device=dev, dtype=dt)
    out = torch.empty(numel // g, device=dev, dtype=dt)
    return lambda: dist.reduce_scatter_tensor(out, inp, group=group)


def _my_group(dist: Any, world: int, rank: int, g: int) -> tuple[Any, int]:
    """(this rank's group of ``g`` consecutive ranks or None, its first rank); every rank
    creates every group, as torch requires."""
    mine, first = None, -1
    for start in range(0, world - g + 1, g):
        grp = dist.new_group(list(range(start, start + g)))
        if start <= rank < start + g:
            mine, first = grp, start
    return mine, first


def _time_collective(dist: Any, torch: Any, fn: Callable[[], Any], group: Any, dev: Any, iters: int,
                     timing: Timing) -> float:
    gpu = dev.type == "cuda"
    for _ in range(timing.warmup):
        fn()
    out = []
    for _ in range(timing.samples):
        dist.barrier(group=group, **({"device_ids": [dev.index]} if gpu else {}))
        if gpu:
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        if gpu:
            torch.cuda.synchronize(dev)
        out.append((time.perf_counter() - t) / iters)
    return float(statistics.median(out))


def collective_worker(job: CollectiveJob) -> list[tuple[str, int, int, float]]:
    """One rank's part (started by :func:`measure_collectives` through torch's launcher): every
    group size, op and message size, the groups of each size consecutive blocks of ranks all
    running at once; each point the slowest rank's median time. Rank 0 prints each row as it
    is measured and returns (op, ranks, bytes, seconds) for each; the others return []."""
    torch = _torch()
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpu = job.device == "cuda"
    if gpu:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group(job.backend, timeout=timedelta(seconds=job.timeout_s))
    dt = torch.bfloat16 if gpu else torch.float32
    timing = Timing.of(job.quick, gpu)
    rows: list[tuple[str, int, int, float]] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 renames the *_tensor collectives
            tasks = [(g, op) for g in job.groups for op in COLLECTIVES]
            tasks += [(2, "send_recv")] if job.p2p and world >= 2 else []
            made: dict[int, tuple[Any, int]] = {}
            for g, op in tasks:
                if g not in made:
                    made[g] = _my_group(dist, world, rank, g)
                mine, first = made[g]
                for nbytes in job.sizes:
                    sec = 0.0
                    if mine is not None:
                        fn = _one_op(dist, torch, op, mine, g, nbytes, dev, dt, rank, first)
                        sec = _time_collective(dist, torch, fn, mine, dev, _iterations(nbytes, job.quick), timing)
                    worst = torch.tensor([sec], dtype=torch.float64, device=dev)
                    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                    if rank == 0:
                        row = (op, g, nbytes, float(worst.item()))
                        rows.append(row)
                        print(collective_row(*row), flush=True)
    finally:
        dist.destroy_process_group()
    return rows


#: what torch's launcher sets in the environment of the process that calls it
_SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"


def _failure(exc: Exception) -> str:
    """One line on why the launch failed: the first failed rank and its error (torch's
    ChildFailedError), else the exception's first line."""
    first = getattr(exc, "get_first_failure", None)
    if first is not None:
        try:
            rank, failure = first()
            msg = failure.message
            msg = msg.get("message", "") if isinstance(msg, dict) else str(msg)
            lines = [ln.strip() for ln in str(msg).splitlines() if ln.strip()]
            if lines:
                return f"rank {rank}: {lines[-1]}"
            return f"rank {rank} exited with code {failure.exitcode}"
        except (AttributeError, IndexError, KeyError, ValueError):
            pass
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and set(ln.strip()) != {"="}]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"


def measure_collectives(job: CollectiveJob, nproc: int) -> list[CollectivePoint]:
    """Start ``nproc`` local processes with torch's launcher (torchrun's ``--standalone``
    rendezvous: c10d on a free local port) running :func:`collective_worker`; their points,
    all ``intra_node`` (every process is on this machine)."""
    _torch()
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                       rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.1,
                       start_method="spawn")
    quiet = {n: logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing")}
    levels = {n: lg.level for n, lg in quiet.items()}
    # the launcher installs its own handlers of these signals in this process and leaves them
    # (and an environment variable) behind: put back what was there
    sigs = [getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, n)]
    handlers = {sig: signal.getsignal(sig) for sig in sigs}
    env = os.environ.get(_SIGNALS_ENV)
    for lg in quiet.values():  # a failure is said once, below, not as torch's traceback log
        lg.setLevel(logging.CRITICAL)
    try:
        got = elastic_launch(cfg, collective_worker)(job)
    except Exception as exc:  # torch's ChildFailedError, a rendezvous that failed, ...
        raise CalibrationError(f"the collectives over {job.backend} on {nproc} processes failed: "
                               f"{_failure(exc)[:300]}") from None
    finally:
        for n, lg in quiet.items():
            lg.setLevel(levels[n])
        if threading.current_thread() is threading.main_thread():
            for sig, h in handlers.items():
                if h is not None:
                    signal.signal(sig, h)
        if env is None:
            os.environ.pop(_SIGNALS_ENV, None)
        else:
            os.environ[_SIGNALS_ENV] = env
    return [CollectivePoint(op, g, "intra_node", nbytes, sec * 1e6) for op, g, nbytes, sec in got[0]]


# -- rows ------------------------------------------------------------------------------------------


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} B"


def gemm_row(p: GemmPoint) -> str:
    sec = 2.0 * p.m * p.n * p.k / (p.tflops * 1e12)
    return f"  gemm       M={p.m:<6} N={p.n:<6} K={p.k:<6} {p.dtype:<5} {p.tflops:9.4g} TFLOP/s  {sec * 1e3:9.3f} ms"


def attention_row(p: AttentionPoint, kernel: str) -> str:
    return (f"  attention  b={p.batch} h={p.heads} s={p.seq} d={p.head_dim} {'causal ' if p.causal else ''}"
            f"{p.dtype} ({kernel})  fwd {p.fwd_tflops:.4g}  bwd {p.bwd_tflops:.4g} TFLOP/s")


def collective_row(op: str, ranks: int, nbytes: int, sec: float) -> str:
    alg = nbytes / sec / 1e9 if sec > 0 else 0.0
    return (f"  {op:<15} ranks={ranks:<3} {human_bytes(nbytes):>8}  {sec * 1e6:10.1f} us  "
            f"bus {alg * bus_factor(op, ranks):8.4g} GB/s")


__all__ = ["COLLECTIVES", "SDPA_BACKENDS", "CalibrationError", "DTYPE_NAMES", "AttentionShape", "CollectiveJob", "GemmShape", "Timing", "attention_row",
           "bus_factor", "collective_row", "collective_sizes", "collective_worker", "copy_bytes", "default_attention",
           "default_gemms", "fp8_capable", "gemm_row", "group_sizes", "human_bytes", "measure_attention", "measure_collectives",
           "measure_copy", "measure_gemm", "measure_gemm_fp8", "median_seconds", "model_shapes"]
