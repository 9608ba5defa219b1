"""Export a plan as a Python module that applies it with torch's own parallel APIs
(``spmdkit plan ... --export torch FILE``, docs/export.md).

The file is plain Python a person reads: the mesh (``MESH_DIMS``, ``MESH_SHAPE``), each module's
tensor-parallel style (``TP_PLAN``: ``ColwiseParallel`` / ``RowwiseParallel`` /
``SequenceParallel`` / ``PrepareModuleOutput`` with the plan's input and output layouts, module
paths with ``*`` for the layer number where every layer has the same style), the data-parallel
wrapping (``fully_shard`` per layer and at the root for ZeRO-3, with
``reshard_after_forward=False`` for ZeRO-1/2, FSDP2's ``replicate`` for plain dp), whether the loss
runs under ``loss_parallel()`` (``LOSS_PARALLEL``), the pipeline (``PIPELINE`` and
``pipeline_stage``), and the collectives the plan issues per step in the terms ``CommDebugMode``
counts (``PLAN_COLLECTIVES``), and what the plan priced beyond its shardings (``RECOMPUTE``,
``RECOMPUTE_LAYERS``, ``PRECISION``, ``GRAD_ACCUM``: whole-layer recomputation applied with torch's
``checkpoint_wrapper`` as torchtitan's full AC, the rest warned of; :mod:`spmdkit.outputs.export_torch_run`).
``parallelize(model, mesh)`` applies it all and returns the model. The file's text (header, constants,
the helper functions it defines, ``parallelize``) is written by :mod:`spmdkit.outputs.export_torch_text`.

The styles come from the plan, as the ``dtensor`` export derives them
(:class:`spmdkit.outputs.export_dtensor._DTensorExport`), with what that export refuses resolved:

- sequence parallel: a norm whose input the plan holds ``Shard(1)`` over tp is
  ``SequenceParallel``; a row layer (or the vocab-parallel embedding) whose partial output the
  plan reduce-scatters to ``Shard(1)`` is ``RowwiseParallel(output_layouts=Shard(1))`` and keeps
  its output a DTensor (``use_local_output=False``), so the residual stream is a sequence-sharded
  DTensor of the global shape (HF's mask and positions read its sequence length); the column
  layers reading a norm's output get it all-gathered once (``PrepareModuleOutput`` from
  ``Shard(1)`` to ``Replicate()`` after ``SequenceParallel``), the LM head alone all-gathers its
  own input (``ColwiseParallel(input_layouts=Shard(1))``);
- GPT-2's ``Conv1D`` (``x @ W`` with ``W [in, out]``): torch's styles shard ``nn.Linear`` only, so
  ``parallelize`` first swaps each such module the plan shards for the ``nn.Linear`` it equals
  (``CONV1D_AS_LINEAR``; the weight transposed, the same names), then styles it;
- GPT-2's fused ``c_attn`` (q | k | v in one weight), which the plan splits into parts and shards
  each by heads: ``parallelize`` reorders its output features so each rank's contiguous block
  (what ``ColwiseParallel`` gives it) is its heads' [q | k | v], its bias with them, and divides
  the attention's ``split_size`` / ``num_heads`` by tp (``FUSED_QKV``, ``fused_order``);
- a MoE block's shared experts beside its replicated router (DeepSeek-V3, Qwen2-MoE): the shared
  experts module ``PrepareModuleInput`` to a replicated DTensor (:meth:`_DTensorExport.beside_columns_module`);
  DeepSeek's MLA key, whole over tp and expanded onto the sharded heads: the file's own
  ``GradAllReduceColumns`` on the replicated layer it is split from (:mod:`spmdkit.outputs.export_torch_mla`);
- pipelines (:mod:`spmdkit.outputs.export_torch_pp`): ``PIPELINE`` (the stages' module prefixes,
  torch's schedule, the microbatches), ``pipeline_stage`` and ``build_pipeline``
  (``torch.distributed.pipelining``).

Refused by name (:class:`ExportError`, one line): a fused weight whose parts are not all sharded on
their output features, a row layer with no column layer beside it, expert stacks over ep (or over
tp other than the experts style's way), a MoE block with shared experts under sequence parallel, context parallelism (torch's ``context_parallel`` has no
Ulysses and no eager attention, and what it has runs only in CUDA's SDPA kernels, not on the CPU /
gloo where an export is checked: ``CP_ON_CPU``), a preset (no HF module), and a pipeline with tied
parameters, sequence parallel or the interleaved schedule (docs/export.md).
"""

from __future__ import annotations

import re
from typing import Any

from spmdkit.core.placements import Shard
from spmdkit.outputs.export_common import ExportError, _placement_text, check_target, write_atomic_text
from spmdkit.outputs.export_dtensor import _DTensorExport, _reduced_to, _style_doc, _tp_placement, context_parallel_doc
from spmdkit.outputs.export_torch_mla import STYLE as MLA_STYLE
from spmdkit.outputs.export_torch_mla import STYLE_SOURCE as MLA_SOURCE
from spmdkit.outputs.export_torch_mla import broadcast_key_styles
from spmdkit.outputs.export_torch_moe import STYLE, STYLE_SOURCE, experts_styles
from spmdkit.outputs.export_torch_pp import (
    FUNCOL,
    PRESENT_FN,
    layers_container,
    pipeline_doc,
    pipeline_imports,
    pipeline_lines,
    stage_collectives,
)
from spmdkit.outputs.export_torch_run import (
    CHECKPOINT_IMPORT,
    checkpoint_fn,
    checkpointed_layers,
    priced_doc,
    run_constants,
)
from spmdkit.outputs.export_torch_text import (
    CONV1D_FN,
    FUSED_FN,
    GRADS_ONCE_FN,
    HEADS_FN,
    VOCAB_FN,
    file_constants,
    file_header,
    file_notes,
    parallelize_fn,
    tp_collectives,
)
from spmdkit.planner.pipeline_split import PipelineSpec
from spmdkit.program.ir import Op
from spmdkit.program.layers import layer_tags
from spmdkit.program.plan import Plan
from spmdkit.strategies.hf_program import data_inputs, weight_axes


