"""The search's best recipe as what people launch (``spmdkit plan --devices N --export-recipe
KIND FILE``): a torchtitan job config (TOML: ``[parallelism]`` degrees, ``[training]`` batch and
sequence, ``[activation_checkpoint]``), Megatron-LM's command-line arguments, or JSON.

The batch: ``global`` sequences per optimizer step; a micro-batch is the sequences one
data-parallel rank (``dp x ep``, ``dp`` alone with ``ep-from=cp``; cp ranks share theirs) runs in
one forward/backward: with a
pipeline ``global / (microbatches x dp)``, without one ``global / (grad_accum x dp)``. ZeRO, as
the plan models each framework (docs/devices.md, "Gradient accumulation under ZeRO"): Megatron-LM's
1 is its distributed optimizer (``--use-distributed-optimizer``: the gradients accumulated whole,
reduced once a step), 2 and 3 Megatron-FSDP (``--use-megatron-fsdp
--data-parallel-sharding-strategy optim_grads`` / ``optim_grads_params``, with the
``--ckpt-format fsdp_dtensor`` it requires and ``--init-model-with-meta-device``: the gradients
held at their shard, reduce-scattered in every microbatch's backward); torchtitan's FSDP
(``data_parallel_shard_degree``) for 1-3 (FSDP2 shards whatever the level, so a ZeRO-1 / 2
recipe is exported as FSDP there, which holds less, never more; its data-parallel degree is the
batch ranks, ``dp x ep`` where ep is carved from dp, whose ranks torchtitan's expert group borrows
from ``data_parallel_shard_degree``, so such a plan without ZeRO is written as FSDP too, with a
warning). The frameworks' context-parallel
degree is the ranks a sequence is split over (``cp x ep`` with ``ep-from=cp``: Megatron-Core and
torchtitan carve the expert group from them), their expert-parallel degree the expert group
(``ep x tp`` under ETP = 1, written with ``--expert-tensor-parallel-size 1`` /
``expert_tensor_parallel_degree = 1``); context parallelism's attention as Megatron-LM's ``--cp-comm-type``
and torchtitan's ``context_parallel_rotate_method`` (:data:`MEGATRON_CP`, :data:`TORCHTITAN_CP`).
Recomputation ``full:K`` (the first K layers of each pipeline stage, the search's least K that
fits: :mod:`spmdkit.planner.search_blocks`) is Megatron-LM's ``--recompute-granularity full
--recompute-method block --recompute-num-layers K``; torchtitan's ``[activation_checkpoint]``
has no count of layers per stage, so it is written as ``mode = "full"`` (every layer: it holds
less and runs slower than predicted) with a warning (:func:`recipe_warning`). ``every:N`` (every
N-th block of each pipeline rank) is torchtitan's ``mode = "selective"``, ``selective_ac_option =
"N"`` (9dec370 ``torchtitan/config_manager.py``, to 114151ad4, which removed it); Megatron-LM has
no such method (``--recompute-method uniform|block``), so its arguments say full recomputation
(``--recompute-method uniform --recompute-num-layers 1``: less memory, a slower step) with a warning.
Standard library only.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.cost.memory import recompute_every, recompute_layers
from spmdkit.io.atomic import output_problem, write_atomic
from spmdkit.planner.pipeline import PipelineEstimate
from spmdkit.planner.pipeline_split import megatron_layout
from spmdkit.planner.search_config import Candidate
from spmdkit.strategies.context import options as cp_options
from spmdkit.strategies.strategy import zero_stage

KINDS = ("torchtitan", "megatron", "json")
#: ZeRO level -> Megatron-FSDP's ``--data-parallel-sharding-strategy`` (the gradients sharded, and
#: the parameters too); ZeRO-1 is Megatron-Core's distributed optimizer, not Megatron-FSDP's ``optim``
MEGATRON_FSDP = {2: "optim_grads", 3: "optim_grads_params"}


def _zero(strategy: str) -> int:
    return zero_stage(p.strip() for p in strategy.split(","))


def recipe(c: Candidate, model: str, global_batch: int, seq: int, layers: int) -> dict[str, Any]:
    """The recipe's figures: degrees, batch, recomputation, ZeRO level, the prediction."""
    cf = c.config
    ranks = cf.batch_ranks  # dp x ep (dp alone with ep-from=cp)
    steps = cf.microbatches if cf.pp > 1 else cf.grad_accum
    micro = global_batch // (steps * ranks)
    parts = cf.strategy.split(",")
    etp1 = "etp=1" in parts and cf.tp > 1
    return {"model": model, "devices": cf.devices, "dp": cf.dp, "tp": cf.tp, "pp": cf.pp, "cp": cf.cp, "ep": cf.ep,
            # the frameworks' degrees: CP the ranks a sequence is split over (cp x ep with ep-from=cp:
            # the expert group carved from them), EP the expert group (ep x tp under ETP = 1)
            "ep_from_cp": cf.ep_from_cp, "context_parallel": cf.cp * (cf.ep if cf.ep_from_cp else 1),
            "expert_parallel": cf.ep * (cf.tp if etp1 else 1), "expert_tensor_parallel": 1 if etp1 else cf.tp,
            "sequence_parallel": "sp" in parts, "zero": _zero(cf.strategy), "strategy": cf.strategy,
            **({"cp_attention": cp_options(parts)[0]} if "cp" in parts else {}),
            "recompute": cf.recompute, "recompute_num_layers": recompute_layers(cf.recompute),
            **({"recompute_every": n} if (n := recompute_every(cf.recompute)) is not None else {}),
            "global_batch": global_batch, "micro_batch": micro, "seq": seq,
            "layers": layers, "microbatches": cf.microbatches if cf.pp > 1 else None,
            "grad_accum": cf.grad_accum if cf.pp == 1 else None,
            "schedule": ("Interleaved1F1B" if cf.virtual > 1 else "1F1B") if cf.pp > 1 else None,
            "virtual_stages": cf.virtual if cf.pp > 1 else None,
            # the split the plan priced, layers per (virtual) stage in Megatron-Core's order (chunk x pp + rank)
            "layers_per_stage": list(c.estimate.counts) if isinstance(c.estimate, PipelineEstimate) else None,
            "precision": _precision(c),
            # the overlaps the step was priced with (docs/devices.md, "Overlaps")
            "grad_overlap": c.plan.runtime.grad_overlap, "tp_comm_overlap": c.plan.runtime.tp_comm_overlap,
            "compile": bool(c.plan.runtime.compile),
            **({"float8": f8} if (f8 := _float8(c)) is not None else {}),
            "predicted": {"step_s": c.step_s, "mfu": c.mfu, "memory_per_device": c.memory,
                          "tokens_per_s": global_batch * seq / c.step_s if c.step_s > 0 else None}}


