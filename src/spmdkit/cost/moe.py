"""The cost of mixture-of-experts layers beyond their ops' own formulas: the structure of each
MoE layer found in the program, the active parameters a token multiplies, the grouped GEMMs of
the experts and the load of the busiest expert-parallel rank. Standard library only.
docs/devices.md, "Mixture of experts".

- :func:`moe_layers` (program): every ``moe_gate_dispatch`` (forward) with its ``moe_combine``,
  found by STRUCTURE (the ops and the tensors between them, not parameter names): the experts
  ``E`` and ``top_k`` of the dispatch, the capacity, the tokens a sequence routes, the expert
  parameter stacks (rank >= 3 parameters read between dispatch and combine) and the tensors of
  the expert computation (the dispatched ``[B, E, C, H]`` through the combined rows).
- Grouped GEMM (:func:`grouped`): the experts' batched GEMMs ``[B, E, C, H] x [E, H, F]`` run as
  Megatron-Core's / torch's grouped GEMM, one GEMM per local expert over every token it
  received from every sequence (``M = B x C``), so tiles quantise once per expert, not per
  sequence: the GEMM-efficiency model (:mod:`spmdkit.cost.rates`) prices a small per-expert M
  (many experts, top-k of few tokens) as the slower GEMM it is. The local experts' GEMMs are ONE
  kernel (:func:`spmdkit.cost.rates.grouped_tile_utilisation`; under Megatron-Core one per
  round of :data:`TE_GEMM_STREAMS` experts, :func:`gemm_streams`): each expert's rows padded to the
  tile, the tiles of all of them in one grid over the SMs, the rows each expert of the busiest ep
  rank receives (:class:`ExpertRows`): the skew rule's hot expert and even rest or the
  histogram's counts as they are (:func:`busiest_experts`), under ``--moe-routing topk`` each
  count binomial over the tokens (a token picks a given expert with chance ``top_k / E``) and
  its tiles expected under a normal approximation, under ``balanced`` (or a capacity factor other
  than 1, or a histogram) exact. The weight gradient's K is the rows: its time, linear in K under
  the model (``K / (K + K0)``), is the mean expert's.
- Load imbalance (:func:`rank_load`): uniform routing gives every expert ``tokens x top_k / E``;
  ``--moe-skew F`` gives the busiest expert ``F`` times that and the others an even share of the
  rest (``--moe-skew NAME``: a published ``F``, :data:`spmdkit.program.runtime.SKEW_FIGURES`),
  ``--moe-histogram`` the measured tokens per expert. Experts sit on the ep ranks in
  contiguous blocks of ``E / ep`` (Megatron-Core's ``local_expert_indices``); the step waits
  for the busiest ep rank, whose load over the mean is ``rho = max_r sum_{e in r} n_e / (sum_e
  n_e / ep)``; with one skewed expert ``rho = (F + (E/ep - 1) (E - F) / (E - 1)) / (E/ep)``
  (1 without ep: one rank holds every expert). Under dropless routing (capacity = the mean,
  the zoo's default) the busiest rank's expert GEMMs, activations and the all-to-alls that
  deliver and return its tokens carry ``rho`` times the tokens; with a capacity factor other
  than 1 every expert runs its capacity's rows (above 1 the buffers padded to it, below 1 every
  expert full; tokens past it dropped either way: :attr:`MoeLayer.padded`) and skew changes
  nothing.
- Megatron-Core's alltoall dispatcher sorts the delivered rows by local expert and back
  (:func:`sorted_by_expert`): one more pass over the rows in each routing op.
- The dispatch and combine all-to-alls (:func:`expert_all_to_all`): under ``--moe-dispatcher
  alltoall`` (NCCL's all-to-all) a rank sends each of a token's ``top_k`` copies to the rank of
  its expert, so ``(N - 1) / N`` of them cross the network when the ep group spans ``N`` nodes.
  Under ``deepep`` (DeepEP's normal kernels, deepseek-ai/DeepEP README) a token crosses the
  network once per other node holding one of its experts and is forwarded inside that node over
  NVLink (:func:`spmdkit.cost.collectives.deduplicated_all_to_all`). The nodes a token reaches
  (:func:`nodes_reached`) follow from the routing: with experts in contiguous blocks of ``E / N``
  per node, a top-k over every expert reaches ``N (1 - C(E - E/N, k) / C(E, k))`` nodes on
  average (uniform routing); DeepSeek-V3's group-limited routing (``groups`` = its ``n_group``
  8, ``topk_groups`` = ``topk_group`` 4; report sec. 3.2, "node-limited routing": each token is
  sent to at most 4 nodes) picks ``topk_groups`` of ``groups`` groups, so with whole groups per
  node it reaches ``N (1 - C(G - G/N, M) / C(G, M))`` nodes: 4 of 8 (3.5 of them remote) where
  plain top-8 routing would reach 5.3 and NCCL's all-to-all sends 7 of the 8 copies off the node.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from spmdkit.core.dist_attr import entry_dims
from spmdkit.core.errors import ProgramError
from spmdkit.core.reshard import Step
from spmdkit.cost.collectives import NcclCostModel, buffer_bytes, deduplicated_all_to_all, time_of
from spmdkit.cost.nccl_p2p import a2a_ctas
from spmdkit.cost.rates import RowGroup
from spmdkit.engine.facts import LocalOp, OpCost
from spmdkit.engine.memo import Recent
from spmdkit.program.ir import Program, flat_refs
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import Runtime, skew_label


@dataclass(frozen=True)
class MoeLayer:
    """One MoE layer of a program (:func:`moe_layers`)."""

    dispatch: int
    combine: int
    experts: int
    top_k: int
    capacity: int
    #: tokens one dispatch row routes (a sequence's)
    tokens: int
    stacks: tuple[str, ...]
    #: the expert computation's forward tensors (dispatched tokens .. combined rows)
    tensors: frozenset[str]
    #: group-limited routing: the top_k among the experts of the topk_groups best of groups
    groups: int = 1
    topk_groups: int = 1

    @property
    def padded(self) -> bool:
        """The capacity is not the mean an expert receives, rounded up (``ceil(tokens x top_k /
        E)``, the capacity a factor of 1 or none builds: :func:`spmdkit.models.zoo_moe.capacity`,
        :func:`spmdkit.models.torch_import.moe.capacity_of`): a capacity factor above 1 pads every
        expert's buffer to it, one below 1 drops the tokens past a capacity every expert fills;
        either way each expert runs its capacity's rows and skew does not change the work. (The
        mean's own rounding, 251 for Mixtral's 1001 x 2 / 8 = 250.25, is no padding.)"""
        return self.capacity != -(-self.tokens * self.top_k // self.experts)


#: _scan's answers by the program's id (the value keeps the program)
_MEMO: Recent[tuple[Program, list[MoeLayer], dict[str, int]]] = Recent(16, by_id=True)


def _scan(prog: Program) -> tuple[list[MoeLayer], dict[str, int]]:
    got = _MEMO.get(id(prog), lambda: (prog, *_scan_layers(prog)))
    return got[1], got[2]


def _scan_layers(prog: Program) -> tuple[list[MoeLayer], dict[str, int]]:
    readers: dict[str, list[int]] = {}
    for i, op in enumerate(prog.ops):
        if op.phase == "forward":
            for n in op.input_names():
                readers.setdefault(n, []).append(i)
    layers: list[MoeLayer] = []
    for i, op in enumerate(prog.ops):
        if op.phase != "forward" or op.rule != "moe_gate_dispatch":
            continue
        outs = op.output_names()
        gl = op.inputs.get("gate_logits")
        if not outs or not isinstance(gl, str):
            continue
        seen: set[str] = set()
        stacks: list[str] = []
        todo, combine = [outs[0]], -1
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            for j in readers.get(n, ()):
                rop = prog.ops[j]
                if rop.rule == "moe_combine":
                    combine = j if combine < 0 else min(combine, j)
                    continue
                for p in rop.input_names():
                    t = prog.tensors[p]
                    if t.kind == "parameter" and len(t.shape) >= 3 and p not in stacks:
                        stacks.append(p)
                todo += [o for o in rop.output_names() if prog.tensors[o].kind != "parameter"]
        if combine < 0 or len(seen) > 10_000:
            continue
        gshape = prog.tensors[gl].shape
        layers.append(MoeLayer(i, combine, int(gshape[-1]), int(op.attrs.get("k", 1)), int(op.attrs.get("capacity", 0)),
                               int(gshape[-2]), tuple(stacks), frozenset(seen), int(op.attrs.get("groups", 1) or 1),
                               int(op.attrs.get("topk_groups", 1) or 1)))
    owner: dict[str, int] = {}
    for li, layer in enumerate(layers):
        for n in layer.tensors:
            owner[n] = li
    for n in prog.tensors:  # the gradients of the expert computation's tensors (autodiff: <name>.grad...)
        base, sep, _ = n.partition(".grad")
        if sep and base in owner and n not in owner:
            owner[n] = owner[base]
    return layers, owner


def moe_layers(prog: Program) -> list[MoeLayer]:
    """Every MoE layer of ``prog`` (memoised per program)."""
    return _scan(prog)[0]


def expert_tensors(prog: Program) -> dict[str, int]:
    """Tensor -> the index (in :func:`moe_layers`) of the MoE layer whose expert computation
    makes or reads it: the forward tensors and their gradients."""
    return _scan(prog)[1]


def active_share(prog: Program) -> dict[str, float]:
    """Expert parameter stack -> the share of it one token multiplies: ``top_k / E`` (the model
    FLOPs count active parameters, as MoE reports do; capacity padding is not model work)."""
    out: dict[str, float] = {}
    for layer in moe_layers(prog):
        for s in layer.stacks:
            if prog.tensors[s].shape[0] == layer.experts:
                out[s] = layer.top_k / layer.experts
    return out


# -- load imbalance ---------------------------------------------------------------------------------


def expert_dims(plan: Plan, layer: MoeLayer) -> tuple[int, ...]:
    """The mesh dims the layer's experts are spread over: those its stacks' expert axis is sharded
    on, the widest of its stacks' (the first of equals; () without expert parallelism)."""
    best: tuple[int, ...] = ()
    for s in layer.stacks:
        a = plan.attrs.get(s)
        if a is None or not a.dims_mapping or plan.program.tensors[s].shape[0] != layer.experts:
            continue
        dims = tuple(entry_dims(a.dims_mapping[0]))
        if math.prod(plan.mesh.shape[d] for d in dims) > math.prod(plan.mesh.shape[d] for d in best):
            best = dims
    return best


