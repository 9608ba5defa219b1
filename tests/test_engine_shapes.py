"""Declared shape and attribute checks (engine/shapes.py) in generated rule functions: each
form of the mini-language raises the right error with the op, tensor and axis named, and
accepts what it should (unknown sizes, absent optional tensors, any number of axes at ...)."""

from __future__ import annotations

from typing import Any

import pytest

from spmdkit.core import DistTensorSpec, ProcessMesh
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.engine.declare import Way, generate
from spmdkit.engine.notation import Notation

MESH = ProcessMesh([2, 2])


def T(shape: list[int]) -> DistTensorSpec:
    return DistTensorSpec(shape, mesh=MESH, dims_mapping=[-1] * len(shape))


def _ew(nx: int, ny: int, nb: int) -> Notation:
    return Notation(("abc"[:nx], "abc"[-ny:] if ny else "", "c" if nb >= 0 else None), ("abc"[:nx],))


RULE: Any = generate(
    "toy", "x: T, y: T, b: T?, groups: int = 1",
    Way(_ew, key="x, y, b", shapes="x: n ... k; y: _ k; b: k", require=("groups >= 1", "groups <= 8")),
)  # fmt: skip


def test_accepts_matching_unknown_and_absent() -> None:
    RULE(T([2, 3, 4]), T([5, 4]), T([4]))
    RULE(T([2, 3, -1]), T([5, 4]), None, 8)
    RULE(T([2, -1]), T([5, 4]), T([-1]))  # ... may be empty


@pytest.mark.parametrize(
    ("args", "error", "words"),
    [
        ((T([4]), T([5, 4]), None), ShapeMismatchError, ["toy: x must be at least 2-D", "[4]"]),
        ((T([2, 4]), T([4]), None), ShapeMismatchError, ["toy: y must be 2-D", "[4]"]),
        ((T([2, 4]), T([5, 4]), T([4, 1])), ShapeMismatchError, ["toy: b must be 1-D"]),
        ((T([2, 3, 4]), T([5, 6]), None), ShapeMismatchError, ["toy: y's axis 1 (k) is 6 but x's axis 2 is 4"]),
        ((T([2, -1]), T([5, 6]), T([7])), ShapeMismatchError, ["toy: b's axis 0 (k) is 7 but y's axis 1 is 6"]),
        ((T([2, 3, 4]), T([5, 4]), None, 0), InvalidAttributeError, ["toy: needs groups >= 1, got groups = 0"]),
        ((T([2, 3, 4]), T([5, 4]), None, 9), InvalidAttributeError, ["toy: needs groups <= 8, got groups = 9"]),
    ],
)
def test_errors_name_op_tensor_and_axis(args: tuple[Any, ...], error: type[Exception], words: list[str]) -> None:
    with pytest.raises(error) as e:
        RULE(*args)
    for w in words:
        assert w in str(e.value)


def test_fixed_size() -> None:
    f: Any = generate("box", "x: T", Way(lambda n: Notation(("ab",), ("ab",)), key="x", shapes="x: r 4"))
    f(T([3, 4]))
    f(T([3, -1]))
    with pytest.raises(ShapeMismatchError, match="box: x's axis 1 must be 4, got shape \\[3, 5\\]"):
        f(T([3, 5]))


@pytest.mark.parametrize("spec", ["z: a", "x: a ... ...", "x: a-b", "groups: a"])
def test_bad_declaration_is_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="toy2: shapes entry"):
        generate("toy2", "x: T, groups: int = 1", Way(_ew, key="x", shapes=spec))


def test_require_with_its_own_words() -> None:
    f: Any = generate(
        "tw", "x: T, transpose_weight: bool = False",
        Way(lambda n: Notation(("ab",), ("ab",)), key="x", require=(("not transpose_weight", "transpose_weight is not supported"),)),
    )  # fmt: skip
    f(T([3, 4]))
    with pytest.raises(
        InvalidAttributeError, match="tw: transpose_weight is not supported, got transpose_weight = True"
    ):
        f(T([3, 4]), True)
