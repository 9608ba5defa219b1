"""Losses: cross_entropy_with_softmax (softmax_with_cross_entropy), c_softmax_with_cross_entropy,
mean_all, c_softmax_with_multi_label_cross_entropy and label_smooth, and their grads.

Notation (3-D logits, class axis last; ``c`` is the class letter, ``1`` the size-1 axis of a
hard label and of the loss)::

    cross_entropy_with_softmax       abc, ab1 -> abc, ab1   (x, label -> softmax, loss)
                                     abc, abc -> abc, ab1   (soft_label)
    cross_entropy_with_softmax_grad  ab1, abc, ab1 -> abc   (label, softmax, loss_grad -> x_grad)
    c_softmax_with_cross_entropy     abc, ab1 -> abc, ab1   (c may stay sharded: the kernel
                                                             all-reduces max / sum over the
                                                             ranks that share c; loss not partial)
    c_softmax_with_cross_entropy_grad abc, ab1, ab1 -> abc  (softmax, label, loss_grad; each rank
                                                             subtracts the one-hot of its classes)
    mean_all                         ab -> (0-d)            partial AVG over every sharded axis
    mean_all_grad                    ab, () -> ab           all replicated

cross_entropy_with_softmax keeps the class letter replicated in every mode (DESIGN class 9:
sharding it needs the communicating kernel, c_softmax_with_cross_entropy; Paddle 3.3.1 keeps it
sharded and answers an unsound non-partial loss, and raises where the class axis is not last or
the label is soft). With ``use_softmax=False`` the softmax output is x itself and is answered with
x's dims_mapping (Paddle answers a 0-length dims_mapping, DESIGN class 5). The batch letters keep
their sharding (uneven included: every row is computed on its own rank). Every partial input is
resharded to replicated (softmax and log are not linear).

mean_all averages local means: that is the mean only where every rank holds as many elements,
so a sharded axis whose size its mesh dims do not divide drops them (minor first; Paddle answers
AVG partial over uneven shards, DESIGN class 7). The grad kernel divides by the local element
count, so mean_all_grad (Paddle's MeanAllGradInferSpmd, also mean_all's backward slot)
replicates x, out_grad and x_grad, as Paddle does.

The reverse rules merge the outputs (softmax, loss), project them onto the inputs and return the
outputs the inferred inputs produce. Deviations: ``docs/deviations.md`` ``loss-*``.

Multi-label model-parallel cross entropy (letters)::

    c_softmax_with_multi_label_cross_entropy
                           abc, abd, abd -> abc, ab1 | abd   (x, label, smooth_weight -> softmax, loss;
                           the class letter c may stay sharded: the kernel all-reduces max, sum
                           and the picked logits over the ranks that share c; loss partial SUM
                           over the mesh dims of d when sum_multi_label_loss)
    c_softmax_with_multi_label_cross_entropy_grad
                           abc, abd, abd, ab1 | abd -> abc   (d replicated)

Its deviations (``docs/deviations.md`` ``moe-amp-*``): loss partial over a sharded label axis (Paddle:
not partial) and its grad with the label axis replicated.

Label smoothing (x ``abc``; ``1`` an axis that is never sharded):

- ``label_smooth`` (LabelSmoothInferSpmd(label, prior_dist, epsilon)): with prior_dist an
  elementwise binary op (prior_dist broadcast from the right; its mesh dims that label's
  leading axes use are dropped first, as Paddle does; size-1 axes are never sharded).
  Without it the class (last) axis is replicated: the kernel adds epsilon / the class count
  it sees locally (Paddle keeps the axis sharded, unsound); on the other axes, as Paddle's
  elementwise unary rule, mesh dims that do not divide the axis are dropped (minor first).
  Backward slot and ``label_smooth_grad`` (LabelSmoothGradInferSpmd(out_grad, epsilon)):
  out_grad and label_grad sharded as out_grad, not partial.

Its deviations (``docs/deviations.md`` ``misc-*``): without prior_dist the class axis replicated;
conflicts Paddle raises on.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from spmdkit.core.dist_attr import ReduceType, entry_dims
from spmdkit.core.errors import ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import make_attr, normalize_axis, one_mesh_dim, unpartial
from spmdkit.engine.declare import Answer, Way, declare
from spmdkit.engine.facts import ClassAllReduces, facts
from spmdkit.engine.notation import ALPHABET, BROADCAST, Coshard, Notation, letters_for
from spmdkit.engine.outshape import Args, Expect, UnknownShape, axis_of, same, scalar
from spmdkit.ops._cost import by_bytes, one_per_element

# -- checks (the engine names the op; the typed attributes are coerced by the binding) -----------


def _hard_label(name: str, label: DistTensorSpec, nd: int, ax: int) -> None:
    if len(label.shape) != nd:
        raise ShapeMismatchError(f"{name} has {len(label.shape)} dims, expected {nd} (as the logits)")
    if label.shape[ax] not in (1, -1):
        hard = " (a hard label)" if name == "label" else ""
        raise ShapeMismatchError(f"{name}{hard} must have size 1 on the class axis {ax}, got {label.shape[ax]}")


def _ce(x: DistTensorSpec, label: DistTensorSpec, soft: bool, axis: int, loss: DistTensorSpec | None = None,
        loss_name: str = "loss") -> None:  # fmt: skip
    """cross_entropy_with_softmax's label (and loss / loss_grad) against x (or softmax)."""
    nd = len(x.shape)
    letters_for(nd)
    if nd == 0:
        raise ShapeMismatchError("the logits must have at least 1 dim (got a 0-d tensor)")
    ax = normalize_axis("", axis, nd)
    if not soft:
        _hard_label("label", label, nd, ax)
    elif len(label.shape) != nd:
        raise ShapeMismatchError(f"label (a soft label) has {len(label.shape)} dims, expected {nd}")
    if loss is not None:
        _hard_label(loss_name, loss, nd, ax)


