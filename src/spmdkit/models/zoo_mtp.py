"""The zoo's multi-token-prediction (MTP) modules, as DeepSeek-V3 trained them (technical report,
arXiv 2412.19437, section 2.2: depth D = 1) and as Megatron-Core builds them
(NVIDIA/Megatron-LM at d98e8a6, ``megatron/core/transformer/multi_token_prediction.py``, ``MultiTokenPredictionLayer``;
Qwen3-Next's ``mtp_num_hidden_layers 1`` is ``--mtp-num-layers 1`` there).

Module ``k`` (0 .. ``mtp_layers - 1``) predicts the token ``k + 2`` ahead of each position from
``h``: for module 0 the main model's hidden state as Megatron-Core hands it to the MTP block
(``GPTModel._postprocess``: the decoder's output, its final layernorm applied), for module
``k > 0`` module ``k - 1``'s output:

- the tokens shifted ``k + 1`` places (input ``mtp.<k>.tokens`` [B, S]: Megatron-Core's
  ``roll_tensor(input_ids, shifts=-1)`` per depth, done on the host's batch here) looked up in
  the model's token embedding ``embed`` (SHARED: the same parameter the first layer reads);
- ``enorm`` of that embedding and ``hnorm`` of ``h`` (norms of the model's kind, RMSNorm for
  DeepSeek-V3 and Qwen3-Next: ``mtp.<k>.enorm`` / ``mtp.<k>.hnorm``), concatenated as ``[embedding; h]`` on the last axis ([B, S, 2H],
  ``_concat_embeddings``' ``torch.cat((decoder_input, hidden_states), -1)``);
- ``eh_proj`` ``[2H, H]`` (``mtp.<k>.eh_proj``, no bias): Megatron-Core's ColumnParallelLinear
  with ``gather_output=False`` followed by a gather over tp (and a scatter to the
  sequence-parallel region under sp): role ``column`` here, the propagation adds that gather;
- one transformer layer of the model's kind (:func:`spmdkit.models.zoo.decoder_layer` with
  ``mtp=k``: parameters ``mtp.<k>.*``): softmax attention (Megatron-Core's GPT path builds it
  from the transformer layer spec; Qwen3-Next's HF checkpoint's ``mtp.layers.0`` is a full
  attention layer, gated as its other full-attention layers), MoE where the model's last layer is
  (Megatron's ``num_floating_point_operations``: ``last_layer_is_moe``; DeepSeek-V3's layer 61 in
  HF's checkpoint is MoE), with its own router and load-balancing loss;
- its ``final_layernorm`` (``mtp.<k>.final_norm``), the model's output head (SHARED: ``lm_head``,
  or the tied embedding) and the cross entropy against ``mtp.<k>.labels`` (the labels shifted
  ``k + 1`` further).

The token losses of the modules are concatenated beside the model's ([B, S, 1 + mtp_layers],
``loss.token.all``): their sum is the step's loss, partial over the data-parallel dims as the
token losses' alone. The weight lambda (DeepSeek-V3: 0.3 then 0.1; Megatron-Core's
``mtp_loss_scaling_factor / mtp_num_layers``, applied through ``MTPLossAutoScaler``) is a
constant factor, left out as the mean's is.

The ops from ``enorm`` to the final norm are labelled ``mtp[k]`` (a label that does not end in a
number: not a pipeline layer), the lookup, the head and the loss ``head``. ``--recompute full``
runs each ``mtp[k]`` group again in the backward (:func:`spmdkit.cost.memory_saved.recompute_regions`
groups the labels with a number), as Megatron-Core's ``MultiTokenPredictionLayer.forward``
checkpoints ``_proj_and_transformer_layer`` under ``recompute_granularity == 'full'``. Every op
follows the model's head, so the pipeline puts the modules on the last stage
(:func:`spmdkit.planner.pipeline_split.op_units`), where Megatron-Core places the MTP block
(``mtp_on_this_rank``: the last stage without a ``--pipeline-model-parallel-layout``; that stage
builds the embedding too: ``if self.pre_process or self.mtp_process``). The embedding is then
read on the first and the last stage, so each holds a copy whose gradients are all-reduced
between them, as for tied embeddings (:func:`spmdkit.planner.stage_costs.shared_parameters`,
Megatron's embedding group).

HF's ``DeepseekV3ForCausalLM`` and ``Qwen3NextForCausalLM`` do not build the MTP layers (their
weights are dropped on load), so a ``--hf`` program has none; the zoo and catalog models build
them from ``mtp_layers``.
"""

