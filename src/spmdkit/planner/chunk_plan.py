"""Megatron-Core's merged forward and backward of one model chunk (``--ep-comm-overlap``), layer by
layer and sub-op by sub-op, on its two CUDA streams.

Under ``--overlap-moe-expert-parallel-comm`` every forward and backward step of the interleaved
schedule goes through ``TransformerModelChunkSchedulePlan.run`` (the warm-up forwards with no
backward, the cool-down backwards with no forward, the steady state's pairs; NVIDIA/Megatron-LM
d7bf5aaaa8, 2025-08-26, the first public commit with the interleaved schedule's overlap:
``megatron/core/models/common/model_chunk_schedule_plan.py``,
``megatron/core/pipeline_parallel/combined_1f1b.py``, ``megatron/core/pipeline_parallel/utils.py``,
``megatron/core/models/gpt/fine_grained_callables.py``). Each MoE layer is split into nodes:
``attn`` and ``post_attn`` (layernorm, router, dispatch preprocess) and ``mlp`` (the experts) on
the computation stream, ``moe_dispatch`` and ``moe_combine`` (the all-to-alls; the combine's node
also runs the residual add after it) on the communication stream. Each node waits on its model
chunk's ONE CUDA event and records it when issued (``stream_acquire_context``): a chunk's nodes run
one after the other whatever their stream, the forward's chunk and the backward's chunk have
events of their own, and the streams run their nodes in the order the host issues them. The
weight gradients (``--delay-wgrad-compute``: ``backward_dw``) run on the computation stream
with no event at all: nothing waits on them. ``TransformerLayerSchedulePlan.run`` issues, for the
forward's layer ``i`` and the backward's layer ``L - 1 - i``::

    combine_bwd [comm] | attn_fwd, post_attn_fwd [comp] | mlp_bwd [comp] | dispatch_fwd [comm]
    | mlp_bwd_dw [comp] | dispatch_bwd [comm] | mlp_fwd [comp] | combine_fwd [comm]
    | post_attn_bwd, attn_bwd [comp] | attn_bwd_dw [comp]

(the first layer's ``attn_bwd_dw`` after the chunk's layers, beside the send of its gradient). The
chunk: the forward's ``pre_process`` (the embedding), the backward's ``post_process`` backward
(the head and loss), the pairs of layers, the layers of the longer chunk left alone, the last
``attn_bwd_dw``, the forward's ``post_process`` (final norm, head, loss) and the backward's
``pre_process`` backward (the embedding), all on the computation stream, then both streams are
waited for. :func:`chunk_run` times that: each node starts once its stream's node before it and
its chunk's node before it have ended, the weight gradients once their stream's has. A dense
layer has no dispatch or combine node (Megatron's ``NoopScheduleNode``): its work runs on the
computation stream.

The computation stream's kernels run on the SMs DeepEP's kernels (or NCCL's all-to-all's CTAs)
leave while an all-to-all runs beside them (``share``: :func:`spmdkit.cost.moe.a2a_compute_share`): a computation node's
work advances at ``share`` of its speed while an all-to-all runs on the other stream, at full
speed otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the two streams
COMP, COMM = 0, 1


@dataclass(frozen=True)
class LayerOps:
    """One layer's seconds by node for one microbatch (forward and backward; nodes that are empty
    in a dense layer are 0 there). ``moe``: the layer has the dispatch and combine nodes."""

    #: forward: attention to the dispatch's preprocess (attn, post_attn), the dispatch's
    #: all-to-all, the experts (mlp), the combine's all-to-all, the work after it (combine node)
    attn_f: float = 0.0
    dispatch_f: float = 0.0
    mlp_f: float = 0.0
    combine_f: float = 0.0
    after_f: float = 0.0
    #: backward: the gradient of the work after the combine (combine node), the combine's
    #: all-to-all, the experts' input gradients (mlp) and weight gradients (mlp dw), the
    #: dispatch's all-to-all, the input gradients from the router to the attention (post_attn,
    #: attn) and the attention's weight gradients (attn dw)
    after_b: float = 0.0
    combine_b: float = 0.0
    mlp_b: float = 0.0
    mlp_dw: float = 0.0
    dispatch_b: float = 0.0
    attn_b: float = 0.0
    attn_dw: float = 0.0
    moe: bool = True

    @property
    def forward_s(self) -> float:
        return self.attn_f + self.dispatch_f + self.mlp_f + self.combine_f + self.after_f

    @property
    def backward_s(self) -> float:
        return self.after_b + self.combine_b + self.mlp_b + self.mlp_dw + self.dispatch_b + self.attn_b + self.attn_dw


@dataclass(frozen=True)
class ChunkOps:
    """One virtual stage's (model chunk's) layers and its work outside them: ``pre_f`` (the
    embedding's forward), ``post_f`` (final norm, head, loss), ``post_b`` (their backward, first),
    ``pre_b`` (the embedding's backward, last)."""

    layers: tuple[LayerOps, ...] = ()
    pre_f: float = 0.0
    post_f: float = 0.0
    post_b: float = 0.0
    pre_b: float = 0.0

    @property
    def forward_s(self) -> float:
        return self.pre_f + self.post_f + sum(x.forward_s for x in self.layers)

    @property
    def backward_s(self) -> float:
        return self.post_b + self.pre_b + sum(x.backward_s for x in self.layers)


@dataclass(frozen=True)
class ChunkRun:
    """A merged (or lone) chunk step: its seconds, and when its forward's and its backward's output
    is made, from its start: the end of its chain's last node before the chunk's closing work
    (``post_forward`` / ``post_backward``, the sends, are issued there; the closing work is the
    last stage's head and loss and the first stage's embedding, whose outputs are not sent)."""

    seconds: float
    forward_end: float
    backward_end: float


#: a node: (stream, chain: "F" | "B" | "" (a weight gradient: no event), seconds, an all-to-all)
Node = tuple[int, str, float, bool]


def _forward_layer(x: LayerOps) -> list[tuple[str, Node]]:
    if not x.moe:
        return [("attn", (COMP, "F", x.attn_f + x.mlp_f, False))]
    return [("attn", (COMP, "F", x.attn_f, False)), ("dispatch", (COMM, "F", x.dispatch_f, True)),
            ("mlp", (COMP, "F", x.mlp_f, False)), ("combine", (COMM, "F", x.combine_f, True)),
            ("after", (COMM, "F", x.after_f, False))]


def _backward_layer(x: LayerOps) -> list[tuple[str, Node]]:
    if not x.moe:
        return [("mlp", (COMP, "B", x.after_b + x.mlp_b + x.attn_b, False)),
                ("mlp_dw", (COMP, "", x.mlp_dw, False)), ("attn_dw", (COMP, "", x.attn_dw, False))]
    return [("after", (COMM, "B", x.after_b, False)), ("combine", (COMM, "B", x.combine_b, True)),
            ("mlp", (COMP, "B", x.mlp_b, False)), ("mlp_dw", (COMP, "", x.mlp_dw, False)),
            ("dispatch", (COMM, "B", x.dispatch_b, True)), ("attn", (COMP, "B", x.attn_b, False)),
            ("attn_dw", (COMP, "", x.attn_dw, False))]


#: the order ``TransformerLayerSchedulePlan.run`` issues a pair's nodes in: (chain, node name)
_PAIR_ORDER = (("B", "after"), ("B", "combine"), ("F", "attn"), ("B", "mlp"), ("F", "dispatch"), ("B", "mlp_dw"),
               ("B", "dispatch"), ("F", "mlp"), ("F", "combine"), ("F", "after"), ("B", "attn"), ("B", "attn_dw"))


def layer_nodes(f: LayerOps | None, b: LayerOps | None, defer_attn_dw: bool = False) -> list[Node]:
    """The nodes of one ``TransformerLayerSchedulePlan.run`` (forward layer ``f``, backward layer
    ``b``, either None) in the order issued (module docstring); ``defer_attn_dw``: the backward's
    attention weight gradients left for after the chunk's layers (its first layer's)."""
    fn = dict(_forward_layer(f)) if f is not None else {}
    bn = dict(_backward_layer(b)) if b is not None else {}
    out: list[Node] = []
    for chain, name in _PAIR_ORDER:
        got = (fn if chain == "F" else bn).get(name)
        if got is not None and not (defer_attn_dw and chain == "B" and name == "attn_dw"):
            out.append(got)
    return out


def chunk_nodes(f: ChunkOps | None, b: ChunkOps | None) -> tuple[list[Node], int, int]:
    """``TransformerModelChunkSchedulePlan.run``'s nodes for forward chunk ``f`` and backward chunk
    ``b`` (either None), in the order issued, and the index of the forward's and the backward's
    closing work (``post_process`` forward, ``pre_process`` backward; module docstring)."""
    nf = len(f.layers) if f is not None else 0
    nb = len(b.layers) if b is not None else 0
    nodes: list[Node] = []
    if f is not None:
        nodes.append((COMP, "F", f.pre_f, False))
    if b is not None:
        nodes.append((COMP, "B", b.post_b, False))
    for i in range(min(nf, nb)):
        assert f is not None and b is not None
        nodes += layer_nodes(f.layers[i], b.layers[nb - 1 - i], defer_attn_dw=nb - 1 - i == 0)
    for i in range(min(nf, nb), nb):
        assert b is not None
        nodes += layer_nodes(None, b.layers[nb - 1 - i], defer_attn_dw=nb - 1 - i == 0)
    for i in range(min(nf, nb), nf):
        assert f is not None
        nodes += layer_nodes(f.layers[i], None)
    if b is not None and nb:
        nodes.append((COMP, "", b.layers[0].attn_dw, False))
    f_close = b_close = -1
    if f is not None:
        f_close = len(nodes)
        nodes.append((COMP, "F", f.post_f, False))
    if b is not None:
        b_close = len(nodes)
        nodes.append((COMP, "B", b.pre_b, False))
    return nodes, f_close, b_close


def simulate(nodes: list[Node], share: float = 1.0) -> list[tuple[float, float]]:
    """Each node's (start, end): a node starts once the node before it on its stream and (a chain
    node) the node before it in its chain have ended; a computation-stream node advances at
    ``share`` of its speed while an all-to-all node runs on the communication stream."""
    n = len(nodes)
    prev_stream: list[int] = [-1] * n
    prev_chain: list[int] = [-1] * n
    last_s = {COMP: -1, COMM: -1}
    last_c = {"F": -1, "B": -1}
    for k, (st, ch, _d, _a) in enumerate(nodes):
        prev_stream[k] = last_s[st]
        last_s[st] = k
        if ch:
            prev_chain[k] = last_c[ch]
            last_c[ch] = k
    queues = {st: [k for k in range(n) if nodes[k][0] == st] for st in (COMP, COMM)}
    head = {COMP: 0, COMM: 0}
    start = [0.0] * n
    end: list[float | None] = [None] * n
    left = [d for _s, _c, d, _a in nodes]
    running: dict[int, int] = {}  # stream -> node
    t = 0.0
    while any(head[st] < len(queues[st]) for st in queues) or running:
        for st in (COMP, COMM):  # start what may start now
            if st in running or head[st] >= len(queues[st]):
                continue
            k = queues[st][head[st]]
            deps = [j for j in (prev_stream[k], prev_chain[k]) if j >= 0]
            if all(end[j] is not None and end[j] <= t for j in deps):  # type: ignore[operator]
                running[st] = k
                start[k] = t
                head[st] += 1
        if not running:  # cannot happen: the first unstarted node's deps are all issued before it
            raise RuntimeError("chunk_plan.simulate: no node can start")
        a2a = COMM in running and nodes[running[COMM]][3]
        rate = {st: (share if st == COMP and a2a else 1.0) for st in running}
        dt = min(left[k] / rate[st] for st, k in running.items())
        t += dt
        for st, k in list(running.items()):
            left[k] -= dt * rate[st]
            if left[k] <= 1e-15 * max(1.0, nodes[k][2]):
                end[k] = t
                del running[st]
    return [(s, e if e is not None else s) for s, e in zip(start, end)]


def chunk_run(f: ChunkOps | None, b: ChunkOps | None, share: float = 1.0) -> ChunkRun:
    """The merged step of forward chunk ``f`` and backward chunk ``b`` (or either alone): its
    seconds (both streams done) and when the forward's and the backward's last node before their
    closing work end (:func:`chunk_nodes`, :func:`simulate`)."""
    nodes, f_close, b_close = chunk_nodes(f, b)
    times = simulate(nodes, share)
    total = max((e for _s, e in times), default=0.0)

    def sent(close: int, chain: str) -> float:  # its chain's last node before its closing work
        return max((times[k][1] for k in range(close) if nodes[k][1] == chain), default=0.0)

    return ChunkRun(total, sent(f_close, "F") if f_close >= 0 else 0.0, sent(b_close, "B") if b_close >= 0 else 0.0)


__all__ = ["COMM", "COMP", "ChunkOps", "ChunkRun", "LayerOps", "chunk_nodes", "chunk_run", "layer_nodes", "simulate"]
