"""Collectives as NCCL runs them: the one time model of every collective the step pays (the
plan's reshards, the collectives inside kernels, the DDP / FSDP gradient buckets, the pipeline's
sends). Standard library only. docs/devices.md, "Communication".

- :class:`Group`: the ranks of one collective and how they sit on the nodes (:func:`group_of`:
  from the mesh shape, the mesh dims of the group and the ranks per node; the last mesh dim is
  the innermost, as :func:`spmdkit.cost.devices.cost_model` places them).
- :class:`Fabric`: a machine's links as NCCL sees them: NVLink per direction per GPU, the NIC
  per GPU (one per GPU, as on DGX A100 / H100), the bus-bandwidth efficiency each reaches on large
  messages (nccl-tests), NVLink SHARP (NVLS) where the NVSwitch has it, and what ``spmdkit
  calibrate`` measured (:mod:`spmdkit.cost.measured`).
- :func:`collective_time` (op, bytes, group, fabric, share): the time of one call. Measured
  points for (op, ranks, scope) are interpolated in log-log space over bytes; otherwise each
  algorithm NCCL has for the op (ring; tree for an all-reduce across nodes; NVLS for an
  all-reduce in an H100 / H200 node) with each protocol (LL, LL128, Simple) is timed as
  ``latency + factor · S / busbw`` and the fastest taken, as NCCL's tuner picks
  (``src/graph/tuning.cc``): latency = base + steps x per-step hardware latency, NVLink steps
  and network steps apart; ``busbw`` the ring's slowest hop: NVLink at its efficiency inside a
  node, ``per_node x NIC`` across nodes (a group with ``per_node`` ranks in each node crosses on
  that many NICs), divided by ``share`` (groups that use the same NICs at the same time).
- :class:`NcclCostModel`: a :class:`~spmdkit.core.reshard.CostModel` whose
  ``collective_time`` is :func:`collective_time` on a mesh; the plan carries it
  (``plan.cost``), so every caller times its collectives through this one function.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from spmdkit.core.reshard import CostModel
from spmdkit.cost.measured import CollectivePoint, Measured

# -- NCCL's tuning constants (NVIDIA/nccl src/graph/tuning.cc, 2.19-2.21; microseconds) ----------
#: protocols: base latency of a ring / tree call, and the bandwidth share each reaches (LL: 8-byte
#: lines carrying 4 bytes of data and 4 of flag; LL128: 120 of every 128 bytes data; Simple: all)
PROTOCOLS = ("LL", "LL128", "Simple")
BASE_LAT_US = {"ring": (6.6, 14.0, 8.4), "tree": (6.8, 14.0, 8.4), "nvls": (0.0, 0.0, 23.0)}
PROTO_BW = (0.5, 120 / 128, 1.0)
#: per-step hardware latency: over NVLink, over the network (hwLat[NVLINK] / hwLat[NET])
HW_LAT_US = {"ring": ((0.6, 1.9, 3.4), (2.7, 4.0, 14.0)),
             "tree": ((0.6, 1.25, 4.0), (5.0, 8.5, 14.0)),
             "nvls": ((0.0, 0.0, 25.0), (0.0, 0.0, 18.0))}
#: NCCL's tree all-reduce model: ``busBw * 0.92`` of the ring's (tuning.cc "model refinements")
TREE_BW = 0.92

#: busbw / link bandwidth that nccl-tests reach on large messages (docs/devices.md): DGX A100
#: all_reduce ~230 GB/s of NVLink3's 300 (0.77); DGX H100 ring ~360 of NVLink4's 450 (0.80);
#: across nodes ~23 GB/s of a 25 GB/s HDR port and ~46 of a 50 GB/s NDR port (0.92)
NVLINK_EFF = {300e9: 0.77, 450e9: 0.80}
NVLINK_EFF_OTHER = 0.78
NIC_EFF = 0.92
#: NVLS (NVLink SHARP, NVSwitch gen 3: DGX H100 / H200, NCCL >= 2.17): all_reduce busbw ~480 GB/s
#: in an 8-GPU node (nccl-tests), 480 / 450 of NVLink4 per direction; in a node of >= 4 ranks
NVLS_MIN_NVLINK = 450e9
NVLS_BUSBW = 480 / 450
NVLS_MIN_RANKS = 4

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


@dataclass(frozen=True)
class Group:
    """``ranks`` in one collective, ``per_node`` of them in each node they span."""

    ranks: int
    per_node: int

    @property
    def nodes(self) -> int:
        return -(-self.ranks // max(1, self.per_node))

    @property
    def scope(self) -> str:
        return "intra_node" if self.nodes <= 1 else "inter_node"


def group_of(mesh_shape: Sequence[int], dims: Sequence[int], ranks_per_node: int) -> Group:
    """The group of the mesh dims ``dims`` (row-major ranks, the last dim innermost; node k holds
    ranks ``k·rpn .. (k+1)·rpn - 1``): its size and the members rank 0's group has in node 0."""
    ranks = math.prod(mesh_shape[d] for d in dims)
    strides = [math.prod(mesh_shape[d + 1:]) for d in range(len(mesh_shape))]
    rpn = max(1, ranks_per_node)

    def count(k: int, base: int) -> int:
        if k == len(dims):
            return 1
        d, total, c = dims[k], 0, 0
        while c < mesh_shape[d] and base + c * strides[d] < rpn:
            total += count(k + 1, base + c * strides[d])
            c += 1
        return total

    per = count(0, 0) if ranks <= 1 << 16 else min(ranks, rpn)
    return Group(ranks, max(1, min(per, ranks)))


