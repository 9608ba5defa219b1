"""The step floor's tail (planner/search_floor_tail.py): what each rank does after its last
backward (its optimizer, Megatron's gradient reductions after the last backward on the ranks
after the first), read from the configuration's own layers' plan: the gradients' bytes by hand,
the optimizer as the plan prices it, each rank's tail never above what the planned pipeline
does after that rank's last backward, and the floor with it never above a planned step."""

from __future__ import annotations

from typing import Any

import pytest

from spmdkit.cost.devices import load_device
from spmdkit.planner.search import Config, _floor, _model_sizes, config_candidates
from spmdkit.planner.search_config import _Job
from spmdkit.planner.search_floor import Units, busiest_rank
from spmdkit.planner.search_floor_layers import level_low
from spmdkit.planner.stage_costs import reduce_gradients

MODEL = "llama3-8b"
OVER = {"layers": 4, "batch": 8, "seq": 512}
#: llama3-8b's layer: q, k, v, o (4096 x (4096 + 2 x 1024 + 4096)), the MLP (3 x 4096 x 14336), two norms
LAYER_PARAMS = 4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336 + 2 * 4096
EMBEDDING = 128256 * 4096


def _floor_of(model: str = MODEL, over: dict[str, int] | None = None, device: str = "h100") -> Any:
    mc, sizes = _model_sizes(model, over or OVER)
    dev = load_device(device)
    job = _Job(dev, sizes.tokens, ["none", "selective", "full"], dev.memory_bytes, None, None, None, 30.0)
    floor = _floor(model, mc, job)
    assert floor is not None
    return floor


def test_a_layers_gradients_and_optimizer_by_hand() -> None:
    """ZeRO-1 on dp=4 (one reduce-scatter group): a layer's gradients are its parameters in
    bf16 (the Reducer reduces them in fp32), the embedding's and the head's (with the final
    norm) theirs; the optimizer shrinks from dp=4 to dp=8 (its states sharded over dp)."""
    floor = _floor_of()
    t = floor.tail(Config(4, 1, 2, "dp,zero1", microbatches=2))
    assert [(k[0], k[1], b) for k, _s, b in t.layer.grads] == [("reduce_scatter", (0,), 2 * LAYER_PARAMS)]
    assert [b for _k, _s, b in t.first.grads] == [2 * EMBEDDING]
    assert [b for _k, _s, b in t.last.grads] == [2 * (EMBEDDING + 4096)]
    t8 = floor.tail(Config(8, 1, 1, "dp,zero1"))
    # its passes over the states' shard halve; Megatron's zeroing of the whole gradient buffer does
    # not (spmdkit.cost.optimizer_step: 0.667 of dp=4's, where it was half before that buffer was counted)
    assert t.layer.opt > 0 and t.layer.opt / 2 < t8.layer.opt < 0.7 * t.layer.opt
    # tensor parallelism halves a layer's reduced bytes but for the replicated norms (sp's all-reduce over tp)
    tp = floor.tail(Config(2, 2, 2, "megatron,sp,zero1", microbatches=4))
    got = {k[0]: b for k, _s, b in tp.layer.grads}
    assert got == {"reduce_scatter": LAYER_PARAMS + 2 * 4096, "all_reduce": 4 * 4096}


@pytest.mark.parametrize("cfg", [Config(8, 1, 1, "dp,zero1"), Config(8, 1, 1, "dp,zero3"),
                                 Config(4, 2, 1, "megatron,sp,zero2", grad_accum=2)], ids=lambda c: c.label())
def test_without_a_pipeline_the_tail_is_the_plans_optimizer(cfg: Config) -> None:
    """Without a pipeline the optimizer's ops run after the last micro-step: the floor adds
    exactly the plan's optimizer compute (to 1e-9: the tail's slack), never more."""
    floor = _floor_of()
    got = config_candidates(MODEL, cfg, "h100", OVER)
    opt = got[0].estimate.compute_s["optimizer"]
    t = floor.tail(cfg)
    assert opt > 0 and t.optimizer(4) == pytest.approx(opt, rel=1e-8) and t.optimizer(4) <= opt
    for c in got:
        rc = c.config.recompute
        assert floor.step(cfg, rc, gathers=True) - floor.step(cfg, rc) == pytest.approx(
            opt, rel=1e-6) or "zero3" in cfg.strategy
        assert floor.step(cfg, rc, gathers=True) <= c.step_s


