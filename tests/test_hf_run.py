"""HuggingFace programs run on the model's real values (issue 14): recorded constants and buffers
(boolean masks, epsilons, -inf fills, position ids) stay what the module recorded, inputs are
drawn in their valid ranges, explicit values reach the simulator and the executor, the loss is
found by its role, and ``spmdkit run --hf`` on 4 gloo processes equals torch eager (the loss and
every parameter gradient by torch autograd, float32, rtol 1e-5 of each tensor's largest
magnitude) with every value finite.

In-process (fast): all 12 tiny models of tests/test_hf.py, padded batch and -100 labels, a
data-parallel plan simulated on recorded values with drawn inputs and on the model's own values
(its loss equal to torch eager's). On gloo (about 15-25 s each): Llama (dp=4, padded), GPT-2
(dp=2 x tp=2, megatron), BERT (dp=2 x tp=2, megatron,sp, padded, MLM labels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import run_cli_line

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'spmdkit[torch]')")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'spmdkit[hf]')")

import test_hf as th  # noqa: E402
from spmdkit.core.errors import ProgramError  # noqa: E402
from spmdkit.models.torch_import import ImportedProgram, import_module, torch_values  # noqa: E402
from spmdkit.planner.propagate import propagate  # noqa: E402
from spmdkit.program.ir import Program, ProgramBuilder, load_program, program_from_json  # noqa: E402
from spmdkit.sim.plan import int_roles, loss_name, simulate_plan, source_values  # noqa: E402
from spmdkit.strategies.strategy import parse_mesh  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")

ROOT = Path(__file__).resolve().parents[1]
MESH = parse_mesh("dp=2")


@pytest.fixture(scope="module")
def imported() -> Any:
    """``imported(name)`` -> (program, float32 model, padded keyword inputs with labels)."""
    cache: dict[str, Any] = {}
    cfgs = th._configs()

    def get(name: str) -> tuple[ImportedProgram, Any, dict[str, Any]]:
        if name not in cache:
            cls, cfg = cfgs[name]
            torch.manual_seed(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m = cls(cfg).float()
            m.eval()
            kw = th._inputs(name, labels=True)
            cache[name] = (import_module(m, (), kw, training=True), m, kw)
        return cache[name]
    return get


def _dp_plan(prog: Program) -> Any:
    """Data parallel: the batch axis of the call's inputs over dp."""
    ann = {n: [0] + [-1] * (len(prog.tensors[n].shape) - 1) for n, (k, _) in prog.sources.items()
           if k == "input"}
    return propagate(prog, MESH, ann)


def _torch_loss(m: Any, kw: dict[str, Any]) -> float:
    with torch.no_grad():
        return float(th._eager(m, kw).loss)


@pytest.mark.parametrize("name", th.MODELS)
def test_simulate_plan_on_real_values(imported: Any, name: str) -> None:
    prog, m, kw = imported(name)
    plan = _dp_plan(prog)
    # recorded constants and buffers, inputs drawn in their ranges: sound, every value checked finite
    rep = simulate_plan(plan)
    assert rep.ok, rep.failures[:3]
    assert rep.checked > 150 and rep.loss is not None and np.isfinite(rep.loss)
    vals = source_values(prog)
    for n, c in prog.constants.items():  # constants are what the module recorded, masks as booleans
        want = c.float().numpy() if c.dtype == torch.bfloat16 else c.numpy()
        assert vals[n].shape == want.shape and np.array_equal(vals[n], want.astype(vals[n].dtype)), n
        assert (vals[n].dtype == np.bool_) == (c.dtype == torch.bool), n
    for n, (kind, fqn) in prog.sources.items():
        if kind == "buffer":
            assert np.array_equal(vals[n], dict(m.named_buffers())[fqn].numpy()), n
    # the model's own weights and inputs: the simulated loss is torch eager's
    rep = simulate_plan(plan, values=torch_values(prog, m, kwargs=kw))
    assert rep.ok, rep.failures[:3]
    assert rep.loss == pytest.approx(_torch_loss(m, kw), rel=1e-5)


