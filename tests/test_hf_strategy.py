"""Strategies on imported HuggingFace programs (spmdkit.strategies.hf, ``spmdkit plan --hf``):
megatron by module names with a vocab-parallel loss, dp, zero, the user's patterns, and the
simulator agreeing with the unsharded step on the model's own weights and inputs.

Tiny models (2 layers, hidden 64, 4 heads, vocab 256, batch 2, seq 16), imported once per
module. Collective counts are per phase on a dp=2 x tp=2 mesh; ``tp`` ones are those over the
tp mesh dim. With 2 layers, Llama's 2 all-reduces per layer each way give 4, plus one each way
outside the layers: the vocab-parallel embedding's output (forward) and the LM head's input
gradient (backward). The dp ones of the forward step are the loss's two scalars (the sum of
token losses and the count of counted tokens: the mean is over the whole batch)."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'spmdkit[torch]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'spmdkit[hf]')")

from spmdkit.core.errors import ProgramError  # noqa: E402
from spmdkit.planner.planning import plan_program  # noqa: E402
from spmdkit.strategies.hf import annotate_program, optimizer_of, tp_roles, vocab_parallel_loss  # noqa: E402
from spmdkit.strategies.strategy import parse_mesh, parse_strategy  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

V = 256
_COMMON = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
           "vocab_size": V, "max_position_embeddings": 64}
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {"num_key_value_heads": 2, **_COMMON}),
    "gpt2": ("GPT2LMHeadModel", {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": V, "n_positions": 64,
                                 "bos_token_id": 0, "eos_token_id": 0}),
    "phi": ("PhiForCausalLM", {"num_key_value_heads": 4, **_COMMON}),
    "bert": ("BertForMaskedLM", dict(_COMMON)),  # post-LN, padding_idx 0
}


@pytest.fixture(scope="module")
def imported() -> Callable[[str], Any]:
    """``imported(name)`` -> (program, model, kwargs), imported once per module, seeded."""
    from spmdkit.models.hf import import_hf

    cache: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in cache:
            cls, cfg = CONFIGS[name]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                cache[name] = import_hf(cls, cfg, batch=2, seq=16, seed=0)
        return cache[name]

    return get


def _counts(plan: Any, phase: str, dim: str | None = None) -> Counter[str]:
    names = plan.mesh.dim_names
    return Counter(s.kind for _r, s in plan.collectives(phase)
                   if dim is None or any(names[d] == dim for d in s.mesh_dims))


def _plan(imported: Callable[[str], Any], name: str, mesh: str, strategy: str, **kw: Any) -> tuple[Any, Any]:
    prog, _model, _kw = imported(name)
    return plan_program(prog, mesh, strategy, **kw)


def test_llama_megatron_two_all_reduces_per_layer_each_way(imported: Callable[[str], Any]) -> None:
    prog, plan = _plan(imported, "llama", "dp=2,tp=2", "megatron")
    assert _counts(plan, "forward", "tp") == Counter(all_reduce=2 * 2 + 1)
    assert _counts(plan, "backward", "tp") == Counter(all_reduce=2 * 2 + 1)
    assert _counts(plan, "forward", "dp") == Counter(all_reduce=2)  # the loss sum and the token count
    a = plan.attrs
    assert a["model.layers.0.self_attn.q_proj.weight"].dims_mapping == (1, -1)  # column: [out, in]
    assert a["model.layers.0.self_attn.o_proj.weight"].dims_mapping == (-1, 1,)  # row
    assert a["model.layers.1.mlp.down_proj.weight"].dims_mapping == (-1, 1,)
    assert a["model.embed_tokens.weight"].dims_mapping == (1, -1)  # vocab
    assert a["lm_head.weight"].dims_mapping == (1, -1)
    # the loss is Megatron's vocab-parallel cross entropy, and its optimizer states follow the params
    assert [op.rule for op in prog.ops if "softmax_with_cross_entropy" in op.rule] == \
        ["c_softmax_with_cross_entropy", "c_softmax_with_cross_entropy_grad"]
    assert a["model.layers.0.mlp.up_proj.weight.moment1"].dims_mapping == (1, -1)


@pytest.mark.parametrize("name", ["llama", "gpt2", "phi"])
def test_megatron_never_gathers_the_logits(imported: Callable[[str], Any], name: str) -> None:
    prog, plan = _plan(imported, name, "dp=2,tp=2", "megatron")
    moved = [(r.tensor, s.kind) for r, s in plan.collectives()
             if len(prog.tensors[r.tensor].shape) >= 2 and prog.tensors[r.tensor].shape[-1] == V
             and prog.tensors[r.tensor].kind not in ("parameter", "optimizer_state")
             and r.tensor.removesuffix(".grad") not in prog.parameters()]  # GPT-2's c_fc is [64, 256] too
    assert moved == []
    logits = next(op.inputs["x"] for op in prog.ops if op.rule == "c_softmax_with_cross_entropy")
    assert plan.attrs[logits].dims_mapping[-1] == 1  # vocab-sharded over tp


def test_phi_megatron_counts(imported: Callable[[str], Any]) -> None:
    # Phi's parallel attention + MLP block: both row outputs are summed before one all-reduce
    # would do, but the rules reduce each (2 per layer forward); backward one per layer
    _, plan = _plan(imported, "phi", "dp=2,tp=2", "megatron")
    assert _counts(plan, "forward", "tp") == Counter(all_reduce=2 * 2 + 1)
    assert _counts(plan, "backward", "tp") == Counter(all_reduce=1 * 2 + 1)


def test_dp_only_gradient_all_reduces(imported: Callable[[str], Any]) -> None:
    prog, _m, _k = imported("llama")
    _, plan = plan_program(prog, "dp=2", "dp")
    for n in ("input_ids", "attention_mask", "labels"):
        assert plan.attrs[n].dims_mapping == (0, -1)
    assert _counts(plan, "backward") == Counter()
    assert _counts(plan, "optimizer") == Counter(all_reduce=len(prog.parameters()))
    fwd = [(r.tensor, s.kind) for r, s in plan.collectives("forward")]
    assert sorted(fwd) == [("cross_entropy_loss.count", "all_reduce"), ("cross_entropy_loss.loss_sum", "all_reduce")]


def test_zero_shards_optimizer_states(imported: Callable[[str], Any]) -> None:
    prog, _m, _k = imported("llama")
    _, plan = plan_program(prog, "dp=2", "dp,zero")
    n = len(prog.parameters())
    # ZeRO-2: each gradient reduce-scattered as the backward makes it, the update on the
    # shards, the updated parameter all-gathered
    assert _counts(plan, "backward") == Counter(reduce_scatter=n)
    assert _counts(plan, "optimizer") == Counter(all_gather=n)
    assert plan.attrs["model.layers.0.mlp.gate_proj.weight.moment2"].dims_mapping == (0, -1)
    assert plan.attrs["model.norm.weight.moment1"].dims_mapping == (0,)
    assert plan.attrs["model.norm.weight"].dims_mapping == (-1,)


def test_replicated_projection_updates_on_its_own_layout(imported: Callable[[str], Any]) -> None:
    """o_proj / down_proj replicated by pattern: their gradients come out tp-sharded; the update
    runs replicated (the gradient gathered once), never leaving the parameter or its moments
    sharded or gathering the moments after it."""
    prog, _m, _k = imported("llama")
    prog, plan = plan_program(prog, "dp=2,tp=2", "megatron",
                              patterns={"o_proj": "replicate", "down_proj": "replicate"})
    opt = optimizer_of(prog)
    for p in ("model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        _g, states, new, new_states = opt[p]
        assert plan.attrs[p].dims_mapping == (-1, -1)
        for n in (new, *states, *new_states):
            assert plan.attrs[n] == plan.attrs[p], n
    moved = {r.tensor for r, _s in plan.collectives("optimizer")}
    assert not [n for n in moved if prog.tensors[n].kind != "gradient"]


def test_zero3_gathers_parameters_per_phase(imported: Callable[[str], Any]) -> None:
    prog, _m, _k = imported("llama")
    _, plan = plan_program(prog, "dp=2", "fsdp")
    n = len(prog.parameters())
    stored = set(plan.storage)
    assert len(stored) == n
    fwd = Counter(r.tensor for r, s in plan.collectives("forward") if s.kind == "all_gather")
    assert set(fwd) == stored and set(fwd.values()) == {1}
    assert _counts(plan, "backward")["reduce_scatter"] == n
    assert not plan.collectives("optimizer")


def test_heads_must_divide_tp_or_a_pattern_says_otherwise(imported: Callable[[str], Any]) -> None:
    prog, _m, _k = imported("llama")  # 4 heads, 2 kv heads
    # kv heads fewer than tp (and dividing it): replicated, as Megatron does, and said so
    with pytest.warns(UserWarning, match=r"model\.layers\.\*\.self_attn\.k_proj \(2 layers\) makes 2 heads, "
                                         r"fewer than tp=4"):
        _, plan = plan_program(prog, "tp=4", "megatron")
    assert plan.attrs["model.layers.1.self_attn.v_proj.weight"].dims_mapping == (-1, -1)
    assert plan.attrs["model.layers.1.self_attn.q_proj.weight"].dims_mapping == (0, -1)
    # heads tp does not divide, or a user's explicit column: refused, naming the module
    with pytest.raises(ProgramError, match=r"model\.layers\.0\.self_attn\.q_proj .*4 heads.*tp=8"):
        plan_program(prog, "tp=8", "megatron")
    with pytest.raises(ProgramError, match=r"model\.layers\.0\.self_attn\.k_proj .*2 heads.*tp=4"):
        plan_program(prog, "tp=4", "megatron", patterns={"k_proj": "column"})
    pats = {"*.k_proj": "replicate", "re:.*\\.v_proj": "replicate"}
    _, plan = plan_program(prog, "tp=4", "megatron", patterns=pats)
    assert plan.attrs["model.layers.0.self_attn.k_proj.weight"].dims_mapping == (-1, -1)
    assert plan.attrs["model.layers.0.self_attn.v_proj.weight"].dims_mapping == (-1, -1)
    assert plan.attrs["model.layers.0.self_attn.q_proj.weight"].dims_mapping == (0, -1)
    with pytest.raises(ProgramError, match="role 'columns'"):
        tp_roles(prog, {"q_proj": "columns"})


def test_a_tp_plan_pattern_matching_no_module_is_named(imported: Callable[[str], Any]) -> None:
    """A --tp-plan pattern that matches no module holding a parameter (a misspelt name) decides
    nothing: one warning naming it, with the closest module name; a matching one says nothing."""
    prog, _m, _k = imported("llama")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, plan = plan_program(prog, "tp=2", "megatron", patterns={"*.qq_proj": "replicate", "*.k_proj": "replicate"})
    said = [str(w.message) for w in caught if str(w.message).startswith("--tp-plan")]
    assert said == ["--tp-plan: '*.qq_proj' matches no module of the model holding a parameter (did you mean "
                    "'q_proj'?): it decides nothing"]
    assert plan.attrs["model.layers.0.self_attn.q_proj.weight"].dims_mapping == (0, -1)  # not replicated


def test_user_pattern_wins_and_bert_dense_layout() -> None:
    # names only (no import): BERT's dense layers and a user's override, first match wins
    from spmdkit.strategies.hf import DEFAULT_PATTERNS, role_of

    d = list(DEFAULT_PATTERNS)
    assert role_of("bert.encoder.layer.0.attention.output.dense", d) == "row"
    assert role_of("bert.encoder.layer.0.intermediate.dense", d) == "column"
    assert role_of("bert.encoder.layer.0.output.dense", d) == "row"
    assert role_of("bert.encoder.layer.0.attention.self.query", d) == "column"
    assert role_of("cls.predictions.transform.dense", d) == "replicate"
    assert role_of("model.layers.0.self_attn.dense", d) == "row"  # Phi
    assert role_of("decoder.block.0.layer.2.DenseReluDense.wi", d) == "column"
    assert role_of("encoder.block.0.layer.0.SelfAttention.o", d) == "row"
    assert role_of("encoder.block.0.layer.0.SelfAttention.relative_attention_bias", d) == "column"
    assert role_of("transformer.h.0.attn.c_attn", d) == "column"  # fused q/k/v, split head-wise
    assert role_of("model.layers.0.input_layernorm", d) is None
    assert role_of("model.layers.0.mlp.up_proj", [("re:model\\.layers\\.0\\..*", "replicate"), *d]) == "replicate"


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert"])
def test_simulator_agrees_on_four_ranks(imported: Callable[[str], Any], name: str) -> None:
    """dp=2 x tp=2 megatron, the sharded step against the unsharded one on the model's own
    weights and inputs (labels with -100: the vocab-parallel loss's ignore_index)."""
    import spmdkit.sim.plan as sim
    from spmdkit.models.torch_import import torch_values

    prog, model, kw = imported(name)
    assert (kw["labels"] == -100).any()
    prog, plan = plan_program(prog, "dp=2,tp=2", "megatron")
    vals = torch_values(prog, model, (), kw)
    rep = sim.simulate_plan(plan, rtol=1e-6, atol=1e-8, values=vals)
    assert rep.failures == []  # the masked scores' -inf included: they must match exactly
    assert rep.checked > 300


def test_vocab_parallel_loss_keeps_ignore_index(imported: Callable[[str], Any]) -> None:
    prog, _m, _k = imported("llama")
    new = vocab_parallel_loss(prog)
    assert new is not prog and prog.ops is not new.ops
    ops = [op for op in new.ops if op.rule.startswith("c_softmax")]
    assert [op.attrs for op in ops] == [{"ignore_index": -100}] * 2
    assert new.loss == prog.loss and new.sources == prog.sources  # an ImportedProgram still
    assert any(op.rule == "cross_entropy_with_softmax" for op in prog.ops)  # the original untouched


def test_program_json_keeps_what_the_strategy_reads(imported: Callable[[str], Any], tmp_path: Any,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from spmdkit.cli import main

    prog, _m, _k = imported("llama")
    f = tmp_path / "llama.json"
    f.write_text(prog.dumps())
    assert main(["plan", "--program", str(f), "--mesh", "dp=2,tp=2", "--strategy", "megatron", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    t = out["tensors"]
    assert t["model.layers.0.self_attn.q_proj.weight"]["dims_mapping"] == [1, -1]
    assert t["input_ids"]["dims_mapping"] == [0, -1]
    assert set(t["const_0"]["dims_mapping"]) == {-1}  # a recorded constant (the rotary positions), replicated
    # tp=4 > 2 kv heads: k / v replicated, one warning line for each module over the layers
    # (it was one a layer: 4 lines at 2 layers, 64 for Llama-3-8B on tp=16)
    assert main(["plan", "--program", str(f), "--mesh", "tp=4", "--strategy", "megatron", "--json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["tensors"]["model.layers.0.self_attn.k_proj.weight"]["dims_mapping"] == [-1, -1]
    assert cap.err.strip().splitlines() == [
        f"spmdkit plan: warning: --strategy megatron: model.layers.*.self_attn.{m}_proj (2 layers) makes 2 heads, "
        f"fewer than tp=4: replicated over tp (its gradients are all-reduced)" for m in "kv"]


def test_cli_refusals_are_one_line(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from spmdkit.cli import main

    cfg = json.dumps(CONFIGS["llama"][1])
    for argv, word in [(["--hf", "LlamaForCausalLM"], "--hf-config"),
                       (["--hf-config", cfg], "--hf-config"),
                       (["--hf", "LlamaForCausalLM", "--hf-config", cfg, "--tp-plan", '{"q_proj": "col"}'], "--tp-plan"),
                       (["--hf", "NoSuchModel", "--hf-config", cfg], "NoSuchModel"),
                       (["--hf", "LlamaForCausalLM", "--hf-config", cfg, "--strategy", "megatron,sp",
                         "--mesh", "dp=2"], "tp"),
                       (["--tp-plan", "{}"], "--tp-plan")]:
        assert main(["plan", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and word in err and "Traceback" not in err, (argv, err)


def test_annotate_program_refuses_indivisible_batch(imported: Callable[[str], Any]) -> None:
    prog, _m, _k = imported("llama")
    mesh = parse_mesh("dp=4")
    with pytest.raises(ProgramError, match="input_ids has batch size 2"):
        annotate_program(prog, mesh, parse_strategy("dp", mesh))


def test_bert_post_ln_and_padding_idx(imported: Callable[[str], Any]) -> None:
    """BERT: one all-reduce per row-parallel layer each way (the q/k/v input gradients summed
    before one reduction, not reduced each before the add_n with the residual's), plus the
    vocab-parallel embedding (forward) and the MLM head's input gradient (backward); the
    padding_idx table is never all-gathered."""
    prog, plan = _plan(imported, "bert", "dp=2,tp=2", "megatron")
    assert _counts(plan, "forward", "tp") == Counter(all_reduce=2 * 2 + 1)
    assert _counts(plan, "backward", "tp") == Counter(all_reduce=2 * 2 + 1)
    table = "bert.embeddings.word_embeddings.weight"
    assert plan.attrs[table].dims_mapping == (1, -1)
    assert not [r for r in plan.reshards if r.tensor == table]
    assert [op.attrs["padding_idx"] for op in prog.ops if op.rule.startswith("embedding")
            and op.inputs["weight"] == table] == [-1, -1]


def test_padding_idx_rewrite_keeps_the_step(imported: Callable[[str], Any]) -> None:
    """The rewritten program (padding_idx lookups as torch's forward, padding positions'
    gradients masked) computes the same loss and gradients as the imported one on BERT's own
    weights and inputs, which include the padding id 0 (the zero row stays zero)."""
    from spmdkit.execute.single import run_program
    from spmdkit.models.torch_import import torch_values
    from spmdkit.strategies.hf import megatron_program

    prog, model, kw = imported("bert")
    kw = dict(kw)
    kw["input_ids"] = kw["input_ids"].clone()
    kw["input_ids"][:, :3] = 0  # the padding id, here: its rows must get no gradient
    new = megatron_program(prog)
    assert new is not prog and any(op.rule == "full_like" for op in new.ops)
    a = run_program(prog, torch_values(prog, model, (), kw))
    b = run_program(new, torch_values(new, model, (), kw))
    import numpy as np

    assert np.isfinite(a[prog.loss]) and abs(float(a[prog.loss]) - float(b[new.loss])) <= 1e-12
    for p, g in prog.grads.items():
        assert np.allclose(a[g], b[new.grads[p]], rtol=0, atol=1e-12), p
    # the lookup's own contribution (the table is tied to the MLM decoder, whose adds to row 0)
    (eg,) = [op.outputs[0] for op in new.ops if op.rule == "embedding_grad"
             and op.inputs["weight"] == "bert.embeddings.word_embeddings.weight"]
    assert not b[eg][0].any() and b[eg][1:].any()


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_sequence_parallel_counts(imported: Callable[[str], Any], name: str) -> None:
    """megatron,sp: the all-reduces become all-gather / reduce-scatter pairs, 2 of each per layer
    each way (+ one outside the layers: the embedding's reduce-scatter and the head's gather
    forward, their transposes backward); the norms' weight gradients (partial over tp: each rank
    saw its sequence shard) are all-reduced over tp before the update, as in Megatron."""
    prog, plan = _plan(imported, name, "dp=2,tp=2", "megatron,sp")
    assert _counts(plan, "forward", "tp") == Counter(reduce_scatter=2 * 2 + 1, all_gather=2 * 2 + 1)
    assert _counts(plan, "backward", "tp") == Counter(reduce_scatter=2 * 2 + 1, all_gather=2 * 2 + 1)
    # over tp in the optimizer phase: only all-reduces of the gradients of tp-replicated parameters
    grad_of = {v[0]: p for p, v in optimizer_of(prog).items()}
    opt = [(r.tensor, s.kind) for r, s in plan.collectives("optimizer") if 1 in s.mesh_dims]
    assert {k for _, k in opt} == {"all_reduce"}
    assert all(1 not in plan.attrs[grad_of[t]].dims_mapping for t, _ in opt)
    if name == "llama":
        assert len(opt) == 5  # the 4 layer norms' and the final norm's weights'
    if name == "llama":
        assert plan.attrs["add_6"].dims_mapping == (0, 1, -1)  # the residual stream: sequence over tp
        assert plan.attrs["mul_4"].dims_mapping == (0, -1, -1)  # the q/k/v input: gathered


def test_simulator_agrees_under_sequence_parallel(imported: Callable[[str], Any]) -> None:
    import spmdkit.sim.plan as sim
    from spmdkit.models.torch_import import torch_values

    prog, model, kw = imported("llama")
    prog, plan = plan_program(prog, "dp=2,tp=2", "megatron,sp")
    vals = torch_values(prog, model, (), kw)
    rep = sim.simulate_plan(plan, rtol=1e-6, atol=1e-8, values=vals)
    assert rep.failures == []
    assert rep.checked > 300


def test_cli_plans_an_hf_model(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """``spmdkit plan --hf CLASS --hf-config FILE`` end to end (the config from a file, bf16)."""
    from spmdkit.cli import main

    f = tmp_path / "config.json"
    f.write_text(json.dumps(CONFIGS["llama"][1]))
    assert main(["plan", "--hf", "LlamaForCausalLM", "--hf-config", str(f), "--dtype", "bf16", "--batch", "4",
                 "--mesh", "dp=2,tp=2", "--strategy", "megatron,sp", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    t = out["tensors"]
    assert t["model.layers.1.mlp.gate_proj.weight"]["dims_mapping"] == [1, -1]
    assert t["model.layers.1.mlp.gate_proj.weight"]["dtype"] == "bfloat16"
    assert t["input_ids"]["shape"] == [4, 16] and t["input_ids"]["dims_mapping"] == [0, -1]
    tp_fwd = Counter(st["kind"] for r in out["reshards"] if r["phase"] == "forward" and not r["shared"]
                     for st in r["steps"] if st["mesh_dims"] == [1] and st["bytes_per_rank"] > 0)
    assert tp_fwd == Counter(reduce_scatter=5, all_gather=5)


def test_data_inputs_of_a_program_file(imported: Callable[[str], Any]) -> None:
    """A program JSON has no sources: the batch-leading inputs are the data, not the rotary
    buffer or the recorded constants."""
    from spmdkit.program.ir import program_from_json
    from spmdkit.strategies.hf import data_inputs

    prog, _m, _k = imported("llama")
    plain = program_from_json(json.loads(prog.dumps()))
    assert sorted(data_inputs(plain)) == ["attention_mask", "input_ids", "labels"] == sorted(data_inputs(prog))


def test_gpt2_fused_qkv_is_split_head_wise(imported: Callable[[str], Any]) -> None:
    """GPT-2's fused c_attn ([in, 3 * hidden], Conv1D) becomes q / k / v projections on
    parameters of their own (the slices of the module's weight): each column-parallel (heads
    over tp) and stored sharded, so the attention is tensor parallel with Llama's 2
    all-reduces per layer each way and no weight-sized collective. The rewritten step equals
    the imported one on GPT-2's own weights (the fused weight's gradient: its parts')."""
    import numpy as np

    from spmdkit.execute.single import run_program
    from spmdkit.models.torch_import import torch_values
    from spmdkit.strategies.hf import megatron_program

    prog, model, kw = imported("gpt2")
    planned, plan = plan_program(prog, "dp=2,tp=2", "megatron")
    assert plan.attrs["transformer.h.0.attn.c_attn.weight.part1"].dims_mapping == (-1, 1)  # Conv1D [in, out]
    assert plan.attrs["transformer.h.0.attn.c_attn.bias.part2"].dims_mapping == (1,)
    assert "transformer.h.0.attn.c_attn.weight" not in planned.tensors
    assert _counts(plan, "forward", "tp") == Counter(all_reduce=2 * 2 + 1)
    assert _counts(plan, "backward", "tp") == Counter(all_reduce=2 * 2 + 1)
    rewritten = megatron_program(prog)
    assert not any(op.rule == "split" for op in rewritten.ops)
    a = run_program(prog, torch_values(prog, model, (), kw))
    b = run_program(rewritten, torch_values(rewritten, model, (), kw))
    assert np.isfinite(a[prog.loss]) and abs(float(a[prog.loss]) - float(b[rewritten.loss])) <= 1e-12
    for p, g in prog.grads.items():
        got = np.concatenate([b[rewritten.grads[f"{p}.part{j}"]] for j in range(3)], axis=-1) \
            if ".c_attn." in p else b[rewritten.grads[p]]
        assert np.allclose(a[g], got, rtol=1e-10, atol=1e-12), p


def test_full_recompute_on_an_imported_model(imported: Callable[[str], Any]) -> None:
    """Imported ops are labelled by their numbered block (model.layers.0, ...), so --recompute
    full keeps only what each transformer layer reads from outside it."""
    from spmdkit.cost.memory_saved import saved_activations

    prog, _, _ = imported("llama")
    assert {op.layer for op in prog.ops if op.phase == "forward"} >= {"model.layers.0", "model.layers.1"}
    _, plan = plan_program(prog, "dp=2,tp=2", "megatron")
    none, full = saved_activations(plan, "none"), saved_activations(plan, "full")
    kept = {k: [n for n, _ in v] for k, v in full.tensors.items()}
    # layer 1 keeps its input (the residual stream leaving layer 0), nothing it makes itself
    assert len(kept["model.layers.1"]) == 1
    assert full.layer("model.layers.1") * 10 < none.layer("model.layers.1")
    assert len(full.recomputed) == 2  # one region per layer


def test_an_hf_batch_dp_does_not_divide_names_batch(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """An --hf model traced at the default batch 2 on dp=4 was refused as '--strategy dp: input
    input_ids has batch size 2, which dp=4 does not divide', naming no flag that changes it: the line
    says the batch is --batch's (a --program file's its own)."""
    from spmdkit.cli import main

    f = tmp_path / "config.json"
    f.write_text(json.dumps(CONFIGS["llama"][1]))
    assert main(["plan", "--hf", "LlamaForCausalLM", "--hf-config", str(f), "--mesh", "dp=4", "--strategy", "dp"]) == 2
    assert capsys.readouterr().err.strip() == (
        "spmdkit plan: ProgramError: --strategy dp: input input_ids has batch size 2, which dp=4 does not divide (each "
        "rank whole sequences; an --hf model is traced at --batch sequences, a --program file at its own)")
