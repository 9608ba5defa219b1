"""HF mixture-of-experts models imported by structure into the zoo's MoE ops (issue 28, hfmoe):
the blocks found from their modules (an experts module with HF's experts interface and 3-D banks,
a router whose routing a probe identifies), lowered to router matmul -> softmax / sigmoid ->
moe_gate_dispatch [B, E, C, H] -> batched GEMMs on [E, in, out] stacks -> moe_combine; the
imported step equal to torch's (forward, loss and every gradient); megatron over the experts
(ETP = tp); the plan of Mixtral-8x7B equal to the catalog's.

Tiny models (2-3 layers, hidden 64, 4 heads, 4-8 experts, top 2), float32 (HF's grouped matmul
has no float64 kernel); the catalog comparison at Mixtral's real widths with 1 layer."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'spmdkit[torch]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'spmdkit[hf]')")

from spmdkit.execute.single import run_program  # noqa: E402
from spmdkit.models import hf  # noqa: E402
from spmdkit.models.torch_import import import_module, torch_values  # noqa: E402
from spmdkit.models.torch_import.moe import Routing, capacity_of, moe_blocks  # noqa: E402
from spmdkit.planner.planning import plan_program  # noqa: E402
from spmdkit.strategies.hf_moe import moe_projections  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

ROOT = Path(__file__).resolve().parents[1]
T = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
     "num_key_value_heads": 2, "max_position_embeddings": 64}
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("MixtralForCausalLM", dict(T, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(T, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              norm_topk_prob=True, head_dim=16)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(T, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=64)),  # a sigmoid-gated shared expert
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(T, num_hidden_layers=3, num_key_value_heads=4,
                                                  first_k_dense_replace=1, moe_intermediate_size=32,
                                                  n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                                                  q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                                                  qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=1,
                                                  routed_scaling_factor=2.5)),
}
ROUTING = {
    "mixtral": Routing("softmax", norm=True),
    "qwen3_moe": Routing("softmax", norm=True),
    "qwen2_moe": Routing("softmax", norm=False),
    "deepseek_v3": Routing("sigmoid", bias=True, norm=True, scale=2.5),
}


def _build(name: str, **changes: Any) -> Any:
    cls, cfg = CONFIGS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = hf.build(cls, dict(cfg, **changes), dtype="float32", seed=0)
    if name == "deepseek_v3":  # a correction bias that changes the choice (HF initialises it to zeros)
        g = torch.Generator().manual_seed(3)
        for mod in m.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(torch.randn(mod.e_score_correction_bias.shape, generator=g) * 0.05)
    return m


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_blocks_found_by_structure_with_their_routing(name: str) -> None:
    m = _build(name)
    blocks = moe_blocks(m)
    cfg = m.config
    n_moe = cfg.num_hidden_layers - getattr(cfg, "first_k_dense_replace", 0)
    assert len(blocks) == n_moe
    b = blocks[0]
    assert b.routing == ROUTING[name] and b.gated and not b.transposed and b.act == ("silu", False)
    assert b.top_k == 2 and b.bias_name == ("e_score_correction_bias" if name == "deepseek_v3" else None)


def test_deepseek_group_limited_routing_is_identified() -> None:
    """DeepSeek-V3's group-limited top-k (8 experts in 4 groups, the best 2 kept) is what its
    router computes on the probe; the plan writes it down as a top-k over every expert."""
    cls, cfg = CONFIGS["deepseek_v3"]
    m = hf.build(cls, dict(cfg, n_group=4, topk_group=2), weights=False)
    (b,) = moe_blocks(m)[:1]
    assert (b.routing.groups, b.routing.topk_group) == (4, 2)
    assert "group-limited top-k (4 groups, 2 kept)" in b.routing.describe()


def test_a_router_the_ops_do_not_express_is_left_to_hf_with_a_warning() -> None:
    m = _build("mixtral")
    router = m.model.layers[0].mlp.gate
    plain = type(router).forward

    def squared(self: Any, x: Any) -> Any:
        logits, w, idx = plain(self, x)
        return logits, w * w, idx
    router.forward = squared.__get__(router)
    with pytest.warns(UserWarning, match=r"MoE block model\.layers\.0\.mlp \(MixtralExperts\) is imported through "
                                         r"HF's grouped matmul .*: router MixtralTopKRouter computes a routing"):
        blocks = moe_blocks(m)
    assert [b.path for b in blocks] == ["model.layers.1.mlp"]


def _import(name: str, training: bool = True) -> tuple[Any, Any, dict[str, Any]]:
    m = _build(name)
    kw = hf.example_inputs(m, 2, 16, labels=training, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = import_module(m, (), kw, training=training)
    return prog, m, kw


def test_the_lowered_layer_is_the_zoos_pattern() -> None:
    """Per MoE layer: the router's matmul and softmax, one moe_gate_dispatch into [B, E, C, H]
    (C = 16: dropless, every token), gate and up GEMMs on [E, in, out] stacks, swiglu, down,
    moe_combine; no grouped matmul over every token. The parameter count is HF's."""
    prog, m, _ = _import("mixtral", training=False)
    fwd = [op for op in prog.ops if op.layer == "model.layers.0" and "mlp" in prog.modules.get(prog.ops.index(op),
                                                                                              ("", ""))[0]]
    rules = [op.rule for op in fwd]
    assert rules == ["reshape", "reshape", "matmul", "softmax", "moe_gate_dispatch", "sum", "add", "divide", "matmul",
                     "matmul", "swiglu", "matmul", "reshape", "transpose", "moe_combine", "reshape", "reshape"]
    disp = next(op for op in fwd if op.rule == "moe_gate_dispatch")
    assert prog.tensors[disp.output_names()[0]].shape == (2, 4, 16, 64) and disp.attrs["capacity"] == 16
    p = "model.layers.0.mlp.experts."
    assert prog.tensors[p + "gate_up_proj_gate"].shape == (4, 64, 128) == prog.tensors[p + "gate_up_proj_up"].shape
    assert prog.tensors[p + "down_proj_t"].shape == (4, 128, 64)
    assert prog.sources[p + "gate_up_proj_up"] == ("parameter_slice", (p + "gate_up_proj", 1, 128, 256, (0, 2, 1)))
    n_prog = sum(math.prod(prog.tensors[n].shape) for n in prog.parameters())
    assert n_prog == sum(p.numel() for p in m.parameters())
    assert len(moe_projections(prog)) == 2


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "deepseek_v3"])
def test_imported_step_equals_torch(name: str) -> None:
    """The loss and every parameter gradient (an expert bank's as its parts: narrowed and
    transposed) equal torch autograd's on the HF model itself, float32."""
    prog, m, kw = _import(name)
    vals = run_program(prog, torch_values(prog, m, (), kw))
    m.zero_grad()
    out = m(**kw)
    out.loss.backward()
    assert abs(float(vals[prog.loss]) - float(out.loss)) <= 1e-5 * abs(float(out.loss))
    named = dict(m.named_parameters())
    gscale = max(float(p.grad.abs().max()) for p in named.values() if p.grad is not None)
    seen = set()
    for p, g in prog.grads.items():
        kind, where = prog.sources[p]
        if kind == "parameter_slice":
            fqn, axis, lo, hi, perm = where
            want = named[fqn].grad.narrow(axis, lo, hi - lo).permute(*perm)
        else:
            fqn, want = where, named[where].grad
        seen.add(fqn)
        err = float(np.max(np.abs(np.asarray(vals[g], dtype=np.float64) - want.double().numpy())))
        assert err <= 1e-5 * max(float(want.abs().max()), 1e-3 * gscale), (p, err)
    assert seen == {k for k, v in named.items() if v.requires_grad}


