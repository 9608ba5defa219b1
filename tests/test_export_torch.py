"""``spmdkit plan ... --export torch FILE`` (spmdkit/outputs/export_torch.py): a Python module that
applies the plan with torch's own parallel APIs.

The generated files of tiny HF models are read back (imported: they are Python) and their styles,
data-parallel wrapping, pipeline and collectives checked against the plan; then the exported
``parallelize`` is applied on 4 gloo processes (tests/torch_export_ranks.py) and one forward and
backward compared with the eager model on the whole batch (loss and every gradient, float32), and
the collectives CommDebugMode counts in the model compared with the file's ``PLAN_COLLECTIVES``."""

from __future__ import annotations

import importlib.util
import json
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from spmdkit.outputs.export import ExportError
from spmdkit.outputs.export_torch import export_torch, torch_source

pytest.importorskip("torch", reason="torch is not installed (pip install 'spmdkit[torch]')")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'spmdkit[hf]')")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

LLAMA = {"num_key_value_heads": 2, "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
         "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64}
QWEN2 = {**LLAMA, "tie_word_embeddings": True}
GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": 64, "bos_token_id": 0,
        "eos_token_id": 0}
#: GPT-2's attention kept whole over tp (its fused c_attn cannot be column-parallel in torch), the MLP megatron
GPT2_ATTN_WHOLE = {"c_attn": "replicate", "attn.c_proj": "replicate"}
MIXTRAL = {**LLAMA, "num_local_experts": 4, "num_experts_per_tok": 2}
PHI3 = {**LLAMA, "pad_token_id": 0}
#: DeepSeek-V3 (MLA with q_lora, layer 0 dense, layer 1 MoE: 4 experts top 2, one shared expert) and
#: Qwen2-MoE (a shared expert and its sigmoid gate in every layer)
DSV3 = {**LLAMA, "num_key_value_heads": 4, "moe_intermediate_size": 32, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
        "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}
QWEN2MOE = {**LLAMA, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "num_experts": 4,
            "num_experts_per_tok": 2}
GEMMA2 = {**LLAMA, "head_dim": 16}
#: attention modules that view q / k / v with head counts of their own (self.num_heads): HEADS_PER_RANK
STABLELM = dict(LLAMA)
OPT = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_dim": 128, "vocab_size": 256,
       "max_position_embeddings": 64, "word_embed_proj_dim": 64, "enable_bias": False}  # k bias: its gradient is 0 but for rounding
BATCH, SEQ = 4, 16


def _plan(cls: str, cfg: dict[str, Any], mesh: str, strategy: str, patterns: dict[str, str] | None = None) -> Any:
    from spmdkit.planner.planning import plan_hf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_hf(cls, cfg, mesh, strategy, batch=BATCH, seq=SEQ, patterns=patterns)[3]


def _export(cls: str, cfg: dict[str, Any], mesh: str, strategy: str, folder: Path,
            patterns: dict[str, str] | None = None) -> Any:
    path = folder / "plan.py"
    export_torch(_plan(cls, cfg, mesh, strategy, patterns), str(path))
    return _load(path)


