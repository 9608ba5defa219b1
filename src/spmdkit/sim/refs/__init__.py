"""Simulator references and case generators of the later op families, one module per family.

Each module registers its numpy references (``spmdkit.sim.ops.register_reference``) and adds
its case generators to ``spmdkit.sim.cases.GENERATORS``; importing this package imports them
all (``spmdkit.sim`` does so on import).
"""

import pkgutil
from importlib import import_module

FAMILY_MODULES = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))

for _m in FAMILY_MODULES:
    import_module(f"spmdkit.sim.refs.{_m}")

__all__ = ["FAMILY_MODULES"]
