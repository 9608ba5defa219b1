"""Expert parallelism (``--strategy dp,ep``) as Megatron-Core folds it, found in the program.

The MoE structure is read from the ops, not from names, so one function serves the zoo, the
catalog and imported HuggingFace programs (:func:`moe_layers`): each ``moe_gate_dispatch`` (its
batched output ``[B, E, C, H]``), the ``moe_combine`` that reads the experts' rows back, the 3-D
parameter stacks ``[E, in, out]`` read between them (the experts) and, in the backward, the
``moe_gate_dispatch_grad`` / ``moe_combine_grad`` of that layer.

The folding (Megatron-Core's: expert parallelism is carved out of data parallelism): outside the
experts (attention, dense MLPs, the router, embeddings, the head) the batch axis is co-sharded
over ``(dp, ep)`` (:func:`batch_entry`), i.e. data parallel over ``dp x ep`` ranks; each expert
stack has its expert axis 0 sharded over ``ep`` and is replicated over ``dp`` (expert data
parallel, EDP = dp); with ``megatron`` each expert is also tensor parallel over ``tp`` (ETP = tp,
Megatron-Core's default). The token exchange (:func:`expert_marks`):

- forward, dispatch: the dispatched tokens ``[B, E, C, H]`` go from batch over ``(dp, ep)`` to
  batch over ``dp`` and experts over ``ep``: one all-to-all over ``ep``;
- forward, combine: the experts' rows ``[B, E x C, H]`` back to batch over ``(dp, ep)`` before
  ``moe_combine``: one all-to-all over ``ep``;
- backward, the mirrors: the gradient of the rows back to experts over ``ep`` (after
  ``moe_combine_grad``) and the gradient of the dispatched tokens back to batch over ``(dp, ep)``
  (before ``moe_gate_dispatch_grad``): two all-to-alls.

ETP = 1 (``etp=1``: :func:`expert_fold`) spreads the experts over ``ep x tp``. With ``sp`` the model
is routed in tp chunks (:func:`config_for`: Megatron's token path): each tp rank dispatches its
own sequence shard ``[B, T, S/T, H]`` (chunk axis over tp), the experts are co-sharded ``(ep,
tp)`` and the dispatch and combine are one all-to-all each over the ep x tp group, with no tp
collective around the experts. An imported (``--hf``) model is routed so at its import
(:func:`tp_chunks`, :func:`spmdkit.models.hf.import_hf`).

Under cp (docs/experts.md "Under cp") the model is routed in cp chunks (cp x tp on the ETP = 1
token path), each cp rank its own tokens; :func:`expert_marks` keeps the chunk axis over cp on
every MoE tensor, so the all-to-alls over ep carry each rank's own tokens and nothing moves over
cp around a MoE layer (Megatron-Core's experts see no cp: ep and the expert-data-parallel group
are carved out of the dp x cp ranks).

With ``ep-from=cp`` (:func:`ep_from_cp`: Megatron-Core's expert group taking cp ranks where tp x
dp is narrower than it) ep is carved from the cp ranks instead: outside the experts the sequence
is over ``(cp, ep)`` (``(cp, ep, tp)`` under sp) and the batch over ``dp`` alone, the chunks
``(cp, ep)`` (x tp) give ep (and tp) to the experts by the dispatch, cp kept; the gradients as
under cp (an expert's over dp x cp, a dense one over dp x cp x ep).

The ops outside the experts see the batch co-sharded ``(dp, ep)``; the planner asks their rules on
the mesh with the two dims fused (:mod:`spmdkit.planner.fuse`), so no rule gathers it. Dense
parameters' gradients come out partial over ``dp`` and ``ep`` (reduced over both), the experts'
over ``dp`` only. ZeRO shards dense states over ``(dp, ep)`` and expert states over ``dp``
(:func:`zero_dims`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from spmdkit.core.dist_attr import Entry
from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh


@dataclass(frozen=True)
class MoeLayer:
    """One MoE layer of a program, as its ops give it."""

    #: moe_gate_dispatch's output [B, E, C, H] (the dispatched tokens)
    dispatched: str
    #: routed experts (E)
    experts: int
    #: moe_combine's x [B, E x C, H] (the experts' rows)
    rows: str
    #: the expert stacks [E, in, out] read between the dispatch and the combine
    stacks: tuple[str, ...]
    #: moe_gate_dispatch_grad's grad_y (the dispatched tokens' gradient), None without a backward
    grad_dispatched: str | None = None
    #: moe_combine_grad's grad_x (the rows' gradient), None without a backward
    grad_rows: str | None = None
    #: routed in chunks (Megatron's ETP = 1 token path): the dispatch's x [B, T, S/T, H], the
    #: dispatched tokens [B, T, E, C, H] and the rows [B, T, E x C, H]; None: one route a sequence
    chunks: str | None = None


def moe_layers(prog: Any) -> list[MoeLayer]:
    """The program's MoE layers in program order: each forward ``moe_gate_dispatch`` paired with
    the next ``moe_combine`` after it, the 3-D parameters with E rows read by the forward ops
    between them, and the backward ops of that layer (``moe_combine_grad`` reading the same rows,
    ``moe_gate_dispatch_grad`` reading the dispatch's combine weights). ProgramError naming
    ``--strategy ep`` for a dispatch that is not batched ([B, E, C, H]) or has no combine."""
    ops = list(prog.ops)
    tensors = prog.tensors
    out: list[MoeLayer] = []
    grad_y = {o.inputs.get("combine_weights"): o.inputs["grad_y"] for o in ops if o.rule == "moe_gate_dispatch_grad"}
    grad_x = {o.inputs.get("x"): o.outputs[0] for o in ops if o.rule == "moe_combine_grad"}
    for i, op in enumerate(ops):
        if op.rule != "moe_gate_dispatch" or op.phase != "forward":
            continue
        y, cw = op.outputs[0], op.outputs[1]
        if y is None or len(tensors[y].shape) not in (4, 5):
            raise ProgramError(f"--strategy ep: op {i} ({op.name or op.rule}) dispatches into "
                               f"{list(tensors[y].shape) if y else None}, not a batched [B, E, C, H] (expert "
                               f"parallelism needs the batch axis)")
        e = tensors[y].shape[-3]
        j = next((j for j in range(i + 1, len(ops)) if ops[j].rule == "moe_combine" and ops[j].phase == "forward"),
                 None)
        if j is None:
            raise ProgramError(f"--strategy ep: op {i} ({op.name or op.rule}) has no moe_combine after it")
        rows = ops[j].inputs["x"]
        stacks: list[str] = []
        for k in range(i + 1, j):
            for n in ops[k].input_names():
                t = tensors[n]
                if t.kind == "parameter" and len(t.shape) == 3 and t.shape[0] == e and n not in stacks:
                    stacks.append(n)
        x = op.inputs["x"]
        out.append(MoeLayer(y, e, rows, tuple(stacks), grad_y.get(cw), grad_x.get(rows),
                            x if len(tensors[y].shape) == 5 else None))
    return out


def batch_entry(dp: int | None, ep: int | None) -> Entry:
    """The batch axis' entry outside the experts: ``(dp, ep)`` co-sharded (data parallel over
    ``dp x ep``), one of them where the other is None, -1 with neither."""
    dims = [d for d in (dp, ep) if d is not None]
    return -1 if not dims else dims[0] if len(dims) == 1 else (dims[0], dims[1])


def check_ep(mesh: ProcessMesh, layers: list[MoeLayer], ep: int, batch: int | None, dp: int | None,
             fold: int | None = None, from_cp: bool = False) -> None:
    """ProgramError naming ``--strategy ep`` when the program has no MoE layer, ``--mesh`` when
    ``ep`` (with ETP = 1, ``ep x tp``: ``fold`` is the tp dim) does not divide a layer's experts
    (with the sizes that do) or when ``dp x ep`` (``dp`` alone with ``from_cp``: ep carved from
    the cp ranks, :func:`ep_from_cp`) does not divide the batch."""
    if not layers:
        raise ProgramError("--strategy ep: the model has no experts (no moe_gate_dispatch op): expert parallelism "
                           "needs a mixture-of-experts model")
    n = mesh.shape[ep]
    t = mesh.shape[fold] if fold is not None else 1
    for lay in layers:
        if lay.experts % (n * t):
            fits = [d for d in range(2, lay.experts + 1) if lay.experts % d == 0]
            some = ", ".join(map(str, fits[:-1])) + (" or " if len(fits) > 1 else "") + str(fits[-1]) if fits else ""
            if fold is not None:
                raise ProgramError(f"--mesh ep={n},{mesh.dim_names[fold]}={t}: with etp=1 the experts are spread over "
                                   f"ep x tp = {n * t} ranks, which does not divide the model's {lay.experts} experts"
                                   + (f"; an ep x tp of {some} does" if fits else ""))
            raise ProgramError(f"--mesh ep={n}: ep does not divide the model's {lay.experts} experts"
                               + (f"; an ep of {some} does" if fits else ""))
    ranks = (1 if from_cp else n) * (mesh.shape[dp] if dp is not None else 1)
    what = (f"dp = {mesh.shape[dp]}" if from_cp else f"dp x ep = {mesh.shape[dp]} x {n}") if dp is not None \
        else f"ep = {n}"
    check_batch(batch, ranks, f"{what} ranks")


def check_batch(batch: int | None, ranks: int, what: str) -> None:
    """ProgramError naming ``--batch`` where the ``ranks`` data-parallel ranks (``what``: the
    mesh dims they are) do not divide it: each rank takes whole sequences, as
    every framework the planner models splits a batch, never in pieces of 1 down to 0: Megatron-LM
    asserts ``global_batch_size % (micro_batch_size * data_parallel_size) == 0``
    (megatron/core/num_microbatches_calculator.py, d98e8a6), torchtitan's batch is
    ``local_batch_size`` sequences per dp rank (torchtitan/train.py, 8570415)."""
    if batch is not None and batch % ranks:
        raise ProgramError(f"--batch {batch}: data parallel over {what} needs a batch that is a multiple of {ranks} "
                           "(each rank whole sequences)")


def expert_marks(prog: Any, mesh: ProcessMesh, dm: Any, dp: int | None, ep: int,
                 layers: list[MoeLayer] | None = None, fold: int | None = None,
                 cp: int | None = None, from_cp: bool = False) -> frozenset[str]:
    """Mark the MoE tensors of ``prog`` in ``dm`` (:class:`spmdkit.strategies.strategy.Marks`:
    tensor -> dims_mapping, edited in place) for expert parallelism over mesh dim ``ep`` (batch
    over ``dp`` too where it is not None): each expert stack's axis 0 over ``ep``, the dispatched
    tokens ``[dp, ep, -1, -1]`` and the rows back at the batch entry, the gradients as their
    mirrors (module docstring). ``fold`` (ETP = 1: the tp mesh dim) spreads the experts over the
    co-shard ``(tp, ep)`` instead: the stacks, the dispatched tokens and the rows' gradient
    ``[dp, (tp, ep), ...]`` (:func:`expert_entry`); routed whole (no chunks), the rows and the
    dispatched tokens' gradient keep their expert axis over tp, as the all-to-all over ep leaves
    them (the planner gathers them or has moe_combine / moe_gate_dispatch_grad read each rank's
    own: ``local_rows``, ``local_experts``). ``cp`` (the cp mesh dim; the model routed in cp
    chunks, each cp rank its own tokens): the chunk axis stays over ``cp`` on every MoE tensor, so
    the all-to-alls over ep carry each cp rank's own tokens (:func:`chunk_entries`). ``from_cp``
    (``ep-from=cp``, :func:`ep_from_cp`): ep carved from the cp ranks, the batch over ``dp`` alone
    and the chunks over ``(cp, ep)`` (x tp), ep (and tp) moved onto the experts by the dispatch,
    cp kept. Returns the expert stacks (their gradients reduce over ``dp`` (x ``cp``) only; ZeRO
    shards their states over ``dp`` (x ``cp``)). The batch of the data inputs is the caller's."""
    b = batch_entry(dp, None if from_cp else ep)
    experts: set[str] = set()
    lays = layers if layers is not None else moe_layers(prog)
    # each chunked layer's (own, kept) entries, made once: the expert entry reads them all
    tokens = {i: chunk_entries(mesh, prog.tensors[lay.chunks].shape[1], fold, cp, ep if from_cp else None)
              for i, lay in enumerate(lays) if lay.chunks is not None}
    # ep-from=cp: the chunks (cp, ep, tp) give their minor tp and then ep to the experts, (tp, ep)
    e = expert_entry(ep, fold, not from_cp and any(t[0] != t[1] and fold is not None for t in tokens.values()))
    for i, lay in enumerate(lays):
        for p in lay.stacks:
            dm(p)[0] = e
            experts.add(p)
        c = 1 if lay.chunks is not None else 0  # the chunk axis after the batch
        own, kept = tokens.get(i, (-1, -1))
        d = dm(lay.dispatched)
        d[0], d[1 + c] = (dp if dp is not None else -1), e
        r = dm(lay.rows)
        r[0] = b
        if fold is not None and not c:  # ETP = 1 routed whole: the rows as the all-to-all over ep leaves
            r[1] = fold  # them, each tp rank its own experts' (moe_combine gathers them or combines them there)
        if c:  # the chunks: each rank's own tokens (own), those the experts' side keeps (kept)
            d[1] = kept
            r[1] = own
            x = dm(lay.chunks)
            x[0], x[1] = b, own
            for n in chunk_means(prog, lay):  # the aux loss' per-chunk means, their grads: kept on the chunks
                for m in (n, n + ".grad"):
                    if m in prog.tensors:
                        g = dm(m)
                        g[0], g[1] = b, own
        if lay.grad_dispatched is not None:
            g = dm(lay.grad_dispatched)
            g[0] = b
            if c:
                g[1] = own
            elif fold is not None:  # routed whole: the slots as the all-to-all over ep leaves them, each
                g[1] = fold  # tp rank its own experts' (moe_gate_dispatch_grad gathers them or reads its own)
        if lay.grad_rows is not None:
            g = dm(lay.grad_rows)
            g[0], g[1 + c] = (dp if dp is not None else -1), e
            if c:
                g[1] = kept
    return frozenset(experts)


