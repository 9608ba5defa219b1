"""Parallel strategies for imported programs (HuggingFace models and any torch module), by
parameter names.

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
- ``megatron`` (``tp``): a parameter's module path (its name without ``.weight`` / ``.bias``,
  or a tied parameter's other names) is matched against the patterns below, first match
  wins, the user's before the defaults: ``column`` shards a linear layer's output features
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
bias (the parameters stay the module's, replicated over ``tp``), each part column-parallel:
the attention is tensor parallel head-wise, and the parts' weight gradients are all-gathered
(weight-sized, not activation-sized) into the weight's gradient.

- ``sp`` (with ``megatron``): Megatron sequence parallel. The residual stream (the
  vocab-parallel embeddings' outputs, the row layers' outputs and the adds that take them)
  and its gradient are sharded on their sequence axis over ``tp``, so HF's decomposed norms
  (``square`` / ``mean`` / ``rsqrt`` / ``multiply``, or the layer norm op) run on sequence
  shards; the inputs of the column layers and of the LM head are gathered (their summed
  gradients reduce-scattered back), the row layers' partial outputs reduce-scattered and
  their output gradients gathered: every tensor-parallel all-reduce becomes an all-gather /
  reduce-scatter pair. A sequence length ``tp`` does not divide is refused (ViT's 17 tokens
  at tp=2).

``megatron`` also makes the loss vocab-parallel: :func:`vocab_parallel_loss` rewrites the
imported ``cross_entropy_with_softmax`` (hard labels, ``ignore_index``) and its grad into
``c_softmax_with_cross_entropy`` (Megatron's cross entropy: max, sum of exponentials and the
label's logit all-reduced over the vocab shards), so the ``[tokens, vocab]`` logits are never
all-gathered. The sum / count of counted tokens after it is unchanged.

Standard library only.
"""

from __future__ import annotations

import fnmatch
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.program.ir import Op, Program, Tensor
from spmdkit.program.plan import Plan
from spmdkit.strategies.strategy import Marks, optimizer_layouts, strategy_dims, user_attrs

ROLES = ("column", "row", "vocab", "replicate")

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
    """The module paths a parameter goes by: its own and those of its tied aliases."""
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
    for _ in range(3):
        nxt: list[str] = []
        for n in frontier:
            for _i, op, _p in readers.get(n, []):
                o = op.output_names()
                if not o:
                    continue
                shape = prog.tensors[o[0]].shape
                if op.rule == "reshape" and len(shape) == len(prog.tensors[n].shape) + 1 \
                        and shape[-1] * shape[-2] == features:
                    return shape[-2]
                if op.rule in ("add", "elementwise_add", "cast"):
                    nxt.append(o[0])
        frontier = nxt
    return None


def weight_axes(prog: Program, readers: dict[str, list[tuple[int, Op, str]]],
                 param: str) -> tuple[str, int, int, Op | None]:
    """(how the weight is read, output-feature axis, input-feature axis, the reading op):
    ``linear`` for a 2-D matmul ``y``, ``embedding`` for a table; ``other`` otherwise."""
    t = prog.tensors[param]
    for _i, op, p in readers.get(param, []):
        if op.rule == "matmul" and p == "y" and len(t.shape) == 2:
            ty = bool(op.attrs.get("trans_y", False))
            return ("linear", 0 if ty else 1, 1 if ty else 0, op)
        if op.rule in ("embedding", "c_embedding") and p == "weight":
            return ("embedding", 1, 0, op)
    return ("other", -1, -1, None)


# -- the annotations -----------------------------------------------------------------------------


