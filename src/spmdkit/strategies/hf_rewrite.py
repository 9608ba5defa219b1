"""What ``megatron`` rewrites in an imported program (:mod:`spmdkit.strategies.hf`): before
planning, the loss made vocab-parallel (Megatron's cross entropy), the vocab-parallel tables'
``padding_idx`` lookups, the fused column projections split into parameters of their own
(:func:`megatron_program`); after a first plan, the partial sums of an ``add_n`` regrouped and the
gradients held as their forward tensors (:func:`regroup_partial_sums`,
:func:`mirror_forward_layouts`). Standard library only."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.program.ir import Op, Program, Tensor
from spmdkit.program.plan import Plan
from spmdkit.strategies.hf_fused import namer, parts_as_parameters, rebuild, slices_as_split, split_fused_projections
from spmdkit.strategies.hf_patterns import tp_roles


def vocab_parallel_loss(prog: Program) -> Program:
    """A copy of ``prog`` whose hard-label ``cross_entropy_with_softmax`` ops (softmax over the
    last axis) and their grads are ``c_softmax_with_cross_entropy`` (and its grad) with the same
    ``ignore_index``: the same values, but the class axis may stay sharded. ``prog`` itself
    when it has none. An imported program's other fields (sources, loss, ...) are kept."""
    ops = list(prog.ops)
    changed = False
    for i, op in enumerate(ops):
        a = op.attrs
        hard = not a.get("soft_label", False) and a.get("use_softmax", True)
        x = op.inputs.get("x") if op.rule == "cross_entropy_with_softmax" else op.inputs.get("softmax")
        if not isinstance(x, str):
            continue
        nd = len(prog.tensors[x].shape)
        ax = int(a.get("axis", -1))
        if not hard or ax not in (-1, nd - 1):
            continue
        attrs = {"ignore_index": int(a.get("ignore_index", -100))}
        if op.rule == "cross_entropy_with_softmax":
            ops[i] = replace(op, rule="c_softmax_with_cross_entropy", attrs=attrs,
                             inputs={"x": x, "label": op.inputs["label"]})
            changed = True
        elif op.rule == "cross_entropy_with_softmax_grad":
            ops[i] = replace(op, rule="c_softmax_with_cross_entropy_grad", attrs=attrs,
                             inputs={"softmax": x, "label": op.inputs["label"], "loss_grad": op.inputs["loss_grad"]})
            changed = True
    if not changed:
        return prog
    return rebuild(prog, list(prog.tensors.values()), [(i, op) for i, op in enumerate(ops)])


def vocab_parallel_embedding(prog: Program, tables: Iterable[str]) -> Program:
    """A copy of ``prog`` whose ``embedding`` ops on ``tables`` with a ``padding_idx`` look up
    every row (``padding_idx=-1``: torch's forward, which does not zero the padding row) and
    whose ``embedding_grad`` ops on them mask the padding positions' output gradient instead
    (``full_like`` / ``not_equal`` / ``cast`` / ``unsqueeze`` / ``multiply``, then
    ``padding_idx=-1``): the same values, and the table may be vocab-sharded (the rule keeps a
    padded table's rows replicated). ``prog`` itself when no such op reads them."""
    tabs = set(tables)
    tensors = list(prog.tensors.values())
    names = set(prog.tensors)
    out: list[tuple[int | None, Op]] = []
    changed = False

    fresh = namer(names)

    for i, op in enumerate(prog.ops):
        pad = int(op.attrs.get("padding_idx", -1))
        w = op.inputs.get("weight")
        if op.rule not in ("embedding", "embedding_grad") or pad < 0 or w not in tabs:
            out.append((i, op))
            continue
        changed = True
        attrs = {**op.attrs, "padding_idx": -1}
        if op.rule == "embedding":
            out.append((i, replace(op, attrs=attrs)))
            continue
        ids, g = op.inputs["x"], op.inputs["out_grad"]
        it, gt = prog.tensors[ids], prog.tensors[g]
        kw = {"layer": op.layer, "phase": op.phase}
        full = fresh(f"{ids}.padding_idx")
        keep = fresh(f"{ids}.not_padding")
        keepf = fresh(f"{ids}.not_padding_f")
        keep1 = fresh(f"{ids}.not_padding_f1")
        masked = fresh(f"{g}.unpadded")
        tensors += [Tensor(full, it.shape, it.dtype), Tensor(keep, it.shape, "bool"),
                    Tensor(keepf, it.shape, gt.dtype), Tensor(keep1, (*it.shape, 1), gt.dtype),
                    Tensor(masked, gt.shape, gt.dtype, "gradient" if gt.kind == "gradient" else "activation")]
        out += [(None, Op("full_like", {"x": ids}, (full,), {"y": pad, "dtype": it.dtype}, name=full, **kw)),
                (None, Op("not_equal", {"x": ids, "y": full}, (keep,), {}, name=keep, **kw)),
                (None, Op("cast", {"x": keep}, (keepf,), {"dtype": gt.dtype}, name=keepf, **kw)),
                (None, Op("unsqueeze", {"x": keepf}, (keep1,), {"axis": (len(it.shape),)}, name=keep1, **kw)),
                (None, Op("multiply", {"x": g, "y": keep1}, (masked,), {}, name=masked, **kw)),
                (i, replace(op, inputs={**op.inputs, "out_grad": masked}, attrs=attrs))]
    if not changed:
        return prog
    return rebuild(prog, tensors, out)