def chunk_entries(mesh: ProcessMesh, chunks: int, fold: int | None, cp: int | None,
                  inner: int | None = None) -> tuple[Entry, Entry]:
    """(the chunk axis' entry where each rank holds its own tokens, its entry on the experts'
    side of the all-to-all) of a layer routed in ``chunks`` chunks a sequence: ``cp`` chunks
    over ``cp`` on both sides (the all-to-all over ep leaves them where they are); with ETP = 1
    (``fold``, the tp dim) and ``chunks`` = cp x tp (or tp without cp: Megatron's token path),
    ``(cp, tp)`` (``tp``), the tp share moved onto the experts by the all-to-all (``cp`` kept:
    ``-1`` without cp). ``inner`` (the ep dim carved from the cp ranks, ``ep-from=cp``): the
    sequence's ranks are ``(cp, ep)``, the chunks ``(cp, ep)`` (``(cp, ep, tp)``) and the
    dispatch moves ep (and tp) onto the experts, ``cp`` kept."""
    seq = () if cp is None else (cp,) if inner is None else (cp, inner)
    n = 1
    for d in seq:
        n *= mesh.shape[d]
    if fold is not None and chunks == n * mesh.shape[fold]:
        return (fold if cp is None else (*seq, fold)), (-1 if cp is None else cp)
    return ((seq[0] if len(seq) == 1 else seq), cp) if cp is not None and chunks == n else (-1, -1)


