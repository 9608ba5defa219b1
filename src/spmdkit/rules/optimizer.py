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

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from spmdkit.core.errors import InvalidArgumentError, InvalidAttributeError, ShapeMismatchError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.compile import Plan, compile_plan, infer
from spmdkit.engine.notation import BROADCAST, Notation, fast_result, letters_for, named_mesh
from spmdkit.engine.registry import register
from spmdkit.rules._common import check_bool, check_int, replicated_plan

_S = -2  # a state tensor (``abc``) in a plan's codes; -1 absent, r >= 0 a replicated scalar of rank r


@lru_cache(maxsize=1024)
def _plan(nd: int, codes: tuple[int, ...], out_codes: tuple[int, ...], n_given: int, voters: tuple[int, ...]) -> Plan:
    """Paddle's vote: every tensor of the answer (the inputs, ``codes``, then the outputs,
    ``out_codes``, then, for the reverse, the ``n_given`` outputs given, labelled where they vote)
    an input of the notation (so none is partial), the state tensors ``abc`` (``_S``), the scalars
    ``1`` (replicated), merged over the ``voters`` alone: per axis the sharding all the voters
    that shard it agree on, else replicated (``conflict="replicate"``, co-shards compared whole
    and kept); mesh dims go to the axes in order, an axis whose mesh dim an earlier axis took
    shards nothing (``taken="letter"``); nothing pruned."""
    a = letters_for(nd)
    n = len(codes) + len(out_codes)
    every = codes + out_codes + tuple(_S if n + i in voters else -1 for i in range(n_given))
    labels = [a if c == _S else None if c == -1 else BROADCAST * c for c in every]
    return compile_plan(Notation(labels, [], conflict="replicate", order="notation", taken="letter", sources=voters))


def _vote(op: str, mesh: ProcessMesh, ins: Sequence[DistTensorSpec | None], codes: tuple[int, ...],
          out_codes: tuple[int, ...], voters: tuple[int, ...], outs: Sequence[DistTensorSpec | None] = ()) -> SpmdResult:
    """The answer for ``ins`` (``codes``) and the outputs (``out_codes``), merged over the
    ``voters``: indices into ``ins``, then the answer's outputs, then ``outs``."""
    n, m = len(codes), len(out_codes)
    p = _plan(len(ins[0].shape), codes, out_codes, len(outs), voters)  # type: ignore[union-attr]
    a, _ = infer(p, op, (*ins, *(None,) * m, *outs), (), mesh)
    return fast_result(a[:n], a[n : n + m])


def _code(t: DistTensorSpec | None, state: bool = False) -> int:
    return -1 if t is None else _S if state else len(t.shape)


def _same_shape(op: str, ref_name: str, ref: DistTensorSpec, named: tuple[tuple[str, DistTensorSpec | None], ...]) -> None:
    s = ref.shape
    for name, t in named:
        if t is None:
            continue
        ts = t.shape
        if len(ts) != len(s):
            raise ShapeMismatchError(
                f"{op}: {name} has {len(ts)} dims (shape {list(ts)}) but {ref_name} has {len(s)} (shape {list(s)})"
            )
        for i, (a, b) in enumerate(zip(s, ts)):
            if a != b and a >= 0 and b >= 0:
                raise ShapeMismatchError(
                    f"{op}: {name} shape {list(ts)} differs from {ref_name} shape {list(s)} on axis {i}"
                )


_ADAM_STATES = ("param", "grad", "moment1", "moment2", "moment2_max", "master_param")
_ADAM_OUTS = ("param_out", "moment1_out", "moment2_out", "moment2_max_out", "beta1_pow_out", "beta2_pow_out",
              "master_param_out")


