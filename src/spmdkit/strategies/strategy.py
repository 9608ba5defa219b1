"""Parallel strategies as annotations on a zoo model, over named mesh dims.

``--strategy`` takes a comma list of:

- ``dp``: data parallel over the ``dp`` mesh dim: the batch axis of the inputs (tokens,
  labels, positions) sharded; parameters, their optimizer states and updates replicated over
  ``dp``, so each parameter gradient (partial over ``dp``) is all-reduced before the update.
- ``megatron`` (``tp``): Megatron-LM tensor parallel over ``tp``: q/k/v, gate/up (and GPT-2's
  fc1) column-parallel (output features sharded) with their biases (role ``column_bias``),
  output / down (fc2) projections row-parallel (input features sharded; their biases, role
  ``bias``, replicated), the embedding and the LM head vocab-parallel; the loss is
  ``c_softmax_with_cross_entropy`` over the vocab-sharded logits. A stack of experts
  ``[E, in, out]`` is sharded as one expert's projection (each expert tensor-parallel, as
  Megatron-Core's expert-tensor-parallel = tp); the MoE router and MLA's down projections
  (roles ``router``, ``replicated``) stay replicated, as Megatron keeps them.
- ``sp``: Megatron sequence parallel (with ``megatron``): the residual stream is sharded on
  its sequence axis over ``tp``, the normalised activations that feed the column-parallel
  projections are gathered: the all-reduces become all-gather / reduce-scatter pairs.
- ``ep``: expert parallelism over the ``ep`` mesh dim, folded into data parallelism as
  Megatron-Core does (:mod:`spmdkit.strategies.experts`, docs/experts.md): outside the experts
  the batch co-sharded over ``(dp, ep)``, each expert stack's expert axis over ``ep``, the
  tokens dispatched and combined by one all-to-all over ``ep`` each way.
- ``etp=1`` (with ``ep`` and ``megatron``): Megatron-Core's ``--expert-tensor-parallel-size 1``:
  each expert whole (not tensor-split), the experts spread over the ``ep x tp`` ranks (a
  co-shard of the expert axis) while attention stays tensor-parallel over ``tp``; with ``sp``
  each tp rank routes its own sequence shard (the model built with ``moe_chunks``, Megatron's
  token path: one all-to-all over the ep x tp group each way, docs/experts.md);
  ``etp=tp`` is the default (each expert split over ``tp``) and adds nothing.
- ``cp``: context parallelism over the ``cp`` mesh dim (:mod:`spmdkit.strategies.context`,
  docs/context.md): the sequence of every activation outside attention split over ``cp``,
  attention by ``cp_attention`` (``cp-attention=allgather|ring|alltoall`` and
  ``cp-balance=zigzag|none`` items, added by ``--cp-attention`` / ``--cp-balance``); gradients
  reduced over dp x cp, ZeRO's states sharded over it; a MoE model routed one chunk a cp rank.
- ``ep-from=cp`` (with ``ep`` and ``cp``): the expert group carved from the context-parallel
  ranks, not the data-parallel ones (Megatron-Core's folding where tp x dp is narrower than its
  expert group): outside the experts ``ep`` is one more cp dim (the sequence over ``(cp, ep)``,
  the batch over ``dp`` alone); ``ep-from=dp`` is the default and adds nothing.
- ``zero1`` / ``zero2`` (``zero``) / ``zero3`` (``fsdp``): ZeRO over ``dp``
  (:func:`optimizer_layouts`): optimizer states (moments, fp32 master weights) sharded on
  their first axis not already sharded that ``dp`` divides, or where none does unevenly on
  their largest (:func:`zero_axis`: real ZeRO shards flat buffers by bytes, whatever
  ``dp`` divides); zero1 all-reduces each gradient,
  zero2 reduce-scatters it, zero3 also stores the parameter sharded and gathers it before its
  forward and backward readers (:func:`zero3_storage`). The update runs on the shards; the
  updated parameter is held as the parameter (all-gathered under zero1/2).

``megatron`` (or ``ep``, ``cp``) alone means ``dp,megatron`` when the mesh has a ``dp`` dim; every
strategy needs its mesh dims (``dp`` / ``tp`` / ``ep``) to exist (with ``ep`` and no ``dp`` dim,
ZeRO shards over the ep ranks). User annotations (tensor -> dims_mapping)
are applied last and win.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.core.mesh import MAX_MESH_RANKS, ProcessMesh
from spmdkit.models.zoo import Model, ModelConfig
from spmdkit.strategies.context import check_options as check_cp_options
from spmdkit.strategies.context import cp_marks, seq_dims, seq_entry
from spmdkit.strategies.context import parse_option as parse_cp_option
from spmdkit.strategies.context import zero_dims as cp_zero_dims
from spmdkit.strategies.experts import (
    batch_entry,
    check_batch,
    check_ep,
    check_etp,
    chunk_inputs,
    chunk_outputs,
    ep_dim,
    ep_from_cp,
    expert_fold,
    expert_marks,
    moe_layers,
    parse_ep_from,
    parse_etp,
    zero_dims,
)

STRATEGIES = ("dp", "megatron", "sp", "ep", "cp", "zero1", "zero2", "zero3")
_ALIASES = {"tp": "megatron", "ddp": "dp", "zero": "zero2", "fsdp": "zero3"}


#: The most ranks a ``--mesh`` may have: the core's limit (2**20, about a million devices),
#: checked here before any mesh is built so the CLI names ``--mesh``.
MAX_RANKS = MAX_MESH_RANKS

_MESH_PART = re.compile(r"([A-Za-z_][A-Za-z0-9_]*) *= *([0-9]{1,9})")


def _cut(text: str, n: int = 80) -> str:
    """``text`` for an error message, cut to about ``n`` characters."""
    return repr(text) if len(text) <= n else repr(text[:n]) + f"... ({len(text)} characters)"


def parse_mesh(text: str) -> ProcessMesh:
    """``"dp=2,tp=4"`` -> a 2x4 mesh with dims named dp and tp. Names are identifiers
    (ASCII letters, digits, ``_``), sizes ASCII decimal ints >= 1, names distinct, at most
    :data:`MAX_RANKS` ranks in all."""
    names: list[str] = []
    sizes: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        m = _MESH_PART.fullmatch(part)
        if m is None or int(m.group(2)) < 1:
            raise ProgramError(f"--mesh {_cut(text)}: {_cut(part, 40)} is not name=size (an identifier, "
                               f"an integer >= 1), e.g. dp=2,tp=4")
        if m.group(1) in names:
            raise ProgramError(f"--mesh {_cut(text)}: dim name {m.group(1)!r} is given twice")
        names.append(m.group(1))
        sizes.append(int(m.group(2)))
        n = 1
        for k in sizes:
            n *= k
        if n > MAX_RANKS:
            raise ProgramError(f"--mesh {_cut(text)}: more than {MAX_RANKS} ranks (the limit)")
    if not sizes:
        raise ProgramError(f"--mesh {_cut(text)}: no mesh dims")
    return ProcessMesh(sizes, dim_names=names)


def strategy_items(text: str | Iterable[str] | None) -> list[str]:
    """``--strategy``'s items: ``text`` split on commas (or its items), each stripped, the empty
    ones dropped (``None``: none)."""
    return [s.strip() for s in ((text or "").split(",") if isinstance(text, str) or text is None else text)
            if s.strip()]


def canonical_items(text: str | Iterable[str] | None) -> list[str]:
    """:func:`strategy_items` with the aliases by their names (``tp`` megatron, ``ddp`` dp, ``zero``
    zero2, ``fsdp`` zero3)."""
    return [_ALIASES.get(s, s) for s in strategy_items(text)]


def parse_strategy(text: str | Iterable[str], mesh: ProcessMesh) -> tuple[str, ...]:
    items = strategy_items(text)
    out: list[str] = []
    for s in items:
        s = _ALIASES.get(s, s)
        if s == "none":
            continue
        opt = parse_cp_option(s)
        etp = parse_etp(s, mesh.shape[mesh.dim_index('tp')] if 'tp' in mesh.dim_names else None)
        if etp is None:
            etp = parse_ep_from(s)
        if etp is not None:
            if not etp:
                continue
            s = etp
        elif opt is not None:
            s = opt
        elif s not in STRATEGIES:
            raise ProgramError(f"--strategy: unknown strategy {_cut(s, 40)} (one of {', '.join(STRATEGIES)}; "
                               f"tp = megatron, zero = zero2, fsdp = zero3)")
        if s not in out:
            out.append(s)
    if ("megatron" in out or "ep" in out or "cp" in out) and "dp" not in out and "dp" in mesh.dim_names:
        out.insert(0, "dp")
    zeros = [s for s in out if s.startswith("zero")]
    if len(zeros) > 1:
        raise ProgramError(f"--strategy: {' and '.join(zeros)}: give one ZeRO stage")
    if zeros and "dp" not in out and (("ep" not in out and "cp" not in out) or "dp" in mesh.dim_names):
        out.insert(0, "dp")  # (with ep / cp and no dp dim: ZeRO over the ep / cp ranks)
    check_cp_options([s for s in out if s not in ("etp=1", "ep-from=cp")], mesh)
    check_etp(out, mesh)
    opts = [s for s in out if s.startswith(("cp-attention=", "cp-balance="))]
    if opts and "cp" in mesh.dim_names and all(mesh.shape[d] == 1 for d in seq_dims(mesh, out)):
        k, _, v = opts[0].partition("=")  # (accepted before and changed nothing: no sequence is split)
        raise ProgramError(f"--{k} {v}: --mesh cp=1 splits no sequence, so no attention is split for it to run; give a cp dim "
                           f"of 2 or more")
    for s in out:
        if s == "cp" or "=" in s:
            continue
        need = "tp" if s in ("megatron", "sp") else "ep" if s == "ep" else "dp"
        if need == "dp" and s != "dp" and ("ep" in out or "cp" in out) and "dp" not in mesh.dim_names:
            continue
        if need not in mesh.dim_names:
            raise ProgramError(f"--strategy {s}: the mesh has no {need!r} dim (mesh dims: {', '.join(mesh.dim_names)})")
    if "sp" in out and "megatron" not in out:
        raise ProgramError("--strategy sp: sequence parallel needs megatron (tensor parallel) too")
    return tuple(out)


def strategy_dims(mesh: ProcessMesh, strategy: Iterable[str]) -> tuple[set[str], int | None, int | None]:
    """(the strategies as a set, the dp mesh dim or None, the tp mesh dim or None (megatron))."""
    st = set(strategy)
    return (st, mesh.dim_index("dp") if "dp" in st else None,
            mesh.dim_index("tp") if "megatron" in st else None)


def tp_problem(cfg: ModelConfig, tp: int, sp: bool = False, etp1: bool = False) -> str | None:
    """Why Megatron's tensor parallelism over ``tp`` ranks cannot split the zoo model ``cfg``
    evenly, or None: the attention heads, the MLP's hidden size (each expert's too), the
    vocabulary (the embedding and the head are vocab-parallel), Gated DeltaNet's key heads and,
    under sequence parallelism, the sequence must each be a multiple of ``tp``; the kv heads a
    multiple of ``tp`` or a divisor of it (fewer kv heads than ``tp``: :func:`tp_notes`). An uneven
    fallback would gather whole tensors where Megatron shards them: refused instead. ``etp1``
    (ETP = 1): the routed experts stay whole, only the shared experts' width (``shared_experts x
    moe_ffn``) is split."""
    if tp <= 1:
        return None
    dense_ffn = cfg.ffn if not cfg.experts or cfg.dense_layers else None  # a layer's dense MLP
    moe_ffn = cfg.expert_ffn if cfg.experts else None  # each expert's (the shared ones' too)
    shared = moe_ffn * cfg.shared_experts if etp1 and moe_ffn is not None and cfg.shared_experts else None
    moe_ffn = None if etp1 else moe_ffn
    kv = None if cfg.kv_lora_rank or tp % cfg.n_kv == 0 else cfg.n_kv
    counts = [(cfg.heads, f"{cfg.heads} attention heads"),
              (kv, f"{cfg.n_kv} kv heads (each rank must hold whole kv heads, or a share of one that tp "
                   f"divides evenly)"),
              (dense_ffn, f"FFN hidden size {cfg.ffn}"), (moe_ffn, f"expert FFN hidden size {moe_ffn}"),
              (shared, f"shared experts' FFN width {shared}"),
              (cfg.vocab, f"vocabulary of {cfg.vocab} (Megatron-LM pads it: --make-vocab-size-divisible-by 128 "
                          f"pads it to {-(-cfg.vocab // (128 * tp)) * 128 * tp}, a multiple of 128 x tp={tp})"),
              (cfg.seq if sp else None, f"sequence of {cfg.seq} tokens that sequence parallel splits"),
              (cfg.linear_key_heads if cfg.full_attention_interval else None,
               f"{cfg.linear_key_heads} Gated DeltaNet key heads")]
    for n, what in counts:
        if n is not None and n % tp:
            fits = [d for d in range(2, min(n, 128) + 1) if n % d == 0][:8]
            some = ", ".join(map(str, fits[:-1])) + (" or " if len(fits) > 1 else "") + str(fits[-1]) if fits else ""
            return f"tp={tp} does not divide the model's {what}" + (f"; a tp of {some} does" if fits else "")
    return None


def tp_comm_overlap_problem(strategy: Iterable[str], text: str, tp: int) -> str | None:
    """Why ``--tp-comm-overlap`` cannot run with the strategy ``strategy`` (as given: ``text``) over
    ``tp`` ranks, else None: it overlaps sequence parallelism's all-gathers and reduce-scatters with
    the GEMMs, and plain megatron over a tp dim of 2 or more has none (its all-reduces block);
    Megatron-LM refuses the pair ("Tensor parallel communication/GEMM overlap can happen only when
    sequence parallelism is enabled", megatron/training/arguments.py, f2e5db402c and d98e8a6), and
    torchtitan's async TP runs on its sequence-parallel TP plan. ``plan`` refuses it, ``--devices``
    does not plan it."""
    st = set(strategy)
    if "megatron" in st and "sp" not in st and tp > 1:
        return (f"--tp-comm-overlap: overlaps sequence parallelism's all-gathers and reduce-scatters with the "
                f"GEMMs; --strategy {text} over tp={tp} has none (its all-reduces block; Megatron-LM asserts "
                f"sequence parallelism with it): add sp, --strategy megatron,sp")
    return None


def tp_notes(cfg: ModelConfig, tp: int) -> list[str]:
    """What the plan of ``cfg`` over ``tp`` ranks does that Megatron-Core would not: fewer kv
    heads than ``tp`` (dividing it) are each split over ``tp / kv`` ranks, and the k / v
    projections gathered before attention (Megatron-Core refuses it; vLLM and the HF strategy
    replicate the kv heads instead)."""
    if tp <= 1 or cfg.kv_lora_rank or cfg.n_kv >= tp or tp % cfg.n_kv:
        return []
    return [f"the model's {cfg.n_kv} kv heads are fewer than tp={tp}: each is split over {tp // cfg.n_kv} ranks "
            f"and the k / v projections are all-gathered before attention (Megatron-Core needs tp to divide "
            f"the kv heads)"]


def check_tp(model: Model, mesh: ProcessMesh, tp: int, st: set[str]) -> None:
    """ProgramError naming ``--mesh`` and its tp dim, with the count :func:`tp_problem` finds; a
    UserWarning for each of :func:`tp_notes` (the CLI prints it as a ``warning:`` line)."""
    dim = f"--mesh {mesh.dim_names[tp]}={mesh.shape[tp]}"
    why = tp_problem(model.config, mesh.shape[tp], "sp" in st, "etp=1" in st)
    if why is not None:
        raise ProgramError(f"{dim}: megatron splits evenly or not at all: {why}")
    for note in tp_notes(model.config, mesh.shape[tp]):
        warnings.warn(f"{dim}: {note}", UserWarning, stacklevel=3)


class Marks(dict[str, list[Any]]):
    """Tensor name -> the dims_mapping a strategy is writing; ``marks(name)`` is the tensor's
    (all ``-1`` the first time)."""

    def __init__(self, prog: Any) -> None:
        super().__init__()
        self.prog = prog

    def __call__(self, name: str) -> list[Any]:
        return self.setdefault(name, [-1] * len(self.prog.tensors[name].shape))


def annotate(model: Model, mesh: ProcessMesh, strategy: Iterable[str],
                user: Mapping[str, Any] | None = None) -> dict[str, TensorDistAttr]:
    """Tensor name -> dist attr for the strategies (and the user's own annotations)."""
    prog = model.program
    st, dp, tp = strategy_dims(mesh, strategy)
    out = dm = Marks(prog)
    ep = ep_dim(mesh, st)
    fold = expert_fold(mesh, st)  # ETP = 1: the experts over ep x tp
    from_cp = ep_from_cp(st)  # ep-from=cp: ep one more cp dim outside the experts, not a dp one
    experts: frozenset[str] = frozenset()
    layers: list[Any] = []
    if ep is not None:
        layers = moe_layers(prog)
        check_ep(mesh, layers, ep, model.config.batch, dp, fold, from_cp)
        experts = expert_marks(prog, mesh, dm, dp, ep, layers, fold,  # under cp: each cp rank routes its own chunk
                               mesh.dim_index("cp") if "cp" in st else None, from_cp)
    elif dp is not None:  # (with ep: check_ep's, over dp x ep)
        check_batch(model.config.batch, mesh.shape[dp], f"--mesh dp={mesh.shape[dp]}")
    # data parallel over dp (x ep: outside the experts, as Megatron folds them; not with ep-from=cp)
    batch = batch_entry(dp, None if from_cp else ep)

    if batch != -1:
        for n in model.token_inputs():
            dm(n)[0] = batch
    if tp is not None:
        check_tp(model, mesh, tp, st)
        for p, role in model.roles.items():
            if p in experts and fold is not None:
                continue  # ETP = 1: each expert whole on one rank of the ep x tp group
            if role in ("column", "head", "column_bias"):
                dm(p)[-1] = tp  # output features (a stack of experts [E, in, out]: each expert's)
            elif role in ("row", "embedding"):
                dm(p)[-2] = tp  # input features (the vocabulary of a table)
            # norm, position, bias (after a row-parallel projection), router, replicated: replicated
    cp = cp_marks(model, mesh, dm, st, batch, tp)
    optimizer_layouts(prog, mesh, model.optimizer, out, st, dp, user, ep, experts)
    if "sp" in st and tp is not None:
        # the residual stream, and under cp the MoE output back from the cp chunks (whole over tp
        # with ETP = tp: sliced onto the stream's co-shard, not the stream gathered for the add)
        back = chunk_outputs(prog) if cp is not None else []
        # with ETP = tp the gradient of a norm output only the cp chunks read comes back whole over
        # tp (every tp rank routed the cp rank's tokens): sliced onto the co-shard where it is, the
        # norm's backward on the rank's own tokens (not the stream gathered over tp for it)
        routed = [g for x in chunk_inputs(prog, layers or moe_layers(prog)) if (g := x + ".grad") in prog.tensors] \
            if cp is not None and fold is None else []
        for n in [*model.residual, *back, *routed]:
            d = dm(n)
            d[1] = tp if cp is None else seq_entry(seq_dims(mesh, st), tp)  # under cp: the cp rank's chunk over tp
            d[0] = batch
        # gathered copies: the normalised activations the column-parallel projections read (not
        # those only a MoE layer routed in chunks reads: each tp rank routes its own tokens), and
        # (backward) the gradients of the row-parallel projections' outputs (not the experts':
        # their rows go back to the tokens by all-to-all first) and, with ETP = tp, of the MoE
        # output back from the cp chunks (every tp rank routed the cp rank's tokens: gathered
        # over tp alone, not the co-shard read whole into the chunks)
        own = chunk_inputs(prog, layers) if ep is not None and fold is not None else frozenset()
        for n in [*(x for x in model.norm_outputs if x not in own),
                  *(g for r in model.row_outputs if (g := r + ".grad") in prog.tensors
                    and (ep is None or len(prog.tensors[g].shape) == 3)),
                  *(g for r in back if fold is None and (g := r + ".grad") in prog.tensors)]:
            d = dm(n)
            d[0] = batch
            if cp is not None:
                d[1] = cp
    # one dist attr per distinct dims_mapping (validated once): a model's layers repeat few
    made: dict[tuple[Any, ...], TensorDistAttr] = {}
    attrs: dict[str, TensorDistAttr] = {}
    for n, d in out.items():
        mk: tuple[Any, ...] | None = tuple(tuple(e) if isinstance(e, list) else e for e in d)
        try:
            a = made.get(mk)  # type: ignore[arg-type]
        except TypeError:  # an entry no dims_mapping holds: refused by TensorDistAttr below
            a, mk = None, None
        if a is None:
            a = TensorDistAttr(mesh, d)
            if mk is not None:
                made[mk] = a
        attrs[n] = a
    attrs.update(user_attrs(prog, mesh, user))
    return attrs


def zero_stage(strategy: Iterable[str]) -> int:
    """The ZeRO stage a strategy asks for (0: none); its parts as given or by their aliases
    (``zero`` = zero2, ``fsdp`` = zero3)."""
    st = {_ALIASES.get(s, s) for s in strategy}
    return max((int(s[4]) for s in st if s in ("zero1", "zero2", "zero3")), default=0)


def zero_axis(shape: Sequence[int], dims_mapping: Sequence[Any], dp: int) -> int | None:
    """The axis ZeRO shards a parameter's states over ``dp`` ranks on: the first axis not
    already sharded that ``dp`` divides; where none does, the largest axis not already sharded
    that has at least ``dp`` elements, split unevenly (the first ranks one element row more).
    Real ZeRO / the distributed optimizer / FSDP shard a flat buffer by bytes (``ceil(numel /
    dp)`` a rank, whatever the shapes); an uneven split of the largest axis holds at most
    ``(dp - 1) / size`` of the tensor more on the fullest rank, and its reduce-scatter and
    all-gather move the same bytes. None where no axis has ``dp`` elements (a tensor too
    small to shard: held whole, as a scalar state)."""
    free = [a for a, e in enumerate(dims_mapping) if e == -1]
    even = next((a for a in free if shape[a] % dp == 0), None)
    if even is not None:
        return even
    big = [a for a in free if shape[a] >= dp]
    return max(big, key=lambda a: shape[a]) if big else None


def optimizer_layouts(prog: Any, mesh: ProcessMesh, optimizer: Mapping[str, tuple[str, tuple[str, ...], str, tuple[str, ...]]],
                      out: dict[str, list[Any]], strategy: Iterable[str], dp: int | None,
                      user: Mapping[str, Any] | None, ep: int | None = None,
                      experts: frozenset[str] = frozenset()) -> dict[str, TensorDistAttr]:
    """Lay out each parameter's optimizer states in ``out`` (tensor -> dims_mapping, edited in
    place): as the parameter (its layout from ``out``, or the user's pin of it, which wins), and
    under ZeRO (``zero1`` / ``zero2`` / ``zero3``) sharded over ``dp`` on their first axis not
    already sharded that ``dp`` divides (with context parallelism over the ``(dp, cp)`` ranks, as
    Megatron-Core's distributed optimizer shards over dp x cp). zero1 holds the gradient all-reduced (whole on every
    rank), zero2 and zero3 hold it reduce-scattered like the states. The updated parameter and
    states are not annotated: propagation holds an in-place output as the tensor it overwrites.
    With expert parallelism (``ep``: its mesh dim; ``experts``: the expert stacks) a dense
    parameter's states are sharded over the data-parallel ranks ``(dp, ep)``, an expert stack's
    over ``dp`` alone (:func:`spmdkit.strategies.experts.zero_dims`); under cp a dense
    parameter's over ``(dp, cp, ep)`` (Megatron-Core's dense data-parallel group), an expert
    stack's over ``(dp, cp)`` (its expert-data-parallel group:
    :func:`spmdkit.strategies.context.zero_dims`).
    Returns the stored layout of each ZeRO-3 parameter (``propagate(storage=...)``)."""
    stage = zero_stage(strategy)
    cp = mesh.dim_index("cp") if "cp" in set(strategy) and "cp" in mesh.dim_names else None
    pins = user_attrs(prog, mesh, user) if user else {}
    storage: dict[str, TensorDistAttr] = {}
    for p, (g, states, _new, new_states) in optimizer.items():
        pin = pins.get(p)
        base = list(pin.dims_mapping) if pin is not None else list(out.get(p, [-1] * len(prog.tensors[p].shape)))
        for s in (*states, *new_states):
            out[s] = list(base)
        # under cp: over dp x cp (Megatron's data-parallel group with cp), an expert stack's too
        # (its expert-data-parallel group); a dense parameter's with ep over dp x cp x ep
        zd = (zero_dims(mesh, dp, ep, p in experts) if cp is None
              else cp_zero_dims(mesh, dp, cp, None if p in experts else ep)) if stage and states else None
        if zd is None:
            continue
        axis = zero_axis(prog.tensors[p].shape, base, zd[1])
        if axis is None:
            continue
        shard = list(base)
        shard[axis] = zd[0]
        for s in (*states, *new_states):
            out[s] = list(shard)
        out[g] = list(base) if stage == 1 else list(shard)
        if stage >= 3:
            storage[p] = TensorDistAttr(mesh, shard)
    return storage


def zero3_storage(optimizer: Mapping[str, tuple[str, tuple[str, ...], str, tuple[str, ...]]],
                  attrs: Mapping[str, TensorDistAttr], strategy: Iterable[str]) -> dict[str, TensorDistAttr]:
    """ZeRO-3 / FSDP: each parameter stored as its optimizer states are laid out (sharded over
    ``dp``), gathered before its forward and backward readers (``propagate(storage=...)``);
    empty below stage 3."""
    if zero_stage(strategy) < 3:
        return {}
    out: dict[str, TensorDistAttr] = {}
    for p, (_g, states, _new, _ns) in optimizer.items():
        a = attrs.get(states[0]) if states else None
        if a is not None and a != attrs.get(p) and not a.partial:
            out[p] = a
    return out


def user_attrs(prog: Any, mesh: ProcessMesh, user: Mapping[str, Any] | None) -> dict[str, TensorDistAttr]:
    """The user's annotations (tensor -> dims_mapping or dist attr) as dist attrs on ``mesh``;
    ProgramError (naming ``--annotate`` and the tensor) for an unknown tensor, a dims_mapping
    the mesh rejects or one whose length is not the tensor's rank."""
    attrs: dict[str, TensorDistAttr] = {}
    for n, a in (user or {}).items():
        if n not in prog.tensors:
            raise ProgramError(f"--annotate {_cut(n, 60)}: the program has no such tensor")
        if not isinstance(a, TensorDistAttr):
            try:
                a = TensorDistAttr(mesh, a)
            except SpmdError as exc:
                raise ProgramError(f"--annotate {n}: {str(exc)[:300]}") from None
        if len(a.dims_mapping) != len(prog.tensors[n].shape):
            raise ProgramError(f"--annotate {n}: dims_mapping has {len(a.dims_mapping)} entries, the tensor "
                               f"has shape {list(prog.tensors[n].shape)}")
        attrs[n] = a
    return attrs


__all__ = ["MAX_RANKS", "STRATEGIES", "annotate", "check_tp", "tp_comm_overlap_problem", "tp_notes", "tp_problem", "optimizer_layouts", "parse_mesh", "parse_strategy", "strategy_items", "user_attrs", "zero3_storage", "zero_axis", "zero_stage"]
