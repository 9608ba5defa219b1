"""Reshard planning: from one dist attr to another on an N-D mesh, per-mesh-dim collectives
with their bytes per rank and an alpha-beta time. Standard library only.

``plan_reshard(src, dst, shape, itemsize, cost)`` returns the steps, in this order:

1. partial mesh dims ``dst`` does not keep: a reduce-scatter onto the axis ``dst`` shards with
   that mesh dim (where it is the next mesh dim of that axis), else an all-reduce (with the
   partial's reduce type; avg: a sum then a scale, same bytes);
2. mesh dims sharding an axis otherwise than in ``dst``: a co-shard is unwound minor dim
   first; a mesh dim that moves to another axis whose sharding it then extends is an
   all-to-all, otherwise an all-gather;
3. mesh dims ``dst`` shards with and the tensor does not yet: a local slice (no communication),
   co-shards built major first;
4. mesh dims ``dst`` marks partial that the tensor is not: ``to_partial`` (one rank keeps the
   value, the others zeros: no communication).

Every intermediate dist attr is legal. Bytes per rank are the ring formulas on the local
buffer of the group (uneven shards: the largest): all-reduce ``2(n-1)/n·S``, all-gather
``(n-1)/n·S_out``, reduce-scatter ``(n-1)/n·S_in``, all-to-all ``(n-1)/n·S``; time
``k·(n-1)·alpha + bytes·beta`` (k = 2 for an all-reduce). The cost model (docs/reshard.md)
has one link per mesh dim: by default a dim is intra-node (5 us, 150 GB/s) while the product
of the sizes from the innermost dim up to it is at most 8, else inter-node (20 us, 25 GB/s).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from spmdkit.core.dist_attr import Entry, Partial, ReduceType, TensorDistAttr, dims_entry, entry_dims, largest_shard
from spmdkit.core.errors import InvalidAttributeError, InvalidMeshError
from spmdkit.core.mesh import ProcessMesh

INTRA = (5e-6, 1 / 150e9)
INTER = (20e-6, 1 / 25e9)


@dataclass(frozen=True)
class LinkCost:
    """Latency (s) and inverse bandwidth (s per byte) of one mesh dim's links."""

    alpha_s: float
    beta_s_per_byte: float