class _TorchExport(_DTensorExport):
    """The styles of the ``torch`` export: the dtensor export's, sequence parallel and
    Conv1D included (module docstring). ``self.entries``: (module path, style doc) in the order
    they are applied; a module may have two (``SequenceParallel`` then ``PrepareModuleOutput``)."""

    fmt = "torch"

    def __init__(self, plan: Plan) -> None:
        super().__init__(plan)
        self.conv1d: set[str] = set()
        self.after: dict[str, dict[str, Any]] = {}
        self.row_inputs: dict[str, str] = {}
        #: a fused weight's module -> its parts' output features (GPT-2's c_attn: q, k, v)
        self.fused: dict[str, tuple[int, ...]] = {}
        #: the token axis sequence parallel shards on [batch, seq, hidden] (token_axis)
        self.seq_dim: int | None = self._residual_axis()
        #: row layers' biases under sequence parallel: their gradient all-reduce is the plan's only
        self.row_bias: set[str] = set()
        #: vocab-parallel lookups scaled inside their module (Gemma's embed_scale): torch all-reduces them
        self.scaled_lookups: set[str] = set()
        #: attention modules whose own head counts _heads_per_rank divides (globs over the layers)
        self.heads: tuple[str, ...] = ()

    def tensor_parallel_dim(self) -> int | None:
        """The mesh dim named ``tp`` (None without one): torch's styles run over ``mesh["tp"]``; a
        weight sharded over another dim is ZeRO-3's (dp) or refused (:meth:`check_experts`)."""
        names = self.plan.mesh.dim_names
        return names.index("tp") if "tp" in names else None

    def check_experts(self) -> None:
        """Expert stacks (3-D parameters) sharded over tp: the experts style written into the file
        (:mod:`spmdkit.outputs.export_torch_moe`), or ExportError for what it does not run."""
        self.styles.update(experts_styles(self.plan, self.tp, self.modules))

    def check_broadcast_onto_shards(self) -> None:
        """A whole tensor broadcast onto heads sharded over tp, its gradient all-reduced (MLA's rotary
        key): the replicated layer it is split from gets the file's ``GradAllReduceColumns``
        (:mod:`spmdkit.outputs.export_torch_mla`)."""
        assert self.tp is not None
        self.styles.update(broadcast_key_styles(self.plan, self.tp, self.producers, self.modules))

    def uses(self, p: str) -> list[tuple[str, str, int, Op]]:
        m = re.fullmatch(r"(.+)\.weight\.part(\d+)", p)
        if m:
            return self._fused_uses(m.group(1), int(m.group(2)), p)
        return super().uses(p)

    def _fused_uses(self, mod: str, k: int, p: str) -> list[tuple[str, str, int, Op]]:
        """A fused weight the plan splits into parts and shards each on its output features over
        tp (GPT-2's ``c_attn``: q | k | v, each column-parallel by heads): one ``ColwiseParallel``
        for the module, read from part 0's op, after the file reorders the fused output features
        so that each rank's contiguous block is its share of every part (``FUSED_QKV``)."""
        assert self.tp is not None
        tp = self.tp
        parts = sorted((n for n in self.weights if n.startswith(mod + ".weight.part")), key=lambda n: int(n.rsplit("part", 1)[1]))
        how, out_ax, _in_ax, op = weight_axes(self.prog, self.readers, p)
        if how != "linear" or op is None:
            raise ExportError(f"--export torch: {p}: a part of a fused weight not read as a linear layer's weight: "
                              f"torch has no parallel style for it")
        bad = [f"{n} {_placement_text(pl)}" for n in parts for pl in [_tp_placement(self.plan.attrs[n], tp)]
               if pl != Shard(out_ax)]
        if bad:
            raise ExportError(f"--export torch: {mod}: the plan splits its fused weight into {len(parts)} parts and does "
                              f"not shard every part on its output features over tp ({', '.join(bad)}); torch's "
                              f"ColwiseParallel shards the fused weight's output features, each rank one block")
        for b in sorted(n for n in self.params if n.startswith(mod + ".bias.part")):
            bp = _tp_placement(self.plan.attrs[b], tp)
            if bp != Shard(0):
                raise ExportError(f"--export torch: {b}: the plan places it {_placement_text(bp)} over tp, "
                                  f"ColwiseParallel Shard(0) (with its weight's part)")
        self.fused[mod] = tuple(self.prog.tensors[n].shape[out_ax] for n in parts)
        if out_ax != 0:
            self.conv1d.add(mod)
        return [(mod, how, out_ax, op)] if k == 0 else []

    def _linear_in_out(self, p: str, how: str, out_ax: int) -> None:
        if how == "linear" and out_ax != 0:
            self.conv1d.add(p[: -len(".weight")] if p.endswith(".weight") else p)

    def style(self, mod: str, how: str, op: Op, pl: Any) -> bool:
        """:meth:`_DTensorExport.style` with the output-feature axis read from the op (a
        Conv1D's is 1): a column layer shards it."""
        assert self.tp is not None
        out_ax = (0 if op.attrs.get("trans_y", False) else 1) if how == "linear" else 1
        if how == "linear" and out_ax == 1:  # as the nn.Linear it is swapped for: [out, in]
            pl = Shard(1 - pl.dim) if pl.is_shard() else pl
        return super().style(mod, how, op, pl)

    def made_as(self, x: str) -> Any:
        """The tp placement ``x`` is made in (before any reshard to its readers)."""
        assert self.tp is not None
        i = self.producers.get(x)
        if i is None:
            return _tp_placement(self.plan.attrs[x], self.tp)
        return _tp_placement(self.plan.ops[i].outputs[self.prog.ops[i].output_names().index(x)], self.tp)

    def _residual_axis(self) -> int | None:
        """The axis of ``[batch, seq, hidden]`` the plan shards the residual stream's tokens on
        over tp (sequence parallel), or None: the one token axis (0 or 1) of the 3-D forward
        activations the plan makes sharded over tp (a hidden axis sharded is a column layer's; an
        op's other outputs, such as the attention's log-sum-exp [batch, heads, seq], left out)."""
        if self.tp is None:
            return None
        found = {pl.dim for i, op in enumerate(self.prog.ops) if op.phase == "forward" and op.output_names()
                 for n, a in [(op.output_names()[0], self.plan.ops[i].outputs[0])]  # not an lse [b, heads, s]
                 if hasattr(a, "mesh") and n in self.prog.tensors and len(self.prog.tensors[n].shape) == 3
                 for pl in [_tp_placement(a, self.tp)] if pl.is_shard() and pl.dim in (0, 1)}
        if len(found) > 1:
            raise ExportError("--export torch: the plan shards the residual stream over tp on both axis 0 and 1 of "
                              "[batch, seq, hidden]; torch's sequence parallel shards one token axis")
        return found.pop() if found else None

    def input_layout(self, x: str) -> Any:
        """The tp placement a module's input ``x`` arrives in: as the plan makes it (a token layout)."""
        return self.token_layout(self.made_as(x), x)

    def token_layout(self, pl: Any, x: str) -> Any:
        """``pl`` of tensor ``x`` as a layout of the module's ``[batch, seq, hidden]`` input or
        output: a Shard(0) of GPT-2's flattened ``[batch * seq, hidden]`` tokens is a split of
        the tokens, which reshaped back is the residual stream's token axis (``seq_dim``: the
        batch rows when tp divides each dp slice's batch, else the sequence)."""
        if pl.is_shard() and pl.dim == 0 and len(self.prog.tensors[x].shape) == 2 and self.seq_dim is not None:
            return Shard(self.seq_dim)
        return pl

    flag = "--export torch"

    def _colwise(self, mod: str, op: Op, x: str, x_in: Any, x_req: Any) -> bool:
        """The column style with its input as the plan's token layout holds it (sequence parallel:
        the sequence-sharded residual, which torch's ColwiseParallel gathers)."""
        local = self._colwise_style(mod, op, x, self.token_layout(self.made_as(x), x), x_req)
        self.column_inputs.setdefault(x, []).append(mod)
        return not local

    def _rowwise(self, mod: str, how: str, op: Op, x: str, x_req: Any, colwise: bool) -> None:
        assert self.tp is not None
        out = op.output_names()[0]
        nd = len(self.prog.tensors[x].shape)
        if how == "linear" and not (x_req.is_shard() and x_req.dim == nd - 1):
            raise ExportError(f"--export torch: {mod} (RowwiseParallel): the plan reads its input {x} as "
                              f"{_placement_text(x_req)} over tp, RowwiseParallel as Shard(-1)")
        if how == "embedding" and not x_req.is_replicate():
            raise ExportError(f"--export torch: {mod} (RowwiseParallel): the plan reads the ids {x} as "
                              f"{_placement_text(x_req)} over tp (it gathers the vocab-sharded table); torch's "
                              f"vocab-parallel embedding reads them Replicate()")
        dst = self._row_target(mod, how, out, colwise)
        if dst is None:
            return
        if dst.is_shard():
            dst = self.token_layout(dst, out)
            self.token_axis(mod, "RowwiseParallel", f"reduce-scatters its output {out} to", dst.dim)
            if how == "linear" and mod + ".bias" in self.placements:
                self.row_bias.add(mod + ".bias")
            if how == "embedding" and self._scaled_inside(mod, out):
                self.scaled_lookups.add(out)
        made = self.made_as(x)
        x_in = "Replicate()" if how == "embedding" else "Shard(-1)" if made.is_shard() and made.dim == nd - 1 \
            else _placement_text(made)
        if how == "linear":
            self.row_inputs[mod] = x
        self.styles[mod] = _style_doc("RowwiseParallel", input_layouts=x_in,
                                      output_layouts=_placement_text(dst), use_local_output=not dst.is_shard())

    def _scaled_inside(self, mod: str, out: str) -> bool:
        """The lookup ``out`` is multiplied by a 0-d tensor inside its own module ``mod`` (Gemma's
        scaled embedding: ``embedding(ids) * self.embed_scale``), before RowwiseParallel's output hook."""
        prog = self.prog
        return any(prog.ops[j].rule == "multiply" and self.modules.get(j, ("", ""))[0] == mod
                   and any(v != out and v in prog.tensors and prog.tensors[v].shape == ()
                           for v in prog.ops[j].input_names())
                   for j in self.fwd_readers.get(out, []))

    def sequence_parallel_norms(self) -> None:
        """A module with a replicated 1-D parameter (a norm's weight or bias) that the plan runs
        on a sequence-sharded input over tp (``Shard(1)``): ``SequenceParallel``. Found by the
        parameter's reading ops, whatever the norm is lowered to (a fused rms_norm, or HF's
        ``weight * x * rsqrt(mean(x^2))``)."""
        assert self.tp is not None
        for p, i, op, k in self.norm_reads_on_shards():
            mod = self.modules.get(i, ("", ""))[0]
            if not mod:
                raise ExportError(f"--export torch: {p}: read on a sequence-sharded input and the program "
                                  f"records no module for it (a program JSON): export from --hf")
            if mod in self.styles:
                continue
            d = _tp_placement(self.plan.ops[i].required[k], self.tp).dim
            if self.heads_axis(op.inputs[k], d):  # Qwen3's q_norm / k_norm on the heads of a column layer
                self.styles[mod] = _style_doc("SequenceParallel", sequence_dim=d, use_local_output=True)
                self.notes.append(f"{mod}: runs on the heads a column layer makes, Shard({d}) over tp: its "
                                  f"weight a replicated DTensor, its gradient all-reduced over tp")
                continue
            self.token_axis(mod, "SequenceParallel", "shards its input on", d)
            self.styles[mod] = _style_doc("SequenceParallel", sequence_dim=d, use_local_output=False)

    def token_axis(self, mod: str, style: str, what: str, d: int) -> None:
        """Check that the plan shards the residual stream's tokens over tp on one axis of
        ``[batch, seq, hidden]``, ``seq_dim``: 1, the sequence (Llama's 3-D linears), or 0, the
        batch rows of each dp slice, where the plan shards GPT-2's flattened ``[batch * seq,
        hidden]`` Conv1D tokens in contiguous blocks. Both are token partitions (each token's
        hidden vector whole on one rank), which ``SequenceParallel(sequence_dim=d)`` and the
        styles' ``Shard(d)`` layouts express."""
        if d not in (0, 1) or d != self.seq_dim:
            raise ExportError(f"--export torch: {mod} ({style}): the plan {what} Shard({d}) over tp; torch's "
                              f"sequence parallel shards one token axis of [batch, seq, hidden] for the whole model"
                              f" (here Shard({self.seq_dim}))")

    def check_replicated_on_shards(self) -> None:
        """A linear layer replicated over tp that the plan runs on its input's token shards (sequence
        parallel: DeepSeek's MLA down projections ``q_a_proj`` / ``kv_a_proj_with_mqa`` on the norm's
        sequence shards, their smaller outputs gathered after) is refused: torch's styles give a
        module with no style the norm's sequence-sharded DTensor (``aten.mm`` then fails on a plain
        weight: mixed torch.Tensor and DTensor), and no torch style runs a replicated layer on
        sequence shards (torchtitan gathers the attention's input first)."""
        assert self.tp is not None
        prog, tp = self.prog, self.tp
        for i, op in enumerate(prog.ops):
            w, x = op.inputs.get("y"), op.inputs.get("x")
            if op.phase != "forward" or op.rule != "matmul" or not isinstance(w, str) or not isinstance(x, str) \
                    or w not in self.placements or len(prog.tensors[w].shape) != 2 \
                    or _tp_placement(self.plan.attrs[w], tp).is_shard():
                continue
            pl = self.token_layout(_tp_placement(self.plan.ops[i].required["x"], tp), x)
            if pl.is_shard() and pl.dim in (0, 1) and pl.dim == self.seq_dim:
                mod = self.modules.get(i, ("", ""))[0] or w
                raise ExportError(f"--export torch: {mod}: replicated over tp, and the plan runs it on the token shards "
                                  f"of its input {x} ({_placement_text(pl)} over tp, sequence parallel); torch's "
                                  f"styles hand a module with no style the sequence-sharded DTensor and have none "
                                  f"that runs a replicated layer on sequence shards: not exported (export it without "
                                  f"sp)")

    def check_norms_on_gathered_columns(self) -> None:
        """A norm the plan runs on a column layer's whole output, all-gathered first (OLMo2's
        ``q_norm`` / ``k_norm`` over ``num_heads * head_dim``), is refused: ColwiseParallel hands it
        its rank's features and no torch style reduces a norm's sum of squares over tp (docs/export.md)."""
        assert self.tp is not None
        prog, tp = self.prog, self.tp
        for p in self.params:
            if len(prog.tensors[p].shape) != 1 or _tp_placement(self.plan.attrs[p], tp).is_shard():
                continue
            for i, op, src in self.weight_reads(p):
                for k, v in op.inputs.items():
                    j = self.producers.get(v) if isinstance(v, str) and v != src else None
                    if j is None or prog.ops[j].rule != "matmul" or op.phase != "forward":
                        continue
                    nd, made = len(prog.tensors[v].shape), self.made_as(v)
                    if not (made.is_shard() and made.dim == nd - 1) \
                            or not _tp_placement(self.plan.ops[i].required[k], tp).is_replicate():
                        continue
                    mod, col, n = " (".join(self.modules.get(i, (p, "?"))) + ")", self.modules.get(j, (v, ""))[0], prog.tensors[v].shape[-1]
                    raise ExportError(f"--export torch: {mod}: normalises the whole output {v} of the column-parallel "
                                      f"{col} ({n} features, Shard(-1) over tp), which the plan all-gathers first; "
                                      f"torch's ColwiseParallel hands it its rank's {n // self.plan.mesh.shape[tp]} and no torch style "
                                      f"runs a norm on a gathered column output or reduces its sum of squares over "
                                      f"tp: not exported (a norm over the whole projection, as OLMo2's q_norm / "
                                      f"k_norm, runs under torch without tp on its attention: --strategy fsdp)")

    def replicated_beside_tokens(self) -> None:
        """An embedding the plan keeps replicated over tp (GPT-2's position embedding ``wpe``)
        whose output is added to the token-sharded residual stream (a DTensor under sequence
        parallel): its output made a replicated DTensor (``PrepareModuleOutput``), so DTensor's
        broadcasting add takes each rank's tokens and reduces the gradient over tp in the
        backward, as the plan all-reduces it."""
        assert self.tp is not None
        prog, tp = self.prog, self.tp
        for i, op in enumerate(prog.ops):
            if op.phase != "forward" or op.rule not in ("embedding", "c_embedding"):
                continue
            mod = self.modules.get(i, ("", ""))[0]
            out = op.output_names()[0]
            if not mod or mod in self.styles:
                continue
            made = _tp_placement(self.plan.ops[i].outputs[0], tp)
            for j in self.fwd_readers.get(out, []):
                other = [k for k, v in prog.ops[j].inputs.items() if isinstance(v, str) and v != out
                         and _tp_placement(self.plan.ops[j].required[k], tp).is_shard()]
                if other and made.is_shard():
                    raise ExportError(f"--export torch: {mod}: the plan looks up its {out} already sharded over tp "
                                      f"({_placement_text(made)}, each rank its positions) beside the token-sharded "
                                      f"residual stream; torch would slice a replicated output and all-gather its "
                                      f"gradient where the plan all-reduces it: not exported (a batch tp divides per "
                                      f"dp rank shards the batch rows instead)")
                if not other:
                    self.check_added_whole(i, out, j)
                    continue
                self.styles[mod] = _style_doc("PrepareModuleOutput", output_layouts="Replicate()",
                                              desired_output_layouts="Replicate()", use_local_output=False)
                self.notes.append(f"{mod}: its output {out} is added to the token-sharded residual stream: a "
                                  f"replicated DTensor, its gradient all-reduced over tp")
                break

    def check_added_whole(self, i: int, out: str, j: int) -> None:
        """Op ``i``'s replicated lookup ``out`` (OPT's ``embed_positions``) added by op ``j`` whole to a
        row output the plan reduce-scatters and all-gathers back is refused: torch keeps that output a
        token-sharded DTensor beside the plain lookup (mixed Tensor and DTensor, docs/export.md)."""
        assert self.tp is not None
        mod, cls = self.modules[i]
        for v in self.prog.ops[j].input_names():
            dst = _reduced_to(self.plan, v, self.tp) if v != out and v in self.producers else None
            if dst is None or not dst.is_shard():
                continue
            row, where = self.modules.get(self.producers[v], (v, ""))[0], self.modules.get(j, ("the model", ""))[0]
            raise ExportError(f"--export torch: {mod} ({cls}): its lookup {out} is "
                              f"added in {where} to {v}, which the plan reduce-scatters over tp ({row}, "
                              f"{_placement_text(dst)}) and all-gathers again to add whole; torch keeps {v} a "
                              f"token-sharded DTensor there beside {mod}'s plain output and no style gathers it "
                              f"before that add (every rank: aten.add got mixed torch.Tensor and DTensor): not "
                              f"exported under sequence parallel (--strategy megatron, without sp, exports)")

    def check_row_inputs(self) -> None:
        """A row layer whose input no column layer beside it makes (in its parent module) is
        refused: the plan slices a replicated computation somewhere between (GPT-2's attention
        heads from a replicated ``c_attn``, their gradients all-gathered where the plan splits
        q / k / v), which torch runs whole on every rank, all-gathering at the row layer."""
        columns = [m for m, d in self.styles.items() if d["style"] == "ColwiseParallel"]
        for mod, x in self.row_inputs.items():
            parent = mod.rsplit(".", 1)[0] + "."
            if not any(c.startswith(parent) for c in columns):
                raise ExportError(f"--export torch: {mod} (RowwiseParallel): no column-parallel layer under "
                                  f"{parent[:-1]} makes its input {x}: the plan slices a replicated computation "
                                  f"before it (and all-gathers its gradients there), torch's module would run it whole "
                                  f"and all-gather at {mod.rsplit('.', 1)[-1]}; keep it whole too (--tp-plan "
                                  f"'{{\"{'.'.join(mod.split('.')[-2:])}\": \"replicate\"}}')")

    def prepare_shared_inputs(self) -> None:
        """Column layers sharing one input that a module makes: that module's output a
        replicated DTensor (all-gathered from ``Shard(1)`` under sequence parallel)."""
        self.check_row_inputs()
        self.check_replicated_on_shards()
        self.check_norms_on_gathered_columns()
        self.sequence_parallel_norms()
        self.shared_module_inputs()
        if self.seq_dim is not None:
            self.replicated_beside_tokens()
        for x, mods, path in self.module_outputs_shared_by_columns():
            src = _placement_text(self.made_as(x))
            doc = _style_doc("PrepareModuleOutput", output_layouts=src, desired_output_layouts="Replicate()",
                             use_local_output=False)
            for m in mods:  # they receive it replicated
                self.styles[m]["input_layouts"] = "Replicate()"
            if path in self.styles:
                if self.styles[path]["style"] != "SequenceParallel":
                    continue
                self.after[path] = doc
            else:
                self.styles[path] = doc
            self.notes.append(f"{path}: its output {x} is read by {', '.join(mods)}: one replicated DTensor"
                              + (" (all-gathered once)" if src != "Replicate()" else "")
                              + ", its gradient reduced once")