def ep_degree(plan: Plan, layer: MoeLayer) -> int:
    """The ranks the layer's experts are spread over (:func:`expert_dims`; 1 without expert
    parallelism)."""
    return math.prod(plan.mesh.shape[d] for d in expert_dims(plan, layer))


def _busiest_rank(h: Sequence[float], ep: int) -> int:
    """The ep rank whose block of ``len(h) / ep`` consecutive experts receives the most of the
    histogram ``h`` (the first of equals)."""
    per = len(h) // ep
    return max(range(ep), key=lambda r: sum(h[r * per:(r + 1) * per]))


def busiest_experts(rt: Runtime, experts: int, top_k: int, ep: int) -> tuple[tuple[float, int], ...] | None:
    """The busiest ep rank's local experts' tokens over the mean expert's, as ``(factor,
    experts)`` groups (module docstring: the skew's hot expert and the even rest, or the
    histogram's block of the largest sum; every expert on one rank without ep); None where uniform
    (or the experts do not split evenly over ``ep``). ProgramError naming the flag where the skew or
    the histogram cannot describe ``experts`` experts of ``top_k``."""
    ep = max(1, ep)
    if rt.moe_histogram is not None:
        h = rt.moe_histogram
        if len(h) != experts:
            raise ProgramError(f"--moe-histogram: {len(h)} experts given; the model's MoE layers have {experts}")
        hot = max(range(experts), key=lambda e: h[e])
        if h[hot] * top_k > sum(h) * (1 + 1e-9):  # a token's top_k experts are distinct: each at most once
            raise ProgramError(f"--moe-histogram: expert {hot} has {h[hot]:g} of the {sum(h):g} tokens routed, "
                               f"{h[hot] * experts / sum(h):.3g} x the mean; an expert receives at most every token "
                               f"once, {experts / top_k:g} x the mean ({experts} experts, top-{top_k})")
        if experts % ep:
            return None
        per, mean = experts // ep, sum(h) / experts
        busiest = _busiest_rank(h, ep)
        return tuple((x / mean, 1) for x in h[busiest * per:(busiest + 1) * per])
    f = rt.moe_skew
    if f > experts / top_k + 1e-9:
        raise ProgramError(f"--moe-skew {skew_label(f)}: an expert receives at most every token once, {experts / top_k:g} x "
                           f"the mean ({experts} experts, top-{top_k})")
    if f == 1.0 or experts % ep or experts <= 1:
        return None
    per = experts // ep
    return ((f, 1), ((experts - f) / (experts - 1), per - 1)) if per > 1 else ((f, 1),)


