"""Context parallelism of HuggingFace models (``--hf ... --strategy ...,cp``; docs/context.md): the
step traced in zig-zag token order with cp_attention, planned with nothing moved over cp outside
attention, simulated equal to the unsharded step, run on gloo equal to torch eager in natural order."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from spmdkit.core.errors import ProgramError
from spmdkit.models.hf import import_hf
from spmdkit.models.hf_cp import cp_order
from spmdkit.planner.planning import plan_hf
from spmdkit.sim.verify_plan import verify_hf

ROOT = Path(__file__).resolve().parents[1]
LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 64}
QWEN = {**LLAMA, "num_key_value_heads": 4}
#: Falcon-7B's form without ALiBi (multi-query): its plain causal mask is built on request and dropped at sdpa
FALCON = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64, "alibi": False,
          "max_position_embeddings": 64}


def test_zigzag_order_and_the_traced_call() -> None:
    """Rank i holds chunks i and 2cp-1-i; the call is the tokens in that order, position_ids their
    positions, shift_labels the labels shifted before the permutation; eager keeps the natural call."""
    assert cp_order(8, 2, "zigzag") == [0, 1, 6, 7, 2, 3, 4, 5]
    prog, _m, kw = import_hf("LlamaForCausalLM", json.dumps(LLAMA), batch=2, seq=8, cp=(2, "ring", "zigzag"))
    nat = prog.eager_kwargs
    order = [0, 1, 6, 7, 2, 3, 4, 5]
    assert kw["input_ids"].tolist() == nat["input_ids"][:, order].tolist()
    assert kw["position_ids"][0].tolist() == order
    lab = nat["labels"]
    for i, p in enumerate(order):
        assert kw["shift_labels"][:, i].tolist() == (lab[:, p + 1].tolist() if p < 7 else [-100, -100])
    ops = [op for op in prog.ops if op.rule == "cp_attention"]
    assert len(ops) == 2 and {op.attrs["variant"] for op in ops} == {"ring"}
    # the loss reads the unflattened [batch, seq, vocab] logits (a flatten would move the sequence)
    ce = next(op for op in prog.ops if op.rule == "cross_entropy_with_softmax")
    assert prog.tensors[ce.inputs["x"]].shape == (2, 8, 64)


def _over_cp(plan: object, cp: int) -> list[str]:
    """The tensors a reshard moves over the cp mesh dim that are not attention's q / k / v (or
    their grads), a scalar of the loss, or a parameter's gradient."""
    prog = plan.program  # type: ignore[attr-defined]
    params = {n for n, t in prog.tensors.items() if t.kind == "parameter"}
    got = []
    for r in plan.reshards:  # type: ignore[attr-defined]
        if not any(cp in s.mesh_dims for s in r.plan.steps):
            continue
        n = r.tensor
        if n.startswith("scaled_dot_product_attention") or not prog.tensors[n].shape \
                or n.removesuffix(".grad") in params:
            continue
        got.append(n)
    return got


@pytest.mark.parametrize(("mesh", "strategy", "attention"), [
    ("dp=1,cp=2", "cp", 8),  # allgather: k, v gathered (the backward reuses them), dK, dV reduce-scattered
    ("dp=1,cp=2", "cp,cp-attention=ring", 0),  # the ring passes the blocks inside the kernel
    ("dp=1,cp=2,tp=2", "megatron,cp", 8),
    ("dp=1,cp=2,tp=2", "megatron,sp,cp", 8),
])
def test_nothing_moves_over_cp_outside_attention(mesh: str, strategy: str, attention: int) -> None:
    _p, _m, _kw, plan = plan_hf("LlamaForCausalLM", LLAMA, mesh, strategy, "float32", 2, 16)
    cp = plan.mesh.dim_index("cp")
    assert _over_cp(plan, cp) == []
    att = [r for r in plan.reshards if r.tensor.startswith("scaled_dot_product_attention")
           and any(cp in s.mesh_dims for s in r.plan.steps) and not r.shared]
    assert len(att) == attention


