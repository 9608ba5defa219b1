"""HuggingFace models imported at full size without their weights (spmdkit.models.hf.build with
weights=False: fake parameters, real buffers, in the requested dtype directly) and with each
distinct layer traced once and repeated (spmdkit.models.torch_import.layers): the published
configs of tests/data/hf/ build with their published parameter counts, the repeated program is
the full trace's, op for op, and a small model still imports with its weights, as before."""

from __future__ import annotations

import math
import resource
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'spmdkit[torch]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'spmdkit[hf]')")

from spmdkit.core.errors import ProgramError  # noqa: E402
from spmdkit.models import hf  # noqa: E402
from spmdkit.models.source import import_hf_checked  # noqa: E402
from spmdkit.models.torch_import import hf_call_kwargs, import_module, torch_values  # noqa: E402
from spmdkit.models.torch_import.aten import mapped_ops  # noqa: E402
from spmdkit.models.torch_import.layers import expand, layer_kinds, layer_stack, prefix_plan  # noqa: E402
from spmdkit.program.autodiff import GRADS  # noqa: E402
from spmdkit.program.ir import Program  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

DATA = Path(__file__).parent / "data" / "hf"
TINY = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=256, max_position_embeddings=64)


def _layer_params(h: int, ffn: int, heads: int, kv: int, head_dim: int) -> int:
    """A Llama block's parameters: q, k, v, o, gate / up / down, two RMSNorm weights."""
    return h * heads * head_dim + 2 * h * kv * head_dim + heads * head_dim * h + 3 * h * ffn + 2 * h


# (file, class, published parameters in billions, to the digits published, the count by hand or None)
PUBLISHED = [
    ("llama-3-8b", "LlamaForCausalLM", "8.03", 2 * 128256 * 4096 + 32 * _layer_params(4096, 14336, 32, 8, 128) + 4096),
    ("llama-3.1-405b", "LlamaForCausalLM", "405.9",
     2 * 128256 * 16384 + 126 * _layer_params(16384, 53248, 128, 8, 128) + 16384),
    ("mixtral-8x7b", "MixtralForCausalLM", "46.7", None),
    ("qwen2.5-72b", "Qwen2ForCausalLM", "72.7",
     2 * 152064 * 8192 + 80 * (_layer_params(8192, 29568, 64, 8, 128) + 8192 + 2 * 1024) + 8192),  # + q/k/v biases
    ("deepseek-v3", "DeepseekV3ForCausalLM", "671", None),  # without the multi-token-prediction layer
]


