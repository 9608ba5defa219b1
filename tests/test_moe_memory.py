"""The memory of MoE layers and of NeMo AutoModel's runs (spmdkit.cost.memory): what one MoE
layer keeps for the backward by hand (Megatron-Core's alltoall dispatcher keeps the same
tensors; not the expert rows back, which torchtitan keeps for the gate weights' gradient), no copy counted for a ZeRO-3 gather over an expert-data-parallel dim of one rank, and
``--framework automodel``'s bytes per parameter (bf16 parameters, gradients and Adam moments) and
loss. The auxiliary load-balancing loss of the zoo's MoE layers (models/zoo_moe.py): its ops,
no collective added, dense programs unchanged, its cost and kept tensors."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from spmdkit.core.errors import ProgramError
from spmdkit.cost.compute import op_cost
from spmdkit.cost.memory import (
    LOSS_BYTES,
    activation_deltas,
    held_for_the_step,
    loss_spans,
    makes_no_copy,
    memory_per_device,
)
from spmdkit.cost.memory_saved import saved_activations, spans_with_recompute, value_spans
from spmdkit.cost.moe import moe_layers
from spmdkit.execute.single import global_step
from spmdkit.models.source import Preset, load_preset
from spmdkit.models.zoo import preset
from spmdkit.planner.planning import plan_model, plan_preset
from spmdkit.planner.propagate import propagate
from spmdkit.program.runtime import Runtime
from spmdkit.strategies.strategy import annotate, parse_mesh, parse_strategy

# Mixtral's shapes, one layer: H 4096, expert FFN 14336, 8 experts top-2; seq 64, batch 2:
# capacity C = 64 x 2 / 8 = 16 tokens an expert takes from a sequence
H, F, E, K, S, B, C = 4096, 14336, 8, 2, 64, 2, 16


def _plan(mesh: str = "dp=1,ep=2", strategy: str = "dp,ep", **sizes: int):  # type: ignore[no-untyped-def]
    return plan_preset("mixtral-8x7b", mesh, strategy, {"layers": 1, "seq": S, "batch": B, **sizes})[1]


def test_one_moe_layer_keeps_what_megatron_keeps_by_hand() -> None:
    """ep=2, dp=1: each rank holds one sequence (the batch over dp x ep) and 4 of the 8 experts,
    which receive 2 sequences x 4 experts x C = 128 token copies (the rank's 64 tokens x top-2)."""
    plan = _plan()
    saved = dict(saved_activations(plan, "none").tensors["layer 0"])
    p = "layers.0."
    tok = S  # the rank's tokens (B / ep = 1 sequence)
    recv = 2 * (E // 2) * C  # token copies its experts receive
    want = {
        "mlp_norm.out": tok * H * 2,  # the router's GEMM input (its weight gradient)
        "mlp_norm.invvar": tok * 4,
        "router.probs": tok * E * 2,  # softmax's output (its gradient)
        "dispatch": recv * H * 2,  # the permuted tokens after the all-to-all: fc1's input
        "dispatch.weights": tok * K * 2,  # the chosen gate values
        "dispatch.index": tok * K * 8,  # top-k's indices (int64, as torch.topk returns them)
        "dispatch.expert": tok * K * 8,
        "dispatch.index.t": 0,  # a transpose of dispatch.index: its storage (memory_saved.shared_storage)
        "experts.gate": recv * F * 2,  # fc1's output: SwiGLU's input
        "experts.up": recv * F * 2,
        "experts.swiglu": recv * F * 2,  # fc2's input
    }
    got = {n[len(p):]: b for n, b in saved.items() if n[len(p):] in want}
    assert got == want
    assert recv == tok * K  # uniform routing, dropless: as many copies received as sent
    # the padded buffer is held once: no other kept tensor of the expert computation (the
    # expert outputs back are not kept: test_megatron_keeps_no_expert_rows_for_the_gate_gradient)
    layer = moe_layers(plan.program)[0]
    assert {n for n in saved if n in layer.tensors} == {p + k for k in ("dispatch", "experts.gate", "experts.up",
                                                                         "experts.swiglu")}


def test_megatron_keeps_no_expert_rows_for_the_gate_gradient() -> None:
    """The expert outputs back after the return all-to-all ([tokens x top_k, H] a rank) are
    what the gate weights' gradient reads where the combine weights them (torchtitan); Megatron-
    Core weights the tokens by the probabilities in the experts' activation (experts.py,
    activation_func_with_probs) and unpermutes without them, so it keeps none: every other kept
    tensor the same, the rows live from the reshape that makes them to the combine alone."""
    plan = _plan()
    titan = replace(plan, runtime=replace(plan.runtime, framework="torchtitan"))
    rows = "layers.0.experts.rows"
    mega = saved_activations(plan, "none")
    kept = dict(mega.tensors["layer 0"])
    both = dict(saved_activations(titan, "none").tensors["layer 0"])
    assert rows not in kept
    assert both.pop(rows) == S * K * H * 2  # the rank's 64 tokens x top-2 rows of H, bf16
    assert both == kept
    made_at, _last, fwd_last = value_spans(plan.program)
    assert plan.program.ops[fwd_last[rows]].rule == "moe_combine"
    assert spans_with_recompute(plan, mega)[rows] == [(made_at[rows], fwd_last[rows], S * K * H * 2)]
    assert rows not in spans_with_recompute(titan, saved_activations(titan, "none"))
    # the step's activation curve: each layer's rows no longer held from the forward to the
    # backward, so where the backward starts (every layer's stash held) 3 layers hold 3 rows less
    three = _plan(layers=3)
    titan3 = replace(three, runtime=replace(three.runtime, framework="torchtitan"))
    start = next(i for i, op in enumerate(three.program.ops) if op.phase == "backward")

    def live(pl):  # type: ignore[no-untyped-def]
        d = activation_deltas(pl, saved_activations(pl, "none"))[0]
        return sum(b for i, b in d.items() if i <= start)

    assert live(titan3) - live(three) == 3 * S * K * H * 2


def test_a_capacity_factor_pads_the_buffers_and_only_them() -> None:
    """capacity_factor 2: C = 32, the dispatched buffer and the expert activations twice the
    dropless ones; the combined rows [S, E x C] of the rank too; the routing tensors unchanged."""
    plan = _plan()
    base = dict(saved_activations(plan, "none").tensors["layer 0"])
    assert moe_layers(plan.program)[0].capacity == C
    cfg = preset("mixtral-8x7b").with_(layers=1, seq=S, batch=B, capacity_factor=2.0)
    loaded = load_preset(Preset("mixtral-8x7b", 1, B, S), cfg)
    assert loaded.model is not None
    mesh = parse_mesh("dp=1,ep=2")
    padded = propagate(loaded.program, mesh, annotate(loaded.model, mesh, parse_strategy("dp,ep", mesh)))
    assert moe_layers(padded.program)[0].capacity == 2 * C
    got = dict(saved_activations(padded, "none").tensors["layer 0"])
    for n in ("dispatch", "experts.gate", "experts.up", "experts.swiglu"):
        assert got["layers.0." + n] == 2 * base["layers.0." + n], n
    for n in ("router.probs", "dispatch.weights", "dispatch.index", "mlp_norm.out"):
        assert got["layers.0." + n] == base["layers.0." + n], n


def test_no_copy_for_a_gather_over_one_rank() -> None:
    """ZeRO-3 with dp=1: the expert stacks are stored over ep and the (size 1) dp dim; their
    all-gather over dp moves nothing and makes no copy (FSDP2 leaves them out), so the activation
    curve is the same with those reshards removed; the dense parameters' gathers over dp x ep are
    real copies."""
    plan = _plan(strategy="dp,ep,zero3")
    stacks = set(moe_layers(plan.program)[0].stacks)
    noop = [r for r in plan.reshards if makes_no_copy(plan, r)]
    assert noop and {r.tensor for r in noop} <= stacks | {s + ".grad" for s in stacks}
    assert not any(makes_no_copy(plan, r) for r in plan.reshards if r.tensor == "layers.0.wq")
    without = replace(plan, reshards=tuple(r for r in plan.reshards if not makes_no_copy(plan, r)))
    assert memory_per_device(plan).activation_peak == memory_per_device(without).activation_peak
    # a real gather (the dense wq over dp x ep = 2 ranks) adds its gathered copy
    no_wq = replace(plan, reshards=tuple(r for r in plan.reshards if r.tensor != "layers.0.wq"))
    assert memory_per_device(plan).activation_peak > memory_per_device(no_wq).activation_peak


def test_the_pipeline_counts_no_gathered_copy_of_the_experts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """pp=2, dp=1, ep=2 under FSDP2 (torchtitan / automodel): each stage keeps its dense
    parameters gathered over the microbatches (bf16) and their gradients unsharded (fp32); the
    expert stacks, gathered over nothing, are not among them."""
    cmd = [sys.executable, "-m", "spmdkit", "plan", "--model", "mixtral-8x7b", "--layers", "2", "--seq", str(S),
           "--mesh", "pp=2,dp=1,ep=2", "--strategy", "dp,ep,zero3", "--batch", "4", "--microbatches", "2",
           "--framework", "automodel", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    d = json.loads(out)
    stages = d["pipeline"]["stages"]
    # a layer's dense parameters: attention (q, o: H x H; k, v: H x 1024), router H x E, 2 norms
    dense = 2 * H * H + 2 * H * 1024 + H * E + 2 * H
    vocab = 32000 * H
    assert [s["unsharded_parameters"] for s in stages] == [2 * (dense + vocab), 2 * (dense + vocab + H)]
    assert [s["unsharded_gradients"] for s in stages] == [4 * (dense + vocab), 4 * (dense + vocab + H)]


def test_automodel_bytes_per_parameter_by_hand() -> None:
    """bf16 parameters, gradients and Adam moments (2 + 2 + 4 bytes) on the rank's shard; under
    gradient accumulation the unreduced (FSDP2 no-sync) gradient in the fp32 reduce dtype."""
    plan = replace(_plan(strategy="dp,ep,zero3"), runtime=Runtime("bf16", "automodel"))
    held = held_for_the_step(plan)
    wq, stack = "layers.0.wq", "layers.0.experts.w_up"
    n_wq = H * H // 2  # stored over dp x ep = 2 ranks
    n_stack = (E // 2) * H * F  # 4 of 8 experts
    pows = 2 * 4  # the program's Adam keeps beta1 ** t and beta2 ** t as fp32 scalars
    assert held[wq] == (2 * n_wq, 2 * n_wq, 4 * n_wq + pows)
    assert held[stack] == (2 * n_stack, 2 * n_stack, 4 * n_stack + pows)
    acc = plan_preset("mixtral-8x7b", "dp=1,ep=2", "dp,ep,zero3", {"layers": 1, "seq": S, "batch": B},
                      grad_accum=4)[1]
    acc = replace(acc, runtime=Runtime("bf16", "automodel"))
    held = held_for_the_step(acc)
    assert held[wq][1] == 4 * H * H  # unreduced, whole, fp32
    assert held[stack][1] == 2 * n_stack  # nothing to reduce over dp = 1: the bf16 gradient
    tt = held_for_the_step(replace(plan, runtime=Runtime("bf16", "torchtitan")))
    assert tt[wq] == (4 * n_wq, 4 * n_wq, 8 * n_wq + pows)


def test_automodel_loss_holds_the_bf16_nll_gradient() -> None:
    """AutoModel's benchmark recipes take cross-entropy on the bf16 logits (fp32_upcast false):
    2 bytes a logit more at the loss's backward, nothing held between; torchtitan's fp32 upcast
    holds 2 + 4 + 8."""
    assert LOSS_BYTES["automodel"] == (0, 0, 2)
    plan = _plan()
    ((i, j, elems),) = loss_spans(plan)
    assert elems == S * 32000
    mem = {fw: memory_per_device(replace(plan, runtime=Runtime("bf16", fw))) for fw in ("megatron", "torchtitan",
                                                                                          "automodel")}
    # Megatron's fp32 softmax (+2) is held from the loss to its backward, AutoModel's bf16 nll
    # gradient (+2) at the backward only: the same there, 2 bytes a logit less before it, but
    # for the layer's expert rows that Megatron-Core keeps not (the gate weights' gradient:
    # test_megatron_keeps_no_expert_rows_for_the_gate_gradient)
    rows = S * K * H * 2
    assert mem["automodel"].curve[j] == mem["megatron"].curve[j] + rows
    assert [mem["megatron"].curve[k] + rows - mem["automodel"].curve[k] for k in (i, j - 1)] == [2 * elems] * 2
    # torchtitan: 2 held, 4 more at the loss, 8 more at its backward
    assert [mem["torchtitan"].curve[k] - mem["automodel"].curve[k] for k in (i, j)] == [6 * elems, 8 * elems]


def test_framework_is_checked() -> None:
    with pytest.raises(ProgramError, match="expected one of megatron, torchtitan, automodel"):
        Runtime("bf16", "nemo")
    assert Runtime(None, "automodel").fsdp2 and Runtime(None, "torchtitan").fsdp2 and not Runtime().fsdp2


# -- the auxiliary load-balancing loss (models/zoo_moe.py) ---------------------------------------------



def _aux_ops(b: int) -> list[tuple[str, str, list[int]]]:
    """The aux-loss ops of one MoE layer (forward) at batch ``b``, in program order."""
    return [("slice", "aux.hi", [b, E - 1]), ("slice", "aux.lo", [b, E - 1]), ("slice", "aux.first", [b, 1]),
            ("subtract", "aux.diff", [b, E - 1]), ("concat", "aux.count", [b, E]), ("cast", "aux.f", [b, E]),
            ("mean", "aux.p", [b, E]), ("cast", "aux.p32", [b, E]), ("multiply", "aux.fp", [b, E]),
            ("sum", "aux", [b, 1])]


def _mixtral(aux: bool, mesh: str, strategy: str, layers: int = 2):  # type: ignore[no-untyped-def]
    cfg = preset("mixtral-8x7b").with_(layers=layers, seq=S, batch=4, aux_loss=aux)
    loaded = load_preset(Preset("mixtral-8x7b", layers, 4, S), cfg, vocab_parallel_loss="megatron" in strategy)
    assert loaded.model is not None
    m = parse_mesh(mesh)
    return propagate(loaded.program, m, annotate(loaded.model, m, parse_strategy(strategy, m)))


def test_aux_loss_ops_per_moe_layer_and_into_the_loss() -> None:
    plan = _mixtral(True, "dp=1", "dp", layers=1)
    prog = plan.program
    fwd = [(op.rule, op.output_names()[0]) for op in prog.ops if op.phase == "forward"]
    got = [(r, n[len("layers.0."):], list(prog.tensors[n].shape)) for r, n in fwd if n.startswith("layers.0.aux")]
    assert got == _aux_ops(4)
    assert fwd[-3:] == [("reshape", "loss.token2d"), ("concat", "loss.terms"), ("sum", "loss")]
    assert list(prog.tensors["loss.terms"].shape) == [4, S + 1]
    # the counts take no gradient; the router's probabilities get the aux loss's through mean_grad
    bwd = {op.rule for op in prog.ops if op.phase == "backward" and any("aux" in n for n in op.input_names())}
    assert {"mean_grad", "multiply_grad", "cast_grad", "sum_grad"} <= bwd and "one_hot_grad" not in bwd
    assert "layers.0.aux.count.grad" not in prog.tensors


def test_dense_programs_and_aux_loss_false_are_unchanged() -> None:
    dense = plan_preset("tiny-llama", "dp=2", "dp")[1].program
    assert not any("aux" in n for n in dense.tensors) and "loss.terms" not in dense.tensors
    off = _mixtral(False, "dp=2", "dp").program
    on = _mixtral(True, "dp=2", "dp").program
    assert not any("aux" in n for n in off.tensors)
    extra = {n for n in on.tensors if n not in off.tensors}
    # besides its own tensors: the router probabilities' second gradient and the sum of both
    assert {n for n in extra if not ("aux" in n or n.startswith("loss."))} == {
        f"layers.{i}.router.probs.{g}" for i in (0, 1) for g in ("grad1", "grad.sum")}


@pytest.mark.parametrize("mesh, strategy", [("dp=2,ep=2", "dp,ep"), ("dp=2,tp=2", "dp,megatron"),
                                            ("dp=2,ep=2,tp=2", "dp,ep,megatron,sp")])
def test_aux_loss_adds_no_collective(mesh: str, strategy: str) -> None:
    """Per sequence: the batch axis stays sharded to the loss's sum, which stays partial as the
    token losses' is; every reshard of the step is the same with and without it."""
    def comm(aux: bool) -> list[tuple[str, str, tuple[str, ...]]]:
        plan = _mixtral(aux, mesh, strategy)
        return sorted((r.tensor, s.kind, tuple(map(str, s.mesh_dims))) for r in plan.reshards for s in r.plan.steps
                      if r.bytes_per_rank)

    off, on = comm(False), comm(True)
    assert on == off and off
    plan = _mixtral(True, mesh, strategy)
    assert plan.attrs["loss"].partial  # reduced only where the loss is read, as without it


def test_aux_loss_is_costed_and_its_memory_counted() -> None:
    """The counts are the differences of the dispatch's cumulative expert_offset (each sequence's
    histogram): checked against a one_hot count of the chosen experts on the tiny step; the
    mean over the sequence reads [B, S, E]; the backward keeps the fp32 counts [B, E] (the
    gradient of the probabilities' mean)."""
    plan = _mixtral(True, "dp=1", "dp", layers=1)
    prog = plan.program
    i = next(k for k, op in enumerate(prog.ops) if op.rule == "mean" and op.phase == "forward")
    assert op_cost(plan, i).bytes >= 4 * S * E * 2
    saved = dict(saved_activations(plan, "none").tensors["layer 0"])
    assert saved["layers.0.aux.f"] == 4 * E * 4  # multiply_grad's other operand (P's gradient is f)
    for n in ("aux.p32", "aux.count", "dispatch.offset"):  # P itself is not needed: f takes no gradient
        assert "layers.0." + n not in saved


def test_aux_counts_are_each_sequences_expert_histogram() -> None:
    """On the tiny MoE step (numpy references): aux.count equals one_hot(expert_id) summed over
    the sequence and top-k, and aux equals sum_e count_e x mean_s probs."""
    _, plan, _ = plan_model(json.dumps({"base": "tiny-llama", "experts": 4, "top_k": 2, "moe_ffn": 8}), "dp=1", "dp")
    vals = global_step(plan, 3)
    p = "layers.0."
    eid, probs = np.asarray(vals[p + "dispatch.expert"]), np.asarray(vals[p + "router.probs"], dtype=np.float64)
    counts = np.stack([np.bincount(eid[b].ravel(), minlength=4) for b in range(eid.shape[0])])
    assert np.array_equal(np.asarray(vals[p + "aux.count"]), counts)
    want = (counts * probs.mean(axis=1)).sum(axis=1)
    assert np.allclose(np.asarray(vals[p + "aux"], dtype=np.float64)[:, 0], want, rtol=1e-5)
