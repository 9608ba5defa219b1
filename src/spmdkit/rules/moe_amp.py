"""MoE dispatch / combine, multi-label model-parallel cross entropy, numel, AMP loss scaling,
coalesce_tensor, and their grads.

Notation (letters; ``1`` a size-1 axis)::

    moe_combine            th, sk, sk -> sh          (x, combine_weights, scatter_index -> y)
                           t replicated; y partial SUM over the mesh dims of k; h replicated
                           where k is sharded (as Paddle)
    moe_combine_grad       th, sk, sk, sh -> th, sk, sk   (x, combine_weights, scatter_index, grad_y ->
                           grad_x, grad_combine_weights, grad_scatter_index); t, k replicated;
                           grad_x partial SUM over s, grad_combine_weights partial SUM over h
    moe_gate_dispatch      sh, se, e -> ech, sk, ks, e, sk   (x, gate_logits, corr_bias -> y,
                           combine_weights, scatter_index, expert_offset, expert_id); only h may
                           stay sharded (s, e, k, c replicated); nothing partial
    moe_gate_dispatch_grad sk, ks, sk, ech, sk -> sh, se   (combine_weights, scatter_index, expert_id,
                           grad_y, grad_combine_weights -> grad_x, grad_gate_logits); k, e, c
                           replicated; nothing partial
    c_softmax_with_multi_label_cross_entropy
                           abc, abd, abd -> abc, ab1 | abd   (x, label, smooth_weight -> softmax, loss;
                           the class letter c may stay sharded: the kernel all-reduces max, sum
                           and the picked logits over the ranks that share c; loss partial SUM
                           over the mesh dims of d when sum_multi_label_loss)
    c_softmax_with_multi_label_cross_entropy_grad
                           abc, abd, abd, ab1 | abd -> abc   (d replicated)
    numel                  x -> ()                   (x as given, out partial SUM over x's mesh dims)
    check_finite_and_unscale  xs, 1 -> xs, 1        (xs keep their sharding, partial dropped; scale
                           replicated; found_infinite partial MAX over the mesh dims of the xs)
    update_loss_scaling    xs, 1, 1, 1, 1 -> xs, 1, 1, 1  (xs as given less partial; the four
                           [1] state tensors replicated)
    coalesce_tensor        [T] -> [T], fused         (everything replicated)

What the data-dependent rules assume. ``scatter_index`` holds *global* row indices:
moe_combine gathers rows of x through it (``y[i] = sum_k x[scatter_index[i, k]] *
combine_weights[i, k]``), so x's row axis (t, of size S*K) is its own letter and is replicated;
Paddle labels it with the token letter s and shards it with the tokens (sound only where each
rank's scatter_index points into its own x block with local indices). moe_gate_dispatch is
answered as one global dispatch with ``use_pad`` layout: y is ``[E, capacity, H]`` (Paddle's
``esh``, its capacity axis labelled with the token letter), tokens are placed in expert slots in
(k, token) order over all S tokens and dropped past ``capacity``; which slot a token takes, and
whether it is dropped (its combine weight zeroed, its scatter index 0), depends on every token
before it, so s (and the capacity axis) stay replicated, and the top-k over experts needs every
expert, so e stays replicated. The combine weights are the gate values of the chosen experts
(``gate_logits[i, expert_id[i, k]]``, chosen by ``gate_logits + corr_bias``); the grad kernel
scatters grad_combine_weights back to those experts. check_finite_and_unscale's found_infinite is
the only data-dependent flag: a rank's flag covers its own shards, so it is partial MAX over the
mesh dims that shard any x; update_loss_scaling needs it (and the loss-scaling state) whole.

Deviations from Paddle 3.3.1 (``docs/deviations.md`` ``moe-amp-*``): moe_combine's x rows
replicated (Paddle shards them with s) and y partial over k's own mesh dim (Paddle always names
mesh dim 1); moe_combine_grad x rows replicated, grad_x partial over s, grad_combine_weights
partial over h; moe_gate_dispatch s and e replicated (Paddle shards the capacity axis of y with s
and keeps the top-k axis e sharded); its grad keeps grad_y's capacity and expert axes
replicated; multi-label cross entropy loss partial over a sharded label axis (Paddle: not partial)
and its grad with the label axis replicated; check_finite_and_unscale and update_loss_scaling
replicate the [1] scale / state tensors (Paddle keeps them as given); coalesce_tensor replicates
its inputs (Paddle keeps them sharded and answers a replicated fused output). Each reverse rule
(Paddle has none here) infers the inputs from the outputs and returns the outputs those inputs
produce.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from spmdkit.core.dist_attr import DimsMapping, Partial, ReduceType, TensorDistAttr, entry_dims
from spmdkit.core.errors import InvalidArgumentError, InvalidAttributeError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import one_mesh_dim_per_axis
from spmdkit.engine.memo import memo
from spmdkit.engine.notation import (
    ALPHABET,
    BROADCAST,
    Notation,
    check_letters,
    fast_result,
    merge_specs,
    named_mesh,
    project,
)
from spmdkit.rules.registry import register

_make = TensorDistAttr.unchecked
Letters = tuple[tuple[str, tuple[int, ...]], ...]


# -- helpers -------------------------------------------------------------------------------------


def _ndim(op: str, name: str, t: DistTensorSpec, nd: int) -> None:
    if len(t.shape) != nd:
        raise ShapeMismatchError(f"{op}: {name} must be a {nd}-D tensor, got shape {list(t.shape)}")


def _int(op: str, name: str, v: object, lo: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidAttributeError(f"{op}: {name} must be an int, got {v!r}")
    if lo is not None and v < lo:
        raise InvalidAttributeError(f"{op}: {name} must be at least {lo}, got {v}")
    return v


def _bool(op: str, name: str, v: object) -> bool:
    if not isinstance(v, (bool, int)):
        raise InvalidAttributeError(f"{op}: {name} must be a bool, got {v!r}")
    return bool(v)


def _one(specs: Sequence[DistTensorSpec | None]) -> list[DistTensorSpec | None]:
    """A co-sharded axis keeps its largest mesh dim, as Paddle's merge reads it."""
    return [None if s is None else one_mesh_dim_per_axis(s) for s in specs]