def _c(x: DistTensorSpec, label: DistTensorSpec, loss: DistTensorSpec | None = None, loss_name: str = "loss") -> None:
    """c_softmax_with_cross_entropy's hard label (and loss / loss_grad)."""
    nd = len(x.shape)
    if nd == 0:
        raise ShapeMismatchError("the logits must have at least 1 dim (got a 0-d tensor)")
    letters_for(nd)
    for name, t in (("label", label), (loss_name, loss)):
        if t is not None:
            _hard_label(name, t, nd, nd - 1)


def _ml(x: DistTensorSpec, xname: str, *more: tuple[str, DistTensorSpec]) -> None:
    """c_softmax_with_multi_label_cross_entropy: ``more`` (label, smooth_weight, ...) of x's rank."""
    nd = len(x.shape)
    if nd == 0:
        raise ShapeMismatchError(f"{xname} must have at least 1 dim (got a 0-d tensor)")
    if nd >= len(ALPHABET):
        raise ShapeMismatchError(f"tensors of more than {len(ALPHABET) - 1} dims are not supported")
    for name, t in more:
        if len(t.shape) != nd:
            raise ShapeMismatchError(f"{name} must be a {nd}-D tensor, got shape {list(t.shape)}")


def _ce_check(x: DistTensorSpec, label: DistTensorSpec, soft_label: bool, axis: int,
              loss: DistTensorSpec | None = None) -> None:  # fmt: skip
    _ce(x, label, soft_label, axis, loss)


def _ce_grad_check(softmax: DistTensorSpec, label: DistTensorSpec, soft_label: bool, axis: int,
                   loss_grad: DistTensorSpec) -> None:  # fmt: skip
    _ce(softmax, label, soft_label, axis, loss_grad, "loss_grad")


def _c_grad_check(softmax: DistTensorSpec, label: DistTensorSpec, loss_grad: DistTensorSpec) -> None:
    _c(softmax, label, loss_grad, "loss_grad")


def _ml_check(x: DistTensorSpec, label: DistTensorSpec, smooth_weight: DistTensorSpec) -> None:
    _ml(x, "x", ("label", label), ("smooth_weight", smooth_weight))


