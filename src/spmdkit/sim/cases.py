"""Seeded, reproducible generators of valid cases (INTERFACE.md JSON) per rule.

``generate_cases(rule, n, seed, mode)`` gives ``n`` case objects. Case ``i`` of a rule
and mode depends only on (seed, rule, mode, i). A family generator (keyed by the
reference's ``family``) draws shapes and attributes; the generic part draws the
mesh (1-3 dims of sizes 1-4), dims_mappings (co-sharding included) and partial
inputs, and lays the arguments out in the rule's parameter order by name.
Backward (reverse) cases get output specs too: shapes from the numpy op run on
the generated inputs, mappings drawn the same way.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from spmdkit.engine.registry import is_reverse, output_params
from spmdkit.sim.ops import REDUCE_BASE_TYPES, REDUCTIONS, Ctx, Reference, get_reference

Shape = tuple[int, ...]


@dataclass(frozen=True)
class TGen:
    """A tensor to generate: its global shape and value domain (None: the reference's)."""

    shape: Shape
    domain: str | None = None


Spec = dict[str, Any]  # param name -> TGen | list[TGen | None] | None | attribute value


# -- random pieces ----------------------------------------------------------------------------


def rand_mesh(r: random.Random) -> list[int]:
    nd = r.choice((1, 1, 2, 2, 2, 3))
    return [r.choice((1, 2, 2, 3, 4)) for _ in range(nd)]


def rand_size(r: random.Random, mesh: list[int]) -> int:
    u = r.random()
    if u < 0.45:
        s = 1
        for m in mesh:
            if r.random() < 0.5:
                s *= m
        return s * r.choice((1, 1, 2, 3))
    if u < 0.55:
        return 1
    return r.randint(1, 9)


def rand_shape(r: random.Random, mesh: list[int], lo: int = 0, hi: int = 4) -> Shape:
    nd = r.randint(lo, hi)
    if lo == 0 and nd == 0 and r.random() < 0.6:
        nd = 1
    return tuple(rand_size(r, mesh) for _ in range(nd))


_REDUCE_FLOAT = ("sum", "sum", "sum", "avg", "max", "min", "prod")


def rand_attr(r: random.Random, mesh: list[int], ndim: int, domain: str, p_partial: float = 0.2) -> dict[str, Any]:
    free = list(range(len(mesh)))
    r.shuffle(free)
    dm: list[Any] = []
    for _ in range(ndim):
        if free and r.random() < 0.5:
            if len(free) >= 2 and r.random() < 0.2:
                dm.append([free.pop(), free.pop()])
            else:
                dm.append(free.pop())
        else:
            dm.append(-1)
    out: dict[str, Any] = {"dims_mapping": dm}
    if free and r.random() < p_partial:
        k = 2 if len(free) >= 2 and r.random() < 0.2 else 1
        part = {}
        for _ in range(k):
            d = free.pop()
            if domain == "bool":
                part[str(d)] = r.choice(("any", "all", "sum"))
            else:
                part[str(d)] = r.choice(_REDUCE_FLOAT)
        out["partial"] = part
    return out


def rand_axis(r: random.Random, ndim: int) -> int:
    if ndim == 0:
        return r.choice((0, -1))
    return r.randint(-ndim, ndim - 1)


def make_array(shape: Shape, domain: str, rng: np.random.Generator) -> np.ndarray:
    """Values in an op's valid domain."""
    if domain == "pos":
        return rng.uniform(0.5, 2.0, size=shape)
    if domain == "unit":
        return rng.uniform(-0.9, 0.9, size=shape)
    if domain == "gt1":
        return rng.uniform(1.1, 3.0, size=shape)
    if domain == "prob":
        return rng.uniform(0.05, 0.95, size=shape)
    if domain == "nonzero":
        return rng.uniform(0.5, 2.0, size=shape) * np.where(rng.random(shape) < 0.5, -1.0, 1.0)
    if domain == "int":
        return rng.integers(-8, 9, size=shape).astype(np.int64)
    if domain == "nzint":
        return (rng.integers(1, 9, size=shape) * np.where(rng.random(shape) < 0.5, -1, 1)).astype(np.int64)
    if domain == "bool":
        return rng.random(shape) < 0.5
    return rng.standard_normal(shape)


# -- family generators: (rng, mesh, reference, rule param kinds) -> Spec ------------------------

Gen = Callable[[random.Random, list[int], Reference], Spec]


def _g_unary(r: random.Random, m: list[int], ref: Reference) -> Spec:
    return {"x": TGen(rand_shape(r, m)), "approximate": r.random() < 0.5}


def _g_cast(r: random.Random, m: list[int], ref: Reference) -> Spec:
    return {"x": TGen(rand_shape(r, m)), "dtype": r.choice(("float32", "float64", "float16", "int32", "int64", "bool"))}


def _g_unary_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m)
    return {"x": TGen(s), "out": TGen(s), "out_grad": TGen(s, "real"), "approximate": r.random() < 0.5,
            "y": r.choice((2.0, 3.0, 0.5, 1.0))}


