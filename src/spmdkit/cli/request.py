"""argv -> one typed request: the flags of ``spmdkit plan`` and ``spmdkit run``, and the frozen
requests the parsed flags become once (:func:`plan_request`, :func:`run_request`).

A request holds the flags as given (texts where the command checks them itself, in its own
order and with its own messages, :mod:`spmdkit.cli.checks` the checks they share); the
commands read it and never change it.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields

from spmdkit.core.errors import ProgramError
from spmdkit.cost.devices import DEVICES
from spmdkit.models.zoo import PRESETS, is_config_text
from spmdkit.planner.planning import MAX_LAYERS, MAX_SIZE
from spmdkit.program.runtime import CE_KERNELS, Runtime, parse_moe_histogram, parse_moe_skew, parse_precision

#: ``--mesh`` when neither it nor ``--devices`` is given.
DEFAULT_MESH = "dp=2,tp=4"
#: ``spmdkit run --timeout`` by default (seconds).
DEFAULT_TIMEOUT = 120.0
#: ``spmdkit run --hf`` example inputs when --batch / --seq are not given
HF_BATCH = 4
HF_SEQ = 16


# -- the requests --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelArgs:
    """Which model: a preset (``--model``), ``--program FILE`` or ``--hf CLASS`` with its
    ``--hf-config`` and ``--dtype``; ``--tp-plan`` (megatron's module patterns for the last
    two). Each command checks them into a :data:`spmdkit.models.source.ModelSource`."""

    model: str
    program: str | None = None
    hf: str | None = None
    hf_config: str | None = None
    dtype: str | None = None
    tp_plan: str | None = None
    #: ``--model-config`` as given (``model`` is then that text); ``--model`` given too
    model_config: str | None = None
    preset_given: bool = False
    #: ``--fallback`` (``replicate``: an --hf op with no lowering imported as a replicated op)
    fallback: str | None = None
    #: ``--make-vocab-size-divisible-by N``: the vocabulary padded to a multiple of N x tp (Megatron's)
    vocab_divisible_by: int | None = None

    def check_config(self) -> None:
        """``--model-config`` and ``--model`` exclude each other; a config is a JSON object or a
        ``.json`` file."""
        if self.model_config is None:
            return
        if self.preset_given:
            raise ProgramError("--model-config: give a preset (--model) or a config (--model-config), not both")
        if not is_config_text(self.model_config):
            raise ProgramError(f"--model-config {self.model_config[:60]!r}: expected a JSON object or a .json file")


@dataclass(frozen=True)
class Links:
    """How the step is timed: ``--cost`` (link costs per mesh dim), ``--device`` (a GPU preset
    or file) and ``--nodes-of`` (ranks per node)."""

    cost: str | None = None
    device: str | None = None
    nodes_of: str | None = None
    precision: str | None = None
    framework: str | None = None
    tp_comm_overlap: bool = False
    moe_skew: str | None = None
    moe_histogram: str | None = None
    grad_dtype: str | None = None
    optimizer_dtype: str | None = None
    compile: bool | None = None
    moe_dispatcher: str | None = None
    moe_routing: str | None = None
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
    attention_kernel: str | None = None

    def runtime(self) -> Runtime:
        """The runtime flags (``--precision``, ``--framework``, ``--tp-comm-overlap``, the MoE,
        state-dtype, compile, loss and p2p flags) as the plan's
        :class:`~spmdkit.program.runtime.Runtime` (ProgramError naming the flag)."""
        return Runtime(precision=parse_precision(self.precision),
                       framework=(self.framework or "megatron").strip().lower(),
                       tp_comm_overlap=self.tp_comm_overlap, moe_skew=parse_moe_skew(self.moe_skew),
                       moe_histogram=parse_moe_histogram(self.moe_histogram),
                       grad_dtype=_state_dtype(self.grad_dtype), optimizer_dtype=_state_dtype(self.optimizer_dtype),
                       compile=self.compile, moe_dispatcher=(self.moe_dispatcher or "alltoall").strip().lower(),
                       moe_routing=(self.moe_routing or "topk").strip().lower(),
                       ce_fusion=self.ce_fusion, ce_kernel=self.ce_kernel, p2p_overlap=self.p2p_overlap,
                       fsdp_float8_all_gather=self.fsdp_float8_all_gather,
                       float8_recipe=None if self.float8_recipe is None else self.float8_recipe.strip().lower(),
                       pp_scatter_gather=self.pp_scatter_gather,
                       ep_comm_overlap=self.ep_comm_overlap, grad_overlap=self.grad_overlap,
                       tp_allreduce_overlap=self.tp_allreduce_overlap, wgrad_fusion=self.wgrad_fusion,
                       attention_kernel=None if self.attention_kernel is None else self.attention_kernel.strip().lower())


def _state_dtype(text: str | None) -> str | None:
    """``--grad-dtype`` / ``--optimizer-dtype`` as given (bfloat16 / float32 as aliases); the
    Runtime refuses other values, naming the flag."""
    if text is None:
        return None
    key = text.strip().lower()
    return {"bfloat16": "bf16", "float32": "fp32"}.get(key, key)


@dataclass(frozen=True)
class Outputs:
    """What ``spmdkit plan`` writes besides the report: ``--json``, ``--wide``, ``--html FILE``,
    ``--export FORMAT FILE``."""

    json: bool = False
    wide: bool = False
    html: str | None = None
    export: tuple[str, str] | None = None
    #: ``--export-recipe KIND FILE`` (--devices: the best recipe as torchtitan TOML, Megatron-LM arguments, JSON)
    recipe: tuple[str, str] | None = None


@dataclass(frozen=True)
class SearchArgs:
    """``--auto`` (the ILP search of the shardings), its ``--auto-time-limit``, ``--memory``
    (the cap) and ``--explain``."""

    auto: bool = False
    time_limit: str | None = None  # (None: not given; the search's 60 s)
    memory: str | None = None
    explain: bool = False


@dataclass(frozen=True)
class PipelineArgs:
    """A pipeline's flags: ``--microbatches``, ``--schedule``, ``--virtual-stages``, ``--stages``,
    ``--microbatch-group``."""

    microbatches: str | None = None
    schedule: str | None = None
    virtual_stages: str | None = None
    stages: str | None = None
    microbatch_group: str | None = None

    def given(self) -> list[str]:
        """The flags given, in this order."""
        return [f for f, v in (("--microbatches", self.microbatches), ("--schedule", self.schedule),
                               ("--virtual-stages", self.virtual_stages), ("--stages", self.stages),
                               ("--microbatch-group", self.microbatch_group))
                if v is not None]


@dataclass(frozen=True)
class PlanRequest:
    """``spmdkit plan``'s flags. ``mesh`` is ``--mesh`` or, unless ``--devices`` is given,
    :data:`DEFAULT_MESH`; ``layers`` / ``batch`` / ``seq`` override a preset's sizes."""

    model: ModelArgs
    mesh: str | None
    strategy: str | None = None
    devices: str | None = None
    layers: str | None = None
    batch: str | None = None
    seq: str | None = None
    annotate: tuple[str, ...] = ()
    links: Links = Links()
    grad_accum: str | None = None
    recompute: str | None = None
    verify: bool = False
    #: sequences per optimizer step, and per data-parallel rank in one micro-step (cli/batch.py)
    global_batch: str | None = None
    micro_batch: str | None = None
    search: SearchArgs = SearchArgs()
    pipeline: PipelineArgs = PipelineArgs()
    outputs: Outputs = Outputs()
    #: the command line as typed (after ``spmdkit``)
    argv: tuple[str, ...] = ()

    @property
    def mesh_text(self) -> str:
        """The mesh planned on (a command without ``--devices``)."""
        assert self.mesh is not None
        return self.mesh


