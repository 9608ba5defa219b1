"""Compute cost of a plan: FLOPs and bytes per op on one device, the collectives some kernels run
inside themselves, and the model FLOPs of a step. Standard library only. docs/devices.md.

Every figure is *per device*, after sharding: an op's tensors have the local (largest-shard)
shapes of the dist attrs the plan gives them (the inputs as the rule requires them, the
outputs as the rule makes them); a partial output costs the same local work as a whole one.

- :func:`op_cost` (plan, op index) -> :class:`~spmdkit.engine.facts.OpCost`: FLOPs executed,
  model FLOPs (the same but without recomputation inside a kernel), bytes read and written in
  device memory, and whether the op runs on the tensor cores. Each op family declares its
  cost beside its rule (``facts(..., cost=...)`` in ``spmdkit.ops.*``): matmul ``2mnk``
  (batched, transposed, their grads ``2mnk`` per input gradient), attention
  (``4·b·h·sq·sk·d``, halved when causal as flash-attention skips masked blocks; the grad
  ``2.5x`` executed, ``2x`` model), convolutions, einsum, and by bytes: elementwise, norms,
  softmax, losses, embedding / gathers, reductions, optimizer updates, copies. A rule with no
  cost declared is *uncovered*: :func:`spmdkit.cost.step.estimate_step` lists it (never a
  silent zero); :data:`COSTED` names every covered rule. Its time on a device:
  :meth:`spmdkit.cost.devices.Device.op_time`.
- :func:`kernel_collectives` (plan): all-reduces inside ops, as their families declare them
  (``c_softmax_with_cross_entropy``: max, sum of exp and the label logit over the ranks sharing
  the class axis).
- :func:`model_flops` (plan, tokens): the step's model FLOPs, ``6·N·tokens`` plus attention.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import spmdkit.ops  # noqa: F401  (registers every op family, and with it its facts)
from spmdkit.core.dist_attr import TensorDistAttr, entry_dims, largest_shard
from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel
from spmdkit.cost.context import CP_RULES, cp_op_cost
from spmdkit.cost.context_torch import torch_cp_op_cost
from spmdkit.cost.eager import eager_cost
from spmdkit.cost.loss import LOSS_BACKWARD, LOSS_FORWARD, flash_ce_cost, fused_loss, loss_cost
from spmdkit.cost.moe import active_share, expert_op_cost, sorted_by_expert
from spmdkit.cost.optimizer_step import megatron_update_cost
from spmdkit.cost.recompute_modules import NORMS
from spmdkit.cost.shards import local_numel
from spmdkit.cost.torchao_casts import gather_degree, rowwise_cast_bytes, torchao_cast_bytes
from spmdkit.engine.cache_keys import UNCACHEABLE, value_key
from spmdkit.engine.facts import LocalOp, LocalTensor, OpCost, declared, facts_of
from spmdkit.engine.memo import Recent, memo_enabled, memo_table
from spmdkit.engine.registry import get_rule
from spmdkit.ops._cost import lookup, no_kernel, numel
from spmdkit.ops.matmul import gemm_dims, k_of
from spmdkit.program.ir import Program, flat_refs
from spmdkit.program.plan import Plan

# -- per-op cost --------------------------------------------------------------------------------

_LOCAL: dict[tuple[tuple[int, ...], TensorDistAttr], tuple[int, ...]] = {}


def local_shape(shape: tuple[int, ...], attr: TensorDistAttr | None) -> tuple[int, ...]:
    """The largest shard's shape (memoised: a model repeats few (shape, dist attr) pairs)."""
    if attr is None:
        return shape
    got = _LOCAL.get((shape, attr))
    if got is None:
        if len(_LOCAL) > 100_000:
            _LOCAL.clear()
        got = _LOCAL[(shape, attr)] = largest_shard(attr.dims_mapping, shape, attr.mesh.shape)
    return got


#: an op's tensors as :func:`local_op` reads them: per input parameter its tensors (name,
#: shape, item size, dtype; None for an absent one), per output position its tensors
_OpTensors = tuple[tuple[tuple[str, tuple[Any, ...]], ...], tuple[tuple[Any, ...], ...]]


def _op_tensors(prog: Program) -> list[_OpTensors]:
    """Every op's tensors (:data:`_OpTensors`), read once per program."""
    tensors = prog.tensors

    def one(n: str | None) -> tuple[str, tuple[int, ...], int, str] | None:
        if n is None:
            return None
        t = tensors[n]
        return n, t.shape, t.itemsize, t.dtype

    return [(tuple((p, tuple(one(n) for n in flat_refs(v))) for p, v in op.inputs.items()),
             tuple(tuple(one(n) for n in flat_refs(v)) for v in op.outputs)) for op in prog.ops]


