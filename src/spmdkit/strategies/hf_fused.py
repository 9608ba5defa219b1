"""Fused projections of an imported program split into one projection per part, so that each
part can be column-parallel on its own (:mod:`spmdkit.strategies.hf`).

A fused projection computes several projections with one weight: GPT-2's ``c_attn`` (q, k, v
as ``[in, 3 * hidden]``, Conv1D ``x @ W``), GPTBigCode's multi-query ``c_attn`` (``[hidden +
2 * head_dim, in]``: q, then one k and one v head), Falcon's ``query_key_value`` (FalconLinear
``x @ W.T``, viewed as ``[..., heads + 2, head_dim]`` and split on the heads axis), MPT's
``Wqkv`` and Phi-3's ``gate_up_proj`` (``chunk``). Sharding such a weight's output axis in
contiguous blocks would cut across its parts (rank 0 would hold all of q, rank 1 k and v).
Found here: a matmul on a 2-D parameter (or its transpose), then optionally a bias add, then
views (``reshape`` / ``unsqueeze``) keeping the features last or splitting them into ``[...,
groups, d]``, then one ``split`` on the features (or the groups) axis into contiguous parts of
any sizes. :func:`split_fused_projections` rewrites it as one projection per part on
``slice`` s of the weight and bias (the parameters stay the module's) and its backward
likewise: each part's gradient through its own projection, the input gradients summed
(``add_n``), the weight and bias gradients the ``concat`` of the parts'. The same values.

Head-interleaved fused weights (GPT-NeoX's and BLOOM's ``query_key_value``: ``[heads, 3,
head_dim]`` rows, split after a view to ``[..., heads, 3 * head_dim]``) need no split: a
contiguous block of rows is whole heads with their q, k and v, as Megatron lays them out.

Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from spmdkit.program.ir import Op, Program, Tensor


def namer(names: set[str]) -> Callable[[str], str]:
    """``fresh(base)``: ``base``, or ``base1``, ``base2``, ... the first not in ``names`` (which
    it joins)."""

    def fresh(base: str) -> str:
        n, k = base, 1
        while n in names:
            n, k = f"{base}{k}", k + 1
        names.add(n)
        return n

    return fresh


def rebuild(prog: Program, tensors: list[Any], ops: list[tuple[int | None, Op]]) -> Program:
    """A copy of ``prog`` (of its class, its other fields kept) with ``tensors`` and ``ops``
    (each with the index it had, None for a new one); an imported program's per-op maps
    (``modules``, ``origins``, ``fallbacks``) follow the ops to their new indices."""
    new = prog.__class__.__new__(prog.__class__)
    new.__dict__.update(prog.__dict__)
    Program.__init__(new, tensors, [op for _, op in ops], prog.name)
    where = {old: i for i, (old, _) in enumerate(ops) if old is not None}
    for field in ("modules", "origins", "fallbacks"):
        m = getattr(prog, field, None)
        if isinstance(m, dict):
            setattr(new, field, {where[k]: v for k, v in m.items() if k in where})
    return new


@dataclass(frozen=True)
class Fused:
    """A fused projection found in a program (op indices and tensor names): ``w`` (or its
    transpose, op ``tr``) read by matmul ``mm`` on ``x``, then the ``chain`` ops (a bias add,
    views) to the ``split`` op making ``parts``, ``feats`` features each; its backward: the
    ``split_grad``, the chain's grad ops (``chain_grads``, in forward order), ``matmul_grad``
    and the transpose's grad (``tr_grad``)."""

    mm: int
    tr: int | None
    chain: tuple[int, ...]
    split: int
    split_grad: int
    chain_grads: tuple[int, ...]
    matmul_grad: int
    tr_grad: int | None
    x: str
    w: str
    b: str | None
    parts: tuple[str, ...]
    feats: tuple[int, ...]
    out_ax: int


