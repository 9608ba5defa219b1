"""spmdkit.cost (compute, devices, step): per-op FLOPs against hand formulas, sharding on the local shapes, the
whole step's model FLOPs against 6N + attention, device presets and JSON files, the collectives
inside the vocab-parallel loss, DDP buckets, MFU, and every rule of the zoo and of the HF
imports costed."""

from __future__ import annotations

import io
import json
import math
import re
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from conftest import cli_stdout
from spmdkit.cli import main
from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.cost.compute import COSTED, kernel_collectives, model_flops, op_cost
from spmdkit.cost.devices import DEVICES, cost_model, device_from_json, load_device, recost
from spmdkit.cost.rates import HOPPER_SUSTAINED
from spmdkit.cost.step import estimate_step
from spmdkit.models.zoo import build_model, preset
from spmdkit.planner.planning import plan_model
from spmdkit.planner.propagate import propagate
from spmdkit.program.autodiff import GRADS
from spmdkit.program.ir import ProgramBuilder


def _plan(b: ProgramBuilder, mesh: ProcessMesh | None = None, ann: dict[str, Any] | None = None) -> Any:
    return propagate(b.build(), mesh or ProcessMesh([1]), ann or {})


def _matmul_prog(xs: list[int], ys: list[int], out: list[int], **attrs: Any) -> ProgramBuilder:
    b = ProgramBuilder()
    b.tensor("x", xs, "bfloat16", "input")
    b.tensor("w", ys, "bfloat16", "parameter")
    b.op("matmul", {"x": "x", "y": "w"}, [("h", out, "bfloat16")], **attrs)
    return b


@pytest.mark.parametrize(("xs", "ys", "out", "attrs", "bmnk"), [
    ([6, 5, 7], [7, 3], [6, 5, 3], {}, (6, 5, 3, 7)),
    ([6, 7, 5], [3, 7], [6, 5, 3], {"trans_x": True, "trans_y": True}, (6, 5, 3, 7)),
    ([4, 5, 7], [4, 3, 7], [4, 5, 3], {"trans_y": True}, (4, 5, 3, 7)),     # batched, both operands
    ([2, 1, 5, 7], [4, 7, 3], [2, 4, 5, 3], {}, (8, 5, 3, 7)),             # broadcast batch
    ([7], [7, 3], [3], {}, (1, 1, 3, 7)),                                  # vector x
])
def test_matmul_flops_are_2mnk(xs: list[int], ys: list[int], out: list[int], attrs: dict[str, Any],
                               bmnk: tuple[int, int, int, int]) -> None:
    plan = _plan(_matmul_prog(xs, ys, out, **attrs))
    c = op_cost(plan, 0)
    bt, m, n, k = bmnk
    assert c.flops == c.model_flops == 2 * bt * m * n * k
    assert c.matmul and c.covered and c.dtype == "bfloat16"
    assert c.bytes == 2 * (math.prod(xs) + math.prod(ys) + math.prod(out))


def test_matmul_grad_counts_2mnk_per_gradient() -> None:
    b = _matmul_prog([6, 5, 7], [7, 3], [6, 5, 3])
    b.phase = "backward"
    b.tensor("dh", [6, 5, 3], "bfloat16", "input")
    b.op("matmul_grad", {"x": "x", "y": "w", "out_grad": "dh"}, [("dx", [6, 5, 7], "bfloat16"),
                                                                  ("dw", [7, 3], "bfloat16")])
    b.op("matmul_grad", {"x": "x", "y": "w", "out_grad": "dh"}, [None, ("dw2", [7, 3], "bfloat16")])
    plan = _plan(b)
    assert op_cost(plan, 1).flops == 2 * 2 * 6 * 5 * 3 * 7
    assert op_cost(plan, 2).flops == 2 * 6 * 5 * 3 * 7  # only the weight gradient


