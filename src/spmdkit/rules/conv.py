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

Every rule is its checks plus a notation compiled once per key (rank, layout, groups > 1,
transposed, which optional tensors are present; never per shape) and run by the engine
(``engine.compile.infer``). Two post-hooks on the engine's answer, for what no notation
says: a conv grad keeps a SUM-partial output_grad (above), and instance_norm's flat
statistics carry n's and c's mesh dims on one axis (two letters on one axis).

Deviations (docs/deviations.md, conv section): conv-spatial-sharded, conv-paddle-raises,
conv-reverse-out, conv-channel-last-out, conv-shape-checks, conv-grad-partial-channel,
dw-grouped-channels, bn-scale-bias, in-flat-stats, in-grad-paddle-raises, roi-grad-conflict,
roi-shape-checks, conv-norm-grads.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from spmdkit.core.dist_attr import ReduceType, TensorDistAttr, dims_entry, entry_dims
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import largest_mesh_dim, mesh_size, replicated
from spmdkit.engine.compile import Plan, compile_plan, infer
from spmdkit.engine.memo import memo
from spmdkit.engine.notation import ALPHABET, BROADCAST, Notation, fast_result, named_mesh
from spmdkit.engine.registry import register
from spmdkit.engine.signature import parse_signature

_SUM = ReduceType.SUM
_make = TensorDistAttr.unchecked

# -- shape checks (errors name the op, the tensor and the sizes) ---------------------------------


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


def _vec(op: str, name: str, t: DistTensorSpec | None, size: int) -> None:
    """A 1-D per-channel tensor (scale, bias, mean, ...) of ``size`` entries."""
    if t is None:
        return
    if len(t.shape) != 1:
        raise ShapeMismatchError(f"{op}: {name} must be 1-D, got shape {list(t.shape)}")
    _same_size(op, f"{name}'s length", t.shape[0], "the channel count", size)


def _vecs(op: str, size: int, names: tuple[str, ...], ts: tuple[DistTensorSpec | None, ...]) -> None:
    for name, t in zip(names, ts):
        _vec(op, name, t, size)


def _same_shape(op: str, na: str, a: DistTensorSpec, nb: str, b: DistTensorSpec) -> None:
    if len(a.shape) != len(b.shape) or any(p != q and p >= 0 and q >= 0 for p, q in zip(a.shape, b.shape)):
        raise ShapeMismatchError(f"{op}: {nb} has shape {list(b.shape)}, {na} has {list(a.shape)}")


# -- convolutions -------------------------------------------------------------------------------


@lru_cache(maxsize=1024)
def _conv_plan(kind: str, nsp: int, channel_last: bool, grouped: bool, transpose: bool) -> Plan:
    """The compiled plan of a conv rule (``kind``: forward, reverse or grad) per key: the number
    of spatial axes, the layout, groups > 1, transposed."""
    s, k, o = "pqr"[:nsp], "ijk"[:nsp], "xyz"[:nsp]
    x, out = ("n" + s + "c", "n" + o + "m") if channel_last else ("nc" + s, "nm" + o)
    w = "c" + ("g" if grouped else "m") + k if transpose else "m" + ("g" if grouped else "c") + k
    rep = s + k + o + ("cmg" if grouped else "")
    if kind == "grad":
        return compile_plan(Notation((x, w, out), (x, w), rep, coshard="largest"))
    return compile_plan(Notation((x, w), (out,), rep, coshard="largest"), "backward" if kind == "reverse" else "forward")


_FORMATS = {2: {"NCHW": False, "NHWC": True, "AnyLayout": False}, 3: {"NCDHW": False, "NDHWC": True, "AnyLayout": False}}


def _conv_checks(op: str, ts: tuple[DistTensorSpec, ...], names: tuple[str, ...], nsp: int, channel_last: bool,
                 groups: int, transpose: bool) -> None:
    """Ranks and channel counts: the input's channels are the filter's in-channel axis times
    groups (conv2d_transpose: the filter's first axis); output / output_grad: batch and
    output channels."""
    x, w = ts[0], ts[1]
    _ndim(op, "input", x, nsp + 2)
    _ndim(op, "filter", w, nsp + 2)
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
    if len(ts) == 3:
        out, name = ts[2], names[2]
        _ndim(op, name, out, nsp + 2)
        _same_size(op, f"{name}'s batch", out.shape[0], "the input's batch", x.shape[0])
        if w.shape[1 if transpose else 0] >= 0:
            m = w.shape[1] * groups if transpose else w.shape[0]
            _same_size(op, f"{name}'s channel count", out.shape[-1] if channel_last else out.shape[1],
                       "the filter's output channels", m)


