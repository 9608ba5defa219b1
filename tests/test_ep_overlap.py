"""``--ep-comm-overlap`` (Megatron-Core's ``--overlap-moe-expert-parallel-comm``): the interleaved
schedule's steady-state forward and backward merged, each one's expert all-to-alls hidden under
the other's work up to that work (spmdkit.planner.schedules, spmdkit.planner.ep_overlap); one
more warm-up forward and one more model chunk in flight; the refusals."""

from __future__ import annotations

import json
from typing import Any

import pytest

from conftest import cli_stdout
from spmdkit.cli import main
from spmdkit.planner.chunk_plan import ChunkOps, LayerOps, chunk_run
from spmdkit.planner.schedules import in_flight, interleaved_warmup, run_schedule, schedule_order

MOE = ["plan", "--model", "mixtral-8x7b", "--layers", "4", "--seq", "1024", "--batch", "16", "--device", "h100"]
PIPE = ["--mesh", "pp=2,dp=1,ep=4", "--strategy", "dp,ep", "--microbatches", "4", "--schedule", "interleaved",
        "--virtual-stages", "2"]


def _chunk(f: float, b: float, af: float, ab: float) -> ChunkOps:
    """A one-layer chunk: ``f`` / ``b`` seconds, ``af`` / ``ab`` of them the all-to-alls, each half
    dispatch, half combine; the rest the attention and the experts' input gradients."""
    return ChunkOps((LayerOps(attn_f=f - af, dispatch_f=af / 2, combine_f=af / 2, combine_b=ab / 2,
                              dispatch_b=ab / 2, mlp_b=b - ab),))


def test_run_schedule_merges_the_steady_state_by_hand() -> None:
    """p=2, v=2, m=4: forwards of 3 (1 of all-to-all), backwards of 5 (3 of all-to-all), one layer a
    chunk (:func:`_chunk`). A merged step by the source's nodes: comm combine_b 0-1.5 beside comp
    attn_f 0-2; dispatch_f 2-2.5; mlp_b 2-4; dispatch_b 4-5.5; combine_f 5.5-6: 6 instead of 8. A
    lone backward: combine 0-1.5, mlp 1.5-3.5, dispatch 3.5-5: 5 (nothing to hide it under). Device 0
    warms up with (2-1)*2 + 2 + 1 = 5 forwards (Megatron's count plus one) and merges 3 pairs,
    device 1 with 3 and 5 pairs."""
    p, v, m = 2, 2, 4
    fwd, bwd, a2a = [3.0] * 4, [5.0] * 4, [_chunk(3.0, 5.0, 1.0, 3.0)] * 4
    run = run_schedule("interleaved", p, v, m, fwd, bwd, a2a=a2a)
    assert [interleaved_warmup(p, v, m, r, 1) for r in range(p)] == [5, 3]
    assert run.hidden_s == [3 * 2.0, 5 * 2.0]
    assert run.busy_s == [m * v * 8.0 - 6.0, m * v * 8.0 - 10.0]
    for r, pairs in ((0, 3), (1, 5)):
        mine = sorted((u for u in run.units if u[0] == r), key=lambda u: u[4])
        spans = [(u[1], round(u[5] - u[4], 12)) for u in mine]
        # a merged pair is its forward's 3/8 and its backward's 5/8 of the 6 it takes, back to back
        assert spans.count(("F", 6 * 3 / 8)) == pairs and spans.count(("B", 6 * 5 / 8)) == pairs
        assert spans.count(("F", 3.0)) == m * v - pairs and spans.count(("B", 5.0)) == m * v - pairs
    plain = run_schedule("interleaved", p, v, m, fwd, bwd)
    assert plain.hidden_s == [] and plain.busy_s == [m * v * 8.0] * 2
    assert run.pipeline_s < plain.pipeline_s


def test_merged_pairs_wait_for_both_inputs_and_never_deadlock() -> None:
    """Every interleaved shape runs to the end with the extra warm-up forward; a merged step
    starts only once its forward's and its backward's inputs have arrived (after their producers
    started and the send)."""
    for p in (2, 3, 4):
        for v in (2, 3):
            for m in (p, 2 * p, 3 * p):
                n = p * v
                fwd = [1.0 + 0.1 * k for k in range(n)]
                bwd = [2.0 + 0.1 * k for k in range(n)]
                run = run_schedule("interleaved", p, v, m, fwd, bwd, [0.05] * n, [0.05] * n,
                                   a2a=[_chunk(f, b, 0.4, 0.7) for f, b in zip(fwd, bwd)])
                assert len(run.units) == 2 * n * m
                ends = {(kind, k, i): (s, e) for _r, kind, k, i, s, e in run.units}
                for (kind, k, i), (s, _e) in ends.items():
                    if kind == "F" and k > 0:
                        assert s >= ends[("F", k - 1, i)][0] + 0.05 - 1e-12
                    if kind == "B" and k < n - 1:
                        assert s >= ends[("B", k + 1, i)][0] + 0.05 - 1e-12


