"""Writes benchmarks/data/torchtitan-2025-runs.json: the rows transcribed by hand from torchtitan's 2025
benchmark files and torchao's float8 README (each row's ``source`` names repository, path, commit and the
quoted line; benchmarks/data/torchtitan-2025-runs.md says where every field comes from).

    python benchmarks/torchtitan_2025_build.py
"""

import json
from pathlib import Path

TT = "pytorch/torchtitan"
ASYNC_PATH = "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
ASYNC_COMMIT = "2887250bbd9103d0bc997ea2efb3a525b5e5dbc0"
H200_PATH = "benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"
H200_COMMIT = "cbccb387871a5e1f522c1e222c51ab88b03c0392"
AO_PATH = "torchao/float8/README.md"
AO_COMMIT = "8c81863ba85cce742244c0151c6683c5696bbe04"
GT = "H100 (SXM-class, 96GB HBM2e, 2.4 TB/s) at 500 W power limit"
M8 = {"name": "Llama 3.1 8B", "layers": 32, "hidden": 4096, "ffn_hidden": 14336, "heads": 32, "kv_heads": 8}
M70 = {"name": "Llama 3.1 70B", "layers": 80, "hidden": 8192, "ffn_hidden": 28672, "heads": 64, "kv_heads": 8}
ARCH = "Llama 3: RMSNorm, SwiGLU, RoPE (theta 500000), GQA, untied embeddings"
PREC = {"bf16": "bf16", "tensorwise": "bf16 + float8 linears (torchao, tensorwise)",
        "rowwise": "bf16 + float8 linears (torchao, rowwise)"}
TABLE_NAME = {"bf16": "None (bfloat16)", "tensorwise": "float8 tensorwise", "rowwise": "float8 rowwise"}


def model(m, commit, seq=8192):
    return {"name": m["name"], "arch": ARCH, "params_b": None, "layers": m["layers"], "hidden": m["hidden"],
            "ffn_hidden": m["ffn_hidden"], "heads": m["heads"], "kv_heads": m["kv_heads"], "vocab": 128256,
            "seq_len": seq, "tied_embeddings": False, "moe": None}


def model_inferences(commit):
    return {
        "model.arch": f"torchtitan torchtitan/models/llama3/model.py at {commit}: RMSNorm, SwiGLU FeedForward, RoPE theta 500000, GQA",
        "model.layers": f"torchtitan torchtitan/models/llama3/__init__.py llama3_configs at {commit}",
        "model.hidden": f"torchtitan llama3_configs at {commit}",
        "model.ffn_hidden": "torchtitan FeedForward: multiple_of * ceil(int(ffn_dim_multiplier * int(2*4*dim/3)) / multiple_of) (8B: 1.3, 1024 -> 14336; 70B: 1.3, 4096 -> 28672)",
        "model.heads": f"torchtitan llama3_configs at {commit}",
        "model.kv_heads": f"torchtitan llama3_configs at {commit} (n_kv_heads=8)",
        "model.vocab": "Llama 3 tiktoken tokenizer (assets/tokenizer/original/tokenizer.model): 128000 + 256 reserved special tokens",
        "model.seq_len": f"not printed in the table; seq_len = 8192 in torchtitan/models/llama3/train_configs/llama3_{{8b,70b}}.toml at {commit}",
        "model.tied_embeddings": "torchtitan Transformer has separate tok_embeddings and output Linear",
        "model.moe": "dense",
        "parallelism.ep": "dense",
        "parallelism.sequence_parallel": "torchtitan apply_tp shards the norms' sequence (SequenceParallel) whenever TP > 1",
        "parallelism.zero": "torchtitan data_parallel_shard_degree = FSDP2 (fully_shard, reshard_after_forward)",
        "parallelism.grad_accum": "no gradient accumulation (not stated; torchtitan trains local_batch_size a step)",
    }


BASIS_MODEL = {k: "inferred" for k in ("model.arch", "model.layers", "model.hidden", "model.ffn_hidden", "model.heads",
                                      "model.kv_heads", "model.vocab", "model.seq_len", "model.tied_embeddings")}
BASIS_MODEL.update({"model.name": "stated", "model.params_b": "not_stated", "model.moe": "not_stated"})

rows = []

