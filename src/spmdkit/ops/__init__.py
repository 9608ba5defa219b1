"""spmdkit.ops: one module per op family; importing this package registers them all.

The families of the foundation are imported in a fixed order (RULE_MODULES); every other
module of this package (one per later op family) is imported after them, by name.
"""

import pkgutil
from importlib import import_module

from spmdkit.engine.registry import (
    Rule,
    all_rules,
    clear_cache,
    get_rule,
    has_rule,
    register,
    rule_names,
    set_cache_enabled,
)

#: The rule modules, imported (and so registered) in this order.
RULE_MODULES = ("elementwise", "matmul", "norm", "reduction", "softmax", "transpose", "view", "default")

_LATER = sorted(m.name for m in pkgutil.iter_modules(__path__)
                if m.name not in RULE_MODULES and not m.name.startswith("_"))

for _m in (*RULE_MODULES, *_LATER):
    import_module(f"spmdkit.ops.{_m}")

__all__ = [
    "Rule",
    "all_rules",
    "clear_cache",
    "get_rule",
    "has_rule",
    "register",
    "rule_names",
    "set_cache_enabled",
    "RULE_MODULES",
]