def _attention_prog(causal: bool, b_: int = 2, s: int = 16, h: int = 4, hk: int = 2, d: int = 8) -> ProgramBuilder:
    b = ProgramBuilder()
    b.tensor("q", [b_, s, h, d], "bfloat16", "input")
    b.tensor("k", [b_, s, hk, d], "bfloat16", "input")
    b.tensor("v", [b_, s, hk, d], "bfloat16", "input")
    b.op("flash_attention", {"q": "q", "k": "k", "v": "v"},
         [("o", [b_, s, h, d], "bfloat16"), None, ("lse", [b_, h, s], "float32"), ("seed", [2], "int64")],
         causal=causal)
    b.phase = "backward"
    b.tensor("do", [b_, s, h, d], "bfloat16", "input")
    b.op("flash_attention_grad", {"q": "q", "k": "k", "v": "v", "out": "o", "softmax_lse": "lse",
                                  "seed_offset": "seed", "out_grad": "do"},
         [("dq", [b_, s, h, d], "bfloat16"), ("dk", [b_, s, hk, d], "bfloat16"),
          ("dv", [b_, s, hk, d], "bfloat16")], causal=causal)
    return b


@pytest.mark.parametrize("causal", [False, True])
def test_attention_flops_and_causal_halving(causal: bool) -> None:
    plan = _plan(_attention_prog(causal))
    full = 4 * 2 * 4 * 16 * 16 * 8  # QK^T and PV: 2·b·h·s·s·d each
    want = full // 2 if causal else full
    fwd, bwd = op_cost(plan, 0), op_cost(plan, 1)
    assert fwd.flops == fwd.model_flops == want and fwd.matmul
    assert bwd.flops == 2.5 * want and bwd.model_flops == 2 * want  # recomputed QK^T: executed, not model


def test_sharding_halves_per_device_matmul_flops() -> None:
    mesh = ProcessMesh([2])
    whole = op_cost(_plan(_matmul_prog([8, 16, 32], [32, 64], [8, 16, 64])), 0).flops
    for ann in ({"x": [0, -1, -1]},             # batch (data parallel)
                {"w": [-1, 0]},                 # columns (column parallel)
                {"x": [-1, -1, 0], "w": [0, -1]}):  # contraction: a partial output, same local work
        plan = _plan(_matmul_prog([8, 16, 32], [32, 64], [8, 16, 64]), mesh, ann)
        assert op_cost(plan, 0).flops == whole / 2, ann
    # uneven: the largest shard (9 rows over 2 ranks: 5)
    plan = _plan(_matmul_prog([9, 4], [4, 6], [9, 6]), mesh, {"x": [0, -1]})
    assert op_cost(plan, 0).flops == 2 * 5 * 6 * 4


def test_roofline_time_is_max_of_compute_and_memory() -> None:
    dev = DEVICES["h100"]
    big = op_cost(_plan(_matmul_prog([8, 2048, 4096], [4096, 4096], [8, 2048, 4096])), 0)
    # compute bound: the achievable rate of the one (16384, 4096, 4096) GEMM (tests/test_rates.py: 0.801 of
    # the peak (792.1 / 989) times 0.97 of tile and wave utilisation: 16 waves of 132 SMs for 2048 tiles of 256x128,
    # times K = 4096's saturation against the measured shape's K = 17920, K0 = 128), times the share of
    # those microbenchmarked rates an H100 sustains through training steps (HOPPER_SUSTAINED, 0.864)
    assert big.gemms == ((1, 16384, 4096, 4096),)
    rate = dev.peak["bf16"] * 792.1 / 989 * 2048 / (16 * 132) * (4096 / 4224) / (17920 / 18048) * HOPPER_SUSTAINED
    assert dev.op_time(big) == pytest.approx(big.flops / rate) and big.flops / rate > big.bytes / dev.hbm_rate
    thin = op_cost(_plan(_matmul_prog([4096, 4], [4, 4096], [4096, 4096])), 0)
    # memory bound: at the achievable HBM bandwidth, 0.90 of 3.35 TB/s
    assert dev.op_time(thin) == thin.bytes / (0.90 * 3350e9) > dev.compute_time(thin)


def _layer_params(cfg: Any) -> int:
    h, f, kv = cfg.hidden, cfg.ffn, cfg.n_kv * cfg.hdim
    if cfg.arch == "llama":
        return h * h + 2 * h * kv + h * h + 3 * h * f
    return 4 * h * h + 2 * h * f


