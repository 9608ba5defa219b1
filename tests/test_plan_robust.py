"""`spmdkit plan` under hostile but fair input: one line on stderr naming the argument, exit
status 2, no traceback (issue 13); uneven meshes stated in the report; declared output shapes
checked against the rule."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spmdkit.cli import main
from spmdkit.core.errors import ProgramError
from spmdkit.planner.planning import MAX_LAYERS
from spmdkit.program.ir import ProgramBuilder
from spmdkit.strategies.strategy import MAX_RANKS, parse_mesh

SRC = str(Path(__file__).resolve().parents[1] / "src")


def plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["plan", *argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def assert_refused(capsys: pytest.CaptureFixture[str], argv: list[str], names: str) -> str:
    rc, out, err = plan(capsys, *argv)
    assert rc == 2, (argv, rc, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert names in lines[0], (names, lines[0])
    assert len(lines[0]) < 700
    return lines[0]


TINY = ["--model", "tiny-llama"]


@pytest.mark.parametrize("mesh", [
    "dp=100000,tp=100000", "dp=99999999999999999999", "dp=\u00b2", "dp=\u0662", "dp=0", "dp=-1",
    "dp=2,dp=2", "=2", "dp=", "dp", "", ",,", "dp=2.0", "dp=1e3", "d p=2", "dp=2,tp=x", "\u00e9=2",
    f"dp={MAX_RANKS},tp=2",
])
def test_bad_mesh_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], mesh: str) -> None:
    assert_refused(capsys, [*TINY, "--mesh", mesh], "--mesh")


def test_mesh_rank_limit_is_inclusive() -> None:
    assert parse_mesh(f"dp={MAX_RANKS}").size == MAX_RANKS
    with pytest.raises(ProgramError, match="--mesh"):
        parse_mesh(f"dp={MAX_RANKS + 1}")


@pytest.mark.parametrize("cost", [
    "tp=5us/0GB", "tp=5us/0.0GB", "tp=5us/GB", "tp=5/150GB", "tp=5us/1.2.3GB", "tp=..us/1GB", "garbage",
    "tp=5us/150GB,zz=1us/1GB", "7=1us/1GB", "tp=" + "9" * 400 + "us/1GB", "tp=1us/" + "9" * 400 + "GB",
    "tp=1us/1GB," * 1000,
])
def test_bad_cost_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], cost: str) -> None:
    assert_refused(capsys, [*TINY, "--mesh", "dp=2,tp=2", "--cost", cost], "--cost")


@pytest.mark.parametrize("flag,value", [
    ("--layers", "1000000"), ("--layers", str(MAX_LAYERS + 1)), ("--layers", "0"), ("--layers", "-3"),
    ("--batch", "1e20"), ("--batch", "0"), ("--batch", "-1"), ("--batch", "99999999999999999999"),
    ("--batch", "\u0663"), ("--seq", "1" * 5000), ("--seq", "0"), ("--seq", "4.5"), ("--seq", "nan"),
])
def test_bad_sizes_are_one_line_exit_2(capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    assert_refused(capsys, [*TINY, "--mesh", "dp=2,tp=2", f"{flag}={value}"], flag)


@pytest.mark.parametrize("ann", [
    "tokens=" + "[" * 5000 + "]" * 5000, "tokens=" + "[" * 1500 + "]" * 1500, "tokens=[0", "tokens",
    "=[0,-1]", "tokens=[5,5]", "tokens=[0]", "tokens=\"x\"", "tokens=[true,-1]", "tokens=[0.5,-1]",
    "tokens={\"a\":1}", "tokens=[[[0]],-1]", "nope=[0,-1]", "x" * 10000 + "=[0]", "tokens=[-7,-1]",
])
def test_bad_annotation_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], ann: str) -> None:
    assert_refused(capsys, [*TINY, "--mesh", "dp=2,tp=2", "--annotate", ann], "--annotate")


def test_unknown_model_and_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    assert_refused(capsys, ["--model", "nope", "--mesh", "dp=2"], "preset")
    assert_refused(capsys, [*TINY, "--mesh", "dp=2,tp=2", "--strategy", "x" * 5000], "--strategy")
    assert_refused(capsys, [*TINY, "--mesh", "dp=2", "--strategy", "megatron"], "--strategy")


def test_program_with_preset_flags_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "p.json"
    f.write_text(_mlp_json([8, 32]))
    assert_refused(capsys, ["--program", str(f), "--mesh", "dp=2", "--layers", "3"], "--layers")
    assert_refused(capsys, ["--program", str(f), "--mesh", "dp=2", "--verify"], "--verify")


def _mlp_json(h_shape: list[int]) -> str:
    return json.dumps({"format": "spmdkit-program", "version": 1, "tensors": [
        {"name": "x", "shape": [8, 16], "kind": "input"}, {"name": "w", "shape": [16, 32], "kind": "parameter"},
        {"name": "h", "shape": h_shape}],
        "ops": [{"rule": "matmul", "name": "fc1", "inputs": {"x": "x", "y": "w"}, "outputs": ["h"]}]})


@pytest.mark.parametrize("content,names", [
    (b"\xff\xfe{\"format\": 1}", "UTF-8"),
    (b"[" * 100000 + b"]" * 100000, "deeply"),
    (b"{" + b"\"a\":{" * 50000 + b"}" * 50001, "deeply"),
    (b"[1, 2]", "object"),
    (b"{\"format\": \"spmdkit-program\", \"version\": 1}", "'tensors'"),
    (b"{\"format\": \"spmdkit-program\", \"version\": 1, \"tensors\": [{\"name\": \"x\", \"shape\": [1"
     + b"0" * 5000 + b"]}], \"ops\": []}", "--program"),
    (b"{\"format\": \"spmdkit-program\", \"version\": 1, \"tensors\": [{\"name\": \"x\", \"shape\": [1e400]}],"
     b" \"ops\": []}", "shape"),
    (b"{\"format\": \"spmdkit-program\", \"version\": 1, \"tensors\": [{\"name\": \"x\", \"shape\": "
     b"[4611686018427387904, 4]}], \"ops\": []}", "elements"),
    (b"{\"format\": \"spmdkit-program\", \"version\": 1, \"tensors\": [{\"name\": \"x\", \"shape\": [2],"
     b" \"kind\": [\"input\"]}], \"ops\": []}", "kind"),
    (b"{\"format\": \"spmdkit-program\", \"version\": 1, \"tensors\": [], \"ops\": [{\"rule\": \"nope\"}]}",
     "nope"),
    (b"{\"format\": \"spmdkit-program\", \"version\": 1, \"tensors\": [], \"ops\": [7]}", "ops[0]"),
    (b"", "JSON"),
])
def test_bad_program_file_is_one_line_exit_2(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                             content: bytes, names: str) -> None:
    f = tmp_path / "p.json"
    f.write_bytes(content)
    assert_refused(capsys, ["--program", str(f), "--mesh", "dp=2"], names)


def test_missing_program_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert_refused(capsys, ["--program", str(tmp_path / "absent.json"), "--mesh", "dp=2"], "--program")


def test_declared_output_shape_contradicting_the_op(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    f = tmp_path / "p.json"
    f.write_text(_mlp_json([9, 33]))
    line = assert_refused(capsys, ["--program", str(f), "--mesh", "dp=2"], "fc1")
    assert "ProgramError" in line and "[9, 33]" in line
    f.write_text(_mlp_json([8, 32]))
    rc, out, err = plan(capsys, "--program", str(f), "--mesh", "dp=2", "--annotate", "x=[0,-1]")
    assert rc == 0 and err == "" and "fc1" in out


@pytest.mark.parametrize("rule,inputs,out_shape,bad", [
    ("relu", {"x": [4, 6]}, [4, 6], [4, 7]),
    ("softmax", {"x": [4, 6]}, [4, 6], [5, 6]),
    ("transpose", {"x": [4, 6]}, [6, 4], [4, 6]),
    ("add", {"x": [4, 6], "y": [4, 6]}, [4, 6], [4, 8]),
])
def test_output_shape_checked_through_the_reverse_rule(rule: str, inputs: dict[str, list[int]],
                                                       out_shape: list[int], bad: list[int]) -> None:
    attrs = {"perm": [1, 0]} if rule == "transpose" else {}
    for shape, ok in ((out_shape, True), (bad, False)):
        b = ProgramBuilder()
        ins = {k: b.tensor(k, v, kind="input") for k, v in inputs.items()}
        b.op(rule, ins, [("out", shape)], name="the_op", **attrs)
        if ok:
            b.build()
        else:
            with pytest.raises(ProgramError, match="the_op"):
                b.build()


def test_uneven_tp_is_refused_and_an_uneven_pin_stated(capsys: pytest.CaptureFixture[str]) -> None:
    """megatron over a tp that does not divide the heads is refused (issue 27: Megatron-LM splits
    evenly or not at all; tests/test_input_checks.py has the other counts); a user's pin that
    splits a weight unevenly is planned and stated."""
    for tp in ("3", "5"):
        assert_refused(capsys, [*TINY, "--mesh", f"tp={tp}"], f"--mesh tp={tp}: megatron splits evenly or not at all")
    pin = [*TINY, "--mesh", "dp=1,tp=3", "--strategy", "dp", "--annotate", "layers.0.wq=[-1,1]"]
    rc, out, err = plan(capsys, *pin)
    assert rc == 0, err
    assert "Uneven shards:" in out and "over tp=3" in out
    head = out.splitlines()[:4]  # said at the top too, not only at the end (issue 27)
    assert any(line.startswith("WARNING: uneven shards: ") and "layers.0.wq axis 1, size 16 in pieces of 6 down to 4"
               in line for line in head), head
    rc, out, _ = plan(capsys, *pin, "--json")
    un = json.loads(out)["uneven_shards"]
    assert un and all(u["size"] % u["parts"] for u in un)
    wq = next(u for u in un if u["tensor"] == "layers.0.wq")
    assert (wq["largest"], wq["parts"]) == (-(-wq["size"] // 3), 3)
    # an even mesh says nothing of the kind
    rc, out, _ = plan(capsys, *TINY, "--mesh", "dp=2,tp=2")
    assert rc == 0 and "Uneven shards" not in out
    assert json.loads(main_json(capsys, "dp=2,tp=2"))["uneven_shards"] == []


def main_json(capsys: pytest.CaptureFixture[str], mesh: str) -> str:
    rc, out, _ = plan(capsys, *TINY, "--mesh", mesh, "--json")
    assert rc == 0
    return out


def test_a_batch_dp_does_not_divide_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """Each data-parallel rank takes whole sequences, as Megatron-LM asserts (global batch a
    multiple of micro-batch x dp) and torchtitan defines (a batch per dp rank): 8 sequences over
    dp=3, or the one of llama-7b over dp=2 (planned before with half the dp ranks given no
    sample and a warning), are refused naming --batch and --mesh's dp; a pipeline's microbatch
    too, saying which --microbatches or --batch would divide."""
    assert_refused(capsys, [*TINY, "--mesh", "dp=3", "--strategy", "dp", "--batch", "8", "--json"],
                   "--batch 8: data parallel over --mesh dp=3 needs a batch that is a multiple of 3 (each rank "
                   "whole sequences)")
    assert_refused(capsys, ["--model", "llama-7b", "--layers", "1", "--seq", "256", "--batch", "1", "--mesh",
                            "dp=2,tp=4", "--strategy", "dp,megatron"],
                   "--batch 1: data parallel over --mesh dp=2 needs a batch that is a multiple of 2")
    assert_refused(capsys, ["--model", "llama-7b", "--layers", "2", "--seq", "256", "--mesh", "pp=2,dp=2,tp=2",
                            "--batch", "16", "--microbatches", "16"],
                   "--batch 1: data parallel over --mesh dp=2 needs a batch that is a multiple of 2 (each rank whole "
                   "sequences) (a microbatch: --batch 16 over --microbatches 16; whole sequences per rank: "
                   "--microbatches 8 or --batch 32)")
    # the model's own batch where --batch is not given: said so, and a pipeline's suggestion is --batch alone
    # (without it each microbatch is the model's batch, whatever --microbatches)
    assert_refused(capsys, ["--model", "llama-7b", "--layers", "1", "--seq", "256", "--mesh", "dp=16",
                            "--strategy", "zero3"],
                   "--batch 8: data parallel over --mesh dp=16 needs a batch that is a multiple of 16 (each rank whole "
                   "sequences); --batch not given: the model's own batch is 8")
    assert_refused(capsys, ["--model", "llama-7b", "--layers", "2", "--seq", "256", "--mesh", "pp=2,dp=16",
                            "--strategy", "zero1", "--microbatches", "4"],
                   "(a microbatch: --batch not given: each of the 4 microbatches the model's own batch; whole "
                   "sequences per rank: --batch 64)")
    rc, out, err = plan(capsys, *TINY, "--mesh", "dp=2", "--strategy", "dp", "--batch", "8", "--json")
    assert rc == 0 and json.loads(out)["uneven_shards"] == [], err


def test_tp_comm_overlap_without_sequence_parallelism_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """--tp-comm-overlap overlaps sp's all-gathers and reduce-scatters; plain megatron over tp=4 has
    none, and it was accepted and ignored (the same step as without it). Megatron-LM asserts
    sequence parallelism with it (megatron/training/arguments.py): refused, naming both flags; with
    sp it plans, and at tp=1 (Megatron's own H100 table sets it on every run) it is no error."""
    base = ["--model", "llama-7b", "--layers", "1", "--seq", "256", "--device", "h100", "--tp-comm-overlap"]
    for strategy in ([], ["--strategy", "megatron"], ["--strategy", "dp,megatron,zero1"]):
        assert_refused(capsys, [*base, "--mesh", "dp=2,tp=4", *strategy],
                       "--tp-comm-overlap: overlaps sequence parallelism's all-gathers and reduce-scatters with the "
                       "GEMMs; --strategy ")
    assert "add sp, --strategy megatron,sp" in assert_refused(capsys, [*base, "--mesh", "pp=2,dp=2,tp=2"],
                                                              "over tp=2 has none")
    for mesh, strategy in (("dp=2,tp=4", "megatron,sp"), ("dp=8", "dp,zero1"), ("dp=8,tp=1", "dp,megatron")):
        rc, _, err = plan(capsys, *base, "--mesh", mesh, "--strategy", strategy)
        assert rc == 0, err


def test_the_search_under_tp_comm_overlap_plans_no_megatron_without_sp(capsys: pytest.CaptureFixture[str]) -> None:
    """--devices with --tp-comm-overlap: the configurations plan refuses (megatron without sp over
    tp > 1) are listed among those not planned, with plan's own message, and none is ranked."""
    rc, out, err = plan(capsys, "--model", "llama-7b", "--layers", "2", "--seq", "256", "--batch", "8", "--device",
                        "h100", "--devices", "8", "--tp-comm-overlap", "--json")
    assert rc == 0, err
    search = json.loads(out)["search"]

    def plain(c: dict[str, Any]) -> bool:
        return bool(c["tp"] > 1 and "megatron" in c["strategy"].split(",") and "sp" not in c["strategy"].split(","))

    assert search["top"] and not any(plain(c) for c in search["top"])
    said = [(c["strategy"], c["tp"], c["reason"]) for c in search["refused"] if plain(c)]
    assert said and all(r == f"--tp-comm-overlap: overlaps sequence parallelism's all-gathers and reduce-scatters "
                             f"with the GEMMs; --strategy {s} over tp={tp} has none (its all-reduces block; "
                             f"Megatron-LM asserts sequence parallelism with it): add sp, --strategy megatron,sp"
                        for s, tp, r in said)


def test_moe_flags_on_a_model_without_experts_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """--moe-skew / --moe-histogram / --moe-dispatcher / --moe-routing on a dense model were accepted
    and changed nothing (as --ep-comm-overlap, they describe a router and its token exchange):
    refused naming the flag, flat, in a pipeline and under --auto; an MoE model takes them."""
    dense = ["--model", "llama-7b", "--layers", "2", "--seq", "256", "--device", "h100"]
    for flags, names in ((["--moe-skew", "2"], "--moe-skew 2: "), (["--moe-histogram", "[1,2]"], "--moe-histogram: "),
                         (["--moe-dispatcher", "deepep", "--moe-routing", "balanced"],
                          "--moe-dispatcher deepep / --moe-routing balanced: ")):
        line = assert_refused(capsys, [*dense, "--mesh", "dp=8", "--strategy", "dp", *flags], names)
        assert "the model has no MoE layer (no moe_gate_dispatch op)" in line
    assert_refused(capsys, [*dense, "--mesh", "pp=2,dp=4", "--strategy", "dp", "--moe-skew", "aux-loss"],
                   "--moe-skew 1.52: describes a mixture-of-experts router")
    assert_refused(capsys, [*TINY, "--mesh", "dp=2", "--auto", "--moe-skew", "2"], "the model has no MoE layer")
    assert_refused(capsys, ["--model-config", '{"base": "tiny-llama"}', "--devices", "4", "--moe-routing", "balanced"],
                   "--moe-routing balanced: describes a mixture-of-experts router")  # before the search
    rc, _, err = plan(capsys, "--model", "mixtral-8x7b", "--layers", "1", "--seq", "256", "--mesh", "dp=8,ep=8",
                      "--strategy", "dp,ep", "--device", "h100", "--moe-skew", "2")
    assert rc == 0, err


def test_the_default_strategy_is_named_when_the_mesh_has_no_tp(capsys: pytest.CaptureFixture[str]) -> None:
    """--mesh dp=2 without --strategy was refused as '--strategy megatron: the mesh has no 'tp' dim', a
    flag the user never gave: the line says it is the default and what to give; a --strategy the
    user typed is named as it was."""
    line = assert_refused(capsys, [*TINY, "--mesh", "dp=2"], "--strategy megatron: the mesh has no 'tp' dim")
    assert line.endswith("; --strategy not given: the default is megatron (give one for a mesh without tp, e.g. "
                         "--strategy dp)")
    assert_refused(capsys, [*TINY, "--mesh", "pp=2,dp=2"], "--strategy not given: the default is megatron")  # a pipeline
    assert "not given" not in assert_refused(capsys, [*TINY, "--mesh", "dp=2", "--strategy", "megatron"], "no 'tp' dim")


def test_subprocess_has_no_traceback() -> None:
    for argv in (["--mesh", "dp=100000,tp=100000"], ["--cost", "tp=5us/0GB"], ["--batch", "1e20"]):
        p = subprocess.run([sys.executable, "-m", "spmdkit", "plan", *TINY, *argv], capture_output=True,
                           text=True, timeout=60, env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})
        assert p.returncode == 2, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


