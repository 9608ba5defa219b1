"""The conv family: conv2d, conv3d, conv2d_transpose, depthwise_conv2d, batch_norm, group_norm,
instance_norm, roi_align and their grads.

Convolutions (Paddle 3.3.1's ``conv2d.cc``, ``conv3d.cc``, ``conv2d_transpose.cc``,
``depthwise_conv2d.cc``). ``n`` batch, ``c`` input channels, ``m`` output channels; the spatial
axes of input, filter and output get letters of their own that are always replicated (a
spatially split input would need the halo of its neighbours). NCHW, groups 1::

    conv2d / conv3d / depthwise   ncPQ, mcIJ -> nmXY      (out partial SUM over c's mesh dims)
    conv2d_transpose              ncPQ, cmIJ -> nmXY      (filter is [C_in, C_out / groups, k...])
    *_grad                        ncPQ, mcIJ, nmXY -> ncPQ, mcIJ
                                  (input_grad partial SUM over m's mesh dims, filter_grad over n's)

Channel-last formats (NHWC, NDHWC) put ``c`` last on the input and ``m`` last on the output
(Paddle's rules label the output ``nm..`` whatever the format: unsound there). With ``groups > 1``
the channels of one group live together, so ``c`` and ``m`` are replicated (a rank's kernel would
need a different ``groups``); only the batch is shardable (Paddle shards ``m`` of depthwise_conv2d
with groups = C: unsound). Where two tensors shard one letter over different mesh dims the larger
tensor wins (Paddle raises for conv2d's channels); partial inputs are resharded to replicated,
except that a grad rule keeps a SUM-partial ``out_grad`` over mesh dims no letter uses (the grads
are linear in it), and then both grads are partial there too. Reverse rules infer ``n``/``m``
from the output and return the output the inputs produce (Paddle echoes it: DESIGN class 4).
A co-sharded axis is read as its largest mesh dim, as Paddle 3.3.1 reads it. The list
attributes (strides, paddings, dilations, ...) default to ``[]``, which the simulator reads as
Paddle's defaults (ones / zeros); the rules do not depend on them (spatial axes are replicated).

Normalizations:

    batch_norm       only the channel axis c is shardable; mean / variance / scale / bias and
                     every statistic output are sharded like c (Paddle leaves scale / bias
                     replicated while x's channels are split: a rank's kernel then fails).
                     batch_norm_grad: scale_grad / bias_grad sharded like c (Paddle: replicated).
    group_norm       only the batch axis n is shardable; mean / variance are [N, groups] and get
                     ``[n, -1]`` (Paddle answers a 1-entry mapping: DESIGN class 5).
                     group_norm_grad: scale_grad / bias_grad partial SUM over n's mesh dims.
    instance_norm    n and c shardable, spatial replicated; saved_mean / saved_variance are
                     flat [N*C]: they carry n's and c's mesh dims co-sharded where that is the
                     same split of the flat axis (otherwise c, then n, is replicated). scale /
                     bias sharded like c. instance_norm_grad: scale_grad / bias_grad sharded like
                     c, partial SUM over n's mesh dims.
    roi_align        only x's channel axis is shardable (boxes, boxes_num, the batch and the
                     spatial axes replicated); out ``[-1, c, -1, -1]``; roi_align_grad: x_grad
                     sharded like x, never partial. Where x and out_grad shard the channels
                     differently the larger tensor wins (Paddle raises).

Deviations (docs/deviations.md, conv section): conv-spatial-sharded, conv-paddle-raises,
conv-reverse-out, conv-channel-last-out, conv-shape-checks, conv-grad-partial-channel,
dw-grouped-channels, bn-scale-bias, in-flat-stats, in-grad-paddle-raises, roi-grad-conflict,
roi-shape-checks, conv-norm-grads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spmdkit.core.dist_attr import DimsMapping, Entry, ReduceType, TensorDistAttr, dims_entry, entry_dims
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import largest_mesh_dim, mesh_size, one_mesh_dim_specs, replicated, replicated_like
from spmdkit.engine.memo import memo
from spmdkit.engine.notation import (
    Notation,
    check_letters,
    einsum_backward,
    einsum_forward,
    fast_result,
    merge_specs,
    merge_weight,
    named_mesh,
    project_all,
)
from spmdkit.rules.registry import register

_SUM = ReduceType.SUM
_make = TensorDistAttr.unchecked

# ---------------------------------------------------------------------------
# shared helpers
# ---------------------------------------------------------------------------


def _ndim(op: str, name: str, t: DistTensorSpec, want: int | tuple[int, ...]) -> int:
    nd = len(t.shape)
    ok = want if isinstance(want, tuple) else (want,)
    if nd not in ok:
        raise ShapeMismatchError(
            f"{op}: {name} must be {' or '.join(str(w) for w in ok)}-D, got shape {list(t.shape)}"
        )
    return nd


def _same_size(op: str, na: str, a: int, nb: str, b: int) -> None:
    if a >= 0 and b >= 0 and a != b:
        raise ShapeMismatchError(f"{op}: {na} is {a} but {nb} is {b}")


def _ones(*ts: DistTensorSpec | None) -> tuple[DistTensorSpec, ...]:
    """A co-sharded axis read as its largest mesh dim, as Paddle 3.3.1's rules read it."""
    return tuple(one_mesh_dim_specs(*ts))  # type: ignore[arg-type]


def _sum_partial(dims: Sequence[int]) -> tuple[tuple[int, ReduceType], ...]:
    return tuple((d, _SUM) for d in sorted(set(dims)))