@pytest.mark.parametrize(("name", "causal"), [("llama-7b", True), ("gpt2-small", True), ("gpt-dropout-small", False)])
def test_model_flops_per_token_match_6n_plus_attention(name: str, causal: bool) -> None:
    """Summed over every op of the step on one device, the model FLOPs per token are within 1%
    of 6N (N: the matmul weights, the LM head included) plus the attention: 12·L·h·s, halved
    by causal flash attention (llama, gpt2-small; the eager score matmuls of the Megatron GPT of
    2022 compute the whole square)."""
    cfg = preset(name)
    model = build_model(cfg, validate=False)
    plan = propagate(model.program, ProcessMesh([1]), {})
    tokens = cfg.batch * cfg.seq
    n = cfg.layers * _layer_params(cfg) + cfg.hidden * cfg.vocab
    att = 12 * cfg.layers * cfg.hidden * cfg.seq * (0.5 if causal else 1.0)
    want = 6 * n + att
    got = sum(op_cost(plan, i).model_flops for i in range(len(plan.program.ops))) / tokens
    assert abs(got / want - 1) < 0.01, (got, want)
    assert got >= want  # the elementwise ops add a little, never take away
    # MFU's numerator: the papers' formula exactly (every parameter but the lookup tables, the
    # attention over the full square)
    mf, n_params, attention = model_flops(plan, tokens)
    assert attention == 12 * cfg.layers * cfg.hidden * cfg.seq * tokens
    # the norms' weights (and gpt-2's biases: none in the zoo's matmuls) are parameters too
    norms = cfg.layers * 2 * cfg.hidden + cfg.hidden if cfg.arch == "llama" else (cfg.layers * 4 + 2) * cfg.hidden
    assert n_params == n + norms
    assert mf == 6 * (n + norms) * tokens + attention


def test_mfu_is_sane_for_every_preset() -> None:
    _, plan, _ = plan_model("llama-7b", "dp=2,tp=4", "megatron", {"layers": 2})
    for key, dev in DEVICES.items():
        p = recost(plan, cost_model(plan.mesh, dev))
        est = estimate_step(p, dev, 8 * 4096)
        assert est.uncovered == {}
        assert est.mfu is not None and 0 < est.mfu <= 1, key
        assert est.compute_total_s <= est.step_overlap_s <= est.step_serial_s * (1 + 1e-12)
        assert est.step_serial_s == pytest.approx(est.compute_total_s + est.comm_total_s, rel=1e-9)
        assert est.tokens_per_s == pytest.approx(8 * 4096 / est.step_overlap_s)
    a, h = (estimate_step(recost(plan, cost_model(plan.mesh, DEVICES[k])), DEVICES[k], 1) for k in ("a100-40gb",
                                                                                                    "h200"))
    assert h.compute_total_s < a.compute_total_s  # faster chip, less compute time


def test_presets_are_dense_datasheet_figures() -> None:
    """docs/devices.md: dense peaks (the datasheets' sparse figures halved), HBM, NVLink."""
    assert DEVICES["a100-40gb"].peak["bf16"] == 312e12 and DEVICES["a100-40gb"].hbm_bytes_per_s == 1555e9
    assert DEVICES["a100-80gb"].hbm_bytes_per_s == 2039e9 and DEVICES["a100-80gb"].peak["tf32"] == 156e12
    for k in ("h100", "h200"):
        assert DEVICES[k].peak["bf16"] == 1979e12 / 2 and DEVICES[k].peak["tf32"] == 989e12 / 2
        assert DEVICES[k].intra.bytes_per_s == 900e9 / 2
    assert DEVICES["h100"].hbm_bytes_per_s == 3350e9 and DEVICES["h200"].hbm_bytes_per_s == 4800e9
    text = (Path(__file__).resolve().parents[1] / "docs" / "devices.md").read_text()
    for fig in ("1,555", "2,039", "3.35", "4.8", "312", "156", "1,979", "989", "600", "900", "200", "400"):
        assert fig in text, fig