def _ml_reverse_check(x: DistTensorSpec, label: DistTensorSpec, smooth_weight: DistTensorSpec,
                      softmax: DistTensorSpec, loss: DistTensorSpec) -> None:  # fmt: skip
    _ml(x, "x", ("label", label), ("smooth_weight", smooth_weight), ("softmax", softmax), ("loss", loss))


def _ml_grad_check(softmax: DistTensorSpec, label: DistTensorSpec, smooth_weight: DistTensorSpec,
                   loss_grad: DistTensorSpec) -> None:  # fmt: skip
    _ml(softmax, "softmax", ("label", label), ("smooth_weight", smooth_weight), ("loss_grad", loss_grad))


# -- notations (module docstring) ------------------------------------------------------------------


def ce_notation(kind: str, nd: int, axis: int, soft: bool) -> Notation:
    """Each co-shard read as its largest mesh dim; the reverse lists loss before softmax (its
    claims come first, as Paddle's reverse merge reads them)."""
    ax = normalize_axis("", axis, nd)
    x = ALPHABET[:nd]
    one = x[:ax] + BROADCAST + x[ax + 1 :]
    lab = x if soft else one
    if kind == "grad":
        return Notation([lab, x, one], [x], replicated=x[ax], coshard=Coshard.LARGEST)
    return Notation([x, lab], [one, x] if kind == "reverse" else [x, one], replicated=x[ax], coshard=Coshard.LARGEST)


def c_notation(kind: str, nd: int) -> Notation:
    x = ALPHABET[:nd]
    one = x[:-1] + BROADCAST
    if kind == "grad":
        return Notation([x, one, one], [x], coshard=Coshard.LARGEST)
    return Notation([x, one], [x, one], coshard=Coshard.LARGEST)


def ml_notation(kind: str, nd: int, summed: bool) -> Notation:
    x = ALPHABET[:nd]
    lab = x[:-1] + ALPHABET[nd]
    loss = (x[:-1] + BROADCAST) if summed else lab
    if kind == "grad":
        return Notation([x, lab, lab, loss], [x], replicated=lab[-1], coshard=Coshard.LARGEST)
    return Notation([x, lab, lab], [x, loss], coshard=Coshard.LARGEST)


def _not_partial(ins: Any, outs: Any, *args: object) -> Answer:
    """c_softmax_with_cross_entropy: the kernel all-reduces the loss, never partial."""
    return ins, tuple(unpartial(a) for a in outs)


def _ml_partial(ins: Any, outs: Any, *args: Any) -> Answer:
    """softmax never partial; the summed loss partial SUM over d's mesh dims (each rank sums its
    own labels), otherwise not partial."""
    summed = args[-3]
    loss = outs[1]
    pt = tuple((d, ReduceType.SUM) for d in sorted(entry_dims(ins[1].dims_mapping[-1]))) if summed else ()
    return ins, (unpartial(outs[0]), make_attr(loss.mesh, loss.dims_mapping, pt))


# -- cross_entropy_with_softmax, c_softmax_with_cross_entropy ----------------------------------

_CE_ATTRS = ("soft_label: bool = False, use_softmax: bool = True, numeric_stable_mode: bool = True, "
             "ignore_index: int = -100, axis: int = -1")


def _ce_way(kind: str, x: str, check: Callable[..., None], paddle: str, doc: str, **kw: Any) -> Way:
    return Way(partial(ce_notation, kind), key=f"{x}, axis, soft_label", letters=True, check=check, paddle=paddle,
               doc=doc, **kw)  # fmt: skip


