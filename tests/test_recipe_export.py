"""--export-recipe (spmdkit.outputs.recipe): the search's best recipe as a torchtitan job config
(parsed with tomllib, each field checked against the configuration), Megatron-LM's arguments and
JSON; refused before the search where it cannot be written or expressed."""

from __future__ import annotations

import io
import itertools
import json
import tomllib
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from spmdkit.cli import main
from spmdkit.outputs.recipe import megatron_args, recipe, recipe_warning, torchtitan_toml
from spmdkit.planner.search import Config, config_candidates


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


SEARCH = ("plan", "--model", "llama3-8b", "--layers", "2", "--seq", "512", "--devices", "8", "--recompute", "full",
          "--global-batch", "64", "--micro-batch", "2")


def test_torchtitan_toml_from_the_search(tmp_path: Path) -> None:
    f = tmp_path / "job.toml"
    rc, _out, err = _cli(*SEARCH, "--strategy", "megatron,sp,zero1", "--export-recipe", "torchtitan", str(f))
    assert rc == 0, err
    j = tmp_path / "r.json"
    assert _cli(*SEARCH, "--strategy", "megatron,sp,zero1", "--export-recipe", "json", str(j))[0] == 0
    r = json.loads(j.read_text())
    doc = tomllib.loads(f.read_text())
    par = doc["parallelism"]
    assert r["dp"] * r["tp"] * r["pp"] == 8 and r["global_batch"] == 64 and r["recompute"] == "full"
    assert par["tensor_parallel_degree"] == r["tp"] and par["pipeline_parallel_degree"] == r["pp"]
    assert par["data_parallel_shard_degree"] == r["dp"] and par["data_parallel_replicate_degree"] == 1  # FSDP
    assert par["context_parallel_degree"] == 1 and par["expert_parallel_degree"] == 1
    assert doc["training"] == {"global_batch_size": 64, "seq_len": 512, "mixed_precision_param": "bfloat16",
                               "local_batch_size": 2 * (r["microbatches"] if r["pp"] > 1 else 1)}
    assert doc["activation_checkpoint"] == {"mode": "full"}
    assert r["micro_batch"] == 2 and (r["grad_accum"] or r["microbatches"]) == 64 // (2 * r["dp"])


