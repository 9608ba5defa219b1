"""``spmdkit plan --export dtensor|jax|paddle FILE`` (spmdkit/export.py).

The jax and paddle exports are checked against the plan's dist attrs (no jax or paddle needed):
every parameter's PartitionSpec read back is its dims_mapping, every placement list is its
per-mesh-dim placements. The dtensor export is applied to the imported HF Llama (2 layers,
kv heads 2) with ``parallelize_module`` on a fake 4-rank process group (dp=2 x tp=2), and the
collectives torch's DTensor runs under ``CommDebugMode`` are counted against the plan's, per
phase and per module: the forward's tp all-reduces (2 per layer + the vocab-parallel embedding
= 5, in the modules that make the tensors the plan reduces: o_proj, down_proj, embed_tokens)
and the backward's (the attention and MLP inputs' summed gradients, 2 per layer, at the norms
whose output they share, + the LM head's input = 5); the loss, vocab-parallel in both (torch's
``loss_parallel``), runs outside the model and is counted apart. Every parameter's
DTensor placement on the tp mesh dim is the plan's."""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.placements import from_partition_spec, to_placements
from spmdkit.outputs.export import (
    DOC_FORMATS,
    ExportError,
    dtensor_document,
    export_plan,
    jax_document,
    paddle_document,
    read_document,
)
from spmdkit.planner.planning import plan_model
from spmdkit.program.ir import Program, Tensor
from spmdkit.strategies.hf import parameters


@pytest.fixture(scope="module")
def tiny_plan() -> Any:
    _, plan, _ = plan_model("tiny-llama", "dp=2,tp=2", "megatron")
    return plan


def _spec_back(spec: list[Any]) -> tuple[Any, ...]:
    return tuple(tuple(e) if isinstance(e, list) else e for e in spec)


def test_jax_specs_are_the_plans_dims_mappings(tiny_plan: Any, tmp_path: Path) -> None:
    path = tmp_path / "plan.jax.json"
    doc = export_plan(tiny_plan, "jax", str(path))
    assert json.loads(path.read_text()) == doc
    assert doc["format"] == DOC_FORMATS["jax"]
    assert doc["mesh"] == {"dim_names": ["dp", "tp"], "shape": [2, 2], "process_ids": [0, 1, 2, 3]}
    params = parameters(tiny_plan.program)
    assert sorted(doc["params"]) == sorted(params)
    sharded = 0
    for name, spec in {**doc["params"], **doc["inputs"]}.items():
        attr = tiny_plan.attrs[name]
        assert from_partition_spec(tiny_plan.mesh, _spec_back(spec), len(attr.dims_mapping)) == attr, name
        assert doc["shapes"][name] == list(tiny_plan.program.tensors[name].shape)
        sharded += any(e is not None for e in spec)
    assert sharded >= 8  # megatron shards the q/k/v/o and MLP weights and the vocab tables
    assert doc["params"]["layers.0.wq"] == [None, "tp"]  # the preset's [in, out] column weight
    assert doc["inputs"] and all(spec[0] == "dp" for spec in doc["inputs"].values())  # the batch over dp


def test_paddle_placements_are_the_plans(tiny_plan: Any, tmp_path: Path) -> None:
    doc = export_plan(tiny_plan, "paddle", str(tmp_path / "p.json"))
    assert doc["format"] == DOC_FORMATS["paddle"]
    assert sorted(doc["placements"]) == sorted(parameters(tiny_plan.program))
    for name, pls in doc["placements"].items():
        assert len(pls) == 2
        assert pls == [repr(p) if "Shard" in repr(p) else "Replicate()" for p in to_placements(tiny_plan.attrs[name])]
    assert doc["placements"]["layers.0.wo"] == ["Replicate()", "Shard(0)"]
    assert doc["placements"]["layers.0.attn_norm"] == ["Replicate()", "Replicate()"]


