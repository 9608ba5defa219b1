"""Export a plan's parameter shardings for torch DTensor, JAX and Paddle (``spmdkit plan --export``).

``export_plan(plan, fmt, path)`` writes one JSON document (atomically: a temporary file in the
same folder, renamed over ``path``) with the plan's mesh (dim names, shape, process ids) and,
per parameter, its shape and its sharding in the framework's terms. The names are the plan's
(for an ``--hf`` import, the module's state-dict names), the shapes are the plan's (torch's
``[out, in]`` for a ``Linear`` weight). ``fmt``:

- ``dtensor``: the DTensor placements of every parameter, one per mesh dim (``Shard(d)``,
  ``Replicate()``), and a ``torch.distributed.tensor.parallel.parallelize_module`` plan over the
  tensor-parallel mesh dim, derived from those placements and from how the program reads each
  weight: a ``Linear`` weight (``[out, in]``, read by ``matmul`` with ``trans_y``) sharded on its
  output features is ``ColwiseParallel``, on its input features ``RowwiseParallel``; an
  ``Embedding`` table sharded on its rows (vocab-parallel) is ``RowwiseParallel``, on its columns
  ``ColwiseParallel``. Input and output layouts are the plan's: a row layer's output goes to the
  layout the plan reduces it to (all-reduced: ``Replicate()``); a column layer whose output feeds the vocab-parallel loss keeps it a DTensor
  (``use_local_output=False``: compute the loss under ``loss_parallel()``, the document says
  ``"loss_parallel": true``). Where two or more column layers read one tensor that a module makes
  (the q / k / v projections reading the attention norm's output), that module gets
  ``PrepareModuleOutput`` to a replicated DTensor, so the layers share it and its gradient is
  summed before one all-reduce, as the plan has it (instead of one all-reduce per layer).
  A tied parameter gets the style of each module reading it and is listed in ``tied``
  (:func:`apply_dtensor_plan` ties it again after ``parallelize_module``).
  An expert-parallel plan's experts get no style (torch has none for experts): the document's
  ``expert_parallel`` names the experts modules and says what torch can and cannot express
  (:mod:`spmdkit.outputs.dtensor_ep`), with a note.
  A MoE router (or Qwen2-MoE's ``shared_expert_gate``) read whole beside the shared experts'
  column layers: the shared experts module gets ``PrepareModuleInput`` to a replicated DTensor.
  Refused: ``[in, out]`` weights (GPT-2's Conv1D, the presets'), a
  weight left replicated beside column layers of the same input (kv heads fewer than tp), a
  whole tensor broadcast onto tp-sharded heads (DeepSeek's MLA key: ``--export torch`` writes a
  style for it), and
  sequence-parallel plans (docs/export.md says why). Load with
  :func:`apply_dtensor_plan` (``apply_dtensor_plan(model, mesh, path)``) or
  :func:`load_dtensor_plan` (``parallelize_module(model, mesh["tp"], load_dtensor_plan(path))``),
  and :func:`load_dtensor_placements`.
- ``jax``: a ``PartitionSpec`` (mesh axis names, ``None`` for a replicated axis, a tuple for a
  co-sharded one) per parameter and per data input; :func:`load_jax_specs`.
- ``paddle``: ``paddle.distributed.shard_tensor`` placements (``Shard(d)`` / ``Replicate()``,
  ``Partial()`` for a partial one) per parameter on a ``ProcessMesh`` with the plan's dim
  names; :func:`load_paddle_placements`.

Errors (an unknown format, a path that cannot be written, a plan without parameters, a
sharding the framework cannot express) are :class:`ExportError` naming the format, the tensor
and what is wrong. Standard library only; the loaders import their framework when called.
The ``dtensor`` plan's derivation is :mod:`spmdkit.outputs.export_dtensor`; the formats, the error
and the writing every export shares, :mod:`spmdkit.outputs.export_common`.
"""
from __future__ import annotations

from typing import Any

from spmdkit.core.dist_attr import entry_dims
from spmdkit.core.errors import SpmdError
from spmdkit.core.placements import to_partition_spec
from spmdkit.io.jsonfile import read_json
from spmdkit.outputs.export_common import (
    ALL_FORMATS,
    DOC_FORMATS,
    FORMATS,
    VERSION,
    ExportError,
    _mesh_doc,
    _parameters,
    _placements,
    check_target,
    write_atomic_text,
    write_json,
)
from spmdkit.outputs.export_dtensor import context_parallel_doc, dtensor_document
from spmdkit.program.plan import Plan
from spmdkit.strategies.hf_program import data_inputs

# -- jax / paddle --------------------------------------------------------------------------------


