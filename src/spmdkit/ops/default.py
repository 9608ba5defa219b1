"""The generic rules: default_data_parallel (alias default_) and replicated.

Both take Paddle's ``(vector<T*> ins, vector<T*> outs)``: the op's inputs and its
outputs (the outputs' shapes are needed to answer for them). As in Paddle, the
result's ``inputs`` is one dist attr per tensor of ``ins`` and its ``outputs`` one
per tensor of ``outs`` (flat lists, not nested).

* ``default_data_parallel``: every tensor's axis 0 is the batch axis (notation
  ``b..., b... -> b...``): the batch axes of all inputs are merged (where two inputs
  shard it over different mesh dims the larger tensor wins, the first of equal ones; Paddle raises),
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

from spmdkit.engine.declare import Way, declare
from spmdkit.engine.facts import facts
from spmdkit.engine.notation import BROADCAST, Conflict, Coshard, Notation
from spmdkit.engine.outshape import Args, Expect, UnknownShape
from spmdkit.ops._cost import copy


def notation(how: str, ins: tuple[int, ...], outs: tuple[int, ...]) -> Notation:
    """``b1.., b1.., ... -> (none)``: every tensor an input of the notation (so none is partial),
    merged from the inputs (``how="forward"``) or the outputs (``"backward"``) as the module says;
    ``how="replicated"`` or a 0-d output: no batch letter. Ranks: -1 for an absent tensor."""
    batch = how != "replicated" and 0 not in outs
    lab = [None if r < 0 else ("b" if batch and r else "") + BROADCAST * (r - (batch and r > 0)) for r in ins + outs]
    src = range(len(ins), len(ins) + len(outs)) if how == "backward" else range(len(ins))
    return Notation(lab, [], coshard=Coshard.LARGEST, conflict=Conflict.HEAVIEST, sources=src)


def _way(how: str, paddle: str) -> Way:
    return Way(lambda i, o: notation(how, i, o), key="ins, outs", nonempty=("ins", "outs"), tail="outs", paddle=paddle)


_SIG = "ins: [T?], outs: [T?]"
declare("default_data_parallel", _SIG, _way("forward", "DefaultDataParallelInferSpmd"),
        reverse=_way("backward", "DefaultDataParallelInferSpmdReverse"), aliases=("default_",),
        doc="Shard every tensor on axis 0 as the inputs' batch axis is sharded; replicate the rest.")  # fmt: skip
declare("replicated", _SIG, _way("replicated", "ReplicatedInferSpmd"),
        reverse=_way("replicated", "ReplicatedInferSpmdReverse"), doc="Every input and output replicated.")  # fmt: skip


# -- output shapes --------------------------------------------------------------------------------


def _outs_shape(a: Args) -> list[Expect]:
    """``outs`` describes the op's outputs, one each."""
    outs = a.vec("outs")
    if len(outs) != len(a.ndims):
        raise UnknownShape
    return list(outs)


facts("default_data_parallel", "replicated", shape=_outs_shape)


# -- cost

#: replicated (the importer's stand-in for an op it could not map) has no cost: a plan's step
#: estimate lists it as uncovered
facts("default_data_parallel", cost=copy)
