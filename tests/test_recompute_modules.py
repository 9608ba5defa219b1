"""Megatron-Core's fine-grained selective recomputation (``--recompute selective:M1,M2``,
spmdkit.cost.recompute_modules) on a small llama, dense and MoE: the bytes each module saves
against the hand count, the forward work it adds to the step, merged regions, refusals."""

from __future__ import annotations

import pytest

from spmdkit.cli import main
from spmdkit.core.errors import ProgramError
from spmdkit.cost.compute import op_cost
from spmdkit.cost.devices import load_device
from spmdkit.cost.memory import check_recompute
from spmdkit.cost.memory_saved import recompute_regions, saved_activations
from spmdkit.cost.step import estimate_step
from spmdkit.models.zoo import ModelConfig, build_model
from spmdkit.planner.propagate import propagate
from spmdkit.strategies.strategy import annotate, parse_mesh, parse_strategy

L, H, A, KV, F, V, S, B = 2, 64, 4, 2, 128, 64, 16, 2
DENSE = ModelConfig("llama", L, H, A, KV, F, V, S, B, "bfloat16")
MOE = DENSE.with_(experts=4, top_k=2)
#: one norm's output (bf16 [b, s, h]) and its inverse rms (fp32 [b, s]), two norms a layer
NORMS = L * 2 * (S * B * H * 2 + S * B * 4)
#: the dense MLP's gate, up and swiglu outputs (bf16 [b, s, f])
MLP = L * 3 * S * B * F * 2
#: the experts' swiglu output: every token's top_k rows (capacity s k / E per expert), bf16
MOE_ACT = L * B * S * 2 * F * 2


def _plan(cfg: ModelConfig, mesh: str = "dp=1", strategy: str = "none"):
    m = parse_mesh(mesh)
    model = build_model(cfg, vocab_parallel_loss="megatron" in strategy, check_rules=False)
    return propagate(model.program, m, annotate(model, m, parse_strategy(strategy, m)))


def _total(plan, mode: str) -> int:
    return saved_activations(plan, mode).total


def test_each_module_saves_its_outputs_bytes() -> None:
    dense, moe = _plan(DENSE), _plan(MOE)
    none = _total(dense, "none")
    assert none - _total(dense, "selective:layernorm") == NORMS == 16896
    assert none - _total(dense, "selective:mlp") == MLP == 49152
    # the pre-MLP norm and the MLP merge: the norm's output (the MLP's input) is not kept either
    assert none - _total(dense, "selective:layernorm,mlp") == NORMS + MLP
    assert _total(dense, "selective:core_attn") == _total(dense, "selective")
    assert recompute_regions(dense.program, "selective:core_attn") == recompute_regions(dense.program, "selective")
    none_moe = _total(moe, "none")
    assert none_moe - _total(moe, "selective:moe_act") == MOE_ACT == 32768
    assert none_moe - _total(moe, "selective:layernorm,moe_act") == NORMS + MOE_ACT
    assert none_moe - _total(moe, "selective:layernorm") == NORMS
    # the whole MoE block: the layer keeps what the dense layer keeps with its MLP recomputed
    assert _total(moe, "selective:moe") == _total(dense, "selective:mlp")
    assert _total(moe, "selective:moe,moe_act") == _total(moe, "selective:moe")  # moe_act is inside moe
    shared = _plan(MOE.with_(shared_experts=1))  # one shared expert of f: its gate, up and swiglu
    assert _total(shared, "none") - _total(shared, "selective:shared_experts") == MLP
    assert _total(shared, "selective:moe,shared_experts") == _total(shared, "selective:moe")
    for plan, modes in ((dense, ("layernorm", "mlp", "core_attn")), (moe, ("layernorm", "moe", "moe_act"))):
        full = _total(plan, "full")
        for m in modes:  # between full (each layer's input only) and none
            assert full < _total(plan, f"selective:{m}") < _total(plan, "none"), m


