"""``spmdkit run`` of the zoo's MoE and MLA models with the default torch kernels.

In-process (fast): the moe family's torch kernels equal the float64 numpy references on random
inputs, batched and not, with capacity overflow (dropped tokens) and a correction bias; a whole
MoE / MLA / DeepSeek-like step on the torch kernels in float64 equals the numpy references
tensor by tensor; a MoE layer of that step (router, top-k with dropped tokens, experts, shared
expert) equals an independent torch eager implementation under autograd. On gloo: the three
models on dp=2 x tp=2 megatron equal the single-process step (loss, every gradient, update and
activation) with the plan's collectives, under a title naming the experts and MLA's ranks; titles
name what differs from the arch's defaults."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import run_json

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'spmdkit[torch]')")

from spmdkit.execute.check import TOLERANCES  # noqa: E402
from spmdkit.execute.kernels import get_kernel, missing_kernels  # noqa: E402
from spmdkit.execute.single import global_step, global_step_torch  # noqa: E402
from spmdkit.models.source import preset_title, variants  # noqa: E402
from spmdkit.models.zoo import PRESETS, preset  # noqa: E402
from spmdkit.planner.planning import plan_model  # noqa: E402
from spmdkit.sim.plan import source_values  # noqa: E402
from spmdkit.sim.reference import Ctx, get_reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

MOE = {"base": "tiny-llama", "experts": 4, "top_k": 2, "moe_ffn": 8}
MLA = {"base": "tiny-llama", "kv_heads": None, "kv_lora_rank": 8, "q_lora_rank": 6, "qk_rope_head_dim": 4, "head_dim": 4,
       "v_head_dim": 6}
#: DeepSeek-like: MLA, a dense first layer, then routed experts and a shared expert; capacity
#: factor 0.5 drops tokens (capacity ceil(8 x 2 / 4 x 0.5) = 2 of a sequence's 4 uniform shares)
DEEPSEEK = {**MLA, **MOE, "shared_experts": 1, "dense_layers": 1, "capacity_factor": 0.5}


def _ref(name: str, **arrays: Any) -> tuple[np.ndarray, ...]:
    ref = get_reference(name)
    assert ref is not None
    return tuple(np.asarray(o) for o in ref.run(dict(arrays), Ctx(None)))  # type: ignore[arg-type]


def _kernel(name: str, **arrays: Any) -> tuple[np.ndarray, ...]:
    k = get_kernel(name)
    assert k is not None
    args = {n: torch.as_tensor(v) if isinstance(v, np.ndarray) else v for n, v in arrays.items()}
    return tuple(o.numpy() for o in k(args, Ctx(None)))  # type: ignore[arg-type]


def _equal(got: tuple[np.ndarray, ...], want: tuple[np.ndarray, ...]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        if w.dtype.kind in "iu":
            assert np.array_equal(g, w)
        else:
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("batch", [None, 3])
@pytest.mark.parametrize(("s", "e", "k", "cap"), [(12, 4, 2, 2), (12, 4, 2, 6), (9, 5, 3, 27), (7, 3, 1, 0),
                                                  (16, 8, 2, 1)])
def test_moe_kernels_equal_the_numpy_references(batch: int | None, s: int, e: int, k: int, cap: int) -> None:
    """Forward and grads, float64, random inputs; small capacities drop tokens (checked to happen),
    a correction bias changes the choice but not the weights; every index exactly equal."""
    rng = np.random.default_rng(100 * s + 10 * e + k + cap)
    lead = () if batch is None else (batch,)
    h = 5
    x, gl = rng.normal(size=(*lead, s, h)), rng.uniform(0.05, 1.0, size=(*lead, s, e))
    for cb in (None, rng.normal(scale=0.3, size=(e,))):
        want = _ref("moe_gate_dispatch", x=x, gate_logits=gl, corr_bias=cb, k=k, capacity=cap, use_pad=True)
        got = _kernel("moe_gate_dispatch", x=x, gate_logits=gl, corr_bias=cb, k=k, capacity=cap, use_pad=True)
        _equal(got, want)
        y, cw, si, off, eid = want
        dropped = int(np.sum(cw == 0))
        assert dropped == s * k * (batch or 1) - int(np.sum(np.minimum(np.diff(off, prepend=0), cap)))
        if cap < s * k / e:
            assert dropped > 0
        gy, gcw = rng.normal(size=y.shape), rng.normal(size=cw.shape)
        args = {"combine_weights": cw, "scatter_index": si, "expert_id": eid, "grad_y": gy,
                "grad_combine_weights": gcw, "k": k, "capacity": cap, "use_pad": True}
        _equal(_kernel("moe_gate_dispatch_grad", **args), _ref("moe_gate_dispatch_grad", **args))
        # combine: the experts' rows gathered back through the dispatch's own indices
        rows = rng.normal(size=(*lead, e * cap, h)) if cap else rng.normal(size=(*lead, 1, h))
        sit = np.swapaxes(si, -1, -2)
        cargs = {"x": rows, "combine_weights": cw, "scatter_index": sit}
        _equal(_kernel("moe_combine", **cargs), _ref("moe_combine", **cargs))
        gargs = {**cargs, "grad_y": rng.normal(size=(*lead, s, h))}
        _equal(_kernel("moe_combine_grad", **gargs), _ref("moe_combine_grad", **gargs))


def test_dispatch_places_tokens_in_k_then_token_order_and_drops_past_capacity() -> None:
    """A hand-worked dispatch: 4 tokens, 2 experts, top-1 and top-2, capacity 2; ties go to the
    lower expert."""
    x = np.arange(4.0)[:, None] + 1.0  # token i carries i + 1
    gl = np.array([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.5, 0.5]])
    y, cw, si, off, eid = _kernel("moe_gate_dispatch", x=x, gate_logits=gl, corr_bias=None, k=1, capacity=2,
                                  use_pad=True)
    # every token chooses expert 0 (token 3 by the tie); tokens 0 and 1 fit, 2 and 3 are dropped
    assert eid[:, 0].tolist() == [0, 0, 0, 0] and y[0, :, 0].tolist() == [1.0, 2.0] and y[1].sum() == 0
    assert cw[:, 0].tolist() == [0.9, 0.8, 0.0, 0.0] and si[0].tolist() == [0, 1, 0, 0] and off.tolist() == [4, 4]
    y, cw, si, off, eid = _kernel("moe_gate_dispatch", x=x, gate_logits=gl, corr_bias=np.array([0.0, 0.5]), k=2,
                                  capacity=3, use_pad=True)
    # the bias makes expert 1 first for tokens 2 and 3 (chosen by 0.8 and 1.0), weighted by their gate
    # values 0.3 and 0.5; first choices take slots before second ones: tokens 1 and 3's second
    # choices find their experts full
    assert eid.tolist() == [[0, 1], [0, 1], [1, 0], [1, 0]] and off.tolist() == [4, 8]
    assert si.tolist() == [[0, 1, 3, 4], [5, 0, 2, 0]]
    assert y[:, :, 0].tolist() == [[1.0, 2.0, 3.0], [3.0, 4.0, 1.0]]
    assert cw.tolist() == [[0.9, 0.1], [0.8, 0.0], [0.3, 0.7], [0.5, 0.0]]


def _float64(plan: Any) -> None:
    for t in plan.program.tensors.values():
        if t.dtype in ("float32", "bfloat16", "float16"):
            object.__setattr__(t, "dtype", "float64")


@pytest.mark.parametrize("cfg", [MOE, MLA, DEEPSEEK], ids=["moe", "mla", "deepseek"])
def test_a_moe_mla_step_on_torch_kernels_equals_the_numpy_references(cfg: dict[str, Any]) -> None:
    _, plan, _ = plan_model(json.dumps(cfg), "dp=2,tp=2", "megatron")
    assert missing_kernels(plan.program) == {}
    _float64(plan)
    want = global_step(plan, 3)
    got, _ = global_step_torch(plan, 3)
    assert set(got) == set(want)
    for n, w in want.items():
        g = got[n].numpy()
        assert g.shape == w.shape, n
        if w.dtype.kind != "f":
            assert np.array_equal(g, w), n
        else:
            assert np.max(np.abs(g - w), initial=0.0) <= 1e-8 * max(1.0, float(np.max(np.abs(w), initial=0.0))), n


def _eager_moe(x: Any, w: dict[str, Any], k: int, cap: int) -> tuple[Any, Any]:
    """A MoE MLP in plain torch, token by token: softmax router, top-k, (k, token) order up to
    ``cap`` tokens per expert and sequence, SwiGLU experts weighted by the gate value, plus the
    shared expert; and each sequence's load-balancing loss as HF Mixtral's
    load_balancing_loss_func counts it (one_hot of the chosen experts, dropped ones included,
    times the mean router probability; without its constant factor)."""
    probs = torch.softmax(x @ w["router"], dim=-1)
    top = torch.topk(probs, k, dim=-1).indices
    counts = torch.nn.functional.one_hot(top, probs.shape[-1]).sum(dim=(1, 2)).to(probs.dtype)
    aux = (counts * probs.mean(dim=1)).sum(dim=-1)
    out = []
    for b in range(x.shape[0]):
        count = [0] * probs.shape[-1]
        rows = [x[b, i] * 0.0 for i in range(x.shape[1])]
        for kk in range(k):
            for i in range(x.shape[1]):
                e = int(top[b, i, kk])
                count[e] += 1
                if count[e] <= cap:
                    act = torch.nn.functional.silu(x[b, i] @ w["experts.w_gate"][e]) * (x[b, i] @ w["experts.w_up"][e])
                    rows[i] = rows[i] + probs[b, i, e] * (act @ w["experts.w_down"][e])
        out.append(torch.stack(rows))
    shared = torch.nn.functional.silu(x @ w["shared.w_gate"]) * (x @ w["shared.w_up"]) @ w["shared.w_down"]
    return torch.stack(out) + shared, aux


def test_a_moe_layer_equals_torch_eager_under_autograd() -> None:
    """Layer 1 of the DeepSeek-like step (float64, tokens dropped): its output, its aux loss and
    the gradients of its input, router, experts and shared expert equal plain torch autograd's
    on the same input, weights and output gradients."""
    _, plan, _ = plan_model(json.dumps(DEEPSEEK), "dp=2,tp=2", "megatron")
    _float64(plan)
    step, _ = global_step_torch(plan, 5)
    p = "layers.1."
    names = ["router", "experts.w_gate", "experts.w_up", "experts.w_down", "shared.w_gate", "shared.w_up",
             "shared.w_down"]
    src = source_values(plan.program, 5)
    w = {n: torch.tensor(np.asarray(src[p + n], dtype=np.float64), requires_grad=True) for n in names}
    x = step[p + "mlp_norm.out"].detach().clone().requires_grad_(True)
    out, aux = _eager_moe(x, w, 2, 2)
    assert int((step[p + "dispatch.weights"] == 0).sum()) > 0  # tokens were dropped
    torch.testing.assert_close(out, step[p + "moe_out.sum"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(aux, step[p + "aux"][:, 0].to(aux.dtype), rtol=1e-12, atol=1e-12)
    assert torch.all(step[p + "aux.grad"] == 1)  # the loss sums the aux losses with the token losses
    torch.autograd.backward([out, aux], [step[p + "moe_out.sum.grad"], step[p + "aux.grad"][:, 0].to(aux.dtype)])
    torch.testing.assert_close(x.grad, step[p + "mlp_norm.out.grad.sum"], rtol=1e-10, atol=1e-12)
    for n in names:
        torch.testing.assert_close(w[n].grad, step[p + n + ".grad"], rtol=1e-10, atol=1e-12, msg=n)


def test_titles_name_experts_mla_positions_norms_and_biases() -> None:
    """A title names what differs from the arch's defaults (nothing for a default config)."""
    assert preset_title("llama-7b", PRESETS["llama-7b"]) == (
        "llama-7b: llama, 32 layers, hidden 4096, 32 heads, FFN 11008, vocab 32000, seq 4096, batch 8, bfloat16")
    assert preset_title("deepseek-v3", preset("deepseek-v3")) == (
        "deepseek-v3: llama (256 experts top-8, expert FFN 2048, 1 shared, 3 dense layers first, MLA kv rank 512, "
        "q rank 1536, qk head 128+64 rope, v head 128), 61 layers, hidden 7168, 128 heads, FFN 18432, vocab 129280, "
        "seq 4096, batch 1, bfloat16")
    assert preset_title("mixtral-8x7b", preset("mixtral-8x7b")).startswith(
        "mixtral-8x7b: llama (8 experts top-2), 32 layers, hidden 4096, 32 heads (8 kv), FFN 14336")
    assert preset_title("bloom-176b", preset("bloom-176b")).startswith(
        "bloom-176b: gpt2 (flash attention, ALiBi, linear biases, embedding norm, tied embeddings), 70 layers")
    assert variants(preset("gemma2-9b")) == ["geglu", "head dim 256", "tied embeddings"]
    assert variants(preset("qwen2.5-72b")) == ["q/k/v biases"]
    assert variants(preset("deepseek-v2-lite"))[-3:] == ["MLA kv rank 512", "qk head 128+64 rope", "v head 128"]
    gpt = PRESETS["tiny-gpt2"]
    assert variants(gpt.with_(norm="rms", positions="rope")) == ["RMS norm", "rotary positions"]
    assert variants(gpt.with_(norm="layer", positions="learned", dropout=0.1)) == ["dropout 0.1"]
    llama = PRESETS["tiny-llama"]
    assert variants(llama.with_(norm="layer", positions="none", head_dim=8, qkv_bias=True)) == [
        "head dim 8", "layer norm", "no positions", "q/k/v biases"]
    assert variants(llama.with_(positions="learned", head_dim=4)) == ["learned positions"]  # 4 = 16 / 4 heads
    moe = llama.with_(experts=8, top_k=1, moe_ffn=32, shared_experts=2, dense_layers=1, capacity_factor=1.25)
    assert variants(moe) == ["8 experts top-1", "2 shared", "1 dense layer first", "capacity factor 1.25"]


