"""The MoE dispatch and combine all-to-alls by dispatcher and routing (spmdkit.cost.moe:
reached, expert_all_to_all; spmdkit.cost.collectives.deduplicated_all_to_all) and DeepSeek-V3's
group-limited routing (the dispatch's groups / topk_groups: model config, kernels)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from spmdkit.core.errors import ProgramError
from spmdkit.cost.collectives import Fabric, Group, collective_time, deduplicated_all_to_all
from spmdkit.cost.devices import DEVICES, cost_model, preset_device
from spmdkit.cost.moe import MoeLayer, expert_all_to_all, moe_layers, reached
from spmdkit.cost.step import estimate_step
from spmdkit.models.hf_config import hf_fields
from spmdkit.models.zoo import preset
from spmdkit.planner.planning import plan_preset
from spmdkit.planner.search import _bounds, _model_sizes, search_meshes
from spmdkit.planner.search_config import _Job
from spmdkit.program.runtime import Runtime
from spmdkit.sim.refs.moe import dispatch, limit_groups

H100 = Fabric.of(450e9, 50e9)


def _layer(experts: int, top_k: int, groups: int = 1, keep: int = 1) -> MoeLayer:
    return MoeLayer(0, 0, experts, top_k, 4096 * top_k // experts, 4096, (), frozenset(), groups, keep)


def test_nodes_and_ranks_a_token_reaches() -> None:
    """DeepSeek-V3 on ep=64 over 8 nodes (32 experts a node = one of its 8 groups, 4 a rank):
    node-limited routing reaches exactly its 4 groups' nodes; 8 experts drawn from those 128
    (32 ranks) reach 32 (1 - C(124, 8) / C(128, 8)) of them. Plain top-8 over 256 experts reaches
    8 (1 - C(224, 8) / C(256, 8)) nodes. AutoModel's fake balanced gate (experts 8t .. 8t + 7):
    one node, two ranks; Qwen3-30B-A3B's 128 experts on 8 ranks (16 a rank): one rank."""
    ds = _layer(256, 8, 8, 4)
    nodes, ranks = reached(ds, 8, 64)
    assert nodes == pytest.approx(4.0)
    assert ranks == pytest.approx(32 * (1 - math.comb(124, 8) / math.comb(128, 8)))
    plain = reached(_layer(256, 8), 8, 64)[0]
    assert plain == pytest.approx(8 * (1 - math.comb(224, 8) / math.comb(256, 8)))  # 5.29
    assert reached(ds, 8, 64, "balanced") == (1.0, 2.0)
    assert reached(_layer(128, 8), 1, 8, "balanced") == (1.0, 1.0)
    assert reached(_layer(8, 2), 1, 8, "balanced") == (1.0, 2.0)  # Mixtral: two experts, two ranks


def test_deduplicated_all_to_all_by_hand() -> None:
    """DeepEP's normal kernels across 8 DGX H100 nodes: the NIC bytes at 46 GB/s (0.92 of 400
    Gb/s) and the NVLink bytes at 360 GB/s run pipelined, the slower sets the time; latency 8.4 us
    + 7 network steps of 14 us + 7 NVLink steps of 3.4 us. Inside one node: NVLink alone."""
    g = Group(64, 8)
    t = deduplicated_all_to_all(200e6, 100e6, g, H100)
    assert t == pytest.approx((8.4 + 7 * 14.0 + 7 * 3.4) * 1e-6 + 200e6 / (50e9 * 0.92), rel=1e-12)
    t = deduplicated_all_to_all(1e6, 900e6, g, H100)
    assert t == pytest.approx((8.4 + 7 * 14.0 + 7 * 3.4) * 1e-6 + 900e6 / (450e9 * 0.80), rel=1e-12)
    t = deduplicated_all_to_all(5e9, 100e6, Group(8, 8), H100)
    assert t == pytest.approx((8.4 + 7 * 3.4) * 1e-6 + 100e6 / (450e9 * 0.80), rel=1e-12)


