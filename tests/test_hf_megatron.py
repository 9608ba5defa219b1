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
    "phi3": ("Phi3ForCausalLM", {"num_key_value_heads": 2, "pad_token_id": 0, **C}),  # qkv_proj cut by 3 slices
}

#: per transformer layer: activation all-reduces over tp (forward, backward). Phi and Falcon
#: (parallel attention and MLP): the two branches' input gradients summed before one
#: reduction. A replicated k / v (MQA at tp=2: Gemma, Falcon, GPTBigCode): its output
#: gradient is a partial sum over the ranks' query heads, all-reduced (+2, k and v).
EXPECTED: dict[str, tuple[int, int]] = {
    "llama": (2, 2), "mistral": (2, 2), "qwen2": (2, 2), "gemma2": (2, 2), "stablelm": (2, 2), "opt": (2, 2),
    "neox": (2, 2), "gpt2": (2, 2), "mpt": (2, 2), "bert": (2, 2), "distilbert": (2, 2), "phi": (2, 1),
    "gemma": (2, 4), "falcon": (2, 4), "bigcode": (2, 4), "phi3": (2, 2),
    "mixtral": (2, 2),  # attention and the experts (ETP = tp: each expert column / row parallel)
}
#: the models whose fused projections are split into parameters of their own
FUSED = ("gpt2", "mpt", "falcon", "bigcode", "phi3")

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


@pytest.mark.parametrize("name", ["neox", "stablelm", "mpt", "distilbert", "opt", "gpt2"])
def test_sequence_parallel_pairs_per_layer(name: str) -> None:
    """megatron,sp at tp=2: 2 reduce-scatters and 2 all-gathers per layer each way, nothing
    else over tp but the pairs' 1 + 1 outside the layers (the embedding's reduce-scatter and
    the LM head's gather, their transposes backward; DistilBERT's MLM transform runs on the
    shards, so its last layer's output is not gathered), the gradients of weights tp-replicated
    and read on shards (norms, biases, GPT-2's position table) all-reduced. Post-LN DistilBERT,
    and OPT and GPT-2, which flatten their tokens to [batch * seq, hidden]: the residual stream
    cut over tp batch-major, as the flattened tensors are."""
    prog, plan = _plan(name, "megatron,sp")
    for layer, c in _blocks(plan).items():
        act = {k: v for k, v in c.items() if k[2] == "activation"}
        want = {(p, k, "activation"): 2 for p in ("forward", "backward") for k in ("reduce_scatter", "all_gather")}
        if name == "distilbert" and layer.endswith(".1"):
            want[("forward", "all_gather", "activation")] = 1
        assert act == want, (layer, c)
    kinds = Counter((prog.ops[r.op_index].phase, s.kind) for r, s in plan.collectives())
    assert kinds[("forward", "reduce_scatter")] == kinds[("backward", "all_gather")] == 5
    assert kinds[("forward", "all_gather")] == kinds[("backward", "reduce_scatter")] == 5
    assert not {k for k in kinds if k[1] == "all_to_all" or (k[0] != "optimizer" and k[1] == "all_reduce")} \
        - {("backward", "all_reduce")}
    assert kinds[("backward", "all_reduce")] == (1 if name == "gpt2" else 0)  # GPT-2's [1, seq, hidden] wpe grad


def test_lm_head_bias_goes_with_the_vocab_parallel_logits() -> None:
    """DistilBERT's vocab_projector (tied to the word embeddings, a bias of its own, no name
    pattern): its bias is found as the bias added to the vocab-parallel logits and stored
    sharded with its Adam moments, so the optimizer step moves nothing over tp."""
    _, plan = _plan("distilbert")
    for t in ("vocab_projector.bias", "vocab_projector.bias.grad", "vocab_projector.bias.moment1",
              "vocab_projector.bias.moment2.new"):
        assert plan.attrs[t].dims_mapping == (0,), t
    assert not [r.tensor for r, s in plan.collectives("optimizer")]


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