def test_inputs_drawn_in_their_valid_ranges(imported: Any) -> None:
    prog, _, _ = imported("llama")
    roles = int_roles(prog)
    assert (roles["input_ids"].bound, roles["input_ids"].ignore_index) == (th.V, None)
    assert (roles["labels"].bound, roles["labels"].ignore_index) == (th.V, -100)  # through HF's pad and shift
    assert roles["attention_mask"].bound is None  # a mask
    v = source_values(prog, seed=3)
    ids, lab, mask = v["input_ids"], v["labels"], v["attention_mask"]
    assert ids.min() >= 0 and ids.max() < th.V
    ignored = lab == -100
    assert ignored.any() and not ignored.all() and lab[~ignored].max() < th.V and lab[~ignored].min() >= 0
    assert set(np.unique(mask)) == {0, 1} and mask[:, 0].all() and mask[0].all()  # padded, every row kept
    # T5: the labels also make the decoder's inputs, where HF replaces -100 first (a where):
    # they may still be ignored; ViT's class labels are below the class count
    t5 = int_roles(imported("t5")[0])
    assert (t5["labels"].bound, t5["labels"].ignore_index) == (th.V, -100)
    assert int_roles(imported("vit")[0])["labels"].bound == 10


def test_loss_found_by_role(imported: Any) -> None:
    from spmdkit.models.zoo import build_model, preset

    prog, _, _ = imported("gpt2")
    assert loss_name(prog) == prog.loss == "cross_entropy_loss"
    # a program file does not carry `loss`: the scalar whose gradient seeds the backward is it
    assert loss_name(program_from_json(json.loads(prog.dumps()))) == "cross_entropy_loss"
    assert loss_name(build_model(preset("tiny-llama")).program) == "loss"
    assert loss_name(imported("gpt2")[0]) != "loss"


def test_program_file_keeps_recorded_values(imported: Any, tmp_path: Path) -> None:
    prog, _, _ = imported("bert")
    f = tmp_path / "bert.json"
    f.write_text(prog.dumps())
    back = load_program(str(f))
    assert set(back.values) == set(prog.values) and back.values == prog.values
    assert {n for n, (k, _) in prog.sources.items() if k in ("constant", "buffer")} == set(prog.values)
    rep = simulate_plan(_dp_plan_file(back, prog))
    assert rep.ok, rep.failures[:3]
    # without them the boolean mask is drawn as a padding mask, not as random floats
    obj = json.loads(prog.dumps())
    del obj["values"]
    bare = program_from_json(obj)
    assert source_values(bare)["const_0"].dtype == np.bool_


def _dp_plan_file(back: Program, prog: ImportedProgram) -> Any:
    ann = {n: [0] + [-1] * (len(prog.tensors[n].shape) - 1) for n, (k, _) in prog.sources.items() if k == "input"}
    return propagate(back, MESH, ann)


@pytest.mark.parametrize(("edit", "msg"), [
    (lambda v: v.update(nosuch=v["const_0"]), "no tensor 'nosuch'"),
    (lambda v: v["const_0"].update(shape=[2, 2]), "is not the tensor's"),
    (lambda v: v["const_0"].update(zlib_base64="!!!"), "does not decode"),
    (lambda v: v["const_0"].update(zlib_base64="eJwDAAAAAAE="), "0 bytes, expected"),
    (lambda v: v["const_0"].update(dtype="complex64"), "is not one of"),
    (lambda v: v["const_0"].pop("dtype"), "exactly dtype, shape and zlib_base64"),
    (lambda v: v.update({"cross_entropy_loss": v["const_0"]}), "an op makes this tensor"),
])
def test_bad_recorded_values_are_refused(imported: Any, edit: Any, msg: str) -> None:
    obj = json.loads(imported("bert")[0].dumps())
    edit(obj["values"])
    with pytest.raises(ProgramError, match=msg):
        program_from_json(obj)


def test_explicit_values_are_checked() -> None:
    b = ProgramBuilder("t")
    x = b.tensor("x", (2, 3), "float32", "input")
    w = b.tensor("w", (3,), "float32", "parameter")
    b.op("multiply", {"x": x, "y": w}, [("y", (2, 3), "float32")])
    prog = b.build()
    got = source_values(prog, values={"w": [1, 2, 3]})
    assert got["w"].dtype == np.float64 and list(got["w"]) == [1.0, 2.0, 3.0]
    with pytest.raises(ProgramError, match="no such tensor"):
        source_values(prog, values={"nosuch": np.ones(3)})
    with pytest.raises(ProgramError, match="shape \\[2\\] is not the tensor's \\[3\\]"):
        source_values(prog, values={"w": np.ones(2)})
    with pytest.raises(ProgramError, match="the step makes this tensor"):
        source_values(prog, values={"y": np.ones((2, 3))})


