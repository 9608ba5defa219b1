"""Context parallelism (``--strategy ...,cp``, docs/context.md): the sequence over a cp mesh dim.

The cp_attention rules per variant (hand-checked answers), their soundness over generated cases
and the simulator's refusal of deliberately wrong ones (an all-gather that does not gather, a
causal kernel without positions), the strategy's errors, the zig-zag layout (the permuted step
equals the plain model's), whole plans simulated (--verify) and runs on 4 gloo processes
against the single-process step."""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from spmd_helpers import T, dms
from spmdkit.core.dist_attr import ReduceType, TensorDistAttr
from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import SpmdResult
from spmdkit.engine.facts import facts_of
from spmdkit.engine.registry import get_rule
from spmdkit.execute.single import global_step
from spmdkit.models.zoo import build_model, preset
from spmdkit.models.zoo_layers import cp_order
from spmdkit.outputs.export import dtensor_document
from spmdkit.planner.planning import plan_model, plan_program
from spmdkit.planner.propagate import propagate
from spmdkit.sim import verify, verify_rule
from spmdkit.sim.plan import simulate_plan, source_values
from spmdkit.sim.verify_plan import verify_strategy

ROOT = Path(__file__).resolve().parents[1]
M = ProcessMesh([2, 2], dim_names=["cp", "tp"])
CPA = get_rule("cp_attention")
CPG = get_rule("cp_attention_grad")
QWEN = {"base": "tiny-llama", "qkv_bias": True, "kv_heads": 2, "name": "tiny-qwen2"}
SUM = ((0, ReduceType.SUM),)


def _qkv(hk: int = 2) -> tuple[Any, ...]:
    """q [2, 8, 4, 4], k / v with ``hk`` kv heads, all sequence over cp and heads over tp."""
    dm = [-1, 0, 1, -1]
    return (T(M, [2, 8, 4, 4], dm), T(M, [2, 8, hk, 4], dm), T(M, [2, 8, hk, 4], dm), T(M, [8], [0]),
            T(M, [8], [0]))


# -- the rules -----------------------------------------------------------------------------------


def test_allgather_keeps_q_on_the_sequence_and_gathers_k_and_v() -> None:
    r = CPA.infer_forward(*_qkv(), True, "allgather", "zigzag")
    assert dms(r.inputs) == [(-1, 0, 1, -1), (-1, -1, 1, -1), (-1, -1, 1, -1), (0,), (-1,)]
    assert dms(r.outputs) == [(-1, 0, 1, -1), (-1, 1, 0)]


def test_allgather_grad_gives_k_and_v_grads_partial_over_the_query_sequence() -> None:
    q, k, v, qp, kp = _qkv()
    out, lse = T(M, [2, 8, 4, 4], [-1, 0, 1, -1]), T(M, [2, 4, 8], [-1, 1, 0])
    r = CPG.infer_forward(q, k, v, out, lse, qp, kp, out, True, "allgather", "zigzag")
    assert dms(r.outputs) == [(-1, 0, 1, -1), (-1, -1, 1, -1), (-1, -1, 1, -1)]
    assert [a.partial for a in r.outputs] == [(), SUM, SUM]


def test_ring_keeps_q_k_v_and_both_positions_on_the_sequence() -> None:
    r = CPA.infer_forward(*_qkv(), True, "ring", "zigzag")
    assert dms(r.inputs) == [(-1, 0, 1, -1)] * 3 + [(0,), (0,)]
    q, k, v, qp, kp = _qkv()
    out, lse = T(M, [2, 8, 4, 4], [-1, 0, 1, -1]), T(M, [2, 4, 8], [-1, 1, 0])
    g = CPG.infer_forward(q, k, v, out, lse, qp, kp, out, True, "ring", "zigzag")
    assert dms(g.outputs) == [(-1, 0, 1, -1)] * 3 and not any(a.partial for a in g.outputs)


def test_alltoall_moves_the_sequence_onto_the_heads_minor_to_tp() -> None:
    r = CPA.infer_forward(*_qkv(hk=4), True, "alltoall", "zigzag")
    assert dms(r.inputs) == [(-1, -1, (1, 0), -1)] * 3 + [(-1,), (-1,)]
    assert dms(r.outputs) == [(-1, -1, (1, 0), -1), (-1, (1, 0), -1)]


