"""An uneven pipeline's split in the search: the layers that do not divide into the stages are split
as ``spmdkit plan`` splits them (balanced by predicted time: pipeline_split.auto_counts), the same split
for every recomputation mode, so the search prices a configuration as the command plans it; before,
the search split them once under the memory cap as no recomputation holds them and priced full
recomputation (and full:K) on that split, too slow."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest

from spmdkit.cli import main
from spmdkit.planner.search import Config, config_candidates

MODEL = "llama3-8b"
OVER = {"layers": 13, "batch": 8, "seq": 4096}   # 13 layers on 4 stages: uneven
CFG = Config(2, 1, 4, "dp,zero1", microbatches=4)
CAP = "25GiB"   # under the time-balanced split's bytes without recomputation (26.8 GiB)


def _cli(recompute: str) -> dict:
    out = io.StringIO()
    with redirect_stdout(out):
        rc = main(["plan", "--model", MODEL, "--layers", "13", "--batch", "8", "--seq", "4096", "--mesh", "pp=4,dp=2",
                   "--strategy", "dp,zero1", "--microbatches", "4", "--device", "h100", "--recompute", recompute,
                   "--json"])
    assert rc == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("fold", [False, True])
def test_an_uneven_pipeline_is_priced_as_the_plan_command_plans_it(fold: bool) -> None:
    got = {c.config.recompute: c for c in config_candidates(MODEL, CFG, "h100", OVER, fold=fold, memory_cap=CAP)}
    for rc in ("none", "full"):
        cli = _cli(rc)
        c = got[rc]
        assert c.estimate.counts == tuple(cli["pipeline"]["layers_per_stage"]) == (4, 4, 4, 1)
        assert c.step_s == pytest.approx(cli["pipeline"]["step_overlap_s"], rel=1e-9)
        assert c.memory == pytest.approx(cli["memory"]["device_total"], rel=1e-9)
    # without recomputation the command's split is over the cap; full recomputation fits, and so
    # does full:1 on the same split, the fastest that fits: 0.3241 s at the share 0.870 and cuDNN's 9.1.0 level (0.3295 s at
    # the share 0.853, 0.3276 s at
    # the share 0.864, earlier 0.3503 s; 0.3442 s before the step ran at its
    # slowest GPU's pace, Device.slowdown; 0.3404 s before Megatron's optimizer
    # passes and fused wgrad accumulation; 0.2792 s before the H100's
    # sustained share; the search before this split the layers 3,4,4,2 under the cap for every mode:
    # none 0.2827 s, full 0.3374 s and no full:K, at the rates of then)
    assert not got["none"].fits and got["full"].fits
    # 0.3940350106329323 s before Megatron's optimizer-step passes and the fused wgrad accumulation,
    # 0.39783980473973163 before the slowest GPU's pace, 0.3910752744714046 before each attention
    # kernel's own shape and the sustained share 0.843, 0.38642260801013567 before the share 0.870,
    # 0.3761940952543295 before the share 0.864, 0.37841185149227824 before cuDNN's 9.1.0 level and the
    # share 0.853, 0.3805856451102968 before the share 0.870
    assert got["full"].step_s == pytest.approx(0.37425952600909, rel=1e-9)
    best = min((c for c in got.values() if c.fits), key=lambda c: c.step_s)
    assert best.config.recompute == "full:1" and best.estimate.counts == (4, 4, 4, 1)
    # 0.3403778499474716 s before them, 0.34418264405427096 before the slowest GPU's pace,
    # 0.33840593568684485 before each attention kernel's own shape and the sustained share 0.843,
    # 0.3344536419025364 before the share 0.870, 0.32571814512135105 before the share 0.864
    assert best.step_s == pytest.approx(0.32414509738430203, rel=1e-9)