def test_links_map_onto_mesh_dims_by_ranks_per_node() -> None:
    mesh = ProcessMesh([4, 8], dim_names=["dp", "tp"])
    dev = DEVICES["h100"]
    cm = cost_model(mesh, dev)
    assert cm.links[1].beta_s_per_byte == 1 / 450e9 and cm.links[0].beta_s_per_byte == 1 / 50e9
    cm4 = cost_model(mesh, dev, ranks_per_node=4)  # tp=8 now spans two nodes
    assert cm4.links[1].beta_s_per_byte == 1 / 50e9
    cm32 = cost_model(mesh, dev, ranks_per_node=32)
    assert all(link.beta_s_per_byte == 1 / 450e9 for link in cm32.links)
    # recost: same steps and bytes, times from the new links
    _, plan, _ = plan_model("tiny-llama", "dp=2,tp=2", "megatron")
    p2 = recost(plan, cost_model(plan.mesh, DEVICES["a100-40gb"]))
    assert p2.bytes_per_rank == plan.bytes_per_rank and p2.time_s != plan.time_s
    assert [r.plan.steps[0].kind for r in p2.reshards if r.plan.steps] == \
        [r.plan.steps[0].kind for r in plan.reshards if r.plan.steps]


def test_vocab_parallel_loss_all_reduces_inside_the_kernel() -> None:
    _, plan, _ = plan_model("tiny-llama", "dp=2,tp=2", "megatron")
    ks = kernel_collectives(plan)
    assert [(k.what, k.reduce_type) for k in ks] == [("row max of the logits", "max"), ("label logit", "sum"),
                                                     ("sum of exp", "sum")]
    rows = 4 * 8 // 2  # batch 4 over dp=2, seq 8: float32 rows
    assert all(k.mesh_dims == (1,) and k.bytes_per_rank == round(2 * (2 - 1) / 2 * 4 * rows) for k in ks)
    link = plan.cost.links[1]
    assert ks[0].time_s == pytest.approx(2 * link.alpha_s + ks[0].bytes_per_rank * link.beta_s_per_byte)
    _, dp_only, _ = plan_model("tiny-llama", "dp=2,tp=2", "dp")
    assert kernel_collectives(dp_only) == []  # the plain loss: no communicating kernel


def test_gradient_reductions_go_into_ddp_buckets() -> None:
    _, plan, _ = plan_model("gpt2-small", "dp=8", "dp", {"layers": 4})
    dev = DEVICES["h100"]
    plan = recost(plan, cost_model(plan.mesh, dev))
    est = estimate_step(plan, dev, 8 * 1024)
    grads = [r for r in plan.reshards if not r.shared and plan.program.ops[r.op_index].phase == "optimizer"]
    assert sum(b.tensors for b in est.buckets) == len(grads)
    # bf16 gradients are reduced in fp32 (Megatron-LM, torchtitan): twice their bytes
    tensors = [plan.program.tensors[r.tensor] for r in grads]
    assert sum(b.bytes for b in est.buckets) == sum(t.nbytes * (2 if t.dtype == "bfloat16" else 1) for t in tensors)
    # Megatron-Core DDP buckets (the default framework): max(40M, 1M x dp) parameters, in fp32
    assert all(b.bytes >= 40_000_000 * 4 for b in est.buckets[:-1])
    assert all(b.start_s >= b.ready_s for b in est.buckets)
    assert all(x.start_s + x.time_s <= y.start_s + 1e-15 for x, y in zip(est.buckets, est.buckets[1:]))
    assert est.buckets[0].start_s < est.compute_s["forward"] + est.compute_s["backward"]  # during the backward
    assert est.step_overlap_s < est.step_serial_s
    assert est.comm_s["optimizer"] == 0  # every optimizer-phase collective was a gradient reduction


def test_every_zoo_rule_is_costed() -> None:
    rules = set(GRADS) | {g for g, _ in GRADS.values()}
    for name in ("tiny-llama", "tiny-gpt2"):
        for vp in (False, True):
            rules |= {op.rule for op in build_model(preset(name), vocab_parallel_loss=vp).program.ops}
    assert rules - COSTED == set()
    # of every registered rule, only the importer's stand-in for an unmapped op has no cost
    from spmdkit.engine.registry import rule_names

    assert set(rule_names(include_aliases=False)) - COSTED == {"replicated"}
    assert COSTED <= set(rule_names(include_aliases=False))
    _, plan, _ = plan_model("tiny-gpt2", "dp=2,tp=2", "megatron,sp")
    assert all(op_cost(plan, i).covered for i in range(len(plan.program.ops)))


