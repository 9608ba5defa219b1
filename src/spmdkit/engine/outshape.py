"""What an op family's shape function reads and answers, and the helpers the families share.

An op family (``spmdkit.ops.*``) declares, beside each rule, the global output shapes the op
makes from its input shapes and attributes: ``facts(<rule names>, shape=fn)``
(:mod:`spmdkit.engine.facts`), where ``fn`` takes the op's forward arguments as :class:`Args`
and answers one :data:`Expect` per output. :meth:`spmdkit.program.ir.Program.validate`
calls it (through :mod:`spmdkit.program.shapes`) and refuses a program whose declared output
shapes contradict it.

Each answer is a tuple with, per axis, the size (an int) or ``None`` where the size is not
fixed by the shapes and attributes the rule sees (it depends on the data, or on an attribute
the rule does not take); a whole output is ``None`` where nothing is checked. A shape function
raises :class:`UnknownShape` (or lets an ``IndexError``, ``KeyError``, ``TypeError``,
``ValueError``, ``ZeroDivisionError`` or ``AttributeError`` out) where the shape is not fixed by
what it sees: every output is then unchecked. Any doubt answers ``None``: a valid program is
never refused.

Shape semantics follow Paddle 3.3.1's InferMeta (paddle/phi/infermeta) as the rules and the
numpy references (spmdkit.sim) implement them. Standard library only; the engine knows
nothing of particular ops.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

Shape = tuple[int | None, ...]
#: One output's expected shape: None (unchecked), a Shape, or a list of them (a vector output).
Expect = Union[None, Shape, list[Shape | None]]


class UnknownShape(Exception):
    """The shape is not fixed by what the shape function sees: every output is unchecked."""


class Args:
    """The op's forward arguments by parameter name: tensors as shapes (tuples of ints), an
    absent optional as None, a vector as a list; attributes as the rule coerces them.
    ``ndims``: the rule's output ranks (None for an output it does not make)."""

    def __init__(self, values: Mapping[str, Any], tensor_params: Sequence[str], ndims: Sequence[Any]) -> None:
        self.values = values
        self.tensor_params = list(tensor_params)
        self.ndims = list(ndims)

    def s(self, name: str) -> tuple[int, ...]:
        v = self.values.get(name)
        if not isinstance(v, tuple):
            raise UnknownShape
        return v

    def opt(self, name: str) -> tuple[int, ...] | None:
        v = self.values.get(name)
        return v if isinstance(v, tuple) else None

    def vec(self, name: str) -> list[tuple[int, ...] | None]:
        v = self.values.get(name)
        if not isinstance(v, list):
            raise UnknownShape
        return v

    def a(self, name: str, default: Any = None) -> Any:
        return self.values.get(name, default)

    def first(self) -> tuple[int, ...]:
        return self.s(self.tensor_params[0])

    def nd(self, i: int) -> int | None:
        nd: int | None = self.ndims[i] if i < len(self.ndims) else None
        return nd


#: A family's shape function: the op's arguments -> one Expect per output.
ShapeFn = Callable[[Args], Sequence[Expect]]


def axis_of(ax: Any, nd: int) -> int:
    """An axis attribute (an int, or a one-item list) as an index into ``nd`` axes."""
    if isinstance(ax, (list, tuple)):
        if len(ax) != 1:
            raise UnknownShape
        ax = ax[0]
    if not isinstance(ax, int) or isinstance(ax, bool) or not -max(nd, 1) <= ax < max(nd, 1):
        raise UnknownShape
    return ax % nd if nd else 0


def broadcast(*shapes: Sequence[int]) -> tuple[int, ...]:
    """Numpy broadcasting of shapes (``UnknownShape`` where they do not broadcast)."""
    nd = max((len(s) for s in shapes), default=0)
    out: list[int] = []
    for i in range(nd):
        size = 1
        for s in shapes:
            k = len(s) - nd + i
            if k < 0:
                continue
            v = s[k]
            if v == 1:
                continue
            if size not in (1, v):
                raise UnknownShape
            size = v
        out.append(size)
    return tuple(out)


def same(a: Args) -> list[Expect]:
    """Every output has the shape of the first tensor input."""
    return [a.first() for _ in range(max(len(a.ndims), 1))]


def scalar(a: Args) -> list[Expect]:
    """One 0-D output."""
    return [()]


def reduce_shape(s: tuple[int, ...], axes: Any, keep: bool, reduce_all: bool = False) -> tuple[int, ...]:
    """``s`` reduced over ``axes`` (an int or a list; none, or ``reduce_all``: every axis), the
    reduced axes kept as 1 where ``keep``."""
    nd = len(s)
    if isinstance(axes, int) and not isinstance(axes, bool):
        axes = (axes,)
    axes = tuple(axes or ())
    if reduce_all or not axes or nd == 0:
        red = set(range(nd))
    else:
        red = set()
        for ax in axes:
            if not isinstance(ax, int) or not -nd <= ax < nd:
                raise UnknownShape
            red.add(ax % nd)
    if keep:
        return tuple(1 if i in red else v for i, v in enumerate(s))
    return tuple(v for i, v in enumerate(s) if i not in red)


def reduced(a: Args) -> list[Expect]:
    """A reduction of x over ``axis`` (``keep_dim`` or ``keepdims``, ``reduce_all``)."""
    keep = a.a("keep_dim", a.a("keepdims", False))
    return [reduce_shape(a.s("x"), a.a("axis", ()), bool(keep), bool(a.a("reduce_all", False)))]


def over_axis_or_all(flag: str) -> Callable[[Args], list[Expect]]:
    """A reduction of x over one ``axis``, or over every axis where the attribute ``flag`` is set
    (argmin / argmax's ``flatten``, p_norm's ``asvector``)."""

    def expect(a: Args) -> list[Expect]:
        x = a.s("x")
        keep = bool(a.a("keepdims", False))
        if a.a(flag, False):
            return [(1,) * len(x) if keep else ()]
        return [reduce_shape(x, (a.a("axis", -1),), keep)]

    return expect


__all__ = ["Args", "Expect", "Shape", "ShapeFn", "UnknownShape", "axis_of", "broadcast", "over_axis_or_all",
           "reduce_shape", "reduced", "same", "scalar"]
