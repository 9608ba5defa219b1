"""Parallel strategies for imported programs (HuggingFace models and any torch module), by
their graph and parameter names.

A program imported from torch (:mod:`spmdkit.models.torch_import`, :mod:`spmdkit.models.hf`) names its
parameters by their state-dict paths (``model.layers.0.self_attn.q_proj.weight``); a program
JSON exported from one keeps those names. The strategies of :mod:`spmdkit.strategies.strategy` read
them here:

- ``dp``: the batch axis (axis 0) of every data input (``input_ids``, ``attention_mask``,
  ``labels``, ``pixel_values``...: the call's arguments, not the recorded constants or
  buffers) over ``dp``; every parameter gradient is then all-reduced over ``dp``.
- ``zero1`` / ``zero2`` (``zero``) / ``zero3`` (``fsdp``): each parameter's optimizer states
  sharded over ``dp`` on their first axis that is not already sharded and that ``dp`` divides,
  then its gradient, then the parameter itself (stored sharded, gathered per phase), as the
  zoo's (:func:`spmdkit.strategies.strategy.optimizer_layouts`).
- ``megatron`` (``tp``): the user's patterns first, then the column / row roles the graph gives
  the linears of each numbered block (:mod:`spmdkit.strategies.hf_roles`: whatever the
  modules are called), then a parameter's module path (its name without ``.weight`` /
  ``.bias``, or a tied parameter's other names) matched against the default patterns below,
  first match wins: ``column`` shards a linear layer's output features
  over ``tp`` (and its bias), ``row`` its input features, ``vocab`` the vocabulary axis of
  an embedding table, an LM head (tied or not) or its bias, ``replicate`` leaves it alone.
  Which axis is the output features follows the op that reads the weight: ``matmul`` with
  ``trans_y`` (torch's ``Linear``, ``[out, in]``) or without (GPT-2's ``Conv1D``,
  ``[in, out]``). A column layer whose output is split into heads (a ``reshape`` to
  ``[..., heads, head_dim]``) needs ``heads % tp == 0``. A k / v projection with fewer heads
  than ``tp`` (GQA / MQA: 1 or 2 kv heads) that divide it is replicated over ``tp``, as Megatron
  replicates kv heads, with a warning naming it (unless the user's patterns named its role);
  any other is a :class:`ProgramError` naming the module (give it ``replicate`` to keep
  going: ``{"*.k_proj": "replicate", ...}``).

Default patterns (:data:`DEFAULT_PATTERNS`; a pattern is a glob over the module path that
also matches any ``.``-suffix, so ``"q_proj"`` matches ``model.layers.3.self_attn.q_proj``;
a pattern starting ``re:`` is a regular expression, full match):

==========================================================  =========
q_proj k_proj v_proj gate_proj up_proj fc1 c_fc query key    column
value wi wi_0 wi_1 q k v (T5), intermediate.dense (BERT),
c_attn (GPT-2's fused q/k/v, split head-wise),
relative_attention_bias (T5's table: heads over tp)
o_proj down_proj fc2 c_proj wo o out_proj dense              row
(attention.output.dense and output.dense of BERT, Phi's dense)
embed_tokens wte word_embeddings shared lm_head embed_out    vocab
cls.predictions (BERT's decoder bias)
transform.dense, pooler.dense                                replicate
==========================================================  =========

GPT-2's fused ``c_attn`` (``[in, 3 * hidden]``): sharding its output axis in contiguous
blocks would cut across q, k and v (the split after it would all-gather), so
:func:`split_fused_projections` rewrites the projection as three on slices of the weight and
bias (a projection cut by ``slice`` s, Phi-3's ``qkv_proj``, first read as a split:
:func:`slices_as_split`) and :func:`parts_as_parameters` makes each slice a parameter of its
own, with its own gradient and update: each part is column-parallel and stored sharded over
``tp`` with its optimizer states, as Megatron stores a fused qkv, and no weight-sized
collective is left (a part's value is its slice of the module's weight:
``("parameter_slice", (fqn, axis, lo, hi))`` in an imported program's ``sources``).

- ``sp`` (with ``megatron``): Megatron sequence parallel. The residual stream (the
  vocab-parallel embeddings' outputs, the row layers' outputs and the adds that take them)
  and its gradient are sharded on their sequence axis over ``tp``, so HF's decomposed norms
  (``square`` / ``mean`` / ``rsqrt`` / ``multiply``, or the layer norm op) run on sequence
  shards; the inputs of the column layers and of the LM head are gathered (their summed
  gradients reduce-scattered back), the row layers' partial outputs reduce-scattered and
  their output gradients gathered: every tensor-parallel all-reduce becomes an all-gather /
  reduce-scatter pair. A MoE block (:func:`spmdkit.strategies.hf_moe.moe_ends`) is run as
  Megatron and torchtitan run one under tp: its tokens gathered before the router (every tp rank
  routes the whole sequence, each expert split over tp; the gradient reduce-scattered back), its
  output sliced back to the sequence shard (its gradient gathered); with ``ep`` the batch is
  co-sharded ``(dp, ep)`` throughout. Under ``ep,etp=1`` the import routes each sequence one
  chunk a tp rank (:func:`spmdkit.strategies.experts.tp_chunks`: Megatron's ETP = 1 token path):
  nothing is gathered, each tp rank routes its own sequence shard and the all-to-all over the
  ep x tp group moves the tokens (docs/experts.md). A sequence length ``tp`` does not divide is
  refused (ViT's 17 tokens at tp=2).

``megatron`` also makes the loss vocab-parallel: :func:`vocab_parallel_loss` rewrites the
imported ``cross_entropy_with_softmax`` (hard labels, ``ignore_index``) and its grad into
``c_softmax_with_cross_entropy`` (Megatron's cross entropy: max, sum of exponentials and the
label's logit all-reduced over the vocab shards), so the ``[tokens, vocab]`` logits are never
all-gathered. The sum / count of counted tokens after it is unchanged.

Standard library only.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

from spmdkit.core.dist_attr import Entry, TensorDistAttr
from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.program.ir import Op, Program, Tensor
from spmdkit.program.plan import Plan
from spmdkit.strategies.context import hf_cp_marks
from spmdkit.strategies.experts import (
    batch_entry,
    check_ep,
    check_tp_chunks,
    chunk_entries,
    ep_dim,
    ep_from_cp,
    expert_fold,
    expert_marks,
    moe_layers,
)
from spmdkit.strategies.hf_fused import (
    fused_parts,
    namer,
    parts_as_parameters,
    rebuild,
    slices_as_split,
    split_fused_projections,
)
from spmdkit.strategies.hf_moe import moe_ends, moe_projections, shard_experts
from spmdkit.strategies.hf_roles import BLOCK, BlockRoles, block_roles, linears, weight_of
from spmdkit.strategies.strategy import Marks, optimizer_layouts, strategy_dims, user_attrs

ROLES = ("column", "row", "vocab", "replicate")
#: what :func:`_shard_weights` notes for a k / v projection it replicates (fewer heads than tp)
KV_REPLICATED = "kv_replicated"
#: what annotate_program notes for a low-rank down projection it keeps whole (MLA's q_a_proj)
LOW_RANK = "low_rank"

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "c_fc", "query", "key", "value",
           "wi", "wi_0", "wi_1", "q", "k", "v", "w1", "w3")
_KV = ("k_proj", "v_proj", "key", "value", "k", "v")  # kv projections: replicated when kv heads < tp
_ROW = ("o_proj", "down_proj", "fc2", "c_proj", "wo", "o", "out_proj", "w2")
_VOCAB = ("embed_tokens", "wte", "word_embeddings", "shared", "lm_head", "embed_out", "embed_in",
          "cls.predictions.decoder", "cls.predictions")

#: (pattern, role) in the order they are tried (after the user's).
DEFAULT_PATTERNS: tuple[tuple[str, str], ...] = (
    ("c_attn", "column"),  # fused q/k/v: split head-wise (split_fused_projections)
    ("transform.dense", "replicate"),
    ("pooler.dense", "replicate"),
    ("intermediate.dense", "column"),
    ("relative_attention_bias", "column"),
    ("dense", "row"),
    *((p, "column") for p in _COLUMN),
    *((p, "row") for p in _ROW),
    *((p, "vocab") for p in _VOCAB),
)


def _matches(pattern: str, path: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], path) is not None
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, "*." + pattern)


def check_patterns(patterns: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> list[tuple[str, str]]:
    """The user's patterns as (pattern, role) pairs; ProgramError for a role not in
    :data:`ROLES` or a regular expression that does not compile."""
    items = list(patterns.items() if isinstance(patterns, Mapping) else (patterns or ()))
    out: list[tuple[str, str]] = []
    for k, v in items:
        if not isinstance(k, str) or not k:
            raise ProgramError(f"tp pattern {k!r}: must be a non-empty string (a glob or re:REGEX)")
        if v not in ROLES:
            raise ProgramError(f"tp pattern {k!r}: role {v!r} is not one of {', '.join(ROLES)}")
        if k.startswith("re:"):
            try:
                re.compile(k[3:])
            except re.error as exc:
                raise ProgramError(f"tp pattern {k!r}: not a regular expression: {exc}") from None
        out.append((k, v))
    return out


def warn_unmatched(prog: Program, patterns: list[tuple[str, str]]) -> None:
    """A UserWarning naming each of the user's ``--tp-plan`` patterns that matches no module
    holding a parameter: a misspelt module name decides nothing, and is said so."""
    paths = {path for p in parameters(prog) for path in _module_paths(prog, p)}
    names = sorted({path.rsplit(".", 1)[-1] for path in paths if not path.rsplit(".", 1)[-1].isdigit()})
    for k, _ in patterns:
        if any(_matches(k, path) for path in paths):
            continue
        close = difflib.get_close_matches(k.rsplit(".", 1)[-1], names, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"its modules end in {', '.join(names[:8])}"
        warnings.warn(f"--tp-plan: {k!r} matches no module of the model holding a parameter ({hint}): it decides "
                      f"nothing", UserWarning, stacklevel=2)


def role_of(path: str, patterns: Iterable[tuple[str, str]]) -> str | None:
    """The role of the module ``path`` under ``patterns`` (first match), else None."""
    for k, v in patterns:
        if _matches(k, path):
            return v
    return None


# -- what the program says about itself ----------------------------------------------------------


def data_inputs(prog: Program) -> list[str]:
    """The inputs fed by the call: an :class:`ImportedProgram`'s ``input`` sources. For a plain
    program (a program JSON), the ``input`` tensors that lead with the batch: not recorded
    constants (``const_N``), gradient seeds or the learning rate, and of the most common
    leading size among those of rank 2 or more (rank 1 only for integer tensors, class
    labels): a buffer recorded as an input (a rotary table) is left out."""
    sources = getattr(prog, "sources", None)
    if sources:
        return [n for n, (kind, _) in sources.items() if kind == "input" and n in prog.tensors]
    made = {n for op in prog.ops for n in op.output_names()}
    cands = [t for t in prog.tensors.values()
             if t.kind == "input" and t.shape and t.name not in made and not re.fullmatch(r"const_\d+", t.name)
             and not t.name.endswith(".grad") and t.name != "learning_rate"]
    lead = Counter(t.shape[0] for t in cands if len(t.shape) >= 2)
    if not lead:
        return []
    batch = lead.most_common(1)[0][0]
    return [t.name for t in cands if t.shape[0] == batch
            and (len(t.shape) >= 2 or t.dtype.startswith(("int", "uint")))]


def parameters(prog: Program) -> list[str]:
    """The program's parameters (not their updated copies)."""
    return [t.name for t in prog.tensors.values() if t.kind == "parameter" and not t.inplace_of]


