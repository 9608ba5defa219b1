"""torch kernels of the ``optimizer`` family (:mod:`spmdkit.ops.optimizer`): adamW / Adam (the
reference's update on torch) and SGD."""

from __future__ import annotations

from typing import Any

import torch

from spmdkit.execute.kernels._common import TORCH, Args, Kernel, register, tensor
from spmdkit.sim.reference import Ctx
from spmdkit.sim.refs.optimizer import adam_update


def _scalar(x: Any) -> float:
    return float(tensor(x).reshape(-1)[0].item())


def _adam_kernel(decoupled: bool) -> Kernel:
    """Adam / AdamW as Paddle's kernel computes them (the reference's update, in torch): the
    moments in their own dtype, a float32 master copy updated where given (multi-precision:
    the parameter is then the master rounded to its dtype)."""

    def fn(a: Args, c: Ctx) -> tuple[Any, ...]:
        amsgrad = bool(a.get("amsgrad", False))
        b1, b2 = float(a.get("beta1", 0.9)), float(a.get("beta2", 0.999))
        lr = _scalar(a["learning_rate"])
        b1p, b2p = tensor(a["beta1_pow"]), tensor(a["beta2_pow"])
        m1, m2 = tensor(a["moment1"]), tensor(a["moment2"])
        g = tensor(a["grad"]).to(m1.dtype)
        m2max = a.get("moment2_max")
        master = a.get("master_param")
        use_master = master is not None and bool(a.get("multi_precision", False))
        p0 = tensor(a["param"])
        skip = a.get("skip_update")
        if skip is not None and tensor(skip).numel() and bool(tensor(skip).reshape(-1)[0]):
            mm = tensor(m2max).clone() if amsgrad and m2max is not None else None
            return (p0.clone(), m1.clone(), m2.clone(), mm, b1p.clone(), b2p.clone(),
                    None if master is None else tensor(master).clone())

        def update(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
            return adam_update(p, g, m1, m2, tensor(m2max) if amsgrad and m2max is not None else None, a, decoupled,
                               lr, _scalar(b1p), _scalar(b2p), TORCH)

        mo = None
        if master is not None:
            mo, m1o, m2o, m2mo = update(tensor(master))
        if use_master:
            assert mo is not None
            po = mo.to(p0.dtype)
        else:
            po, m1o, m2o, m2mo = update(p0)
        if a.get("use_global_beta_pow", False):
            b1o, b2o = b1p.clone(), b2p.clone()
        else:
            b1o, b2o = b1p * b1, b2p * b2
        return po, m1o, m2o, m2mo, b1o, b2o, mo

    return fn


register("adam", "adam_")(_adam_kernel(False))
register("adamw", "adamw_")(_adam_kernel(True))


@register("sgd", "sgd_")
def _k_sgd(a: Args, c: Ctx) -> tuple[Any, ...]:
    lr = _scalar(a["learning_rate"])
    g = tensor(a["grad"])
    master = a.get("master_param")
    mo = None if master is None else tensor(master) - lr * g.to(tensor(master).dtype)
    if mo is not None and a.get("multi_precision", False):
        return mo.to(tensor(a["param"]).dtype), mo
    return (tensor(a["param"]) - lr * g, mo)
