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
any sizes (or ``slice`` s tiling the features, Phi-3's ``qkv_proj``: :func:`slices_as_split`
reads them as one split). :func:`split_fused_projections` rewrites it as one projection per
part on ``slice`` s of the weight and bias and its backward likewise: each part's gradient
through its own projection, the input gradients summed (``add_n``), the weight and bias
gradients the ``concat`` of the parts'. The same values. :func:`parts_as_parameters` then
makes each slice a parameter of its own (its gradient, optimizer states and update its own),
so that the parts, not a replicated fused weight, are what tp shards and the optimizer
updates.

Head-interleaved fused weights (GPT-NeoX's and BLOOM's ``query_key_value``: ``[heads, 3,
head_dim]`` rows, split after a view to ``[..., heads, 3 * head_dim]``) need no split: a
contiguous block of rows is whole heads with their q, k and v, as Megatron lays them out.

Standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any, NamedTuple

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


def _back_to_matmul(ops: list[Op], producer: dict[str, int], name: str, ws: set[str]) -> bool:
    """Whether ``name`` is made by a forward matmul on one of ``ws`` (or its transpose), maybe
    through a bias add and views."""
    for _ in range(5):
        i = producer.get(name)
        if i is None:
            return False
        op = ops[i]
        if op.rule == "matmul":
            y = op.inputs.get("y")
            j = producer.get(y) if isinstance(y, str) else None
            if j is not None and ops[j].rule == "transpose":
                y = ops[j].inputs.get("x")
            return y in ws
        if op.rule not in ("add", "reshape", "unsqueeze"):
            return False
        name = op.inputs.get("x")  # type: ignore[assignment]
        if not isinstance(name, str):
            return False
    return False


def slices_as_split(prog: Program, weights: Iterable[str]) -> Program:
    """A copy of ``prog`` where a projection's output (a matmul on one of ``weights``, maybe
    through a bias add and views) cut by two or more ``slice`` ops that tile one axis (its only
    forward readers: Phi-3's ``qkv_proj``, ``qkv[..., :q]``, ``qkv[..., q:q + kv]``, ...) is one
    ``split`` with those sections, and the ``slice_grad`` ops summed by one ``add_n`` its
    ``split_grad``: the same values, a form :func:`split_fused_projections` splits. ``prog``
    itself when there is none."""
    ws = set(weights)
    ops = list(prog.ops)
    T = prog.tensors
    readers = _readers(ops)
    producer = {o: i for i, op in enumerate(ops) if op.phase == "forward" for o in op.output_names()}
    replace_at: dict[int, Op] = {}
    drop: set[int] = set()
    for name, rs in readers.items():
        fwd = [j for j in rs if ops[j].phase == "forward"]
        if len(fwd) < 2 or any(ops[j].rule != "slice" for j in fwd) or name not in T \
                or not _back_to_matmul(ops, producer, name, ws):
            continue
        nd = len(T[name].shape)
        cuts = []
        for j in fwd:
            a = ops[j].attrs
            axes, st, en = tuple(a.get("axes", ())), tuple(a.get("starts", ())), tuple(a.get("ends", ()))
            if len(axes) != 1 or len(st) != 1 or len(en) != 1 or a.get("decrease_axis") or a.get("strides") \
                    or not ops[j].output_names():
                break
            cuts.append((int(axes[0]) % nd, int(st[0]), int(en[0]), j))
        else:
            cuts.sort(key=lambda c: c[1])
            ax = cuts[0][0]
            size = T[name].shape[ax]
            ok = all(c[0] == ax for c in cuts) and cuts[0][1] == 0 and cuts[-1][2] == size \
                and all(a[2] == b[1] and a[1] < a[2] for a, b in pairwise(cuts))
            # the backward: one slice_grad per slice, summed by one add_n (nothing else)
            sgs = [k for k, o in enumerate(ops) if o.phase == "backward" and o.rule == "slice_grad"
                   and o.inputs.get("input") == name]
            outs = [ops[k].output_names()[0] for k in sgs if ops[k].output_names()]
            adds = {k for o in outs for k in readers.get(o, [])}
            if not ok or len(sgs) != len(cuts) or len(adds) != 1:
                continue
            (ia,) = adds
            if ops[ia].rule != "add_n" or sorted(ops[ia].input_names()) != sorted(outs):
                continue
            by_cut = {(tuple(ops[k].attrs.get("starts", ())), tuple(ops[k].attrs.get("ends", ()))): k for k in sgs}
            ks = [by_cut.get((tuple(ops[c[3]].attrs["starts"]), tuple(ops[c[3]].attrs["ends"]))) for c in cuts]
            if None in ks or len(set(ks)) != len(ks):
                continue
            parts = [ops[c[3]].output_names()[0] for c in cuts]
            gparts = [ops[k].inputs.get("out_grad") for k in ks if k is not None]
            if not all(isinstance(g, str) for g in gparts):
                continue
            first = min(c[3] for c in cuts)
            kw = {"layer": ops[first].layer, "phase": "forward"}
            replace_at[first] = Op("split", {"x": name}, (tuple(parts),),
                                   {"sections": tuple(c[2] - c[1] for c in cuts), "axis": ax}, name=parts[0], **kw)
            drop.update(c[3] for c in cuts if c[3] != first)
            gout = ops[ia].output_names()[0]
            replace_at[ia] = Op("split_grad", {"out_grad": tuple(gparts)}, (gout,), {"axis": ax},
                                name=gout, layer=ops[ia].layer, phase="backward")
            drop.update(sgs)
    if not replace_at:
        return prog
    out: list[tuple[int | None, Op]] = [(i, replace_at.get(i, op)) for i, op in enumerate(ops) if i not in drop]
    made = {n for _, op in out for n in op.output_names()} | {n for _, op in out for n in op.input_names()}
    return rebuild(prog, [t for t in prog.tensors.values() if t.name in made
                          or t.kind not in ("activation", "gradient")], out)


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


