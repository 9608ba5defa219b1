"""The plan's context parallelism as torch's own ``context_parallel`` runs it
(spmdkit.outputs.torch_cp), checked against torch 2.13 itself: the rotate method named is one
``set_rotate_method`` takes, torch has no ring by send/recv and no Ulysses, and its head-tail
load balancer lays the tokens out exactly as spmdkit's zig-zag does."""

from __future__ import annotations

import pytest

from spmdkit.models.zoo import preset
from spmdkit.models.zoo_layers import cp_order
from spmdkit.outputs.torch_cp import torch_context_parallel
from spmdkit.planner.planning import plan_model

torch = pytest.importorskip("torch")
cpa = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._attention")
lb = pytest.importorskip("torch.distributed.tensor.experimental._context_parallel._load_balancer")


@pytest.fixture(autouse=True)
def _restore_rotate() -> object:
    old = cpa._cp_options.rotate_method
    yield
    cpa._cp_options.rotate_method = old


@pytest.mark.parametrize(("variant", "method", "enum"), [("allgather", "allgather", "ALL_GATHER"),
                                                         ("ring", "alltoall", "ALL_TO_ALL")])
def test_the_rotate_method_named_is_torchs(variant: str, method: str, enum: str) -> None:
    _, plan, _ = plan_model("tiny-llama", "dp=2,cp=2", f"dp,cp,cp-attention={variant}")
    doc = torch_context_parallel(plan)
    assert doc is not None and doc["supported"] and doc["rotate_method"] == method and doc["p2p_ring"] is False
    assert doc["buffers"] == {"labels": 1, "rope.cos": 1, "rope.sin": 1, "tokens": 1} and doc["sdpa_seq_dim"] == 2
    cpa.set_rotate_method(doc["rotate_method"])
    assert cpa._cp_options.rotate_method == getattr(cpa._RotateMethod, enum)
    assert ("send/recv" in doc["note"]) == (variant == "ring")


def test_torch_has_no_p2p_ring_and_no_ulysses() -> None:
    assert {m.name for m in cpa._RotateMethod} == {"ALL_TO_ALL", "ALL_GATHER"}
    for name in ("ring", "p2p", "ulysses"):
        with pytest.raises(NotImplementedError):
            cpa.set_rotate_method(name)
    _, plan, _ = plan_model("tiny-llama", "dp=2,cp=2", "dp,cp,cp-attention=alltoall")
    doc = torch_context_parallel(plan)
    assert doc is not None and not doc["supported"] and doc["rotate_method"] is None
    assert "DeepSpeed-Ulysses" in doc["note"]


@pytest.mark.parametrize(("seq", "cp"), [(8, 2), (16, 2), (16, 4), (64, 8)])
def test_torchs_head_tail_balancer_is_spmdkits_zigzag(seq: int, cp: int) -> None:
    """torch reorders natural-order buffers with _HeadTailLoadBalancer, then chunks them over the
    ranks: the order is spmdkit's cp_order (rank i: chunks i and 2cp-1-i)."""
    got = lb._create_default_load_balancer(seq, cp, "cpu")
    assert isinstance(got, lb._HeadTailLoadBalancer)
    assert got._generate_indices().flatten().tolist() == cp_order(preset("tiny-llama").with_(seq=seq, cp=cp))


def test_eager_attention_and_no_cp() -> None:
    """gpt2's eager attention (matmuls, no SDPA) is split over cp but torch's context_parallel
    replaces SDPA only; a plan without cp has no statement."""
    _, plan, _ = plan_model("tiny-gpt2", "dp=2,cp=2", "dp,cp")
    doc = torch_context_parallel(plan)
    assert doc is not None and doc["variant"] == "eager" and not doc["supported"] and "SDPA" in doc["note"]
    _, plan, _ = plan_model("tiny-llama", "dp=2", "dp")
    assert torch_context_parallel(plan) is None