def _deepseek_plan(dispatcher: str, routing: str = "topk"):  # type: ignore[no-untyped-def]
    """DeepSeek-V3's first MoE layer (4 layers: 3 dense first; its MTP module left out: one MoE
    layer), one sequence of 4096 tokens per rank on ep=64 (8 DGX H100 nodes), timed by H100's NCCL
    model."""
    main = '{"base":"deepseek-v3","name":"deepseek-v3","mtp_layers":0}'
    plan = plan_preset(main, "ep=64", "ep", {"layers": 4, "seq": 4096, "batch": 64})[1]
    dev = preset_device("h100")
    return replace(plan, cost=cost_model(plan.mesh, dev), runtime=Runtime(moe_dispatcher=dispatcher,
                                                                            moe_routing=routing))


def _a2a_steps(plan: Any) -> list[tuple[str, Any]]:
    return [(r.tensor, s) for r in plan.reshards if not r.shared for s in r.plan.steps if s.kind == "all_to_all"]


def test_deepseek_v3_dispatch_by_hand() -> None:
    """One rank's 4096 tokens of 7168 bf16 values (58.7 MB): NCCL's all-to-all sends all 8
    copies, 56/64 of them off the node (411 MB at 46 GB/s: 8.9 ms); DeepEP under node-limited
    routing sends each token once to each of the 3.5 remote nodes of its 4 (205 MB: 4.5 ms); under
    AutoModel's balanced gate to 7/8 of one node (51 MB: 1.1 ms). 2 all-to-alls forward, 2 back."""
    token_bytes = 4096 * 7168 * 2
    lat = (8.4 + 7 * 14.0 + 7 * 3.4) * 1e-6
    for dispatcher, routing, net in (("deepep", "topk", 4 * 7 / 8), ("deepep", "balanced", 7 / 8)):
        plan = _deepseek_plan(dispatcher, routing)
        steps = _a2a_steps(plan)
        assert len(steps) == 4 and {plan.program.ops[r.op_index].phase for r in plan.reshards
                                    if not r.shared and any(s.kind == "all_to_all" for s in r.plan.steps)} \
            == {"forward", "backward"}
        for tensor, s in steps:
            assert expert_all_to_all(plan, tensor, s) == pytest.approx(lat + token_bytes * net / (50e9 * 0.92),
                                                                       rel=1e-9)
    plan = _deepseek_plan("alltoall")
    for tensor, s in _a2a_steps(plan):
        assert expert_all_to_all(plan, tensor, s) == s.time_s  # the reshard's own (NCCL's under --device)
    want = collective_time("all_to_all", 8 * token_bytes, Group(64, 8), H100)
    assert want == pytest.approx(lat + 8 * token_bytes * 56 / 64 / (50e9 * 0.92) + 49 * 2.6e-6, rel=0.2)
    assert want > 8 * token_bytes * 56 / 64 / (50e9 * 0.92)


def test_the_dispatcher_sets_the_step() -> None:
    """The step's communication follows: DeepEP under the balanced gate is faster than under
    node-limited routing, which is faster than NCCL's all-to-all; the compute differs under
    the same routing by the alltoall dispatcher's sorts alone, and the balanced gate's exact counts waste no tile on the top-k counts'
    scatter (tests/test_grouped_gemm.py)."""
    dev = preset_device("h100")
    steps = {}
    for d, r in (("alltoall", "topk"), ("deepep", "topk"), ("deepep", "balanced")):
        est = estimate_step(_deepseek_plan(d, r), dev, 64 * 4096)
        steps[d, r] = est
    a, b, c = steps["alltoall", "topk"], steps["deepep", "topk"], steps["deepep", "balanced"]
    # Megatron-Core's alltoall dispatcher sorts the rows by local expert (4 a rank) after the
    # dispatch and back before the combine, and their gradients: 4 passes (read and write) over a
    # rank's [1, 256, 128, 7168] bf16 buffer (spmdkit.cost.moe.sorted_by_expert); DeepEP none
    buf = 256 * 128 * 7168 * 2
    assert a.compute_total_s - b.compute_total_s == pytest.approx(4 * 2 * buf / dev.hbm_rate, rel=1e-9)
    assert c.compute_total_s < a.compute_total_s
    assert a.step_overlap_s > b.step_overlap_s > c.step_overlap_s
    # 4 all-to-alls: NCCL's minus DeepEP's time, exactly
    plan_a, plan_b = _deepseek_plan("alltoall"), _deepseek_plan("deepep")
    saved = sum(s.time_s - expert_all_to_all(plan_b, t, s) for t, s in _a2a_steps(plan_a))
    assert a.comm_total_s - b.comm_total_s == pytest.approx(saved, rel=1e-6)


