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

                           replicated; nothing partial
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
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import make_attr, normalize_axis, one_mesh_dim, unpartial
from spmdkit.engine.declare import Answer, Way, declare, generate
from spmdkit.engine.notation import ALPHABET, BROADCAST, Notation, fast_result
from spmdkit.engine.registry import register
from spmdkit.rules._common import check_bool, check_int, check_ndim

# -- checks (the engine names the op where a message lacks it) -----------------------------------


def _letters(nd: int) -> None:
    if nd > len(ALPHABET):
        raise ShapeMismatchError(f"tensors of more than {len(ALPHABET)} dims are not supported")


def _hard_label(op: str, name: str, label: DistTensorSpec, nd: int, ax: int) -> None:
    if len(label.shape) != nd:
        raise ShapeMismatchError(f"{op}: {name} has {len(label.shape)} dims, expected {nd} (as the logits)")
    if label.shape[ax] not in (1, -1):
        raise ShapeMismatchError(
            f"{op}: {name}{' (a hard label)' if name == 'label' else ''} must have size 1 on the class axis {ax}, "
            f"got {label.shape[ax]}"
        )


def _ce(op: str, x: DistTensorSpec, label: DistTensorSpec, soft_label: object, use_softmax: object,
        numeric_stable_mode: object, ignore_index: object, axis: object, loss: DistTensorSpec | None = None,
        loss_name: str = "loss") -> None:  # fmt: skip
    """cross_entropy_with_softmax's attributes, label (and loss / loss_grad) against x (or softmax)."""
    nd = len(x.shape)
    _letters(nd)
    check_int(op, "axis", axis)
    if nd == 0:
        raise ShapeMismatchError(f"{op}: the logits must have at least 1 dim (got a 0-d tensor)")
    ax = normalize_axis(op, axis, nd)  # type: ignore[arg-type]
    soft = check_bool(op, "soft_label", soft_label)
    check_bool(op, "use_softmax", use_softmax)
    check_bool(op, "numeric_stable_mode", numeric_stable_mode)
    check_int(op, "ignore_index", ignore_index)
    if not soft:
        _hard_label(op, "label", label, nd, ax)
    elif len(label.shape) != nd:
        raise ShapeMismatchError(f"{op}: label (a soft label) has {len(label.shape)} dims, expected {nd}")
    if loss is not None:
        _hard_label(op, loss_name, loss, nd, ax)


def _c(op: str, x: DistTensorSpec, label: DistTensorSpec, ignore_index: object, rank: object, nranks: object,
       loss: DistTensorSpec | None = None, loss_name: str = "loss") -> None:  # fmt: skip
    """c_softmax_with_cross_entropy's attributes and hard label (and loss / loss_grad)."""
    nd = len(x.shape)
    if nd == 0:
        raise ShapeMismatchError(f"{op}: the logits must have at least 1 dim (got a 0-d tensor)")
    _letters(nd)
    check_int(op, "ignore_index", ignore_index)
    check_int(op, "rank", rank)
    if check_int(op, "nranks", nranks) < 1:
        raise InvalidAttributeError(f"{op}: nranks must be positive, got {nranks}")
    _hard_label(op, "label", label, nd, nd - 1)
    if loss is not None:
        _hard_label(op, loss_name, loss, nd, nd - 1)


def _ml(op: str, x: DistTensorSpec, label: DistTensorSpec, smooth_weight: DistTensorSpec, ignore_index: object,
        sum_multi_label_loss: object, rank: object, nranks: object, xname: str = "x",
        **more: DistTensorSpec) -> None:  # fmt: skip
    """c_softmax_with_multi_label_cross_entropy's attributes; label, smooth_weight (and ``more``)
    of x's rank."""
    nd = len(x.shape)
    if nd == 0:
        raise ShapeMismatchError(f"{op}: {xname} must have at least 1 dim (got a 0-d tensor)")
    if nd >= len(ALPHABET):
        raise ShapeMismatchError(f"{op}: tensors of more than {len(ALPHABET) - 1} dims are not supported")
    check_int(op, "ignore_index", ignore_index)
    check_bool(op, "sum_multi_label_loss", sum_multi_label_loss)
    check_int(op, "rank", rank)
    check_int(op, "nranks", nranks, 1)
    for name, t in (("label", label), ("smooth_weight", smooth_weight), *more.items()):
        check_ndim(op, name, t, nd)


_ENV: dict[str, Any] = {"_ce": _ce, "_c": _c, "_ml": _ml}


# -- notations ----------------------------------------------------------------------------------


