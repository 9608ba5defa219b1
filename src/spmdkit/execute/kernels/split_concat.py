"""torch kernels of the ``split_concat`` family (:mod:`spmdkit.ops.split_concat`): split, concat, stack
and unbind (each one's gradient is another's forward)."""

from __future__ import annotations

from typing import Any

import torch

from spmdkit.execute.kernels._common import Args, Kernel, axis_of, register, tensor
from spmdkit.sim.reference import Ctx


def _sections(sections: Any, size: int) -> list[int]:
    s = [int(v) for v in sections]
    if -1 in s:
        s[s.index(-1)] = size - sum(v for v in s if v != -1)
    return s


@register("split")
def _k_split(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = tensor(a["x"])
    ax = axis_of(a.get("axis", 0), x.ndim)
    return tuple(p.contiguous() for p in torch.split(x, _sections(a["sections"], x.shape[ax]), dim=ax))


@register("split_with_num")
def _k_split_with_num(a: Args, c: Ctx) -> tuple[Any, ...]:
    x = tensor(a["x"])
    return tuple(p.contiguous() for p in torch.chunk(x, int(a["num"]), dim=axis_of(a.get("axis", 0), x.ndim)))


def _concat_kernel(name: str) -> Kernel:
    def fn(a: Args, c: Ctx) -> tuple[Any, ...]:
        xs = [tensor(t) for t in a[name]]
        return (torch.cat(xs, dim=axis_of(a.get("axis", 0), xs[0].ndim)),)

    return fn


register("concat")(_concat_kernel("x"))
register("split_grad", "split_with_num_grad")(_concat_kernel("out_grad"))


@register("concat_grad")
def _k_concat_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    g = tensor(a["output_grad"])
    ax = axis_of(a.get("axis", 0), g.ndim)
    return tuple(p.contiguous() for p in torch.split(g, [tensor(t).shape[ax] for t in a["x"]], dim=ax))


def _stack_kernel(name: str) -> Kernel:
    def fn(a: Args, c: Ctx) -> tuple[Any, ...]:
        xs = [tensor(t) for t in a[name]]
        return (torch.stack(xs, dim=axis_of(a.get("axis", 0), xs[0].ndim + 1)),)

    return fn


def _unbind_kernel(name: str) -> Kernel:
    def fn(a: Args, c: Ctx) -> tuple[Any, ...]:
        x = tensor(a[name])
        return tuple(v.clone() for v in torch.unbind(x, dim=axis_of(a.get("axis", 0), x.ndim)))

    return fn


register("stack")(_stack_kernel("x"))
register("unbind_grad")(_stack_kernel("out_grad"))
register("unbind")(_unbind_kernel("x"))
register("stack_grad")(_unbind_kernel("output_grad"))