def test_ring_fact_names_the_blocks_the_kernel_passes() -> None:
    """cost/ reads this: the forward rings k, v and their positions on axis 1; the grad also dK, dV."""
    f, g = facts_of("cp_attention").ring, facts_of("cp_attention_grad").ring
    assert f is not None and g is not None
    assert (f.blocks, f.axis, f.grads) == (("k", "v", "k_positions"), 1, ())
    assert g.grads == ("k_grad", "v_grad")
    assert f.applies({"variant": "ring"}) and not f.applies({"variant": "allgather"})


@pytest.mark.parametrize("rule", ["cp_attention", "cp_attention_grad"])
def test_generated_cases_are_sound(rule: str) -> None:
    rep = verify_rule(rule, n=40, seed=3)
    assert rep.cases == 40 and rep.sound == 40, rep.first_unsound


def _case(rule: str, args: list[Any]) -> dict[str, Any]:
    return {"rule": rule, "mesh": [2], "mode": "forward", "args": args}


def _a(dm: list[int]) -> TensorDistAttr:
    return TensorDistAttr(ProcessMesh([2]), dm)


def test_an_allgather_that_does_not_gather_is_caught() -> None:
    """Each rank attending only its own block of keys (k, v left on the sequence) is unsound."""
    seq = {"dims_mapping": [-1, 0, -1, -1]}
    case = _case("cp_attention", [{"shape": [1, 8, 2, 2], **seq}, {"shape": [1, 8, 2, 2], **seq},
                                  {"shape": [1, 8, 2, 2], **seq}, {"shape": [8], "dims_mapping": [0]},
                                  {"shape": [8], "dims_mapping": [0]}, True, "allgather", "zigzag"])
    assert verify(None, case).status == "sound"  # the rule's own answer gathers k and v
    wrong = SpmdResult([_a([-1, 0, -1, -1])] * 3 + [_a([0]), _a([0])], [_a([-1, 0, -1, -1]), _a([-1, -1, 0])])
    assert verify(None, case, result=wrong).status == "unsound"


def test_causal_flash_attention_without_positions_on_a_split_sequence_is_caught() -> None:
    """flash_attention masks from position 0 on every rank: its queries sequence-sharded, k and v
    whole, it is wrong on rank 1 (why cp needs cp_attention's positions)."""
    case = _case("flash_attention", [{"shape": [1, 8, 2, 2], "dims_mapping": [-1, 0, -1, -1]},
                                     {"shape": [1, 8, 2, 2], "dims_mapping": [-1, -1, -1, -1]},
                                     {"shape": [1, 8, 2, 2], "dims_mapping": [-1, -1, -1, -1]}, None, None,
                                     0.0, True, False, False])
    wrong = SpmdResult([_a([-1, 0, -1, -1]), _a([-1, -1, -1, -1]), _a([-1, -1, -1, -1]), None, None],
                       [_a([-1, 0, -1, -1]), None, _a([-1, -1, 0]), _a([-1])])
    assert verify(None, case, result=wrong).status == "unsound"


# -- the strategy ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("mesh", "strategy", "msg"), [
    ("dp=2,tp=2", "dp,cp", "--strategy cp: the mesh has no 'cp' dim (mesh dims: dp, tp)"),
    ("cp=8", "cp", "--mesh cp=8: the sequence of 8 tokens does not split into 2 x cp = 16 chunks (the zig-zag "
                   "balance)"),
    ("cp=2,tp=2", "megatron,cp,cp-attention=alltoall", "--mesh cp=2: --cp-attention alltoall moves the sequence "
                                                       "onto the heads: cp x tp = 4 does not divide the model's 2 kv heads"),
    ("dp=2,tp=2", "megatron,cp-attention=ring", "--cp-attention ring: context parallelism is not asked for (add cp "
                                                "to --strategy and a cp dim to --mesh)"),
    ("cp=2", "cp,cp-attention=mesh", "--cp-attention 'mesh': not one of allgather, ring, alltoall"),
    # a cp dim of one rank: the option was accepted and changed nothing
    ("dp=2,cp=1", "dp,cp,cp-attention=ring", "--cp-attention ring: --mesh cp=1 splits no sequence, so no attention is "
                                             "split for it to run; give a cp dim of 2 or more"),
], ids=["no-cp-dim", "sequence", "alltoall-heads", "option-without-cp", "unknown-variant", "cp-of-one"])
def test_errors_name_the_flag_value_and_what_is_wrong(mesh: str, strategy: str, msg: str) -> None:
    with pytest.raises(ProgramError) as e:
        plan_model("tiny-llama", mesh, strategy)
    assert str(e.value) == msg


