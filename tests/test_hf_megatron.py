"""Megatron on imported HuggingFace models found by structure (spmdkit.strategies.hf_roles,
hf_fused): per transformer layer, the plan's collectives over tp are an expert's (2
all-reduces of activations forward and 2 backward; reduce-scatter / all-gather pairs under
sequence parallel), whatever the modules are called; fused projections split into their parts
compute the same step; a layer left replicated is a warning with its share of the parameters.

Tiny models (2 layers, hidden 64, 4 heads, vocab 256, batch 2, seq 16), tp=2."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'spmdkit[torch]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'spmdkit[hf]')")

from spmdkit.planner.planning import plan_program  # noqa: E402
from spmdkit.strategies.hf import megatron_program, tp_roles  # noqa: E402
from spmdkit.strategies.hf_roles import BLOCK, block_roles, layer_collectives  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

H, V = 64, 256
C = {"num_hidden_layers": 2, "hidden_size": H, "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": V,
     "max_position_embeddings": 64}
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {"num_key_value_heads": 2, **C}),
    "mistral": ("MistralForCausalLM", {"num_key_value_heads": 2, **C}),
    "qwen2": ("Qwen2ForCausalLM", {"num_key_value_heads": 2, **C}),  # q/k/v biases
    "gemma": ("GemmaForCausalLM", {"num_key_value_heads": 1, "head_dim": 16, **C}),  # MQA
    "gemma2": ("Gemma2ForCausalLM", {"num_key_value_heads": 2, "head_dim": 16, **C}),
    "stablelm": ("StableLmForCausalLM", {"num_key_value_heads": 2, **C}),
    "phi": ("PhiForCausalLM", {"num_key_value_heads": 4, **C}),  # parallel attention + MLP
    "opt": ("OPTForCausalLM", {"num_hidden_layers": 2, "hidden_size": H, "num_attention_heads": 4, "ffn_dim": 128,
                               "vocab_size": V, "max_position_embeddings": 64, "word_embed_proj_dim": H}),
    "neox": ("GPTNeoXForCausalLM", dict(C)),  # head-interleaved query_key_value, dense_h_to_4h
    "gpt2": ("GPT2LMHeadModel", {"n_layer": 2, "n_embd": H, "n_head": 4, "vocab_size": V, "n_positions": 64,
                                 "bos_token_id": 0, "eos_token_id": 0}),  # Conv1D, fused c_attn
    "mpt": ("MptForCausalLM", {"n_layers": 2, "d_model": H, "n_heads": 4, "vocab_size": V, "max_seq_len": 64}),
    "falcon": ("FalconForCausalLM", {"num_hidden_layers": 2, "hidden_size": H, "num_attention_heads": 4,
                                     "vocab_size": V}),  # FalconLinear x @ W.T, multi-query fused qkv
    "bigcode": ("GPTBigCodeForCausalLM", {"n_layer": 2, "n_embd": H, "n_head": 4, "vocab_size": V, "n_positions": 64,
                                          "multi_query": True, "bos_token_id": 0, "eos_token_id": 0}),
    "bert": ("BertForMaskedLM", dict(C)),
    "distilbert": ("DistilBertForMaskedLM", {"n_layers": 2, "dim": H, "n_heads": 4, "hidden_dim": 128,
                                             "vocab_size": V, "max_position_embeddings": 64}),  # q_lin, lin1
    "mixtral": ("MixtralForCausalLM", {"num_key_value_heads": 2, "num_local_experts": 4, **C}),
}

#: per transformer layer: activation all-reduces over tp (forward, backward). Phi and Falcon
#: (parallel attention and MLP): the two branches' input gradients summed before one
#: reduction. A replicated k / v (MQA at tp=2: Gemma, Falcon, GPTBigCode): its output
#: gradient is a partial sum over the ranks' query heads, all-reduced (+2, k and v).
EXPECTED: dict[str, tuple[int, int]] = {
    "llama": (2, 2), "mistral": (2, 2), "qwen2": (2, 2), "gemma2": (2, 2), "stablelm": (2, 2), "opt": (2, 2),
    "neox": (2, 2), "gpt2": (2, 2), "mpt": (2, 2), "bert": (2, 2), "distilbert": (2, 2), "phi": (2, 1),
    "gemma": (2, 4), "falcon": (2, 4), "bigcode": (2, 4),
}

_CACHE: dict[str, Any] = {}


def imported(name: str) -> Any:
    from spmdkit.models.hf import import_hf

    if name not in _CACHE:
        cls, cfg = CONFIGS[name]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _CACHE[name] = import_hf(cls, cfg, batch=2, seq=16, seed=0)
    return _CACHE[name]


def _plan(name: str, strategy: str = "megatron", mesh: str = "tp=2") -> tuple[Any, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_program(imported(name)[0], mesh, strategy)


def _blocks(plan: Any) -> dict[str, Counter[tuple[str, str, str]]]:
    return {k: v for k, v in layer_collectives(plan).items() if BLOCK.fullmatch(k)}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_megatron_gives_an_experts_collectives_per_layer(name: str) -> None:
    _, plan = _plan(name)
    fwd, bwd = EXPECTED[name]
    blocks = _blocks(plan)
    assert len(blocks) == 2, blocks
    for layer, c in blocks.items():
        act = {k: v for k, v in c.items() if k[2] == "activation"}
        assert act == {("forward", "all_reduce", "activation"): fwd,
                       ("backward", "all_reduce", "activation"): bwd}, (layer, c)


@pytest.mark.parametrize("name", ["neox", "stablelm", "mpt"])
def test_sequence_parallel_pairs_per_layer(name: str) -> None:
    _, plan = _plan(name, "megatron,sp")
    for layer, c in _blocks(plan).items():
        act = {k: v for k, v in c.items() if k[2] == "activation"}
        assert act == {(p, k, "activation"): 2 for p in ("forward", "backward")
                       for k in ("reduce_scatter", "all_gather")}, (layer, c)


def test_roles_come_from_the_graph_not_the_names() -> None:
    """DistilBERT's q_lin / out_lin / lin1 / lin2 and GPT-NeoX's dense_h_to_4h / dense_4h_to_h
    match no name pattern: the graph gives them their roles (and their biases follow)."""
    prog = imported("distilbert")[0]
    roles = tp_roles(prog)
    at = "distilbert.transformer.layer.1."
    for mod, role in (("attention.q_lin", "column"), ("attention.v_lin", "column"), ("attention.out_lin", "row"),
                      ("ffn.lin1", "column"), ("ffn.lin2", "row")):
        assert roles[at + mod + ".weight"] == role and roles[at + mod + ".bias"] == role, mod
    assert block_roles(prog).unpaired == ()
    found = block_roles(imported("neox")[0])
    assert found.pairs["gpt_neox.layers.0.mlp.dense_4h_to_h.weight"] == ("gpt_neox.layers.0.mlp.dense_h_to_4h.weight",)
    assert found.pairs["gpt_neox.layers.0.attention.dense.weight"] == (
        "gpt_neox.layers.0.attention.query_key_value.weight",)
    # the graph's roles win over a misleading name: a model whose MLP is called "dense" (row by name)
    prog = imported("falcon")[0]
    roles = tp_roles(prog)
    assert roles["transformer.h.0.mlp.dense_h_to_4h.weight"] == "column"
    assert roles["transformer.h.0.self_attention.dense.weight"] == "row"


def test_falcon_linear_reads_its_weight_through_a_transpose() -> None:
    """FalconLinear computes x @ W.T: its weight [out, in] is column-parallel on axis 0, the
    row layer on axis 1, as torch's Linear."""
    _, plan = _plan("falcon")
    assert plan.attrs["transformer.h.0.mlp.dense_h_to_4h.weight"].dims_mapping == (0, -1)
    assert plan.attrs["transformer.h.0.mlp.dense_4h_to_h.weight"].dims_mapping == (-1, 0)
    assert plan.attrs["transformer.h.1.self_attention.dense.weight"].dims_mapping == (-1, 0)