@pytest.mark.parametrize(("file", "cls", "published", "by_hand"), PUBLISHED)
def test_published_configs_build_without_weights(file: str, cls: str, published: str, by_hand: int | None) -> None:
    """The published config.json of a model up to 671B builds in this process without
    allocating its weights: every parameter a fake tensor in bfloat16 (no float32 copy), the
    count the published one (and the hand count where given)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    m = hf.build(cls, str(DATA / f"{file}.json"), dtype="bf16", weights=False)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    n = sum(p.numel() for p in m.parameters())
    digits = len(published.split(".")[1]) if "." in published else 0
    assert f"{n / 1e9:.{digits}f}" == published
    if by_hand is not None:
        assert n == by_hand
    assert not hf.has_weights(m)
    dtypes = {str(p.dtype) for name, p in m.named_parameters() if "gate.weight" not in name}
    assert dtypes == {"torch.bfloat16"}  # DeepSeek's router stays float32, as HF makes it
    assert grown < n * 2 / 100  # nowhere near the weights' size (bf16: 2 bytes each)


def test_prefix_plan_covers_every_kind_transition() -> None:
    assert prefix_plan([0] * 126) == (2, [0] + [1] * 125)  # Llama: a layer and one after it
    assert prefix_plan([0, 0, 0] + [1] * 58) == (5, [0, 1, 2, 3] + [4] * 57)  # DeepSeek-V3: 3 dense, then MoE
    assert prefix_plan([0, 1] * 4) == (3, [0, 1, 2, 1, 2, 1, 2, 1])  # Gemma 2: local / global
    assert prefix_plan(([0] * 5 + [1]) * 2) == (7, [0, 1, 2, 3, 4, 5, 6, 1, 1, 1, 1, 5])  # Gemma 3: 5 local, 1 global
    assert prefix_plan([0]) == (1, [0])


def test_layer_kinds_from_structure() -> None:
    """Gemma 2's layers alternate sliding / full attention (an attribute); Qwen3-MoE's dense and
    MoE layers differ by their MLP; the layer index is not a difference."""
    g2 = hf.build("Gemma2ForCausalLM", dict(TINY, head_dim=16), weights=False)
    path, layers = layer_stack(g2) or ("", [])
    assert path == "model.layers" and layer_kinds(layers) == [0, 1, 0, 1]
    moe = hf.build("Qwen3MoeForCausalLM", dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                              mlp_only_layers=[0, 1]), weights=False)
    assert layer_kinds(layer_stack(moe)[1]) == [0, 0, 1, 1]  # type: ignore[index]


def _same(a: Program, b: Program) -> None:
    assert list(a.ops) == list(b.ops)
    assert {n: (t.shape, t.dtype, t.kind) for n, t in a.tensors.items()} == \
        {n: (t.shape, t.dtype, t.kind) for n, t in b.tensors.items()}
    assert a.modules == b.modules and a.sources == b.sources and a.grads == b.grads  # type: ignore[attr-defined]
    assert a.optimizer == b.optimizer and set(a.values) == set(b.values)  # type: ignore[attr-defined]


def _canonical(p: Any) -> tuple[list[Any], dict[str, Any]]:
    """The program with every tensor but the parameters, buffers and inputs renamed by first use
    (export numbers a functionalised graph's nodes with gaps, so those names may differ)."""
    keep = {n for n, (k, _) in p.sources.items() if k in ("parameter", "buffer", "input")}
    ren: dict[str, str] = {}

    def r(v: Any) -> Any:
        if isinstance(v, tuple):
            return tuple(r(x) for x in v)
        if v is None or v in keep:
            return v
        return ren.setdefault(v, f"t{len(ren)}")
    ops = [(op.rule, {k: r(v) for k, v in op.inputs.items()}, r(op.outputs), dict(op.attrs), op.layer, op.phase)
           for op in p.ops]
    return ops, {r(n): (t.shape, t.dtype, t.kind) for n, t in p.tensors.items()}


@pytest.mark.parametrize(("cls", "cfg", "exact"), [
    ("LlamaForCausalLM", TINY, True),
    ("GPT2LMHeadModel", dict(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0,
                             eos_token_id=0), True),
    ("Gemma2ForCausalLM", dict(TINY, head_dim=16), True),
    ("Qwen3MoeForCausalLM", dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                 mlp_only_layers=[0]), False),
    pytest.param("DeepseekV3ForCausalLM", dict(TINY, num_hidden_layers=5, num_key_value_heads=4, first_k_dense_replace=2,
                                               moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                                               n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
                                               qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16), False,
                 marks=pytest.mark.skipif("aten.scatter" not in mapped_ops() or "strided_slice" not in GRADS,
                                          reason="DeepSeek-V3 needs the scatter lowering and strided_slice's grad")),
])
def test_repeated_layers_equal_the_full_trace(cls: str, cfg: dict[str, Any], exact: bool) -> None:
    """A 4-layer model imported from its first layers repeated (Llama, GPT-2: 2 traced; Gemma 2,
    local / global: 3; Qwen3-MoE with a dense first layer: 3; a 5-layer DeepSeek-V3, MLA, 2 dense
    layers then MoE: 4) is the full trace's training step,
    op for op: rules, inputs, outputs, attributes, layers, phases, every tensor's shape, dtype and
    kind, the parameters' names, the module paths, the gradients and the optimizer states. A
    functionalised graph (MoE's in-place updates) is numbered with gaps by torch.export: there the
    activations' names are compared up to renaming."""
    m = hf.build(cls, cfg, dtype="bf16", weights=False)
    kw = hf.example_inputs(m, 2, 16)
    full = import_module(m, (), kw, training=True, fallback="error")
    rep = import_module(m, (), kw, training=True, fallback="error", repeat_layers=True)
    # the repeat did apply (the full trace is its fallback): an export of the first layers expands
    stack = layer_stack(m)
    assert stack is not None
    n, copies = prefix_plan(layer_kinds(stack[1]))
    assert n < len(copies)
    if exact:
        _same(full, rep)
    else:
        assert _canonical(full) == _canonical(rep)
    assert sum(op.layer in ("model.layers.3", "transformer.h.3") for op in rep.ops) > 10