def expert_entry(ep: int, fold: int | None = None, chunked: bool = False) -> Entry:
    """The expert axis' entry: ``ep``, or with ETP = 1 (``fold``: the tp mesh dim) a co-shard of
    ``tp`` and ``ep``. Routed in chunks (Megatron's token path, ``chunked``): ``(ep, tp)``, so
    the dispatch moves the batch's ep and then the chunks' tp onto the expert axis, two
    all-to-alls the planner makes one over the ep x tp group. Else ``(tp, ep)``: tp major, so a
    tp rank's share of experts is a slice of tokens it already holds (gathered over tp before
    the dispatch) and the all-to-all over ep carries only that slice."""
    return ep if fold is None else (ep, fold) if chunked else (fold, ep)


def parse_etp(item: str, tp: int | None = None) -> str | None:
    """``etp=1`` -> ``"etp=1"``; ``etp=tp``, or the tp dim's size ``tp`` as a number (Megatron's
    ``--expert-tensor-parallel-size`` equal to ``--tensor-model-parallel-size``) -> ``""`` (the
    default: each expert tensor-parallel over tp, nothing to add); None where ``item`` is no etp
    item; ProgramError naming the item for another value."""
    key, eq, value = item.partition("=")
    if not eq or key.strip() != "etp":
        return None
    value = value.strip()
    if value == "1":
        return "etp=1"
    if value == "tp" or (tp is not None and value == str(tp)):
        return ""
    size = f"tp (the tp dim's size, {tp}: " if tp is not None else "tp ("
    raise ProgramError(f"--strategy etp={value}: expert tensor parallel is 1 (each expert whole, experts over ep x "
                       f"tp) or {size}each expert split over tp: the default)")