@pytest.mark.parametrize("name", FUSED)
def test_fused_weights_are_stored_sharded_with_no_weight_collective(name: str) -> None:
    """A split fused weight is its parts, each a parameter of its own stored column-sharded
    over tp with its gradient and Adam moments (or replicated: GPTBigCode's and Falcon's single
    k / v head), as Megatron stores a fused qkv: no weight-sized collective anywhere in the
    step, only the 2 + 2 all-reduces per layer (and the replicated k / v heads' output
    gradients, EXPECTED)."""
    from spmdkit.strategies.hf_fused import fused_parts

    prog, plan = _plan(name)
    parts = fused_parts(prog)
    assert parts and not {p.source for p in parts.values()} & set(prog.tensors)  # the fused weights are gone
    sharded = 0
    for part in parts:
        assert prog.tensors[part].kind == "parameter"
        g, states, _new, _ = prog.optimizer[part]
        dm = plan.attrs[part].dims_mapping
        for t in (g, *states):  # the gradient and moments laid out as the part
            assert plan.attrs[t].dims_mapping == dm, (part, t)
        sharded += 0 in dm
    # GPT-2, GPTBigCode: 2 layers x (3 weight + 3 bias parts); Falcon, GPTBigCode: k and v replicated
    assert sharded == {"gpt2": 12, "mpt": 6, "falcon": 2, "bigcode": 4, "phi3": 10}[name]
    for _layer, c in layer_collectives(plan).items():
        assert not [k for k in c if k[2] == "weight"], (_layer, c)
    assert not [r for r, s in plan.collectives("optimizer") if 0 in s.mesh_dims]


@pytest.mark.parametrize("name", FUSED)
def test_fused_projection_split_keeps_the_step(name: str) -> None:
    """GPT-2's c_attn (Conv1D, bias, split), Falcon's query_key_value (x @ W.T, viewed [..,
    heads + 2, d], split 4/1/1 heads), GPTBigCode's multi-query c_attn (bias, unsqueeze, split
    64/16/16), MPT's Wqkv (chunk) and Phi-3's qkv_proj (three slices) and gate_up_proj
    (chunk): each split into one projection per part, the parts parameters of their own
    (their values the module weight's slices); the rewritten step computes the imported one's
    loss, and every gradient (a fused weight's: its parts' concatenated) on the model's own
    weights; torch eager's gradients, sliced, are the parts'."""
    from spmdkit.execute.eager import eager_reference
    from spmdkit.execute.single import run_program
    from spmdkit.models.torch_import import torch_values
    from spmdkit.strategies.hf_fused import fused_parts

    prog, model, kw = imported(name)
    new = megatron_program(prog)
    parts = fused_parts(new)
    assert not any(op.rule == "split" for op in new.ops)
    assert all(new.sources[p][0] == "parameter_slice" for p in parts)
    a = run_program(prog, torch_values(prog, model, (), kw))
    b = run_program(new, torch_values(new, model, (), kw))
    assert np.isfinite(a[prog.loss]) and abs(float(a[prog.loss]) - float(b[new.loss])) <= 1e-5
    for p, g in prog.grads.items():
        ps = sorted((q for q, f in parts.items() if f.source == p), key=lambda q: parts[q].lo)
        got = np.concatenate([b[new.grads[q]] for q in ps], axis=parts[ps[0]].axis) if ps else b[new.grads[p]]
        assert np.allclose(a[g], got, rtol=1e-4, atol=1e-6), p
    assert len(parts) == {"gpt2": 12, "mpt": 6, "falcon": 6, "bigcode": 12, "phi3": 10}[name]
    _dt, ref = eager_reference(new, model, (), kw)
    for q in parts:
        assert np.allclose(ref[new.grads[q]], b[new.grads[q]], rtol=1e-3, atol=1e-5), q


def test_multi_query_c_attn_is_split_by_q_k_v() -> None:
    """GPTBigCode's c_attn [hidden + 2 * head_dim, hidden]: q column-parallel (heads over tp),
    the single k and v head replicated, each said so."""
    with pytest.warns(UserWarning, match=r"transformer\.h\.\*\.attn\.c_attn \(2 layers\) part 1 \(16 of 96 features\) "
                                         r"makes 1 head, fewer than tp=2: replicated"):
        prog, plan = plan_program(imported("bigcode")[0], "tp=2", "megatron")
    a = plan.attrs
    assert a["transformer.h.0.attn.c_attn.weight.part0"].dims_mapping == (0, -1)  # q: 64 features
    assert a["transformer.h.0.attn.c_attn.bias.part0"].dims_mapping == (0,)
    for j in (1, 2):  # k, v: one head of 16
        assert prog.tensors[f"transformer.h.0.attn.c_attn.weight.part{j}"].shape == (16, 64)
        assert a[f"transformer.h.0.attn.c_attn.weight.part{j}"].dims_mapping == (-1, -1)
        assert a[f"transformer.h.0.attn.c_attn.bias.part{j}"].dims_mapping == (-1,)


