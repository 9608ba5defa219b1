"""The exact sharding search (spmdkit.planner.auto): candidates from the rules, an ILP solved by
HiGHS, the choice run through propagate."""

from __future__ import annotations

import builtins
import dataclasses
from typing import Any

import pytest

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import ProgramError
from spmdkit.planner.auto import auto_plan
from spmdkit.planner.planning import plan_model
from spmdkit.program.runtime import Runtime
from spmdkit.sim.plan import simulate_plan

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


def _step(p: Any, dev: Any) -> float:
    """Communication (the device's links) + compute + the collectives inside kernels."""
    from spmdkit.cost.compute import kernel_collectives, op_cost
    from spmdkit.cost.devices import cost_model, recost

    p = recost(p, cost_model(p.mesh, dev))
    return float(p.time_s + sum(dev.op_time(op_cost(p, i)) for i in range(len(p.ops)))
                 + sum(k.time_s for k in kernel_collectives(p)))


def _per_op(plan: Any) -> list[tuple[dict[str, TensorDistAttr], dict[str, TensorDistAttr]]]:
    from spmdkit.program.ir import flat_refs

    out = []
    for opp in plan.ops:
        req: dict[str, TensorDistAttr] = {}
        for p, r in opp.required.items():
            for n, a in zip(flat_refs(opp.op.inputs[p]), r if isinstance(r, tuple) else (r,)):
                if n is not None and a is not None:
                    req[n] = a
        outs: dict[str, TensorDistAttr] = {}
        for v, a in zip(opp.op.outputs, opp.outputs):
            for n, x in zip(flat_refs(v), a if isinstance(a, tuple) else (a,)):
                if n is not None and x is not None:
                    outs[n] = x
        out.append((req, outs))
    return out


def test_every_hand_strategy_sharding_is_a_candidate() -> None:
    """Megatron's per-op shardings (tp-partial, dp-sharded gradients summed by add_n;
    reshape_grad with its shape-only input sharded as the gradient) are among the candidates."""
    from spmdkit.core.reshard import CostModel
    from spmdkit.planner.auto import _Gen

    gens: dict[bool, Any] = {}
    for s in ("dp", "megatron", "megatron,sp", "dp,zero"):
        model, plan, _ = plan_model("tiny-llama", MESH, s, None)
        # one generation per program (megatron's has the vocab-parallel loss)
        gen = gens.setdefault("megatron" in s, _Gen(model.program, plan.mesh, CostModel.default(plan.mesh), None, None))
        for i, (req, outs) in enumerate(_per_op(plan)):
            got = [(c[0], c[1]) for c in gen.candidates(i)]
            assert (req, outs) in got, (s, i, model.program.ops[i].rule)


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
    from spmdkit.cost.devices import preset_device
    from spmdkit.models.zoo import build_model, preset

    dev = preset_device("h200")
    hand = {s: plan_model("tiny-llama", MESH, s, {"batch": 8, "seq": 256})
            for s in ("dp", "megatron", "megatron,sp", "dp,zero")}
    model = build_model(preset("tiny-llama").with_(batch=8, seq=256), vocab_parallel_loss=True, check_rules=False)
    seen: list[tuple[str, int, int]] = []
    plan, info = auto_plan(model.program, hand["dp"][1].mesh, {model.inputs["tokens"]: [0, -1]}, time_limit=20,
                           device=dev, progress=lambda ph, d, t: seen.append((ph, d, t)))
    assert info.status == "Optimal"
    assert _step(plan, dev) <= min(_step(p, dev) for _, p, _ in hand.values())
    assert _step(plan, dev) > plan.time_s  # compute counted
    # the progress callback: candidates then the solve, each ending done == total
    phases = [ph for ph, _, _ in seen]
    assert phases[0] == "candidates" and phases[-1] == "solve"
    assert all(0 <= d <= t for _, d, t in seen)
    assert ("candidates", len(model.program.ops), len(model.program.ops)) in seen and ("solve", 1, 1) in seen


