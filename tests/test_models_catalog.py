"""The catalog of published architectures (``--model NAME``, ``spmdkit models``) and HF
config.json files given to ``--model-config``: every dense model's parameter count from its
built program against the figure its source publishes, real config.json files against the
catalog's entries, the CLI. The MoE and MLA models: tests/test_models_catalog_moe.py."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest

from spmdkit.cli import main
from spmdkit.core.errors import ProgramError
from spmdkit.cost.memory import memory_per_device
from spmdkit.models import catalog
from spmdkit.models.hf_config import MODEL_TYPES, hf_fields, is_hf_config
from spmdkit.models.params import count_params, mismatches, parameters
from spmdkit.models.zoo import PRESETS, ModelConfig, build_model, config_from_json, model_label, preset
from spmdkit.planner.planning import plan_preset

HF_DATA = Path(__file__).parent / "data" / "hf"
DENSE = [n for n, e in catalog.entries().items() if not e.fields.get("experts")]
MOE = [n for n, e in catalog.entries().items() if e.fields.get("experts")]


def published_ok(name: str) -> list[tuple[str, str, int]]:
    """(figure, as stated, as counted) of every published figure of ``name`` that the count,
    rounded or truncated to the figure's last stated digit, is not."""
    e = catalog.lookup(name)
    assert e is not None
    return mismatches(e, count_params(preset(name)))


def tp_for(cfg: ModelConfig) -> int:
    """The largest of 8, 4, 2 that divides the heads, the kv heads, the MLP and the vocabulary."""
    sizes = [cfg.heads, cfg.ffn, cfg.expert_ffn, cfg.vocab] + ([] if cfg.mla else [cfg.n_kv])
    return next(t for t in (8, 4, 2, 1) if all(s % t == 0 for s in sizes))


# -- the data ----------------------------------------------------------------------------------


def test_the_catalog_holds_the_published_architectures() -> None:
    names = set(catalog.names())
    for n in ("llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "llama3.1-405b", "mistral-7b",
              "mixtral-8x7b", "mixtral-8x22b", "qwen2.5-7b", "qwen2.5-72b", "qwen3-8b", "qwen3-32b", "qwen3-30b-a3b",
              "qwen3-235b-a22b", "deepseek-v2-lite", "deepseek-v3", "gemma2-9b", "gemma2-27b", "gemma3-27b",
              "phi3-mini", "phi3-medium", "gpt3-175b", "megatron-gpt-1.7b", "megatron-gpt-1t", "bloom-176b",
              "nemotron4-340b"):
        assert n in names
    assert len([n for n in names if n.startswith("megatron-gpt-")]) == 10
    assert catalog.lookup("llama3-405b") is catalog.lookup("llama3.1-405b")
    assert not set(names) & set(PRESETS)  # presets keep their names and meaning


@pytest.mark.parametrize("name", catalog.names())
def test_every_entry_is_a_valid_config_with_its_source(name: str) -> None:
    e = catalog.lookup(name)
    assert e is not None and e.source.startswith("https://") and e.where.startswith("https://")
    cfg = preset(name)
    cfg.check()
    assert (cfg.name, cfg.batch, cfg.dtype) == (name, 1, "bfloat16")
    assert model_label(name) == name


def test_figures_are_read_to_their_stated_precision() -> None:
    assert catalog.figure("8.03B") == (8.03e9, pytest.approx(5e6))
    assert catalog.figure("671B") == (671e9, 5e8)
    assert catalog.figure("1008.0B") == (1008e9, pytest.approx(5e7))
    assert catalog.figure("25600M") == (25600e6, 50e6)  # trailing zeros of a whole number: not significant
    assert catalog.figure("176247271424") == (176247271424, 0.5)
    assert catalog.matches("7.61B", 7_615_616_512) and catalog.matches("7.62B", 7_615_616_512)  # truncated, rounded
    assert not catalog.matches("7.61B", 7_620_000_001) and not catalog.matches("7.61B", 7_604_999_999)
    with pytest.raises(ProgramError, match=r"not a number like 8\.03B"):
        catalog.figure("about 8B")


