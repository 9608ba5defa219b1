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

from spmdkit.core.dist_attr import DimsMapping, TensorDistAttr, entry_dims
from spmdkit.core.errors import InvalidArgumentError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.axes import largest_mesh_dim, replicated_like
from spmdkit.engine.compile import infer
from spmdkit.engine.notation import common_mesh, merge_weight
from spmdkit.rules._common import replicated_plan
from spmdkit.rules.registry import register

Specs = Sequence[DistTensorSpec | None]


def _mesh(op: str, ins: Specs, outs: Specs) -> ProcessMesh:
    if not any(s is not None for s in ins) and not any(s is not None for s in outs):
        raise InvalidArgumentError(f"{op}: ins and outs are both empty: no tensor, so no mesh")
    return common_mesh(op, list(ins) + list(outs))


def _replicate(mesh: ProcessMesh, specs: Specs) -> list[TensorDistAttr | None]:
    return [replicated_like(mesh, s) for s in specs]


def _batch_dims(mesh: ProcessMesh, specs: Specs) -> tuple[int, ...]:
    """The mesh dims of the merged batch axis: the largest tensor sharding it wins."""
    best: tuple[int, ...] = ()
    weight = -1
    for s in specs:
        if s is None or s.ndim == 0:
            continue
        d = entry_dims(s.dist_attr.dims_mapping[0])
        if not d:
            continue
        n = merge_weight(s.shape)
        if n > weight:
            best, weight = d, n
    return best


def _batch_only(mesh: ProcessMesh, dims: tuple[int, ...], specs: Specs) -> list[TensorDistAttr | None]:
    # a co-sharded batch axis keeps one mesh dim, its largest (the first of equal sizes), as in Paddle
    head = largest_mesh_dim(dims, mesh.shape) if dims else -1
    out: list[TensorDistAttr | None] = []
    for s in specs:
        if s is None:
            out.append(None)
            continue
        dm: DimsMapping = (head, *([-1] * (s.ndim - 1))) if s.ndim else ()
        out.append(TensorDistAttr.unchecked(mesh, dm, ()))
    return out


def _data_parallel(op: str, ins: Specs, outs: Specs, source: Specs) -> SpmdResult:
    mesh = _mesh(op, ins, outs)
    if any(s is not None and s.ndim == 0 for s in outs):
        return SpmdResult(_replicate(mesh, ins), _replicate(mesh, outs))
    dims = _batch_dims(mesh, source)
    return SpmdResult(_batch_only(mesh, dims, ins), _batch_only(mesh, dims, outs))


def default_data_parallel_forward(ins: Specs, outs: Specs) -> SpmdResult:
    """Shard every tensor on axis 0 as the inputs' batch axis is sharded; replicate the rest."""
    return _data_parallel("default_data_parallel", ins, outs, ins)


def default_data_parallel_backward(ins: Specs, outs: Specs) -> SpmdResult:
    """Shard every tensor on axis 0 as the outputs' batch axis is sharded; replicate the rest."""
    return _data_parallel("default_data_parallel", ins, outs, outs)


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
