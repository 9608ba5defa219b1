"""Developer check (not run by the tests, ~1 minute on 2 cores): the ``dtensor`` export of a tiny
HF Llama's megatron plan, applied with ``parallelize_module`` on ``--tp`` gloo ranks, computes the
same loss and gradients as the unsharded model.

    PYTHONPATH=src python scripts/export_dtensor_check.py [--tp 2] [--layers 2] [--tied]

Plans ``LlamaForCausalLM`` (hidden 64, 4 heads, 2 kv heads, vocab 256, batch 2, seq 16) on
``tp=N`` with megatron, writes the export to a temporary folder, applies it with ``apply_dtensor_plan``, then on each rank builds the
same seeded model twice, runs one forward / backward unsharded and one through the exported plan
(the loss vocab-parallel under ``loss_parallel``), and prints the loss of both and the largest
gradient difference relative to the gradient's largest value. Exit status 1 when the loss
differs by more than 1e-5 relative or a gradient by more than 1e-4.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import warnings
from typing import Any


def _config(layers: int, tied: bool = False) -> dict[str, Any]:
    return {"tie_word_embeddings": tied, "num_key_value_heads": 2, "num_hidden_layers": layers, "hidden_size": 64, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64}


def _step(model: Any, kw: dict[str, Any], parallel: bool) -> Any:
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    inputs = {k: v for k, v in kw.items() if k != "labels"}
    with loss_parallel() if parallel else contextlib.nullcontext():
        logits = model(**inputs).logits
        vocab = logits.shape[-1]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), kw["labels"][:, 1:].reshape(-1), ignore_index=-100)
        loss.backward()
    return loss


def _rank(r: int, world: int, folder: str, layers: int, tied: bool, out: Any) -> None:
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from spmdkit.models.hf import build, example_inputs
    from spmdkit.outputs.export import apply_dtensor_plan

    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=r, world_size=world)
    try:
        ref = build("LlamaForCausalLM", _config(layers, tied), seed=0)
        model = build("LlamaForCausalLM", _config(layers, tied), seed=0)
        torch.manual_seed(1)
        kw = example_inputs(ref, 2, 16)
        ref_loss = _step(ref, kw, False)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        apply_dtensor_plan(model, mesh, f"{folder}/plan.json")
        loss = _step(model, kw, True)
        full = loss.full_tensor() if isinstance(loss, DTensor) else loss
        refp = dict(ref.named_parameters())
        worst, where = 0.0, ""
        for n, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            rel = ((g - refp[n].grad).abs().max() / refp[n].grad.abs().max().clamp_min(1e-30)).item()
            if not rel <= worst:  # NaN counts as worst
                worst, where = rel, n
        if r == 0:
            out.put((full.item(), ref_loss.item(), worst, where))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tied", action="store_true", help="tie the embedding and the LM head")
    a = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    import torch.multiprocessing as mp

    from spmdkit.outputs.export import export_plan
    from spmdkit.planner.planning import plan_hf

    with tempfile.TemporaryDirectory() as folder:
        _prog, _model, _kw, plan = plan_hf("LlamaForCausalLM", _config(a.layers, a.tied), f"tp={a.tp}", "megatron")
        doc = export_plan(plan, "dtensor", os.path.join(folder, "plan.json"))
        ctx = mp.get_context("spawn")
        q = ctx.SimpleQueue()
        mp.start_processes(_rank, args=(a.tp, folder, a.layers, a.tied, q), nprocs=a.tp, start_method="spawn")
        loss, ref, worst, where = q.get()
    print(f"{len(doc['parallelize_plan'])} styles on tp={a.tp}: loss {loss:.8f}, unsharded {ref:.8f}; "
          f"largest relative gradient difference {worst:.2e} ({where})")
    ok = abs(loss - ref) <= 1e-5 * abs(ref) and worst <= 1e-4
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