def _load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"exported_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _styles(mod: Any) -> dict[str, tuple[str, dict[str, Any]]]:
    """TP_PLAN as (class name, the style's layouts and use_local_output)."""
    out = {}
    for path, style in mod.TP_PLAN.items():
        kw = {k: getattr(style, k) for k in ("input_layouts", "output_layouts", "use_local_output",
                                              "desired_output_layouts") if hasattr(style, k)}
        kw = {k: v[0] if isinstance(v, tuple) and len(v) == 1 else v for k, v in kw.items()}
        out[path] = (type(style).__name__, kw)
    return out


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The exported modules of the tiny Llama on dp=2 x tp=2 under megatron, megatron+sp, megatron+sp+fsdp."""
    folder = tmp_path_factory.mktemp("llama")
    out = {}
    for st in ("megatron", "megatron,sp", "megatron,sp,fsdp"):
        path = folder / f"{st.replace(',', '_')}.py"
        export_torch(_plan("LlamaForCausalLM", LLAMA, "dp=2,tp=2", st), str(path))
        out[st] = _load(path)
    return out


def test_llama_megatron_styles_are_the_plans(llama_files: dict[str, Any]) -> None:
    from torch.distributed.tensor import Replicate, Shard

    mod = llama_files["megatron"]
    assert mod.MESH_DIMS == ("dp", "tp") and mod.MESH_SHAPE == (2, 2)
    assert mod.LOSS_PARALLEL is True and mod.PIPELINE is None
    # 2 per layer and the vocab-parallel embedding forward; 2 per layer and the LM head's input backward
    assert mod.PLAN_COLLECTIVES == {"forward": {"all_reduce": 5}, "backward": {"all_reduce": 5}}
    s = _styles(mod)
    assert list(s) == ["model.embed_tokens", "model.layers.*.input_layernorm", "model.layers.*.self_attn.q_proj",
                       "model.layers.*.self_attn.k_proj", "model.layers.*.self_attn.v_proj",
                       "model.layers.*.self_attn.o_proj", "model.layers.*.post_attention_layernorm",
                       "model.layers.*.mlp.gate_proj", "model.layers.*.mlp.up_proj", "model.layers.*.mlp.down_proj",
                       "lm_head"]
    col = ("ColwiseParallel", {"input_layouts": Replicate(), "output_layouts": Shard(-1), "use_local_output": True})
    row = ("RowwiseParallel", {"input_layouts": Shard(-1), "output_layouts": Replicate(), "use_local_output": True})
    assert s["model.layers.*.self_attn.q_proj"] == s["model.layers.*.mlp.up_proj"] == col
    assert s["model.layers.*.self_attn.o_proj"] == s["model.layers.*.mlp.down_proj"] == row
    assert s["model.embed_tokens"] == ("RowwiseParallel", {"input_layouts": Replicate(), "output_layouts": Replicate(),
                                                            "use_local_output": True})
    assert s["lm_head"] == ("ColwiseParallel", {**col[1], "use_local_output": False})  # the vocab-parallel loss
    assert s["model.layers.*.input_layernorm"][0] == "PrepareModuleOutput"
    # plain dp: FSDP2's replicate per block and the root, one all-reduce of each group's gradients
    assert mod.DATA_PARALLEL == {"mesh_dim": "dp", "zero": 0, "wrap": "replicate", "reshard_after_forward": False,
                                 "layers": "model.layers"}
    assert mod.DP_COLLECTIVES == {"forward": {}, "backward": {"allreduce_": 3}}


def test_llama_sequence_parallel_styles(llama_files: dict[str, Any]) -> None:
    from torch.distributed.tensor import Replicate, Shard

    mod = llama_files["megatron,sp"]
    s = _styles(mod)
    # the residual stream a sequence-sharded DTensor: the embedding and the row layers reduce-scatter
    row = ("RowwiseParallel", {"input_layouts": Shard(-1), "output_layouts": Shard(1), "use_local_output": False})
    assert s["model.layers.*.self_attn.o_proj"] == s["model.layers.*.mlp.down_proj"] == row
    assert s["model.embed_tokens"] == ("RowwiseParallel", {"input_layouts": Replicate(), "output_layouts": Shard(1),
                                                            "use_local_output": False})
    for norm in ("model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm", "model.norm"):
        assert s[norm] == ("SequenceParallel", {"use_local_output": False}), norm
    # the norms' outputs all-gathered once for the column layers that share them; the LM head its own input
    after = {p: (type(v).__name__, v.output_layouts, v.desired_output_layouts) for p, v in mod.TP_PLAN_AFTER.items()}
    assert after == {n: ("PrepareModuleOutput", (Shard(1),), (Replicate(),))
                     for n in ("model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm")}
    assert s["model.layers.*.self_attn.q_proj"][1]["input_layouts"] == Replicate()
    assert s["lm_head"] == ("ColwiseParallel", {"input_layouts": Shard(1), "output_layouts": Shard(-1),
                                                 "use_local_output": False})
    # per layer: 2 reduce-scatters and 2 all-gathers each way; the embedding's reduce-scatter, the final
    # norm's all-gather; backward the mirrors, and the 5 norm weights' gradients (partial over tp: the
    # plan reduces them in its gradient sync, DTensor in the backward)
    assert mod.PLAN_COLLECTIVES == {"forward": {"all_gather_into_tensor": 5, "reduce_scatter_tensor": 5},
                                    "backward": {"all_gather_into_tensor": 5, "all_reduce": 5,
                                                 "reduce_scatter_tensor": 5}}


def test_llama_fsdp_wraps_each_block_and_the_root(llama_files: dict[str, Any]) -> None:
    mod = llama_files["megatron,sp,fsdp"]
    assert mod.DATA_PARALLEL == {"mesh_dim": "dp", "zero": 3, "wrap": "fully_shard", "reshard_after_forward": True,
                                 "layers": "model.layers"}
    # all-gather each group forward, each block again backward (resharded), reduce-scatter every group
    assert mod.DP_COLLECTIVES == {"forward": {"_allgather_base_": 3},
                                  "backward": {"_allgather_base_": 2, "_reduce_scatter_base_": 3}}
    assert _styles(mod) == _styles(llama_files["megatron,sp"])  # fsdp changes no tp style


def test_cli_writes_the_file_atomically_and_refuses_in_one_line(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from spmdkit.cli import main

    path = tmp_path / "plan.py"
    argv = ["plan", "--hf", "LlamaForCausalLM", "--hf-config", json.dumps(LLAMA), "--mesh", "dp=2,tp=2",
            "--batch", str(BATCH), "--seq", str(SEQ)]
    assert main([*argv, "--export", "torch", str(path)]) == 0
    text = path.read_text()
    command = text.split("Written by::\n\n    ", 1)[1].split("\n")[0]
    assert command.startswith("spmdkit plan --hf LlamaForCausalLM") and command.endswith(f"--export torch {path}")
    assert text == torch_source(_plan("LlamaForCausalLM", LLAMA, "dp=2,tp=2", "megatron"), command)
    compile(text, str(path), "exec")
    capsys.readouterr()
    assert main(["plan", "--model", "tiny-llama", "--mesh", "dp=2,tp=2", "--export", "torch", str(tmp_path / "z.py")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("spmdkit plan: ExportError: --export torch: the program ")
    assert "records no module paths (a preset's zoo model or a program JSON)" in err[0]
    assert not (tmp_path / "z.py").exists()
    assert main([*argv, "--export", "torch", str(tmp_path / "no" / "p.py")]) == 2
    assert capsys.readouterr().err.strip().endswith("does not exist")


def test_refusals_inherited_from_the_dtensor_export_name_export_torch(tmp_path: Path) -> None:
    """The checks the torch export shares with the dtensor one name the option the user typed:
    tp=4 over Llama's 2 kv heads leaves k / v whole beside column-parallel q (was '--export dtensor')."""
    plan = _plan("LlamaForCausalLM", LLAMA, "dp=2,tp=4", "megatron")
    with pytest.raises(ExportError, match=r"^--export torch: model\.layers\.0\.self_attn\.k_proj\.weight: "
                                          r"replicated over tp while model\.layers\.0\.self_attn\.q_proj"):
        export_torch(plan, str(tmp_path / "plan.py"))
    assert not (tmp_path / "plan.py").exists()


def test_qwen3_head_norms_are_sequence_parallel_on_the_heads(tmp_path: Path) -> None:
    """Qwen3's q_norm / k_norm run on the heads the column-parallel q_proj / k_proj make (Shard(2)
    of [batch, seq, heads, head_dim] over tp): SequenceParallel(sequence_dim=2, use_local_output=True),
    their weights' gradients the plan's tp all-reduces (2 a layer in the backward; it was refused as a
    second token axis). Without a dp wrap the file reduces those Partial gradients once as they are
    accumulated (_reduce_partial_grads_once); with FSDP2's replicate over dp it does not."""
    from torch.distributed.tensor import Shard

    qwen3 = {**LLAMA, "head_dim": 16}
    mod = _export("Qwen3ForCausalLM", qwen3, "dp=2,tp=2", "megatron", tmp_path)
    styles = _styles(mod)
    for norm in ("q_norm", "k_norm"):
        style, kw = styles[f"model.layers.*.self_attn.{norm}"]
        assert style == "SequenceParallel" and kw["use_local_output"] is True
        assert mod.TP_PLAN[f"model.layers.*.self_attn.{norm}"].sequence_sharding == (Shard(2),)
    assert mod.PLAN_COLLECTIVES == {"forward": {"all_reduce": 2 * 2 + 1}, "backward": {"all_reduce": 2 * 2 + 1 + 2 * 2}}
    assert not hasattr(mod, "_reduce_partial_grads_once")
    alone = tmp_path / "tp"
    alone.mkdir()
    mod = _export("Qwen3ForCausalLM", qwen3, "tp=2", "megatron", alone)
    assert "    _reduce_partial_grads_once(model)" in (alone / "plan.py").read_text()


def test_gemma2_norms_read_through_one_plus_weight_are_sequence_parallel(tmp_path: Path) -> None:
    """Gemma 2's RMSNorm scales by ``1 + weight``: the weight is read by ``add(weight, 1)``, whose
    output then meets the sequence-sharded activation. Under megatron,sp each of its norms is
    SequenceParallel (found through that add), so its weight is a replicated DTensor beside the
    DTensor input; before, it had none and every rank failed with "aten.mul.Tensor got mixed
    torch.Tensor and DTensor"."""
    mod = _export("Gemma2ForCausalLM", GEMMA2, "dp=2,tp=2", "megatron,sp", tmp_path)
    styles = _styles(mod)
    for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"):
        assert styles[f"model.layers.*.{norm}"] == ("SequenceParallel", {"use_local_output": False}), norm
    assert styles["model.norm"] == ("SequenceParallel", {"use_local_output": False})
    assert mod.TP_PLAN["model.norm"].sequence_sharding == (mod.Shard(1),)


