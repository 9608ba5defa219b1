"""Inputs checked like the rest of the CLI (issue 27): a bad ``--hf-config`` is one line naming
the key, exit 2, before any model is built (a fuzz set of bad configs over seven classes); a tp
that does not split the model evenly is refused naming the mesh dim and the count, for every
model source and in the ``--devices`` search; output files (``--html``, ``--export``,
``calibrate --out``) are written only to a regular file or a new path."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest

from spmdkit.cli import main
from spmdkit.core.errors import ProgramError
from spmdkit.io.atomic import NotRegularFile, output_problem, write_atomic
from spmdkit.models.zoo import PRESETS, ModelConfig
from spmdkit.strategies.strategy import tp_notes, tp_problem

tf = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'spmdkit[hf]')")


def one_line(capsys: pytest.CaptureFixture[str], argv: list[str], names: str) -> str:
    """``spmdkit ARGV`` exits 2 with one stderr line containing ``names``, nothing on stdout."""
    rc = main(argv)
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert rc == 2, (argv[-6:], rc, cap.err[-2000:])
    assert "Traceback" not in cap.err and len(lines) == 1, cap.err[-2000:]
    assert cap.out == ""
    assert names in lines[0], (names, lines[0])
    return lines[0]


# -- --hf-config: a fuzz set of bad configs ---------------------------------------------------------

LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 32}
GPT2 = {"n_embd": 32, "n_layer": 1, "n_head": 4, "vocab_size": 64, "n_positions": 32}
MIXTRAL = {**LLAMA, "num_local_experts": 4, "num_experts_per_tok": 2}
BERT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
        "vocab_size": 64, "max_position_embeddings": 32}
T5 = {"d_model": 32, "d_ff": 64, "num_layers": 1, "num_heads": 4, "d_kv": 8, "vocab_size": 64}
OPT = {"hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 64,
       "max_position_embeddings": 32, "word_embed_proj_dim": 32}
GEMMA2 = {**LLAMA, "head_dim": 16}

CLASSES = {"llama": ("LlamaForCausalLM", LLAMA), "gpt2": ("GPT2LMHeadModel", GPT2),
           "mixtral": ("MixtralForCausalLM", MIXTRAL), "bert": ("BertForMaskedLM", BERT),
           "t5": ("T5ForConditionalGeneration", T5), "opt": ("OPTForCausalLM", OPT),
           "gemma2": ("Gemma2ForCausalLM", GEMMA2)}

DROP = object()


def _mutated(base: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    cfg = dict(base)
    for k, v in change.items():
        if v is DROP:
            cfg.pop(k)
        else:
            cfg[k] = v
    return cfg


#: (class, change to its good config, what the one line must say). Each is bad in one way.
BAD_CONFIGS: list[tuple[str, dict[str, Any], str]] = [
    # wrong types and values of the sizes
    ("llama", {"hidden_size": 0}, "hidden_size is 0"),
    ("llama", {"hidden_size": 64.5}, "hidden_size is float '64.5'"),
    ("llama", {"hidden_size": "64"}, "hidden_size is str '64'"),
    ("llama", {"hidden_size": True}, "hidden_size is bool 'True'"),
    ("llama", {"hidden_size": None}, "hidden_size is null"),
    ("llama", {"hidden_size": -32}, "hidden_size is -32"),
    ("llama", {"hidden_size": [32]}, "hidden_size is list"),
    ("llama", {"num_attention_heads": 0}, "num_attention_heads is 0"),
    ("llama", {"num_key_value_heads": 0}, "num_key_value_heads is 0"),
    ("llama", {"num_key_value_heads": "2"}, "num_key_value_heads is str"),
    ("llama", {"num_hidden_layers": 0}, "num_hidden_layers is 0"),
    ("llama", {"num_hidden_layers": -4}, "num_hidden_layers is -4"),
    ("llama", {"num_hidden_layers": 1e3}, "num_hidden_layers is float"),
    ("llama", {"num_hidden_layers": 10**6}, "num_hidden_layers is 1000000; LlamaConfig needs an integer >= 1 and at most 1024"),
    ("llama", {"vocab_size": 0}, "vocab_size is 0"),
    ("llama", {"vocab_size": 1 << 40}, "vocab_size is 1099511627776; LlamaConfig needs an integer >= 1 and at most 2147483647"),
    ("llama", {"intermediate_size": 64.0}, "intermediate_size is float"),
    ("llama", {"max_position_embeddings": 0}, "max_position_embeddings is 0"),
    ("llama", {"head_dim": 0}, "head_dim is 0"),
    # missing size keys (HF's default would be taken silently)
    ("llama", {"hidden_size": DROP}, "hidden_size is missing"),
    ("llama", {"num_attention_heads": DROP}, "num_attention_heads is missing"),
    ("llama", {"num_hidden_layers": DROP}, "num_hidden_layers is missing"),
    ("llama", {"vocab_size": DROP}, "vocab_size is missing"),
    ("llama", {"intermediate_size": DROP}, "intermediate_size is missing"),
    # shapes that do not divide
    ("llama", {"num_attention_heads": 3, "num_key_value_heads": 3}, "hidden_size 32 is not divisible by num_attention_heads 3"),
    ("llama", {"num_key_value_heads": 3}, "num_attention_heads 4 is not divisible by num_key_value_heads 3"),
    # values that index or pick from a size
    ("llama", {"pad_token_id": 10**6}, "pad_token_id 1000000 is not a token of the vocabulary of 64"),
    ("llama", {"head_dim": 3}, "the head size 3 (head_dim) is odd"),
    ("llama", {"hidden_size": 36}, "the head size 9 (hidden_size / num_attention_heads) is odd"),
    # typos of known keys
    ("llama", {"num_attention_head": 4}, "'num_attention_head' is not a key of LlamaConfig (did you mean 'num_attention_heads'?)"),
    ("llama", {"hidden_size": DROP, "hiden_size": 32}, "'hiden_size' is not a key of LlamaConfig"),
    ("llama", {"vocab_sise": 64}, "'vocab_sise'"),
    ("llama", {"intermediate_sizes": 64}, "did you mean 'intermediate_size'"),
    # values of other keys the config class rejects
    ("llama", {"rms_norm_eps": "small"}, "rms_norm_eps"),
    ("llama", {"hidden_act": 5}, "hidden_act"),
    # GPT-2's spellings
    ("gpt2", {"n_embd": DROP}, "n_embd is missing"),
    ("gpt2", {"vocab_size": DROP}, "vocab_size is missing"),
    ("gpt2", {"n_layer": DROP}, "n_layer is missing"),
    ("gpt2", {"n_head": 0}, "n_head is 0"),
    ("gpt2", {"n_layer": 0}, "n_layer is 0"),
    ("gpt2", {"n_embd": 30}, "n_embd 30 is not divisible by n_head 4"),
    ("gpt2", {"n_inner": 0}, "n_inner is 0"),
    ("gpt2", {"n_inner": "128"}, "n_inner is str"),
    ("gpt2", {"n_embed": 32}, "'n_embed' is not a key of GPT2Config (did you mean 'n_embd'?)"),
    ("gpt2", {"n_embd": DROP, "hidden_size": "32"}, "hidden_size is str"),
    # Mixtral
    ("mixtral", {"num_local_experts": 0}, "num_local_experts is 0"),
    ("mixtral", {"num_local_experts": 2.5}, "num_local_experts is float"),
    ("mixtral", {"num_experts_per_tok": 0}, "num_experts_per_tok is 0"),
    ("mixtral", {"intermediate_size": DROP}, "intermediate_size is missing"),
    ("mixtral", {"num_experts_per_tok": 8}, "num_experts_per_tok 8 is more than the 4 experts"),
    # BERT
    ("bert", {"intermediate_size": DROP}, "intermediate_size is missing"),
    ("bert", {"num_attention_heads": 5}, "hidden_size 32 is not divisible by num_attention_heads 5"),
    ("bert", {"type_vocab_size": 0}, "type_vocab_size is 0"),
    ("bert", {"pad_token_id": 200}, "pad_token_id 200 is not a token of the vocabulary of 64"),
    ("bert", {"num_hiden_layers": 1}, "did you mean 'num_hidden_layers'"),
    # T5 (d_model, num_layers, num_heads, d_ff)
    ("t5", {"d_ff": DROP}, "d_ff is missing"),
    ("t5", {"num_heads": 0}, "num_heads is 0"),
    ("t5", {"num_layers": DROP}, "num_layers is missing"),
    # OPT (ffn_dim)
    ("opt", {"ffn_dim": DROP}, "ffn_dim is missing"),
    ("opt", {"ffn_dim": -1}, "ffn_dim is -1"),
    # Gemma 2 (an explicit head_dim: hidden need not divide by the heads, but it must be a size)
    ("gemma2", {"head_dim": -16}, "head_dim is -16"),
    ("gemma2", {"num_key_value_heads": 3}, "not divisible by num_key_value_heads 3"),
    # a rotary scaling transformers lacks: its config only logs it ('the model does not import:
    # KeyError: 'bogus'' before); a nested (per layer type) one too
    ("llama", {"rope_scaling": {"type": "bogus", "factor": 2.0}},
     "rope_scaling's rope_type 'bogus' is not one transformers has (default, dynamic, linear, llama3, longrope, "
     "proportional, yarn)"),
    ("gemma2", {"rope_parameters": {"rope_type": "ntk", "factor": 2.0}}, "rope_parameters's rope_type 'ntk'"),
    # an activation ACT2FN lacks ('the model does not import: KeyError: 'swish2'' before)
    ("llama", {"hidden_act": "swish2"}, "hidden_act 'swish2' is not an activation transformers has (did you mean "
                                        "'swish'?)"),
    ("gpt2", {"activation_function": "relu3"}, "activation_function 'relu3' is not an activation transformers has"),
]


def test_the_fuzz_set_is_large() -> None:
    assert len(BAD_CONFIGS) >= 40
    assert len({c for c, _ch, _m in BAD_CONFIGS}) >= 6


@pytest.mark.parametrize("which,change,says", BAD_CONFIGS,
                         ids=[f"{c}-{'-'.join(ch)}" for c, ch, _s in BAD_CONFIGS])
def test_bad_hf_config_is_one_line_naming_the_key(capsys: pytest.CaptureFixture[str], which: str,
                                                  change: dict[str, Any], says: str) -> None:
    cls, base = CLASSES[which]
    cfg = _mutated(base, change)
    line = one_line(capsys, ["plan", "--hf", cls, "--hf-config", json.dumps(cfg), "--mesh", "dp=2,tp=2"], says)
    assert line.startswith("spmdkit plan: ProgramError: --hf-config")


def test_good_tiny_configs_pass_the_checks() -> None:
    """Every base config of the fuzz set is accepted (the set's failures are its changes')."""
    from spmdkit.models.hf_checks import check_hf_config

    for cls, cfg in CLASSES.values():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # not even a warning
            check_hf_config(getattr(tf, cls).config_class, cfg, getattr(tf, cls))  # as hf.build calls it


@pytest.mark.parametrize("change,says", [
    ({"hidden_size": 0}, "hidden_size is 0"),
    ({"num_hidden_layers": DROP}, "num_hidden_layers is missing"),
    ({"num_attention_head": 4}, "did you mean 'num_attention_heads'"),
])
def test_bad_hf_config_through_run(capsys: pytest.CaptureFixture[str], change: dict[str, Any], says: str) -> None:
    pytest.importorskip("torch")
    from conftest import run_cli_line

    rc, line = run_cli_line(capsys, "--hf", "LlamaForCausalLM", "--hf-config", json.dumps(_mutated(LLAMA, change)),
                            "--mesh", "dp=2", "--strategy", "dp")
    assert rc == 2 and line.startswith("spmdkit run: ") and "--hf-config: " in line and says in line, line


def test_bad_hf_config_file_through_devices(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "config.json"
    f.write_text(json.dumps(_mutated(LLAMA, {"vocab_size": DROP})))
    one_line(capsys, ["plan", "--hf", "LlamaForCausalLM", "--hf-config", str(f), "--devices", "4"],
             "--hf-config: vocab_size is missing (LlamaConfig would take its default 32000 silently)")


def _published(name: str) -> dict[str, Any]:
    """A published config.json as the hub holds it (tests/data/hf/, shared with the import tests)."""
    return dict(json.loads((Path(__file__).parent / "data" / "hf" / f"{name}.json").read_text()))


#: Published config.json files (the keys as the hub holds them): accepted; those keys transformers
#: no longer reads are one warning naming them.
PUBLISHED: dict[str, tuple[dict[str, Any], set[str]]] = {
    "LlamaForCausalLM": (_published("llama-3-8b"), set()),
    "MixtralForCausalLM": (_published("mixtral-8x7b"), set()),
    "Qwen2ForCausalLM": (_published("qwen2.5-72b"), set()),
    "GPT2LMHeadModel": ({  # gpt2
        "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
        "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12,
        "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": None, "summary_first_dropout": 0.1,
        "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True,
        "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}}, "vocab_size": 50257}, set()),
    "BloomForCausalLM": ({  # bigscience/bloom (its n_embed read as hidden_size)
        "apply_residual_connection_post_layernorm": False, "attention_dropout": 0.0,
        "attention_softmax_in_fp32": True, "bias_dropout_fusion": True, "bos_token_id": 1, "eos_token_id": 2,
        "hidden_dropout": 0.0, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "masked_softmax_fusion": True,
        "model_type": "bloom", "n_embed": 14336, "n_layer": 70, "num_attention_heads": 112, "pad_token_id": 3,
        "pretraining_tp": 4, "slow_but_exact": False, "transformers_version": "4.21.0", "use_cache": True,
        "vocab_size": 250880}, {"attention_softmax_in_fp32", "bias_dropout_fusion", "masked_softmax_fusion"}),
    "DeepseekV3ForCausalLM": ({  # deepseek-ai/DeepSeek-V3
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, "aux_loss_alpha": 0.001,
        "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
        "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
        "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
        "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
        "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                                "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
        "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280},
        {"aux_loss_alpha", "ep_size", "moe_layer_freq", "scoring_func", "seq_aux", "topk_method"}),
    # deepseek-ai/DeepSeek-V2-Lite: q_lora_rank null (no low-rank query compression; the class
    # annotates it int | None and its attention tests it against None)
    "DeepseekV2ForCausalLM": (_published("deepseek-v2-lite"), {"aux_loss_alpha", "moe_layer_freq", "scoring_func",
                                                                "seq_aux"}),
    # google/gemma-3-1b-pt: sliding_window_pattern 6 (Gemma3TextConfig reads it from its kwargs)
    "Gemma3ForCausalLM": (_published("gemma-3-1b"), set()),
    "T5ForConditionalGeneration": ({  # t5-base
        "architectures": ["T5ForConditionalGeneration"], "d_ff": 3072, "d_kv": 64, "d_model": 768,
        "decoder_start_token_id": 0, "dropout_rate": 0.1, "eos_token_id": 1, "initializer_factor": 1.0,
        "is_encoder_decoder": True, "layer_norm_epsilon": 1e-06, "model_type": "t5", "n_positions": 512,
        "num_heads": 12, "num_layers": 12, "output_past": True, "pad_token_id": 0,
        "relative_attention_num_buckets": 32, "vocab_size": 32128}, {"n_positions"}),
}


@pytest.mark.parametrize("cls", sorted(PUBLISHED))
def test_published_configs_pass(cls: str) -> None:
    from spmdkit.models.hf_checks import check_hf_config

    cfg, ignored = PUBLISHED[cls]
    cfg = {k: v for k, v in cfg.items() if k != "architectures"}  # hf.build drops it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_hf_config(getattr(tf, cls).config_class, cfg, getattr(tf, cls))  # as hf.build calls it
    notes = [str(w.message) for w in caught if str(w.message).startswith("--hf-config")]
    mtp = [n for n in notes if "multi-token-prediction" in n]
    # DeepSeek-V3's num_nextn_predict_layers 1: HF's model has no MTP layer, said so
    assert mtp == (["--hf-config: num_nextn_predict_layers 1: the HF model builds no multi-token-prediction "
                    "layers, so the plan has none (a catalog model or --model-config with this config plans them)"]
                   if cls == "DeepseekV3ForCausalLM" else [])
    notes = [n for n in notes if n not in mtp]
    if not ignored:
        assert notes == []
    else:
        assert len(notes) == 1 and all(repr(k) in notes[0] for k in ignored), notes


def test_null_q_lora_rank_and_the_sliding_window_pattern_build_their_models() -> None:
    """DeepSeek-V2-Lite's q_lora_rank null builds the plain query projection (no q_a_proj), and
    Gemma 3's sliding_window_pattern 2 makes every second layer global; both were refused
    ('q_lora_rank is null; DeepseekV2Config needs an integer >= 1', "'sliding_window_pattern' is
    not a key of Gemma3TextConfig (did you mean '_sliding_window_pattern'?)")."""
    from spmdkit.models.hf import build

    ds = {k: v for k, v in _published("deepseek-v2-lite").items() if k != "architectures"}
    ds.update(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
              kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, vocab_size=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        attn = build("DeepseekV2ForCausalLM", ds).model.layers[0].self_attn
        gemma = build("Gemma3ForCausalLM", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
                                            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                                            "vocab_size": 64, "sliding_window_pattern": 2})
    assert tuple(attn.q_proj.weight.shape) == (4 * 16, 32) and attn.q_a_proj is None
    assert gemma.config.layer_types == ["sliding_attention", "full_attention"] * 2


def test_another_models_config_and_an_auto_class_are_refused_naming_the_class(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Mixtral's config.json given to --hf LlamaForCausalLM planned a dense Llama (its expert keys
    one 'ignored' warning); an auto class was 'transformers has no model class'."""
    mixtral = str(Path(__file__).parent / "data" / "hf" / "mixtral-8x7b.json")
    one_line(capsys, ["plan", "--hf", "LlamaForCausalLM", "--hf-config", mixtral, "--mesh", "dp=2", "--strategy", "dp"],
             "--hf-config: model_type 'mixtral' is not LlamaForCausalLM's (LlamaConfig: 'llama'); the config is another "
             "model's, whose keys LlamaConfig would drop (the config's architectures: MixtralForCausalLM)")
    one_line(capsys, ["run", "--hf", "LlamaForCausalLM", "--hf-config", json.dumps({**LLAMA, "model_type": "mistral"}),
                      "--mesh", "dp=2", "--strategy", "dp"], "model_type 'mistral' is not LlamaForCausalLM's")
    one_line(capsys, ["plan", "--hf", "AutoModelForCausalLM", "--hf-config", json.dumps({**LLAMA, "model_type": "qwen2"}),
                      "--mesh", "dp=2", "--strategy", "dp"],
             "hf: AutoModelForCausalLM is one of transformers' auto classes, which pick a model class by the config's "
             "model_type; give the model class itself (model_type 'qwen2': Qwen2ForCausalLM)")
    rc = main(["plan", "--hf", "LlamaForCausalLM", "--hf-config", json.dumps({**LLAMA, "model_type": "llama"}),
               "--mesh", "dp=2", "--strategy", "dp", "--json"])
    assert rc == 0, capsys.readouterr().err[-1000:]


def test_the_title_says_the_dtype_planned_and_the_configs_own(capsys: pytest.CaptureFixture[str]) -> None:
    """A published config.json says torch_dtype bfloat16; --dtype's default float32 planned it at twice
    the bytes with no word of either dtype in the report."""
    cfg = json.dumps({**LLAMA, "torch_dtype": "bfloat16"})
    assert main(["plan", "--hf", "LlamaForCausalLM", "--hf-config", cfg, "--mesh", "dp=2", "--strategy", "dp"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == ["LlamaForCausalLM (HuggingFace), batch 2, seq 16, float32; strategy dp",
                       "note: the config's torch_dtype is bfloat16; the model is planned in float32 (--dtype bfloat16 "
                       "plans it as the config says)"]
    assert main(["plan", "--hf", "LlamaForCausalLM", "--hf-config", cfg, "--mesh", "dp=2", "--strategy", "dp",
                 "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "LlamaForCausalLM (HuggingFace), batch 2, seq 16, bfloat16; strategy dp"
    assert not out[1].startswith("note: the config's torch_dtype")


def test_unknown_key_is_a_warning_line_and_the_model_plans(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = {**LLAMA, "my_custom_flag": 1}
    rc = main(["plan", "--hf", "LlamaForCausalLM", "--hf-config", json.dumps(cfg), "--mesh", "dp=2", "--strategy", "dp",
               "--json"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err[-1000:]
    assert ("spmdkit plan: warning: --hf-config: LlamaConfig does not know 'my_custom_flag': ignored "
            "(check the spelling)") in cap.err.splitlines()


def test_a_key_the_modeling_code_reads_is_not_called_ignored(capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen3MoeConfig has no head_dim argument, but Qwen3-MoE's attention reads
    ``getattr(config, "head_dim", hidden // heads)`` (Qwen3-30B-A3B's config.json: 128, not
    2048 / 32): the key shapes the model, so no "ignored" warning; a key nothing reads still is."""
    from spmdkit.models.hf import build

    cfg = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 16, "num_experts": 4,
           "num_experts_per_tok": 2, "vocab_size": 128, "max_window_layers": 1}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = build("Qwen3MoeForCausalLM", cfg)
    notes = [str(w.message) for w in caught if str(w.message).startswith("--hf-config")]
    assert notes == ["--hf-config: Qwen3MoeConfig does not know 'max_window_layers': ignored (check the spelling)"]
    assert tuple(model.model.layers[0].self_attn.q_proj.weight.shape) == (4 * 16, 32)  # head_dim 16, not 32 / 4
    with pytest.raises(ProgramError, match=r"'head_dims' is not a key of Qwen3MoeConfig \(did you mean 'head_dim'\?\)"):
        build("Qwen3MoeForCausalLM", {**cfg, "head_dims": 16})


