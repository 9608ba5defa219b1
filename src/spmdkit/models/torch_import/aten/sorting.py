"""Lowerings of ATen ops to the ``sorting`` family's rules (:mod:`spmdkit.ops.sorting`): sort / argsort
-> ``argsort`` (stable)."""

from __future__ import annotations

from typing import Any

from spmdkit.models.torch_import.context import Hook, ImportContext, Name, norm_dim


def _sort(c: ImportContext) -> Any:
    """``sort`` / ``argsort`` -> ``argsort`` (sorted values and indices), stable: ties keep their
    order (torch's unstable sort may order ties otherwise; every HF use, MoE routing, undoes
    the permutation it makes, so the result does not depend on the order of ties)."""
    x = c.args[0]
    xs = c.shape(x)
    if c.target.startswith("aten.sort.stable"):
        dim, desc = c.kwargs.get("dim", -1), c.kwargs.get("descending", False)
    else:
        dim, desc = c.arg(1, "dim", -1), c.arg(2, "descending", False)
    dim = norm_dim(int(dim), len(xs))
    outs = [(c.fresh("sorted"), xs, c.dtype(x)), (c.fresh("indices"), xs, "int64")]
    if c.imp.tape is None or x not in c.imp.tape.needs_grad:
        v, i = c.emit("argsort", {"x": x}, outs, axis=dim, descending=bool(desc), stable=True)
        return Name(str(i)) if c.target.startswith("aten.argsort") else (Name(str(v)), Name(str(i)))
    # training: the permutation from argsort, the sorted values gathered by it (differentiable)
    _, i = c.emit_nograd("argsort", {"x": x}, outs, axis=dim, descending=bool(desc), stable=True)
    if c.target.startswith("aten.argsort"):
        return Name(str(i))
    v = c.emit1("take_along_axis", {"x": x, "index": i}, (c.fresh("sorted_values"), xs, c.dtype(x)), axis=dim)
    return (v, Name(str(i)))


def _table() -> dict[str, Hook]:
    t: dict[str, Hook] = {}
    t["aten.sort"] = t["aten.argsort"] = _sort
    return t


#: ATen op (packet or overload) -> its lowering
ATEN = _table()
