"""The optimizer update keeps each parameter's layout; ZeRO-1/2/3 (FSDP): memory against the ZeRO
paper's formulas, the collectives each stage adds, and the sharded step checked by the simulator."""

from __future__ import annotations

import io
import sys
from collections import Counter
from contextlib import redirect_stderr
from dataclasses import replace
from typing import Any

import pytest

from spmdkit.core.errors import ProgramError
from spmdkit.cost.memory import memory_per_device
from spmdkit.planner.planning import plan_model
from spmdkit.program.runtime import Runtime
from spmdkit.strategies.strategy import parse_mesh, parse_strategy

MiB = 1 << 20
PINS = {"layers.0.wo": [-1, -1], "layers.0.w_down": [-1, -1]}


def _collectives(plan: Any, phase: str) -> Counter[tuple[str, str]]:
    """(collective kind, tensor) -> how many, in one phase."""
    return Counter((s.kind, r.tensor) for r, s in plan.collectives(phase))


# -- the update on the parameter's layout -------------------------------------------------------


def test_replicated_weights_update_on_their_own_layout() -> None:
    model, plan, _ = plan_model("llama-7b", "dp=2,tp=4", "megatron", {"layers": 1}, dict(PINS))
    numel = 0
    for p in PINS:
        _g, states, new, new_states = model.optimizer[p]
        a = plan.attrs[p]
        assert a.dims_mapping == (-1, -1)
        # the updated parameter and every state (moments, fp32 master) keep the parameter's layout
        for n in (new, *states, *new_states):
            assert plan.attrs[n] == a, n
        numel += model.program.tensors[p].shape[0] * model.program.tensors[p].shape[1]
    # nothing of the update is resharded after it: no moment or parameter all-gathered
    opt = _collectives(plan, "optimizer")
    assert not [k for k in opt if ".moment" in k[1] or ".master" in k[1] or k[1].endswith(".new")]
    # the plan gathers each bf16 gradient once over tp (3/4 of it arrives at each of 4 ranks)
    gathered = sum(s.bytes_per_rank for r, s in plan.collectives("optimizer")
                   if s.kind == "all_gather" and r.tensor in {p + ".grad" for p in PINS})
    assert gathered == numel * 2 * 3 // 4
    assert round(gathered / MiB, 1) == 88.5
    # the column-parallel weights are untouched: their update runs on their tp shards
    assert plan.attrs["layers.0.wq.new"] == plan.attrs["layers.0.wq"]
    assert plan.attrs["layers.0.wq"].dims_mapping == (-1, 1)


def test_replicated_weights_update_simulated() -> None:
    pytest.importorskip("numpy")
    from spmdkit.sim.plan import simulate_plan

    model, plan, _ = plan_model("tiny-llama", "dp=2,tp=2", "megatron", None, dict(PINS))
    for p in PINS:
        assert plan.attrs[model.optimizer[p][2]] == plan.attrs[p]
    rep = simulate_plan(plan, seed=3)
    assert rep.ok, rep.failures[:5]
    assert rep.checked > 200


# -- ZeRO memory: Rajbhandari et al. 2020, Figure 1 ---------------------------------------------