def _g_dropout_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m)
    return {"mask": TGen(s, "bool"), "out_grad": TGen(s, "real"), "p": r.choice((0.0, 0.1, 0.5)),
            "is_test": r.random() < 0.2, "mode": r.choice(("upscale_in_train", "downscale_in_infer"))}


def _broadcast_pair(r: random.Random, m: list[int]) -> tuple[Shape, Shape]:
    x = list(rand_shape(r, m))
    y = list(x)
    for i in range(len(y)):
        u = r.random()
        if u < 0.15:
            y[i] = 1
        elif u < 0.25:
            x[i] = 1
    cut = r.randint(0, len(y)) if r.random() < 0.3 else 0
    y = y[cut:]
    if r.random() < 0.5:
        return tuple(x), tuple(y)
    return tuple(y), tuple(x)


def _g_binary(r: random.Random, m: list[int], ref: Reference) -> Spec:
    x, y = _broadcast_pair(r, m)
    return {"x": TGen(x), "y": TGen(y)}


def _g_binary_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    x, y = _broadcast_pair(r, m)
    o = np.broadcast_shapes(x, y)
    return {"x": TGen(x), "y": TGen(y), "out": TGen(o, "real"), "out_grad": TGen(o, "real"), "axis": -1}


def _g_softmax(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 1, 4)
    return {"x": TGen(s), "axis": rand_axis(r, len(s))}


def _g_softmax_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 1, 4)
    return {"out": TGen(s), "out_grad": TGen(s), "axis": rand_axis(r, len(s))}



def _bna(r: random.Random, nd: int) -> int:
    if nd <= 1 or r.random() < 0.15:
        return r.randint(0, nd)
    return r.randint(1, nd - 1)


def _g_layer_norm(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 1, 4)
    b = _bna(r, len(s))
    tail = (math.prod(s[b:]),)
    return {
        "x": TGen(s),
        "scale": TGen(tail) if r.random() < 0.8 else None,
        "bias": TGen(tail) if r.random() < 0.8 else None,
        "epsilon": 1e-5,
        "begin_norm_axis": b,
    }


def _g_layer_norm_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    sp = _g_layer_norm(r, m, ref)
    s = sp["x"].shape
    bs = s[: sp["begin_norm_axis"]]
    sp.update({"mean": TGen(bs), "variance": TGen(bs, "pos"), "out_grad": TGen(s, "real")})
    return sp


def _g_rms_norm(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 1, 4)
    return {"x": TGen(s), "scale": TGen(s[-1:]) if r.random() < 0.9 else None, "epsilon": 1e-6}


def _g_rms_norm_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    sp = _g_rms_norm(r, m, ref)
    s = sp["x"].shape
    sp.update({"invvar": TGen(s[:-1], "pos"), "out_grad": TGen(s, "real")})
    return sp


def _matmul_shapes(r: random.Random, m: list[int]) -> tuple[Shape, Shape, bool, bool]:
    mm, k, n = rand_size(r, m), rand_size(r, m), rand_size(r, m)
    tx, ty = r.random() < 0.3, r.random() < 0.3
    x1, y1 = r.random() < 0.12, r.random() < 0.12
    tx, ty = tx and not x1, ty and not y1  # Paddle's rule rejects trans on a 1-D operand
    x: tuple[int, ...] = (k,) if x1 else ((k, mm) if tx else (mm, k))
    y: tuple[int, ...] = (k,) if y1 else ((n, k) if ty else (k, n))
    nb = r.choice((0, 0, 1, 1, 2))
    batch = [rand_size(r, m) for _ in range(nb)]
    bx, by = list(batch), list(batch)
    for i in range(nb):
        u = r.random()
        if u < 0.15:
            bx[i] = 1
        elif u < 0.3:
            by[i] = 1
    if r.random() < 0.3:
        bx = bx[r.randint(0, nb):]
    elif r.random() < 0.3:
        by = by[r.randint(0, nb):]
    if not x1:
        x = (*bx, *x)
    if not y1:
        y = (*by, *y)
    return x, y, tx, ty