def test_hf_config_file_that_is_no_text_or_a_model_folder(tmp_path: Path) -> None:
    """--hf-config: a file that is not UTF-8 text is one line naming it (it was "the model does not
    import: UnicodeDecodeError"); a model's folder is read as its config.json; a folder without
    one is named."""
    from spmdkit.models.hf import load_config

    binary = tmp_path / "weights.bin"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(200, 256)))
    with pytest.raises(ProgramError, match=r"^hf: config '.*weights\.bin' is not UTF-8 text \(.* at byte 8\): "
                                           r"give the model's config\.json$"):
        load_config(str(binary))
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert load_config(str(tmp_path)) == LLAMA
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ProgramError, match=r"^hf: config '.*empty' is a folder with no config\.json in it$"):
        load_config(str(empty))


# -- tp that does not split the model evenly ---------------------------------------------------------


def test_tp_problem_names_the_count() -> None:
    llama7 = PRESETS["llama-7b"]
    assert tp_problem(llama7, 3) == "tp=3 does not divide the model's 32 attention heads; a tp of 2, 4, 8, 16 or 32 does"
    assert tp_problem(llama7, 8) is None and tp_problem(llama7, 1) is None
    kv3 = ModelConfig("llama", 1, 96, 12, 4, 96, 96)
    assert tp_problem(kv3, 6) == ("tp=6 does not divide the model's 4 kv heads (each rank must hold whole kv heads, "
                                  "or a share of one that tp divides evenly); a tp of 2 or 4 does")
    assert tp_problem(PRESETS["llama-70b"], 16) is None  # 8 kv heads, each over 2 ranks: planned, and said so
    assert tp_notes(PRESETS["llama-70b"], 16) == [
        "the model's 8 kv heads are fewer than tp=16: each is split over 2 ranks and the k / v projections are "
        "all-gathered before attention (Megatron-Core needs tp to divide the kv heads)"]
    assert tp_notes(PRESETS["llama-70b"], 8) == [] and tp_notes(PRESETS["llama-7b"], 16) == []
    odd_ffn = ModelConfig("llama", 1, 64, 4, None, 102, 64)
    assert "FFN hidden size 102" in str(tp_problem(odd_ffn, 4))
    odd_vocab = ModelConfig("llama", 1, 64, 4, None, 128, 50257)
    assert "vocabulary of 50257" in str(tp_problem(odd_vocab, 2))
    assert tp_problem(PRESETS["tiny-llama"].with_(seq=6), 4, sp=True) is not None  # 6 tokens over 4 ranks
    assert tp_problem(PRESETS["tiny-llama"].with_(seq=6), 4) is None  # 4 heads, 2 kv heads (a note), ffn 32, vocab 64
    assert tp_problem(PRESETS["tiny-llama"].with_(seq=7), 2) is None
    assert "sequence of 7 tokens" in str(tp_problem(PRESETS["tiny-llama"].with_(seq=7), 2, sp=True))