declare(
    "cross_entropy_with_softmax", f"x: T, label: T, {_CE_ATTRS}",
    _ce_way("forward", "x", _ce_check, "CrossEntropyWithSoftmaxInferSpmdStatic",
            "cross_entropy_with_softmax (CrossEntropyWithSoftmaxInferSpmdStatic): batch axes merged, the class axis "
            "replicated; softmax as x, loss as x with the class axis of size 1."),
    reverse=_ce_way("reverse", "x", _ce_check, "CrossEntropyWithSoftmaxInferSpmdReverse",
                    order="x, label, loss, softmax_out",
                    doc="cross_entropy_with_softmax (CrossEntropyWithSoftmaxInferSpmdReverse): the inputs from softmax "
                        "and loss (class axis replicated); the outputs those inputs produce."),
    outputs="softmax_out: T, loss: T", aliases=("softmax_with_cross_entropy",),
)  # fmt: skip
declare(
    "cross_entropy_with_softmax_grad", f"label: T, softmax: T, loss_grad: T, {_CE_ATTRS}",
    _ce_way("grad", "softmax", _ce_grad_check, "CrossEntropyWithSoftmaxGradInferSpmd",
            "cross_entropy_with_softmax_grad (CrossEntropyWithSoftmaxGradInferSpmd): label, softmax and loss_grad "
            "merged on the batch axes, the class axis replicated; x_grad as softmax."),
    aliases=("softmax_with_cross_entropy_grad",),
)  # fmt: skip
_C_ATTRS = "ignore_index: int = -100, rank: int = 0, nranks: int = 1"
_C_WAY: dict[str, Any] = {"letters": True, "require": ("nranks >= 1",)}
declare(
    "c_softmax_with_cross_entropy", f"x: T, label: T, {_C_ATTRS}",
    Way(partial(c_notation, "forward"), key="x", **_C_WAY, post=_not_partial, check=_c,
        paddle="CSoftmaxWithCrossEntropyInferSpmd",
        doc="c_softmax_with_cross_entropy (CSoftmaxWithCrossEntropyInferSpmd): the class axis (last) keeps its "
            "sharding (the kernel reduces over it), label follows x's batch axes; loss not partial."),
    reverse=Way(partial(c_notation, "forward"), key="x", **_C_WAY, post=_not_partial, check=_c,
                doc="c_softmax_with_cross_entropy reverse (Paddle has none): the inputs from softmax and loss."),
    outputs="softmax: T, loss: T",
)  # fmt: skip
declare(
    "c_softmax_with_cross_entropy_grad", f"softmax: T, label: T, loss_grad: T, {_C_ATTRS}",
    Way(partial(c_notation, "grad"), key="softmax", **_C_WAY, check=_c_grad_check,
        paddle="CSoftmaxWithCrossEntropyGradSpmd",
        doc="c_softmax_with_cross_entropy_grad (CSoftmaxWithCrossEntropyGradSpmd): softmax, label and loss_grad "
            "merged, x_grad as softmax (class axis sharded: each rank handles its own classes)."),
)  # fmt: skip


# -- mean_all -----------------------------------------------------------------------------------


def _one_element(out_grad: DistTensorSpec) -> None:
    if len(out_grad.shape) != 0 and any(s != 1 for s in out_grad.shape):
        raise ShapeMismatchError(f"out_grad must hold one element (0-d), got shape {list(out_grad.shape)}")


declare(
    "mean_all", "x: T",
    Way(lambda nd: Notation([letters_for(nd)], [""], reduce=ReduceType.AVG, prune="*", coshard=Coshard.LARGEST), key="x",
        paddle="MeanAllInferSpmd",
        doc="mean_all (MeanAllInferSpmd): a 0-d out, partial AVG over the mesh dims of x's (even) axes."),
    grad=Way(lambda nd, ng: Notation([BROADCAST * nd, BROADCAST * ng], [BROADCAST * nd]), key="x, out_grad",
             check=_one_element, paddle="MeanAllGradInferSpmd",
             doc="mean_all_grad (MeanAllGradInferSpmd): x, out_grad and x_grad replicated (the grad kernel "
                 "divides by the local element count)."),
    grad_signature="x: T, out_grad: T", grad_name="mean_all_grad",
)  # fmt: skip


# -- label_smooth -------------------------------------------------------------------------------


def smooth_notation(nd: int, pn: int, lm: int, pm: int) -> Notation:
    """label_smooth over label (rank ``nd``, size-1 axes ``lm``) and prior_dist (rank ``pn``,
    -1 absent; size-1 axes ``pm``), as the module docstring says (with prior_dist each co-shard
    read as its largest mesh dim)."""
    if nd == 0:
        raise ShapeMismatchError("label must have at least 1 dim (the class axis)")
    a = letters_for(nd)
    if pn < 0:
        return Notation([a, None], [a], replicated=a[-1], prune="*")
    la = "".join(BROADCAST if lm >> i & 1 else c for i, c in enumerate(a))
    pa = "".join(BROADCAST if pm >> i & 1 else a[nd - pn + i] for i in range(pn))
    return Notation([la, pa], [la], coshard=Coshard.LARGEST)


