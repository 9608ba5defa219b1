"""spmdkit.sim: the numeric SPMD simulator, the judge of rule soundness (needs numpy).

    >>> from spmdkit.sim import verify
    >>> verify("matmul", {"mesh": [2], "args": [{"shape": [4, 6], "dims_mapping": [-1, 0]},
    ...                                         {"shape": [6, 3]}, False, False]}).status
    'sound'

``shard`` / ``assemble`` move arrays between the global view and the ranks of a
simulated mesh; ``spmdkit.sim.reference`` holds the machinery of the numpy references and
``spmdkit.sim.refs`` the references themselves with their case generators, one module per op
family (named as in ``spmdkit.ops``); ``spmdkit.sim.cases`` generates seeded cases; ``verify``
judges one answer and ``verify_rule`` many. See docs/simulator.md.
"""

from spmdkit.sim import refs as _refs  # noqa: F401  (registers the families' references)
from spmdkit.sim.cases import generate_case, generate_cases
from spmdkit.sim.mesh import AssembleError, assemble, balanced_split, local_slices, shard
from spmdkit.sim.reference import Ctx, Reference, get_reference, reference_names, register_reference
from spmdkit.sim.verify import (
    REJECTED,
    SKIPPED,
    SOUND,
    UNSOUND,
    RuleReport,
    Verdict,
    verifiable_rules,
    verify,
    verify_rule,
)

__all__ = [
    "AssembleError",
    "Ctx",
    "REJECTED",
    "Reference",
    "RuleReport",
    "SKIPPED",
    "SOUND",
    "UNSOUND",
    "Verdict",
    "assemble",
    "balanced_split",
    "generate_case",
    "generate_cases",
    "get_reference",
    "local_slices",
    "reference_names",
    "register_reference",
    "shard",
    "verifiable_rules",
    "verify",
    "verify_rule",
]