class Part(NamedTuple):
    """A parameter that is a part of a fused one (:func:`parts_as_parameters`): the module's
    parameter ``source`` (its name in the imported program), the ``axis`` and the range
    ``lo:hi`` it is of it, and ``weight``: the weight part it goes with (itself for a weight
    part; for a bias part, the weight part of the same index)."""

    source: str
    axis: int
    lo: int
    hi: int
    weight: str


def fused_parts(prog: Program) -> dict[str, Part]:
    """The program's parameters that are parts of a fused one (empty for none)."""
    parts = getattr(prog, "fused_parts", None)
    return dict(parts) if isinstance(parts, dict) else {}


def _tiling(prog: Program, ops: list[Op], w: str, readers: dict[str, list[int]]
            ) -> list[tuple[int, int, int, str]] | None:
    """(axis, lo, hi, part) of the forward ``slice`` ops that tile parameter ``w`` along one
    axis, in order, when they are all its forward readers; else None."""
    t = prog.tensors[w]
    rs = [j for j in readers.get(w, []) if ops[j].phase == "forward"]
    cuts: list[tuple[int, int, int, str]] = []
    for j in rs:
        a = ops[j].attrs
        axes, st, en = tuple(a.get("axes", ())), tuple(a.get("starts", ())), tuple(a.get("ends", ()))
        if ops[j].rule != "slice" or len(axes) != 1 or len(st) != 1 or len(en) != 1 or a.get("decrease_axis") \
                or len(ops[j].output_names()) != 1:
            return None
        cuts.append((int(axes[0]) % len(t.shape), int(st[0]), int(en[0]), ops[j].output_names()[0]))
    cuts.sort(key=lambda c: c[1])
    if len(cuts) < 2 or len({c[0] for c in cuts}) != 1 or cuts[0][1] != 0 \
            or cuts[-1][2] != t.shape[cuts[0][0]] or any(a[2] != b[1] for a, b in pairwise(cuts)):
        return None
    return cuts


