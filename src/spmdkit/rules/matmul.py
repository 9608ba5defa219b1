"""matmul (matmul_v2), its reverse rule and matmul_grad.

Notation (Paddle 3.3.1's ``matmul.cc``), on the operands *after* trans_x / trans_y:
``[batch_x] m k, [batch_y] k n -> batch m n`` with the batch axes aligned on the
trailing side (numpy broadcasting); a 1-D x is ``k`` (no ``m`` in out), a 1-D y is
``k`` (no ``n``). A sharded contracting axis ``k`` makes out partial SUM over its
mesh dims.

Merging follows what Paddle 3.3.1 answers:

* one letter sharded differently by x and y is *co-sharded* over both (the larger
  sharding major, x first on a tie), e.g. x ``k`` on 0, y ``k`` on 1 -> ``k`` on
  ``(0, 1)``; a size-1 batch axis's sharding counts for its letter (then is dropped
  on that operand, which broadcasts);
* a mesh dim claimed by several letters goes to the batch letters first (left to
  right), then to ``m`` and ``n`` (the larger axis first, ``m`` on a tie), then to
  ``k``; a letter keeps the rest of its mesh dims;
* batch letters and ``k`` drop the mesh dims that do not divide their size (minor
  dims first); ``m`` and ``n`` keep uneven shardings (sound with balanced splits),
  but a size-1 ``m`` / ``n`` is never sharded (Paddle shards out there; unsound).

Reverse: the letters come from out alone (every letter pruned to even shardings);
x and y are projected from them (``k`` replicated) and out is what those inputs
produce (never partial).

matmul_grad: the same merge over x, y and out_grad (``mk, kn, mn``); x_grad takes
x's sharding and is partial SUM over the mesh dims of the letters x does not carry
(``n``, and the batch letters x broadcasts along); y_grad likewise (``m``).
"""

from __future__ import annotations

from functools import lru_cache

from spmdkit.core.dist_attr import DimsMapping, Entry, ReduceType, TensorDistAttr, entry_dims
from spmdkit.core.errors import InvalidAttributeError, InvalidMeshError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.memo import memo
from spmdkit.engine.notation import attr_as, fast_result
from spmdkit.rules.registry import register

Shape = tuple[int, ...]
Dims = tuple[int, ...]

_SUM = ReduceType.SUM
_make = TensorDistAttr._make


# ---------------------------------------------------------------------------
# notation: letters are small ints; batch letters 0..nb-1, then M, K, N
# ---------------------------------------------------------------------------


def _swap(t: tuple, on: bool) -> tuple:  # type: ignore[type-arg]
    if not on:
        return t
    return (*t[:-2], t[-1], t[-2])


class _Nt:
    """The letters of one matmul call (shapes after the transposes)."""

    __slots__ = ("K", "M", "N", "nb", "out", "sizes", "x", "y")

    def __init__(self, op: str, xs: Shape, ys: Shape, tx: bool, ty: bool) -> None:
        nx, ny = len(xs), len(ys)
        if nx == 0 or ny == 0:
            raise ShapeMismatchError(
                f"{op}: x and y must have at least 1 dim, got x shape {list(xs)} and y shape {list(ys)}"
            )
        if tx and nx < 2:
            raise InvalidAttributeError(f"{op}: trans_x needs x with at least 2 dims, x has shape {list(xs)}")
        if ty and ny < 2:
            raise InvalidAttributeError(f"{op}: trans_y needs y with at least 2 dims, y has shape {list(ys)}")
        bx, by = max(nx - 2, 0), max(ny - 2, 0)
        nb = max(bx, by)
        M, K, N = nb, nb + 1, nb + 2
        self.nb, self.M, self.K, self.N = nb, M, K, N
        self.x = tuple(range(nb - bx, nb)) + ((M, K) if nx > 1 else (K,))
        self.y = tuple(range(nb - by, nb)) + ((K, N) if ny > 1 else (K,))
        self.out = tuple(range(nb)) + ((M,) if nx > 1 else ()) + ((N,) if ny > 1 else ())
        sizes = [1] * (nb + 3)
        xl, yl = _swap(xs, tx), _swap(ys, ty)
        kx, ky = xl[-1] if nx > 1 else xl[0], yl[-2] if ny > 1 else yl[0]
        if kx != ky and kx >= 0 and ky >= 0:
            raise ShapeMismatchError(
                f"{op}: the contracting axis k differs: x shape {list(xs)} has {kx}, y shape {list(ys)} "
                f"has {ky} (trans_x={tx}, trans_y={ty})"
            )
        sizes[K] = kx if kx >= 0 else ky
        if nx > 1:
            sizes[M] = xl[-2]
        if ny > 1:
            sizes[N] = yl[-1]
        for i in range(nb):
            ix, iy = i - (nb - bx), i - (nb - by)
            sx = xl[ix] if ix >= 0 else 1
            sy = yl[iy] if iy >= 0 else 1
            if sx != 1 and sy != 1 and sx != sy and sx >= 0 and sy >= 0:
                raise ShapeMismatchError(
                    f"{op}: the batch axes of x shape {list(xs)} and y shape {list(ys)} do not broadcast ({sx} vs {sy})"
                )
            sizes[i] = sx if sx != 1 else sy
        self.sizes = tuple(sizes)


