"""``spmdkit run``: execute a planned training step on torch.distributed (needs ``spmdkit[torch]``)."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, TextIO

from spmdkit.core.errors import ProgramError


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    from spmdkit.graph.zoo import PRESETS

    p.add_argument("--model", default="tiny-llama", help=f"a preset ({', '.join(sorted(PRESETS))}); default tiny-llama")
    p.add_argument("--program", help="run a program JSON file (docs/graph.md) instead of a preset; its annotations "
                                      "come from --annotate")
    p.add_argument("--mesh", default="dp=2,tp=2", help="named mesh dims, e.g. dp=2,tp=2 (default)")
    p.add_argument("--strategy", default="megatron", help="comma list of dp, megatron (tp), sp, zero; default megatron")
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--batch", type=int, help="override the preset's batch size")
    p.add_argument("--seq", type=int, help="override the preset's sequence length")
    p.add_argument("--annotate", action="append", default=[], metavar="TENSOR=DIMS_MAPPING",
                   help='pin a tensor, e.g. --annotate "tokens=[0,-1]" (repeatable)')
    p.add_argument("--nproc", type=int,
                   help="start this many local processes (default: the mesh size); ignored under torchrun")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                   help="torch.distributed backend (auto: nccl where GPUs exist, else gloo)")
    p.add_argument("--seed", type=int, default=0, help="seed of the step's data and parameters")
    p.add_argument("--json", action="store_true", help="print rank 0's report as JSON")


def _strip_nproc(argv: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if a.startswith("--nproc="):
            continue
        out.append(a)
    return out


def run_command(ns: argparse.Namespace, out: TextIO, argv: list[str]) -> int:
    try:
        import torch.distributed  # noqa: F401
    except ImportError as exc:
        raise ProgramError(f"spmdkit run needs torch (pip install 'spmdkit[torch]'): {exc}") from None
    from spmdkit.graph.plan_cli import _annotations, plan_model
    from spmdkit.graph.strategy import parse_mesh

    mesh = parse_mesh(ns.mesh)
    user = _annotations(ns.annotate)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        nproc = ns.nproc or mesh.size
        if nproc != mesh.size:
            raise ProgramError(f"spmdkit run: --nproc {nproc} but the mesh {ns.mesh} has {mesh.size} ranks")
        from spmdkit.torch_exec import launch_local

        out.flush()
        return launch_local(_strip_nproc(argv), nproc)
    import torch.distributed as dist

    from spmdkit.torch_exec import format_report, init_from_env, run_rank

    init_from_env(ns.backend)
    try:
        if ns.program:
            from spmdkit.graph.program import load_program
            from spmdkit.graph.propagate import propagate

            plan = propagate(load_program(ns.program), mesh, user)
            title = f"program {ns.program}, mesh {ns.mesh}"
        else:
            overrides = {"layers": ns.layers, "batch": ns.batch, "seq": ns.seq}
            model, plan, _ = plan_model(ns.model, ns.mesh, ns.strategy, overrides, user)
            title = f"{ns.model} ({model.config.layers} layers), mesh {ns.mesh}, strategy {ns.strategy}"
        rep = run_rank(plan, ns.seed)
    finally:
        dist.barrier()
        dist.destroy_process_group()
    if rep is None:
        return 0
    if ns.json:
        d: dict[str, Any] = {
            "title": title, "world_size": rep.world_size, "backend": rep.backend, "ok": rep.ok,
            "loss": rep.loss, "reference_loss": rep.reference_loss, "checked": rep.checked,
            "max_error": rep.max_error, "failures": [list(f) for f in rep.failures],
            "collectives": [c.__dict__ for c in rep.collectives], "collectives_match": rep.collectives_match,
            "expected_collectives": len(rep.expected),
        }
        out.write(json.dumps(d) + "\n")
    else:
        out.write(format_report(rep, title) + "\n")
    out.flush()
    return 0 if rep.ok else 1