def _attr(mesh: ProcessMesh, axes: str | None, letters: Mapping[str, tuple[int, ...]],
          partial_letters: str = "", reduce: ReduceType = ReduceType.SUM) -> TensorDistAttr | None:
    """The dist attr of a tensor labelled ``axes``; partial (``reduce``) over the mesh dims of
    ``partial_letters`` (letters the tensor lacks)."""
    if axes is None:
        return None
    pt: dict[int, ReduceType] = {}
    for ch in partial_letters:
        for d in letters.get(ch, ()):
            pt[d] = reduce
    return _make(mesh, project(axes, letters), tuple(sorted(pt.items())))


def _merge(op: str, notation: Notation, axes: Sequence[str | None], specs: Sequence[DistTensorSpec | None],
           names: Sequence[str], mesh: ProcessMesh) -> dict[str, tuple[int, ...]]:
    check_letters(op, axes, specs, names)
    return dict(merge_specs(notation, axes, _one(specs), mesh))


# -- moe_combine -----------------------------------------------------------------------------------

_COMBINE = Notation(["th", "sk", "sk"], ["sh"], replicated="t")
_COMBINE_GRAD = Notation(["th", "sk", "sk", "sh"], ["th", "sk", "sk"], replicated="tk")


def _combine_checks(op: str, x: DistTensorSpec, cw: DistTensorSpec, si: DistTensorSpec) -> None:
    _ndim(op, "x", x, 2)
    _ndim(op, "combine_weights", cw, 2)
    _ndim(op, "scatter_index", si, 2)


@memo()
def _combine_letters(merged: Letters) -> dict[str, tuple[int, ...]]:
    letters = dict(merged)
    if letters.get("k"):
        letters["h"] = ()  # Paddle: k and h are not sharded together
    return letters