def _prior(label: DistTensorSpec, prior_dist: DistTensorSpec | None) -> None:
    """prior_dist broadcasts (from the right) onto label."""
    if prior_dist is None or not label.shape:
        return
    nd, pn = len(label.shape), len(prior_dist.shape)
    if pn > nd:
        raise ShapeMismatchError(f"prior_dist has {pn} dims, more than label's {nd}")
    for i, s in enumerate(prior_dist.shape):
        t = label.shape[nd - pn + i]
        if s != t and s != 1 and s >= 0 and t >= 0:
            raise ShapeMismatchError(f"prior_dist axis {i} has size {s}, which does not broadcast onto label's {t}")


def _lead_unread(fn: Callable[..., SpmdResult], signature: str, outputs: Any) -> Callable[..., SpmdResult]:
    """As Paddle, prior_dist's mesh dims that label's leading (extra) axes use (each co-shard
    read as its largest mesh dim) are dropped from prior_dist before the merge."""

    def label_smooth(label: DistTensorSpec, prior_dist: DistTensorSpec | None = None,
                     epsilon: float = 0.0) -> SpmdResult:  # fmt: skip
        if prior_dist is not None:
            off = len(label.shape) - len(prior_dist.shape)
            a = label.dist_attr
            lead = {d for e in one_mesh_dim(a.dims_mapping[:off], a.mesh.shape) for d in entry_dims(e)} if off > 0 else ()
            p = prior_dist.dist_attr
            if lead and any(d in lead for e in p.dims_mapping for d in entry_dims(e)):
                dm = tuple(_drop_dims(e, lead) for e in p.dims_mapping)
                prior_dist = DistTensorSpec(prior_dist.shape, make_attr(p.mesh, dm, p.partial))
        return fn(label, prior_dist, epsilon)

    label_smooth.__doc__ = fn.__doc__
    return label_smooth


def _drop_dims(e: Any, drop: set[int]) -> Any:
    d = tuple(x for x in entry_dims(e) if x not in drop)
    return -1 if not d else d[0] if len(d) == 1 else d


declare(
    "label_smooth", "label: T, prior_dist: T?, epsilon: float = 0.0",
    Way(smooth_notation, key="label, prior_dist, ones(label), ones(prior_dist)", check=_prior,
        wrap=_lead_unread, paddle="LabelSmoothInferSpmd",
        doc="LabelSmoothInferSpmd: elementwise with prior_dist; without it the class axis replicated."),
    grad=Way(lambda nd: Notation([letters_for(nd)], [letters_for(nd)]), key="out_grad",
             paddle="LabelSmoothGradInferSpmd",
             doc="LabelSmoothGradInferSpmd: out_grad and label_grad sharded as out_grad, not partial."),
    grad_signature="out_grad: T, epsilon: float = 0.0", grad_name="label_smooth_grad",
)  # fmt: skip


# -- c_softmax_with_multi_label_cross_entropy ------------------------------------------------------

_ML_ATTRS = "ignore_index: int = -100, sum_multi_label_loss: bool = True, rank: int = 0, nranks: int = 1"


def _ml_way(kind: str, check: Callable[..., None], paddle: str, doc: str, x: str = "x", **kw: Any) -> Way:
    """A mode of the multi-label loss keyed by the rank of x (``x``: its parameter) and
    sum_multi_label_loss; ``check``: label, smooth_weight and the others of x's rank."""
    return Way(partial(ml_notation, kind), key=f"{x}, bool(sum_multi_label_loss)", letters=True,
               require=("nranks >= 1",), check=check, paddle=paddle, doc=doc, **kw)  # fmt: skip