def rank_load(rt: Runtime, experts: int, top_k: int, ep: int) -> float:
    """The busiest ep rank's tokens over the mean rank's (module docstring): the mean of
    :func:`busiest_experts` (1 without ep); ProgramError as it gives."""
    groups = busiest_experts(rt, experts, top_k, ep)
    if groups is None or ep <= 1:
        return 1.0
    return sum(f * n for f, n in groups) / sum(n for _, n in groups)


@dataclass(frozen=True)
class ExpertRows:
    """How the busiest ep rank's local experts' rows spread around their mean (:func:`plan_rows`):
    ``factors`` the :func:`busiest_experts` groups (None: every expert the mean); ``share`` the
    chance ``top_k / E`` that a token picks one given expert under ``--moe-routing topk`` (each
    expert's count is then binomial over the tokens, taken as normal: :meth:`groups`), 0 where the
    counts are exact (``balanced`` routing, a measured histogram, capacity padding)."""

    factors: tuple[tuple[float, int], ...] | None
    share: float

    def groups(self, mean: float, local: int) -> tuple[RowGroup, ...]:
        """``(mean rows, sd, experts)`` of ``local`` experts whose rows average ``mean`` (the loaded
        GEMM's M): expert e's count ``n_e ~ Binomial(T, f_e k / E)`` with ``T = mu E / k`` the
        tokens the ep group routes (``mu = mean / rho``, the uniform mean), so ``E[n_e] = mu f_e``
        and ``var = mu f_e (1 - f_e k / E)``."""
        fs = self.factors if self.factors is not None and sum(n for _, n in self.factors) == local else ()
        if sum(f * n for f, n in fs) <= 0.0:  # not this rank's experts, or none of them loaded
            fs = ((1.0, local),)
        mu = mean * local / sum(f * n for f, n in fs)
        return tuple((mu * f, math.sqrt(max(0.0, mu * f * (1.0 - f * self.share))) if self.share else 0.0, n) for f, n in fs)


