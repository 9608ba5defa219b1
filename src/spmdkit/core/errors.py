"""The library's error hierarchy: every error spmdkit raises is an :class:`SpmdError`."""

from __future__ import annotations


class SpmdError(Exception):
    """Base class of every error spmdkit raises on bad input."""


class InvalidMeshError(SpmdError):
    """A process mesh is malformed (shape, process ids, dim names) or two tensors disagree on it."""


class InvalidDimsMappingError(SpmdError):
    """A dims_mapping is malformed: wrong length, mesh dim out of range or used twice."""


class InvalidPartialError(SpmdError):
    """A partial status is malformed: unknown reduce type, mesh dim out of range or also sharding."""


class ShapeMismatchError(SpmdError):
    """Tensor shapes are inconsistent with each other or with the op."""


class InvalidAttributeError(SpmdError):
    """An op attribute has the wrong type or a value out of its range."""


class InvalidArgumentError(SpmdError):
    """A rule was called with the wrong number or kind of arguments."""


class UnknownRuleError(SpmdError):
    """No rule is registered under the requested name."""


class ConflictError(SpmdError):
    """Shardings that cannot be reconciled."""


class UnsupportedModeError(SpmdError):
    """The rule has no function for the requested mode (forward / backward)."""


class CaseFormatError(SpmdError):
    """A JSON case (INTERFACE.md) is malformed."""


__all__ = [
    "SpmdError",
    "InvalidMeshError",
    "InvalidDimsMappingError",
    "InvalidPartialError",
    "ShapeMismatchError",
    "InvalidAttributeError",
    "InvalidArgumentError",
    "UnknownRuleError",
    "ConflictError",
    "UnsupportedModeError",
    "CaseFormatError",
]


class ProgramError(SpmdError):
    """A program (spmdkit.graph) is malformed: unknown rule, dangling or twice-produced tensor,
    shapes the op's rule rejects, or an annotation that does not fit its tensor."""
