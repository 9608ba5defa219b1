"""spmdkit.core.reshard: plans checked by executing their steps on simulated ranks, byte and time
formulas, errors."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from spmdkit.core.dist_attr import TensorDistAttr, entry_dims
from spmdkit.core.errors import InvalidAttributeError, InvalidMeshError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel, LinkCost, plan_reshard
from spmdkit.sim.mesh import assemble, shard


def _groups(mesh: ProcessMesh, d: int) -> list[list[int]]:
    out: dict[tuple[int, ...], list[int]] = {}
    for r in range(mesh.size):
        c = mesh.coords(r)
        out.setdefault(tuple(x for i, x in enumerate(c) if i != d), []).append(r)
    return [sorted(g, key=lambda r: mesh.coords(r)[d]) for g in out.values()]


def _execute(step: Any, local: list[np.ndarray]) -> list[np.ndarray]:
    """One step on every rank's local array, as the collective does it."""
    mesh = step.src.mesh
    (d,) = step.mesh_dims
    out = list(local)
    for g in _groups(mesh, d):
        pieces = [local[r] for r in g]
        n = len(g)
        if step.kind == "all_reduce":
            red = np.max(pieces, axis=0) if step.reduce_type == "max" else np.sum(pieces, axis=0)
            for r in g:
                out[r] = red
        elif step.kind == "reduce_scatter":
            red = np.sum(pieces, axis=0)
            for i, r in enumerate(g):
                out[r] = np.array_split(red, n, axis=step.tensor_axis)[i]
        elif step.kind == "all_gather":
            full = np.concatenate(pieces, axis=step.tensor_axis)
            for r in g:
                out[r] = full
        elif step.kind == "all_to_all":
            full = np.concatenate(pieces, axis=step.tensor_axis)
            for i, r in enumerate(g):
                out[r] = np.array_split(full, n, axis=step.dst_axis)[i]
        elif step.kind == "slice":
            for i, r in enumerate(g):
                out[r] = np.array_split(local[r], n, axis=step.tensor_axis)[i]
        elif step.kind == "to_partial":
            for i, r in enumerate(g):
                out[r] = local[r] if i == 0 else np.zeros_like(local[r])
        else:  # pragma: no cover
            raise AssertionError(step.kind)
    return out


def _rand_attr(r: random.Random, mesh: ProcessMesh, ndim: int) -> TensorDistAttr:
    dm: list[Any] = [-1] * ndim
    partial: list[int] = []
    for d in range(mesh.ndim):
        u = r.random()
        if u < 0.5:
            i = r.randrange(ndim)
            dm[i] = d if dm[i] == -1 else (*entry_dims(dm[i]), d)
        elif u < 0.7:
            partial.append(d)
    return TensorDistAttr(mesh, dm, partial)


@pytest.mark.parametrize("mesh_shape", [[4], [2, 2], [2, 3], [2, 2, 2]])
def test_plans_turn_src_shards_into_dst_shards(mesh_shape: list[int]) -> None:
    r = random.Random(str(mesh_shape))
    mesh = ProcessMesh(mesh_shape)
    rng = np.random.default_rng(0)
    for _ in range(150):
        ndim = r.randint(1, 3)
        shape = [r.choice([24, 48]) for _ in range(ndim)]  # divisible by every co-shard (nested = flat chunks)
        src, dst = _rand_attr(r, mesh, ndim), _rand_attr(r, mesh, ndim)
        g = rng.standard_normal(shape)
        local = shard(g, src, rng)
        plan = plan_reshard(src, dst, shape, 8)
        cur = src
        for s in plan.steps:
            assert s.src == cur
            TensorDistAttr(s.dst.mesh, s.dst.dims_mapping, dict(s.dst.partial))  # every step is legal
            local = _execute(s, local)
            cur = s.dst
        assert cur == dst
        np.testing.assert_allclose(assemble(local, dst, shape), g, rtol=1e-12, atol=1e-12, equal_nan=False)