def test_one_more_chunk_in_flight() -> None:
    """Megatron's extra warm-up forward holds one more model chunk of activations."""
    assert [in_flight("interleaved", 4, 2, 8, r, 1) for r in range(4)] == [
        (in_flight("interleaved", 4, 2, 8, r) * 2 + 1) / 2 for r in range(4)]
    # the last of 4 devices, 2 chunks: (v - 1) p = 4 warm-up forwards, 5 with the overlap
    assert [u[0] for u in schedule_order("interleaved", 4, 2, 8, 3)[:6]] == ["F"] * 5 + ["B"]
    assert [u[0] for u in schedule_order("interleaved", 4, 2, 8, 3, 1)[:7]] == ["F"] * 6 + ["B"]
    assert in_flight("interleaved", 2, 2, 1, 0, 1) == 1.0  # at most every chunk of every microbatch


def _plan(*extra: str) -> dict[str, Any]:
    rc, out = cli_stdout(*MOE, *PIPE, "--json", *extra)
    assert rc == 0
    return dict(json.loads(out))


def _chunks(stages: list[dict[str, Any]]) -> list[ChunkOps]:
    """Each stage's merged-schedule nodes as the plan's JSON gives them."""
    return [ChunkOps(tuple(LayerOps(**x) for x in st["chunk"]["layers"]),
                     **{k: v for k, v in st["chunk"].items() if k != "layers"}) for st in stages]


def _hidden(pipe: dict[str, Any], share: float) -> list[float]:
    """Each device's hidden seconds by hand: over its steady-state pairs (after Megatron's warm-up
    count plus one) F + B less the merged chunk step, over its cool-down backwards B less the lone
    backward's step (:func:`spmdkit.planner.chunk_plan.chunk_run`)."""
    p, v, m, stages = pipe["pp"], pipe["virtual_stages"], pipe["microbatches"], pipe["stages"]
    chunks = _chunks(stages)
    out = []
    for r in range(p):
        order = schedule_order("interleaved", p, v, m, r, 1)
        warm = interleaved_warmup(p, v, m, r, 1)
        hid = 0.0
        for (_f, kf, _i), (_b, kb, _j) in zip(order[warm:len(order) - warm:2], order[warm + 1:len(order) - warm:2]):
            f, b = stages[kf]["forward_s"], stages[kb]["backward_s"] + stages[kb]["recompute_s"]
            hid += f + b - chunk_run(chunks[kf], chunks[kb], share).seconds
        for _b, kb, _j in order[len(order) - warm:]:
            b = stages[kb]["backward_s"] + stages[kb]["recompute_s"]
            hid += b - chunk_run(None, chunks[kb], share).seconds
        out.append(hid)
    return out


@pytest.mark.parametrize("cost", [[], ["--cost", "ep=20us/2GB"], ["--cost", "ep=20us/9GB"]])
def test_the_plan_hides_what_the_chunk_plan_hides(cost: list[str]) -> None:
    """On a 4-layer Mixtral over pp=2 x 2 virtual stages, ep=4: each stage's all-to-all seconds
    are its layers' dispatch and combine reshards of the plan (their own times), and its nodes
    (the JSON's ``chunk``) add up to its forward and its backward (with the recomputation) and to
    those all-to-alls; each device's hidden seconds are its merged and lone steps' by the chunk
    plan (:func:`_hidden`), all the all-to-alls at most."""
    d = _plan("--ep-comm-overlap", *cost)
    pipe = d["pipeline"]
    p = pipe["pp"]
    stages = pipe["stages"]
    chunks = _chunks(stages)
    for k, st in enumerate(stages):  # one layer per virtual stage: layer k
        a2a = {"forward": 0.0, "backward": 0.0}
        for r in d["reshards"]:
            if r["layer"] == f"layer {k}" and not r["shared"]:
                a2a[r["phase"]] += sum(s["time_s"] for s in r["steps"] if s["kind"] == "all_to_all")
        assert a2a["forward"] > 0 and a2a["backward"] > 0
        assert st["a2a_forward_s"] == pytest.approx(a2a["forward"], rel=1e-12)
        assert st["a2a_backward_s"] == pytest.approx(a2a["backward"], rel=1e-12)
        (layer,) = chunks[k].layers
        assert layer.dispatch_f + layer.combine_f == pytest.approx(a2a["forward"], rel=1e-12)
        assert layer.dispatch_b + layer.combine_b == pytest.approx(a2a["backward"], rel=1e-12)
        assert chunks[k].forward_s == pytest.approx(st["forward_s"], rel=1e-12)
        assert chunks[k].backward_s == pytest.approx(st["backward_s"] + st["recompute_s"], rel=1e-12)
    got = pipe["ep_comm_overlap"]["hidden_s"]
    # NCCL's all-to-all (the alltoall dispatcher) over ep = 4 in one H100 node: its kernel takes
    # all 32 p2p channels, one SM each (spmdkit.cost.nccl_p2p); 1 under a plain --cost model
    share = pipe["ep_comm_overlap"]["compute_share"]
    assert share == (pytest.approx((132 - 32) / 132, rel=1e-12) if not cost else 1.0)
    assert got == pytest.approx(_hidden(pipe, share), rel=1e-9)
    assert all(g > 0 for g in got)
    plain = _plan(*cost)["pipeline"]
    assert "ep_comm_overlap" not in plain
    assert [plain["busy_s"][r] - pipe["busy_s"][r] for r in range(p)] == pytest.approx(got, rel=1e-9)
    assert pipe["step_overlap_s"] < plain["step_overlap_s"]
    # one more model chunk of activations in flight on every device
    v, m = pipe["virtual_stages"], pipe["microbatches"]
    flights = [(dv["in_flight_microbatches"], dq["in_flight_microbatches"])
               for dv, dq in zip(pipe["devices"], plain["devices"])]
    assert flights == [(min(q * v + 1, m * v) / v, q) for _o, q in flights]
    assert pipe["devices"][0]["memory"]["activation_peak"] > plain["devices"][0]["memory"]["activation_peak"]