def _readers(ops: list[Op]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, op in enumerate(ops):
        for n in op.input_names():
            out.setdefault(n, []).append(i)
    return out


def find_fused(prog: Program, ops: list[Op], i: int, ws: set[str], readers: dict[str, list[int]],
               producer: dict[str, int]) -> Fused | None:
    """The fused projection whose matmul is op ``i`` on one of ``ws``, if it is one."""
    T = prog.tensors

    def only(name: str, phase: str) -> int | None:
        rs = [j for j in readers.get(name, []) if ops[j].phase == phase]
        return rs[0] if len(rs) == 1 else None

    op = ops[i]
    y = op.inputs.get("y")
    if op.phase != "forward" or op.rule != "matmul" or not isinstance(y, str) or len(T[y].shape) != 2:
        return None
    tr = None
    w = y
    if T[y].kind != "parameter":
        tr = producer.get(y)
        if tr is None or ops[tr].rule != "transpose" or tuple(ops[tr].attrs.get("perm", ())) != (1, 0):
            return None
        w = ops[tr].inputs["x"]
        if only(y, "forward") != i:
            return None
    if w not in ws or T[w].kind != "parameter":
        return None
    x, mm = op.inputs["x"], op.output_names()[0]
    F = T[mm].shape[-1]
    y_out = 0 if bool(op.attrs.get("trans_y", False)) else 1
    out_ax = 1 - y_out if tr is not None else y_out
    chain: list[int] = []
    b = None
    cur = mm
    for _ in range(4):  # the bias add and views before the split
        j = only(cur, "forward")
        if j is None:
            return None
        o = ops[j]
        if o.rule == "split":
            break
        if o.rule == "add" and b is None:
            other = o.inputs.get("y")  # the importer's linear: x @ W + b
            if o.inputs.get("x") != cur or not isinstance(other, str) or T[other].kind != "parameter" \
                    or T[other].shape != (F,):
                return None
            b = other
        elif o.rule not in ("reshape", "unsqueeze") or not o.output_names():
            return None
        chain.append(j)
        cur = o.output_names()[0]
    else:
        return None
    for j in chain[:-1]:  # every view but the last keeps the features last
        if T[ops[j].output_names()[0]].shape[-1] != F:
            return None
    if chain and ops[chain[-1]].rule == "add" and T[cur].shape[-1] != F:
        return None
    isp = only(cur, "forward")
    assert isp is not None
    sp = ops[isp]
    parts = list(sp.outputs[0]) if isinstance(sp.outputs[0], (list, tuple)) else []
    shp = T[cur].shape
    nd = len(shp)
    ax = int(sp.attrs.get("axis", -1)) % nd
    secs = tuple(int(s) for s in sp.attrs.get("sections", ()))
    if len(parts) < 2 or None in parts or len(secs) != len(parts) or sum(secs) != shp[ax]:
        return None
    if ax == nd - 1 and shp[-1] == F:
        feats = secs
    elif ax == nd - 2 and shp[-2] * shp[-1] == F:
        feats = tuple(s * shp[-1] for s in secs)
    else:
        return None
    # the backward mirrors it: split_grad, the chain's grads in reverse, matmul_grad
    isg = next((j for j, o in enumerate(ops) if o.phase == "backward" and o.rule == "split_grad"
                and o.inputs.get("out_grad") == tuple(p + ".grad" for p in parts)), None)
    if isg is None:
        isg = next((j for j, o in enumerate(ops) if o.phase == "backward" and o.rule == "split_grad"
                    and isinstance(o.inputs.get("out_grad"), tuple)
                    and all(g.startswith(p + ".grad") for p, g in zip(parts, o.inputs["out_grad"]))
                    and len(o.inputs["out_grad"]) == len(parts)), None)
    if isg is None:
        return None
    g = ops[isg].output_names()[0]
    grads: list[int] = []
    for j in reversed(chain):
        k = only(g, "backward")
        if k is None or ops[k].rule != ops[j].rule + "_grad":
            return None
        grads.append(k)
        g = ops[k].outputs[0]
        if not isinstance(g, str):
            return None
    img = only(g, "backward")
    if img is None or ops[img].rule != "matmul_grad" or ops[img].inputs.get("y") != y \
            or ops[img].inputs.get("x") != x:
        return None
    trg = None
    if tr is not None:
        yg = ops[img].outputs[1]
        trg = only(yg, "backward") if isinstance(yg, str) else None
        if trg is None or ops[trg].rule != "transpose_grad":
            return None
    return Fused(i, tr, tuple(chain), isp, isg, tuple(reversed(grads)), img, trg, x, w, b, tuple(parts),
                 feats, out_ax)


def _part_shape(shape: tuple[int, ...], F: int, f: int) -> tuple[int, ...]:
    return (*shape[:-1], f) if shape and shape[-1] == F else shape


def _part(prog: Program, ops: list[Op], f: Fused, j: int, lo: int, fj: int, tensors: list[Any],
          fresh: Callable[[str], str], fwd: list[Op], bwd: list[Op]) -> tuple[str, str, str | None]:
    """Part ``j`` (features ``lo`` to ``lo + fj``) of ``f``: its forward ops appended to ``fwd``,
    its backward ones to ``bwd``; returns its input, weight and bias gradients."""
    T = prog.tensors
    mm_op = ops[f.mm]
    mm = mm_op.output_names()[0]
    F = T[mm].shape[-1]
    fwd_kw = {"layer": mm_op.layer, "phase": "forward"}
    bwd_kw = {"layer": ops[f.split_grad].layer, "phase": "backward"}
    ren: dict[str, str] = {}  # forward tensor -> the part's

    def new(name: str, base: str, shape: tuple[int, ...], like: str, kind: str = "activation") -> str:
        n = fresh(base)
        tensors.append(Tensor(n, shape, T[like].dtype, kind))
        ren[name] = n
        return n

    wshape = tuple(fj if a == f.out_ax else s for a, s in enumerate(T[f.w].shape))
    wj = new(f.w, f"{f.w}.part{j}", wshape, f.w)
    fwd.append(Op("slice", {"input": f.w}, (wj,), {"axes": (f.out_ax,), "starts": (lo,), "ends": (lo + fj,)},
                  name=wj, **fwd_kw))
    yj = wj
    if f.tr is not None:
        y = mm_op.inputs["y"]
        yj = new(y, f"{y}.part{j}", wshape[::-1], y)
        fwd.append(Op("transpose", {"x": wj}, (yj,), dict(ops[f.tr].attrs), name=yj, **fwd_kw))
    if f.b is not None:
        bj = new(f.b, f"{f.b}.part{j}", (fj,), f.b)
        fwd.append(Op("slice", {"input": f.b}, (bj,), {"axes": (0,), "starts": (lo,), "ends": (lo + fj,)},
                      name=bj, **fwd_kw))
    outs = [mm, *(ops[k].output_names()[0] for k in f.chain)]
    for n in outs[:-1]:
        new(n, f"{n}.part{j}", _part_shape(T[n].shape, F, fj), n)
    ren[outs[-1]] = f.parts[j]  # the last makes the part itself
    fwd.append(Op("matmul", {"x": f.x, "y": yj}, (ren[mm],), dict(mm_op.attrs), name=ren[mm], **fwd_kw))
    for k in f.chain:
        o = ops[k]
        out = ren[o.output_names()[0]]
        attrs = dict(o.attrs)
        if o.rule == "reshape":
            attrs["shape"] = T[out].shape if out in T else _part_shape(tuple(attrs["shape"]), F, fj)
        fwd.append(Op(o.rule, {p: ren.get(v, v) if isinstance(v, str) else v for p, v in o.inputs.items()},
                      (out,), attrs, name=out, **fwd_kw))
    # the backward, in reverse: the chain's grads, then the matmul's (and the transpose's)
    gren = {ops[f.split_grad].output_names()[0]: ops[f.split_grad].inputs["out_grad"][j]}

    def mapped(o: Op) -> dict[str, Any]:
        return {p: gren.get(v, ren.get(v, v)) if isinstance(v, str) else v for p, v in o.inputs.items()}

    for k in reversed(f.chain_grads):
        o = ops[k]
        gouts: list[Any] = []
        for v in o.outputs:
            if isinstance(v, str):
                gren[v] = fresh(f"{v}.part{j}")
                tensors.append(Tensor(gren[v], _part_shape(T[v].shape, F, fj), T[v].dtype, "gradient"))
            gouts.append(gren.get(v, v) if isinstance(v, str) else v)
        bwd.append(Op(o.rule, mapped(o), tuple(gouts), dict(o.attrs), name=gouts[0], **bwd_kw))
    mg = ops[f.matmul_grad]
    xg, yg = mg.outputs[0], mg.outputs[1]
    assert isinstance(xg, str) and isinstance(yg, str)
    xjg, yjg = fresh(f"{xg}.part{j}"), fresh(f"{yg}.part{j}")
    tensors += [Tensor(xjg, T[xg].shape, T[xg].dtype, "gradient"),
                Tensor(yjg, wshape[::-1] if f.tr is not None else wshape, T[yg].dtype, "gradient")]
    bwd.append(Op("matmul_grad", mapped(mg), (xjg, yjg), dict(mg.attrs), name=xjg, **bwd_kw))
    wjg = yjg
    if f.tr_grad is not None:
        wjg = fresh(f"{f.w}.grad.part{j}")
        tensors.append(Tensor(wjg, wshape, T[yg].dtype, "gradient"))
        bwd.append(Op("transpose_grad", {"out_grad": yjg}, (wjg,), dict(ops[f.tr_grad].attrs), name=wjg, **bwd_kw))
    bg = _bias_grad(ops, f)
    return xjg, wjg, (gren[bg] if bg is not None else None)


def _bias_grad(ops: list[Op], f: Fused) -> str | None:
    """The bias's gradient: the second output of the chain's ``add_grad``."""
    if f.b is None:
        return None
    add = next(k for k in f.chain_grads if ops[k].rule == "add_grad")
    bg = ops[add].outputs[1]
    assert isinstance(bg, str)
    return bg


def _split(prog: Program, ops: list[Op], f: Fused, tensors: list[Any],
           fresh: Callable[[str], str]) -> tuple[list[Op], list[Op]]:
    """The forward and backward ops of ``f`` split into one projection per part (the new
    tensors appended to ``tensors``)."""
    fwd: list[Op] = []
    bwd: list[Op] = []
    xgs, wgs, bgs = [], [], []
    lo = 0
    for j, fj in enumerate(f.feats):
        xjg, wjg, bjg = _part(prog, ops, f, j, lo, fj, tensors, fresh, fwd, bwd)
        lo += fj
        xgs.append(xjg)
        wgs.append(wjg)
        if bjg is not None:
            bgs.append(bjg)
    mg = ops[f.matmul_grad]
    xg = mg.outputs[0]
    wg = ops[f.tr_grad].outputs[0] if f.tr_grad is not None else mg.outputs[1]
    assert isinstance(xg, str) and isinstance(wg, str)
    bwd_kw = {"layer": ops[f.split_grad].layer, "phase": "backward"}
    bwd += [Op("add_n", {"input": tuple(xgs)}, (xg,), {}, name=xg, **bwd_kw),
            Op("concat", {"x": tuple(wgs)}, (wg,), {"axis": f.out_ax}, name=wg, **bwd_kw)]
    bg = _bias_grad(ops, f)
    if bg is not None:
        bwd.append(Op("concat", {"x": tuple(bgs)}, (bg,), {"axis": 0}, name=bg, **bwd_kw))
    return fwd, bwd


def split_fused_projections(prog: Program, weights: Iterable[str]) -> Program:
    """A copy of ``prog`` where each fused projection (module docstring) on one of
    ``weights`` is one projection per part on slices of its weight and bias, forward and
    backward: the same values, each part column-parallel (head-wise) on its own. ``prog``
    itself when no projection matches."""
    ws = set(weights)
    ops = list(prog.ops)
    readers = _readers(ops)
    producer = {o: i for i, op in enumerate(ops) if op.phase == "forward" for o in op.output_names()}
    tensors = list(prog.tensors.values())
    names = set(prog.tensors)
    replace_at: dict[int, list[Op]] = {}
    drop: set[int] = set()
    gone_out: set[str] = set()  # what the replaced ops made
    fresh = namer(names)
    for i in range(len(ops)):
        f = find_fused(prog, ops, i, ws, readers, producer)
        if f is None:
            continue
        fwd, bwd = _split(prog, ops, f, tensors, fresh)
        first_fwd = f.tr if f.tr is not None else f.mm
        replace_at[first_fwd], replace_at[f.split_grad] = fwd, bwd
        gone = [f.mm, *f.chain, f.split, *f.chain_grads, f.matmul_grad]
        if f.tr is not None:
            gone += [f.tr]
            assert f.tr_grad is not None
            gone += [f.tr_grad]
        drop.update(k for k in gone if k not in replace_at)
        gone_out.update(n for k in gone for n in ops[k].output_names())
        gone_out.update(ops[f.split_grad].output_names())
    if not replace_at:
        return prog
    out: list[tuple[int | None, Op]] = []
    for i, op in enumerate(ops):
        if i in replace_at:
            out += [(None, o) for o in replace_at[i]]
        elif i not in drop:
            out.append((i, op))
    made = {n for _, op in out for n in op.output_names()}
    read = {n for _, op in out for n in op.input_names()}
    return rebuild(prog, [t for t in tensors if t.name not in gone_out or t.name in made or t.name in read], out)


__all__ = ["Fused", "find_fused", "namer", "rebuild", "split_fused_projections"]
