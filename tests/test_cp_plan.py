"""Context parallelism end to end on the cost side: Llama-3-8B at 131,072 tokens on 64 H100s
(cp=8, tp=8) plans, fits in 80 GB, reports its ring's exposed communication, and carries the
error band of the published cp runs, whose accuracy is issue 26's bound or not yet (a strict xfail);
the search considers cp for long sequences only."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from spmdkit.cli import main as spmdkit_main
from spmdkit.cost.band import error_band
from spmdkit.planner import search_space
from spmdkit.planner.search import context_degrees, factorizations, hand_strategies, search_meshes

GIB = 1024**3
DONE = ["plan", "--model", "llama3-8b", "--seq", "131072", "--batch", "1", "--mesh", "dp=1,cp=8,tp=8",
        "--strategy", "megatron,sp,cp", "--cp-attention", "ring", "--device", "h100"]


def _cli(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        assert spmdkit_main(argv) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def done() -> dict:
    return json.loads(_cli([*DONE, "--json"]))


def test_llama3_8b_131k_on_64_h100s_fits(done: dict) -> None:
    assert done["memory"]["device_total"] <= 80 * GIB
    # activations per rank at 1/cp of the sequence: 16,384 tokens a rank, 2,048 more a tp rank under sp
    st = done["step"]
    assert st["tokens"] == 131072 and st["cp"] == 8


def test_llama3_8b_131k_ring_exposed_reported(done: dict) -> None:
    ring = done["step"]["ring_attention"]
    assert ring["cp"] == 8 and ring["ops"] == 2 * 32  # each layer's attention and its grad
    # a forward step: K and V of 16,384 tokens x 1 kv head (8 over tp=8) x 128 x 2, bf16, and the positions
    assert ring["forward"]["block_bytes"] == 16384 * 1 * 256 * 2 + 16384 * 8
    assert 0 <= ring["exposed_s"] < ring["comm_s"]
    assert ring["exposed_s"] == pytest.approx(sum([ring["forward"]["exposed_s"], ring["backward"]["exposed_s"]]) * 32)
    text = _cli(DONE)
    assert "ring attention over cp=8:" in text and "exposed (" in text


@pytest.mark.xfail(strict=True, reason="issue 29: the published cp runs are not yet predicted within issue 26's bound: "
                   "their band (band.json family cp, benchmarks/fidelity.py) is 0.92-1.18, p90 1.18 > 1.12, set by "
                   "torchtitan's Table 2 rows at cp 4 and 8 (1.169, 1.206; docs/context.md: no sourced mechanism found, "
                   "cp 2 at 0.891); strict: passes (and fails here) once those runs are predicted within the bound")
def test_llama3_8b_131k_within_the_cp_runs_fidelity_bound(done: dict) -> None:
    # issue 29: the plan's predicted step is within the fidelity bound of the published long-context
    # runs. A plan has no measured step of its own: it carries the error band of the published runs
    # with cp > 1, and that band must meet issue 26's bound on them: the median within 5% and 80% of
    # the runs within 12% (the band's 10th and 90th percentiles of measured / predicted step time)
    band = error_band("h100", cp=True)
    assert band is not None and band.family.startswith("context-parallel") and band.runs == 8
    assert done["step"]["error_band"]["family"] == band.family
    assert abs(band.p50 - 1) <= 0.05
    assert 0.88 <= band.p10 and band.p90 <= 1.12


def test_context_degrees() -> None:
    assert context_degrees(8, 8192) == [1]  # short sequences: no cp
    assert context_degrees(8, 131072) == [1, 2, 4, 8]
    assert context_degrees(6, 16384) == [1, 2]  # 2 x cp must divide the sequence: 3 does not (16384 / 6)
    assert hand_strategies(1, 8, cp=8) == [b + v + z for b in ("megatron", "megatron,sp")
                                           for v in (",cp", ",cp,cp-attention=ring", ",cp,cp-attention=alltoall")
                                           for z in ("", ",zero1", ",zero2", ",zero3")]
    assert hand_strategies(4, 1) == ["dp", "dp,zero1", "dp,zero2", "dp,zero3"]


def test_short_sequence_search_unchanged() -> None:
    # a dense model at a short sequence: the meshes and strategies of the search before cp, no more
    res = search_meshes("gpt2-small", 8, "a100-80gb", recompute=["none"], pipeline=False, overrides={"layers": 2})
    refused = {(c.dp, c.tp) for c, _ in res.refused}
    want = {(dp, tp, s) for dp, tp, _pp in factorizations(8, False) for s in hand_strategies(dp, tp)
            if (dp, tp) not in refused and not (tp == 1 and "megatron" in s)}
    assert {(c.config.dp, c.config.tp, c.config.strategy) for c in res.candidates} == want
    assert res.plans == len(want) and all(c.config.cp == 1 for c in res.candidates)


def test_long_sequence_search_picks_cp() -> None:
    # llama3-8b at 131,072 tokens, a global batch of 8 sequences on 64 H100s (2 layers: the choice
    # is per layer): splitting the sequence over cp beats splitting the model over tp=8 (the best
    # mesh without cp: all-gathers and reduce-scatters of every activation over 8 ranks)
    ring = "megatron,sp,cp,cp-attention=ring"
    res = search_meshes("llama3-8b", 64, "h100", recompute=["none"], pipeline=False,
                        strategies=["megatron,sp", "megatron,sp,cp", ring],
                        overrides={"seq": 131072, "batch": 8, "layers": 2})
    best = res.best
    assert best is not None and best.config.cp > 1 and best.config.devices == 64
    assert best.config.strategy in ("megatron,sp,cp", ring)
    plain = [c for c in res.candidates if c.config.cp == 1]
    assert plain and all(c.step_s > best.step_s or not c.fits for c in plain)
    # the attention variant is chosen by cost: both were planned on each cp mesh, each costed on its own
    by = {(c.config.dp, c.config.cp, c.config.tp, c.config.strategy): c.step_s for c in res.candidates if c.config.cp > 1}
    pairs = [(v, by[(dp, cp, tp, ring)]) for (dp, cp, tp, s), v in by.items() if s == "megatron,sp,cp"
             and (dp, cp, tp, ring) in by]
    assert pairs and any(a != b for a, b in pairs)
    assert best.step_s == min(c.step_s for c in res.candidates if c.fits)


def test_auto_search_splits_the_sequence_over_cp(monkeypatch: pytest.MonkeyPatch) -> None:
    # --devices --auto: on a cp mesh the model is built with cp_attention and the exact search
    # chooses to split the sequence over cp (a tiny llama; the long-sequence threshold lowered to it)
    monkeypatch.setattr(search_space, "LONG_SEQ", 64)
    res = search_meshes("tiny-llama", 4, "h100", auto=True, strategies=[], recompute=["none"], pipeline=False,
                        overrides={"seq": 4096, "batch": 1}, time_limit=20)
    cps = [c for c in res.candidates if c.config.cp > 1]
    assert {c.config.cp for c in cps} == {2, 4} and all(c.config.strategy == "auto" for c in res.candidates)
    assert res.best is not None and res.best.config.cp > 1
    for c in cps:
        cp_dim = c.plan.mesh.dim_index("cp")
        assert c.plan.attrs["layers.0.resid1"].dims_mapping[1] == cp_dim  # the residual's sequence over cp
        assert c.estimate.cp == c.config.cp


def test_pipeline_of_a_cp_plan_carries_the_cp_band() -> None:
    d = json.loads(_cli(["plan", "--model", "llama3-8b", "--layers", "2", "--seq", "16384", "--batch", "2",
                         "--mesh", "pp=2,cp=2,tp=2", "--strategy", "megatron,sp,cp", "--microbatches", "2",
                         "--device", "h100", "--json"]))
    assert d["pipeline"]["error_band"]["family"] == error_band("h100", cp=True).family != error_band("h100").family