@dataclass(frozen=True)
class RunRequest:
    """``spmdkit run``'s flags, and ``argv``: its own arguments, which the local launcher hands
    to every rank."""

    model: ModelArgs
    mesh: str
    argv: tuple[str, ...] = ()
    strategy: str | None = None
    layers: int | None = None
    batch: int | None = None
    seq: int | None = None
    pad: int | None = None
    annotate: tuple[str, ...] = ()
    nproc: int | None = None
    backend: str = "auto"
    seed: int = 0
    kernels: str = "torch"
    warmup: int = 0
    device: str | None = None
    json: bool = False
    timeout: float = DEFAULT_TIMEOUT
    #: ``--engine``: spmdkit (op by op, exact) or torch (the export on torch's own engine under torchrun)
    engine: str = "spmdkit"
    #: ``--engine torch``: training steps, optimizer, learning rate, an export file to run (None: made here)
    steps: int | None = None
    optimizer: str | None = None
    lr: float | None = None
    torch_plan: str | None = None


def _model_args(ns: argparse.Namespace) -> ModelArgs:
    return ModelArgs(model=ns.model_config or ns.model or ns.default_model, program=ns.program, hf=ns.hf,
                     hf_config=ns.hf_config, dtype=ns.dtype, tp_plan=ns.tp_plan, model_config=ns.model_config,
                     preset_given=ns.model is not None, fallback=ns.fallback,
                     vocab_divisible_by=getattr(ns, "vocab_divisible_by", None))


