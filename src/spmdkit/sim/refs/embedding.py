"""Simulator references and case generators: embedding, c_embedding, one_hot and the grads.

A rank whose weight rows are sharded runs the vocab-parallel kernel: the ``localize`` hook
gives it the global index of its first row (from the rule's weight dist attr), it looks up
only the ids of its own rows and writes zeros for the others (so the rule must answer out
partial SUM over the row mesh dims). The grads accumulate only the ids of a rank's rows
into its local weight_grad. Ids come from the ``int`` domain and are folded into the vocab
range by ``prepare`` (c_embedding keeps a few ids outside ``[start_index, start_index +
rows)``, which look up zeros).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, TGen, rand_shape, rand_size
from spmdkit.sim.mesh import local_slices
from spmdkit.sim.reference import Arrays, Ctx, Reference, register_reference

FAMILY = "embedding"


def _row_start(c: Ctx, name: str = "weight") -> int:
    """The global index of the first weight row a rank holds (0 for the global run)."""
    if c.is_global or c.coords is None:
        return 0
    attr = c.in_attrs.get(name)
    shape = c.shapes.get(name)
    if attr is None or shape is None:
        return 0
    return int(local_slices(attr, shape, c.coords)[0].start)


def _localize_rows(a: Arrays, c: Ctx) -> Arrays:
    out = dict(a)
    out["_row_start"] = _row_start(c)
    return out


def _ids(x: Any) -> np.ndarray:
    return np.asarray(x).astype(np.int64)


def _mask(ids: np.ndarray, start: int, rows: int, padding_idx: int) -> tuple[np.ndarray, np.ndarray]:
    idx = ids - start
    ok = (idx >= 0) & (idx < rows)
    if padding_idx >= 0:
        ok &= ids != padding_idx
    return idx, ok


def lookup(ids: Any, weight: Any, start: int = 0, padding_idx: int = -1) -> np.ndarray:
    """out[..., :] = weight[id - start] for ids in the table's range (and not padding), else 0."""
    i = _ids(ids)
    w = np.asarray(weight, dtype=np.float64)
    idx, ok = _mask(i, start, w.shape[0], padding_idx)
    out = np.zeros((*i.shape, w.shape[1]))
    out[ok] = w[idx[ok]]
    return out


def lookup_grad(ids: Any, weight: Any, out_grad: Any, start: int = 0, padding_idx: int = -1) -> np.ndarray:
    """d(sum(out * out_grad)) / d(weight): out_grad rows scattered (summed) onto their ids' rows."""
    i = _ids(ids)
    w = np.asarray(weight, dtype=np.float64)
    g = np.asarray(out_grad, dtype=np.float64)
    idx, ok = _mask(i, start, w.shape[0], padding_idx)
    wg = np.zeros(w.shape)
    np.add.at(wg, idx[ok], g[ok])
    return wg


def _emb(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return (lookup(a["x"], a["weight"], int(a.get("_row_start", 0)), int(a.get("padding_idx", -1))),)


def _emb_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return (lookup_grad(a["x"], a["weight"], a["out_grad"], int(a.get("_row_start", 0)),
                        int(a.get("padding_idx", -1))),)


def _c_emb(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    start = int(a.get("start_index", 0)) + int(a.get("_row_start", 0))
    return (lookup(a["x"], a["weight"], start),)


def _c_emb_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    start = int(a.get("start_index", 0)) + int(a.get("_row_start", 0))
    return (lookup_grad(a["x"], a["weight"], a["out_grad"], start),)


def _prep_ids(a: Arrays) -> None:
    rows = int(np.shape(a["weight"])[0])
    a["x"] = np.abs(_ids(a["x"])) % max(rows, 1)


def _prep_c_ids(a: Arrays) -> None:
    """Ids in ``[start_index, start_index + rows)``, every fourth one just past the end (zeros)."""
    rows = int(np.shape(a["weight"])[0])
    raw = _ids(a["x"])
    start = int(a.get("start_index", 0))
    a["x"] = np.where(raw % 4 == 0, start + rows, start + np.abs(raw) % max(rows, 1))


def _one_hot(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    i = _ids(a["x"])
    n = int(a["num_classes"])
    ok = (i >= 0) & (i < n)
    out = np.zeros((*i.shape, n))
    out[ok] = np.eye(n)[i[ok]]
    return (out,)


def _prep_one_hot(a: Arrays) -> None:
    a["x"] = np.abs(_ids(a["x"])) % max(int(a["num_classes"]), 1)


_IDS = {"x": "int"}
register_reference(Reference("embedding", _emb, ("x", "weight"), ("out",), FAMILY, domains=_IDS,
                             prepare=_prep_ids, localize=_localize_rows), "lookup_table_v2")
register_reference(Reference("embedding_grad", _emb_grad, ("x", "weight", "out_grad"), ("weight_grad",),
                             "embedding_grad", domains=_IDS, prepare=_prep_ids, localize=_localize_rows),
                   "lookup_table_v2_grad")
register_reference(Reference("c_embedding", _c_emb, ("weight", "x"), ("out",), "c_embedding", domains=_IDS,
                             prepare=_prep_c_ids, localize=_localize_rows))
register_reference(Reference("c_embedding_grad", _c_emb_grad, ("weight", "x", "out_grad"), ("weight_grad",),
                             "c_embedding_grad", domains=_IDS, prepare=_prep_c_ids, localize=_localize_rows))
register_reference(Reference("one_hot", _one_hot, ("x",), ("out",), "one_hot", domains=_IDS,
                             prepare=_prep_one_hot))


# -- generators ---------------------------------------------------------------------------------


def _table(r: random.Random, m: list[int]) -> tuple[tuple[int, ...], tuple[int, int]]:
    x = rand_shape(r, m, 0, 3)
    return x, (rand_size(r, m), rand_size(r, m))


def _g_embedding(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    x, w = _table(r, m)
    pad = -1 if r.random() < 0.75 else r.randrange(w[0])
    return {"x": TGen(x, "int"), "weight": TGen(w), "padding_idx": pad, "sparse": r.random() < 0.1}


def _g_embedding_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    sp = _g_embedding(r, m, ref)
    sp["out_grad"] = TGen((*sp["x"].shape, sp["weight"].shape[1]), "real")
    return sp


def _g_c_embedding(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    x, w = _table(r, m)
    start = r.choice((0, 0, 1, 3))
    return {"weight": TGen(w), "x": TGen(x, "int"), "start_index": start, "vocab_size": start + w[0]}


def _g_c_embedding_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    sp = _g_c_embedding(r, m, ref)
    sp.pop("vocab_size")
    sp["out_grad"] = TGen((*sp["x"].shape, sp["weight"].shape[1]), "real")
    return sp


def _g_one_hot(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    return {"x": TGen(rand_shape(r, m, 0, 3), "int"), "num_classes": rand_size(r, m)}


GENERATORS.update({
    FAMILY: _g_embedding,
    "embedding_grad": _g_embedding_grad,
    "c_embedding": _g_c_embedding,
    "c_embedding_grad": _g_c_embedding_grad,
    "one_hot": _g_one_hot,
})
