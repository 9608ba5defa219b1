"""``plan --auto`` on a mesh with a cp dim: the preset is built with cp_attention (its positions
recorded in zig-zag order) so the exact search may split the sequence over cp, and ``--verify``
simulates the searched shardings on the tiny model built the same way; a program file and a
strategy item that is no cp option are refused in one line (an --hf model is imported for cp:
tests/test_search_hf_cp.py)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from spmdkit.cli import main as spmdkit_main
from spmdkit.core.errors import ProgramError
from spmdkit.models.zoo import preset
from spmdkit.strategies.context import auto_config
from spmdkit.strategies.strategy import parse_mesh


def _plan(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = spmdkit_main(["plan", *argv])
    return rc, out.getvalue(), err.getvalue()


def test_auto_on_a_cp_mesh_plans_the_cp_model_and_verifies() -> None:
    rc, out, _ = _plan("--model", "tiny-llama", "--batch", "1", "--seq", "256", "--mesh", "cp=2", "--auto",
                       "--device", "h100", "--json", "--verify")
    assert rc == 0
    doc = json.loads(out)
    # the cp model: its attention reads the positions the tokens hold (before: flash_attention, no positions)
    assert doc["tensors"]["cp.positions"]["shape"] == [256] and "cp.key_positions" in doc["tensors"]
    # one sequence, two ranks: the search splits something over cp (not every tensor replicated)
    assert any(-1 != e for t in doc["tensors"].values() for e in t["dims_mapping"])
    assert doc["verify"]["ok"] and doc["verify"]["model"] == "tiny-llama built for cp=2", doc["verify"]["text"]


def test_auto_config_builds_the_variant_asked_and_refuses_what_it_cannot() -> None:
    mesh = parse_mesh("dp=2,cp=2")
    cfg = auto_config(preset("tiny-llama"), mesh, ["cp-attention=ring"], None)
    assert cfg is not None and (cfg.cp, cfg.cp_attention, cfg.cp_balance) == (2, "ring", "zigzag")
    assert auto_config(preset("tiny-llama"), parse_mesh("dp=2,tp=2"), [], None) == preset("tiny-llama")
    with pytest.raises(ProgramError) as e:
        auto_config(preset("tiny-llama"), parse_mesh("dp=2"), ["cp-attention=ring"], None)
    assert str(e.value) == ("--cp-attention ring: context parallelism is not asked for (--auto splits the sequence on "
                            "a cp mesh dim of more than one rank)")
    # an --hf model is imported for cp instead (no zoo config): tests/test_search_hf_cp.py
    assert auto_config(None, mesh, ["cp-attention=ring"], "--hf") is None
    with pytest.raises(ProgramError) as e:
        auto_config(None, mesh, [], "--program")
    assert str(e.value) == ("--auto --mesh cp=2: context parallelism needs the model built or imported with "
                            "cp_attention; a --program file is not (give the preset, catalog or --hf model)")
    with pytest.raises(ProgramError) as e:
        auto_config(preset("tiny-llama"), parse_mesh("cp=8"), [], None)
    assert str(e.value) == ("--mesh cp=8: the sequence of 8 tokens does not split into 2 x cp = 16 chunks (the zig-zag "
                            "balance)")
    with pytest.raises(ProgramError) as e:
        auto_config(preset("tiny-llama"), mesh, ["dp", "cp"], None)
    assert str(e.value) == "--strategy: does not apply with --auto (the search chooses the shardings)"


def test_auto_with_a_strategy_is_one_line_exit_2() -> None:
    rc, out, err = _plan("--model", "tiny-llama", "--mesh", "cp=2", "--auto", "--strategy", "dp")
    assert rc == 2 and not out and "Traceback" not in err
    assert "--strategy: does not apply with --auto (the search chooses the shardings)" in err
