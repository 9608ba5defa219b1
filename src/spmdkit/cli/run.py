"""``spmdkit run``: execute a planned training step on torch.distributed (needs ``spmdkit[torch]``)."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any, NoReturn, TextIO

from spmdkit.core.errors import ProgramError
from spmdkit.cost.devices import load_device


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    from spmdkit.models.zoo import PRESETS

    p.add_argument("--model", default="tiny-llama", help=f"a preset ({', '.join(sorted(PRESETS))}); default tiny-llama")
    p.add_argument("--program", help="run a program JSON file (docs/graph.md) instead of a preset; its annotations "
                                      "come from --annotate")
    p.add_argument("--hf", metavar="CLASS", help="run a HuggingFace transformers model (e.g. LlamaForCausalLM) built "
                                                 "from --hf-config, on its own weights (needs spmdkit[hf])")
    p.add_argument("--hf-config", metavar="FILE|JSON", help="the --hf model's config: a config.json path or a JSON "
                                                            "object")
    p.add_argument("--dtype", help="the --hf model's dtype (float32, float64, bfloat16, float16; default float32)")
    p.add_argument("--pad", type=int, help="--hf: padded positions (attention mask 0) at the end of the batch's last "
                                           "row (default 0)")
    p.add_argument("--mesh", default="dp=2,tp=2", help="named mesh dims, e.g. dp=2,tp=2 (default)")
    p.add_argument("--strategy", help="comma list of dp, megatron (tp), sp, zero1, zero2 (zero), zero3 (fsdp); default megatron (--program: "
                                      "none, its --annotate pins alone)")
    p.add_argument("--tp-plan", metavar="FILE|JSON",
                   help='megatron for --hf / --program: module-name patterns -> column, row, vocab or replicate, '
                        'e.g. \'{"*.k_proj": "replicate"}\' (docs/torch.md)')
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--batch", type=int, help=f"override the preset's batch size (--hf: default {HF_BATCH})")
    p.add_argument("--seq", type=int, help=f"override the preset's sequence length (--hf: default {HF_SEQ})")
    p.add_argument("--annotate", action="append", default=[], metavar="TENSOR=DIMS_MAPPING",
                   help='pin a tensor, e.g. --annotate "tokens=[0,-1]" (repeatable)')
    p.add_argument("--nproc", type=int,
                   help="start this many local processes (default: the mesh size); ignored under torchrun")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                   help="torch.distributed backend (auto: nccl where GPUs exist, else gloo)")
    p.add_argument("--seed", type=int, default=0, help="seed of the step's data and parameters")
    p.add_argument("--kernels", choices=("numpy", "torch"), default="torch",
                   help="what each rank computes with: torch's ops in the program's dtypes (default: a real "
                        "training step, checked against a single-process torch step within each dtype's "
                        "tolerance; docs/torch.md) or spmdkit's numpy references in float64 (exact checks)")
    p.add_argument("--warmup", type=int, metavar="N", default=0,
                   help="untimed steps before the timed, checked one (default 0: the times then include torch's "
                        "first-call initialisation of its kernels, and the report says so; 1 for times to set "
                        "beside the prediction)")
    p.add_argument("--device", metavar="NAME|FILE",
                   help="the plan's prediction of the step's time on this GPU (a preset: a100-40gb, a100-80gb, "
                        "h100, h200, or a JSON file), printed beside the measured time; default: this GPU's "
                        "preset, else h100")
    p.add_argument("--json", action="store_true", help="print rank 0's report as JSON")
    p.add_argument("--timeout", type=_positive_seconds, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help="the longest any rendezvous, process group or collective may wait; a rank that "
                        "waits longer fails and the run ends (default %(default)g)")


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


DEFAULT_TIMEOUT = 120.0
#: ``--hf`` example inputs when --batch / --seq are not given
HF_BATCH = 4
HF_SEQ = 16


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
    import threading
    import time

    def watch() -> None:
        while os.getppid() == int(want):
            time.sleep(0.5)
        os._exit(3)  # EXIT_RANK_FAILED

    threading.Thread(target=watch, daemon=True).start()


def _positive_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return v


def run_command(ns: argparse.Namespace, out: TextIO, argv: list[str]) -> int:
    """``spmdkit run``: exit 0 (every tensor and collective as planned), 1 (the check failed, or a
    rank failed: one line names it), 2 (bad arguments or environment, before any rank starts)."""
    die_with_launcher()  # first: importing torch takes seconds
    try:
        return _run_command(ns, out, argv)
    except RunUsageError as exc:
        print(f"spmdkit run: {exc}", file=sys.stderr)
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

    plan: Any
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
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="spmdkit-run-")
    try:
        path = _write_step(step, os.path.join(d, "step.pickle"))
    except Exception:  # not an error of the run: each rank makes its own step and says what fails
        shutil.rmtree(d, ignore_errors=True)
        return None
    os.environ[STEP_ENV] = path
    return d


def _write_step(step: _Step, path: str) -> str:
    import pickle

    from spmdkit.execute.eager import eager_reference
    from spmdkit.models.torch_import import torch_values

    prog = step.plan.program
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
    import pickle

    try:
        with open(path, "rb") as f:
            step = pickle.load(f)
    except Exception:  # unreadable: this rank makes the step itself
        return None
    return step if isinstance(step, _Step) else None


def _plan(ns: argparse.Namespace, mesh: Any, user: dict[str, Any]) -> _Step:
    if ns.hf:
        return _plan_hf_step(ns, user)
    for flag, v in (("--hf-config", ns.hf_config), ("--dtype", ns.dtype), ("--pad", ns.pad)):
        if v is not None:
            raise RunUsageError(f"{flag} applies to --hf CLASS only")
    if ns.program:
        from spmdkit.cli.plan import parse_tp_plan
        from spmdkit.planner.planning import plan_program
        from spmdkit.program.ir import load_program

        _prog, plan = plan_program(load_program(ns.program), ns.mesh, ns.strategy, user, parse_tp_plan(ns.tp_plan))
        return _Step(plan, f"program {ns.program}, mesh {ns.mesh}" + (f", strategy {ns.strategy}" if ns.strategy
                                                                       else ""))
    from spmdkit.planner.planning import plan_model

    if ns.tp_plan is not None:
        raise RunUsageError("--tp-plan applies to --hf or --program models (a preset has its own roles)")
    strategy = ns.strategy or "megatron"
    overrides = {"layers": ns.layers, "batch": ns.batch, "seq": ns.seq}
    model, plan, _ = plan_model(ns.model, ns.mesh, strategy, overrides, user)
    return _Step(plan, f"{ns.model} ({model.config.layers} layers), mesh {ns.mesh}, strategy {strategy}")


def _plan_hf_step(ns: argparse.Namespace, user: dict[str, Any]) -> _Step:
    if ns.program:
        raise RunUsageError("--hf and --program: give one of them")
    if ns.hf_config is None:
        raise RunUsageError("--hf needs --hf-config FILE|JSON (the model's config)")
    if ns.layers is not None:
        raise RunUsageError("--layers applies to a preset; set the layer count in --hf-config")
    for flag, v in (("--batch", ns.batch), ("--seq", ns.seq)):
        if v is not None and v < 1:
            raise RunUsageError(f"{flag} {v}: must be at least 1")
    batch = HF_BATCH if ns.batch is None else ns.batch
    seq = HF_SEQ if ns.seq is None else ns.seq
    pad = ns.pad or 0
    if not 0 <= pad < seq:
        raise RunUsageError(f"--pad {pad}: must be in [0, --seq {seq})")
    from spmdkit.models.hf import dtype_name

    dtype = dtype_name(ns.dtype or "float32")
    strategy = ns.strategy or "megatron"
    from spmdkit.cli.plan import parse_tp_plan
    from spmdkit.planner.planning import plan_hf

    _prog, model, kw, plan = plan_hf(ns.hf, ns.hf_config, ns.mesh, strategy, dtype, batch, seq, user,
                                      parse_tp_plan(ns.tp_plan))
    if pad:  # the same shapes, a padded last row: the program does not depend on the inputs' values
        from spmdkit.models.hf import example_inputs

        kw = example_inputs(model, batch, seq, labels=True, pad=pad)
    return _Step(plan, f"{ns.hf} ({dtype}, batch {batch}, seq {seq}" + (f", {pad} padded" if pad else "")
                 + f"), mesh {ns.mesh}, strategy {strategy}", model, kw)


def _check_kernels_and_device(ns: argparse.Namespace, plan: Any) -> None:
    """--kernels torch: every op has a torch kernel; --device: a known device (both before any rank starts)."""
    if ns.kernels == "torch":
        from spmdkit.execute.kernels import check_kernels

        try:
            check_kernels(plan.program)
        except ProgramError as exc:
            raise RunUsageError(str(exc)) from None
    if ns.device is not None:
        try:
            load_device(ns.device)
        except ProgramError as exc:
            raise RunUsageError(str(exc)) from None


def _env_int(name: str, lo: int, hi: int) -> int:
    v = os.environ.get(name, "").strip()
    if not v.isdigit() or not lo <= int(v) <= hi:
        raise RunUsageError(f"environment variable {name}={os.environ.get(name)!r}: expected an integer in "
                            f"[{lo}, {hi}]")
    return int(v)


def _run_command(ns: argparse.Namespace, out: TextIO, argv: list[str]) -> int:
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise RunUsageError("needs torch (pip install 'spmdkit[torch]')")
    if ns.warmup < 0:
        raise RunUsageError(f"--warmup {ns.warmup}: must be at least 0")
    if ns.nproc is not None and ns.nproc < 1:
        raise RunUsageError(f"--nproc {ns.nproc}: must be at least 1")
    rank_mode = "RANK" in os.environ
    if rank_mode or ns.backend == "nccl":  # the launcher itself does not import torch (seconds)
        _check_backend(ns.backend)
    if rank_mode:  # one rank under torchrun (or our launcher): the rendezvous must be complete
        missing = [v for v in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v, "").strip()]
        if missing:
            raise RunUsageError(f"RANK is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: "
                                "set all of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (as torchrun does), or "
                                "none of them to start local processes")
        _env_int("RANK", 0, _env_int("WORLD_SIZE", 1, 1 << 20) - 1)
        _env_int("MASTER_PORT", 1, 65535)
    step = _load_step() if rank_mode else None  # what our launcher made for its ranks
    from spmdkit.outputs.progress import Progress

    bar = Progress("spmdkit run", stream=sys.stderr) if not rank_mode else None
    try:
        return _run_command_with(ns, out, argv, rank_mode, step, bar)
    finally:
        if bar is not None:
            bar.close()


def _run_command_with(ns: argparse.Namespace, out: TextIO, argv: list[str], rank_mode: bool, step: Any,
                      bar: Any) -> int:
    from spmdkit.cli.plan import parse_annotations, strategy_notes
    from spmdkit.execute.launch import uneven_shards
    from spmdkit.strategies.strategy import parse_mesh

    if rank_mode:
        world = _env_int("WORLD_SIZE", 1, 1 << 20)
        rank = _env_int("RANK", 0, world - 1)
    try:
        mesh = parse_mesh(ns.mesh)
        if "pp" in mesh.dim_names:
            raise RunUsageError(f"--mesh {ns.mesh}: a pp dim (pipeline parallelism) is planned by 'spmdkit plan' "
                                "(stages, schedule, bubble); 'spmdkit run' executes one step without stages, so it "
                                "would run pp as a plain replicated dim: drop pp from --mesh")
        n = mesh.size if ns.nproc is None else ns.nproc
        phases = ["planning", f"starting {n} ranks", *(["warm-up"] if ns.warmup else []), "step", "checking"]
        if bar is not None:
            bar.total = len(phases)
        if step is None:
            with strategy_notes("run"):  # --hf / --program strategies' notes, one line each
                if bar is not None:
                    bar.update(0, note="planning")
                try:
                    step = _plan(ns, mesh, parse_annotations(ns.annotate))
                finally:
                    if bar is not None:
                        bar.clear()  # the notes, or an error, come next
    except RunUsageError:
        raise
    except ProgramError as exc:
        raise RunUsageError(str(exc)) from None
    plan = step.plan
    why = uneven_shards(plan)
    if why:
        raise RunUsageError(f"mesh {ns.mesh}: {why}")
    _check_kernels_and_device(ns, plan)
    if not rank_mode:
        nproc = mesh.size if ns.nproc is None else ns.nproc
        if nproc != mesh.size:
            raise RunUsageError(f"--nproc {nproc} but the mesh {ns.mesh} has {mesh.size} ranks")
        port = None
        if os.environ.get("MASTER_PORT", "").strip():
            from spmdkit.execute.launch import port_in_use

            port = _env_int("MASTER_PORT", 1, 65535)
            if port_in_use(port):
                raise RunUsageError(f"MASTER_PORT {port} is in use on 127.0.0.1; free it, or unset MASTER_PORT "
                                    "to let spmdkit run pick a free port")
        from spmdkit.execute.launch import launch_local

        saved = _save_step(step) if step.model is not None else None
        out.flush()
        try:
            return launch_local(_strip_nproc(argv), nproc, ns.timeout, port, progress=bar, phases=phases)
        finally:
            if saved is not None:
                import shutil

                os.environ.pop(STEP_ENV, None)
                shutil.rmtree(saved, ignore_errors=True)
    if world != mesh.size:
        raise RunUsageError(f"WORLD_SIZE {world} but the mesh {ns.mesh} has {mesh.size} ranks")
    return _run_rank(ns, out, step, rank)


def _tell_launcher(name: str) -> None:
    """Rank 0: the phase of the run, for the launcher's progress line (spmdkit.execute.launch.PHASE_MARK)."""
    from spmdkit.execute.launch import PHASE_MARK

    sys.stderr.write(f"{PHASE_MARK}{name}\n")
    sys.stderr.flush()