from __future__ import annotations

from collections.abc import Callable

from spmdkit.models.zoo_config import Model, ModelConfig
from spmdkit.models.zoo_layers import norm, norm_params
from spmdkit.program.autodiff import Tape

#: decoder_layer(t, cfg, i, h, m, mtp=k) and head_loss(t, cfg, m, x, head, labels, prefix) of spmdkit.models.zoo
LayerFn = Callable[..., str]


def mtp_module(t: Tape, cfg: ModelConfig, m: Model, k: int, h: str, emb: str, head: str, layer: LayerFn,
               head_loss: LayerFn) -> tuple[str, str]:
    """Module ``k`` on the hidden state ``h`` (normalised): (its hidden state, its token losses [B, S, 1])."""
    b = t.b
    B, S, H, dt = cfg.batch, cfg.seq, cfg.hidden, cfg.dtype
    p = f"mtp.{k}."
    b.layer = "head"  # the lookup, the head and the loss: beside the model's head (module docstring)
    tokens = b.tensor(p + "tokens", [B, S], "int64", "input")
    labels = b.tensor(p + "labels", [B, S, 1], "int64", "input")
    m.inputs.update({p + "tokens": tokens, p + "labels": labels})
    (e,) = t.op("embedding", {"x": tokens, "weight": emb}, [(p + "embed.out", [B, S, H], dt)])
    assert e is not None
    m.residual.append(e)
    b.layer = f"mtp[{k}]"  # what Megatron-Core recomputes under full recomputation (module docstring)
    en = norm(t, cfg, m, e, p + "enorm", *norm_params(t, cfg, m, p + "enorm", H))
    hn = norm(t, cfg, m, h, p + "hnorm", *norm_params(t, cfg, m, p + "hnorm", H))
    (cat,) = t.op("concat", {"x": (en, hn)}, [(p + "eh", [B, S, 2 * H], dt)], axis=2)
    w = t.param(p + "eh_proj", [2 * H, H], dt)
    m.roles[w] = "column"
    (x,) = t.op("matmul", {"x": cat, "y": w}, [(p + "eh_proj.out", [B, S, H], dt)])
    assert x is not None
    m.residual.append(x)
    out = layer(t, cfg, cfg.layers, x, m, mtp=k)
    nf = norm(t, cfg, m, out, p + "final_norm", *norm_params(t, cfg, m, p + "final_norm", H))
    b.layer = "head"
    return nf, head_loss(t, cfg, m, nf, head, labels, p)


def mtp_modules(t: Tape, cfg: ModelConfig, m: Model, h: str, emb: str, head: str, loss_tok: str,
                layer: LayerFn, head_loss: LayerFn) -> str:
    """The ``cfg.mtp_layers`` modules after the model's final norm ``h``: the model's token losses
    ``loss_tok`` [B, S, 1] and theirs, side by side ([B, S, 1 + mtp_layers])."""
    losses = [loss_tok]
    for k in range(cfg.mtp_layers):
        h, lk = mtp_module(t, cfg, m, k, h, emb, head, layer, head_loss)
        losses.append(lk)
    (out,) = t.op("concat", {"x": tuple(losses)}, [("loss.token.all", [cfg.batch, cfg.seq, len(losses)], "float32")],
                  axis=2)
    assert out is not None
    return out


__all__ = ["mtp_module", "mtp_modules"]
