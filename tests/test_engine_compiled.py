"""Compiled plans (spmdkit.engine.compiler) against the reference merge (spmdkit.engine.merge).

Every compiled plan must answer what the plain dict-based reference answers for its notation
and policy: on random notations and policies, on the notations the rules on the engine compile
(matmul, the norm family, softmax, the views, split / concat / stack, ...), and, for the default
policy, what merge_letters answers.
Seeded and bounded: a few thousand cases, a few seconds.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from spmdkit.core.dist_attr import ReduceType
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec
from spmdkit.engine.compiler import compile_plan, infer, merge_letters, run
from spmdkit.engine.dim_trans import reshape_links, view_plan
from spmdkit.engine.merge import BROADCAST, reference_merge
from spmdkit.engine.notation import Notation
from spmdkit.engine.plans import RulePlan
from spmdkit.ops import (
    amp,
    conv,
    default,
    elementwise,
    embedding,
    linalg,
    matmul,
    norm,
    optimizer,
    softmax,
    split_concat,
    transpose,
    view,
)
from spmdkit.ops import slice as slice_rules

MESHES = [(2,), (3,), (2, 2), (2, 3), (3, 2), (2, 4), (2, 2, 2), (1, 2), (2, 3, 2)]
SIZES = [1, 1, 2, 3, 4, 6, 8, 12, 5, -1, 0]


def _entry(rng: random.Random, ndim: int, used: set[int]) -> Any:
    free = [d for d in range(ndim) if d not in used]
    r = rng.random()
    if r < 0.4 or not free:
        return -1
    if r < 0.8 or len(free) < 2:
        d = rng.choice(free)
        used.add(d)
        return d
    pair = rng.sample(free, 2)
    used.update(pair)
    return tuple(pair)


def _mapping(rng: random.Random, n: int, mesh_ndim: int) -> tuple[Any, ...]:
    used: set[int] = set()
    return tuple(_entry(rng, mesh_ndim, used) for _ in range(n))


def _tensors(rng: random.Random, axes: tuple[str | None, ...], mesh_ndim: int) -> tuple[list[Any], list[Any]]:
    """Random dims_mappings and shapes for tensors labelled ``axes`` (one size per letter, some
    axes size 1, a few absent tensors)."""
    size = {c: rng.choice(SIZES) for a in axes if a for c in a}
    dms: list[Any] = []
    shapes: list[Any] = []
    for a in axes:
        if a is None or rng.random() < 0.05:
            dms.append(None)
            shapes.append(None)
            continue
        shapes.append(tuple(1 if c == BROADCAST or rng.random() < 0.15 else size[c] for c in a))
        dms.append(_mapping(rng, len(a), mesh_ndim))
    return dms, shapes


def _partials(rng: random.Random, dms: list[Any], mesh_ndim: int) -> list[Any]:
    """Random partial status (over mesh dims a tensor does not shard) for some tensors."""
    out: list[Any] = []
    kinds = [ReduceType.SUM, ReduceType.AVG, ReduceType.MAX]
    for dm in dms:
        if dm is None or rng.random() < 0.6:
            out.append(None if dm is None else ())
            continue
        used = {x for e in dm for x in ((e,) if isinstance(e, int) else e)}
        free = [d for d in range(mesh_ndim) if d not in used and rng.random() < 0.6]
        out.append(tuple((d, rng.choice(kinds[:1] if rng.random() < 0.5 else kinds)) for d in free))
    return out


def _random_notation(rng: random.Random) -> Notation:
    letters = "abcde"

    def tensor() -> str:
        return "".join(rng.sample(letters, rng.randint(0, 4))) + BROADCAST * rng.choice([0, 0, 1])

    ins = [tensor() for _ in range(rng.randint(1, 3))]
    outs = [tensor() for _ in range(rng.randint(1, 2))]
    seen = "".join(dict.fromkeys("".join(ins + outs).replace(BROADCAST, "")))
    pick = lambda: "".join(c for c in seen if rng.random() < 0.3)  # noqa: E731
    order: Any = rng.choice(["claim", "notation", "groups"])
    if order == "groups":
        a = pick()
        b = "".join(c for c in pick() if c not in a)
        order = ("*", ">" + b, a) if rng.random() < 0.5 else (a, "*")
    chains: list[str] = []  # flatten: disjoint letter strings
    free = list(seen)
    rng.shuffle(free)
    while free and rng.random() < 0.5:
        k = rng.randint(1, min(3, len(free)))
        chains.append("".join(free[:k]))
        free = free[k:]
    conflict = rng.choice(["weight", "first", "union", "replicate", "heaviest", "align"])
    if conflict == "align" and rng.random() < 0.5:  # concat-like: every input carries the same letters
        ins = [ins[0]] * len(ins)
        present = set("".join(ins + outs))
        chains = [c for c in ("".join(x for x in ch if x in present) for ch in chains) if c]
    return Notation(
        ins,
        outs,
        replicated=pick(),
        prune=rng.choice(["", "*", pick()]),
        coshard=rng.choice(["keep", "largest"]),
        conflict=conflict,
        order=order,
        replicated_claims=rng.choice(["drop", "block"]),
        uneven=pick(),
        size1_claims=pick(),
        sizes=rng.choice(["first", "known"]),
        unit_axes=rng.choice(["skip", "claim"]) if order == "claim" and conflict != "align" else "skip",
        taken=rng.choice(["dims", "letter", "keep"]),
        sources=None if rng.random() < 0.6 else [i for i in range(len(ins)) if rng.random() < 0.6],
        flatten=chains,
        partial=rng.choice(["replicate", "keep", "linear"]),
    )


def _check(p: RulePlan, direction: str, dms: list[Any], shapes: list[Any], mesh_shape: tuple[int, ...],
           pts: list[Any] | None = None) -> None:
    nt = p.notation
    n_in = len(nt.inputs)
    merged = slice(0, n_in) if direction == "forward" else slice(n_in, None)
    axes = (nt.inputs + nt.outputs)[merged]
    if direction == "forward" and nt.sources is not None:  # the other inputs are not merged
        axes = tuple(a if i in nt.sources else None for i, a in enumerate(axes))
    m_dms, m_shapes, m_pts = dms[merged], shapes[merged], None if pts is None else pts[merged]
    got = run(p, m_dms, m_shapes, shapes[:n_in], mesh_shape, shapes, m_pts)
    want = reference_merge(
        nt, axes, m_dms, m_shapes, mesh_shape, nt.inputs, shapes[:n_in], nt.inputs + nt.outputs, shapes, m_pts
    )
    for i, c in enumerate(nt.letters):
        assert got[i] == want.get(c, ()), (nt, direction, dms, shapes, mesh_shape, c, got, want)


def test_random_notations_and_policies() -> None:
    rng = random.Random(17)
    for _ in range(1500):
        nt = _random_notation(rng)
        mesh_shape = rng.choice(MESHES)
        dms, shapes = _tensors(rng, nt.inputs + nt.outputs, len(mesh_shape))
        pts = _partials(rng, dms, len(mesh_shape))
        for direction in ("forward", "backward"):
            _check(compile_plan(nt, direction), direction, dms, shapes, mesh_shape, pts)


def test_default_policy_is_merge_letters() -> None:
    rng = random.Random(3)
    for _ in range(1000):
        nt = _random_notation(rng)
        nt = Notation(nt.inputs, nt.outputs, replicated=nt.replicated, prune=nt.prune)
        mesh_shape = rng.choice(MESHES)
        dms, shapes = _tensors(rng, nt.inputs, len(mesh_shape))
        old = dict(merge_letters(nt.inputs, tuple(dms), tuple(shapes), nt.replicated, nt.prune, mesh_shape))
        new = reference_merge(nt, nt.inputs, dms, shapes, mesh_shape)
        assert {c: d for c, d in old.items() if d} == {c: d for c, d in new.items() if d}, (nt, dms, shapes)
        got = run(compile_plan(nt), dms, shapes, shapes, mesh_shape)
        assert {c: got[i] for i, c in enumerate(nt.letters) if got[i]} == {c: d for c, d in new.items() if d}


def _rule_plans() -> list[tuple[RulePlan, str]]:
    plans: list[tuple[RulePlan, str]] = []
    for nx in (1, 2, 3, 4):
        for ny in (1, 2, 3):
            for tx in (False, True) if nx > 1 else (False,):
                for ty in (False, True) if ny > 1 else (False,):
                    plans.append((compile_plan(matmul.notation(nx, ny, tx, ty)), "forward"))
                    plans.append((compile_plan(matmul.reverse_notation(nx, ny, tx, ty), "backward"), "backward"))
                    for mask in ((1, 0, 0), (0, 0, 0)):
                        plans.append((compile_plan(matmul.grad_notation(nx, ny, tx, ty, mask), "forward", mask), "forward"))
    for nd in (1, 2, 3, 4):
        for bna in range(nd + 1):
            for kind in ("ln", "ln_rev", "ln_grad"):
                p = compile_plan(norm.notation(kind, nd, bna, 1, -1), "backward" if kind.endswith("rev") else "forward")
                plans.append((p, "backward" if kind.endswith("rev") else "forward"))
        for kind in ("rms", "rms_rev", "rms_grad"):
            p = compile_plan(norm.notation(kind, nd, nd - 1, 1), "backward" if kind.endswith("rev") else "forward")
            plans.append((p, "backward" if kind.endswith("rev") else "forward"))
        for ux in range(1 << nd):
            for ny in range(nd + 1):
                uy = ux & ((1 << ny) - 1)
                plans.append((compile_plan(elementwise.binary_notation("forward", nd, ny, ux, uy)), "forward"))
                plans.append((compile_plan(elementwise.binary_notation("backward", nd, ny, ux, uy), "backward"), "backward"))
                plans.append((compile_plan(elementwise.binary_grad_notation(ny % 2 == 0, nd, nd, ny, ux, uy)), "forward"))
        plans.append((compile_plan(elementwise.unary_grad_notation(2, nd)), "forward"))
        plans.append((compile_plan(transpose.notation(nd, tuple(range(nd))[::-1])), "forward"))
        plans.append((compile_plan(transpose.notation(nd, tuple(range(nd))[::-1]), "backward"), "backward"))
        for axis in range(nd):
            plans.append((compile_plan(softmax.notation(nd, axis)), "forward"))
            plans.append((compile_plan(softmax.notation(nd, axis), "backward"), "backward"))
            plans.append((compile_plan(softmax.notation(nd, axis, grad=True)), "forward"))
    for nd in (1, 2, 3):  # slice.py: the fixed (sliced / tiled / broadcast) axes, new leading axes
        for fixed in ((), (0,), (nd - 1,)):
            for lead in (0, 2):
                for kind in ("copy", "copy_noy", "tile_grad", "expand", "expand_grad"):
                    plans.append((compile_plan(slice_rules.notation(kind, "keep", nd, fixed, (), lead)), "forward"))
                nt = slice_rules.notation("copy", "largest", nd, fixed, (), lead)
                plans.append((compile_plan(nt, "backward"), "backward"))
            plans.append((compile_plan(slice_rules.notation("slice_grad", "largest", nd, fixed, fixed[:1])), "forward"))
    # the declared policies conflict="heaviest" (default_data_parallel), taken="keep" (the AMP ops)
    # and the optimizers' vote over every answered tensor
    for ranks in ((2, 3), (1, 2, 0), (3,)):
        for how in ("forward", "backward"):
            plans.append((compile_plan(default.notation(how, ranks, (2, 1))), "forward"))
        for op in ("check_finite_and_unscale", "update_loss_scaling"):
            for reverse in (False, True):
                nt = amp.notation(op, reverse, ranks, *(1,) * (1 if op.startswith("check") else 4))
                plans.append((compile_plan(nt), "forward"))
    plans.append((compile_plan(optimizer.notation(2, 1, False, -2, -2, False, -1, False, True, False)), "forward"))
    plans.append((compile_plan(optimizer.notation(3, 1, False, -2, -2, True, -1, False)), "forward"))
    adam_rev = optimizer.notation(2, 1, True, 1, 1, True, 1, True, True, True, True, True, False, False, True)
    plans.append((compile_plan(adam_rev), "forward"))
    for a, b in (((6, 12, 48, 24), (1, 72, 48, 4, 6)), ((8, 16, 4), (512,)), ((4, 1, 8), (32,)), ((24,), (2, 3, 4)),
                 ((2, 3, 4), (6, 4)), ((1, 8), (8, 1))):  # the view rules' plans (and their reverse)
        for keep in (True, False):
            plans.append((view_plan(len(a), reshape_links(a, b), keep), "forward"))
            plans.append((view_plan(len(b), reshape_links(b, a), keep, True), "backward"))
        plans.append((compile_plan(view.grad_notation(len(b), reshape_links(b, a))), "forward"))
    # linalg: the gemm family on matmul's notations (the third tensor unlabelled), flpga, einsum_grad
    for nx, tx, ty in ((2, False, False), (3, True, False), (3, False, True)):
        for kind, direction in (("forward", "forward"), ("reverse", "backward")):
            plans.append((compile_plan(linalg.gemm_notation(kind, nx, 2, tx, ty, (0, 0)), direction, (0, 0)), direction))
        plans.append((compile_plan(linalg.gemm_notation("grad", nx, 2, tx, ty, (0, 0, 0, 0)), "forward", (0, 0, 0, 0)),
                      "forward"))
        plans.append((compile_plan(linalg.flpga_notation(nx, (0, 0)), "forward", (0, 0)), "forward"))
    plans.append((compile_plan(linalg.einsum_notation("ij,jk->ik", ((4, 6), (6, 8)), True, (2, -1))), "forward"))

    for nd in (1, 2, 3, 4):  # split_concat.py: pieces, reverse pieces, joins
        for axis in range(nd):
            for drop in (False, True):
                plans.append((compile_plan(split_concat.pieces(drop, drop and axis == 1, nd, axis)), "forward"))
                plans.append((compile_plan(split_concat.rejoin(drop, 3, nd, axis), "backward"), "backward"))
                plans.append((compile_plan(split_concat.unjoin(drop, 3, nd, axis, 2 * drop)), "forward"))
            for n in (1, 2, 3):
                for stack in (False, True):
                    plans.append((compile_plan(split_concat.join(stack, False, n, nd, axis, 0)), "forward"))
            plans.append((compile_plan(split_concat.join(False, False, 3, nd, axis, 2)), "forward"))
            plans.append((compile_plan(split_concat.join(False, True, 2, nd, axis, 0)), "forward"))
    return plans


def _conv_family_plans() -> list[tuple[RulePlan, str]]:
    """The plans of the conv family (convolutions, batch / group / instance norm, roi_align) and
    of embedding."""
    plans: list[tuple[RulePlan, str]] = []
    for kind in ("forward", "reverse", "grad"):
        d = "backward" if kind == "reverse" else "forward"
        for nsp in (2, 3):
            for cl in (False, True):
                for grouped in (False, True):
                    for tr in (False, True):
                        plans.append((compile_plan(conv.conv_notation(kind == "grad", nsp, tr, cl, grouped), d), d))
        for nd in (0, 1, 2, 3):
            for wf in (False, True):
                for rows in (False, True):
                    plans.append((compile_plan(embedding.notation(kind, wf, nd, rows), d), d))
    for s in (-1, 1):
        for b in (-1, 1):
            for nd in (2, 3, 4, 5):
                for ci in (1, nd - 1) if nd > 2 else (1,):
                    for kind in ("forward", "reverse", "grad"):  # forward / reverse: Way.tail, compiled forward
                        plans.append((compile_plan(conv.bn_notation(kind, nd, ci, s, b, (nd + ci) % 3 - 1)), "forward"))
                for kind in ("forward", "reverse", "grad"):
                    d = "backward" if kind == "reverse" else "forward"
                    plans.append((compile_plan(conv.gn_notation(kind, nd, s, b), d), d))
            for keep in ("ab", "a", "b", ""):
                plans.append((compile_plan(conv.in_notation(False, keep, s, b)), "forward"))
                plans.append((compile_plan(conv.in_notation(True, keep, s, b)), "forward"))
    for grad in (False, True):
        for boxes_num in (-1, 1):
            plans.append((compile_plan(conv.roi_notation(grad, boxes_num)), "forward"))
    return plans



def test_conv_family_plans_match_the_reference() -> None:
    """The conv family's and embedding's plans: the general path answers as the reference, the
    generated code (where it answers) as the general path."""
    rng = random.Random(29)
    plans = _conv_family_plans()
    answered = 0
    for _ in range(3000):
        p, direction = rng.choice(plans)
        got, general, dms, shapes, mesh_shape = _fast_and_general(rng, p, direction)
        _check(p, direction, dms, shapes, mesh_shape)
        if got is not None:
            answered += 1
            assert _attrs(got) == _attrs(general), (p.notation, direction, dms, shapes)
    assert answered > 1000

def test_rule_plans_match_the_reference() -> None:
    rng = random.Random(5)
    plans = _rule_plans()
    for _ in range(4000):
        p, direction = rng.choice(plans)
        mesh_shape = rng.choice(MESHES)
        dms, shapes = _tensors(rng, p.notation.inputs + p.notation.outputs, len(mesh_shape))
        _check(p, direction, dms, shapes, mesh_shape, _partials(rng, dms, len(mesh_shape)))


def _specs(mesh: ProcessMesh, dms: list[Any], shapes: list[Any], pts: list[Any] | None = None) -> list[DistTensorSpec | None]:
    pts = pts or [None] * len(dms)
    return [None if d is None else DistTensorSpec(list(s), mesh=mesh, dims_mapping=list(d), partial=pt)
            for d, s, pt in zip(dms, shapes, pts)]


def _attrs(res: Any) -> Any:
    return [[None if a is None else (a.dims_mapping, a.partial) for a in side] for side in res]


def _fast_and_general(
    rng: random.Random, p: RulePlan, direction: str, partial: bool = False
) -> tuple[Any, Any, list[Any], list[Any], Any]:
    """A random case of the plan (``partial``: with random partial tensors): the generated
    code's answer (None where it declines), the general path's (None for a backward case
    without outputs), the dims_mappings, the shapes and the mesh shape."""
    nt = p.notation
    mesh = ProcessMesh(list(rng.choice(MESHES)))
    dms, shapes = _tensors(rng, nt.inputs + nt.outputs, mesh.ndim)
    dms = [None if a is None else d for a, d in zip(nt.inputs + nt.outputs, dms)]
    specs = _specs(mesh, dms, shapes, _partials(rng, dms, mesh.ndim) if partial else None)
    ins, outs = specs[: len(nt.inputs)], specs[len(nt.inputs) :] if direction == "backward" else []
    if direction == "backward" and not any(outs):
        return None, None, dms, shapes, mesh.shape
    out_shapes = shapes[len(nt.inputs) :]
    general = infer(p, "op", ins, outs, mesh, fast=False, out_shapes=out_shapes)
    return p.fast(tuple(ins), tuple(outs), mesh, out_shapes), general, dms, shapes, mesh.shape


def test_generated_fast_path_equals_the_general_path() -> None:
    """The plans' generated code (infer's first try) answers as the general path, or declines."""
    rng = random.Random(11)
    plans = _rule_plans()
    answered = 0
    for i in range(2000):
        if i % 2:
            p, direction = rng.choice(plans)
        else:
            direction = rng.choice(["forward", "backward"])
            p = compile_plan(_random_notation(rng), direction)
        got, general, dms, shapes, mesh_shape = _fast_and_general(rng, p, direction, i % 4 == 2)
        if got is not None:
            answered += 1
            assert _attrs(got) == _attrs(general), (p.notation, direction, dms, shapes, mesh_shape)
    assert answered > 600  # the fast path answers most cases


def test_generated_fast_path_resolves_letters_on_one_mesh_dim() -> None:
    """Two letters sharded on one mesh dim, no letter pruned, claim order: the generated code
    drops the mesh dim from the later claim itself, as the general path does (embedding's ids
    and table rows on one mesh dim, say)."""
    rng = random.Random(23)
    resolved = 0
    for _ in range(3000):
        r = _random_notation(rng)
        nt = Notation(r.inputs, r.outputs, r.replicated, coshard=r.coshard, conflict=r.conflict,
                      replicated_claims=r.replicated_claims, taken=r.taken, sources=r.sources)  # fmt: skip
        direction = rng.choice(["forward", "backward"])
        got, general, dms, shapes, mesh_shape = _fast_and_general(rng, compile_plan(nt, direction), direction)
        if got is None:
            continue
        assert _attrs(got) == _attrs(general), (nt, direction, dms, shapes)
        first: dict[str, Any] = {}  # each letter's first sharded entry on the merged tensors
        for ti, (a, d) in enumerate(zip(nt.inputs if direction == "forward" else nt.outputs,
                                        dms[: len(nt.inputs)] if direction == "forward" else dms[len(nt.inputs) :])):
            if a is None or d is None or (direction == "forward" and nt.sources is not None and ti not in nt.sources):
                continue
            for c, e in zip(a, d):
                if c != BROADCAST and c not in nt.replicated and c not in first and e != -1:
                    first[c] = max(e, key=lambda x: mesh_shape[x]) if isinstance(e, tuple) else e
        resolved += len(set(first.values())) < len(first)
    assert resolved > 100

def test_matmul_coshard_union_through_infer() -> None:
    # x k on 0, y k on 1 -> k co-sharded over both, the larger mesh dim major; out partial
    m = ProcessMesh([3, 2])
    x = DistTensorSpec([6, 36], mesh=m, dims_mapping=[-1, 0])
    y = DistTensorSpec([36, 6], mesh=m, dims_mapping=[1, -1])
    p = compile_plan(matmul.notation(2, 2, False, False))
    ins, outs = infer(p, "matmul", (x, y), (), m)
    assert [a.dims_mapping for a in ins] == [(-1, (0, 1)), ((0, 1), -1)]  # type: ignore[union-attr]
    assert [d for d, _ in outs[0].partial] == [0, 1]  # type: ignore[union-attr]


def test_align_votes_per_mesh_dim() -> None:
    # concat on b: mesh dim 0 is contested (x0 shards a, x1 shards c): it goes to the letter
    # whose resharding moves fewer elements; mesh dim 1, SUM-partial on both, stays partial
    m = ProcessMesh([2, 4])
    p = compile_plan(Notation(["abc", "abc"], ["abc"], "b", conflict="align", partial="linear"))

    def dms(x1_shape: list[int]) -> Any:
        x0 = DistTensorSpec([8, 16, 8], mesh=m, dims_mapping=[0, -1, -1], partial={1: ReduceType.SUM})
        x1 = DistTensorSpec(x1_shape, mesh=m, dims_mapping=[-1, -1, 0], partial={1: ReduceType.SUM})
        ins, outs = infer(p, "concat", (x0, x1), (), m)
        assert all(a.partial == ((1, ReduceType.SUM),) for a in (*ins, *outs))  # type: ignore[union-attr]
        return [a.dims_mapping for a in (*ins, *outs)]  # type: ignore[union-attr]

    assert dms([8, 4, 8]) == [(0, -1, -1)] * 3  # x1 (local 128) is the cheaper to reshard on a
    assert dms([8, 64, 8]) == [(-1, -1, 0)] * 3  # x0 (local 512) is now the cheaper on c
    assert dms([1, 64, 8]) == [(-1, -1, 0)] * 3  # a smaller than mesh dim 0 on x1: never a


def test_bad_policy_value_rejected() -> None:
    with pytest.raises(ValueError, match="conflict"):
        Notation(["ab"], ["ab"], conflict="largest")
    with pytest.raises(ValueError, match="order"):
        Notation(["ab"], ["ab"], order="size")
    with pytest.raises(ValueError, match="share letters"):
        Notation(["ab"], ["ab"], order=(">ab", "b"))
    with pytest.raises(ValueError, match="sources"):
        Notation(["ab"], ["ab"], sources=[1])
    with pytest.raises(ValueError, match="claim order"):
        Notation(["ab"], ["ab"], unit_axes="claim", order="notation")
    for bad in (["ab", "b"], ["ax"], [""]):
        with pytest.raises(ValueError, match="flatten"):
            Notation(["ab"], ["a"], flatten=bad)
    with pytest.raises(ValueError, match="partial"):
        Notation(["ab"], ["ab"], partial="sum")
    with pytest.raises(ValueError, match="align"):
        Notation(["ab"], ["ab"], conflict="align", unit_axes="claim")


def test_flatten_chain_co_shards_the_run() -> None:
    """x [8, 16] flattened: the first axis takes both mesh dims where 8 divides by them; a
    run whose product does not divide the first axis's size (or the output's) stops before."""
    p = compile_plan(Notation(["ab"], ["a"], flatten=["ab"]))
    for mesh_shape, x_shape, out_size, want in (((2, 4), [8, 16], 128, (0, 1)), ((2, 8), [8, 16], 128, 0),
                                                 ((4, 2), [6, 16], 96, -1), ((2, 4), [8, 16], 2, 0)):
        m = ProcessMesh(list(mesh_shape))
        x = DistTensorSpec(x_shape, mesh=m, dims_mapping=[0, 1])
        for fast in (True, False):
            ins, outs = infer(p, "flatten", (x,), (), m, fast=fast, out_shapes=[(out_size,)])
            assert outs[0].dims_mapping == (want,), (mesh_shape, x_shape, out_size)  # type: ignore[union-attr]
            assert ins[0].dims_mapping == (want, -1)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="out_shapes"):
        infer(p, "flatten", (x,), (), m)

def test_docs_rules_md_examples_run() -> None:
    """docs/rules.md is true: its Python example runs (its asserts hold) and the notations it
    spells out are those norm.py compiles."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "rules.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks
    for b in blocks:
        exec(compile(b, "docs/rules.md", "exec"), {})
    rev = Notation(["ab1", "1", "1"], ["abc", "ab", "ab"], replicated="c", replicated_claims="block",
                   coshard="largest")  # fmt: skip
    assert norm.notation("ln_rev", 3, 2, 1, 1) == rev
    assert norm.notation("ln_grad", 3, 2, 1, 1) == Notation(
        ["ab1", "1", "1", "ab", "ab", "ab1"], ["ab1", "1", "1"], coshard="largest"
    )


