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

from collections.abc import Callable, Sequence
from functools import lru_cache

from spmdkit.core.errors import InvalidArgumentError
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.compile import Plan, compile_plan, infer
from spmdkit.engine.notation import BROADCAST, Notation, common_mesh
from spmdkit.engine.registry import register

Specs = Sequence[DistTensorSpec | None]


@lru_cache(maxsize=1024)
def _plan(ins: tuple[int, ...], outs: tuple[int, ...], how: str) -> Plan:
    """``b1.., b1.., ... -> (none)`` over the inputs and the outputs alike (every answer is an
    input of the notation, so none is partial), merged from the inputs (``how="forward"``) or the
    outputs (``"backward"``): the heaviest tensor sharding the batch axis keeps its sharding (the
    first on a tie), a co-shard read as its largest mesh dim. A 0-d output makes every tensor
    replicated (it would be a reduction over the batch), as ``how="replicated"`` does. Ranks: -1
    for an absent tensor."""
    batch = how != "replicated" and 0 not in outs
    lab = [None if r < 0 else ("b" if batch and r else "") + BROADCAST * (r - (batch and r > 0)) for r in ins + outs]
    src = range(len(ins), len(ins) + len(outs)) if how == "backward" else range(len(ins))
    return compile_plan(Notation(lab, [], coshard="largest", conflict="heaviest", sources=src))


def _rule(op: str, how: str) -> Callable[[Specs, Specs], SpmdResult]:
    def rule(ins: Specs, outs: Specs) -> SpmdResult:
        if all(s is None for s in ins) and all(s is None for s in outs):
            raise InvalidArgumentError(f"{op}: ins and outs are both empty: no tensor, so no mesh")
        mesh = common_mesh(op, list(ins) + list(outs))
        ranks = [-1 if s is None else s.ndim for s in (*ins, *outs)]
        a, _ = infer(_plan(tuple(ranks[: len(ins)]), tuple(ranks[len(ins) :]), how), op, (*ins, *outs), (), mesh)
        return SpmdResult(list(a[: len(ins)]), list(a[len(ins) :]))

    return rule


_SIG = "ins: [T?], outs: [T?]"
register("default_data_parallel", _rule("default_data_parallel", "forward"), _SIG,
         _rule("default_data_parallel", "backward"), kind="reverse", outputs="", aliases=("default_",),
         forward_name="DefaultDataParallelInferSpmd", backward_name="DefaultDataParallelInferSpmdReverse",
         doc="Shard every tensor on axis 0 as the inputs' batch axis is sharded; replicate the rest.")  # fmt: skip
register("replicated", _rule("replicated", "replicated"), _SIG, _rule("replicated", "replicated"), kind="reverse",
         outputs="", forward_name="ReplicatedInferSpmd", backward_name="ReplicatedInferSpmdReverse",
         doc="Every input and output replicated.")  # fmt: skip