def _g_matmul(r: random.Random, m: list[int], ref: Reference) -> Spec:
    x, y, tx, ty = _matmul_shapes(r, m)
    return {"x": TGen(x), "y": TGen(y), "trans_x": tx, "trans_y": ty}


def _g_matmul_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    sp = _g_matmul(r, m, ref)
    xa = np.zeros(sp["x"].shape)
    ya = np.zeros(sp["y"].shape)
    (o,) = ref_global(get_reference("matmul"), {"x": xa, "y": ya, "trans_x": sp["trans_x"], "trans_y": sp["trans_y"]})
    sp["out_grad"] = TGen(np.shape(o), "real")
    return sp


def _rand_axes(r: random.Random, nd: int) -> list[int]:
    if nd == 0 or r.random() < 0.12:
        return []
    k = r.randint(1, nd)
    ax = r.sample(range(nd), k)
    return [a - nd if r.random() < 0.3 else a for a in ax]


def _g_reduction(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 0, 4)
    return {"x": TGen(s), "axis": _rand_axes(r, len(s)), "keep_dim": r.random() < 0.4}


def _g_reduce_base(r: random.Random, m: list[int], ref: Reference) -> Spec:
    sp = _g_reduction(r, m, ref)
    rt = r.choice(sorted(REDUCE_BASE_TYPES))
    sp["reduce_type"] = rt
    sp["x"] = TGen(sp["x"].shape, REDUCTIONS[REDUCE_BASE_TYPES[rt]][1])
    return sp


def _g_reduction_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    sp = _g_reduction(r, m, ref)
    s = sp["x"].shape
    op = ref.meta.get("op", "sum")
    sp["x"] = TGen(s, REDUCTIONS[op][1])
    (o,) = ref_global(get_reference(op), {"x": np.ones(s), "axis": sp["axis"], "keep_dim": sp["keep_dim"]})
    sp.update({"out": TGen(np.shape(o), "real"), "out_grad": TGen(np.shape(o), "real"), "reduce_all": False})
    return sp


def _rand_perm(r: random.Random, nd: int) -> list[int]:
    p = list(range(nd))
    r.shuffle(p)
    return [v - nd if r.random() < 0.25 else v for v in p]


def _g_transpose(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 1, 4)
    return {"x": TGen(s), "perm": _rand_perm(r, len(s))}


def _g_transpose_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 1, 4)
    return {"out_grad": TGen(s), "perm": _rand_perm(r, len(s))}


def _g_default_dp(r: random.Random, m: list[int], ref: Reference) -> Spec:
    b = rand_size(r, m)
    ins = [TGen((b, *rand_shape(r, m, 0, 2))) for _ in range(r.randint(1, 3))]
    outs = [TGen((b, *rand_shape(r, m, 0, 2))) for _ in range(r.randint(1, 2))]
    return {"ins": ins, "outs": outs}


def _g_replicated(r: random.Random, m: list[int], ref: Reference) -> Spec:
    ins = [TGen(rand_shape(r, m, 1, 3)) for _ in range(r.randint(1, 3))]
    outs = [TGen(rand_shape(r, m, 1, 3)) for _ in range(r.randint(1, 2))]
    return {"ins": ins, "outs": outs}