def test_deepseek_v3_routing_groups_from_the_catalog_and_hf() -> None:
    cfg = preset("deepseek-v3")
    assert (cfg.expert_groups, cfg.topk_groups) == (8, 4)
    plan = plan_preset("deepseek-v3", "ep=8", "ep", {"layers": 4, "seq": 64, "batch": 8})[1]
    layers = moe_layers(plan.program)  # layer 3's and the MTP module's (models/zoo_mtp.py)
    assert len(layers) == 2
    for layer in layers:
        assert (layer.experts, layer.top_k, layer.groups, layer.topk_groups) == (256, 8, 8, 4)
    hf = {"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128, "n_routed_experts": 16,
          "num_experts_per_tok": 4, "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1,
          "n_group": 4, "topk_group": 2, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
          "qk_rope_head_dim": 8, "v_head_dim": 16}
    got = hf_fields(hf)
    assert (got["expert_groups"], got["topk_groups"]) == (4, 2)


@pytest.mark.parametrize(("over", "msg"), [
    ({"expert_groups": 3}, "model: expert_groups 3 / topk_groups 4: the groups must divide the 256 experts"),
    ({"topk_groups": 9}, "model: expert_groups 8 / topk_groups 9:"),
    ({"topk_groups": 0}, "model: topk_groups must be an integer >= 1, got 0"),
])
def test_group_validation(over: dict[str, int], msg: str) -> None:
    with pytest.raises(ProgramError, match="^" + msg.replace("/", "/").replace("(", r"\(")):
        preset("deepseek-v3").with_(**over).check()


