"""The ``dtensor`` export (:mod:`spmdkit.outputs.export` describes the document): a
``parallelize_module`` plan over the tensor-parallel mesh dim derived from the plan's placements
and from how the program reads each weight (:class:`_DTensorExport`, which
:mod:`spmdkit.outputs.export_torch` extends), the placements of every parameter, and torch's
``context_parallel`` for a plan with cp.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr, entry_dims
from spmdkit.core.placements import Replicate, Shard, to_placements
from spmdkit.outputs.dtensor_ep import expert_note, expert_parallel_statement
from spmdkit.outputs.export_common import (
    DOC_FORMATS,
    VERSION,
    ExportError,
    _mesh_doc,
    _parameters,
    _placement_text,
    _placements,
)
from spmdkit.outputs.torch_cp import torch_context_parallel
from spmdkit.program.ir import Op, Program
from spmdkit.program.plan import Plan
from spmdkit.strategies.hf_moe import moe_projections
from spmdkit.strategies.hf_program import forward_readers, weight_axes
from spmdkit.strategies.hf_roles import block_roles


def _producers(prog: Program) -> dict[str, int]:
    return {n: i for i, op in enumerate(prog.ops) for n in op.output_names()}


def _forward_readers(prog: Program) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, op in enumerate(prog.ops):
        if op.phase == "forward":
            for n in op.input_names():
                out.setdefault(n, []).append(i)
    return out


# -- dtensor -------------------------------------------------------------------------------------


def _tp_dim(plan: Plan, weights: list[str]) -> int | None:
    """The tensor-parallel mesh dim: the one named ``tp``, else the only mesh dim that shards a
    weight; None when no weight is sharded."""
    names = plan.mesh.dim_names
    if "tp" in names:
        return int(names.index("tp"))
    dims = {d for w in weights for e in plan.attrs[w].dims_mapping for d in entry_dims(e)}
    if len(dims) == 1:
        return dims.pop()
    if not dims:
        return None
    raise ExportError(f"--export dtensor: weights are sharded over mesh dims {sorted(names[d] for d in dims)} and "
                      f"none is named 'tp': name the tensor-parallel one tp")


def _tp_placement(attr: TensorDistAttr, tp: int) -> Any:
    return to_placements(attr)[tp]


def _feeds_loss(prog: Program, readers: dict[str, list[int]], name: str) -> bool:
    """Whether ``name`` reaches a vocab-parallel loss through views / casts / a bias add / Gemma 2's
    final-logit soft-capping (``tanh(logits / cap) * cap``)."""
    frontier, seen = [name], set()
    for _ in range(8):
        nxt = []
        for n in frontier:
            for i in readers.get(n, []):
                op = prog.ops[i]
                if op.rule == "c_softmax_with_cross_entropy":
                    return True
                if op.rule in ("reshape", "cast", "slice", "add", "transpose", "scale", "multiply", "divide", "tanh"):
                    nxt += [o for o in op.output_names() if o not in seen]
        seen.update(nxt)
        frontier = nxt
    return False


def _reduced_to(plan: Plan, name: str, tp: int) -> Any:
    """The tp placement a partial tensor is first resharded to (its readers' layout), else None."""
    for r in plan.reshards:
        if r.tensor == name and _tp_placement(r.src, tp).is_partial():
            return _tp_placement(r.dst, tp)
    return None


def _module_of_param(name: str, fmt: str) -> str:
    if not name.endswith(".weight"):
        raise ExportError(f"--export {fmt}: {name}: a sharded 2-D parameter not named <module>.weight has no "
                          f"torch parallel style (ColwiseParallel / RowwiseParallel shard a module's weight): "
                          f"export an --hf model's plan this way; a preset's tensor-parallel weights (the zoo's "
                          f"[in, out] tensors, no torch module) export to jax or paddle")
    return name[: -len(".weight")]


def _sequence_parallel(mod: str, name: str, pl: Any) -> ExportError:
    return ExportError(f"--export dtensor: {mod}: the plan holds {name} as {_placement_text(pl)} over tp (sequence "
                       f"parallel): a parallelize_module plan holds one style per module and a sequence-parallel norm "
                       f"needs two (SequenceParallel, then its output all-gathered): use --export torch")


def _style_doc(style: str, **kw: Any) -> dict[str, Any]:
    return {"style": style, **kw}


class _DTensorExport:
    """The ``dtensor`` export of one plan, step by step: the tensor-parallel mesh dim, each
    sharded weight's modules (:meth:`uses`) and their parallel styles (:meth:`style`), the
    checks on layers beside column layers and the shared inputs' ``PrepareModuleOutput``."""

    fmt = "dtensor"

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.prog = prog = plan.program
        self.params = _parameters(plan, self.fmt)
        self.placements = {p: _placements(plan.attrs[p], self.fmt, p) for p in self.params}
        self.readers = forward_readers(prog)
        self.fwd_readers = _forward_readers(prog)
        self.producers = _producers(prog)
        self.modules: dict[int, tuple[str, str]] = getattr(prog, "modules", None) or {}
        self.aliases: dict[str, str] = getattr(prog, "aliases", None) or {}
        self.weights = [p for p in self.params if len(prog.tensors[p].shape) == 2]
        self.tp = self.tensor_parallel_dim()
        self.styles: dict[str, dict[str, Any]] = {}
        self.loss_parallel = False
        self.notes: list[str] = []
        self.column_inputs: dict[str, list[str]] = {}
        self.tied_to: dict[str, str] = {}
        #: modules whose column layers share an input read whole beside them (beside_columns_module)
        self.shared_modules: dict[str, str] = {}
        #: the whole layers read beside each of them
        self.whole_beside: dict[str, list[str]] = {}
        #: those whose column layers' input gradients the plan all-reduces one by one, not summed
        self.each_own: set[str] = set()

    def tensor_parallel_dim(self) -> int | None:
        """The tensor-parallel mesh dim (:func:`_tp_dim`)."""
        return _tp_dim(self.plan, self.weights)

    def document(self) -> dict[str, Any]:
        plan, prog, tp = self.plan, self.prog, self.tp
        if tp is not None:
            for p in self.weights:
                pl = _tp_placement(plan.attrs[p], tp)
                if not pl.is_shard():
                    continue
                for mod, how, _out_ax, op in self.uses(p):
                    self.loss_parallel = self.style(mod, how, op, pl) or self.loss_parallel
            self.check_whole_beside_columns()
            self.check_broadcast_onto_shards()
            self.prepare_shared_inputs()
        if self.styles and not self.modules:
            self.notes.append("the program records no module paths (a program JSON): no PrepareModuleOutput derived, "
                              "so each column layer all-reduces its own input gradient (more than the plan's one per "
                              "block)")
        experts = expert_parallel_statement(plan)
        if experts is not None:
            self.notes.append(expert_note(experts))
        return {"format": DOC_FORMATS.get(self.fmt, self.fmt), "version": VERSION, "mesh": _mesh_doc(plan),
                "expert_parallel": experts, "tp_dim": None if tp is None else plan.mesh.dim_names[tp],
                "parallelize_plan": dict(sorted(self.styles.items())), "loss_parallel": self.loss_parallel,
                "tied": self.tied_to, "placements": self.placements,
                "shapes": {p: list(prog.tensors[p].shape) for p in self.params}, "notes": self.notes}

    def _linear_in_out(self, p: str, how: str, out_ax: int) -> None:
        if how == "linear" and out_ax != 0:
            raise ExportError(f"{self.flag}: {p}: read as x @ W with W [in, out] (GPT-2's Conv1D, a "
                              f"preset's weights): ColwiseParallel / RowwiseParallel take nn.Linear ([out, in]) "
                              f"and nn.Embedding weights")

    def heads_axis(self, x: str, d: int) -> bool:
        """Axis ``d`` of ``x`` is a heads axis of ``[batch, seq, heads, head_dim]`` (neither a token
        axis nor the features a norm reduces): Qwen3's ``q_norm`` / ``k_norm`` run on the heads a
        column-parallel ``q_proj`` / ``k_proj`` makes, which tp shards. Followed back through the
        forward ops that made ``x`` (elementwise ones, same shape in and out, and transposes; by
        :attr:`producers`): Gemma 3's norms run on ``[batch, heads, seq, head_dim]`` (the view
        transposed first, ``perm (0, 2, 1, 3)``), whose axis 1 is that heads axis, not the sequence."""
        prog = self.prog
        for _ in range(8):
            i, shape = self.producers.get(x), prog.tensors[x].shape
            src = prog.ops[i] if i is not None and prog.ops[i].phase == "forward" else None
            perm = src.attrs.get("perm") if src is not None and src.rule == "transpose" else None
            if src is not None and isinstance(perm, (tuple, list)) and len(perm) == len(shape):
                x, d = src.inputs["x"], int(perm[d])
                continue
            same = [v for v in (src.input_names() if src is not None else []) if v in prog.tensors
                    and prog.tensors[v].shape == shape]
            if not same:
                break
            x = same[0]
        nd = len(prog.tensors[x].shape)
        return nd >= 4 and 1 < d < nd - 1

    def uses(self, p: str) -> list[tuple[str, str, int, Op]]:
        """(module path, linear / embedding, output-feature axis, reading op) of each module
        that reads weight ``p``: one, or one per name of a tied parameter."""
        assert self.tp is not None
        prog = self.prog
        tied = sorted(a for a, t in self.aliases.items() if t == p)
        layers = [op for op in prog.ops if op.phase == "forward" and (
            (op.rule == "matmul" and op.inputs.get("y") == p)
            or (op.rule in ("embedding", "c_embedding") and op.inputs.get("weight") == p))]
        if not tied and len(layers) > 1:
            raise ExportError(f"{self.flag}: {p}: read by {len(layers)} layers ({', '.join(op.rule for op in layers)}) "
                              f"and the program names no other module for it (a tied parameter in a program JSON, "
                              f"which keeps no module paths): export from --hf")
        if not tied:
            how, out_ax, _in_ax, op = weight_axes(prog, self.readers, p)
            if op is None:
                raise ExportError(f"{self.flag}: {p}: sharded over tp ({self.placements[p][self.tp]}) but not "
                                  f"read as a Linear weight or an Embedding table: torch has no parallel style for it")
            self._linear_in_out(p, how, out_ax)
            return [(_module_of_param(p, self.fmt), how, out_ax, op)]
        return self._tied_uses(p, tied)

    def _tied_uses(self, p: str, tied: list[str]) -> list[tuple[str, str, int, Op]]:
        """:meth:`uses` of a tied parameter: the module of each name reads it."""
        paths = {_module_of_param(n, self.fmt) for n in [p, *tied]}
        out = []
        for i, op in enumerate(self.prog.ops):
            if op.phase != "forward":
                continue
            if op.rule == "matmul" and op.inputs.get("y") == p:
                how, out_ax = "linear", 0 if op.attrs.get("trans_y", False) else 1
            elif op.rule in ("embedding", "c_embedding") and op.inputs.get("weight") == p:
                how, out_ax = "embedding", 1
            else:
                continue
            self._linear_in_out(p, how, out_ax)
            m = self.modules.get(i, ("", ""))[0]
            if m not in paths:
                raise ExportError(f"{self.flag}: {p} (tied with {', '.join(tied)}): read in module {m or '?'}, "
                                  f"not one of {', '.join(sorted(paths))}")
            out.append((m, how, out_ax, op))
            self.tied_to.update({a: p for a in tied})
        if {m for m, *_ in out} != paths:
            raise ExportError(f"{self.flag}: {p} (tied with {', '.join(tied)}): not read by every module named "
                              f"{', '.join(sorted(paths))}")
        return out

    def style(self, mod: str, how: str, op: Op, pl: Any) -> bool:
        """Add ``mod``'s style; True when its output feeds the vocab-parallel loss."""
        assert self.tp is not None
        tp, plan = self.tp, self.plan
        i = self.prog.ops.index(op)
        x = op.inputs["x"]
        assert isinstance(x, str)
        x_in = _tp_placement(plan.ops[i].given["x"], tp)
        x_req = _tp_placement(plan.ops[i].required["x"], tp)
        colwise = (pl.dim == 0) if how == "linear" else (pl.dim == 1)
        feeds_loss = False
        if how == "linear" and colwise:
            feeds_loss = self._colwise(mod, op, x, x_in, x_req)
        else:
            self._rowwise(mod, how, op, x, x_req, colwise)
        bias = mod + ".bias"
        if bias in self.placements:
            bp = _tp_placement(plan.attrs[bias], tp)
            style = self.styles[mod]["style"]
            ok = bp == Shard(0) if style == "ColwiseParallel" else bp == Replicate()
            if not ok:
                raise ExportError(f"{self.flag}: {bias}: the plan places it {_placement_text(bp)} over tp, "
                                  f"{style} {'Shard(0)' if style == 'ColwiseParallel' else 'Replicate()'}")
        return feeds_loss

    #: the option the export's messages name
    flag = "--export dtensor"

    def _colwise_style(self, mod: str, op: Op, x: str, x_in: Any, x_req: Any) -> bool:
        """A column-parallel linear layer's style (its input read as ``x_in``); True when its
        output stays a local tensor (it does not feed the loss)."""
        assert self.tp is not None
        prog = self.prog
        out = op.output_names()[0]
        if not x_req.is_replicate():
            raise ExportError(f"{self.flag}: {mod} (ColwiseParallel): the plan reads its input {x} as "
                              f"{_placement_text(x_req)} over tp, ColwiseParallel as Replicate()")
        local = not _feeds_loss(prog, self.fwd_readers, out)
        o = _tp_placement(self.plan.attrs[out], self.tp)
        if not (o.is_shard() and o.dim == len(prog.tensors[out].shape) - 1):
            raise ExportError(f"{self.flag}: {mod} (ColwiseParallel): the plan makes its output {out} "
                              f"{_placement_text(o)} over tp, ColwiseParallel Shard(-1)")
        self.styles[mod] = _style_doc("ColwiseParallel", input_layouts=_placement_text(x_in),
                                      output_layouts="Shard(-1)", use_local_output=local)
        return local

    def _colwise(self, mod: str, op: Op, x: str, x_in: Any, x_req: Any) -> bool:
        """A column-parallel linear layer's style; True when its output feeds the loss."""
        local = self._colwise_style(mod, op, x, x_in, x_req)
        if x_in.is_shard():
            raise _sequence_parallel(mod, x, x_in)
        self.column_inputs.setdefault(x, []).append(mod)
        return not local

    def _row_target(self, mod: str, how: str, out: str, colwise: bool) -> Any:
        """Where a row layer's partial output is reduced to over tp (a placement), or None for an
        embedding table sharded on its features (ColwiseParallel, its style set here)."""
        assert self.tp is not None
        if how == "embedding" and colwise:
            self.styles[mod] = _style_doc("ColwiseParallel", input_layouts="Replicate()", output_layouts="Shard(-1)",
                                          use_local_output=True)
            return None
        dst = _reduced_to(self.plan, out, self.tp)
        if dst is None:
            raise ExportError(f"{self.flag}: {mod} (RowwiseParallel): the plan never reduces its "
                              f"partial output {out} over tp")
        return dst

    def _rowwise(self, mod: str, how: str, op: Op, x: str, x_req: Any, colwise: bool) -> None:
        """A row-parallel linear layer's style, or an embedding table's."""
        assert self.tp is not None
        out = op.output_names()[0]
        want = "Shard(-1)" if how == "linear" else "Replicate()"
        if how == "embedding" and x_req.is_shard():
            raise _sequence_parallel(mod, x, x_req)
        if (how == "linear" and not (x_req.is_shard() and x_req.dim == len(self.prog.tensors[x].shape) - 1)) \
                or (how == "embedding" and not x_req.is_replicate()):
            raise ExportError(f"{self.flag}: {mod} (RowwiseParallel): the plan reads its input {x} as "
                              f"{_placement_text(x_req)} over tp, RowwiseParallel as {want}")
        dst = self._row_target(mod, how, out, colwise)
        if dst is None:
            return
        if dst.is_shard():
            raise _sequence_parallel(mod, out, dst)
        self.styles[mod] = _style_doc("RowwiseParallel", input_layouts=want if how == "linear" else "Replicate()",
                                      output_layouts=_placement_text(dst), use_local_output=True)

    def check_whole_beside_columns(self) -> None:
        """A layer left whole beside column layers of the same input (kv projections with fewer
        heads than tp) is refused: on local shards its output would not match theirs (2 kv
        heads against 1 query head)."""
        assert self.tp is not None
        prog = self.prog
        routers = {m.router for m in moe_projections(prog)}
        kv = block_roles(prog).kv
        for x, mods in self.column_inputs.items():
            for j in self.fwd_readers.get(x, []):
                w = prog.ops[j].inputs.get("y") if prog.ops[j].rule == "matmul" else None
                if isinstance(w, str) and w in self.placements and len(prog.tensors[w].shape) == 2 \
                        and not _tp_placement(self.plan.attrs[w], self.tp).is_shard():
                    if self.beside_columns_module(x, mods, w, j):
                        continue
                    if w in routers:
                        raise ExportError(f"{self.flag}: {w}: the MoE router, replicated over tp, reads the input {x} "
                                          f"of the column-parallel {', '.join(mods)}, and those are not the only "
                                          f"readers of {x} inside one module the router is outside of (the shared "
                                          f"experts MLP, which PrepareModuleInput gives the input alone): not exported")
                    if w not in kv:
                        raise ExportError(f"{self.flag}: {w}: replicated over tp while {', '.join(mods)} reading the "
                                          f"same input {x} are column-parallel: not exported, the export has no style "
                                          f"for a whole layer beside column layers of its input")
                    raise ExportError(f"{self.flag}: {w}: replicated over tp while {', '.join(mods)} reading the "
                                      f"same input {x} are column-parallel (kv heads fewer than tp?): torch runs the "
                                      f"module's code on local shards, which would pair its whole output with their "
                                      f"shards; use a tp that divides the kv heads")

    def check_broadcast_onto_shards(self) -> None:
        """A tensor whole over tp that the plan broadcasts (``expand``) onto heads sharded over tp and
        whose gradient it therefore all-reduces over tp (DeepSeek's MLA: the rotary key ``k_rot``, one
        head from the whole ``kv_a_proj_with_mqa``, shared by every query head) is refused: torch's
        styles run HF's attention on each rank's heads with no hook inside its forward, so that
        gradient, and the whole layer's behind it, would stay each rank's heads' share."""
        assert self.tp is not None
        for r, s in self.plan.collectives("backward"):
            op = self.prog.ops[r.op_index]
            if op.rule != "expand_grad" or s.kind != "all_reduce" or self.tp not in s.mesh_dims:
                continue
            x = op.inputs.get("x")
            i = self.producers.get(x) if isinstance(x, str) else None
            mod = self.modules.get(i, ("", ""))[0] if i is not None else ""
            keep = {".".join(w.split(".")[-3:-1]): "replicate" for w in self.weights
                    if mod and w.startswith(mod + ".") and _tp_placement(self.plan.attrs[w], self.tp).is_shard()}
            raise ExportError(f"{self.flag}: {mod or x}: the plan broadcasts {x}, whole over tp, onto heads sharded "
                              f"over tp (expand) and all-reduces its gradient over tp (MLA's rotary key, one head "
                              f"shared by all); torch's styles run the module's forward on each rank's heads with no "
                              f"hook inside it, so that gradient would stay each rank's share: not exported (--export torch writes a "
                              f"style of its own for it; or keep the attention whole over tp: --tp-plan "
                              f"'{json.dumps(keep)}')")

    def beside_columns_module(self, x: str, mods: list[str], w: str, j: int) -> bool:
        """Whether the whole layer ``w`` (read by op ``j``) beside the column layers ``mods`` of input
        ``x`` is one torch runs as the plan does: the column layers are all of ``x``'s readers inside
        one module M that ``x`` enters from outside (a MoE block's shared experts MLP, DeepSeek-V3's
        ``shared_experts``, Qwen2-MoE's ``shared_expert``), and ``w`` reads ``x`` outside M (the
        router, Qwen2-MoE's ``shared_expert_gate``). M then gets ``PrepareModuleInput`` to a
        replicated DTensor (:meth:`shared_module_inputs`): its column layers' input gradients summed
        and all-reduced once, as the plan's one all-reduce of their sum; ``w`` reads the plain
        tensor and its gradient stays whole, as the plan's (refused where the plan reduces it over
        tp). torchtitan's DeepSeek-V3 runs its MoE block so: the router gate replicated (NoParallel),
        the shared experts' w1 / w3 ColwiseParallel and w2 RowwiseParallel (torchtitan 9810191^,
        torchtitan/models/llama4/infra/parallelize.py apply_moe_ep_tp), their parent converting its
        input to Replicate once before the w1 / w3 fork (torchtitan b5bcd76,
        torchtitan/models/common/moe_sharding.py _shared_experts_sharding_configs)."""
        assert self.tp is not None
        # the parents' common path: commonprefix of the lists of names compares them name by name
        path = ".".join(os.path.commonprefix([m.split(".")[:-1] for m in mods]))  # noqa: RUF071

        def inside(m: str) -> bool:
            return bool(path) and (m == path or m.startswith(path + "."))

        if not path or inside(self.modules.get(j, ("", ""))[0]):
            return False
        made = self.modules.get(self.producers[x], ("", ""))[0] if x in self.producers else ""
        if inside(made) or any(inside(m) and m not in mods for k in self.fwd_readers.get(x, [])
                               for m in [self.modules.get(k, ("", ""))[0]]):
            return False
        tp = self.tp
        if any(r.tensor == w + ".grad" and tp in s.mesh_dims for ph in ("backward", "optimizer")
               for r, s in self.plan.collectives(ph)):
            raise ExportError(f"{self.flag}: {w}: replicated over tp beside the column-parallel {', '.join(mods)} "
                              f"(reading {x} outside {path}), and the plan reduces its gradient over tp: torch's "
                              f"plain module keeps each rank's own; not exported")
        self.shared_modules[path] = x
        self.whole_beside.setdefault(path, []).append(w.removesuffix(".weight"))
        weights = {m + ".weight" for m in mods}
        own = {op.outputs[0] for op in self.prog.ops if op.phase == "backward" and op.rule == "matmul_grad"
               and op.inputs.get("x") == x and op.inputs.get("y") in weights}
        reduced = {r.tensor for r, s in self.plan.collectives("backward") if tp in s.mesh_dims}
        if own and own <= reduced:  # the plan all-reduces each layer's own: ColwiseParallel's, no shared DTensor
            self.each_own.add(path)
        return True

    def shared_module_inputs(self) -> None:
        """The modules :meth:`beside_columns_module` found: ``PrepareModuleInput`` of their input to
        a replicated DTensor (from the layout the plan makes it in), their column layers reading it
        replicated."""
        for path, x in self.shared_modules.items():
            if path in self.each_own:
                self.notes.append(f"{path}: its column layers read {x} whole beside "
                                  f"{', '.join(sorted(set(self.whole_beside.get(path, []))))}, each all-reducing its "
                                  f"own input gradient, as the plan")
                continue
            src = _placement_text(self.input_layout(x))
            self.styles[path] = _style_doc("PrepareModuleInput", input_layouts=src, desired_input_layouts="Replicate()",
                                           use_local_output=False)
            for m in self.column_inputs.get(x, []):
                self.styles[m]["input_layouts"] = "Replicate()"
            beside = ", ".join(sorted(set(self.whole_beside.get(path, []))))
            self.notes.append(f"{path}: its input {x} (read whole beside it by {beside}) one replicated DTensor for "
                              f"its column layers, their gradient all-reduced once")

    def input_layout(self, x: str) -> Any:
        """The tp placement a module's input ``x`` arrives in (the dtensor export: Replicate())."""
        return Replicate()

    def weight_reads(self, p: str) -> list[tuple[int, Op, str]]:
        """The forward ops reading parameter ``p`` (op index, op, the tensor it reads): directly,
        or through ops whose other inputs are recorded inputs or constants (Gemma's norms read
        ``1 + weight``: ``add(weight, 1)``, then the multiply with the activation)."""
        prog, out, frontier = self.prog, [], [p]
        for _ in range(4):
            nxt = []
            for n in frontier:
                for i, op, _slot in self.readers.get(n, []):
                    out.append((i, op, n))
                    others = [v for v in op.input_names() if v != n]
                    if len(op.output_names()) == 1 and all(v in prog.tensors and prog.tensors[v].kind == "input"
                                                           for v in others):
                        nxt.append(op.output_names()[0])
            frontier = nxt
        return out

    def norm_reads_on_shards(self) -> list[tuple[str, int, Op, str]]:
        """Each replicated 1-D parameter (a norm's weight or bias) that the plan reads beside an
        input sharded over tp, at its first such read (:meth:`weight_reads`' order): (parameter,
        op index, op, the sharded input's slot); the norms :meth:`norms_on_shards` and the torch
        export's ``sequence_parallel_norms`` give a style."""
        assert self.tp is not None
        prog, tp = self.prog, self.tp
        out: list[tuple[str, int, Op, str]] = []
        for p in self.params:
            if len(prog.tensors[p].shape) != 1 or _tp_placement(self.plan.attrs[p], tp).is_shard():
                continue
            for i, op, src in self.weight_reads(p):
                seq = [k for k, v in op.inputs.items() if isinstance(v, str) and v != src and v in prog.tensors
                       and prog.tensors[v].kind != "parameter"
                       and _tp_placement(self.plan.ops[i].required[k], tp).is_shard()]
                if seq:
                    out.append((p, i, op, seq[0]))
                    break
        return out

    def norms_on_shards(self) -> None:
        """A module with a replicated 1-D parameter (a norm's weight) that the plan runs on an
        input sharded over tp, whose gradient the plan therefore all-reduces over tp: on a heads
        axis (Qwen3's ``q_norm`` / ``k_norm``, :meth:`heads_axis`) ``SequenceParallel(sequence_dim=d,
        use_local_output=True)``, its weight a replicated DTensor whose ``Partial`` gradient DTensor
        sums over tp; on a token axis (sequence parallel) the refusal of sp plans. Never a plain
        module whose weight's gradient each rank keeps from its own heads."""
        assert self.tp is not None
        for p, i, op, k in self.norm_reads_on_shards():
            mod, x = self.modules.get(i, ("", ""))[0], op.inputs[k]
            if not mod:
                raise ExportError(f"{self.flag}: {p}: read on {x}, sharded over tp, and the program records "
                                  f"no module for it (a program JSON): export from --hf")
            if mod in self.styles:
                continue
            pl = _tp_placement(self.plan.ops[i].required[k], self.tp)
            if not self.heads_axis(x, pl.dim):
                raise _sequence_parallel(mod, x, pl)
            d = pl.dim
            self.styles[mod] = _style_doc("SequenceParallel", sequence_dim=d, use_local_output=True)
            self.notes.append(f"{mod}: runs on the heads a column layer makes, Shard({d}) over tp: its weight a "
                              f"replicated DTensor, its gradient Partial over tp after the backward (DTensor "
                              f"all-reduces it where the optimizer reads it; the plan once before the update)")

    def module_outputs_shared_by_columns(self) -> Iterator[tuple[str, list[str], str]]:
        """(tensor, the column layers reading it, the module making it) for each input that two or
        more column layers share, made by a module none of whose forward readers lies inside it
        and that is not one of :meth:`shared_module_inputs`' own."""
        for x, mods in self.column_inputs.items():
            if len(mods) < 2 or x not in self.producers or x in self.shared_modules.values():
                continue
            made = self.modules.get(self.producers[x])
            if made is None:
                continue
            path = made[0]
            if all(not (self.modules.get(j, ("", ""))[0] + ".").startswith(path + ".")
                   for j in self.fwd_readers.get(x, [])):
                yield x, mods, path

    def prepare_shared_inputs(self) -> None:
        """Column layers sharing one input made by one module: the module's output a
        replicated DTensor (``PrepareModuleOutput``), its gradient all-reduced once; norms on
        sharded inputs first (:meth:`norms_on_shards`), then those of :meth:`shared_module_inputs`."""
        self.norms_on_shards()
        self.shared_module_inputs()
        for x, mods, path in self.module_outputs_shared_by_columns():
            if path in self.styles:
                continue
            self.styles[path] = _style_doc("PrepareModuleOutput", output_layouts="Replicate()",
                                           desired_output_layouts="Replicate()", use_local_output=False)
            self.notes.append(f"{path}: its output {x} is read by {', '.join(mods)}: one replicated DTensor, its "
                              f"gradient all-reduced once")


def dtensor_document(plan: Plan) -> dict[str, Any]:
    """The ``dtensor`` export of ``plan`` (module docstring) as a JSON-able dict; a plan with
    context parallelism adds ``"context_parallel"`` (:func:`context_parallel_doc`)."""
    doc = _DTensorExport(plan).document()
    cp = context_parallel_doc(plan)
    if cp is not None:
        doc["context_parallel"] = cp
    return doc


def context_parallel_doc(plan: Plan) -> dict[str, Any] | None:
    """How torch's ``context_parallel`` runs the plan's context parallelism, or None without cp
    (:func:`spmdkit.outputs.torch_cp.torch_context_parallel`)."""
    return torch_context_parallel(plan)


__all__ = ["context_parallel_doc", "dtensor_document"]