def test_paddle_refuses_a_co_shard(tiny_plan: Any) -> None:
    attrs = dict(tiny_plan.attrs)
    attrs["layers.0.wq"] = TensorDistAttr(tiny_plan.mesh, [(0, 1), -1])
    bad = dataclasses.replace(tiny_plan, attrs=attrs)
    with pytest.raises(ExportError, match=r"paddle: layers\.0\.wq: axis 0 is co-sharded over mesh dims \[0, 1\]"):
        paddle_document(bad)
    assert jax_document(bad)["params"]["layers.0.wq"] == [["dp", "tp"], None]


def test_dtensor_refuses_a_presets_in_out_weights(tiny_plan: Any) -> None:
    with pytest.raises(ExportError, match=r"dtensor: embed: .*no torch parallel style"):
        dtensor_document(tiny_plan)


def test_errors_name_what_is_wrong(tiny_plan: Any, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match=r"'yaml': unknown format \(one of dtensor, jax, paddle, torch\)"):
        export_plan(tiny_plan, "yaml", str(tmp_path / "x"))
    with pytest.raises(ExportError, match="does not exist"):
        export_plan(tiny_plan, "jax", str(tmp_path / "no" / "x.json"))
    with pytest.raises(ExportError, match="is a folder"):
        export_plan(tiny_plan, "jax", str(tmp_path))
    empty = Program([Tensor("x", (4, 4), "float32", "input"), Tensor("y", (4, 4), "float32")], [])
    no_params = dataclasses.replace(tiny_plan, program=empty, attrs={})
    for fmt in ("dtensor", "jax", "paddle"):
        with pytest.raises(ExportError, match=f"--export {fmt}: the plan's program has no parameters"):
            export_plan(no_params, fmt, str(tmp_path / "e.json"))
    assert not (tmp_path / "e.json").exists()
    (tmp_path / "j.json").write_text("{}")
    with pytest.raises(ExportError, match="format is None, expected 'spmdkit-jax-export'"):
        read_document(str(tmp_path / "j.json"), "jax")


