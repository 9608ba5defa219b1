"""The cost and memory of MoE layers (spmdkit.cost.moe): expert GEMM FLOPs by hand, grouped
GEMM shapes, the routing ops' cost, the busiest ep rank's load under --moe-skew and
--moe-histogram (exactly the docstring's formula), their validation, model FLOPs on active
parameters, parameter memory with the experts sharded."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from dataclasses import replace

import pytest

from spmdkit.core.errors import ProgramError
from spmdkit.cost.collectives import Fabric, Group, collective_time
from spmdkit.cost.compute import model_flops, op_cost
from spmdkit.cost.devices import preset_device
from spmdkit.cost.memory import memory_per_device
from spmdkit.cost.moe import active_share, busiest_load, moe_layers, rank_load
from spmdkit.cost.step import estimate_step
from spmdkit.models.params import count_params
from spmdkit.models.source import Preset, load_preset
from spmdkit.models.zoo import preset
from spmdkit.planner.planning import plan_preset
from spmdkit.planner.propagate import propagate
from spmdkit.program.runtime import SKEW_FIGURES, Runtime, parse_moe_histogram, parse_moe_skew
from spmdkit.strategies.strategy import annotate, parse_mesh, parse_strategy

# Mixtral's shapes, one layer, short sequences: E = 8, top-2, H = 4096, F = 14336, C = S x 2 / 8
H, F, E, K = 4096, 14336, 8, 2
STACKS = ("layers.0.experts.w_gate", "layers.0.experts.w_up", "layers.0.experts.w_down")


def _plan(mesh: str = "dp=2", seq: int = 256, batch: int = 4, ep: bool = False):  # type: ignore[no-untyped-def]
    user = {s: [0, -1, -1] for s in STACKS} if ep else None  # the experts sharded over dp (ep = dp)
    return plan_preset("mixtral-8x7b", mesh, "dp", {"layers": 1, "seq": seq, "batch": batch}, user)[1]


def _expert_ops(plan, phase: str = "forward") -> list[int]:  # type: ignore[no-untyped-def]
    return [i for i, op in enumerate(plan.program.ops) if op.phase == phase and op.rule.startswith("matmul")
            and any(n in STACKS or n.startswith(STACKS) for n in op.input_names() + op.output_names())]


def test_the_layer_is_found_by_structure() -> None:
    layers = moe_layers(_plan().program)
    assert len(layers) == 1
    la = layers[0]
    assert (la.experts, la.top_k, la.capacity, la.tokens) == (E, K, 64, 256)
    assert set(la.stacks) == set(STACKS) and not la.padded
    assert active_share(_plan().program) == {s: K / E for s in STACKS}


def test_expert_gemm_flops_by_hand() -> None:
    """Forward: 2 x tokens x top_k x H x F x 3 (gate, up, down of SwiGLU) per device, the tokens
    the rank's batch rows route (dp=2: 2 of 4 sequences of 256); the backward twice that."""
    plan = _plan()
    tokens = 2 * 256
    fwd = sum(op_cost(plan, i).flops for i in _expert_ops(plan))
    assert fwd == 2 * tokens * K * H * F * 3
    bwd = sum(op_cost(plan, i).flops for i in _expert_ops(plan, "backward"))
    assert bwd == 2 * fwd


def test_expert_gemms_are_grouped_per_expert() -> None:
    """[B, E, C, H] x [E, H, F] runs as E GEMMs of B x C tokens each (not B x E of C); the
    weight gradient's K is the tokens. torch's grouped GEMM (torchtitan) is one grid over the 8
    experts; Megatron-Core's (TE's GroupedLinear: a cuBLAS GEMM an expert on 4 streams) two
    rounds of 4 (spmdkit.cost.moe.gemm_streams)."""
    plan = _plan()
    tt = replace(plan, runtime=Runtime(framework="torchtitan"))
    gate = next(i for i in _expert_ops(plan) if STACKS[0] in plan.program.ops[i].input_names())
    assert op_cost(tt, gate).gemms == ((E, 2 * 64, F, H),)
    assert op_cost(plan, gate).gemms == ((4, 2 * 64, F, H),) * 2
    grad = next(i for i in _expert_ops(plan, "backward") if "layers.0.experts.w_gate" in plan.program.ops[i].input_names())
    assert op_cost(tt, grad).gemms == ((E, 2 * 64, H, F), (E, H, F, 2 * 64))
    assert op_cost(plan, grad).gemms == ((4, 2 * 64, H, F),) * 2 + ((4, H, F, 2 * 64),) * 2