def test_column_weights_pinned_no_worse_than_the_all_gather_plan() -> None:
    """llama-7b (1 layer) on dp=2 x tp=4, only the tokens (dp) and the column-parallel weights
    pinned: propagation all-reduces attn_out and mlp_out (384 MiB forward); XLA all-gathers attn2d
    (96 + 192 = 288 MiB). The search's plan moves no more in the forward and is no slower."""
    from spmdkit.cost.devices import cost_model, preset_device
    from spmdkit.models.zoo import build_model, preset
    from spmdkit.planner.propagate import propagate
    from spmdkit.strategies.strategy import parse_mesh

    model = build_model(preset("llama-7b").with_(layers=1), vocab_parallel_loss=True, check_rules=False)
    prog = model.program
    mesh = parse_mesh("dp=2,tp=4")
    dev = preset_device("h100")
    cost = cost_model(mesh, dev)
    pins: dict[str, Any] = {model.inputs["tokens"]: [0, -1]}
    pins.update({p: [-1, 1] for p, r in model.roles.items() if r == "column"})

    def forward_mib(p: Any) -> float:
        return sum(r.bytes_per_rank for r in p.reshards if prog.ops[r.op_index].phase == "forward"
                   and prog.ops[r.op_index].layer == "layer 0") / 2**20

    greedy = propagate(prog, mesh, pins, cost)
    xla = propagate(prog, mesh, {**pins, "layers.0.attn2d": [0, -1, -1], "layers.0.wo": [-1, -1]}, cost)
    assert forward_mib(greedy) == 384.0 and forward_mib(xla) == 288.0
    plan, info = auto_plan(prog, mesh, pins, cost, time_limit=20)  # communication only
    assert info.status == "Optimal"
    assert forward_mib(plan) <= 288.0
    assert plan.time_s <= min(xla.time_s, greedy.time_s)
    for p, dm in pins.items():
        assert list(plan.attrs[p].dims_mapping) == dm


def test_folded_layers_share_one_choice() -> None:
    from spmdkit.models.zoo import build_model, preset

    model = build_model(preset("tiny-llama").with_(layers=4), check_rules=False)
    prog = model.program
    mesh = TensorDistAttr.replicated(plan_model("tiny-llama", MESH, "dp", None)[1].mesh, 1).mesh
    pins = {model.inputs["tokens"]: [0, -1]}
    plan, info = auto_plan(prog, mesh, pins, time_limit=20)
    _free, finfo = auto_plan(prog, mesh, pins, time_limit=20, fold=False)
    assert info.folded and info.folded_layers >= 1 and info.merged_ops > 0
    assert not finfo.folded and finfo.folded_layers == 0
    assert info.variables < finfo.variables
    # folding restricts the choice: never cheaper than the unfolded optimum
    assert info.objective_s >= finfo.objective_s * (1 - 1e-9)
    # the middle layers (1 and 2: the same ops) hold every tensor alike
    for n in prog.tensors:
        if n.startswith("layers.1."):
            m = "layers.2." + n[len("layers.1."):]
            if m in prog.tensors:
                assert plan.attrs[n].dims_mapping == plan.attrs[m].dims_mapping, n
    assert simulate_plan(plan, seed=0).ok


def test_memory_cap_megatron_cannot_meet() -> None:
    """A cap below megatron's memory: the search's plan fits it (the fastest choice does not: the
    program is re-solved with memory priced in); a cap below what any choice holds is a one-line
    ProgramError."""
    from spmdkit.cost.devices import preset_device
    from spmdkit.cost.memory import memory_per_device
    from spmdkit.models.zoo import build_model, preset

    dev = preset_device("h200")
    sizes = {"batch": 8, "seq": 256, "layers": 1}
    hand = {s: plan_model("tiny-llama", MESH, s, sizes)[1] for s in ("dp", "megatron", "megatron,sp", "dp,zero")}
    cap = int(memory_per_device(hand["megatron"]).total * 0.99)
    model = build_model(preset("tiny-llama").with_(**sizes), vocab_parallel_loss=True, check_rules=False)
    mesh = hand["dp"].mesh
    pins = {model.inputs["tokens"]: [0, -1]}
    plan, info = auto_plan(model.program, mesh, pins, time_limit=10, device=dev, memory_cap=cap)
    assert memory_per_device(plan).total <= cap
    assert info.memory_cap == cap and info.memory_bytes is not None and 0 < info.memory_bytes <= cap
    assert "memory-capped" in info.status and info.gap >= 0.0
    assert simulate_plan(plan, seed=0).ok
    with pytest.raises(ProgramError) as exc:
        auto_plan(model.program, mesh, pins, time_limit=10, device=dev, memory_cap=4096)
    msg = str(exc.value)
    assert "--memory 4.00 KiB" in msg and "at least" in msg and "\n" not in msg


def test_explain_prices_the_runner_up() -> None:
    from spmdkit.models.zoo import build_model, preset
    from spmdkit.outputs.report import explain_table

    model = build_model(preset("tiny-llama").with_(layers=1), check_rules=False)
    mesh = plan_model("tiny-llama", MESH, "dp", {"layers": 1})[1].mesh
    _, info = auto_plan(model.program, mesh, {model.inputs["tokens"]: [0, -1]}, time_limit=20, explain=True)
    rows = info.explain
    assert info.status == "Optimal"
    assert "layer 0" in {r.layer for r in rows}
    for r in rows:
        assert r.objective_s == pytest.approx(info.objective_s)
        if r.runner_up_s is not None:  # excluding the layer's choice can only cost more
            assert r.runner_up_s >= r.objective_s * (1 - 1e-6)
    assert any(r.runner_up_s is not None for r in rows)
    table = explain_table(rows).splitlines()
    assert table[0].startswith("--explain: per layer") and len(table) == len(rows) + 2
    assert any(line.strip().startswith("layer 0") for line in table)


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

    rc, out = _cli("plan", "--model", "tiny-llama", "--layers", "1", "--mesh", MESH, "--auto", "--annotate",
                   "tokens=[0,-1]", "--memory", "1GiB", "--json")
    assert rc == 0, out
    got = json.loads(out)
    assert got["auto"]["status"] == "Optimal"
    assert got["auto"]["folded_layers"] is False and got["auto"]["merged_elementwise"] is True
    assert got["auto"]["merged_ops"] > 0 and got["auto"]["layers_folded"] == 0
    assert got["auto"]["memory_cap"] == 2**30 and 0 < got["auto"]["memory_counted"] <= 2**30
    assert got["auto"]["explain"] == []
    assert "memory cap 1.00 GiB" in got["title"]


