#!/usr/bin/env python3
"""How benchmarks/data/nemo-runs.json was made (benchmarks/data/nemo-runs.md): every DGX-H100 pre-training
row of NVIDIA-NeMo/Megatron-Bridge ``docs/performance-summary-archive.md`` (at :data:`HEAD`) whose model the
spmdkit catalog has, each with what its release's recipe (the Megatron-Bridge tag of :data:`TAGS`) sets,
as read by hand from that tag's ``scripts/performance`` and ``src/megatron/bridge/recipes``.

    python benchmarks/nemo_runs_build.py MEGATRON_BRIDGE_GIT_DIR benchmarks/data/nemo-runs.json

The table lines are parsed from the archive (``git show HEAD:docs/performance-summary-archive.md``) and
kept verbatim in ``source.source_row``; ``source.first_commit`` is ``git log -S`` of the line."""
import json
import re
import subprocess
import sys
from pathlib import Path

MB = ""  # the Megatron-Bridge git directory (argv[1])
HEAD = "067f987df03b8355b03192d88d70f1709fedf51a"
ARCH = "docs/performance-summary-archive.md"

def git(*a):
    return subprocess.run(["git", "-C", MB, *a], capture_output=True, text=True, check=True).stdout

TAGS = {  # release -> (Bridge tag, commit, date): the tag cut for the container (inferred from dates)
    "25.09": ("v0.1.0rc3", "bf71eba07bae8d36f08b796c106d1197d46ad541", "2025-10-07"),
    "25.11": ("v0.2.0", "7af9601c9da746d21481194356295bfe23df3737", "2025-11-26"),
    "26.02": ("v0.3.0", "21b02e0cfb2f8ff907e0d8baee0c5205876c6812", "2026-02-26"),
    "26.02.01": ("v0.3.1", "9c9dd848966322fc3ed7706747ec13219ef49dda", "2026-03-20"),
    "26.04": ("v0.4.0", "0fbfe7d3e970fbd75c1281d71cee586ce1f3df5e", "2026-04-16"),
    "26.04.01": ("v0.4.1", "f9b6319e58494b9a655b4789724df715aebabaef", "2026-05-06"),
    "26.06": ("v0.5.0", "fcbb6031103d0ca845c1a54d4fee55ecfcca17b6", "2026-06-16"),
}

#: how each release's container is tied to its Megatron-Bridge version (the tag of :data:`TAGS`)
TAG_SOURCES = {
    **{rel: (f"stated: Megatron-Bridge docs/releases/software-versions.md at {HEAD[:10]}, 'NeMo Framework {rel}': "
             f"Megatron-Bridge {ver}") for rel, ver in (("25.09", "0.1.0rc3"), ("25.11", "0.2.0"), ("26.02", "0.3.0"),
                                                        ("26.04", "0.4.0"), ("26.06", "0.5.0"))},
    "26.02.01": (f"stated: Megatron-Bridge docs/releases/known-issues.md at {HEAD[:10]}, '## 26.02': '... Fixed in "
                 "26.02.01 (r0.3.1)'"),
    "26.04.01": ("inferred: software-versions.md names no 26.04.01 container; v0.4.1 is the tag cut (2026-05-06) "
                 "before the table (2026-05)"),
}

MODELS = {
    "LLAMA3_8B": ("llama3_8b", {"name": "Llama 3 8B", "layers": 32, "hidden": 4096, "ffn_hidden": 14336, "heads": 32}),
    "LLAMA3_70B": ("llama3_70b", {"name": "Llama 3 70B", "layers": 80, "hidden": 8192, "ffn_hidden": 28672, "heads": 64}),
    "LLAMA3.1_405B": ("llama31_405b", {"name": "Llama 3.1 405B", "layers": 126, "hidden": 16384, "ffn_hidden": 53248,
                                       "heads": 128}),
}
LLAMA_ARCH = "Llama 3: RoPE, RMSNorm, SwiGLU MLP, GQA (8 kv heads), no biases, untied embeddings"
QWEN30 = {"name": "Qwen3-30B-A3B", "arch": "Qwen3 MoE: RoPE, RMSNorm, GQA (qk-norm), SwiGLU experts, 128 routed experts top-8, no shared expert",
          "params_b": None, "layers": 48, "hidden": 2048, "ffn_hidden": 6144, "heads": 32, "kv_heads": 4, "vocab": 151936,
          "seq_len": 4096, "tied_embeddings": False,
          "moe": {"catalog": "qwen3-30b-a3b", "experts": 128, "top_k": 8, "moe_ffn_hidden": 768, "shared_experts": 0}}
