"""``spmdkit run --kernels torch``: torch's own ops on each rank's shards, in the program's dtype.

In-process (fast): the torch kernels in float64 equal the numpy references on whole training
steps (every tensor of tiny-llama's and tiny-gpt-dropout's steps); every rule the zoo presets use
has a kernel; a rule without one is refused by name, suggesting ``--kernels numpy``; the
per-dtype check fails on a wrong value and on a NaN. On gloo (seconds each): tiny-llama
(megatron, float32) and a bfloat16 Llama (--hf, megatron on tp=2, padded) equal the single-process torch
step within their dtype's tolerance, with the plan's collectives, and print the time per phase
beside the plan's prediction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'spmdkit[torch]')")

from conftest import run_cli_line  # noqa: E402
from spmdkit.cli import main  # noqa: E402
from spmdkit.core.errors import SpmdError  # noqa: E402
from spmdkit.execute.check import TOLERANCES  # noqa: E402
from spmdkit.execute.kernels import NoTorchKernelError, check_kernels, missing_kernels  # noqa: E402
from spmdkit.execute.single import global_step, global_step_torch  # noqa: E402
from spmdkit.models.zoo import PRESETS  # noqa: E402
from spmdkit.planner.planning import plan_model  # noqa: E402
from spmdkit.planner.propagate import propagate  # noqa: E402
from spmdkit.program.ir import ProgramBuilder  # noqa: E402
from spmdkit.strategies.strategy import parse_mesh  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _float64(plan: Any) -> None:
    """Every floating tensor of the plan's program as float64 (a cast op keeps its own target)."""
    for t in plan.program.tensors.values():
        if t.dtype in ("float32", "bfloat16", "float16"):
            object.__setattr__(t, "dtype", "float64")


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt-dropout"])
def test_torch_kernels_in_float64_equal_the_numpy_references(model: str) -> None:
    _, plan, _ = plan_model(model, "dp=2,tp=2", "megatron", {"layers": 1})
    _float64(plan)
    want = global_step(plan, 3)
    got, secs = global_step_torch(plan, 3)
    assert set(got) == set(want) and len(want) > 100
    assert set(secs) == {"forward", "backward", "optimizer"}
    for n, w in want.items():
        g = got[n].numpy()
        assert g.shape == w.shape, n
        if w.dtype.kind != "f":
            assert np.array_equal(g, w), n
            continue
        assert np.isfinite(g).all() and np.isfinite(w).all(), n
        # gelu's numpy gradient is a central difference (1e-10); everything else to rounding
        assert np.max(np.abs(g - w), initial=0.0) <= 1e-8 * max(1.0, float(np.max(np.abs(w), initial=0.0))), n


def test_every_zoo_rule_has_a_torch_kernel() -> None:
    for name in sorted(PRESETS):
        for strategy in ("megatron", "dp"):
            _, plan, _ = plan_model(name, "dp=2,tp=2" if strategy == "megatron" else "dp=2", strategy, {"layers": 1})
            assert missing_kernels(plan.program) == {}, (name, strategy)


def test_an_op_without_a_torch_kernel_is_refused_by_name(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                        monkeypatch: Any) -> None:
    b = ProgramBuilder("t")
    x = b.tensor("x", (4, 3), "float32", "input")
    b.op("cummax", {"x": x}, [("m", (4, 3), "float32"), ("i", (4, 3), "int64")], axis=0)
    prog = b.build()
    assert missing_kernels(prog) == {"cummax": prog.ops[0].name}
    with pytest.raises(NoTorchKernelError, match=r"no torch kernel for cummax .*--kernels numpy") as exc:
        check_kernels(prog)
    assert isinstance(exc.value, SpmdError)
    plan = propagate(prog, parse_mesh("dp=2"), {"x": [0, -1]})
    with pytest.raises(NoTorchKernelError):
        global_step_torch(plan)
    # the command refuses it before any rank starts (exit 2, one line), and a device it does not know
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    f = tmp_path / "p.json"
    f.write_text(prog.dumps())
    rc, line = run_cli_line(capsys, "--kernels", "torch", "--program", str(f), "--mesh", "dp=2",
                            "--annotate", "x=[0,-1]")
    assert rc == 2 and line.startswith("spmdkit run: NoTorchKernelError: --kernels torch: no torch kernel for "
                                       "cummax (op ") and "--kernels numpy" in line, line
    # an unknown --device prints as spmdkit plan prints it: with its class (it printed without)
    rc, line = run_cli_line(capsys, "--kernels", "torch", "--mesh", "dp=2", "--strategy", "dp", "--device", "tpu9")
    assert rc == 2 and line.startswith("spmdkit run: ProgramError: --device 'tpu9': no such preset ("), line
    assert main(["plan", "--model", "tiny-llama", "--mesh", "dp=2", "--strategy", "dp", "--device", "tpu9"]) == 2
    assert capsys.readouterr().err.strip() == line.replace("spmdkit run:", "spmdkit plan:", 1)
    rc, line = run_cli_line(capsys, "--mesh", "dp=2", "--strategy", "dp", "--warmup", "-1")
    assert rc == 2 and "--warmup -1: must be at least 0" in line, line


