"""slice, strided_slice, tile, expand_as, expand, pad and their grads.

Each of these ops changes the extent of some axes and copies the others through, so every rule
is per axis: an axis whose extent changes (sliced, tiled, padded, broadcast) is replicated, the
others keep their sharding. Partial status is cleared, as in Paddle.

* ``slice(input, axes, starts, ends, infer_flags, decrease_axis)``: notation ``abc -> ac`` for
  axes [1], decrease_axis [1]: the axes in ``axes`` replicated, the decreased ones dropped from
  the output. Paddle answers the output with one entry per *input* axis (DESIGN class 5);
  spmdkit drops the decreased axes. The reverse rule inserts the decreased axes back and
  replicates the sliced ones (Paddle raises when decrease_axis is not empty).
  ``slice_grad(input, out_grad, ...)``: input and out_grad merged per axis (the sliced axes
  replicated); input_grad sharded as input.
* ``strided_slice(input, axes, starts, ends, strides)``: as slice without decrease_axis; its
  backward slot is Paddle's grad rule ``StridedSliceGradInferSpmd(input, out_grad, ...)``,
  also registered as ``strided_slice_grad``.
* ``tile(x, repeat_times)``: ``bc -> 1bc`` for repeat_times of length 3: axes repeated more
  than once replicated, new leading axes replicated in out. The reverse rule gives x the
  sharding of out's axes that are not tiled and returns the out that x produces (Paddle keeps
  a sharded new or tiled out axis, DESIGN class 4). ``tile_grad(x, out_grad, repeat_times)``:
  x and out_grad merged on the untiled axes; out_grad sharded on a new leading axis makes
  x_grad partial SUM.
* ``expand_as(x, y, target_shape)`` (alias expand_as_v2): out is sharded as y; x takes y's
  sharding where its size equals y's, else (a broadcast axis) is replicated. y may be absent
  (as in Paddle): out then has ``target_shape`` and x's sharding on the axes x keeps. Its backward
  slot is the grad rule ``ExpandAsGradInferSpmd(x, out_grad, target_shape)``, also
  ``expand_as_grad``: x_grad as x, partial SUM over the mesh dims out_grad has on broadcast
  axes.
* ``expand(x, shape)`` (paddle.expand; not a Paddle 3.3.1 rule name): broadcast axes and new
  axes replicated; the reverse rule takes x from out's non-broadcast axes.
  ``expand_grad(x, out_grad, shape)``: as expand_as_grad.
* ``pad(x, paddings, pad_value)``: padded axes replicated. Its backward slot is Paddle's
  ``PadGradInferSpmd(x, out, paddings, pad_value)``, which infers x from out (padded axes
  replicated). ``pad_grad(out_grad, paddings, pad_value)`` (Paddle's PadGradInferSpmdDynamic):
  x_grad = out_grad with the padded axes replicated.

Deviations from Paddle 3.3.1 (docs/deviations.md): slice-decrease-out, slice-reverse-decrease,
slice-invalid-decrease, strided-slice-sharded-axis (Paddle keeps a sliced last axis sharded),
tile-reverse-out, pad-coshard (Paddle answers one mesh dim for out, co-shard for x),
expand-as-no-y (Paddle returns x as given without y).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from spmdkit.core.dist_attr import DimsMapping, Partial, ReduceType, TensorDistAttr, entry_dims
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import one_mesh_dim
from spmdkit.engine.compile import Plan, compile_plan, infer
from spmdkit.engine.memo import memo
from spmdkit.engine.notation import (
    BROADCAST,
    Notation,
    common_mesh,
    fast_result,
    letters_for,
    merge_letters,
    project,
)
from spmdkit.rules.registry import register

Shape = tuple[int, ...]
_make = TensorDistAttr.unchecked


def _norm_axes(op: str, name: str, axes: Sequence[int], ndim: int) -> tuple[int, ...]:
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise InvalidAttributeError(f"{op}: {name} entry {a} is out of range [{-ndim}, {ndim}) for a {ndim}-D input")
        a = a + ndim if a < 0 else a
        if a in out:
            raise InvalidAttributeError(f"{op}: {name} names axis {a} twice")
        out.append(a)
    return tuple(out)



def _blank(dm: DimsMapping, axes: Sequence[int]) -> DimsMapping:
    return tuple(-1 if i in axes else e for i, e in enumerate(dm))


def _check_shapes(op: str, na: str, a: Shape, nb: str, b: Shape, skip: Sequence[int] = ()) -> None:
    if len(a) != len(b):
        raise ShapeMismatchError(f"{op}: {nb} has {len(b)} dims, {na} has {len(a)}")
    for i, (s, t) in enumerate(zip(a, b)):
        if i not in skip and s != t and s >= 0 and t >= 0:
            raise ShapeMismatchError(f"{op}: {na} and {nb} differ on axis {i} ({s} vs {t})")


@memo()
def _merge2(ndim: int, blank: tuple[int, ...], dms: tuple[DimsMapping, ...], shapes: tuple[Shape, ...],
            mesh_shape: Shape) -> DimsMapping:
    """Merge tensors of one rank axis by axis (the axes in ``blank`` replicated)."""
    letters = "".join(BROADCAST if i in blank else c for i, c in enumerate(letters_for(ndim)))
    merged = merge_letters(tuple(letters for _ in dms), dms, shapes, frozenset(), "", mesh_shape)
    return project(letters, dict(merged))


# -- slice ------------------------------------------------------------------------------------


def _slice_attrs(op: str, ndim: int, axes: Sequence[int], starts: Sequence[int], ends: Sequence[int],
                 decrease: Sequence[int], strides: Sequence[int] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    ax = _norm_axes(op, "axes", axes, ndim)
    if len(starts) != len(ax) or len(ends) != len(ax):
        raise InvalidAttributeError(
            f"{op}: starts ({len(starts)}) and ends ({len(ends)}) must have one entry per axis in axes ({len(ax)})")
    if strides is not None:
        if len(strides) != len(ax):
            raise InvalidAttributeError(f"{op}: strides has {len(strides)} entries for {len(ax)} axes")
        if any(s == 0 for s in strides):
            raise InvalidAttributeError(f"{op}: strides {list(strides)} has a zero stride")
    dec = _norm_axes(op, "decrease_axis", decrease, ndim)
    for d in dec:
        if d not in ax:
            raise InvalidAttributeError(f"{op}: decrease_axis {d} is not a sliced axis (axes {list(axes)})")
    return ax, tuple(sorted(dec))


def _remove(dm: tuple[Any, ...], dec: Sequence[int]) -> tuple[Any, ...]:
    return tuple(e for i, e in enumerate(dm) if i not in dec)


def _insert(dm: tuple[Any, ...], dec: Sequence[int], ndim: int) -> tuple[Any, ...]:
    it = iter(dm)
    return tuple(-1 if i in dec else next(it) for i in range(ndim))


def slice_forward(input: DistTensorSpec, axes: tuple[int, ...], starts: tuple[int, ...], ends: tuple[int, ...],
                  infer_flags: tuple[int, ...] = (), decrease_axis: tuple[int, ...] = ()) -> SpmdResult:
    """The sliced axes replicated; the decreased axes dropped from the output."""
    a = input.dist_attr
    ax, dec = _slice_attrs("slice", input.ndim, axes, starts, ends, decrease_axis)
    dm = _blank(one_mesh_dim(a.dims_mapping, a.mesh.shape), ax)
    return fast_result((_make(a.mesh, dm),), (_make(a.mesh, _remove(dm, dec)),))


def slice_backward(input: DistTensorSpec, output: DistTensorSpec, axes: tuple[int, ...], starts: tuple[int, ...],
                   ends: tuple[int, ...], infer_flags: tuple[int, ...] = (),
                   decrease_axis: tuple[int, ...] = ()) -> SpmdResult:
    """input from output: the decreased axes put back, the sliced axes replicated."""
    mesh = common_mesh("slice", (input, output))
    ax, dec = _slice_attrs("slice", input.ndim, axes, starts, ends, decrease_axis)
    if output.ndim != input.ndim - len(dec):
        raise ShapeMismatchError(f"slice: output has {output.ndim} dims; input has {input.ndim} and "
                                 f"decrease_axis removes {len(dec)}")
    _check_shapes("slice", "input", _remove(input.shape, dec), "output", output.shape,
                  [i for i, k in enumerate(j for j in range(input.ndim) if j not in dec) if k in ax])
    dm = _blank(_insert(one_mesh_dim(output.dist_attr.dims_mapping, mesh.shape), dec, input.ndim), ax)
    return fast_result((_make(mesh, dm),), (_make(mesh, _remove(dm, dec)),))


def _slice_grad(op: str, input: DistTensorSpec, out_grad: DistTensorSpec, ax: tuple[int, ...],
                dec: tuple[int, ...]) -> SpmdResult:
    mesh = common_mesh(op, (input, out_grad))
    nd = input.ndim
    if out_grad.ndim != nd - len(dec):
        raise ShapeMismatchError(f"{op}: out_grad has {out_grad.ndim} dims; input has {nd} and "
                                 f"decrease_axis removes {len(dec)}")
    g_dm = _insert(one_mesh_dim(out_grad.dist_attr.dims_mapping, mesh.shape), dec, nd)
    g_shape = _insert(out_grad.shape, dec, nd)
    _check_shapes(op, "input", input.shape, "out_grad", g_shape, ax)
    # out_grad claims first, input fills the axes it leaves (as Paddle's strided_slice grad)
    x_dm = one_mesh_dim(input.dist_attr.dims_mapping, mesh.shape)
    dm = _merge2(nd, ax, (g_dm, x_dm), (g_shape, input.shape), mesh.shape)
    xa = _make(mesh, dm)
    return fast_result((xa, _make(mesh, _remove(dm, dec))), (xa,))


def slice_grad(input: DistTensorSpec, out_grad: DistTensorSpec, axes: tuple[int, ...], starts: tuple[int, ...],
               ends: tuple[int, ...], infer_flags: tuple[int, ...] = (),
               decrease_axis: tuple[int, ...] = ()) -> SpmdResult:
    """input_grad: out_grad padded back with zeros; input and out_grad merged, sliced axes replicated."""
    ax, dec = _slice_attrs("slice_grad", input.ndim, axes, starts, ends, decrease_axis)
    return _slice_grad("slice_grad", input, out_grad, ax, dec)


def strided_slice_forward(input: DistTensorSpec, axes: tuple[int, ...], starts: tuple[int, ...],
                          ends: tuple[int, ...], strides: tuple[int, ...]) -> SpmdResult:
    """The sliced axes replicated."""
    a = input.dist_attr
    ax, _ = _slice_attrs("strided_slice", input.ndim, axes, starts, ends, (), strides)
    at = _make(a.mesh, _blank(one_mesh_dim(a.dims_mapping, a.mesh.shape), ax))
    return fast_result((at,), (at,))


def _make_strided_grad(op: str):  # type: ignore[no-untyped-def]
    def grad(input: DistTensorSpec, out_grad: DistTensorSpec, axes: tuple[int, ...], starts: tuple[int, ...],
             ends: tuple[int, ...], strides: tuple[int, ...]) -> SpmdResult:
        ax, _ = _slice_attrs(op, input.ndim, axes, starts, ends, (), strides)
        return _slice_grad(op, input, out_grad, ax, ())

    grad.__name__ = op
    grad.__doc__ = "input_grad: input and out_grad merged, the sliced axes replicated (StridedSliceGradInferSpmd)."
    return grad


# -- tile -------------------------------------------------------------------------------------


def _repeats(op: str, repeat_times: Sequence[int], ndim: int) -> tuple[int, ...]:
    if any(r < 0 for r in repeat_times):
        raise InvalidAttributeError(f"{op}: repeat_times {list(repeat_times)} has a negative entry")
    r = tuple(repeat_times)
    return (1,) * (ndim - len(r)) + r if len(r) < ndim else r


def _check_tiled(op: str, x: DistTensorSpec, out: DistTensorSpec, oname: str, rep: tuple[int, ...]) -> None:
    if out.ndim != len(rep):
        raise ShapeMismatchError(f"{op}: {oname} has {out.ndim} dims, repeat_times makes {len(rep)}")
    xs = (1,) * (len(rep) - x.ndim) + x.shape
    for i, (s, r, o) in enumerate(zip(xs, rep, out.shape)):
        if s >= 0 and o >= 0 and s * r != o:
            raise ShapeMismatchError(f"{op}: {oname} has size {o} on axis {i}; x tiled {r} times makes {s * r}")


def tile_forward(x: DistTensorSpec, repeat_times: tuple[int, ...]) -> SpmdResult:
    """Tiled axes replicated; new leading axes replicated in out."""
    a = x.dist_attr
    rep = _repeats("tile", repeat_times, x.ndim)
    lead = len(rep) - x.ndim
    dm = _blank(a.dims_mapping, [i for i in range(x.ndim) if rep[lead + i] != 1])
    return fast_result((_make(a.mesh, dm),), (_make(a.mesh, (-1,) * lead + dm),))


def tile_backward(x: DistTensorSpec, out: DistTensorSpec, repeat_times: tuple[int, ...]) -> SpmdResult:
    """x from out's untiled axes; out returned as x produces it."""
    mesh = common_mesh("tile", (x, out))
    rep = _repeats("tile", repeat_times, x.ndim)
    lead = len(rep) - x.ndim
    _check_tiled("tile", x, out, "out", rep)
    odm = out.dist_attr.dims_mapping
    dm = tuple(-1 if rep[lead + i] != 1 else odm[lead + i] for i in range(x.ndim))
    return fast_result((_make(mesh, dm),), (_make(mesh, (-1,) * lead + dm),))


