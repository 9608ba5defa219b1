"""``--recompute every:N``: torchtitan's layer-frequency selective activation checkpointing
(``[activation_checkpoint] mode = "selective"``, ``selective_ac_option = "N"``; 9dec370
``torchtitan/parallelisms/parallelize_llama.py`` ``_apply_ac_to_transformer_block``): one counter
a process, ``ptd_checkpoint_wrapper._count += 1`` for each block it is given, and the block
wrapped in ``checkpoint_wrapper`` where ``_count % ac_freq == 0`` -- the N-th, 2N-th ... block
counted from 1, over the model chunks of a pipeline rank in the order it builds them (its stages
``r, r + p, ...``), never reset."""

from __future__ import annotations

import io
import json
import tomllib
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import replace

import pytest

from spmdkit.cli import main
from spmdkit.core.errors import ProgramError
from spmdkit.cost.checkpoints import every_blocks, recompute_every
from spmdkit.cost.compute import op_cost
from spmdkit.cost.devices import load_device
from spmdkit.cost.memory import check_recompute, memory_per_device
from spmdkit.cost.memory_saved import recompute_regions, saved_activations
from spmdkit.cost.step import estimate_step
from spmdkit.outputs.recipe import megatron_args, recipe, recipe_warning, torchtitan_toml
from spmdkit.planner.pipeline import estimate_pipeline
from spmdkit.planner.pipeline_split import PipelineSpec, every_layers
from spmdkit.planner.planning import plan_model
from spmdkit.planner.search import Config, config_candidates
from spmdkit.program.runtime import Runtime

#: tiny-llama (float32, batch 4, seq 8, hidden 16) at 4 layers on dp=2: 2 sequences a rank
LAYERS = 4
INPUT = 2 * 8 * 16 * 4  # a checkpointed layer's input: b/dp x s x h x 4 bytes


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def plan():  # type: ignore[no-untyped-def]
    p = plan_model("tiny-llama", "dp=2", "dp", {"layers": LAYERS})[1]
    return replace(p, runtime=Runtime(framework="torchtitan"))


def test_the_blocks_torchtitan_wraps() -> None:
    # by hand from the counter: 1-based, count % N == 0, running on over a rank's chunks
    assert every_blocks([4], 2) == [[1, 3]]
    assert every_blocks([4], 1) == [[0, 1, 2, 3]]
    assert every_blocks([4], 3) == [[2]]
    assert every_blocks([4], 4) == [[3]]
    assert every_blocks([2, 2], 3) == [[], [0]]  # the 3rd block is the second chunk's first
    assert every_blocks([3, 3], 2) == [[1], [0, 2]]  # blocks 2, 4, 6 of the rank
    assert recompute_every("every:12") == 12 and recompute_every("full") is None and recompute_every("full:2") is None


def test_every_2_of_4_layers_keeps_the_inputs_of_layers_1_and_3_and_everything_of_0_and_2(plan) -> None:  # type: ignore[no-untyped-def]
    prog = plan.program
    full = recompute_regions(prog, "full")
    assert len(full) == LAYERS and recompute_regions(prog, "every:2") == [full[1], full[3]]
    assert recompute_regions(prog, "every:4") == [full[3]] and recompute_regions(prog, "every:1") == full
    none, two, every = (saved_activations(plan, m) for m in ("none", "every:2", "full"))
    assert two.layers == ["layer 1", "layer 3"] and every.layers == []
    # the wrapped blocks keep their input only, as under full (checkpoint_wrapper saves its input)
    assert two.layer("layer 1") == two.layer("layer 3") == INPUT
    assert {n for n, _ in two.tensors["layer 1"]} == {"layers.0.resid2"}
    assert {n for n, _ in two.tensors["layer 3"]} == {"layers.2.resid2"}
    # the others keep what they keep without recomputation; layer 2's norm, not checkpointed, saves its
    # input, the output of the wrapped layer 1 (kept, not made again), and the final norm layer 3's
    assert two.layer("layer 0") == none.layer("layer 0") > 10 * INPUT
    assert two.layer("layer 2") == none.layer("layer 2") and ("layers.1.resid2", INPUT) in two.tensors["layer 2"]
    assert two.layer("head") == none.layer("head") and ("layers.3.resid2", INPUT) in two.tensors["head"]
    assert two.total == 2 * INPUT + none.layer("layer 0") + none.layer("layer 2") + none.layer("head")
    assert every.total < two.total < none.total
    mem = {m: memory_per_device(plan, m) for m in ("none", "every:2", "full")}
    assert mem["full"].total < mem["every:2"].total < mem["none"].total
    assert mem["every:2"].saved is not None and mem["every:2"].saved.total == two.total