def test_the_megatron_series_is_table_1_of_narayanan_et_al() -> None:
    """Table 1 of arXiv 2104.04473: (heads, hidden, layers) and the parameters, which their
    formula 12 l h^2 (1 + 13 / (12 h) + (V + s) / (12 l h)) gives (V 51200, s 2048)."""
    table = {"1.7b": (24, 2304, 24), "3.6b": (32, 3072, 30), "7.5b": (32, 4096, 36), "18.4b": (48, 6144, 40),
             "39.1b": (64, 8192, 48), "76.1b": (80, 10240, 60), "145.6b": (96, 12288, 80),
             "310.1b": (128, 16384, 96), "529.6b": (128, 20480, 105), "1t": (160, 25600, 128)}
    for key, (a, h, layers) in table.items():
        c = preset(f"megatron-gpt-{key}")
        assert (c.heads, c.hidden, c.layers, c.vocab, c.seq, c.ffn) == (a, h, layers, 51200, 2048, 4 * h)
        formula = 12 * layers * h * h * (1 + 13 / (12 * h) + (51200 + 2048) / (12 * layers * h))
        value, half = catalog.figure(catalog.entries()[f"megatron-gpt-{key}"].published["total"])
        assert abs(formula - value) <= half


# -- parameter counts against the published figures -------------------------------------------


@pytest.mark.parametrize("name", DENSE)
def test_dense_parameter_count_matches_the_published_figure(name: str) -> None:
    assert published_ok(name) == []


def test_exact_counts_where_the_source_states_them_exactly() -> None:
    """HF's safetensors count of Meta-Llama-3-8B is 8,030,261,248 and of Llama-3.1-405B
    405,853,388,800; BLOOM's model card states 176,247,271,424."""
    assert count_params(preset("llama3-8b")).total == 8_030_261_248
    assert count_params(preset("llama3.1-405b")).total == 405_853_388_800
    assert count_params(preset("bloom-176b")).total == 176_247_271_424


def test_the_count_scales_two_small_builds_exactly() -> None:
    cfg = preset("qwen2.5-7b").with_(layers=5, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=300, seq=16)
    full = parameters(build_model(cfg, validate=False, check_rules=False).program)
    pc = count_params(cfg)
    assert pc.total == sum(full.values())
    assert pc.embedding == 2 * 300 * 64 and pc.active == pc.total


# -- HF config.json -> the catalog's config --------------------------------------------------

def _published(name: str) -> dict[str, Any]:
    """A published config.json as the hub holds it (tests/data/hf/, shared with the import tests)."""
    return dict(json.loads((HF_DATA / f"{name}.json").read_text()))


LLAMA3_8B = _published("llama-3-8b")
MIXTRAL_8X7B = _published("mixtral-8x7b")
DEEPSEEK_V3 = _published("deepseek-v3")
QWEN25_72B = _published("qwen2.5-72b")


@pytest.mark.parametrize(("hf", "name", "seq", "notes"), [
    (LLAMA3_8B, "llama3-8b", 8192, []),
    (MIXTRAL_8X7B, "mixtral-8x7b", 32768, []),
    # num_nextn_predict_layers 1 is the catalog's mtp_layers 1 (models/zoo_mtp.py), not a note
    (DEEPSEEK_V3, "deepseek-v3", 163840, ["quantization_config"]),
    (QWEN25_72B, "qwen2.5-72b", 131072, []),
])
def test_a_real_config_json_is_the_catalog_model(hf: dict, name: str, seq: int, notes: list[str]) -> None:
    """The published config.json maps to the catalog's entry (its seq the config's context,
    max_position_embeddings, where the catalog's is the training context)."""
    assert is_hf_config(hf)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = config_from_json(json.dumps(hf))
        assert model_label(json.dumps(hf)) == hf["architectures"][0] + " (HF config)"
    said = " ".join(str(w.message) for w in caught)
    assert all(n in said for n in notes) and bool(caught) == bool(notes)
    assert cfg.seq == seq
    label = hf["architectures"][0] + " (HF config)"
    assert cfg == preset(name).with_(seq=seq, name=label)
    assert cfg.mtp_layers == hf.get("num_nextn_predict_layers", 0) and "nextn" not in said


