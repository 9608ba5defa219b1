"""Helpers the rule-family tests share: spec and JSON builders, numeric gradients, soundness."""

from __future__ import annotations

from typing import Any

import numpy as np

from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec
from spmdkit.sim import verify_rule
from spmdkit.sim.ops import Ctx


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
