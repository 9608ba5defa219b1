"""torchtitan's memory as its code holds it (spmdkit.cost.memory): the loss over vocab-sharded logits
run op by op by torch's DTensor loss-parallel handlers (4 bytes an element more than aten's kernels,
forward and backward), op-level selective checkpointing holding the matmul outputs it saves until the
ops recomputed from them run again in the backward (eager: all of them; compiled: those the backward
needs), and FSDP2's root group (embedding, final norm, head) gathered from the forward's start to the
backward's end."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from spmdkit.cost import memory as mem
from spmdkit.cost.memory_saved import recompute_inputs, saved_activations
from spmdkit.planner.planning import plan_model
from spmdkit.program.runtime import Runtime

SMALL = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2, "ffn": 256, "vocab": 4096, "seq": 64, "batch": 2}


def _plan(mesh: str, strategy: str) -> Any:
    plan = plan_model("llama-7b", mesh, strategy, SMALL)[1]
    return replace(plan, runtime=Runtime(framework="torchtitan"))


def test_loss_parallel_holds_four_bytes_more_each_way(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch/distributed/tensor/parallel/loss.py: forward x.float() 4 + shifted 4 + exp(shifted) 4 beside the
    # bf16 logits 2 = 14 (aten: logits 2 + x 4 + log_softmax 4 = 10); backward log-softmax 4 + zeros_like 4
    # + exp 4 + their sum 4 = 16 (aten: log-softmax 4 + nll grad 4 + its grad 4 = 12)
    assert mem.LOSS_PARALLEL_BYTES["torchtitan"] == (2, 4 + 4, 8 + 4)
    plan = _plan("tp=2", "megatron,sp")
    ((i, j, elems),) = mem.loss_spans(plan)
    assert plan.program.ops[i].rule == "c_softmax_with_cross_entropy"
    assert elems == 2 * 64 * 4096 // 2  # the local (vocab-sharded) logits
    assert mem.loss_bytes(plan, i) == (2, 8, 12)
    flat = _plan("dp=1", "dp")
    ((k, _, _),) = mem.loss_spans(flat)
    assert mem.loss_bytes(flat, k) == mem.LOSS_BYTES["torchtitan"] == (2, 4, 8)  # tp = 1: aten's kernels
    # the curve: 4 bytes a local logit element more at the loss forward and at its backward
    got = mem.memory_per_device(plan, "none").curve
    monkeypatch.setitem(mem.LOSS_PARALLEL_BYTES, "torchtitan", (2, 4, 8))
    base = mem.memory_per_device(plan, "none").curve
    assert got[i] - base[i] == 4 * elems and got[j] - base[j] == 4 * elems
    assert got[i - 1] == base[i - 1]


def test_selective_checkpointing_holds_the_saved_matmul_outputs_to_the_backward(
        monkeypatch: pytest.MonkeyPatch) -> None:
    plan = _plan("dp=1", "dp")
    saved = saved_activations(plan, "selective")
    ops = plan.program.ops
    # torchtitan's op policy saves the outputs of wq, wv, w1 and w2 (matmuls 1, 3, 5, 7); no backward op
    # reads those of wq, wv, w2 (the rotary embedding and the residual add run again from them)
    again = recompute_inputs(plan, saved)
    for layer in (0, 1):
        for n in ("q", "v", "mlp_out"):
            assert ops[again[f"layers.{layer}.{n}"]].phase == "backward"
    loss = next(i for i, op in enumerate(ops) if op.rule in mem.LOSS_RULES)
    got = mem.memory_per_device(plan, "selective").curve
    monkeypatch.setattr(mem, "recompute_inputs", lambda plan, saved: {})
    dropped = mem.memory_per_device(plan, "selective").curve
    # at the loss, per layer: q 128 tokens x 128 x 2 B, v 128 x 64 x 2 B, the w2 output 128 x 128 x 2 B
    assert got[loss] - dropped[loss] == 2 * (128 * 128 * 2 + 128 * 64 * 2 + 128 * 128 * 2)
    # and every tensor kept for the backward is live there (the layers' ones: the head's come later)
    kept = sum(b for label, lst in saved.tensors.items() if label.startswith("layer") for _, b in lst)
    assert got[loss] >= kept
    monkeypatch.undo()
    # compiled (AOTAutograd's partitioner saves what the backward needs): w2's output, which only the
    # residual add reads, is not held; q and v are (the rotary embedding and attention run again)
    comp = replace(plan, runtime=Runtime(framework="torchtitan", compile=True))
    held = recompute_inputs(comp, saved_activations(comp, "selective"))
    assert "layers.1.mlp_out" in held
    assert "layers.0.q" in held and "layers.0.v" in held and "layers.0.mlp_out" not in held
    got_c = mem.memory_per_device(comp, "selective").curve
    assert got[loss] - got_c[loss] == 128 * 128 * 2  # layer 0's (the last layer's output is run again)


def test_fsdp2_root_group_stays_gathered_for_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    # FSDP2 (dp=2, parameters stored sharded): block by block, the embedding's gathered copy would be
    # freed after its forward; FSDP2's root group is not resharded after the forward
    # (FSDPState._lazy_init: post_forward_mesh_info = None), so it is live at the loss and to the end of
    # the backward: the table, 4096 x 128 in bf16, more there
    plan = _plan("dp=2", "dp,zero3")
    ops = plan.program.ops
    loss = next(i for i, op in enumerate(ops) if op.rule in mem.LOSS_RULES)
    last_bwd = max(i for i, op in enumerate(ops) if op.phase == "backward")
    assert mem.root_reshard(plan) == last_bwd
    assert mem.root_reshard(replace(plan, runtime=Runtime(framework="megatron"))) == 0
    got = mem.memory_per_device(plan, "none").curve
    monkeypatch.setattr(mem, "root_reshard", lambda plan: 0)
    blocks = mem.memory_per_device(plan, "none").curve
    assert got[loss] - blocks[loss] == 4096 * 128 * 2
    # in the first block: the whole group (embedding, head, final norm's 128 scales) since the root's
    # pre-forward all-gather, where a block-by-block FSDP would not have gathered the head yet
    first = next(i for i, op in enumerate(ops) if op.layer == "layer 0")
    assert got[first] - blocks[first] == 2 * 4096 * 128 * 2 + 128 * 2
