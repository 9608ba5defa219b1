"""HuggingFace transformers models as they come (built from tiny configs, seeded, no hub): the
12 architectures of issue 14 import with fallback="error" (no replicated op) from keyword inputs
(input_ids=, attention_mask= with padding zeros, labels=, decoder_input_ids=, pixel_values=),
and the simulator's single-process run of the imported program on the model's own weights
reproduces torch eager: the forward outputs for all 12, the model's own loss (ignore_index,
label shifting, the mean over counted tokens) and every parameter gradient for a
representative subset (GQA, MQA, MoE, softcapping, MLM, encoder-decoder, conv patches), and
bfloat16 / float16 training imports (HF's mixed-precision casts).

Tolerances: the simulator computes in float64; HF computes a few things in float32 on purpose
even in a float64 model (rotary tables, the logits upcast of the loss, T5's layer-norm
variance), so outputs and gradients are compared at rtol 1e-5 (BERT, which has none of these,
at 1e-9). Mixtral runs in float32 (torch's grouped_mm has no float64 kernel)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'spmdkit[torch]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'spmdkit[hf]')")

from spmdkit.execute.single import run_program  # noqa: E402
from spmdkit.models.torch_import import ImportedProgram, import_module, torch_values  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")  # torch's own, in export

B, S, V, H = 2, 16, 256, 64
_COMMON = dict(num_hidden_layers=2, hidden_size=H, num_attention_heads=4, intermediate_size=128, vocab_size=V,
               max_position_embeddings=64)


def _configs() -> dict[str, tuple[Any, Any]]:
    tf = transformers
    return {
        "gpt2": (tf.GPT2LMHeadModel, tf.GPT2Config(n_layer=2, n_embd=H, n_head=4, vocab_size=V, n_positions=64,
                                                   bos_token_id=0, eos_token_id=0)),
        "llama": (tf.LlamaForCausalLM, tf.LlamaConfig(num_key_value_heads=2, **_COMMON)),  # GQA
        "mistral": (tf.MistralForCausalLM, tf.MistralConfig(num_key_value_heads=2, **_COMMON)),
        "qwen2": (tf.Qwen2ForCausalLM, tf.Qwen2Config(num_key_value_heads=1, **_COMMON)),  # MQA
        "mixtral": (tf.MixtralForCausalLM, tf.MixtralConfig(num_key_value_heads=2, num_local_experts=4,
                                                            num_experts_per_tok=2, **_COMMON)),
        "gemma": (tf.GemmaForCausalLM, tf.GemmaConfig(num_key_value_heads=1, head_dim=16, **_COMMON)),
        "gemma2": (tf.Gemma2ForCausalLM, tf.Gemma2Config(num_key_value_heads=2, head_dim=16, **_COMMON)),
        "gemma3": (tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(num_key_value_heads=2, head_dim=16, **_COMMON)),
        "phi": (tf.PhiForCausalLM, tf.PhiConfig(num_key_value_heads=4, **_COMMON)),
        "bert": (tf.BertForMaskedLM, tf.BertConfig(**_COMMON)),
        "t5": (tf.T5ForConditionalGeneration, tf.T5Config(num_layers=2, d_model=H, num_heads=4, d_kv=16, d_ff=128,
                                                          vocab_size=V, decoder_start_token_id=0, pad_token_id=0)),
        "vit": (tf.ViTForImageClassification, tf.ViTConfig(num_hidden_layers=2, hidden_size=H, num_attention_heads=4,
                                                           intermediate_size=128, image_size=32, patch_size=8,
                                                           num_labels=10)),
    }


MODELS = list(_configs())
#: training in float64 against torch's autograd: MoE, softcapping + sliding window, masked LM
#: with -100 labels, encoder-decoder, conv patches (Llama's GQA trains in the bfloat16 test; the
#: others' training imports take the same code paths; docs/torch.md has the full matrix's figures)
TRAIN = ["mixtral", "gemma2", "bert", "t5", "vit"]


def _default_dtype(name: str) -> Any:
    return torch.float32 if name == "mixtral" else torch.float64


@pytest.fixture(scope="module")
def model() -> Callable[[str, Any], Any]:
    """Built models, shared by the tests of this module: ``model(name, dtype)``."""
    cache: dict[tuple[str, Any], Any] = {}
    cfgs = _configs()

    def get(name: str, dtype: Any = None) -> Any:
        dtype = dtype or _default_dtype(name)
        if (name, dtype) not in cache:
            cls, cfg = cfgs[name]
            torch.manual_seed(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m = cls(cfg).to(dtype)
            m.eval()
            cache[(name, dtype)] = m
        return cache[(name, dtype)]
    return get


def _inputs(name: str, labels: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        kw = {"pixel_values": torch.randn(B, 3, 32, 32, generator=g)}
        if labels:
            kw["labels"] = torch.randint(0, 10, (B,), generator=g)
        return kw
    ids = torch.randint(0, V, (B, S), generator=g)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, -4:] = 0  # a padded batch
    kw = {"input_ids": ids, "attention_mask": mask}
    if labels:
        lab = torch.randint(0, V, (B, S), generator=g)
        if name == "bert":
            lab[torch.rand(B, S, generator=g) > 0.3] = -100  # MLM: most tokens not counted
        else:
            lab[0, 3] = -100
        kw["labels"] = lab
    elif name == "t5":
        kw["decoder_input_ids"] = torch.randint(0, V, (B, S), generator=g)
    return kw


def _import(m: Any, kw: dict[str, Any], **opts: Any) -> ImportedProgram:
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="torch import")  # a replicated fallback would warn
        prog = import_module(m, (), kw, fallback="error", **opts)
    assert "replicated" not in {op.rule for op in prog.ops}
    return prog


def _eager(m: Any, kw: dict[str, Any]) -> Any:
    return m(**kw, use_cache=False) if getattr(m.config, "use_cache", None) is not None else m(**kw)


def _close(got: Any, want: Any, rtol: float, what: str) -> None:
    got = np.asarray(got, dtype=np.float64)
    want = want.detach().double().numpy() if isinstance(want, torch.Tensor) else np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert np.isfinite(got).all() and np.isfinite(want).all(), what
    scale = max(float(np.max(np.abs(want))), 1e-30) if want.size else 1.0
    err = float(np.max(np.abs(got - want))) if want.size else 0.0
    assert err <= rtol * scale, f"{what}: max error {err:.3e} > {rtol} x {scale:.3e}"


# -- forward: all 12 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_forward_imports_and_equals_torch(model: Any, name: str) -> None:
    m = model(name)
    kw = _inputs(name)
    prog = _import(m, kw)
    for k in kw:  # keyword inputs are program inputs under their names, found by their key path
        assert prog.tensors[k].kind == "input" and prog.input_path(k) == f"kwargs['{k}']"
    # every op knows the module that made it: a projection's matmul, the module owning its weight
    params = set(prog.parameters())
    projections = [(i, op) for i, op in enumerate(prog.ops) if op.rule == "matmul" and op.inputs["y"] in params]
    assert projections
    for i, op in projections:
        w = op.inputs["y"]
        owners = {n.rsplit(".", 1)[0] for n in [w, *(a for a, t in prog.aliases.items() if t == w)]}
        assert prog.modules[i][0] in owners, (i, prog.modules[i], owners)
    vals = run_program(prog, torch_values(prog, m, (), kw))
    with torch.no_grad():
        out = _eager(m, kw)
    flat = torch.utils._pytree.tree_flatten(out)[0]
    assert len(prog.outputs) == len(flat)
    for o, want in zip(prog.outputs, flat):
        _close(vals[o], want, 1e-5, f"{name} output {o}")


def test_conv2d_geometry_imports_exactly() -> None:
    """conv2d with stride, padding, dilation and groups (conv3d over a unit depth axis) and the
    plain one (the conv2d rule), forward and gradients against torch in float64."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=2, groups=2)
            self.b = torch.nn.Conv2d(6, 3, 2, bias=False)

        def forward(self, x: Any) -> Any:
            return self.b(torch.tanh(self.a(x))).square().mean()

    torch.manual_seed(0)
    m = Net().double()
    x = torch.randn(2, 4, 11, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    prog = _import(m, {"x": x}, training=True)
    rules = [op.rule for op in prog.ops]
    assert "conv3d" in rules and "conv2d" in rules
    c3 = next(op for op in prog.ops if op.rule == "conv3d")
    assert (c3.attrs["strides"], c3.attrs["paddings"], c3.attrs["dilations"], c3.attrs["groups"]) == \
        ((1, 2, 2), (0, 0, 1, 1, 1, 1), (1, 2, 2), 2)
    vals = run_program(prog, torch_values(prog, m, (), {"x": x}))
    loss = m(x)
    loss.backward()
    assert prog.loss is not None
    _close(vals[prog.loss], loss, 1e-12, "loss")
    for p, t in m.named_parameters():
        _close(vals[prog.grads[p]], t.grad, 1e-12, p)


class _IndexingOps(torch.nn.Module):
    """The ATen ops HF models reach beyond plain layers, on one parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 5, 4, dtype=torch.float64))

    def forward(self, x: Any, ids: Any, ids2: Any) -> Any:
        a = x * self.w  # [3, 5, 4]
        r = [a[ids], a[:, ids2],  # index_select on dims 0 and 1 (a 2-D index)
             a[ids, :, ids2[0, 0] + ids],  # non-adjacent index tensors: gather_nd
             a[torch.arange(3).view(3, 1), torch.arange(1, 4).view(1, 3)],  # constant ranges: a view
             a[torch.tensor([-1, 0])],  # negative constant indices
             torch.nn.functional.pad(a, (1, -1, 0, 2), value=-float("inf"))[..., :4].clamp(-1.0, 0.5),
             torch.nn.functional.pad(a, (0, 0, 2, 1), value=3.0)]
        b = a.clone()
        b[:, 1:3] = a[:, :2] * 2  # slice_scatter
        b[0] = a[2]  # select_scatter
        r.append(b)
        r.append(torch.isinf(r[5]).to(torch.float64))
        r.append(torch.topk(a, 2, dim=-1)[0])
        r.append(a.sort(dim=1)[0])
        loss = sum(t.sum() for k, t in enumerate(r) if k != 5) + r[5].clamp_min(-5).sum()
        return loss, *r


@pytest.mark.parametrize("training", [False, True])
def test_indexing_padding_scatter_clamp_sort_equal_torch(training: bool) -> None:
    torch.manual_seed(0)
    m = _IndexingOps()
    g = torch.Generator().manual_seed(3)
    args = (torch.randn(3, 5, 4, dtype=torch.float64, generator=g), torch.tensor([2, 0, 2]),
            torch.tensor([[1, 4], [0, 0]]))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="torch import")
        prog = import_module(m, args, training=training, fallback="error")
    rules = {op.rule for op in prog.ops}
    assert {"index_select", "gather_nd", "pad", "where", "concat", "topk", "argsort"} <= rules
    vals = run_program(prog, torch_values(prog, m, args))
    m.zero_grad()
    outs = m(*args)
    assert len(prog.outputs) == len(outs)
    for name, want in zip(prog.outputs, outs):
        got, w = np.asarray(vals[name], dtype=np.float64), want.detach().numpy()
        assert got.shape == w.shape, name
        assert np.array_equal(np.isneginf(got), np.isneginf(w)), name  # the -inf padding
        fin = np.isfinite(w)
        np.testing.assert_allclose(got[fin], w[fin], rtol=0, atol=1e-12, err_msg=name)
    if training:
        outs[0].backward()
        assert {"take_along_axis_grad", "gather_nd_grad", "pad_grad", "where_grad"} <= rules
        np.testing.assert_allclose(vals[prog.grads["w"]], m.w.grad.numpy(), rtol=0, atol=1e-12)


# -- training with the model's own loss ----------------------------------------------------------------


def _check_training(m: Any, kw: dict[str, Any], prog: ImportedProgram, ref: Any, rtol: float, name: str) -> None:
    """The simulated loss and gradients of ``prog`` (imported from ``m``) against torch's autograd
    on ``ref`` (``m`` itself, or a float64 copy of its weights)."""
    params = dict(ref.named_parameters())
    # a parameter's gradient under its name, or its parts' (an expert bank's [E, in, out] parts)
    of = {p: (w[0] if k == "parameter_slice" else w) for p, (k, w) in prog.sources.items() if p in prog.grads}
    assert set(of.values()) | set(prog.aliases) >= {k for k, v in params.items() if v.requires_grad}
    vals = run_program(prog, torch_values(prog, m, (), kw))
    ref.zero_grad()
    out = _eager(ref, kw)
    out.loss.backward()
    assert prog.loss is not None and prog.loss == prog.outputs[0]  # the loss field of the ModelOutput
    _close(vals[prog.loss], out.loss, rtol, f"{name} loss")
    gscale = max(float(p.grad.abs().max()) for p in params.values() if p.grad is not None)
    for p, g in prog.grads.items():
        kind, where = prog.sources[p]
        want = params[of[p]].grad
        assert want is not None, p
        if kind == "parameter_slice":
            _fqn, axis, lo, hi, *perm = where
            want = want.narrow(axis, lo, hi - lo)
            want = want.permute(*perm[0]) if perm and perm[0] else want
        got = np.asarray(vals[g], dtype=np.float64)
        err = float(np.max(np.abs(got - want.double().numpy())))
        assert np.isfinite(got).all() and err <= rtol * max(float(want.abs().max()), 1e-3 * gscale), \
            f"{name} gradient of {p}: max error {err:.3e}"


@pytest.mark.parametrize("name", TRAIN)
def test_training_own_loss_and_gradients_equal_torch(model: Any, name: str) -> None:
    m = model(name)
    kw = _inputs(name, labels=True)
    prog = _import(m, kw, training=True)
    assert {op.phase for op in prog.ops} == {"forward", "backward", "optimizer"}
    _check_training(m, kw, prog, m, 1e-9 if name == "bert" else 1e-5, name)


def test_mean_loss_counts_only_labelled_tokens(model: Any) -> None:
    """BERT's MLM loss over its few labelled tokens (the others -100), and HF's causal-LM loss
    (labels padded with -100 and shifted by one: 2 x 15 positions, one of them -100, so 29
    counted): the mean over the counted tokens, as torch computes it."""
    m = model("bert")
    kw = _inputs("bert", labels=True)
    prog = _import(m, kw, training=True)
    vals = run_program(prog, torch_values(prog, m, (), kw))
    with torch.no_grad():
        logits = _eager(m, kw).logits
    lab = kw["labels"].view(-1)
    keep = lab != -100
    tok = torch.nn.functional.cross_entropy(logits.view(-1, V)[keep], lab[keep], reduction="sum")
    want = tok.item() / int(keep.sum())
    assert 0 < int(keep.sum()) < lab.numel()
    assert abs(float(vals[prog.loss]) - want) < 1e-12  # not the mean over all 32 tokens
    g = model("gpt2")
    kw = _inputs("gpt2", labels=True)
    prog = _import(g, kw, training=True)
    vals = run_program(prog, torch_values(prog, g, (), kw))
    with torch.no_grad():
        logits = _eager(g, kw).logits.double()
    shifted = kw["labels"][:, 1:].reshape(-1)
    counted = shifted != -100
    assert int(counted.sum()) == B * (S - 1) - 1
    tok = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V)[counted], shifted[counted],
                                            reduction="sum")
    assert abs(float(vals[prog.loss]) - tok.item() / int(counted.sum())) < 1e-6  # HF's loss upcasts logits to f32


# -- mixed precision -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "dtype"), [("llama", "bfloat16"), ("mixtral", "bfloat16"), ("gemma", "float16")])
def test_half_precision_training_imports(model: Any, name: str, dtype: str) -> None:
    """A bfloat16 / float16 model trains as imported: parameters and gradients in that dtype,
    HF's casts (RMSNorm's float32 statistics, the float32 logits of the loss) in the program; its simulated step (float64 arithmetic) equals torch's autograd on the
    same (rounded) weights in float64."""
    m = model(name, getattr(torch, dtype))
    kw = _inputs(name, labels=True)
    prog = _import(m, kw, training=True)
    assert {prog.tensors[p].dtype for p in prog.parameters()} == {dtype}
    assert {prog.tensors[g].dtype for g in prog.grads.values()} == {dtype}
    casts = [op for op in prog.ops if op.rule == "cast"]
    assert any(op.attrs["dtype"] == "float32" for op in casts)  # upcasts inside the model
    assert any(op.rule == "cast_grad" for op in prog.ops)
    assert prog.tensors[prog.loss].dtype == "float32"  # HF's loss upcasts the logits
    ref = copy.deepcopy(m).to(_default_dtype(name))
    _check_training(m, kw, prog, ref, 1e-5, f"{name} {dtype}")


# -- spmdkit.models.hf: by class name and config ------------------------------------------------------------


def test_hf_helpers_build_inputs_in_range_and_import(tmp_path: Any) -> None:
    from spmdkit.core.errors import ProgramError
    from spmdkit.models.hf import build, example_inputs, import_hf

    cfg = dict(_COMMON, num_key_value_heads=1)
    path = tmp_path / "config.json"
    path.write_text(__import__("json").dumps(cfg))
    prog, m, kw = import_hf("Qwen2ForCausalLM", str(path), dtype="bf16", pad=3, seed=4, fallback="error")
    assert isinstance(m, transformers.Qwen2ForCausalLM) and m.dtype == torch.bfloat16
    ids, mask, lab = kw["input_ids"], kw["attention_mask"], kw["labels"]
    assert int(ids.min()) >= 0 and int(ids.max()) < V
    assert mask.tolist()[-1] == [1] * (S - 3) + [0] * 3 and int(mask[0].min()) == 1
    counted = lab[lab != -100]
    assert 0 < counted.numel() < lab.numel() and int(counted.min()) >= 0 and int(counted.max()) < V
    assert prog.loss is not None and {prog.tensors[g].dtype for g in prog.grads.values()} == {"bfloat16"}
    vit = build("ViTForImageClassification", _configs()["vit"][1].to_dict())
    kv = example_inputs(vit, 3, labels=True)
    assert tuple(kv["pixel_values"].shape) == (3, 3, 32, 32) and int(kv["labels"].max()) < 10
    t5 = build("T5ForConditionalGeneration", _configs()["t5"][1].to_dict())
    assert set(example_inputs(t5, labels=False)) == {"input_ids", "attention_mask", "decoder_input_ids"}
    for cls, cfg_arg, why in (("NoSuchModel", {}, "no model class"), ("LlamaForCausalLM", "{oops", "not valid JSON"),
                              ("LlamaForCausalLM", str(tmp_path / "missing.json"), "neither a JSON object")):
        with pytest.raises(ProgramError, match=why):
            build(cls, cfg_arg)


def test_hf_build_refuses_a_model_larger_than_memory(monkeypatch: Any) -> None:
    """A config whose parameters do not fit is a one-line ProgramError before anything is
    allocated (counted on the meta device), not an out-of-memory kill."""
    import spmdkit.models.hf as hf
    from spmdkit.core.errors import ProgramError

    cfg = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
           "vocab_size": 256}
    n = hf._param_count(transformers.LlamaForCausalLM, transformers.LlamaConfig(**cfg))
    assert n == 2 * 256 * 64 + 2 * (4 * 64 * 64 + 3 * 64 * 128 + 2 * 64) + 64 + 16  # + rotary buffers
    monkeypatch.setattr(hf, "_available_bytes", lambda: 2 * n * 2 - 1)  # just under twice the bf16 size
    with pytest.raises(ProgramError, match=r"LlamaForCausalLM with this config has 0.00 billion parameters"):
        hf.build("LlamaForCausalLM", cfg, dtype="bf16")
    monkeypatch.setattr(hf, "_available_bytes", lambda: 2 * n * 2)  # built in bf16 directly: no fp32 copy
    assert hf.build("LlamaForCausalLM", cfg, dtype="bf16").dtype == torch.bfloat16
    assert not hf.has_weights(hf.build("LlamaForCausalLM", cfg, dtype="bf16", weights=False))  # not refused


@pytest.mark.parametrize("max_positions", [64, 8])
def test_dynamic_ntk_rope_imports_as_hf_computes_it(max_positions: int) -> None:
    """rope_scaling dynamic (HF's dynamic NTK: the frequencies recomputed from the largest position
    id in the forward) failed torch.export ('GuardOnDataDependentSymNode'); it imports with the
    frequencies HF computes at the traced length: unchanged at seq 16 <= max_position_embeddings
    64, grown past 8; the step's loss equal to eager either way."""
    import torch

    from spmdkit.models.hf import import_hf

    cfg = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": max_positions}
    dyn = {**cfg, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}
    prog, m, kw = import_hf("LlamaForCausalLM", dyn, batch=2, seq=16, dtype="float64")
    got = run_program(prog, torch_values(prog, m, (), kw))[prog.loss]
    rope = m.model.rotary_emb
    assert rope.rope_type == "dynamic"  # restored after the trace
    with torch.no_grad():
        eager = m(**kw).loss.item()
    assert abs(float(got) - eager) < 1e-6  # HF upcasts the logits to float32 for its loss
    # the frequencies the step read: grown (base 10000 x (4 x 16 / 8 - 3) ** (8 / 6)) past 8 positions
    grown = 1.0 / (10000 * 5 ** (8 / 6)) ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    want = grown if max_positions < 16 else rope.original_inv_freq
    assert torch.allclose(rope.inv_freq.double(), want.double(), rtol=1e-6)