def _linear_partial(ins: tuple[Any, ...], outs: tuple[Any, ...], pt: Any, mesh: ProcessMesh) -> tuple[Any, Any]:
    """Post-hook of the conv grads: a SUM-partial output_grad over mesh dims no letter uses stays
    partial, and both grads are partial there too (they are linear in it); no notation policy
    keeps a partial input."""
    used = {d for a in ins for e in a.dims_mapping for d in entry_dims(e)}
    keep = tuple((d, r) for d, r in pt if r == _SUM and d not in used)
    if not keep:
        return ins, outs
    g = ins[2]
    ins = (ins[0], ins[1], _make(mesh, g.dims_mapping, keep))
    outs = tuple(_make(mesh, o.dims_mapping, tuple(sorted(dict(o.partial + keep).items()))) for o in outs)
    return ins, outs


def _conv_rule(op: str, kind: str, nsp: int, transpose: bool, sig: str, doc: str) -> Any:
    """A conv rule of ``kind``: forward ``(input, filter, *attrs)``, reverse ``(input, filter,
    output)`` or grad ``(input, filter, output_grad, *attrs)`` over the attributes of Paddle's
    signature ``sig`` (only ``groups`` and ``data_format`` decide a sharding)."""
    attrs = [p.name for p in parse_signature(sig)] if sig else []
    nt = 2 if kind == "forward" else 3
    gi = nt + attrs.index("groups") if sig else -1
    fi = nt + attrs.index("data_format") if sig else -1
    names = ("input", "filter", "output_grad" if kind == "grad" else "output")[:nt]

    def rule(*args: Any) -> SpmdResult:
        ts = args[:nt]
        fmt, groups = (args[fi], args[gi]) if sig else ("NCHW", 1)
        channel_last = _FORMATS[nsp].get(fmt)
        if channel_last is None:
            raise InvalidAttributeError(f"{op}: data_format {fmt!r} is not one of {', '.join(sorted(_FORMATS[nsp]))}")
        if groups < 1:
            raise InvalidAttributeError(f"{op}: groups must be >= 1, got {groups}")
        _conv_checks(op, ts, names, nsp, channel_last, groups, transpose)
        mesh = named_mesh(op, zip(names, ts))
        p = _conv_plan(kind, nsp, channel_last, groups > 1, transpose)
        if kind == "reverse":
            return fast_result(*infer(p, op, ts[:2], ts[2:], mesh, names))
        ins, outs = infer(p, op, ts, (), mesh, names)
        if kind == "grad" and ts[2].dist_attr.partial:
            ins, outs = _linear_partial(ins, outs, ts[2].dist_attr.partial, mesh)
        return fast_result(ins, outs)

    rule.__name__ = rule.__qualname__ = op if kind == "grad" else f"{op}_{kind}"
    rule.__doc__ = doc
    return rule


_CONV2D = ('strides: ints = [], paddings: ints = [], padding_algorithm: str = "EXPLICIT", '
           'dilations: ints = [], groups: int = 1, data_format: str = "NCHW"')
_CONV3D = ('strides: ints = [], paddings: ints = [], padding_algorithm: str = "EXPLICIT", '
           'groups: int = 1, dilations: ints = [], data_format: str = "NCDHW"')
_CT = ('strides: ints = [], paddings: ints = [], output_padding: ints = [], output_size: ints = [], '
       'padding_algorithm: str = "EXPLICIT", groups: int = 1, dilations: ints = [], data_format: str = "NCHW"')
_DW = ('strides: ints = [], paddings: ints = [], padding_algorithm: str = "EXPLICIT", '
       'groups: int = 1, dilations: ints = [], data_format: str = "NCHW"')
_F, _G = "input: T, filter: T, ", "input: T, filter: T, output_grad: T, "
_GDOC = "input_grad partial SUM over m's mesh dims, filter_grad over n's."

