"""slice, strided_slice, tile, expand_as, expand, pad and their grads.

Each of these ops changes the extent of some axes and copies the others through, so every rule
is a notation with one letter per axis, compiled per rank and attributes (``_plan``): an axis
whose extent changes (sliced, tiled, padded, broadcast) is labelled ``1`` (replicated), the
others keep their letter and so their sharding. Partial status is cleared, as in Paddle.

* ``slice(input, axes, starts, ends, infer_flags, decrease_axis)``: notation ``a1c -> ac`` for
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

from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.compile import Plan, compile_plan, infer
from spmdkit.engine.notation import BROADCAST, Notation, common_mesh, fast_result, letters_for
from spmdkit.engine.registry import register

Shape = tuple[int, ...]
T = DistTensorSpec
Ints = tuple[int, ...]


@lru_cache(maxsize=4096)
def _plan(kind: str, nd: int, fixed: Ints, drop: Ints = (), lead: int = 0, coshard: str = "keep",
          direction: str = "forward") -> Plan:
    """A rule's notation, compiled per key (ranks and attributes, never shapes). ``x``: the
    ``nd``-D tensor's letters, its ``fixed`` axes (sliced, tiled, broadcast, padded) labelled
    ``1``; ``y``: x's image, ``lead`` new leading axes (``1``) and the ``drop`` (decreased) axes
    removed; ``g``: the gradient of y, its new leading axes (for expand also the broadcast axes)
    letters that x_grad lacks, so x_grad is partial SUM over their mesh dims. Per ``kind``:

    * ``copy``        ``x -> y``     slice, strided_slice, tile, expand, pad (either direction)
    * ``copy_noy``    ``x, _ -> y``  expand_as without y
    * ``slice_grad``  ``y, x -> x``  slice_grad, strided_slice's grad (out_grad claims first)
    * ``tile_grad``   ``x, g -> x``  tile_grad
    * ``expand``      ``x, g -> g``  expand_as: y alone merged (``sources``), x as y where kept
    * ``expand_grad`` ``x, g -> x``  expand_grad, expand_as_grad: out_grad alone merged
    """
    full = letters_for(nd)
    x = "".join(BROADCAST if i in fixed else c for i, c in enumerate(full))
    y = BROADCAST * lead + "".join(c for i, c in enumerate(x) if i not in drop)
    g = letters_for(lead, nd) + (full if kind.startswith("expand") else x)
    table: dict[str, tuple[tuple[str | None, ...], str]] = {
        "copy": ((x,), y), "copy_noy": ((x, None), y), "slice_grad": ((y, x), x), "tile_grad": ((x, g), x),
        "expand": ((x, g), g), "expand_grad": ((x, g), x),
    }  # fmt: skip
    ins, out = table[kind]
    sources = (1,) if kind.startswith("expand") else None
    return compile_plan(Notation(ins, [out], coshard=coshard, sources=sources), direction)


def _answer(op: str, p: Plan, ins: tuple[T | None, ...], outs: tuple[T, ...] = (),
            mesh: ProcessMesh | None = None) -> SpmdResult:
    return fast_result(*infer(p, op, ins, outs, ins[0].dist_attr.mesh if mesh is None else mesh))  # type: ignore[union-attr]


def _norm_axes(op: str, name: str, axes: Sequence[int], ndim: int) -> Ints:
    out = []
    for a in axes:
        if not -ndim <= a < ndim:
            raise InvalidAttributeError(f"{op}: {name} entry {a} is out of range [{-ndim}, {ndim}) for a {ndim}-D input")
        a = a + ndim if a < 0 else a
        if a in out:
            raise InvalidAttributeError(f"{op}: {name} names axis {a} twice")
        out.append(a)
    return tuple(out)


def _check_shapes(op: str, na: str, a: Shape, nb: str, b: Shape, skip: Sequence[int] = ()) -> None:
    if len(a) != len(b):
        raise ShapeMismatchError(f"{op}: {nb} has {len(b)} dims, {na} has {len(a)}")
    for i, (s, t) in enumerate(zip(a, b)):
        if i not in skip and s != t and s >= 0 and t >= 0:
            raise ShapeMismatchError(f"{op}: {na} and {nb} differ on axis {i} ({s} vs {t})")


# -- slice ------------------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def _slice(op: str, nd: int, axes: Ints, n_starts: int, n_ends: int, decrease: Ints, strides: Ints | None = None,
           kind: str = "copy", direction: str = "forward") -> tuple[Plan, Ints, Ints]:
    """The plan of an ``nd``-D input sliced on ``axes`` (attributes checked), the sliced axes and
    the decreased ones, sorted."""
    ax = _norm_axes(op, "axes", axes, nd)
    if n_starts != len(ax) or n_ends != len(ax):
        raise InvalidAttributeError(
            f"{op}: starts ({n_starts}) and ends ({n_ends}) must have one entry per axis in axes ({len(ax)})")
    if strides is not None:
        if len(strides) != len(ax):
            raise InvalidAttributeError(f"{op}: strides has {len(strides)} entries for {len(ax)} axes")
        if any(s == 0 for s in strides):
            raise InvalidAttributeError(f"{op}: strides {list(strides)} has a zero stride")
    dec = _norm_axes(op, "decrease_axis", decrease, nd)
    for d in dec:
        if d not in ax:
            raise InvalidAttributeError(f"{op}: decrease_axis {d} is not a sliced axis (axes {list(axes)})")
    dec = tuple(sorted(dec))
    return _plan(kind, nd, ax, dec, 0, "largest", direction), ax, dec


def slice_forward(input: T, axes: Ints, starts: Ints, ends: Ints, infer_flags: Ints = (),
                  decrease_axis: Ints = ()) -> SpmdResult:
    """The sliced axes replicated; the decreased axes dropped from the output."""
    return _answer("slice", _slice("slice", input.ndim, axes, len(starts), len(ends), decrease_axis)[0], (input,))


def slice_backward(input: T, output: T, axes: Ints, starts: Ints, ends: Ints, infer_flags: Ints = (),
                   decrease_axis: Ints = ()) -> SpmdResult:
    """input from output: the decreased axes put back, the sliced axes replicated."""
    mesh = common_mesh("slice", (input, output))
    p, ax, dec = _slice("slice", input.ndim, axes, len(starts), len(ends), decrease_axis, None, "copy", "backward")
    _check_sliced("slice", input, output, "output", ax, dec)
    return _answer("slice", p, (input,), (output,), mesh)


def _check_sliced(op: str, input: T, other: T, oname: str, ax: Ints, dec: Ints) -> None:
    """``other`` (output, out_grad) is input sliced on ``ax`` with the ``dec`` axes removed."""
    nd = input.ndim
    if other.ndim != nd - len(dec):
        raise ShapeMismatchError(f"{op}: {oname} has {other.ndim} dims; input has {nd} and "
                                 f"decrease_axis removes {len(dec)}")
    it = iter(other.shape)
    _check_shapes(op, "input", input.shape, oname, tuple(-1 if i in dec else next(it) for i in range(nd)), ax)


def _slice_grad(op: str, input: T, out_grad: T, p: Plan, ax: Ints, dec: Ints) -> SpmdResult:
    """input and out_grad merged (out_grad claims first), the sliced axes replicated;
    input_grad (out_grad padded back with zeros) sharded as input."""
    mesh = common_mesh(op, (input, out_grad))
    _check_sliced(op, input, out_grad, "out_grad", ax, dec)
    (g, x), outs = infer(p, op, (out_grad, input), (), mesh)
    return fast_result((x, g), outs)


def slice_grad(input: T, out_grad: T, axes: Ints, starts: Ints, ends: Ints, infer_flags: Ints = (),
               decrease_axis: Ints = ()) -> SpmdResult:
    key = _slice("slice_grad", input.ndim, axes, len(starts), len(ends), decrease_axis, None, "slice_grad")
    return _slice_grad("slice_grad", input, out_grad, *key)


def strided_slice_forward(input: T, axes: Ints, starts: Ints, ends: Ints, strides: Ints) -> SpmdResult:
    """The sliced axes replicated."""
    return _answer("strided_slice", _slice("strided_slice", input.ndim, axes, len(starts), len(ends), (),
                                           strides)[0], (input,))


def _strided_grad(op: str):  # type: ignore[no-untyped-def]
    def grad(input: T, out_grad: T, axes: Ints, starts: Ints, ends: Ints, strides: Ints) -> SpmdResult:
        key = _slice(op, input.ndim, axes, len(starts), len(ends), (), strides, "slice_grad")
        return _slice_grad(op, input, out_grad, *key)

    grad.__name__, grad.__doc__ = op, "As slice_grad (StridedSliceGradInferSpmd)."
    return grad


# -- tile -------------------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def _tile(op: str, nd: int, repeat_times: Ints, kind: str = "copy", direction: str = "forward") -> tuple[Plan, Ints, int]:
    """The plan for an ``nd``-D x tiled ``repeat_times`` (tiled axes ``1``, new leading axes),
    the repeats per out axis and the number of new leading axes."""
    if any(r < 0 for r in repeat_times):
        raise InvalidAttributeError(f"{op}: repeat_times {list(repeat_times)} has a negative entry")
    rep = (1,) * (nd - len(repeat_times)) + tuple(repeat_times)
    lead = len(rep) - nd
    return _plan(kind, nd, tuple(i for i in range(nd) if rep[lead + i] != 1), (), lead, "keep", direction), rep, lead


def _check_tiled(op: str, x: T, out: T, oname: str, rep: Ints, lead: int) -> None:
    if out.ndim != len(rep):
        raise ShapeMismatchError(f"{op}: {oname} has {out.ndim} dims, repeat_times makes {len(rep)}")
    for i, (s, r, o) in enumerate(zip((1,) * lead + x.shape, rep, out.shape)):
        if s >= 0 and o >= 0 and s * r != o:
            raise ShapeMismatchError(f"{op}: {oname} has size {o} on axis {i}; x tiled {r} times makes {s * r}")


def tile_forward(x: T, repeat_times: Ints) -> SpmdResult:
    """Tiled axes replicated; new leading axes replicated in out."""
    return _answer("tile", _tile("tile", x.ndim, repeat_times)[0], (x,))


def tile_backward(x: T, out: T, repeat_times: Ints) -> SpmdResult:
    """x from out's untiled axes; out returned as x produces it."""
    mesh = common_mesh("tile", (x, out))
    p, rep, lead = _tile("tile", x.ndim, repeat_times, "copy", "backward")
    _check_tiled("tile", x, out, "out", rep, lead)
    return _answer("tile", p, (x,), (out,), mesh)


