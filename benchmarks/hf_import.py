#!/usr/bin/env python3
"""HuggingFace models imported at full size without their weights: the published config.json
files of tests/data/hf/ (``spmdkit plan --hf CLASS --hf-config FILE --dtype bf16``'s import,
then optionally its megatron plan).

    python benchmarks/hf_import.py [--models llama-3.1-405b,deepseek-v3] [--plan dp=8,tp=8]
                                   [--batch 8] [--seq 16] [--full-trace]

Each model runs in a child process (its own peak RSS, as ``/usr/bin/time -v`` reports it: the
child's ``ru_maxrss``, the Python interpreter, torch and transformers included). Columns:
class; layers; parameters of the imported program (billions; the published count); the
layers traced (one per kind transition, repeated to the depth; all of them with
``--full-trace``); ops of the training step; import wall and CPU seconds (the transformers
import and the model's fake build included); plan wall seconds (``--plan``, megatron);
peak RSS. Wall times on a loaded machine: read the CPU column too.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

DATA = ROOT / "tests" / "data" / "hf"
MODELS = {"llama-3-8b": "LlamaForCausalLM", "mixtral-8x7b": "MixtralForCausalLM", "qwen2.5-72b": "Qwen2ForCausalLM",
          "llama-3.1-405b": "LlamaForCausalLM", "deepseek-v3": "DeepseekV3ForCausalLM"}


def _one(name: str, args: argparse.Namespace, out: Any) -> None:
    warnings.simplefilter("ignore")
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        from spmdkit.models.hf import import_hf
        from spmdkit.models.torch_import.layers import layer_kinds, layer_stack, prefix_plan
        from spmdkit.planner.planning import plan_program

        prog, model, _kw = import_hf(MODELS[name], str(DATA / f"{name}.json"), batch=args.batch, seq=args.seq,
                                     dtype="bfloat16", weights=False, repeat=not args.full_trace)
        t_import, c_import = time.perf_counter() - t0, time.process_time() - c0
        stack = layer_stack(model)
        depth = len(stack[1]) if stack else 0
        traced = depth if args.full_trace or not stack else prefix_plan(layer_kinds(stack[1]))[0]
        row = {"class": MODELS[name], "layers": depth, "traced": traced,
               "params": sum(math.prod(prog.tensors[p].shape) for p in prog.parameters()), "ops": len(prog.ops),
               "import_s": t_import, "import_cpu_s": c_import}
        if args.plan:
            t1 = time.perf_counter()
            plan_program(prog, args.plan, "megatron")
            row["plan_s"] = time.perf_counter() - t1
    except Exception as exc:  # a row says why
        row = {"class": MODELS[name], "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    row["rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.put(row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--plan", default="", help="a mesh (dp=8,tp=8): plan megatron on it too")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--full-trace", action="store_true", help="trace every layer (no repetition)")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    print(f"batch {args.batch}, seq {args.seq}, bf16{', megatron on ' + args.plan if args.plan else ''}"
          f"{', full trace' if args.full_trace else ''}")
    head = f"{'model':<16} {'class':<22} {'layers':>6} {'traced':>6} {'params (B)':>11} {'ops':>6} " \
           f"{'import s':>9} {'CPU s':>6} {'plan s':>7} {'peak RSS MiB':>13}"
    print(head)
    print("-" * len(head))
    for name in args.models.split(","):
        q = ctx.Queue()
        p = ctx.Process(target=_one, args=(name, args, q))
        p.start()
        row = q.get()
        p.join()
        if "error" in row:
            print(f"{name:<16} {row['class']:<22} {row['error']}")
            continue
        plan = f"{row['plan_s']:7.1f}" if "plan_s" in row else f"{'-':>7}"
        print(f"{name:<16} {row['class']:<22} {row['layers']:>6} {row['traced']:>6} {row['params'] / 1e9:>11.2f} "
              f"{row['ops']:>6} {row['import_s']:>9.1f} {row['import_cpu_s']:>6.1f} {plan} {row['rss_mib']:>13.0f}",
              flush=True)


if __name__ == "__main__":
    main()