def tile_grad(x: DistTensorSpec, out_grad: DistTensorSpec, repeat_times: tuple[int, ...]) -> SpmdResult:
    """x and out_grad merged on untiled axes; out_grad's new leading axes make x_grad partial."""
    op = "tile_grad"
    mesh = common_mesh(op, (x, out_grad))
    rep = _repeats(op, repeat_times, x.ndim)
    lead = len(rep) - x.ndim
    _check_tiled(op, x, out_grad, "out_grad", rep)
    tiled = tuple(lead + i for i in range(x.ndim) if rep[lead + i] != 1)
    gdm = _blank(out_grad.dist_attr.dims_mapping, tiled)
    x_dm = (-1,) * lead + x.dist_attr.dims_mapping
    x_shape = (1,) * lead + x.shape
    dm = _merge2(len(rep), tiled, (x_dm, gdm), (x_shape, out_grad.shape), mesh.shape)
    pt: Partial = tuple((d, _SUM) for d in sorted(d for e in dm[:lead] for d in entry_dims(e)))
    xdm = dm[lead:]
    return fast_result((_make(mesh, xdm), _make(mesh, dm)), (_make(mesh, xdm, pt),))


# -- expand_as / expand -----------------------------------------------------------------------


def _expand_map(op: str, xs: Shape, target: Shape, tname: str) -> tuple[bool, ...]:
    """Per x axis: does it keep its size (True) or is it broadcast (False)?"""
    d = len(target) - len(xs)
    if d < 0:
        raise ShapeMismatchError(f"{op}: x has {len(xs)} dims, more than {tname} ({len(target)})")
    keep = []
    for i, s in enumerate(xs):
        t = target[d + i]
        if t == -1 or t == s:
            keep.append(True)
        elif s == 1:
            keep.append(False)
        else:
            raise ShapeMismatchError(f"{op}: x has size {s} on axis {i}, which cannot be expanded to {t} "
                                     f"({tname} axis {d + i})")
    return tuple(keep)