#: HF training imports whose rules together are those of all 24 imports of the tests/test_hf.py
#: configs (12 models, forward and training: 75 rules, measured when this list was made; the
#: other 20 imports add no rule), so the test imports 4 models, not 12, twice
#: (model, training, how its MoE blocks import): mixtral twice, lowered to the moe ops and as
#: HF computes it (the grouped matmul a block the lowering does not match keeps)
_HF_COVER = [("gpt2", True, "dropless"), ("vit", True, "dropless"), ("t5", True, "dropless"),
             ("mixtral", True, "dropless"), ("mixtral", True, None)]


def test_every_rule_of_the_hf_imports_is_costed() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import test_hf
    from spmdkit.models.torch_import import import_module

    cfgs = test_hf._configs()
    seen: set[str] = set()
    for name, training, moe in _HF_COVER:
        cls, cfg = cfgs[name]
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            m = cls(cfg).to(torch.float32)
            m.eval()
            prog = import_module(m, (), test_hf._inputs(name, labels=training), fallback="error", training=training,
                                 moe=moe)
        seen |= {op.rule for op in prog.ops}
        est = estimate_step(propagate(prog, ProcessMesh([1]), {}), DEVICES["h100"], test_hf.B * test_hf.S)
        assert est.uncovered == {}, (name, est.uncovered)
    assert seen - COSTED == set()
    assert len(seen) >= 75


def test_uncovered_rules_are_listed_not_zero() -> None:
    b = ProgramBuilder()
    b.tensor("x", [4, 6], "float32", "input")
    b.op("logsumexp", {"x": "x"}, [("y", [4], "float32")], axis=(1,))
    prog = b.build()
    plan = propagate(prog, ProcessMesh([1]), {})
    assert op_cost(plan, 0).covered
    assert "replicated" not in COSTED
    # a rule without a cost: the estimate names it and times it by its bytes (never a silent zero)
    from spmdkit.engine import facts

    saved = facts._FACTS["logsumexp"]
    facts._FACTS["logsumexp"] = replace(saved, cost=None)
    try:
        est = estimate_step(plan, DEVICES["h100"])
        assert est.uncovered == {"logsumexp": 1}
        assert op_cost(plan, 0).bytes == (4 * 6 + 4) * 4
        # its bytes at the achievable bandwidth, at least one kernel launch (4 us)
        assert est.compute_total_s == max((4 * 6 + 4) * 4 / DEVICES["h100"].hbm_rate, 4e-6) == 4e-6
        out = io.StringIO()
        from spmdkit.outputs.report import write_estimate

        write_estimate(est, out)
        assert "NOT COSTED" in out.getvalue() and "logsumexp x1" in out.getvalue()
    finally:
        facts._FACTS["logsumexp"] = saved


def _run(*argv: str) -> tuple[int, str]:
    return cli_stdout(*argv)


def test_the_device_line_shows_the_calibrated_collectives(tmp_path: Path) -> None:
    """A calibrated device file: the collectives in a node run at the measured points
    (collectives.collective_time) and memory-bound ops at the measured HBM (Device.hbm_rate); the
    Device line showed the preset's 450 GB/s and 3350 GB/s alone."""
    f = tmp_path / "dev.json"
    f.write_text(json.dumps({"base": "h100", "name": "H100 (calibrated)", "measured": {
        "source": "test", "hbm_gb_per_s": 2900.0, "collectives": [
            {"op": "all_reduce", "ranks": 2, "scope": "intra_node", "bytes": 1 << 20, "time_us": 30.0},
            {"op": "all_reduce", "ranks": 2, "scope": "intra_node", "bytes": 1 << 28, "time_us": 1500.0}]}}))
    rc, out = _run("plan", "--model", "tiny-llama", "--mesh", "dp=2", "--strategy", "dp", "--device", str(f))
    assert rc == 0
    (line,) = [ln for ln in out.splitlines() if ln.startswith("Device:")]
    assert line.endswith("HBM 3350 GB/s (2900 GB/s measured, which the memory-bound ops run at), 8 ranks per node "
                         "(in a node all_reduce as measured (2 points), other ops 450 GB/s per GPU; across nodes "
                         "50 GB/s per GPU)"), line