def local_op(prog: Program, i: int, required: Mapping[str, Any], outputs: Sequence[Any],
             attrs: Mapping[str, TensorDistAttr]) -> LocalOp:
    """Op ``i`` of ``prog`` on one device: its inputs as ``required`` (per parameter: a dist attr,
    or a tuple of them for a vector parameter), its outputs as ``outputs`` (per position), a
    tensor neither gives as ``attrs`` has it (else whole)."""
    op = prog.ops[i]
    in_slots, out_slots = prog.derived("compute.op_tensors", _op_tensors)[i]
    ins: dict[str, list[LocalTensor]] = {}
    for p, ts in in_slots:
        req = required.get(p)
        reqs = req if isinstance(req, tuple) else (req,) * len(ts)
        args = [(local_shape(t[1], a if a is not None else attrs.get(t[0])), t[2], t[3])
                for t, a in zip(ts, reqs) if t is not None]
        if args:
            ins[p] = args
    outs: list[LocalTensor | None] = []
    for k, ts in enumerate(out_slots):
        got = outputs[k] if k < len(outputs) else None
        given = got if isinstance(got, tuple) else (got,) * len(ts)
        outs += [None if t is None else (local_shape(t[1], a if a is not None else attrs.get(t[0])), t[2], t[3])
                 for t, a in zip(ts, given)]
    return LocalOp(op.rule, op.attrs, ins, outs)


def _canonical(rule: str) -> str:
    try:
        return get_rule(rule).name
    except SpmdError:  # an unknown name is simply not costed
        return rule


#: costs by what a cost function reads (the function itself, the rule, attributes, local
#: tensors): a model's repeated layers cost each kind of op once (bounded; off with the engine's
#: memo tables)
_COSTS: dict[tuple[Any, ...], OpCost] = memo_table()


def _cost_key(c: LocalOp) -> tuple[Any, ...] | None:
    items: list[Any] = [c.rule]
    for k, v in c.attrs.items():
        kv = value_key(v)
        if kv is UNCACHEABLE:
            return None
        items.append((k, kv))
    return (tuple(items), tuple([(p, tuple(a)) for p, a in c.ins.items()]), tuple(c.outs))


def cost_of(c: LocalOp) -> OpCost:
    """The cost of an op on one device, by the cost its family declares for its rule (an alias:
    the rule's); uncovered (its bytes alone) where none is declared or the op's tensors do not
    fit the family's formula. Memoised by what the cost function reads (:data:`_COSTS`)."""
    fn = facts_of(c.rule).cost or facts_of(_canonical(c.rule)).cost
    if fn is None:
        return OpCost(0.0, 0.0, c.in_bytes + c.out_bytes, False, c.dtype(), covered=False)
    key = _cost_key(c) if memo_enabled() else None
    if key is None:
        return _apply(fn, c)
    key = (fn, key)
    got = _COSTS.get(key)
    if got is None:
        if len(_COSTS) > 100_000:
            _COSTS.clear()
        got = _COSTS[key] = _apply(fn, c)
    return got


def _apply(fn: Any, c: LocalOp) -> OpCost:
    try:
        return fn(c)  # type: ignore[no-any-return]
    except (AssertionError, IndexError, TypeError, ValueError):
        return OpCost(0.0, 0.0, c.in_bytes + c.out_bytes, False, c.dtype(), covered=False)


#: the GEMM rules of linear layers (forward and grad) that ``--precision fp8`` runs in fp8 where
#: their weight operand is a parameter
FP8_GEMMS = frozenset({"matmul", "matmul_grad", "linear_v2", "linear_v2_grad", "fused_gemm_epilogue",
                       "fused_gemm_epilogue_grad"})
#: the ops whose output Transformer Engine writes in fp8 itself (LayerNormLinear / LayerNormMLP fuse
#: the norm and the activation with the cast): a GEMM reading one pays no separate input cast
FP8_FUSED_PRODUCERS = NORMS | {"gelu", "swiglu", "squared_relu"}
_WEIGHT_PARAMS = ("y", "weight")
_INPUT_PARAMS = ("x", "input")


@dataclass(frozen=True)
class Fp8Layers:
    """Which GEMMs of a program run in fp8 (:func:`fp8_layers`): the weights, and the forward ops
    that pay the cast of their input (the first fp8 reader of an activation no fused producer
    wrote in fp8)."""

    weights: frozenset[str]
    casts_input: frozenset[int]
    #: the first forward fp8 GEMM reading each distinct input, whoever made it (torchao casts after
    #: a norm or SwiGLU too: :mod:`spmdkit.cost.torchao_casts`)
    first_reads: frozenset[int] = frozenset()
    #: the first fp8 GEMM grad reading each distinct input (its fp8 copy transposed for the wgrad)
    first_grad_reads: frozenset[int] = frozenset()


#: fp8_layers by program (id; the program kept in the value, so the id stays its own)
_FP8_MEMO: Recent[tuple[Program, Fp8Layers]] = Recent(16, by_id=True)


