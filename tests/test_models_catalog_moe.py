"""The catalog's MoE and MLA models (Mixtral, Qwen3-MoE, DeepSeek-V2-Lite and V3): parameter
counts from the built program against the published total and active figures, and megatron's
parameter memory per device (needs the zoo's MoE / MLA builders, branch zooarch)."""

from __future__ import annotations

import pytest

from spmdkit.cost.memory import memory_per_device
from spmdkit.models import catalog
from spmdkit.models.params import count_params, mismatches, parameters
from spmdkit.models.zoo import preset
from spmdkit.planner.planning import plan_preset

MOE = [n for n, e in catalog.entries().items() if e.fields.get("experts")]


def test_the_moe_models_are_in_the_catalog() -> None:
    assert set(MOE) == {"mixtral-8x7b", "mixtral-8x22b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v2-lite",
                        "deepseek-v3", "qwen3-next-80b-a3b"}


@pytest.mark.parametrize("name", MOE)
def test_moe_parameter_counts_match_the_published_figures(name: str) -> None:
    e = catalog.lookup(name)
    assert e is not None and "active" in e.published
    assert mismatches(e, count_params(preset(name))) == []


def test_active_parameters_by_hand() -> None:
    """Mixtral 8x7B: per layer attention 4096 x (4096 + 2 x 1024 + 4096), two of eight experts of
    3 x 4096 x 14336, the router 4096 x 8 and two RMS norms; embeddings 2 x 32000 x 4096 and the
    final norm. DeepSeek-V3: 256 routed experts of 3 x 7168 x 2048 in 58 layers and the MTP module's
    MoE layer, 8 a token; the MTP module (models/zoo_mtp.py) 11.61B beside the 671.03B: eh_proj
    [2 x 7168, 7168], its 3 norms and one MLA + MoE layer (the embedding and the head shared)."""
    attn, expert, router, norms = 4096 * (4096 + 2048 + 4096), 3 * 4096 * 14336, 4096 * 8, 2 * 4096
    layer_total = attn + 8 * expert + router + norms
    emb = 2 * 32000 * 4096 + 4096
    pc = count_params(preset("mixtral-8x7b"))
    assert pc.total == 32 * layer_total + emb
    assert pc.active == 32 * (layer_total - 6 * expert) + emb
    v3 = count_params(preset("deepseek-v3"))
    H = 7168
    assert v3.total - v3.active == (58 + 1) * (256 - 8) * 3 * H * 2048
    assert v3.token_embedding == 129280 * H
    mla = H * 1536 + 1536 * 128 * 192 + H * (512 + 64) + 512 * 128 * (128 + 128) + 128 * 128 * H + 1536 + 512
    moe_layer = mla + 2 * H + H * 256 + 256 * 3 * H * 2048 + 3 * H * 2048  # norms, router, routed, shared
    assert v3.mtp == 2 * H * H + 3 * H + moe_layer == 11_610_067_968
    assert v3.total - v3.mtp == 671_026_404_352  # the report's 671B: the main model
    assert v3.total == 682_636_472_320


@pytest.mark.parametrize("name", MOE)
def test_megatron_holds_moe_params_bytes_over_shards(name: str) -> None:
    """Megatron at tp (8, or what divides the heads and the kv heads) over experts as
    Megatron-Core runs them with expert-tensor-parallel = tp: each expert's gate / up split on
    its moe_ffn axis, down on its input; router, norms and MLA's down projections replicated;
    Gated DeltaNet's projections, filters, dt_bias and A_log split with its heads, its gated
    norm replicated; at dense_layers + 1 layers."""
    cfg = preset(name)
    tp = next(t for t in (8, 4, 2) if cfg.heads % t == 0 and (cfg.mla or cfg.n_kv % t == 0))
    _, plan, _ = plan_preset(name, f"tp={tp}", "megatron", {"layers": cfg.dense_layers + 1, "seq": 256})
    expect = 0
    for p, n in parameters(plan.program).items():
        shape = plan.program.tensors[p].shape
        split = ".experts.w_" in p or ".shared.w_" in p or p.endswith((".wq", ".wk", ".wv", ".wo", ".w_gate",
                                                                         ".w_up", ".w_down", ".wq_b", ".wkv_b"))
        split = split or p in ("embed", "lm_head") or (".gdn." in p and not p.endswith(".norm"))  # Gated DeltaNet
        # the MTP module's projection, column-parallel, and its layer's attention gate (zoo_mtp)
        split = split or p.endswith((".eh_proj", ".attn_gate"))
        expect += 2 * (n // tp if split else n)
        assert not split or shape[-1] % tp == 0 or shape[-2] % tp == 0
    assert memory_per_device(plan).parameters == expect
