"""benchmarks/fidelity.py: the published runs expressed through the CLI, their architectures
matching the published parameter counts, and the error band and docs/fidelity.md it writes
current with the code."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from conftest import load_script
from spmdkit.cost.band import BAND_FILE, error_band, family_of
from spmdkit.models.zoo import build_model, preset

ROOT = Path(__file__).resolve().parents[1]


def _bench() -> ModuleType:
    return load_script("fidelity_bench", ROOT / "benchmarks" / "fidelity.py")


FID = _bench()
ROWS: list[dict[str, Any]] = json.loads(FID.RUNS.read_text())
#: features the planner does not have yet (the microbatch-level recompute of Korthikanti App. C);
#: every other run must be expressible
NOT_YET = {"microbatch-level recomputation (Korthikanti App. C)"}


def test_every_run_is_expressed_or_named_unsupported() -> None:
    reasons: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as d:
        for row in ROWS:
            try:
                case = FID.express(row, Path(d))
            except FID.Unsupported as exc:
                reasons.setdefault(str(exc), []).append(row["id"])
                continue
            assert case.argv[0] == "plan" and "--json" in case.argv
    assert set(reasons) <= NOT_YET, reasons
    assert len(ROWS) - sum(map(len, reasons.values())) >= 63


def test_cp_runs_expressed_as_their_sources_ran_them() -> None:
    # the 8 runs with cp > 1: a cp mesh dim between dp and tp, ,cp in the strategy (ZeRO after it),
    # and the attention the source ran: NeMo 24.07 Transformer Engine's p2p ring, torchtitan's
    # context_parallel the all-gather rotation (torch's default)
    cp_rows = [r for r in ROWS if (r["parallelism"].get("cp") or 1) > 1]
    assert len(cp_rows) == 8
    with tempfile.TemporaryDirectory() as d:
        for row in cp_rows:
            case = FID.express(row, Path(d))
            par = row["parallelism"]
            mesh = case.argv[case.argv.index("--mesh") + 1]
            strategy = case.argv[case.argv.index("--strategy") + 1].split(",")
            assert f"cp={par['cp']}" in mesh.split(",") and mesh.index("cp=") < mesh.index("tp=")
            want = "ring" if row["id"].startswith("nemo") else "allgather"
            assert "cp" in strategy and f"cp-attention={want}" in strategy
            assert case.gpus == row["hardware"]["num_gpus"]


def test_megatron_moe_rows_expressed_as_their_source_ran_them() -> None:
    """Megatron-MoE-ModelZoo's Qwen3-235B rows: ETP = 1 folds the table's EP out of dp x tp (EP 8 at
    TP 4: an ep mesh dim of 2, the table's EDP 4 as dp: 256 GPUs), the pipeline split with the
    embedding and the loss counted as layers (3 a virtual stage: 2, 3 x 30, 2), uniform top-k
    routing (run_235b.sh at 31c5686: --moe-router-force-load-balancing) (the pp=32 x 3 row at one
    layer a virtual stage: 0, 1 x 94, 0, the embedding and the loss stages of their own; a 0 in the
    middle unsupported); a run that recomputes Megatron-Core's
    --recompute-modules layernorm moe_act is planned with --recompute selective:layernorm,moe_act (not
    as the attention core's selective recomputation), one with a module not built is named unsupported."""
    rows = {r["id"]: r for r in json.loads(FID.MOE_RUNS.read_text()) if r["id"].startswith("megatron_moe_zoo")}
    with tempfile.TemporaryDirectory() as d:
        case = FID.express(rows["megatron_moe_zoo_h100_bf16_qwen3_235b_tp4_pp8_ep8"], Path(d))
        a = case.argv
        assert a[a.index("--mesh") + 1] == "pp=8,dp=4,ep=2,tp=4" and case.gpus == 256
        assert set(a[a.index("--strategy") + 1].split(",")) == {"dp", "ep", "megatron", "sp", "zero1", "etp=1"}
        assert a[a.index("--stages") + 1] == ",".join(["2"] + ["3"] * 30 + ["2"])
        assert a[a.index("--microbatches") + 1] == "256" and a[a.index("--batch") + 1] == "2048"
        assert a[a.index("--moe-routing") + 1] == "topk" and a[a.index("--recompute") + 1] == "none"
        assert "--tp-comm-overlap" not in a  # neither the yaml nor the sbatch script of c1ad0b5 sets it
        a = FID.express(rows["megatron_moe_zoo_h100_bf16_qwen3_235b_tp2_pp8_ep32"], Path(d)).argv
        assert a[a.index("--recompute") + 1] == "selective:layernorm,moe_act"
        # pp=32 x vpp=3 at one layer a virtual stage: the first holds the embedding alone, the last the loss
        deep = rows["megatron_moe_zoo_h100_bf16_qwen3_235b_tp2_pp32_ep8_a2a"]
        a = FID.express(deep, Path(d)).argv
        assert a[a.index("--stages") + 1] == ",".join(["0"] + ["1"] * 94 + ["0"])
        assert a[a.index("--virtual-stages") + 1] == "3" and a[a.index("--mesh") + 1].startswith("pp=32,")
        # a stage of no layer in the middle is not what Megatron-Core builds
        middle = [1] * 47 + [0] + [1] * 47 + [0]
        with pytest.raises(FID.Unsupported, match="a middle pipeline stage without a decoder layer"):
            FID.express(dict(deep, parallelism={**deep["parallelism"], "stages": middle}), Path(d))
        row = dict(rows["megatron_moe_zoo_h100_bf16_qwen3_235b_tp2_pp8_ep32"], recompute="selective: layernorm, qkv_proj")
        with pytest.raises(FID.Unsupported, match=r"recompute modules \(layernorm, qkv_proj\): --recompute "
                                                  r"selective:layernorm,qkv_proj: module 'qkv_proj' is not a module"):
            FID.express(row, Path(d))


def _params(row: dict[str, Any]) -> float:
    with tempfile.TemporaryDirectory() as d:
        case = FID.express(row, Path(d))
    cfg = preset(case.argv[case.argv.index("--model-config") + 1]).with_(batch=1, seq=64)
    prog = build_model(cfg, check_rules=False).program
    n = sum(t.numel for t in prog.tensors.values() if t.kind == "parameter" and not t.inplace_of)
    pos = [t.numel for t in prog.tensors.values() if t.name == "pos_embed"]
    # the position table at the published sequence length, not the test's 64
    return n + (pos[0] // 64 * (row["model"]["seq_len"] - 64) if pos else 0)


@pytest.mark.parametrize("rid", ["narayanan21_t1_1.7b", "narayanan21_t1_18.4b", "narayanan21_t1_145.6b",
                                 "megatronlm_h100_2024_7.1b", "megatronlm_h100_2024_177b"])
def test_architectures_have_the_published_parameter_counts(rid: str) -> None:
    """The model each run is planned with has its source's parameter count: Narayanan's eq. 2,
    ``12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h))`` (tied embeddings, learned positions; the
    13/(12h) term is biases and norms, which the zoo's GPT has as norms only), and for the
    Megatron-LM labels ``12 L h^2 + 2 V h`` (untied; the GPT's learned positions on top); each matching the stated size to its
    rounding."""
    row = next(r for r in ROWS if r["id"] == rid)
    m = row["model"]
    h, L, V, s = m["hidden"], m["layers"], m["vocab"], m["seq_len"]
    got = _params(row)
    if rid.startswith("narayanan21"):
        eq2 = 12 * L * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))
        assert got == pytest.approx(eq2 - 9 * h * L, rel=1e-4)  # eq. 2 less the biases (9 h per layer)
    else:
        assert got == pytest.approx(12 * L * h * h + 2 * V * h + s * h, rel=2e-4)  # + learned positions, norms
    assert got / 1e9 == pytest.approx(m["params_b"], rel=0.035)


def test_flop_definitions_reproduce_the_published_aggregates() -> None:
    """Narayanan eq. 3 over 1.7B's measured 137 TFLOP/s x 32 GPUs gives their 4.4 PFLOP/s; the
    Megatron-Core count gives the README's 41% MFU for its 1.7B (408.8 TFLOP/s / 989)."""
    row = next(r for r in ROWS if r["id"] == "narayanan21_t1_1.7b")
    assert 137 * 32 / 1e3 == pytest.approx(row["measured"]["aggregate_pflops"], abs=0.05)
    # Narayanan's eq. 3 counts the recomputed forward that Korthikanti's eq. 7 (model FLOPs) leaves
    # out: the difference is one forward of the layers, 24 B s l h^2 (1 + s/(6h)), the logits alike
    mr = row["model"]
    s_, h_, l_, b_ = mr["seq_len"], mr["hidden"], mr["layers"], row["parallelism"]["global_batch"]
    assert FID.narayanan_flops(row) - FID.korthikanti_model_flops(row) == \
        pytest.approx(24 * b_ * s_ * l_ * h_ * h_ * (1 + s_ / (6 * h_)), rel=1e-12)
    m = next(r for r in ROWS if r["id"] == "megatronlm_h100_2024_1.7b")
    assert 100 * m["measured"]["tflops_per_gpu"] / 989.5 == pytest.approx(m["measured"]["mfu_pct"], abs=0.5)
    # Megatron-Core's formula against a hand count for the 1.7B (MHA, 4h GeLU, untied): 12 B s L h^2
    # (2 + s/h + 4 + V/(2 L h))
    mm = m["model"]
    s, h, L, V, B = mm["seq_len"], mm["hidden"], mm["layers"], mm["vocab"], m["parallelism"]["global_batch"]
    assert FID.megatron_core_flops(m) == pytest.approx(12 * B * s * L * h * h * (6 + s / h + V / (2 * L * h)))


def test_band_and_docs_are_current() -> None:
    """benchmarks/fidelity.py --write's outputs of the published runs are what the code predicts
    today: the error band and docs/fidelity.md but its MoE section (checked apart, below, so the
    two halves run on two workers)."""
    results, unsupported = FID.evaluate(ROWS)
    s = FID.summarise(results, unsupported)
    band = json.loads(BAND_FILE.read_text())
    band["families"].pop("moe", None)  # the MoE runs' family: checked with them (test_moe_docs_are_current)
    assert band == FID.band_json(results), "run: python benchmarks/fidelity.py --write"
    rest, section = FID.split_moe_section((ROOT / "docs" / "fidelity.md").read_text())
    assert section, "docs/fidelity.md has no MoE section: run: python benchmarks/fidelity.py --write"
    for x in FID.EXTRA_RUNS:  # the out-of-sample sections, checked apart (below)
        rest, _ = FID.split_section(rest, x.heading)
    assert rest == FID.markdown(results, unsupported, s), "run: python benchmarks/fidelity.py --write"


def test_moe_docs_are_current() -> None:
    """docs/fidelity.md's MoE section and band.json's ``moe`` family (the band a plan with MoE layers
    carries) are what the code predicts today for benchmarks/data/moe-runs.json."""
    mres, muns = FID.evaluate(json.loads(FID.MOE_RUNS.read_text()))
    assert json.loads(BAND_FILE.read_text())["families"]["moe"] == FID.band_json([], mres)["families"]["moe"], \
        "run: python benchmarks/fidelity.py --write"
    _, section = FID.split_moe_section((ROOT / "docs" / "fidelity.md").read_text())
    assert section == FID.moe_section(mres, muns, FID.summarise(mres, muns)), \
        "run: python benchmarks/fidelity.py --write"


def test_a_moe_plan_carries_the_moe_runs_band() -> None:
    # a plan with MoE layers is told how far the published MoE runs fell from their predictions, not the dense
    # H100 runs' band; a dense plan on the same device keeps the H100 family's; the families as band.json has them
    families = json.loads(BAND_FILE.read_text())["families"]
    moe = error_band("NVIDIA H100 SXM5 80GB", moe=True)
    assert moe is not None and moe.family == "mixture-of-experts" and moe.runs == families["moe"]["runs"] == 16
    assert (moe.p10, moe.p50, moe.p90) == (families["moe"]["p10"], families["moe"]["p50"], families["moe"]["p90"])
    assert set(moe.sources) == {"NeMo AutoModel", "Megatron-MoE-ModelZoo"}
    assert error_band("NVIDIA H100 SXM5 80GB", cp=True, moe=True) == moe  # a MoE plan with cp: the MoE runs'
    dense = error_band("NVIDIA H100 SXM5 80GB")
    assert dense is not None and dense.family == "H100" and dense.runs == families["H100"]["runs"]
    out = subprocess.run([sys.executable, "-m", "spmdkit", "plan", "--model", "mixtral-8x7b", "--layers", "1", "--seq",
                          "512", "--batch", "8", "--mesh", "dp=2,ep=4", "--strategy", "dp,ep", "--device", "h100",
                          "--json"], capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["step"]["error_band"]["family"] == "mixture-of-experts"


def test_the_moe_section_is_split_off_whole() -> None:
    doc = FID.markdown([], {}, FID.summarise([], {}), ["", FID.MOE_HEADING, "", "- a line"])
    rest, section = FID.split_moe_section(doc)
    assert section == ["", FID.MOE_HEADING, "", "- a line"] and rest == FID.markdown([], {}, FID.summarise([], {}))
    assert FID.MOE_HEADING not in rest and FID.AFTER_MOE in rest
    band = error_band("NVIDIA H100 SXM5 80GB")
    assert band is not None and band.family == "H100" and band.p10 <= band.p50 <= band.p90
    assert family_of("NVIDIA A100 SXM4 80GB") == "A100" and family_of("my TPU") == "all"


def test_breakdown_sums_to_the_step() -> None:
    """``--breakdown``: a flat run's compute and exposed parts sum to its predicted step (Megatron-LM's
    1.7B: tp = 1, so nothing blocks, and the gradient buckets overlap all but the tail of its last
    backward); a pipeline's schedule and what runs after it likewise; the measured step is the
    ratio times the predicted one."""
    row = next(r for r in ROWS if r["id"] == "megatronlm_h100_2024_1.7b")
    with tempfile.TemporaryDirectory() as d:
        case = FID.express(row, Path(d))
    pred, _ = FID.predict(case)
    b = case.breakdown
    assert set(b) == {"compute", "blocking", "gradient_buckets", "param_gathers", "regathers", "step"}
    assert sum(v for k, v in b.items() if k != "step") == pytest.approx(b["step"], rel=1e-9)
    assert b["blocking"] == 0 and b["gradient_buckets"] < 0.05 * b["step"]
    # the README's TFLOP/s is Megatron-Core's count over the step: the step is that count over the prediction
    assert FID.megatron_core_flops(row) / 48 / b["step"] / 1e12 == pytest.approx(pred, rel=1e-9)
    line = FID.breakdown_line(b, case.measured and pred / case.measured)
    assert line.startswith(f"    step {b['step']:.3f} s (measured {pred / case.measured * b['step']:.3f} s): compute ")
    p = {"pipeline": {"step_overlap_s": 2.5, "pipeline_s": 2.0, "bubble_s": 0.25}}
    assert FID.breakdown(p) == {"pipeline": 2.0, "bubble": 0.25, "after_pipeline": 0.5, "step": 2.5}


def test_table4_rows_split_their_layer_into_forward_and_backward() -> None:
    """Korthikanti et al. 2022 Table 4 gives a layer's forward and backward apart: ``--breakdown`` prints
    both halves beside them, and they sum to the combined prediction; full recomputation runs the
    forward again inside the backward, so its forward half is the baseline's and its backward half
    is the baseline's plus that forward (Table 4: 7.7 ms forward both, 11.9 -> 19.5 backward)."""
    got = {}
    for rid in ("korthikanti22_t4_22b_layer_baseline_no_recompute", "korthikanti22_t4_22b_layer_baseline_full_recompute"):
        row = next(r for r in ROWS if r["id"] == rid)
        with tempfile.TemporaryDirectory() as d:
            case = FID.express(row, Path(d))
        pred, _ = FID.predict(case)
        b = case.breakdown
        assert set(b) == {"layer_forward_ms", "layer_backward_ms"}
        assert b["layer_forward_ms"] + b["layer_backward_ms"] == pytest.approx(pred, rel=1e-9)
        line = FID.layer_line(b, row["measured"])
        assert line == (f"    layer forward {b['layer_forward_ms']:.2f} ms (measured {row['measured']['layer_forward_ms']:g}), "
                        f"backward {b['layer_backward_ms']:.2f} ms (measured {row['measured']['layer_backward_ms']:g})")
        got[rid.rsplit("_", 2)[-2]] = b
    assert got["full"]["layer_forward_ms"] == pytest.approx(got["no"]["layer_forward_ms"], rel=1e-9)
    assert got["full"]["layer_backward_ms"] == pytest.approx(
        got["no"]["layer_backward_ms"] + got["no"]["layer_forward_ms"], rel=0.01)


def test_table4_layer_is_priced_as_the_step_overlaps_it() -> None:
    """A Table 4 layer is its wall time in the step, not its compute plus every collective as if each
    blocked: Megatron's backward all-reduce of the column-parallel input gradient runs beside the
    weight-gradient GEMM (the step hides it), so the layer's backward is the step's rest less the
    optimizer, 1.6 ms under the serial sum on the 22B layer (tp 8: one 4 x 2048 x 6144 bf16
    all-reduce a layer in the backward, which the forward's blocking twin shows)."""
    row = next(r for r in ROWS if r["id"] == "korthikanti22_t4_22b_layer_baseline_no_recompute")
    with tempfile.TemporaryDirectory() as d:
        case = FID.express(row, Path(d))
        assert case.argv2 is not None
        d1, d2 = FID.run_cli(case.argv), FID.run_cli(case.argv2)
        pred, _ = FID.predict(case)

    def serial(d: dict[str, Any], phase: str) -> float:
        return float(d["step"]["compute_s"][phase]) + float(d["step"]["comm_s"][phase])

    fwd_comm = 1e3 * (d2["step"]["comm_s"]["forward"] - d1["step"]["comm_s"]["forward"])
    bwd_comm = 1e3 * (d2["step"]["comm_s"]["backward"] - d1["step"]["comm_s"]["backward"])
    assert bwd_comm == pytest.approx(fwd_comm, rel=1e-6) and bwd_comm > 1.0
    old = 1e3 * sum(serial(d2, p) - serial(d1, p) for p in ("forward", "backward"))
    assert pred == pytest.approx(old - bwd_comm, rel=1e-3)
    halves = FID.layer_halves_ms(d1, d2)
    assert halves["layer_forward_ms"] == pytest.approx(1e3 * (serial(d2, "forward") - serial(d1, "forward")), rel=1e-9)
    # the halves on a made-up pair: the step less the optimizer, the forward with its collectives
    a = {"step": {"step_overlap_s": 1.0, "compute_s": {"forward": 0.2, "optimizer": 0.1}, "comm_s": {"forward": 0.05}}}
    b = {"step": {"step_overlap_s": 1.5, "compute_s": {"forward": 0.3, "optimizer": 0.15},
                  "comm_s": {"forward": 0.1, "inside_ops": 0.01}}}
    assert FID.layer_halves_ms(a, b) == pytest.approx({"layer_forward_ms": 160.0, "layer_backward_ms": 290.0})


MOE_ROWS: dict[str, dict[str, Any]] = {r["id"]: r for r in json.loads(FID.MOE_RUNS.read_text())}


def test_megatron_moe_flops_reproduce_the_zoo_tflops() -> None:
    """Megatron-Core's MoE FLOP count (training.py ``num_floating_point_operations`` at 1e057005)
    over the step and the GPUs gives the Megatron-MoE-ModelZoo table's Per GPU TF on every Qwen3-235B
    row with both figures: within the rounding of the step (0.1 s) and of the TF (1) for the rows run
    on main(1e057005), within 0.6% for those of the moe_dev branch (f3e6c5, not public); e.g.
    tp4_pp8_ep8: 1.2418e18 / (29.0 s x 256) = 167.3 (167)."""
    # Qwen3-Next apart: the formula here counts softmax attention in every layer, not Gated DeltaNet
    # (its row is compared by step time; this count gives it 91.0 TF/GPU to the table's 89)
    both = [r for r in MOE_ROWS.values() if r["id"].startswith("megatron_moe_zoo") and r["model"]["moe"]["catalog"]
            and {"step_time_s", "tflops_per_gpu"} <= set(r["measured"]) and "Gated DeltaNet" not in r["model"]["arch"]]
    assert len(both) == 5
    for r in both:
        flops, gpus = FID.megatron_core_moe_flops(r), r["hardware"]["num_gpus"]
        step, tf = r["measured"]["step_time_s"], r["measured"]["tflops_per_gpu"]
        if "main(1e057005)" in r["source"]["source_row"]:
            lo, hi = flops / ((step + 0.05) * gpus) / 1e12, flops / ((step - 0.05) * gpus) / 1e12
            assert lo - 0.5 <= tf <= hi + 0.5, (r["id"], lo, hi, tf)
        else:
            assert flops / (step * gpus) / 1e12 == pytest.approx(tf, rel=0.006), r["id"]
    # by hand, per token: 94 layers of 12 h (top-8 x 1536 x 3/2 SwiGLU) + 12 h^2 (1 + 4/64 + s/(2h)) x
    # (64 x 128 / h) GQA attention, and the untied output layer 6 h V (V = 151936: 1187 x 128)
    r = MOE_ROWS["megatron_moe_zoo_h100_bf16_qwen3_235b_tp4_pp8_ep8"]
    per_token = 12 * 94 * 4096 * 18432 + 12 * 94 * 4096**2 * (1 + 4 / 64 + 4096 / 8192) * 2 + 6 * 4096 * 151936
    assert FID.megatron_core_moe_flops(r) == pytest.approx(2048 * 4096 * per_token, rel=1e-12)
    # the vocabulary padded as Megatron pads it: to 128 x tp by default (151936 -> 152064 at tp 4)
    r2 = {**r, "model": {k: v for k, v in r["model"].items() if k != "vocab_divisible_by"}}
    assert FID.megatron_core_moe_flops(r2) - FID.megatron_core_moe_flops(r) == \
        pytest.approx(2048 * 4096 * 6 * 4096 * 128, rel=1e-9)


def test_megatron_moe_flops_of_mla_dense_layers_and_mtp() -> None:
    """DeepSeek-V3 (MLA, 3 dense layers, one shared expert) with one MTP layer, by hand: the MTP layer
    counts as a 62nd layer of the last layer's kind (MoE), plus its norms and projection and a second
    output layer; MLA's terms per layer: the q down and up projections with its norm, the kv down and
    up with theirs, the shared rope key, the output projection and the causal core."""
    r = MOE_ROWS["automodel_h100_bf16_deepseek_v3_256gpu"]
    r = {**r, "model": {**r["model"], "moe": {**r["model"]["moe"], "mtp_layers": 1}},
         "parallelism": {**r["parallelism"], "global_batch": 1}}
    h, s = 7168, 4096
    mla = (1536 * (h + 128 * 192 + 1) + 512 * (h + 128 * 256 + 1) + h * 64 + 128 * 128 * h
           + s * 128 * 192 / 2 + s * 128 * 128 / 2)
    mlp = 12 * h * 1.5 * (18432 * 3 + (2048 * 8 + 2048) * 59)
    want = s * (mlp + 6 * 62 * mla + 6 * (3 * h + 2 * h * h) + 6 * h * 129280 * 2)
    assert FID.megatron_core_moe_flops(r) == pytest.approx(want, rel=1e-12)


def test_megatron_moe_tflops_rows_are_planned_with_the_moe_count() -> None:
    """The long-context rows (TF/GPU only) are planned at their sequence and cp, and their prediction
    is the MoE count over the predicted step; rows with features spmdkit lacks are named; a MoE
    TFLOP/s of another definition is refused rather than compared with Megatron's count."""
    with tempfile.TemporaryDirectory() as d:
        c1 = FID.express(MOE_ROWS["megatron_moe_zoo_h100_bf16_qwen3_235b_seq16k_tp4_cp1_pp8_ep8_forced"], Path(d))
        a = c1.argv
        assert c1.metric == "tflops_per_gpu" and c1.measured == 295 and c1.gpus == 256
        assert a[a.index("--mesh") + 1] == "pp=8,dp=4,ep=2,tp=4" and a[a.index("--seq") + 1] == "16384"
        assert a[a.index("--microbatches") + 1] == "32" and a[a.index("--batch") + 1] == "256"
        assert a[a.index("--recompute") + 1] == "selective:layernorm,moe" and "--tp-comm-overlap" not in a
        c2 = FID.express(MOE_ROWS["megatron_moe_zoo_h100_bf16_qwen3_235b_seq32k_tp4_cp2_pp8_ep8_dropless"], Path(d))
        a = c2.argv
        assert a[a.index("--mesh") + 1] == "pp=8,dp=2,cp=2,ep=2,tp=4" and c2.gpus == 256 and c2.measured == 277
        assert {"cp", "cp-attention=ring", "etp=1"} <= set(a[a.index("--strategy") + 1].split(","))
        assert a[a.index("--microbatches") + 1] == "64"
        # --overlap-moe-expert-parallel-comm: the same layout as the row without it, plus --ep-comm-overlap
        over = FID.express(MOE_ROWS["megatron_moe_zoo_h100_bf16_qwen3_235b_tp2_pp8_ep32_1f1b_overlap"], Path(d)).argv
        base = FID.express(MOE_ROWS["megatron_moe_zoo_h100_bf16_qwen3_235b_tp2_pp8_ep32"], Path(d)).argv
        assert "--ep-comm-overlap" in over and "--ep-comm-overlap" not in base
        assert [x for x in over if x != "--ep-comm-overlap"] == base
        # the dropless rows route the data with the model's aux-loss router (--moe-aux-loss-coeff 1e-3): the
        # published figure at that coefficient; every other row forces the balance or fakes it
        # (docs/experts.md, "Routing skew")
        assert a[a.index("--moe-skew") + 1] == "aux-loss" and "--moe-skew" not in c1.argv
        skewed = {r for r in MOE_ROWS if "moe_skew" in MOE_ROWS[r]["parallelism"]}
        assert skewed == {r for r in MOE_ROWS if r.endswith("_dropless")} and len(skewed) == 4
        fsdp = FID.express(MOE_ROWS["megatron_moe_zoo_h100_bf16_qwen3_235b_tp2_ep8_fsdp"], Path(d)).argv
        assert fsdp[fsdp.index("--mesh") + 1] == "dp=32,ep=4,tp=2" and "zero3" in fsdp[fsdp.index("--strategy") + 1]
        assert fsdp[fsdp.index("--framework") + 1] == "megatron" and fsdp[fsdp.index("--grad-accum") + 1] == "4"
        # 128k: tp 4 x cp 8, dp 1, EP 8 (ETP 1): the expert group takes 2 of the cp ranks (ep-from=cp)
        c3 = FID.express(MOE_ROWS["megatron_moe_zoo_h100_bf16_qwen3_235b_seq128k_tp4_cp8_pp8_ep8_dropless"], Path(d))
        a = c3.argv
        assert c3.gpus == 256 and c3.measured == 357 and a[a.index("--mesh") + 1] == "pp=8,dp=1,cp=4,ep=2,tp=4"
        assert {"ep", "etp=1", "cp", "cp-attention=ring", "ep-from=cp"} <= set(a[a.index("--strategy") + 1].split(","))
        assert a[a.index("--batch") + 1] == "256" and a[a.index("--microbatches") + 1] == "256"
        assert "ep-from=cp" not in c2.argv[c2.argv.index("--strategy") + 1]  # cp=2: ep from the dp ranks
        nxt = FID.express(MOE_ROWS["megatron_moe_zoo_h100_bf16_qwen3_next_80b_a3b_tp1_pp4_ep32"], Path(d)).argv
        assert nxt[nxt.index("--model") + 1] == "qwen3-next-80b-a3b" and nxt[nxt.index("--seq") + 1] == "4096"
        assert nxt[nxt.index("--mesh") + 1] == "pp=4,dp=1,ep=32,tp=1" and nxt[nxt.index("--virtual-stages") + 1] == "3"
        other = dict(MOE_ROWS["automodel_h100_bf16_qwen3_30b_a3b"])
        other["measured"] = {"tflops_per_gpu": 277, "flops_definition": "NeMo AutoModel 'Model TFLOPs/sec/GPU'"}
        with pytest.raises(FID.Unsupported, match="MoE TFLOP/s by another FLOP definition"):
            FID.express(other, Path(d))
    step = 10.0
    gib = float(2**30)
    fake = {"pipeline": {"step_overlap_s": step, "pipeline_s": 9.0, "bubble_s": 0.5,
                         "devices": [{"memory": {"reserved": 60 * gib, "device_total": 62 * gib}}]}}
    orig = FID.run_cli
    try:
        FID.run_cli = lambda argv: fake
        pred, mem = FID.predict(c1)
    finally:
        FID.run_cli = orig
    assert pred == pytest.approx(FID.megatron_core_moe_flops(c1.row) / step / 256 / 1e12, rel=1e-12)
    assert mem == 60.0 and c1.device_need_gib == 62.0


def test_dropless_rows_are_predicted_slower_than_forced_balance() -> None:
    """The 16k rows: one layout, forced balance (random router logits, 295 TF/GPU) and the model's
    aux-loss router (237): the latter planned with --moe-skew aux-loss is predicted slower (its busiest
    of the 8 expert ranks (1.52 + 15 x 126.48 / 127) / 16 = 1.0287 x the mean), where without the
    skew both were the same plan (285.0 TF/GPU)."""
    rows = [MOE_ROWS[f"megatron_moe_zoo_h100_bf16_qwen3_235b_seq16k_tp4_cp1_pp8_ep8_{k}"] for k in ("forced", "dropless")]
    with tempfile.TemporaryDirectory() as d:
        forced, dropless = (FID.predict(FID.express(r, Path(d)))[0] for r in rows)
    assert dropless < forced * 0.995 and dropless > forced * 0.95


def test_a_command_is_planned_once_per_evaluation(monkeypatch: pytest.MonkeyPatch) -> None:
    """evaluate plans each command once: a row evaluated twice reads the first's plan; the
    Megatron-MoE zoo's forced and dropless rows of a sequence length are two commands (the dropless
    one's --moe-skew aux-loss); torchtitan's rows at another power limit write another device file
    under one name, so they are two commands. (test_moe_docs_are_current: the figures so read are
    those published.)"""
    gib = float(2**30)
    fake = {"pipeline": {"step_overlap_s": 10.0, "pipeline_s": 9.0, "bubble_s": 0.5,
                         "devices": [{"memory": {"reserved": 60 * gib, "device_total": 62 * gib}}]}}
    planned: list[list[str]] = []
    monkeypatch.setattr(FID, "run_cli", lambda argv: planned.append(argv) or fake)
    zoo = "megatron_moe_zoo_h100_bf16_qwen3_235b_seq16k_tp4_cp1_pp8_ep8_"
    rows = [MOE_ROWS[zoo + "forced"], MOE_ROWS[zoo + "dropless"], MOE_ROWS[zoo + "forced"]]
    results, unsupported = FID.evaluate(rows)
    assert not unsupported and len(planned) == 2 and [r["id"] for r in results] == [zoo + k for k in
                                                                                   ("forced", "dropless", "forced")]
    assert [x for x in planned[1] if x not in ("--moe-skew", "aux-loss")] == planned[0]
    assert results[0]["predicted"] == results[2]["predicted"] and results[2]["breakdown"]["step"] == 10.0
    assert results[0]["breakdown"] is not results[2]["breakdown"]
    titan = next(r for r in ROWS if "96GB" in r["hardware"]["gpu"])
    capped = dict(titan, hardware={**titan["hardware"], "gpu": titan["hardware"]["gpu"].replace("500 W", "400 W")})
    planned.clear()
    FID.evaluate([titan, capped, titan])
    assert len(planned) == 2 and planned[0] == planned[1]  # one argv, two device files


# -- the out-of-sample check: llm-foundry's MPT tables (benchmarks/data/foundry-runs.json) -------------

FF = sys.modules["fidelity_foundry"]
FOUNDRY: dict[str, dict[str, Any]] = {r["id"]: r for r in json.loads(FF.FOUNDRY_RUNS.read_text())}


def _foundry_case(rid: str) -> Any:
    with tempfile.TemporaryDirectory() as d:
        return FID.express(FOUNDRY[rid], Path(d))


def test_every_foundry_row_is_expressed() -> None:
    """All 216 rows of llm-foundry's five tables are planned (none has CPU offload, the one feature
    counted unsupported), as Composer's FSDP runs them: data parallel over every GPU, eager ops."""
    assert len(FOUNDRY) == 216
    with tempfile.TemporaryDirectory() as d:
        for row in FOUNDRY.values():
            argv = FID.express(row, Path(d)).argv
            assert argv[argv.index("--mesh") + 1] == f"dp={row['hardware']['num_gpus']},tp=1"
            assert argv[argv.index("--framework") + 1] == "torchtitan" and "--no-compile" in argv
    offload = {**FOUNDRY["foundry_a100_40gb_bf16_7b_s4096_g8_mb6"]}
    offload["parallelism"] = {**offload["parallelism"], "activation_cpu_offload": True}
    with tempfile.TemporaryDirectory() as d, pytest.raises(FID.Unsupported, match="activation CPU offload"):
        FID.express(offload, Path(d))


def test_a_foundry_row_is_the_command_its_table_line_says() -> None:
    """'|  7b | 4096 | 8 | a100_40gb | 50.11 | 66.82 | 156 | 6 | 4 | 192 | ... | bf16 | PURE | FULL_SHARD |
    True | False |': MPT-7B (d 4096, 32 heads, 32 layers, mlp 4d, vocab 50368, tied, biases, learned
    positions) at seq 4096 on 8 A100 40GB, FULL_SHARD, micro-batch 6 x 4 accumulations x 8 = 192,
    every block checkpointed, PURE (gradients reduced in bf16)."""
    row = FOUNDRY["foundry_a100_40gb_bf16_7b_s4096_g8_mb6"]
    assert row["source"]["source_row"].startswith("|  7b | 4096 | 8 | a100_40gb | 50.11 |")
    a = _foundry_case(row["id"]).argv
    opt = {k: a[a.index(k) + 1] for k in ("--mesh", "--strategy", "--device", "--precision", "--recompute",
                                           "--batch", "--grad-accum", "--grad-dtype")}
    assert opt == {"--mesh": "dp=8,tp=1", "--strategy": "dp,zero3", "--device": "a100-40gb", "--precision": "bf16",
                   "--recompute": "full", "--batch": "48", "--grad-accum": "4", "--grad-dtype": "bf16"}
    cfg = json.loads(a[a.index("--model-config") + 1])
    assert {k: cfg[k] for k in ("arch", "activation", "attention", "layers", "hidden", "heads", "kv_heads", "ffn",
                                "vocab", "seq", "tied_embeddings", "linear_bias")} == \
        {"arch": "gpt2", "activation": "gelu", "attention": "flash", "layers": 32, "hidden": 4096, "heads": 32,
         "kv_heads": 32, "ffn": 16384, "vocab": 50368, "seq": 4096, "tied_embeddings": True, "linear_bias": True}
    # SHARD_GRAD_OP is ZeRO-2; DEFAULT reduces in fp32 (no --grad-dtype); fp8 runs the linears in fp8
    b = _foundry_case("foundry_h100_80gb_bf16_3b_s2048_g512_mb8").argv
    assert b[b.index("--strategy") + 1] == "dp,zero2" and "--grad-dtype" not in b and "--grad-accum" not in b
    assert b[b.index("--batch") + 1] == "4096" and b[b.index("--recompute") + 1] == "none"
    c = _foundry_case("foundry_h100_80gb_fp8_3b_s512_g8_mb40").argv
    assert c[c.index("--precision") + 1] == "fp8"


def test_foundry_rows_run_flash_attn_cross_entropy_of_their_commit() -> None:
    """MPT's default loss_fn, fused_crossentropy: flash-attn's CrossEntropyLoss of the flash-attn the
    row's commit installed: 300cc5c58 and b2a43a147 ``.[gpu]`` (flash-attn 1.x: the CUDA xentropy),
    5e85bd62d ``.[gpu-flash2]`` (flash-attn 2.4.2: the Triton kernel)."""
    for rid, kernel in (("foundry_a100_40gb_bf16_7b_s4096_g8_mb6", "flash-attn-xentropy"),    # 300cc5c58
                        ("foundry_h100_80gb_fp8_3b_s512_g8_mb40", "flash-attn-xentropy"),     # b2a43a147
                        ("foundry_h100_80gb_bf16_3b_s2048_g512_mb8", "flash-attn-triton")):   # 5e85bd62d
        a = _foundry_case(rid).argv
        assert a[a.index("--cross-entropy-kernel") + 1] == kernel, rid


@pytest.mark.parametrize("rid", ["foundry_a100_40gb_bf16_125m_s2048_g8_mb26", "foundry_a100_80gb_bf16_125m_s65536_g8_mb1",
                                 "foundry_h100_80gb_bf16_70b_s2048_g512_mb8", "foundry_a100_80gb_bf16_30b_s8192_g8_mb1"])
def test_foundry_models_have_the_published_parameter_counts(rid: str) -> None:
    """The NumParams column exactly: V d + s d + L (12 d^2 + 13 d) + 2 d (tied embedding, learned
    positions, a bias in every linear and norm: MPT's no_bias=False), e.g. 125M at seq 2048:
    125,311,488."""
    row = FOUNDRY[rid]
    m = row["model"]
    V, d, L, s = m["vocab"], m["hidden"], m["layers"], m["seq_len"]
    published = round(m["params_b"] * 1e9)
    assert published == V * d + s * d + L * (12 * d * d + 13 * d) + 2 * d
    assert _params(row) == published


def test_foundry_mfu_reproduces_the_published_column() -> None:
    """llm-foundry's MFU from its tokens/s: MPT-70B on 512 H100s, 1007 tokens/s/GPU x (6 N + 12 L d s)
    / 989.5e12 = 41.25% (the table's); every row's to 0.01 point from its tokens/s."""
    row = FOUNDRY["foundry_h100_80gb_bf16_70b_s2048_g512_mb8"]
    by_hand = (6 * 64862437376 + 12 * 80 * 8192 * 2048) * 1007 / 989.5e12 * 100
    assert FF.foundry_mfu_pct(row, 1007) == pytest.approx(by_hand, rel=1e-12)
    assert by_hand == pytest.approx(41.25, abs=0.01)
    for r in FOUNDRY.values():
        got = FF.foundry_mfu_pct(r, r["measured"]["tokens_per_sec"] / r["hardware"]["num_gpus"])
        assert got == pytest.approx(r["measured"]["mfu_pct"], abs=0.01), r["id"]


def test_foundry_rows_stay_out_of_the_calibration() -> None:
    """The out-of-sample rows are in no file the band or the sustained-rate calibration reads."""
    assert FID.RUNS.name == "published-runs.json" and FF.FOUNDRY_RUNS != FID.RUNS
    assert FID.band_json([])["runs_file"] == "benchmarks/data/published-runs.json"
    assert "foundry" not in (ROOT / "benchmarks" / "calibrate_sustained.py").read_text()
    assert not any(r["id"].startswith("foundry_") for r in ROWS)


# -- the out-of-sample runs (benchmarks/data/outside-runs.json) --------------------------------------------

OUTSIDE: list[dict[str, Any]] = json.loads(FID.OUTSIDE_RUNS.read_text())


def _outside(rid: str) -> dict[str, Any]:
    return next(r for r in OUTSIDE if r["id"] == rid)


def _opt(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_outside_runs_are_expressed_or_named_unsupported() -> None:
    reasons: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as d:
        for row in OUTSIDE:
            try:
                case = FID.express(row, Path(d))
            except FID.Unsupported as exc:
                reasons.setdefault(str(exc), []).append(row["id"])
                continue
            assert case.argv[0] == "plan" and case.gpus == row["hardware"]["num_gpus"]
    # OPT-175B: 2M tokens = 1,024 sequences over 992 / 8 = 124 data-parallel ranks: its batch a rank is not known
    assert reasons == {"global batch 1024 not a multiple of dp x micro-batch 124": ["opt_175b_992gpu"]}
    assert {r["id"].split("_")[0] for r in OUTSIDE} == {"llama3", "bloom", "mtnlg", "megatron2021", "opt"}
    assert len(OUTSIDE) == 9


def test_bloom_is_expressed_as_its_slurm_script_ran_it() -> None:
    # tr11-176B-ml.slurm: TP 4, PP 12 on 48 nodes of 8, MBS 2, GBS 2048, --checkpoint-activations, --bf16, ZeRO
    # stage 0 with the bf16 optimizer's own stage-1 sharding, DeepSpeed's PipelineEngine, CUDA_LAUNCH_BLOCKING=1
    with tempfile.TemporaryDirectory() as d:
        case = FID.express(_outside("bloom_176b_384gpu"), Path(d))
    argv = case.argv
    assert _opt(argv, "--mesh") == "pp=12,dp=8,tp=4" and _opt(argv, "--strategy") == "dp,megatron,zero1"
    assert _opt(argv, "--recompute") == "full" and _opt(argv, "--precision") == "bf16"
    assert _opt(argv, "--batch") == "2048" and _opt(argv, "--microbatches") == "128"  # 8 x 2 x 128 sequences
    # 'type:transformer|embedding': 70 layers + 2 embeddings = 72 parts, 6 a stage, an embedding on each end stage
    assert _opt(argv, "--stages") == ",".join(["5"] + ["6"] * 10 + ["5"])
    assert {"--no-p2p-overlap", "--no-grad-overlap", "--no-async-tp-allreduce", "--no-wgrad-fusion"} <= set(argv)
    cfg = json.loads(_opt(argv, "--model-config"))
    assert (cfg["attention"], cfg["vocab"], cfg["layers"], cfg["ffn"], cfg["dropout"]) == ("eager", 250880, 70, 57344, 0.1)
    assert case.metric == "step_time_s" and case.measured == 105.22


def test_llama3_long_context_row_is_expressed_as_table4_states() -> None:
    # 16,384 GPUs = TP 8 x CP 16 x PP 16 x DP 8; 16 sequences of 131,072 a DP rank; all-gather cp attention;
    # FSDP without resharding after forward: ZeRO-2; 126 layers + embedding and loss chunks = 16 x 8 one-layer chunks
    with tempfile.TemporaryDirectory() as d:
        case = FID.express(_outside("llama3_t4_405b_16384gpu_cp16_128k"), Path(d))
    argv = case.argv
    assert _opt(argv, "--mesh") == "pp=16,dp=8,cp=16,tp=8"
    assert _opt(argv, "--strategy") == "dp,megatron,sp,cp,zero2,cp-attention=allgather"
    assert _opt(argv, "--batch") == "128" and _opt(argv, "--microbatches") == "16"
    assert _opt(argv, "--virtual-stages") == "8" and _opt(argv, "--stages") == ",".join(["0"] + ["1"] * 126 + ["0"])
    assert json.loads(_opt(argv, "--model-config"))["seq"] == 131072 and case.metric == "tflops_per_gpu"


def test_outside_flop_counts_reproduce_the_stated_tflops() -> None:
    # BLOOM's log: 149.02 TFLOP/s at 105.22 s an iteration on 384 GPUs, Megatron-DeepSpeed's eq. 3 with the
    # checkpoint factor 4: 96 B s l h^2 (1 + s/(6h) + V/(16 l h)), B = s = 2048, l 70, h 14336, V 250880
    bloom = _outside("bloom_176b_384gpu")
    f = FID.flops_of(bloom)
    assert f == pytest.approx(96 * 2048 * 2048 * 70 * 14336**2 * (1 + 2048 / (6 * 14336) + 250880 / (16 * 70 * 14336)))
    assert f / (105.22 * 384) / 1e12 == pytest.approx(149.02, abs=0.05)
    # MT-NLG Sec. 2.4: 60.1 / 50.2 / 44.4 s on 280 / 350 / 420 DGX A100 = 126 / 121 / 113 TFLOP/s; eq. 3 at
    # B 1920, l 105, h 20480, V 51200 gives 125.7 / 120.4 / 113.5 (the paper's rounding: within 1%)
    for nodes, secs, tflops in ((280, 60.1, 126), (350, 50.2, 121), (420, 44.4, 113)):
        row = _outside(f"mtnlg_530b_{nodes * 8}gpu")
        assert FID.flops_of(row) / (secs * nodes * 8) / 1e12 == pytest.approx(tflops, rel=0.01)
    # Megatron-LM's README, GPT-3 175B on 1024 A100s: 'around 32 seconds ... 138 teraFLOPs per GPU' (eq. 3: 137.7)
    gpt3 = _outside("megatron2021_gpt3_175b_1024gpu")
    assert FID.flops_of(gpt3) / (32 * 1024) / 1e12 == pytest.approx(138, rel=0.005)


def test_megatron_2021_gpt3_example_is_expressed_as_its_script_ran_it() -> None:
    # examples/pretrain_gpt3_175B.sh: TP 8, PP 16 on 128 nodes of 8, MBS 1, GBS 1536, --fp16,
    # --checkpoint-activations, no virtual stages, no --DDP-impl (megatron/arguments.py's default: local)
    with tempfile.TemporaryDirectory() as d:
        case = FID.express(_outside("megatron2021_gpt3_175b_1024gpu"), Path(d))
    argv = case.argv
    assert _opt(argv, "--mesh") == "pp=16,dp=8,tp=8" and _opt(argv, "--strategy") == "dp,megatron"
    assert _opt(argv, "--batch") == "1536" and _opt(argv, "--microbatches") == "192" and "--schedule" not in argv
    # Megatron-LM of 2021: blocking sends, scatter-gather, no async tp all-reduce nor wgrad fusion; its local DDP
    # planned as the sc21 rows' (no --no-grad-overlap: docs/devices.md "--no-grad-overlap")
    assert {"--no-p2p-overlap", "--pp-scatter-gather", "--no-async-tp-allreduce", "--no-wgrad-fusion"} <= set(argv)
    assert "--no-grad-overlap" not in argv
    assert _opt(argv, "--precision") == "fp16" and _opt(argv, "--recompute") == "full"


def test_outside_runs_are_kept_out_of_the_band_and_the_calibration() -> None:
    calibrate = (ROOT / "benchmarks" / "calibrate_sustained.py").read_text()
    assert "OUTSIDE" not in calibrate and "outside-runs" not in calibrate and "fidelity.RUNS" in calibrate
    assert FID.OUTSIDE_RUNS != FID.RUNS and not {r["id"] for r in ROWS} & {r["id"] for r in OUTSIDE}
    # every out-of-sample runs file (NeMo 24.03's long-sequence table among them): its own section, none of its
    # runs in the published set (band.json's), its name and constant absent from the calibration
    paths = [x.path for x in FID.EXTRA_RUNS]
    assert FID.NEMO_LONG_RUNS in paths and FF.FOUNDRY_RUNS in paths and FID.RUNS not in paths and FID.MOE_RUNS not in paths
    assert FID.TORCHTITAN_2025.path in paths  # torchtitan's 2025 benchmarks (async TP, float8, H200)
    for path in paths:
        assert path.name not in calibrate and "EXTRA_RUNS" not in calibrate
        assert not {r["id"] for r in ROWS} & {r["id"] for r in json.loads(path.read_text())}
    assert "NEMO_LONG" not in calibrate


def test_extra_sections_are_split_off_whole() -> None:
    s0 = FID.summarise([], {})
    moe = ["", FID.MOE_HEADING, "", "- a line"]
    x = FID.EXTRA_RUNS[0]
    extra = FID.extra_section(x, [], {"a feature": ["a_run"]}, s0, [])
    grouped = FID.extra_section(FF.FOUNDRY, [], {}, s0, [])  # the last section: no heading after it but AFTER_MOE's
    doc = FID.markdown([], {}, s0, moe + extra + grouped)
    rest, section = FID.split_moe_section(doc)
    assert section == moe
    rest, section = FID.split_section(rest, x.heading)
    assert section == extra and section[-1] == "- unsupported a feature: a_run"
    rest, section = FID.split_section(rest, FF.FOUNDRY.heading)
    assert section == grouped and rest == FID.markdown([], {}, s0)


def test_a_grouped_section_tables_the_error_by_group() -> None:
    # llm-foundry's section: the error in all and by GPU, checkpointing and sharding, the worst rows, no unit column
    rows = [FOUNDRY["foundry_a100_40gb_bf16_7b_s4096_g8_mb6"], FOUNDRY["foundry_h100_80gb_bf16_3b_s2048_g512_mb8"]]
    res = [{"id": r["id"], "metric": "tokens_per_sec_per_gpu", "measured": 100.0, "predicted": p, "ratio": p / 100,
            "memory_gib": 1.0, "fits": True, "assumptions": ["a"], "group": r["id"]} for r, p in zip(rows, (90.0, 120.0))]
    sec = FID.extra_section(FF.FOUNDRY, res, {}, FID.summarise(res, {}), rows)
    assert "| all | 2 | 15.0% | 19.0% | 0% | 50% | 1.050 |" in sec
    assert "| GPU: A100 40GB bf16 | 1 | 10.0% | 10.0% | 0% | 100% | 0.900 |" in sec
    assert "| GPU: H100 80GB bf16 | 1 | 20.0% | 20.0% | 0% | 0% | 1.200 |" in sec
    assert sec[sec.index("| run | measured | predicted | ratio | memory GiB | fits |") + 2].endswith("| 100 | 90 | 0.900 | 1.0 | yes |")
    assert "The worst rows: foundry_h100_80gb_bf16_3b_s2048_g512_mb8 1.200, foundry_a100_40gb_bf16_7b_s4096_g8_mb6 0.900." in sec
    assert not any(line.startswith("- foundry_") for line in sec)  # no assumptions listed: 216 rows


@pytest.mark.parametrize("x", FID.EXTRA_RUNS, ids=[x.path.stem for x in FID.EXTRA_RUNS])
def test_outside_docs_are_current(x: Any) -> None:
    """docs/fidelity.md's out-of-sample sections (the largest runs, NeMo's long-sequence and later runs,
    llm-foundry's, torchtitan's 2025 runs) are what the code predicts today (fails until ``python
    benchmarks/fidelity.py --write`` has written them); one test a section, so that the workers share them."""
    _, section = FID.split_section((ROOT / "docs" / "fidelity.md").read_text(), x.heading)
    assert section, f"docs/fidelity.md has no section {x.heading!r}: run: python benchmarks/fidelity.py --write"
    assert section == FID.evaluate_section(x), "run: python benchmarks/fidelity.py --write"


# -- the out-of-sample long-sequence runs (benchmarks/data/nemo-long-runs.json) ------------------------------

NEMO_LONG: list[dict[str, Any]] = json.loads(FID.NEMO_LONG_RUNS.read_text())


def _nemo_long(rid: str) -> dict[str, Any]:
    return next(r for r in NEMO_LONG if r["id"] == rid)


def test_nemo_long_runs_are_expressed_as_nemo_2407s_cp_rows() -> None:
    # NVIDIA/NeMo performance_long_sequence.md, 'LLAMA2-7B (FP8) - H100': 9 rows, 4K to 1024K tokens, every one
    # expressible; cp > 1 as NeMo 24.07's rows: a cp mesh dim between dp and tp, TE's p2p ring, fp8, the
    # distributed optimizer, sp with tp; no TP overlap nor fused cross-entropy (24.03.01's llama2_7b.yaml)
    assert len(NEMO_LONG) == 9 and {r["parallelism"]["cp"] for r in NEMO_LONG} == {1, 2, 4, 8, 16, 32}
    with tempfile.TemporaryDirectory() as d:
        cases = {r["id"]: FID.express(r, Path(d)) for r in NEMO_LONG}
    for rid, case in cases.items():
        row = _nemo_long(rid)
        assert case.gpus == row["hardware"]["num_gpus"] and case.metric == "tokens_per_sec_per_gpu"
        assert _opt(case.argv, "--precision") == "fp8" and _opt(case.argv, "--framework") == "megatron"
        assert "--tp-comm-overlap" not in case.argv and "--cross-entropy-fusion" not in case.argv
        cfg = json.loads(_opt(case.argv, "--model-config"))
        assert (cfg["seq"], cfg["kv_heads"], cfg["ffn"], cfg["vocab"]) == (row["model"]["seq_len"], 32, 11008, 32000)
        assert "dropout" not in cfg
    top = cases["nemo2403_long_llama2_7b_1024k_1024gpu_cp32"].argv
    assert _opt(top, "--mesh") == "dp=4,cp=32,tp=8"
    assert _opt(top, "--strategy") == "dp,megatron,sp,cp,zero1,cp-attention=ring"
    assert _opt(top, "--batch") == "4" and "--grad-accum" not in top  # batch 4 over dp 4: one sequence a rank
    short = cases["nemo2403_long_llama2_7b_4k_4gpu_cp1"].argv
    assert _opt(short, "--mesh") == "dp=4,tp=1" and _opt(short, "--strategy") == "dp,zero1"
    assert (_opt(short, "--batch"), _opt(short, "--grad-accum")) == ("4", "256")  # batch 1024 over dp 4
    piped = cases["nemo2403_long_llama2_7b_8k_8gpu_cp1"].argv  # the one row with pp = 2: 512 / 4 microbatches
    assert _opt(piped, "--mesh") == "pp=2,dp=4,tp=1" and _opt(piped, "--microbatches") == "128"


def test_nemo2403_rows_are_measured_in_tokens_and_their_tflops_are_megatron_cores_count() -> None:
    # NVIDIA/NeMo 35029a0c84 (2024-10-07), the table's first version, gives Tokens / sec / GPU beside the
    # TFLOP/s: the ratio is taken on the tokens (no FLOP count needed), as NeMo 24.07's rows
    with tempfile.TemporaryDirectory() as d:
        metrics = {FID.express(r, Path(d)).metric for r in NEMO_LONG}
    assert metrics == {"tokens_per_sec_per_gpu"}
    # the 4K row by hand: 768 TFLOP/s at 16,671 tokens/s/GPU is 46.07 GFLOP a token. Megatron-Core's count
    # (core_r0.6.0 num_floating_point_operations: 12 l h^2 (1 + ffn/h x 3/2 + kv/heads + s/h + V/(2 l h)) a
    # token) is 46.08 GFLOP: inside the rounding of 768 (+-0.5) and 16,671; the launcher's auto_configurator
    # count (GPT-3's 24 h^2 MLP: (24 h^2 + 4 s h) x 3 l + 6 h V) is 45.88 GFLOP, 0.33% or more off
    row = _nemo_long("nemo2403_long_llama2_7b_4k_4gpu_cp1")
    s, h, l_, v = 4096, 4096, 32, 32000
    mcore = 12 * l_ * h * h * (1 + 11008 / h * 1.5 + 1 + s / h + v / (2 * l_ * h))
    launcher = (24 * h * h + 4 * s * h) * 3 * l_ + 6 * h * v
    assert mcore == pytest.approx(46.0849e9, rel=1e-5) and launcher == pytest.approx(45.8836e9, rel=1e-5)
    assert FID.megatron_core_flops(row) == pytest.approx(1024 * s * mcore, rel=1e-12) and FID.flops_of(row) == FID.megatron_core_flops(row)
    lo, hi = 767.5e12 / 16671.5, 768.5e12 / 16670.5  # the FLOP a token the two rounded figures allow
    assert lo < mcore < hi and not lo < launcher < hi
    # every row: TFLOP/s x 1e12 / tokens within the rounding of the two figures of Megatron-Core's count
    for r in NEMO_LONG:
        meas, tokens = r["measured"], r["parallelism"]["global_batch"] * r["model"]["seq_len"]
        per_token = FID.megatron_core_flops(r) / tokens
        tf, tok = meas["tflops_per_gpu"], meas["tokens_per_sec_per_gpu"]
        assert (tf - 0.5) * 1e12 / (tok + 0.5) < per_token < (tf + 0.5) * 1e12 / (tok - 0.5), r["id"]
    # the attention non-causal: at 1024K, 4 sequences, it is 97.7% of the count (a causal count: 0.512 of it)
    top = _nemo_long("nemo2403_long_llama2_7b_1024k_1024gpu_cp32")
    s = 1024 * 1024
    attn = 4 * 4 * s * s * h * 96
    assert attn / FID.flops_of(top) == pytest.approx(0.9765, abs=1e-4)
    # and the table's 318 tokens a second a GPU is a step of 12.88 s on 1,024 GPUs
    assert 4 * s / (318 * 1024) == pytest.approx(12.880, abs=0.001)

# -- the out-of-sample runs of NeMo's later performance summaries (benchmarks/data/nemo-runs.json) --------

NEMO: dict[str, dict[str, Any]] = {r["id"]: r for r in json.loads(FID.NEMO_RUNS.read_text())}


def test_nemo_runs_are_expressed_or_named_unsupported() -> None:
    reasons: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as d:
        for row in NEMO.values():
            try:
                case = FID.express(row, Path(d))
            except FID.Unsupported as exc:
                reasons.setdefault(str(exc), []).append(row["id"])
                continue
            assert case.argv[0] == "plan" and case.gpus == row["hardware"]["num_gpus"], row["id"]
            assert case.metric == "tokens_per_sec_per_gpu" and "--cross-entropy-fusion" in case.argv
            assert _opt(case.argv, "--grad-dtype") == "bf16" and _opt(case.argv, "--precision") == "fp8"
    # Qwen3-30B-A3B's recipe from Megatron-Bridge v0.4.0 on: HybridEP
    assert reasons == {
        "MoE dispatcher hybridep": ["nemo2606_h100_fp8_qwen3_30b_a3b_16gpu", "nemo260401_h100_fp8_qwen3_30b_a3b_16gpu",
                                    "nemo2604_h100_fp8_qwen3_30b_a3b_16gpu"]}
    # Llama 3 8B of 25.11: the first 5 of 32 layers recomputed (recompute_method block) without a pipeline
    with tempfile.TemporaryDirectory() as d:
        case = FID.express(NEMO["nemo2511_h100_fp8_llama3_8b_8gpu"], Path(d))
    assert _opt(case.argv, "--recompute") == "full:5" and _opt(case.argv, "--mesh") == "dp=8,tp=1"
    assert len(NEMO) == 27 and sum(1 for r in NEMO.values() if r["model"]["moe"]) == 14
    assert {r["id"].split("_")[0] for r in NEMO.values()} == {
        "nemo2509", "nemo2511", "nemo2602", "nemo260201", "nemo2604", "nemo260401", "nemo2606"}


def test_nemo_llama3_70b_row_is_expressed_as_its_recipe_ran_it() -> None:
    # 25.11's | LLAMA3_70B | 64 | FP8-CS | 128 | 1 | 8192 | 0 | 4 | 8 | 1 | 5 | 1 | 64 | 1602 | 719 |, with
    # Megatron-Bridge v0.2.0's LLAMA3_70B_H100_FP8_CS_BASE_CONFIG (TP 4, PP 8, VP 5) and llama3_70b_pretrain_config:
    # DP = 64 / (4 x 8) = 2, 128 / (2 x 1) = 64 microbatches, 80 layers / (8 x 5) = 2 a chunk (no --stages);
    # CommOverlapConfig(tp_comm_overlap=True), the distributed optimizer, grad_reduce_in_fp32 False,
    # cross_entropy_loss_fusion True, sequence parallel with TP
    row = NEMO["nemo2511_h100_fp8_llama3_70b_64gpu"]
    assert row["source"]["source_row"] == "| LLAMA3_70B | 64 | FP8-CS | 128 | 1 | 8192 | 0 | 4 | 8 | 1 | 5 | 1 | 64 | 1602 | 719 |"
    with tempfile.TemporaryDirectory() as d:
        case = FID.express(row, Path(d))
    argv = case.argv
    assert _opt(argv, "--mesh") == "pp=8,dp=2,tp=4" and _opt(argv, "--strategy") == "dp,megatron,sp,zero1"
    assert _opt(argv, "--batch") == "128" and _opt(argv, "--microbatches") == "64" and "--stages" not in argv
    assert _opt(argv, "--schedule") == "interleaved" and _opt(argv, "--virtual-stages") == "5"
    assert {"--tp-comm-overlap", "--cross-entropy-fusion"} <= set(argv) and _opt(argv, "--recompute") == "none"
    assert _opt(argv, "--precision") == "fp8" and _opt(argv, "--grad-dtype") == "bf16"
    cfg = json.loads(_opt(argv, "--model-config"))
    assert (cfg["layers"], cfg["hidden"], cfg["ffn"], cfg["heads"], cfg["kv_heads"], cfg["vocab"], cfg["seq"]) == \
        (80, 8192, 28672, 64, 8, 128256, 8192)
    assert "dropout" not in cfg and case.measured == 1602
    # the bf16 gradients are the recipe's (stated), not an assumption
    assert not any("gradients in bf16" in a for a in case.assumptions)


def test_nemo_qwen3_235b_row_is_expressed_as_its_recipe_ran_it() -> None:
    # 25.11's Qwen3-235B-A22B: TP 2, PP 8, VP 4, EP 32 on 256 GPUs; ETP = 1 (BASE_QWEN3_235B_A22B_CONFIG): the
    # expert group tp x ep = 2 x 16, EDP 256 / (8 x 32) = 1; GBS 2048 over 16 attention-DP ranks: 128
    # microbatches; alltoall with moe_a2a_overlap, forced balance (dropless), tp_comm_overlap False;
    # (94 + 2) / 32 = 3 a chunk with the embedding and the loss counted
    with tempfile.TemporaryDirectory() as d:
        case = FID.express(NEMO["nemo2511_h100_fp8_qwen3_235b_a22b_256gpu"], Path(d))
    argv = case.argv
    assert _opt(argv, "--mesh") == "pp=8,dp=1,ep=16,tp=2"
    assert _opt(argv, "--strategy") == "dp,ep,megatron,sp,zero1,etp=1"
    assert _opt(argv, "--batch") == "2048" and _opt(argv, "--microbatches") == "128"
    assert _opt(argv, "--moe-dispatcher") == "alltoall" and _opt(argv, "--moe-routing") == "topk"
    assert "--ep-comm-overlap" in argv and "--tp-comm-overlap" not in argv
    assert _opt(argv, "--stages") == ",".join(["2"] + ["3"] * 30 + ["2"]) and _opt(argv, "--model") == "qwen3-235b-a22b"


def test_nemo_2509_moe_rows_are_expressed_as_run_script_ran_them() -> None:
    # Megatron-Bridge v0.1.0rc3 scripts/performance/run_script.py, DeepSeek-V3 on H100: enable_deepep (flex
    # dispatcher, DeepEP), A2A_1F1B (overlap_moe_expert_parallel_comm, delay_wgrad_compute), recompute_modules
    # ['mla_up_proj', 'mlp'] and comm_overlap.overlap_grad_reduce = False; Qwen3-235B-A22B with
    # CommOverlapConfig(tp_comm_overlap=True), kept at TP 2 with sequence parallelism
    dsv3 = NEMO["nemo2509_h100_fp8_deepseek_v3_1024gpu_dropless"]
    with tempfile.TemporaryDirectory() as d:
        argv = FID.express(dsv3, Path(d)).argv
    assert _opt(argv, "--moe-dispatcher") == "deepep" and "--ep-comm-overlap" in argv
    assert _opt(argv, "--recompute") == "selective:mla_up_proj,mlp" and _opt(argv, "--moe-routing") == "topk"
    assert dsv3["parallelism"]["overlaps"] == "--overlap-param-gather" and "--no-grad-overlap" not in argv
    assert dsv3["basis"]["parallelism.dispatcher"] == "stated_companion"
    with tempfile.TemporaryDirectory() as d:
        argv = FID.express(NEMO["nemo2509_h100_fp8_qwen3_235b_a22b_256gpu_tokendrop"], Path(d)).argv
    assert "--tp-comm-overlap" in argv and "--ep-comm-overlap" not in argv and _opt(argv, "--moe-routing") == "balanced"
    with tempfile.TemporaryDirectory() as d:  # TP 1: run_script's tp_comm_overlap=True is dropped
        argv = FID.express(NEMO["nemo2509_h100_fp8_qwen3_30b_a3b_16gpu_tokendrop"], Path(d)).argv
    assert "--tp-comm-overlap" not in argv


def test_nemo_qwen3_30b_rows_name_what_their_sources_leave_open() -> None:
    # 25.11: the table's MBS 2 / VP 24 are not v0.2.0's preset (MBS 1, VP 12); 26.02: DeepEP, which the release's
    # known issues say the container does not support; 26.02.01: v0.3.0's layout, v0.3.1's preset is EP 16 HybridEP
    for rid, words in (("nemo2511_h100_fp8_qwen3_30b_a3b_16gpu", "MBS 2, VP 24"),
                       ("nemo2602_h100_fp8_qwen3_30b_a3b_16gpu", "DeepEP is not supported"),
                       ("nemo260201_h100_fp8_qwen3_30b_a3b_16gpu", "8901")):
        doubts = [a for a in NEMO[rid]["assumptions"] if a.startswith("run not determined")]
        assert len(doubts) == 1 and words in doubts[0], rid
    assert not any(a.startswith("run not determined") for r in NEMO.values() if "qwen3_30b" not in r["id"]
                   for a in r["assumptions"])
    # the container's Megatron-Bridge: stated by software-versions.md (25.09 .. 26.06) and known-issues.md (26.02.01)
    assert "stated: Megatron-Bridge docs/releases/software-versions.md" in NEMO["nemo2602_h100_fp8_qwen3_235b_a22b_256gpu"]["assumptions"][0]
    assert "Fixed in 26.02.01 (r0.3.1)" in NEMO["nemo260201_h100_fp8_qwen3_235b_a22b_256gpu"]["assumptions"][0]


MBRIDGE: dict[str, dict[str, Any]] = {r["id"]: r for r in json.loads(FID.MBRIDGE_RUNS.read_text())}


def test_mbridge_pr3868_row_is_expressed_as_its_comment_states_it() -> None:
    # PR #3868's handoff: 2 nodes x 8 H100, BF16, EP 16, TP 1, PP 1, CP 1, MBS 1, GBS 1024, alltoall
    # (--moe_flex_dispatcher_backend None), no EP overlap; eager 41.36 s a step (iterations 5-8). ETP 1: the
    # expert DP 16 / 16 = 1, 1024 / 16 = 64 microbatches of 1; the recipe's bf16 gradients, forced balance
    row = MBRIDGE["nemo_mbridge_pr3868_h100_bf16_qwen3_30b_a3b_16gpu"]
    with tempfile.TemporaryDirectory() as d:
        case = FID.express(row, Path(d))
    argv = case.argv
    assert case.metric == "step_time_s" and case.measured == 41.36 and case.gpus == 16
    assert _opt(argv, "--mesh") == "dp=1,ep=16,tp=1" and _opt(argv, "--strategy") == "dp,ep,zero1"
    assert _opt(argv, "--batch") == "16" and _opt(argv, "--grad-accum") == "64" and _opt(argv, "--precision") == "bf16"
    assert _opt(argv, "--moe-dispatcher") == "alltoall" and _opt(argv, "--moe-routing") == "topk"
    assert "--ep-comm-overlap" not in argv and "--tp-comm-overlap" not in argv and _opt(argv, "--grad-dtype") == "bf16"
    assert row["measured"]["tokens_per_sec_per_gpu"] == 6338  # 1024 x 4096 / 41.36 / 16
    assert "memory_gib_max" not in row["measured"]  # PR #3880's 61.35 GB is another run's
    calibrate = (ROOT / "benchmarks" / "calibrate_sustained.py").read_text()
    assert FID.MBRIDGE_RUNS in [x.path for x in FID.EXTRA_RUNS] and "mbridge" not in calibrate
    assert not set(MBRIDGE) & {r["id"] for r in ROWS} and not set(MBRIDGE) & set(NEMO)


def test_mbridge_pr3862_pair_is_expressed_as_its_table_states_it() -> None:
    # PR #3862's skill table (750d0d322): the same shape, 'no EP overlap | 41.25s', 'EP overlap plus
    # `delay_wgrad_compute` | 31.20s' (iterations 3-8); Megatron-Core's PP = 1 overlap: --ep-comm-overlap at --grad-accum 64
    for key, step, overlap in (("no_ep_overlap", 41.25, False), ("ep_overlap_dwgrad", 31.20, True)):
        row = MBRIDGE[f"nemo_mbridge_pr3862_h100_bf16_qwen3_30b_a3b_16gpu_{key}"]
        with tempfile.TemporaryDirectory() as d:
            case = FID.express(row, Path(d))
        argv = case.argv
        assert case.metric == "step_time_s" and case.measured == step and case.gpus == 16
        assert _opt(argv, "--mesh") == "dp=1,ep=16,tp=1" and _opt(argv, "--grad-accum") == "64"
        assert ("--ep-comm-overlap" in argv) == overlap and "--microbatches" not in argv
        assert row["source"]["commit"].startswith("750d0d322") and f"{step:.2f}s" in row["source"]["source_row"]
    assert "31.31 s" in MBRIDGE["nemo_mbridge_pr3862_h100_bf16_qwen3_30b_a3b_16gpu_ep_overlap_dwgrad"]["measured"]["note"]


def test_nemo_runs_are_kept_out_of_the_band_and_the_calibration() -> None:
    calibrate = (ROOT / "benchmarks" / "calibrate_sustained.py").read_text()
    assert "NEMO_RUNS" not in calibrate and "nemo-runs" not in calibrate and "fidelity.RUNS" in calibrate
    assert FID.NEMO_RUNS not in (FID.RUNS, FID.MOE_RUNS) and FID.NEMO_RUNS in [x.path for x in FID.EXTRA_RUNS]
    assert FID.band_json([])["runs_file"] == "benchmarks/data/published-runs.json"
    assert not set(NEMO) & {r["id"] for r in ROWS}
    # no row repeats one of the shared NeMo 24.07 rows (a later release, another figure)
    shared = {(r["model"]["layers"], r["parallelism"]["tp"], r["parallelism"]["pp"], r["parallelism"]["global_batch"],
               r["measured"]["tokens_per_sec_per_gpu"]) for r in ROWS if r["id"].startswith("nemo2407")}
    assert not shared & {(r["model"]["layers"], r["parallelism"]["tp"], r["parallelism"]["pp"],
                          r["parallelism"]["global_batch"], r["measured"]["tokens_per_sec_per_gpu"])
                         for r in NEMO.values()}