def jax_document(plan: Plan) -> dict[str, Any]:
    """The ``jax`` export: a PartitionSpec (a list of axis names / None / lists) per parameter and
    data input."""
    fmt = "jax"
    params = _parameters(plan, fmt)
    prog = plan.program

    def spec(n: str) -> list[Any]:
        try:
            return [list(e) if isinstance(e, tuple) else e for e in to_partition_spec(plan.attrs[n])]
        except SpmdError as exc:
            raise ExportError(f"--export jax: {n}: {exc}") from None

    inputs = [n for n in data_inputs(prog) if n in plan.attrs]
    return {"format": DOC_FORMATS[fmt], "version": VERSION, "mesh": _mesh_doc(plan),
            "params": {p: spec(p) for p in params}, "inputs": {n: spec(n) for n in inputs},
            "shapes": {n: list(prog.tensors[n].shape) for n in params + inputs}}


def paddle_document(plan: Plan) -> dict[str, Any]:
    """The ``paddle`` export: ``shard_tensor`` placements per parameter, one per mesh dim."""
    fmt = "paddle"
    params = _parameters(plan, fmt)
    prog = plan.program
    out: dict[str, list[str]] = {}
    for p in params:
        attr = plan.attrs[p]
        for axis, e in enumerate(attr.dims_mapping):
            if len(entry_dims(e)) > 1:
                raise ExportError(f"--export paddle: {p}: axis {axis} is co-sharded over mesh dims "
                                  f"{list(entry_dims(e))}; a Paddle placement list shards an axis over one mesh dim")
        out[p] = _placements(attr, fmt, p)
    return {"format": DOC_FORMATS[fmt], "version": VERSION, "mesh": _mesh_doc(plan), "placements": out,
            "shapes": {p: list(prog.tensors[p].shape) for p in params}}


_DOCUMENTS = {"dtensor": dtensor_document, "jax": jax_document, "paddle": paddle_document}


def export_document(plan: Plan, fmt: str) -> dict[str, Any]:
    """The export of ``plan`` in ``fmt`` (one of :data:`FORMATS`) as a JSON-able dict."""
    if fmt not in _DOCUMENTS:
        raise ExportError(f"--export {str(fmt)[:40]!r}: unknown format (one of {', '.join(ALL_FORMATS)})")
    doc = _DOCUMENTS[fmt](plan)
    padding = plan.program.vocab_padding
    if padding is not None:  # --make-vocab-size-divisible-by: the shapes are the padded model's
        doc["vocab_padding"] = dict(zip(("vocab_size", "padded_vocab_size", "make_vocab_size_divisible_by", "tp"),
                                        padding))
    return doc


def export_plan(plan: Plan, fmt: str, path: str) -> dict[str, Any]:
    """Write the ``fmt`` export of ``plan`` to ``path`` (atomically) and return it."""
    doc = export_document(plan, fmt)
    write_json(doc, path, f"--export {fmt}")
    return doc


# -- loaders (need the framework) ----------------------------------------------------------------


def read_document(path: str, fmt: str) -> dict[str, Any]:
    """An export document of ``fmt`` read back; ExportError when it is not one."""
    doc = read_json(path, f"{fmt} export", ExportError)
    if not isinstance(doc, dict) or doc.get("format") != DOC_FORMATS.get(fmt):
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ExportError(f"{fmt} export {path!r}: format is {got!r}, expected {DOC_FORMATS.get(fmt)!r}")
    return doc


def _parse_placement(text: str, mod: Any, partial: Any) -> Any:
    t = text.strip()
    if t == "Replicate()":
        return mod.Replicate()
    if t.startswith("Shard(") and t.endswith(")"):
        return mod.Shard(int(t[6:-1]))
    if t.startswith("Partial(") and t.endswith(")"):
        return partial(t[8:-1].strip("'\""))
    raise ExportError(f"export: placement {t!r} is not Shard(d), Replicate() or Partial(op)")


def load_dtensor_plan(path: str) -> dict[str, Any]:
    """The ``parallelize_module`` plan of a ``dtensor`` export: module path -> ParallelStyle.
    Apply with ``parallelize_module(model, mesh[doc_tp_dim], load_dtensor_plan(path))`` (the
    tp sub-mesh of the plan's mesh); run the loss under ``loss_parallel()`` when the document
    says ``"loss_parallel": true``."""
    import torch.distributed.tensor as dt
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    doc = read_document(path, "dtensor")

    def pl(v: Any) -> Any:
        return _parse_placement(v, dt, dt.Partial) if isinstance(v, str) else v

    classes = {"ColwiseParallel": ColwiseParallel, "RowwiseParallel": RowwiseParallel,
               "PrepareModuleInput": PrepareModuleInput,
               "PrepareModuleOutput": PrepareModuleOutput, "SequenceParallel": SequenceParallel}
    out: dict[str, Any] = {}
    for mod, spec in doc.get("parallelize_plan", {}).items():
        kw = {k: pl(v) for k, v in spec.items() if k != "style"}
        cls = classes.get(spec.get("style"))
        if cls is None:
            raise ExportError(f"dtensor export {path!r}: {mod}: unknown style {spec.get('style')!r}")
        out[mod] = cls(**kw)
    return out


