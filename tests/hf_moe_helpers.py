"""What the tests of imported (``--hf``) MoE models under cp, sp and ep share: tiny Mixtral /
Qwen3-MoE configs (hidden 32, 4 experts top-2) and a plan's collectives as rows to count."""

from __future__ import annotations

import collections
from typing import Any

MIXTRAL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "num_local_experts": 4,
           "num_experts_per_tok": 2}
QWEN3 = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64, "num_experts": 4,
         "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}


def collectives(plan: Any, scalars: bool = True) -> collections.Counter[tuple[str, str, str, str, int]]:
    """(phase, kind, mesh dims, tensor, bytes a rank sends) of every collective of the plan; without
    ``scalars`` those of 0-d tensors (the loss' sum and count) left out."""
    names = plan.mesh.dim_names
    got: collections.Counter[tuple[str, str, str, str, int]] = collections.Counter()
    for r, s in plan.collectives():
        if scalars or plan.program.tensors[r.tensor].shape:
            got[(plan.program.ops[r.op_index].phase, s.kind, "x".join(names[d] for d in s.mesh_dims), r.tensor,
                 s.bytes_per_rank)] += 1
    return got


def equals_eager(rep: dict[str, Any], world: int) -> None:
    """``spmdkit run --hf --json``'s report ``rep`` on ``world`` gloo ranks: every tensor equal to
    its op run unsharded, the ranks' collectives the plan's, and the loss and every parameter
    gradient equal to torch eager's step (float32)."""
    assert rep["world_size"] == world and rep["ok"] and rep["collectives_match"] and not rep["failures"], \
        rep["failures"]
    eager = rep["eager"]
    assert eager["checked"] >= 20 and not eager["failures"], eager
    assert abs(rep["loss"] - eager["loss"]) <= 1e-5 * abs(eager["loss"])


def cp_moe_rows(seq: str, every: str, kv: int, a2a: int, ranks: int) -> dict[tuple[str, str, str, str, int], int]:
    """The activations' collectives (:func:`collectives` without the optimizer's) of a one-layer
    Mixtral import under cp and ep, all-gather attention: k and v gathered over the sequence's
    group ``seq`` (``kv`` bytes a rank sends) and their gradients reduce-scattered back, the
    dispatch and the rows one all-to-all each over ep (``a2a``) both ways, the loss' two float32
    scalars all-reduced over ``every`` (``ranks`` ranks)."""
    loss = 2 * (ranks - 1) * 4 // ranks
    return {
        ("forward", "all_gather", seq, "scaled_dot_product_attention.k", kv): 1,
        ("forward", "all_gather", seq, "scaled_dot_product_attention.v", kv): 1,
        ("forward", "all_to_all", "ep", "moe_experts.dispatch", a2a): 1,
        ("forward", "all_to_all", "ep", "moe_experts.rows", a2a): 1,
        ("forward", "all_reduce", every, "cross_entropy_loss.loss_sum", loss): 1,
        ("forward", "all_reduce", every, "cross_entropy_loss.count", loss): 1,
        ("backward", "all_to_all", "ep", "moe_experts.rows.grad", a2a): 1,
        ("backward", "all_to_all", "ep", "moe_experts.dispatch.grad.sum", a2a): 1,
        ("backward", "reduce_scatter", seq, "scaled_dot_product_attention.k.grad", kv): 1,
        ("backward", "reduce_scatter", seq, "scaled_dot_product_attention.v.grad", kv): 1,
    }
