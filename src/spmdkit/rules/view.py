"""View ops: reshape (reshape2), flatten, squeeze, unsqueeze (unsqueeze2) and their grads.

Notation: a list of ``spmdkit.engine.dim_trans`` entries, one per output axis, e.g. reshape
[6,12,48,24] -> [1,72,48,4,6] is ``Singleton, Flatten(0,1), InputDim(2), Split(3,(4,6),0),
Split(3,(4,6),1)``. The forward rule moves x's dims_mapping through the list
(``infer_from_trans``); a partial x stays partial (a view is linear). The reverse rule moves
out's dims_mapping through the list from out's shape to x's; as in Paddle 3.3.1 a co-sharded
out axis is read as its last mesh dim, and out is returned as the x it infers produces it
(never partial: Paddle's reshape keeps out's partial over an x it asks unpartial, which is
unsound). squeeze and unsqueeze forward drop a partial x (reshard), reshape and flatten keep it.
Grad rules reshape out_grad back to x's shape (the shape of ``x_shape`` / ``xshape`` / ``x``).

Deviations from Paddle 3.3.1 (docs/deviations.md, "View family"): invalid targets and axes
raise; unsqueeze places new axes as the op does (one after another), and the reverse rules
do not co-shard an out axis whose size the mesh dims do not divide.

Bound: unsqueeze inserts at most :data:`MAX_NEW_AXES` (1024) axes (Paddle's tensors have at
most 9 dims); a longer ``axis`` list is an InvalidAttributeError (placing the axes one after
another costs time quadratic in their number).
"""

from __future__ import annotations

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import one_mesh_dim
from spmdkit.engine.dim_trans import (
    DimTrans,
    flatten_reverse_trans,
    flatten_trans,
    infer_from_trans,
    invert_trans,
    reshape_infer,
    resolve_target,
    squeeze_trans,
    unsqueeze_trans,
)
from spmdkit.engine.notation import attr_as, fast_result
from spmdkit.rules.registry import register


def _check_sizes(op: str, spec: DistTensorSpec, name: str, dynamic: bool = False) -> None:
    """Sizes >= 1; with ``dynamic`` (reshape's x and out) a size may also be -1 (unknown)."""
    for s in spec.shape:
        if s <= 0 and not (dynamic and s == -1):
            raise ShapeMismatchError(f"{op}: {name} has shape {list(spec.shape)}; view rules need sizes >= 1"
                                     + (" (or -1 for a dynamic size)" if dynamic else ""))



def _forward(op: str, x: DistTensorSpec, trans: tuple[DimTrans, ...], keep_partial: bool = True) -> SpmdResult:
    """x's mapping through ``trans``; a partial x stays partial when ``keep_partial`` (reshape,
    flatten), else it is resharded to unpartial and co-shards are read as one mesh dim
    (squeeze, unsqueeze: as Paddle 3.3.1)."""
    a = x.dist_attr
    mesh = a.mesh
    dm = a.dims_mapping if keep_partial else one_mesh_dim(a.dims_mapping, mesh.shape)
    new_in, out = infer_from_trans(trans, x.shape, dm, mesh.shape)
    pt = a.partial if keep_partial else ()
    return SpmdResult([TensorDistAttr.unchecked(mesh, new_in, pt)], [TensorDistAttr.unchecked(mesh, out, pt)])


def _reverse(op: str, x: DistTensorSpec, out: DistTensorSpec, out_shape: tuple[int, ...],
             trans: tuple[DimTrans, ...] | None = None) -> SpmdResult:
    """x from out through the list out -> x (``trans``; reshape's list when None)."""
    if tuple(out.shape) != tuple(out_shape):
        raise ShapeMismatchError(f"{op}: out has shape {list(out.shape)} but x of shape {list(x.shape)} "
                                 f"gives {list(out_shape)}")
    a = out.dist_attr
    mesh = a.mesh
    odm = one_mesh_dim(a.dims_mapping, mesh.shape)
    if trans is None:
        new_out, x_dm = reshape_infer(out.shape, x.shape, odm, mesh.shape)
    else:
        new_out, x_dm = infer_from_trans(trans, out.shape, odm, mesh.shape)
    return SpmdResult([TensorDistAttr.unchecked(mesh, x_dm)], [TensorDistAttr.unchecked(mesh, new_out)])


