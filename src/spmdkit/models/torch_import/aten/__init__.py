"""The importer's built-in lowerings of ATen ops, one module per op family with the file names of
:mod:`spmdkit.ops` (the family of the rules a lowering emits, for the ops that lower to one
family): each module's ``ATEN`` table maps ATen ops (packets, or overloads) to their hooks, and
:data:`BUILTIN` is all of them."""

from __future__ import annotations

import pkgutil
from importlib import import_module

from spmdkit.models.torch_import.context import Hook

#: the family modules, each imported in name order, each with its ``ATEN`` table
FAMILIES = tuple(import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__)
                 if not m.name.startswith("_"))


def _builtin() -> dict[str, Hook]:
    table: dict[str, Hook] = {}
    for fam in FAMILIES:
        twice = set(table) & set(fam.ATEN)
        if twice:
            raise RuntimeError(f"torch import: {fam.__name__} maps {', '.join(sorted(twice))} again")
        table.update(fam.ATEN)
    return table


#: every built-in lowering: ATen op (packet or overload) -> its hook
BUILTIN = _builtin()


def mapped_ops() -> list[str]:
    """The ATen ops (packets) the importer maps itself."""
    return sorted(BUILTIN)


__all__ = ["BUILTIN", "FAMILIES", "mapped_ops"]