@dataclass(frozen=True)
class Fabric:
    """A machine's links as the collectives see them (bytes/s per direction per GPU)."""

    nvlink_bps: float
    nic_bps: float
    ranks_per_node: int = 8
    nvlink_eff: float = NVLINK_EFF_OTHER
    nic_eff: float = NIC_EFF
    nvls: bool = False
    measured: tuple[CollectivePoint, ...] = ()

    @classmethod
    def of(cls, nvlink_bps: float, nic_bps: float, ranks_per_node: int = 8,
           measured: Measured | None = None) -> Fabric:
        eff = next((e for bw, e in NVLINK_EFF.items() if abs(nvlink_bps - bw) < 1e6), NVLINK_EFF_OTHER)
        return cls(nvlink_bps, nic_bps, ranks_per_node, eff, NIC_EFF, nvlink_bps >= NVLS_MIN_NVLINK,
                   measured.collectives if measured is not None else ())


def _factor(op: str, n: int) -> float:
    """Bytes each rank moves per byte of its buffer (nccl-tests' busbw factor)."""
    if op == "send_recv":
        return 1.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    return (n - 1) / n


def _ring_busbw(g: Group, f: Fabric, share: float) -> float:
    """The ring's slowest hop: NVLink inside a node, the group's NICs of a node across nodes."""
    intra = f.nvlink_bps * f.nvlink_eff
    if g.nodes <= 1:
        return intra
    inter = g.per_node * f.nic_bps * f.nic_eff / max(1.0, share)
    return min(intra, inter) if g.per_node > 1 else inter


def _best(op: str, nbytes: float, g: Group, f: Fabric, share: float) -> float:
    n = g.ranks
    fac = _factor(op, n)
    inter_steps = 0 if g.nodes <= 1 else g.nodes - 1
    if op == "send_recv":
        steps, inter_steps = 1, (1 if g.nodes > 1 else 0)
    elif op == "all_to_all":
        steps, inter_steps = n - 1, (n - g.per_node if g.nodes > 1 else 0)
    else:
        k = 2 if op == "all_reduce" else 1
        steps, inter_steps = k * (n - 1), k * inter_steps
    bw = _ring_busbw(g, f, share)
    if op == "all_to_all" and g.nodes > 1:
        # each rank sends (per_node - 1)/n of its buffer over NVLink and (n - per_node)/n over its NIC
        t_in = (g.per_node - 1) / n * nbytes / (f.nvlink_bps * f.nvlink_eff)
        t_out = (n - g.per_node) / n * nbytes / (f.nic_bps * f.nic_eff / max(1.0, share))
        bw = fac * nbytes / max(t_in, t_out) if max(t_in, t_out) > 0 else bw
    cands: list[tuple[str, float, int, int]] = [("ring", bw, steps - inter_steps, inter_steps)]
    if op == "all_reduce" and g.nodes > 1:
        tree_lat_steps = 2 * (g.per_node - 1), 2 * max(1, math.ceil(math.log2(g.nodes)))
        cands.append(("tree", bw * TREE_BW, *tree_lat_steps))
    if op == "all_reduce" and f.nvls and g.nodes <= 1 and n >= NVLS_MIN_RANKS:
        cands.append(("nvls", f.nvlink_bps * NVLS_BUSBW, 1, 0))
    best = math.inf
    for algo, busbw, s_in, s_out in cands:
        for p in range(len(PROTOCOLS)):
            if algo == "nvls" and PROTOCOLS[p] != "Simple":
                continue
            lat = BASE_LAT_US[algo][p] + s_in * HW_LAT_US[algo][0][p] + s_out * HW_LAT_US[algo][1][p]
            best = min(best, lat * 1e-6 + fac * nbytes / (busbw * PROTO_BW[p]))
    return best


def _interpolate(points: list[tuple[float, float]], nbytes: float) -> float:
    """Time at ``nbytes`` from (bytes, seconds) points sorted by bytes: log-log linear between
    points; below the smallest its time (latency-bound), above the largest its bandwidth."""
    xs = [b for b, _ in points]
    if nbytes <= xs[0]:
        return points[0][1]
    if nbytes >= xs[-1]:
        b, t = points[-1]
        return t * nbytes / b
    i = bisect.bisect_left(xs, nbytes)
    (b0, t0), (b1, t1) = points[i - 1], points[i]
    if b1 == b0:
        return t1
    w = (math.log(nbytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
    return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0)))