QWEN235 = {"name": "Qwen3-235B-A22B", "arch": QWEN30["arch"], "params_b": None, "layers": 94, "hidden": 4096,
           "ffn_hidden": 12288, "heads": 64, "kv_heads": 4, "vocab": 151936, "seq_len": 4096, "tied_embeddings": False,
           "moe": {"catalog": "qwen3-235b-a22b", "experts": 128, "top_k": 8, "moe_ffn_hidden": 1536, "shared_experts": 0}}
DSV3 = {"name": "DeepSeek-V3", "arch": "DeepSeek-V3: MLA, RMSNorm, 3 dense layers then 256 routed experts top-8 + 1 shared, "
        "SwiGLU, sigmoid router; one multi-token-prediction module", "params_b": 671, "layers": 61, "hidden": 7168,
        "ffn_hidden": 18432, "heads": 128, "kv_heads": 128, "vocab": 129280, "seq_len": 4096, "tied_embeddings": False,
        "moe": {"catalog": "deepseek-v3", "experts": 256, "top_k": 8, "moe_ffn_hidden": 2048, "shared_experts": 1,
                "mtp_layers": 1}}
MOE = {"DeepSeekV3": ("deepseek_v3", DSV3), "Qwen3_30B_a3B": ("qwen3_30b_a3b", QWEN30),
       "Qwen3_235B_a22B": ("qwen3_235b_a22b", QWEN235)}
SKIP_MODELS = {"GPT OSS 120B": "GPT-OSS 120B: not in the spmdkit catalog (sliding-window + sink attention, MXFP4 experts)",
               "Nemotron_3_Nano": "Nemotron 3 Nano: a hybrid Mamba-2 / attention MoE, not in the spmdkit catalog"}

def sections(text):
    """release -> list of (model, header, line) of DGX-H100 pre-training rows."""
    out, skipped = {}, []
    rel = None
    sub = None
    model = None
    header = None
    system = None
    for line in text.split("\n"):
        m = re.match(r"^## (\S+) NeMo Container", line)
        if m:
            rel = m.group(1)
            sub = None
            continue
        if line.startswith("### "):
            sub = line[4:].strip()
            continue
        if line.startswith("#### Model: "):
            model = line[len("#### Model: "):].strip()
            system = None
            continue
        if line.startswith("#### System: "):
            system = line[len("#### System: "):].strip()
            model = None
            continue
        if line.startswith("| System") or line.startswith("| Model"):
            header = line
            continue
        if not line.startswith("| ") or line.startswith("|--") or rel is None:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        cols = [c.strip() for c in header.strip().strip("|").split("|")]
        d = dict(zip(cols, cells))
        sysname = d.get("System", system)
        if sysname != "DGX-H100":
            continue
        name = d.get("Model", model)
        if sub != "Pre-Training Performance":
            skipped.append((rel, name, f"{sub}: not pre-training"))
            continue
        out.setdefault(rel, []).append((name, header, line, d))
    return out, skipped

def num(x):
    return None if x in ("n/a", "") else int(x)

def first_commit(line):
    got = git("log", "-S" + line, "--format=%H %ad %s", "--date=short", "--reverse", HEAD, "--",
              "docs/performance-summary.md", ARCH).strip().split("\n")
    return got[0] if got and got[0] else None

def build():
    text = git("show", f"{HEAD}:{ARCH}")
    secs, skipped = sections(text)
    rows = []
    for rel, items in secs.items():
        if rel not in TAGS:
            continue
        tag, commit, date = TAGS[rel]
        for name, header, line, d in items:
            base = re.sub(r"\s*\(.*\)$", "", name).strip()
            note = re.search(r"\((.*)\)", name)
            note = note.group(1) if note else None
            if base in SKIP_MODELS:
                skipped.append((rel, name, SKIP_MODELS[base]))
                continue
            rows.append(row(rel, tag, commit, date, base, note, header, line, d))
    return rows, skipped

