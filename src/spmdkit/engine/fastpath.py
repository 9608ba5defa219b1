"""A compiled plan's fast path: straight-line Python for its common case (:func:`generate`,
written in named steps: the reads, the claims, the prunes, the answer), made a function by
:func:`spmdkit.engine.codegen.define`. The general path (:func:`spmdkit.engine.compiler.run`)
answers every case the code declines; tests/test_engine_compiled.py holds the two equal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spmdkit.core.dist_attr import ReduceType, TensorDistAttr
from spmdkit.engine.axes import largest_mesh_dim
from spmdkit.engine.codegen import define
from spmdkit.engine.plans import _ONE, RulePlan
from spmdkit.engine.tensors import attr_as

_make = TensorDistAttr._make


def fast_path(p: RulePlan, direction: str) -> Any:
    """The plan's fast path: its generated code, or for a big plan (more than :data:`_EAGER`
    axes) a stand-in that generates it on the plan's second use."""
    size = sum(len(a) for a in (*p.notation.inputs, *p.notation.outputs) if a)
    return generate(p, direction) if size <= _EAGER else _lazy(p, direction)


#: a plan labelling more axes than this generates its code on its second use, not when compiled:
#: compiling the straight-line code of a long list of tensors (an AMP op over a model's grads)
#: costs far more than the general path of the one call that may be all the plan ever answers
_EAGER = 96


def _lazy(p: RulePlan, direction: str) -> Any:
    """A stand-in for the generated code of a big plan: declines its first call (the general
    path answers it), generates the code on the second."""

    def first(inputs: Any, outputs: Any, mesh: Any, out_shapes: Any = None) -> None:
        p.fast = second
        return None

    def second(inputs: Any, outputs: Any, mesh: Any, out_shapes: Any = None) -> Any:
        p.fast = generate(p, direction)
        return p.fast(inputs, outputs, mesh, out_shapes)

    return first


def generate(p: RulePlan, direction: str, raw: bool = False) -> Any:
    """Straight-line Python for the plan's common case: every entry a single mesh dim (or a
    co-shard read as its largest), no two tensors sharding one letter differently (under
    ``conflict="first"`` the first simply wins), no two letters (nor, under ``unit_axes="claim"``,
    sharded size-1 axes) on one mesh dim (under ``order="claim"`` with no letter pruned, no flatten
    chain and ``taken`` other than "keep", the code drops such a mesh dim from the later claim
    itself, as :func:`run` does), no replicated
    letter sharded under ``replicated_claims="block"``. Then the order of resolution cannot
    matter and each letter prunes on its own. Any other case returns None: :func:`~spmdkit.engine.compiler.infer` takes
    the general path (:func:`~spmdkit.engine.compiler.run`), which answers it as the reference does.

    ``raw`` (forward only): ``fast(D, S, ms)`` on the inputs' dims_mappings, shapes and the
    mesh shape, returning ``((letter, mesh dims), ...)`` in the notation's letter order (what
    ``merge_letters`` answers), or None."""
    nt = p.notation
    align = p.conflict == 5
    if align and not raw and len({frozenset(a for a in ids if a >= 0) for _, ids in p.src}) > 1:
        return _decline  # conflict="align" on tensors of different letters: the general path
    forward = direction == "forward"
    lines = ["def fast(D, S, ms):"] if raw else ["def fast(I, O, mesh, Z=None):", "    ms = mesh.shape"]
    emit = lines.append
    # two letters on one mesh dim, resolved here in claim order (P: where a letter was first
    # sharded) where no letter prunes; otherwise the general path resolves them
    resolve = (p.order_kind == 0 and not p.unit and not p.taken_keep and not p.chains
               and not any(p.prune[a] for a in range(p.n) if not p.rep[a]))
    read: set[int] = set()  # the letters read
    units: list[str] = []  # unit_axes="claim": the mesh dim of each size-1 axis
    twice = _gen_reads(p, forward, raw, resolve, read, units, emit)
    ent = _gen_chains(p, forward, read, emit) if p.chains and not raw else set()
    live = _gen_claims(p, raw, resolve, read, units, twice, emit)
    _gen_prunes(p, raw, read, live, ent, emit)
    if raw:
        emit("    return (" + "".join(f"({c!r}, () if L{a} < 0 else _ONE[L{a}]), " for a, c in enumerate(nt.letters)) + ")")
        return _fast_fn(lines, f"plan {nt!r} letters", {})
    return _gen_answer(p, forward, ent, lines, f"plan {nt!r} {direction}")