def _optimizer_per_part(prog: Program, op: Op, w: str, parts: list[tuple[str, str]], tensors: dict[str, Tensor],
                        fresh: Callable[[str], str]) -> list[Op]:
    """``op`` (the update of ``w``) as one update per (part, its gradient): each state of
    ``w``'s shape one of the part's shape, each other state (the beta powers) the part's own
    copy, the learning rate shared."""
    W = prog.tensors[w]
    grad = op.inputs.get("grad")
    assert isinstance(grad, str)
    out: list[Op] = []
    for part, g in parts:
        P = tensors[part]
        ren: dict[str, str] = {w: part, grad: g}

        def mapped(n: str, part: str = part, P: Tensor = P, ren: dict[str, str] = ren) -> str:
            if n in ren:
                return ren[n]
            t = prog.tensors[n]
            if t.kind != "optimizer_state" and not t.inplace_of:
                return n  # the learning rate
            src = ren.get(t.inplace_of) if t.inplace_of else None
            base = (src + n[len(t.inplace_of):]) if src and t.inplace_of and n.startswith(t.inplace_of) else \
                (part + n[len(w):] if n.startswith(w) else f"{part}.{n}")
            m = fresh(base)
            tensors[m] = Tensor(m, P.shape if t.shape == W.shape else t.shape, t.dtype, t.kind, src)
            ren[n] = m
            return m

        ins = {k: mapped(v) if isinstance(v, str) else v for k, v in op.inputs.items()}
        outs = tuple(mapped(v) if isinstance(v, str) else v for v in op.outputs)
        out.append(Op(op.rule, ins, outs, dict(op.attrs), name=f"update {part}", layer=op.layer, phase=op.phase))
    return out


