"""Layer folding (spmdkit.planner.fold): a configuration priced on two shallow copies of the
model and extrapolated equals the model planned whole (step, memory, communication, MFU,
collectives, every recomputation mode; 1e-9 relative), for dense, sp, ZeRO, pp (even and
balanced splits), cp and ep configurations; the gradient buckets that do not end where a layer
ends are replayed; the search's table is the same folded or not and its best is planned whole.
scripts/check_fold.py checks more configurations at full size."""

from __future__ import annotations

import pytest

from spmdkit.planner.fold import Fold, fold_of, full_layer_costs
from spmdkit.planner.fold_stages import copy_layers, stage_copy
from spmdkit.planner.search import Config, config_candidates, search_meshes
from spmdkit.program.layers import layer_tags
from spmdkit.program.runtime import Runtime

FIELDS = ("step_s", "memory", "comm_s", "mfu", "collectives")


def _same(model: str, over: dict[str, int], cfg: Config, runtime: Runtime | None = None) -> int:
    folded = config_candidates(model, cfg, overrides=over, fold=True, runtime=runtime)
    whole = config_candidates(model, cfg, overrides=over, fold=False, runtime=runtime)
    assert [c.config for c in folded] == [c.config for c in whole]
    for f, w in zip(folded, whole):
        for k in FIELDS:
            assert getattr(f, k) == pytest.approx(getattr(w, k), rel=1e-9, abs=0), (cfg.label(), f.config.recompute, k)
        assert w.folded == 0
    return folded[0].folded


def test_fold_of_keeps_the_stages_and_the_dense_layers() -> None:
    assert fold_of((32,)) == Fold((2,), (3,), 30)
    assert fold_of((7, 8, 8, 7)) == Fold((2, 3, 3, 2), (3, 4, 4, 3), 5)
    assert fold_of((27,), dense=3) == Fold((4,), (5,), 23)   # the 3 dense layers kept, one MoE layer repeated
    assert fold_of((3, 3)) is None                           # nothing to save
    assert fold_of((2, 30), dense=3) is None                 # dense layers past the first stage
    assert Fold((2,), (3,), 30).at(1.0, 1.5) == 16.0
    assert full_layer_costs([5.0, 1.0, 2.0, 3.0], 6, dense=0) == [5.0, 1.0, 1.0, 1.0, 2.0, 3.0]


def test_dense_zero_sp_configurations_fold_exactly() -> None:
    over = {"batch": 8, "layers": 10, "seq": 1024}
    assert _same("llama3-8b", over, Config(8, 1, 1, "dp,zero1")) == 3
    assert _same("llama3-8b", over, Config(8, 1, 1, "dp,zero2"), Runtime(framework="torchtitan")) == 3
    # ZeRO-3 / FSDP2: the parameter prefetch shares the buckets' stream: planned whole
    assert _same("llama3-8b", over, Config(2, 4, 1, "megatron,sp,zero3")) == 0
    assert _same("llama3-8b", over, Config(8, 1, 1, "dp,zero3"), Runtime(framework="torchtitan")) == 0


def test_zero3_whose_stream_queue_grows_with_depth_is_planned_whole() -> None:
    """llama3-405b on 16,384 devices, dp=2048 x tp=8 megatron,sp,zero3: its gathers and
    reductions over 2,048 ranks outrun a layer's backward, so their queue grows with the depth;
    two shallow copies do not show it (folded it was 8.48 s, whole 11.72 s: the search listed the
    folded figure and planned its best again whole at 12.31 s)."""
    assert _same("llama3-405b", {"batch": 2048, "seq": 8192}, Config(2048, 8, 1, "megatron,sp,zero3")) == 0


def test_pipelines_fold_exactly_even_and_balanced() -> None:
    over = {"batch": 8, "layers": 12, "seq": 1024}
    assert _same("llama3-8b", over, Config(2, 2, 2, "megatron,sp,zero1", microbatches=4)) == 6  # 6 + 6 -> 3 + 3
    # 21 layers balanced by time as 12, 9 (the 128k-word head is heavy at seq 1024): copies 5 + 2 and 6 + 3
    assert _same("llama3-8b", {**over, "layers": 21}, Config(4, 1, 2, "dp,zero1", microbatches=2)) == 9
    whole = config_candidates("llama3-8b", Config(4, 1, 2, "dp,zero1", microbatches=2),
                              overrides={**over, "layers": 21}, fold=False)
    assert whole[0].estimate.counts == (12, 9)


def test_a_tied_embedding_pipeline_folds_exactly() -> None:
    """GPT-3's word embedding is its LM head: a copy on the first and the last stage whose
    gradients are all-reduced after the data-parallel reductions (planner.pipeline's tied_s);
    the two copies' step counts it as the whole model's does (it was refused, and planned on
    far deeper copies)."""
    over = {"batch": 16, "layers": 12, "seq": 1024}
    assert _same("gpt3-175b", over, Config(2, 4, 2, "megatron,sp,zero1", microbatches=8)) == 6  # 6 + 6 -> 3 + 3