def moe_combine_forward(x: DistTensorSpec, combine_weights: DistTensorSpec, scatter_index: DistTensorSpec
                        ) -> SpmdResult:
    """moe_combine (MoECombineInferSpmd): rows of x replicated (gathered through scatter_index),
    tokens s and hidden h follow the inputs; y partial SUM over k's mesh dims."""
    op = "moe_combine"
    _combine_checks(op, x, combine_weights, scatter_index)
    specs = (x, combine_weights, scatter_index)
    names = ("x", "combine_weights", "scatter_index")
    mesh = named_mesh(op, zip(names, specs))
    merged = _merge(op, _COMBINE, _COMBINE.inputs, specs, names, mesh)
    letters = _combine_letters(tuple(merged.items()))
    ins = tuple(_attr(mesh, a, letters) for a in _COMBINE.inputs)
    return fast_result(ins, (_attr(mesh, "sh", letters, "k"),))


def moe_combine_grad(x: DistTensorSpec, combine_weights: DistTensorSpec, scatter_index: DistTensorSpec,
                     grad_y: DistTensorSpec) -> SpmdResult:
    """moe_combine_grad (MoECombineGradInferSpmd): x rows and k replicated; grad_x scatters the
    rows a rank holds (partial SUM over s), grad_combine_weights sums over h (partial SUM over h)."""
    op = "moe_combine_grad"
    _combine_checks(op, x, combine_weights, scatter_index)
    _ndim(op, "grad_y", grad_y, 2)
    specs = (x, combine_weights, scatter_index, grad_y)
    names = ("x", "combine_weights", "scatter_index", "grad_y")
    mesh = named_mesh(op, zip(names, specs))
    letters = _merge(op, _COMBINE_GRAD, _COMBINE_GRAD.inputs, specs, names, mesh)
    ins = tuple(_attr(mesh, a, letters) for a in _COMBINE_GRAD.inputs)
    outs = (_attr(mesh, "th", letters, "s"), _attr(mesh, "sk", letters, "h"), _attr(mesh, "sk", letters))
    return fast_result(ins, outs)


# -- moe_gate_dispatch -----------------------------------------------------------------------------

_DISPATCH = Notation(["sh", "se", "e"], ["ech", "sk", "ks", "e", "sk"], replicated="seck")
_DISPATCH_GRAD = Notation(["sk", "ks", "sk", "ech", "sk"], ["sh", "se"], replicated="keck")


def _dispatch_attrs(op: str, k: object, capacity: object, use_pad: object) -> None:
    _int(op, "k", k, 1)
    _int(op, "capacity", capacity, 0)
    _bool(op, "use_pad", use_pad)


def moe_gate_dispatch_forward(x: DistTensorSpec, gate_logits: DistTensorSpec, corr_bias: DistTensorSpec | None,
                              k: int, capacity: int, use_pad: bool) -> SpmdResult:
    """moe_gate_dispatch (MoEGateDispatchInferSpmd): one global dispatch: only the hidden axis h
    keeps its sharding (x -> y); tokens, experts, k and capacity replicated; nothing partial."""
    op = "moe_gate_dispatch"
    _dispatch_attrs(op, k, capacity, use_pad)
    _ndim(op, "x", x, 2)
    _ndim(op, "gate_logits", gate_logits, 2)
    if corr_bias is not None:
        _ndim(op, "corr_bias", corr_bias, 1)
    if 0 <= gate_logits.shape[1] < k:
        raise InvalidAttributeError(f"{op}: k {k} exceeds the number of experts {gate_logits.shape[1]}")
    specs = (x, gate_logits, corr_bias)
    names = ("x", "gate_logits", "corr_bias")
    mesh = named_mesh(op, zip(names, specs))
    letters = _merge(op, _DISPATCH, _DISPATCH.inputs, specs, names, mesh)
    ins = tuple(None if t is None else _attr(mesh, a, letters) for a, t in zip(_DISPATCH.inputs, specs))
    outs = tuple(_attr(mesh, a, letters) for a in _DISPATCH.outputs)
    return fast_result(ins, outs)