@pytest.mark.parametrize("argv,says", [
    (["--model", "tiny-llama", "--mesh", "tp=3"], "--mesh tp=3: megatron splits evenly or not at all: tp=3 does not "
                                                  "divide the model's 4 attention heads; a tp of 2 or 4 does"),
    (["--model", "llama-7b", "--mesh", "dp=2,tp=3", "--layers", "1"], "the model's 32 attention heads"),
    (["--model-config", '{"layers": 1, "hidden": 96, "heads": 12, "kv_heads": 4, "ffn": 96, "vocab": 96}', "--mesh",
      "tp=6"], "--mesh tp=6: megatron splits evenly or not at all: tp=6 does not divide the model's 4 kv heads"),
    (["--model", "tiny-llama", "--mesh", "tp=2", "--strategy", "megatron,sp", "--seq", "7"],
     "the model's sequence of 7 tokens that sequence parallel splits"),
    (["--model-config", '{"layers": 1, "hidden": 64, "heads": 4, "ffn": 128, "vocab": 101}', "--mesh", "tp=2"],
     "--mesh tp=2: megatron splits evenly or not at all: tp=2 does not divide the model's vocabulary of 101"),
    (["--model-config", '{"layers": 1, "hidden": 64, "heads": 4, "ffn": 102, "vocab": 128}', "--mesh", "tp=4"],
     "--mesh tp=4: megatron splits evenly or not at all: tp=4 does not divide the model's FFN hidden size 102"),
    (["--model", "tiny-gpt2", "--mesh", "pp=2,tp=3"], "the model's 4 attention heads"),
])
def test_uneven_tp_is_refused_for_presets_and_configs(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                      says: str) -> None:
    one_line(capsys, ["plan", *argv], says)


