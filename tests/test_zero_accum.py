"""ZeRO-2 / ZeRO-3 with gradient accumulation: Megatron-FSDP and torchtitan's FSDP2 reduce-scatter
the gradients in every micro-step's backward and hold them at their shard; NeMo AutoModel (and
every framework's ZeRO-1) accumulates them unreduced and reduces once
(:func:`spmdkit.program.runtime.reduces_each_microstep`, docs/memory.md)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from dataclasses import replace
from typing import Any

import pytest

from spmdkit.cli import main
from spmdkit.cost.devices import preset_device
from spmdkit.cost.memory import memory_per_device
from spmdkit.cost.step import estimate_step
from spmdkit.planner.planning import plan_model
from spmdkit.program.runtime import FRAMEWORKS, Runtime, reduces_each_microstep

#: tiny-llama (2 layers, hidden 16, 4 heads of 4, 2 kv heads, ffn 32, vocab 64, fp32): the
#: embedding 64 x 16; per layer two norms of 16, wq and wo 16 x 16, wk and wv 16 x 8, w_gate and
#: w_up 16 x 32, w_down 32 x 16; the final norm 16 and the LM head 16 x 64
TINY_PARAMS = 64 * 16 + 2 * (2 * 16 + 2 * 16 * 16 + 2 * 16 * 8 + 3 * 16 * 32) + 16 + 16 * 64
N_PARAMS = 2 * 9 + 3


def _plan_json(strategy: str, k: int, framework: str = "megatron") -> dict[str, Any]:
    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["plan", "--model", "tiny-llama", "--mesh", "dp=4", "--strategy", strategy, "--grad-accum", str(k),
                   "--framework", framework, "--device", "h100", "--json"])
    assert rc == 0
    d: dict[str, Any] = json.loads(out.getvalue())
    assert d["grad_accum"] == k
    return d


def test_the_rule_by_framework_zero_and_pipeline() -> None:
    got = {(fw, z, pp): reduces_each_microstep(fw, z, pp) for fw in FRAMEWORKS for z in range(4)
           for pp in (False, True)}
    every = {("megatron", 2, False), ("megatron", 3, False), ("megatron", 2, True), ("megatron", 3, True),
             ("torchtitan", 2, False), ("torchtitan", 3, False)}
    assert {key for key, v in got.items() if v} == every


def test_zero3_accum_holds_the_gradient_shard_by_hand() -> None:
    """dp=4 zero3 --grad-accum 4 under Megatron-FSDP: each parameter stored and its gradient held
    as a quarter (every parameter has a dim that 4 divides), 4 bytes (fp32) an element."""
    assert TINY_PARAMS == 6736
    one, four = _plan_json("zero3", 1), _plan_json("zero3", 4)
    assert one["memory"]["gradients"] == TINY_PARAMS // 4 * 4 == 6736
    assert four["memory"]["gradients"] == 6736  # at the shard, not the whole 26,944 bytes
    assert four["memory"]["parameters"] == one["memory"]["parameters"] == 6736
    assert four["memory"]["total"] == one["memory"]["total"]


@pytest.mark.parametrize("framework", ["megatron", "torchtitan"])
@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_reduce_scatters_every_micro_step(strategy: str, framework: str) -> None:
    """The step's reduce-scatters, their bytes and their time are K x one micro-step's."""
    one, four = _plan_json(strategy, 1, framework), _plan_json(strategy, 4, framework)
    b1, b4 = one["totals"]["backward"], four["totals"]["backward"]
    assert b1["collectives"]["reduce_scatter"] == N_PARAMS
    assert b4["collectives"]["reduce_scatter"] == 4 * N_PARAMS
    assert b4["collectives"].get("all_gather", 0) == 4 * b1["collectives"].get("all_gather", 0)
    assert b4["bytes_per_rank"] == 4 * b1["bytes_per_rank"]
    s1, s4 = one["step"], four["step"]
    assert s4["comm_s"]["gradient_buckets"] == pytest.approx(4 * s1["comm_s"]["gradient_buckets"])
    # a tiny model's backward hides none of its reductions: every micro-step waits for its own
    assert s4["exposed_s"]["gradient_buckets"] == pytest.approx(4 * s1["exposed_s"]["gradient_buckets"])
    assert s4["exposed_s"]["gradient_buckets"] > 0


def test_step_adds_each_micro_steps_own_reductions() -> None:
    """estimate_step: K - 1 more micro-steps, each with its forward, backward and reductions."""
    _, plan, _ = plan_model("llama-7b", "dp=8", "zero2", {"layers": 2})
    dev = preset_device("h100")
    e1 = estimate_step(plan, dev, 32768)
    e3 = estimate_step(replace(plan, grad_accum=3), dev, 32768)
    assert e3.grad_sync_s == pytest.approx(3 * e1.grad_sync_s)
    assert e3.compute_s["optimizer"] == pytest.approx(e1.compute_s["optimizer"])
    micro = sum(e1.compute_s[ph] + e1.comm_s[ph] for ph in ("forward", "backward")) + e1.kernel_comm_s
    tail = e1.exposed_s["gradient_buckets"]
    assert e3.step_overlap_s == pytest.approx(e1.step_overlap_s + 2 * (micro + tail))
    assert e3.step_serial_s == pytest.approx(e1.step_serial_s + 2 * (micro + e1.grad_sync_s))
    assert memory_per_device(replace(plan, grad_accum=3)).gradients == memory_per_device(plan).gradients


def test_automodel_reduces_once_and_holds_the_gradient_whole() -> None:
    """The same plan under --framework automodel (set_requires_gradient_sync(is_optim_step)):
    one reduce-scatter per parameter a step, the gradient held whole until it."""
    one, four = _plan_json("zero3", 1, "automodel"), _plan_json("zero3", 4, "automodel")
    assert four["totals"]["backward"]["collectives"] == {"all_gather": 4 * N_PARAMS, "reduce_scatter": N_PARAMS}
    assert four["memory"]["gradients"] == 4 * TINY_PARAMS == 26944
    assert four["step"]["comm_s"]["gradient_buckets"] == pytest.approx(one["step"]["comm_s"]["gradient_buckets"])
    mega = _plan_json("zero3", 4, "megatron")
    assert mega["memory"]["gradients"] == 6736
    _, plan, _ = plan_model("llama-7b", "dp=8", "zero3", {"layers": 2}, grad_accum=4)
    auto = replace(plan, runtime=Runtime(framework="automodel"))
    assert sum(plan.reduced_each_microstep(r) for r in plan.reshards) == N_PARAMS  # megatron (the default)
    assert not any(auto.reduced_each_microstep(r) for r in auto.reshards)


def test_zero1_accum_is_unchanged() -> None:
    """ZeRO-1 (the gradient all-reduced whole; Megatron's distributed optimizer reduce-scatters
    it in the last micro-step only): today's figures for tiny-llama dp=4 --grad-accum 4 (the step
    0.0019084559215598916 s before it ran at the slowest of its 4 GPUs' pace, Device.slowdown;
    0.0018817882617865123 before each attention kernel's own shape and the sustained share 0.843;
    0.0018575587008109527 before the share 0.870; 0.0018266158804409573 before the share 0.864;
    0.0018333249333143905 before cuDNN's 9.1.0 level and the share 0.853; 0.0018458699970109026 before
    the share 0.870)."""
    d = _plan_json("zero1", 4)
    assert d["memory"]["gradients"] == 26944 and d["memory"]["optimizer_states"] == 13640
    assert d["totals"]["backward"]["collectives"] == {"all_reduce": N_PARAMS}
    assert d["totals"]["backward"]["bytes_per_rank"] == 40416
    assert d["step"]["step_overlap_s"] == pytest.approx(0.0018266158804409573, rel=1e-9)
    assert d["step"]["comm_s"]["gradient_buckets"] == pytest.approx(8.512266666666665e-06, rel=1e-9)


@pytest.mark.parametrize(("framework", "said"), [("megatron", "ZeRO's gradients reduce-scattered in each"),
                                                 ("automodel", "gradients reduced once")])
def test_the_report_says_when_the_gradients_are_reduced(framework: str, said: str) -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["plan", "--model", "tiny-llama", "--mesh", "dp=4", "--strategy", "zero3", "--grad-accum", "4",
                   "--framework", framework, "--device", "h100", "--wide"])
    assert rc == 0
    assert f"4 micro-steps accumulated, {said})" in out.getvalue()
