"""What ``spmdkit calibrate`` measured on a machine, as a device file holds it (its
``"measured"`` object): GEMM rates at shapes, attention rates, the memory bandwidth reached,
and collective times by op, group size, scope and message size. :class:`Measured` is read by
:func:`spmdkit.cost.devices.device_from_json`; the compute model interpolates the GEMM and
attention points, the collective model the collective points. Standard library only.

The JSON (every number positive and finite; lists may be empty)::

    "measured": {
      "source": "spmdkit calibrate 0.x on host, 2026-12-05, torch 2.x, nccl",
      "gemm": [{"m": 8192, "n": 8192, "k": 8192, "dtype": "bf16", "tflops": 712.0}],
      "attention": [{"batch": 1, "heads": 32, "seq": 4096, "head_dim": 128, "causal": true,
                     "dtype": "bf16", "fwd_tflops": 480.0, "bwd_tflops": 390.0}],
      "hbm_gb_per_s": 2900.0,
      "collectives": [{"op": "all_reduce", "ranks": 8, "scope": "intra_node",
                       "bytes": 268435456, "time_us": 1480.0}]
    }

``op``: all_reduce, all_gather, reduce_scatter, all_to_all, send_recv (``bytes``: the buffer
each rank holds in and out: the whole tensor for all_reduce, the gathered output for
all_gather, the input for reduce_scatter, the message for send_recv); ``scope``: intra_node
(every rank of the group in one node) or inter_node; ``time_us``: the measured time of one call.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from spmdkit.core.errors import ProgramError

DTYPES = ("fp8", "bf16", "fp16", "tf32", "fp32", "fp64")
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
SCOPES = ("intra_node", "inter_node")


@dataclass(frozen=True)
class GemmPoint:
    m: int
    n: int
    k: int
    dtype: str
    tflops: float


@dataclass(frozen=True)
class AttentionPoint:
    batch: int
    heads: int
    seq: int
    head_dim: int
    causal: bool
    dtype: str
    fwd_tflops: float
    bwd_tflops: float


@dataclass(frozen=True)
class CollectivePoint:
    op: str
    ranks: int
    scope: str
    bytes: int
    time_us: float


@dataclass(frozen=True)
class Measured:
    source: str = ""
    gemm: tuple[GemmPoint, ...] = ()
    attention: tuple[AttentionPoint, ...] = ()
    hbm_gb_per_s: float | None = None
    collectives: tuple[CollectivePoint, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "gemm": [p.__dict__ for p in self.gemm],
                               "attention": [p.__dict__ for p in self.attention],
                               "collectives": [p.__dict__ for p in self.collectives]}
        if self.hbm_gb_per_s is not None:
            out["hbm_gb_per_s"] = self.hbm_gb_per_s
        return out


def _pos(where: str, v: Any, integer: bool = False) -> Any:
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(float(v)) and v > 0
    if ok and integer:
        ok = float(v) == int(v) and v <= 1 << 62
    if not ok:
        what = "a positive integer" if integer else "a positive finite number"
        raise ProgramError(f"--device measured.{where}: expected {what}, got {json.dumps(v)[:40]}")
    return int(v) if integer else float(v)


def _choice(where: str, v: Any, options: tuple[str, ...]) -> str:
    if not isinstance(v, str) or v not in options:
        raise ProgramError(f"--device measured.{where}: expected one of {', '.join(options)}, got {json.dumps(v)[:40]}")
    return v


def _rows(obj: dict[str, Any], key: str, fields: dict[str, str]) -> list[dict[str, Any]]:
    """The objects of list ``key``, each with exactly ``fields`` (name -> kind: int, num, bool,
    dtype, op, scope), checked."""
    rows = obj.get(key, [])
    if not isinstance(rows, list):
        raise ProgramError(f"--device measured.{key}: expected a list")
    out = []
    for i, r in enumerate(rows):
        where = f"{key}[{i}]"
        if not isinstance(r, dict) or set(r) != set(fields):
            raise ProgramError(f"--device measured.{where}: expected an object with exactly "
                               f"{', '.join(fields)}")
        got: dict[str, Any] = {}
        for f, kind in fields.items():
            v, w = r[f], f"{where}.{f}"
            if kind == "int":
                got[f] = _pos(w, v, integer=True)
            elif kind == "num":
                got[f] = _pos(w, v)
            elif kind == "bool":
                if not isinstance(v, bool):
                    raise ProgramError(f"--device measured.{w}: expected true or false")
                got[f] = v
            else:
                got[f] = _choice(w, v, {"dtype": DTYPES, "op": COLLECTIVE_OPS, "scope": SCOPES}[kind])
        out.append(got)
    return out


def parse_measured(obj: Any) -> Measured:
    """A :class:`Measured` from a device file's ``"measured"`` object; ProgramError naming the
    field otherwise."""
    if not isinstance(obj, dict):
        raise ProgramError("--device measured: expected an object")
    unknown = sorted(set(obj) - {"source", "gemm", "attention", "hbm_gb_per_s", "collectives"})
    if unknown:
        raise ProgramError(f"--device measured: unknown field {unknown[0][:40]!r} "
                           f"(fields: attention, collectives, gemm, hbm_gb_per_s, source)")
    source = obj.get("source", "")
    if not isinstance(source, str):
        raise ProgramError("--device measured.source: expected a string")
    gemm = [GemmPoint(**r) for r in _rows(obj, "gemm", {"m": "int", "n": "int", "k": "int", "dtype": "dtype",
                                                        "tflops": "num"})]
    att = [AttentionPoint(**r) for r in _rows(obj, "attention", {
        "batch": "int", "heads": "int", "seq": "int", "head_dim": "int", "causal": "bool", "dtype": "dtype",
        "fwd_tflops": "num", "bwd_tflops": "num"})]
    coll = [CollectivePoint(**r) for r in _rows(obj, "collectives", {"op": "op", "ranks": "int", "scope": "scope",
                                                                     "bytes": "int", "time_us": "num"})]
    hbm = _pos("hbm_gb_per_s", obj["hbm_gb_per_s"]) if "hbm_gb_per_s" in obj else None
    return Measured(source[:200], tuple(gemm), tuple(att), hbm, tuple(coll))


__all__ = ["COLLECTIVE_OPS", "DTYPES", "SCOPES", "AttentionPoint", "CollectivePoint", "GemmPoint", "Measured",
           "parse_measured"]