_PIECES = ["dp", "tp", "=", ",", "2", "3", "0", "-1", "\u00b2", "[", "]", "{", "}", "\"", "us", "/", "GB", "e9",
           ".", " ", "x", "9999999999", "tokens", "null", "true", "-", "\x00", "\u0662", ":", "ms", "TB"]


def _junk(r: random.Random) -> str:
    return "".join(r.choice(_PIECES) for _ in range(r.randint(0, 12)))


def test_fuzz_plan_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    """Seeded random malformed --mesh / --cost / --annotate / --layers / --batch / --seq: never a
    traceback, exit 0, 1 or 2, and a refusal is one line. 150 runs of a tiny model."""
    r = random.Random(1313)
    for _ in range(150):
        # --flag=value: a value starting with "-" given as its own word is argparse's usage error
        argv = [*TINY, "--mesh=" + r.choice(["dp=2,tp=2", "tp=2", "dp=2", _junk(r)])]
        if r.random() < 0.5:
            argv += ["--cost=" + r.choice(["tp=5us/150GB", _junk(r)])]
        if r.random() < 0.5:
            argv += ["--annotate=" + r.choice(["tokens=", "labels=", ""]) + _junk(r)]
        for flag in ("--layers", "--batch", "--seq"):
            if r.random() < 0.3:
                argv += [f"{flag}={r.choice(['1', '2', '4', _junk(r)])}"]
        rc = main(["plan", *argv])
        cap = capsys.readouterr()
        assert rc in (0, 1, 2), argv
        assert "Traceback" not in cap.err
        if rc:
            assert len(cap.err.strip().splitlines()) == 1, (argv, cap.err)


