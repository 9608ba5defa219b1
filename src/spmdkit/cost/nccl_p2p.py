"""The CTAs (thread blocks, one SM each) NCCL's all-to-all launches: its grouped send/recv kernel
(``ncclDevKernel_SendRecv``) as NCCL 2.25-2.28 schedules it. Standard library only.
docs/experts.md, "NCCL's SMs".

An all-to-all of ``n`` ranks (torch's ``all_to_all_single``: ``ncclGroupStart``, a send and a
receive per peer, ``ncclGroupEnd``) is one kernel of ``countOneBits(plan->channelMask)`` CTAs of
``NCCL_MAX_NTHREADS`` = 640 threads, one per p2p channel holding work (NVIDIA/nccl
``src/enqueue.cc`` ``ncclLaunchKernel``, ``grid = {nChannels}``, ``block = {threadPerBlock}``). The
channels a peer's send and receive go to, read at NVIDIA/nccl v2.28.7-1 (ae7aed19; the count is
the same at v2.25.1-1 .. v2.27.7-1, whose channel bases differ but not in number):

- ``ncclTopoComputeP2pChannels`` (``src/graph/paths.cc``): ``p2pnChannels = pow2Up(min(nChannels,
  NCCL_MAX_P2P_NCHANNELS = 64))`` and ``p2pnChannelsPerPeer = pow2Up(min over the peers of
  ncclTopoGetNchannels)``: an NVLink peer ``2 x (path bandwidth / one NVLink's)`` (36 on an H100's
  18 NVLinks, so the p2p channels bind), a peer on another node ``NCCL_NCHANNELS_PER_NET_PEER``
  (unset: 2, halved while ``2 n > 4 p2pnChannels``, at least the GPU's NICs by bandwidth: 1).
- ``scheduleP2pTasksToPlan`` (``src/enqueue.cc``): ``nChannelsMin = p2pnChannelsPerPeer`` halved
  while ``nChannelsMin x n > p2pnChannels``; ``addP2pToPlan`` splits a message into
  ``min(nChannelsMin, bytes / minPartSize)`` parts, doubled while a part is over ``maxPartSize``
  and the parts at most half of ``p2pnChannelsPerPeer`` (across nodes a step of
  ``NCCL_P2P_NET_CHUNKSIZE`` = 128 KiB: parts of 64 KiB .. 128 KiB; in a node
  ``NCCL_P2P_NVL_CHUNKSIZE`` = 512 KiB: 64 KiB .. 16 MiB); part ``k`` of round ``r`` runs on channel
  ``(base(r) + k) & (p2pnChannels - 1)`` (``ncclP2pChannelForPart``, ``src/include/device.h``).
- ``ncclP2pChannelBaseForRound`` (``src/include/channel.h``): in a node ``base(r) =
  reverseBits(r)``; across nodes the rounds go in groups of ``NCCL_P2P_SCHEDULE_GROUP_SIZE`` = 8
  peers (``NCCL_MAX_DEV_WORK_P2P_PER_BATCH`` = 8 to a channel's batch), ``base(r) =
  reverseBits(r / 8)``.

So in one node every p2p channel gets work (32 CTAs on an H100), across nodes two channels per
group of 8 peers (4 CTAs for 16 ranks on two nodes, 8 for 32 on four), for messages of more
than 128 KiB a peer (every MoE all-to-all of the published runs: megabytes). An NCCL CTA keeps
its SM: the kernels are built with ``-maxrregcount=96`` (``makefiles/common.mk``), 640 x 96 =
61,440 of an SM's 65,536 registers, and "NCCL CTAs won't share an SM with compute kernels"
(NVIDIA/nccl issue #689, NCCL's maintainer). NCCL 2.29 (``ncclTopoComputeP2pChannelsPerPeer``)
gives a network peer ``max(NICs, NIC bandwidth / NCCL_P2P_PER_CHANNEL_NET_BW 14 GB/s)`` channels
(4 for a 400 Gb/s NIC), twice the CTAs across nodes: not modelled (the plan does not carry NCCL's
version; the containers of the runs, NGC PyTorch 25.11, predate NCCL 2.29.2 of 2026-01-07).
"""

from __future__ import annotations

import math

#: NCCL's default P2P chunk across nodes (``NCCL_P2P_NET_CHUNKSIZE``, ``src/init.cc``) and in a
#: node over NVLink (``NCCL_P2P_NVL_CHUNKSIZE``), bytes
NET_CHUNK = 128 * 1024
NVL_CHUNK = 512 * 1024
#: peers to a channel's batch of work (``NCCL_MAX_DEV_WORK_P2P_PER_BATCH``, the default
#: ``NCCL_P2P_SCHEDULE_GROUP_SIZE``)
P2P_PER_BATCH = 8


def _reverse_bits(x: int, bits: int) -> int:
    return int(format(x, f"0{bits}b")[::-1], 2) if bits else 0


def a2a_ctas(ranks: int, per_node: int, channels: int, peer_bytes: float = float("inf")) -> int:
    """The CTAs of NCCL's grouped send/recv kernel for an all-to-all of ``ranks`` ranks,
    ``per_node`` of them in each node, on a communicator of ``channels`` p2p channels (NCCL's
    ``p2pnChannels``: a power of 2), each peer sent ``peer_bytes`` (module docstring). 0 for one
    rank or no channels."""
    if ranks <= 1 or channels <= 0:
        return 0
    p = 1 << max(0, (channels - 1).bit_length())
    bits = p.bit_length() - 1
    nodes = -(-ranks // max(1, per_node))
    if nodes > 1:
        per_peer = 2
        while per_peer * ranks > 4 * p and per_peer > 1:
            per_peer //= 2
        lo, hi = NET_CHUNK / 2, NET_CHUNK
    else:
        per_peer = p
        lo, hi = NVL_CHUNK / 8, NVL_CHUNK * 32
    c_min = per_peer
    while c_min * ranks > p and c_min > 1:
        c_min //= 2
    parts = max(1, min(c_min, int(-(-peer_bytes // lo)) if peer_bytes < float("inf") else c_min))
    size = max(lo, peer_bytes / parts)
    while size > hi and parts <= per_peer // 2:
        parts *= 2
        size = peer_bytes / parts
    group = math.gcd(P2P_PER_BATCH, max(1, per_node))
    used: set[int] = set()
    for r in range(ranks):
        base = _reverse_bits(((r // group) if nodes > 1 else r) & (p - 1), bits)
        used.update((base + k) & (p - 1) for k in range(parts))
    return len(used)
