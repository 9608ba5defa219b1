"""The MoE layers of a program found by structure, and Megatron's expert tensor parallelism over them.

A MoE layer is what the zoo (:mod:`spmdkit.models.zoo_moe`) and the HF importer
(:mod:`spmdkit.models.torch_import.aten.moe`) build alike: a ``moe_gate_dispatch`` whose gate values
come from a router (a ``matmul`` with a 2-D parameter, through ``softmax`` / ``sigmoid`` / casts /
reshapes), its dispatched tokens ``[B, E, C, H]`` read by ``matmul`` s with 3-D parameter stacks
``[E, in, out]`` (the experts' first projections: gate and up), an activation, a ``matmul`` with a
stack back to the hidden size (down) and, through a reshape, ``moe_combine``. :func:`moe_projections`
finds them by that pattern (with which stacks are an expert's first projections and which its
down projection, and the router: what Megatron's expert tensor parallelism needs;
:func:`spmdkit.strategies.experts.moe_layers` is expert parallelism's view of the same layers), whatever the parameters are called.

``megatron`` (:func:`shard_experts`): Megatron-Core's expert tensor parallelism with ETP = tp, as the
zoo's megatron: each expert's first projections column-parallel (their ``out`` axis over tp), the
down projection row-parallel (its ``in`` axis over tp), so an expert's output is a partial sum over
tp like a dense MLP's; the router replicated (every tp rank routes every token the same way).
Standard library only."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.program.ir import Op, Program

#: ops a router's gate values or an expert's activation pass through (one tensor input that matters)
_THROUGH = frozenset({"softmax", "sigmoid", "cast", "reshape", "transpose", "scale"})
_ACT = frozenset({"swiglu", "silu", "gelu", "relu", "multiply", "square", "sigmoid", "cast"})


@dataclass
class MoeProjections:
    """One MoE layer of a program: its dispatch and combine ops (indices), the router's weight
    (None where the gate values do not come from a parameter), the experts' first projections
    (``column``: gate and up stacks) and down projections (``row``)."""

    dispatch: int
    combine: int
    router: str | None
    column: list[str] = field(default_factory=list)
    row: list[str] = field(default_factory=list)

    @property
    def stacks(self) -> list[str]:
        return [*self.column, *self.row]


def _stack(prog: Program, op: Op) -> str | None:
    """The 3-D parameter a ``matmul`` multiplies by (its ``y``), or None."""
    y = op.inputs.get("y")
    if op.rule != "matmul" or not isinstance(y, str):
        return None
    t = prog.tensors.get(y)
    return y if t is not None and t.kind == "parameter" and len(t.shape) == 3 else None


def moe_projections(prog: Program) -> list[MoeProjections]:
    """The program's MoE layers in forward order (see the module docstring)."""
    fwd = [(i, op) for i, op in enumerate(prog.ops) if op.phase == "forward"]
    producer = {o: (i, op) for i, op in fwd for o in op.output_names()}
    readers: dict[str, list[tuple[int, Op]]] = {}
    for i, op in fwd:
        for n in op.input_names():
            readers.setdefault(n, []).append((i, op))
    found: list[MoeProjections] = []
    for i, op in fwd:
        if op.rule != "moe_gate_dispatch":
            continue
        y = op.output_names()[0]
        column = [s for _j, r in readers.get(y, []) if (s := _stack(prog, r)) is not None]
        outs = [r.output_names()[0] for _j, r in readers.get(y, []) if _stack(prog, r) is not None]
        row: list[str] = []
        combine = -1
        frontier, seen = list(outs), set(outs)
        while frontier:  # from the first projections' outputs through the activation to down, then combine
            n = frontier.pop()
            for _j, r in readers.get(n, []):
                s = _stack(prog, r)
                if s is not None and r.inputs.get("x") == n:
                    row.append(s)
                    combine = max(combine, _combine_after(r.output_names()[0], readers))
                elif r.rule in _ACT:
                    o = r.output_names()[0]
                    if o not in seen:
                        seen.add(o)
                        frontier.append(o)
        if column and row and combine >= 0:
            found.append(MoeProjections(i, combine, _router(prog, op.inputs.get("gate_logits"), producer),
                                  list(dict.fromkeys(column)), list(dict.fromkeys(row))))
    return found


def _combine_after(n: str, readers: Mapping[str, list[tuple[int, Op]]]) -> int:
    for _ in range(4):
        nxt = None
        for j, r in readers.get(n, []):
            if r.rule == "moe_combine" and r.inputs.get("x") == n:
                return j
            if r.rule in ("reshape", "cast"):
                nxt = r.output_names()[0]
        if nxt is None:
            return -1
        n = nxt
    return -1