def test_gemma3_head_norms_after_the_transpose_are_on_the_heads(tmp_path: Path) -> None:
    """Gemma 3's q_norm / k_norm run on q / k viewed and transposed to [batch, heads, seq, head_dim]
    (scaled by 1 + weight): the plan shards axis 1, the heads. Under megatron,sp they are
    SequenceParallel(sequence_dim=1, use_local_output=True), as Qwen3's on Shard(2): before, axis 1
    was taken for the sequence (use_local_output=False: every rank failed at run time on a DTensor
    meeting the attention's plain tensors), and under megatron they were refused ('Shard(None)')."""
    for strategy in ("megatron,sp", "megatron"):
        folder = tmp_path / strategy.replace(",", "_")
        folder.mkdir()
        mod = _export("Gemma3ForCausalLM", GEMMA2, "dp=2,tp=2", strategy, folder)
        for norm in ("q_norm", "k_norm"):
            style = mod.TP_PLAN[f"model.layers.*.self_attn.{norm}"]
            assert type(style).__name__ == "SequenceParallel" and style.use_local_output is True, (strategy, norm)
            assert style.sequence_sharding == (mod.Shard(1),)
        assert "self_attn.q_norm: runs on the heads a column layer makes, Shard(1) over tp" in \
            (folder / "plan.py").read_text().replace("\n#  ", "")


def test_olmo2_norms_over_the_whole_projection_are_refused(tmp_path: Path) -> None:
    """OLMo2's q_norm / k_norm span the whole q / k projection (num_heads * head_dim = 64 features),
    which the column-parallel q_proj shards over tp: the plan all-gathers it to normalise it whole,
    torch's ColwiseParallel hands the norm its rank's 32 (every rank failed at run time on the norm's
    64-wide weight) and no style reduces a norm's sum of squares over tp. Refused in one line naming
    the module, under megatron and megatron,sp; fsdp (no tp) exports."""
    for strategy in ("megatron,sp", "megatron"):
        with pytest.raises(ExportError, match=r"^--export torch: model\.layers\.0\.self_attn\.q_norm \(Olmo2RMSNorm\): "
                                              r"normalises the whole output linear of the column-parallel "
                                              r"model\.layers\.0\.self_attn\.q_proj \(64 features, Shard\(-1\) over "
                                              r"tp\), which the plan all-gathers first; torch's ColwiseParallel "
                                              r"hands it its rank's 32 .*--strategy fsdp\)$"):
            _export("Olmo2ForCausalLM", LLAMA, "dp=2,tp=2", strategy, tmp_path)
        assert not (tmp_path / "plan.py").exists()
    assert _export("Olmo2ForCausalLM", LLAMA, "dp=4", "fsdp", tmp_path).TP_PLAN == {}


def test_opt_positions_added_whole_to_a_reduce_scattered_stream_are_refused(tmp_path: Path) -> None:
    """OPT's decoder adds its learned positions (embed_positions, replicated) to the token
    embedding, which the plan under megatron,sp reduce-scatters over tp and all-gathers again to add
    whole: torch keeps the embedding's output a token-sharded DTensor and the positions a plain
    tensor (every rank failed: aten.add.Tensor got mixed torch.Tensor and DTensor). Refused in one
    line naming the module; OPT under megatron exports (and equals eager on gloo, GLOO_CASES)."""
    with pytest.raises(ExportError, match=r"^--export torch: model\.decoder\.embed_positions "
                                          r"\(OPTLearnedPositionalEmbedding\): its lookup embedding_1 is added in "
                                          r"model\.decoder to embedding, which the plan reduce-scatters over tp "
                                          r"\(model\.decoder\.embed_tokens, Shard\(0\)\) .*--strategy megatron, "
                                          r"without sp, exports\)$"):
        _export("OPTForCausalLM", OPT, "dp=2,tp=2", "megatron,sp", tmp_path)
    assert not (tmp_path / "plan.py").exists()


def test_shared_experts_beside_the_router_and_mla_export(tmp_path: Path) -> None:
    """DeepSeek-V3's router (and Qwen2-MoE's shared_expert_gate) read whole the input of the
    column-parallel shared experts (refused before): the shared experts MLP gets PrepareModuleInput
    to a replicated DTensor (its gate / up input gradients summed, all-reduced once, as the plan's
    one all-reduce), the router and the gate no style (plain, whole gradients). DeepSeek's MLA key
    (kv_a_proj_with_mqa's last qk_rope_head_dim = 8 features after kv_lora_rank = 16), whole over tp
    and expanded onto the sharded heads, gets the file's GradAllReduceColumns(16, 24). The dtensor
    export refuses that key (torch's own styles cannot hook it). Under megatron,sp Qwen2-MoE's block runs
    whole between PrepareModuleInputOutput (strategies.hf_sp: it was left on a layout no style runs and
    refused); DeepSeek-V3's MLA down projections on sequence shards are refused."""
    from torch.distributed.tensor import Replicate

    from spmdkit.outputs.export import dtensor_document

    mod = _export("DeepseekV3ForCausalLM", DSV3, "dp=2,tp=2", "megatron", tmp_path)
    s = _styles(mod)
    prep = mod.TP_PLAN["model.layers.1.mlp.shared_experts"]
    assert type(prep).__name__ == "PrepareModuleInput" and prep.input_layouts == (Replicate(),)
    assert prep.desired_input_layouts == (Replicate(),) and prep.use_local_output is False
    for lin in ("gate_proj", "up_proj"):
        assert s[f"model.layers.1.mlp.shared_experts.{lin}"][0] == "ColwiseParallel"
    assert s["model.layers.1.mlp.shared_experts.down_proj"][0] == "RowwiseParallel"
    assert s["model.layers.1.mlp.experts"][0] == "ExpertsTensorParallel" and "model.layers.1.mlp.gate" not in s
    assert "model.layers.*.post_attention_layernorm" not in s  # the router reads the norm's plain output
    key = mod.TP_PLAN["model.layers.*.self_attn.kv_a_proj_with_mqa"]
    assert type(key).__name__ == "GradAllReduceColumns" and (key.start, key.stop) == (16, 24)
    # forward: the embedding, 2 o_proj, layer 0's down_proj, layer 1's experts' rows and shared down_proj;
    # backward: per layer q_b_proj's and kv_b_proj's input and the MLA key, layer 0's MLP input, layer 1's
    # experts' input and shared experts' input, the LM head's input
    assert mod.PLAN_COLLECTIVES == {"forward": {"all_reduce": 6}, "backward": {"all_reduce": 2 * 3 + 1 + 2 + 1}}
    qwen = _export("Qwen2MoeForCausalLM", QWEN2MOE, "dp=2,tp=2", "megatron", tmp_path)
    s = _styles(qwen)
    assert type(qwen.TP_PLAN["model.layers.*.mlp.shared_expert"]).__name__ == "PrepareModuleInput"
    assert not any(p.endswith(("mlp.gate", "shared_expert_gate")) for p in s)
    # per layer forward o_proj, the shared expert's down_proj, the experts' rows (and the embedding);
    # backward the attention's, the experts' and the shared expert's input (and the LM head's)
    assert qwen.PLAN_COLLECTIVES == {"forward": {"all_reduce": 7}, "backward": {"all_reduce": 7}}
    doc = dtensor_document(_plan("Qwen2MoeForCausalLM", QWEN2MOE, "dp=2,tp=2", "megatron"))
    assert doc["parallelize_plan"]["model.layers.0.mlp.shared_expert"] == {
        "style": "PrepareModuleInput", "input_layouts": "Replicate()", "desired_input_layouts": "Replicate()",
        "use_local_output": False}
    with pytest.raises(ExportError, match=r"^--export dtensor: model\.layers\.1\.self_attn: the plan broadcasts "
                                          r"cat_5, whole over tp, onto heads sharded over tp \(expand\) and all-reduces "
                                          r"its gradient over tp .*--tp-plan '\{\"self_attn\.q_b_proj\": \"replicate\""):
        dtensor_document(_plan("DeepseekV3ForCausalLM", DSV3, "dp=2,tp=2", "megatron"))
    # megatron,sp: the MoE block (shared expert included) between Shard(1) -> Replicate() -> Shard(1), as
    # torchtitan's MoE module; the plan all-reduces the shared expert's gate / up input gradients one by one
    # there, so no PrepareModuleInput: each ColwiseParallel its own. DeepSeek-V3's MLA down projections run
    # on sequence shards: refused
    sp = _export("Qwen2MoeForCausalLM", QWEN2MOE, "dp=2,tp=2", "megatron,sp", tmp_path)
    s = _styles(sp)
    assert type(sp.TP_PLAN["model.layers.*.mlp"]).__name__ == "PrepareModuleInputOutput"
    assert "model.layers.*.mlp.shared_expert" not in s
    assert s["model.layers.*.mlp.shared_expert.down_proj"][1]["output_layouts"] == Replicate()
    # forward per layer: q/k/v's and the block's input all-gathered, o_proj reduce-scattered, the shared
    # down_proj and the experts' rows all-reduced; the embedding's reduce-scatter and the LM head's
    # all-gather. Backward their mirrors, per layer the experts', gate_proj's and up_proj's input
    # gradients all-reduced, and the 5 norm weights'
    assert sp.PLAN_COLLECTIVES == {"forward": {"all_gather_into_tensor": 5, "all_reduce": 4, "reduce_scatter_tensor": 3},
                                   "backward": {"all_gather_into_tensor": 5, "all_reduce": 2 * 3 + 5,
                                                "reduce_scatter_tensor": 3}}
    with pytest.raises(ExportError, match=r"^--export torch: model\.layers\.0\.self_attn\.q_a_proj: replicated over "
                                          r"tp, and the plan runs it on the token shards of its input \S+ "
                                          r"\(Shard\(1\) over tp, sequence parallel\); "):
        torch_source(_plan("DeepseekV3ForCausalLM", DSV3, "dp=2,tp=2", "megatron,sp"))