def test_capacity_dropless_to_run_uniform_to_plan() -> None:
    """With its weights (spmdkit run) every token fits (capacity 16 of 16); imported to plan
    (no weights) the zoo's ceil(16 x 2 / 4) = 8, as the catalog sizes it."""
    cls, cfg = CONFIGS["mixtral"]
    caps = {}
    for w in (True, False):
        prog, _, _ = hf.import_hf(cls, cfg, batch=2, seq=16, weights=w, training=False)
        caps[w] = {op.attrs["capacity"] for op in prog.ops if op.rule == "moe_gate_dispatch"}
    assert caps == {True: {16}, False: {8}}
    assert capacity_of(1.25, 16, 2, 4) == 10 and capacity_of("dropless", 16, 2, 4) == 16


def test_megatron_shards_each_expert_and_keeps_the_router() -> None:
    """ETP = tp: gate / up stacks column-parallel (out axis), down row-parallel (in axis), the
    router replicated; no replicated-layer warning; per layer 2 all-reduces of activations
    over tp forward (attention, experts) and 2 backward."""
    from spmdkit.strategies.hf_roles import BLOCK, layer_collectives

    prog, _, _ = _import("mixtral")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        prog, plan = plan_program(prog, "dp=2,tp=2", "megatron")
    assert not [w for w in got if "left replicated" in str(w.message)]
    p = "model.layers.0.mlp."
    assert plan.attr(p + "experts.gate_up_proj_gate").dims_mapping == (-1, -1, 1)
    assert plan.attr(p + "experts.gate_up_proj_up").dims_mapping == (-1, -1, 1)
    assert plan.attr(p + "experts.down_proj_t").dims_mapping == (-1, 1, -1)
    assert plan.attr(p + "gate.weight").dims_mapping == (-1, -1)
    blocks = {k: v for k, v in layer_collectives(plan).items() if BLOCK.fullmatch(k)}
    assert len(blocks) == 2
    for c in blocks.values():
        act = {k: v for k, v in c.items() if k[2] == "activation"}
        assert act == {("forward", "all_reduce", "activation"): 2, ("backward", "all_reduce", "activation"): 2}


