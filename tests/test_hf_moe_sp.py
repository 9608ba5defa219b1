"""Imported (``--hf``) MoE models under sequence parallelism with expert parallelism:
``--strategy megatron,sp,ep,etp=1`` (Megatron-Core's usual MoE layout) and ``megatron,sp,ep``
(ETP = tp), docs/experts.md "ETP = 1".

With ETP = 1 the import routes each sequence in tp chunks (cp x tp under cp: ``import_hf``'s
``tp_chunks``, as the zoo's ``moe_chunks``): each tp rank routes its own S / tp tokens of the
sequence-parallel residual stream, one all-to-all over the ep x tp group dispatches them and one
brings the rows back; nothing moves over tp around the experts. Tiny Mixtral / Qwen3-MoE (hidden
32, 4 experts top-2, float32), counted by hand and against the zoo model of the same config."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import warnings
from typing import Any

import pytest

pytest.importorskip("transformers")

from conftest import ROOT, cli_stdout
from hf_moe_helpers import MIXTRAL, QWEN3, collectives
from spmdkit.core.errors import ProgramError
from spmdkit.models.hf import import_hf
from spmdkit.models.source import moe_note
from spmdkit.planner.planning import plan_hf, plan_model, plan_program
from spmdkit.sim.verify_plan import verify_hf

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

MODELS = {"MixtralForCausalLM": ("mixtral", MIXTRAL), "Qwen3MoeForCausalLM": ("qwen3_moe", QWEN3)}


def _plan(model: str, mesh: str, strategy: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_hf(model, MODELS[model][1], mesh, strategy, "float32", 4, 16)[3]


def test_the_import_routes_in_one_chunk_a_tp_rank() -> None:
    """tp_chunks=2 at seq 16: the dispatch [B, 2, E, C, H] with the dropless capacity of a chunk (8
    tokens), named in the note; under cp=2 the chunks are cp x tp = 4; a sequence that does not
    split into them is refused in one line."""
    prog, _m, _kw = import_hf("MixtralForCausalLM", json.dumps(MIXTRAL), batch=2, seq=16, tp_chunks=2)
    d = next(op for op in prog.ops if op.rule == "moe_gate_dispatch")
    assert prog.tensors[d.outputs[0]].shape == (2, 2, 4, 8, 32)
    assert "capacity 8 tokens an expert a chunk (each sequence routed in 2 chunks, one a tp rank) (dropless)" in \
        moe_note(prog)
    prog, _m, _kw = import_hf("MixtralForCausalLM", json.dumps(MIXTRAL), batch=2, seq=16, tp_chunks=2,
                              cp=(2, "allgather", "zigzag"))
    d = next(op for op in prog.ops if op.rule == "moe_gate_dispatch")
    assert prog.tensors[d.outputs[0]].shape == (2, 4, 4, 4, 32)
    assert "(each sequence routed in 4 chunks, one a cp x tp rank)" in moe_note(prog)
    with pytest.raises(ProgramError, match=r"^--strategy megatron,sp,ep,etp=1: each rank routes its own tokens, the "
                                           r"sequence of 12 tokens split into cp x tp = 8 chunks; it does not split "
                                           r"evenly$"):
        import_hf("MixtralForCausalLM", json.dumps(MIXTRAL), batch=2, seq=12, tp_chunks=4,
                  cp=(2, "allgather", "zigzag"))


def test_etp1_collectives_by_hand() -> None:
    """Mixtral, batch 4, seq 16, ep=2 x tp=2, megatron + sp + ETP = 1 (capacity uniform: ceil(8 x
    2 / 4) = 4 a chunk of 8 tokens). A rank holds [2, 8, 32] of the residual stream (2,048 B) and
    dispatches its own chunk into [2, 1, 4, 4, 32] slots (4,096 B) sent by one all-to-all over the
    ep x tp group (3 / 4 of it: 3,072 B); the rows come back the same way; no tp collective around
    the experts (the MoE block's tokens are not gathered, its output not reduced). Over tp only
    attention's sp pair each way, the embedding's reduce-scatter and the final norm's gather."""
    got = collectives(_plan("MixtralForCausalLM", "ep=2,tp=2", "megatron,sp,ep,etp=1"), scalars=False)
    res, a2a = 2 * 8 * 32 * 4 // 2 * 2, 3 * (2 * 1 * 4 * 4 * 32 * 4) // 4
    assert {k: n for k, n in got.items() if k[0] != "optimizer"} == {
        ("forward", "reduce_scatter", "tp", "embedding", res): 1,
        ("forward", "all_gather", "tp", "mul_4", res): 1,  # the attention norm's output
        ("forward", "reduce_scatter", "tp", "linear_3", res): 1,  # o_proj's
        ("forward", "all_to_all", "epxtp", "moe_experts.dispatch", a2a): 1,
        ("forward", "all_to_all", "tpxep", "moe_experts.rows", a2a): 1,
        ("forward", "all_gather", "tp", "rms_norm_default", res): 1,  # the final norm, before the head
        ("backward", "reduce_scatter", "tp", "rms_norm_default.grad", res): 1,
        ("backward", "all_to_all", "epxtp", "moe_experts.rows.grad", a2a): 1,
        ("backward", "all_to_all", "tpxep", "moe_experts.dispatch.grad.sum", a2a): 1,
        ("backward", "all_gather", "tp", "linear_3.grad", res): 1,
        ("backward", "reduce_scatter", "tp", "mul_4.grad.sum", res): 1,
        ("backward", "all_gather", "tp", "embedding.grad.sum", res): 1,
    }
    grads = {k[3]: k[2] for k in got if k[0] == "optimizer"}
    assert not [n for n in grads if ".experts." in n]  # experts: EDP = dp, no dp dim
    assert grads["model.layers.0.self_attn.q_proj.weight.grad"] == "ep"
    assert grads["model.layers.0.input_layernorm.weight.grad"] == "epxtp"  # partial over tp under sp


@pytest.mark.parametrize(("model", "mesh"), [
    ("MixtralForCausalLM", "ep=2,tp=2"), ("Qwen3MoeForCausalLM", "dp=2,ep=2,tp=2"), ("MixtralForCausalLM",
                                                                                     "cp=2,ep=2,tp=2"),
])
def test_etp1_collectives_equal_the_zoo_model_s(model: str, mesh: str) -> None:
    """Every collective (kind, mesh dims, bytes a rank sends; forward, backward and the gradients)
    of the import equals the zoo model's built from the same HF config under the same mesh and
    strategy, but the zoo's load-balancing loss statistics (HF computes no aux loss without
    output_router_logits) and the gradients of Qwen3's q / k norms (the zoo's llama has none):
    the tensors are named otherwise, the collectives are the same."""
    strategy = "megatron,sp,ep,etp=1" + (",cp" if "cp" in mesh else "")
    hf = collectives(_plan(model, mesh, strategy), scalars=False)
    kind, cfg = MODELS[model]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _m, zp, _s = plan_model(json.dumps({**cfg, "model_type": kind, "torch_dtype": "float32"}), mesh, strategy,
                                {"batch": 4, "seq": 16})
    zoo = collectives(zp, scalars=False)

    def shape(c: collections.Counter[tuple[str, str, str, str, int]]) -> collections.Counter[tuple[str, str, str, int]]:
        out: collections.Counter[tuple[str, str, str, int]] = collections.Counter()
        for (ph, k, dims, t, b), n in c.items():
            if not re.search(r"\.aux\b|_attn\.[qk]_norm\.", t):
                out[(ph, k, dims, b)] += n
        return out

    assert shape(hf) == shape(zoo)
    assert sum(n for k, n in shape(hf).items() if k[1] == "all_to_all") == 4  # dispatch, rows, each way
    assert {k[2] for k in hf if k[1] == "all_to_all"} == {"epxtp", "tpxep"}


def test_etp_tp_collectives_by_hand() -> None:
    """megatron + sp + ep without etp=1 (ETP = tp, each expert split over tp; routed whole): the
    MoE block's tokens gathered over tp (2,048 B), the dispatch ([2, 4, 8, 32] a rank, capacity
    ceil(16 x 2 / 4) = 8) one all-to-all over ep (half of 8,192 B), the experts' row-parallel rows
    all-reduced over tp (2 x (2 - 1) / 2 x 8,192 B) before the all-to-all back, the output sliced
    back onto the sequence. Backward: the output's gradient gathered over tp (2,048 B; the zoo
    all-reduces the rows' gradient instead, 8,192 B), the dispatch gradient all-reduced over tp."""
    got = collectives(_plan("MixtralForCausalLM", "ep=2,tp=2", "megatron,sp,ep"))
    moe = {k: n for k, n in got.items() if k[3].startswith(("mul_10", "moe_", "reshape_2"))}
    a2a = {(ph, "all_to_all", "ep", "moe_experts." + t, 4096): 1 for ph, t in [
        ("forward", "dispatch"), ("forward", "rows"), ("backward", "rows.grad"), ("backward", "dispatch.grad.sum")]}
    over_tp = {(ph, kind, "tp", t, b): 1 for ph, kind, t, b in [
        ("forward", "all_gather", "mul_10", 2048), ("forward", "all_reduce", "moe_experts.rows", 8192),
        ("backward", "all_gather", "reshape_2.grad", 2048),
        ("backward", "all_reduce", "moe_experts.dispatch.grad.sum", 8192)]}
    assert moe == {**a2a, **over_tp}


@pytest.mark.parametrize(("model", "mesh", "strategy"), [
    ("MixtralForCausalLM", "ep=2,tp=2", "megatron,sp,ep,etp=1"),
    ("Qwen3MoeForCausalLM", "dp=2,ep=2,tp=2", "megatron,sp,ep,etp=1"),
    ("MixtralForCausalLM", "cp=2,ep=2,tp=2", "megatron,sp,ep,etp=1,cp"),
    ("MixtralForCausalLM", "ep=2,tp=2", "megatron,sp,ep"),
])
def test_verify_simulates_equal(model: str, mesh: str, strategy: str) -> None:
    """--verify's check: the tiny import simulated rank by rank against the unsharded step (loss,
    every gradient, every update)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        v = verify_hf(model, MODELS[model][1], mesh, strategy)
    assert v["ok"] and v["checked"] > 200, v["text"]


def test_pipeline_plan_routes_in_tp_chunks() -> None:
    """`spmdkit plan --hf` with a pp dim (the pipeline's own import): each stage's MoE layer
    routed one chunk a tp rank, its all-to-alls over the ep x tp group (imported routed whole it
    would slice the slots over tp and send them over ep)."""
    cfg = json.dumps({**MIXTRAL, "num_hidden_layers": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc, out = cli_stdout("plan", "--hf", "MixtralForCausalLM", "--hf-config", cfg, "--mesh", "pp=2,ep=2,tp=2",
                             "--strategy", "megatron,sp,ep,etp=1", "--batch", "8", "--seq", "16")
    assert rc == 0
    assert "(each sequence routed in 2 chunks, one a tp rank)" in out
    a2a = [line for line in out.splitlines() if "all-to-all" in line and "moe_experts" in line]
    assert len(a2a) == 4 and all(" over epxtp " in line or " over tpxep " in line for line in a2a), a2a


def test_refusals() -> None:
    """What is still refused, one line each: ep x tp not dividing the experts (ETP = 1), a
    sequence the chunks or tp do not divide, a program not routed in the tp chunks ETP = 1 with
    sp needs (imported once without a strategy, as the --devices search does)."""
    with pytest.raises(ProgramError, match=r"^--mesh ep=4,tp=2: with etp=1 the experts are spread over ep x tp = 8 "
                                           r"ranks, which does not divide the model's 4 experts; an ep x tp of 2 or "
                                           r"4 does$"):
        _plan("MixtralForCausalLM", "ep=4,tp=2", "megatron,sp,ep,etp=1")
    with pytest.raises(ProgramError, match=r"^--strategy megatron,sp,ep,etp=1: each rank routes its own tokens, the "
                                           r"sequence of 15 tokens split into tp = 2 chunks; it does not split "
                                           r"evenly$"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan_hf("MixtralForCausalLM", MIXTRAL, "ep=2,tp=2", "megatron,sp,ep,etp=1", "float32", 4, 15)
    prog, _m, _kw = import_hf("MixtralForCausalLM", json.dumps(MIXTRAL), batch=4, seq=16, weights=False)
    with pytest.raises(ProgramError, match=r"^--strategy megatron,sp,ep,etp=1: each tp rank routes its own tokens "
                                           r"\(Megatron's token path\), 2 chunks a sequence on this mesh; the program "
                                           r"routes each sequence whole \(import it for the strategy: spmdkit plan "
                                           r"--hf does, import_hf\(tp_chunks=2\)\)$"):
        plan_program(prog, "ep=2,tp=2", "megatron,sp,ep,etp=1")  # a program imported once (the --devices search)
    plan_program(prog, "ep=2,tp=2", "megatron,sp,ep")  # ETP = tp routes each sequence whole: planned
    with pytest.raises(ProgramError, match=r"^--strategy sp: .* has sequence length 15, not divisible by tp=2$"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan_hf("MixtralForCausalLM", MIXTRAL, "ep=2,tp=2", "megatron,sp,ep", "float32", 4, 15)


def test_run_on_gloo_equals_torch_eager() -> None:
    """`spmdkit run` on 4 gloo processes (ep=2 x tp=2, megatron + sp + ETP = 1, 2 layers,
    dropless): the loss and every parameter gradient equal torch eager's step of the HF model;
    every MoE collective an all-to-all (the merged ep x tp one run over ep and tp), none gathers a
    MoE tensor over tp."""
    cfg = json.dumps({**QWEN3, "num_hidden_layers": 2})
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.run([sys.executable, "-m", "spmdkit", "run", "--hf", "Qwen3MoeForCausalLM", "--hf-config", cfg,
                        "--mesh", "ep=2,tp=2", "--strategy", "megatron,sp,ep,etp=1", "--seq", "16", "--batch", "4",
                        "--json", "--warmup", "0", "--timeout", "200"], capture_output=True, text=True, env=env,
                       timeout=500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["world_size"] == 4 and rep["ok"] and rep["collectives_match"] and not rep["failures"], rep["failures"]
    eager = rep["eager"]
    assert eager["dtype"] == "float32" and eager["checked"] >= 20 and not eager["failures"], eager
    assert eager["max_rel_error"] <= 1e-5
    assert rep["loss"] == pytest.approx(eager["loss"], rel=1e-5)
    moe = collections.Counter((c["kind"], c["mesh_dim"]) for c in rep["collectives"] if c["tensor"].startswith("moe_"))
    assert moe == {("all_to_all", 0): 8, ("all_to_all", 1): 8}  # 2 layers x 4 all-to-alls over ep x tp, each 2


# -- the search (--devices) ----------------------------------------------------------------------------

MIXTRAL2 = json.dumps({**MIXTRAL, "num_hidden_layers": 2})


def _json(*argv: str) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc, out = cli_stdout("plan", "--hf", "MixtralForCausalLM", "--hf-config", MIXTRAL2, "--batch", "8", "--seq",
                             "16", "--recompute", "none", "--json", *argv)
    assert rc == 0, out[-2000:]
    return dict(json.loads(out))


def test_devices_plans_etp1_routed_in_tp_chunks_as_strategy_does() -> None:
    """`plan --hf --devices 8`: ETP = 1 with sp (megatron,sp,ep,etp=1) is planned, not refused as
    routed whole: flat (dp=2 x ep=2 x tp=2) and as a pipeline (pp=2, 4 microbatches of 2), each
    predicted exactly as `plan --hf --mesh ... --strategy` of the same layout predicts it (the step
    and the memory per device); the best's title names the routing."""
    got = _json("--devices", "8", "--strategy", "megatron,sp,ep,etp=1")
    s = got["search"]
    assert not [r for r in s["refused"] if "routes each sequence whole" in r["reason"]], s["refused"]
    rows = {(r["dp"], r["ep"], r["tp"], r["pp"]): r for r in s["top"]}
    assert {(2, 2, 2, 1), (1, 2, 2, 2)} <= set(rows), sorted(rows)
    assert "each sequence routed in 2 chunks, one a tp rank" in got["title"]
    flat = _json("--mesh", "dp=2,ep=2,tp=2", "--strategy", "megatron,sp,ep,etp=1", "--device", "h100")
    assert rows[(2, 2, 2, 1)]["step_s"] == pytest.approx(flat["step"]["step_overlap_s"], rel=1e-12)
    assert rows[(2, 2, 2, 1)]["memory_per_device"] == flat["memory"]["device_total"]
    assert "(each sequence routed in 2 chunks, one a tp rank)" in flat["title"]
    pipe = _json("--mesh", "pp=2,dp=1,ep=2,tp=2", "--strategy", "megatron,sp,ep,etp=1", "--microbatches", "4",
                 "--device", "h100")
    assert rows[(1, 2, 2, 2)]["microbatches"] == 4
    assert rows[(1, 2, 2, 2)]["step_s"] == pytest.approx(pipe["pipeline"]["step_overlap_s"], rel=1e-12)
    assert rows[(1, 2, 2, 2)]["memory_per_device"] == max(d["memory"]["device_total"]
                                                          for d in pipe["pipeline"]["devices"])


def test_devices_traces_the_model_once_per_batch_and_routing() -> None:
    """The search over an --hf MoE imports the model again once per (sequences, tp chunks) it
    needs, not once per candidate: ETP = 1's ZeRO stages share the flat import routed in tp chunks
    (8 sequences, 2 chunks), the pipelines' microbatches of 2 sequences one import routed whole
    (ETP = tp) and one in tp chunks (ETP = 1); ETP = tp's flat configurations plan the program as
    first imported, and so does ETP = 1 on ep=2 x tp=4, which 4 experts refuse. Every etp=1 configuration planned on a program routed in 2 chunks."""
    from dataclasses import replace

    from spmdkit.models.source import HFModel, load
    from spmdkit.planner.search import search_meshes

    src = HFModel("MixtralForCausalLM", MIXTRAL2, "float32", 8, 16, weights=False)
    traced: list[tuple[int, int]] = []

    def reload(b: int, chunks: int, cp: Any) -> Any:
        assert cp is None  # 16 tokens: no cp tried
        traced.append((b, chunks))
        return load(replace(src, batch=b, tp_chunks=chunks)).program

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = search_meshes(load(src).program, 8, "h100", recompute=["none"], reload=reload,
                            strategies=["megatron,sp,ep,etp=1", "megatron,sp,ep,etp=1,zero1", "megatron,sp,ep"])
    assert sorted(traced) == [(2, 1), (2, 2), (8, 2)]
    # ep=2 x tp=4 not traced in 4 chunks: refused for what it is (its experts), not for its routing
    assert {why for c, why in res.refused if (c.ep, c.tp) == (2, 4) and "etp=1" in c.strategy} == {
        "--mesh ep=2,tp=4: with etp=1 the experts are spread over ep x tp = 8 ranks, which does not divide the "
        "model's 4 experts; an ep x tp of 2 or 4 does"}
    etp = [c for c in res.candidates if "etp=1" in c.config.strategy]
    assert {(c.config.dp, c.config.ep, c.config.tp, c.config.pp, c.config.strategy) for c in etp} == {
        (d, 2, 2, p, "megatron,sp,ep,etp=1" + z) for d, p in ((2, 1), (1, 2)) for z in ("", ",zero1")}
    for c in etp:
        d = next(op for op in c.plan.program.ops if op.rule == "moe_gate_dispatch")
        assert c.plan.program.tensors[d.outputs[0]].shape[1] == 2  # [B, T, E, C, H]: one chunk a tp rank
    assert not [why for _c, why in res.refused if "etp=1" in why and "whole" in why]