def _gen_reads(p: RulePlan, forward: bool, raw: bool, resolve: bool, read: set[int], units: list[str],
               emit: Callable[[str], None]) -> bool:  # fmt: skip
    """The generated reads of the merged tensors' entries: ``L{a}`` per letter read (added to
    ``read``), the size-1 axes' ``U{k}`` (``units``), their agreement, ``P{a}`` where the claims
    are resolved here. Returns whether a letter is read on two axes (two claims can then share a
    mesh dim)."""
    align = p.conflict == 5
    src_name = "I" if forward else "O"
    twice = False
    pos = 0
    for ti, ids in p.src:
        if raw:
            emit(f"    d{ti} = D[{ti}]")
            emit(f"    s{ti} = S[{ti}]")
            emit(f"    if d{ti} is None or s{ti} is None: return None")
        else:
            emit(f"    t = {src_name}[{ti}]")
            emit("    if t is None: return None")
            emit(f"    d{ti} = t.dist_attr.dims_mapping")
            if align or p.keep_partial:  # a partial tensor: the general path
                emit("    if t.dist_attr.partial: return None")
        emit(f"    if len(d{ti}) != {len(ids)}: return None")
        if not p.sizes_known and not raw:
            emit(f"    s{ti} = t.shape")
        for i, a in enumerate(ids):
            if a < 0 and align:  # a sharded size-1 axis may move a mesh dim: the general path
                emit(f"    if d{ti}[{i}] != -1: return None")
                continue
            if a < 0:
                if p.unit:
                    var = f"U{len(units)}"
                    units.append(var)
                    emit(f"    {var} = d{ti}[{i}]")
                    emit(f"    if {var}.__class__ is not int:")
                    emit(f"        {var} = _largest({var}, ms)" if p.largest else "        return None")
                continue
            twice = twice or a in read
            var = f"L{a}" if a not in read else "e"
            emit(f"    {var} = d{ti}[{i}]")
            emit(f"    if {var}.__class__ is not int:")
            emit(f"        {var} = _largest({var}, ms)" if p.largest else "        return None")
            if a in read and align:  # every tensor places every mesh dim alike
                emit(f"    if e != L{a}: return None")
            elif a in read:
                emit("    if e != -1:")
                emit(f"        if L{a} == -1: L{a} = e" + (f"; P{a} = {pos}" if resolve else ""))
                if p.conflict != 1:
                    emit(f"        elif e != L{a}: return None")
            elif resolve:
                emit(f"    P{a} = {pos}")
            pos += 1
            read.add(a)
    return twice


def _gen_claims(p: RulePlan, raw: bool, resolve: bool, read: set[int], units: list[str], twice: bool,
                emit: Callable[[str], None]) -> list[int]:  # fmt: skip
    """The generated code emptying the replicated letters, then checking (or, with ``resolve``,
    resolving in claim order) that no two claimers take one mesh dim. Returns the live letters."""
    for a in sorted(read):
        if p.rep[a]:
            if p.block:
                emit(f"    if L{a} != -1: return None")
            emit(f"    L{a} = -1")
    live = [a for a in sorted(read) if not p.rep[a]]
    # no two claimers (letters, size-1 axes) on one mesh dim: the claim order cannot matter
    claimers = [f"L{a}" for a in live] + units
    # one merged tensor, each letter once: its (valid) dims_mapping never repeats a mesh dim
    if len(claimers) > 1 and not p.taken_keep and (raw or len(p.src) > 1 or twice or units):
        emit("    u = c = 0" if resolve else "    u = 0")
        for v in claimers:
            emit(f"    if {v} >= 0:")
            emit(f"        b = 1 << {v}")
            emit("        if u & b: " + ("c = 1" if resolve else "return None"))
            emit("        u |= b")
        if resolve:  # a mesh dim a letter claimed earlier is dropped from a later one
            emit("    if c:")
            emit(f"        Q = sorted([{', '.join(f'(P{a}, {k})' for k, a in enumerate(live))}])")
            emit(f"        V = [{', '.join(f'L{a}' for a in live)}]")
            emit("        u = 0")
            emit("        for _, k in Q:")
            emit("            x = V[k]")
            emit("            if x >= 0:")
            emit("                if (u >> x) & 1: V[k] = -1")
            emit("                else: u |= 1 << x")
            emit(f"        {', '.join(f'L{a}' for a in live)}, = V")
    return live


