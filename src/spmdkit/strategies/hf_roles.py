"""Megatron roles of an imported program's linear layers, found from its graph (not its names).

A *linear* is a forward ``matmul`` whose ``y`` is a 2-D parameter, its transpose (FalconLinear's
``x @ W.T``) or a slice of it (a part of a split fused projection): torch's ``Linear``
(``[out, in]``), GPT-2's ``Conv1D`` (``[in, out]``) and any module computing ``x @ W`` its own
way. In a numbered block (an op's ``layer`` ending in ``.N``: ``model.layers.3``,
``transformer.h.0``), the linears reached from a linear's output going forward through the
block's ops, stopping at the next linear's input, are its *successors*; reaching an op outside
the block (the residual stream flowing on) counts too. Megatron's pairs are then:

- ``row``: a linear whose predecessors (the linears it is a successor of) are all in its
  block and lead only to it: the attention's output projection (after q, k and v), the MLP's
  down projection (after gate and up, or fc1). Its output returns to the residual stream.
- ``column``: those predecessors: they read the normalised residual stream and their outputs
  stay inside the block until the row linear (attention heads, the MLP's hidden features).
- ``replicate``: a low-rank down projection, whose output stays in the block, the only
  predecessor of a linear whose output stays in the block too and flows on to further linears (MLA's ``q_a_proj`` before ``q_b_proj``,
  ``kv_a_proj_with_mqa`` before ``kv_b_proj``): Megatron keeps it whole on every rank, and the
  linear after it is a column of the block's row linear (MLA's heads).

A linear in a block that is neither (a router, a projection whose output leaves the block) has
no role here: :func:`spmdkit.strategies.hf.annotate_program` replicates it, with a warning.

Standard library only.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from spmdkit.program.ir import Op, Program
from spmdkit.program.plan import Plan

#: an op's layer label that is a numbered block (``model.layers.3``, ``transformer.h.0``)
BLOCK = re.compile(r".+\.\d+")


@dataclass(frozen=True)
class Linear:
    """One forward matmul reading a 2-D parameter ``weight`` (op index ``op``) as ``y``,
    maybe through a transpose or a slice: ``x @ y -> out`` in block ``layer``."""

    op: int
    weight: str
    y: str
    x: str
    out: str
    layer: str
    #: the slice of the weight it reads (a part of a split fused projection), else None
    part: str | None = None


def weight_of(prog: Program, name: str, producer: dict[str, Op]) -> tuple[str, str | None] | None:
    """The 2-D parameter a matmul's ``y`` is (the parameter itself, its ``transpose``, a
    ``slice`` of it or a transpose of a slice) and the slice (None for none); None when it
    is none of these."""
    part = None
    for _ in range(3):
        t = prog.tensors.get(name)
        if t is None or len(t.shape) != 2:
            return None
        if t.kind == "parameter":
            return name, part
        op = producer.get(name)
        if op is None or op.phase != "forward":
            return None
        if op.rule == "transpose" and tuple(op.attrs.get("perm", ())) == (1, 0):
            src = op.inputs.get("x")
        elif op.rule == "slice" and part is None:
            src = op.inputs.get("input")
            part = name
        else:
            return None
        if not isinstance(src, str):
            return None
        name = src
    return None


def linears(prog: Program) -> list[Linear]:
    """The program's linears (module docstring), in op order."""
    producer = {o: op for op in prog.ops if op.phase == "forward" for o in op.output_names()}
    out: list[Linear] = []
    for i, op in enumerate(prog.ops):
        if op.phase != "forward" or op.rule != "matmul":
            continue
        x, y = op.inputs.get("x"), op.inputs.get("y")
        if not isinstance(x, str) or not isinstance(y, str) or len(prog.tensors[x].shape) < 2:
            continue
        w = weight_of(prog, y, producer)
        if w is not None:
            out.append(Linear(i, w[0], y, x, op.output_names()[0], op.layer, w[1]))
    return out


@dataclass(frozen=True)
class BlockRoles:
    """What the graph says: ``roles`` (weight -> ``column`` / ``row`` / ``replicate``), ``kv`` (the column
    weights, or parts of a split fused one, making fewer features than another column of the
    same row linear: GQA / MQA k and v, replicated when their heads are fewer than tp), ``unpaired`` (weights of block
    linears with no role), ``pairs`` (row weight -> its column weights)."""

    roles: dict[str, str]
    kv: frozenset[str]
    unpaired: tuple[str, ...]
    pairs: dict[str, tuple[str, ...]]


