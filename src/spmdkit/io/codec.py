"""The JSON case / result codec of INTERFACE.md (shared/INTERFACE.md)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spmdkit.core.dist_attr import ReduceType, TensorDistAttr
from spmdkit.core.errors import CaseFormatError, InternalError, SpmdError, UnsupportedModeError, bounded
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import ArgDistAttr, DistTensorSpec, SpmdResult
from spmdkit.engine.registry import Rule, get_rule
from spmdkit.engine.signature import Mode


@dataclass(frozen=True)
class Case:
    """One decoded case: the rule, the mode and the bound positional arguments."""

    rule: Rule
    mode: str
    mesh: ProcessMesh
    args: tuple[Any, ...]
    id: Any = None

    def run(self) -> SpmdResult:
        return self.rule.infer(self.mode, *self.args)


def parse_mesh(obj: Any) -> ProcessMesh:
    if isinstance(obj, list):
        return ProcessMesh(obj)
    if isinstance(obj, dict):
        unknown = set(obj) - {"shape", "process_ids", "dim_names"}
        if unknown:
            raise CaseFormatError(f"mesh: unknown field(s) {_short(sorted(unknown))}")
        if "shape" not in obj:
            raise CaseFormatError("mesh: an object mesh needs a 'shape'")
        return ProcessMesh(obj["shape"], obj.get("process_ids"), obj.get("dim_names"))
    raise CaseFormatError(f"mesh must be a list of sizes or an object, got {_short(obj)}")


def parse_partial(obj: Any, where: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, list):
        return obj
    if isinstance(obj, dict):
        return {k: v for k, v in obj.items()}
    raise CaseFormatError(f"{where}: partial must be a list of mesh dims or an object, got {_short(obj)}")


def parse_tensor(obj: Any, mesh: ProcessMesh, where: str) -> DistTensorSpec:
    if not isinstance(obj, dict) or "shape" not in obj:
        raise CaseFormatError(f"{where}: a tensor must be an object with a 'shape', got {_short(obj)}")
    unknown = set(obj) - {"shape", "dims_mapping", "partial"}
    if unknown:
        raise CaseFormatError(f"{where}: unknown tensor field(s) {_short(sorted(unknown))}")
    shape = obj["shape"]
    if not isinstance(shape, list):
        raise CaseFormatError(f"{where}: shape must be a list of ints, got {_short(shape)}")
    dm = obj.get("dims_mapping")
    if dm is None:
        dm = [-1] * len(shape)
    if not isinstance(dm, list):
        raise CaseFormatError(f"{where}: dims_mapping must be a list, got {_short(dm)}")
    try:
        attr = TensorDistAttr(mesh, dm, parse_partial(obj.get("partial"), where))
        return DistTensorSpec(shape, attr)
    except SpmdError as exc:
        raise type(exc)(f"{where}: {exc}") from None


def decode_args(rule: Rule, mode: Mode, mesh: ProcessMesh, raw: list[Any]) -> tuple[Any, ...]:
    params = mode.params
    if len(raw) > len(params):
        raise CaseFormatError(
            f"{rule.name}: {len(raw)} args given, the {_mode_name(rule, mode)} rule takes at most "
            f"{len(params)} ({mode.describe()})"
        )
    out: list[Any] = []
    for p, a in zip(params, raw):
        where = f"{rule.name}: argument {p.name!r}"
        if p.kind in ("T", "T?"):
            if a is None:
                out.append(None)
            else:
                out.append(parse_tensor(a, mesh, where))
        elif p.kind in ("[T]", "[T?]"):
            if not isinstance(a, list):
                raise CaseFormatError(f"{where}: must be a list of tensors, got {_short(a)}")
            out.append(
                [None if t is None else parse_tensor(t, mesh, f"{where}[{i}]") for i, t in enumerate(a)]
            )
        else:
            out.append(a)
    return tuple(out)


def _mode_name(rule: Rule, mode: Mode) -> str:
    return "forward" if mode is rule.forward else "backward"


#: The keys a case may have (INTERFACE.md); any other key is a CaseFormatError naming it.
CASE_KEYS = ("id", "rule", "mesh", "mode", "args")


def parse_case(obj: Any) -> Case:
    """Decode one case object (already parsed from JSON)."""
    if not isinstance(obj, dict):
        raise CaseFormatError(f"a case must be a JSON object, got {_short(obj)}")
    for key in obj:
        if key not in CASE_KEYS:
            raise CaseFormatError(f"case has an unknown key {_short(key)} (known: {', '.join(CASE_KEYS)})")
    for key in ("rule", "mesh"):
        if key not in obj:
            raise CaseFormatError(f"case has no {key!r}")
    name = obj["rule"]
    if not isinstance(name, str):
        raise CaseFormatError(f"rule must be a string, got {_short(name)}")
    rule = get_rule(name)
    mode_name = obj.get("mode", "forward")
    if mode_name is None:  # (it read as the mode 'None')
        raise UnsupportedModeError(f"{name}: mode is null: 'forward' or 'backward' (or no 'mode' key: forward)")
    mode = rule.mode(mode_name)
    mesh = parse_mesh(obj["mesh"])
    raw = obj.get("args", [])
    if not isinstance(raw, list):
        raise CaseFormatError(f"args must be a list, got {_short(raw)}")
    return Case(rule, mode_name, mesh, decode_args(rule, mode, mesh, raw), obj.get("id"))


def encode_entry(e: Any) -> Any:
    return list(e) if isinstance(e, tuple) else e


def encode_attr(a: TensorDistAttr | None) -> Any:
    if a is None:
        return None
    return {
        "dims_mapping": [encode_entry(e) for e in a.dims_mapping],
        "partial": {str(d): r.value for d, r in a.partial},
    }


def encode_arg(a: ArgDistAttr) -> Any:
    if isinstance(a, tuple):
        return [encode_attr(x) for x in a]
    return encode_attr(a)


def encode_result(result: SpmdResult, case_id: Any = None) -> dict[str, Any]:
    return {
        "id": case_id,
        "inputs": [encode_arg(a) for a in result.inputs],
        "outputs": [encode_arg(a) for a in result.outputs],
    }


def encode_error(exc: BaseException, case_id: Any = None) -> dict[str, Any]:
    if not isinstance(exc, SpmdError):
        exc = InternalError(f"{type(exc).__name__}: {_str(exc)}")
    return {"id": case_id, "error": type(exc).__name__, "message": bounded(_str(exc))}


def _str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return f"<{type(exc).__name__}>"


def _short(v: Any) -> str:
    try:
        s = repr(v)
    except Exception:
        s = f"<{type(v).__name__}>"
    return s if len(s) <= 80 else s[:77] + "..."


def answer_line(line: str | bytes) -> dict[str, Any]:
    """Answer one input line of ``infer --batch``: a result or an error object, never raises
    (an exception that is not an SpmdError becomes an InternalError naming its type)."""
    case_id: Any = None
    try:
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise CaseFormatError(
                    f"line is not valid UTF-8 (byte {exc.object[exc.start]:#04x} at offset {exc.start})"
                ) from None
        if not line.strip():
            raise CaseFormatError("blank line: expected one case as a JSON object")
        try:
            obj = json.loads(line, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            raise CaseFormatError(f"line is not valid JSON: {_str(exc)}") from None
        if isinstance(obj, dict):
            case_id = obj.get("id")
        case = parse_case(obj)
        return encode_result(case.run(), case_id)
    except RecursionError:
        return encode_error(CaseFormatError("case is nested too deeply"), case_id)
    except Exception as exc:
        return encode_error(exc, case_id)


def echo_id(case_id: Any) -> Any:
    """``case_id`` if it can be written as strict JSON; else its JSON text with non-finite numbers
    (``1e400`` decodes to infinity: echoed as the string ``"Infinity"``); else ``None``."""
    try:
        json.dumps(case_id, allow_nan=False)
        return case_id
    except Exception:
        pass
    try:
        return json.dumps(case_id, allow_nan=True)
    except Exception:
        return None


def answer_text(line: str | bytes) -> str:
    """One output line of ``infer --batch`` for one input line (without the newline); never raises."""
    ans = answer_line(line)
    try:
        return dumps(ans)
    except Exception:
        pass
    ans["id"] = echo_id(ans.get("id"))
    try:
        return dumps(ans)
    except Exception as exc:
        return dumps(encode_error(exc, ans["id"]))


def _reject_constant(name: str) -> float:
    raise CaseFormatError(f"{name} is not a valid JSON number")


def decode_attr(obj: Any, mesh: ProcessMesh) -> TensorDistAttr | None:
    """A RES object back into a dist attr (for tests and tools)."""
    if obj is None:
        return None
    return TensorDistAttr(mesh, obj["dims_mapping"], parse_partial(obj.get("partial"), "result"))


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(", ", ": "), allow_nan=False, default=_json_default)


def _json_default(o: Any) -> Any:
    if isinstance(o, ReduceType):
        return o.value
    if isinstance(o, tuple):
        return list(o)
    if isinstance(o, float) and not math.isfinite(o):
        return None
    raise TypeError(f"cannot encode {type(o).__name__}")


__all__: Sequence[str] = [
    "Case",
    "parse_case",
    "parse_mesh",
    "parse_tensor",
    "encode_result",
    "encode_error",
    "encode_attr",
    "answer_line",
    "answer_text",
    "echo_id",
    "CASE_KEYS",
    "decode_attr",
    "dumps",
]