def moe_gate_dispatch_grad(combine_weights: DistTensorSpec, scatter_index: DistTensorSpec, expert_id: DistTensorSpec,
                           grad_y: DistTensorSpec, grad_combine_weights: DistTensorSpec, k: int, capacity: int,
                           use_pad: bool) -> SpmdResult:
    """moe_gate_dispatch_grad (MoEGateDispatchGradInferSpmd): tokens s and hidden h follow the
    inputs; grad_y's expert and capacity axes and k replicated (grad_x gathers rows of grad_y
    through scatter_index); nothing partial."""
    op = "moe_gate_dispatch_grad"
    _dispatch_attrs(op, k, capacity, use_pad)
    specs = (combine_weights, scatter_index, expert_id, grad_y, grad_combine_weights)
    names = ("combine_weights", "scatter_index", "expert_id", "grad_y", "grad_combine_weights")
    for n, t, nd in zip(names, specs, (2, 2, 2, 3, 2)):
        _ndim(op, n, t, nd)
    mesh = named_mesh(op, zip(names, specs))
    letters = _merge(op, _DISPATCH_GRAD, _DISPATCH_GRAD.inputs, specs, names, mesh)
    ins = tuple(_attr(mesh, a, letters) for a in _DISPATCH_GRAD.inputs)
    outs = tuple(_attr(mesh, a, letters) for a in _DISPATCH_GRAD.outputs)
    return fast_result(ins, outs)


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
    _int(op, "ignore_index", ignore_index)
    summed = _bool(op, "sum_multi_label_loss", sum_multi_label_loss)
    _int(op, "rank", rank)
    _int(op, "nranks", nranks, 1)
    _ndim(op, "label", label, nd)
    _ndim(op, "smooth_weight", smooth_weight, nd)
    return nd, summed


def _ml_outputs(mesh: ProcessMesh, letters: Mapping[str, tuple[int, ...]], nd: int, summed: bool
                ) -> tuple[TensorDistAttr | None, ...]:
    x, lab, loss = _ml_axes(nd, summed)
    # softmax never partial (the kernel all-reduces over c); the summed loss is partial over the
    # mesh dims of the label axis d (each rank sums its own labels)
    return (_attr(mesh, x, letters), _attr(mesh, loss, letters, lab[-1] if summed else ""))


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
    letters = _merge(op, n, n.inputs, specs, names, mesh)
    ins = tuple(_attr(mesh, a, letters) for a in n.inputs)
    return fast_result(ins, _ml_outputs(mesh, letters, nd, summed))


def ml_reverse(x: DistTensorSpec, label: DistTensorSpec, smooth_weight: DistTensorSpec, softmax: DistTensorSpec,
               loss: DistTensorSpec, ignore_index: int = -100, sum_multi_label_loss: bool = True, rank: int = 0,
               nranks: int = 1) -> SpmdResult:
    """c_softmax_with_multi_label_cross_entropy reverse (Paddle has none): the inputs from softmax
    and loss; the outputs those inputs produce."""
    op = "c_softmax_with_multi_label_cross_entropy"
    nd, summed = _ml_checks(op, x, label, smooth_weight, ignore_index, sum_multi_label_loss, rank, nranks)
    n = _ml_notation(nd, summed)
    _ndim(op, "softmax", softmax, nd)
    _ndim(op, "loss", loss, nd)
    specs = (x, label, smooth_weight, softmax, loss)
    names = ("x", "label", "smooth_weight", "softmax", "loss")
    mesh = named_mesh(op, zip(names, specs))
    check_letters(op, (*n.inputs, *n.outputs), specs, names)
    letters = dict(merge_specs(n, n.outputs, _one(specs[3:]), mesh))
    ins = tuple(_attr(mesh, a, letters) for a in n.inputs)
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
    _ndim(op, "loss_grad", loss_grad, nd)
    n = _ml_grad_notation(nd, summed)
    specs = (softmax, label, smooth_weight, loss_grad)
    names = ("softmax", "label", "smooth_weight", "loss_grad")
    mesh = named_mesh(op, zip(names, specs))
    letters = _merge(op, n, n.inputs, specs, names, mesh)
    ins = tuple(_attr(mesh, a, letters) for a in n.inputs)
    return fast_result(ins, (_attr(mesh, n.outputs[0], letters),))


