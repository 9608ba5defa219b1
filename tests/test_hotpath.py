"""The planner's per-program tables (made once per Program, shared by every plan of it) and the
other hot-path shortcuts give exactly what was computed before: a plan on a program whose tables
another plan made equals the plan on a freshly built program, figure for figure; the tables are
forgotten when a program is rebuilt; the pipeline schedule's simulation keeps its units."""

from __future__ import annotations

import copy
import gc
import json
import pickle
import weakref
from dataclasses import fields, replace

import pytest

import spmdkit.cost.step as step_mod
import spmdkit.cost.step_compute as compute_mod
from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.mesh import ProcessMesh
from spmdkit.cost.devices import preset_device
from spmdkit.cost.step import estimate_step
from spmdkit.engine.memo import Recent
from spmdkit.models.zoo import build_model, config_from_json, preset
from spmdkit.ops import clear_cache, set_cache_enabled
from spmdkit.planner import propagate as prop_mod
from spmdkit.planner.fuse import Fusion
from spmdkit.planner.planning import plan_model
from spmdkit.planner.schedules import run_schedule
from spmdkit.planner.stage_costs import stage_costs
from spmdkit.program.ir import Op, Program
from spmdkit.strategies.strategy import annotate, parse_mesh, parse_strategy

_MOE = {"base": "tiny-llama", "layers": 3, "experts": 4, "top_k": 2, "moe_ffn": 8, "shared_experts": 1,
        "dense_layers": 1}


def _model(moe: bool = False):  # type: ignore[no-untyped-def]
    cfg = config_from_json(json.dumps(_MOE)) if moe else preset("tiny-llama").with_(layers=3)
    return build_model(cfg, vocab_parallel_loss=True)


def _plan(model, mesh_text: str, strategy: str):  # type: ignore[no-untyped-def]
    mesh = parse_mesh(mesh_text)
    return prop_mod.propagate(model.program, mesh, annotate(model, mesh, parse_strategy(strategy, mesh)))


def test_op_names_are_found_once_and_handed_out_as_fresh_lists() -> None:
    op = Op("concat", {"x": ("a", None, "b"), "y": None}, (("c", None), "d"))
    assert op.input_names() == ["a", "b"]
    assert op.output_names() == ["c", "d"]
    got = op.input_names()
    got.append("z")  # a caller's list is its own
    assert op.input_names() == ["a", "b"]
    assert op.__dict__["_input_names"] == ("a", "b")


def test_a_program_table_is_made_once_and_forgotten_by_a_rebuild() -> None:
    prog = _model().program
    calls: list[int] = []

    def make(p: Program) -> int:
        calls.append(1)
        return len(p.ops)

    assert prog.derived("t", make) == len(prog.ops) and prog.derived("t", make) == len(prog.ops)
    assert len(calls) == 1
    # a rewritten copy (hf_fused.rebuild: __dict__ copy, then Program.__init__) makes its own
    new = Program.__new__(Program)
    new.__dict__.update(prog.__dict__)
    Program.__init__(new, list(prog.tensors.values()), prog.ops[:-1], prog.name)
    assert new.derived("t", make) == len(prog.ops) - 1
    assert len(calls) == 2


