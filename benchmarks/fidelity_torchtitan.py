"""The out-of-sample check of ``benchmarks/fidelity.py`` from torchtitan's 2025 benchmarks
(``benchmarks/data/torchtitan-2025-runs.json``; ``benchmarks/data/torchtitan-2025-runs.md`` says
where each field comes from): the async TP tables of June 2025 (Llama 3.1 70B on 256 and 8B on 64
Grand Teton H100s, bf16 / float8 tensorwise / float8 rowwise, vanilla against async TP), Trainy's
Llama 3.1 8B on 32 and 64 H200s (float8, TPS and memory) and torchao's float8 README's Llama 3 8B
on 8 H100s (bf16 / tensorwise / rowwise, TPS and memory). None of it is in ``band.json`` nor read by
``benchmarks/calibrate_sustained.py``; nothing was tuned after seeing it.

The rows are planned as the ``torchtitan_202412`` rows of the published set are (``--framework
torchtitan``, the 96GB device file of Grand Teton at 500 W, ``--compile``, torchtitan's op-level SAC
as ``--recompute selective``, ``--tp-comm-overlap`` for async TP, ``--precision fp8`` for torchao's
float8 tensorwise linears; with a tp dimension their TP all-gathers in float8 as torchao's float8 TP
runs them: ``spmdkit.cost.float8_tp``). torchao's rowwise recipe (torchtitan ``--float8.recipe_name
rowwise``; torchtitan ``torchtitan/components/quantization/float8.py`` at 820504e:
``Float8LinearConfig.from_recipe_name``) is planned with ``--float8-recipe rowwise``
(:func:`float8_recipe_flags`): the axiswise casts and their backward re-scales, the backward GEMMs'
rescale kernels, and under TP the all-gathers in bf16 (``parallelize_llama`` at 820504e:
``enable_float8_tensorwise_tp = enable_float8_linear and not float8_is_rowwise``);
``spmdkit.cost.torchao_casts``. Its forward GEMM (PyTorch's rowwise CUTLASS ``_scaled_mm``) is
priced at cuBLAS's tensorwise float8 rate, an assumption no source settles (each row's
``assumptions`` says so). A float8 feature the planner does not model would be counted unsupported
by :func:`float8_unsupported` (none of the rows ran one now).

FSDP2's float8 all-gather (``--float8.enable_fsdp_float8_all_gather``, torchao
``torchao/float8/fsdp_utils.py``: ``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`` casts
the weight's shard to float8 and FSDP2 gathers 1 byte an element; with
``precompute_float8_dynamic_scale_for_fsdp`` one amax all-reduce after each optimizer step) is
planned with ``--fsdp-float8-all-gather`` (:func:`fsdp_float8_flags`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fidelity_tables import RunsSection

TORCHTITAN_2025_RUNS = Path(__file__).resolve().parent / "data" / "torchtitan-2025-runs.json"
TORCHTITAN_2025_HEADING = "## Out-of-sample check: torchtitan's 2025 benchmarks (async TP, float8, H200)"


def float8_unsupported(row: dict[str, Any]) -> str | None:
    """The torchao float8 feature of ``row`` the planner does not model (the module's docstring), or
    None: torchao's ``rowwise_with_gw_hp`` recipe (its grad_weight GEMM in bf16), which no row ran.
    Rowwise scaling (:func:`float8_recipe_flags`) and FSDP2's float8 all-gather
    (:func:`fsdp_float8_flags`) are modelled."""
    if "rowwise_with_gw_hp" in str(row.get("precision") or "").lower():
        return "float8 rowwise_with_gw_hp (torchao recipe: a bf16 grad_weight GEMM beside float8 ones)"
    return None


#: what the rowwise rows' plans assume of the rowwise linear's time (spmdkit.cost.torchao_rowwise)
ROWWISE_RATE_ASSUMPTION = ("each rowwise float8 linear timed by torchao's published H100 table of the recipe "
                           "(docs/static/fp8-rowwise-perf.png at 4c8086744, LN -> Linear -> Sigmoid fwd + bwd over "
                           "bf16, torch 2.8.0a0+git48807d5) at its shape clamped into the table's 1024..32768: the "
                           "TP 8 shards' N = 128 (wk, wv) and M = 98304 / 131072 lie outside it")


def float8_recipe_flags(row: dict[str, Any], assume: list[str] | None = None) -> list[str]:
    """``--float8-recipe rowwise`` for a row that ran torchao's rowwise recipe (``precision`` names
    it: torchtitan's ``--float8.recipe_name rowwise``), with :data:`ROWWISE_RATE_ASSUMPTION` in
    ``assume``; else none (tensorwise, the planner's default, or bf16)."""
    p = str(row.get("precision") or "").lower()
    if "float8" not in p or "rowwise" not in p:
        return []
    if assume is not None:
        assume.append(ROWWISE_RATE_ASSUMPTION)
    return ["--float8-recipe", "rowwise"]


#: the published (in-sample) torchtitan 2024-12 rows that ran ``train_configs/llama3_405b.toml`` at
#: 9dec370 (the rows' companion), whose ``[float8]`` sets ``enable_float8_linear``,
#: ``enable_fsdp_float8_all_gather`` and ``precompute_float8_dynamic_scale_for_fsdp`` true (the 8B and
#: 70B tomls have ``enable_float8_linear = false``: their float8 rows' flags are not stated, and
#: torchtitan's defaults are off); by id prefix
FSDP_FLOAT8_TOML_ROWS = ("torchtitan_202412_t5_405b", "torchtitan_202412_t6_405b")


def fsdp_float8_flags(row: dict[str, Any], assume: list[str] | None = None) -> list[str]:
    """``--fsdp-float8-all-gather`` for a row that ran torchao's float8 all-gather under FSDP2
    (``parallelism.fsdp_float8_all_gather``: ``--float8.enable_fsdp_float8_all_gather`` with
    ``--float8.precompute_float8_dynamic_scale_for_fsdp`` on its command line; or the 405B toml of
    :data:`FSDP_FLOAT8_TOML_ROWS`, noted in ``assume``); else none. A toml row whose FSDP degree
    (``dp_shard``) is 1 gets none: torchtitan's ``Float8Handler`` (``torchtitan.float8`` at
    9dec370) sets ``enable_fsdp_float8_all_gather = parallel_dims.dp_shard_enabled and ...``, so
    Table 6's "FSDP 1, CP 8" row gathered its weights in bf16 over cp."""
    if row["id"].startswith(FSDP_FLOAT8_TOML_ROWS) and "float8" in str(row.get("precision") or "").lower():
        if int(row["parallelism"].get("dp") or 1) <= 1:
            if assume is not None:
                assume.append("FSDP2 gathers in bf16: the toml's enable_fsdp_float8_all_gather is off where dp_shard = 1 "
                              "(torchtitan.float8 at 9dec370: parallel_dims.dp_shard_enabled and ...)")
            return []
        if assume is not None:
            assume.append("FSDP2 float8 all-gather with precomputed scales (not stated; llama3_405b.toml at 9dec370: "
                          "enable_fsdp_float8_all_gather = true, precompute_float8_dynamic_scale_for_fsdp = true)")
        return ["--fsdp-float8-all-gather"]
    if row["parallelism"].get("fsdp_float8_all_gather"):
        if not row["parallelism"].get("precompute_float8_dynamic_scale"):
            raise ValueError(f"{row['id']}: the float8 all-gather without precompute_float8_dynamic_scale_for_fsdp "
                             f"(an amax all-reduce a weight before each gather) is not modelled")
        return ["--fsdp-float8-all-gather"]
    return []


#: torchtitan commits whose ``build_cross_entropy_loss`` compiles the loss under ``training.compile``
#: (``torchtitan/components/loss.py``: ``loss_fn = torch.compile(loss_fn)`` from bbb1b616e, 2025-04-02),
#: by the id prefix of the rows that ran them: the async TP tables (820504e) and Trainy's H200 runs
#: (e7c0cae). The 2024-12 rows (9dec370: ``# if job_config.training.compile: loss_fn =
#: torch.compile(loss_fn)``, commented out) and torchao's README rows (torchtitan 0.0.2, 0da8901b1:
#: ``# compiled_cross_entropy_loss = torch.compile(cross_entropy_loss)``) ran the eager loss.
COMPILED_LOSS_ROWS = ("torchtitan_202506_",)


def loss_flags(row: dict[str, Any]) -> list[str]:
    """``--cross-entropy-kernel compiled`` for a row whose torchtitan compiles the loss
    (:data:`COMPILED_LOSS_ROWS`) and which ran with ``training.compile``; else none."""
    if row["id"].startswith(COMPILED_LOSS_ROWS) and row["parallelism"].get("torch_compile"):
        return ["--cross-entropy-kernel", "compiled"]
    return []


def _quantization(r: dict[str, Any]) -> str:
    p = str(r["precision"])
    return "float8 tensorwise" if "tensorwise" in p else "float8 rowwise" if "rowwise" in p else "bf16"


TORCHTITAN_2025 = RunsSection(TORCHTITAN_2025_RUNS, TORCHTITAN_2025_HEADING, (
    "The runs of `benchmarks/data/torchtitan-2025-runs.json`: torchtitan's async TP tables of June 2025",
    "(`benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md`: Llama 3.1 70B on 256 and 8B on 64 Grand Teton",
    "H100s, FSDP x TP 8, bf16 / float8 tensorwise / float8 rowwise, vanilla against async TP), Trainy's Llama 3.1",
    "8B on 32 and 64 H200s (`benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md`, float8 with FSDP float8",
    "all-gather) and torchao's float8 README's Llama 3 8B on 8 H100s (`torchao/float8/README.md`, 8c81863ba).",
    "Planned as the torchtitan rows of 2024-12 above are (`--framework torchtitan`, the 96GB device file at",
    "500 W, `--compile`, `--tp-comm-overlap` for async TP, `--precision fp8` for float8 tensorwise,",
    "`--float8-recipe rowwise` for float8 rowwise, `--fsdp-float8-all-gather` for FSDP2's float8 all-gather;",
    "`benchmarks/fidelity_torchtitan.py`). Nothing in the cost model was calibrated on them: they are",
    "kept out of `band.json`, the summary above and `benchmarks/calibrate_sustained.py`.", ""),
    groups=(("quantization", _quantization),
            ("TP", lambda r: "async" if r["parallelism"].get("async_tp") else "vanilla" if r["parallelism"]["tp"] > 1
             else "none")))