class _Summed(torch.nn.Module):
    """Layers whose outputs are all read after the last one (not a chain)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: Any) -> Any:
        outs = []
        for layer in self.layers:
            x = layer(x)
            outs.append(x)
        return sum(outs).sum()


class _Shared(torch.nn.Module):
    """One layer applied four times (its parameters shared between the layers)."""

    def __init__(self) -> None:
        super().__init__()
        lin = torch.nn.Linear(8, 8)
        self.layers = torch.nn.ModuleList([lin] * 4)

    def forward(self, x: Any) -> Any:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum()


@pytest.mark.parametrize("cls", [_Summed, _Shared])
def test_layers_that_are_not_a_chain_are_traced_whole(cls: Any) -> None:
    """Every layer's output read after the last one, or one layer's parameters shared by all: the
    first layers' export does not expand, and repeat_layers gives the full trace."""
    m = cls()
    x = torch.randn(2, 8)
    layers = m.layers
    m.layers = torch.nn.ModuleList(list(layers)[:2])
    ep = torch.export.export(m, (x,))
    m.layers = layers
    assert expand(ep, m, "layers", [0, 1, 1, 1]) is None
    full = import_module(m, (x,), training=True)
    _same(full, import_module(m, (x,), training=True, repeat_layers=True))
    assert len(full.parameters()) == (8 if cls is _Summed else 2)