def test_llama_zero1_and_zero2_map_to_fsdp2_without_resharding(tmp_path: Path) -> None:
    for st, z in (("megatron,zero1", 1), ("megatron,zero2", 2)):
        mod = _export("LlamaForCausalLM", LLAMA, "dp=2,tp=2", st, tmp_path)
        assert mod.DATA_PARALLEL == {"mesh_dim": "dp", "zero": z, "wrap": "fully_shard",
                                     "reshard_after_forward": False, "layers": "model.layers"}
        assert mod.DP_COLLECTIVES == {"forward": {"_allgather_base_": 3}, "backward": {"_reduce_scatter_base_": 3}}


def test_qwen2_tied_with_biases_under_sequence_parallel(tmp_path: Path) -> None:
    from torch.distributed.tensor import Replicate, Shard

    mod = _export("Qwen2ForCausalLM", QWEN2, "dp=2,tp=2", "megatron,sp", tmp_path)
    assert mod.TIED == {"lm_head.weight": "model.embed_tokens.weight"}  # tied again after parallelize_module
    s = _styles(mod)
    assert s["model.layers.*.self_attn.q_proj"] == ("ColwiseParallel", {"input_layouts": Replicate(),
                                                                         "output_layouts": Shard(-1),
                                                                         "use_local_output": True})
    assert s["model.norm"][0] == "SequenceParallel" and s["lm_head"][1]["input_layouts"] == Shard(1)
    assert set(mod.TP_PLAN_AFTER) == {"model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm"}


def test_gpt2_fused_qkv_reordered_per_rank(tmp_path: Path) -> None:
    from torch.distributed.tensor import Replicate, Shard

    mod = _export("GPT2LMHeadModel", GPT2, "dp=2,tp=2", "megatron", tmp_path)
    assert mod.CONV1D_AS_LINEAR == ("transformer.h.*.attn.c_attn", "transformer.h.*.attn.c_proj",
                                    "transformer.h.*.mlp.c_fc", "transformer.h.*.mlp.c_proj")
    # c_attn: q | k | v, 64 features each; rank r's contiguous block [q_r | k_r | v_r]
    assert mod.FUSED_QKV == {"transformer.h.*.attn.c_attn": (64, 64, 64)}
    order = mod.fused_order((64, 64, 64), 2)
    assert order[:32] == list(range(32)) and order[32:64] == list(range(64, 96)) and order[96:128] == list(range(32, 64))
    assert sorted(order) == list(range(192))
    s = _styles(mod)
    assert list(s) == ["transformer.wte", "transformer.h.*.attn.c_attn", "transformer.h.*.attn.c_proj",
                       "transformer.h.*.mlp.c_fc", "transformer.h.*.mlp.c_proj", "lm_head"]
    col = ("ColwiseParallel", {"input_layouts": Replicate(), "output_layouts": Shard(-1), "use_local_output": True})
    assert s["transformer.h.*.attn.c_attn"] == s["transformer.h.*.mlp.c_fc"] == col
    assert s["transformer.h.*.attn.c_proj"][1]["input_layouts"] == Shard(-1)
    # the embedding's and each block's 2 all-reduces forward; each block's 2 input gradients and the LM head's backward
    assert mod.PLAN_COLLECTIVES == {"forward": {"all_reduce": 5}, "backward": {"all_reduce": 5}}
    assert mod.TIED == {"lm_head.weight": "transformer.wte.weight"} and mod.DATA_PARALLEL["layers"] == "transformer.h"
    # the attention whole over tp (c_attn replicated) and c_proj row-parallel: the plan slices the heads
    # between (all-gathering q / k / v's gradients), torch would run it whole: refused
    with pytest.raises(ExportError, match=r"^--export torch: transformer\.h\.0\.attn\.c_proj \(RowwiseParallel\): no "
                                          r"column-parallel layer under transformer\.h\.0\.attn makes its input .*"
                                          r"\(--tp-plan '\{\"attn\.c_proj\": \"replicate\"\}'\)$"):
        torch_source(_plan("GPT2LMHeadModel", GPT2, "dp=2,tp=2", "megatron", {"c_attn": "replicate"}))
    whole = _export("GPT2LMHeadModel", GPT2, "dp=2,tp=2", "megatron", tmp_path, GPT2_ATTN_WHOLE)
    assert not hasattr(whole, "FUSED_QKV") and whole.PLAN_COLLECTIVES == {"forward": {"all_reduce": 3},
                                                                          "backward": {"all_reduce": 3}}