def _operand(prog: Program, op: Any, params: tuple[str, ...], kind: str | None) -> str | None:
    for p in params:
        n = op.inputs.get(p)
        if isinstance(n, str) and (kind is None or prog.tensors[n].kind == kind):
            return n
    return None


def fp8_layers(prog: Program) -> Fp8Layers:
    """The parameters whose GEMMs run in fp8 under ``--precision fp8``: every forward linear
    layer's weight (the y / weight operand, a parameter) but the last one's, the output head
    (Transformer Engine and torchao keep the lm_head in bf16; in a decoder the head is the last
    parameter matmul of the forward, the embedding table itself when tied); and the forward ops
    that cast their input (once per activation; none where a norm or activation wrote it, through
    views). Memoised per program."""
    return _FP8_MEMO.get(id(prog), lambda: (prog, _fp8_layers(prog)))[1]


def _fp8_layers(prog: Program) -> Fp8Layers:
    producer: dict[str, Any] = {}
    for op in prog.ops:
        for o in op.output_names():
            producer[o] = op
    ops: list[tuple[int, str]] = []
    for i, op in enumerate(prog.ops):
        if op.phase == "forward" and _canonical(op.rule) in FP8_GEMMS:
            w = _operand(prog, op, _WEIGHT_PARAMS, "parameter")
            if w is not None:
                ops.append((i, w))
    head = ops[-1][1] if ops else None
    weights = frozenset(w for _, w in ops if w != head)
    seen: set[str] = set()
    casts: set[int] = set()
    first: set[int] = set()
    grads: dict[str, int] = {}
    for i, op in enumerate(prog.ops):
        x = _operand(prog, op, _INPUT_PARAMS, None)
        if op.phase == "backward" and x is not None and _canonical(op.rule) in FP8_GEMMS \
                and _operand(prog, op, _WEIGHT_PARAMS, "parameter") in weights:
            grads.setdefault(x, i)
    for i, w in ops:
        x = _operand(prog, prog.ops[i], _INPUT_PARAMS, None)
        if w not in weights or x is None or x in seen:
            continue
        seen.add(x)
        first.add(i)
        src = producer.get(x)
        while src is not None and facts_of(_canonical(src.rule)).cost is no_kernel:
            v = _operand(prog, src, ("x", "input"), None)
            src = producer.get(v) if v else None
        if src is None or _canonical(src.rule) not in FP8_FUSED_PRODUCERS:
            casts.add(i)
    return Fp8Layers(weights, frozenset(casts), frozenset(first), frozenset(grads.values()))


def fp8_weights(prog: Program) -> frozenset[str]:
    """The weights :func:`fp8_layers` runs in fp8."""
    return fp8_layers(prog).weights


#: the roles of a float8 GEMM's operand that torchao casts before the TP all-gather, by phase
_ROLES = {"forward": ("x", "input"), "backward": ("out_grad",)}

_F8TP_MEMO: Recent[tuple[Plan, frozenset[str], dict[str, tuple[int, ...]]]] = Recent(16, by_id=True)


def float8_tp_gathers(plan: Plan) -> frozenset[str]:
    """The activations and gradients whose all-gather moves float8 (1 byte an element) under
    torchao's float8 TP: ``--precision fp8 --framework torchtitan``, gathered (an all-gather
    step) where every reader of the same phase is a float8 linear's GEMM (:func:`fp8_weights`)
    reading it as its input (forward) or output gradient (backward). Empty otherwise."""
    return _float8_tp(plan)[1]


def float8_tp_gather_dims(plan: Plan) -> dict[str, tuple[int, ...]]:
    """Each :func:`float8_tp_gathers` tensor -> the mesh dims of its all-gather (its first reshard
    that gathers, in the plan's order). Empty where torchao's float8 TP does not run."""
    return _float8_tp(plan)[2]


def _float8_tp(plan: Plan) -> tuple[Plan, frozenset[str], dict[str, tuple[int, ...]]]:
    rt = plan.runtime
    if not (rt.fp8 and rt.framework == "torchtitan") or rt.float8_rowwise:  # rowwise: plain TP, bf16 gathers
        return plan, frozenset(), {}

    def make() -> tuple[Plan, frozenset[str], dict[str, tuple[int, ...]]]:
        dims = _gathers(plan)
        return plan, frozenset(dims), dims

    return _F8TP_MEMO.get(id(plan), make)


def _gathers(plan: Plan) -> dict[str, tuple[int, ...]]:
    prog = plan.program
    weights = fp8_weights(prog)
    readers: dict[str, list[int]] = {}
    for j, op in enumerate(prog.ops):
        for n in op.input_names():
            readers.setdefault(n, []).append(j)
    out: dict[str, tuple[int, ...]] = {}
    for r in plan.reshards:
        t = prog.tensors[r.tensor]
        phase = prog.ops[r.op_index].phase
        gather = next((s.mesh_dims for s in r.plan.steps if s.kind == "all_gather" and s.bytes_per_rank), None)
        if t.kind not in ("activation", "gradient") or phase not in _ROLES or gather is None:
            continue
        same = [prog.ops[j] for j in readers.get(r.tensor, ()) if prog.ops[j].phase == phase]
        if same and all(_canonical(op.rule) in FP8_GEMMS
                        and _operand(prog, op, ("y", "weight"), "parameter") in weights
                        and any(op.inputs.get(k) == r.tensor for k in _ROLES[phase]) for op in same):
            out.setdefault(r.tensor, tuple(gather))
    return out


