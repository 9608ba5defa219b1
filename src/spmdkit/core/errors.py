"""The library's error hierarchy: every error spmdkit raises is an :class:`SpmdError`.

A message is at most :data:`MAX_MESSAGE_CHARS` characters: a longer one (a rule that echoes a
two-million-entry dims_mapping) keeps its head and tail and says how much was elided, so no error
anywhere carries an unbounded echo of its input.
"""

from __future__ import annotations

from typing import Any

#: The longest error message kept whole; a longer one has its middle elided.
MAX_MESSAGE_CHARS = 600
_HEAD = 400
_TAIL = 150


def bounded(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` if it is at most ``limit`` characters, else its head and tail around a note of
    how many characters were elided."""
    if len(text) <= limit:
        return text
    head = max(1, limit * _HEAD // MAX_MESSAGE_CHARS)
    tail = max(1, limit * _TAIL // MAX_MESSAGE_CHARS)
    return f"{text[:head]} ... ({len(text) - head - tail} characters elided) ... {text[-tail:]}"


class SpmdError(Exception):
    """Base class of every error spmdkit raises on bad input."""

    def __init__(self, *args: Any) -> None:
        if args and isinstance(args[0], str) and len(args[0]) > MAX_MESSAGE_CHARS:
            args = (bounded(args[0]), *args[1:])
        super().__init__(*args)
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


class InternalError(SpmdError):
    """An unforeseen failure while answering (``infer --batch`` reports it on the case's line,
    naming the original exception type, instead of ending the process)."""


class ProgramError(SpmdError):
    """A program (spmdkit.program) is malformed: unknown rule, dangling or twice-produced tensor,
    shapes the op's rule rejects, or an annotation that does not fit its tensor."""


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
    "ProgramError",
    "InternalError",
    "MAX_MESSAGE_CHARS",
    "bounded",
]
