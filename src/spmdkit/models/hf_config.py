"""A HuggingFace ``config.json`` given to ``--model-config``, mapped to the fields of a zoo
:class:`~spmdkit.models.zoo.ModelConfig` (no transformers, no weights).

:func:`is_hf_config` tells one from a zoo config (``model_type``, ``architectures`` or HF's key
names); :func:`hf_fields` maps it: the sizes, the kv heads, the head size, the activation and
its gating, the norm, the positions, the biases, tied embeddings, the MoE experts (routed,
shared, top-k, dense layers first), the MLA ranks and Qwen3-Next's Gated DeltaNet layers
(``qwen3_next``), per ``model_type``. ``seq`` is the
config's ``max_position_embeddings`` (the longest context it was made for), ``batch`` 1, the
dtype its ``torch_dtype`` (bf16 where it names none).

Every key of the config is accounted for: mapped, known and without effect on the training
step's shapes (token ids, initialisation, rope frequencies, dropout, ...), known and not
modelled (a sliding window, logit soft-capping, a quantization: one warning line naming them,
the model planned otherwise), or unknown to the model type: a ProgramError naming it, so a typo
such as ``num_attention_head`` never plans a different model. A size that is missing (a layer
count, the hidden size, the heads, the vocabulary, the MLP width) is an error too, never HF's
default.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Mapping
from typing import Any

from spmdkit.core.errors import ProgramError

#: keys of every HF ``PretrainedConfig`` (and generation keys old configs carry): they do not
#: change the training step's shapes
_COMMON = frozenset("""
architectures model_type torch_dtype dtype transformers_version _name_or_path name_or_path auto_map bos_token_id
eos_token_id pad_token_id sep_token_id unk_token_id decoder_start_token_id use_cache initializer_range return_dict
output_hidden_states output_attentions torchscript use_bfloat16 tokenizer_class problem_type chunk_size_feed_forward
pruned_heads id2label label2id is_decoder is_encoder_decoder add_cross_attention cross_attention_hidden_size
task_specific_params finetuning_task prefix max_length min_length do_sample early_stopping num_beams num_beam_groups
diversity_penalty temperature top_k top_p typical_p repetition_penalty length_penalty no_repeat_ngram_size
encoder_no_repeat_ngram_size bad_words_ids num_return_sequences output_scores return_dict_in_generate
forced_bos_token_id forced_eos_token_id remove_invalid_values exponential_decay_length_penalty suppress_tokens
begin_suppress_tokens tf_legacy_loss tie_encoder_decoder _attn_implementation attn_implementation
_attn_implementation_autoset quantization_config tie_word_embeddings rope_theta rope_scaling rope_parameters
max_position_embeddings vocab_size hidden_size num_hidden_layers num_attention_heads num_key_value_heads
intermediate_size hidden_act head_dim attention_dropout rms_norm_eps pretraining_tp attention_bias mlp_bias
""".split())

#: per model type: the keys beyond the common ones it knows (mapped or without effect)
_KEYS = {
    "llama": "",
    "mistral": "sliding_window",
    "mixtral": "sliding_window num_local_experts num_experts_per_tok router_aux_loss_coef output_router_logits "
               "router_jitter_noise",
    "qwen2": "use_sliding_window sliding_window max_window_layers layer_types",
    "qwen2_moe": "use_sliding_window sliding_window max_window_layers num_experts num_experts_per_tok "
                 "moe_intermediate_size shared_expert_intermediate_size decoder_sparse_step mlp_only_layers "
                 "norm_topk_prob router_aux_loss_coef output_router_logits qkv_bias layer_types",
    "qwen3": "use_sliding_window sliding_window max_window_layers layer_types",
    "qwen3_moe": "use_sliding_window sliding_window max_window_layers num_experts num_local_experts num_experts_per_tok "
                 "moe_intermediate_size decoder_sparse_step mlp_only_layers norm_topk_prob router_aux_loss_coef "
                 "output_router_logits layer_types",
    "qwen3_next": "use_sliding_window sliding_window full_attention_interval layer_types linear_conv_kernel_dim "
                  "linear_key_head_dim linear_value_head_dim linear_num_key_heads linear_num_value_heads num_experts num_experts_per_tok "
                  "moe_intermediate_size shared_expert_intermediate_size decoder_sparse_step mlp_only_layers "
                  "norm_topk_prob router_aux_loss_coef output_router_logits partial_rotary_factor "
                  "mtp_num_hidden_layers mtp_use_dedicated_embeddings",
    "deepseek_v2": "n_routed_experts n_shared_experts num_experts_per_tok moe_intermediate_size first_k_dense_replace "
                   "moe_layer_freq q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim "
                   "routed_scaling_factor topk_method n_group topk_group scoring_func norm_topk_prob aux_loss_alpha "
                   "seq_aux ep_size num_nextn_predict_layers output_router_logits qk_head_dim",
    "deepseek_v3": "n_routed_experts n_shared_experts num_experts_per_tok moe_intermediate_size first_k_dense_replace "
                   "moe_layer_freq q_lora_rank kv_lora_rank qk_nope_head_dim qk_rope_head_dim v_head_dim "
                   "routed_scaling_factor topk_method n_group topk_group scoring_func norm_topk_prob aux_loss_alpha "
                   "seq_aux ep_size num_nextn_predict_layers rope_interleave output_router_logits qk_head_dim",
    "gemma": "hidden_activation use_bidirectional_attention",
    "gemma2": "hidden_activation sliding_window sliding_window_size attn_logit_softcapping final_logit_softcapping "
              "query_pre_attn_scalar cache_implementation layer_types use_bidirectional_attention",
    "gemma3_text": "hidden_activation sliding_window attn_logit_softcapping final_logit_softcapping "
                   "query_pre_attn_scalar cache_implementation sliding_window_pattern layer_types "
                   "rope_local_base_freq use_bidirectional_attention _sliding_window_pattern",
    "phi3": "sliding_window partial_rotary_factor original_max_position_embeddings resid_pdrop embd_pdrop",
    "nemotron": "norm_eps partial_rotary_factor",
    "gpt2": "n_embd n_layer n_head n_positions n_ctx n_inner activation_function resid_pdrop embd_pdrop attn_pdrop "
            "layer_norm_epsilon scale_attn_weights summary_type summary_use_proj summary_activation "
            "summary_proj_to_labels summary_first_dropout scale_attn_by_inverse_layer_idx reorder_and_upcast_attn",
    "bloom": "n_embed n_layer n_head n_inner layer_norm_epsilon apply_residual_connection_post_layernorm "
             "hidden_dropout slow_but_exact offset_alibi skip_bias_add skip_bias_add_qkv masked_softmax_fusion "
             "bias_dropout_fusion attention_softmax_in_fp32 seq_length",
}
#: keys of the common set a model type does not have (gpt2 and bloom name their sizes their own way)
_NOT_COMMON = {"gpt2": "hidden_size num_hidden_layers num_attention_heads num_key_value_heads intermediate_size "
                       "hidden_act head_dim max_position_embeddings rms_norm_eps",
               "bloom": "num_key_value_heads intermediate_size hidden_act head_dim max_position_embeddings "
                        "rms_norm_eps"}

#: HF's default context per model type (where max_position_embeddings is not given)
_SEQ = {"llama": 2048, "mistral": 131072, "mixtral": 131072, "qwen2": 32768, "qwen2_moe": 32768, "qwen3": 32768,
        "qwen3_moe": 32768, "qwen3_next": 32768, "deepseek_v2": 2048, "deepseek_v3": 4096, "gemma": 8192, "gemma2": 8192,
        "gemma3_text": 131072, "phi3": 4096, "nemotron": 4096, "gpt2": 1024, "bloom": 2048}
#: the activation of each model type (gated, the arch's default swiglu: None)
_GELU_GATED = ("gemma", "gemma2", "gemma3_text")
_TIED = ("gemma", "gemma2", "gemma3_text", "gpt2", "bloom")
_ARCH_OF_CLASS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mixtral",
                  "Qwen2ForCausalLM": "qwen2", "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3ForCausalLM": "qwen3",
                  "Qwen3MoeForCausalLM": "qwen3_moe", "Qwen3NextForCausalLM": "qwen3_next",
                  "DeepseekV2ForCausalLM": "deepseek_v2",
                  "DeepseekV3ForCausalLM": "deepseek_v3", "GemmaForCausalLM": "gemma", "Gemma2ForCausalLM": "gemma2",
                  "Gemma3ForCausalLM": "gemma3_text", "Phi3ForCausalLM": "phi3", "NemotronForCausalLM": "nemotron",
                  "GPT2LMHeadModel": "gpt2", "BloomForCausalLM": "bloom"}
MODEL_TYPES = tuple(_KEYS)
#: HF key names a zoo config never has: one of them marks a config.json of HF's
_HF_MARKS = frozenset({"model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
                       "intermediate_size", "vocab_size", "n_embd", "n_layer", "n_head"})
_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def is_hf_config(obj: Mapping[str, Any]) -> bool:
    """A JSON object that is a HuggingFace config.json (it has one of HF's key names)."""
    return any(k in obj for k in _HF_MARKS)


def _model_type(obj: Mapping[str, Any]) -> str:
    mt = obj.get("model_type")
    if mt is None:
        archs = obj.get("architectures")
        first = archs[0] if isinstance(archs, list) and archs else None
        mt = _ARCH_OF_CLASS.get(first) if isinstance(first, str) else None
        if mt is None:
            raise ProgramError(f"--model-config: a HuggingFace config.json needs model_type ({', '.join(MODEL_TYPES)})")
    if not isinstance(mt, str) or mt not in _KEYS:
        raise ProgramError(f"--model-config model_type: {str(mt)[:40]!r} is not one spmdkit maps "
                           f"({', '.join(MODEL_TYPES)}); --hf imports any HuggingFace class")
    return mt


def _known(mt: str) -> frozenset[str]:
    return (_COMMON - frozenset(_NOT_COMMON.get(mt, "").split())) | frozenset(_KEYS[mt].split())


class _Reader:
    """Reads the keys of one config, each checked, naming it in errors."""

    def __init__(self, obj: Mapping[str, Any], mt: str) -> None:
        self.obj, self.mt = obj, mt

    def size(self, *keys: str, default: int | None = None, low: int = 1) -> int:
        """The first of ``keys`` present: an integer >= ``low``; missing: ``default`` or an error."""
        for k in keys:
            if k in self.obj and self.obj[k] is not None:
                v = self.obj[k]
                if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= 1 << 31:
                    raise ProgramError(f"--model-config: HF key {k!r}: expected an integer from {low} to {1 << 31}, "
                                       f"got {str(v)[:40]!r}")
                return v
        if default is None:
            raise ProgramError(f"--model-config: HF key {keys[0]!r} is missing (a {self.mt} config.json gives it; "
                               f"spmdkit takes no default for a size)")
        return default

    def flag(self, key: str, default: bool) -> bool:
        v = self.obj.get(key, default)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise ProgramError(f"--model-config: HF key {key!r}: expected true or false, got {str(v)[:40]!r}")
        return v

    def text(self, key: str, default: str) -> str:
        v = self.obj.get(key, default)
        if v is None:
            return default
        if not isinstance(v, str):
            raise ProgramError(f"--model-config: HF key {key!r}: expected a string, got {str(v)[:40]!r}")
        return v


def _activation(r: _Reader) -> str | None:
    """The zoo activation (None: the arch's default) of the config's ``hidden_act``."""
    mt = r.mt
    if mt == "gpt2":
        act = r.text("activation_function", "gelu_new")
    elif mt == "bloom":
        return None
    else:
        act = r.text("hidden_activation", "") or r.text("hidden_act", "relu2" if mt == "nemotron" else
                                                        "gelu_pytorch_tanh" if mt in _GELU_GATED else "silu")
    gated = mt not in ("gpt2", "nemotron")
    table = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_new": "geglu", "gelu_pytorch_tanh": "geglu",
             "gelu_fast": "geglu"} if gated else \
        {"gelu": "gelu", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu", "relu": "relu",
         "relu2": "squared_relu"}
    if act not in table:
        raise ProgramError(f"--model-config: HF key 'hidden_act': {act[:40]!r} is not an activation spmdkit models "
                           f"for {mt} ({', '.join(table)})")
    got = table[act]
    default = "swiglu" if mt not in ("gpt2", "bloom") else "gelu"
    return None if got == default else got