#: bytes a sharded weight element moves in torchao's ``fsdp_pre_all_gather`` with a precomputed
#: scale (``hp_tensor_and_scale_to_float8`` of the fp32 shard: read 4, write the float8 1), once
#: per all-gather; and in ``precompute_float8_dynamic_scale_for_fsdp`` (``torch._foreach_norm(weights,
#: ord=inf)`` over the fp32 shards: read 4), once per step after the optimizer
FP8_PRE_GATHER, FP8_AMAX = 5.0, 4.0


#: fp8_gathered's answers by the plan's id (the value keeps the plan)
_GATHERED_FP8: Recent[tuple[Plan, frozenset[str]]] = Recent(16, by_id=True)


def fp8_gathered(plan: Plan) -> frozenset[str]:
    """Under ``--fsdp-float8-all-gather`` (torchao ``torchao/float8/fsdp_utils.py``:
    ``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`` returns the float8 ``_data`` of the
    cast shard and its scale; ``fsdp_post_all_gather`` wraps the gathered bytes as a ``Float8Tensor``
    that ``matmul_with_hp_or_float8_args`` uses as is, forward and backward): the fp8 weights
    (:func:`fp8_weights`) the plan stores sharded, which FSDP2 gathers and holds at 1 byte an
    element. Empty without the option; a ProgramError where the plan stores no parameter sharded,
    or where its mesh's dp dimension is 1: torchtitan turns the float8 all-gather on only where
    FSDP's ``dp_shard`` degree is over 1 (``torchtitan/float8.py`` at 9dec370, ``Float8Handler``:
    ``parallel_dims.dp_shard_enabled and float8_config.enable_fsdp_float8_all_gather``), not where
    FSDP shards over cp alone. Memoised per plan (each GEMM and optimizer op asks)."""
    if not plan.runtime.fsdp_float8_all_gather:
        return frozenset()
    return _GATHERED_FP8.get(id(plan), lambda: (plan, _fp8_gathered(plan)))[1]


def gathered_itemsize(plan: Plan, name: str) -> int:
    """Bytes an element of parameter ``name`` takes gathered (and held gathered) by FSDP2: 1 where
    it is gathered in float8 (:func:`fp8_gathered`), else its dtype's."""
    return 1 if name in fp8_gathered(plan) else plan.program.tensors[name].itemsize


def _fp8_gathered(plan: Plan) -> frozenset[str]:
    if not plan.storage:
        raise ProgramError("--fsdp-float8-all-gather: the plan stores no parameter sharded; the float8 all-gather is "
                           "FSDP2's: give a ZeRO-3 strategy (zero3 in --strategy)")
    dp = dict(zip(plan.mesh.dim_names, plan.mesh.shape)).get("dp", 1)
    if dp <= 1:
        raise ProgramError(f"--fsdp-float8-all-gather: the mesh has dp = {dp}; torchtitan gathers in float8 only where "
                           f"FSDP's dp_shard degree is over 1 (Float8Handler: parallel_dims.dp_shard_enabled), not "
                           f"where FSDP shards over cp alone: drop the option or give dp > 1 in --mesh")
    return fp8_weights(plan.program) & frozenset(plan.storage)


def _shard(plan: Plan, w: str) -> int:
    """Local elements of the stored (sharded) weight ``w``."""
    return local_numel(plan.storage[w], plan.program.tensors[w].shape)


def fp8_amax_cost(plan: Plan, i: int, c: OpCost) -> OpCost:
    """``c`` (an optimizer op) with ``precompute_float8_dynamic_scale_for_fsdp``'s read of its
    weight's fp32 shard (:data:`FP8_AMAX`) where that weight is gathered in float8; its one
    all-reduce of the amaxes (a float a weight) is left out."""
    w = _operand(plan.program, plan.program.ops[i], ("param", "master_param"), "parameter")
    if w is None or w not in fp8_gathered(plan):
        return c
    return replace(c, bytes=c.bytes + FP8_AMAX * _shard(plan, w))


