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
what one microbatch holds in the flat step from just before its pair's forward layer through that
layer's ops: its layers below (the activations they keep), its stream (``f_input``, the layer's
input, passed from pair to pair) and the most the layer adds (saved and working bytes: the two
streams' ops of one pair may run together); and at the backward's output-layer ops, which run after
the partner's ``pre_process.forward()``, the partner's embedding output (the flat curve just before
its first layer). The rest of the merged step (the forward's output layer, the embedding's backward,
the first forward and the last backward alone) is the flat step's. (Until 2026-12-07 the partner
was its saved layers and the layer's rise alone: its stream, one [s, b, h] tensor a pair, and the
embedding output beside the output layer's backward were left out.)
"""

from __future__ import annotations

from spmdkit.program.layers import layer_tags
from spmdkit.program.plan import Plan


def merged_curve(plan: Plan, curve: list[int]) -> list[int]:
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
    if not all(forward.values()):
        return curve
    # the partner at pair p: what one microbatch holds in the flat step from the end of layer p - 1 (its
    # saved layers below and its stream, f_input) through layer p's forward ops
    partner = [max(curve[ix[0] - 1] if ix[0] else 0, max(curve[i] for i in ix)) for ix in forward.values()]
    embedded = curve[forward[tags[0]][0] - 1] if forward[tags[0]][0] else 0  # its embedding's output
    n = len(tags)
    out = list(curve)
    layers_back = False
    for i, op in enumerate(prog.ops):
        if op.phase != "backward":
            continue
        q = index.get(op.layer)
        if q is not None:
            layers_back = True
            out[i] += partner[n - 1 - q]  # the forward layer paired with backward layer q
        elif not layers_back:  # the output layer's backward (post_process), after the partner's embedding
            out[i] += embedded
    return out


__all__ = ["merged_curve"]
