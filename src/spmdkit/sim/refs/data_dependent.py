"""Numpy references and case generators of the data_dependent family (spmdkit.ops.data_dependent):
nonzero and unique, whose output sizes depend on the data; the references compute them from it (the
rules only assume the ranks).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, TGen, rand_axis, rand_shape
from spmdkit.sim.reference import Arrays, Ctx, Reference, register_reference
from spmdkit.sim.reference import norm_axis as _ax

# -- nonzero / unique ---------------------------------------------------------------------------


def _nonzero(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = np.asarray(a["x"])
    if x.ndim == 0:
        raise ValueError("nonzero needs at least 1 dim")
    return (np.argwhere(x).astype(np.int64),)


def unique(x: Any, return_index: bool, return_inverse: bool, return_counts: bool, axis: Any) -> tuple[Any, ...]:
    x = np.asarray(x)
    ax = list(axis) if isinstance(axis, (list, tuple)) else ([] if axis is None else [axis])
    if len(ax) > 1:
        raise ValueError("unique takes at most one axis")
    a = None if not ax else _ax(ax[0], x.ndim)
    flat = x.reshape(-1) if a is None else x
    out, ind, inv, cnt = np.unique(flat, return_index=True, return_inverse=True, return_counts=True, axis=a)
    return (out.astype(np.float64), ind.astype(np.int64) if return_index else None,
            inv.reshape(-1).astype(np.int64) if return_inverse else None,
            cnt.astype(np.int64) if return_counts else None)


register_reference(Reference("nonzero", _nonzero, ("x",), ("out",), "nonzero", domains={"x": "int"}))
register_reference(Reference("unique", lambda a, c: unique(a["x"], bool(a.get("return_index")),
                                                           bool(a.get("return_inverse")),
                                                           bool(a.get("return_counts")), a.get("axis", ())),
                             ("x",), ("out", "indices", "inverse", "counts"), "unique", domains={"x": "int"}))



# -- case generators ----------------------------------------------------------------------------


def _g_nonzero(r: random.Random, m: list[int], ref: Any) -> dict[str, Any]:
    return {"x": TGen(rand_shape(r, m, 1, 4), "int")}


def _g_unique(r: random.Random, m: list[int], ref: Any) -> dict[str, Any]:
    s = rand_shape(r, m, 1, 3)
    axis = [] if r.random() < 0.5 else [rand_axis(r, len(s))]
    return {"x": TGen(s, "int"), "return_index": r.random() < 0.5, "return_inverse": r.random() < 0.5,
            "return_counts": r.random() < 0.5, "axis": axis, "dtype": "int64"}


GENERATORS.update({
    "nonzero": _g_nonzero,
    "unique": _g_unique,
})

__all__ = ["unique"]