def test_replicated_layers_are_a_warning_with_their_share() -> None:
    """Mixtral imported as HF computes its experts (moe=None: HF's grouped matmul, no MoE ops):
    its router (gate) and expert banks have no tensor-parallel role: one warning names them and
    the share of the parameters they hold (hand-computed)."""
    from spmdkit.models.hf import import_hf

    cls, cfg = CONFIGS["mixtral"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = import_hf(cls, cfg, batch=2, seq=16, seed=0, moe=None)[0]
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





_RUN = {"gpt2": CONFIGS["gpt2"], "falcon": CONFIGS["falcon"], "bigcode": CONFIGS["bigcode"], "phi3": CONFIGS["phi3"]}


@pytest.mark.parametrize("name", sorted(_RUN))
def test_verify_simulates_the_fused_parts(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`plan --hf ... --verify` (dp=2 x tp=2, megatron): the plan with the fused weights' parts
    as sharded parameters, simulated on 4 ranks, equals the unsharded step in every tensor."""
    from spmdkit.cli import main

    cls, cfg = _RUN[name]
    assert main(["plan", "--hf", cls, "--hf-config", json.dumps(cfg), "--mesh", "dp=2,tp=2", "--json",
                 "--verify"]) == 0
    v = json.loads(capsys.readouterr().out)["verify"]
    assert v["ok"] and v["checked"] > 300 and v["model"] == cls


@pytest.mark.parametrize("name", ["falcon", "bigcode"])
def test_run_with_fused_parts_equals_torch_eager(name: str) -> None:
    """`spmdkit run --hf` on 4 gloo processes (dp=2 x tp=2, megatron, torch kernels): the parts
    of Falcon's query_key_value and GPTBigCode's c_attn start as the slices of the module's
    weights, and the loss and every gradient (a part's: torch autograd's slice) equal torch
    eager's; over tp only the plan's all-reduces (2 + 4 per layer, + 1 each way outside)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    cls, cfg = _RUN[name]
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root / "src"))
    p = subprocess.run([sys.executable, "-m", "spmdkit", "run", "--json", "--kernels", "torch", "--timeout", "120",
                        "--hf", cls, "--hf-config", json.dumps(cfg), "--mesh", "dp=2,tp=2"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["ok"] and rep["collectives_match"] and not rep["failures"] and rep["nonfinite"] == 0
    eager = rep["eager"]
    # parameter tensors: Falcon 2 x 4 linears (qkv as 3 parts: + 2) + 2 x 2 norms + embedding, final norm
    n_params = {"falcon": 2 * (4 + 2) + 2 * 2 + 1 + 2, "bigcode": 36}[name]
    assert eager["checked"] == 1 + n_params and not eager["failures"] and eager["max_rel_error"] <= 1e-5
    tp = Counter(c["kind"] for c in rep["collectives"] if c["mesh_dim"] == 1)
    assert tp == Counter(all_reduce=2 * (2 + 4) + 2)


def test_a_tiny_replicated_share_reads_below_a_tenth_of_a_percent() -> None:
    """Qwen2-MoE's shared_expert_gate (a hidden -> 1 linear, no tensor-parallel role) is the one
    layer left replicated: 64 weights of 168,576 (embed and lm_head 2 x 256 x 64, attention
    2 x 64 x 64 + 2 x 64 x 32 and its q/k/v biases 64 + 2 x 32, 3 norms x 64, the router 64 x 4,
    4 experts and the shared one 5 x 3 x 64 x 128, the gate 64) is 0.038%, which '.1%' prints as
    0.0%: it reads '<0.1%'."""
    from spmdkit.models.hf import import_hf

    cfg = {**C, "num_hidden_layers": 1, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = import_hf("Qwen2MoeForCausalLM", cfg, batch=2, seq=16, seed=0)[0]
    total = sum(int(np.prod(prog.tensors[p].shape)) for p in prog.parameters())
    assert total == 2 * 256 * 64 + 2 * 64 * 64 + 2 * 64 * 32 + 64 + 2 * 32 + 3 * 64 + 64 * 4 + 5 * 3 * 64 * 128 + 64 == 168576
    assert f"{64 / total:.1%}" == "0.0%"
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        plan_program(prog, "tp=2", "megatron")
    msgs = [str(w.message) for w in got if "left replicated" in str(w.message)]
    assert len(msgs) == 1 and "1 layer left replicated over tp, <0.1% of the parameters" in msgs[0], msgs
    assert "model.layers.*.mlp.shared_expert_gate;" in msgs[0]