def test_cli_error_is_one_line_exit_2() -> None:
    p = _spmdkit("plan", "--model", "tiny-llama", "--mesh", "cp=8", "--strategy", "cp", "--cp-attention", "ring")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "--mesh cp=8: the sequence of 8 tokens does not split into 2 x cp = 16 chunks" in p.stderr


def test_zigzag_order_gives_rank_i_chunks_i_and_mirror() -> None:
    cfg = preset("tiny-llama").with_(seq=16, cp=2)
    assert cp_order(cfg) == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    assert cp_order(cfg.with_(cp_balance="none")) == list(range(16))


def test_the_zigzag_step_equals_the_plain_model_on_the_same_tokens() -> None:
    """The cp program (tokens laid out in zig-zag order, each with its position; rope's rows and
    cp_attention's mask from the positions) on the permuted tokens and labels: the loss, every
    parameter gradient and update equal the plain model's (flash_attention) on the tokens in order."""
    base = preset("tiny-llama").with_(seq=8)
    plain = build_model(base)
    zig = build_model(base.with_(cp=2))
    order = cp_order(base.with_(cp=2))
    assert order == [0, 1, 6, 7, 2, 3, 4, 5]
    assert any(op.rule == "cp_attention" for op in zig.program.ops)
    assert not any(op.rule == "cp_attention" for op in plain.program.ops)
    vals = source_values(plain.program, seed=5)
    given = {n: v for n, v in vals.items() if n in zig.program.tensors and n not in ("rope.sin", "rope.cos")}
    given["tokens"] = vals["tokens"][:, order]
    given["labels"] = vals["labels"][:, order]
    mesh = ProcessMesh([1], dim_names=["dp"])
    a = global_step(propagate(plain.program, mesh, {}), 0, vals)
    b = global_step(propagate(zig.program, mesh, {}), 0, given)
    assert b["loss"] == pytest.approx(float(a["loss"]), rel=1e-12)
    assert len(plain.optimizer) == 21  # 2 layers x 9, the embedding, the final norm, the head
    for p, (grad, _, new, _) in plain.optimizer.items():
        np.testing.assert_allclose(b[grad], a[grad], rtol=1e-10, atol=1e-12, err_msg=p)
        np.testing.assert_allclose(b[new], a[new], rtol=1e-10, atol=1e-12, err_msg=p)
    np.testing.assert_allclose(b["final_norm.out"], a["final_norm.out"][:, order], rtol=1e-10)


def _kinds(plan: Any) -> collections.Counter[tuple[str, str]]:
    names = plan.mesh.dim_names
    return collections.Counter((s.kind, "x".join(names[d] for d in s.mesh_dims)) for r in plan.reshards
                               for s in r.plan.steps if s.kind != "slice")


def test_allgather_plan_gathers_k_and_v_and_reduce_scatters_their_grads() -> None:
    """tiny-llama (2 layers) on dp=2,cp=2: per layer k and v all-gathered over cp in the forward
    (listed again for the backward, shared: not issued again), their grads reduce-scattered; each parameter gradient all-reduced
    once over dp x cp (21 parameters)."""
    _, plan, _ = plan_model("tiny-llama", "dp=2,cp=2", "dp,cp")
    assert _kinds(plan) == {("all_gather", "cp"): 8, ("reduce_scatter", "cp"): 4, ("all_reduce", "dpxcp"): 21}
    assert sum(1 for r in plan.reshards if r.shared) == 4  # the backward's k, v: the forward's gathers reused
    assert plan.attrs["tokens"].dims_mapping == (0, 1)
    assert plan.attrs["layers.0.mlp_norm.out"].dims_mapping[:2] == (0, 1)