def test_megatron_arguments_and_a_pipeline_recipe() -> None:
    c = next(x for x in config_candidates("llama3-8b", Config(2, 2, 2, "megatron,sp,zero1", microbatches=8),
                                          overrides={"layers": 4, "batch": 16, "seq": 512})
             if x.config.recompute == "selective")
    r = recipe(c, "llama3-8b", 16, 512, 4)
    assert (r["micro_batch"], r["microbatches"], r["schedule"]) == (1, 8, "1F1B")
    args = megatron_args(r).replace("\\\n", "").split()
    pairs = dict(itertools.pairwise(args))
    assert pairs["--tensor-model-parallel-size"] == "2" and pairs["--pipeline-model-parallel-size"] == "2"
    assert pairs["--micro-batch-size"] == "1" and pairs["--global-batch-size"] == "16"
    assert pairs["--recompute-granularity"] == "selective"
    assert "--sequence-parallel" in args and "--use-distributed-optimizer" in args
    doc = tomllib.loads(torchtitan_toml(r))
    assert doc["parallelism"]["pipeline_parallel_microbatch_size"] == 1
    assert doc["parallelism"]["pipeline_parallel_schedule"] == "1F1B"
    assert doc["training"]["local_batch_size"] == 8  # the rank's 8 sequences, in microbatches of 1
    assert doc["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}


@pytest.mark.parametrize(("extra", "message"), [
    (("--export-recipe", "yaml", "x.yaml"), "--export-recipe 'yaml': one of torchtitan, megatron, json"),
    (("--export-recipe", "json", "/no/such/dir/r.json"), "--export-recipe '/no/such/dir/r.json': is in no existing"),
])
def test_refused_in_one_line(extra: tuple[str, ...], message: str, tmp_path: Path,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    rc, _out, err = _cli(*SEARCH, *extra)
    assert rc == 2 and message in err, err
    assert [line for line in err.splitlines() if line.startswith("spmdkit plan:")] == err.splitlines()[-1:]
    assert not list(tmp_path.iterdir())  # no partial output file


def test_refused_without_devices(tmp_path: Path) -> None:
    rc, _out, err = _cli("plan", "--model", "tiny-llama", "--mesh", "dp=2", "--export-recipe", "json",
                         str(tmp_path / "r.json"))
    assert rc == 2 and "--export-recipe: applies to --devices" in err


def test_an_interleaved_recipe() -> None:
    """vp=2 (Config.virtual): torchtitan's Interleaved1F1B (2 stages a rank), Megatron-LM's
    --num-virtual-stages-per-pipeline-rank 2."""
    c = config_candidates("llama3-8b", Config(1, 2, 2, "megatron,sp", microbatches=4, virtual=2),
                          overrides={"layers": 4, "batch": 4, "seq": 512})[0]
    assert c.estimate.spec.virtual == 2 and c.estimate.counts == (1, 1, 1, 1)  # type: ignore[union-attr]
    r = recipe(c, "llama3-8b", 4, 512, 4)
    assert (r["schedule"], r["virtual_stages"], r["microbatches"]) == ("Interleaved1F1B", 2, 4)
    pairs = dict(itertools.pairwise(megatron_args(r).replace("\\\n", "").split()))
    assert pairs["--num-virtual-stages-per-pipeline-rank"] == "2" and pairs["--pipeline-model-parallel-size"] == "2"
    assert tomllib.loads(torchtitan_toml(r))["parallelism"]["pipeline_parallel_schedule"] == "Interleaved1F1B"


@pytest.mark.parametrize(("strategy", "zero", "flags"), [
    ("megatron,sp,zero1", 1, ["--use-distributed-optimizer"]),
    ("megatron,sp,zero2", 2, ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads",
                              "--ckpt-format", "fsdp_dtensor", "--init-model-with-meta-device"]),
    ("megatron,sp,zero3", 3, ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                              "--ckpt-format", "fsdp_dtensor", "--init-model-with-meta-device"]),
    ("megatron,sp", 0, []),
])
def test_megatron_zero_is_what_the_plan_models(strategy: str, zero: int, flags: list[str]) -> None:
    """ZeRO-1: Megatron-Core's distributed optimizer (the gradients reduced once); ZeRO-2 / 3:
    Megatron-FSDP's optim_grads / optim_grads_params (the gradients held at their shard and
    reduce-scattered in every microbatch, as the pipeline's step times them), never both."""
    c = next(x for x in config_candidates("llama3-8b", Config(2, 2, 2, strategy, microbatches=8),
                                          overrides={"layers": 4, "batch": 16, "seq": 512})
             if x.config.recompute == "none")
    r = recipe(c, "llama3-8b", 16, 512, 4)
    assert r["zero"] == zero
    args = megatron_args(r).replace("\\\n", "").split()
    zero_flags = {"--use-distributed-optimizer", "--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                  "--ckpt-format", "--init-model-with-meta-device"}
    got = [a for i, a in enumerate(args) if a in zero_flags or (i and args[i - 1] in zero_flags and
                                                                 not a.startswith("--"))]
    assert got == flags
    est = c.estimate
    assert any(s.each for s in est.stages) == (zero >= 2)  # type: ignore[union-attr]


def test_a_zero3_and_an_aliased_recipe_from_the_cli(tmp_path: Path) -> None:
    """``--strategy dp,zero3`` exports Megatron-FSDP's optim_grads_params (it was refused);
    ``fsdp`` (zero3's alias) is ZeRO-3 in the recipe, not none."""
    f = tmp_path / "args.txt"
    rc, _out, err = _cli(*SEARCH, "--strategy", "dp,zero3", "--export-recipe", "megatron", str(f))
    assert rc == 0, err
    pairs = dict(itertools.pairwise(f.read_text().replace("\\\n", "").split()))
    assert pairs["--data-parallel-sharding-strategy"] == "optim_grads_params" and "--use-megatron-fsdp" in pairs
    j = tmp_path / "r.json"
    assert _cli(*SEARCH, "--strategy", "megatron,sp,fsdp", "--export-recipe", "json", str(j))[0] == 0
    assert json.loads(j.read_text())["zero"] == 3
    assert tomllib.loads(torchtitan_toml(json.loads(j.read_text())))["parallelism"]["data_parallel_replicate_degree"] == 1


def test_an_hf_recipe_has_the_models_sequence_and_layers(tmp_path: Path) -> None:
    """--export-recipe of an --hf model without --seq / --layers wrote seq 0 and layers 0 (torchtitan's
    seq_len = 0, Megatron-LM's --seq-length 0 --num-layers 0): they are the traced program's, its
    data inputs' second axis and its layers."""
    pytest.importorskip("transformers")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                               "vocab_size": 256, "max_position_embeddings": 128}))
    j = tmp_path / "r.json"
    rc, _out, err = _cli("plan", "--hf", "LlamaForCausalLM", "--hf-config", str(cfg), "--devices", "4",
                         "--export-recipe", "json", str(j))
    assert rc == 0, err
    r = json.loads(j.read_text())
    assert (r["seq"], r["layers"]) == (16, 2)  # the --hf default sequence, the config's layers
    assert tomllib.loads(torchtitan_toml(r))["training"]["seq_len"] == 16
    pairs = dict(itertools.pairwise(megatron_args(r).replace("\\\n", "").split()))
    assert (pairs["--seq-length"], pairs["--num-layers"]) == ("16", "2")