def test_write_is_atomic(tiny_plan: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import spmdkit.outputs.export_common as export  # (where the atomic writing lives)

    path = tmp_path / "plan.json"
    path.write_text("old")
    export_plan(tiny_plan, "paddle", str(path))
    assert json.loads(path.read_text())["format"] == DOC_FORMATS["paddle"]
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary file left
    path.write_text("old")

    def fail(src: str, dst: str) -> None:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(export.os, "replace", fail)
    with pytest.raises(ExportError, match=r"--export jax: cannot write .*plan\.json.*: Invalid cross-device link"):
        export_plan(tiny_plan, "jax", str(path))
    assert path.read_text() == "old"  # the old file whole, the temporary one removed
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
    monkeypatch.undo()
    with pytest.raises(ExportError, match="cannot write"):
        export_plan(tiny_plan, "jax", str(tmp_path / ("x" * 300)))  # a name too long for the file system


def test_cli_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from spmdkit.cli import main

    path = tmp_path / "plan.jax.json"
    assert main(["plan", "--model", "tiny-llama", "--mesh", "dp=2,tp=2", "--json", "--export", "jax", str(path)]) == 0
    doc = json.loads(path.read_text())
    _, plan, _ = plan_model("tiny-llama", "dp=2,tp=2", "megatron")
    assert doc == jax_document(plan)
    capsys.readouterr()
    assert main(["plan", "--model", "tiny-llama", "--export", "onnx", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["spmdkit plan: ExportError: --export 'onnx': unknown format (one of dtensor, jax, paddle, torch)"]
    assert main(["plan", "--model", "tiny-llama", "--export", "dtensor", str(tmp_path / "d.json")]) == 2
    err = capsys.readouterr().err  # (the line says where dtensor applies and what a preset exports to)
    assert "embed: a sharded 2-D parameter not named <module>.weight" in err
    assert err.strip().endswith("export an --hf model's plan this way; a preset's tensor-parallel weights (the zoo's "
                                "[in, out] tensors, no torch module) export to jax or paddle")
    assert not (tmp_path / "d.json").exists()


# -- dtensor on the imported HF Llama -------------------------------------------------------------

LLAMA = {"num_key_value_heads": 2, "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
         "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64}


def _counter() -> Any:
    """A CommDebugMode whose module tracker survives a module object called more than once in one
    forward (transformers' kernelized ``apply_rotary_pos_emb``, one ``Func`` module shared by the
    layers: torch's tracker pops its parent once per call and runs out); the counts are torch's.
    The one the export's gloo ranks use (tests/torch_export_ranks.py)."""
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        import torch_export_ranks
    finally:
        sys.path.pop(0)
    return torch_export_ranks._counter()


def _kinds(cm: Any) -> Counter[str]:
    """The collectives counted, by kind (``all_reduce``)."""
    return Counter({str(k).rsplit(".", 1)[-1]: v for k, v in cm.get_comm_counts().items()})


def _import_llama(tied: bool) -> Any:
    pytest.importorskip("torch", reason="torch is not installed (pip install 'spmdkit[torch]')")
    pytest.importorskip("transformers", reason="transformers is not installed (pip install 'spmdkit[hf]')")
    from spmdkit.models.hf import import_hf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return import_hf("LlamaForCausalLM", {**LLAMA, "tie_word_embeddings": tied}, batch=2, seq=16, seed=0)


@pytest.fixture(scope="module")
def llama() -> Any:
    """(program, model, inputs) of the imported HF Llama, seeded."""
    return _import_llama(False)


@pytest.fixture(scope="module")
def llama_tied() -> Any:
    """The same with its embedding and LM head tied (``tie_word_embeddings``)."""
    return _import_llama(True)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_dtensor_refuses_sequence_parallel(llama: Any) -> None:
    from spmdkit.planner.planning import plan_program

    _, plan = plan_program(llama[0], "tp=2", "megatron,sp")
    with pytest.raises(ExportError, match=r"dtensor: model\.embed_tokens: .*Shard\(1\) over tp \(sequence parallel\)"):
        dtensor_document(plan)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_dtensor_of_a_program_json_notes_what_it_cannot_derive(llama: Any, llama_tied: Any) -> None:
    from spmdkit.planner.planning import plan_program
    from spmdkit.program.ir import program_from_json

    prog = program_from_json(json.loads(json.dumps(llama[0].to_json())))  # no module paths, no aliases
    _, plan = plan_program(prog, "tp=2", "megatron")
    doc = dtensor_document(plan)
    styles = Counter(s["style"] for s in doc["parallelize_plan"].values())
    assert styles == Counter(ColwiseParallel=2 * 5 + 1, RowwiseParallel=2 * 2 + 1)  # no PrepareModuleOutput
    assert any("records no module paths" in n for n in doc["notes"])
    tied = program_from_json(json.loads(json.dumps(llama_tied[0].to_json())))
    _, plan = plan_program(tied, "tp=2", "megatron")
    with pytest.raises(ExportError, match=r"model\.embed_tokens\.weight: read by 2 layers \(embedding, matmul\)"):
        dtensor_document(plan)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_dtensor_refuses_kv_heads_replicated_beside_sharded_queries(llama: Any) -> None:
    from spmdkit.planner.planning import plan_program

    _, plan = plan_program(llama[0], "tp=4", "megatron")  # 2 kv heads, tp=4: k / v replicated by the plan
    assert plan.attrs["model.layers.0.self_attn.k_proj.weight"].dims_mapping == (-1, -1)
    with pytest.raises(ExportError, match=r"dtensor: model\.layers\.0\.self_attn\.k_proj\.weight: replicated over tp "
                                          r"while model\.layers\.0\.self_attn\.q_proj"):
        dtensor_document(plan)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_dtensor_plan_on_hf_llama_matches_the_plans_collectives(llama: Any, tied: bool, tmp_path: Path,
                                                                request: pytest.FixtureRequest) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from spmdkit.outputs.dtensor import placements as torch_placements
    from spmdkit.outputs.export import apply_dtensor_plan, load_dtensor_placements, load_dtensor_plan
    from spmdkit.planner.planning import plan_program

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    torch.manual_seed(0)
    imported, model, kw = request.getfixturevalue("llama_tied") if tied else llama
    prog, plan = plan_program(imported, "dp=2,tp=2", "megatron")
    path = tmp_path / "plan.dtensor.json"
    doc = export_plan(plan, "dtensor", str(path))
    names = plan.mesh.dim_names

    def planned(phase: str) -> Counter[str]:
        return Counter(s.kind for _r, s in plan.collectives(phase) if any(names[d] == "tp" for d in s.mesh_dims))

    assert planned("forward") == Counter(all_reduce=5) and planned("backward") == Counter(all_reduce=5)
    styles = Counter(s["style"] for s in doc["parallelize_plan"].values())
    # q/k/v/gate/up + lm_head column; o/down + the embedding row; the two norms per layer share their output
    assert styles == Counter(ColwiseParallel=2 * 5 + 1, RowwiseParallel=2 * 2 + 1, PrepareModuleOutput=2 * 2)
    assert doc["parallelize_plan"]["lm_head"]["use_local_output"] is False and doc["loss_parallel"] is True
    assert doc["tp_dim"] == "tp"
    assert doc["tied"] == ({"lm_head.weight": "model.embed_tokens.weight"} if tied else {})
    for p in parameters(prog):
        assert load_dtensor_placements(str(path))[p] == torch_placements(plan.attrs[p]), p

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.mesh.size)
    try:
        mesh = init_device_mesh("cpu", tuple(plan.mesh.shape), mesh_dim_names=tuple(names))
        if tied:  # parallelize_module unties: apply_dtensor_plan ties again
            apply_dtensor_plan(model, mesh, str(path))
            assert model.lm_head.weight is model.model.embed_tokens.weight
        else:
            parallelize_module(model, mesh["tp"], load_dtensor_plan(str(path)))  # the documented one-liner
        tp = names.index("tp")
        for pname, param in model.named_parameters():
            want = torch_placements(plan.attrs[pname])[tp]
            got = param.placements[0] if isinstance(param, DTensor) else None
            assert (got if got is not None else type(want)()) == want, pname
        sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
        assert len(sharded) == 2 * 7 + 2 - tied  # every linear layer and both vocab tables (one when tied)
        inputs = {k: v for k, v in kw.items() if k != "labels"}
        with _counter() as comm, loss_parallel():
            logits = model(**inputs).logits
            assert isinstance(logits, DTensor) and logits.placements[0].is_shard(2)  # vocab-sharded, never gathered
            vocab = logits.shape[-1]
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), kw["labels"][:, 1:].reshape(-1),
                                   ignore_index=-100)
            loss.backward()
        assert set(_kinds(comm)) == {"all_reduce"}
        # where: the modules whose forward / backward runs a collective in torch are the plan's
        produced = {n: i for i, op in enumerate(prog.ops) for n in op.output_names()}

        def made_in(name: str) -> str:
            return str(prog.modules[produced[name]][0])

        def boundary(grad: str) -> str:
            """Where torch reduces the gradient of a column layers' input: at the module that made
            it when that module's output is a shared DTensor, else at the one column layer reading it."""
            base = grad.split(".grad")[0]
            if doc["parallelize_plan"].get(made_in(base), {}).get("style") == "PrepareModuleOutput":
                return made_in(base)
            readers = sorted({prog.modules[i][0] for i, op in enumerate(prog.ops) if op.phase == "forward"
                              and base in op.input_names() and prog.modules.get(i, ("",))[0] in doc["parallelize_plan"]})
            assert len(readers) == 1, f"{grad}: the plan reduces it once, torch once per reader {readers}"
            return str(readers[0])

        root = type(model).__name__
        for phase, site in (("forward", made_in), ("backward", boundary)):
            want = Counter(site(r.tensor) for r, s in plan.collectives(phase) if tp in s.mesh_dims)
            got = Counter({k.removeprefix(root + "."): sum(v[phase].values()) for k, v in comm.comm_module_counts.items()
                           if k.removeprefix(root + ".") in doc["parallelize_plan"] and sum(v[phase].values())})
            assert got == want, phase
            assert sum(comm.comm_module_counts[root][phase].values()) == sum(planned(phase).values()) == 5
        # forward, outside the model: the loss's own reductions (max, sum of exponentials, the label's
        # logit), inside spmdkit's c_softmax_with_cross_entropy rule, not among the plan's reshards
        fwd_global = sum(comm.comm_module_counts["Global"]["forward"].values())
        assert fwd_global - sum(comm.comm_module_counts[root]["forward"].values()) == 3
        assert [op.rule for op in prog.ops if op.rule.startswith("c_softmax")] == [
            "c_softmax_with_cross_entropy", "c_softmax_with_cross_entropy_grad"]
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_dtensor_qwen3_head_norms_get_their_gradient_reduced_over_tp(tmp_path: Path) -> None:
    """Qwen3's q_norm / k_norm run on the heads the column-parallel q_proj / k_proj make; the plan
    all-reduces their weights' gradients over tp. The export gives them SequenceParallel(sequence_dim=2,
    use_local_output=True): on a fake 2-rank tp group their weight is a replicated DTensor and its
    gradient a Partial one (DTensor's pending sum over tp). Before, they had no style: a plain weight
    whose gradient each rank kept from its own heads, the plan's all-reduce silently dropped."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel, loss_parallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from spmdkit.models.hf import import_hf
    from spmdkit.outputs.export import load_dtensor_plan
    from spmdkit.planner.planning import plan_program

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    imported, model, kw = import_hf("Qwen3ForCausalLM", {**LLAMA, "head_dim": 16}, batch=2, seq=16, seed=0)
    _, plan = plan_program(imported, "tp=2", "megatron")
    path = tmp_path / "plan.dtensor.json"
    doc = export_plan(plan, "dtensor", str(path))
    for layer in range(LLAMA["num_hidden_layers"]):
        for norm in ("q_norm", "k_norm"):
            assert doc["parallelize_plan"][f"model.layers.{layer}.self_attn.{norm}"] == {
                "style": "SequenceParallel", "sequence_dim": 2, "use_local_output": True}
    styles = load_dtensor_plan(str(path))
    assert isinstance(styles["model.layers.0.self_attn.q_norm"], SequenceParallel)
    assert styles["model.layers.0.self_attn.q_norm"].sequence_sharding == (Shard(2),)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        parallelize_module(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), styles)
        with loss_parallel():
            logits = model(**{k: v for k, v in kw.items() if k != "labels"}).logits
            vocab = logits.shape[-1]
            F.cross_entropy(logits[:, :-1].reshape(-1, vocab), kw["labels"][:, 1:].reshape(-1),
                            ignore_index=-100).backward()
        weight = model.model.layers[0].self_attn.q_norm.weight
        assert isinstance(weight, DTensor) and weight.placements == (Replicate(),)
        assert isinstance(weight.grad, DTensor) and weight.grad.placements == (Partial(),)
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
def test_cli_export_dtensor_of_an_hf_model(llama: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from spmdkit.cli import main
    from spmdkit.planner.planning import plan_program

    path = tmp_path / "plan.dtensor.json"
    assert main(["plan", "--hf", "LlamaForCausalLM", "--hf-config", json.dumps(LLAMA), "--mesh", "dp=2,tp=2",
                 "--export", "dtensor", str(path)]) == 0
    assert "tp" in capsys.readouterr().out  # the report still printed
    _, plan = plan_program(llama[0], "dp=2,tp=2", "megatron")
    assert json.loads(path.read_text()) == dtensor_document(plan)