# -- on gloo --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("cfg", "layers", "title"), [
    (MOE, 1, "custom tiny-llama (1 layer, 4 experts top-2, expert FFN 8)"),
    (MLA, 1, "custom tiny-llama (1 layer, MLA kv rank 8, q rank 6, qk head 4+4 rope, v head 6)"),
    (DEEPSEEK, 2, "custom tiny-llama (2 layers, 4 experts top-2, expert FFN 8, 1 shared, 1 dense layer first, "
                  "capacity factor 0.5, MLA kv rank 8, q rank 6, qk head 4+4 rope, v head 6)"),
], ids=["moe", "mla", "deepseek"])
def test_run_moe_and_mla_models_with_the_default_torch_kernels(cfg: dict[str, Any], layers: int, title: str) -> None:
    """dp=2 x tp=2 megatron, 4 gloo processes, float32, the default kernels (torch): loss, every
    gradient, update and activation equal the single-process step, the collectives the plan's."""
    rep = run_json("--model-config", json.dumps({**cfg, "layers": layers}), "--mesh", "dp=2,tp=2", "--strategy",
               "megatron")
    assert rep["kernels"] == "torch" and rep["world_size"] == 4 and rep["backend"] == "gloo"
    assert rep["ok"] and rep["collectives_match"] and not rep["failures"] and rep["nonfinite"] == 0, rep["failures"]
    assert rep["checked"] > 100 and rep["max_rel_error"] <= TOLERANCES["float32"]
    assert rep["loss"] == pytest.approx(rep["reference_loss"], rel=1e-6)
    kinds = {(c["kind"], c["mesh_dim"]) for c in rep["collectives"]}
    assert {("all_reduce", 0), ("all_reduce", 1)} <= kinds
    assert rep["title"] == title + ", mesh dp=2,tp=2, strategy megatron"