def test_hf_config_maps_the_variants() -> None:
    gemma2 = {"model_type": "gemma2", "hidden_size": 3584, "num_hidden_layers": 42, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 256, "intermediate_size": 14336, "vocab_size": 256000,
              "max_position_embeddings": 8192, "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096,
              "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256}
    with pytest.warns(UserWarning, match=r"sliding_window 4096 .*attn_logit_softcapping 50.0; "
                                         r"final_logit_softcapping 30.0"):
        f = hf_fields(gemma2)
    assert ModelConfig(**f) == preset("gemma2-9b").with_(name="gemma2 (HF config)")
    bloom = {"model_type": "bloom", "hidden_size": 14336, "n_layer": 70, "n_head": 112, "vocab_size": 250880}
    assert ModelConfig(**hf_fields(bloom)) == preset("bloom-176b").with_(name="bloom (HF config)")
    nemotron = {"model_type": "nemotron", "hidden_size": 18432, "num_hidden_layers": 96, "num_attention_heads": 96,
                "num_key_value_heads": 8, "intermediate_size": 73728, "vocab_size": 256000,
                "max_position_embeddings": 4096, "hidden_act": "relu2", "partial_rotary_factor": 0.5}
    assert ModelConfig(**hf_fields(nemotron)) == preset("nemotron4-340b").with_(name="nemotron (HF config)")
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257,
            "n_positions": 1024, "activation_function": "gelu_new", "torch_dtype": "float32"}
    c = ModelConfig(**hf_fields(gpt2))
    assert (c.arch, c.ffn, c.seq, c.tied_embeddings, c.linear_bias, c.act, c.dtype) == \
        ("gpt2", 3072, 1024, True, True, "gelu", "float32")


def test_hf_config_refuses_an_unknown_key_and_a_missing_size() -> None:
    typo = {**LLAMA3_8B, "num_attention_head": 32}
    with pytest.raises(ProgramError, match="HF key 'num_attention_head' is not a key of a llama config; did you "
                                           "mean 'num_attention_heads'"):
        config_from_json(json.dumps(typo))
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
        short = {k: v for k, v in LLAMA3_8B.items() if k != key}
        with pytest.raises(ProgramError, match=f"HF key '{key}' is missing"):
            config_from_json(json.dumps(short))
    for key, bad in (("hidden_size", 64.5), ("num_hidden_layers", 0), ("num_attention_heads", "32"),
                     ("tie_word_embeddings", "no")):
        with pytest.raises(ProgramError, match=f"HF key '{key}'"):
            config_from_json(json.dumps({**LLAMA3_8B, key: bad}))
    with pytest.raises(ProgramError, match="model_type: 'llama4' is not one spmdkit maps"):
        config_from_json(json.dumps({**LLAMA3_8B, "model_type": "llama4"}))
    with pytest.raises(ProgramError, match="mixtral config; did you mean 'num_local_experts'"):
        config_from_json(json.dumps({**MIXTRAL_8X7B, "num_local_expert": 8}))


def test_transformers_default_configs_of_every_model_type_map() -> None:
    """The keys transformers writes today for each model type are known (a default config of
    each, as ``save_pretrained`` would write it)."""
    transformers = pytest.importorskip("transformers")
    for mt in MODEL_TYPES:
        d = transformers.AutoConfig.for_model(mt).to_dict()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                f = hf_fields(d)
            except ProgramError as exc:  # deepseek_v2's default leaves num_experts_per_tok None
                assert "is missing" in str(exc), mt
                continue
        assert f["layers"] == d.get("num_hidden_layers", d.get("n_layer")), mt


# -- the command line --------------------------------------------------------------------------


def test_plan_takes_a_catalog_name_and_its_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama3-8b", "--layers", "2", "--seq", "512", "--mesh", "tp=4", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert "llama3-8b" in got["title"] and "2 layers" in got["title"] and "seq 512" in got["title"]
    assert got["tensors"]["layers.0.wk"]["shape"] == [4096, 1024]
    assert got["tensors"]["layers.0.wk"]["placements"] == "[tp:S(1)]"
    assert "layers.2.wq" not in got["tensors"]


