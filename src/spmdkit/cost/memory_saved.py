"""What the backward keeps of the forward and what it runs again: the activations a backward op
reads the values of (:func:`saved_activations`, :class:`ActivationMemory`), the regions each
recomputation mode runs again (:func:`recompute_regions`), where they run and what they read
(:func:`rerun_points`, :func:`recompute_inputs`, :func:`spans_with_recompute`), and the value
reads of a program those rest on (:func:`value_inputs`, :func:`value_reads`, :func:`value_spans`).
Read by the memory (:mod:`spmdkit.cost.memory`), the step (:mod:`spmdkit.cost.step`) and the
pipeline's stages. Standard library only. docs/devices.md, "Memory".

Activations kept for the backward. :func:`saved_activations` (plan, recompute) reads the program: a forward activation is *kept
for the backward* when a backward op reads its values. Some grad rules read a forward tensor
for its shape only (``add_grad``'s x and y, ``reshape_grad``'s x_shape, ...:
:data:`SHAPE_ONLY`); those reads keep nothing. Each kept tensor is counted once, in the
layer of the earliest layer's backward op that reads it (a layer's input belongs to the
layer whose norm reads it), at its local size under the plan (the largest shard). Under
Megatron-LM, the experts' output rows a ``moe_combine``'s backward reads for the routing
weights' gradient are not kept: Megatron-Core weights the tokens by the probabilities in the
experts' activation (:func:`spmdkit.cost.moe.combine_rows_unkept`).

A tensor held gathered by an all-gather right after its producer (sequence parallel's
normalised activations, which the column-parallel projections read whole) is kept as the
shard its producer made and gathered again for the backward, as Megatron-LM does
(Korthikanti et al. 2022, section 4.2.2): :attr:`ActivationMemory.regathered` lists those
all-gathers, which :func:`spmdkit.cost.step.estimate_step` adds to the backward.

Recomputation (``recompute``):

- ``none``: every kept tensor is held from the forward to its backward.
- ``selective``: the attention core of each layer (Korthikanti et al.: ``QK^T``, the
  scaling and mask, softmax, dropout on the probabilities and the product with V) is run
  again in the backward; its outputs are not kept, its inputs are. A core starts at a
  forward ``matmul`` / ``bmm`` of two batched activations (rank >= 3, neither a parameter:
  ``QK^T``) and takes every later forward op that reads a tensor of the core, up to and
  including the next such matmul (the product with V). A ``flash_attention`` keeps no
  score-sized tensor; Megatron-Core still checkpoints it (``recompute_modules`` core_attn):
  the fused kernel runs again in the backward and its output and statistics are not kept.
  Under torchtitan, its op-level policy instead (the flash kernel's outputs saved).
- ``selective:M1,M2,...``: Megatron-Core's ``--recompute-modules`` (core_attn, layernorm, mlp,
  moe, moe_act), each module's forward ops in each layer: :mod:`spmdkit.cost.recompute_modules`.
- ``full``: every transformer layer (the ops of a layer group whose label has a number:
  ``layer 3`` of a preset, ``model.layers.3`` of an imported HF model) is run again in the
  backward; only the tensors a layer reads from before it (its input) are kept, and those of
  its outputs that the backward of an op outside the recomputed layers reads (the last layer's
  output, which the final norm saves: :mod:`spmdkit.cost.checkpoints`). A program without numbered
  layer labels is refused with a ProgramError.
- ``full:K`` / ``every:N``: ``full``'s regions of the first K layers (Megatron-LM's block
  method) or of every N-th layer (torchtitan's ``selective_ac_option = N``,
  :func:`~spmdkit.cost.checkpoints.every_blocks`); a pipeline picks them per stage / per rank.

:data:`~spmdkit.cost.checkpoints.RECOMPUTE` names the modes. :func:`recompute_regions` gives the recomputed forward ops.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import ProgramError
from spmdkit.cost.checkpoints import (
    check_recompute,
    every_blocks,
    layer_numbers,
    layer_outputs_kept,
    recompute_every,
    recompute_layers,
    whole_layers,
)
from spmdkit.cost.moe import combine_rows_unkept, plan_loads
from spmdkit.cost.recompute_modules import module_regions, op_sac, recompute_modules
from spmdkit.cost.shards import local_numel
from spmdkit.program.ir import Op, Program, flat_refs
from spmdkit.program.plan import Plan

#: grad rule -> tensor parameters it reads for their shape (or dtype) only, not their values
SHAPE_ONLY: dict[str, frozenset[str]] = {
    **{r: frozenset({"x", "y"}) for r in ("add_grad", "subtract_grad", "where_grad")},
    **{r: frozenset({"x"}) for r in ("cast_grad", "concat_grad", "expand_grad", "gather_nd_grad", "index_select_grad",
                                     "mean_grad", "sum_grad", "unsqueeze_grad", "take_along_axis_grad")},
    "reshape_grad": frozenset({"x_shape"}),
    "squeeze_grad": frozenset({"xshape"}),
    "slice_grad": frozenset({"input"}),
    "embedding_grad": frozenset({"weight"}),
}


#: grad rule -> {output index: the input only that gradient reads}: a product's operand is read for
#: the other operand's gradient alone, so where that gradient is not made (``cos`` of a rotary
#: table, a constant) the operand is not kept, as torch's autograd saves ``self`` of ``mul`` only
#: when ``other`` requires a gradient
FOR_GRAD_ONLY: dict[str, dict[int, str]] = {"multiply_grad": {0: "y", 1: "x"}}


def value_inputs(op: Op) -> list[str]:
    """The tensors ``op`` reads the values of: its inputs less those its grad rule reads for
    their shape only (:data:`SHAPE_ONLY`) and those read only for a gradient it does not make
    (:data:`FOR_GRAD_ONLY`)."""
    skip = SHAPE_ONLY.get(op.rule, frozenset())
    only = FOR_GRAD_ONLY.get(op.rule)
    if only:
        skip = skip | {p for i, p in only.items() if i < len(op.outputs) and op.outputs[i] is None}
    if not skip:
        return op.input_names()
    return [n for p, v in op.inputs.items() if p not in skip for n in flat_refs(v) if n is not None]


_VALUE_INPUTS: weakref.WeakKeyDictionary[Program, list[list[str]]] = weakref.WeakKeyDictionary()


def all_value_inputs(prog: Program) -> list[list[str]]:
    """:func:`value_inputs` of every op of ``prog`` (program order), computed once per program."""
    got = _VALUE_INPUTS.get(prog)
    if got is None or len(got) != len(prog.ops):
        got = _VALUE_INPUTS[prog] = [value_inputs(op) for op in prog.ops]
    return got


def value_spans(prog: Program) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(the op that makes each tensor, the last op that reads its values, or makes it if none
    does, the last forward op that reads its values), by op index, for every tensor an op
    makes. A read for the shape only (:data:`SHAPE_ONLY`) keeps nothing alive: the framework
    keeps the shape, not the tensor (``Program.live_spans`` counts every read). Made once per
    program (:meth:`~spmdkit.program.ir.Program.derived`): read only."""
    return prog.derived("memory.value_spans", _value_spans)  # type: ignore[no-any-return]


