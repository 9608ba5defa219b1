"""The search's floors planned ahead in a forked process (planner/search_ahead.py): the same
search as without it (rows, what is pruned and why, the strategies' notes), its bounds taken
from the worker."""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest

from spmdkit.planner import search as search_mod
from spmdkit.planner import search_ahead
from spmdkit.planner.search import search_meshes

#: a MoE with a dense first layer and 2 kv heads (tp=4 and 8 split each over ranks: a note) on 8
#: devices: 200+ configurations, ZeRO-3 among them (their gathers' floors)
MOE_KV = json.dumps({"base": "tiny-llama", "name": "moe-kv", "layers": 6, "dense_layers": 1, "hidden": 256,
                     "heads": 4, "kv_heads": 2, "ffn": 512, "vocab": 512, "seq": 512, "batch": 16,
                     "dtype": "bfloat16", "experts": 4, "top_k": 2, "moe_ffn": 4096})


@pytest.fixture()
def helpers(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Each search's worker (search_ahead.Ahead) as it is closed; the floors lazy (EAGER_FLOORS
    0), as at 2,048 devices."""
    monkeypatch.setattr(search_mod, "EAGER_FLOORS", 0)
    made: list[Any] = []
    real = search_ahead.Ahead.close

    def close(self: Any) -> None:
        made.append(self)
        real(self)

    monkeypatch.setattr(search_ahead.Ahead, "close", close)
    return made


def _search(workers: int | None) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        res = search_meshes(MOE_KV, 8, "h100", memory_cap="1.56GB", prune=True, workers=workers)
    return res, sorted({str(w.message) for w in said})


def test_floors_planned_ahead_give_the_same_search(helpers: list[Any]) -> None:
    alone, notes_alone = _search(0)
    assert not helpers
    ahead, notes_ahead = _search(1)
    assert len(helpers) == 1
    h = helpers[0]
    assert h.taken > 0 and h.gathered > 0  # bounds came from the worker, some with their ZeRO-3 gathers
    assert [c.to_json() for c in ahead.candidates] == [c.to_json() for c in alone.candidates]
    assert ahead.pruned == alone.pruned and ahead.plans == alone.plans and ahead.refused == alone.refused
    assert alone.pruned and any("kv heads" in n for n in notes_alone)
    assert notes_ahead == notes_alone
    assert not h.proc.is_alive()


def test_a_worker_where_there_are_two_cores_only(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[Any] = []
    monkeypatch.setattr(search_ahead, "Ahead", lambda *a: started.append(a) or a)
    for n, workers, want in ((1, None, 0), (2, None, 1), (2, 0, 0), (1, 1, 1)):
        monkeypatch.setattr(search_ahead, "cores", lambda n=n: n)
        r = search_ahead.Refiner(object(), True, lambda c: 0.0)  # type: ignore[arg-type]
        r.start([], workers)
        assert (r.ahead is not None) == bool(want), (n, workers)


def test_the_workers_notes_are_raised_where_the_search_takes_its_bound() -> None:
    """A bound the worker computed: its value, the layer floors it planned for it (into the
    search's cache), its notes raised when the search takes it (not when the worker made them),
    its bound from its own plans (ZeRO-3's gathers, the tail) where the first is under the best
    (the fake floor's own plans: "z" only); one not in its order left to the
    search."""
    import time
    from types import SimpleNamespace

    floor = SimpleNamespace(cache={}, plans=0, own_key=lambda c: c if c.startswith("z") else None)

    def bound(cfg: str, gathers: bool = False) -> float:
        if cfg not in floor.cache:
            floor.cache[cfg] = search_ahead.NO_FLOOR if cfg == "b" else cfg.upper()
            floor.plans += 1
        warnings.warn(f"--note {cfg} {gathers}", UserWarning, stacklevel=1)
        return {"a": 1.0, "b": 2.0, "z": 3.0}[cfg] + (10.0 if gathers else 0.0)

    got = search_ahead.Ahead(floor, ["a", "b", "z"], bound)  # type: ignore[arg-type]
    try:
        end = time.monotonic() + 60
        while list(got.state) != [2, 2, 2] and time.monotonic() < end:  # every one claimed by the worker
            time.sleep(0.01)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            assert got.take("a", 5.0) == (1.0, None)
            assert [str(w.message) for w in said] == ["--note a False"]
            assert got.take("z", 5.0) == (3.0, 13.0)  # under the best: its gathers' bound too
            assert [str(w.message) for w in said][1:] == ["--note z False", "--note z True"]
        assert floor.cache["a"] == "A" and floor.cache["z"] == "Z" and floor.plans == 3
        assert floor.cache["b"] is search_ahead.NO_FLOOR  # sent as None, the search's own object again
        assert got.taken == 2 and got.gathered == 1
        assert got.take("c", 5.0) is None  # not in its order
    finally:
        got.close()
    assert not got.proc.is_alive()


def test_the_worker_stops_when_the_search_is_interrupted(helpers: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or a refusal) in the middle of the planning loop: the worker is stopped there, not
    left computing bounds for a search that has ended (the CLI prints one line for Ctrl-C)."""
    def interrupted(*args: Any, **kw: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(search_mod, "_plan_preset_config", interrupted)
    monkeypatch.setattr(search_mod, "_plan_program_config", interrupted)
    with pytest.raises(KeyboardInterrupt):
        search_meshes(MOE_KV, 8, "h100", memory_cap="1.56GB", prune=True, workers=1)
    assert len(helpers) == 1 and not helpers[0].proc.is_alive()


def test_least_refined_takes_the_least_refined_bounds_refining_only_those_that_come_first() -> None:
    """search._seeds' pick: best first on the bounds so far, each refined when it comes first and
    taken when it comes first refined (a ZeRO-2 twin whose reduce-scatters in every microbatch
    lift its bound from 1.0 to 5.0 gives way to the ZeRO-1 configurations of bounds 2.0 and 3.0);
    ties in the order given; a configuration never reached is not refined."""
    from spmdkit.planner.search_space import Config

    a, b, c, d = (Config(8, 1, 2, s, microbatches=4, ep=2) for s in ("dp,ep,zero2", "dp,ep,zero1", "dp,ep", "dp"))
    lows = {a: 1.0, b: 2.0, c: 3.0, d: 3.0}
    refined = {a: 5.0, b: 2.5, c: 3.0, d: 1.0}  # (a refinement below the bound so far keeps it)
    asked: list[Config] = []

    def refine(cfg: Config) -> float:
        asked.append(cfg)
        return refined[cfg]

    got = search_ahead.least_refined([a, b, c, d], lows, refine, 2)
    assert got == [b, c] and asked == [a, b, c]
    assert lows == {a: 5.0, b: 2.5, c: 3.0, d: 3.0}
    assert search_ahead.least_refined([a, b, c, d], dict(lows), lambda cfg: lows[cfg], 4) == [b, c, d, a]
