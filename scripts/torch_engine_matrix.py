"""Developer check (not run by the tests; about a minute per row on 2 cores): tiny HF models'
plans exported for torch and trained on torch's own engine under torchrun on gloo.

    PYTHONPATH=src python scripts/torch_engine_matrix.py [--only Llama] [--steps 3]

For each model (Llama, Qwen2, GPT-2, Mixtral) and each plan (dp=2 x tp=2 megatron, megatron + sp,
megatron + sp + fsdp (zero3), pp=2 x tp=2 and pp=2 x dp=2 x tp=2 (8 processes) megatron with 1F1B over 2
microbatches):
``spmdkit plan ... --export torch FILE`` then ``spmdkit run --engine torch --torch-plan FILE``; one
row per pair: refused (the export's one line), failed (the run's one line), or the largest loss
difference from torch eager over the steps and whether every rank's collectives equal the plan's
every step. Exit 1 when a row that ran is not ok.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_DEC = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "intermediate_size": 64, "vocab_size": 128, "max_position_embeddings": 64}
MODELS = {
    "LlamaForCausalLM": _DEC,
    "Qwen2ForCausalLM": _DEC,
    "GPT2LMHeadModel": {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 128, "n_positions": 64},
    "MixtralForCausalLM": {**_DEC, "num_local_experts": 4, "num_experts_per_tok": 2},
}
PLANS = [
    ("dp=2,tp=2", "megatron", []),
    ("dp=2,tp=2", "megatron,sp", []),
    ("dp=2,tp=2", "megatron,sp,zero3", []),
    ("pp=2,tp=2", "megatron", ["--microbatches", "2", "--schedule", "1f1b"]),
    ("pp=2,dp=2,tp=2", "megatron", ["--microbatches", "2", "--schedule", "1f1b"]),
]


def _spmdkit(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, "-m", "spmdkit", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def _last(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:160] if lines else "(no output)"


def row(cls: str, mesh: str, strategy: str, extra: list[str], steps: int, folder: str) -> tuple[str, bool]:
    cfg = json.dumps(MODELS[cls])
    path = os.path.join(folder, f"{cls}-{mesh}-{strategy}.py".replace(",", "_").replace("=", ""))
    p = _spmdkit("plan", "--hf", cls, "--hf-config", cfg, "--mesh", mesh, "--strategy", strategy, "--batch", "4",
                 "--seq", "8", *extra, "--export", "torch", path)
    if p.returncode != 0:
        return f"refused: {_last(p.stderr)}", True
    p = _spmdkit("run", "--engine", "torch", "--hf", cls, "--hf-config", cfg, "--torch-plan", path, "--batch", "4",
                 "--seq", "8", "--steps", str(steps), "--json")
    if not p.stdout.strip():
        return f"failed: {_last(p.stderr)}", False
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    worst = max(s["abs_error"] for s in rep["steps"])
    coll = "equal" if rep["collectives_match"] else "NOT equal: " + json.dumps(
        {k: v for k, v in rep["steps"][-1].items() if k in ("collectives", "collectives_differ_on_ranks")})[:200]
    return f"{'ok' if rep['ok'] else 'NOT ok'}: loss diff <= {worst:.1e}; collectives {coll}", bool(rep["ok"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="models whose class name contains this")
    ap.add_argument("--plan", help="plans whose strategy or mesh contains this")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args(argv)
    ok = True
    with tempfile.TemporaryDirectory() as folder:
        print(f"{'model':<20} {'mesh':<15} {'strategy':<18} result")
        for cls in MODELS:
            if a.only and a.only not in cls:
                continue
            for mesh, strategy, extra in PLANS:
                if a.plan and a.plan not in strategy and a.plan not in mesh:
                    continue
                text, good = row(cls, mesh, strategy, extra, a.steps, folder)
                ok &= good
                print(f"{cls:<20} {mesh:<15} {strategy:<18} {text}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
