"""``spmdkit run`` ends, always, and says why; its check never passes on NaN.

Faults are made to happen for real on local gloo processes: a test-only ``sitecustomize`` on the
ranks' PYTHONPATH kills, stops or breaks one rank at a chosen point (nothing of it ships), and the
launcher itself is killed. Every run is bounded by the test's own subprocess timeout and must end
with a non-zero exit, a line naming the rank or tensor, and no rank process left alive."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import run_cli_line

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'spmdkit[torch]')")


ROOT = Path(__file__).resolve().parents[1]
# seconds every rendezvous, group and collective may wait: generous where the run ends through the
# fault itself (ranks that start seconds apart on a loaded machine still meet), short where the
# test waits for it to pass
TIMEOUT = "60"

# the ranks' fault injection: RANK and SPMDKIT_TEST_FAULT="rank:point:action" choose where
_HOOK = '''
import os
_rank = os.environ.get("RANK")
_dir = os.environ.get("SPMDKIT_TEST_DIR")
if _rank is not None and _dir:
    with open(os.path.join(_dir, f"rank{_rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
_fault = os.environ.get("SPMDKIT_TEST_FAULT", "")
if _rank is not None and _fault and _fault.split(":")[0] == _rank:
    _, point, action = _fault.split(":")
    import signal
    import time
    import torch.distributed as dist

    def _act():
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif action == "raise":
            raise RuntimeError("injected fault")
        elif action == "sleep":
            open(os.path.join(_dir, "sleeping"), "w").close()
            time.sleep(600)

    if point == "new_group":
        _new_group = dist.new_group
        def new_group(*a, **k):
            _act()
            return _new_group(*a, **k)
        dist.new_group = new_group
    elif point == "all_reduce":
        _all_reduce = dist.all_reduce
        def all_reduce(*a, **k):
            _act()
            return _all_reduce(*a, **k)
        dist.all_reduce = all_reduce
    elif point == "output":  # one NaN in this rank's piece of the first sharded float tensor
        import spmdkit.execute.rank as te
        _run = te.Rank.run
        def run(self, seed):
            out = _run(self, seed)
            for name in sorted(out):
                a = out[name]
                if a.dtype.kind == "f" and a.size and any(e != -1 for e in self.made[name].dims_mapping):
                    a.reshape(-1)[0] = float("nan")
                    with open(os.path.join(_dir, "nan_tensor"), "w") as f:
                        f.write(name)
                    break
            return out
        te.Rank.run = run
'''


def _env(tmp: Path, fault: str = "") -> dict[str, str]:
    hook = tmp / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(_HOOK)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=f"{hook}{os.pathsep}{ROOT / 'src'}", SPMDKIT_TEST_DIR=str(tmp), SPMDKIT_TEST_FAULT=fault)
    return env


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a dead child the init process has not reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _rank_pids(tmp: Path) -> list[int]:
    return [int(p.read_text()) for p in sorted(tmp.glob("rank*.pid"))]


def _assert_no_ranks_left(tmp: Path, n: int = 2, within: float = 5.0) -> None:
    pids = _rank_pids(tmp)
    assert len(pids) == n, f"{len(pids)} ranks started"
    end = time.monotonic() + within
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.05)
    left = [p for p in pids if _alive(p)]
    for p in left:  # do not leave them to the next test
        os.kill(p, signal.SIGKILL)
    assert not left, f"rank processes {left} still alive"


def _run(tmp: Path, *args: str, fault: str = "", limit: float = 60,
         timeout: str = TIMEOUT) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([sys.executable, "-m", "spmdkit", "run", "--kernels", "numpy", "--timeout", timeout, *args], env=_env(tmp, fault),
                       capture_output=True, text=True, timeout=limit)
    return p


DP2 = ("--mesh", "dp=2", "--strategy", "dp")


@pytest.mark.parametrize(("fault", "says"), [
    ("1:new_group:kill", "rank 1 was killed by SIGKILL"),  # dies while the groups are made
    ("1:all_reduce:raise", "rank 1 failed (exit 3): spmdkit run: rank 1: RuntimeError: injected fault"),
])
def test_a_failing_rank_ends_the_run(tmp_path: Path, fault: str, says: str) -> None:
    # bounded below the --timeout (60 s): the launcher ends the peers, they do not wait it out
    p = _run(tmp_path, *DP2, fault=fault, limit=45)
    assert p.returncode == 1, p.stderr
    assert says in p.stderr and "ended every rank" in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    _assert_no_ranks_left(tmp_path)


def test_a_stopped_rank_times_out_and_is_named(tmp_path: Path) -> None:
    """Rank 1 stops itself (SIGSTOP) in its first all-reduce: rank 0's collective times out after
    --timeout, and the launcher kills everything, the stopped rank included."""
    p = _run(tmp_path, *DP2, fault="1:all_reduce:stop", timeout="6")
    assert p.returncode == 1, p.stderr
    assert "rank 1 stopped (SIGSTOP?) and did not answer within --timeout 6 s" in p.stderr, p.stderr
    assert "rank 0 failed" in p.stderr and "Timed out" in p.stderr
    _assert_no_ranks_left(tmp_path)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_killing_the_launcher_ends_the_ranks(tmp_path: Path, sig: int) -> None:
    """Rank 1 sleeps inside its first all-reduce; the launcher is killed: SIGTERM ends the ranks
    from its handler, SIGKILL through the ranks' parent-death signal."""
    launcher = subprocess.Popen([sys.executable, "-m", "spmdkit", "run", "--kernels", "numpy", "--timeout", "60", *DP2],
                                env=_env(tmp_path, "1:all_reduce:sleep"), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 60
        while not (tmp_path / "sleeping").exists():
            assert launcher.poll() is None and time.monotonic() < end, "the run did not reach the fault"
            time.sleep(0.05)
        launcher.send_signal(sig)
        _, err = launcher.communicate(timeout=20)
    finally:
        launcher.kill()
    assert launcher.returncode == (128 + sig if sig == signal.SIGTERM else -sig)
    if sig == signal.SIGTERM:
        assert "interrupted (SIGTERM); ended 2 rank processes" in err
    _assert_no_ranks_left(tmp_path)


def test_nan_in_the_reference_never_passes(tmp_path: Path) -> None:
    """log of normal samples: the single-process value is 56% NaN and so is the distributed one,
    at the same places. Before, this printed "max abs error 0, all equal" and exited 0."""
    prog = tmp_path / "log.json"
    prog.write_text('{"format": "spmdkit-program", "version": 1, "name": "log", '
                    '"tensors": [{"name": "x", "shape": [4, 8], "kind": "input"}, {"name": "y", "shape": [4, 8]}], '
                    '"ops": [{"rule": "log", "name": "log", "inputs": {"x": "x"}, "outputs": ["y"]}]}')
    p = _run(tmp_path, "--program", str(prog), "--mesh", "dp=2", "--annotate", "x=[0,-1]")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "all equal" not in p.stdout
    assert "1 differ (first: y); 1 hold NaN or infinite values" in p.stdout
    assert "y: not checkable: the single-process value has 18 non-finite values of 32" in p.stdout


def test_nan_on_one_rank_fails_the_check(tmp_path: Path) -> None:
    """One NaN written into rank 1's piece of one sharded tensor: the run exits 1 naming it."""
    p = _run(tmp_path, *DP2, "--json", fault="1:output:nan")
    assert p.returncode == 1, p.stderr
    import json

    rep = json.loads(p.stdout.strip().splitlines()[-1])
    name = (tmp_path / "nan_tensor").read_text()
    assert rep["ok"] is False and rep["nonfinite"] == 1
    assert [name, "1 non-finite values of " + rep["failures"][0][1].split(" of ")[1]] == rep["failures"][0]
    assert rep["max_error"] < 1e-9  # the finite positions still agree


# -- refused before any rank starts: exit 2, one line, no traceback ------------------------------


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    return run_cli_line(capsys, *args)


def test_bad_arguments_are_one_line_errors(capsys: pytest.CaptureFixture[str], monkeypatch: Any) -> None:
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    cases = [
        (["--nproc", "0"], "spmdkit run: --nproc 0: must be at least 1"),
        (["--nproc", "-2"], "spmdkit run: --nproc -2: must be at least 1"),
        (["--nproc", "3"], "spmdkit run: --nproc 3 but the mesh dp=2,tp=2 has 4 ranks"),
        (["--timeout", "0"], "argument --timeout: must be a positive number of seconds, got '0'"),
        (["--timeout", "nan"], "argument --timeout: must be a positive number of seconds, got 'nan'"),
        (["--mesh", "dp=3", "--strategy", "dp"],
         "spmdkit run: ProgramError: --batch 4: data parallel over --mesh dp=3 needs a batch that is a multiple of 3 (each rank "
         "whole sequences); --batch not given: the model's own batch is 4"),
        (["--mesh", "dp=2,tp=3"],
         "spmdkit run: ProgramError: --mesh tp=3: megatron splits evenly or not at all: tp=3 does not divide the "
         "model's 4 attention heads"),
        (["--mesh", "tp=5", "--batch", "8"], "--mesh tp=5: megatron splits evenly or not at all"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--backend", "nccl"], "spmdkit run: --backend nccl needs CUDA GPUs"))
    for args, says in cases:
        rc, line = _cli(capsys, *args)
        assert rc == 2 and says in line, (args, rc, line)


def test_incomplete_rendezvous_environment(capsys: pytest.CaptureFixture[str], monkeypatch: Any) -> None:
    for k in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "0")
    rc, line = _cli(capsys, "--mesh", "dp=2", "--strategy", "dp")
    assert rc == 2 and line.startswith("spmdkit run: RANK is set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_PORT", "29500")
    rc, line = _cli(capsys, "--mesh", "dp=2", "--strategy", "dp")
    assert rc == 2 and line.startswith("spmdkit run: RANK is set but MASTER_ADDR is not")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("RANK", "2")
    rc, line = _cli(capsys, "--mesh", "dp=2", "--strategy", "dp")
    assert rc == 2 and line == "spmdkit run: environment variable RANK='2': expected an integer in [0, 1]"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    rc, line = _cli(capsys, "--mesh", "dp=2", "--strategy", "dp")
    assert rc == 2 and line == "spmdkit run: WORLD_SIZE 4 but the mesh dp=2 has 2 ranks"


def test_a_taken_master_port_is_refused(capsys: pytest.CaptureFixture[str], monkeypatch: Any) -> None:
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        monkeypatch.setenv("MASTER_PORT", str(port))
        rc, line = _cli(capsys, "--mesh", "dp=2", "--strategy", "dp")
    assert rc == 2 and line.startswith(f"spmdkit run: MASTER_PORT {port} is in use on 127.0.0.1")


def test_torchrun_style_ranks_on_a_taken_port_end(tmp_path: Path) -> None:
    """RANK / WORLD_SIZE / MASTER_* set by hand (as torchrun does) on a port something else
    listens on: rank 0 says the port is in use; rank 1, whose client would wait on that listener
    forever, is ended by its rendezvous watchdog. Before, rank 1 hung."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        env = dict(_env(tmp_path), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2")
        procs = [subprocess.Popen([sys.executable, "-m", "spmdkit", "run", "--kernels", "numpy", "--timeout", "2", *DP2],
                                  env=dict(env, RANK=str(r)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True) for r in range(2)]
        try:
            errs = [p.communicate(timeout=60)[1] for p in procs]
        finally:
            for p in procs:
                p.kill()
    assert procs[0].returncode == 4 and errs[0].strip() == (
        f"spmdkit run: rank 0 cannot listen on 127.0.0.1:{port}: the port is in use")
    assert procs[1].returncode == 3 and errs[1].strip().startswith(
        f"spmdkit run: rank 1: rendezvous at 127.0.0.1:{port} did not complete within --timeout 2 s"), errs[1]


def test_a_pipeline_mesh_is_refused_not_run_replicated(capsys: pytest.CaptureFixture[str]) -> None:
    """A pp dim would run as a plain replicated dim (every pp rank the whole step): refused."""
    rc, line = _cli(capsys, "--mesh", "pp=2,dp=2", "--strategy", "dp")
    assert rc == 2 and "--mesh pp=2,dp=2: a pp dim (pipeline parallelism) is planned by 'spmdkit plan'" in line


def test_the_rank_that_failed_first_is_named_though_its_peer_exits_sooner(capsys: pytest.CaptureFixture[str]) -> None:
    """The race CI hit: rank 1 raises, rank 0's gloo sees the closed connection and exits before
    rank 1 is seen to have exited. The launcher names rank 1's error, not rank 0's lost peer."""
    import threading

    from spmdkit.execute import launch

    def rank(code: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    procs = [rank("import sys; sys.stderr.write('RuntimeError: [gloo] Connection closed by peer\\n'); sys.exit(3)"),
             rank("import sys, time; time.sleep(0.8); "
                  "sys.stderr.write('spmdkit run: rank 1: RuntimeError: injected fault\\n'); sys.exit(3)")]
    errs: list[list[bytes]] = [[], []]
    readers = []
    for p, buf in zip(procs, errs):
        t = threading.Thread(target=lambda s=p.stderr, b=buf: b.extend(iter(s.readline, b"")), daemon=True)
        t.start()
        readers.append(t)
    procs[0].wait()  # the consequence has exited, the cause has not
    assert procs[1].poll() is None
    rc = launch._watch(procs, errs, readers, 60.0, launch._Show(None, [], threading.Lock()))
    err = capsys.readouterr().err
    assert rc == 1
    assert "rank 1 failed (exit 3): spmdkit run: rank 1: RuntimeError: injected fault" in err, err
