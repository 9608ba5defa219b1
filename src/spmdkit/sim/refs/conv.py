"""Simulator references and case generators: convolutions, batch / group / instance norm,
roi_align and their grads.

Convolutions are computed with explicit loops over the kernel offsets (numpy slicing of the
zero-padded input, one einsum per offset); the grads are the exact adjoints of that sum
(conv2d_transpose is the input grad of a conv, its grads a conv and a conv filter grad).
Empty ``strides`` / ``dilations`` mean ones, empty ``paddings`` zeros (Paddle's defaults).
The norms run in training mode (batch statistics); their grads take the saved statistics as
inputs, made consistent with x by ``prepare``, and are the true derivatives. ``group_norm``'s
forward rule has no ``groups`` attribute: the reference uses 2 groups where the channel count is
even, else 1 (any count is sound under the rule, which shards only the batch). roi_align is
Paddle's CPU algorithm (bilinear sampling, adaptive sampling grid for ``sampling_ratio <= 0``);
boxes are made valid and boxes_num consistent with the box count by ``prepare``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, TGen, ref_global
from spmdkit.sim.reference import Arrays, Ctx, Reference, get_reference, register_reference

Pads = list[tuple[int, int]]

# ---------------------------------------------------------------------------
# convolution arithmetic (channel-first, N spatial dims)
# ---------------------------------------------------------------------------


def _ints(v: Any, nsp: int, fill: int) -> list[int]:
    if v is None:
        return [fill] * nsp
    v = [int(x) for x in (v if isinstance(v, (list, tuple)) else [v])]
    if not v:
        return [fill] * nsp
    out: list[int] = list(v)
    if len(out) == 1:
        return out * nsp
    return out


def _pads(paddings: Any, nsp: int) -> Pads:
    p = _ints(paddings, nsp, 0)
    if len(p) == nsp:
        return [(x, x) for x in p]
    if len(p) == 2 * nsp:
        return [(p[2 * i], p[2 * i + 1]) for i in range(nsp)]
    raise ValueError(f"paddings {p} for {nsp} spatial dims")


def conv_geometry(
    in_sp: Sequence[int], k_sp: Sequence[int], a: Arrays, nsp: int
) -> tuple[list[int], Pads, list[int]]:
    """(strides, pads, dilations) after padding_algorithm (SAME / VALID / EXPLICIT)."""
    st = _ints(a.get("strides"), nsp, 1)
    dil = _ints(a.get("dilations"), nsp, 1)
    alg = str(a.get("padding_algorithm", "EXPLICIT"))
    if alg == "VALID":
        pads = [(0, 0)] * nsp
    elif alg == "SAME":
        dil = [1] * nsp
        pads = []
        for s, k, t in zip(in_sp, k_sp, st):
            o = -(-s // t)
            tot = max((o - 1) * t + k - s, 0)
            pads.append((tot // 2, tot - tot // 2))
    else:
        pads = _pads(a.get("paddings"), nsp)
    return st, pads, dil


def _out_size(s: int, k: int, st: int, p: tuple[int, int], d: int) -> int:
    return (s + p[0] + p[1] - d * (k - 1) - 1) // st + 1


def _windows(shape_sp: Sequence[int], k_sp: Sequence[int], o_sp: Sequence[int], st: Sequence[int],
             dil: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[slice, ...]]]:
    """Per kernel offset: (offset, slices of the padded input it reads for every output point)."""
    out = []
    for off in np.ndindex(*k_sp):
        sl = tuple(slice(o * d, o * d + t * (n - 1) + 1, t) for o, d, t, n in zip(off, dil, st, o_sp))
        out.append((tuple(off), sl))
    return out


def _at(off: tuple[Any, ...]) -> tuple[Any, ...]:
    """The index of one kernel offset in a [G, M/G, C/G, K...] array."""
    lead: tuple[Any, ...] = (slice(None), slice(None), slice(None))
    return lead + tuple(off)


def conv_forward(x: np.ndarray, w: np.ndarray, st: Sequence[int], pads: Pads, dil: Sequence[int],
                 groups: int) -> np.ndarray:
    """x [N, C, S...], w [M, C/g, K...] -> [N, M, O...]."""
    n, c = x.shape[:2]
    m, cg = w.shape[:2]
    nsp = x.ndim - 2
    if c != cg * groups or m % groups:
        raise ValueError(f"channels {c} vs filter {w.shape} with groups {groups}")
    xp = np.pad(x, [(0, 0), (0, 0), *pads])
    o_sp = [_out_size(s, k, t, p, d) for s, k, t, p, d in zip(x.shape[2:], w.shape[2:], st, pads, dil)]
    if any(o < 1 for o in o_sp):
        raise ValueError(f"empty output {o_sp}")
    mg = m // groups
    out = np.zeros((n, groups, mg, *o_sp))
    xg = xp.reshape(n, groups, cg, *xp.shape[2:])
    wg = w.reshape(groups, mg, cg, *w.shape[2:])
    for off, sl in _windows(x.shape[2:], w.shape[2:], o_sp, st, dil):
        patch = xg[(slice(None), slice(None), slice(None), *sl)]
        out += np.einsum("ngc...,gmc->ngm...", patch, wg[_at(off)])
    return out.reshape(n, m, *o_sp) if nsp else out.reshape(n, m)


def conv_input_grad(gy: np.ndarray, w: np.ndarray, x_shape: Sequence[int], st: Sequence[int], pads: Pads,
                    dil: Sequence[int], groups: int) -> np.ndarray:
    n, c = x_shape[:2]
    m, cg = w.shape[:2]
    mg = m // groups
    o_sp = gy.shape[2:]
    padded = [s + p[0] + p[1] for s, p in zip(x_shape[2:], pads)]
    gxp = np.zeros((n, groups, cg, *padded))
    gyg = gy.reshape(n, groups, mg, *o_sp)
    wg = w.reshape(groups, mg, cg, *w.shape[2:])
    for off, sl in _windows(x_shape[2:], w.shape[2:], o_sp, st, dil):
        gxp[(slice(None), slice(None), slice(None), *sl)] += np.einsum(
            "ngm...,gmc->ngc...", gyg, wg[_at(off)])
    crop = tuple(slice(p[0], p[0] + s) for s, p in zip(x_shape[2:], pads))
    return gxp.reshape(n, c, *padded)[(slice(None), slice(None), *crop)]


def conv_filter_grad(gy: np.ndarray, x: np.ndarray, w_shape: Sequence[int], st: Sequence[int], pads: Pads,
                     dil: Sequence[int], groups: int) -> np.ndarray:
    n = x.shape[0]
    m, cg = w_shape[:2]
    mg = m // groups
    o_sp = gy.shape[2:]
    xp = np.pad(x, [(0, 0), (0, 0), *pads])
    xg = xp.reshape(n, groups, cg, *xp.shape[2:])
    gyg = gy.reshape(n, groups, mg, *o_sp)
    gw = np.zeros((groups, mg, cg, *w_shape[2:]))
    for off, sl in _windows(x.shape[2:], w_shape[2:], o_sp, st, dil):
        patch = xg[(slice(None), slice(None), slice(None), *sl)]
        npt = int(np.prod(o_sp, dtype=np.int64))
        gw[_at(off)] += np.einsum(
            "ngmp,ngcp->gmc", gyg.reshape(n, groups, mg, npt), patch.reshape(n, groups, cg, npt))
    return gw.reshape(tuple(w_shape))


def _to_cf(x: np.ndarray, last: bool) -> np.ndarray:
    return np.moveaxis(x, -1, 1) if last else x


def _from_cf(x: np.ndarray, last: bool) -> np.ndarray:
    return np.moveaxis(x, 1, -1) if last else x


def channels_last(a: Arrays) -> bool:
    fmt = str(a.get("data_format", "NCHW"))
    return fmt in ("NHWC", "NDHWC")


def _f(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _conv_setup(a: Arrays) -> tuple[np.ndarray, np.ndarray, list[int], Pads, list[int], int, bool]:
    last = channels_last(a)
    x = _to_cf(_f(a["input"]), last)
    w = _f(a["filter"])
    nsp = x.ndim - 2
    st, pads, dil = conv_geometry(x.shape[2:], w.shape[2:], a, nsp)
    return x, w, st, pads, dil, int(a.get("groups", 1)), last


def _conv(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x, w, st, pads, dil, g, last = _conv_setup(a)
    return (_from_cf(conv_forward(x, w, st, pads, dil, g), last),)


def _conv_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x, w, st, pads, dil, g, last = _conv_setup(a)
    gy = _to_cf(_f(a["output_grad"]), last)
    gx = conv_input_grad(gy, w, x.shape, st, pads, dil, g)
    gw = conv_filter_grad(gy, x, w.shape, st, pads, dil, g)
    return _from_cf(gx, last), gw


# conv2d_transpose: out = conv_input_grad(x as out_grad, filter [C, M/g, k] as a conv filter)


def _ct_geometry(a: Arrays, x: np.ndarray, w: np.ndarray) -> tuple[list[int], Pads, list[int], list[int]]:
    nsp = x.ndim - 2
    st = _ints(a.get("strides"), nsp, 1)
    dil = _ints(a.get("dilations"), nsp, 1)
    if str(a.get("padding_algorithm", "EXPLICIT")) not in ("EXPLICIT", ""):
        raise ValueError("the reference runs EXPLICIT padding only for conv2d_transpose")
    pads = _pads(a.get("paddings"), nsp)
    op = _ints(a.get("output_padding"), nsp, 0)
    osz = [int(v) for v in (a.get("output_size") or [])]
    sizes = []
    for i in range(nsp):
        base = (x.shape[2 + i] - 1) * st[i] - pads[i][0] - pads[i][1] + dil[i] * (w.shape[2 + i] - 1) + 1
        if osz:
            if not base <= osz[i] < base + st[i]:
                raise ValueError(f"output_size {osz} out of range")
            sizes.append(osz[i])
        else:
            sizes.append(base + op[i])
    return st, pads, dil, sizes


def _ct_setup(a: Arrays) -> tuple[np.ndarray, np.ndarray, list[int], Pads, list[int], list[int], int, bool]:
    last = channels_last(a)
    x = _to_cf(_f(a["input"]), last)
    w = _f(a["filter"])
    st, pads, dil, sizes = _ct_geometry(a, x, w)
    return x, w, st, pads, dil, sizes, int(a.get("groups", 1)), last


def _ct_pads(pads: Pads, sizes: Sequence[int], x: np.ndarray, w: np.ndarray, st: Sequence[int],
             dil: Sequence[int]) -> Pads:
    """The conv pads (extra high padding where output_padding / output_size add rows)."""
    out = []
    for i, (lo, hi) in enumerate(pads):
        base = (x.shape[2 + i] - 1) * st[i] - lo - hi + dil[i] * (w.shape[2 + i] - 1) + 1
        out.append((lo, hi - (sizes[i] - base)))
    return out


def _conv_t(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x, w, st, pads, dil, sizes, g, last = _ct_setup(a)
    n = x.shape[0]
    m = w.shape[1] * g
    cp = _ct_pads(pads, sizes, x, w, st, dil)
    y = _ct_apply(x, w, (n, m, *sizes), st, cp, dil, g)
    return (_from_cf(y, last),)


def _ct_apply(x: np.ndarray, w: np.ndarray, y_shape: Sequence[int], st: Sequence[int], cp: Pads,
              dil: Sequence[int], g: int) -> np.ndarray:
    """conv_input_grad with possibly negative high pads (extra output rows get only zeros)."""
    grow = [max(0, -hi) for _, hi in cp]
    pads = [(lo, max(hi, 0)) for lo, hi in cp]
    big = [s + e for s, e in zip(y_shape[2:], grow)]
    # a bigger output with zero high pads, cropped: rows past the conv's reach stay zero
    y = conv_input_grad(x, w, (*y_shape[:2], *big), st, pads, dil, g)
    return y[(slice(None), slice(None), *[slice(0, s) for s in y_shape[2:]])]


def _conv_t_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x, w, st, pads, dil, sizes, g, last = _ct_setup(a)
    gy = _to_cf(_f(a["output_grad"]), last)
    cp = _ct_pads(pads, sizes, x, w, st, dil)
    grow = [max(0, -hi) for _, hi in cp]
    pp = [(lo, max(hi, 0)) for lo, hi in cp]
    gyb = np.pad(gy, [(0, 0), (0, 0), *[(0, e) for e in grow]])
    gx = conv_forward(gyb, w, st, pp, dil, g)
    gx = gx[(slice(None), slice(None), *[slice(0, s) for s in x.shape[2:]])]
    gw = conv_filter_grad(x, gyb, w.shape, st, pp, dil, g)
    return _from_cf(gx, last), gw


# ---------------------------------------------------------------------------
# batch_norm
# ---------------------------------------------------------------------------


def _bn_axes(x: np.ndarray, fmt: str) -> tuple[int, tuple[int, ...]]:
    c = 1 if len(fmt) > 1 and fmt[1] == "C" else x.ndim - 1
    return c, tuple(i for i in range(x.ndim) if i != c)


def _bshape(x: np.ndarray, c: int) -> list[int]:
    s = [1] * x.ndim
    s[c] = x.shape[c]
    return s


def _bn(a: Arrays, ctx: Ctx) -> tuple[Any, ...]:
    x = _f(a["x"])
    c, red = _bn_axes(x, "NCHW")
    eps, mom = 1e-5, 0.9
    mu = x.mean(axis=red)
    var = x.var(axis=red)
    bs = _bshape(x, c)
    rstd = 1.0 / np.sqrt(var + eps)
    out = (x - mu.reshape(bs)) * rstd.reshape(bs)
    if a.get("scale") is not None:
        out = out * _f(a["scale"]).reshape(bs)
    if a.get("bias") is not None:
        out = out + _f(a["bias"]).reshape(bs)
    mean_out = mom * _f(a["mean"]) + (1 - mom) * mu
    var_out = mom * _f(a["variance"]) + (1 - mom) * var
    return out, mean_out, var_out, mu, rstd, None


def _bn_grad(a: Arrays, ctx: Ctx) -> tuple[Any, ...]:
    x = _f(a["x"])
    gy = _f(a["out_grad"])
    c, red = _bn_axes(x, str(a.get("data_format", "NCHW")))
    eps = float(a.get("epsilon", 1e-5))
    bs = _bshape(x, c)
    scale = _f(a["scale"]) if a.get("scale") is not None else np.ones(x.shape[c])
    glob = bool(a.get("is_test")) or bool(a.get("use_global_stats"))
    if glob:
        mu = _f(a["mean_out"])
        rstd = 1.0 / np.sqrt(_f(a["variance_out"]) + eps)
    else:
        mu = _f(a["saved_mean"])
        rstd = _f(a["saved_variance"])
    xhat = (x - mu.reshape(bs)) * rstd.reshape(bs)
    g_bias = gy.sum(axis=red)
    g_scale = (gy * xhat).sum(axis=red)
    if glob:
        gx = gy * (scale * rstd).reshape(bs)
    else:
        cnt = x.size // max(x.shape[c], 1)
        gx = (scale * rstd).reshape(bs) / cnt * (
            cnt * gy - g_bias.reshape(bs) - xhat * g_scale.reshape(bs))
    return (gx, g_scale if a.get("scale") is not None else None, g_bias if a.get("bias") is not None else None)


def _bn_grad_prepare(a: Arrays) -> None:
    x = _f(a["x"])
    _, red = _bn_axes(x, str(a.get("data_format", "NCHW")))
    eps = float(a.get("epsilon", 1e-5))
    a["saved_mean"] = x.mean(axis=red)
    a["saved_variance"] = 1.0 / np.sqrt(x.var(axis=red) + eps)


# ---------------------------------------------------------------------------
# group_norm
# ---------------------------------------------------------------------------


def default_groups(channels: int) -> int:
    """The group count the reference uses for group_norm's forward (no groups attribute)."""
    return 2 if channels % 2 == 0 else 1