register(
    "conv2d", _conv_rule("conv2d", "forward", 2, False, "",
                         "Conv2dInferSpmdBase: ``ncPQ, mcIJ -> nmXY`` (NCHW, groups 1); out partial SUM over c."),
    "input: T, filter: T",
    _conv_rule("conv2d", "reverse", 2, False, "",
               "Conv2dInferSpmdReverseBase: n and m from the output; the output the inputs produce."),
    kind="reverse", outputs="output: T", forward_name="Conv2dInferSpmdBase", backward_name="Conv2dInferSpmdReverseBase",
)  # fmt: skip
register("conv2d_grad", _conv_rule("conv2d_grad", "grad", 2, False, _CONV2D,
                                   "Conv2dGradInferSpmd: ``ncPQ, mcIJ, nmXY -> ncPQ, mcIJ``; " + _GDOC),
         _G + _CONV2D, forward_name="Conv2dGradInferSpmd")  # fmt: skip
for _op, _nsp, _tr, _sig, _fn, _fdoc in (
    ("conv3d", 3, False, _CONV3D, "Conv3d", "``ncPQR, mcIJK -> nmXYZ`` (NCDHW); NDHWC puts c / m last."),
    ("conv2d_transpose", 2, True, _CT, "Conv2dTranspose", "``ncPQ, cmIJ -> nmXY``; out partial SUM over c."),
    ("depthwise_conv2d", 2, False, _DW, "DepthwiseConv2d",
     "a grouped conv2d; with groups > 1 only the batch is shardable."),
):
    register(
        _op, _conv_rule(_op, "forward", _nsp, _tr, _sig, f"{_fn}InferSpmd: {_fdoc}"), _F + _sig,
        _conv_rule(f"{_op}_grad", "grad", _nsp, _tr, _sig, f"{_fn}GradInferSpmd: {_GDOC}"), _G + _sig,
        kind="grad", grad_name=f"{_op}_grad", forward_name=f"{_fn}InferSpmd", backward_name=f"{_fn}GradInferSpmd",
    )  # fmt: skip


# -- normalizations and roi_align: one shardable letter -----------------------------------------


@lru_cache(maxsize=1024)
def _plan(ins: tuple[str | None, ...], outs: tuple[str | None, ...], keep: str, direction: str = "forward",
          sources: tuple[int, ...] | None = None) -> Plan:
    """A plan where every letter but those of ``keep`` is replicated (co-shards read as their
    largest mesh dim); ``sources``: the inputs the forward merge reads."""
    every = set("".join(a for a in (*ins, *outs) if a)) - {BROADCAST}
    nt = Notation(ins, outs, "".join(sorted(every - set(keep))), coshard="largest", sources=sources)
    return compile_plan(nt, direction)


_X = (0,)  # sources: x alone decides the sharding
_BN_NAMES = ("x", "mean", "variance", "scale", "bias")
_BN_OUTS = ("out", "mean_out", "variance_out", "saved_mean", "saved_variance", "reserve_space")
_BN_GRAD = ("x", "scale", "bias", "mean_out", "variance_out", "saved_mean", "saved_variance", "reserve_space",
            "out_grad")


def _bn_channel(op: str, x: DistTensorSpec, data_format: str) -> tuple[int, int]:
    """(x's rank, its channel axis)."""
    nd = _ndim(op, "x", x, (2, 3, 4, 5))
    if len(data_format) < 2:
        raise InvalidAttributeError(f"{op}: data_format {data_format!r} is too short")
    return nd, 1 if data_format[1] == "C" else nd - 1


@lru_cache(maxsize=1024)
def _bn_plan(kind: str, nd: int, ci: int, scale: bool, bias: bool, reserve: int = -1) -> Plan:
    """batch_norm's plans (kind: forward, reverse, grad): x ``abc..`` with the channel letter
    (axis ``ci``) alone shardable; every per-channel tensor labelled by it; ``reserve``:
    reserve_space's rank (-1: absent)."""
    xl = ALPHABET[:nd]
    c = xl[ci]
    s, b = (c if scale else None), (c if bias else None)
    if kind == "grad":
        return _plan((xl, s, b, c, c, c, c, None if reserve < 0 else BROADCAST * reserve, xl), (xl, s, b), c,
                     sources=_X)  # fmt: skip
    if kind == "reverse":
        return _plan((xl, c, c, s, b), (xl, c, c, c, c), c, "backward")
    return _plan((xl, c, c, s, b), (xl, c, c, c, c), c, sources=_X)