def test_an_unknown_model_names_the_presets_the_catalog_and_the_closest(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama3-8bb", "--mesh", "tp=2"]) == 2
    err = capsys.readouterr().err
    assert "no preset 'llama3-8bb' nor catalog model" in err and "llama-7b" in err
    assert "`spmdkit models` lists the" in err and "did you mean 'llama3-8b'" in err


def test_a_hf_config_file_plans_with_one_warning_line(tmp_path: pytest.TempPathFactory,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"  # type: ignore[operator]
    path.write_text(json.dumps({**LLAMA3_8B, "model_type": "mistral", "sliding_window": 4096,
                                "architectures": ["MistralForCausalLM"]}))
    assert main(["plan", "--model-config", str(path), "--layers", "1", "--mesh", "tp=2"]) == 0
    cap = capsys.readouterr()
    lines = [ln for ln in cap.err.splitlines() if "warning" in ln]
    assert lines == ["spmdkit plan: warning: --model-config: MistralForCausalLM (HF config): not modelled: "
                     "sliding_window 4096 (planned as full causal attention)"]
    assert "MistralForCausalLM (HF config)" in cap.out


def test_models_lists_the_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "llama3", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["llama3-8b", "llama3-70b", "llama3.1-8b", "llama3.1-70b", "llama3.1-405b"]
    assert rows[0]["params"]["total"] == 8_030_261_248 and rows[0]["published"]["total"] == "8.03B"
    assert rows[-1]["aliases"] == ["llama3-405b"] and rows[-1]["config"]["layers"] == 126
    assert main(["models", "--wide", "gemma"]) == 0
    out = capsys.readouterr().out
    assert "gemma2-9b" in out and "9.24B" in out and "llama" not in out
    # the MTP module apart from the count the report states (671B, 37B active)
    assert main(["models", "--wide", "deepseek-v3", "--json"]) == 0
    (v3,) = json.loads(capsys.readouterr().out)
    assert (v3["params"]["mtp"], v3["params"]["total"] - v3["params"]["mtp"]) == (11_610_067_968, 671_026_404_352)
    assert main(["models", "--wide", "deepseek-v3"]) == 0
    out = capsys.readouterr().out
    assert "671.03B + 11.61B MTP" in out and "37.55B + 0.69B MTP" in out and "682.64B" not in out
    assert main(["models", "nosuchmodel"]) == 2
    assert "no catalog model matches 'nosuchmodel'" in capsys.readouterr().err
    # a preset: --model takes it, the catalog does not list it (it said only "no catalog model matches")
    assert main(["models", "tiny-llama"]) == 2
    assert "; tiny-llama is a preset, which --model takes but this catalog" in capsys.readouterr().err


def test_llama_405b_plans_on_1024_ranks_in_16_uneven_stages(capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's command as typed: 126 layers split 7, 8 x 14, 7 (the first and last stages
    also hold the embedding and the head), and without --batch one sequence per dp rank (8
    on dp=8), not a batch of 1 cut into empty shards."""
    assert main(["plan", "--model", "llama3.1-405b", "--mesh", "pp=16,dp=8,tp=8", "--strategy", "megatron",
                 "--device", "h100"]) == 0
    got = capsys.readouterr()
    text = got.out + got.err
    assert "split 7," + "8," * 14 + "7 " in text
    assert "batch 8 as 1 microbatches of 8" in text
    assert "uneven shards" not in text


def test_catalog_batch_follows_dp_unless_given(capsys: pytest.CaptureFixture[str]) -> None:
    """A catalog model's batch is rounded up to whole sequences per dp rank; --batch is kept
    as given (3 on dp=2 is refused: each rank whole sequences); a preset keeps its own batch."""
    assert main(["plan", "--model", "llama3-8b", "--layers", "1", "--seq", "256", "--mesh", "dp=4,tp=2"]) == 0
    assert "seq 256, batch 4, bfloat16" in capsys.readouterr().out
    assert main(["plan", "--model", "llama3-8b", "--layers", "1", "--seq", "256", "--batch", "3",
                 "--mesh", "dp=2,tp=2"]) == 2
    assert "--batch 3: data parallel over --mesh dp=2 needs a batch that is a multiple of 2" in capsys.readouterr().err
    assert main(["plan", "--model", "tiny-llama", "--mesh", "dp=2,tp=2"]) == 0
    assert "batch 4, float32" in capsys.readouterr().out


def test_catalog_pipeline_without_batch_has_one_sequence_a_dp_rank_a_microbatch(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A pipeline of a catalog model without --batch: each of --microbatches M is one sequence a dp
    rank (as a preset's microbatch is its batch), so the step is dp x M sequences. It was refused:
    the batch rounded to dp (2) was taken as the whole step's and '--microbatches 4: does not divide
    the batch 2' named a batch the user never gave."""
    argv = ["plan", "--model", "llama3-8b", "--layers", "2", "--seq", "256", "--mesh", "pp=2,dp=2,tp=2",
            "--strategy", "megatron,sp"]
    assert main([*argv, "--microbatches", "4"]) == 0
    assert "batch 8 as 4 microbatches of 2, bfloat16" in capsys.readouterr().out
    assert main(argv) == 0  # one microbatch (the default): as before
    assert "batch 2 as 1 microbatches of 2, bfloat16" in capsys.readouterr().out
    assert main([*argv, "--microbatches", "4", "--batch", "4"]) == 2  # a --batch given is the step's, as before
    assert "(a microbatch: --batch 4 over --microbatches 4; whole sequences per rank: --microbatches 2 or --batch 8)" \
        in capsys.readouterr().err


def test_devices_search_of_a_catalog_model_tries_every_dp(capsys: pytest.CaptureFixture[str]) -> None:
    """--devices N without --batch: a catalog model's batch is N whole sequences, so dp up to N
    divides it (with its entry's batch of 1 the search could only try dp=1)."""
    assert main(["plan", "--model", "llama3-8b", "--layers", "1", "--seq", "256", "--devices", "4",
                 "--device", "h100", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert "batch 4" in got["title"]
    assert {c["dp"] for c in got["search"]["top"]} & {2, 4}
    assert not any("does not divide the batch" in str(r) for r in got["search"]["refused"])


# -- megatron over every catalog model ---------------------------------------------------------


@pytest.mark.parametrize("name", DENSE)
def test_megatron_holds_params_bytes_over_shards(name: str) -> None:
    """Every dense catalog model plans under megatron at the tp that divides its heads; the
    predicted parameter memory per device is each parameter's bytes (bf16: 2) over the tp
    ranks it is split over: column / head / a column's bias on their output axis, row /
    embedding on their input or vocabulary axis; a norm, a learned position table, a row's
    bias, the router and MLA's down projections not at all; at two layers (the layers are
    alike; the full depth: the next test and benchmarks/catalog.py)."""
    cfg = preset(name)
    tp = tp_for(cfg)
    layers = 2
    loaded, plan, _ = plan_preset(name, f"tp={tp}", "megatron", {"layers": layers})
    model = loaded.model
    assert model is not None
    expect = 0
    for p, n in parameters(plan.program).items():
        role, shape = model.roles[p], plan.program.tensors[p].shape
        axis = -1 if role in ("column", "head", "column_bias") else -2 if role in ("row", "embedding") else None
        # an axis tp would not divide: the largest piece, ceil(size / tp)
        expect += 2 * (n if axis is None else n // shape[axis] * -(-shape[axis] // tp))
    assert memory_per_device(plan).parameters == expect
    assert math.gcd(tp, cfg.heads) == tp and tp >= 2


def test_llama3_8b_at_full_depth_holds_its_published_count_over_tp() -> None:
    """All 32 layers under megatron tp=8: every weight split 8 ways but the 65 RMS norms
    (hidden 4096 each), so the parameters per device are 2 bytes x ((8.03B - norms) / 8 + norms)."""
    _, plan, _ = plan_preset("llama3-8b", "tp=8", "megatron")
    norms = (2 * 32 + 1) * 4096
    assert memory_per_device(plan).parameters == 2 * ((8_030_261_248 - norms) // 8 + norms)
