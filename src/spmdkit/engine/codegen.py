"""The engine's one code generator: Python source text made into a function.

The rule functions (:mod:`spmdkit.engine.declare`), the compiled plans' fast paths
(:mod:`spmdkit.engine.compiler`) and the result cache's key functions
(:mod:`spmdkit.engine.cache_keys`) are straight-line Python written per declaration, plan or
signature. Each is compiled here, under a file name in angle brackets that says what it is
(``<rule matmul forward>``, ``<plan Notation('mk,kn->mn') forward>``, ``<cache key T, T>``: a
traceback through generated code names it), and executed into a namespace holding only the
names the source reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def define(source: str, what: str, name: str, namespace: Mapping[str, Any]) -> Any:
    """The function ``name`` that ``source`` defines, run in a copy of ``namespace`` (the
    globals of the generated code); ``what`` names the code in tracebacks (``<what>``)."""
    ns = dict(namespace)
    exec(compile(source, f"<{what}>", "exec"), ns)
    return ns[name]


__all__ = ["define"]