def _fp8(plan: Plan, i: int, lop: LocalOp, c: OpCost) -> OpCost:
    """``c`` run in fp8 where op ``i`` is a linear layer's GEMM (:func:`fp8_layers`), with
    Transformer Engine's casts (bf16 read, an fp8 copy and its transpose written: 4 bytes per
    element, amax in the same kernel): the forward casts its weight, and its input unless a fused
    producer wrote it in fp8 or another GEMM cast it; the backward casts the output gradient (the
    inputs' fp8 copies are the forward's). A weight FSDP2 gathers in float8 (:func:`fp8_gathered`)
    is not cast in the GEMM: its shard is, before each gather (forward, and the backward's
    re-gather: :data:`FP8_PRE_GATHER` a shard element). Under ``--framework torchtitan`` the casts
    are torchao's instead (:mod:`spmdkit.cost.torchao_casts`: an amax pass and a cast pass whoever
    made the tensor, on the shard where it is gathered in float8, and the backward's transposed
    float8 copies; under ``--float8-recipe rowwise`` the rowwise recipe's casts, re-scales along
    the other axis and the backward GEMMs' rescales: :func:`~spmdkit.cost.torchao_casts.rowwise_cast_bytes`;
    its passes' time scaled by torchao's published table of the linear, ``OpCost.rowwise``:
    :mod:`spmdkit.cost.torchao_rowwise`)."""
    prog = plan.program
    op = prog.ops[i]
    if _canonical(op.rule) not in FP8_GEMMS or not c.gemms:
        return c
    layers = fp8_layers(prog)
    w = _operand(prog, op, _WEIGHT_PARAMS, "parameter")
    if w is None or w not in layers.weights:
        return c
    b, m, n, k = gemm_dims(lop)
    pre = FP8_PRE_GATHER * _shard(plan, w) if w in fp8_gathered(plan) else None
    if plan.runtime.framework == "torchtitan":  # torchao's float8 linears, under torch.compile
        weight = lop.one("y") or lop.one("weight")
        assert weight is not None  # gemm_dims read it
        if plan.runtime.float8_rowwise:  # torchao's rowwise recipe: its casts, re-scales and rescales
            return replace(c, fp8=True, rowwise=(b * m, k, n), cast_bytes=rowwise_cast_bytes(
                (b, m, n, k), math.prod(weight[0]), grad=op.rule.endswith("_grad"),
                x_cast=i in layers.first_reads, x_transpose=i in layers.first_grad_reads))
        gathers = float8_tp_gather_dims(plan)  # tensorwise only: rowwise gathers in bf16
        src, dy = _operand(prog, op, _INPUT_PARAMS, None), op.inputs.get("out_grad")
        return replace(c, fp8=True, cast_bytes=torchao_cast_bytes(
            (b, m, n, k), math.prod(weight[0]), grad=op.rule.endswith("_grad"), pre=pre,
            x_cast=i in layers.first_reads, x_degree=gather_degree(plan, gathers, src),
            dy_degree=gather_degree(plan, gathers, dy if isinstance(dy, str) else None),
            x_transpose=i in layers.first_grad_reads))
    if op.rule.endswith("_grad"):
        cast = 4.0 * b * m * n + (pre or 0.0)
    else:  # the weight as this device holds it (an expert stack: its local experts, not the GEMM's batch)
        weight = lop.one("y") or lop.one("weight")
        assert weight is not None  # gemm_dims read it
        x = 4.0 * b * m * k if i in layers.casts_input else 0.0
        cast = x + (pre if pre is not None else 4.0 * math.prod(weight[0]))
    return replace(c, fp8=True, cast_bytes=cast)


#: bytes of an fp32 main gradient element that a fused weight-gradient GEMM reads and writes
#: (``accumulate=True`` into ``main_grad``: :func:`fused_wgrad`)
MAIN_GRAD_BYTES = 8.0

#: gradient elements an unfused accumulation moves per weight element: ``param.grad`` and the new
#: gradient read, ``param.grad`` written (:func:`fused_wgrad` under ``--no-wgrad-fusion``)
ACCUMULATE_GRAD_READS_WRITES = 3

#: _grads_sharded_at_producer's answers by the plan's id (the value keeps the plan)
_SHARDED: Recent[tuple[Plan, frozenset[str]]] = Recent(16, by_id=True)


def _grads_sharded_at_producer(plan: Plan) -> frozenset[str]:
    """The gradients reduce-scattered right after the op that makes them (ZeRO-2 / ZeRO-3:
    Megatron-FSDP's ``optim_grads`` / ``optim_grads_params``), memoised per plan."""
    return _SHARDED.get(id(plan), lambda: (plan, frozenset(
        r.tensor for r in plan.reshards if plan.reduce_scatters_at_producer(r))))[1]