def _value_spans(prog: Program) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    fwd_last: dict[str, int] = {}
    vin = all_value_inputs(prog)
    for i, op in enumerate(prog.ops):
        for n in op.output_names():
            first.setdefault(n, i)
            last.setdefault(n, i)
        for n in vin[i]:
            if n in first:
                last[n] = i
                if op.phase == "forward":
                    fwd_last[n] = i
    return first, last, fwd_last


def _is_act(prog: Program, n: str) -> bool:
    return prog.tensors[n].kind == "activation"


def _layer_groups(prog: Program, fwd: list[int], mode: str) -> list[list[int]]:
    """The forward ops of each numbered layer (``layer 3``), in program order; a ProgramError
    naming ``--recompute`` where no op has a numbered layer label."""
    groups: dict[str, list[int]] = {}
    for i in fwd:
        layer = prog.ops[i].layer
        if layer_numbers(layer):
            groups.setdefault(layer, []).append(i)
    if not groups:
        labels = sorted({prog.ops[i].layer for i in fwd})
        raise ProgramError(f"--recompute {mode}: no forward op is labelled with a numbered layer (the program's "
                           f"layer labels: {', '.join(repr(x) for x in labels[:8]) or 'none'}); this "
                           f"recomputation runs each numbered layer group again")
    return list(groups.values())


