"""The generic rules: default_data_parallel (alias default_) and replicated.

Both take Paddle's ``(vector<T*> ins, vector<T*> outs)``: the op's inputs and its
outputs (the outputs' shapes are needed to answer for them). As in Paddle, the
result's ``inputs`` is one dist attr per tensor of ``ins`` and its ``outputs`` one
per tensor of ``outs`` (flat lists, not nested).

* ``default_data_parallel``: every tensor's axis 0 is the batch axis (notation
  ``b..., b... -> b...``): the batch axes of all inputs are merged (where two
  inputs shard it over different mesh dims the larger tensor wins, Paddle raises),
  every input and output is sharded on axis 0 only (a co-sharded batch axis keeps
  its largest mesh dim, the first of equal sizes, as in Paddle), everything else replicated,
  partial status cleared. Forward merges over the inputs, backward over the
  outputs. A 0-d tensor has no batch axis: a 0-d input is replicated; a 0-d
  output cannot be made batch-wise (it would be a reduction over the batch), so
  the whole op is answered replicated (Paddle 3.3.1 crashes the process on a 0-d
  tensor here).
* ``replicated``: every input and output replicated, partial cleared.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from spmdkit.core.errors import InvalidArgumentError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.compile import Plan, compile_plan, infer
from spmdkit.engine.notation import BROADCAST, Notation, common_mesh
from spmdkit.rules._common import replicated_plan
from spmdkit.rules.registry import register

Specs = Sequence[DistTensorSpec | None]


def _mesh(op: str, ins: Specs, outs: Specs) -> ProcessMesh:
    if not any(s is not None for s in ins) and not any(s is not None for s in outs):
        raise InvalidArgumentError(f"{op}: ins and outs are both empty: no tensor, so no mesh")
    return common_mesh(op, list(ins) + list(outs))


@lru_cache(maxsize=1024)
def _plan(ins: tuple[int, ...], outs: tuple[int, ...], reverse: bool) -> Plan:
    """``b1.., b1.., ... -> (none)`` over the inputs and the outputs alike (every answer is an
    input of the notation, so none is partial), merged from the inputs (the outputs for the
    reverse): the heaviest tensor sharding the batch axis keeps its sharding (the first on a tie),
    a co-shard read as its largest mesh dim. A 0-d output makes every tensor replicated (it
    would be a reduction over the batch). Ranks: -1 for an absent tensor."""
    batch = 0 not in outs
    lab = [None if r < 0 else ("b" if batch and r else "") + BROADCAST * (r - (batch and r > 0)) for r in ins + outs]
    src = range(len(ins), len(ins) + len(outs)) if reverse else range(len(ins))
    return compile_plan(Notation(lab, [], coshard="largest", conflict="heaviest", sources=src))


def _data_parallel(op: str, ins: Specs, outs: Specs, reverse: bool) -> SpmdResult:
    mesh = _mesh(op, ins, outs)
    p = _plan(_ranks(ins), _ranks(outs), reverse)
    a, _ = infer(p, op, (*ins, *outs), (), mesh)
    return SpmdResult(list(a[: len(ins)]), list(a[len(ins) :]))


def _ranks(specs: Specs) -> tuple[int, ...]:
    return tuple(-1 if s is None else s.ndim for s in specs)


def default_data_parallel_forward(ins: Specs, outs: Specs) -> SpmdResult:
    """Shard every tensor on axis 0 as the inputs' batch axis is sharded; replicate the rest."""
    return _data_parallel("default_data_parallel", ins, outs, False)


def default_data_parallel_backward(ins: Specs, outs: Specs) -> SpmdResult:
    """Shard every tensor on axis 0 as the outputs' batch axis is sharded; replicate the rest."""
    return _data_parallel("default_data_parallel", ins, outs, True)


def replicated_forward(ins: Specs, outs: Specs) -> SpmdResult:
    """Every input and output replicated."""
    mesh = _mesh("replicated", ins, outs)
    p = replicated_plan(tuple(-1 if s is None else s.ndim for s in ins),
                         tuple(-1 if s is None else s.ndim for s in outs))  # fmt: skip
    a, b = infer(p, "replicated", ins, (), mesh)
    return SpmdResult(list(a), list(b))



def replicated_backward(ins: Specs, outs: Specs) -> SpmdResult:
    """Every input and output replicated."""
    return replicated_forward(ins, outs)


_SIG = "ins: [T?], outs: [T?]"
register(
    "default_data_parallel",
    default_data_parallel_forward,
    _SIG,
    default_data_parallel_backward,
    kind="reverse", outputs="",
    aliases=("default_",),
    forward_name="DefaultDataParallelInferSpmd",
    backward_name="DefaultDataParallelInferSpmdReverse",
)
register(
    "replicated",
    replicated_forward,
    _SIG,
    replicated_backward,
    kind="reverse", outputs="",
    forward_name="ReplicatedInferSpmd",
    backward_name="ReplicatedInferSpmdReverse",
)