def block_roles(prog: Program) -> BlockRoles:
    """The column / row roles of the linears in the program's numbered blocks (module
    docstring). A weight read by linears given different roles gets none."""
    lins = [lin for lin in linears(prog) if BLOCK.fullmatch(lin.layer or "")]
    by_op = {lin.op: lin for lin in lins}
    readers: dict[str, list[int]] = {}
    for i, op in enumerate(prog.ops):
        if op.phase == "forward":
            for n in op.input_names():
                readers.setdefault(n, []).append(i)
    succ: dict[int, tuple[frozenset[int], bool]] = {}
    for lin in lins:
        found: set[int] = set()
        leaves = False
        seen = {lin.out}
        stack = [lin.out]
        while stack:
            n = stack.pop()
            for i in readers.get(n, ()):
                op = prog.ops[i]
                if op.layer != lin.layer:
                    leaves = True
                    continue
                if i in by_op and by_op[i].x == n:
                    found.add(i)
                    continue
                for o in op.output_names():
                    if o not in seen:
                        seen.add(o)
                        stack.append(o)
        loss = getattr(prog, "loss", None)
        if loss is not None and loss in seen:
            leaves = True
        succ[lin.op] = (frozenset(found), leaves)
    preds: dict[int, list[int]] = {}
    for a, (nxt, _) in succ.items():
        for b in nxt:
            preds.setdefault(b, []).append(a)
    # a low-rank factorisation (MLA's q_a_proj -> q_b_proj, kv_a_proj_with_mqa -> kv_b_proj): a
    # linear that is the only predecessor of a linear whose output stays in the block, flowing on
    # to further linears (a row linear's returns to the residual stream). The down projection is
    # replicated, as Megatron keeps MLA's, and left out of the pairs
    down = {ps[0] for b, ps in preds.items() if len(ps) == 1 and succ[b][0] and not succ[b][1]
            and not succ[ps[0]][1]}
    preds = {b: kept for b, ps in preds.items() if (kept := [a for a in ps if a not in down])}
    votes: dict[str, set[str]] = {by_op[a].weight: {"replicate"} for a in down}
    pairs: dict[str, list[str]] = {}
    kv: set[str] = set()
    for b, ps in preds.items():
        if not all(succ[a] == (frozenset({b}), False) for a in ps):
            continue
        row = by_op[b].weight
        votes.setdefault(row, set()).add("row")
        feats = {a: prog.tensors[by_op[a].out].shape[-1] for a in ps}
        top = max(feats.values())
        for a in ps:
            votes.setdefault(by_op[a].weight, set()).add("column")
            pairs.setdefault(row, []).append(by_op[a].weight)
            if feats[a] < top:
                kv.add(by_op[a].part or by_op[a].weight)
    roles = {w: next(iter(v)) for w, v in votes.items() if len(v) == 1}
    unpaired = tuple(dict.fromkeys(lin.weight for lin in lins if lin.weight not in roles))
    return BlockRoles(roles, frozenset(kv), unpaired,
                      {r: tuple(dict.fromkeys(cs)) for r, cs in pairs.items()})




def layer_collectives(plan: Plan, dim: str = "tp") -> dict[str, Counter[tuple[str, str, str]]]:
    """Per op layer (``model.layers.0``, ``''`` outside any; the layer of the op that made the
    tensor moved, in the same phase, or of the first term of a sum of partial gradients; else
    the op's that reads it): the plan's collectives over mesh
    dim ``dim`` as a Counter of (phase, kind, side), side ``activation`` or ``weight`` (a
    parameter, a tensor computed from parameters alone such as a slice of a fused weight, or
    the gradient of one): what Megatron's placement is checked against, 2 all-reduces of
    activations per dense transformer layer each way."""
    prog = plan.program
    names = plan.mesh.dim_names
    params = {n for n, t in prog.tensors.items() if t.kind in ("parameter", "optimizer_state")}
    from_params = set(params)
    for op in prog.ops:
        ins = op.input_names()
        if op.phase == "forward" and ins and all(n in from_params for n in ins):
            from_params.update(op.output_names())
    made = {o: op for op in prog.ops for o in op.output_names()}
    fwd = {op.name: op for op in prog.ops if op.phase == "forward" and op.name}
    out: dict[str, Counter[tuple[str, str, str]]] = {}
    for r, s in plan.collectives():
        if not any(names[d] == dim for d in s.mesh_dims):
            continue
        op = prog.ops[r.op_index]
        f = fwd.get(op.name[len("grad of "):]) if op.name.startswith("grad of ") and not r.output else None
        if f is not None and r.tensor.split(".grad")[0] in f.output_names():
            # the gradient of an op's output moved just before that op's own grad (the transpose
            # of a collective after the op: the embedding's reduce-scatter): the op's layer
            out.setdefault(f.layer or "", Counter())[(op.phase, s.kind, "activation")] += 1
            continue
        if not r.output and r.tensor in made and made[r.tensor].phase == op.phase:
            op = made[r.tensor]  # counted in the layer that made the tensor
            first = op.input_names()[0] if op.rule == "add_n" and op.input_names() else None
            if first in made and made[first].phase == op.phase:
                op = made[first]  # a sum of partial gradients: the layer that made them (a post-LN block's)
        side = "weight" if r.tensor.split(".grad")[0] in from_params else "activation"
        out.setdefault(op.layer or "", Counter())[(op.phase, s.kind, side)] += 1
    return out


__all__ = ["BLOCK", "BlockRoles", "Linear", "block_roles", "layer_collectives", "linears", "weight_of"]