def load_summary(plan: Plan) -> dict[str, Any] | None:
    """What ``--moe-skew`` / ``--moe-histogram`` do to the plan's MoE layers, for the report:
    the flag, the ranks the experts are split over (``ep``), the busiest rank's load over the
    mean rank's (:func:`rank_load`; 1 where every expert runs its capacity: ``padded``) and, for
    a histogram, that rank and its experts; None under uniform routing or without MoE layers."""
    rt = plan.runtime
    layers = moe_layers(plan.program)
    if (rt.moe_skew == 1.0 and rt.moe_histogram is None) or not layers:
        return None
    layer = layers[0]
    ep = ep_degree(plan, layer)
    padded = all(la.padded for la in layers)
    out: dict[str, Any] = {"flag": "--moe-histogram" if rt.moe_histogram is not None else f"--moe-skew {skew_label(rt.moe_skew)}",
                           "ep": ep, "load": 1.0 if padded else rank_load(rt, layer.experts, layer.top_k, ep),
                           "padded": padded}
    h = rt.moe_histogram
    if h is not None and ep > 1 and layer.experts % ep == 0:
        per, r = layer.experts // ep, _busiest_rank(h, ep)
        out.update(rank=r, experts=[r * per, (r + 1) * per - 1])
    return out


def busiest_load(plan: Plan) -> dict[str, float]:
    """Tensor -> the factor its tokens carry on the busiest ep rank (:func:`rank_load`), for the
    expert computation of dropless MoE layers under expert parallelism; empty when uniform."""
    rt = plan.runtime
    if rt.moe_skew == 1.0 and rt.moe_histogram is None:
        return {}
    layers, owner = _scan(plan.program)
    if not layers:
        return {}
    loads = []
    for layer in layers:
        rho = rank_load(rt, layer.experts, layer.top_k, ep_degree(plan, layer))
        loads.append(1.0 if layer.padded else rho)
    return {n: loads[li] for n, li in owner.items() if loads[li] != 1.0}


def _scaled(shape: tuple[int, ...], rho: float) -> tuple[int, ...]:
    """``shape`` with its token (capacity) axis, the second last, times ``rho``."""
    if len(shape) < 2:
        return shape
    return (*shape[:-2], max(1, round(shape[-2] * rho)), shape[-1])


def loaded(lop: LocalOp, names_in: dict[str, list[str]], names_out: list[str | None], load: dict[str, float]
           ) -> LocalOp:
    """``lop`` with the token axis of every expert tensor scaled by its load (the busiest rank's
    share of the tokens); ``names_in`` / ``names_out``: the tensor names behind ``lop.ins`` /
    ``lop.outs``."""
    ins: dict[str, list[Any]] = {}
    for p, args in lop.ins.items():
        names = names_in.get(p, [])
        ins[p] = [(_scaled(s, load[names[k]]), b, dt) if k < len(names) and names[k] in load else (s, b, dt)
                  for k, (s, b, dt) in enumerate(args)]
    outs: list[Any] = []
    for k, o in enumerate(lop.outs):
        n = names_out[k] if k < len(names_out) else None
        outs.append(o if o is None or n is None or n not in load else (_scaled(o[0], load[n]), o[1], o[2]))
    return LocalOp(lop.rule, lop.attrs, ins, outs)


#: Compute streams Transformer Engine's ``GroupedLinear`` spreads a grouped GEMM's experts over
#: (TE 2.3-2.7, the Megatron-Core of 2025: ``nvte_multi_stream_cublas_gemm`` in
#: ``transformer_engine/common/gemm/cublaslt_gemm.cu`` issues ONE cuBLAS GEMM per expert, expert
#: ``i`` on compute stream ``i % 4``; ``num_compute_streams = 4`` in ``common/util/multi_stream.cpp``).
#: A single cuBLASLt grouped GEMM came to TE in 2026 (b9f401314, #2502).
TE_GEMM_STREAMS = 4