def test_a_program_pickles_without_its_tables() -> None:
    """``spmdkit run`` pickles a plan: the propagation's per-op calls (rule functions inside) are
    left out, and a plan on the unpickled program is the plan on the original."""
    model = _model()
    plan = _plan(model, "dp=2,tp=2", "megatron")
    assert "propagate.calls" in model.program._derived
    back = pickle.loads(pickle.dumps(plan))
    assert back.program._derived == {} and back.attrs == plan.attrs
    model.program = back.program
    assert _plan(model, "dp=2,tp=2", "megatron").attrs == plan.attrs
    old = Program.__new__(Program)  # pickled before programs had tables: made on first use
    old.__setstate__({k: v for k, v in back.program.__dict__.items() if k != "_derived"})
    assert old.derived("n", lambda p: len(p.ops)) == len(plan.program.ops)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_plan_on_a_program_another_plan_warmed_equals_one_on_a_fresh_build(moe: bool) -> None:
    """The second mesh's plan reads the tables the first one made (the ops' calls, their
    tensors, the expert ops, the value reads and spans): every dist attr, reshard, op cost, the
    step and each pipeline stage's memory equal those of a plan on a program built afresh."""
    warm = _model(moe)
    first = _plan(warm, "dp=2,tp=2", "megatron")
    second = _plan(warm, "dp=4,tp=2", "megatron,sp")
    assert warm.program.derived("propagate.calls", prop_mod._program_calls) is \
        warm.program.derived("propagate.calls", lambda p: None)  # one table, made by the first plan
    fresh = _plan(_model(moe), "dp=4,tp=2", "megatron,sp")
    assert second.attrs == fresh.attrs
    assert [(r.tensor, r.src, r.dst, r.op_index) for r in second.reshards] == \
        [(r.tensor, r.src, r.dst, r.op_index) for r in fresh.reshards]
    dev = preset_device("h100")
    assert estimate_step(second, dev).to_json() == estimate_step(fresh, dev).to_json()
    n = len(second.program.ops)
    stages = [0 if i < n // 2 else 1 for i in range(n)]
    got = [c.to_json() for c in stage_costs(second, stages, (2, 2), dev, "full")]
    assert got == [c.to_json() for c in stage_costs(fresh, stages, (2, 2), dev, "full")]
    assert got[0]["working_peak"] > 0 and got[1]["stash_bytes"] > 0
    assert first.attrs != second.attrs  # the two meshes' plans differ: the tables hold nothing of a plan


def test_a_fusion_is_made_once_and_maps_as_a_fresh_one() -> None:
    mesh = ProcessMesh([2, 4, 2], dim_names=["dp", "ep", "tp"])
    f = Fusion.of(mesh, ((0, 1),))
    assert Fusion.of(mesh, ((0, 1),)) is f and Fusion.of(mesh, ((1, 2),)) is not f
    fresh = Fusion(mesh, ((0, 1),))
    for dm, partial in [([(0, 1), -1], None), ([-1, 2], {0: "sum", 1: "sum"}), ([0, -1], None)]:
        a = TensorDistAttr(mesh, dm, partial)
        for _ in range(2):  # the second answer from the memo
            assert f.attr_in(a) == fresh.attr_in(a)
            assert f.attr_out(f.attr_in(a)) == fresh.attr_out(fresh.attr_in(a))
    assert f.attr_in(TensorDistAttr(mesh, [(0, 1), -1])).dims_mapping == (0, -1)
    assert f.attr_out(TensorDistAttr(f.fused, [0, 1])).dims_mapping == ((0, 1), 2)


def test_the_interleaved_schedule_runs_its_units_in_dependency_order() -> None:
    """p=2, v=2, m=2: each unit starts when its device is free and its input has arrived (the
    forward of the stage before plus its send, the backward of the stage after plus its send)."""
    run = run_schedule("interleaved", 2, 2, 2, [1.0, 2.0, 1.5, 1.0], [2.0, 3.0, 2.5, 2.0],
                       [0.25] * 4, [0.5] * 4)
    ends = {(kind, k, i): (start, end) for _r, kind, k, i, start, end in run.units}
    assert ends[("F", 0, 0)] == (0.0, 1.0)
    assert ends[("F", 1, 0)] == (1.25, 3.25)  # after stage 0's forward and its send
    assert ends[("B", 3, 0)][0] >= ends[("F", 3, 0)][1]
    assert ends[("B", 2, 0)][0] >= ends[("B", 3, 0)][1] + 0.5
    assert len(run.units) == 2 * 2 * 2 * 2
    assert run.finish_s == [max(u[5] for u in run.units if u[0] == r) for r in range(2)]
    assert run.pipeline_s == max(run.finish_s)


def test_a_plan_timed_again_after_others_is_not_costed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ops' costs of the last few (plan, device) pairs are kept: timing a plan again after
    another one (the search's step, then its stages, then the bound's copy) costs its ops once,
    and each caller gets the same figures with sums of its own."""
    model = _model()
    a, b = _plan(model, "dp=2,tp=2", "megatron"), _plan(model, "dp=4", "dp")
    dev = preset_device("h100")
    computed: list[int] = []
    real = compute_mod._compute_ops
    monkeypatch.setattr(compute_mod, "_compute_ops", lambda p, d: computed.append(1) or real(p, d))
    monkeypatch.setattr(compute_mod, "_LAST", Recent(8))
    first = compute_mod.step_compute(a, dev)
    compute_mod.step_compute(b, dev)
    again = compute_mod.step_compute(a, dev)
    assert len(computed) == 2
    assert again.times == first.times and again.by_phase == first.by_phase and again.by_phase is not first.by_phase
    assert again.flops == first.flops > 0
    compute_mod.step_compute(b, preset_device("a100-80gb"))  # another device: another pair
    for _ in range(8 - 1):  # a pushed out by as many other pairs as are kept
        compute_mod.step_compute(_plan(model, "dp=2", "dp"), dev)
    compute_mod.step_compute(a, dev)
    assert len(computed) == 3 + 8


def _fresh(oc):  # type: ignore[no-untyped-def]
    return (oc.compute, oc.wait, oc.pending, oc.costs, oc.param_gathers, oc.prefetch_exposed, oc.gathers_s)


def test_op_communication_is_computed_once_per_plan_contents_and_device() -> None:
    """op_communication keeps its answers by what it reads of a plan (every field but ``rounds``)
    and the device: an equal plan (a copy sharing every field, the search's re-pricing) is served
    the object computed first; a plan differing in any field it reads, or another device, is
    computed afresh, and each answer equals one computed without the cache."""
    plan = plan_model("tiny-llama", "dp=2,tp=2", "megatron,sp,zero3", {"layers": 2})[1]
    dev = preset_device("h100")
    first = step_mod.op_communication(plan, dev)
    assert _fresh(first) == _fresh(step_mod._op_communication(plan, dev)) and first.gathers_s > 0
    assert step_mod.op_communication(plan, dev) is first
    assert step_mod.op_communication(replace(plan, rounds=plan.rounds + 1), dev) is first  # not read
    assert step_mod.op_communication(replace(plan, runtime=replace(plan.runtime)), dev) is first  # by value
    m = plan.mesh  # meshes are interned: an equal one is the same object
    changed = {"grad_accum": 2, "runtime": replace(plan.runtime, tp_comm_overlap=True),
               "mesh": ProcessMesh(list(m.shape), list(m.process_ids), ["a", "b"])}
    for f in fields(plan):
        if f.name == "rounds":
            continue
        other = replace(plan, **{f.name: changed.get(f.name, copy.copy(getattr(plan, f.name)))})
        got = step_mod.op_communication(other, dev)
        assert got is not first, f.name
        assert _fresh(got) == _fresh(step_mod._op_communication(other, dev)), f.name
    # the TP overlap changes the answer: a cache keyed without the runtime would serve a wrong one
    overlap = step_mod.op_communication(replace(plan, runtime=changed["runtime"]), dev)
    assert overlap.wait != first.wait
    a100 = step_mod.op_communication(plan, preset_device("a100-80gb"))
    assert a100 is not first and a100.compute != first.compute


def test_op_communication_keeps_its_plans_alive_and_is_reached_by_the_memo_switch() -> None:
    """An answer holds its plan (so the ids in its key are not another plan's while it is kept);
    spmdkit.ops.clear_cache() empties the cache, and with the caches off every call computes."""
    plan = _plan(_model(), "dp=2,tp=2", "megatron")
    dev = preset_device("h100")
    tmp = replace(plan, attrs=dict(plan.attrs))
    ref = weakref.ref(tmp)
    step_mod.op_communication(tmp, dev)
    assert [v[:2] for v in step_mod._OC.values.values() if v[0] is tmp] == [(tmp, dev)]
    del tmp
    gc.collect()
    assert ref() is not None
    clear_cache()
    gc.collect()
    assert ref() is None and len(step_mod._OC) == 0
    set_cache_enabled(False)
    try:
        assert step_mod.op_communication(plan, dev) is not step_mod.op_communication(plan, dev)
        assert len(step_mod._OC) == 0
    finally:
        set_cache_enabled(True)
    assert step_mod.op_communication(plan, dev) is step_mod.op_communication(plan, dev)