# -- torchtitan's async TP benchmarks of June 2025 ---------------------------------------------------------------
ASYNC = {  # size: (gpus, dp, local batch, AC, heading, {quant: (vanilla, async)})
    "70b": (256, 32, 16, "full", "Llama3 70b on 256 H100s with FSDP=32, TP=8, torch.compile, full AC,  local batch size 16",
            {"bf16": ("597.3", "652.4", "1.09"), "tensorwise": ("809.8", "942.4", "1.16"), "rowwise": ("599.6", "624.8", "1.04")}),
    "8b": (64, 8, 12, "selective", "Llama3 8b on 64 H100s with FSDP=8, TP=8, torch.compile, per op SAC, local batch size 12",
           {"bf16": ("4378", "4809.4", "1.10"), "tensorwise": ("5078.1", "5570.1", "1.10"), "rowwise": ("3708.5", "3914.9", "1.06")}),
}
C = "820504e20d1149fbf0b98c567af24c4b0433b22d"
for size, (gpus, dp, lb, ac, heading, table) in ASYNC.items():
    m = M70 if size == "70b" else M8
    for quant, (van, asy, speed) in table.items():
        for which, val in (("vanilla", van), ("async", asy)):
            cells = f"| {TABLE_NAME[quant]} | {van} | {asy} | {speed} |"
            row = {
                "id": f"torchtitan_202506_asynctp_{size}_{gpus}gpu_{quant}_{which}tp",
                "source": {
                    "repo": TT, "path": ASYNC_PATH, "commit": ASYNC_COMMIT,
                    "ref": f"pytorch/torchtitan {ASYNC_PATH} (added {ASYNC_COMMIT[:9]}, 2025-06-16; runs at torchtitan 820504e, torch 38410cf9, torchao 6243040, 2025-06-13/14), table '{heading}'",
                    "companions": [
                        f"torchtitan torchtitan/models/llama3/train_configs/llama3_{size}.toml at {C[:9]} (seq_len 8192; [float8] enable_fsdp_float8_all_gather = false, precompute_float8_dynamic_scale_for_fsdp = false, filter_fqns = ['output'])",
                        f"torchtitan torchtitan/models/llama3/parallelize_llama.py at {C[:9]} (Float8ColwiseParallel / Float8RowwiseParallel / PrepareFloat8ModuleInput for tensorwise only; async TP: torch._inductor.config._micro_pipeline_tp, enable_symm_mem_for_group; op SAC _save_list)",
                        f"torchtitan torchtitan/components/quantization/float8.py at {C[:9]} (recipe_name rowwise: Float8LinearConfig.from_recipe_name, no FSDP float8 all-gather)",
                    ],
                    "source_row": f"{heading}: {cells} ({'Vanilla' if which == 'vanilla' else 'Async'} TP tokens/sec {val})",
                },
                "model": model(m, C),
                "hardware": {"gpu": GT, "num_gpus": gpus, "gpus_per_node": 8, "intra_node": "NVLink (fully connected)",
                             "inter_node": "RDMA backend network, 400 Gb/s per GPU", "cluster": "Meta Grand Teton"},
                "parallelism": {"tp": 8, "pp": 1, "dp": dp, "cp": 1, "ep": 1, "vp_chunks": None, "schedule": None,
                                "sequence_parallel": True, "zero": f"FSDP2 (fully sharded, degree {dp})",
                                "micro_batch": None, "local_batch": lb, "global_batch": lb * dp, "grad_accum": 1,
                                "async_tp": which == "async", "torch_compile": True,
                                "fsdp_float8_all_gather": False if quant != "bf16" else None},
                "recompute": ac,
                "precision": PREC[quant],
                "measured": {"tokens_per_sec_per_gpu": float(val),
                             "flops_definition": "torchtitan's tps: tokens per second per device (metrics.py: ntokens / (time x non_data_parallel_size)); no memory reported"},
                "basis": {**BASIS_MODEL, "hardware.gpu": "stated", "hardware.num_gpus": "stated", "hardware.gpus_per_node": "stated",
                          "hardware.intra_node": "stated", "hardware.inter_node": "stated", "hardware.cluster": "stated",
                          "parallelism.tp": "stated", "parallelism.pp": "inferred", "parallelism.dp": "stated",
                          "parallelism.cp": "inferred", "parallelism.ep": "inferred", "parallelism.vp_chunks": "not_stated",
                          "parallelism.schedule": "not_stated", "parallelism.sequence_parallel": "inferred",
                          "parallelism.zero": "inferred", "parallelism.micro_batch": "not_stated",
                          "parallelism.local_batch": "stated", "parallelism.global_batch": "inferred",
                          "parallelism.grad_accum": "inferred", "parallelism.async_tp": "stated",
                          "parallelism.torch_compile": "stated", "parallelism.fsdp_float8_all_gather": "inferred" if quant != "bf16" else "not_stated",
                          "recompute": "stated", "precision": "stated",
                          "measured.tokens_per_sec_per_gpu": "stated", "measured.flops_definition": "inferred"},
                "inferences": {**model_inferences(C),
                               "parallelism.pp": "the table names FSDP and TP only: pp 1, cp 1",
                               "parallelism.cp": "the table names FSDP and TP only: pp 1, cp 1",
                               "parallelism.global_batch": f"local batch {lb} x FSDP {dp} (torchtitan's local_batch_size is per data-parallel rank)",
                               "recompute": "full AC (70B) = activation_checkpoint.mode 'full'; per op SAC (8B) = mode 'selective', selective_ac_option 'op' (torchtitan's op-level policy: _save_list at 820504e)",
                               "precision": "bf16 = torchtitan's default mixed precision (FSDP2 param_dtype bf16, reduce_dtype fp32); float8 = torchao Float8Linear on every nn.Linear but 'output' (the toml's filter_fqns)",
                               "parallelism.fsdp_float8_all_gather": "not stated: the toml's enable_fsdp_float8_all_gather = false at 820504e; a float8 recipe_name (tensorwise / rowwise) asserts it off (float8.py at 820504e)" if quant != "bf16" else "bf16: no float8",
                               "measured.flops_definition": "the table's tokens/sec is torchtitan's logged tps (per GPU: the same figure as the 2024-12 tables' TPS/GPU)",
                               "versions": "the file's table of versions says 2024/06/13 for torchao and torchtitan: the commits are of 2025-06-13 (torchtitan 820504e is 2025-06-13)"},
            }
            if quant == "bf16":
                del row["parallelism"]["fsdp_float8_all_gather"]
                del row["basis"]["parallelism.fsdp_float8_all_gather"]
                del row["inferences"]["parallelism.fsdp_float8_all_gather"]
            rows.append(row)