@pytest.mark.parametrize(("args", "msg"), [
    (("--strategy", "dp"), "--strategy: does not apply with --auto"),
    (("--auto-time-limit", "x"), "--auto-time-limit: 'x' is not a number"),
    (("--auto-time-limit", "0"), "--auto-time-limit: 0 is not between"),
    (("--memory", "lots"), "--memory 'lots': expected a size"),
    (("--memory", "0GB"), "--memory '0GB': expected a size from 1 byte to 1 EiB"),
    (("--memory", "1KiB"), "--memory 1.00 KiB: no plan fits"),
])
def test_cli_auto_bad_arguments(args: tuple[str, ...], msg: str) -> None:
    rc, out = _cli("plan", "--model", "tiny-llama", "--mesh", MESH, "--auto", *args)
    assert rc == 2
    assert msg in out and "Traceback" not in out


@pytest.mark.parametrize("flag", [("--memory", "80GB"), ("--explain",)])
def test_cli_auto_only_flags_need_auto(flag: tuple[str, ...]) -> None:
    rc, out = _cli("plan", "--model", "tiny-llama", "--mesh", MESH, "--strategy", "dp", *flag)
    assert rc == 2
    assert f"{flag[0]}: applies to the --auto search" in out and "Traceback" not in out


def test_overlapped_step_no_worse_than_hand_strategies() -> None:
    """With a device the gradient reductions before the optimizer overlap the backward (the
    step's DDP buckets): the search weights them by GRAD_SYNC_WEIGHT, and its plan's overlapped
    step is no longer than megatron's, megatron+sp's or dp's, and shorter than the plan of the
    serial objective (weight 1) on this case."""
    from spmdkit.cost.devices import cost_model, preset_device
    from spmdkit.cost.step import estimate_step
    from spmdkit.models.zoo import build_model, preset
    from spmdkit.planner.auto import GRAD_SYNC_WEIGHT
    from spmdkit.planner.propagate import propagate
    from spmdkit.strategies.strategy import annotate, parse_mesh, parse_strategy

    dev = preset_device("h100")
    # float32: the gradients reduced in the bytes the search counts (bf16 ones are reduced in fp32)
    cfg = preset("gpt2-small").with_(layers=1, dtype="float32")
    prog = build_model(cfg, vocab_parallel_loss=True, check_rules=False).program
    mesh = parse_mesh("dp=4,tp=2")
    tokens = cfg.batch * cfg.seq

    def step(p: Any) -> float:
        # torch DDP's buckets (1 MiB, then 25 MiB: an FSDP2 framework's replicate): a one-layer
        # model's gradients fit one Megatron bucket of 40M parameters, which overlaps nothing. AutoModel,
        # not torchtitan: its optimizer is the fused update the search costs (torchtitan's foreach AdamW
        # is not, spmdkit.cost.eager.FOREACH)
        ddp = dataclasses.replace(p, runtime=Runtime(framework="automodel"))
        return float(estimate_step(ddp, dev, tokens).step_overlap_s)

    plan, _ = auto_plan(prog, mesh, {"tokens": [0, -1]}, cost_model(mesh, dev, None), time_limit=30, device=dev)
    serial, _ = auto_plan(prog, mesh, {"tokens": [0, -1]}, cost_model(mesh, dev, None), time_limit=30, device=dev,
                          grad_sync_weight=1.0)
    model = build_model(cfg, vocab_parallel_loss=True, check_rules=False)
    hand = {s: step(propagate(model.program, mesh, annotate(model, mesh, parse_strategy(s, mesh))))
            for s in ("dp", "megatron", "megatron,sp")}
    assert 0 < GRAD_SYNC_WEIGHT < 1
    assert step(plan) <= min(hand.values()) * (1 + 1e-9), (step(plan), hand)
    assert step(plan) < step(serial)
    with pytest.raises(ProgramError, match="grad_sync_weight 2 is not between 0 and 1"):
        auto_plan(prog, mesh, grad_sync_weight=2)
