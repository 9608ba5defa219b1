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
  with tp > cp, keeps the sequence over tp alone and gathers it over cp). One that holds ``a``
  alone and is whole over ``b`` is not: read as the co-shard, a co-shard a rule made in passing
  (the batch over ``(dp, tp)`` in an imported attention) would spread over the whole plan, each
  such tensor sliced onto it. Where the strategy wants one on the co-shard it marks it so.
- An op whose other tensors hold ``b`` alone on an axis of their own (the vocab-parallel
  embedding's weight beside the co-sharded gradient) is asked on the real mesh with the co-shard
  read as ``a`` alone (:class:`Trim`): ``b`` is gathered from the sequence, ``a`` kept.

An op that holds ``a`` or ``b`` otherwise (the experts: batch over ``dp``, experts over ``ep``)
is asked on the real mesh as before.

Each co-shard is judged on its own, and every one that qualifies is fused (or trimmed) in the
same question: under ``--strategy dp,ep,megatron,sp,cp`` the residual stream is ``[(dp, ep), (cp,
tp), H]``, two co-shards. Fusing only the first (the batch) left the rule reading the sequence's
``(cp, tp)`` as its largest dim, so every norm, add and MoE op around the experts gathered the
sequence over cp (or tp) and sliced it again (docs/experts.md, "Under cp": two co-shards).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from spmdkit.core.dist_attr import Entry, Partial, TensorDistAttr, dims_entry, entry_dims
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


def _coshards(specs: Sequence[DistTensorSpec]) -> list[tuple[int, int]]:
    """The co-shards ``(a, b)`` (an entry's first two mesh dims) the tensors hold, in the order
    met, each once."""
    out: list[tuple[int, int]] = []
    for s in specs:
        for e in s.dist_attr.dims_mapping:
            if isinstance(e, tuple) and len(e) >= 2 and (e[0], e[1]) not in out:
                out.append((e[0], e[1]))
    return out


def _fuses(specs: Sequence[DistTensorSpec], a: int, b: int) -> bool:
    """The tensors hold ``a`` and ``b`` only as the co-shard ``(a, b)`` (and partial over both or
    neither, with one reduce type) or as ``a`` alone on an axis and partial over ``b`` alone."""
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
                    return False  # b without a, a inside an entry, or a alone and not partial over b alone
                alone = True
        if not alone and ((a in pt) != (b in pt) or (a in pt and pt[a] != pt[b])):
            return False  # partial over one of the two only
    return True


def _pairs(args: Sequence[Any]) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """(the co-shards the rule is asked with fused, those it is asked with trimmed to their major
    dim) of the rule's tensor arguments: each co-shard on its own (the batch over ``(dp, ep)``
    and the sequence over ``(cp, tp)`` of one tensor are two, each fused), a co-shard sharing a
    mesh dim with one taken before it left as it is."""
    specs = _specs(args)
    fuse: list[tuple[int, int]] = []
    trim: list[tuple[int, int]] = []
    used: set[int] = set()
    for a, b in _coshards(specs):
        if a in used or b in used:
            continue
        if _fuses(specs, a, b):
            fuse.append((a, b))
        elif _minor_elsewhere(specs, a, b):
            trim.append((a, b))
        else:
            continue
        used.update((a, b))
    return tuple(fuse), tuple(trim)


def fused_pairs(args: Sequence[Any]) -> tuple[tuple[int, int], ...]:
    """The co-shards ``(a, b)`` whose mesh dims the rule's tensor arguments hold only as that
    co-shard (and partial over both or neither, with one reduce type) or as ``a`` alone on an
    axis and partial over ``b`` alone (read as the co-shard: its reduction over ``b`` becomes a
    reduce-scatter onto it); empty where there is none. Several co-shards (the batch over ``(dp,
    ep)`` and the sequence over ``(cp, tp)``) are fused together, each pair on its own."""
    return _pairs(args)[0]


class Fusion:
    """The real mesh, the fused one (each pair ``(a, b)`` one dim, at ``a``'s place) and the maps."""

    def __init__(self, mesh: ProcessMesh, pairs: tuple[tuple[int, int], ...]) -> None:
        self.mesh, self.pairs = mesh, pairs
        minor = {b for _, b in pairs}
        self.minor = {a: b for a, b in pairs}  # major -> minor
        shape = list(mesh.shape)
        names = list(mesh.dim_names)
        for a, b in pairs:
            shape[a] *= shape[b]
            names[a] = f"{names[a]}x{names[b]}"
        self.back = [d for d in range(mesh.ndim) if d not in minor]  # fused dim -> real dim
        self.fused = ProcessMesh([shape[d] for d in self.back], dim_names=[names[d] for d in self.back])
        self.to = [d - sum(m < d for m in minor) for d in range(mesh.ndim)]  # real dim -> fused dim (a minor: unused)
        # each map is a function of the dist attr alone: the repeated layers map few, once each
        self._in: Recent[TensorDistAttr] = Recent(4096)
        self._out: Recent[TensorDistAttr] = Recent(4096)

    @staticmethod
    def of(mesh: ProcessMesh, pairs: tuple[tuple[int, int], ...]) -> Fusion:
        """The fusion of ``pairs`` on ``mesh``, made once (with its maps' memos)."""
        return _FUSIONS.get((mesh, pairs), lambda: Fusion(mesh, pairs))

    def attr_in(self, attr: TensorDistAttr) -> TensorDistAttr:
        got = self._in.known(attr)  # hundreds of thousands of calls a search: the look-up alone first
        return got if got is not None else self._in.get(attr, lambda: self._attr_in(attr))

    def attr_out(self, attr: TensorDistAttr) -> TensorDistAttr:
        got = self._out.known(attr)
        return got if got is not None else self._out.get(attr, lambda: self._attr_out(attr))

    def _attr_in(self, attr: TensorDistAttr) -> TensorDistAttr:
        to, minor = self.to, self.minor.values()
        dm = [dims_entry([to[d] for d in entry_dims(e) if d not in minor]) for e in attr.dims_mapping]
        pt: Partial = tuple((to[d], r) for d, r in attr.partial if d not in minor)
        return TensorDistAttr.unchecked(self.fused, tuple(dm), pt)

    def _real(self, d: int) -> tuple[int, ...]:
        """The real mesh dims of fused dim ``d``: a pair's two, major first, or the one."""
        r = self.back[d]
        return (r, self.minor[r]) if r in self.minor else (r,)

    def _attr_out(self, attr: TensorDistAttr) -> TensorDistAttr:
        dm = [dims_entry([r for d in entry_dims(e) for r in self._real(d)]) for e in attr.dims_mapping]
        pt = sorted((r, t) for d, t in attr.partial for r in self._real(d))
        return TensorDistAttr.unchecked(self.mesh, tuple(dm), tuple(pt))

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


#: fusions by (mesh, pairs), each with its maps' memos (emptied with the engine's memo tables)
_FUSIONS: Recent[Fusion] = Recent(64)


def _minor_elsewhere(specs: Sequence[DistTensorSpec], a: int, b: int) -> bool:
    """A tensor holds ``b`` alone on an axis of its own (a tensor-parallel weight beside the
    sequence co-sharded ``(cp, tp)``), and every tensor ``a`` only in the co-shard ``(a, b)`` or
    alone (and ``b`` only there or alone)."""
    elsewhere = False
    for s in specs:
        for e in s.dist_attr.dims_mapping:
            ds = entry_dims(e)
            if ds == (a, b) or ds == (a,):
                continue
            if ds == (b,):
                elsewhere = True
            elif a in ds or b in ds:
                return False
    return elsewhere


class Trim:
    """Each co-shard ``(a, b)`` of ``pairs`` read as ``a`` alone: an op whose other tensors hold
    ``b`` on an axis of their own is asked with ``b`` gathered from the co-sharded axis
    (Megatron's sequence parallelism: the sequence all-gathered over tp before a tensor-parallel
    op), rather than the co-shard read as its largest dim (which, with tp > cp, keeps the sequence
    over tp and gathers it over cp)."""

    def __init__(self, pairs: tuple[tuple[int, int], ...]) -> None:
        self.major: dict[tuple[int, ...], Entry] = {(a, b): a for a, b in pairs}

    def arg_in(self, x: Any) -> Any:
        if isinstance(x, DistTensorSpec):
            attr = x.dist_attr
            dm = tuple(self.major.get(entry_dims(e), e) for e in attr.dims_mapping)
            if dm == attr.dims_mapping:
                return x
            return DistTensorSpec(x.shape, TensorDistAttr.unchecked(attr.mesh, dm, attr.partial))
        if isinstance(x, list):
            return [self.arg_in(y) for y in x]
        return x


def infer_fused(fn: Callable[..., SpmdResult], args: Sequence[Any], mesh: ProcessMesh) -> SpmdResult:
    """``fn(*args)`` (a rule's infer function), on the fused mesh where the tensors hold two mesh
    dims only as one co-shard (:func:`fused_pairs`: each such pair fused), with the co-shards
    whose minor dim another tensor holds alone read as their major dim (:class:`Trim`), else as
    it is."""
    fuse, trim = _pairs(args)
    if trim:
        t = Trim(trim)
        args = [t.arg_in(x) for x in args]
    if not fuse:
        return fn(*args)
    f = Fusion.of(mesh, fuse)
    # a co-shard of three dims ((cp, ep, tp): ep carved from the cp ranks, under sp) is a pair on
    # the fused mesh ((cp x ep, tp)): asked again there, each level one fewer mesh dim
    res = infer_fused(fn, [f.arg_in(x) for x in args], f.fused)
    return SpmdResult([f.res_out(x) for x in res.inputs], [f.res_out(x) for x in res.outputs])


__all__ = ["Fusion", "Trim", "fused_pairs", "infer_fused"]
