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

from functools import partial

from spmdkit.engine.axes import normalize_axis
from spmdkit.engine.declare import Way, declare
from spmdkit.engine.facts import facts
from spmdkit.engine.notation import Conflict, Notation, Order, letters_for
from spmdkit.engine.outshape import same
from spmdkit.ops._cost import by_bytes


def notation(ndim: int, axis: int, grad: bool = False) -> Notation:
    """``abc -> abc``, the softmax axis replicated, every other uneven mesh dim dropped; the grad's
    ``abc, abc -> abc`` merged as an elementwise binary op (out's sharding wins, axes in order)."""
    x, a = letters_for(ndim), normalize_axis("", axis, ndim)
    rep = x[a] if ndim else ""
    if grad:
        return Notation([x, x], [x], replicated=rep, conflict=Conflict.FIRST, order=Order.NOTATION)
    return Notation([x], [x], replicated=rep, prune="*")


for _name in ("softmax", "log_softmax"):
    declare(
        _name, "x: T, axis: int = -1",
        Way(notation, key="x, axis", paddle="SoftmaxInferSpmd",
            doc=f"{_name} (SoftmaxInferSpmd): the softmax axis replicated, uneven shardings dropped."),
        reverse=Way(notation, key="x, axis", same=[("x", "out")], paddle="SoftmaxInferSpmdReverse",
                    doc=f"{_name} (SoftmaxInferSpmdReverse): x from out; out is what x produces."),
        outputs="out: T",
    )  # fmt: skip
    declare(
        f"{_name}_grad", "out: T, out_grad: T, axis: int = -1",
        Way(partial(notation, grad=True), key="out, axis", same=[("out", "out_grad")], paddle="SoftmaxGradInferSpmd",
            doc=f"{_name}_grad (SoftmaxGradInferSpmd): out, out_grad and x_grad sharded alike, axis replicated."),
    )  # fmt: skip


# -- output shapes / grads ----------------------------------------------------------------------

facts("softmax", "log_softmax", shape=same)
facts("softmax_grad", "log_softmax_grad", grad_like=("=",))  # x_grad has out_grad's shape
for _name in ("softmax", "log_softmax"):
    facts(_name, grad=f"{_name}_grad", wrt=("x",))


# -- cost

#: memory-bound, nominal FLOPs per output element
facts("softmax", "log_softmax", cost=by_bytes(5))
facts("softmax_grad", "log_softmax_grad", cost=by_bytes(3))