def row(rel, tag, commit, date, base, note, header, line, d):
    relid = rel.replace(".", "")
    gpus, gbs, mbs, seq = int(d["#-GPUs"]), int(d["GBS"]), int(d["MBS"]), int(d["Sequence Length"])
    tp, pp, cp = int(d["TP"]), int(d["PP"]), int(d["CP"])
    vp = num(d["VP"])
    ep = num(d["EP"]) or 1
    fsdp = num(d.get("FSDP", "0")) or 0
    prec_cell = d.get("Precision")
    tok = d["Tokens / sec / GPU"]
    tfl = d["Model TFLOP / sec / GPU"]
    tok_v = int(re.match(r"\d+", tok).group(0))
    tfl_v = int(re.match(r"\d+", tfl).group(0))
    moe = base in MOE
    key, model = (MOE[base] if moe else MODELS[base])
    if not moe:
        model = {"name": model["name"], "arch": LLAMA_ARCH, "params_b": None, "layers": model["layers"],
                 "hidden": model["hidden"], "ffn_hidden": model["ffn_hidden"], "heads": model["heads"], "kv_heads": 8,
                 "vocab": 128256, "seq_len": seq, "tied_embeddings": False, "moe": None}
    else:
        model = json.loads(json.dumps(model))
        model["seq_len"] = seq
    suffix = f"_{note}" if note and note in ("tokendrop", "dropless") else ""
    rid = f"nemo{relid}_h100_fp8_{key}_{gpus}gpu{suffix}"
    basis, inf, companions = {}, {}, []
    src_first = first_commit(line)
    source = {"ref": f"NVIDIA-NeMo/Megatron-Bridge {ARCH} @ {HEAD[:10]} ('## {rel} NeMo Container', "
                     f"'### Pre-Training Performance', DGX-H100)" + (f"; first published in {src_first}" if src_first else ""),
              "repo": "NVIDIA-NeMo/Megatron-Bridge", "path": ARCH, "commit": HEAD,
              "first_commit": src_first.split()[0] if src_first else None,
              "companions": [], "source_row": line, "columns": header}
    # precision
    if prec_cell:
        precision = "fp8 (Transformer Engine, per-tensor current scaling: Megatron-Bridge bf16_with_fp8_current_scaling_mixed)"
        basis["precision"] = "stated" if "CS" in prec_cell else "inferred"
        if "CS" not in prec_cell:
            inf["precision"] = (f"the Precision column's '{prec_cell}' on DGX-H100: the recipes at {tag} have H100 presets for BF16 "
                                "and FP8_CS only (the *_H100_FP8_CS_* workload configs), and 25.11's table names the same "
                                "H100 runs FP8-CS")
    else:
        precision = "fp8 (Transformer Engine, per-tensor current scaling: Megatron-Bridge bf16_with_fp8_current_scaling_mixed)"
        basis["precision"] = "inferred"
        inf["precision"] = ("25.09's table has no precision column; its note says the figures in parentheses use other "
                            "quantization granularities ('For H100 system, 128x128 for weights and 1x128 for activations'), "
                            "so the main figures are FP8 with per-tensor scaling; the yaml perf_matrix of "
                            f"{tag} has fp8_cs presets for every H100 row, and where its bf16 entry differs the table's layout is "
                            "the fp8 one (Llama 3 70B: PP 8, CP 1 where bf16 is PP 4, CP 2; Llama 3 8B: CP 1 and Megatron "
                            "FSDP where bf16 is CP 2; Qwen3-30B: MBS 2 where bf16 is 1); fp8_ds (delayed scaling) has the "
                            "same layouts: current scaling assumed, as 25.11 states for the same H100 runs")
    if key == "deepseek_v3":
        inf["precision"] += ("; Megatron-Bridge's known issues for 25.09 (docs/releases/known-issues.md): 'Pretraining "
                             "DeepSeek in subchannel FP8 precision is not working. Pretraining DeepSeek with current scaling "
                             "FP8 is a workaround'")
    dp_all = gpus // (tp * pp * cp)
    par = {"tp": tp, "pp": pp, "cp": cp, "vp_chunks": vp or 1,
           "schedule": "interleaved" if (vp or 1) > 1 else None, "sequence_parallel": tp > 1,
           "micro_batch": mbs, "global_batch": gbs}
    basis.update({"parallelism.tp": "stated", "parallelism.pp": "stated", "parallelism.cp": "stated",
                  "parallelism.vp_chunks": "stated", "parallelism.micro_batch": "stated",
                  "parallelism.global_batch": "stated", "parallelism.sequence_parallel": "stated_companion",
                  "parallelism.dp": "inferred", "parallelism.zero": "stated_companion",
                  "measured.tokens_per_sec_per_gpu": "stated", "measured.tflops_per_gpu": "stated",
                  "model": "stated_companion (the catalog's / Hugging Face config of the named model)",
                  "hardware.gpu": "inferred", "hardware.num_gpus": "stated", "hardware.inter_node": "not_stated"})
    inf["parallelism.sequence_parallel"] = "WorkloadBaseConfig.sequence_parallel = tensor_model_parallel_size > 1 (scripts/performance/utils/utils.py)"
    recipe_file = {"llama3_8b": "llama3/llama3_8b", "llama3_70b": "llama3/llama3_70b", "llama31_405b": "llama31/llama31_405b",
                   "qwen3_30b_a3b": "qwen3/qwen3_30b_a3b", "qwen3_235b_a22b": "qwen3/qwen3_235b_a22b",
                   "deepseek_v3": "deepseek/deepseek_v3"}[key]
    if rel == "25.09":
        companions.append(f"NVIDIA-NeMo/Megatron-Bridge scripts/performance/configs/{recipe_file}_llm_pretrain.yaml at {tag} "
                          f"({commit}, {date}): perf_matrix h100 (the yaml recipes of the 25.09 container)")
    else:
        d0 = "llama" if key.startswith("llama3_") else "llama31" if key.startswith("llama31") else "qwen3" if key.startswith("qwen") else "deepseek"
        folder = {"llama": "llama" if tag >= "v0.3" else "llama3", "llama31": "llama" if tag >= "v0.3" else "llama31",
                  "qwen3": "qwen" if tag >= "v0.3" else "qwen3", "deepseek": "deepseek"}[d0]
        stem = {"llama": "llama3", "llama31": "llama31", "qwen3": "qwen3", "deepseek": "deepseek"}[d0]
        wb = f"{stem}_workload_base_configs.py" if tag >= "v0.3" else "workload_base_configs.py"
        companions.append(f"NVIDIA-NeMo/Megatron-Bridge scripts/performance/configs/{folder}/{wb} and "
                          f"{stem}_llm_pretrain.py at {tag} ({commit}, {date}): the H100 FP8_CS preset and its config function")
    if rel == "25.09":
        companions.append(f"NVIDIA-NeMo/Megatron-Bridge scripts/performance/run_script, setup_experiment.py and "
                          f"utils/helpers.py at {tag}: apply_perf_matrix_overrides, set_megatron_fsdp_overrides, "
                          "set_recompute_overrides, get_precision_config; the yaml's ConfigContainer overrides "
                          "(cross_entropy_fusion_impl 'te', grad_reduce_in_fp32 false)")
    else:
        companions.append(f"NVIDIA-NeMo/Megatron-Bridge scripts/performance/utils/helpers.py at {tag}: set_common_perf_overrides "
                          "(cross_entropy_fusion_impl 'te', apply_rope_fusion), set_recompute_overrides, "
                          "set_moe_a2a_overlap_overrides")
    companions.append(f"NVIDIA-NeMo/Megatron-Bridge src/megatron/bridge/models/gpt_provider.py at {tag}: "
                      "cross_entropy_loss_fusion True; the Llama / Qwen providers: hidden_dropout = attention_dropout = 0.0")
    par["cross_entropy_fusion"] = True
    basis["parallelism.cross_entropy_fusion"] = "stated_companion"
    inf["parallelism.cross_entropy_fusion"] = ("GPTModelProvider.cross_entropy_loss_fusion = True (gpt_provider.py) and "
                                              "cross_entropy_fusion_impl = 'te' (" + ("the 25.09 yaml's model overrides"
                                              if rel == "25.09" else "set_common_perf_overrides") + ")")
    par["grad_reduce_in_fp32"] = False
    basis["parallelism.grad_reduce_in_fp32"] = "stated_companion"
    inf["parallelism.grad_reduce_in_fp32"] = ("the perf scripts' common configs: cfg.mixed_precision.grad_reduce_in_fp32 = False, "
                                             "cfg.ddp.grad_reduce_in_fp32 = False (bf16 gradients)")
    overlaps = ["--overlap-grad-reduce", "--overlap-param-gather"]
    recompute = "none"
    if not moe:
        par["dp"] = dp_all
        par["ep"] = 1
        inf["parallelism.dp"] = "GPUs / (TP x PP x CP)"
        if fsdp:
            par["zero"] = "FSDP (Megatron FSDP, data_parallel_sharding_strategy optim_grads_params)"
            inf["parallelism.zero"] = (f"the FSDP column's {fsdp}: use_megatron_fsdp (the 25.09 yaml's h100 fp8_cs: "
                                       "use_megatron_fsdp true); Megatron FSDP's default sharding optim_grads_params "
                                       "shards the parameters, gradients and optimizer state (ZeRO-3)")
            par["framework_note"] = "Megatron FSDP"
        else:
            par["zero"] = "distributed optimizer"
            inf["parallelism.zero"] = ("the FSDP column's 0 (DDP); the Llama recipes' OptimizerConfig / DDP config: "
                                       "use_distributed_optimizer = True, overlap_grad_reduce, overlap_param_gather")
        if tp > 1:
            overlaps.insert(0, "--tp-comm-overlap")
            inf["parallelism.overlaps"] = ("the Llama 3 70B / 3.1 405B recipes: CommOverlapConfig(tp_comm_overlap=True) with the "
                                           "H100 userbuffers config (userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192 / "
                                           "userbuffers_bf16_h100_h16384_tp8_cp2_mbs1_seqlen8192)")
        if cp > 1:
            par["cp_attention"] = "ring"
            inf["parallelism.cp_attention"] = ("Megatron-Core's cp_comm_type default 'p2p' (Transformer Engine's ring, "
                                               "load-balanced): no Bridge recipe or perf script sets cp_comm_type")
        if key == "llama31_405b":
            n = pp * (vp or 1)
            par["stages"] = [1] + [2] * (n - 2) + [1]
            basis["parallelism.stages"] = "stated_companion"
            inf["parallelism.stages"] = ("llama31_405b_pretrain_config (llama31_405b.py's model_config at v0.1.0rc3, "
                                         "llama3.py from v0.2.0): account_for_embedding_in_pipeline_split and "
                                         f"account_for_loss_in_pipeline_split True: (126 + 2) / ({pp} x {vp}) = 2 a "
                                         "virtual stage, the first and the last 1 decoder layer")
        if key == "llama3_8b" and rel != "25.09":
            recompute = "full:5"
            inf["recompute"] = ("LLAMA3_8B_H100_FP8_CS preset: recompute_num_layers=5 -> set_recompute_overrides: "
                                "recompute_granularity 'full', recompute_method 'block', recompute_num_layers 5 (the first "
                                "5 of the 32 layers recomputed)")
        else:
            inf["recompute"] = "no recompute override in the H100 preset; the recipe's default (none)"
    else:
        etp = 1
        par["dp"] = gpus // (pp * cp * ep) if tp > 1 else gpus // (tp * pp * cp * ep)
        par["ep"] = ep
        par["etp"] = etp
        inf["parallelism.dp"] = ("the expert data-parallel ranks: GPUs / (PP x CP x EP) with ETP = 1 (an expert group is "
                                 "tp x ep ranks; the attention's DP is dp x EP / TP)" if tp > 1 else "GPUs / (TP x PP x CP x EP)")
        basis["parallelism.etp"] = "stated_companion"
        inf["parallelism.etp"] = "BASE_*_CONFIG: expert_tensor_parallel_size=1"
        par["zero"] = "distributed optimizer"
        inf["parallelism.zero"] = "the FSDP column's 0; the Qwen3 MoE / DeepSeek recipes: use_distributed_optimizer True"
        tokendrop = note == "tokendrop"
        # dispatcher
        if key == "qwen3_30b_a3b":
            if tag in ("v0.3.0", "v0.3.1"):
                disp, a2a = "deepep", True
                inf["parallelism.dispatcher"] = ("QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1 at v0.3.0 (the table's layout: "
                                                 "PP 2, VP 12, EP 8): moe_flex_dispatcher_backend='deepep', moe_a2a_overlap=True; "
                                                 "qwen3_30b_a3b_pretrain_config_h100 passes the backend to the recipe "
                                                 "(apply_flex_dispatcher_backend: moe_token_dispatcher_type 'flex' on sm 9.x)"
                                                 + ("; v0.3.1's preset is EP 16, PP 1, moe_flex_dispatcher_backend='hybridep', "
                                                    "moe_a2a_overlap=False (f29a269f8, #2477, merged into r0.3.0 by 69655bff2 "
                                                    "on 2026-03-03), which the 26.02.01 table's layout (EP 8, PP 2, VP 12) is "
                                                    "not: v0.3.0's preset taken (the row's assumptions)" if tag == "v0.3.1" else ""))
            elif tag >= "v0.4":
                disp, a2a = "hybridep", False
                inf["parallelism.dispatcher"] = (f"QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1 at {tag}: EP 16, "
                                                 "moe_flex_dispatcher_backend='hybridep', moe_a2a_overlap=False")
            elif tag == "v0.2.0":
                disp, a2a = "alltoall", True
                inf["parallelism.dispatcher"] = ("QWEN3_30B_A3B_H100_FP8_CS_BASE_CONFIG at v0.2.0: no flex backend "
                                                 "(Megatron-Core's alltoall dispatcher), moe_a2a_overlap=True")
            else:
                disp, a2a = "alltoall", False
                inf["parallelism.dispatcher"] = ("run_script at v0.1.0rc3: qwen3_30b_a3b_pretrain_config (the provider's "
                                                 "moe_token_dispatcher_type 'alltoall') then apply_moe_token_drop "
                                                 "('moe_expert_capacity_factor only works with alltoall token dispatcher'); "
                                                 "no a2a overlap set")
            if tag == "v0.1.0rc3":
                inf["parallelism.overlaps"] = ("run_script at v0.1.0rc3: CommOverlapConfig(tp_comm_overlap=True), which "
                                               "CommOverlapConfig._get_model_comm_overlap_cfgs disables at TP 1")
        elif key == "qwen3_235b_a22b":
            if tag == "v0.1.0rc3":
                disp, a2a = "alltoall", False
                inf["parallelism.dispatcher"] = ("run_script at v0.1.0rc3: qwen3_235b_a22b_pretrain_config (the provider's "
                                                 "moe_token_dispatcher_type 'alltoall') then apply_moe_token_drop (which "
                                                 "needs alltoall); no a2a overlap set")
                overlaps.insert(0, "--tp-comm-overlap")
                inf["parallelism.overlaps"] = ("run_script at v0.1.0rc3: qwen3_235b_a22b_pretrain_config(comm_overlap_config="
                                               "CommOverlapConfig(tp_comm_overlap=True)); TP 2 with sequence parallelism "
                                               "(apply_perf_matrix_overrides), so _get_model_comm_overlap_cfgs keeps it: TE's "
                                               "userbuffers TP overlap with its default config (COMM_OVERLAP_CONFIG_MAP has no "
                                               "qwen3 entry)")
            else:
                disp, a2a = "alltoall", True
                inf["parallelism.dispatcher"] = (f"QWEN3_235B_A22B H100 FP8_CS preset at {tag}: moe_a2a_overlap=True; "
                                                 "the alltoall dispatcher" + (
                                                     ": the preset names no flex backend" if tag in ("v0.2.0", "v0.3.0") else
                                                     ": BASE_QWEN3_235B_A22B_CONFIG's moe_flex_dispatcher_backend='deepep' "
                                                     "(5c38201c9, #2351) is overridden by qwen3_235b_a22b_pretrain_config_h100's "
                                                     "moe_token_dispatcher_type = 'alltoall'" if tag == "v0.3.1" else
                                                     ": no flex backend, and set_workload_base_configs sets "
                                                     "moe_token_dispatcher_type 'alltoall' when the preset names none"))
                inf["parallelism.overlaps"] = (f"qwen3_235b_a22b H100 config function at {tag}: "
                                               "CommOverlapConfig(tp_comm_overlap=False)")
            par["stages"] = [2] + [3] * 30 + [2]
            basis["parallelism.stages"] = "stated_companion"
            inf["parallelism.stages"] = ("qwen3_235b_a22b_pretrain_config: account_for_embedding_in_pipeline_split and "
                                         "account_for_loss_in_pipeline_split True: (94 + 2) / (8 x 4) = 3 a virtual stage, "
                                         "the first and last 2 decoder layers")
        else:  # deepseek
            disp, a2a = "deepep", True
            inf["parallelism.dispatcher"] = ("run_script at v0.1.0rc3 (DeepSeek-V3): enable_deepep = gpu == 'h100' (not "
                                             "token drop on H100) passed to deepseek_v3_pretrain_config: "
                                             "moe_token_dispatcher_type 'flex', moe_enable_deepep True, "
                                             "moe_router_force_load_balancing True (setup_experiment.py's enable_deepep only "
                                             "sets the layernorm SM margin)")
            par["stages"] = [1] + [2] * 30 + [0]
            basis["parallelism.stages"] = "stated_companion"
            inf["parallelism.stages"] = ("the 25.09 yaml's pipeline_model_parallel_layout 'Et|(tt|)*30mL': the embedding "
                                         "and 1 decoder layer, 30 virtual stages of 2 layers, the MTP module and the loss "
                                         "last (8 x 4 = 32 virtual stages)")
            recompute = "selective:mla_up_proj,mlp"
            inf["recompute"] = ("run_script at v0.1.0rc3: recipe.model.recompute_modules = ['mla_up_proj', 'mlp'] on "
                                "H100; the 25.09 yaml's recompute_granularity 'selective' (perf_matrix sets no "
                                "recompute_num_layers)")
            overlaps.remove("--overlap-grad-reduce")
            inf["parallelism.overlaps"] = ("run_script at v0.1.0rc3: recipe.comm_overlap.overlap_grad_reduce = False on "
                                           "H100, which CommOverlapConfig._override_user_cfgs puts over the DDP config's "
                                           "True; overlap_param_gather stays True (data parallel > 1)")
        par["dispatcher"] = disp
        basis["parallelism.dispatcher"] = "stated_companion"
        if a2a:
            par["ep_comm_overlap"] = "moe_a2a_overlap: overlap_moe_expert_parallel_comm, delay_wgrad_compute"
            basis["parallelism.ep_comm_overlap"] = "stated_companion"
            inf["parallelism.ep_comm_overlap"] = (
                "run_script at v0.1.0rc3: A2A_1F1B = gpu == 'h100': recipe.comm_overlap.overlap_moe_expert_parallel_comm "
                "= True, delay_wgrad_compute = True, moe_shared_expert_overlap = False" if key == "deepseek_v3" else
                "set_moe_a2a_overlap_overrides (helpers.py): overlap_moe_expert_parallel_comm = True, delay_wgrad_compute = True")
        if tokendrop:
            par["routing"] = "balanced"
            inf["parallelism.routing"] = ("'(tokendrop)': apply_moe_token_drop (moe_token_drop.py) with its defaults "
                                          "moe_expert_capacity_factor 1.0, moe_pad_expert_input_to_capacity True: every "
                                          "expert computes exactly its capacity (the mean load): spmdkit --moe-routing balanced")
        else:
            par["routing"] = "topk"
            inf["parallelism.routing"] = ("dropless with moe_router_force_load_balancing True (set_qwen3_common_configs; "
                                          "'In MoE training benchmarks, we force-balance the token distribution among "
                                          "experts'): random router logits, uniform top-k, as moe-runs.json's zoo rows "
                                          "express it: spmdkit --moe-routing topk")
        basis["parallelism.routing"] = "stated_companion"
        if key != "deepseek_v3":
            inf["recompute"] = ("the 25.09 yaml's model overrides: recompute_granularity / method / num_layers null"
                                if tag == "v0.1.0rc3" else
                                "set_qwen3_common_configs: recompute_granularity / method / num_layers = None")
    basis["parallelism.overlaps"] = "stated_companion"
    par["overlaps"] = " ".join(overlaps)
    par["grad_accum"] = gbs // ((par["dp"] * (par["ep"] // (par["tp"] if moe and tp > 1 else 1)) if moe else par["dp"]) * mbs)
    basis["recompute"] = "stated_companion"
    meas = {"tokens_per_sec_per_gpu": tok_v, "tflops_per_gpu": tfl_v,
            "flops_definition": "Megatron-Bridge 'Model TFLOP / sec / GPU' (its own FLOP count; compared here in tokens/s/GPU)"}
    if tok != str(tok_v) or tfl != str(tfl_v):
        meas["note"] = f"the table's cells '{tok}' / '{tfl}': the first figure taken (the parenthesised one is another FP8 granularity)"
    r = {"id": rid, "source": source, "release": rel, "model": model,
         "hardware": {"gpu": "H100-SXM 80GB", "num_gpus": gpus, "gpus_per_node": 8, "intra_node": "NVLink/NVSwitch",
                      "inter_node": None, "cluster": "DGX-H100"},
         "parallelism": par, "recompute": recompute, "precision": precision, "measured": meas,
         "framework": "megatron", "basis": basis, "inferences": inf,
         "assumptions": _assumptions(rel, tag, key, par, prec_cell)}
    r["source"]["companions"] = companions
    inf["hardware.gpu"] = "'DGX-H100' (8x H100 SXM 80GB, NVLink/NVSwitch)"
    return r

