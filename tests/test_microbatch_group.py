"""``--microbatch-group N``: Megatron-Core's microbatch group of the interleaved schedule
(``microbatch_group_size_per_vp_stage``; megatron/core/pipeline_parallel/schedules.py at
NVIDIA/Megatron-LM d98e8a6): the order, the warm-up and in-flight counts, the refusals, and a
plan where a smaller group holds fewer microbatches and leaves a larger bubble."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from spmdkit.cli import main
from spmdkit.core.errors import ProgramError
from spmdkit.cost.devices import preset_device
from spmdkit.planner.bubble import bubble_hint
from spmdkit.planner.chunk_plan import ChunkOps, LayerOps
from spmdkit.planner.pipeline import estimate_pipeline
from spmdkit.planner.pipeline_plan import plan_pipeline
from spmdkit.planner.pipeline_split import parse_spec
from spmdkit.planner.schedules import (
    held_counts,
    in_flight,
    interleaved_warmup,
    run_schedule,
    schedule_order,
    schedule_table,
)


def test_schedule_table_is_megatrons() -> None:
    # get_schedule_table's own example (PP2 N3 M5 VP2): microbatch 0 1 2 0 1 2 3 4 3 4, chunk 0 0 0 1 1 1 0 0 1 1
    assert schedule_table(5, 2, 3) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]
    # ModelParallelConfig's docstring, PP=2 VP=2 N=2 M=4: rank 0 | 0 1 0 1 2 3 2 3
    assert [i for i, _c in schedule_table(4, 2, 2)] == [0, 1, 0, 1, 2, 3, 2, 3]
    # N = M: breadth-first, every microbatch through chunk 0, then chunk 1
    assert schedule_table(3, 2, 3) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]


def test_order_is_megatrons_for_a_group_of_three() -> None:
    """p=2, v=2, m=5, N=3, rank 0: (p - r - 1) 2 + (v - 1) N = 5 warm-up forwards, then one
    forward and one backward, then the backwards; convert_schedule_table_to_order's example
    for 5 warm-ups is "1 1 1 2 2 2 -2 1 -2 1 -2 2 -1 2 -1 -1 -2 -2 -1 -1" (a forward of chunk c is
    c + 1; a backward ``table chunk - v``, the backward of chunk ``v - 1 - table chunk`` = c: -(c + 1))."""
    order = schedule_order("interleaved", 2, 2, 5, 0, group=3)
    # rank 0 holds virtual stages 0 (chunk 0) and 2 (chunk 1)
    assert order == [("F", 0, 0), ("F", 0, 1), ("F", 0, 2), ("F", 2, 0), ("F", 2, 1),
                     ("F", 2, 2), ("B", 2, 0), ("F", 0, 3), ("B", 2, 1), ("F", 0, 4), ("B", 2, 2),
                     ("F", 2, 3), ("B", 0, 0), ("F", 2, 4), ("B", 0, 1),
                     ("B", 0, 2), ("B", 2, 3), ("B", 2, 4), ("B", 0, 3), ("B", 0, 4)]
    signed = [(k // 2 + 1) * (1 if kind == "F" else -1) for kind, k, _i in order]
    assert " ".join(map(str, signed)) == "1 1 1 2 2 2 -2 1 -2 1 -2 2 -1 2 -1 -1 -2 -2 -1 -1"


def test_default_group_is_the_depth_first_order() -> None:
    for p, v, m in [(2, 2, 4), (4, 2, 8), (4, 3, 12)]:
        for r in range(p):
            assert schedule_order("interleaved", p, v, m, r) == schedule_order("interleaved", p, v, m, r, group=p)


@pytest.mark.parametrize("group,r,warm,flight", [(4, 0, 10, 5.5), (8, 0, 14, 7.5), (8, 3, 8, 4.5), (6, 1, 10, 5.5)])
def test_warmup_and_in_flight(group: int, r: int, warm: int, flight: float) -> None:
    """p=4, v=2, m=8 (m=12 for N=6): (4 - r - 1) 2 + (2 - 1) N warm-up forwards, one more in flight."""
    m = 12 if group == 6 else 8
    assert interleaved_warmup(4, 2, m, r, group=group) == warm
    assert in_flight("interleaved", 4, 2, m, r, group=group) == flight
    order = schedule_order("interleaved", 4, 2, m, r, group=group)
    assert [k for k, _s, _i in order[:warm + 2]] == ["F"] * (warm + 1) + ["B"]
    assert held_counts(order)[0] == flight * 2


def test_group_with_the_all_to_all_overlap() -> None:
    """--ep-comm-overlap: get_pp_rank_microbatches adds its one warm-up forward to the group's count
    ((4 - 0 - 1) 2 + (2 - 1) 8 + 1 = 15 on rank 0 of p=4, v=2, m=16, N=8), and the merged steady
    state pairs the 32 - 15 = 17 forwards after it with the first 17 backwards."""
    assert interleaved_warmup(4, 2, 16, 0, 1, group=8) == 15
    assert in_flight("interleaved", 4, 2, 16, 0, 1, group=8) == 8.0
    n = 8
    # one layer a chunk: forward 0.75 of attention, 0.125 + 0.125 of dispatch and combine; backward
    # 0.25 + 0.25 of combine and dispatch, 1.5 of the experts' gradients
    chunk = ChunkOps((LayerOps(attn_f=0.75, dispatch_f=0.125, combine_f=0.125, combine_b=0.25, dispatch_b=0.25,
                               mlp_b=1.5),))
    run = run_schedule("interleaved", 4, 2, 16, [1.0] * n, [2.0] * n, a2a=[chunk] * n, group=8)
    # each merged step (Megatron's nodes): combine_b beside attn_f 0-0.75, mlp_b 0.75-2.25 (dispatch_f
    # beside it), dispatch_b 2.25-2.5, combine_f 2.5-2.625: 2.625 of 3, hiding 0.375; a lone
    # backward has nothing to hide its all-to-alls under
    assert run.hidden_s[0] == pytest.approx(17 * 0.375)


def test_larger_group_hides_the_sends() -> None:
    """Equal stages, free sends: the bubble is (p-1)/(v m) whatever N; with sends, a group of N > p
    lets the first rank run N - p more forwards before it waits on the last rank's output
    (Megatron-Core sizes the first rank's receive buffers N - p + 1), so the sends leave less
    bubble."""
    p, v, m = 4, 2, 16
    n = p * v
    f, b = [1.0] * n, [2.0] * n
    free = {g: run_schedule("interleaved", p, v, m, f, b, group=g).bubble_fraction for g in (4, 8, 16)}
    assert free == pytest.approx({g: (p - 1) / (v * m) for g in free}, rel=1e-12)
    sends = [0.3] * n
    slow = {g: run_schedule("interleaved", p, v, m, f, b, sends, sends, group=g).bubble_s for g in (4, 8)}
    assert slow[4] > slow[8] > run_schedule("interleaved", p, v, m, f, b, group=8).bubble_s


@pytest.mark.parametrize("args,message", [
    ({"microbatches": 8, "schedule": "interleaved", "group": 2},
     "--microbatch-group 2: Megatron-Core's interleaved schedule needs a group from pp=4 to --microbatches 8"),
    ({"microbatches": 8, "schedule": "interleaved", "group": 9},
     "--microbatch-group 9: Megatron-Core's interleaved schedule needs a group from pp=4 to --microbatches 8"),
    ({"microbatches": 10, "schedule": "interleaved", "group": 8},
     "--microbatch-group 8: --microbatches 10 leaves a last group of 2, fewer than pp=4"),
    ({"microbatches": 8, "schedule": "1f1b", "group": 4},
     "--microbatch-group 4: groups the microbatches of the interleaved schedule's model chunks; --schedule 1f1b"),
    ({"microbatches": 8, "group": 8}, "--schedule 1f1b has none (give --schedule interleaved)"),
    ({"microbatches": 8, "schedule": "interleaved", "group": "x"}, "--microbatch-group 'x': expected an integer"),
])
def test_refusals(args: dict[str, object], message: str) -> None:
    with pytest.raises(ProgramError, match=re.escape(message)):
        parse_spec(4, **args)


def test_accepted_groups() -> None:
    # a last group of at least p: m need not be a multiple of p (Megatron-Core's check is on m mod N)
    assert parse_spec(4, 10, "interleaved", group=6).group == 6
    assert parse_spec(4, 8, "interleaved", group=8).group == 8
    assert parse_spec(4, 8, "interleaved", group=4).group is None  # the default, pp
    with pytest.raises(ProgramError, match="--microbatches 10 is not a multiple of pp=4"):
        parse_spec(4, 10, "interleaved")


def _tiny() -> tuple:
    argv = {"microbatches": 8, "schedule": "interleaved", "virtual": 2}
    return plan_pipeline("tiny-llama", "pp=4,tp=2", "megatron", argv, {"layers": 8, "batch": 8})


def test_smaller_group_holds_less_and_waits_more() -> None:
    """tiny-llama, pp=4 x 2 chunks, 8 microbatches, sends of 0.1 ms (a stage's compute is 0.16 ms):
    N=4 (the default) against N=8. Rank 0 holds (3 * 2 + N + 1) / 2 stages' microbatches:
    5.5 against 7.5, its activations round((flight - 1/2) * stash) over the working peak; the
    smaller group's bubble is the larger."""
    _m, plan, spec, counts, _ = _tiny()
    dev = preset_device("a100-80gb")
    est = {g: estimate_pipeline(plan, replace(spec, group=g), counts, dev, (1e-4, 1 / 10e9), 8 * 16, 8)
           for g in (None, 8)}
    assert est[None].in_flight == [5.5, 4.5, 3.5, 2.5]
    assert est[8].in_flight == [7.5, 6.5, 5.5, 4.5]
    mine = [est[8].stages[0], est[8].stages[4]]
    stash = sum(c.stash_bytes for c in mine)
    work = max(c.working_peak for c in mine)
    for g, flight in ((None, 5.5), (8, 7.5)):
        assert est[g].memory[0].activation_peak == work + round((flight - 0.5) * stash)
    assert max(m.device_total for m in est[None].memory) < max(m.device_total for m in est[8].memory)
    assert est[None].run is not None and est[8].run is not None
    assert est[None].run.bubble_s > est[8].run.bubble_s
    assert est[8].to_json()["microbatch_group"] == 8 and "microbatch_group" not in est[None].to_json()
    # the bubble hint tries counts N apart (each leaves the plan's last group): 24 for N=8, 28 for N=4
    assert [getattr(bubble_hint(plan, est[g], 0.1), "more", None) for g in (8, None)] == [24, 28]


def test_torch_pipelining_refuses_the_group() -> None:
    _m, plan, spec, counts, _ = _tiny()
    plan = replace(plan, runtime=replace(plan.runtime, framework="torchtitan"))
    with pytest.raises(ProgramError, match=re.escape("--microbatch-group 8: Megatron-Core's interleaved schedule; "
                                                     "--framework torchtitan pipelines with torch.distributed.pipelining")):
        estimate_pipeline(plan, replace(spec, group=8), counts)


def _plan_json(extra: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    argv = ["plan", "--model", "tiny-llama", "--layers", "8", "--batch", "8", "--mesh", "pp=4,tp=2",
            "--microbatches", "8", "--schedule", "interleaved", "--device", "a100-80gb", "--json", *extra]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    out.pop("plan_seconds", None)
    return out


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    default = _plan_json([], capsys)
    assert _plan_json(["--microbatch-group", "4"], capsys) == default  # N = pp: Megatron-Core's default
    wide = _plan_json(["--microbatch-group", "8"], capsys)["pipeline"]
    assert wide["microbatch_group"] == 8
    assert [d["in_flight_microbatches"] for d in wide["devices"]] == [7.5, 6.5, 5.5, 4.5]
    auto = _plan_json(["--microbatch-group", "8", "--stages", "auto"], capsys)["pipeline"]
    assert auto["microbatch_group"] == 8 and auto["stages_auto"]["chosen"]
    assert main(["plan", "--model", "tiny-llama", "--devices", "8", "--microbatch-group", "8"]) == 2
    assert "--microbatch-group: does not apply with --devices" in capsys.readouterr().err
