#!/usr/bin/env python3
"""How benchmarks/data/mbridge-runs.json was made (benchmarks/data/mbridge-runs.md): runs that Megatron-Bridge's
maintainers measured in their pull requests, on a layout spmdkit can plan, each with the recipe of the branch the
PR ran (``scripts/performance`` and ``src/megatron/bridge/recipes`` at :data:`MAIN`, read by hand) and the PR's own
words quoted in ``source.source_row``.

    python benchmarks/mbridge_runs_build.py MEGATRON_BRIDGE_GIT_DIR benchmarks/data/mbridge-runs.json

The git directory is read only to check that the commits and files named exist (``git cat-file -e``)."""
import json
import subprocess
import sys
from pathlib import Path

from nemo_runs_build import QWEN30

#: the parent of 1faf74e32 (PR #3868's merge, 2026-05-18): main as the PR's experiment ran it ("Branch base:
#: latest origin/main"); 750d0d322 is PR #3862's merge, the same day, the same shape
MAIN = "750d0d322"
PR3868 = "1faf74e3259bd2183e6df0284468621fd70d4894"
#: PR #3862's merge ('[docs] docs: Record MoE overlap smoke results', 2026-05-18): its A/B of EP overlap
PR3862 = "750d0d322a96cc28688fbb74aa767b12b852c1cd"
PR3862_FILES = ("skills/perf-expert-parallel-overlap/SKILL.md", "docs/training/communication-overlap.md",
                "scripts/performance/utils/utils.py")
FILES = ("scripts/performance/configs/qwen/qwen3_workload_base_configs.py",
         "scripts/performance/configs/qwen/qwen3_llm_pretrain.py", "scripts/performance/utils/overrides.py",
         "scripts/performance/argument_parser.py", "src/megatron/bridge/recipes/qwen/qwen3_moe.py")


