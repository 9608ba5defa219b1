"""The local launcher of ``spmdkit run`` (no torch needed here): the checks made before any rank
starts (:func:`uneven_shards`, :func:`port_in_use`), and :func:`launch_local`, which starts one
process per rank and watches them until every one has ended, one way or another.

A rank that fails or dies ends the run at once: the launcher kills the others and prints one line
naming the rank and its error (a stopped rank is named as such once its peers' collectives time
out). Killing the launcher ends the ranks: SIGTERM / SIGINT / SIGHUP from its handler, its death
through each rank's parent-death signal (``spmdkit.cli.run.die_with_launcher``).

On a terminal the launcher shows one progress line on its stderr (a
:class:`spmdkit.outputs.progress.Progress`: starting N ranks, then the phases rank 0 reports on its
stderr as :data:`PHASE_MARK` lines); rank 0's output then passes through the launcher, which
erases the line before writing it, so the two never interleave. On a pipe nothing changes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr, entry_dims
from spmdkit.program.plan import Plan


def uneven_shards(plan: Plan) -> str | None:
    """Why the executor cannot run ``plan`` (a tensor axis its collectives would split unevenly),
    or None. Checks every dist attr the step uses: each tensor's, each op's required inputs and
    its outputs, and every reshard step's source and destination."""
    prog = plan.program
    ms = plan.mesh.shape
    names = plan.mesh.dim_names

    def check(name: Any, attr: Any) -> str | None:
        if isinstance(name, (tuple, list)):
            attrs = attr if isinstance(attr, (tuple, list)) else (attr,) * len(name)
            for n, a in zip(name, attrs):
                why = check(n, a)
                if why:
                    return why
            return None
        if not isinstance(name, str) or not isinstance(attr, TensorDistAttr) or name not in prog.tensors:
            return None
        shape = prog.tensors[name].shape
        for axis, (size, e) in enumerate(zip(shape, attr.dims_mapping)):
            dims = entry_dims(e)
            n = 1
            for d in dims:
                n *= ms[d]
            if n > 1 and size % n:
                over = " x ".join(f"{names[d]}={ms[d]}" for d in dims)
                return (f"tensor {name} axis {axis} of size {size} does not split evenly over mesh dim"
                        f"{'s' if len(dims) > 1 else ''} {over} ({size} % {n} = {size % n}); the executor "
                        f"needs even shards: choose mesh sizes that divide it")
        return None

    for name, attr in plan.attrs.items():
        why = check(name, attr)
        if why:
            return why
    for op_plan in plan.ops:
        op = op_plan.op
        for p, v in op.inputs.items():
            why = check(v, op_plan.required.get(p))
            if why:
                return why
        why = check(list(op.outputs), list(op_plan.outputs))
        if why:
            return why
    for rs in plan.reshards:
        for st in rs.plan.steps:
            why = check(rs.tensor, st.src) or check(rs.tensor, st.dst)
            if why:
                return why
    return None


def free_port() -> int:
    """A TCP port nobody listens on now (bind port 0 on 127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``port`` cannot be bound on ``host`` (someone holds it)."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


#: the prefix of the lines by which rank 0 tells the launcher's progress line its phase (only when
#: the launcher sets SPMDKIT_PROGRESS; the launcher keeps them out of every output)
PHASE_MARK = "\x1espmdkit phase: "
PROGRESS_ENV = "SPMDKIT_PROGRESS"

#: a rank's exit code when its rendezvous port was taken (the launcher retries on another port)
EXIT_PORT_IN_USE = 4
#: a rank's exit code for a failure of the run itself (a collective timed out, a peer died, ...)
EXIT_RANK_FAILED = 3


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _proc_state(pid: int) -> str:
    """The one-letter state of a live process from /proc (``T`` stopped), or ``?``."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