def _prod(mesh_shape: Shape, dims: Dims) -> int:
    p = 1
    for d in dims:
        p *= mesh_shape[d]
    return p


def _merge(
    nb: int,
    sizes: tuple[int, ...] | list[int],
    tensors: tuple[tuple[tuple[int, ...], DimsMapping], ...],
    mesh_shape: Shape,
    prune_mn: bool,
) -> list[Dims]:
    """Per-letter mesh dims after co-shard merge, conflict resolution and pruning (the
    general path of :func:`_merge_plan`)."""
    n = nb + 3
    cands: list[list[Dims]] = [[] for _ in range(n)]
    batch_order: list[int] = []
    for axes, dm in tensors:
        for a, e in zip(axes, dm):
            d = entry_dims(e)
            if d:
                cands[a].append(d)
                if a < nb and a not in batch_order:
                    batch_order.append(a)
    merged: list[Dims] = []
    unions: list[int] = []
    for i, c in enumerate(cands):
        if not c:
            merged.append(())
        elif len(c) == 1:
            merged.append(c[0])
        else:
            if any(x != c[0] for x in c[1:]):
                c = sorted(c, key=lambda d: -_prod(mesh_shape, d))
                unions.append(i)
            out: list[int] = []
            for d in c:
                for x in d:
                    if x not in out:
                        out.append(x)
            merged.append(tuple(out))
    # a mesh dim another letter also wants goes minor (as Paddle 3.3.1 orders them)
    count: dict[int, int] = {}
    for d in merged if unions else ():
        for x in d:
            count[x] = count.get(x, 0) + 1
    if unions and any(v > 1 for v in count.values()):
        for i in unions:
            d = merged[i]
            if len(d) > 1:
                merged[i] = tuple(x for x in d if count[x] == 1) + tuple(x for x in d if count[x] > 1)
    M, K, N = nb, nb + 1, nb + 2
    mn = (M, N) if sizes[M] >= sizes[N] or sizes[N] < 0 else (N, M)
    # batch letters in the order the tensors first shard them, then m / n, then k
    order = (*batch_order, *mn, K)
    used: set[int] = set()
    final: list[Dims] = [()] * n
    for a in order:
        d = merged[a]
        if not d:
            continue
        kept = tuple(x for x in d if x not in used)
        size = sizes[a]
        claim = kept
        if size >= 0 and (size == 1 or prune_mn or (a != M and a != N)):
            while kept and size % _prod(mesh_shape, kept) != 0:
                kept = kept[:-1]
            if size != 1 or (a != M and a != N):
                claim = kept
        # a size-1 m / n keeps its mesh dims from the other letters (as Paddle) but
        # shards nothing (Paddle shards out there, which is unsound)
        used.update(claim)
        final[a] = kept
    return final


# ---------------------------------------------------------------------------
# per-structure plans: the letters of each operand, by (ranks, transposes) only
# ---------------------------------------------------------------------------