def recompute_regions(prog: Program, mode: str, framework: str = "megatron") -> list[list[int]]:
    """The forward ops run again in the backward, as regions (op indices in program order):
    one per attention core (``selective``; under ``framework`` torchtitan, its op-level policy:
    :func:`~spmdkit.cost.recompute_modules.op_sac`), per transformer layer (``full``) or per
    named module (``selective:M1,M2``: :mod:`spmdkit.cost.recompute_modules`), per layer of the
    first K in program order (``full:K`` without a pipeline: Megatron-Core's TransformerBlock
    ``_checkpointed_forward``, method block, checkpoints layers 0 .. K-1 of its chunk, the whole
    model at pp = 1; the embedding and head are no layer), per N-th layer (``every:N`` without a
    pipeline: torchtitan's ``selective_ac_option = N`` wraps layers N-1, 2N-1 ... counted from 0,
    :func:`~spmdkit.cost.checkpoints.every_blocks`); none for ``none``."""
    check_recompute(mode)
    fwd = [i for i, op in enumerate(prog.ops) if op.phase == "forward"]
    if mode == "none":
        return []
    k = recompute_layers(mode)
    n = recompute_every(mode)
    if mode == "full" or k is not None or n is not None:
        groups = _layer_groups(prog, fwd, mode)
        if k is not None and k > len(groups):
            raise ProgramError(f"--recompute {mode}: recomputes the first {k} layers, but the model has "
                               f"{len(groups)} (give K from 1 to {len(groups)})")
        if n is not None:
            if n > len(groups):
                raise ProgramError(f"--recompute {mode}: checkpoints layers {n}, {2 * n}, ... (counted from 1), but the "
                                   f"model has {len(groups)}, so none would be (give N from 1 to {len(groups)}, or none)")
            return [groups[i] for i in every_blocks([len(groups)], n)[0]]
        return groups[:k]
    mods = recompute_modules(mode)
    if framework == "torchtitan" and mods is None:
        return [r for r in (op_sac(prog, g) for g in _layer_groups(prog, fwd, mode)) if r]
    regions: list[list[int]] = []
    region: list[int] | None = None
    made: set[str] = set()
    for i in fwd:
        op = prog.ops[i]
        if op.rule == "flash_attention":
            # Megatron-Core's selective recomputation under flash attention (recompute_modules
            # core_attn: Transformer Engine's checkpointed core attention): the fused kernel runs
            # again in the backward; its output and softmax statistics are not kept, q, k, v are
            regions.append([i])
            continue
        two_acts = op.rule in ("matmul", "bmm") and all(
            isinstance(op.inputs.get(p), str) and _is_act(prog, op.inputs[p]) and len(prog.tensors[op.inputs[p]].shape) >= 3
            for p in ("x", "y"))
        if region is None:
            if two_acts:
                region, made = [i], set(op.output_names())
            continue
        if not any(n in made for n in op.input_names()):
            continue
        region.append(i)
        if two_acts:  # the product with V closes the core
            regions.append(region)
            region = None
        else:
            made.update(op.output_names())
    if mods is not None:  # Megatron-Core's recompute_modules (spmdkit.cost.recompute_modules)
        return module_regions(prog, _layer_groups(prog, fwd, mode), mods, regions, mode)
    return regions


