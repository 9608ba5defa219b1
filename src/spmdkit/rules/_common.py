"""Helpers shared by the rule families: attribute and shape checks, the merge-then-project steps
over the engine's :mod:`spmdkit.engine.notation` (sorting, along_axis, moe, loss, reduction's
p_norm), a one-axis-replicated plan (:func:`axis_plan`) and einsum under ``coshard="largest"``
(:func:`forward_largest` / :func:`reverse_largest`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from spmdkit.core.dist_attr import ReduceType, TensorDistAttr
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import make_attr, one_mesh_dim_specs
from spmdkit.engine.compile import Plan, compile_plan
from spmdkit.engine.notation import (
    ALPHABET,
    BROADCAST,
    Notation,
    check_letters,
    einsum_backward,
    einsum_forward,
    fast_result,
    merge_specs,
    project,
    project_all,
)

Shape = tuple[int, ...]


# -- attribute and shape checks ----------------------------------------------------------------


def check_int(op: str, name: str, v: object, lo: int | None = None) -> int:
    """An int attribute (not a bool), at least ``lo`` where given."""
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidAttributeError(f"{op}: {name} must be an int, got {v!r}")
    if lo is not None and v < lo:
        raise InvalidAttributeError(f"{op}: {name} must be at least {lo}, got {v}")
    return v


def check_bool(op: str, name: str, v: object) -> bool:
    """A bool attribute (an int is read as one)."""
    if not isinstance(v, (bool, int)):
        raise InvalidAttributeError(f"{op}: {name} must be a bool, got {v!r}")
    return bool(v)


def check_ndim(op: str, name: str, t: DistTensorSpec, nd: int) -> None:
    if len(t.shape) != nd:
        raise ShapeMismatchError(f"{op}: {name} must be a {nd}-D tensor, got shape {list(t.shape)}")


def check_same_ndim(op: str, t: DistTensorSpec, n: int, name: str, what: str) -> None:
    if len(t.shape) != n:
        raise ShapeMismatchError(f"{op}: {name} has {len(t.shape)} dims, but {what} has {n}")


def check_same_shape(op: str, t: DistTensorSpec, shape: Shape, name: str, what: str) -> None:
    """``t`` has ``shape`` (unknown sizes, -1, match anything)."""
    check_same_ndim(op, t, len(shape), name, what)
    for i, (s, w) in enumerate(zip(t.shape, shape)):
        if s != w and s >= 0 and w >= 0:
            raise ShapeMismatchError(f"{op}: {name} axis {i} has size {s}, but {what} has {w}")


def check_like(op: str, a: DistTensorSpec, b: DistTensorSpec, na: str, nb: str) -> None:
    """``b`` has ``a``'s shape (unknown sizes, -1, match anything)."""
    if len(a.shape) != len(b.shape):
        raise ShapeMismatchError(f"{op}: {nb} has {len(b.shape)} dims, expected {len(a.shape)} (as {na})")
    for i, (s, t) in enumerate(zip(a.shape, b.shape)):
        if s != t and s >= 0 and t >= 0:
            raise ShapeMismatchError(f"{op}: {na} and {nb} differ on axis {i} ({s} vs {t})")


def letters(op: str, n: int) -> str:
    """The first ``n`` letters of the alphabet (ShapeMismatchError past 26 dims)."""
    if n > len(ALPHABET):
        raise ShapeMismatchError(f"{op}: tensors of more than {len(ALPHABET)} dims are not supported")
    return ALPHABET[:n]


# -- merge, then project -----------------------------------------------------------------------


def merge_project(
    notation: Notation,
    merge_axes: Sequence[str | None],
    specs: Sequence[DistTensorSpec | None],
    mesh: ProcessMesh,
) -> tuple[list[TensorDistAttr | None], list[TensorDistAttr | None]]:
    """Merge the letters of the tensors labelled ``merge_axes`` (None: not merged) with the
    notation's flags, and project every input and output of the notation."""
    return project_all(notation, merge_specs(notation, merge_axes, specs, mesh), mesh)