def _router(prog: Program, g: Any, producer: Mapping[str, tuple[int, Op]]) -> str | None:
    for _ in range(6):
        if not isinstance(g, str) or g not in producer:
            return None
        _i, op = producer[g]
        if op.rule == "matmul":
            w = op.inputs.get("y")
            t = prog.tensors.get(w) if isinstance(w, str) else None
            return w if isinstance(w, str) and t is not None and t.kind == "parameter" and len(t.shape) == 2 else None
        if op.rule not in _THROUGH:
            return None
        g = op.inputs.get("x")
    return None


def shard_experts(prog: Program, mesh: ProcessMesh, dm: Any, tp: int, sharded: dict[str, str],
                  layers: list[MoeProjections] | None = None, whole: frozenset[str] = frozenset()
                  ) -> list[MoeProjections]:
    """Megatron's ETP = tp over the MoE layers (module docstring): the stacks' feature axes over
    ``tp``, recorded in ``sharded`` (``expert_column`` / ``expert_row``; the router
    ``router``, replicated on purpose). ``whole``: the stacks kept whole (ETP = 1: expert
    parallel over ep x tp instead, recorded as ``expert``). The layers."""
    size = mesh.shape[tp]
    found = moe_projections(prog) if layers is None else layers
    for layer in found:
        for p, role in [*((p, "column") for p in layer.column), *((p, "row") for p in layer.row)]:
            if p in whole:
                sharded.setdefault(p, "expert")
            if p in sharded:
                continue
            trans = any(op.attrs.get("trans_y") for op in prog.ops if op.phase == "forward" and op.rule == "matmul"
                        and op.inputs.get("y") == p)
            axis = (1 if trans else 2) if role == "column" else (2 if trans else 1)
            n = prog.tensors[p].shape[axis]
            if n % size:
                raise ProgramError(f"--strategy megatron: expert stack {p} ({role}): its feature axis has {n} "
                                   f"entries, not divisible by tp={size}")
            dm(p)[axis] = tp
            sharded[p] = "expert_" + role
        if layer.router is not None:
            sharded.setdefault(layer.router, "router")
    return found


def block_module(prog: Program, m: MoeProjections) -> str:
    """The MoE block's module path (the experts module's parent: HF's sparse MoE block, which
    runs the router, the experts and any shared experts), or "" where the program records none."""
    modules = getattr(prog, "modules", None) or {}
    experts = modules.get(m.dispatch, ("", ""))[0]
    return str(experts).rpartition(".")[0]


def moe_ends(prog: Program, layers: list[MoeProjections]) -> list[tuple[list[str], list[str]]]:
    """Each MoE layer's ends: its input tokens (the dispatch's ``x``, then back through reshapes to
    the tensor it is read from, the last: a norm's output) and its output (the combine's, then on
    through reshapes and the block's own adds of a shared expert's output, the last: what the
    residual add reads). Sequence parallel gathers the first
    before the block and returns the second to sequence shards (strategies.hf)."""
    producer = {o: op for op in prog.ops if op.phase == "forward" for o in op.output_names()}
    modules = getattr(prog, "modules", None) or {}
    module_of = {id(op): modules[i][0] for i, op in enumerate(prog.ops) if i in modules}
    readers: dict[str, list[Op]] = {}
    for op in prog.ops:
        if op.phase == "forward":
            for n in op.input_names():
                readers.setdefault(n, []).append(op)
    out = []
    for m in layers:
        x = prog.ops[m.dispatch].inputs.get("x")
        ins = [x] if isinstance(x, str) else []
        while ins and ins[-1] in producer and producer[ins[-1]].rule == "reshape" \
                and isinstance(producer[ins[-1]].inputs.get("x"), str):
            ins.append(producer[ins[-1]].inputs["x"])
        outs = [prog.ops[m.combine].output_names()[0]]
        block = block_module(prog, m)
        while len(readers.get(outs[-1], [])) == 1 and (readers[outs[-1]][0].rule == "reshape" or (
                block and readers[outs[-1]][0].rule == "add" and module_of.get(id(readers[outs[-1]][0])) == block)):
            outs.append(readers[outs[-1]][0].output_names()[0])
        out.append((ins, outs))
    return out


__all__ = ["MoeProjections", "block_module", "moe_ends", "moe_projections", "shard_experts"]