def _error_line(err: str) -> str:
    """The line of a rank's stderr that says what went wrong."""
    lines = [ln.strip() for ln in err.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("spmdkit"):
            return ln
    if any(ln.startswith("Traceback") for ln in lines):
        tail = [ln for ln in lines if not ln.startswith(("File ", "Traceback", "^", "~"))]
        return tail[-1] if tail else lines[-1]
    return lines[0] if lines else "(no message)"


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL every rank still alive, with anything it started (SIGKILL also ends a stopped
    process), and reap them."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                try:
                    p.kill()
                except ProcessLookupError:
                    pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
            pass


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def launch_local(argv: list[str], nproc: int, timeout: float = 120.0, port: int | None = None,
                 retries: int = 3, progress: Any = None, phases: Sequence[str] = ()) -> int:
    """Start ``nproc`` local processes of ``spmdkit run`` with torchrun's environment (on
    ``port``, or a free one) and watch them: rank 0's output is this process's output; when a
    rank fails or dies, the others are ended at once and one line on stderr names the rank and
    its error. Killing this process (SIGTERM, SIGINT, SIGHUP) ends the ranks; so does its death
    (each rank asks the kernel for SIGKILL when its parent dies). Returns 0 when every rank
    succeeded, 1 when the check failed or a rank did, ``128 + signal`` when interrupted.

    ``progress``: a :class:`spmdkit.outputs.progress.Progress` to keep up to date (when it is enabled: a
    terminal), its count the index of the phase in ``phases`` rank 0 reports."""
    import threading

    show = _Show(progress if progress is not None and getattr(progress, "enabled", False) else None,
                 list(phases), threading.Lock())
    chosen = port is None
    for _attempt in range(max(1, retries)):
        rc = _launch_once(argv, nproc, timeout, free_port() if port is None else port, show)
        if rc != -EXIT_PORT_IN_USE:
            return rc
        if not chosen:
            break
    show.clear()
    print(f"spmdkit run: the rendezvous port{'' if chosen else f' {port}'} was taken by another process"
          + (f" {retries} times" if chosen else "; unset MASTER_PORT to let spmdkit run pick a free one"),
          file=sys.stderr)
    return 1


class _Show:
    """The launcher's progress line, shared by its threads (None: no terminal, nothing shown)."""

    def __init__(self, bar: Any, phases: list[str], lock: Any) -> None:
        self.bar, self.phases, self.lock = bar, phases, lock
        self.quiet = False  # rank 0 has written its output: the line is not drawn again

    def phase(self, name: str) -> None:
        if self.bar is not None:
            with self.lock:
                if not self.quiet:
                    self.bar.update(self.phases.index(name) if name in self.phases else None, note=name)

    def tick(self) -> None:
        if self.bar is not None:
            with self.lock:
                if not self.quiet:
                    self.bar.update()

    def clear(self) -> None:
        if self.bar is not None:
            with self.lock:
                self.bar.clear()

    def write(self, data: bytes) -> None:
        """Rank 0's output, on this process's stdout, the progress line erased first."""
        with self.lock:
            if self.bar is not None:
                self.bar.clear()
                self.quiet = True
            buf = getattr(sys.stdout, "buffer", None)
            if buf is not None:
                buf.write(data)
            else:
                sys.stdout.write(data.decode(errors="replace"))
            sys.stdout.flush()


def _launch_once(argv: list[str], nproc: int, timeout: float, port: int, show: _Show) -> int:
    import threading

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), SPMDKIT_LAUNCHER_PID=str(os.getpid()))
    env.pop(PROGRESS_ENV, None)
    errs: list[list[bytes]] = [[] for _ in range(nproc)]
    mark = PHASE_MARK.encode()
    shown = show.bar is not None

    def read(stream: Any, buf: list[bytes]) -> None:
        size = 0
        for line in iter(stream.readline, b""):
            if line.startswith(mark):
                show.phase(line[len(mark):].decode(errors="replace").strip())
                continue
            if size < 1 << 16:
                buf.append(line)
                size += len(line)
        stream.close()

    def forward(stream: Any) -> None:
        for line in iter(stream.readline, b""):
            show.write(line)
        stream.close()

    procs: list[subprocess.Popen[bytes]] = []
    readers: list[threading.Thread] = []
    old: dict[int, Any] = {}
    forwarder: threading.Thread | None = None

    def on_signal(signum: int, frame: Any) -> None:
        raise _Interrupted(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        try:
            old[sig] = signal.signal(sig, on_signal)
        except (ValueError, OSError):  # not the main thread: the ranks still die with this process
            pass
    try:
        show.phase(f"starting {nproc} ranks")
        for r in range(nproc):
            e = dict(env, RANK=str(r), LOCAL_RANK=str(r))
            if r == 0 and shown:
                e[PROGRESS_ENV] = "1"
            # a session of its own: a terminal's Ctrl-C reaches the launcher, which ends the ranks
            procs.append(subprocess.Popen([sys.executable, "-m", "spmdkit", "run", *argv], env=e,
                                          stdout=(subprocess.PIPE if shown else None) if r == 0 else subprocess.DEVNULL,
                                          stderr=subprocess.PIPE, start_new_session=True))
            if r == 0 and shown:
                forwarder = threading.Thread(target=forward, args=(procs[-1].stdout,), daemon=True)
                forwarder.start()
            t = threading.Thread(target=read, args=(procs[-1].stderr, errs[r]), daemon=True)
            t.start()
            readers.append(t)
        return _watch(procs, errs, readers, timeout, show, forwarder)
    except _Interrupted as exc:
        _kill(procs)
        show.clear()
        print(f"spmdkit run: interrupted ({_signame(exc.signum)}); ended {len(procs)} rank processes",
              file=sys.stderr)
        return 128 + exc.signum
    except KeyboardInterrupt:
        _kill(procs)
        show.clear()
        print(f"spmdkit run: interrupted (SIGINT); ended {len(procs)} rank processes", file=sys.stderr)
        return 128 + int(signal.SIGINT)
    finally:
        _kill(procs)
        for signum, h in old.items():
            signal.signal(signum, h)


_CONSEQUENCES = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout", "peer",
                 "socket", "rendezvous")


