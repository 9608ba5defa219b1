"""Helpers shared by test files."""

from __future__ import annotations

import contextlib
import io

import pytest


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