def test_every_2_runs_the_forward_of_half_the_layers_again(plan) -> None:  # type: ignore[no-untyped-def]
    dev = load_device("h100")
    est = {m: estimate_step(plan, dev, 64, m) for m in ("none", "every:2", "full")}
    hand = sum(op_cost(plan, j).flops for j, op in enumerate(plan.program.ops)
               if op.phase == "forward" and op.layer in ("layer 1", "layer 3"))
    e = est["every:2"]
    assert hand > 0 and e.recompute_flops_per_device == pytest.approx(hand, rel=1e-12)
    assert e.recompute_flops_per_device == pytest.approx(est["full"].recompute_flops_per_device / 2, rel=1e-12)
    assert e.flops_per_device == pytest.approx(est["none"].flops_per_device + hand, rel=1e-12)
    assert e.compute_s["recompute"] == pytest.approx(est["full"].compute_s["recompute"] / 2, rel=1e-9)
    assert est["none"].step_overlap_s < e.step_overlap_s < est["full"].step_overlap_s
    assert e.recompute == "every:2"


def test_a_pipeline_counts_the_blocks_of_each_rank() -> None:
    p8 = plan_model("tiny-llama", "dp=1", "dp", {"layers": 8})[1]
    prog = p8.program
    # pp 2, 4 layers a stage: each rank counts its own 4 blocks (not the model's 8)
    assert every_layers(prog, (4, 4), 2, 2) == {"layer 1", "layer 3", "layer 5", "layer 7"}
    assert every_layers(prog, (4, 4), 3, 2) == {"layer 2", "layer 6"}  # a count over the model: 2 and 5
    # 2 virtual stages a rank (looped): rank 0 holds layers 0, 1 and 4, 5, rank 1 layers 2, 3 and 6, 7;
    # the count runs on from a rank's first chunk to its second
    assert every_layers(prog, (2, 2, 2, 2), 3, 2) == {"layer 4", "layer 6"}
    with pytest.raises(ProgramError, match=r"^--recompute every:5: torchtitan counts the blocks of each pipeline "
                                           r"rank and checkpoints its blocks 5, 10, \.\.\.; no rank holds 5 \(the "
                                           r"most: 4\), so none would be \(give N from 1 to 4, or none\)$"):
        every_layers(prog, (4, 4), 5, 2)
    sub = plan_model("tiny-llama", "dp=1", "dp", {"layers": 8, "batch": 1})[1]
    sub = replace(sub, runtime=Runtime(framework="torchtitan"))
    dev = load_device("h100")
    spec = PipelineSpec(2, 4, "1f1b", 1)
    got = {m: estimate_pipeline(sub, spec, (4, 4), dev, recompute=m) for m in ("none", "every:2", "full")}
    for s in range(2):  # each stage reruns 2 of its 4 layers: half of full's recomputation
        assert got["every:2"].stages[s].recompute_s == pytest.approx(got["full"].stages[s].recompute_s / 2, rel=1e-9)
        assert got["full"].stages[s].stash_bytes < got["every:2"].stages[s].stash_bytes \
            < got["none"].stages[s].stash_bytes


def test_every_n_refusals() -> None:
    for bad, what in (("every:0", r"N must be at least 1 \(torchtitan's selective_ac_option = \"0\" checkpoints "
                                  r"every block: give full\)"),
                      ("every:x", r"expected every:N with N a whole number of blocks >= 1"),
                      ("every:1.5", r"expected every:N"), ("every:-1", r"expected every:N"), ("every:", "expected")):
        with pytest.raises(ProgramError, match=rf"^--recompute '{bad}': {what}"):
            check_recompute(bad)
    assert check_recompute("every:3", framework="torchtitan") == "every:3"
    with pytest.raises(ProgramError, match=r"^--recompute every:2 with --framework megatron: megatron's activation "
                                           r"checkpointing has no setting that checkpoints every N-th layer \("
                                           r"torchtitan's selective_ac_option = N\); it has full \(--recompute-method "
                                           r"uniform, 1 layer a unit\) or full:K \(--recompute-method block"):
        check_recompute("every:2", framework="megatron")
    with pytest.raises(ProgramError, match=r"^--recompute every:2 with --framework automodel: .* it has full \(every "
                                           r"layer\) or selective, or give --framework torchtitan$"):
        check_recompute("every:2", framework="automodel")
    megatron = plan_model("tiny-llama", "dp=2", "dp", {"layers": LAYERS})[1]  # the plan's own framework
    with pytest.raises(ProgramError, match=r"^--recompute every:2 with --framework megatron"):
        saved_activations(megatron, "every:2")