@pytest.mark.parametrize(("model", "mesh", "strategy"), [
    ("LlamaForCausalLM", "dp=1,cp=2,tp=2", "megatron,sp,cp"),
    ("Qwen2ForCausalLM", "dp=2,cp=2", "dp,cp,cp-attention=alltoall"),
    ("FalconForCausalLM", "dp=1,tp=2", "megatron,sp"),  # refused under cp until its mask was found plain causal
    ("FalconForCausalLM", "dp=2,cp=2", "dp,cp"),
    ("FalconForCausalLM", "dp=1,cp=2,tp=2", "megatron,sp,cp"),
])
def test_verify_simulates_equal(model: str, mesh: str, strategy: str) -> None:
    cfg = QWEN if model.startswith("Qwen") else FALCON if model.startswith("Falcon") else LLAMA
    v = verify_hf(model, cfg, mesh, strategy)
    assert v["ok"] and v["checked"] > 300, v["text"]


def test_a_mask_no_attention_reads_is_no_reason_to_refuse_cp() -> None:
    """Qwen2-MoE's config sets sliding_window 0 without use_sliding_window and its model builds a
    sliding-window mask beside the causal one, though every layer is full attention: cp was refused
    ('attention has sliding window 0 <= seq 16'); the mask no sdpa call reads is no reason now, and
    the plan verifies."""
    moe = {**QWEN, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 64}
    v = verify_hf("Qwen2MoeForCausalLM", moe, "dp=2,cp=2", "dp,cp")
    assert v["ok"] and v["checked"] > 300, v["text"]


def test_what_cannot_be_split_by_position_is_refused_by_name() -> None:
    with pytest.raises(ProgramError, match=r"^--pad 2 with --strategy cp: a padded batch needs its padding mask"):
        import_hf("LlamaForCausalLM", json.dumps(LLAMA), seq=8, pad=2, cp=(2, "allgather", "zigzag"))
    mistral = {**LLAMA, "sliding_window": 4}
    with pytest.raises(ProgramError) as e:
        import_hf("MistralForCausalLM", json.dumps(mistral), seq=8, cp=(2, "allgather", "zigzag"))
    assert str(e.value) == ("--strategy cp: MistralForCausalLM's attention has sliding window 4 <= seq 8: context "
                            "parallelism splits causal attention with no mask or bias only")
    falcon = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 64, "alibi": True}
    with pytest.raises(ProgramError) as e:  # ALiBi added onto its mask: it said 'has the model has'
        import_hf("FalconForCausalLM", json.dumps(falcon), seq=8, cp=(2, "allgather", "zigzag"))
    assert str(e.value) == ("--strategy cp: FalconForCausalLM's attention has a mask the model builds in full (HF "
                            "builds it so for a bias such as ALiBi, overlays or packed sequences): context "
                            "parallelism splits causal attention with no mask or bias only")
    with pytest.raises(ProgramError, match=r"^--mesh cp=2: the sequence of 6 tokens does not split into 2 x cp = 4"):
        import_hf("LlamaForCausalLM", json.dumps(LLAMA), seq=6, cp=(2, "allgather", "zigzag"))
    with pytest.raises(ProgramError, match=r"cp x tp = 4 does not divide the model's 2 kv heads"):
        plan_hf("LlamaForCausalLM", LLAMA, "cp=2,tp=2", "megatron,cp,cp-attention=alltoall", "float32", 2, 16)


def _spmdkit(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, "-m", "spmdkit", *args], capture_output=True, text=True, env=env,
                          timeout=500)


@pytest.mark.parametrize(("model", "variant"), [("LlamaForCausalLM", "allgather"), ("Qwen2ForCausalLM", "ring")])
def test_run_on_gloo_equals_torch_eager(model: str, variant: str) -> None:
    """2 gloo processes on cp=2: every tensor equal to its op run unsharded, and the loss and every
    parameter gradient equal to torch eager's step on the tokens in natural order."""
    cfg = QWEN if model.startswith("Qwen") else LLAMA
    p = _spmdkit("run", "--hf", model, "--hf-config", json.dumps(cfg), "--mesh", "dp=1,cp=2", "--strategy", "cp",
                 "--cp-attention", variant, "--seq", "8", "--batch", "2", "--json", "--warmup", "0", "--timeout", "200")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["ok"] and rep["collectives_match"] and not rep["failures"], rep["failures"]
    eager = rep["eager"]
    assert eager["checked"] >= 20 and not eager["failures"], eager
    assert rep["loss"] == pytest.approx(eager["loss"], rel=1e-5)


