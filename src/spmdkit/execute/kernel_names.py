"""The rule names that have a torch kernel (:mod:`spmdkit.execute.kernels`), known without
importing torch: ``spmdkit run``'s launcher checks a plan's kernels before any rank starts
(:func:`check_kernels`), and it imports no torch of its own (1.4 CPU s a launch). The list is the
kernel table's: :func:`spmdkit.execute.kernels._common.register` refuses a name not in it, and
tests/test_torch_kernels.py checks that every name in it has a kernel."""

from __future__ import annotations

from spmdkit.core.errors import ProgramError
from spmdkit.engine.registry import by_rule_name
from spmdkit.program.ir import Program

#: every name :data:`spmdkit.execute.kernels.KERNELS` has a kernel under (aliases included)
KERNEL_NAMES: frozenset[str] = frozenset({
    "abs", "abs_grad", "acos", "acos_grad", "acosh", "acosh_grad", "adam", "adam_", "adamw", "adamw_", "add",
    "add_grad", "add_n", "add_n_grad", "all", "amax", "amax_grad", "amin", "amin_grad", "any", "argsort",
    "argsort_grad", "asin", "asin_grad", "asinh", "asinh_grad", "assign", "assign_grad", "atan", "atan_grad", "atanh",
    "atanh_grad", "bernoulli", "bernoulli_grad", "bitwise_and", "bitwise_not", "bitwise_or", "bitwise_xor", "bmm",
    "c_embedding", "c_embedding_grad", "c_softmax_with_cross_entropy", "c_softmax_with_cross_entropy_grad", "cast",
    "cast_grad", "causal_conv1d", "causal_conv1d_grad", "ceil", "ceil_grad", "celu", "celu_grad", "clip", "clip_grad",
    "concat", "concat_grad", "conj", "conj_grad", "conv1d", "conv1d_grad", "conv2d", "conv2d_grad", "conv3d",
    "conv3d_grad", "cos", "cos_grad", "cosh", "cosh_grad", "cp_attention", "cp_attention_grad",
    "cross_entropy_with_softmax", "cross_entropy_with_softmax_grad", "cumsum", "cumsum_grad", "digamma", "digamma_grad",
    "divide", "divide_grad", "dropout", "dropout_grad", "elementwise_add", "elementwise_add_grad", "elementwise_binary",
    "elementwise_binary_grad", "elementwise_div", "elementwise_div_grad", "elementwise_mul", "elementwise_mul_grad",
    "elementwise_pow", "elementwise_pow_grad", "elementwise_sub", "elementwise_sub_grad", "elementwise_unary",
    "elementwise_unary_grad", "elu", "elu_grad", "embedding", "embedding_grad", "empty_like", "erf", "erf_grad",
    "erfinv", "erfinv_grad", "exp", "exp_grad", "expand", "expand_as", "expand_as_grad", "expand_as_v2",
    "expand_as_v2_grad", "expand_grad", "expm1", "expm1_grad", "fill", "fill_grad", "flash_attention",
    "flash_attention_grad", "flatten", "flatten_grad", "floor", "floor_divide", "floor_divide_grad", "floor_grad",
    "fmax", "fmax_grad", "fmin", "fmin_grad", "frobenius_norm", "frobenius_norm_grad", "full_like", "fused_rms_norm",
    "fused_rms_norm_grad", "fused_rope", "fused_rope_grad", "fused_rotary_position_embedding",
    "fused_rotary_position_embedding_grad", "gated_delta_rule", "gated_delta_rule_grad", "gather", "gather_grad",
    "gelu", "gelu_grad", "greater_than", "hardshrink", "hardshrink_grad", "hardsigmoid", "hardsigmoid_grad",
    "hardswish", "hardswish_grad", "hardtanh", "hardtanh_grad", "heaviside", "heaviside_grad", "index_put",
    "index_put_grad", "index_select", "index_select_grad", "layer_norm", "layer_norm_grad", "leaky_relu",
    "leaky_relu_grad", "less_than", "lgamma", "lgamma_grad", "log", "log10", "log10_grad", "log1p", "log1p_grad",
    "log2", "log2_grad", "log_grad", "log_softmax", "log_softmax_grad", "logical_and", "logical_not", "logical_or",
    "logical_xor", "logit", "logit_grad", "logsigmoid", "logsigmoid_grad", "lookup_table_v2", "lookup_table_v2_grad",
    "matmul", "matmul_grad", "matmul_v2", "matmul_v2_grad", "max", "max_grad", "maximum", "maximum_grad", "mean",
    "mean_all", "mean_all_grad", "mean_grad", "min", "min_grad", "minimum", "minimum_grad", "mish", "mish_grad",
    "moe_combine", "moe_combine_grad", "moe_gate_dispatch", "moe_gate_dispatch_grad", "multiply", "multiply_grad",
    "not_equal", "numel", "one_hot", "ones_like", "pad", "poisson", "poisson_grad", "pow", "pow_binary",
    "pow_binary_grad", "pow_grad", "prod", "prod_grad", "put_along_axis", "put_along_axis_grad", "reciprocal",
    "reciprocal_grad", "reduce_all", "reduce_any", "reduce_base", "reduce_max", "reduce_max_grad", "reduce_mean",
    "reduce_mean_grad", "reduce_min", "reduce_min_grad", "reduce_prod", "reduce_prod_grad", "reduce_sum",
    "reduce_sum_grad", "relu", "relu6", "relu6_grad", "relu_grad", "remainder", "remainder_grad", "reshape", "reshape2",
    "reshape_grad", "rms_norm", "rms_norm_grad", "round", "round_grad", "rsqrt", "rsqrt_grad", "scale", "scale_grad",
    "selu", "selu_grad", "sgd", "sgd_", "sigmoid", "sigmoid_grad", "sign", "sign_grad", "silu", "silu_grad", "sin",
    "sin_grad", "sinh", "sinh_grad", "slice", "slice_grad", "softmax", "softmax_grad", "softmax_with_cross_entropy",
    "softmax_with_cross_entropy_grad", "softplus", "softplus_grad", "softshrink", "softshrink_grad", "softsign",
    "softsign_grad", "split", "split_grad", "split_with_num", "split_with_num_grad", "sqrt", "sqrt_grad", "square",
    "square_grad", "squared_l2_norm", "squared_l2_norm_grad", "squeeze", "squeeze_grad", "stack", "stack_grad", "stanh",
    "stanh_grad", "strided_slice", "strided_slice_grad", "subtract", "subtract_grad", "sum", "sum_grad", "swiglu",
    "swiglu_grad", "swish", "swish_grad", "take_along_axis", "take_along_axis_grad", "tan", "tan_grad", "tanh",
    "tanh_grad", "tanh_shrink", "tanh_shrink_grad", "thresholded_relu", "thresholded_relu_grad", "tile", "tile_grad",
    "topk", "topk_grad", "transpose", "transpose2", "transpose_grad", "trunc", "trunc_divide", "trunc_grad", "unbind",
    "unbind_grad", "unsqueeze", "unsqueeze2", "unsqueeze_grad", "where", "where_grad", "zeros_like"
})

