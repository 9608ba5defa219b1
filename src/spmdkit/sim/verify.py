"""verify(rule, case, mode): is a rule's answer sound, numerically?

Run the rule; shard the global inputs as the rule requires (its returned input
dist attrs, partial included); run the op on every rank; assemble the outputs as
the rule claims; compare with the op run on the global inputs (float64,
allclose). A backward (reverse) answer is checked the same way: the op runs on
the inputs it returned and its outputs must come out as it returned them.

A NaN equals nothing: a NaN where the unsharded op gives a number is unsound, and an output
whose unsharded value itself has NaN proves nothing, so such a case is skipped ("not
checkable"), never counted sound. Infinities must match exactly (sign and position).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.registry import get_rule, rule_names
from spmdkit.io.codec import Case, decode_attr, encode_arg, parse_case
from spmdkit.sim.cases import generate_case, make_array, mode_reference
from spmdkit.sim.mesh import AssembleError, arrays_close, assemble, local_slices, shard
from spmdkit.sim.reference import Ctx, Reference

SOUND = "sound"
UNSOUND = "unsound"
REJECTED = "rejected"
SKIPPED = "skipped"

RTOL = 1e-6
ATOL = 1e-8


@dataclass
class Verdict:
    """The outcome of one verification.

    ``status``: sound / unsound / rejected (the rule raised an SpmdError) / skipped (no
    reference, or the case is outside what the reference can run). For unsound:
    ``output`` (index into the op's outputs, None when an input answer is at fault),
    ``ranks`` involved and ``detail`` (what differed).
    """

    status: str
    rule: str
    mode: str
    detail: str = ""
    output: int | None = None
    ranks: tuple[int, ...] = ()
    case: dict[str, Any] | None = None
    result: SpmdResult | None = None
    error: str | None = None

    @property
    def sound(self) -> bool:
        return self.status == SOUND

    def case_line(self) -> str:
        """The case as a runnable ``spmdkit infer`` line."""
        c = dict(self.case or {})
        c.pop("id", None)
        return "spmdkit infer '" + json.dumps(c, separators=(",", ":")) + "'"

    def describe(self) -> str:
        s = f"{self.rule} {self.mode}: {self.status}"
        if self.output is not None:
            s += f", output {self.output}"
        if self.ranks:
            s += f", ranks {list(self.ranks)}"
        if self.detail:
            s += f": {self.detail}"
        return s

    def __str__(self) -> str:
        return self.describe()


def _flat(xs: Iterable[Any]) -> list[Any]:
    out: list[Any] = []
    for x in xs:
        if isinstance(x, (tuple, list)):
            out.extend(x)
        else:
            out.append(x)
    return out


def _case_obj(case: Any, rule_name: str | None, mode: str | None) -> tuple[dict[str, Any] | None, Case]:
    if isinstance(case, Case):
        return None, case
    if isinstance(case, str):
        case = json.loads(case)
    obj = dict(case)
    if rule_name is not None and "rule" not in obj:
        obj["rule"] = rule_name
    if mode is not None:
        obj["mode"] = mode
    return obj, parse_case(obj)


def _rebuild_case(c: Case) -> dict[str, Any]:
    """A JSON case object from a decoded Case (for reporting)."""

    def t(v: Any) -> Any:
        if isinstance(v, DistTensorSpec):
            e = encode_arg(v.dist_attr)
            out = {"shape": list(v.shape), "dims_mapping": e["dims_mapping"]}
            if e["partial"]:
                out["partial"] = e["partial"]
            return out
        if isinstance(v, (list, tuple)) and v and all(x is None or isinstance(x, DistTensorSpec) for x in v):
            return [t(x) for x in v]
        if isinstance(v, tuple):
            return list(v)
        return v

    mesh: Any = list(c.mesh.shape)
    if c.mesh.process_ids != tuple(range(c.mesh.size)) or c.mesh.dim_names != tuple(
        f"d{i}" for i in range(c.mesh.ndim)
    ):
        mesh = {"shape": list(c.mesh.shape), "process_ids": list(c.mesh.process_ids),
                "dim_names": list(c.mesh.dim_names)}
    return {"rule": c.rule.name, "mesh": mesh, "mode": c.mode, "args": [t(a) for a in c.args]}


def _check_attr(a: Any, mesh: ProcessMesh, ndim: int, what: str) -> str | None:
    if not isinstance(a, TensorDistAttr):
        return f"{what}: expected a dist attr, got {a!r}"
    if a.mesh != mesh:
        return f"{what}: answered on mesh {a.mesh!r}, the case's mesh is {mesh!r}"
    try:
        TensorDistAttr(a.mesh, a.dims_mapping, dict(a.partial))
    except SpmdError as exc:
        return f"{what}: illegal dist attr {a!r}: {exc}"
    if len(a.dims_mapping) != ndim:
        return f"{what}: dims_mapping has {len(a.dims_mapping)} entries for a {ndim}-D tensor"
    return None


def verify(
    rule_name: str | None,
    case: Any,
    mode: str | None = None,
    *,
    seed: int = 0,
    rtol: float = RTOL,
    atol: float = ATOL,
    result: SpmdResult | dict[str, Any] | None = None,
) -> Verdict:
    """Verify one rule answer. ``case``: an INTERFACE.md case (dict, JSON text or a decoded
    :class:`~spmdkit.io.codec.Case`); ``rule_name`` / ``mode`` override the case's.
    ``result``: judge this answer instead of the rule's (to test the judge itself, or to
    judge another tool's answer): an SpmdResult or an INTERFACE.md result object."""
    try:
        obj, c = _case_obj(case, rule_name, mode)
    except SpmdError as exc:
        return Verdict(REJECTED, str(rule_name), str(mode or "forward"), detail=f"{type(exc).__name__}: {exc}",
                       case=case if isinstance(case, dict) else None, error=type(exc).__name__)
    if obj is None:
        obj = _rebuild_case(c)
    rule = c.rule
    md = c.mode
    if isinstance(result, dict):
        try:
            result = _decode_result(result, c.mesh)
        except SpmdError as exc:  # the answer judged is not even a legal dist attr
            return Verdict(UNSOUND, rule.name, md, detail=f"illegal dist attr in the answer: {exc}", case=obj)
    if result is None:
        try:
            result = c.run()
        except SpmdError as exc:
            return Verdict(REJECTED, rule.name, md, detail=f"{type(exc).__name__}: {exc}", case=obj,
                           error=type(exc).__name__)
    v = Verdict(SOUND, rule.name, md, case=obj, result=result)
    with np.errstate(all="ignore"):
        return _judge(v, c, result, seed, rtol, atol)


def _decode_result(obj: dict[str, Any], mesh: ProcessMesh) -> SpmdResult:
    def one(r: Any) -> Any:
        if isinstance(r, list):
            return [one(x) for x in r]
        return decode_attr(r, mesh)

    return SpmdResult([one(r) for r in obj.get("inputs", [])], [one(r) for r in obj.get("outputs", [])])


def _judge(v: Verdict, c: Case, result: SpmdResult, seed: int, rtol: float, atol: float) -> Verdict:
    """Judge ``result`` on case ``c``: the op run on the global arrays, then on every rank's
    shards as the answer lays them out, the ranks' outputs assembled as it claims and compared."""
    rule = c.rule
    ref, reverse = mode_reference(rule, c.mode)
    if ref is None:
        v.status, v.detail = SKIPPED, f"no numpy reference for {rule.name} ({c.mode})"
        return v
    op_args, tensor_params = _op_args(c, reverse)
    unknown = [n for n in tensor_params if n not in ref.tensor_params]
    missing = [n for n in ref.inputs if n not in op_args]
    if unknown or missing:
        v.status = SKIPPED
        v.detail = f"reference {ref.name} does not match the parameters (unknown {unknown}, missing {missing})"
        return v
    data_params = [n for n in tensor_params if n not in ref.spec_params]
    # -- the rule's input answers, aligned with the data tensors
    in_attrs = _align_inputs(list(result.inputs), tensor_params, data_params, op_args)
    if in_attrs is None:
        return _bad(v, f"the rule answered {len(result.inputs)} input dist attrs for {len(tensor_params)} tensor "
                       f"parameters ({', '.join(tensor_params)})")
    mesh = c.mesh
    nprng = np.random.default_rng(seed)
    # -- global arrays, and the op on them
    arrays, shapes = _global_arrays(ref, op_args, tensor_params, nprng)
    attrs = {k: a for k, a in op_args.items() if k not in tensor_params}
    gargs = {**attrs, **arrays}
    if ref.prepare is not None:
        try:
            ref.prepare(gargs)
        except Exception as exc:
            v.status, v.detail = SKIPPED, f"reference cannot prepare this case: {type(exc).__name__}: {exc}"
            return v
    outs_attr = _flat(result.outputs)
    out_ndims = tuple(a.ndim if isinstance(a, TensorDistAttr) else None for a in outs_attr)
    try:
        gouts = list(ref.run(gargs, Ctx(mesh, None, None, in_attrs, shapes, out_ndims, tuple(outs_attr))))
    except Exception as exc:
        v.status, v.detail = SKIPPED, f"reference cannot run this case: {type(exc).__name__}: {exc}"
        return v
    gouts = [None if o is None else np.asarray(o) for o in gouts]
    if len(outs_attr) != len(gouts):
        return _bad(v, f"the rule answered {len(outs_attr)} output dist attrs, the op has {len(gouts)} outputs")
    bad = _check_answers(v, mesh, in_attrs, gargs, data_params, outs_attr, gouts)
    if bad is not None:
        return bad
    # -- shard the inputs as the rule requires, run the op on every rank
    local = _shard_inputs(mesh, attrs, gargs, in_attrs, tensor_params, data_params, nprng)
    out_shapes = tuple(None if g is None else g.shape for g in gouts)
    louts: list[list[Any]] = []
    for r in range(mesh.size):
        ctx = Ctx(mesh, r, mesh.coords(r), in_attrs, shapes, out_ndims, tuple(outs_attr), out_shapes)
        try:
            o = list(ref.run(local[r], ctx))
        except Exception as exc:
            return _bad(v, f"the op fails on rank {r}'s local shards ({_shapes_text(local[r], data_params)}): "
                           f"{type(exc).__name__}: {exc}", ranks=(r,))
        louts.append(o)
    return _compare(v, mesh, outs_attr, gouts, louts, rtol, atol)


def _op_args(c: Case, reverse: bool) -> tuple[dict[str, Any], list[str]]:
    """The op's arguments by name, and its tensor parameters: a reverse (backward) case runs the
    forward op, on the forward's parameters (defaults where the case leaves them out)."""
    mode = c.rule.mode(c.mode)
    named = {p.name: a for p, a in zip(mode.params, c.args)}
    if not reverse:
        return dict(named), [p.name for p in mode.params if p.is_tensor]
    fwd = c.rule.forward
    op_args: dict[str, Any] = {}
    for p in fwd.params:
        if p.name in named:
            op_args[p.name] = named[p.name]
        elif not p.required:
            op_args[p.name] = p.default
    return op_args, [p.name for p in fwd.params if p.is_tensor]


def _global_arrays(ref: Reference, op_args: dict[str, Any], tensor_params: list[str],
                   nprng: np.random.Generator) -> tuple[dict[str, Any], dict[str, Any]]:
    """Global arrays (in the reference's value domains) and their shapes, per tensor parameter."""
    arrays: dict[str, Any] = {}
    shapes: dict[str, Any] = {}
    for n in tensor_params:
        spec = op_args.get(n)
        if spec is None:
            arrays[n], shapes[n] = None, None
        elif isinstance(spec, (list, tuple)):
            shapes[n] = [None if t is None else t.shape for t in spec]
            arrays[n] = [None if t is None else make_array(t.shape, ref.domain(n), nprng) for t in spec]
        else:
            shapes[n] = spec.shape
            arrays[n] = make_array(spec.shape, ref.domain(n), nprng)
    return arrays, shapes


def _check_answers(v: Verdict, mesh: ProcessMesh, in_attrs: dict[str, Any], gargs: dict[str, Any],
                   data_params: list[str], outs_attr: list[Any], gouts: list[Any]) -> Verdict | None:
    """The unsound verdict where an answer is no legal dist attr of its tensor's rank (or is
    missing for an output the op has); None when every answer is."""
    for n in data_params:
        a, arr = in_attrs[n], gargs[n]
        if arr is None:
            continue
        if isinstance(arr, list):
            if not isinstance(a, tuple) or len(a) != len(arr):
                return _bad(v, f"input {n!r}: expected {len(arr)} dist attrs, got {a!r}")
            for i, (ai, xi) in enumerate(zip(a, arr)):
                if xi is not None:
                    err = _check_attr(ai, mesh, np.ndim(xi), f"input {n!r}[{i}]")
                    if err:
                        return _bad(v, err)
        else:
            err = _check_attr(a, mesh, np.ndim(arr), f"input {n!r}")
            if err:
                return _bad(v, err)
    for k, (a, g) in enumerate(zip(outs_attr, gouts)):
        if g is None:
            continue
        if a is None:
            return _bad(v, f"output {k}: the op has this output but the rule answered none", output=k)
        err = _check_attr(a, mesh, g.ndim, f"output {k}")
        if err:
            return _bad(v, err, output=k)
    return None


def _shard_inputs(mesh: ProcessMesh, attrs: dict[str, Any], gargs: dict[str, Any], in_attrs: dict[str, Any],
                  tensor_params: list[str], data_params: list[str],
                  nprng: np.random.Generator) -> list[dict[str, Any]]:
    """Every rank's arguments: the attributes, its shards of the data tensors as the rule requires
    (output specs keep their global shapes)."""
    local: list[dict[str, Any]] = [dict(attrs) for _ in range(mesh.size)]
    for n in tensor_params:
        arr = gargs[n]
        if n not in data_params:  # output specs: global shapes only
            for r in range(mesh.size):
                local[r][n] = arr
            continue
        if arr is None:
            for r in range(mesh.size):
                local[r][n] = None
        elif isinstance(arr, list):
            vec: Any = in_attrs[n]
            per = [shard(x, ai, nprng) if x is not None else [None] * mesh.size for x, ai in zip(arr, vec)]
            for r in range(mesh.size):
                local[r][n] = [p[r] for p in per]
        else:
            one: Any = in_attrs[n]
            sh = shard(arr, one, nprng)
            for r in range(mesh.size):
                local[r][n] = sh[r]
    return local


def _compare(v: Verdict, mesh: ProcessMesh, outs_attr: list[Any], gouts: list[Any], louts: list[list[Any]],
             rtol: float, atol: float) -> Verdict:
    """Assemble every output from the ranks as the rule claims and compare it with the global op's."""
    uncheckable: list[str] = []
    for k, (a, g) in enumerate(zip(outs_attr, gouts)):
        if g is None:
            continue
        nan = _nan_count(g)
        if nan:  # NaN compares to nothing: this output proves nothing either way
            uncheckable.append(f"output {k} ({nan} of {g.size} values NaN)")
            continue
        pieces = [louts[r][k] for r in range(mesh.size)]
        if any(p is None for p in pieces):
            return _bad(v, f"output {k}: some ranks produced no value", output=k)
        try:
            got = assemble(pieces, a, g.shape, rtol=rtol, atol=atol)
        except AssembleError as exc:
            return _bad(v, f"output {k} ({_fmt_attr(a)}): {exc}", output=k, ranks=exc.ranks)
        if not arrays_close(got, g, rtol, atol):
            return _bad(v, f"output {k} ({_fmt_attr(a)}): {_first_diff(got, g, a)}", output=k,
                        ranks=_rank_of_diff(got, g, a))
    if uncheckable:
        v.status = SKIPPED
        v.detail = ("not checkable: the unsharded op gives NaN on these inputs, and a NaN equals nothing: "
                    + ", ".join(uncheckable))
    return v


def _nan_count(a: Any) -> int:
    x = np.asarray(a)
    return int(np.count_nonzero(np.isnan(x))) if x.dtype.kind in "fc" else 0


def _align_inputs(
    ins: list[Any], tensor_params: list[str], data_params: list[str], op_args: dict[str, Any]
) -> dict[str, Any] | None:
    """The rule's input answers per data tensor parameter. Vector arguments may come back as one
    tuple per parameter or flattened (one attr per tensor, as Paddle's variadic rules answer)."""
    def fits(params: list[str]) -> bool:
        return len(ins) == len(params) and all(
            isinstance(a, tuple) == isinstance(op_args.get(n), (list, tuple)) or op_args.get(n) is None
            for n, a in zip(params, ins)
        )

    if fits(tensor_params):
        return {n: a for n, a in zip(tensor_params, ins) if n in data_params}
    if fits(data_params):
        return dict(zip(data_params, ins))
    flat = _flat(ins)
    for params in (data_params, tensor_params):
        need = sum(len(op_args[n]) if isinstance(op_args.get(n), (list, tuple)) else 1 for n in params)
        if len(flat) == need:
            out: dict[str, Any] = {}
            i = 0
            for n in params:
                a = op_args.get(n)
                if isinstance(a, (list, tuple)):
                    out[n] = tuple(flat[i : i + len(a)])
                    i += len(a)
                else:
                    out[n] = flat[i]
                    i += 1
            return {n: out[n] for n in data_params}
    return None


def _fmt_attr(a: TensorDistAttr) -> str:
    s = "dims_mapping " + json.dumps(encode_arg(a)["dims_mapping"], separators=(",", ":"))
    if a.partial:
        s += " partial " + json.dumps(encode_arg(a)["partial"], separators=(",", ":"))
    return s


def _shapes_text(args: dict[str, Any], names: Sequence[str]) -> str:
    parts = []
    for n in names:
        x = args.get(n)
        if isinstance(x, list):
            parts.append(f"{n}={[None if t is None else list(np.shape(t)) for t in x]}")
        elif x is not None:
            parts.append(f"{n}={list(np.shape(x))}")
    return ", ".join(parts)


def _diff_index(got: np.ndarray, want: np.ndarray) -> tuple[int, ...] | None:
    try:
        bad = ~np.isclose(np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64),
                          rtol=RTOL, atol=ATOL, equal_nan=False)
    except (TypeError, ValueError):
        bad = np.asarray(got != want)
    idx = np.argwhere(bad)
    if idx.size == 0:
        return None if got.ndim else ()
    return tuple(int(i) for i in idx[0])