def test_regions_are_found_by_structure() -> None:
    moe = _plan(MOE)
    prog = moe.program
    rules = {m: [[prog.ops[i].rule for i in r] for r in recompute_regions(prog, f"selective:{m}")]
             for m in ("layernorm", "moe_act")}
    assert rules["layernorm"] == [["fused_rms_norm"]] * (2 * L)
    assert rules["moe_act"] == [["swiglu"]] * L
    # MLA's q_norm / kv_norm normalise latents, not the residual stream: not input / pre-MLP norms
    mla = build_model(DENSE.with_(kv_heads=A, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16),
                      check_rules=False).program
    assert sum(op.rule == "fused_rms_norm" and op.phase == "forward" for op in mla.ops) == 4 * L + 1
    assert [[mla.ops[i].output_names()[0] for i in r] for r in recompute_regions(mla, "selective:layernorm")] == \
        [[f"layers.{k}.{n}.out"] for k in range(L) for n in ("attn_norm", "mlp_norm")]
    block = recompute_regions(prog, "selective:moe")
    assert len(block) == L and all(prog.ops[r[-1]].rule == "moe_combine" for r in block)
    assert {"moe_gate_dispatch", "moe_combine", "softmax"} <= {prog.ops[i].rule for i in block[0]}
    for r in block:  # everything the block made is dropped; its input (the pre-MLP norm's output) is kept
        kept = {n for lst in saved_activations(moe, "selective:moe").tensors.values() for n, _ in lst}
        made = {n for i in r for n in prog.ops[i].output_names()}
        assert not kept & made
        assert set(prog.ops[r[0]].input_names()) - {n for n in prog.tensors if prog.tensors[n].kind == "parameter"} <= kept


@pytest.mark.parametrize("cfg,mode", [(DENSE, "selective:layernorm"), (DENSE, "selective:mlp"),
                                      (MOE, "selective:moe_act"), (MOE, "selective:moe")])
def test_the_step_runs_the_module_forward_again(cfg: ModelConfig, mode: str) -> None:
    plan = _plan(cfg, "tp=2", "megatron,sp")
    dev = load_device("h100")
    none, est = estimate_step(plan, dev, S * B, "none"), estimate_step(plan, dev, S * B, mode)
    again = sum(op_cost(plan, j).flops for r in recompute_regions(plan.program, mode) for j in r)
    assert again > 0
    assert est.recompute_flops_per_device == pytest.approx(again, rel=1e-12)
    assert est.flops_per_device == pytest.approx(none.flops_per_device + again, rel=1e-12)
    assert est.compute_s["recompute"] > 0 and est.step_overlap_s > none.step_overlap_s
    full = estimate_step(plan, dev, S * B, "full")
    assert full.recompute_flops_per_device > est.recompute_flops_per_device
    assert full.step_overlap_s > est.step_overlap_s
    if mode == "selective:layernorm":  # exactly the norms' forward FLOPs again
        norms = [j for j, op in enumerate(plan.program.ops) if op.phase == "forward" and op.rule == "fused_rms_norm"
                 and op.layer.startswith("layer ")]
        assert len(norms) == 2 * L
        assert est.recompute_flops_per_device == pytest.approx(sum(op_cost(plan, j).flops for j in norms), rel=1e-12)


#: a DeepSeek-like MLA: q through a 32-wide latent, kv through a 16-wide one, heads of 16 + 8 (rope), v of 16
MLA = DENSE.with_(kv_heads=A, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=16)
DN, DR, DV = H // A, 8, 16
#: mla_up_proj: the attention kernel's q and k ([b, s, heads, dn + dr]) and v ([b, s, heads, dv]),
#: bf16, are not kept; k's rope part before its rope ([b, s, dr], the checkpoint's k_pos_emb) is
MLA_UP = L * (2 * B * S * A * (DN + DR) * 2 + B * S * A * DV * 2 - B * S * DR * 2)