def _gen_prunes(p: RulePlan, raw: bool, read: set[int], live: list[int], ent: set[int],
                emit: Callable[[str], None]) -> None:  # fmt: skip
    """The generated code after the claims: a chain's other letters emptied, each pruned letter
    dropped where its mesh dim does not divide its size, the letters not read (or, backward, no
    input carries) emptied."""
    rest = [x for chain in p.chains for x in chain[1:] if x in read]
    if rest and not raw:  # a chain's other letters shard nothing (their mesh dims are its first's)
        emit("    " + " = ".join(f"L{x}" for x in rest) + " = -1")
    for a in live:
        if not p.prune[a]:
            continue
        srcs = p.size_src[a]
        emit(f"    if L{a} >= 0:")
        if p.sizes_known:
            # the first size >= 0 other than 1; else -1 where one is -1; else 1
            shape = "S[{}]" if raw else "I[{}].shape"
            for ti, _ in srcs:
                emit(f"        if {'S' if raw else 'I'}[{ti}] is None: return None")
            if not srcs:
                emit("        s = 1")
            for k, (ti, i) in enumerate(srcs):
                if k == 0:
                    emit(f"        s = {shape.format(ti)}[{i}]")
                    continue
                emit("        if s == 1 or s == -1:")
                emit(f"            v = {shape.format(ti)}[{i}]")
                emit("            if v >= 0 and v != 1: s = v")
                emit("            elif v == -1: s = -1")
        else:
            if not srcs:
                emit("        s = 1")
            for k, (ti, i) in enumerate(srcs):
                emit(f"        {'s' if k == 0 else '    s'} = s{ti}[{i}]" if k == 0 else f"        if s == 1: s = s{ti}[{i}]")
        cond = "s == 1" if p.uneven[a] else "s >= 0"
        emit(f"        if {cond} and s % ms[L{a}]: L{a} = -1")
    for a in range(p.n):
        if a not in read or (p.in_letters is not None and not p.in_letters[a]):
            emit(f"    L{a} = -1" + (f"; E{a} = -1" if a in ent else ""))
    for a in sorted(ent):  # a co-sharded chain letter making an output partial: the general path
        if any(m is not None and any(x == a for x, _ in m) for m in p.out_missing):
            emit(f"    if E{a}.__class__ is tuple: return None")


def _gen_answer(p: RulePlan, forward: bool, ent: set[int], lines: list[str], what: str) -> Any:
    """The generated answer of a (not raw) plan: one attr per input, then per output (partial
    over the mesh dims of the letters it lacks), and the function made of ``lines``."""
    emit = lines.append

    def dm(ids: tuple[int, ...]) -> str:
        return "(" + "".join(("-1" if a < 0 else f"E{a}" if a in ent else f"L{a}") + ", " for a in ids) + ")"


    # one attr per distinct (dims_mapping, no partial): an output sharded as an input is that
    # input's attr (dist attrs are immutable)
    plain: dict[str, str] = {}
    ins = []
    for j, in_ids in enumerate(p.in_axes):
        if in_ids is None:
            ins.append("None")
            continue
        # an absent tensor the notation labels (one the merge does not read): the attr it would need
        # (an earlier tensor's where it is labelled alike: dist attrs are immutable)
        key = dm(in_ids)
        absent = plain.get(key) or f"_make(mesh, {key})"
        emit(f"    i{j} = {absent} if I[{j}] is None else _attr_as(I[{j}].dist_attr, mesh, {key})")
        plain.setdefault(key, f"i{j}")
        ins.append(f"i{j}")
    outs = []
    consts: dict[str, Any] = {}
    for j, (out_ids, missing) in enumerate(zip(p.out_axes, p.out_missing)):
        if out_ids is None or missing is None:
            outs.append("None")
            continue
        ids = out_ids
        if not missing:
            if not forward:
                emit(f"    if O[{j}] is None: return None")
                outs.append(f"_attr_as(O[{j}].dist_attr, mesh, {dm(ids)})")
            elif dm(ids) in plain:
                outs.append(plain[dm(ids)])
            else:
                emit(f"    o{j} = _make(mesh, {dm(ids)})")
                plain[dm(ids)] = f"o{j}"
                outs.append(f"o{j}")
            continue
        if len(missing) == 1:
            a, r = missing[0]
            consts[f"R{j}_0"] = r
            pt = f"(((L{a}, R{j}_0),) if L{a} >= 0 else ())"
        else:
            emit(f"    pt{j} = []")
            for k, (a, r) in enumerate(missing):
                consts[f"R{j}_{k}"] = r
                emit(f"    if L{a} >= 0: pt{j}.append((L{a}, R{j}_{k}))")
            emit(f"    pt{j}.sort(key=_first)")
            pt = f"_uniq(pt{j})" if p.taken_keep else f"tuple(pt{j})"
        outs.append(f"_make(mesh, {dm(ids)}, {pt})")
    emit(f"    return ({''.join(x + ', ' for x in ins)}), ({''.join(x + ', ' for x in outs)})")
    return _fast_fn(lines, what, consts)


