#!/usr/bin/env python3
"""Predicted vs measured: every published run of a runs file planned through the CLI, as a user
would type it, and compared in the source's own unit and FLOP definition.

    python benchmarks/fidelity.py [--runs FILE ...] [--only PREFIX[,PREFIX]] [--json OUT] [--show-argv] [--breakdown]
    python benchmarks/fidelity.py --runs benchmarks/data/moe-runs.json   # the MoE runs (expert parallelism)
    python benchmarks/fidelity.py --runs benchmarks/data/outside-runs.json   # out of sample (outside-runs.md)
    python benchmarks/fidelity.py --runs benchmarks/data/nemo-long-runs.json   # NeMo 24.03's cp table (nemo-long-runs.md)
    python benchmarks/fidelity.py --runs benchmarks/data/torchtitan-2025-runs.json   # torchtitan 2025: async TP, float8, H200

For each run: the command line (``spmdkit plan --model-config ... --mesh pp=..,dp=..,tp=..
--strategy ... --device ... --precision ... --recompute ... --json``), the prediction in the
unit the source measured, ``ratio = predicted / measured`` (speed: > 1 is optimistic), the
predicted peak memory and whether it fits, and the assumptions made for the fields the source
does not state. Runs the planner cannot express are counted by the missing feature.

Units, as the runs file's README says to compare them:

- ``tflops_per_gpu`` of Narayanan et al. (2021): their eq. 3, ``96 B s l h^2 (1 + s/(6h) +
  V/(16 l h))`` per iteration (it counts the recompute forward) over the predicted step;
- Korthikanti et al. (2022): ``step_time_s`` directly; ``mfu_pct`` by their eq. 7 (model FLOPs
  ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))``, 312 TFLOP/s peak); Table 4's one-layer forward and
  backward milliseconds as the difference of a 2-layer and a 1-layer plan, each the step as it
  overlaps its collectives less the optimizer;
- Megatron-LM (``tflops_per_gpu``): Megatron-Core's FLOP count
  (``megatron/training/training.py: num_floating_point_operations``);
- NeMo and torchtitan: ``tokens_per_sec_per_gpu`` (no FLOP definition needed); torchtitan's
  ``memory_gib_max`` against the predicted peak;
- the out-of-sample runs (``outside-runs.json``): BLOOM, MT-NLG and Megatron-LM's GPT-3 example by
  their stated iteration time (their TFLOP/s are eq. 3's, reproduced from it); Llama 3's TFLOP/s by
  Megatron-Core's count (Meta states none); NeMo 24.03's long-sequence table (``nemo-long-runs.json``) by
  its first version's ``tokens_per_sec_per_gpu`` (NVIDIA/NeMo 35029a0c84; its TFLOP/s are Megatron-Core's
  count, SwiGLU-wide and non-causal, to the rounding of every row).

The summary: median and 90th percentile of ``|ratio - 1|`` (speed), the share within 5% and 10%,
memory ratios where measured, runs that trained predicted to fit, and the pairwise order of the
configurations of one model (same model and GPU, different parallelism or recompute).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from spmdkit.cli import main as spmdkit_main
from spmdkit.core.errors import ProgramError
from spmdkit.cost.recompute_modules import recompute_modules
from spmdkit.engine.memo import gc_paused
from spmdkit.models.catalog import config_fields
from spmdkit.program.runtime import DISPATCHERS  # the MoE dispatchers --moe-dispatcher takes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity_foundry import FOUNDRY, foundry_argv
from fidelity_tables import RunsSection, run_table, runs_section
from fidelity_torchtitan import TORCHTITAN_2025, float8_recipe_flags, float8_unsupported, fsdp_float8_flags, loss_flags

#: the published runs (a copy of the team's shared calibration set; benchmarks/data/published-runs.md)
RUNS = Path(__file__).resolve().parent / "data" / "published-runs.json"
#: published MoE runs with expert parallelism (benchmarks/data/moe-runs.json, the same schema; a
#: row's ``model.moe.catalog`` names the spmdkit catalog entry with its shapes)
MOE_RUNS = Path(__file__).resolve().parent / "data" / "moe-runs.json"
#: published runs of the largest trainings (Llama 3 405B, BLOOM, MT-NLG, OPT) that nothing in the cost
#: model was calibrated on: an out-of-sample check (benchmarks/data/outside-runs.json, the same schema)
OUTSIDE_RUNS = Path(__file__).resolve().parent / "data" / "outside-runs.json"
#: NeMo 24.03.01's long-sequence table (Llama 2 7B fp8 on DGX-H100, 4K to 1024K tokens, cp 1 to 32): an
#: out-of-sample check of cp (benchmarks/data/nemo-long-runs.json, the same schema; nemo-long-runs.md)
NEMO_LONG_RUNS = Path(__file__).resolve().parent / "data" / "nemo-long-runs.json"

#: NeMo's later performance summaries (25.09 to 26.06, Megatron-Bridge's archive): the DGX-H100 pre-training
#: rows of the catalog's models, an out-of-sample check (benchmarks/data/nemo-runs.json, the same schema)
NEMO_RUNS = Path(__file__).resolve().parent / "data" / "nemo-runs.json"
#: runs Megatron-Bridge's maintainers measured in their pull requests (Qwen3-30B-A3B on 16 H100s, PR #3868): an
#: out-of-sample check (benchmarks/data/mbridge-runs.json, the same schema; mbridge-runs.md)
MBRIDGE_RUNS = Path(__file__).resolve().parent / "data" / "mbridge-runs.json"
GIB = 1024**3


#: run id prefixes of Megatron-LM of 2021 (before the async tp all-reduce, 2021-09, and gradient-accumulation
#: fusion, 2022-02): the sc21 runs and outside-runs.json's GPT-3 175B example of the README
MEGATRON_2021 = ("narayanan21", "megatron2021")
#: and of 2021-2022 (blocking pipeline sends, scatter-gather of pipeline tensors, the fused softmax)
MEGATRON_OLD = (*MEGATRON_2021, "korthikanti22")

#: architectures (a phrase of a row's ``model.arch``) the planner cannot build, and the feature named
MISSING_ARCH: dict[str, str] = {}


class Unsupported(Exception):
    """A run the planner cannot express: the message names the missing feature."""


@dataclass
class Case:
    """One run made a command line: the argv, what it measures, the assumptions made."""

    row: dict[str, Any]
    argv: list[str]
    metric: str
    measured: float
    assumptions: list[str] = field(default_factory=list)
    #: Table 4: the same command at 2 layers (the layer's time is the difference)
    argv2: list[str] | None = None
    gpus: int = 0
    memory_measured_gib: float | None = None
    device_memory_gib: float = 80.0
    #: what the GPU must hold, predicted (Memory.device_total), set by predict
    device_need_gib: float = 0.0
    #: where the predicted step goes (:func:`breakdown`), set by predict
    breakdown: dict[str, float] = field(default_factory=dict)


# -- a run as a command line ------------------------------------------------------------------------


def _device(row: dict[str, Any], tmp: Path) -> tuple[str, float]:
    """The --device for the run's GPU, and its memory in GiB."""
    gpu = str(row["hardware"]["gpu"])
    if gpu.startswith("A100"):
        return ("a100-80gb" if "80" in gpu else "a100-40gb"), (80.0 if "80" in gpu else 40.0)
    if "96GB" in gpu:  # torchtitan's H100s: 96 GB HBM2e at 2.4 TB/s, 500 W
        f = tmp / "h100-96gb-hbm2e.json"
        dev: dict[str, Any] = {"base": "h100", "name": "H100 SXM 96GB HBM2e (torchtitan's)",
                               "memory_gb": 96 * GIB / 1e9, "hbm_gb_per_s": 2400}
        watts = re.search(r"at (\d+) W power limit", gpu)
        if watts:  # the sustained tensor-core clock under the cap (docs/devices.md, "Power limits")
            dev["power_limit_w"] = int(watts.group(1))
        f.write_text(json.dumps(dev))
        return str(f), 96.0
    if gpu.startswith("H100"):
        return "h100", 80.0
    if gpu.startswith("H200"):  # H200 SXM: 141 GB HBM3e (the h200 preset)
        return "h200", 141e9 / GIB
    raise Unsupported(f"GPU {gpu}")


#: the cuDNN each run's container ships, where a source says (docs/devices.md, "cuDNN's version"):
#: (id prefix, version, source). ``--device``'s ``efficiency.cudnn_version`` then picks the newest
#: measured version not newer (spmdkit.cost.rates.measured_cudnn_version); a run not listed takes
#: the presets' (cuDNN 9.1-9.3: Megatron-LM 2024, NeMo 24.07 on NGC 24.07's 9.2.1, TE's notebook
#: on 9.3.0; NeMo 24.03's 9.0.0 is older than any measured one)
CUDNN_VERSIONS = (
    ("megatron_moe_zoo_h100_bf16_qwen3_235b_seq", "9.11.0",
     "yanring/Megatron-MoE-ModelZoo dockers/Dockerfile at c1ad0b5 (the long-context table's b0b92ff, 2025-11-04): "
     "pytorch:25.06-py3 with cudnn9.11.0.92 copied over its 9.10.2"),
    ("megatron_moe_zoo_h100_bf16_qwen3_next", "9.11.0",
     "yanring/Megatron-MoE-ModelZoo dockers/Dockerfile at b0b92ff (2025-11-04, the commit that added the Qwen3-Next "
     "row): pytorch:25.06-py3 with cudnn9.11.0.92 copied over its 9.10.2"),
    ("megatron_moe_zoo", "9.7.1",
     "yanring/Megatron-MoE-ModelZoo dockers/Dockerfile at 8017e11 (the 4k table, 2025-05-27): pytorch:25.02-py3, "
     "cuDNN 9.7.1 by NGC's release notes (not in the mirrors; any version from 9.4.0 on takes the same rates)"),
    ("nemo2509", "9.13.1", "NGC pytorch:25.09-py3 (Megatron-Bridge's base image; cudnn-frontend bb37575 README: 9.13.1)"),
    ("nemo2511", "9.17.0", "NGC pytorch:25.11-py3 (cudnn-frontend d48a60e README: 9.17.0)"),
    ("nemo26", "9.17.0", "NGC pytorch:26.02-26.06 (Megatron-Bridge docker/Dockerfile.ci BASE_IMAGE): at least 25.11's 9.17.0"),
)


