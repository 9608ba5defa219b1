"""Rotary embeddings by position_ids on a split sequence (``local_positions``, spmdkit's option of
``fused_rotary_position_embedding``; docs/deviations.md rope-local-positions): each rank rotates
its share of the tokens by the position ids it holds (any order: context parallelism's zig-zag
too), the sin / cos tables whole. Paddle's answer (the default) replicates the sequence."""

from __future__ import annotations

import collections
from typing import Any

import pytest

from spmd_helpers import T, dms
from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import SpmdResult
from spmdkit.engine.registry import get_rule
from spmdkit.planner.propagate import propagate
from spmdkit.program.autodiff import Tape
from spmdkit.program.ir import Program, ProgramBuilder
from spmdkit.sim import verify, verify_rule
from spmdkit.sim.plan import simulate_plan

M = ProcessMesh([2], dim_names=["cp"])
ROPE = get_rule("fused_rotary_position_embedding")


def _args(local: bool) -> tuple[Any, ...]:
    q, table, ids = T(M, [2, 8, 4, 4], [-1, 0, -1, -1]), T(M, [1, 16, 1, 4], [-1, -1, -1, -1]), T(M, [2, 8], [-1, 0])
    return q, None, None, table, table, ids, True, False, 10000.0, local


def test_local_positions_keep_the_sequence_split_paddles_answer_unchanged() -> None:
    paddle = ROPE.infer_forward(*_args(False))
    assert dms(paddle.inputs) == [(-1, -1, -1, -1), None, None, (-1, -1, -1, -1), (-1, -1, -1, -1), (-1, -1)]
    local = ROPE.infer_forward(*_args(True))
    assert dms(local.inputs) == [(-1, 0, -1, -1), None, None, (-1, -1, -1, -1), (-1, -1, -1, -1), (-1, 0)]
    assert dms(local.outputs) == [(-1, 0, -1, -1), None, None]
    grad = get_rule("fused_rotary_position_embedding_grad")
    q, _, _, table, _, ids, *attrs = _args(True)
    assert dms(grad.infer_forward(table, table, ids, q, None, None, *attrs).outputs) == [(-1, 0, -1, -1), None, None]


@pytest.mark.parametrize("rule", ["fused_rotary_position_embedding", "fused_rotary_position_embedding_grad"])
def test_generated_cases_with_local_positions_are_sound(rule: str) -> None:
    rep = verify_rule(rule, n=200, seed=7)
    assert rep.cases == 200 and rep.sound == 200, rep.first_unsound


def _a(dm: list[int]) -> TensorDistAttr:
    return TensorDistAttr(ProcessMesh([2]), dm)


def test_a_table_split_with_the_sequence_is_caught() -> None:
    """The ids index the whole table: splitting the table's rows with the tokens (as the sin /
    cos-rows form does) is unsound here."""
    seq, whole = {"dims_mapping": [-1, 0, -1, -1]}, {"dims_mapping": [-1, -1, -1, -1]}
    case = {"rule": "fused_rotary_position_embedding", "mesh": [2], "mode": "forward",
            "args": [{"shape": [1, 8, 2, 4], **seq}, None, None, {"shape": [1, 8, 1, 4], **whole},
                     {"shape": [1, 8, 1, 4], **whole}, {"shape": [1, 8], "dims_mapping": [-1, 0]}, True, False,
                     10000.0, True]}
    assert verify(None, case).status == "sound"
    wrong = SpmdResult([_a([-1, 0, -1, -1]), None, None, _a([-1, 0, -1, -1]), _a([-1, 0, -1, -1]), _a([-1, 0])],
                       [_a([-1, 0, -1, -1]), None, None])
    assert verify(None, case, result=wrong).status == "unsound"


def _program(local: bool) -> Program:
    """x [2, 8, 2, 4] scaled by a parameter, rotated by position_ids into a 16-row table, summed."""
    b = ProgramBuilder("rope")
    t = Tape(b)
    x = b.tensor("x", [2, 8, 2, 4], "float64", "input")
    ids = b.tensor("position_ids", [2, 8], "int64", "input")
    sin, cos = (b.tensor(f"rope.{n}", [1, 16, 1, 4], "float64", "input") for n in ("sin", "cos"))
    w = t.param("w", [4], "float64")
    (q,) = t.op("multiply", {"x": x, "y": w}, [("q", [2, 8, 2, 4], "float64")])
    out, _, _ = t.op("fused_rotary_position_embedding",
                     {"q": q, "k": None, "v": None, "sin": sin, "cos": cos, "position_ids": ids},
                     [("q_rope", [2, 8, 2, 4], "float64"), None, None], use_neox_rotary_style=True,
                     local_positions=local)
    (loss,) = t.op("sum", {"x": out}, [("loss", [], "float64")], axis=(), keep_dim=False)
    assert loss is not None
    t.backward(loss)
    return b.build()


@pytest.mark.parametrize(("local", "moved"), [(False, {"x": 1, "q": 1, "position_ids": 2}), (True, {})])
def test_a_split_sequence_rotated_by_its_positions_moves_nothing(local: bool, moved: dict[str, int]) -> None:
    """The tokens and their position ids split over cp (in zig-zag order: any ids are sound); the
    forward and backward planned and simulated against the unsharded step."""
    prog = _program(local)
    ann = {"x": TensorDistAttr(M, [-1, 0, -1, -1]), "position_ids": TensorDistAttr(M, [-1, 0])}
    plan = propagate(prog, M, ann)
    gathers = collections.Counter(r.tensor for r in plan.reshards for s in r.plan.steps if s.kind == "all_gather")
    assert gathers == moved
    assert plan.attrs["q_rope"].dims_mapping == ((-1, 0, -1, -1) if local else (-1, -1, -1, -1))
    assert simulate_plan(plan).ok