def test_the_launchers_list_of_kernel_names_is_the_table(tmp_path: Path) -> None:
    """spmdkit.execute.kernel_names.KERNEL_NAMES (what the launcher checks plans against, without
    torch) is exactly the kernel table's names; a kernel registered under a name not listed is
    refused as its module is imported; ``spmdkit run``'s launcher refuses cummax before any rank
    starts in a process that never imports torch, where tiny-llama's plan passes the check."""
    from spmdkit.execute.kernel_names import KERNEL_NAMES
    from spmdkit.execute.kernels import KERNELS
    from spmdkit.execute.kernels._common import register

    assert KERNEL_NAMES == frozenset(KERNELS) and len(KERNEL_NAMES) > 300
    with pytest.raises(SpmdError, match=r"torch kernel cummax: not in spmdkit.execute.kernel_names.KERNEL_NAMES"):
        register("add", "cummax")
    assert "cummax" not in KERNELS
    b = ProgramBuilder("t")
    x = b.tensor("x", (4, 3), "float32", "input")
    b.op("cummax", {"x": x}, [("m", (4, 3), "float32"), ("i", (4, 3), "int64")], axis=0)
    (tmp_path / "p.json").write_text(b.build().dumps())
    code = ("import sys; from spmdkit.execute.kernel_names import check_kernels; from spmdkit.cli import main; "
            "from spmdkit.planner.planning import plan_model; "
            "check_kernels(plan_model('tiny-llama', 'dp=2,tp=2', 'megatron', {'layers': 1})[1].program); "
            f"rc = main(['run', '--kernels', 'torch', '--program', {str(tmp_path / 'p.json')!r}, '--mesh', 'dp=2', "
            "'--annotate', 'x=[0,-1]']); print(rc, 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(env, PYTHONPATH=str(ROOT / "src")))
    assert p.returncode == 0 and p.stdout.splitlines()[-1] == "2 False", p.stdout[-500:] + p.stderr[-2000:]
    assert "no torch kernel for cummax (op " in p.stderr.strip().splitlines()[-1]


def test_the_dtype_check_fails_on_a_wrong_value_and_on_nan() -> None:
    """check_torch: within the dtype's tolerance of each tensor's scale passes, beyond fails, a NaN never passes."""
    from spmdkit.execute.check import RunReport, check_torch
    from spmdkit.execute.rank import Rank

    b = ProgramBuilder("t")
    x = b.tensor("x", (4, 3), "bfloat16", "input")
    w = b.tensor("w", (3,), "bfloat16", "parameter")
    b.op("multiply", {"x": x, "y": w}, [("y", (4, 3), "bfloat16")])
    prog = b.build()
    plan = propagate(prog, parse_mesh("dp=2"), {"x": [0, -1]})
    ref = {n: v.float().numpy() for n, v in global_step_torch(plan, 0)[0].items()}
    me = Rank.__new__(Rank)
    me.made = {"y": plan.attrs["y"]}

    def check(y: np.ndarray) -> RunReport:
        rep = RunReport(2, "gloo")
        check_torch(rep, plan, [({"y": y[:2]}, [], {}), ({"y": y[2:]}, [], {})], me, 0, None, torch.device("cpu"))
        return rep

    y = ref["y"]
    scale = float(np.abs(y).max())
    assert not check(y).failures and check(y).max_rel_error == 0.0
    near = y.copy()
    near[0, 0] += 0.5 * TOLERANCES["bfloat16"] * scale
    assert not check(near).failures
    far = y.copy()
    far[0, 0] += 2 * TOLERANCES["bfloat16"] * scale
    assert [n for n, _ in check(far).failures] == ["y"]
    nan = y.copy()
    nan[3, 2] = np.nan
    rep = check(nan)
    assert rep.nonfinite == 1 and "non-finite" in rep.failures[0][1]


def test_a_relu_mask_flipped_by_rounding_passes_and_a_wrong_gradient_or_nan_still_fails() -> None:
    """A ReLU input within rounding of zero takes the other side of the mask in a run that sums in
    another order (bfloat16 T5): the single-process check runs relu_grad on the distributed
    run's forward value (itself checked), so the flip passes; a wrong gradient, a gradient with
    the wrong mask for its own forward value, a NaN and a forward value beyond the tolerance fail."""
    from spmdkit.execute.check import RunReport, check_torch
    from spmdkit.execute.rank import Rank

    b = ProgramBuilder("t")
    x = b.tensor("x", (4, 8), "bfloat16", "input")
    g = b.tensor("g", (4, 8), "bfloat16", "input")
    (r,) = b.op("relu", {"x": x}, [("r", (4, 8), "bfloat16")])
    b.phase = "backward"
    b.op("relu_grad", {"out": r, "out_grad": g}, [("x.grad", (4, 8), "bfloat16")])
    prog = b.build()
    plan = propagate(prog, parse_mesh("dp=2"), {"x": [0, -1], "g": [0, -1]})
    rng = np.random.default_rng(3)
    xv = rng.uniform(0.5, 1.0, (4, 8)) * rng.choice([-1.0, 1.0], (4, 8))
    gv = rng.uniform(0.5, 1.0, (4, 8))
    xv[0, 0] = -2 ** -10  # within bfloat16's rounding of zero next to values near 1
    values = {"x": xv, "g": gv}
    ref = {n: v.float().numpy() for n, v in global_step_torch(plan, 0, values)[0].items()}
    assert ref["r"][0, 0] == 0 and ref["x.grad"][0, 0] == 0  # the single-process run's own mask: 0
    me = Rank.__new__(Rank)
    me.made = {"r": plan.attrs["r"], "x.grad": plan.attrs["x.grad"]}

    def check(rv: np.ndarray, gr: np.ndarray) -> RunReport:
        rep = RunReport(2, "gloo")
        check_torch(rep, plan, [({"r": rv[:2], "x.grad": gr[:2]}, [], {}), ({"r": rv[2:], "x.grad": gr[2:]}, [], {})],
                     me, 0, values, torch.device("cpu"))
        return rep

    r_flip, g_flip = ref["r"].copy(), ref["x.grad"].copy()
    r_flip[0, 0] = 2 ** -10  # the distributed run rounded the input to the other side of zero ...
    g_flip[0, 0] = np.float32(torch.tensor(gv[0, 0]).bfloat16().float())  # ... and its mask passes the gradient
    rep = check(r_flip, g_flip)
    assert not rep.failures and rep.checked == 2 and rep.max_rel_error < TOLERANCES["bfloat16"]
    scale = float(np.abs(ref["x.grad"]).max())
    wrong = g_flip.copy()
    wrong[2, 3] += 2 * TOLERANCES["bfloat16"] * scale  # a planted wrong gradient element
    assert [n for n, _ in check(r_flip, wrong).failures] == ["x.grad"]
    assert [n for n, _ in check(r_flip, ref["x.grad"]).failures] == ["x.grad"]  # mask 0 where its r > 0
    nan = g_flip.copy()
    nan[1, 1] = np.nan
    rep = check(r_flip, nan)
    assert rep.nonfinite == 1 and [n for n, _ in rep.failures] == ["x.grad"]
    far = r_flip.copy()
    far[0, 0] = 0.5  # a forward value beyond rounding is no flip: it fails itself
    assert "r" in [n for n, _ in check(far, g_flip).failures]


def test_the_half_precision_eager_check_is_bounded_by_torchs_own_half_step() -> None:
    """Against torch eager's float32 step, a half-precision run's gradient passes within rtol or twice
    torch's own half-precision step's largest relative L2 error; beyond it, or a NaN, fails."""
    from spmdkit.execute.check import RunReport
    from spmdkit.execute.eager import compare_eager

    rng = np.random.default_rng(5)
    want = {"loss": np.array(2.0), "a.grad": rng.normal(size=(64, 32)), "b.grad": rng.normal(size=(32,))}
    own = {k: v.copy() for k, v in want.items()}
    own["a.grad"] = want["a.grad"] + 0.05 * rng.normal(size=(64, 32))  # torch's bf16: about 5% norm-wise
    rep = RunReport(4, "gloo")

    def check(a: np.ndarray) -> Any:
        rep.values = {"loss": np.array(2.0), "a.grad": a, "b.grad": want["b.grad"]}
        return compare_eager(rep, "float32", want, "loss", 0.06, native=own)

    near = want["a.grad"] + 0.08 * rng.normal(size=(64, 32))  # beyond rtol, within twice torch's own
    chk = check(near)
    assert not chk.failures and 0.04 < chk.native_error < 0.06 and 0.06 < chk.max_rel_error < 2 * chk.native_error
    far = want["a.grad"] + 0.2 * rng.normal(size=(64, 32))
    assert [n for n, _ in check(far).failures] == ["a.grad"]
    nan = near.copy()
    nan[3, 4] = np.nan
    assert [n for n, _ in check(nan).failures] == ["a.grad"]
    rep.values = {"loss": np.array(2.0), "a.grad": near, "b.grad": want["b.grad"]}
    assert [n for n, _ in compare_eager(rep, "float32", want, "loss", 0.06).failures] == ["a.grad"]  # float32: max


# -- on gloo --------------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT / "src"))


def _run(*args: str) -> dict[str, Any]:
    p = subprocess.run([sys.executable, "-m", "spmdkit", "run", "--json", "--kernels", "torch", "--warmup", "0",
                        "--timeout", "120", *args], capture_output=True, text=True, env=_env(), timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def _common(rep: dict[str, Any], dtype: str) -> None:
    assert rep["ok"] and rep["collectives_match"] and not rep["failures"] and rep["nonfinite"] == 0, rep["failures"][:5]
    assert rep["kernels"] == "torch" and rep["checked"] > 100
    assert 0 < rep["max_rel_error"] <= TOLERANCES[dtype]  # sharding reorders sums: not bit-equal, within tolerance
    assert rep["loss"] == pytest.approx(rep["reference_loss"], rel=10 * TOLERANCES[dtype])
    for ph in ("forward", "backward", "optimizer"):  # measured and predicted, per phase
        assert rep["timing"][ph]["compute"] > 0 and rep["predicted"][ph]["compute"] > 0
    assert rep["timing"]["step"]["wall"] > 0 and rep["predicted_on"]


def test_run_tiny_llama_float32_with_torch_kernels() -> None:
    rep = _run("--model", "tiny-llama", "--layers", "1", "--mesh", "dp=2,tp=2")
    _common(rep, "float32")
    assert {(c["kind"], c["mesh_dim"]) for c in rep["collectives"]} >= {("all_reduce", 0), ("all_reduce", 1)}


def test_run_hf_llama_bfloat16_with_torch_kernels() -> None:
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'spmdkit[hf]')")
    cfg = {"num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 128, "vocab_size": 256}
    rep = _run("--hf", "LlamaForCausalLM", "--hf-config", json.dumps(cfg), "--dtype", "bfloat16", "--mesh",
               "dp=1,tp=2", "--pad", "3")
    _common(rep, "bfloat16")
    assert rep["loss_tensor"] == "cross_entropy_loss" and 4.5 < rep["loss"] < 7  # about ln(256)
    eager = rep["eager"]  # torch's float32 autograd on the same bfloat16 weights
    assert eager["checked"] > 10 and not eager["failures"] and eager["max_rel_error"] <= TOLERANCES["bfloat16"]


def test_the_report_prints_time_per_phase_beside_the_prediction() -> None:
    from spmdkit.execute.check import RunReport
    from spmdkit.execute.report import format_report, predicted_timing

    _, plan, _ = plan_model("tiny-llama", "dp=2,tp=2", "megatron", {"layers": 1})
    pred, on = predicted_timing(plan, "h100")
    assert on == "NVIDIA H100 SXM5 80GB" and set(pred) == {"forward", "backward", "optimizer", "step"}
    assert all(pred[p]["compute"] > 0 for p in ("forward", "backward", "optimizer"))
    assert pred["forward"]["comm"] > 0 and pred["step"]["wall"] == pytest.approx(
        sum(v["compute"] + v["comm"] for k, v in pred.items() if k != "step"))
    rep = RunReport(4, "gloo", kernels="torch", predicted=pred, predicted_on=on,
                    timing={"forward": {"compute": 0.25, "comm": 0.002}, "backward": {"compute": 1.5, "comm": 3e-4},
                            "optimizer": {"compute": 2e-5, "comm": 0.0}, "step": {"wall": 1.75}})
    text = format_report(rep, "t")
    assert ("time per phase (torch kernels, slowest rank; no warm-up: includes torch's first-call overhead, "
            "--warmup 1 to exclude it; predicted: the plan on NVIDIA H100 SXM5 80GB") in text
    rep.warmup = 1
    assert "time per phase (torch kernels, slowest rank; after 1 untimed step; predicted:" in format_report(rep, "t")
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("forward"))
    assert "250.00 ms" in line and "2.00 ms" in line
    assert "step           1.75 s (predicted" in text


def _arrays(ref: Any, spec: dict[str, Any], rng: Any) -> dict[str, Any]:
    from spmdkit.sim.cases import TGen, make_array

    out: dict[str, Any] = {}
    for k, v in spec.items():
        if isinstance(v, TGen):
            out[k] = make_array(v.shape, v.domain or ref.domain(k), rng)
        elif isinstance(v, list) and v and all(isinstance(t, (TGen, type(None))) for t in v):
            out[k] = [None if t is None else make_array(t.shape, t.domain or ref.domain(k), rng) for t in v]
        else:
            out[k] = v
    for p in ref.tensor_params:
        out.setdefault(p, None)
    return out


def _torch_args(a: dict[str, Any]) -> dict[str, Any]:
    def conv(v: Any) -> Any:
        if isinstance(v, (np.ndarray, np.generic)):
            return torch.as_tensor(np.array(v))
        if isinstance(v, list) and v and all(isinstance(x, (np.ndarray, type(None))) for x in v):
            return [None if x is None else torch.as_tensor(np.array(x)) for x in v]
        return v

    return {k: conv(v) for k, v in a.items()}


def test_every_torch_kernel_equals_its_numpy_reference_on_the_simulator_cases() -> None:
    """Every rule with a torch kernel and a case generator, 6 generated cases each, global, float64:
    the kernel's outputs equal the reference's (cast excepted: it really casts, the reference
    keeps float64; flash_attention's return_softmax is refused by design)."""
    import random

    from spmdkit.execute.kernels import get_kernel, run_kernel
    from spmdkit.sim.cases import GENERATORS, rand_mesh
    from spmdkit.sim.reference import REFERENCES, Ctx

    checked: set[str] = set()
    for name, ref in sorted(REFERENCES.items()):
        kernel = get_kernel(name)
        if kernel is None or ref.family not in GENERATORS or name == "cast":
            continue
        for i in range(6):
            r = random.Random(f"torch:{name}:{i}")
            spec = GENERATORS[ref.family](r, rand_mesh(r), ref)
            if name.startswith("flash_attention") and spec.get("return_softmax"):
                continue
            a = _arrays(ref, spec, np.random.default_rng(i))
            if ref.prepare is not None:
                ref.prepare(a)
            shapes = {k: (list(np.shape(v)) if isinstance(v, np.ndarray) else
                          [None if x is None else list(np.shape(x)) for x in v]
                          if isinstance(v, list) and v and isinstance(v[0], (np.ndarray, type(None))) else None)
                      for k, v in a.items()}
            ctx = Ctx(None, shapes=shapes)  # type: ignore[arg-type]  # the global run needs no mesh
            try:
                with np.errstate(all="ignore"):
                    want = ref.run(dict(a), ctx)
            except Exception:  # a case the reference itself rejects (an out-of-range attribute)
                continue
            with torch.no_grad():
                got = run_kernel(ref, kernel, _torch_args(a), ctx)
            assert len(got) == len(want), name
            for j, (w, g) in enumerate(zip(want, got)):
                if w is None:
                    continue
                wa = np.asarray(w, dtype=np.float64)
                ga = g.double().numpy()
                assert ga.shape == wa.shape, (name, i, j)
                fin = np.isfinite(wa)
                assert np.array_equal(fin, np.isfinite(ga)) and np.array_equal(wa[~fin], ga[~fin]), (name, i, j)
                tol = 1e-6 * max(1.0, float(np.max(np.abs(wa[fin]), initial=0.0)))
                assert np.max(np.abs(wa[fin] - ga[fin]), initial=0.0) <= tol, (name, i, j)
            checked.add(name)
    assert len(checked) > 250  # nearly every kernel has cases