def test_megatron_arguments_state_the_plans_precision() -> None:
    """Megatron-LM trains in fp32 without --bf16 / --fp16 (d98e8a64dd megatron/core/model_parallel_config.py:
    bf16 = False): the arguments of a bf16 plan had neither, those of an fp8 plan no --fp8-format."""
    from spmdkit.program.runtime import Runtime

    def args(model: str, runtime: Runtime | None = None) -> tuple[str, list[str]]:
        c = next(x for x in config_candidates(model, Config(2, 1, 1, "dp"), overrides={"layers": 2, "batch": 4,
                                                                                         "seq": 64}, runtime=runtime)
                 if x.config.recompute == "none")
        r = recipe(c, model, 4, 64, 2)
        return r["precision"], megatron_args(r).replace("\\\n", "").split()

    prec, got = args("llama3-8b")  # a bfloat16 catalog model
    assert prec == "bf16" and "--bf16" in got and "--fp16" not in got and "--fp8-format" not in got
    prec, got = args("llama3-8b", Runtime(precision="fp8"))
    assert prec == "fp8" and dict(itertools.pairwise(got))["--fp8-format"] == "hybrid" and "--bf16" in got
    prec, got = args("tiny-llama")  # float32
    assert prec == "fp32" and not {"--bf16", "--fp16", "--fp8-format"} & set(got)


def test_megatron_arguments_state_an_uneven_split_as_a_layout() -> None:
    """6 layers on pp=4: Megatron-LM asserts the layers divisible by the pipeline size unless a
    layout is given (d98e8a64dd megatron/training/arguments.py); the arguments had none, the split
    the plan priced (1, 1, 3, 1: the first and last stages hold the embedding and the 128k-vocab
    head) unsaid. The layout: E on the first stage, L on the last, t a layer, | between stages."""
    c = next(x for x in config_candidates("llama3-8b", Config(1, 1, 4, "dp", microbatches=4),
                                          overrides={"layers": 6, "batch": 4, "seq": 256})
             if x.config.recompute == "none")
    r = recipe(c, "llama3-8b", 4, 256, 6)
    assert r["layers_per_stage"] == list(c.estimate.counts) == [1, 1, 3, 1]  # type: ignore[union-attr]
    pairs = dict(itertools.pairwise(megatron_args(r).replace("\\\n", "").split()))
    assert pairs["--pipeline-model-parallel-layout"] == "'Et|t|t*3|tL'" and pairs["--num-layers"] == "6"
    even = next(x for x in config_candidates("llama3-8b", Config(2, 1, 2, "dp", microbatches=4),
                                             overrides={"layers": 4, "batch": 8, "seq": 256})
                if x.config.recompute == "none")
    r = recipe(even, "llama3-8b", 8, 256, 4)
    assert r["layers_per_stage"] == [2, 2] and "--pipeline-model-parallel-layout" not in megatron_args(r)