def _experts(r: _Reader, notes: list[str]) -> dict[str, Any]:
    """The MoE fields: experts, top_k, moe_ffn, shared_experts, dense_layers."""
    mt, obj = r.mt, r.obj
    if mt == "mixtral":
        return {"experts": r.size("num_local_experts"), "top_k": r.size("num_experts_per_tok")}
    if mt in ("qwen2_moe", "qwen3_moe", "qwen3_next"):
        out: dict[str, Any] = {"experts": r.size("num_experts", "num_local_experts"), "top_k": r.size("num_experts_per_tok"),
                               "moe_ffn": r.size("moe_intermediate_size")}
        if mt in ("qwen2_moe", "qwen3_next"):
            shared = r.size("shared_expert_intermediate_size", default=0, low=0)
            if shared % out["moe_ffn"]:
                raise ProgramError(f"--model-config: HF key 'shared_expert_intermediate_size' {shared} is not a "
                                   f"multiple of moe_intermediate_size {out['moe_ffn']} (spmdkit's shared experts "
                                   f"are each moe_ffn wide)")
            out["shared_experts"] = shared // out["moe_ffn"]
            if shared and mt == "qwen3_next":
                out["shared_expert_gate"] = True
            elif shared:
                notes.append("the shared expert's sigmoid gate")
        dense = obj.get("mlp_only_layers") or []
        if not isinstance(dense, list) or dense != list(range(len(dense))):
            raise ProgramError(f"--model-config: HF key 'mlp_only_layers' {str(dense)[:40]}: spmdkit models dense "
                               f"layers first only (a list 0, 1, ..., k-1)")
        out["dense_layers"] = len(dense)
        if r.size("decoder_sparse_step", default=1) != 1:
            notes.append(f"decoder_sparse_step {obj['decoder_sparse_step']} (planned with experts in every layer)")
        return out
    out = {"experts": r.size("n_routed_experts"), "top_k": r.size("num_experts_per_tok"),
           "moe_ffn": r.size("moe_intermediate_size"), "shared_experts": r.size("n_shared_experts", default=0, low=0),
           "dense_layers": r.size("first_k_dense_replace", default=0, low=0)}
    if mt == "deepseek_v3" and obj.get("topk_method", "noaux_tc") == "noaux_tc":  # group-limited (node-limited) routing
        out["expert_groups"] = r.size("n_group", default=1)
        out["topk_groups"] = r.size("topk_group", default=out["expert_groups"])
    if r.size("moe_layer_freq", default=1) != 1:
        notes.append(f"moe_layer_freq {obj['moe_layer_freq']} (planned with experts in every layer past the dense)")
    return out


