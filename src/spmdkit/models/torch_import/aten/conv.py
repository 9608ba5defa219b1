"""Lowerings of ATen ops to the ``conv`` family's rules (:mod:`spmdkit.ops.conv`): conv1d / conv2d /
convolution (1-D or 2-D, not transposed)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spmdkit.models.torch_import.context import Hook, ImportContext


def _pair(v: Any, n: int = 2) -> tuple[int, ...]:
    if isinstance(v, int):
        return (v,) * n
    t = tuple(int(x) for x in v)
    return t * n if len(t) == 1 else t


def _conv2d(c: ImportContext) -> Any:
    """``conv1d`` / ``conv2d`` / ``convolution`` (1-D or 2-D, not transposed). A 1-D convolution
    (Mamba's depthwise causal conv: groups = channels, padding k - 1) is the 2-D one over a unit
    height axis (input and filter unsqueezed at axis 2, the output squeezed). Stride 1, no padding, dilation 1,
    groups 1: the ``conv2d`` rule (Paddle's Conv2dInferSpmdBase takes no geometry attributes,
    so its program op cannot carry any). Any other geometry: ``conv3d`` over a unit depth axis
    (input and filter unsqueezed at axis 2, the output squeezed), whose rule carries strides,
    paddings, dilations and groups; the same arithmetic, and the same shardings (batch; the
    channels only with groups 1). A bias is added as ``[C_out, 1, 1]``."""
    x, w, bias = c.args[0], c.args[1], c.arg(2, "bias")
    conv = c.target.startswith("aten.convolution")
    if conv and bool(c.arg(6, "transposed", False)):
        raise c.unsupported("a transposed convolution")
    stride = _pair(c.arg(3, "stride", 1))
    padding: Any = c.arg(4, "padding", 0)
    dilation = _pair(c.arg(5, "dilation", 1))
    groups = int(c.arg(8 if conv else 6, "groups", 1))
    xs, ws = c.shape(x), c.shape(w)
    if len(xs) == 3 and len(ws) == 3:
        return _conv1d(c, x, w, bias, stride, padding, dilation, groups)
    if len(xs) != 4 or len(ws) != 4:
        raise c.unsupported(f"a {len(ws) - 2}-D convolution (1-D or 2-D with a batch axis only)")
    return _conv(c, x, w, bias, stride, padding, dilation, groups, c.out_shape(), c.name)


def _conv1d(c: ImportContext, x: Any, w: Any, bias: Any, stride: tuple[int, ...], padding: Any,
            dilation: tuple[int, ...], groups: int) -> Any:
    """A 1-D convolution as the 2-D one over a unit height axis."""
    xs, ws, out = c.shape(x), c.shape(w), c.out_shape()
    x4 = c.emit1("unsqueeze", {"x": x}, (c.fresh("input2d"), (xs[0], xs[1], 1, xs[2]), c.dtype(x)), axis=(2,))
    w4 = c.emit1("unsqueeze", {"x": w}, (c.fresh("filter2d"), (ws[0], ws[1], 1, ws[2]), c.dtype(w)), axis=(2,))
    pad2: Any = padding if isinstance(padding, str) else (0, _pair(padding, 1)[0])
    y4 = _conv(c, x4, w4, bias, (1, stride[0]), pad2, (1, dilation[0]), groups, (out[0], out[1], 1, out[2]),
               c.fresh("conv2d"))
    return c.emit1("squeeze", {"x": y4}, axis=(2,))


def _conv(c: ImportContext, x: Any, w: Any, bias: Any, stride: tuple[int, ...], padding: Any,
          dilation: tuple[int, ...], groups: int, out: Sequence[int], name: str) -> Any:
    xs, ws = c.shape(x), c.shape(w)
    if isinstance(padding, str):  # 'valid' / 'same' (stride 1): the explicit pads torch uses
        if padding == "valid":
            pads: tuple[int, ...] = (0, 0, 0, 0)
        else:
            tot = [d * (k - 1) for d, k in zip(dilation, ws[2:])]
            pads = (tot[0] // 2, tot[0] - tot[0] // 2, tot[1] // 2, tot[1] - tot[1] // 2)
    else:
        p2 = _pair(padding)
        pads = (p2[0], p2[0], p2[1], p2[1])
    dt = c.dtype(x)
    has_bias = bias is not None
    res_name = c.fresh("conv") if has_bias else name
    res_shape = (out[0], out[1], out[2], out[3])
    if stride == (1, 1) and not any(pads) and dilation == (1, 1) and groups == 1:
        y = c.emit1("conv2d", {"input": x, "filter": w}, (res_name, res_shape, dt))
    else:
        x5 = c.emit1("unsqueeze", {"x": x}, (c.fresh("input3d"), (xs[0], xs[1], 1, xs[2], xs[3]), dt), axis=(2,))
        w5 = c.emit1("unsqueeze", {"x": w}, (c.fresh("filter3d"), (ws[0], ws[1], 1, ws[2], ws[3]), c.dtype(w)),
                     axis=(2,))
        y5 = c.emit1("conv3d", {"input": x5, "filter": w5}, (c.fresh("conv3d"), (out[0], out[1], 1, out[2], out[3]), dt),
                     strides=(1, *stride), paddings=(0, 0, *pads), dilations=(1, *dilation), groups=groups,
                     padding_algorithm="EXPLICIT", data_format="NCDHW")
        y = c.emit1("squeeze", {"x": y5}, (res_name, res_shape, dt), axis=(2,))
    if not has_bias:
        return y
    b3 = c.reshape(bias, (c.shape(bias)[0], 1, 1), c.fresh("bias"))
    return c.emit1("add", {"x": y, "y": b3}, (name, res_shape, dt))


def _table() -> dict[str, Hook]:
    t: dict[str, Hook] = {}
    t["aten.conv1d"] = t["aten.conv2d"] = t["aten.convolution"] = _conv2d
    return t


#: ATen op (packet or overload) -> its lowering
ATEN = _table()