# -- Trainy on WhiteFiber, H200, June 2025 ---------------------------------------------------------------------
E = "e7c0cae934df78d6e9c2835f42ff1f757dc3fddc"
for nodes, tps, mem in ((4, 10938, 47.96), (8, 10753, 46.97)):
    gpus = 8 * nodes
    rows.append({
        "id": f"torchtitan_202506_h200_8b_{gpus}gpu_float8",
        "source": {
            "repo": TT, "path": H200_PATH, "commit": H200_COMMIT,
            "ref": f"pytorch/torchtitan {H200_PATH} (added {H200_COMMIT[:9]}, 2025-07-11; Trainy on WhiteFiber, June 2025; torchtitan e7c0cae, torchao 0afa4c1, torch 2.8.0a0+5228986c39 of NGC 25.05)",
            "companions": [
                f"torchtitan torchtitan/models/llama3/train_configs/llama3_8b.toml at {E[:9]} (seq_len 8192; activation_checkpoint mode 'selective', selective_ac_option 'op'; data_parallel_shard_degree -1, tensor/pipeline/context parallel 1; filter_fqns ['output'])",
                f"torchtitan torchtitan/components/quantization/float8.py at {E[:9]} (no recipe_name: Float8LinearConfig(enable_fsdp_float8_all_gather, force_recompute_fp8_weight_in_bwd), tensorwise; precompute_scale after each optimizer step)",
                "the command line of the file: torchrun --nnodes $NUM_NODES --nproc_per_node 8 torchtitan/train.py --job.config-file torchtitan/models/llama3/train_configs/llama3_8b.toml --training.local_batch_size=2 --training.compile --model.converters=\"float8\" --float8.enable_fsdp_float8_all_gather --float8.precompute_float8_dynamic_scale_for_fsdp --float8.force_recompute_fp8_weight_in_bwd",
            ],
            "source_row": f"| {nodes} | {tps} | {mem} | (NUM_NODES, TPS/GPU, Memory(GiB), sampled at the 100th iteration)",
        },
        "model": model(M8, E),  # seq_len of llama3_8b.toml
        "hardware": {"gpu": "H200 (SXM, 141 GB HBM3e)", "num_gpus": gpus, "gpus_per_node": 8,
                     "intra_node": "NVLink", "inter_node": "RDMA fabric, 400 Gb/s (Mellanox CX-7) per GPU",
                     "cluster": "WhiteFiber (Trainy)"},
        "parallelism": {"tp": 1, "pp": 1, "dp": gpus, "cp": 1, "ep": 1, "vp_chunks": None, "schedule": None,
                        "sequence_parallel": False, "zero": f"FSDP2 (fully sharded, degree {gpus})",
                        "micro_batch": None, "local_batch": 2, "global_batch": 2 * gpus, "grad_accum": 1,
                        "async_tp": False, "torch_compile": True, "fsdp_float8_all_gather": True,
                        "precompute_float8_dynamic_scale": True, "force_recompute_fp8_weight_in_bwd": True},
        "recompute": "selective",
        "precision": PREC["tensorwise"],
        "measured": {"tokens_per_sec_per_gpu": float(tps), "memory_gib_max": mem,
                     "flops_definition": "TPS/GPU and Memory(GiB) of torchtitan's log at the 100th iteration (memory: torch.cuda max reserved of the logging rank, GiB)"},
        "basis": {**BASIS_MODEL, "hardware.gpu": "inferred", "hardware.num_gpus": "stated", "hardware.gpus_per_node": "stated",
                  "hardware.intra_node": "stated", "hardware.inter_node": "stated", "hardware.cluster": "stated",
                  "parallelism.tp": "inferred", "parallelism.pp": "inferred", "parallelism.dp": "inferred",
                  "parallelism.cp": "inferred", "parallelism.ep": "inferred", "parallelism.vp_chunks": "not_stated",
                  "parallelism.schedule": "not_stated", "parallelism.sequence_parallel": "inferred",
                  "parallelism.zero": "inferred", "parallelism.micro_batch": "not_stated",
                  "parallelism.local_batch": "stated", "parallelism.global_batch": "inferred",
                  "parallelism.grad_accum": "inferred", "parallelism.async_tp": "inferred",
                  "parallelism.torch_compile": "stated", "parallelism.fsdp_float8_all_gather": "stated",
                  "parallelism.precompute_float8_dynamic_scale": "stated", "parallelism.force_recompute_fp8_weight_in_bwd": "stated",
                  "recompute": "inferred", "precision": "stated",
                  "measured.tokens_per_sec_per_gpu": "stated", "measured.memory_gib_max": "stated", "measured.flops_definition": "inferred"},
        "inferences": {**model_inferences(E),
                       "hardware.gpu": "'8 NVIDIA H200 GPUs connected via NVLink' a host: the SXM part (HGX H200, 141 GB); power limit not stated (the default, 700 W)",
                       "parallelism.tp": "llama3_8b.toml at e7c0cae: tensor, pipeline, context parallel degree 1, data_parallel_shard_degree -1 (every GPU); the command line overrides none",
                       "parallelism.dp": f"data_parallel_shard_degree -1: FSDP over all {gpus} GPUs",
                       "parallelism.pp": "llama3_8b.toml at e7c0cae: pipeline_parallel_degree 1",
                       "parallelism.cp": "llama3_8b.toml at e7c0cae: context_parallel_degree 1",
                       "parallelism.global_batch": f"local batch 2 x FSDP {gpus}",
                       "parallelism.async_tp": "TP 1",
                       "recompute": "llama3_8b.toml at e7c0cae: mode 'selective', selective_ac_option 'op'",
                       "parallelism.sequence_parallel": "TP 1",
                       "measured.flops_definition": "torchtitan's logged tps (per device) and memory (max reserved, GiB) at step 100"},
    })