def gemm_streams(framework: str) -> int:
    """How many of a grouped GEMM's local experts share the SMs at once under ``framework``:
    Megatron-Core's ``TEGroupedMLP`` (:data:`TE_GEMM_STREAMS`: one cuBLAS GEMM an expert on 4
    streams, so the experts run in rounds of 4, each round's tiles one grid); 0 (every local
    expert's tiles in ONE grid) under torchtitan (``torch._grouped_mm``) and AutoModel
    (``grouped_gemm.ops.gmm``, a CUTLASS grouped kernel)."""
    return TE_GEMM_STREAMS if framework == "megatron" else 0


@lru_cache(maxsize=4096)
def _rounds(entry: tuple[int, int, int, int], spread: tuple[RowGroup, ...], streams: int, wgrad: bool
            ) -> tuple[tuple[tuple[int, int, int, int], tuple[RowGroup, ...]], ...]:
    """One grouped GEMM ``entry`` ``(experts, m, n, k)`` (:func:`grouped`) as the rounds of
    ``streams`` experts that run at once (:func:`gemm_streams`), in expert order: each round its
    own GEMM entry over its experts (M the round's mean rows an expert; the weight gradient's K
    stays the mean expert's) with the rows ``spread`` gives them."""
    el = entry[0]
    if streams <= 0 or el <= streams:
        return ((entry, spread),)
    if spread:
        experts = [(m, sd) for m, sd, n in spread for _ in range(n)]
    else:
        experts = [(float(entry[1]), 0.0)] * el
    out: list[tuple[tuple[int, int, int, int], tuple[RowGroup, ...]]] = []
    for a in range(0, el, streams):
        part = experts[a:a + streams]
        if wgrad:
            out.append(((len(part), entry[1], entry[2], entry[3]), ()))
            continue
        groups: list[RowGroup] = []
        for m, sd in part:
            if groups and groups[-1][:2] == (m, sd):
                groups[-1] = (m, sd, groups[-1][2] + 1)
            else:
                groups.append((m, sd, 1))
        mean = sum(m for m, _ in part) / len(part)
        out.append(((len(part), max(1, round(mean)), entry[2], entry[3]), tuple(groups) if spread else ()))
    return tuple(out)