def _mla(r: _Reader) -> dict[str, Any]:
    """DeepSeek's multi-head latent attention: head_dim is the non-rotary part of q/k."""
    return {"q_lora_rank": r.size("q_lora_rank", default=0, low=0), "kv_lora_rank": r.size("kv_lora_rank"),
            "head_dim": r.size("qk_nope_head_dim"), "qk_rope_head_dim": r.size("qk_rope_head_dim"),
            "v_head_dim": r.size("v_head_dim"), "kv_heads": None}


def _hybrid(r: _Reader, layers: int, notes: list[str]) -> dict[str, Any]:
    """Qwen3-Next's Gated DeltaNet layers (every layer but each ``full_attention_interval``-th),
    the gated attention of the others, its MTP layers (``mtp_num_hidden_layers``); its partial
    rotary embedding noted."""
    n = r.size("full_attention_interval", default=4)
    lt = r.obj.get("layer_types")
    want = ["linear_attention" if (i + 1) % n else "full_attention" for i in range(layers)]
    if lt is not None and lt != want:
        raise ProgramError(f"--model-config: HF key 'layer_types': spmdkit models Gated DeltaNet layers with full "
                           f"attention every full_attention_interval-th layer ({n}: {want[:n]} repeated)")
    prf = r.obj.get("partial_rotary_factor", 0.25)
    if prf != 1:
        notes.append(f"partial_rotary_factor {str(prf)[:20]} (rope on the whole head)")
    if r.flag("mtp_use_dedicated_embeddings", False):
        notes.append("mtp_use_dedicated_embeddings (the MTP layer planned with the shared embedding)")
    return {"mtp_layers": r.size("mtp_num_hidden_layers", default=0, low=0),"full_attention_interval": n, "linear_key_heads": r.size("linear_num_key_heads", default=16),
            "linear_value_heads": r.size("linear_num_value_heads", default=32),
            "linear_key_head_dim": r.size("linear_key_head_dim", default=128),
            "linear_value_head_dim": r.size("linear_value_head_dim", default=128),
            "linear_conv": r.size("linear_conv_kernel_dim", default=4), "attention_gate": True}