class _Plan:
    """The letters of a matmul call's operands in their *given* axis order (before the
    transposes), by structure only: ``(x.ndim, y.ndim, trans_x, trans_y)``."""

    __slots__ = ("K", "M", "N", "bx", "by", "kxi", "kyi", "mxi", "n", "nb", "nx", "ny", "nyi", "out",
                 "out_pos", "rev_mn", "rev_nm", "x", "x_missing", "xpos",
                 "y", "y_missing", "ypos")

    def __init__(self, nx: int, ny: int, tx: bool, ty: bool) -> None:
        bx, by = max(nx - 2, 0), max(ny - 2, 0)
        nb = max(bx, by)
        M, K, N = nb, nb + 1, nb + 2
        self.nx, self.ny, self.bx, self.by = nx, ny, bx, by
        self.nb, self.M, self.K, self.N, self.n = nb, M, K, N, nb + 3
        self.x: tuple[int, ...] = _swap(tuple(range(nb - bx, nb)) + ((M, K) if nx > 1 else (K,)), tx)
        self.y: tuple[int, ...] = _swap(tuple(range(nb - by, nb)) + ((K, N) if ny > 1 else (K,)), ty)
        self.out: tuple[int, ...] = tuple(range(nb)) + ((M,) if nx > 1 else ()) + ((N,) if ny > 1 else ())
        # the given axis of x holding k / m, of y holding k / n
        self.kxi = self.x.index(K)
        self.kyi = self.y.index(K)
        self.mxi = self.x.index(M) if nx > 1 else -1
        self.nyi = self.y.index(N) if ny > 1 else -1
        self.out_pos = tuple(a for a in range(nb + 3) if a not in self.out)
        # the axis of x / y carrying each letter (-1: none)
        self.xpos = tuple(self.x.index(a) if a in self.x else -1 for a in range(nb + 3))
        self.ypos = tuple(self.y.index(a) if a in self.y else -1 for a in range(nb + 3))
        self.x_missing = tuple(a for a in range(nb + 3) if a not in self.x)
        self.y_missing = tuple(a for a in range(nb + 3) if a not in self.y)
        # (out axis, letter) in claim order: batch, then m before n / n before m
        pos = {a: i for i, a in enumerate(self.out)}
        self.rev_mn = tuple((pos[a], a) for a in (*range(nb), M, N) if a in pos)
        self.rev_nm = tuple((pos[a], a) for a in (*range(nb), N, M) if a in pos)


@lru_cache(maxsize=1024)
def _plan(nx: int, ny: int, tx: bool, ty: bool) -> _Plan:
    return _Plan(nx, ny, tx, ty)


def _plan_sizes(op: str, xs: Shape, ys: Shape, tx: bool, ty: bool) -> tuple[_Plan, list[int]]:
    """The plan and the per-letter sizes (the checks and errors of :class:`_Nt`)."""
    nx, ny = len(xs), len(ys)
    if nx == 0 or ny == 0 or (tx and nx < 2) or (ty and ny < 2):
        _Nt(op, xs, ys, tx, ty)  # raises
    p = _plan(nx, ny, tx, ty)
    kx, ky = xs[p.kxi], ys[p.kyi]
    if kx != ky and kx >= 0 and ky >= 0:
        _Nt(op, xs, ys, tx, ty)  # raises
    nb = p.nb
    sizes = [1] * (nb + 3)
    sizes[p.K] = kx if kx >= 0 else ky
    if nx > 1:
        sizes[p.M] = xs[p.mxi]
    if ny > 1:
        sizes[p.N] = ys[p.nyi]
    off = nb - p.bx
    for j in range(p.bx):
        sizes[off + j] = xs[j]
    off = nb - p.by
    for j in range(p.by):
        sy = ys[j]
        a = off + j
        sx = sizes[a]
        if sx == 1:
            sizes[a] = sy
        elif sy != 1 and sx != sy and sx >= 0 and sy >= 0:
            _Nt(op, xs, ys, tx, ty)  # raises
    return p, sizes


#: (d,) for a mesh dim d: no tuple built per entry
_ONE = tuple((d,) for d in range(64))


