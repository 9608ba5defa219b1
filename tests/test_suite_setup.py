"""What tests/conftest.py's ``pytest_configure`` sets up for every process of the suite: spmdkit's
bytecode, current, before any test process starts (so that none compiles the package again where
PYTHONDONTWRITEBYTECODE is set), and one intra-op thread for torch."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
from tests.conftest import ROOT


def test_every_source_has_current_bytecode() -> None:
    sources = sorted((ROOT / "src" / "spmdkit").rglob("*.py"))
    assert len(sources) > 100
    for src in sources:
        pyc = Path(importlib.util.cache_from_source(str(src)))
        assert pyc.is_file(), f"{src.relative_to(ROOT)}: no bytecode at {pyc.relative_to(ROOT)}"
        head = pyc.read_bytes()[:16]
        assert head[:4] == importlib.util.MAGIC_NUMBER, f"{pyc.name}: another Python's bytecode"
        if int.from_bytes(head[4:8], "little") == 0:  # checked by the source's time and size (not a hash)
            st = src.stat()
            assert (int.from_bytes(head[8:12], "little"), int.from_bytes(head[12:16], "little")) == \
                (int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF), f"{pyc.name}: stale"


def test_torch_runs_one_intra_op_thread_unless_told_otherwise() -> None:
    torch = pytest.importorskip("torch")
    assert "OMP_NUM_THREADS" in os.environ  # set for the subprocesses too
    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])
