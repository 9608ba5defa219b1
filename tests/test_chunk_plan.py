"""Megatron-Core's merged forward and backward of a model chunk under ``--ep-comm-overlap``, node
by node on its two streams (spmdkit.planner.chunk_plan: ``TransformerLayerSchedulePlan.run`` at
NVIDIA/Megatron-LM d7bf5aaaa8), and the stage's ops cut into those nodes (spmdkit.planner.chunk_ops)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spmdkit.planner.chunk_plan import COMM, COMP, ChunkOps, LayerOps, chunk_nodes, chunk_run, simulate
from spmdkit.planner.schedules import interleaved_warmup, run_schedule

#: one MoE layer (ms): forward attention 2, dispatch 1, experts 3, combine 1; backward combine 3,
#: experts' input gradients 4 and weight gradients 2, dispatch 1, router to attention 3, its
#: weight gradients 1
LAYER = LayerOps(attn_f=2, dispatch_f=1, mlp_f=3, combine_f=1, combine_b=3, mlp_b=4, mlp_dw=2, dispatch_b=1,
                 attn_b=3, attn_dw=1)


def test_a_merged_layer_by_hand() -> None:
    """The source's pairing: comm combine_b 0-3 beside comp attn_f 0-2; comp mlp_b waits for the
    combine: 3-7; comm dispatch_f (after attn_f, after combine_b on its stream) 3-4; comp mlp_dw 7-9;
    comm dispatch_b waits for mlp_b only (the weight gradients record no event): 7-8; comp mlp_f
    9-12; comm combine_f 12-13; comp post_attn/attn backward (after mlp_f on its stream, after
    dispatch_b in its chain) 12-15; the deferred attention weight gradients 15-16. 16 in all, against
    7 + 14 = 21 one after the other. The former bound, max(a_F, B - a_B) + max(a_B, F - a_F) =
    max(2, 10) + max(4, 5) = 15, hid the backward's combine under the forward's work whole; the
    source runs it beside the attention alone (2 of it), so 1 more is exposed."""
    chunk = ChunkOps((LAYER,))
    got = chunk_run(chunk, chunk)
    assert (got.seconds, got.forward_end, got.backward_end) == (16.0, 13.0, 15.0)
    assert chunk.forward_s == 7.0 and chunk.backward_s == 14.0
    # with the backward's combine as short as the attention beside it, nothing waits: 15
    short = ChunkOps((replace(LAYER, combine_b=1.0),))
    assert chunk_run(short, short).seconds == 15.0


def test_lone_steps() -> None:
    """A warm-up forward alone: its nodes one after the other (7). A cool-down backward alone: its
    dispatch's all-to-all (after its experts' input gradients) beside their weight gradients:
    combine 0-3, mlp 3-7, mlp_dw 7-9, dispatch 7-8, attention 9-12, its dw 12-13: 13 of 14. Two
    layers: the second's combine (waiting on the first's attention backward, not its dw) also beside
    the first's attention weight gradients (1 of its 3): 13 + 13 - 1 = 25 of 28."""
    chunk = ChunkOps((LAYER,))
    assert chunk_run(chunk, None).seconds == 7.0
    assert chunk_run(None, chunk).seconds == 13.0
    two = ChunkOps((LAYER, LAYER))
    assert chunk_run(two, None).seconds == 14.0
    assert chunk_run(None, two).seconds == 25.0


def test_chunk_order_and_unpaired_layers() -> None:
    """The forward's embedding first, then the backward's head, the pairs (forward layer i with the
    backward's layer L - 1 - i), the longer chunk's layers alone, the first layer's attention dw,
    the forward's head and the backward's embedding last. A dense layer has no comm-stream node."""
    dense = LayerOps(attn_f=1.0, mlp_f=2.0, mlp_b=3.0, attn_b=1.0, mlp_dw=0.5, attn_dw=0.25, moe=False)
    f = ChunkOps((dense,), pre_f=0.5, post_f=0.0)
    b = ChunkOps((LAYER, LAYER), post_b=0.75, pre_b=0.0)
    nodes, fc, bc = chunk_nodes(f, b)
    assert nodes[0] == (COMP, "F", 0.5, False) and nodes[1] == (COMP, "B", 0.75, False)
    assert [nd for nd in nodes if nd[1] == "F"] == [(COMP, "F", 0.5, False), (COMP, "F", 3.0, False),
                                                    (COMP, "F", 0.0, False)]
    assert (fc, bc) == (len(nodes) - 2, len(nodes) - 1)
    # the attention weight gradients of the backward's first layer run after both layers
    assert nodes[-3] == (COMP, "", 1.0, False)
    got = chunk_run(f, b)
    assert got.seconds <= f.forward_s + b.backward_s