def _strategy(ns: argparse.Namespace) -> str | None:
    """``--strategy`` with ``--cp-attention`` / ``--cp-balance`` added as its items
    (spmdkit.strategies.context: the strategy text carries cp's options)."""
    extra = [f"{k}={v}" for k, v in (("cp-attention", getattr(ns, "cp_attention", None)),
                                     ("cp-balance", getattr(ns, "cp_balance", None))) if v]
    if not extra:
        return ns.strategy  # type: ignore[no-any-return]
    return ",".join([*([ns.strategy] if ns.strategy else []), *extra])


def _divisor(text: str) -> int:
    """``--make-vocab-size-divisible-by``: a positive integer."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if not 1 <= v <= 1 << 20:
        raise argparse.ArgumentTypeError(f"must be a positive integer (Megatron's default is 128), got {text!r}")
    return v


def _add_vocab_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--make-vocab-size-divisible-by", dest="vocab_divisible_by", type=_divisor, metavar="N",
                   help="--hf, a preset or --model-config: pad the vocabulary to a multiple of N x tp as Megatron-LM "
                        "does (its --make-vocab-size-divisible-by, default 128 there; HF's resize_token_embeddings("
                        "pad_to_multiple_of=...)): the padded rows are parameters of the embedding and the output "
                        "layer, their logits in the softmax, never a token or a target; the report says so "
                        "(default: the vocabulary as the config gives it, refused where tp does not divide it)")


def _add_loss_arguments(p: argparse.ArgumentParser) -> None:
    """The loss as the framework or the model code runs it (docs/devices.md, "The loss")."""
    p.add_argument("--cross-entropy-fusion", dest="ce_fusion", action="store_true",
                   help="framework megatron: the loss as Megatron's --cross-entropy-loss-fusion runs it (NeMo's "
                        "cross_entropy_loss_fusion: fewer passes over the fp32 logits; default off, as in Megatron-LM)")
    p.add_argument("--cross-entropy-kernel", dest="ce_kernel", choices=CE_KERNELS,
                   help="framework torchtitan: the loss is flash-attn's fused CrossEntropyLoss in the model code "
                        "(llm-foundry MPT's loss_fn: fused_crossentropy): flash-attn-xentropy (flash-attn <= 2.2.2, "
                        "CUDA xentropy) or flash-attn-triton (>= 2.2.3); one kernel over the bf16 logits each way, "
                        "no fp32 copy; compiled: torchtitan's own loss compiled under --compile (torchtitan from "
                        "2025-04: torch.compile(loss_fn) if training.compile) (default: the framework's own loss)")


def _add_cp_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cp-attention", dest="cp_attention", choices=("allgather", "ring", "alltoall"),
                   help="with cp in --strategy: attention over the split sequence by allgather (k and v gathered: "
                        "the default, Llama 3's), ring (kv blocks passed round the cp ranks) or alltoall "
                        "(DeepSpeed-Ulysses: sequence traded for heads) (docs/context.md)")
    p.add_argument("--cp-balance", dest="cp_balance", choices=("zigzag", "none"),
                   help="with cp: zigzag (the default: rank i holds chunks i and 2cp-1-i, equal causal work) or none")


def plan_request(ns: argparse.Namespace) -> PlanRequest:
    """The request of a parsed ``spmdkit plan`` command line."""
    mesh = ns.mesh if ns.mesh is not None or ns.devices is not None else DEFAULT_MESH
    return PlanRequest(
        model=_model_args(ns), mesh=mesh, strategy=_strategy(ns), devices=ns.devices, layers=ns.layers,
        batch=ns.batch, seq=ns.seq, annotate=tuple(ns.annotate),
        links=Links(**{f.name: getattr(ns, f.name) for f in fields(Links)}),  # each flag's dest is its field
        grad_accum=ns.grad_accum, recompute=ns.recompute, verify=ns.verify,
        global_batch=ns.global_batch, micro_batch=ns.micro_batch,
        search=SearchArgs(auto=ns.auto, time_limit=ns.auto_time_limit, memory=ns.memory, explain=ns.explain),
        pipeline=PipelineArgs(microbatches=ns.microbatches, schedule=ns.schedule,
                              virtual_stages=ns.virtual_stages, stages=ns.stages,
                              microbatch_group=ns.microbatch_group),
        outputs=Outputs(json=ns.json, wide=ns.wide, html=ns.html,
                        export=None if ns.export is None else (ns.export[0], ns.export[1]),
                        recipe=None if ns.export_recipe is None else (ns.export_recipe[0], ns.export_recipe[1])),
        argv=tuple(ns.argv))


def run_request(ns: argparse.Namespace, argv: list[str]) -> RunRequest:
    """The request of a parsed ``spmdkit run`` command line; ``argv``: the arguments after ``run``."""
    return RunRequest(
        model=_model_args(ns), mesh=ns.mesh, argv=tuple(argv), strategy=_strategy(ns), layers=ns.layers,
        batch=ns.batch, seq=ns.seq, pad=ns.pad, annotate=tuple(ns.annotate), nproc=ns.nproc, backend=ns.backend,
        seed=ns.seed, kernels=ns.kernels, warmup=ns.warmup, device=ns.device, json=ns.json, timeout=ns.timeout,
        engine=ns.engine, steps=ns.steps, optimizer=ns.optimizer, lr=ns.lr, torch_plan=ns.torch_plan)


# -- the flags -----------------------------------------------------------------------------------


_SCATTER_GATHER_HELP = ("--framework megatron, tp > 1 without sequence parallelism: each tp rank sends 1/tp of a "
                        "pipeline activation or gradient and the receivers all-gather it over tp (Megatron-LM "
                        "2021-2022's default; Megatron-Core sends whole tensors)")


def _add_compute_arguments(p: argparse.ArgumentParser) -> None:
    """``--precision``, ``--framework``, ``--float8-recipe`` and ``--attention-kernel``: what the step computes in and
    with which framework's conventions and kernels."""
    p.add_argument("--precision", metavar="fp32|bf16|fp16|fp8",
                   help="what the GEMMs compute in: fp8 runs the linear layers' GEMMs on the fp8 tensor cores "
                        "(Transformer Engine / torchao float8: weights in bf16 plus fp8 copies); default the "
                        "model's dtype")
    p.add_argument("--framework", metavar="megatron|torchtitan|automodel",
                   help="whose memory and overlap conventions the prediction follows: megatron (Megatron-LM / "
                        "NeMo: fp32 main gradients and master weights; default), torchtitan (FSDP2: fp32 "
                        "sharded parameters and gradients, bf16 compute copies) or automodel (NeMo AutoModel: "
                        "FSDP2 over bf16 parameters, bf16 Adam moments, the loss on bf16 logits)")
    p.add_argument("--float8-recipe", dest="float8_recipe", metavar="tensorwise|rowwise",
                   help="--precision fp8 --framework torchtitan: torchao's float8 recipe (torchtitan's "
                        "--float8.recipe_name): tensorwise (default; per-tensor scales, float8 TP all-gathers) or "
                        "rowwise (a scale per row, its backward operands re-scaled along the other axis from bf16, "
                        "TP all-gathers in bf16)")
    p.add_argument("--attention-kernel", metavar="fa2|flash-attn|cudnn|triton",
                   help="the flash-attention kernel the run's model code calls, where it is not the framework's "
                        "(megatron: cudnn on Hopper, fa2 on Ampere; torchtitan: fa2): fa2 (FlashAttention-2, "
                        "torch's scaled_dot_product_attention), flash-attn (FlashAttention-2 from Dao's flash-attn "
                        "package, as Transformer Engine runs it with NVTE_FUSED_ATTN=0), cudnn (Transformer "
                        "Engine's fused attention) or triton (flash-attention's pre-MLIR Triton kernel, MPT's "
                        "attn_impl: triton; priced at FlashAttention v1's rates, which its docstring compares it "
                        "with)")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help=f"a preset ({', '.join(sorted(PRESETS))}) or a published architecture by name "
                        f"(llama3-8b, deepseek-v3, ...: spmdkit models lists them); default llama-7b")
    p.set_defaults(default_model="llama-7b", argv=())
    p.add_argument("--model-config", dest="model_config", metavar="FILE|JSON",
                   help='a decoder of your own instead of a preset: a JSON object or file with layers, hidden, heads, '
                        'kv_heads, ffn, vocab, seq, batch, dtype, arch (llama or gpt2), activation (swiglu, gelu, '
                        'squared_relu, relu), attention (flash or eager), tied_embeddings, or "base": a preset the '
                        'others override, e.g. \'{"base": "llama-7b", "layers": 16}\' (docs/graph.md)')
    p.add_argument("--program", help="plan a program JSON file (docs/graph.md) instead of a preset")
    p.add_argument("--hf", metavar="CLASS",
                   help="plan a HuggingFace transformers model built from --hf-config, e.g. LlamaForCausalLM "
                        "(needs spmdkit[hf])")
    p.add_argument("--hf-config", metavar="FILE|JSON", help="the --hf model's config: a config.json file or a JSON object")
    p.add_argument("--dtype", default="float32", help="the --hf model's dtype: float32 (default), bf16, fp16, float64")
    p.add_argument("--fallback", choices=("replicate",), help="--hf: an ATen op with no lowering becomes a replicated op (every input and output replicated, its backward too; torch runs it), named in a warning at the top of the report; default: refused")
    _add_vocab_argument(p)
    p.add_argument("--tp-plan", metavar="FILE|JSON",
                   help='megatron for --hf / --program: module-name patterns -> column, row, vocab or replicate, '
                        'tried before the defaults, e.g. \'{"*.k_proj": "replicate"}\'')
    p.add_argument("--mesh", default=None, help="named mesh dims, e.g. dp=2,tp=4 (default)")
    p.add_argument("--devices", metavar="N",
                   help="instead of --mesh: search every dp x tp x pp mesh of N devices, the strategies, ZeRO stages "
                        "and recomputation (and --auto's search per mesh) for the fastest plan that fits the memory "
                        "(graph/auto_search.py); prints the top configurations and the best plan")
    p.add_argument("--strategy", default=None,
                   help="comma list of dp, megatron (tp), sp, ep (MoE experts over an ep mesh dim, tokens over dp x ep; "
                        "with megatron, etp=1: each expert whole, the experts over ep x tp; with cp, ep-from=cp: the ep "
                        "ranks carved from cp, the sequence over cp x ep), "
                        "cp (the sequence over a cp mesh dim: context parallelism), zero1, "
                        "zero2 (zero), zero3 (fsdp); default megatron (= dp,megatron) for a preset or --hf, none for --program")
    _add_cp_arguments(p)
    p.add_argument("--layers", help=f"override the preset's layer count (1 to {MAX_LAYERS})")
    p.add_argument("--batch", help=f"override the preset's batch size (1 to {MAX_SIZE}): the sequences of one "
                                   "forward/backward over every data-parallel rank (with --grad-accum K a step "
                                   "trains K x batch; with --devices or a pipeline, the sequences per step)")
    p.add_argument("--global-batch", dest="global_batch", metavar="G",
                   help="sequences per optimizer step (Megatron's --global-batch-size); the gradient accumulation "
                        "or a pipeline's microbatches are derived: G / (micro-batch x dp)")
    p.add_argument("--micro-batch", dest="micro_batch", metavar="B",
                   help="with --global-batch: sequences per data-parallel rank in one forward/backward "
                        "(default: G / dp without a pipeline, 1 with one)")
    p.add_argument("--seq", help=f"override the preset's sequence length (1 to {MAX_SIZE})")
    p.add_argument("--annotate", action="append", default=[], metavar="TENSOR=DIMS_MAPPING",
                   help='pin a tensor, e.g. --annotate "tokens=[0,-1]" (repeatable)')
    p.add_argument("--cost", help='link costs per mesh dim, e.g. "tp=5us/150GB,dp=20us/25GB"')
    p.add_argument("--device", help=f"predict the step on this GPU: a preset ({', '.join(DEVICES)}) "
                                    "or a JSON file (docs/devices.md); also sets the links of --cost")
    p.add_argument("--nodes-of", dest="nodes_of", metavar="N",
                   help="ranks per node (the device's, 8, by default): inner mesh dims within N ranks use NVLink")
    _add_compute_arguments(p)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="--framework torchtitan: the transformer blocks compiled by torch.compile (norms, rotary "
                        "and SwiGLU fused) or, --no-compile (torchtitan's default), run eagerly: every PyTorch op "
                        "its own kernels reading and writing HBM (docs/devices.md, \"Eager and compiled\")")
    p.add_argument("--tp-comm-overlap", dest="tp_comm_overlap", action="store_true",
                   help="tensor-parallel all-gathers and reduce-scatters overlap the GEMMs (Megatron's "
                        "--tp-comm-overlap, torch async TP)")
    p.add_argument("--fsdp-float8-all-gather", dest="fsdp_float8_all_gather", action="store_true",
                   help="--precision fp8 --framework torchtitan on a ZeRO-3 plan: FSDP2 gathers the fp8 linears' "
                        "weights in float8 (torchao's enable_fsdp_float8_all_gather with "
                        "precompute_float8_dynamic_scale_for_fsdp): 1 byte an element gathered and held")
    p.add_argument("--ep-comm-overlap", dest="ep_comm_overlap", action="store_true",
                   help="mixture of experts, interleaved pipeline or no pipeline (--grad-accum microbatches): a "
                        "forward and another microbatch's backward run as one merged step, each one's expert-parallel all-to-alls under the other's computation "
                        "(Megatron-Core's --overlap-moe-expert-parallel-comm with --delay-wgrad-compute)")
    p.add_argument("--no-p2p-overlap", dest="p2p_overlap", action="store_false",
                   help="pipeline: every stage-to-stage send blocks its sender (Megatron-LM before 2023, "
                        "--no-overlap-p2p-communication); default: the interleaved schedule's sends overlap compute")
    p.add_argument("--pp-scatter-gather", action="store_true", help=_SCATTER_GATHER_HELP)
    p.add_argument("--no-grad-overlap", dest="grad_overlap", action="store_false",
                   help="the data-parallel gradient reduction runs after the last backward, all in one buffer per "
                        "dtype (Megatron-LM 2021-2022's local DDP); default: in buckets under the backward")
    p.add_argument("--no-async-tp-allreduce", dest="tp_allreduce_overlap", action="store_false",
                   help="framework megatron: the backward's tp all-reduce of a column-parallel input gradient blocks "
                        "(Megatron-LM before 2021-09); default: it runs beside the wgrad GEMM (async all-reduce)")
    p.add_argument("--no-wgrad-fusion", dest="wgrad_fusion", action="store_false",
                   help="framework megatron: autograd adds each microbatch's weight gradient into param.grad "
                        "(Megatron-LM before 2022-02); default: its GEMM accumulates into the fp32 main_grad")
    _add_loss_arguments(p)
    p.add_argument("--moe-skew", dest="moe_skew", metavar="F|NAME",
                   help="mixture of experts: the busiest expert receives F x the mean tokens (the others share the "
                        "rest); under expert parallelism the step waits for the busiest ep rank (default 1: uniform); "
                        "NAME: a published figure, aux-loss (1.52: an auxiliary-loss router's MaxVio over a "
                        "validation set, Wang et al. 2024) or r1-decode (11.948: DeepSeek-R1's hottest expert per "
                        "layer and iteration, TensorRT-LLM's wide-EP blog); docs/experts.md")
    p.add_argument("--moe-histogram", dest="moe_histogram", metavar="FILE|JSON",
                   help="mixture of experts: measured tokens per expert, a JSON list (one number per expert) or a "
                        "file holding one, instead of --moe-skew")
    p.add_argument("--moe-dispatcher", dest="moe_dispatcher", metavar="alltoall|deepep",
                   help="mixture of experts: how tokens reach other ranks' experts: alltoall (NCCL all-to-all, "
                        "Megatron-Core's alltoall dispatcher; default) or deepep (DeepEP: once per destination node "
                        "over the network, forwarded over NVLink; Megatron-Core's flex, AutoModel's DeepEP)")
    p.add_argument("--moe-routing", dest="moe_routing", metavar="topk|balanced",
                   help="mixture of experts: the experts a token reaches, for the all-to-alls' bytes: topk (the "
                        "model's router; default) or balanced (consecutive experts t*k..t*k+k-1: NeMo AutoModel's "
                        "fake_balanced_gate)")
    p.add_argument("--grad-dtype", dest="grad_dtype", metavar="fp32|bf16",
                   help="the dtype gradients are accumulated and reduced in (Megatron-Core's grad_reduce_in_fp32, "
                        "NeMo's optim.grad_sync_dtype); default the framework's (fp32 main gradients)")
    p.add_argument("--optimizer-dtype", dest="optimizer_dtype", metavar="fp32|bf16",
                   help="the dtype of Adam's moments (NeMo's optim.dtype); bf16: two bf16 moments and no fp32 "
                        "master copy; default the framework's")
    p.add_argument("--grad-accum", dest="grad_accum", metavar="K",
                   help="gradient accumulation: K forward/backward micro-steps per optimizer step, the gradients "
                        "accumulated and reduced once (default 1)")
    p.add_argument("--recompute", default=None, metavar="none|selective|selective:M1,M2|full|full:K|every:N|microbatch",
                   help="activation recomputation: selective (the attention core, Korthikanti et al. 2022); "
                        "selective:M1,M2 (Megatron-Core's --recompute-modules: the named modules of each layer "
                        "run again, among core_attn, layernorm, mlp, moe, moe_act, shared_experts, mla_up_proj); "
                        "full (every layer, only its input kept); full:K (the first K layers of each pipeline "
                        "stage, of the model without a pipeline, Megatron-LM's --recompute-method block "
                        "--recompute-num-layers K); every:N (torchtitan's selective_ac_option = N: every N-th "
                        "block of each pipeline rank checkpointed whole, the others not); microbatch (a "
                        "pipeline: every activation of "
                        "as many in-flight microbatches as fit, the attention core of the others recomputed, "
                        "Korthikanti et al. App. C); in the memory and the --device step (default "
                        "none; --devices tries none, selective, full)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--html", metavar="FILE",
                   help="also write the plan as one self-contained HTML page (figures of the mesh, the shardings, "
                        "communication, memory and the step's timeline; no network needed)")
    p.add_argument("--wide", action="store_true",
                   help="print the tables whole, however wide (on a terminal they are fitted to its width)")
    p.add_argument("--export", nargs=2, metavar=("torch|dtensor|jax|paddle", "FILE"),
                   help="also write the plan for torch (a Python module: parallelize(model, mesh) with torch's "
                        "parallel styles, FSDP2 and pipelining), torch DTensor (a parallelize_module plan and "
                        "placements), JAX (PartitionSpecs) or Paddle (shard_tensor placements) to FILE (docs/export.md)")
    p.add_argument("--export-recipe", dest="export_recipe", nargs=2, metavar=("torchtitan|megatron|json", "FILE"),
                   help="with --devices: also write the best recipe as a torchtitan job config (TOML), Megatron-LM's "
                        "command-line arguments or JSON to FILE (docs/search.md)")
    p.add_argument("--verify", action="store_true",
                   help="also run the same plan at tiny sizes through the simulator (needs numpy)")
    p.add_argument("--auto", action="store_true",
                   help="search the shardings (an ILP over the rules' candidates, solved by HiGHS; needs highspy) "
                        "instead of a --strategy; --annotate pins are kept; minimises communication time, plus compute "
                        "time with --device")
    p.add_argument("--auto-time-limit", dest="auto_time_limit", metavar="SECONDS",
                   help="the --auto solver's time limit (default 60)")
    p.add_argument("--memory", metavar="SIZE",
                   help="memory per device the plan must fit in, e.g. 80GiB, 80GB (10^9 bytes), 512MiB or a byte "
                        "count (default: the --device's memory): the --auto search's cap; --devices rejects "
                        "configurations over it")
    p.add_argument("--explain", action="store_true",
                   help="--auto: per layer, what was chosen and what the best plan choosing otherwise there costs")
    add_pipeline_arguments(p)  # a pp mesh dim: --microbatches, --schedule, --virtual-stages, --stages, ...