def optimizer_of(prog: Program) -> dict[str, tuple[str, tuple[str, ...], str, tuple[str, ...]]]:
    """parameter -> (grad, states, updated parameter, updated states): an imported program's
    ``optimizer``, else read from the optimizer ops (``param``, ``grad``, the inputs of kind
    ``optimizer_state`` shaped as the parameter, and the outputs that overwrite them)."""
    opt = getattr(prog, "optimizer", None)
    if opt:
        return dict(opt)
    out: dict[str, tuple[str, tuple[str, ...], str, tuple[str, ...]]] = {}
    for op in prog.ops:
        if op.phase != "optimizer" or not isinstance(op.inputs.get("param"), str):
            continue
        p = op.inputs["param"]
        g = op.inputs.get("grad")
        shape = prog.tensors[p].shape
        states = tuple(n for n in op.input_names() if prog.tensors[n].kind == "optimizer_state"
                       and prog.tensors[n].shape == shape)
        by_src = {prog.tensors[n].inplace_of: n for n in op.output_names() if prog.tensors[n].inplace_of}
        new = by_src.get(p)
        if not isinstance(g, str) or new is None:
            continue
        out[p] = (g, states, new, tuple(by_src[s] for s in states if s in by_src))
    return out


def _module_paths(prog: Program, param: str) -> list[str]:
    """The module paths a parameter goes by: its own and those of its tied aliases (a part of
    a fused parameter: the fused one's)."""
    part = fused_parts(prog).get(param)
    if part is not None:
        param = part.source
    names = [param] + [a for a, t in (getattr(prog, "aliases", None) or {}).items() if t == param]
    return [n.rsplit(".", 1)[0] if "." in n else n for n in names]