def test_gpt2_sequence_parallel_on_the_flattened_tokens(tmp_path: Path) -> None:
    """GPT-2's Conv1D multiplies the flattened [batch * seq, hidden] tokens, whose axis 0 the plan
    shards under sp: on [batch, seq, hidden] that is Shard(0) (each rank its batch rows of its dp
    slice), which torch's styles take as they take Shard(1)."""
    from torch.distributed.tensor import Replicate, Shard

    mod = _export("GPT2LMHeadModel", GPT2, "dp=2,tp=2", "megatron,sp", tmp_path)
    s = _styles(mod)
    assert s["transformer.wte"] == ("RowwiseParallel", {"input_layouts": Replicate(), "output_layouts": Shard(0),
                                                        "use_local_output": False})
    # the position embedding, replicated, added to the token-sharded stream: a replicated DTensor
    assert s["transformer.wpe"] == ("PrepareModuleOutput", {"output_layouts": Replicate(), "use_local_output": False,
                                                            "desired_output_layouts": Replicate()})
    assert [k for k, v in s.items() if v[0] == "SequenceParallel"] == ["transformer.h.*.ln_1", "transformer.h.*.ln_2",
                                                                       "transformer.ln_f"]
    assert mod.TP_PLAN["transformer.h.*.ln_1"].sequence_sharding == (Shard(0),)
    assert s["transformer.h.*.attn.c_attn"][1]["input_layouts"] == Shard(0)
    assert s["transformer.h.*.mlp.c_proj"][1]["output_layouts"] == Shard(0)
    # per block 2 all-gathers and 2 reduce-scatters, and the embedding's / the LM head's; backward their
    # mirrors and the all-reduces of the 5 norms' weights and biases and of wpe's gradient; not the
    # c_proj biases' 4 the plan adds (torch takes them from the all-gathered gradient)
    assert mod.PLAN_COLLECTIVES == {"forward": {"all_gather_into_tensor": 5, "reduce_scatter_tensor": 5},
                                    "backward": {"all_gather_into_tensor": 5, "all_reduce": 11,
                                                 "reduce_scatter_tensor": 5}}
    assert "Not counted: the plan's all-reduce of each row layer's bias" in (tmp_path / "plan.py").read_text()