def _e(t: DistTensorSpec, axis: int) -> Entry:
    """One axis' entry, a co-shard read as its largest mesh dim (as Paddle 3.3.1 reads it)."""
    return largest_mesh_dim(t.dist_attr.dims_mapping[axis], t.dist_attr.mesh.shape)


def _axis_dims(t: DistTensorSpec, axis: int) -> tuple[int, ...]:
    return entry_dims(_e(t, axis))


def _with_axis(nd: int, axis: int, e: Entry) -> DimsMapping:
    dm: list[Entry] = [-1] * nd
    dm[axis] = e
    return tuple(dm)


# ---------------------------------------------------------------------------
# convolution notations
# ---------------------------------------------------------------------------

_SPATIAL_IN = "pqr"
_SPATIAL_K = "ijk"
_SPATIAL_OUT = "xyz"


@memo()
def _conv_axes(nsp: int, channel_last: bool, grouped: bool, transpose: bool) -> tuple[str, str, str, str]:
    """(input, filter, output axes, replicated letters)."""
    s, k, o = _SPATIAL_IN[:nsp], _SPATIAL_K[:nsp], _SPATIAL_OUT[:nsp]
    if channel_last:
        x, out = "n" + s + "c", "n" + o + "m"
    else:
        x, out = "nc" + s, "nm" + o
    if transpose:
        w = "c" + ("g" if grouped else "m") + k
    else:
        w = "m" + ("g" if grouped else "c") + k
    rep = s + k + o + ("cmg" if grouped else "")
    return x, w, out, rep


@memo()
def _conv_notation(nsp: int, channel_last: bool, grouped: bool, transpose: bool) -> Notation:
    x, w, out, rep = _conv_axes(nsp, channel_last, grouped, transpose)
    return Notation((x, w), (out,), replicated=rep)


@memo()
def _conv_grad_notation(nsp: int, channel_last: bool, grouped: bool, transpose: bool) -> Notation:
    x, w, out, rep = _conv_axes(nsp, channel_last, grouped, transpose)
    return Notation((x, w, out), (x, w), replicated=rep)


_FORMATS = {
    2: {"NCHW": False, "NHWC": True, "AnyLayout": False},
    3: {"NCDHW": False, "NDHWC": True, "AnyLayout": False},
}


def _channel_last(op: str, data_format: str, nsp: int) -> bool:
    fm = _FORMATS[nsp]
    if data_format not in fm:
        raise InvalidAttributeError(
            f"{op}: data_format {data_format!r} is not one of {', '.join(sorted(fm))}"
        )
    return fm[data_format]


def _groups(op: str, groups: int) -> int:
    if groups < 1:
        raise InvalidAttributeError(f"{op}: groups must be >= 1, got {groups}")
    return groups


def _conv_checks(
    op: str,
    x: DistTensorSpec,
    w: DistTensorSpec,
    nsp: int,
    channel_last: bool,
    groups: int,
    transpose: bool,
) -> None:
    """input / filter ranks and channel counts (the input's channels are the filter's
    in-channel axis times groups; conv2d_transpose: the filter's first axis)."""
    nd = nsp + 2
    _ndim(op, "input", x, nd)
    _ndim(op, "filter", w, nd)
    cin = x.shape[-1] if channel_last else x.shape[1]
    if transpose:
        _same_size(op, "the input's channel count", cin, "the filter's first axis", w.shape[0])
        if cin >= 0 and groups > 1 and cin % groups:
            raise ShapeMismatchError(f"{op}: the input's {cin} channels are not divisible by groups {groups}")
    else:
        fc = w.shape[1]
        if cin >= 0 and fc >= 0 and cin != fc * groups:
            raise ShapeMismatchError(
                f"{op}: the input has {cin} channels, the filter expects {fc} x groups {groups} = {fc * groups}"
            )
        m = w.shape[0]
        if m >= 0 and groups > 1 and m % groups:
            raise ShapeMismatchError(f"{op}: the filter's {m} output channels are not divisible by groups {groups}")


def _out_checks(op: str, name: str, out: DistTensorSpec, x: DistTensorSpec, w: DistTensorSpec,
                nsp: int, channel_last: bool, groups: int, transpose: bool) -> None:
    _ndim(op, name, out, nsp + 2)
    _same_size(op, f"{name}'s batch", out.shape[0], "the input's batch", x.shape[0])
    oc = out.shape[-1] if channel_last else out.shape[1]
    m = w.shape[1] * groups if transpose else w.shape[0]
    if w.shape[1 if transpose else 0] >= 0:
        _same_size(op, f"{name}'s channel count", oc, "the filter's output channels", m)


_NAMES2 = ("input", "filter")
_NAMES3 = ("input", "filter", "output")
_GNAMES = ("input", "filter", "output_grad")


#: the hand-written forward for the plain case (channels first, groups 1, not transposed, no
#: co-shard); tests compare it with the notation engine, which answers every other case
FAST = True


