"""Numpy references and case generators of the optimizer family (spmdkit.ops.optimizer): the
updates adam, adamw and sgd (one real update step each, in Paddle's kernel formulas) and
coalesce_tensor.

``coalesce_tensor``: the outputs are the inputs (copy_data), the constant (set_constant) or zeros
(memory left as it is, modelled as zeros); fused_output their flattened concatenation, each piece
padded to the alignment. Its vector output comes back flat next to fused_output (as the verifier
assembles them), except when run for case generation
(:attr:`~spmdkit.sim.reference.Ctx.nests_vectors`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, TGen, rand_shape, rand_tensors
from spmdkit.sim.reference import NUMPY, ArrayLib, Arrays, Ctx, Reference, register_reference


def _f(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _scalar(x: Any) -> float:
    return float(_f(x).reshape(-1)[0])


def _skip(a: Arrays) -> bool:
    s = a.get("skip_update")
    if s is None or np.size(s) == 0:
        return False
    return bool(np.asarray(s).reshape(-1)[0])


def adam_update(p: Any, g: Any, m1: Any, m2: Any, m2max: Any, a: Mapping[str, Any], decoupled: bool, lr: float,
                b1s: float, b2s: float, xp: ArrayLib) -> tuple[Any, Any, Any, Any]:
    """One Adam / AdamW update as Paddle's kernel computes it, in the array library ``xp`` (the
    step cast to the parameter's dtype): (param, moment1, moment2, moment2_max or None).
    ``m2max``: the amsgrad running maximum, None without amsgrad; ``b1s`` / ``b2s``: the beta
    powers; ``a``: the op's attributes."""
    b1, b2 = float(a.get("beta1", 0.9)), float(a.get("beta2", 0.999))
    eps = float(a.get("epsilon", 1e-8))
    step_lr = lr
    if decoupled:
        step_lr = lr * float(a.get("lr_ratio", 1.0))
        if a.get("with_decay", False):
            p = p * (1.0 - step_lr * float(a.get("coeff", 0.01)))
    m1o = b1 * m1 + (1.0 - b1) * g
    m2o = b2 * m2 + (1.0 - b2) * g * g
    m2mo = None
    denom = m2o
    if m2max is not None:
        m2mo = xp.maximum(m2max, m2o)
        denom = m2mo
    lr_t = step_lr * math.sqrt(1.0 - b2s) / (1.0 - b1s)
    po = p - xp.cast(lr_t * (m1o / (xp.sqrt(denom) + eps * math.sqrt(1.0 - b2s))), p)
    return po, m1o, m2o, m2mo


