"""Numpy references and case generators of the view family (spmdkit.ops.view): reshape, flatten,
squeeze, unsqueeze and their grads.

A view runs as a reshape to its out shape; on a rank the ``localize`` hook gives the local out
shape (the local piece of the output the rule claims, from the out sharding).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from spmdkit.engine.dim_trans import flatten_trans, squeeze_trans, unsqueeze_trans
from spmdkit.sim.cases import GENERATORS, Spec, TGen, rand_shape
from spmdkit.sim.mesh import local_shape
from spmdkit.sim.reference import Arrays, Ctx, Reference, RefFn, register_reference

# -- reshape (the localize hook at work) ---------------------------------------------------------


def resolve_shape(target: Sequence[int], in_shape: Sequence[int]) -> tuple[int, ...]:
    """Paddle's reshape target: 0 copies the input size at that index, one -1 is inferred."""
    out = [in_shape[i] if t == 0 and i < len(in_shape) else int(t) for i, t in enumerate(target)]
    n = int(np.prod(in_shape)) if in_shape else 1
    if out.count(-1) > 1:
        raise ValueError(f"reshape: more than one -1 in {list(target)}")
    if -1 in out:
        rest = int(np.prod([v for v in out if v != -1])) if len(out) > 1 else 1
        if rest == 0 or n % rest:
            raise ValueError(f"reshape: cannot infer -1 in {list(target)} for {list(in_shape)}")
        out[out.index(-1)] = n // rest
    if int(np.prod(out)) != n:
        raise ValueError(f"reshape: {list(target)} does not hold {n} elements")
    return tuple(out)