def tp_roles(prog: Program, patterns: Mapping[str, str] | Iterable[tuple[str, str]] | None = None
             ) -> dict[str, str]:
    """parameter -> role (``column`` / ``row`` / ``vocab``; replicated ones left out) under the
    user's ``patterns`` then :data:`DEFAULT_PATTERNS`."""
    pats = check_patterns(patterns) + list(DEFAULT_PATTERNS)
    out: dict[str, str] = {}
    for p in parameters(prog):
        for path in _module_paths(prog, p):
            r = role_of(path, pats)
            if r is not None:
                if r != "replicate":
                    out[p] = r
                break
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

    if dp is not None:
        _shard_batch(prog, mesh, dm, dp)
    if tp is not None:
        readers = forward_readers(prog)
        roles = tp_roles(prog, patterns)
        # 2-D weights sharded over tp -> column / row / vocab / vocab_head
        sharded = _shard_weights(prog, mesh, dm, tp, readers, roles, check_patterns(patterns))
        _shard_fused_parts(prog, mesh, dm, tp, readers, roles, sharded)
        if "sp" in st:
            _sequence_parallel(prog, mesh, sharded, dm, dp, tp)
    optimizer_layouts(prog, mesh, optimizer_of(prog), out, st, dp, user)
    attrs = {n: TensorDistAttr(mesh, d) for n, d in out.items()}
    attrs.update(user_attrs(prog, mesh, user))
    return attrs


def _shard_batch(prog: Program, mesh: ProcessMesh, dm: Marks, dp: int) -> None:
    """``dp``: the batch axis of every data input over ``dp``."""
    size = mesh.shape[dp]
    for n in data_inputs(prog):
        shape = prog.tensors[n].shape
        if not shape:
            continue
        if shape[0] % size:
            raise ProgramError(f"--strategy dp: input {n} has batch size {shape[0]}, which dp={size} "
                               f"does not divide")
        dm(n)[0] = dp


def _shard_weights(prog: Program, mesh: ProcessMesh, dm: Marks, tp: int,
                   readers: dict[str, list[tuple[int, Op, str]]], roles: Mapping[str, str],
                   user_pats: list[tuple[str, str]]) -> dict[str, str]:
    """``megatron``: each parameter with a role sharded over ``tp`` on the axis its role and
    its reader give (a bias with its layer); the 2-D weights sharded, by role."""
    size = mesh.shape[tp]
    sharded: dict[str, str] = {}

    def user_role(p: str) -> str | None:
        for path in _module_paths(prog, p):
            r = role_of(path, user_pats)
            if r is not None:
                return r
        return None

    replicated: set[str] = set()  # column layers left whole (kv heads fewer than tp), with their bias
    for p, role in sorted(roles.items(), key=lambda kv: len(prog.tensors[kv[0]].shape) == 1):
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
                    and mod.rsplit(".", 1)[-1] in _KV:
                # fewer kv heads than tp (GQA / MQA): replicated on every rank, as Megatron does
                warnings.warn(f"--strategy megatron: {mod} makes {heads} heads, fewer than tp={size}: "
                              f"replicated over tp (its gradients are all-reduced)", stacklevel=3)
                replicated.add(mod)
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
                       sharded: dict[str, str]) -> None:
    """The parts of a split fused projection (:func:`split_fused_projections`): each
    column-parallel (added to ``sharded``)."""
    size = mesh.shape[tp]
    for op in prog.ops:
        src = op.inputs.get("input") if op.rule == "slice" and op.phase == "forward" else None
        if not isinstance(src, str) or roles.get(src) != "column" or src in sharded:
            continue
        part = op.output_names()[0]
        pt = prog.tensors[part]
        mod = _module_paths(prog, src)[0]
        if len(pt.shape) == 1:  # a part of the bias
            if pt.shape[0] % size:
                raise ProgramError(f"--strategy megatron: {mod} (column): a bias part of {pt.shape[0]} is not "
                                   f"divisible by tp={size}")
            dm(part)[0] = tp
            continue
        how, out_ax, _in, mop = weight_axes(prog, readers, part)
        if how != "linear" or mop is None:
            continue
        if pt.shape[out_ax] % size:
            raise ProgramError(f"--strategy megatron: {mod} (column): a part of {pt.shape[out_ax]} features is "
                               f"not divisible by tp={size}")
        heads = _heads(prog, readers, mop.output_names()[0], pt.shape[out_ax])
        if heads is not None and heads % size:
            raise ProgramError(f"--strategy megatron: {mod} (column) makes {heads} heads, not divisible "
                               f"by tp={size}")
        dm(part)[out_ax] = tp
        sharded[part] = "column"