# -- numel -----------------------------------------------------------------------------------------


@memo()
def _numel_partial(dm: DimsMapping) -> Partial:
    return tuple(sorted((d, ReduceType.SUM) for e in dm for d in entry_dims(e)))


def numel_forward(x: DistTensorSpec) -> SpmdResult:
    """numel (NumelInferSpmd): x as given; the 0-d count partial SUM over every mesh dim sharding x
    (local element counts add up to the global one, uneven shards included)."""
    a = x.dist_attr
    return fast_result((a,), (_make(a.mesh, (), _numel_partial(a.dims_mapping)),))


def numel_reverse(x: DistTensorSpec, out: DistTensorSpec) -> SpmdResult:
    """numel reverse (Paddle has none): a 0-d count says nothing about x's axes: x replicated,
    the count replicated."""
    op = "numel"
    if len(out.shape) != 0:
        raise ShapeMismatchError(f"{op}: out must be a 0-d tensor, got shape {list(out.shape)}")
    mesh = named_mesh(op, (("x", x), ("out", out)))
    return fast_result((_make(mesh, (-1,) * len(x.shape)),), (_make(mesh, ()),))


# -- check_finite_and_unscale / update_loss_scaling -------------------------------------------------


def _scalar_state(op: str, name: str, t: DistTensorSpec, mesh: ProcessMesh) -> TensorDistAttr:
    if len(t.shape) > 1 or any(s not in (1, -1) for s in t.shape):
        raise ShapeMismatchError(f"{op}: {name} must hold one element (shape [1]), got {list(t.shape)}")
    return _make(mesh, (-1,) * len(t.shape))


def _plain(xs: Sequence[DistTensorSpec], mesh: ProcessMesh) -> tuple[TensorDistAttr, ...]:
    """Each x with its dims_mapping, partial dropped."""
    out = []
    for t in xs:
        a = t.dist_attr
        out.append(_make(mesh, a.dims_mapping) if a.partial else a)
    return tuple(out)


def _found_inf(xs: Sequence[TensorDistAttr], mesh: ProcessMesh, ndim: int) -> TensorDistAttr:
    dims = sorted({d for a in xs for e in a.dims_mapping for d in entry_dims(e)})
    return _make(mesh, (-1,) * ndim, tuple((d, ReduceType.MAX) for d in dims))


def _check_xs(op: str, xs: Sequence[DistTensorSpec], name: str = "xs") -> None:
    if not xs:
        raise InvalidArgumentError(f"{op}: {name} must hold at least one tensor")


def cfu_forward(xs: Sequence[DistTensorSpec], scale: DistTensorSpec) -> SpmdResult:
    """check_finite_and_unscale (CheckFiniteAndUnscaleSpmd): each x keeps its sharding (partial
    dropped), scale replicated; out as xs, found_infinite partial MAX over the xs' mesh dims."""
    op = "check_finite_and_unscale"
    _check_xs(op, xs)
    mesh = named_mesh(op, [*((f"xs[{i}]", t) for i, t in enumerate(xs)), ("scale", scale)])
    sc = _scalar_state(op, "scale", scale, mesh)
    xa = _plain(xs, mesh)
    return SpmdResult((xa, sc), (xa, _found_inf(xa, mesh, 1)))


