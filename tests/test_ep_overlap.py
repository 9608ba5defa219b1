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
from spmdkit.planner.schedules import in_flight, interleaved_warmup, run_schedule, schedule_order

MOE = ["plan", "--model", "mixtral-8x7b", "--layers", "4", "--seq", "1024", "--batch", "16", "--device", "h100"]
PIPE = ["--mesh", "pp=2,dp=1,ep=4", "--strategy", "dp,ep", "--microbatches", "4", "--schedule", "interleaved",
        "--virtual-stages", "2"]


def _merged(af: float, ab: float, f: float, b: float) -> float:
    """A merged step: the forward's all-to-alls under the backward's other work and back."""
    return max(af, b - ab) + max(ab, f - af)


def test_run_schedule_merges_the_steady_state_by_hand() -> None:
    """p=2, v=2, m=4: forwards of 3 (1 of all-to-all), backwards of 5 (3 of all-to-all): a merged
    step takes max(1, 5 - 3) + max(3, 3 - 1) = 5 instead of 8 (the backward's all-to-alls exceed the
    forward's other work by 1: hiding them whole would give 4). Device 0 warms up with (2-1)*2 + 2 + 1 = 5
    forwards (Megatron's count plus one) and merges 3 pairs, device 1 with 3 and 5 pairs."""
    p, v, m = 2, 2, 4
    fwd, bwd, a2a = [3.0] * 4, [5.0] * 4, [(1.0, 3.0)] * 4
    run = run_schedule("interleaved", p, v, m, fwd, bwd, a2a=a2a)
    assert [interleaved_warmup(p, v, m, r, 1) for r in range(p)] == [5, 3]
    assert run.hidden_s == [3 * 3.0, 5 * 3.0]
    assert run.busy_s == [m * v * 8.0 - 9.0, m * v * 8.0 - 15.0]
    for r, pairs in ((0, 3), (1, 5)):
        mine = sorted((u for u in run.units if u[0] == r), key=lambda u: u[4])
        spans = [(u[1], round(u[5] - u[4], 12)) for u in mine]
        # a merged pair is its forward's 3/8 and its backward's 5/8 of the 5 it takes, back to back
        assert spans.count(("F", 5 * 3 / 8)) == pairs and spans.count(("B", 5 * 5 / 8)) == pairs
        assert spans.count(("F", 3.0)) == m * v - pairs and spans.count(("B", 5.0)) == m * v - pairs
    plain = run_schedule("interleaved", p, v, m, fwd, bwd)
    assert plain.hidden_s == [] and plain.busy_s == [m * v * 8.0] * 2
    assert run.pipeline_s < plain.pipeline_s


def test_merged_pairs_wait_for_both_inputs_and_never_deadlock() -> None:
    """Every interleaved shape runs to the end with the extra warm-up forward; a merged step
    starts only once its forward's and its backward's inputs have arrived, and both its outputs
    leave at its end."""
    for p in (2, 3, 4):
        for v in (2, 3):
            for m in (p, 2 * p, 3 * p):
                n = p * v
                fwd = [1.0 + 0.1 * k for k in range(n)]
                bwd = [2.0 + 0.1 * k for k in range(n)]
                run = run_schedule("interleaved", p, v, m, fwd, bwd, [0.05] * n, [0.05] * n,
                                   a2a=[(0.4, 0.7)] * n)
                assert len(run.units) == 2 * n * m
                ends = {(kind, k, i): (s, e) for _r, kind, k, i, s, e in run.units}
                for (kind, k, i), (s, _e) in ends.items():
                    if kind == "F" and k > 0:
                        assert s >= ends[("F", k - 1, i)][1] + 0.05 - 1e-12
                    if kind == "B" and k < n - 1:
                        assert s >= ends[("B", k + 1, i)][1] + 0.05 - 1e-12


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


@pytest.mark.parametrize("cost, bounds", [([], (False, False)), (["--cost", "ep=20us/2GB"], (True, True)),
                                          (["--cost", "ep=20us/9GB"], (False, True))])
