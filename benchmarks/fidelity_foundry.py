"""The out-of-sample check of ``benchmarks/fidelity.py``: MosaicML llm-foundry's published MPT
throughput tables (``benchmarks/data/foundry-runs.json``), a source the cost model was never
calibrated on (``benchmarks/calibrate_sustained.py`` reads the team's published runs only, and
``band.json`` is made from ``published-runs.json`` alone).

The rows are transcribed from ``scripts/train/benchmarking/README.md`` of mosaicml/llm-foundry at
495218376 (the newest version of the file; its tables unchanged since 5e85bd62d, 2024-01-06), every
row of its five tables. llm-foundry trains through Composer's torch FSDP (FSDP1) only: the planner
runs them as ``--mesh dp=N --strategy dp,zero3`` (``FULL_SHARD``; ``SHARD_GRAD_OP``: ``zero2``)
with ``--framework torchtitan``'s conventions (fp32 sharded parameters, bf16 compute copies, eager
PyTorch ops: ``--no-compile``), compared in the source's own unit, tokens per second per GPU. Where
FSDP1 differs from what the planner models, the row's assumptions say so; nothing was tuned to
these rows.

llm-foundry's MFU (``scripts/train/benchmarking/collect_results.py`` at 5e85bd62d, the README's
"MFU"): ``(3 * 2 N s + 3 * 4 L d s^2)`` FLOPs a sequence (``N`` the NumParams column, embeddings
included; the attention's two ``s x s`` GEMMs), times samples per second, over the GPUs' peak
(Composer v0.17.2 ``composer/callbacks/speed_monitor.py`` ``GPU_AVAILABLE_FLOPS``: A100 312e12,
H100 SXM 989.5e12 in bf16, 1979e12 in fp8): :func:`foundry_mfu_pct`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fidelity_tables import RunsSection

FOUNDRY_RUNS = Path(__file__).resolve().parent / "data" / "foundry-runs.json"
FOUNDRY_HEADING = "## Out-of-sample check: llm-foundry (MPT), kept out of the calibration"

#: Composer v0.17.2 composer/callbacks/speed_monitor.py GPU_AVAILABLE_FLOPS (dense; the spec
#: sheets' sparse figures halved), the peaks collect_results.py divides by
PEAK_FLOPS = {("A100", "bf16"): 312e12, ("H100", "bf16"): 1.979e15 / 2, ("H100", "fp8"): 3.958e15 / 2}


def foundry_mfu_pct(row: dict[str, Any], tokens_per_sec_per_gpu: float) -> float:
    """llm-foundry's MFU (%) of ``row`` at ``tokens_per_sec_per_gpu`` (collect_results.py at
    5e85bd62d): ``(6 N s + 12 L d s^2)`` FLOPs a sequence, ``N`` the published parameter count."""
    m = row["model"]
    s, n = int(m["seq_len"]), round(float(m["params_b"]) * 1e9)
    per_seq = 3 * 2 * n * s + 3 * 4 * int(m["layers"]) * int(m["hidden"]) * s * s
    peak = PEAK_FLOPS[(str(row["hardware"]["gpu"])[:4], str(row["precision"]))]
    return 100 * per_seq * tokens_per_sec_per_gpu / s / peak


#: the flash-attn the benchmark runs installed, by the commit that added the row (submit_benchmarks.py
#: ``pip_install`` and setup.py's extras at that commit) -> its CrossEntropyLoss kernel: 300cc5c58 ``.[gpu]``,
#: flash-attn v1.0.3.post0; b2a43a147 ``.[gpu]``, flash-attn 1.0.9 (its fp8 rows 1.0.7); 5e85bd62d
#: ``.[gpu-flash2]``, flash-attn 2.4.2. Every yaml the rows ran (yamls/pretrain/mpt-*.yaml; mosaic_gpt's
#: at 300cc5c58) leaves ``loss_fn`` unset: the default, ``fused_crossentropy`` (modeling_mpt.py /
#: mosaic_gpt.py at each commit), flash_attn.losses.cross_entropy.CrossEntropyLoss(ignore_index=-100)
FOUNDRY_LOSS = {"300cc5c58": ("flash-attn-xentropy", "flash-attn v1.0.3.post0"),
                "b2a43a147": ("flash-attn-xentropy", "flash-attn 1.0.9 (fp8 rows: 1.0.7)"),
                "5e85bd62d": ("flash-attn-triton", "flash-attn 2.4.2")}


def foundry_loss(row: dict[str, Any], assume: list[str]) -> list[str]:
    """``--cross-entropy-kernel`` of an llm-foundry row: MPT's default loss_fn, fused_crossentropy,
    with the flash-attn its commit's benchmark runs installed (:data:`FOUNDRY_LOSS`)."""
    kernel, version = FOUNDRY_LOSS[str(row["source"]["row_added"]).split()[0]]
    assume.append(f"loss_fn fused_crossentropy (MPT's default; no yaml sets it): flash-attn's CrossEntropyLoss of "
                  f"{version}, --cross-entropy-kernel {kernel}")
    return ["--cross-entropy-kernel", kernel]