def pr3868_row() -> dict:
    """Qwen3-30B-A3B on 16 H100s, BF16, TP 1 PP 1 EP 16, MBS 1 GBS 1024, the alltoall dispatcher, eager
    (NVIDIA-NeMo/Megatron-Bridge PR #3868's experiment handoff comment, 2026-05-18)."""
    model = json.loads(json.dumps(QWEN30))
    step = 41.36
    tokens = 1024 * 4096 / step / 16
    quoted = ("Workload: Qwen3 30B A3B pretrain, H100 BF16, config variant v1 / Scale: 2 nodes, 8 GPUs/node, 16 GPUs "
              "total, EP=16 / Dispatcher/layout fixed: all-to-all dispatcher, TP=1, PP=1, CP=1, MBS=1, GBS=1024 / Max "
              "steps: 8 / Common overrides: `--moe_flex_dispatcher_backend None`, `--moe_a2a_overlap false`, "
              "`--tokenizer_type NullTokenizer`, `comm_overlap.overlap_moe_expert_parallel_comm=false`, "
              "`comm_overlap.delay_wgrad_compute=false`, ...; docs/training/cuda-graphs.md (the PR's change): 'replay "
              "iterations 5-8 averaged `42.00 s` versus `41.36 s` for eager'")
    return {
        "id": "nemo_mbridge_pr3868_h100_bf16_qwen3_30b_a3b_16gpu",
        "source": {
            "ref": ("NVIDIA-NeMo/Megatron-Bridge PR #3868 '[docs] docs: update MoE CUDA graph guidance' (merged as "
                    f"{PR3868[:10]}, 2026-05-18): the author's experiment handoff comment (layout) and the PR's "
                    "docs/training/cuda-graphs.md 'Mid-sized MoE pretrain' (the eager step)"),
            "repo": "NVIDIA-NeMo/Megatron-Bridge", "path": "docs/training/cuda-graphs.md", "commit": PR3868,
            "companions": [
                f"NVIDIA-NeMo/Megatron-Bridge at {MAIN} (main before the PR's merge): "
                "QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_BF16_V1 (EP 16, GBS 1024, hybridep, TE graphs moe_router / "
                "moe_preprocess, moe_a2a_overlap False), qwen3_30b_a3b_pretrain_config_h100 and set_qwen3_common_configs "
                "(qwen3_llm_pretrain.py), set_workload_base_configs / set_user_overrides / _set_common_perf_overrides "
                "(utils/overrides.py), argument_parser.py's --moe_flex_dispatcher_backend, qwen3_30b_a3b_pretrain_config "
                "(src/megatron/bridge/recipes/qwen/qwen3_moe.py)",
                "NVIDIA-NeMo/Megatron-Bridge PR #3862 (750d0d322, the same day): the same shape (H100 x16, EP 16, "
                "alltoall, BF16, GBS 1024, CUDA graphs off) without EP overlap 41.25 s a step (iterations 3-8), with "
                "moe_permute_fusion=false ('the PyTorch 25.11 / TE / Triton stack failed in Transformer Engine fused "
                "permutation')",
                "NVIDIA-NeMo/Megatron-Bridge PR #3880 (closed, 2026-05-19) skills/perf-activation-recompute/SKILL.md: "
                "'Qwen3 30B A3B pretrain on 16x H100, BF16, all-to-all dispatch, CUDA graphs off, EP overlap off, "
                "MBS=1: | None | 42.21 s | 61.35 |' (recompute_modules, step time, Peak Mem (GB)): another run of "
                "the shape"],
            "source_row": quoted,
            "columns": "the comment's 'Context' list; the step time from the PR's docs change"},
        "release": "Megatron-Bridge main 2026-05-18 (PR #3868)",
        "model": model,
        "hardware": {"gpu": "H100-SXM 80GB", "num_gpus": 16, "gpus_per_node": 8, "intra_node": "NVLink/NVSwitch",
                     "inter_node": None, "cluster": "2 H100 nodes (not named)"},
        "parallelism": {
            "tp": 1, "pp": 1, "cp": 1, "vp_chunks": 1, "schedule": None, "sequence_parallel": False,
            "micro_batch": 1, "global_batch": 1024, "dp": 1, "ep": 16, "etp": 1, "grad_accum": 64,
            "zero": "distributed optimizer", "cross_entropy_fusion": True, "grad_reduce_in_fp32": False,
            "overlaps": "--overlap-grad-reduce --overlap-param-gather", "dispatcher": "alltoall", "routing": "topk"},
        "recompute": "none",
        "precision": "bf16",
        "measured": {
            "step_time_s": step, "tokens_per_sec_per_gpu": round(tokens),
            "note": (f"the eager mean of iterations 5-8 (the TE-graph run: 42.00 s); tokens/s/GPU = 1024 x 4096 / "
                     f"{step} / 16 (derived). Not compared: PR #3880's peak memory 61.35 'GB' is of another run of "
                     "the shape (42.21 s a step), allocated or reserved not stated")},
        "framework": "megatron",
        "basis": {
            "model": "stated_companion (the catalog's / Hugging Face config of the named model)",
            "hardware.num_gpus": "stated", "hardware.gpu": "stated", "hardware.inter_node": "not_stated",
            "parallelism.tp": "stated", "parallelism.pp": "stated", "parallelism.cp": "stated",
            "parallelism.ep": "stated", "parallelism.micro_batch": "stated", "parallelism.global_batch": "stated",
            "parallelism.dispatcher": "stated", "parallelism.ep_comm_overlap": "stated",
            "parallelism.dp": "inferred", "parallelism.etp": "stated_companion", "parallelism.zero": "stated_companion",
            "parallelism.cross_entropy_fusion": "stated_companion", "parallelism.grad_reduce_in_fp32": "stated_companion",
            "parallelism.overlaps": "stated_companion", "parallelism.routing": "stated_companion",
            "recompute": "stated_companion", "precision": "stated", "measured.step_time_s": "stated",
            "measured.tokens_per_sec_per_gpu": "inferred"},
        "inferences": {
            "parallelism.dp": "the expert data-parallel ranks: 16 / (PP 1 x CP 1 x EP 16) = 1; the attention's DP 16",
            "parallelism.etp": "BASE_QWEN3_30B_A3B_CONFIG: expert_tensor_parallel_size=1",
            "parallelism.dispatcher": ("--moe_flex_dispatcher_backend None: argument_parser.py maps 'None' to None, and "
                                       "set_user_overrides then sets recipe.model.moe_token_dispatcher_type = 'alltoall' "
                                       "(over the H100 function's 'flex' with the preset's hybridep)"),
            "parallelism.routing": ("set_qwen3_common_configs: moe_router_force_load_balancing = True (dropless, "
                                    "random router logits): --moe-routing topk, as moe-runs.json's Megatron rows"),
            "parallelism.zero": "qwen3_30b_a3b_pretrain_config: ddp.use_distributed_optimizer = True, overlap_grad_reduce, "
                                "overlap_param_gather True",
            "parallelism.cross_entropy_fusion": ("qwen3_30b_a3b_pretrain_config: cross_entropy_loss_fusion True, "
                                                 "cross_entropy_fusion_impl 'te' (and _set_common_perf_overrides)"),
            "parallelism.grad_reduce_in_fp32": "set_qwen3_common_configs: mixed_precision / ddp grad_reduce_in_fp32 = False",
            "parallelism.overlaps": ("CommOverlapConfig(tp_comm_overlap=True) of the H100 function, off at TP 1; EP overlap "
                                     "off (the comment's overrides)"),
            "recompute": "set_qwen3_common_configs: recompute_granularity / method / num_layers = None",
            "precision": "'H100 BF16' (the comment; bf16_mixed)",
            "hardware.gpu": "'2 H100 nodes, 8 GPUs/node'"},
        "assumptions": [
            "eager: the BF16 preset's TE graphs (moe_router, moe_preprocess) are the A/B's other arm, not this row",
            "the comment's list of overrides is cut ('model.moe_shared_expert_...'); PR #3862's run of the same shape "
            "the same day set moe_permute_fusion=false, which the planner does not tell apart",
            "forced load balancing (random router logits) planned as --moe-routing topk's expected load",
            "the container not stated (PR #3862: 'the available PyTorch 25.11 / TE / Triton stack'): the planner's "
            "newest cuDNN rates",
            "a short run (8 steps; the mean of iterations 5-8)"],
    }


