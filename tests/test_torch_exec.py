"""torch.distributed execution of plans (``spmdkit run``) and DTensor export, on local gloo
processes: loss and every tensor equal to the single-process step, the collectives each rank
issues equal to the plan's, every reshard step kind executed for real, DTensor placements that
split as spmdkit does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'spmdkit[torch]')")

from spmdkit.execute.collectives import Collective, expected_collectives  # noqa: E402
from spmdkit.planner.planning import plan_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _spmdkit_run(*args: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.run([sys.executable, "-m", "spmdkit", "run", "--json", "--kernels", "numpy", *args], capture_output=True, text=True,
                       env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return dict(json.loads(p.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize(("model", "strategy", "mesh"), [
    ("tiny-llama", "megatron", "dp=2,tp=2"),
    ("tiny-llama", "megatron,sp", "dp=2,tp=2"),
    ("tiny-gpt2", "megatron,sp,zero", "dp=2,tp=2"),
    ("tiny-llama", "megatron,zero3", "dp=2,tp=2"),  # parameters gathered again in the backward: issued twice
    # a one-rank dp dim: its gradient all-reduces are identities (once summed over the whole world)
    ("tiny-gpt2", "megatron", "dp=1,tp=2"),
])
def test_run_equals_single_process_and_plan(model: str, strategy: str, mesh: str) -> None:
    rep = _spmdkit_run("--model", model, "--mesh", mesh, "--strategy", strategy)
    assert rep["ok"], rep["failures"]
    assert rep["world_size"] == plan_model(model, mesh, strategy)[1].mesh.size and rep["backend"] == "gloo"
    assert rep["max_error"] <= 1e-5
    assert rep["loss"] == pytest.approx(rep["reference_loss"], rel=1e-9)
    assert rep["checked"] > 100  # loss, every gradient, update and activation
    # the collectives rank 0 issued are the plan's, one by one (every rank's were checked equal)
    _, plan, _ = plan_model(model, mesh, strategy)
    want = expected_collectives(plan)
    got = [Collective(**c) for c in rep["collectives"]]
    assert got == want and rep["collectives_match"]
    kinds = {c.kind for c in want}
    assert "all_reduce" in kinds or strategy.endswith("zero")
    if "sp" in strategy.split(","):
        assert {"all_gather", "reduce_scatter"} <= kinds


def test_megatron_collective_counts() -> None:
    """Megatron TP on 2 layers: 2 all-reduces per layer forward and 2 backward, the embedding's
    and the head's, plus one data-parallel all-reduce per parameter gradient."""
    _, plan, _ = plan_model("tiny-llama", "dp=2,tp=2", "megatron")
    want = expected_collectives(plan)
    tp = [c for c in want if c.kind == "all_reduce" and c.mesh_dim == 1]
    dp = [c for c in want if c.kind == "all_reduce" and c.mesh_dim == 0]
    assert len(tp) == 2 * 2 * 2 + 2
    params = [t for t in plan.program.tensors.values() if t.kind == "parameter" and t.inplace_of is None]
    assert len(dp) == len(params)


_WORKER = textwrap.dedent('''
    import json, random, sys
    import numpy as np
    import torch, torch.distributed as dist
    from spmdkit.core.dist_attr import TensorDistAttr, entry_dims
    from spmdkit.core.mesh import ProcessMesh
    from spmdkit.core.reshard import plan_reshard
    from spmdkit.sim.mesh import assemble, shard
    from spmdkit.execute.rank import Rank
    from spmdkit.outputs.dtensor import placements
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    sys.path.insert(0, sys.argv[3])  # tests/: test_reshard's random dist attrs
    from test_reshard import _rand_attr

    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    def run(mesh_shape):
        mesh = ProcessMesh(mesh_shape)
        me = Rank(mesh, rank, torch.device("cpu"))
        r = random.Random(7)
        rng = np.random.default_rng(7)

        def rand_attr(ndim):
            return _rand_attr(r, mesh, ndim)

        kinds = set()
        bad = []
        dt_checked = 0
        dmesh = init_device_mesh("cpu", tuple(mesh_shape))
        for case in range(int(sys.argv[2])):
            ndim = r.randint(1, 3)
            shape = [r.choice([8, 16]) for _ in range(ndim)]
            src, dst = rand_attr(ndim), rand_attr(ndim)
            g = rng.standard_normal(shape)
            pieces = shard(g, src, rng)  # every process draws the same pieces
            a = pieces[rank]
            steps = plan_reshard(src, dst, shape, 8).steps
            me.record.clear()
            for st in steps:
                a = me.step("t", st, a)
                kinds.add(st.kind)
            if [c.kind for c in me.record] != [s.kind for s in steps if s.kind not in ("slice", "to_partial")]:
                bad.append((case, "collectives differ from the steps"))
            allp = [None] * mesh.size
            dist.all_gather_object(allp, a)
            if not np.allclose(assemble(allp, dst, shape), g):
                bad.append((case, f"{src} -> {dst}: wrong value"))
            if not dst.partial and all(list(entry_dims(e)) == sorted(entry_dims(e)) for e in dst.dims_mapping):
                loc = distribute_tensor(torch.from_numpy(g), dmesh, list(placements(dst))).to_local().numpy()
                if loc.shape != a.shape or not np.allclose(loc, a):
                    bad.append((case, f"DTensor local shard of {dst} differs from spmdkit's"))
                dt_checked += 1
        # a module's parameters distributed as a plan says
        from types import SimpleNamespace
        from spmdkit.outputs.dtensor import distribute_parameters
        torch.manual_seed(0)
        lin = torch.nn.Linear(8, 16).double()
        w0 = lin.weight.detach().numpy().copy()
        wattr = TensorDistAttr(mesh, [0, -1] if mesh.ndim == 1 else [0, 1])
        plan = SimpleNamespace(mesh=mesh, attrs={"w": wattr, "b": TensorDistAttr(mesh, [-1])})
        applied = distribute_parameters(lin, plan, {"weight": "w", "bias": "b"}, dmesh)
        if not np.allclose(lin.weight.to_local().detach().numpy(), shard(w0, wattr)[rank]):
            bad.append(("distribute_parameters", "weight shard differs"))
        if sorted(applied) != ["bias", "weight"]:
            bad.append(("distribute_parameters", str(applied)))
        return {"bad": bad, "kinds": sorted(kinds), "dtensor_checked": dt_checked}

    got = {json.dumps(m): run(m) for m in json.loads(sys.argv[1])}
    if rank == 0:
        print(json.dumps(got))
    dist.barrier()
    dist.destroy_process_group()
''')


