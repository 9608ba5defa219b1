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

torchao's **rowwise** recipe (``--float8-recipe rowwise``; torchao ``torchao/float8/config.py`` at
6243040, 0afa4c1 and 890e0ac8, ``Float8LinearConfig.from_recipe_name("rowwise")``): input, weight and
output gradient each cast with ``ScalingGranularity.AXISWISE`` to e4m3 (the gradient too),
``round_scales_to_power_of_2``; all three GEMMs in float8. ``matmul_with_hp_or_float8_args``
(``float8_linear.py``) saves the bf16 input and weight, casts the input along its last axis and the
weight along its input axis in the forward (``axiswise_dim`` -1 / 0), and in the backward the output
gradient along its last axis for the dgrad, and the weight, the output gradient and the input each
*again from bf16* along the other axis for the dgrad / wgrad (an axiswise scale does not carry over
to the transposed use). The kernels those casts run, and their bytes, are torchao's own roofline
for the recipe (``torchao/testing/float8/roofline_utils.py`` at 6243040,
``get_tensor_memory_traffic_ovhd_s``, ``float8_recipe_name == "rowwise"``, added d8af7d7b8):

- a cast along the contiguous axis is one kernel, the amax of a row and its cast together: read bf16,
  write float8 (:data:`ROW_CAST` = 3 B an element);
- a cast along the other axis is a bf16 transpose then such a cast ("assume that we can't fuse 2 and
  3 because that would require loading the entire tensor to shared memory"): 2 + 2 + 3
  (:data:`ROW_CAST_T` = 7 B), as the roofline writes the weight's backward;
- the output gradient, both of its casts in the backward: one kernel reads it once and writes its
  float8 copy and its bf16 transpose (2 + 1 + 2), a second casts the transpose (2 + 1):
  :data:`ROW_GRAD_OUT` = 8 B an element;
- the input's forward cast (3 B, the first forward reader of each distinct input) and its backward
  re-scale (7 B, the first backward reader): the roofline fuses the transpose into the forward
  kernel, but torchao's code casts the saved bf16 input in the backward
  (``matmul_with_hp_or_float8_args.backward``: ``hp_tensor_to_float8_dynamic(input_hp_reshaped, ...,
  axiswise_dim=get_maybe_axiswise_dim(0, ...))``), so it is priced as the weight's is.

No transposed float8 copy for ``_scaled_mm``: the roofline's casts write the layout the GEMM reads.
The two backward GEMMs run ``use_fast_accum=False`` (``Float8LinearConfig``'s
``gemm_config_grad_input`` / ``gemm_config_grad_weight``), and ``addmm_float8_unwrapped``
(``float8_ops.py`` at 6243040) then calls cuBLAS's *tensorwise* kernel with unit scales and applies
the row and column scales afterwards ("The rowwise CUTLASS-based kernel is so slow without
fast-accum that we'd rather use the tensorwise cuBLAS-based kernel and do the scaling manually
afterwards"): ``output *= post_inverse_scale``, a kernel of its own per GEMM under torch.compile
(pytorch/ao#2184: "at least one extra triton kernel *per GEMM* ... just for the rescaling"), which
reads and writes the bf16 output (:data:`RESCALE` = 4 B an element of dX and of dW). The forward
GEMM (``use_fast_accum=True``) runs PyTorch's rowwise CUTLASS kernel; no source gives its rate
against cuBLAS's tensorwise one at these shapes (pytorch/pytorch#147971, 2025-02: "most shapes are
within 90-100% of tensor-wise efficiency, but there's a long tail going down to 50%", as a plot;
torchao's roofline prices both at the same float8 peak), so it is priced at the float8 rate; the
whole linear these parts make is then scaled to torchao's published table of it
(:mod:`spmdkit.cost.torchao_rowwise`). Under TP the recipe runs plain TP (torchtitan
``parallelize_llama`` at 820504e: ``enable_float8_tensorwise_tp = enable_float8_linear and not
float8_is_rowwise``): the all-gathers move bf16 and every cast runs on the gathered tensor.
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
#: rowwise recipe (module docstring; torchao's roofline at 6243040): a cast along the contiguous
#: axis (read bf16 2, write float8 1, one kernel)
ROW_CAST = 3.0
#: a cast along the other axis: a bf16 transpose (read 2, write 2), then a rowwise cast (3)
ROW_CAST_T = 7.0
#: the output gradient's two casts: its float8 copy and bf16 transpose in one pass (2 + 1 + 2), the
#: transpose's cast (2 + 1)
ROW_GRAD_OUT = 8.0
#: the backward GEMMs' rescale (``output *= post_inverse_scale``): read and write the bf16 output
RESCALE = 4.0


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


def rowwise_cast_bytes(gemm: tuple[int, int, int, int], weight: int, *, grad: bool, x_cast: bool,
                       x_transpose: bool) -> float:
    """Bytes of torchao's rowwise recipe's casts and rescales at a float8 GEMM op (the module
    docstring): ``gemm`` its local ``(batch, m, n, k)``, ``weight`` its local weight's elements,
    ``grad`` whether it is the linear's backward, ``x_cast`` / ``x_transpose`` whether this op casts
    the input along its last axis (the forward's first reader of it) / re-scales it along its
    other axis (the backward's first reader). The forward: the weight's cast and the input's;
    the backward: the weight's re-scale, the output gradient's two casts, the input's re-scale and
    the rescale of dX (``b m k``) and dW (the weight's elements)."""
    b, m, n, k = gemm
    if not grad:
        return ROW_CAST * weight + (ROW_CAST * b * m * k if x_cast else 0.0)
    out = ROW_CAST_T * weight + ROW_GRAD_OUT * b * m * n + RESCALE * (b * m * k + weight)
    return out + (ROW_CAST_T * b * m * k if x_transpose else 0.0)


__all__ = ["CAST", "RESCALE", "ROW_CAST", "ROW_CAST_T", "ROW_GRAD_OUT", "TRANSPOSE", "gather_degree",
           "rowwise_cast_bytes", "torchao_cast_bytes"]