def _assumptions(rel: str, tag: str, key: str, par: dict, prec_cell: str | None) -> list[str]:
    """What the planner runs differently from the row's recipe, or what the row infers (fidelity.md lists them)."""
    out = [f"the recipe of Megatron-Bridge {tag} (the container's version: {TAG_SOURCES[rel]})",
           "FP8 per-tensor current scaling planned as --precision fp8, whose casts take the amax in the cast kernel "
           "(delayed scaling's; Transformer Engine's current scaling runs an amax pass before the cast)"]
    if prec_cell is None:
        out.append("FP8 (25.09's table states no precision; its layouts are the yaml's fp8 entries)")
    out += _run_doubts(rel, key)
    if key == "deepseek_v3":
        out.append("DeepEP with the 1F1B a2a overlap and the selective recompute of mla_up_proj and mlp (run_script's "
                   "H100 branch); its overlap_grad_reduce False (the gradients reduce-scattered after the last backward) "
                   "is planned overlapped under the backward, as every row: benchmarks/fidelity.py passes no "
                   "--no-grad-overlap (the row's parallelism.overlaps states the recipe)")
    if par.get("routing") == "topk":
        out.append("forced load balancing (random router logits) planned as --moe-routing topk's expected load, as "
                   "moe-runs.json's Megatron rows")
    elif par.get("routing") == "balanced":
        out.append("token drop at capacity factor 1.0, padded to capacity: every expert its capacity "
                   "(--moe-routing balanced)")
    return out


