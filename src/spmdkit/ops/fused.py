"""Fused LLM ops: swiglu, fused_dropout_add and their grads.

swiglu (Paddle 3.3.1's ``swiglu.cc``): ``out = silu(x) * y``.

* with y: elementwise binary on equal shapes, ``abc, abc -> abc``, merged as Paddle's
  ElementwiseBinaryInferSpmd does: a co-sharded entry keeps its largest mesh dim, x's axes
  claim their mesh dims first, then y's (a mesh dim already claimed is dropped; where x and
  y shard one axis over different mesh dims x wins), a size-1 axis claims its mesh dim
  but shards nothing. Uneven shardings are kept (a balanced split is sound elementwise).
* without y (x split in halves on the last axis: ``silu(x[..., :n/2]) * x[..., n/2:]``):
  ``abc -> abc`` with the last axis ``c`` replicated. Paddle runs the unary rule and keeps
  the last axis sharded (unsound, DESIGN class 6: each rank would pair the wrong halves;
  Paddle 3.3.1 also crashes the process on an absent y), ``swiglu-halved-axis``.

The reverse rule infers x (and y) from out the same way and returns the out they produce.
swiglu_grad (SwiGLUGradInferSpmd(x, y, out_grad)): x, y and out_grad merged as one
elementwise op (with y absent: x and out_grad, the last axis replicated); x_grad and
y_grad are sharded as x and y.

fused_dropout_add (``fused_dropout_add.cc``): ``out = dropout(x) + y``, FusedDropoutAddSpmdBase
``abc, abc -> abc`` merged as swiglu's binary case, and ``seed_offset`` (shape [2])
replicated. Paddle returns x and y unchanged (partial status and conflicting shardings
included) while out takes the merged sharding (``fda-inputs-echoed``, DESIGN class 6);
spmdkit returns the merged shardings, partial cleared. The reverse returns the replicated
seed_offset the op produces (Paddle echoes the requested one, ``fda-reverse-seed``, class 4).
fused_dropout_add_grad (FusedDropoutAddGradInferSpmd(seed_offset, out_grad, p, is_test,
mode, fix_seed)): x_grad and y_grad are sharded as out_grad; a SUM / AVG / MAX / MIN
partial out_grad stays partial (the grad is out_grad times a non-negative mask), other
reduce types are made replicated. Nothing else becomes partial.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spmdkit.core.dist_attr import DimsMapping, ReduceType, entry_dims
from spmdkit.core.errors import ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.axes import make_attr
from spmdkit.engine.declare import Answer, PartialIn, Way, declare
from spmdkit.engine.facts import facts
from spmdkit.engine.notation import BROADCAST, Conflict, Coshard, Notation, UnitAxes, letters_for
from spmdkit.engine.outshape import Args, Expect, UnknownShape, broadcast
from spmdkit.ops._absent import absent_0d
from spmdkit.ops._common import check_like, check_same_shape
from spmdkit.ops._cost import by_bytes, one_per_element


def binary(n_in: int, outs: int, nd: int, y: int, unit: int, seed: int = -2) -> Notation:
    """``n_in`` tensors of x's shape merged as the module docstring says (``outs`` outputs of that
    shape, and an unlabelled seed_offset output where ``seed`` > -2; ``unit``: the size-1 axes);
    without y (swiglu's halved x) as Paddle's unary rule (uneven mesh dims dropped, minor
    first), the last axis replicated."""
    if y < 0:
        a = letters_for(nd)
        ts: list[str | None] = [a, None, a][:n_in]
        return Notation(ts, [a, None][:outs], replicated=a[-1:], prune="*")
    a = "".join(BROADCAST if unit >> i & 1 else c for i, c in enumerate(letters_for(nd)))
    seeds: list[str | None] = [] if seed == -2 else [None]
    return Notation([a] * n_in, [*([a] * outs), *seeds], coshard=Coshard.LARGEST, conflict=Conflict.FIRST, unit_axes=UnitAxes.CLAIM)


def _halved(src: DimsMapping, ins: Any, outs: Any) -> Answer:
    """swiglu without y: only mesh dims of size 1 (which split nothing) may stay on the halved
    last axis, as ``src`` (x, or out in the reverse rule) has them."""
    last = src[-1] if src else -1
    a = next(t for t in ins if t is not None)
    if last == -1:
        return ins, outs
    dims = entry_dims(last)
    used = {d for e in a.dims_mapping for d in entry_dims(e)}
    if not all(a.mesh.shape[d] == 1 and d not in used for d in dims):
        return ins, outs
    b = make_attr(a.mesh, (*a.dims_mapping[:-1], last))
    return tuple(None if t is None else b for t in ins), tuple(None if t is None else b for t in outs)


def _swiglu(op: str, x: DistTensorSpec, y: Any, t: Any = None, name: str = "") -> None:
    """With y, y and ``t`` (out / out_grad) of x's shape; without y, x's last axis even and ``t``
    x with its last axis halved."""
    if y is not None and y.shape == x.shape and (t is None or t.shape == x.shape):
        return
    if y is not None:
        for n, u in (("y", y), (name, t)):
            if u is not None:
                check_like(op, x, u, "x", n)
        return
    s = x.shape[-1]
    if s >= 0 and s % 2 != 0:
        raise ShapeMismatchError(f"{op}: without y, x's last axis ({s}) must be even")
    if t is not None:
        check_same_shape(op, t, (*x.shape[:-1], s // 2 if s >= 0 else -1), name, "x with its last axis halved")


_KEEP = frozenset({ReduceType.SUM, ReduceType.AVG, ReduceType.MAX, ReduceType.MIN})


def _keep_partial(ins: Any, outs: Any, seed_offset: Any, out_grad: DistTensorSpec, *attrs: object) -> Answer:
    """A SUM / AVG / MAX / MIN partial out_grad stays partial (the grad is out_grad times a
    non-negative mask); other reduce types are made replicated."""
    ga = out_grad.dist_attr
    pt = tuple((d, r) for d, r in ga.partial if r in _KEEP)
    if not pt:
        return ins, outs
    a = make_attr(ga.mesh, ga.dims_mapping, pt)
    return (ins[0], a), (a, a)


def _seed(ins: Any, outs: Any, x: DistTensorSpec, y: object, out: object = None, seed_offset: object = 0) -> Answer:
    """seed_offset ``[2]`` replicated (where the reverse rule is given one); the notation leaves
    it unlabelled (it lacks every letter, so the engine would make it partial)."""
    return ins, (outs[0], None if seed_offset is None else make_attr(x.dist_attr.mesh, (-1,)))


def _binary(n_in: int, outs: int, seed: int = -2) -> Any:
    return lambda nd, y, unit, *s: binary(n_in, outs, nd, y, unit, *(s or (seed,)))


def _swiglu_out(op: str, x: DistTensorSpec, y: Any, out: DistTensorSpec) -> None:
    _swiglu(op, x, y, out, "out")


def _swiglu_out_grad(op: str, x: DistTensorSpec, y: Any, out_grad: DistTensorSpec) -> None:
    _swiglu(op, x, y, out_grad, "out_grad")


def _no_y(y: Any) -> bool:
    return y is None


def _swiglu_way(check: Callable[..., None], src: int, paddle: str, doc: str, n_in: int = 2, outs: int = 1) -> Way:
    """A mode of swiglu: ``check`` x, y and the third tensor (out / out_grad), ``src`` the argument
    whose last axis _halved reads without y. A 0-D y is read as absent: x is at least 1-D, so a 0-D
    y is never a real operand."""
    return Way(_binary(n_in, outs), key="x, y, ones(x)", shapes="x: _ ...", check=check,
               wrap=absent_0d("y"), post_if=_no_y, paddle=paddle, doc=doc,
               post=lambda i, o, *args: _halved(args[src].dist_attr.dims_mapping, i, o))  # fmt: skip


declare(
    "swiglu", "x: T, y: T? = None",
    _swiglu_way(_swiglu, 0, "SwiGLUInferSpmd",
                "swiglu (SwiGLUInferSpmd): elementwise binary with y; without y the halved last axis is replicated."),
    reverse=_swiglu_way(_swiglu_out, 2, "SwiGLUInferSpmdReverse",
                        "swiglu (SwiGLUInferSpmdReverse): x and y from out; out is what they produce."),
    outputs="out: T",
)  # fmt: skip
declare(
    "swiglu_grad", "x: T, y: T?, out_grad: T",
    _swiglu_way(_swiglu_out_grad, 0, "SwiGLUGradInferSpmd",
                "swiglu_grad (SwiGLUGradInferSpmd): x, y, out_grad, x_grad, y_grad sharded alike.", 3, 2),
)  # fmt: skip
declare(
    "fused_dropout_add", "x: T, y: T",
    Way(_binary(2, 1, -1), key="x, 0, ones(x)", same=[("x", "y")], post=_seed, paddle="FusedDropoutAddSpmdBase",
        doc="fused_dropout_add (FusedDropoutAddSpmdBase): x, y and out merged elementwise, seed_offset replicated."),
    reverse=Way(_binary(2, 1, -1), key="x, 0, ones(x)", shapes="seed_offset: _", same=[("x", "y"), ("x", "out")],
                post=_seed, paddle="FusedDropoutAddSpmdReverseBase",
                doc="fused_dropout_add (FusedDropoutAddSpmdReverseBase): x, y from out; the outputs are what x "
                    "and y produce."),
    outputs="out: T, seed_offset: T? = None",
)  # fmt: skip


def _fda_grad_notation(so_rank: int, nd: int) -> Notation:
    """``1, abc -> abc, abc`` (seed_offset, out_grad -> x_grad, y_grad)."""
    a = letters_for(nd)
    return Notation([None if so_rank < 0 else BROADCAST * so_rank, a], [a, a])


declare(
    "fused_dropout_add_grad",
    "seed_offset: T?, out_grad: T, p: scalar = 0.5, is_test: bool = False, mode: str = 'upscale_in_train', "
    "fix_seed: bool = False",
    Way(_fda_grad_notation, require=("not isinstance(p, bool) and 0 <= p <= 1",
                                     "mode in ('upscale_in_train', 'downscale_in_infer')"),
        wrap=absent_0d("seed_offset"), post=_keep_partial, post_if=PartialIn("out_grad"),
        paddle="FusedDropoutAddGradInferSpmd",
        doc="fused_dropout_add_grad (FusedDropoutAddGradInferSpmd): x_grad and y_grad sharded as out_grad."),
)  # fmt: skip


# -- output shapes / grads ----------------------------------------------------------------------


def _swiglu_shape(a: Args) -> list[Expect]:
    """out like x and y; without y, x's last axis holds both halves."""
    x = a.s("x")
    y = a.opt("y")
    if y is not None:
        return [broadcast(x, y)]
    if not x or x[-1] % 2:
        raise UnknownShape
    return [(*x[:-1], x[-1] // 2)]


def _dropout_add_shape(a: Args) -> list[Expect]:
    """out like x + y; seed_offset is the RNG seed and offset, [2]."""
    return [broadcast(a.s("x"), a.s("y")), (2,)]


facts("swiglu", shape=_swiglu_shape, grad="swiglu_grad", wrt=("x", "y"))
facts("fused_dropout_add", shape=_dropout_add_shape)
facts("fused_dropout_add_grad", grad_like=("=", "="))


# -- cost

facts("fused_dropout_add", "fused_dropout_add_grad", cost=one_per_element)
#: nominal FLOPs per output element
facts("swiglu", cost=by_bytes(5))
facts("swiglu_grad", cost=by_bytes(8))
