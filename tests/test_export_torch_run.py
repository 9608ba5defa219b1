"""The ``torch`` export states what the plan priced beyond its shardings (``RECOMPUTE``,
``RECOMPUTE_LAYERS``, ``PRECISION``, ``GRAD_ACCUM``), applies whole-layer recomputation
(torch's ``checkpoint_wrapper`` around each block, as torchtitan's full AC) and names in one
warning line what it does not apply (spmdkit.outputs.export_torch_run). The gloo run of a full
recompute export against eager is a case of tests/test_export_torch.py's combined spawn."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import cli_stdout

pytest.importorskip("torch")
pytest.importorskip("transformers")

LLAMA = {"num_key_value_heads": 2, "num_hidden_layers": 3, "hidden_size": 32, "num_attention_heads": 4,
         "intermediate_size": 64, "vocab_size": 128, "max_position_embeddings": 64}


def _export(tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str,
            mesh: str = "dp=2,tp=2", strategy: str = "megatron,sp") -> tuple[Any, str]:
    """(the exported module, the warning lines on stderr) of ``plan --hf LlamaForCausalLM ... FLAGS``."""
    path = tmp_path / "plan.py"
    capsys.readouterr()
    rc, _ = cli_stdout("plan", "--hf", "LlamaForCausalLM", "--hf-config", json.dumps(LLAMA), "--mesh", mesh,
                       "--strategy", strategy, *flags, "--export", "torch", str(path))
    err = capsys.readouterr().err
    assert rc == 0 and path.is_file(), err
    spec = importlib.util.spec_from_file_location("exported_run_plan", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, "\n".join(ln for ln in err.splitlines() if "--export torch: the file does not apply" in ln)


def _model() -> Any:
    from spmdkit.models.hf import build

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build("LlamaForCausalLM", LLAMA, seed=0)


def test_full_recompute_wraps_every_block_and_counts_its_collectives_again(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--recompute full: the file says so, wraps each of the 3 blocks in checkpoint_wrapper (applied
    here to an unsharded model: no process group needed) and counts each block's forward collectives
    over tp again in the backward. megatron,sp on tp=2, per block: 2 all-gathers (the two norms' outputs
    for the column layers) and 2 reduce-scatters (o_proj's, down_proj's outputs); the embedding's
    reduce-scatter and the head's all-gather are outside the blocks: forward 3 x 2 + 1 each, the
    backward's own 7 each, plus 3 x 2 recomputed = 13."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    mod, warned = _export(tmp_path, capsys, "--recompute", "full")
    assert (mod.RECOMPUTE, mod.RECOMPUTE_LAYERS, mod.PRECISION, mod.GRAD_ACCUM) == ("full", "all", None, 1)
    assert warned == ""
    assert "Priced with: recompute full (applied: parallelize wraps every block in checkpoint_wrapper)" in \
        " ".join(mod.__doc__.split())
    assert mod.PLAN_COLLECTIVES["forward"] == {"all_gather_into_tensor": 7, "reduce_scatter_tensor": 7}
    back = mod.PLAN_COLLECTIVES["backward"]
    assert (back["all_gather_into_tensor"], back["reduce_scatter_tensor"]) == (13, 13)
    model = _model()
    mod._checkpoint_layers(model)
    assert [type(b) for b in model.model.layers] == [CheckpointWrapper] * 3
    assert "_checkpoint_layers(model)" in Path(tmp_path / "plan.py").read_text()


def test_full_k_and_every_n_wrap_the_layers_the_plan_prices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """full:2: the first two blocks (Megatron's block method); every:2: block 1 (torchtitan's
    selective_ac_option 2: the 2nd, 4th ... counted from 1); the backward counts only theirs again."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    for flag, layers, wrapped in (("full:2", ("model.layers.0", "model.layers.1"), [True, True, False]),
                                  ("every:2", ("model.layers.1",), [False, True, False])):
        framework = ["--framework", "torchtitan"] if flag.startswith("every") else []
        mod, warned = _export(tmp_path, capsys, "--recompute", flag, *framework)
        assert (mod.RECOMPUTE, mod.RECOMPUTE_LAYERS, warned) == (flag, layers, "")
        assert mod.PLAN_COLLECTIVES["backward"]["reduce_scatter_tensor"] == 7 + 2 * len(layers)
        model = _model()
        mod._checkpoint_layers(model)
        assert [isinstance(b, CheckpointWrapper) for b in model.model.layers] == wrapped


def test_what_the_file_does_not_apply_is_warned_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """selective recompute, fp8 and --grad-accum 4: stated in the file, not applied, one warning line
    naming each and what to do; none of the checkpoint code written."""
    mod, warned = _export(tmp_path, capsys, "--recompute", "selective", "--precision", "fp8", "--grad-accum", "4")
    assert (mod.RECOMPUTE, mod.RECOMPUTE_LAYERS, mod.PRECISION, mod.GRAD_ACCUM) == ("selective", (), "fp8", 4)
    assert not hasattr(mod, "_checkpoint_layers")
    assert "Priced with: recompute selective (not applied)" in " ".join(mod.__doc__.split())
    assert "precision fp8 (PRECISION, not applied" in " ".join(mod.__doc__.split())
    assert len(warned.splitlines()) == 1
    assert warned.startswith("spmdkit plan: warning: --export torch: the file does not apply --recompute selective (")
    assert "--precision fp8 (" in warned and "convert_to_float8_training" in warned
    assert "--grad-accum 4 (" in warned and "run 4 micro-steps per optimizer step" in warned
    mod, warned = _export(tmp_path, capsys)
    assert (mod.RECOMPUTE, mod.RECOMPUTE_LAYERS, mod.GRAD_ACCUM, warned) == ("none", (), 1, "")


def test_a_pipeline_export_states_the_precision_it_was_priced_in(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A pipeline plan's file states --precision as the plan without one does (cli.common's
    export_plan_file for both: the plan step_estimate returns, carrying the runtime); the pipeline
    path exported the plan before its runtime was set and wrote PRECISION = None under fp8."""
    mod, warned = _export(tmp_path, capsys, "--batch", "4", "--seq", "16", "--microbatches", "2",
                          "--precision", "fp8", mesh="pp=2,tp=2", strategy="megatron")
    assert mod.PIPELINE is not None and mod.PRECISION == "fp8"
    assert "--precision fp8" in warned