def _run_doubts(rel: str, key: str) -> list[str]:
    """What the sources leave undetermined about the run behind a row (issue 28): the table's layout against its
    release's preset, and the releases' known issues."""
    if key != "qwen3_30b_a3b":
        return []
    if rel == "25.11":
        return ["run not determined: the table's MBS 2, VP 24 (GA 32) are not v0.2.0's QWEN3_30B_A3B_H100_FP8_CS_BASE_CONFIG "
                "(MBS 1, VP 12: its micro_batch_size=2 was dropped when moe_a2a_overlap=True came in, 8aed9a229, #1457, "
                "2025-11-21) but the 25.09 yaml's fp8_cs entry; planned with the table's layout and v0.2.0's a2a overlap"]
    if rel == "26.02":
        return ["run not determined: the recipe asks for DeepEP, while Megatron-Bridge's known issues for 26.02 say 'DeepEP "
                "is not supported in the current NeMo framework 26.02 container' (and Megatron-Core's _DeepepManager raises "
                "ImportError without deep_ep); the same recipe measured 9058 tokens/s/GPU in 26.02.01; planned with DeepEP "
                "as the recipe states"]
    if rel == "26.02.01":
        return ["run not determined: the table's layout (EP 8, PP 2, VP 12) is v0.3.0's preset, not v0.3.1's (EP 16, PP 1, "
                "HybridEP, no a2a overlap), and the measured 9058 tokens/s/GPU is within 2% of 26.04's 8901 and 26.04.01's "
                "8960, which ran that EP 16 HybridEP preset; planned as the table states it, with v0.3.0's DeepEP and a2a "
                "overlap"]
    return []


if __name__ == "__main__":
    MB = sys.argv[1]
    rows, skipped = build()
    Path(sys.argv[2]).write_text(json.dumps(rows, indent=1) + "\n")
    for s in skipped:
        print("skipped", s)
    print(len(rows), "rows")