def _cudnn_version(row: dict[str, Any]) -> tuple[str, str] | None:
    """(version, source) of the cuDNN the run ran, where :data:`CUDNN_VERSIONS` knows it."""
    rid = str(row["id"])
    return next(((v, src) for pre, v, src in CUDNN_VERSIONS if rid.startswith(pre)), None)


def _h100_cudnn(row: dict[str, Any], tmp: Path, assume: list[str]) -> str:
    """``h100``, or a device file of it with the run's cuDNN version (:data:`CUDNN_VERSIONS`)."""
    got = _cudnn_version(row)
    if got is None:
        return "h100"
    version, src = got
    assume.append(f"cuDNN {version} ({src}): the attention rates of cudnn-frontend's newest measured version not newer")
    f = tmp / f"h100-cudnn-{version}.json"
    f.write_text(json.dumps({"base": "h100", "efficiency": {"cudnn_version": version}}))
    return str(f)


def _arch(row: dict[str, Any]) -> dict[str, Any]:
    m = row["model"]
    arch = str(m.get("arch") or "")
    name = str(m.get("name") or "")
    llama = "Llama" in name or "Llama" in arch or "Nemotron" in arch or "RoPE" in arch
    out: dict[str, Any] = {"arch": "llama" if llama else "gpt2"}
    if "squared-ReLU" in arch or "squared ReLU" in arch:
        out["activation"] = "squared_relu"
    elif "SwiGLU" in arch or "Llama" in name:
        out["activation"] = "swiglu"
    else:
        out["activation"] = "gelu"
    # the attention kernel: Megatron-LM of 2021-2022 materialised the scores (fused softmax);
    # Megatron-Core, NeMo and torchtitan run flash attention
    # (and Megatron-DeepSpeed's BLOOM and MT-NLG: its fused scale-mask-softmax, ALiBi's bias in it)
    old = row["id"].startswith((*MEGATRON_OLD, "bloom", "mtnlg"))
    out["attention"] = "eager" if old and not llama else "flash"
    return out


def _precision(row: dict[str, Any]) -> str:
    p = str(row.get("precision") or "").lower()
    if "fp8" in p or "float8" in p:
        return "fp8"
    return "fp16" if p.startswith("fp16") else "bf16"


def _strategy(row: dict[str, Any], assume: list[str]) -> tuple[str, str]:
    """(--strategy, --framework)."""
    par = row["parallelism"]
    parts = ["dp"]
    if par["tp"] > 1:
        parts.append("megatron")
    sp = par.get("sequence_parallel")
    if sp is None and par["tp"] > 1 and not row["id"].startswith("narayanan21"):
        sp = True
        assume.append("sequence parallel (not stated; the framework's default with tp > 1)")
    if sp and par["tp"] > 1:
        parts.append("sp")
    zero = str(par.get("zero") or "none")
    framework = "megatron"
    if zero.startswith("FSDP"):  # FSDP's SHARD_GRAD_OP keeps the parameters whole between forward and backward
        parts.append("zero2" if "SHARD_GRAD_OP" in zero else "zero3")
        framework = str(row.get("framework") or "torchtitan")  # a stated FSDP2 framework (AutoModel's)
    elif "distributed optimizer" in zero.lower() or zero.startswith("ZeRO-1"):
        parts.append("zero1")
    elif zero.startswith("ZeRO-2"):  # Llama 3's FSDP without resharding after forward
        parts.append("zero2")
    elif par.get("zero") is None and row["id"].startswith(("megatronlm", "nemo")):
        parts.append("zero1")
        assume.append("distributed optimizer (not stated; Megatron-Core / NeMo performance configs use it)")
    return ",".join(parts), framework


def _recompute(row: dict[str, Any], assume: list[str]) -> str:
    rc = row.get("recompute")
    if rc is None:
        assume.append("no activation recomputation (not stated)")
        return "none"
    rc = str(rc)
    if rc.startswith("selective:"):  # Megatron-Core's --recompute-modules: --recompute selective:M1,M2
        mode = "selective:" + ",".join(m.strip() for m in rc.split(":", 1)[1].split(","))
        try:
            recompute_modules(mode)
        except ProgramError as e:
            raise Unsupported(f"recompute modules ({rc.split(':', 1)[1].strip()}): {e}") from None
        return mode
    if rc.startswith("selective"):
        if "microbatch-level" in rc:
            return "microbatch"  # Korthikanti App. C: --recompute microbatch (a pipeline's mode)
        return "selective"
    if rc in ("full", "none"):
        return rc
    if re.fullmatch(r"full:\d+", rc):  # Megatron's --recompute-method block --recompute-num-layers K
        return rc  # the first K layers of each pipeline stage, of the model without a pipeline
    raise Unsupported(f"recompute {rc!r}")


def _with_cp(strategy: str, attention: str) -> str:
    """``--strategy`` with ``cp`` after the tensor-parallel parts (before ZeRO) and the cp attention
    variant as its item (what ``--cp-attention`` adds)."""
    parts = strategy.split(",")
    at = next((k for k, p in enumerate(parts) if p.startswith("zero")), len(parts))
    return ",".join([*parts[:at], "cp", *parts[at:], f"cp-attention={attention}"])


def _cp_attention(row: dict[str, Any], framework: str, assume: list[str]) -> str:
    """The cp attention the source ran (``--cp-attention``). torchtitan of 2024-12 (9dec370) calls
    torch's ``context_parallel``, whose ``_cp_options.rotate_method`` defaults to
    ``_RotateMethod.ALL_GATHER`` (torch/distributed/tensor/experimental/_attention.py): K and V
    all-gathered once, asynchronously under the local block, dK / dV passed back round a ring
    in fp32; load-balanced (zig-zag: ``_cp_options.enable_load_balance`` is True by default, its
    ``_RoundRobinLoadBalancer`` giving rank ``i`` chunks ``i`` and ``2cp-1-i``; torchtitan 9dec370
    leaves it). NeMo 24.07 (Megatron-Core 0.8, before its ``cp_comm_type``
    option) runs Transformer Engine's default, the p2p ring: KV blocks sent peer to peer under
    the block computations, load-balanced. A row's ``parallelism.cp_attention`` is taken as it
    stands (its ``inferences`` give the source)."""
    stated = row["parallelism"].get("cp_attention")
    if stated:  # the row's own (its inferences say from where)
        return str(stated)
    if framework == "torchtitan":
        assume.append("cp attention: torch context_parallel's all-gather rotation (its default, "
                      "_RotateMethod.ALL_GATHER), zig-zag balanced")
        return "allgather"
    assume.append("cp attention: Transformer Engine's p2p ring (its default; Megatron-Core 0.8 has no "
                  "cp_comm_type), zig-zag balanced")
    return "ring"


#: NeMo 24.07's runs of the performance summary used the NeMo 1.0 launcher's training configs
#: (NVIDIA/NeMo-Framework-Launcher launcher_scripts/conf/training/{gpt3,llama,nemotron}/*.yaml at
#: 1ab2c781, August 2024): per model, ``ub_tp_comm_overlap`` (Transformer Engine's userbuffers TP
#: overlap: ``--tp-comm-overlap``), ``hidden_dropout`` / ``attention_dropout`` and
#: ``cross_entropy_loss_fusion`` (absent: Megatron-Core's default, off)
NEMO_LAUNCHER = {"gpt3_5b": (False, 0.1, False), "gpt3_20b": (True, 0.1, False), "gpt3_175b": (False, 0.1, False),
                 "llama2_7b": (False, 0.0, True), "llama2_13b": (False, 0.0, True), "llama2_70b": (True, 0.0, True),
                 "nemotron_8b": (True, 0.0, True), "nemotron_22b": (True, 0.0, True),
                 "nemotron_340b": (False, 0.0, False), "llama3_8b": (False, 0.0, True),
                 "llama3_70b": (True, 0.0, True)}

#: The NeMo 24.07 runs whose launcher config is not their model's yaml (same fields as
#: :data:`NEMO_LAUNCHER`). GPT-3 175B on 512 GPUs (GBS 2048, MBS 2, TP 4, PP 8, VP 6, fp8; the
#: table's TFLOP/s cell links to MLCommons) is ``gpt3/175b_mlperf.yaml`` (at 1ab2c781: 64 nodes of 8,
#: exactly that layout, "the best 175B training performance with the NeMo SW stack"; 175b_fp8.yaml
#: renamed and retuned on 2024-07-18, 121c975d): ``ub_tp_comm_overlap: True``, hidden and attention
#: dropout 0.0. Its 128-GPU twin (GBS 256, MBS 1) is ``examples/training/gpt/h100/175b_fp8_16node.sh``
#: (``training=gpt3/175b`` with fp8 and the batch overridden), so it keeps gpt3_175b's yaml.
NEMO_LAUNCHER_RUN = {"nemo2407_h100_fp8_gpt3_175b_512gpu": (True, 0.0, False)}