def test_the_plan_hides_exactly_the_partner_bounded_all_to_alls(cost: list[str], bounds: tuple[bool, bool]) -> None:
    """On a 4-layer Mixtral over pp=2 x 2 virtual stages, ep=4: each stage's all-to-all seconds
    are its layers' dispatch and combine reshards of the plan (their own times); each device's
    hidden seconds are, over its steady-state pairs (after Megatron's warm-up count plus one),
    F + B - (max(a_F, B - a_B) + max(a_B, F - a_F)): the H100's links hide every all-to-all, a
    2 GB/s ep link hides them only up to the partner's work, 9 GB/s one direction only."""
    d = _plan("--ep-comm-overlap", *cost)
    pipe = d["pipeline"]
    p, v, m = pipe["pp"], pipe["virtual_stages"], pipe["microbatches"]
    stages = pipe["stages"]
    for k, st in enumerate(stages):  # one layer per virtual stage: layer k
        a2a = {"forward": 0.0, "backward": 0.0}
        for r in d["reshards"]:
            if r["layer"] == f"layer {k}" and not r["shared"]:
                a2a[r["phase"]] += sum(s["time_s"] for s in r["steps"] if s["kind"] == "all_to_all")
        assert a2a["forward"] > 0 and a2a["backward"] > 0
        assert st["a2a_forward_s"] == pytest.approx(a2a["forward"], rel=1e-12)
        assert st["a2a_backward_s"] == pytest.approx(a2a["backward"], rel=1e-12)
    want, full = [], []
    for r in range(p):
        order = schedule_order("interleaved", p, v, m, r, 1)
        warm = interleaved_warmup(p, v, m, r, 1)
        hid = every = 0.0
        for (_f, kf, _i), (_b, kb, _j) in zip(order[warm:len(order) - warm:2], order[warm + 1:len(order) - warm:2]):
            f, b = stages[kf]["forward_s"], stages[kb]["backward_s"] + stages[kb]["recompute_s"]
            af, ab = stages[kf]["a2a_forward_s"], stages[kb]["a2a_backward_s"]
            hid += f + b - _merged(af, ab, f, b)
            every += af + ab
        want.append(hid)
        full.append(every)
    got = pipe["ep_comm_overlap"]["hidden_s"]
    assert got == pytest.approx(want, rel=1e-9)
    # (the forward's all-to-alls longer than the backward's other work, and the other way round)
    assert {(st["a2a_forward_s"] > st["backward_s"] - st["a2a_backward_s"],
             st["a2a_backward_s"] > st["forward_s"] - st["a2a_forward_s"]) for st in stages} == {bounds}
    if not cost:
        assert got == pytest.approx(full, rel=1e-9)
    else:
        assert all(0 < g < f for g, f in zip(got, full))
    plain = _plan(*cost)["pipeline"]
    assert "ep_comm_overlap" not in plain
    assert [plain["busy_s"][r] - pipe["busy_s"][r] for r in range(p)] == pytest.approx(got, rel=1e-9)
    assert pipe["step_overlap_s"] < plain["step_overlap_s"]
    # one more model chunk of activations in flight on every device
    flights = [(dv["in_flight_microbatches"], dq["in_flight_microbatches"])
               for dv, dq in zip(pipe["devices"], plain["devices"])]
    assert flights == [(min(q * v + 1, m * v) / v, q) for _o, q in flights]
    assert pipe["devices"][0]["memory"]["activation_peak"] > plain["devices"][0]["memory"]["activation_peak"]


def test_the_report_names_the_hidden_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*MOE, *PIPE, "--ep-comm-overlap"]) == 0
    out = capsys.readouterr().out
    assert "ep all-to-all overlap (--ep-comm-overlap): the steady state's merged forwards and backwards hide" in out


@pytest.mark.parametrize("args, message", [
    (["--mesh", "dp=1,ep=4", "--strategy", "dp,ep"], "--ep-comm-overlap: merges the forward and backward of an "
     "interleaved pipeline's steady state; this plan has no pipeline"),
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
    assert "--ep-comm-overlap: applies to one pipeline plan" in capsys.readouterr().err


def test_deepeps_sms_slow_the_work_beside_its_all_to_alls() -> None:
    """Under DeepEP the merged step's work beside an all-to-all runs on the SMs DeepEP's kernels
    leave (Megatron-Core's moe_deepep_num_sms, 20 of an H100's 132): by hand, 1 s of all-to-all
    beside 2 s of work at 0.8 of its speed ends at 2.2 s, beside 0.5 s at 1 s (the all-to-all's
    end); in a plan, each device's hidden seconds are F + B less the two halves at
    (132 - 20) / 132, and fewer than NCCL's all-to-all would hide with the same stage times."""
    from spmdkit.planner.schedules import merged_part

    assert merged_part(1.0, 2.0, 0.8) == pytest.approx(2.2) and merged_part(1.0, 0.5, 0.8) == 1.0
    assert merged_part(1.0, 2.0) == 2.0
    d = _plan("--ep-comm-overlap", "--moe-dispatcher", "deepep", "--cost", "ep=20us/12GB")
    pipe = d["pipeline"]
    share = pipe["ep_comm_overlap"]["compute_share"]
    assert share == pytest.approx(112 / 132, rel=1e-12)
    assert _plan("--ep-comm-overlap", "--cost", "ep=20us/12GB")["pipeline"]["ep_comm_overlap"]["compute_share"] == 1.0
    p, v, m, stages = pipe["pp"], pipe["virtual_stages"], pipe["microbatches"], pipe["stages"]
    for r in range(p):
        order, warm = schedule_order("interleaved", p, v, m, r, 1), interleaved_warmup(p, v, m, r, 1)
        hid = whole = 0.0
        for (_f, kf, _i), (_b, kb, _j) in zip(order[warm:len(order) - warm:2], order[warm + 1:len(order) - warm:2]):
            f, b = stages[kf]["forward_s"], stages[kb]["backward_s"] + stages[kb]["recompute_s"]
            af, ab = stages[kf]["a2a_forward_s"], stages[kb]["a2a_backward_s"]
            hid += f + b - merged_part(af, b - ab, share) - merged_part(ab, f - af, share)
            whole += f + b - _merged(af, ab, f, b)
        assert pipe["ep_comm_overlap"]["hidden_s"][r] == pytest.approx(hid, rel=1e-9)
        assert 0 < hid < whole
