"""HF attention imported as the zoo's causal flash_attention (issue 27's last gap;
spmdkit.models.hf_attention): an unpadded step of a plain causal decoder carries no [seq, seq]
mask or scores, its attention is the zoo's op with the zoo's attributes, the loss still equals
torch eager's, and where the causal op cannot express the pattern (a sliding window shorter than
the sequence, padding, a relative position bias, the model's own eager attention) the mask is
kept and the report's first lines say why."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'spmdkit[torch]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'spmdkit[hf]')")

from spmdkit.execute.single import run_program  # noqa: E402
from spmdkit.models.hf import import_hf  # noqa: E402
from spmdkit.models.hf_attention import spelt_out_attention, square_tensors  # noqa: E402
from spmdkit.models.source import HFModel, hf_title  # noqa: E402
from spmdkit.models.torch_import import torch_values  # noqa: E402
from spmdkit.models.zoo import build_model, preset  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

TINY = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 1024}
DECODERS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"]


def _import(cls: str, cfg: dict[str, Any], seq: int, **kw: Any) -> tuple[Any, Any, dict[str, Any]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return import_hf(cls, cfg, batch=2, seq=seq, fallback="error", **kw)


def _loss_equals_eager(prog: Any, model: Any, kw: dict[str, Any]) -> None:
    vals = run_program(prog, torch_values(prog, model, (), kw))
    with torch.no_grad():
        want = float(model(**kw).loss)
    assert prog.loss is not None and abs(float(vals[prog.loss]) - want) <= 1e-5 * abs(want)


@pytest.mark.parametrize("cls", DECODERS)
def test_plain_causal_decoder_has_no_seq_by_seq_tensor(cls: str) -> None:
    """At seq 512 (no other axis of that size), the training step holds no tensor with two axes
    of the sequence length: forward, backward or constant; each layer's attention is one causal
    flash_attention and the report's first lines carry no note."""
    prog, _, _ = _import(cls, TINY, 512, weights=False)
    assert square_tensors(prog, 512) == []
    assert not any(sum(d == 512 for d in t.shape) >= 2 for t in prog.tensors.values())
    flash = [op for op in prog.ops if op.rule == "flash_attention"]
    assert len(flash) == 2 and all(op.attrs == {"causal": True} for op in flash)
    assert prog.notes == []


def test_imported_attention_is_the_zoos_op() -> None:
    """The imported attention is the zoo's op: the same rule, the same attributes, q / k / v as
    [batch, seq, heads, head_dim] with grouped kv heads, the same four outputs (their shapes and
    dtypes), so its cost and memory are the same."""
    cfg = preset("tiny-llama")
    zoo = build_model(cfg, check_rules=False).program
    hf_cfg = {**TINY, "num_hidden_layers": cfg.layers, "hidden_size": cfg.hidden, "num_attention_heads": cfg.heads,
              "num_key_value_heads": cfg.n_kv, "intermediate_size": cfg.ffn, "vocab_size": cfg.vocab}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog, _, _ = import_hf("LlamaForCausalLM", hf_cfg, batch=cfg.batch, seq=cfg.seq, weights=False)

    def forms(p: Any) -> list[Any]:
        got = []
        for op in p.ops:
            if op.rule == "flash_attention":
                ins = tuple(p.tensors[op.inputs[k]].shape for k in ("q", "k", "v"))
                outs = tuple((p.tensors[n].shape, p.tensors[n].dtype) if n else None for n in op.outputs)
                got.append((op.attrs, ins, outs))
        return got

    assert len(forms(prog)) == cfg.layers and forms(prog) == forms(zoo)


@pytest.mark.parametrize("cls", [*DECODERS, "GraniteForCausalLM", "OPTForCausalLM", "BertForMaskedLM"])
def test_loss_equals_torch_eager_with_flash(cls: str) -> None:
    """With the weights, the imported step's loss equals torch eager's (which attends through the
    all-ones mask): the causal op is exact. Granite and OPT call sdpa with a scale other than
    1/sqrt(d) (q is scaled first); BERT is bidirectional (flash_attention causal=False)."""
    cfg = {**TINY, "max_position_embeddings": 64}
    if cls == "OPTForCausalLM":
        cfg = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_dim": 128,
               "vocab_size": 256, "max_position_embeddings": 64, "word_embed_proj_dim": 64}
    if cls == "BertForMaskedLM":
        cfg = {k: v for k, v in cfg.items() if k != "num_key_value_heads"}
    prog, model, kw = _import(cls, cfg, 16, optimizer=None)
    causal = [op.attrs["causal"] for op in prog.ops if op.rule == "flash_attention"]
    assert causal == [cls != "BertForMaskedLM"] * 2
    assert spelt_out_attention(prog, 16) == [] and prog.notes == []
    _loss_equals_eager(prog, model, kw)


