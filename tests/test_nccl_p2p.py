"""NCCL's all-to-all kernel's CTAs (spmdkit.cost.nccl_p2p, read at NVIDIA/nccl v2.28.7-1) and the
share of an H100 they leave to the work beside an EP all-to-all under ``--ep-comm-overlap``
(spmdkit.cost.moe.a2a_compute_share)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import cli_stdout
from spmdkit.cost.devices import DEVICES
from spmdkit.cost.nccl_p2p import a2a_ctas

QWEN = ["plan", "--model", "qwen3-30b-a3b", "--layers", "2", "--seq", "512", "--batch", "16", "--grad-accum", "2",
        "--mesh", "dp=1,ep=16", "--strategy", "dp,ep", "--ep-comm-overlap", "--json"]


def test_channels_by_hand() -> None:
    """By hand from NCCL 2.28's scheduler.

    16 ranks on two nodes of 8, 16 p2p channels: a network peer gets 2 channels (2 x 16 <= 4 x 16);
    nChannelsMin 2 halves to 1 (2 x 16 > 16); a message of megabytes is one part of over 128 KiB,
    doubled to 2 (1 <= 2 / 2); rounds 0-7 are group 0 (base reverseBits(0) = 0), rounds 8-15
    group 1 (base reverseBits(1, 4 bits) = 8): channels {0, 1} and {8, 9}, 4 CTAs. 32 ranks on four
    nodes: bases 0, 8, 4, 12, two channels each: 8. 8 ranks in one node, 32 channels: 4 parts a
    peer (32 halved while x 8 > 32) from bases reverseBits(0..7, 5 bits) = 0, 16, 8, 24, 4, 20, 12,
    28: all 32. Peers of 64 KiB across nodes: one part (64 KiB is not over 128 KiB): 2 CTAs."""
    assert a2a_ctas(16, 8, 16) == 4
    assert a2a_ctas(32, 8, 16) == 8
    assert a2a_ctas(8, 8, 32) == 32
    assert a2a_ctas(16, 8, 16, 64 * 1024) == 2
    assert a2a_ctas(16, 8, 16, 8 * 1024**2) == 4
    assert a2a_ctas(1, 8, 32) == 0 and a2a_ctas(16, 8, 0) == 0
    assert DEVICES["h100"].nccl_p2p_channels == (32, 16)
    assert DEVICES["h200"].nccl_p2p_channels == (0, 0)  # no NCCL log of an H200 node read


def _share(*extra: str) -> float:
    rc, out = cli_stdout(*QWEN, *extra)
    assert rc == 0
    d: dict[str, Any] = json.loads(out)
    return float(d["step"]["ep_comm_overlap"]["compute_share"])


def test_the_share_beside_nccls_all_to_all(tmp_path: Path) -> None:
    """ep = 16 over two H100 nodes under the alltoall dispatcher: NCCL's kernel holds 4 SMs, the work
    beside it runs on 128 of 132; DeepEP's 20 SMs under deepep; a device based on the h100 preset
    keeps its channels, one whose node is redrawn (ranks_per_node) or a plain --cost model gives 1."""
    assert _share("--device", "h100") == pytest.approx(128 / 132, rel=1e-12)
    assert _share("--device", "h100", "--moe-dispatcher", "deepep") == pytest.approx(112 / 132, rel=1e-12)
    cudnn = tmp_path / "cudnn.json"
    cudnn.write_text(json.dumps({"base": "h100", "efficiency": {"cudnn_version": "9.10"}}))
    assert _share("--device", str(cudnn)) == pytest.approx(128 / 132, rel=1e-12)
    four = tmp_path / "four.json"
    four.write_text(json.dumps({"base": "h100", "ranks_per_node": 4}))
    assert _share("--device", str(four)) == 1.0
    assert _share("--device", "h100", "--cost", "ep=20us/12GB") == 1.0