def nemo_launcher(row: dict[str, Any], assume: list[str]) -> tuple[bool, float, bool] | None:
    """(TP comm overlap, dropout, fused cross-entropy) of a NeMo 24.07 run, from the launcher's
    config of the run (:data:`NEMO_LAUNCHER_RUN`) or of its model (:data:`NEMO_LAUNCHER`); None for
    another source."""
    rid = str(row["id"])
    if not rid.startswith("nemo2407"):
        return None
    if rid in NEMO_LAUNCHER_RUN:
        assume.append("NeMo launcher config gpt3/175b_mlperf.yaml (Aug 2024; the run's layout, batch and GPUs): "
                      "ub_tp_comm_overlap true, dropout 0.0")
        return NEMO_LAUNCHER_RUN[rid]
    key = "_".join(rid.split("_")[3:-1])
    got = NEMO_LAUNCHER.get(key)
    if got is not None:
        assume.append("NeMo launcher config (conf/training, Aug 2024): ub_tp_comm_overlap, dropout and "
                      "cross_entropy_loss_fusion as its model's yaml sets them")
    return got


def _nemo_states(row: dict[str, Any], assume: list[str]) -> list[str]:
    """NeMo 24.07's gradient and optimizer-state dtypes (``--grad-dtype``, ``--optimizer-dtype``).
    NVIDIA's performance recipes reduce and hold the gradients in bf16: NeMo-Framework-Launcher's
    fp8 configs (``gpt3/{5b,20b,175b}_fp8_performance.yaml``, 24.07's ``gpt3/175b_fp8.yaml`` and
    ``nemotron/nemotron_340b.yaml``: ``optim.grad_sync_dtype: bf16``; NeMo 2.0's
    ``scripts/performance/helpers.py``: ``grad_reduce_in_fp32 = False``). Nemotron-4 340B's 24.07
    recipe also keeps Adam's moments in bf16 (``optim.dtype: bf16``)."""
    if not row["id"].startswith("nemo"):
        return []
    out = ["--grad-dtype", "bf16"]
    if row["parallelism"].get("grad_reduce_in_fp32") is not False:  # nemo-runs.json's recipes state it
        assume.append("gradients in bf16 (not stated; NVIDIA's fp8 performance recipes: optim.grad_sync_dtype bf16)")
    if "Nemotron-4 340B" in str(row["model"].get("name")):
        out += ["--optimizer-dtype", "bf16"]
        assume.append("Adam moments in bf16 (not stated; NeMo 24.07's nemotron_340b.yaml: optim.dtype bf16)")
    return out


#: NeMo 24.07's runs whose launcher command turns cuDNN attention back on. The launcher's
#: launcher_scripts/conf/config.yaml at 1ab2c781 (as at tags 24.01-24.07) sets ``env_vars:
#: NVTE_FUSED_ATTN: 0 # Disable cudnn FA until we've tested it more``, exported into the job
#: (nemo_launcher.core.stages ``get_env_vars``: the top-level ``env_vars``), and Transformer Engine
#: then runs its FlashAttention backend, Dao's flash-attn (``--attention-kernel flash-attn``). GPT-3
#: 175B on 128 GPUs is ``examples/training/gpt/h100/175b_fp8_16node.sh``, which adds
#: ``+env_vars.NVTE_FUSED_ATTN=1`` (95c77b59, "Enable cuDNN FlashAtt only for 175B", by the table's
#: co-author): cuDNN. On 512 GPUs, ``gpt3/175b_mlperf.yaml`` writes ``env_vars: NVTE_FUSED_ATTN: 1``
#: inside the training config, which ``get_env_vars`` does not read: inconclusive, left on cuDNN.
NEMO_CUDNN_RUNS = ("nemo2407_h100_fp8_gpt3_175b_128gpu", "nemo2407_h100_fp8_gpt3_175b_512gpu")


def _nemo_kernel(row: dict[str, Any], assume: list[str]) -> list[str]:
    """``--attention-kernel flash-attn`` for the NeMo 24.07 runs launched with ``NVTE_FUSED_ATTN: 0``
    (:data:`NEMO_CUDNN_RUNS` are not)."""
    rid = str(row["id"])
    if not rid.startswith("nemo2407") or rid in NEMO_CUDNN_RUNS:
        return []
    assume.append("attention: Dao's flash-attn through Transformer Engine (NeMo-Framework-Launcher 1ab2c781 "
                  "conf/config.yaml: env_vars NVTE_FUSED_ATTN: 0, cuDNN attention off)")
    return ["--attention-kernel", "flash-attn"]