def test_ring_plan_moves_nothing_but_the_gradients() -> None:
    _, plan, _ = plan_model("tiny-llama", "dp=2,cp=2", "dp,cp,cp-attention=ring")
    assert _kinds(plan) == {("all_reduce", "dpxcp"): 21}


def test_alltoall_plan_trades_sequence_for_heads() -> None:
    """Per layer 8 all-to-alls over cp issued: forward q, k, v to heads and out back (4);
    backward out_grad to heads and the three grads back (4). The grad reads q, k, v and out as
    the forward had them in head layout (shared): out is the kernel's own output, kept for its
    grad as DeepSpeed-Ulysses' local attention and Transformer Engine's AttnFuncWithCPAndQKVOA2A
    (``out_part``, since 789c6ca63) keep it; it was traded back to the heads again (5 a layer)."""
    _, plan, _ = plan_model("tiny-llama", "dp=2,cp=2", "dp,cp,cp-attention=alltoall")
    issued = [r for r in plan.reshards if not r.shared and r.plan.steps[0].kind == "all_to_all"]
    by_phase = collections.Counter(plan.program.ops[r.op_index].phase for r in issued)
    assert by_phase == {"forward": 8, "backward": 8}
    assert {s.mesh_dims for r in issued for s in r.plan.steps} == {(1,)}
    assert set(_kinds(plan)) == {("all_to_all", "cp"), ("all_reduce", "dpxcp")}
    grads = [op for op in plan.program.ops if op.rule == "cp_attention_grad"]
    shared = {(r.tensor, plan.program.ops[r.op_index].rule) for r in plan.reshards if r.shared}
    assert shared == {(op.inputs[p], "cp_attention_grad") for op in grads for p in ("q", "k", "v", "out")}
    backward = sorted(r.tensor for r in issued if plan.program.ops[r.op_index].phase == "backward")
    assert backward == sorted(n for op in grads for n in (op.inputs["out_grad"], *op.outputs[:3]))


def test_alltoall_holds_the_head_layout_output_for_its_grad() -> None:
    """The head-layout output kept for the grad is memory: each layer's local out in head layout
    (out [4, 8, 4, 4] float32 as [b/dp, s, h/cp, d] = 2 x 8 x 2 x 4 x 4 B = 512 bytes) held from
    the forward to the backward: the peak (at the backward's start) 2 x 512 above the ring plan's,
    which holds the same otherwise (equal before the copy was kept)."""
    from spmdkit.cost.memory import local_numel, memory_per_device

    _, a2a, _ = plan_model("tiny-llama", "dp=2,cp=2", "dp,cp,cp-attention=alltoall")
    _, ring, _ = plan_model("tiny-llama", "dp=2,cp=2", "dp,cp,cp-attention=ring")
    prog = a2a.program
    out = [r for r in a2a.reshards if r.output and prog.ops[r.op_index].rule == "cp_attention"]
    assert len(out) == 2
    each = {local_numel(r.src, prog.tensors[r.tensor].shape) * prog.tensors[r.tensor].itemsize for r in out}
    assert each == {512}
    assert memory_per_device(a2a).activation_peak - memory_per_device(ring).activation_peak == 2 * 512
    # recomputed (full): the attention runs again right before its grad, nothing is held across
    assert memory_per_device(a2a, "full").activation_peak == memory_per_device(ring, "full").activation_peak


def test_zero_shards_the_states_over_dp_x_cp_with_one_collective_each_way() -> None:
    """As Megatron-Core's distributed optimizer: the states over the (dp, cp) ranks, each gradient
    reduce-scattered over dp x cp at once and the updated parameter all-gathered back; without a
    dp dim over cp alone."""
    _, plan, _ = plan_model("tiny-llama", "dp=2,cp=2", "dp,cp,zero2")
    assert plan.attrs["layers.0.wq.moment1"].dims_mapping == ((0, 1), -1)
    assert plan.attrs["layers.0.wq.grad"].dims_mapping == ((0, 1), -1)
    assert _kinds(plan)[("reduce_scatter", "dpxcp")] == 21 and _kinds(plan)[("all_gather", "dpxcp")] == 21
    _, plan, _ = plan_model("tiny-llama", "cp=2,tp=2", "megatron,cp,zero1")
    assert plan.attrs["layers.0.w_up.moment1"].dims_mapping == (0, 1)