def cfu_reverse(xs: Sequence[DistTensorSpec], scale: DistTensorSpec, out: Sequence[DistTensorSpec],
                found_infinite: DistTensorSpec) -> SpmdResult:
    """check_finite_and_unscale reverse (Paddle has none): each x as its out (partial dropped),
    scale replicated; the outputs those inputs produce."""
    op = "check_finite_and_unscale"
    _check_xs(op, xs)
    if len(out) != len(xs):
        raise ShapeMismatchError(f"{op}: out has {len(out)} tensors but xs has {len(xs)}")
    mesh = named_mesh(op, [*((f"xs[{i}]", t) for i, t in enumerate(xs)), ("scale", scale),
                           *((f"out[{i}]", t) for i, t in enumerate(out)), ("found_infinite", found_infinite)])
    for i, (x, o) in enumerate(zip(xs, out)):
        if len(x.shape) != len(o.shape):
            raise ShapeMismatchError(f"{op}: out[{i}] has {len(o.shape)} dims but xs[{i}] has {len(x.shape)}")
    sc = _scalar_state(op, "scale", scale, mesh)
    _scalar_state(op, "found_infinite", found_infinite, mesh)
    xa = _plain(out, mesh)
    return SpmdResult((xa, sc), (xa, _found_inf(xa, mesh, 1)))


