"""``spmdkit run``: execute a planned training step on torch.distributed (needs ``spmdkit[torch]``)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, NoReturn, TextIO

from spmdkit.cli.checks import parse_annotations, parse_tp_plan
from spmdkit.cli.common import plan_source, strategy_notes
from spmdkit.cli.request import HF_BATCH, HF_SEQ, RunRequest
from spmdkit.cli.run_torch import run_torch_command
from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.cost.devices import load_device
from spmdkit.execute.kernel_names import check_kernels
from spmdkit.execute.launch import (
    EXIT_PORT_IN_USE,
    EXIT_RANK_FAILED,
    PHASE_MARK,
    PROGRESS_ENV,
    launch_local,
    port_in_use,
    uneven_shards,
)
from spmdkit.models.hf import dtype_name
from spmdkit.models.source import HFModel, Preset, ProgramFile, variants
from spmdkit.models.zoo import model_label
from spmdkit.outputs.progress import Progress
from spmdkit.planner.planning import MAX_SIZE, parse_size
from spmdkit.program.plan import Plan
from spmdkit.strategies.strategy import parse_mesh


def _strip_nproc(argv: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        out.append(a)
    return out


class RunUsageError(ProgramError):
    """Bad arguments or environment for ``spmdkit run`` (exit 2, one line, before any rank starts)."""


def die_with_launcher() -> None:
    """In a rank ``launch_local`` started: end this process when the launcher dies (Linux:
    PR_SET_PDEATHSIG; elsewhere a thread that watches the parent pid)."""
    want = os.environ.get("SPMDKIT_LAUNCHER_PID", "")
    if not want.isdigit() or "RANK" not in os.environ:
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        ok = False
    if os.getppid() != int(want):  # it died before we asked
        os._exit(3)  # EXIT_RANK_FAILED
    if ok:
        return
    def watch() -> None:
        while os.getppid() == int(want):
            time.sleep(0.5)
        os._exit(3)  # EXIT_RANK_FAILED

    threading.Thread(target=watch, daemon=True).start()


def run_command(req: RunRequest, out: TextIO) -> int:
    """``spmdkit run``: exit 0 (every tensor and collective as planned), 1 (the check failed, or a
    rank failed: one line names it), 2 (bad arguments or environment, before any rank starts)."""
    if req.engine == "torch":  # the export on torch's own engine, under torchrun (cli/run_torch.py)
        return run_torch_command(req, out)
    die_with_launcher()  # first: importing torch takes seconds
    try:
        req.model.check_config()
        for flag, v in (("--steps", req.steps), ("--optimizer", req.optimizer), ("--lr", req.lr),
                        ("--torch-plan", req.torch_plan)):
            if v is not None:
                raise RunUsageError(f"{flag} applies to --engine torch (this run is --engine spmdkit: one step, "
                                    "op by op)")
        return _run_command(req, out)
    except RunUsageError as exc:
        print(f"spmdkit run: {exc}", file=sys.stderr)
        return 2
    except SpmdError as exc:  # as --engine torch (cli/run_torch.py) and spmdkit plan print it
        print(f"spmdkit run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


def _check_backend(backend: str) -> None:
    import torch
    import torch.distributed as dist

    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise RunUsageError("--backend nccl needs CUDA GPUs and a torch built with NCCL; this machine has "
                            + ("no usable GPU" if not torch.cuda.is_available() else "no NCCL")
                            + " (use --backend gloo)")
    if backend == "gloo" and not dist.is_gloo_available():
        raise RunUsageError("--backend gloo: this torch build has no gloo")


@dataclass
class _Step:
    """What a run executes: the plan, its title, and for a ``--hf`` model the module and its
    call (the step then runs on the module's weights and is compared with torch eager), or,
    as the launcher hands it to its ranks, the values and torch eager's reference themselves."""

    plan: Plan
    title: str
    model: Any = None
    kwargs: dict[str, Any] | None = None
    values: dict[str, Any] | None = None
    #: torch eager's (dtype, reference values), or why torch could not run the module
    eager_ref: tuple[Any, ...] | str | None = None


#: the environment variable naming the file in which the local launcher hands a ``--hf`` step
#: (plan, values, torch eager's reference) to its ranks, so that they need not import
#: transformers, build and export the model again (under torchrun every rank makes its own)
STEP_ENV = "SPMDKIT_RUN_STEP"


def _save_step(step: _Step) -> str | None:
    """Compute a ``--hf`` step's values and torch eager's reference once, in the launcher, and
    write them with the plan to a private temporary directory (returned) for the ranks; None
    where that cannot be done (the ranks then make the step themselves, as under torchrun)."""
    d = tempfile.mkdtemp(prefix="spmdkit-run-")
    try:
        path = _write_step(step, os.path.join(d, "step.pickle"))
    except Exception:  # not an error of the run: each rank makes its own step and says what fails
        shutil.rmtree(d, ignore_errors=True)
        return None
    os.environ[STEP_ENV] = path
    return d


def _write_step(step: _Step, path: str) -> str:
    from spmdkit.execute.eager import eager_reference  # (imports torch)
    from spmdkit.models.torch_import import ImportedProgram, torch_values  # (imports torch)

    prog = step.plan.program
    assert isinstance(prog, ImportedProgram)  # a --hf step's
    values = torch_values(prog, step.model, kwargs=step.kwargs)
    try:
        ref: tuple[Any, ...] | str = eager_reference(prog, step.model, (), step.kwargs, native=True)
    except Exception as exc:  # rank 0 reports it as a failure of the check
        ref = f"{type(exc).__name__}: {_first_line(exc)}"
    with open(path, "wb") as f:
        pickle.dump(_Step(step.plan, step.title, None, None, values, ref), f, protocol=pickle.HIGHEST_PROTOCOL)
    return path


def _load_step() -> _Step | None:
    """The step the local launcher (this process's parent) saved for its ranks, if any."""
    path = os.environ.get(STEP_ENV, "")
    if not path or os.environ.get("SPMDKIT_LAUNCHER_PID", "") != str(os.getppid()) or not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            step = pickle.load(f)
    except Exception:  # unreadable: this rank makes the step itself
        return None
    return step if isinstance(step, _Step) else None


def _plan(req: RunRequest, user: dict[str, Any]) -> _Step:
    m = req.model
    if m.hf:
        return _plan_hf_step(req, user)
    for flag, v in (("--hf-config", m.hf_config), ("--dtype", m.dtype), ("--pad", req.pad)):
        if v is not None:
            raise RunUsageError(f"{flag} applies to --hf CLASS only")
    if m.program:
        patterns = parse_tp_plan(m.tp_plan)
        _loaded, plan, _ = plan_source(ProgramFile(m.program), req.mesh, req.strategy, user, patterns)
        return _Step(plan, f"program {m.program}, mesh {req.mesh}" + (f", strategy {req.strategy}" if req.strategy
                                                                       else ""))
    if m.tp_plan is not None:
        raise RunUsageError("--tp-plan applies to --hf or --program models (a preset has its own roles)")
    strategy = req.strategy or "megatron"
    loaded, plan, _ = plan_source(Preset(m.model, req.layers, req.batch, req.seq,
                                         vocab_divisible_by=m.vocab_divisible_by), req.mesh, strategy, user)
    assert loaded.model is not None
    n = loaded.model.config.layers
    what = ", ".join([f"{n} layer{'s' if n != 1 else ''}", *variants(loaded.model.config)])
    return _Step(plan, f"{model_label(m.model)} ({what}), mesh {req.mesh}, strategy {strategy}")


def _plan_hf_step(req: RunRequest, user: dict[str, Any]) -> _Step:
    m = req.model
    assert m.hf is not None
    if m.program:
        raise RunUsageError("--hf and --program: give one of them")
    if m.hf_config is None:
        raise RunUsageError("--hf needs --hf-config FILE|JSON (the model's config)")
    if req.layers is not None:
        raise RunUsageError("--layers applies to a preset; set the layer count in --hf-config")
    for flag, v in (("--batch", req.batch), ("--seq", req.seq)):
        if v is not None and v < 1:
            raise RunUsageError(f"{flag} {v}: must be at least 1")
    batch = HF_BATCH if req.batch is None else req.batch
    seq = HF_SEQ if req.seq is None else req.seq
    pad = req.pad or 0
    if not 0 <= pad < seq:
        raise RunUsageError(f"--pad {pad}: must be in [0, --seq {seq})")
    dtype = dtype_name(m.dtype or "float32")
    strategy = req.strategy or "megatron"
    patterns = parse_tp_plan(m.tp_plan)
    b, sq = parse_size("--batch", batch, MAX_SIZE), parse_size("--seq", seq, MAX_SIZE)
    assert b is not None and sq is not None
    loaded, plan, _ = plan_source(HFModel(m.hf, m.hf_config, dtype, b, sq, weights=True, fallback=m.fallback or "error",
                                          pad=pad, vocab_divisible_by=m.vocab_divisible_by), req.mesh, strategy, user,
                                  patterns)
    warn = loaded.title.partition("\n")[2]  # --fallback replicate, a padded vocabulary: lines under the first
    kw = loaded.inputs  # padded: traced with HF's padding mask (an unpadded step has none to read)
    return _Step(plan, f"{m.hf} ({dtype}, batch {batch}, seq {seq}" + (f", {pad} padded" if pad else "")
                 + f"), mesh {req.mesh}, strategy {strategy}" + (f"\n{warn}" if warn else ""), loaded.module, kw)


def _check_kernels_and_device(req: RunRequest, plan: Plan) -> None:
    """--kernels torch: every op has a torch kernel; --device: a known device (both before any rank
    starts). Their errors reach run_command as raised, and print with their class as spmdkit plan
    prints the same --device's (``spmdkit run: ProgramError: --device 'tpu9': no such preset ...``)."""
    if req.kernels == "torch":  # (by the names of the kernels: the launcher imports no torch)
        check_kernels(plan.program)
    if req.device is not None:
        load_device(req.device)


def _env_int(name: str, lo: int, hi: int) -> int:
    v = os.environ.get(name, "").strip()
    if not v.isdigit() or not lo <= int(v) <= hi:
        raise RunUsageError(f"environment variable {name}={os.environ.get(name)!r}: expected an integer in "
                            f"[{lo}, {hi}]")
    return int(v)


def _run_command(req: RunRequest, out: TextIO) -> int:
    if importlib.util.find_spec("torch") is None:
        raise RunUsageError("needs torch (pip install 'spmdkit[torch]')")
    if req.warmup < 0:
        raise RunUsageError(f"--warmup {req.warmup}: must be at least 0")
    if req.nproc is not None and req.nproc < 1:
        raise RunUsageError(f"--nproc {req.nproc}: must be at least 1")
    rank_mode = "RANK" in os.environ
    if rank_mode or req.backend == "nccl":  # the launcher itself does not import torch (seconds)
        _check_backend(req.backend)
    if rank_mode:  # one rank under torchrun (or our launcher): the rendezvous must be complete
        missing = [v for v in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v, "").strip()]
        if missing:
            raise RunUsageError(f"RANK is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: "
                                "set all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (as torchrun does), or "
                                "none of them to start local processes")
        _env_int("RANK", 0, _env_int("WORLD_SIZE", 1, 1 << 20) - 1)
        _env_int("MASTER_PORT", 1, 65535)
    step = _load_step() if rank_mode else None  # what our launcher made for its ranks
    bar = Progress("spmdkit run", stream=sys.stderr) if not rank_mode else None
    try:
        return _run_command_with(req, out, rank_mode, step, bar)
    finally:
        if bar is not None:
            bar.close()


