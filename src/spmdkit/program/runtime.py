"""How a plan's step runs beyond its shardings: the precision of the GEMMs, the framework whose
memory and overlap conventions apply, and whether tensor-parallel communication overlaps the
GEMMs. A plan carries one (:attr:`spmdkit.program.plan.Plan.runtime`); the CLI sets it from
``--precision``, ``--framework``, ``--tp-comm-overlap`` and ``--ep-comm-overlap``. Standard library only.

- ``precision``: ``fp32``, ``bf16``, ``fp16`` or ``fp8``. ``fp8`` is Transformer Engine's (and
  torchao's float8 linears'): the GEMMs of the linear layers run on the fp8 tensor cores, their
  weights kept in bf16 plus fp8 copies, the rest of the model in bf16. None: the program's own
  parameter dtype.
- ``framework``: ``megatron`` (Megatron-LM / NeMo: DDP or the distributed optimizer, fp32 main
  gradients and master weights), ``torchtitan`` (FSDP2: fp32 sharded parameters and
  gradients, bf16 compute copies gathered per layer) or ``automodel`` (NeMo AutoModel's
  benchmark recipes: FSDP2 over bf16 parameters, ``torch.optim.Adam`` whose moments take the
  parameters' bf16, gradients reduced in fp32 and kept in bf16, the loss without an fp32
  upcast, Transformer Engine's attention). :data:`FSDP2` names the FSDP2 ones.
- ``tp_comm_overlap``: the tensor-parallel all-gathers and reduce-scatters run under the GEMMs
  that consume or produce them (Megatron's ``--tp-comm-overlap``, torch's async TP).
- ``ep_comm_overlap``: Megatron-Core's ``--overlap-moe-expert-parallel-comm`` (with
  ``--delay-wgrad-compute``): in the interleaved pipeline's steady state, or without a pipeline
  between gradient-accumulation microbatches, a forward and another microbatch's backward run as
  one merged step, each one's expert-parallel all-to-alls under the other's computation, node by
  node as Megatron-Core's schedule plan runs them (:mod:`spmdkit.planner.schedules`,
  :mod:`spmdkit.planner.chunk_plan`, :mod:`spmdkit.planner.ep_overlap`, docs/experts.md).
- ``grad_dtype``: ``fp32`` or ``bf16``, the dtype the framework accumulates and reduces the
  gradients in (Megatron-LM's ``--accumulate-allreduce-grads-in-fp32``, Megatron-Core's
  ``grad_reduce_in_fp32``, NeMo's ``optim.grad_sync_dtype``); None: the framework's default
  (fp32 main gradients under megatron and torchtitan; automodel's bf16).
- ``optimizer_dtype``: ``fp32`` or ``bf16``, the dtype of Adam's moments (NeMo's ``optim.dtype``,
  Apex's ``DistributedFusedAdam(dtype=...)``): bf16 keeps two bf16 moments and no fp32 master
  copy (the bf16 parameter is the master); None: the framework's default.
- ``ce_fusion``: Megatron's ``--cross-entropy-loss-fusion`` (NeMo's ``cross_entropy_loss_fusion``):
  the vocab-parallel cross-entropy's passes over the fp32 logits compiled together, fewer of
  them (:mod:`spmdkit.cost.loss`); off by default, as in Megatron-LM. Under ``--framework megatron``
  only (refused elsewhere: the other frameworks have no such option).
- ``ce_kernel``: the loss is flash-attn's fused ``CrossEntropyLoss`` (``--cross-entropy-kernel``),
  as model code calls it (llm-foundry's MPT, ``loss_fn: fused_crossentropy``, its default):
  ``flash-attn-xentropy`` (flash-attn up to v2.2.2: the CUDA ``xentropy_cuda_lib``) or
  ``flash-attn-triton`` (from v2.2.3: the Triton kernel). One kernel over the 16-bit logits
  each way, no fp32 copy; the logits saved for the backward (:mod:`spmdkit.cost.loss`). Under
  ``--framework torchtitan`` only (FSDP with eager model code, how llm-foundry's Composer runs
  are planned); Megatron and AutoModel run their own losses and are refused. ``compiled``:
  torchtitan's own loss compiled by Inductor (``torch.compile(cross_entropy_loss)`` under
  ``training.compile``, torchtitan from bbb1b616e, 2025-04): the bf16 logits saved, no fp32 copy,
  one kernel each way; with ``--compile`` only. None: the framework's loss.
- ``fsdp_float8_all_gather``: torchao's float8 all-gather under FSDP2
  (``--fsdp-float8-all-gather``; torchtitan's ``--float8.enable_fsdp_float8_all_gather`` with
  ``--float8.precompute_float8_dynamic_scale_for_fsdp``): each fp8 linear's sharded weight is cast to
  float8 before FSDP2 gathers it (1 byte an element gathered and held unsharded, no cast of the
  gathered weight in the GEMM), its scale precomputed after each optimizer step
  (:func:`spmdkit.cost.compute.fp8_gathered`). With ``--precision fp8`` and ``--framework
  torchtitan`` only, on a plan that stores its parameters sharded (ZeRO-3).
- ``float8_recipe``: torchao's float8 recipe (``--float8-recipe``; torchtitan's
  ``--float8.recipe_name``, torchao ``Float8LinearRecipeName`` at 890e0ac8 / 6243040 / 0afa4c1):
  ``tensorwise`` (the default: dynamic per-tensor scales, cuBLAS's tensorwise ``_scaled_mm``,
  torchao's float8 TP) or ``rowwise`` (a scale per row of each operand, e4m3 for the gradients too,
  power-of-2 scales; plain TP, its all-gathers in bf16: :mod:`spmdkit.cost.torchao_casts`).
  ``rowwise_with_gw_hp`` is torchao's third name, refused: its weight-gradient GEMM runs in bf16
  beside float8 ones, which the op's one precision cannot say. With ``--precision fp8 --framework
  torchtitan`` only; rowwise refuses ``--fsdp-float8-all-gather`` as torchtitan does. None: not
  given (tensorwise there).
- ``p2p_overlap``: the interleaved pipeline's sends overlap the next unit's compute (Megatron's
  ``overlap_p2p_comm``, on by default since 2023); off (``--no-p2p-overlap``): every send blocks
  its sender, as Megatron-LM's ``batch_isend_irecv`` + ``torch.cuda.synchronize()`` of 2021-2022.
- ``pp_scatter_gather``: under ``--framework megatron``, a pipeline exchange of a tensor every tp
  rank holds whole (no sequence parallelism) sends 1/t of it a tp rank and all-gathers it over tp
  after the receive, forward and backward (Megatron-LM 2021-2022's default,
  ``--no-scatter-gather-tensors-in-pipeline`` off; megatron/p2p_communication at de7dc40f88);
  off by default: Megatron-Core's p2p_communication (core_r0.8.0 and after) sends whole tensors.
- ``grad_overlap``: the data-parallel gradient reductions run in buckets under the backward that
  makes them (Megatron-Core's ``--overlap-grad-reduce``, torch DDP, FSDP2); off
  (``--no-grad-overlap``): every gradient in one buffer per dtype, reduced after the last backward
  (Megatron-LM 2021-2022's local DDP: ``train_step`` calls ``allreduce_gradients()`` once
  ``forward_backward_func`` returns; megatron/training at de7dc40f88 and 35a3fa8b7c).
- ``tp_allreduce_overlap``: under ``--framework megatron``, the backward's tensor-parallel
  all-reduce of a column-parallel linear's input gradient runs beside the GEMMs of its weight
  gradient (Megatron-LM's ``async_tensor_model_parallel_allreduce``, on by default since
  16c90445e7, 2021-09; Megatron-Core's ``allreduce_dgrad``); off (``--no-async-tp-allreduce``):
  it blocks after them, as Megatron-LM of August 2021 (de7dc40f88) ran it.
- ``wgrad_fusion``: under ``--framework megatron``, the weight-gradient GEMM accumulates into the
  fp32 ``main_grad`` (``--gradient-accumulation-fusion``, from 83b1e42f30, 2022-02); off
  (``--no-wgrad-fusion``): it writes the gradient and autograd adds it into ``param.grad``, a
  memory-bound kernel a microbatch (Megatron-LM of 2021: :func:`spmdkit.cost.compute.fused_wgrad`).
- ``lower_bound``: the plan stands in for every ZeRO level of its strategy in a search's step
  floor (:mod:`spmdkit.planner.search_floor` plans the strategy without ZeRO on one data-parallel
  rank): what only some levels pay is left out, so the floor stays under each (the weight
  gradient's accumulation into ``main_grad`` or ``param.grad``, which Megatron-FSDP's ZeRO-2/3 do
  not run). Not a user option; not in the plan's JSON.
- ``moe_skew`` / ``moe_histogram``: how unevenly a mixture-of-experts router spreads the tokens
  (``--moe-skew F``: the busiest expert receives F x the mean, the others share the rest evenly;
  ``--moe-skew NAME``: a published figure of :data:`SKEW_FIGURES`; ``--moe-histogram``: tokens
  per expert as measured); uniform (1.0, None) by default. :mod:`spmdkit.cost.moe` turns them
  into the load of the busiest expert-parallel rank.
- ``moe_dispatcher``: how the tokens reach the experts of other ranks (``--moe-dispatcher``):
  ``alltoall`` (NCCL's all-to-all: Megatron-Core's ``alltoall`` dispatcher, torch's
  ``all_to_all_single``; a token goes to each rank holding one of its experts, across nodes too)
  or ``deepep`` (DeepSeek's DeepEP normal kernels: Megatron-Core's ``flex`` dispatcher, NeMo
  AutoModel's ``TE + DeepEP``; a token crosses the network once per destination node and is
  forwarded to that node's ranks over NVLink). :mod:`spmdkit.cost.moe` times each.
- ``moe_routing``: which experts a token's router picks, as the cost model spreads them over
  the ranks (``--moe-routing``): ``topk`` (the model's router, group-limited where its config
  says: each token's experts drawn uniformly) or ``balanced`` (NeMo AutoModel's
  ``fake_balanced_gate``, its benchmark configs' setting: token t goes to experts ``t k .. t k +
  k - 1`` mod E, consecutive, every expert the same tokens).
- ``compile``: torchtitan's ``training.compile`` (``--compile`` / ``--no-compile``): each
  transformer block compiled by Inductor (its norms, rotary embedding and SwiGLU fused, as the
  program's ops are costed) or run eagerly (each PyTorch op its own kernels: the unfused
  traffic of :mod:`spmdkit.cost.eager`). None: the framework's default (torchtitan: eager,
  its ``compile = false``). Megatron and AutoModel run fused kernels: only torchtitan takes it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.io.jsonfile import read_json

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
#: the dtypes of ``--grad-dtype`` and ``--optimizer-dtype``
STATE_DTYPES = ("fp32", "bf16")
FRAMEWORKS = ("megatron", "torchtitan", "automodel")
#: ``--moe-dispatcher`` values (module docstring)
DISPATCHERS = ("alltoall", "deepep")
#: ``--moe-routing`` values (module docstring)
ROUTINGS = ("topk", "balanced")
#: ``--cross-entropy-kernel``: flash-attn's fused cross-entropy kernels (:mod:`spmdkit.cost.loss`)
CE_KERNELS = ("flash-attn-xentropy", "flash-attn-triton", "compiled")
#: ``--float8-recipe``: torchao's ``Float8LinearRecipeName`` values (``torchao/float8/config.py`` at
#: 890e0ac8, 6243040 and 0afa4c1: the same three), which torchtitan's ``--float8.recipe_name`` takes
#: (``torchtitan/config_manager.py`` at 820504e: ``Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]``)
FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: ``--moe-skew NAME``: published per-expert load imbalances, the busiest expert's tokens over the
#: mean (``1 + MaxVio``, ``1 + (max - mean) / mean``), and where each is from (docs/experts.md,
#: "Routing skew: the published figures")
SKEW_FIGURES: dict[str, tuple[float, str]] = {
    "aux-loss": (1.52, "Wang et al. 2024, 'Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts' "
                       "(arXiv 2408.15664), Table 2: MaxVio_global 0.52 of the auxiliary-loss-controlled 3B MoE "
                       "(64 routed experts, top-6, alpha 0.001), over the validation set"),
    "r1-decode": (11.948, "NVIDIA/TensorRT-LLM docs/source/blogs/tech_blog/blog4_Scaling_Expert_Parallelism_in_"
                          "TensorRT-LLM.md, Table 1 'No EPLB': DeepSeek-R1 serving a machine-translation dataset on "
                          "EP 32, the hottest expert 10.948 x more routed tokens than the mean (per layer and "
                          "iteration, averaged)"),
}
#: the frameworks that shard with FSDP2 (their overlaps and pipelines alike)
FSDP2 = frozenset({"torchtitan", "automodel"})


def reduces_each_microstep(framework: str, zero: int, pipeline: bool) -> bool:
    """Whether ``framework`` reduces a parameter gradient in every micro-step's backward under
    gradient accumulation (``--grad-accum``, or a pipeline's microbatches), holding it at its
    shard between micro-steps, rather than accumulating it unreduced and reducing it once, in
    the last micro-step's backward. ``zero``: the ZeRO level (2 and 3 hold the gradient
    reduce-scattered); ``pipeline``: the step runs on a pipeline schedule (``pp`` > 1).
    docs/devices.md ("Memory", "Gradient accumulation under ZeRO") has the sources:

    - ZeRO-0/1 (DDP, Megatron-Core's DDP and distributed optimizer, FSDP2's replicate): once,
      in the last micro-step (``no_sync``; Megatron's ``ParamAndGradBucketGroup.is_last_microbatch``),
      the gradient accumulated whole.
    - ``megatron`` ZeRO-2/3 (Megatron-FSDP ``optim_grads`` / ``optim_grads_params``): every
      backward, pipeline or not (``_post_backward``: ``grad_reduce_every_bprop``; its ``no_sync``
      "For grads shard mode there will actually always be gradient sync happening").
    - ``torchtitan`` ZeRO-2/3 (FSDP2's ``fully_shard``): every backward without a pipeline
      (``Trainer.train_step`` calls ``forward_backward_step`` per micro-batch and never
      ``set_requires_gradient_sync(False)``); once under a pipeline
      (``torch.distributed.pipelining``'s ``backward_maybe_with_nosync`` turns the sync off
      until the last backward).
    - ``automodel`` (FSDP2): once (``get_sync_ctx``: ``set_requires_gradient_sync(is_optim_step)``;
      under a pipeline, torch's pipelining as above)."""
    if zero < 2:
        return False
    if framework == "megatron":
        return True
    return framework == "torchtitan" and not pipeline

#: the flash-attention kernels the cost model has rates for (:mod:`spmdkit.cost.rates`): ``fa2``
#: (FlashAttention-2, torch's scaled_dot_product_attention), ``flash-attn`` (FlashAttention-2 as
#: Dao's own ``flash-attn`` package builds it: what Transformer Engine's FlashAttention backend calls),
#: ``cudnn`` (Transformer Engine's fused attention), ``triton`` (flash-attention's pre-MLIR Triton
#: kernel, ``flash_attn_triton.py``, as MPT's ``attn_impl: triton`` runs it)
ATTENTION_KERNELS = ("fa2", "flash-attn", "cudnn", "triton")

#: a program dtype -> the precision it computes in
_OF_DTYPE = {"float32": "fp32", "float64": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class Runtime:
    """See the module docstring."""

    precision: str | None = None
    framework: str = "megatron"
    tp_comm_overlap: bool = False
    moe_skew: float = 1.0
    moe_histogram: tuple[float, ...] | None = None
    grad_dtype: str | None = None
    optimizer_dtype: str | None = None
    compile: bool | None = None
    moe_dispatcher: str = "alltoall"
    moe_routing: str = "topk"
    ce_fusion: bool = False
    ce_kernel: str | None = None
    fsdp_float8_all_gather: bool = False
    float8_recipe: str | None = None
    p2p_overlap: bool = True
    pp_scatter_gather: bool = False
    ep_comm_overlap: bool = False
    grad_overlap: bool = True
    tp_allreduce_overlap: bool = True
    wgrad_fusion: bool = True
    lower_bound: bool = False
    #: the flash-attention kernel the run's model code calls (``--attention-kernel``, one of
    #: :data:`spmdkit.cost.rates.ATTENTION_KERNELS`); None: the framework's (the device's
    #: ``attention_kernel`` map)
    attention_kernel: str | None = None

    def __post_init__(self) -> None:
        if self.moe_dispatcher not in DISPATCHERS:
            raise ProgramError(f"--moe-dispatcher {str(self.moe_dispatcher)[:40]!r}: expected one of "
                               f"{', '.join(DISPATCHERS)}")
        if self.moe_routing not in ROUTINGS:
            raise ProgramError(f"--moe-routing {str(self.moe_routing)[:40]!r}: expected one of {', '.join(ROUTINGS)}")
        for flag, v in (("--grad-dtype", self.grad_dtype), ("--optimizer-dtype", self.optimizer_dtype)):
            if v is not None and v not in STATE_DTYPES:
                raise ProgramError(f"{flag} {str(v)[:40]!r}: expected one of {', '.join(STATE_DTYPES)}")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ProgramError(f"--precision {self.precision[:40]!r}: expected one of {', '.join(PRECISIONS)}")
        if self.framework not in FRAMEWORKS:
            raise ProgramError(f"--framework {self.framework[:40]!r}: expected one of {', '.join(FRAMEWORKS)}")
        if self.attention_kernel is not None and self.attention_kernel not in ATTENTION_KERNELS:
            raise ProgramError(f"--attention-kernel {str(self.attention_kernel)[:40]!r}: unknown kernel, expected one "
                               f"of {', '.join(ATTENTION_KERNELS)}")
        _check_skew(self.moe_skew)
        if self.moe_histogram is not None:
            _check_histogram(self.moe_histogram)
        if self.moe_histogram is not None and self.moe_skew != 1.0:
            raise ProgramError("--moe-skew and --moe-histogram: give one, not both")
        if self.moe_routing == "balanced" and (self.moe_histogram is not None or self.moe_skew != 1.0):
            flag = "--moe-histogram" if self.moe_histogram is not None else f"--moe-skew {skew_label(self.moe_skew)}"
            raise ProgramError(f"{flag} with --moe-routing balanced: balanced routing gives every expert the same "
                               f"tokens (fake_balanced_gate), so no expert is busier; give one, not both")
        for flag, off, what in (("--no-async-tp-allreduce", not self.tp_allreduce_overlap,
                                 "the tp all-reduce of Megatron-LM before 2021-09, blocking the backward"),
                                ("--no-wgrad-fusion", not self.wgrad_fusion,
                                 "Megatron-LM before 2022-02, its weight gradients added into param.grad")):
            if off and self.framework != "megatron":  # (they were accepted there and changed nothing)
                raise ProgramError(f"{flag}: {what}; applies to --framework megatron only, not --framework "
                                   f"{self.framework}")
        if self.pp_scatter_gather and self.framework != "megatron":
            raise ProgramError(f"--pp-scatter-gather: applies to --framework megatron only (Megatron-LM 2021-2022's "
                               f"scatter_gather_tensors_in_pipeline), not --framework {self.framework}")
        self._check_loss()
        if self.fsdp_float8_all_gather and not (self.fp8 and self.framework == "torchtitan"):
            raise ProgramError(f"--fsdp-float8-all-gather: torchao's float8 all-gather under FSDP2 needs --precision fp8 "
                               f"and --framework torchtitan (given: {self._given()})")
        self._check_float8_recipe()
        if self.compile is not None and self.framework != "torchtitan":
            raise ProgramError(f"--{'' if self.compile else 'no-'}compile: applies to --framework torchtitan only "
                               f"(--framework {self.framework} runs fused Transformer Engine kernels)")

    def _given(self) -> str:
        """The precision and framework as given, for a message (no ``--precision``: the model's dtype)."""
        return f"{f'--precision {self.precision}' if self.precision else 'no --precision'}, --framework {self.framework}"

    def _check_float8_recipe(self) -> None:
        """``--float8-recipe`` where torchao's float8 linears run, and not with what torchtitan refuses."""
        r = self.float8_recipe
        if r is None:
            return
        if r not in FLOAT8_RECIPES:
            raise ProgramError(f"--float8-recipe {str(r)[:40]!r}: expected one of {', '.join(FLOAT8_RECIPES)} "
                               f"(torchao's Float8LinearRecipeName)")
        if not (self.fp8 and self.framework == "torchtitan"):
            raise ProgramError(f"--float8-recipe {r}: torchao's float8 recipe applies to --precision fp8 --framework "
                               f"torchtitan only (given: {self._given()})")
        if r == "rowwise_with_gw_hp":
            raise ProgramError("--float8-recipe rowwise_with_gw_hp: not modelled (its grad_weight GEMM runs in bf16 "
                               "beside the float8 output and grad_input GEMMs: torchao Float8LinearConfig."
                               "from_recipe_name); give tensorwise or rowwise")
        if r == "rowwise" and self.fsdp_float8_all_gather:
            raise ProgramError("--float8-recipe rowwise and --fsdp-float8-all-gather: torchao's float8 all-gather "
                               "supports tensorwise scaling only (torchtitan asserts enable_fsdp_float8_all_gather "
                               "off with a recipe_name); give one, not both")

    @property
    def float8_rowwise(self) -> bool:
        """torchao's rowwise float8 recipe (``--float8-recipe rowwise``) runs the fp8 linears."""
        return self.float8_recipe == "rowwise" and self.fp8 and self.framework == "torchtitan"

    def _check_loss(self) -> None:
        """``--cross-entropy-fusion`` and ``--cross-entropy-kernel`` where the framework has them."""
        if self.ce_fusion and self.framework != "megatron":
            raise ProgramError(f"--cross-entropy-fusion: Megatron's --cross-entropy-loss-fusion applies to --framework "
                               f"megatron only, not --framework {self.framework}")
        if self.ce_kernel is None:
            return
        if self.ce_kernel not in CE_KERNELS:
            raise ProgramError(f"--cross-entropy-kernel {str(self.ce_kernel)[:40]!r}: expected one of "
                               f"{', '.join(CE_KERNELS)}")
        if self.framework != "torchtitan":
            raise ProgramError(f"--cross-entropy-kernel {self.ce_kernel}: flash-attn's CrossEntropyLoss in the model's "
                               f"code applies to --framework torchtitan only, not --framework {self.framework} "
                               f"(it runs its own loss)")
        if self.ce_fusion:
            raise ProgramError("--cross-entropy-kernel and --cross-entropy-fusion: give one, not both")
        if self.ce_kernel == "compiled" and not self.compile:
            raise ProgramError("--cross-entropy-kernel compiled: torchtitan compiles its loss under --compile only "
                               "(build_cross_entropy_loss: torch.compile(loss_fn) if training.compile); give "
                               "--compile, or leave the option out for the eager loss")

    @property
    def eager(self) -> bool:
        """The model's blocks run as eager PyTorch ops (torchtitan without ``--compile``)."""
        return self.framework == "torchtitan" and not self.compile

    def precision_of(self, dtype: str) -> str:
        """The precision the step computes in: ``precision`` if given, else the one of ``dtype``
        (the program's parameter dtype)."""
        return self.precision or _OF_DTYPE.get(dtype, "fp32")

    @property
    def fsdp2(self) -> bool:
        """The framework shards with FSDP2 (:data:`FSDP2`)."""
        return self.framework in FSDP2

    @property
    def fp8(self) -> bool:
        return self.precision == "fp8"

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"precision": self.precision, "framework": self.framework,
                                  "tp_comm_overlap": self.tp_comm_overlap}
        if self.moe_skew != 1.0:
            out["moe_skew"] = self.moe_skew
        if self.moe_histogram is not None:
            out["moe_histogram"] = list(self.moe_histogram)
        if self.grad_dtype is not None:
            out["grad_dtype"] = self.grad_dtype
        if self.optimizer_dtype is not None:
            out["optimizer_dtype"] = self.optimizer_dtype
        if self.moe_dispatcher != "alltoall":
            out["moe_dispatcher"] = self.moe_dispatcher
        if self.moe_routing != "topk":
            out["moe_routing"] = self.moe_routing
        if self.framework == "torchtitan":
            out["compile"] = bool(self.compile)
        if self.ce_fusion:
            out["ce_fusion"] = True
        if self.ce_kernel is not None:
            out["ce_kernel"] = self.ce_kernel
        if self.fsdp_float8_all_gather:
            out["fsdp_float8_all_gather"] = True
        if self.fp8 and self.framework == "torchtitan":
            out["float8_recipe"] = self.float8_recipe or "tensorwise"
        if not self.p2p_overlap:
            out["p2p_overlap"] = False
        if self.pp_scatter_gather:
            out["pp_scatter_gather"] = True
        if not self.grad_overlap:
            out["grad_overlap"] = False
        if not self.tp_allreduce_overlap:
            out["tp_allreduce_overlap"] = False
        if not self.wgrad_fusion:
            out["wgrad_fusion"] = False
        if self.ep_comm_overlap:
            out["ep_comm_overlap"] = True
        if self.attention_kernel is not None:
            out["attention_kernel"] = self.attention_kernel
        return out


def parse_precision(text: str | None) -> str | None:
    """``--precision``: one of :data:`PRECISIONS` (``bfloat16`` / ``float16`` / ``float32`` as
    aliases), None when not given."""
    if text is None:
        return None
    key = text.strip().lower()
    key = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float8": "fp8"}.get(key, key)
    if key not in PRECISIONS:
        raise ProgramError(f"--precision {text[:40]!r}: expected one of {', '.join(PRECISIONS)}")
    return key


def _number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(float(v))


def _check_skew(f: Any) -> None:
    if not _number(f) or f < 1.0:
        raise ProgramError(f"--moe-skew {str(f)[:40]}: expected a number >= 1 (the busiest expert's tokens over the "
                           f"mean; 1 = uniform routing)")


def _check_histogram(h: Any) -> None:
    if not isinstance(h, (list, tuple)) or not h:
        raise ProgramError("--moe-histogram: expected a non-empty JSON list of tokens per expert")
    for e, v in enumerate(h):
        if not _number(v) or v < 0:
            raise ProgramError(f"--moe-histogram: expert {e} has {json.dumps(v)[:40]} tokens; expected a number >= 0")
    if sum(h) <= 0:
        raise ProgramError("--moe-histogram: every expert has 0 tokens; expected some tokens routed")


def parse_moe_skew(text: str | None) -> float:
    """``--moe-skew F|NAME``: a number >= 1 or the name of one of :data:`SKEW_FIGURES` (case
    ignored), as the busiest expert's tokens over the mean (ProgramError naming the flag); 1.0
    when not given."""
    if text is None:
        return 1.0
    figure = SKEW_FIGURES.get(text.strip().lower())
    if figure is not None:
        return figure[0]
    try:
        f = float(text)
    except ValueError:
        raise ProgramError(f"--moe-skew {text[:40]!r}: expected a number >= 1 (the busiest expert's tokens over "
                           f"the mean) or a published figure: {', '.join(SKEW_FIGURES)}") from None
    _check_skew(f)
    return f


def skew_label(f: float) -> str:
    """How messages name the skew ``f``: ``NAME (F)`` for a figure of :data:`SKEW_FIGURES`, else ``F``."""
    name = next((n for n, (v, _) in SKEW_FIGURES.items() if v == f), None)
    return f"{name} ({f:g})" if name else f"{f:g}"


def parse_moe_histogram(text: str | None) -> tuple[float, ...] | None:
    """``--moe-histogram FILE|JSON``: a JSON list of tokens per expert (numbers >= 0, not all
    0), inline or in a file; None when not given."""
    if text is None:
        return None
    t = text.strip()
    if t.startswith(("[", "{")):  # JSON inline (an object is named as not a list, not looked for as a file)
        try:
            obj = json.loads(t)
        except (json.JSONDecodeError, RecursionError, ValueError):
            raise ProgramError(f"--moe-histogram {text[:40]!r}: not a JSON list of tokens per expert") from None
    else:
        obj = read_json(t, "--moe-histogram: file", ProgramError)
    _check_histogram(obj)
    return tuple(float(v) for v in obj)


__all__ = ["CE_KERNELS", "DISPATCHERS", "FLOAT8_RECIPES", "FRAMEWORKS", "ROUTINGS", "FSDP2", "PRECISIONS", "SKEW_FIGURES", "Runtime", "parse_moe_histogram",
           "parse_moe_skew", "parse_precision", "reduces_each_microstep", "skew_label"]