@pytest.mark.parametrize(("mesh", "strategy"), [
    ("cp=2,tp=2", "megatron,cp,zero1"),
    ("dp=2,cp=2", "dp,cp"),
    ("dp=2,cp=2", "dp,cp,cp-attention=ring"),
    ("dp=2,cp=2", "dp,cp,cp-attention=alltoall"),
    ("dp=2,cp=2", "dp,cp,cp-balance=none"),
    ("cp=2,tp=2", "megatron,cp,cp-attention=ring"),
    ("cp=2,tp=2", "megatron,sp,cp"),
    ("dp=2,cp=2", "dp,cp,zero3,cp-attention=ring"),
    ("cp=2,tp=2", "megatron,cp,cp-attention=alltoall"),
], ids=["megatron-zero1", "allgather", "ring", "alltoall", "no-balance", "megatron-ring", "sp", "zero3-ring", "megatron-alltoall"])
def test_verify_simulates_the_strategy_equal_to_the_unsharded_step(mesh: str, strategy: str) -> None:
    rep = verify_strategy("tiny-llama", mesh, strategy)
    assert rep["ok"] and rep["checked"] > 200, rep["text"]


def test_gpt2_learned_positions_and_eager_attention_under_cp() -> None:
    """gpt2 (eager attention: the scores' matmuls gather k and v as allgather does; its causal mask
    and learned positions recorded in zig-zag order) simulated equal; ring refused for eager."""
    _, plan, _ = plan_model("tiny-gpt2", "dp=2,cp=2", "dp,cp")
    assert plan.attrs["positions"].dims_mapping == (0, 1) and plan.attrs["causal_mask"].dims_mapping == (-1, -1, 1, -1)
    assert simulate_plan(plan).ok
    with pytest.raises(ProgramError, match="--cp-attention ring: the model's attention is eager"):
        plan_model("tiny-gpt2", "dp=2,cp=2", "dp,cp,cp-attention=ring")


# -- on gloo ---------------------------------------------------------------------------------------


def _spmdkit(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, "-m", "spmdkit", *args], capture_output=True, text=True, env=env,
                          timeout=400)


@pytest.mark.parametrize(("model", "mesh", "variant", "kernels"), [
    (["--model", "tiny-llama", "--seq", "16"], "cp=4", "ring", "torch"),
    (["--model-config", json.dumps(QWEN)], "dp=2,cp=2", "allgather", "numpy"),
    (["--model-config", json.dumps(QWEN)], "dp=2,cp=2", "alltoall", "torch"),
    (["--model", "tiny-llama"], "cp=2,tp=2", "ring", "numpy"),
], ids=["llama-ring-of-4-torch", "qwen-allgather", "qwen-alltoall-torch", "llama-megatron-ring"])
def test_run_on_gloo_equals_the_single_process_step(model: list[str], mesh: str, variant: str, kernels: str) -> None:
    """4 gloo processes: loss, every gradient, update and activation equal the single-process
    step (numpy: float64 references; torch: each op against its kernel run unsharded); every
    rank issued the plan's collectives (the ring's send / recv are the kernel's own: a ring of 4
    checks their direction)."""
    strategy = "megatron,cp" if "tp=" in mesh else "dp,cp" if "dp=" in mesh else "cp"
    p = _spmdkit("run", *model, "--mesh", mesh, "--strategy", strategy, "--cp-attention", variant, "--kernels", kernels,
                 "--json", "--warmup", "0", "--timeout", "120")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["world_size"] == 4 and rep["backend"] == "gloo"
    assert rep["ok"] and rep["collectives_match"] and not rep["failures"] and rep["nonfinite"] == 0, rep["failures"]
    assert rep["loss"] == pytest.approx(rep["reference_loss"], rel=1e-6)
    kinds = {c["kind"] for c in rep["collectives"]}
    assert ("all_to_all" in kinds) == (variant == "alltoall") and ("all_gather" in kinds) == (variant == "allgather")


