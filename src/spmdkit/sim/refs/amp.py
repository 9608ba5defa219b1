"""Numpy references and case generators of the amp family (spmdkit.ops.amp):
check_finite_and_unscale and update_loss_scaling.

``check_finite_and_unscale``: ``out = x / scale`` and ``found_infinite = any(!isfinite(x))``
(``prepare`` plants an inf in some cases). ``update_loss_scaling``: outputs zeroed when
found_infinite; the loss scale and step counters updated as Paddle's kernel does. Both return their
vector output flat, next to the other outputs (as the verifier assembles them), except when run
for case generation (:attr:`~spmdkit.sim.reference.Ctx.nests_vectors`).
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np

from spmdkit.sim.cases import GENERATORS, TGen, rand_tensors
from spmdkit.sim.reference import Arrays, Ctx, Reference, register_reference


def _f(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _i(x: Any) -> np.ndarray:
    return np.asarray(x).astype(np.int64)


# -- check_finite_and_unscale / update_loss_scaling ------------------------------------------------


def _cfu(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    scale = _f(a["scale"]).reshape(-1)
    s = float(scale[0]) if scale.size else 1.0
    xs = [_f(x) for x in a["xs"]]
    outs = [x / s for x in xs]
    found = np.asarray([any(not np.all(np.isfinite(x)) for x in xs)])
    return (outs, found) if c.nests_vectors else (*outs, found)


def _prep_cfu(a: Arrays) -> None:
    xs = [_f(x).copy() for x in a["xs"]]
    if xs and xs[0].size and float(xs[0].reshape(-1)[0]) > 0.5:  # about one case in three
        xs[0].reshape(-1)[-1] = np.inf
    a["xs"] = xs


def _uls(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    found = bool(np.asarray(a["found_infinite"]).reshape(-1)[0]) if np.size(a["found_infinite"]) else False
    prev = float(_f(a["prev_loss_scaling"]).reshape(-1)[0])
    good = int(_i(a["in_good_steps"]).reshape(-1)[0])
    bad = int(_i(a["in_bad_steps"]).reshape(-1)[0])
    outs = [np.zeros_like(_f(x)) if found else _f(x).copy() for x in a["xs"]]
    scale = prev
    stop = a.get("stop_update", False)
    if not bool(stop):
        if found:
            good, bad = 0, bad + 1
            if bad == int(a["decr_every_n_nan_or_inf"]):
                scale = max(prev * float(a["decr_ratio"]), 1.0)
                bad = 0
        else:
            good, bad = good + 1, 0
            if good == int(a["incr_every_n_steps"]):
                new = prev * float(a["incr_ratio"])
                scale = new if math.isfinite(new) else prev
                good = 0
    state = (np.asarray([scale]), np.asarray([good], dtype=np.int64), np.asarray([bad], dtype=np.int64))
    return (outs, *state) if c.nests_vectors else (*outs, *state)


def _prep_uls(a: Arrays) -> None:
    for n in ("in_good_steps", "in_bad_steps"):
        a[n] = np.abs(_i(a[n]))


register_reference(Reference("check_finite_and_unscale", _cfu, ("xs", "scale"), ("out", "found_infinite"),
                             "check_finite_and_unscale", domains={"scale": "pos"}, prepare=_prep_cfu))
register_reference(Reference("update_loss_scaling", _uls,
                             ("xs", "found_infinite", "prev_loss_scaling", "in_good_steps", "in_bad_steps"),
                             ("out", "loss_scaling", "out_good_steps", "out_bad_steps"), "update_loss_scaling",
                             domains={"found_infinite": "bool", "prev_loss_scaling": "pos", "in_good_steps": "int",
                                      "in_bad_steps": "int"}, prepare=_prep_uls))


# -- case generators ----------------------------------------------------------------------------


def _g_cfu(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    return {"xs": rand_tensors(r, m, 2, 3), "scale": TGen((1,), "pos")}


def _g_uls(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    return {"xs": rand_tensors(r, m, 1, 2), "found_infinite": TGen((1,), "bool"), "prev_loss_scaling": TGen((1,), "pos"),
            "in_good_steps": TGen((1,), "int"), "in_bad_steps": TGen((1,), "int"),
            "incr_every_n_steps": r.choice((1, 2, 1000)), "decr_every_n_nan_or_inf": r.choice((1, 2)),
            "incr_ratio": 2.0, "decr_ratio": 0.5, "stop_update": r.random() < 0.2}


GENERATORS.update({
    "check_finite_and_unscale": _g_cfu,
    "update_loss_scaling": _g_uls,
})