def test_sliding_window_shorter_than_seq_keeps_its_mask_and_says_so() -> None:
    """Mistral with a window of 128 at seq 512: the window is in the mask, so attention stays
    spelt out with it, the loss is still torch eager's, and the report's first lines say why;
    a window of the sequence or longer is plain causal."""
    prog, _, _ = _import("MistralForCausalLM", {**TINY, "sliding_window": 128}, 512, weights=False)
    assert len(spelt_out_attention(prog, 512)) == 2
    (note,) = prog.notes
    assert note.startswith("note: 2 attention(s) spelt out with an explicit [512, 512] mask") \
        and "sliding window 128 <= seq 512" in note
    src = HFModel("MistralForCausalLM", {}, 2, 512)
    assert hf_title(src, prog).splitlines()[1] == note
    wide, _, _ = _import("MistralForCausalLM", {**TINY, "sliding_window": 1024}, 512, weights=False)
    assert square_tensors(wide, 512) == [] and wide.notes == []
    small, model, kw = _import("MistralForCausalLM", {**TINY, "max_position_embeddings": 64, "sliding_window": 8}, 16,
                               optimizer=None)
    assert "sliding window 8 <= seq 16" in small.notes[0]
    _loss_equals_eager(small, model, kw)


def test_padded_inputs_keep_the_mask() -> None:
    """Padded example inputs (the last row's last 3 positions): the padding is in the mask, so it
    is kept, the loss equals torch eager's, and the note says the inputs are padded."""
    prog, model, kw = _import("LlamaForCausalLM", {**TINY, "max_position_embeddings": 64}, 16, pad=3, optimizer=None)
    assert len(spelt_out_attention(prog, 16)) == 2 and "the example inputs are padded" in prog.notes[0]
    _loss_equals_eager(prog, model, kw)


@pytest.mark.parametrize(("cls", "cfg", "why"), [
    ("BloomForCausalLM", {"n_layer": 2, "hidden_size": 64, "n_head": 4, "vocab_size": 256},
     "its own eager code, not sdpa"),
    ("T5ForConditionalGeneration", {"num_layers": 2, "d_model": 64, "num_heads": 4, "d_kv": 16, "d_ff": 128,
                                    "vocab_size": 256, "decoder_start_token_id": 0, "pad_token_id": 0},
     "a relative position bias added to the scores"),
])
def test_attention_the_causal_op_cannot_express_keeps_its_mask(cls: str, cfg: dict[str, Any], why: str) -> None:
    """BLOOM (ALiBi in its own eager attention, which reads the mask itself) and T5 (a relative
    position bias added to the scores): the mask is kept, the loss is torch eager's, the note
    says why."""
    prog, model, kw = _import(cls, cfg, 16, optimizer=None)
    assert spelt_out_attention(prog, 16) and why in prog.notes[0]
    _loss_equals_eager(prog, model, kw)


def _own_attention(module: Any, q: Any, k: Any, v: Any, mask: Any, scaling: float = 1.0, **_: Any) -> Any:
    """Attention in a model's own code: sdpa told nothing but the mask it is handed (without
    one it attends everywhere), as a model reading its mask itself does."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


class _OwnOnly:
    """An attention table whose every entry is :func:`_own_attention` (not transformers' sdpa)."""

    def get_interface(self, _name: str, _default: Any) -> Any:
        return _own_attention


def test_a_model_reading_its_mask_itself_is_traced_again_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model configured for sdpa whose attention is its own code reading the mask (as BLOOM's
    reads its own): handed no mask it would attend everywhere, so the import sees that sdpa was
    never called and traces again with the mask: the program is the plain trace's (HF's masks as
    torch.export builds them), and the note says why. (HF's eager mode would skip that mask
    itself, so such a model is broken in eager too: the retrace is a guard.)"""
    from transformers.models.llama import modeling_llama

    from spmdkit.models.torch_import import import_module

    monkeypatch.setattr(modeling_llama, "ALL_ATTENTION_FUNCTIONS", _OwnOnly())
    prog, model, kw = _import("LlamaForCausalLM", {**TINY, "max_position_embeddings": 64}, 16, optimizer=None)
    assert len(spelt_out_attention(prog, 16)) == 2 and "reads its mask in code of its own" in prog.notes[0]
    plain = import_module(model, (), kw, training=True, optimizer=None, fuse=True)
    assert [(op.rule, op.inputs, op.outputs) for op in prog.ops] == [(op.rule, op.inputs, op.outputs) for op in plain.ops]
    masked = [op for op in prog.ops if op.rule == "where" and op.phase == "forward"]
    assert len(masked) == 2  # where(mask, scores, -inf) in each layer


def test_the_note_is_the_reports_second_line(capsys: pytest.CaptureFixture[str]) -> None:
    """On the command line the note follows the title's first line (which carries the strategy),
    flat and with a pipeline."""
    from spmdkit.cli import main

    cfg = json.dumps({**TINY, "sliding_window": 8, "max_position_embeddings": 64})
    for mesh in ("dp=2", "pp=2"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert main(["plan", "--hf", "MistralForCausalLM", "--hf-config", cfg, "--mesh", mesh, "--strategy", "dp",
                         "--seq", "16", "--batch", "4"]) == 0
        lines = capsys.readouterr().out.splitlines()
        first = next(i for i, ln in enumerate(lines) if ln.startswith("MistralForCausalLM (HuggingFace)"))
        assert "; strategy dp" in lines[first]
        assert lines[first + 1].startswith("note: 2 attention(s) spelt out") and "sliding window 8 <= seq 16" in \
            lines[first + 1] and "strategy" not in lines[first + 1]


def test_a_router_softmax_over_as_many_experts_as_tokens_is_no_attention() -> None:
    """Mixtral with 8 experts traced at seq 8: the router's softmax over [batch, seq, 8] logits has
    [seq, seq] last axes; it was counted as attention spelt out ('note: 2 attention(s) spelt out
    with an explicit [8, 8] mask'), though attention is one flash_attention a layer."""
    cfg = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 64, "num_local_experts": 8, "num_experts_per_tok": 2}
    prog, _m, _kw = import_hf("MixtralForCausalLM", cfg, seq=8, weights=False)
    assert sum(op.rule == "flash_attention" for op in prog.ops if op.phase == "forward") == 2
    assert spelt_out_attention(prog, 8) == [] and not any("spelt out" in n for n in prog.notes)