def _run_command_with(req: RunRequest, out: TextIO, rank_mode: bool, step: _Step | None,
                      bar: Progress | None) -> int:
    if rank_mode:
        world = _env_int("WORLD_SIZE", 1, 1 << 20)
        rank = _env_int("RANK", 0, world - 1)
    # the planner's errors (an SpmdError) reach run_command, which prints them with their class, as
    # spmdkit plan and --engine torch do
    mesh = parse_mesh(req.mesh)
    if "pp" in mesh.dim_names:
        raise RunUsageError(f"--mesh {req.mesh}: a pp dim (pipeline parallelism) is planned by 'spmdkit plan' "
                            "(stages, schedule, bubble); 'spmdkit run' executes one step without stages, so it "
                            "would run pp as a plain replicated dim: drop pp from --mesh")
    n = mesh.size if req.nproc is None else req.nproc
    phases = ["planning", f"starting {n} ranks", *(["warm-up"] if req.warmup else []), "step", "checking"]
    if bar is not None:
        bar.total = len(phases)
    if step is None:
        with strategy_notes("run"):  # --hf / --program strategies' notes, one line each
            if bar is not None:
                bar.update(0, note="planning")
            try:
                step = _plan(req, parse_annotations(req.annotate))
            finally:
                if bar is not None:
                    bar.clear()  # the notes, or an error, come next
    plan = step.plan
    why = uneven_shards(plan)
    if why:
        raise RunUsageError(f"mesh {req.mesh}: {why}")
    _check_kernels_and_device(req, plan)
    if not rank_mode:
        nproc = mesh.size if req.nproc is None else req.nproc
        if nproc != mesh.size:
            raise RunUsageError(f"--nproc {nproc} but the mesh {req.mesh} has {mesh.size} ranks")
        port = None
        if os.environ.get("MASTER_PORT", "").strip():
            port = _env_int("MASTER_PORT", 1, 65535)
            if port_in_use(port):
                raise RunUsageError(f"MASTER_PORT {port} is in use on 127.0.0.1; free it, or unset MASTER_PORT "
                                    "to let spmdkit run pick a free port")
        saved = _save_step(step) if step.model is not None else None
        out.flush()
        try:
            return launch_local(_strip_nproc(list(req.argv)), nproc, req.timeout, port, progress=bar, phases=phases)
        finally:
            if saved is not None:
                os.environ.pop(STEP_ENV, None)
                shutil.rmtree(saved, ignore_errors=True)
    if world != mesh.size:
        raise RunUsageError(f"WORLD_SIZE {world} but the mesh {req.mesh} has {mesh.size} ranks")
    return _run_rank(req, out, step, rank)


