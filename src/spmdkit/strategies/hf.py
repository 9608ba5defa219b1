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

Default patterns: :data:`spmdkit.strategies.hf_patterns.DEFAULT_PATTERNS` (its module's
docstring has the table; a pattern is a glob over the module path, or ``re:`` a regular
expression).

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
  output sliced back to the sequence shard (its gradient gathered), a shared expert inside the
  block (its row layer all-reduced there, not reduce-scattered); with ``ep`` the batch is
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

Beside this module (the annotations: :func:`annotate_program`): the roles by pattern
(:mod:`spmdkit.strategies.hf_patterns`), what the program says about itself
(:mod:`spmdkit.strategies.hf_program`), ``sp`` (:mod:`spmdkit.strategies.hf_sp`), the programs
``megatron`` rewrites (:mod:`spmdkit.strategies.hf_rewrite`).

Standard library only.
"""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.program.ir import Op, Program
from spmdkit.strategies.context import hf_cp_marks
from spmdkit.strategies.experts import (
    batch_entry,
    check_ep,
    check_tp_chunks,
    ep_dim,
    ep_from_cp,
    expert_fold,
    expert_marks,
    moe_layers,
)
from spmdkit.strategies.hf_fused import fused_parts, split_fused_projections
from spmdkit.strategies.hf_moe import moe_projections, shard_experts
from spmdkit.strategies.hf_patterns import (
    DEFAULT_PATTERNS,
    KV_NAMES,
    ROLES,
    check_patterns,
    role_of,
    tp_roles,
    warn_unmatched,
)
from spmdkit.strategies.hf_program import (
    data_inputs,
    forward_readers,
    module_paths,
    optimizer_of,
    output_heads,
    parameters,
    weight_axes,
)
from spmdkit.strategies.hf_rewrite import (
    megatron_program,
    regroup_partial_sums,
    vocab_parallel_embedding,
    vocab_parallel_loss,
)
from spmdkit.strategies.hf_roles import BLOCK, block_roles, linears
from spmdkit.strategies.hf_sp import sequence_parallel
from spmdkit.strategies.strategy import Marks, optimizer_layouts, strategy_dims, user_attrs

#: what :func:`_shard_weights` notes for a k / v projection it replicates (fewer heads than tp)
KV_REPLICATED = "kv_replicated"
#: what annotate_program notes for a low-rank down projection it keeps whole (MLA's q_a_proj)
LOW_RANK = "low_rank"


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
                                                                    module_paths(prog, p))}
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
            sequence_parallel(prog, mesh, sharded, dm, batch_entry(dp, bep), tp, cp, expert_fold(mesh, st))
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
                               f"does not divide (each rank whole sequences; an --hf model is traced at --batch "
                               f"sequences, a --program file at its own)")
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
        for path in module_paths(prog, p):
            r = role_of(path, user_pats)
            if r is not None:
                return r
        return None

    replicated: set[str] = set()  # column layers left whole (kv heads fewer than tp), with their bias
    notes: list[tuple[str, str]] = []  # (module, what was done): warned of once per module of a layer
    parts = fused_parts(prog)
    for p, role in sorted(roles.items(), key=lambda kv: len(prog.tensors[kv[0]].shape) == 1):
        if p in parts:
            continue  # a part of a fused projection: _shard_fused_parts
        t = prog.tensors[p]
        mod = module_paths(prog, p)[0]
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
                               f"axis has {t.shape[axis]} entries, not divisible by tp={size}"
                               + (pad_hint(t.shape[axis], size) if role == "vocab" else ""))
        if role == "column" and op is not None:
            heads = output_heads(prog, readers, op.output_names()[0], t.shape[axis])
            if heads is not None and heads < size and size % heads == 0 and user_role(p) is None \
                    and (mod.rsplit(".", 1)[-1] in KV_NAMES or p in kv):
                # fewer kv heads than tp (GQA / MQA): replicated on every rank, as Megatron does
                notes.append((mod, f"makes {heads} heads, fewer than tp={size}: replicated over tp (its gradients "
                                   f"are all-reduced)"))
                replicated.add(mod)
                sharded[p] = KV_REPLICATED
                continue
            if heads is not None and heads % size:
                raise ProgramError(f"--strategy megatron: {mod} (column) makes {heads} heads, not divisible "
                                   f"by tp={size} (give it a pattern, e.g. {{'{mod.rsplit('.', 1)[-1]}': "
                                   f"'replicate'}}, or a smaller tp)")
        dm(p)[axis] = tp
        sharded[p] = "vocab_head" if role == "vocab" and how == "linear" else role
    warn_by_layers(notes)
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
        groups.setdefault(module_paths(prog, part)[0], ([], []))[len(prog.tensors[part].shape) == 1].append(part)
    notes: list[tuple[str, str]] = []
    for mod, (wparts, bparts) in groups.items():
        feats: list[int] = []
        heads: list[int | None] = []
        axes: list[int] = []
        for part in wparts:
            how, out_ax, _in, mop = weight_axes(prog, readers, part)
            f = prog.tensors[part].shape[out_ax] if how == "linear" else 0
            feats.append(f)
            axes.append(out_ax if how == "linear" and mop is not None else -1)
            heads.append(output_heads(prog, readers, mop.output_names()[0], f) if mop is not None and f else None)
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
                notes.append((mod, f"part {j} ({f} of {sum(feats)} features) makes {h} head{'s' if h > 1 else ''}, "
                                   f"fewer than tp={size}: replicated over tp (its gradients are all-reduced)"))
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
    warn_by_layers(notes)


def pad_hint(vocab: int, tp: int, by: int = 128) -> str:
    """The way out of a vocabulary tp does not divide, as Megatron-LM takes it: padded to a multiple
    of ``--make-vocab-size-divisible-by`` (``by``, 128 its default) x tp
    (``megatron.training.vocab_utils.calculate_padded_vocab_size``)."""
    padded = -(-vocab // (by * tp)) * by * tp
    return (f"; pad it as Megatron-LM does: --make-vocab-size-divisible-by {by} pads it to {padded} "
            f"(a multiple of {by} x tp={tp})")


def warn_by_layers(notes: list[tuple[str, str]]) -> None:
    """One warning per module of a layer and what was done to it, not one per layer: the same
    module of every layer (``model.layers.0.self_attn.k_proj`` ... ``model.layers.31...``) is
    named once as ``model.layers.*.self_attn.k_proj (32 layers)`` (Llama-3-8B on tp=16 gave 64
    lines); a module of one layer by its own name."""
    groups: dict[tuple[str, str], list[str]] = {}
    for mod, what in notes:
        groups.setdefault((re.sub(r"\.\d+(?=\.|$)", ".*", mod), what), []).append(mod)
    for (glob, what), mods in groups.items():
        name = mods[0] if len(mods) == 1 else f"{glob} ({len(mods)} layers)"
        warnings.warn(f"--strategy megatron: {name} {what}", stacklevel=4)


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
        if any(role_of(path, user_pats) == "replicate" for path in module_paths(prog, w)):
            continue
        left.append(w)
    for op in prog.ops:  # 3-D parameters outside a MoE layer the experts' sharding found (shard_experts)
        if op.phase == "forward" and BLOCK.fullmatch(op.layer or ""):
            left += [n for n in op.input_names() if prog.tensors[n].kind == "parameter" and n not in left
                     and len(prog.tensors[n].shape) >= 3 and n not in sharded]
    if not left:
        return
    mods = {module_paths(prog, w)[0] for w in left}
    size = {p: math.prod(prog.tensors[p].shape) for p in parameters(prog)}
    mine = sum(n for p, n in size.items() if p in left or module_paths(prog, p)[0] in mods)
    share = mine / max(1, sum(size.values()))
    groups = Counter(re.sub(r"\.\d+(?=\.|$)", ".*", m) for m in sorted(mods))
    shown = [f"{g} ({k})" if k > 1 else g for g, k in groups.items()]
    more = f" and {len(shown) - 6} more" if len(shown) > 6 else ""
    warnings.warn(f"--strategy megatron: {len(mods)} layer{'s' if len(mods) > 1 else ''} left replicated "
                  f"over tp, {share_text(share)} of the parameters (no column / row role from the graph or the names): "
                  f"{', '.join(shown[:6])}{more}; a linear layer can be given a role with --tp-plan", stacklevel=3)


def share_text(share: float) -> str:
    """A share of the parameters as a percentage to one decimal; a share below 0.1% but not zero
    (a MoE router, a shared_expert_gate: "0.0%" read as none) reads "<0.1%"."""
    return "<0.1%" if 0 < share < 0.001 else f"{share:.1%}"


__all__ = ["DEFAULT_PATTERNS", "ROLES", "annotate_program", "check_patterns", "data_inputs", "forward_readers", "megatron_program",
           "optimizer_of", "parameters", "regroup_partial_sums", "role_of", "share_text", "split_fused_projections", "tp_roles", "vocab_parallel_embedding", "vocab_parallel_loss",
           "weight_axes"]