#: the view ops (ops/view.py): torch's ``reshape`` / ``view`` / ``flatten`` of a contiguous
#: tensor, its ``squeeze`` / ``unsqueeze``, return a view of its storage, no copy
VIEW_RULES = frozenset({"reshape", "reshape2", "flatten", "squeeze", "unsqueeze", "unsqueeze2"})
#: ops whose output is a strided view of part of their input: a reshape of it copies
STRIDED_RULES = frozenset({"slice", "strided_slice", "split", "split_with_num", "unbind", "expand", "expand_as"})


def shared_storage(plan: Plan) -> dict[str, str]:
    """Forward tensor made by a view of another -> the first tensor of its chain of views, whose
    storage it is (:func:`view_inputs`)."""
    parents = view_inputs(plan)
    out: dict[str, str] = {}
    for y, (x, _) in parents.items():  # program order: x's own root is known already
        out[y] = out.get(x, x)
    return out


def view_inputs(plan: Plan) -> dict[str, tuple[str, int]]:
    """Forward tensor made by a view of another (a :data:`VIEW_RULES` op, or a ``transpose``) ->
    (the tensor it views, whose storage it is, the op making it), as torch allocates them:
    ``transpose`` is always a view (strides swapped); ``squeeze`` / ``unsqueeze`` too;
    ``reshape`` / ``flatten`` are a view of a tensor laid out contiguously (its transposes
    undone: HF's ``attn_output.transpose(1, 2)`` of SDPA's transposed flash output) and a copy
    of one that is not, or of a :data:`STRIDED_RULES` op's output (a new storage, the first of
    its own chain). Not where the plan copies the view's input for it (a reshard there that
    moves bytes or changes its local size) or where the view's local bytes are not the
    input's. A view is no new memory: torch frees a storage when its last view dies
    (docs/devices.md, "Memory": the attention output, which the flash kernel's backward and
    the output projection's both keep, is one storage)."""
    prog = plan.program
    copied: set[tuple[int, str]] = set()
    for r in plan.reshards:
        shape = prog.tensors[r.tensor].shape
        if not r.output and (r.plan.bytes_per_rank or any(s.bytes_per_rank for s in r.plan.steps)
                             or local_numel(r.src, shape) != local_numel(r.dst, shape)):
            copied.add((r.op_index, r.tensor))
    made_by: dict[str, str] = {}
    out: dict[str, tuple[str, int]] = {}
    order: dict[str, tuple[int, ...] | None] = {}  # a view -> its dims' order in its storage (None: not known)
    for i, op in enumerate(prog.ops):
        outs = op.output_names()
        for n in outs:
            made_by.setdefault(n, op.rule)
        x = op.inputs.get("x")
        if op.phase != "forward" or (op.rule not in VIEW_RULES and op.rule != "transpose") or \
                not isinstance(x, str) or len(outs) != 1:
            continue
        y = outs[0]
        tx, ty = prog.tensors[x], prog.tensors[y]
        if (i, x) in copied or tx.kind != "activation" or tx.itemsize != ty.itemsize or x not in plan.attrs or \
                y not in plan.attrs or local_numel(plan.attrs[x], tx.shape) != local_numel(plan.attrs[y], ty.shape):
            continue
        have = order.get(x, tuple(range(len(tx.shape))))
        if op.rule == "transpose":
            perm = tuple(op.attrs.get("perm", ()))
            order[y] = tuple(have[k] for k in perm) if have is not None and len(perm) == len(have) else None
        elif have == tuple(range(len(tx.shape))) and made_by.get(_root(out, x)) not in STRIDED_RULES:
            order[y] = tuple(range(len(ty.shape)))
        elif op.rule in ("squeeze", "unsqueeze", "unsqueeze2"):
            order[y] = None
        else:
            continue  # a reshape of a tensor not laid out contiguously: a copy
        out[y] = (x, i)
    return out