def expand_as_forward(x: DistTensorSpec, y: DistTensorSpec | None,
                      target_shape: tuple[int, ...] = ()) -> SpmdResult:
    """out sharded as y; x as y on the axes it does not broadcast. Without y (Paddle allows it):
    out has target_shape, sharded as x on x's kept axes, broadcast and new axes replicated."""
    if y is None:
        a = x.dist_attr
        tgt = tuple(target_shape)
        keep = _expand_map("expand_as", x.shape, tgt, "target_shape")
        xdm = tuple(e if k else -1 for e, k in zip(a.dims_mapping, keep))
        return fast_result((_make(a.mesh, xdm), None), (_make(a.mesh, (-1,) * (len(tgt) - x.ndim) + xdm),))
    mesh = common_mesh("expand_as", (x, y))
    keep = _expand_map("expand_as", x.shape, y.shape, "y")
    d = y.ndim - x.ndim
    ydm = one_mesh_dim(y.dist_attr.dims_mapping, mesh.shape)
    xdm = tuple(ydm[d + i] if k else -1 for i, k in enumerate(keep))
    ya = _make(mesh, ydm)
    return fast_result((_make(mesh, xdm), ya), (ya,))


def _expand_grad(op: str, x: DistTensorSpec, out_grad: DistTensorSpec, gname: str,
                 target: Shape | None = None) -> SpmdResult:
    mesh = common_mesh(op, (x, out_grad))
    keep = _expand_map(op, x.shape, out_grad.shape if target is None else target, gname)
    if target is not None:
        _expand_map(op, x.shape, out_grad.shape, "out_grad")
    d = out_grad.ndim - x.ndim
    gdm = one_mesh_dim(out_grad.dist_attr.dims_mapping, mesh.shape)
    xdm = tuple(gdm[d + i] if k else -1 for i, k in enumerate(keep))
    pdims = [dd for i, e in enumerate(gdm) if i < d or not keep[i - d] for dd in entry_dims(e)]
    pt: Partial = tuple((dd, _SUM) for dd in sorted(pdims))
    return fast_result((_make(mesh, xdm), _make(mesh, gdm)), (_make(mesh, xdm, pt),))