def test_torchtitan_toml_states_the_precision_and_the_split() -> None:
    """torchtitan 820504e trains in the dtype FSDP casts to (Training.mixed_precision_param) and splits
    a pipeline by its own rule unless given pipeline_parallel_split_points (generate_split_points: the
    embedding and the head a layer each, 8 effective layers on pp=4 as 2 each: layers.1, layers.3,
    layers.5); the plan priced 6 layers as 1, 1, 3, 1, which begin at layers.1, layers.2, layers.5."""
    c = next(x for x in config_candidates("llama3-8b", Config(1, 1, 4, "dp", microbatches=4),
                                          overrides={"layers": 6, "batch": 4, "seq": 256})
             if x.config.recompute == "none")
    r = recipe(c, "llama3-8b", 4, 256, 6)
    doc = tomllib.loads(torchtitan_toml(r))
    assert doc["parallelism"]["pipeline_parallel_split_points"] == ["layers.1", "layers.2", "layers.5"]
    assert doc["training"]["mixed_precision_param"] == "bfloat16"
    # no FSDP (dp = 1 here): torchtitan applies mixed_precision_param only as FSDP's param_dtype
    assert "trains in float32" in (recipe_warning("torchtitan", r) or "")
    fp32 = next(x for x in config_candidates("tiny-llama", Config(2, 1, 1, "dp,zero3"),
                                             overrides={"layers": 2, "batch": 4, "seq": 64})
                if x.config.recompute == "none")
    r = recipe(fp32, "tiny-llama", 4, 64, 2)
    doc = tomllib.loads(torchtitan_toml(r))
    assert doc["training"]["mixed_precision_param"] == "float32" and recipe_warning("torchtitan", r) is None
    assert "pipeline_parallel_split_points" not in doc["parallelism"]


def test_the_programs_precision_is_the_dtype_most_parameters_have() -> None:
    """Program.param_dtype, the one rule the step's peak rate and a recipe's precision read: the
    dtype of most parameters; of dtypes as many, the first declared (the set's hash order picked
    one before); None without parameters."""
    from spmdkit.cost.devices import load_device
    from spmdkit.cost.step import estimate_step
    from spmdkit.planner.propagate import propagate
    from spmdkit.program.ir import ProgramBuilder
    from spmdkit.strategies.strategy import parse_mesh

    def prog(*dtypes: str) -> Any:
        b = ProgramBuilder("p")
        b.tensor("x", [8, 16], kind="input")
        for i, dt in enumerate(dtypes):
            b.tensor(f"w{i}", [16, 16], dt, kind="parameter")
            b.op("matmul", {"x": "x" if i == 0 else f"h{i - 1}", "y": f"w{i}"}, [(f"h{i}", [8, 16])])
        return b.build(True)

    assert prog("float32", "bfloat16", "bfloat16").param_dtype() == "bfloat16"
    assert prog("bfloat16", "float32").param_dtype() == "bfloat16"
    assert prog("float32", "bfloat16").param_dtype() == "float32"
    assert ProgramBuilder("none").build(True).param_dtype() is None
    h100 = load_device("h100")
    for p, dt in ((prog("float32", "bfloat16", "bfloat16"), "bfloat16"), (prog("float32", "bfloat16"), "float32")):
        assert estimate_step(propagate(p, parse_mesh("dp=2"), {"x": [0, -1]}), h100).peak == h100.matmul_peak(dt)


@pytest.mark.parametrize(("variant", "megatron", "titan"), [
    ("", "all_gather", "allgather"), (",cp-attention=ring", "p2p", "alltoall"), (",cp-attention=alltoall", "a2a", None)])