def add_pipeline_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--microbatches", metavar="M",
                   help="pipeline (a pp mesh dim): microbatches per step (batch / M each; gradients accumulated)")
    p.add_argument("--schedule", help="pipeline schedule: gpipe, 1f1b (default), interleaved or zb-h1 (zero bubble: "
                                      "the weight gradients deferred into the bubble, Qi et al. 2023)")
    p.add_argument("--virtual-stages", dest="virtual_stages", metavar="V",
                   help="interleaved 1F1B: model chunks per device (default 2 with --schedule interleaved)")
    p.add_argument("--microbatch-group", dest="microbatch_group", metavar="N",
                   help="interleaved 1F1B: microbatches a model chunk runs in a row before the next chunk's (Megatron-"
                        "Core's --microbatch-group-size-per-virtual-pipeline-stage; default pp, depth-first; up to "
                        "--microbatches, breadth-first): a larger N holds more microbatches in flight and hides the "
                        "sends better")
    p.add_argument("--stages", metavar="N,N,...|auto",
                   help="layers per (virtual) stage, in order, e.g. 20,20,20,20 (default: an even split); the first "
                        "and the last may be 0 (Megatron-Core's embedding-only / loss-only stage: 0,20,20,0); auto: "
                        "the split whose slowest stage is fastest within each rank's memory (docs/pipeline.md)")