def test_masked_scores_hold_minus_inf_and_pass_but_a_nan_never() -> None:
    """-inf in an activation (HF's masked scores) is a value, compared exactly; a loss or a
    gradient that is infinite, or any NaN, is not checkable."""
    b = ProgramBuilder("mask")
    s = b.tensor("s", (2, 4), "float32", "input")
    keep = b.tensor("keep", (2, 4), "bool", "input")
    fill = b.tensor("fill", (), "float32", "input")
    (m,) = b.op("where", {"condition": keep, "x": s, "y": fill}, [("masked", (2, 4), "float32")])
    b.op("softmax", {"x": m}, [("p", (2, 4), "float32")], axis=-1)
    prog = b.build()
    plan = propagate(prog, MESH, {"s": [0, -1], "keep": [0, -1]})
    keep_v = np.array([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=bool)
    rep = simulate_plan(plan, values={"fill": np.float64(-np.inf), "keep": keep_v})
    assert rep.ok and rep.checked == 2, rep.failures
    rep = simulate_plan(plan, values={"fill": np.float64(np.nan), "keep": keep_v})
    assert not rep.ok and any("not checkable" in why for _, why in rep.failures)


# -- spmdkit run --hf on 4 gloo processes, against torch eager ---------------------------------------

_CFG = {
    "llama": ("LlamaForCausalLM", {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                   "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256}),
    "gpt2": ("GPT2LMHeadModel", {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": 64}),
    "bert": ("BertForMaskedLM", {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                 "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64}),
}
def _spmdkit_run(*args: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.run([sys.executable, "-m", "spmdkit", "run", "--json", "--kernels", "numpy", "--timeout", "120",
                        *args], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


def _run_hf(name: str, mesh: str, *extra: str) -> dict[str, Any]:
    cls, cfg = _CFG[name]
    return _spmdkit_run("--hf", cls, "--hf-config", json.dumps(cfg), "--mesh", mesh, *extra)


@pytest.mark.parametrize(("name", "mesh", "extra"), [
    ("llama", "dp=4", ("--strategy", "dp", "--pad", "4")),
    ("gpt2", "dp=2,tp=2", ()),  # the default: megatron (c_attn split head-wise)
    ("bert", "dp=2,tp=2", ("--strategy", "megatron,sp", "--pad", "5")),
])
def test_run_hf_equals_torch_eager(name: str, mesh: str, extra: tuple[str, ...]) -> None:
    rep = _run_hf(name, mesh, *extra)
    assert rep["ok"] and rep["collectives_match"] and not rep["failures"], rep["failures"][:5]
    assert rep["world_size"] == 4 and rep["nonfinite"] == 0
    assert rep["loss_tensor"] == "cross_entropy_loss"
    eager = rep["eager"]
    # parameter tensors (tied heads once; GPT-2's c_attn weight and bias: 3 parts each under megatron)
    n_params = {"llama": 21, "gpt2": 28 + 2 * 4, "bert": 42}[name]
    assert eager["dtype"] == "float32" and eager["checked"] == 1 + n_params and not eager["failures"]
    assert eager["max_rel_error"] <= 1e-5
    assert isinstance(rep["loss"], float) and rep["loss"] == pytest.approx(eager["loss"], rel=1e-5)
    assert 4.5 < rep["loss"] < 7  # about ln(256): random weights, a real cross-entropy
    kinds = {(c["kind"], c["mesh_dim"]) for c in rep["collectives"]}
    assert ("all_reduce", 0) in kinds  # the data-parallel gradients
    if name == "gpt2":
        assert ("all_reduce", 1) in kinds  # megatron: the row-parallel outputs
    if name == "bert":
        assert {("all_gather", 1), ("reduce_scatter", 1)} <= kinds  # sequence parallel


def test_run_program_file_on_its_recorded_values(imported: Any, tmp_path: Path) -> None:
    """--program: an imported BERT step written to JSON (its masks and buffers in `values`) runs
    on 2 gloo processes: every value finite, the loss line found by role (its weights drawn)."""
    prog, _, _ = imported("bert")
    f = tmp_path / "bert.json"
    f.write_text(prog.dumps())
    ann = [a for n in ("input_ids", "attention_mask", "labels") for a in ("--annotate", f"{n}=[0,-1]")]
    rep = _spmdkit_run("--program", str(f), "--mesh", "dp=2", *ann)
    assert rep["ok"] and rep["collectives_match"] and not rep["failures"] and rep["nonfinite"] == 0
    assert rep["loss_tensor"] == "cross_entropy_loss" and rep["eager"] is None
    assert isinstance(rep["loss"], float) and rep["loss"] > 0
    assert rep["loss"] == pytest.approx(rep["reference_loss"], rel=1e-12)
    assert rep["checked"] > 400


def test_run_hf_bad_arguments_are_one_line_errors(capsys: pytest.CaptureFixture[str], monkeypatch: Any) -> None:
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    cfg = json.dumps(_CFG["llama"][1])
    cases = [
        (["--hf", "LlamaForCausalLM"], "spmdkit run: --hf needs --hf-config FILE|JSON"),
        (["--pad", "2"], "spmdkit run: --pad applies to --hf CLASS only"),
        (["--hf-config", cfg], "spmdkit run: --hf-config applies to --hf CLASS only"),
        (["--hf", "LlamaForCausalLM", "--hf-config", cfg, "--dtype", "fp8"], "hf: dtype 'fp8' is not one of"),
        (["--hf", "LlamaForCausalLM", "--hf-config", cfg, "--pad", "16"], "--pad 16: must be in [0, --seq 16)"),
        (["--hf", "NoSuchModel", "--hf-config", cfg], "hf: transformers has no model class 'NoSuchModel'"),
        (["--hf", "LlamaForCausalLM", "--hf-config", "{not json"], "hf: config is not valid JSON"),
        (["--hf", "LlamaForCausalLM", "--hf-config", cfg, "--mesh", "dp=3", "--strategy", "dp"],
         "--strategy dp: input input_ids has batch size 4, which dp=3 does not divide"),
        (["--hf", "LlamaForCausalLM", "--hf-config", cfg, "--mesh", "dp=4"],
         "--strategy megatron: the mesh has no 'tp' dim"),
        (["--hf", "LlamaForCausalLM", "--hf-config", cfg, "--mesh", "dp=2,tp=2", "--tp-plan", "{nope"],
         "--tp-plan '{nope': not JSON"),
        (["--tp-plan", "{}"], "spmdkit run: --tp-plan applies to --hf or --program models"),
        (["--hf", "LlamaForCausalLM", "--hf-config", cfg, "--mesh", "dp=2", "--annotate", "nosuch=[0]", "--strategy", "dp"],
         "--annotate 'nosuch': the program has no such tensor"),
    ]
    for args, says in cases:
        rc, line = run_cli_line(capsys, *args)
        assert rc == 2 and says in line, (args, rc, line)


def test_eager_comparison_can_fail() -> None:
    """The comparison with torch eager: within rtol of each tensor's scale (a gradient's scale at
    least a thousandth of the largest gradient), every value finite, every tensor present."""
    from spmdkit.execute.check import RunReport
    from spmdkit.execute.eager import compare_eager

    ref = {"loss": np.array(5.0), "a.grad": np.array([1.0, -2.0]), "b.grad": np.array([1e-12, 0.0])}
    rep = RunReport(4, "gloo")
    rep.values = {"loss": np.array(5.0 + 4e-5), "a.grad": np.array([1.0, -2.0 + 1e-5]),
                  "b.grad": np.array([0.0, 1e-9])}  # b: noise under 1e-5 of 2e-3, the floor
    chk = compare_eager(rep, "float32", ref, "loss", 1e-5)
    assert not chk.failures and chk.checked == 3 and chk.loss == 5.0
    assert chk.max_rel_error == pytest.approx(8e-6)
    rep.values["a.grad"] = np.array([1.0, -2.0 + 1e-4])
    rep.values["loss"] = np.array(5.0 + 1e-4)
    rep.values["b.grad"] = np.array([np.nan, 0.0])
    chk = compare_eager(rep, "float32", ref, "loss", 1e-5)
    assert {n for n, _ in chk.failures} == {"loss", "a.grad", "b.grad"}
    del rep.values["a.grad"]
    chk = compare_eager(rep, "float32", ref, "loss", 1e-5)
    assert any(n == "a.grad" and "did not make" in why for n, why in chk.failures)


def test_launcher_hands_its_ranks_the_step(monkeypatch: Any) -> None:
    """The local launcher computes a --hf step's values and torch eager's reference once and
    hands them with the plan to its own ranks (not to processes it did not start)."""
    import shutil

    from spmdkit.cli.run import STEP_ENV, _load_step, _save_step, _Step
    from spmdkit.execute.eager import eager_reference
    from spmdkit.planner.planning import plan_hf

    cls, cfg = _CFG["gpt2"]
    prog, model, kw, plan = plan_hf(cls, json.dumps(cfg), "dp=2", "dp", "float32", 2, 16, {})
    monkeypatch.delenv(STEP_ENV, raising=False)
    d = _save_step(_Step(plan, "t", model, kw))
    try:
        monkeypatch.setenv("SPMDKIT_LAUNCHER_PID", str(os.getppid()))
        got = _load_step()
        assert got is not None and got.model is None and got.plan.program.tensors == prog.tensors
        assert got.values is not None and set(got.values) == set(torch_values(prog, model, kwargs=kw))
        assert isinstance(got.eager_ref, tuple)
        dtype, ref = got.eager_ref
        want = eager_reference(prog, model, (), kw)[1]
        assert dtype == "float32" and set(ref) == set(want) and len(ref) == 1 + len(prog.grads)
        assert all(np.array_equal(ref[n], want[n]) for n in ref)
        monkeypatch.setenv("SPMDKIT_LAUNCHER_PID", "1")  # another parent: it plans for itself
        assert _load_step() is None
    finally:
        shutil.rmtree(d)
        os.environ.pop(STEP_ENV, None)


def test_a_rewritten_copy_keeps_the_recorded_values(imported: Any) -> None:
    """A program rewritten as a copy (``__dict__`` copied, then ``Program.__init__`` with new
    tensors and ops, as strategies rewrite imported programs) keeps the recorded values of the
    tensors it still has, and only those."""
    prog, _, _ = imported("bert")
    new = prog.__class__.__new__(prog.__class__)
    new.__dict__.update(prog.__dict__)
    gone = next(iter(prog.values))
    Program.__init__(new, [t for n, t in prog.tensors.items() if n != gone],
                     [op for op in prog.ops if gone not in op.input_names()], prog.name)
    assert new.values == {n: v for n, v in prog.values.items() if n != gone} and new.values
    assert Program(prog.tensors.values(), prog.ops).values == {}


# -- the torch check: each op against what its ranks received -----------------------------------------


#: rows of ``a`` and columns of ``w`` whose product is zero in exact arithmetic (the halves negate
#: each other) but not in a float32 matmul over all four: which leaves a remainder depends on the
#: CPU kernel's order and FMA (the first is 0 on an AMD EPYC's, the second -3e-8 there)
CANCELLING = (([0.1, 0.7, -0.1, -0.7], [0.3, 0.9, 0.3, 0.9]), ([0.7, 0.1, -0.7, -0.1], [0.9, 0.3, 0.9, 0.3]),
              ([0.3, 0.1, -0.3, -0.1], [0.9, 1e-4, 0.9, 1e-4]))


def _adam_on_a_cancelling_gradient() -> tuple[Any, dict[str, Any], Any, Any]:
    """A gradient that is zero in exact arithmetic, made partial over tp = 2 (a row-parallel
    matmul) and all-reduced before AdamW: (plan, the ranks' values, the received gradient's key,
    the all-reduced gradient). Adam's first step is ``lr * g / (|g| + eps)``: on 0 it is 0, on a
    rounding remainder (1e-9 to 3e-8, by the CPU kernel) it is lr / 10 to lr / 1.3."""
    from spmdkit.models.zoo import Model, ModelConfig, add_optimizer

    b = ProgramBuilder("adam")  # a gradient partial over tp, and another gradient (the step's scale)
    a_ = b.tensor("a", (1, 4), "float32", "input")
    w = b.tensor("w", (4, 1), "float32", "input")
    c = b.tensor("c", (1, 2), "float32", "input")
    p = b.tensor("p", (1, 1), "float32", "parameter")
    q = b.tensor("q", (1, 2), "float32", "parameter")
    b.phase = "backward"
    (g,) = b.op("matmul", {"x": a_, "y": w}, [("p.grad", (1, 1), "float32", "gradient")])
    (gq,) = b.op("multiply", {"x": c, "y": c}, [("q.grad", (1, 2), "float32", "gradient")])  # the step's others
    b.phase = "optimizer"
    add_optimizer(b, Model(ModelConfig(), Program([], []), {}, [], [], {}), {p: g, q: gq}, "adamw")
    prog = b.build()
    plan = propagate(prog, parse_mesh("tp=2"), {"a": [-1, 0], "w": [0, -1]})
    t = torch.from_numpy
    for a_row, w_col in CANCELLING:  # the first whose single sum leaves a remainder on this CPU's kernel
        av = np.array([a_row], dtype=np.float32)
        wv = np.array(w_col, dtype=np.float32).reshape(4, 1)
        single = float((t(av) @ t(wv)).item())
        halves = [(t(av[:, :2]) @ t(wv[:2])).numpy(), (t(av[:, 2:]) @ t(wv[2:])).numpy()]
        reduced = halves[0] + halves[1]
        if reduced.item() == 0.0 and single != 0.0:  # the sharded sums cancel exactly, the single one does not
            break
    else:
        pytest.fail(f"none of {CANCELLING} leaves a rounding remainder in torch's float32 matmul here")
    values = {"a": av, "w": wv, "c": np.array([[0.6, -0.9]], np.float32), "p": np.full((1, 1), 0.5, np.float32),
              "q": np.ones((1, 2), np.float32), "learning_rate": np.full((1,), 1e-3, np.float32)}
    for n, shape in (("p", (1, 1)), ("q", (1, 2))):  # Adam's first step: zero moments
        values.update({f"{n}.moment1": np.zeros(shape, np.float32), f"{n}.moment2": np.zeros(shape, np.float32),
                       f"{n}.beta1_pow": np.full((1,), 0.9, np.float32),
                       f"{n}.beta2_pow": np.full((1,), 0.999, np.float32)})
    return plan, values, halves, reduced


def _ranks(plan: Any, values: dict[str, Any], halves: list[Any], reduced: Any) -> tuple[Any, list[Any]]:
    """(the rank that checks, each rank's (outputs, collectives, timing, received)) as the two
    ranks computed the step: the partial gradient pieces, then AdamW on the all-reduced one."""
    from spmdkit.execute.rank import Rank
    from spmdkit.execute.single import global_step_torch

    prog = plan.program
    adam = next(o for o in plan.ops if o.op.rule == "adamw")
    req = adam.required["grad"]
    assert req.dims_mapping == (-1, -1) and not req.partial  # the update reads the gradient replicated
    after, _ = global_step_torch(plan, 0, values, optimizer_inputs={"p.grad": reduced})
    me = Rank.__new__(Rank)
    me.made = {n: plan.attrs[n] for op in prog.ops for n in op.output_names()}
    pieces = []
    for r in range(2):
        outs = {n: v.numpy().copy() for n, v in after.items() if n != "p.grad"}
        outs["p.grad"] = halves[r].copy()
        pieces.append((outs, [], {}, {("p.grad", req, ""): reduced.copy()}))
    return me, pieces


def _check(plan: Any, values: dict[str, Any], me: Any, pieces: list[Any]) -> Any:
    from spmdkit.execute.check import RunReport, check_torch

    rep = RunReport(2, "gloo")
    check_torch(rep, plan, pieces, me, 0, values, torch.device("cpu"))
    return rep


def test_adam_on_a_gradient_zero_in_exact_arithmetic_passes() -> None:
    """GPTBigCode's failure: the update is checked on the gradient the ranks received (an exact
    0), not on one recomputed in another order (a rounding remainder, whose Adam step is a sizeable part of lr)."""
    plan, values, halves, reduced = _adam_on_a_cancelling_gradient()
    me, pieces = _ranks(plan, values, halves, reduced)
    rep = _check(plan, values, me, pieces)
    assert not rep.failures, rep.failures
    assert rep.checked == 12 and rep.max_rel_error < 1e-5  # 2 gradients, AdamW's 5 outputs each
    assert rep.max_error < 1e-7  # p.grad's rounding remainder in the unsharded matmul; the updates exact
    assert float(pieces[0][0]["p.moment1.new"][0, 0]) == 0.0  # the ranks' exact zero gradient
    from spmdkit.execute.single import global_step_torch

    own, _ = global_step_torch(plan, 0, values)  # the step recomputed unsharded: Adam on 3.7e-8, not 0
    assert abs(float(own["p.new"]) - float(pieces[0][0]["p.new"][0, 0])) > 1e-3 * 0.5


@pytest.mark.parametrize("fault", ["kernel", "collective", "nan", "partial piece"])
def test_a_wrong_kernel_or_collective_or_a_nan_is_still_caught(fault: str) -> None:
    plan, values, halves, reduced = _adam_on_a_cancelling_gradient()
    me, pieces = _ranks(plan, values, halves, reduced)
    if fault == "kernel":  # rank 1's AdamW wrote a wrong update
        pieces[1][0]["p.new"] += 1e-3
        want = {"p.new"}
    elif fault == "collective":  # the all-reduce delivered a wrong sum, and the ranks updated with it
        me, pieces = _ranks(plan, values, halves, reduced + 0.25)
        want = {"p.grad"}
    elif fault == "nan":
        for p in pieces:  # the same NaN on both ranks (one rank alone: they disagree, also a failure)
            p[0]["p.moment2.new"][0, 0] = np.nan
        want = {"p.moment2.new"}
    else:  # rank 0's matmul piece is wrong: the op fails, not the ops after it
        pieces[0][0]["p.grad"] += 0.5
        want = {"p.grad"}
    rep = _check(plan, values, me, pieces)
    assert {n for n, _ in rep.failures} == want, rep.failures
    if fault == "collective":
        assert "moved from" in rep.failures[0][1]
    if fault == "nan":
        assert rep.nonfinite == 1


# -- --fallback replicate ----------------------------------------------------------------------------


def test_fallback_replicate_plans_warns_and_computes_as_torch(monkeypatch: Any,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """With gelu's lowering taken away, BERT does not import (the hint names --fallback
    replicate); with the flag it plans, the report's first lines name the replicated ops, and
    the step (the fallback's forward and its backward by torch autograd) equals torch eager."""
    from conftest import cli_stdout
    from spmdkit.execute.single import global_step_torch
    from spmdkit.models.hf import import_hf
    from spmdkit.models.torch_import.aten import BUILTIN
    from spmdkit.planner.planning import plan_program

    monkeypatch.delitem(BUILTIN, "aten.gelu")
    cls, cfg = _CFG["bert"]
    args = ["plan", "--hf", cls, "--hf-config", json.dumps(cfg), "--mesh", "dp=2,tp=2"]
    rc, _ = cli_stdout(*args)
    err = capsys.readouterr().err
    assert rc == 2 and "no mapping for aten op aten.gelu" in err and "--fallback replicate" in err, err
    rc, out = cli_stdout(*args, "--fallback", "replicate", "--verify")  # --verify imports it the same way
    assert rc == 0, capsys.readouterr().err
    assert "verify: BertForMaskedLM at a tiny config" in out and "all equal" in out
    head = out.splitlines()[:2]
    assert head[1].startswith("warning: --fallback replicate: 3 op(s) with no lowering imported replicated")
    assert head[1].count("aten.gelu.default") == 3
    rc, _ = cli_stdout("plan", "--fallback", "replicate")
    assert rc == 2 and "--fallback replicate: applies to --hf models" in capsys.readouterr().err

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog, model, kw = import_hf(cls, cfg, batch=2, seq=16, fallback="replicate", optimizer=None)
    fell = [op for op in prog.ops if op.rule == "replicated"]
    assert [op.phase for op in fell] == ["forward"] * 3 + ["backward"] * 3
    _p, plan = plan_program(prog, "dp=2,tp=2", "megatron")
    got, _ = global_step_torch(plan, 0, torch_values(prog, model, (), kw, dtype=np.float32))
    out_t = model(**kw)
    out_t.loss.backward()
    assert float(got["cross_entropy_loss"]) == pytest.approx(float(out_t.loss), rel=1e-5)
    big = max(float(p.grad.abs().max()) for p in model.parameters() if p.grad is not None)
    for n, p in model.named_parameters():
        if n in prog.grads and p.grad is not None:
            err = float((got[prog.grads[n]] - p.grad).abs().max())
            assert err <= 1e-5 * big, (n, err)
