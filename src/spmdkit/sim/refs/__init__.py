"""The numpy references and case generators of the op families, one module per family, named as
the family's module in :mod:`spmdkit.ops` (a family without numeric references has none).

Each module registers its numpy references (:func:`spmdkit.sim.reference.register_reference`)
and, beside them, their case generators (``spmdkit.sim.cases.GENERATORS``); importing this
package imports them all (``spmdkit.sim`` does so on import).
"""

import pkgutil
from importlib import import_module

FAMILY_MODULES = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")))

for _m in FAMILY_MODULES:
    import_module(f"spmdkit.sim.refs.{_m}")

__all__ = ["FAMILY_MODULES"]