def grouped(c: OpCost, lop: LocalOp, rows: ExpertRows | None = None, streams: int = 0) -> OpCost:
    """An expert GEMM's cost with its batched GEMMs ``(B x E_local, m, n, k)`` (x ``[B, E, C, H]``
    by the stack y ``[E, H, F]``) run as ONE grouped GEMM ``(E_local, B x m, n, k)``: each local
    expert's rows all its tokens, its rows as ``rows`` spreads them (:meth:`ExpertRows.groups`,
    the tiles summed over the experts: :func:`spmdkit.cost.rates.grouped_tile_utilisation`);
    the weight gradient ``(B x E_local, k, n, m)`` as ``(E_local, k, n, B x m)`` (its K is the
    tokens, summed; its time is linear in each expert's K, so the mean's is the sum's). With
    ``streams`` (:func:`gemm_streams`) the local experts run in rounds of that many, one grid a
    round (:func:`_rounds`)."""
    y = lop.one("y")
    if not c.gemms or y is None or len(y[0]) != 3:
        return c
    el = y[0][0]
    wgrad = -1
    if lop.rule.endswith("_grad") and len(lop.outs) > 1 and lop.outs[1] is not None:
        wgrad = 1 if lop.outs[0] is not None else 0
    out: list[tuple[int, int, int, int]] = []
    spread: list[tuple[RowGroup, ...]] = []
    for g, (b, m, n, k) in enumerate(c.gemms):
        if el <= 0 or b < el or b % el:
            out.append((b, m, n, k))
            spread.append(())
            continue
        sp: tuple[RowGroup, ...] = ()
        if g == wgrad:
            entry = (el, m, n, k * (b // el))
        else:
            entry, sp = (el, m * (b // el), n, k), (rows.groups(m * (b // el), el) if rows is not None else ())
        for e, r in _rounds(entry, sp, streams, g == wgrad):
            out.append(e)
            spread.append(r)
    return replace(c, gemms=tuple(out), grouped_rows=tuple(spread) if any(spread) else ())


#: plan_loads' answers by the plan's id (the value keeps the plan)
_LOADS: Recent[tuple[Plan, dict[str, float]]] = Recent(16, by_id=True)


def plan_loads(plan: Plan) -> dict[str, float]:
    """:func:`busiest_load` memoised per plan (a plan is frozen)."""
    return _LOADS.get(id(plan), lambda: (plan, busiest_load(plan)))[1]


#: plan_rows' answers by the plan's id (the value keeps the plan)
_ROWS: Recent[tuple[Plan, list[ExpertRows]]] = Recent(16, by_id=True)


def plan_rows(plan: Plan) -> list[ExpertRows]:
    """Per MoE layer (:func:`moe_layers`): how its busiest ep rank's experts' rows spread
    (:class:`ExpertRows`), memoised per plan."""
    return _ROWS.get(id(plan), lambda: (plan, _expert_rows(plan)))[1]


def _expert_rows(plan: Plan) -> list[ExpertRows]:
    rt = plan.runtime
    out = []
    for layer in moe_layers(plan.program):
        if layer.padded:  # the GEMMs run on the capacity, every expert alike
            out.append(ExpertRows(None, 0.0))
            continue
        share = layer.top_k / layer.experts if rt.moe_routing == "topk" and rt.moe_histogram is None else 0.0
        out.append(ExpertRows(busiest_experts(rt, layer.experts, layer.top_k, ep_degree(plan, layer)), share))
    return out


def combine_rows_unkept(plan: Plan, reads: dict[str, list[int]]) -> frozenset[str]:
    """Under ``--framework megatron``: the experts' output rows that a ``moe_combine``'s backward
    alone reads (``reads``: :func:`spmdkit.cost.memory_saved.value_reads`), for the combine weights'
    gradient. Megatron-Core keeps no such tensor: its experts multiply the routing probabilities
    in their activation (``megatron/core/transformer/moe/experts.py``,
    ``activation_func_with_probs``, since 2659630721 of 2025-04-09, "Memory efficient token
    permutation"), so the probabilities' gradient reads the activation's input (the fc1 output,
    kept for the activation's backward or, under ``moe_act`` recomputation, to run it again),
    and the unpermute after the combine all-to-all (``token_dispatcher.py``,
    ``MoEAlltoAllTokenDispatcher.token_unpermutation``: ``unpermute`` without probs) keeps
    nothing. Such rows live to their last forward reader. Empty under other frameworks. A table
    of the program alone (``reads`` is made from it), made once per program."""
    if plan.runtime.framework != "megatron":
        return frozenset()
    return plan.program.derived(  # type: ignore[no-any-return]
        "moe.combine_rows_unkept", lambda prog: _combine_rows_read_alone(prog, reads))


def _combine_rows_read_alone(prog: Program, reads: dict[str, list[int]]) -> frozenset[str]:
    out: set[str] = set()
    for op in prog.ops:
        x = op.inputs.get("x") if op.rule == "moe_combine_grad" else None
        if isinstance(x, str) and x in reads and all(
                prog.ops[i].rule == "moe_combine_grad" and prog.ops[i].inputs.get("x") == x for i in reads[x]):
            out.add(x)
    return frozenset(out)


def _expert_ops(prog: Program) -> list[tuple[dict[str, list[str]], list[str | None], int] | None]:
    """Per op of ``prog``: where it is part of an expert computation (it makes or reads one of
    :func:`expert_tensors`, and is not a routing op ``moe_*``), the tensor names behind its
    local inputs and outputs (:func:`loaded`) and the index of its layer, else None; found once
    per program."""
    owner = expert_tensors(prog)
    out: list[tuple[dict[str, list[str]], list[str | None], int] | None] = []
    for op in prog.ops:
        if not owner or op.rule.startswith("moe_"):
            out.append(None)
            continue
        names_in = {p: [n for n in flat_refs(v) if n is not None] for p, v in op.inputs.items()}
        names_out: list[str | None] = []
        for v in op.outputs:
            names_out += list(flat_refs(v))
        layer = next((owner[n] for n in [*(n for ns in names_in.values() for n in ns), *names_out] if n in owner), -1)
        out.append((names_in, names_out, layer) if layer >= 0 else None)
    return out


def expert_op_cost(plan: Plan, i: int, lop: LocalOp, cost_of: Any) -> OpCost | None:
    """The cost of op ``i`` where it is part of an expert computation (:func:`expert_tensors`):
    its tokens at the busiest ep rank's load (:func:`plan_loads`), its expert GEMMs grouped
    (:func:`grouped`) over that rank's experts' rows (:func:`plan_rows`); None for any other op (and for the routing ops themselves, which run
    on the tokens a rank sends)."""
    names = plan.program.derived("moe.expert_ops", _expert_ops)[i]
    if names is None:
        return None
    names_in, names_out, layer = names
    load = plan_loads(plan)
    if load:
        lop = loaded(lop, names_in, names_out, load)
    c: OpCost = cost_of(lop)
    return grouped(c, lop, plan_rows(plan)[layer], gemm_streams(plan.runtime.framework)) if c.matmul else c


#: The routing ops whose rows Megatron-Core's ``alltoall`` dispatcher sorts by local expert, and
#: where those rows are: ``(input name, or None for the op's first output)``
#: (:func:`sorted_by_expert`)
_SORTED: dict[str, str | None] = {"moe_gate_dispatch": None, "moe_combine": "x", "moe_gate_dispatch_grad": "grad_y",
                                  "moe_combine_grad": None}


def _layer_of(prog: Program, i: int) -> int:
    """The MoE layer (:func:`moe_layers`) whose routing op ``i`` is: the forward dispatch's own
    index, else the layer owning one of its tensors (:func:`expert_tensors`); -1 if none."""
    layers, owner = _scan(prog)
    for li, layer in enumerate(layers):
        if layer.dispatch == i:
            return li
    op = prog.ops[i]
    for n in [*op.input_names(), *op.output_names()]:
        if n in owner:
            return owner[n]
    return -1


def sorted_by_expert(plan: Plan, i: int, lop: LocalOp, c: OpCost) -> OpCost:
    """A routing op's cost under ``--moe-dispatcher alltoall`` (Megatron-Core's
    ``MoEAlltoAllTokenDispatcher``, ``megatron/core/transformer/moe/token_dispatcher.py`` at
    1e057005) with more than one local expert: the rows an all-to-all delivers arrive grouped by
    source rank, so ``token_permutation`` sorts them by local expert after the dispatch
    all-to-all (``sort_chunks_by_idxs``, "Permutation 2") and ``token_unpermutation`` sorts them
    back before the combine's ("Unpermutation 2"), each one more pass over the rows (read and
    written, one kernel: TE's ``moe_sort_chunks_by_index`` under ``--moe-permute-fusion``); their
    backward sorts the gradients the same way. The dispatch and the combine ops carry the forward
    passes, their gradients' ops the backward's, on the rows the busiest rank holds
    (:func:`plan_loads`). DeepEP (``flex``) permutes once on the receiving side, the pass the
    routing ops already count; one local expert needs no sort, and without expert parallelism
    no all-to-all is planned (the permutation the dispatch counts already orders the rows by
    expert). The routing probabilities sorted
    beside the rows (4 bytes a row against ``2 H``) are not counted. ``c`` unchanged otherwise."""
    op = plan.program.ops[i]
    where = _SORTED.get(op.rule, "")
    if where == "" or plan.runtime.moe_dispatcher != "alltoall" or plan.runtime.framework != "megatron":
        return c
    li = _layer_of(plan.program, i)
    if li < 0:
        return c
    layer = moe_layers(plan.program)[li]
    ep = ep_degree(plan, layer)
    if ep <= 1 or layer.experts // ep <= 1:
        return c
    name: Any = (op.output_names() or [""])[0] if where is None else op.inputs.get(where)
    t = (lop.outs[0] if lop.outs else None) if where is None else lop.one(where)
    if t is None:
        return c
    rows = math.prod(t[0]) * t[1] * plan_loads(plan).get(name if isinstance(name, str) else "", 1.0)
    return replace(c, bytes=c.bytes + 2.0 * rows, kernels=c.kernels + 1)


# -- the dispatch and combine all-to-alls -----------------------------------------------------------


def _spread(total: int, per: int, picked: int) -> float:
    """Bins of ``per`` consecutive units (of ``total``) that ``picked`` distinct units drawn
    uniformly at random fall in, on average: ``bins (1 - C(total - per, picked) / C(total, picked))``."""
    if per <= 0 or total % per or picked <= 0:
        return float(max(1, min(picked, total // max(1, per))))
    picked = min(picked, total)
    return total // per * (1.0 - math.comb(total - per, picked) / math.comb(total, picked))


def _blocks(experts: int, top_k: int, per: int) -> float:
    """Blocks of ``per`` consecutive experts that a token's experts ``t k .. t k + k - 1`` (mod E)
    touch, averaged over the tokens (AutoModel's FakeBalancedGate)."""
    starts = sorted({(t * top_k) % experts for t in range(experts)})
    return sum(len({((s0 + j) % experts) // per for j in range(top_k)}) for s0 in starts) / len(starts)


def reached(layer: MoeLayer, nodes: int, ranks: int, routing: str = "topk") -> tuple[float, float]:
    """(nodes, ranks) a token's ``top_k`` experts sit on, on average, with the experts in
    contiguous blocks of ``E / ranks`` per ep rank and ``E / nodes`` per node (module docstring):
    ``routing`` ``topk`` the model's router (uniform), ``balanced`` the consecutive experts of
    AutoModel's fake balanced gate."""
    e, k = layer.experts, layer.top_k
    nodes, ranks = max(1, nodes), max(1, ranks)
    if e % ranks or ranks % nodes:
        return float(min(nodes, k)), float(min(ranks, k))
    if routing == "balanced":
        return _blocks(e, k, e // nodes), _blocks(e, k, e // ranks)
    g, m = layer.groups, layer.topk_groups
    if 1 < g and m < g:
        n_nodes = _spread(g, g // nodes, m) if g % nodes == 0 else _spread(e, e // nodes, k)
        n_ranks = _spread(m * e // g, e // ranks, k) if ranks % g == 0 else _spread(e, e // ranks, k)
        return n_nodes, n_ranks
    return _spread(e, e // nodes, k), _spread(e, e // ranks, k)


#: Streaming multiprocessors DeepEP's normal dispatch and combine kernels keep while they run:
#: Megatron-Core's ``TransformerConfig.moe_deepep_num_sms``, 20 by default (the zoo's code of the
#: time; later versions default to None, which keeps DeepEP v1's 20).
DEEPEP_SMS = 20


def a2a_compute_share(plan: Plan, sms: int, p2p_channels: tuple[int, int] = (0, 0)) -> float:
    """The share of a GPU of ``sms`` SMs left to other work while a MoE all-to-all runs beside it
    (``--ep-comm-overlap``'s merged steps): under ``--moe-dispatcher deepep`` DeepEP's kernels
    keep :data:`DEEPEP_SMS` of them, ``(sms - 20) / sms`` (0.848 on an H100's 132); under
    ``alltoall`` NCCL's send/recv kernel keeps one SM per CTA, ``(sms - ctas) / sms``
    (:func:`nccl_a2a_ctas`: 0.970 for an ep group of 16 over two H100 nodes, 0.758 for 8 in one);
    1 where the device gives no NCCL channel counts (``p2p_channels``: the device's
    ``nccl_p2p_channels``) or the cost model is not NCCL's."""
    if plan.runtime.moe_dispatcher == "deepep":
        return (sms - DEEPEP_SMS) / sms if sms > DEEPEP_SMS else 1.0
    ctas = nccl_a2a_ctas(plan, p2p_channels)
    return (sms - ctas) / sms if 0 < ctas < sms else 1.0


def nccl_a2a_ctas(plan: Plan, p2p_channels: tuple[int, int]) -> int:
    """The CTAs NCCL's all-to-all over the plan's ep group launches (:func:`spmdkit.cost.nccl_p2p.a2a_ctas`,
    messages of megabytes): the group of the first MoE layer's expert dims, on ``p2p_channels[0]``
    channels in one node or ``p2p_channels[1]`` across nodes; 0 without expert parallelism, an NCCL
    cost model or a channel count."""
    if not isinstance(plan.cost, NcclCostModel):
        return 0
    for layer in moe_layers(plan.program):
        dims = expert_dims(plan, layer)
        if dims:
            g = plan.cost.group(dims)
            return a2a_ctas(g.ranks, g.per_node, p2p_channels[0] if g.nodes <= 1 else p2p_channels[1])
    return 0


def expert_all_to_all(plan: Plan, tensor: str, s: Step) -> float:
    """Seconds of the all-to-all step ``s`` of ``tensor``: for a MoE layer's dispatched tokens,
    rows and their gradients, at the busiest ep rank's load (:func:`plan_loads`) and by
    ``--moe-dispatcher`` (module docstring); ``s.time_s`` for any other tensor."""
    li = expert_tensors(plan.program).get(tensor)
    if li is None:
        return s.time_s
    layer = moe_layers(plan.program)[li]
    rho = plan_loads(plan).get(tensor, 1.0)
    deepep = plan.runtime.moe_dispatcher == "deepep" and isinstance(plan.cost, NcclCostModel)
    if rho == 1.0 and not deepep:
        return s.time_s
    n = math.prod(plan.mesh.shape[d] for d in s.mesh_dims)
    buf = buffer_bytes(s.kind, s.bytes_per_rank, n) * rho
    if not deepep:
        return time_of(plan.cost, s.kind, s.mesh_dims, buf, plan.mesh.shape)
    assert isinstance(plan.cost, NcclCostModel)
    g = plan.cost.group(s.mesh_dims)
    d_nodes, d_ranks = reached(layer, g.nodes, g.ranks, plan.runtime.moe_routing)
    # the buffer holds capacity x experts slots of a token each; a rank's tokens are tokens x (the
    # sequences it routes): each crosses to the other nodes and ranks holding its experts once
    token_bytes = buf * layer.tokens / max(1, layer.capacity * layer.experts)
    net = token_bytes * d_nodes * (g.nodes - 1) / g.nodes
    nvl = token_bytes * d_ranks * (g.ranks - 1) / g.ranks
    return deduplicated_all_to_all(net, nvl, g, plan.cost.fabric)


__all__ = ["ExpertRows", "MoeLayer", "active_share", "busiest_experts", "busiest_load", "combine_rows_unkept", "ep_degree", "expert_dims", "expert_all_to_all", "expert_op_cost",
           "expert_tensors", "gemm_streams", "grouped", "load_summary", "loaded", "moe_layers", "plan_loads", "plan_rows", "rank_load",
           "reached", "sorted_by_expert"]