def test_cp_configuration_folds_exactly() -> None:
    assert _same("llama3-8b", {"batch": 4, "layers": 10, "seq": 4096}, Config(2, 2, 1, "megatron,sp,cp", cp=2)) == 3


def test_moe_buckets_are_replayed() -> None:
    """Mixtral under megatron,sp,ep: Megatron's 40M-parameter buckets fall every other layer,
    so the buckets' count and time are not affine in the layers (the replay makes them exact),
    and DeepSeek-V2-Lite's dense first layer stays in the first stage of a balanced split."""
    assert _same("mixtral-8x7b", {"batch": 8, "layers": 8, "seq": 1024}, Config(1, 2, 1, "megatron,sp,ep", ep=4)) == 3
    assert _same("deepseek-v2-lite", {"batch": 8, "seq": 1024},
                 Config(2, 1, 2, "dp,ep,zero1", microbatches=2, ep=2)) > 0


def test_search_is_the_same_folded_and_its_best_is_planned_whole() -> None:
    over = {"batch": 8, "layers": 9, "seq": 1024}
    folded = search_meshes("llama3-8b", 8, "h100", overrides=over, strategies=["dp,zero1", "megatron,sp,zero1"])
    whole = search_meshes("llama3-8b", 8, "h100", overrides=over, strategies=["dp,zero1", "megatron,sp,zero1"],
                          fold=False)
    assert [c.config for c in folded.candidates] == [c.config for c in whole.candidates]
    for f, w in zip(folded.candidates, whole.candidates):
        assert f.step_s == pytest.approx(w.step_s, rel=1e-9) and f.memory == pytest.approx(w.memory, rel=1e-9)
    assert any(c.folded for c in folded.candidates[1:])
    best = folded.best
    assert best is not None and best.folded == 0 and len(layer_tags(best.plan.program)) == 9


@pytest.mark.parametrize(("model", "over"), [("llama3-8b", {"batch": 8, "layers": 12, "seq": 1024}),
                                              ("deepseek-v2-lite", {"batch": 8, "layers": 9, "seq": 1024})])
def test_search_bounds_fold_exactly(model: str, over: dict[str, int]) -> None:
    """The bounds that prune a large search (search_bounds), read off two shallow copies: every
    layer's parameters and states and the step's FLOPs as the whole model's."""
    from dataclasses import replace

    from spmdkit.cost.devices import load_device
    from spmdkit.planner.search import _bounds, _model_sizes
    from spmdkit.planner.search_config import RECOMPUTE_MODES, _Job

    mc, sizes = _model_sizes(model, over)
    dev = load_device("h100")
    job = _Job(dev, sizes.tokens, RECOMPUTE_MODES, dev.memory_bytes, None, None, None, 30.0)
    folded, whole = _bounds(model, mc, job), _bounds(model, mc, replace(job, fold=False))
    assert folded.layers == whole.layers and len(folded.layers) == over["layers"]
    assert folded.flops == pytest.approx(whole.flops, rel=1e-12)
    assert (folded.outside, folded.peak, folded.token_bytes, folded.batch) == \
           (whole.outside, whole.peak, whole.token_bytes, whole.batch)


def test_stage_copy_keeps_one_middle_stage_of_each_count() -> None:
    """Llama 3 405B's 126 layers on 16 stages, 7, 8 x 14, 7: a copy of 7, 8, 7 (22 layers)."""
    copy, where = stage_copy((7,) + (8,) * 14 + (7,))
    assert copy == (7, 8, 7) and where == (0,) + (1,) * 14 + (2,)
    assert stage_copy((3, 4, 4, 3, 4, 3)) == ((3, 4, 3, 3), (0, 1, 1, 2, 1, 3))
    assert stage_copy((4, 4, 4)) is None          # no middle stage repeats: nothing saved
    assert stage_copy((2, 3, 3, 3), dense=3) is None  # its stages up to the first MoE layer kept: none left to repeat
    assert copy_layers((8,) * 16) == 24