def express(row: dict[str, Any], tmp: Path) -> Case:
    """The command line of ``row``, or Unsupported naming the missing feature."""
    m, par = row["model"], row["parallelism"]
    for feature, what in MISSING_ARCH.items():
        if feature in str(m.get("arch") or ""):
            raise Unsupported(what)
    if m.get("moe") and not (isinstance(m["moe"], dict) and m["moe"].get("catalog")):
        raise Unsupported("mixture of experts without a catalog architecture")
    if par.get("activation_cpu_offload"):  # llm-foundry's fsdp_config.activation_cpu_offload
        raise Unsupported("activation CPU offload")
    float8 = float8_unsupported(row)  # a torchao float8 recipe not modelled (rowwise_with_gw_hp)
    if float8:
        raise Unsupported(float8)
    assume: list[str] = [str(x) for x in row.get("assumptions") or []]  # the row's own (outside-runs.json)
    device, mem_gib = _device(row, tmp)
    if device == "h100":
        device = _h100_cudnn(row, tmp, assume)
    tp, pp, dp = int(par["tp"]), int(par["pp"]), int(par["dp"])
    ep = int(par.get("ep") or 1) if m.get("moe") else 1
    etp1 = m.get("moe") and par.get("etp") == 1 and tp > 1
    if etp1:  # ETP = 1: an expert group is tp x ep ranks (Megatron folds ep out of dp x tp): the ep mesh dim is ep / tp
        if ep % tp:
            raise Unsupported(f"ETP = 1 with EP {ep} not a multiple of TP {tp}")
        ep //= tp
    cp = int(par.get("cp") or 1)
    gpus = tp * pp * dp * ep * cp
    from_cp = bool(etp1 and cp > 1 and gpus != int(row["hardware"]["num_gpus"]))
    if from_cp:
        # Megatron's expert group of ETP = 1 is the next EP ranks in tp-cp-dp order: past tp and
        # with no data-parallel rank to take, cp ranks: the ep mesh dim carved from cp (ep-from=cp)
        if cp % ep or tp * pp * dp * cp != int(row["hardware"]["num_gpus"]):
            raise Unsupported(f"ETP = 1 with an expert group (EP {ep * tp}) wider than TP {tp} x the data-parallel "
                              f"ranks and not carved from the {cp} context-parallel ranks")
        cp //= ep
        gpus = tp * pp * dp * ep * cp
        assume.append(f"ETP = 1, EP {ep * tp} wider than TP {tp} x DP {dp}: the expert group takes {ep} of the cp "
                      f"ranks (--strategy ...,ep-from=cp: the sequence over cp x ep = {cp} x {ep})")
    mb = par.get("micro_batch") or par.get("local_batch")
    gb = par.get("global_batch")
    if par.get("micro_batch") is None and par.get("local_batch") and pp > 1:
        # torchtitan's pipeline: as many microbatches as stages unless told otherwise
        mb = int(par["local_batch"]) // pp
        assume.append(f"{pp} microbatches of {mb} (torchtitan's default: as many as pipeline stages)")
    if mb is None:
        mb = 1
        assume.append("micro-batch 1 (not stated)")
    layers = int(m["layers"])
    vocab = m.get("vocab") or 51200
    if m.get("vocab") is None:
        assume.append("vocab 51200 (not stated; a one-layer timing, the vocab cancels)")
    tied = bool(m.get("tied_embeddings"))
    cfg = {"name": row["id"], **_arch(row), "layers": layers, "hidden": m["hidden"], "heads": m["heads"],
           "kv_heads": m.get("kv_heads") or m["heads"], "ffn": m["ffn_hidden"], "vocab": vocab, "seq": m["seq_len"],
           "batch": 1, "dtype": "bf16", "tied_embeddings": tied}
    if m.get("linear_bias"):  # biases in every linear layer and norm (MPT's no_bias=False)
        cfg["linear_bias"] = True
    if row["id"].startswith((*MEGATRON_OLD, "megatronlm", "bloom", "mtnlg")):
        # Megatron GPT's hidden and attention dropout, 0.1 by default (Korthikanti et al. count its
        # masks in their activation memory, Sec. 4.1); still so in Megatron-LM core_r0.8.0
        # (megatron/training/arguments.py: --hidden-dropout / --attention-dropout default 0.1)
        cfg["dropout"] = 0.1
        assume.append("dropout 0.1 (Megatron-LM's default of the time)")
    nemo = nemo_launcher(row, assume)
    if nemo is not None and nemo[1] > 0:
        cfg["dropout"] = nemo[1]
    strategy, framework = _strategy(row, assume)
    recompute = _recompute(row, assume)
    if ep > 1:  # Megatron-Core's folding: the experts over ep, the rest data parallel over dp x ep
        strategy = strategy.replace("dp", "dp,ep", 1) + (",etp=1" if etp1 else "")
    if cp > 1 or from_cp:
        strategy = _with_cp(strategy, _cp_attention(row, framework, assume)) + (",ep-from=cp" if from_cp else "")
    # the ranks as both frameworks lay them out: tp innermost, then cp (Megatron-Core's
    # tp-cp-ep-dp-pp order; torchtitan's mesh pp, dp_shard, cp, tp)
    dims = (("pp", pp), ("dp", dp), ("ep", ep), ("cp", cp), ("tp", tp))
    if etp1 and (cp > 1 or from_cp) and ep > 1:
        # ETP = 1: Megatron's expert group is EP consecutive ranks (TP x CP ranks, one node), which
        # the ep mesh dim can only share with tp: ep inside cp keeps the group's ranks together
        dims = (("pp", pp), ("dp", dp), ("cp", cp), ("ep", ep), ("tp", tp))
        if not from_cp:
            assume.append("ETP = 1 under cp: the ep mesh dim inside cp (Megatron's expert group is EP consecutive "
                          "ranks, tp x cp ones; spmdkit's ep cannot share cp's ranks, so the cp ring spans ep x tp)")
    argv = ["plan", "--mesh", ",".join(f"{k}={v}" for k, v in dims if (k not in ("pp", "ep", "cp") or v > 1)),
            "--strategy", strategy, "--device", device, "--precision", _precision(row), "--framework", framework,
            "--recompute", recompute, "--json"]
    argv += _nemo_states(row, assume) + _nemo_kernel(row, assume) + foundry_argv(row, assume)
    if par.get("dispatcher"):  # MoE: the dispatcher and the routing the run used (moe-runs.json)
        if par["dispatcher"] not in DISPATCHERS:
            raise Unsupported(f"MoE dispatcher {par['dispatcher']}")
        argv += ["--moe-dispatcher", str(par["dispatcher"])]
    if par.get("routing"):
        argv += ["--moe-routing", str(par["routing"])]
    if par.get("moe_skew"):  # the routing skew of the run's router: a number or a published figure's name
        argv += ["--moe-skew", str(par["moe_skew"])]
    if framework == "torchtitan":  # training.compile: Inductor's fused blocks, or eager PyTorch ops
        argv.append("--compile" if par.get("torch_compile") else "--no-compile")
        argv += loss_flags(row)  # torchtitan from 2025-04 compiles its loss under training.compile
        argv += fsdp_float8_flags(row, assume)  # torchao's float8 all-gather under FSDP2
        argv += float8_recipe_flags(row, assume)  # torchao's rowwise recipe (--float8.recipe_name rowwise)
    overlaps = str(par.get("overlaps") or "")
    if "--tp-comm-overlap" in overlaps or par.get("async_tp") or (nemo is not None and nemo[0] and tp > 1):
        argv.append("--tp-comm-overlap")
    if (nemo is not None and nemo[2]) or par.get("cross_entropy_fusion"):  # the row's recipe (nemo-runs.json)
        argv.append("--cross-entropy-fusion")
    if par.get("ep_comm_overlap"):  # Megatron-Core's --overlap-moe-expert-parallel-comm (1F1B A2A overlap)
        argv.append("--ep-comm-overlap")
    argv += _deepspeed_flags(row, assume)
    if pp > 1 and row["id"].startswith(MEGATRON_OLD):
        # Megatron-LM of 2021-2022 (megatron/p2p_communication.py): batch_isend_irecv, req.wait()
        # and torch.cuda.synchronize() after every exchange; overlap_p2p_comm came in 2023-05
        argv.append("--no-p2p-overlap")
        assume.append("pipeline sends block (Megatron-LM 2021-2022: torch.cuda.synchronize() after each "
                      "batch_isend_irecv)")
    if pp > 1 and tp > 1 and row["id"].startswith(MEGATRON_OLD):
        # Megatron-LM of 2021-2022 (megatron/p2p_communication at de7dc40f88 and cfd2e21607):
        # scatter_gather_tensors_in_pipeline on by default, off under --sequence-parallel (the
        # planner keeps sp's already-split activations whole); Megatron-Core sends whole tensors
        argv.append("--pp-scatter-gather")
        assume.append("pipeline tensors sent 1/tp a tp rank and all-gathered over tp (Megatron-LM 2021-2022's "
                      "scatter_gather_tensors_in_pipeline; not under sequence parallelism)")
    if par["tp"] > 1 and row["id"].startswith(MEGATRON_2021):
        # Megatron-LM at de7dc40f88 (2021-08, the sc21 scripts): the column-parallel linear's
        # backward all-reduce blocks (copy_to_tensor_model_parallel_region); the async one beside
        # the wgrad GEMM came in 16c90445e7 (2021-09, async_tensor_model_parallel_allreduce)
        argv.append("--no-async-tp-allreduce")
        assume.append("tp all-reduce of the input gradient blocks (Megatron-LM 2021-08: no "
                      "async_tensor_model_parallel_allreduce)")
    dpe = dp * (1 if from_cp else ep)  # the data-parallel ranks (ep folded into them unless carved from cp)
    accum = (gb // (dpe * mb)) if gb else 1
    if gb and gb % (dpe * mb):
        raise Unsupported(f"global batch {gb} not a multiple of dp x micro-batch {dpe * mb}")
    if accum > 1 and row["id"].startswith(MEGATRON_2021):
        # Megatron-LM at de7dc40f88 predates --gradient-accumulation-fusion (83b1e42f30, 2022-02):
        # its weight gradients accumulate in param.grad through autograd, microbatch by microbatch
        argv.append("--no-wgrad-fusion")
        assume.append("weight gradients added into param.grad each microbatch (Megatron-LM 2021-08: no "
                      "gradient accumulation fusion)")
    if pp > 1:
        argv += ["--batch", str(dpe * mb * accum), "--microbatches", str(accum)]
        v = par.get("vp_chunks") or 1
        if par.get("vp_chunks") is None and str(par.get("schedule") or "").lower().startswith("interleaved") \
                and framework == "torchtitan":
            v = 2  # torchtitan's generate_split_points: 2 stages a rank for a looped schedule without split points
            assume.append("2 stages per rank (not stated; torchtitan's default for a looped schedule without "
                          "pipeline_parallel_split_points)")
        if v > 1:
            argv += ["--schedule", "interleaved", "--virtual-stages", str(v)]
        n = pp * v
        if par.get("stages"):  # the run's own layout (Megatron's embedding and loss counted as layers)
            if 0 in par["stages"][1:-1]:  # Megatron-Core's embedding-only first / loss-only last stage are planned
                raise Unsupported("a middle pipeline stage without a decoder layer")
            argv += ["--stages", ",".join(str(k) for k in par["stages"])]
        elif layers % n:
            argv += ["--stages", ",".join(str(k) for k in _split(layers, n, framework))]
            assume.append(f"{layers} layers split {'/'.join(str(k) for k in _split(layers, n, framework))} "
                          f"over {n} stages")
    else:
        argv += ["--batch", str(dpe * mb)]
        if accum > 1:
            argv += ["--grad-accum", str(accum)]
    meas = row["measured"]
    metric, value = _metric(row, meas)
    case = Case(row, argv, metric, value, assume, gpus=gpus, device_memory_gib=mem_gib,
                memory_measured_gib=meas.get("memory_gib_max"))
    if m.get("moe"):  # the catalog's architecture (MoE, MLA) at the run's sequence length and MTP depth
        case.argv = [*argv, "--model", _moe_model(m), "--seq", str(m["seq_len"])]
    elif metric.startswith("layer_"):
        case.argv = [*argv, "--model-config", json.dumps({**cfg, "layers": 1})]
        case.argv2 = [*argv, "--model-config", json.dumps({**cfg, "layers": 2})]
    else:
        case.argv = [*argv, "--model-config", json.dumps(cfg)]
    return case


def _deepspeed_flags(row: dict[str, Any], assume: list[str]) -> list[str]:
    """The flags of a Megatron-DeepSpeed run (BLOOM, MT-NLG: ``parallelism.schedule`` names DeepSpeed's
    PipelineEngine). (Megatron-LM's own local DDP of 2021, ``--DDP-impl local``, is planned as for the
    sc21 rows: without ``--no-grad-overlap``; docs/devices.md "--no-grad-overlap" says why.) Its ``TrainSchedule`` (deepspeed/runtime/pipe/schedule.py) runs the instructions
    of a step in order, each send blocking (runtime/pipe/p2p.py ``send``: ``assert async_op == False``,
    then ``dist.send``, or ``dist.broadcast`` over the two stages' group before torch 1.8), and
    appends ``ReduceTiedGrads(), ReduceGrads(), OptimizerStep()`` after the last microbatch: the
    gradients reduced after the pipeline, not under its backward. ``parallelism.launch_blocking``
    (BLOOM's slurm script exports ``CUDA_LAUNCH_BLOCKING=1``): every launch waits for its kernel, so
    no collective runs beside compute, the tp all-reduces included."""
    par = row["parallelism"]
    out: list[str] = []
    if "DeepSpeed PipelineEngine" in str(par.get("schedule") or ""):
        out += ["--no-p2p-overlap", "--no-grad-overlap"]
        assume.append("DeepSpeed PipelineEngine: blocking sends, the gradients reduced after the last microbatch "
                      "(deepspeed.runtime.pipe.schedule.TrainSchedule: ReduceGrads after the pipeline)")
    if par.get("launch_blocking"):
        out.append("--no-async-tp-allreduce")
        assume.append("CUDA_LAUNCH_BLOCKING=1: the tp all-reduce of the input gradient blocks (no collective beside "
                      "compute)")
    elif row["id"].startswith("mtnlg") and int(par["tp"]) > 1:
        out.append("--no-async-tp-allreduce")
        assume.append("tp all-reduce of the input gradient blocks (Megatron-DeepSpeed of 2021, forked before "
                      "Megatron-LM's async_tensor_model_parallel_allreduce, 2021-09; not stated)")
    if row["id"].startswith(("bloom", "mtnlg")) and par.get("global_batch"):
        out.append("--no-wgrad-fusion")
        assume.append("weight gradients added into param.grad each microbatch (Megatron-DeepSpeed of 2021-2022: "
                      "no gradient accumulation fusion, which Megatron-LM gained in 2022-02)")
    return out


def _moe_model(m: dict[str, Any]) -> str:
    """The ``--model`` of a MoE row: its catalog entry, with the run's multi-token-prediction depth
    (``model.moe.mtp_layers``, Megatron's ``--mtp-num-layers``; 0 where the row states none: the
    catalog's deepseek-v3 has DeepSeek's MTP module, which NeMo AutoModel's DeepseekV3ForCausalLM
    does not build) as a config over it where the two differ."""
    name = str(m["moe"]["catalog"])
    fields = config_fields(name)
    mtp = int(m["moe"].get("mtp_layers") or 0)
    if fields is None or int(fields.get("mtp_layers") or 0) == mtp:
        return name
    return json.dumps({"base": name, "name": name, "mtp_layers": mtp}, separators=(",", ":"))


def _split(layers: int, n: int, framework: str) -> list[int]:
    """Layers per pipeline stage. torchtitan (``generate_split_points`` at 9dec370, no split
    points given): the first stage ``layers // n`` (it holds the embedding), the middle stages one
    more while the remainder lasts, the rest ``layers // n``; otherwise the first stages one more."""
    base, extra = divmod(layers, n)
    if framework != "torchtitan":
        return [base + (k < extra) for k in range(n)]
    out = [base]
    for _ in range(1, n):
        out.append(base + (extra > 0))
        extra -= extra > 0
    out[-1] += extra  # more left than middle stages (never with n > 2 and layers >= n): the last takes it
    return out


def _metric(row: dict[str, Any], meas: dict[str, Any]) -> tuple[str, float]:
    rid = row["id"]
    if rid.startswith("korthikanti22_t4"):
        return "layer_combined_ms", float(meas["layer_combined_ms"])
    if "step_time_s" in meas:
        return "step_time_s", float(meas["step_time_s"])
    if "tokens_per_sec_per_gpu" in meas:
        return "tokens_per_sec_per_gpu", float(meas["tokens_per_sec_per_gpu"])
    if "tflops_per_gpu" in meas:
        defined = str(meas.get("flops_definition") or "")
        if row["model"].get("moe") and not defined.startswith("Megatron-Core"):
            # a MoE run's FLOPs are counted one way here: Megatron-Core's (megatron_core_moe_flops)
            raise Unsupported(f"MoE TFLOP/s by another FLOP definition ({defined[:60] or 'not stated'})")
        return "tflops_per_gpu", float(meas["tflops_per_gpu"])
    if "mfu_pct" in meas:
        return "mfu_pct", float(meas["mfu_pct"])
    raise Unsupported(f"measured figure {sorted(meas)}")


# -- FLOP definitions ---------------------------------------------------------------------------------


def narayanan_flops(row: dict[str, Any]) -> float:
    """Narayanan et al. (2021) eq. 3 per iteration (counts the recompute forward)."""
    m, gb = row["model"], row["parallelism"]["global_batch"]
    s, h, l_, v = m["seq_len"], m["hidden"], m["layers"], m["vocab"]
    return 96.0 * gb * s * l_ * h * h * (1 + s / (6 * h) + v / (16 * l_ * h))


def korthikanti_model_flops(row: dict[str, Any]) -> float:
    """Korthikanti et al. (2022) eq. 7: model FLOPs per iteration."""
    m, gb = row["model"], row["parallelism"]["global_batch"]
    s, h, l_, v = m["seq_len"], m["hidden"], m["layers"], m["vocab"]
    return 72.0 * gb * s * l_ * h * h * (1 + s / (6 * h) + v / (12 * l_ * h))


def megatron_core_flops(row: dict[str, Any]) -> float:
    """Megatron-Core's ``num_floating_point_operations`` (training.py) per iteration."""
    m, gb = row["model"], row["parallelism"]["global_batch"]
    s, h, l_, v = m["seq_len"], m["hidden"], m["layers"], m["vocab"]
    heads, kv = m["heads"], m.get("kv_heads") or m["heads"]
    gated = 1.5 if _arch(row)["activation"] == "swiglu" else 1.0
    return 12.0 * gb * s * l_ * h * h * ((1 + kv / heads + s / h) + m["ffn_hidden"] / h * gated
                                         + v / (2 * l_ * h))


def flops_of(row: dict[str, Any]) -> float:
    """A run's FLOPs per iteration as its source counts them: Narayanan's eq. 3 for the sc21 runs and for
    Megatron-DeepSpeed's (BLOOM's and MT-NLG's throughput logs: ``24 x 4 x B s l h^2 (...)``, the
    factor 4 for the checkpointed forward); Megatron-Core's for a MoE and for the rest (Llama 3's, whose
    source states none: the non-causal count Megatron-Core and torchtitan's ``get_num_flop_per_token``
    share)."""
    if row["id"].startswith((*MEGATRON_2021, "bloom", "mtnlg")):
        return narayanan_flops(row)
    return megatron_core_moe_flops(row) if row["model"].get("moe") else megatron_core_flops(row)


def _padded_vocab(v: int, tp: int, divisible_by: int) -> int:
    """Megatron's padded vocabulary: ``v`` rounded up to a multiple of ``divisible_by x tp``
    (``--make-vocab-size-divisible-by``, 128 by default)."""
    step = divisible_by * tp
    return -(-v // step) * step


def megatron_core_moe_flops(row: dict[str, Any]) -> float:
    """Megatron-Core's FLOPs of one iteration of a MoE (or MLA) GPT, as ``num_floating_point_operations``
    counts them in NVIDIA/Megatron-LM ``megatron/training/training.py`` (its ``transformer_flops``) at
    1e057005 (2025-05-24, the Megatron-MoE-ModelZoo table's ``main(1e057005)``; unchanged to
    bb216765, 2025-10-30). Every GEMM counts 3 times (forward, data and weight gradients) at 2 FLOPs
    a multiply-add, per token of the ``global_batch x seq_len`` of the iteration (no recomputation):

    - attention with GQA: per layer ``12 h^2 p (1 + g/n + s/(2h))`` with ``p = n d / h`` (the query
      width over the hidden: ``--kv-channels`` d may differ from h / n) and the causal half of the
      score and value products (``s/(2h)``); the norms (qk-norm included) are not counted;
    - MLA (DeepSeek's ``multi_latent_attention``): per layer 6 x (the q down and up projections
      ``r_q (h + n (d_qk + d_rope) + 1)``, or ``h n (d_qk + d_rope)`` without ``q_lora_rank``; the kv
      down and up ``r_kv (h + n (d_qk + d_v) + 1)``; the shared rope key ``h d_rope``; the output
      ``n d_v h``; the causal core ``s n (d_qk + d_rope) / 2 + s n d_v / 2``);
    - the MLPs: per layer ``12 h x`` width, the width scaled by 3/2 with SwiGLU: the dense MLP's
      ``ffn`` on the first ``dense_layers`` layers, and on a MoE layer the ``top_k`` routed experts'
      ``top_k x moe_ffn`` plus the shared experts' width (``shared_experts x moe_ffn``, Megatron's
      ``moe_shared_expert_intermediate_size``); the router and the permutations are not counted;
    - multi-token prediction (``model.moe.mtp_layers``, Megatron's ``--mtp-num-layers``): each MTP
      module one more layer of the last layer's kind (attention and MLP), plus ``6 (3h + 2h^2)``
      for its norms and its projection of ``[h, h]`` concatenated;
    - the output layer ``6 h V`` once per prediction (``mtp_layers + 1``), ``V`` padded to a multiple
      of ``make_vocab_size_divisible_by x tp`` (``model.vocab_divisible_by``, Megatron's 128 by
      default).

    The shapes are the spmdkit catalog entry's (``model.moe.catalog``: the architecture the run is
    planned with); the sequence, batch, tp and MTP depth are the run's."""
    m, par = row["model"], row["parallelism"]
    fields = config_fields(str(m["moe"]["catalog"]))
    if fields is None:
        raise Unsupported(f"FLOP count: no catalog model {m['moe']['catalog']!r}")
    b, s = int(par["global_batch"]), int(m["seq_len"])
    h, n, layers = int(fields["hidden"]), int(fields["heads"]), int(fields["layers"])
    dense = int(fields.get("dense_layers") or 0) if fields.get("experts") else layers
    mtp = int(m["moe"].get("mtp_layers") or 0)
    last_moe = dense < layers
    n_layers, n_moe = layers + mtp, (layers - dense) + (mtp if last_moe else 0)
    n_dense = n_layers - n_moe
    act = fields.get("activation") or ("swiglu" if fields.get("arch") == "llama" else "gelu")
    gated = 1.5 if act == "swiglu" else 1.0
    moe_ffn = int(fields.get("moe_ffn") or fields["ffn"])
    width = gated * (int(fields["ffn"]) * n_dense
                     + (moe_ffn * int(fields.get("top_k") or 0) + moe_ffn * int(fields.get("shared_experts") or 0))
                     * n_moe)
    mlp = 12.0 * h * width
    if fields.get("kv_lora_rank"):  # MLA
        dq, dr, dv = int(fields["head_dim"]), int(fields["qk_rope_head_dim"]), int(fields["v_head_dim"])
        rq, rkv = int(fields.get("q_lora_rank") or 0), int(fields["kv_lora_rank"])
        q = rq * (h + n * (dq + dr) + 1) if rq else h * n * (dq + dr)
        per = q + rkv * (h + n * (dq + dv) + 1) + h * dr + n * dv * h + s * n * (dq + dr) / 2 + s * n * dv / 2
        attn = 6.0 * n_layers * per
    else:
        g = int(fields.get("kv_heads") or n)
        p = int(fields.get("head_dim") or h // n) * n / h
        attn = 12.0 * n_layers * h * h * (1 + g / n + s / h / 2) * p
    vocab = _padded_vocab(int(fields["vocab"]), int(par["tp"]), int(m.get("vocab_divisible_by") or 128))
    extra = 6.0 * mtp * (3 * h + 2 * h * h) + 6.0 * h * vocab * (mtp + 1)
    return b * s * (mlp + attn + extra)


# -- running ----------------------------------------------------------------------------------------


@gc_paused  # (the CLI pauses it while it plans; its JSON, parsed here, is as large: 30,000 tensors)
def run_cli(argv: list[str]) -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = spmdkit_main(argv)
    if rc != 0:
        raise RuntimeError(f"spmdkit {' '.join(argv[:3])}...: exit {rc}: {err.getvalue().strip()[:300]}")
    return json.loads(out.getvalue())


def _step(d: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(the step's seconds, the phase times) of a plan's JSON (flat or pipeline)."""
    if "pipeline" in d:
        return float(d["pipeline"]["step_overlap_s"]), d["pipeline"]
    return float(d["step"]["step_overlap_s"]), d["step"]


def _memory_gib(d: dict[str, Any], key: str = "reserved") -> float:
    """The fullest device's memory: ``reserved`` (torch.cuda.max_memory_reserved, what torchtitan
    logs as its memory) or ``device_total`` (with the CUDA context and NCCL buffers: what the
    GPU must hold, the fit)."""
    if "pipeline" in d:
        return max(x["memory"][key] for x in d["pipeline"]["devices"]) / GIB
    return float(d["memory"][key]) / GIB


def _forward_s(d: dict[str, Any]) -> float:
    """The forward of a one-microbatch flat plan: its compute and its collectives (a forward's
    tensor-parallel collectives block the next op), the collectives inside ops (the loss's)
    with it."""
    st = d["step"]
    return float(st["compute_s"]["forward"]) + float(st["comm_s"]["forward"]) \
        + float(st["comm_s"].get("inside_ops", 0.0))


def _layers_wall_s(d: dict[str, Any]) -> float:
    """The forward, recomputation and backward of a one-microbatch flat plan as the step prices
    them: the step less its optimizer, so a collective the step hides (the backward's
    tensor-parallel all-reduce beside the weight-gradient GEMM) is not counted as if it blocked."""
    st = d["step"]
    return float(st["step_overlap_s"]) - float(st["compute_s"].get("optimizer", 0.0)) \
        - float(st["comm_s"].get("optimizer", 0.0))


def layer_halves_ms(d1: dict[str, Any], d2: dict[str, Any]) -> dict[str, float]:
    """Table 4's halves (ms) of one layer, the difference of a 2-layer plan ``d2`` and a 1-layer
    plan ``d1``: its forward, and its backward with the recomputation run in it (the rest of the
    layer's wall time in the step)."""
    fwd = 1e3 * (_forward_s(d2) - _forward_s(d1))
    whole = 1e3 * (_layers_wall_s(d2) - _layers_wall_s(d1))
    return {"layer_forward_ms": fwd, "layer_backward_ms": whole - fwd}


def layer_line(b: dict[str, float], measured: dict[str, Any]) -> str:
    """A Table 4 run's predicted layer forward and backward (``b``: :func:`layer_halves_ms`)
    beside the measured ones."""
    parts = [f"{k.removeprefix('layer_').removesuffix('_ms')} {v:.2f} ms (measured {measured[k]:g})"
             for k, v in b.items()]
    return "    layer " + ", ".join(parts)


def breakdown(d: dict[str, Any]) -> dict[str, float]:
    """Where a plan's predicted step goes (seconds), from its ``--json``: a flat plan's compute
    and the parts of its exposed communication (``step.exposed_s``: blocking collectives,
    gradient buckets past the last backward, distributed-optimizer gathers past the first
    forward, backward re-gathers), which sum to the step; a pipeline's schedule (its bubble
    inside) and what runs after it (gradient reductions, optimizer, gathers)."""
    if "pipeline" in d:
        p = d["pipeline"]
        step = float(p["step_overlap_s"])
        return {"pipeline": float(p["pipeline_s"]), "bubble": float(p["bubble_s"]),
                "after_pipeline": step - float(p["pipeline_s"]), "step": step}
    st = d["step"]
    return {"compute": float(st["compute_total_s"]), **{k: float(v) for k, v in st["exposed_s"].items()},
            "step": float(st["step_overlap_s"])}


def breakdown_line(b: dict[str, float], ratio: float | None) -> str:
    """``b`` as one line; with ``ratio`` (a whole-step run's measured / predicted time) the
    measured step beside it."""
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.3f}" for k, v in b.items() if k != "step")
    meas = f" (measured {ratio * b['step']:.3f} s)" if ratio is not None else ""
    return f"    step {b['step']:.3f} s{meas}: {parts}"


def _command_key(argv: list[str]) -> tuple[str, ...]:
    """``argv`` with the text of each file it names (the torchtitan device file is written afresh
    for each run, its power limit the row's): two runs of one key plan alike."""
    return tuple(argv) + tuple(Path(a).read_text() for a in argv if a.endswith(".json") and Path(a).is_file())


@gc_paused  # to its return, where the plans' JSON is dropped: the collector resumes on the few numbers kept
def _planned(argv: list[str], argv2: list[str] | None) -> dict[str, Any]:
    """What :func:`predict` reads of the command's plan (and of its 2-layer twin's): a few
    numbers, kept by :func:`evaluate` for another run of the same command."""
    d = run_cli(argv)
    got = {"memory": _memory_gib(d), "device_total": _memory_gib(d, "device_total"), "breakdown": breakdown(d),
           "step": _step(d)[0]}
    if argv2 is not None:
        d2 = run_cli(argv2)
        got["layer_halves"] = layer_halves_ms(d, d2)
        got["layer_s"] = 1e-3 * sum(got["layer_halves"].values())
    return got


def predict(case: Case, planned: dict[tuple[str, ...], dict[str, Any]] | None = None) -> tuple[float, float]:
    """(prediction in the run's unit, predicted peak memory GiB). ``planned``: the commands
    planned before (by :func:`_command_key`), read instead of planning one again (the
    Megatron-MoE zoo's forced and dropless rows are one command: the planner routes both alike)."""
    key = _command_key(case.argv) + (("--and", *_command_key(case.argv2)) if case.argv2 is not None else ())
    got = planned.get(key) if planned is not None else None
    if got is None:
        got = _planned(case.argv, case.argv2)
        if planned is not None:
            planned[key] = got
    row, metric = case.row, case.metric
    mem = got["memory"]
    case.device_need_gib = got["device_total"]
    case.breakdown = dict(got["breakdown"])
    if metric == "layer_combined_ms":
        assert case.argv2 is not None
        case.breakdown = dict(got["layer_halves"])
        return 1e3 * got["layer_s"], mem
    step = got["step"]
    if metric == "step_time_s":
        return step, mem
    if metric == "tokens_per_sec_per_gpu":
        m = row["model"]
        return row["parallelism"]["global_batch"] * m["seq_len"] / step / case.gpus, mem
    if metric == "tflops_per_gpu":
        return flops_of(row) / step / case.gpus / 1e12, mem
    if metric == "mfu_pct":
        return 100 * korthikanti_model_flops(row) / (step * case.gpus * 312e12), mem
    raise AssertionError(metric)


# -- the summary ---------------------------------------------------------------------------------------


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return math.nan
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _group(row: dict[str, Any]) -> str:
    m = row["model"]
    return f"{row['id'].split('_')[0]}|{m['layers']}|{m['hidden']}|{row['hardware']['gpu']}|{row['precision']}"


def summarise(results: list[dict[str, Any]], unsupported: dict[str, list[str]]) -> dict[str, Any]:
    speed = [r for r in results if "ratio" in r]
    errs = [abs(r["ratio"] - 1) for r in speed]
    mem = [r for r in results if r.get("memory_ratio") is not None]
    fits = [r for r in results if r.get("fits") is not None]
    pairs = agree = 0
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in speed:
        if r["metric"] in ("tokens_per_sec_per_gpu", "tflops_per_gpu", "mfu_pct"):
            groups.setdefault(r["group"], []).append(r)
    for rs in groups.values():
        for i in range(len(rs)):
            for j in range(i + 1, len(rs)):
                a, b = rs[i], rs[j]
                if a["measured"] == b["measured"]:
                    continue
                pairs += 1
                agree += (a["measured"] > b["measured"]) == (a["predicted"] > b["predicted"])
    return {
        "runs": len(results) + sum(len(v) for v in unsupported.values()), "planned": len(results),
        "speed_median_abs_err": statistics.median(errs) if errs else math.nan,
        "speed_p90_abs_err": _pct(errs, 0.9), "speed_median_ratio": statistics.median([r["ratio"] for r in speed])
        if speed else math.nan,
        "within_5pct": sum(e <= 0.05 for e in errs) / len(errs) if errs else math.nan,
        "within_10pct": sum(e <= 0.10 for e in errs) / len(errs) if errs else math.nan,
        "worst": max(speed, key=lambda r: abs(r["ratio"] - 1))["id"] if speed else None,
        "memory_ratios": [round(r["memory_ratio"], 3) for r in mem],
        "memory_within_10pct": sum(abs(r["memory_ratio"] - 1) <= 0.10 for r in mem),
        "memory_measured": len(mem),
        "fit_when_trained": sum(r["fits"] for r in fits), "trained": len(fits),
        "pairs": pairs, "pairs_in_order": agree,
        "unsupported": {k: len(v) for k, v in unsupported.items()},
    }


def evaluate(rows: list[dict[str, Any]], show_argv: bool = False, out: Any = None, show_breakdown: bool = False
             ) -> tuple[list[dict[str, Any]], dict[str, list[str]]]:
    """Every row planned and compared: (results, unsupported runs by missing feature); a table
    row per run to ``out`` as it goes (with ``show_breakdown``, where its predicted step goes)."""
    results: list[dict[str, Any]] = []
    unsupported: dict[str, list[str]] = {}
    planned: dict[tuple[str, ...], dict[str, Any]] = {}

    def say(line: str) -> None:
        if out is not None:
            print(line, file=out, flush=True)

    say("| run | unit | measured | predicted | ratio | memory GiB (measured) | fits | s |")
    say("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        for row in rows:
            try:
                case = express(row, tmp)
            except Unsupported as exc:
                unsupported.setdefault(str(exc), []).append(row["id"])
                say(f"| {row['id']} | unsupported: {exc} | | | | | | |")
                continue
            t0 = time.perf_counter()
            try:
                pred, mem = predict(case, planned)
            except RuntimeError as exc:
                unsupported.setdefault("planner error", []).append(row["id"])
                say(f"| {row['id']} | error: {str(exc)[:200]} | | | | | | |")
                continue
            secs = time.perf_counter() - t0
            ratio = pred / case.measured
            if case.metric in ("step_time_s", "layer_combined_ms"):
                ratio = case.measured / pred  # a time: > 1 is optimistic, as for a rate
            fits = case.device_need_gib <= case.device_memory_gib if case.metric != "layer_combined_ms" else None
            res = {"id": row["id"], "metric": case.metric, "measured": case.measured, "predicted": pred,
                   "ratio": ratio, "memory_gib": mem, "fits": fits, "group": _group(row),
                   "gpu": "A100" if str(row["hardware"]["gpu"]).startswith("A100") else "H100",
                   "cp": int(row["parallelism"].get("cp") or 1),
                   "memory_measured_gib": case.memory_measured_gib,
                   "memory_ratio": mem / case.memory_measured_gib if case.memory_measured_gib else None,
                   "assumptions": case.assumptions, "argv": case.argv, "seconds": secs,
                   "breakdown": case.breakdown}
            results.append(res)
            mm = f" ({case.memory_measured_gib})" if case.memory_measured_gib else ""
            say(f"| {row['id']} | {case.metric} | {case.measured:g} | {pred:.4g} | {ratio:.3f} | {mem:.1f}{mm} | "
                f"{'yes' if fits else 'no' if fits is not None else ''} | {secs:.1f} |")
            if show_argv:
                say("    spmdkit " + " ".join(_quote(x) for x in case.argv))
            if show_breakdown:
                say(layer_line(case.breakdown, row["measured"]) if case.metric == "layer_combined_ms"
                    else breakdown_line(case.breakdown, ratio))
    return results, unsupported


def summary_lines(s: dict[str, Any]) -> list[str]:
    return [
        f"speed: {s['planned']} of {s['runs']} runs planned; median |ratio - 1| "
        f"{100 * s['speed_median_abs_err']:.1f}%, 90th percentile {100 * s['speed_p90_abs_err']:.1f}%, median ratio "
        f"{s['speed_median_ratio']:.3f}, within 5%: {100 * s['within_5pct']:.0f}%, within 10%: "
        f"{100 * s['within_10pct']:.0f}%, worst {s['worst']}",
        f"memory: {s['memory_within_10pct']} of {s['memory_measured']} measured peaks within 10% "
        f"(ratios {s['memory_ratios']}); predicted to fit: {s['fit_when_trained']} of {s['trained']} runs that "
        f"trained",
        f"order: {s['pairs_in_order']} of {s['pairs']} pairs of configurations of one model in the measured order",
        "unsupported: " + (", ".join(f"{k}: {v}" for k, v in s["unsupported"].items()) or "none")]


SOURCES = {"narayanan21": "Narayanan 2021", "korthikanti22": "Korthikanti 2022", "megatronlm": "Megatron-LM 2024",
           "nemo2407": "NeMo 24.07", "torchtitan": "torchtitan 2024-12",
           "automodel": "NeMo AutoModel", "megatron": "Megatron-MoE-ModelZoo"}


def _band_family(rs: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [r["ratio"] for r in rs]
    return {"runs": len(ratios), "p10": round(_pct(ratios, 0.1), 3), "p50": round(_pct(ratios, 0.5), 3),
            "p90": round(_pct(ratios, 0.9), 3), "sources": sorted({SOURCES[r["id"].split("_")[0]] for r in rs})}


def band_json(results: list[dict[str, Any]], moe: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The error band per GPU family (spmdkit.cost.band): percentiles of measured / predicted
    step time over the whole-step runs without cp (Table 4's one-layer timings left out); ``cp``:
    the context-parallel runs' (cp > 1, any GPU), the band of a cp plan; ``moe``: the runs of
    ``benchmarks/data/moe-runs.json`` (``moe``, their results), the band of a plan with MoE layers."""
    fam: dict[str, Any] = {}
    whole = [r for r in results if r["metric"] != "layer_combined_ms"]
    steps = [r for r in whole if r.get("cp", 1) == 1]  # the families: plans without cp
    for name, rs in (("A100", [r for r in steps if r["gpu"] == "A100"]),
                     ("H100", [r for r in steps if r["gpu"] == "H100"]), ("all", steps),
                     ("cp", [r for r in whole if r.get("cp", 1) > 1]), ("moe", moe or [])):
        if rs:
            fam[name] = _band_family(rs)
    return {"generated_by": "benchmarks/fidelity.py --write", "runs_file": "benchmarks/data/published-runs.json",
            "moe_runs_file": "benchmarks/data/moe-runs.json", "families": fam}


MOE_HEADING = "## Mixture of experts"
AFTER_MOE = "## Not expressible yet"


def markdown(results: list[dict[str, Any]], unsupported: dict[str, list[str]], s: dict[str, Any],
             moe: list[str] | None = None) -> str:
    """docs/fidelity.md: the summary, every run, the unsupported ones and the assumptions; with
    ``moe`` (the MoE runs' section, :func:`moe_section`) that section after the runs."""
    out = ["# Predictions against published runs", "",
           "Generated by `python benchmarks/fidelity.py --write` (tests/test_fidelity.py fails when it is stale):",
           "every run of `benchmarks/data/published-runs.json` planned through the CLI and compared in the source's",
           "own unit (`benchmarks/fidelity.py` says how). `ratio`: predicted speed / measured speed (for a time,",
           "measured / predicted): above 1 the prediction is optimistic.", "", "## Summary", ""]
    out += [f"- {line}" for line in summary_lines(s)]
    out += ["", "## Runs", "", *run_table(results, memory="memory GiB (measured)", measured_memory=True)]
    cp = [r for r in results if r.get("cp", 1) > 1]
    if cp:
        ratios = ", ".join(f"{r['id']} {r['ratio']:.3f}" for r in cp)
        out += ["", "## Context parallelism", "",
                f"The {len(cp)} runs with cp > 1 (above: `--mesh ...,cp=C,...`, `--strategy ...,cp,cp-attention=V`: NeMo",
                "24.07 Transformer Engine's p2p ring, torchtitan's context_parallel the all-gather rotation) make the",
                "error band of a cp plan (`band.json` family `cp`), apart from the families above. Ratios: " + ratios + "."]
    if moe is not None:
        out += moe
    out += ["", AFTER_MOE, ""]
    out += [f"- {k}: {', '.join(v)}" for k, v in unsupported.items()] or ["- none"]
    out += ["", "## Assumptions (fields the sources do not state)", ""]
    seen: dict[str, list[str]] = {}
    for r in results:
        for x in r["assumptions"]:
            seen.setdefault(x, []).append(r["id"])
    out += [f"- {k}: {len(v)} runs ({v[0]}{', ...' if len(v) > 1 else ''})" for k, v in seen.items()]
    return "\n".join(out) + "\n"


def moe_section(mres: list[dict[str, Any]], muns: dict[str, list[str]], ms: dict[str, Any]) -> list[str]:
    """docs/fidelity.md's section of the MoE runs (their results, unsupported runs and summary)."""
    out = ["", MOE_HEADING, "",
           "The MoE runs of `benchmarks/data/moe-runs.json` (expert parallelism folded into data parallelism as",
           "Megatron-Core and FSDP2 + DeepEP run it: `--mesh dp=D,ep=E --strategy dp,ep[,zero3]`; the catalog's",
           "architecture), planned the same way; not in the error band above: a plan with MoE layers carries their own",
           "(`band.json` family `moe`, 16 runs). Their recipes are read from NeMo AutoModel's benchmark configs (each",
           "row's `companions`): every decoder layer checkpointed",
           "(`--recompute full`), the model in bf16 with `torch.optim.Adam` (bf16 moments) under FSDP2 and",
           "the loss on bf16 logits (`--framework automodel`, docs/devices.md \"Memory\"); the experts stay",
           "out of FSDP (ep covers every rank of a stage). The configs set `enable_deepep` and",
           "`fake_balanced_gate` (token t to experts t k .. t k + k - 1): `--moe-dispatcher deepep",
           "--moe-routing balanced` (docs/devices.md \"Mixture of experts\"). The `megatron_moe_zoo` rows are",
           "Megatron-Core's own (Megatron-MoE-ModelZoo's Qwen3 table, H100s): ETP = 1",
           "(`--strategy dp,ep,megatron,sp,zero1,etp=1`, the experts over ep x tp), the distributed optimizer",
           "(no `--tp-comm-overlap`: the zoo's scripts of the time set none), the model's router (dropless or",
           "forced balance: `--moe-routing topk`), DeepEP or NCCL's all-to-all, the pipeline split with the",
           "embedding and the loss counted as layers; its long-context rows (seq 16k-128k, cp 1-8) give TFLOP/s",
           "per GPU only: Megatron-Core's MoE FLOP count (`megatron_core_moe_flops`) over the predicted step.", ""]
    out += [f"- {line}" for line in summary_lines(ms)[:1] + summary_lines(ms)[3:]]
    out += ["", *run_table(mres, memory="memory GiB (measured)")]
    out += [f"- unsupported {k}: {', '.join(v)}" for k, v in muns.items()]
    return out


def split_moe_section(doc: str) -> tuple[str, list[str]]:
    """(docs/fidelity.md without its MoE section, the section's lines as :func:`moe_section` makes
    them): so the dense runs and the MoE runs are checked apart."""
    return split_section(doc, MOE_HEADING)


def split_section(doc: str, heading: str) -> tuple[str, list[str]]:
    """(``doc`` without the section under ``heading``, the section's lines: its blank line and heading
    up to the blank line before the next ``## `` heading)."""
    lines = doc.split("\n")
    if heading not in lines or AFTER_MOE not in lines:
        return doc, []
    a = lines.index(heading) - 1
    b = next(k for k in range(a + 2, len(lines)) if lines[k].startswith("## ")) - 1
    return "\n".join(lines[:a] + lines[b:]), lines[a:b]


OUTSIDE_HEADING = "## Out-of-sample check: the largest published runs"
OUTSIDE_INTRO = (
    "The runs of `benchmarks/data/outside-runs.json`: Llama 3 405B on 8,192 and 16,384 H100s (Dubey et al. 2024,",
    "Table 4, one row at 131,072 tokens with cp 16), BLOOM-176B (BigScience's log and slurm script), Megatron-Turing",
    "NLG 530B (Smith et al. 2022), Megatron-LM's GPT-3 175B example (its README) and OPT-175B (Zhang et al. 2022).",
    "Nothing in the cost model was calibrated on them (`benchmarks/data/outside-runs.md`)",
    "and no change was made by looking at them: they are kept out of `band.json`, the summary above and",
    "`benchmarks/calibrate_sustained.py`. Megatron-DeepSpeed's runs as DeepSpeed's PipelineEngine runs them",
    "(blocking sends, the gradients reduced after the pipeline), BLOOM's `CUDA_LAUNCH_BLOCKING=1` as no collective",
    "beside compute; BLOOM and MT-NLG in Narayanan's eq. 3 (their own count), Llama 3 by Megatron-Core's count",
    "(Meta states none; non-causal attention, as torchtitan's): each row's assumptions below.", "")
NEMO_LONG_HEADING = "## Out-of-sample check: NeMo 24.03's long-sequence runs (cp up to 32)"
NEMO_LONG_INTRO = (
    "The runs of `benchmarks/data/nemo-long-runs.json`: NVIDIA NeMo's long-sequence table (Llama 2 7B, fp8,",
    "NeMo 24.03.01 on DGX-H100, 4K to 1024K tokens, cp 1 to 32, 4M tokens a step; NVIDIA/NeMo",
    "docs/source/performance/performance_long_sequence.md). Nothing in the cost model was calibrated on them",
    "(`benchmarks/data/nemo-long-runs.md`): out of `band.json`, the summary above and",
    "`benchmarks/calibrate_sustained.py`. Expressed as NeMo 24.07's cp rows (Transformer Engine's p2p ring,",
    "`--strategy ...,cp,cp-attention=ring`, fp8, the distributed optimizer); measured as the table's first",
    "version's tokens a second a GPU (NVIDIA/NeMo 35029a0c84), whose TFLOP/s are Megatron-Core's count",
    "(non-causal attention, most of the count at 1M tokens).", "")
NEMO_HEADING = "## Out-of-sample check: NeMo's later performance summaries (25.09 to 26.06)"
NEMO_INTRO = (
    "The runs of `benchmarks/data/nemo-runs.json`: every DGX-H100 pre-training row of NeMo 25.09 to 26.06's",
    "performance summaries (NVIDIA-NeMo/Megatron-Bridge `docs/performance-summary-archive.md`) whose model the",
    "catalog has (Llama 3 8B / 70B, Llama 3.1 405B, DeepSeek-V3, Qwen3-30B-A3B, Qwen3-235B-A22B), each with its",
    "recipe at the release's Megatron-Bridge tag (`benchmarks/data/nemo-runs.md`). Expressed as the NeMo 24.07",
    "rows are (the distributed optimizer, bf16 gradients, sequence parallelism with tp; the recipe's TP overlap",
    "and fused cross-entropy; the MoE rows' dispatcher, a2a overlap and forced balance or token drop as",
    "moe-runs.json's are); compared in tokens/s/GPU. Nothing in the cost model was calibrated on them: they",
    "are kept out of `band.json`, the summary above and `benchmarks/calibrate_sustained.py`.", "")
MBRIDGE_HEADING = "## Out-of-sample check: Megatron-Bridge's pull-request runs"
MBRIDGE_INTRO = (
    "The runs of `benchmarks/data/mbridge-runs.json`: steps Megatron-Bridge's maintainers measured in their pull",
    "requests on a layout the planner can make (PR #3868: Qwen3-30B-A3B on 16 H100s, BF16, TP 1, PP 1, EP 16,",
    "the alltoall dispatcher, eager; PR #3862: the same shape without and with Megatron-Core's EP all-to-all overlap",
    "at PP 1, `--ep-comm-overlap`), each with the recipe of the branch it ran (`benchmarks/data/mbridge-runs.md`).",
    "Expressed as the NeMo rows above are; compared in seconds a step. Nothing in the cost model was calibrated",
    "on them: they are kept out of `band.json`, the summary above and `benchmarks/calibrate_sustained.py`.", "")
#: the runs files planned apart from the calibration (out of band.json, of the published runs' summary
#: and of benchmarks/calibrate_sustained.py), each a section of docs/fidelity.md after the MoE runs
EXTRA_RUNS: list[RunsSection] = [RunsSection(OUTSIDE_RUNS, OUTSIDE_HEADING, OUTSIDE_INTRO),
                                 RunsSection(NEMO_LONG_RUNS, NEMO_LONG_HEADING, NEMO_LONG_INTRO),
                                 RunsSection(NEMO_RUNS, NEMO_HEADING, NEMO_INTRO),
                                 RunsSection(MBRIDGE_RUNS, MBRIDGE_HEADING, MBRIDGE_INTRO), FOUNDRY, TORCHTITAN_2025]


def extra_section(x: RunsSection, res: list[dict[str, Any]], uns: dict[str, list[str]], s: dict[str, Any],
                  rows: list[dict[str, Any]]) -> list[str]:
    """docs/fidelity.md's section of ``x``, a runs file of :data:`EXTRA_RUNS`
    (:func:`fidelity_tables.runs_section`), ``s`` the summary of ``res``, ``rows`` the file's rows."""
    return runs_section(x, res, uns, rows, summary_lines(s))


def evaluate_section(x: RunsSection, out: Any = None) -> list[str]:
    """Plan every run of ``x``'s file and give its section (:func:`extra_section`)."""
    rows = json.loads(x.path.read_text())
    res, uns = evaluate(rows, False, out)
    return extra_section(x, res, uns, summarise(res, uns), rows)

ROOT = Path(__file__).resolve().parents[1]
BAND = ROOT / "src" / "spmdkit" / "cost" / "band.json"
DOC = ROOT / "docs" / "fidelity.md"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", action="append", default=None,
                    help="a runs file, repeatable (default benchmarks/data/published-runs.json; the MoE runs: "
                         "benchmarks/data/moe-runs.json)")
    ap.add_argument("--only", help="comma list of run id prefixes")
    ap.add_argument("--json", help="also write every result and the summary to this file")
    ap.add_argument("--write", action="store_true",
                    help="also write the error band (src/spmdkit/cost/band.json) and docs/fidelity.md")
    ap.add_argument("--show-argv", action="store_true", help="print each run's command line")
    ap.add_argument("--breakdown", action="store_true",
                    help="print where each run's predicted step goes (compute, exposed communication by kind; "
                         "a pipeline's schedule, bubble and what runs after it) and the measured step; a Table 4 "
                         "layer's forward and backward halves beside the measured ones")
    ap.add_argument("--section", action="store_true",
                    help="print the section of docs/fidelity.md of the one --runs file given, an out-of-sample "
                         "set (benchmarks/data/{outside,nemo-long,nemo,mbridge,foundry,torchtitan-2025}-runs.json), for the runs planned")
    a = ap.parse_args()
    runs = a.runs or [str(RUNS)]
    section = next((x for x in EXTRA_RUNS if len(runs) == 1 and Path(runs[0]).resolve() == x.path), None)
    if a.section and section is None:  # refused before any run is planned
        print("--section: give one --runs file of the out-of-sample sets: "
              + ", ".join(str(x.path.relative_to(ROOT)) for x in EXTRA_RUNS), file=sys.stderr)
        return 2
    rows = [r for f in runs for r in json.loads(Path(f).read_text())]
    if a.only:
        rows = [r for r in rows if r["id"].startswith(tuple(a.only.split(",")))]
    results, unsupported = evaluate(rows, a.show_argv, sys.stdout, a.breakdown)
    s = summarise(results, unsupported)
    print()
    for line in summary_lines(s):
        print(line)
    if a.section and section is not None:  # the section --write would put in docs/fidelity.md, for these rows
        print("\n".join(extra_section(section, results, unsupported, s, rows)))
    if a.json:
        Path(a.json).write_text(json.dumps({"results": results, "unsupported": unsupported, "summary": s}, indent=1))
    if a.write:
        if a.only or runs != [str(RUNS)]:
            print("--write: only from every run of the default runs file", file=sys.stderr)
            return 2
        mrows = json.loads(MOE_RUNS.read_text())
        mres, muns = evaluate(mrows, False, sys.stdout)
        BAND.write_text(json.dumps(band_json(results, mres), indent=1) + "\n")
        sections = moe_section(mres, muns, summarise(mres, muns))
        for x in EXTRA_RUNS:  # the out-of-sample checks: not in band.json
            sections += evaluate_section(x, sys.stdout)
        DOC.write_text(markdown(results, unsupported, s, sections))
    return 0


def _quote(x: str) -> str:
    return f"'{x}'" if any(c in x for c in " {}\"") else x


if __name__ == "__main__":
    raise SystemExit(main())
