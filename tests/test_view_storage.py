"""A view is its base's storage (spmdkit.cost.memory_saved.shared_storage): torch's transpose,
squeeze and unsqueeze return views, and reshape / view / flatten of a contiguous tensor too, so
a tensor and its views kept for the backward hold one storage, counted once; the attention
output the flash kernel's backward keeps and its [b, s, h] reshape the output projection keeps
are one (Transformer Engine d0067d0da: ``FusedAttnFunc.forward`` saves ``out`` and
``FusedAttention.forward`` returns ``output.view(...)``; torchtitan 9dec370
``models/llama/model.py``: ``output.transpose(1, 2).contiguous().view(bs, seqlen, -1)`` of SDPA's
flash output, which it laid out [b, s, h, d] and returned transposed, into ``self.wo``)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from spmdkit.cli import main
from spmdkit.cost.memory_saved import shared_storage
from spmdkit.planner.propagate import propagate
from spmdkit.program.ir import ProgramBuilder
from spmdkit.strategies.strategy import parse_mesh

#: Llama 3 405B's shapes (the published params.json), at 8,192 tokens
L3 = {"name": "l3", "arch": "llama", "activation": "swiglu", "attention": "flash", "hidden": 16384, "heads": 128,
      "kv_heads": 8, "ffn": 53248, "vocab": 128256, "seq": 8192, "batch": 1, "dtype": "bf16",
      "tied_embeddings": False}


def test_views_share_their_base_and_a_reshape_of_a_transpose_copies() -> None:
    """h = x @ w; ht = h^T (a view); r1 = ht.reshape (not contiguous: a copy, its own storage);
    hu = ht^T (a view, h's layout again); r2 = hu.reshape (a view of h); u = r1.unsqueeze (a
    view of r1)."""
    b = ProgramBuilder()
    x = b.tensor("x", [4, 6, 8], kind="input")
    w = b.tensor("w", [8, 8], kind="parameter")
    (h,) = b.op("matmul", {"x": x, "y": w}, [("h", [4, 6, 8])])
    (ht,) = b.op("transpose", {"x": h}, [("ht", [4, 8, 6])], perm=(0, 2, 1))
    (r1,) = b.op("reshape", {"x": ht}, [("r1", [4, 48])], shape=(4, 48))
    (hu,) = b.op("transpose", {"x": ht}, [("hu", [4, 6, 8])], perm=(0, 2, 1))
    b.op("reshape", {"x": hu}, [("r2", [4, 48])], shape=(4, 48))
    b.op("unsqueeze", {"x": r1}, [("u", [1, 4, 48])], axis=[0])
    plan = propagate(b.build(), parse_mesh("dp=1"), {})
    assert shared_storage(plan) == {"ht": "h", "hu": "h", "r2": "h", "u": "r1"}


def _plan(capsys: pytest.CaptureFixture[str], mesh: str, *extra: str) -> dict[str, Any]:
    argv = ["plan", "--mesh", mesh, "--strategy", "megatron,sp", "--device", "h100", "--framework", "megatron",
            "--recompute", "none", "--json", "--model-config", json.dumps({**L3, "layers": 2}), *extra]
    assert main(argv) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_llama3_405b_keeps_its_attention_output_once(capsys: pytest.CaptureFixture[str]) -> None:
    """A Llama 3 405B layer at tp 8 with sequence parallelism, 8,192 tokens, bf16, no
    recomputation, keeps for its backward, in units of u = s h / t x 2 bytes (33,554,432): its
    input and its two norms' outputs (3 u: the norms' inputs and sequence parallel's sharded
    outputs), q after the rotary embedding (u), k and v (u / 16 each: 8 of 128 heads), the
    attention output once (u), the residual after attention (u), the MLP's gate, up and SwiGLU
    outputs (3 x 3.25 u), plus the norms' float32 inverse RMS (2 x 4,096), flash's float32
    log-sum-exp (16 heads x 8,192 x 4) and its seed (16): 15.875 u + 532,496 bytes. Before, the
    attention output's reshape was counted again: + u. A pipeline stage of that layer stashes as
    much a microbatch in flight. Under fp8 the output projection keeps its own fp8 cast of it (1 byte an element): not shared."""
    u = 8192 * 16384 // 8 * 2
    layer = round(15.875 * u) + 2 * 4096 + 16 * 8192 * 4 + 16
    kept = _plan(capsys, "tp=8")["memory"]["saved_for_backward"]
    assert kept["per_layer"]["layer 1"] == layer == 533_209_104
    # fp8: the inputs of the linears only they read (the two norms' outputs, the attention output's
    # reshape, SwiGLU's output) kept as 1-byte casts: - (1 + 1 + 3.25) u / 2, + u / 2 for the reshape's
    fp8 = _plan(capsys, "tp=8", "--precision", "fp8")["memory"]["saved_for_backward"]
    assert fp8["per_layer"]["layer 1"] == layer - round(2.125 * u)
    # a pipeline stage of one layer stashes it a microbatch (its input received, its output sent and freed)
    pipe = _plan(capsys, "pp=2,tp=8", "--batch", "2", "--microbatches", "2")["pipeline"]
    assert pipe["stages"][0]["stash_bytes"] == layer
