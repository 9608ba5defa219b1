"""spmdkit.rules: one module per op family; importing this package registers them all."""

from importlib import import_module

from spmdkit.rules.registry import (
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
RULE_MODULES = (
    "elementwise",
    "matmul",
    "norm",
    "reduction",
    "softmax",
    "transpose",
    "view",
    "default",
)

for _m in RULE_MODULES:
    import_module(f"spmdkit.rules.{_m}")

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
