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

The same holds for context parallelism with Megatron's sequence parallelism (``--strategy
megatron,sp,cp``): the residual stream's sequence is co-sharded ``(cp, tp)``. Two relaxations
make the question fit the ops there; both only change what the rule is asked, never its answer's
soundness (the planner reshards each input from how it is held to what the answer needs):

- A tensor that holds ``a`` alone on an axis and is partial over ``b`` (the row-parallel
  projection's output: sequence over cp, partial over tp) is read on the fused mesh
  as if it held the co-shard: the answer asks it reduce-scattered over ``b`` onto the co-shard, as
  Megatron's sequence parallelism does, instead of the co-shard read as its largest dim (which,
  with tp > cp, keeps the sequence over tp alone and gathers it over cp).
- An op whose other tensors hold ``b`` alone on an axis of their own (the vocab-parallel
  embedding's weight beside the co-sharded gradient) is asked on the real mesh with the co-shard
  read as ``a`` alone (:class:`Trim`): ``b`` is gathered from the sequence, ``a`` kept.

An op that holds ``a`` or ``b`` otherwise (the experts: batch over ``dp``, experts over ``ep``)
is asked on the real mesh as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from spmdkit.core.dist_attr import Partial, TensorDistAttr, dims_entry, entry_dims
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.memo import Recent


def _specs(args: Sequence[Any]) -> list[DistTensorSpec]:
    out: list[DistTensorSpec] = []
    for a in args:
        if isinstance(a, DistTensorSpec):
            out.append(a)
        elif isinstance(a, list):
            out.extend(x for x in a if isinstance(x, DistTensorSpec))
    return out


def _coshard(specs: Sequence[DistTensorSpec]) -> tuple[int, int] | None:
    for s in specs:
        for e in s.dist_attr.dims_mapping:
            if isinstance(e, tuple) and len(e) >= 2:
                return e[0], e[1]
    return None


def fused_pair(args: Sequence[Any]) -> tuple[int, int] | None:
    """The mesh dims ``(a, b)`` the rule's tensor arguments hold only as the co-shard ``(a, b)``
    (and partial over both or neither, with one reduce type) or as ``a`` alone on an axis and
    partial over ``b`` alone (read as the co-shard: its reduction over ``b`` becomes a
    reduce-scatter onto it), or None (no co-shard, or one of the two held otherwise)."""
    specs = _specs(args)
    pair = _coshard(specs)
    if pair is None:
        return None
    a, b = pair
    for s in specs:
        attr = s.dist_attr
        pt = attr.partial_status
        alone = False  # the tensor holds a alone on an axis (and is partial over b alone)
        for e in attr.dims_mapping:
            ds = entry_dims(e)
            if a in ds or b in ds:
                i = ds.index(a) if a in ds else -1
                if i >= 0 and i + 1 < len(ds) and ds[i + 1] == b:
                    continue  # the co-shard itself
                if i < 0 or i + 1 < len(ds) or a in pt or b not in pt:
                    return None  # b without a, a inside an entry, or a alone and not partial over b alone
                alone = True
        if not alone and ((a in pt) != (b in pt) or (a in pt and pt[a] != pt[b])):
            return None  # partial over one of the two only
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
        # each map is a function of the dist attr alone: the repeated layers map few, once each
        self._in: Recent[TensorDistAttr] = Recent(4096)
        self._out: Recent[TensorDistAttr] = Recent(4096)

    @staticmethod
    def of(mesh: ProcessMesh, a: int, b: int) -> Fusion:
        """The fusion of ``a`` and ``b`` on ``mesh``, made once (with its maps' memos)."""
        return _FUSIONS.get((mesh, a, b), lambda: Fusion(mesh, a, b))

    def attr_in(self, attr: TensorDistAttr) -> TensorDistAttr:
        got = self._in.known(attr)  # hundreds of thousands of calls a search: the look-up alone first
        return got if got is not None else self._in.get(attr, lambda: self._attr_in(attr))

    def attr_out(self, attr: TensorDistAttr) -> TensorDistAttr:
        got = self._out.known(attr)
        return got if got is not None else self._out.get(attr, lambda: self._attr_out(attr))

    def _attr_in(self, attr: TensorDistAttr) -> TensorDistAttr:
        dm = []
        for e in attr.dims_mapping:
            ds = [self.to[d] for d in entry_dims(e) if d != self.b]
            dm.append(dims_entry(ds))
        pt: Partial = tuple((self.to[d], r) for d, r in attr.partial if d != self.b)
        return TensorDistAttr.unchecked(self.fused, tuple(dm), pt)

    def _attr_out(self, attr: TensorDistAttr) -> TensorDistAttr:
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


#: fusions by (mesh, a, b), each with its maps' memos (emptied with the engine's memo tables)
_FUSIONS: Recent[Fusion] = Recent(64)


def minor_elsewhere(args: Sequence[Any]) -> tuple[int, int] | None:
    """The co-shard ``(a, b)`` of a tensor argument where another holds ``b`` alone on an axis of
    its own (a tensor-parallel weight beside the sequence co-sharded ``(cp, tp)``), ``a`` only in
    the co-shard or alone; or None."""
    specs = _specs(args)
    pair = _coshard(specs)
    if pair is None:
        return None
    a, b = pair
    elsewhere = False
    for s in specs:
        for e in s.dist_attr.dims_mapping:
            ds = entry_dims(e)
            if ds == (a, b) or ds == (a,):
                continue
            if ds == (b,):
                elsewhere = True
            elif a in ds or b in ds:
                return None
    return pair if elsewhere else None


class Trim:
    """The co-shard ``(a, b)`` read as ``a`` alone: an op whose other tensors hold ``b`` on an
    axis of their own is asked with ``b`` gathered from the co-sharded axis (Megatron's sequence
    parallelism: the sequence all-gathered over tp before a tensor-parallel op), rather than the
    co-shard read as its largest dim (which, with tp > cp, keeps the sequence over tp and gathers
    it over cp)."""

    def __init__(self, a: int, b: int) -> None:
        self.a, self.b = a, b

    def arg_in(self, x: Any) -> Any:
        if isinstance(x, DistTensorSpec):
            attr = x.dist_attr
            dm = tuple(self.a if entry_dims(e) == (self.a, self.b) else e for e in attr.dims_mapping)
            if dm == attr.dims_mapping:
                return x
            return DistTensorSpec(x.shape, TensorDistAttr.unchecked(attr.mesh, dm, attr.partial))
        if isinstance(x, list):
            return [self.arg_in(y) for y in x]
        return x


def infer_fused(fn: Callable[..., SpmdResult], args: Sequence[Any], mesh: ProcessMesh) -> SpmdResult:
    """``fn(*args)`` (a rule's infer function), on the fused mesh where the tensors hold two mesh
    dims only as one co-shard (:func:`fused_pair`), else as it is."""
    pair = fused_pair(args)
    if pair is None:
        trim = minor_elsewhere(args)
        if trim is not None:
            t = Trim(*trim)
            return fn(*[t.arg_in(x) for x in args])
        return fn(*args)
    f = Fusion.of(mesh, *pair)
    res = fn(*[f.arg_in(x) for x in args])
    return SpmdResult([f.res_out(x) for x in res.inputs], [f.res_out(x) for x in res.outputs])


__all__ = ["Fusion", "Trim", "fused_pair", "infer_fused", "minor_elsewhere"]