def test_a_cp_recipe_states_the_attention_the_plan_priced(variant: str, megatron: str, titan: str | None) -> None:
    """The search prices three attentions over a split sequence (planner.search_space.CP_VARIANTS); the
    recipes said the degree alone, so Megatron-LM ran its default --cp-comm-type p2p (the ring) whatever was
    priced, and torchtitan its default rotate method (allgather)."""
    c = next(x for x in config_candidates("llama3-8b", Config(1, 1, 1, f"dp,cp{variant}", cp=2),
                                          overrides={"layers": 2, "batch": 2, "seq": 1024})
             if x.config.recompute == "none")
    r = recipe(c, "llama3-8b", 2, 1024, 2)
    assert r["context_parallel"] == 2 and r["cp_attention"] == (variant.split("=")[1] if variant else "allgather")
    pairs = dict(itertools.pairwise(megatron_args(r).replace("\\\n", "").split()))
    assert pairs["--context-parallel-size"] == "2" and pairs["--cp-comm-type"] == megatron
    par = tomllib.loads(torchtitan_toml(r))["parallelism"]
    warning = recipe_warning("torchtitan", r) or ""
    if titan is None:  # Ulysses: torch's context_parallel has none; said, and its default written
        assert par["context_parallel_rotate_method"] == "allgather" and "has no torchtitan form" in warning
    else:
        assert par["context_parallel_rotate_method"] == titan and "cp attention" not in warning
    flat = next(x for x in config_candidates("llama3-8b", Config(2, 1, 1, "dp"),
                                             overrides={"layers": 2, "batch": 2, "seq": 1024})
                if x.config.recompute == "none")
    r = recipe(flat, "llama3-8b", 2, 1024, 2)
    assert "cp_attention" not in r and "--cp-comm-type" not in megatron_args(r)
    assert "context_parallel_rotate_method" not in tomllib.loads(torchtitan_toml(r))["parallelism"]


def test_recipes_state_the_overlaps_the_step_was_priced_with() -> None:
    """The step is priced with the gradient buckets reduced under the backward, the distributed optimizer's
    parameters gathered under the next forward, and --tp-comm-overlap / --compile where given; Megatron-LM
    runs none of the first two by default (d98e8a64dd: --overlap-grad-reduce, --overlap-param-gather are
    store_true) and the arguments said neither; torchtitan's TOML had no compile nor async TP."""
    from spmdkit.program.runtime import Runtime

    def rec(strategy: str, runtime: Runtime | None = None, dp: int = 2, tp: int = 2) -> dict[str, object]:
        c = next(x for x in config_candidates("llama3-8b", Config(dp, tp, 1, strategy),
                                              overrides={"layers": 2, "batch": 4, "seq": 256}, runtime=runtime)
                 if x.config.recompute == "none")
        return recipe(c, "llama3-8b", 4, 256, 2)

    args = megatron_args(rec("megatron,sp,zero1")).split()
    assert "--overlap-grad-reduce" in args and "--overlap-param-gather" in args and "--tp-comm-overlap" not in args
    args = megatron_args(rec("megatron,sp")).split()  # DDP: its buckets; no distributed optimizer to gather
    assert "--overlap-grad-reduce" in args and "--overlap-param-gather" not in args
    args = megatron_args(rec("megatron,sp,zero3")).split()  # Megatron-FSDP turns both on itself
    assert not {"--overlap-grad-reduce", "--overlap-param-gather"} & set(args)
    args = megatron_args(rec("megatron,sp,zero1", Runtime(grad_overlap=False))).split()  # --no-grad-overlap
    assert not {"--overlap-grad-reduce", "--overlap-param-gather"} & set(args)
    assert "--overlap-grad-reduce" not in megatron_args(rec("megatron,sp", dp=1))  # no data-parallel reduction
    assert "--tp-comm-overlap" in megatron_args(rec("megatron,sp", Runtime(tp_comm_overlap=True))).split()
    titan = rec("megatron,sp,zero3", Runtime(framework="torchtitan", compile=True, tp_comm_overlap=True))
    doc = tomllib.loads(torchtitan_toml(titan))
    assert doc["training"]["compile"] is True and doc["parallelism"]["enable_async_tensor_parallel"] is True
    doc = tomllib.loads(torchtitan_toml(rec("megatron,sp,zero3", Runtime(framework="torchtitan"))))
    assert "compile" not in doc["training"] and "enable_async_tensor_parallel" not in doc["parallelism"]
