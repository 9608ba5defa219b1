"""--model-config (a decoder of one's own: sizes and the variants published runs use) and the
runtime flags (--precision, --framework, --tp-comm-overlap) a plan carries."""

from __future__ import annotations

import json

import pytest

from spmdkit.cli import main
from spmdkit.core.errors import ProgramError
from spmdkit.models.zoo import (
    PRESETS,
    ModelConfig,
    build_model,
    config_from_json,
    config_json,
    model_label,
    preset,
    tiny_like,
)
from spmdkit.program.runtime import Runtime, parse_precision


def _plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _params(cfg: ModelConfig) -> int:
    prog = build_model(cfg, check_rules=False).program
    return sum(t.numel for t in prog.tensors.values() if t.kind == "parameter" and not t.inplace_of)


def test_config_with_a_base_overrides_only_the_fields_given() -> None:
    cfg = config_from_json('{"base": "llama-7b", "layers": 16, "name": "half"}')
    assert cfg == PRESETS["llama-7b"].with_(layers=16, name="half")
    assert model_label('{"base": "llama-7b", "layers": 16, "name": "half"}') == "half"
    assert model_label("llama-7b") == "llama-7b"


def test_parameter_counts_of_the_variants() -> None:
    """The published formulas: GPT with untied embeddings has 12 L h^2 + 2 V h (+ positions
    and norms); tying drops V h; a gated MLP of width f has 3 h f weights, an ungated one 2 h f."""
    L, h, f, V, S = 2, 64, 256, 1000, 32
    base = ModelConfig("gpt2", L, h, 4, None, f, V, S, 1, "float32")
    norms = L * 4 * h + 2 * h  # two LayerNorms (weight, bias) per layer and the final one
    untied = _params(base)
    assert untied == L * (4 * h * h + 2 * h * f) + 2 * V * h + S * h + norms
    assert _params(base.with_(tied_embeddings=True)) == untied - V * h
    assert _params(base.with_(activation="swiglu")) == untied + L * h * f
    assert _params(base.with_(activation="squared_relu")) == untied
    llama = ModelConfig("llama", L, h, 4, 2, f, V, S, 1, "float32")
    gated = _params(llama)
    assert _params(llama.with_(activation="squared_relu")) == gated - L * h * f


def test_flash_attention_keeps_no_score_tensor() -> None:
    cfg = ModelConfig("gpt2", 1, 64, 4, None, 256, 100, 32, 2, "float32")
    eager = build_model(cfg, check_rules=False).program
    flash = build_model(cfg.with_(attention="flash"), check_rules=False).program
    assert any(t.shape[-2:] == (32, 32) for t in eager.tensors.values())
    assert not any(len(t.shape) == 4 and t.shape[-2:] == (32, 32) for t in flash.tensors.values())
    assert [op.rule for op in flash.ops].count("flash_attention") == 1


def test_squared_relu_is_relu_then_square() -> None:
    prog = build_model(ModelConfig("llama", 1, 16, 4, None, 32, 64, 8, 2, "float32", activation="squared_relu"),
                       check_rules=False).program
    rules = [op.rule for op in prog.ops if op.phase == "forward"]
    i = rules.index("relu")
    assert rules[i + 1] == "square" and "swiglu" not in rules


@pytest.mark.parametrize("variant", [
    {"attention": "flash"}, {"activation": "squared_relu", "tied_embeddings": True},
    {"activation": "swiglu", "kv_heads": 2, "attention": "flash"}])
def test_verify_simulates_the_same_variant(capsys: pytest.CaptureFixture[str], variant: dict) -> None:
    text = json.dumps({"base": "tiny-gpt2", **variant})
    d = _plan_json(capsys, "--model-config", text, "--mesh", "dp=2,tp=2", "--strategy", "megatron,sp", "--verify")
    assert d["verify"]["ok"] and d["verify"]["model"] == "tiny-gpt2 variant"
    tiny = preset(tiny_like(preset(text)))
    for k in variant:
        assert getattr(tiny, k) == variant[k]


def test_a_tied_pipeline_simulates_equal(capsys: pytest.CaptureFixture[str]) -> None:
    d = _plan_json(capsys, "--model-config", '{"base": "tiny-llama", "tied_embeddings": true}',
                   "--mesh", "pp=2,dp=2,tp=2", "--verify")
    assert d["verify"]["ok"]


