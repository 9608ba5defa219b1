"""How far a distributed run may fall from the single-process one, by dtype: torch-free, so that
``spmdkit run --engine torch``'s launcher (:mod:`spmdkit.execute.torchrun`, which imports no torch)
reads the same figures as the ranks' check (:mod:`spmdkit.execute.check`)."""

from __future__ import annotations

#: ``--kernels torch``: the largest error a tensor may have against its op run unsharded on the
#: ranks' inputs with the same kernel and dtypes, as a fraction of its scale (the largest magnitude of the
#: single-process value, at least ``check.FLOOR`` of the largest of its kind: a gradient that is
#: zero in exact arithmetic is rounding noise). Sharding changes the order of sums (a
#: row-parallel matmul's partial products, a gradient's all-reduce), so two runs agree to the
#: rounding of the dtype, compounded over the step: about 10x the largest error measured on the
#: zoo's tiny models and the 12 tiny HF models (float32 3.1e-6, float16 2.2e-3; bfloat16 2x its
#: 2.8e-2), docs/torch.md.
TOLERANCES = {"float64": 1e-9, "float32": 3e-5, "float16": 1e-2, "bfloat16": 6e-2}

__all__ = ["TOLERANCES"]