def _not_modelled(r: _Reader, seq: int) -> list[str]:
    """The keys that change the architecture and that spmdkit does not model, as they are set."""
    obj, notes = r.obj, []
    sw = obj.get("sliding_window")
    if sw is not None and obj.get("use_sliding_window", True) and not (isinstance(sw, int) and sw >= seq):
        notes.append(f"sliding_window {str(sw)[:20]} (planned as full causal attention)")
    for k in ("attn_logit_softcapping", "final_logit_softcapping"):
        if obj.get(k) is not None:
            notes.append(f"{k} {str(obj[k])[:20]}")
    if obj.get("quantization_config") is not None:
        notes.append("quantization_config (the weights planned unquantized)")
    if obj.get("mlp_bias"):
        notes.append("mlp_bias (the MLP's biases)")
    if obj.get("attention_bias") and r.mt not in ("qwen2", "qwen2_moe"):
        notes.append("attention_bias on o_proj (the q/k/v biases are modelled)")
    if obj.get("use_bidirectional_attention"):
        notes.append("use_bidirectional_attention (planned causal)")
    if obj.get("apply_residual_connection_post_layernorm"):
        notes.append("apply_residual_connection_post_layernorm")
    return notes


def hf_fields(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`~spmdkit.models.zoo.ModelConfig` fields of the HuggingFace config ``obj``
    (a config.json's object); a UserWarning (``--model-config: ...``) names the keys that change
    the architecture and are not modelled; ProgramError naming an unknown or bad key."""
    notes: list[str] = []
    if obj.get("model_type") == "gemma3" and isinstance(obj.get("text_config"), dict):
        obj = {"model_type": "gemma3_text", **obj["text_config"],
               **{k: obj[k] for k in ("architectures", "torch_dtype") if k in obj}}
        notes.append("the vision tower of gemma3 (its text_config is planned)")
    mt = _model_type(obj)
    known = _known(mt)
    unknown = [k for k in obj if k not in known]
    if unknown:
        k = str(unknown[0])
        close = difflib.get_close_matches(k, sorted(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ProgramError(f"--model-config: HF key {k[:60]!r} is not a key of a {mt} config{hint}")
    r = _Reader(obj, mt)
    gpt = mt in ("gpt2", "bloom")
    layers = r.size("n_layer", "num_hidden_layers") if gpt else r.size("num_hidden_layers")
    hidden = r.size("n_embd") if mt == "gpt2" else r.size("hidden_size", "n_embed")
    heads = r.size("n_head", "num_attention_heads") if gpt else r.size("num_attention_heads")
    seq = r.size("n_positions", default=_SEQ[mt]) if mt == "gpt2" else \
        r.size("seq_length", default=_SEQ[mt]) if mt == "bloom" else r.size("max_position_embeddings", default=_SEQ[mt])
    ffn = r.size("n_inner", default=4 * hidden) if gpt else r.size("intermediate_size")
    dtype = r.text("torch_dtype", "") or r.text("dtype", "bfloat16")
    f: dict[str, Any] = {"arch": "gpt2" if gpt else "llama", "name": _name(obj, mt), "layers": layers, "hidden": hidden,
                         "heads": heads, "ffn": ffn, "vocab": r.size("vocab_size"), "seq": seq, "batch": 1,
                         "dtype": _DTYPES.get(dtype, "bfloat16"),
                         "tied_embeddings": r.flag("tie_word_embeddings", mt in _TIED),
                         "activation": _activation(r)}
    if gpt:
        f.update(linear_bias=True, attention="flash")
        if mt == "bloom":
            f.update(positions="alibi", embed_norm=True)
    else:
        f["kv_heads"] = r.size("num_key_value_heads", default=heads)
        hd = r.size("head_dim", default=0, low=0)
        if hd and (hidden % heads or hd != hidden // heads):
            f["head_dim"] = hd
        f["qkv_bias"] = mt in ("qwen2", "qwen2_moe") or r.flag("attention_bias", False)
        if mt == "nemotron":
            f["norm"] = "layer"
    if mt in ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next", "deepseek_v2", "deepseek_v3"):
        f.update(_experts(r, notes))
    if mt == "qwen3_next":
        f.update(_hybrid(r, layers, notes))
    if mt.startswith("deepseek"):
        f.update(_mla(r))
        f["mtp_layers"] = r.size("num_nextn_predict_layers", default=0, low=0)  # DeepSeek-V3's MTP depth D
    notes.extend(_not_modelled(r, seq))
    if notes:
        warnings.warn(f"--model-config: {f['name']}: not modelled: {'; '.join(notes)}", UserWarning, stacklevel=2)
    return f


def _name(obj: Mapping[str, Any], mt: str) -> str:
    archs = obj.get("architectures")
    first = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    return f"{(first or mt)[:60]} (HF config)"


__all__ = ["MODEL_TYPES", "hf_fields", "is_hf_config"]