def ce_notation(kind: str, nd: int, axis: int, soft: bool) -> Notation:
    """``abc, ab1 -> abc, ab1`` (x, label -> softmax, loss; a soft label ``abc``), the class
    axis replicated, each co-shard read as its largest mesh dim; the grad ``ab1, abc, ab1 ->
    abc`` (label, softmax, loss_grad -> x_grad); the reverse merges loss before softmax (its
    claims come first, as Paddle's reverse merge reads them)."""
    ax = normalize_axis("", axis, nd)
    x = ALPHABET[:nd]
    one = x[:ax] + BROADCAST + x[ax + 1 :]
    lab = x if soft else one
    if kind == "grad":
        return Notation([lab, x, one], [x], replicated=x[ax], coshard="largest")
    return Notation([x, lab], [one, x] if kind == "reverse" else [x, one], replicated=x[ax], coshard="largest")


def c_notation(kind: str, nd: int) -> Notation:
    """``abc, ab1 -> abc, ab1``: the class letter c may stay sharded (the kernel all-reduces max
    and sum over the ranks that share it); the grad ``abc, ab1, ab1 -> abc``."""
    x = ALPHABET[:nd]
    one = x[:-1] + BROADCAST
    if kind == "grad":
        return Notation([x, one, one], [x], coshard="largest")
    return Notation([x, one], [x, one], coshard="largest")


def ml_notation(kind: str, nd: int, summed: bool) -> Notation:
    """``abc, abd, abd -> abc, ab1 | abd`` (x, label, smooth_weight -> softmax, loss: ``ab1``
    summed over the labels); the grad ``abc, abd, abd, ab1 | abd -> abc`` with d replicated."""
    x = ALPHABET[:nd]
    lab = x[:-1] + ALPHABET[nd]
    loss = (x[:-1] + BROADCAST) if summed else lab
    if kind == "grad":
        return Notation([x, lab, lab, loss], [x], replicated=lab[-1], coshard="largest")
    return Notation([x, lab, lab], [x, loss], coshard="largest")


def _not_partial(ins: Any, outs: Any, *args: object) -> Answer:
    """c_softmax_with_cross_entropy: the kernel all-reduces the loss, never partial."""
    return ins, tuple(unpartial(a) for a in outs)


def _ml_partial(ins: Any, outs: Any, *args: Any) -> Answer:
    """softmax never partial (the kernel all-reduces over c); the summed loss partial SUM over
    the mesh dims of the label axis d (each rank sums its own labels), otherwise not partial."""
    summed = args[-3]
    loss = outs[1]
    pt = tuple((d, ReduceType.SUM) for d in sorted(entry_dims(ins[1].dims_mapping[-1]))) if summed else ()
    return ins, (unpartial(outs[0]), make_attr(loss.mesh, loss.dims_mapping, pt))


def _swapped(fn, signature, outputs):  # type: ignore[no-untyped-def]
    """cross_entropy_with_softmax's reverse: generated over (x, label, loss, softmax_out) so that
    loss's claims come first; called in Paddle's order and answered in it."""

    def reverse(x: DistTensorSpec, label: DistTensorSpec, softmax_out: DistTensorSpec, loss: DistTensorSpec,
                *attrs: object) -> SpmdResult:  # fmt: skip
        r = fn(x, label, loss, softmax_out, *attrs)
        return fast_result(r.inputs, r.outputs[::-1])

    reverse.__doc__ = fn.__doc__
    return reverse


# -- cross_entropy_with_softmax, c_softmax_with_cross_entropy ----------------------------------

_CE_ATTRS = ("soft_label: bool = False, use_softmax: bool = True, numeric_stable_mode: bool = True, "
             "ignore_index: int = -100, axis: int = -1")
_CE_CALL = "soft_label, use_softmax, numeric_stable_mode, ignore_index, axis"
_CE = Way(partial(ce_notation, "forward"), key="x, axis, soft_label", letters=True, env=_ENV,
          check=f"_ce(_OP, x, label, {_CE_CALL})", paddle="CrossEntropyWithSoftmaxInferSpmdStatic",
          doc="cross_entropy_with_softmax (CrossEntropyWithSoftmaxInferSpmdStatic): batch axes merged, the class "
              "axis replicated; softmax as x, loss as x with the class axis of size 1.")
_CE_REV = Way(partial(ce_notation, "reverse"), key="x, axis, soft_label", letters=True, env=_ENV, wrap=_swapped,
              check=f"_ce(_OP, x, label, {_CE_CALL}, loss)", paddle="CrossEntropyWithSoftmaxInferSpmdReverse",
              doc="cross_entropy_with_softmax (CrossEntropyWithSoftmaxInferSpmdReverse): the inputs from softmax "
                  "and loss (class axis replicated); the outputs those inputs produce.")
