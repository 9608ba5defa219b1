"""Where a view is not its base's storage (spmdkit.cost.memory_saved.storage_of), the three holes
of the shared-storage rule and recomputation:

1. a view and its base both crossing a pipeline stage boundary reach the next stage as two
   buffers: each tensor a stage receives is a fresh ``torch.empty`` (Megatron-Core d98e8a64dd
   ``pipeline_parallel/p2p_communication.py`` ``create_tensor_recv_prev``;
   torch.distributed.pipelining ``stage.py`` ``_RecvInfo`` / ``_make_tensor_from_meta``);
2. a tensor and its view both kept as fp8 casts (Transformer Engine d0067d0da
   ``module/linear.py``: each linear quantizes its own input and saves that cast) are two casts;
3. a view read by the backward of a stage that does not make it (its base kept on another stage)
   is that stage's own buffer, not 0.

The programs: ``h1 = x @ w1`` ([4, 8, 16] bf16: 1,024 bytes) in layer 1 and ``v``, its
[32, 16] reshape (a view), read by linears; layer 1 on stage 0, layer 2 on stage 1."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from spmdkit.cli import main
from spmdkit.cost.memory import activation_deltas, peak_of
from spmdkit.cost.memory_saved import saved_activations, shared_storage
from spmdkit.planner.propagate import propagate
from spmdkit.planner.stage_costs import StageCost, stage_costs
from spmdkit.planner.zero_bubble import weight_shares, weight_stash
from spmdkit.program.autodiff import Tape
from spmdkit.program.ir import Program, ProgramBuilder
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import Runtime
from spmdkit.strategies.strategy import parse_mesh

S, F = [4, 8, 16], [32, 16]
H = 4 * 8 * 16 * 2  # h1's bytes, and v's


def _program(kind: str) -> Program:
    """``cross``: v made in layer 1, h1 and v read only by layer 2's linears; ``local``: the same
    with v made in layer 2; ``both``: v read by a linear of each layer, h1 by one of layer 1."""
    b = ProgramBuilder(kind)
    t = Tape(b)
    b.layer = "layer 1"
    x = b.tensor("x", S, "bfloat16", "input")
    w = [t.param(f"w{k}", [16, 16], "bfloat16") for k in range(4)]
    (h1,) = t.op("matmul", {"x": x, "y": w[0]}, [("h1", S, "bfloat16")])
    if kind != "local":
        (v,) = t.op("reshape", {"x": h1}, [("v", F, "bfloat16")], shape=tuple(F))
    if kind == "both":
        (a,) = t.op("matmul", {"x": h1, "y": w[1]}, [("a", S, "bfloat16")])
        (d,) = t.op("matmul", {"x": v, "y": w[3]}, [("d", F, "bfloat16")])
    b.layer = "layer 2"
    if kind == "local":
        (v,) = t.op("reshape", {"x": h1}, [("v", F, "bfloat16")], shape=tuple(F))
    if kind != "both":
        (a,) = t.op("matmul", {"x": h1, "y": w[1]}, [("a", S, "bfloat16")])
    (c,) = t.op("matmul", {"x": v, "y": w[2]}, [("c", F, "bfloat16")])
    (s,) = t.op("add", {"x": a, "y": t.op("reshape", {"x": c}, [("cr", S, "bfloat16")], shape=tuple(S))[0]},
                [("s", S, "bfloat16")])
    if kind == "both":
        (dr,) = t.op("reshape", {"x": d}, [("dr", S, "bfloat16")], shape=tuple(S))
        (s,) = t.op("add", {"x": s, "y": dr}, [("s2", S, "bfloat16")])
    (loss,) = t.op("sum", {"x": s}, [("loss", [], "float32")], axis=(), keep_dim=False)
    assert loss is not None
    t.backward(loss)
    return b.build()


def _plan(kind: str, precision: str | None = None) -> Plan:
    plan = propagate(_program(kind), parse_mesh("dp=1"), {})
    return dataclasses.replace(plan, runtime=Runtime(precision=precision, framework="megatron"))


def _stages(plan: Plan, recompute: str = "none") -> list[StageCost]:
    stages = [0 if op.layer == "layer 1" else 1 for op in plan.program.ops]
    return stage_costs(plan, stages, (1, 1), recompute=recompute)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_a_view_and_its_base_received_are_two_buffers(recompute: str) -> None:
    """Hole 1. One group (no pipeline): h1 and its view v are one storage, kept once (1,024 B;
    under full recomputation layer 2's checkpoint saves both as its inputs, one storage still).
    Stage 1 of the pipeline receives h1 and v (2,048 B sent) as two buffers and keeps both for
    its linears' weight gradients: 2,048 B a microbatch (1,024 before: v counted 0 as h1's).
    Made on stage 1 from the h1 it received (``local``), v is that buffer: 1,024 B."""
    plan = _plan("cross")
    assert shared_storage(plan)["v"] == "h1"
    assert saved_activations(plan, recompute).per_layer == {"layer 2": H}
    cross = _stages(plan, recompute)
    assert [c.send_bytes for c in cross] == [2 * H, 0]
    assert [c.stash_bytes for c in cross] == [0, 2 * H]
    local = _stages(_plan("local"), recompute)
    assert [c.send_bytes for c in local] == [H, 0]
    assert [c.stash_bytes for c in local] == [0, H]


def test_zb_h1_defers_both_received_buffers_to_w() -> None:
    """Hole 1 in ZB-H1's W stash (what a microbatch keeps from its B to its W): stage 1's weight
    gradients of ``a = h1 @ w1`` and ``c = v @ w2`` read h1 and v, two received buffers: 2,048 B
    (1,024 before), the output gradients left out here (0 B)."""
    plan = _plan("cross")
    stages = [0 if op.layer == "layer 1" else 1 for op in plan.program.ops]
    shares = weight_shares(plan, [f"w{k}.grad" for k in range(4)])
    assert weight_stash(plan, stages, 2, saved_activations(plan), shares, lambda n: 0) == [0, 2 * H]


def test_a_received_view_lives_beside_its_base_in_the_stage_curve() -> None:
    """Hole 1, the working curve: on stage 1 the received v is not merged into the received h1.
    Stage 1's peak is at the backward of c = v @ w2 (it reads v; h1 is live until a's weight
    gradient after it): 1,024 B above the ``local`` program's, where v is made on stage 1 from
    the h1 it received and is that storage (before: the same peak, v merged into h1)."""
    cross = _stages(_plan("cross"))
    local = _stages(_plan("local"))
    assert cross[1].working_peak - local[1].working_peak == H
    # no pipeline: one storage in both programs, the same peak
    flat = [peak_of(activation_deltas(p, saved_activations(p))[0])[0] for p in (_plan("cross"), _plan("local"))]
    assert flat[0] == flat[1]


def test_a_view_read_by_a_stage_that_does_not_make_it_counts_there() -> None:
    """Hole 3. v is read by a linear of layer 1 and one of layer 2, h1 by one of layer 1: both
    kept under layer 1's label, v at 0 as h1's storage. Stage 0 holds one storage (1,024 B);
    stage 1 receives v and keeps that buffer for its linear (1,024 B; it was counted 0 there
    because its base is kept on stage 0)."""
    plan = _plan("both")
    kept = saved_activations(plan)
    assert kept.tensors == {"layer 1": [("h1", H), ("v", 0)]} and kept.shared == {"v": "h1"}
    assert [c.stash_bytes for c in _stages(plan)] == [H, H]


def test_a_tensor_and_its_view_kept_as_fp8_casts_are_two_casts() -> None:
    """Hole 2. Under fp8 with Transformer Engine h1 and v are read by the backward only as two
    linears' inputs: each linear keeps its own 1-byte cast (512 B each), 1,024 B, not one cast
    (512 B). In bf16 they are one storage, 1,024 B."""
    assert saved_activations(_plan("local")).per_layer == {"layer 2": H}
    fp8 = saved_activations(_plan("local", "fp8"))
    assert fp8.tensors == {"layer 2": [("h1", H // 2), ("v", H // 2)]} and fp8.shared == {}
    assert [c.stash_bytes for c in _stages(_plan("local", "fp8"))] == [0, H]


#: Llama 3 405B's shapes (the published params.json), at 8,192 tokens, two layers
L3 = {"name": "l3", "arch": "llama", "activation": "swiglu", "attention": "flash", "hidden": 16384, "heads": 128,
      "kv_heads": 8, "ffn": 53248, "vocab": 128256, "seq": 8192, "batch": 1, "dtype": "bf16",
      "tied_embeddings": False, "layers": 2}


def _l3(capsys: pytest.CaptureFixture[str], recompute: str) -> dict[str, Any]:
    argv = ["plan", "--mesh", "tp=8", "--strategy", "megatron,sp", "--device", "h100", "--framework", "megatron",
            "--recompute", recompute, "--json", "--model-config", json.dumps(L3)]
    assert main(argv) == 0
    return dict(json.loads(capsys.readouterr().out)["memory"]["saved_for_backward"])


def test_a_kept_view_of_a_recomputed_base_counts_on_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    """Recomputation: under selective (Megatron-Core's core_attn checkpoint) the flash output is
    made again in the backward and not kept; its [s, b, h] view, which the output projection
    keeps, holds the forward's storage alone and counts in full (u = 33,554,432 B). A Llama 3
    405B layer at tp 8 with sequence parallelism keeps 15.875 u + 533,209,104's norms' float32
    inverse RMS (2 x 4,096 B), less flash's log-sum-exp and seed (test_view_storage)."""
    u = 8192 * 16384 // 8 * 2
    kept = _l3(capsys, "selective")
    assert kept["per_layer"]["layer 1"] == round(15.875 * u) + 2 * 4096 == 532_684_800
