"""``plan --hf ... --mesh pp=...`` with ``--verify`` (it was refused): the HF class at a tiny config
cut into the same stages and simulated as a preset's pipeline is (sim/verify_plan.verify_pipeline_hf):
the stages run in order, 2 microbatches each equal their unsharded step, and HF's mean loss of the
whole batch is the mean of the microbatches' (labels without ignored tokens, so each counts as
many). A plan that breaks the simulation is reported, exit 1."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install 'spmdkit[torch]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'spmdkit[hf]')")

from spmdkit.cli import main
from spmdkit.planner.pipeline_split import parse_spec
from spmdkit.sim import verify_plan

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

LLAMA = {"hidden_size": 512, "intermediate_size": 1408, "num_attention_heads": 8, "num_key_value_heads": 2,
         "num_hidden_layers": 8, "vocab_size": 32000}


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    got = capsys.readouterr()
    return rc, got.out, got.err


@pytest.mark.parametrize(("cls", "config", "mesh", "strategy"), [
    ("LlamaForCausalLM", LLAMA, "pp=2,tp=2", "megatron"),
    ("GPT2LMHeadModel", {"n_embd": 256, "n_layer": 4, "n_head": 8, "vocab_size": 1024}, "pp=2,dp=2", "dp"),
])
def test_hf_pipeline_verify_simulates_the_stages(cls: str, config: dict[str, Any], mesh: str, strategy: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _run(["plan", "--hf", cls, "--hf-config", json.dumps(config), "--mesh", mesh, "--strategy", strategy,
                         "--seq", "64", "--json", "--verify"], capsys)
    assert rc == 0, err
    v = json.loads(out)["verify"]
    assert v["ok"] and v["stages_in_order"] and v["losses_agree"] and v["microbatches"] == 2
    assert v["model"] == cls and v["layers"] == 2 and v["checked"] > 200 and v["failures"] == []
    assert "the microbatch losses average to the whole batch's loss: yes" in v["text"]


def test_a_wrong_microbatch_weighting_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the ignored labels left in (microbatches counting different numbers of tokens) the
    mean of the microbatch losses is not the whole batch's: the check says NO, so it can fail."""
    monkeypatch.setattr(verify_plan, "_all_counted", lambda a: a)  # keep the drawn -100 labels
    v = verify_plan.verify_pipeline_hf("LlamaForCausalLM", LLAMA, "pp=2,tp=2", parse_spec(2), "megatron")
    assert v["stages_in_order"] and v["failures"] == []
    assert not v["losses_agree"] and not v["ok"] and "average to the whole batch's loss: NO" in v["text"]


def test_hf_pipeline_verify_checks_the_plan_s_split(capsys: pytest.CaptureFixture[str]) -> None:
    """``--stages 0,2,2,0`` (an embedding-only first stage, a loss-only last one: the ops cut by
    ``op_units(ends=True)``): --verify simulates the tiny model split as the plan is, 4 layers 0, 2,
    2, 0 (it simulated its own even split, 1 a stage, before), the stages in order and every tensor
    equal; a middle split the layers do not divide evenly (--stages 1,3 of 4) likewise."""
    cfg = json.dumps({**LLAMA, "num_hidden_layers": 4})
    for mesh, stages, want in (("pp=4,tp=2", "0,2,2,0", [0, 2, 2, 0]), ("pp=2,dp=2", "1,3", [1, 3])):
        rc, out, err = _run(["plan", "--hf", "LlamaForCausalLM", "--hf-config", cfg, "--mesh", mesh, "--strategy",
                             "megatron" if "tp" in mesh else "dp", "--stages", stages, "--microbatches", "2",
                             "--seq", "64", "--json", "--verify"], capsys)
        assert rc == 0, err
        got = json.loads(out)
        v = got["verify"]
        assert got["pipeline"]["layers_per_stage"] == want
        assert f"with 4 layers in {len(want)} pipeline stages split {', '.join(map(str, want))} (" in v["text"]
        assert v["layers_per_stage"] == want and v["layers"] == 4, v["text"]
        assert v["ok"] and v["stages_in_order"] and v["losses_agree"] and v["failures"] == []


def test_devices_verify_of_an_hf_pipeline_checks_its_split(capsys: pytest.CaptureFixture[str]) -> None:
    """``plan --hf --devices 2 --verify`` whose best is a pipeline (a 5-layer Llama under a memory
    cap only pp=2 fits, 1.14 GiB against dp's 1.52): the verdict is the pipeline check on the split
    the search priced (3, 2), not the strategy on one stage's sub-mesh (before: 1 rank, no stages)."""
    cfg = json.dumps({**LLAMA, "num_hidden_layers": 5})
    rc, out, err = _run(["plan", "--hf", "LlamaForCausalLM", "--hf-config", cfg, "--devices", "2", "--strategy", "dp",
                         "--recompute", "none", "--seq", "64", "--batch", "4", "--memory", "1.3GiB", "--json",
                         "--verify"], capsys)
    assert rc == 0, err
    got = json.loads(out)
    assert "best of 2 devices: mesh pp=2,dp=1,tp=1; dp" in got["title"]
    split = got["pipeline"]["layers_per_stage"]
    v = got["verify"]
    assert "with 5 layers in 2 pipeline stages split 3, 2 (" in v["text"] and split == [3, 2]
    assert v["layers_per_stage"] == split and v["ok"] and v["stages_in_order"] and v["losses_agree"]