# -- reshape -------------------------------------------------------------------------------------


def reshape_forward(x: DistTensorSpec, shape: tuple[int, ...]) -> SpmdResult:
    """out = x viewed as ``shape`` (0 copies x's size, one -1 inferred; a dynamic (-1) size of x
    must be copied by a 0 at its index)."""
    xs = x.shape
    for v in xs:
        if v <= 0:
            _check_sizes("reshape", x, "x", dynamic=True)
            break
    tgt = resolve_target("reshape", shape, xs)
    a = x.dist_attr
    mesh = a.mesh
    new_in, out = reshape_infer(xs, tgt, a.dims_mapping, mesh.shape, True)
    pt = a.partial
    return fast_result((attr_as(a, mesh, new_in) if not pt else TensorDistAttr.unchecked(mesh, new_in, pt),),
                       (TensorDistAttr.unchecked(mesh, out, pt),))


def reshape_backward(x: DistTensorSpec, out: DistTensorSpec, shape: tuple[int, ...]) -> SpmdResult:
    """x from out through the list out -> x."""
    _check_sizes("reshape", x, "x", dynamic=True)
    _check_sizes("reshape", out, "out", dynamic=True)
    return _reverse("reshape", x, out, resolve_target("reshape", shape, x.shape))


def _grad(op: str, xs: DistTensorSpec, out_grad: DistTensorSpec, xs_name: str) -> SpmdResult:
    """x_grad = out_grad viewed as x's shape; ``xs`` (x's shape holder) is returned as given."""
    _check_sizes(op, xs, xs_name)
    _check_sizes(op, out_grad, "out_grad")
    n, m = 1, 1
    for s in xs.shape:
        n *= s
    for s in out_grad.shape:
        m *= s
    if n != m:
        raise ShapeMismatchError(f"{op}: out_grad of shape {list(out_grad.shape)} does not hold the "
                                 f"{n} elements of {xs_name} of shape {list(xs.shape)}")
    a = out_grad.dist_attr
    new_in, out = reshape_infer(out_grad.shape, xs.shape, a.dims_mapping, a.mesh.shape)
    return SpmdResult([xs.dist_attr, TensorDistAttr.unchecked(a.mesh, new_in, a.partial)],
                      [TensorDistAttr.unchecked(a.mesh, out, a.partial)])


def reshape_grad(x_shape: DistTensorSpec, out_grad: DistTensorSpec) -> SpmdResult:
    return _grad("reshape_grad", x_shape, out_grad, "x_shape")


# -- flatten -------------------------------------------------------------------------------------


def flatten_forward(x: DistTensorSpec, start_axis: int, stop_axis: int) -> SpmdResult:
    """Axes start_axis..stop_axis merged into one."""
    _check_sizes("flatten", x, "x")
    trans, _ = flatten_trans(x.shape, int(start_axis), int(stop_axis))
    return _forward("flatten", x, trans)


def flatten_backward(x: DistTensorSpec, out: DistTensorSpec, start_axis: int, stop_axis: int) -> SpmdResult:
    _check_sizes("flatten", x, "x")
    _, oshape = flatten_trans(x.shape, int(start_axis), int(stop_axis))
    return _reverse("flatten", x, out, oshape, flatten_reverse_trans(x.shape, int(start_axis), int(stop_axis)))


def flatten_grad(xshape: DistTensorSpec, out_grad: DistTensorSpec) -> SpmdResult:
    return _grad("flatten_grad", xshape, out_grad, "xshape")


# -- squeeze / unsqueeze -------------------------------------------------------------------------