declare(
    "c_softmax_with_multi_label_cross_entropy", f"x: T, label: T, smooth_weight: T, {_ML_ATTRS}",
    _ml_way("forward", _ml_check, "CSoftmaxWithMultiLabelCrossEntropyInferSpmd", post=_ml_partial,
            doc="c_softmax_with_multi_label_cross_entropy (CSoftmaxWithMultiLabelCrossEntropyInferSpmd): batch axes "
                "merged, the class axis keeps its sharding, the label axis follows label and smooth_weight; the "
                "summed loss partial SUM over the label axis' mesh dims."),
    reverse=_ml_way("forward", _ml_reverse_check,
                    "CSoftmaxWithMultiLabelCrossEntropyInferSpmdReverse", post=_ml_partial,
                    doc="c_softmax_with_multi_label_cross_entropy reverse (Paddle has none): the inputs from softmax "
                        "and loss; the outputs those inputs produce."),
    outputs="softmax: T, loss: T",
)  # fmt: skip
declare(
    "c_softmax_with_multi_label_cross_entropy_grad", f"softmax: T, label: T, smooth_weight: T, loss_grad: T, {_ML_ATTRS}",
    _ml_way("grad", _ml_grad_check, "CSoftmaxWithMultiLabelCrossEntropyGradSpmd", x="softmax",
            doc="c_softmax_with_multi_label_cross_entropy_grad (CSoftmaxWithMultiLabelCrossEntropyGradSpmd): batch "
                "axes merged, the class axis keeps its sharding (each rank subtracts the labels in its class range), "
                "the label axis replicated; x_grad as softmax."),
)  # fmt: skip


# -- output shapes / grads ----------------------------------------------------------------------


def _cross_entropy_shape(a: Args) -> list[Expect]:
    """softmax like x; loss like x with the class axis 1."""
    x = a.s("x")
    if not x:
        raise UnknownShape
    ax = axis_of(a.a("axis", -1), len(x))
    return [x, (*x[:ax], 1, *x[ax + 1:])]


def _c_softmax_shape(a: Args) -> list[Expect]:
    x = a.s("x")
    if not x:
        raise UnknownShape
    return [x, (*x[:-1], 1)]


def _c_softmax_multi_label_shape(a: Args) -> list[Expect]:
    x, label = a.s("x"), a.s("label")
    if not label:
        raise UnknownShape
    return [x, (*label[:-1], 1) if a.a("sum_multi_label_loss", True) else label]


facts("cross_entropy_with_softmax", shape=_cross_entropy_shape, grad="cross_entropy_with_softmax_grad", wrt=("x",),
      grad_reads=(("softmax", "softmax_out"),))
facts("c_softmax_with_cross_entropy", shape=_c_softmax_shape, grad="c_softmax_with_cross_entropy_grad", wrt=("x",))
facts("c_softmax_with_multi_label_cross_entropy", shape=_c_softmax_multi_label_shape)
facts("label_smooth", shape=same)
facts("mean_all", shape=scalar)
facts("cross_entropy_with_softmax_grad", "c_softmax_with_cross_entropy_grad",
      "c_softmax_with_multi_label_cross_entropy_grad", grad_like=("softmax",))
facts("label_smooth_grad", grad_like=("=",))


# -- cost

_ML = "c_softmax_with_multi_label_cross_entropy"
#: memory-bound, nominal FLOPs per output element
facts("cross_entropy_with_softmax", "c_softmax_with_cross_entropy", _ML, cost=by_bytes(6))
facts("cross_entropy_with_softmax_grad", "c_softmax_with_cross_entropy_grad", _ML + "_grad", cost=by_bytes(2))
facts("label_smooth", "label_smooth_grad", "mean_all", "mean_all_grad", cost=one_per_element)
#: the vocab-parallel losses all-reduce over the ranks sharing the class axis (Megatron-LM's
#: vocab_parallel_cross_entropy, Paddle's c_softmax_with_cross_entropy kernel)
facts("c_softmax_with_cross_entropy", collectives=ClassAllReduces(
    (("row max of the logits", "max"), ("label logit", "sum"), ("sum of exp", "sum"))))
facts(_ML, collectives=ClassAllReduces(
    (("row max of the logits", "max"), ("label logits", "sum"), ("sum of exp", "sum")), rows_of="label"))
