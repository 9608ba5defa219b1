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

from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.declare import Way, declare
from spmdkit.engine.facts import LocalOp, LocalTensor, OpCost, facts
from spmdkit.engine.notation import Conflict, Notation, Size1, Sizes
from spmdkit.engine.outshape import Args, Expect, UnknownShape, broadcast
from spmdkit.ops._common import check_same_shape
from spmdkit.ops._cost import numel

Shape = tuple[int, ...]

#: batch letters (m, k, n are the matrix letters)
_BATCH = "abcdefghijlopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _matmul_notation(x: str, y: str, out: str, uneven: str) -> Notation:
    """The merge of the module docstring; a size-1 m / n still claims its mesh dims."""
    return Notation([x, y], [out], prune="*", uneven=uneven, conflict=Conflict.UNION, order=("*", ">mn", "k"),
                    size1_claims="mn", sizes=Sizes.KNOWN, size1=Size1.BROADCAST)  # fmt: skip


def _swap(t: str, on: bool) -> str:
    return t[:-2] + t[-1] + t[-2] if on else t


@lru_cache(maxsize=4096)
def _letters(nx: int, ny: int, tx: bool, ty: bool) -> tuple[str, str, str]:
    """The letters of x, y (in their given axis order) and out."""
    bx, by = max(nx - 2, 0), max(ny - 2, 0)
    nb = max(bx, by)
    if nb > len(_BATCH):
        raise ShapeMismatchError(f"tensors of more than {len(_BATCH) + 2} dims are not supported")
    batch = _BATCH[:nb]
    x = _swap(batch[nb - bx :] + ("mk" if nx > 1 else "k"), tx)
    y = _swap(batch[nb - by :] + ("kn" if ny > 1 else "k"), ty)
    return x, y, batch + ("m" if nx > 1 else "") + ("n" if ny > 1 else "")


def notation(nx: int, ny: int, tx: bool, ty: bool, mask: tuple[int, ...] = ()) -> Notation:
    """forward: m and n keep uneven shardings (the plan is compiled with the operands' size-1 ``mask``)."""
    return _matmul_notation(*_letters(nx, ny, tx, ty), "mn")


def reverse_notation(nx: int, ny: int, tx: bool, ty: bool, mask: tuple[int, ...] = ()) -> Notation:
    """reverse: the forward's letters, every one pruned."""
    return _matmul_notation(*_letters(nx, ny, tx, ty), "")


def grad_notation(nx: int, ny: int, tx: bool, ty: bool, mask: tuple[int, ...]) -> Notation:
    """``[b]mk, [b]kn, bmn -> [b]mk, [b]kn``: x_grad / y_grad carry the letters of x / y but
    their size-1 axes (``mask``), so they are partial SUM over the mesh dims of the others."""
    x, y, out = _letters(nx, ny, tx, ty)

    def grad(t: str, m: int) -> str:
        return "".join("1" if (m >> i) & 1 else c for i, c in enumerate(t))

    return _matmul_notation(x, y, out, "mn").relabel([x, y, out], [grad(x, mask[0]), grad(y, mask[1])])


def out_shape(xs: Shape, ys: Shape, tx: bool, ty: bool) -> Shape:
    """The shape of x @ y (after the transposes); ShapeMismatchError / InvalidAttributeError
    where x and y do not multiply."""
    nx, ny = len(xs), len(ys)
    if nx == 0 or ny == 0:
        raise ShapeMismatchError(f"x and y must have at least 1 dim, got x shape {list(xs)} and y shape {list(ys)}")
    if tx and nx < 2:
        raise InvalidAttributeError(f"trans_x needs x with at least 2 dims, x has shape {list(xs)}")
    if ty and ny < 2:
        raise InvalidAttributeError(f"trans_y needs y with at least 2 dims, y has shape {list(ys)}")
    kx = xs[-2 if tx else -1]
    ky = ys[-1 if ty else -2] if ny > 1 else ys[0]
    if kx != ky and kx >= 0 and ky >= 0:
        raise ShapeMismatchError(
            f"the contracting axis k differs: x shape {list(xs)} has {kx}, y shape {list(ys)} "
            f"has {ky} (trans_x={tx}, trans_y={ty})"
        )
    batch: list[int] = []
    bx, by = nx - 2 if nx > 2 else 0, ny - 2 if ny > 2 else 0
    nb = bx if bx > by else by
    for i in range(nb):  # aligned on the trailing side; a missing axis is 1
        sx = xs[i - nb + bx] if i >= nb - bx else 1
        sy = ys[i - nb + by] if i >= nb - by else 1
        if sx != 1 and sy != 1 and sx != sy and sx >= 0 and sy >= 0:
            raise ShapeMismatchError(
                f"the batch axes of x shape {list(xs)} and y shape {list(ys)} do not broadcast ({sx} vs {sy})"
            )
        batch.append(sx if sx != 1 else sy)
    if nx > 1:
        batch.append(xs[-1 if tx else -2])
    if ny > 1:
        batch.append(ys[-2 if ty else -1])
    return tuple(batch)


def _multiply(x: DistTensorSpec, y: DistTensorSpec, trans_x: bool, trans_y: bool) -> None:
    """x and y multiply."""
    out_shape(x.shape, y.shape, trans_x, trans_y)


