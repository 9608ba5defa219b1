"""Two mesh dims read as one: an op whose tensors hold mesh dims ``a`` and ``b`` only together
(as the co-shard ``(a, b)``, ``a`` major, and partial over both or neither) is asked its rule on
the mesh with ``a`` and ``b`` fused into one dim of size ``|a| x |b|``, and the answer mapped back.

Why: expert parallelism (``--strategy dp,ep``) folds data parallelism over ``dp x ep`` outside the
experts, as Megatron-Core does: the batch axis is co-sharded ``(dp, ep)``. Most rules read a
co-shard as its largest mesh dim (Paddle's merges, ``Coshard.LARGEST``), so a batch co-sharded
over two dims would be gathered over one of them at every op. A co-shard ``(a, b)`` splits an axis
into ``|a| x |b|`` pieces, piece ``i_a x |b| + i_b`` on the rank at ``(i_a, i_b)``: exactly a
sharding over one mesh dim of that size whose index is ``(i_a, i_b)`` read major first, and a
partial over both dims is a partial over that one. So any sound answer on the fused mesh is a sound
answer on the real one, whatever the rule (no rule is changed; the simulator checks the plans).
An op that holds ``a`` or ``b`` otherwise (the experts: batch over ``dp``, experts over ``ep``)
is asked on the real mesh as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from spmdkit.core.dist_attr import Partial, TensorDistAttr, dims_entry, entry_dims
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult


def _specs(args: Sequence[Any]) -> list[DistTensorSpec]:
    out: list[DistTensorSpec] = []
    for a in args:
        if isinstance(a, DistTensorSpec):
            out.append(a)
        elif isinstance(a, list):
            out.extend(x for x in a if isinstance(x, DistTensorSpec))
    return out


def fused_pair(args: Sequence[Any]) -> tuple[int, int] | None:
    """The mesh dims ``(a, b)`` the rule's tensor arguments hold only as the co-shard ``(a, b)``
    (and partial over both or neither, with one reduce type), or None (no co-shard, or one of the
    two held otherwise)."""
    specs = _specs(args)
    pair: tuple[int, int] | None = None
    for s in specs:
        for e in s.dist_attr.dims_mapping:
            if isinstance(e, tuple) and len(e) >= 2:
                pair = (e[0], e[1])
                break
        if pair is not None:
            break
    if pair is None:
        return None
    a, b = pair
    for s in specs:
        attr = s.dist_attr
        for e in attr.dims_mapping:
            ds = entry_dims(e)
            if a in ds or b in ds:
                i = ds.index(a) if a in ds else -1
                if i < 0 or i + 1 >= len(ds) or ds[i + 1] != b:
                    return None
        pt = attr.partial_status
        if (a in pt) != (b in pt) or (a in pt and pt[a] != pt[b]):
            return None
    return pair


class Fusion:
    """The real mesh, the fused one (``a`` and ``b`` one dim, at ``a``'s place) and the maps."""

    def __init__(self, mesh: ProcessMesh, a: int, b: int) -> None:
        self.mesh, self.a, self.b = mesh, a, b
        shape = list(mesh.shape)
        names = list(mesh.dim_names)
        shape[a] *= shape[b]
        names[a] = f"{names[a]}x{names[b]}"
        del shape[b], names[b]
        self.fused = ProcessMesh(shape, dim_names=names)
        self.to = [d - (d > b) for d in range(mesh.ndim)]  # real dim -> fused dim (b: unused)
        self.back = [d for d in range(mesh.ndim) if d != b]  # fused dim -> real dim

    def attr_in(self, attr: TensorDistAttr) -> TensorDistAttr:
        dm = []
        for e in attr.dims_mapping:
            ds = [self.to[d] for d in entry_dims(e) if d != self.b]
            dm.append(dims_entry(ds))
        pt: Partial = tuple((self.to[d], r) for d, r in attr.partial if d != self.b)
        return TensorDistAttr.unchecked(self.fused, tuple(dm), pt)

    def attr_out(self, attr: TensorDistAttr) -> TensorDistAttr:
        a, b = self.a, self.b
        dm = []
        for e in attr.dims_mapping:
            ds: list[int] = []
            for d in entry_dims(e):
                ds.extend((a, b) if self.back[d] == a else (self.back[d],))
            dm.append(dims_entry(ds))
        pt: list[tuple[int, Any]] = []
        for d, r in attr.partial:
            pt.extend(((a, r), (b, r)) if self.back[d] == a else ((self.back[d], r),))
        return TensorDistAttr.unchecked(self.mesh, tuple(dm), tuple(sorted(pt)))

    def arg_in(self, x: Any) -> Any:
        if isinstance(x, DistTensorSpec):
            return DistTensorSpec(x.shape, self.attr_in(x.dist_attr))
        if isinstance(x, list):
            return [self.arg_in(y) for y in x]
        return x

    def res_out(self, x: Any) -> Any:
        if isinstance(x, TensorDistAttr):
            return self.attr_out(x)
        if isinstance(x, (tuple, list)):
            return tuple(self.res_out(y) for y in x)
        return x


def infer_fused(fn: Callable[..., SpmdResult], args: Sequence[Any], mesh: ProcessMesh) -> SpmdResult:
    """``fn(*args)`` (a rule's infer function), on the fused mesh where the tensors hold two mesh
    dims only as one co-shard (:func:`fused_pair`), else as it is."""
    pair = fused_pair(args)
    if pair is None:
        return fn(*args)
    f = Fusion(mesh, *pair)
    res = fn(*[f.arg_in(x) for x in args])
    return SpmdResult([f.res_out(x) for x in res.inputs], [f.res_out(x) for x in res.outputs])


__all__ = ["Fusion", "fused_pair", "infer_fused"]