def test_megatron_sp_gathers_the_moe_blocks_tokens_as_torchtitan() -> None:
    """megatron+sp: the MoE block runs on every token of the sequence, as Megatron and torchtitan run
    one under tp (torchtitan: its MoE module's input Shard(1) -> Replicate, router replicated,
    experts split over tp): the norm's output all-gathered once before the router, the experts'
    partial rows all-reduced, the output sliced back to the sequence shard; backward the output's
    gradient all-gathered and the dispatch gradient all-reduced. No all-to-all (the plan once moved
    the block to the batch rows and back, 2 each way, and all-gathered the k x larger dispatch
    buffer), and the router's gradient is whole on every tp rank (reduced over dp only)."""
    from spmdkit.strategies.hf_moe import moe_ends
    from spmdkit.strategies.hf_roles import BLOCK, layer_collectives

    prog, _, _ = _import("mixtral")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog, plan = plan_program(prog, "dp=2,tp=2", "megatron,sp")
    for c in (v for k, v in layer_collectives(plan).items() if BLOCK.fullmatch(k)):
        act = {k[:2]: v for k, v in c.items() if k[2] == "activation"}
        # attention: q/k/v's input gathered, o_proj's output reduce-scattered; MoE: tokens gathered, rows reduced
        assert act == {("forward", "all_gather"): 2, ("forward", "reduce_scatter"): 1, ("forward", "all_reduce"): 1,
                       ("backward", "all_gather"): 2, ("backward", "reduce_scatter"): 1,
                       ("backward", "all_reduce"): 1}, act
    (ins, outs), _ = moe_ends(prog, moe_projections(prog))
    assert plan.attr(ins[0]).dims_mapping == (0, -1, -1)  # the router's tokens: batch over dp, whole over tp
    assert plan.attr(outs[-1]).dims_mapping == (0, 1, -1)  # the block's output: the sequence shard
    assert plan.attr("model.layers.0.mlp.gate.weight").dims_mapping == (-1, -1)
    grad = plan.attr("model.layers.0.mlp.gate.weight.grad")
    assert [d for d, _ in grad.partial] == [0]  # partial over dp only: every tp rank routes the same tokens


def test_megatron_replicates_mla_down_projections() -> None:
    """DeepSeek-V3's MLA: the low-rank down projections (q_a_proj, kv_a_proj_with_mqa)
    replicated, q_b_proj and kv_b_proj column-parallel (heads), o_proj row-parallel, as the
    zoo's MLA, found from the graph."""
    prog, _, _ = _import("deepseek_v3")
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        prog, plan = plan_program(prog, "tp=2", "megatron")
    assert not [w for w in got if "left replicated" in str(w.message)]
    a = "model.layers.0.self_attn."
    want = {"q_a_proj": (-1, -1), "kv_a_proj_with_mqa": (-1, -1), "q_b_proj": (0, -1), "kv_b_proj": (0, -1),
            "o_proj": (-1, 0)}
    assert {k: plan.attr(a + k + ".weight").dims_mapping for k in want} == want


# -- the catalog's plan ---------------------------------------------------------------------------------


def _layer(label: str) -> int | None:
    import re

    m = re.search(r"layers?[. ](\d+)", label or "")
    return int(m.group(1)) if m else None


