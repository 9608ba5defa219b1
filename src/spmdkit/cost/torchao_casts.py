"""torchao's tensorwise float8 casts as torchtitan runs them under torch.compile (``--precision fp8
--framework torchtitan``): the memory-bound passes of each float8 linear, priced as the op's
``cast_bytes`` (separate kernels at the HBM rate, :meth:`spmdkit.cost.devices.Device.op_time`).
docs/devices.md, "torchao's float8 casts under torch.compile".

What the sources show (torchao ``torchao/float8`` at eab345c, the 2024-12 rows, and 6243040, the
2025-06 rows; the same passes):

- a cast is ``hp_tensor_to_float8_dynamic``: ``tensor_to_amax`` (``torch.max(torch.abs(x))``, a
  reduction over the whole tensor), ``amax_to_scale``, then ``_to_fp8_saturated`` (clamp, to
  float8). The cast needs the finished amax, so Inductor runs the reduction and the pointwise cast as
  kernels of their own: the amax reads the bf16 tensor (2 B an element), the cast reads it again
  and writes the float8 copy (2 + 1 B): :data:`CAST` = 5 B an element. Neither fuses into a norm's
  kernel (Transformer Engine's LayerNormLinear does; torchao has no such path): an input is cast
  whoever made it, once per distinct tensor (q / k / v and w1 / w3 read one input: the compiled
  block's graph computes the identical cast once);
- ``torch._scaled_mm`` wants its first operand row-major and its second column-major
  (``float8_ops.preprocess_addmm``: ``a_data.contiguous()`` where ``a`` is not row-major,
  ``b_data.t().contiguous().t()`` where ``b`` is row-major). The forward (``x_fp8 @ w_fp8.t()``)
  takes both as cast; the backward's dgrad (``dY_fp8 @ w_fp8``) copies the float8 weight transposed,
  the wgrad (``dY_fp8.t() @ x_fp8``) copies both the float8 output gradient and the float8 input
  transposed: a pass reading and writing 1 B an element each (:data:`TRANSPOSE` = 2 B), in the
  backward, on tensors the cast wrote earlier (a collective between, or the forward's saved copy);
- the output gradient is cast once (eab345c: ``NoopFwToFloat8BwDynamic``; 6243040: the two
  identical tensorwise casts of ``matmul_with_hp_or_float8_args.backward``, one after the graph's
  CSE); under torchao's float8 TP (:mod:`spmdkit.cost.float8_tp`) a block input and a rowwise
  linear's output gradient are cast on their 1/tp shard, before the all-gather, and the gathered
  float8 tensor is then copied transposed for the wgrad.

So, a float8 linear: forward, the weight cast (5 B a local weight element; a weight FSDP2 gathers in
float8 is cast before its gather instead, ``FP8_PRE_GATHER``), its input cast (5 B an element, on the
shard where it is gathered in float8); backward, the output gradient cast and transposed (5 + 2 B an
element; 5 B a shard element + 2 B where gathered in float8), the weight transposed (2 B) and the
input transposed (2 B an element, once per distinct input). Under full AC the forward's casts run
again in the recompute (the step re-runs the forward ops' cost). Not counted: the tiny second stage
of the amax's split reduction and the scale computation (one element), and torchtitan's per-op SAC
saving ``aten.max`` (the recomputed forward GEMMs are charged their amax again).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from spmdkit.program.plan import Plan

#: bytes an element of a dynamic tensorwise cast moves: the amax's read (2) and the cast's read and
#: float8 write (2 + 1), two kernels
CAST = 5.0
#: bytes an element of a float8 tensor copied transposed for ``_scaled_mm`` (read 1, write 1)
TRANSPOSE = 2.0


def gather_degree(plan: Plan, gathers: Mapping[str, tuple[int, ...]], tensor: str | None) -> int:
    """The ranks ``tensor`` is all-gathered over in float8 (``gathers``: the plan's
    :func:`spmdkit.cost.compute.float8_tp_gather_dims`, tensor -> mesh dims); 1 where it is not: its
    cast runs on ``1 / degree`` of the gathered elements."""
    dims = gathers.get(tensor) if tensor is not None else None
    return math.prod(plan.mesh.shape[d] for d in dims) if dims else 1


def torchao_cast_bytes(gemm: tuple[int, int, int, int], weight: int, *, grad: bool, pre: float | None,
                       x_cast: bool, x_degree: int, dy_degree: int, x_transpose: bool) -> float:
    """Bytes of torchao's cast and transpose passes at a float8 GEMM op (see the module docstring):
    ``gemm`` its local ``(batch, m, n, k)``, ``weight`` its local weight's elements, ``grad`` whether
    it is the linear's backward, ``pre`` the bytes of the shard casts before FSDP2's float8 gathers
    (None where the weight is gathered in bf16), ``x_cast`` / ``x_transpose`` whether this op casts
    the input (the forward's first reader) / copies its float8 input transposed (the backward's
    first reader), ``x_degree`` / ``dy_degree`` the ranks the input / the output gradient is
    all-gathered over in float8 (its cast on the shard; 1: on the GEMM's operand)."""
    b, m, n, k = gemm
    if not grad:
        out = pre if pre is not None else CAST * weight
        return out + (CAST * b * m * k / x_degree if x_cast else 0.0)
    out = (pre or 0.0) + TRANSPOSE * weight + CAST * b * m * n / dy_degree + TRANSPOSE * b * m * n
    return out + (TRANSPOSE * b * m * k if x_transpose else 0.0)


__all__ = ["CAST", "TRANSPOSE", "gather_degree", "torchao_cast_bytes"]
