"""The zoo's model description: :class:`ModelConfig` (a decoder's sizes and architecture
variants, checked one line per bad value) and :class:`Model` (a built training step and the
roles the strategies read). :mod:`spmdkit.models.zoo` builds them; the layers are in
:mod:`spmdkit.models.zoo_layers` and :mod:`spmdkit.models.zoo_moe`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.program.ir import Program

ACTIVATIONS = ("swiglu", "geglu", "gelu", "squared_relu", "relu")
NORMS = ("rms", "layer")
POSITIONS = ("rope", "learned", "alibi", "none")


#: cp_attention's variants and the positions' balance (spmdkit.ops.context: VARIANTS, BALANCES)
CP_ATTENTION = ("allgather", "ring", "alltoall")
CP_BALANCE = ("zigzag", "none")


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of a decoder. ``arch``: llama or gpt2."""

    arch: str = "llama"
    layers: int = 2
    hidden: int = 16
    heads: int = 4
    kv_heads: int | None = None
    ffn: int = 32
    vocab: int = 64
    seq: int = 8
    batch: int = 4
    dtype: str = "float32"
    #: dropout probability (gpt2 only): > 0 adds Megatron GPT's three dropouts per layer, on
    #: the attention probabilities, after the attention output projection and after the MLP,
    #: each keeping a 1-byte mask for the backward (Korthikanti et al. 2022, section 4.1)
    dropout: float = 0.0
    #: the LM head is the token embedding (transposed): one [vocab, hidden] parameter
    tied_embeddings: bool = False
    #: the MLP's activation: swiglu, gelu, squared_relu or relu (None: the arch's, swiglu for
    #: llama, gelu for gpt2)
    activation: str | None = None
    #: the attention kernel: flash or eager (None: the arch's, flash for llama, eager for gpt2)
    attention: str | None = None
    #: a name for a custom config (``--model-config``'s ``name``)
    name: str = ""
    #: the attention head size (None: hidden // heads); q/k/v are heads x head_dim wide, the
    #: output projection [heads x head_dim, hidden] (Gemma: 256 with hidden 3584 / 16 heads);
    #: with MLA (kv_lora_rank > 0) the non-rotary part of each q/k head (qk_nope_head_dim)
    head_dim: int | None = None
    #: the normalisation: rms or layer (None: the arch's, rms for llama, layer for gpt2)
    norm: str | None = None
    #: positions: rope, learned, alibi or none (None: the arch's, rope for llama, learned for gpt2)
    positions: str | None = None
    #: biases on the q, k and v projections (Qwen2)
    qkv_bias: bool = False
    #: biases on every linear layer but the LM head (GPT-3, BLOOM)
    linear_bias: bool = False
    #: a LayerNorm right after the token embedding (BLOOM)
    embed_norm: bool = False
    #: routed experts per MoE layer (0: a dense MLP)
    experts: int = 0
    #: experts each token is routed to
    top_k: int = 2
    #: each expert's hidden size (None: ffn)
    moe_ffn: int | None = None
    #: always-active experts (DeepSeek, Qwen2-MoE), each moe_ffn wide
    shared_experts: int = 0
    #: the first dense_layers layers have the dense MLP of width ffn (DeepSeek-V3: 3)
    dense_layers: int = 0
    #: group-limited routing (DeepSeek-V3's n_group / topk_group): the experts in expert_groups
    #: contiguous groups, a token's top_k chosen among the topk_groups best groups (1, 1: plain top-k)
    expert_groups: int = 1
    topk_groups: int = 1
    #: expert capacity = ceil(tokens x top_k / experts x capacity_factor) (None: dropless,
    #: uniform routing, a factor of 1)
    capacity_factor: float | None = None
    #: MoE: the auxiliary load-balancing loss (Switch / Mixtral, per sequence: :mod:`spmdkit.models.zoo_moe`)
    aux_loss: bool = True
    #: MLA's query compression rank (0: q projected directly, as DeepSeek-V2-Lite)
    q_lora_rank: int = 0
    #: > 0: multi-head latent attention (DeepSeek-V2/V3) with this kv compression rank
    kv_lora_rank: int = 0
    #: MLA's rotary part of each q/k head (k's shared by the heads)
    qk_rope_head_dim: int = 0
    #: MLA's value head size (None: head_dim)
    v_head_dim: int | None = None
    #: context parallelism (docs/context.md): > 1 splits the sequence over this many ranks; the
    #: attention is then ``cp_attention`` at the positions each token holds (inputs
    #: ``cp.positions`` / ``cp.key_positions``, recorded in the program)
    cp: int = 1
    #: how cp_attention computes a split sequence: allgather (Llama 3's), ring or alltoall (Ulysses)
    cp_attention: str = "allgather"
    #: zigzag: rank i of cp holds the sequence's chunks i and 2cp-1-i of 2cp (every rank the same
    #: causal work); none: chunk i
    cp_balance: str = "zigzag"
    #: MoE: > 1 routes each sequence in this many chunks of ``seq / moe_chunks`` tokens, each on
    #: its own (capacity per chunk): Megatron's ETP = 1 token path, where each tp rank dispatches
    #: its own sequence-parallel shard (``--strategy megatron,sp,ep,etp=1`` builds it with tp
    #: chunks; :mod:`spmdkit.models.zoo_moe`, docs/experts.md); under cp each cp rank its own
    #: tokens (cp chunks, cp x tp on that path)
    moe_chunks: int = 1
    #: hybrid linear attention (Qwen3-Next): > 0 makes layer i Gated DeltaNet
    #: (:mod:`spmdkit.models.zoo_linear`) unless ``(i + 1) % full_attention_interval == 0`` (HF's
    #: ``full_attention_interval``; 0: every layer softmax attention)
    full_attention_interval: int = 0
    #: Gated DeltaNet's key heads: q and k (HF's ``linear_num_key_heads``)
    linear_key_heads: int = 0
    #: its value heads, a multiple of the key heads (``linear_num_value_heads``)
    linear_value_heads: int = 0
    #: the q / k head size (``linear_key_head_dim``)
    linear_key_head_dim: int = 0
    #: the v head size (``linear_value_head_dim``)
    linear_value_head_dim: int = 0
    #: the short causal convolution's width (``linear_conv_kernel_dim``)
    linear_conv: int = 4
    #: an output gate on softmax attention: ``attn * sigmoid(x @ w_attn_gate)`` (Qwen3-Next)
    attention_gate: bool = False
    #: the shared experts' output scaled by ``sigmoid(x @ w [hidden, 1])`` (Qwen2-MoE, Qwen3-Next)
    shared_expert_gate: bool = False
    #: multi-token-prediction modules (DeepSeek-V3's depth D, Megatron-Core's ``--mtp-num-layers``,
    #: HF's ``num_nextn_predict_layers`` / ``mtp_num_hidden_layers``): each one more transformer
    #: layer predicting one token further ahead through the shared embedding and head
    #: (:mod:`spmdkit.models.zoo_mtp`; 0: none)
    mtp_layers: int = 0

    @property
    def act(self) -> str:
        return self.activation or ("swiglu" if self.arch == "llama" else "gelu")

    @property
    def attn(self) -> str:
        return self.attention or ("flash" if self.arch == "llama" else "eager")

    @property
    def hdim(self) -> int:
        """The head size in effect (q/k's non-rotary part with MLA)."""
        return self.head_dim or self.hidden // self.heads

    @property
    def nrm(self) -> str:
        """The normalisation in effect: rms or layer."""
        return self.norm or ("rms" if self.arch == "llama" else "layer")

    @property
    def pos(self) -> str:
        """The positions in effect: rope, learned, alibi or none."""
        return self.positions or ("rope" if self.arch == "llama" else "learned")

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def vdim(self) -> int:
        """The value head size (MLA's v_head_dim, else the head size)."""
        return self.v_head_dim or self.hdim

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn or self.ffn

    def is_moe_layer(self, i: int) -> bool:
        """Layer ``i`` has routed experts (past the first dense_layers)."""
        return self.experts > 0 and i >= self.dense_layers

    def is_linear_layer(self, i: int) -> bool:
        """Layer ``i`` is Gated DeltaNet (hybrid linear attention), not softmax attention."""
        n = self.full_attention_interval
        return n > 0 and (i + 1) % n != 0

    @property
    def n_kv(self) -> int:
        return self.kv_heads or self.heads

    def check(self) -> None:
        if self.arch not in ("llama", "gpt2"):
            raise ProgramError(f"model: unknown arch {self.arch!r} (llama or gpt2)")
        for k in ("layers", "hidden", "heads", "ffn", "vocab", "seq", "batch"):
            if int(getattr(self, k)) < 1:
                raise ProgramError(f"model: {k} must be >= 1")
        if self.head_dim is None and self.hidden % self.heads:
            raise ProgramError(f"model: hidden {self.hidden} is not divisible by heads {self.heads} "
                               f"(or give head_dim)")
        if self.heads % self.n_kv:
            raise ProgramError(f"model: heads {self.heads} is not divisible by kv_heads {self.n_kv}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ProgramError(f"model: dropout must be in [0, 1), got {self.dropout}")
        if self.dropout and self.arch != "gpt2":
            raise ProgramError(f"model: dropout is modelled for gpt2 only, not {self.arch}")
        if self.act not in ACTIVATIONS:
            raise ProgramError(f"model: unknown activation {self.act!r} ({', '.join(ACTIVATIONS)})")
        if self.attn not in ("flash", "eager"):
            raise ProgramError(f"model: unknown attention {self.attn!r} (flash or eager)")
        if self.attn == "eager" and self.arch != "gpt2":
            raise ProgramError(f"model: eager attention is modelled for gpt2 only, not {self.arch}")
        if self.arch == "gpt2" and self.n_kv != self.heads and self.attn == "eager":
            raise ProgramError("model: grouped kv heads need attention flash in the gpt2 arch")
        self._check_variants()
        self._check_cp()
        self._check_moe()
        self._check_mla()
        self._check_linear()

    def _check_linear(self) -> None:
        """Gated DeltaNet's sizes (where a layer has it); context parallelism refused with it."""
        names = ("full_attention_interval", "linear_key_heads", "linear_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv")
        for k in names:
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ProgramError(f"model: {k} must be an integer >= 0, got {v!r}")
        v = self.mtp_layers
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ProgramError(f"model: mtp_layers must be an integer >= 0, got {v!r}")
        if self.shared_expert_gate and not self.shared_experts:
            raise ProgramError("model: shared_expert_gate needs shared_experts >= 1")
        if self.attention_gate and (self.mla or self.attn != "flash"):
            raise ProgramError("model: attention_gate is modelled on flash attention without MLA")
        if not self.full_attention_interval:
            return
        if min(getattr(self, k) for k in names[1:]) < 1:
            raise ProgramError(f"model: full_attention_interval {self.full_attention_interval} (Gated DeltaNet "
                               f"layers) needs {', '.join(names[1:])} >= 1")
        if self.linear_value_heads % self.linear_key_heads:
            raise ProgramError(f"model: linear_value_heads {self.linear_value_heads} is not a multiple of "
                               f"linear_key_heads {self.linear_key_heads}")
        if self.cp > 1:
            raise ProgramError(f"gated_delta_rule: --mesh cp={self.cp} (context parallelism) is refused: the "
                               f"recurrence carries its state along the whole sequence (Megatron-Core's "
                               f"GatedDeltaNet has no context parallelism: '# TODO: support CP'); shard the batch "
                               f"(dp) or the heads (tp, sp) instead")

    def _check_variants(self) -> None:
        for k in ("head_dim", "moe_ffn", "v_head_dim"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ProgramError(f"model: {k} must be an integer >= 1 (or null), got {v!r}")
        for k in ("experts", "shared_experts", "dense_layers", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ProgramError(f"model: {k} must be an integer >= 0, got {v!r}")
        if self.nrm not in NORMS:
            raise ProgramError(f"model: unknown norm {self.nrm!r} ({' or '.join(NORMS)})")
        if self.pos not in POSITIONS:
            raise ProgramError(f"model: unknown positions {self.pos!r} ({', '.join(POSITIONS)})")
        if self.pos == "rope" and not self.mla and self.hdim % 2:
            raise ProgramError(f"model: rope needs an even head_dim, got {self.hdim}")

    def _check_cp(self) -> None:
        if not isinstance(self.cp, int) or isinstance(self.cp, bool) or self.cp < 1:
            raise ProgramError(f"model: cp must be an integer >= 1, got {self.cp!r}")
        if self.cp_attention not in CP_ATTENTION:
            raise ProgramError(f"--cp-attention {self.cp_attention!r}: not one of {', '.join(CP_ATTENTION)}")
        if self.cp_balance not in CP_BALANCE:
            raise ProgramError(f"--cp-balance {self.cp_balance!r}: not one of {', '.join(CP_BALANCE)}")
        if self.cp == 1:
            return
        chunks = 2 * self.cp if self.cp_balance == "zigzag" else self.cp
        if self.seq % chunks:
            how = f"2 x cp = {chunks} chunks (the zig-zag balance)" if self.cp_balance == "zigzag" else f"cp = {chunks}"
            raise ProgramError(f"--mesh cp={self.cp}: the sequence of {self.seq} tokens does not split into {how}")
        if self.attn == "eager" and self.pos == "alibi":
            raise ProgramError("--mesh cp: eager attention with alibi positions is not modelled under context "
                               "parallelism (the bias is a [1, heads, s, s] input); give attention flash")
        if self.attn == "eager" and self.cp_attention != "allgather":
            raise ProgramError(f"--cp-attention {self.cp_attention}: the model's attention is eager (the scores "
                               f"materialised): only allgather splits it; give attention flash in --model-config")

    def _check_moe(self) -> None:
        if not self.experts:
            for k in ("shared_experts", "dense_layers"):
                if getattr(self, k):
                    raise ProgramError(f"model: {k} {getattr(self, k)} needs experts >= 1 (a MoE model)")
            if (self.expert_groups, self.topk_groups) != (1, 1):
                raise ProgramError("model: expert_groups / topk_groups need experts >= 1 (a MoE model)")
            if self.moe_ffn is not None or self.capacity_factor is not None:
                k = "moe_ffn" if self.moe_ffn is not None else "capacity_factor"
                raise ProgramError(f"model: {k} needs experts >= 1 (a MoE model)")
            return
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or not 1 <= self.top_k <= self.experts:
            raise ProgramError(f"model: top_k must be from 1 to experts {self.experts}, got {self.top_k!r}")
        if self.dense_layers >= self.layers:
            raise ProgramError(f"model: dense_layers {self.dense_layers} leaves no MoE layer of {self.layers}")
        g, kg = self.expert_groups, self.topk_groups
        for k, v in (("expert_groups", g), ("topk_groups", kg)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ProgramError(f"model: {k} must be an integer >= 1, got {v!r}")
        if self.experts % g or kg > g or kg * (self.experts // g) < self.top_k:
            raise ProgramError(f"model: expert_groups {g} / topk_groups {kg}: the groups must divide the "
                               f"{self.experts} experts, topk_groups <= expert_groups and the kept groups hold at "
                               f"least top_k {self.top_k} experts")
        t = self.moe_chunks
        if not isinstance(t, int) or isinstance(t, bool) or t < 1 or self.seq % t:
            raise ProgramError(f"model: moe_chunks must be an integer >= 1 dividing seq {self.seq}, got {t!r}")
        cf = self.capacity_factor
        if cf is not None and (isinstance(cf, bool) or not isinstance(cf, (int, float)) or not 0 < cf <= 1024):
            raise ProgramError(f"model: capacity_factor must be a number in (0, 1024] (or null), got {cf!r}")
        if self.dropout:
            raise ProgramError("model: dropout is not modelled with experts (a MoE model)")
        if self.linear_bias:
            raise ProgramError("model: linear_bias is not modelled with experts (a MoE model)")

    def _check_mla(self) -> None:
        if not self.mla:
            for k in ("q_lora_rank", "qk_rope_head_dim"):
                if getattr(self, k):
                    raise ProgramError(f"model: {k} {getattr(self, k)} needs kv_lora_rank >= 1 (MLA)")
            if self.v_head_dim is not None:
                raise ProgramError("model: v_head_dim needs kv_lora_rank >= 1 (MLA)")
            return
        if self.attn != "flash":
            raise ProgramError("model: kv_lora_rank (MLA) needs attention flash, not eager")
        if self.qkv_bias:
            raise ProgramError("model: qkv_bias is not modelled with kv_lora_rank (MLA)")
        if self.pos != "rope" or self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2:
            raise ProgramError(f"model: kv_lora_rank (MLA) needs positions rope and an even qk_rope_head_dim >= 2, "
                               f"got {self.pos} and {self.qk_rope_head_dim}")
        if self.kv_heads is not None and self.kv_heads != self.heads:
            raise ProgramError(f"model: kv_heads {self.kv_heads} with kv_lora_rank (MLA): MLA has one kv head per "
                               f"q head")

    def with_(self, **kw: Any) -> ModelConfig:
        return replace(self, **kw)




@dataclass
class Model:
    """A built training step and the roles strategies read."""

    config: ModelConfig
    program: Program
    #: parameter name -> role: embedding, position, column, row, head, norm, column_bias (a
    #: column-parallel projection's bias), bias (a row-parallel one's), router, replicated
    roles: dict[str, str]
    #: residual-stream activations (Megatron sequence parallel shards their sequence axis)
    residual: list[str]
    #: normalised activations that feed the column-parallel projections
    norm_outputs: list[str]
    #: parameter -> (gradient, optimizer states, updated parameter, updated states)
    optimizer: dict[str, tuple[str, tuple[str, ...], str, tuple[str, ...]]]
    #: outputs of the row-parallel projections (their gradients are gathered under sequence parallel)
    row_outputs: list[str] = field(default_factory=list)
    inputs: dict[str, str] = field(default_factory=dict)
    loss: str = "loss"
    vocab_parallel_loss: bool = False
    #: MoE with ``aux_loss``: each MoE layer's per-sequence load-balancing losses [batch, 1]
    aux: list[str] = field(default_factory=list)

    def token_inputs(self) -> list[str]:
        """The inputs laid out as the tokens, [batch, seq, ...]: the tokens, the labels, the learned
        positions, and each multi-token-prediction module's shifted tokens and labels (what data
        and context parallelism split with the batch and the sequence)."""
        keys = ["tokens", "labels", "positions"]
        for k in range(self.config.mtp_layers):
            keys += [f"mtp.{k}.tokens", f"mtp.{k}.labels"]
        return [self.inputs[k] for k in keys if k in self.inputs]



__all__ = ["CP_ATTENTION", "CP_BALANCE", "ACTIVATIONS", "NORMS", "POSITIONS", "Model", "ModelConfig"]