def chunk_means(prog: Any, lay: MoeLayer) -> list[str]:
    """The load-balancing loss' tensors on the chunks of a layer routed in chunks: the outputs of
    the forward ``cast`` / ``multiply`` / ``mean`` / ``sum`` (not over the batch or the chunk
    axis) reached from the gate values it dispatches by, of rank 3 or more (the per-chunk means
    ``[B, T, E]``; under cp each token's share ``[B, T, S/T, 1]`` and its factors)."""
    front = {op.inputs.get("gate_logits") for op in prog.ops if op.rule == "moe_gate_dispatch"
             and op.outputs[0] == lay.dispatched}
    out: list[str] = []
    for op in prog.ops:
        if op.phase != "forward" or op.rule not in ("cast", "multiply", "mean", "sum") or not front & set(
                op.input_names()):
            continue
        y = op.outputs[0]
        if {0, 1} & set(op.attrs.get("axis", ()) or ()) or y is None or len(prog.tensors[y].shape) < 3:
            continue
        front.add(y)
        out.append(y)
    return out


def chunk_inputs(prog: Any, layers: list[MoeLayer]) -> frozenset[str]:
    """The tensors that only the reshapes into the chunks of MoE layers routed in chunks read
    (the normalised tokens before a layer without shared experts): under ``sp`` they stay
    sequence-sharded over tp, each rank routing its own tokens, instead of gathered."""
    chunks = {lay.chunks for lay in layers if lay.chunks is not None}
    if not chunks:
        return frozenset()
    readers: dict[str, set[bool]] = {}
    for op in prog.ops:
        if op.phase != "forward":
            continue
        into = op.rule == "reshape" and op.outputs[0] in chunks
        for n in op.input_names():
            readers.setdefault(n, set()).add(into)
    return frozenset(n for n, r in readers.items() if r == {True})