def fused_wgrad(plan: Plan, i: int, lop: LocalOp, c: OpCost) -> OpCost:
    """``c`` of a linear layer's backward under ``--framework megatron`` with its weight-gradient
    GEMMs accumulating into the fp32 ``main_grad`` (Megatron-LM's ``--gradient-accumulation-fusion``,
    on unless ``--no-gradient-accumulation-fusion``: ``megatron/training/arguments.py`` at 1e057005;
    Transformer Engine's ``fuse_wgrad_accumulation``, which Megatron-Core's TE layers set from it,
    ``TEGroupedLinear`` too: ``megatron/core/extensions/transformer_engine.py``): the wgrad GEMM
    writes ``main_grad`` with ``accumulate=True`` (TE v2.6, c90a7207,
    ``transformer_engine/pytorch/module/grouped_linear.py``: ``wgrad_list = main_grads``,
    ``general_grouped_gemm(..., accumulate=accumulate_wgrad_into_param_main_grad)``; the linear
    modules alike), so its epilogue reads and writes 4 + 4 bytes a weight element
    (:data:`MAIN_GRAD_BYTES`) where a bf16 gradient is written once (2). The wgrad GEMMs are
    then timed as their own kernels (:meth:`spmdkit.cost.devices.Device.op_time`): a GEMM of
    few rows (an expert's tokens) over a large weight is bound by that traffic. Not where the
    gradient is reduce-scattered at its producer (ZeRO-2 / 3: Megatron-FSDP's ``optim_grads`` /
    ``optim_grads_params`` assert the fusion off, ``validate_args``), nor under other frameworks
    (FSDP2 writes the gradient in the compute dtype). The first microbatch's GEMM overwrites
    ``main_grad`` (``not is_first_microbatch``): counted as the others. Without the fusion
    (``Runtime.wgrad_fusion`` off, ``--no-wgrad-fusion``: Megatron-LM before 83b1e42f30, 2022-02,
    e.g. de7dc40f88 with ``--DDP-impl local`` and no contiguous buffers, or torch DDP) the GEMM
    writes the gradient in the weight's dtype and autograd's ``AccumulateGrad`` adds it into
    ``param.grad`` in place (``variable_grad += new_grad``): a memory-bound kernel of its own
    reading two and writing one gradient element (:data:`ACCUMULATE_GRAD_READS_WRITES`), every
    microbatch's backward (the first, which only stores it, counted as the others). None of it in a
    search floor's stand-in plan (``Runtime.lower_bound``: ZeRO-2/3 run neither)."""
    rt = plan.runtime
    if rt.framework != "megatron" or rt.lower_bound or not c.matmul or not c.gemms or len(lop.outs) < 2:
        return c
    op = plan.program.ops[i]
    if not op.rule.endswith("_grad") or _canonical(op.rule) not in FP8_GEMMS or lop.outs[1] is None:
        return c
    w = _operand(plan.program, op, _WEIGHT_PARAMS, "parameter")
    wt = lop.one("y") or lop.one("weight")
    names = [n for v in op.outputs for n in flat_refs(v)]
    if w is None or wt is None or len(names) < 2 or names[1] in _grads_sharded_at_producer(plan):
        return c
    wgemms = len(c.gemms) // 2 if lop.outs[0] is not None else len(c.gemms)
    if wgemms <= 0:
        return c
    elems = numel(wt[0])
    if not rt.wgrad_fusion:  # autograd adds the GEMM's gradient into param.grad: a kernel of its own
        return replace(c, cast_bytes=c.cast_bytes + ACCUMULATE_GRAD_READS_WRITES * wt[1] * elems)
    size = 1 if c.fp8 else wt[1]  # under --precision fp8 the wgrad GEMM reads the fp8 copies
    operands = sum(b * (m * k + k * n) for b, m, n, k in c.gemms[-wgemms:]) * size
    written = numel(lop.outs[1][0]) * lop.outs[1][1]
    wbytes = operands + MAIN_GRAD_BYTES * elems
    return replace(c, bytes=c.bytes - written + MAIN_GRAD_BYTES * elems, wgrad_gemms=wgemms, wgrad_bytes=wbytes)