# -- what the file says ---------------------------------------------------------------------------


def _heads_modules(ex: _TorchExport) -> tuple[str, ...]:
    """The modules holding a ColwiseParallel q projection (not a fused one) whose k and v, where it
    has them, are ColwiseParallel too, as globs over the layers: HEADS_PER_RANK. (A k / v the plan
    replicates, kv heads fewer than tp, leaves the module out: its grouping would change.)"""
    col = {m for m, d in ex.styles.items() if d["style"] == "ColwiseParallel"}
    out: list[str] = []
    for m in sorted(col - set(ex.fused)):
        parent, _, leaf = m.rpartition(".")
        if not parent or leaf not in ("q_proj", "query", "q"):
            continue
        kv = [f"{parent}.{k}" for k in ("k_proj", "v_proj", "key", "value", "k", "v")
              if f"{parent}.{k}.weight" in ex.prog.tensors]
        if all(k in col for k in kv):
            out.append(_layer_glob(parent)[0])
    return tuple(dict.fromkeys(out))


def _layer_glob(path: str) -> tuple[str, str | None]:
    """(``a.layers.*.b``, ``"3"``) for a path with a number after its container, else (path, None)."""
    m = re.search(r"\.(\d+)(\.|$)", path)
    if m is None:
        return path, None
    return path[: m.start(1)] + "*" + path[m.end(1):], m.group(1)


