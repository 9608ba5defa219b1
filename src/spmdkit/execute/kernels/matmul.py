"""torch kernels of the ``matmul`` family (:mod:`spmdkit.ops.matmul`): matmul and its gradient: the
reference's formula (:func:`spmdkit.sim.refs.matmul.matmul`), run on torch."""

from __future__ import annotations

from typing import Any

from spmdkit.execute.kernels._common import Args, register, tensor
from spmdkit.sim.reference import Ctx
from spmdkit.sim.refs.matmul import matmul, matmul_grad


@register("matmul", "matmul_v2")
def matmul_kernel(a: Args, c: Ctx) -> tuple[Any, ...]:
    return (matmul(tensor(a["x"]), tensor(a["y"]), bool(a.get("trans_x", False)), bool(a.get("trans_y", False))),)


@register("matmul_grad", "matmul_v2_grad")
def _k_matmul_grad(a: Args, c: Ctx) -> tuple[Any, ...]:
    return matmul_grad(tensor(a["x"]), tensor(a["y"]), tensor(a["out_grad"]), bool(a.get("trans_x", False)),
                       bool(a.get("trans_y", False)))