def _conv_fast(x: DistTensorSpec, w: DistTensorSpec, nsp: int) -> SpmdResult | None:
    """``nc<spatial>, mc<kernel> -> nm<spatial>`` as the notation engine merges it: claims in
    order n, c (x), m, c (w: the larger tensor's c wins a disagreement), spatial letters
    replicated, a mesh dim taken by an earlier claim dropped; out partial SUM over c."""
    xa, wa = x.dist_attr, w.dist_attr
    xd, wd = xa.dims_mapping, wa.dims_mapping
    n, c, m, wc = xd[0], xd[1], wd[0], wd[1]
    if n.__class__ is not int or c.__class__ is not int or m.__class__ is not int or wc.__class__ is not int:
        return None  # a co-shard: the generic path collapses it first
    for e in xd[2:]:
        if e.__class__ is not int:
            return None
    for e in wd[2:]:
        if e.__class__ is not int:
            return None
    # c: the first claim is x's unless x leaves it unsharded; where both shard it differently
    # the larger tensor keeps its own (x on a tie)
    c_late = False  # c is claimed after m (x does not shard it, w does)
    if c < 0:
        if wc >= 0:
            c, c_late = wc, True
    elif wc >= 0 and wc != c and merge_weight(w.shape) > merge_weight(x.shape):
        c = wc
    used = 0
    if n >= 0:
        used = 1 << n
    if not c_late and c >= 0:
        if (used >> c) & 1:
            c = -1
        else:
            used |= 1 << c
    if m >= 0:
        if (used >> m) & 1:
            m = -1
        else:
            used |= 1 << m
    if c_late and (used >> c) & 1:
        c = -1
    mesh = xa.mesh
    rest = (-1,) * nsp
    pt = ((c, _SUM),) if c >= 0 else ()
    return fast_result((_make(mesh, (n, c, *rest)), _make(mesh, (m, c, *rest))), (_make(mesh, (n, m, *rest), pt),))


def _conv_forward(op: str, x: DistTensorSpec, w: DistTensorSpec, nsp: int, channel_last: bool,
                  groups: int, transpose: bool) -> SpmdResult:
    _conv_checks(op, x, w, nsp, channel_last, groups, transpose)
    named_mesh(op, zip(_NAMES2, (x, w)))
    if FAST and not channel_last and not transpose and groups == 1:
        r = _conv_fast(x, w, nsp)
        if r is not None:
            return r
    x, w = _ones(x, w)
    nt = _conv_notation(nsp, channel_last, groups > 1, transpose)
    ins, outs = einsum_forward(op, nt, (x, w), _NAMES2)
    return fast_result(tuple(ins), tuple(outs))


def _conv_reverse(op: str, x: DistTensorSpec, w: DistTensorSpec, out: DistTensorSpec, nsp: int,
                  channel_last: bool, groups: int, transpose: bool) -> SpmdResult:
    _conv_checks(op, x, w, nsp, channel_last, groups, transpose)
    _out_checks(op, "output", out, x, w, nsp, channel_last, groups, transpose)
    x, w, out = _ones(x, w, out)
    nt = _conv_notation(nsp, channel_last, groups > 1, transpose)
    named_mesh(op, zip(_NAMES3, (x, w, out)))
    ins, outs = einsum_backward(op, nt, (x, w), (out,), _NAMES3)
    return fast_result(tuple(ins), tuple(outs))


def _conv_grad(op: str, x: DistTensorSpec, w: DistTensorSpec, gy: DistTensorSpec, nsp: int,
               channel_last: bool, groups: int, transpose: bool) -> SpmdResult:
    _conv_checks(op, x, w, nsp, channel_last, groups, transpose)
    _out_checks(op, "output_grad", gy, x, w, nsp, channel_last, groups, transpose)
    mesh = named_mesh(op, zip(_GNAMES, (x, w, gy)))
    x, w, gy = _ones(x, w, gy)
    nt = _conv_grad_notation(nsp, channel_last, groups > 1, transpose)
    check_letters(op, nt.inputs, (x, w, gy), _GNAMES)
    merged = merge_specs(nt, nt.inputs, (x, w, gy), mesh)
    ins, outs = project_all(nt, merged, mesh)
    # a SUM-partial out_grad over mesh dims no letter uses stays partial: both grads are linear in it
    pt = gy.dist_attr.partial
    if pt:
        used = {d for _, ds in merged for d in ds}
        keep = tuple((d, r) for d, r in pt if r == _SUM and d not in used)
        if keep:
            g = ins[2]
            assert g is not None
            ins[2] = _make(mesh, g.dims_mapping, keep)
            for i in (0, 1):
                o = outs[i]
                assert o is not None
                outs[i] = _make(mesh, o.dims_mapping, tuple(sorted(dict(o.partial + keep).items())))
    return fast_result(tuple(ins), tuple(outs))


# ---------------------------------------------------------------------------
# conv2d (Conv2dInferSpmdBase / Conv2dInferSpmdReverseBase / Conv2dGradInferSpmd)
# ---------------------------------------------------------------------------


def conv2d_forward(input: DistTensorSpec, filter: DistTensorSpec) -> SpmdResult:
    """Conv2dInferSpmdBase: ``ncPQ, mcIJ -> nmXY`` (NCHW, groups 1); out partial SUM over c."""
    return _conv_forward("conv2d", input, filter, 2, False, 1, False)


def conv2d_backward(input: DistTensorSpec, filter: DistTensorSpec, output: DistTensorSpec) -> SpmdResult:
    """Conv2dInferSpmdReverseBase: n and m from the output; the output the inputs produce."""
    return _conv_reverse("conv2d", input, filter, output, 2, False, 1, False)


def _attr_names(sig: str) -> tuple[str, ...]:
    return tuple(part.split(":")[0].strip() for part in sig.split(", "))