def test_a_small_model_keeps_its_weights_and_a_large_one_imports_without() -> None:
    """``weights=None`` (what ``spmdkit plan`` and ``run`` load): a model up to WEIGHTS_UP_TO
    is built with its weights (the same program: a fake build traces alike) and runs; above it
    the model has none, torch_values says so, and the plan's program is the same."""
    prog, m, kw = import_hf_checked("LlamaForCausalLM", dict(TINY), 2, 16, "bfloat16")
    assert hf.has_weights(m) and {str(p.dtype) for p in m.parameters()} == {"torch.bfloat16"}
    vals = torch_values(prog, m, (), kw)
    assert vals["model.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
    fake_prog, fm, _ = hf.import_hf("LlamaForCausalLM", dict(TINY), dtype="bf16", weights=False)
    assert not hf.has_weights(fm)
    _same(prog, fake_prog)
    with pytest.raises(ProgramError, match=r"^torch_values: the module was imported without its weights"):
        torch_values(fake_prog, fm, (), kw)


def test_bf16_parameters_with_float32_master_and_moments() -> None:
    """--dtype bf16 plans in bf16: parameters and gradients bf16, AdamW's master copy and moments
    float32 (the 12 bytes per parameter of mixed-precision Adam), as the zoo models have them."""
    prog, _m, _kw = hf.import_hf("LlamaForCausalLM", dict(TINY), dtype="bf16", weights=False)
    params = prog.parameters()
    assert params and {prog.tensors[p].dtype for p in params} == {"bfloat16"}
    for p in params:
        grad, states, _new, _ = prog.optimizer[p]
        assert prog.tensors[grad].dtype == "bfloat16"
        assert [s.rsplit(".", 1)[1] for s in states] == ["moment1", "moment2", "master"]
        assert {prog.tensors[s].dtype for s in states} == {"float32"}


def test_build_in_the_dtype_directly() -> None:
    """No float32 detour: a bfloat16 build makes bfloat16 parameters (the memory check counts 2
    bytes each), and the float32 buffers HF makes on purpose (the rotary table) stay float32."""
    m = hf.build("LlamaForCausalLM", dict(TINY), dtype="bf16")
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    assert m.model.rotary_emb.inv_freq.dtype == torch.float32


def test_llama_3_8b_imports_at_full_size_with_the_models_parameters() -> None:
    """The full Llama-3-8B config imports as 2 traced layers repeated to 32: every parameter of
    the model (names and shapes) in the program, 8,030,261,248 of them, 32 layers of ops."""
    prog, m, kw = import_hf_checked("LlamaForCausalLM", str(DATA / "llama-3-8b.json"), 2, 16, "bfloat16")
    assert not hf.has_weights(m)
    got = {n: prog.tensors[n].shape for n in prog.parameters()}
    assert got == {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert sum(math.prod(s) for s in got.values()) == PUBLISHED[0][3]
    layers = {op.layer for op in prog.ops if op.layer.startswith("model.layers.")}
    assert layers == {f"model.layers.{i}" for i in range(32)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert hf_call_kwargs(m, kw)["use_cache"] is False


DS_TINY = dict(TINY, num_hidden_layers=3, num_key_value_heads=4, first_k_dense_replace=1, moe_intermediate_size=32,
               n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
               qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=512)


@pytest.mark.skipif("aten.scatter" not in mapped_ops() or "strided_slice" not in GRADS,
                    reason="DeepSeek-V3 needs the scatter lowering and strided_slice's grad")
def test_fills_of_activation_shape_are_ops_not_recorded_constants() -> None:
    """DeepSeek-V3's MLA writes its keys into ``kv.new_empty(b, heads, s, qk_head_dim)``: a fill
    of an activation's size is an op (a 0-d constant expanded), not a constant folded at import
    time, so the recorded values (and the importer's memory) do not grow as batch x seq x heads
    (at full size and seq 4096 they were 1.5 GiB a layer)."""
    from spmdkit.models.torch_import import context

    m = hf.build("DeepseekV3ForCausalLM", DS_TINY, dtype="bf16", weights=False)
    for seq in (32, 256):
        p = import_module(m, (), hf.example_inputs(m, 2, seq), training=True, repeat_layers=True)
        # nothing of b x s x heads elements or more but the causal mask [1, 1, s, s]: no [b, h, s, d] fill
        big = {v.shape for v in p.values.values() if math.prod(v.shape) >= 2 * seq * 4}
        assert big <= {(1, 1, seq, seq)}, (seq, big)
        assert any(op.rule == "expand" and any(str(o).startswith("new_empty") for o in op.output_names())
                   for op in p.ops)
    assert context.FOLD_FILL_UP_TO < 2 * 4 * 256 * 24  # the keys' fill is above it


@pytest.mark.skipif("aten.scatter" not in mapped_ops() or "strided_slice" not in GRADS,
                    reason="DeepSeek-V3 needs the scatter lowering and strided_slice's grad")
def test_fills_as_ops_compute_what_torch_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fill imported as an op (none made a constant) still gives torch's loss."""
    from spmdkit.execute.single import run_program
    from spmdkit.models.torch_import import context

    monkeypatch.setattr(context, "FOLD_FILL_UP_TO", 0)
    prog, model, kw = hf.import_hf("DeepseekV3ForCausalLM", DS_TINY, batch=2, seq=16, fallback="error",
                                   optimizer=None)
    assert sum(op.rule == "expand" for op in prog.ops) >= 3
    vals = run_program(prog, torch_values(prog, model, (), kw))
    with torch.no_grad():
        want = float(model(**kw).loss)
    assert prog.loss is not None and abs(float(vals[prog.loss]) - want) <= 1e-5 * abs(want)