_CAUSE_GRACE_S = 3.0


def _faulted(codes: list[int | None]) -> list[int]:
    """The ranks that exited with a fault: rank 0's exit 1 is its report saying the check failed;
    any other non-zero exit is a fault."""
    return [r for r, c in enumerate(codes) if c is not None and c != 0 and not (r == 0 and c == 1)]


def _is_consequence(line: str) -> bool:
    return any(w in line.lower() for w in _CONSEQUENCES)


def _await_cause(procs: list[subprocess.Popen[bytes]], failed: list[int], codes: list[int | None],
                 text: Any) -> tuple[list[int], list[int | None]]:
    """While every failed rank failed only because a peer went away (and none was killed by a signal),
    wait up to _CAUSE_GRACE_S for another rank to exit; return the failures seen then."""
    import time

    end = time.monotonic() + _CAUSE_GRACE_S
    while time.monotonic() < end:
        if any(int(codes[r] or 0) < 0 or not _is_consequence(_error_line(text(r))) for r in failed):
            break
        if all(c is not None for c in codes):
            break
        time.sleep(0.05)
        codes = [p.poll() for p in procs]
        failed = _faulted(codes)
    return failed, codes


def _watch(procs: list[subprocess.Popen[bytes]], errs: list[list[bytes]], readers: list[Any],
           timeout: float, show: _Show, forwarder: Any = None) -> int:
    import time

    def text(r: int) -> str:
        readers[r].join(timeout=2)
        return b"".join(errs[r]).decode(errors="replace")

    while True:
        codes = [p.poll() for p in procs]
        failed = _faulted(codes)
        if failed:
            # a rank that lost its peer often exits before the peer that failed first is seen to: give
            # the cause a moment to exit on its own before the consequence is reported
            failed, codes = _await_cause(procs, failed, codes, text)
            stopped = [r for r, p in enumerate(procs) if p.poll() is None and _proc_state(p.pid) == "T"]
            _kill(procs)
            lines = {r: _error_line(text(r)) for r in failed}

            # a rank killed by a signal caused the others' failures; then one whose own error is not a
            # lost peer or a timeout; then the lowest rank
            bad = min(failed, key=lambda r: (int(codes[r] or 0) >= 0,
                                             _is_consequence(lines[r]), r))
            c = int(codes[bad] or 0)
            if c == EXIT_PORT_IN_USE and bad == 0:
                return -EXIT_PORT_IN_USE
            if forwarder is not None:
                forwarder.join(timeout=2)
            show.clear()
            what = f"was killed by {_signame(-c)}" if c < 0 else f"failed (exit {c}): {lines[bad]}"
            msg = f"spmdkit run: rank {bad} {what}"
            if stopped:
                msg = (f"spmdkit run: rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))} "
                       f"stopped (SIGSTOP?) and did not answer within --timeout {timeout:g} s; rank {bad} {what}")
            print(msg + "; ended every rank", file=sys.stderr)
            return 1
        if all(c is not None for c in codes):
            break
        show.tick()
        time.sleep(0.05)
    if forwarder is not None:
        forwarder.join(timeout=10)
    show.clear()
    err = text(0)
    if err:
        sys.stderr.write(err)
    return 1 if any(p.returncode for p in procs) else 0


__all__ = ["EXIT_PORT_IN_USE", "EXIT_RANK_FAILED", "PHASE_MARK", "PROGRESS_ENV", "free_port", "launch_local", "port_in_use", "uneven_shards"]