def _tell_launcher(name: str) -> None:
    """Rank 0: the phase of the run, for the launcher's progress line (spmdkit.execute.launch.PHASE_MARK)."""
    sys.stderr.write(f"{PHASE_MARK}{name}\n")
    sys.stderr.flush()


def _run_rank(req: RunRequest, out: TextIO, step: _Step, rank: int) -> int:
    """One rank: any failure is one line on stderr and exit EXIT_RANK_FAILED (EXIT_PORT_IN_USE when
    rank 0 cannot listen on MASTER_PORT), without waiting on peers that may be gone."""
    import torch.distributed as dist

    from spmdkit.execute.collectives import init_from_env  # (imports torch)
    from spmdkit.execute.eager import eager_reference
    from spmdkit.execute.rank import run_rank
    from spmdkit.execute.report import format_report
    from spmdkit.models.torch_import import ImportedProgram, torch_values  # (imports torch)

    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    # torch bounds the rendezvous by the timeout, except a TCPStore client talking to something
    # else listening on the port, which waits forever: a watchdog ends that
    watchdog = threading.Timer(req.timeout + min(5.0, req.timeout), _die, (
        f"spmdkit run: rank {rank}: rendezvous at {where} did not complete within --timeout {req.timeout:g} s "
        "(is something else listening on MASTER_PORT?)", EXIT_RANK_FAILED))
    watchdog.daemon = True
    watchdog.start()
    try:
        init_from_env(req.backend, req.timeout)
        watchdog.cancel()
    except Exception as exc:  # every rendezvous failure becomes one line
        text = f"{type(exc).__name__}: {_first_line(exc)}"
        if rank == 0 and ("address already in use" in str(exc).lower() or "EADDRINUSE" in str(exc)):
            _die(f"spmdkit run: rank 0 cannot listen on {where}: the port is in use", EXIT_PORT_IN_USE)
        _die(f"spmdkit run: rank {rank}: rendezvous at {where} failed within --timeout {req.timeout:g} s: {text}",
             EXIT_RANK_FAILED)
    plan, title = step.plan, step.title
    try:
        values: dict[str, Any] | None = step.values
        eager: Any = None
        if step.eager_ref is not None:
            ref = step.eager_ref

            def eager() -> Any:
                if isinstance(ref, str):
                    raise ProgramError(ref)
                return ref
        elif step.model is not None:  # the module's weights, buffers and constants, the call's inputs
            assert isinstance(plan.program, ImportedProgram)  # a --hf step's
            values = torch_values(plan.program, step.model, kwargs=step.kwargs)
            eager = partial(eager_reference, plan.program, step.model, (), step.kwargs, native=True)
        # the launcher's progress line on a terminal
        phase = _tell_launcher if rank == 0 and os.environ.get(PROGRESS_ENV) else None
        rep = run_rank(plan, req.seed, timeout=req.timeout, values=values, eager=eager, kernels=req.kernels,
                       predict_on=req.device, warmup=req.warmup, phase=phase)
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # a collective timed out, a peer died, a kernel failed
        if os.environ.get("SPMDKIT_TRACEBACK"):
            import traceback

            traceback.print_exc()
        _die(f"spmdkit run: rank {rank}: {type(exc).__name__}: {_first_line(exc)}", EXIT_RANK_FAILED)
    if rep is None:
        return 0
    if req.json:
        d: dict[str, Any] = {
            "title": title, "world_size": rep.world_size, "backend": rep.backend, "ok": rep.ok,
            "loss": _finite(rep.loss), "reference_loss": _finite(rep.reference_loss), "loss_tensor": rep.loss_tensor,
            "checked": rep.checked,
            "max_error": rep.max_error, "nonfinite": rep.nonfinite, "failures": [list(f) for f in rep.failures],
            "collectives": [c.__dict__ for c in rep.collectives], "collectives_match": rep.collectives_match,
            "expected_collectives": len(rep.expected),
            "kernels": rep.kernels, "max_rel_error": rep.max_rel_error, "timing": rep.timing, "warmup": rep.warmup,
            "predicted": rep.predicted, "predicted_on": rep.predicted_on,
            "moved": [list(m) for m in rep.moved],
            "eager": None if rep.eager is None else {
                "dtype": rep.eager.dtype, "loss": _finite(rep.eager.loss), "checked": rep.eager.checked,
                "max_rel_error": rep.eager.max_rel_error, "rtol": rep.eager.rtol,
                "native_error": rep.eager.native_error,
                "failures": [list(f) for f in rep.eager.failures]},
        }
        out.write(json.dumps(d) + "\n")
    else:
        out.write(format_report(rep, title) + "\n")
    out.flush()
    return 0 if rep.ok else 1


def _finite(x: float | None) -> float | str | None:
    """JSON has no NaN or infinity: such a loss is written as its name."""
    if x is None or math.isfinite(x):
        return x
    return str(x)


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0][:500] if lines else "(no message)"


def _die(msg: str, code: int) -> NoReturn:
    """Print one line and end this rank now: no exit handlers, no waiting in torch's teardown for
    peers that may be dead or stopped."""
    sys.stdout.flush()
    print(msg, file=sys.stderr, flush=True)
    os._exit(code)
