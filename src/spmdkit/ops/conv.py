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

Every rule is a declaration (``engine.declare``): a notation per key (rank, layout, groups > 1,
optional tensors present; never per shape), its checks, and two post-hooks for what no notation
says: the conv grads' SUM-partial output_grad and instance_norm's flat statistics (above).

Deviations (docs/deviations.md, conv section): conv-spatial-sharded, conv-paddle-raises,
conv-reverse-out, conv-channel-last-out, conv-shape-checks, conv-grad-partial-channel,
dw-grouped-channels, bn-scale-bias, in-flat-stats, in-grad-paddle-raises, roi-grad-conflict,
roi-shape-checks, conv-norm-grads.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from spmdkit.core.dist_attr import ReduceType, TensorDistAttr, dims_entry, entry_dims
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec as T
from spmdkit.engine.axes import largest_mesh_dim, mesh_size
from spmdkit.engine.declare import Answer, PartialIn, Way, declare
from spmdkit.engine.facts import LocalOp, LocalTensor, OpCost, facts
from spmdkit.engine.memo import memo
from spmdkit.engine.notation import ALPHABET, BROADCAST, Coshard, Notation
from spmdkit.engine.outshape import Args, Expect, UnknownShape
from spmdkit.ops._cost import by_bytes, numel

_make = TensorDistAttr.unchecked


def conv_notation(grad: bool, nsp: int, transpose: bool, channel_last: bool, grouped: bool) -> Notation:
    """A conv rule's notation (module docstring) for ``nsp`` spatial axes, the layout, groups > 1."""
    s, k, o = "pqr"[:nsp], "ijk"[:nsp], "xyz"[:nsp]
    x, out = ("n" + s + "c", "n" + o + "m") if channel_last else ("nc" + s, "nm" + o)
    w = "c" + ("g" if grouped else "m") + k if transpose else "m" + ("g" if grouped else "c") + k
    rep = s + k + o + ("cmg" if grouped else "")
    return Notation((x, w, out) if grad else (x, w), (x, w) if grad else (out,), rep, coshard=Coshard.LARGEST)


def _keep(ins: tuple[str | None, ...], outs: tuple[str | None, ...], keep: str, sources: Any = (0,)) -> Notation:
    """The normalizations' and roi_align's notations: every letter but ``keep``'s replicated."""
    every = set("".join(a for a in (*ins, *outs) if a)) - {BROADCAST}
    return Notation(ins, outs, "".join(sorted(every - set(keep))), coshard=Coshard.LARGEST, sources=sources)


def bn_notation(kind: str, nd: int, ci: int, scale: int, bias: int, reserve: int = -1) -> Notation:
    """x ``abc..``, its channel letter (axis ``ci``) on every per-channel tensor; scale / bias /
    reserve_space: their ranks (-1: absent). forward / reverse: the outputs labelled among the
    inputs (``Way.tail``: never partial; the reverse merges the given ones)."""
    if nd > 5:
        raise ShapeMismatchError(f"x must be at most 5-D, got a {nd}-D x")
    xl, c = ALPHABET[:nd], ALPHABET[ci]
    s, b = (c if scale >= 0 else None), (c if bias >= 0 else None)
    outs = (xl, c, c, c, c)
    if kind == "grad":
        return _keep((xl, s, b, c, c, c, c, None if reserve < 0 else BROADCAST * reserve, xl), (xl, s, b), c)
    if kind == "reverse":
        return _keep((xl, c, c, s, b, *outs, None, *outs, None if reserve < 0 else "1"), (), c, range(5, 10))
    return _keep((xl, c, c, s, b, *outs, "1"), (), c)


def gn_notation(kind: str, nd: int, scale: int, bias: int) -> Notation:
    """group_norm's notations (kind: forward, reverse, grad): the batch letter ``a`` alone shardable."""
    if nd > 5:
        raise ShapeMismatchError(f"x must be at most 5-D, got a {nd}-D x")
    xl = ALPHABET[:nd]
    sb = ("1" if scale >= 0 else None, "1" if bias >= 0 else None)
    if kind == "grad":
        return _keep((xl, *sb, xl, "a1", "a1", xl), (xl, *sb), "a")
    return _keep((xl, *sb), (xl, "a1", "a1"), "a")


def in_notation(grad: bool, keep: str, scale: int, bias: int) -> Notation:
    """``abcd``, scale / bias ``b``; the flat statistics are left to :func:`_flat_stats` (None)."""
    sb = ("b" if scale >= 0 else None, "b" if bias >= 0 else None)
    if grad:
        return _keep(("abcd", *sb, None, None, "abcd"), ("abcd", *sb), keep)
    return _keep(("abcd", *sb), ("abcd", None, None), keep)