FALCON = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64, "alibi": False,
          "max_position_embeddings": 1024}


@pytest.mark.parametrize("arch", [{"multi_query": True},  # Falcon-7B: one kv head
                                  {"new_decoder_architecture": True, "num_kv_heads": 2}])  # Falcon-40B: grouped
def test_a_plain_causal_mask_built_on_request_is_causal_flash(arch: dict[str, Any]) -> None:
    """Falcon (transformers 5.25 ``FalconModel.forward``) asks ``create_causal_mask`` for its mask
    with ``allow_is_causal_skip=False`` ("so alibi can be added onto it") and, without ALiBi, hands it
    unchanged to sdpa: the plain causal pattern. Its attention was spelt out (a [seq, seq] mask,
    scores and softmax, the note 'a mask the model builds in full'); it is one causal
    flash_attention a layer now, no tensor with two axes of the sequence, no note, the loss torch
    eager's."""
    prog, _, _ = _import("FalconForCausalLM", {**FALCON, **arch}, 512, weights=False)
    assert square_tensors(prog, 512) == [] and spelt_out_attention(prog, 512) == [] and prog.notes == []
    flash = [op for op in prog.ops if op.rule == "flash_attention"]
    assert len(flash) == 2 and all(op.attrs == {"causal": True} for op in flash)
    prog, model, kw = _import("FalconForCausalLM", {**FALCON, **arch}, 16, optimizer=None)
    assert sum(op.rule == "flash_attention" for op in prog.ops) == 2 and prog.notes == []
    _loss_equals_eager(prog, model, kw)


def test_falcon_with_alibi_keeps_its_mask() -> None:
    """With ALiBi Falcon adds the bias onto the mask (a new tensor): sdpa reads a mask that is not
    the one built, so it is kept, spelt out, and the note says why."""
    prog, model, kw = _import("FalconForCausalLM", {**FALCON, "alibi": True}, 16, optimizer=None)
    assert len(spelt_out_attention(prog, 16)) == 2 and not any(op.rule == "flash_attention" for op in prog.ops)
    assert "a mask the model builds in full" in prog.notes[0]
    _loss_equals_eager(prog, model, kw)


def test_a_plain_mask_is_dropped_only_unchanged_and_unwrapped() -> None:
    """The sdpa call drops a mask built on request only where it is the plain causal pattern as
    built: changed in place after (its version moved), or made with an overlay (``or_masks``), it is
    read; dropped, the call is causal even where the module says otherwise."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function, or_masks
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from spmdkit.models.hf_attention import unmasked_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=gen) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = False
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def ran(out: Any, want: Any) -> bool:
        return torch.allclose(out[0], want.transpose(1, 2), atol=1e-6)

    with unmasked_attention() as rec:
        def build(fn: Any) -> Any:
            return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](batch_size=1, q_length=4, kv_length=4, mask_function=fn,
                                                        allow_is_causal_skip=False)

        plain = build(causal_mask_function)
        assert ran(ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, plain), sdpa(q, k, v, is_causal=True))
        changed = build(causal_mask_function)
        changed[:, :, 3, 1] = False
        assert ran(ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, changed), sdpa(q, k, v, attn_mask=changed))
        overlay = build(or_masks(causal_mask_function, lambda b, h, i, j: j == i + 1))
        assert ran(ALL_ATTENTION_FUNCTIONS["sdpa"](module, q, k, v, overlay), sdpa(q, k, v, attn_mask=overlay))
    assert rec.dropped == 1 and rec.sdpa_calls == 3 and len(rec.read) == 2