def apply_dtensor_plan(model: Any, mesh: Any, path: str) -> Any:
    """``parallelize_module`` of ``model`` on ``mesh``'s tp dim (or ``mesh`` itself when it is
    1-D) with a ``dtensor`` export, then its tied parameters tied again (``parallelize_module``
    gives each module its own): ``model`` returned."""
    from torch.distributed.tensor.parallel import parallelize_module

    doc = read_document(path, "dtensor")
    tp = doc.get("tp_dim")
    if tp is None:
        return model
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    sub = mesh[tp] if mesh.ndim > 1 or (names and names != (tp,)) else mesh
    parallelize_module(model, sub, load_dtensor_plan(path))

    def owner(name: str) -> tuple[Any, str]:
        *path_, leaf = name.split(".")
        m = model
        for part in path_:
            m = getattr(m, part)
        return m, leaf

    for alias, canon in doc.get("tied", {}).items():
        o, leaf = owner(alias)
        c, cleaf = owner(canon)
        setattr(o, leaf, getattr(c, cleaf))
    return model


def load_dtensor_placements(path: str) -> dict[str, tuple[Any, ...]]:
    """Parameter name -> its DTensor placements (one per mesh dim of the plan's mesh)."""
    import torch.distributed.tensor as dt

    doc = read_document(path, "dtensor")
    return {p: tuple(_parse_placement(v, dt, dt.Partial) for v in pls) for p, pls in doc["placements"].items()}


def load_jax_specs(path: str) -> dict[str, dict[str, Any]]:
    """``{"params": {name: PartitionSpec}, "inputs": {name: PartitionSpec}}`` of a ``jax``
    export; make the mesh with ``jax.make_mesh(tuple(doc["mesh"]["shape"]),
    tuple(doc["mesh"]["dim_names"]))`` (or :func:`jax_mesh`)."""
    from jax.sharding import PartitionSpec

    doc = read_document(path, "jax")

    def ps(spec: list[Any]) -> Any:
        return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in spec))

    return {k: {n: ps(s) for n, s in doc[k].items()} for k in ("params", "inputs")}


def jax_mesh(path: str, devices: Any = None) -> Any:
    """The ``jax.sharding.Mesh`` of a ``jax`` export (over ``jax.devices()`` by default)."""
    import jax
    import numpy as np

    doc = read_document(path, "jax")
    shape, names = tuple(doc["mesh"]["shape"]), tuple(doc["mesh"]["dim_names"])
    devs = list(jax.devices() if devices is None else devices)
    n = 1
    for s in shape:
        n *= s
    if len(devs) < n:
        raise ExportError(f"jax export {path!r}: the mesh {dict(zip(names, shape))} needs {n} devices, "
                          f"{len(devs)} given")
    return jax.sharding.Mesh(np.array(devs[:n]).reshape(shape), names)


def load_paddle_placements(path: str) -> tuple[Any, dict[str, list[Any]]]:
    """(``paddle.distributed.ProcessMesh``, parameter name -> placements) of a ``paddle``
    export; shard a tensor with ``dist.shard_tensor(t, mesh, placements[name])``."""
    import paddle.distributed as dist

    doc = read_document(path, "paddle")
    m = doc["mesh"]
    ids = list(m["process_ids"])

    def nest(flat: list[int], shape: list[int]) -> Any:
        if len(shape) == 1:
            return flat
        step = len(flat) // shape[0]
        return [nest(flat[i * step:(i + 1) * step], shape[1:]) for i in range(shape[0])]

    mesh = dist.ProcessMesh(nest(ids, list(m["shape"])), dim_names=list(m["dim_names"]))

    def partial(op: str) -> Any:
        kinds = {"sum": dist.ReduceType.kRedSum, "avg": dist.ReduceType.kRedAvg, "max": dist.ReduceType.kRedMax,
                 "min": dist.ReduceType.kRedMin, "prod": dist.ReduceType.kRedProd}
        if op not in kinds:
            raise ExportError(f"paddle export {path!r}: Partial({op}) has no Paddle reduce type")
        return dist.Partial(kinds[op])

    return mesh, {p: [_parse_placement(v, dist, partial) for v in pls] for p, pls in doc["placements"].items()}


__all__ = ["ALL_FORMATS", "DOC_FORMATS", "FORMATS", "ExportError", "check_target", "context_parallel_doc", "dtensor_document", "export_document", "export_plan",
           "apply_dtensor_plan", "jax_document", "jax_mesh", "load_dtensor_placements", "load_dtensor_plan", "load_jax_specs",
           "load_paddle_placements", "paddle_document", "read_document", "write_atomic_text", "write_json"]
