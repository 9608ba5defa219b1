"""torchtitan's compiled loss (``--cross-entropy-kernel compiled``, spmdkit.cost.loss): from 2025-04
torchtitan compiles ``cross_entropy(pred.float())`` under ``training.compile``; the min-cut partitioner
saves the bf16 logits (not the fp32 log-softmax) and Inductor runs one kernel each way. Its bytes
counted by hand, its memory against the eager loss, where it applies (``--compile``, logits not
vocab-sharded) and its errors."""

from __future__ import annotations

import contextlib
import io
from dataclasses import replace

import pytest

from spmdkit.cli import main
from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.cost import memory as mem
from spmdkit.cost.compute import op_cost
from spmdkit.planner.planning import plan_model
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import Runtime

TOKENS, VOCAB = 2 * 128, 4096
SMALL = {"layers": 1, "seq": 128, "batch": 2, "vocab": VOCAB, "hidden": 256, "heads": 4, "kv_heads": 4, "ffn": 512}


def _plan(mesh: str = "dp=1", strategy: str = "dp", **kw: object) -> tuple[Plan, int, int]:
    """llama-7b's head and loss, one layer, vocab 4096, 2 x 128 tokens under torchtitan with
    ``--compile``: (plan, the loss op, its grad)."""
    _, plan, _ = plan_model("llama-7b", mesh, strategy, SMALL)
    plan = replace(plan, runtime=Runtime(framework="torchtitan", compile=True, **kw))  # type: ignore[arg-type]
    ops = plan.program.ops
    fwd = next(i for i, op in enumerate(ops) if op.rule in mem.LOSS_RULES)
    bwd = next(i for i, op in enumerate(ops) if op.rule.startswith(ops[fwd].rule) and op.phase == "backward")
    return plan, fwd, bwd


def test_compiled_loss_bytes_by_hand() -> None:
    plan, fwd, bwd = _plan(ce_kernel="compiled")
    elems = TOKENS * VOCAB
    tok = 16 * TOKENS  # a token each way: the int64 label, the fp32 loss and log-sum-exp
    # forward: Inductor's looped reduction reads the bf16 row twice (amax, then the sum of exponentials):
    # 2 + 2; backward: exp(x - amax - lse) from the saved bf16 logits, the gradient written in bf16: 2 + 2
    assert op_cost(plan, fwd).bytes == 4 * elems + tok
    assert op_cost(plan, bwd).bytes == 4 * elems + tok
    assert op_cost(plan, fwd).kernels == 1 and op_cost(plan, bwd).kernels == 1
    # the eager loss torchtitan ran before 2025-04: .float() 2 + 4, log_softmax 3 x 4 + 4 = 22 forward
    eager, _, _ = _plan()
    assert op_cost(eager, fwd).bytes >= 22 * elems


def test_compiled_loss_saves_the_bf16_logits_not_the_fp32_log_softmax() -> None:
    plan, fwd, bwd = _plan(ce_kernel="compiled")
    eager, _, _ = _plan()
    elems = TOKENS * VOCAB
    assert mem.loss_bytes(eager, fwd) == (2, 4, 8)  # the fp32 log-softmax held, fp32 copies at each end
    assert mem.loss_bytes(plan, fwd) == (0, -2, 0)  # the bf16 logits (the program's softmax) held, no more
    got = mem.memory_per_device(plan, "none")
    base = mem.memory_per_device(eager, "none")
    # at the loss grad: 2 (held fp32 log-softmax beyond the bf16 softmax) + 8 (the fp32 nll and
    # log-softmax gradients) = 10 bytes an element less
    assert base.peak_op == bwd
    assert base.curve[bwd] - got.curve[bwd] == 10 * elems
    # at the loss forward: held 2 + forward 4 less, and no softmax beside the logits (2): 8
    assert base.curve[fwd] - got.curve[fwd] == 8 * elems


def test_vocab_sharded_logits_keep_the_loss_parallel_handlers() -> None:
    plan, fwd, bwd = _plan("tp=2", "megatron,sp", ce_kernel="compiled")
    eager, _, _ = _plan("tp=2", "megatron,sp")
    assert mem.loss_bytes(plan, fwd) == mem.LOSS_PARALLEL_BYTES["torchtitan"]
    assert op_cost(plan, fwd).bytes == op_cost(eager, fwd).bytes
    assert op_cost(plan, bwd).bytes == op_cost(eager, bwd).bytes


def test_compiled_loss_wants_compile() -> None:
    with pytest.raises(ProgramError, match=r"--cross-entropy-kernel compiled: torchtitan compiles its loss under "
                                           r"--compile only"):
        Runtime(framework="torchtitan", ce_kernel="compiled")
    with pytest.raises(ProgramError, match=r"--cross-entropy-kernel compiled: .*not --framework megatron"):
        Runtime(framework="megatron", ce_kernel="compiled")
    assert issubclass(ProgramError, SpmdError)
    err = io.StringIO()
    argv = ["plan", "--model", "llama-7b", "--layers", "1", "--mesh", "dp=1", "--strategy", "dp",
            "--framework", "torchtitan", "--no-compile", "--cross-entropy-kernel", "compiled", "--json"]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) != 0
    assert "--cross-entropy-kernel compiled" in err.getvalue()
