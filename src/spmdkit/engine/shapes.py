"""Declared shape and attribute checks: what a rule's ``Way(shapes=..., require=...)`` says,
turned into straight-line code the generated rule function runs (no parsing per call).

``shapes``: ``;``-separated entries ``name: axes`` over the mode's tensor parameters, the axes
separated by spaces:

* a name (``b``, ``k``, ``seq``): a size; every axis with that name must have one size (``-1``,
  an unknown size, matches any);
* an integer: that size (``boxes: r 4``);
* ``_``: any size;
* ``...``: any number of axes (at most one per entry): the named axes after it count from the
  end, the rank check is "at least".

``x: b m k; y: b k n; out_grad: b m n`` checks that x, y and out_grad are 3-D and that the
sizes agree, raising :class:`~spmdkit.core.errors.ShapeMismatchError` naming the op, the tensor,
the axis and the other tensor's axis it disagrees with. An optional tensor (``T?``) is checked
where given. Entries are checked in order: each tensor's rank, then each size.

``require``: conditions over the parameters, each a Python expression (``"groups >= 1"``), or a
pair (condition, what is wrong) where "needs <condition>" would not say it; where one is false
the call raises :class:`~spmdkit.core.errors.InvalidAttributeError` naming the op, the condition
(or what is wrong) and the values of the parameters it reads.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def mismatch(a: Sequence[int], b: Sequence[int], skip: Sequence[int] = ()) -> int | None:
    """Where shape ``b`` differs from shape ``a``: None where it does not (an unknown size, -1,
    matches any; the axes in ``skip`` are not compared), -1 where the ranks differ, else the
    first axis whose sizes differ. The one comparison behind every same-shape check."""
    if len(a) != len(b):
        return -1
    for i, (s, t) in enumerate(zip(a, b)):
        if s != t and s >= 0 and t >= 0 and i not in skip:
            return i
    return None


def rank_error(op: str, name: str, shape: Sequence[int], want: int, at_least: bool) -> ShapeMismatchError:
    """``name`` has the wrong rank."""
    return ShapeMismatchError(
        f"{op}: {name} must be {'at least ' if at_least else ''}{want}-D, got shape {list(shape)}"
    )


def size_error(op: str, axis: str, items: Sequence[tuple[str, int, Sequence[int]]]) -> ShapeMismatchError | None:
    """The error where the known sizes of ``items`` (``(tensor, axis, shape)``: every axis named
    ``axis``) disagree, else None (unknown sizes, -1, match any)."""
    first: tuple[str, int, Sequence[int]] | None = None
    for name, i, shape in items:
        s = shape[i]
        if s < 0:
            continue
        if first is None:
            first = (name, i, shape)
        elif s != first[2][first[1]]:
            n0, i0, s0 = first
            return ShapeMismatchError(
                f"{op}: {_of(name)} axis {_axis(i, shape)} ({axis}) is {s} but {_of(n0)} axis {_axis(i0, s0)} is "
                f"{s0[i0]} ({name} {list(shape)}, {n0} {list(s0)})"
            )
    return None


def fixed_error(op: str, name: str, i: int, shape: Sequence[int], want: int) -> ShapeMismatchError:
    return ShapeMismatchError(f"{op}: {_of(name)} axis {_axis(i, shape)} must be {want}, got shape {list(shape)}")


def require_error(op: str, cond: str, values: Sequence[tuple[str, Any]], what: str = "") -> InvalidAttributeError:
    """``cond`` is false: ``what`` (default: "needs <cond>") and the values of the parameters it reads."""
    got = ", ".join(
        f"{_of(n)} shape = {list(v.shape)}" if hasattr(v, "dist_attr") else f"{n} = {v!r}" for n, v in values
    )
    return InvalidAttributeError(f"{op}: {what or 'needs ' + cond}, got {got}")


def _of(name: str) -> str:
    """``name``'s possessive: ``x's``, ``boxes'``."""
    return name + ("'" if name.endswith("s") else "'s")


def _axis(i: int, shape: Sequence[int]) -> int:
    return i + len(shape) if i < 0 else i