def pr3862_row(overlap: bool) -> dict:
    """PR #3862's A/B of the same shape (H100 x16, EP 16, alltoall, BF16, GBS 1024, CUDA graphs off,
    ``moe_permute_fusion=false``): 'no EP overlap' 41.25 s, or 'EP overlap plus delay_wgrad_compute' 31.20 s
    (Megatron-Core's ``--overlap-moe-expert-parallel-comm --delay-wgrad-compute`` at PP 1, which
    ``--ep-comm-overlap`` models); its third case, 'EP overlap' without delayed wgrad (31.31 s), is in the note."""
    row = pr3868_row()
    step = 31.20 if overlap else 41.25
    case = "EP overlap plus `delay_wgrad_compute`" if overlap else "no EP overlap"
    table = ("| no EP overlap | 41.25s | 1.000x | / | EP overlap | 31.31s | 1.317x | / | EP overlap plus "
             "`delay_wgrad_compute` | 31.20s | 1.322x |")
    quoted = ("skills/perf-expert-parallel-overlap/SKILL.md 'Measured Short-Run Evidence': 'A 2026-05-18 current-main H100 "
              "x16 Qwen3 30B-A3B mock pretraining run used `EP=16`, `alltoall`, BF16, global batch size 1024, CUDA graphs "
              "disabled, and `moe_permute_fusion=false`. With iterations 3-8 as the steady window: | Case | Steady mean | "
              f"Relative | {table}'")
    row["id"] = f"nemo_mbridge_pr3862_h100_bf16_qwen3_30b_a3b_16gpu_{'ep_overlap_dwgrad' if overlap else 'no_ep_overlap'}"
    row["source"] = {
        "ref": ("NVIDIA-NeMo/Megatron-Bridge PR #3862 '[docs] docs: Record MoE overlap smoke results' (merged as "
                f"{PR3862[:10]}, 2026-05-18): skills/perf-expert-parallel-overlap/SKILL.md 'Measured Short-Run "
                f"Evidence', the case '{case}'"),
        "repo": "NVIDIA-NeMo/Megatron-Bridge", "path": "skills/perf-expert-parallel-overlap/SKILL.md", "commit": PR3862,
        "companions": [
            "the PR's docs/training/communication-overlap.md: 'a 2026-05-18 current-main H100 x16 Qwen3 30B-A3B "
            "mock-data rerun with `EP=16`, `alltoall`, CUDA graphs disabled, and `moe_permute_fusion=false` reduced "
            "steady-state step time from 41.25s to 31.31s when enabling EP overlap / in that same run, adding "
            "`delay_wgrad_compute` was neutral: 31.20s versus 31.31s for overlap-only'",
            "the PR's description: '| A0 | alltoall, no EP overlap | 41.25s | 1.000x | / | A1 | EP overlap | 31.31s | "
            "1.317x | / | A2 | EP overlap + delayed wgrad | 31.20s | 1.322x |'",
            f"the layout of PR #3868's run of the same preset (nemo_mbridge_pr3868_h100_bf16_qwen3_30b_a3b_16gpu): "
            f"QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_BF16_V1 at {MAIN}, WorkloadBaseConfig's TP 1, PP 1, CP 1, MBS 1 "
            "(scripts/performance/utils/utils.py)"],
        "source_row": quoted,
        "columns": "Case, Steady mean (iterations 3-8), Relative"}
    row["release"] = "Megatron-Bridge main 2026-05-18 (PR #3862)"
    par = row["parallelism"]
    if overlap:
        par["ep_comm_overlap"] = "overlap_moe_expert_parallel_comm, delay_wgrad_compute (Megatron-Core's PP = 1 path)"
        par["overlaps"] = "--overlap-grad-reduce --overlap-param-gather --ep-comm-overlap"
    row["measured"] = {
        "step_time_s": step, "tokens_per_sec_per_gpu": round(1024 * 4096 / step / 16),
        "note": (f"the mean of iterations 3-8 of the case '{case}'; tokens/s/GPU = 1024 x 4096 / {step} / 16 (derived)."
                 + (" The same PR's 'EP overlap' case without delayed wgrad: 31.31 s (not a row: --ep-comm-overlap "
                    "models Megatron-Core's overlap with --delay-wgrad-compute)" if overlap else ""))}
    basis = row["basis"]
    for k in ("parallelism.tp", "parallelism.pp", "parallelism.cp", "parallelism.micro_batch"):
        basis[k] = "stated_companion"
    basis["parallelism.ep_comm_overlap"] = "stated"
    row["inferences"]["parallelism.dispatcher"] = "'`alltoall`' (the PR's own words): NCCL's all-to-all"
    row["inferences"]["parallelism.overlaps"] = (
        "qwen3_30b_a3b_pretrain_config: overlap_grad_reduce, overlap_param_gather; EP overlap "
        + ("on with delay_wgrad_compute (the case)" if overlap else "off (the case)"))
    row["assumptions"] = [
        "TP 1, PP 1, CP 1, MBS 1: the preset QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_BF16_V1 sets none of them "
        "(WorkloadBaseConfig's defaults), as PR #3868's handoff comment of the same shape states them",
        "CUDA graphs disabled (the PR's words): eager",
        "moe_permute_fusion=false (the PR's words), which the planner does not tell apart",
        "forced load balancing (random router logits) planned as --moe-routing topk's expected load",
        "the container 'the available PyTorch 25.11 / TE / Triton stack' (the PR's description): the planner's newest "
        "cuDNN rates",
        "a short run (8 steps; the mean of iterations 3-8)"]
    return row


def build(mb: str) -> list[dict]:
    for c in (MAIN, PR3868, PR3862):
        subprocess.run(["git", "-C", mb, "cat-file", "-e", c], check=True)
    for f in FILES:
        subprocess.run(["git", "-C", mb, "cat-file", "-e", f"{MAIN}:{f}"], check=True)
    for f in PR3862_FILES:
        subprocess.run(["git", "-C", mb, "cat-file", "-e", f"{PR3862}:{f}"], check=True)
    return [pr3868_row(), pr3862_row(False), pr3862_row(True)]


if __name__ == "__main__":
    rows = build(sys.argv[1])
    Path(sys.argv[2]).write_text(json.dumps(rows, indent=1) + "\n")
    print(len(rows), "rows")