_HAS = dict.fromkeys(KERNEL_NAMES, True)

#: rule -> (attribute, what): a kernel that exists but not for this attribute set true
_UNSUPPORTED = {"flash_attention": ("return_softmax", "flash_attention with return_softmax")}


class NoTorchKernelError(ProgramError):
    """An op of the program has no torch kernel (``--kernels numpy`` runs it)."""


def has_kernel(name: str) -> bool:
    """Whether the rule ``name`` (or any alias of its rule) has a torch kernel."""
    return by_rule_name(_HAS, name) is not None


def missing_kernels(program: Program) -> dict[str, str]:
    """Rules of ``program`` with no torch kernel, or none for the attributes an op sets
    ("flash_attention with return_softmax"): -> the first op that uses it."""
    out: dict[str, str] = {}
    fallbacks = getattr(program, "fallbacks", None) or {}  # an imported op torch itself runs
    for i, op in enumerate(program.ops):
        if i in fallbacks:
            continue
        bad = _UNSUPPORTED.get(op.rule)
        key = bad[1] if bad is not None and op.attrs.get(bad[0]) else op.rule
        if (not has_kernel(op.rule) or key != op.rule) and key not in out:
            out[key] = op.name
    return out


def check_kernels(program: Program) -> None:
    """Raise :class:`NoTorchKernelError` naming every op whose rule has no torch kernel."""
    miss = missing_kernels(program)
    if miss:
        names = ", ".join(f"{r} (op {o})" for r, o in sorted(miss.items()))
        raise NoTorchKernelError(f"--kernels torch: no torch kernel for {names}; run with --kernels numpy "
                                 f"(spmdkit's float64 numpy references) instead")


__all__ = ["KERNEL_NAMES", "NoTorchKernelError", "check_kernels", "has_kernel", "missing_kernels"]