def _entries(op: str, spec: str, kinds: dict[str, str]) -> list[tuple[str, list[str], int]]:
    """``(tensor, axis tokens, index of ...  or -1)`` per entry, checked against the signature."""
    out = []
    for part in spec.split(";"):
        if not part.strip():
            continue
        name, sep, axes = part.partition(":")
        name = name.strip()
        toks = axes.split()
        if not sep or kinds.get(name) not in ("T", "T?"):
            raise ValueError(f"{op}: shapes entry {part.strip()!r} names no single tensor parameter")
        for t in toks:
            if t not in ("_", "...") and not _NAME.fullmatch(t) and not t.isdigit():
                raise ValueError(f"{op}: shapes entry {part.strip()!r}: bad axis {t!r}")
        if toks.count("...") > 1:
            raise ValueError(f"{op}: shapes entry {part.strip()!r} has more than one '...'")
        out.append((name, toks, toks.index("...") if "..." in toks else -1))
    return out


def shape_lines(op: str, spec: str, kinds: dict[str, str], indent: str) -> list[str]:
    """The generated code checking ``spec`` (module docstring) for a function whose parameters
    have ``kinds`` (``parse_signature``'s); it uses the names ``_OP``, ``_rank_error``,
    ``_size_error`` and ``_fixed_error`` of the generated module."""
    lines: list[str] = []
    by_name: dict[str, list[tuple[str, int]]] = {}
    for name, toks, ell in _entries(op, spec, kinds):
        opt = kinds[name] == "T?"
        pre = f"{name} is not None and " if opt else ""
        n = len(toks) - (ell >= 0)
        cmp = "<" if ell >= 0 else "!="
        lines.append(
            f"{indent}if {pre}len({name}.shape) {cmp} {n}: raise _rank_error(_OP, {name!r}, {name}.shape, {n}, {ell >= 0})"
        )
        for j, t in enumerate(toks):
            if t in ("_", "..."):
                continue
            i = j if ell < 0 or j < ell else j - len(toks)
            if t.isdigit():
                lines.append(
                    f"{indent}if {pre}{name}.shape[{i}] != {t} and {name}.shape[{i}] >= 0: "
                    f"raise _fixed_error(_OP, {name!r}, {i}, {name}.shape, {t})"
                )
            else:
                by_name.setdefault(t, []).append((name, i))
    for axis, occ in by_name.items():
        if len(occ) < 2:
            continue
        vals = [
            f"{n}.shape[{i}]" if kinds[n] == "T" else f"({n}.shape[{i}] if {n} is not None else -1)" for n, i in occ
        ]
        cond = " or ".join(f"{vals[0]} != {v}" for v in vals[1:])
        items = "".join(f"({n!r}, {i}, {n}.shape if {n} is not None else (-1,) * {abs(i) + 1}), " for n, i in occ)
        lines.append(f"{indent}if {cond}:")
        lines.append(f"{indent}    _e = _size_error(_OP, {axis!r}, ({items}))")
        lines.append(f"{indent}    if _e is not None: raise _e")
    return lines


def require_lines(conds: Sequence[str | tuple[str, str]], params: Sequence[str], indent: str) -> list[str]:
    """The generated code raising InvalidAttributeError where a condition of ``conds`` is false
    (an item: the condition, or ``(condition, what is wrong)`` for the message; uses ``_OP`` and
    ``_require_error``)."""
    lines = []
    for item in conds:
        c, what = (item, "") if isinstance(item, str) else item
        used = [n for n in dict.fromkeys(_NAME.findall(c)) if n in params]
        vals = "".join(f"({n!r}, {n}), " for n in used)
        lines.append(f"{indent}if not ({c}): raise _require_error(_OP, {c!r}, ({vals}), {what!r})")
    return lines


NAMESPACE = {"_rank_error": rank_error, "_size_error": size_error, "_fixed_error": fixed_error,
             "_require_error": require_error}  # fmt: skip

__all__ = [
    "NAMESPACE",
    "fixed_error",
    "mismatch",
    "rank_error",
    "require_error",
    "require_lines",
    "shape_lines",
    "size_error",
]
