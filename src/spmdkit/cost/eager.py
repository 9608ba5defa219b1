"""Eager PyTorch: the memory-bound traffic and kernels of ops that a fused program op stands for.
Standard library only. docs/devices.md, "Eager and compiled".

A program op such as ``fused_rms_norm`` is costed as one fused kernel (its inputs read and its
outputs written once): what Megatron-LM's and Transformer Engine's fused kernels run, and what
torch.compile's Inductor makes of a torchtitan block. torchtitan without ``--compile`` (its
default, ``training.compile = false``) runs its model code op by op: every PyTorch op is its own
kernel reading and writing HBM, with fp32 intermediates where the code upcasts. This module gives,
per program op, the bytes and kernels of that eager chain as torchtitan's model code writes it
(``torchtitan/models/llama/model.py`` and ``models/norms.py`` at 9dec370, 2024-12), forward and
autograd backward, from the op's local tensors:

- RMSNorm (``_norm(x.float()).type_as(x) * weight``, ``_norm = x * rsqrt(x.pow(2).mean(-1) + eps)``):
  forward ``x.float()``, ``pow``, ``mean``, ``add``, ``rsqrt``, ``mul``, ``type_as``, ``mul`` (8
  kernels, ``4a + 7f`` bytes an element, ``a`` the activation's bytes, ``f`` = 4); backward the
  autograd chain of the same (:func:`_rms_norm_grad`).
- rotary (``apply_rotary_emb``: ``view_as_complex(x.float())``, a complex multiply by
  ``freqs_cis``, ``view_as_real(...).type_as(x)``): 3 kernels, ``2a + 4f`` an element, backward
  likewise.
- SwiGLU (``w2(silu(w1(x)) * w3(x))``): ``silu`` and ``mul`` (``5a`` an element of the hidden);
  backward the two products and ``silu_backward`` (``9a``).

The extra cost of an op is the eager chain's bytes and kernels less what the fused op already
costs (never negative). Two costs are torchtitan's whatever ``--compile`` says, since its
compiled region is each transformer block and these sit outside it or outside Inductor's fusion:

- the loss, ``cross_entropy(pred.flatten(0, 1).float(), labels)``: ``.float()`` of the logits,
  ``log_softmax`` (three passes over a wide row: max, sum of exponentials, the write), then in
  the backward ``nll_loss_backward`` (a zero-filled fp32 gradient) and ``log_softmax_backward``
  (the gradient and the output read, a row sum, the write) and the cast back;
- grouped-query attention's ``repeat_kv``: K and V expanded to the query heads and copied
  (``expand(...).reshape(...)``) before ``scaled_dot_product_attention``, their gradients
  summed back over the repeats in the backward;
- the optimizer, torch's foreach AdamW (``build_optimizers``: ``"foreach": not fused``,
  ``--optimizer.fused`` off): eight HBM passes of ``_multi_tensor_adamw`` (:data:`FOREACH`), not
  the fused update's one.
"""

from __future__ import annotations

from dataclasses import replace

from spmdkit.engine.facts import LocalOp, OpCost

F32 = 4


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _first(c: LocalOp, *params: str) -> tuple[int, int] | None:
    """(elements, bytes per element) of the first of ``params`` the op has."""
    for p in params:
        t = c.one(p)
        if t is not None:
            return _numel(t[0]), t[1]
    return None


def _rotated(c: LocalOp) -> tuple[int, int]:
    """Elements rotated by a rotary op (its q / k / v outputs) and their bytes per element."""
    outs = [o for o in c.outs if o is not None and len(o[0]) >= 3]
    return sum(_numel(o[0]) for o in outs), (outs[0][1] if outs else 2)


def _casts(a: int) -> int:
    """Kernels of an upcast and its downcast: none where the activations are fp32 already
    (``x.float()`` and ``type_as`` of an fp32 tensor return it)."""
    return 0 if a >= F32 else 2


