"""The zoo's architectures (issue 27): any decoder of the published families as a ModelConfig,
built as a training step with the published parameter counts, the FLOPs of its experts on
the tokens they receive, Megatron's placements of the new parameters, and --verify."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest

from spmd_helpers import T, dms, global_ctx
from spmdkit.cli import main
from spmdkit.core.errors import ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.cost.compute import model_flops, op_cost
from spmdkit.cost.memory import memory_per_device
from spmdkit.engine.registry import get_rule
from spmdkit.models.zoo import ModelConfig, build_model, preset, tiny_like
from spmdkit.models.zoo_moe import capacity
from spmdkit.planner.planning import plan_model
from spmdkit.planner.propagate import propagate
from spmdkit.sim.plan import flat_values, op_io, source_values
from spmdkit.sim.reference import Ctx, get_reference

LLAMA3_8B = ModelConfig("llama", 32, 4096, 32, 8, 14336, 128256, 8192, 1, "bfloat16")
MIXTRAL_8X7B = ModelConfig("llama", 32, 4096, 32, 8, 14336, 32000, 4096, 1, "bfloat16", experts=8, top_k=2)
DEEPSEEK_V3 = ModelConfig("llama", 61, 7168, 128, None, 18432, 129280, 4096, 1, "bfloat16", experts=256, top_k=8,
                          moe_ffn=2048, shared_experts=1, dense_layers=3, q_lora_rank=1536, kv_lora_rank=512,
                          qk_rope_head_dim=64, head_dim=128, v_head_dim=128)
BLOOM_176B = ModelConfig("gpt2", 70, 14336, 112, None, 4 * 14336, 250880, 2048, 1, "bfloat16", tied_embeddings=True,
                         positions="alibi", embed_norm=True, linear_bias=True, attention="flash")
GEMMA2_9B = ModelConfig("llama", 42, 3584, 16, 8, 14336, 256000, 8192, 1, "bfloat16", head_dim=256,
                        activation="geglu", tied_embeddings=True)


def _counts(cfg: ModelConfig) -> tuple[int, float]:
    """(parameters, active parameters) of the program built for ``cfg`` (the routed experts'
    stacks count top_k / experts of themselves as active)."""
    prog = build_model(cfg, validate=False, check_rules=False).program
    total, active = 0, 0.0
    for t in prog.tensors.values():
        if t.kind == "parameter" and not t.inplace_of:
            total += t.numel
            active += t.numel * (cfg.top_k / cfg.experts if ".experts." in t.name else 1)
    return total, active


def _full_size(cfg: ModelConfig) -> tuple[int, float]:
    """The counts of ``cfg`` at its depth from builds of 1-3 layers (every layer of a kind
    has the same parameters: checked on the builds), so the test builds no 61-layer program."""
    def at(layers: int, dense: int) -> tuple[int, float]:
        return _counts(cfg.with_(layers=layers, dense_layers=dense))
    if cfg.experts and cfg.dense_layers:
        two, moe3, dense3 = at(2, 1), at(3, 1), at(3, 2)
        moe = [a - b for a, b in zip(moe3, two)]
        dense = [a - b for a, b in zip(dense3, two)]
        n = [two[i] + (cfg.dense_layers - 1) * dense[i] + (cfg.layers - cfg.dense_layers - 1) * moe[i] for i in (0, 1)]
        return int(n[0]), n[1]
    one, two = at(1, 0), at(2, 0)
    three = at(3, 0)
    assert [c - b for b, c in zip(two, three)] == [b - a for a, b in zip(one, two)]  # every layer alike
    return int(one[0] + (cfg.layers - 1) * (two[0] - one[0])), one[1] + (cfg.layers - 1) * (two[1] - one[1])


@pytest.mark.parametrize(("cfg", "total", "active"), [
    (LLAMA3_8B, 8.03e9, 8.03e9),  # Meta's model card: 8.03B
    (MIXTRAL_8X7B, 46.7e9, 12.9e9),  # Mistral AI: 46.7B total, 12.9B active per token
    (DEEPSEEK_V3, 671e9, 37e9),  # DeepSeek-V3 report: 671B total (the 14B MTP module aside), 37B activated
    (BLOOM_176B, 176.2e9, 176.2e9),  # BigScience: 176,247M
    (GEMMA2_9B, 9.24e9, 9.24e9),  # Gemma 2 report: 9.24B (with the tied embeddings)
], ids=["llama3-8b", "mixtral-8x7b", "deepseek-v3", "bloom-176b", "gemma2-9b"])
def test_published_parameter_counts(cfg: ModelConfig, total: float, active: float) -> None:
    got, got_active = _full_size(cfg)
    assert got == pytest.approx(total, rel=0.003), got
    assert got_active == pytest.approx(active, rel=0.02), got_active


def test_mixtral_counted_by_hand() -> None:
    """Mixtral-8x7B exactly: per layer q, o (h x h), k, v (h x 1024), 8 experts of 3 h f,
    the router h x 8 and two norms; embedding, head and final norm."""
    h, f, v, L = 4096, 14336, 32000, 32
    layer = 2 * h * h + 2 * h * 1024 + 8 * 3 * h * f + h * 8 + 2 * h
    assert _full_size(MIXTRAL_8X7B)[0] == L * layer + 2 * v * h + h == 46_702_792_704


def _params(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    prog = build_model(cfg, check_rules=False).program
    return {t.name: tuple(t.shape) for t in prog.tensors.values() if t.kind == "parameter" and not t.inplace_of}


def test_head_dim_sets_the_projection_widths() -> None:
    p = _params(preset("tiny-llama").with_(head_dim=8))  # 4 heads of 8 (2 kv) on hidden 16
    assert (p["layers.0.wq"], p["layers.0.wk"], p["layers.0.wo"]) == ((16, 32), (16, 16), (32, 16))
    g = _params(preset("tiny-gpt2").with_(head_dim=6, hidden=18, heads=4, kv_heads=4))  # 18 % 4 != 0: allowed
    assert (g["layers.0.wq"], g["layers.0.wo"]) == ((18, 24), (24, 18))


def test_norms_positions_biases_and_embed_norm() -> None:
    base = preset("tiny-llama")
    layer = _params(base.with_(norm="layer"))
    assert layer["layers.0.attn_norm.bias"] == (16,) and layer["final_norm.bias"] == (16,)
    rms = _params(preset("tiny-gpt2").with_(norm="rms"))
    assert "layers.0.ln1.w" in rms and "layers.0.ln1.b" not in rms
    learned = _params(base.with_(positions="learned"))
    assert learned["pos_embed"] == (8, 16)
    biased = _params(base.with_(qkv_bias=True))
    assert [n for n in biased if n.endswith(".bias")] == [f"layers.{i}.w{x}.bias" for i in (0, 1) for x in "qkv"]
    every = _params(base.with_(linear_bias=True, embed_norm=True))
    assert sum(n.endswith(".bias") for n in every) == 2 * 7 + 1  # q k v o gate up down, the embedding norm's
    assert every["embed_norm"] == every["embed_norm.bias"] == (16,)


def _ops(cfg: ModelConfig) -> list[str]:
    return [op.rule for op in build_model(cfg, check_rules=False).program.ops if op.phase == "forward"]


def test_alibi_flash_is_flash_without_a_mask_and_eager_adds_the_bias_per_head() -> None:
    base = preset("tiny-gpt2").with_(attention="flash")
    assert _ops(base.with_(positions="alibi")) == _ops(base.with_(positions="none"))
    assert _ops(base.with_(positions="alibi")).count("embedding") == 1  # no learned positions
    eager = build_model(preset("tiny-gpt2").with_(positions="alibi"), check_rules=False)
    assert eager.program.tensors["alibi_mask"].shape == (1, 4, 8, 8)
    plan = plan_model(json.dumps({"base": "tiny-gpt2", "positions": "alibi"}), "tp=2", "megatron")[1]
    assert plan.attrs["layers.0.scores.masked"].dims_mapping == (-1, 0, -1, -1)  # heads sharded, with the bias


def test_geglu_is_gelu_of_the_gate_times_up() -> None:
    rules = _ops(preset("tiny-llama").with_(activation="geglu"))
    i = rules.index("gelu")
    assert rules[i + 1] == "multiply" and "swiglu" not in rules
    assert _params(preset("tiny-llama").with_(activation="geglu"))["layers.0.w_gate"] == (16, 32)


def _tiny_moe(**kw: Any) -> str:
    return json.dumps({"base": "tiny-llama", "experts": 4, "top_k": 2, "moe_ffn": 8, "shared_experts": 1,
                       "dense_layers": 1, **kw})


def test_megatron_places_the_new_parameters() -> None:
    """Column-parallel biases sharded with their outputs, row-parallel ones replicated; the
    experts' stacks sharded as one expert's projection, the router replicated; MLA's down
    projections replicated, its up projections column-parallel."""
    biases = json.dumps({"base": "tiny-gpt2", "linear_bias": True})
    a = plan_model(biases, "tp=2", "megatron")[1].attrs
    assert a["layers.0.wq.bias"].dims_mapping == (0,) and a["layers.0.fc1.bias"].dims_mapping == (0,)
    assert a["layers.0.wo.bias"].dims_mapping == (-1,) and a["layers.0.fc2.bias"].dims_mapping == (-1,)
    m = plan_model(_tiny_moe(), "dp=2,tp=2", "megatron")[1].attrs
    assert m["layers.1.experts.w_gate"].dims_mapping == (-1, -1, 1)
    assert m["layers.1.experts.w_down"].dims_mapping == (-1, 1, -1)
    assert m["layers.1.router"].dims_mapping == (-1, -1)
    assert m["layers.1.shared.w_up"].dims_mapping == (-1, 1) and m["layers.1.shared.w_down"].dims_mapping == (1, -1)
    # each sequence dispatched on its own: the tokens stay sharded over dp, no rank gathers another's
    assert m["layers.1.dispatch"].dims_mapping == (0, -1, -1, -1)
    assert m["layers.1.experts.up"].dims_mapping == (0, -1, -1, 1)
    mla = json.dumps({"base": "tiny-llama", "kv_heads": None, "kv_lora_rank": 8, "q_lora_rank": 6,
                      "qk_rope_head_dim": 4, "head_dim": 4, "v_head_dim": 6})
    p = plan_model(mla, "tp=2", "megatron")[1].attrs
    assert p["layers.0.wq_a"].dims_mapping == p["layers.0.wkv_a"].dims_mapping == (-1, -1)
    assert p["layers.0.wq_b"].dims_mapping == p["layers.0.wkv_b"].dims_mapping == (-1, 0)
    assert p["layers.0.wo"].dims_mapping == (0, -1)
    assert p["layers.0.attn"].dims_mapping == (-1, -1, 0, -1)  # heads sharded through the attention


def test_mla_shapes() -> None:
    """DeepSeek-V3's layer: q 1536 -> 128 heads x (128 + 64), the kv latent 512 + 64, up to 128
    heads x (128 + 128), o [128 x 128, 7168]; attention on q/k heads of 192, v heads of 128."""
    prog = build_model(DEEPSEEK_V3.with_(layers=1, dense_layers=0, experts=0, top_k=2, moe_ffn=None,
                                         shared_experts=0, seq=64), validate=False, check_rules=False).program
    s = {n: tuple(t.shape) for n, t in prog.tensors.items()}
    assert (s["layers.0.wq_a"], s["layers.0.wq_b"]) == ((7168, 1536), (1536, 128 * 192))
    assert (s["layers.0.wkv_a"], s["layers.0.wkv_b"]) == ((7168, 576), (512, 128 * 256))
    assert s["layers.0.wo"] == (128 * 128, 7168)
    assert (s["layers.0.q_full"], s["layers.0.k_full"], s["layers.0.v4"]) == \
        ((1, 64, 128, 192), (1, 64, 128, 192), (1, 64, 128, 128))
    assert s["rope.sin"] == (1, 64, 1, 64)


def test_capacity() -> None:
    cfg = preset("tiny-llama").with_(experts=4, top_k=2)
    assert capacity(cfg) == 4  # 8 tokens x 2 / 4
    assert capacity(cfg.with_(capacity_factor=1.25)) == 5  # ceil(5.0)
    assert capacity(cfg.with_(capacity_factor=1.3)) == 6  # ceil(5.2)
    assert capacity(DEEPSEEK_V3) == 128  # 4096 x 8 / 256


def test_moe_flops_count_the_experts_on_their_tokens() -> None:
    """A Mixtral-like layer: the op costs summed over the step are 6 x active parameters x tokens
    plus the attention (each expert multiplies only its capacity of tokens), and the model FLOPs'
    N is the active parameters, counted by hand."""
    h, f, E, K, V, S, B, L, kv = 256, 512, 8, 2, 1000, 128, 2, 2, 128
    cfg = ModelConfig("llama", L, h, 4, 2, f, V, S, B, "bfloat16", experts=E, top_k=K)
    plan = propagate(build_model(cfg, validate=False).program, ProcessMesh([1]), {})
    tokens = B * S
    active = L * (2 * h * h + 2 * h * kv + K * 3 * h * f + h * E + 2 * h) + h * V + h  # the embedding: a lookup
    mf, n, att = model_flops(plan, tokens)
    assert n == active
    assert att == 3 * L * 2 * B * S * S * h * 2  # QK^T and PV, forward and backward, full square
    assert mf == 6 * active * tokens + att
    # the experts' GEMMs, forward: 2 x rows x h x f per projection over E x capacity rows = tokens x K
    ops = [(i, op) for i, op in enumerate(plan.program.ops) if op.phase == "forward" and op.rule == "matmul"
           and "experts" in op.inputs["y"]]
    assert len(ops) == 3 * L
    assert all(op_cost(plan, i).flops == 2 * tokens * K * h * f for i, _ in ops)


def test_expert_gemms_are_split_over_tp() -> None:
    _m, plan, _ = plan_model(_tiny_moe(), "tp=2", "megatron")
    i = next(i for i, op in enumerate(plan.program.ops) if op.output_names() == ["layers.1.experts.up"])
    # [4, 4 experts, capacity 4, 16] x [4, 16, 8]: moe_ffn halved on each rank
    assert op_cost(plan, i).flops == 2 * 4 * 4 * 4 * 16 * 8 / 2


def test_memory_counts_the_new_parameters_and_the_expert_activations() -> None:
    """Parameters, gradients and states of every tensor the program declares (the experts'
    stacks and MLA's projections included); activations include the dispatched tokens."""
    cfg = json.dumps({"base": "tiny-llama", "experts": 4, "top_k": 2, "moe_ffn": 8, "dtype": "fp32"})
    model, plan, _ = plan_model(cfg, "dp=1", "dp")
    n = sum(t.numel for t in model.program.tensors.values() if t.kind == "parameter" and not t.inplace_of)
    mem = memory_per_device(plan)
    assert mem.parameters == 4 * n and mem.gradients == 4 * n
    kept = {n: b for ts in mem.saved.tensors.values() for n, b in ts}
    # the backward of the experts reads them: [batch 4, 4 experts, capacity 4, hidden 16] in fp32 each
    assert kept["layers.0.dispatch"] == kept["layers.1.dispatch"] == 4 * 4 * 4 * 16 * 4


def test_batched_dispatch_is_each_sequence_on_its_own() -> None:
    """moe_gate_dispatch / moe_combine with a batch axis first: the reference is the 2-D op per
    sequence, and the rules keep the batch axis sharded (nothing gathered over dp), forward and
    grad."""
    rng = np.random.default_rng(0)
    x, gl = rng.normal(size=(3, 5, 4)), rng.uniform(size=(3, 5, 4))
    ref = get_reference("moe_gate_dispatch")
    assert ref is not None
    args = {"x": x, "gate_logits": gl, "k": 2, "capacity": 3, "use_pad": True}
    outs = ref.fn(args, global_ctx())
    for b in range(3):
        one = ref.fn({**args, "x": x[b], "gate_logits": gl[b]}, global_ctx())
        assert all(np.array_equal(o[b], o1) for o, o1 in zip(outs, one))
    m = ProcessMesh([2])
    res = get_rule("moe_gate_dispatch").infer_forward(T(m, [4, 8, 16], [0, -1, -1]), T(m, [4, 8, 4], [0, -1, -1]),
                                                      None, 2, 4, True)
    assert dms(res.outputs) == [(0, -1, -1, -1), (0, -1, -1), (0, -1, -1), (0, -1), (0, -1, -1)]
    res = get_rule("moe_combine").infer_forward(T(m, [4, 16, 16], [0, -1, -1]), T(m, [4, 8, 2], [0, -1, -1]),
                                                T(m, [4, 8, 2], [0, -1, -1]))
    assert dms(res.outputs) == [(0, -1, -1)]
    res = get_rule("moe_gate_dispatch_grad").infer_forward(
        T(m, [4, 8, 2], [0, -1, -1]), T(m, [4, 2, 8], [0, -1, -1]), T(m, [4, 8, 2], [0, -1, -1]),
        T(m, [4, 4, 4, 16], [0, -1, -1, -1]), T(m, [4, 8, 2], [0, -1, -1]), 2, 4, True)
    assert dms(res.outputs) == [(0, -1, -1), (0, -1, -1)]
    with pytest.raises(ShapeMismatchError, match="moe_gate_dispatch: the tensors must all be 2-D, all 3-D"):
        get_rule("moe_gate_dispatch").infer_forward(T(m, [4, 8, 16], [-1, -1, -1]), T(m, [8, 4], [-1, -1]),
                                                    None, 2, 4, True)


@pytest.mark.parametrize("cfg", [
    _tiny_moe(),
    json.dumps({"base": "tiny-llama", "kv_heads": None, "kv_lora_rank": 8, "q_lora_rank": 6, "qk_rope_head_dim": 4,
                "head_dim": 4, "v_head_dim": 6}),
    json.dumps({"base": "tiny-gpt2", "positions": "alibi", "embed_norm": True, "linear_bias": True,
                "tied_embeddings": True}),
], ids=["moe", "mla", "bloom-like"])
def test_verify_simulates_the_variant(capsys: pytest.CaptureFixture[str], cfg: str) -> None:
    """megatron on dp=2 x tp=2: the sharded step equals the unsharded one (loss, every
    gradient, every update) for the tiny model of the same architecture."""
    assert main(["plan", "--model-config", cfg, "--mesh", "dp=2,tp=2", "--strategy", "megatron", "--verify",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["verify"]["ok"] and d["verify"]["model"].endswith("variant")
    tiny = preset(tiny_like(preset(cfg)))
    full = preset(cfg)
    for f in ("experts", "kv_lora_rank", "embed_norm", "linear_bias", "shared_experts", "dense_layers"):
        assert bool(getattr(tiny, f)) == bool(getattr(full, f))
    assert (tiny.pos, tiny.nrm, tiny.act, tiny.tied_embeddings) == (full.pos, full.nrm, full.act, full.tied_embeddings)


def test_tiny_like_scales_the_variants() -> None:
    big = preset(tiny_like(DEEPSEEK_V3))
    assert (big.experts, big.top_k, big.shared_experts, big.dense_layers, big.kv_lora_rank, big.q_lora_rank) == \
        (4, 2, 1, 1, 8, 6)
    assert preset(tiny_like(GEMMA2_9B)).hdim == 8 and preset(tiny_like(GEMMA2_9B)).act == "geglu"
    assert tiny_like(preset("llama-7b")) == "tiny-llama"
    assert math.isclose(capacity(big), 4)


def _run(prog: Any, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every tensor of ``prog`` run unsharded through the numpy references (float64)."""
    mesh = ProcessMesh([1])
    plan = propagate(prog, mesh, {})
    glob: dict[str, Any] = dict(values)
    for op_plan in plan.ops:
        io = op_io(op_plan, prog)
        args = io.values(lambda n, req: glob[n])
        outs = flat_values(io.ref.run(args, Ctx(mesh, None, None, io.in_attrs, io.shapes, io.out_ndims,
                                                io.out_attrs)))
        for name, v in zip(io.out_refs, outs):
            if name is not None and v is not None:
                glob[name] = np.asarray(v)
    return glob


@pytest.mark.parametrize("cfg", [
    preset("tiny-llama").with_(kv_heads=None, kv_lora_rank=8, q_lora_rank=6, qk_rope_head_dim=4, head_dim=4,
                               v_head_dim=6, experts=4, top_k=2, moe_ffn=8, shared_experts=1, dense_layers=1),
    preset("tiny-gpt2").with_(positions="alibi", embed_norm=True, linear_bias=True, activation="geglu", head_dim=6),
], ids=["mla-moe", "bloom-geglu"])
def test_gradients_equal_finite_differences(cfg: ModelConfig) -> None:
    """The backward the autodiff builds (the moe ops' grads included: dispatch, combine, the
    router through the combine weights) is the derivative of the loss: central differences of
    the loss (float64) at entries of the new parameters."""
    model = build_model(cfg, optimizer="sgd")
    prog = model.program
    values = source_values(prog, seed=3)
    base = _run(prog, values)
    names = [n for n in model.optimizer if any(k in n for k in (
        "router", "experts.w_gate", "experts.w_down", "shared.w_up", "wq_a", "wkv_a", "wkv_b", "kv_norm", "q_norm",
        ".bias", "embed_norm", "fc1.gate", "wo"))]
    assert len(names) >= 8
    rng = np.random.default_rng(0)
    eps = 1e-6
    for p in names:
        g = base[model.optimizer[p][0]]
        for _ in range(2):
            idx = tuple(int(rng.integers(s)) for s in g.shape)
            plus, minus = dict(values), dict(values)
            plus[p] = values[p].copy()
            plus[p][idx] += eps
            minus[p] = values[p].copy()
            minus[p][idx] -= eps
            fd = (_run(prog, plus)[model.loss] - _run(prog, minus)[model.loss]) / (2 * eps)
            assert fd == pytest.approx(g[idx], rel=1e-4, abs=1e-6), (p, idx)