def batch_norm_forward(x: DistTensorSpec, mean: DistTensorSpec, variance: DistTensorSpec,
                       scale: DistTensorSpec | None, bias: DistTensorSpec | None) -> SpmdResult:
    """BatchNormInferSpmdStatic (training, NCHW): only x's channel axis keeps its sharding; the
    per-channel inputs and statistics follow it; reserve_space (an opaque buffer) replicated."""
    op = "batch_norm"
    ts = (x, mean, variance, scale, bias)
    mesh = named_mesh(op, zip(_BN_NAMES, ts))
    nd, ci = _bn_channel(op, x, "NCHW")
    _vecs(op, x.shape[ci], _BN_NAMES[1:], ts[1:])
    ins, outs = infer(_bn_plan("forward", nd, ci, scale is not None, bias is not None), op, ts, (), mesh, _BN_NAMES)
    return fast_result(ins, (*outs, replicated(mesh, 1)))


def batch_norm_backward(
    x: DistTensorSpec, mean: DistTensorSpec, variance: DistTensorSpec, scale: DistTensorSpec | None,
    bias: DistTensorSpec | None, out: DistTensorSpec, mean_out: DistTensorSpec, variance_out: DistTensorSpec,
    saved_mean: DistTensorSpec, saved_variance: DistTensorSpec, reserve_space: DistTensorSpec | None = None,
) -> SpmdResult:  # fmt: skip
    """Reverse of batch_norm (Paddle has none): the channel sharding from out and the
    statistics (the larger tensor wins a conflict); the outputs the inputs produce."""
    op = "batch_norm"
    ins, outs = (x, mean, variance, scale, bias), (out, mean_out, variance_out, saved_mean, saved_variance)
    mesh = named_mesh(op, zip(_BN_NAMES + _BN_OUTS, (*ins, *outs, reserve_space)))
    nd, ci = _bn_channel(op, x, "NCHW")
    _vecs(op, x.shape[ci], _BN_NAMES[1:] + _BN_OUTS[1:5], ins[1:] + outs[1:])
    _same_shape(op, "x", x, "out", out)
    p = _bn_plan("reverse", nd, ci, scale is not None, bias is not None)
    a_in, a_out = infer(p, op, ins, outs, mesh, _BN_NAMES + _BN_OUTS)
    return fast_result(a_in, (*a_out, None if reserve_space is None else replicated(mesh, 1)))


def batch_norm_grad(
    x: DistTensorSpec, scale: DistTensorSpec | None, bias: DistTensorSpec | None, mean_out: DistTensorSpec,
    variance_out: DistTensorSpec, saved_mean: DistTensorSpec, saved_variance: DistTensorSpec,
    reserve_space: DistTensorSpec | None, out_grad: DistTensorSpec, momentum: float = 0.9, epsilon: float = 1e-5,
    data_format: str = "NCHW", is_test: bool = False, use_global_stats: bool = False,
    trainable_statistics: bool = False,
) -> SpmdResult:  # fmt: skip
    """BatchNormGradInferSpmd: x's channel sharding for every per-channel tensor and grad."""
    op = "batch_norm_grad"
    ts = (x, scale, bias, mean_out, variance_out, saved_mean, saved_variance, reserve_space, out_grad)
    mesh = named_mesh(op, zip(_BN_GRAD, ts))
    nd, ci = _bn_channel(op, x, data_format)
    _vecs(op, x.shape[ci], _BN_GRAD[1:7], ts[1:7])
    _same_shape(op, "x", x, "out_grad", out_grad)
    rs = -1 if reserve_space is None else len(reserve_space.shape)
    p = _bn_plan("grad", nd, ci, scale is not None, bias is not None, rs)
    return fast_result(*infer(p, op, ts, (), mesh, _BN_GRAD))


# -- group_norm: the batch letter ``a`` alone is shardable; mean / variance ``[N, groups]`` ------

_GN = ("x", "scale", "bias", "y", "mean", "variance", "y_grad")


