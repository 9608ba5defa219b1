"""Planning speed without changed answers: the propagation's memo of rule answers (by the call's
signature and its tensors' dist attrs), the per-op cost memo and the paused garbage collector
give exactly the plan computed from scratch (every memo and cache off), and the repeated
layers are answered once. (benchmarks/plan_equiv.py compares whole reports at full size.)"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from spmdkit.cli import main
from spmdkit.engine.memo import gc_paused
from spmdkit.models.zoo import build_model, preset
from spmdkit.ops import clear_cache, set_cache_enabled
from spmdkit.planner import propagate as prop_mod
from spmdkit.strategies.strategy import annotate, parse_mesh, parse_strategy

_MOE = json.dumps({"base": "tiny-llama", "layers": 5, "experts": 4, "top_k": 2, "moe_ffn": 8, "shared_experts": 1,
                   "dense_layers": 1})
_MLA = json.dumps({"base": "tiny-llama", "layers": 4, "kv_heads": None, "kv_lora_rank": 8, "q_lora_rank": 6,
                   "qk_rope_head_dim": 4, "head_dim": 4, "v_head_dim": 6})
_CASES = {
    "llama megatron": ["--model", "tiny-llama", "--layers", "6", "--mesh", "dp=2,tp=2", "--strategy", "megatron"],
    "gpt2 sp zero3 recompute": ["--model", "tiny-gpt2", "--layers", "4", "--mesh", "dp=2,tp=2",
                                "--strategy", "megatron,sp,zero3", "--recompute", "selective"],
    "moe": ["--model-config", _MOE, "--mesh", "dp=2,tp=2", "--strategy", "megatron"],
    "mla pipeline": ["--model-config", _MLA, "--mesh", "pp=2,dp=2,tp=2", "--strategy", "megatron,sp",
                     "--microbatches", "4"],
}


@pytest.fixture
def caches_restored() -> Iterator[None]:
    yield
    set_cache_enabled(True)
    clear_cache()


def _plan_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    assert main(["plan", *argv, "--device", "h100", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    d.pop("plan_seconds", None)
    return d


@pytest.mark.parametrize("case", list(_CASES), ids=list(_CASES))
def test_memoised_plan_equals_the_plan_from_scratch(case: str, capsys: pytest.CaptureFixture[str],
                                                   caches_restored: None) -> None:
    """Every dist attr, reshard, op cost, memory figure and step time of the plan's JSON is the
    same with the memos on (twice: the second run answered from warm tables) as with every memo
    and cache off."""
    clear_cache()
    warm_cold = _plan_json(_CASES[case], capsys)
    warm = _plan_json(_CASES[case], capsys)
    set_cache_enabled(False)
    scratch = _plan_json(_CASES[case], capsys)
    assert warm_cold == scratch
    assert warm == scratch
    assert scratch["reshards"] and (scratch.get("step") or scratch.get("pipeline"))  # reshards, a predicted step


def _answers(layers: int) -> tuple[int, int]:
    """(distinct rule calls the propagation answered, ops) for tiny-llama under megatron."""
    cfg = preset("tiny-llama").with_(layers=layers)
    model = build_model(cfg, vocab_parallel_loss=True, check_rules=False)
    mesh = parse_mesh("dp=2,tp=2")
    p = prop_mod._Propagation(model.program, mesh, annotate(model, mesh, parse_strategy("megatron", mesh)), None,
                              None)
    p.sweeps(None)
    assert p.answers is not None
    return len(p.answers), len(model.program.ops)


def test_repeated_layers_are_answered_once() -> None:
    """Going from 4 to 12 layers adds ops but no distinct rule call: layer k's calls are layer
    1's (the same shapes and dist attrs), answered from the memo."""
    a4, ops4 = _answers(4)
    a12, ops12 = _answers(12)
    assert ops12 > ops4 + 100
    assert a12 == a4
    assert a4 < ops4 / 2


def test_gc_paused_restores_the_collector() -> None:
    """The collector is off inside, back on after (also after an error), and left off where it
    was off."""
    seen: list[bool] = []

    @gc_paused
    def f(fail: bool) -> None:
        seen.append(gc.isenabled())
        if fail:
            raise ValueError("x")

    assert gc.isenabled()
    f(False)
    with pytest.raises(ValueError):
        f(True)
    assert seen == [False, False] and gc.isenabled()
    gc.disable()
    try:
        f(False)
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("case", ["llama megatron", "mla pipeline"])
def test_plan_command_runs_with_the_collector_paused(case: str, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``spmdkit plan`` (flat, and a pipeline) builds, costs and encodes its JSON with the cyclic
    collector off (cli/plan.py's ``_plan_one``: half of a 100-layer pipeline's planning time
    was the collector walking the heap), and turns it back on when done."""
    from spmdkit.cli import pipeline as cli_pipeline
    from spmdkit.cli import plan as cli_plan

    seen: list[bool] = []

    def spy(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            seen.append(gc.isenabled())
            return fn(*args, **kwargs)
        return wrapped

    for mod, name in ((cli_plan, "plan_json"), (cli_pipeline, "pipeline_plan_json")):
        monkeypatch.setattr(mod, name, spy(getattr(mod, name)))
    assert gc.isenabled()
    d = _plan_json(_CASES[case], capsys)
    assert seen == [False] and gc.isenabled()
    assert ("pipeline" in d) == (case == "mla pipeline")


def test_a_command_lets_its_plans_go_when_it_returns(capsys: pytest.CaptureFixture[str]) -> None:
    """``spmdkit.cli.main`` called in a long-lived process: the memos keyed by the ids of the plans
    and programs a command made (the step's compute, the MoE scan: they hold the objects so that
    the ids stay theirs) are emptied when it returns, so its plans are freed; the rule answers
    (by value) are kept for the next command. Before, each command left its plan alive in
    them, up to 16 whole plans (millions of containers each full collection walked)."""
    from spmdkit.cost import moe, step_compute
    from spmdkit.engine.registry import cache_stats
    from spmdkit.program.plan import Plan

    def plans() -> int:
        gc.collect()
        return sum(type(o) is Plan for o in gc.get_objects())

    before = plans()
    argv = ["plan", "--model-config", _MOE, "--mesh", "dp=2,tp=2", "--strategy", "megatron", "--device", "h100",
            "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["step"]["step_overlap_s"] > 0
    assert len(step_compute._LAST) == len(moe._MEMO) == len(moe._LOADS) == 0
    assert plans() == before
    assert cache_stats()["entries"] > 0
