"""Lowerings of ATen ops to the ``norm`` family's rules (:mod:`spmdkit.ops.norm`): layer_norm
(``begin_norm_axis``) and rms_norm (``fused_rms_norm``)."""

from __future__ import annotations

from typing import Any

import torch

from spmdkit.models.torch_import.context import TORCH_DTYPES, Hook, ImportContext, Name


def _stat_dtype(dt: str) -> str:
    return "float64" if dt == "float64" else "float32"


def _layer_norm(c: ImportContext) -> Any:
    x, ns = c.args[0], c.args[1]
    w, bias = c.arg(2, "weight"), c.arg(3, "bias")
    eps = float(c.arg(4, "eps", 1e-5))
    xs = c.shape(x)
    bna = len(xs) - len(ns)
    sd = _stat_dtype(c.dtype(x))
    outs = [(c.name, xs, c.dtype(x)), (c.fresh("mean"), xs[:bna], sd), (c.fresh("var"), xs[:bna], sd)]
    o, _, _ = c.emit("layer_norm", {"x": x, "scale": w, "bias": bias}, outs, epsilon=eps, begin_norm_axis=bna)
    if c.target.startswith("aten.native_layer_norm"):
        return (Name(str(o)), None, None)
    return Name(str(o))


def _rms_norm(c: ImportContext) -> Any:
    x, ns = c.args[0], c.args[1]
    w = c.arg(2, "weight")
    eps = c.arg(3, "eps")
    xs = c.shape(x)
    if len(ns) != 1:
        raise c.unsupported(f"rms_norm over {len(ns)} trailing dims (fused_rms_norm normalises the last one)")
    if eps is None:
        eps = float(torch.finfo(TORCH_DTYPES[c.dtype(x)]).eps)
    outs = [(c.name, xs, c.dtype(x)), (c.fresh("invvar"), xs[:-1], _stat_dtype(c.dtype(x)))]
    o, _ = c.emit("fused_rms_norm", {"x": x, "scale": w}, outs, epsilon=float(eps))
    return Name(str(o))


def _table() -> dict[str, Hook]:
    t: dict[str, Hook] = {}
    t["aten.layer_norm"] = t["aten.native_layer_norm"] = _layer_norm
    t["aten.rms_norm"] = _rms_norm
    return t


#: ATen op (packet or overload) -> its lowering
ATEN = _table()