def chunk_outputs(prog: Any) -> list[str]:
    """The outputs of MoE layers routed in chunks put back on the sequence: the forward
    ``reshape`` of a ``moe_combine``'s output ``[B, T, S/T, H]`` to ``[B, S, H]``."""
    combined = {op.outputs[0] for op in prog.ops if op.rule == "moe_combine" and op.phase == "forward"}
    return [op.outputs[0] for op in prog.ops if op.rule == "reshape" and op.phase == "forward"
            and op.inputs.get("x") in combined and len(prog.tensors[op.outputs[0]].shape) == 3]


def config_for(cfg: Any, mesh: ProcessMesh, strategy: Any) -> Any:
    """The zoo config (:class:`spmdkit.models.zoo_config.ModelConfig`) built for the strategy:
    under ``megatron,sp,ep,etp=1`` a MoE model routes each sequence in ``tp`` chunks
    (``moe_chunks``), one a tp rank, as Megatron's ETP = 1 token path has each rank dispatch its
    own sequence-parallel shard over the ep x tp group; under cp (the model already routed in
    ``cp`` chunks, :func:`spmdkit.strategies.context.moe_chunks`) each cp chunk split again in
    ``tp``: ``cp x tp`` chunks, one a rank of the (cp, tp) co-shard of the sequence; ``cfg``
    otherwise."""
    tp = tp_chunks(mesh, strategy)  # the tp size under megatron,sp,ep,etp=1, else 1
    if not cfg.experts or tp == 1:
        return cfg
    chunks = tp * (cfg.moe_chunks if cfg.cp > 1 else 1)
    return cfg.with_(moe_chunks=chunks) if cfg.seq % chunks == 0 else cfg


