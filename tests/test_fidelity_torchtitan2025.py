"""The out-of-sample set of torchtitan's 2025 benchmarks (benchmarks/data/torchtitan-2025-runs.json,
benchmarks/fidelity_torchtitan.py): every row expressed as the torchtitan_202412 rows are, the rowwise
rows with --float8-recipe rowwise; the transcription against each row's quoted source line;
one command line by hand; the set kept out of the calibration."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench() -> ModuleType:
    name = "fidelity_bench"  # the same module tests/test_fidelity.py loads, when both run in one process
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "fidelity.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


FID = _bench()
FT = importlib.import_module("fidelity_torchtitan")  # benchmarks/ is on sys.path once fidelity.py is loaded
TT: list[dict[str, Any]] = json.loads(FT.TORCHTITAN_2025_RUNS.read_text())
ROWMAP = {r["id"]: r for r in TT}
ROWWISE_ROWS = ["torchtitan_202506_asynctp_70b_256gpu_rowwise_vanillatp", "torchtitan_202506_asynctp_70b_256gpu_rowwise_asynctp",
                "torchtitan_202506_asynctp_8b_64gpu_rowwise_vanillatp", "torchtitan_202506_asynctp_8b_64gpu_rowwise_asynctp",
                "torchtitan_202503_torchao_8b_8gpu_rowwise"]
FP8_GATHER_ROWS = ["torchtitan_202503_torchao_8b_8gpu_tensorwise", "torchtitan_202506_h200_8b_32gpu_float8",
                   "torchtitan_202506_h200_8b_64gpu_float8"]


def _opt(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_every_row_is_expressed_or_unsupported_by_feature() -> None:
    # 17 rows: 12 async TP (70B and 8B x bf16 / tensorwise / rowwise x vanilla / async), 2 H200, 3 torchao
    assert len(TT) == 17 and len(ROWMAP) == 17
    expressed: list[str] = []
    unsupported: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as d:
        for row in TT:
            try:
                case = FID.express(row, Path(d))
            except FID.Unsupported as exc:
                unsupported.setdefault(str(exc), []).append(row["id"])
                continue
            expressed.append(row["id"])
            assert case.metric == "tokens_per_sec_per_gpu" and case.gpus == row["hardware"]["num_gpus"]
            assert _opt(case.argv, "--framework") == "torchtitan" and "--compile" in case.argv
            assert ("--tp-comm-overlap" in case.argv) == row["parallelism"]["async_tp"]
            assert _opt(case.argv, "--precision") == ("fp8" if "float8" in row["precision"] else "bf16")
            # torchao's rowwise recipe (--float8.recipe_name rowwise): the five rows that ran it
            rowwise = row["id"] in ROWWISE_ROWS
            assert (_opt(case.argv, "--float8-recipe") == "rowwise") if rowwise else "--float8-recipe" not in case.argv
            assert (FT.ROWWISE_RATE_ASSUMPTION in case.assumptions) == rowwise
            # FSDP2's float8 all-gather (--float8.enable_fsdp_float8_all_gather): the three rows that ran it
            assert ("--fsdp-float8-all-gather" in case.argv) == (row["id"] in FP8_GATHER_ROWS)
    assert unsupported == {}  # issue 26: no row unsupported for want of fp8
    assert len(expressed) == 17 and set(FP8_GATHER_ROWS) | set(ROWWISE_ROWS) <= set(expressed)


def test_the_measured_figures_are_the_quoted_source_lines() -> None:
    # every measured figure is a cell of the row's quoted source line (never edited), and its source names a
    # repository, a path and a 40-digit commit
    for row in TT:
        src, meas = row["source"], row["measured"]
        assert len(src["commit"]) == 40 and src["repo"] in ("pytorch/torchtitan", "pytorch/ao") and src["path"]
        cells = [c.strip() for c in src["source_row"].replace("(", "|").replace(")", "|").split("|")]
        assert f"{meas['tokens_per_sec_per_gpu']:g}" in cells, row["id"]
        if "memory_gib_max" in meas:
            assert f"{meas['memory_gib_max']:g}" in cells, row["id"]
    # the async TP table's two columns: the vanilla row reads the first, the async row the second
    van, asy = ROWMAP["torchtitan_202506_asynctp_70b_256gpu_tensorwise_vanillatp"], \
        ROWMAP["torchtitan_202506_asynctp_70b_256gpu_tensorwise_asynctp"]
    assert van["source"]["source_row"] == asy["source"]["source_row"].replace("Async TP tokens/sec 942.4",
                                                                            "Vanilla TP tokens/sec 809.8")
    assert "| float8 tensorwise | 809.8 | 942.4 | 1.16 |" in van["source"]["source_row"]
    assert (van["measured"]["tokens_per_sec_per_gpu"], asy["measured"]["tokens_per_sec_per_gpu"]) == (809.8, 942.4)


def test_the_70b_async_tp_float8_row_by_hand() -> None:
    # asyncTP_llama3_h100_2025-06_torchtitan.md: "Llama3 70b on 256 H100s with FSDP=32, TP=8, torch.compile, full
    # AC, local batch size 16", float8 tensorwise, async TP; Grand Teton H100 96GB HBM2e at 500 W;
    # llama3_70b.toml at 820504e: seq_len 8192, no FSDP float8 all-gather; 70B: 80 layers, dim 8192, 64 heads,
    # 8 kv heads, ffn 28672 (1.3 x int(2 x 4 x 8192 / 3) rounded up to 4096)
    row = ROWMAP["torchtitan_202506_asynctp_70b_256gpu_tensorwise_asynctp"]
    with tempfile.TemporaryDirectory() as d:
        case = FID.express(row, Path(d))
        dev = json.loads(Path(_opt(case.argv, "--device")).read_text())
    argv = case.argv
    assert _opt(argv, "--mesh") == "dp=32,tp=8" and _opt(argv, "--strategy") == "dp,megatron,sp,zero3"
    assert _opt(argv, "--precision") == "fp8" and _opt(argv, "--recompute") == "full"
    assert {"--compile", "--tp-comm-overlap"} <= set(argv) and "--grad-accum" not in argv
    assert _opt(argv, "--batch") == "512"  # local batch 16 on each of the 32 FSDP ranks
    assert dev["base"] == "h100" and dev["hbm_gb_per_s"] == 2400 and dev["power_limit_w"] == 500
    assert case.device_memory_gib == 96.0 and case.gpus == 256
    cfg = json.loads(_opt(argv, "--model-config"))
    assert (cfg["layers"], cfg["hidden"], cfg["heads"], cfg["kv_heads"], cfg["ffn"], cfg["vocab"], cfg["seq"]) == \
        (80, 8192, 64, 8, 28672, 128256, 8192)
    hidden = int(1.3 * int(2 * 4 * 8192 / 3))  # torchtitan's FeedForward: ffn_dim_multiplier 1.3, multiple_of 4096
    assert 4096 * ((hidden + 4095) // 4096) == cfg["ffn"]
    # torchtitan's tps is per device: local tokens over TP 8 (metrics.py: ntokens / (time x non_data_parallel_size)),
    # the same figure as fidelity's global tokens over 256 GPUs
    par = row["parallelism"]
    assert par["global_batch"] * 8192 / case.gpus == par["local_batch"] * 8192 / par["tp"] == 16384
    # the 8B table: per op SAC is torchtitan's op-level selective policy, local batch 12 over FSDP 8
    with tempfile.TemporaryDirectory() as d:
        small = FID.express(ROWMAP["torchtitan_202506_asynctp_8b_64gpu_bf16_vanillatp"], Path(d)).argv
    assert _opt(small, "--recompute") == "selective" and _opt(small, "--batch") == "96"
    assert _opt(small, "--mesh") == "dp=8,tp=8" and "--tp-comm-overlap" not in small


def test_the_float8_features_name_only_these_rows() -> None:
    # no row of the other sets ran torchao's rowwise scaling or FSDP2's float8 all-gather as a row field: the
    # check moves none of them
    data = ROOT / "benchmarks" / "data"
    for f in ("published-runs.json", "moe-runs.json", "outside-runs.json", "nemo-runs.json", "nemo-long-runs.json",
              "foundry-runs.json"):
        assert all(FT.float8_unsupported(r) is None for r in json.loads((data / f).read_text())), f
    assert FT.float8_unsupported(ROWMAP["torchtitan_202506_asynctp_8b_64gpu_rowwise_asynctp"]) is None  # modelled
    assert FT.float8_recipe_flags(ROWMAP["torchtitan_202506_asynctp_8b_64gpu_rowwise_asynctp"]) == \
        ["--float8-recipe", "rowwise"]
    assert FT.float8_recipe_flags(ROWMAP["torchtitan_202506_asynctp_8b_64gpu_tensorwise_asynctp"]) == []
    for f in ("published-runs.json", "moe-runs.json"):  # no in-sample row is rowwise: the summaries do not move
        assert all(FT.float8_recipe_flags(r) == [] for r in json.loads((data / f).read_text())), f
    assert FT.float8_unsupported(ROWMAP["torchtitan_202506_h200_8b_64gpu_float8"]) is None  # modelled
    assert FT.fsdp_float8_flags(ROWMAP["torchtitan_202506_h200_8b_64gpu_float8"]) == ["--fsdp-float8-all-gather"]
    assert FT.float8_unsupported(ROWMAP["torchtitan_202506_asynctp_70b_256gpu_tensorwise_vanillatp"]) is None


def test_an_h200_row_plans_on_the_h200_preset() -> None:
    # the Trainy rows' GPU (8 H200 a host over NVLink: the SXM part, 141 GB): --device h200, its 141 GB the fit;
    # its FSDP float8 all-gather and compiled loss as flags
    row = ROWMAP["torchtitan_202506_h200_8b_32gpu_float8"]
    with tempfile.TemporaryDirectory() as d:
        case = FID.express(row, Path(d))
    assert "--fsdp-float8-all-gather" in case.argv and _opt(case.argv, "--cross-entropy-kernel") == "compiled"
    assert _opt(case.argv, "--device") == "h200" and case.device_memory_gib == pytest.approx(141e9 / 2**30)
    assert _opt(case.argv, "--mesh") == "dp=32,tp=1" and _opt(case.argv, "--strategy") == "dp,zero3"
    assert _opt(case.argv, "--batch") == "64" and _opt(case.argv, "--recompute") == "selective"
    assert case.memory_measured_gib == 47.96


def test_the_compiled_loss_goes_to_the_rows_whose_torchtitan_compiles_it() -> None:
    # torchtitan components/loss.py: torch.compile(loss_fn) under training.compile from bbb1b616e (2025-04);
    # 820504e (async TP tables) and e7c0cae (Trainy) have it, 9dec370 (2024-12) and 0da8901b1 (torchao's
    # README table) comment it out
    flag = ["--cross-entropy-kernel", "compiled"]
    assert FT.loss_flags(ROWMAP["torchtitan_202506_h200_8b_32gpu_float8"]) == flag
    assert FT.loss_flags(ROWMAP["torchtitan_202506_asynctp_8b_64gpu_bf16_vanillatp"]) == flag
    assert FT.loss_flags(ROWMAP["torchtitan_202503_torchao_8b_8gpu_bf16"]) == []
    published = json.loads((ROOT / "benchmarks" / "data" / "published-runs.json").read_text())
    if isinstance(published, dict):
        published = published["runs"]
    assert not [r["id"] for r in published if FT.loss_flags(r)]
    row = copy.deepcopy(ROWMAP["torchtitan_202506_h200_8b_32gpu_float8"])
    row["parallelism"]["fsdp_float8_all_gather"] = False
    with tempfile.TemporaryDirectory() as d:
        assert _opt(FID.express(row, Path(d)).argv, "--cross-entropy-kernel") == "compiled"


def test_the_in_sample_405b_rows_gather_in_float8_as_their_toml_says() -> None:
    # train_configs/llama3_405b.toml at 9dec370: enable_fsdp_float8_all_gather = true,
    # precompute_float8_dynamic_scale_for_fsdp = true; the 8B / 70B tomls: enable_float8_linear = false
    published = json.loads((ROOT / "benchmarks" / "data" / "published-runs.json").read_text())
    if isinstance(published, dict):
        published = published["runs"]
    # except Table 6's "FSDP 1, CP 8" row: torchtitan/float8.py at 9dec370 turns the option on only where
    # parallel_dims.dp_shard_enabled (dp_shard > 1)
    flagged = []
    for row in published:
        assume: list[str] = []
        if FT.fsdp_float8_flags(row, assume):
            flagged.append(row["id"])
            assert "llama3_405b.toml at 9dec370" in assume[0]
    assert sorted(flagged) == ["torchtitan_202412_t5_405b_512gpu_12", "torchtitan_202412_t5_405b_512gpu_13",
                               "torchtitan_202412_t6_405b_512gpu_14", "torchtitan_202412_t6_405b_512gpu_15",
                               "torchtitan_202412_t6_405b_512gpu_16"]
    row17 = next(r for r in published if r["id"] == "torchtitan_202412_t6_405b_512gpu_17")
    assume = []
    assert row17["parallelism"]["dp"] == 1 and FT.fsdp_float8_flags(row17, assume) == []
    assert "off where dp_shard = 1" in assume[0]


def test_async_tp_is_predicted_faster_than_vanilla_tp() -> None:
    # the 70B bf16 pair: measured 597.3 -> 652.4 tokens/s a GPU (1.09x); the prediction orders them too
    rows = [ROWMAP["torchtitan_202506_asynctp_70b_256gpu_bf16_vanillatp"],
            ROWMAP["torchtitan_202506_asynctp_70b_256gpu_bf16_asynctp"]]
    res, uns = FID.evaluate(rows)
    assert not uns and [r["measured"] for r in res] == [597.3, 652.4]
    assert 1.0 < res[1]["predicted"] / res[0]["predicted"] < 1.25
    assert FID.summarise(res, uns)["pairs_in_order"] == 1


def test_the_set_is_an_out_of_sample_section() -> None:
    # its own section of docs/fidelity.md (fidelity.py --write), out of band.json's runs and of the calibration
    assert FT.TORCHTITAN_2025 in FID.EXTRA_RUNS and FT.TORCHTITAN_2025_RUNS not in (FID.RUNS, FID.MOE_RUNS)
    calibrate = (ROOT / "benchmarks" / "calibrate_sustained.py").read_text()
    assert "torchtitan-2025" not in calibrate and "TORCHTITAN_2025" not in calibrate and "fidelity_torchtitan" \
        not in calibrate
    published = {r["id"] for r in json.loads(FID.RUNS.read_text())} | {r["id"] for r in json.loads(FID.MOE_RUNS.read_text())}
    assert not published & set(ROWMAP)
    band = json.loads((ROOT / "src" / "spmdkit" / "cost" / "band.json").read_text())
    assert band["runs_file"] == "benchmarks/data/published-runs.json" and "torchtitan-2025" not in json.dumps(band)