def _conv_rule(op: str, sig: str, nd: int, transpose: bool, grad: bool, doc: str) -> Any:
    """A conv forward (``input, filter, *attrs``) or grad (``input, filter, output_grad,
    *attrs``) rule over the attributes of Paddle's signature ``sig`` (only ``groups`` and
    ``data_format`` decide a sharding; strides, paddings and dilations do not)."""
    names = _attr_names(sig)
    gi, fi = names.index("groups"), names.index("data_format")

    def fwd(input: DistTensorSpec, filter: DistTensorSpec, *attrs: Any) -> SpmdResult:
        groups, fmt = _conv_attrs(attrs, gi, fi, nd)
        return _conv_forward(op, input, filter, nd, _channel_last(op, fmt, nd), _groups(op, groups), transpose)

    def grd(input: DistTensorSpec, filter: DistTensorSpec, output_grad: DistTensorSpec, *attrs: Any) -> SpmdResult:
        groups, fmt = _conv_attrs(attrs, gi, fi, nd)
        return _conv_grad(op, input, filter, output_grad, nd, _channel_last(op, fmt, nd), _groups(op, groups),
                          transpose)

    fn = grd if grad else fwd
    fn.__name__ = fn.__qualname__ = f"{op}_{'rule' if grad else 'forward'}"
    fn.__doc__ = doc
    return fn


def _conv_attrs(attrs: tuple[Any, ...], gi: int, fi: int, nd: int) -> tuple[int, str]:
    groups = attrs[gi] if gi < len(attrs) else 1
    fmt = attrs[fi] if fi < len(attrs) else ("NCHW" if nd == 2 else "NCDHW")
    return groups, fmt


_CONV2D_ATTRS = ('strides: ints = [], paddings: ints = [], padding_algorithm: str = "EXPLICIT", '
                 'dilations: ints = [], groups: int = 1, data_format: str = "NCHW"')
_CONV3D_ATTRS = ('strides: ints = [], paddings: ints = [], padding_algorithm: str = "EXPLICIT", '
                 'groups: int = 1, dilations: ints = [], data_format: str = "NCDHW"')
_CT_ATTRS = ('strides: ints = [], paddings: ints = [], output_padding: ints = [], '
             'output_size: ints = [], padding_algorithm: str = "EXPLICIT", groups: int = 1, '
             'dilations: ints = [], data_format: str = "NCHW"')
_DW_ATTRS = ('strides: ints = [], paddings: ints = [], padding_algorithm: str = "EXPLICIT", '
             'groups: int = 1, dilations: ints = [], data_format: str = "NCHW"')

conv2d_grad = _conv_rule("conv2d_grad", _CONV2D_ATTRS, 2, False, True,
                         "Conv2dGradInferSpmd: ``ncPQ, mcIJ, nmXY -> ncPQ, mcIJ``; input_grad partial SUM "
                         "over m, filter_grad over n.")
conv3d_forward = _conv_rule("conv3d", _CONV3D_ATTRS, 3, False, False,
                            "Conv3dInferSpmd: ``ncPQR, mcIJK -> nmXYZ`` (NCDHW); NDHWC puts c / m last.")
conv3d_grad = _conv_rule("conv3d_grad", _CONV3D_ATTRS, 3, False, True,
                         "Conv3dGradInferSpmd: input_grad partial SUM over m, filter_grad over n.")
conv2d_transpose_forward = _conv_rule("conv2d_transpose", _CT_ATTRS, 2, True, False,
                                      "Conv2dTransposeInferSpmd: ``ncPQ, cmIJ -> nmXY``; out partial SUM over c.")
conv2d_transpose_grad = _conv_rule("conv2d_transpose_grad", _CT_ATTRS, 2, True, True,
                                   "Conv2dTransposeGradInferSpmd: input_grad partial SUM over m, filter_grad "
                                   "over n.")
depthwise_conv2d_forward = _conv_rule("depthwise_conv2d", _DW_ATTRS, 2, False, False,
                                      "DepthwiseConv2dInferSpmd: a grouped conv2d; with groups > 1 only the "
                                      "batch is shardable.")
depthwise_conv2d_grad = _conv_rule("depthwise_conv2d_grad", _DW_ATTRS, 2, False, True,
                                   "DepthwiseConv2dGradInferSpmd: the grouped conv grad; filter_grad partial SUM "
                                   "over n.")

register(
    "conv2d", conv2d_forward, "input: T, filter: T", conv2d_backward, kind="reverse", outputs="output: T",
    forward_name="Conv2dInferSpmdBase", backward_name="Conv2dInferSpmdReverseBase",
)  # fmt: skip
_G = "input: T, filter: T, output_grad: T, "
_F = "input: T, filter: T, "
register("conv2d_grad", conv2d_grad, _G + _CONV2D_ATTRS, forward_name="Conv2dGradInferSpmd")
register("conv3d", conv3d_forward, _F + _CONV3D_ATTRS, conv3d_grad, _G + _CONV3D_ATTRS, kind="grad", grad_name="conv3d_grad",
         forward_name="Conv3dInferSpmd", backward_name="Conv3dGradInferSpmd")
register("conv2d_transpose", conv2d_transpose_forward, _F + _CT_ATTRS, conv2d_transpose_grad, _G + _CT_ATTRS, kind="grad", grad_name="conv2d_transpose_grad",
         forward_name="Conv2dTransposeInferSpmd", backward_name="Conv2dTransposeGradInferSpmd")
register("depthwise_conv2d", depthwise_conv2d_forward, _F + _DW_ATTRS, depthwise_conv2d_grad, _G + _DW_ATTRS, kind="grad", grad_name="depthwise_conv2d_grad",
         forward_name="DepthwiseConv2dInferSpmd", backward_name="DepthwiseConv2dGradInferSpmd")


# ---------------------------------------------------------------------------
# normalization helpers
# ---------------------------------------------------------------------------


def _vec(op: str, name: str, t: DistTensorSpec | None, size: int) -> None:
    """A 1-D per-channel tensor (scale, bias, mean, ...) of ``size`` entries."""
    if t is None:
        return
    if len(t.shape) != 1:
        raise ShapeMismatchError(f"{op}: {name} must be 1-D, got shape {list(t.shape)}")
    _same_size(op, f"{name}'s length", t.shape[0], "the channel count", size)