def _root(parents: dict[str, tuple[str, int]], n: str) -> str:
    while (p := parents.get(n)) is not None:
        n = p[0]
    return n


def storage_of(plan: Plan, group_of: Sequence[int] | None = None) -> Callable[[str, int], tuple[str, bool]]:
    """The one rule of which storage a tensor the backward keeps holds, in a group of ops (a
    pipeline stage; ``group_of``: op index -> group, None: one group): (tensor, cast), the tensor
    whose storage it is and whether that is a cast of its own. A view is its input's storage
    (:func:`view_inputs`) where the op making it runs in the group, and so on up its chain; a view
    made in an earlier stage reaches a stage as a buffer of its own, as does its base received
    beside it: each tensor a stage receives is a fresh allocation (Megatron-Core d98e8a64dd
    ``pipeline_parallel/p2p_communication.py`` ``_communicate``: ``create_tensor_recv_prev`` is a
    ``torch.empty`` per receive; torch.distributed.pipelining ``stage.py``: one ``_RecvInfo`` a
    stage input, its buffer ``_make_tensor_from_meta``'s ``torch.empty``). A tensor kept as its fp8
    cast (:func:`fp8_stashed`) is that cast, its own, whatever views share its 16-bit storage:
    Transformer Engine d0067d0da ``module/linear.py`` quantizes each linear's input
    (``inputmat = input_quantizer(inputmat)``, ``own_quantized_input``) and saves that tensor
    (``saved_inputmat = inputmat``), so two linears reading a tensor and its view keep two casts.
    docs/devices.md, "Memory"."""
    parents = view_inputs(plan)
    fp8 = fp8_stashed(plan)

    def storage(n: str, g: int) -> tuple[str, bool]:
        if n in fp8:
            return n, True
        while (p := parents.get(n)) is not None and (group_of is None or group_of[p[1]] == g):
            n = p[0]
        return n, False

    return storage


def kept_storage(plan: Plan, saved: ActivationMemory, group_of: Sequence[int]) -> Callable[[str, int], str]:
    """A kept tensor and a group whose backward reads it -> the kept tensor whose storage it holds
    there: the first of its storage (``saved.shared``, counted, the view at 0) where the view is
    that storage in the group (:func:`storage_of`), else itself (a view received by a later stage,
    or one kept beside its base's own fp8 cast: a buffer of its own there, at its first's bytes)."""
    storage = storage_of(plan, group_of)

    def at(n: str, g: int) -> str:
        first = saved.shared.get(n)
        return first if first is not None and storage(n, g) == storage(first, g) else n

    return at


@dataclass
class ActivationMemory:
    """Activations kept for the backward, bytes per device. ``per_layer``: layer label ->
    bytes; ``tensors``: layer label -> [(tensor, bytes)]; ``recomputed``: the forward ops run
    again in the backward (regions, op indices); ``regathered``: tensors kept as their
    producer's shard and all-gathered again for the backward (tensor, index of the output
    reshard that gathered them in the forward); ``layers``: the layers recomputed under ``full:K``
    and ``every:N``; ``shared``: a kept view -> the kept tensor whose storage it is
    (:func:`shared_storage`; the view listed at 0 bytes in ``tensors``)."""

    recompute: str
    per_layer: dict[str, int]
    tensors: dict[str, list[tuple[str, int]]]
    recomputed: list[list[int]] = field(default_factory=list)
    regathered: list[tuple[str, int]] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)
    shared: dict[str, str] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.per_layer.values())

    def layer(self, label: str) -> int:
        return self.per_layer.get(label, 0)

    def to_json(self) -> dict[str, object]:
        return {"recompute": self.recompute, "total": self.total, "per_layer": dict(self.per_layer),
                "tensors": {k: [list(t) for t in v] for k, v in self.tensors.items()},
                "recomputed_ops": sum(len(r) for r in self.recomputed),
                "regathered": [t for t, _ in self.regathered],
                **({"recomputed_layers": list(self.layers)} if self.layers else {})}