def _gen_chains(p: RulePlan, forward: bool, read: set[int], emit: Any) -> set[int]:
    """The generated code of the plan's ``flatten`` chains (after the reads): each chain's first
    letter's entry ``E{a}`` (a mesh dim or a co-shard tuple); ``L{a}`` stays its first mesh dim
    and the other letters keep theirs for the claim check, then shard nothing. A chain with a
    replicated letter or a pruned first letter declines where its first letter is sharded.
    Returns the letters with an ``E`` variable (the caller empties the others after the claim
    check)."""
    ent: set[int] = set()
    n_in = len(p.notation.inputs)
    # the merged tensors' shapes are read already (s{ti}; their tensors checked not None)
    merged = {ti if forward else n_in + ti for ti, _ in p.src} if not p.sizes_known else set()
    for chain, where in zip(p.chains, p.chain_src):
        a = chain[0]
        if a not in read:
            continue
        if p.rep[a] or p.prune[a] or any(p.rep[x] for x in chain[1:] if x in read):
            emit(f"    if L{a} >= 0: return None")
            continue
        ent.add(a)
        emit(f"    E{a} = L{a}")
        emit(f"    if L{a} >= 0:")
        sizes = []
        for k, (ti, i) in enumerate(where):
            if ti in merged:
                sizes.append(f"s{ti if forward else ti - n_in}[{i}]")
            elif ti < n_in:
                t = f"I[{ti}]"
                emit(f"        if {t} is None: return None")
                sizes.append(f"{t}.shape[{i}]")
            elif forward:
                t = f"Z[{ti - n_in}]"
                emit(f"        if Z is None or {t} is None: return None")
                sizes.append(f"{t}[{i}]")
            else:
                t = f"O[{ti - n_in}]"
                emit(f"        if {t} is None: return None")
                sizes.append(f"{t}.shape[{i}]")
            emit(f"        z{k} = {sizes[-1]}")
        fail = " or ".join(f"(z{k} >= 0 and z{k} % q)" for k in range(len(sizes))) or "False"
        emit(f"        q = ms[L{a}]")
        emit(f"        if {fail}: E{a} = L{a} = -1")
        ind = "        "
        got = [f"L{a}"]
        for x in chain[1:]:
            if x not in read:
                break
            emit(f"{ind}{'elif' if len(got) == 1 else 'if'} L{x} >= 0:")
            ind += "    "
            emit(f"{ind}q *= ms[L{x}]")
            emit(f"{ind}if not ({fail}):")
            ind += "    "
            got.append(f"L{x}")
            emit(f"{ind}E{a} = ({', '.join(got)})")
    return ent


def _fast_fn(lines: list[str], name: str, consts: dict[str, Any]) -> Any:
    """The function ``fast`` the generated ``lines`` define."""
    ns: dict[str, Any] = {"_attr_as": attr_as, "_make": _make, "_largest": largest_mesh_dim, "_first": _first,
                          "_ONE": _ONE, "_uniq": _uniq, **consts}  # fmt: skip
    return define("\n".join(lines), name, "fast", ns)


def _decline(*args: Any) -> None:
    """A plan's fast path that answers no case (the general path answers all)."""
    return None


def _first(t: tuple[int, ReduceType]) -> int:
    return t[0]


def _uniq(pt: list[tuple[int, ReduceType]]) -> tuple[tuple[int, ReduceType], ...]:
    """A sorted partial with each mesh dim once (``taken="keep"``: letters may share one)."""
    return tuple(t for i, t in enumerate(pt) if i == 0 or pt[i - 1][0] != t[0])


__all__ = ["fast_path", "generate"]