def _summary(plan: Any) -> tuple[float, tuple[int, int, int], dict[int | None, Counter[Any]]]:
    from spmdkit.cost.compute import op_cost
    from spmdkit.cost.memory import memory_per_device

    prog = plan.program
    flops = sum(op_cost(plan, i).flops for i in range(len(prog.ops)))
    per: dict[int | None, Counter[Any]] = {}
    for r, s in plan.collectives():
        op = prog.ops[r.op_index]
        if op.phase != "optimizer":
            per.setdefault(_layer(op.layer), Counter())[(op.phase, s.kind, s.mesh_dims, s.bytes_per_rank)] += 1
    mem = memory_per_device(plan)
    return flops, (mem.parameters, mem.gradients, mem.optimizer_states), per


@pytest.mark.parametrize(("mesh", "strategy", "per_layer"), [
    ("dp=2,tp=2", "megatron", {"all_reduce": 4}),  # attention and experts, each way
    ("dp=2,ep=2", "dp,ep", {"all_to_all": 4}),  # dispatch and combine, each way
])
def test_mixtral_8x7b_plans_as_the_catalog_model(mesh: str, strategy: str, per_layer: dict[str, int]) -> None:
    """`plan --hf MixtralForCausalLM` with the published config (1 layer, bf16, seq 64, batch 4)
    against `--model mixtral-8x7b` on the same mesh: parameters, gradients and optimizer states
    per device equal, the layer's collectives equal, the step's FLOPs within 1%."""
    from spmdkit.planner.planning import plan_hf, plan_preset

    cfg = json.loads((ROOT / "tests/data/hf/mixtral-8x7b.json").read_text())
    cfg["num_hidden_layers"] = 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, _, hp = plan_hf("MixtralForCausalLM", cfg, mesh, strategy, dtype="bf16", batch=4, seq=64)
        _, cp, _ = plan_preset("mixtral-8x7b", mesh, strategy, {"layers": 1, "batch": 4, "seq": 64})
    (hf_flops, hf_mem, hf_per), (cat_flops, cat_mem, cat_per) = _summary(hp), _summary(cp)
    assert hf_mem == cat_mem
    assert hf_per[0] == cat_per[0]
    kinds = Counter()
    for (_phase, kind, _dims, _b), n in hf_per[0].items():
        kinds[kind] += n
    assert kinds == per_layer
    assert abs(hf_flops / cat_flops - 1) < 0.01