@pytest.mark.parametrize(("over", "cfg", "layers"), [
    ({"layers": 24}, Config(1, 1, 8, "dp", microbatches=8), 9),                              # 3 x 8 -> 3, 3, 3
    ({"layers": 22}, Config(2, 1, 8, "dp,zero1", microbatches=4), 7),                         # uneven: 3 x 7, 1 -> 3, 3, 1
    ({"layers": 16}, Config(1, 2, 4, "megatron,sp", microbatches=8, virtual=2), 6),           # interleaved: 8 x 2
    ({"layers": 24}, Config(2, 1, 8, "dp,zero3", microbatches=4), 9),                         # FSDP's prefetch: bucket_sync
])
def test_deep_pipelines_fold_by_stage_exactly(over: dict[str, int], cfg: Config, layers: int) -> None:
    """A pipeline whose stages are too shallow for the two-copy fold is priced on a copy with its
    first stage, one middle stage of each layer count and its last (planner.fold_stages): the same
    step, memory, communication, MFU and collectives as the pipeline planned whole, every mode."""
    over = {"batch": 8, "seq": 512, **over}
    assert _same("llama3-8b", over, cfg) == layers
    folded = config_candidates("llama3-8b", cfg, overrides=over)
    whole = config_candidates("llama3-8b", cfg, overrides=over, fold=False)
    assert [c.estimate.counts for c in folded] == [c.estimate.counts for c in whole]  # type: ignore[union-attr]


#: a DeepSeek-style MoE: 3 dense layers first, then MoE layers (experts over ep); without the
#: auxiliary loss, whose sum over every MoE layer's term the last stage computes (a copy's stage
#: sums fewer: the fold is 5e-6 off with it, as it was with one dense layer)
DENSE3 = ('{"base": "tiny-llama", "name": "moe3", "layers": 32, "hidden": 256, "heads": 4, "kv_heads": 4, "ffn": 512, '
          '"vocab": 512, "seq": 64, "batch": 8, "dtype": "bfloat16", "experts": 4, "top_k": 2, "moe_ffn": 256, '
          '"shared_experts": 1, "dense_layers": 3, "aux_loss": false}')


def test_stage_copy_keeps_the_stages_of_the_dense_layers() -> None:
    """DeepSeek-V3's 61 layers (3 dense) on 32 stages of 1-2 layers: the dense layers span two
    stages, both kept, as is the stage with the first MoE layer; one middle stage of each count."""
    counts = (2,) * 29 + (1,) * 3
    copy, where = stage_copy(counts, dense=3)
    assert copy == (2, 2, 2, 1, 1) and where == (0, 1) + (2,) * 27 + (3, 3, 4)
    assert stage_copy((3,) * 8, dense=3) == ((3, 3, 3, 3), (0, 1, 2, 2, 2, 2, 2, 3))  # stage 1: the first MoE layer
    assert stage_copy((4,) * 8, dense=3) == ((4, 4, 4), (0,) + (1,) * 6 + (2,))       # stage 0 holds it
    assert stage_copy((2, 2, 2, 2), dense=3) is None  # the kept stages reach the last


@pytest.mark.parametrize(("cfg", "layers"), [
    (Config(1, 1, 16, "dp,ep", microbatches=16, ep=2), 8),                      # 2 x 16: 2, 2 | 2, 2
    (Config(2, 1, 8, "dp,ep,zero1", microbatches=8, ep=2, virtual=2), 8),       # 16 virtual stages of 2
])
def test_moe_deep_pipelines_whose_dense_layers_span_stages_fold_exactly(cfg: Config, layers: int) -> None:
    """The dense layers over the first two stages (DeepSeek-V3 on pp=32): folded by stage, the
    same step, memory, communication, MFU and collectives as planned whole, every mode."""
    assert _same(DENSE3, {"batch": 32, "layers": 32}, cfg) == layers


@pytest.mark.parametrize(("over", "cfg", "layers", "step"), [
    ({"batch": 128, "layers": 12}, Config(16, 1, 2, "dp,zero2", microbatches=8), 6, 0.186263),  # two copies
    ({"batch": 32, "layers": 24}, Config(8, 1, 8, "dp,zero2", microbatches=4), 9, 0.071209),     # by stage
])
def test_megatron_fsdp_pipelines_fold_exactly(over: dict[str, int], cfg: Config, layers: int, step: float) -> None:
    """Megatron-FSDP's ZeRO-2 reduce-scatters in every microbatch's backward (StageCost.each),
    replayed on each rank of the folded pipeline (fold._pipeline_overlap) as on the pipeline
    planned whole (pipeline._step_times): the same figures, every mode. Both bound by the
    reductions (seq 128, dp 16 / 8: 0.0768 and 0.0456 s reduced once). The steps were 0.185710 and
    0.071011 s before Megatron's optimizer-step passes (spmdkit.cost.optimizer_step), 0.186458 and
    0.071722 before the step ran at its slowest GPU's pace (32 and 64 GPUs: Device.slowdown), 0.186426
    and 0.071664 before each attention kernel's own shape and the sustained share 0.843, 0.186354 and
    0.071464 before the share 0.870, 0.186263 and 0.071209 before the share 0.864, 0.186283 and 0.071264
    before cuDNN's 9.1.0 level and the share 0.853, 0.186320 and 0.071368 before the share 0.870."""
    over = {"seq": 128, **over}
    assert _same("llama3-8b", over, cfg) == layers
    assert config_candidates("llama3-8b", cfg, overrides=over)[0].step_s == pytest.approx(step, abs=1e-6)