def tile_grad(x: T, out_grad: T, repeat_times: Ints) -> SpmdResult:
    """x and out_grad merged on untiled axes; out_grad's new leading axes make x_grad partial."""
    mesh = common_mesh("tile_grad", (x, out_grad))
    p, rep, lead = _tile("tile_grad", x.ndim, repeat_times, "tile_grad")
    _check_tiled("tile_grad", x, out_grad, "out_grad", rep, lead)
    return _answer("tile_grad", p, (x, out_grad), (), mesh)


# -- expand_as / expand -----------------------------------------------------------------------


def _broadcast(op: str, xs: Shape, target: Shape, tname: str) -> tuple[Ints, int]:
    """The broadcast axes of x (size 1 expanded) and the number of new leading axes."""
    d = len(target) - len(xs)
    if d < 0:
        raise ShapeMismatchError(f"{op}: x has {len(xs)} dims, more than {tname} ({len(target)})")
    out = []
    for i, s in enumerate(xs):
        t = target[d + i]
        if t != -1 and t != s:
            if s != 1:
                raise ShapeMismatchError(f"{op}: x has size {s} on axis {i}, which cannot be expanded to {t} "
                                         f"({tname} axis {d + i})")
            out.append(i)
    return tuple(out), d


def _merged_by(op: str, kind: str, x: T, t: T, target: Shape, tname: str) -> SpmdResult:
    """x with t (y, out_grad), whose sharding alone decides (read as one mesh dim per axis)."""
    mesh = common_mesh(op, (x, t))
    bc, lead = _broadcast(op, x.shape, target, tname)
    return _answer(op, _plan(kind, x.ndim, bc, (), lead, "largest"), (x, t), (), mesh)