def _sequence_parallel(prog: Program, mesh: ProcessMesh, sharded: Mapping[str, str], dm: Any,
                       dp: int | None, tp: int) -> None:
    """Megatron sequence parallel on an imported program: the residual stream (the outputs of
    the adds that take a row-parallel layer's output, and of the vocab-parallel embeddings)
    sharded on its sequence axis (1) over tp, so the row layers' partial outputs are
    reduce-scattered into it and the norms between run on sequence shards; the inputs of the
    column-parallel layers and of the LM head are gathered (sequence whole), and so are the
    gradients of the row layers' outputs in the backward step."""
    size = mesh.shape[tp]
    fwd = [(i, op) for i, op in enumerate(prog.ops) if op.phase == "forward"]
    readers = forward_readers(prog)
    seq: list[str] = []
    row_out: list[str] = []
    gather: list[str] = []
    for _i, op in fwd:
        y = op.inputs.get("y") if op.rule == "matmul" else op.inputs.get("weight")
        role = sharded.get(y) if isinstance(y, str) else None
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
        if op.phase == "backward" and op.rule == "matmul_grad" and isinstance(y, str) and sharded.get(y) == "row":
            gather.append(op.inputs["out_grad"])

    producer = {o: op for op in prog.ops if op.phase == "forward" for o in op.output_names()}

    def grads_of(n: str) -> list[str]:
        """The gradients of activation ``n`` (the importer's ``n.grad``, ``n.gradK``, and their
        sum ``n.grad.sum``)."""
        pat = re.compile(re.escape(n) + r"\.grad(\d*|\.sum)")
        return [g for g in prog.tensors if pat.fullmatch(g) and prog.tensors[g].shape == prog.tensors[n].shape]

    batch = {prog.tensors[n].shape[0] for n in data_inputs(prog) if prog.tensors[n].shape}

    def shard_seq(n: str) -> None:
        shape = prog.tensors[n].shape
        if len(shape) == 2 and batch and shape[0] % max(batch) == 0 and shape[0] > max(batch):
            # tokens flattened ([batch * seq, hidden], GPT-2's Conv1D): batch over dp, then seq over tp
            if (shape[0] // max(batch)) % size:
                raise ProgramError(f"--strategy sp: {n} has {shape[0] // max(batch)} tokens per sequence, not "
                                   f"divisible by tp={size}")
            dm(n)[0] = [dp, tp] if dp is not None else tp
            return
        if len(shape) != 3:
            return
        if shape[1] % size:
            raise ProgramError(f"--strategy sp: {n} has sequence length {shape[1]}, not divisible by tp={size}")
        d = dm(n)
        d[0], d[1] = (dp if dp is not None else -1), tp

    for n in seq:
        # the residual stream and its gradient, sequence-sharded
        shard_seq(n)
        for g in grads_of(n):
            shard_seq(g)
    for n in row_out:
        shard_seq(n)  # its gradient stays gathered: the row layer's weight gradient reads it whole
    for n in gather:
        d = dm(n)
        if dp is not None and d:
            d[0] = dp
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
    return _rebuild(prog, list(prog.tensors.values()), [(i, op) for i, op in enumerate(ops)])


def _namer(names: set[str]) -> Callable[[str], str]:
    """``fresh(base)``: ``base``, or ``base1``, ``base2``, ... the first not in ``names`` (which
    it joins)."""

    def fresh(base: str) -> str:
        n, k = base, 1
        while n in names:
            n, k = f"{base}{k}", k + 1
        names.add(n)
        return n

    return fresh


def _rebuild(prog: Program, tensors: list[Any], ops: list[tuple[int | None, Op]]) -> Program:
    """A copy of ``prog`` (of its class, its other fields kept) with ``tensors`` and ``ops``
    (each with the index it had, None for a new one); an imported program's per-op maps
    (``modules``, ``origins``, ``fallbacks``) follow the ops to their new indices."""
    new = prog.__class__.__new__(prog.__class__)
    new.__dict__.update(prog.__dict__)
    Program.__init__(new, tensors, [op for _, op in ops], prog.name)
    where = {old: i for i, (old, _) in enumerate(ops) if old is not None}
    for field in ("modules", "origins", "fallbacks"):
        m = getattr(prog, field, None)
        if isinstance(m, dict):
            setattr(new, field, {where[k]: v for k, v in m.items() if k in where})
    return new


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

    fresh = _namer(names)

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
    return _rebuild(prog, tensors, out)


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
    return _rebuild(prog, tensors, out)


@dataclass(frozen=True)
class _Fused:
    """A fused projection found in a program: ``x @ w + b`` (ops ``mm``, ``add``), reshaped
    (``reshape``) and ``split`` into ``parts`` of ``sec`` features each, and its backward ops
    (``split_grad``, ``reshape_grad``, ``add_grad``, ``matmul_grad``); op indices and tensor
    names."""

    mm: int
    add: int
    reshape: int
    split: int
    split_grad: int
    reshape_grad: int
    add_grad: int
    matmul_grad: int
    x: str
    w: str
    b: str
    mm_out: str
    added: str
    parts: tuple[str, ...]
    sec: int
    out_ax: int
    xg: str
    wg: str
    bg: str


def _find_fused(prog: Program, ops: list[Op], i: int, ws: set[str],
                readers: dict[str, list[int]]) -> _Fused | None:
    """The fused projection whose matmul is op ``i`` on one of ``ws``, if it is one."""

    def only(name: str, rule: str) -> int | None:
        rs = [j for j in readers.get(name, []) if ops[j].phase == "forward"]
        return rs[0] if len(rs) == 1 and ops[rs[0]].rule == rule else None

    def find(rule: str, **inputs: Any) -> int | None:
        for j, o in enumerate(ops):
            if o.phase == "backward" and o.rule == rule and all(o.inputs.get(k) == v for k, v in inputs.items()):
                return j
        return None

    op = ops[i]
    w = op.inputs.get("y")
    if op.phase != "forward" or op.rule != "matmul" or w not in ws or len(prog.tensors[w].shape) != 2:
        return None
    x, mm = op.inputs["x"], op.output_names()[0]
    ia = only(mm, "add")
    b = ops[ia].inputs.get("y") if ia is not None else None
    if ia is None or not isinstance(b, str) or prog.tensors[b].kind != "parameter" or ops[ia].inputs.get("x") != mm:
        return None
    added = ops[ia].output_names()[0]
    ir = only(added, "reshape")
    if ir is None:
        return None
    ish = only(ops[ir].output_names()[0], "split")
    if ish is None:
        return None
    sp = ops[ish]
    parts = list(sp.outputs[0]) if isinstance(sp.outputs[0], (list, tuple)) else []
    nd = len(prog.tensors[sp.inputs["x"]].shape)
    secs = tuple(sp.attrs.get("sections", ()))
    if len(parts) < 2 or int(sp.attrs.get("axis", -1)) not in (-1, nd - 1) or len(set(secs)) != 1 \
            or len(secs) != len(parts) or None in parts:
        return None
    isg = find("split_grad", out_grad=tuple(p + ".grad" for p in parts))
    irg = find("reshape_grad", x_shape=added)
    iag = find("add_grad", x=mm, y=b)
    img = find("matmul_grad", x=x, y=w)
    if isg is None or irg is None or iag is None or img is None:
        return None
    if ops[irg].inputs.get("out_grad") != ops[isg].output_names()[0] \
            or ops[iag].inputs.get("out_grad") != ops[irg].output_names()[0] \
            or ops[img].inputs.get("out_grad") != ops[iag].outputs[0]:
        return None
    xg, wg = ops[img].outputs[0], ops[img].outputs[1]
    bg = ops[iag].outputs[1]
    if not isinstance(xg, str) or not isinstance(wg, str) or not isinstance(bg, str):
        return None
    return _Fused(i, ia, ir, ish, isg, irg, iag, img, x, w, b, mm, added, tuple(parts), secs[0],
                  0 if bool(op.attrs.get("trans_y", False)) else 1, xg, wg, bg)


def _split_fused(prog: Program, ops: list[Op], f: _Fused, tensors: list[Any],
                 fresh: Callable[[str], str]) -> tuple[list[Op], list[Op]]:
    """The forward and backward ops of ``f`` split into one projection per part (the new
    tensors appended to ``tensors``)."""
    T = prog.tensors
    sec, out_ax, w, b, mm, added = f.sec, f.out_ax, f.w, f.b, f.mm_out, f.added
    wt, bt, xt = T[w], T[b], T[f.x]
    fwd_kw = {"layer": ops[f.mm].layer, "phase": "forward"}
    bwd_kw = {"layer": ops[f.split_grad].layer, "phase": "backward"}
    fwd: list[Op] = []
    bwd: list[Op] = []
    xgs, wgs, bgs = [], [], []
    for j, part in enumerate(f.parts):
        wj, bj = fresh(f"{w}.part{j}"), fresh(f"{b}.part{j}")
        mmj, aj = fresh(f"{mm}.part{j}"), fresh(f"{added}.part{j}")
        wshape = list(wt.shape)
        wshape[out_ax] = sec
        mshape = list(T[mm].shape)
        mshape[-1] = sec
        tensors += [Tensor(wj, tuple(wshape), wt.dtype), Tensor(bj, (sec,), bt.dtype),
                    Tensor(mmj, tuple(mshape), T[mm].dtype), Tensor(aj, tuple(mshape), T[added].dtype)]
        fwd += [Op("slice", {"input": w}, (wj,), {"axes": (out_ax,), "starts": (j * sec,), "ends": ((j + 1) * sec,)},
                   name=wj, **fwd_kw),
                Op("slice", {"input": b}, (bj,), {"axes": (0,), "starts": (j * sec,), "ends": ((j + 1) * sec,)},
                   name=bj, **fwd_kw),
                Op("matmul", {"x": f.x, "y": wj}, (mmj,), dict(ops[f.mm].attrs), name=mmj, **fwd_kw),
                Op("add", {"x": mmj, "y": bj}, (aj,), {}, name=aj, **fwd_kw),
                Op("reshape", {"x": aj}, (part,), {"shape": T[part].shape}, name=part, **fwd_kw)]
        ajg, mmjg, bjg = fresh(aj + ".grad"), fresh(mmj + ".grad"), fresh(bj + ".grad")
        xjg, wjg = fresh(f"{f.xg}.part{j}"), fresh(wj + ".grad")
        tensors += [Tensor(ajg, tuple(mshape), T[added].dtype, "gradient"),
                    Tensor(mmjg, tuple(mshape), T[mm].dtype, "gradient"),
                    Tensor(bjg, (sec,), bt.dtype, "gradient"),
                    Tensor(xjg, xt.shape, T[f.xg].dtype, "gradient"),
                    Tensor(wjg, tuple(wshape), T[f.wg].dtype, "gradient")]
        bwd += [Op("reshape_grad", {"x_shape": aj, "out_grad": part + ".grad"}, (ajg,), {}, name=ajg, **bwd_kw),
                Op("add_grad", {"x": mmj, "y": bj, "out_grad": ajg}, (mmjg, bjg), {}, name=mmjg, **bwd_kw),
                Op("matmul_grad", {"x": f.x, "y": wj, "out_grad": mmjg}, (xjg, wjg), dict(ops[f.matmul_grad].attrs),
                   name=xjg, **bwd_kw)]
        xgs.append(xjg)
        wgs.append(wjg)
        bgs.append(bjg)
    bwd += [Op("add_n", {"input": tuple(xgs)}, (f.xg,), {}, name=f.xg, **bwd_kw),
            Op("concat", {"x": tuple(wgs)}, (f.wg,), {"axis": out_ax}, name=f.wg, **bwd_kw),
            Op("concat", {"x": tuple(bgs)}, (f.bg,), {"axis": 0}, name=f.bg, **bwd_kw)]
    return fwd, bwd


def split_fused_projections(prog: Program, weights: Iterable[str]) -> Program:
    """A copy of ``prog`` where a fused projection (GPT-2's ``c_attn``: ``x @ W + b`` reshaped
    and ``split`` into k equal parts on its last axis, q / k / v) on one of ``weights`` is k
    projections on slices of ``W`` and ``b`` (``slice`` ops, so the parameters stay the
    module's), and its backward likewise: each part's gradient through its own projection,
    the input gradients summed (``add_n``), the weight and bias gradients the ``concat`` of
    the parts'. The same values; each part can then be column-parallel (head-wise) on its
    own. ``prog`` itself when no projection matches."""
    ws = set(weights)
    ops = list(prog.ops)
    readers: dict[str, list[int]] = {}
    for i, op in enumerate(ops):
        for n in op.input_names():
            readers.setdefault(n, []).append(i)
    tensors = list(prog.tensors.values())
    names = set(prog.tensors)
    replace_at: dict[int, list[Op]] = {}
    drop: set[int] = set()
    dead: set[Any] = set()  # the fused tensors no op makes or reads any more
    for i in range(len(ops)):
        f = _find_fused(prog, ops, i, ws, readers)
        if f is None:
            continue
        replace_at[f.mm], replace_at[f.split_grad] = _split_fused(prog, ops, f, tensors, _namer(names))
        drop.update({f.add, f.reshape, f.split, f.reshape_grad, f.add_grad, f.matmul_grad})
        dead.update({f.mm_out, f.added, ops[f.reshape].output_names()[0], *ops[f.split_grad].output_names(),
                     *ops[f.reshape_grad].output_names(), ops[f.add_grad].outputs[0]})
    if not replace_at:
        return prog
    out: list[tuple[int | None, Op]] = []
    for i, op in enumerate(ops):
        if i in replace_at:
            out += [(None, o) for o in replace_at[i]]
        elif i not in drop:
            out.append((i, op))
    return _rebuild(prog, [t for t in tensors if t.name not in dead], out)


def megatron_program(prog: Program, patterns: Mapping[str, str] | Iterable[tuple[str, str]] | None = None
                     ) -> Program:
    """``prog`` made ready for ``megatron``: its loss vocab-parallel
    (:func:`vocab_parallel_loss`), its vocab-parallel tables' ``padding_idx`` lookups
    rewritten (:func:`vocab_parallel_embedding`) and its fused column projections split
    (:func:`split_fused_projections`)."""
    roles = tp_roles(prog, patterns)
    vocab = [p for p, r in roles.items() if r == "vocab"]
    fused = [p for p, r in roles.items() if r == "column" and len(prog.tensors[p].shape) == 2]
    return split_fused_projections(vocab_parallel_embedding(vocab_parallel_loss(prog), vocab), fused)


__all__ = ["DEFAULT_PATTERNS", "ROLES", "annotate_program", "check_patterns", "data_inputs", "forward_readers", "megatron_program",
           "optimizer_of", "parameters", "regroup_partial_sums", "role_of", "split_fused_projections", "tp_roles", "vocab_parallel_embedding", "vocab_parallel_loss",
           "weight_axes"]