def _rms_norm(c: LocalOp) -> tuple[float, int]:
    e, a = _first(c, "x") or (0, 2)
    cast = a < F32
    # x.float() | pow | mean (one fp32 read) | add eps, rsqrt (rows) | x * rstd | type_as | * weight
    per = (a + F32 if cast else 0) + 2 * F32 + F32 + 2 * F32 + (F32 + a if cast else 0) + 2 * a
    return float(per * e), 6 + _casts(a)


def _rms_norm_grad(c: LocalOp) -> tuple[float, int]:
    e, a = _first(c, "x") or (0, 2)
    cast = a < F32
    per = (2 * a          # g * weight
           + 3 * a + a    # g * normed (the weight's gradient), summed over the tokens
           + (a + F32 if cast else 0)  # type_as backward: the gradient to fp32
           + 2 * F32      # grad * rstd
           + 3 * F32 + F32  # (grad * x).sum(-1): the rstd's gradient
           + F32          # mean backward: the row gradient expanded and divided
           + 7 * F32      # pow backward: grad * (2 * x.pow(1)): a copy, a scale, a product
           + 3 * F32      # the two gradients of x summed
           + (F32 + a if cast else 0))  # x.float() backward: the gradient to bf16
    return float(per * e), 10 + _casts(a)


def _rope(c: LocalOp) -> tuple[float, int]:
    e, a = _rotated(c)
    cast = a < F32
    # x.float() | complex multiply by freqs_cis (fp32 read and write) | type_as
    return float(((a + F32) if cast else 0) * e + 2 * F32 * e + ((F32 + a) if cast else 0) * e), 1 + _casts(a)


def _swiglu(c: LocalOp) -> tuple[float, int]:
    e = c.out_numel
    a = (c.first_out() or ((), 2, ""))[1]
    return float(5 * a * e), 2  # silu(gate): read, write | * up: two reads, a write


def _swiglu_grad(c: LocalOp) -> tuple[float, int]:
    g = _first(c, "out_grad")
    e, a = g if g else (0, 2)
    return float(9 * a * e), 3  # g * up | g * silu(gate) | silu_backward(g * up, gate)


#: the eager chain of a fused program op under torchtitan without --compile: rule -> (bytes, kernels)
EAGER = {"fused_rms_norm": _rms_norm, "rms_norm": _rms_norm, "rms_norm_grad": _rms_norm_grad,
         "fused_rms_norm_grad": _rms_norm_grad,
         "fused_rotary_position_embedding": _rope, "fused_rotary_position_embedding_grad": _rope,
         "swiglu": _swiglu, "swiglu_grad": _swiglu_grad}


def _loss(c: LocalOp, backward: bool) -> tuple[float, int]:
    """torchtitan's ``cross_entropy(pred.float())`` over the op's logits (bf16, ``a`` bytes):
    the forward's ``x``, the backward's gradient of it (its first output)."""
    o = c.first_out()
    x = (_numel(o[0]), o[1]) if backward and o is not None else _first(c, "x")
    if x is None:
        return 0.0, 0
    e, a = x
    up = (a + F32) if a < F32 else 0
    if not backward:  # .float() | log_softmax: max, sum of exp, write
        return float(e * (up + 3 * F32 + F32)), 2 + (1 if up else 0)
    # nll_loss_backward: zero-filled fp32 gradient | log_softmax_backward: grad and output read,
    # row sums, the write | the cast back to the logits' dtype
    return float(e * (F32 + 3 * F32 + F32 + up)), 3 + (1 if up else 0)