def _adam(op: str, ins: tuple[DistTensorSpec | None, ...], amsgrad: bool,
          outs: tuple[DistTensorSpec | None, ...] | None = None) -> SpmdResult:
    """``ins``: param, grad, learning_rate, moment1, moment2, moment2_max, beta1_pow, beta2_pow,
    master_param, skip_update; ``outs`` (the reverse): the 7 outputs."""
    param, grad, lr, m1, m2, m2max, b1, b2, master, skip = ins
    if amsgrad and m2max is None:
        raise InvalidArgumentError(f"{op}: amsgrad=True needs moment2_max, which is absent")
    named = tuple(zip(_ADAM_STATES, (param, grad, m1, m2, m2max, master)))
    out_named = () if outs is None else tuple(zip(_ADAM_OUTS, outs))
    mesh = named_mesh(op, (*named, ("learning_rate", lr), ("beta1_pow", b1), ("beta2_pow", b2), ("skip_update", skip),
                           *out_named))  # fmt: skip
    assert param is not None
    _same_shape(op, "param", param, named[1:] + tuple((n, t) for n, t in out_named if "beta" not in n))
    codes = (_S, _S, _code(lr), _S, _S, _code(m2max, True), _code(b1), _code(b2), _code(master, True), _code(skip))
    out_codes = (_S, _S, _S, _S if amsgrad else -1, codes[6], codes[7], codes[8])
    if outs is None:
        return _vote(op, mesh, ins, codes, out_codes, (0, 1, 3, 4, 5) if amsgrad else (0, 1, 3, 4))
    voters = tuple(17 + i for i in (0, 1, 2, 3, 6) if outs[i] is not None and (i != 3 or amsgrad))
    return _vote(op, mesh, ins, codes, out_codes, voters, outs)


def _adam_rule(op: str, reverse: bool) -> Any:
    """adam / adamw's forward (the 10 tensor inputs, then the attributes) or reverse rule (the
    10 inputs, the 7 outputs, then the attributes); amsgrad is the last attribute of both, and
    the only one that decides a sharding."""
    n = 17 if reverse else 10

    def fn(*args: Any) -> SpmdResult:
        ts, attrs = args[:n], args[n:]
        return _adam(op, ts[:10], bool(attrs[-1]) if attrs else False, tuple(ts[10:]) if reverse else None)

    return fn


def _sgd(
    param: DistTensorSpec, learning_rate: DistTensorSpec, grad: DistTensorSpec, master_param: DistTensorSpec | None,
    outs: tuple[DistTensorSpec | None, ...] | None = None,
) -> SpmdResult:
    op = "sgd"
    named = (("param", param), ("grad", grad), ("master_param", master_param))
    out_named: tuple[tuple[str, DistTensorSpec | None], ...] = ()
    if outs is not None:
        out_named = (("param_out", outs[0]), ("master_param_out", outs[1]))
    mesh = named_mesh(op, (*named, ("learning_rate", learning_rate), *out_named))
    _same_shape(op, "param", param, named[1:] + out_named)
    ins = (param, learning_rate, grad, master_param)
    codes = (_S, _code(learning_rate), _S, _code(master_param, True))
    if outs is None:
        return _vote(op, mesh, ins, codes, (_S, codes[3]), (0, 2))
    return _vote(op, mesh, ins, codes, (_S, codes[3]), tuple(6 + i for i, o in enumerate(outs) if o is not None), outs)


def sgd_forward(
    param: DistTensorSpec, learning_rate: DistTensorSpec, grad: DistTensorSpec, master_param: DistTensorSpec | None,
    multi_precision: bool = False,
) -> SpmdResult:
    """SgdInferSpmd: param and grad sharded alike, learning_rate replicated."""
    return _sgd(param, learning_rate, grad, master_param)


def sgd_backward(
    param: DistTensorSpec, learning_rate: DistTensorSpec, grad: DistTensorSpec, master_param: DistTensorSpec | None,
    param_out: DistTensorSpec, master_param_out: DistTensorSpec | None, multi_precision: bool = False,
) -> SpmdResult:
    """sgd reverse (spmdkit's own): param and grad from param_out (and master_param_out)."""
    return _sgd(param, learning_rate, grad, master_param, (param_out, master_param_out))


_ADAM_IN = ("param: T, grad: T, learning_rate: T, moment1: T, moment2: T, moment2_max: T?, beta1_pow: T, "
            "beta2_pow: T, master_param: T?, skip_update: T?")
_ADAM_OUT = ("param_out: T, moment1_out: T, moment2_out: T, moment2_max_out: T?, beta1_pow_out: T, "
             "beta2_pow_out: T, master_param_out: T?")
