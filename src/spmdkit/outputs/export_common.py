"""What every ``--export`` shares (:mod:`spmdkit.outputs.export` describes the formats): the
formats, :class:`ExportError`, the plan's parameters and their placements as text, and the target
checked and written atomically (a temporary file in the same folder, renamed over the path).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import SpmdError
from spmdkit.core.placements import Partial, Shard, to_placements
from spmdkit.io.atomic import output_problem, write_atomic
from spmdkit.program.plan import Plan
from spmdkit.strategies.hf_program import parameters

FORMATS = ("dtensor", "jax", "paddle")
#: every --export format: the JSON documents above and ``torch``, a Python module
#: (:mod:`spmdkit.outputs.export_torch`)
ALL_FORMATS = (*FORMATS, "torch")
#: The ``format`` field of each document.
DOC_FORMATS = {f: f"spmdkit-{f}-export" for f in FORMATS}
VERSION = 1


class ExportError(SpmdError):
    """A plan cannot be exported: an unknown format, an unwritable path, no parameters, or a
    sharding the target framework has no form for."""


# -- what the plan says --------------------------------------------------------------------------


def _parameters(plan: Plan, fmt: str) -> list[str]:
    names = parameters(plan.program)
    if not names:
        raise ExportError(f"--export {fmt}: the plan's program has no parameters (no tensor of kind "
                          f"'parameter'), so there is nothing to place")
    return names


def _mesh_doc(plan: Plan) -> dict[str, Any]:
    m = plan.mesh
    return {"dim_names": list(m.dim_names), "shape": list(m.shape), "process_ids": list(m.process_ids)}


def _placement_text(p: Any) -> str:
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, Partial):
        return f"Partial({p.reduce_op.value})"
    return "Replicate()"


def _placements(attr: TensorDistAttr, fmt: str, name: str) -> list[str]:
    try:
        return [_placement_text(p) for p in to_placements(attr)]
    except SpmdError as exc:
        raise ExportError(f"--export {fmt}: {name}: {exc}") from None


def check_target(fmt: str, path: str) -> None:
    """ExportError for an unknown format, or a path that is a folder or in no folder."""
    if fmt not in ALL_FORMATS:
        raise ExportError(f"--export {str(fmt)[:40]!r}: unknown format (one of {', '.join(ALL_FORMATS)})")
    _check_path(os.fspath(path), f"--export {fmt}")


def _check_path(p: str, what: str) -> None:
    """ExportError naming ``what`` unless ``p`` is a regular file or a new name in a folder
    (:func:`spmdkit.io.atomic.output_problem`: a FIFO, a device or a symbolic link is never
    replaced)."""
    folder = os.path.dirname(os.path.abspath(p))
    if not p or (os.path.isdir(p) and not os.path.islink(p)):
        raise ExportError(f"{what}: {p!r} is a folder, not a file path")
    if not os.path.isdir(folder):
        raise ExportError(f"{what}: cannot write {p!r}: the folder {folder!r} does not exist")
    problem = output_problem(p)
    if problem is not None:
        raise ExportError(f"{what} {p!r}: {problem}")


def write_json(doc: Mapping[str, Any], path: str, what: str = "--export") -> None:
    """Write ``doc`` to ``path`` atomically (a temporary file in the same folder, then renamed):
    a reader never sees half a file; ExportError naming the path when it cannot be written."""
    write_atomic_text(json.dumps(doc, indent=1) + "\n", path, what)


def write_atomic_text(text: str, path: str, what: str) -> None:
    """Write ``text`` to ``path`` atomically; ExportError naming the path when it cannot be written."""
    p = os.fspath(path)
    _check_path(p, what)
    try:
        write_atomic(p, text.encode("utf-8"))
    except OSError as exc:
        raise ExportError(f"{what}: cannot write {p!r}: {exc.strerror or exc}") from None


__all__ = ["ALL_FORMATS", "DOC_FORMATS", "FORMATS", "VERSION", "ExportError", "check_target", "write_atomic_text",
           "write_json"]
