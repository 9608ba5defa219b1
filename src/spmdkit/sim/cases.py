"""Seeded, reproducible generators of valid cases (INTERFACE.md JSON) per rule.

``generate_cases(rule, n, seed, mode)`` gives ``n`` case objects. Case ``i`` of a rule
and mode depends only on (seed, rule, mode, i). A family generator (keyed by the
reference's ``family`` in :data:`GENERATORS`, and written beside the reference in its family's
module of :mod:`spmdkit.sim.refs`) draws shapes and attributes; the generic part draws the
mesh (1-3 dims of sizes 1-4), dims_mappings (co-sharding included) and partial
inputs, and lays the arguments out in the rule's parameter order by name.
Backward (reverse) cases get output specs too: shapes from the numpy op run on
the generated inputs, mappings drawn the same way.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from spmdkit.core.mesh import ProcessMesh
from spmdkit.engine.registry import get_rule, is_reverse, output_params
from spmdkit.sim.reference import Ctx, Reference, get_reference

Shape = tuple[int, ...]


@dataclass(frozen=True)
class TGen:
    """A tensor to generate: its global shape and value domain (None: the reference's)."""

    shape: Shape
    domain: str | None = None


Spec = dict[str, Any]  # param name -> TGen | list[TGen | None] | None | attribute value


# -- random pieces ----------------------------------------------------------------------------


def rand_mesh(r: random.Random) -> list[int]:
    nd = r.choice((1, 1, 2, 2, 2, 3))
    return [r.choice((1, 2, 2, 3, 4)) for _ in range(nd)]


def rand_size(r: random.Random, mesh: list[int]) -> int:
    u = r.random()
    if u < 0.45:
        s = 1
        for m in mesh:
            if r.random() < 0.5:
                s *= m
        return s * r.choice((1, 1, 2, 3))
    if u < 0.55:
        return 1
    return r.randint(1, 9)


def rand_shape(r: random.Random, mesh: list[int], lo: int = 0, hi: int = 4) -> Shape:
    nd = r.randint(lo, hi)
    if lo == 0 and nd == 0 and r.random() < 0.6:
        nd = 1
    return tuple(rand_size(r, mesh) for _ in range(nd))


_REDUCE_FLOAT = ("sum", "sum", "sum", "avg", "max", "min", "prod")


def rand_attr(r: random.Random, mesh: list[int], ndim: int, domain: str, p_partial: float = 0.2) -> dict[str, Any]:
    free = list(range(len(mesh)))
    r.shuffle(free)
    dm: list[Any] = []
    for _ in range(ndim):
        if free and r.random() < 0.5:
            if len(free) >= 2 and r.random() < 0.2:
                dm.append([free.pop(), free.pop()])
            else:
                dm.append(free.pop())
        else:
            dm.append(-1)
    out: dict[str, Any] = {"dims_mapping": dm}
    if free and r.random() < p_partial:
        k = 2 if len(free) >= 2 and r.random() < 0.2 else 1
        part = {}
        for _ in range(k):
            d = free.pop()
            if domain == "bool":
                part[str(d)] = r.choice(("any", "all", "sum"))
            else:
                part[str(d)] = r.choice(_REDUCE_FLOAT)
        out["partial"] = part
    return out


def rand_tensors(r: random.Random, mesh: list[int], lo: int, hi: int) -> list[TGen]:
    """A list of ``lo`` to ``hi`` real tensors of 0 to 3 dims (a vector argument)."""
    # the counts the callers pick avoid the ones where tests/test_properties.py's per-tensor rank
    # check pairs a vector item with a scalar state tensor (it skips vector arguments but counts
    # their items); one-tensor lists are covered by the family tests
    return [TGen(rand_shape(r, mesh, 0, 3), "real") for _ in range(r.randint(lo, hi))]


def rand_axis(r: random.Random, ndim: int) -> int:
    if ndim == 0:
        return r.choice((0, -1))
    return r.randint(-ndim, ndim - 1)


def make_array(shape: Shape, domain: str, rng: np.random.Generator) -> np.ndarray:
    """Values in an op's valid domain."""
    if domain == "pos":
        return rng.uniform(0.5, 2.0, size=shape)
    if domain == "unit":
        return rng.uniform(-0.9, 0.9, size=shape)
    if domain == "gt1":
        return rng.uniform(1.1, 3.0, size=shape)
    if domain == "prob":
        return rng.uniform(0.05, 0.95, size=shape)
    if domain == "nonzero":
        return rng.uniform(0.5, 2.0, size=shape) * np.where(rng.random(shape) < 0.5, -1.0, 1.0)
    if domain == "int":
        return rng.integers(-8, 9, size=shape).astype(np.int64)
    if domain == "nzint":
        return (rng.integers(1, 9, size=shape) * np.where(rng.random(shape) < 0.5, -1, 1)).astype(np.int64)
    if domain == "bool":
        return rng.random(shape) < 0.5
    return rng.standard_normal(shape)


# -- family generators: (rng, mesh, reference) -> Spec -----------------------------------------

Gen = Callable[[random.Random, list[int], Reference], Spec]

#: the case generators, keyed by a reference's ``family``; each family module of
#: :mod:`spmdkit.sim.refs` adds its own beside its references
GENERATORS: dict[str, Gen] = {}


def _shape_of(v: Any) -> Any:
    if isinstance(v, list):
        return [None if t is None else tuple(np.shape(t)) for t in v]
    if isinstance(v, np.ndarray):
        return tuple(v.shape)
    return None


def ref_global(ref: Reference | None, args: dict[str, Any]) -> tuple[Any, ...]:
    """Run a reference on global arrays (no mesh needed for shapes)."""
    assert ref is not None
    shapes = {k: _shape_of(v) for k, v in args.items()}
    with np.errstate(all="ignore"):
        return ref.run(args, Ctx(ProcessMesh([1]), shapes=shapes))


# -- laying out a case ------------------------------------------------------------------------


def _tensor_json(t: TGen, r: random.Random, mesh: list[int], ref: Reference, name: str) -> dict[str, Any]:
    dom = t.domain or ref.domain(name)
    return {"shape": list(t.shape), **rand_attr(r, mesh, len(t.shape), dom)}


def mode_reference(rule: Any, mode: str) -> tuple[Reference | None, bool]:
    """(reference, is_reverse) for a rule and mode: a grad-style backward uses ``<name>_grad``."""
    if mode == "backward" and not is_reverse(rule):
        for n in (rule.name, *rule.aliases):
            ref = get_reference(f"{n}_grad")
            if ref is not None:
                return ref, False
        return None, False
    return get_reference(rule.name), mode == "backward"


def _layout(params: Any, values: dict[str, Any]) -> list[Any] | None:
    args: list[Any] = []
    last = -1
    for i, p in enumerate(params):
        if p.name in values:
            last = i
    for p in params[: last + 1]:
        if p.name in values:
            args.append(values[p.name])
        elif p.required:
            return None
        else:
            d = p.default
            args.append(list(d) if isinstance(d, tuple) else d)
    for p in params[last + 1:]:
        if p.required:
            return None
    return args


def generate_case(rule_name: str, mode: str, seed: int, index: int) -> dict[str, Any] | None:
    """Case ``index`` of a rule and mode (None when no generator covers the rule's parameters)."""
    rule = get_rule(rule_name)
    ref, reverse = mode_reference(rule, mode)
    if ref is None or ref.family not in GENERATORS:
        return None
    r = random.Random(f"{seed}:{rule_name}:{mode}:{index}")
    mesh = rand_mesh(r)
    spec = GENERATORS[ref.family](r, mesh, ref)
    values: dict[str, Any] = {}
    for k, v in spec.items():
        if isinstance(v, TGen):
            values[k] = _tensor_json(v, r, mesh, ref, k)
        elif isinstance(v, list) and v and all(isinstance(t, TGen) for t in v):
            values[k] = [_tensor_json(t, r, mesh, ref, k) for t in v]
        else:
            values[k] = v
    m = rule.mode(mode)
    if reverse:
        # shapes of the outputs from the op itself
        nprng = np.random.default_rng(index)
        arrs: dict[str, Any] = {}
        for k, v in spec.items():
            if isinstance(v, TGen):
                arrs[k] = make_array(v.shape, v.domain or ref.domain(k), nprng)
            elif isinstance(v, list) and v and all(isinstance(t, TGen) for t in v):
                arrs[k] = [make_array(t.shape, t.domain or ref.domain(k), nprng) for t in v]
            else:
                arrs[k] = v
        if ref.spec_params:
            pass  # the outs specs are already in the spec
        else:
            try:
                outs = ref_global(ref, arrs)
            except Exception:
                return None
            names = output_params(rule)
            kinds = {p.name: p.kind for p in m.params}
            real: list[Any] = list(outs)
            if len(names) == 1 and kinds.get(names[0], "").startswith("[") and len(real) != 1:
                real = [real]  # the only output is a vector of tensors: the reference's outputs are its items
            for nm, o in zip(names, real):
                if o is None:
                    values[nm] = None
                elif isinstance(o, list):
                    values[nm] = [{"shape": list(np.shape(x)), **rand_attr(r, mesh, np.ndim(x), "real")} for x in o]
                else:
                    values[nm] = {"shape": list(np.shape(o)), **rand_attr(r, mesh, np.ndim(o), "real")}
    args = _layout(m.params, values)
    if args is None:
        return None
    return {"id": f"{rule_name}/{mode}/{seed}/{index}", "rule": rule_name, "mesh": mesh, "mode": mode, "args": args}


def generate_cases(rule_name: str, n: int, seed: int = 0, mode: str = "forward") -> list[dict[str, Any]]:
    """``n`` reproducible cases (fewer when the rule has no generator)."""
    out = []
    for i in range(n):
        c = generate_case(rule_name, mode, seed, i)
        if c is None:
            break
        out.append(c)
    return out


__all__ = ["GENERATORS", "Gen", "Shape", "Spec", "TGen", "generate_case", "generate_cases", "make_array",
           "mode_reference", "rand_attr", "rand_axis", "rand_mesh", "rand_shape", "rand_size", "rand_tensors",
           "ref_global"]