@pytest.mark.parametrize("name", ["falcon", "bigcode", "mpt"])
def test_fused_projection_split_keeps_the_step(name: str) -> None:
    """Falcon's query_key_value (x @ W.T, viewed [.., heads + 2, d], split 4/1/1 heads),
    GPTBigCode's multi-query c_attn (bias, unsqueeze, split 64/16/16) and MPT's Wqkv (chunk):
    each split into one projection per part; the rewritten step computes the imported one's
    loss and every gradient on the model's own weights."""
    import numpy as np

    from spmdkit.execute.single import run_program
    from spmdkit.models.torch_import import torch_values

    prog, model, kw = imported(name)
    new = megatron_program(prog)
    assert sum(op.rule == "split" for op in new.ops) < sum(op.rule == "split" for op in prog.ops)
    a = run_program(prog, torch_values(prog, model, (), kw))
    b = run_program(new, torch_values(new, model, (), kw))
    assert np.isfinite(a[prog.loss]) and abs(float(a[prog.loss]) - float(b[new.loss])) <= 1e-5
    for p, g in prog.grads.items():
        assert np.allclose(a[g], b[new.grads[p]], rtol=1e-4, atol=1e-6), p


def test_multi_query_c_attn_is_split_by_q_k_v() -> None:
    """GPTBigCode's c_attn [hidden + 2 * head_dim, hidden]: q column-parallel (heads over tp),
    the single k and v head replicated, each said so."""
    with pytest.warns(UserWarning, match=r"transformer\.h\.0\.attn\.c_attn part 1 \(16 of 96 features\) makes 1 "
                                         r"head, fewer than tp=2: replicated"):
        prog, plan = plan_program(imported("bigcode")[0], "tp=2", "megatron")
    a = plan.attrs
    assert a["transformer.h.0.attn.c_attn.weight.part0"].dims_mapping == (0, -1)  # q: 64 features
    assert a["transformer.h.0.attn.c_attn.bias.part0"].dims_mapping == (0,)
    for j in (1, 2):  # k, v: one head of 16
        assert prog.tensors[f"transformer.h.0.attn.c_attn.weight.part{j}"].shape == (16, 64)
        assert a[f"transformer.h.0.attn.c_attn.weight.part{j}"].dims_mapping == (-1, -1)
        assert a[f"transformer.h.0.attn.c_attn.bias.part{j}"].dims_mapping == (-1,)