def forward_readers(prog: Program) -> dict[str, list[tuple[int, Op, str]]]:
    """Per tensor name: the forward ops reading it as (op index, op, input slot)."""
    out: dict[str, list[tuple[int, Op, str]]] = {}
    for i, op in enumerate(prog.ops):
        if op.phase != "forward":
            continue
        for p, v in op.inputs.items():
            if isinstance(v, str):
                out.setdefault(v, []).append((i, op, p))
    return out


def _heads(prog: Program, readers: dict[str, list[tuple[int, Op, str]]], out: str, features: int) -> int | None:
    """The head count a column layer's output ``out`` is reshaped into (``[..., heads, d]``
    with ``heads * d == features``), following a bias add; None when it is not."""
    frontier = [out]
    for _ in range(4):
        nxt: list[str] = []
        for n in frontier:
            for _i, op, _p in readers.get(n, []):
                o = op.output_names()
                if not o:
                    continue
                shape = prog.tensors[o[0]].shape
                if op.rule == "reshape" and len(shape) >= len(prog.tensors[n].shape) >= 2 \
                        and prog.tensors[n].shape[-1] == features and shape[-1] * shape[-2] == features:
                    return shape[-2]
                if op.rule in ("add", "elementwise_add", "cast", "unsqueeze"):
                    nxt.append(o[0])
        frontier = nxt
    return None


def weight_axes(prog: Program, readers: dict[str, list[tuple[int, Op, str]]],
                 param: str) -> tuple[str, int, int, Op | None]:
    """(how the weight is read, output-feature axis, input-feature axis, the reading op):
    ``linear`` for a 2-D matmul ``y`` (the weight itself or its transpose: FalconLinear's
    ``x @ W.T``), ``embedding`` for a table; ``other`` otherwise."""
    t = prog.tensors[param]
    for _i, op, p in readers.get(param, []):
        if op.rule == "matmul" and p == "y" and len(t.shape) == 2:
            ty = bool(op.attrs.get("trans_y", False))
            return ("linear", 0 if ty else 1, 1 if ty else 0, op)
        if op.rule in ("embedding", "c_embedding") and p == "weight":
            return ("embedding", 1, 0, op)
    for _i, op, _p in readers.get(param, []):
        if op.rule == "transpose" and len(t.shape) == 2 and tuple(op.attrs.get("perm", ())) == (1, 0):
            for _j, mop, q in readers.get(op.output_names()[0], []):
                if mop.rule == "matmul" and q == "y":
                    ty = bool(mop.attrs.get("trans_y", False))  # axes of W.T: swapped back
                    return ("linear", 1 if ty else 0, 0 if ty else 1, mop)
    return ("other", -1, -1, None)


# -- the annotations -----------------------------------------------------------------------------


def tp_roles(prog: Program, patterns: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
             found: BlockRoles | None = None) -> dict[str, str]:
    """parameter -> role (``column`` / ``row`` / ``vocab``; replicated ones left out): the
    user's ``patterns`` first, then the roles the graph gives the linears of the numbered
    blocks (:func:`spmdkit.strategies.hf_roles.block_roles`; ``found`` when already
    computed), then :data:`DEFAULT_PATTERNS` by module name."""
    user = check_patterns(patterns)
    graph = (found or block_roles(prog)).roles
    out: dict[str, str] = {}
    decided: set[str] = set()
    for p in parameters(prog):
        paths = _module_paths(prog, p)
        r = next((r for path in paths if (r := role_of(path, user)) is not None), None)
        part = fused_parts(prog).get(p)
        key = p if p in graph else part.weight if part is not None else paths[0] + ".weight"  # a layer's weight, or its bias
        if r is None and key in graph:
            r = graph[key]
        if r is None:
            r = next((r for path in paths if (r := role_of(path, DEFAULT_PATTERNS)) is not None), None)
        if r is not None:
            decided.add(p)
        if r is not None and r != "replicate":
            out[p] = r
    # a bias nothing above decides goes with its linear (the matmul whose output it is added to):
    # a vocab-parallel LM head's bias (DistilBERT's vocab_projector) sharded as the logits
    producer = {o: op for op in prog.ops if op.phase == "forward" for o in op.output_names()}
    for op in prog.ops:
        b, x = op.inputs.get("y"), op.inputs.get("x")
        if op.phase != "forward" or op.rule != "add" or not isinstance(b, str) or not isinstance(x, str) \
                or b in decided or prog.tensors[b].kind != "parameter" or len(prog.tensors[b].shape) != 1:
            continue
        mm = producer.get(x)
        y = mm.inputs.get("y") if mm is not None and mm.rule == "matmul" else None
        w = weight_of(prog, y, producer) if isinstance(y, str) else None
        role = out.get(w[0]) if w is not None else None
        if role in ("column", "vocab") and prog.tensors[b].shape[-1] == prog.tensors[x].shape[-1]:
            out[b] = role
    return out