def _gn_view(x: np.ndarray, c_axis: int, g: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """x as [N, G, C/G * spatial] (channel-first copy) and the channel-first shape."""
    xc = np.moveaxis(x, c_axis, 1)
    n, ch = xc.shape[:2]
    return xc.reshape(n, g, (ch // g) * int(np.prod(xc.shape[2:], dtype=np.int64))), xc.shape


def _gn_caxis(x: np.ndarray, fmt: str) -> int:
    return 1 if len(fmt) > 1 and fmt[1] == "C" else x.ndim - 1


def _gn_core(x: np.ndarray, c_axis: int, g: int, eps: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    v, _ = _gn_view(x, c_axis, g)
    return v, v.mean(axis=2), v.var(axis=2)


def _gn_affine(xhat_cf: np.ndarray, a: Arrays) -> np.ndarray:
    bs = [1] * xhat_cf.ndim
    bs[1] = xhat_cf.shape[1]
    y = xhat_cf
    if a.get("scale") is not None:
        y = y * _f(a["scale"]).reshape(bs)
    if a.get("bias") is not None:
        y = y + _f(a["bias"]).reshape(bs)
    return y


def _gn(a: Arrays, ctx: Ctx) -> tuple[Any, ...]:
    x = _f(a["x"])
    g = default_groups(x.shape[1])
    eps = 1e-5
    v, mu, var = _gn_core(x, 1, g, eps)
    xhat = ((v - mu[..., None]) / np.sqrt(var[..., None] + eps)).reshape(x.shape)
    return _gn_affine(xhat, a), mu, var


def _gn_groups(a: Arrays) -> int:
    g = int(a.get("groups", -1))
    return g if g > 0 else int(np.shape(a["mean"])[1])


def _gn_grad(a: Arrays, ctx: Ctx) -> tuple[Any, ...]:
    x = _f(a["x"])
    fmt = str(a.get("data_format", "NCHW"))
    ca = _gn_caxis(x, fmt)
    g = _gn_groups(a)
    eps = float(a.get("epsilon", 1e-5))
    mu, var = _f(a["mean"]), _f(a["variance"])
    v, cf_shape = _gn_view(x, ca, g)
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = (v - mu[..., None]) * rstd[..., None]
    gy_cf = np.moveaxis(_f(a["y_grad"]), ca, 1)
    ch = cf_shape[1]
    scale = _f(a["scale"]) if a.get("scale") is not None else np.ones(ch)
    bs = [1] * len(cf_shape)
    bs[1] = ch
    dxhat = (gy_cf * scale.reshape(bs)).reshape(v.shape)
    gx = rstd[..., None] * (dxhat - dxhat.mean(axis=2, keepdims=True)
                            - xhat * (dxhat * xhat).mean(axis=2, keepdims=True))
    gx = np.moveaxis(gx.reshape(cf_shape), 1, ca)
    red = tuple(i for i in range(len(cf_shape)) if i != 1)
    g_scale = (gy_cf * xhat.reshape(cf_shape)).sum(axis=red)
    g_bias = gy_cf.sum(axis=red)
    return (gx, g_scale if a.get("scale") is not None else None, g_bias if a.get("bias") is not None else None)


def _gn_grad_prepare(a: Arrays) -> None:
    x = _f(a["x"])
    ca = _gn_caxis(x, str(a.get("data_format", "NCHW")))
    g = _gn_groups(a)
    v, _ = _gn_view(x, ca, g)
    a["mean"] = v.mean(axis=2)
    a["variance"] = v.var(axis=2)


# ---------------------------------------------------------------------------
# instance_norm
# ---------------------------------------------------------------------------


def _in(a: Arrays, ctx: Ctx) -> tuple[Any, ...]:
    x = _f(a["x"])
    eps = float(a.get("epsilon", 1e-5))
    mu = x.mean(axis=(2, 3))
    var = x.var(axis=(2, 3))
    rstd = 1.0 / np.sqrt(var + eps)
    xhat = (x - mu[..., None, None]) * rstd[..., None, None]
    return _gn_affine(xhat, a), mu.reshape(-1), rstd.reshape(-1)


def _in_grad(a: Arrays, ctx: Ctx) -> tuple[Any, ...]:
    x = _f(a["x"])
    n, ch = x.shape[:2]
    mu = _f(a["saved_mean"]).reshape(n, ch)
    rstd = _f(a["saved_variance"]).reshape(n, ch)
    gy = _f(a["y_grad"])
    scale = _f(a["scale"]) if a.get("scale") is not None else np.ones(ch)
    xhat = (x - mu[..., None, None]) * rstd[..., None, None]
    dxhat = gy * scale.reshape(1, ch, 1, 1)
    gx = rstd[..., None, None] * (dxhat - dxhat.mean(axis=(2, 3), keepdims=True)
                                  - xhat * (dxhat * xhat).mean(axis=(2, 3), keepdims=True))
    g_scale = (gy * xhat).sum(axis=(0, 2, 3))
    g_bias = gy.sum(axis=(0, 2, 3))
    return (gx, g_scale if a.get("scale") is not None else None, g_bias if a.get("bias") is not None else None)


def _in_grad_prepare(a: Arrays) -> None:
    x = _f(a["x"])
    eps = float(a.get("epsilon", 1e-5))
    a["saved_mean"] = x.mean(axis=(2, 3)).reshape(-1)
    a["saved_variance"] = (1.0 / np.sqrt(x.var(axis=(2, 3)) + eps)).reshape(-1)


# ---------------------------------------------------------------------------
# roi_align
# ---------------------------------------------------------------------------


def _roi_weights(box: np.ndarray, h: int, w: int, a: Arrays) -> np.ndarray:
    """The [ph*pw, h*w] matrix of one box: out[bin] = sum_pixel weight * x[pixel]."""
    ph, pw = int(a["pooled_height"]), int(a["pooled_width"])
    ss = float(a["spatial_scale"])
    sr = int(a["sampling_ratio"])
    aligned = bool(a["aligned"])
    off = 0.5 if aligned else 0.0
    x1, y1, x2, y2 = (float(v) * ss - off for v in box[:4])
    rw, rh = x2 - x1, y2 - y1
    if not aligned:
        rw, rh = max(rw, 1.0), max(rh, 1.0)
    bh, bw = rh / ph, rw / pw
    gh = sr if sr > 0 else math.ceil(rh / ph)
    gw = sr if sr > 0 else math.ceil(rw / pw)
    cnt = max(gh * gw, 1)
    wm = np.zeros((ph * pw, h * w))
    for i in range(ph):
        for j in range(pw):
            row = wm[i * pw + j]
            for iy in range(gh):
                yy = y1 + i * bh + (iy + 0.5) * bh / gh
                for ix in range(gw):
                    xx = x1 + j * bw + (ix + 0.5) * bw / gw
                    _bilinear(row, yy, xx, h, w, 1.0 / cnt)
    return wm


def _bilinear(row: np.ndarray, y: float, x: float, h: int, w: int, scale: float) -> None:
    if y < -1.0 or y > h or x < -1.0 or x > w:
        return
    y, x = max(y, 0.0), max(x, 0.0)
    yl, xl = int(y), int(x)
    if yl >= h - 1:
        yl = yh = h - 1
        y = float(yl)
    else:
        yh = yl + 1
    if xl >= w - 1:
        xl = xh = w - 1
        x = float(xl)
    else:
        xh = xl + 1
    ly, lx = y - yl, x - xl
    hy, hx = 1.0 - ly, 1.0 - lx
    row[yl * w + xl] += hy * hx * scale
    row[yl * w + xh] += hy * lx * scale
    row[yh * w + xl] += ly * hx * scale
    row[yh * w + xh] += ly * lx * scale


def _roi_batch(a: Arrays, k: int, n: int) -> list[int]:
    bn = a.get("boxes_num")
    if bn is None:
        return [0] * k
    counts = np.asarray(bn).astype(np.int64).reshape(-1)
    out: list[int] = []
    for b, cnum in enumerate(counts):
        out += [b] * int(cnum)
    if len(out) != k or (out and max(out) >= n):
        raise ValueError(f"boxes_num {counts.tolist()} does not fit {k} boxes")
    return out


def _roi(a: Arrays, ctx: Ctx) -> tuple[Any, ...]:
    x = _f(a["x"])
    boxes = _f(a["boxes"])
    n, ch, h, w = x.shape
    k = boxes.shape[0]
    ph, pw = int(a["pooled_height"]), int(a["pooled_width"])
    out = np.zeros((k, ch, ph, pw))
    for i, b in enumerate(_roi_batch(a, k, n)):
        wm = _roi_weights(boxes[i], h, w, a)
        out[i] = (x[b].reshape(ch, h * w) @ wm.T).reshape(ch, ph, pw)
    return (out,)


def _roi_grad(a: Arrays, ctx: Ctx) -> tuple[Any, ...]:
    x = _f(a["x"])
    boxes = _f(a["boxes"])
    gy = _f(a["out_grad"])
    n, ch, h, w = x.shape
    k = boxes.shape[0]
    gx = np.zeros_like(x)
    for i, b in enumerate(_roi_batch(a, k, n)):
        wm = _roi_weights(boxes[i], h, w, a)
        gx[b] += (gy[i].reshape(ch, wm.shape[0]) @ wm).reshape(ch, h, w)
    return (gx,)


def _roi_prepare(a: Arrays) -> None:
    x = np.asarray(a["x"])
    n, _, h, w = x.shape
    u = np.abs(_f(a["boxes"])) % 1.0
    ss = float(a["spatial_scale"])
    k = u.shape[0]
    bw, bh = w / ss, h / ss
    x1 = u[:, 0] * bw * 0.6
    y1 = u[:, 1] * bh * 0.6
    a["boxes"] = np.stack([x1, y1, x1 + (0.1 + u[:, 2]) * bw * 0.5, y1 + (0.1 + u[:, 3]) * bh * 0.5], axis=1)
    if a.get("boxes_num") is not None:
        a["boxes_num"] = np.array([k // n + (1 if i < k % n else 0) for i in range(n)], dtype=np.int64)


# ---------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------

_P = "conv."
_CONV_IN = ("input", "filter")
_CONV_G = ("input", "filter", "output_grad")
_POS = {"variance": "pos", "mean_out": "real", "variance_out": "pos"}

# (rule, forward, grad, case family)
for _name, _fwd, _grad, _fam in (("conv2d", _conv, _conv_grad, "conv2d"), ("conv3d", _conv, _conv_grad, "conv3d"),
                                  ("depthwise_conv2d", _conv, _conv_grad, "depthwise"),
                                  ("conv2d_transpose", _conv_t, _conv_t_grad, "conv2d_transpose")):
    register_reference(Reference(_name, _fwd, _CONV_IN, ("output",), _P + _fam))
    register_reference(Reference(f"{_name}_grad", _grad, _CONV_G, ("input_grad", "filter_grad"), f"{_P}{_fam}_grad"))
register_reference(Reference("batch_norm", _bn, ("x", "mean", "variance"),
                             ("out", "mean_out", "variance_out", "saved_mean", "saved_variance", "reserve_space"),
                             _P + "batch_norm", optional=("scale", "bias"), domains={"variance": "pos"}))
register_reference(Reference("batch_norm_grad", _bn_grad,
                             ("x", "mean_out", "variance_out", "saved_mean", "saved_variance", "out_grad"),
                             ("x_grad", "scale_grad", "bias_grad"), _P + "batch_norm_grad",
                             optional=("scale", "bias", "reserve_space"), domains=_POS,
                             prepare=_bn_grad_prepare))
register_reference(Reference("group_norm", _gn, ("x",), ("y", "mean", "variance"), _P + "group_norm",
                             optional=("scale", "bias")))
register_reference(Reference("group_norm_grad", _gn_grad, ("x", "y", "mean", "variance", "y_grad"),
                             ("x_grad", "scale_grad", "bias_grad"), _P + "group_norm_grad",
                             optional=("scale", "bias"), domains={"variance": "pos"}, prepare=_gn_grad_prepare))
register_reference(Reference("instance_norm", _in, ("x",), ("y", "saved_mean", "saved_variance"),
                             _P + "instance_norm", optional=("scale", "bias")))
register_reference(Reference("instance_norm_grad", _in_grad, ("x", "saved_mean", "saved_variance", "y_grad"),
                             ("x_grad", "scale_grad", "bias_grad"), _P + "instance_norm_grad",
                             optional=("scale", "bias"), domains={"saved_variance": "pos"},
                             prepare=_in_grad_prepare))
register_reference(Reference("roi_align", _roi, ("x", "boxes"), ("out",), _P + "roi_align",
                             optional=("boxes_num",), domains={"boxes_num": "int"}, prepare=_roi_prepare))
register_reference(Reference("roi_align_grad", _roi_grad, ("x", "boxes", "out_grad"), ("x_grad",),
                             _P + "roi_align_grad", optional=("boxes_num",), domains={"boxes_num": "int"},
                             prepare=_roi_prepare))


# ---------------------------------------------------------------------------
# generators (small shapes: batch / channels / spatial 1-6, kernels 1-3)
# ---------------------------------------------------------------------------


def _sz(r: random.Random, mesh: list[int], hi: int = 6) -> int:
    """A size in 1..hi, often a multiple of some mesh dims (so shardings divide)."""
    if r.random() < 0.5:
        s = 1
        for m in mesh:
            if r.random() < 0.5 and s * m <= hi:
                s *= m
        if s > 1 or r.random() < 0.3:
            return s
    return r.randint(1, hi)


def _geom(r: random.Random, nsp: int) -> tuple[list[int], list[int], list[int], list[int], str]:
    """(kernel, strides, paddings, dilations, padding_algorithm) with a non-empty output."""
    k = [r.randint(1, 3) for _ in range(nsp)]
    st = [r.choice((1, 1, 2)) for _ in range(nsp)]
    pd = [r.choice((0, 0, 1)) for _ in range(nsp)]
    dl = [r.choice((1, 1, 1, 2)) for _ in range(nsp)]
    alg = r.choice(("EXPLICIT", "EXPLICIT", "EXPLICIT", "SAME", "VALID"))
    return k, st, pd, dl, alg


def _spatial(r: random.Random, k: list[int], dl: list[int]) -> list[int]:
    return [r.randint(d * (kk - 1) + 1, max(d * (kk - 1) + 1, 6)) for kk, d in zip(k, dl)]


def _conv_spec(r: random.Random, m: list[int], nsp: int, kind: str) -> dict[str, Any]:
    n = _sz(r, m)
    k, st, pd, dl, alg = _geom(r, nsp)
    if kind == "conv2d":  # Conv2dInferSpmdBase: NCHW, stride 1, no padding, groups 1
        st, pd, dl, alg = [1] * nsp, [0] * nsp, [1] * nsp, "EXPLICIT"
    if kind == "transpose":
        alg = "EXPLICIT"
    sp = _spatial(r, k, dl)
    last = nsp == 2 and kind != "conv2d" and r.random() < 0.3
    if nsp == 3:
        last = r.random() < 0.3
    groups = 1
    if kind == "depthwise":
        cin = _sz(r, m)
        mult = r.choice((1, 1, 2))
        groups = cin
        w = [cin * mult, 1, *k]
    elif kind == "transpose":
        groups = r.choice((1, 1, 1, 2))
        cin = _sz(r, m) * groups if groups > 1 else _sz(r, m)
        cin = min(cin, 6) if cin % groups == 0 else groups
        w = [cin, _sz(r, m, 3), *k]
    else:
        groups = 1 if kind == "conv2d" or r.random() < 0.75 else 2
        cg = _sz(r, m, 3 if groups > 1 else 6)
        cin = cg * groups
        mo = _sz(r, m, 3) * groups if groups > 1 else _sz(r, m)
        w = [mo, cg, *k]
    x = [n, *sp, cin] if last else [n, cin, *sp]
    fmt = ("NHWC" if nsp == 2 else "NDHWC") if last else ("NCHW" if nsp == 2 else "NCDHW")
    spec: dict[str, Any] = {"input": TGen(tuple(x)), "filter": TGen(tuple(w)), "strides": st, "paddings": pd,
                            "padding_algorithm": alg, "groups": groups, "dilations": dl, "data_format": fmt}
    if kind == "transpose":
        spec["output_padding"] = []
        spec["output_size"] = []
    return spec


def _with_out_grad(spec: dict[str, Any], ref_name: str) -> dict[str, Any]:
    args = {k: (np.zeros(v.shape) if isinstance(v, TGen) else v) for k, v in spec.items()}
    (o,) = ref_global(get_reference(ref_name), args)
    spec["output_grad"] = TGen(tuple(np.shape(o)), "real")
    return spec


def _gen_conv(nsp: int, kind: str, grad: bool, ref_name: str) -> Any:
    def gen(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
        spec = _conv_spec(r, m, nsp, kind)
        return _with_out_grad(spec, ref_name) if grad else spec

    return gen


GENERATORS[_P + "conv2d"] = _gen_conv(2, "conv2d", False, "conv2d")
GENERATORS[_P + "conv2d_grad"] = _gen_conv(2, "conv2d_grad", True, "conv2d")
GENERATORS[_P + "conv3d"] = _gen_conv(3, "conv", False, "conv3d")
GENERATORS[_P + "conv3d_grad"] = _gen_conv(3, "conv", True, "conv3d")
GENERATORS[_P + "depthwise"] = _gen_conv(2, "depthwise", False, "depthwise_conv2d")
GENERATORS[_P + "depthwise_grad"] = _gen_conv(2, "depthwise", True, "depthwise_conv2d")
GENERATORS[_P + "conv2d_transpose"] = _gen_conv(2, "transpose", False, "conv2d_transpose")
GENERATORS[_P + "conv2d_transpose_grad"] = _gen_conv(2, "transpose", True, "conv2d_transpose")


def _nchw(r: random.Random, m: list[int], lo: int, hi: int) -> list[int]:
    nd = r.randint(lo, hi)
    return [_sz(r, m) if i < 2 else r.randint(1, 4) for i in range(nd)]


def _g_bn(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    x = _nchw(r, m, 2, 5)
    c = x[1]
    return {"x": TGen(tuple(x)), "mean": TGen((c,)), "variance": TGen((c,), "pos"),
            "scale": TGen((c,)) if r.random() < 0.9 else None, "bias": TGen((c,)) if r.random() < 0.9 else None}


def _g_bn_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    x = _nchw(r, m, 2, 5)
    last = len(x) > 2 and r.random() < 0.3
    fmt = "NHWC" if last else "NCHW"
    if last:
        x = [x[0], *x[2:], x[1]]
    c = x[-1] if last else x[1]
    return {"x": TGen(tuple(x)), "scale": TGen((c,)) if r.random() < 0.9 else None,
            "bias": TGen((c,)) if r.random() < 0.9 else None, "mean_out": TGen((c,)),
            "variance_out": TGen((c,), "pos"), "saved_mean": TGen((c,)), "saved_variance": TGen((c,), "pos"),
            "reserve_space": TGen((0,)) if r.random() < 0.5 else None, "out_grad": TGen(tuple(x), "real"),
            "momentum": 0.9, "epsilon": 1e-5, "data_format": fmt, "is_test": r.random() < 0.15,
            "use_global_stats": r.random() < 0.1, "trainable_statistics": False}


def _g_gn(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    x = _nchw(r, m, 3, 5)
    c = x[1]
    return {"x": TGen(tuple(x)), "scale": TGen((c,)) if r.random() < 0.9 else None,
            "bias": TGen((c,)) if r.random() < 0.9 else None}


def _g_gn_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    x = _nchw(r, m, 3, 5)
    last = r.random() < 0.3
    if last:
        x = [x[0], *x[2:], x[1]]
    c = x[-1] if last else x[1]
    g = r.choice([d for d in range(1, c + 1) if c % d == 0])
    return {"x": TGen(tuple(x)), "scale": TGen((c,)) if r.random() < 0.9 else None,
            "bias": TGen((c,)) if r.random() < 0.9 else None, "y": TGen(tuple(x)), "mean": TGen((x[0], g)),
            "variance": TGen((x[0], g), "pos"), "y_grad": TGen(tuple(x), "real"), "epsilon": 1e-5,
            "groups": g if r.random() < 0.7 else -1, "data_format": "NHWC" if last else "NCHW"}


def _g_in(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    x = _nchw(r, m, 4, 4)
    c = x[1]
    return {"x": TGen(tuple(x)), "scale": TGen((c,)) if r.random() < 0.9 else None,
            "bias": TGen((c,)) if r.random() < 0.9 else None, "epsilon": 1e-5}


def _g_in_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    sp = _g_in(r, m, ref)
    x = sp["x"].shape
    sp.update({"saved_mean": TGen((x[0] * x[1],)), "saved_variance": TGen((x[0] * x[1],), "pos"),
               "y_grad": TGen(x, "real")})
    return sp


def _g_roi(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    n = _sz(r, m, 3)
    x = (n, _sz(r, m), r.randint(2, 6), r.randint(2, 6))
    k = r.randint(1, 5)
    use_num = n > 1 or r.random() < 0.6
    return {"x": TGen(x), "boxes": TGen((k, 4)), "boxes_num": TGen((n,), "int") if use_num else None,
            "pooled_height": r.randint(1, 3), "pooled_width": r.randint(1, 3),
            "spatial_scale": r.choice((1.0, 0.5)), "sampling_ratio": r.choice((-1, 1, 2)),
            "aligned": r.random() < 0.5}


def _g_roi_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    sp = _g_roi(r, m, ref)
    x, b = sp["x"].shape, sp["boxes"].shape
    sp["out_grad"] = TGen((b[0], x[1], sp["pooled_height"], sp["pooled_width"]), "real")
    return sp


GENERATORS[_P + "batch_norm"] = _g_bn
GENERATORS[_P + "batch_norm_grad"] = _g_bn_grad
GENERATORS[_P + "group_norm"] = _g_gn
GENERATORS[_P + "group_norm_grad"] = _g_gn_grad
GENERATORS[_P + "instance_norm"] = _g_in
GENERATORS[_P + "instance_norm_grad"] = _g_in_grad
GENERATORS[_P + "roi_align"] = _g_roi
GENERATORS[_P + "roi_align_grad"] = _g_roi_grad