def _same_shape(op: str, na: str, a: DistTensorSpec, nb: str, b: DistTensorSpec) -> None:
    if len(a.shape) != len(b.shape) or any(p != q and p >= 0 and q >= 0 for p, q in zip(a.shape, b.shape)):
        raise ShapeMismatchError(f"{op}: {nb} has shape {list(b.shape)}, {na} has {list(a.shape)}")


def _vec_attr(mesh: ProcessMesh, t: DistTensorSpec | None, e: Entry) -> TensorDistAttr | None:
    return None if t is None else _make(mesh, (e,))


# ---------------------------------------------------------------------------
# batch_norm (BatchNormInferSpmdStatic; own reverse; BatchNormGradInferSpmd)
# ---------------------------------------------------------------------------

_BN_NAMES = ("x", "mean", "variance", "scale", "bias")
_BN_OUT_NAMES = ("out", "mean_out", "variance_out", "saved_mean", "saved_variance", "reserve_space")


def _bn_channel(op: str, x: DistTensorSpec, data_format: str) -> int:
    nd = _ndim(op, "x", x, (2, 3, 4, 5))
    if len(data_format) < 2:
        raise InvalidAttributeError(f"{op}: data_format {data_format!r} is too short")
    return 1 if data_format[1] == "C" else nd - 1


def _bn_checks(op: str, x: DistTensorSpec, c: int, named: Sequence[tuple[str, DistTensorSpec | None]]) -> None:
    for name, t in named:
        _vec(op, name, t, x.shape[c])


def batch_norm_forward(
    x: DistTensorSpec,
    mean: DistTensorSpec,
    variance: DistTensorSpec,
    scale: DistTensorSpec | None,
    bias: DistTensorSpec | None,
) -> SpmdResult:
    """BatchNormInferSpmdStatic (training, NCHW): only the channel axis keeps its sharding;
    the per-channel inputs and statistics follow it."""
    op = "batch_norm"
    mesh = named_mesh(op, zip(_BN_NAMES, (x, mean, variance, scale, bias)))
    c = _bn_channel(op, x, "NCHW")
    _bn_checks(op, x, c, (("mean", mean), ("variance", variance), ("scale", scale), ("bias", bias)))
    return _bn_result(mesh, x, c, _e(x, c), (mean, variance, scale, bias), True)


def _bn_result(mesh: ProcessMesh, x: DistTensorSpec, c: int, e: Entry,
               vecs: Sequence[DistTensorSpec | None], reserve: bool | None) -> SpmdResult:
    xa = _make(mesh, _with_axis(len(x.shape), c, e))
    va = _make(mesh, (e,))
    ins = (xa, *(None if v is None else va for v in vecs))
    outs = (xa, va, va, va, va, replicated(mesh, 1) if reserve else None)
    return fast_result(ins, outs)


def batch_norm_backward(
    x: DistTensorSpec,
    mean: DistTensorSpec,
    variance: DistTensorSpec,
    scale: DistTensorSpec | None,
    bias: DistTensorSpec | None,
    out: DistTensorSpec,
    mean_out: DistTensorSpec,
    variance_out: DistTensorSpec,
    saved_mean: DistTensorSpec,
    saved_variance: DistTensorSpec,
    reserve_space: DistTensorSpec | None = None,
) -> SpmdResult:
    """Reverse of batch_norm (Paddle has none): the channel sharding from out and the
    statistics (the larger tensor wins a conflict); the outputs the inputs produce."""
    op = "batch_norm"
    mesh = named_mesh(op, zip(_BN_NAMES + _BN_OUT_NAMES,
                              (x, mean, variance, scale, bias, out, mean_out, variance_out, saved_mean,
                               saved_variance, reserve_space)))
    c = _bn_channel(op, x, "NCHW")
    _bn_checks(op, x, c, (("mean", mean), ("variance", variance), ("scale", scale), ("bias", bias),
                          ("mean_out", mean_out), ("variance_out", variance_out), ("saved_mean", saved_mean),
                          ("saved_variance", saved_variance)))
    _same_shape(op, "x", x, "out", out)
    e = _merge_one((out, mean_out, variance_out, saved_mean, saved_variance), (c, 0, 0, 0, 0), mesh)
    return _bn_result(mesh, x, c, e, (mean, variance, scale, bias), reserve_space is not None)


def _merge_one(ts: Sequence[DistTensorSpec], axes: Sequence[int], mesh: ProcessMesh) -> Entry:
    """One letter's sharding over several tensors' axes (merge_letters: the first tensor
    sharding it claims it, a larger one sharding it otherwise wins)."""
    nt = _one_letter_notation(tuple(len(t.shape) for t in ts), tuple(axes))
    merged = merge_specs(nt, nt.inputs, _ones(*ts), mesh)
    return dims_entry(dict(merged).get("a", ()))


@memo()
def _one_letter_notation(ndims: tuple[int, ...], axes: tuple[int, ...]) -> Notation:
    labels = []
    for nd, ax in zip(ndims, axes):
        labels.append("".join("a" if i == ax else "1" for i in range(nd)))
    return Notation(tuple(labels), ())


