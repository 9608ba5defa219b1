"""The outer search's ``ep-from=cp`` candidates (issue 28): the expert group carved from the
context-parallel ranks where a long sequence's cp degree leaves too few data-parallel ranks for
it (Megatron-Core folds the expert group from dp first, then cp; docs/search.md, docs/experts.md).

For each cp degree ``c`` > 1 the search tries (:func:`spmdkit.planner.search_space.context_degrees`:
sequences of 16k tokens or more) with ``d = dp_total / c`` data-parallel ranks, every expert
group ``e`` > d that divides ``c`` (a cp dim of at least 2 left) and the experts is planned as
the mesh ``dp=d, cp=c/e, ep=e, tp`` under ETP = 1 (``dp,ep`` on tp = 1, ``megatron,sp,ep,etp=1``
where ``ep x tp`` divides the experts), each cp variant, each ZeRO stage, ``ep-from=cp``."""

from __future__ import annotations

import itertools
import json
import tomllib

from spmdkit.cost.devices import DEVICES
from spmdkit.outputs.recipe import megatron_args, recipe, recipe_warning, torchtitan_toml
from spmdkit.planner.search import _bounds, _model_sizes, _work, config_candidates, search_meshes
from spmdkit.planner.search_config import _Job
from spmdkit.planner.search_space import CP_VARIANTS, Config, context_degrees, ep_from_cp_degrees, hand_strategies
from spmdkit.program.runtime import Runtime

#: a tiny MoE (8 experts top-2, 8 heads) at a long sequence: the search tries cp on it
MOE = json.dumps({"base": "tiny-llama", "name": "moe", "layers": 2, "hidden": 64, "heads": 8, "kv_heads": 8,
                  "ffn": 128, "vocab": 256, "seq": 16384, "batch": 1, "dtype": "bfloat16", "experts": 8, "top_k": 2,
                  "moe_ffn": 64})


