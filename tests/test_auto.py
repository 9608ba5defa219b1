"""The exact sharding search (spmdkit.graph.auto): candidates from the rules, an ILP solved by
HiGHS, the choice run through propagate."""

from __future__ import annotations

import builtins
from typing import Any

import pytest

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import ProgramError
from spmdkit.graph.auto import auto_plan
from spmdkit.graph.plan_cli import plan_model
from spmdkit.graph.simulate import simulate_plan

pytest.importorskip("highspy")

MESH = "dp=2,tp=2"


@pytest.fixture(scope="module")
def hand() -> dict[str, Any]:
    out = {}
    for s in ("dp", "megatron", "dp,megatron"):
        model, plan, _ = plan_model("tiny-llama", MESH, s, None)
        out[s] = (model, plan)
    return out


@pytest.fixture(scope="module")
def auto(hand: dict[str, Any]) -> Any:
    model, plan = hand["dp"]
    tokens = model.inputs["tokens"]
    return model, auto_plan(model.program, plan.mesh, {tokens: [0, -1]}, time_limit=20)


def test_auto_no_worse_than_hand_strategies(hand: dict[str, Any], auto: Any) -> None:
    model, (plan, info) = auto
    tokens = model.inputs["tokens"]
    for s in ("dp", "dp,megatron"):  # these pin the tokens as the search is pinned
        assert list(hand[s][1].attrs[tokens].dims_mapping) == [0, -1], s
    best = min(p.time_s for _, p in hand.values())
    assert plan.time_s <= best
    assert plan.time_s > 0  # dp over the tokens needs at least the gradient all-reduces
    assert info.status == "Optimal"
    assert 0.0 <= info.gap <= 1e-6
    assert info.objective_s >= 0.0
    assert info.candidates > len(model.program.ops)
    # the returned plan is no dearer than the integer program predicted (the plan shares a
    # reshard among its readers, the program counts it per reader)
    assert info.realized in ("direct", "propagate")
    assert plan.time_s <= info.objective_s * (1 + 1e-9)


def test_with_a_device_compute_plus_communication_no_worse_than_hand() -> None:
    from spmdkit.graph.compute import op_cost, preset_device

    dev = preset_device("h200")

    def step(p: Any) -> float:
        return float(p.time_s + sum(op_cost(p, i).time_s(dev) for i in range(len(p.ops))))

    hand = {s: plan_model("tiny-llama", MESH, s, {"batch": 8, "seq": 256}) for s in ("dp", "megatron", "dp,megatron")}
    model = hand["dp"][0]
    plan, info = auto_plan(model.program, hand["dp"][1].mesh, {model.inputs["tokens"]: [0, -1]}, time_limit=20,
                           device=dev)
    assert info.status == "Optimal"
    assert step(plan) <= min(step(p) for _, p, _ in hand.values())
    assert step(plan) > plan.time_s  # compute counted


def test_auto_plan_is_sound_and_respects_pins(auto: Any) -> None:
    model, (plan, _) = auto
    tokens = model.inputs["tokens"]
    assert list(plan.attrs[tokens].dims_mapping) == [0, -1]
    rep = simulate_plan(plan, seed=0)
    assert rep.ok, rep.failures[:5]
    assert rep.loss is not None


def test_pin_on_a_produced_tensor_is_held(hand: dict[str, Any]) -> None:
    model, p = hand["dp"]
    prog = model.program
    name = next(o.outputs[0] for o in prog.ops if o.rule == "matmul" and o.outputs[0].startswith("layers.0."))
    pin = [-1] * len(prog.tensors[name].shape)
    pin[-1] = 1
    plan, _ = auto_plan(prog, p.mesh, {model.inputs["tokens"]: [0, -1], name: pin}, time_limit=20)
    assert plan.attrs[name] == TensorDistAttr(p.mesh, pin)
    assert simulate_plan(plan, seed=0).ok


def test_bad_pin_is_a_program_error(hand: dict[str, Any]) -> None:
    model, p = hand["dp"]
    with pytest.raises(ProgramError, match="no such tensor"):
        auto_plan(model.program, p.mesh, {"nope": [0]})


def test_without_highspy_a_one_line_program_error(hand: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    model, p = hand["dp"]
    real = builtins.__import__

    def fake(name: str, *a: Any, **kw: Any) -> Any:
        if name == "highspy":
            raise ImportError("no highspy")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", fake)
    with pytest.raises(ProgramError) as exc:
        auto_plan(model.program, p.mesh)
    assert "highspy" in str(exc.value) and "\n" not in str(exc.value)


def _cli(*args: str) -> tuple[int, str]:
    import io
    from contextlib import redirect_stderr

    from spmdkit.cli import main

    out, err = io.StringIO(), io.StringIO()
    from contextlib import redirect_stdout

    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue() + err.getvalue()


def test_cli_auto_json() -> None:
    import json

    rc, out = _cli("plan", "--model", "tiny-llama", "--mesh", MESH, "--auto", "--annotate", "tokens=[0,-1]", "--json")
    assert rc == 0, out
    got = json.loads(out)
    assert got["auto"]["status"] == "Optimal"
    assert got["auto"]["folded_layers"] is False and got["auto"]["merged_elementwise"] is True


@pytest.mark.parametrize(("args", "msg"), [
    (("--strategy", "dp"), "--strategy: does not apply with --auto"),
    (("--auto-time-limit", "x"), "--auto-time-limit: 'x' is not a number"),
    (("--auto-time-limit", "0"), "--auto-time-limit: 0 is not between"),
])
def test_cli_auto_bad_arguments(args: tuple[str, ...], msg: str) -> None:
    rc, out = _cli("plan", "--model", "tiny-llama", "--mesh", MESH, "--auto", *args)
    assert rc == 2
    assert msg in out and "Traceback" not in out