def test_expert_weight_gradient_accumulates_into_fp32_main_grad() -> None:
    """Under Megatron-Core (TE's GroupedLinear with ``fuse_wgrad_accumulation``) each expert's
    wgrad GEMM reads and writes its fp32 main_grad: the two rounds of wgrad GEMMs are the op's last
    two, their bytes the 8 experts' [H, F] gradients at 8 bytes and their bf16 operands (x [128, H]
    and dy [128, F] an expert); FSDP2 (torchtitan) writes a bf16 gradient: not counted so."""
    plan = _plan()
    grad = next(i for i in _expert_ops(plan, "backward") if "layers.0.experts.w_gate" in plan.program.ops[i].input_names())
    c = op_cost(plan, grad)
    assert c.wgrad_gemms == 2
    assert c.wgrad_bytes == 8 * E * H * F + 2 * E * (H * 128 + 128 * F)
    tt = op_cost(replace(plan, runtime=Runtime(framework="torchtitan")), grad)
    assert (tt.wgrad_gemms, tt.wgrad_bytes) == (0, 0.0)
    assert c.bytes - tt.bytes == (8 - 2) * E * H * F


def test_routing_ops_cost_their_bytes() -> None:
    """moe_gate_dispatch: x read once per chosen expert, the padded [E, C, H] written, the gate
    read twice, the index tensors three times; 5 kernels."""
    plan = _plan()
    i = next(i for i, op in enumerate(plan.program.ops) if op.rule == "moe_gate_dispatch")
    c = op_cost(plan, i)
    b, s = 2, 256
    x = b * s * H * 2 * K
    y = b * E * 64 * H * 2
    gate = 2 * b * s * E * 2
    idx = 3 * (b * s * K * 2 + b * K * s * 8 + b * E * 8 + b * s * K * 8)
    assert (c.bytes, c.kernels, c.matmul) == (x + y + gate + idx, 5, False)


@pytest.mark.parametrize(("skew", "rho"), [(1.0, 1.0), (1.875, 1.125), (2.75, 1.25), (3.625, 1.375)])
def test_skew_scales_the_busiest_rank_exactly(skew: float, rho: float) -> None:
    """ep = 2 over 8 experts (4 a rank): rho = (F + 3 (8 - F) / 7) / 4 = (F + 6) / 7; the
    expert GEMMs of the busiest rank do rho x the uniform FLOPs."""
    assert rank_load(Runtime(moe_skew=skew), E, K, 2) == pytest.approx(rho)
    plan = _plan(ep=True)
    uniform = sum(op_cost(plan, i).flops for i in _expert_ops(plan))
    skewed = replace(plan, runtime=Runtime(moe_skew=skew))
    assert set(busiest_load(skewed).values()) <= {rho}
    assert sum(op_cost(skewed, i).flops for i in _expert_ops(skewed)) == pytest.approx(rho * uniform)


def test_skew_raises_the_step_monotonically() -> None:
    plan = _plan(ep=True)
    dev = preset_device("h100")
    steps = [estimate_step(replace(plan, runtime=Runtime(moe_skew=f)), dev, 1024).step_overlap_s
             for f in (1.0, 1.5, 2.0, 3.0, 4.0)]
    assert all(a < b for a, b in itertools.pairwise(steps)), steps


def test_skew_without_ep_or_with_padding_changes_nothing() -> None:
    """One rank holds every expert (no ep): the same tokens; a capacity factor pads every
    expert's buffer to the capacity (the GEMMs run on the padded rows)."""
    assert rank_load(Runtime(moe_skew=3.0), E, K, 1) == 1.0
    plan = _plan()
    assert busiest_load(replace(plan, runtime=Runtime(moe_skew=3.0))) == {}