def test_mla_up_proj() -> None:
    plan = _plan(MLA)
    prog = plan.program
    none = _total(plan, "none")
    assert none - _total(plan, "selective:mla_up_proj") == MLA_UP == 31744
    # with the MLP: two regions a layer that do not touch, the savings add up
    assert none - _total(plan, "selective:mla_up_proj,mlp") == MLA_UP + MLP
    assert none - _total(plan, "selective:mlp") == MLP
    regions = recompute_regions(prog, "selective:mla_up_proj")
    assert len(regions) == L
    for r in regions:  # from the up projections (of the latent norms' outputs) to the concats, the kernel's q and k
        rules = [prog.ops[i].rule for i in r]
        assert rules.count("matmul") == 2 and rules.count("fused_rotary_position_embedding") == 2
        assert rules.count("concat") == 2 and "flash_attention" not in rules and "fused_rms_norm" not in rules
        ups = [prog.ops[i].inputs["x"] for i in r if prog.ops[i].rule == "matmul"]
        assert [prog.ops[next(j for j, o in enumerate(prog.ops) if x in o.output_names())].rule for x in ups] == \
            ["fused_rms_norm"] * 2
    # the core attention too: the regions feed it, one region a layer
    assert len(recompute_regions(prog, "selective:mla_up_proj,core_attn")) == L
    # without q_lora_rank (DeepSeek-V2-Lite) q is projected from the input norm's output inside the
    # checkpoint (Megatron's linear_q_proj): the region reads that norm, so it merges with layernorm's
    lite = _plan(MLA.with_(q_lora_rank=0))
    r = recompute_regions(lite.program, "selective:mla_up_proj")[0]
    assert [lite.program.ops[i].inputs["x"] for i in r if lite.program.ops[i].rule == "matmul"] == \
        ["layers.0.attn_norm.out", "layers.0.kv_norm.out"]
    assert _total(lite, "none") - _total(lite, "selective:mla_up_proj") == MLA_UP
    assert len(recompute_regions(lite.program, "selective:layernorm,mla_up_proj")) == 2 * L
    mp = _plan(MLA, "tp=2", "megatron,sp")
    dev = load_device("h100")
    base, est = estimate_step(mp, dev, S * B, "none"), estimate_step(mp, dev, S * B, "selective:mla_up_proj")
    again = sum(op_cost(mp, j).flops for r in recompute_regions(mp.program, "selective:mla_up_proj") for j in r)
    ups = [j for j, op in enumerate(mp.program.ops) if op.phase == "forward" and op.layer.startswith("layer ")
           and op.rule == "matmul" and op.output_names()[0].split(".")[-1] in ("q", "kv")]
    # the up projections at TP 2: 2bs(32 x a(dn + dr) + 16 x a(dn + dv)) / 2 a layer; the ropes 3 FLOPs an element
    assert len(ups) == 2 * L and sum(op_cost(mp, j).flops for j in ups) == L * B * S * (32 * A * 24 + 16 * A * 32)
    assert again == L * (B * S * (32 * A * 24 + 16 * A * 32) + 3 * B * S * DR + 3 * B * S * (A // 2) * DR) == 332288
    assert est.recompute_flops_per_device == pytest.approx(again, rel=1e-12)
    assert est.flops_per_device == pytest.approx(base.flops_per_device + again, rel=1e-12)


def test_refusals_name_the_module() -> None:
    with pytest.raises(ProgramError, match=r"--recompute selective:layernorm,mla_up_projection: module "
                                           r"'mla_up_projection' is not a module; expected modules among core_attn, "
                                           r"layernorm, mlp, moe, moe_act, shared_experts, mla_up_proj"):
        check_recompute("selective:layernorm,mla_up_projection")
    with pytest.raises(ProgramError, match=r"selective:mla_up_proj,mlp: module 'mla_up_proj': no numbered layer has "
                                           r"an MLA up projection"):
        recompute_regions(_plan(DENSE).program, "selective:mla_up_proj,mlp")
    eager = _plan(ModelConfig("gpt2", L, H, A, A, F, V, S, B, "bfloat16")).program  # eager attention, layer norms
    with pytest.raises(ProgramError, match=r"module 'mla_up_proj': no numbered layer"):
        recompute_regions(eager, "selective:mla_up_proj")
    with pytest.raises(ProgramError, match=r"module 'attn' is not a module; expected modules among"):
        check_recompute("selective:attn")
    with pytest.raises(ProgramError, match=r"module '' is not a module"):
        check_recompute("selective:")
    with pytest.raises(ProgramError, match=r"selective:moe_act: module 'moe_act': no numbered layer has an expert"):
        recompute_regions(_plan(DENSE).program, "selective:moe_act")
    with pytest.raises(ProgramError, match=r"selective:shared_experts: module 'shared_experts': no numbered layer "
                                           r"has shared experts"):
        recompute_regions(_plan(MOE).program, "selective:shared_experts")
    with pytest.raises(ProgramError, match=r"selective:mlp: module 'mlp': no numbered layer has a dense MLP"):
        recompute_regions(_plan(MOE).program, "selective:mlp")
    assert check_recompute("selective:layernorm,moe_act", pipeline=True) == "selective:layernorm,moe_act"


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--model", "tiny-gpt-dropout", "--mesh", "tp=2", "--recompute", "selective:layernorm,mlp"])
    assert rc == 0 and "kept for the backward (recompute selective:layernorm,mlp)" in capsys.readouterr().out
    rc = main(["plan", "--model", "tiny-gpt-dropout", "--mesh", "tp=2", "--recompute", "selective:moe"])
    assert rc == 2
    assert capsys.readouterr().err.strip() == ("spmdkit plan: ProgramError: --recompute selective:moe: module 'moe': "
                                               "no numbered layer has a MoE block (moe_gate_dispatch, moe_combine)")
