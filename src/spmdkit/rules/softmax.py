"""softmax, log_softmax and their grads.

Notation (Paddle 3.3.1's ``softmax.cc``): ``abc -> abc`` with the softmax axis kept
replicated (sharding it would need a cross-rank max / sum). Paddle 3.3.1 drops, on
the output, the mesh dims that do not divide an axis (minor co-shard dims first)
but keeps them on x (unsound, DESIGN class 3); spmdkit drops them on x too, so x
and out agree. A 0-d x is replicated (Paddle crashes on it). The reverse rule
infers x from out the same way and returns the out that x produces (Paddle
returns the requested out, DESIGN class 4).

Grads (SoftmaxGradInferSpmd(out, out_grad, axis), also for log_softmax_grad):
``abc, abc -> abc`` with the axis replicated; out and out_grad are merged as an
elementwise binary op (a tensor axis sharded differently by the two: out's
sharding wins), x_grad is sharded as they are. Partial inputs are made replicated.
"""

from __future__ import annotations

from spmdkit.core.dist_attr import DimsMapping, Entry, TensorDistAttr, entry_dims
from spmdkit.core.errors import InvalidAttributeError, InvalidMeshError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.memo import memo
from spmdkit.rules.registry import register

Shape = tuple[int, ...]


def _axis(op: str, axis: int, ndim: int) -> int:
    if ndim == 0:
        if axis not in (0, -1):
            raise InvalidAttributeError(f"{op}: axis {axis} is out of range for a 0-d tensor (0 or -1)")
        return -1
    if not -ndim <= axis < ndim:
        raise InvalidAttributeError(f"{op}: axis {axis} is out of range for a {ndim}-D tensor [{-ndim}, {ndim})")
    return axis + ndim if axis < 0 else axis


def _prod(mesh_shape: Shape, dims: tuple[int, ...]) -> int:
    p = 1
    for d in dims:
        p *= mesh_shape[d]
    return p


@memo()
def _infer(shape: Shape, dm: DimsMapping, axis: int, mesh_shape: Shape, prune: bool) -> DimsMapping:
    """The softmax axis replicated, every other uneven mesh dim dropped (minor first)."""
    out: list[Entry] = []
    for i, e in enumerate(dm):
        if i == axis or e == -1:
            out.append(-1)
            continue
        d = entry_dims(e)
        size = shape[i]
        if prune and size >= 0:
            while d and size % _prod(mesh_shape, d) != 0:
                d = d[:-1]
        out.append(-1 if not d else d[0] if len(d) == 1 else d)
    return tuple(out)


def _check_same(op: str, a: DistTensorSpec, b: DistTensorSpec, na: str, nb: str) -> None:
    if b.dist_attr.mesh != a.dist_attr.mesh:
        raise InvalidMeshError(f"{op}: {na} and {nb} lie on different meshes")
    if len(a.shape) != len(b.shape):
        raise ShapeMismatchError(f"{op}: {nb} has {len(b.shape)} dims but {na} has {len(a.shape)}")
    for i, (s, t) in enumerate(zip(a.shape, b.shape)):
        if s != t and s >= 0 and t >= 0:
            raise ShapeMismatchError(f"{op}: {na} and {nb} differ on axis {i} ({s} vs {t})")


def _make_forward(op: str):  # type: ignore[no-untyped-def]
    def forward(x: DistTensorSpec, axis: int = -1) -> SpmdResult:
        mesh = x.dist_attr.mesh
        ax = _axis(op, axis, len(x.shape))
        dm = _infer(x.shape, x.dist_attr.dims_mapping, ax, mesh.shape, True)
        a = TensorDistAttr._make(mesh, dm)
        return SpmdResult([a], [a])

    def backward(x: DistTensorSpec, out: DistTensorSpec, axis: int = -1) -> SpmdResult:
        _check_same(op, x, out, "x", "out")
        mesh = x.dist_attr.mesh
        ax = _axis(op, axis, len(x.shape))
        dm = _infer(out.shape, out.dist_attr.dims_mapping, ax, mesh.shape, True)
        a = TensorDistAttr._make(mesh, dm)
        return SpmdResult([a], [a])

    forward.__name__ = f"{op}_forward"
    forward.__doc__ = f"{op} (SoftmaxInferSpmd): the softmax axis replicated, uneven shardings dropped."
    backward.__name__ = f"{op}_backward"
    backward.__doc__ = f"{op} (SoftmaxInferSpmdReverse): x from out; out is what x produces."
    return forward, backward


@memo()
def _grad(shape: Shape, do: DimsMapping, dg: DimsMapping, axis: int, mesh_shape: Shape) -> DimsMapping:
    # elementwise merge of out and out_grad: out's sharding wins an axis both shard
    # differently; a mesh dim already taken by an earlier axis is dropped
    used: set[int] = set()
    res: list[Entry] = []
    for i in range(len(shape)):
        if i == axis:
            res.append(-1)
            continue
        e = do[i] if do[i] != -1 else dg[i]
        d = tuple(x for x in entry_dims(e) if x not in used)
        used.update(d)
        res.append(-1 if not d else d[0] if len(d) == 1 else d)
    return tuple(res)


def _make_grad(op: str):  # type: ignore[no-untyped-def]
    def grad(out: DistTensorSpec, out_grad: DistTensorSpec, axis: int = -1) -> SpmdResult:
        _check_same(op, out, out_grad, "out", "out_grad")
        mesh = out.dist_attr.mesh
        ax = _axis(op, axis, len(out.shape))
        dm = _grad(out.shape, out.dist_attr.dims_mapping, out_grad.dist_attr.dims_mapping, ax, mesh.shape)
        a = TensorDistAttr._make(mesh, dm)
        return SpmdResult([a, a], [a])

    grad.__name__ = op
    grad.__doc__ = f"{op} (SoftmaxGradInferSpmd): out, out_grad and x_grad sharded alike, axis replicated."
    return grad


for _name in ("softmax", "log_softmax"):
    _f, _b = _make_forward(_name)
    register(
        _name, _f, "x: T, axis: int = -1", _b, "x: T, out: T, axis: int = -1",
        forward_name="SoftmaxInferSpmd", backward_name="SoftmaxInferSpmdReverse",
    )  # fmt: skip
    register(
        f"{_name}_grad", _make_grad(f"{_name}_grad"), "out: T, out_grad: T, axis: int = -1",
        forward_name="SoftmaxGradInferSpmd",
    )  # fmt: skip
