"""``--make-vocab-size-divisible-by N``: a vocabulary tp does not divide (GPT-2's 50257 at tp=2)
padded as Megatron-LM pads it, to a multiple of N x tp
(``megatron.training.vocab_utils.calculate_padded_vocab_size`` at d98e8a6); the refusals name the
option; the padded model planned, run against torch eager, and exported saying so."""

from __future__ import annotations

import json
import runpy
from pathlib import Path
from typing import Any

import pytest

from conftest import cli_stdout, run_json
from spmdkit.core.errors import ProgramError

pytest.importorskip("torch")
pytest.importorskip("transformers")

from spmdkit.models.hf import build, import_hf

GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
TINY = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 250, "n_positions": 64}


def _plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    rc, out = cli_stdout("plan", *args)
    return rc, out, capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(("vocab", "by", "tp", "padded"), [
    (50257, 128, 2, 50432),  # GPT-2 at tp 2: a multiple of 256
    (50257, 128, 1, 50304),  # GPT-2 at tp 1 (nanoGPT's and the gpt2-small preset's 50304)
    (50257, 64, 2, 50304),
    (151936, 128, 4, 152064),  # Qwen at tp 4
    (151936, 1187, 4, 151936),  # the Megatron-MoE-ModelZoo's 1187: stays
    (250, 8, 2, 256),
])
def test_padded_vocab_is_megatrons(vocab: int, by: int, tp: int, padded: int) -> None:
    from spmdkit.models.hf import padded_vocab_size

    assert padded_vocab_size(vocab, by, tp) == padded


def test_gpt2_at_tp2_is_refused_naming_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    args = ("--hf", "GPT2LMHeadModel", "--hf-config", json.dumps(GPT2), "--seq", "128", "--batch", "2",
            "--mesh", "dp=1,tp=2", "--strategy", "megatron")
    rc, _out, err = _plan(capsys, *args)
    assert rc == 2
    assert err == ("spmdkit plan: ProgramError: --strategy megatron: transformer.wte (vocab): its vocabulary axis has "
                   "50257 entries, not divisible by tp=2; pad it as Megatron-LM does: --make-vocab-size-divisible-by "
                   "128 pads it to 50432 (a multiple of 128 x tp=2)")


def test_model_config_vocab_refused_naming_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _out, err = _plan(capsys, "--model-config", '{"base": "gpt2-small", "vocab": 50257, "layers": 2}',
                          "--mesh", "dp=1,tp=2")
    assert rc == 2
    assert err == ("spmdkit plan: ProgramError: --mesh tp=2: megatron splits evenly or not at all: tp=2 does not "
                   "divide the model's vocabulary of 50257 (Megatron-LM pads it: --make-vocab-size-divisible-by 128 "
                   "pads it to 50432, a multiple of 128 x tp=2); a tp of 29 does")