def test_the_cli_refusals_and_the_search(capsys: pytest.CaptureFixture[str]) -> None:
    base = ("plan", "--model", "tiny-llama", "--layers", "4", "--strategy", "dp")
    for fw in ("megatron", "automodel"):
        for mesh in ("dp=2", "pp=2,dp=1"):
            rc, _out, err = _cli(*base, "--mesh", mesh, "--recompute", "every:2", "--framework", fw)
            assert rc == 2 and err.startswith(f"spmdkit plan: ProgramError: --recompute every:2 with --framework {fw}: ")
    rc, _out, err = _cli(*base, "--mesh", "dp=2", "--recompute", "every:5", "--framework", "torchtitan")
    assert rc == 2 and err.strip() == ("spmdkit plan: ProgramError: --recompute every:5: checkpoints layers 5, 10, ... "
                                       "(counted from 1), but the model has 4, so none would be (give N from 1 to 4, "
                                       "or none)")
    rc, _out, err = _cli(*base, "--mesh", "pp=2,dp=1", "--recompute", "every:3", "--framework", "torchtitan",
                         "--microbatches", "2")
    assert rc == 2 and "no rank holds 3 (the most: 2)" in err
    # the search tries none, selective and full only (docs/devices.md, "Recomputation")
    rc, _out, err = _cli("plan", "--model", "tiny-llama", "--devices", "2", "--recompute", "every:2", "--framework",
                         "torchtitan")
    assert rc == 2 and err.strip() == ("spmdkit plan: ProgramError: --recompute every:2: the search tries none, "
                                       "selective, full (each configuration priced once a mode), not every N-th layer; "
                                       "price it for one configuration with spmdkit plan --mesh ... --recompute every:2")


def _plan_json(*extra: str) -> dict:  # type: ignore[type-arg]
    rc, out, err = _cli("plan", "--model", "tiny-llama", "--layers", "4", "--mesh", "dp=2", "--strategy", "dp",
                        "--device", "h100", "--framework", "torchtitan", "--json", *extra)
    assert rc == 0, err
    got = json.loads(out)
    got.pop("plan_seconds")
    return got  # type: ignore[no-any-return]


def test_the_plan_names_the_mode_and_every_1_is_full() -> None:
    assert _plan_json("--recompute", "every:1") == _plan_json("--recompute", "full")
    two = _plan_json("--recompute", "every:2")
    assert two["memory"]["saved_for_backward"]["recompute"] == "every:2"
    assert two["memory"]["saved_for_backward"]["recomputed_layers"] == ["layer 1", "layer 3"]
    assert two["step"]["recompute"] == "every:2"
    rc, text, _err = _cli("plan", "--model", "tiny-llama", "--layers", "4", "--mesh", "dp=2", "--strategy", "dp",
                          "--framework", "torchtitan", "--recompute", "every:2")
    assert rc == 0 and "kept for the backward (recompute every:2: layer 1, layer 3 recomputed)" in text


def test_the_recipe_writes_torchtitans_option() -> None:
    c = next(x for x in config_candidates("llama3-8b", Config(2, 2, 1, "megatron,sp,zero1"),
                                          overrides={"layers": 4, "batch": 16, "seq": 512})
             if x.config.recompute == "selective")
    c = replace(c, config=replace(c.config, recompute="every:2"))
    r = recipe(c, "llama3-8b", 16, 512, 4)
    doc = tomllib.loads(torchtitan_toml(r))
    assert doc["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "2"}
    assert recipe_warning("torchtitan", r) is None
    args = megatron_args(r)
    assert "--recompute-method uniform" in args and "--recompute-num-layers 1" in args
    warn = recipe_warning("megatron", r)
    assert warn is not None and warn.startswith("--export-recipe megatron: recompute every:2 (torchtitan's checkpoint "
                                                "of blocks 2, 4, ... of each pipeline rank) has no Megatron-LM form")