def test_deepep_slows_the_work_beside_an_all_to_all() -> None:
    """1 s of all-to-all beside 2 s of work at 0.5 of its speed: the work ends at 1 x 0.5 done, then
    1.5 at full speed: 2.5."""
    assert simulate([(COMM, "F", 1.0, True), (COMP, "B", 2.0, False)], 0.5) == [(0.0, 1.0), (0.0, 2.5)]
    assert simulate([(COMM, "F", 1.0, True), (COMP, "B", 2.0, False)], 1.0) == [(0.0, 1.0), (0.0, 2.0)]
    chunk = ChunkOps((LAYER,))
    assert chunk_run(chunk, chunk, 0.5).seconds > chunk_run(chunk, chunk).seconds


def test_run_schedule_times_every_step_by_the_chunk_plan() -> None:
    """p=2, v=2, m=4, every stage the one-layer chunk of :data:`LAYER` with the backward's combine
    1 (merged 15, lone backward 11 of 12): device 0 warms up with 5 forwards and merges 3 pairs
    (each hiding 7 + 12 - 15 = 4), then 5 lone backwards (1 each): 17 hidden; device 1: 3 and 5
    pairs, 3 lone backwards: 23."""
    short = ChunkOps((replace(LAYER, combine_b=1.0),))
    p, v, m = 2, 2, 4
    run = run_schedule("interleaved", p, v, m, [7.0] * 4, [12.0] * 4, a2a=[short] * 4)
    assert [interleaved_warmup(p, v, m, r, 1) for r in range(p)] == [5, 3]
    assert run.hidden_s == pytest.approx([17.0, 23.0])
    assert run.busy_s == pytest.approx([m * v * 19.0 - 17.0, m * v * 19.0 - 23.0])
    plain = run_schedule("interleaved", p, v, m, [7.0] * 4, [12.0] * 4)
    assert run.pipeline_s < plain.pipeline_s


def test_a_layers_ops_cut_into_the_nodes() -> None:
    """One MoE layer's ops (seconds; the all-to-all part of an op's wait after its own work), cut at
    its all-to-alls: forward attention norm 1 and attention 2, pre-MLP norm 0.5, the dispatch op
    0.25 (+1 all-to-all), the experts 3 and their activation 0.75, the rows 0 (+1), the combine 0.1;
    backward the combine's gradient 0.2 (+1), the experts' gradient 4 (half weight gradient), the
    dispatch's gradient 0.1 (+1), the attention's 2 (half weight gradient). Under selective
    recomputation of the two norms and the activation, the attention norm runs again in the
    attention's backward, the pre-MLP norm (read by the dispatch) and the activation in the experts'
    (Megatron-Core registers the pre-MLP norm's recompute on the experts' output)."""
    from types import SimpleNamespace

    from spmdkit.planner.chunk_ops import chunk_ops

    def op(phase: str, reads: list[str], makes: list[str], rule: str = "op") -> SimpleNamespace:
        return SimpleNamespace(phase=phase, layer="layer 0", rule=rule, input_names=lambda: reads,
                               output_names=lambda: makes)

    # the dispatch reads the pre-MLP norm's output through a reshape (0 s)
    ops = [op("forward", ["x"], ["n1"]), op("forward", ["n1"], ["a"]), op("forward", ["a"], ["n2"]),
           op("forward", ["n2"], ["c"], "reshape"), op("forward", ["c"], ["d"]), op("forward", ["d"], ["h"]),
           op("forward", ["h"], ["e"]),
           op("forward", ["e"], ["r"]), op("forward", ["r"], ["y"]),
           op("backward", ["gy"], ["gr"]), op("backward", ["gr"], ["gd"]), op("backward", ["gd"], ["gn2"]),
           op("backward", ["gn2"], ["gx"])]
    times = [1.0, 2.0, 0.5, 0.0, 1.25, 3.0, 0.75, 1.0, 0.1, 1.2, 4.0, 1.1, 2.0]
    a2a = {4: 1.0, 7: 1.0, 9: 1.0, 11: 1.0}
    prog = SimpleNamespace(ops=ops)
    (chunk,) = chunk_ops(prog, [0] * len(ops), 1, times, a2a, {0, 2, 6}, {10: 0.5, 12: 0.5})  # type: ignore[arg-type]
    (got,) = chunk.layers
    want = LayerOps(attn_f=3.75, dispatch_f=1.0, mlp_f=3.75, combine_f=1.0, after_f=0.1, after_b=0.2, combine_b=1.0,
                    mlp_b=3.35, mlp_dw=2.0, dispatch_b=1.0, attn_b=2.0, attn_dw=1.0)
    assert got.moe and got.__dict__ == pytest.approx(want.__dict__)
    assert chunk.forward_s == pytest.approx(sum(times[:9]))
    assert chunk.backward_s == pytest.approx(sum(times[9:]) + 1.0 + 0.5 + 0.75)
