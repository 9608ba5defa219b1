"""Which rule-modes are answered through the engine's compiled plans (issue 17: all of them).

Every canonical rule-mode runs a few simulator-generated cases with the result cache off (which
also turns off the engine's memo tables, so no cached answer hides a rule) under
:func:`spmdkit.engine.compiler.traced`; a mode is on the engine when every case it answers (an
error answer reaches no merge) went through a compiled plan. Every mode must be (the list of
exceptions this test used to carry is empty and gone).
"""

from __future__ import annotations

import json

from spmdkit.engine.compiler import traced
from spmdkit.io.codec import answer_line
from spmdkit.ops import get_rule, rule_names, set_cache_enabled
from spmdkit.sim.cases import generate_case

CASES = 6  # per mode and seed (2 seeds): a few seconds in all


def _modes() -> list[tuple[str, str]]:
    return [(n, m) for n in rule_names(include_aliases=False) for m in get_rule(n).modes]


def _on_engine(name: str, mode: str) -> bool | None:
    """Whether every answered case of the mode reached a compiled plan (None: none answered)."""
    answered = traced_all = 0
    for seed in (0, 7):
        for i in range(CASES):
            case = generate_case(name, mode, seed, i)
            if case is None:
                break
            case = dict(case, rule=name, mode=mode)
            with traced() as seen:
                ans = answer_line(json.dumps(case))
            if "error" in ans:
                continue
            answered += 1
            traced_all += bool(seen)
    return None if not answered else traced_all == answered


def test_rule_modes_through_the_engine() -> None:
    set_cache_enabled(False)
    try:
        result = {f"{n}:{m}": _on_engine(n, m) for n, m in _modes()}
    finally:
        set_cache_enabled(True)
    assert len(result) > 500
    assert None not in result.values(), [k for k, v in result.items() if v is None]
    off = sorted(k for k, v in result.items() if not v)
    assert not off, f"rule-modes answered without a compiled plan: {off}"
