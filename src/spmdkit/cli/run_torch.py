"""``spmdkit run --engine torch``: the plan exported for torch (``spmdkit plan ... --export torch
FILE``), applied to the ``--hf`` model with torch's own APIs and trained ``--steps`` steps under
torch's own launcher (``python -m torch.distributed.run``); the report sets each step's loss beside
torch eager's and each rank's collectives (``CommDebugMode``) beside the plan's.

Exit 0 when both agree every step, 1 when they do not or a rank failed (one line names the rank
and its error), 2 for bad arguments or a plan torch cannot express (one line, before torchrun
starts)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
from typing import Any, TextIO

from spmdkit.cli.checks import parse_tp_plan
from spmdkit.cli.common import plan_source, strategy_notes
from spmdkit.cli.request import HF_BATCH, HF_SEQ, RunRequest
from spmdkit.core.dist_attr import entry_dims
from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.execute.torchrun import (
    TorchrunFailed,
    export_mesh,
    export_model_class,
    export_vocab_padding,
    format_torch_report,
    launch_torchrun,
    loss_rtol,
    torch_report,
)
from spmdkit.models.hf import dtype_name, load_config
from spmdkit.models.source import HFModel
from spmdkit.outputs.export_torch import export_torch
from spmdkit.planner.planning import MAX_SIZE, parse_size
from spmdkit.program.plan import Plan
from spmdkit.strategies.strategy import parse_mesh

DEFAULT_STEPS = 3
DEFAULT_OPTIMIZER = "sgd"
DEFAULT_LR = 0.01


class TorchUsageError(ProgramError):
    """Bad arguments for ``spmdkit run --engine torch`` (exit 2, one line, before torchrun starts)."""


def run_torch_command(req: RunRequest, out: TextIO) -> int:
    try:
        return _run(req, out)
    except TorchUsageError as exc:
        print(f"spmdkit run: {exc}", file=sys.stderr)
        return 2
    except SpmdError as exc:
        print(f"spmdkit run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except TorchrunFailed as exc:
        print(f"spmdkit run: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the launcher ended torchrun's process group first
        print("spmdkit run: interrupted; ended torchrun and its workers", file=sys.stderr)
        return 130


def _check(req: RunRequest) -> None:
    """Everything refused before torchrun starts."""
    if "RANK" in os.environ:
        raise TorchUsageError("--engine torch starts torchrun itself: run it outside torchrun (RANK is set)")
    for mod, extra in (("torch", "torch"), ("transformers", "hf")):
        if importlib.util.find_spec(mod) is None:
            raise TorchUsageError(f"--engine torch needs {mod} (pip install 'spmdkit[{extra}]')")
    m = req.model
    if not m.hf:
        raise TorchUsageError("--engine torch runs an --hf model (a transformers class built from --hf-config); "
                              "presets and --program files run on --engine spmdkit")
    if m.hf_config is None:
        raise TorchUsageError("--hf needs --hf-config FILE|JSON (the model's config)")
    for flag, given in (("--program", m.program), ("--pad", req.pad), ("--annotate", req.annotate or None),
                        ("--device", req.device), ("--warmup", req.warmup or None), ("--layers", req.layers),
                        ("--fallback", m.fallback)):
        if given is not None:
            raise TorchUsageError(f"{flag} applies to --engine spmdkit, not --engine torch")
    if req.torch_plan is not None:
        for flag, given in (("--strategy", req.strategy), ("--tp-plan", m.tp_plan),
                            ("--make-vocab-size-divisible-by", m.vocab_divisible_by)):
            if given is not None:
                raise TorchUsageError(f"{flag} with --torch-plan: the export is already planned (give one of them)")
    if req.steps is not None and not 1 <= req.steps <= 1000:
        raise TorchUsageError(f"--steps {req.steps}: must be in [1, 1000]")
    if req.lr is not None and not (math.isfinite(req.lr) and req.lr > 0):
        raise TorchUsageError(f"--lr {req.lr}: must be a positive number")
    for flag, v in (("--batch", req.batch), ("--seq", req.seq)):
        if v is not None and not 1 <= v <= MAX_SIZE:
            raise TorchUsageError(f"{flag} {v}: must be in [1, {MAX_SIZE}]")


def _backend(name: str) -> str:
    import torch
    import torch.distributed as dist

    gpus = torch.cuda.is_available() and dist.is_nccl_available()
    if name == "auto":
        return "nccl" if gpus else "gloo"
    if name == "nccl" and not gpus:
        raise TorchUsageError("--backend nccl needs CUDA GPUs and a torch built with NCCL (use --backend gloo)")
    return name


def _export(req: RunRequest, folder: str, dtype: str, batch: int, seq: int
            ) -> tuple[str, str, list[str] | None]:
    """(the export's path, what it is for the title, the plan's batch dims): ``--torch-plan``
    (the batch dims then the export's ``BATCH_DIMS``, else by name), or the plan of ``--mesh`` /
    ``--strategy`` exported here (``spmdkit.outputs.export_torch.export_torch``)."""
    if req.torch_plan is not None:
        return req.torch_plan, f"export {req.torch_plan}", None
    mesh = parse_mesh(req.mesh)
    if "pp" in mesh.dim_names:
        raise TorchUsageError(f"--mesh {req.mesh}: a pipeline plan's stages and schedule come from spmdkit plan: "
                              "write it with spmdkit plan ... --microbatches M --schedule S --export torch FILE "
                              "and run it with --torch-plan FILE")
    m = req.model
    assert m.hf is not None and m.hf_config is not None
    strategy = req.strategy or "megatron"
    with strategy_notes("run"):
        _loaded, plan, _ = plan_source(HFModel(m.hf, m.hf_config, dtype, batch, seq, weights=False,
                                               vocab_divisible_by=m.vocab_divisible_by), req.mesh,
                                       strategy, {}, parse_tp_plan(m.tp_plan))
    path = os.path.join(folder, "plan_torch.py")
    export_torch(plan, path)
    return path, f"mesh {req.mesh}, strategy {strategy}", batch_dims(plan)


def batch_dims(plan: Plan) -> list[str] | None:
    """The mesh dims the plan splits the batch over: those sharding axis 0 of its token ids
    (``input_ids``), major first; None when the program has none."""
    attr = plan.attrs.get("input_ids")
    if attr is None or not attr.dims_mapping:
        return None
    return [plan.mesh.dim_names[d] for d in entry_dims(attr.dims_mapping[0])]


def _run(req: RunRequest, out: TextIO) -> int:
    _check(req)
    m = req.model
    assert m.hf is not None and m.hf_config is not None
    dtype = dtype_name(m.dtype or "float32")
    batch = parse_size("--batch", HF_BATCH if req.batch is None else req.batch, MAX_SIZE)
    seq = parse_size("--seq", HF_SEQ if req.seq is None else req.seq, MAX_SIZE)
    assert batch is not None and seq is not None
    config = load_config(m.hf_config)
    backend = _backend(req.backend)
    steps = DEFAULT_STEPS if req.steps is None else req.steps
    optimizer = req.optimizer or DEFAULT_OPTIMIZER
    lr = DEFAULT_LR if req.lr is None else req.lr
    folder = tempfile.mkdtemp(prefix="spmdkit-run-torch-")
    try:
        path, what, dims_of_batch = _export(req, folder, dtype, batch, seq)
        try:
            dims, shape = export_mesh(path)
            planned = export_model_class(path)
        except ValueError as exc:
            raise TorchUsageError(str(exc)) from None
        if planned is not None and planned != m.hf:
            raise TorchUsageError(f"--torch-plan {path}: planned for {planned}, not --hf {m.hf}: its styles are that "
                                  f"model's (a module of {m.hf} it does not name would run unstyled)")
        nproc = math.prod(shape)
        if req.nproc is not None and req.nproc != nproc:
            raise TorchUsageError(f"--nproc {req.nproc} but the export's mesh "
                                  f"{','.join(f'{d}={s}' for d, s in zip(dims, shape))} has {nproc} ranks")
        try:
            padding = export_vocab_padding(path)
        except ValueError as exc:
            raise TorchUsageError(str(exc)) from None
        if padding is not None:  # the export's padded vocabulary: the model built with it, tokens below the real one
            config = {**config, "vocab_size": padding[1]}
        spec: dict[str, Any] = {"hf": m.hf, "config": config, "dtype": dtype, "batch": batch, "seq": seq,
                                "vocab": padding[0] if padding is not None else None,
                                "steps": steps, "optimizer": optimizer, "lr": lr, "seed": req.seed,
                                "export": os.path.abspath(path), "timeout": req.timeout, "backend": backend,
                                "batch_dims": dims_of_batch}
        got = launch_torchrun(spec, nproc, req.timeout * (steps + 3))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    title = (f"{m.hf} ({dtype}, batch {batch}, seq {seq}), {what}; {steps} step{'s' if steps != 1 else ''} of "
             f"{optimizer} (lr {lr:g})")
    rep = torch_report(got, title, loss_rtol(dtype))
    out.write((json.dumps(rep) if req.json else format_torch_report(rep)) + "\n")
    out.flush()
    return 0 if rep["ok"] else 1


__all__ = ["DEFAULT_LR", "DEFAULT_OPTIMIZER", "DEFAULT_STEPS", "run_torch_command"]
