"""slice, strided_slice, tile, expand_as, expand, pad and their grads.

Each op changes the extent of some axes and copies the others through: in its :func:`notation`
(keyed by kind, rank, the fixed axes, ...; never shapes) an axis whose extent changes (sliced,
tiled, padded, broadcast) is ``1`` (replicated), the others keep their letter and so their
sharding. Partial status is cleared, as in Paddle.

* ``slice(input, axes, starts, ends, infer_flags, decrease_axis)``: notation ``a1c -> ac`` for
  axes [1], decrease_axis [1]: the axes in ``axes`` replicated, the decreased ones dropped from
  the output. Paddle answers the output with one entry per *input* axis (DESIGN class 5);
  spmdkit drops the decreased axes. The reverse rule inserts the decreased axes back and
  replicates the sliced ones (Paddle raises when decrease_axis is not empty).
  ``slice_grad(input, out_grad, ...)``: input and out_grad merged per axis (out_grad claims
  first, the sliced axes replicated); input_grad (out_grad padded back with zeros) sharded as input.
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
  replicated, a co-shard read as its largest mesh dim). ``pad_grad(out_grad, paddings,
  pad_value)`` (Paddle's PadGradInferSpmdDynamic): x_grad = out_grad with the padded axes replicated.

Deviations from Paddle 3.3.1 (docs/deviations.md): slice-decrease-out, slice-reverse-decrease,
slice-invalid-decrease, strided-slice-sharded-axis (Paddle keeps a sliced last axis sharded),
tile-reverse-out, pad-coshard (Paddle answers one mesh dim for out, co-shard for x),
expand-as-no-y (Paddle returns x as given without y).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.declare import Let, Way, declare
from spmdkit.engine.facts import facts
from spmdkit.engine.notation import BROADCAST, Coshard, Notation, letters_for
from spmdkit.engine.outshape import Args, Expect, UnknownShape, axis_of
from spmdkit.engine.shapes import mismatch
from spmdkit.ops._cost import copy

T = DistTensorSpec
Ints = tuple[int, ...]
#: a plan's key: kind, coshard, rank, the fixed axes, the dropped (decreased) axes, new leading axes
Key = tuple[str, str, int, Ints, Ints, int]


def notation(kind: str, coshard: Coshard, nd: int, fixed: Ints, drop: Ints = (), lead: int = 0) -> Notation:
    """``x``: the ``nd``-D tensor's letters, its ``fixed`` axes ``1``; ``y``: x's image, ``lead``
    new leading axes (``1``) and the ``drop`` axes removed; ``g``: y's gradient, its new leading
    axes (for expand also the broadcast axes) letters x_grad lacks (partial SUM over their mesh
    dims). ``copy``: ``x -> y`` (slice, strided_slice, tile, expand, pad: either direction);
    ``copy_noy``: ``x, _ -> y`` (expand_as without y); ``slice_grad``: ``y, x -> x``; ``tile_grad``:
    ``x, g -> x``; ``expand``: ``x, g -> g`` (expand_as: y alone merged, x as y where kept);
    ``expand_grad``: ``x, g -> x`` (out_grad alone merged)."""
    full = letters_for(nd)
    x = "".join(BROADCAST if i in fixed else c for i, c in enumerate(full))
    y = BROADCAST * lead + "".join(c for i, c in enumerate(x) if i not in drop)
    g = letters_for(lead, nd) + (full if kind.startswith("expand") else x)
    table: dict[str, tuple[tuple[str | None, ...], str]] = {
        "copy": ((x,), y), "copy_noy": ((x, None), y), "slice_grad": ((y, x), x), "tile_grad": ((x, g), x),
        "expand": ((x, g), g), "expand_grad": ((x, g), x),
    }  # fmt: skip
    ins, out = table[kind]
    return Notation(ins, [out], coshard=coshard, sources=(1,) if kind.startswith("expand") else None)


def _norm_axes(name: str, axes: Sequence[int], ndim: int) -> Ints:
    out = tuple(a + ndim if a < 0 else a for a in axes)
    for a, n in zip(axes, out):
        if not 0 <= n < ndim:
            raise InvalidAttributeError(f"{name} entry {a} is out of range [{-ndim}, {ndim}) for a {ndim}-D input")
    if len(set(out)) != len(out):
        raise InvalidAttributeError(f"{name} {list(axes)} names an axis twice")
    return out


def _check_shapes(na: str, a: Ints, nb: str, b: Ints, skip: Sequence[int] = ()) -> None:
    i = mismatch(a, b, skip)
    if i == -1:
        raise ShapeMismatchError(f"{nb} has {len(b)} dims, {na} has {len(a)}")
    if i is not None:
        raise ShapeMismatchError(f"{na} and {nb} differ on axis {i} ({a[i]} vs {b[i]})")


@lru_cache(maxsize=4096)
def _slice_key(kind: str, nd: int, axes: Ints, n_starts: int, n_ends: int, decrease: Ints,
               strides: Ints | None = None) -> Key:
    """The sliced axes fixed, the decreased ones (sorted) dropped; the attributes checked."""
    ax = _norm_axes("axes", axes, nd)
    if n_starts != len(ax) or n_ends != len(ax):
        raise InvalidAttributeError(f"starts ({n_starts}), ends ({n_ends}) need one entry per axis in axes ({len(ax)})")
    if strides is not None and (len(strides) != len(ax) or 0 in strides):
        raise InvalidAttributeError(f"strides {list(strides)} must hold one nonzero stride per axis ({len(ax)})")
    dec = _norm_axes("decrease_axis", decrease, nd)
    for d in dec:
        if d not in ax:
            raise InvalidAttributeError(f"decrease_axis {d} is not a sliced axis (axes {list(axes)})")
    return kind, Coshard.LARGEST, nd, ax, tuple(sorted(dec)), 0


def _sliced(k: Key, input: T, other: T, oname: str) -> Key:
    """``k``, ``other`` (output, out_grad) checked to be input sliced with the decreased axes removed."""
    nd, ax, dec = k[2], k[3], k[4]
    if len(other.shape) != nd - len(dec):
        raise ShapeMismatchError(f"{oname} has {len(other.shape)} dims; input has {nd}, decrease_axis drops {len(dec)}")
    it = iter(other.shape)
    _check_shapes("input", input.shape, oname, tuple(-1 if i in dec else next(it) for i in range(nd)), ax)
    return k


@lru_cache(maxsize=4096)
def _tile_key(kind: str, nd: int, repeat_times: Ints) -> tuple[Key, Ints]:
    """The tiled axes fixed, new leading axes; and the repeats per out axis."""
    if any(r < 0 for r in repeat_times):
        raise InvalidAttributeError(f"repeat_times {list(repeat_times)} has a negative entry")
    rep = (1,) * (nd - len(repeat_times)) + tuple(repeat_times)
    lead = len(rep) - nd
    return (kind, Coshard.KEEP, nd, tuple(i for i in range(nd) if rep[lead + i] != 1), (), lead), rep


def _tiled(kind: str, x: T, out: T, oname: str, repeat_times: Ints) -> Key:
    """The key, ``out`` (out, out_grad) checked to be x tiled."""
    k, rep = _tile_key(kind, len(x.shape), repeat_times)
    if len(out.shape) != len(rep):
        raise ShapeMismatchError(f"{oname} has {len(out.shape)} dims, repeat_times makes {len(rep)}")
    for i, (s, r, o) in enumerate(zip((1,) * k[5] + x.shape, rep, out.shape)):
        if s >= 0 and o >= 0 and s * r != o:
            raise ShapeMismatchError(f"{oname} has size {o} on axis {i}; x tiled {r} times makes {s * r}")
    return k


def _broadcast(kind: str, x: T, target: Ints, tname: str) -> Key:
    """x expanded to ``target``: its broadcast axes (size 1 expanded) fixed, new leading axes; a
    co-shard kept by a copy, read as its largest mesh dim where y / out_grad is merged."""
    xs = x.shape
    d = len(target) - len(xs)
    if d < 0:
        raise ShapeMismatchError(f"x has {len(xs)} dims, more than {tname} ({len(target)})")
    out = []
    for i, s in enumerate(xs):
        t = target[d + i]
        if t != -1 and t != s:
            if s != 1:
                raise ShapeMismatchError(f"x has size {s} on axis {i}, not expandable to {t} ({tname} axis {d + i})")
            out.append(i)
    return kind, Coshard.KEEP if kind.startswith("copy") else Coshard.LARGEST, len(xs), tuple(out), (), d


def _target(x: T, shape: Sequence[int], out: T | None = None, oname: str = "") -> Ints:
    """expand's target shape (``-1``: x's size), checked against ``out`` where given."""
    d = len(shape) - len(x.shape)
    if d < 0:
        raise InvalidAttributeError(f"shape {list(shape)} has fewer entries than x has dims ({len(x.shape)})")
    for i, s in enumerate(shape):
        if s < -1 or (s == -1 and i < d):
            raise InvalidAttributeError(f"shape {list(shape)}: entry {i} ({s}) is not a size")
    tgt = tuple(x.shape[i - d] if s == -1 else s for i, s in enumerate(shape))
    if out is not None:
        _check_shapes("shape", tgt, oname, out.shape)
    return tgt


@lru_cache(maxsize=4096)
def _pad_key(coshard: Coshard, nd: int, paddings: Ints) -> Key:
    """The padded axes fixed."""
    if len(paddings) != 2 * nd:
        raise InvalidAttributeError(f"paddings has {len(paddings)} entries, a {nd}-D tensor needs {2 * nd}")
    return "copy", coshard, nd, tuple(i for i in range(nd) if paddings[2 * i] or paddings[2 * i + 1]), (), 0


def _padded(x: T, out: T, paddings: Ints) -> Key:
    k = _pad_key(Coshard.LARGEST, len(x.shape), paddings)
    _check_shapes("x", x.shape, "out", out.shape, k[3])
    return k


# -- the declarations: a key expression (``*f(...)``: f's tuple) per mode ----------------------

_ENV: dict[str, Any] = {"_sk": _slice_key, "_sliced": _sliced, "_tk": _tile_key, "_tiled": _tiled,
                        "_bk": _broadcast, "_target": _target, "_pk": _pad_key, "_padded": _padded, "Coshard": Coshard}  # fmt: skip
_SLICE = "input: T, axes: ints, starts: ints, ends: ints, infer_flags: ints = [], decrease_axis: ints = []"
_SLICE_G = _SLICE.replace("input: T,", "input: T, out_grad: T,")
_SSLICE = "input: T, axes: ints, starts: ints, ends: ints, strides: ints"
_SSLICE_G = _SSLICE.replace("input: T,", "input: T, out_grad: T,")
_SK = "_sk('{}', len(input.shape), axes, len(starts), len(ends), {})"


def _slice_grad_key(input: T, axes: Ints, starts: Ints, ends: Ints, decrease_axis: Ints) -> Key:
    return _slice_key("slice_grad", len(input.shape), axes, len(starts), len(ends), decrease_axis)


def _strided_grad_key(input: T, axes: Ints, starts: Ints, ends: Ints, strides: Ints) -> Key:
    return _slice_key("slice_grad", len(input.shape), axes, len(starts), len(ends), (), strides)


def _grad(key: Callable[..., Key], paddle: str, doc: str) -> Way:
    """slice_grad / strided_slice's grad: out_grad labelled first (it claims mesh dims first, as in
    Paddle); the attributes (``key``, bound to ``kk``) checked before the mesh is read (``pre``), as
    before the rules were declared."""
    return Way(notation, key="*_sliced(kk, input, out_grad, 'out_grad')", pre=Let("kk", key), order="out_grad, input",
               env=_ENV, paddle=paddle, doc=doc)  # fmt: skip

declare(
    "slice", _SLICE,
    Way(notation, key="*" + _SK.format("copy", "decrease_axis"), env=_ENV, paddle="SliceInferSpmd",
        doc="The sliced axes replicated; the decreased axes dropped from the output."),
    reverse=Way(notation, key=f"*_sliced({_SK.format('copy', 'decrease_axis')}, input, output, 'output')",
                env=_ENV, paddle="SliceInferSpmdReverse",
                doc="input from output: the decreased axes put back, the sliced axes replicated."),
    outputs="output: T",
)  # fmt: skip
declare("slice_grad", _SLICE_G, _grad(_slice_grad_key, "SliceGradInferSpmdDynamic",
                                      "input and out_grad merged; input_grad sharded as input."))
_SS_GRAD = (_strided_grad_key, "StridedSliceGradInferSpmd", "As slice_grad.")
declare("strided_slice", _SSLICE, Way(notation, key="*" + _SK.format("copy", "(), strides"), env=_ENV,
                                      paddle="StridedSliceInferSpmd", doc="The sliced axes replicated."),
        grad=_grad(*_SS_GRAD), grad_signature=_SSLICE_G, grad_op="strided_slice")
declare("strided_slice_grad", _SSLICE_G, _grad(*_SS_GRAD))
declare(
    "tile", "x: T, repeat_times: ints",
    Way(notation, key="*_tk('copy', len(x.shape), repeat_times)[0]", env=_ENV, paddle="TileInferSpmd",
        doc="Tiled axes replicated; new leading axes replicated in out."),
    reverse=Way(notation, key="*_tiled('copy', x, out, 'out', repeat_times)", env=_ENV, paddle="TileInferSpmdReverse",
                doc="x from out's untiled axes; out returned as x produces it."),
    outputs="out: T",
)  # fmt: skip
declare("tile_grad", "x: T, out_grad: T, repeat_times: ints",
        Way(notation, key="*_tiled('tile_grad', x, out_grad, 'out_grad', repeat_times)", env=_ENV,
            paddle="TileGradInferSpmd", doc="x and out_grad merged on untiled axes; new leading axes: x_grad partial."))
declare(
    "expand", "x: T, shape: ints",
    Way(notation, key="*_bk('copy', x, _target(x, shape), 'shape')", env=_ENV, paddle="ExpandInferSpmd",
        doc="Broadcast and new axes replicated, the others as x."),
    reverse=Way(notation, key="*_bk('copy', x, _target(x, shape, out, 'out'), 'shape')", env=_ENV,
                paddle="ExpandInferSpmdReverse", doc="x from out's non-broadcast axes; out returned as x produces it."),
    outputs="out: T",
)  # fmt: skip
def _expand_grad_target(x: T, shape: Sequence[int], out_grad: T) -> Ints:
    return _target(x, shape, out_grad, "out_grad")


# shape checked before the mesh is read (as before the rule was declared), bound to tg
declare("expand_grad", "x: T, out_grad: T, shape: ints",
        Way(notation, key="*_bk('expand_grad', x, tg, 'shape')", pre=Let("tg", _expand_grad_target),
            env=_ENV, paddle="ExpandGradInferSpmd", doc="As expand_as_grad, broadcast axes from ``shape``."))
declare(
    "expand_as", "x: T, y: T?, target_shape: ints = []",
    Way(notation, key="*(_bk('copy_noy', x, tuple(target_shape), 'target_shape') if y is None else "
        "_bk('expand', x, y.shape, 'y'))", env=_ENV, paddle="ExpandAsInferSpmd",
        doc="out sharded as y; x as y on the axes it does not broadcast (without y: out has target_shape)."),
    grad=Way(notation, key="*_bk('expand_grad', x, out_grad.shape, 'out_grad')", env=_ENV,
             paddle="ExpandAsGradInferSpmd", doc="x_grad as x; partial SUM over out_grad's broadcast axes' mesh dims."),
    grad_signature="x: T, out_grad: T, target_shape: ints = []", grad_name="expand_as_grad",
    grad_aliases=("expand_as_v2_grad",), aliases=("expand_as_v2",),
)  # fmt: skip
_PAD = "x: T, paddings: ints, pad_value: int = 0"
_PAD_G = "x: T, out: T, paddings: ints, pad_value: int = 0"
declare("pad", _PAD, Way(notation, key="*_pk(Coshard.KEEP, len(x.shape), paddings)", env=_ENV, paddle="PadInferSpmd",
                         doc="Padded axes replicated, the others as x."),
        grad=Way(notation, key="*_padded(x, out, paddings)", env=_ENV, direction="backward", outputs=("out",),
                 paddle="PadGradInferSpmd", doc="(PadGradInferSpmd) x from out: padded axes replicated."),
        grad_signature=_PAD_G, grad_op="pad")
declare("pad_grad", "out_grad: T, paddings: ints, pad_value: scalar = 0",
        Way(notation, key="*_pk(Coshard.KEEP, len(out_grad.shape), paddings)", env=_ENV, paddle="PadGradInferSpmdDynamic",
            doc="x_grad = out_grad cropped: padded axes replicated, the others as out_grad."))


# -- output shapes / grads ----------------------------------------------------------------------


def _expand_shape(a: Args) -> list[Expect]:
    """``shape``, a -1 keeping x's size (x's axes are the trailing ones)."""
    x = a.s("x")
    shape = list(a.a("shape"))
    if len(shape) < len(x):
        raise UnknownShape
    off = len(shape) - len(x)
    out = []
    for i, v in enumerate(shape):
        if v == -1:
            if i < off:
                raise UnknownShape
            v = x[i - off]
        out.append(v)
    return [tuple(out)]


def _expand_as_shape(a: Args) -> list[Expect]:
    y = a.opt("y")
    t = tuple(a.a("target_shape") or ())
    if t:
        return [t]
    if y is None:
        raise UnknownShape
    return [y]


def _tile_shape(a: Args) -> list[Expect]:
    x = a.s("x")
    rep = list(a.a("repeat_times"))
    nd = max(len(x), len(rep))
    xs = (1,) * (nd - len(x)) + x
    rs = [1] * (nd - len(rep)) + rep
    return [tuple(u * v for u, v in zip(xs, rs))]


def _slice_size(size: int, start: int, end: int, step: int = 1) -> int:
    return len(range(*slice(start, end, step).indices(size)))


def _slice_shape(a: Args) -> list[Expect]:
    x = a.s("input")
    out: list[int | None] = list(x)
    for ax, st, en in zip(a.a("axes"), a.a("starts"), a.a("ends")):
        i = axis_of(ax, len(x))
        out[i] = _slice_size(x[i], st, en)
    dec = {axis_of(d, len(x)) for d in a.a("decrease_axis") or ()}
    return [tuple(v for i, v in enumerate(out) if i not in dec)]


def _strided_slice_shape(a: Args) -> list[Expect]:
    x = a.s("input")
    out: list[int | None] = list(x)
    for ax, st, en, sd in zip(a.a("axes"), a.a("starts"), a.a("ends"), a.a("strides")):
        i = axis_of(ax, len(x))
        if sd == 0:
            raise UnknownShape
        out[i] = _slice_size(x[i], st, en, sd)
    return [tuple(out)]


def _padded_shape(x: tuple[int, ...], paddings: Any, sign: int) -> tuple[int, ...]:
    """``x`` with Paddle's per-axis (before, after) ``paddings`` added (``sign`` 1) or taken off (-1)."""
    p = list(paddings)
    if len(p) != 2 * len(x):
        raise UnknownShape
    return tuple(v + sign * (p[2 * i] + p[2 * i + 1]) for i, v in enumerate(x))


def _pad_shape(a: Args) -> list[Expect]:
    return [_padded_shape(a.s("x"), a.a("paddings"), 1)]


def _pad_grad_shape(a: Args) -> list[Expect]:
    return [_padded_shape(a.s("out_grad"), a.a("paddings"), -1)]


facts("expand", shape=_expand_shape, grad="expand_grad", wrt=("x",))
facts("expand_as", shape=_expand_as_shape)
facts("tile", shape=_tile_shape, grad="tile_grad", wrt=("x",))
facts("slice", shape=_slice_shape, grad="slice_grad", wrt=("input",))
facts("strided_slice", shape=_strided_slice_shape, grad="strided_slice_grad", wrt=("input",))
facts("pad", shape=_pad_shape, grad="pad_grad", wrt=("x",))
facts("pad_grad", shape=_pad_grad_shape)


# -- cost

facts("expand", "expand_grad", "expand_as", "expand_as_grad", "pad", "pad_grad", "slice", "slice_grad",
      "strided_slice", "strided_slice_grad", "tile", "tile_grad", cost=copy)