def test_the_mean_rounded_up_is_no_padding_and_a_factor_below_one_fills_every_expert() -> None:
    """Dropless routing's capacity is the mean rounded up: at 257 tokens Mixtral's experts average
    257 x 2 / 8 = 64.25 rows, capacity 65, and --moe-skew still loads the busiest ep rank (it
    was read as padding, 65 x 8 > 514, and the skew silently changed nothing); a capacity
    factor of 0.5 (capacity 33, every expert full, the tokens past it dropped) fixes each expert's
    rows at the capacity, so skew cannot raise them (it was priced at rho x the capacity). Experts
    over dp = 2 (ep = dp), as _plan(ep=True)."""
    skew = Runtime(moe_skew=3.0)
    odd = plan_preset("mixtral-8x7b", "dp=2", "dp", {"layers": 1, "seq": 257, "batch": 4},
                      {s: [0, -1, -1] for s in STACKS})[1]
    la = moe_layers(odd.program)[0]
    assert (la.capacity, la.tokens, la.padded) == (65, 257, False)
    loads = set(busiest_load(replace(odd, runtime=skew)).values())  # ep = 2: rho = (F + 6) / 7
    assert len(loads) == 1 and loads.pop() == pytest.approx((3.0 + 6) / 7)
    cfg = preset("mixtral-8x7b").with_(layers=1, seq=256, batch=4, capacity_factor=0.5)
    loaded = load_preset(Preset("mixtral-8x7b", 1, 4, 256), cfg)
    mesh = parse_mesh("dp=2")
    assert loaded.model is not None
    half = propagate(loaded.program, mesh, annotate(loaded.model, mesh, parse_strategy("dp", mesh),
                                                    {s: [0, -1, -1] for s in STACKS}))
    lh = moe_layers(half.program)[0]
    assert (lh.capacity, lh.padded) == (32, True)
    assert busiest_load(replace(half, runtime=skew)) == {}