def _launch(script: Path, *args: str, n: int = 4) -> dict[str, Any]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE=str(n))
    procs = [subprocess.Popen([sys.executable, str(script), *args], env=dict(env, RANK=str(i)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_o, e) in zip(procs, outs):
        assert p.returncode == 0, e[-3000:]
    return dict(json.loads(outs[0][0].strip().splitlines()[-1]))


def test_every_reshard_step_runs_as_real_collectives(tmp_path: Path) -> None:
    """Random src -> dst reshards (partial, co-sharded, moved axes) executed step by step with
    gloo collectives reach exactly dst; DTensor's distribute_tensor with the exported
    placements gives every rank the same local shard as spmdkit's sharding. On a 2 x 2 and a
    4 mesh, in one launch of 4 processes."""
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    shapes = [[2, 2], [4]]
    got = _launch(script, json.dumps(shapes), "120", str(Path(__file__).parent))
    assert sorted(got) == sorted(json.dumps(m) for m in shapes)
    for shape, out in got.items():
        assert out["bad"] == [], shape
        assert {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "slice", "to_partial"} <= set(out["kinds"])
        assert out["dtensor_checked"] > 20, shape


def test_run_a_program_file(tmp_path: Path) -> None:
    """--program: a program JSON (here the tiny GPT-2 step) planned from --annotate alone."""
    from spmdkit.models.zoo import build_model, preset

    f = tmp_path / "prog.json"
    f.write_text(build_model(preset("tiny-gpt2")).program.dumps())
    rep = _spmdkit_run("--program", str(f), "--mesh", "dp=4", "--annotate", "tokens=[0,-1]")
    assert rep["ok"] and rep["collectives_match"] and rep["max_error"] <= 1e-5
    assert {c["kind"] for c in rep["collectives"]} == {"all_reduce"}  # data parallel: the gradients


def test_wrong_process_count_is_an_error() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    p = subprocess.run([sys.executable, "-m", "spmdkit", "run", "--mesh", "dp=2,tp=2", "--nproc", "3"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2
    assert "--nproc 3 but the mesh dp=2,tp=2 has 4 ranks" in p.stderr and "Traceback" not in p.stderr


def test_placements_of_dist_attrs() -> None:
    from torch.distributed.tensor import Partial, Replicate, Shard

    from spmdkit.core.dist_attr import TensorDistAttr
    from spmdkit.core.errors import InvalidDimsMappingError, InvalidPartialError
    from spmdkit.core.mesh import ProcessMesh
    from spmdkit.outputs.dtensor import placements

    m = ProcessMesh([2, 2], dim_names=["dp", "tp"])
    assert placements(TensorDistAttr(m, [0, -1], [1])) == (Shard(0), Partial("sum"))
    assert placements(TensorDistAttr(m, [-1, 1])) == (Replicate(), Shard(1))
    assert placements(TensorDistAttr(m, [(0, 1), -1])) == (Shard(0), Shard(0))  # co-shard, mesh-dim order
    assert placements(TensorDistAttr(m, [-1, -1], {0: "max"})) == (Partial("max"), Replicate())
    with pytest.raises(InvalidDimsMappingError, match="in an order DTensor"):
        placements(TensorDistAttr(m, [(1, 0), -1]))
    with pytest.raises(InvalidPartialError, match="no Partial reduce op for 'any'"):
        placements(TensorDistAttr(m, [-1, -1], {0: "any"}))


def test_imported_torch_model_runs_on_gloo(tmp_path: Path) -> None:
    """End to end: a LLaMA-style model written in plain torch, imported as a training step
    (spmdkit.models.torch_import), planned under Megatron TP x DP from parameter annotations, executed
    on 4 gloo processes: every tensor equals the single-process step, the collectives the plan's."""
    import test_torch_import as tti
    from spmdkit.models.torch_import import import_module

    prog = import_module(tti._model(tti.Llama), tti._data(), training=True)
    f = tmp_path / "llama.json"
    f.write_text(prog.dumps())
    ann: list[str] = []
    for name, dm in tti._megatron(prog, tp=1, dp=0).items():
        ann += ["--annotate", f"{name}={json.dumps(dm)}"]
    rep = _spmdkit_run("--program", str(f), "--mesh", "dp=2,tp=2", *ann)
    assert rep["ok"] and rep["collectives_match"] and rep["max_error"] <= 1e-5
    assert rep["checked"] > 250
    kinds = [c["kind"] for c in rep["collectives"]]
    assert kinds.count("all_reduce") > 20  # the row-parallel outputs and the dp gradients
