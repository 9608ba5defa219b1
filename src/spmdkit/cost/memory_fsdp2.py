"""FSDP2's gathered parameters (``--framework torchtitan`` / ``automodel`` with a ZeRO-3
``storage``) and the all-gather buffers its copy-in stream keeps reserved. The core, the
program and the plan only. docs/devices.md, "Memory".

torch's FSDP2 (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``, ``foreach_all_gather``)
allocates each all-gather's output, one FSDP group's parameters gathered into one flat buffer,
on its all-gather copy-in stream, and copies it out into the group's unsharded parameters on the
default stream; the forward frees a group's buffer only at the next group's all-gather
(``FSDPParamGroup.wait_for_unshard``: ``FSDPCommContext.all_gather_state``, "Defer free to allow
for overlap of this copy-out with next all-gather collective"), so two groups' buffers are
allocated at once (the root group's, gathered first, with the first block's). PyTorch's caching allocator reuses a freed block only for the stream it was
allocated on (``CUDACachingAllocator``: a block's free-list key holds its stream; under
``expandable_segments:True``, torchtitan's setting, a segment per stream), so those two buffers
stay reserved in that stream's pool all step (``torch.cuda.max_memory_reserved``, what torchtitan
logs), outside the default stream's blocks: :func:`copy_in_pool`. A group is what
``fully_shard`` was applied to: torchtitan's transformer blocks (a numbered layer) and the model
(chunk) holding the rest (:func:`param_groups`); each model chunk of a pipeline is a root with
streams of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import pairwise

from spmdkit.cost.checkpoints import layer_numbers
from spmdkit.cost.compute import gathered_itemsize
from spmdkit.cost.shards import local_numel
from spmdkit.program.ir import Program
from spmdkit.program.plan import Plan, Reshard


def makes_no_copy(plan: Plan, r: Reshard) -> bool:
    """``r`` changes only mesh dims of one rank (a ZeRO-3 gather of an expert stack over an
    expert-data-parallel dim of size 1): the local tensor is the same, no bytes move and the
    framework makes no copy (FSDP2 leaves such a parameter out: AutoModel's ``ignored_params``;
    a layout change over a mesh dim of size 1, ``dp=1``'s batch entry, alike)."""
    shape = plan.program.tensors[r.tensor].shape
    return (not r.plan.bytes_per_rank and local_numel(r.src, shape) == local_numel(r.dst, shape)
            and not any(s.bytes_per_rank for s in r.plan.steps))


def gathered_numels(plan: Plan) -> dict[str, int]:
    """Each stored (ZeRO-3 sharded) parameter a reshard gathers -> the local elements of the
    gathered copy (its first such reshard's; none where the gather makes no copy)."""
    out: dict[str, int] = {}
    for r in plan.reshards:
        if r.tensor in plan.storage and r.tensor not in out and not makes_no_copy(plan, r):
            out[r.tensor] = local_numel(r.dst, plan.program.tensors[r.tensor].shape)
    return out


def param_groups(prog: Program) -> dict[str, str]:
    """Each parameter's FSDP2 group: the numbered layer label (``layer 3``) of its first forward
    reader, ``""`` (the model's root group) where that label has no number. Made once per
    program."""
    return prog.derived("memory_fsdp2.groups", _param_groups)  # type: ignore[no-any-return]


def _param_groups(prog: Program) -> dict[str, str]:
    out: dict[str, str] = {}
    for op in prog.ops:
        if op.phase == "forward":
            for nm in op.input_names():
                if nm not in out and prog.tensors[nm].kind == "parameter":
                    out[nm] = op.layer if layer_numbers(op.layer) else ""
    return out


def gather_sizes(prog: Program, gathered: Mapping[str, int]) -> list[int]:
    """The bytes of each FSDP2 group's gathered parameters (``gathered``: parameter -> its
    gathered bytes), in the order the forward all-gathers them: the root group first (the
    model's pre-forward), then the blocks by their first forward reader."""
    sizes: dict[str, int] = {"": 0}
    for nm, g in param_groups(prog).items():
        if nm in gathered:
            sizes[g] = sizes.get(g, 0) + gathered[nm]
    return [b for b in sizes.values() if b]


def last_group(prog: Program, per_param: Mapping[str, int]) -> int:
    """The bytes ``per_param`` gives the parameters of the FSDP2 group that comes last in its
    root's module order: torchtitan's ``model.layers`` in layer order after the model (chunk)
    itself, so the highest-numbered block (the root group where no block has a parameter here).
    ``FSDPState._lazy_init`` lists the root's states in ``named_modules()`` order, and
    ``torch.distributed.pipelining``'s ``run_post_backward`` calls their groups' ``post_backward``
    in that order."""
    groups = param_groups(prog)
    sizes: dict[str, int] = {}
    for nm, b in per_param.items():
        g = groups.get(nm, "")
        sizes[g] = sizes.get(g, 0) + b

    def number(label: str) -> int:
        return (layer_numbers(label) or (-1,))[-1]

    return sizes[max(sizes, key=number)] if sizes else 0


def pair_peak(sizes: Sequence[int]) -> int:
    """The most two all-gathers in a row hold (``sizes`` in their order): a group's buffer is
    freed at the next group's all-gather (module docstring)."""
    return max((a + b for a, b in pairwise(sizes)), default=sizes[0] if sizes else 0)


def copy_in_pool(plan: Plan) -> int:
    """Bytes FSDP2's all-gather copy-in stream keeps reserved (module docstring): the most two
    consecutive groups' gathered parameters take; 0 but under an FSDP2 framework."""
    if not plan.runtime.fsdp2:
        return 0
    prog = plan.program
    # gathered in float8 (--fsdp-float8-all-gather): 1 byte an element
    return pair_peak(gather_sizes(prog, {nm: n * gathered_itemsize(plan, nm) for nm, n in gathered_numels(plan).items()}))


__all__ = ["copy_in_pool", "gather_sizes", "gathered_numels", "last_group", "makes_no_copy", "pair_peak",
           "param_groups"]