def expand_as_forward(x: T, y: T | None, target_shape: Ints = ()) -> SpmdResult:
    """out sharded as y; x as y on the axes it does not broadcast. Without y (Paddle allows it):
    out has target_shape, sharded as x on x's kept axes, broadcast and new axes replicated."""
    if y is None:
        bc, lead = _broadcast("expand_as", x.shape, tuple(target_shape), "target_shape")
        return _answer("expand_as", _plan("copy_noy", x.ndim, bc, (), lead), (x, None))
    return _merged_by("expand_as", "expand", x, y, y.shape, "y")


def expand_as_grad(x: T, out_grad: T, target_shape: Ints = ()) -> SpmdResult:
    """x_grad as x (out_grad's sharding where x is not broadcast); partial SUM over the mesh dims
    out_grad has on broadcast and new axes."""
    return _merged_by("expand_as_grad", "expand_grad", x, out_grad, out_grad.shape, "out_grad")


def _target(op: str, x: T, shape: Sequence[int]) -> Shape:
    d = len(shape) - x.ndim
    if d < 0:
        raise InvalidAttributeError(f"{op}: shape {list(shape)} has fewer entries than x has dims ({x.ndim})")
    for i, s in enumerate(shape):
        if s < -1 or (s == -1 and i < d):
            raise InvalidAttributeError(f"{op}: shape {list(shape)}: entry {i} ({s}) is not a size")
    return tuple(x.shape[i - d] if s == -1 else s for i, s in enumerate(shape))


