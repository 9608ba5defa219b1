"""``spmdkit calibrate``: the mechanism on CPU with gloo (2 processes started by torch's launcher,
tiny sizes, --quick), the shapes it measures, the device file it writes and its errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import spmdkit
from spmdkit.cli import build_parser, main
from spmdkit.cli.calibrate import Setup, check_request
from spmdkit.cost.devices import DEVICES, load_device
from spmdkit.cost.measured import parse_measured
from spmdkit.execute.calibrate import (
    AttentionShape,
    CalibrationError,
    CollectiveJob,
    GemmShape,
    bus_factor,
    collective_sizes,
    default_gemms,
    group_sizes,
    measure_collectives,
    model_shapes,
)
from spmdkit.planner.planning import plan_preset

torch = pytest.importorskip("torch")

SRC = str(Path(spmdkit.__file__).resolve().parents[1])


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")


def _tiny_llama_gemms() -> set[tuple[int, int, int, str]]:
    """tiny-llama (hidden 16, 4 heads of 4, 2 kv heads, ffn 32, vocab 64, batch 4, seq 8) on dp=2:
    M = 2 x 8 = 16 tokens a device; the forward GEMMs (M, N, K) by hand, each with its input
    gradient (M, K, N) and its weight gradient (K, N, M)."""
    fwd = [(16, 16, 16),   # q and o projections
           (16, 8, 16),    # k and v: 2 kv heads x 4
           (16, 32, 16),   # gate and up
           (16, 16, 32),   # down
           (16, 64, 16)]   # the LM head
    return {s for m, n, k in fwd for s in ((m, n, k, "fp32"), (m, k, n, "fp32"), (k, n, m, "fp32"))}


def test_model_shapes_are_the_local_gemms_and_attention() -> None:
    _l, plan, _s = plan_preset("tiny-llama", "dp=2", "dp", {"layers": 1}, {}, None, None, 1)
    gemms, atts = model_shapes(plan)
    assert {(g.m, g.n, g.k, g.dtype) for g in gemms} == _tiny_llama_gemms()
    assert atts == [AttentionShape(2, 4, 8, 4, True, "fp32")]


def test_model_shapes_follow_tensor_parallel_sharding() -> None:
    # llama-7b on dp=2,tp=4: 4 x 4096 tokens a device, the q projection's columns split 4 ways
    _l, plan, _s = plan_preset("llama-7b", "dp=2,tp=4", "megatron", {"layers": 1}, {}, None, None, 1)
    gemms, atts = model_shapes(plan)
    assert GemmShape(16384, 1024, 4096, "bf16") in gemms       # q/k/v: 4096 -> 4096/4
    assert GemmShape(16384, 4096, 2752, "bf16") in gemms       # down: 11008/4 -> 4096
    assert GemmShape(4096, 2752, 16384, "bf16") in gemms       # up's weight gradient
    assert atts == [AttentionShape(4, 8, 4096, 128, True, "bf16")]  # 32 heads / 4


def test_flop_conventions_and_bus_factor() -> None:
    assert GemmShape(2, 3, 5, "fp32").flops == 60
    a = AttentionShape(1, 1, 4, 2, False, "bf16")
    assert a.fwd_flops == 4 * 16 * 2 and a.bwd_flops == 2.5 * 128
    assert AttentionShape(1, 1, 4, 2, True, "bf16").fwd_flops == 64
    assert bus_factor("all_reduce", 8) == 1.75 and bus_factor("all_gather", 4) == 0.75  # nccl-tests


def test_group_sizes_per_mesh_dim_and_what_cannot_be_formed() -> None:
    assert group_sizes([2, 4], 8) == ([2, 4], [])
    got, notes = group_sizes([2, 4], 2)
    assert got == [2] and len(notes) == 1 and "group size 4" in notes[0] and "runs 2" in notes[0]
    assert group_sizes([], 8) == ([2, 4, 8], [])
    assert group_sizes([], 6) == ([2, 4, 6], [])
    assert group_sizes([1, 1], 1) == ([], [])
    assert collective_sizes(False, True) == [4096, 65536]
    assert collective_sizes(True, False)[-1] == 1 << 28


def test_cpu_gloo_two_processes_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "mine.json"
    p = subprocess.run([sys.executable, "-m", "spmdkit", "calibrate", "--out", str(out), "--device", "cpu",
                        "--model", "tiny-llama", "--mesh", "dp=2", "--quick"],
                       env=_env(), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "not GPU figures" in p.stdout and "all_reduce" in p.stdout and "wrote" in p.stdout
    obj = json.loads(out.read_text())
    assert "base" not in obj and obj["name"].endswith("(calibrated)")
    m = parse_measured(obj["measured"])
    assert f"torch {torch.__version__}" in m.source and "gloo" in m.source
    assert {(g.m, g.n, g.k, g.dtype) for g in m.gemm} == _tiny_llama_gemms()
    assert [(a.batch, a.heads, a.seq, a.head_dim, a.causal, a.dtype) for a in m.attention] == [(2, 4, 8, 4, True, "fp32")]
    assert all(g.tflops > 0 for g in m.gemm) and m.hbm_gb_per_s is not None and m.hbm_gb_per_s > 0
    # every op at both quick sizes, group size 2 (dp=2), all local processes
    assert sorted((c.op, c.ranks, c.scope, c.bytes) for c in m.collectives) == sorted(
        (op, 2, "intra_node", b) for op in ("all_reduce", "all_gather", "reduce_scatter") for b in (4096, 65536))
    assert all(c.time_us > 0 for c in m.collectives)
    # the file stands alone: its fp32 rate is the best GEMM measured, and plan --device reads it
    dev = load_device(str(out))
    assert dev.measured == m and dev.peak["fp32"] == pytest.approx(max(g.tflops for g in m.gemm) * 1e12)
    assert dev.hbm_bytes_per_s == pytest.approx(m.hbm_gb_per_s * 1e9)
    assert [f for f in os.listdir(tmp_path) if f != "mine.json"] == []  # no temporary file left


def test_plan_reads_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "one.json"
    rc = main(["calibrate", "--out", str(out), "--device", "cpu", "--base", "h100", "--mesh", "dp=1", "--quick"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    # one process: collectives skipped with a note, not a failure
    assert "no collective to measure" in cap.out
    obj = json.loads(out.read_text())
    assert obj["base"] == "h100" and obj["measured"]["collectives"] == []
    assert [(g["m"], g["n"], g["k"]) for g in obj["measured"]["gemm"]] == [(128, 128, 128), (256, 256, 256)]
    dev = load_device(str(out))
    assert dev.peak == DEVICES["h100"].peak and dev.measured is not None and len(dev.measured.gemm) == 2
    rc = main(["plan", "--model", "tiny-llama", "--mesh", "dp=2", "--strategy", "dp", "--device", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "(calibrated)" in cap.out


@pytest.mark.parametrize("argv, words", [
    (["--backend", "mpi"], ["--backend", "mpi"]),
    (["--device", "tpu"], ["--device", "tpu"]),
])
def test_bad_flag_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                     words: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "--out", str(tmp_path / "x.json"), *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1 and all(w in err for w in words)
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("argv, words", [
    (["--device", "cpu", "--backend", "nccl"], ["--backend nccl", "--device cuda"]),
    (["--device", "cpu", "--base", "tpu-v5"], ["--base 'tpu-v5'", "no such preset"]),
    (["--device", "cpu", "--model", "no-such-model"], ["no-such-model"]),
    (["--device", "cpu", "--batch", "4"], ["--batch", "--model"]),
    (["--device", "cpu", "--model", "tiny-llama", "--model-config", '{"base": "tiny-llama"}'], ["not both"]),
    (["--device", "cpu", "--model-config", "layers=2"], ["--model-config 'layers=2'", "JSON object"]),
    (["--device", "cpu", "--model-config", '{"base": "tiny-llama", "activation": "tanh"}'], ["activation"]),
    (["--device", "cpu", "--mesh", "dp=x"], ["--mesh 'dp=x'", "not name=size"]),
])
def test_bad_value_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                      words: list[str]) -> None:
    rc = main(["calibrate", "--out", str(tmp_path / "x.json"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("spmdkit calibrate: ProgramError: ")
    assert all(w in err for w in words), err
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")
def test_cuda_without_a_gpu_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["calibrate", "--out", str(tmp_path / "x.json"), "--device", "cuda"])
    err = capsys.readouterr().err
    assert rc == 2 and "--device cuda" in err and "--device cpu" in err and len(err.strip().splitlines()) == 1


def test_unwritable_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for path, words in ((tmp_path / "missing" / "x.json", "no such folder"), (tmp_path, "is a folder")):
        rc = main(["calibrate", "--out", str(path), "--device", "cpu", "--quick"])
        err = capsys.readouterr().err
        assert rc == 2 and "--out" in err and words in err and len(err.strip().splitlines()) == 1
    assert os.listdir(tmp_path) == []  # nothing measured, nothing written


def test_a_failed_measurement_leaves_no_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "mine.json"
    out.write_text('{"base": "h100"}')  # an older file stays as it was

    def fail(job: CollectiveJob, nproc: int) -> None:
        raise CalibrationError(f"the collectives over {job.backend} on {nproc} processes failed: rank 1 died")

    monkeypatch.setattr("spmdkit.cli.calibrate.measure_collectives", fail)
    rc = main(["calibrate", "--out", str(out), "--device", "cpu", "--quick"])
    err = capsys.readouterr().err
    assert rc == 1 and "CalibrationError" in err and "gloo on 2 processes" in err
    assert out.read_text() == '{"base": "h100"}' and os.listdir(tmp_path) == ["mine.json"]


def test_the_launcher_leaves_this_process_as_it_was() -> None:
    # torch's launcher installs its own SIGINT / SIGTERM handlers in the calling process; after a
    # launch (here one that fails) the old ones are back, and its environment variable gone
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    job = CollectiveJob("no-such-backend", "cpu", (2,), (4096,), True)
    with pytest.raises(CalibrationError) as exc:
        measure_collectives(job, 2)
    assert "on 2 processes failed: rank " in str(exc.value) and "\n" not in str(exc.value)
    assert {s: signal.getsignal(s) for s in before} == before
    assert "TORCHELASTIC_SIGNALS_TO_HANDLE" not in os.environ


def _setup(tmp_path: Path, *argv: str) -> Setup:
    return check_request(build_parser().parse_args(["calibrate", "--out", str(tmp_path / "x.json"), *argv]))


def test_what_a_mesh_asks_for(tmp_path: Path) -> None:
    s = _setup(tmp_path, "--device", "cpu", "--mesh", "pp=2,dp=2,tp=4", "--base", "a100")
    # 16 ranks; groups of each non-pp dim's size; send_recv pairs for the pp dim; the alias's preset
    assert (s.nproc, s.groups, s.p2p, s.base, s.notes) == (16, (2, 4), True, "a100-80gb", ())
    assert s.gemms == tuple(default_gemms("fp32", False)) and s.backend == "gloo" and not s.gpu
    s = _setup(tmp_path, "--device", "cpu", "--mesh", "tp=1", "--quick")
    assert (s.nproc, s.groups, s.p2p, s.base) == (1, (), False, None) and "no collective" in s.notes[0]
    s = _setup(tmp_path, "--device", "cpu", "--quick")  # no mesh: 2 processes, groups of 2
    assert (s.nproc, s.groups) == (2, (2,))
    # the model's shapes on the planning mesh (pp dropped: every stage has the same layers)
    s = _setup(tmp_path, "--device", "cpu", "--model", "tiny-llama", "--mesh", "pp=2,dp=2", "--quick")
    assert {(g.m, g.n, g.k, g.dtype) for g in s.gemms} == _tiny_llama_gemms() and s.p2p
    # a decoder of one's own: tied embeddings (the head is the embedding, transposed) and
    # squared ReLU (no gate) have the same GEMM shapes as tiny-llama
    cfg = '{"base": "tiny-llama", "tied_embeddings": true, "activation": "squared_relu"}'
    s = _setup(tmp_path, "--device", "cpu", "--model-config", cfg, "--mesh", "dp=2", "--quick")
    assert {(g.m, g.n, g.k, g.dtype) for g in s.gemms} == _tiny_llama_gemms()
    # gpt2 (tiny-gpt2: hidden 16, 4 heads of 4, ffn 32, vocab 64): eager attention's matmuls of
    # two activations are no GEMM of a weight and give no attention point; flash gives one
    fwd = [(16, 16, 16), (16, 32, 16), (16, 16, 32), (16, 64, 16)]  # q/k/v/o, fc1, fc2, head
    gpt2 = {s for m, n, k in fwd for s in ((m, n, k), (m, k, n), (k, n, m))}
    for attention, points in (("eager", ()), ("flash", (AttentionShape(2, 4, 8, 4, True, "fp32"),))):
        s = _setup(tmp_path, "--device", "cpu", "--model-config",
                   f'{{"base": "tiny-gpt2", "attention": "{attention}"}}', "--mesh", "dp=2", "--quick")
        assert {(g.m, g.n, g.k) for g in s.gemms} == gpt2 and s.attention == points


def test_preset_of_gpu_by_driver_name() -> None:
    from spmdkit.cost.devices import preset_of_gpu

    assert preset_of_gpu("NVIDIA H100 80GB HBM3", 85 * 10**9) == "h100"
    assert preset_of_gpu("NVIDIA H200", 150 * 10**9) == "h200"
    assert preset_of_gpu("NVIDIA A100-SXM4-80GB", 85 * 10**9) == "a100-80gb"
    assert preset_of_gpu("NVIDIA A100-SXM4-40GB", 42 * 10**9) == "a100-40gb"
    assert preset_of_gpu("NVIDIA L4", 24 * 10**9) is None
