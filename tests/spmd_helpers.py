"""Helpers the rule-family tests share: spec and JSON builders, numeric gradients, soundness."""

from __future__ import annotations

from typing import Any

import numpy as np

from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec
from spmdkit.sim import verify_rule
from spmdkit.sim.reference import Ctx


def T(mesh: ProcessMesh, shape: list[int], dm: list[Any], partial: Any = None) -> DistTensorSpec:
    """A DistTensorSpec on ``mesh``."""
    return DistTensorSpec(shape, mesh=mesh, dims_mapping=dm, partial=partial)


def dms(attrs: Any) -> list[Any]:
    """The dims_mappings of a result's inputs or outputs (None stays None)."""
    return [None if a is None else a.dims_mapping for a in attrs]


def J(shape: list[int], dm: list[Any], partial: Any = None) -> dict[str, Any]:
    """A tensor argument in the INTERFACE JSON form."""
    d: dict[str, Any] = {"shape": shape, "dims_mapping": dm}
    if partial is not None:
        d["partial"] = partial
    return d


def R(dm: list[Any], partial: Any = None) -> dict[str, Any]:
    """An expected dist attr in the INTERFACE JSON form."""
    return {"dims_mapping": dm, "partial": partial or {}}


def rand_dims_mapping(r: Any, nd: int, mesh: ProcessMesh, p_shard: float, p_coshard: float = 0.3) -> list[Any]:
    """A random legal dims_mapping: each mesh dim shards a random axis with probability
    ``p_shard``, joining an already sharded axis as a co-shard with probability ``p_coshard``."""
    dm: list[Any] = [-1] * nd
    for d in range(mesh.ndim):
        if r.random() < p_shard:
            i = r.randrange(nd)
            if dm[i] == -1:
                dm[i] = d
            elif r.random() < p_coshard:
                dm[i] = (*((dm[i],) if isinstance(dm[i], int) else dm[i]), d)
    return dm


def answer_or_error(f: Any, args: Any) -> Any:
    """``f(*args)``, or the SpmdError's class name and message."""
    from spmdkit.core.errors import SpmdError

    try:
        return f(*args)
    except SpmdError as e:
        return (type(e).__name__, str(e))


def numeric_grad(fwd: Any, x: np.ndarray, g: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """d(sum(fwd(x) * g)) / dx by central differences."""
    out = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += h
        xm[i] -= h
        out[i] = (np.sum(fwd(xp) * g) - np.sum(fwd(xm) * g)) / (2 * h)
    return out


def global_ctx() -> Ctx:
    """The context of a global (unsharded) reference run."""
    return Ctx(ProcessMesh([1]))


def assert_sound(name: str, cases: int, seed: int, mode: str = "forward") -> None:
    """Every generated case of the rule and mode is answered soundly (none skipped)."""
    rep = verify_rule(name, cases, seed=seed, mode=mode)
    assert rep.cases == cases and rep.unsound == 0 and rep.skipped == 0, rep.first_unsound or rep.first_skipped


def soundness_tests(rules: list[str], grads: list[str], cases: int, seed: int) -> tuple[Any, Any]:
    """``test_sound`` (every rule, both modes) and ``test_grad_sound`` (every grad rule) for a
    family's test module: ``test_sound, test_grad_sound = soundness_tests(RULES, GRADS, 200, 7)``."""
    import pytest

    @pytest.mark.parametrize("name", rules)
    @pytest.mark.parametrize("mode", ["forward", "backward"])
    def test_sound(name: str, mode: str) -> None:
        assert_sound(name, cases, seed, mode)

    @pytest.mark.parametrize("name", grads)
    def test_grad_sound(name: str) -> None:
        assert_sound(name, cases, seed, "forward")

    return test_sound, test_grad_sound


def assert_0d_is_absent(rule: str, mode: str, seed: int, slots: list[str], n: int = 12,
                        sim_reads_0d: bool = True) -> int:
    """A 0-D tensor (shape ``[]``) in each optional slot of ``slots`` is read as absent: on ``n``
    generated cases, the answer equals the answer with None there, except that the slot's own
    answer is a replicated 0-D dist attr (``[]``) where None's is null; and the simulator judges
    it sound (the 0-D case itself where its reference reads a 0-D optional as absent,
    ``sim_reads_0d``; else the None case, whose answer it equals). Returns how many (case, slot) pairs were checked (>0 asserted)."""
    import json

    from spmdkit.io.codec import answer_line
    from spmdkit.ops import get_rule
    from spmdkit.sim import SOUND, verify
    from spmdkit.sim.cases import generate_case

    params = [p.name for p in get_rule(rule).mode(mode).params]
    checked = 0
    for i in range(n):
        case = generate_case(rule, mode, seed, i)
        assert case is not None, f"no generator for {rule} {mode}"
        for name in slots:
            pos = params.index(name)
            none_case = json.loads(json.dumps(case))
            none_case["args"][pos] = None
            want = answer_line(json.dumps(none_case))
            if "error" in want:
                continue
            zero_case = json.loads(json.dumps(case))
            zero_case["args"][pos] = {"shape": [], "dims_mapping": []}
            got = answer_line(json.dumps(zero_case))
            assert "error" not in got, (name, got)
            for side in ("inputs", "outputs"):
                assert len(got[side]) == len(want[side])
                for g, w in zip(got[side], want[side]):
                    assert g == w or (w is None and g == {"dims_mapping": [], "partial": {}}), (name, side, g, w)
            assert got != want  # the 0-D slot itself is answered
            v = verify(None, zero_case if sim_reads_0d else none_case)
            assert v.status == SOUND, v.describe()
            checked += 1
    assert checked > 0
    return checked