def test_histogram_load_and_memory() -> None:
    """Tokens per expert [3, 1, 1, 1 | 1, 1, 1, 1] on 2 ep ranks: the busiest holds 6 of a mean
    5 (rho = 1.2); its dispatched activations grow by the same factor."""
    h = (3.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
    assert rank_load(Runtime(moe_histogram=h), E, K, 2) == pytest.approx(1.2)
    plan = _plan(ep=True)
    hist = replace(plan, runtime=Runtime(moe_histogram=h))
    a, b = memory_per_device(plan).saved, memory_per_device(hist).saved
    assert a is not None and b is not None
    sa = {n: x for lst in a.tensors.values() for n, x in lst}
    sb = {n: x for lst in b.tensors.values() for n, x in lst}
    assert sb["layers.0.experts.up"] == round(1.2 * sa["layers.0.experts.up"])
    assert sb["layers.0.mlp_norm.out"] == sa["layers.0.mlp_norm.out"]  # outside the experts: unchanged


@pytest.mark.parametrize(("text", "msg"), [
    ("[]", "--moe-histogram: expected a non-empty JSON list of tokens per expert"),
    ("[1, -2]", "--moe-histogram: expert 1 has -2 tokens; expected a number >= 0"),
    ("[0, 0]", "--moe-histogram: every expert has 0 tokens; expected some tokens routed"),
    ("[1, true]", "--moe-histogram: expert 1 has true tokens; expected a number >= 0"),
    ("[1,", "--moe-histogram '[1,': not a JSON list of tokens per expert"),
    # a JSON object inline: named as not a list (it was looked for as a file: "cannot read: No such file")
    ('{"e0": 3}', "--moe-histogram: expected a non-empty JSON list of tokens per expert"),
])
def test_histogram_validation(text: str, msg: str) -> None:
    with pytest.raises(ProgramError) as e:
        parse_moe_histogram(text)
    assert str(e.value) == msg


def test_skew_validation_and_the_plan_time_checks() -> None:
    with pytest.raises(ProgramError, match=r"^--moe-skew 0.5: expected a number >= 1"):
        parse_moe_skew("0.5")
    with pytest.raises(ProgramError, match=r"^--moe-skew 'x': expected a number >= 1"):
        parse_moe_skew("x")
    with pytest.raises(ProgramError, match=r"^--moe-skew 5: an expert receives at most every token once, 4 x"):
        rank_load(Runtime(moe_skew=5.0), E, K, 2)
    with pytest.raises(ProgramError, match=r"^--moe-histogram: 3 experts given; the model's MoE layers have 8$"):
        rank_load(Runtime(moe_histogram=(1.0, 2.0, 3.0)), E, K, 2)
    # --moe-routing balanced gives every expert the mean: a skew or a histogram beside it contradicts it
    # (it was accepted, the histogram's load priced over the balanced routing's exact counts)
    with pytest.raises(ProgramError) as e:
        Runtime(moe_routing="balanced", moe_histogram=(1.0, 2.0))
    assert str(e.value) == ("--moe-histogram with --moe-routing balanced: balanced routing gives every expert the "
                            "same tokens (fake_balanced_gate), so no expert is busier; give one, not both")
    with pytest.raises(ProgramError, match=r"^--moe-skew aux-loss \(1.52\) with --moe-routing balanced: "):
        Runtime(moe_routing="balanced", moe_skew=1.52)
    assert Runtime(moe_routing="balanced").moe_skew == 1.0
    # a token's top-2 experts are two: an expert holds at most 1/2 of the routed tokens, 4 x the mean
    # (planned at rho = 100 / (100 / 2) = 2 before: 'every token to expert 0 twice')
    with pytest.raises(ProgramError) as e:
        rank_load(Runtime(moe_histogram=(100.0, 0, 0, 0, 0, 0, 0, 0)), E, K, 2)
    assert str(e.value) == ("--moe-histogram: expert 0 has 100 of the 100 tokens routed, 8 x the mean; an expert "
                            "receives at most every token once, 4 x the mean (8 experts, top-2)")
    assert rank_load(Runtime(moe_histogram=(4.0, 1, 1, 1, 0, 0, 0, 1)), E, K, 2) == pytest.approx(7 / 4)  # 4 of 8: at the bound


def test_named_skew_figures_and_their_rank_load() -> None:
    """--moe-skew NAME: the published figures of docs/experts.md ("Routing skew"), case ignored.
    aux-loss (1 + MaxVio_global 0.52, Wang et al. 2024 Table 2) on Qwen3-235B's 128 experts of
    top-8: ep x tp = 8 ranks of 16 experts, rho = (1.52 + 15 x 126.48 / 127) / 16; ep 32 (4 a
    rank) 1.127. r1-decode (1 + 10.948, TensorRT-LLM's blog, Table 1) at the blog's own layout
    (DeepSeek-R1, 256 experts, top-8, EP 32: 8 a rank) gives 2.331 by the one-hot-expert rule,
    9 % under the busiest rank the blog measured, 1 + 1.564 (two hot experts shared rank 13)."""
    assert parse_moe_skew("aux-loss") == 1.52 and parse_moe_skew(" R1-Decode ") == 11.948
    assert set(SKEW_FIGURES) == {"aux-loss", "r1-decode"}
    assert "2408.15664" in SKEW_FIGURES["aux-loss"][1] and "blog4" in SKEW_FIGURES["r1-decode"][1]
    aux = Runtime(moe_skew=parse_moe_skew("aux-loss"))
    assert rank_load(aux, 128, 8, 8) == pytest.approx((1.52 + 15 * 126.48 / 127) / 16, rel=1e-12)
    assert rank_load(aux, 128, 8, 8) == pytest.approx(1.02866, abs=1e-5)
    assert rank_load(aux, 128, 8, 32) == pytest.approx(1.12693, abs=1e-5)
    r1 = rank_load(Runtime(moe_skew=parse_moe_skew("r1-decode")), 256, 8, 32)
    assert r1 == pytest.approx((11.948 + 7 * 244.052 / 255) / 8, rel=1e-12)
    assert r1 == pytest.approx(2.33093, abs=1e-5) and 0.9 < r1 / 2.564 < 1.0
    with pytest.raises(ProgramError) as e:
        parse_moe_skew("typical")
    assert str(e.value) == ("--moe-skew 'typical': expected a number >= 1 (the busiest expert's tokens over the mean) "
                            "or a published figure: aux-loss, r1-decode")
    with pytest.raises(ProgramError) as e:
        rank_load(Runtime(moe_skew=parse_moe_skew("r1-decode")), E, K, 2)
    assert str(e.value) == ("--moe-skew r1-decode (11.948): an expert receives at most every token once, 4 x the "
                            "mean (8 experts, top-2)")


def test_cli_named_skew_is_its_number(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``spmdkit plan --moe-skew aux-loss`` plans what ``--moe-skew 1.52`` does (Mixtral, one
    layer, ep=4: 4 ranks of 2 experts, rho = (1.52 + 6.48 / 7) / 2 = 1.2229), slower
    than uniform routing; an unknown name exits 2 naming the flag and the figures."""
    base = [sys.executable, "-m", "spmdkit", "plan", "--model", "mixtral-8x7b", "--layers", "1", "--seq", "256",
            "--batch", "8", "--mesh", "dp=2,ep=4", "--strategy", "dp,ep", "--device", "h100", "--json"]

    def step(*extra: str) -> float:
        r = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return float(json.loads(r.stdout)["step"]["step_overlap_s"])

    assert rank_load(Runtime(moe_skew=1.52), E, K, 4) == pytest.approx(1.22286, abs=1e-5)
    uniform, named, number = step(), step("--moe-skew", "aux-loss"), step("--moe-skew", "1.52")
    assert named == number and named > uniform
    r = subprocess.run([*base, "--moe-skew", "typical"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--moe-skew 'typical': expected a number >= 1" in r.stderr
    assert "or a published figure: aux-loss, r1-decode" in r.stderr


def test_cli_names_a_bad_histogram_with_exit_2(tmp_path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "h.json"
    f.write_text(json.dumps([1] * 7))
    r = subprocess.run([sys.executable, "-m", "spmdkit", "plan", "--model", "mixtral-8x7b", "--layers", "1", "--seq",
                        "256", "--mesh", "dp=2", "--strategy", "dp", "--device", "h100", "--moe-histogram", str(f)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "--moe-histogram: 7 experts given; the model's MoE layers have 8" in r.stderr


def test_model_flops_count_active_parameters_with_a_capacity_factor() -> None:
    """Mixtral-8x7B at capacity factor 1.25 (padded buffers): model FLOPs = 6 x (active
    parameters less the input embedding, a lookup) x tokens + attention, as Mixtral / DeepSeek
    count them; the padding is not model work."""
    cfg = preset("mixtral-8x7b").with_(layers=2, seq=512, batch=2, capacity_factor=1.25)
    active = count_params(cfg).active - cfg.vocab * cfg.hidden
    loaded = load_preset(Preset("mixtral-8x7b", 2, 2, 512), cfg)
    mesh = parse_mesh("dp=2")
    assert loaded.model is not None
    plan = propagate(loaded.program, mesh, annotate(loaded.model, mesh, parse_strategy("dp", mesh), None))
    assert moe_layers(plan.program)[0].padded
    tokens = 2 * 512
    mf, n, att = model_flops(plan, tokens)
    assert n == active
    # PaLM's attention term: 6 x 2 x layers x seq x (heads x head dim) per token, causal square counted whole
    assert att == 12 * 2 * 512 * cfg.heads * (cfg.hidden // cfg.heads) * tokens
    assert mf == 6 * active * tokens + att


def test_parameter_memory_with_the_experts_sharded() -> None:
    """Mixtral-8x7B (one layer) on 8 ranks with the experts' axis sharded 8 ways: parameter
    bytes per rank = (dense parameters + expert parameters / 8) x 2 (bf16)."""
    plan = _plan(mesh="dp=8", batch=8, ep=True)
    total = sum(t.numel for t in plan.program.tensors.values() if t.kind == "parameter" and not t.inplace_of)
    expert = 3 * E * H * F
    assert memory_per_device(plan).parameters == (total - expert + expert // 8) * 2


def test_mixtral_under_ep_parameters_and_all_to_alls() -> None:
    """Mixtral-8x7B (one layer) on --mesh dp=8,ep=8 --strategy dp,ep: parameter bytes per rank =
    (dense parameters + expert parameters / 8) x 2; the skew slows the step (the busiest ep
    rank's expert GEMMs and all-to-alls)."""
    plan = plan_preset("mixtral-8x7b", "dp=8,ep=8", "dp,ep", {"layers": 1, "seq": 256, "batch": 64})[1]
    total = sum(t.numel for t in plan.program.tensors.values() if t.kind == "parameter" and not t.inplace_of)
    expert = 3 * E * H * F
    assert memory_per_device(plan).parameters == (total - expert + expert // 8) * 2
    assert rank_load(Runtime(moe_skew=2.0), E, K, 8) == 2.0  # one expert a rank: the busiest expert's
    dev = preset_device("h100")
    a = estimate_step(plan, dev, 64 * 256).step_overlap_s
    b = estimate_step(replace(plan, runtime=Runtime(moe_skew=2.0)), dev, 64 * 256).step_overlap_s
    assert b > a


def test_all_to_all_across_nodes_by_hand() -> None:
    """NCCL's all-to-all (pairwise sends, one per peer) over 16 ranks on 2 DGX H100 nodes: the
    (n - local)/n = 8/16 of the buffer crossing each GPU's 400 Gb/s NIC (46 GB/s reached) sets
    the time, the 7/16 over NVLink run alongside; plus NCCL's Simple-protocol latency (8.4 us
    base, 7 NVLink steps of 3.4 us, 8 network steps of 14 us)."""
    s = 1e9
    got = collective_time("all_to_all", s, Group(16, 8), Fabric.of(450e9, 50e9))
    assert got == pytest.approx((8.4 + 7 * 3.4 + 8 * 14.0) * 1e-6 + 8 / 16 * s / (50e9 * 0.92), rel=1e-9)
    inside = collective_time("all_to_all", s, Group(8, 8), Fabric.of(450e9, 50e9))
    assert inside == pytest.approx((8.4 + 7 * 3.4) * 1e-6 + 7 / 8 * s / (450e9 * 0.80), rel=1e-9)  # NVLink


def test_fp8_casts_the_local_expert_stack_once_not_per_gemm_batch() -> None:
    # Transformer Engine casts each weight to fp8 once a forward: for an expert GEMM [B, E, C, H] x [E, H, F]
    # that is the E / ep x H x F stack this rank holds (Mixtral on dp=2,ep=4: 2 of 8 experts), however many
    # sequences the dispatch buffer batches (the GEMM's batch is sequences x local experts); the input is
    # cast where no fused producer wrote it in fp8
    plan = replace(plan_preset("mixtral-8x7b", "dp=2,ep=4", "dp,ep", {"layers": 1, "seq": 256, "batch": 16})[1],
                   runtime=Runtime(precision="fp8"))
    ops = [i for i in _expert_ops(plan) if op_cost(plan, i).fp8]
    assert len(ops) == 3  # gate, up, down
    weight = (E // 4) * H * F
    casts = sorted(op_cost(plan, i).cast_bytes for i in ops)
    # up and down: their weights alone (their inputs are the gate's, cast once, and the SwiGLU's output);
    # the gate: its weight and the dispatched tokens, 2 sequences x 8 experts x capacity 64 x H on this rank
    assert casts == [4 * weight, 4 * weight, 4 * (weight + 2 * 8 * 64 * H)]


def test_the_report_says_the_busiest_rank_s_load(capsys: pytest.CaptureFixture[str]) -> None:
    """--moe-histogram / --moe-skew move the step (the busiest ep rank's tokens) but the report
    said nothing of them: the reshard tables print the uniform bytes. Tokens [1, 1, 1, 1, 1, 1, 2,
    8] on ep = 4 (2 experts a rank): rank 3 holds 10 of the 16, the mean rank 4, so 2.5 x; the
    JSON step has the same (moe_load), a uniform plan's has none."""
    from spmdkit.cli import main

    base = ["plan", "--model", "mixtral-8x7b", "--layers", "1", "--seq", "256", "--batch", "8", "--mesh", "dp=2,ep=4",
            "--strategy", "dp,ep", "--device", "h100"]
    hist = ["--moe-histogram", "[1, 1, 1, 1, 1, 1, 2, 8]"]
    assert main([*base, *hist]) == 0
    assert ("expert load (--moe-histogram): the busiest of the 4 ranks the experts are split over, rank 3 (experts "
            "6-7) receives 2.500 x the mean rank's tokens;") in capsys.readouterr().out
    assert main([*base, *hist, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"]["moe_load"] == {
        "flag": "--moe-histogram", "ep": 4, "load": 2.5, "padded": False, "rank": 3, "experts": [6, 7]}
    assert main([*base, "--moe-skew", "aux-loss"]) == 0  # rho = (1.52 + 6.48 / 7) / 2
    assert "expert load (--moe-skew aux-loss (1.52)): the busiest of the 4 ranks the experts are split over " \
           "receives 1.223 x the mean rank's tokens;" in capsys.readouterr().out
    assert main([*base, "--json"]) == 0
    assert "moe_load" not in json.loads(capsys.readouterr().out)["step"]
    pipe = ["plan", "--model", "mixtral-8x7b", "--layers", "2", "--seq", "256", "--batch", "16", "--microbatches",
            "2", "--mesh", "pp=2,dp=2,ep=4", "--strategy", "dp,ep", "--device", "h100", *hist]
    assert main(pipe) == 0  # a pipeline's report: the same line below its step time
    assert "expert load (--moe-histogram): the busiest of the 4 ranks the experts are split over, rank 3 (experts " \
           "6-7) receives 2.500 x the mean rank's tokens;" in capsys.readouterr().out
    assert main([*pipe, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pipeline"]["moe_load"]["load"] == 2.5
