"""FSDP2's float8 all-gather (``--fsdp-float8-all-gather``, torchao ``torchao/float8/fsdp_utils.py``):
each fp8 linear's fp32 shard cast to float8 before FSDP2 gathers it, the gathered weight 1 byte an
element in the all-gather, the all-gather buffers and the unsharded copy, no cast of it in the
GEMM, the amax precomputed over the shards after the optimizer. Byte counts by hand, and where the
option applies."""

from __future__ import annotations

import contextlib
import io
from dataclasses import replace

import pytest

from spmdkit.cli import main
from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.cost import memory as mem
from spmdkit.cost.compute import fp8_gathered, fp8_weights, op_cost
from spmdkit.cost.devices import DEVICES, cost_model, recost
from spmdkit.cost.memory_fsdp2 import copy_in_pool
from spmdkit.cost.step_comm import communication
from spmdkit.cost.step_compute import step_compute
from spmdkit.planner.pipeline import PipelineEstimate
from spmdkit.planner.planning import plan_model
from spmdkit.planner.search import Config, config_candidates
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import Runtime

H100 = DEVICES["h100"]
DP = 4
HIDDEN, FFN = 256, 512
SMALL = {"layers": 2, "hidden": HIDDEN, "heads": 4, "kv_heads": 4, "ffn": FFN, "vocab": 4096, "seq": 128, "batch": 4}


def _plans(strategy: str = "dp,zero3") -> tuple[Plan, Plan]:
    """(without, with the option): torchtitan, fp8, compiled, FSDP over 4 ranks."""
    _, plan, _ = plan_model("llama-7b", f"dp={DP}", strategy, SMALL)
    plan = recost(plan, cost_model(plan.mesh, H100))
    base = Runtime(precision="fp8", framework="torchtitan", compile=True)
    return replace(plan, runtime=base), replace(plan, runtime=replace(base, fsdp_float8_all_gather=True))


def _wq(plan: Plan) -> tuple[str, int, int, int]:
    """(the first block's wq, its forward GEMM, its grad, its optimizer op)."""
    ops = plan.program.ops
    w = next(n for n in sorted(fp8_weights(plan.program)) if n.startswith("layers.0") and "wq" in n)
    fwd = next(i for i, op in enumerate(ops) if op.phase == "forward" and w in op.input_names())
    bwd = next(i for i, op in enumerate(ops) if op.phase == "backward" and w in op.input_names())
    opt = next(i for i, op in enumerate(ops) if op.phase == "optimizer" and w in op.input_names())
    return w, fwd, bwd, opt


def test_the_gathered_weights_are_the_sharded_fp8_ones() -> None:
    off, on = _plans()
    assert fp8_gathered(off) == frozenset()
    got = fp8_gathered(on)
    # every linear of the blocks (wq wk wv wo w1 w2 w3), not the output head (kept in bf16) nor the embedding
    assert got == fp8_weights(on.program) and len(got) == 2 * 7
    assert not any("output" in n or "embed" in n for n in got)


def test_the_casts_move_to_the_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    off, on = _plans()
    w, fwd, bwd, opt = _wq(on)
    assert on.program.tensors[w].shape == (HIDDEN, HIDDEN)
    shard = HIDDEN * HIDDEN // DP
    a, b = op_cost(off, fwd), op_cost(on, fwd)
    # forward: torchao's cast of the gathered bf16 weight in the GEMM (amax read 2, cast read 2 write 1:
    # 5 a weight element, spmdkit.cost.torchao_casts; 4 when priced as Transformer Engine's) becomes
    # fsdp_pre_all_gather's cast of the fp32 shard (read 4, write 1: 5 a shard element)
    assert a.cast_bytes - b.cast_bytes == 5 * HIDDEN * HIDDEN - 5 * shard
    # backward: the re-gather's cast of the shard, beside the output gradient's cast
    assert op_cost(on, bwd).cast_bytes - op_cost(off, bwd).cast_bytes == 5 * shard
    # after the optimizer: precompute_float8_dynamic_scale_for_fsdp's foreach inf-norm over the fp32 shard
    assert op_cost(on, opt).bytes - op_cost(off, opt).bytes == 4 * shard


def test_the_all_gathers_move_one_byte_an_element() -> None:
    off, on = _plans()
    w, _, _, _ = _wq(on)
    comm = {p.runtime.fsdp_float8_all_gather: communication(p, step_compute(p, H100), H100) for p in (off, on)}
    per_off = {k: v for g in comm[False].gathers.values() for k, v in g.items() if k[0] == w}
    per_on = {k: v for g in comm[True].gathers.values() for k, v in g.items() if k[0] == w}
    assert per_off and per_off.keys() == per_on.keys()
    for key, b in per_off.items():
        # each gather's buffer: the whole bf16 weight (2 a element) -> its float8 bytes (1)
        assert per_on[key] == pytest.approx(b / 2)
    assert max(per_on.values()) == pytest.approx(HIDDEN * HIDDEN * 1)