def test_run_reports_as_moved_only_what_a_reshard_delivered() -> None:
    """cp alltoall on 2 gloo ranks (torch kernels): each layer's attention output is traded from
    the head layout (its op's, [-1, -1, cp, -1]) onto the sequence ([-1, cp, -1, -1]) by an
    all-to-all, and its grad reads the op's own head-layout copy, kept (commit ad484e2). The
    report's reshards (``moved``, each checked against the value it moved) list the all-to-all's
    result once and not the kept copy, which nothing delivered; the grad is still checked on it."""
    p = _spmdkit("run", "--model", "tiny-llama", "--mesh", "cp=2", "--strategy", "cp", "--cp-attention", "alltoall",
                 "--kernels", "torch", "--json", "--warmup", "0", "--timeout", "120")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["ok"] and not rep["failures"], rep["failures"]
    attn = sorted((n, a.split("), ")[1]) for n, a in rep["moved"] if n in ("layers.0.attn", "layers.1.attn"))
    assert attn == [("layers.0.attn", "[-1, 0, -1, -1])"), ("layers.1.attn", "[-1, 0, -1, -1])")]
    assert len({(n, a) for n, a in rep["moved"]}) == len(rep["moved"])
    # every tensor checked op by op as before the kept copies left ``moved`` (231: the 6 outputs of
    # the two attention grads, which read the kept copies, skipped unchecked)
    assert rep["checked"] == 237


def test_the_docs_command_plans_as_the_page_says() -> None:
    text = (ROOT / "docs" / "context.md").read_text()
    cmd = next(line for line in text.splitlines() if line.startswith("spmdkit plan "))
    p = _spmdkit(*cmd.split()[1:])
    assert p.returncode == 0, p.stderr[-2000:]
    assert "all equal" in p.stdout


def test_dtensor_export_says_how_torch_context_parallel_runs_it() -> None:
    """allgather and ring map onto torch's rotate methods, with the data inputs' sequence axes as
    its buffers; alltoall (Ulysses) is said to have no torch equivalent; no key without cp."""
    _, plan, _ = plan_model("tiny-llama", "dp=2,cp=2", "dp,cp,cp-attention=ring")
    doc = dtensor_document(plan)["context_parallel"]
    assert doc["supported"] and doc["rotate_method"] == "alltoall" and doc["load_balance"]
    assert doc["buffers"] == {"labels": 1, "rope.cos": 1, "rope.sin": 1, "tokens": 1}
    _, plan, _ = plan_model("tiny-llama", "dp=2,cp=2", "dp,cp")
    assert dtensor_document(plan)["context_parallel"]["rotate_method"] == "allgather"
    _, plan, _ = plan_model("tiny-llama", "dp=2,cp=2", "dp,cp,cp-attention=alltoall,cp-balance=none")
    doc = dtensor_document(plan)["context_parallel"]
    assert not doc["supported"] and "DeepSpeed-Ulysses" in doc["note"] and not doc["load_balance"]
    _, plan, _ = plan_model("tiny-llama", "dp=2", "dp")
    assert "context_parallel" not in dtensor_document(plan)


def test_an_imported_program_is_refused_under_cp_by_name() -> None:
    """A program without cp_attention (not imported for cp: --hf with --strategy ...,cp is,
    tests/test_hf_cp.py) is refused on a cp mesh."""
    prog = build_model(preset("tiny-llama")).program
    with pytest.raises(ProgramError) as e:
        plan_program(prog, "dp=2,cp=2", "dp,cp")
    assert str(e.value) == ("--mesh cp=2: the imported program has no cp_attention (import it with cp: "
                            "--strategy ...,cp on --hf)")