def op_cost(plan: Plan, i: int) -> OpCost:
    """The cost of op ``i`` of ``plan`` on one device (see the module docstring), with what the
    plan's runtime changes: a linear layer's GEMMs in fp8 under ``--precision fp8``
    (:func:`fp8_weights`), the framework whose attention kernel runs a flash-attention pass; an
    op of a MoE layer's expert computation as grouped GEMMs at the busiest ep rank's load
    (:func:`spmdkit.cost.moe.expert_op_cost`); a cp attention op as its busiest rank runs it (a
    ring's steps, the causal imbalance without zig-zag: :func:`spmdkit.cost.context.cp_op_cost`); a
    softmax cross-entropy over the logits as the framework runs it (:func:`spmdkit.cost.loss.loss_cost`), or
    flash-attn's fused kernel or torchtitan's compiled loss under ``--cross-entropy-kernel``
    (:func:`spmdkit.cost.loss.flash_ce_cost`); an Adam
    update as Megatron's optimizer step runs it (:func:`spmdkit.cost.optimizer_step.megatron_update_cost`)."""
    opp = plan.ops[i]
    lop = local_op(plan.program, i, opp.required, opp.outputs, plan.attrs)
    c = expert_op_cost(plan, i, lop, cost_of) or sorted_by_expert(plan, i, lop, cost_of(lop))
    if opp.op.rule in CP_RULES:
        c = torch_cp_op_cost(plan, i, cp_op_cost(plan, i, c))  # under torchtitan: torch's context_parallel
    rt = plan.runtime
    if c.attention is not None and rt.framework == "torchtitan":  # AutoModel runs TE's attention, as Megatron
        c = replace(c, framework=rt.framework)
    if c.attention is not None and rt.attention_kernel is not None:  # the kernel the run's model code calls
        c = replace(c, attention_kernel=rt.attention_kernel)
    if rt.fp8 and c.matmul:
        c = _fp8(plan, i, lop, c)
    c = fused_wgrad(plan, i, lop, c)
    if rt.framework == "megatron" and opp.op.phase == "optimizer":  # its optimizer step's passes
        c = megatron_update_cost(plan, i, lop, c)
    if _canonical(opp.op.rule) in LOSS_FORWARD | LOSS_BACKWARD and fused_loss(plan, i):
        # flash-attn's loss or torchtitan's compiled one: not the eager one
        return flash_ce_cost(_canonical(opp.op.rule), lop, c, str(rt.ce_kernel))
    if rt.framework == "torchtitan":  # its model code's eager ops (and, under --compile, the loss and repeat_kv)
        c = eager_cost(lop, c, rt.eager)
    if rt.fsdp_float8_all_gather and opp.op.phase == "optimizer":  # after the foreach passes it adds to
        c = fp8_amax_cost(plan, i, c)
    return loss_cost(_canonical(opp.op.rule), lop, c, rt.framework, rt.ce_fusion)


#: every registered rule with a cost; the others (today: ``replicated``, the importer's stand-in
#: for an op it could not map) are listed as uncovered by :func:`spmdkit.cost.step.estimate_step`
COSTED = frozenset(n for n in declared() if facts_of(n).cost is not None)


# -- collectives inside kernels -----------------------------------------------------------------


@dataclass(frozen=True)
class KernelCollective:
    """A collective an op's kernel runs itself (not a reshard of the plan)."""

    op_index: int
    rule: str
    what: str
    kind: str
    mesh_dims: tuple[int, ...]
    reduce_type: str
    bytes_per_rank: int
    time_s: float

    def to_json(self) -> dict[str, Any]:
        return {"op_index": self.op_index, "rule": self.rule, "what": self.what, "kind": self.kind,
                "mesh_dims": list(self.mesh_dims), "reduce_type": self.reduce_type,
                "bytes_per_rank": self.bytes_per_rank, "time_s": self.time_s}


def op_kernel_collectives(prog: Program, i: int, required: Mapping[str, Any], mesh: ProcessMesh,
                          cost: CostModel) -> list[KernelCollective]:
    """The all-reduces op ``i``'s kernel runs itself with its inputs as ``required``
    (:class:`~spmdkit.engine.facts.ClassAllReduces`, as its family declares them), timed by
    ``cost``: one per mesh dim of the group (a class axis co-sharded on two dims is reduced over
    each)."""
    op = prog.ops[i]
    spec = facts_of(op.rule).collectives
    if spec is None:
        return []
    attr = required.get("x")
    name = op.inputs.get("x")
    if not isinstance(attr, TensorDistAttr) or not isinstance(name, str) or not attr.dims_mapping:
        return []
    dims = entry_dims(attr.dims_mapping[-1])
    if not dims:
        return []
    rows = numel(local_shape(prog.tensors[name].shape, attr)[:-1])
    if spec.rows_of is not None:
        other = op.inputs.get(spec.rows_of)
        if isinstance(other, str):
            rows = numel(local_shape(prog.tensors[other].shape, required.get(spec.rows_of)))
    size = 4 * rows
    out: list[KernelCollective] = []
    for what, rt in spec.reductions:
        for d in dims:
            n = mesh.shape[d]
            b = round(2 * (n - 1) / n * size)
            out.append(KernelCollective(i, op.rule, what, "all_reduce", (d,), rt, b,
                                        cost.collective_time("all_reduce", (d,), size, mesh.shape)))
    return out


def kernel_collectives(plan: Plan) -> list[KernelCollective]:
    """The all-reduces inside the plan's ops (:func:`op_kernel_collectives`), timed with the
    plan's cost model."""
    out: list[KernelCollective] = []
    for i in range(len(plan.program.ops)):
        out += op_kernel_collectives(plan.program, i, plan.ops[i].required, plan.mesh, plan.cost)
    return out


# -- the model's FLOPs --------------------------------------------------------------------------