# -- spmdkit run on gloo ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "mesh", "strategy", "over"), [
    ("mixtral", "dp=2,tp=2", "megatron", ("all_reduce", 1)),
    ("deepseek_v3", "dp=2,tp=2", "megatron", ("all_reduce", 1)),
    ("qwen3_moe", "dp=2,ep=2", "dp,ep", ("all_to_all", 1)),
    ("deepseek_v3", "dp=2,ep=2", "dp,ep", ("all_to_all", 1)),
])
def test_run_hf_moe_equals_torch_eager(name: str, mesh: str, strategy: str, over: tuple[str, int]) -> None:
    """`spmdkit run --hf` on 4 gloo processes, megatron (dp=2 x tp=2: each expert tensor
    parallel) or expert parallel (dp=2 x ep=2: the tokens dispatched and combined by
    all-to-all over ep): the loss and every gradient equal torch eager of the HF model (dropless
    routing, as HF's), the collectives the plan's."""
    cls, cfg = CONFIGS[name]
    p = subprocess.run([sys.executable, "-m", "spmdkit", "run", "--json", "--kernels", "numpy", "--timeout", "120",
                        "--hf", cls, "--hf-config", json.dumps(cfg), "--mesh", mesh, "--strategy", strategy,
                        "--batch", "4"], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["ok"] and rep["collectives_match"] and not rep["failures"] and rep["nonfinite"] == 0
    eager = rep["eager"]
    assert eager["dtype"] == "float32" and not eager["failures"] and eager["max_rel_error"] <= 1e-5
    assert rep["loss"] == pytest.approx(eager["loss"], rel=1e-5)
    kinds = {(c["kind"], c["mesh_dim"]) for c in rep["collectives"]}
    assert {("all_reduce", 0), over} <= kinds


@pytest.mark.parametrize(("name", "want"), [("qwen3_moe", "float32"), ("qwen2_moe", "float32"),
                                             ("mixtral", "float32"), ("deepseek_v3", "float32")])
def test_a_bfloat16_router_scores_in_the_dtype_hf_computes_them(name: str, want: str) -> None:
    """Imported in bfloat16, the gate values are softmax / sigmoid in float32 as every HF router
    computes them: Qwen2/3-MoE take softmax(logits, dtype=torch.float) and cast only the
    renormalised top-k weights back to bfloat16, so the dtype of those weights (bfloat16) is not
    the scores' (the import took it for them: probs, top-k and renormalisation in bfloat16)."""
    cls, cfg = CONFIGS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog, _, _ = hf.import_hf(cls, cfg, batch=2, seq=8, dtype="bfloat16")
    probs = [n for n, t in prog.tensors.items() if n.endswith(".probs") or n == "moe_route.probs"]
    assert probs and {prog.tensors[n].dtype for n in probs} == {want}, {n: prog.tensors[n].dtype for n in probs}
    weights = [n for n in prog.tensors if n.endswith("dispatch.weights")]
    assert {prog.tensors[n].dtype for n in weights} == {want}
    rows = [n for n in prog.tensors if n.endswith("experts.rows")]
    assert {prog.tensors[n].dtype for n in rows} == {"bfloat16"}


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_run_hf_moe_in_bfloat16_routes_as_torch(name: str) -> None:
    """`spmdkit run --hf Qwen3MoeForCausalLM --dtype bfloat16` (torch kernels) on dp=2 gloo ranks:
    every gradient within the bfloat16 tolerance of torch eager's. With the gate values in
    bfloat16 token 17 of layer 0 (float32 probs 0.2548 for expert 0, 0.2569 for expert 2, both
    0.2559 in bfloat16) tied and took expert 0, HF (softmax in float32) expert 2: layer 0's
    expert, router and post-attention-norm gradients 8-23% off (relative L2), 0.0136 after.
    Qwen2-MoE (the same router): 0.140 before, 0.0121 after."""
    cls, cfg = CONFIGS[name]
    p = subprocess.run([sys.executable, "-m", "spmdkit", "run", "--json", "--kernels", "torch", "--timeout", "120",
                        "--hf", cls, "--hf-config", json.dumps(cfg), "--mesh", "dp=2", "--strategy", "dp",
                        "--batch", "4", "--dtype", "bfloat16"], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["ok"] and rep["collectives_match"] and not rep["failures"], rep["failures"]
    eager = rep["eager"]
    assert eager["checked"] >= 28 and not eager["failures"], eager["failures"]
    assert eager["max_rel_error"] <= 2 * eager["native_error"], eager


#: a Qwen3-MoE with top 8 of 16 experts, wide enough (hidden 256, seq 256) that combining each tp
#: rank's rows where they are costs less than gathering them (tests/test_etp.py, local_rows)
QWEN3_TOP8 = dict(T, num_hidden_layers=1, hidden_size=256, intermediate_size=512, max_position_embeddings=256,
                  num_experts=16, num_experts_per_tok=8, moe_intermediate_size=32, norm_topk_prob=True)


def test_run_hf_moe_combining_the_rows_where_they_are_equals_torch_eager() -> None:
    """`spmdkit run --hf` (torch kernels) on ep=2 x tp=2, etp=1 without sp: the experts whole over
    ep x tp, the rows back over ep stay sharded over tp and moe_combine sums each rank's own
    (local_rows): its output all-reduced over tp, no all-gather of the rows; moe_combine_grad
    writes each rank's rows' gradient, the combine weights' gradient all-reduced over tp;
    moe_gate_dispatch_grad sums each rank's own experts' slots (local_experts), the tokens'
    gradient all-reduced over tp instead of the slots gathered. The loss and every gradient equal
    torch eager of the HF model."""
    p = subprocess.run([sys.executable, "-m", "spmdkit", "run", "--json", "--timeout", "120", "--warmup", "0",
                        "--hf", "Qwen3MoeForCausalLM", "--hf-config", json.dumps(QWEN3_TOP8), "--mesh", "ep=2,tp=2",
                        "--strategy", "ep,megatron,etp=1", "--batch", "4", "--seq", "256"], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")), timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["ok"] and rep["collectives_match"] and not rep["failures"] and rep["nonfinite"] == 0
    assert rep["kernels"] == "torch" and rep["world_size"] == 4
    eager = rep["eager"]
    assert eager["dtype"] == "float32" and not eager["failures"] and eager["max_rel_error"] <= 1e-5
    assert rep["loss"] == pytest.approx(eager["loss"], rel=1e-5)
    tp = Counter((c["kind"], c["tensor"]) for c in rep["collectives"] if c["mesh_dim"] == 1)
    assert not [t for k, t in tp if k == "all_gather"]  # neither the rows nor the slots' gradient
    assert tp[("all_reduce", "reshape_2")] == 1  # moe_combine's partial output, reshaped to [B, S, H]
    assert tp[("all_reduce", "moe_experts.weights_norm.grad")] == 1
    assert tp[("all_reduce", "moe_route.tokens.grad")] == 1  # moe_gate_dispatch_grad's partial grad_x
    assert {c["kind"] for c in rep["collectives"] if c["mesh_dim"] == 0} == {"all_to_all", "all_reduce"}


#: DeepSeek-V3's architecture at scaled widths (MLA, 1 dense layer first, 8 routed experts top 2,
#: 1 shared, sigmoid routing with a correction bias), its config as HF's config.json
DS_SCALED = {"model_type": "deepseek_v3", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
             "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "first_k_dense_replace": 1,
             "moe_intermediate_size": 64, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
             "n_group": 1, "topk_group": 1, "q_lora_rank": 64, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
             "qk_nope_head_dim": 32, "v_head_dim": 32, "max_position_embeddings": 64, "tie_word_embeddings": False}


@pytest.mark.parametrize(("mesh", "strategy"), [("dp=2,tp=2", "megatron"), ("dp=2,ep=2", "dp,ep")])
def test_deepseek_v3_plans_as_the_zoo_model_of_its_config(mesh: str, strategy: str) -> None:
    """`plan --hf DeepseekV3ForCausalLM` against the zoo's DeepSeek-V3 built from the same
    config.json (`--model-config`): parameters, gradients and optimizer states per device
    equal but for the router, which HF keeps in float32 (in a bf16 step: 2 bytes more per
    element, and no float32 master copy); per layer the same collectives, but that the MoE layer's backward sums the shared
    experts' and the routed path's partial input gradients before one all-reduce (the imported
    program's regrouping; the zoo reduces each: one [B, S, H] all-reduce more); FLOPs within 1%."""
    from spmdkit.models.source import Preset, load_preset
    from spmdkit.models.zoo import config_from_json
    from spmdkit.planner.planning import plan_hf
    from spmdkit.planner.propagate import propagate
    from spmdkit.strategies.strategy import annotate, parse_mesh, parse_strategy

    b, s = 4, 32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, _, _, hp = plan_hf("DeepseekV3ForCausalLM", DS_SCALED, mesh, strategy, dtype="bf16", batch=b, seq=s)
        cfg = config_from_json(json.dumps(DS_SCALED)).with_(batch=b, seq=s, dtype="bfloat16")
        m = parse_mesh(mesh)
        st = parse_strategy(strategy, m)
        model = load_preset(Preset("deepseek-v3-scaled"), cfg, vocab_parallel_loss="megatron" in st).model
        assert model is not None
        zp = propagate(model.program, m, annotate(model, m, st))
    (hf_flops, hf_mem, hf_per), (z_flops, z_mem, z_per) = _summary(hp), _summary(zp)
    # 2 MoE layers, each a float32 router of 8 x 256: 2 bytes more an element, no float32 master copy (4 less)
    assert (hf_mem[0] - z_mem[0], hf_mem[1] - z_mem[1], hf_mem[2] - z_mem[2]) == (2 * 2048 * 2, 0, -2 * 2048 * 4)
    assert hf_per.get(0) == z_per.get(0), (sorted(hf_per, key=str), sorted(z_per, key=str))  # the dense layer
    for layer in (1, 2):
        extra = z_per[layer] - hf_per[layer]
        assert not hf_per[layer] - z_per[layer]
        if "megatron" in strategy:
            assert list(extra.items()) == [(("backward", "all_reduce", (1,), b // 2 * s * 256 * 2), 1)]
        else:
            assert not extra
    assert abs(hf_flops / z_flops - 1) < 0.01


@pytest.mark.parametrize(("mesh", "strategy"), [("dp=2,tp=2", "megatron"), ("dp=2,ep=2", "dp,ep")])
def test_verify_simulates_the_moe_plan(mesh: str, strategy: str) -> None:
    """`plan --hf MixtralForCausalLM --verify`: the plan simulated rank by rank at the tiny config
    (uniform capacity 8 of 16 tokens: some tokens dropped, a token with both choices dropped
    weighted 0, not 0 / 0) equals the unsharded step, every tensor."""
    from spmdkit.sim.verify_plan import verify_hf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = verify_hf("MixtralForCausalLM", CONFIGS["mixtral"][1], mesh, strategy)
    assert rep["ok"], rep["text"]
    assert rep["checked"] > 400