def annotate_program(prog: Program, mesh: ProcessMesh, strategy: Iterable[str],
                     user: Mapping[str, Any] | None = None,
                     patterns: Mapping[str, str] | Iterable[tuple[str, str]] | None = None
                     ) -> dict[str, TensorDistAttr]:
    """Tensor name -> dist attr for ``strategy`` (parsed: see
    :func:`spmdkit.strategies.strategy.parse_strategy`) on an imported program (module docstring);
    ``patterns``: the user's module-name patterns -> role for ``megatron``; ``user``:
    annotations (tensor -> dims_mapping) applied last, which win."""
    st, dp, tp = strategy_dims(mesh, strategy)
    out = dm = Marks(prog)
    ep = ep_dim(mesh, st)
    # ep-from=cp: ep one more cp dim outside the experts (the import traced for cp x ep ranks:
    # context.hf_cp), the batch over dp alone
    from_cp = ep_from_cp(st)
    bep = None if from_cp else ep  # the ep dim the batch is split over
    experts: frozenset[str] = frozenset()
    if ep is not None:  # expert parallelism found in the program (strategies.experts), as for the zoo
        layers = moe_layers(prog)
        batches = {prog.tensors[n].shape[0] for n in data_inputs(prog) if prog.tensors[n].shape}
        fold = expert_fold(mesh, st)  # etp=1: the experts over ep x tp, each whole
        check_ep(mesh, layers, ep, max(batches) if batches else None, dp, fold, from_cp)
        check_tp_chunks(prog, mesh, st, layers)  # etp=1 with sp: traced one chunk a tp rank (models/hf.py)
        # under cp the importer routes each sequence in cp (x ep) chunks (models/hf.py): kept over cp
        cpd = mesh.dim_index("cp") if "cp" in st and "cp" in mesh.dim_names else None
        experts = expert_marks(prog, mesh, dm, dp, ep, layers, fold, cpd, from_cp)
    if dp is not None or bep is not None:
        _shard_batch(prog, mesh, dm, dp, bep)
    # cp: the call's sequence over cp (x ep), attention cp_attention's (an import traced for cp: models/hf_cp.py)
    cp = hf_cp_marks(prog, mesh, dm, st, data_inputs(prog), batch_entry(dp, bep), tp)
    if tp is not None:
        for n in data_inputs(prog):  # every tp rank reads the whole batch (not a sequence shard of it)
            dm(n)
        readers = forward_readers(prog)
        found = block_roles(prog)
        roles = tp_roles(prog, patterns, found)
        user_pats = check_patterns(patterns)
        warn_unmatched(prog, user_pats)
        moe = moe_projections(prog)  # the MoE layers' routers stay replicated unless the user's patterns say
        routers = {m.router for m in moe} - {p for p in roles if any(role_of(path, user_pats) for path in
                                                                    _module_paths(prog, p))}
        roles = {p: r for p, r in roles.items() if p not in routers}
        # 2-D weights sharded over tp -> column / row / vocab / vocab_head
        sharded = _shard_weights(prog, mesh, dm, tp, readers, roles, user_pats, found.kv)
        _shard_fused_parts(prog, mesh, dm, tp, readers, roles, sharded, found.kv)
        shard_experts(prog, mesh, dm, tp, sharded, moe, whole=experts if "etp=1" in st else frozenset())
        for w, r in found.roles.items():  # low-rank down projections (MLA's), replicated on purpose
            if r == "replicate" and roles.get(w) is None:
                sharded.setdefault(w, LOW_RANK)
        warn_replicated(prog, sharded, user_pats)
        sharded = {k: v for k, v in sharded.items() if v not in (KV_REPLICATED, LOW_RANK)}
        if "sp" in st:
            _sequence_parallel(prog, mesh, sharded, dm, batch_entry(dp, bep), tp, cp, expert_fold(mesh, st))
    optimizer_layouts(prog, mesh, optimizer_of(prog), out, st, dp, user, ep, experts)
    attrs = {n: TensorDistAttr(mesh, d) for n, d in out.items()}
    attrs.update(user_attrs(prog, mesh, user))
    return attrs


def _shard_batch(prog: Program, mesh: ProcessMesh, dm: Marks, dp: int | None, ep: int | None = None) -> None:
    """``dp``: the batch axis of every data input over ``dp`` (co-sharded over ``(dp, ep)`` with
    expert parallelism: data parallel over dp x ep outside the experts, as Megatron folds them)."""
    size = (mesh.shape[dp] if dp is not None else 1) * (mesh.shape[ep] if ep is not None else 1)
    for n in data_inputs(prog):
        shape = prog.tensors[n].shape
        if not shape:
            continue
        if shape[0] % size:
            raise ProgramError(f"--strategy dp: input {n} has batch size {shape[0]}, which dp={size} "
                               f"does not divide")
        dm(n)[0] = batch_entry(dp, ep)


def _shard_weights(prog: Program, mesh: ProcessMesh, dm: Marks, tp: int,
                   readers: dict[str, list[tuple[int, Op, str]]], roles: Mapping[str, str],
                   user_pats: list[tuple[str, str]], kv: frozenset[str] = frozenset()) -> dict[str, str]:
    """``megatron``: each parameter with a role sharded over ``tp`` on the axis its role and
    its reader give (a bias with its layer); the 2-D weights sharded, by role (a k / v
    projection with fewer heads than tp: :data:`KV_REPLICATED`). ``kv``: the columns the
    graph found making fewer features than their row's widest (GQA / MQA k and v)."""
    size = mesh.shape[tp]
    sharded: dict[str, str] = {}

    def user_role(p: str) -> str | None:
        for path in _module_paths(prog, p):
            r = role_of(path, user_pats)
            if r is not None:
                return r
        return None

    replicated: set[str] = set()  # column layers left whole (kv heads fewer than tp), with their bias
    parts = fused_parts(prog)
    for p, role in sorted(roles.items(), key=lambda kv: len(prog.tensors[kv[0]].shape) == 1):
        if p in parts:
            continue  # a part of a fused projection: _shard_fused_parts
        t = prog.tensors[p]
        mod = _module_paths(prog, p)[0]
        if mod in replicated:
            continue
        how, out_ax, in_ax, op = weight_axes(prog, readers, p)
        if len(t.shape) == 1:
            # a bias: a column layer's (output features) or a vocab head's is sharded
            # (a fused projection's is sliced: its parts are, below)
            if any(op.rule == "slice" for _i, op, _p in readers.get(p, [])):
                continue
            if role in ("column", "vocab"):
                if t.shape[0] % size:
                    raise ProgramError(f"--strategy megatron: {mod} ({role}): bias size {t.shape[0]} is not "
                                       f"divisible by tp={size}")
                dm(p)[0] = tp
            continue
        if how == "other":
            continue  # not a linear layer or a table (a conv, an expert bank): replicated
        if role == "vocab":
            axis = 0 if how == "embedding" else out_ax
        elif how == "embedding":
            if role != "column":
                continue
            axis = 1  # a table's output features (T5's relative position bias: one column per head)
        else:
            axis = out_ax if role == "column" else in_ax
        if t.shape[axis] % size:
            raise ProgramError(f"--strategy megatron: {mod} ({role}): its {'vocabulary' if role == 'vocab' else 'feature'} "
                               f"axis has {t.shape[axis]} entries, not divisible by tp={size}")
        if role == "column" and op is not None:
            heads = _heads(prog, readers, op.output_names()[0], t.shape[axis])
            if heads is not None and heads < size and size % heads == 0 and user_role(p) is None \
                    and (mod.rsplit(".", 1)[-1] in _KV or p in kv):
                # fewer kv heads than tp (GQA / MQA): replicated on every rank, as Megatron does
                warnings.warn(f"--strategy megatron: {mod} makes {heads} heads, fewer than tp={size}: "
                              f"replicated over tp (its gradients are all-reduced)", stacklevel=3)
                replicated.add(mod)
                sharded[p] = KV_REPLICATED
                continue
            if heads is not None and heads % size:
                raise ProgramError(f"--strategy megatron: {mod} (column) makes {heads} heads, not divisible "
                                   f"by tp={size} (give it a pattern, e.g. {{'{mod.rsplit('.', 1)[-1]}': "
                                   f"'replicate'}}, or a smaller tp)")
        dm(p)[axis] = tp
        sharded[p] = "vocab_head" if role == "vocab" and how == "linear" else role
    return sharded