def test_replicated_layers_are_a_warning_with_their_share() -> None:
    """Mixtral's router (gate) and expert banks have no tensor-parallel role: one warning
    names them and the share of the parameters they hold (hand-computed)."""
    prog = imported("mixtral")[0]
    n = {p: prog.tensors[p].shape for p in prog.parameters()}
    total = sum(int(np.prod(s)) for s in n.values())
    left = sum(int(np.prod(s)) for p, s in n.items() if ".mlp.experts." in p or ".mlp.gate." in p)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        plan_program(prog, "tp=2", "megatron")
    msgs = [str(w.message) for w in got if "left replicated" in str(w.message)]
    assert len(msgs) == 1, msgs
    assert f"{left / total:.1%} of the parameters" in msgs[0]
    assert "model.layers.*.mlp.gate (2)" in msgs[0] and "model.layers.*.mlp.experts (2)" in msgs[0]
    with warnings.catch_warnings(record=True) as got:  # a fully tensor-parallel model: none
        warnings.simplefilter("always")
        plan_program(imported("llama")[0], "tp=2", "megatron")
    assert not [w for w in got if "left replicated" in str(w.message)]


def test_cli_prints_the_warning_before_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    """The notes reach stderr while planning, before any line of the report."""
    from spmdkit.cli.common import strategy_notes

    with strategy_notes("plan"):
        warnings.warn("--strategy megatron: a note", UserWarning, stacklevel=1)
        assert capsys.readouterr().err == "spmdkit plan: warning: --strategy megatron: a note\n"
        warnings.warn("not ours", UserWarning, stacklevel=1)
    assert capsys.readouterr().err == ""


def test_hf_llama_equals_the_zoo_placement(capsys: pytest.CaptureFixture[str]) -> None:
    """`plan --hf LlamaForCausalLM` at tiny-llama's sizes gives the zoo's expert placement:
    the same collectives over tp in every layer (2 all-reduces each way) and outside them."""
    from spmdkit.cli import main
    from spmdkit.models.zoo import preset
    from spmdkit.planner.planning import plan_model

    c = preset("tiny-llama")
    cfg = {"num_hidden_layers": c.layers, "hidden_size": c.hidden, "num_attention_heads": c.heads,
           "num_key_value_heads": c.kv_heads, "intermediate_size": c.ffn, "vocab_size": c.vocab,
           "max_position_embeddings": 64}
    from spmdkit.planner.planning import plan_hf

    _prog, _m, _kw, hf_plan = plan_hf("LlamaForCausalLM", cfg, "tp=2", "megatron", batch=c.batch, seq=c.seq)
    _model, zoo_plan, _ = plan_model("tiny-llama", "tp=2", "megatron")
    hf = layer_collectives(hf_plan)
    zoo = layer_collectives(zoo_plan)
    hf_layers = [hf[k] for k in sorted(hf) if BLOCK.fullmatch(k)]
    zoo_layers = [zoo[k] for k in sorted(zoo) if k.startswith("layer ")]
    assert hf_layers == zoo_layers and len(hf_layers) == c.layers
    assert sum((hf[k] for k in hf if not BLOCK.fullmatch(k)), Counter()) == \
        sum((zoo[k] for k in zoo if not k.startswith("layer ")), Counter())
    # and the same through the CLI's JSON: the tp collectives of each phase
    counts = []
    for argv in (["--model", "tiny-llama"], ["--hf", "LlamaForCausalLM", "--hf-config", json.dumps(cfg),
                                             "--batch", str(c.batch), "--seq", str(c.seq)]):
        assert main(["plan", *argv, "--mesh", "tp=2", "--strategy", "megatron", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        counts.append(Counter((r["phase"], st["kind"]) for r in out["reshards"] if not r["shared"]
                              for st in r["steps"] if st["bytes_per_rank"] > 0))
    assert counts[0] == counts[1] == Counter({("forward", "all_reduce"): 5, ("backward", "all_reduce"): 5})