def merge_one_dim(op: str, notation: Notation, axes: Sequence[str | None], specs: Sequence[DistTensorSpec | None],
                  names: Sequence[str], mesh: ProcessMesh) -> dict[str, tuple[int, ...]]:
    """The merged letters of ``specs`` (labelled ``axes``), each co-shard read as its largest
    mesh dim first; ShapeMismatchError where one letter has two sizes."""
    check_letters(op, axes, specs, names)
    return dict(merge_specs(notation, axes, one_mesh_dim_specs(*specs), mesh))


def letter_attr(mesh: ProcessMesh, axes: str | None, letters: Mapping[str, tuple[int, ...]],
                partial_letters: str = "", reduce: ReduceType = ReduceType.SUM) -> TensorDistAttr | None:
    """The dist attr of a tensor labelled ``axes``; partial (``reduce``) over the mesh dims of
    ``partial_letters`` (letters the tensor lacks)."""
    if axes is None:
        return None
    pt: dict[int, ReduceType] = {}
    for ch in partial_letters:
        for d in letters.get(ch, ()):
            pt[d] = reduce
    return make_attr(mesh, project(axes, letters), tuple(sorted(pt.items())))


# -- one axis replicated ------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def axis_plan(nd: int, ax: int, n_in: int, n_out: int, coshard: str = "keep", source: int = -1,
              direction: str = "forward") -> Plan:
    """``abc, ... -> abc, ...`` (``n_in`` / ``n_out`` tensors of one rank) with axis ``ax``
    replicated; ``source``: the one input merged (-1: all)."""
    a = ALPHABET[:nd]
    nt = Notation([a] * n_in, [a] * n_out, replicated=a[ax : ax + 1], coshard=coshard,
                  sources=None if source < 0 else (source,))  # fmt: skip
    return compile_plan(nt, direction)


@lru_cache(maxsize=1024)
def replicated_plan(ins: tuple[int, ...], outs: tuple[int, ...]) -> Plan:
    """Every tensor unsharded: each labelled ``1`` per axis (rank -1: an absent tensor)."""

    def lab(r: int) -> str | None:
        return None if r < 0 else BROADCAST * r

    return compile_plan(Notation([lab(r) for r in ins], [lab(r) for r in outs]))


# -- einsum with Paddle's reading of a co-shard ------------------------------------------------


@lru_cache(maxsize=4096)
def largest(notation: Notation) -> Notation:
    """``notation`` with ``coshard="largest"``: each co-shard read as its largest mesh dim."""
    return notation.replace(coshard="largest")


def forward_largest(op: str, notation: Notation, specs: Sequence[DistTensorSpec | None],
                    names: Sequence[str]) -> SpmdResult:
    """einsum_forward over ``specs`` under the notation with ``coshard="largest"``."""
    ins, outs = einsum_forward(op, largest(notation), specs, names)
    return fast_result(tuple(ins), tuple(outs))


def reverse_largest(op: str, notation: Notation, inputs: Sequence[DistTensorSpec | None],
                    outputs: Sequence[DistTensorSpec | None], names: Sequence[str]) -> SpmdResult:
    """einsum_backward from ``outputs`` under the notation with ``coshard="largest"``."""
    ins, outs = einsum_backward(op, largest(notation), inputs, outputs, names)
    return fast_result(tuple(ins), tuple(outs))


# -- small declaration helpers ------------------------------------------------------------------


def op_rule(op: str, fn: Callable[..., SpmdResult], doc: str) -> Callable[..., SpmdResult]:
    """``fn(op, *args)`` as a rule function named ``op``: one body for a grad rule registered both
    in its forward op's backward slot and as a rule of its own, its errors naming the op called."""

    def rule(*args: Any) -> SpmdResult:
        return fn(op, *args)

    rule.__name__ = rule.__qualname__ = op
    rule.__doc__ = doc
    rule.__module__ = fn.__module__  # the family that declares it (README tables, docs)
    return rule
