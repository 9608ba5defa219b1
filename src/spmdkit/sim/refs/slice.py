"""Numpy references and case generators: slice, strided_slice, tile, expand_as, expand, pad, grads.

Local runs use local shapes: expand's target becomes the local out shape (``localize``),
expand_as expands to y's local shape, tile_grad folds the repeats it sees in its local out_grad.
``pad_grad``'s reference also serves pad's backward slot (Paddle's ``PadGradInferSpmd(x, out)``
infers x from out): given x it pads, given out_grad it crops.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, TGen, rand_shape, rand_size
from spmdkit.sim.mesh import local_shape
from spmdkit.sim.reference import Arrays, Ctx, Reference, register_reference, sum_to_shape

Shape = tuple[int, ...]


def _norm(axes: Any, ndim: int) -> list[int]:
    return [int(a) + ndim if int(a) < 0 else int(a) for a in axes]


def slice_index(shape: Shape, axes: Any, starts: Any, ends: Any, strides: Any = None) -> tuple[slice, ...]:
    idx = [slice(None)] * len(shape)
    ax = _norm(axes, len(shape))
    for k, a in enumerate(ax):
        st = 1 if strides is None else int(strides[k])
        if strides is None:  # Paddle slice: negative wraps once, then clipped to [0, size]
            n = shape[a]
            b, e = int(starts[k]), int(ends[k])
            b = min(max(b + n if b < 0 else b, 0), n)
            e = min(max(e + n if e < 0 else e, 0), n)
            idx[a] = slice(b, max(b, e))
        else:
            idx[a] = slice(int(starts[k]), int(ends[k]), st)
    return tuple(idx)


def _slice(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = np.asarray(a["input"])
    out = x[slice_index(x.shape, a["axes"], a["starts"], a["ends"])]
    dec = _norm(a.get("decrease_axis") or (), x.ndim)
    if dec:
        out = out.reshape(tuple(s for i, s in enumerate(out.shape) if i not in dec))
    return (out,)


def _slice_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = np.asarray(a["input"])
    g = np.asarray(a["out_grad"], dtype=np.float64)
    idx = slice_index(x.shape, a["axes"], a["starts"], a["ends"], a.get("strides"))
    out = np.zeros(x.shape)
    target = out[idx].shape
    out[idx] = g.reshape(target)
    return (out,)


def _strided_slice(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = np.asarray(a["input"])
    return (x[slice_index(x.shape, a["axes"], a["starts"], a["ends"], a["strides"])],)


def _tile(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return (np.tile(np.asarray(a["x"]), tuple(int(v) for v in a["repeat_times"])),)


def _tile_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = np.asarray(a["x"])
    g = np.asarray(a["out_grad"], dtype=np.float64)
    lead = g.ndim - x.ndim
    g = g.sum(axis=tuple(range(lead))) if lead else g
    shp: list[int] = []
    for s, t in zip(x.shape, g.shape):  # the repeats this rank sees: local out_grad / local x
        shp += [t // s if s else 0, s]
    if 0 in x.shape:
        return (np.zeros(x.shape),)
    return (g.reshape(shp).sum(axis=tuple(range(0, 2 * x.ndim, 2))),)


def _expand_as(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = np.asarray(a["x"])
    tgt = np.shape(a["y"]) if a.get("y") is not None else expand_target(a["target_shape"], x.shape)
    return (np.array(np.broadcast_to(x, tgt)),)


def _expand_as_localize(a: Arrays, c: Ctx) -> Arrays:
    """Without y a rank expands to its local out shape (target_shape is global)."""
    if a.get("y") is not None:
        return a
    out = dict(a)
    if c.out_attrs and c.out_shapes and c.coords is not None:
        out["target_shape"] = list(local_shape(c.out_attrs[0], c.out_shapes[0], c.coords))
    return out


def _expand_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return (sum_to_shape(np.asarray(a["out_grad"], dtype=np.float64), np.shape(a["x"])),)


def expand_target(shape: Any, xs: Shape) -> Shape:
    d = len(shape) - len(xs)
    return tuple(xs[i - d] if int(s) == -1 else int(s) for i, s in enumerate(shape))


def _expand(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = np.asarray(a["x"])
    return (np.array(np.broadcast_to(x, expand_target(a["shape"], x.shape))),)


def _expand_localize(a: Arrays, c: Ctx) -> Arrays:
    out = dict(a)
    if c.out_attrs and c.out_shapes and c.coords is not None:
        out["shape"] = list(local_shape(c.out_attrs[0], c.out_shapes[0], c.coords))
    return out


def _pads(p: Any, ndim: int) -> list[tuple[int, int]]:
    return [(int(p[2 * i]), int(p[2 * i + 1])) for i in range(ndim)]


def _pad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = np.asarray(a["x"])
    return (np.pad(x, _pads(a["paddings"], x.ndim), constant_values=a.get("pad_value", 0)),)


def _pad_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    g = a.get("out_grad")
    if g is None:  # pad's backward slot (x from out): the op itself
        return _pad(a, c)
    g = np.asarray(g, dtype=np.float64)
    idx = tuple(slice(b, s - e) for (b, e), s in zip(_pads(a["paddings"], g.ndim), g.shape))
    return (np.array(g[idx]),)


register_reference(Reference("slice", _slice, ("input",), ("out",), "slice"))
register_reference(Reference("slice_grad", _slice_grad, ("input", "out_grad"), ("input_grad",), "slice_grad"))
register_reference(Reference("strided_slice", _strided_slice, ("input",), ("out",), "strided_slice"))
register_reference(Reference("strided_slice_grad", _slice_grad, ("input", "out_grad"), ("input_grad",),
                             "strided_slice_grad"))
register_reference(Reference("tile", _tile, ("x",), ("out",), "tile"))
register_reference(Reference("tile_grad", _tile_grad, ("x", "out_grad"), ("x_grad",), "tile_grad"))
register_reference(Reference("expand_as", _expand_as, ("x",), ("out",), "expand_as", optional=("y",),
                             localize=_expand_as_localize), "expand_as_v2")
register_reference(Reference("expand_as_grad", _expand_grad, ("x", "out_grad"), ("x_grad",), "expand_as_grad"),
                   "expand_as_v2_grad")
register_reference(Reference("expand", _expand, ("x",), ("out",), "expand", localize=_expand_localize))
register_reference(Reference("expand_grad", _expand_grad, ("x", "out_grad"), ("x_grad",), "expand_grad"))
register_reference(Reference("pad", _pad, ("x",), ("out",), "pad"))
register_reference(Reference("pad_grad", _pad_grad, (), ("x_grad",), "pad_grad", optional=("out_grad", "x"),
                             spec_params=("out",)))


# -- generators -------------------------------------------------------------------------------


def _slice_attrs(r: random.Random, s: Shape, dec_ok: bool) -> dict[str, Any]:
    nd = len(s)
    axes = r.sample(range(nd), r.randint(1, nd))
    starts, ends, dec = [], [], []
    for a in axes:
        n = s[a]
        if dec_ok and n >= 1 and r.random() < 0.3:
            b = r.randrange(n)
            starts.append(b - n if r.random() < 0.3 else b)
            ends.append(b + 1)
            dec.append(a)
            continue
        b = r.randint(0, n)
        e = r.randint(b, n + 2)
        starts.append(b - n if b and r.random() < 0.2 else b)
        ends.append(e - n - 1 if r.random() < 0.15 else (10**9 if e > n and r.random() < 0.5 else e))
    axes_out = [a - nd if r.random() < 0.2 else a for a in axes]
    return {"axes": axes_out, "starts": starts, "ends": ends, "infer_flags": [1] * len(axes),
            "decrease_axis": dec}


def _g_slice(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s = rand_shape(r, m, 1, 4)
    return {"input": TGen(s), **_slice_attrs(r, s, True)}


def _g_slice_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    sp = _g_slice(r, m, ref)
    (o,) = _slice({**sp, "input": np.zeros(sp["input"].shape)}, None)  # type: ignore[arg-type]
    sp["out_grad"] = TGen(np.shape(o))
    return sp


def _sslice_attrs(r: random.Random, s: Shape) -> dict[str, Any]:
    nd = len(s)
    axes = r.sample(range(nd), r.randint(1, nd))
    starts, ends, strides = [], [], []
    for a in axes:
        n = s[a]
        st = r.choice((1, 1, 2, 3, -1, -2))
        if st > 0:
            b, e = r.randint(0, n), r.randint(0, n + 1)
        else:
            b, e = r.randint(-1, n), r.randint(-n - 1, n)
        starts.append(b)
        ends.append(e)
        strides.append(st)
    return {"axes": axes, "starts": starts, "ends": ends, "strides": strides}


def _g_strided_slice(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s = rand_shape(r, m, 1, 4)
    return {"input": TGen(s), **_sslice_attrs(r, s)}


def _g_strided_slice_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    sp = _g_strided_slice(r, m, ref)
    (o,) = _strided_slice({**sp, "input": np.zeros(sp["input"].shape)}, None)  # type: ignore[arg-type]
    sp["out_grad"] = TGen(np.shape(o))
    return sp


def _g_tile(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s = rand_shape(r, m, 1, 3)
    k = r.randint(max(0, len(s) - 1), len(s) + 2)
    rep = [r.choice((1, 1, 2, 3)) for _ in range(k)]
    return {"x": TGen(s), "repeat_times": rep}


def _g_tile_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    sp = _g_tile(r, m, ref)
    (o,) = _tile({**sp, "x": np.zeros(sp["x"].shape)}, None)  # type: ignore[arg-type]
    sp["out_grad"] = TGen(np.shape(o))
    return sp


def _broadcast_target(r: random.Random, m: list[int]) -> tuple[Shape, Shape]:
    x = list(rand_shape(r, m, 0, 3))
    t = list(x)
    for i in range(len(x)):
        if r.random() < 0.35:
            x[i] = 1
    lead = [rand_size(r, m) for _ in range(r.randint(0, 2))]
    return tuple(x), (*lead, *t)


def _g_expand_as(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    x, y = _broadcast_target(r, m)
    return {"x": TGen(x), "y": TGen(y) if r.random() < 0.8 else None, "target_shape": list(y)}


def _g_expand_as_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    x, y = _broadcast_target(r, m)
    return {"x": TGen(x), "out_grad": TGen(y), "target_shape": list(y)}


def _shape_attr(r: random.Random, x: Shape, y: Shape) -> list[int]:
    d = len(y) - len(x)
    return [-1 if i >= d and x[i - d] == s and r.random() < 0.3 else s for i, s in enumerate(y)]


def _g_expand(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    x, y = _broadcast_target(r, m)
    return {"x": TGen(x), "shape": _shape_attr(r, x, y)}


def _g_expand_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    x, y = _broadcast_target(r, m)
    return {"x": TGen(x), "out_grad": TGen(y), "shape": _shape_attr(r, x, y)}


def _g_pad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s = rand_shape(r, m, 1, 4)
    p: list[int] = []
    for _ in s:
        p += [r.choice((0, 0, 1, 2)), r.choice((0, 0, 1, 3))] if r.random() < 0.5 else [0, 0]
    out = tuple(v + p[2 * i] + p[2 * i + 1] for i, v in enumerate(s))
    return {"x": TGen(s), "out": TGen(out), "out_grad": TGen(out), "paddings": p,
            "pad_value": r.choice((0, 0, 1))}


GENERATORS.update({
    "slice": _g_slice,
    "slice_grad": _g_slice_grad,
    "strided_slice": _g_strided_slice,
    "strided_slice_grad": _g_strided_slice_grad,
    "tile": _g_tile,
    "tile_grad": _g_tile_grad,
    "expand_as": _g_expand_as,
    "expand_as_grad": _g_expand_as_grad,
    "expand": _g_expand,
    "expand_grad": _g_expand_grad,
    "pad": _g_pad,
    "pad_grad": _g_pad,
})
