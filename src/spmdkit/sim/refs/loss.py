"""Numpy references and case generators of the loss family (spmdkit.ops.loss): cross entropy (plain
and model-parallel), the multi-label model-parallel cross entropy, mean_all, label_smooth and
their grads.

``cross_entropy_with_softmax`` runs the plain kernel on a rank's local logits (a sharded
class axis gives a local softmax: the rule must keep that axis replicated). Hard labels are
folded into ``[0, classes)`` by ``prepare``, with some set to ``ignore_index`` (loss and grad
0 there); soft labels are normalized; with ``use_softmax=False`` the logits are made
probabilities.

``c_softmax_with_cross_entropy`` is a communicating kernel: the ranks that share the class
axis all-reduce the max and the sum of exponentials. The simulator runs ranks one at a time,
so a rank gets the group's gathered logits from the global run (``_GROUP``; the verifier runs
the global op first, then every rank) after checking that its own local logits are exactly
its slice of them (a partial or otherwise mis-sharded x fails there); it returns its own
class slice of the softmax and the loss of its rows from its own local label. The grad is
local: a rank subtracts the one-hot of the labels that fall in its class range.

``c_softmax_with_multi_label_cross_entropy`` is a communicating kernel the same way (its own
``_ML_GROUP``): a rank returns its class slice of the softmax and the loss of its own labels:
``loss[..., j] = (logsumexp(x) - x[label_j]) * smooth_weight_j`` (0 where ``label_j ==
ignore_index``), summed over j with ``sum_multi_label_loss``. The grad is the true gradient
``softmax * sum_j c_j - sum_j c_j onehot(label_j)``, ``c_j = loss_grad_j * smooth_weight_j``
(valid labels), each rank handling its class range.

``mean_all`` averages the local x; ``mean_all_grad`` divides by the local element count (as
the kernel does), so only a replicated x is sound. ``label_smooth`` runs on a rank's local
label with the global attributes (the rule keeps the class axis replicated).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np

from spmdkit.core.dist_attr import entry_dims
from spmdkit.sim.cases import GENERATORS, TGen, rand_axis, rand_shape, rand_size
from spmdkit.sim.mesh import local_slices
from spmdkit.sim.reference import Arrays, Ctx, Reference, register_reference

#: the global logits of the class-parallel kernels' last global run, for their ranks
_GROUP: dict[str, Any] = {}
_ML_GROUP: dict[str, Any] = {}


def _f(x: Any) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def _i(x: Any) -> np.ndarray:
    return np.asarray(x).astype(np.int64)


def _ax(axis: Any, nd: int) -> int:
    a = int(axis)
    return a + nd if a < 0 else a


def log_softmax(x: np.ndarray, ax: int) -> np.ndarray:
    x = _f(x)
    if x.size == 0:
        return x.copy()
    m = x.max(axis=ax, keepdims=True)
    return np.asarray(x - m - np.log(np.exp(x - m).sum(axis=ax, keepdims=True)))


def _hard(label: Any, classes: int, ignore_index: int) -> tuple[np.ndarray, np.ndarray]:
    lab = np.asarray(label).astype(np.int64)
    valid = lab != ignore_index
    return np.clip(lab, 0, max(classes - 1, 0)), valid


def cross_entropy(x: Any, label: Any, soft: bool, use_softmax: bool, ignore_index: int, ax: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(softmax, loss) of Paddle's cross_entropy_with_softmax kernel."""
    x = _f(x)
    if use_softmax:
        logsm = log_softmax(x, ax)
        sm = np.exp(logsm)
    else:
        sm = x.copy()
        logsm = np.log(x)
    if soft:
        loss = -(_f(label) * logsm).sum(axis=ax, keepdims=True)
    else:
        idx, valid = _hard(label, x.shape[ax], ignore_index)
        if x.shape[ax] == 0:
            return sm, np.zeros(idx.shape)
        picked = np.take_along_axis(logsm, idx, axis=ax)
        loss = np.where(valid, -picked, 0.0)
    return sm, np.asarray(loss)


def cross_entropy_grad(label: Any, softmax: Any, loss_grad: Any, soft: bool, use_softmax: bool, ignore_index: int,
                       ax: int, class_start: int = 0) -> np.ndarray:
    """d(sum(loss * loss_grad)) / d(logits) given the softmax (classes from ``class_start``)."""
    sm = _f(softmax)
    g = _f(loss_grad)
    if soft:
        lab = _f(label)
        return np.asarray((sm - lab) * g if use_softmax else -lab / sm * g)
    lab = np.asarray(label).astype(np.int64)
    valid = lab != ignore_index
    shape = [1] * sm.ndim
    shape[ax] = sm.shape[ax]
    classes = np.arange(class_start, class_start + sm.shape[ax]).reshape(shape)
    onehot = (lab == classes).astype(np.float64)
    out = (sm - onehot) * g if use_softmax else -onehot / sm * g
    return np.asarray(np.where(valid, out, 0.0))