def _uls_attrs(op: str, incr_every_n_steps: object, decr_every_n_nan_or_inf: object, incr_ratio: object,
               decr_ratio: object, stop_update: object) -> None:
    _int(op, "incr_every_n_steps", incr_every_n_steps)
    _int(op, "decr_every_n_nan_or_inf", decr_every_n_nan_or_inf)
    for n, v in (("incr_ratio", incr_ratio), ("decr_ratio", decr_ratio)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InvalidAttributeError(f"{op}: {n} must be a number, got {v!r}")
    if not isinstance(stop_update, (bool, int, float)):
        raise InvalidAttributeError(f"{op}: stop_update must be a bool, got {stop_update!r}")


_STATE = ("found_infinite", "prev_loss_scaling", "in_good_steps", "in_bad_steps")


def _uls(op: str, xs: Sequence[DistTensorSpec], state: Sequence[DistTensorSpec],
         extra: Sequence[tuple[str, DistTensorSpec]], src: Sequence[DistTensorSpec]) -> SpmdResult:
    _check_xs(op, xs)
    mesh = named_mesh(op, [*((f"xs[{i}]", t) for i, t in enumerate(xs)), *zip(_STATE, state), *extra])
    st = tuple(_scalar_state(op, n, t, mesh) for n, t in zip(_STATE, state))
    xa = _plain(src, mesh)
    one = _make(mesh, (-1,))
    return SpmdResult((xa, *st), (xa, one, one, one))


def uls_forward(xs: Sequence[DistTensorSpec], found_infinite: DistTensorSpec, prev_loss_scaling: DistTensorSpec,
                in_good_steps: DistTensorSpec, in_bad_steps: DistTensorSpec, incr_every_n_steps: int,
                decr_every_n_nan_or_inf: int, incr_ratio: float, decr_ratio: float,
                stop_update: object = False) -> SpmdResult:
    """update_loss_scaling (UpdateLossScalingSpmd): each x keeps its sharding (partial dropped);
    found_infinite and the loss-scaling state replicated; out as xs, the new state replicated."""
    op = "update_loss_scaling"
    _uls_attrs(op, incr_every_n_steps, decr_every_n_nan_or_inf, incr_ratio, decr_ratio, stop_update)
    return _uls(op, xs, (found_infinite, prev_loss_scaling, in_good_steps, in_bad_steps), (), xs)


def uls_reverse(xs: Sequence[DistTensorSpec], found_infinite: DistTensorSpec, prev_loss_scaling: DistTensorSpec,
                in_good_steps: DistTensorSpec, in_bad_steps: DistTensorSpec, out: Sequence[DistTensorSpec],
                loss_scaling: DistTensorSpec, out_good_steps: DistTensorSpec, out_bad_steps: DistTensorSpec,
                incr_every_n_steps: int, decr_every_n_nan_or_inf: int, incr_ratio: float, decr_ratio: float,
                stop_update: object = False) -> SpmdResult:
    """update_loss_scaling reverse (Paddle has none): each x as its out (partial dropped), the
    state replicated; the outputs those inputs produce."""
    op = "update_loss_scaling"
    _uls_attrs(op, incr_every_n_steps, decr_every_n_nan_or_inf, incr_ratio, decr_ratio, stop_update)
    if len(out) != len(xs):
        raise ShapeMismatchError(f"{op}: out has {len(out)} tensors but xs has {len(xs)}")
    for i, (x, o) in enumerate(zip(xs, out)):
        if len(x.shape) != len(o.shape):
            raise ShapeMismatchError(f"{op}: out[{i}] has {len(o.shape)} dims but xs[{i}] has {len(x.shape)}")
    extra = (*((f"out[{i}]", t) for i, t in enumerate(out)), ("loss_scaling", loss_scaling),
             ("out_good_steps", out_good_steps), ("out_bad_steps", out_bad_steps))
    for n, t in extra[len(out):]:
        _scalar_state(op, n, t, found_infinite.dist_attr.mesh)
    return _uls(op, xs, (found_infinite, prev_loss_scaling, in_good_steps, in_bad_steps), extra, out)


# -- coalesce_tensor -------------------------------------------------------------------------------


def _coalesce_attrs(op: str, dtype: object, copy_data: object, set_constant: object, persist_output: object,
                    constant: object, use_align: object, align_size: object, size_of_dtype: object) -> None:
    if not isinstance(dtype, (str, int)) or isinstance(dtype, bool):
        raise InvalidAttributeError(f"{op}: dtype must be a data type name, got {dtype!r}")
    for n, v in (("copy_data", copy_data), ("set_constant", set_constant), ("persist_output", persist_output),
                 ("use_align", use_align)):
        _bool(op, n, v)
    if isinstance(constant, bool) or not isinstance(constant, (int, float)):
        raise InvalidAttributeError(f"{op}: constant must be a number, got {constant!r}")
    _int(op, "align_size", align_size)
    _int(op, "size_of_dtype", size_of_dtype)


def _coalesce(op: str, inputs: Sequence[DistTensorSpec], extra: Sequence[tuple[str, DistTensorSpec]]) -> SpmdResult:
    if not inputs:
        raise InvalidArgumentError(f"{op}: input must hold at least one tensor")
    mesh = named_mesh(op, [*((f"input[{i}]", t) for i, t in enumerate(inputs)), *extra])
    ins = tuple(_make(mesh, (-1,) * len(t.shape)) for t in inputs)
    return SpmdResult((ins,), (ins, _make(mesh, (-1,))))


def coalesce_forward(input: Sequence[DistTensorSpec], dtype: object = "float32", copy_data: bool = False,
                     set_constant: bool = False, persist_output: bool = False, constant: float = 0.0,
                     use_align: bool = True, align_size: int = -1, size_of_dtype: int = -1,
                     concated_shapes: Sequence[int] = (), concated_ranks: Sequence[int] = ()) -> SpmdResult:
    """coalesce_tensor (CoalesceTensorInferSpmd): the fused 1-D buffer holds every input whole, so
    every input is replicated; output as the inputs, fused_output replicated."""
    op = "coalesce_tensor"
    _coalesce_attrs(op, dtype, copy_data, set_constant, persist_output, constant, use_align, align_size,
                    size_of_dtype)
    return _coalesce(op, input, ())


def coalesce_reverse(input: Sequence[DistTensorSpec], output: Sequence[DistTensorSpec], fused_output: DistTensorSpec,
                     dtype: object = "float32", copy_data: bool = False, set_constant: bool = False,
                     persist_output: bool = False, constant: float = 0.0, use_align: bool = True,
                     align_size: int = -1, size_of_dtype: int = -1, concated_shapes: Sequence[int] = (),
                     concated_ranks: Sequence[int] = ()) -> SpmdResult:
    """coalesce_tensor reverse (Paddle has none): every input replicated whatever the outputs ask
    (the fused buffer needs them whole); the outputs those inputs produce."""
    op = "coalesce_tensor"
    _coalesce_attrs(op, dtype, copy_data, set_constant, persist_output, constant, use_align, align_size,
                    size_of_dtype)
    if len(output) != len(input):
        raise ShapeMismatchError(f"{op}: output has {len(output)} tensors but input has {len(input)}")
    if len(fused_output.shape) != 1:
        raise ShapeMismatchError(f"{op}: fused_output must be 1-D, got shape {list(fused_output.shape)}")
    return _coalesce(op, input, (*((f"output[{i}]", t) for i, t in enumerate(output)),
                                 ("fused_output", fused_output)))


# -- registration ----------------------------------------------------------------------------------

_COMBINE_SIG = "x: T, combine_weights: T, scatter_index: T"
_COMBINE_GRAD_SIG = "x: T, combine_weights: T, scatter_index: T, grad_y: T"
_DISPATCH_GRAD_SIG = ("combine_weights: T, scatter_index: T, expert_id: T, grad_y: T, grad_combine_weights: T, "
                      "k: int, capacity: int, use_pad: bool")
_ML_ATTRS = "ignore_index: int = -100, sum_multi_label_loss: bool = True, rank: int = 0, nranks: int = 1"
_ULS_ATTRS = ("incr_every_n_steps: int, decr_every_n_nan_or_inf: int, incr_ratio: float, decr_ratio: float, "
              "stop_update: scalar = False")
_COALESCE_ATTRS = ("dtype: any = 'float32', copy_data: bool = False, set_constant: bool = False, "
                   "persist_output: bool = False, constant: float = 0.0, use_align: bool = True, "
                   "align_size: int = -1, size_of_dtype: int = -1, concated_shapes: ints = [], "
                   "concated_ranks: ints = []")

register(
    "moe_combine", moe_combine_forward, _COMBINE_SIG, moe_combine_grad, _COMBINE_GRAD_SIG, kind="grad",
    forward_name="MoECombineInferSpmd", backward_name="MoECombineGradInferSpmd",
)  # fmt: skip
register("moe_combine_grad", moe_combine_grad, _COMBINE_GRAD_SIG, forward_name="MoECombineGradInferSpmd")
register(
    "moe_gate_dispatch", moe_gate_dispatch_forward,
    "x: T, gate_logits: T, corr_bias: T?, k: int, capacity: int, use_pad: bool",
    moe_gate_dispatch_grad, _DISPATCH_GRAD_SIG, kind="grad",
    forward_name="MoEGateDispatchInferSpmd", backward_name="MoEGateDispatchGradInferSpmd",
)  # fmt: skip
register("moe_gate_dispatch_grad", moe_gate_dispatch_grad, _DISPATCH_GRAD_SIG,
         forward_name="MoEGateDispatchGradInferSpmd")
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
register("numel", numel_forward, "x: T", numel_reverse, kind="reverse", outputs="out: T", forward_name="NumelInferSpmd",
         backward_name="NumelInferSpmdReverse")
register(
    "check_finite_and_unscale", cfu_forward, "xs: [T], scale: T", cfu_reverse,
    kind="reverse", outputs="out: [T], found_infinite: T",
    forward_name="CheckFiniteAndUnscaleSpmd", backward_name="CheckFiniteAndUnscaleSpmdReverse",
)  # fmt: skip
register(
    "update_loss_scaling", uls_forward,
    f"xs: [T], found_infinite: T, prev_loss_scaling: T, in_good_steps: T, in_bad_steps: T, {_ULS_ATTRS}",
    uls_reverse,
    kind="reverse", outputs="out: [T], loss_scaling: T, out_good_steps: T, out_bad_steps: T",
    forward_name="UpdateLossScalingSpmd", backward_name="UpdateLossScalingSpmdReverse",
)  # fmt: skip
register(
    "coalesce_tensor", coalesce_forward, f"input: [T], {_COALESCE_ATTRS}", coalesce_reverse,
    kind="reverse", outputs="output: [T], fused_output: T",
    forward_name="CoalesceTensorInferSpmd", backward_name="CoalesceTensorInferSpmdReverse",
)  # fmt: skip