def mirror_forward_layouts(plan: Plan, dims: Iterable[int]) -> dict[str, TensorDistAttr]:
    """Gradients to hold as their forward tensors are held over mesh dims ``dims`` (tp): where
    ``plan`` reduce-scatters a partial gradient ``X.grad`` onto an axis that ``X`` is whole on
    over those dims (DeepSeek's MLA: the rope key's one head, expanded to every head, its gradient
    a partial sum over the tp ranks' heads that a concat_grad would scatter over the batch), the
    gradient's layout is ``X``'s, so it is all-reduced, as Megatron's backward mirrors its forward
    and the batch is never cut over tp. Empty when there is none."""
    prog = plan.program
    want = set(dims)
    made = {o: i for i, op in enumerate(prog.ops) for o in op.output_names()}
    out: dict[str, TensorDistAttr] = {}
    for r in plan.reshards:
        if r.shared or not r.src.partial or not r.tensor.endswith(".grad"):
            continue
        fwd = r.tensor[:-len(".grad")]
        if fwd not in prog.tensors or prog.ops[made.get(fwd, 0)].phase != "forward" or fwd not in made:
            continue
        a = plan.attr(fwd)
        cut = {d for e in r.dst.dims_mapping for d in (e if isinstance(e, (list, tuple)) else (e,)) if d != -1}
        held = {d for e in a.dims_mapping for d in (e if isinstance(e, (list, tuple)) else (e,)) if d != -1}
        if (cut - held) & want and not a.partial:
            out[r.tensor] = TensorDistAttr(a.mesh, a.dims_mapping)
    return out


def regroup_partial_sums(prog: Program, plan: Plan) -> Program:
    """A copy of ``prog`` where an ``add_n`` that ``plan`` feeds two or more partial inputs
    (partial alike) and some that are not first sums the partial ones (one ``add_n``, still
    partial: one reduction where the rule would reduce each) and then adds the rest. BERT's
    post-LN backward: the q, k and v input gradients (partial over tp) meet the residual one
    (not partial) in one ``add_n``. ``prog`` itself when there is no such op. The sum is the
    same up to the order of floating-point additions."""
    out: list[tuple[int | None, Op]] = []
    tensors = list(prog.tensors.values())
    names = set(prog.tensors)
    changed = False
    for i, op in enumerate(prog.ops):
        ins = op.inputs.get("input")
        given = plan.ops[i].given.get("input") if op.rule == "add_n" else None
        if op.rule != "add_n" or not isinstance(ins, (list, tuple)) or not isinstance(given, tuple):
            out.append((i, op))
            continue
        part = [k for k, a in enumerate(given) if a is not None and a.partial]
        if part:
            ref = given[part[0]]
            part = [k for k in part if given[k] == ref]
        rest = [k for k in range(len(ins)) if k not in part]
        if len(part) < 2 or not rest:
            out.append((i, op))
            continue
        o = op.output_names()[0]
        t = prog.tensors[o]
        n, k = f"{o}.partial", 1
        while n in names:
            n, k = f"{o}.partial{k}", k + 1
        names.add(n)
        tensors.append(Tensor(n, t.shape, t.dtype, "gradient" if t.kind == "gradient" else "activation"))
        out.append((None, Op("add_n", {"input": tuple(ins[k] for k in part)}, (n,), {}, name=n, layer=op.layer,
                             phase=op.phase)))
        out.append((i, replace(op, inputs={**op.inputs, "input": (n, *(ins[k] for k in rest))})))
        changed = True
    if not changed:
        return prog
    return rebuild(prog, tensors, out)


def megatron_program(prog: Program, patterns: Mapping[str, str] | Iterable[tuple[str, str]] | None = None
                     ) -> Program:
    """``prog`` made ready for ``megatron``: its loss vocab-parallel
    (:func:`vocab_parallel_loss`), its vocab-parallel tables' ``padding_idx`` lookups
    rewritten (:func:`vocab_parallel_embedding`) and its fused column projections split
    (:func:`split_fused_projections`)."""
    roles = tp_roles(prog, patterns)
    vocab = [p for p, r in roles.items() if r == "vocab"]
    fused = [p for p, r in roles.items() if r == "column" and len(prog.tensors[p].shape) == 2]
    prog = vocab_parallel_embedding(vocab_parallel_loss(prog), vocab)
    prog = split_fused_projections(slices_as_split(prog, fused), fused)
    return parts_as_parameters(prog, [p for p, r in roles.items() if r == "column"])


__all__ = ["megatron_program", "mirror_forward_layouts", "regroup_partial_sums", "vocab_parallel_embedding",
           "vocab_parallel_loss"]
