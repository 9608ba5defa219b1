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

from spmdkit.core.dist_attr import DimsMapping, Entry, ReduceType, TensorDistAttr, dims_entry, entry_dims
from spmdkit.core.errors import InvalidAttributeError, InvalidMeshError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.memo import memo
from spmdkit.rules.registry import register

Shape = tuple[int, ...]
Dims = tuple[int, ...]

_SUM = ReduceType.SUM


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


@memo(4096)
def _notation(op: str, xs: Shape, ys: Shape, tx: bool, ty: bool) -> _Nt:
    return _Nt(op, xs, ys, tx, ty)


def _prod(mesh_shape: Shape, dims: Dims) -> int:
    p = 1
    for d in dims:
        p *= mesh_shape[d]
    return p


def _merge(
    nt: _Nt,
    tensors: tuple[tuple[tuple[int, ...], DimsMapping], ...],
    mesh_shape: Shape,
    prune_mn: bool,
) -> list[Dims]:
    """Per-letter mesh dims after co-shard merge, conflict resolution and pruning."""
    n = nt.nb + 3
    nb = nt.nb
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
    sizes = nt.sizes
    M, K, N = nt.M, nt.K, nt.N
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


def _project(axes: tuple[int, ...], shape: Shape, letters: list[Dims], trans: bool) -> DimsMapping:
    dm: list[Entry] = []
    for a, s in zip(axes, shape):
        dm.append(-1 if s == 1 else dims_entry(letters[a]))
    return _swap(tuple(dm), trans)


def _partial(letters: list[Dims], keep: set[int]) -> tuple[tuple[int, ReduceType], ...]:
    pt: list[int] = []
    for a, d in enumerate(letters):
        if d and a not in keep:
            pt.extend(d)
    return tuple((d, _SUM) for d in sorted(pt))


def _carried(axes: tuple[int, ...], shape: Shape) -> set[int]:
    return {a for a, s in zip(axes, shape) if s != 1}


# ---------------------------------------------------------------------------
# cached cores on plain tuples
# ---------------------------------------------------------------------------


@memo()
def _forward_core(
    xs: Shape, ys: Shape, xdm: DimsMapping, ydm: DimsMapping, tx: bool, ty: bool, mesh_shape: Shape
) -> tuple[DimsMapping, DimsMapping, DimsMapping, tuple[tuple[int, ReduceType], ...]]:
    nt = _notation("matmul", xs, ys, tx, ty)
    xl, yl = _swap(xs, tx), _swap(ys, ty)
    letters = _merge(nt, ((nt.x, _swap(xdm, tx)), (nt.y, _swap(ydm, ty))), mesh_shape, False)
    mx = _project(nt.x, xl, letters, tx)
    my = _project(nt.y, yl, letters, ty)
    mo = tuple(dims_entry(letters[a]) for a in nt.out)
    return mx, my, mo, _partial(letters, set(nt.out))


@memo()
def _reverse_core(
    xs: Shape, ys: Shape, os_: Shape, odm: DimsMapping, tx: bool, ty: bool, mesh_shape: Shape
) -> tuple[DimsMapping, DimsMapping, DimsMapping]:
    nt = _notation("matmul", xs, ys, tx, ty)
    letters = _merge(nt, ((nt.out, odm),), mesh_shape, True)
    letters[nt.K] = ()
    xl, yl = _swap(xs, tx), _swap(ys, ty)
    mx = _project(nt.x, xl, letters, tx)
    my = _project(nt.y, yl, letters, ty)
    have = _carried(nt.x, xl) | _carried(nt.y, yl)
    mo = tuple(dims_entry(letters[a]) if a in have or _prod(mesh_shape, letters[a]) == 1 else -1 for a in nt.out)
    return mx, my, mo


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
    nt = _notation("matmul_grad", xs, ys, tx, ty)
    xl, yl = _swap(xs, tx), _swap(ys, ty)
    letters = _merge(nt, ((nt.x, _swap(xdm, tx)), (nt.y, _swap(ydm, ty)), (nt.out, gdm)), mesh_shape, False)
    mx = _project(nt.x, xl, letters, tx)
    my = _project(nt.y, yl, letters, ty)
    mg = _project(nt.out, gs, letters, False)
    px = _partial(letters, _carried(nt.x, xl))
    py = _partial(letters, _carried(nt.y, yl))
    return mx, my, mg, px, py


# ---------------------------------------------------------------------------
# the rules
# ---------------------------------------------------------------------------


def _same_mesh(op: str, pairs: tuple[tuple[str, DistTensorSpec], ...]) -> ProcessMesh:
    mesh = pairs[0][1].dist_attr.mesh
    for name, t in pairs[1:]:
        if t.dist_attr.mesh != mesh:
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


def matmul_forward(x: DistTensorSpec, y: DistTensorSpec, trans_x: bool = False, trans_y: bool = False) -> SpmdResult:
    """MatmulInferSpmd: ``[b] m k, [b] k n -> b m n``; a sharded k makes out partial SUM."""
    mesh = _same_mesh("matmul", (("x", x), ("y", y)))
    mx, my, mo, pt = _forward_core(
        x.shape, y.shape, x.dist_attr.dims_mapping, y.dist_attr.dims_mapping, trans_x, trans_y, mesh.shape
    )
    make = TensorDistAttr._make
    return SpmdResult([make(mesh, mx), make(mesh, my)], [make(mesh, mo, pt)])


def matmul_backward(
    x: DistTensorSpec, y: DistTensorSpec, out: DistTensorSpec, trans_x: bool = False, trans_y: bool = False
) -> SpmdResult:
    """MatmulInferSpmdReverse: x and y from out's sharding (k replicated)."""
    mesh = _same_mesh("matmul", (("x", x), ("y", y), ("out", out)))
    nt = _notation("matmul", x.shape, y.shape, trans_x, trans_y)
    _check_out("matmul", "out", nt, out.shape, x.shape, y.shape, trans_x, trans_y)
    mx, my, mo = _reverse_core(x.shape, y.shape, out.shape, out.dist_attr.dims_mapping, trans_x, trans_y, mesh.shape)
    make = TensorDistAttr._make
    return SpmdResult([make(mesh, mx), make(mesh, my)], [make(mesh, mo)])


def matmul_grad(
    x: DistTensorSpec, y: DistTensorSpec, out_grad: DistTensorSpec, trans_x: bool = False, trans_y: bool = False
) -> SpmdResult:
    """MatmulGradInferSpmd: inputs x, y, out_grad; outputs x_grad (partial over n and x's
    broadcast batch letters), y_grad (partial over m and y's broadcast batch letters)."""
    op = "matmul_grad"
    mesh = _same_mesh(op, (("x", x), ("y", y), ("out_grad", out_grad)))
    nt = _notation(op, x.shape, y.shape, trans_x, trans_y)
    _check_out(op, "out_grad", nt, out_grad.shape, x.shape, y.shape, trans_x, trans_y)
    mx, my, mg, px, py = _grad_core(
        x.shape,
        y.shape,
        out_grad.shape,
        x.dist_attr.dims_mapping,
        y.dist_attr.dims_mapping,
        out_grad.dist_attr.dims_mapping,
        trans_x,
        trans_y,
        mesh.shape,
    )
    make = TensorDistAttr._make
    return SpmdResult(
        [make(mesh, mx), make(mesh, my), make(mesh, mg)],  # type: ignore[arg-type]
        [make(mesh, mx, px), make(mesh, my, py)],  # type: ignore[arg-type]
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