@pytest.mark.parametrize("argv, message", [
    (["--model-config", '{"layers": 2}'], "--model-config: missing 'hidden'"),
    (["--model-config", '{"base": "tiny-llama", "activation": "tanh"}'], "unknown activation 'tanh'"),
    (["--model-config", '{"base": "tiny-llama", "attention": "eager"}'], "eager attention is modelled for gpt2 only"),
    (["--model-config", '{"base": "tiny-llama", "layerz": 3}'], "unknown field 'layerz'"),
    (["--model-config", '{"base": "tiny-llama", "layers": 0}'], "--model-config layers: expected an integer"),
    (["--model-config", '{"base": "tiny-llama", "tied_embeddings": 1}'], "tied_embeddings: expected true or false"),
    (["--model-config", '{"base": "nope"}'], "--model-config base: no preset 'nope'"),  # (not --model: not given)
    (["--model-config", "missing.json"], "no such file"),
    (["--model-config", "[1]"], "expected a JSON object or a .json file"),
    (["--model-config", "{"], "not valid JSON"),
    (["--model", "tiny-llama", "--model-config", '{"base": "tiny-llama"}'], "not both"),
    (["--model", "tiny-llama", "--precision", "fp9"], "--precision 'fp9': expected one of fp32, bf16, fp16, fp8"),
    (["--model", "tiny-llama", "--framework", "jax"], "--framework 'jax': expected one of megatron, torchtitan"),
    (["--model", "tiny-llama", "--precision", "fp8", "--device", "a100-80gb"], "--precision fp8: NVIDIA A100"),
])
def test_bad_configs_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["plan", *argv, "--mesh", "dp=2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert message in err, err


def test_runtime_reaches_the_plan(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import spmdkit.cli.common as common

    seen: list[Runtime] = []
    real = common.estimate_step

    def spy(plan, *a, **k):  # type: ignore[no-untyped-def]
        seen.append(plan.runtime)
        return real(plan, *a, **k)

    monkeypatch.setattr(common, "estimate_step", spy)
    _plan_json(capsys, "--model", "tiny-llama", "--mesh", "dp=2,tp=2", "--strategy", "megatron,sp", "--device", "h100",
               "--precision", "bf16", "--framework", "torchtitan", "--compile", "--tp-comm-overlap")
    assert seen == [Runtime("bf16", "torchtitan", True, compile=True)]


def test_precision_names() -> None:
    assert parse_precision("bfloat16") == "bf16" and parse_precision("FP8") == "fp8" and parse_precision(None) is None
    assert Runtime().precision_of("bfloat16") == "bf16" and Runtime("fp8").precision_of("bfloat16") == "fp8"
    with pytest.raises(ProgramError, match="--framework"):
        Runtime(framework="deepspeed")


@pytest.mark.parametrize(("field", "text", "msg"), [
    ("experts", '"experts": -1', "--model-config experts: expected an integer from 0 to"),
    ("top_k", '"experts": 4, "top_k": 5', "--model-config: top_k must be from 1 to experts 4, got 5"),
    ("top_k", '"top_k": 0', "--model-config top_k: expected an integer from 1 to"),
    ("capacity_factor", '"experts": 4, "capacity_factor": "x"', "--model-config capacity_factor: expected a finite number or null"),
    ("capacity_factor", '"experts": 4, "capacity_factor": 0', "--model-config: capacity_factor must be a number in (0, 1024]"),
    ("shared_experts", '"shared_experts": 1', "--model-config: shared_experts 1 needs experts >= 1"),
    ("dense_layers", '"experts": 4, "dense_layers": 2', "--model-config: dense_layers 2 leaves no MoE layer of 2"),
    ("norm", '"norm": "batch"', "--model-config: unknown norm 'batch' (rms or layer)"),
    ("positions", '"positions": "sinusoid"', "--model-config: unknown positions 'sinusoid'"),
    ("activation", '"activation": "reglu"', "--model-config: unknown activation 'reglu' (swiglu, geglu,"),
    ("head_dim", '"head_dim": 0', "--model-config head_dim: expected an integer from 1 to"),
    ("head_dim", '"head_dim": 5', "--model-config: rope needs an even head_dim, got 5"),
    ("kv_lora_rank", '"kv_lora_rank": 8, "qk_rope_head_dim": 4, "base": "tiny-gpt2"',
     "--model-config: kv_lora_rank (MLA) needs attention flash, not eager"),
    ("kv_lora_rank", '"kv_lora_rank": 8, "kv_heads": null', "--model-config: kv_lora_rank (MLA) needs positions rope and an even "
     "qk_rope_head_dim >= 2, got rope and 0"),
    ("v_head_dim", '"v_head_dim": 4', "--model-config: v_head_dim needs kv_lora_rank >= 1 (MLA)"),
    ("q_lora_rank", '"q_lora_rank": 8', "--model-config: q_lora_rank 8 needs kv_lora_rank >= 1 (MLA)"),
    ("kv_heads", '"kv_lora_rank": 8, "qk_rope_head_dim": 4, "kv_heads": 2', "--model-config: kv_heads 2 with "
     "kv_lora_rank (MLA)"),
])
def test_new_fields_are_checked_one_line(field: str, text: str, msg: str) -> None:
    body = "{" + text + ("" if "base" in text else ', "base": "tiny-llama"') + "}"
    with pytest.raises(ProgramError) as e:
        config_from_json(body)
    assert str(e.value).startswith(msg) and "\n" not in str(e.value) and field in str(e.value)


def test_new_fields_parse_and_default_to_the_arch() -> None:
    cfg = config_from_json('{"base": "tiny-llama", "experts": 4, "top_k": 2, "moe_ffn": 8, "shared_experts": 1, '
                           '"dense_layers": 1, "capacity_factor": 1.25, "head_dim": 8, "qkv_bias": true, '
                           '"norm": null, "positions": null}')
    assert (cfg.experts, cfg.top_k, cfg.expert_ffn, cfg.shared_experts, cfg.capacity_factor) == (4, 2, 8, 1, 1.25)
    assert (cfg.hdim, cfg.nrm, cfg.pos, cfg.qkv_bias) == (8, "rms", "rope", True)
    assert [cfg.is_moe_layer(i) for i in range(2)] == [False, True]
    gpt = preset("tiny-gpt2")
    assert (gpt.hdim, gpt.nrm, gpt.pos, gpt.vdim) == (4, "layer", "learned", 4)
    assert config_from_json('{"base": "tiny-gpt2", "norm": "rms", "positions": "alibi"}').pos == "alibi"


def test_config_json_round_trips_the_new_fields() -> None:
    cfg = config_from_json('{"base": "tiny-llama", "kv_heads": null, "experts": 4, "top_k": 2, "moe_ffn": 8, '
                           '"shared_experts": 1, "dense_layers": 1, "capacity_factor": 1.25, "kv_lora_rank": 8, '
                           '"q_lora_rank": 6, "qk_rope_head_dim": 4, "head_dim": 4, "v_head_dim": 6, "norm": "layer"}')
    assert config_from_json(config_json(cfg)) == cfg