def _shard_fused_parts(prog: Program, mesh: ProcessMesh, dm: Marks, tp: int,
                       readers: dict[str, list[tuple[int, Op, str]]], roles: Mapping[str, str],
                       sharded: dict[str, str], kv: frozenset[str] = frozenset()) -> None:
    """The parts of a split fused projection (:func:`split_fused_projections`): each
    column-parallel (added to ``sharded``), heads over tp; a k / v part with fewer heads than
    tp that divide it (GPTBigCode's multi-query c_attn: one k and one v head) replicated, as
    Megatron replicates kv heads, with a warning (its bias part with it)."""
    size = mesh.shape[tp]
    groups: dict[str, tuple[list[str], list[str]]] = {}
    for part, _of in sorted(fused_parts(prog).items(), key=lambda kv: (kv[1].source, kv[1].lo)):
        if roles.get(part) != "column" or part in sharded or part not in prog.tensors:
            continue
        groups.setdefault(_module_paths(prog, part)[0], ([], []))[len(prog.tensors[part].shape) == 1].append(part)
    for mod, (wparts, bparts) in groups.items():
        feats: list[int] = []
        heads: list[int | None] = []
        axes: list[int] = []
        for part in wparts:
            how, out_ax, _in, mop = weight_axes(prog, readers, part)
            f = prog.tensors[part].shape[out_ax] if how == "linear" else 0
            feats.append(f)
            axes.append(out_ax if how == "linear" and mop is not None else -1)
            heads.append(_heads(prog, readers, mop.output_names()[0], f) if mop is not None and f else None)
        known = [(f, h) for f, h in zip(feats, heads) if h]
        head_dim = max(known)[0] // max(known)[1] if known else None
        top = max(feats, default=0)
        for j, part in enumerate(wparts):
            f, h = feats[j], heads[j]
            if axes[j] < 0:
                continue
            if h is None and head_dim and f % head_dim == 0:
                h = f // head_dim
            bias = bparts[j] if j < len(bparts) else None
            if h is not None and h < size and size % h == 0 and (f < top or part in kv):
                warnings.warn(f"--strategy megatron: {mod} part {j} ({f} of {sum(feats)} features) makes {h} "
                              f"head{'s' if h > 1 else ''}, fewer than tp={size}: replicated over tp (its "
                              f"gradients are all-reduced)", stacklevel=3)
                sharded[part] = KV_REPLICATED
                continue
            if f % size:
                raise ProgramError(f"--strategy megatron: {mod} (column): a part of {f} features is "
                                   f"not divisible by tp={size}")
            if h is not None and h % size:
                raise ProgramError(f"--strategy megatron: {mod} (column) makes {h} heads, not divisible "
                                   f"by tp={size}")
            dm(part)[axes[j]] = tp
            sharded[part] = "column"
            if bias is not None:
                dm(bias)[0] = tp


def warn_replicated(prog: Program, sharded: Mapping[str, str], user_pats: list[tuple[str, str]]) -> None:
    """A warning naming the linear layers (and expert banks) of the numbered blocks that
    ``megatron`` left replicated over tp (no role from the user's patterns, the graph or the
    names; not a replicated k / v) and the share of the parameters they hold: never silent."""
    lins = [lin for lin in linears(prog) if BLOCK.fullmatch(lin.layer or "")]
    done = {lin.weight for lin in lins if lin.weight in sharded or (lin.part or "") in sharded}
    left: list[str] = []
    for lin in lins:
        w = lin.weight
        if w in done or w in left:
            continue
        if any(role_of(path, user_pats) == "replicate" for path in _module_paths(prog, w)):
            continue
        left.append(w)
    for op in prog.ops:  # 3-D parameters outside a MoE layer the experts' sharding found (shard_experts)
        if op.phase == "forward" and BLOCK.fullmatch(op.layer or ""):
            left += [n for n in op.input_names() if prog.tensors[n].kind == "parameter" and n not in left
                     and len(prog.tensors[n].shape) >= 3 and n not in sharded]
    if not left:
        return
    mods = {_module_paths(prog, w)[0] for w in left}
    size = {p: math.prod(prog.tensors[p].shape) for p in parameters(prog)}
    mine = sum(n for p, n in size.items() if p in left or _module_paths(prog, p)[0] in mods)
    share = mine / max(1, sum(size.values()))
    groups = Counter(re.sub(r"\.\d+(?=\.|$)", ".*", m) for m in sorted(mods))
    shown = [f"{g} ({k})" if k > 1 else g for g, k in groups.items()]
    more = f" and {len(shown) - 6} more" if len(shown) > 6 else ""
    warnings.warn(f"--strategy megatron: {len(mods)} layer{'s' if len(mods) > 1 else ''} left replicated "
                  f"over tp, {share:.1%} of the parameters (no column / row role from the graph or the names): "
                  f"{', '.join(shown[:6])}{more}; a linear layer can be given a role with --tp-plan", stacklevel=3)