@pytest.mark.parametrize("argv", [["--mesh", "--x"], ["--bogus"], ["--layers"], ["--mesh", "-x"]])
def test_argparse_errors_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    """argparse's own refusals (a flag without its value, an unknown flag) are one line too, no usage block."""
    with pytest.raises(SystemExit) as exc:
        main(["plan", *TINY, *argv])
    cap = capsys.readouterr()
    assert exc.value.code == 2
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("spmdkit") and "error" in lines[0], cap.err


def test_a_mesh_dim_the_strategy_leaves_idle_is_warned_of(capsys: pytest.CaptureFixture[str]) -> None:
    """--mesh dp=2,ep=2 --strategy dp on a MoE model shards nothing over ep: its 2 ranks run the
    same sequences and the same experts, the dim accepted and ignored without a word. One warning
    names the dim, the strategy and what to do; a strategy using every dim (or the default
    megatron over dp x tp) gets none."""
    moe = ["--model-config", json.dumps({"base": "tiny-llama", "experts": 4, "top_k": 2, "moe_ffn": 8}), "--batch", "4"]
    rc, _, err = plan(capsys, *moe, "--mesh", "dp=2,ep=2", "--strategy", "dp")
    assert rc == 0
    assert err.splitlines() == ["spmdkit plan: warning: --mesh ep=2: --strategy dp shards nothing over ep, so its 2 "
                                "ranks repeat the same work (give a --strategy that uses ep, or drop it from --mesh)"]
    rc, _, err = plan(capsys, *TINY, "--mesh", "dp=2,cp=2", "--strategy", "dp")
    assert rc == 0 and "--mesh cp=2: --strategy dp shards nothing over cp" in err
    rc, _, err = plan(capsys, *moe, "--mesh", "pp=2,dp=2,ep=2", "--strategy", "dp", "--batch", "8")  # a pipeline's stages
    assert rc == 0 and "--mesh ep=2: --strategy dp shards nothing over ep" in err
    for argv in ([*moe, "--mesh", "dp=2,ep=2", "--strategy", "dp,ep"], [*TINY, "--mesh", "dp=2,tp=2"],
                 [*TINY, "--mesh", "dp=1,tp=2"], [*TINY, "--mesh", "pp=2,dp=2,tp=2", "--batch", "4"]):
        rc, _, err = plan(capsys, *argv)
        assert rc == 0 and "shards nothing" not in err, (argv, err)