def test_rules_on_the_engine_are_answered_through_it() -> None:
    """Every mode of matmul, the norm family and softmax reaches a compiled plan (traced)."""
    from spmdkit.engine.compiler import traced
    from spmdkit.ops import get_rule, set_cache_enabled

    m = ProcessMesh([2, 2])

    def t(shape: list[int], dm: list[Any]) -> DistTensorSpec:
        return DistTensorSpec(shape, mesh=m, dims_mapping=dm)

    x3, w = t([4, 6, 8], [0, -1, 1]), t([8, 10], [1, -1])
    calls = [
        ("matmul", "forward", (x3, w)),
        ("matmul", "backward", (x3, w, t([4, 6, 10], [0, 1, -1]))),
        ("matmul_grad", "forward", (x3, w, t([4, 6, 10], [0, -1, -1]))),
        ("layer_norm", "forward", (x3, t([8], [-1]), None, 1e-5, 2)),
        ("layer_norm", "backward", (x3, None, None, x3, t([4, 6], [0, -1]), t([4, 6], [0, -1]), 1e-5, 2)),
        ("layer_norm_grad", "forward", (x3, None, None, t([4, 6], [0, -1]), t([4, 6], [0, -1]), x3, 1e-5, 2)),
        ("fused_rms_norm", "forward", (x3, t([8], [-1]), 1e-5)),
        ("fused_rms_norm", "backward", (x3, None, x3, t([4, 6], [0, -1]), 1e-5)),
        ("rms_norm_grad", "forward", (x3, None, t([4, 6], [0, -1]), x3, 1e-5)),
        ("softmax", "forward", (x3, -1)),
        ("softmax", "backward", (x3, x3, -1)),
        ("softmax_grad", "forward", (x3, x3, -1)),
        ("log_softmax", "forward", (x3, 1)),
        ("log_softmax_grad", "forward", (x3, x3, 0)),
    ]
    set_cache_enabled(False)
    try:
        for name, mode, args in calls:
            rule = get_rule(name)
            f = rule.infer_forward if mode == "forward" else rule.infer_backward
            with traced() as seen:
                f(*args)
            assert seen, f"{name} {mode} did not reach a compiled plan"
    finally:
        set_cache_enabled(True)


