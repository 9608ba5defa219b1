"""torch kernels of the ``linalg`` family (:mod:`spmdkit.ops.linalg`): bmm: the matmul kernel."""

from __future__ import annotations

from spmdkit.execute.kernels._common import register
from spmdkit.execute.kernels.matmul import matmul_kernel

register("bmm")(matmul_kernel)