PIPES = [Config(4, 1, 2, "dp,zero1", microbatches=2), Config(2, 2, 2, "megatron,sp,zero1", microbatches=4, virtual=2),
         Config(2, 1, 4, "dp,zero2", microbatches=4), Config(2, 2, 2, "megatron,sp,zero3", microbatches=4)]


@pytest.mark.parametrize("cfg", PIPES, ids=lambda c: c.label())
def test_each_ranks_tail_is_under_what_it_does_after_its_last_backward(cfg: Config) -> None:
    """Rank r's tail (its layers as the plan splits them) is at most its gradient reductions'
    end after its last backward plus its optimizer (pipeline._step_times); on a rank after the
    first its reduction part is the plan's one bucket (the layers all alike: equal), except under
    Megatron-FSDP (ZeRO-2/3: the default megatron framework), whose every rank reduces in buckets
    under each microbatch's backward: its tail is the optimizer alone."""
    floor = _floor_of()
    t = floor.tail(cfg)
    p, v = cfg.pp, cfg.virtual
    for c in config_candidates(MODEL, cfg, "h100", OVER):
        e = c.estimate
        fsdp = any(s.each for s in e.stages)
        assert fsdp == ("zero2" in cfg.strategy or "zero3" in cfg.strategy) and t.single == (not fsdp)
        for r in range(p):
            mine = [e.stages[ch * p + r] for ch in range(v)]
            end = e.run.finish_s[r]
            done, _b = reduce_gradients(c.plan, [(end, *g[1:]) for s in mine for g in s.grads], end,
                                        r > 0 and not fsdp)
            n = sum(e.counts[ch * p + r] for ch in range(v))
            o = sum(s.optimizer_s for s in mine)
            tail = t.rank(r, p, n)
            assert 0 < tail <= done - end + o, (r, tail, done - end, o)
            if r > 0:  # the bucket exactly: the tail is not overcounted, nor left out
                opt = n * t.layer.opt + (t.last.opt if r == p - 1 else 0.0)
                assert tail - opt * (1 - 1e-9) == pytest.approx(0.0 if fsdp else done - end, rel=1e-6, abs=1e-15)
        assert floor.step(cfg, c.config.recompute, gathers=True) <= c.step_s


def test_the_busiest_rank_with_a_tail_by_hand() -> None:
    """Two ranks, four layers of 1 s a microbatch, two microbatches: without a tail the busiest
    rank's bound is 2 x 2 + 1 = 5 s (rank 1's two layers, then the chain before it, on rank 0).
    Rank 1's tail follows its own last backward, not the chain: a tail of 1.5 s a layer on rank
    1 alone gives 2 layers each max(4 + 3, 4 + 1) = 7 s or 3 on rank 0 (6 s; rank 1 then 2 +
    max(1.5, 1) = 3.5 s): 6 s. A tail under the chain's 1 s adds nothing; rank 0's tail (0.25 s)
    follows the chain."""
    u = Units(0.0, 0.0, 1.0)
    assert busiest_rank(u, 4, 2, 1, 2) == 5.0
    assert busiest_rank(u, 4, 2, 1, 2, lambda r, n: 1.5 * n if r else 0.0) == 6.0
    assert busiest_rank(u, 4, 2, 1, 2, lambda r, n: 0.5 if r else 0.0) == 5.0
    assert busiest_rank(u, 4, 2, 1, 2, lambda r, n: 0.0 if r else 0.25) == 5.25