def _matmul_params(prog: Program, tokens: int = 0) -> int:
    """The parameters a forward op other than a lookup reads (an embedding table read only by
    lookups does no multiply); a MoE layer's expert stack counts as the share of it a token
    multiplies, ``top_k / experts`` (:func:`spmdkit.cost.moe.active_share`: the layer found by
    its structure; capacity padding is not model work), so ``6 N tokens`` counts the active
    parameters (Mixtral's 12.9B of 46.7B) as MoE reports count them; another stack of rank >=
    3 read by forward matmuls as ``rows x numel / (experts x tokens)`` for the rows its matmuls
    multiply it by."""
    share = active_share(prog)
    read_by: dict[str, set[str]] = {}
    rows: dict[str, int] = {}
    uses: dict[str, int] = {}  # a weight multiplied twice a token counts twice: a multi-token-prediction
    for op in prog.ops:       # module's pass through the shared head (Megatron's "(mtp_num_layers + 1)")
        if op.phase != "forward":
            continue
        for n in op.input_names():
            read_by.setdefault(n, set()).add(op.rule)
        y = op.inputs.get("y")
        if op.rule == "matmul" and isinstance(y, str):
            uses[y] = uses.get(y, 0) + 1
        if op.rule == "matmul" and isinstance(y, str) and len(prog.tensors[y].shape) >= 3 and op.output_names():
            out = prog.tensors[op.output_names()[0]]
            rows[y] = rows.get(y, 0) + out.numel // max(out.shape[-1], 1)
    n_params = 0
    tokens = guess_tokens(prog) or tokens if rows else tokens  # the program's own tokens, its rows'
    for t in prog.tensors.values():
        if t.kind == "parameter" and not t.inplace_of:
            rules = read_by.get(t.name, set())
            if rules and all(facts_of(r).cost is lookup for r in rules):
                continue
            if t.name in share:
                n_params += round(t.numel * share[t.name])
                continue
            if t.name in rows and tokens > 0 and rules == {"matmul"}:
                n_params += round(t.numel * rows[t.name] / (t.shape[0] * tokens))
                continue
            n_params += t.numel * max(1, uses.get(t.name, 0) if len(t.shape) == 2 else 1)
    return n_params


def _attention_flops(prog: Program) -> float:
    """``QK^T`` and ``PV`` of the forward over the full ``s x s`` square (global shapes):
    flash_attention or cp_attention, or a forward matmul of two batched activations (rank >= 3: an imported
    program's weights may be activations, transposed or split, but are 2-D)."""
    att = 0.0
    for op in prog.ops:
        if op.phase != "forward":
            continue
        if op.rule in ("flash_attention", "cp_attention"):
            q, k, v = (prog.tensors[op.inputs[p]].shape for p in ("q", "k", "v"))
            att += 2.0 * q[-4] * q[-2] * q[-3] * k[-3] * (q[-1] + v[-1])
        elif op.rule in ("matmul", "bmm"):
            x, y = op.inputs.get("x"), op.inputs.get("y")
            if not isinstance(x, str) or not isinstance(y, str):
                continue
            if prog.tensors[x].kind in ("parameter", "input") or prog.tensors[y].kind in ("parameter", "input"):
                continue
            if len(prog.tensors[x].shape) < 3 or len(prog.tensors[y].shape) < 3:
                continue  # a weight made an activation (transposed, split by megatron_program): not attention
            xs = prog.tensors[x].shape
            out = op.output_names()
            if not out or not xs:
                continue
            k_ = k_of((xs, 0, ""), bool(op.attrs.get("trans_x", False)))
            att += 2.0 * prog.tensors[out[0]].numel * k_
    return att


def model_flops(plan: Plan, tokens: int) -> tuple[float, int, float]:
    """(model FLOPs of the step, N, attention FLOPs) as Narayanan et al. (2021) and PaLM
    (Chowdhery et al. 2022, appendix B) count them: ``6·N·tokens`` with N the parameters a
    matmul reads (an embedding table read only by a lookup does no multiply), plus the
    attention's ``QK^T`` and ``PV`` over the full ``s x s`` square, three times (forward and
    backward): PaLM's ``12·L·H·Q·T`` per token. Global shapes."""
    n_params = _matmul_params(plan.program, tokens)
    att = _attention_flops(plan.program) * 3
    return 6.0 * n_params * tokens + att, n_params, att


def guess_tokens(program: Program) -> int | None:
    """Tokens per step of a program: the elements of its token-id input (``tokens`` or
    ``input_ids``, else the first integer input of rank 2), None if it has none."""
    ins = [t for t in program.tensors.values() if t.kind == "input"]
    for t in ins:
        if t.name in ("tokens", "input_ids"):
            return t.numel
    for t in ins:
        if t.dtype in ("int64", "int32") and len(t.shape) == 2:
            return t.numel
    return None


__all__ = ["COSTED", "FP8_AMAX", "float8_tp_gather_dims", "float8_tp_gathers", "FP8_FUSED_PRODUCERS", "FP8_GEMMS", "FP8_PRE_GATHER", "Fp8Layers", "KernelCollective", "cost_of", "fp8_amax_cost", "fp8_gathered", "fp8_layers", "gathered_itemsize",
           "fp8_weights", "fused_wgrad", "guess_tokens", "kernel_collectives", "local_op", "local_shape",
           "model_flops", "op_cost", "op_kernel_collectives"]
