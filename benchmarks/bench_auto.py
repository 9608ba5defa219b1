#!/usr/bin/env python3
"""The exact sharding search (``plan --auto``) against the hand strategies, on predicted step time.

    python benchmarks/bench_auto.py [--sections speed,quality,hf] [--time-limit 60] [--row-timeout 300]

Every cost is the same model's: the plan re-timed by the device's links and
``compute.estimate_step(...).step_overlap_s`` (compute + communication, the gradient
reductions overlapping the backward) on ``--device`` (h100). The search gets no pins: it
chooses every tensor's sharding itself, the batch split included. "best hand" is the fastest
of dp, dp+zero1/2/3, megatron (= dp,megatron), megatron+sp and megatron(+sp)+zero2 on the
same mesh. "auto / hand" < 1: the search wins.

Sections:

- ``speed``: zoo llama (``--model``, llama-7b) cut to ``--layers`` (8,16,32,80) on dp=2 x tp=4:
  ops, the search's wall time (candidates + model + solve + realisation), HiGHS's solve time,
  status and gap (``--time-limit`` each), the auto plan's step and the best hand strategy's.
- ``quality``: zoo llama-7b and gpt2-small cut to ``--quality-layers`` (2) on 8 devices
  (dp=2 x tp=4) and 64 devices (dp=8 x tp=8).
- ``hf``: the 12 tiny HuggingFace models of tests/test_hf.py (2 layers, hidden 64, batch 2,
  seq 16; needs torch and transformers) on dp=2 x tp=2, no pins.

Each search runs in a child process killed after ``--row-timeout`` seconds (the candidate
generation is not bounded by HiGHS's time limit); such a row says "timed out".
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from spmdkit.core.errors import SpmdError
from spmdkit.cost.compute import guess_tokens
from spmdkit.cost.devices import cost_model, preset_device, recost
from spmdkit.cost.step import estimate_step
from spmdkit.strategies.strategy import parse_mesh

HAND = ["dp", "dp,zero1", "dp,zero2", "dp,zero3", "megatron", "megatron,sp", "megatron,zero2", "megatron,sp,zero2"]


def _step(plan: Any, device: Any, tokens: int | None) -> float:
    plan = recost(plan, cost_model(plan.mesh, device))
    return float(estimate_step(plan, device, tokens).step_overlap_s)


def hand_zoo(name: str, layers: int, mesh: str, device: Any) -> tuple[str, float]:
    from spmdkit.planner.planning import plan_model

    best = ("-", float("inf"))
    for s in HAND:
        try:
            model, plan, _ = plan_model(name, mesh, s, {"layers": layers})
        except SpmdError:
            continue
        c = model.config
        t = _step(plan, device, c.batch * c.seq)
        if t < best[1]:
            best = (s, t)
    return best


def hand_program(prog: Any, mesh: str, device: Any) -> tuple[str, float]:
    from spmdkit.planner.planning import plan_program

    best = ("-", float("inf"))
    for s in HAND:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                p2, plan = plan_program(prog, mesh, s)
        except SpmdError:
            continue
        t = _step(plan, device, guess_tokens(p2))
        if t < best[1]:
            best = (s, t)
    return best


def _auto(prog: Any, mesh_text: str, device: Any, time_limit: float, tokens: int | None) -> dict[str, Any]:
    from spmdkit.planner.auto import auto_plan

    mesh = parse_mesh(mesh_text)
    t0 = time.perf_counter()
    plan, info = auto_plan(prog, mesh, None, cost=cost_model(mesh, device), time_limit=time_limit, device=device)
    wall = time.perf_counter() - t0
    return {"wall": wall, "solve": info.solve_s, "status": info.status, "gap": info.gap,
            "step": _step(plan, device, tokens), "realized": info.realized, "candidates": info.candidates}


def auto_zoo(name: str, layers: int, mesh: str, device: Any, time_limit: float) -> dict[str, Any]:
    from spmdkit.models.zoo import build_model, preset

    cfg = preset(name).with_(layers=layers)
    prog = build_model(cfg, vocab_parallel_loss=True, check_rules=False).program
    out = _auto(prog, mesh, device, time_limit, cfg.batch * cfg.seq)
    out["ops"] = len(prog.ops)
    return out


def auto_program(prog: Any, mesh: str, device: Any, time_limit: float) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = _auto(prog, mesh, device, time_limit, guess_tokens(prog))
    out["ops"] = len(prog.ops)
    return out


def _child(q: Any, fn: Any, args: tuple[Any, ...]) -> None:
    try:
        q.put(fn(*args))
    except Exception as exc:  # a row's failure is reported in its row
        q.put({"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}"})


def in_child(fn: Any, args: tuple[Any, ...], timeout: float) -> dict[str, Any]:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q, fn, args))
    t0 = time.perf_counter()
    p.start()
    try:
        res: dict[str, Any] = q.get(timeout=timeout)
    except queue.Empty:
        res = {"error": f"timed out after {time.perf_counter() - t0:.0f} s"}
    p.join(5)
    if p.is_alive():
        p.kill()
        p.join()
    return res


def _fmt_ms(s: float) -> str:
    return "-" if s != s or s == float("inf") else f"{s * 1e3:.3f}"


def row_text(label: str, res: dict[str, Any], hand: tuple[str, float], ops: int | None = None) -> list[str]:
    if "error" in res:
        return [label, str(ops or "-"), res["error"], "", "", "", "-", hand[0], _fmt_ms(hand[1]), "-"]
    ratio = res["step"] / hand[1] if hand[1] not in (0.0, float("inf")) else float("nan")
    return [label, str(res.get("ops", ops or "-")), f"{res['wall']:.1f}", f"{res['solve']:.1f}",
            f"{res['status']}", f"{100 * res['gap']:.1f}%", _fmt_ms(res["step"]), hand[0], _fmt_ms(hand[1]),
            f"{ratio:.3f}"]


HEAD = ["model", "ops", "auto s", "solve s", "HiGHS", "gap", "auto step ms", "best hand", "hand step ms",
        "auto / hand"]


def print_table(title: str, rows: list[list[str]]) -> None:
    w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(HEAD)]
    print(f"\n{title}")
    print("| " + " | ".join(h.ljust(w[i]) for i, h in enumerate(HEAD)) + " |")
    print("|" + "|".join("-" * (x + 2) for x in w) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |")
    sys.stdout.flush()


def hf_models() -> dict[str, tuple[str, dict[str, Any]]]:
    """The 12 tiny configs of tests/test_hf.py: class name -> config dict."""
    common = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
              "vocab_size": 256, "max_position_embeddings": 64}
    return {
        "gpt2": ("GPT2LMHeadModel", {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": 64,
                                     "bos_token_id": 0, "eos_token_id": 0}),
        "llama": ("LlamaForCausalLM", {"num_key_value_heads": 2, **common}),
        "mistral": ("MistralForCausalLM", {"num_key_value_heads": 2, **common}),
        "qwen2": ("Qwen2ForCausalLM", {"num_key_value_heads": 1, **common}),
        "mixtral": ("MixtralForCausalLM", {"num_key_value_heads": 2, "num_local_experts": 4,
                                           "num_experts_per_tok": 2, **common}),
        "gemma": ("GemmaForCausalLM", {"num_key_value_heads": 1, "head_dim": 16, **common}),
        "gemma2": ("Gemma2ForCausalLM", {"num_key_value_heads": 2, "head_dim": 16, **common}),
        "gemma3": ("Gemma3ForCausalLM", {"num_key_value_heads": 2, "head_dim": 16, **common}),
        "phi": ("PhiForCausalLM", {"num_key_value_heads": 4, **common}),
        "bert": ("BertForMaskedLM", dict(common)),
        "t5": ("T5ForConditionalGeneration", {"num_layers": 2, "d_model": 64, "num_heads": 4, "d_kv": 16,
                                              "d_ff": 128, "vocab_size": 256, "decoder_start_token_id": 0,
                                              "pad_token_id": 0}),
        "vit": ("ViTForImageClassification", {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                              "intermediate_size": 128, "image_size": 32, "patch_size": 8,
                                              "num_labels": 10}),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="speed,quality,hf")
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--layers", default="8,16,32,80")
    ap.add_argument("--mesh", default="dp=2,tp=4")
    ap.add_argument("--quality-layers", type=int, default=2)
    ap.add_argument("--hf-models", default=None, help="comma list of the hf section's models (default all 12)")
    ap.add_argument("--device", default="h100")
    ap.add_argument("--time-limit", type=float, default=60.0, help="HiGHS's time limit per search (s)")
    ap.add_argument("--row-timeout", type=float, default=300.0, help="wall-clock limit per search (s)")
    a = ap.parse_args()
    device = preset_device(a.device)
    sections = {s.strip() for s in a.sections.split(",")}
    print(f"device {device.name}; HiGHS time limit {a.time_limit:g} s; row timeout {a.row_timeout:g} s; "
          "steps: compute + communication with the gradient reductions overlapped (ms)")
    if "speed" in sections:
        rows = []
        for n in [int(x) for x in a.layers.split(",")]:
            hand = hand_zoo(a.model, n, a.mesh, device)
            res = in_child(auto_zoo, (a.model, n, a.mesh, device, a.time_limit), a.row_timeout)
            rows.append(row_text(f"{a.model} {n} layers", res, hand))
            print(f"  [speed] {rows[-1]}", file=sys.stderr)
        print_table(f"Speed: {a.model} by layers on {a.mesh}, no pins", rows)
    if "quality" in sections:
        rows = []
        for name in ("llama-7b", "gpt2-small"):
            for mesh in ("dp=2,tp=4", "dp=8,tp=8"):
                hand = hand_zoo(name, a.quality_layers, mesh, device)
                res = in_child(auto_zoo, (name, a.quality_layers, mesh, device, a.time_limit), a.row_timeout)
                rows.append(row_text(f"{name} {mesh}", res, hand))
                print(f"  [quality] {rows[-1]}", file=sys.stderr)
        print_table(f"Quality: zoo models cut to {a.quality_layers} layers, 8 and 64 devices, no pins", rows)
    if "hf" in sections:
        try:
            import torch  # noqa: F401  (imported before forking: the children inherit it)
            import transformers  # noqa: F401
        except ImportError:
            print("\nhf: skipped (needs torch and transformers)")
            return 0
        from spmdkit.planner.search import import_hf_program

        rows = []
        models = hf_models()
        names = a.hf_models.split(",") if a.hf_models else list(models)
        for name in names:
            cls, cfg = models[name]
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    prog = import_hf_program(cls, cfg, 2, 16)
            except SpmdError as exc:
                rows.append([name, "-", f"import: {str(exc)[:60]}", "", "", "", "-", "-", "-", "-"])
                continue
            hand = hand_program(prog, "dp=2,tp=2", device)
            res = in_child(auto_program, (prog, "dp=2,tp=2", device, a.time_limit), a.row_timeout)
            rows.append(row_text(name, res, hand, len(prog.ops)))
            print(f"  [hf] {rows[-1]}", file=sys.stderr)
        print_table("HuggingFace: the 12 tiny models of tests/test_hf.py on dp=2,tp=2, batch 2, seq 16, no pins", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
