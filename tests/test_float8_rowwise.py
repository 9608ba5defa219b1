"""torchao's float8 rowwise recipe under torchtitan (``--float8-recipe rowwise``; torchao
``Float8LinearConfig.from_recipe_name("rowwise")`` at 6243040, torchtitan 820504e): where the option
applies and what it refuses, the ``[float8]`` section of the torchtitan export, the casts of one
linear by hand (torchao's roofline ``roofline_utils.py`` at 6243040 and the backward GEMMs' rescale of
``float8_ops.addmm_float8_unwrapped``), plain TP with bf16 all-gathers, and async TP's all-gathers
left unfused (pytorch/pytorch#149990)."""

from __future__ import annotations

import contextlib
import io
import tomllib
from dataclasses import replace

import pytest
from tests.test_torchao_casts import H100, HIDDEN, SEQ, _casts, _plan

from spmdkit.cli import main
from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.cost import step as st
from spmdkit.cost.compute import fp8_layers
from spmdkit.cost.float8_tp import amax_all_reduces, float8_tp_gathers
from spmdkit.cost.step_comm import communication
from spmdkit.cost.step_compute import step_compute
from spmdkit.cost.torchao_casts import RESCALE, ROW_CAST, ROW_CAST_T, ROW_GRAD_OUT, rowwise_cast_bytes
from spmdkit.outputs.recipe import recipe, torchtitan_toml
from spmdkit.planner.search import Config, config_candidates
from spmdkit.program.runtime import FLOAT8_RECIPES, Runtime

TENSORWISE = Runtime(framework="torchtitan", precision="fp8", compile=True)
ROWWISE = replace(TENSORWISE, float8_recipe="rowwise")


def _cli_error(*extra: str) -> str:
    argv = ["plan", "--model", "llama-7b", "--layers", "1", "--mesh", "dp=2", "--strategy", "dp,zero3", *extra,
            "--json"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) != 0
    return err.getvalue()


def test_the_recipe_names_are_torchaos() -> None:
    # torchao/float8/config.py at 890e0ac8, 6243040 and 0afa4c1: Float8LinearRecipeName TENSORWISE = "tensorwise",
    # ROWWISE = "rowwise", ROWWISE_WITH_GW_HP = "rowwise_with_gw_hp" (torchtitan 820504e's recipe_name Literal)
    assert FLOAT8_RECIPES == ("tensorwise", "rowwise", "rowwise_with_gw_hp")
    assert ROWWISE.float8_rowwise and not TENSORWISE.float8_rowwise
    assert Runtime(framework="torchtitan", precision="fp8", float8_recipe="tensorwise").to_json()["float8_recipe"] \
        == "tensorwise"
    assert ROWWISE.to_json()["float8_recipe"] == "rowwise" and TENSORWISE.to_json()["float8_recipe"] == "tensorwise"
    assert "float8_recipe" not in Runtime(framework="torchtitan").to_json()


def test_the_option_is_refused_where_it_does_not_apply() -> None:
    with pytest.raises(ProgramError, match=r"--float8-recipe 'blockwise': expected one of tensorwise, rowwise, "
                                           r"rowwise_with_gw_hp"):
        Runtime(framework="torchtitan", precision="fp8", float8_recipe="blockwise")
    with pytest.raises(ProgramError, match=r"--float8-recipe rowwise: torchao's float8 recipe applies to --precision "
                                           r"fp8 --framework torchtitan only \(given: --precision bf16, "
                                           r"--framework torchtitan\)"):
        Runtime(framework="torchtitan", precision="bf16", float8_recipe="rowwise")
    with pytest.raises(ProgramError, match=r"\(given: --precision fp8, --framework megatron\)"):
        Runtime(framework="megatron", precision="fp8", float8_recipe="rowwise")
    with pytest.raises(ProgramError, match=r"--float8-recipe rowwise_with_gw_hp: not modelled \(its grad_weight GEMM "
                                           r"runs in bf16"):
        Runtime(framework="torchtitan", precision="fp8", float8_recipe="rowwise_with_gw_hp")
    # torchtitan 820504e (components/quantization/float8.py): a recipe_name asserts the float8 all-gather off;
    # torchao's Float8LinearConfig: "enable_fsdp_float8_all_gather only supports tensorwise scaling granularity"
    with pytest.raises(ProgramError, match=r"--float8-recipe rowwise and --fsdp-float8-all-gather: torchao's float8 "
                                           r"all-gather supports tensorwise scaling only"):
        replace(ROWWISE, fsdp_float8_all_gather=True)
    assert replace(TENSORWISE, float8_recipe="tensorwise", fsdp_float8_all_gather=True).fsdp_float8_all_gather
    assert issubclass(ProgramError, SpmdError)
    # the command line names the option and the argument
    assert "ProgramError: --float8-recipe rowwise: torchao's float8 recipe applies to --precision fp8 --framework " \
        "torchtitan only (given: no --precision, --framework torchtitan)" in _cli_error(
            "--framework", "torchtitan", "--float8-recipe", "rowwise")
    assert "--float8-recipe rowwise and --fsdp-float8-all-gather" in _cli_error(
        "--framework", "torchtitan", "--precision", "fp8", "--fsdp-float8-all-gather", "--float8-recipe", "Rowwise")