register(
    "cross_entropy_with_softmax", generate("cross_entropy_with_softmax", f"x: T, label: T, {_CE_ATTRS}", _CE,
                                           name="ce_forward"),
    f"x: T, label: T, {_CE_ATTRS}",
    generate("cross_entropy_with_softmax", f"x: T, label: T, loss: T, softmax_out: T, {_CE_ATTRS}", _CE_REV,
             "backward", ("loss", "softmax_out"), name="ce_reverse"),
    kind="reverse", outputs="softmax_out: T, loss: T", aliases=("softmax_with_cross_entropy",),
    forward_name=_CE.paddle, backward_name=_CE_REV.paddle,
)  # fmt: skip
declare(
    "cross_entropy_with_softmax_grad", f"label: T, softmax: T, loss_grad: T, {_CE_ATTRS}",
    Way(partial(ce_notation, "grad"), key="softmax, axis, soft_label", letters=True, env=_ENV,
        check=f"_ce(_OP, softmax, label, {_CE_CALL}, loss_grad, 'loss_grad')",
        paddle="CrossEntropyWithSoftmaxGradInferSpmd",
        doc="cross_entropy_with_softmax_grad (CrossEntropyWithSoftmaxGradInferSpmd): label, softmax and loss_grad "
            "merged on the batch axes, the class axis replicated; x_grad as softmax."),
    aliases=("softmax_with_cross_entropy_grad",),
)  # fmt: skip
_C_ATTRS = "ignore_index: int = -100, rank: int = 0, nranks: int = 1"
declare(
    "c_softmax_with_cross_entropy", f"x: T, label: T, {_C_ATTRS}",
    Way(partial(c_notation, "forward"), key="x", letters=True, env=_ENV, post=_not_partial,
        check="_c(_OP, x, label, ignore_index, rank, nranks)", paddle="CSoftmaxWithCrossEntropyInferSpmd",
        doc="c_softmax_with_cross_entropy (CSoftmaxWithCrossEntropyInferSpmd): the class axis (last) keeps its "
            "sharding (the kernel reduces over it), label follows x's batch axes; loss not partial."),
    reverse=Way(partial(c_notation, "forward"), key="x", letters=True, env=_ENV, post=_not_partial,
                check="_c(_OP, x, label, ignore_index, rank, nranks, loss)",
                doc="c_softmax_with_cross_entropy reverse (Paddle has none): the inputs from softmax and loss."),
    outputs="softmax: T, loss: T",
)  # fmt: skip
declare(
    "c_softmax_with_cross_entropy_grad", f"softmax: T, label: T, loss_grad: T, {_C_ATTRS}",
    Way(partial(c_notation, "grad"), key="softmax", letters=True, env=_ENV,
        check="_c(_OP, softmax, label, ignore_index, rank, nranks, loss_grad, 'loss_grad')",
        paddle="CSoftmaxWithCrossEntropyGradSpmd",
        doc="c_softmax_with_cross_entropy_grad (CSoftmaxWithCrossEntropyGradSpmd): softmax, label and loss_grad "
            "merged, x_grad as softmax (class axis sharded: each rank handles its own classes)."),
)  # fmt: skip


# -- mean_all -----------------------------------------------------------------------------------


def _one_element(out_grad: DistTensorSpec) -> None:
    if len(out_grad.shape) != 0 and any(s != 1 for s in out_grad.shape):
        raise ShapeMismatchError(f"out_grad must hold one element (0-d), got shape {list(out_grad.shape)}")


def _mean_all(nd: int) -> Notation:
    """``ab -> (0-d)``: partial AVG over the mesh dims of x's axes, uneven ones dropped (local
    means average to the mean only where every rank holds as many elements)."""
    _letters(nd)
    return Notation([ALPHABET[:nd]], [""], reduce=ReduceType.AVG, prune="*", coshard="largest")


declare(
    "mean_all", "x: T",
    Way(_mean_all, key="x", paddle="MeanAllInferSpmd",
        doc="mean_all (MeanAllInferSpmd): a 0-d out, partial AVG over the mesh dims of x's (even) axes."),
    grad=Way(lambda nd, ng: Notation([BROADCAST * nd, BROADCAST * ng], [BROADCAST * nd]), key="x, out_grad",
             check="_one_element(out_grad)", env={"_one_element": _one_element}, paddle="MeanAllGradInferSpmd",
             doc="mean_all_grad (MeanAllGradInferSpmd): x, out_grad and x_grad replicated (the grad kernel "
                 "divides by the local element count)."),
    grad_signature="x: T, out_grad: T", grad_name="mean_all_grad",
)  # fmt: skip


# -- label_smooth -------------------------------------------------------------------------------