def parts_as_parameters(prog: Program, weights: Iterable[str]) -> Program:
    """A copy of ``prog`` where each of ``weights`` that its forward reads only as ``slice`` s
    tiling one axis (the parts of a split fused projection: :func:`split_fused_projections`),
    whose gradient is the ``concat`` of the parts' and is read only by its update, is replaced
    by its parts as parameters of their own (named as the slices: ``c_attn.weight.part0``),
    their gradients (``c_attn.weight.part0.grad``) and updates their own: each part can then
    be stored sharded over tp with its optimizer states, as Megatron stores a fused qkv, and no
    weight-sized collective is left in the step. The same values: each part starts as its
    slice of the module's weight (an imported program's ``sources`` say
    ``("parameter_slice", (fqn, axis, lo, hi))``), its gradient is that slice of the weight's
    and Adam updates elementwise. The program's ``fused_parts`` (:func:`fused_parts`) say
    where each part is from; ``prog`` itself when no weight is such."""
    ops = list(prog.ops)
    readers = _readers(ops)
    made = {o: i for i, op in enumerate(ops) for o in op.output_names()}
    tensors = dict(prog.tensors)
    fresh = namer(set(tensors))
    grads: dict[str, str] = dict(getattr(prog, "grads", None) or {})
    opt = dict(getattr(prog, "optimizer", None) or {})
    sources = dict(getattr(prog, "sources", None) or {})
    found = fused_parts(prog)
    replace_at: dict[int, list[Op]] = {}
    drop: set[int] = set()
    gone: set[str] = set()
    weight_parts: dict[tuple[str, int], str] = {}
    for w in sorted(weights, key=lambda n: len(prog.tensors[n].shape) if n in prog.tensors else 0, reverse=True):
        W = prog.tensors.get(w)
        if W is None or W.kind != "parameter" or W.inplace_of or w in (getattr(prog, "aliases", None) or {}).values():
            continue
        cuts = _tiling(prog, ops, w, readers)
        upd = [j for j in readers.get(w, []) if ops[j].phase == "optimizer"]
        bwd = [j for j in readers.get(w, []) if ops[j].phase == "backward"]
        if cuts is None or len(upd) != 1 or bwd or ops[upd[0]].inputs.get("param") != w:
            continue
        g = ops[upd[0]].inputs.get("grad")
        cat = made.get(g) if isinstance(g, str) else None
        if not isinstance(g, str) or cat is None or ops[cat].rule != "concat" or int(ops[cat].attrs.get("axis", 0)) % len(W.shape) != cuts[0][0] \
                or readers.get(g, []) != upd or len(ops[cat].input_names()) != len(cuts):
            continue
        pgs = ops[cat].input_names()
        if any(tensors[pg].shape != tensors[c[3]].shape or len(readers.get(pg, [])) != 1 for pg, c in zip(pgs, cuts)):
            continue
        src = sources.pop(w, None)
        parts: list[tuple[str, str]] = []
        for j, ((ax, lo, hi, part), pg) in enumerate(zip(cuts, pgs)):
            P = tensors[part]
            tensors[part] = Tensor(part, P.shape, W.dtype, "parameter")
            new_g = fresh(f"{part}.grad")
            tensors[new_g] = replace(tensors.pop(pg), name=new_g, kind="gradient")
            k = made[pg]
            o = replace_at[k][0] if k in replace_at else ops[k]
            replace_at[k] = [replace(o, outputs=tuple(new_g if v == pg else v for v in o.outputs),
                                     name=new_g if o.name == pg else o.name)]
            parts.append((part, new_g))
            if len(W.shape) == 2:
                weight_parts[(w.rsplit(".", 1)[0], j)] = part
            found[part] = Part(w, ax, lo, hi, weight_parts.get((w.rsplit(".", 1)[0], j), part))
            if src is not None and src[0] == "parameter":
                sources[part] = ("parameter_slice", (src[1], ax, lo, hi))
            elif src is not None and src[0] == "parameter_slice":  # a part of a part
                fqn, a0, lo0, _hi0 = src[1]
                assert a0 == ax
                sources[part] = ("parameter_slice", (fqn, ax, lo0 + lo, lo0 + hi))
            grads[part] = new_g
        replace_at[upd[0]] = _optimizer_per_part(prog, ops[upd[0]], w, parts, tensors, fresh)
        for n in parts:
            st = next(o for o in replace_at[upd[0]] if o.inputs.get("param") == n[0])
            states = tuple(v for k, v in st.inputs.items() if isinstance(v, str) and tensors[v].kind == "optimizer_state"
                           and k not in ("param", "grad") and tensors[v].shape == tensors[n[0]].shape)
            new_states = tuple(t.name for t in (tensors[o] for o in st.output_names()) if t.inplace_of in states)
            new_p = next(o for o in st.output_names() if tensors[o].inplace_of == n[0])
            opt[n[0]] = (n[1], states, new_p, new_states)
        opt.pop(w, None)
        grads.pop(w, None)
        drop.update(made[c[3]] for c in cuts)
        drop.add(cat)
        old = ops[upd[0]]
        gone.update([w, g, *old.input_names(), *old.output_names()])
    if not replace_at:
        return prog
    out: list[tuple[int | None, Op]] = []
    for i, op in enumerate(ops):
        if i in drop:
            continue
        if i in replace_at:
            out += [(i if k == 0 else None, o) for k, o in enumerate(replace_at[i])]
        else:
            out.append((i, op))
    used = {n for _, op in out for n in (*op.input_names(), *op.output_names())}
    new = rebuild(prog, [t for n, t in tensors.items() if n not in gone or n in used], out)
    if hasattr(prog, "grads"):
        new.grads = grads  # type: ignore[attr-defined]
    if hasattr(prog, "optimizer"):
        new.optimizer = opt  # type: ignore[attr-defined]
    if hasattr(prog, "sources"):
        new.sources = sources  # type: ignore[attr-defined]
    new.fused_parts = found  # type: ignore[attr-defined]
    return new


__all__ = ["Fused", "Part", "find_fused", "fused_parts", "namer", "parts_as_parameters", "rebuild", "slices_as_split",
           "split_fused_projections"]