def squeeze_forward(x: DistTensorSpec, axis: tuple[int, ...]) -> SpmdResult:
    """Size-1 axes in ``axis`` (all when empty) removed; sharding on kept size-1 axes dropped."""
    _check_sizes("squeeze", x, "x")
    trans, _ = squeeze_trans(x.shape, tuple(axis))
    return _forward("squeeze", x, trans, keep_partial=False)


def squeeze_backward(x: DistTensorSpec, out: DistTensorSpec, axis: tuple[int, ...]) -> SpmdResult:
    _check_sizes("squeeze", x, "x")
    trans, oshape = squeeze_trans(x.shape, tuple(axis))
    return _reverse("squeeze", x, out, oshape, invert_trans(trans, x.ndim))


def squeeze_grad(xshape: DistTensorSpec, out_grad: DistTensorSpec, axis: tuple[int, ...] = ()) -> SpmdResult:
    return _grad("squeeze_grad", xshape, out_grad, "xshape")


#: The most axes one unsqueeze inserts (see the module docstring).
MAX_NEW_AXES = 1024


def _check_new_axes(axis: tuple[int, ...]) -> None:
    if len(axis) > MAX_NEW_AXES:
        raise InvalidAttributeError(
            f"unsqueeze: axis has {len(axis)} entries; at most {MAX_NEW_AXES} new axes are answered"
        )


def unsqueeze_forward(x: DistTensorSpec, axis: tuple[int, ...]) -> SpmdResult:
    """New size-1 axes inserted at ``axis`` (one after another, as the op does)."""
    _check_sizes("unsqueeze", x, "x")
    _check_new_axes(axis)
    trans, _ = unsqueeze_trans(x.shape, tuple(axis))
    return _forward("unsqueeze", x, trans, keep_partial=False)


def unsqueeze_backward(x: DistTensorSpec, out: DistTensorSpec, axis: tuple[int, ...]) -> SpmdResult:
    _check_sizes("unsqueeze", x, "x")
    _check_new_axes(axis)
    trans, oshape = unsqueeze_trans(x.shape, tuple(axis))
    return _reverse("unsqueeze", x, out, oshape, invert_trans(trans, x.ndim))


def unsqueeze_grad(x: DistTensorSpec, out_grad: DistTensorSpec, axis: tuple[int, ...] = ()) -> SpmdResult:
    return _grad("unsqueeze_grad", x, out_grad, "x")


register("reshape", reshape_forward, "x: T, shape: ints", reshape_backward, kind="reverse", outputs="out: T",
         aliases=("reshape2",), forward_name="ReshapeInferSpmd", backward_name="ReshapeInferSpmdReverse")
register("reshape_grad", reshape_grad, "x_shape: T, out_grad: T", forward_name="ReshapeGradInferSpmd")
register("flatten", flatten_forward, "x: T, start_axis: int, stop_axis: int", flatten_backward,
         kind="reverse", outputs="out: T",
         forward_name="FlattenInferSpmd", backward_name="FlattenInferSpmdReverse")
register("flatten_grad", flatten_grad, "xshape: T, out_grad: T", forward_name="FlattenGradInferSpmd")
register("squeeze", squeeze_forward, "x: T, axis: ints", squeeze_backward, kind="reverse", outputs="out: T",
         forward_name="SqueezeInferSpmd", backward_name="SqueezeInferSpmdReverse")
register("squeeze_grad", squeeze_grad, "xshape: T, out_grad: T, axis: ints = []",
         forward_name="SqueezeGradInferSpmd")
register("unsqueeze", unsqueeze_forward, "x: T, axis: ints", unsqueeze_backward, kind="reverse", outputs="out: T",
         aliases=("unsqueeze2",), forward_name="UnsqueezeInferSpmd", backward_name="UnsqueezeInferSpmdReverse")
register("unsqueeze_grad", unsqueeze_grad, "x: T, out_grad: T, axis: ints = []",
         forward_name="UnsqueezeGradInferSpmd")