def test_gpt2_at_tp2_padded_plan(capsys: pytest.CaptureFixture[str]) -> None:
    """GPT-2 (2 layers) at tp=2, padded to 50432: the embedding (tied to the head) split by rows,
    25216 a rank; the parameters per rank counted by hand (float32)."""
    rc, out = cli_stdout("plan", "--hf", "GPT2LMHeadModel", "--hf-config", json.dumps(GPT2), "--seq", "128",
                         "--batch", "2", "--mesh", "dp=1,tp=2", "--make-vocab-size-divisible-by", "128", "--json")
    assert rc == 0
    got = json.loads(out)
    assert got["title"].split("\n")[1] == (
        "note: vocabulary 50257 padded to 50432 (Megatron --make-vocab-size-divisible-by 128 x tp 2): 175 more rows "
        "in the embedding and the output layer, their logits in the softmax, never a token or a target")
    wte = got["tensors"]["transformer.wte.weight"]
    assert wte["shape"] == [50432, 768] and wte["placements"] == "[dp:R, tp:S(0)]"  # 25216 rows a rank
    h, f = 768, 3072
    layer = (2 * h + h * 3 * h // 2 + 3 * h // 2 + h * h // 2 + h  # ln_1, c_attn (column), c_proj (row) + its bias
             + 2 * h + h * f // 2 + f // 2 + f * h // 2 + h)  # ln_2, c_fc (column), c_proj (row) + its bias
    per_rank = 2 * layer + 50432 // 2 * h + 1024 * h + 2 * h  # wte's rows over tp, wpe, ln_f
    assert got["memory"]["parameters"] == 4 * per_rank == 108985344


def test_preset_padded_and_said(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = cli_stdout("plan", "--model-config", '{"base": "gpt2-small", "vocab": 50257, "layers": 2}',
                         "--mesh", "dp=1,tp=2", "--make-vocab-size-divisible-by", "128", "--json")
    assert rc == 0
    got = json.loads(out)
    assert ", vocab 50432, " in got["title"].split("\n")[0]
    assert got["title"].split("\n")[1].startswith("note: vocabulary 50257 padded to 50432 (Megatron "
                                                  "--make-vocab-size-divisible-by 128 x tp 2)")
    assert any(t["shape"] == [50432, 768] and t["kind"] == "parameter" for t in got["tensors"].values())


def test_tokens_and_labels_below_the_real_vocabulary() -> None:
    """The padded model's example step draws its token ids and labels below the tokenizer's 250 (the
    same draws as the unpadded model's), never a padded row."""
    _p, model, kw = import_hf("GPT2LMHeadModel", {**TINY, "vocab_size": 256}, batch=4, seq=16, vocab=250)
    assert model.get_input_embeddings().weight.shape[0] == 256
    _p0, _m0, kw0 = import_hf("GPT2LMHeadModel", TINY, batch=4, seq=16)
    assert int(kw["input_ids"].max()) < 250 and int(kw["labels"].max()) < 250
    assert kw["input_ids"].equal(kw0["input_ids"]) and kw["labels"].equal(kw0["labels"])


def test_run_padded_gpt2_at_tp2_equals_torch_eager() -> None:
    """spmdkit run of a tiny GPT-2 (vocabulary 250, padded to 256 for tp=2) on 2 gloo ranks: every
    tensor within its tolerance and the loss and every gradient equal to torch eager's of the same
    padded model."""
    rep = run_json("--hf", "GPT2LMHeadModel", "--hf-config", json.dumps(TINY), "--mesh", "dp=1,tp=2",
                   "--make-vocab-size-divisible-by", "8", "--backend", "gloo")
    assert rep["ok"] and rep["collectives_match"] and not rep["failures"] and rep["nonfinite"] == 0
    assert rep["world_size"] == 2
    eager = rep["eager"]
    assert eager["checked"] == 1 + 28 + 2 * 4 and not eager["failures"]  # the loss and every parameter gradient
    assert eager["max_rel_error"] <= 1e-5
    assert rep["loss"] == pytest.approx(eager["loss"], rel=1e-5)


def test_export_states_the_padding(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "plan.py"
    rc, _out = cli_stdout("plan", "--hf", "GPT2LMHeadModel", "--hf-config", json.dumps(TINY), "--mesh", "dp=1,tp=2",
                          "--make-vocab-size-divisible-by", "8", "--export", "torch", str(path))
    assert rc == 0
    ns: dict[str, Any] = runpy.run_path(str(path))
    assert ns["VOCAB_PADDING"] == {"vocab_size": 250, "padded_vocab_size": 256, "make_vocab_size_divisible_by": 8,
                                   "tp": 2}
    ns["_check_vocab"](build("GPT2LMHeadModel", {**TINY, "vocab_size": 256}))  # the padded model passes
    for fmt, args in (("paddle", ("--hf", "GPT2LMHeadModel", "--hf-config", json.dumps(TINY))),
                      ("jax", ("--model-config", '{"base": "tiny-gpt2", "vocab": 250}'))):
        doc = tmp_path / f"{fmt}.json"
        assert cli_stdout("plan", *args, "--mesh", "dp=1,tp=2", "--make-vocab-size-divisible-by", "8",
                          "--export", fmt, str(doc))[0] == 0
        assert json.loads(doc.read_text())["vocab_padding"] == ns["VOCAB_PADDING"]
    with pytest.raises(ValueError, match=r"padded to 256 rows \(VOCAB_PADDING\); the model's embedding has 250: "
                                         r"pad it first, e.g. model.resize_token_embeddings\(256\)"):
        ns["_check_vocab"](build("GPT2LMHeadModel", TINY))


@pytest.mark.parametrize(("args", "msg"), [
    (("--program", "x.json"), "--make-vocab-size-divisible-by 8: pads an --hf model's, a preset's or a "
                              "--model-config's vocabulary; a --program file's shapes are its own"),
    (("--devices", "4", "--model", "tiny-gpt2"), "--make-vocab-size-divisible-by 8: pads the vocabulary by N x tp "
                                                 "of one mesh (--mesh); the --devices search tries several tp"),
])
def test_flag_refused_where_it_cannot_pad(capsys: pytest.CaptureFixture[str], args: tuple[str, ...], msg: str) -> None:
    rc, _out, err = _plan(capsys, *args, "--make-vocab-size-divisible-by", "8")
    assert rc == 2 and msg in err


def test_flag_needs_a_positive_integer(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_stdout("plan", "--model", "tiny-gpt2", "--make-vocab-size-divisible-by", "0")
    assert "must be a positive integer (Megatron's default is 128), got '0'" in capsys.readouterr().err


def test_falcon_heads_tp_does_not_divide_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    """Falcon-7B's 71 heads at tp=2: refused (Megatron-LM asserts tp divides the heads) in one line
    naming the heads and tp (already so before the option: a pin)."""
    cfg = {"model_type": "falcon", "num_hidden_layers": 1, "hidden_size": 142, "num_attention_heads": 71,
           "multi_query": True, "new_decoder_architecture": False, "parallel_attn": True, "vocab_size": 64,
           "bias": False}
    rc, _out, err = _plan(capsys, "--hf", "FalconForCausalLM", "--hf-config", json.dumps(cfg), "--mesh", "dp=1,tp=2")
    assert rc == 2
    assert err == ("spmdkit plan: ProgramError: --strategy megatron: transformer.h.0.self_attention.query_key_value "
                   "(column) makes 71 heads, not divisible by tp=2")


def test_no_vocab_size_to_pad() -> None:
    from spmdkit.models.hf import pad_vocab_config

    with pytest.raises(ProgramError, match=r"^--make-vocab-size-divisible-by: --hf ViTForImageClassification's "
                                           r"config has no vocab_size to pad$"):
        pad_vocab_config("ViTForImageClassification", {"num_hidden_layers": 1, "hidden_size": 32,
                                                       "num_attention_heads": 2, "intermediate_size": 64}, 128, 2)


@pytest.mark.parametrize("extra", [("--mesh", "pp=2,tp=2", "--microbatches", "2"), ("--mesh", "dp=2,tp=2", "--auto")])
def test_pipeline_and_auto_pad_too(extra: tuple[str, ...]) -> None:
    """A pipeline (the tp of its stages' sub-mesh) and --auto pad as the flat plan does, the note on
    the report's second line."""
    rc, out = cli_stdout("plan", "--model-config", '{"base": "tiny-gpt2", "vocab": 250}', *extra,
                         "--make-vocab-size-divisible-by", "8")
    assert rc == 0
    first, second = out.split("\n")[:2]
    assert (", vocab 256, " in first) == ("--auto" not in extra)  # (--auto's title names no vocabulary)
    assert second == ("note: vocabulary 250 padded to 256 (Megatron --make-vocab-size-divisible-by 8 x tp 2): 6 more "
                      "rows in the embedding and the output layer, their logits in the softmax, never a token or a "
                      "target")
