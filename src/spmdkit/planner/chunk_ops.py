"""Each virtual stage's ops as Megatron-Core's merged schedule splits them into nodes
(:class:`spmdkit.planner.chunk_plan.ChunkOps`, ``--ep-comm-overlap``).

A MoE layer's forward ops, in program order, are cut at its expert all-to-alls (the ops whose wait
is an expert-parallel all-to-all: :attr:`spmdkit.cost.step.OpComm.ep_a2a`): the ops up to the
first (attention, the router, the dispatch's own work) are Megatron's ``attn`` and ``post_attn``
nodes, the first all-to-all its ``moe_dispatch``, the ops up to the second its ``mlp`` (the
experts), the second its ``moe_combine`` with the ops after it (the combine's weighted sum and the
residual add: ``submodule_combine_forward``). The backward's ops are cut the same way, in its own
order: the ops up to the combine's gradient all-to-all (the residual add's and the weighted sum's
gradients) run in the ``moe_combine`` node's backward, then the all-to-all, the experts' gradients
(``mlp``), the dispatch's all-to-all, the router's to the attention's (``post_attn``, ``attn``).
An op's wait on an all-to-all is after its own work (the dispatch's all-to-all of what it made).
A weight-gradient op's W share (:func:`spmdkit.planner.zero_bubble.weight_shares`) runs in its
node's ``backward_dw`` (``--delay-wgrad-compute``). A recomputed forward op (``--recompute
selective``: layernorm, moe_act) runs again in the backward of its own node, but for the pre-MLP
norm (the op whose output the dispatch reads, through views), which runs again in the experts' backward
(Megatron-Core's ``CheckpointWithoutOutput``: ``submodule_moe_forward`` registers the pre-MLP
layernorm's recompute on the experts' output; the activation's runs inside the experts, the
input layernorm's on the attention's output). The ops outside the layers are the chunk's ``pre_process``
(before its first layer: the embedding) and ``post_process`` (after its last: final norm, head,
loss), their gradients in the backward's order.
"""

from __future__ import annotations

from collections.abc import Collection

from spmdkit.planner.chunk_plan import ChunkOps, LayerOps
from spmdkit.program.ir import Program
from spmdkit.program.layers import layer_tags

#: LayerOps fields by (phase, segment between all-to-alls): forward, backward (input gradient,
#: weight gradient); the all-to-alls' fields by (phase, index)
_FWD = ("attn_f", "mlp_f", "after_f")
_BWD = (("after_b", "mlp_dw"), ("mlp_b", "mlp_dw"), ("attn_b", "attn_dw"))
_A2A = {"forward": ("dispatch_f", "combine_f"), "backward": ("combine_b", "dispatch_b")}
#: ops that only view their input (no work): the dispatch reads the pre-MLP norm through them
_VIEWS = frozenset({"reshape", "transpose", "squeeze", "unsqueeze", "flatten", "view"})


def chunk_ops(prog: Program, stages: list[int], n: int, times: list[float], a2a: dict[int, float],
              rerun: Collection[int], shares: dict[int, float]) -> list[ChunkOps]:
    """Per virtual stage (``stages[i]``: op i's, of ``n``), its :class:`ChunkOps` from each op's
    seconds ``times`` (its work and waits), the expert all-to-all part of its wait ``a2a``, the
    recomputed forward ops ``rerun`` and the weight-gradient shares ``shares`` (module docstring)."""
    tags = set(layer_tags(prog))
    # each layer's dispatch (its forward's first op waiting on an all-to-all): what it reads,
    # through views (a reshape into the chunks Megatron's ETP = 1 path routes)
    dispatch_reads: dict[str, set[str]] = {}
    made_by: dict[str, int] = {}
    for i, op in enumerate(prog.ops):
        if op.phase != "forward":
            continue
        if a2a.get(i, 0.0) > 0.0 and op.layer not in dispatch_reads:
            reads, todo = set(op.input_names()), list(op.input_names())
            while todo:
                j = made_by.get(todo.pop(), -1)
                if j >= 0 and prog.ops[j].rule in _VIEWS:
                    todo += [x for x in prog.ops[j].input_names() if x not in reads]
                    reads.update(prog.ops[j].input_names())
            dispatch_reads[op.layer] = reads
        for x in op.output_names():
            made_by[x] = i
    layers: list[dict[str, dict[str, float]]] = [{} for _ in range(n)]
    rest = [{"pre_f": 0.0, "post_f": 0.0, "post_b": 0.0, "pre_b": 0.0} for _ in range(n)]
    seg: dict[tuple[str, str], int] = {}  # (phase, layer) -> the all-to-alls passed so far
    moe: set[str] = set()
    for i, op in enumerate(prog.ops):
        if op.phase not in ("forward", "backward"):
            continue
        s, t, fwd = stages[i], times[i], op.phase == "forward"
        mine = layers[s]
        if op.layer not in tags:
            if fwd:
                key = "post_f" if mine else "pre_f"
                rest[s][key] += t
                if i in rerun:
                    rest[s]["post_b" if key == "post_f" else "pre_b"] += t
            else:
                rest[s]["pre_b" if any(("backward", x) in seg for x in mine) else "post_b"] += t
            continue
        got = mine.setdefault(op.layer, {})
        k = seg.setdefault((op.phase, op.layer), 0)
        wait = a2a.get(i, 0.0)
        work = t - wait
        if fwd:
            _add(got, _FWD[min(k, 2)], work)
            if i in rerun:  # the pre-MLP norm the dispatch reads: again in the experts' backward
                mlp = k == 0 and bool(dispatch_reads.get(op.layer, set()) & set(op.output_names()))
                _add(got, "mlp_b" if mlp else _BWD[2 - min(k, 2)][0], work)
        else:
            b, w = _BWD[min(k, 2)]
            share = shares.get(i, 0.0)
            _add(got, b, work * (1.0 - share))
            _add(got, w, work * share)
        if wait > 0.0:
            _add(got, _A2A[op.phase][min(k, 1)], wait)
            seg[(op.phase, op.layer)] = k + 1
            moe.add(op.layer)
    return [ChunkOps(tuple(LayerOps(**vals, moe=tag in moe) for tag, vals in mine.items()), **r)
            for mine, r in zip(layers, rest)]


def _add(d: dict[str, float], key: str, t: float) -> None:
    d[key] = d.get(key, 0.0) + t


__all__ = ["chunk_ops"]
