"""Helpers shared by test files."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """What the suite's processes share, set once before any test process starts (the xdist
    workers, each ``spmdkit run`` and its ranks, torchrun's workers, the CLI subprocesses all
    inherit it):

    - spmdkit's sources compiled to bytecode. Hundreds of those processes import most of ``src``;
      where ``PYTHONDONTWRITEBYTECODE`` is set (as on this project's machines) none of them wrote
      the ``__pycache__`` it compiled, so every one compiled the package again (a ``spmdkit
      run`` rank: 3.2 -> 2.2 CPU s). Python checks each file's bytecode against its source's
      modification time, so an edited source is compiled afresh as before.
    - ``OMP_NUM_THREADS=1`` unless it is set: the suite runs one test per core (``-n 2``) and
      each gloo job several ranks, so torch's second intra-op thread only waited, spinning, for
      a core that was busy (test_hf.py with test_torch_kernels.py: 7 to 12% fewer CPU s).
      torchrun's workers ran on one already (``spmdkit.execute.torchrun``).

    docs/architecture.md, "The suite's CPU time", has the measurements."""
    if hasattr(config, "workerinput"):  # an xdist worker: its controller did it
        return
    import compileall

    for d in ("src", "benchmarks", "scripts"):
        compileall.compile_dir(str(ROOT / d), quiet=2)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def run_cli_line(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``spmdkit run ARGS`` in-process: (exit status, the last stderr line); never a traceback."""
    from spmdkit.cli import main

    try:
        rc = main(["run", *args])
    except SystemExit as exc:  # argparse
        rc = int(exc.code or 0)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err.strip().splitlines()[-1] if err.strip() else ""


def cli_stdout(*argv: str) -> tuple[int, str]:
    """``spmdkit ARGV`` in-process: (exit status, what it printed on stdout)."""
    from spmdkit.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(list(argv))
    return rc, buf.getvalue()


def run_json(*args: str) -> dict[str, Any]:
    """``spmdkit run --json --warmup 0 --timeout 120 ARGS`` in a subprocess (it launches the
    gloo ranks): its JSON report; a non-zero exit fails the test with the output's tail."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.run([sys.executable, "-m", "spmdkit", "run", "--json", "--warmup", "0", "--timeout", "120", *args],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def load_script(name: str, path: Path) -> ModuleType:
    """The benchmark or script at ``path`` loaded afresh as module ``name`` (registered in
    sys.modules first: its dataclasses look their module up while the file runs)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