def _g_reshape(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 1, 4)
    sizes: list[int] = []
    for v in s:  # split some axes into factors, then merge some neighbours
        f = [d for d in (2, 3, 4) if v % d == 0 and v > d]
        if f and r.random() < 0.3:
            d = r.choice(f)
            sizes += [d, v // d]
        else:
            sizes.append(v)
    out: list[int] = []
    for v in sizes:
        if out and r.random() < 0.35:
            out[-1] *= v
        else:
            out.append(v)
    if r.random() < 0.1:
        out.append(1)
    tgt: list[int] = list(out)
    if tgt and r.random() < 0.3:
        tgt[r.randrange(len(tgt))] = -1
    for i in range(min(len(tgt), len(s))):
        if tgt[i] == s[i] and r.random() < 0.3:
            tgt[i] = 0
    return {"x": TGen(s), "shape": tgt}


def _g_flatten(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 1, 4)
    nd = len(s)
    a = r.randrange(nd)
    b = r.randrange(a, nd)
    return {"x": TGen(s), "start_axis": a - nd if r.random() < 0.2 else a,
            "stop_axis": b - nd if r.random() < 0.3 else b}


def _g_squeeze(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = list(rand_shape(r, m, 1, 4))
    for _ in range(r.randint(0, 2)):
        s.insert(r.randint(0, len(s)), 1)
    nd = len(s)
    ax = [] if r.random() < 0.25 else r.sample(range(nd), r.randint(1, nd))
    return {"x": TGen(tuple(s)), "axis": [a - nd if r.random() < 0.25 else a for a in ax]}


def _g_unsqueeze(r: random.Random, m: list[int], ref: Reference) -> Spec:
    s = rand_shape(r, m, 0, 3)
    rank = len(s)
    ax: list[int] = []
    for _ in range(r.randint(1, 3)):
        a = r.randint(0, rank)
        ax.append(a - rank - 1 if r.random() < 0.3 else a)
        rank += 1
    return {"x": TGen(s), "axis": ax}


def _g_view_grad(r: random.Random, m: list[int], ref: Reference) -> Spec:
    from spmdkit.engine import dim_trans as dt
    from spmdkit.sim.ops import resolve_shape

    holder = ref.meta["holder"]
    op = ref.name[: -len("_grad")]
    if op == "reshape":
        sp = _g_reshape(r, m, ref)
        s = sp["x"].shape
        o = resolve_shape(sp["shape"], s)
        return {holder: TGen(s), "out_grad": TGen(o)}
    if op == "flatten":
        sp = _g_flatten(r, m, ref)
        s = sp["x"].shape
        o = dt.flatten_trans.raw(s, sp["start_axis"], sp["stop_axis"])[1]  # type: ignore[attr-defined]
        return {holder: TGen(s), "out_grad": TGen(o)}
    sp = _g_squeeze(r, m, ref) if op == "squeeze" else _g_unsqueeze(r, m, ref)
    s = sp["x"].shape
    fn = dt.squeeze_trans if op == "squeeze" else dt.unsqueeze_trans
    o = fn.raw(s, tuple(sp["axis"]))[1]  # type: ignore[attr-defined]
    return {holder: TGen(s), "out_grad": TGen(o), "axis": sp["axis"]}


GENERATORS: dict[str, Gen] = {
    "reshape": _g_reshape,
    "flatten": _g_flatten,
    "squeeze": _g_squeeze,
    "unsqueeze": _g_unsqueeze,
    "view_grad": _g_view_grad,
    "unary": _g_unary,
    "cast": _g_cast,
    "unary_grad": _g_unary_grad,
    "dropout_grad": _g_dropout_grad,
    "binary": _g_binary,
    "binary_grad": _g_binary_grad,
    "softmax": _g_softmax,
    "softmax_grad": _g_softmax_grad,
    "layer_norm": _g_layer_norm,
    "layer_norm_grad": _g_layer_norm_grad,
    "rms_norm": _g_rms_norm,
    "rms_norm_grad": _g_rms_norm_grad,
    "matmul": _g_matmul,
    "matmul_grad": _g_matmul_grad,
    "reduction": _g_reduction,
    "reduce_base": _g_reduce_base,
    "reduction_grad": _g_reduction_grad,
    "transpose": _g_transpose,
    "transpose_grad": _g_transpose_grad,
    "default_dp": _g_default_dp,
    "replicated": _g_replicated,
}


def _shape_of(v: Any) -> Any:
    if isinstance(v, list):
        return [None if t is None else tuple(np.shape(t)) for t in v]
    if isinstance(v, np.ndarray):
        return tuple(v.shape)
    return None


def ref_global(ref: Reference | None, args: dict[str, Any]) -> tuple[Any, ...]:
    """Run a reference on global arrays (no mesh needed for shapes)."""
    assert ref is not None
    from spmdkit.core.mesh import ProcessMesh

    shapes = {k: _shape_of(v) for k, v in args.items()}
    with np.errstate(all="ignore"):
        return ref.run(args, Ctx(ProcessMesh([1]), shapes=shapes))


# -- laying out a case ------------------------------------------------------------------------


def _tensor_json(t: TGen, r: random.Random, mesh: list[int], ref: Reference, name: str) -> dict[str, Any]:
    dom = t.domain or ref.domain(name)
    return {"shape": list(t.shape), **rand_attr(r, mesh, len(t.shape), dom)}


def mode_reference(rule: Any, mode: str) -> tuple[Reference | None, bool]:
    """(reference, is_reverse) for a rule and mode: a grad-style backward uses ``<name>_grad``."""
    if mode == "backward" and not is_reverse(rule):
        for n in (rule.name, *rule.aliases):
            ref = get_reference(f"{n}_grad")
            if ref is not None:
                return ref, False
        return None, False
    return get_reference(rule.name), mode == "backward"


def _layout(params: Any, values: dict[str, Any]) -> list[Any] | None:
    args: list[Any] = []
    last = -1
    for i, p in enumerate(params):
        if p.name in values:
            last = i
    for p in params[: last + 1]:
        if p.name in values:
            args.append(values[p.name])
        elif p.required:
            return None
        else:
            d = p.default
            args.append(list(d) if isinstance(d, tuple) else d)
    for p in params[last + 1:]:
        if p.required:
            return None
    return args


def generate_case(rule_name: str, mode: str, seed: int, index: int) -> dict[str, Any] | None:
    """Case ``index`` of a rule and mode (None when no generator covers the rule's parameters)."""
    from spmdkit.engine.registry import get_rule

    rule = get_rule(rule_name)
    ref, reverse = mode_reference(rule, mode)
    if ref is None or ref.family not in GENERATORS:
        return None
    r = random.Random(f"{seed}:{rule_name}:{mode}:{index}")
    mesh = rand_mesh(r)
    spec = GENERATORS[ref.family](r, mesh, ref)
    values: dict[str, Any] = {}
    for k, v in spec.items():
        if isinstance(v, TGen):
            values[k] = _tensor_json(v, r, mesh, ref, k)
        elif isinstance(v, list) and v and all(isinstance(t, TGen) for t in v):
            values[k] = [_tensor_json(t, r, mesh, ref, k) for t in v]
        else:
            values[k] = v
    m = rule.mode(mode)
    if reverse:
        # shapes of the outputs from the op itself
        nprng = np.random.default_rng(index)
        arrs: dict[str, Any] = {}
        for k, v in spec.items():
            if isinstance(v, TGen):
                arrs[k] = make_array(v.shape, v.domain or ref.domain(k), nprng)
            elif isinstance(v, list) and v and all(isinstance(t, TGen) for t in v):
                arrs[k] = [make_array(t.shape, t.domain or ref.domain(k), nprng) for t in v]
            else:
                arrs[k] = v
        if ref.spec_params:
            pass  # the outs specs are already in the spec
        else:
            try:
                outs = ref_global(ref, arrs)
            except Exception:
                return None
            names = output_params(rule)
            kinds = {p.name: p.kind for p in m.params}
            real: list[Any] = list(outs)
            if len(names) == 1 and kinds.get(names[0], "").startswith("[") and len(real) != 1:
                real = [real]  # one vector output (split, unbind): the reference's outputs are its items
            for nm, o in zip(names, real):
                if o is None:
                    values[nm] = None
                elif isinstance(o, list):
                    values[nm] = [{"shape": list(np.shape(x)), **rand_attr(r, mesh, np.ndim(x), "real")} for x in o]
                else:
                    values[nm] = {"shape": list(np.shape(o)), **rand_attr(r, mesh, np.ndim(o), "real")}
    args = _layout(m.params, values)
    if args is None:
        return None
    return {"id": f"{rule_name}/{mode}/{seed}/{index}", "rule": rule_name, "mesh": mesh, "mode": mode, "args": args}


def generate_cases(rule_name: str, n: int, seed: int = 0, mode: str = "forward") -> list[dict[str, Any]]:
    """``n`` reproducible cases (fewer when the rule has no generator)."""
    out = []
    for i in range(n):
        c = generate_case(rule_name, mode, seed, i)
        if c is None:
            break
        out.append(c)
    return out


__all__ = ["GENERATORS", "TGen", "generate_case", "generate_cases", "make_array", "mode_reference", "output_params", "rand_attr",
           "rand_mesh"]