# -- torchao's float8 README: e2e training benchmarks on 8 H100 --------------------------------------------------
AO = {"bf16": ("none (bfloat16)", "47.65", "6150", "-"),
      "tensorwise": ("tensorwise with float8 all-gather", "47.77", "7689.5", "25.03%"),
      "rowwise": ("rowwise with bfloat16 all-gather", "47.79", "6768", "10.05%")}
for quant, (name, mem, tps, speed) in AO.items():
    par = {"tp": 1, "pp": 1, "dp": 8, "cp": 1, "ep": 1, "vp_chunks": None, "schedule": None,
           "sequence_parallel": False, "zero": "FSDP2 (fully sharded, degree 8)", "micro_batch": None,
           "local_batch": 1, "global_batch": 8, "grad_accum": 1, "async_tp": False, "torch_compile": True}
    if quant == "tensorwise":
        par.update({"fsdp_float8_all_gather": True, "precompute_float8_dynamic_scale": True,
                    "force_recompute_fp8_weight_in_bwd": True})
    elif quant == "rowwise":
        par["fsdp_float8_all_gather"] = False
    row = {
        "id": f"torchtitan_202503_torchao_8b_8gpu_{quant}",
        "source": {
            "repo": "pytorch/ao", "path": AO_PATH, "commit": AO_COMMIT,
            "ref": f"pytorch/ao {AO_PATH} (table added {AO_COMMIT[:9]}, 2025-03-12; unchanged to 927cbfb91, 2025-08-15), 'Training benchmarks' / 'e2e training benchmarks', NVIDIA H100: torch 2.7.0a0+gitb98af95, torchao 0.10.0+git890e0ac8, torchtitan 0.0.2",
            "companions": [
                f"pytorch/ao benchmarks/float8/training/float8_training_benchmark.sh and parse_torchtitan_logs.py at {AO_COMMIT[:9]} (run_train.sh with torchtitan/models/llama/train_configs/llama3_8b.toml --training.steps=100 --training.batch_size=1 --training.compile; tensorwise: --model.converters=float8 --float8.enable_fsdp_float8_all_gather --float8.precompute_float8_dynamic_scale_for_fsdp --float8.force_recompute_fp8_weight_in_bwd; rowwise: --model.converters=float8 --float8.recipe_name=rowwise; the median tps of steps 2-100, the max of the log's 'memory: X GiB')",
                "torchtitan torchtitan/models/llama/train_configs/llama3_8b.toml at 0da8901b1 (2025-03-11, the last torchtitan commit before the table; the same since 82afc842e, 2025-02-21, where that path begins): seq_len 8192, activation_checkpoint mode 'selective', selective_ac_option 'op', data_parallel_shard_degree -1",
            ],
            "source_row": f"| Llama3-8b     |  {name} | per op SAC               | {mem}             |  {tps}                | {speed}",
        },
        "model": model(M8, "0da8901b1"),
        "hardware": {"gpu": GT, "num_gpus": 8, "gpus_per_node": 8, "intra_node": "NVLink (fully connected)",
                     "inter_node": None, "cluster": "not stated (8xH100, single node)"},
        "parallelism": par,
        "recompute": "selective",
        "precision": PREC[quant],
        "measured": {"tokens_per_sec_per_gpu": float(tps), "memory_gib_max": float(mem),
                     "flops_definition": "median torchtitan tps of steps 2-100 (per device); Peak Memory (GB): the max of the log's 'memory: X GiB' (torch.cuda max reserved of the logging rank, GiB)"},
        "basis": {**BASIS_MODEL, "hardware.gpu": "inferred", "hardware.num_gpus": "stated", "hardware.gpus_per_node": "stated",
                  "hardware.intra_node": "inferred", "hardware.inter_node": "not_stated", "hardware.cluster": "not_stated",
                  "parallelism.tp": "inferred", "parallelism.pp": "inferred", "parallelism.dp": "inferred",
                  "parallelism.cp": "inferred", "parallelism.ep": "inferred", "parallelism.vp_chunks": "not_stated",
                  "parallelism.schedule": "not_stated", "parallelism.sequence_parallel": "inferred",
                  "parallelism.zero": "stated", "parallelism.micro_batch": "not_stated",
                  "parallelism.local_batch": "stated", "parallelism.global_batch": "inferred",
                  "parallelism.grad_accum": "inferred", "parallelism.async_tp": "inferred",
                  "parallelism.torch_compile": "stated", "recompute": "stated", "precision": "stated",
                  "measured.tokens_per_sec_per_gpu": "stated", "measured.memory_gib_max": "stated",
                  "measured.flops_definition": "inferred"},
        "inferences": {**model_inferences("0da8901b1"),
                       "model.seq_len": "stated in the README (sequence length 8192); llama3_8b.toml's seq_len 8192",
                       "hardware.gpu": "'8xH100' only: taken to be the PyTorch team's Meta H100 hosts, Grand Teton (96 GB HBM2e, 2.4 TB/s, 500 W power limit), on which the same team's torchtitan tables of 2024-12 and 2025-06 state they ran (not stated here; an H100 SXM 80GB at 700 W is the alternative)",
                       "hardware.intra_node": "one host of 8 H100s: NVLink",
                       "parallelism.tp": "the benchmark script uses FSDP2 only ('Other forms of parallelism supported in torchtitan are not yet supported in this script'): FSDP over the 8 GPUs",
                       "parallelism.dp": "data_parallel_shard_degree -1: FSDP over the 8 GPUs",
                       "parallelism.pp": "FSDP2 only (the benchmark script): pipeline degree 1",
                       "parallelism.cp": "FSDP2 only (the benchmark script): context parallel degree 1",
                       "parallelism.global_batch": "batch size 1 (--training.batch_size=1, per data-parallel rank) x 8",
                       "parallelism.async_tp": "TP 1", "parallelism.sequence_parallel": "TP 1",
                       "measured.flops_definition": "parse_torchtitan_logs.py at 8c81863ba: median of tps, max of memory, in GiB ('Peak Memory (GB)' in the table)"},
    }
    if quant == "tensorwise":
        row["basis"]["parallelism.precompute_float8_dynamic_scale"] = "stated"
        row["basis"]["parallelism.force_recompute_fp8_weight_in_bwd"] = "stated"
    if quant != "bf16":
        row["basis"]["parallelism.fsdp_float8_all_gather"] = "stated"
        row["inferences"]["parallelism.fsdp_float8_all_gather"] = ("'tensorwise with float8 all-gather': the script's FLOAT8_RECIPE_WITH_BEST_SETTINGS=tensorwise flags"
                                                                   if quant == "tensorwise" else "'rowwise with bfloat16 all-gather': --float8.recipe_name=rowwise")
    rows.append(row)