def test_the_report_names_the_hidden_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*MOE, *PIPE, "--ep-comm-overlap"]) == 0
    out = capsys.readouterr().out
    assert "ep all-to-all overlap (--ep-comm-overlap): the merged forwards and backwards (and the lone backwards' " \
        "weight gradients) hide" in out


@pytest.mark.parametrize("args, message", [
    (["--mesh", "pp=2,dp=1,ep=4", "--strategy", "dp,ep", "--microbatches", "4", "--schedule", "1f1b"],
     "--ep-comm-overlap: merges the steady-state forward and backward of the interleaved schedule "
     "(Megatron-Core requires virtual pipeline stages); --schedule 1f1b has none to merge"),
    (["--mesh", "pp=2,dp=4", "--strategy", "dp", "--microbatches", "4", "--schedule", "interleaved",
      "--virtual-stages", "2"],
     "--ep-comm-overlap: overlaps the experts' all-to-alls over ep; the experts are not expert-parallel"),
    ([*PIPE, "--recompute", "full"], "--ep-comm-overlap: Megatron-Core refuses --recompute full"),
    ([*PIPE, "--recompute", "microbatch"], "--ep-comm-overlap: Megatron-Core refuses --recompute microbatch"),
    ([*PIPE, "--recompute", "selective:moe"], "--ep-comm-overlap: Megatron-Core refuses the recomputed module moe"),
    ([*PIPE, "--framework", "torchtitan"], "--framework torchtitan runs torch's pipelining schedules"),
])
def test_refusals(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*MOE, *args, "--ep-comm-overlap"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_refusals_without_experts_and_under_the_search(capsys: pytest.CaptureFixture[str]) -> None:
    dense = ["plan", "--model", "llama-7b", "--layers", "4", "--seq", "1024", "--batch", "16", "--microbatches", "4",
             "--mesh", "pp=2,dp=4", "--strategy", "dp", "--schedule", "interleaved", "--virtual-stages", "2"]
    assert main([*dense, "--ep-comm-overlap"]) == 2
    assert "--ep-comm-overlap: overlaps the experts' all-to-alls; the model has no MoE layer" in capsys.readouterr().err
    assert main(["plan", "--devices", "8", "--model", "mixtral-8x7b", "--ep-comm-overlap"]) == 2
    assert "--ep-comm-overlap: applies to one plan" in capsys.readouterr().err


def test_deepeps_sms_slow_the_work_beside_its_all_to_alls() -> None:
    """Under DeepEP the merged step's work beside an all-to-all runs on the SMs DeepEP's kernels
    leave (Megatron-Core's moe_deepep_num_sms, 20 of an H100's 132): each device's hidden seconds
    are the chunk plan's at (132 - 20) / 132 (:func:`_hidden`), fewer than at full speed."""
    d = _plan("--ep-comm-overlap", "--moe-dispatcher", "deepep", "--cost", "ep=20us/12GB")
    pipe = d["pipeline"]
    share = pipe["ep_comm_overlap"]["compute_share"]
    assert share == pytest.approx(112 / 132, rel=1e-12)
    assert _plan("--ep-comm-overlap", "--cost", "ep=20us/12GB")["pipeline"]["ep_comm_overlap"]["compute_share"] == 1.0
    got = pipe["ep_comm_overlap"]["hidden_s"]
    assert got == pytest.approx(_hidden(pipe, share), rel=1e-9)
    assert all(0 < g < w for g, w in zip(got, _hidden(pipe, 1.0)))
