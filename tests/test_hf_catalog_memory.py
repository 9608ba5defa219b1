"""``plan --hf`` of a published config.json equals the catalog model's plan, activations too
(issue 27's Done means): HF's attention is the zoo's causal flash_attention
(spmdkit.models.hf_attention), its RMSNorm and SwiGLU the zoo's fused ops
(spmdkit.models.torch_import.fuse), and a product's operand is kept only for the other operand's
gradient (spmdkit.cost.memory_saved.FOR_GRAD_ONLY). At reduced depth, seq as published or shorter,
bf16, on a flat mesh and a pipeline: parameters, gradients and optimizer states per device are
equal to the byte; the activations kept for the backward differ by exactly what HF's step holds
and the catalog's does not, each named and counted here:

- per layer, the rotary tables' views ``cos.unsqueeze(1)`` and ``sin.unsqueeze(1)`` that HF's
  ``apply_rotary_pos_emb`` makes in each layer ([1, 1, seq, head_dim] each, replicated; the
  catalog takes its tables as inputs);
- HF's loss upcasts the logits to float32 (``logits.float()`` in ``ForCausalLMLoss``), so the
  softmax kept for the backward is 4 bytes an element, not 2;
- HF's loss shifts the labels inside the step (pad + slice): an int64 label per local token is
  kept (the catalog's labels are an input), and 3 float32 scalars (loss sum, count, loss).

The forward and backward collectives are the catalog's, plus HF's 2 loss scalars all-reduced over
dp (the token count and the loss sum)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install 'spmdkit[torch]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'spmdkit[hf]')")

from spmdkit.cli import main

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"), pytest.mark.filterwarnings("ignore::UserWarning")]

DATA = Path(__file__).parent / "data" / "hf"

#: (config file, HF class, catalog name, layers, mesh, batch, seq)
CASES = [
    ("llama-3.1-405b", "LlamaForCausalLM", "llama3.1-405b", 2, "dp=8,tp=8", 8, 8192),
    ("qwen2.5-72b", "Qwen2ForCausalLM", "qwen2.5-72b", 2, "dp=2,tp=8", 4, 4096),
    ("llama-3-8b", "LlamaForCausalLM", "llama3-8b", 2, "dp=2,tp=2", 4, 2048),
]


def _plan(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _both(capsys: pytest.CaptureFixture[str], tmp_path: Path, file: str, cls: str, name: str, layers: int, mesh: str,
          batch: int, seq: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    cfg = json.loads((DATA / f"{file}.json").read_text())
    cfg["num_hidden_layers"] = layers
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    sizes = ["--mesh", mesh, "--batch", str(batch), "--seq", str(seq)]
    hf = _plan(capsys, ["--hf", cls, "--hf-config", str(path), "--dtype", "bf16", *sizes])
    cat = _plan(capsys, ["--model", name, "--layers", str(layers), *sizes])
    return hf, cat, cfg


def _rope_views(cfg: dict[str, Any], layers: int, seq: int) -> int:
    """The bytes of the layers' rotary views (module docstring), each counted."""
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return layers * 2 * seq * head_dim * 2


def _extra(cfg: dict[str, Any], layers: int, dp: int, tp: int, batch: int, seq: int) -> int:
    """What HF's step keeps beyond the catalog's (module docstring), bytes per device."""
    tokens = batch // dp * seq
    rope_views = _rope_views(cfg, layers, seq)
    fp32_softmax = tokens * (cfg["vocab_size"] // tp) * (4 - 2)
    return rope_views + fp32_softmax + tokens * 8 + 3 * 4


@pytest.mark.parametrize(("file", "cls", "name", "layers", "mesh", "batch", "seq"), CASES)
def test_hf_plan_equals_the_catalog_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path, file: str, cls: str,
                                         name: str, layers: int, mesh: str, batch: int, seq: int) -> None:
    hf, cat, cfg = _both(capsys, tmp_path, file, cls, name, layers, mesh, batch, seq)
    assert hf["title"].count("\n") == cat["title"].count("\n") == 0  # no note: no attention spelt out
    mh, mc = hf["memory"], cat["memory"]
    for k in ("parameters", "gradients", "optimizer_states"):
        assert mh[k] == mc[k], k
    dims = dict(p.split("=") for p in mesh.split(","))
    extra = _extra(cfg, layers, int(dims["dp"]), int(dims["tp"]), batch, seq)
    kh, kc = mh["saved_for_backward"], mc["saved_for_backward"]
    assert kh["total"] - kc["total"] == extra
    per_layer = kc["per_layer"]["layer 0"] + 2 * 2 * seq * (cfg.get("head_dim") or 128)
    assert [kh["per_layer"][f"model.layers.{i}"] for i in range(layers)] == [per_layer] * layers
    # the peak: the same plus or minus HF's 3 loss scalars (live or not at the peak op), but for
    # the rotary views: every layer's is a view of one cos / sin storage (memory_saved.shared_storage),
    # which the activation curve holds once (the kept tensors count each layer's, in its layer)
    views = _rope_views(cfg, layers, seq)
    assert abs((mh["activation_peak"] - mc["activation_peak"]) - (extra - views + views // layers)) <= 12
    th, tc = hf["totals"], cat["totals"]
    for phase in ("backward", "optimizer"):
        assert th[phase]["collectives"] == tc[phase]["collectives"], phase
        assert th[phase]["bytes_per_rank"] == tc[phase]["bytes_per_rank"], phase
        assert th[phase]["time_s"] == pytest.approx(tc[phase]["time_s"], rel=1e-12), phase  # summed in another order
    assert th["forward"]["collectives"]["all_reduce"] == tc["forward"]["collectives"]["all_reduce"] + 2
    dp = int(dims["dp"])  # a ring all-reduce of a float32 scalar moves 2 (dp - 1) / dp x 4 bytes a rank
    assert th["forward"]["bytes_per_rank"] == tc["forward"]["bytes_per_rank"] + 2 * (2 * (dp - 1) * 4 // dp)


def test_hf_pipeline_stages_equal_the_catalogs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Llama-3-8B, 4 layers on pp=2 x dp=2 x tp=2: the same cut, and per stage the same
    parameters, gradients, optimizer states and sends; the stashed activations differ by the
    stage's rotary views, and the last stage's by HF's loss as well."""
    hf, cat, cfg = _both(capsys, tmp_path, "llama-3-8b", "LlamaForCausalLM", "llama3-8b", 4, "pp=2,dp=2,tp=2", 8, 2048)
    ph, pc = hf["pipeline"], cat["pipeline"]
    assert ph["layers_per_stage"] == pc["layers_per_stage"] == [2, 2]
    rope = 2 * 2 * 2048 * 128 * 2
    for i, (sh, sc) in enumerate(zip(ph["stages"], pc["stages"], strict=True)):
        for k in ("parameters", "gradients", "optimizer_states", "send_bytes", "send_grad_bytes"):
            assert sh[k] == sc[k], (i, k)
        want = rope if i == 0 else _extra(cfg, 2, 2, 2, 8, 2048)
        assert sh["stash_bytes"] - sc["stash_bytes"] == want, i