def test_mixtral_experts_style_under_megatron_and_what_is_refused(tmp_path: Path) -> None:
    import torch

    mod = _export("MixtralForCausalLM", MIXTRAL, "dp=2,tp=2", "megatron", tmp_path)
    s = _styles(mod)
    # the experts get the file's own ParallelStyle; the router (mlp.gate) none: replicated
    assert s["model.layers.*.mlp.experts"] == ("ExpertsTensorParallel", {})
    assert not any(p.endswith("mlp.gate") for p in s)
    # per layer forward: o_proj's and the experts' rows' all-reduce, and the embedding's; backward: the
    # attention's input (once for q / k / v), the experts' input, and the LM head's input
    assert mod.PLAN_COLLECTIVES == {"forward": {"all_reduce": 5}, "backward": {"all_reduce": 5}}
    # the permutation: rank r's Shard(1) chunk of the bank is [gate_r; up_r], gate_up_to_hf undoes it
    e, f, h, n = 2, 4, 3, 2
    bank = torch.arange(e * 2 * f * h, dtype=torch.float32).view(e, 2 * f, h)
    perm = bank.view(e, 2, n, f // n, h).transpose(1, 2).reshape(e, 2 * f, h)
    r1 = perm.chunk(n, dim=1)[1]
    assert torch.equal(r1, torch.cat([bank[:, f // n:f], bank[:, f + f // n:]], dim=1))
    assert torch.equal(mod.gate_up_to_hf(perm, n), bank)
    with pytest.raises(ExportError, match=r"^--export torch: model\.layers\.0\.mlp\.experts: the plan shards its "
                                          r"expert stacks over ep \(model\.layers\.0\.mlp\.experts\.gate_up_proj_gate "
                                          r"\(1, -1, -1\)\); the export's experts style runs them over tp only"):
        torch_source(_plan("MixtralForCausalLM", MIXTRAL, "dp=2,ep=2", "dp,ep"))
    mod = _export("MixtralForCausalLM", MIXTRAL, "dp=4", "fsdp", tmp_path)
    assert mod.TP_PLAN == {} and mod.DATA_PARALLEL["zero"] == 3 and mod.PLAN_COLLECTIVES == {"forward": {},
                                                                                             "backward": {}}


def test_mixtral_sequence_parallel_moe_block_gathers_the_sequence(tmp_path: Path) -> None:
    """megatron+sp: the plan runs the MoE block on the whole sequence (torchtitan's layout), so the
    block gets PrepareModuleInputOutput (Shard(1) -> Replicate() in, Replicate() -> Shard(1) out, a
    sequence-sharded DTensor for the residual add) around the experts style; no all-to-all."""
    from torch.distributed.tensor import Replicate, Shard

    mod = _export("MixtralForCausalLM", MIXTRAL, "dp=2,tp=2", "megatron,sp", tmp_path)
    s = _styles(mod)
    assert s["model.layers.*.mlp.experts"] == ("ExpertsTensorParallel", {})
    block = mod.TP_PLAN["model.layers.*.mlp"]
    assert type(block).__name__ == "PrepareModuleInputOutput"
    assert block.prepare_module_input.input_layouts == (Shard(1),)
    assert block.prepare_module_input.desired_input_layouts == (Replicate(),)
    assert block.prepare_module_input.use_local_output is True
    assert block.prepare_module_output.output_layouts == (Replicate(),)
    assert block.prepare_module_output.desired_output_layouts == (Shard(1),)
    assert block.prepare_module_output.use_local_output is False
    assert s["model.layers.*.post_attention_layernorm"][0] == "SequenceParallel"
    assert not any(p.endswith("mlp.gate") for p in s)  # the router: replicated, on every token
    # forward: per layer q/k/v's and the MoE block's input all-gathered, o_proj reduce-scattered, the
    # experts' rows all-reduced; the embedding's reduce-scatter and the LM head's all-gather. Backward
    # their mirrors (the block's output gradient all-gathered, its experts' input gradient all-reduced)
    # and the 5 norm weights' gradients
    assert mod.PLAN_COLLECTIVES == {"forward": {"all_gather_into_tensor": 5, "all_reduce": 2,
                                                "reduce_scatter_tensor": 3},
                                    "backward": {"all_gather_into_tensor": 5, "all_reduce": 2 + 5,
                                                 "reduce_scatter_tensor": 3}}
    from spmdkit.planner.planning import plan_hf

    def annotated(user: dict[str, Any]) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return plan_hf("MixtralForCausalLM", MIXTRAL, "dp=2,tp=2", "megatron,sp", batch=BATCH, seq=SEQ,
                           user=user)[3]

    # the router's tokens annotated onto the batch rows over tp (the plan's layout before: all-to-all
    # from the sequence shard): two token axes over tp, refused where the residual stream is read
    with pytest.raises(ExportError, match=r"^--export torch: the plan shards the residual stream over tp on both "
                                          r"axis 0 and 1 of \[batch, seq, hidden\]; torch's sequence parallel "
                                          r"shards one token axis$"):
        torch_source(annotated({"moe_route.tokens": [[0, 1], -1, -1]}))
    # the block's output annotated whole over tp: not the Shard(1) -> Replicate() -> Shard(1) round trip
    with pytest.raises(ExportError, match=r"^--export torch: model\.layers\.0\.mlp: the plan makes its tokens "
                                          r"mul_10 Shard\(1\) over tp and reads them Replicate\(\), makes its output "
                                          r"reshape_2 Replicate\(\) and hands it on Replicate\(\); "):
        torch_source(annotated({"reshape_2": [0, -1, -1]}))


def test_auto_plan_of_a_tiny_model_exports(tmp_path: Path) -> None:
    from spmdkit.cli import main

    path = tmp_path / "auto.py"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["plan", "--hf", "LlamaForCausalLM", "--hf-config", json.dumps(LLAMA), "--mesh", "dp=2,tp=2",
                     "--auto", "--json", "--export", "torch", str(path)]) == 0
    mod = _load(path)
    # what --auto chose at this size: everything whole on every rank, the batch too: no style, no data
    # parallel wrapper (nothing to synchronise)
    assert mod.TP_PLAN == {} and mod.DATA_PARALLEL is None and mod.LOSS_PARALLEL is False


def test_pipeline_pp2_tp2_stages_and_collectives(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from spmdkit.cli import main

    path = tmp_path / "pp.py"
    argv = ["plan", "--hf", "LlamaForCausalLM", "--hf-config", json.dumps(LLAMA), "--mesh", "pp=2,tp=2",
            "--batch", str(BATCH), "--seq", str(SEQ), "--microbatches", "2"]
    assert main([*argv, "--export", "torch", str(path)]) == 0
    mod = _load(path)
    assert mod.MESH_DIMS == ("pp", "tp") and mod.MESH_SHAPE == (2, 2)
    assert mod.PIPELINE == {"stages": [["model.layers.0", "model.embed_tokens"], ["model.layers.1", "model.norm", "lm_head"]],
                            "schedule": "1F1B", "microbatches": 2, "layers": "model.layers",
                            "ends": ["model.embed_tokens", "model.norm", "lm_head"], "tied": []}
    # per microbatch: stage 0 the embedding's and layer 0's 2 all-reduces forward, layer 0's 2 backward;
    # stage 1 layer 1's 2 forward, its 2 and the LM head input's backward; x 2 microbatches
    assert mod.PLAN_COLLECTIVES_BY_STAGE == [{"forward": {"all_reduce": 6}, "backward": {"all_reduce": 4}},
                                             {"forward": {"all_reduce": 4}, "backward": {"all_reduce": 6}}]
    assert mod.PLAN_COLLECTIVES == {"forward": {"all_reduce": 10}, "backward": {"all_reduce": 10}}
    capsys.readouterr()
    assert main([*argv, "--strategy", "megatron,sp", "--export", "torch", str(tmp_path / "sp.py")]) == 2
    assert "a pipeline of a sequence-parallel plan" in capsys.readouterr().err
    assert not (tmp_path / "sp.py").exists()
    assert main([*argv, "--export", "jax", str(tmp_path / "j.json")]) == 2
    assert "--export jax: does not apply to a pipeline (pp) plan (--export torch does)" in capsys.readouterr().err


def test_gpt2_pipeline_tied_copies_and_its_own_stage_forward(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """GPT-2 at pp=2 x tp=2: the first stage holds wte and wpe (its stage forward written out:
    HF's model would add wpe again on the next stage), the last ln_f and lm_head, its copy of the
    tied wte; the copies' gradients all-reduced once per step on both stages (the plan's:
    planner/stage_costs.shared_parameters). A model whose first stage holds more than the token
    embedding and that is not GPT-2 stays refused."""
    from spmdkit.cli import main
    from spmdkit.models.source import HFModel
    from spmdkit.outputs.export_torch_pp import tied_copies
    from spmdkit.planner.pipeline_plan import plan_pipeline_source
    from spmdkit.planner.pipeline_split import op_stages

    path = tmp_path / "gpt2pp.py"
    argv = ["plan", "--hf", "GPT2LMHeadModel", "--hf-config", json.dumps(GPT2), "--mesh", "pp=2,tp=2",
            "--batch", str(BATCH), "--seq", str(SEQ), "--microbatches", "2"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([*argv, "--export", "torch", str(path)]) == 0
    mod = _load(path)
    assert mod.PIPELINE == {
        "stages": [["transformer.h.0", "transformer.wte", "transformer.wpe"], ["transformer.h.1", "transformer.ln_f",
                                                                             "lm_head"]],
        "schedule": "1F1B", "microbatches": 2, "layers": "transformer.h",
        "ends": ["transformer.wte", "transformer.wpe", "transformer.ln_f", "lm_head"],
        "tied": [{"names": ["transformer.wte.weight", "lm_head.weight"], "stages": [0, 1]}], "body": "transformer"}
    # per microbatch: stage 0 wte's, attn.c_proj's and mlp.c_proj's all-reduces forward, c_attn's and c_fc's
    # input gradients backward; stage 1 the block's 2 forward, its 2 and lm_head's input backward; x 2
    # microbatches; and once per step on each stage the tied copies' gradient all-reduce
    assert mod.PLAN_COLLECTIVES_BY_STAGE == [{"forward": {"all_reduce": 6}, "backward": {"all_reduce": 4 + 1}},
                                             {"forward": {"all_reduce": 4}, "backward": {"all_reduce": 6 + 1}}]
    text = path.read_text()
    assert "h = body.drop(body.wte(x) + body.wpe(positions)) if self.first else x" in text
    assert "torch.distributed.all_reduce(grad, group=group)" in text and "self.hf(inputs_embeds=x)" not in text
    # with dp: FSDP2's replicate per block and per module outside the blocks (the stage's forward calls them,
    # not the root's), each all-reducing after every microbatch: 3 groups x 2 microbatches on each stage
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main([*argv[:6], "pp=2,dp=2,tp=2", *argv[7:], "--export", "torch", str(tmp_path / "dp.py")]) == 0
    dp = _load(tmp_path / "dp.py")
    assert dp.DP_COLLECTIVES == {0: {"allreduce_": 6}, 1: {"allreduce_": 6}}
    assert "            replicate(model.get_submodule(name), mesh=dp)" in (tmp_path / "dp.py").read_text()
    capsys.readouterr()
    neo = {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "vocab_size": 128, "max_position_embeddings": 64,
           "attention_types": [[["global"], 2]]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["plan", "--hf", "GPTNeoForCausalLM", "--hf-config", json.dumps(neo), "--mesh", "pp=2,tp=2",
                     "--batch", str(BATCH), "--seq", str(SEQ), "--microbatches", "2", "--export", "torch",
                     str(tmp_path / "neo.py")]) == 2
        got = plan_pipeline_source(HFModel("GPT2LMHeadModel", json.dumps(GPT2), "float32", BATCH, SEQ), "pp=2,tp=2",
                                   "megatron", {"microbatches": 2})
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "spmdkit plan: ExportError: --export torch: a pipeline whose first stage holds transformer.wte, "
        "transformer.wpe besides the blocks: HF's model, given the hidden states on a later stage, would run all but "
        "the token embedding again; not exported (the file writes GPT-2's stage forward out, not GPTNeoModel's)")
    assert not (tmp_path / "neo.py").exists()
    stages = op_stages(got.plan.program, got.counts)
    with pytest.raises(ExportError, match=r"^--export torch: the tied transformer.wte.weight = lm_head.weight: the tp "
                                          r"plan styles transformer.wte and not lm_head; "):
        tied_copies(got.plan, stages, frozenset({"transformer.wte"}))


# -- on gloo: the exported parallelize against eager ------------------------------------------------


def _ranks() -> Any:
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        import torch_export_ranks
    finally:
        sys.path.pop(0)
    return torch_export_ranks


#: the dp=2 x tp=2 cases run on gloo: (HF class, config, strategy); one spawn of 4 ranks runs
#: them all (torch_export_ranks.rank_cases: one import of torch and transformers a rank, ~30 s of
#: CPU a launch saved per case), checked by one test (so one xdist worker runs the spawn)
GLOO_CASES = {"llama-megatron,sp,fsdp": ("LlamaForCausalLM", LLAMA, "megatron,sp,fsdp"),
              "mixtral-megatron": ("MixtralForCausalLM", MIXTRAL, "megatron"),
              "mixtral-megatron,fsdp": ("MixtralForCausalLM", MIXTRAL, "megatron,fsdp"),
              "gpt2-megatron": ("GPT2LMHeadModel", GPT2, "megatron"),
              "gpt2-megatron,sp": ("GPT2LMHeadModel", GPT2, "megatron,sp"),
              "phi3-megatron": ("Phi3ForCausalLM", PHI3, "megatron"),
              "gemma2-megatron": ("Gemma2ForCausalLM", GEMMA2, "megatron"),
              "gemma2-megatron,sp": ("Gemma2ForCausalLM", GEMMA2, "megatron,sp"),
              "gemma3-megatron,sp": ("Gemma3ForCausalLM", GEMMA2, "megatron,sp"),
              "deepseek_v3-megatron": ("DeepseekV3ForCausalLM", DSV3, "megatron"),
              "qwen2_moe-megatron,sp": ("Qwen2MoeForCausalLM", QWEN2MOE, "megatron,sp"),
              "stablelm-megatron,sp": ("StableLmForCausalLM", STABLELM, "megatron,sp"),
              "opt-megatron": ("OPTForCausalLM", OPT, "megatron"),
              "llama-megatron,sp+recompute-full": ("LlamaForCausalLM", LLAMA, "megatron,sp")}
#: the cases exported with a --recompute (export_torch's recompute): whole blocks in checkpoint_wrapper
GLOO_RECOMPUTE = {"llama-megatron,sp+recompute-full": "full"}


@pytest.fixture()
def gloo_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Any]]:
    """Each case's (rank 0's result, the exported module): every case planned on dp=2 x tp=2 and
    exported to a folder of its own, then run in one spawn of 4 gloo processes."""
    import torch.multiprocessing as mp

    cases, folders = [], {}
    for key, (cls, cfg, strategy) in GLOO_CASES.items():
        folder = tmp_path_factory.mktemp(key.replace(",", "_"))
        plan = _plan(cls, cfg, "dp=2,tp=2", strategy)
        assert plan.mesh.size == 4
        export_torch(plan, str(folder / "plan.py"), recompute=GLOO_RECOMPUTE.get(key, "none"))
        cases.append((str(folder), cls, cfg))
        folders[str(folder)] = key
    q = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_ranks().rank_cases, args=(4, cases, BATCH, SEQ, q), nprocs=4, start_method="spawn")
    got: dict[str, tuple[Any, Any]] = {}
    while not q.empty():
        folder, result = q.get()
        got[folders[folder]] = (result, _load(Path(folder) / "plan.py"))
    assert set(got) == set(GLOO_CASES)
    return got


def _check_gloo(result: tuple[Any, ...], mod: Any) -> None:
    """Loss and gradients equal eager's; the tp collectives in the model's forward and backward are
    PLAN_COLLECTIVES; all those of the step are those, FSDP2's (DP_COLLECTIVES) and the loss's."""
    from spmdkit.outputs.export_torch import FUNCOL

    loss, eager, worst, where, per_phase, total = result
    assert abs(loss - eager) <= 1e-5 * abs(eager), (loss, eager)
    assert worst <= 1e-4, (worst, where)
    funcol = set(FUNCOL.values())
    for phase in ("forward", "backward"):
        assert {k: v for k, v in per_phase[phase].items() if k in funcol} == mod.PLAN_COLLECTIVES[phase], phase
    want: Counter[str] = Counter()
    for table in (mod.PLAN_COLLECTIVES, mod.DP_COLLECTIVES):
        for counts in table.values():
            want.update(counts)
    if mod.LOSS_PARALLEL:  # max, sum of exponentials, the label's logit
        want["all_reduce"] += 3
    assert Counter(total) == want


def test_the_gloo_check_fails_a_wrong_run() -> None:
    """_check_gloo (the combined gloo test's check of each case) passes a run that equals eager with
    the plan's collectives and fails one whose loss, a gradient or a collective count is off, or
    whose loss or gradient is NaN."""
    from types import SimpleNamespace

    from spmdkit.outputs.export_torch import FUNCOL

    ag, ar = FUNCOL["all_gather"], FUNCOL["all_reduce"]
    mod = SimpleNamespace(PLAN_COLLECTIVES={"forward": {ag: 2}, "backward": {ar: 2}},
                          DP_COLLECTIVES={"optimizer": {"reduce_scatter": 1}}, LOSS_PARALLEL=False)
    phases = {"forward": {ag: 2}, "backward": {ar: 2}}
    good = (2.5, 2.5, 1e-6, "w", phases, {ag: 2, ar: 2, "reduce_scatter": 1})
    _check_gloo(good, mod)
    nan = float("nan")
    for wrong in ((2.6, *good[1:]), (nan, *good[1:]), (*good[:2], 1e-3, *good[3:]), (*good[:2], nan, *good[3:]),
                  (*good[:4], {"forward": {ag: 1}, "backward": {ar: 2}}, good[5]),
                  (*good[:5], {ag: 2, ar: 3, "reduce_scatter": 1})):
        with pytest.raises(AssertionError):
            _check_gloo(wrong, mod)


def test_exported_files_on_gloo_equal_eager(gloo_runs: dict[str, tuple[Any, Any]]) -> None:
    """Each case's exported parallelize on 4 gloo ranks: loss and every gradient equal eager's, the
    collectives the plan's. Llama under megatron,sp,fsdp; Mixtral's experts style written into the
    file (gate_up permuted, down Shard(2), the rows all-reduced before the combine) under megatron
    and megatron,fsdp; GPT-2's Conv1D and tied embedding under megatron and megatron,sp; Phi-3's fused
    qkv_proj (sliced at its config's head counts, each attention given its own config with them
    divided by tp: it ran into a matmul shape error before) and gate_up_proj under megatron; Gemma 2's
    soft-capped logits (x / cap, tanh, x cap) kept vocab-sharded into the parallel loss (its head's
    output was made local before, each rank's loss over half the vocabulary), and under megatron,sp its
    norms SequenceParallel through their 1 + weight and its scaled embedding's partial lookup counted as
    the all-reduce torch runs inside the module (_SCALED_DOC); Gemma 3's q / k norms on the transposed
    heads under megatron,sp (SequenceParallel on Shard(1), use_local_output=True). DeepSeek-V3 under megatron and Qwen2-MoE
    under megatron,sp: the shared experts beside the replicated router / shared_expert_gate
    (PrepareModuleInput on DeepSeek's shared experts; Qwen2-MoE's MoE block between
    PrepareModuleInputOutput), DeepSeek's MLA key through GradAllReduceColumns (without it kv_a_proj_with_mqa's
    gradient was each rank's heads' share: 0.9 % off, 2 all-reduces fewer backward). StableLM's and OPT's
    attention view q / k / v with their own num_heads: HEADS_PER_RANK divides them by tp (StableLM failed
    'shape [2, 8, 4, 16] is invalid', OPT's view(bsz, -1, num_heads, head_dim) folded heads into the
    sequence: its loss was not eager's)."""
    assert gloo_runs["stablelm-megatron,sp"][1].HEADS_PER_RANK == ("model.layers.*.self_attn",)
    assert gloo_runs["opt-megatron"][1].HEADS_PER_RANK == ("model.decoder.layers.*.self_attn",)
    failures = []
    for case, (result, mod) in gloo_runs.items():
        try:
            _check_gloo(result, mod)
        except AssertionError as exc:
            failures.append(f"{case}: {exc}")
    assert not failures, "\n".join(failures)


def test_pipeline_on_gloo_equals_eager(tmp_path: Path) -> None:
    """pp=2 x tp=2, 2 microbatches under Schedule1F1B: the last stage's loss and every rank's
    gradients equal eager's; each rank's collectives its stage's (and the loss's 3 per microbatch)."""
    import torch.multiprocessing as mp

    from spmdkit.cli import main

    path = tmp_path / "plan.py"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["plan", "--hf", "LlamaForCausalLM", "--hf-config", json.dumps(LLAMA), "--mesh", "pp=2,tp=2",
                     "--batch", str(BATCH), "--seq", str(SEQ), "--microbatches", "2", "--json", "--export", "torch",
                     str(path)]) == 0
    mod = _load(path)
    rank_main = _ranks().pipeline_rank_main
    q = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(rank_main, args=(4, str(tmp_path), "LlamaForCausalLM", LLAMA, BATCH, SEQ, q), nprocs=4,
                       start_method="spawn")
    got = sorted(q.get() for _ in range(4))
    for r, loss, eager, worst, where, total in got:
        stage = r // 2  # ranks (pp, tp) row-major
        assert worst <= 1e-4, (r, worst, where)
        want = dict(sum((Counter(c) for c in mod.PLAN_COLLECTIVES_BY_STAGE[stage].values()), Counter()))
        if stage == 1:
            assert abs(loss - eager) <= 1e-5 * abs(eager), (loss, eager)
            want["all_reduce"] += 3 * mod.PIPELINE["microbatches"]  # the vocab-parallel loss's own
        assert total == want, r


# -- context parallelism: refused, torch's context_parallel does not run on CPU / gloo ---------------


@pytest.mark.parametrize(("variant", "method"), [("allgather", "allgather"), ("ring", "alltoall")])
def test_cp_plan_refused_naming_what_fails_on_cpu(variant: str, method: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from spmdkit.cli import main

    path = tmp_path / "cp.py"
    assert main(["plan", "--model", "tiny-llama", "--mesh", "dp=2,cp=2", "--strategy", f"dp,cp,cp-attention={variant}",
                 "--export", "torch", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"spmdkit plan: ExportError: --export torch: the plan runs context parallelism over cp ({variant} "
                   f"attention; torch 2.13's context_parallel with set_rotate_method('{method}')): not exported, it "
                   f"cannot run on CPU / gloo (where exports are checked against eager): torch's ring runs in the CUDA "
                   f"SDPA kernels (aten._scaled_dot_product_{{flash,efficient,cudnn}}_attention), and CPU's "
                   f"aten._scaled_dot_product_flash_attention_for_cpu has no DTensor sharding strategy; --export "
                   f"dtensor says how torch runs it on CUDA"]
    assert not path.exists()


@pytest.mark.parametrize(("model", "strategy", "why"), [
    ("tiny-llama", "dp,cp,cp-attention=alltoall", "torch's context_parallel has no head/sequence all-to-all "
                                                  "(DeepSpeed-Ulysses)"),
    ("tiny-gpt2", "dp,cp", "the model's attention is eager (scores by matmul, a causal mask, softmax): torch's "
                           "context_parallel replaces the SDPA kernels only")])
def test_cp_plan_torch_cannot_express_refused(model: str, strategy: str, why: str) -> None:
    from spmdkit.planner.planning import plan_model

    _, plan, _ = plan_model(model, "dp=2,cp=2", strategy)
    with pytest.raises(ExportError) as exc:
        torch_source(plan)
    msg = str(exc.value)
    variant = "alltoall" if "alltoall" in strategy else "eager"
    assert msg.startswith(f"--export torch: the plan runs context parallelism over cp ({variant} attention): not "
                          f"exported: {why}") and msg.endswith("(torch 2.13)") and "\n" not in msg


def test_torch_context_parallel_does_not_run_on_cpu(tmp_path: Path) -> None:
    """What the refusal says, against the installed torch: its ring kernels' SDPA ops have no CPU
    kernel, and a causal SDPA under context_parallel on 2 gloo processes raises, by the default
    backend (CPU's flash op: no DTensor sharding strategy) and by the math backend (a plain mask
    added to DTensor scores). When torch runs it, this fails: export cp plans then."""
    import torch
    import torch.multiprocessing as mp

    from spmdkit.outputs.export_torch import CP_ON_CPU

    x = torch.zeros(1, 1, 2, 2)
    for op in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_cudnn_attention"):
        assert op in CP_ON_CPU.replace("{flash,efficient,cudnn}", op.split("_")[-2])
        args = (x, x, x, 0.0, True) if "flash" in op else (x, x, x, None, True, 0.0, True)
        with pytest.raises(NotImplementedError, match=f"Could not run 'aten::{op}' with arguments from the 'CPU'"):
            getattr(torch.ops.aten, op)(*args)
    q = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_ranks().cp_probe_rank_main, args=(2, str(tmp_path), q), nprocs=2, start_method="spawn")
    got = q.get()
    assert got["default"] == ("NotImplementedError", "Operator aten._scaled_dot_product_flash_attention_for_cpu.default "
                                                     "does not have a sharding strategy registered.")
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in CP_ON_CPU
    assert got["math"][0] == "RuntimeError" and "got mixed torch.Tensor and DTensor" in got["math"][1]