def _plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    from spmdkit.cli import main

    rc = main(["plan", *argv, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0 and "Traceback" not in err, err[-3000:]
    doc: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return doc


@pytest.mark.parametrize(("model", "variant"), [(m, v) for m in ("LlamaForCausalLM", "Qwen2ForCausalLM")
                                                for v in ("allgather", "ring", "alltoall")])
def test_an_hf_pipeline_with_cp_plans_as_the_flat_step_and_verifies(model: str, variant: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """pp=2 with cp=2 on an --hf model (refused until 2026-12-07): each microbatch is traced in the cp ranks'
    token order, so the stages' plan is the flat plan of one microbatch (the same shardings and reshards:
    cp_attention of the variant, nothing over cp outside attention); --verify simulates 2 microbatches
    against the whole batch traced in the same order (it gave NaN losses, the whole batch's reference
    traced in natural order and its constants taken by name for the stages')."""
    cfg = json.dumps(QWEN if model.startswith("Qwen") else LLAMA)
    common = ["--hf", model, "--hf-config", cfg, "--strategy", "cp", "--cp-attention", variant, "--seq", "16"]
    piped = _plan_json(capsys, *common, "--mesh", "pp=2,dp=1,cp=2", "--batch", "4", "--microbatches", "2",
                       "--verify")
    flat = _plan_json(capsys, *common, "--mesh", "dp=1,cp=2", "--batch", "2")
    assert "shift_labels" in piped["tensors"]  # type: ignore[operator]  # the call traced under cp
    assert piped["tensors"] == flat["tensors"] and piped["reshards"] == flat["reshards"]
    v = piped["verify"]
    assert isinstance(v, dict)
    assert v["ok"] and v["losses_agree"] and not v["failures"] and v["checked"] > 700, v["text"]
    assert v["microbatches"] == 2 and v["stages_in_order"]
    assert math.isfinite(v["loss"]) and v["loss"] > 0


@pytest.mark.parametrize(("mesh", "strategy"), [("pp=2,dp=1,cp=2", "cp"), ("pp=2,cp=2,ep=2", "cp,ep,ep-from=cp")])
def test_an_hf_moe_pipeline_with_cp_verifies(mesh: str, strategy: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny Mixtral (2 layers) in a pipeline with cp: each cp rank routes its own tokens in the stages and
    in the whole batch's reference alike (both traced for cp), the expert group carved from the cp ranks
    too; every tensor equal and the microbatch losses the whole batch's."""
    cfg = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
           "num_local_experts": 4, "num_experts_per_tok": 2}
    doc = _plan_json(capsys, "--hf", "MixtralForCausalLM", "--hf-config", json.dumps(cfg), "--mesh", mesh,
                     "--strategy", strategy, "--seq", "16", "--batch", "4", "--microbatches", "2", "--verify")
    v = doc["verify"]
    assert isinstance(v, dict)
    assert v["ok"] and v["losses_agree"] and v["checked"] > 900 and math.isfinite(v["loss"]), v["text"]


def test_falcon_runs_on_gloo_with_cp_equal_to_torch_eager() -> None:
    """Falcon without ALiBi on cp=2 (refused: 'attention has a mask the model builds in full'): its
    attention is cp_attention, every tensor equal to its op run unsharded, the loss and the 15
    parameter gradients equal to torch eager's step on the tokens in natural order."""
    prog, _m, _kw = import_hf("FalconForCausalLM", json.dumps(FALCON), batch=2, seq=8, cp=(2, "allgather", "zigzag"))
    assert sum(op.rule == "cp_attention" for op in prog.ops) == 2 and prog.notes == []
    p = _spmdkit("run", "--hf", "FalconForCausalLM", "--hf-config", json.dumps(FALCON), "--mesh", "dp=1,cp=2",
                 "--strategy", "cp", "--seq", "8", "--batch", "2", "--json", "--warmup", "0", "--timeout", "200")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["ok"] and rep["collectives_match"] and not rep["failures"], rep["failures"]
    eager = rep["eager"]
    assert eager["checked"] == 16 and not eager["failures"], eager
    assert rep["loss"] == pytest.approx(eager["loss"], rel=1e-5)