_ADAM_TAIL = ("lazy_mode: bool = False, min_row_size_to_use_multithread: int = 1000, multi_precision: bool = False, "
              "use_global_beta_pow: bool = False, amsgrad: bool = False")
_BETAS = "beta1: scalar = 0.9, beta2: scalar = 0.999, epsilon: scalar = 1e-08"
_ADAMW_EXTRA = "lr_ratio: float = 1.0, coeff: float = 0.01, with_decay: bool = False"

register(
    "adam", _adam_rule("adam", False), f"{_ADAM_IN}, {_BETAS}, {_ADAM_TAIL}",
    _adam_rule("adam", True), kind="reverse", outputs=_ADAM_OUT,
    doc="AdamInferSpmdDynamic: param, grad and the moments sharded alike (an axis they shard differently is "
        "replicated), the scalars replicated, a partial grad reduced first.",
    aliases=("adam_",), forward_name="AdamInferSpmdDynamic", backward_name="AdamInferSpmdReverse",
)  # fmt: skip
register(
    "adamw", _adam_rule("adamw", False), f"{_ADAM_IN}, {_BETAS}, {_ADAMW_EXTRA}, {_ADAM_TAIL}",
    _adam_rule("adamw", True), kind="reverse", outputs=_ADAM_OUT,
    doc="AdamwInferSpmdDynamic: as adam (the decay is elementwise too).",
    aliases=("adamw_",), forward_name="AdamwInferSpmdDynamic", backward_name="AdamwInferSpmdReverse",
)  # fmt: skip
register(
    "sgd", sgd_forward, "param: T, learning_rate: T, grad: T, master_param: T?, multi_precision: bool = False",
    sgd_backward,
    kind="reverse", outputs="param_out: T, master_param_out: T?",
    aliases=("sgd_",), forward_name="SgdInferSpmd", backward_name="SgdInferSpmdReverse",
)  # fmt: skip


# -- coalesce_tensor -------------------------------------------------------------------------------


def _coalesce_attrs(op: str, dtype: object, copy_data: object, set_constant: object, persist_output: object,
                    constant: object, use_align: object, align_size: object, size_of_dtype: object) -> None:
    if not isinstance(dtype, (str, int)) or isinstance(dtype, bool):
        raise InvalidAttributeError(f"{op}: dtype must be a data type name, got {dtype!r}")
    for n, v in (("copy_data", copy_data), ("set_constant", set_constant), ("persist_output", persist_output),
                 ("use_align", use_align)):
        check_bool(op, n, v)
    if isinstance(constant, bool) or not isinstance(constant, (int, float)):
        raise InvalidAttributeError(f"{op}: constant must be a number, got {constant!r}")
    check_int(op, "align_size", align_size)
    check_int(op, "size_of_dtype", size_of_dtype)


def _coalesce(op: str, inputs: Sequence[DistTensorSpec], extra: Sequence[tuple[str, DistTensorSpec]]) -> SpmdResult:
    if not inputs:
        raise InvalidArgumentError(f"{op}: input must hold at least one tensor")
    mesh = named_mesh(op, [*((f"input[{i}]", t) for i, t in enumerate(inputs)), *extra])
    ranks = tuple(len(t.shape) for t in inputs)
    # every tensor labelled ``1`` per axis: the fused buffer holds each input whole
    ins, outs = infer(replicated_plan(ranks, (*ranks, 1)), op, inputs, (), mesh)
    return fast_result((ins,), (outs[:-1], outs[-1]))  # type: ignore[arg-type]


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




_COALESCE_ATTRS = ("dtype: any = 'float32', copy_data: bool = False, set_constant: bool = False, "
                   "persist_output: bool = False, constant: float = 0.0, use_align: bool = True, "
                   "align_size: int = -1, size_of_dtype: int = -1, concated_shapes: ints = [], "
                   "concated_ranks: ints = []")
register(
    "coalesce_tensor", coalesce_forward, f"input: [T], {_COALESCE_ATTRS}", coalesce_reverse,
    kind="reverse", outputs="output: [T], fused_output: T",
    forward_name="CoalesceTensorInferSpmd", backward_name="CoalesceTensorInferSpmdReverse",
)  # fmt: skip