def _product(op: str, x: DistTensorSpec, y: DistTensorSpec, trans_x: bool, trans_y: bool,
             out: DistTensorSpec | None = None, out_grad: DistTensorSpec | None = None) -> None:  # fmt: skip
    """The reverse rule's out (the grad rule's out_grad) is shaped as x @ y."""
    t, name = (out, "out") if out is not None else (out_grad, "out_grad")
    want = out_shape(x.shape, y.shape, trans_x, trans_y)
    if t is not None and t.shape != want:
        check_same_shape(op, t, want, name, "x @ y")


_KEY = "x, y, trans_x, trans_y"
declare(
    "matmul", "x: T, y: T, trans_x: bool = False, trans_y: bool = False",
    Way(notation, key=_KEY, mask=("x", "y"), check=_multiply,
        paddle="MatmulInferSpmd", doc="MatmulInferSpmd: ``[b] m k, [b] k n -> b m n``; a sharded k makes out partial."),
    reverse=Way(reverse_notation, key=_KEY, mask=("x", "y"), check=_product,
                paddle="MatmulInferSpmdReverse", doc="MatmulInferSpmdReverse: x and y from out (k replicated)."),
    outputs="out: T", aliases=("matmul_v2",),
)  # fmt: skip
declare(
    "matmul_grad", "x: T, y: T, out_grad: T, trans_x: bool = False, trans_y: bool = False",
    Way(grad_notation, key=_KEY, mask=("x", "y", "out_grad"), check=_product,
        paddle="MatmulGradInferSpmd",
        doc="MatmulGradInferSpmd: x_grad partial over n and x's broadcast batch letters, y_grad over m and y's."),
    aliases=("matmul_v2_grad",),
)  # fmt: skip


# -- output shapes / grads ----------------------------------------------------------------------


def _matmul_shape(a: Args) -> list[Expect]:
    x, y = a.s("x"), a.s("y")
    if not x or not y:
        raise UnknownShape
    xs, ys = list(x), list(y)
    x1, y1 = len(xs) == 1, len(ys) == 1
    if x1:
        xs = [1, xs[0]]
    elif a.a("trans_x", False):
        xs[-1], xs[-2] = xs[-2], xs[-1]
    if y1:
        ys = [ys[0], 1]
    elif a.a("trans_y", False):
        ys[-1], ys[-2] = ys[-2], ys[-1]
    batch = broadcast(xs[:-2], ys[:-2])
    return [tuple(list(batch) + ([] if x1 else [xs[-2]]) + ([] if y1 else [ys[-1]]))]


facts("matmul", shape=_matmul_shape, grad="matmul_grad", wrt=("x", "y"))


# -- cost


def k_of(x: LocalTensor, trans: bool) -> int:
    """The contraction length of a matmul operand ``x`` (its last axis, the one before when
    transposed; a 1-D x is all contraction)."""
    s = x[0]
    if len(s) == 0:
        return 1
    if len(s) == 1:
        return s[0]
    return s[-2] if trans else s[-1]


def gemm_dims(c: LocalOp) -> tuple[int, int, int, int]:
    """The (local) product as one GEMM ``(batch, m, n, k)`` from x and y (``input`` and ``weight``
    for a linear): a y without batch axes (a weight) folds x's batch into m (one GEMM, as the
    frameworks run a linear layer); else the broadcast batch is the GEMM's batch count."""
    x, y = c.one("x") or c.one("input"), c.one("y") or c.one("weight")
    tx = bool(c.attr("trans_x", False))
    ty = bool(c.attr("trans_y", c.attr("transpose_weight", False)))
    assert x is not None and y is not None
    xs, ys = x[0], y[0]
    m = 1 if len(xs) < 2 else (xs[-1] if tx else xs[-2])
    n = 1 if len(ys) < 2 else (ys[-2] if ty else ys[-1])
    bx, by = xs[:-2], ys[:-2]
    nb = max(len(bx), len(by))
    bx = (1,) * (nb - len(bx)) + tuple(bx)
    by = (1,) * (nb - len(by)) + tuple(by)
    batch = numel(max(a, b) for a, b in zip(bx, by))
    k = k_of(x, tx)
    if numel(by) == 1:
        return 1, batch * m, n, k
    return batch, m, n, k


def cost(c: LocalOp) -> OpCost:
    """``2mnk`` (batched, transposed; plus ``mn`` for a bias), on the tensor cores: one GEMM."""
    b, m, n, k = gemm_dims(c)
    f = 2.0 * b * m * n * k
    if c.one("bias") is not None:
        f += b * m * n
    return OpCost(f, f, c.in_bytes + c.out_bytes, True, c.dtype(), gemms=((b, m, n, k),))


def grad_cost(c: LocalOp) -> OpCost:
    """``2mnk`` per input gradient made: x_grad ``= out_grad · y^T`` (an (m, k) output over n),
    y_grad ``= x^T · out_grad`` (a (k, n) output over m: over the batch too where y is a weight,
    whose GEMM folds it into m)."""
    b, m, n, k = gemm_dims(c)
    gemms: list[tuple[int, int, int, int]] = []
    if len(c.outs) > 0 and c.outs[0] is not None:
        gemms.append((b, m, k, n))
    if len(c.outs) > 1 and c.outs[1] is not None:
        gemms.append((b, k, n, m))
    f = sum(2.0 * g[0] * g[1] * g[2] * g[3] for g in gemms)
    return OpCost(f, f, c.in_bytes + c.out_bytes, True, c.dtype(), gemms=tuple(gemms))


facts("matmul", cost=cost)
facts("matmul_grad", cost=grad_cost)