def _merge_plan(
    p: _Plan,
    sizes: list[int],
    tensors: tuple[tuple[tuple[int, ...], DimsMapping], ...],
    mesh_shape: Shape,
    prune_mn: bool,
) -> tuple[list[Dims], list[Entry]]:
    """:func:`_merge` on int lists (the same answer); returns the per-letter mesh dims and
    their dims_mapping entries. A letter sharded differently by two tensors (co-shard
    merge) takes the general path."""
    n = p.n
    nb = p.nb
    first: list[Dims | None] = [None] * n
    batch_order: list[int] = []
    for axes, dm in tensors:
        for a, e in zip(axes, dm):
            if e.__class__ is int:
                if e < 0:  # type: ignore[operator,unused-ignore]
                    continue
                d: Dims = _ONE[e] if e < 64 else (e,)  # type: ignore[index,operator,assignment,unused-ignore]
            else:
                d = e  # type: ignore[assignment]
            c = first[a]
            if c is None:
                first[a] = d
                if a < nb:
                    batch_order.append(a)
            elif c != d:
                final = _merge(p.nb, sizes, tensors, mesh_shape, prune_mn)
                return final, [-1 if not f else f[0] if len(f) == 1 else f for f in final]
    M, K, N = p.M, p.K, p.N
    sn = sizes[N]
    if sizes[M] >= sn or sn < 0:
        batch_order.append(M)
        batch_order.append(N)
    else:
        batch_order.append(N)
        batch_order.append(M)
    batch_order.append(K)
    out: list[Dims] = [()] * n
    ent: list[Entry] = [-1] * n
    used = 0  # bit mask of claimed mesh dims
    for a in batch_order:
        c = first[a]
        if c is None:
            continue
        d = c
        if used:
            if len(d) == 1:
                kept: Dims = () if (used >> d[0]) & 1 else d
            else:
                kept = tuple([x for x in d if not (used >> x) & 1])
            if not kept:
                continue
        else:
            kept = d
        size = sizes[a]
        claim = kept
        if size >= 0:
            mn = a == M or a == N
            if size == 1 or prune_mn or not mn:
                while kept and size % _prod(mesh_shape, kept) != 0:
                    kept = kept[:-1]
                if size != 1 or not mn:
                    claim = kept
        for x in claim:
            used |= 1 << x
        if kept:
            out[a] = kept
            ent[a] = kept[0] if len(kept) == 1 else kept
    return out, ent


def _proj(axes: tuple[int, ...], shape: Shape, ent: list[Entry]) -> DimsMapping:
    """The dims_mapping of an operand (given axis order): a size-1 axis is never sharded."""
    if 1 not in shape:
        return tuple([ent[a] for a in axes])
    return tuple([-1 if s == 1 else ent[a] for a, s in zip(axes, shape)])


def _partial_of(final: list[Dims], letters: tuple[int, ...]) -> tuple[tuple[int, ReduceType], ...]:
    """Partial SUM over the mesh dims of ``letters``."""
    pt: list[int] = []
    for a in letters:
        f = final[a]
        if f:
            pt.extend(f)
    if not pt:
        return ()
    if len(pt) > 1:
        pt.sort()
    return tuple([(d, _SUM) for d in pt])


def _not_carried(p: _Plan, axes: tuple[int, ...], shape: Shape) -> tuple[int, ...]:
    """The letters an operand does not carry (absent or size 1)."""
    if 1 not in shape:
        return p.x_missing if axes is p.x else p.y_missing
    have = [False] * p.n
    for a, s in zip(axes, shape):
        if s != 1:
            have[a] = True
    return tuple([a for a in range(p.n) if not have[a]])


@memo()
def _forward_core(
    xs: Shape, ys: Shape, xdm: DimsMapping, ydm: DimsMapping, tx: bool, ty: bool, mesh_shape: Shape
) -> tuple[DimsMapping, DimsMapping, DimsMapping, tuple[tuple[int, ReduceType], ...]]:
    p, sizes = _plan_sizes("matmul", xs, ys, tx, ty)
    final, ent = _merge_plan(p, sizes, ((p.x, xdm), (p.y, ydm)), mesh_shape, False)
    mo = tuple([ent[a] for a in p.out])
    return _proj(p.x, xs, ent), _proj(p.y, ys, ent), mo, _partial_of(final, p.out_pos)