def compress(styles: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Module path -> style, the paths that every layer has with the same style written once with
    ``*`` for the layer number (``parallelize_module`` matches ``*`` per path atom)."""
    by: dict[str, dict[str, dict[str, Any]]] = {}
    numbers: dict[str, set[str]] = {}
    for path, doc in styles.items():
        glob, n = _layer_glob(path)
        if n is not None:
            by.setdefault(glob, {})[n] = doc
            numbers.setdefault(glob.split("*")[0], set()).add(n)
    out: dict[str, dict[str, Any]] = {}
    for path, doc in styles.items():
        glob, n = _layer_glob(path)
        group = by.get(glob, {})
        uniform = n is not None and set(group) == numbers[glob.split("*")[0]] and \
            all(d == doc for d in group.values()) and len(group) > 1
        out[glob if uniform else path] = doc
    return out


def compress_values(by_module: dict[str, Any]) -> dict[str, Any]:
    """Module path -> value, the paths every layer has with the same value written once with ``*``."""
    globs: dict[str, list[Any]] = {}
    for path, v in by_module.items():
        globs.setdefault(_layer_glob(path)[0], []).append(v)
    out: dict[str, Any] = {}
    for path, v in sorted(by_module.items()):
        glob = _layer_glob(path)[0]
        same = len(globs[glob]) > 1 and all(x == v for x in globs[glob])
        out[glob if same else path] = v
    return out


def _py(v: Any) -> str:
    if isinstance(v, str) and (v.startswith(("Shard(", "Replicate(", "Partial("))):
        return v
    return repr(v)


def _style_py(doc: dict[str, Any]) -> str:
    kw = ", ".join(f"{k}={_py(v)}" for k, v in doc.items() if k != "style")
    return f"{doc['style']}({kw})"


def _plan_py(name: str, styles: dict[str, dict[str, Any]], comment: str) -> list[str]:
    lines = [f"#: {comment}", f"{name} = {{"]
    for path, doc in styles.items():
        lines.append(f"    {path!r}: {_style_py(doc)},")
    lines.append("}")
    return lines


def zero_level(plan: Plan) -> int:
    """The plan's ZeRO stage read from its layouts: 3 when parameters are stored sharded, 2 when a
    gradient is sharded over dp, 1 when only optimizer states are, else 0."""
    if "dp" not in plan.mesh.dim_names or plan.mesh.shape[plan.mesh.dim_index("dp")] == 1:
        return 0
    if plan.storage:
        return 3
    dp = plan.mesh.dim_index("dp")
    prog = plan.program
    opt = getattr(prog, "optimizer", None) or {}
    level = 0
    for _p, (g, states, *_rest) in opt.items():
        def on_dp(n: str) -> bool:
            a = plan.attrs.get(n)
            return a is not None and any(dp in (e if isinstance(e, tuple) else (e,)) for e in a.dims_mapping)
        if on_dp(g):
            return 2
        if any(on_dp(s) for s in states):
            level = 1
    return level


def data_parallel(plan: Plan) -> dict[str, Any] | None:
    """How the dp mesh dim is applied with FSDP2: None without a dp dim of size > 1; else the
    ZeRO stage, the wrapper (``fully_shard`` for ZeRO-1/2/3, ``replicate`` for plain dp), its
    ``reshard_after_forward`` (ZeRO-3: True; ZeRO-1/2: False, the parameters stay whole from the
    forward to the backward and the gradient is reduce-scattered: torch has no ZeRO-1, which
    all-reduces the gradient and shards only the optimizer states; the same bytes move) and the
    layers container each of whose blocks is one group (then the root)."""
    names = plan.mesh.dim_names
    batch_dims: set[str] = set()
    for n in data_inputs(plan.program):
        a = plan.attrs.get(n)
        if a is None or not a.dims_mapping:
            continue
        e = a.dims_mapping[0]
        for d in (e if isinstance(e, tuple) else (e,)):
            if d != -1:
                batch_dims.add(names[d])
    if batch_dims - {"dp"}:
        raise ExportError(f"--export torch: the plan splits the batch over {', '.join(sorted(batch_dims))}; torch's "
                          f"data parallelism (FSDP2's fully_shard / replicate) splits it over dp only")
    if "dp" not in batch_dims:  # the whole batch on every rank (an --auto plan may): nothing to synchronise
        return None
    z = zero_level(plan)
    return {"mesh_dim": "dp", "zero": z, "wrap": "fully_shard" if z else "replicate",
            "reshard_after_forward": z == 3, "layers": layers_container(plan)}


def _model_order(ex: _TorchExport, paths: dict[str, Any]) -> list[str]:
    first: dict[str, int] = {}
    for i in range(len(ex.prog.ops)):
        m = ex.modules.get(i, ("", ""))[0]
        for p in paths:
            if p not in first and (m == p or m.startswith(p + ".")):
                first[p] = i
    return sorted(paths, key=lambda p: (first.get(p, 1 << 30), p))


def _imports(ex: _TorchExport, dp: dict[str, Any] | None, used: list[str], pipe: dict[str, Any] | None,
             experts: bool, own: bool = False) -> list[str]:
    """The file's imports; ``experts``: it defines ExpertsTensorParallel; ``own``: a style of its own
    (ExpertsTensorParallel, GradAllReduceColumns)."""
    lines = ["from __future__ import annotations", ""]
    std = [*(["import copy"] if ex.fused else []),
           *(["import fnmatch"] if ex.conv1d or ex.fused or ex.heads or pipe is not None else []), *(["import types"] if experts else []),
           *(["from typing import Any"] if pipe is not None or own else [])]
    lines += [*std, ""] if std else []
    lines += ["import torch", "from torch.distributed.device_mesh import DeviceMesh"]
    if dp is not None:
        lines.append("from torch.distributed.fsdp import fully_shard" if dp["wrap"] == "fully_shard" else
                     "from torch.distributed._composable.replicate_with_fsdp import replicate")
    if pipe is not None:
        lines += pipeline_imports(pipe)
    if own:
        lines += ["from torch.distributed.tensor import DTensor, Partial, Replicate, Shard"
                  + (", distribute_module, distribute_tensor" if experts else "")]
    elif used:
        lines.append("from torch.distributed.tensor import Replicate, Shard")
    if used or own:
        lines.append(f"from torch.distributed.tensor.parallel import {', '.join([*used, 'parallelize_module'])}")
    if own:
        lines.append("from torch.distributed.tensor.parallel.style import ParallelStyle")
    return lines


#: why torch's context_parallel cannot run a plan's cp on CPU (tests/test_export_torch.py checks it against
#: the installed torch: 2 gloo processes, a causal SDPA under context_parallel; docs/export.md)
CP_ON_CPU = ("torch's ring runs in the CUDA SDPA kernels (aten._scaled_dot_product_{flash,efficient,cudnn}_attention), "
             "and CPU's aten._scaled_dot_product_flash_attention_for_cpu has no DTensor sharding strategy")


def _cp_refusal(cp: dict[str, Any]) -> str:
    """The one-line refusal of a cp plan (``cp``: :func:`context_parallel_doc`): torch has no
    equivalent of the variant, or its equivalent does not run on CPU / gloo, where the export is
    checked against eager (docs/export.md)."""
    head = f"--export torch: the plan runs context parallelism over cp ({cp['variant']} attention"
    if not cp["supported"]:
        return f"{head}): not exported: {cp['note']} (torch {cp['torch']})"
    return (f"{head}; torch {cp['torch']}'s context_parallel with set_rotate_method({cp['rotate_method']!r})): not "
            f"exported, it cannot run on CPU / gloo (where exports are checked against eager): {CP_ON_CPU}; "
            f"--export dtensor says how torch runs it on CUDA")


def torch_source(plan: Plan, command: str = "",
                 pipeline: tuple[Any, PipelineSpec, tuple[int, ...]] | None = None, recompute: str = "none") -> str:
    """The ``torch`` export of ``plan``: the text of a Python module (module docstring).
    ``pipeline``: (the full mesh with its pp dim, the spec, the layers per stage) of a pipeline
    plan, ``plan`` then the plan of one microbatch on the sub-mesh without pp. ``recompute``: the
    plan's ``--recompute`` (:mod:`spmdkit.outputs.export_torch_run`: stated, whole layers applied)."""
    cp = context_parallel_doc(plan)
    if cp is not None:
        raise ExportError(_cp_refusal(cp))
    if not getattr(plan.program, "modules", None):
        raise ExportError(f"--export torch: the program {plan.program.name or ''} records no module paths (a preset's "
                          f"zoo model or a program JSON): the torch export styles an HF model's modules (plan --hf)")
    ex = _TorchExport(plan)
    ex.check_experts()
    doc = ex.document()
    full = plan.mesh if pipeline is None else pipeline[0]
    dims, shape = tuple(full.dim_names), tuple(full.shape)
    pipe = by_stage = None
    if pipeline is not None:
        sp = sorted(m for m, d in ex.styles.items() if d["style"] == "SequenceParallel" and not d["use_local_output"])
        if sp:
            raise ExportError(f"--export torch: a pipeline of a sequence-parallel plan ({sp[0]}: SequenceParallel): "
                              f"the hidden states between stages are sequence-sharded DTensors, which torch's "
                              f"PipelineStage does not send; not exported (drop sp or pp)")
        pipe = pipeline_doc(plan, pipeline[1], pipeline[2], frozenset(ex.styles))
        by_stage = stage_collectives(plan, pipeline[2], pipeline[1].microbatches, frozenset(ex.row_bias))
    ex.heads = _heads_modules(ex)
    ordered = {p: ex.styles[p] for p in _model_order(ex, ex.styles)}
    styles, after = compress(ordered), compress(ex.after)
    dp = data_parallel(plan)
    container = layers_container(plan)
    n_layers = len(layer_tags(plan.program)) if container else 0
    ckpt = checkpointed_layers(plan, recompute, pipeline is not None) if container else ()
    used = sorted({d["style"] for d in [*styles.values(), *after.values()]} - {STYLE, MLA_STYLE})
    experts = any(d["style"] == STYLE for d in styles.values())
    mla = any(d["style"] == MLA_STYLE for d in styles.values())
    lines = [*file_header(plan, command, dims, shape, priced_doc(plan, recompute, ckpt)), *_imports(ex, dp, used, pipe, experts, experts or mla),
             *([CHECKPOINT_IMPORT] if ckpt else []),
             *file_constants(plan, doc, dims, shape, dp, n_layers, pipe, by_stage, frozenset(ex.row_bias),
                         frozenset(ex.scaled_lookups), ckpt), *run_constants(plan, recompute, ckpt)]
    lines += [*STYLE_SOURCE.split("\n")[1:], "", ""] if experts else []
    lines += [*MLA_SOURCE.split("\n")[1:], "", ""] if mla else []
    lines += _plan_py("TP_PLAN", styles, "module path -> its style over mesh[\"tp\"] (parallelize_module; * is any layer)")
    if after:
        lines += ["", *_plan_py("TP_PLAN_AFTER", after, "applied after TP_PLAN: a norm's sequence-sharded output "
                                                         "all-gathered once for the column layers sharing it")]
    conv = list(dict.fromkeys(c if c in styles else m for m in sorted(ex.conv1d) for c in [_layer_glob(m)[0]]))
    if conv:
        lines += ["", "#: Conv1D modules (x @ W, W [in, out]: GPT-2's) the plan shards: torch's styles shard nn.Linear, so",
                  "#: each is swapped for the nn.Linear it equals (its weight transposed, the same names) before TP_PLAN",
                  f"CONV1D_AS_LINEAR = {tuple(conv)!r}"]
    fused = compress_values(ex.fused)
    if fused:
        lines += ["", "#: Fused weights the plan splits into parts, each sharded over tp by heads (GPT-2's c_attn: q | k | v,",
                  "#: the parts' output features). ColwiseParallel shards a weight's output features in one contiguous",
                  "#: block, which would give a rank other heads' q / k / v: _fused_per_rank first reorders them so",
                  "#: that rank r's block is [q_r | k_r | v_r] (fused_order), its bias with them, and divides the",
                  "#: attention's split_size / num_heads by tp. Gradients come back in that order (fused_order maps them).",
                  f"FUSED_QKV = {fused!r}"]
    if ex.heads:
        lines += ["", "#: Attention modules that view their q / k / v outputs with head counts of their own (StableLM, OPT,",
                  "#: GPT-Neo: .view(bsz, q_len, self.num_heads, head_dim)); ColwiseParallel gives each rank its heads'",
                  "#: features, so _heads_per_rank divides those counts by tp before TP_PLAN.",
                  f"HEADS_PER_RANK = {ex.heads!r}"]
    lines += ["", "#: tied parameters (parallelize_module gives each module its own; tied again after): name -> the one kept",
              f"TIED = {dict(sorted(doc['tied'].items()))!r}"]
    notes = file_notes(doc["notes"])
    lines += ["", *notes] if notes else []
    lines += CONV1D_FN if conv else []
    lines += FUSED_FN if fused else []
    lines += HEADS_FN if ex.heads else []
    padded = plan.program.vocab_padding is not None
    lines += VOCAB_FN if padded else []
    lines += PRESENT_FN if pipe is not None else []
    once = dp is None and any(d["style"] == "SequenceParallel" for d in [*styles.values(), *after.values()])
    lines += GRADS_ONCE_FN if once else []
    lines += checkpoint_fn(container) if ckpt and container else []
    lines += parallelize_fn(styles, after, conv, dp, pipe, bool(fused), once, bool(ex.heads), bool(ckpt), padded)
    if pipe is not None:
        lines += [*pipeline_lines(pipe)[1:], ""]
    return "\n".join(lines)


def export_torch(plan: Plan, path: str, command: str = "",
                 pipeline: tuple[Any, PipelineSpec, tuple[int, ...]] | None = None, recompute: str = "none") -> str:
    """Write the ``torch`` export of ``plan`` to ``path`` (atomically) and return its text
    (:func:`torch_source`)."""
    check_target("torch", path)
    text = torch_source(plan, command, pipeline, recompute)
    write_atomic_text(text, path, "--export torch")
    return text


__all__ = ["CP_ON_CPU", "FUNCOL", "compress", "export_torch", "torch_source", "tp_collectives"]