def expand_as_grad(x: DistTensorSpec, out_grad: DistTensorSpec, target_shape: tuple[int, ...] = ()) -> SpmdResult:
    """x_grad as x (out_grad's sharding where x is not broadcast); partial SUM over the mesh dims
    out_grad has on broadcast axes."""
    return _expand_grad("expand_as_grad", x, out_grad, "out_grad")


def _target(op: str, x: DistTensorSpec, shape: Sequence[int]) -> Shape:
    d = len(shape) - x.ndim
    if d < 0:
        raise InvalidAttributeError(f"{op}: shape {list(shape)} has fewer entries than x has dims ({x.ndim})")
    for i, s in enumerate(shape):
        if s < -1 or (s == -1 and i < d):
            raise InvalidAttributeError(f"{op}: shape {list(shape)}: entry {i} ({s}) is not a size")
    return tuple(x.shape[i - d] if s == -1 else s for i, s in enumerate(shape))


def expand_forward(x: DistTensorSpec, shape: tuple[int, ...]) -> SpmdResult:
    """Broadcast and new axes replicated, the others as x."""
    a = x.dist_attr
    tgt = _target("expand", x, shape)
    keep = _expand_map("expand", x.shape, tgt, "shape")
    dm = tuple(e if k else -1 for e, k in zip(a.dims_mapping, keep))
    return fast_result((_make(a.mesh, dm),), (_make(a.mesh, (-1,) * (len(tgt) - x.ndim) + dm),))


