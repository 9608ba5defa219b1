"""What an imported program says about itself, read by the strategies on imported programs
(:mod:`spmdkit.strategies.hf`) and by the exports: the inputs the call feeds, the parameters and
their optimizer's tensors, a parameter's module paths, the forward ops reading each tensor, and
how a weight is read (a linear's output / input feature axes, a table) and into how many heads a
column layer's output is split. Standard library only."""

from __future__ import annotations

import re
from collections import Counter

from spmdkit.program.ir import Op, Program
from spmdkit.strategies.hf_fused import fused_parts


def data_inputs(prog: Program) -> list[str]:
    """The inputs fed by the call: an :class:`ImportedProgram`'s ``input`` sources. For a plain
    program (a program JSON), the ``input`` tensors that lead with the batch: not recorded
    constants (``const_N``), gradient seeds or the learning rate, and of the most common
    leading size among those of rank 2 or more (rank 1 only for integer tensors, class
    labels): a buffer recorded as an input (a rotary table) is left out."""
    sources = getattr(prog, "sources", None)
    if sources:
        return [n for n, (kind, _) in sources.items() if kind == "input" and n in prog.tensors]
    made = {n for op in prog.ops for n in op.output_names()}
    cands = [t for t in prog.tensors.values()
             if t.kind == "input" and t.shape and t.name not in made and not re.fullmatch(r"const_\d+", t.name)
             and not t.name.endswith(".grad") and t.name != "learning_rate"]
    lead = Counter(t.shape[0] for t in cands if len(t.shape) >= 2)
    if not lead:
        return []
    batch = lead.most_common(1)[0][0]
    return [t.name for t in cands if t.shape[0] == batch
            and (len(t.shape) >= 2 or t.dtype.startswith(("int", "uint")))]


def parameters(prog: Program) -> list[str]:
    """The program's parameters (not their updated copies)."""
    return [t.name for t in prog.tensors.values() if t.kind == "parameter" and not t.inplace_of]


def optimizer_of(prog: Program) -> dict[str, tuple[str, tuple[str, ...], str, tuple[str, ...]]]:
    """parameter -> (grad, states, updated parameter, updated states): an imported program's
    ``optimizer``, else read from the optimizer ops (``param``, ``grad``, the inputs of kind
    ``optimizer_state`` shaped as the parameter, and the outputs that overwrite them)."""
    opt = getattr(prog, "optimizer", None)
    if opt:
        return dict(opt)
    out: dict[str, tuple[str, tuple[str, ...], str, tuple[str, ...]]] = {}
    for op in prog.ops:
        if op.phase != "optimizer" or not isinstance(op.inputs.get("param"), str):
            continue
        p = op.inputs["param"]
        g = op.inputs.get("grad")
        shape = prog.tensors[p].shape
        states = tuple(n for n in op.input_names() if prog.tensors[n].kind == "optimizer_state"
                       and prog.tensors[n].shape == shape)
        by_src = {prog.tensors[n].inplace_of: n for n in op.output_names() if prog.tensors[n].inplace_of}
        new = by_src.get(p)
        if not isinstance(g, str) or new is None:
            continue
        out[p] = (g, states, new, tuple(by_src[s] for s in states if s in by_src))
    return out


def module_paths(prog: Program, param: str) -> list[str]:
    """The module paths a parameter goes by: its own and those of its tied aliases (a part of
    a fused parameter: the fused one's)."""
    part = fused_parts(prog).get(param)
    if part is not None:
        param = part.source
    names = [param] + [a for a, t in (getattr(prog, "aliases", None) or {}).items() if t == param]
    return [n.rsplit(".", 1)[0] if "." in n else n for n in names]


def forward_readers(prog: Program) -> dict[str, list[tuple[int, Op, str]]]:
    """Per tensor name: the forward ops reading it as (op index, op, input slot)."""
    out: dict[str, list[tuple[int, Op, str]]] = {}
    for i, op in enumerate(prog.ops):
        if op.phase != "forward":
            continue
        for p, v in op.inputs.items():
            if isinstance(v, str):
                out.setdefault(v, []).append((i, op, p))
    return out


def output_heads(prog: Program, readers: dict[str, list[tuple[int, Op, str]]], out: str, features: int) -> int | None:
    """The head count a column layer's output ``out`` is reshaped into (``[..., heads, d]``
    with ``heads * d == features``), following a bias add; None when it is not."""
    frontier = [out]
    for _ in range(4):
        nxt: list[str] = []
        for n in frontier:
            for _i, op, _p in readers.get(n, []):
                o = op.output_names()
                if not o:
                    continue
                shape = prog.tensors[o[0]].shape
                if op.rule == "reshape" and len(shape) >= len(prog.tensors[n].shape) >= 2 \
                        and prog.tensors[n].shape[-1] == features and shape[-1] * shape[-2] == features:
                    return shape[-2]
                if op.rule in ("add", "elementwise_add", "cast", "unsqueeze"):
                    nxt.append(o[0])
        frontier = nxt
    return None


def weight_axes(prog: Program, readers: dict[str, list[tuple[int, Op, str]]],
                 param: str) -> tuple[str, int, int, Op | None]:
    """(how the weight is read, output-feature axis, input-feature axis, the reading op):
    ``linear`` for a 2-D matmul ``y`` (the weight itself or its transpose: FalconLinear's
    ``x @ W.T``), ``embedding`` for a table; ``other`` otherwise."""
    t = prog.tensors[param]
    for _i, op, p in readers.get(param, []):
        if op.rule == "matmul" and p == "y" and len(t.shape) == 2:
            ty = bool(op.attrs.get("trans_y", False))
            return ("linear", 0 if ty else 1, 1 if ty else 0, op)
        if op.rule in ("embedding", "c_embedding") and p == "weight":
            return ("embedding", 1, 0, op)
    for _i, op, _p in readers.get(param, []):
        if op.rule == "transpose" and len(t.shape) == 2 and tuple(op.attrs.get("perm", ())) == (1, 0):
            for _j, mop, q in readers.get(op.output_names()[0], []):
                if mop.rule == "matmul" and q == "y":
                    ty = bool(mop.attrs.get("trans_y", False))  # axes of W.T: swapped back
                    return ("linear", 1 if ty else 0, 0 if ty else 1, mop)
    return ("other", -1, -1, None)


__all__ = ["data_inputs", "forward_readers", "module_paths", "optimizer_of", "output_heads", "parameters",
           "weight_axes"]