#: spmdkit's --cp-attention -> Megatron-LM's --cp-comm-type (d98e8a64dd megatron/training/arguments.py, default
#: p2p; Transformer Engine's context_parallel takes all_gather, p2p, a2a): the all-gather of K and V, the ring of
#: KV blocks, DeepSpeed-Ulysses' head / sequence all-to-all
MEGATRON_CP = {"allgather": "all_gather", "ring": "p2p", "alltoall": "a2a"}
#: spmdkit's --cp-attention -> torchtitan 820504e's Parallelism.context_parallel_rotate_method (torch's
#: context_parallel: "allgather" gathers K and V once, "alltoall" passes each KV block round the ring by an
#: all-to-all; docs/context.md); Ulysses has no torchtitan form
TORCHTITAN_CP = {"allgather": "allgather", "ring": "alltoall"}


#: a parameter dtype -> the precision the plan trains in (its --precision where given)
_PRECISIONS = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def _precision(c: Candidate) -> str:
    """What the plan's linear layers compute in: ``--precision`` where given, else the dtype most of
    the program's parameters have (:meth:`spmdkit.program.ir.Program.param_dtype`, as the step's peak rate)."""
    rt = c.plan.runtime
    if rt.precision is not None:
        return rt.precision
    return _PRECISIONS.get(c.plan.program.param_dtype() or "float32", "fp32")


def _float8(c: Candidate) -> dict[str, Any] | None:
    """torchtitan's ``[float8]`` for a plan priced with torchao's float8 linears (``--precision fp8
    --framework torchtitan``), None otherwise: the output head left in bf16 (``filter_fqns``, as the
    planner keeps it); the rowwise recipe by ``recipe_name`` (torchtitan 820504e
    ``components/quantization/float8.py``: ``Float8LinearConfig.from_recipe_name``); tensorwise by
    none, torchtitan's default, since a ``recipe_name`` asserts ``enable_fsdp_float8_all_gather`` off
    (``--fsdp-float8-all-gather`` writes it and ``precompute_float8_dynamic_scale_for_fsdp`` on)."""
    rt = c.plan.runtime
    if not (rt.fp8 and rt.framework == "torchtitan"):
        return None
    out: dict[str, Any] = {"enable_fsdp_float8_all_gather": rt.fsdp_float8_all_gather,
                           "precompute_float8_dynamic_scale_for_fsdp": rt.fsdp_float8_all_gather}
    if rt.float8_recipe not in (None, "tensorwise"):
        out["recipe_name"] = rt.float8_recipe
    return {**out, "filter_fqns": ["output"]}