def expand_backward(x: DistTensorSpec, out: DistTensorSpec, shape: tuple[int, ...]) -> SpmdResult:
    """x from out's non-broadcast axes; out returned as x produces it."""
    mesh = common_mesh("expand", (x, out))
    tgt = _target("expand", x, shape)
    keep = _expand_map("expand", x.shape, tgt, "shape")
    _check_shapes("expand", "shape", tgt, "out", out.shape)
    d = len(tgt) - x.ndim
    odm = out.dist_attr.dims_mapping
    dm = tuple(odm[d + i] if k else -1 for i, k in enumerate(keep))
    return fast_result((_make(mesh, dm),), (_make(mesh, (-1,) * d + dm),))


def expand_grad(x: DistTensorSpec, out_grad: DistTensorSpec, shape: tuple[int, ...]) -> SpmdResult:
    """As expand_as_grad, broadcast axes from ``shape``."""
    tgt = _target("expand_grad", x, shape)
    _check_shapes("expand_grad", "shape", tgt, "out_grad", out_grad.shape)
    return _expand_grad("expand_grad", x, out_grad, "shape", tgt)


# -- pad --------------------------------------------------------------------------------------


def _padded(op: str, paddings: Sequence[int], ndim: int) -> tuple[int, ...]:
    if len(paddings) != 2 * ndim:
        raise InvalidAttributeError(f"{op}: paddings has {len(paddings)} entries, a {ndim}-D tensor needs {2 * ndim}")
    return tuple(i for i in range(ndim) if paddings[2 * i] != 0 or paddings[2 * i + 1] != 0)


def pad_forward(x: DistTensorSpec, paddings: tuple[int, ...], pad_value: int = 0) -> SpmdResult:
    """Padded axes replicated, the others as x."""
    p = _pad_plan(x.ndim, _padded("pad", paddings, x.ndim), "keep", "forward")
    return fast_result(*infer(p, "pad", (x,), (), x.dist_attr.mesh, ("x",)))