def test_the_torchtitan_export_writes_the_recipe() -> None:
    # torchtitan 820504e: [model] converters = ["float8"], [float8] recipe_name = "rowwise" (config_manager.Float8);
    # tensorwise is torchtitan's default (no recipe_name: one would assert the float8 all-gather off)
    def section(rt: Runtime) -> dict[str, object]:
        c = config_candidates("llama-7b", Config(2, 1, 1, "dp,zero3", "none"), "h100",
                              overrides={"layers": 1, "seq": 256, "batch": 2}, runtime=rt)[0]
        toml = torchtitan_toml(recipe(c, "llama-7b", 2, 256, 1))
        if rt.float8_rowwise:
            assert '\n[float8]\nenable_fsdp_float8_all_gather = false\n' in toml and 'recipe_name = "rowwise"\n' in toml
        return tomllib.loads(toml)

    got = section(ROWWISE)
    assert got["model"] == {"converters": ["float8"]}
    assert got["float8"] == {"enable_fsdp_float8_all_gather": False, "precompute_float8_dynamic_scale_for_fsdp": False,
                             "recipe_name": "rowwise", "filter_fqns": ["output"]}
    tw = section(replace(TENSORWISE, fsdp_float8_all_gather=True))
    assert tw["float8"] == {"enable_fsdp_float8_all_gather": True, "precompute_float8_dynamic_scale_for_fsdp": True,
                            "filter_fqns": ["output"]}
    assert "float8" not in section(Runtime(framework="torchtitan", compile=True))


def test_the_rowwise_casts_of_one_linear_by_hand() -> None:
    # torchao's roofline for "rowwise" (roofline_utils.py at 6243040): a cast along the contiguous axis reads
    # bf16 and writes float8 (2 + 1); along the other axis a bf16 transpose (2 + 2) then that cast; the output
    # gradient's float8 copy and bf16 transpose in one pass (2 + 1 + 2), the transpose's cast (2 + 1). The two
    # backward GEMMs (use_fast_accum=False) run cuBLAS's tensorwise kernel, then output *= post_inverse_scale:
    # read and write the bf16 output (2 + 2), for dX and for dW
    assert (ROW_CAST, ROW_CAST_T, ROW_GRAD_OUT, RESCALE) == (3.0, 7.0, 8.0, 4.0)
    got = _casts(_plan("dp=2", "dp", ROWWISE, batch=2))  # one sequence a rank, every linear whole
    w, x = HIDDEN * HIDDEN, SEQ * HIDDEN  # wo: a 4096 x 4096 weight, its input and its output 2048 x 4096
    # wo's forward: its weight cast (3 B an element), its input (the attention output, read by wo alone) cast
    assert got["layers.0.attn_out"] == 3 * w + 3 * x == 75_497_472
    # wo's backward: the weight re-scaled along its other axis (7), the output gradient's two casts (8), the
    # input re-scaled along its other axis (7), dX and dW rescaled (4 each)
    assert got["grad of layers.0.attn_out"] == 7 * w + 8 * x + 7 * x + 4 * (x + w) == 343_932_928
    assert rowwise_cast_bytes((1, SEQ, HIDDEN, HIDDEN), w, grad=True, x_cast=False, x_transpose=True) == 343_932_928
    # q / k / v read one input: its forward cast and its backward re-scale once (the first reader of each phase)
    layers = fp8_layers(_plan("dp=2", "dp", ROWWISE, batch=2).program)
    assert layers.first_reads and layers.first_grad_reads
    assert got["layers.0.q"] == 3 * w + 3 * x and got["layers.0.k"] == got["layers.0.v"] == 3 * w
    assert got["grad of layers.0.v"] - got["grad of layers.0.q"] == 7 * x
    # tensorwise for the same linear (torchao_casts: amax 2 + cast 3, transposed float8 copies 2): fewer bytes
    tw = _casts(_plan("dp=2", "dp", TENSORWISE, batch=2))
    assert tw["layers.0.attn_out"] == 5 * w + 5 * x and tw["grad of layers.0.attn_out"] == 2 * w + 7 * x + 2 * x
    assert got["layers.0.attn_out"] < tw["layers.0.attn_out"]
    assert got["grad of layers.0.attn_out"] + got["layers.0.attn_out"] > \
        tw["grad of layers.0.attn_out"] + tw["layers.0.attn_out"]


