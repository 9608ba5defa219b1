"""Activation memory per transformer layer against the closed forms of Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models" (2022), on the GPT with
Megatron's dropouts, and activation recomputation (selective, full) in memory and time.

The closed forms (bytes per layer, 16-bit activations, 1-byte dropout masks): sbh(34 + 5as/h)
without parallelism, sbh(10 + 24/t + 5as/(ht)) with tensor parallel, sbh/t (34 + 5as/h) with
tensor + sequence parallel, 34 sbh/t with selective recompute (and sequence parallel). The
program's layer_norm also keeps its mean and variance (float32, [b, s] each, two norms):
16 sb bytes more per layer (16 sb / t under sequence parallel), which the paper leaves out.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from spmdkit.cli import main
from spmdkit.core.errors import ProgramError
from spmdkit.cost.compute import op_cost
from spmdkit.cost.devices import load_device
from spmdkit.cost.memory import RECOMPUTE, check_recompute, memory_per_device
from spmdkit.cost.memory_saved import recompute_regions, saved_activations
from spmdkit.cost.step import estimate_step
from spmdkit.models.zoo import ModelConfig, build_model, preset
from spmdkit.planner.propagate import propagate
from spmdkit.strategies.strategy import annotate, parse_mesh, parse_strategy


def _plan(s: int, b: int, h: int, a: int, mesh: str, strategy: str, layers: int = 2):
    cfg = ModelConfig("gpt2", layers, h, a, None, 4 * h, 64, s, b, "bfloat16", 0.1)
    m = parse_mesh(mesh)
    st = parse_strategy(strategy, m)
    model = build_model(cfg, vocab_parallel_loss="megatron" in st, check_rules=False)
    return propagate(model.program, m, annotate(model, m, st))


#: (s, b, h, a, t): as/h differs (4, 2, 8), t divides a
POINTS = [(16, 2, 64, 4, 4), (32, 3, 96, 6, 2), (64, 1, 32, 4, 2)]


def _closed_forms(s: int, b: int, h: int, a: int, t: int) -> dict[str, Fraction]:
    sbh = Fraction(s * b * h)
    return {"none": sbh * (34 + Fraction(5 * a * s, h)),
            "tp": sbh * (10 + Fraction(24, t) + Fraction(5 * a * s, h * t)),
            "tp+sp": sbh / t * (34 + Fraction(5 * a * s, h)),
            "selective": 34 * sbh / t}


@pytest.mark.parametrize("s,b,h,a,t", POINTS)
def test_four_closed_forms_exactly(s: int, b: int, h: int, a: int, t: int) -> None:
    want = _closed_forms(s, b, h, a, t)
    stats = 16 * s * b  # layer_norm mean + variance, float32, two norms
    cases = [("none", "dp=1", "none", "none", stats),
             ("tp", f"tp={t}", "megatron", "none", stats),
             ("tp+sp", f"tp={t}", "megatron,sp", "none", Fraction(stats, t)),
             ("selective", f"tp={t}", "megatron,sp", "selective", Fraction(stats, t))]
    for form, mesh, strategy, recompute, extra in cases:
        am = saved_activations(_plan(s, b, h, a, mesh, strategy), recompute)
        for layer in ("layer 0", "layer 1"):
            assert am.layer(layer) == want[form] + extra, (form, layer, am.tensors[layer])


def test_data_parallel_divides_the_batch() -> None:
    s, b, h, a, t = 16, 4, 64, 4, 2
    am = saved_activations(_plan(s, b, h, a, f"dp=2,tp={t}", "megatron,sp"))
    assert am.layer("layer 1") == _closed_forms(s, b // 2, h, a, t)["tp+sp"] + Fraction(16 * s * (b // 2), t)


def test_kept_tensors_are_read_by_the_backward() -> None:
    am = saved_activations(_plan(16, 2, 64, 4, "tp=2", "megatron"))
    kept = {n.removeprefix("layers.1.") for n, _ in am.tensors["layer 1"]}
    assert kept == {"layers.0.resid2", "ln1.out", "ln1.mean", "ln1.var", "qt", "kt", "probs", "probs.dropout.mask",
                    "probs.dropout", "vt", "ctx2d", "attn_out.dropout.mask", "resid1", "ln2.out", "ln2.mean",
                    "ln2.var", "fc1.out", "gelu", "mlp_out.dropout.mask"}
    sizes = dict(am.tensors["layer 1"])
    sbh = 16 * 2 * 64
    assert sizes["layers.1.attn_out.dropout.mask"] == sbh  # uint8: one byte an element, replicated under tp
    assert sizes["layers.1.probs.dropout.mask"] == 4 * 16 * 16 * 2 // 2  # as^2 b / t


def test_sequence_parallel_keeps_norm_outputs_as_shards() -> None:
    plan = _plan(16, 2, 64, 4, "tp=4", "megatron,sp")
    am = saved_activations(plan)
    regathered = {n for n, _ in am.regathered}
    assert {"layers.0.ln1.out", "layers.0.ln2.out", "layers.1.ln1.out", "layers.1.ln2.out"} <= regathered
    assert dict(am.tensors["layer 1"])["layers.1.ln1.out"] == 2 * 16 * 2 * 64 // 4


@pytest.mark.parametrize("strategy,t", [("megatron", 1), ("megatron,sp", 4)])
def test_full_recompute_keeps_the_layer_input(strategy: str, t: int) -> None:
    s, b, h, a = 16, 2, 64, 4
    am = saved_activations(_plan(s, b, h, a, "tp=4", strategy), "full")
    assert am.tensors["layer 1"] == [("layers.0.resid2", 2 * s * b * h // t)]
    assert am.tensors["layer 0"] == [("embed.sum", 2 * s * b * h // t)]


def test_selective_regions_are_the_attention_cores() -> None:
    plan = _plan(16, 2, 64, 4, "tp=2", "megatron", layers=3)
    prog = plan.program
    regions = recompute_regions(prog, "selective")
    assert len(regions) == 3
    for i, region in enumerate(regions):
        outs = [n for j in region for n in prog.ops[j].output_names()]
        assert outs == [f"layers.{i}.{n}" for n in ("scores", "scores.scaled", "scores.masked", "probs",
                                                    "probs.dropout", "probs.dropout.mask", "ctx")]
    full = recompute_regions(prog, "full")
    assert [prog.ops[r[0]].layer for r in full] == ["layer 0", "layer 1", "layer 2"]
    assert recompute_regions(prog, "none") == []


def test_recompute_lowers_memory_and_adds_time() -> None:
    s, b, h, a, t, L = 64, 2, 64, 4, 2, 3
    plan = _plan(s, b, h, a, f"tp={t}", "megatron,sp", layers=L)
    mems = {r: memory_per_device(plan, r) for r in RECOMPUTE}
    sel_saving = mems["none"].saved.total - mems["selective"].saved.total
    assert sel_saving == L * 5 * a * s * s * b // t  # the attention core: 5as^2b/t per layer
    assert mems["none"].activation_peak > mems["selective"].activation_peak > mems["full"].activation_peak
    assert mems["none"].saved.total > mems["selective"].saved.total > mems["full"].saved.total
    for r in RECOMPUTE:  # parameters, gradients and states do not change
        assert (mems[r].parameters, mems[r].gradients, mems[r].optimizer_states) == \
            (mems["none"].parameters, mems["none"].gradients, mems["none"].optimizer_states)
    dev = load_device("h100")
    est = {r: estimate_step(plan, dev, s * b, r) for r in RECOMPUTE}
    for r in ("selective", "full"):
        regions = recompute_regions(plan.program, r)
        again = sum(op_cost(plan, j).flops for reg in regions for j in reg)
        assert again > 0
        assert est[r].recompute_flops_per_device == pytest.approx(again, rel=1e-12)
        assert est[r].flops_per_device == pytest.approx(est["none"].flops_per_device + again, rel=1e-12)
        assert est[r].model_flops == est["none"].model_flops  # MFU counts model FLOPs only
        assert est[r].compute_s["recompute"] > 0
        assert est[r].step_overlap_s > est["none"].step_overlap_s
        assert est[r].mfu is not None and est["none"].mfu is not None and est[r].mfu < est["none"].mfu
        hfu = est[r].hfu
        assert hfu is not None and hfu > est[r].mfu
    assert est["none"].hfu == est["none"].mfu
    # full: every layer's forward runs again, its collectives too (sequence parallel's all-gathers)
    layer_fwd = sum(op_cost(plan, j).flops for j, op in enumerate(plan.program.ops)
                    if op.phase == "forward" and op.layer.startswith("layer "))
    assert est["full"].recompute_flops_per_device == pytest.approx(layer_fwd, rel=1e-12)
    assert est["full"].comm_s["recompute"] > 0 and est["selective"].comm_s.get("recompute", 0.0) == 0.0


def test_dropout_model_simulates_sharded() -> None:
    pytest.importorskip("numpy")
    from spmdkit.planner.planning import plan_model
    from spmdkit.sim.plan import simulate_plan

    _, plan, _ = plan_model("tiny-gpt-dropout", "dp=2,tp=2", "megatron,sp")
    rep = simulate_plan(plan)
    assert rep.ok and rep.checked > 100, rep.failures[:3]
    rules = {op.rule for op in plan.program.ops}
    assert {"dropout", "bernoulli", "dropout_grad"} <= rules
    assert "dropout" not in {op.rule for op in build_model(preset("tiny-gpt2")).program.ops}


def test_bad_recompute_and_dropout_are_program_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ProgramError, match="--recompute 'some': expected one of none, selective, full"):
        check_recompute("some")
    with pytest.raises(ProgramError, match="dropout must be in"):
        ModelConfig("gpt2", dropout=1.5).check()
    with pytest.raises(ProgramError, match="gpt2 only"):
        ModelConfig("llama", dropout=0.1).check()
    rc = main(["plan", "--model", "tiny-gpt-dropout", "--mesh", "tp=2", "--recompute", "partial"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip().splitlines() == ["spmdkit plan: ProgramError: --recompute 'partial': expected one of none, "
                                        "selective, full, microbatch, full:K, every:N or selective:M1,M2 (modules core_attn, "
                                        "layernorm, mlp, moe, moe_act, shared_experts, mla_up_proj)"]


def test_cli_recompute_reports_memory_and_time(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    out = {}
    for r in RECOMPUTE:
        rc = main(["plan", "--model", "tiny-gpt-dropout", "--mesh", "tp=2", "--strategy", "megatron,sp",
                   "--device", "h100", "--recompute", r, "--json"])
        assert rc == 0
        out[r] = json.loads(capsys.readouterr().out)
    saved = {r: out[r]["memory"]["saved_for_backward"] for r in RECOMPUTE}
    assert [saved[r]["recompute"] for r in RECOMPUTE] == list(RECOMPUTE)
    assert saved["none"]["total"] > saved["selective"]["total"] > saved["full"]["total"]
    assert out["full"]["step"]["recompute"] == "full"
    assert out["full"]["step"]["hfu"] > out["full"]["step"]["mfu"]
    rc = main(["plan", "--model", "tiny-gpt-dropout", "--mesh", "tp=2", "--recompute", "selective"])
    text = capsys.readouterr().out
    assert rc == 0 and "kept for the backward (recompute selective)" in text


def test_full_recompute_needs_numbered_layers() -> None:
    from dataclasses import replace

    from spmdkit.program.ir import Program

    prog = build_model(preset("tiny-gpt-dropout")).program
    flat = Program(prog.tensors.values(), [replace(op, layer="transformer") for op in prog.ops], prog.name)
    with pytest.raises(ProgramError, match=r"--recompute full: no forward op is labelled with a numbered layer"):
        recompute_regions(flat, "full")
    assert len(recompute_regions(flat, "selective")) == 2  # found by structure, not by labels


def test_model_flops_attention_skips_weights_made_activations() -> None:
    """An imported program's weights can be activations (transposed, split by megatron):
    their matmuls are not attention; a batched q @ k^T is."""
    from spmdkit.core.mesh import ProcessMesh
    from spmdkit.cost.compute import model_flops
    from spmdkit.program.ir import ProgramBuilder

    b = ProgramBuilder("t")
    x_in = b.tensor("x.in", [2, 8, 16], "float32", "input")
    (x,) = b.op("scale", {"x": x_in}, [("x", [2, 8, 16], "float32")])  # an activation, as after a norm
    w = b.tensor("w", [16, 16], "float32", "parameter")
    (wt,) = b.op("transpose", {"x": w}, [("w.t", [16, 16], "float32")], perm=(1, 0))
    (h,) = b.op("matmul", {"x": x, "y": wt}, [("h", [2, 8, 16], "float32")])
    (k,) = b.op("matmul", {"x": x, "y": wt}, [("k", [2, 8, 16], "float32")])
    b.op("matmul", {"x": h, "y": k}, [("scores", [2, 8, 8], "float32")], trans_y=True)
    plan = propagate(b.build(), ProcessMesh([1]), {})
    _, n_params, att = model_flops(plan, 16)
    assert n_params == 256
    assert att == 3 * 2.0 * (2 * 8 * 8) * 16  # only the scores matmul, forward and backward


def test_selective_under_flash_attention_is_megatrons_core_attention_checkpoint() -> None:
    """Megatron-Core's selective recomputation (recompute_modules core_attn) under flash
    attention: the fused kernel runs again in the backward, its output and softmax statistics are
    not kept (q, k, v are); torchtitan's op-level policy saves the flash kernel's outputs."""
    from dataclasses import replace as _replace

    from spmdkit.cost.memory_saved import recompute_regions, saved_activations
    from spmdkit.planner.planning import plan_model
    from spmdkit.program.runtime import Runtime

    _, plan, _ = plan_model("tiny-llama", "dp=2,tp=2", "megatron", {"layers": 2})
    prog = plan.program
    flash = [i for i, op in enumerate(prog.ops) if op.rule == "flash_attention" and op.phase == "forward"]
    assert recompute_regions(prog, "selective") == [[i] for i in flash]
    none = {n for lst in saved_activations(plan, "none").tensors.values() for n, _ in lst}
    sel = {n for lst in saved_activations(plan, "selective").tensors.values() for n, _ in lst}
    outs = {n for i in flash for n in prog.ops[i].output_names() if n in none}
    assert outs and none - sel == outs  # exactly the kernel's kept outputs leave the stash
    assert all(prog.ops[flash[0]].inputs[p] in sel for p in ("q", "k", "v"))
    tt = _replace(plan, runtime=Runtime(framework="torchtitan"))
    kept_tt = {n for lst in saved_activations(tt, "selective").tensors.values() for n, _ in lst}
    assert outs <= kept_tt
