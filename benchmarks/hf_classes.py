#!/usr/bin/env python3
"""HuggingFace classes as they come, at tiny size: import, megatron, --verify, ``spmdkit run``.

    python benchmarks/hf_classes.py [--classes Llama,GPT2,...] [--no-run] [--write-docs]

For each class below (2 layers, hidden 64, 4 heads, FFN 128, vocab 256, batch 4, seq 16, float32,
random weights from seed 0; no hub):

- **imports**: ``spmdkit.models.hf.import_hf`` with ``fallback="error"`` (the training step:
  forward, backward, AdamW), its op count;
- **megatron**: the plan on dp=2 x tp=2 with ``--strategy megatron``: the collectives over tp
  per transformer layer (layer 0's), forward / backward (an expert's plan: 2 all-reduces per
  dense layer each way), and the share of parameters left replicated over tp;
- **verify**: the plan simulated rank by rank on the model's own weights and inputs
  (:func:`spmdkit.sim.plan.simulate_plan`: every tensor of the step assembled from the ranks
  equals the unsharded step's, float64 references);
- **run**: ``spmdkit run --hf CLASS --mesh dp=2,tp=2 --nproc 4`` on gloo (torch kernels in
  float32, each op checked on what its rank received, and the loss and every parameter gradient
  against torch eager's autograd), its verdict and torch eager's largest relative error.

``--write-docs`` replaces the table in docs/torch.md (between its ``hf-classes`` markers).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

V, H, F, S, B = 256, 64, 128, 16, 4
_C = {"num_hidden_layers": 2, "hidden_size": H, "num_attention_heads": 4, "intermediate_size": F, "vocab_size": V,
      "max_position_embeddings": 64}
_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
_ENC_DEC = {"encoder_layers": 2, "decoder_layers": 2, "d_model": H, "encoder_attention_heads": 4,
            "decoder_attention_heads": 4, "encoder_ffn_dim": F, "decoder_ffn_dim": F, "vocab_size": V,
            "decoder_start_token_id": 1, **_IDS}

#: class -> tiny config (the 12 of tests/test_hf.py first, then those issue 27 names, then others)
CLASSES: dict[str, dict[str, Any]] = {
    "GPT2LMHeadModel": {"n_layer": 2, "n_embd": H, "n_head": 4, "vocab_size": V, "n_positions": 64, **_IDS},
    "LlamaForCausalLM": {**_C, "num_key_value_heads": 2},
    "MistralForCausalLM": {**_C, "num_key_value_heads": 2},
    "Qwen2ForCausalLM": {**_C, "num_key_value_heads": 2},
    "MixtralForCausalLM": {**_C, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
    "GemmaForCausalLM": {**_C, "num_key_value_heads": 2, "head_dim": 16},
    "Gemma2ForCausalLM": {**_C, "num_key_value_heads": 2, "head_dim": 16},
    "Gemma3ForCausalLM": {**_C, "num_key_value_heads": 2, "head_dim": 16},
    "PhiForCausalLM": {**_C, "num_key_value_heads": 4},
    "BertForMaskedLM": dict(_C),
    "T5ForConditionalGeneration": {"num_layers": 2, "d_model": H, "num_heads": 4, "d_kv": 16, "d_ff": F,
                                   "vocab_size": V, "decoder_start_token_id": 0, "pad_token_id": 0},
    "ViTForImageClassification": {"num_hidden_layers": 2, "hidden_size": H, "num_attention_heads": 4,
                                  "intermediate_size": F, "image_size": 32, "patch_size": 8, "num_labels": 10},
    # named in issue 27
    "GPTJForCausalLM": {"n_layer": 2, "n_embd": H, "n_head": 4, "vocab_size": V, "n_positions": 64, "rotary_dim": 8,
                        **_IDS},
    "CohereForCausalLM": {**_C, "num_key_value_heads": 2, **_IDS},
    "BloomForCausalLM": {"n_layer": 2, "hidden_size": H, "n_head": 4, "vocab_size": V, **_IDS},
    "Llama4ForCausalLM": {**_C, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
                          "intermediate_size_mlp": F, "interleave_moe_layer_step": 1, **_IDS},
    "DeepseekV3ForCausalLM": {**_C, "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
                              "moe_intermediate_size": 32, "first_k_dense_replace": 1, "kv_lora_rank": 16,
                              "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
                              "n_group": 1, "topk_group": 1, **_IDS},
    "MambaForCausalLM": {"num_hidden_layers": 2, "hidden_size": H, "vocab_size": V, "state_size": 8, "expand": 2,
                         "intermediate_size": 2 * H,
                         "conv_kernel": 4, **_IDS},
    "WhisperForConditionalGeneration": {**_ENC_DEC, "num_mel_bins": 16, "max_source_positions": 16,
                                        "max_target_positions": 32, "begin_suppress_tokens": None,
                                        "suppress_tokens": None},
    "GPTBigCodeForCausalLM": {"n_layer": 2, "n_embd": H, "n_head": 4, "vocab_size": V, "n_positions": 64,
                              "multi_query": True, **_IDS},
    "Qwen3MoeForCausalLM": {**_C, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 4,
                            "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    # others in transformers
    "Qwen3ForCausalLM": {**_C, "num_key_value_heads": 2, "head_dim": 16},
    "Phi3ForCausalLM": {**_C, "num_key_value_heads": 4, **_IDS},
    "OPTForCausalLM": {"num_hidden_layers": 2, "hidden_size": H, "num_attention_heads": 4, "ffn_dim": F,
                       "vocab_size": V, "max_position_embeddings": 64, "word_embed_proj_dim": H, **_IDS},
    "GPTNeoXForCausalLM": {**_C, **_IDS},
    "FalconForCausalLM": {"num_hidden_layers": 2, "hidden_size": H, "num_attention_heads": 4, "vocab_size": V,
                          **_IDS},
    "StableLmForCausalLM": {**_C, "num_key_value_heads": 4, **_IDS},
    "OlmoForCausalLM": {**_C, "num_key_value_heads": 4, **_IDS},
    "Olmo2ForCausalLM": {**_C, "num_key_value_heads": 4, **_IDS},
    "Starcoder2ForCausalLM": {**_C, "num_key_value_heads": 2, **_IDS},
    "MptForCausalLM": {"n_layers": 2, "d_model": H, "n_heads": 4, "vocab_size": V, "max_seq_len": 64},
    "GraniteForCausalLM": {**_C, "num_key_value_heads": 2, **_IDS},
    "Qwen2MoeForCausalLM": {**_C, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
                            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64},
    "GPTNeoForCausalLM": {"num_layers": 2, "hidden_size": H, "num_heads": 4, "vocab_size": V,
                          "max_position_embeddings": 64, "attention_types": [[["global", "local"], 1]],
                          "window_size": 8, **_IDS},
    "CodeGenForCausalLM": {"n_layer": 2, "n_embd": H, "n_head": 4, "vocab_size": V, "n_positions": 64,
                           "rotary_dim": 8, **_IDS},
    "RobertaForMaskedLM": {**_C, "max_position_embeddings": 64, "pad_token_id": 1},
    "DistilBertForMaskedLM": {"n_layers": 2, "dim": H, "n_heads": 4, "hidden_dim": F, "vocab_size": V,
                              "max_position_embeddings": 64},
    "ElectraForMaskedLM": {**_C, "embedding_size": H},
    "BartForConditionalGeneration": {**_ENC_DEC, "max_position_embeddings": 64},
}


def _short(msg: str, n: int = 150) -> str:
    msg = " ".join(str(msg).split())
    msg = re.sub(r"/[^ ]*/site-packages/", "", msg)
    return msg if len(msg) <= n else msg[: n - 3] + "..."


def _layer_counts(plan: Any) -> tuple[str, float, list[str]]:
    """tp collectives of the first transformer layer, forward / backward (``2 / 2``), the share
    of parameter elements replicated over tp, and the first layer's matrices left replicated."""
    names = plan.mesh.dim_names
    ops = plan.program.ops
    per: dict[tuple[str, str], Counter[str]] = {}
    for r, st in [*plan.collectives("forward"), *plan.collectives("backward")]:
        if not any(names[d] == "tp" for d in st.mesh_dims):
            continue
        op = ops[r.op_index]
        per.setdefault((op.layer or "", op.phase), Counter())[st.kind] += 1
    layers = sorted({op.layer for op in ops if op.layer and re.search(r"\d", op.layer)},
                    key=lambda s: ([int(x) for x in re.findall(r"\d+", s)], s))
    first = layers[0] if layers else ""

    def say(phase: str) -> str:
        c = per.get((first, phase), Counter())
        return " + ".join(f"{v} {k.replace('all_reduce', 'AR').replace('all_gather', 'AG').replace('reduce_scatter', 'RS')}"
                          for k, v in sorted(c.items())) or "0"

    tp = names.index("tp")
    params = [t for t in plan.program.tensors.values() if t.kind == "parameter"]
    total = sum(max(1, _numel(t.shape)) for t in params)
    repl = [t for t in params if tp not in plan.attrs[t.name].dims_mapping]
    share = sum(max(1, _numel(t.shape)) for t in repl) / total if total else 0.0
    digits = re.findall(r"\d+", first)
    mark = f".{digits[0]}." if digits else None
    left = sorted({re.sub(r"\.(weight|bias|new)\b.*$", "", t.name.split(mark, 1)[1]) for t in repl
                   if mark and mark in t.name and len(t.shape) >= 2})
    return f"{say('forward')} / {say('backward')}", share, left


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def one(cls: str, cfg: dict[str, Any], run: bool) -> dict[str, Any]:
    """The row of one class."""
    import torch

    from spmdkit.core.errors import SpmdError
    from spmdkit.models.hf import import_hf
    from spmdkit.models.torch_import import torch_values
    from spmdkit.planner.planning import plan_program
    from spmdkit.sim.plan import simulate_plan

    row: dict[str, Any] = {"class": cls, "imports": "", "megatron": "", "replicated": "", "verify": "", "run": "",
                           "why": ""}
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prog, model, kw = import_hf(cls, cfg, batch=B, seq=S, fallback="error")
    except (SpmdError, Exception) as exc:
        row["imports"] = "no"
        row["why"] = _short(f"{type(exc).__name__}: {exc}")
        return row
    row["imports"] = f"yes ({len(prog.ops)} ops, {time.perf_counter() - t0:.1f} s)"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _p, plan = plan_program(prog, "dp=2,tp=2", "megatron")
        counts, repl, left = _layer_counts(plan)
        row["megatron"], row["replicated"] = counts, f"{100 * repl:.0f}%"
        if left:
            row["why"] = _short("megatron leaves replicated: " + ", ".join(left), 120)
    except Exception as exc:
        row["megatron"] = "no"
        row["why"] = _short(f"megatron: {type(exc).__name__}: {exc}")
        return row
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rep = simulate_plan(plan, values=torch_values(plan.program, model, (), kw), rtol=1e-6, atol=1e-9)
        row["verify"] = "ok" if rep.ok else f"{len(rep.failures)} differ"
        if not rep.ok:
            row["why"] = _short(f"verify: {rep.failures[0]}; {row['why']}")
    except Exception as exc:
        row["verify"] = "error"
        row["why"] = _short(f"verify: {type(exc).__name__}: {exc}")
    if run:
        row.update(_run(cls, cfg, row["why"]))
    return row