def _first_diff(got: np.ndarray, want: np.ndarray, a: TensorDistAttr) -> str:
    if got.shape != want.shape:
        return f"assembled shape {list(got.shape)}, the op gives {list(want.shape)}"
    i = _diff_index(got, want)
    if i is None:
        return "values differ"
    n = int(np.sum(~np.isclose(np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64),
                               rtol=RTOL, atol=ATOL, equal_nan=False))) if got.dtype != np.bool_ else int(
        np.sum(got != want))
    return (f"assembled value differs from the unsharded op at {n} of {got.size} positions; "
            f"first at index {list(i)}: got {got[i]!r}, expected {want[i]!r}")


def _rank_of_diff(got: np.ndarray, want: np.ndarray, a: TensorDistAttr) -> tuple[int, ...]:
    i = _diff_index(got, want) if got.shape == want.shape else None
    if i is None:
        return ()
    out = []
    for r in range(a.mesh.size):
        sl = local_slices(a, want.shape, a.mesh.coords(r))
        if all(s.start <= j < s.stop for s, j in zip(sl, i)):
            out.append(r)
    return tuple(out)


def _bad(v: Verdict, detail: str, output: int | None = None, ranks: Sequence[int] = ()) -> Verdict:
    v.status = UNSOUND
    v.detail = detail
    v.output = output
    v.ranks = tuple(ranks)
    return v