def _ce(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = a["x"]
    ax = _ax(a.get("axis", -1), np.ndim(x))
    return cross_entropy(x, a["label"], bool(a.get("soft_label", False)), bool(a.get("use_softmax", True)),
                         int(a.get("ignore_index", -100)), ax)


def _prep_label(a: Arrays, ax: int, classes: int, key: str = "label") -> None:
    if bool(a.get("soft_label", False)):
        lab = _f(a[key])
        a[key] = np.exp(log_softmax(lab, ax)) if lab.size else lab
        return
    raw = np.asarray(a[key]).astype(np.int64)
    lab = np.abs(raw) % max(classes, 1)
    a[key] = np.where(raw % 5 == 0, int(a.get("ignore_index", -100)), lab)


def _prep_ce(a: Arrays) -> None:
    nd = np.ndim(a["x"])
    ax = _ax(a.get("axis", -1), nd)
    if not bool(a.get("use_softmax", True)) and np.size(a["x"]):
        a["x"] = np.exp(log_softmax(a["x"], ax))
    _prep_label(a, ax, int(np.shape(a["x"])[ax]))


def _ce_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    sm = a["softmax"]
    ax = _ax(a.get("axis", -1), np.ndim(sm))
    return (cross_entropy_grad(a["label"], sm, a["loss_grad"], bool(a.get("soft_label", False)),
                               bool(a.get("use_softmax", True)), int(a.get("ignore_index", -100)), ax),)


def _prep_ce_grad(a: Arrays) -> None:
    nd = np.ndim(a["softmax"])
    ax = _ax(a.get("axis", -1), nd)
    if np.size(a["softmax"]):
        a["softmax"] = np.exp(log_softmax(a["softmax"], ax))
    _prep_label(a, ax, int(np.shape(a["softmax"])[ax]))


register_reference(Reference("cross_entropy_with_softmax", _ce, ("x", "label"), ("softmax", "loss"),
                             "cross_entropy", domains={"label": "int"}, prepare=_prep_ce),
                   "softmax_with_cross_entropy")
register_reference(Reference("cross_entropy_with_softmax_grad", _ce_grad, ("label", "softmax", "loss_grad"),
                             ("x_grad",), "cross_entropy_grad", domains={"label": "int"}, prepare=_prep_ce_grad),
                   "softmax_with_cross_entropy_grad")


# -- c_softmax_with_cross_entropy ----------------------------------------------------------------


def class_parallel(group: dict[str, Any], op: str, x: np.ndarray, c: Ctx,
                   run: Callable[[np.ndarray], tuple[Any, ...]], comm: Callable[[], tuple[Any, ...]]
                   ) -> tuple[Any, ...]:
    """A class-parallel kernel (softmax and loss over a class axis the ranks may shard): ``run``
    on the global logits ``x`` (kept in ``group`` for the ranks); on a real engine's rank
    ``comm()``; on a simulated rank ``run`` on its rows of the global logits, every class (what
    its class group gathers), its class slice of the softmax and its loss, after checking that
    its local ``x`` is exactly its slice of the global one (ValueError naming ``op`` else)."""
    if c.is_global:
        group["x"] = x.copy()
        return run(x)
    if c.comm is not None:
        return comm()
    gx = group.get("x")
    gshape = tuple(c.shapes.get("x") or ())
    if gx is None or gx.shape != gshape or c.coords is None:
        raise ValueError(f"{op}: no global run to gather the class axis from")
    sl = local_slices(c.in_attrs["x"], gshape, c.coords)
    if x.shape != gx[sl].shape or not np.allclose(x, gx[sl], rtol=1e-7, atol=1e-9):
        raise ValueError(f"{op}: the local logits are not this rank's slice of x")
    sm, loss = run(gx[(*sl[:-1], slice(None))])
    return sm[..., sl[-1]], loss


def _c_softmax(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = _f(a["x"])
    ig = int(a.get("ignore_index", -100))
    return class_parallel(_GROUP, "c_softmax_with_cross_entropy", x, c,
                          lambda rows: cross_entropy(rows, a["label"], False, True, ig, rows.ndim - 1),
                          lambda: _c_softmax_comm(x, a["label"], ig, c))


def _c_softmax_comm(x: np.ndarray, label: Any, ig: int, c: Ctx) -> tuple[Any, ...]:
    """The kernel as a rank runs it on a real engine: max, sum of exponentials and the
    label's logit all-reduced over the mesh dims that shard the class axis."""
    dims = entry_dims(c.in_attrs["x"].dims_mapping[-1])
    start = class_start(c, "x")
    m = c.comm.all_reduce(x.max(axis=-1, keepdims=True), dims, "max")
    e = np.exp(x - m)
    s = c.comm.all_reduce(e.sum(axis=-1, keepdims=True), dims, "sum")
    idx, valid = _hard(label, int(c.shapes["x"][-1]), ig)
    loc = idx - start
    mine = (loc >= 0) & (loc < x.shape[-1])
    picked = np.take_along_axis(x, np.clip(loc, 0, max(x.shape[-1] - 1, 0)), axis=-1)
    xl = c.comm.all_reduce(np.where(mine, picked, 0.0), dims, "sum")
    return e / s, np.where(valid, -(xl - m - np.log(s)), 0.0)


def _prep_c(a: Arrays) -> None:
    x = a["x"]
    _prep_label(a, np.ndim(x) - 1, int(np.shape(x)[-1]))


def class_start(c: Ctx, name: str) -> int:
    if c.is_global or c.coords is None:
        return 0
    return int(local_slices(c.in_attrs[name], c.shapes[name], c.coords)[-1].start)


def _c_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    sm = a["softmax"]
    return (cross_entropy_grad(a["label"], sm, a["loss_grad"], False, True, int(a.get("ignore_index", -100)),
                               np.ndim(sm) - 1, int(a.get("_class_start", 0))),)


def _localize_c_grad(a: Arrays, c: Ctx) -> Arrays:
    out = dict(a)
    out["_class_start"] = class_start(c, "softmax")
    return out


def _prep_c_grad(a: Arrays) -> None:
    sm = a["softmax"]
    if np.size(sm):
        a["softmax"] = np.exp(log_softmax(sm, np.ndim(sm) - 1))
    _prep_label(a, np.ndim(sm) - 1, int(np.shape(sm)[-1]))


register_reference(Reference("c_softmax_with_cross_entropy", _c_softmax, ("x", "label"), ("softmax", "loss"),
                             "c_softmax", domains={"label": "int"}, prepare=_prep_c))
register_reference(Reference("c_softmax_with_cross_entropy_grad", _c_grad, ("softmax", "label", "loss_grad"),
                             ("x_grad",), "c_softmax_grad", domains={"label": "int"}, prepare=_prep_c_grad,
                             localize=_localize_c_grad))


# -- mean_all -----------------------------------------------------------------------------------


def _mean_all(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = _f(a["x"])
    return (np.asarray(x.mean() if x.size else np.nan),)


def _mean_all_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = np.asarray(a["x"])
    g = float(_f(a["out_grad"]).reshape(-1)[0]) if np.size(a["out_grad"]) else 0.0
    return (np.full(x.shape, g / x.size if x.size else 0.0),)


register_reference(Reference("mean_all", _mean_all, ("x",), ("out",), "mean_all"))
register_reference(Reference("mean_all_grad", _mean_all_grad, ("x", "out_grad"), ("x_grad",), "mean_all_grad"))


# -- generators ---------------------------------------------------------------------------------


def _logits(r: random.Random, m: list[int], last: bool = False) -> tuple[tuple[int, ...], int]:
    s = rand_shape(r, m, 1, 4)
    ax = len(s) - 1 if last or r.random() < 0.5 else rand_axis(r, len(s)) % len(s)
    return s, ax


def _one(s: tuple[int, ...], ax: int) -> tuple[int, ...]:
    return (*s[:ax], 1, *s[ax + 1:])


def _g_ce(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s, ax = _logits(r, m)
    soft = r.random() < 0.25
    return {"x": TGen(s), "label": TGen(s if soft else _one(s, ax), "real" if soft else "int"), "soft_label": soft,
            "use_softmax": r.random() < 0.8, "numeric_stable_mode": r.random() < 0.8,
            "ignore_index": r.choice((-100, -100, -1, 0)), "axis": ax - len(s) if r.random() < 0.5 else ax}


def _g_ce_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    sp = _g_ce(r, m, ref)
    x = sp.pop("x")
    ax = _ax(sp["axis"], len(x.shape))
    sp["softmax"] = x
    sp["loss_grad"] = TGen(_one(x.shape, ax), "real")
    return sp


def _g_c_softmax(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s, ax = _logits(r, m, last=True)
    nranks = r.choice((1, 2, 4))
    return {"x": TGen(s), "label": TGen(_one(s, ax), "int"), "ignore_index": r.choice((-100, -100, 0)),
            "rank": r.randrange(nranks), "nranks": nranks}


def _g_c_softmax_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    sp = _g_c_softmax(r, m, ref)
    x = sp.pop("x")
    sp["softmax"] = x
    sp["loss_grad"] = TGen(_one(x.shape, len(x.shape) - 1), "real")
    return sp


def _g_mean_all(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    return {"x": TGen(rand_shape(r, m, 0, 4))}


def _g_mean_all_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    return {"x": TGen(rand_shape(r, m, 0, 4)), "out_grad": TGen((), "real")}


GENERATORS.update({
    "cross_entropy": _g_ce,
    "cross_entropy_grad": _g_ce_grad,
    "c_softmax": _g_c_softmax,
    "c_softmax_grad": _g_c_softmax_grad,
    "mean_all": _g_mean_all,
    "mean_all_grad": _g_mean_all_grad,
})


# -- c_softmax_with_multi_label_cross_entropy ------------------------------------------------------


def _ml_loss(logsm_picked: np.ndarray, label: np.ndarray, w: np.ndarray, ig: int, summed: bool) -> np.ndarray:
    loss = np.where(label == ig, 0.0, -logsm_picked * w)
    return np.asarray(loss.sum(axis=-1, keepdims=True) if summed else loss)


def _ml_global(x: np.ndarray, label: Any, w: Any, ig: int, summed: bool) -> tuple[np.ndarray, np.ndarray]:
    lab = _i(label)
    logsm = log_softmax(x, -1)
    if x.shape[-1] == 0:
        picked = np.zeros(lab.shape)
    else:
        picked = np.take_along_axis(logsm, np.clip(lab, 0, x.shape[-1] - 1), axis=-1)
    return np.exp(logsm), _ml_loss(picked, lab, _f(w), ig, summed)


def _ml(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    x = _f(a["x"])
    ig = int(a.get("ignore_index", -100))
    summed = bool(a.get("sum_multi_label_loss", True))
    return class_parallel(_ML_GROUP, "c_softmax_with_multi_label_cross_entropy", x, c,
                          lambda rows: _ml_global(rows, a["label"], a["smooth_weight"], ig, summed),
                          lambda: _ml_comm(x, a, ig, summed, c))


def _ml_comm(x: np.ndarray, a: Arrays, ig: int, summed: bool, c: Ctx) -> tuple[Any, ...]:
    """The kernel as a rank runs it on a real engine: max, sum of exponentials and the labels'
    logits all-reduced over the mesh dims that shard the class axis."""
    dims = entry_dims(c.in_attrs["x"].dims_mapping[-1])
    start = class_start(c, "x")
    m = c.comm.all_reduce(x.max(axis=-1, keepdims=True), dims, "max")
    e = np.exp(x - m)
    s = c.comm.all_reduce(e.sum(axis=-1, keepdims=True), dims, "sum")
    lab = _i(a["label"])
    loc = lab - start
    mine = (loc >= 0) & (loc < x.shape[-1])
    picked = np.take_along_axis(x, np.clip(loc, 0, max(x.shape[-1] - 1, 0)), axis=-1)
    xl = c.comm.all_reduce(np.where(mine, picked, 0.0), dims, "sum")
    return e / s, _ml_loss(xl - m - np.log(s), lab, _f(a["smooth_weight"]), ig, summed)


def ml_grad(softmax: Any, label: Any, w: Any, loss_grad: Any, ig: int, class_start: int = 0) -> np.ndarray:
    sm = _f(softmax)
    lab = _i(label)
    coef = np.where(lab == ig, 0.0, _f(loss_grad) * _f(w))  # loss_grad [..., 1] broadcasts over the labels
    classes = np.arange(class_start, class_start + sm.shape[-1])
    onehot = (lab[..., :, None] == classes).astype(np.float64)  # [..., L, C]
    return np.asarray(sm * coef.sum(axis=-1, keepdims=True) - (coef[..., :, None] * onehot).sum(axis=-2))


def _ml_grad(a: Arrays, c: Ctx) -> tuple[Any, ...]:
    return (ml_grad(a["softmax"], a["label"], a["smooth_weight"], a["loss_grad"], int(a.get("ignore_index", -100)),
                    int(a.get("_class_start", 0))),)


def _localize_ml_grad(a: Arrays, c: Ctx) -> Arrays:
    out = dict(a)
    out["_class_start"] = class_start(c, "softmax")
    return out


def _prep_ml_label(a: Arrays, classes: int) -> None:
    raw = _i(a["label"])
    lab = np.abs(raw) % max(classes, 1)
    a["label"] = np.where(raw % 5 == 0, int(a.get("ignore_index", -100)), lab)


def _prep_ml(a: Arrays) -> None:
    _prep_ml_label(a, int(np.shape(a["x"])[-1]))


def _prep_ml_grad(a: Arrays) -> None:
    sm = _f(a["softmax"])
    if sm.size:
        a["softmax"] = np.exp(log_softmax(sm, -1))
    _prep_ml_label(a, int(sm.shape[-1]))


register_reference(Reference("c_softmax_with_multi_label_cross_entropy", _ml, ("x", "label", "smooth_weight"),
                             ("softmax", "loss"), "c_softmax_multi_label",
                             domains={"label": "int", "smooth_weight": "pos"}, prepare=_prep_ml))
register_reference(Reference("c_softmax_with_multi_label_cross_entropy_grad", _ml_grad,
                             ("softmax", "label", "smooth_weight", "loss_grad"), ("x_grad",),
                             "c_softmax_multi_label_grad", domains={"label": "int", "smooth_weight": "pos"},
                             prepare=_prep_ml_grad, localize=_localize_ml_grad))


def _ml_shapes(r: random.Random, m: list[int]) -> tuple[tuple[int, ...], tuple[int, ...], bool]:
    s = rand_shape(r, m, 1, 4)
    n_labels = r.choice((1, 2, 3, 4, rand_size(r, m)))
    return s, (*s[:-1], n_labels), r.random() < 0.6


def _ml_attrs(r: random.Random, summed: bool) -> dict[str, Any]:
    nranks = r.choice((1, 2, 4))
    return {"ignore_index": r.choice((-100, -100, -1, 0)), "sum_multi_label_loss": summed,
            "rank": r.randrange(nranks), "nranks": nranks}


def _g_ml(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s, lab, summed = _ml_shapes(r, m)
    return {"x": TGen(s), "label": TGen(lab, "int"), "smooth_weight": TGen(lab, "pos"), **_ml_attrs(r, summed)}


def _g_ml_grad(r: random.Random, m: list[int], ref: Reference) -> dict[str, Any]:
    s, lab, summed = _ml_shapes(r, m)
    loss = (*s[:-1], 1) if summed else lab
    return {"softmax": TGen(s), "label": TGen(lab, "int"), "smooth_weight": TGen(lab, "pos"),
            "loss_grad": TGen(loss, "real"), **_ml_attrs(r, summed)}


GENERATORS.update({
    "c_softmax_multi_label": _g_ml,
    "c_softmax_multi_label_grad": _g_ml_grad,
})


# -- label_smooth -------------------------------------------------------------------------------


def label_smooth(label: Any, prior: Any, eps: float) -> np.ndarray:
    lab = _f(label)
    if prior is None:
        return np.asarray((1 - eps) * lab + eps / lab.shape[-1])
    return np.asarray((1 - eps) * lab + eps * _f(prior))


register_reference(Reference("label_smooth",
                             lambda a, c: (label_smooth(a["label"], a.get("prior_dist"), float(a.get("epsilon", 0.0))),),
                             ("label",), ("out",), "label_smooth", optional=("prior_dist",)))
register_reference(Reference("label_smooth_grad",
                             lambda a, c: ((1 - float(a.get("epsilon", 0.0))) * _f(a["out_grad"]),),
                             ("out_grad",), ("label_grad",), "label_smooth_grad"))


def _g_label(r: random.Random, m: list[int], ref: Any) -> dict[str, Any]:
    s = rand_shape(r, m, 1, 4)
    u = r.random()
    if u < 0.35:
        prior: TGen | None = None
    elif u < 0.6:
        prior = TGen((s[-1],), "prob")
    elif u < 0.8 and len(s) >= 2:
        prior = TGen((1, s[-1]), "prob")
    else:
        k = r.randint(1, len(s))
        prior = TGen(tuple(1 if r.random() < 0.4 else v for v in s[-k:]), "prob")
    return {"label": TGen(s, "prob"), "prior_dist": prior, "epsilon": r.choice((0.0, 0.1, 0.25))}


def _g_label_grad(r: random.Random, m: list[int], ref: Any) -> dict[str, Any]:
    return {"out_grad": TGen(rand_shape(r, m, 1, 4), "real"), "epsilon": r.choice((0.0, 0.1, 0.25))}


GENERATORS.update({
    "label_smooth": _g_label,
    "label_smooth_grad": _g_label_grad,
})