@dataclass(frozen=True)
class CostModel:
    """One :class:`LinkCost` per mesh dim."""

    links: tuple[LinkCost, ...]

    @classmethod
    def default(cls, mesh: ProcessMesh, intra_node: int = 8) -> CostModel:
        links: list[LinkCost] = []
        prod = 1
        for size in reversed(mesh.shape):
            prod *= size
            links.append(LinkCost(*(INTRA if prod <= intra_node else INTER)))
        return cls(tuple(reversed(links)))

    @classmethod
    def parse(cls, text: str, mesh: ProcessMesh, base: CostModel | None = None) -> CostModel:
        """``"tp=5us/150GB,dp=20us/25GB"`` (per mesh dim name or index: latency in s/ms/us/ns,
        bandwidth in B/KB/MB/GB per second); unnamed dims keep ``base``'s links (the defaults)."""
        links = list((base or cls.default(mesh)).links)
        units = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
        bw = {"B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            m = re.fullmatch(r"(\w+)=([\d.]+)(s|ms|us|ns)/([\d.]+)(B|KB|MB|GB|TB)", part)
            if m is None:
                raise InvalidAttributeError(f"--cost {part!r}: expected DIM=LATENCY/BANDWIDTH like tp=5us/150GB")
            dim = int(m.group(1)) if m.group(1).isdigit() else mesh.dim_index(m.group(1))
            if not 0 <= dim < mesh.ndim:
                raise InvalidMeshError(f"--cost {part!r}: the mesh has no dim {dim}")
            links[dim] = LinkCost(float(m.group(2)) * units[m.group(3)], 1 / (float(m.group(4)) * bw[m.group(5)]))
        return cls(tuple(links))

    def collective_time(self, kind: str, mesh_dims: Sequence[int], buffer_bytes: float,
                        mesh_shape: Sequence[int]) -> float:
        """Seconds of one collective over the groups of ``mesh_dims``: ``buffer_bytes`` the buffer
        each rank holds (all_reduce: the tensor; all_gather: the gathered output; reduce_scatter,
        all_to_all: the input; send_recv: the message). Here the alpha-beta ring,
        ``k(n-1)·alpha + k(n-1)/n·S·beta`` (k = 2 for an all-reduce; the mean latency and the
        slowest link of the dims); :class:`spmdkit.cost.collectives.NcclCostModel` (a device's
        links) times it as NCCL runs it."""
        dims = tuple(mesh_dims)
        if not dims or buffer_bytes <= 0:
            return 0.0
        a = sum(self.links[d].alpha_s for d in dims) / len(dims)
        b = max(self.links[d].beta_s_per_byte for d in dims)
        if kind == "send_recv":
            return a + buffer_bytes * b
        n = math.prod(mesh_shape[d] for d in dims)
        if n <= 1:
            return 0.0
        k = 2 if kind == "all_reduce" else 1
        return k * (n - 1) * a + round(k * (n - 1) / n * buffer_bytes) * b


@dataclass(frozen=True)
class Step:
    """One collective (or local step) over the groups of ``mesh_dims``."""

    kind: str
    mesh_dims: tuple[int, ...]
    tensor_axis: int | None
    bytes_per_rank: int
    time_s: float
    src: TensorDistAttr
    dst: TensorDistAttr
    dst_axis: int | None = None
    reduce_type: str | None = None

    def describe(self) -> str:
        names = self.src.mesh.dim_names
        n = 1
        for d in self.mesh_dims:
            n *= self.src.mesh.shape[d]
        over = "x".join(names[d] for d in self.mesh_dims)
        what = self.kind.replace("_", "-")
        if self.kind == "all_to_all":
            what += f" axis {self.tensor_axis}->{self.dst_axis}"
        elif self.tensor_axis is not None:
            what += f" axis {self.tensor_axis}"
        if self.reduce_type and self.reduce_type != "sum":
            what += f" ({self.reduce_type})"
        if self.bytes_per_rank == 0:
            return f"{what} over {over} (local)"
        return f"{what} over {over} ({n} ranks), {_fmt_bytes(self.bytes_per_rank)}/rank, {self.time_s * 1e6:.0f} us"


@dataclass(frozen=True)
class ReshardPlan:
    steps: tuple[Step, ...]

    @property
    def bytes_per_rank(self) -> int:
        return sum(s.bytes_per_rank for s in self.steps)

    @property
    def time_s(self) -> float:
        return sum(s.time_s for s in self.steps)

    def describe(self) -> str:
        return "; ".join(s.describe() for s in self.steps) or "nothing to do"


def _fmt_bytes(n: float) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{int(n)} B"


def local_bytes(dm: Sequence[Entry], shape: Sequence[int], mesh_shape: Sequence[int], itemsize: int) -> int:
    """Bytes of the largest local shard of a tensor sharded by ``dm``."""
    return itemsize * math.prod(largest_shard(dm, shape, mesh_shape))


class _State:
    def __init__(self, src: TensorDistAttr) -> None:
        self.mesh = src.mesh
        self.dims = [list(entry_dims(e)) for e in src.dims_mapping]
        self.partial: dict[int, ReduceType] = dict(src.partial)

    def attr(self) -> TensorDistAttr:
        pt: Partial = tuple(sorted(self.partial.items()))
        return TensorDistAttr.unchecked(self.mesh, tuple(dims_entry(d) for d in self.dims), pt)

    def axis_of(self, d: int) -> int | None:
        for i, ds in enumerate(self.dims):
            if d in ds:
                return i
        return None


def _without(attr: TensorDistAttr, d: int, axis: int | None, add: bool) -> TensorDistAttr:
    """``attr`` with mesh dim ``d`` no longer partial (``add``: now sharding ``axis`` as its
    minor dim), or (not ``add``) no longer sharding ``axis``."""
    dims = [list(entry_dims(e)) for e in attr.dims_mapping]
    pt = dict(attr.partial)
    if add:
        pt.pop(d, None)
        if axis is not None:
            dims[axis].append(d)
    elif axis is not None:
        dims[axis].remove(d)
    return TensorDistAttr.unchecked(attr.mesh, tuple(dims_entry(x) for x in dims), tuple(sorted(pt.items())))


def single_dim_steps(step: Step) -> tuple[Step, ...]:
    """A collective over several mesh dims (one group of their ranks: a data-parallel group
    folded over ``dp x ep``) as the same collective over each dim in turn, with the dist attrs
    between (bytes and time not split: 0): an all-reduce dim by dim, a reduce-scatter major dim
    first, an all-gather minor dim first (``mesh_dims`` are the co-shard's, major first). The
    result is the same; an executor with one process group per mesh dim runs it so."""
    if len(step.mesh_dims) < 2:
        return (step,)
    out: list[Step] = []
    cur = step.src
    if step.kind == "all_to_all":  # each dim moved in turn (mesh_dims in that order), minor off its axis
        want = [entry_dims(e) for e in step.dst.dims_mapping]
        for d in step.mesh_dims:
            held = [list(entry_dims(e)) for e in cur.dims_mapping]
            i = next(a for a, ds in enumerate(held) if d in ds)
            j = next(a for a, ds in enumerate(want) if d in ds)
            held[i].remove(d)
            held[j].append(d)
            nxt = TensorDistAttr.unchecked(cur.mesh, tuple(dims_entry(x) for x in held), cur.partial)
            out.append(Step("all_to_all", (d,), i, 0, 0.0, cur, nxt, j))
            cur = nxt
        return tuple(out)
    dims = step.mesh_dims if step.kind != "all_gather" else tuple(reversed(step.mesh_dims))
    for d in dims:
        nxt = _without(cur, d, step.tensor_axis, step.kind != "all_gather")
        out.append(Step(step.kind, (d,), step.tensor_axis, 0, 0.0, cur, nxt, step.dst_axis, step.reduce_type))
        cur = nxt
    return tuple(out)


def merge_groups(plan: ReshardPlan, groups: Sequence[tuple[int, ...]], shape: Sequence[int], itemsize: int,
                 cost: CostModel) -> ReshardPlan:
    """``plan`` with consecutive collectives of one kind over the mesh dims of a group (two or
    more dims: an all-reduce over each, a reduce-scatter over them major first onto one axis, an
    all-gather over them minor first off one, an all-to-all over each in any order off one axis
    or onto one: Megatron's ETP = 1 token dispatch over the ep x tp group) made one collective
    over the group's ranks, its bytes and time those of one ring (one all-to-all) over them. The
    longest group that matches wins: a dense gradient partial over ``dp``, ``cp`` and ``ep`` is
    one all-reduce over the three (``(dp, cp, ep)``), not one over dp x cp and one over ep."""
    steps = list(plan.steps)
    if len(steps) < 2 or not groups:
        return plan
    ms = steps[0].src.mesh.shape
    sizes = sorted({len(g) for g in groups if len(g) > 1}, reverse=True)
    out: list[Step] = []
    i = 0
    while i < len(steps):
        run, dims = next(((steps[i:i + k], d) for k in sizes
                          if (d := _group_of(steps[i:i + k], k, groups)) is not None), ([steps[i]], None))
        if dims is None:
            out.append(steps[i])
            i += 1
            continue
        s, t = run[0], run[-1]
        n = math.prod(ms[d] for d in dims)
        if s.kind == "all_gather":
            size = local_bytes(t.dst.dims_mapping, shape, ms, itemsize)
            b = round((n - 1) / n * size)
        else:
            size = local_bytes(s.src.dims_mapping, shape, ms, itemsize)
            b = round((2 if s.kind == "all_reduce" else 1) * (n - 1) / n * size)
        out.append(Step(s.kind, dims, s.tensor_axis, b, cost.collective_time(s.kind, dims, size, ms), s.src,
                        t.dst, t.dst_axis if s.kind == "all_to_all" else None, s.reduce_type))
        i += len(run)
    return ReshardPlan(tuple(out))


def _group_of(run: Sequence[Step], k: int, groups: Sequence[tuple[int, ...]]) -> tuple[int, ...] | None:
    """The mesh dims of the one collective ``run`` (``k`` consecutive steps) makes over a group
    of ``groups`` (:func:`merge_groups`), or None: the steps' own order (one dim after the
    other, as an executor replans it: :func:`single_dim_steps`), an all-gather's major first."""
    if len(run) < k:
        return None
    s = run[0]
    if any(t.kind != s.kind or t.reduce_type != s.reduce_type or len(t.mesh_dims) != 1 or not t.bytes_per_rank
           for t in run):
        return None
    if s.kind == "all_to_all":
        if len({t.dst_axis for t in run}) > 1 and len({t.tensor_axis for t in run}) > 1:
            return None
    elif any(t.tensor_axis != s.tensor_axis for t in run):
        return None
    dims = tuple(t.mesh_dims[0] for t in run)
    if s.kind in ("all_reduce", "all_to_all"):
        return dims if any(len(g) == k and set(g) == set(dims) for g in groups) else None
    if s.kind == "all_gather":
        dims = dims[::-1]
    return dims if dims in groups else None


def _slice_major(st: _State, want: list[int], target: int, d: int, steps: list[Step]) -> None:
    """Before mesh dim ``d`` moves onto axis ``target`` by all-to-all: the dims ``want`` puts
    before ``d`` there that the tensor does not use yet (replicated over them, not partial) are
    sliced onto it first, so the all-to-all lands ``d`` as the minor dim (and carries only the
    slice) instead of ``d`` being all-gathered and sliced again (experts co-sharded ``(tp, ep)``
    from tokens replicated over tp: docs/experts.md, ETP = 1)."""
    if d not in want:
        return
    major = want[: want.index(d)]
    have = st.dims[target]
    if major[: len(have)] != have:
        return
    free = major[len(have):]
    if not free or any(st.axis_of(m) is not None or m in st.partial for m in free):
        return
    for m in free:
        before = st.attr()
        st.dims[target].append(m)
        steps.append(Step("slice", (m,), target, 0, 0.0, before, st.attr()))


def plan_reshard(src: TensorDistAttr, dst: TensorDistAttr, shape: Sequence[int], itemsize: int = 4,
                 cost: CostModel | None = None) -> ReshardPlan:
    """The steps that turn a tensor distributed as ``src`` into one distributed as ``dst``."""
    if src.mesh != dst.mesh:
        raise InvalidMeshError(f"reshard: src lies on mesh {list(src.mesh.shape)}, dst on {list(dst.mesh.shape)}")
    if src.ndim != len(shape) or dst.ndim != len(shape):
        raise InvalidAttributeError(f"reshard: dims_mappings of {src.ndim} and {dst.ndim} entries for shape "
                                    f"{list(shape)}")
    if src == dst:
        return ReshardPlan(())
    mesh = src.mesh
    ms = mesh.shape
    cost = cost or CostModel.default(mesh)
    want = [list(entry_dims(e)) for e in dst.dims_mapping]
    want_partial = dict(dst.partial)
    st = _State(src)
    steps: list[Step] = []

    def lb() -> int:
        return local_bytes([dims_entry(x) for x in st.dims], shape, ms, itemsize)

    # 1. partial dims dst does not keep
    for d in sorted(st.partial):
        if want_partial.get(d) == st.partial[d]:
            continue
        n = ms[d]
        before = st.attr()
        size = lb()
        rt = st.partial.pop(d)
        target = next((i for i, w in enumerate(want) if d in w), None)
        if target is not None and want[target][: len(st.dims[target]) + 1] == [*st.dims[target], d]:
            st.dims[target].append(d)
            b = round((n - 1) / n * size)
            steps.append(Step("reduce_scatter", (d,), target, b, cost.collective_time("reduce_scatter", (d,), size, ms),
                              before, st.attr(), None, rt.value))
        else:
            b = round(2 * (n - 1) / n * size)
            steps.append(Step("all_reduce", (d,), None, b, cost.collective_time("all_reduce", (d,), size, ms),
                              before, st.attr(), None, rt.value))
    # 2. shardings dst does not have: unwind minor first
    for i in range(len(st.dims)):
        keep = 0
        while keep < len(st.dims[i]) and keep < len(want[i]) and st.dims[i][keep] == want[i][keep]:
            keep += 1
        while len(st.dims[i]) > keep:
            d = st.dims[i][-1]
            n = ms[d]
            target = next((j for j, w in enumerate(want) if d in w), None)
            if target is not None and target != i:
                _slice_major(st, want[target], target, d, steps)
            before = st.attr()
            size = lb()
            if target is not None and target != i and want[target][: len(st.dims[target]) + 1] == [
                    *st.dims[target], d]:
                st.dims[i].pop()
                st.dims[target].append(d)
                b = round((n - 1) / n * size)
                steps.append(Step("all_to_all", (d,), i, b, cost.collective_time("all_to_all", (d,), size, ms),
                                  before, st.attr(), target))
            else:
                st.dims[i].pop()
                out = lb()
                b = round((n - 1) / n * out)
                steps.append(Step("all_gather", (d,), i, b, cost.collective_time("all_gather", (d,), out, ms),
                                  before, st.attr()))
    # 3. shardings dst adds: local slices, major first
    for i, w in enumerate(want):
        for d in w[len(st.dims[i]):]:
            before = st.attr()
            st.dims[i].append(d)
            steps.append(Step("slice", (d,), i, 0, 0.0, before, st.attr()))
    # 4. partial dims dst adds
    for d, rt in sorted(want_partial.items()):
        if st.partial.get(d) != rt:
            before = st.attr()
            st.partial[d] = rt
            steps.append(Step("to_partial", (d,), None, 0, 0.0, before, st.attr(), None, rt.value))
    final = st.attr()
    if final != dst:  # pragma: no cover - the phases above always reach dst
        raise InvalidAttributeError(f"reshard: could not reach {dst} from {src} (got {final})")
    return ReshardPlan(tuple(steps))


__all__ = ["CostModel", "LinkCost", "ReshardPlan", "Step", "local_bytes", "merge_groups", "plan_reshard",
           "single_dim_steps"]