# -- many cases -------------------------------------------------------------------------------


@dataclass
class RuleReport:
    """Counts of one rule and mode over generated cases, and the first unsound verdict."""

    rule: str
    mode: str
    cases: int = 0
    sound: int = 0
    unsound: int = 0
    rejected: int = 0
    skipped: int = 0
    first_unsound: Verdict | None = None
    first_skipped: Verdict | None = None
    seconds: float = 0.0
    note: str = ""
    unsound_cases: list[Verdict] = field(default_factory=list)

    def add(self, v: Verdict) -> None:
        self.cases += 1
        if v.status == SOUND:
            self.sound += 1
        elif v.status == UNSOUND:
            self.unsound += 1
            if self.first_unsound is None:
                self.first_unsound = v
            self.unsound_cases.append(v)
        elif v.status == REJECTED:
            self.rejected += 1
        else:
            self.skipped += 1
            if self.first_skipped is None:
                self.first_skipped = v


def verify_rule(rule_name: str, n: int = 50, seed: int = 0, mode: str = "forward") -> RuleReport:
    """Verify ``n`` generated cases of one rule and mode."""
    rep = RuleReport(rule_name, mode)
    t0 = time.perf_counter()
    rule = get_rule(rule_name)
    if mode not in rule.modes:
        rep.note = "no such mode"
        return rep
    ref, _ = mode_reference(rule, mode)
    if ref is None:
        rep.note = "no numpy reference"
        return rep
    for i in range(n):
        case = generate_case(rule_name, mode, seed, i)
        if case is None:
            rep.note = "no case generator for its parameters"
            break
        rep.add(verify(rule_name, case, mode, seed=seed * 1_000_003 + i))
    rep.seconds = time.perf_counter() - t0
    return rep


def verifiable_rules(include_aliases: bool = False) -> list[str]:
    """Registered rule names (canonical by default) that have a numpy reference for some mode."""
    out = []
    for name in rule_names(include_aliases=include_aliases):
        rule = get_rule(name)
        if any(mode_reference(rule, m)[0] is not None for m in rule.modes):
            out.append(name)
    return out


__all__ = [
    "REJECTED",
    "SKIPPED",
    "SOUND",
    "UNSOUND",
    "RuleReport",
    "Verdict",
    "verifiable_rules",
    "verify",
    "verify_rule",
]
