"""Property test over every rule family: random valid (and deliberately broken) inputs give a
well-formed result (one dist attr per tensor, legal mappings on the case's mesh) or an SpmdError,
never another exception."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import SpmdError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.io.codec import parse_case
from spmdkit.ops import get_rule, rule_names
from spmdkit.sim.cases import generate_case

PAIRS = [(n, m) for n in rule_names(include_aliases=False) for m in get_rule(n).modes
         if generate_case(n, m, 0, 0) is not None]


def _check_attr(a: Any, mesh: Any) -> None:
    assert isinstance(a, TensorDistAttr)
    assert a.mesh == mesh
    TensorDistAttr(a.mesh, a.dims_mapping, dict(a.partial))  # re-validates: legal, no dim used twice


def _check(res: SpmdResult, case: Any) -> None:
    assert isinstance(res, SpmdResult)
    for part in (res.inputs, res.outputs):
        for a in part:
            if isinstance(a, tuple):
                for x in a:
                    if x is not None:
                        _check_attr(x, case.mesh)
            elif a is not None:
                _check_attr(a, case.mesh)
    # inputs answered one per tensor argument, with the argument's rank
    specs = [a for a in case.args if isinstance(a, DistTensorSpec)]
    flat_in = [x for a in res.inputs for x in (a if isinstance(a, tuple) else (a,)) if x is not None]
    if len(flat_in) == len(specs):
        for s, a in zip(specs, flat_in):
            assert len(a.dims_mapping) == s.ndim


def _mutate(case: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
    """Break one tensor's dims_mapping (out-of-range mesh dim, wrong length, a dim used twice)."""
    c = copy.deepcopy(case)
    ts = [a for a in c["args"] if isinstance(a, dict) and "shape" in a]
    if not ts:
        return c
    t = data.draw(st.sampled_from(ts))
    how = data.draw(st.sampled_from(["range", "length", "twice", "shape"]))
    dm = list(t.get("dims_mapping") or [-1] * len(t["shape"]))
    if how == "range" and dm:
        dm[0] = len(c["mesh"]) + 2
    elif how == "length":
        dm = [*dm, -1]
    elif how == "twice" and len(dm) >= 2:
        dm[0] = dm[1] = 0
    elif how == "shape":
        t["shape"] = [*t["shape"], 3]
    t["dims_mapping"] = dm
    return c


@pytest.mark.parametrize(("rule", "mode"), PAIRS, ids=[f"{n}-{m}" for n, m in PAIRS])
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**20), broken=st.booleans(), data=st.data())
def test_rule_answers_are_well_formed(rule: str, mode: str, seed: int, broken: bool, data: st.DataObject) -> None:
    case = generate_case(rule, mode, seed, seed % 97)
    assert case is not None
    if broken:
        case = _mutate(case, data)
    try:
        c = parse_case(case)
        res = c.run()
    except SpmdError as exc:
        assert str(exc), "an SpmdError must say what is wrong"
        return
    _check(res, c)