def pad_backward(x: DistTensorSpec, out: DistTensorSpec, paddings: tuple[int, ...], pad_value: int = 0) -> SpmdResult:
    """(PadGradInferSpmd) x from out: padded axes replicated, the others as out."""
    mesh = common_mesh("pad", (x, out))
    ax = _padded("pad", paddings, x.ndim)
    _check_shapes("pad", "x", x.shape, "out", out.shape, ax)
    return fast_result(*infer(_pad_plan(x.ndim, ax, "largest", "backward"), "pad", (x,), (out,), mesh, ("x", "out")))


def pad_grad(out_grad: DistTensorSpec, paddings: tuple[int, ...], pad_value: float = 0) -> SpmdResult:
    """x_grad = out_grad cropped: padded axes replicated, the others as out_grad."""
    p = _pad_plan(out_grad.ndim, _padded("pad_grad", paddings, out_grad.ndim), "keep", "forward")
    return fast_result(*infer(p, "pad_grad", (out_grad,), (), out_grad.dist_attr.mesh, ("out_grad",)))


@lru_cache(maxsize=1024)
def _pad_plan(nd: int, padded: tuple[int, ...], coshard: str, direction: str) -> Plan:
    """``abc -> abc``, the padded axes replicated (the reverse reads a co-shard as its largest
    mesh dim)."""
    a = letters_for(nd)
    return compile_plan(Notation([a], [a], replicated="".join(a[i] for i in padded), coshard=coshard), direction)


_SUM = ReduceType.SUM

_SLICE = "input: T, axes: ints, starts: ints, ends: ints, infer_flags: ints = [], decrease_axis: ints = []"
_SSLICE = "input: T, axes: ints, starts: ints, ends: ints, strides: ints"
_SSLICE_G = "input: T, out_grad: T, axes: ints, starts: ints, ends: ints, strides: ints"
register(
    "slice", slice_forward, _SLICE, slice_backward, kind="reverse", outputs="output: T",
    forward_name="SliceInferSpmd", backward_name="SliceInferSpmdReverse",
)  # fmt: skip
register("slice_grad", slice_grad, _SLICE.replace("input: T,", "input: T, out_grad: T,"),
         forward_name="SliceGradInferSpmdDynamic")
register(
    "strided_slice", strided_slice_forward, _SSLICE, _make_strided_grad("strided_slice"), _SSLICE_G, kind="grad",
    forward_name="StridedSliceInferSpmd", backward_name="StridedSliceGradInferSpmd",
)  # fmt: skip
register("strided_slice_grad", _make_strided_grad("strided_slice_grad"), _SSLICE_G,
         forward_name="StridedSliceGradInferSpmd")
register(
    "tile", tile_forward, "x: T, repeat_times: ints", tile_backward, kind="reverse", outputs="out: T",
    forward_name="TileInferSpmd", backward_name="TileInferSpmdReverse",
)  # fmt: skip
register("tile_grad", tile_grad, "x: T, out_grad: T, repeat_times: ints", forward_name="TileGradInferSpmd")
register(
    "expand_as", expand_as_forward, "x: T, y: T?, target_shape: ints = []",
    expand_as_grad, "x: T, out_grad: T, target_shape: ints = []", kind="grad", grad_name="expand_as_grad", grad_aliases=("expand_as_v2_grad",), aliases=("expand_as_v2",),
    forward_name="ExpandAsInferSpmd", backward_name="ExpandAsGradInferSpmd",
)  # fmt: skip
register(
    "expand", expand_forward, "x: T, shape: ints", expand_backward, kind="reverse", outputs="out: T",
    forward_name="ExpandInferSpmd", backward_name="ExpandInferSpmdReverse",
)  # fmt: skip
register("expand_grad", expand_grad, "x: T, out_grad: T, shape: ints", forward_name="ExpandGradInferSpmd")
register(
    "pad", pad_forward, "x: T, paddings: ints, pad_value: int = 0",
    pad_backward, "x: T, out: T, paddings: ints, pad_value: int = 0", kind="grad",
    forward_name="PadInferSpmd", backward_name="PadGradInferSpmd",
)  # fmt: skip
register("pad_grad", pad_grad, "out_grad: T, paddings: ints, pad_value: scalar = 0",
         forward_name="PadGradInferSpmdDynamic")