def _positive_seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return v


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=f"a preset ({', '.join(sorted(PRESETS))}) or a catalog model "
                                                        f"(spmdkit models); default tiny-llama")
    p.set_defaults(default_model="tiny-llama")
    p.add_argument("--model-config", dest="model_config", metavar="FILE|JSON",
                   help="a decoder of your own instead of a preset (the fields of spmdkit plan --model-config)")
    p.add_argument("--program", help="run a program JSON file (docs/graph.md) instead of a preset; its annotations "
                                      "come from --annotate")
    p.add_argument("--hf", metavar="CLASS", help="run a HuggingFace transformers model (e.g. LlamaForCausalLM) built "
                                                 "from --hf-config, on its own weights (needs spmdkit[hf])")
    p.add_argument("--hf-config", metavar="FILE|JSON", help="the --hf model's config: a config.json path or a JSON "
                                                            "object")
    p.add_argument("--dtype", help="the --hf model's dtype (float32, float64, bfloat16, float16; default float32)")
    p.add_argument("--fallback", choices=("replicate",), help="--hf: an ATen op with no lowering becomes a replicated op (every input and output replicated, its backward too; torch runs it), named in a warning at the top of the report; default: refused")
    _add_vocab_argument(p)
    p.add_argument("--pad", type=int, help="--hf: padded positions (attention mask 0) at the end of the batch's last "
                                           "row (default 0)")
    p.add_argument("--mesh", default="dp=2,tp=2", help="named mesh dims, e.g. dp=2,tp=2 (default)")
    p.add_argument("--strategy", help="comma list of dp, megatron (tp), sp, ep (MoE experts over an ep mesh dim; etp=1: "
                                      "over ep x tp, each whole; ep-from=cp: ep carved from the cp ranks), cp "
                                      "(the sequence over a cp mesh dim), zero1, zero2 "
                                      "(zero), zero3 (fsdp); default megatron (--program: none, its --annotate pins alone)")
    _add_cp_arguments(p)
    p.add_argument("--tp-plan", metavar="FILE|JSON",
                   help='megatron for --hf / --program: module-name patterns -> column, row, vocab or replicate, '
                        'e.g. \'{"*.k_proj": "replicate"}\' (docs/torch.md)')
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument("--batch", type=int, help=f"override the preset's batch size (--hf: default {HF_BATCH})")
    p.add_argument("--seq", type=int, help=f"override the preset's sequence length (--hf: default {HF_SEQ})")
    p.add_argument("--annotate", action="append", default=[], metavar="TENSOR=DIMS_MAPPING",
                   help='pin a tensor, e.g. --annotate "tokens=[0,-1]" (repeatable)')
    p.add_argument("--nproc", type=int,
                   help="start this many local processes (default: the mesh size); ignored under torchrun")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"),
                   help="torch.distributed backend (auto: nccl where GPUs exist, else gloo)")
    p.add_argument("--seed", type=int, default=0, help="seed of the step's data and parameters")
    p.add_argument("--kernels", choices=("numpy", "torch"), default="torch",
                   help="what each rank computes with: torch's ops in the program's dtypes (default: a real "
                        "training step, checked against a single-process torch step within each dtype's "
                        "tolerance; docs/torch.md) or spmdkit's numpy references in float64 (exact checks)")
    p.add_argument("--warmup", type=int, metavar="N", default=0,
                   help="untimed steps before the timed, checked one (default 0: the times then include torch's "
                        "first-call initialisation of its kernels, and the report says so; 1 for times to set "
                        "beside the prediction)")
    p.add_argument("--device", metavar="NAME|FILE",
                   help="the plan's prediction of the step's time on this GPU (a preset: a100-40gb, a100-80gb, "
                        "h100, h200, or a JSON file), printed beside the measured time; default: this GPU's "
                        "preset, else h100")
    p.add_argument("--json", action="store_true", help="print rank 0's report as JSON")
    p.add_argument("--timeout", type=_positive_seconds, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help="the longest any rendezvous, process group or collective may wait; a rank that "
                        "waits longer fails and the run ends (default %(default)g)")
    p.add_argument("--engine", choices=("spmdkit", "torch"), default="spmdkit",
                   help="spmdkit (default): the plan executed op by op by spmdkit's executor, every tensor "
                        "checked; torch: the plan exported for torch (--export torch) applied to the --hf model "
                        "with torch's own APIs (DTensor styles, FSDP2, pipelining), trained --steps steps under "
                        "torchrun, losses against torch eager and collectives against the plan's (docs/export.md)")
    p.add_argument("--steps", type=int, help="--engine torch: training steps (default 3)")
    p.add_argument("--optimizer", choices=("sgd", "adamw"), help="--engine torch: the optimizer (default sgd)")
    p.add_argument("--lr", type=float, help="--engine torch: the learning rate (default 0.01)")
    p.add_argument("--torch-plan", dest="torch_plan", metavar="FILE",
                   help="--engine torch: run this export (spmdkit plan ... --export torch FILE) instead of "
                        "planning --mesh / --strategy here; a pipeline (pp) plan needs it")


__all__ = ["DEFAULT_MESH", "DEFAULT_TIMEOUT", "HF_BATCH", "HF_SEQ",
           "Links", "ModelArgs", "Outputs", "PipelineArgs", "PlanRequest", "RunRequest", "SearchArgs",
           "add_pipeline_arguments", "add_plan_arguments", "add_run_arguments", "plan_request", "run_request"]