def value_reads(prog: Program) -> dict[str, list[int]]:
    """Forward activation -> the backward ops that read its values (program order). Made once
    per program (:meth:`~spmdkit.program.ir.Program.derived`): read only."""
    return prog.derived("memory.value_reads", _value_reads)  # type: ignore[no-any-return]


def _value_reads(prog: Program) -> dict[str, list[int]]:
    fwd_made: set[str] = set()
    for op in prog.ops:
        if op.phase == "forward":
            fwd_made.update(op.output_names())
    reads: dict[str, list[int]] = {}
    vin = all_value_inputs(prog)
    for i, op in enumerate(prog.ops):
        if op.phase != "backward":
            continue
        for n in vin[i]:
            if n in fwd_made and _is_act(prog, n):
                lst = reads.setdefault(n, [])
                if not lst or lst[-1] != i:
                    lst.append(i)
    return reads


def fp8_stashed(plan: Plan) -> frozenset[str]:
    """Under ``--precision fp8`` with Megatron-LM / Transformer Engine (``plan.runtime``): the
    activations the backward reads only as the input of a linear layer (``matmul_grad``'s x
    against a parameter), which TE saves as the fp8 cast it made for the forward GEMM (one
    byte an element) rather than in bf16. Empty otherwise (torchao's float8 linears, which
    torchtitan uses, save the high-precision input and cast again in the backward)."""
    rt = plan.runtime
    if not (rt.fp8 and rt.framework == "megatron"):
        return frozenset()
    prog = plan.program
    fp8: set[str] = set()
    other: set[str] = set()
    for op in prog.ops:
        if op.phase != "backward":
            continue
        y = op.inputs.get("y")
        linear = op.rule == "matmul_grad" and isinstance(y, str) and prog.tensors[y].kind == "parameter"
        skip = SHAPE_ONLY.get(op.rule, frozenset())
        for p, v in op.inputs.items():
            if p in skip:
                continue
            for n in flat_refs(v):
                if n is not None:
                    (fp8 if linear and p == "x" else other).add(n)
    return frozenset(fp8 - other)


