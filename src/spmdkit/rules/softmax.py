"""softmax, log_softmax and their grads.

Notation (Paddle 3.3.1's ``softmax.cc``): ``abc -> abc`` with the softmax axis kept
replicated (sharding it would need a cross-rank max / sum). Paddle 3.3.1 drops, on
the output, the mesh dims that do not divide an axis (minor co-shard dims first)
but keeps them on x (unsound, DESIGN class 3); spmdkit drops them on x too, so x
and out agree. A 0-d x is replicated (Paddle crashes on it). The reverse rule
infers x from out the same way and returns the out that x produces (Paddle
returns the requested out, DESIGN class 4).

Grads (SoftmaxGradInferSpmd(out, out_grad, axis), also for log_softmax_grad):
``abc, abc -> abc`` with the axis replicated; out and out_grad are merged as an
elementwise binary op (a tensor axis sharded differently by the two: out's
sharding wins), x_grad is sharded as they are. Partial inputs are made replicated.
"""

from __future__ import annotations

from functools import lru_cache

from spmdkit.core.errors import InvalidMeshError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import normalize_axis
from spmdkit.engine.compile import Plan, compile_plan, infer
from spmdkit.engine.notation import Notation, fast_result, letters_for
from spmdkit.rules.registry import register


@lru_cache(maxsize=4096)
def _plan(ndim: int, axis: int, direction: str) -> Plan:
    """``abc -> abc``, the softmax axis replicated, every other uneven mesh dim dropped."""
    x = letters_for(ndim)
    rep = x[axis] if ndim else ""
    return compile_plan(Notation([x], [x], replicated=rep, prune="*"), direction)


@lru_cache(maxsize=4096)
def _grad_plan(ndim: int, axis: int) -> Plan:
    """``abc, abc -> abc`` (out, out_grad -> x_grad), the axis replicated; merged as an
    elementwise binary op: out's sharding wins an axis both shard, axes claim in order."""
    x = letters_for(ndim)
    rep = x[axis] if ndim else ""
    return compile_plan(Notation([x, x], [x], replicated=rep, conflict="first", order="notation"))


def _check_same(op: str, a: DistTensorSpec, b: DistTensorSpec, na: str, nb: str) -> None:
    if b.dist_attr.mesh != a.dist_attr.mesh:
        raise InvalidMeshError(f"{op}: {na} and {nb} lie on different meshes")
    if len(a.shape) != len(b.shape):
        raise ShapeMismatchError(f"{op}: {nb} has {len(b.shape)} dims but {na} has {len(a.shape)}")
    for i, (s, t) in enumerate(zip(a.shape, b.shape)):
        if s != t and s >= 0 and t >= 0:
            raise ShapeMismatchError(f"{op}: {na} and {nb} differ on axis {i} ({s} vs {t})")


def _make_forward(op: str):  # type: ignore[no-untyped-def]
    def forward(x: DistTensorSpec, axis: int = -1) -> SpmdResult:
        nd = len(x.shape)
        ins, outs = infer(_plan(nd, normalize_axis(op, axis, nd), "forward"), op, (x,), (), x.dist_attr.mesh, ("x",))
        return fast_result(ins, outs)

    def backward(x: DistTensorSpec, out: DistTensorSpec, axis: int = -1) -> SpmdResult:
        _check_same(op, x, out, "x", "out")
        nd = len(x.shape)
        p = _plan(nd, normalize_axis(op, axis, nd), "backward")
        return fast_result(*infer(p, op, (x,), (out,), x.dist_attr.mesh, ("x", "out")))

    forward.__name__ = f"{op}_forward"
    forward.__doc__ = f"{op} (SoftmaxInferSpmd): the softmax axis replicated, uneven shardings dropped."
    backward.__name__ = f"{op}_backward"
    backward.__doc__ = f"{op} (SoftmaxInferSpmdReverse): x from out; out is what x produces."
    return forward, backward


def _make_grad(op: str):  # type: ignore[no-untyped-def]
    def grad(out: DistTensorSpec, out_grad: DistTensorSpec, axis: int = -1) -> SpmdResult:
        _check_same(op, out, out_grad, "out", "out_grad")
        nd = len(out.shape)
        p = _grad_plan(nd, normalize_axis(op, axis, nd))
        return fast_result(*infer(p, op, (out, out_grad), (), out.dist_attr.mesh, ("out", "out_grad")))

    grad.__name__ = op
    grad.__doc__ = f"{op} (SoftmaxGradInferSpmd): out, out_grad and x_grad sharded alike, axis replicated."
    return grad


for _name in ("softmax", "log_softmax"):
    _f, _b = _make_forward(_name)
    register(
        _name, _f, "x: T, axis: int = -1", _b, kind="reverse", outputs="out: T",
        forward_name="SoftmaxInferSpmd", backward_name="SoftmaxInferSpmdReverse",
    )  # fmt: skip
    register(
        f"{_name}_grad", _make_grad(f"{_name}_grad"), "out: T, out_grad: T, axis: int = -1",
        forward_name="SoftmaxGradInferSpmd",
    )  # fmt: skip
