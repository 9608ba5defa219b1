"""torch kernels of the ``view`` family (:mod:`spmdkit.ops.view`): reshape, flatten, squeeze and
unsqueeze (the localize hook's local target on a rank), and their gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spmdkit.execute.kernels._common import Args, Kernel, register, tensor
from spmdkit.sim.reference import Ctx
from spmdkit.sim.refs import view as o
from spmdkit.sim.refs.view import resolve_shape


@register("reshape", "reshape2")
def _k_reshape(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = tensor(a["x"])
    if not c.is_global and c.out_attrs:  # the localize hook's local target
        return (x.reshape(tuple(a["shape"])),)
    return (x.reshape(resolve_shape(a["shape"], tuple(x.shape))),)


def _view_kernel(name: str, shape_of: Callable[[Args, tuple[int, ...]], tuple[int, ...]]) -> Kernel:
    def fn(a: Args, c: Ctx) -> tuple[Any, ...]:
        x = tensor(a[name])
        shape = shape_of(a, tuple(x.shape)) if c.is_global else tuple(a["shape"])
        return (x.reshape(shape),)

    return fn


def _view_grad_kernel(holder: str) -> Kernel:
    def fn(a: Args, c: Ctx) -> tuple[Any, ...]:
        g = tensor(a["out_grad"])
        return (g.reshape(tuple(tensor(a[holder]).shape) if c.is_global else tuple(a["shape"])),)

    return fn


def _register_views() -> None:
    for n, shape_of in (("flatten", o.flatten_shape), ("squeeze", o.squeeze_shape),
                        ("unsqueeze", o.unsqueeze_shape)):
        register(n, *(("unsqueeze2",) if n == "unsqueeze" else ()))(_view_kernel("x", shape_of))
    for n, holder in (("reshape_grad", "x_shape"), ("flatten_grad", "xshape"), ("squeeze_grad", "xshape"),
                      ("unsqueeze_grad", "x")):
        register(n)(_view_grad_kernel(holder))


_register_views()