def _adam_step(a: Arrays, decoupled: bool) -> tuple[Any, ...]:
    amsgrad = bool(a.get("amsgrad", False))
    b1, b2 = float(a.get("beta1", 0.9)), float(a.get("beta2", 0.999))
    lr = _scalar(a["learning_rate"])
    b1p, b2p = _f(a["beta1_pow"]), _f(a["beta2_pow"])
    g = _f(a["grad"])
    m1, m2 = _f(a["moment1"]), _f(a["moment2"])
    m2max = a.get("moment2_max")
    master = a.get("master_param")
    use_master = master is not None and bool(a.get("multi_precision", False))

    def update(p: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
        return adam_update(p, g, m1, m2, _f(m2max) if amsgrad and m2max is not None else None, a, decoupled,
                           lr, _scalar(b1p), _scalar(b2p), NUMPY)

    if _skip(a):
        po: np.ndarray = _f(a["param"]).copy()
        m1o, m2o = m1.copy(), m2.copy()
        m2mo = _f(m2max).copy() if amsgrad and m2max is not None else None
        mo = None if master is None else _f(master).copy()
        return po, m1o, m2o, m2mo, b1p.copy(), b2p.copy(), mo
    mo = None
    if master is not None:
        mo, m1o, m2o, m2mo = update(_f(master))
    if use_master:
        assert mo is not None
        po = mo.copy()
    else:
        po, m1o, m2o, m2mo = update(_f(a["param"]))
    if a.get("use_global_beta_pow", False):
        b1o, b2o = b1p.copy(), b2p.copy()
    else:
        b1o, b2o = b1p * b1, b2p * b2
    return po, m1o, m2o, m2mo, b1o, b2o, mo


def _adam(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return _adam_step(a, False)


def _adamw(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return _adam_step(a, True)


def _sgd(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    lr = _scalar(a["learning_rate"])
    g = _f(a["grad"])
    master = a.get("master_param")
    mo = None if master is None else _f(master) - lr * g
    if master is not None and a.get("multi_precision", False):
        assert mo is not None
        return mo.copy(), mo
    return _f(a["param"]) - lr * g, mo


_OUTS = ("param_out", "moment1_out", "moment2_out", "moment2_max_out", "beta1_pow_out", "beta2_pow_out",
         "master_param_out")
_DOM = {"learning_rate": "pos", "moment2": "pos", "moment2_max": "pos", "beta1_pow": "prob", "beta2_pow": "prob",
        "skip_update": "bool"}

register_reference(Reference("adam", _adam, ("param", "grad", "learning_rate", "moment1", "moment2", "beta1_pow",
                                              "beta2_pow"), _OUTS, "adam",
                             optional=("moment2_max", "master_param", "skip_update"), domains=_DOM), "adam_")
register_reference(Reference("adamw", _adamw, ("param", "grad", "learning_rate", "moment1", "moment2", "beta1_pow",
                                                "beta2_pow"), _OUTS, "adam",
                             optional=("moment2_max", "master_param", "skip_update"), domains=_DOM), "adamw_")
register_reference(Reference("sgd", _sgd, ("param", "learning_rate", "grad"), ("param_out", "master_param_out"),
                             "sgd", optional=("master_param",), domains={"learning_rate": "pos"}), "sgd_")


def _g_adam(r: random.Random, m: list[int], ref: Any) -> dict[str, Any]:
    s = rand_shape(r, m, 1, 3)
    amsgrad = r.random() < 0.3
    return {
        "param": TGen(s), "grad": TGen(s), "learning_rate": TGen((1,), "pos"), "moment1": TGen(s),
        "moment2": TGen(s, "pos"), "moment2_max": TGen(s, "pos") if amsgrad or r.random() < 0.1 else None,
        "beta1_pow": TGen((1,), "prob"), "beta2_pow": TGen((1,), "prob"),
        "master_param": TGen(s) if r.random() < 0.3 else None,
        "skip_update": TGen((1,), "bool") if r.random() < 0.2 else None,
        "beta1": r.choice((0.9, 0.5)), "beta2": r.choice((0.999, 0.9)), "epsilon": 1e-8,
        "lr_ratio": r.choice((1.0, 0.5)), "coeff": r.choice((0.01, 0.1)), "with_decay": r.random() < 0.5,
        "lazy_mode": False, "min_row_size_to_use_multithread": 1000, "multi_precision": r.random() < 0.3,
        "use_global_beta_pow": r.random() < 0.2, "amsgrad": amsgrad,
    }


def _g_sgd(r: random.Random, m: list[int], ref: Any) -> dict[str, Any]:
    s = rand_shape(r, m, 1, 3)
    return {"param": TGen(s), "learning_rate": TGen((1,), "pos"), "grad": TGen(s),
            "master_param": TGen(s) if r.random() < 0.3 else None, "multi_precision": r.random() < 0.4}


GENERATORS["adam"] = _g_adam
GENERATORS["sgd"] = _g_sgd


# -- coalesce_tensor -------------------------------------------------------------------------------


def _aligned(n: int, a: Arrays) -> int:
    if not bool(a.get("use_align", True)):
        return n
    size = int(a.get("size_of_dtype", -1))
    size = size if size > 0 else 4
    align = int(a.get("align_size", -1))
    align = align if align > 0 else 256
    unit = max(align // size, 1)
    return -(-n // unit) * unit


def _coalesce(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    xs = [_f(x) for x in a["input"]]
    if bool(a.get("copy_data", False)):
        outs = [x.copy() for x in xs]
    elif bool(a.get("set_constant", False)):
        outs = [np.full(x.shape, float(a.get("constant", 0.0))) for x in xs]
    else:
        outs = [np.zeros(x.shape) for x in xs]
    fill = float(a.get("constant", 0.0)) if bool(a.get("set_constant", False)) else 0.0
    pieces = []
    for o in outs:
        flat = o.reshape(-1)
        pad = _aligned(flat.size, a) - flat.size
        pieces.append(np.concatenate([flat, np.full(pad, fill)]) if pad else flat)
    fused = np.concatenate(pieces) if pieces else np.zeros(0)
    return (outs, fused) if c.nests_vectors else (*outs, fused)


register_reference(Reference("coalesce_tensor", _coalesce, ("input",), ("output", "fused_output"), "coalesce_tensor"))


def _g_coalesce(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    return {"input": rand_tensors(r, m, 2, 3), "dtype": r.choice(("float32", "float16", "bfloat16")),
            "copy_data": r.random() < 0.6, "set_constant": r.random() < 0.3, "persist_output": r.random() < 0.2,
            "constant": r.choice((0.0, 1.5)), "use_align": r.random() < 0.7, "align_size": r.choice((-1, 16, 256)),
            "size_of_dtype": r.choice((-1, 2, 4))}


GENERATORS["coalesce_tensor"] = _g_coalesce