def _reshape(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = np.asarray(a["x"])
    if not c.is_global and c.out_attrs:  # a local target (from the out sharding): 0 is a size
        return (x.reshape(tuple(a["shape"])),)
    return (x.reshape(resolve_shape(a["shape"], x.shape)),)


def _reshape_localize(a: Arrays, c: Ctx) -> Arrays:
    """A rank reshapes its local x to the local piece of the output the rule claims."""
    out = dict(a)
    attr = c.out_attrs[0] if c.out_attrs else None
    gshape = c.out_shapes[0] if c.out_shapes else None
    if attr is not None and gshape is not None and c.coords is not None:
        out["shape"] = local_shape(attr, gshape, c.coords)
    return out


register_reference(Reference("reshape", _reshape, ("x",), ("out",), "reshape", localize=_reshape_localize), "reshape2")


def _view_to(name: str) -> RefFn:
    """A view op (flatten, squeeze, unsqueeze) run as a reshape to its global out shape; on
    a rank the localize hook gives the local out shape (from the out sharding)."""

    def fn(a: Arrays, c: Ctx) -> tuple[Any, ...]:
        x = np.asarray(a[name])
        return (x.reshape(tuple(a["shape"])),)

    return fn


def _view_localize(shape_of: Callable[[Arrays, tuple[int, ...]], tuple[int, ...]], name: str) -> Callable[
        [Arrays, Ctx], Arrays]:
    def loc(a: Arrays, c: Ctx) -> Arrays:
        out = dict(a)
        if c.is_global:
            out["shape"] = shape_of(a, tuple(np.shape(a[name])))
            return out
        return _reshape_localize(out, c)

    return loc


def _view_run(shape_of: Callable[[Arrays, tuple[int, ...]], tuple[int, ...]], name: str) -> RefFn:
    base = _view_to(name)
    loc = _view_localize(shape_of, name)

    def fn(a: Arrays, c: Ctx) -> tuple[Any, ...]:
        if c.is_global:
            a = loc(a, c)
        return tuple(base(a, c))

    return fn


def flatten_shape(a: Arrays, shp: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(flatten_trans.raw(shp, int(a["start_axis"]), int(a["stop_axis"]))[1])  # type: ignore[attr-defined]


def squeeze_shape(a: Arrays, shp: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(squeeze_trans.raw(shp, tuple(a["axis"]))[1])  # type: ignore[attr-defined]


def unsqueeze_shape(a: Arrays, shp: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(unsqueeze_trans.raw(shp, tuple(a["axis"]))[1])  # type: ignore[attr-defined]


def _grad_ref(holder: str) -> RefFn:
    """x_grad = out_grad viewed as the holder's shape (global, or the local x_grad piece)."""

    def fn(a: Arrays, c: Ctx) -> tuple[Any, ...]:
        g = np.asarray(a["out_grad"])
        if c.is_global:
            return (g.reshape(tuple(np.shape(a[holder]))),)
        return (g.reshape(tuple(a["shape"])),)

    return fn


def _grad_localize(a: Arrays, c: Ctx) -> Arrays:
    return _reshape_localize(a, c)


for _n, _f_shape, _fam in (("flatten", flatten_shape, "flatten"), ("squeeze", squeeze_shape, "squeeze"),
                           ("unsqueeze", unsqueeze_shape, "unsqueeze")):
    register_reference(Reference(_n, _view_run(_f_shape, "x"), ("x",), ("out",), _fam,
                                 localize=_reshape_localize), *(("unsqueeze2",) if _n == "unsqueeze" else ()))

for _n, _holder in (("reshape_grad", "x_shape"), ("flatten_grad", "xshape"), ("squeeze_grad", "xshape"),
                    ("unsqueeze_grad", "x")):
    register_reference(Reference(_n, _grad_ref(_holder), ("out_grad",), ("x_grad",), "view_grad",
                                 spec_params=(_holder,), localize=_grad_localize, meta={"holder": _holder}))


# -- case generators ----------------------------------------------------------------------------


def _g_reshape(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 1, 4)
    sizes: list[int] = []
    for v in s:  # split some axes into factors, then merge some neighbours
        f = [d for d in (2, 3, 4) if v % d == 0 and v > d]
        if f and r.random() < 0.3:
            d = r.choice(f)
            sizes += [d, v // d]
        else:
            sizes.append(v)
    out: list[int] = []
    for v in sizes:
        if out and r.random() < 0.35:
            out[-1] *= v
        else:
            out.append(v)
    if r.random() < 0.1:
        out.append(1)
    tgt: list[int] = list(out)
    if tgt and r.random() < 0.3:
        tgt[r.randrange(len(tgt))] = -1
    for i in range(min(len(tgt), len(s))):
        if tgt[i] == s[i] and r.random() < 0.3:
            tgt[i] = 0
    return {"x": TGen(s), "shape": tgt}


def _g_flatten(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 1, 4)
    nd = len(s)
    a = r.randrange(nd)
    b = r.randrange(a, nd)
    return {"x": TGen(s), "start_axis": a - nd if r.random() < 0.2 else a,
            "stop_axis": b - nd if r.random() < 0.3 else b}


def _g_squeeze(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = list(rand_shape(r, m, 1, 4))
    for _ in range(r.randint(0, 2)):
        s.insert(r.randint(0, len(s)), 1)
    nd = len(s)
    ax = [] if r.random() < 0.25 else r.sample(range(nd), r.randint(1, nd))
    return {"x": TGen(tuple(s)), "axis": [a - nd if r.random() < 0.25 else a for a in ax]}


def _g_unsqueeze(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 0, 3)
    rank = len(s)
    ax: list[int] = []
    for _ in range(r.randint(1, 3)):
        a = r.randint(0, rank)
        ax.append(a - rank - 1 if r.random() < 0.3 else a)
        rank += 1
    return {"x": TGen(s), "axis": ax}


def _g_view_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    holder = ref.meta["holder"]
    op = ref.name[: -len("_grad")]
    if op == "reshape":
        sp = _g_reshape(r, m, ref)
        s = sp["x"].shape
        o = resolve_shape(sp["shape"], s)
        return {holder: TGen(s), "out_grad": TGen(o)}
    if op == "flatten":
        sp = _g_flatten(r, m, ref)
        s = sp["x"].shape
        o = flatten_trans.raw(s, sp["start_axis"], sp["stop_axis"])[1]  # type: ignore[attr-defined]
        return {holder: TGen(s), "out_grad": TGen(o)}
    sp = _g_squeeze(r, m, ref) if op == "squeeze" else _g_unsqueeze(r, m, ref)
    s = sp["x"].shape
    fn = squeeze_trans if op == "squeeze" else unsqueeze_trans
    o = fn.raw(s, tuple(sp["axis"]))[1]  # type: ignore[attr-defined]
    return {holder: TGen(s), "out_grad": TGen(o), "axis": sp["axis"]}


GENERATORS.update({
    "reshape": _g_reshape,
    "flatten": _g_flatten,
    "squeeze": _g_squeeze,
    "unsqueeze": _g_unsqueeze,
    "view_grad": _g_view_grad,
})

__all__ = ["flatten_shape", "resolve_shape", "squeeze_shape", "unsqueeze_shape"]