def foundry_argv(row: dict[str, Any], assume: list[str]) -> list[str]:
    """The options of an llm-foundry row beyond the common ones (none for another source): the
    gradient reduction's dtype, and what differs from the real framework, as assumptions."""
    if not str(row["id"]).startswith("foundry_"):
        return []
    par = row["parallelism"]
    assume.append("Composer torch FSDP1 (flat parameters; limit_all_gathers, backward_prefetch BACKWARD_POST, no "
                  "forward_prefetch: Composer v0.17.2 dist_strategy.py defaults) planned as the planner's FSDP "
                  "(--framework torchtitan conventions: fp32 sharded parameters, bf16 compute copies, gathers "
                  "prefetched one layer ahead); gradients reduce-scattered every micro-batch in both (Composer v0.17.2 "
                  "trainer.py _train_microbatch: no no_sync for a model that is not DDP); not tuned to these rows")
    assume.append("low_precision_layernorm planned as a layer norm, eager PyTorch ops (--no-compile)")
    argv = [*foundry_loss(row, assume), *attention_argv(row, assume)]
    if str(par.get("fsdp_mixed_precision")) == "PURE":
        # Composer get_mixed_precision: PURE reduces in the precision's dtype, DEFAULT in fp32
        assume.append("FSDP mixed_precision PURE: gradients reduce-scattered in bf16 (--grad-dtype bf16)")
        return [*argv, "--grad-dtype", "bf16"]
    assume.append("FSDP mixed_precision DEFAULT: gradients reduce-scattered in fp32 (the framework's default)")
    return argv


def attention_argv(row: dict[str, Any], assume: list[str]) -> list[str]:
    """MPT's attention kernel: ``attn_impl: triton`` in every row (``scripts/train/benchmarking/
    submit_benchmarks.py`` ``--attn_impl`` default ``triton`` at 300cc5c58, b2a43a147 and 5e85bd62d,
    written into the yaml's ``attn_config``; ``triton-pre-mlir`` an install requirement of all three),
    llm-foundry's copy of flash-attention's pre-MLIR Triton kernel: ``--attention-kernel triton``,
    FlashAttention v1's rates on the row's GPU (docs/devices.md, "The pre-MLIR Triton kernel")."""
    del row
    assume.append("MPT attn_impl triton (submit_benchmarks.py default): flash-attention's pre-MLIR Triton kernel "
                  "(--attention-kernel triton: FlashAttention v1's rates, which its docstring says it is 'slightly "
                  "slower' than; both run mma.sync on A100 and H100)")
    return ["--attention-kernel", "triton"]


FOUNDRY = RunsSection(FOUNDRY_RUNS, FOUNDRY_HEADING, (
    "Every row of MosaicML llm-foundry's published MPT throughput tables (`scripts/train/benchmarking/",
    "README.md` at 495218376, unchanged since 5e85bd62d; `benchmarks/data/foundry-runs.json`): MPT 125M-70B,",
    "seq 512-65536, 8-512 A100 40GB / A100 80GB / H100 80GB GPUs, Composer's torch FSDP. A source the cost",
    "model was never calibrated on: it is not in `band.json` nor read by `benchmarks/calibrate_sustained.py`,",
    "and nothing was tuned after seeing it (`benchmarks/fidelity_foundry.py` says how the rows are planned).",
    "Compared in tokens per second per GPU.", ""),
    groups=(("GPU", lambda r: f"{r['hardware']['gpu']} {r['precision']}"),
            ("activation checkpointing", lambda r: str(r["recompute"])),
            ("sharding", lambda r: str(r["parallelism"]["zero"]).split()[1])),
    unit=False, assumptions=False)
