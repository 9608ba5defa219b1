"""The Python rule API under adversarial input: every invalid argument is an SpmdError.

A seeded, bounded run of spmdkit.sim.fuzz over every rule and mode (canonical names),
the targeted huge-size calls included, plus the cases issue 13 named. The full run
(``python -m spmdkit.sim.fuzz --count 1000``) is the same code with more calls.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from spmdkit.core.errors import (
    InvalidArgumentError,
    InvalidAttributeError,
    ShapeMismatchError,
    SpmdError,
    UnsupportedModeError,
)
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec
from spmdkit.ops import get_rule
from spmdkit.ops.split_concat import MAX_OUTPUTS
from spmdkit.ops.view import MAX_NEW_AXES
from spmdkit.sim.fuzz import canonical_rules, fuzz_all, fuzz_mode

M2 = ProcessMesh([2])


def S(shape: list[int], dm: list[Any] | None = None, mesh: ProcessMesh = M2) -> DistTensorSpec:
    return DistTensorSpec(shape, mesh=mesh, dims_mapping=dm if dm is not None else [-1] * len(shape))


def test_every_rule_mode_fuzzed_without_a_foreign_exception() -> None:
    # 100 random calls per rule-mode after the targeted huge-size ones (about 170 in all per
    # rule-mode, ~90k calls); any exception that is not an SpmdError fails, with its call
    rep = fuzz_all(count=100, seed=13, call_timeout=30.0)
    assert len(rep.per_mode) == sum(len(r.modes) for r in canonical_rules()) >= 500
    assert rep.calls >= 100 * len(rep.per_mode)
    assert rep.refused > 0 and rep.answered > 0  # the fuzzer reaches both outcomes
    assert not rep.failures, "\n\n".join(str(f) for f in rep.failures[:5])


def test_fuzzer_catches_a_foreign_exception() -> None:
    # the harness itself: a rule that raises something else is reported, not swallowed
    from spmdkit.engine.registry import Rule
    from spmdkit.engine.signature import Mode

    def bad(x: DistTensorSpec) -> Any:
        raise RuntimeError("boom")

    rule = Rule("bad_rule_for_test", Mode(bad, "x: T"), None)
    rep = fuzz_mode(rule, "forward", 40, 0)
    assert rep.failures and all(f.op == "bad_rule_for_test" for f in rep.failures)
    assert "RuntimeError: boom" in rep.failures[0].error


@pytest.mark.parametrize("value", [
    np.array([1.0, 2.0]), {1, 2}, bytearray(b"ab"), {1: "a", "b": 2}, {"a": {2: {1.5: None}}}, np.float32(1.5),
    [np.int64(3), {4}], frozenset({1}),
])
@pytest.mark.parametrize("rule", ["cast", "cummax", "empty_like", "full_like", "unique"])
def test_any_attribute_values_answered_or_refused(rule: str, value: Any) -> None:
    # numpy values, sets, bytearrays and mixed-key dicts: frozen to a hashable canonical form
    r = get_rule(rule)
    name = next(p.name for p in r.forward.params if p.kind == "any")
    a = r.infer_forward(S([4, 6], [0, -1]), **{name: value})
    b = r.infer_forward(S([4, 6], [0, -1]), **{name: value})
    assert a == b


def test_any_attribute_refusals_name_the_op_and_attribute() -> None:
    deep: Any = 1
    for _ in range(100):
        deep = [deep]
    with pytest.raises(InvalidAttributeError, match=r"cast: attribute 'dtype' nests deeper"):
        get_rule("cast").infer_forward(S([4]), deep)
    with pytest.raises(InvalidAttributeError, match=r"cast: attribute 'dtype' must be"):
        get_rule("cast").infer_forward(S([4]), object.__new__(type("Unhashable", (), {"__hash__": None})))
    # a value that cannot be echoed whole is cut, and its repr never recurses
    with pytest.raises(InvalidAttributeError) as e:
        get_rule("softmax").infer_forward(S([4, 6]), [[[[[[[[1]]]]]]]] * 5000)
    assert len(str(e.value)) < 400


@pytest.mark.parametrize(("rule", "args", "exc", "words"), [
    ("unbind", (S([10_000_000]), 0), ShapeMismatchError, r"unbind: x's axis 0 \(size 10000000\).*at most 4096"),
    ("unbind", (S([2**63]), 0), ShapeMismatchError, "unbind: .*at most 4096"),
    ("split_with_num", (S([10_000_000]), 10_000_000, 0), InvalidAttributeError, "split_with_num: num 10000000"),
    ("split_with_num", (S([2**64]), 2**63, 0), InvalidAttributeError, "split_with_num: num"),
    ("split", (S([8192]), [2] * 4097, 0), InvalidAttributeError, "split: sections"),
    ("stack_grad", (S([2**62, 3]), 0), ShapeMismatchError, "stack_grad: output_grad's axis 0"),
    ("stack_grad", (S([3, 5000]), 1), ShapeMismatchError, "stack_grad: .*at most 4096"),
])
def test_output_count_bounded(rule: str, args: tuple[Any, ...], exc: type, words: str) -> None:
    with pytest.raises(exc, match=words):
        get_rule(rule).infer_forward(*args)


def test_output_count_bound_in_reverse_modes_and_at_the_limit() -> None:
    outs = [S([1])] * 5000
    with pytest.raises(ShapeMismatchError, match=r"unbind: .*at most 4096"):
        get_rule("unbind").infer_backward(S([5000, 1]), outs, 0)
    with pytest.raises(InvalidAttributeError, match="split_with_num: num 5000"):
        get_rule("split_with_num").infer_backward(S([5000]), outs, 5000, 0)
    # exactly the limit is answered
    res = get_rule("unbind").infer_forward(S([MAX_OUTPUTS, 4], [-1, 0]), 0)
    assert len(res.outputs[0]) == MAX_OUTPUTS
    assert len(get_rule("stack_grad").infer_forward(S([MAX_OUTPUTS]), 0).outputs[0]) == MAX_OUTPUTS


def test_unsqueeze_axes_bounded() -> None:
    with pytest.raises(InvalidAttributeError, match="unsqueeze: axis has 1025 entries"):
        get_rule("unsqueeze").infer_forward(S([4]), [0] * (MAX_NEW_AXES + 1))
    res = get_rule("unsqueeze").infer_forward(S([4], [0]), [0] * 8)
    assert res.outputs[0].dims_mapping == (-1,) * 8 + (0,)


def test_keywords_self_and_mode_are_rule_arguments() -> None:
    # self= / mode= go to the rule: an unknown argument, or the rule's own parameter named mode
    with pytest.raises(InvalidArgumentError, match="softmax: unknown argument 'self'"):
        get_rule("softmax").infer_forward(S([4, 6]), self=1)
    with pytest.raises(InvalidArgumentError, match="softmax: unknown argument 'mode'"):
        get_rule("softmax").infer("forward", S([4, 6]), mode="x")
    pad = get_rule("fused_dropout_add_grad")
    assert "mode" in pad.forward.names
    a = pad.infer("forward", None, S([4, 6], [0, -1]), 0.0, False, mode="downscale_in_infer")
    assert a == pad.infer_forward(None, S([4, 6], [0, -1]), 0.0, False, "downscale_in_infer")


@pytest.mark.parametrize("mode", [None, 1, ["forward"], b"forward", "sideways"])
def test_bad_mode_is_unsupported_mode_error(mode: Any) -> None:
    with pytest.raises(UnsupportedModeError, match="softmax"):
        get_rule("softmax").infer(mode, S([4, 6]))


def test_errors_from_inside_a_rule_are_spmd_errors() -> None:
    # MemoryError / RecursionError / OverflowError raised by a rule: InvalidArgumentError naming it
    from spmdkit.engine.registry import Rule
    from spmdkit.engine.signature import Mode

    for exc in (MemoryError(), RecursionError("deep"), OverflowError("big"), AttributeError("a")):
        def fn(x: DistTensorSpec, _e: BaseException = exc) -> Any:
            raise _e

        rule = Rule("raiser", Mode(fn, "x: T"), None)
        with pytest.raises(InvalidArgumentError, match="raiser: ") as e:
            rule.infer_forward(S([2]))
        assert isinstance(e.value, SpmdError)


def test_deeply_nested_attribute_refused_without_recursing() -> None:
    # a 100,000-deep tuple: hashing or printing it would overflow the C stack (a crash, not
    # an exception), so binding refuses it by depth before anything recurses over it. Run in
    # a child process so that a regression fails this test instead of killing the suite.
    import subprocess
    import sys

    code = (
        "from spmdkit.ops import get_rule, set_cache_enabled\n"
        "from spmdkit.core import DistTensorSpec, ProcessMesh\n"
        "from spmdkit.core.errors import InvalidAttributeError\n"
        "set_cache_enabled(False)\n"
        "x = DistTensorSpec([4], mesh=ProcessMesh([2]), dims_mapping=[0])\n"
        "v = 1\n"
        "for _ in range(100_000):\n"
        "    v = (v,)\n"
        "for rule, arg in (('cast', v), ('softmax', v), ('transpose', v)):\n"
        "    try:\n"
        "        get_rule(rule).infer_forward(x, arg)\n"
        "    except InvalidAttributeError as e:\n"
        "        assert len(str(e)) < 400, e\n"
        "        print('refused', rule)\n"
        "from spmdkit.core.errors import UnknownRuleError\n"
        "try:\n"
        "    get_rule(v)\n"
        "except UnknownRuleError as e:\n"
        "    assert len(str(e)) < 400, e\n"
        "    print('refused get_rule')\n"
    )
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split("\n")[:4] == ["refused cast", "refused softmax", "refused transpose", "refused get_rule"]


@pytest.mark.parametrize("name", [None, 1, ["softmax"], b"softmax", {"a": 1}, np.str_("nope"), "nope"])
def test_get_rule_refuses_foreign_names(name: Any) -> None:
    from spmdkit.core.errors import UnknownRuleError
    from spmdkit.ops import has_rule

    with pytest.raises(UnknownRuleError):
        get_rule(name)
    assert not has_rule(name)
