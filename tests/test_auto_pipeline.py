"""``spmdkit plan --auto`` on a mesh with a ``pp`` dim: the stages' shardings chosen by the exact
search on the sub-mesh without pp (planner/auto/stage.py), as the ``--devices`` search plans its
``auto`` pipeline configurations; the pipeline's estimate, the ``--json`` auto block, and the
refusals of what does not apply. Tiny models, 2 layers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import cli_stdout
from spmdkit.models.zoo import build_model, preset
from spmdkit.planner.search import Config, config_candidates

#: tiny-llama as an HF config, 2 layers
TINY_LLAMA_HF = {"hidden_size": 16, "intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "num_hidden_layers": 2, "vocab_size": 64, "max_position_embeddings": 64}


@pytest.fixture(scope="module")
def planned() -> dict[str, Any]:
    rc, out = cli_stdout("plan", "--model", "tiny-llama", "--batch", "8", "--seq", "64", "--microbatches", "2",
                         "--mesh", "pp=2,dp=2", "--auto", "--device", "h100", "--json")
    assert rc == 0
    return dict(json.loads(out))


def test_plan_auto_pp_is_what_devices_auto_plans(planned: dict[str, Any]) -> None:
    """The plan of one microbatch on the stages' sub-mesh and the step are those of the --devices
    search's auto configuration pp=2 x dp=2 (the search's sub-mesh has a tp dim of 1)."""
    cands = config_candidates("tiny-llama", Config(2, 1, 2, "auto", microbatches=2), "h100",
                              {"layers": 2, "batch": 8, "seq": 64}, fold=False)
    best = next(c for c in cands if c.config.recompute == "none")
    got = {n: t["dims_mapping"] for n, t in planned["tensors"].items()}
    want = {n: list(a.dims_mapping) for n, a in best.plan.attrs.items()}
    assert got == want
    # not the all-replicated plan: 59 of its tensors split over dp (the vocab-parallel loss built on
    # every mesh, as the flat --auto builds it)
    assert sum(any(x >= 0 for x in dm) for dm in got.values()) >= 50
    assert planned["pipeline"]["step_overlap_s"] == pytest.approx(best.step_s, rel=1e-9)
    assert planned["pipeline"]["pp"] == 2 and planned["pipeline"]["microbatches"] == 2


def test_plan_auto_pp_json_and_title(planned: dict[str, Any]) -> None:
    auto = planned["auto"]  # the flat --auto's block (cli/common.auto_json)
    assert auto["status"] == "Optimal" and auto["gap"] == 0.0 and auto["solve_seconds"] > 0
    assert auto["memory_cap"] is None and auto["realized"] == "direct"
    assert "; --auto (HiGHS Optimal, gap 0.00%" in planned["title"]
    assert "strategy" not in planned["title"] and planned["title"].endswith("; pipeline pp=2")


def test_plan_auto_pp_program_and_explain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prog = build_model(preset("tiny-llama"), check_rules=False).program
    f = tmp_path / "p.json"
    f.write_text(json.dumps(prog.to_json()))
    rc, out = cli_stdout("plan", "--program", str(f), "--mesh", "pp=2,dp=2", "--auto", "--explain")
    assert rc == 0, capsys.readouterr().err
    assert out.startswith(f"program {f}, 2 layers, 1 microbatches of its step; --auto (HiGHS Optimal")
    assert "layers per stage 1,1" in out and "--explain: per layer" in out


def test_plan_auto_pp_cp_of_an_hf_model_traces_its_stages_for_cp() -> None:
    """An --hf model on pp=2,cp=2 (refused until 2026-12-07): the stages' program is traced in the cp
    ranks' token order (its loss reads the labels shifted before the permutation, models/hf_cp.py),
    as the flat ``plan --hf --auto --mesh cp=2`` imports it, and the search runs on it."""
    rc, out = cli_stdout("plan", "--hf", "LlamaForCausalLM", "--hf-config", json.dumps(TINY_LLAMA_HF), "--seq", "8",
                         "--mesh", "pp=2,cp=2", "--auto", "--json")
    assert rc == 0
    doc = json.loads(out)
    assert "shift_labels" in doc["tensors"] and doc["pipeline"]["pp"] == 2
    assert doc["auto"]["status"] == "Optimal"


@pytest.mark.parametrize(("args", "msg"), [
    (["--model", "tiny-llama", "--mesh", "pp=2,dp=2", "--strategy", "megatron"],
     "ProgramError: --strategy: does not apply with --auto (the search chooses the shardings)"),
    (["--model", "tiny-llama", "--mesh", "pp=2,dp=2", "--verify"],
     "ProgramError: --verify: checks a flat --auto plan (its tiny model simulated); the stages of a pipeline"),
    (["--model", "tiny-llama", "--mesh", "pp=2,dp=2", "--memory", "10GiB"],
     "ProgramError: --memory: --auto on a pipeline (--mesh with pp) takes no cap"),
    (["--hf", "LlamaForCausalLM", "--hf-config", json.dumps(TINY_LLAMA_HF), "--seq", "8", "--mesh", "pp=2,dp=2",
      "--tp-plan", '{"*.q_proj": "column"}'],
     "ProgramError: --tp-plan: does not apply with --auto"),
    # the flat --auto too (it ignored --tp-plan)
    (["--hf", "LlamaForCausalLM", "--hf-config", json.dumps(TINY_LLAMA_HF), "--seq", "8", "--mesh", "dp=2",
      "--tp-plan", '{"*.q_proj": "column"}'],
     "ProgramError: --tp-plan: does not apply with --auto"),
])
def test_plan_auto_pp_refusals(args: list[str], msg: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = cli_stdout("plan", *args, "--auto")
    err = capsys.readouterr().err
    assert rc == 2 and out == ""
    assert err.startswith(f"spmdkit plan: {msg}"), err