def _measured(op: str, nbytes: float, g: Group, f: Fabric) -> float | None:
    """The measured points of ``op`` in the group's scope: those of its size, else of the nearest
    size with their bandwidth term scaled by the busbw factors."""
    pts = [p for p in f.measured if p.op == op and p.scope == g.scope]
    if not pts:
        return None
    near = min({p.ranks for p in pts}, key=lambda r: (abs(math.log(r / g.ranks)), r))
    xy = sorted((float(p.bytes), p.time_us * 1e-6) for p in pts if p.ranks == near)
    t = _interpolate(xy, nbytes)
    if near != g.ranks and near > 1 and g.ranks > 1:
        t *= _factor(op, g.ranks) / _factor(op, near)
    return t


def collective_time(op: str, nbytes: float, group: Group, fabric: Fabric, share: float = 1.0) -> float:
    """Seconds of one ``op`` (all_reduce, all_gather, reduce_scatter, all_to_all, send_recv) on
    ``group``; ``nbytes`` the buffer each rank holds (as :mod:`spmdkit.cost.measured` counts it);
    ``share``: groups crossing the same NICs at once (their bandwidth divided among them)."""
    if nbytes <= 0 or (group.ranks <= 1 and op != "send_recv"):
        return 0.0
    got = _measured(op, nbytes, group, fabric)
    if got is not None:
        return got * (max(1.0, share) if group.nodes > 1 else 1.0)
    return _best(op, nbytes, group, fabric, share)


def deduplicated_all_to_all(net_bytes: float, nvl_bytes: float, group: Group, fabric: Fabric, share: float = 1.0
                            ) -> float:
    """Seconds of DeepEP's normal (high-throughput) dispatch or combine on ``group``
    (deepseek-ai/DeepEP README: "normal kernels with NVLink and RDMA forwarding"): a rank sends
    each token once to every other node holding one of its experts, over its NIC (``net_bytes``),
    and once to every rank holding one, over NVLink (``nvl_bytes``: directly inside its node,
    forwarded by the receiving rank in another); the two run pipelined, so the slower link sets
    the time. Latency: one Simple-protocol step per remote node and per NVLink peer."""
    if group.ranks <= 1 or net_bytes + nvl_bytes <= 0:
        return 0.0
    t_nvl = nvl_bytes / (fabric.nvlink_bps * fabric.nvlink_eff)
    t_net = 0.0 if group.nodes <= 1 else net_bytes / (fabric.nic_bps * fabric.nic_eff / max(1.0, share))
    p = PROTOCOLS.index("Simple")
    lat = (BASE_LAT_US["ring"][p] + (group.nodes - 1) * HW_LAT_US["ring"][1][p]
           + (min(group.ranks, group.per_node) - 1) * HW_LAT_US["ring"][0][p])
    return lat * 1e-6 + max(t_net, t_nvl)


@dataclass(frozen=True)
class NcclCostModel(CostModel):
    """A device's links on a mesh (:func:`spmdkit.cost.devices.cost_model`): ``links`` per mesh
    dim as before (for what reads them), and :meth:`collective_time` by :func:`collective_time`."""

    mesh_shape: tuple[int, ...] = ()
    fabric: Fabric = field(default_factory=lambda: Fabric(450e9, 50e9))

    def group(self, mesh_dims: Sequence[int]) -> Group:
        return group_of(self.mesh_shape, tuple(mesh_dims), self.fabric.ranks_per_node)

    def collective_time(self, kind: str, mesh_dims: Sequence[int], buffer_bytes: float,
                        mesh_shape: Sequence[int] | None = None, share: float = 1.0) -> float:
        dims = tuple(mesh_dims)
        if not dims:
            return 0.0
        op = kind if kind in OPS else "all_reduce"
        return collective_time(op, buffer_bytes, self.group(dims), self.fabric, share)


def buffer_bytes(kind: str, bytes_per_rank: float, n: int) -> float:
    """The buffer of a collective from the ring bytes each rank moves (the inverse of
    :func:`spmdkit.core.reshard.plan_reshard`'s formulas)."""
    if n <= 1:
        return 0.0
    return bytes_per_rank / _factor(kind if kind in OPS else "all_reduce", n)


def time_of(cost: CostModel, kind: str, mesh_dims: Sequence[int], nbytes: float,
            mesh_shape: Sequence[int], share: float = 1.0) -> float:
    """The one entry every caller uses: ``cost.collective_time`` (NCCL's model under a device's
    :class:`NcclCostModel`, the alpha-beta ring under a plain one)."""
    if isinstance(cost, NcclCostModel):
        return cost.collective_time(kind, mesh_dims, nbytes, mesh_shape, share)
    return cost.collective_time(kind, mesh_dims, nbytes, mesh_shape)


__all__ = ["OPS", "Fabric", "Group", "NcclCostModel", "buffer_bytes", "collective_time", "deduplicated_all_to_all",
           "group_of", "time_of"]