def _expected(dp_total: int, seq: int, experts: int) -> list[tuple[int, int]]:
    """(ep, cp dim) written out by the rule: cp > 1 of the long sequence, e > dp, e | c, e < c."""
    out = []
    for c in range(2, dp_total + 1):
        if dp_total % c or seq % (2 * c) or seq < 16384:
            continue
        out += [(e, c // e) for e in range(2, c) if c % e == 0 and experts % e == 0 and e > dp_total // c]
    return out


def test_the_degrees_are_those_dp_is_too_small_for() -> None:
    """8 data-parallel ranks at 128k: cp=8 leaves dp=1, so ep 2 (cp 4) and ep 4 (cp 2); cp=4 leaves
    dp=2, too many for ep 2, and ep 4 would leave no cp dim; cp=2 leaves dp=4. None at a short
    sequence, none for a dense model, none where ep does not divide the experts."""
    assert ep_from_cp_degrees(8, 131072, 128) == [(2, 4), (4, 2)]
    assert ep_from_cp_degrees(16, 131072, 128) == [(4, 2), (2, 8), (4, 4), (8, 2)]  # cp=8 (dp 2), cp=16 (dp 1)
    assert ep_from_cp_degrees(8, 8192, 128) == []
    assert ep_from_cp_degrees(8, 131072, 0) == []
    assert ep_from_cp_degrees(8, 131072, 6) == [(2, 4)]
    for n in (4, 8, 12, 16, 32, 64):
        for experts in (8, 60, 128):
            got = ep_from_cp_degrees(n, 131072, experts)
            assert got == _expected(n, 131072, experts), (n, experts)
            assert all(e > n // (e * c) and e * c in context_degrees(n, 131072) for e, c in got)


def test_the_strategies_are_etp1_with_each_cp_variant() -> None:
    """tp > 1: megatron,sp,ep,etp=1 alone (where ep x tp divides the experts), tp = 1: dp,ep;
    each cp variant, ep-from=cp, each ZeRO stage."""
    zeros = ["", ",zero1", ",zero2", ",zero3"]
    assert hand_strategies(1, 2, 2, 4, 8, True) == [
        "megatron,sp,ep,etp=1,ep-from=cp" + v + z for v in CP_VARIANTS for z in zeros]
    assert hand_strategies(1, 1, 2, 4, 8, True) == ["dp,ep,ep-from=cp" + v + z for v in CP_VARIANTS for z in zeros]
    assert hand_strategies(1, 8, 2, 4, 8, True) == []  # ep x tp = 16 does not divide 8 experts
    cfg = Config(1, 2, 2, "megatron,sp,ep,etp=1,ep-from=cp,cp", ep=2, cp=4, microbatches=4)
    assert cfg.ep_from_cp and cfg.batch_ranks == 1 and cfg.devices == 32
    assert cfg.mesh_text == "pp=2,dp=1,cp=4,ep=2,tp=2"  # ep inside cp in rank order
    assert Config(2, 2, 1, "megatron,ep", ep=2).mesh_text == "dp=2,ep=2,tp=2" and \
        Config(2, 2, 1, "megatron,ep", ep=2).batch_ranks == 4


def test_the_search_space_has_them_exactly_when_it_should() -> None:
    """8 devices at 16k: the ep-from=cp configurations are exactly the (ep, cp) of the rule on each
    dp x tp x pp factorisation's data-parallel degree, each with ep > dp and cp > 1, every one
    strategy ETP = 1; none at seq 4096 nor for the same model dense; the strategies of the other
    configurations name no ep-from."""
    _mc, sizes = _model_sizes(MOE, None)
    work, _ = _work(8, True, sizes, None, False)
    got = {(c.dp, c.cp, c.ep, c.tp, c.pp) for c in work if c.ep_from_cp}
    want = set()
    for pp in (1, 2, 4, 8):
        for tp in (1, 2, 4, 8):
            if 8 % (pp * tp) or 8 % tp:
                continue
            dpt = 8 // (pp * tp)
            want |= {(dpt // (e * c), c, e, tp, pp) for e, c in _expected(dpt, 16384, 8) if tp == 1 or 8 % (e * tp) == 0}
    assert got == want and want == {(1, 4, 2, 1, 1), (1, 2, 4, 1, 1), (1, 2, 2, 2, 1), (1, 2, 2, 1, 2)}
    for c in work:
        parts = c.strategy.split(",")
        assert ("ep-from=cp" in parts) == c.ep_from_cp
        if c.ep_from_cp:
            assert c.cp > 1 and c.ep > c.dp and "cp" in parts and (c.tp == 1 or "etp=1" in parts)
            assert c.sub_mesh_text == f"dp={c.dp},cp={c.cp},ep={c.ep},tp={c.tp}"
        else:
            assert not (c.ep > 1 and c.cp > 1)
    short, _ = _work(8, True, _model_sizes(MOE, {"seq": 4096})[1], None, False)
    dense, _ = _work(8, True, _model_sizes(json.dumps({k: v for k, v in json.loads(MOE).items() if k not in ("experts", "top_k", "moe_ffn")}), None)[1], None, False)
    assert not [c for c in short + dense if c.ep_from_cp or "ep-from=cp" in c.strategy]
    given, _ = _work(8, True, sizes, ["dp,ep,cp,ep-from=cp"], False)
    assert {(c.dp, c.cp, c.ep, c.tp, c.pp) for c in given} == {(1, 4, 2, 1, 1), (1, 2, 4, 1, 1), (1, 2, 2, 1, 2)}


def test_the_search_plans_them_and_their_bounds_hold() -> None:
    """The tiny MoE's search on 8 H100 at 16k, every configuration planned: the ep-from=cp ones
    are planned (a step each), their memory and step bounds below what their plans give."""
    full = search_meshes(MOE, 8, "h100", prune=False, recompute=["none"])
    epcp = [c for c in full.candidates if c.config.ep_from_cp]
    assert len({c.config for c in epcp}) >= 40 and all(c.step_s > 0 for c in epcp)
    mc, sizes = _model_sizes(MOE, None)
    job = _Job(DEVICES["h100"], sizes.tokens, ["none"], 0, None, None, None, 30.0, None, Runtime())
    b = _bounds(MOE, mc, job)
    for c in epcp:
        cf = c.config
        assert b.memory(cf.dp * cf.cp, cf.ep, cf.tp, cf.pp, cf.strategy, cf.microbatches) <= c.memory, cf.label()
        assert b.step(cf.devices, cf.pp, cf.microbatches, cf.ep, cf.strategy, cf.virtual) <= c.step_s, cf.label()


def test_the_recipe_of_an_ep_from_cp_configuration() -> None:
    """--export-recipe of dp=1 x cp=4 x ep=2 x tp=2 (ETP = 1, ep from cp) at batch 2: the batch
    over dp alone (micro-batch 2, not 2 / (dp x ep) = 1), the frameworks' context-parallel degree
    the 8 ranks a sequence is split over, the expert group ep x tp = 4 with ETP 1 (before: CP 4,
    EP 2 and the experts tensor-parallel, another layout)."""
    cfg = Config(1, 2, 1, "megatron,sp,ep,etp=1,cp,cp-attention=ring,ep-from=cp", ep=2, cp=4)
    c = next(x for x in config_candidates(MOE, cfg, overrides={"batch": 2}) if x.config.recompute == "none")
    r = recipe(c, "moe", 2, 16384, 2)
    assert (r["micro_batch"], r["context_parallel"], r["expert_parallel"], r["expert_tensor_parallel"]) == (2, 8, 4, 1)
    pairs = dict(itertools.pairwise(megatron_args(r).replace("\\\n", "").split()))
    assert (pairs["--context-parallel-size"], pairs["--expert-model-parallel-size"],
            pairs["--expert-tensor-parallel-size"], pairs["--micro-batch-size"]) == ("8", "4", "1", "2")
    par = tomllib.loads(torchtitan_toml(r))["parallelism"]
    assert (par["context_parallel_degree"], par["expert_parallel_degree"], par["expert_tensor_parallel_degree"]) == \
        (8, 4, 1)
    plain = next(x for x in config_candidates(MOE, Config(2, 2, 1, "megatron,sp,ep", ep=2), overrides={
        "batch": 4, "seq": 256}) if x.config.recompute == "none")  # ETP = tp, ep from dp: as before
    r = recipe(plain, "moe", 4, 256, 2)
    assert (r["micro_batch"], r["context_parallel"], r["expert_parallel"], r["expert_tensor_parallel"]) == (1, 1, 2, 2)
    assert "--expert-tensor-parallel-size" not in megatron_args(r)
    assert "expert_tensor_parallel_degree" not in tomllib.loads(torchtitan_toml(r))["parallelism"]


def test_torchtitan_recipes_degrees_multiply_to_the_devices() -> None:
    """torchtitan's ParallelDims asserts dp_replicate x dp_shard x cp x tp x pp == world size and
    that ep divides dp_shard x cp x tp (its expert group borrows the data-parallel ranks). The
    recipe wrote spmdkit's dp alone as the data-parallel degree, so dp=2 x ep=2 x tp=2 (8 devices)
    came out as 2 x 2 = 4 ranks, which torchtitan refuses, and local_batch_size x dp under the
    global batch (a doubled accumulation). Now the batch ranks dp x ep: FSDP over 4 (written as FSDP
    without ZeRO too, with a warning), and the ep-from=cp layout keeps dp alone (ep is in cp there)."""
    def degrees(par: dict[str, int]) -> int:
        return (par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"]
                * par["context_parallel_degree"] * par["tensor_parallel_degree"] * par["pipeline_parallel_degree"])

    plain = next(x for x in config_candidates(MOE, Config(2, 2, 1, "megatron,sp,ep", ep=2), overrides={
        "batch": 4, "seq": 256}) if x.config.recompute == "none")
    r = recipe(plain, "moe", 4, 256, 2)
    doc = tomllib.loads(torchtitan_toml(r))
    par = doc["parallelism"]
    assert degrees(par) == 8 and (par["data_parallel_shard_degree"], par["data_parallel_replicate_degree"]) == (4, 1)
    assert (par["data_parallel_shard_degree"] * par["context_parallel_degree"] * par["tensor_parallel_degree"]) \
        % par["expert_parallel_degree"] == 0
    assert doc["training"]["global_batch_size"] == doc["training"]["local_batch_size"] * 4  # no accumulation
    assert "written as FSDP" in (recipe_warning("torchtitan", r) or "") and recipe_warning("megatron", r) is None
    z1 = next(x for x in config_candidates(MOE, Config(2, 2, 1, "megatron,sp,ep,zero1", ep=2), overrides={
        "batch": 4, "seq": 256}) if x.config.recompute == "none")
    r1 = recipe(z1, "moe", 4, 256, 2)
    assert degrees(tomllib.loads(torchtitan_toml(r1))["parallelism"]) == 8 and recipe_warning("torchtitan", r1) is None
    cfg = Config(1, 2, 1, "megatron,sp,ep,etp=1,cp,cp-attention=ring,ep-from=cp", ep=2, cp=4)
    c = next(x for x in config_candidates(MOE, cfg, overrides={"batch": 2}) if x.config.recompute == "none")
    assert degrees(tomllib.loads(torchtitan_toml(recipe(c, "moe", 2, 16384, 2)))["parallelism"]) == 16