def saved_activations(plan: Plan, recompute: str = "none", only: Collection[str] | None = None) -> ActivationMemory:
    """The activations ``plan``'s backward keeps, per layer (module docstring); ``only``: the
    layer labels whose regions are recomputed (``full:K``: the first K of each stage; ``every:N``:
    every N-th of each pipeline rank), else all. ``every:N`` is refused under a framework without
    it (:func:`~spmdkit.cost.checkpoints.check_recompute`)."""
    check_recompute(recompute)
    if recompute_every(recompute) is not None:
        check_recompute(recompute, framework=plan.runtime.framework)
    prog = plan.program
    reads = value_reads(prog)
    # layer of a kept tensor: that of the last backward op reading it (the earliest layer)
    layer_of = {n: prog.ops[ix[-1]].layer for n, ix in reads.items()}
    kept = set(reads) - combine_rows_unkept(plan, reads)  # Megatron-Core's experts weight by the probs
    regions = recompute_regions(prog, recompute, plan.runtime.framework)
    if only is not None:
        regions = [r for r in regions if prog.ops[r[0]].layer in only]
    whole = whole_layers(recompute)  # whole layers (full, full:K, every:N): their outputs
    outside = layer_outputs_kept(prog, regions, reads) if whole else set()  # that an op after them saves
    for region in regions:
        kept -= {n for i in region for n in prog.ops[i].output_names()} - outside
    for region in regions:  # a region's inputs made before it are kept to run it again
        made = {n for i in region for n in prog.ops[i].output_names()}
        label = prog.ops[region[0]].layer
        for i in region:
            for n in prog.ops[i].input_names():
                if n not in made and _is_act(prog, n):
                    if n not in kept:
                        layer_of[n] = label
                    kept.add(n)
    gathered: dict[str, tuple[int, TensorDistAttr]] = {}
    for r in plan.reshards:
        if r.output and not r.src.partial and all(s.kind == "all_gather" for s in r.plan.steps if s.bytes_per_rank):
            gathered.setdefault(r.tensor, (r.op_index, r.src))
    fp8 = fp8_stashed(plan)
    load = plan_loads(plan)  # MoE: the busiest ep rank holds rho x the mean tokens (spmdkit.cost.moe)
    per_layer: dict[str, int] = {}
    tensors: dict[str, list[tuple[str, int]]] = {}
    regathered: list[tuple[str, int]] = []
    order = {n: k for k, n in enumerate(prog.tensors)}
    storage = storage_of(plan)
    first: dict[tuple[str, bool], tuple[int, str, str]] = {}  # a storage -> (bytes, layer, name) of its first kept tensor
    shared: dict[str, str] = {}
    for n in sorted(kept, key=order.__getitem__):
        t = prog.tensors[n]
        attr = plan.attrs[n]
        g = gathered.get(n)
        if g is not None:
            src = g[1]
            if local_numel(src, t.shape) < local_numel(attr, t.shape):
                attr = src
                regathered.append((n, g[0]))
        b = round(local_numel(attr, t.shape) * (1 if n in fp8 else t.itemsize) * load.get(n, 1.0))
        label = layer_of[n]
        root = storage(n, 0)
        got = first.get(root)
        if got is not None and got[:2] == (b, label):
            b = 0  # the storage of a tensor kept before it, in the same layer (shared_storage): counted there
            shared[n] = got[2]
        else:
            first.setdefault(root, (b, label, n))
        per_layer[label] = per_layer.get(label, 0) + b
        tensors.setdefault(label, []).append((n, b))
    layers = [prog.ops[r[0]].layer for r in regions] if recompute_layers(recompute) or recompute_every(recompute) else []
    return ActivationMemory(recompute, per_layer, tensors, regions, regathered, layers, shared)


def recompute_inputs(plan: Plan, saved: ActivationMemory) -> dict[str, int]:
    """Kept activation -> the backward op before which the recomputed region reading it runs
    again (the latest such op): a region's input made before it is held until the region has
    run again, whether or not a backward op reads it itself. Which inputs: those of the region's
    ops that must run again (their outputs, or those of ops after them, feed the backward), as
    AOTAutograd's partitioner saves them (compiled); in eager PyTorch (torchtitan without
    ``--compile``) every output its op-level selective checkpointing marks saved
    (``wq`` / ``wv`` / ``w1`` / ``w2``'s): torch.utils.checkpoint's ``_CachingTorchDispatchMode``
    stores each ``MUST_SAVE`` op's output in the forward, and the storage lives until the
    layer's backward, needed or not (``w2``'s, which only the residual add reads)."""
    prog = plan.program
    reads = value_reads(prog)
    kept = {n for lst in saved.tensors.values() for n, _ in lst}
    every = plan.runtime.eager
    out: dict[str, int] = {}
    for region in saved.recomputed:
        made = {n for i in region for n in prog.ops[i].output_names()}
        dropped = [n for n in made if n in reads and n not in kept]
        if not dropped:
            continue
        again = min(reads[n][0] for n in dropped)
        need = set(dropped)
        for i in reversed(region):
            op = prog.ops[i]
            if every or any(n in need for n in op.output_names()):
                need.update(op.input_names())
                for n in op.input_names():
                    if n in kept and n not in made:
                        out[n] = max(out.get(n, again), again)
    return out