def _toml(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))


def _torchtitan_ac(r: dict[str, Any]) -> dict[str, Any]:
    """torchtitan's ``[activation_checkpoint]`` for the recipe's recomputation: ``full:K`` has no
    torchtitan form (no count of layers per stage): every layer (:func:`recipe_warning`);
    ``every:N`` is the layer-frequency option (torchtitan 9dec370 ``_apply_ac_to_transformer_block``:
    ``selective_ac_option.isdigit()``), ``selective`` the op-level one."""
    if r.get("recompute_num_layers"):
        return {"mode": "full"}
    if r.get("recompute_every"):
        return {"mode": "selective", "selective_ac_option": str(r["recompute_every"])}
    return {"mode": r["recompute"], **({"selective_ac_option": "op"} if r["recompute"] == "selective" else {})}


def _torchtitan_split_points(r: dict[str, Any]) -> list[str]:
    """The FQNs (``layers.N``) beginning each (virtual) stage but the first, in stage order (torchtitan's
    stage ``i`` is virtual stage ``i // pp`` of rank ``i % pp``, as the planner counts them)."""
    counts = r.get("layers_per_stage") or []
    starts = list(itertools.accumulate(counts))[:-1]
    return [f"layers.{n}" for n in starts]


def _torchtitan_fsdp(r: dict[str, Any]) -> bool:
    """Whether the torchtitan recipe shards over more than one data-parallel rank (FSDP applied)."""
    ep_dp = r["ep"] > 1 and not r["ep_from_cp"]
    return (r["zero"] >= 1 or ep_dp) and r["dp"] * (r["ep"] if ep_dp else 1) > 1


def torchtitan_toml(r: dict[str, Any]) -> str:
    """A torchtitan job config's sections for the recipe (``--job.config_file``)."""
    # torchtitan's data-parallel degrees hold the batch ranks, dp x ep where ep is carved from dp: its
    # expert group borrows them (ParallelDims._validate: dp_replicate x dp_shard x cp x tp x pp is the world,
    # ep divides dp_shard x cp x tp), so such a plan is written as FSDP (recipe_warning says so without ZeRO)
    ep_dp = r["ep"] > 1 and not r["ep_from_cp"]
    ranks = r["dp"] * (r["ep"] if ep_dp else 1)
    fsdp = r["zero"] >= 1 or ep_dp
    sections: dict[str, dict[str, Any]] = {
        "job": {"description": f"{r['model']} on {r['devices']} GPUs: spmdkit plan --devices "
                               f"{r['devices']} (predicted {r['predicted']['step_s']:.4g} s a step)"},
        # local_batch_size: a rank's sequences a forward (torchtitan accumulates up to global_batch_size), or
        # with a pipeline its share of the step, split into pipeline_parallel_microbatch_size microbatches
        "training": {"global_batch_size": r["global_batch"],
                     "local_batch_size": r["micro_batch"] * (r["microbatches"] if r["pp"] > 1 else 1),
                     "seq_len": r["seq"]},
        "parallelism": {"data_parallel_replicate_degree": 1 if fsdp else ranks,
                        "data_parallel_shard_degree": ranks if fsdp else 1,
                        "tensor_parallel_degree": r["tp"], "context_parallel_degree": r["context_parallel"],
                        "pipeline_parallel_degree": r["pp"], "expert_parallel_degree": r["expert_parallel"],
                        **({"context_parallel_rotate_method": TORCHTITAN_CP.get(r["cp_attention"], "allgather")}
                           if r["context_parallel"] > 1 and r.get("cp_attention") else {}),
                        **({"expert_tensor_parallel_degree": 1} if r["expert_tensor_parallel"] == 1 < r["tp"]
                           and r["ep"] > 1 else {})},
        "activation_checkpoint": _torchtitan_ac(r),
    }
    # the precision the plan was priced in: FSDP's param_dtype (820504e torchtitan/config_manager.py
    # Training.mixed_precision_param, "bfloat16" or "float32"; fp8's linears run beside bf16 ones)
    prec = r.get("precision", "fp32")
    sections["training"]["mixed_precision_param"] = "float32" if prec == "fp32" else "bfloat16"
    if r.get("compile"):  # the blocks priced compiled (--compile; 820504e Training.compile, off by default)
        sections["training"]["compile"] = True
    if r.get("tp_comm_overlap") and r["tp"] > 1:  # torch's async TP (Parallelism.enable_async_tensor_parallel)
        sections["parallelism"]["enable_async_tensor_parallel"] = True
    if r.get("float8"):  # torchao's float8 linears: the converter and its [float8] section
        sections["model"] = {"converters": ["float8"]}
        sections["float8"] = r["float8"]
    if r["pp"] > 1:
        # Interleaved1F1B: torchtitan's looped schedules hold 2 stages a rank unless told otherwise
        sections["parallelism"].update({"pipeline_parallel_schedule": r["schedule"],
                                        "pipeline_parallel_microbatch_size": r["micro_batch"]})
        # the split the plan priced, as the first layer of each stage after the first (820504e
        # Parallelism.pipeline_parallel_split_points): torchtitan's own (generate_split_points) counts the
        # embedding and the head as a layer each and gives a looped schedule 2 stages a rank
        if points := _torchtitan_split_points(r):
            sections["parallelism"]["pipeline_parallel_split_points"] = points
    out = []
    for name, kv in sections.items():
        out.append(f"[{name}]")
        out += [f"{k} = {_toml(v)}" for k, v in kv.items()]
        out.append("")
    return "\n".join(out)


