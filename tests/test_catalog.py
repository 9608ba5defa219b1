"""Paddle 3.3.1's whole rule catalog: every name its SpmdRuleFactory answers is registered in
spmdkit with the modes Paddle has, under Paddle's function names.

The data file tests/data/paddle-3.3.1-registered-rules.json is Paddle's table as read from the
live binding (name -> the function in the forward and backward slots, or null)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from spmdkit.ops import get_rule, has_rule

_TABLE: dict[str, Any] = json.loads(
    (Path(__file__).parent / "data" / "paddle-3.3.1-registered-rules.json").read_text())
PADDLE: dict[str, dict[str, str | None]] = {k: v for k, v in _TABLE.items() if not k.startswith("_")}

#: Paddle names spmdkit does not have yet (issue 7). Must shrink to empty; the test below fails
#: when a name here gets registered, so the list cannot go stale.
NOT_YET: set[str] = set()

#: Slots where spmdkit deliberately registers another function than Paddle, with the reason.
OTHER_FUNCTION = {
    ("fused_linear_param_grad_add", "backward"):
        "Paddle's backward slot is a fake that takes nothing and returns empty lists; spmdkit "
        "has a real reverse rule (docs/deviations.md, linalg)",
}


def _fn(entry: str | None) -> str | None:
    return None if entry is None else entry.split("(")[0]


def test_catalog_size() -> None:
    assert len(PADDLE) == 187
    assert sum(1 for v in PADDLE.values() if v["backward"] is None) == 8


def test_not_yet_is_exact() -> None:
    missing = {n for n in PADDLE if not has_rule(n)}
    assert missing == NOT_YET


@pytest.mark.parametrize("name", sorted(set(PADDLE) - NOT_YET))
def test_registered_with_paddles_modes(name: str) -> None:
    rule = get_rule(name)
    for slot in ("forward", "backward"):
        want = _fn(PADDLE[name][slot])
        mode = rule.forward if slot == "forward" else rule.backward
        if want is None:
            continue  # Paddle has no backward here; spmdkit may add its own reverse rule
        assert mode is not None, f"{name}: Paddle has a {slot} rule ({want}), spmdkit none"
        if not want or want.startswith("(variadic"):
            continue  # Paddle's binding does not name variadic rules
        if (name, slot) in OTHER_FUNCTION:
            assert mode.function_name != want
            continue
        assert mode.function_name == want, f"{name} {slot}: Paddle {want}, spmdkit {mode.function_name}"


def test_every_rule_without_paddle_backward_still_has_one() -> None:
    """Where Paddle has no backward, spmdkit builds a reverse rule all the same."""
    lacking = [n for n, v in PADDLE.items() if v["backward"] is None and has_rule(n)
               and get_rule(n).backward is None]
    assert lacking == []