@memo()
def _reverse_core(
    xs: Shape, ys: Shape, os_: Shape, odm: DimsMapping, tx: bool, ty: bool, mesh_shape: Shape
) -> tuple[DimsMapping, DimsMapping, DimsMapping]:
    """:func:`_merge` over out alone (every letter pruned), k replicated, in one pass: out's
    letters are distinct, so no co-shard merge."""
    p, sizes = _plan_sizes("matmul", xs, ys, tx, ty)
    _check_out_plan("matmul", "out", p, sizes, os_, xs, ys, tx, ty)
    M, N = p.M, p.N
    sn = sizes[N]
    order = p.rev_mn if sizes[M] >= sn or sn < 0 else p.rev_nm
    xpos, ypos = p.xpos, p.ypos
    ent: list[Entry] = [-1] * p.n
    mo: list[Entry] = [-1] * len(odm)
    used = 0  # bit mask of claimed mesh dims
    for i, a in order:
        e = odm[i]
        if e.__class__ is int:
            if e < 0 or (used >> e) & 1:  # type: ignore[operator,unused-ignore]
                continue
            size = sizes[a]
            if size >= 0 and size % mesh_shape[e] != 0:  # type: ignore[index,unused-ignore]
                if size == 1 and (a == M or a == N):
                    used |= 1 << e  # type: ignore[operator,unused-ignore]
                continue
            used |= 1 << e  # type: ignore[operator,unused-ignore]
            kept: Entry = e
            dims: Dims = _ONE[e] if e < 64 else (e,)  # type: ignore[index,operator,assignment,unused-ignore]
        else:
            d: Dims = e  # type: ignore[assignment]
            dims = tuple([x for x in d if not (used >> x) & 1]) if used else d
            if not dims:
                continue
            size = sizes[a]
            claim = dims
            if size >= 0:
                while dims and size % _prod(mesh_shape, dims) != 0:
                    dims = dims[:-1]
                if size != 1 or (a != M and a != N):
                    claim = dims
            for x in claim:
                used |= 1 << x
            if not dims:
                continue
            kept = dims[0] if len(dims) == 1 else dims
        ent[a] = kept
        # out is what x and y produce: a letter neither carries (size 1) shards nothing
        j = xpos[a]
        if j >= 0 and xs[j] != 1:
            mo[i] = kept
        else:
            j = ypos[a]
            if (j >= 0 and ys[j] != 1) or _prod(mesh_shape, dims) == 1:
                mo[i] = kept
    return _proj(p.x, xs, ent), _proj(p.y, ys, ent), tuple(mo)


@memo()
def _grad_core(
    xs: Shape,
    ys: Shape,
    gs: Shape,
    xdm: DimsMapping,
    ydm: DimsMapping,
    gdm: DimsMapping,
    tx: bool,
    ty: bool,
    mesh_shape: Shape,
) -> tuple[DimsMapping, ...] | tuple[object, ...]:
    p, sizes = _plan_sizes("matmul_grad", xs, ys, tx, ty)
    _check_out_plan("matmul_grad", "out_grad", p, sizes, gs, xs, ys, tx, ty)
    final, ent = _merge_plan(p, sizes, ((p.x, xdm), (p.y, ydm), (p.out, gdm)), mesh_shape, False)
    mx, my = _proj(p.x, xs, ent), _proj(p.y, ys, ent)
    mg = _proj(p.out, gs, ent)
    px = _partial_of(final, _not_carried(p, p.x, xs))
    py = _partial_of(final, _not_carried(p, p.y, ys))
    return mx, my, mg, px, py


# ---------------------------------------------------------------------------
# the rules
# ---------------------------------------------------------------------------


def _same_mesh(op: str, pairs: tuple[tuple[str, DistTensorSpec], ...]) -> ProcessMesh:
    mesh = pairs[0][1].dist_attr.mesh
    for name, t in pairs[1:]:
        m = t.dist_attr.mesh
        if m is not mesh and m != mesh:
            raise InvalidMeshError(
                f"{op}: {name} lies on a different mesh than {pairs[0][0]} ({t.dist_attr.mesh!r} vs {mesh!r})"
            )
    return mesh


def _out_shape(nt: _Nt, xs: Shape, ys: Shape, tx: bool, ty: bool) -> Shape:
    xl, yl = _swap(xs, tx), _swap(ys, ty)
    batch = list(nt.sizes[: nt.nb])
    tail: list[int] = []
    if len(xs) > 1:
        tail.append(xl[-2])
    if len(ys) > 1:
        tail.append(yl[-1])
    return (*batch, *tail)


def _check_out_plan(
    op: str, name: str, p: _Plan, sizes: list[int], os_: Shape, xs: Shape, ys: Shape, tx: bool, ty: bool
) -> None:
    """:func:`_check_out` on the plan's sizes (the same checks and errors)."""
    out = p.out
    bad = len(os_) != len(out)
    if not bad:
        for a, s in zip(out, os_):
            w = sizes[a]
            if s != w and s >= 0 and w >= 0:
                bad = True
                break
    if bad:
        _check_out(op, name, _Nt(op, xs, ys, tx, ty), os_, xs, ys, tx, ty)