def test_forward_projection_equals_the_reference() -> None:
    """infer's general path projects the merged letters as the dict-based spec does: every
    output partial over each mesh dim of the letters it lacks once (``taken="keep"`` lets two
    letters share one), inputs without partial."""
    from spmdkit.engine.merge import partial_of, project

    rng = random.Random(23)
    checked = 0
    for _ in range(600):
        nt = _random_notation(rng)
        mesh = ProcessMesh(list(rng.choice(MESHES)))
        every, every_shapes = _tensors(rng, nt.inputs + nt.outputs, mesh.ndim)  # outputs: flatten sizes
        n = len(nt.inputs)
        dms = [None if a is None else d for a, d in zip(nt.inputs, every[:n])]
        shapes = every_shapes[:n]
        ins = _specs(mesh, dms, shapes)
        axes = tuple(a if nt.sources is None or i in nt.sources else None for i, a in enumerate(nt.inputs))
        want = reference_merge(nt, axes, dms, shapes, mesh.shape, nt.inputs, shapes, nt.inputs + nt.outputs, every_shapes)
        got_in, got_out = infer(compile_plan(nt), "op", ins, (), mesh, fast=False, out_shapes=every_shapes[n:])
        for a, attr in zip(nt.outputs, got_out):
            assert attr is not None and a is not None
            assert (attr.dims_mapping, attr.partial) == (project(a, want), partial_of(a, want, nt)), (nt, dms, shapes)
        for a, attr in zip(nt.inputs, got_in):
            assert attr is not None and a is not None
            assert (attr.dims_mapping, attr.partial) == (project(a, want), ())
        checked += 1
    assert checked == 600


def test_big_plan_generates_its_code_on_second_use() -> None:
    """A plan labelling more than ``_EAGER`` axes declines its first call (the general path
    answers), generates its code on the second, and that code answers as the general path."""
    from spmdkit.engine.fastpath import _EAGER

    rng = random.Random(29)
    n = _EAGER // 2 + 1  # 2-D tensors of their own letters: more than _EAGER axes
    letters = [chr(0x100 + 2 * i) + chr(0x101 + 2 * i) for i in range(n)]
    p = compile_plan(Notation(letters, [BROADCAST], taken="keep"))
    mesh = ProcessMesh([2, 4])
    dms = [_mapping(rng, 2, 2) for _ in range(n)]
    dms = [tuple(-1 if isinstance(e, tuple) else e for e in d) for d in dms]  # the generated code's case
    ins = _specs(mesh, dms, [(4, 8)] * n)
    general = infer(p, "op", ins, (), mesh, fast=False)
    assert p.fast(tuple(ins), (), mesh) is None
    got = p.fast(tuple(ins), (), mesh)
    assert got is not None and _attrs(got) == _attrs(general)
    assert _attrs(p.fast(tuple(ins), (), mesh)) == _attrs(general)