def test_rowwise_runs_plain_tp_with_bf16_all_gathers() -> None:
    # torchtitan 820504e parallelize_llama: enable_float8_tensorwise_tp = enable_float8_linear and not
    # float8_is_rowwise: no PrepareFloat8ModuleInput / Float8RowwiseParallel, the gathers in bf16, no amax
    # all-reduce of a sharded cast (every cast runs on the gathered tensor)
    tw, rw = _plan("tp=4", "megatron,sp", TENSORWISE), _plan("tp=4", "megatron,sp", ROWWISE)
    assert float8_tp_gathers(tw) and amax_all_reduces(tw)
    assert float8_tp_gathers(rw) == frozenset() and amax_all_reduces(rw) == {}
    # the block input's all-gather: 2 bytes an element (1 under tensorwise)
    comm = {p.runtime.float8_recipe: communication(p, step_compute(p, H100), H100) for p in (tw, rw)}
    norm = next(i for i, op in enumerate(rw.program.ops) if op.name == "layers.0.attn_norm.out")
    assert comm["rowwise"].blocking[norm] > comm[None].blocking[norm]
    # its casts priced on the gathered input (q reads SEQ x HIDDEN, not the 1/4 shard)
    wq = HIDDEN * HIDDEN // 4
    assert _casts(rw)["layers.0.q"] == 3 * wq + 3 * SEQ * HIDDEN
    # the step: rowwise is slower than tensorwise (bf16 gathers, more cast bytes, the GEMM rates alike)
    est = {p.runtime.float8_recipe: st.estimate_step(p, H100, SEQ) for p in (tw, rw)}
    assert est["rowwise"].step_overlap_s > est[None].step_overlap_s


def test_async_tp_does_not_fuse_the_rowwise_all_gathers() -> None:
    # pytorch/pytorch#149990 (open): with rowwise scales the matmul-reduce-scatters are fused, the
    # all-gather-matmuls are not (the casts run between the gather and the _scaled_mm)
    def fused(rt: Runtime) -> set[str]:
        plan = _plan("tp=4", "megatron,sp", replace(rt, tp_comm_overlap=True))
        comm = communication(plan, step_compute(plan, H100), H100)
        return {f"{plan.program.ops[i].phase}:{plan.program.ops[i].name}" for i in comm.fused}

    gathers = {"forward:layers.0.attn_norm.out", "forward:layers.0.mlp_norm.out",
               "backward:grad of layers.0.resid1", "backward:grad of layers.0.resid2"}
    scatters = {"forward:layers.0.attn_out", "forward:layers.0.mlp_out"}
    assert gathers | scatters <= fused(TENSORWISE)
    rw = fused(ROWWISE)
    assert scatters <= rw and not gathers & rw