def test_a_pipeline_stage_stashes_the_head_layout_output_per_microbatch(capsys: pytest.CaptureFixture[str]) -> None:
    """The head-layout output alltoall keeps for its grad (above) is kept by every microbatch in
    flight, not only by the one whose curve is the working peak: a stage of one tiny-llama layer
    (microbatch 2 of batch 8, [2, 8, 2, 4] float32 = 512 bytes) stashes 512 bytes more than the
    ring plan's, as its working peak holds 512 more; under full recompute nothing more (the
    attention runs again right before its grad). It was stashed as the ring plan's (the copy held
    in the working curve only)."""
    from spmdkit.cli import main

    def stages(attention: str, recompute: str) -> list[tuple[int, int]]:
        assert main(["plan", "--model", "tiny-llama", "--mesh", "pp=2,cp=2", "--strategy",
                     f"cp,cp-attention={attention}", "--microbatches", "4", "--batch", "8",
                     "--recompute", recompute, "--json"]) == 0
        return [(s["stash_bytes"], s["working_peak"]) for s in json.loads(capsys.readouterr().out)["pipeline"]["stages"]]

    a2a, ring = stages("alltoall", "none"), stages("ring", "none")
    assert [(a[0] - r[0], a[1] - r[1]) for a, r in zip(a2a, ring)] == [(512, 512), (512, 512)]
    assert [a[0] for a in stages("alltoall", "full")] == [a[0] for a in stages("ring", "full")]


def test_a_layout_change_over_one_rank_is_not_a_kept_copy() -> None:
    """An annotated output resharded after its op only over a mesh dim of one rank (``dp`` in the
    strategy of a ``dp=1`` mesh: a residual add's output made batch-sharded over that rank, a
    layout change that makes no copy) is the op's output itself, not a copy of its own kept for a
    later reader of the op's layout, as alltoall's head-layout output is: a ring cp plan stashes
    none (the Megatron-MoE-ModelZoo Qwen3-235B cp8 rows, so planned: 57.1 GiB; counted as copies,
    63.3; here 131,072 bytes a stage, one [32, 2048] bf16 residual)."""
    from spmdkit.cost.memory import output_copies, stashed_output_copies
    from spmdkit.cost.memory_fsdp2 import makes_no_copy
    from spmdkit.cost.memory_saved import saved_activations
    from spmdkit.planner.pipeline_plan import plan_pipeline
    from spmdkit.planner.pipeline_split import op_stages

    _, plan, _spec, counts, _ = plan_pipeline("qwen3-30b-a3b", "pp=2,dp=1,cp=2,ep=2,tp=2",
                                              "dp,ep,megatron,sp,cp,zero1,etp=1,cp-attention=ring,ep-from=cp",
                                              {"microbatches": 4}, {"layers": 2, "batch": 4, "seq": 256})
    same = {r.tensor for r in plan.reshards if r.output and plan.annotations.get(r.tensor) == r.dst
            and makes_no_copy(plan, r)}
    assert {"layers.0.resid1", "layers.0.resid2"} <= same
    saved = saved_activations(plan, "none")
    assert not same & {n for n, _ in output_copies(plan, saved)}
    assert stashed_output_copies(plan, saved, op_stages(plan.program, counts)) == {}


def test_a_norm_output_kept_as_its_shard_is_not_kept_again_for_a_reader_of_the_shard() -> None:
    """Sequence parallelism's norm output is all-gathered after its op and kept for the backward as
    its shard, gathered again there (Megatron saves the sharded input; memory_saved.saved_activations'
    ``regathered``): DeepSeek-V2-Lite's MoE layer (megatron,sp,ep on dp=2,ep=2,tp=2; 256 tokens) keeps
    ``mlp_norm.out`` as 1 sequence x 128 tokens x 2,048 x 2 bytes = 524,288. Its router's weight
    gradient reads that shard (the norm's own layout): the same tensor, not a copy of the op's own
    held beside it as alltoall's head-layout output is (which the activation curve held from the norm
    to the router's grad, 524,288 bytes over 59 ops, and a pipeline stage would have stashed)."""
    from spmdkit.cost.memory import output_copies
    from spmdkit.cost.memory_saved import saved_activations

    _, plan, _ = plan_model("deepseek-v2-lite", "dp=2,ep=2,tp=2", "megatron,sp,ep", {"layers": 2, "seq": 256, "batch": 4})
    saved = saved_activations(plan, "none")
    n = "layers.1.mlp_norm.out"
    assert (n, 524_288) in saved.tensors["layer 1"] and n in {t for t, _ in saved.regathered}
    assert any(r.shared and r.tensor == n and plan.program.ops[r.op_index].rule == "matmul_grad" for r in plan.reshards)
    assert n not in {t for t, _ in output_copies(plan, saved)}
