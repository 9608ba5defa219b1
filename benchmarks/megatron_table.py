#!/usr/bin/env python3
"""Predicted vs published: the GPT runs of Narayanan et al. (2021), "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM", Table 1 (A100-80GB, Selene).

    python benchmarks/megatron_table.py [--rows 0,1,2] [--microbatch 1] [--schedule 1f1b]

For each row: a GPT (the zoo's gpt2 arch: learned positions, LayerNorm, GELU MLP of 4h) with
the row's hidden size, heads and layers, sequence 2048, vocabulary 51200, bfloat16; the mesh
pp=p,dp=d,tp=t (d = GPUs / (t p); tp innermost, as Megatron-LM orders ranks); strategy
megatron (dp + tensor parallel), the microbatch ``--microbatch`` sequences per data-parallel
rank, m = batch / (d * microbatch) microbatches, full activation recomputation in the time
(one more forward per backward, as the paper trains). The paper's achieved teraFLOP/s per
GPU counts the recomputation: F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per step (its
equation 3); the prediction is that same F over the predicted step time and the GPUs. The
memory column: the fullest pipeline rank with full recomputation, as Megatron-LM allocates it
(:attr:`spmdkit.cost.memory.Memory.device_total`), at ``--microbatch`` (the paper's runs used
larger micro-batches on the smaller models: benchmarks/fidelity.py plans those).
Prints a Markdown table (docs/graph.md shows one).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from spmdkit.cost.devices import cost_model, preset_device, recost
from spmdkit.models.zoo import ModelConfig, build_model
from spmdkit.planner.pipeline import estimate_pipeline
from spmdkit.planner.pipeline_split import PipelineSpec, split_layers
from spmdkit.planner.propagate import propagate
from spmdkit.strategies.strategy import annotate, parse_mesh, parse_strategy

# params (B), heads, hidden, layers, t, p, GPUs, batch, achieved TFLOP/s per GPU (Table 1)
TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
SEQ, VOCAB = 2048, 51200


def paper_flops(batch: int, layers: int, hidden: int) -> float:
    s, h, v = SEQ, hidden, VOCAB
    return 96.0 * batch * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", help="comma list of row indices (default all)")
    ap.add_argument("--microbatch", type=int, default=1, help="sequences per microbatch per data-parallel rank")
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--virtual", type=int, default=1)
    a = ap.parse_args()
    rows = [TABLE1[int(i)] for i in a.rows.split(",")] if a.rows else TABLE1
    dev = preset_device("a100-80gb")
    print("| params | t | p | d | batch | m | bubble | published TFLOP/s/GPU | predicted | ratio | model-only MFU | "
          "memory (fullest rank, on the device) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for params, heads, hidden, layers, t, p, gpus, batch, achieved in rows:
        t0 = time.perf_counter()
        d = gpus // (t * p)
        m = batch // (d * a.microbatch)
        cfg = ModelConfig("gpt2", layers, hidden, heads, None, 4 * hidden, VOCAB, SEQ, d * a.microbatch, "bfloat16")
        full = parse_mesh(f"pp={p},dp={d},tp={t}")
        mesh = parse_mesh(f"dp={d},tp={t}")
        st = parse_strategy("megatron", mesh)
        model = build_model(cfg, vocab_parallel_loss=True, check_rules=False)
        plan = propagate(model.program, mesh, annotate(model, mesh, st))
        plan = recost(plan, cost_model(mesh, dev))
        spec = PipelineSpec(p, m, a.schedule, a.virtual)
        link = cost_model(full, dev).links[0]
        est = estimate_pipeline(plan, spec, split_layers(layers, spec), dev, (link.alpha_s, link.beta_s_per_byte),
                                batch * SEQ, full.size, recompute_forward=True)
        pred = paper_flops(batch, layers, hidden) / (est.step_overlap_s * gpus) / 1e12
        bub = max(0.0, est.run.bubble_fraction) if est.run else 0.0
        # memory with the full recomputation the paper trains with (the time above counts it)
        mem = max(estimate_pipeline(plan, spec, split_layers(layers, spec), recompute="full").memory,
                  key=lambda x: x.device_total)
        print(f"| {params}B | {t} | {p} | {d} | {batch} | {m} | {100 * bub:.1f}% | {achieved} | {pred:.0f} | "
              f"{pred / achieved:.2f} | {100 * (est.mfu or 0):.0f}% | {mem.device_total / 2**30:.1f} GiB "
              f"({'fits' if mem.device_total <= dev.memory_bytes else 'does not fit'}) |", flush=True)
        print(f"<!-- {time.perf_counter() - t0:.1f} s -->", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