def _check_out(op: str, name: str, nt: _Nt, os_: Shape, xs: Shape, ys: Shape, tx: bool, ty: bool) -> None:
    want = _out_shape(nt, xs, ys, tx, ty)
    if len(os_) != len(want):
        raise ShapeMismatchError(
            f"{op}: {name} has {len(os_)} dims (shape {list(os_)}), but x {list(xs)} @ y {list(ys)} "
            f"gives {len(want)} dims {list(want)}"
        )
    for i, (s, w) in enumerate(zip(os_, want)):
        if s != w and s >= 0 and w >= 0:
            raise ShapeMismatchError(
                f"{op}: {name} shape {list(os_)} does not match x {list(xs)} @ y {list(ys)} = {list(want)} (axis {i})"
            )


def _meshes(op: str, pairs: tuple[tuple[str, DistTensorSpec], ...]) -> None:
    _same_mesh(op, pairs)  # raises


def matmul_forward(x: DistTensorSpec, y: DistTensorSpec, trans_x: bool = False, trans_y: bool = False) -> SpmdResult:
    """MatmulInferSpmd: ``[b] m k, [b] k n -> b m n``; a sharded k makes out partial SUM."""
    xa, ya = x.dist_attr, y.dist_attr
    mesh = xa.mesh
    if ya.mesh is not mesh and ya.mesh != mesh:
        _meshes("matmul", (("x", x), ("y", y)))
    mx, my, mo, pt = _forward_core(
        x.shape, y.shape, xa.dims_mapping, ya.dims_mapping, trans_x, trans_y, mesh.shape
    )
    return fast_result((attr_as(xa, mesh, mx), attr_as(ya, mesh, my)), (_make(mesh, mo, pt),))


def matmul_backward(
    x: DistTensorSpec, y: DistTensorSpec, out: DistTensorSpec, trans_x: bool = False, trans_y: bool = False
) -> SpmdResult:
    """MatmulInferSpmdReverse: x and y from out's sharding (k replicated)."""
    xa, ya, oa = x.dist_attr, y.dist_attr, out.dist_attr
    mesh = xa.mesh
    if (ya.mesh is not mesh and ya.mesh != mesh) or (oa.mesh is not mesh and oa.mesh != mesh):
        _meshes("matmul", (("x", x), ("y", y), ("out", out)))
    mx, my, mo = _reverse_core(x.shape, y.shape, out.shape, oa.dims_mapping, trans_x, trans_y, mesh.shape)
    return fast_result((attr_as(xa, mesh, mx), attr_as(ya, mesh, my)), (attr_as(oa, mesh, mo),))


def matmul_grad(
    x: DistTensorSpec, y: DistTensorSpec, out_grad: DistTensorSpec, trans_x: bool = False, trans_y: bool = False
) -> SpmdResult:
    """MatmulGradInferSpmd: inputs x, y, out_grad; outputs x_grad (partial over n and x's
    broadcast batch letters), y_grad (partial over m and y's broadcast batch letters)."""
    op = "matmul_grad"
    xa, ya, ga = x.dist_attr, y.dist_attr, out_grad.dist_attr
    mesh = xa.mesh
    if (ya.mesh is not mesh and ya.mesh != mesh) or (ga.mesh is not mesh and ga.mesh != mesh):
        _meshes(op, (("x", x), ("y", y), ("out_grad", out_grad)))
    mx, my, mg, px, py = _grad_core(
        x.shape, y.shape, out_grad.shape, xa.dims_mapping, ya.dims_mapping, ga.dims_mapping,
        trans_x, trans_y, mesh.shape,
    )  # fmt: skip
    ax, ay = attr_as(xa, mesh, mx), attr_as(ya, mesh, my)  # type: ignore[arg-type]
    return fast_result(
        (ax, ay, attr_as(ga, mesh, mg)),  # type: ignore[arg-type]
        (ax if not px else _make(mesh, mx, px), ay if not py else _make(mesh, my, py)),  # type: ignore[arg-type]
    )


register(
    "matmul",
    matmul_forward,
    "x: T, y: T, trans_x: bool = False, trans_y: bool = False",
    matmul_backward,
    "x: T, y: T, out: T, trans_x: bool = False, trans_y: bool = False",
    aliases=("matmul_v2",),
    forward_name="MatmulInferSpmd",
    backward_name="MatmulInferSpmdReverse",
)
register(
    "matmul_grad",
    matmul_grad,
    "x: T, y: T, out_grad: T, trans_x: bool = False, trans_y: bool = False",
    aliases=("matmul_v2_grad",),
    forward_name="MatmulGradInferSpmd",
)
