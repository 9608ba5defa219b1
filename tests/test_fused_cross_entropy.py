"""flash-attn's fused CrossEntropyLoss (``--cross-entropy-kernel``, spmdkit.cost.loss): its bytes
counted by hand from the kernels, its memory (the 16-bit logits saved, no fp32 copy), and where
the option applies (``--framework torchtitan`` only; Megatron's ``--cross-entropy-fusion`` under
``--framework megatron`` only)."""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import replace

import pytest

from spmdkit.cli import main
from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.cost.compute import op_cost
from spmdkit.cost.memory import memory_per_device
from spmdkit.planner.planning import plan_model
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import Runtime

TOKENS, VOCAB = 2 * 128, 4096


def _loss_plan() -> tuple[Plan, int, int]:
    """llama-7b's head and loss, one layer, vocab 4096, 2 x 128 tokens on one rank: (plan, the
    loss op, its grad)."""
    _, plan, _ = plan_model("llama-7b", "dp=1", "dp", {"layers": 1, "seq": 128, "batch": 2, "vocab": VOCAB,
                                                       "hidden": 256, "heads": 4, "kv_heads": 4, "ffn": 512})
    ops = plan.program.ops
    fwd = next(i for i, op in enumerate(ops) if op.rule == "cross_entropy_with_softmax")
    bwd = next(i for i, op in enumerate(ops) if op.rule == "cross_entropy_with_softmax_grad")
    return plan, fwd, bwd


def _with(plan: Plan, **kw: object) -> Plan:
    return replace(plan, runtime=Runtime(framework="torchtitan", compile=False, **kw))  # type: ignore[arg-type]


def test_flash_attn_cross_entropy_bytes_by_hand() -> None:
    plan, fwd, bwd = _loss_plan()
    elems = TOKENS * VOCAB
    # per token, each way: the int64 label 8, the fp32 loss 4 and log-sum-exp 4
    tok = 16 * TOKENS
    # xentropy_kernel.cu: forward two walks of the bf16 row (max and sum, then sum of exp): 2 + 2;
    # backward reads the saved bf16 logits and writes the bf16 gradient: 2 + 2
    x = _with(plan, ce_kernel="flash-attn-xentropy")
    assert op_cost(x, fwd).bytes == 4 * elems + tok and op_cost(x, bwd).bytes == 4 * elems + tok
    assert op_cost(x, fwd).kernels == 1 and op_cost(x, bwd).kernels == 1
    # the Triton kernel (flash-attn >= 2.2.3): one load of the row's block (vocab <= 65536): 2
    t = _with(plan, ce_kernel="flash-attn-triton")
    assert op_cost(t, fwd).bytes == 2 * elems + tok and op_cost(t, bwd).bytes == 4 * elems + tok
    # torchtitan's eager cross_entropy(pred.float()): .float() 2+4, log_softmax 3 x 4 + 4 = 22 forward
    eager = _with(plan)
    assert op_cost(eager, fwd).bytes >= 22 * elems


def test_flash_attn_cross_entropy_drops_the_fp32_copies_from_the_peak() -> None:
    plan, _, bwd = _loss_plan()
    elems = TOKENS * VOCAB
    eager = memory_per_device(_with(plan))
    fused = memory_per_device(_with(plan, ce_kernel="flash-attn-triton"))
    # at the loss grad torchtitan's loss holds the fp32 log-softmax beside the program's bf16
    # softmax (+2) and the fp32 nll and log-softmax gradients (+8); flash-attn's kernel holds the
    # bf16 logits (the program's softmax's 2) and writes the bf16 gradient (the program's): +0
    assert eager.peak_op == bwd
    assert eager.activation_peak - fused.activation_peak == 10 * elems


def test_the_loss_options_are_refused_where_the_framework_lacks_them() -> None:
    with pytest.raises(ProgramError, match=r"--cross-entropy-kernel flash-attn-triton: .*--framework torchtitan "
                                           r"only, not --framework megatron"):
        Runtime(framework="megatron", ce_kernel="flash-attn-triton")
    with pytest.raises(ProgramError, match="not --framework automodel"):
        Runtime(framework="automodel", ce_kernel="flash-attn-xentropy")
    with pytest.raises(ProgramError, match=r"--cross-entropy-fusion: .*--framework megatron only, not --framework "
                                           r"torchtitan"):
        Runtime(framework="torchtitan", ce_fusion=True)
    with pytest.raises(ProgramError, match=r"--cross-entropy-kernel 'liger': expected one of flash-attn-xentropy, "
                                           "flash-attn-triton, compiled"):
        Runtime(framework="torchtitan", ce_kernel="liger")
    assert issubclass(ProgramError, SpmdError)
    err = io.StringIO()
    argv = ["plan", "--model", "llama-7b", "--layers", "1", "--mesh", "dp=1", "--strategy", "dp",
            "--framework", "megatron", "--cross-entropy-kernel", "flash-attn-triton", "--json"]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) != 0
    assert "--cross-entropy-kernel flash-attn-triton" in err.getvalue()


def test_the_cli_option_reaches_the_plan() -> None:
    peaks = {}
    for kernel in ([], ["--cross-entropy-kernel", "flash-attn-xentropy"]):
        buf = io.StringIO()
        argv = ["plan", "--model", "llama-7b", "--layers", "1", "--seq", "1024", "--batch", "2", "--mesh", "dp=1",
                "--strategy", "dp", "--framework", "torchtitan", "--device", "h100", "--json", *kernel]
        with contextlib.redirect_stdout(buf):
            assert main(argv) == 0
        peaks[len(kernel)] = json.loads(buf.getvalue())["memory"]["activation_peak"]
    # llama-7b's vocab 32000, 2 x 1024 tokens: the 10 bytes a logit of torchtitan's fp32 loss at its grad
    assert peaks[0] - peaks[2] == 10 * 2 * 1024 * 32000