def _run(cls: str, cfg: dict[str, Any], why: str) -> dict[str, Any]:
    """``spmdkit run`` of the class on 4 gloo processes: its verdict (the first failure joins
    ``why``)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    cmd = [sys.executable, "-m", "spmdkit", "run", "--hf", cls, "--hf-config", json.dumps(cfg), "--mesh", "dp=2,tp=2",
           "--nproc", "4", "--json", "--timeout", "240"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    except subprocess.TimeoutExpired:
        return {"run": "timed out", "why": _join(why, "run: timed out after 900 s")}
    last = (p.stdout.strip().splitlines() or [""])[-1]
    try:
        rep = json.loads(last)
    except json.JSONDecodeError:
        err = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"run": f"exit {p.returncode}", "why": _join(why, _short(f"run: {err}"))}
    eager = rep.get("eager") or {}
    if rep.get("ok"):
        return {"run": f"ok (eager {eager.get('max_rel_error', 0):.1e})"}
    first = (rep.get("failures") or [["?", "?"]])[0]
    return {"run": f"{len(rep.get('failures') or [])} fail", "why": _join(why, _short(f"run: {first[0]}: {first[1]}"))}


def _join(a: str, b: str) -> str:
    return f"{b}; {a}" if a else b


COLUMNS = ("class", "imports", "megatron", "replicated", "verify", "run", "why")
HEAD = ("class", "imports (training step)", "megatron tp collectives, layer 0 (fwd / bwd)",
        "params replicated over tp", "verify", "spmdkit run (gloo, 4 ranks)", "what fails and why")


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(c, "")).replace("|", "\\|") for c in COLUMNS) + " |")
    return "\n".join(out)


def write_docs(text: str) -> None:
    path = ROOT / "docs" / "torch.md"
    doc = path.read_text(encoding="utf-8")
    start, end = "<!-- hf-classes:start -->", "<!-- hf-classes:end -->"
    if start not in doc:
        raise SystemExit(f"{path}: no {start} marker")
    head, rest = doc.split(start, 1)
    _old, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{text}\n{end}{tail}", encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--classes", help="comma list of classes (or substrings); default all")
    ap.add_argument("--no-run", action="store_true", help="skip spmdkit run (the slow part: ~20 s a class)")
    ap.add_argument("--write-docs", action="store_true", help="write the table into docs/torch.md")
    ap.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    a = ap.parse_args()
    want = [c.strip() for c in a.classes.split(",")] if a.classes else None
    rows = []
    for cls, cfg in CLASSES.items():
        if want and not any(w.lower() in cls.lower() for w in want):
            continue
        t0 = time.perf_counter()
        row = one(cls, cfg, not a.no_run)
        rows.append(row)
        print(f"{cls}: {row} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        if a.json:  # row by row: a long sweep's rows so far survive an interruption
            Path(a.json).write_text(json.dumps(rows, indent=1), encoding="utf-8")
    text = table(rows)
    print(text)
    if a.write_docs:
        write_docs(text)


if __name__ == "__main__":
    main()