def expand_forward(x: T, shape: Ints) -> SpmdResult:
    """Broadcast and new axes replicated, the others as x."""
    bc, lead = _broadcast("expand", x.shape, _target("expand", x, shape), "shape")
    return _answer("expand", _plan("copy", x.ndim, bc, (), lead), (x,))


def expand_backward(x: T, out: T, shape: Ints) -> SpmdResult:
    """x from out's non-broadcast axes; out returned as x produces it."""
    mesh = common_mesh("expand", (x, out))
    tgt = _target("expand", x, shape)
    bc, lead = _broadcast("expand", x.shape, tgt, "shape")
    _check_shapes("expand", "shape", tgt, "out", out.shape)
    return _answer("expand", _plan("copy", x.ndim, bc, (), lead, "keep", "backward"), (x,), (out,), mesh)


def expand_grad(x: T, out_grad: T, shape: Ints) -> SpmdResult:
    """As expand_as_grad, broadcast axes from ``shape``."""
    tgt = _target("expand_grad", x, shape)
    _check_shapes("expand_grad", "shape", tgt, "out_grad", out_grad.shape)
    return _merged_by("expand_grad", "expand_grad", x, out_grad, tgt, "shape")


# -- pad --------------------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def _pad(op: str, nd: int, paddings: Ints, coshard: str = "keep", direction: str = "forward") -> tuple[Plan, Ints]:
    """The plan of an ``nd``-D tensor padded by ``paddings`` and its padded axes."""
    if len(paddings) != 2 * nd:
        raise InvalidAttributeError(f"{op}: paddings has {len(paddings)} entries, a {nd}-D tensor needs {2 * nd}")
    padded = tuple(i for i in range(nd) if paddings[2 * i] != 0 or paddings[2 * i + 1] != 0)
    return _plan("copy", nd, padded, (), 0, coshard, direction), padded


def pad_forward(x: T, paddings: Ints, pad_value: int = 0) -> SpmdResult:
    """Padded axes replicated, the others as x."""
    return _answer("pad", _pad("pad", x.ndim, paddings)[0], (x,))


def pad_backward(x: T, out: T, paddings: Ints, pad_value: int = 0) -> SpmdResult:
    """(PadGradInferSpmd) x from out: padded axes replicated, the others as out (a co-shard read
    as its largest mesh dim)."""
    mesh = common_mesh("pad", (x, out))
    p, padded = _pad("pad", x.ndim, paddings, "largest", "backward")
    _check_shapes("pad", "x", x.shape, "out", out.shape, padded)
    return _answer("pad", p, (x,), (out,), mesh)


def pad_grad(out_grad: T, paddings: Ints, pad_value: float = 0) -> SpmdResult:
    """x_grad = out_grad cropped: padded axes replicated, the others as out_grad."""
    return _answer("pad_grad", _pad("pad_grad", out_grad.ndim, paddings)[0], (out_grad,))


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
    "strided_slice", strided_slice_forward, _SSLICE, _strided_grad("strided_slice"), _SSLICE_G, kind="grad",
    forward_name="StridedSliceInferSpmd", backward_name="StridedSliceGradInferSpmd",
)  # fmt: skip
register("strided_slice_grad", _strided_grad("strided_slice_grad"), _SSLICE_G, forward_name="StridedSliceGradInferSpmd")
for _name, _attr, _fwd, _rev, _grad in (("tile", "repeat_times", tile_forward, tile_backward, tile_grad),
                                        ("expand", "shape", expand_forward, expand_backward, expand_grad)):
    _p = _name.title()
    register(_name, _fwd, f"x: T, {_attr}: ints", _rev, kind="reverse", outputs="out: T",
             forward_name=f"{_p}InferSpmd", backward_name=f"{_p}InferSpmdReverse")
    register(f"{_name}_grad", _grad, f"x: T, out_grad: T, {_attr}: ints", forward_name=f"{_p}GradInferSpmd")
register(
    "expand_as", expand_as_forward, "x: T, y: T?, target_shape: ints = []",
    expand_as_grad, "x: T, out_grad: T, target_shape: ints = []", kind="grad", grad_name="expand_as_grad",
    grad_aliases=("expand_as_v2_grad",), aliases=("expand_as_v2",),
    forward_name="ExpandAsInferSpmd", backward_name="ExpandAsGradInferSpmd",
)  # fmt: skip
register(
    "pad", pad_forward, "x: T, paddings: ints, pad_value: int = 0",
    pad_backward, "x: T, out: T, paddings: ints, pad_value: int = 0", kind="grad",
    forward_name="PadInferSpmd", backward_name="PadGradInferSpmd",
)  # fmt: skip
register("pad_grad", pad_grad, "out_grad: T, paddings: ints, pad_value: scalar = 0",
         forward_name="PadGradInferSpmdDynamic")
