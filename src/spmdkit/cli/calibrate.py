"""``spmdkit calibrate --out FILE``: microbenchmarks on this machine through torch, written as a
device file (docs/devices.md, "Calibrate") that ``spmdkit plan --device FILE`` reads.

It measures the GEMMs of the shapes a model has on one device of a mesh (``--model``, planned as
``spmdkit plan`` plans it; a default sweep without one), attention forward and backward, the
bandwidth of a large copy, and all_reduce / all_gather / reduce_scatter for each mesh dim's group
size over the real backend (nccl on GPUs, gloo on CPU) in processes started by torch's launcher
(:mod:`spmdkit.execute.calibrate`). Each figure is printed as it is measured; the file is
written once, whole, at the end (never a partial file). Bad flags are one line and exit 2; a
measurement that fails, exit 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import socket
import sys
import tempfile
from dataclasses import dataclass, replace
from importlib import metadata
from typing import Any, TextIO

from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.cost.devices import DEVICES, device_from_json, preset_device, preset_of_gpu
from spmdkit.cost.measured import AttentionPoint, CollectivePoint, GemmPoint, Measured
from spmdkit.execute.calibrate import (
    CollectiveJob,
    Timing,
    attention_row,
    collective_sizes,
    copy_bytes,
    default_attention,
    default_gemms,
    fp8_capable,
    gemm_row,
    group_sizes,
    human_bytes,
    measure_attention,
    measure_collectives,
    measure_copy,
    measure_gemm,
    measure_gemm_fp8,
    model_shapes,
)
from spmdkit.io.atomic import output_problem, write_atomic
from spmdkit.models.zoo import PRESETS, is_config_text
from spmdkit.planner.planning import MAX_SIZE, plan_preset
from spmdkit.strategies.strategy import parse_mesh

CPU_NOTE = ("NOTE: --device cpu: these are CPU figures (fp32 GEMMs, gloo collectives between local processes), "
            "not GPU figures; they test the mechanism, they do not describe a GPU cluster")


def add_calibrate_command(sub: Any) -> None:
    p = sub.add_parser("calibrate", help="measure this machine (GEMMs, attention, memory bandwidth, collectives) "
                                         "through torch and write a device file for plan --device FILE")
    p.add_argument("--out", required=True, metavar="FILE", help="the device file to write (JSON), e.g. mycluster.json")
    p.add_argument("--base", metavar="PRESET",
                   help=f"the preset whose datasheet figures the file keeps where nothing was measured "
                        f"({', '.join(DEVICES)}); default: told from the GPU's name")
    p.add_argument("--model", metavar="NAME",
                   help=f"measure the GEMMs and attention of this preset's shapes on one device of --mesh "
                        f"({', '.join(sorted(PRESETS))}) or catalog model's (spmdkit models); default: a sweep of shapes")
    p.add_argument("--model-config", dest="model_config", metavar="FILE|JSON",
                   help="instead of --model: a decoder of your own (the fields of spmdkit plan --model-config)")
    p.add_argument("--strategy", help="with --model: the strategy it is planned under, as for spmdkit plan "
                                      "(default megatron with a tp mesh dim, else dp)")
    p.add_argument("--batch", help=f"with --model: override its batch size (1 to {MAX_SIZE})")
    p.add_argument("--seq", help=f"with --model: override its sequence length (1 to {MAX_SIZE})")
    p.add_argument("--mesh", help="named mesh dims, e.g. dp=2,tp=4: the model's local shapes and the collectives' "
                                  "group sizes (each dim's size); default: groups of 2, 4, ... up to the local GPUs")
    p.add_argument("--backend", choices=("nccl", "gloo"), help="the collectives' backend (default nccl on cuda, "
                                                               "gloo on cpu)")
    p.add_argument("--device", choices=("cuda", "cpu"),
                   help="measure the GPU (cuda, default where there is one) or the CPU (fp32, gloo: tests the "
                        "mechanism, not GPU figures)")
    p.add_argument("--quick", action="store_true", help="few, small measurements (a test of the mechanism)")
    p.set_defaults(fn=run_calibrate)


# -- the checked request ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """The flags, checked: ``gpu`` (cuda), the backend, the processes the collectives run on,
    the group sizes, ``p2p`` (a pp dim: send_recv between pairs too) and the notes about what
    cannot be measured, the base preset (None: a CPU's own figures), the shapes."""

    out: str
    gpu: bool
    backend: str
    nproc: int
    groups: tuple[int, ...]
    p2p: bool
    notes: tuple[str, ...]
    base: str | None
    device_name: str
    gemms: tuple[Any, ...]
    attention: tuple[Any, ...]
    quick: bool


def check_out(path: str) -> str:
    """``--out``: a file whose folder exists and can be written (a probe file is created and
    removed there); ProgramError naming the flag otherwise."""
    if not path.strip():
        raise ProgramError("--out: empty path")
    if os.path.isdir(path):
        raise ProgramError(f"--out {path[:100]!r}: is a folder; give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ProgramError(f"--out {path[:100]!r}: no such folder {folder[:100]!r}")
    problem = output_problem(path)  # a FIFO, a device, a symbolic link: never replaced
    if problem is not None:
        raise ProgramError(f"--out {path[:100]!r}: {problem}")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".spmdkit-calibrate-", suffix=".probe"):
            pass
    except OSError as exc:
        raise ProgramError(f"--out {path[:100]!r}: cannot write in {folder[:100]!r} ({exc.strerror or exc})") from None
    return path


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise ProgramError(f"spmdkit calibrate needs torch (pip install 'spmdkit[torch]'): {exc}") from None
    return torch


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return "CPU " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU " + (platform.processor() or platform.machine() or "unknown")


def _plan_mesh(mesh_text: str) -> tuple[str, list[int], int, bool]:
    """(the mesh the model is planned on: ``--mesh`` less its pp dim, whose stages hold the same
    layers; the sizes of the other dims, whose groups run collectives; the ranks; whether a pp
    dim of 2 or more is there, whose stages send and receive)."""
    mesh = parse_mesh(mesh_text)
    keep = [(n, s) for n, s in zip(mesh.dim_names, mesh.shape) if n != "pp"]
    pp = any(n == "pp" and s > 1 for n, s in zip(mesh.dim_names, mesh.shape))
    return (",".join(f"{n}={s}" for n, s in keep) or "dp=1", [s for _n, s in keep], math.prod(mesh.shape), pp)


def _model_shapes(model: str, ns: argparse.Namespace, mesh_text: str,
                  dtype: str | None) -> tuple[list[Any], list[Any]]:
    """The shapes of ``model`` (a preset's name or a ``--model-config`` text) planned as
    ``spmdkit plan`` plans it, one layer deep."""
    plan_mesh = _plan_mesh(mesh_text)[0]
    names = parse_mesh(plan_mesh).dim_names
    strategy = ns.strategy or ("megatron" if "tp" in names else "dp" if "dp" in names else "none")
    overrides = {"layers": 1, "batch": ns.batch, "seq": ns.seq}  # every layer has the same shapes
    _loaded, plan, _secs = plan_preset(model, plan_mesh, strategy, overrides, {}, None, None, 1)
    return model_shapes(plan, dtype)


def check_request(ns: argparse.Namespace) -> Setup:
    """The flags checked, before anything is measured (ProgramError naming the flag)."""
    out = check_out(ns.out)
    torch = _torch()
    has_gpu = bool(torch.cuda.is_available())
    gpu = (ns.device or ("cuda" if has_gpu else "cpu")) == "cuda"
    if gpu and not has_gpu:
        raise ProgramError("--device cuda: torch sees no CUDA GPU here (torch.cuda.is_available() is False); "
                           "give --device cpu to test the mechanism")
    backend = ns.backend or ("nccl" if gpu else "gloo")
    if backend == "nccl" and not gpu:
        raise ProgramError("--backend nccl: needs --device cuda (gloo runs on the CPU)")
    if ns.model and ns.model_config:
        raise ProgramError("--model-config: give a preset (--model) or a config (--model-config), not both")
    if ns.model_config and not is_config_text(ns.model_config):
        raise ProgramError(f"--model-config {ns.model_config[:60]!r}: expected a JSON object or a .json file")
    model = ns.model_config or ns.model
    if ns.model and is_config_text(ns.model):
        raise ProgramError(f"--model {ns.model[:60]!r}: a preset name; give a config as --model-config")
    if (ns.batch or ns.seq or ns.strategy) and not model:
        raise ProgramError("--batch / --seq / --strategy: apply to a --model; give --model too")
    _m, mesh_sizes, world, p2p = _plan_mesh(ns.mesh) if ns.mesh else ("", [], 0, False)
    if gpu:
        local = int(torch.cuda.device_count())
        nproc = min(local, world) if world else local
        index = int(os.environ.get("LOCAL_RANK", "0"))
        device_name = str(torch.cuda.get_device_name(index))
        memory = int(torch.cuda.get_device_properties(index).total_memory)
    else:
        nproc = world or 2
        device_name, memory = _cpu_name(), 0
    groups, notes = group_sizes(mesh_sizes or ([] if not ns.mesh else [1]), nproc)
    if nproc <= 1:
        groups, p2p, notes = [], False, [f"{nproc} process{'es' if nproc != 1 else ''} on this machine: no collective to "
                             f"measure (a group needs 2 ranks); the file keeps the base's links"]
    base = ns.base
    if base is not None:  # an alias as its preset
        try:
            dev = preset_device(base)
        except ProgramError:  # (preset_device's message names plan's --device and its .json files)
            raise ProgramError(f"--base {base[:60]!r}: no such preset ({', '.join(DEVICES)})") from None
        base = next(k for k, d in DEVICES.items() if d == dev)
    elif gpu:
        base = preset_of_gpu(device_name, memory)
        if base is None:
            raise ProgramError(f"--base: cannot tell which preset {device_name[:60]!r} is; give --base "
                               f"({', '.join(DEVICES)}) for the figures that are not measured")
    dtype = None if gpu else "fp32"
    if model:
        gemms, atts = _model_shapes(model, ns, ns.mesh or "dp=1", dtype)
    else:
        gemms, atts = default_gemms(dtype or "bf16", ns.quick), default_attention(dtype or "bf16", ns.quick)
    if gpu and ns.quick:  # quick on a GPU: the first and last shapes of each kind
        gemms, atts = sorted({gemms[0], gemms[-1]}), sorted({atts[0], atts[-1]}) if atts else []
    return Setup(out, gpu, backend, nproc, tuple(groups), p2p, tuple(notes), base, device_name, tuple(gemms),
                 tuple(atts), bool(ns.quick))


# -- measuring and writing -------------------------------------------------------------------------


def _source(s: Setup, torch: Any) -> str:
    try:
        ver = metadata.version("spmdkit")
    except metadata.PackageNotFoundError:
        ver = "(not installed)"
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (f"spmdkit calibrate {ver} on {socket.gethostname()[:40]}, {date}, torch {torch.__version__}, "
            f"{s.backend}, {s.device_name[:60]}")


def _sig(x: float) -> float:
    """``x`` to 6 significant digits (a file that reads well; still positive)."""
    return float(f"{x:.6g}")


def _fp8_gemms(s: Setup, dev: Any, timing: Timing, out: TextIO) -> list[GemmPoint]:
    """On a GPU with fp8 tensor cores: the bf16 / fp16 shapes again as fp8 GEMMs (those whose
    sides are multiples of 16, as the fp8 kernels need); a note where they cannot be run."""
    if not s.gpu or not fp8_capable(dev):
        return []
    shapes = [g for g in s.gemms if g.dtype in ("bf16", "fp16") and g.m % 16 == 0 and g.n % 16 == 0 and g.k % 16 == 0]
    got: list[GemmPoint] = []
    for g in sorted({replace(g, dtype="fp8") for g in shapes}):
        try:
            got.append(p := measure_gemm_fp8(g, dev, timing))
        except (RuntimeError, TypeError, AttributeError) as exc:  # no kernel for this GPU / shape, another API
            print(f"  fp8 GEMMs: not measured ({' '.join(str(exc).split())[:120]})", file=out)
            break
        print(gemm_row(p), file=out, flush=True)
    return got


def measure(s: Setup, out: TextIO) -> Measured:
    """Every measurement of ``s``, each row printed as it is made."""
    torch = _torch()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if s.gpu else torch.device("cpu")
    if s.gpu:
        torch.cuda.set_device(dev)
    timing = Timing.of(s.quick, s.gpu)
    source = _source(s, torch)
    print(f"spmdkit calibrate: {source}", file=out)
    if not s.gpu:
        print(CPU_NOTE, file=out)
    out.flush()
    gemm: list[GemmPoint] = []
    print(f"GEMMs ({len(s.gemms)} shapes, torch.matmul, median of {timing.samples}):", file=out)
    for g in s.gemms:
        gemm.append(p := measure_gemm(g, dev, timing))
        print(gemm_row(p), file=out, flush=True)
    gemm += _fp8_gemms(s, dev, timing, out)
    att: list[AttentionPoint] = []
    print(f"attention ({len(s.attention)} shapes, scaled_dot_product_attention):", file=out)
    for a in s.attention:
        point, kernel = measure_attention(a, dev, timing)
        att.append(point)
        print(attention_row(point, kernel), file=out, flush=True)
    nbytes = copy_bytes(s.gpu, s.quick)
    hbm = measure_copy(dev, nbytes, timing)
    print(f"memory bandwidth: copy of {human_bytes(nbytes)}: {hbm:.1f} GB/s (read + write)", file=out, flush=True)
    coll: list[CollectivePoint] = []
    for note in s.notes:
        print(f"collectives: {note}", file=out)
    if s.groups or s.p2p:
        what = [f"group sizes {', '.join(map(str, s.groups))}"] if s.groups else []
        what += ["send_recv between pairs (the pp dim)"] if s.p2p else []
        print(f"collectives over {s.backend}, {s.nproc} local processes (torch's launcher), {'; '.join(what)}; "
              f"all intra_node: inter_node needs several machines, not measured:", file=out, flush=True)
        job = CollectiveJob(s.backend, "cuda" if s.gpu else "cpu", s.groups,
                            tuple(collective_sizes(s.gpu, s.quick)), s.quick, s.p2p)
        coll = measure_collectives(job, s.nproc)
    return Measured(source, tuple(GemmPoint(p.m, p.n, p.k, p.dtype, _sig(p.tflops)) for p in gemm),
                    tuple(AttentionPoint(p.batch, p.heads, p.seq, p.head_dim, p.causal, p.dtype, _sig(p.fwd_tflops),
                                         _sig(p.bwd_tflops)) for p in att),
                    _sig(hbm), tuple(CollectivePoint(c.op, c.ranks, c.scope, c.bytes, _sig(c.time_us)) for c in coll))


def device_file(s: Setup, m: Measured) -> dict[str, Any]:
    """The device file's object: the base preset and what was measured; a CPU without ``--base``
    stands alone (its fp32 peak the best GEMM rate measured, its bandwidth the copy's, its
    memory the machine's RAM)."""
    name = f"{s.device_name[:70]} (calibrated)"
    obj: dict[str, Any] = {"name": name}
    if s.base is not None:
        obj["base"] = s.base
    else:
        best = max((p.tflops for p in m.gemm), default=1e-3)
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 1 << 30
        obj.update({"peak_tflops": {"fp32": best}, "hbm_gb_per_s": m.hbm_gb_per_s or 1.0,
                    "memory_gb": _sig(ram / 1e9)})
    obj["measured"] = m.to_json()
    return obj


def run_calibrate(ns: argparse.Namespace, out: TextIO) -> int:
    """Check, measure, write; 2 for a bad flag, 1 for a measurement or a write that failed."""
    try:
        s = check_request(ns)
    except SpmdError as exc:
        print(f"spmdkit calibrate: {type(exc).__name__}: {' '.join(str(exc).split())[:500]}", file=sys.stderr)
        return 2
    try:
        m = measure(s, out)
        obj = device_file(s, m)
        device_from_json(obj)  # the file loads as plan --device reads it
        write_atomic(s.out, (json.dumps(obj, indent=1) + "\n").encode())
    except SpmdError as exc:
        print(f"spmdkit calibrate: {type(exc).__name__}: {' '.join(str(exc).split())[:500]}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"spmdkit calibrate: --out {s.out[:100]!r}: cannot write it ({exc.strerror or exc})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("spmdkit calibrate: interrupted; nothing written", file=sys.stderr)
        return 130
    print(f"spmdkit calibrate: wrote {s.out}: {len(m.gemm)} GEMM, {len(m.attention)} attention, "
          f"{len(m.collectives)} collective points (use it: spmdkit plan --device {s.out})", file=out)
    return 0


__all__ = ["CPU_NOTE", "Setup", "add_calibrate_command", "check_out", "check_request", "device_file", "measure",
           "run_calibrate"]