def smooth_notation(nd: int, pn: int, lm: int, pm: int) -> Notation:
    """label_smooth over label (rank ``nd``, size-1 axes ``lm``) and prior_dist (rank ``pn``,
    -1 absent; size-1 axes ``pm``): with prior_dist an elementwise binary op (right-aligned
    letters, a size-1 axis ``1``: never sharded, as Paddle's elementwise rules), each co-shard
    read as its largest mesh dim; without it ``abc, _ -> abc`` with the class axis replicated
    (the kernel adds epsilon / the class count it sees) and elsewhere, as Paddle's elementwise
    unary rule, the mesh dims that do not divide an axis dropped (minor first)."""
    if nd == 0:
        raise ShapeMismatchError("label must have at least 1 dim (the class axis)")
    _letters(nd)
    a = ALPHABET[:nd]
    if pn < 0:
        return Notation([a, None], [a], replicated=a[-1], prune="*")
    la = "".join(BROADCAST if lm >> i & 1 else c for i, c in enumerate(a))
    pa = "".join(BROADCAST if pm >> i & 1 else a[nd - pn + i] for i in range(pn))
    return Notation([la, pa], [la], coshard="largest")


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


def _as_out_grad(nd: int) -> Notation:
    """``abc -> abc``: sharded as out_grad, not partial."""
    _letters(nd)
    return Notation([ALPHABET[:nd]], [ALPHABET[:nd]])


declare(
    "label_smooth", "label: T, prior_dist: T?, epsilon: float = 0.0",
    Way(smooth_notation, key="label, prior_dist, ones(label), ones(prior_dist)", check="_prior(label, prior_dist)",
        env={"_prior": _prior}, wrap=_lead_unread, paddle="LabelSmoothInferSpmd",
        doc="LabelSmoothInferSpmd: elementwise with prior_dist; without it the class axis replicated."),
    grad=Way(_as_out_grad, key="out_grad", paddle="LabelSmoothGradInferSpmd",
             doc="LabelSmoothGradInferSpmd: out_grad and label_grad sharded as out_grad, not partial."),
    grad_signature="out_grad: T, epsilon: float = 0.0", grad_name="label_smooth_grad",
)  # fmt: skip


# -- c_softmax_with_multi_label_cross_entropy ------------------------------------------------------

_ML_ATTRS = "ignore_index: int = -100, sum_multi_label_loss: bool = True, rank: int = 0, nranks: int = 1"


def _ml_way(kind: str, check: str, paddle: str, doc: str, x: str = "x", **kw: Any) -> Way:
    """A mode of the multi-label loss keyed by the rank of x (``x``: its parameter) and
    sum_multi_label_loss; ``check``: what :func:`_ml` checks besides the attributes."""
    return Way(partial(ml_notation, kind), key=f"{x}, bool(sum_multi_label_loss)", letters=True, env=_ENV,
               check=f"_ml(_OP, {x}, label, smooth_weight, ignore_index, sum_multi_label_loss, rank, nranks{check})",
               paddle=paddle, doc=doc, **kw)  # fmt: skip


declare(
    "c_softmax_with_multi_label_cross_entropy", f"x: T, label: T, smooth_weight: T, {_ML_ATTRS}",
    _ml_way("forward", "", "CSoftmaxWithMultiLabelCrossEntropyInferSpmd", post=_ml_partial,
            doc="c_softmax_with_multi_label_cross_entropy (CSoftmaxWithMultiLabelCrossEntropyInferSpmd): batch axes "
                "merged, the class axis keeps its sharding, the label axis follows label and smooth_weight; the "
                "summed loss partial SUM over the label axis' mesh dims."),
    reverse=_ml_way("forward", ", softmax=softmax, loss=loss", "CSoftmaxWithMultiLabelCrossEntropyInferSpmdReverse",
                    post=_ml_partial, doc="c_softmax_with_multi_label_cross_entropy reverse (Paddle has none): the "
                    "inputs from softmax and loss; the outputs those inputs produce."),
    outputs="softmax: T, loss: T",
)  # fmt: skip
declare(
    "c_softmax_with_multi_label_cross_entropy_grad", f"softmax: T, label: T, smooth_weight: T, loss_grad: T, {_ML_ATTRS}",
    _ml_way("grad", ", 'softmax', loss_grad=loss_grad", "CSoftmaxWithMultiLabelCrossEntropyGradSpmd", x="softmax",
            doc="c_softmax_with_multi_label_cross_entropy_grad (CSoftmaxWithMultiLabelCrossEntropyGradSpmd): batch "
                "axes merged, the class axis keeps its sharding (each rank subtracts the labels in its class range), "
                "the label axis replicated; x_grad as softmax."),
)  # fmt: skip