def batch_norm_grad(
    x: DistTensorSpec,
    scale: DistTensorSpec | None,
    bias: DistTensorSpec | None,
    mean_out: DistTensorSpec,
    variance_out: DistTensorSpec,
    saved_mean: DistTensorSpec,
    saved_variance: DistTensorSpec,
    reserve_space: DistTensorSpec | None,
    out_grad: DistTensorSpec,
    momentum: float = 0.9,
    epsilon: float = 1e-5,
    data_format: str = "NCHW",
    is_test: bool = False,
    use_global_stats: bool = False,
    trainable_statistics: bool = False,
) -> SpmdResult:
    """BatchNormGradInferSpmd: x's channel sharding for every per-channel tensor and grad."""
    op = "batch_norm_grad"
    names = ("x", "scale", "bias", "mean_out", "variance_out", "saved_mean", "saved_variance", "reserve_space",
             "out_grad")
    ts = (x, scale, bias, mean_out, variance_out, saved_mean, saved_variance, reserve_space, out_grad)
    mesh = named_mesh(op, zip(names, ts))
    c = _bn_channel(op, x, data_format)
    _bn_checks(op, x, c, (("scale", scale), ("bias", bias), ("mean_out", mean_out), ("variance_out", variance_out),
                          ("saved_mean", saved_mean), ("saved_variance", saved_variance)))
    _same_shape(op, "x", x, "out_grad", out_grad)
    e = _e(x, c)
    xa = _make(mesh, _with_axis(len(x.shape), c, e))
    va = _make(mesh, (e,))
    ins = (xa, _vec_attr(mesh, scale, e), _vec_attr(mesh, bias, e), va, va, va, va,
           replicated_like(mesh, reserve_space), xa)
    outs = (xa, _vec_attr(mesh, scale, e), _vec_attr(mesh, bias, e))
    return fast_result(ins, outs)


register(
    "batch_norm", batch_norm_forward, "x: T, mean: T, variance: T, scale: T?, bias: T?",
    batch_norm_backward,
    kind="reverse", outputs="out: T, mean_out: T, variance_out: T, saved_mean: T, saved_variance: T, reserve_space: T? = None",
    forward_name="BatchNormInferSpmdStatic", backward_name="BatchNormInferSpmdReverse",
)  # fmt: skip
register(
    "batch_norm_grad", batch_norm_grad,
    "x: T, scale: T?, bias: T?, mean_out: T, variance_out: T, saved_mean: T, saved_variance: T, "
    "reserve_space: T?, out_grad: T, momentum: float = 0.9, epsilon: float = 1e-5, "
    'data_format: str = "NCHW", is_test: bool = False, use_global_stats: bool = False, '
    "trainable_statistics: bool = False",
    forward_name="BatchNormGradInferSpmd",
)  # fmt: skip

# ---------------------------------------------------------------------------
# group_norm (GroupNormInferSpmdBase; own reverse; GroupNormGradInferSpmd)
# ---------------------------------------------------------------------------

_GN_NAMES = ("x", "scale", "bias")


def _gn_checks(op: str, x: DistTensorSpec, scale: DistTensorSpec | None, bias: DistTensorSpec | None,
               data_format: str = "NCHW") -> int:
    nd = _ndim(op, "x", x, (3, 4, 5))
    c = 1 if len(data_format) > 1 and data_format[1] == "C" else nd - 1
    _vec(op, "scale", scale, x.shape[c])
    _vec(op, "bias", bias, x.shape[c])
    return c


def _gn_stat(op: str, name: str, t: DistTensorSpec, x: DistTensorSpec) -> None:
    if len(t.shape) != 2:
        raise ShapeMismatchError(f"{op}: {name} must be 2-D [N, groups], got shape {list(t.shape)}")
    _same_size(op, f"{name}'s first axis", t.shape[0], "x's batch", x.shape[0])


def _gn_result(mesh: ProcessMesh, x: DistTensorSpec, e: Entry, scale: DistTensorSpec | None,
               bias: DistTensorSpec | None) -> SpmdResult:
    xa = _make(mesh, _with_axis(len(x.shape), 0, e))
    st = _make(mesh, (e, -1))
    return fast_result((xa, replicated_like(mesh, scale), replicated_like(mesh, bias)), (xa, st, st))


def group_norm_forward(x: DistTensorSpec, scale: DistTensorSpec | None, bias: DistTensorSpec | None) -> SpmdResult:
    """GroupNormInferSpmdBase: ``n...`` -> out ``n...``, mean / variance ``[n, -1]``."""
    op = "group_norm"
    mesh = named_mesh(op, zip(_GN_NAMES, (x, scale, bias)))
    _gn_checks(op, x, scale, bias)
    return _gn_result(mesh, x, _e(x, 0), scale, bias)


def group_norm_backward(
    x: DistTensorSpec,
    scale: DistTensorSpec | None,
    bias: DistTensorSpec | None,
    y: DistTensorSpec,
    mean: DistTensorSpec,
    variance: DistTensorSpec,
) -> SpmdResult:
    """Reverse of group_norm (Paddle has none): n from y, mean and variance."""
    op = "group_norm"
    mesh = named_mesh(op, zip(("x", "scale", "bias", "y", "mean", "variance"), (x, scale, bias, y, mean, variance)))
    _gn_checks(op, x, scale, bias)
    _same_shape(op, "x", x, "y", y)
    _gn_stat(op, "mean", mean, x)
    _gn_stat(op, "variance", variance, x)
    e = _merge_one((y, mean, variance), (0, 0, 0), mesh)
    return _gn_result(mesh, x, e, scale, bias)


