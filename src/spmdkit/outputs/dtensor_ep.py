"""What the DTensor export of an expert-parallel plan can and cannot say in torch's own terms.

An ep plan (``--strategy ...,ep``: :mod:`spmdkit.strategies.experts`) shards each expert stack
``[E, in, out]`` on its expert axis over ``ep`` and exchanges the tokens by all-to-all around the
experts. In torch (checked on 2.13):

- expressible: every placement. An expert stack is ``Shard(0)`` over ``ep`` (with megatron, also
  ``Shard(1)`` / ``Shard(2)`` over ``tp``: ETP), ``Replicate()`` over ``dp``; the batch, data
  parallel over ``dp x ep``, is ``Shard(0)`` on both (``distribute_tensor`` takes these, and
  :func:`spmdkit.outputs.dtensor.distribute_parameters` places the stacks);
- not expressible: applying it to a module. ``torch.distributed.tensor.parallel`` has no
  expert-parallel style (its styles are ``ColwiseParallel``, ``RowwiseParallel``,
  ``SequenceParallel`` and the ``PrepareModule*`` ones, for ``nn.Linear`` / ``nn.Embedding``),
  so ``parallelize_module`` cannot shard an experts module nor insert the token dispatch and
  combine (one all-to-all over ``ep`` each way, their mirrors in the backward). torchtitan
  writes it as its own ``ParallelStyle``, ``ExpertParallel`` (torchtitan/distributed/expert_parallel.py:
  ``distribute_module`` with ``Shard(0)`` parameters, ``_token_dispatch`` / ``_token_combine``
  with ``all_to_all_single_autograd``), and its ``TensorParallel`` for the experts' tensor
  parallelism.

The ``torch`` export (``--export torch``, :mod:`spmdkit.outputs.export_torch_moe`) writes such a
style of its own into the file for the experts' tensor parallelism: ``ExpertsTensorParallel``
(HF's fused ``gate_up_proj`` / ``down_proj`` split on each expert's ffn axis over ``tp``, the rows
all-reduced before the combine), checked on gloo against eager for Mixtral under megatron and
megatron+fsdp. Over ``ep`` it refuses (no dispatch / combine style written yet): this statement
stands for expert parallelism.

:func:`expert_parallel_statement` gives this for a plan (None for a plan without expert
parallelism), naming each experts module (a stack's name up to its last dot) and its stacks; the
``dtensor`` export carries it as ``expert_parallel`` with a note (:mod:`spmdkit.outputs.export`).
Standard library only.
"""

from __future__ import annotations

from typing import Any

from spmdkit.core.dist_attr import entry_dims
from spmdkit.program.plan import Plan
from spmdkit.strategies.experts import moe_layers

#: torch.distributed.tensor.parallel's styles (torch 2.13): none is for experts
TORCH_STYLES = ("ColwiseParallel", "RowwiseParallel", "SequenceParallel", "PrepareModuleInput",
                "PrepareModuleOutput", "PrepareModuleInputOutput")

CANNOT = ("torch.distributed.tensor.parallel has no expert-parallel ParallelStyle (its styles: "
          + ", ".join(TORCH_STYLES) + ", for nn.Linear / nn.Embedding): parallelize_module cannot shard these "
          "experts modules nor insert the token dispatch and combine (one all-to-all over {ep} each way, their "
          "mirrors in the backward), nor does --export torch yet (it writes a ParallelStyle for experts over tp "
          "only); write them as a custom ParallelStyle, as torchtitan's ExpertParallel "
          "(torchtitan/distributed/expert_parallel.py: distribute_module with Shard(0) parameters, token dispatch / "
          "combine with all_to_all_single_autograd)")
CAN = ("the placements: each stack Shard(0) over {ep} (distribute_tensor; spmdkit.outputs.dtensor."
       "distribute_parameters places them), the batch Shard(0) over the data-parallel dims {data}")


def expert_parallel_statement(plan: Plan) -> dict[str, Any] | None:
    """The plan's expert parallelism in torch's terms (module docstring): the mesh dim the
    experts are split over, each experts module and its stacks' placements, what torch can and
    cannot express; None where no expert stack is sharded on its expert axis."""
    prog = plan.program
    if not any(op.rule == "moe_gate_dispatch" for op in prog.ops):
        return None
    names = plan.mesh.dim_names
    modules: dict[str, list[str]] = {}
    dims: set[int] = set()
    for lay in moe_layers(prog):
        for s in lay.stacks:
            d = entry_dims(plan.attrs[s].dims_mapping[0]) if s in plan.attrs else ()
            if d:
                dims.update(d)
                modules.setdefault(s.rsplit(".", 1)[0] if "." in s else s, []).append(s)
    if not modules:
        return None
    ep = "/".join(names[d] for d in sorted(dims))
    data = ", ".join(n for n in names if n in ("dp", "ep")) or ep
    return {"mesh_dim": ep, "modules": {m: sorted(v) for m, v in sorted(modules.items())},
            "torch_can": CAN.format(ep=ep, data=data), "torch_cannot": CANNOT.format(ep=ep),
            "torch_style": None}


def expert_note(statement: dict[str, Any]) -> str:
    """The export's one-line note of an expert-parallel plan."""
    mods = list(statement["modules"])
    shown = ", ".join(mods[:4]) + (f" and {len(mods) - 4} more" if len(mods) > 4 else "")
    return (f"expert parallel over {statement['mesh_dim']} ({len(mods)} experts modules: {shown}): "
            f"parallelize_plan leaves them out; {statement['torch_cannot']}")


__all__ = ["CAN", "CANNOT", "TORCH_STYLES", "expert_note", "expert_parallel_statement"]
