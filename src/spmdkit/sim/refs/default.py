"""Numpy references and case generators of the default family (spmdkit.ops.default): the stand-in
ops of the generic rules default_data_parallel and replicated.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, Spec, TGen, rand_shape, rand_size
from spmdkit.sim.reference import Arrays, Ctx, Reference, as_f64, register_reference

# -- default_data_parallel / replicated -------------------------------------------------------
# A stand-in op for the generic rules: every output row b depends on row b of every input
# (default_data_parallel), or every output depends on every element of every input
# (replicated). Output shapes come from the ``outs`` specs; a rank makes its outputs with
# the batch size of its local inputs (data parallel) and the global sizes elsewhere.


def _pattern(shape: tuple[int, ...]) -> np.ndarray:
    n = int(np.prod(shape)) if shape else 1
    return (np.arange(n, dtype=np.float64) % 7 + 1.0).reshape(shape) / 7.0


def _dp(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    ins = [np.asarray(t) for t in (a.get("ins") or []) if t is not None]
    out_shapes = [tuple(s) if s is not None else None for s in c.shapes.get("outs", [])]
    batch = None
    for t in ins:
        if t.ndim:
            batch = t.shape[0]
            break
    rowsum = None
    for t in ins:
        if t.ndim == 0:
            continue
        r = np.tanh(as_f64(t)).reshape(t.shape[0], int(np.prod(t.shape[1:]))).sum(axis=1)
        rowsum = r if rowsum is None else rowsum + r
    outs: list[Any] = []
    for s in out_shapes:
        if s is None:
            outs.append(None)
            continue
        if not s:
            outs.append(np.asarray(sum(float(np.tanh(as_f64(t)).sum()) for t in ins)))
            continue
        b = batch if batch is not None else s[0]
        shp = (b, *s[1:])
        rs = rowsum if rowsum is not None else np.zeros(b)
        outs.append(rs.reshape((b,) + (1,) * (len(s) - 1)) * _pattern((1, *shp[1:])))
    return tuple(outs)


def _replicated(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    ins = [np.asarray(t) for t in (a.get("ins") or []) if t is not None]
    total = sum(float(np.tanh(as_f64(t)).mean()) if t.size else 0.0 for t in ins)  # bounded: |total| <= len(ins)
    return tuple(None if s is None else total * _pattern(tuple(s)) for s in c.shapes.get("outs", []))


register_reference(Reference("default_data_parallel", _dp, ("ins",), (), "default_dp", spec_params=("outs",)),
                   "default_")
register_reference(Reference("replicated", _replicated, ("ins",), (), "replicated", spec_params=("outs",)))


# -- case generators ----------------------------------------------------------------------------


def _g_default_dp(r: random.Random, m: list[int], ref: Reference) -> Spec:
    b = rand_size(r, m)
    ins = [TGen((b, *rand_shape(r, m, 0, 2))) for _ in range(r.randint(1, 3))]
    outs = [TGen((b, *rand_shape(r, m, 0, 2))) for _ in range(r.randint(1, 2))]
    return {"ins": ins, "outs": outs}


def _g_replicated(r: random.Random, m: list[int], ref: Reference) -> Spec:
    ins = [TGen(rand_shape(r, m, 1, 3)) for _ in range(r.randint(1, 3))]
    outs = [TGen(rand_shape(r, m, 1, 3)) for _ in range(r.randint(1, 2))]
    return {"ins": ins, "outs": outs}


GENERATORS.update({
    "default_dp": _g_default_dp,
    "replicated": _g_replicated,
})