def group_norm_grad(
    x: DistTensorSpec,
    scale: DistTensorSpec | None,
    bias: DistTensorSpec | None,
    y: DistTensorSpec,
    mean: DistTensorSpec,
    variance: DistTensorSpec,
    y_grad: DistTensorSpec,
    epsilon: float = 1e-5,
    groups: int = -1,
    data_format: str = "NCHW",
) -> SpmdResult:
    """GroupNormGradInferSpmd: x's batch sharding everywhere; scale_grad / bias_grad
    replicated, partial SUM over the batch's mesh dims."""
    op = "group_norm_grad"
    mesh = named_mesh(op, zip(("x", "scale", "bias", "y", "mean", "variance", "y_grad"),
                              (x, scale, bias, y, mean, variance, y_grad)))
    _gn_checks(op, x, scale, bias, data_format)
    _same_shape(op, "x", x, "y", y)
    _same_shape(op, "x", x, "y_grad", y_grad)
    _gn_stat(op, "mean", mean, x)
    _gn_stat(op, "variance", variance, x)
    if groups != -1 and groups < 1:
        raise InvalidAttributeError(f"{op}: groups must be >= 1 (or -1), got {groups}")
    e = _e(x, 0)
    xa = _make(mesh, _with_axis(len(x.shape), 0, e))
    st = _make(mesh, (e, -1))
    pt = _sum_partial(entry_dims(e))
    g_s = None if scale is None else _make(mesh, (-1,), pt)
    g_b = None if bias is None else _make(mesh, (-1,), pt)
    ins = (xa, replicated_like(mesh, scale), replicated_like(mesh, bias), xa, st, st, xa)
    return fast_result(ins, (xa, g_s, g_b))


register(
    "group_norm", group_norm_forward, "x: T, scale: T?, bias: T?",
    group_norm_backward, kind="reverse", outputs="y: T, mean: T, variance: T",
    forward_name="GroupNormInferSpmdBase", backward_name="GroupNormInferSpmdReverse",
)  # fmt: skip
register(
    "group_norm_grad", group_norm_grad,
    "x: T, scale: T?, bias: T?, y: T, mean: T, variance: T, y_grad: T, epsilon: float = 1e-5, "
    'groups: int = -1, data_format: str = "NCHW"',
    forward_name="GroupNormGradInferSpmd",
)  # fmt: skip

# ---------------------------------------------------------------------------
# instance_norm (InstanceNormInferSpmd / InstanceNormGradInferSpmd)
# ---------------------------------------------------------------------------