def test_cli_plan_device_text_and_json() -> None:
    rc, out = _run("plan", "--model", "tiny-llama", "--mesh", "dp=2,tp=2", "--device", "h100", "--nodes-of", "2")
    assert rc == 0
    for part in ("Predicted step per device", "step time:", "tokens/s:", "MFU", "Collectives inside ops",
                 "NVIDIA H100", "2 ranks per node"):
        assert part in out, part
    rc, out = _run("plan", "--model", "tiny-llama", "--mesh", "dp=2,tp=2", "--device", "a100-80gb", "--json")
    assert rc == 0
    step = json.loads(out)["step"]
    assert step["tokens"] == 32 and 0 < step["mfu"] <= 1 and step["uncovered_rules"] == {}
    assert step["step_overlap_s"] <= step["step_serial_s"] * (1 + 1e-12) and step["flops_per_device"] > 0
    assert set(step["comm_s"]) == {"forward", "backward", "optimizer", "inside_ops", "gradient_buckets"}
    rc, plain = _run("plan", "--model", "tiny-llama", "--mesh", "dp=2,tp=2", "--json")
    assert "step" not in json.loads(plain)  # no device: no prediction
    # --nodes-of alone: the default links, tp across nodes when a node holds one rank
    rc, one = _run("plan", "--model", "tiny-llama", "--mesh", "dp=2,tp=2", "--nodes-of", "1", "--json")
    t_default, t_one = (json.loads(x)["totals"]["forward"]["time_s"] for x in (plain, one))
    assert rc == 0 and t_one > t_default and "step" not in json.loads(one)
    rc, out = _run("plan", "--model", "llama-7b", "--layers", "2", "--mesh", "dp=2,tp=4", "--device", "a100-40gb")
    assert re.search(r"memory: (fits with [\d.]+ GiB headroom|does not fit by [\d.]+ GiB) \(\d+% of 40 GiB\) "
                     r"on a NVIDIA A100 SXM4 40GB", out)


def test_device_json_file(tmp_path: Path) -> None:
    f = tmp_path / "mine.json"
    f.write_text(json.dumps({"base": "h100", "name": "H100 at 80% of peak", "peak_tflops": {"bf16": 791.6},
                             "inter_node": {"gb_per_s": 25}, "ranks_per_node": 4}))
    dev = load_device(str(f))
    assert dev.peak["bf16"] == pytest.approx(791.6e12) and dev.peak["fp32"] == 67e12
    assert dev.inter.bytes_per_s == 25e9 and dev.inter.alpha_s == DEVICES["h100"].inter.alpha_s
    assert dev.ranks_per_node == 4
    same = device_from_json(DEVICES["h200"].to_json())
    assert same.peak == pytest.approx(DEVICES["h200"].peak) and same.hbm_bytes_per_s == pytest.approx(4800e9)