def test_group_limited_dispatch_kernels() -> None:
    """4 experts in 2 groups, top-2 among the experts of the 1 best group (a group scores the sum
    of its two best): scores [0.9, 0.1, 0.5, 0.45] pick group 0 (1.0 > 0.95), experts 0 and 1,
    where plain top-2 picks 0 and 2. The torch kernel equals the numpy reference."""
    gl = np.array([[0.9, 0.1, 0.5, 0.45], [0.1, 0.2, 0.3, 0.35]])
    x = np.arange(8.0).reshape(2, 4)
    eid = dispatch(x, gl, None, 2, 4, 2, 1)[4]
    assert eid.tolist() == [[0, 1], [3, 2]]
    assert dispatch(x, gl, None, 2, 4)[4].tolist() == [[0, 2], [3, 2]]
    assert np.isinf(limit_groups(gl, 2, 1)[0, 2:]).all()
    torch = pytest.importorskip("torch")
    from spmdkit.execute.kernels.moe import dispatch as tdispatch

    rng = np.random.default_rng(0)
    xs, gls = rng.standard_normal((2, 16, 4)), rng.random((2, 16, 8))
    got = tdispatch(torch.tensor(xs), torch.tensor(gls), None, 2, 8, 4, 2)
    for b in range(2):
        want = dispatch(xs[b], gls[b], None, 2, 8, 4, 2)
        for g, w in zip(got, want, strict=True):
            assert np.allclose(g[b].numpy(), w)
        groups = {int(e) // 2 for e in want[4].reshape(-1)}
        assert all(len({int(e) // 2 for e in row}) <= 2 for row in want[4]) and groups


def test_cli_flags_and_refusals() -> None:
    base = [sys.executable, "-m", "spmdkit", "plan", "--model", "mixtral-8x7b", "--layers", "1", "--seq", "64",
            "--mesh", "dp=2,ep=8", "--strategy", "dp,ep", "--batch", "16", "--device", "h100"]
    bad = subprocess.run([*base, "--moe-dispatcher", "nvshmem"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].endswith(
        "--moe-dispatcher 'nvshmem': expected one of alltoall, deepep")
    bad = subprocess.run([*base, "--moe-routing", "random"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "--moe-routing 'random': expected one of topk, balanced" in bad.stderr
    assert Runtime(moe_dispatcher="deepep", moe_routing="balanced").to_json()["moe_dispatcher"] == "deepep"


#: a small MoE whose experts dominate (tests/test_search_ep.py's), its tokens long enough that
#: the all-to-alls weigh
SMALL = json.dumps({"base": "tiny-llama", "name": "moe", "layers": 2, "hidden": 256, "heads": 4, "kv_heads": 4,
                    "ffn": 512, "vocab": 512, "seq": 512, "batch": 8, "dtype": "bfloat16", "experts": 8, "top_k": 2,
                    "moe_ffn": 1024})


@pytest.mark.parametrize(("dispatcher", "routing"), [("alltoall", "topk"), ("deepep", "balanced")])
def test_the_step_bound_with_all_to_alls_is_a_lower_bound(dispatcher: str, routing: str) -> None:
    """Every configuration of the small MoE's search on 4 H100 in nodes of 2 (so ep=4 crosses
    nodes): the step bound, with the MoE all-to-alls and the GEMM ceiling, stays at or below the
    planned step; for an ep configuration its all-to-all term is positive and its floor above
    FLOPs at peak."""
    dev = replace(DEVICES["h100"], ranks_per_node=2)
    rt = Runtime(moe_dispatcher=dispatcher, moe_routing=routing)
    full = search_meshes(SMALL, 4, dev, memory_cap=None, prune=False, runtime=rt, pipeline=False)
    mc, sizes = _model_sizes(SMALL, None)
    job = _Job(dev, sizes.tokens, ["none"], 0, None, None, None, 30.0, None, rt)
    b = _bounds(SMALL, mc, job)
    assert b.floor_s > b.flops / b.peak and len(b.moe) == 2
    eps = 0
    for c in full.candidates:
        cf = c.config
        low = b.step(cf.devices, cf.pp, cf.microbatches, cf.ep, cf.strategy, cf.virtual)
        assert low <= c.step_s, cf.label()
        if cf.ep > 1:
            eps += 1
            assert b.all_to_all(cf.devices, cf.ep, cf.strategy) > 0
    assert eps >= 4


def _routing_costs(mesh: str, strategy: str, model: str, rt: Runtime) -> dict[str, list[Any]]:
    from spmdkit.cost.compute import op_cost
    plan = replace(plan_preset(model, mesh, strategy, {"layers": 1, "seq": 512, "batch": 8})[1], runtime=rt)
    out: dict[str, list[Any]] = {}
    for i, op in enumerate(plan.program.ops):
        if op.rule.startswith("moe_") and op.rule in ("moe_gate_dispatch", "moe_combine", "moe_gate_dispatch_grad",
                                                      "moe_combine_grad"):
            out.setdefault(op.rule, []).append(op_cost(plan, i))
    return out


def test_the_alltoall_dispatcher_sorts_the_rows_by_local_expert() -> None:
    """Megatron-Core's MoEAlltoAllTokenDispatcher with 16 local experts (Qwen3-30B-A3B on ep=8):
    the rows sorted by local expert after the dispatch all-to-all and back before the combine's
    (sort_chunks_by_idxs), and their gradients likewise: each routing op one more kernel and one
    more read and write of the rank's rows, [1, 128, 32, 2048] bf16 (512 tokens x top-8 / 128
    experts = 32 a slot) = 16 MiB, against DeepEP's; Mixtral on ep=8 (one expert a rank) and
    torchtitan's runtime: none."""
    rows = 128 * 32 * 2048 * 2
    a2a = _routing_costs("ep=8", "ep", "qwen3-30b-a3b", Runtime())
    deep = _routing_costs("ep=8", "ep", "qwen3-30b-a3b", Runtime(moe_dispatcher="deepep"))
    assert sorted(a2a) == ["moe_combine", "moe_combine_grad", "moe_gate_dispatch", "moe_gate_dispatch_grad"]
    for rule in a2a:
        (a,), (d,) = a2a[rule], deep[rule]
        assert (a.bytes - d.bytes, a.kernels - d.kernels) == (2 * rows, 1), rule
    one = _routing_costs("ep=8", "ep", "mixtral-8x7b", Runtime())
    assert one == _routing_costs("ep=8", "ep", "mixtral-8x7b", Runtime(moe_dispatcher="deepep"))
    tt = _routing_costs("ep=8", "ep", "qwen3-30b-a3b", Runtime(framework="torchtitan"))
    assert tt == _routing_costs("ep=8", "ep", "qwen3-30b-a3b", Runtime(framework="torchtitan", moe_dispatcher="deepep"))
