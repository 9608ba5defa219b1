"""Imported (``--hf``) MoE models under context parallelism: each cp rank routes its own tokens.

``import_hf(cp=...)`` traces the call in the cp ranks' token order; its MoE blocks are lowered
routed in ``cp`` chunks of each sequence (the zoo's ``moe_chunks``, docs/experts.md "Under cp"):
the router, the dispatch ``[B, cp, E, C, H]`` (the capacity per chunk), the experts and the
combine on each chunk on its own, HF's flat ``[B x S, H]`` view around the block left out (it
would mix a batch shard's rows with a cp shard's). The chunk axis stays over cp, so nothing moves
over cp around a MoE layer and the all-to-alls over ep carry each rank's own tokens. Tiny
Mixtral / Qwen3-MoE (hidden 32, 4 experts top-2, float32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from conftest import ROOT
from hf_moe_helpers import MIXTRAL, QWEN3, collectives, cp_moe_rows
from spmdkit.models.hf import import_hf
from spmdkit.models.source import moe_note
from spmdkit.planner.planning import plan_hf
from spmdkit.sim.verify_plan import verify_hf

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

def test_the_import_routes_in_one_chunk_a_cp_rank() -> None:
    """cp=2 at seq 16: the dispatch [B, 2, E, C, H] with the dropless capacity of a chunk (8
    tokens), the router on [B, 2, 8, H] read straight from the [B, S, H] tokens (no flat [B x S,
    H] view); without cp one route a sequence."""
    prog, _m, _kw = import_hf("MixtralForCausalLM", json.dumps(MIXTRAL), batch=2, seq=16, cp=(2, "allgather", "zigzag"))
    d = next(op for op in prog.ops if op.rule == "moe_gate_dispatch")
    assert prog.tensors[d.outputs[0]].shape == (2, 2, 4, 8, 32)
    assert prog.tensors[d.inputs["x"]].shape == (2, 2, 8, 32)
    assert not [n for n, t in prog.tensors.items() if t.shape == (32, 32) and t.kind == "activation"]  # [B x S, H]
    assert "capacity 8 tokens an expert a chunk (each sequence routed in 2 chunks, one a cp rank) (dropless)" in \
        moe_note(prog)
    plain, _m, _kw = import_hf("MixtralForCausalLM", json.dumps(MIXTRAL), batch=2, seq=16)
    d = next(op for op in plain.ops if op.rule == "moe_gate_dispatch")
    assert plain.tensors[d.outputs[0]].shape == (2, 4, 16, 32)


@pytest.mark.parametrize("mesh", ["cp=2,ep=2", "dp=2,cp=2,ep=2"])
def test_collectives_by_hand(mesh: str) -> None:
    """Batch 4, seq 16, 1 layer, the capacity uniform (ceil(8 x 2 / 4) = 4 a chunk): forward the
    dispatch and the rows one all-to-all each over ep of the rank's own chunk ([4 / (dp x ep), 1,
    4, 4, 32] float32, half of it sent), attention's k and v gathered over cp, the loss' two
    scalars; backward the two mirrors and k / v's reduce-scatters; nothing else
    over cp around the MoE layer (before: the tokens gathered over cp, the experts' all-to-alls
    of the whole sequence). The experts' gradients over dp x cp, the dense ones over every rank."""
    strategy = ",".join(d.split("=")[0] for d in mesh.split(","))
    _p, _m, _kw, plan = plan_hf("MixtralForCausalLM", MIXTRAL, mesh, strategy, "float32", 4, 16)
    dp = 2 if mesh.startswith("dp") else 1
    rows = 4 // (dp * 2) * 1 * 4 * 4 * 32 * 4  # the rank's [B / (dp x ep), 1 chunk, E, C, H] float32
    a2a = rows // 2  # (ep - 1) / ep of it
    kv = 4 // (dp * 2) * 8 * 2 * 8 * 4  # k / v [B / (dp x ep), S / cp, 2 kv heads, 8] float32, half sent
    every = "x".join(n for n in plan.mesh.dim_names)
    edp = "dpxcp" if dp == 2 else "cp"
    got = collectives(plan)
    acts = {k: v for k, v in got.items() if k[0] != "optimizer"}
    assert acts == cp_moe_rows("cp", every, kv, a2a, plan.mesh.size)
    grads = {k[3]: k[2] for k in got if k[0] == "optimizer"}
    assert {n: d for n, d in grads.items() if ".experts." in n} == {
        f"model.layers.0.mlp.experts.{w}.grad": edp for w in ("gate_up_proj_gate", "gate_up_proj_up", "down_proj_t")}
    assert {d for n, d in grads.items() if ".experts." not in n} == {every}


