"""Optimizer update rules: adam, adamw and sgd (Paddle's AdamInferSpmdDynamic,
AdamwInferSpmdDynamic, SgdInferSpmd; not registered under these names in Paddle 3.3.1), and
coalesce_tensor, which fuses their parameters or grads into one buffer.

Notation: the update is elementwise over the parameter's axes, ``abc`` for param, grad,
moment1, moment2 (and moment2_max with amsgrad, master_param), and the scalars
learning_rate, beta1_pow, beta2_pow (and skip_update) are ``1`` (replicated).

Merge (as Paddle): per axis, the mesh dims the state tensors (param, grad, moment1,
moment2, moment2_max with amsgrad; sgd: param and grad) shard it with; where they all
agree (ignoring the unsharded ones) every state tensor takes that sharding, where two
disagree the axis is replicated on all. A mesh dim claimed by two axes stays with the
first. master_param takes the result. Nothing is pruned (the update is elementwise, an
uneven split is still one element per element).

Partial: a partial input (a partial grad, typically) is answered as needing replication
over those mesh dims: it must be reduced before the update (the update is not linear in
grad). Outputs are never partial: param_out, moment1_out, moment2_out, moment2_max_out and
master_param_out are sharded like param; beta1_pow_out / beta2_pow_out are replicated.

Reverse (spmdkit's own; Paddle has none): the same merge over the state outputs
(param_out, moment1_out, moment2_out, moment2_max_out, master_param_out); the inputs are
sharded as merged, the scalars replicated, and the outputs are what those inputs produce.

Deviations: Paddle keeps learning_rate / beta1_pow / beta2_pow (shape [1]) as given, also
sharded; spmdkit replicates them (optimizer-scalars-replicated). Paddle raises on a sharded
skip_update; spmdkit replicates it (optimizer-skip-update). Paddle's first step, an elementwise
merge of param and grad, raises where they shard one axis on different mesh dims; spmdkit
replicates the axis (optimizer-two-mesh-dims). Paddle's per-axis vote can put one mesh dim on
two axes (param [0,-1], moment1 [-1,0] -> [0,0]); spmdkit keeps it on the first
(optimizer-repeated-mesh-dim).

coalesce_tensor (CoalesceTensorInferSpmd): ``[T] -> [T], fused``, everything replicated (Paddle keeps the
inputs sharded and answers a replicated fused output: ``docs/deviations.md`` ``moe-amp-*``). Its
reverse rule (Paddle has none) infers the inputs from the outputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

from spmdkit.core.errors import InvalidArgumentError, ShapeMismatchError
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.declare import Way, declare
from spmdkit.engine.facts import facts
from spmdkit.engine.notation import BROADCAST, Conflict, Notation, Order, Taken, letters_for
from spmdkit.engine.outshape import Args, Expect, ShapeFn
from spmdkit.ops._cost import by_bytes, copy, one_per_element


def notation(nd: int, lr: int, m2max: bool, b1: int, b2: int, master: bool, skip: int, amsgrad: bool,
             *given: bool) -> Notation:
    """The vote above over ``abc`` (``nd`` letters; a scalar of rank r ``1`` * r; -1 absent; sgd:
    ``b1 == -2``): every tensor an input of the notation (the call's, for the reverse its outputs
    ``given``, then the answer's outputs, absent, so none is partial), merged over the voters alone
    (``sources``) with ``conflict=Conflict.REPLICATE`` (co-shards compared whole) and ``taken=Taken.LETTER``."""
    a = letters_for(nd)

    def lab(r: int) -> str | None:
        return None if r < 0 else BROADCAST * r

    st = [a if on else None for on in (m2max, master)]
    if b1 == -2:  # sgd
        ins, outs, voters = [a, lab(lr), a, st[1]], [a, st[1]], [0, 2]
    else:
        ins = [a, a, lab(lr), a, a, st[0], lab(b1), lab(b2), st[1], lab(skip)]
        outs = [a, a, a, a if amsgrad else None, lab(b1), lab(b2), st[1]]
        voters = [0, 1, 3, 4, 5][: 5 if amsgrad else 4]
    if given:  # the reverse: the state outputs given vote
        voters = [len(ins) + i for i, on in enumerate(given) if on]
        ins += [a if on else None for on in given] + [None] * (len(outs) - len(given))
    return Notation(ins + outs, [], conflict=Conflict.REPLICATE, order=Order.NOTATION, taken=Taken.LETTER, sources=voters)


_ADAM_IN = ("param: T, grad: T, learning_rate: T, moment1: T, moment2: T, moment2_max: T?, beta1_pow: T, "
            "beta2_pow: T, master_param: T?, skip_update: T?")
_ADAM_OUT = ("param_out: T, moment1_out: T, moment2_out: T, moment2_max_out: T?, beta1_pow_out: T, "
             "beta2_pow_out: T, master_param_out: T?")
_ADAM_TAIL = ("lazy_mode: bool = False, min_row_size_to_use_multithread: int = 1000, multi_precision: bool = False, "
              "use_global_beta_pow: bool = False, amsgrad: bool = False")
_BETAS = "beta1: scalar = 0.9, beta2: scalar = 0.999, epsilon: scalar = 1e-08"
_ADAMW_EXTRA = "lr_ratio: float = 1.0, coeff: float = 0.01, with_decay: bool = False"
_ADAM_KEY = ("param, learning_rate, moment2_max is not None, beta1_pow, beta2_pow, master_param is not None, "
             "skip_update, amsgrad")
_ADAM_SAME = [("param", t) for t in ("grad", "moment1", "moment2", "moment2_max", "master_param")]
_OUT_SAME = [("param", t + "_out") for t in ("param", "moment1", "moment2", "moment2_max", "master_param")]


def _amsgrad(amsgrad: bool, moment2_max: DistTensorSpec | None) -> None:
    if amsgrad and moment2_max is None:
        raise InvalidArgumentError("amsgrad=True needs moment2_max, which is absent")


#: the reverse's voters: param_out, moment1_out, moment2_out (always given), moment2_max_out with
#: amsgrad, master_param_out (beta1_pow_out / beta2_pow_out never vote)
_ADAM_GIVEN = "True, True, True, amsgrad and moment2_max_out is not None, False, False, master_param_out is not None"

for _name, _pd, _sig, _doc in (
    ("adam", "Adam", f"{_ADAM_IN}, {_BETAS}, {_ADAM_TAIL}",
     "AdamInferSpmdDynamic: param, grad and the moments sharded alike (an axis they shard differently is "
     "replicated), the scalars replicated, a partial grad reduced first."),
    ("adamw", "Adamw", f"{_ADAM_IN}, {_BETAS}, {_ADAMW_EXTRA}, {_ADAM_TAIL}",
     "AdamwInferSpmdDynamic: as adam (the decay is elementwise too)."),
):
    declare(
        _name, _sig,
        Way(notation, key=_ADAM_KEY, check=_amsgrad, same=_ADAM_SAME, tail=7, paddle=f"{_pd}InferSpmdDynamic",
            doc=_doc),
        reverse=Way(notation, key=f"{_ADAM_KEY}, {_ADAM_GIVEN}", check=_amsgrad, tail=7,
                    same=_ADAM_SAME + _OUT_SAME, paddle=f"{_pd}InferSpmdReverse",
                    doc=f"{_name} reverse (spmdkit's own): the vote over the outputs."),
        outputs=_ADAM_OUT, aliases=(f"{_name}_",),
    )  # fmt: skip
_SGD_KEY = "param, learning_rate, False, -2, -2, master_param is not None, -1, False"
_SGD_SAME = [("param", "grad"), ("param", "master_param")]
declare(
    "sgd", "param: T, learning_rate: T, grad: T, master_param: T?, multi_precision: bool = False",
    Way(notation, key=_SGD_KEY, same=_SGD_SAME, tail=2, paddle="SgdInferSpmd",
        doc="SgdInferSpmd: param and grad sharded alike, learning_rate replicated."),
    reverse=Way(notation, key=f"{_SGD_KEY}, True, master_param_out is not None", tail=2,
                same=[*_SGD_SAME, ("param", "param_out"), ("param", "master_param_out")], paddle="SgdInferSpmdReverse",
                doc="sgd reverse (spmdkit's own): param and grad from param_out (and master_param_out)."),
    outputs="param_out: T, master_param_out: T?", aliases=("sgd_",),
)  # fmt: skip


def coalesce_notation(ranks: tuple[int, ...]) -> Notation:
    """``[T] -> [T], fused``: every tensor ``1`` per axis."""
    ones = [BROADCAST * r for r in ranks]
    return Notation(ones, [*ones, BROADCAST])


def _as_many(op: str, input: Sequence[DistTensorSpec], output: Sequence[DistTensorSpec]) -> None:
    if len(output) != len(input):
        raise ShapeMismatchError(f"{op}: output has {len(output)} tensors but input has {len(input)}")


def _fused(ins: tuple[Any, ...], outs: tuple[Any, ...], input: tuple[DistTensorSpec, ...], *rest: object) -> Any:
    """The answer as Paddle groups its lists: ``(input,), (output, fused_output)``."""
    n = len(input)
    return (ins if len(ins) == 1 else (tuple(ins),)), (tuple(outs[-n - 1 : -1]), outs[-1])


_COALESCE_ATTRS = ("dtype: any = 'float32', copy_data: bool = False, set_constant: bool = False, "
                   "persist_output: bool = False, constant: float = 0.0, use_align: bool = True, "
                   "align_size: int = -1, size_of_dtype: int = -1, concated_shapes: ints = [], "
                   "concated_ranks: ints = []")
# dtype a name or a number (the other attributes are typed by the signature)
_COALESCE = partial(Way, coalesce_notation, key="input", nonempty=("input",), post=_fused,
                    require=("isinstance(dtype, (str, int)) and not isinstance(dtype, bool)",))
declare(
    "coalesce_tensor", f"input: [T], {_COALESCE_ATTRS}",
    _COALESCE(paddle="CoalesceTensorInferSpmd", doc="coalesce_tensor (CoalesceTensorInferSpmd): every tensor "
              "replicated (the fused 1-D buffer holds each input whole)."),
    reverse=_COALESCE(tail="output", shapes="fused_output: _", check=_as_many,
                      paddle="CoalesceTensorInferSpmdReverse",
                      doc="coalesce_tensor reverse (Paddle has none): all replicated whatever the outputs ask."),
    outputs="output: [T], fused_output: T",
)  # fmt: skip


# -- output shapes --------------------------------------------------------------------------------


def _in_place(*inputs: str) -> ShapeFn:
    """Outputs that are updated inputs (``param_out`` of ``param``): each the shape of its input."""
    return lambda a: [a.opt(p) for p in inputs]


def _coalesce_shape(a: Args) -> list[Expect]:
    """output like input; fused_output [total elements], each input's count rounded up to
    align_size bytes (CoalesceTensorInferMeta) where use_align, align_size and size_of_dtype
    say it (a -1 size means the dtype's and place's default: not checked)."""
    xs = a.vec("input")
    out: list[Expect] = [list(xs)]
    counts = [math.prod(x) for x in xs if x is not None]
    if not a.a("use_align", True):
        return [*out, (sum(counts),)]
    align, size = a.a("align_size", -1), a.a("size_of_dtype", -1)
    if not (isinstance(align, int) and isinstance(size, int) and align > 0 and size > 0 and align % size == 0):
        return [*out, None]
    unit = align // size
    return [*out, (sum(-(-n // unit) * unit for n in counts),)]


facts("adam", "adamw",
      shape=_in_place("param", "moment1", "moment2", "moment2_max", "beta1_pow", "beta2_pow", "master_param"))
facts("sgd", shape=_in_place("param", "master_param"))
facts("coalesce_tensor", shape=_coalesce_shape,
      unchecked="fused_output's size when align_size or size_of_dtype is -1 (the place's and dtype's defaults); "
                "output is checked")


# -- cost

#: nominal FLOPs per parameter element
facts("adamw", cost=by_bytes(6))
facts("adam", cost=by_bytes(5))
facts("sgd", cost=one_per_element)
facts("coalesce_tensor", cost=copy)