@pytest.mark.parametrize(("content", "why"), [
    ("{oops", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"base": "h100", "color": "green"}', "unknown field 'color'"),
    ('{"peak_tflops": {"bf16": 100, "fp32": 10}}', "missing 'hbm_gb_per_s'"),
    ('{"peak_tflops": {"bf16": 100}, "hbm_gb_per_s": 1000}', "needs fp32"),
    ('{"base": "h100", "hbm_gb_per_s": -5}', "hbm_gb_per_s"),
    ('{"base": "h100", "peak_tflops": {"fp4": 5}}', "unknown dtype 'fp4'"),
    ('{"base": "h100", "efficiency": {"hbm": 1.2}}', "efficiency.hbm"),
    ('{"base": "h100", "efficiency": {"gemm": {"int4": 0.5}}}', "unknown dtype 'int4'"),
    ('{"base": "h100", "efficiency": {"attention": {"fa9": {"fwd": 0.5, "bwd": 0.4}}}}', "unknown kernel 'fa9'"),
    ('{"base": "h100", "efficiency": {"sms": 0}}', "efficiency.sms"),
    ('{"base": "h100", "efficiency": {"pace": 1}}', "unknown field 'pace'"),
    ('{"base": "h100", "inter_node": {"gb_per_s": 0}}', "inter_node.gb_per_s"),
    ('{"base": "h100", "ranks_per_node": 0}', "ranks_per_node"),
    ('{"base": "h100", "tf32": "yes"}', "tf32"),
    # the file's field, not a --device argument ('--device 'tpu': no such preset ... and not a .json file')
    ('{"base": "tpu"}', r"--device base: 'tpu' is not a preset \(one of a100-40gb, "),
    ('{"base": "h100", "intra_node": {"gb_per_s": 1e999}}', "intra_node.gb_per_s"),
    ('{"base": "h100", "memory_gb": 1e308}', "memory_gb"),
    ('{"base": "h100", "peak_tflops": {"bf16": NaN}}', "peak_tflops.bf16"),
])
def test_device_json_errors_are_one_line(tmp_path: Path, capsys: Any, content: str, why: str) -> None:
    f = tmp_path / "dev.json"
    f.write_text(content)
    with pytest.raises(ProgramError, match=why):
        load_device(str(f))
    assert main(["plan", "--model", "tiny-llama", "--mesh", "dp=2", "--strategy", "dp", "--device", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("spmdkit plan: ProgramError: --device") and "Traceback" not in err


def test_device_argument_errors(capsys: Any, tmp_path: Path) -> None:
    for argv, why in ((["--device", "tpu-v9"], "no such preset"), (["--device", str(tmp_path / "no.json")],
                                                                  "no such file"),
                      (["--device", "h100", "--nodes-of", "0"], "--nodes-of 0"),
                      (["--device", "h100", "--nodes-of", "x"], "--nodes-of")):
        assert main(["plan", "--model", "tiny-llama", "--mesh", "dp=2", "--strategy", "dp", *argv]) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1, err


def test_readme_step_example_is_real() -> None:
    """The README's --device example shows this run's lines, figure for figure."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    rc, out = _run("plan", "--model", "llama-7b", "--mesh", "dp=2,tp=4", "--strategy", "megatron", "--device", "h100")
    assert rc == 0
    shown = [ln for ln in out.splitlines() if ln.startswith(("Device:", "step time:", "FLOPs per device:", "tokens/s:"))]
    assert len(shown) == 4
    for ln in shown:
        assert ln in readme, ln


def test_c_embedding_all_reduce_is_the_reshard_of_its_partial_output() -> None:
    """c_embedding with vocab-sharded rows makes a partial output; the plan's reshard of it is
    the all-reduce (counted once), not a collective inside the kernel."""
    from spmdkit.outputs.report import step_kinds

    b = ProgramBuilder()
    b.tensor("ids", [4, 8], "int64", "input")
    b.tensor("table", [64, 16], "bfloat16", "parameter")
    b.op("c_embedding", {"weight": "table", "x": "ids"}, [("e", [4, 8, 16], "bfloat16")])
    b.op("relu", {"x": "e"}, [("r", [4, 8, 16], "bfloat16")])
    plan = _plan(b, ProcessMesh([2]), {"table": [0, -1]})
    kernel = kernel_collectives(plan)
    assert kernel == [] and step_kinds(plan, None, kernel) == {"all_reduce": 1}
    assert op_cost(plan, 0).bytes == 2 * (4 * 8 * 16 * 2) + 4 * 8 * 8  # rows read + written, the ids


def test_device_json_fuzz_is_a_device_or_a_program_error() -> None:
    """Seeded random device objects (wrong types, NaN, infinities, huge, nested, unknown keys):
    each is a Device or a ProgramError naming --device, never another exception."""
    import random

    rng = random.Random(15)
    values: list[Any] = [0, -1, 1, 2.5, 1e308, 1e30, 1e-320, float("nan"), float("inf"), True, None, "h100", [], {}, {"x": 1},
                         {"gb_per_s": 10}, {"latency_us": -1}, {"bf16": 100, "fp32": 10}, {"fp32": "x"}, 10**30]
    keys = ["base", "name", "peak_tflops", "hbm_gb_per_s", "memory_gb", "intra_node", "inter_node",
            "ranks_per_node", "tf32", "other"]
    ok = 0
    for _ in range(400):
        obj = {k: rng.choice(values) for k in rng.sample(keys, rng.randint(0, 5))}
        if rng.random() < 0.5:
            obj["base"] = rng.choice(["h100", "a100", "h200", "a100-40gb"])
        try:
            dev = device_from_json(json.loads(json.dumps(obj)))
        except ProgramError as exc:
            assert str(exc).startswith("--device") and "\n" not in str(exc)
            continue
        ok += 1
        assert all(math.isfinite(v) and v > 0 for v in dev.peak.values())
        assert dev.hbm_bytes_per_s > 0 and 1 <= dev.ranks_per_node
        assert math.isfinite(dev.intra.bytes_per_s) and math.isfinite(float(dev.memory_bytes))
    assert ok > 0