def test_the_gathered_copies_are_held_in_fp8() -> None:
    off, on = _plans()
    # FSDP2's copy-in stream keeps two consecutive groups' all-gather buffers, here the root group's
    # (embedding, output head, final norm: bf16 either way) and the first block's: its 7 linears
    # (4 h^2 + 3 h f) at 2 bytes an element, then at 1
    block = 4 * HIDDEN * HIDDEN + 3 * HIDDEN * FFN
    assert copy_in_pool(off) - copy_in_pool(on) == block
    # the unsharded copies held in the activations' walk: at most two blocks' fp8 linears less
    a, b = mem.memory_per_device(off, "none"), mem.memory_per_device(on, "none")
    assert 0 < a.activation_peak - b.activation_peak <= 2 * block
    assert a.parameters == b.parameters  # the fp32 shards stay as they are


def test_the_option_is_refused_where_it_does_not_apply() -> None:
    with pytest.raises(ProgramError, match=r"--fsdp-float8-all-gather: .*needs --precision fp8 and --framework "
                                           r"torchtitan \(given: --precision bf16, --framework torchtitan\)"):
        Runtime(precision="bf16", framework="torchtitan", fsdp_float8_all_gather=True)
    with pytest.raises(ProgramError, match=r"\(given: --precision fp8, --framework megatron\)"):
        Runtime(precision="fp8", framework="megatron", fsdp_float8_all_gather=True)
    _, on = _plans("dp")  # DDP: nothing stored sharded, nothing gathered
    with pytest.raises(ProgramError, match=r"--fsdp-float8-all-gather: the plan stores no parameter sharded"):
        fp8_gathered(on)
    assert issubclass(ProgramError, SpmdError)
    err = io.StringIO()
    argv = ["plan", "--model", "llama-7b", "--layers", "1", "--mesh", "dp=2", "--strategy", "dp,zero3",
            "--framework", "torchtitan", "--fsdp-float8-all-gather", "--json"]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) != 0
    assert "--fsdp-float8-all-gather" in err.getvalue()


def test_the_option_is_refused_where_fsdp_shards_over_cp_alone() -> None:
    # torchtitan/float8.py at 9dec370 (Float8Handler): enable_fsdp_float8_all_gather =
    # parallel_dims.dp_shard_enabled and float8_config.enable_fsdp_float8_all_gather, so a mesh whose
    # dp_shard is 1 (FSDP over the cp ranks alone) gathers in bf16 whatever the toml says
    argv = ["plan", "--model", "llama-7b", "--layers", "1", "--strategy", "dp,cp,zero3", "--precision", "fp8",
            "--framework", "torchtitan", "--fsdp-float8-all-gather", "--json"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main([*argv[:5], "--mesh", "dp=1,cp=2", *argv[5:]]) != 0
    assert "ProgramError: --fsdp-float8-all-gather: the mesh has dp = 1; torchtitan gathers in float8 only where " \
        "FSDP's dp_shard degree is over 1" in err.getvalue()
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        assert main([*argv[:5], "--mesh", "dp=2,cp=2", *argv[5:]]) == 0


def test_a_pipeline_stage_holds_its_gathered_fp8_weights_at_one_byte() -> None:
    # torchtitan under a pipeline keeps each stage's parameters gathered all step (apply_fsdp:
    # reshard_after_forward=False when pp is enabled): llama-7b's 4 layers on pp = 2 x dp = 64, 2 blocks a
    # stage, each block's 7 linears (4 h^2 + 3 h f, h 4096, f 11008) gathered whole at 1 byte, not 2
    got = {}
    for on in (False, True):
        rt = Runtime(precision="fp8", framework="torchtitan", compile=True, fsdp_float8_all_gather=on)
        c = config_candidates("llama-7b", Config(64, 1, 2, "megatron,zero3", "none", microbatches=16), "h100",
                              overrides={"layers": 4, "seq": 256, "batch": 64 * 16}, runtime=rt)[0]
        assert isinstance(c.estimate, PipelineEstimate)
        got[on] = c.estimate.stages
    h, f = 4096, 11008
    for s_off, s_on in zip(got[False], got[True], strict=True):
        assert s_off.unsharded_parameters - s_on.unsharded_parameters == 2 * (4 * h * h + 3 * h * f)
        assert s_off.unsharded_gradients == s_on.unsharded_gradients  # fp32, unsharded, as before