def test_plan_kinds_and_bytes() -> None:
    mesh = ProcessMesh([2, 4], dim_names=["dp", "tp"])
    shape = [8, 1024, 4096]
    full = 8 * 1024 * 4096 * 4
    tp = 1
    p = plan_reshard(TensorDistAttr(mesh, [-1, -1, -1], [tp]), TensorDistAttr(mesh, [-1, -1, -1]), shape)
    (s,) = p.steps
    assert s.kind == "all_reduce" and s.bytes_per_rank == 2 * 3 * full // 4  # 2(n-1)/n S: 192 MiB
    p = plan_reshard(TensorDistAttr(mesh, [0, -1, -1], [tp]), TensorDistAttr(mesh, [0, tp, -1]), shape)
    (s,) = p.steps
    assert s.kind == "reduce_scatter" and s.tensor_axis == 1 and s.bytes_per_rank == 3 * (full // 2) // 4
    p = plan_reshard(TensorDistAttr(mesh, [0, tp, -1]), TensorDistAttr(mesh, [0, -1, -1]), shape)
    (s,) = p.steps
    assert s.kind == "all_gather" and s.bytes_per_rank == 3 * (full // 2) // 4
    p = plan_reshard(TensorDistAttr(mesh, [0, tp, -1]), TensorDistAttr(mesh, [0, -1, tp]), shape)
    (s,) = p.steps
    assert s.kind == "all_to_all" and (s.tensor_axis, s.dst_axis) == (1, 2)
    p = plan_reshard(TensorDistAttr(mesh, [-1, -1, -1]), TensorDistAttr(mesh, [0, tp, -1]), shape)
    assert [s.kind for s in p.steps] == ["slice", "slice"] and p.bytes_per_rank == 0
    assert plan_reshard(TensorDistAttr(mesh, [0, -1, -1]), TensorDistAttr(mesh, [0, -1, -1]), shape).steps == ()
    # a co-shard is unwound minor dim first
    p = plan_reshard(TensorDistAttr(mesh, [(0, 1), -1, -1]), TensorDistAttr(mesh, [-1, -1, -1]), shape)
    assert [s.mesh_dims for s in p.steps] == [(1,), (0,)]


def test_alpha_beta_time() -> None:
    mesh = ProcessMesh([4], dim_names=["tp"])
    cost = CostModel((LinkCost(1e-5, 1e-9),))
    p = plan_reshard(TensorDistAttr(mesh, [-1], [0]), TensorDistAttr(mesh, [-1]), [1000], 4, cost)
    (s,) = p.steps
    assert s.bytes_per_rank == 2 * 3 * 4000 // 4
    assert s.time_s == pytest.approx(2 * 3 * 1e-5 + 6000 * 1e-9)
    assert "all-reduce" in s.describe() and "tp (4 ranks)" in s.describe()


def test_cost_model_defaults_and_parse() -> None:
    mesh = ProcessMesh([4, 8], dim_names=["dp", "tp"])
    c = CostModel.default(mesh)
    assert c.links[1] == LinkCost(5e-6, 1 / 150e9)  # 8 ranks: one node
    assert c.links[0] == LinkCost(20e-6, 1 / 25e9)  # across nodes
    c = CostModel.parse("tp=2us/300GB", mesh)
    assert c.links[1] == LinkCost(2e-6, 1 / 300e9) and c.links[0] == LinkCost(20e-6, 1 / 25e9)
    with pytest.raises(InvalidAttributeError, match="DIM=LATENCY/BANDWIDTH"):
        CostModel.parse("tp=fast", mesh)
    with pytest.raises(InvalidMeshError, match="no dim named 'pp'"):
        CostModel.parse("pp=2us/300GB", mesh)


def test_reshard_errors() -> None:
    a = TensorDistAttr(ProcessMesh([2]), [0])
    b = TensorDistAttr(ProcessMesh([4]), [0])
    with pytest.raises(InvalidMeshError, match="src lies on mesh"):
        plan_reshard(a, b, [8])
    with pytest.raises(InvalidAttributeError, match="for shape"):
        plan_reshard(a, a, [8, 2])