def test_the_level_holders_tail_by_hand() -> None:
    """The split floor's rank holding the level ``c`` (split_levels): rank 2 (no dense layer,
    two layers before it) adds the larger of the chain before it and a middle rank's tail of
    ``c`` layers; where the first rank may hold it, the least of its tail and a later rank's."""
    def tail(moe: int, dense: int, first: bool, last: bool) -> float:
        return 0.0 if first else 0.5 * moe + 0.25 * dense + (1.0 if last else 0.0)

    shape = (4, 3, 1.0, 1.0)  # m, p, t, lam
    assert level_low(12.0, 3, 2, (), shape) == 14.0
    assert level_low(12.0, 3, 2, (), shape, tail) == 12.0 + max(2.0, 1.5)
    assert level_low(12.0, 5, 2, (), shape, tail) == 12.0 + max(2.0, 2.5)
    assert level_low(12.0, 3, 0, (), shape, tail) == 12.0  # the first rank: no reduction after it
    assert level_low(12.0, 3, -1, ((1, 2),), shape, tail) == 4 * (3 + 2) + max(1.0, 1.5 + 0.5)


@pytest.mark.parametrize("pair", [(Config(2, 2, 2, "megatron,sp,zero1", microbatches=4),
                                   Config(2, 2, 2, "megatron,sp,zero1", microbatches=2)),
                                  (Config(4, 1, 2, "dp,zero2", microbatches=2), Config(4, 1, 1, "dp,zero2"))],
                         ids=lambda p: p[0].label())
def test_the_tail_does_not_depend_on_the_batch(pair: tuple[Config, Config]) -> None:
    """The tail's figures are the parameters' (gradient bytes, optimizer updates): planned on two
    batches of a rank they are the same, which is why they are cached without it."""
    a, b = pair
    fa, fb = _floor_of(), _floor_of()
    assert fa.own_key(a) != fb.own_key(b)
    ta, tb = fa.tail(a), fb.tail(b)
    assert (ta.layer, ta.dense_layer, ta.first, ta.last) == (tb.layer, tb.dense_layer, tb.first, tb.last)


def test_megatron_fsdp_pipelines_floor_counts_each_microbatchs_reductions() -> None:
    """Megatron-FSDP (zero2 / zero3, the megatron framework) reduce-scatters every microbatch: the
    busiest rank (6 of llama3-8b's 12 layers on pp=2) queues 8 microbatches of them on its stream
    before its optimizer (Tail.stream), 0.1111 s, where the schedule's floor says 0.0396 s; never
    above a planned step (0.186 s and up); the distributed optimizer (zero1) reduces once: no such term."""
    over = {"layers": 12, "batch": 128, "seq": 128}
    floor = _floor_of(MODEL, over)
    for cfg in (Config(16, 1, 2, "dp,zero2", microbatches=8), Config(16, 1, 2, "dp,zero3", microbatches=8),
                Config(8, 2, 2, "megatron,sp,zero2", microbatches=8, virtual=2)):
        for c in config_candidates(MODEL, cfg, "h100", over):
            assert floor.step(cfg, c.config.recompute, gathers=True) <= c.step_s
    z2 = Config(16, 1, 2, "dp,zero2", microbatches=8)
    # 0.110495 / 0.116903 s before Megatron's optimizer-step passes (spmdkit.cost.optimizer_step)
    assert floor.tail(z2).stream(8, 6) == pytest.approx(0.111112, abs=1e-6)
    # and the first microbatch's forward and the backward of stage 1 before rank 0's first reduction
    # (0.117373 / 0.038626 before each attention kernel's own shape and the sustained share 0.843,
    # 0.117289 / 0.038091 before the share 0.870, 0.117181 / 0.037408 before the share 0.864,
    # 0.117205 / 0.037556 before cuDNN's 9.1.0 level and the share 0.853, 0.117248 / 0.037833 before the
    # share 0.870)
    assert floor.step(z2, "none", gathers=True) == pytest.approx(0.117181, abs=1e-6)
    assert floor.step(z2, "none") == pytest.approx(0.037408, abs=1e-6)  # without the tail
    assert floor.tail(Config(16, 1, 2, "dp,zero1", microbatches=8)).stream(8, 6) == 0.0