@lru_cache(maxsize=1024)
def _gn_plan(kind: str, xl: str, scale: bool, bias: bool) -> Plan:
    """group_norm's plans (kind: forward, backward = the reverse, grad); scale / bias replicated."""
    sb = ("1" if scale else None, "1" if bias else None)
    if kind == "grad":
        return _plan((xl, *sb, xl, "a1", "a1", xl), (xl, *sb), "a", sources=_X)
    return _plan((xl, *sb), (xl, "a1", "a1"), "a", kind, _X if kind == "forward" else None)


def _gn(op: str, kind: str, ts: tuple[DistTensorSpec | None, ...], data_format: str = "NCHW",
        groups: int = -1) -> SpmdResult:
    """A group_norm rule: checks (scale / bias, then y / y_grad like x, then mean / variance
    ``[N, groups]``), then the plan of ``kind``."""
    mesh = named_mesh(op, zip(_GN, ts))
    x = ts[0]
    assert x is not None
    nd = _ndim(op, "x", x, (3, 4, 5))
    _vecs(op, x.shape[1 if len(data_format) > 1 and data_format[1] == "C" else nd - 1], _GN[1:3], ts[1:3])
    named = list(zip(_GN[3:], ts[3:]))
    for name, t in named:
        if name in ("y", "y_grad"):
            _same_shape(op, "x", x, name, t)  # type: ignore[arg-type]
    for name, t in named:
        if name in ("mean", "variance"):
            assert t is not None
            if len(t.shape) != 2:
                raise ShapeMismatchError(f"{op}: {name} must be 2-D [N, groups], got shape {list(t.shape)}")
            _same_size(op, f"{name}'s first axis", t.shape[0], "x's batch", x.shape[0])
    if groups != -1 and groups < 1:
        raise InvalidAttributeError(f"{op}: groups must be >= 1 (or -1), got {groups}")
    n_in = 3 if kind == "backward" else len(ts)
    p = _gn_plan(kind, ALPHABET[:nd], ts[1] is not None, ts[2] is not None)
    return fast_result(*infer(p, op, ts[:n_in], ts[n_in:], mesh, _GN))


def group_norm_forward(x: DistTensorSpec, scale: DistTensorSpec | None, bias: DistTensorSpec | None) -> SpmdResult:
    """GroupNormInferSpmdBase: ``a...`` -> y ``a...``, mean / variance ``[a, -1]``."""
    return _gn("group_norm", "forward", (x, scale, bias))


def group_norm_backward(x: DistTensorSpec, scale: DistTensorSpec | None, bias: DistTensorSpec | None,
                        y: DistTensorSpec, mean: DistTensorSpec, variance: DistTensorSpec) -> SpmdResult:
    """Reverse of group_norm (Paddle has none): the batch sharding from y, mean and variance."""
    return _gn("group_norm", "backward", (x, scale, bias, y, mean, variance))


def group_norm_grad(x: DistTensorSpec, scale: DistTensorSpec | None, bias: DistTensorSpec | None,
                    y: DistTensorSpec, mean: DistTensorSpec, variance: DistTensorSpec, y_grad: DistTensorSpec,
                    epsilon: float = 1e-5, groups: int = -1, data_format: str = "NCHW") -> SpmdResult:
    """GroupNormGradInferSpmd: x's batch sharding everywhere; scale_grad / bias_grad
    replicated, partial SUM over the batch's mesh dims."""
    return _gn("group_norm_grad", "grad", (x, scale, bias, y, mean, variance, y_grad), data_format, groups)


# -- instance_norm: ``abcd`` with n = a, c = b shardable; flat [N*C] statistics ------------------


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


def _in_keep(x: DistTensorSpec) -> str:
    """The letters of n (``a``) and c (``b``) that stay sharded: those whose split the flat
    statistics can carry (c's dropped first, then n's). Chooses the notation; the engine merges."""
    ms = x.dist_attr.mesh.shape
    dm = x.dist_attr.dims_mapping
    kn = mesh_size(ms, entry_dims(largest_mesh_dim(dm[0], ms)))
    kc = mesh_size(ms, entry_dims(largest_mesh_dim(dm[1], ms)))
    n, c = x.shape[0], x.shape[1]
    for keep, a, b in (("ab", kn, kc), ("a", kn, 1), ("b", 1, kc)):
        if _flat_ok(n, c, a, b):
            return keep
    return ""