@pytest.mark.parametrize("strategy", ["dp", "zero1", "zero2", "zero3"])
def test_zero_memory_matches_megatron_and_torchtitan(strategy: str) -> None:
    """Bytes per parameter as the frameworks allocate them. Megatron-LM's table
    (docs/api-guide/dist_optimizer.md, bf16 parameters, fp32 gradients): 18 without the
    distributed optimizer, 6 + 12/d with it (our zero1: bf16 parameter 2 + fp32 main gradient 4,
    fp32 master + two moments 12 sharded); zero2 also shards the gradient, zero3 the parameter.
    torchtitan's FSDP2: fp32 parameter, gradient and two moments, 16/d."""
    nd = 4
    model, plan, _ = plan_model("gpt2-small", f"dp={nd}", strategy, {"layers": 1})
    prog = model.program
    params = [t for t in prog.tensors.values() if t.kind == "parameter" and not t.inplace_of]
    psi = sum(t.numel for t in params)
    assert psi % nd == 0 and all(t.dtype == "bfloat16" for t in params)
    expected = {"dp": 18 * psi,
                "zero1": 6 * psi + 12 * psi // nd,
                "zero2": 2 * psi + 16 * psi // nd,
                "zero3": 18 * psi // nd}[strategy]
    scalars = 8 * len(params)  # each update's beta1_pow / beta2_pow (fp32 [1]), replicated
    mem = memory_per_device(plan)
    assert mem.framework == "megatron"
    assert mem.parameters + mem.gradients + mem.optimizer_states == expected + scalars
    assert mem.parameters == (2 * psi // nd if strategy == "zero3" else 2 * psi)
    assert mem.gradients == (4 * psi if strategy in ("dp", "zero1") else 4 * psi // nd)
    titan = memory_per_device(replace(plan, runtime=Runtime(framework="torchtitan")))
    shard = {"dp": 1, "zero1": 1, "zero2": 1, "zero3": nd}[strategy]
    assert titan.parameters == 4 * psi // shard
    if strategy == "zero3":
        assert titan.parameters + titan.gradients + titan.optimizer_states == 16 * psi // nd + scalars


def test_strategy_aliases() -> None:
    mesh = parse_mesh("dp=2,tp=2")
    assert parse_strategy("zero", mesh) == ("dp", "zero2")
    assert parse_strategy("fsdp", mesh) == ("dp", "zero3")
    assert parse_strategy("megatron,zero1", mesh) == ("dp", "megatron", "zero1")


# -- the collectives of each stage ---------------------------------------------------------------


def test_zero_collectives_per_stage() -> None:
    model, z1, _ = plan_model("tiny-llama", "dp=2", "zero1", {"layers": 2})
    params = [p for p in model.optimizer]
    _, z2, _ = plan_model("tiny-llama", "dp=2", "zero2", {"layers": 2})
    _, z3, _ = plan_model("tiny-llama", "dp=2", "zero3", {"layers": 2})
    grads = {model.optimizer[p][0] for p in params}
    kinds = {name: Counter(s.kind for _, s in plan.collectives(ph))
             for name, plan in (("z1", z1), ("z2", z2), ("z3", z3)) for ph in ("forward",)}
    assert kinds["z1"] == kinds["z2"] == Counter()  # parameters whole: nothing to gather
    # zero1: gradients all-reduced (kept whole), the updated parameter all-gathered
    assert Counter(s.kind for _, s in z1.collectives("backward")) == {"all_reduce": len(params)}
    assert Counter(s.kind for _, s in z1.collectives("optimizer")) == {"all_gather": len(params)}
    # zero2: gradients reduce-scattered instead
    assert Counter(s.kind for _, s in z2.collectives("backward")) == {"reduce_scatter": len(params)}
    assert Counter(s.kind for _, s in z2.collectives("optimizer")) == {"all_gather": len(params)}
    # zero3: every parameter all-gathered once before its forward use and once again in the
    # backward, every gradient reduce-scattered, nothing after the update
    fwd, bwd = _collectives(z3, "forward"), _collectives(z3, "backward")
    assert fwd == Counter({("all_gather", p): 1 for p in params})
    assert bwd == Counter({**{("all_gather", p): 1 for p in params}, **{("reduce_scatter", g): 1 for g in grads}})
    assert not z3.collectives("optimizer")
    for p in params:  # stored sharded, as its states
        assert z3.attrs[p] == z3.attrs[model.optimizer[p][1][0]] == z3.attrs[model.optimizer[p][2]]


def test_zero3_keeps_a_layer_and_the_prefetched_next_gathered() -> None:
    layers = 3
    model, z2, _ = plan_model("llama-7b", "dp=4", "zero2", {"layers": layers})
    _, z3, _ = plan_model("llama-7b", "dp=4", "zero3", {"layers": layers})
    prog = model.program
    per_layer = sum(t.numel * t.itemsize for n, t in prog.tensors.items()
                    if n.startswith("layers.0.") and t.kind == "parameter" and not t.inplace_of)
    head = sum(prog.tensors[n].numel * prog.tensors[n].itemsize for n in ("lm_head", "final_norm"))
    extra = memory_per_device(z3).activation_peak - memory_per_device(z2).activation_peak
    # the gathered copies alive at the peak are two blocks' (the layer computing and the next one,
    # prefetched, as FSDP2 and DeepSpeed do), never all
    assert max(per_layer, head) < extra <= per_layer + max(per_layer, head)
    assert extra < layers * per_layer


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "megatron,zero3"])
def test_zero_step_simulated(strategy: str) -> None:
    pytest.importorskip("numpy")
    from spmdkit.sim.plan import simulate_plan

    _, plan, _ = plan_model("tiny-llama", "dp=2,tp=2", strategy)
    rep = simulate_plan(plan, seed=1)
    assert rep.ok, rep.failures[:5]
    assert rep.checked > 200


def test_zero_cli_verify_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("numpy")
    from spmdkit.cli import main

    rc = main(["plan", "--model", "tiny-gpt2", "--mesh", "dp=2,tp=2", "--strategy", "megatron,sp,fsdp", "--verify"])
    out = capsys.readouterr().out
    assert rc == 0 and "all equal" in out
    for args, msg in ((["--strategy", "zero1,zero3"], "give one ZeRO stage"),
                      (["--strategy", "zero3", "--mesh", "tp=2"], "no 'dp' dim"),
                      (["--strategy", "zero4"], "unknown strategy 'zero4'")):
        err = io.StringIO()
        with redirect_stderr(err):
            rc = main(["plan", "--model", "tiny-llama", *args])
        text = err.getvalue() or capsys.readouterr().err
        assert rc == 2, args
        assert msg in text and text.count("\n") == 1 and "Traceback" not in text, text
    assert sys.modules["spmdkit.strategies.strategy"].zero_stage(("dp", "zero3")) == 3


# -- gradient accumulation ---------------------------------------------------------------------


def test_grad_accum_counts_memory_and_step(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from spmdkit.cli import main
    from spmdkit.cost.devices import preset_device
    from spmdkit.cost.step import estimate_step

    def totals(strategy: str, k: int) -> dict[str, Any]:
        rc = main(["plan", "--model", "llama-7b", "--layers", "2", "--mesh", "dp=8", "--strategy", strategy,
                   "--grad-accum", str(k), "--framework", "automodel", "--json"])
        assert rc == 0
        d = json.loads(capsys.readouterr().out)
        assert d["grad_accum"] == k
        return dict(d["totals"], memory=d["memory"])

    n = 9 * 2 + 3  # parameters of a 2-layer llama
    one, four = totals("zero3", 1), totals("zero3", 4)
    # parameters gathered in every micro-step; gradients reduce-scattered once per step (AutoModel's
    # set_requires_gradient_sync(is_optim_step); Megatron-FSDP and torchtitan: tests/test_zero_accum.py)
    assert one["forward"]["collectives"] == {"all_gather": n}
    assert four["forward"]["collectives"] == {"all_gather": 4 * n}
    assert four["backward"]["collectives"] == {"all_gather": 4 * n, "reduce_scatter": n}
    assert four["forward"]["bytes_per_rank"] == 4 * one["forward"]["bytes_per_rank"]
    # the gradients wait unreduced (whole, in FSDP2's fp32 reduce dtype) for the step's one
    # reduction: 8x the bf16 shard's elements, 2x its bytes each
    assert four["memory"]["gradients"] == 16 * one["memory"]["gradients"]
    assert four["memory"]["parameters"] == one["memory"]["parameters"]
    dp1, dp4 = totals("dp", 1), totals("dp", 4)
    assert dp4["optimizer"] == dp1["optimizer"] and dp4["memory"] == dp1["memory"]

    _, plan, _ = plan_model("llama-7b", "dp=8", "zero2", {"layers": 2})
    plan = replace(plan, runtime=Runtime(framework="automodel"))
    dev = preset_device("h100")
    # llama-7b's 2 layers (q, k, v, o 4096 x 4096; gate, up, down 4096 x 11008; 2 norms), the
    # embedding and the output (32000 x 4096), the final norm
    n_params = 2 * (4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096) + 2 * 32000 * 4096 + 4096
    e1 = estimate_step(plan, dev, 32768)
    plan = replace(plan, grad_accum=3)
    e3 = estimate_step(plan, dev, 32768)
    assert e3.tokens == 3 * 32768
    assert e3.compute_s["forward"] == pytest.approx(3 * e1.compute_s["forward"])
    assert e3.compute_s["optimizer"] == pytest.approx(e1.compute_s["optimizer"])
    assert e3.grad_sync_s == pytest.approx(e1.grad_sync_s)
    micro = sum(e1.compute_s[ph] + e1.comm_s[ph] for ph in ("forward", "backward")) + e1.kernel_comm_s
    # two more forward / backward passes, without gradient reductions (those overlap the last) nor
    # FSDP2's reduce-scatter copy-ins (foreach_reduce_scatter_copy_in on the compute stream: every
    # gradient's bf16 bytes read, its fp32 bytes written), which only the last micro-step runs
    copy_in = (2 + 4) * n_params / dev.hbm_rate
    assert e3.compute_s["backward"] == pytest.approx(3 * e1.compute_s["backward"] - 2 * copy_in)
    assert e3.step_overlap_s == pytest.approx(e1.step_overlap_s + 2 * (micro - copy_in))
    assert e3.step_serial_s == pytest.approx(e1.step_serial_s + 2 * (micro - copy_in))


def test_storage_of_a_made_tensor_is_refused() -> None:
    from spmdkit.models.zoo import build_model, preset
    from spmdkit.planner.propagate import propagate
    from spmdkit.strategies.strategy import annotate

    model = build_model(preset("tiny-llama"))
    mesh = parse_mesh("dp=2")
    ann = annotate(model, mesh, ("dp",))
    with pytest.raises(ProgramError, match=r"storage for 'embed.out': only a program input"):
        propagate(model.program, mesh, ann, storage={"embed.out": [0, -1, -1]})
    with pytest.raises(ProgramError, match=r"storage for 'embed': dims_mapping has 1 entries"):
        propagate(model.program, mesh, ann, storage={"embed": [0]})


@pytest.mark.parametrize("strategy", ["megatron,zero1", "megatron,zero3"])
def test_master_weights_simulated(strategy: str) -> None:
    """A bf16 model: each update also reads and writes an fp32 master copy (multi_precision),
    sharded as the moments; the simulator checks it with the rest."""
    pytest.importorskip("numpy")
    from spmdkit.models.zoo import build_model, preset
    from spmdkit.planner.propagate import propagate
    from spmdkit.sim.plan import simulate_plan
    from spmdkit.strategies.strategy import annotate, zero3_storage

    mesh = parse_mesh("dp=2,tp=2")
    st = parse_strategy(strategy, mesh)
    model = build_model(preset("tiny-llama").with_(dtype="bfloat16"), vocab_parallel_loss=True)
    ann = annotate(model, mesh, st)
    plan = propagate(model.program, mesh, ann, storage=zero3_storage(model.optimizer, ann, st))
    master = "layers.0.wq.master"
    assert model.program.tensors[master].dtype == "float32"
    assert plan.attrs[master] == plan.attrs["layers.0.wq.moment1"] == plan.attrs[master + ".new"]
    assert plan.attrs[master].dims_mapping == (0, 1)  # dp on the free axis, tp as the weight
    rep = simulate_plan(plan, seed=2)
    assert rep.ok, rep.failures[:5]
    assert rep.checked == 260  # 239 of the fp32 model and the 21 master copies