#: ZeRO-2/3 pipelines of several shapes: pp 2 and 4, interleaved, even and uneven splits (12
#: layers on 8 chunks), dp and megatron,sp, m from 2 to 16
FSDP_PIPELINES = [Config(16, 1, 2, "dp,zero2", microbatches=8), Config(8, 1, 4, "dp,zero2", microbatches=16),
                  Config(8, 2, 2, "megatron,sp,zero2", microbatches=8, virtual=2),
                  Config(4, 2, 4, "megatron,sp,zero3", microbatches=4, virtual=2),
                  Config(8, 1, 4, "dp,zero3", microbatches=2), Config(8, 1, 2, "dp,zero3", microbatches=16, virtual=3),
                  Config(4, 1, 4, "dp,zero2", microbatches=8, virtual=2)]


@pytest.mark.parametrize("cfg", FSDP_PIPELINES, ids=lambda c: c.label())
def test_megatron_fsdp_pipelines_floor_never_above_the_planned_step(cfg: Config) -> None:
    """StepFloor.stream (the first microbatch's forward, under an even split the backward of the
    chunks above rank 0's highest, then a rank's m microbatches' reduce-scatters and its
    optimizer) and the floor with it stay under every mode's planned step."""
    over = {"layers": 12, "batch": 128, "seq": 128}
    floor = _floor_of(MODEL, over)
    f, t = floor.of(cfg), floor.tail(cfg)
    assert floor.stream(cfg, f, t) > 0.0
    for c in config_candidates(MODEL, cfg, "h100", over):
        assert floor.stream(cfg, f, t) <= c.step_s
        assert floor.step(cfg, c.config.recompute, gathers=True) <= c.step_s


def test_the_stream_waits_for_the_first_backward() -> None:
    """dp=16 pp=2 zero2, 12 layers (6 a stage, even): rank 0's reductions start no earlier than the
    first microbatch's forward through both stages and stage 1's backward (6 layers' and the
    head's); on 12 layers over pp=2 x vp=4 (8 chunks, uneven) only the forward is counted."""
    over = {"layers": 12, "batch": 128, "seq": 128}
    floor = _floor_of(MODEL, over)
    cfg = Config(16, 1, 2, "dp,zero2", microbatches=8)
    f, t = floor.of(cfg), floor.tail(cfg)
    b = f.backward
    # 0.0030700, 0.0003792 and 0.0009151 before each attention kernel's own shape and the share 0.843,
    # 0.0030406, 0.0003734 and 0.0008953 before the share 0.870, 0.0030031, 0.0003660 and 0.0008700
    # before the share 0.864, 0.0030112, 0.0003676 and 0.0008755 before cuDNN's 9.1.0 level and the share 0.853,
    # 0.0030264, 0.0003706 and 0.0008858 before the share 0.870
    assert f.forward == pytest.approx(0.0030031, abs=1e-7) and b.layer == pytest.approx(0.0003660, abs=1e-7)
    assert b.last == pytest.approx(0.0008700, abs=1e-7)
    want = t.stream(8, 6, 6, last=False) + f.forward + 6 * b.layer + b.last
    assert floor.stream(cfg, f, t) == pytest.approx(want, rel=1e-8)
    assert floor.stream(cfg, f, t) == pytest.approx(0.117181, abs=1e-6)  # 0.116903 before the optimizer passes,
    # 0.117373 before each attention kernel's own shape and the sustained share 0.843, 0.117289 before 0.870,
    # 0.117181 before 0.864, 0.117205 before cuDNN's 9.1.0 level and 0.853, 0.117248 before 0.870
    uneven = Config(16, 1, 2, "dp,zero2", microbatches=8, virtual=4)
    assert floor.stream(uneven, floor.of(uneven), t) == pytest.approx(t.stream(8, 6, 6) + f.forward, rel=1e-8)
