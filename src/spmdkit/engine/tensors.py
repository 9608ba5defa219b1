"""The call's tensors and the answer's dist attrs, for the generated rule functions and the
compiled plans: the one mesh of a call, the letters' sizes agreeing, and unvalidated
constructors of the answer (an engine answer is valid by construction).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from spmdkit.core.dist_attr import DimsMapping, Partial, TensorDistAttr
from spmdkit.core.errors import InvalidMeshError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.notation import BROADCAST


def common_mesh(op: str, specs: Iterable[DistTensorSpec | None]) -> ProcessMesh:
    mesh: ProcessMesh | None = None
    for s in specs:
        if s is None:
            continue
        m = s.dist_attr.mesh
        if mesh is None:
            mesh = m
        elif m is not mesh and m != mesh:
            raise InvalidMeshError(f"{op}: the tensors lie on different meshes ({mesh!r} and {m!r})")
    if mesh is None:
        raise InvalidMeshError(f"{op}: no tensor given, so no mesh")
    return mesh


def named_mesh(op: str, named: Iterable[tuple[str, DistTensorSpec | None]]) -> ProcessMesh:
    """The one mesh of the named tensors (absent ones skipped); InvalidMeshError naming the two
    tensors that disagree."""
    mesh: ProcessMesh | None = None
    first = ""
    for name, t in named:
        if t is None:
            continue
        m = t.dist_attr.mesh
        if mesh is None:
            mesh, first = m, name
        elif m is not mesh and m != mesh:
            raise InvalidMeshError(f"{op}: {name} lies on a different mesh than {first} ({m!r} vs {mesh!r})")
    if mesh is None:
        raise InvalidMeshError(f"{op}: no tensor given, so no mesh")
    return mesh


def check_letters(
    op: str,
    axes: Sequence[str | None],
    specs: Sequence[DistTensorSpec | None],
    names: Sequence[str] | None = None,
) -> None:
    """Raise ShapeMismatchError where one letter has two sizes (size 1 and -1 excepted)."""
    seen: dict[str, int] = {}
    where: dict[str, int] = {}
    ti = -1
    for t_axes, s in zip(axes, specs):
        ti += 1
        if t_axes is None or s is None:
            continue
        shape = s.shape
        if len(t_axes) != len(shape):
            nm = names[ti] if names else f"tensor {ti}"
            raise ShapeMismatchError(f"{op}: {nm} has {len(shape)} dims, expected {len(t_axes)}")
        i = -1
        for ch in t_axes:
            i += 1
            if ch == BROADCAST:
                continue
            size = shape[i]
            if size < 0:
                continue
            prev = seen.get(ch)
            if prev is None:
                seen[ch] = size
                where[ch] = ti
            elif prev != size:
                pi = where[ch]
                a = names[pi] if names else f"tensor {pi}"
                b = names[ti] if names else f"tensor {ti}"
                raise ShapeMismatchError(
                    f"{op}: axis sizes disagree: {a} has {prev} and {b} has {size} on the same axis"
                )


def with_partial(attr: TensorDistAttr, partial: Partial) -> TensorDistAttr:
    """A copy of ``attr`` with extra partial mesh dims (engine-internal, no validation)."""
    if not partial:
        return attr
    merged = dict(attr.partial)
    merged.update(partial)
    return TensorDistAttr._make(attr.mesh, attr.dims_mapping, tuple(sorted(merged.items())))


# ---------------------------------------------------------------------------
# unvalidated constructors for the rules' hot paths
# ---------------------------------------------------------------------------

_new = object.__new__
_set_inputs = SpmdResult.__dict__["inputs"].__set__
_set_outputs = SpmdResult.__dict__["outputs"].__set__
_set_result_hash = SpmdResult.__dict__["_hash"].__set__
_make_attr = TensorDistAttr._make


def fast_result(
    inputs: tuple[TensorDistAttr | None, ...], outputs: tuple[TensorDistAttr | None, ...]
) -> SpmdResult:
    """``SpmdResult(inputs, outputs)`` for tuples of dist attrs (or None), unvalidated."""
    r = _new(SpmdResult)
    _set_inputs(r, inputs)
    _set_outputs(r, outputs)
    _set_result_hash(r, None)
    return r


def attr_as(src: TensorDistAttr, mesh: ProcessMesh, dims_mapping: DimsMapping) -> TensorDistAttr:
    """``TensorDistAttr._make(mesh, dims_mapping)``, or ``src`` itself where it is that attr
    already (dist attrs are immutable, so the answer is the same)."""
    if src.mesh is mesh and not src.partial and src.dims_mapping == dims_mapping:
        return src
    return _make_attr(mesh, dims_mapping)