def roi_notation(grad: bool, boxes_num: int) -> Notation:
    """x ``abcd``, boxes ``11``; x and out_grad merged in the grad, x_grad like x."""
    ins = ("abcd", "11", None if boxes_num < 0 else "1")
    return _keep((*ins, "1b11"), ("abcd",), "b", None) if grad else _keep(ins, ("1b11",), "b", None)


# -- checks (what the shapes DSL cannot say), instance_norm's key, the two post-hooks ------------
def _channels(transpose: bool, input: T, filter: T, output: T | None = None, output_grad: T | None = None,
              data_format: str = "NCHW", groups: int = 1) -> None:  # fmt: skip
    """The input has the filter's in-channels x groups (conv2d_transpose: its first axis), groups
    divide the channels they split, and the reverse rule's output / the grad's output_grad has the
    filter's output channels (conv2d's forward and reverse have no attributes: NCHW, groups 1)."""
    out, name = (output, "output") if output is not None else (output_grad, "output_grad")
    channel_last = data_format in ("NHWC", "NDHWC")
    cin = input.shape[-1] if channel_last else input.shape[1]
    w0, w1g = filter.shape[0], filter.shape[1] * groups if filter.shape[1] >= 0 else -1
    fin, m = (w0, w1g) if transpose else (w1g, w0)
    if cin >= 0 and fin >= 0 and cin != fin:
        raise ShapeMismatchError(f"the input has {cin} channels, the filter expects {fin} (groups {groups})")
    split = cin if transpose else m
    if split >= 0 and groups > 1 and split % groups:
        raise ShapeMismatchError(f"{split} channels are not divisible by groups {groups}")
    mo = -1 if out is None else out.shape[-1] if channel_last else out.shape[1]
    if mo >= 0 and m >= 0 and mo != m:
        raise ShapeMismatchError(f"{name}'s channel count is {mo} but the filter's output channels is {m}")


def _lengths(what: str, size: int, **vecs: T | None) -> None:
    """The given 1-D ``vecs`` have ``size`` entries (-1: unknown; x's channels by data_format, N*C)."""
    for name, t in vecs.items():
        if t is not None and size >= 0 and t.shape[0] >= 0 and t.shape[0] != size:
            raise ShapeMismatchError(f"{name}'s length is {t.shape[0]} but {what} is {size}")


def _pooled(pooled_height: int, pooled_width: int) -> None:
    """A check, not ``require``: after the shapes (a bad boxes shape raises ShapeMismatchError first)."""
    if pooled_height < 1 or pooled_width < 1:
        raise InvalidAttributeError(f"pooled_height / pooled_width must be >= 1, got {pooled_height} / {pooled_width}")