@pytest.mark.parametrize("change,mesh,says", [
    ({"num_attention_heads": 8, "num_key_value_heads": 8}, "tp=3", "tp=3"),  # the vocabulary, first: 64 % 3
    ({"vocab_size": 96, "num_attention_heads": 2, "num_key_value_heads": 2}, "tp=3", "not divisible by tp=3"),
    ({"vocab_size": 96, "num_key_value_heads": 4}, "tp=3", "not divisible by tp=3"),
    ({"intermediate_size": 66, "vocab_size": 66, "num_key_value_heads": 4}, "tp=4", "not divisible by tp=4"),
])
def test_uneven_tp_is_refused_for_hf(capsys: pytest.CaptureFixture[str], change: dict[str, Any], mesh: str,
                                     says: str) -> None:
    cfg = _mutated(LLAMA, change)
    line = one_line(capsys, ["plan", "--hf", "LlamaForCausalLM", "--hf-config", json.dumps(cfg), "--mesh", mesh], says)
    assert "--strategy megatron" in line


def test_fewer_kv_heads_than_tp_is_a_warning_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--model", "tiny-llama", "--mesh", "dp=2,tp=4", "--json"])
    cap = capsys.readouterr()
    assert rc == 0
    assert cap.err.splitlines() == [
        "spmdkit plan: warning: --mesh tp=4: the model's 2 kv heads are fewer than tp=4: each is split over 2 ranks "
        "and the k / v projections are all-gathered before attention (Megatron-Core needs tp to divide the kv heads)"]


