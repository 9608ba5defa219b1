"""The activation memory of a merged forward-and-backward step without a pipeline
(``--ep-comm-overlap`` with ``--grad-accum`` M > 1: Megatron-Core's
``combined_1f1b_schedule_for_no_pipelining``, :mod:`spmdkit.planner.ep_overlap`).

Each of the ``M - 1`` merged steps runs the forward of microbatch ``i + 1`` beside the backward of
microbatch ``i`` through ``TransformerModelChunkSchedulePlan.run`` (NVIDIA/Megatron-LM
d98e8a64dd, module ``megatron.core.models.common.model_chunk_schedule_plan``): the forward's
embedding, then the backward's output layer and loss (``b_schedule_plan.post_process.backward``),
then the layers in pairs, forward layer ``p`` with backward layer ``L - 1 - p``, the backward
layer's saved state released after its pair (``b_layer.release_state()``), then the forward's
output layer and loss, then the backward's embedding. So while the backward of layer ``L - 1 - p``
runs, the partner microbatch holds its layers ``0 .. p - 1`` and builds layer ``p``: one
microbatch's activations and about one layer's more, where the flat step holds one microbatch's
and the output layer's.

:func:`merged_curve` adds to the flat step's curve (the live transient bytes after each op,
:func:`spmdkit.cost.memory.peak_of`) at every backward op of a layer the partner's bytes beside it:
the saved activations of its layers before its pair's (:class:`spmdkit.cost.memory_saved.ActivationMemory`)
and the most its own pair's forward layer adds over that layer's forward ops in the flat step
(saved and working bytes: the two streams' ops of one pair may run together). The rest of the merged
step (the output layer, the embedding, the first forward and the last backward alone) is the flat
step's.
"""

from __future__ import annotations

from spmdkit.cost.memory_saved import ActivationMemory
from spmdkit.program.layers import layer_tags
from spmdkit.program.plan import Plan


def merged_curve(plan: Plan, saved: ActivationMemory, curve: list[int]) -> list[int]:
    """``curve`` (the flat step's live transient bytes after each op) as a merged step holds them
    (module docstring); ``curve`` itself where the plan has no merged step (no
    ``--ep-comm-overlap``, one microbatch, no numbered layers)."""
    prog = plan.program
    tags = layer_tags(prog)
    if not plan.runtime.ep_comm_overlap or plan.grad_accum < 2 or not tags or len(curve) != len(prog.ops):
        return curve
    index = {t: k for k, t in enumerate(tags)}
    forward: dict[str, list[int]] = {t: [] for t in tags}
    for i, op in enumerate(prog.ops):
        if op.phase == "forward" and op.layer in index:
            forward[op.layer].append(i)
    rise = {t: max(curve[i] for i in ix) - (curve[ix[0] - 1] if ix[0] else 0) if ix else 0
            for t, ix in forward.items()}
    held = 0
    before: list[int] = []  # the partner's saved layers before pair p
    for t in tags:
        before.append(held)
        held += saved.layer(t)
    n = len(tags)
    out = list(curve)
    for i, op in enumerate(prog.ops):
        q = index.get(op.layer) if op.phase == "backward" else None
        if q is not None:
            p = n - 1 - q  # the forward layer paired with backward layer q
            out[i] += before[p] + max(0, rise[tags[p]])
    return out


__all__ = ["merged_curve"]
