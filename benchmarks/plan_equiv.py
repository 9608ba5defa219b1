#!/usr/bin/env python3
"""Plan equivalence: the plan JSON (``--json``) and the text report of a fixed set of ``spmdkit
plan`` commands, written to a folder, and two such folders compared (for speed work that must
not change an answer: propagation, per-op cost, memory).

    python benchmarks/plan_equiv.py snapshot OUT_DIR [--tree DIR] [--only SUBSTR]
    python benchmarks/plan_equiv.py compare A B

``snapshot`` runs every command of :data:`COMMANDS` through ``spmdkit.cli.main`` in one process
(so that memo tables and rule caches carry from one command to the next, as they would in a
long-lived process: a memo keyed too loosely shows up as a difference), with ``--tree``'s
``src`` first on the path (default: this checkout); each command's stdout goes to
``OUT_DIR/NN.json`` or ``NN.txt``. A command whose argv holds :data:`HTML` writes its ``--html``
page to ``OUT_DIR/NN.html`` (run from OUT_DIR, so the page's command line is the same in every
snapshot); it is compared byte for byte, but for the wall-clock figures. Wall-clock figures are
blanked (``plan_seconds``, "planned in X s", "solved in X s"). Every command is meant to plan:
``snapshot`` exits 1 naming those that did not (a refusal would compare only its message; three
pipeline commands had become refusals of their batch unnoticed). ``compare`` prints the commands
whose outputs differ and exits 1 if any does. The ``--hf`` commands need torch and transformers
(the imports of tiny configs: dense, GPT-2's fused projection, MoE routed whole and in tp chunks,
expert parallel, context parallel). Standard library only (but for what ``--hf`` imports).

``snapshot`` then runs :data:`EXPORTS` (``--export`` torch / dtensor / jax / paddle of presets and
tiny ``--hf`` Llama, Qwen2 tied, Qwen2-MoE, Gemma 3, DeepSeek-V3, Mixtral under tp, ep and etp=1,
pp, cp, fsdp; ``--export-recipe`` torchtitan / megatron / json of ``--devices`` searches; the
refusals among them; ``spmdkit run``'s checks before any rank starts), each in ``OUT_DIR/xNN/``
with its written files, and the recipe files of an uneven pipeline split and each precision
(``OUT_DIR/recipes.txt``). ``compare`` walks both folders.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_H = ["--device", "h100"]
_TINY = '{"vocab_size":128,"hidden_size":32,"intermediate_size":64,"num_hidden_layers":2,' \
        '"num_attention_heads":4,"num_key_value_heads":2}'
_LLAMA = '{"vocab_size":64,"hidden_size":32,"intermediate_size":64,"num_hidden_layers":2,' \
         '"num_attention_heads":4,"num_key_value_heads":2,"max_position_embeddings":64}'
_GPT2 = '{"n_layer":2,"n_embd":64,"n_head":4,"vocab_size":256,"n_positions":64,"bos_token_id":0,"eos_token_id":0}'
_MIXTRAL = '{"vocab_size":64,"hidden_size":32,"intermediate_size":64,"num_hidden_layers":2,"num_attention_heads":4,' \
           '"num_key_value_heads":2,"max_position_embeddings":64,"num_local_experts":4,"num_experts_per_tok":2}'
_QWEN3 = '{"vocab_size":64,"hidden_size":32,"intermediate_size":64,"num_hidden_layers":1,"num_attention_heads":4,' \
         '"num_key_value_heads":4,"max_position_embeddings":64,"num_experts":4,"num_experts_per_tok":2,' \
         '"moe_intermediate_size":32,"norm_topk_prob":true}'
_DEEPSEEK = '{"vocab_size":64,"hidden_size":32,"intermediate_size":64,"moe_intermediate_size":32,' \
            '"num_hidden_layers":2,"first_k_dense_replace":1,"num_attention_heads":4,"num_key_value_heads":4,' \
            '"n_routed_experts":4,"n_shared_experts":1,"num_experts_per_tok":2,"n_group":1,"topk_group":1,' \
            '"q_lora_rank":16,"kv_lora_rank":16,"qk_rope_head_dim":8,"qk_nope_head_dim":8,"v_head_dim":8,' \
            '"max_position_embeddings":64}'
#: the argv word replaced by ``NN.html`` (``--html`` written to the snapshot's folder)
HTML = "@HTML"
_P = ["--html", HTML]


def _hf(cls: str, config: str, mesh: str, strategy: str, *more: str, batch: int = 4, page: bool = False) -> list[str]:
    """``--hf CLS`` of a tiny ``config`` on ``mesh`` and ``strategy``, 16 tokens a sequence, on an
    H100; ``page``: with ``--html``."""
    return ["--hf", cls, "--hf-config", config, "--mesh", mesh, "--strategy", strategy, *more, "--seq", "16",
            "--batch", str(batch), *_H, *(_P if page else [])]


#: (label, argv after ``plan``); each is run with ``--json`` and without
COMMANDS: list[tuple[str, list[str]]] = [
    ("preset llama-7b dp2 tp4", ["--model", "llama-7b", "--mesh", "dp=2,tp=4", "--strategy", "megatron", *_H]),
    ("preset gpt-small sp zero1", ["--model", "gpt2-small", "--mesh", "dp=4,tp=2", "--strategy", "megatron,sp,zero1",
                                   "--device", "a100-80gb"]),
    ("preset llama-70b zero3 recompute", ["--model", "llama-70b", "--layers", "4", "--mesh", "dp=8,tp=8",
                                          "--strategy", "megatron,zero3", "--recompute", "selective", *_H]),
    ("preset llama-70b grad-accum no device", ["--model", "llama-70b", "--layers", "6", "--mesh", "dp=4,tp=8",
                                               "--strategy", "megatron", "--grad-accum", "2"]),
    ("405b pp16 dp8 tp8", ["--model", "llama3.1-405b", "--mesh", "pp=16,dp=8,tp=8", "--strategy", "megatron", *_H]),
    ("deepseek-v3 dp8 tp8", ["--model", "deepseek-v3", "--mesh", "dp=8,tp=8", "--strategy", "megatron", *_H]),
    ("deepseek-v2-lite pp2 sp", ["--model", "deepseek-v2-lite", "--mesh", "pp=2,dp=2,tp=4",
                                 "--strategy", "megatron,sp,zero1", "--microbatches", "4", "--batch", "8", *_H]),
    ("mixtral-8x7b dp4 tp8 recompute full", ["--model", "mixtral-8x7b", "--mesh", "dp=4,tp=8", "--strategy",
                                             "megatron,sp", "--recompute", "full", *_H]),
    ("qwen3-30b-a3b pp4", ["--model", "qwen3-30b-a3b", "--mesh", "pp=4,dp=2,tp=4", "--strategy", "megatron",
                           "--schedule", "interleaved", "--microbatches", "8", "--batch", "16", "--layers", "16", *_H]),
    ("bloom-176b gemma2 style dp tp", ["--model", "bloom-176b", "--layers", "4", "--mesh", "dp=2,tp=8",
                                       "--strategy", "megatron", *_H]),
    ("gemma2-9b tp2", ["--model", "gemma2-9b", "--mesh", "dp=4,tp=2", "--strategy", "megatron", *_H]),
    ("gpt3-175b pp8 gpipe", ["--model", "gpt3-175b", "--mesh", "pp=8,dp=4,tp=8", "--strategy", "megatron",
                             "--schedule", "gpipe", "--microbatches", "16", "--batch", "64", *_H]),
    ("hf tiny llama", ["--hf", "LlamaForCausalLM", "--hf-config", _TINY, "--mesh", "dp=2,tp=2",
                       "--strategy", "megatron", *_H]),
    ("hf tiny llama pp2", ["--hf", "LlamaForCausalLM", "--hf-config", _TINY, "--mesh", "pp=2,tp=2",
                           "--strategy", "megatron"]),
    ("auto small", ["--model", "gpt2-small", "--layers", "2", "--mesh", "dp=2,tp=2", "--auto", *_H]),
    # --html pages (outputs/html.py): the page, the cards, the step and memory figures, a pipeline's
    ("html llama-7b dp2 tp4", ["--model", "llama-7b", "--layers", "4", "--mesh", "dp=2,tp=4", "--strategy",
                               "megatron,sp,zero1", "--recompute", "selective", *_H, *_P]),
    ("html no device grad-accum nodes-of", ["--model", "gpt2-small", "--layers", "2", "--mesh", "dp=4,tp=2",
                                            "--strategy", "megatron,zero3", "--grad-accum", "2", "--nodes-of",
                                            "4", *_P]),
    ("html pipeline 1f1b", ["--model", "llama-70b", "--layers", "8", "--mesh", "pp=4,dp=2,tp=4", "--strategy",
                            "megatron", "--microbatches", "8", "--recompute", "full", *_H, *_P]),
    ("html pipeline interleaved moe", ["--model", "qwen3-30b-a3b", "--mesh", "pp=4,dp=2,tp=4", "--strategy",
                                       "megatron", "--schedule", "interleaved", "--microbatches", "8", "--layers",
                                       "16", "--batch", "16", *_H, *_P]),
    ("html auto explain", ["--model", "gpt2-small", "--layers", "2", "--mesh", "dp=2,tp=2", "--auto", "--explain",
                           *_H, *_P]),
    # --hf imports (strategies/hf.py): dense, fused, user patterns, MoE (whole, tp chunks, ep), cp
    ("hf llama sp zero1 html", _hf("LlamaForCausalLM", _LLAMA, "dp=2,tp=2", "megatron,sp,zero1", page=True)),
    ("hf llama tp4 kv replicated zero3", _hf("LlamaForCausalLM", _LLAMA, "dp=2,tp=4", "megatron,zero3")),
    ("hf gpt2 fused c_attn sp", _hf("GPT2LMHeadModel", _GPT2, "dp=2,tp=2", "megatron,sp")),
    ("hf gpt2 tp-plan", _hf("GPT2LMHeadModel", _GPT2, "dp=2,tp=2", "megatron", "--tp-plan",
                            '{"c_attn": "replicate", "attn.c_proj": "replicate"}')),
    ("hf mixtral sp", _hf("MixtralForCausalLM", _MIXTRAL, "dp=2,tp=2", "megatron,sp")),
    ("hf mixtral ep etp=1 sp", _hf("MixtralForCausalLM", _MIXTRAL, "ep=2,tp=2", "megatron,sp,ep,etp=1", batch=8)),
    ("hf qwen3 moe dp ep", _hf("Qwen3MoeForCausalLM", _QWEN3, "dp=2,ep=2", "dp,ep")),
    ("hf deepseek-v3 megatron sp", _hf("DeepseekV3ForCausalLM", _DEEPSEEK, "dp=2,tp=2", "megatron,sp")),
    ("hf llama cp tp sp", _hf("LlamaForCausalLM", _LLAMA, "cp=2,tp=2", "megatron,sp,cp", batch=2)),
    ("hf mixtral cp ep-from=cp", _hf("MixtralForCausalLM", _MIXTRAL, "cp=2,ep=2", "cp,ep,ep-from=cp", batch=2)),
    ("hf mixtral cp tp sp", _hf("MixtralForCausalLM", _MIXTRAL, "cp=2,tp=2", "megatron,sp,cp", batch=2)),
]

_Q2MOE = '{"vocab_size":256,"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,' \
         '"num_key_value_heads":2,"max_position_embeddings":64,"moe_intermediate_size":32,' \
         '"shared_expert_intermediate_size":64,"num_experts":4,"num_experts_per_tok":2}'
_GEMMA3 = '{"vocab_size":256,"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,' \
          '"num_key_value_heads":2,"max_position_embeddings":64,"head_dim":16}'
_QWEN2_TIED = '{"vocab_size":256,"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,' \
              '"num_attention_heads":4,"num_key_value_heads":2,"max_position_embeddings":64,"tie_word_embeddings":true}'
def _hfx(cls: str, config: str, mesh: str, strategy: str, *more: str, batch: int = 4) -> list[str]:
    return ["plan", *_hf(cls, config, mesh, strategy, *more, batch=batch)]


#: the argv word replaced by the command's export file name (``--export KIND @OUT.KIND``)
OUT = "@OUT"


def _ex(kind: str) -> list[str]:
    return ["--export", kind, f"{OUT}.{kind}"]


_SEARCH = ["--model", "llama3-8b", "--layers", "2", "--seq", "512", "--devices", "8", "--recompute", "full",
           "--global-batch", "64", "--micro-batch", "2", "--strategy", "megatron,sp,zero1"]
#: (label, argv after ``spmdkit``): the exports (``--export`` torch / dtensor / jax / paddle and
#: ``--export-recipe``), each run in a folder of its own with ``--json``: the plan, every file the
#: command wrote, its messages; refusals (exit != 0) are expected among them and compared as such
EXPORTS: list[tuple[str, list[str]]] = [
    *[(f"preset tiny-llama megatron {k}", ["plan", "--model", "tiny-llama", "--mesh", "dp=2,tp=2", "--strategy",
                                           "megatron", *_H, *_ex(k)]) for k in ("torch", "dtensor", "jax", "paddle")],
    ("preset mixtral ep torch", ["plan", "--model", "mixtral-8x7b", "--layers", "2", "--mesh", "dp=2,ep=2,tp=2",
                                 "--strategy", "megatron,ep", *_H, *_ex("torch")]),
    *[(f"hf llama megatron {k}", _hfx("LlamaForCausalLM", _TINY, "dp=2,tp=2", "megatron", *_ex(k)))
      for k in ("torch", "dtensor", "jax", "paddle")],
    *[(f"hf llama megatron,sp {k}", _hfx("LlamaForCausalLM", _TINY, "dp=2,tp=2", "megatron,sp", *_ex(k)))
      for k in ("torch", "dtensor")],
    ("hf llama fsdp torch", _hfx("LlamaForCausalLM", _TINY, "dp=4", "fsdp", *_ex("torch"))),
    ("hf llama pp2 tp2 torch", _hfx("LlamaForCausalLM", _TINY, "pp=2,tp=2", "megatron", "--microbatches", "2",
                                   *_ex("torch"))),
    *[(f"hf llama cp tp sp {k}", _hfx("LlamaForCausalLM", _LLAMA, "cp=2,tp=2", "megatron,sp,cp", *_ex(k), batch=2))
      for k in ("torch", "dtensor")],
    *[(f"hf qwen2 tied {k}", _hfx("Qwen2ForCausalLM", _QWEN2_TIED, "dp=2,tp=2", "megatron", *_ex(k)))
      for k in ("torch", "dtensor")],
    *[(f"hf qwen2-moe megatron {k}", _hfx("Qwen2MoeForCausalLM", _Q2MOE, "dp=2,tp=2", "megatron", *_ex(k)))
      for k in ("torch", "dtensor", "jax")],
    ("hf qwen2-moe megatron,sp torch", _hfx("Qwen2MoeForCausalLM", _Q2MOE, "dp=2,tp=2", "megatron,sp", *_ex("torch"))),
    *[(f"hf gemma3 {s} {k}", _hfx("Gemma3ForCausalLM", _GEMMA3, "dp=2,tp=2", s, *_ex(k)))
      for s in ("megatron", "megatron,sp") for k in ("torch", "dtensor")],
    *[(f"hf deepseek-v3 megatron {k}", _hfx("DeepseekV3ForCausalLM", _DEEPSEEK, "dp=2,tp=2", "megatron", *_ex(k)))
      for k in ("torch", "dtensor", "paddle")],
    *[(f"hf mixtral {m} {s} {k}", _hfx("MixtralForCausalLM", _MIXTRAL, m, s, *_ex(k), batch=8))
      for m, s in (("dp=2,tp=2", "megatron"), ("dp=2,ep=2", "dp,ep"), ("ep=2,tp=2", "megatron,sp,ep,etp=1"))
      for k in ("torch", "dtensor")],
    ("hf gpt2 dtensor refused", _hfx("GPT2LMHeadModel", _GPT2, "dp=2,tp=2", "megatron", *_ex("dtensor"))),
    ("hf gpt2 tp-plan torch", _hfx("GPT2LMHeadModel", _GPT2, "dp=2,tp=2", "megatron", "--tp-plan",
                                  '{"c_attn": "replicate", "attn.c_proj": "replicate"}', *_ex("torch"))),
    ("export bad kind", ["plan", "--model", "tiny-llama", "--mesh", "dp=2", "--strategy", "dp", "--export", "onnx",
                         "x.json"]),
    ("export no folder", ["plan", "--model", "tiny-llama", "--mesh", "dp=2", "--strategy", "dp", "--export", "jax",
                          "no/such/x.json"]),
    *[(f"recipe {k}", ["plan", *_SEARCH, "--export-recipe", k, f"{OUT}.{k}"]) for k in ("torchtitan", "megatron",
                                                                                        "json")],
    *[(f"recipe fp8 torchtitan {k}", ["plan", *_SEARCH, "--precision", "fp8", "--framework", "torchtitan",
                                      "--export-recipe", k, f"{OUT}.{k}"]) for k in ("torchtitan", "json")],
    ("recipe moe megatron", ["plan", "--model", "mixtral-8x7b", "--layers", "2", "--seq", "512", "--devices", "8",
                             "--global-batch", "64", "--device", "h100", "--export-recipe", "megatron",
                             f"{OUT}.megatron"]),
    ("recipe without devices", ["plan", "--model", "tiny-llama", "--mesh", "dp=2", "--export-recipe", "json",
                                "r.json"]),
    # spmdkit run's checks before any rank starts (refusals only: nothing is launched)
    ("run device", ["run", "--model", "tiny-llama", "--mesh", "dp=2", "--strategy", "dp", "--device", "tpu9"]),
    ("run kernels", ["run", "--kernels", "torch", "--program", "@CUMMAX", "--mesh", "dp=2", "--annotate",
                     "x=[0,-1]"]),
    ("run warmup", ["run", "--model", "tiny-llama", "--mesh", "dp=2", "--strategy", "dp", "--warmup", "-1"]),
    ("run pp", ["run", "--model", "tiny-llama", "--mesh", "pp=2", "--strategy", "dp"]),
]

_BLANK = [(re.compile(r"planned in [0-9.]+ s"), "planned in X s"),
          (re.compile(r"solved? (in )?[0-9.]+ s"), "solve X s"),
          (re.compile(r'"(\w+_seconds)": [0-9.eE+-]+'), r'"\1": 0'),
          (re.compile(r"^(plan --devices .*)\([0-9.]+ s\)$", re.M), r"\1(X s)"),
          (re.compile(r'"seconds": [0-9.eE+-]+'), '"seconds": 0')]


def _normal(text: str) -> str:
    for pat, rep in _BLANK:
        text = pat.sub(rep, text)
    return text


def snapshot(out_dir: Path, tree: Path, only: str | None) -> int:
    sys.path.insert(0, str(tree / "src"))
    from spmdkit.cli import main  # the tree under test

    out_dir.mkdir(parents=True, exist_ok=True)
    k = 0
    refused: list[str] = []
    for label, argv in COMMANDS:
        for as_json in (True, False):
            k += 1
            if only and only not in label:
                continue
            buf, err = io.StringIO(), io.StringIO()
            args = [f"{k:02d}.html" if a == HTML else a for a in argv]
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err), contextlib.chdir(out_dir):
                try:
                    rc = main(["plan", *args, *(["--json"] if as_json else [])])
                except SystemExit as exc:
                    rc = exc.code
            if as_json:  # key order and float text as written; checked to parse
                for line in buf.getvalue().splitlines():
                    json.loads(line)
            text = _normal(buf.getvalue())
            (out_dir / f"{k:02d}.{'json' if as_json else 'txt'}").write_text(
                f"# {label}: plan {' '.join(args)}{' --json' if as_json else ''} -> exit {rc}\n{text}"
                f"# stderr\n{_normal(err.getvalue())}")
            print(f"{k:02d} exit {rc} {label}{' --json' if as_json else ''}", flush=True)
            if rc:
                refused.append(f"{k:02d} {label}")
    _exports(out_dir, only)
    if refused:  # every command is meant to plan: a refusal compares only its message
        print(f"{len(refused)} commands did not plan (exit != 0): {', '.join(refused)}", file=sys.stderr)
        return 1
    return 0


def _cummax_program(path: Path) -> None:
    """A program whose one op (cummax) has no torch kernel (``run --kernels torch`` refuses it)."""
    from spmdkit.program.ir import ProgramBuilder

    b = ProgramBuilder("t")
    x = b.tensor("x", (4, 3), "float32", "input")
    b.op("cummax", {"x": x}, [("m", (4, 3), "float32"), ("i", (4, 3), "int64")], axis=0)
    path.write_text(b.build().dumps())


def _exports(out_dir: Path, only: str | None) -> None:
    """:data:`EXPORTS`, each in ``OUT_DIR/xNN/`` (its files there, ``OUT.*``), with ``--json`` for
    ``plan``; its exit status, stdout and stderr in ``xNN/run.txt``. Then :func:`_recipes`."""
    from spmdkit.cli import main

    for k, (label, argv) in enumerate(EXPORTS, 1):
        if only and only not in label:
            continue
        folder = out_dir / f"x{k:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        if "@CUMMAX" in argv:
            _cummax_program(folder / "cummax.json")
        args = ["OUT" + a[len(OUT):] if a.startswith(OUT) else "cummax.json" if a == "@CUMMAX" else a for a in argv]
        if args[0] == "plan":
            args.append("--json")
        buf, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err), contextlib.chdir(folder):
            try:
                rc = main(args)
            except SystemExit as exc:
                rc = exc.code
        (folder / "run.txt").write_text(f"# {label}: spmdkit {' '.join(args)} -> exit {rc}\n"
                                        f"{_normal(buf.getvalue())}# stderr\n{_normal(err.getvalue())}")
        print(f"x{k:02d} exit {rc} {label}", flush=True)
    if not only or "recipe" in only:
        _recipes(out_dir / "recipes.txt")


def _recipes(path: Path) -> None:
    """The recipe files of configurations the search does not reach from the command line: an uneven
    pipeline split (Megatron-LM's layout, torchtitan's split points) and the precisions (bf16, fp8, fp32)."""
    from spmdkit.outputs.recipe import megatron_args, recipe, recipe_warning, torchtitan_toml
    from spmdkit.planner.search import Config, config_candidates
    from spmdkit.program.runtime import Runtime

    out = []
    for model, cf, over, rt in (("llama3-8b", Config(1, 1, 4, "dp", microbatches=4), (6, 4, 256), None),
                                ("llama3-8b", Config(2, 1, 2, "dp", microbatches=4), (4, 8, 256), None),
                                ("llama3-8b", Config(2, 1, 1, "dp"), (2, 4, 64), Runtime(precision="fp8")),
                                ("tiny-llama", Config(2, 1, 1, "dp,zero3"), (2, 4, 64), None)):
        layers, batch, seq = over
        c = next(x for x in config_candidates(model, cf, overrides={"layers": layers, "batch": batch, "seq": seq},
                                              runtime=rt) if x.config.recompute == "none")
        r = recipe(c, model, batch, seq, layers)
        out += [f"# {model} {cf}", json.dumps(r, sort_keys=True, default=str), megatron_args(r), torchtitan_toml(r),
                str(recipe_warning("torchtitan", r)), str(recipe_warning("megatron", r))]
    path.write_text("\n".join(out) + "\n")


def compare(a: Path, b: Path) -> int:
    names = sorted({str(p.relative_to(a)) for p in a.rglob("*") if p.is_file()}
                   | {str(p.relative_to(b)) for p in b.rglob("*") if p.is_file()})
    bad = 0
    for n in names:
        pa, pb = a / n, b / n
        if not pa.exists() or not pb.exists():
            print(f"{n}: only in {a if pa.exists() else b}")
            bad += 1
            continue
        if pa.read_bytes() == pb.read_bytes():
            continue
        # (the snapshot's own folder, where a message names a path in it)
        ta = _normal(pa.read_text(encoding="utf-8").replace(str(a.resolve()), "<snapshot>"))
        tb = _normal(pb.read_text(encoding="utf-8").replace(str(b.resolve()), "<snapshot>"))
        if ta != tb:
            bad += 1
            print(f"{n}: differs ({ta.splitlines()[0]})")
            if n.endswith(".html"):  # one long line: where the pages part, with some context
                at = next((k for k, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
                print(f"-{ta[max(0, at - 120):at + 180]}\n+{tb[max(0, at - 120):at + 180]}")
                continue
            diff = list(difflib.unified_diff(ta.splitlines(), tb.splitlines(), lineterm="", n=0))
            print("\n".join(line[:300] for line in diff[:12]))
    print(f"{len(names) - bad} of {len(names)} outputs identical")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("snapshot")
    s.add_argument("out", type=Path)
    s.add_argument("--tree", type=Path, default=ROOT)
    s.add_argument("--only")
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    a = ap.parse_args()
    if a.cmd == "snapshot":
        return snapshot(a.out, a.tree.resolve(), a.only)
    return compare(a.a, a.b)


if __name__ == "__main__":
    raise SystemExit(main())
