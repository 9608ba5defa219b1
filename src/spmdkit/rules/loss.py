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

from collections.abc import Mapping
from functools import lru_cache

from spmdkit.core.dist_attr import Entry, ReduceType, TensorDistAttr, entry_dims
from spmdkit.core.errors import InvalidAttributeError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import normalize_axis, one_mesh_dim_per_axis, one_mesh_dim_specs
from spmdkit.engine.compile import Plan, compile_plan, infer
from spmdkit.engine.memo import memo
from spmdkit.engine.notation import (
    ALPHABET,
    BROADCAST,
    Notation,
    check_letters,
    common_mesh,
    einsum_forward,
    fast_result,
    merge_specs,
    named_mesh,
    project_all,
)
from spmdkit.rules._common import (
    check_bool,
    check_int,
    check_ndim,
    forward_largest,
    letter_attr,
    merge_one_dim,
    merge_project,
)
from spmdkit.rules.registry import register

Shape = tuple[int, ...]

_make = TensorDistAttr.unchecked


def _axis(op: str, axis: object, ndim: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise InvalidAttributeError(f"{op}: axis must be an int, got {axis!r}")
    if ndim == 0:
        raise ShapeMismatchError(f"{op}: the logits must have at least 1 dim (got a 0-d tensor)")
    return normalize_axis(op, axis, ndim)


def _bool(op: str, name: str, v: object) -> bool:
    if not isinstance(v, (bool, int)):
        raise InvalidAttributeError(f"{op}: {name} must be a bool, got {v!r}")
    return bool(v)


def _int(op: str, name: str, v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidAttributeError(f"{op}: {name} must be an int, got {v!r}")
    return v


def _letters(op: str, nd: int) -> str:
    if nd > len(ALPHABET):
        raise ShapeMismatchError(f"{op}: tensors of more than {len(ALPHABET)} dims are not supported")
    return ALPHABET[:nd]


def _hard_label(op: str, name: str, label: DistTensorSpec, nd: int, ax: int) -> None:
    if len(label.shape) != nd:
        raise ShapeMismatchError(f"{op}: {name} has {len(label.shape)} dims, expected {nd} (as the logits)")
    if label.shape[ax] not in (1, -1):
        raise ShapeMismatchError(
            f"{op}: {name}{' (a hard label)' if name == 'label' else ''} must have size 1 on the class axis {ax}, "
            f"got {label.shape[ax]}"
        )


@memo()
def _ce_axes(nd: int, ax: int, soft: bool) -> tuple[str, str, str]:
    """(logits axes, label axes, loss axes)."""
    full = ALPHABET[:nd]
    one = full[:ax] + BROADCAST + full[ax + 1 :]
    return full, full if soft else one, one


@memo()
def _ce_notation(nd: int, ax: int, soft: bool) -> Notation:
    x, lab, loss = _ce_axes(nd, ax, soft)
    return Notation([x, lab], [x, loss], replicated=x[ax])


@memo()
def _ce_grad_notation(nd: int, ax: int, soft: bool) -> Notation:
    x, lab, loss = _ce_axes(nd, ax, soft)
    return Notation([lab, x, loss], [x], replicated=x[ax])


def _ce_attrs(op: str, x: DistTensorSpec, soft_label: object, use_softmax: object, numeric_stable_mode: object,
              ignore_index: object, axis: object) -> tuple[int, bool]:
    _letters(op, len(x.shape))
    ax = _axis(op, axis, len(x.shape))
    soft = _bool(op, "soft_label", soft_label)
    _bool(op, "use_softmax", use_softmax)
    _bool(op, "numeric_stable_mode", numeric_stable_mode)
    _int(op, "ignore_index", ignore_index)
    return ax, soft


def _check_label(op: str, name: str, label: DistTensorSpec, nd: int, ax: int, soft: bool) -> None:
    if soft:
        if len(label.shape) != nd:
            raise ShapeMismatchError(f"{op}: {name} (a soft label) has {len(label.shape)} dims, expected {nd}")
    else:
        _hard_label(op, name, label, nd, ax)


def ce_forward(x: DistTensorSpec, label: DistTensorSpec, soft_label: bool = False, use_softmax: bool = True,
               numeric_stable_mode: bool = True, ignore_index: int = -100, axis: int = -1) -> SpmdResult:
    """cross_entropy_with_softmax (CrossEntropyWithSoftmaxInferSpmdStatic): batch axes merged,
    the class axis replicated; softmax as x, loss as x with the class axis of size 1."""
    op = "cross_entropy_with_softmax"
    ax, soft = _ce_attrs(op, x, soft_label, use_softmax, numeric_stable_mode, ignore_index, axis)
    _check_label(op, "label", label, len(x.shape), ax, soft)
    return forward_largest(op, _ce_notation(len(x.shape), ax, soft), [x, label], ["x", "label"])


def ce_backward(x: DistTensorSpec, label: DistTensorSpec, softmax_out: DistTensorSpec, loss: DistTensorSpec,
                soft_label: bool = False, use_softmax: bool = True, numeric_stable_mode: bool = True,
                ignore_index: int = -100, axis: int = -1) -> SpmdResult:
    """cross_entropy_with_softmax (CrossEntropyWithSoftmaxInferSpmdReverse): the inputs from
    softmax and loss (class axis replicated); the outputs those inputs produce."""
    op = "cross_entropy_with_softmax"
    nd = len(x.shape)
    ax, soft = _ce_attrs(op, x, soft_label, use_softmax, numeric_stable_mode, ignore_index, axis)
    _check_label(op, "label", label, nd, ax, soft)
    _hard_label(op, "loss", loss, nd, ax)
    x, label, softmax_out, loss = one_mesh_dim_specs(x, label, softmax_out, loss)
    n = _ce_notation(nd, ax, soft)
    specs = (x, label, softmax_out, loss)
    mesh = common_mesh(op, specs)
    check_letters(op, (*n.inputs, *n.outputs), specs, ("x", "label", "softmax_out", "loss"))
    # loss claims its mesh dims before softmax_out (as Paddle's reverse merge does)
    merged = merge_specs(n, (n.outputs[1], n.outputs[0]), (loss, softmax_out), mesh)
    ins, outs = project_all(n, tuple((c, d) for c, d in merged if c != _ce_axes(nd, ax, soft)[0][ax]), mesh)
    return fast_result(tuple(ins), tuple(outs))


def ce_grad(label: DistTensorSpec, softmax: DistTensorSpec, loss_grad: DistTensorSpec, soft_label: bool = False,
            use_softmax: bool = True, numeric_stable_mode: bool = True, ignore_index: int = -100,
            axis: int = -1) -> SpmdResult:
    """cross_entropy_with_softmax_grad (CrossEntropyWithSoftmaxGradInferSpmd): label, softmax and
    loss_grad merged on the batch axes, the class axis replicated; x_grad as softmax."""
    op = "cross_entropy_with_softmax_grad"
    nd = len(softmax.shape)
    ax, soft = _ce_attrs(op, softmax, soft_label, use_softmax, numeric_stable_mode, ignore_index, axis)
    _check_label(op, "label", label, nd, ax, soft)
    _hard_label(op, "loss_grad", loss_grad, nd, ax)
    return forward_largest(op, _ce_grad_notation(nd, ax, soft), [label, softmax, loss_grad], ["label", "softmax", "loss_grad"])


# -- c_softmax_with_cross_entropy: the class axis may stay sharded (a communicating kernel) -----


@memo()
def _c_notation(nd: int) -> Notation:
    x, _, one = _ce_axes(nd, nd - 1, False)
    return Notation([x, one], [x, one])


@memo()
def _c_grad_notation(nd: int) -> Notation:
    x, _, one = _ce_axes(nd, nd - 1, False)
    return Notation([x, one, one], [x])


def _c_attrs(op: str, x: DistTensorSpec, ignore_index: object, rank: object, nranks: object) -> int:
    nd = len(x.shape)
    if nd == 0:
        raise ShapeMismatchError(f"{op}: the logits must have at least 1 dim (got a 0-d tensor)")
    _letters(op, nd)
    _int(op, "ignore_index", ignore_index)
    _int(op, "rank", rank)
    if _int(op, "nranks", nranks) < 1:
        raise InvalidAttributeError(f"{op}: nranks must be positive, got {nranks}")
    return nd


def _no_partial(outs: list[TensorDistAttr | None]) -> tuple[TensorDistAttr | None, ...]:
    """The loss is all-reduced by the kernel: never partial."""
    return tuple(None if a is None else _make(a.mesh, a.dims_mapping) if a.partial else a for a in outs)


def c_softmax_forward(x: DistTensorSpec, label: DistTensorSpec, ignore_index: int = -100, rank: int = 0,
                      nranks: int = 1) -> SpmdResult:
    """c_softmax_with_cross_entropy (CSoftmaxWithCrossEntropyInferSpmd): the class axis (last)
    keeps its sharding (the kernel reduces over it), label follows x's batch axes; loss not partial."""
    op = "c_softmax_with_cross_entropy"
    nd = _c_attrs(op, x, ignore_index, rank, nranks)
    _hard_label(op, "label", label, nd, nd - 1)
    x, label = one_mesh_dim_specs(x, label)
    ins, outs = einsum_forward(op, _c_notation(nd), [x, label], ["x", "label"])
    return fast_result(tuple(ins), _no_partial(outs))


def c_softmax_reverse(x: DistTensorSpec, label: DistTensorSpec, softmax: DistTensorSpec, loss: DistTensorSpec,
                       ignore_index: int = -100, rank: int = 0, nranks: int = 1) -> SpmdResult:
    """c_softmax_with_cross_entropy reverse (Paddle has none): the inputs from softmax and loss."""
    op = "c_softmax_with_cross_entropy"
    nd = _c_attrs(op, x, ignore_index, rank, nranks)
    _hard_label(op, "label", label, nd, nd - 1)
    _hard_label(op, "loss", loss, nd, nd - 1)
    n = _c_notation(nd)
    specs = tuple(one_mesh_dim_specs(x, label, softmax, loss))
    mesh = common_mesh(op, specs)
    check_letters(op, (*n.inputs, *n.outputs), specs, ("x", "label", "softmax", "loss"))
    merged = merge_specs(n, n.outputs, specs[2:], mesh)
    ins, outs = project_all(n, merged, mesh)
    return fast_result(tuple(ins), _no_partial(outs))


def _make_c_grad(op: str):  # type: ignore[no-untyped-def]
    def grad(softmax: DistTensorSpec, label: DistTensorSpec, loss_grad: DistTensorSpec, ignore_index: int = -100,
             rank: int = 0, nranks: int = 1) -> SpmdResult:
        nd = _c_attrs(op, softmax, ignore_index, rank, nranks)
        _hard_label(op, "label", label, nd, nd - 1)
        _hard_label(op, "loss_grad", loss_grad, nd, nd - 1)
        softmax, label, loss_grad = one_mesh_dim_specs(softmax, label, loss_grad)
        ins, outs = einsum_forward(op, _c_grad_notation(nd), [softmax, label, loss_grad],
                                   ["softmax", "label", "loss_grad"])
        return fast_result(tuple(ins), tuple(outs))

    grad.__name__ = op
    grad.__doc__ = (f"{op} (CSoftmaxWithCrossEntropyGradSpmd): softmax, label and loss_grad merged, "
                    "x_grad as softmax (class axis sharded: each rank handles its own classes).")
    return grad


# -- mean_all -----------------------------------------------------------------------------------


@memo()
def _mean_notation(nd: int) -> Notation:
    return Notation([ALPHABET[:nd]], [""], reduce=ReduceType.AVG, prune="*")


def mean_all_forward(x: DistTensorSpec) -> SpmdResult:
    """mean_all (MeanAllInferSpmd): a 0-d out, partial AVG over the mesh dims of x's (even) axes."""
    op = "mean_all"
    (x,) = one_mesh_dim_specs(x)
    ins, outs = einsum_forward(op, _mean_notation(len(_letters(op, len(x.shape)))), [x], ["x"])
    return fast_result(tuple(ins), tuple(outs))


@lru_cache(maxsize=64)
def _mean_grad_plan(nd: int, ng: int) -> Plan:
    """``11, 1 -> 11``: x, out_grad and x_grad all unsharded."""
    return compile_plan(Notation([BROADCAST * nd, BROADCAST * ng], [BROADCAST * nd]))


def _make_mean_grad(op: str):  # type: ignore[no-untyped-def]
    def grad(x: DistTensorSpec, out_grad: DistTensorSpec) -> SpmdResult:
        if len(out_grad.shape) != 0 and any(s != 1 for s in out_grad.shape):
            raise ShapeMismatchError(f"{op}: out_grad must hold one element (0-d), got shape {list(out_grad.shape)}")
        mesh = common_mesh(op, (x, out_grad))
        return fast_result(*infer(_mean_grad_plan(len(x.shape), len(out_grad.shape)), op, (x, out_grad), (), mesh))

    grad.__name__ = op
    grad.__doc__ = f"{op} (MeanAllGradInferSpmd): x, out_grad and x_grad replicated."
    return grad


register(
    "cross_entropy_with_softmax", ce_forward,
    "x: T, label: T, soft_label: bool = False, use_softmax: bool = True, numeric_stable_mode: bool = True, "
    "ignore_index: int = -100, axis: int = -1",
    ce_backward,
    kind="reverse", outputs="softmax_out: T, loss: T",
    aliases=("softmax_with_cross_entropy",), forward_name="CrossEntropyWithSoftmaxInferSpmdStatic",
    backward_name="CrossEntropyWithSoftmaxInferSpmdReverse",
)  # fmt: skip
register(
    "cross_entropy_with_softmax_grad", ce_grad,
    "label: T, softmax: T, loss_grad: T, soft_label: bool = False, use_softmax: bool = True, "
    "numeric_stable_mode: bool = True, ignore_index: int = -100, axis: int = -1",
    aliases=("softmax_with_cross_entropy_grad",), forward_name="CrossEntropyWithSoftmaxGradInferSpmd",
)  # fmt: skip
register(
    "c_softmax_with_cross_entropy", c_softmax_forward,
    "x: T, label: T, ignore_index: int = -100, rank: int = 0, nranks: int = 1",
    c_softmax_reverse,
    kind="reverse", outputs="softmax: T, loss: T",
    forward_name="CSoftmaxWithCrossEntropyInferSpmd",
)  # fmt: skip
register(
    "c_softmax_with_cross_entropy_grad", _make_c_grad("c_softmax_with_cross_entropy_grad"),
    "softmax: T, label: T, loss_grad: T, ignore_index: int = -100, rank: int = 0, nranks: int = 1",
    forward_name="CSoftmaxWithCrossEntropyGradSpmd",
)  # fmt: skip
register(
    "mean_all", mean_all_forward, "x: T", _make_mean_grad("mean_all"), "x: T, out_grad: T", kind="grad",
    forward_name="MeanAllInferSpmd", backward_name="MeanAllGradInferSpmd",
)  # fmt: skip
register(
    "mean_all_grad", _make_mean_grad("mean_all_grad"), "x: T, out_grad: T", forward_name="MeanAllGradInferSpmd",
)  # fmt: skip


# ---------------------------------------------------------------------------
# label_smooth
# ---------------------------------------------------------------------------


@memo()
def _label_axes(l_shape: Shape, p_shape: Shape) -> tuple[str, str]:
    """Right-aligned broadcast letters; a size-1 axis is ``1`` (never sharded, as in Paddle's
    elementwise rules)."""
    nd = len(l_shape)
    s = "".join(BROADCAST if v == 1 else c for v, c in zip(l_shape, ALPHABET[:nd]))
    off = nd - len(p_shape)
    p = "".join(BROADCAST if p_shape[i] == 1 else ALPHABET[off + i] for i in range(len(p_shape)))
    return s, p


def label_smooth_forward(label: DistTensorSpec, prior_dist: DistTensorSpec | None = None,
                         epsilon: float = 0.0) -> SpmdResult:
    """LabelSmoothInferSpmd: elementwise with prior_dist; without it the class axis replicated."""
    op = "label_smooth"
    nd = len(label.shape)
    if nd == 0:
        raise ShapeMismatchError(f"{op}: label must have at least 1 dim (the class axis)")
    if nd > len(ALPHABET):
        raise ShapeMismatchError(f"{op}: tensors of more than {len(ALPHABET)} dims are not supported")
    if prior_dist is None:
        return fast_result(*infer(_unary_plan(nd), op, (label, None), (), label.dist_attr.mesh, ("label", "prior_dist")))
    mesh = named_mesh(op, (("label", label), ("prior_dist", prior_dist)))
    pn = len(prior_dist.shape)
    if pn > nd:
        raise ShapeMismatchError(f"{op}: prior_dist has {pn} dims, more than label's {nd}")
    off = nd - pn
    for i, s in enumerate(prior_dist.shape):
        t = label.shape[off + i]
        if s != t and s != 1 and s >= 0 and t >= 0:
            raise ShapeMismatchError(
                f"{op}: prior_dist axis {i} has size {s}, which does not broadcast onto label's {t}"
            )
    la, pa = _label_axes(label.shape, prior_dist.shape)
    # Paddle drops prior_dist's mesh dims that label's leading (extra) axes use
    label = one_mesh_dim_per_axis(label)
    lead = {d for e in label.dist_attr.dims_mapping[:off] for d in entry_dims(e)}
    pdm = prior_dist.dist_attr.dims_mapping
    if lead:
        pdm = tuple(_drop_dims(e, lead) for e in pdm)
    p2 = one_mesh_dim_per_axis(DistTensorSpec(prior_dist.shape, _make(mesh, pdm)))
    n = _label_notation(la, pa)
    ins, outs = merge_project(n, (la, pa), (label, p2), mesh)
    return fast_result(tuple(ins), tuple(outs))


@lru_cache(maxsize=64)
def _unary_plan(nd: int) -> Plan:
    """label_smooth without prior_dist, ``abc, _ -> abc``: the class axis replicated; elsewhere,
    as Paddle's elementwise unary rule, the mesh dims that do not divide an axis dropped (minor
    first)."""
    a = ALPHABET[:nd]
    return compile_plan(Notation([a, None], [a], replicated=a[-1], prune="*"))


def _drop_dims(e: Entry, drop: set[int]) -> Entry:
    d = tuple(x for x in entry_dims(e) if x not in drop)
    return -1 if not d else d[0] if len(d) == 1 else d


@memo()
def _label_notation(la: str, pa: str) -> Notation:
    return Notation((la, pa), (la,))


def label_smooth_grad(out_grad: DistTensorSpec, epsilon: float = 0.0) -> SpmdResult:
    """LabelSmoothGradInferSpmd: out_grad and label_grad sharded as out_grad, not partial."""
    p = _same_plan(len(out_grad.shape))
    return fast_result(*infer(p, "label_smooth_grad", (out_grad,), (), out_grad.dist_attr.mesh, ("out_grad",)))


@lru_cache(maxsize=64)
def _same_plan(nd: int) -> Plan:
    """``abc -> abc``: sharded as the input, not partial."""
    a = _letters("label_smooth_grad", nd)
    return compile_plan(Notation([a], [a]))




register("label_smooth", label_smooth_forward, "label: T, prior_dist: T?, epsilon: float = 0.0",
         label_smooth_grad, "out_grad: T, epsilon: float = 0.0", kind="grad", grad_name="label_smooth_grad",
         forward_name="LabelSmoothInferSpmd", backward_name="LabelSmoothGradInferSpmd")  # fmt: skip


# -- c_softmax_with_multi_label_cross_entropy ------------------------------------------------------


@memo()
def _ml_axes(nd: int, summed: bool) -> tuple[str, str, str]:
    """(x axes, label / smooth_weight axes, loss axes)."""
    x = ALPHABET[:nd]
    lab = x[:-1] + ALPHABET[nd]
    return x, lab, (x[:-1] + BROADCAST) if summed else lab


@memo()
def _ml_notation(nd: int, summed: bool) -> Notation:
    x, lab, loss = _ml_axes(nd, summed)
    return Notation([x, lab, lab], [x, loss])


@memo()
def _ml_grad_notation(nd: int, summed: bool) -> Notation:
    x, lab, loss = _ml_axes(nd, summed)
    return Notation([x, lab, lab, loss], [x], replicated=lab[-1])


def _ml_checks(op: str, x: DistTensorSpec, label: DistTensorSpec, smooth_weight: DistTensorSpec,
               ignore_index: object, sum_multi_label_loss: object, rank: object, nranks: object,
               xname: str = "x") -> tuple[int, bool]:
    nd = len(x.shape)
    if nd == 0:
        raise ShapeMismatchError(f"{op}: {xname} must have at least 1 dim (got a 0-d tensor)")
    if nd >= len(ALPHABET):
        raise ShapeMismatchError(f"{op}: tensors of more than {len(ALPHABET) - 1} dims are not supported")
    check_int(op, "ignore_index", ignore_index)
    summed = check_bool(op, "sum_multi_label_loss", sum_multi_label_loss)
    check_int(op, "rank", rank)
    check_int(op, "nranks", nranks, 1)
    check_ndim(op, "label", label, nd)
    check_ndim(op, "smooth_weight", smooth_weight, nd)
    return nd, summed


def _ml_outputs(mesh: ProcessMesh, letters: Mapping[str, tuple[int, ...]], nd: int, summed: bool
                ) -> tuple[TensorDistAttr | None, ...]:
    x, lab, loss = _ml_axes(nd, summed)
    # softmax never partial (the kernel all-reduces over c); the summed loss is partial over the
    # mesh dims of the label axis d (each rank sums its own labels)
    return (letter_attr(mesh, x, letters), letter_attr(mesh, loss, letters, lab[-1] if summed else ""))


def ml_forward(x: DistTensorSpec, label: DistTensorSpec, smooth_weight: DistTensorSpec, ignore_index: int = -100,
               sum_multi_label_loss: bool = True, rank: int = 0, nranks: int = 1) -> SpmdResult:
    """c_softmax_with_multi_label_cross_entropy (CSoftmaxWithMultiLabelCrossEntropyInferSpmd):
    batch axes merged, the class axis keeps its sharding, the label axis follows label and
    smooth_weight; the summed loss partial SUM over the label axis' mesh dims."""
    op = "c_softmax_with_multi_label_cross_entropy"
    nd, summed = _ml_checks(op, x, label, smooth_weight, ignore_index, sum_multi_label_loss, rank, nranks)
    n = _ml_notation(nd, summed)
    specs = (x, label, smooth_weight)
    names = ("x", "label", "smooth_weight")
    mesh = named_mesh(op, zip(names, specs))
    letters = merge_one_dim(op, n, n.inputs, specs, names, mesh)
    ins = tuple(letter_attr(mesh, a, letters) for a in n.inputs)
    return fast_result(ins, _ml_outputs(mesh, letters, nd, summed))


def ml_reverse(x: DistTensorSpec, label: DistTensorSpec, smooth_weight: DistTensorSpec, softmax: DistTensorSpec,
               loss: DistTensorSpec, ignore_index: int = -100, sum_multi_label_loss: bool = True, rank: int = 0,
               nranks: int = 1) -> SpmdResult:
    """c_softmax_with_multi_label_cross_entropy reverse (Paddle has none): the inputs from softmax
    and loss; the outputs those inputs produce."""
    op = "c_softmax_with_multi_label_cross_entropy"
    nd, summed = _ml_checks(op, x, label, smooth_weight, ignore_index, sum_multi_label_loss, rank, nranks)
    n = _ml_notation(nd, summed)
    check_ndim(op, "softmax", softmax, nd)
    check_ndim(op, "loss", loss, nd)
    specs = (x, label, smooth_weight, softmax, loss)
    names = ("x", "label", "smooth_weight", "softmax", "loss")
    mesh = named_mesh(op, zip(names, specs))
    check_letters(op, (*n.inputs, *n.outputs), specs, names)
    letters = dict(merge_specs(n, n.outputs, one_mesh_dim_specs(*specs[3:]), mesh))
    ins = tuple(letter_attr(mesh, a, letters) for a in n.inputs)
    return fast_result(ins, _ml_outputs(mesh, letters, nd, summed))


def ml_grad(softmax: DistTensorSpec, label: DistTensorSpec, smooth_weight: DistTensorSpec, loss_grad: DistTensorSpec,
            ignore_index: int = -100, sum_multi_label_loss: bool = True, rank: int = 0, nranks: int = 1
            ) -> SpmdResult:
    """c_softmax_with_multi_label_cross_entropy_grad (CSoftmaxWithMultiLabelCrossEntropyGradSpmd):
    batch axes merged, the class axis keeps its sharding (each rank subtracts the labels in its
    class range), the label axis replicated; x_grad as softmax."""
    op = "c_softmax_with_multi_label_cross_entropy_grad"
    nd, summed = _ml_checks(op, softmax, label, smooth_weight, ignore_index, sum_multi_label_loss, rank, nranks,
                            "softmax")
    check_ndim(op, "loss_grad", loss_grad, nd)
    n = _ml_grad_notation(nd, summed)
    specs = (softmax, label, smooth_weight, loss_grad)
    names = ("softmax", "label", "smooth_weight", "loss_grad")
    mesh = named_mesh(op, zip(names, specs))
    letters = merge_one_dim(op, n, n.inputs, specs, names, mesh)
    ins = tuple(letter_attr(mesh, a, letters) for a in n.inputs)
    return fast_result(ins, (letter_attr(mesh, n.outputs[0], letters),))




_ML_ATTRS = "ignore_index: int = -100, sum_multi_label_loss: bool = True, rank: int = 0, nranks: int = 1"
register(
    "c_softmax_with_multi_label_cross_entropy", ml_forward, f"x: T, label: T, smooth_weight: T, {_ML_ATTRS}",
    ml_reverse, kind="reverse", outputs="softmax: T, loss: T",
    forward_name="CSoftmaxWithMultiLabelCrossEntropyInferSpmd",
    backward_name="CSoftmaxWithMultiLabelCrossEntropyInferSpmdReverse",
)  # fmt: skip
register(
    "c_softmax_with_multi_label_cross_entropy_grad", ml_grad,
    f"softmax: T, label: T, smooth_weight: T, loss_grad: T, {_ML_ATTRS}",
    forward_name="CSoftmaxWithMultiLabelCrossEntropyGradSpmd",
)  # fmt: skip