def _flat_stats(mesh: ProcessMesh, xa: TensorDistAttr) -> TensorDistAttr:
    """Post-hook: a flat [N*C] statistic carries n's mesh dims then c's, co-sharded (one axis
    with two letters, which no notation labels), read off the engine's answer for x."""
    dm = xa.dims_mapping
    return _make(mesh, (dims_entry(entry_dims(dm[0]) + entry_dims(dm[1])),))


_IN = ("x", "scale", "bias", "saved_mean", "saved_variance", "y_grad")


@lru_cache(maxsize=64)
def _in_plan(grad: bool, keep: str, scale: bool, bias: bool) -> Plan:
    """instance_norm's plans: ``abcd``, scale / bias ``b``; the flat statistics are left to
    :func:`_flat_stats` (labelled None)."""
    sb = ("b" if scale else None, "b" if bias else None)
    if grad:
        return _plan(("abcd", *sb, None, None, "abcd"), ("abcd", *sb), keep, sources=_X)
    return _plan(("abcd", *sb), ("abcd",), keep, sources=_X)


def _in(op: str, ts: tuple[DistTensorSpec | None, ...]) -> SpmdResult:
    """An instance_norm rule (forward: x, scale, bias; grad: also saved_mean, saved_variance,
    y_grad): checks, the plan, and the flat statistics from the engine's answer for x."""
    mesh = named_mesh(op, zip(_IN, ts))
    x = ts[0]
    assert x is not None
    _ndim(op, "x", x, 4)
    _vecs(op, x.shape[1], _IN[1:3], ts[1:3])
    for name, t in zip(_IN[3:5], ts[3:5]):
        assert t is not None
        if len(t.shape) != 1:
            raise ShapeMismatchError(f"{op}: {name} must be 1-D [N*C], got shape {list(t.shape)}")
        if x.shape[0] >= 0 and x.shape[1] >= 0:
            _same_size(op, f"{name}'s length", t.shape[0], "N*C", x.shape[0] * x.shape[1])
    grad = len(ts) > 3
    if grad:
        _same_shape(op, "x", x, "y_grad", ts[5])  # type: ignore[arg-type]
    ins, outs = infer(_in_plan(grad, _in_keep(x), ts[1] is not None, ts[2] is not None), op, ts, (), mesh, _IN)
    st = _flat_stats(mesh, ins[0])  # type: ignore[arg-type]  # x's attr: y / x_grad are sharded as x
    return fast_result((*ins[:3], st, st, ins[5]), outs) if grad else fast_result(ins, (outs[0], st, st))


def instance_norm_forward(
    x: DistTensorSpec, scale: DistTensorSpec | None, bias: DistTensorSpec | None, epsilon: float = 1e-5
) -> SpmdResult:
    """InstanceNormInferSpmd: ``abcd`` -> y ``abcd``, saved_mean / saved_variance flat ``(a b)``."""
    return _in("instance_norm", (x, scale, bias))


def instance_norm_grad(x: DistTensorSpec, scale: DistTensorSpec | None, bias: DistTensorSpec | None,
                       saved_mean: DistTensorSpec, saved_variance: DistTensorSpec, y_grad: DistTensorSpec,
                       epsilon: float = 1e-5) -> SpmdResult:
    """InstanceNormGradInferSpmd: x's n / c sharding; scale_grad / bias_grad sharded like c,
    partial SUM over n's mesh dims."""
    return _in("instance_norm_grad", (x, scale, bias, saved_mean, saved_variance, y_grad))


# -- roi_align: x ``abcd``, only the channels ``b`` shardable; boxes, boxes_num replicated -------

_ROI = ("x", "boxes", "boxes_num", "out_grad")


def _roi(op: str, ts: tuple[DistTensorSpec | None, ...], pooled_height: int, pooled_width: int) -> SpmdResult:
    x, boxes, boxes_num = ts[0], ts[1], ts[2]
    assert x is not None and boxes is not None
    mesh = named_mesh(op, zip(_ROI, ts))
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
    ins: tuple[str | None, ...] = ("abcd", "11", None if boxes_num is None else "1")
    if len(ts) == 4:  # the grad: x and out_grad merged (the larger tensor wins), x_grad like x
        g = ts[3]
        assert g is not None
        _ndim(op, "out_grad", g, 4)
        _same_size(op, "out_grad's first axis", g.shape[0], "the number of boxes", boxes.shape[0])
        _same_size(op, "out_grad's channels", g.shape[1], "x's channels", x.shape[1])
        return fast_result(*infer(_plan((*ins, "1b11"), ("abcd",), "b"), op, ts, (), mesh, _ROI))
    return fast_result(*infer(_plan(ins, ("1b11",), "b"), op, ts, (), mesh, _ROI))