def tp_chunks(mesh: ProcessMesh, strategy: Any) -> int:
    """The chunks an imported (``--hf``) model's MoE blocks route each sequence (each cp rank's
    share) in beyond cp's (:func:`spmdkit.models.hf.import_hf`'s ``tp_chunks``): under
    ``megatron,sp,ep,etp=1`` the tp size, one chunk a tp rank (Megatron's ETP = 1 token path, as
    :func:`config_for` builds a zoo model); 1 otherwise."""
    st = set(strategy)
    if not {"megatron", "sp", "ep", "etp=1"} <= st or "tp" not in mesh.dim_names:
        return 1
    return int(mesh.shape[mesh.dim_index("tp")])


def check_tp_chunks(prog: Any, mesh: ProcessMesh, strategy: Any, layers: list[MoeLayer]) -> None:
    """ProgramError naming ``--strategy megatron,sp,ep,etp=1`` where an imported program's MoE
    layers are not routed in the chunks the strategy needs (:func:`tp_chunks`, times cp's under
    ``cp``, cp x ep's with ``ep-from=cp``): Megatron's token path has each tp rank route its own sequence shard, which the program
    must be traced for (``spmdkit plan --hf`` imports it so; a program routed whole would be planned
    otherwise than it says)."""
    st = set(strategy)
    n = tp_chunks(mesh, st)
    if n == 1:
        return
    want = n * (mesh.shape[mesh.dim_index("cp")] if "cp" in st and "cp" in mesh.dim_names else 1)
    if ep_from_cp(st) and "cp" in st and "ep" in mesh.dim_names:  # the sequence over cp x ep outside the experts
        want *= mesh.shape[mesh.dim_index("ep")]
    for lay in layers:
        got = prog.tensors[lay.chunks].shape[1] if lay.chunks is not None else 1
        if got != want:
            how = "each sequence whole" if got == 1 else f"each sequence in {got} chunks"
            raise ProgramError(f"--strategy megatron,sp,ep,etp=1: each tp rank routes its own tokens (Megatron's "
                               f"token path), {want} chunks a sequence on this mesh; the program routes {how} "
                               f"(import it for the strategy: spmdkit plan --hf does, import_hf(tp_chunks={n}))")


