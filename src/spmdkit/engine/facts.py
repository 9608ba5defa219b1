"""What an op means besides its sharding rule, declared by its family beside the rule.

An op family module (``spmdkit.ops.*``) declares its rules with :func:`spmdkit.engine.declare.declare`
and, beside each, the op's other facts with :func:`facts`:

* ``shape``: the global output shapes the op makes from its input shapes and attributes
  (``Program.validate`` refuses a program whose declared output shapes contradict its op);
* ``cost``: the op's FLOPs and bytes on one device from its local (sharded) tensors, and the
  collectives its kernel runs inside itself (the cost model times them);
* ``wrt``: the inputs the op is differentiated against, and the grad op that does it (autodiff);
  ``grad_reads``: the grad op's parameters that read a forward output of another name;
* ``unchecked``: why an output's shape is not (fully) checked (its size is not fixed by the
  shapes and attributes: data-dependent sizes, kernel workspace);
* ``grad_like``: for a grad rule without a ``shape``, the tensor parameter each output has the
  shape of, where deriving it from the base rule's signature does not say
  (:mod:`spmdkit.program.shapes`).

Shape functions take and answer the types of :mod:`spmdkit.engine.outshape`.

The engine only keeps the table: it knows nothing of particular ops, and the layers above
(program, cost) read it through :func:`facts_of`. Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OpFacts:
    """One rule's facts; a field is None where the family declares none."""

    shape: Callable[..., Any] | None = None
    cost: Callable[..., Any] | None = None
    grad: str | None = None
    wrt: tuple[str, ...] | None = None
    grad_reads: tuple[tuple[str, str], ...] | None = None
    unchecked: str | None = None
    grad_like: tuple[str, ...] | None = None


_FACTS: dict[str, OpFacts] = {}


def facts(*names: str, shape: Callable[..., Any] | None = None, cost: Callable[..., Any] | None = None,
          grad: str | None = None, wrt: tuple[str, ...] | None = None,
          grad_reads: tuple[tuple[str, str], ...] | None = None, unchecked: str | None = None,
          grad_like: tuple[str, ...] | None = None) -> None:
    """Declare facts of the rules ``names`` (a fact given again for a name replaces the earlier one;
    facts not given keep what an earlier call declared)."""
    if not names:
        raise ValueError("facts() needs at least one rule name")
    for name in names:
        old = _FACTS.get(name, _NONE)
        _FACTS[name] = OpFacts(shape if shape is not None else old.shape, cost if cost is not None else old.cost,
                               grad if grad is not None else old.grad, wrt if wrt is not None else old.wrt,
                               grad_reads if grad_reads is not None else old.grad_reads,
                               unchecked if unchecked is not None else old.unchecked,
                               grad_like if grad_like is not None else old.grad_like)


def facts_of(name: str) -> OpFacts:
    """The facts declared for rule ``name`` (the canonical name: resolve aliases first); an empty
    :class:`OpFacts` where none are."""
    return _FACTS.get(name) or _NONE


def declared() -> frozenset[str]:
    """Every rule name with facts declared."""
    return frozenset(_FACTS)


_NONE = OpFacts()

__all__ = ["OpFacts", "declared", "facts", "facts_of"]