def _chunks(size: int, n: int) -> list[tuple[int, int]]:
    chunk = -(-size // n) if size > 0 else 0
    return [(min(i * chunk, size), min(min(i * chunk, size) + chunk, size)) for i in range(n)]


@memo()
def _flat_ok(n_size: int, c_size: int, kn: int, kc: int) -> bool:
    """Is the [N, C] block split (kn x kc pieces) the same as splitting the flat [N*C] axis
    into kn * kc pieces (major first)?"""
    if kn == 1 and kc == 1:
        return True
    if n_size < 0 or c_size < 0:
        return False
    flat = _chunks(n_size * c_size, kn * kc)
    for i, (nlo, nhi) in enumerate(_chunks(n_size, kn)):
        for j, (clo, chi) in enumerate(_chunks(c_size, kc)):
            flo, fhi = flat[i * kc + j]
            if nhi <= nlo or chi <= clo:
                if fhi > flo:
                    return False
                continue
            if nhi - nlo != 1 and (clo != 0 or chi != c_size):
                return False
            if (flo, fhi) != (nlo * c_size + clo, (nhi - 1) * c_size + chi):
                return False
    return True


def _in_split(x: DistTensorSpec, dn: tuple[int, ...], dc: tuple[int, ...], ms: tuple[int, ...]) -> tuple[
        tuple[int, ...], tuple[int, ...]]:
    """The n / c mesh dims kept so that the flat statistics can carry them."""
    n, c = x.shape[0], x.shape[1]
    kn, kc = mesh_size(ms, dn), mesh_size(ms, dc)
    if _flat_ok(n, c, kn, kc):
        return dn, dc
    if _flat_ok(n, c, kn, 1):  # c's split does not fit the flat axis: c replicated
        return dn, ()
    if _flat_ok(n, c, 1, kc):
        return (), dc
    return (), ()


def _in_checks(op: str, x: DistTensorSpec, scale: DistTensorSpec | None, bias: DistTensorSpec | None) -> None:
    _ndim(op, "x", x, 4)
    _vec(op, "scale", scale, x.shape[1])
    _vec(op, "bias", bias, x.shape[1])


def _in_flat(op: str, name: str, t: DistTensorSpec, x: DistTensorSpec) -> None:
    if len(t.shape) != 1:
        raise ShapeMismatchError(f"{op}: {name} must be 1-D [N*C], got shape {list(t.shape)}")
    n, c = x.shape[0], x.shape[1]
    if n >= 0 and c >= 0:
        _same_size(op, f"{name}'s length", t.shape[0], "N*C", n * c)


def instance_norm_forward(
    x: DistTensorSpec, scale: DistTensorSpec | None, bias: DistTensorSpec | None, epsilon: float = 1e-5
) -> SpmdResult:
    """InstanceNormInferSpmd: ``nc11`` -> y ``nc11``, saved_mean / saved_variance flat ``(n c)``."""
    op = "instance_norm"
    mesh = named_mesh(op, zip(_GN_NAMES, (x, scale, bias)))
    _in_checks(op, x, scale, bias)
    dn, dc = _in_split(x, _axis_dims(x, 0), _axis_dims(x, 1), mesh.shape)
    xa = _make(mesh, (dims_entry(dn), dims_entry(dc), -1, -1))
    st = _make(mesh, (dims_entry(dn + dc),))
    ca = _make(mesh, (dims_entry(dc),))
    return fast_result((xa, None if scale is None else ca, None if bias is None else ca), (xa, st, st))


def instance_norm_grad(
    x: DistTensorSpec,
    scale: DistTensorSpec | None,
    bias: DistTensorSpec | None,
    saved_mean: DistTensorSpec,
    saved_variance: DistTensorSpec,
    y_grad: DistTensorSpec,
    epsilon: float = 1e-5,
) -> SpmdResult:
    """InstanceNormGradInferSpmd: x's n / c sharding; scale_grad / bias_grad sharded like c,
    partial SUM over n's mesh dims."""
    op = "instance_norm_grad"
    mesh = named_mesh(op, zip(("x", "scale", "bias", "saved_mean", "saved_variance", "y_grad"),
                              (x, scale, bias, saved_mean, saved_variance, y_grad)))
    _in_checks(op, x, scale, bias)
    _in_flat(op, "saved_mean", saved_mean, x)
    _in_flat(op, "saved_variance", saved_variance, x)
    _same_shape(op, "x", x, "y_grad", y_grad)
    dn, dc = _in_split(x, _axis_dims(x, 0), _axis_dims(x, 1), mesh.shape)
    xa = _make(mesh, (dims_entry(dn), dims_entry(dc), -1, -1))
    st = _make(mesh, (dims_entry(dn + dc),))
    ca = _make(mesh, (dims_entry(dc),))
    ga = _make(mesh, (dims_entry(dc),), _sum_partial(dn))
    ins = (xa, None if scale is None else ca, None if bias is None else ca, st, st, xa)
    return fast_result(ins, (xa, None if scale is None else ga, None if bias is None else ga))


_IN_GRAD_SIG = "x: T, scale: T?, bias: T?, saved_mean: T, saved_variance: T, y_grad: T, epsilon: float = 1e-5"
register(
    "instance_norm", instance_norm_forward, "x: T, scale: T?, bias: T?, epsilon: float = 1e-5",
    instance_norm_grad, _IN_GRAD_SIG, kind="grad", grad_name="instance_norm_grad",
    forward_name="InstanceNormInferSpmd", backward_name="InstanceNormGradInferSpmd",
)  # fmt: skip

# ---------------------------------------------------------------------------
# roi_align (RoiAlignInferSpmd / RoiAlignGradInferSpmd)
# ---------------------------------------------------------------------------

_ROI_ATTRS = ("pooled_height: int, pooled_width: int, spatial_scale: float, sampling_ratio: int, "
              "aligned: bool")


def _roi_checks(op: str, x: DistTensorSpec, boxes: DistTensorSpec, boxes_num: DistTensorSpec | None,
                pooled_height: int, pooled_width: int) -> None:
    _ndim(op, "x", x, 4)
    _ndim(op, "boxes", boxes, 2)
    if boxes.shape[1] not in (4, -1):
        raise ShapeMismatchError(f"{op}: boxes must be [num_boxes, 4] (x1, y1, x2, y2), got shape {list(boxes.shape)}")
    if boxes_num is not None:
        _ndim(op, "boxes_num", boxes_num, 1)
        _same_size(op, "boxes_num's length", boxes_num.shape[0], "x's batch", x.shape[0])
    if pooled_height < 1 or pooled_width < 1:
        raise InvalidAttributeError(
            f"{op}: pooled_height / pooled_width must be >= 1, got {pooled_height} / {pooled_width}"
        )


def roi_align_forward(
    x: DistTensorSpec,
    boxes: DistTensorSpec,
    boxes_num: DistTensorSpec | None,
    pooled_height: int,
    pooled_width: int,
    spatial_scale: float,
    sampling_ratio: int,
    aligned: bool,
) -> SpmdResult:
    """RoiAlignInferSpmd: x ``-c--``, boxes / boxes_num replicated -> out ``-c--``."""
    op = "roi_align"
    mesh = named_mesh(op, zip(("x", "boxes", "boxes_num"), (x, boxes, boxes_num)))
    _roi_checks(op, x, boxes, boxes_num, pooled_height, pooled_width)
    e = _e(x, 1)
    xa = _make(mesh, (-1, e, -1, -1))
    return fast_result((xa, replicated(mesh, 2), replicated_like(mesh, boxes_num)), (xa,))


def roi_align_grad(
    x: DistTensorSpec,
    boxes: DistTensorSpec,
    boxes_num: DistTensorSpec | None,
    out_grad: DistTensorSpec,
    pooled_height: int,
    pooled_width: int,
    spatial_scale: float,
    sampling_ratio: int,
    aligned: bool,
) -> SpmdResult:
    """RoiAlignGradInferSpmd: the channel sharding of x and out_grad merged; x_grad like x."""
    op = "roi_align_grad"
    mesh = named_mesh(op, zip(("x", "boxes", "boxes_num", "out_grad"), (x, boxes, boxes_num, out_grad)))
    _roi_checks(op, x, boxes, boxes_num, pooled_height, pooled_width)
    _ndim(op, "out_grad", out_grad, 4)
    _same_size(op, "out_grad's first axis", out_grad.shape[0], "the number of boxes", boxes.shape[0])
    _same_size(op, "out_grad's channels", out_grad.shape[1], "x's channels", x.shape[1])
    e = _merge_one((x, out_grad), (1, 1), mesh)
    xa = _make(mesh, (-1, e, -1, -1))
    return fast_result((xa, replicated(mesh, 2), replicated_like(mesh, boxes_num), xa), (xa,))


_ROI_GRAD_SIG = "x: T, boxes: T, boxes_num: T?, out_grad: T, " + _ROI_ATTRS
register(
    "roi_align", roi_align_forward, "x: T, boxes: T, boxes_num: T?, " + _ROI_ATTRS,
    roi_align_grad, _ROI_GRAD_SIG, kind="grad", grad_name="roi_align_grad",
    forward_name="RoiAlignInferSpmd", backward_name="RoiAlignGradInferSpmd",
)  # fmt: skip