def parse_ep_from(item: str) -> str | None:
    """``ep-from=cp`` -> ``"ep-from=cp"`` (the expert group carved from the context-parallel
    ranks, :func:`ep_from_cp`); ``ep-from=dp`` -> ``""`` (the default: from the data-parallel
    ranks, nothing to add); None where ``item`` is no ep-from item; ProgramError naming the item
    for another value."""
    key, eq, value = item.partition("=")
    if not eq or key.strip() != "ep-from":
        return None
    value = value.strip()
    if value in ("cp", "dp"):
        return "ep-from=cp" if value == "cp" else ""
    raise ProgramError(f"--strategy ep-from={value}: the ep ranks are carved from dp (the default: data parallel over "
                       f"dp x ep outside the experts) or cp (the sequence over cp x ep outside the experts)")


def ep_from_cp(strategy: Mapping[str, Any] | Any) -> bool:
    """``ep-from=cp`` in the strategy (with ``ep`` and ``cp``, :func:`check_etp`): Megatron-Core's
    expert group folded over context-parallel ranks. Outside the experts the ep dim is one more
    cp dim (the sequence over ``(cp, ep)``, ep inside cp in rank order, attention's cp group
    ``cp x ep``), the batch over ``dp`` alone; the experts over ep (x tp with ETP = 1), their
    gradients reduced over ``dp x cp`` (EDP), a dense one over ``dp x cp x ep``."""
    return "ep-from=cp" in set(strategy)


def check_etp(items: list[str], mesh: ProcessMesh) -> None:
    """``etp=1`` needs ``ep`` and ``megatron`` in the strategy (and their mesh dims); ``ep-from=cp``
    ``ep`` and ``cp``."""
    if "ep-from=cp" in items:
        for need, what in (("ep", "expert parallelism (ep)"), ("cp", "context parallelism (cp)")):
            if need not in items:
                raise ProgramError(f"--strategy ep-from=cp: the expert group carved from the context-parallel ranks "
                                   f"needs {what} in --strategy")
    if "etp=1" not in items:
        return
    for need, what in (("ep", "expert parallelism (ep)"), ("megatron", "tensor parallelism (megatron)")):
        if need not in items:
            raise ProgramError(f"--strategy etp=1: expert tensor parallel = 1 folds the experts over ep x tp; it needs "
                               f"{what} in --strategy")


def expert_fold(mesh: ProcessMesh, strategy: Mapping[str, Any] | Any) -> int | None:
    """The tp mesh dim the experts are folded over (ETP = 1: ``etp=1`` in the strategy), else None."""
    st = set(strategy)
    return mesh.dim_index("tp") if "etp=1" in st and "megatron" in st and "ep" in st else None


def zero_dims(mesh: ProcessMesh, dp: int | None, ep: int | None, expert: bool) -> tuple[Entry, int] | None:
    """(the entry, the ranks) ZeRO shards a parameter's states over: a dense parameter's over the
    data-parallel ranks ``(dp, ep)``, an expert stack's over ``dp`` alone (EDP); None where there
    are none."""
    if expert:
        return None if dp is None else (dp, mesh.shape[dp])
    e = batch_entry(dp, ep)
    if e == -1:
        return None
    n = 1
    for d in ((e,) if isinstance(e, int) else e):
        n *= mesh.shape[d]
    return e, n


def ep_dim(mesh: ProcessMesh, strategy: Mapping[str, Any] | Any) -> int | None:
    """The ``ep`` mesh dim when the strategy has ``ep``, else None."""
    return mesh.dim_index("ep") if "ep" in set(strategy) else None


__all__ = ["MoeLayer", "batch_entry", "check_ep", "check_etp", "check_tp_chunks", "chunk_entries", "chunk_inputs", "chunk_outputs", "config_for", "ep_dim", "ep_from_cp", "expert_entry", "expert_fold", "expert_marks",
           "moe_layers", "parse_ep_from", "parse_etp", "tp_chunks", "zero_dims"]