def _repeat_kv(c: LocalOp, backward: bool) -> tuple[float, int]:
    """GQA's ``repeat_kv`` of K and V to the query heads (forward: a copy each; backward: their
    gradients summed over the repeats)."""
    q, k = c.one("q"), c.one("k")
    if q is None or k is None or len(q[0]) != 4 or len(k[0]) != 4 or k[0][2] >= q[0][2]:
        return 0.0, 0
    kv = _numel(k[0]) * k[1]
    full = kv * (q[0][2] // max(k[0][2], 1))
    return float(2 * (kv + full)), 2  # K and V: read kv, write the repeated (backward: the reverse)


def _foreach_adamw(c: LocalOp) -> tuple[float, int]:
    """torch's ``_multi_tensor_adamw`` (``AdamW(foreach=True)``, torchtitan's default), one pass
    over HBM per foreach op: the update runs on the sharded parameter (``master_param`` where the
    program keeps one, else ``param``) and its gradient in that dtype (FSDP2 casts the reduced
    gradient to the sharded parameter's), the moments in their own dtype; the temporary
    ``sqrt(v)`` in v's."""
    p = _first(c, "master_param", "param")
    m, v = _first(c, "moment1"), _first(c, "moment2")
    if p is None or m is None or v is None:
        return 0.0, 0
    e, pb = p
    mb, vb = m[1], v[1]
    per = (2 * pb                # _foreach_mul_(params, 1 - lr * weight_decay)
           + 2 * mb + pb         # _foreach_lerp_(exp_avgs, grads, 1 - beta1)
           + 2 * vb              # _foreach_mul_(exp_avg_sqs, beta2)
           + 2 * vb + pb         # _foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
           + 2 * vb              # _foreach_sqrt(exp_avg_sqs): a new tensor
           + 2 * vb + 2 * vb     # _foreach_div_(.., bias_correction2_sqrt), _foreach_add_(.., eps)
           + 2 * pb + mb + vb)   # _foreach_addcdiv_(params, exp_avgs, denom, step_size)
    return float(per * e), 8


#: torch's foreach optimizers, as torchtitan builds them whatever ``--compile`` says
#: (``build_optimizers``: ``"fused": fused, "foreach": not fused``, ``--optimizer.fused`` off;
#: its compiled regions are the transformer blocks only)
FOREACH = {"adamw": _foreach_adamw}


#: the losses torchtitan computes as ``cross_entropy(pred.float())`` (loss_parallel under TP)
LOSSES = frozenset({"cross_entropy_with_softmax", "cross_entropy_with_softmax_grad", "c_softmax_with_cross_entropy",
                    "c_softmax_with_cross_entropy_grad"})


def eager_cost(c: LocalOp, cost: OpCost, eager: bool) -> OpCost:
    """``cost`` (the fused op's) with what torchtitan runs beyond it: the eager chain of a fused
    op (:data:`EAGER`) when ``eager``; the fp32 loss, GQA's ``repeat_kv`` and the foreach
    optimizer's passes (:data:`FOREACH`) either way."""
    rule = c.rule
    extra, kernels = 0.0, 0
    fn = EAGER.get(rule) if eager else None
    if fn is not None:
        b, k = fn(c)
        extra, kernels = max(0.0, b - cost.bytes), max(0, k - cost.kernels)
    elif rule in FOREACH:  # its kernels launch once for many parameters: the op's kernel count stays
        b, _k = FOREACH[rule](c)
        extra = max(0.0, b - cost.bytes)
    elif rule in LOSSES:
        b, k = _loss(c, rule.endswith("_grad"))
        extra, kernels = max(0.0, b - cost.bytes), max(0, k - cost.kernels)
    elif rule in ("flash_attention", "flash_attention_grad"):
        # a copy kernel before (forward) or after (backward) the attention kernel: its bytes are
        # timed on their own, as the casts before a GEMM are (Device.op_time adds cast_bytes)
        b, _ = _repeat_kv(c, rule.endswith("_grad"))
        return replace(cost, cast_bytes=cost.cast_bytes + b) if b > 0 else cost
    if extra <= 0 and kernels <= 0:
        return cost
    return replace(cost, bytes=cost.bytes + extra, kernels=cost.kernels + kernels)


__all__ = ["EAGER", "FOREACH", "LOSSES", "eager_cost"]
