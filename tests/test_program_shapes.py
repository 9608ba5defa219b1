"""Declared output shapes are checked against the shapes the op makes (issue 13).

A program whose declared output shape contradicts its op is a ProgramError naming the op,
for every rule whose semantics fix the output shape (spmdkit.program.shapes); a correct
program passes. The sweep over every rule uses the numpy references as the oracle.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from spmdkit.core.errors import ProgramError
from spmdkit.engine.facts import facts_of
from spmdkit.engine.registry import all_rules, get_rule
from spmdkit.models.zoo import PRESETS, build_model
from spmdkit.program.ir import ProgramBuilder
from spmdkit.program.shapes import expected_output_shapes, unchecked_rules

ROOT = Path(__file__).resolve().parents[1]


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("output_shape_coverage", ROOT / "benchmarks" /
                                                  "output_shape_coverage.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["output_shape_coverage"] = mod
    spec.loader.exec_module(mod)
    return mod


def _build(rule: str, inputs: dict[str, Any], outputs: list[Any], attrs: dict[str, Any]) -> None:
    b = ProgramBuilder()
    ins: dict[str, Any] = {}
    for k, v in inputs.items():
        if v is None:
            ins[k] = None
        elif v and isinstance(v[0], list):
            ins[k] = [b.tensor(f"{k}{i}", s, kind="input") for i, s in enumerate(v)]
        else:
            ins[k] = b.tensor(k, v, kind="input")
    outs: list[Any] = []
    for i, o in enumerate(outputs):
        if o is None:
            outs.append(None)
        elif o and isinstance(o[0], list):
            outs.append([(f"out{i}_{j}", s) for j, s in enumerate(o)])
        else:
            outs.append((f"out{i}", o))
    b.op(rule, ins, outs, name="the_op", **attrs)
    b.build()


# (rule, inputs, correct outputs, attrs, (output index, item or None, axis) to perturb)
CASES: list[tuple[str, dict[str, Any], list[Any], dict[str, Any], tuple[int, Any, int]]] = [
    ("matmul", {"x": [8, 16], "y": [16, 32]}, [[8, 32]], {}, (0, None, 1)),
    ("matmul", {"x": [2, 8, 16], "y": [32, 16]}, [[2, 8, 32]], {"trans_y": True}, (0, None, 0)),
    ("matmul_grad", {"x": [8, 16], "y": [16, 32], "out_grad": [8, 32]}, [[8, 16], [16, 32]], {}, (1, None, 0)),
    ("add_grad", {"x": [4, 1, 6], "y": [5, 6], "out_grad": [4, 5, 6]}, [[4, 1, 6], [5, 6]], {}, (0, None, 1)),
    ("relu_grad", {"out": [4, 6], "out_grad": [4, 6]}, [[4, 6]], {}, (0, None, 0)),
    ("softmax_grad", {"out": [4, 6], "out_grad": [4, 6]}, [[4, 6]], {}, (0, None, 1)),
    ("layer_norm_grad", {"x": [2, 3, 8], "scale": [8], "bias": [8], "mean": [2, 3], "variance": [2, 3],
                         "out_grad": [2, 3, 8]}, [[2, 3, 8], [8], [8]], {"begin_norm_axis": 2}, (1, None, 0)),
    ("concat", {"x": [[2, 3], [2, 5], [2, 1]]}, [[2, 9]], {"axis": 1}, (0, None, 1)),
    ("concat", {"x": [[2, 3], [4, 3]]}, [[6, 3]], {"axis": -2}, (0, None, 0)),
    ("concat_grad", {"x": [[2, 3], [2, 5]], "output_grad": [2, 8]}, [[[2, 3], [2, 5]]], {"axis": 1}, (0, 1, 1)),
    ("cummax", {"x": [4, 6]}, [[4, 6], [4, 6]], {"axis": 1}, (1, None, 0)),
    ("cummin", {"x": [4, 6]}, [[4, 6], [4, 6]], {"axis": 0}, (0, None, 1)),
    ("take_along_axis", {"x": [4, 6], "index": [4, 2]}, [[4, 2]], {"axis": 1}, (0, None, 1)),
    ("take_along_axis_grad", {"x": [4, 6], "index": [4, 2], "out_grad": [4, 2]}, [[4, 6]], {"axis": 1},
     (0, None, 1)),
    ("label_smooth", {"label": [4, 10], "prior_dist": None}, [[4, 10]], {"epsilon": 0.1}, (0, None, 1)),
    ("label_smooth_grad", {"out_grad": [4, 10]}, [[4, 10]], {"epsilon": 0.1}, (0, None, 0)),
    ("split", {"x": [4, 10]}, [[[4, 3], [4, 7]]], {"sections": [3, -1], "axis": 1}, (0, 1, 1)),
    ("split_grad", {"out_grad": [[4, 3], [4, 7]]}, [[4, 10]], {"axis": 1}, (0, None, 1)),
    ("reshape", {"x": [4, 6, 2]}, [[4, 12]], {"shape": [0, -1]}, (0, None, 1)),
    ("slice", {"input": [8, 16]}, [[8, 4]], {"axes": [1], "starts": [4], "ends": [8]}, (0, None, 1)),
    ("sum", {"x": [4, 6, 2]}, [[4, 1, 2]], {"axis": [1], "keep_dim": True}, (0, None, 1)),
    ("sum_grad", {"x": [4, 6], "out_grad": [4]}, [[4, 6]], {"axis": [1]}, (0, None, 1)),
    ("embedding", {"x": [4, 7], "weight": [100, 16]}, [[4, 7, 16]], {}, (0, None, 2)),
    ("embedding_grad", {"x": [4, 7], "weight": [100, 16], "out_grad": [4, 7, 16]}, [[100, 16]], {}, (0, None, 0)),
    ("transpose_grad", {"out_grad": [6, 4, 2]}, [[4, 2, 6]], {"perm": [2, 0, 1]}, (0, None, 0)),
    ("stack_grad", {"output_grad": [4, 3, 5]}, [[[4, 5], [4, 5], [4, 5]]], {"axis": 1}, (0, 2, 1)),
    ("unsqueeze_grad", {"x": [4, 6], "out_grad": [4, 1, 6]}, [[4, 6]], {"axis": [1]}, (0, None, 1)),
    ("topk", {"x": [4, 10]}, [[4, 3], [4, 3]], {"k": 3}, (1, None, 1)),
    ("where_grad", {"condition": [4, 6], "x": [4, 6], "y": [6], "out_grad": [4, 6]}, [[4, 6], [6]], {},
     (1, None, 0)),
    ("conv3d", {"input": [2, 3, 8, 9, 10], "filter": [5, 3, 3, 3, 3]}, [[2, 5, 4, 9, 4]],
     {"strides": [2, 1, 2], "paddings": [1, 1, 0], "padding_algorithm": "EXPLICIT"}, (0, None, 3)),
    ("einsum", {"inputs": [[2, 3, 4], [2, 4, 5]]}, [[2, 3, 5]], {"equation": "bij,bjk->bik"}, (0, None, 2)),
    ("flash_attention", {"q": [2, 16, 4, 8], "k": [2, 16, 4, 8], "v": [2, 16, 4, 8]},
     [[2, 16, 4, 8], None, None, None], {}, (0, None, 1)),
    ("sgd", {"param": [16, 8], "learning_rate": [1], "grad": [16, 8], "master_param": None},
     [[16, 8], None], {}, (0, None, 0)),
    ("nonzero", {"x": [4, 6]}, [[9, 2]], {}, (0, None, 1)),
]


@pytest.mark.parametrize("rule,inputs,outputs,attrs,bad", CASES, ids=[c[0] for c in CASES])
def test_declared_output_shape_is_checked(rule: str, inputs: dict[str, Any], outputs: list[Any],
                                          attrs: dict[str, Any], bad: tuple[int, Any, int]) -> None:
    _build(rule, inputs, outputs, attrs)  # the correct program passes
    k, item, ax = bad
    wrong = [None if o is None else [list(s) for s in o] if o and isinstance(o[0], list) else list(o)
             for o in outputs]
    target = wrong[k] if item is None else wrong[k][item]
    target[ax] += 1
    with pytest.raises(ProgramError, match=r"the_op.*contradicts"):
        _build(rule, inputs, wrong, attrs)


def test_the_issue_example_names_the_op_and_both_shapes() -> None:
    with pytest.raises(ProgramError) as e:
        _build("matmul", {"x": [8, 16], "y": [16, 32]}, [[9, 33]], {})
    msg = str(e.value)
    assert "the_op" in msg and "[9, 33]" in msg and "[8, 32]" in msg and "matmul" in msg


def test_data_dependent_axis_is_not_checked() -> None:
    for n in (0, 1, 24):  # nonzero's count comes from the data: any size is valid
        _build("nonzero", {"x": [4, 6]}, [[n, 2]], {})
    assert facts_of("nonzero").unchecked and facts_of("unique").unchecked


def test_vector_output_count_is_checked() -> None:
    with pytest.raises(ProgramError, match="the_op"):
        _build("split", {"x": [4, 10]}, [[[4, 3], [4, 3], [4, 4]]], {"sections": [3, -1], "axis": 1})


def test_every_rule_has_a_shape_function_or_a_reason() -> None:
    canon = {r.name for r in all_rules().values()}
    unchecked = unchecked_rules()
    assert all(reason for reason in unchecked.values())
    no_fn = [n for n, why in unchecked.items() if why.startswith("no shape function")]
    assert no_fn == [], no_fn
    assert set(unchecked) <= canon


def test_expected_shapes_answer_none_on_nonsense_instead_of_raising() -> None:
    rule = get_rule("concat")
    assert expected_output_shapes(rule, {"x": [(2, 3), (2, 3)], "axis": 7}, [2]) == [None]
    assert expected_output_shapes(get_rule("matmul"), {"x": (), "y": (3,)}, [0]) == [None]
    mm = {"x": (8, 16), "y": (16, 32), "trans_x": False, "trans_y": False}
    assert expected_output_shapes(get_rule("matmul"), mm, [2]) == [(8, 32)]
    # a rank that disagrees with the rule's own answer is this table's doubt: not used
    assert expected_output_shapes(get_rule("matmul"), mm, [3]) == [None]


def test_seeded_sweep_every_rule_no_false_alarm_and_perturbations_caught() -> None:
    """Two seeded valid cases per rule, output shapes from the numpy reference: every correct
    program passes, and a one-larger output axis is caught except where documented."""
    bench = _bench()
    partial = {"conv2d", "coalesce_tensor", "flash_attention", "group_norm", "nonzero",
               "unique", "mean_all", "numel"}
    alarms: list[str] = []
    missed: list[str] = []
    measured = 0
    for name in sorted({r.name for r in all_rules().values()}):
        for case in bench.forward_cases(name, 2, 7):
            t = bench.Tally()
            bench.measure(case, t, alarms)
            measured += t.cases
            if t.caught != t.tried and name not in partial:
                missed.append(f"{name}: {t.caught}/{t.tried}")
    assert alarms == []
    assert missed == []
    assert measured > 600


def test_zoo_programs_validate_and_a_wrong_grad_shape_is_caught() -> None:
    from dataclasses import replace

    from spmdkit.program.ir import Program, Tensor

    for name in ("tiny-llama", "tiny-gpt2"):
        prog = build_model(PRESETS[name]).program
        prog.validate()
        for op in prog.ops:
            if op.rule.endswith("_grad") and op.output_names():
                out = op.output_names()[0]
                break
        else:
            raise AssertionError("no grad op in the zoo program")
        t = prog.tensors[out]
        bad = [replace(x, shape=(x.shape[0] + 1, *x.shape[1:])) if x.name == out else x
               for x in prog.tensors.values()]
        assert all(isinstance(x, Tensor) for x in bad)
        with pytest.raises(ProgramError, match=r"contradicts"):
            Program(bad, prog.ops, prog.name).validate()
        assert t.shape  # the perturbed tensor had an axis