def _run_rank(ns: argparse.Namespace, out: TextIO, step: _Step, rank: int) -> int:
    """One rank: any failure is one line on stderr and exit EXIT_RANK_FAILED (EXIT_PORT_IN_USE when
    rank 0 cannot listen on MASTER_PORT), without waiting on peers that may be gone."""
    import threading

    import torch.distributed as dist

    from spmdkit.execute.collectives import init_from_env
    from spmdkit.execute.launch import EXIT_PORT_IN_USE, EXIT_RANK_FAILED, PROGRESS_ENV
    from spmdkit.execute.rank import run_rank
    from spmdkit.execute.report import format_report

    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    # torch bounds the rendezvous by the timeout, except a TCPStore client talking to something
    # else listening on the port, which waits forever: a watchdog ends that
    watchdog = threading.Timer(ns.timeout + min(5.0, ns.timeout), _die, (
        f"spmdkit run: rank {rank}: rendezvous at {where} did not complete within --timeout {ns.timeout:g} s "
        "(is something else listening on MASTER_PORT?)", EXIT_RANK_FAILED))
    watchdog.daemon = True
    watchdog.start()
    try:
        init_from_env(ns.backend, ns.timeout)
        watchdog.cancel()
    except Exception as exc:  # every rendezvous failure becomes one line
        text = f"{type(exc).__name__}: {_first_line(exc)}"
        if rank == 0 and ("address already in use" in str(exc).lower() or "EADDRINUSE" in str(exc)):
            _die(f"spmdkit run: rank 0 cannot listen on {where}: the port is in use", EXIT_PORT_IN_USE)
        _die(f"spmdkit run: rank {rank}: rendezvous at {where} failed within --timeout {ns.timeout:g} s: {text}",
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
            from functools import partial

            from spmdkit.execute.eager import eager_reference
            from spmdkit.models.torch_import import torch_values

            values = torch_values(plan.program, step.model, kwargs=step.kwargs)
            eager = partial(eager_reference, plan.program, step.model, (), step.kwargs, native=True)
        # the launcher's progress line on a terminal
        phase = _tell_launcher if rank == 0 and os.environ.get(PROGRESS_ENV) else None
        rep = run_rank(plan, ns.seed, timeout=ns.timeout, values=values, eager=eager, kernels=ns.kernels,
                       predict_on=ns.device, warmup=ns.warmup, phase=phase)
        dist.barrier()
        dist.destroy_process_group()
    except Exception as exc:  # a collective timed out, a peer died, a kernel failed
        if os.environ.get("SPMDKIT_TRACEBACK"):
            import traceback

            traceback.print_exc()
        _die(f"spmdkit run: rank {rank}: {type(exc).__name__}: {_first_line(exc)}", EXIT_RANK_FAILED)
    if rep is None:
        return 0
    if ns.json:
        d: dict[str, Any] = {
            "title": title, "world_size": rep.world_size, "backend": rep.backend, "ok": rep.ok,
            "loss": _finite(rep.loss), "reference_loss": _finite(rep.reference_loss), "loss_tensor": rep.loss_tensor,
            "checked": rep.checked,
            "max_error": rep.max_error, "nonfinite": rep.nonfinite, "failures": [list(f) for f in rep.failures],
            "collectives": [c.__dict__ for c in rep.collectives], "collectives_match": rep.collectives_match,
            "expected_collectives": len(rep.expected),
            "kernels": rep.kernels, "max_rel_error": rep.max_rel_error, "timing": rep.timing, "warmup": rep.warmup,
            "predicted": rep.predicted, "predicted_on": rep.predicted_on,
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
