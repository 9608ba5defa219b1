"""torchao's float8 tensor parallelism: the TP all-gathers of float8 linears' operands in float8
(``--precision fp8 --framework torchtitan`` on a plan with a tp mesh dim). Standard library only.
docs/devices.md, "torchao's float8 TP".

What the sources show. torchtitan's ``apply_tp`` (``torchtitan/parallelisms/parallelize_llama.py``
at 9dec370; ``torchtitan/models/llama3/parallelize_llama.py`` at 820504e, tensorwise recipe) gives
every transformer block's linears torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel``
and the attention and feed-forward modules ``PrepareFloat8ModuleInput`` (input ``Shard(1)`` to
``Replicate()``). In ``torchao.float8.float8_tensor_parallel`` (eab345c, the 2024-12 runs;
6243040, the 2025-06 runs; the same logic):

- forward: ``PrepareFloat8ModuleInput._prepare_input_arg`` casts the sequence-sharded input to
  ``float8_e4m3fn`` (``hp_tensor_to_float8_dynamic``, tensorwise) *before* ``redistribute``
  (``Shard -> Replicate``): the all-gather moves 1 byte an element, once for q / k / v and once
  for w1 / w3 ("so that if there are multiple float8 users of the input activation, we perform
  fp8 allgather only once"); the colwise linears find it already cast (``tensor_already_casted_to_fp8``);
- backward: ``Float8RowwiseParallel._prepare_output_fn`` applies ``NoopFwToFloat8BwDynamic``
  *after* the output's ``redistribute`` (``Partial -> Shard(1)``), so in the backward the output
  gradient is cast to ``float8_e5m2`` on its sequence shard first and the all-gather that is the
  reduce-scatter's backward moves the float8 tensor (1 byte), which the linear's backward uses as
  is (``NoopFwToFloat8BwDynamic.backward`` / ``matmul_with_hp_or_float8_args``: already float8).
  The reduce-scatters (forward of wo / w2, backward of the summed input gradients) move the
  matmuls' bf16 outputs: unchanged.

A tensor gathered over tp whose every reader in that phase is a float8 linear's GEMM (its input
in the forward, its output gradient in the backward) is gathered in float8: :func:`float8_tp_gathers`
(in :mod:`spmdkit.cost.compute`, which prices torchao's casts on those shards; re-exported here).
The final norm's output, gathered for the bf16 output head (torchtitan's plain ``ColwiseParallel``
for ``output``), is not.
"""

from __future__ import annotations

import math
from dataclasses import replace

from spmdkit.core.reshard import Step
from spmdkit.cost.collectives import buffer_bytes, time_of
from spmdkit.cost.compute import (
    _ROLES,
    FP8_GEMMS,
    _canonical,
    _operand,
    float8_tp_gather_dims,
    float8_tp_gathers,
    fp8_weights,
)
from spmdkit.engine.memo import Recent
from spmdkit.program.plan import Plan


def float8_step(plan: Plan, tensor: str, s: Step) -> Step:
    """``s`` at 1 byte an element where it is an all-gather of a :func:`float8_tp_gathers` tensor
    (the ring bytes and the time of a buffer ``itemsize`` times smaller); else ``s``."""
    if s.kind != "all_gather" or not s.bytes_per_rank or tensor not in float8_tp_gathers(plan):
        return s
    size = plan.program.tensors[tensor].itemsize
    n = math.prod(plan.mesh.shape[d] for d in s.mesh_dims)
    buf = buffer_bytes(s.kind, s.bytes_per_rank, n) / size
    return replace(s, bytes_per_rank=round(s.bytes_per_rank / size),
                   time_s=time_of(plan.cost, s.kind, s.mesh_dims, buf, plan.mesh.shape))


#: bytes of a tensorwise amax all-reduced over tp (``tensor_to_amax`` of a DTensor: one fp32 scalar)
AMAX_BYTES = 4.0

_AMAX_MEMO: Recent[tuple[Plan, dict[int, float]]] = Recent(16, by_id=True)


def amax_all_reduces(plan: Plan) -> dict[int, float]:
    """Op -> seconds of the amax all-reduces torchao's float8 TP runs there: each cast of a sharded
    DTensor takes ``torch.max(torch.abs(x))`` (``tensor_to_amax``), a ``Partial(max)`` scalar that
    ``amax_to_scale``'s clamp needs replicated, one all-reduce of :data:`AMAX_BYTES` over tp: at the
    op that makes a :func:`float8_tp_gathers` block input (its cast before the gather, once for its
    readers), at each other forward float8 GEMM (its input cast on its shard: wo, w2), and at each
    float8 GEMM's grad (its output gradient's ``NoopFwToFloat8BwDynamic`` cast). Empty where
    torchao's float8 TP does not run (:func:`float8_tp_gathers` empty)."""
    if not float8_tp_gathers(plan):
        return {}
    return _AMAX_MEMO.get(id(plan), lambda: (plan, _amax(plan)))[1]


def _amax(plan: Plan) -> dict[int, float]:
    prog = plan.program
    gathers = float8_tp_gather_dims(plan)
    at: dict[str, int] = {}
    for r in plan.reshards:
        if r.tensor in gathers and prog.ops[r.op_index].phase == "forward":
            at.setdefault(r.tensor, r.op_index)
    # the tp dims: a forward block input's gather's, else (only backward gathers) the first one's
    dims = gathers[next(iter(at))] if at else next(iter(gathers.values()))
    t = time_of(plan.cost, "all_reduce", dims, AMAX_BYTES, plan.mesh.shape)
    weights = fp8_weights(prog)
    out: dict[int, float] = {}
    for i, op in enumerate(prog.ops):
        if op.phase not in _ROLES or _canonical(op.rule) not in FP8_GEMMS \
                or _operand(prog, op, ("y", "weight"), "parameter") not in weights:
            continue
        x = _operand(prog, op, ("x", "input"), None) if op.phase == "forward" else None
        j = at.pop(x, -1) if x in at else (-1 if x in gathers else i)  # a gathered input: once, at its cast
        if j >= 0:
            out[j] = out.get(j, 0.0) + t
    return out


def float8_gather_s(plan: Plan, index: int) -> float:
    """Seconds of reshard ``index`` (all its steps), its float8 all-gathers at 1 byte an element."""
    r = plan.reshards[index]
    return sum(float8_step(plan, r.tensor, s).time_s for s in r.plan.steps)


__all__ = ["AMAX_BYTES", "amax_all_reduces", "float8_gather_s", "float8_step", "float8_tp_gathers"]
