"""Megatron-LM 2021-2022's pipeline scatter / gather (``--pp-scatter-gather``): each tp rank sends
1/t of a pipeline activation (``split_tensor_into_1d_equal_chunks``) and the receivers all-gather
it over tp (``gather_split_1d_tensor``), forward and backward; megatron/p2p_communication at
de7dc40f88 and cfd2e21607 (off under ``--sequence-parallel``). Times by hand from the parts."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import pytest

from spmdkit.cli import main
from spmdkit.core.errors import SpmdError
from spmdkit.cost.collectives import Fabric, Group, collective_time
from spmdkit.cost.devices import preset_device
from spmdkit.program.runtime import Runtime


def _plan(strategy: str, *extra: str) -> dict[str, Any]:
    # pp=2 over tp=8: tp fills a node, so the pipeline exchange crosses nodes (the NIC)
    argv = ["plan", "--model", "llama-7b", "--layers", "4", "--seq", "1024", "--mesh", "pp=2,tp=8",
            "--strategy", strategy, "--device", "h100", "--batch", "4", "--microbatches", "4", "--json", *extra]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return json.loads(buf.getvalue())  # type: ignore[no-any-return]


def test_one_exchange_sends_a_tp_chunk_then_all_gathers_it_by_hand() -> None:
    whole, split = _plan("megatron"), _plan("megatron", "--pp-scatter-gather")
    b = 1024 * 1 * 4096 * 2  # [seq, micro-batch, hidden] in bf16: what each tp rank holds whole
    dev = preset_device("h100")
    fabric = Fabric.of(dev.intra.bytes_per_s, dev.inter.bytes_per_s, dev.ranks_per_node, dev.measured)
    nic = collective_time("send_recv", b, Group(2, 1), fabric)
    chunk = collective_time("send_recv", b // 8, Group(2, 1), fabric)
    gather = collective_time("all_gather", b, Group(8, 8), fabric)  # over NVLink, in the node
    for est in (whole, split):  # the stage still holds and stashes the whole tensor
        assert est["pipeline"]["stages"][0]["send_bytes"] == b
        assert est["pipeline"]["stages"][1]["send_grad_bytes"] == b
    s0, s1 = whole["pipeline"]["stages"]
    assert s0["send_s"] == pytest.approx(nic) and s1["send_grad_s"] == pytest.approx(nic)
    s0, s1 = split["pipeline"]["stages"]
    assert s0["send_gathered"] == b and s1["send_grad_gathered"] == b
    assert s0["send_s"] == pytest.approx(chunk + gather)  # the activation, forward
    assert s1["send_grad_s"] == pytest.approx(chunk + gather)  # its gradient, backward
    assert chunk + gather < nic / 2  # 1/8 of the bytes over the NIC, the rest over NVLink
    assert split["pipeline"]["pipeline_s"] < whole["pipeline"]["pipeline_s"]


def test_sequence_parallel_activations_are_sent_as_they_are() -> None:
    # Megatron turns scatter / gather off under --sequence-parallel: each rank's chunk is its own
    sp, both = _plan("megatron,sp"), _plan("megatron,sp", "--pp-scatter-gather")
    assert both["pipeline"]["stages"][0]["send_bytes"] == 1024 * 4096 * 2 // 8
    assert both["pipeline"]["stages"][0]["send_gathered"] == 0
    assert both["pipeline"]["stages"][0]["send_s"] == sp["pipeline"]["stages"][0]["send_s"]


def test_scatter_gather_is_megatrons_only() -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["plan", "--model", "llama-7b", "--layers", "4", "--mesh", "pp=2,dp=2", "--strategy", "dp",
                   "--framework", "torchtitan", "--pp-scatter-gather", "--batch", "4", "--microbatches", "2"])
    assert rc != 0
    assert "--pp-scatter-gather: applies to --framework megatron only" in err.getvalue()
    with pytest.raises(SpmdError, match="--pp-scatter-gather: applies to --framework megatron only"):
        Runtime(framework="torchtitan", pp_scatter_gather=True)


def test_pipeline_and_megatron_only_flags_are_refused_where_they_change_nothing() -> None:
    """--no-p2p-overlap and --pp-scatter-gather without a pp dim, and --no-async-tp-allreduce /
    --no-wgrad-fusion under a framework that is not Megatron-LM, were accepted and planned the same
    step as without them (llama3-8b 2 layers on dp=2,tp=4: 12.24 ms either way): each is refused,
    naming itself and why; where they apply they still plan."""
    base = ["plan", "--model", "llama3-8b", "--layers", "2", "--seq", "1024", "--strategy", "megatron,sp",
            "--device", "h100"]
    for extra, needle in (
            (["--mesh", "dp=2,tp=4", "--no-p2p-overlap"],
             "--no-p2p-overlap: applies to a pipeline's stage-to-stage sends; --mesh dp=2,tp=4 has no pp dim"),
            (["--mesh", "dp=2,tp=4", "--pp-scatter-gather"],
             "--pp-scatter-gather: applies to a pipeline's stage-to-stage sends; --mesh dp=2,tp=4 has no pp dim"),
            # a pipeline without a tp dim: no tp rank sends a share (stage_costs.scattered), so nothing changed
            (["--mesh", "pp=2,dp=4", "--pp-scatter-gather"],
             "--pp-scatter-gather: each tp rank sends 1/tp of a pipeline tensor; --mesh pp=2,dp=4 has no tp dim of "
             "more than one rank"),
            (["--mesh", "dp=2,tp=4", "--framework", "torchtitan", "--no-async-tp-allreduce"],
             "--no-async-tp-allreduce: the tp all-reduce of Megatron-LM before 2021-09, blocking the backward; "
             "applies to --framework megatron only, not --framework torchtitan"),
            (["--mesh", "dp=2,tp=4", "--framework", "automodel", "--no-wgrad-fusion"],
             "--no-wgrad-fusion: Megatron-LM before 2022-02, its weight gradients added into param.grad; applies "
             "to --framework megatron only, not --framework automodel")):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            assert main([*base, *extra]) == 2
        assert err.getvalue().strip() == f"spmdkit plan: ProgramError: {needle}", err.getvalue()
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        assert main([*base, "--mesh", "pp=2,tp=4", "--no-p2p-overlap", "--pp-scatter-gather",
                     "--no-async-tp-allreduce", "--no-wgrad-fusion"]) == 0
    with pytest.raises(SpmdError, match="--no-wgrad-fusion: Megatron-LM before 2022-02"):
        Runtime(framework="torchtitan", wgrad_fusion=False)