def roi_align_forward(x: DistTensorSpec, boxes: DistTensorSpec, boxes_num: DistTensorSpec | None,
                      pooled_height: int, pooled_width: int, spatial_scale: float, sampling_ratio: int,
                      aligned: bool) -> SpmdResult:
    """RoiAlignInferSpmd: x ``-c--``, boxes / boxes_num replicated -> out ``-c--``."""
    return _roi("roi_align", (x, boxes, boxes_num), pooled_height, pooled_width)


def roi_align_grad(x: DistTensorSpec, boxes: DistTensorSpec, boxes_num: DistTensorSpec | None,
                   out_grad: DistTensorSpec, pooled_height: int, pooled_width: int, spatial_scale: float,
                   sampling_ratio: int, aligned: bool) -> SpmdResult:
    """RoiAlignGradInferSpmd: the channel sharding of x and out_grad merged; x_grad like x."""
    return _roi("roi_align_grad", (x, boxes, boxes_num, out_grad), pooled_height, pooled_width)


# -- declarations: name, forward, its signature, the backward slot, Paddle's function names -------

_BN_SIG = "x: T, mean: T, variance: T, scale: T?, bias: T?"
_GN_SIG = "x: T, scale: T?, bias: T?"
for _name, _fwd, _sig, _rev, _outs, _grad, _gsig, _pd in (
    ("batch_norm", batch_norm_forward, _BN_SIG, batch_norm_backward,
     "out: T, mean_out: T, variance_out: T, saved_mean: T, saved_variance: T, reserve_space: T? = None",
     batch_norm_grad,
     "x: T, scale: T?, bias: T?, mean_out: T, variance_out: T, saved_mean: T, saved_variance: T, reserve_space: T?, "
     'out_grad: T, momentum: float = 0.9, epsilon: float = 1e-5, data_format: str = "NCHW", is_test: bool = False, '
     "use_global_stats: bool = False, trainable_statistics: bool = False",
     ("BatchNormInferSpmdStatic", "BatchNormInferSpmdReverse", "BatchNormGradInferSpmd")),
    ("group_norm", group_norm_forward, _GN_SIG, group_norm_backward, "y: T, mean: T, variance: T", group_norm_grad,
     'x: T, scale: T?, bias: T?, y: T, mean: T, variance: T, y_grad: T, epsilon: float = 1e-5, groups: int = -1, '
     'data_format: str = "NCHW"',
     ("GroupNormInferSpmdBase", "GroupNormInferSpmdReverse", "GroupNormGradInferSpmd")),
):
    register(_name, _fwd, _sig, _rev, kind="reverse", outputs=_outs, forward_name=_pd[0], backward_name=_pd[1])
    register(f"{_name}_grad", _grad, _gsig, forward_name=_pd[2])

_ROI_ATTRS = "pooled_height: int, pooled_width: int, spatial_scale: float, sampling_ratio: int, aligned: bool"
for _op, _f, _s, _g, _gs, _pn in (
    ("instance_norm", instance_norm_forward, _GN_SIG + ", epsilon: float = 1e-5", instance_norm_grad,
     "x: T, scale: T?, bias: T?, saved_mean: T, saved_variance: T, y_grad: T, epsilon: float = 1e-5", "InstanceNorm"),
    ("roi_align", roi_align_forward, "x: T, boxes: T, boxes_num: T?, " + _ROI_ATTRS, roi_align_grad,
     "x: T, boxes: T, boxes_num: T?, out_grad: T, " + _ROI_ATTRS, "RoiAlign"),
):
    register(_op, _f, _s, _g, _gs, kind="grad", grad_name=f"{_op}_grad",
             forward_name=f"{_pn}InferSpmd", backward_name=f"{_pn}GradInferSpmd")  # fmt: skip
