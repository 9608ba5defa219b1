"""Whole-model planning: the program IR, propagation, strategies, memory, the end-to-end
simulation and ``spmdkit plan``."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from conftest import cli_stdout
from spmdkit.cli import main
from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.cost.memory import local_numel, memory_per_device
from spmdkit.models.zoo import build_model, preset
from spmdkit.planner.planning import plan_model
from spmdkit.planner.propagate import MAX_ROUNDS, propagate
from spmdkit.program.ir import ProgramBuilder, program_from_json
from spmdkit.program.plan import Plan
from spmdkit.sim.plan import simulate_plan
from spmdkit.strategies.strategy import parse_mesh, parse_strategy

MESH = "dp=2,tp=2"


def _plan(model: str = "tiny-llama", strategy: str = "megatron", mesh: str = MESH, **kw: Any) -> tuple[Any, Plan]:
    m, p, _ = plan_model(model, mesh, strategy, kw or None)
    return m, p


def _kinds(plan: Plan, phase: str) -> Counter[str]:
    return Counter(s.kind for _, s in plan.collectives(phase))


def _mlp(validate: bool = True) -> Any:
    b = ProgramBuilder("mlp")
    b.tensor("x", [8, 16], kind="input")
    b.tensor("w1", [16, 32], kind="parameter")
    b.tensor("w2", [32, 16], kind="parameter")
    b.op("matmul", {"x": "x", "y": "w1"}, [("h", [8, 32])], name="fc1")
    b.op("gelu", {"x": "h"}, [("a", [8, 32])], name="act")
    b.op("matmul", {"x": "a", "y": "w2"}, [("y", [8, 16])], name="fc2")
    return b.build(validate)


# -- the IR -----------------------------------------------------------------------------------


def test_program_json_round_trip() -> None:
    prog = _mlp()
    again = program_from_json(json.loads(prog.dumps()))
    assert again.to_json() == prog.to_json()
    again.validate()


@pytest.mark.parametrize(("edit", "msg"), [
    (lambda d: d["ops"][0].update(rule="matmulx"), "no SPMD rule named .matmulx."),
    (lambda d: d["ops"][1]["inputs"].update(x="nope"), "'nope' is not a tensor"),
    (lambda d: d["ops"].insert(0, d["ops"].pop(1)), "used before any op produces it"),
    (lambda d: d["ops"][2].update(outputs=["h"]), "already produced by op 0"),
    (lambda d: d["tensors"][1].update(shape=[15, 32]), "rejects the op"),
    (lambda d: d["tensors"][3].update(shape=[8, 32, 1]), "makes a 2-D tensor"),
    (lambda d: d["ops"][0]["inputs"].update(z="x"), "no tensor parameter 'z'"),
    (lambda d: d["ops"][0]["attrs"].update(alpha=1), "no attribute 'alpha'"),
    # each op checked, also after an op of the same rule passed (validate keeps each rule's parameters once)
    (lambda d: d["ops"][2]["inputs"].update(z="a"), r"op 2 \(fc2\): rule matmul has no tensor parameter 'z' \(x: T, y: T, trans_x"),
    (lambda d: d["ops"][2]["inputs"].update(trans_x="a"), r"op 2 \(fc2\): rule matmul has no tensor parameter 'trans_x'"),
    (lambda d: d["ops"][2]["attrs"].update(y=1), r"op 2 \(fc2\): rule matmul has no attribute 'y' \(x: T, y: T, trans_x"),
    (lambda d: d["ops"][2]["inputs"].pop("y"), r"op 2 \(fc2\): missing tensor argument 'y' of rule matmul$"),
    (lambda d: d["ops"][2].update(rule="matmulx"), r"op 2 \(fc2\): .*no SPMD rule named .matmulx."),
    (lambda d: d.update(version=7), "version 7 is not supported"),
    (lambda d: d.update(format="onnx"), "'format' must be"),
    (lambda d: d["tensors"][0].update(kind="weights"), "unknown kind"),
])
def test_program_validation_errors(edit: Any, msg: str) -> None:
    d = json.loads(_mlp().dumps())
    edit(d)
    with pytest.raises(ProgramError, match=msg):
        program_from_json(d).validate()


def test_load_program_file_errors(tmp_path: Any) -> None:
    from spmdkit.program.ir import load_program

    with pytest.raises(ProgramError, match="cannot read"):
        load_program(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProgramError, match="is not JSON"):
        load_program(str(bad))


# -- propagation ------------------------------------------------------------------------------


def test_propagate_small_program_megatron_mlp() -> None:
    """Column- then row-parallel: one all-reduce of y, nothing else; annotations never change."""
    prog = _mlp()
    mesh = ProcessMesh([2, 2], dim_names=["dp", "tp"])
    ann = {"x": [0, -1], "w1": [-1, 1], "w2": [1, -1], "y": [0, -1]}
    plan = propagate(prog, mesh, ann)
    assert plan.attrs["h"].dims_mapping == (0, 1)
    assert plan.attrs["a"].dims_mapping == (0, 1)
    for n, dm in ann.items():
        assert plan.attrs[n] == TensorDistAttr(mesh, dm)
    steps = [s for _, s in plan.collectives()]
    assert [s.kind for s in steps] == ["all_reduce"]
    (r,) = [r for r in plan.reshards if not r.shared]
    assert r.tensor == "y" and r.output and r.src.partial and not r.dst.partial


def test_propagate_fills_unannotated_parameters_from_their_first_use() -> None:
    prog = _mlp()
    mesh = ProcessMesh([2, 2], dim_names=["dp", "tp"])
    plan = propagate(prog, mesh, {"x": [0, -1], "h": [0, 1]})
    # w1 has no annotation: the reverse matmul rule lays it out for h
    assert plan.attrs["w1"].dims_mapping == (-1, 1)
    assert plan.rounds <= MAX_ROUNDS


def test_propagate_bad_annotations() -> None:
    prog = _mlp()
    mesh = ProcessMesh([2, 2], dim_names=["dp", "tp"])
    with pytest.raises(ProgramError, match="no such tensor"):
        propagate(prog, mesh, {"zz": [0, -1]})
    with pytest.raises(ProgramError, match="has 3 entries"):
        propagate(prog, mesh, {"x": [0, -1, -1]})
    with pytest.raises(ProgramError, match="annotation for 'x'"):
        propagate(prog, mesh, {"x": [5, -1]})


def test_propagation_is_deterministic() -> None:
    _, a = _plan(strategy="megatron,sp")
    _, b = _plan(strategy="megatron,sp")
    assert a.attrs == b.attrs
    assert [(r.tensor, r.src, r.dst, r.op_index) for r in a.reshards] == [
        (r.tensor, r.src, r.dst, r.op_index) for r in b.reshards]


# -- strategies: the Megatron-LM communication pattern ----------------------------------------


def _ring(kind: str, n: int, nbytes: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n * nbytes, "all_gather": (n - 1) / n * nbytes,
            "reduce_scatter": (n - 1) / n * nbytes}[kind]


@pytest.mark.parametrize("layers", [1, 3])
def test_megatron_tp_two_all_reduces_per_layer_each_way(layers: int) -> None:
    model, plan = _plan(strategy="megatron", layers=layers)
    cfg = model.config
    act = cfg.batch * cfg.seq * cfg.hidden * 4  # [batch, seq, hidden] float32, batch split over dp=2
    for phase in ("forward", "backward"):
        steps = [(r, s) for r, s in plan.collectives(phase)]
        assert Counter(s.kind for _, s in steps) == {"all_reduce": 2 * layers + 1}, phase
        tensors = sorted(r.tensor for r, _ in steps)
        if phase == "forward":  # the row-parallel outputs, and the vocab-parallel embedding's
            want = [f"layers.{i}.{n}" for i in range(layers) for n in ("attn_out", "mlp_out")] + ["embed.out"]
        else:  # the summed input gradients of the column-parallel projections, and the head's
            want = [f"layers.{i}.{n}.out.grad.sum" for i in range(layers) for n in ("attn_norm", "mlp_norm")]
            want.append("final_norm.out.grad")
        assert tensors == sorted(want)
        for r, s in steps:
            assert plan.program.tensors[r.tensor].shape == (cfg.batch, cfg.seq, cfg.hidden)
            assert s.bytes_per_rank == pytest.approx(_ring("all_reduce", 2, act // 2))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_megatron_sp_all_gather_reduce_scatter_pairs(name: str) -> None:
    layers = 2
    model, plan = _plan(name, strategy="megatron,sp", layers=layers)
    cfg = model.config
    act = cfg.batch * cfg.seq * cfg.hidden * 4 // 2  # the local batch of the gathered activation
    for phase in ("forward", "backward"):
        kinds = _kinds(plan, phase)
        assert kinds == {"all_gather": 2 * layers + 1, "reduce_scatter": 2 * layers + 1}, phase
        for _r, s in plan.collectives(phase):
            assert s.bytes_per_rank == pytest.approx(_ring(s.kind, 2, act))


def test_dp_one_gradient_all_reduce_per_parameter() -> None:
    model, plan = _plan(strategy="dp")
    params = [t for t in plan.program.tensors.values() if t.kind == "parameter" and not t.inplace_of]
    assert _kinds(plan, "forward") == {} and _kinds(plan, "backward") == {}
    steps = plan.collectives("optimizer")
    assert Counter(s.kind for _, s in steps) == {"all_reduce": len(params)}
    grads = {r.tensor: s for r, s in steps}
    for p in params:
        g, *_ = model.optimizer[p.name]
        assert grads[g].bytes_per_rank == pytest.approx(_ring("all_reduce", 2, p.numel * 4))


def test_zero_reduce_scatters_gradients_and_gathers_parameters() -> None:
    _model, plan = _plan(strategy="dp,zero")
    params = [t for t in plan.program.tensors.values() if t.kind == "parameter" and not t.inplace_of]
    # ZeRO-2: each gradient reduce-scattered as the backward makes it, the update on the
    # shards, the updated parameter all-gathered
    assert _kinds(plan, "backward").get("reduce_scatter") == len(params)
    assert _kinds(plan, "optimizer") == {"all_gather": len(params)}
    dense = memory_per_device(_plan(strategy="dp")[1])
    zero = memory_per_device(plan)
    assert zero.optimizer_states < dense.optimizer_states
    assert zero.parameters == dense.parameters


def test_strategy_errors() -> None:
    mesh = parse_mesh("dp=2")
    with pytest.raises(ProgramError, match="no 'tp' dim"):
        parse_strategy("megatron", mesh)
    with pytest.raises(ProgramError, match="unknown strategy"):
        parse_strategy("pp", mesh)
    with pytest.raises(ProgramError, match="name=size"):
        parse_mesh("dp:2")


# -- memory -----------------------------------------------------------------------------------


def test_memory_tp_shards_the_weights() -> None:
    _, dp = _plan(strategy="dp")
    _, tp = _plan(strategy="megatron")
    m_dp, m_tp = memory_per_device(dp), memory_per_device(tp)
    assert m_tp.parameters < m_dp.parameters
    # every weight matrix is halved by tp=2; the norm scales stay whole
    prog = tp.program
    full = sum(t.nbytes for t in prog.tensors.values() if t.kind == "parameter" and not t.inplace_of)
    norms = sum(t.nbytes for t in prog.tensors.values()
                if t.kind == "parameter" and len(t.shape) == 1 and not t.inplace_of)
    assert m_tp.parameters == (full - norms) // 2 + norms
    assert m_dp.parameters == full
    assert m_tp.activation_peak > 0 and m_tp.total > m_tp.parameters


def test_local_numel_uneven() -> None:
    mesh = ProcessMesh([3])
    assert local_numel(TensorDistAttr(mesh, [0, -1]), (7, 2)) == 3 * 2


# -- the end-to-end numeric check -------------------------------------------------------------


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("strategy", ["dp", "megatron", "megatron,sp", "dp,zero", "megatron,sp,zero"])
def test_simulated_training_step_equals_unsharded(model: str, strategy: str) -> None:
    _, plan = _plan(model, strategy)
    rep = simulate_plan(plan)
    assert rep.ok, rep.failures[:5]
    assert rep.checked >= len([o for o in plan.program.ops]) // 2
    assert rep.loss is not None


def test_simulation_catches_an_unsound_plan() -> None:
    _, plan = _plan("tiny-llama", "megatron")
    # claim the row-parallel output is already summed: it is partial
    i = next(k for k, o in enumerate(plan.program.ops) if o.rule == "matmul" and o.outputs[0] == "layers.0.attn_out")
    op_plan = plan.ops[i]
    a = op_plan.outputs[0]
    op_plan.outputs[0] = TensorDistAttr(a.mesh, a.dims_mapping)
    rep = simulate_plan(plan)
    assert not rep.ok
    assert rep.failures[0][0] == "layers.0.attn_out"


# -- spmdkit plan -----------------------------------------------------------------------------


def _run(*argv: str) -> tuple[int, str]:
    return cli_stdout(*argv)


def test_cli_plan_report() -> None:
    rc, out = _run("plan", "--model", "llama-7b", "--mesh", "dp=2,tp=4", "--strategy", "megatron", "--layers", "2")
    assert rc == 0
    for part in ("Sharding", "Reshards", "Communication per training step", "Memory per device",
                 "layers.0.wq", "all_reduce", "tp:S(1)"):
        assert part in out, part


def test_cli_plan_json_and_verify() -> None:
    rc, out = _run("plan", "--model", "tiny-llama", "--mesh", MESH, "--strategy", "megatron,sp", "--json", "--verify")
    assert rc == 0
    d = json.loads(out)
    assert d["verify"]["ok"] is True
    # sequence parallel: 5 all-gather / reduce-scatter pairs, and the 3 all-reduces inside the
    # vocab-parallel loss kernel (max, label logit, sum of exp: spmdkit.cost.compute)
    assert d["totals"]["forward"]["collectives"] == {"all_gather": 5, "reduce_scatter": 5, "all_reduce": 3}
    assert [k["what"] for k in d["kernel_collectives"]] == ["row max of the logits", "label logit", "sum of exp"]
    assert d["memory"]["total"] > 0
    assert d["tensors"]["layers.0.wq"]["dims_mapping"] == [-1, 1]


def test_cli_plan_bad_input_is_an_error_not_a_traceback(capsys: Any) -> None:
    assert main(["plan", "--model", "gpt5", "--mesh", MESH]) == 2  # a bad argument: exit 2 (issue 13)
    assert "no preset 'gpt5'" in capsys.readouterr().err
    assert main(["plan", "--model", "tiny-llama", "--mesh", "dp=2", "--strategy", "sp"]) == 2
    assert "tp" in capsys.readouterr().err


def test_cli_plan_program_file(tmp_path: Any) -> None:
    f = tmp_path / "mlp.json"
    f.write_text(_mlp().dumps())
    rc, out = _run("plan", "--program", str(f), "--mesh", MESH, "--annotate", "x=[0,-1]", "--annotate",
                   "w1=[-1,1]", "--annotate", "w2=[1,-1]", "--annotate", "y=[0,-1]", "--json")
    assert rc == 0
    d = json.loads(out)
    assert d["totals"]["forward"]["collectives"] == {"all_reduce": 1}


def test_layers_scale_linearly_in_ops() -> None:
    a = build_model(preset("tiny-llama").with_(layers=2), validate=False).program
    b = build_model(preset("tiny-llama").with_(layers=4), validate=False).program
    c = build_model(preset("tiny-llama").with_(layers=8), validate=False).program
    assert len(c.ops) - len(b.ops) == 2 * (len(b.ops) - len(a.ops))