def _chunks(size: int, n: int) -> list[tuple[int, int]]:
    chunk = -(-size // n) if size > 0 else 0
    return [(min(i * chunk, size), min(min(i * chunk, size) + chunk, size)) for i in range(n)]


@memo()
def _flat_ok(n_size: int, c_size: int, kn: int, kc: int) -> bool:
    """Is the [N, C] block split (kn x kc pieces) the flat [N*C] axis split in kn * kc (major first)?"""
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


def _in_keep(x: T) -> str:
    """instance_norm: the letters of n (``a``) and c (``b``) that stay sharded: those whose split
    the flat statistics can carry (c's dropped first, then n's). Chooses the notation."""
    ms = x.dist_attr.mesh.shape
    kn, kc = (mesh_size(ms, entry_dims(largest_mesh_dim(e, ms))) for e in x.dist_attr.dims_mapping[:2])
    for keep, a, b in (("ab", kn, kc), ("a", kn, 1), ("b", 1, kc)):
        if _flat_ok(x.shape[0], x.shape[1], a, b):
            return keep
    return ""


def _linear_partial(ins: Any, outs: Any, x: T, w: T, output_grad: T, *attrs: Any) -> Answer:
    """Post-hook of the conv grads: a SUM-partial output_grad over mesh dims no letter uses stays
    partial, and both grads are partial there too (linear in it); no notation keeps a partial input."""
    used = {d for a in ins for e in a.dims_mapping for d in entry_dims(e)}
    keep = tuple((d, r) for d, r in output_grad.dist_attr.partial if r == ReduceType.SUM and d not in used)
    if not keep:
        return ins, outs
    mesh = ins[0].mesh
    grads = tuple(_make(mesh, o.dims_mapping, tuple(sorted(dict(o.partial + keep).items()))) for o in outs)
    return (ins[0], ins[1], _make(mesh, ins[2].dims_mapping, keep)), grads


def _flat_stats(ins: Any, outs: Any, *args: Any) -> Answer:
    """Post-hook of instance_norm: a flat [N*C] statistic carries n's mesh dims then c's, co-sharded
    (one axis with two letters, which no notation labels), read off the engine's answer for x."""
    dm = ins[0].dims_mapping
    st = _make(ins[0].mesh, (dims_entry(entry_dims(dm[0]) + entry_dims(dm[1])),))
    return ((*ins[:3], st, st, ins[5]), outs) if len(ins) == 6 else (ins, (outs[0], st, st))


def _bn_lengths(x: T, data_format: str, scale: T | None, bias: T | None, mean_out: T, variance_out: T,
                saved_mean: T, saved_variance: T) -> None:  # fmt: skip
    _lengths("the channel count", x.shape[1 if data_format[1] == "C" else -1], scale=scale, bias=bias,
             mean_out=mean_out, variance_out=variance_out, saved_mean=saved_mean, saved_variance=saved_variance)


def _gn_lengths(x: T, data_format: str, scale: T | None, bias: T | None) -> None:
    _lengths("the channel count", x.shape[1 if len(data_format) > 1 and data_format[1] == "C" else -1], scale=scale,
             bias=bias)  # fmt: skip


def _in_lengths(x: T, saved_mean: T, saved_variance: T) -> None:
    nc = x.shape[0] * x.shape[1] if min(x.shape[:2]) >= 0 else -1
    _lengths("N*C", nc, saved_mean=saved_mean, saved_variance=saved_variance)


_ENV = {"_in_keep": _in_keep}


# -- declarations -------------------------------------------------------------------------------
def _conv(grad: bool, nsp: int, transpose: bool, attrs: bool, out: str, paddle: str, doc: str) -> Way:
    """A conv rule's mode; ``attrs``: the signature has Paddle's attributes (conv2d's forward and
    reverse have none: NCHW, groups 1); ``out``: the third tensor (output / output_grad) or ''."""
    sp = " _" * nsp
    fmts = ("NCHW", "NHWC", "AnyLayout") if nsp == 2 else ("NCDHW", "NDHWC", "AnyLayout")
    last, groups = ("data_format in ('NHWC', 'NDHWC')", "groups") if attrs else ("False", "1")  # the key's
    return Way(
        partial(conv_notation, grad, nsp, transpose), key=f"{last}, {groups} > 1",
        require=(f"data_format in {fmts!r}", "groups >= 1") if attrs else (),
        shapes=f"input: n _{sp}; filter: _ _{sp}" + (f"; {out}: n _{sp}" if out else ""),
        check=partial(_channels, transpose),
        post=_linear_partial if grad else None, post_if=PartialIn("output_grad") if grad else None,
        paddle=paddle, doc=f"{paddle}: {doc}",
    )  # fmt: skip


_SP, _ALG = "strides: ints = [], paddings: ints = [], ", 'padding_algorithm: str = "EXPLICIT", '
_GDF = "groups: int = 1, dilations: ints = [], data_format: str = "
_CT = _SP + "output_padding: ints = [], output_size: ints = [], " + _ALG + _GDF + '"NCHW"'
_F, _G = "input: T, filter: T, ", "input: T, filter: T, output_grad: T, "
_GDOC = "input_grad partial SUM over m's mesh dims, filter_grad over n's."
declare(
    "conv2d", "input: T, filter: T",
    _conv(False, 2, False, False, "", "Conv2dInferSpmdBase", "``ncPQ, mcIJ -> nmXY`` (NCHW, groups 1)."),
    reverse=_conv(False, 2, False, False, "output", "Conv2dInferSpmdReverseBase", "n and m from the output."),
    outputs="output: T",
)  # fmt: skip
declare(
    "conv2d_grad",
    _G + _SP + _ALG + 'dilations: ints = [], groups: int = 1, data_format: str = "NCHW"',
    _conv(True, 2, False, True, "output_grad", "Conv2dGradInferSpmd", "``ncPQ, mcIJ, nmXY -> ncPQ, mcIJ``; " + _GDOC),
)
for _op, _nsp, _tr, _sig, _fn, _fdoc in (
    ("conv3d", 3, False, _SP + _ALG + _GDF + '"NCDHW"', "Conv3d", "``ncPQR, mcIJK -> nmXYZ`` (NCDHW)."),
    ("conv2d_transpose", 2, True, _CT, "Conv2dTranspose", "``ncPQ, cmIJ -> nmXY``; out partial SUM over c."),
    ("depthwise_conv2d", 2, False, _SP + _ALG + _GDF + '"NCHW"', "DepthwiseConv2d", "a grouped conv2d."),
):
    declare(
        _op, _F + _sig, _conv(False, _nsp, _tr, True, "", f"{_fn}InferSpmd", _fdoc),
        grad=_conv(True, _nsp, _tr, True, "output_grad", f"{_fn}GradInferSpmd", _GDOC),
        grad_signature=_G + _sig, grad_name=f"{_op}_grad",
    )  # fmt: skip

_BN = "x: _ c ...; mean: c; variance: c; scale: c; bias: c"
_BN_CI = "1 if data_format[1] == 'C' else -1"
declare(
    "batch_norm", "x: T, mean: T, variance: T, scale: T?, bias: T?",
    Way(partial(bn_notation, "forward"), key="x, 1, scale, bias", shapes=_BN, tail=6, paddle="BatchNormInferSpmdStatic",
        doc="BatchNormInferSpmdStatic (training, NCHW): x's channel sharding for every per-channel tensor."),
    reverse=Way(partial(bn_notation, "reverse"), key="x, 1, scale, bias, reserve_space", tail=6,
                shapes=_BN + "; mean_out: c; variance_out: c; saved_mean: c; saved_variance: c", same=[("x", "out")],
                paddle="BatchNormInferSpmdReverse", doc="Reverse of batch_norm (Paddle has none): c from the outputs."),
    outputs="out: T, mean_out: T, variance_out: T, saved_mean: T, saved_variance: T, reserve_space: T? = None",
)  # fmt: skip
declare(
    "batch_norm_grad",
    "x: T, scale: T?, bias: T?, mean_out: T, variance_out: T, saved_mean: T, saved_variance: T, reserve_space: T?, "
    'out_grad: T, momentum: float = 0.9, epsilon: float = 1e-5, data_format: str = "NCHW", is_test: bool = False, '
    "use_global_stats: bool = False, trainable_statistics: bool = False",
    Way(partial(bn_notation, "grad"), key=f"x, ({_BN_CI}) % len(x.shape), scale, bias, reserve_space",
        require=("len(data_format) >= 2",), same=[("x", "out_grad")],
        shapes="x: _ _ ...; scale: _; bias: _; mean_out: _; variance_out: _; saved_mean: _; saved_variance: _",
        check=_bn_lengths,
        paddle="BatchNormGradInferSpmd", doc="BatchNormGradInferSpmd: c's sharding on every per-channel tensor."),
)  # fmt: skip

_GN = "x: n c _ ...; scale: c; bias: c"
declare(
    "group_norm", "x: T, scale: T?, bias: T?",
    Way(partial(gn_notation, "forward"), key="x, scale, bias", shapes=_GN, paddle="GroupNormInferSpmdBase",
        doc="GroupNormInferSpmdBase: ``a...`` -> y ``a...``, mean / variance ``[a, -1]``."),
    reverse=Way(partial(gn_notation, "reverse"), key="x, scale, bias", shapes=_GN + "; mean: n _; variance: n _",
                same=[("x", "y")], paddle="GroupNormInferSpmdReverse", doc="group_norm's reverse: n from the outputs."),
    outputs="y: T, mean: T, variance: T",
)  # fmt: skip
declare(
    "group_norm_grad", "x: T, scale: T?, bias: T?, y: T, mean: T, variance: T, y_grad: T, epsilon: float = 1e-5, "
    'groups: int = -1, data_format: str = "NCHW"',
    Way(partial(gn_notation, "grad"), key="x, scale, bias", require=("groups == -1 or groups >= 1",),
        shapes="x: n _ _ ...; scale: _; bias: _; mean: n _; variance: n _", same=[("x", "y"), ("x", "y_grad")],
        check=_gn_lengths,
        paddle="GroupNormGradInferSpmd", doc="GroupNormGradInferSpmd: scale_grad / bias_grad partial SUM over n."),
)  # fmt: skip

_IN = "x: _ c _ _; scale: c; bias: c"
declare(
    "instance_norm", "x: T, scale: T?, bias: T?, epsilon: float = 1e-5",
    Way(partial(in_notation, False), key="_in_keep(x), scale, bias", shapes=_IN, env=_ENV, post=_flat_stats,
        paddle="InstanceNormInferSpmd", doc="InstanceNormInferSpmd: ``abcd`` -> ``abcd``, flat ``(a b)``."),
    grad=Way(partial(in_notation, True), key="_in_keep(x), scale, bias", env=_ENV, post=_flat_stats,
             shapes=_IN + "; saved_mean: _; saved_variance: _", same=[("x", "y_grad")],
             check=_in_lengths,
             paddle="InstanceNormGradInferSpmd", doc="InstanceNormGradInferSpmd: x's n / c sharding."),
    grad_signature="x: T, scale: T?, bias: T?, saved_mean: T, saved_variance: T, y_grad: T, epsilon: float = 1e-5",
    grad_name="instance_norm_grad",
)  # fmt: skip

_ROI = "x: n c _ _; boxes: r 4; boxes_num: n"
_ROI_ATTRS = "pooled_height: int, pooled_width: int, spatial_scale: float, sampling_ratio: int, aligned: bool"
declare(
    "roi_align", "x: T, boxes: T, boxes_num: T?, " + _ROI_ATTRS,
    Way(partial(roi_notation, False), key="boxes_num", shapes=_ROI, check=_pooled,
        paddle="RoiAlignInferSpmd", doc="RoiAlignInferSpmd: x ``-c--`` -> out ``-c--``."),
    grad=Way(partial(roi_notation, True), key="boxes_num", shapes=_ROI + "; out_grad: r c _ _", check=_pooled,
             paddle="RoiAlignGradInferSpmd", doc="RoiAlignGradInferSpmd: x and out_grad merged."),
    grad_signature="x: T, boxes: T, boxes_num: T?, out_grad: T, " + _ROI_ATTRS, grad_name="roi_align_grad",
)  # fmt: skip


# -- output shapes / grads ----------------------------------------------------------------------


def _geometry_ints(v: Any, n: int, fill: int) -> list[int]:
    """A per-spatial-axis attribute: empty means ``fill``, one value means every axis."""
    vals = list(v or ())
    if not vals:
        return [fill] * n
    if len(vals) == 1:
        return vals * n
    if len(vals) != n:
        raise UnknownShape
    return vals


def _conv_pads(v: Any, n: int) -> list[tuple[int, int]]:
    """Paddle's conv paddings: one per spatial axis (both sides) or (before, after) pairs."""
    p = list(v or ()) or [0]
    if len(p) == 1:
        p = p * n
    if len(p) == n:
        return [(x, x) for x in p]
    if len(p) == 2 * n:
        return [(p[2 * i], p[2 * i + 1]) for i in range(n)]
    raise UnknownShape


def _conv_out(a: Args, x_sp: Sequence[int], k_sp: Sequence[int], transpose: bool) -> list[int | None]:
    """The spatial output sizes (Paddle's ConvInferMeta / ConvTransposeInferMeta)."""
    n = len(x_sp)
    st = _geometry_ints(a.a("strides"), n, 1)
    dil = _geometry_ints(a.a("dilations"), n, 1)
    alg = str(a.a("padding_algorithm", "EXPLICIT"))
    if any(v <= 0 for v in st + dil):
        raise UnknownShape
    if alg == "SAME" and not transpose:
        return [-(-s // t) for s, t in zip(x_sp, st)]
    if alg == "VALID":
        pads = [(0, 0)] * n
    elif alg == "EXPLICIT":
        pads = _conv_pads(a.a("paddings"), n)
    else:
        return [None] * n
    if not transpose:
        return [(s + p[0] + p[1] - d * (k - 1) - 1) // t + 1 for s, k, t, p, d in zip(x_sp, k_sp, st, pads, dil)]
    size = list(a.a("output_size") or ())
    if size:
        return [v if isinstance(v, int) and v > 0 else None for v in _geometry_ints(size, n, 0)]
    extra = _geometry_ints(a.a("output_padding"), n, 0)
    return [(s - 1) * t - p[0] - p[1] + d * (k - 1) + 1 + e
            for s, k, t, p, d, e in zip(x_sp, k_sp, st, pads, dil, extra)]


def _conv_shape(transpose: bool, a: Args) -> list[Expect]:
    """Batch, channel and (where the rule takes the geometry attributes) spatial axes."""
    x, w = a.s("input"), a.s("filter")
    nd = len(x)
    if nd < 3 or len(w) != nd:
        raise UnknownShape
    fmt = str(a.a("data_format", "NCHW"))
    last = fmt in ("NHWC", "NDHWC")
    x_sp = x[1:-1] if last else x[2:]
    if transpose:
        g = a.a("groups", 1)
        channels: int | None = w[1] * g if isinstance(g, int) and g > 0 else None
    else:
        channels = w[0]
    geometry = any(p.startswith("strides") for p in a.values)
    spatial = _conv_out(a, x_sp, w[2:], transpose) if geometry else [None] * len(x_sp)
    return [tuple([x[0], *spatial, channels] if last else [x[0], channels, *spatial])]


def _batch_norm_shape(a: Args) -> list[Expect]:
    """out like x; the running and saved statistics like the running mean ([C], whichever
    axis of x the channels are); reserve_space is kernel workspace."""
    x, mean = a.s("x"), a.opt("mean")
    return [x, mean, a.opt("variance"), mean, mean, None]


def _group_norm_shape(a: Args) -> list[Expect]:
    """y like x; mean and variance are [N, groups] and the rule takes no groups."""
    x = a.s("x")
    return [x, (x[0], None) if x else None, (x[0], None) if x else None]


def _instance_norm_shape(a: Args) -> list[Expect]:
    """y like x; saved_mean and saved_variance are [N * C] (InstanceNormInferMeta)."""
    x = a.s("x")
    stat = (x[0] * x[1],) if len(x) >= 2 else None
    return [x, stat, stat]


def _roi_align_shape(a: Args) -> list[Expect]:
    x, boxes = a.s("x"), a.s("boxes")
    if len(x) != 4 or not boxes:
        raise UnknownShape
    return [(boxes[0], x[1], a.a("pooled_height"), a.a("pooled_width"))]


facts("conv2d", "conv3d", "depthwise_conv2d", shape=partial(_conv_shape, False))
facts("conv2d_transpose", shape=partial(_conv_shape, True))
facts("conv2d", unchecked="the rule takes no strides / paddings / dilations, so the output's spatial sizes are not "
                          "fixed by the op; its batch and channel axes are checked")
facts("batch_norm", shape=_batch_norm_shape,
      unchecked="reserve_space is kernel workspace; every other output is checked")
facts("group_norm", shape=_group_norm_shape,
      unchecked="mean and variance are [N, groups] and the rule takes no groups: their N axis is checked")
facts("instance_norm", shape=_instance_norm_shape)
facts("roi_align", shape=_roi_align_shape)
for _op in ("conv2d", "conv3d"):  # autodiff: HF models' patch-embedding convolutions
    facts(_op, grad=f"{_op}_grad", wrt=("input", "filter"))


# -- cost


def _conv_flops(c: LocalOp, t: LocalTensor | None, grads: bool) -> OpCost:
    """``2 · elements of t · (in channels / groups · kernel elements)`` (filter [m, c/g, ...]),
    once per input gradient made for a grad."""
    w = c.one("filter")
    assert w is not None and t is not None
    n = sum(1 for o in c.outs[:2] if o is not None) if grads else 1
    f = 2.0 * numel(t[0]) * numel(w[0][1:]) * n
    return OpCost(f, f, c.in_bytes + c.out_bytes, True, c.dtype())


def _conv_cost(c: LocalOp) -> OpCost:
    return _conv_flops(c, c.first_out(), False)


def _conv_grad_cost(c: LocalOp) -> OpCost:
    return _conv_flops(c, c.one("output_grad") or c.one("out_grad"), True)


def _conv_transpose_cost(c: LocalOp) -> OpCost:
    return _conv_flops(c, c.one("input"), False)


def _conv_transpose_grad_cost(c: LocalOp) -> OpCost:
    return _conv_flops(c, c.one("input"), True)


facts("conv2d", "conv3d", "depthwise_conv2d", cost=_conv_cost)
facts("conv2d_grad", "conv3d_grad", "depthwise_conv2d_grad", cost=_conv_grad_cost)
facts("conv2d_transpose", cost=_conv_transpose_cost)
facts("conv2d_transpose_grad", cost=_conv_transpose_grad_cost)
#: the norms: memory-bound, nominal FLOPs per output element
facts("batch_norm", "group_norm", "instance_norm", cost=by_bytes(8))
facts("batch_norm_grad", "group_norm_grad", "instance_norm_grad", cost=by_bytes(12))
#: roi_align: 4 bilinear taps per sample
facts("roi_align", "roi_align_grad", cost=by_bytes(16))