@pytest.mark.parametrize(("mesh", "strategy"), [
    ("cp=2,ep=2", "cp,ep"), ("dp=1,cp=2,tp=2", "megatron,cp"), ("dp=1,cp=2,tp=2", "megatron,sp,cp"),
    ("cp=2,ep=2,tp=2", "cp,ep,megatron,etp=1"),
])
def test_nothing_moves_over_cp_but_attention_s(mesh: str, strategy: str) -> None:
    """Over cp only attention's k and v (and their gradients), the loss' scalars and the
    parameters' gradients: under sp the MoE block's tokens are gathered over tp alone (before
    the fix of the sp marks: over cp x tp, 3 x the bytes), under ep the all-to-alls over ep."""
    _p, _m, _kw, plan = plan_hf("MixtralForCausalLM", MIXTRAL, mesh, strategy, "float32", 4, 16)
    cp = plan.mesh.dim_index("cp")
    prog = plan.program
    params = {n for n, t in prog.tensors.items() if t.kind == "parameter"}
    moved = {r.tensor for r in plan.reshards if not r.shared and any(cp in s.mesh_dims for s in r.plan.steps
                                                                      if s.bytes_per_rank)}
    assert {n for n in moved if not n.startswith("scaled_dot_product_attention") and prog.tensors[n].shape
            and n.removesuffix(".grad") not in params} == set()


@pytest.mark.parametrize(("model", "mesh", "strategy"), [
    ("MixtralForCausalLM", "cp=2,ep=2", "cp,ep"),
    ("MixtralForCausalLM", "dp=1,cp=2,tp=2", "megatron,sp,cp"),
    ("MixtralForCausalLM", "dp=2,cp=2,ep=2", "dp,cp,ep,cp-attention=ring"),
    ("MixtralForCausalLM", "dp=1,cp=2,tp=2", "megatron,cp"),
    ("MixtralForCausalLM", "cp=2,ep=2,tp=2", "cp,ep,megatron,etp=1"),
    ("Qwen3MoeForCausalLM", "cp=2,ep=2", "cp,ep"),
    # the expert group carved from the cp ranks: traced for cp x ep (tests/test_hf_moe_epcp.py)
    ("MixtralForCausalLM", "cp=2,ep=2", "cp,ep,ep-from=cp"),
    ("MixtralForCausalLM", "dp=2,cp=2,ep=2", "dp,cp,ep,ep-from=cp,cp-attention=ring"),
    ("MixtralForCausalLM", "cp=2,ep=2,tp=2", "cp,ep,megatron,sp,ep-from=cp"),
    ("MixtralForCausalLM", "cp=2,ep=2,tp=2", "cp,ep,megatron,sp,etp=1,ep-from=cp,zero1"),
    ("Qwen3MoeForCausalLM", "cp=2,ep=2,tp=2", "cp,ep,megatron,sp,etp=1,ep-from=cp,cp-attention=ring"),
    ("Qwen3MoeForCausalLM", "cp=2,ep=2", "cp,ep,ep-from=cp,cp-attention=alltoall"),
])
def test_verify_simulates_equal(model: str, mesh: str, strategy: str) -> None:
    """--verify's check: the tiny import routed in cp (cp x ep with ep-from=cp) chunks, simulated
    against the unsharded step (loss, every gradient, every update)."""
    v = verify_hf(model, QWEN3 if model.startswith("Qwen") else MIXTRAL, mesh, strategy)
    assert v["ok"] and v["checked"] > 200, v["text"]


def test_run_on_gloo_equals_torch_eager() -> None:
    """4 gloo processes (cp=2 x ep=2), 2 layers, dropless: every tensor equal to its op run
    unsharded, the loss and every parameter gradient equal to torch eager's step on the tokens in
    natural order, each all-to-all over ep (none over cp for the MoE layers)."""
    cfg = json.dumps({**MIXTRAL, "num_hidden_layers": 2})
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.run([sys.executable, "-m", "spmdkit", "run", "--hf", "MixtralForCausalLM", "--hf-config", cfg,
                        "--mesh", "cp=2,ep=2", "--strategy", "cp,ep", "--seq", "8", "--batch", "2", "--json",
                        "--warmup", "0", "--timeout", "200"], capture_output=True, text=True, env=env, timeout=500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["world_size"] == 4 and rep["ok"] and rep["collectives_match"] and not rep["failures"], rep["failures"]
    eager = rep["eager"]
    assert eager["checked"] >= 20 and not eager["failures"], eager
    assert rep["loss"] == pytest.approx(eager["loss"], rel=1e-5)
    moe = {(c["kind"], c["mesh_dim"]) for c in rep["collectives"] if c["tensor"].startswith("moe_experts")}
    assert moe == {("all_to_all", 1)}