def megatron_args(r: dict[str, Any]) -> str:
    """Megatron-LM's (``pretrain_gpt.py``) parallelism, batch and recomputation arguments."""
    args = [f"--tensor-model-parallel-size {r['tp']}", f"--pipeline-model-parallel-size {r['pp']}",
            f"--context-parallel-size {r['context_parallel']}", f"--expert-model-parallel-size {r['expert_parallel']}",
            f"--micro-batch-size {r['micro_batch']}", f"--global-batch-size {r['global_batch']}",
            f"--seq-length {r['seq']}", f"--num-layers {r['layers']}"]
    # the precision the plan was priced in: Megatron-LM trains in fp32 without --bf16 / --fp16
    # (d98e8a64dd megatron/core/model_parallel_config.py: bf16 = False); fp8 as its Llama 3 example runs it
    # (examples/llama/train_llama3_8b_h100_fp8.sh: --bf16 with --fp8-format hybrid)
    prec = r.get("precision", "fp32")
    args += {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp8": ["--bf16", "--fp8-format hybrid"]}.get(prec, [])
    if r["context_parallel"] > 1 and r.get("cp_attention"):  # Megatron-LM's default is p2p, the ring
        args.append(f"--cp-comm-type {MEGATRON_CP[r['cp_attention']]}")
    if r["ep"] > 1 and r["expert_tensor_parallel"] == 1 < r["tp"]:  # ETP = 1: each expert whole
        args.append("--expert-tensor-parallel-size 1")
    # Megatron-Core's --pipeline-model-parallel-layout for the recipe's split (None for an even one;
    # it sets the virtual stages too: Megatron-LM takes one of the two)
    layout = megatron_layout(r.get("layers_per_stage") or [])
    if layout is not None:
        args.append(f"--pipeline-model-parallel-layout '{layout}'")
    elif r.get("virtual_stages") and r["virtual_stages"] > 1:
        args.append(f"--num-virtual-stages-per-pipeline-rank {r['virtual_stages']}")
    if r["sequence_parallel"]:
        args.append("--sequence-parallel")
    if r.get("tp_comm_overlap") and r["tp"] > 1:  # Transformer Engine's userbuffers overlap (off by default)
        args.append("--tp-comm-overlap")
    if r.get("grad_overlap", True) and r["zero"] <= 1 and r["devices"] // (r["tp"] * r["pp"]) > 1:
        # the step was priced with the gradient buckets reduced under the backward and (the distributed optimizer)
        # the parameters gathered under the next forward: both off by default in Megatron-LM (d98e8a64dd
        # arguments.py: --overlap-grad-reduce and --overlap-param-gather, store_true); Megatron-FSDP turns them on
        args.append("--overlap-grad-reduce")
        if r["zero"] == 1:
            args.append("--overlap-param-gather")
    if r["zero"] >= 2:  # Megatron-FSDP (megatron/training/arguments.py; megatron/core/distributed/README.md)
        args += ["--use-megatron-fsdp", f"--data-parallel-sharding-strategy {MEGATRON_FSDP[r['zero']]}",
                 "--ckpt-format fsdp_dtensor", "--init-model-with-meta-device"]
    elif r["zero"] == 1:
        args.append("--use-distributed-optimizer")
    if r["recompute"] == "selective":
        args.append("--recompute-granularity selective")
    elif r["recompute"] == "full":
        args += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    elif r.get("recompute_num_layers"):  # full:K: the first K layers of each stage (of each model chunk)
        args += ["--recompute-granularity full", "--recompute-method block",
                 f"--recompute-num-layers {r['recompute_num_layers']}"]
    elif r.get("recompute_every"):  # every:N has no Megatron-LM form: every layer (recipe_warning)
        args += ["--recompute-granularity full", "--recompute-method uniform", "--recompute-num-layers 1"]
    return " \\\n".join(args) + "\n"


def recipe_warning(kind: str, r: dict[str, Any]) -> str | None:
    """The one line saying what ``kind`` writes for what it cannot express (None: all of it)."""
    if kind == "torchtitan" and r["zero"] == 0 and r["ep"] > 1 and not r["ep_from_cp"]:
        return (f"--export-recipe torchtitan: expert parallelism borrows its {r['ep']} ranks from "
                f"data_parallel_shard_degree (torchtitan's ParallelDims: ep divides dp_shard x cp x tp), so the "
                f"plan's data parallelism without ZeRO ({r['strategy']}) is written as FSDP: less memory than the "
                f"plan's, another step than the {r['predicted']['step_s']:.4g} s predicted")
    k = r.get("recompute_num_layers")
    if kind == "torchtitan" and k:
        return (f"--export-recipe torchtitan: recompute {r['recompute']} (full recomputation of the first {k} layers "
                f"of each pipeline stage) has no [activation_checkpoint] option (its mode has no count of layers); "
                f"written as mode = \"full\" (every layer: less memory, a slower step than the "
                f"{r['predicted']['step_s']:.4g} s predicted)")
    if kind == "torchtitan" and r["context_parallel"] > 1 and r.get("cp_attention") == "alltoall":
        return ("--export-recipe torchtitan: cp attention alltoall (DeepSpeed-Ulysses' head / sequence all-to-all) "
                "has no torchtitan form (torch's context_parallel rotates K and V round the ring); written as "
                "context_parallel_rotate_method = \"allgather\" (another step than the "
                f"{r['predicted']['step_s']:.4g} s predicted)")
    prec = r.get("precision", "fp32")
    if kind == "torchtitan" and prec == "fp16":
        return ("--export-recipe torchtitan: precision fp16 has no torchtitan form (mixed_precision_param is "
                "bfloat16 or float32); written as bfloat16")
    if kind == "torchtitan" and prec != "fp32" and not _torchtitan_fsdp(r) and r["context_parallel"] == 1:
        return (f"--export-recipe torchtitan: mixed_precision_param takes effect only under FSDP (torchtitan's "
                f"parallelize applies it as FSDP's param_dtype, with data_parallel_shard_degree > 1 or context "
                f"parallelism); without either this recipe trains in float32, not the {prec} the "
                f"{r['predicted']['step_s']:.4g} s predicted were priced in")
    n = r.get("recompute_every")
    if kind == "megatron" and n:
        return (f"--export-recipe megatron: recompute {r['recompute']} (torchtitan's checkpoint of blocks {n}, {2 * n}, ... of "
                f"each pipeline rank) has no Megatron-LM form (--recompute-method is uniform or block); written as --recompute-granularity "
                f"full --recompute-method uniform --recompute-num-layers 1 (every layer: less memory, a slower step "
                f"than the {r['predicted']['step_s']:.4g} s predicted)")
    return None


def write_recipe(kind: str, path: str, r: dict[str, Any]) -> None:
    """``r`` written to ``path`` as ``kind`` (whole or not at all)."""
    if kind == "torchtitan":
        text = torchtitan_toml(r)
    elif kind == "megatron":
        text = megatron_args(r)
    else:
        text = json.dumps(r, indent=2) + "\n"
    write_atomic(path, text.encode())


def check_recipe_target(kind: str, path: str) -> None:
    """``--export-recipe KIND FILE`` refused before the search when it cannot be written."""
    if kind not in KINDS:
        raise ProgramError(f"--export-recipe {kind[:40]!r}: one of {', '.join(KINDS)}")
    why = output_problem(path)
    if why is not None:
        raise ProgramError(f"--export-recipe {path[:200]!r}: {why}")


__all__ = ["KINDS", "MEGATRON_CP", "MEGATRON_FSDP", "TORCHTITAN_CP", "check_recipe_target", "megatron_args", "recipe", "recipe_warning", "torchtitan_toml",
           "write_recipe"]