def spans_with_recompute(plan: Plan, saved: ActivationMemory) -> dict[str, list[tuple[int, int, int]]]:
    """Tensor -> [(first op, last op, bytes)] live intervals for the tensors whose life
    recomputation, a backward re-gather or an fp8 stash (:func:`fp8_stashed`) splits, or that
    Megatron-Core does not keep (:func:`spmdkit.cost.moe.combine_rows_unkept`: to their last
    forward reader) (:func:`memory_per_device`); other tensors live from their producer to the last op that
    reads their values."""
    prog = plan.program
    out: dict[str, list[tuple[int, int, int]]] = {}
    fp8 = fp8_stashed(plan)
    reads = value_reads(prog)
    unkept = combine_rows_unkept(plan, reads)
    if not saved.recomputed and not saved.regathered and not fp8 and not unkept:
        return out
    made_at, last, fwd_last = value_spans(prog)
    kept = {n for lst in saved.tensors.values() for n, _ in lst}
    load = plan_loads(plan)

    def size(n: str, attr: TensorDistAttr | None = None, stash: bool = False) -> int:
        t = prog.tensors[n]
        return round(local_numel(attr or plan.attrs[n], t.shape) * (1 if stash and n in fp8 else t.itemsize)
                     * load.get(n, 1.0))

    for region in saved.recomputed:
        made = [n for i in region for n in prog.ops[i].output_names()]
        dropped = [n for n in made if n in reads and n not in kept]
        if not dropped:
            continue
        again = min(reads[n][0] for n in dropped)  # the region runs again right before this op
        for n in dropped:
            a = made_at[n]
            e = max(fwd_last.get(n, a), a)
            b = size(n)
            out[n] = [(a, e, b), (again, last.get(n, again), b)] if again > e else [(a, last.get(n, a), b)]
    shards = {r.tensor: r.src for r in plan.reshards if r.output}
    regathered = {n for n, _ in saved.regathered}
    for n in regathered:
        a = made_at[n]
        e = max(fwd_last.get(n, a), a)
        back = reads[n][0]
        full = size(n)
        if back <= e + 1:
            continue
        out[n] = [(a, e, full), (e + 1, back - 1, size(n, shards[n], True)), (back, last.get(n, back), full)]
    for n in unkept:  # not kept for the backward: lives to its last forward reader
        out[n] = [(made_at[n], max(fwd_last.get(n, made_at[n]), made_at[n]), size(n))]
    for n in kept & fp8 - regathered:  # held as its fp8 cast between its last forward reader and the backward
        a = made_at[n]
        e = max(fwd_last.get(n, a), a)
        if last[n] > e:
            out[n] = [(a, e, size(n)), (e + 1, last[n], size(n, None, True))]
    return out


def rerun_points(plan: Plan, saved: ActivationMemory) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Where the backward runs forward work again: (backward op index -> the recomputed forward
    ops run right before it, backward op index -> the indices of the output reshards whose
    all-gather runs again right before it). A region runs again before the first backward op
    that reads one of its outputs not kept (those kept, a layer's output the next layer's norm or
    the final norm saves, are read before the checkpoint's backward runs; where every output is
    kept, the first reader of any); a re-gathered tensor before its first backward reader."""
    prog = plan.program
    reads = value_reads(prog)
    kept = {n for lst in saved.tensors.values() for n, _ in lst}
    rerun: dict[int, list[int]] = {}
    for region in saved.recomputed:
        outs = [n for i in region for n in prog.ops[i].output_names() if n in reads]
        firsts = [reads[n][0] for n in outs if n not in kept] or [reads[n][0] for n in outs]
        if firsts:
            rerun.setdefault(min(firsts), []).extend(region)
    regather: dict[int, list[int]] = {}
    out_reshards = {r.tensor: k for k, r in enumerate(plan.reshards) if r.output}
    for n, _ in saved.regathered:
        regather.setdefault(reads[n][0], []).append(out_reshards[n])
    return rerun, regather