def _sequence_parallel(prog: Program, mesh: ProcessMesh, sharded: Mapping[str, str], dm: Any,
                       batch_dims: Entry, tp: int, cp: Entry | None = None, fold: int | None = None) -> None:
    """Megatron sequence parallel on an imported program: the residual stream (the outputs of
    the adds that take a row-parallel layer's output, and of the vocab-parallel embeddings)
    sharded on its sequence axis (1) over tp, so the row layers' partial outputs are
    reduce-scattered into it and the norms between run on sequence shards; the inputs of the
    column-parallel layers and of the LM head are gathered (sequence whole), and so are the
    gradients of the row layers' outputs in the backward step. Under ``cp`` (the sequence's entry:
    the cp mesh dim, or ``(cp, ep)`` with ``ep-from=cp``) the residual is co-sharded ``(cp, tp)``
    (``(cp, ep, tp)``) on its sequence (the cp rank's share split again over tp) and the gathered
    tensors stay on their cp share, as the zoo's (docs/context.md).
    ``batch_dims``: the batch axis' entry (``dp``, or ``(dp, ep)`` with expert parallelism:
    :func:`spmdkit.strategies.experts.batch_entry`); ``fold``: the tp dim the experts are folded
    over (ETP = 1), the MoE blocks then routed one chunk a tp rank (:func:`_moe_sequence_parallel`)."""
    size = mesh.shape[tp]
    lead = [d for d in ((batch_dims,) if isinstance(batch_dims, int) else batch_dims) if d != -1]
    fwd = [(i, op) for i, op in enumerate(prog.ops) if op.phase == "forward"]
    readers = forward_readers(prog)
    seq: list[str] = []
    row_out: list[str] = []
    gather: list[str] = []
    # a weight read through its transpose (FalconLinear's x @ W.T): the transpose -> the weight
    via = {op.output_names()[0]: op.inputs["x"] for _i, op in fwd if op.rule == "transpose"
           and isinstance(op.inputs.get("x"), str) and op.inputs["x"] in sharded}
    for _i, op in fwd:
        y = op.inputs.get("y") if op.rule == "matmul" else op.inputs.get("weight")
        role = sharded.get(via.get(y, y)) if isinstance(y, str) else None
        if role is None:
            continue
        if op.rule in ("embedding", "c_embedding"):
            if role == "vocab":  # a token table (not T5's per-head position bias)
                seq.append(op.output_names()[0])
        elif role in ("column", "vocab_head") or (role == "vocab" and op.rule == "matmul"):  # a tied head too
            gather.append(op.inputs["x"])
        elif role == "row":
            cur = op.output_names()[0]
            row_out.append(cur)  # reduce-scattered right after the layer (a post-norm then runs on shards)
            for _ in range(4):  # through a bias add and a reshape to the residual add
                nxt = None
                for _j, r, _p in readers.get(cur, []):
                    ins = [prog.tensors[n] for n in r.input_names()]
                    o = r.output_names()
                    if r.rule == "add" and len(ins) == 2 and all(t.kind != "parameter" for t in ins) \
                            and ins[0].shape == ins[1].shape:
                        seq.append(o[0])
                        nxt = None
                        break
                    if r.rule in ("add", "reshape") and o:
                        nxt = o[0]
                if nxt is None:
                    break
                cur = nxt
    for op in prog.ops:
        y = op.inputs.get("y")
        if op.phase == "backward" and op.rule == "matmul_grad" and isinstance(y, str) \
                and sharded.get(via.get(y, y)) == "row":
            gather.append(op.inputs["out_grad"])

    producer = {o: op for op in prog.ops if op.phase == "forward" for o in op.output_names()}

    def grads_of(n: str) -> list[str]:
        """The gradients of activation ``n`` (the importer's ``n.grad``, ``n.gradK``, and their
        sum ``n.grad.sum``)."""
        pat = re.compile(re.escape(n) + r"\.grad(\d*|\.sum)")
        return [g for g in prog.tensors if pat.fullmatch(g) and prog.tensors[g].shape == prog.tensors[n].shape]

    batch = {prog.tensors[n].shape[0] for n in data_inputs(prog) if prog.tensors[n].shape}

    def flat(shape: tuple[int, ...]) -> bool:
        return len(shape) == 2 and bool(batch) and shape[0] % max(batch) == 0 and shape[0] > max(batch)

    # a residual stream that is also flattened ([batch * seq, hidden]: OPT's MLP, GPT-2's Conv1D)
    # is cut over tp in the flattened order, batch-major: with 2 or more sequences per dp rank
    # that tp divides, the [batch, seq, hidden] tensors are cut on the batch axis to match (each
    # rank still holds 1/tp of the tokens; Megatron's [seq, batch] layout flattens seq-major)
    local = max(batch) // math.prod(mesh.shape[d] for d in lead) if batch else 1
    by_batch = cp is None and local > 1 and local % size == 0 and any(flat(prog.tensors[n].shape) for n in (*seq, *row_out))

    def shard_seq(n: str) -> None:
        shape = prog.tensors[n].shape
        if len(shape) == 3 and by_batch and shape[0] == max(batch):
            dm(n)[0] = [*lead, tp] if lead else tp
            return
        if flat(shape):
            # tokens flattened ([batch * seq, hidden], GPT-2's Conv1D): batch over dp, then seq over tp
            if (shape[0] // max(batch)) % size:
                raise ProgramError(f"--strategy sp: {n} has {shape[0] // max(batch)} tokens per sequence, not "
                                   f"divisible by tp={size}")
            dm(n)[0] = [*lead, tp] if lead else tp
            return
        if len(shape) != 3:
            return
        if shape[1] % size:
            raise ProgramError(f"--strategy sp: {n} has sequence length {shape[1]}, not divisible by tp={size}")
        d = dm(n)
        d[0], d[1] = batch_dims, (tp if cp is None else [*_dims(cp), tp])

    for n in seq:
        # the residual stream and its gradient, sequence-sharded
        shard_seq(n)
        for g in grads_of(n):
            shard_seq(g)
    for n in row_out:
        shard_seq(n)  # its gradient stays gathered: the row layer's weight gradient reads it whole
    for n in gather:
        d = dm(n)
        if lead and d:
            d[0] = batch_dims
        if cp is not None and len(d) == 3:
            d[1] = cp
        # the summed gradient of a gathered input: reduce-scattered back to sequence shards
        # (of the [batch, seq, hidden] tensor a flattened input was reshaped from)
        src = producer.get(n)
        if len(prog.tensors[n].shape) == 2 and src is not None and src.rule == "reshape" \
                and len(prog.tensors[src.inputs["x"]].shape) == 3:
            n = src.inputs["x"]
        gs = grads_of(n)
        total = n + ".grad.sum" if n + ".grad.sum" in gs else (n + ".grad" if n + ".grad" in gs else None)
        if total is not None:
            shard_seq(total)
    _moe_sequence_parallel(prog, mesh, dm, batch_dims, tp, cp, fold, frozenset(gather), shard_seq, grads_of)


def _dims(entry: Entry) -> tuple[int, ...]:
    """The mesh dims of a sharded entry (one dim or a co-shard), major first."""
    return (entry,) if isinstance(entry, int) else tuple(entry)


def _moe_sequence_parallel(prog: Program, mesh: ProcessMesh, dm: Any, batch_dims: Entry, tp: int, cp: Entry | None,
                           fold: int | None, gathered: frozenset[str], shard_seq: Callable[[str], None],
                           grads_of: Callable[[str], list[str]]) -> None:
    """The MoE blocks (:func:`spmdkit.strategies.hf_moe.moe_ends`) under ``sp`` (a block with a
    shared expert, whose column layers gather the same tokens, left as it was):

    - routed whole, or in cp chunks only (ETP = tp), as Megatron and torchtitan run one under tp:
      its tokens gathered before the router (every tp rank routes the whole sequence, each expert
      split over tp; their gradient reduce-scattered back), its output returned to sequence shards
      (its gradient gathered); under cp gathered over tp only: the sequence ([B, S, H]) or the
      chunks ([B, cp, S / cp, H]: each cp rank its own tokens) kept over cp;
    - routed one chunk a tp rank (ETP = 1, ``fold``: Megatron's token path): nothing gathered,
      the block's ``[B, S, H]`` ends and their gradients sequence-sharded as the residual stream
      and the chunks ``[B, T, S / T, H]`` on each rank's own chunk
      (:func:`spmdkit.strategies.experts.chunk_entries`): the tokens go to the experts by the
      all-to-all over the ep x tp group alone.

    ``cp``: the sequence's entry (``(cp, ep)`` with ``ep-from=cp``: the chunks one a cp x ep rank)."""
    seq = _dims(cp) if cp is not None else ()
    ranks = math.prod(mesh.shape[d] for d in seq)
    for moe_in, moe_out in moe_ends(prog, moe_projections(prog)):
        if not moe_in or set(moe_in) & gathered:
            continue
        shape = prog.tensors[moe_in[0]].shape
        own = chunk_entries(mesh, shape[1], fold, *(seq[:2] if seq else (None,)))[0] if len(shape) == 4 else -1
        mine = fold is not None and fold in ((own,) if isinstance(own, int) else own)
        for m in (*moe_in, *moe_out):
            for t in (m, *grads_of(m)):
                shape = prog.tensors[t].shape
                if mine and len(shape) == 3:
                    shard_seq(t)
                    continue
                d = dm(t)
                d[0] = batch_dims
                if mine and len(shape) == 4:
                    d[1] = own
                elif cp is not None and (len(shape) == 3 or (len(shape) == 4 and shape[1] == ranks)):
                    d[1] = cp
        if not mine:
            for g in grads_of(moe_in[-1]):
                shard_seq(g)
            shard_seq(moe_out[-1])


# -- the vocab-parallel loss ---------------------------------------------------------------------


def vocab_parallel_loss(prog: Program) -> Program:
    """A copy of ``prog`` whose hard-label ``cross_entropy_with_softmax`` ops (softmax over the
    last axis) and their grads are ``c_softmax_with_cross_entropy`` (and its grad) with the same
    ``ignore_index``: the same values, but the class axis may stay sharded. ``prog`` itself
    when it has none. An imported program's other fields (sources, loss, ...) are kept."""
    ops = list(prog.ops)
    changed = False
    for i, op in enumerate(ops):
        a = op.attrs
        hard = not a.get("soft_label", False) and a.get("use_softmax", True)
        x = op.inputs.get("x") if op.rule == "cross_entropy_with_softmax" else op.inputs.get("softmax")
        if not isinstance(x, str):
            continue
        nd = len(prog.tensors[x].shape)
        ax = int(a.get("axis", -1))
        if not hard or ax not in (-1, nd - 1):
            continue
        attrs = {"ignore_index": int(a.get("ignore_index", -100))}
        if op.rule == "cross_entropy_with_softmax":
            ops[i] = replace(op, rule="c_softmax_with_cross_entropy", attrs=attrs,
                             inputs={"x": x, "label": op.inputs["label"]})
            changed = True
        elif op.rule == "cross_entropy_with_softmax_grad":
            ops[i] = replace(op, rule="c_softmax_with_cross_entropy_grad", attrs=attrs,
                             inputs={"softmax": x, "label": op.inputs["label"], "loss_grad": op.inputs["loss_grad"]})
            changed = True
    if not changed:
        return prog
    return rebuild(prog, list(prog.tensors.values()), [(i, op) for i, op in enumerate(ops)])


def vocab_parallel_embedding(prog: Program, tables: Iterable[str]) -> Program:
    """A copy of ``prog`` whose ``embedding`` ops on ``tables`` with a ``padding_idx`` look up
    every row (``padding_idx=-1``: torch's forward, which does not zero the padding row) and
    whose ``embedding_grad`` ops on them mask the padding positions' output gradient instead
    (``full_like`` / ``not_equal`` / ``cast`` / ``unsqueeze`` / ``multiply``, then
    ``padding_idx=-1``): the same values, and the table may be vocab-sharded (the rule keeps a
    padded table's rows replicated). ``prog`` itself when no such op reads them."""
    tabs = set(tables)
    tensors = list(prog.tensors.values())
    names = set(prog.tensors)
    out: list[tuple[int | None, Op]] = []
    changed = False

    fresh = namer(names)

    for i, op in enumerate(prog.ops):
        pad = int(op.attrs.get("padding_idx", -1))
        w = op.inputs.get("weight")
        if op.rule not in ("embedding", "embedding_grad") or pad < 0 or w not in tabs:
            out.append((i, op))
            continue
        changed = True
        attrs = {**op.attrs, "padding_idx": -1}
        if op.rule == "embedding":
            out.append((i, replace(op, attrs=attrs)))
            continue
        ids, g = op.inputs["x"], op.inputs["out_grad"]
        it, gt = prog.tensors[ids], prog.tensors[g]
        kw = {"layer": op.layer, "phase": op.phase}
        full = fresh(f"{ids}.padding_idx")
        keep = fresh(f"{ids}.not_padding")
        keepf = fresh(f"{ids}.not_padding_f")
        keep1 = fresh(f"{ids}.not_padding_f1")
        masked = fresh(f"{g}.unpadded")
        tensors += [Tensor(full, it.shape, it.dtype), Tensor(keep, it.shape, "bool"),
                    Tensor(keepf, it.shape, gt.dtype), Tensor(keep1, (*it.shape, 1), gt.dtype),
                    Tensor(masked, gt.shape, gt.dtype, "gradient" if gt.kind == "gradient" else "activation")]
        out += [(None, Op("full_like", {"x": ids}, (full,), {"y": pad, "dtype": it.dtype}, name=full, **kw)),
                (None, Op("not_equal", {"x": ids, "y": full}, (keep,), {}, name=keep, **kw)),
                (None, Op("cast", {"x": keep}, (keepf,), {"dtype": gt.dtype}, name=keepf, **kw)),
                (None, Op("unsqueeze", {"x": keepf}, (keep1,), {"axis": (len(it.shape),)}, name=keep1, **kw)),
                (None, Op("multiply", {"x": g, "y": keep1}, (masked,), {}, name=masked, **kw)),
                (i, replace(op, inputs={**op.inputs, "out_grad": masked}, attrs=attrs))]
    if not changed:
        return prog
    return rebuild(prog, tensors, out)


def mirror_forward_layouts(plan: Plan, dims: Iterable[int]) -> dict[str, TensorDistAttr]:
    """Gradients to hold as their forward tensors are held over mesh dims ``dims`` (tp): where
    ``plan`` reduce-scatters a partial gradient ``X.grad`` onto an axis that ``X`` is whole on
    over those dims (DeepSeek's MLA: the rope key's one head, expanded to every head, its gradient
    a partial sum over the tp ranks' heads that a concat_grad would scatter over the batch), the
    gradient's layout is ``X``'s, so it is all-reduced, as Megatron's backward mirrors its forward
    and the batch is never cut over tp. Empty when there is none."""
    prog = plan.program
    want = set(dims)
    made = {o: i for i, op in enumerate(prog.ops) for o in op.output_names()}
    out: dict[str, TensorDistAttr] = {}
    for r in plan.reshards:
        if r.shared or not r.src.partial or not r.tensor.endswith(".grad"):
            continue
        fwd = r.tensor[:-len(".grad")]
        if fwd not in prog.tensors or prog.ops[made.get(fwd, 0)].phase != "forward" or fwd not in made:
            continue
        a = plan.attr(fwd)
        cut = {d for e in r.dst.dims_mapping for d in (e if isinstance(e, (list, tuple)) else (e,)) if d != -1}
        held = {d for e in a.dims_mapping for d in (e if isinstance(e, (list, tuple)) else (e,)) if d != -1}
        if (cut - held) & want and not a.partial:
            out[r.tensor] = TensorDistAttr(a.mesh, a.dims_mapping)
    return out


def regroup_partial_sums(prog: Program, plan: Plan) -> Program:
    """A copy of ``prog`` where an ``add_n`` that ``plan`` feeds two or more partial inputs
    (partial alike) and some that are not first sums the partial ones (one ``add_n``, still
    partial: one reduction where the rule would reduce each) and then adds the rest. BERT's
    post-LN backward: the q, k and v input gradients (partial over tp) meet the residual one
    (not partial) in one ``add_n``. ``prog`` itself when there is no such op. The sum is the
    same up to the order of floating-point additions."""
    out: list[tuple[int | None, Op]] = []
    tensors = list(prog.tensors.values())
    names = set(prog.tensors)
    changed = False
    for i, op in enumerate(prog.ops):
        ins = op.inputs.get("input")
        given = plan.ops[i].given.get("input") if op.rule == "add_n" else None
        if op.rule != "add_n" or not isinstance(ins, (list, tuple)) or not isinstance(given, tuple):
            out.append((i, op))
            continue
        part = [k for k, a in enumerate(given) if a is not None and a.partial]
        if part:
            ref = given[part[0]]
            part = [k for k in part if given[k] == ref]
        rest = [k for k in range(len(ins)) if k not in part]
        if len(part) < 2 or not rest:
            out.append((i, op))
            continue
        o = op.output_names()[0]
        t = prog.tensors[o]
        n, k = f"{o}.partial", 1
        while n in names:
            n, k = f"{o}.partial{k}", k + 1
        names.add(n)
        tensors.append(Tensor(n, t.shape, t.dtype, "gradient" if t.kind == "gradient" else "activation"))
        out.append((None, Op("add_n", {"input": tuple(ins[k] for k in part)}, (n,), {}, name=n, layer=op.layer,
                             phase=op.phase)))
        out.append((i, replace(op, inputs={**op.inputs, "input": (n, *(ins[k] for k in rest))})))
        changed = True
    if not changed:
        return prog
    return rebuild(prog, tensors, out)


def megatron_program(prog: Program, patterns: Mapping[str, str] | Iterable[tuple[str, str]] | None = None
                     ) -> Program:
    """``prog`` made ready for ``megatron``: its loss vocab-parallel
    (:func:`vocab_parallel_loss`), its vocab-parallel tables' ``padding_idx`` lookups
    rewritten (:func:`vocab_parallel_embedding`) and its fused column projections split
    (:func:`split_fused_projections`)."""
    roles = tp_roles(prog, patterns)
    vocab = [p for p, r in roles.items() if r == "vocab"]
    fused = [p for p, r in roles.items() if r == "column" and len(prog.tensors[p].shape) == 2]
    prog = vocab_parallel_embedding(vocab_parallel_loss(prog), vocab)
    prog = split_fused_projections(slices_as_split(prog, fused), fused)
    return parts_as_parameters(prog, [p for p, r in roles.items() if r == "column"])


__all__ = ["DEFAULT_PATTERNS", "ROLES", "annotate_program", "check_patterns", "data_inputs", "forward_readers", "megatron_program",
           "optimizer_of", "parameters", "regroup_partial_sums", "role_of", "split_fused_projections", "tp_roles", "vocab_parallel_embedding", "vocab_parallel_loss",
           "weight_axes"]
