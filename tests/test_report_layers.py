"""The plan report and the HTML page group an imported model by layer as they do a preset
(spmdkit.program.layers): layer 0 in full, one line for the others, every layer's reshards
folded into one row. Tiny LlamaForCausalLM imports (hidden 64, 11 and 1 layers) and presets."""

from __future__ import annotations

import io
import re
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'spmdkit[torch]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'spmdkit[hf]')")

from spmdkit.cost.memory import memory_per_device  # noqa: E402
from spmdkit.outputs import html as H  # noqa: E402
from spmdkit.outputs.report import _ranges, reshard_groups, write_report  # noqa: E402
from spmdkit.planner.planning import plan_hf, plan_model  # noqa: E402
from spmdkit.program.layers import layer_tags, program_layers  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")]

LAYERS = 11  # model.layers.10 sorts before model.layers.2 by name: the page must not


def _config(layers: int) -> dict[str, Any]:
    return {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": layers, "vocab_size": 256}


@pytest.fixture(scope="module")
def llama() -> Any:
    _prog, _model, _kw, plan = plan_hf("LlamaForCausalLM", _config(LAYERS), "dp=2,tp=2", None)
    return plan


@pytest.fixture(scope="module")
def llama1() -> Any:
    _prog, _model, _kw, plan = plan_hf("LlamaForCausalLM", _config(1), "dp=2,tp=2", None)
    return plan


def _report(plan: Any) -> str:
    out = io.StringIO()
    write_report(plan, out)
    return out.getvalue()


def test_layers_found_from_the_op_labels(llama: Any) -> None:
    prog = llama.program
    layers = program_layers(prog)
    assert layers.tags == layer_tags(prog) == [f"model.layers.{i}" for i in range(LAYERS)]
    assert layers.kind == [0] * LAYERS  # one structure: the layers are identical
    of = layers.tensor_layer
    assert of["model.layers.7.mlp.up_proj.weight"] == 7
    assert "model.embed_tokens.weight" not in of and "lm_head.weight" not in of and "input_ids" not in of
    assert layers.fold("model.layers.7.mlp.up_proj.weight.grad") == "model.layers.*.mlp.up_proj.weight.grad"
    assert layers.fold("linear_10") == "linear_10"
    # every layer holds the same tensors: each of layer 4's matches one of layer 0's, of the same shape
    by_key = {layers.tensor_key(n): n for n, u in of.items() if u == 0}
    four = [n for n, u in of.items() if u == 4]
    assert len(four) == len(by_key) > 50
    for n in four:
        m = by_key[layers.tensor_key(n)]
        assert prog.tensors[m].shape == prog.tensors[n].shape and prog.tensors[m].kind == prog.tensors[n].kind
    # the gradient of an activation is in that activation's layer (made by the backward of the layer that reads it)
    grads = [n for n, t in prog.tensors.items() if t.kind == "gradient" and of.get(n) == 4]
    assert grads and all(of[n.split(".grad")[0]] == 4 for n in grads)


def test_report_shows_layer_zero_in_full_and_one_line_for_the_others(llama: Any) -> None:
    text = _report(llama)
    table = text.split("Sharding (layer 0 in full", 1)[1].split("\nReshards", 1)[0]
    assert "model.layers.0.self_attn.q_proj.weight" in table and "model.layers.0.mlp.down_proj.weight" in table
    assert not re.search(r"model\.layers\.([1-9]|10)\.", table)
    assert f"layers 1-{LAYERS - 1}: every tensor sharded as in layer 0\n" in text
    # the lines of the sharding table do not grow with the layers
    one = text.count("\n│ ")
    assert one < 200


def test_reshards_of_every_layer_fold_into_one_row(llama: Any, llama1: Any) -> None:
    """The 11-layer model has the 1-layer model's reshard rows, each in-layer one 11 times."""
    rows = reshard_groups(llama)
    rows1 = reshard_groups(llama1)
    assert len(rows) == len(rows1)
    for g, g1 in zip(rows, rows1):
        assert (g["phase"], g["from_to"], g["collectives"].split(",")[0]) == \
            (g1["phase"], g1["from_to"], g1["collectives"].split(",")[0])
        if g1["layer"] == "model.layers.0" or g["tensor"].startswith("model.layers.*"):
            assert g["times"] == LAYERS * g1["times"], g
            assert g["layer"] in (f"{LAYERS} layers", "-")
        else:
            assert g["times"] == g1["times"], g
    # megatron: an all-reduce after the attention's and the MLP's row-parallel matmul in every layer
    fwd = [g for g in rows if g["phase"] == "forward" and g["layer"] == f"{LAYERS} layers"]
    assert [(g["times"], g["from_to"]) for g in fwd] == [(LAYERS, "[dp:S(0), tp:P(sum)] -> [dp:S(0), tp:R]")] * 2
    assert sum(g["times"] for g in rows) == sum(1 for r in llama.reshards if not r.shared)


def test_html_page_by_layer(llama: Any) -> None:
    plan = llama
    mem = memory_per_device(plan)
    table = H.layer_table(plan, mem)
    labels = [r["layer"] for r in table]
    assert labels[labels.index("model.layers.0"):][:LAYERS] == [f"model.layers.{i}" for i in range(LAYERS)]
    assert labels[0] == "model" and labels.index("lm_head") > labels.index(f"model.layers.{LAYERS - 1}")
    page = H.render_html(plan, "tiny llama", mem)
    cards = re.findall(r'class="card" data-name="([^"]*)"', page)
    assert "model.layers.0.self_attn.o_proj.weight" in cards and "model.embed_tokens.weight" in cards
    assert not any(re.match(r"model\.layers\.([1-9]|10)\.", c) for c in cards)
    # every layer holds the same parameters
    params = {r["layer"]: r["parameters"] for r in table}
    assert len({params[f"model.layers.{i}"] for i in range(LAYERS)}) == 1 and params["model.layers.0"] > 0


def test_presets_keep_their_layers_by_name() -> None:
    """A preset's tensors named ``layers.N.`` are in layer N (the report's grouping before the
    op labels were used; scripts/report_snapshot.py diffs whole reports), and the report says so."""
    _model, plan, _ = plan_model("gpt2-small", "dp=2,tp=2", "megatron", {"layers": 3})
    prog = plan.program
    layers = program_layers(prog)
    assert layers.tags == ["layer 0", "layer 1", "layer 2"]
    for n in prog.tensors:
        m = re.match(r"layers\.(\d+)\.", n)
        assert layers.tensor_layer.get(n) == (int(m.group(1)) if m else None), n
    assert layers.fold("layers.2.wq.grad") == "layers.*.wq.grad"
    text = _report(plan)
    assert "layers 1-2: every tensor sharded as in layer 0\n" in text
    assert "layers.1." not in text.split("Reshards")[0]


def test_bf16_last_layer_folds_with_the_others() -> None:
    """In bf16 the last layer's backward has one op fewer (no residual gradient to add from a
    next layer): its forward is the same, so its tensors and reshards still fold with the others'."""
    _prog, _model, _kw, plan = plan_hf("LlamaForCausalLM", _config(3), "dp=2,tp=2", None, dtype="bf16")
    layers = program_layers(plan.program)
    assert layers.kind == [0, 0, 0]
    text = _report(plan)
    assert "layers 1-2: every tensor sharded as in layer 0\n" in text
    rows = reshard_groups(plan)
    assert [g["times"] for g in rows if g["phase"] == "backward" and g["layer"] == "3 layers"] == [3, 3]


@pytest.mark.filterwarnings("ignore:--strategy megatron:UserWarning")
def test_a_dense_layer_then_moe_layers_each_structure_in_full() -> None:
    """Qwen2-MoE with its first layer dense (``mlp_only_layers``): layer 0 and layer 1 (the first
    MoE layer) in full, the other MoE layers compared with layer 1, their reshards folded apart."""
    cfg = {**_config(4), "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "num_experts": 4,
           "num_experts_per_tok": 2, "mlp_only_layers": [0]}
    _prog, _model, _kw, plan = plan_hf("Qwen2MoeForCausalLM", cfg, "dp=2,tp=2", None)
    layers = program_layers(plan.program)
    assert layers.kind == [0, 1, 1, 1]
    text = _report(plan)
    assert "Sharding (layer 0 in full, layer 1 in full (the first of another structure), and the tensors outside " \
           "the layers)" in text
    table = text.split("Sharding (", 1)[1].split("\nReshards", 1)[0]
    assert "model.layers.1.mlp.gate.weight" in table and "model.layers.0.mlp.gate_proj.weight" in table
    assert not re.search(r"model\.layers\.[23]\.", table)
    assert "\nlayers 2-3: every tensor sharded as in layer 1\n" in text
    fwd = [g for g in reshard_groups(plan) if g["phase"] == "forward" and g["from_to"].endswith("-> [dp:S(0), tp:R]")
           and "P(sum)" in g["from_to"]]
    # layer 0: attention and MLP; each MoE layer: attention, the shared expert and the routed experts' rows
    # (tensor-parallel experts, ETP = tp: their down projection's partial sum)
    assert sorted(g["times"] for g in fwd if g["layer"] != "model") == [1, 1, 3, 3, 3]
    assert "moe_experts.rows" in {g["tensor"] for g in fwd}
    page = H.render_html(plan, "tiny qwen2-moe", memory_per_device(plan))
    cards = re.findall(r'class="card" data-name="([^"]*)"', page)
    assert "model.layers.0.mlp.gate_proj.weight" in cards and "model.layers.1.mlp.gate.weight" in cards
    assert not any(re.match(r"model\.layers\.[23]\.", c) for c in cards)
    assert "Each tensor of layer 0 (and of layer 1, the first of another structure)" in page


def test_preset_moe_after_a_dense_layer() -> None:
    """deepseek-v2-lite (its first layer dense) at 3 layers: layer 1 in full, layer 2 as layer 1."""
    _model, plan, _ = plan_model("deepseek-v2-lite", "dp=2,tp=4", "megatron", {"layers": 3, "seq": 512, "batch": 2})
    text = _report(plan)
    assert "layer 1 in full (the first of another structure)" in text
    assert "\nlayer 2: every tensor sharded as in layer 1\n" in text


def test_layer_ranges() -> None:
    assert _ranges([1, 2, 3, 5, 7, 8]) == "layers 1-3, 5, 7-8"
    assert _ranges([4]) == "layer 4"