def test_a_devices_searchs_warning_names_the_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    """--devices, not --mesh: the note of the configuration with tp=4 (tiny-llama's 2 kv heads) names
    it; it said '--mesh tp=4', a flag the user did not give."""
    rc = main(["plan", "--model", "tiny-llama", "--devices", "4", "--json"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err[-2000:]
    notes = [ln for ln in cap.err.splitlines() if "warning:" in ln]
    assert notes == [
        "spmdkit plan: warning: configuration dp=1,tp=4: the model's 2 kv heads are fewer than tp=4: each is split "
        "over 2 ranks and the k / v projections are all-gathered before attention (Megatron-Core needs tp to divide "
        "the kv heads)"], notes


def test_devices_never_proposes_an_uneven_tp(capsys: pytest.CaptureFixture[str]) -> None:
    """12 attention heads in 4 kv groups on 12 devices: tp 3 and 6 divide the heads but split
    the kv heads unevenly; they are refused before planning, naming the count, and every
    configuration planned has a tp that 4 divides or that divides 4."""
    cfg = {"layers": 2, "hidden": 96, "heads": 12, "kv_heads": 4, "ffn": 192, "vocab": 96, "seq": 16, "batch": 12}
    rc = main(["plan", "--model-config", json.dumps(cfg), "--devices", "12", "--json"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err[-2000:]
    search = json.loads(cap.out.strip().splitlines()[-1])["search"]
    assert search["top"] and all(4 % c["tp"] == 0 or c["tp"] % 4 == 0 for c in search["top"])
    why = {r["tp"]: r["reason"] for r in search["refused"] if 4 % r["tp"] and r["tp"] % 4}
    assert set(why) == {3, 6}, why
    assert why[3] == ("tp=3 does not divide the model's 4 kv heads (each rank must hold whole kv heads, or a share of "
                      "one that tp divides evenly); a tp of 2 or 4 does")


# -- output files -----------------------------------------------------------------------------------


def _specials(tmp_path: Path) -> dict[str, str]:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    target = tmp_path / "target.txt"
    target.write_text("keep me")
    link = tmp_path / "link"
    link.symlink_to(target)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    folder = tmp_path / "folder"
    folder.mkdir()
    dir_link = tmp_path / "dir_link"
    dir_link.symlink_to(folder)
    return {"fifo": str(fifo), "link": str(link), "dangling": str(dangling), "folder": str(folder),
            "dir_link": str(dir_link), "devnull": os.devnull}


def _unchanged(tmp_path: Path) -> None:
    assert (tmp_path / "fifo").is_fifo()
    assert (tmp_path / "link").is_symlink() and (tmp_path / "target.txt").read_text() == "keep me"
    assert (tmp_path / "dangling").is_symlink() and not (tmp_path / "nowhere").exists()
    assert (tmp_path / "dir_link").is_symlink() and list((tmp_path / "folder").iterdir()) == []
    assert os.path.exists(os.devnull) and not os.path.isfile(os.devnull)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]  # no partial file left


def test_output_problem_says_what_the_path_is(tmp_path: Path) -> None:
    s = _specials(tmp_path)
    assert output_problem(s["fifo"]).startswith("is a FIFO (named pipe), not a regular file")  # type: ignore[union-attr]
    assert output_problem(s["link"]).startswith("is a symbolic link")  # type: ignore[union-attr]
    assert output_problem(s["dangling"]).startswith("is a symbolic link")  # type: ignore[union-attr]
    assert output_problem(s["dir_link"]).startswith("is a symbolic link")  # type: ignore[union-attr]
    assert output_problem(s["folder"]).startswith("is a directory")  # type: ignore[union-attr]
    assert output_problem(os.devnull).startswith("is a character device")  # type: ignore[union-attr]
    assert output_problem(str(tmp_path / "target.txt")) is None
    assert output_problem(str(tmp_path / "new.json")) is None
    assert output_problem(str(tmp_path / "no" / "new.json")).startswith("is in no existing directory")  # type: ignore[union-attr]
    assert output_problem(str(tmp_path / "target.txt" / "x")).startswith("cannot write it: Not a directory")  # type: ignore[union-attr]
    assert output_problem("") == "is empty: give a file name"


def test_write_atomic_refuses_all_but_regular_files(tmp_path: Path) -> None:
    s = _specials(tmp_path)
    for path in s.values():
        with pytest.raises(NotRegularFile):
            write_atomic(path, b"data")
    _unchanged(tmp_path)
    write_atomic(str(tmp_path / "target.txt"), b"new")  # a regular file is replaced whole
    assert (tmp_path / "target.txt").read_bytes() == b"new"
    os.chmod(tmp_path / "target.txt", 0o600)
    write_atomic(str(tmp_path / "target.txt"), b"newer")  # its mode kept
    assert (tmp_path / "target.txt").stat().st_mode & 0o777 == 0o600


def test_write_atomic_leaves_nothing_when_the_path_turns_into_a_fifo(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is made again just before the rename: a FIFO made meanwhile is not replaced."""
    import spmdkit.io.atomic as atomic

    path = tmp_path / "out.json"
    real = atomic.output_problem
    calls = []

    def racing(p: str) -> str | None:
        calls.append(p)
        if len(calls) == 2:
            os.mkfifo(p)
        return real(p)

    monkeypatch.setattr(atomic, "output_problem", racing)
    with pytest.raises(NotRegularFile):
        write_atomic(str(path), b"data")
    assert path.is_fifo() and [p.name for p in tmp_path.iterdir()] == ["out.json"]


@pytest.mark.parametrize("kind", ["fifo", "link", "dangling", "folder", "dir_link", "devnull"])
def test_html_refuses_special_paths(capsys: pytest.CaptureFixture[str], tmp_path: Path, kind: str) -> None:
    path = _specials(tmp_path)[kind]
    line = one_line(capsys, ["plan", "--model", "tiny-llama", "--mesh", "dp=2", "--html", path], f"--html {path!r}")
    assert ("is a directory" if kind == "folder" else "not a regular file") in line
    _unchanged(tmp_path)


@pytest.mark.parametrize("kind", ["fifo", "link", "dangling", "folder", "devnull"])
def test_export_refuses_special_paths(capsys: pytest.CaptureFixture[str], tmp_path: Path, kind: str) -> None:
    path = _specials(tmp_path)[kind]
    line = one_line(capsys, ["plan", "--model", "tiny-llama", "--mesh", "dp=2", "--export", "dtensor", path],
                    "--export dtensor")
    assert path in line and ("is a folder" if kind == "folder" else "not a regular file") in line
    _unchanged(tmp_path)


def test_html_and_export_write_regular_and_new_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    old = tmp_path / "old.html"
    old.write_text("old")
    new = tmp_path / "new.json"
    rc = main(["plan", "--model", "tiny-llama", "--mesh", "dp=2", "--strategy", "dp", "--html", str(old),
               "--export", "dtensor", str(new)])
    capsys.readouterr()
    assert rc == 0
    assert old.read_text().startswith("<!DOCTYPE html>") and json.loads(new.read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.json", "old.html"]


def test_calibrate_out_refuses_special_paths(tmp_path: Path) -> None:
    from spmdkit.cli.calibrate import check_out

    for path in _specials(tmp_path).values():
        with pytest.raises(ProgramError, match="--out"):
            check_out(path)
    assert check_out(str(tmp_path / "dev.json")) == str(tmp_path / "dev.json")


def test_verify_grows_the_tiny_model_to_split_evenly(capsys: pytest.CaptureFixture[str]) -> None:
    """--verify simulates the tiny model of the arch; tiny-llama's 4 heads do not split over tp=8,
    so it is grown (heads 8, the head size 4 kept) and the plan verified, not refused."""
    pytest.importorskip("numpy")
    from spmdkit.models.zoo import preset
    from spmdkit.sim.verify_plan import tiny_for_mesh

    assert tiny_for_mesh("tiny-llama", "dp=2,tp=4", "megatron") == "tiny-llama"
    grown = preset(tiny_for_mesh("tiny-llama", "tp=8", "megatron"))
    assert (grown.heads, grown.n_kv, grown.hidden, grown.ffn, grown.vocab, grown.seq) == (8, 2, 32, 32, 64, 8)
    assert grown.name == "tiny-llama sized for tp=8" and tp_problem(grown, 8) is None
    assert preset(tiny_for_mesh("tiny-llama", "tp=3", "megatron,sp")).seq == 24
    rc = main(["plan", "--model", "llama-7b", "--mesh", "tp=8", "--layers", "1", "--verify"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err[-1000:]
    assert "verify: tiny-llama sized for tp=8 with the same mesh and strategy, simulated on 8 ranks" in cap.out
    assert "all equal" in cap.out and cap.err == ""


@pytest.mark.parametrize("model", ["mixtral-8x7b", "deepseek-v3", "gemma2-9b", "qwen3-30b-a3b", "gpt3-175b"])
def test_tiny_for_mesh_keeps_the_variant(model: str) -> None:
    """The grown tiny model keeps its architecture's variant (MoE, MLA, an explicit head size) and
    splits evenly over tp=8 (sp: its sequence too)."""
    pytest.importorskip("numpy")
    from spmdkit.models.zoo import preset, tiny_like
    from spmdkit.sim.verify_plan import tiny_for_mesh

    tiny = preset(tiny_like(preset(model)))
    grown = preset(tiny_for_mesh(tiny_like(preset(model)), "dp=2,tp=8", "megatron,sp"))
    assert tp_problem(grown, 8, sp=True) is None
    for f in ("arch", "experts", "kv_lora_rank", "head_dim", "activation", "norm", "positions"):
        assert getattr(grown, f) == getattr(tiny, f), f
    assert grown.hdim == tiny.hdim and grown.heads % 8 == 0


def test_the_keys_a_modeling_module_reads_are_scanned_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """hf_checks reads a model's modeling module for the config keys it reads (``config.KEY``,
    ``getattr(config, "KEY", ...)``) once a process: a second config check of the model (``--devices``
    checks once a cp layout) does not read the module's source again."""
    import importlib.util
    import inspect
    import sys

    from spmdkit.models import hf_checks

    path = tmp_path / "modeling_scan_once.py"
    path.write_text("class M:\n    def __init__(self, config):\n        self.h = config.hidden_size\n"
                    "        self.d = getattr(config, 'head_dim', 8)\n")
    spec = importlib.util.spec_from_file_location("modeling_scan_once", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "modeling_scan_once", mod)
    spec.loader.exec_module(mod)
    reads: list[object] = []
    real = inspect.getsource
    monkeypatch.setattr(hf_checks.inspect, "getsource", lambda obj: reads.append(obj) or real(obj))
    assert hf_checks._read_by_model(mod.M) == {"hidden_size", "head_dim"}
    assert hf_checks._read_by_model(mod.M) == {"hidden_size", "head_dim"}
    assert reads == [mod]
