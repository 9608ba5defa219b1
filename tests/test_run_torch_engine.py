"""``spmdkit run --engine torch``: an exported plan applied to an HF model with torch's own APIs
and trained under torch's own launcher (``python -m torch.distributed.run``) on gloo.

Each launch starts 4 worker processes (about a minute on 2 cores), so the suite runs the smallest
set: Llama dp=2 x tp=2 megatron whose 3 steps' losses equal torch eager's and whose collectives
equal the export's; an export without the dp gradient reduction (the check fails: exit 1, the
losses and collectives named); an export that raises on one rank (exit 1, one line naming the
rank and its error, every rank ended, no hang); an export that aborts one rank (killed by
SIGABRT, the rank's last stderr lines quoted); the pipelines: Llama and GPT-2 (its tied wte held on
both stages, the copies' gradients all-reduced) at pp=2 x tp=2. The rest are checked without launching: the
report's arithmetic, the names of the collectives, the failure line read from torchrun's
output, the refusals before torchrun starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from tests.conftest import ROOT, cli_stdout, run_cli_line

pytest.importorskip("torch")
pytest.importorskip("transformers")

LLAMA = {"num_key_value_heads": 2, "num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 4,
         "intermediate_size": 64, "vocab_size": 128, "max_position_embeddings": 64}
#: 1 layer on dp=2 x tp=2, megatron, as CommDebugMode counts them per step on every rank: the forward's
#: tp all-reduces (o_proj, down_proj, the vocab-parallel embedding: 3), the backward's (the shared
#: inputs of q/k/v and of gate/up, the head's input: 3), the vocab-parallel loss's 3 (max, sum of
#: exponentials, the label's logit), FSDP2's replicate over dp: one gradient all-reduce per group (the
#: block, the root: 2)
ALL_REDUCES = 3 + 3 + 3 + 2
OPT = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "ffn_dim": 64, "vocab_size": 128,
       "max_position_embeddings": 64, "word_embed_proj_dim": 32, "enable_bias": False}


def _real_export(tmp_path: Path, name: str = "plan.py", mesh: str = "dp=2,tp=2", extra: list[str] | None = None,
                 config: dict[str, int] = LLAMA, cls: str = "LlamaForCausalLM") -> Path:
    """``spmdkit plan --export torch`` of the Llama's megatron plan (1 layer, dp=2 x tp=2 by default),
    in this process (torch and transformers are loaded here already; the launches below start the CLI)."""
    path = tmp_path / name
    rc, _ = cli_stdout("plan", "--hf", cls, "--hf-config", json.dumps(config), "--mesh", mesh,
                       *(["--strategy", "megatron"] if "--auto" not in (extra or []) else []), *(extra or []),
                       "--export", "torch", str(path))
    assert rc == 0 and path.is_file()
    return path


def _launch(*args: str, timeout: float = 600, config: dict[str, int] = LLAMA,
            cls: str = "LlamaForCausalLM") -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    return subprocess.run([sys.executable, "-m", "spmdkit", "run", "--engine", "torch", "--hf", cls,
                           "--hf-config", json.dumps(config), "--batch", "4", "--seq", "8", "--timeout", "60", *args],
                          capture_output=True, text=True, env=env, timeout=timeout)


def test_llama_dp_tp_trains_as_eager_with_the_plans_collectives() -> None:
    """Planned and exported by the run itself (no --torch-plan), trained 3 steps under torchrun."""
    p = _launch("--mesh", "dp=2,tp=2", "--strategy", "megatron", "--json")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["ok"] and rep["engine"] == "torch" and rep["world_size"] == 4 and rep["backend"] == "gloo"
    assert rep["same_initial_weights"]
    assert rep["launcher"] == "torch.distributed.run" and "--nproc-per-node 4" in rep["command"]
    assert len(rep["steps"]) == 3
    for s in rep["steps"]:
        assert abs(s["loss"] - s["eager_loss"]) <= 2e-5 * max(1.0, abs(s["eager_loss"])), s
        assert s["collectives"] == [{"all_reduce": ALL_REDUCES}] * 4
    # the updates move the loss: step 2 is not step 1's batch through the same weights
    assert len({round(s["eager_loss"], 6) for s in rep["steps"]}) == 3
    # every rank holds half of each tp-sharded parameter and its gradient (sgd: no state)
    half = {m["parameters"] for m in rep["memory"]}
    assert len(half) == 1 and half.pop() < rep["eager_parameter_bytes"] * 0.75
    assert all(m["gradients"] == m["parameters"] and m["optimizer"] == 0 and m["max_rss_bytes"] > 2**20
               for m in rep["memory"])


GPT2 = {"n_layer": 1, "n_embd": 32, "n_head": 4, "vocab_size": 128, "n_positions": 64}


def test_gpt2_fused_qkv_sequence_parallel_fsdp_trains_as_eager() -> None:
    """GPT-2 (1 block) on dp=2 x tp=2 under megatron + sp + zero3, one launch: the fused c_attn
    reordered per rank, the flattened tokens' sequence parallel on the batch rows (Shard(0)), the
    position embedding a replicated DTensor, FSDP2 per block and the root. Per step on every rank:
    the tp all-gathers (c_attn, c_fc, the LM head: 3 forward, 3 backward) and reduce-scatters (wte,
    the 2 c_proj: 3 forward, 3 backward); all-reduces: the 3 norms' weights and biases, wpe's
    gradient (7) and the loss's 3; FSDP2's 2 all-gathers forward, 1 backward (the block's), 2
    reduce-scatters."""
    _sp_zero3_trains_as_eager(GPT2, "GPT2LMHeadModel", {"all_gather_into_tensor": 3 + 3 + 2 + 1, "all_reduce": 7 + 3,
                                                        "reduce_scatter_tensor": 3 + 3 + 2})


def _sp_zero3_trains_as_eager(config: dict[str, Any], cls: str, per_rank: dict[str, int]) -> None:
    """One launch of dp=2 x tp=2 megatron + sp + zero3: 3 steps, each loss eager's, every rank's
    collectives ``per_rank``."""
    p = _launch("--mesh", "dp=2,tp=2", "--strategy", "megatron,sp,zero3", "--json", config=config, cls=cls)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["ok"] and rep["same_initial_weights"] and len(rep["steps"]) == 3
    for s in rep["steps"]:
        assert abs(s["loss"] - s["eager_loss"]) <= 2e-5 * max(1.0, abs(s["eager_loss"])), s
        assert s["collectives"] == [per_rank] * 4


MIXTRAL = {**LLAMA, "num_local_experts": 4, "num_experts_per_tok": 2}


def test_mixtral_sequence_parallel_fsdp_trains_as_eager() -> None:
    """Mixtral (1 layer, 4 experts, top 2) on dp=2 x tp=2 under megatron + sp + zero3, one launch:
    the MoE block's tokens gathered from the sequence shard (PrepareModuleInputOutput), the router
    replicated, each expert split over tp (ExpertsTensorParallel: the rows all-reduced), FSDP2 per
    block and the root. Per step on every rank: the tp all-gathers (q/k/v's input, the MoE block's
    input, the LM head's: 3 forward; the o_proj output's, the MoE output's and the embedding's
    gradients: 3 backward) and reduce-scatters (the embedding, o_proj: 2 forward; q/k/v's and the LM
    head's input gradients: 2 backward); all-reduces: the experts' rows and their input gradient (2),
    the 3 norms' weights (3) and the loss's 3; FSDP2's 2 all-gathers forward, 1 backward, 2
    reduce-scatters."""
    _sp_zero3_trains_as_eager(MIXTRAL, "MixtralForCausalLM", {"all_gather_into_tensor": 3 + 3 + 2 + 1,
                                                              "all_reduce": 2 + 3 + 3, "reduce_scatter_tensor": 2 + 2 + 2})


QWEN3 = {**LLAMA, "head_dim": 8}


def test_qwen3_head_norms_on_tp_alone_train_as_eager_under_adamw() -> None:
    """Qwen3 (1 layer) on tp=2 alone, megatron, AdamW: q_norm / k_norm run on the heads q_proj /
    k_proj make (SequenceParallel(sequence_dim=2, use_local_output=True): the export refused them
    before), and with no dp wrap their Partial weight gradients are all-reduced once as they are
    accumulated (_reduce_partial_grads_once), not at each of AdamW's 3 reads. Per step on every
    rank: the forward's tp all-reduces (o_proj, down_proj, the embedding: 3), the backward's (q/k/v's
    and gate/up's shared inputs, the head's input: 3; q_norm's and k_norm's weights: 2), the loss's 3."""
    p = _launch("--mesh", "tp=2", "--strategy", "megatron", "--optimizer", "adamw", "--steps", "2", "--json",
                config=QWEN3, cls="Qwen3ForCausalLM")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["ok"] and rep["same_initial_weights"] and len(rep["steps"]) == 2
    for s in rep["steps"]:
        assert abs(s["loss"] - s["eager_loss"]) <= 2e-5 * max(1.0, abs(s["eager_loss"])), s
        assert s["collectives"] == [{"all_reduce": 3 + 3 + 2 + 3}] * 2


def test_a_bfloat16_model_is_compared_at_its_dtypes_tolerance() -> None:
    """--dtype bfloat16: each rank and torch eager round their own sums in bfloat16, so the losses
    are compared within spmdkit run's bfloat16 tolerance (check.TOLERANCES, 6e-2 of the loss),
    not float32's 2e-5, which every bfloat16 run failed (1.3e-2 apart at step 1 here)."""
    from spmdkit.execute.check import TOLERANCES

    p = _launch("--mesh", "dp=2,tp=2", "--strategy", "megatron", "--dtype", "bfloat16", "--steps", "2", "--json")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["ok"] and rep["loss_rtol"] == TOLERANCES["bfloat16"] and "bfloat16" in rep["title"]
    assert all(s["collectives"] == [{"all_reduce": ALL_REDUCES}] * 4 for s in rep["steps"])


def test_an_export_of_another_model_class_is_refused_before_torchrun(tmp_path: Path) -> None:
    """--torch-plan written for Llama, run with --hf Qwen3ForCausalLM: refused (exit 2, one line)
    before torchrun starts, from the file's MODEL_CLASS. It trained before, Qwen3's q_norm / k_norm
    unstyled (each rank's own heads' weight gradient, the plan's all-reduces missing), and passed."""
    path = _real_export(tmp_path)
    assert "MODEL_CLASS = 'LlamaForCausalLM'" in path.read_text()
    p = _launch("--torch-plan", str(path), "--steps", "1", config=QWEN3, cls="Qwen3ForCausalLM")
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stderr.strip().splitlines() == [f"spmdkit run: --torch-plan {path}: planned for LlamaForCausalLM, not "
                                             f"--hf Qwen3ForCausalLM: its styles are that model's (a module of "
                                             f"Qwen3ForCausalLM it does not name would run unstyled)"]


def test_llama_pp_tp_pipeline_trains_as_eager(tmp_path: Path) -> None:
    """pp=2 x tp=2, 1F1B over 2 microbatches, AdamW: the export's build_pipeline under torchrun.
    Per microbatch stage 0 (the embedding, block 0) all-reduces 3 in the forward (the embedding,
    o_proj, down_proj) and 2 in the backward (the inputs q/k/v and gate/up share); stage 1 (block
    1, the norm, the head) 2 forward, 3 backward (+ the head's input) and the loss's 3."""
    cfg = {**LLAMA, "num_hidden_layers": 2}
    path = _real_export(tmp_path, "pp.py", "pp=2,tp=2", ["--microbatches", "2", "--schedule", "1f1b"], cfg)
    p = _launch("--torch-plan", str(path), "--json", "--optimizer", "adamw", "--steps", "2", config=cfg)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["ok"] and rep["pipeline"]["microbatches"] == 2
    for s in rep["steps"]:
        assert abs(s["loss"] - s["eager_loss"]) <= 2e-5 * max(1.0, abs(s["eager_loss"])), s
        assert s["collectives"] == [{"all_reduce": 2 * 5}] * 2 + [{"all_reduce": 2 * 5 + 2 * 3}] * 2
    # AdamW holds two moments per local parameter element (and a step count per parameter)
    assert all(m["optimizer"] >= 2 * m["parameters"] for m in rep["memory"])


def test_llama_pipeline_with_empty_end_stages_trains_as_eager(tmp_path: Path) -> None:
    """pp=4, --stages 0,1,1,0 (Megatron-Core's embedding-only first and loss-only last stage), 1F1B over
    4 microbatches: rank 0 holds the embedding alone, rank 3 the final norm and the head; the losses
    equal eager's and the collectives the plan's (tp=1: only the last stage's vocab-parallel loss's 3
    all-reduces, per microbatch)."""
    cfg = {**LLAMA, "num_hidden_layers": 2}
    path = _real_export(tmp_path, "pp0.py", "pp=4,tp=1", ["--microbatches", "4", "--schedule", "1f1b",
                                                          "--stages", "0,1,1,0"], cfg)
    p = _launch("--torch-plan", str(path), "--json", "--steps", "2", config=cfg)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["ok"] and rep["pipeline"]["stages"] == [["model.embed_tokens"], ["model.layers.0"],
                                                       ["model.layers.1"], ["model.norm", "lm_head"]]
    for s in rep["steps"]:
        assert abs(s["loss"] - s["eager_loss"]) <= 2e-5 * max(1.0, abs(s["eager_loss"])), s
        assert s["collectives"] == [{}, {}, {}, {"all_reduce": 4 * 3}]
    # fp32: the embedding [128, 32] alone on rank 0, the final norm [32] and the head [128, 32] on rank 3
    assert [m["parameters"] for m in rep["memory"]][::3] == [128 * 32 * 4, (32 + 128 * 32) * 4]


GPT2_PP = {"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 128, "n_positions": 64}


def test_gpt2_pp_tp_tied_pipeline_trains_as_eager(tmp_path: Path) -> None:
    """GPT-2 (wte tied to lm_head) at pp=2 x tp=2, 1F1B over 2 microbatches: the first stage holds
    wte and wpe, the last its own copy of wte as lm_head; after each step the copies' gradients
    are all-reduced between the stages (one all_reduce per rank per step). Per microbatch stage 0
    all-reduces 3 in the forward (the vocab-parallel wte, attn.c_proj, mlp.c_proj) and 2 in the
    backward (the inputs c_attn and c_fc read); stage 1 2 forward, 3 backward (+ lm_head's input)
    and the loss's 3. At lr 0.5 a step without the tied all-reduce differs from eager by 1e-2 at
    step 2 (checked by hand)."""
    path = _real_export(tmp_path, "gpt2pp.py", "pp=2,tp=2", ["--microbatches", "2", "--schedule", "1f1b"], GPT2_PP,
                        "GPT2LMHeadModel")
    text = path.read_text()
    assert "class _TiedSchedule(Schedule1F1B):" in text and "self.hf(inputs_embeds=x)" not in text
    p = _launch("--torch-plan", str(path), "--json", "--steps", "3", "--lr", "0.5", config=GPT2_PP,
                cls="GPT2LMHeadModel")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["ok"] and rep["pipeline"]["tied"] == [{"names": ["transformer.wte.weight", "lm_head.weight"],
                                                      "stages": [0, 1]}]
    for s in rep["steps"]:
        assert abs(s["loss"] - s["eager_loss"]) <= 2e-5 * max(1.0, abs(s["eager_loss"])), s
        assert s["collectives"] == [{"all_reduce": 2 * 5 + 1}] * 2 + [{"all_reduce": 2 * 5 + 1 + 2 * 3}] * 2


def test_an_auto_plan_exports_and_trains(tmp_path: Path) -> None:
    """--auto keeps the tiny model's step whole on every rank (no collective is worth it): the
    export wraps nothing, the batch is not split, the steps equal eager's with no collective."""
    path = _real_export(tmp_path, "auto.py", extra=["--auto", "--batch", "4", "--seq", "8"])
    assert "DATA_PARALLEL = None" in path.read_text()
    p = _launch("--torch-plan", str(path), "--json", "--steps", "2")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rep = json.loads(p.stdout.strip().splitlines()[-1])
    assert rep["ok"] and all(s["collectives"] == [{}] * 4 for s in rep["steps"])


def test_an_export_without_the_dp_gradient_reduction_fails_the_check(tmp_path: Path) -> None:
    """The real export with its FSDP2 replicate lines removed (the dp gradient all-reduces missing):
    step 1's loss is still eager's (the weights are equal), step 2's is not, and every step runs two
    all-reduces fewer than the export says."""
    path = _real_export(tmp_path)
    text = path.read_text()
    assert text.count("replicate(") == 2  # each block, then the root
    wrong = "\n".join(ln for ln in text.splitlines() if not ln.strip().startswith(("replicate(", "for block in")))
    path.write_text(wrong)
    p = _launch("--torch-plan", str(path), "--steps", "2", "--lr", "0.5")
    assert p.returncode == 1, p.stdout[-2000:] + p.stderr[-2000:]
    rows = [ln.split() for ln in p.stdout.splitlines() if ln.strip()[:1].isdigit()][:2]
    assert float(rows[0][3]) <= 1e-6
    assert float(rows[1][3]) > 1e-4  # step 2: the ranks' updates differ from eager's
    assert f"all_reduce x{ALL_REDUCES - 2}  NOT the plan's on rank(s) [0, 1, 2, 3]" in p.stdout
    assert f"plan's collectives per step: all_reduce x{ALL_REDUCES}" in p.stdout
    assert "losses NOT equal to torch eager's" in p.stdout and "collectives NOT equal to the plan's" in p.stdout


def test_a_rank_that_raises_ends_the_job_with_one_line(tmp_path: Path) -> None:
    path = _real_export(tmp_path)
    path.write_text(path.read_text() + "\n_orig = parallelize\n\ndef parallelize(model, mesh):\n"
                    "    if mesh.get_rank() == 2:\n        raise RuntimeError('rank two cannot place lm_head')\n"
                    "    return _orig(model, mesh)\n")
    t0 = time.monotonic()
    p = _launch("--torch-plan", str(path), timeout=300)
    assert p.returncode == 1 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert lines == ["spmdkit run: rank 2 failed: RuntimeError: rank two cannot place lm_head; torchrun ended "
                     "every rank (exit 1)"], p.stderr[-2000:]
    assert time.monotonic() - t0 < 240  # the others did not wait out --timeout 60 in a collective


def test_a_rank_killed_by_sigabrt_leaves_its_last_stderr_lines_in_the_failure(tmp_path: Path) -> None:
    """A rank that aborts (a C++ ``terminate``, here ``os.abort()`` after its message) writes no
    error of its own: the failure names the signal, then quotes the end of the rank's stderr
    (torchrun's ``--redirects`` file): the C++ message, faulthandler's ``Fatal Python error`` and
    the Python stack of the abort (the export's line, under ``load_export``)."""
    path = _real_export(tmp_path)
    path.write_text(path.read_text() + "\nimport os as _os\nimport sys as _sys\n\nif _os.environ['RANK'] == '2':\n"
                    "    _sys.stderr.write('terminate called after throwing an instance of gloo::EnforceNotMet\\n')\n"
                    "    _os.abort()\n")
    p = _launch("--torch-plan", str(path), timeout=300)
    assert p.returncode == 1 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert lines[0] == ("spmdkit run: rank 2 failed: killed by SIGABRT; torchrun ended every rank (exit 1); its "
                        "stderr ended:"), p.stderr[-3000:]
    assert lines[1:3] == ["  | terminate called after throwing an instance of gloo::EnforceNotMet",
                          "  | Fatal Python error: Aborted"], p.stderr[-3000:]
    assert any(ln.startswith(f'  |   File "{path}", line ') for ln in lines)
    assert any(ln.endswith(" in load_export") for ln in lines)


# -- without launching -------------------------------------------------------------------------


def test_collective_names_are_the_functional_ones() -> None:
    import torch

    from spmdkit.execute.torch_engine import collective_name

    assert collective_name(torch.ops._c10d_functional.all_reduce.default) == "all_reduce"
    assert collective_name(torch.ops._c10d_functional.all_gather_into_tensor.default) == "all_gather_into_tensor"
    assert collective_name(torch.ops.c10d.allreduce_.default) == "all_reduce"
    assert collective_name(torch.ops.c10d._reduce_scatter_base_.default) == "reduce_scatter_tensor"


def test_report_averages_the_batch_shards_and_names_the_ranks_that_differ() -> None:
    from spmdkit.execute.torchrun import format_torch_report, torch_report

    got = {"world_size": 2, "backend": "gloo", "mesh": {"dp": 2}, "loss_parallel": False, "pipeline": None,
           "eager": [2.0, 1.5], "eager_parameter_bytes": 4096,
           "ranks": [{"rank": r, "losses": [2.0 + d, 1.5 + d], "counts": [{"all_reduce": 1}, {"all_reduce": 1 + r}],
                      "expected": {"all_reduce": 1}, "weights_sum": 1.5,
                      "state_bytes": {"parameters": 4096, "gradients": 4096, "optimizer": 0},
                      "max_rss_bytes": 2**28} for r, d in ((0, 1e-6), (1, -1e-6))]}
    rep = torch_report(got, "t")
    assert [s["loss"] for s in rep["steps"]] == pytest.approx([2.0, 1.5], abs=1e-12)
    assert rep["losses_match"] and not rep["collectives_match"] and not rep["ok"]
    assert rep["steps"][1]["collectives_differ_on_ranks"] == [1]
    text = format_torch_report(rep)
    assert "all_reduce x1 (rank 0); all_reduce x2 (rank 1)  NOT the plan's on rank(s) [1]" in text
    assert "256.0 MiB" in text


def test_the_loss_tolerance_is_the_dtypes_and_the_launcher_imports_no_torch() -> None:
    """The loss is compared within 2e-5 in float32 and within spmdkit run's tolerance of the dtype
    (6e-2 bfloat16, 1e-2 float16: each rank and eager round their sums in it), figures the launcher
    reads without importing torch (it does not import the ranks' check module for them)."""
    code = ("import sys; from spmdkit.execute.torchrun import loss_rtol; "
            "print(loss_rtol('float32'), loss_rtol('bfloat16'), loss_rtol('float16'), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")}).stdout.split()
    assert out == ["2e-05", "0.06", "0.01", "False"]


def test_expected_counts_per_stage_and_phase() -> None:
    from spmdkit.execute.torch_engine import expected_counts

    assert expected_counts({"allreduce_": 2, "all_reduce": 1, "send": 0}, None) == {"all_reduce": 3}
    per_stage = {0: {"all_reduce": 3}, 1: {"forward": {"all_reduce": 2}, "backward": {"all_reduce": 2,
                                                                                      "all_gather_into_tensor": 1}}}
    assert expected_counts(per_stage, 1) == {"all_gather_into_tensor": 1, "all_reduce": 4}
    with pytest.raises(ValueError, match="no entry for pipeline stage 2"):
        expected_counts(per_stage, 2)


def test_failure_line_names_torchruns_root_cause(tmp_path: Path) -> None:
    from spmdkit.execute.torchrun import _failure_line

    log = ("Root Cause (first observed failure):\n[0]:\n  time      : now\n  host      : localhost\n"
           "  rank      : 3 (local_rank: 3)\n  exitcode  : -9 (pid: 1)\n  error_file: <N/A>\n"
           "  traceback : Signal 9 (SIGKILL) received by PID 1\n")
    assert _failure_line(str(tmp_path), log, 1) == ("rank 3 failed: killed by SIGKILL; torchrun ended every rank "
                                                    "(exit 1)\n  (rank 3 wrote nothing to stderr)")
    (tmp_path / "error.3").write_text("ValueError: x\n")
    assert _failure_line(str(tmp_path), log, 1) == "rank 3 failed: ValueError: x; torchrun ended every rank (exit 1)"


def test_failure_line_names_the_rank_whose_own_error_came_first(tmp_path: Path) -> None:
    """torchrun may observe first a peer that lost its connection to the failing rank (CI saw rank
    3's gloo error named for rank 2's RuntimeError): the rank with an error of its own is named."""
    import os

    from spmdkit.execute.torchrun import _failure_line

    log = ("Root Cause (first observed failure):\n[0]:\n  rank      : 3 (local_rank: 3)\n  exitcode  : 1 (pid: 1)\n"
           "  error_file: <N/A>\n  traceback : To enable traceback see: ...\n")
    (tmp_path / "error.3").write_text("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                                      "Connection closed by peer [127.0.0.1]:12345\n")
    assert _failure_line(str(tmp_path), log, 1).startswith("rank 3 failed: RuntimeError: [../third_party/gloo")
    (tmp_path / "error.2").write_text("RuntimeError: rank two cannot place lm_head\n")
    os.utime(tmp_path / "error.2", ns=(1, 1))  # written after the peer's, still named
    assert _failure_line(str(tmp_path), log, 1) == ("rank 2 failed: RuntimeError: rank two cannot place lm_head; "
                                                   "torchrun ended every rank (exit 1)")
    (tmp_path / "error.2").unlink()
    killed = log.replace("exitcode  : 1", "exitcode  : -9").replace("To enable traceback see: ...",
                                                                  "Signal 9 (SIGKILL) received by PID 1")
    (tmp_path / "error.3").rename(tmp_path / "error.1")
    assert _failure_line(str(tmp_path), killed, 1) == ("rank 3 failed: killed by SIGKILL; torchrun ended every rank "
                                                    "(exit 1)\n  (rank 3 wrote nothing to stderr)")


def test_failure_of_a_killed_rank_quotes_the_end_of_its_stderr(tmp_path: Path) -> None:
    """A rank killed by a signal: its stderr's last lines follow the failure line, from a few lines
    before faulthandler's last ``Fatal Python error`` (the C++ message is above it), its list of
    extension modules left out; a rank that wrote nothing is said so. A rank with an error of its
    own stays one line."""
    from spmdkit.execute.torchrun import _failure_line, rank_stderr_tail

    log = ("Root Cause (first observed failure):\n[0]:\n  rank      : 3 (local_rank: 3)\n  exitcode  : -6 (pid: 1)\n"
           "  error_file: <N/A>\n  traceback : Signal 6 (SIGABRT) received by PID 1\n")
    assert _failure_line(str(tmp_path), log, 1) == ("rank 3 failed: killed by SIGABRT; torchrun ended every rank (exit 1)"
                                                   "\n  (rank 3 wrote nothing to stderr)")
    rank3 = tmp_path / "logs" / "run_x" / "attempt_0" / "3"
    rank3.mkdir(parents=True)
    (tmp_path / "logs" / "run_x" / "attempt_0" / "2").mkdir()
    (tmp_path / "logs" / "run_x" / "attempt_0" / "2" / "stderr.log").write_text("rank two's line\n")
    said = [f"warning {i}" for i in range(40)] + [
        "terminate called after throwing an instance of 'gloo::EnforceNotMet'",
        "  what():  [enforce fail at pair.cc:446] op.preamble.length <= op.nbytes. 16 vs 8", "",
        "Fatal Python error: Aborted", "", "Thread 0x1 (most recent call first):", '  File "x.py", line 3 in f',
        "Extension modules: torch._C, numpy (total: 2)"]
    (rank3 / "stderr.log").write_text("\n".join(said) + "\n")
    got = _failure_line(str(tmp_path), log, 1).splitlines()
    assert got == ["rank 3 failed: killed by SIGABRT; torchrun ended every rank (exit 1); its stderr ended:",
                   "  | warning 38", "  | warning 39", "  | terminate called after throwing an instance of "
                   "'gloo::EnforceNotMet'", "  |   what():  [enforce fail at pair.cc:446] op.preamble.length <= "
                   "op.nbytes. 16 vs 8", "  | Fatal Python error: Aborted", "  | Thread 0x1 (most recent call first):",
                   '  |   File "x.py", line 3 in f']
    (rank3 / "stderr.log").write_text("\n".join(f"line {i}" for i in range(100)) + "\n")
    assert rank_stderr_tail(str(tmp_path), 3, 3) == ["line 97", "line 98", "line 99"]
    assert len(_failure_line(str(tmp_path), log, 1).splitlines()) == 1 + 25
    (tmp_path / "error.3").write_text("ValueError: x\n")
    assert _failure_line(str(tmp_path), log, 1) == "rank 3 failed: ValueError: x; torchrun ended every rank (exit 1)"


@pytest.mark.parametrize("fails", [False, True])
def test_the_worker_ends_without_the_interpreters_teardown(tmp_path: Path, fails: bool) -> None:
    """Run as the program, the worker ends its process once it has written rank 0's result (or its
    error line) and flushed its output: an exit handler never runs (the interpreter's teardown,
    with gloo's threads alive, is skipped), the exit status is the rank's."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"out": str(tmp_path)}))
    fake = "raise ValueError('no model')" if fails else "return {'facts': 1}"
    code = ("import atexit, sys\nimport spmdkit.execute.torch_engine as te\n"
            f"def run(spec):\n    print('ran', flush=True)\n    {fake}\n"
            "te.run = run\natexit.register(print, 'teardown')\n"
            f"sys.argv = ['worker', {str(spec)!r}]\nte.main()\nprint('main returned')\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT / "src"), RANK="0"))
    assert (p.returncode, p.stdout) == ((1, "ran\n") if fails else (0, "ran\n")), p.stderr[-2000:]
    if fails:
        assert (tmp_path / "error.0").read_text() == "ValueError: no model\n"
    else:
        assert json.loads((tmp_path / "result.json").read_text()) == {"facts": 1}


@pytest.mark.parametrize(("args", "line"), [
    (["--model", "tiny-llama"], "spmdkit run: --engine torch runs an --hf model"),
    (["--hf", "LlamaForCausalLM"], "spmdkit run: --hf needs --hf-config FILE|JSON (the model's config)"),
    (["--hf", "LlamaForCausalLM", "--hf-config", "{}", "--steps", "0"], "spmdkit run: --steps 0: must be in [1, 1000]"),
    (["--hf", "LlamaForCausalLM", "--hf-config", "{}", "--pad", "1"],
     "spmdkit run: --pad applies to --engine spmdkit, not --engine torch"),
    (["--hf", "LlamaForCausalLM", "--hf-config", "{}", "--torch-plan", "/nonexistent/x.py"],
     "spmdkit run: --torch-plan /nonexistent/x.py: cannot be read (No such file or directory)"),
    (["--hf", "LlamaForCausalLM", "--hf-config", "{}", "--mesh", "pp=2,tp=2"],
     "spmdkit run: --mesh pp=2,tp=2: a pipeline plan's stages and schedule come from spmdkit plan"),
    # these failed on every rank at run time (a 32-wide q_norm on 16 features; mixed Tensor and DTensor)
    (["--hf", "Olmo2ForCausalLM", "--hf-config", json.dumps(LLAMA), "--mesh", "dp=2,tp=2", "--strategy", "megatron,sp",
      "--batch", "4", "--seq", "8"],
     "spmdkit run: ExportError: --export torch: model.layers.0.self_attn.q_norm (Olmo2RMSNorm): normalises the "
     "whole output linear of the column-parallel model.layers.0.self_attn.q_proj (32 features"),
    (["--hf", "OPTForCausalLM", "--hf-config", json.dumps(OPT), "--mesh", "dp=2,tp=2", "--strategy", "megatron,sp",
      "--batch", "4", "--seq", "8"],
     "spmdkit run: ExportError: --export torch: model.decoder.embed_positions (OPTLearnedPositionalEmbedding): "
     "its lookup embedding_1 is added in model.decoder to embedding, which the plan reduce-scatters over tp"),
])
def test_refused_before_torchrun_starts(capsys: pytest.CaptureFixture[str], args: list[str], line: str) -> None:
    rc, last = run_cli_line(capsys, "--engine", "torch", *args)
    assert rc == 2 and last.startswith(line), last


def test_torch_flags_are_refused_on_the_spmdkit_engine(capsys: pytest.CaptureFixture[str]) -> None:
    rc, last = run_cli_line(capsys, "--steps", "2")
    assert rc == 2 and last == ("spmdkit run: --steps applies to --engine torch (this run is --engine spmdkit: "
                                "one step, op by op)")


def test_export_mesh_is_read_without_running_the_file(tmp_path: Path) -> None:
    from spmdkit.execute.torchrun import export_mesh

    f = tmp_path / "e.py"
    f.write_text("import does_not_exist\nMESH_DIMS = ('pp', 'tp')\nMESH_SHAPE = (2, 2)\n")
    assert export_mesh(str(f)) == (("pp", "tp"), (2, 2))
    f.write_text("MESH_DIMS = ('tp',)\n")
    with pytest.raises(ValueError, match="defines no MESH_SHAPE"):
        export_mesh(str(f))


def test_an_export_missing_a_contract_name_is_named(tmp_path: Path) -> None:
    from spmdkit.execute.torch_engine import load_export

    f = tmp_path / "plan.torch"  # any file name: the export is loaded as Python source
    f.write_text("MESH_DIMS = ('tp',)\nMESH_SHAPE = (2,)\nPIPELINE = {'schedule': '1f1b', 'microbatches': 2}\n"
                 "def parallelize(model, mesh):\n    return model\nPLAN_COLLECTIVES = {}\n")
    with pytest.raises(ValueError, match=r"PIPELINE is set but no build_pipeline\(model, mesh, loss_fn, device\) is defined"):
        load_export(str(f))
    f.write_text("MESH_DIMS = ('tp',)\n")
    with pytest.raises(ValueError, match="defines no MESH_SHAPE, parallelize, PLAN_COLLECTIVES"):
        load_export(str(f))


def test_the_batch_follows_the_export_then_the_plan_then_its_data_parallel_dim() -> None:
    from types import SimpleNamespace

    from spmdkit.execute.torch_engine import batch_split

    dims = ("dp", "tp")
    assert batch_split(SimpleNamespace(MESH_DIMS=dims, BATCH_DIMS=("dp", "tp")), ["dp"]) == ["dp", "tp"]
    assert batch_split(SimpleNamespace(MESH_DIMS=dims), []) == []  # the plan keeps the batch whole
    assert batch_split(SimpleNamespace(MESH_DIMS=dims, DATA_PARALLEL=None), None) == []  # an --auto export
    assert batch_split(SimpleNamespace(MESH_DIMS=dims, DATA_PARALLEL={"mesh_dim": "dp"}), None) == ["dp"]
    assert batch_split(SimpleNamespace(MESH_DIMS=("pp", "dp", "tp")), None) == ["dp"]
    with pytest.raises(ValueError, match=r"BATCH_DIMS \['ep'\]: ep not in MESH_DIMS \['dp', 'tp'\]"):
        batch_split(SimpleNamespace(MESH_DIMS=dims, BATCH_DIMS=["ep"]), None)



def test_a_planning_error_reads_the_same_on_both_engines_and_in_plan(capsys: pytest.CaptureFixture[str]) -> None:
    # tp=3 does not divide the 128-entry vocabulary: the planner's ProgramError, which spmdkit plan prints
    # with its class; run's two engines print it the same way (--engine spmdkit dropped the class)
    from spmdkit.cli import main

    args = ["--hf", "LlamaForCausalLM", "--hf-config", json.dumps(LLAMA), "--mesh", "tp=3", "--batch", "2", "--seq", "8"]
    want = ("ProgramError: --strategy megatron: model.embed_tokens (vocab): its vocabulary axis has 128 entries, "
            "not divisible by tp=3; pad it as Megatron-LM does: --make-vocab-size-divisible-by 128 pads it to 384 "
            "(a multiple of 128 x tp=3)")
    lines = [run_cli_line(capsys, "--engine", engine, *args) for engine in ("spmdkit", "torch")]
    assert lines == [(2, f"spmdkit run: {want}")] * 2
    assert main(["plan", *args]) != 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"spmdkit plan: {want}"
