"""Numpy references and case generators: split, split_with_num, unbind, concat, stack, grads.

Vector outputs (split's pieces) are returned flat, one array per piece, in order. The reverse
rules of split / split_with_num / unbind take the pieces as ``out: [T]``; the case generator
describes them as output specs (``spec_params=("out",)``), so that reverse cases get one spec
per piece (the generic reverse layout gives a single tensor per output parameter).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, TGen, rand_axis, rand_shape, rand_size
from spmdkit.sim.reference import Arrays, Ctx, Reference, register_reference

Shape = tuple[int, ...]


def _ax(axis: Any, ndim: int) -> int:
    a = int(axis)
    return a + ndim if a < 0 else a


def _sections(sections: Any, size: int) -> list[int]:
    s = [int(v) for v in sections]
    if -1 in s:
        s[s.index(-1)] = size - sum(v for v in s if v != -1)
    return s


def _cuts(sizes: list[int]) -> list[int]:
    return list(np.cumsum(sizes)[:-1]) if sizes else []


def _split(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = np.asarray(a["x"])
    ax = _ax(a.get("axis", 0), x.ndim)
    return tuple(np.split(x, _cuts(_sections(a["sections"], x.shape[ax])), axis=ax))


def _split_with_num(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = np.asarray(a["x"])
    return tuple(np.split(x, int(a["num"]), axis=_ax(a.get("axis", 0), x.ndim)))


def _unbind(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = np.asarray(a["x"])
    ax = _ax(a.get("axis", 0), x.ndim)
    return tuple(np.take(x, i, axis=ax) for i in range(x.shape[ax]))


def _concat_of(name: str) -> Any:
    def fn(a: Arrays, c: Ctx) -> tuple[Any, ...]:
        xs = [np.asarray(t) for t in a[name]]
        return (np.concatenate(xs, axis=_ax(a.get("axis", 0), xs[0].ndim)),)

    return fn


def _stack_of(name: str) -> Any:
    def fn(a: Arrays, c: Ctx) -> tuple[Any, ...]:
        xs = [np.asarray(t) for t in a[name]]
        return (np.stack(xs, axis=_ax(a.get("axis", 0), xs[0].ndim + 1)),)

    return fn


def _concat_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    g = np.asarray(a["output_grad"])
    ax = _ax(a.get("axis", 0), g.ndim)
    sizes = [np.shape(t)[ax] for t in a["x"]]
    return tuple(np.split(g, _cuts(sizes), axis=ax))


def _stack_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    g = np.asarray(a["output_grad"])
    ax = _ax(a.get("axis", 0), g.ndim)
    return tuple(np.take(g, i, axis=ax) for i in range(g.shape[ax]))


register_reference(Reference("split", _split, ("x",), ("out",), "split", spec_params=("out",)))
register_reference(Reference("split_with_num", _split_with_num, ("x",), ("out",), "split_with_num",
                             spec_params=("out",)))
register_reference(Reference("unbind", _unbind, ("x",), ("out",), "unbind", spec_params=("out",)))
register_reference(Reference("concat", _concat_of("x"), ("x",), ("out",), "concat"))
register_reference(Reference("stack", _stack_of("x"), ("x",), ("out",), "stack"))
register_reference(Reference("split_grad", _concat_of("out_grad"), ("out_grad",), ("x_grad",), "split_grad"))
register_reference(Reference("split_with_num_grad", _concat_of("out_grad"), ("out_grad",), ("x_grad",),
                             "split_grad"))
register_reference(Reference("unbind_grad", _stack_of("out_grad"), ("out_grad",), ("input_grad",), "unbind_grad"))
register_reference(Reference("concat_grad", _concat_grad, ("x", "output_grad"), ("x_grad",), "concat_grad"))
register_reference(Reference("stack_grad", _stack_grad, ("output_grad",), ("x_grad",), "stack_grad"))


# -- generators -------------------------------------------------------------------------------


def _with(shape: Shape, ax: int, size: int) -> Shape:
    return (*shape[:ax], size, *shape[ax + 1:])


def _parts(r: random.Random, size: int) -> list[int]:
    """A random composition of ``size`` (1-4 parts; zero-size parts now and then)."""
    k = r.randint(1, 4)
    cuts = sorted(r.randint(0, size) for _ in range(k - 1))
    parts = [b - a for a, b in zip([0, *cuts], [*cuts, size])]
    if size and r.random() < 0.7:
        parts = [p for p in parts if p] or [size]
    return parts


def _g_split(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s = rand_shape(r, m, 1, 4)
    axis = rand_axis(r, len(s))
    ax = _ax(axis, len(s))
    parts = _parts(r, s[ax])
    secs = list(parts)
    if r.random() < 0.25:
        secs[r.randrange(len(secs))] = -1
    return {"x": TGen(s), "sections": secs, "axis": axis, "out": [TGen(_with(s, ax, p)) for p in parts]}


def _g_split_with_num(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s = list(rand_shape(r, m, 1, 4))
    axis = rand_axis(r, len(s))
    ax = _ax(axis, len(s))
    num = r.choice((1, 2, 2, 3, 4))
    s[ax] = num * max(1, s[ax] // num) if r.random() < 0.5 else num * r.randint(1, 3)
    piece = _with(tuple(s), ax, s[ax] // num)
    return {"x": TGen(tuple(s)), "num": num, "axis": axis, "out": [TGen(piece) for _ in range(num)]}


def _g_unbind(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s = list(rand_shape(r, m, 1, 4))
    axis = rand_axis(r, len(s))
    ax = _ax(axis, len(s))
    s[ax] = min(s[ax], 5)
    rest = tuple(v for i, v in enumerate(s) if i != ax)
    return {"x": TGen(tuple(s)), "axis": axis, "out": [TGen(rest) for _ in range(s[ax])]}


def _join_shapes(r: random.Random, m: list[int], vary: bool) -> tuple[list[Shape], int, int]:
    s = rand_shape(r, m, 1, 4)
    axis = rand_axis(r, len(s))
    ax = _ax(axis, len(s))
    n = r.choice((1, 2, 2, 3))
    shapes = [_with(s, ax, rand_size(r, m)) if vary else s for _ in range(n)]
    return shapes, axis, ax


def _g_concat(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    shapes, axis, _ = _join_shapes(r, m, True)
    return {"x": [TGen(t) for t in shapes], "axis": axis}


def _g_stack(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    shapes, _, _ = _join_shapes(r, m, False)
    if len(shapes) == 1:  # tests/test_properties.py pairs a lone vector item with the output
        shapes = shapes * 2
    nd = len(shapes[0]) + 1
    return {"x": [TGen(t) for t in shapes], "axis": r.randint(-nd, nd - 1)}


def _g_split_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    shapes, axis, _ = _join_shapes(r, m, True)
    return {"out_grad": [TGen(t) for t in shapes], "axis": axis}


def _g_unbind_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    shapes, _, _ = _join_shapes(r, m, False)
    nd = len(shapes[0]) + 1
    return {"out_grad": [TGen(t) for t in shapes], "axis": r.randint(-nd, nd - 1)}


def _g_concat_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    shapes, axis, ax = _join_shapes(r, m, True)
    total = _with(shapes[0], ax, sum(t[ax] for t in shapes))
    return {"x": [TGen(t) for t in shapes], "output_grad": TGen(total), "axis": axis}


def _g_stack_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s = list(rand_shape(r, m, 1, 4))
    axis = rand_axis(r, len(s))
    s[_ax(axis, len(s))] = min(s[_ax(axis, len(s))], 5)
    return {"output_grad": TGen(tuple(s)), "axis": axis}


GENERATORS.update({
    "split": _g_split,
    "split_with_num": _g_split_with_num,
    "unbind": _g_unbind,
    "concat": _g_concat,
    "stack": _g_stack,
    "split_grad": _g_split_grad,
    "unbind_grad": _g_unbind_grad,
    "concat_grad": _g_concat_grad,
    "stack_grad": _g_stack_grad,
})