LOSS = ("the loss compiled (torchtitan components.loss build_cross_entropy_loss at {c}: torch.compile(loss_fn) under "
        "training.compile): planned as the eager fp32 cross-entropy of 9dec370 (not modelled)")
for r in rows:
    a = []
    rid, par = r["id"], r["parallelism"]
    if "202506" in rid:
        a.append(LOSS.format(c="820504e" if "asynctp" in rid else "e7c0cae"))
    if "tensorwise" in r["precision"] and par["tp"] > 1:
        a.append("torchao's float8 TP modelled (spmdkit.cost.float8_tp; torchao.float8.float8_tensor_parallel at 6243040): "
                 "PrepareFloat8ModuleInput casts each block input to float8 before its TP all-gather and "
                 "Float8RowwiseParallel the output gradient to e5m2 on its shard before the backward's, so those four "
                 "all-gathers a block move 1 byte an element, each sharded cast's amax all-reduced over tp (one fp32 "
                 "scalar, 11 a block); not modelled: those casts priced as Transformer Engine's (4 B a gathered "
                 "element, none after a norm) rather than on the shard")
    if "float8" in r["precision"] and r["recompute"] == "selective":
        a.append("per op SAC under float8 linears planned as under bf16 (every other linear's output saved): torchao's "
                 "Float8Linear calls torch.mm on Float8Tensors (float8_linear at 6243040), which float8_ops "
                 "implements as aten.mm by torch._scaled_mm, so the SAC policy (a dispatch mode, _save_list: aten.mm) "
                 "presumably sees aten.mm as under bf16; not checked on a GPU")
    if rid.startswith("torchtitan_202503"):
        a.append("8xH100 of unstated kind: Grand Teton's 96GB HBM2e at 500 W (the PyTorch team's other H100 tables); "
                 "an H100 SXM 80GB at 700 W is the alternative")
    if a:
        r["assumptions"] = a

out = Path(__file__).resolve().parent / "data" / "torchtitan-2025-runs.json"
with open(out, "w") as f:
    json.dump(rows, f, indent=1)
    f.write("\n")
print(len(rows), [r["id"] for r in rows])
