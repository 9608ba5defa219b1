"""``spmdkit infer --batch`` under bad input: every line answered, answers independent of order,
bounded work and messages (issue 13). Seeded and bounded in time."""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spmdkit import cli
from spmdkit.core.errors import MAX_MESSAGE_CHARS, InvalidMeshError, SpmdError, bounded
from spmdkit.core.mesh import MAX_MESH_RANKS, ProcessMesh
from spmdkit.engine.registry import cache_stats, clear_cache, get_rule
from spmdkit.io.codec import answer_line, answer_text, echo_id, parse_case

SRC = Path(__file__).resolve().parent.parent / "src"
GOLDEN = Path(__file__).parent / "golden"


def _batch(data: bytes, *extra: str) -> tuple[int, list[str], str]:
    """Run the real CLI on ``data`` as stdin: (exit status, output lines, stderr)."""
    env = dict(os.environ, PYTHONPATH=str(SRC))
    p = subprocess.run([sys.executable, "-m", "spmdkit", "infer", "--batch", *extra], input=data,
                       capture_output=True, env=env, timeout=300, check=False)
    return p.returncode, p.stdout.decode("utf-8").split("\n")[:-1], p.stderr.decode("utf-8", "replace")


SOFTMAX_1 = {"rule": "softmax", "mesh": [2], "args": [{"shape": [4, 8], "dims_mapping": [0, -1]}, 1]}
SOFTMAX_TRUE = {"rule": "softmax", "mesh": [2], "args": [{"shape": [4, 8], "dims_mapping": [0, -1]}, True]}


# ---- the lines that used to end the process --------------------------------------------------

KILLERS = [
    b'{"id": 1, "rule": "softmax", "mesh": [100000, 100000], "args": [{"shape": [4, 8]}, 1]}',
    b'{"id": 2, "rule": "softmax", "mesh": [9223372036854775808], "args": [{"shape": [4, 8]}, 1]}',
    b'{"id": 3, "rule": "softmax", "mesh": [2], "args": [{"shape": [9223372036854775808, 8]}, 1]}',
    b'{"id": 1e400, "rule": "softmax", "mesh": [2], "args": [{"shape": [4, 8]}, 1]}',
    b"",
    b"   ",
    b'{"id": "\xff\xfe", "rule": "softmax", "mesh": [2]}',
    b'{"id": 8, "rule": "softmax", "mesh": [2], "mdoe": "backward", "args": [{"shape": [4, 8]}, 1]}',
    b"[" * 100_000,
    b'{"id": 10, "rule": "softmax", "mesh": [2], "args": [{"shape": [4, 8]}, -1]}',
]


def test_killer_lines_each_get_their_line_and_later_lines_survive() -> None:
    rc, out, err = _batch(b"\n".join(KILLERS) + b"\n")
    assert rc == 0 and "Traceback" not in err
    assert len(out) == len(KILLERS)
    got = [json.loads(o) for o in out]
    assert [g.get("error") for g in got] == [
        "InvalidMeshError", "InvalidMeshError", got[2].get("error"), None, "CaseFormatError",
        "CaseFormatError", "CaseFormatError", "CaseFormatError", "CaseFormatError", None]
    assert [g["id"] for g in got] == [1, 2, 3, "Infinity", None, None, None, 8, None, 10]
    assert "MAX_MESH_RANKS" in got[0]["message"] and str(MAX_MESH_RANKS) in got[0]["message"]
    assert "'mdoe'" in got[7]["message"]
    assert "UTF-8" in got[6]["message"]
    assert got[9]["outputs"] == [{"dims_mapping": [-1, -1], "partial": {}}]


def test_input_file_with_invalid_utf8_and_no_final_newline(tmp_path: Path) -> None:
    f = tmp_path / "cases.jsonl"
    f.write_bytes(b'{"id": "a\xc3", "rule": "softmax"}\n\n' + json.dumps({**SOFTMAX_1, "id": "z"}).encode())
    rc, out, err = _batch(b"", "--input", str(f))
    assert rc == 0 and "Traceback" not in err
    assert [json.loads(o).get("error") for o in out] == ["CaseFormatError", "CaseFormatError", None]
    assert json.loads(out[2])["id"] == "z"


def test_over_long_line_is_answered_without_reading_it_whole(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "MAX_LINE_BYTES", 150)
    data = (json.dumps({**SOFTMAX_1, "id": "x" * 500}) + "\n" + json.dumps({**SOFTMAX_1, "id": 1}) + "\n"
            + "y" * 1000).encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    assert cli.main(["infer", "--batch"]) == 0
    got = [json.loads(o) for o in capsys.readouterr().out.splitlines()]
    assert len(got) == 3
    assert "longer than 150 bytes" in got[0]["message"] and "longer than 150 bytes" in got[2]["message"]
    assert got[1]["id"] == 1 and "outputs" in got[1]


def test_echo_id() -> None:
    assert echo_id(7) == 7 and echo_id("a") == "a" and echo_id([1, {"b": None}]) == [1, {"b": None}]
    assert echo_id(float("inf")) == "Infinity" and echo_id([float("-inf")]) == "[-Infinity]"
    assert echo_id(float("nan")) == "NaN"
    assert echo_id({1, 2}) is None  # not JSON at all
    assert json.loads(answer_text(json.dumps({**SOFTMAX_1, "id": 5}).replace("5", "1e400", 1)))["id"] == "Infinity"


# ---- bounded work and messages ----------------------------------------------------------------

def test_mesh_rank_limit_before_allocation() -> None:
    with pytest.raises(InvalidMeshError, match="MAX_MESH_RANKS"):
        ProcessMesh([MAX_MESH_RANKS, 2])
    with pytest.raises(InvalidMeshError, match="MAX_MESH_RANKS"):
        ProcessMesh([2**63, 2**63], process_ids=None)
    with pytest.raises(InvalidMeshError, match="dims"):
        ProcessMesh([1] * 1000)
    m = ProcessMesh([MAX_MESH_RANKS])  # the limit itself is allowed, and stores no id tuple
    assert m.size == MAX_MESH_RANKS and m.process_ids[-1] == MAX_MESH_RANKS - 1


def test_meshes_are_interned_and_equal_by_value() -> None:
    a = ProcessMesh([2, 4])
    assert ProcessMesh((2, 4)) is a
    assert ProcessMesh([2, 4], list(range(8)), ["d0", "d1"]) is a
    assert ProcessMesh([2, 4]).process_ids == tuple(range(8))
    b = ProcessMesh([2, 4], [7, 6, 5, 4, 3, 2, 1, 0])
    assert b != a and b.process_ids == (7, 6, 5, 4, 3, 2, 1, 0)
    assert ProcessMesh([2, 4], (7, 6, 5, 4, 3, 2, 1, 0)) is b
    c = ProcessMesh([2, 4], dim_names=["dp", "tp"])
    assert c != a and c.dim_names == ("dp", "tp") and hash(c) != hash(a)
    import pickle

    assert pickle.loads(pickle.dumps(b)) == b


def test_every_message_is_bounded() -> None:
    assert len(str(SpmdError("x" * 10_000_000))) <= MAX_MESSAGE_CHARS
    text = "head " + "m" * 5000 + " tail"
    short = bounded(text)
    assert short.startswith("head ") and short.endswith(" tail") and "characters elided" in short
    dm = list(range(-1, 300_000))
    got = answer_line(json.dumps({"rule": "softmax", "mesh": [2], "args": [{"shape": [4, 8], "dims_mapping": dm}, 1]}))
    assert got["error"] and len(got["message"]) <= MAX_MESSAGE_CHARS


def test_result_cache_is_bounded_in_entries_and_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    from spmdkit.engine import registry

    clear_cache()
    monkeypatch.setattr(registry, "_CACHE_LIMIT", 50)
    rule = get_rule("softmax")
    for k in range(1, 400):
        for _ in range(2):  # an answer is stored on its key's second call
            parse_case({"rule": "softmax", "mesh": [2], "args": [{"shape": [k, 8], "dims_mapping": [0, -1]}, 1]}).run()
        assert 0 < cache_stats()["entries"] <= 50
    monkeypatch.setattr(registry, "_CACHE_LIMIT", 10**9)
    monkeypatch.setattr(registry, "_CACHE_BYTES_LIMIT", 20_000)
    clear_cache()
    for k in range(1, 400):
        for _ in range(2):
            parse_case({"rule": "softmax", "mesh": [2], "args": [{"shape": [k, 8], "dims_mapping": [0, -1]}, 1]}).run()
        assert 0 < cache_stats()["bytes"] <= 20_000
    # a mesh with 10,000 explicit ids costs more than the whole budget: never cached, still answered
    clear_cache()
    ids = list(range(10_000))[::-1]
    mesh = {"shape": [10_000], "process_ids": ids}
    for _ in range(2):
        got = answer_line(json.dumps({"rule": "softmax", "mesh": mesh, "args": [{"shape": [4, 8]}, 1]}))
    assert "outputs" in got and cache_stats()["entries"] == 0 and cache_stats()["seen"] == 1
    assert rule._cache == {}
    clear_cache()


def test_no_cache_flag_gives_the_same_answers() -> None:
    lines = [json.dumps(SOFTMAX_1), json.dumps(SOFTMAX_TRUE), json.dumps(SOFTMAX_1)]
    data = ("\n".join(lines) + "\n").encode()
    rc1, out1, _ = _batch(data)
    rc2, out2, _ = _batch(data, "--no-cache")
    assert rc1 == rc2 == 0 and out1 == out2 and len(out1) == 3
    assert json.loads(out1[1])["error"] == "InvalidAttributeError"


# ---- an answer never depends on what came before ---------------------------------------------

def test_softmax_true_after_one() -> None:
    clear_cache()
    alone = answer_line(json.dumps(SOFTMAX_TRUE))
    assert alone["error"] == "InvalidAttributeError"
    answer_line(json.dumps(SOFTMAX_1))
    answer_line(json.dumps(SOFTMAX_1))  # stored on its second call
    assert cache_stats()["entries"] == 1
    assert answer_line(json.dumps(SOFTMAX_TRUE)) == alone
    clear_cache()


def _flip(v: Any) -> list[Any]:
    """Type-perturbed twins of one attribute value (JSON-representable)."""
    if v is True or v is False:
        return [int(v)]
    if isinstance(v, int):
        out: list[Any] = [float(v)]
        if v in (0, 1):
            out.append(bool(v))
        return out
    if isinstance(v, float):
        return [int(v)] if v.is_integer() and abs(v) < 2**53 else []
    if isinstance(v, list):
        twins = []
        for i, x in enumerate(v):
            for t in _flip(x):
                twins.append([*v[:i], t, *v[i + 1:]])
        return twins[:2]
    return []


def _twins(case: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    args = case.get("args", [])
    for i, a in enumerate(args):
        if isinstance(a, dict) and "shape" in a:
            for t in _flip(a.get("dims_mapping") or [])[:1]:
                out.append({**case, "args": [*args[:i], {**a, "dims_mapping": t}, *args[i + 1:]]})
            continue
        if isinstance(a, list) and a and all(isinstance(x, dict) or x is None for x in a):
            continue
        for t in _flip(a):
            out.append({**case, "args": [*args[:i], t, *args[i + 1:]]})
    return out


def _golden_cases() -> list[dict[str, Any]]:
    cases = []
    for f in sorted(GOLDEN.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                cases.append(json.loads(line)["case"])
    return cases


def _alone(case: dict[str, Any]) -> dict[str, Any]:
    clear_cache()
    return answer_line(json.dumps(case))


def test_golden_twins_answer_alike_in_either_order() -> None:
    """Each sampled golden case and each of its type-perturbed twins (bool<->int, int<->float, in
    attributes and dims_mappings) answers the same after the other as alone with an empty cache."""
    rng = random.Random(13)
    cases = _golden_cases()
    pairs = [(c, t) for c in cases for t in _twins(c)]
    assert len(pairs) > 1000
    checked = 0
    for c, t in rng.sample(pairs, 700):
        a_c, a_t = _alone(c), _alone(t)
        clear_cache()
        answer_line(json.dumps(c))
        answer_line(json.dumps(c))  # stored on its second call
        after_c = answer_line(json.dumps(t))
        clear_cache()
        answer_line(json.dumps(t))
        answer_line(json.dumps(t))
        after_t = answer_line(json.dumps(c))
        assert after_c == a_t, f"{t} after {c}: {after_c} != alone {a_t}"
        assert after_t == a_c, f"{c} after {t}: {after_t} != alone {a_c}"
        checked += 1
    clear_cache()
    assert checked == 700


def test_api_tuple_and_list_attributes_answer_alike() -> None:
    """list <-> tuple twins through the Python API, both orders (transpose's perm, reshape's shape)."""
    rng = random.Random(7)
    cases = [c for c in _golden_cases() if c.get("rule") in ("transpose", "reshape", "tile", "squeeze",
                                                               "unsqueeze", "expand", "slice")]
    assert cases
    for c in rng.sample(cases, min(150, len(cases))):
        try:
            case = parse_case(c)
        except SpmdError:
            continue
        tup = tuple(tuple(a) if isinstance(a, list) and all(isinstance(x, (int, float)) for x in a) else a
                    for a in case.args)

        def ask(args: tuple[Any, ...], case: Any = case) -> Any:
            try:
                r = case.rule.infer(case.mode, *args)
                return (r.inputs, r.outputs)
            except SpmdError as exc:
                return type(exc).__name__

        clear_cache()
        alone_l = ask(case.args)
        clear_cache()
        alone_t = ask(tup)
        clear_cache()
        ask(case.args)
        ask(case.args)  # stored on its second call
        assert ask(tup) == alone_t
        clear_cache()
        ask(tup)
        ask(tup)
        assert ask(case.args) == alone_l
    clear_cache()


# ---- seeded fuzz of the real CLI ---------------------------------------------------------------

_BIG = "__BIG_NUMBER__"
_RULES = sorted({"softmax", "matmul", "add", "layer_norm", "transpose", "reshape", "concat", "split", "slice",
                 "embedding", "cross_entropy_with_softmax", "flash_attention", "reduce_sum", "cast", "full_like",
                 "expand_as", "where", "conv2d", "topk", "argmax", "squeeze", "tile", "no_such_rule"})


def _scalar(rng: random.Random) -> Any:
    return rng.choice([0, 1, -1, 2, 7, True, False, None, 0.5, -0.0, 1e308, 2**63, -(2**63), 10**30,
                       "", "x", "ü\u2028\u0000", "\ud800", _BIG, 3.0, [], {}])


def _value(rng: random.Random, depth: int = 0) -> Any:
    r = rng.random()
    if depth > 3 or r < 0.55:
        return _scalar(rng)
    if r < 0.8:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["shape", "dims_mapping", "partial", "a", "0", ""]): _value(rng, depth + 1)
            for _ in range(rng.randint(0, 3))}


def _mesh(rng: random.Random) -> Any:
    return rng.choice([[2], [2, 4], [1], [100000, 100000], [2**63], [2**20], [2**20, 2], [], [0], [-1], [1.5],
                       [True], "x", None, [2] * 70,
                       {"shape": [2, 2], "dim_names": ["dp", "tp"]},
                       {"shape": [2, 2], "process_ids": [3, 2, 1, 0]},
                       {"shape": [2, 2], "process_ids": [0, 0, 1, 1]},
                       {"shape": [2**40], "process_ids": [0]},
                       {"shape": [2], "dim_names": ["", ""]},
                       {"shape": [2], "bogus": 1}, _value(rng)])


def _tensor(rng: random.Random) -> Any:
    nd = rng.randint(0, 4)
    shape = [rng.choice([1, 2, 4, 8, 0, -1, 2**63, 10**12, True, 1.0]) for _ in range(nd)]
    t: dict[str, Any] = {"shape": shape if rng.random() < 0.9 else _value(rng)}
    if rng.random() < 0.8:
        t["dims_mapping"] = [rng.choice([-1, -1, 0, 1, 2, 99, -5, [0, 1], [0, 0], True, 2**63, "0", None])
                             for _ in range(nd + (rng.random() < 0.1))]
    if rng.random() < 0.3:
        t["partial"] = rng.choice([[0], [1], {"0": "sum"}, {"0": "median"}, {"x": "sum"}, [[0]], "sum", 2**63])
    if rng.random() < 0.05:
        t["strides"] = [1]
    return t


def _id(rng: random.Random) -> Any:
    return rng.choice([1, "a", None, _BIG, [1, 2], {"k": [None]}, 2**70, "ü", [_BIG], 1.5, True])


def _case_line(rng: random.Random) -> str:
    case: dict[str, Any] = {}
    if rng.random() < 0.9:
        case["id"] = _id(rng)
    if rng.random() < 0.95:
        case["rule"] = rng.choice(_RULES) if rng.random() < 0.9 else _value(rng)
    if rng.random() < 0.95:
        case["mesh"] = _mesh(rng)
    if rng.random() < 0.3:
        case["mode"] = rng.choice(["forward", "backward", "sideways", 1, None])
    if rng.random() < 0.05:
        case[rng.choice(["mdoe", "Args", "", "ID"])] = "backward"
    if rng.random() < 0.95:
        args = []
        for _ in range(rng.randint(0, 6)):
            r = rng.random()
            args.append(_tensor(rng) if r < 0.5 else [_tensor(rng) for _ in range(rng.randint(0, 3))]
                        if r < 0.6 else _value(rng))
        case["args"] = args if rng.random() < 0.95 else _value(rng)
    text = json.dumps(case, ensure_ascii=rng.random() < 0.5)
    return text.replace(f'"{_BIG}"', rng.choice(["1e400", "-1e400", "1" + "0" * 5000, "1e-400"]))


def _garbage_line(rng: random.Random) -> bytes:
    r = rng.randint(0, 11)
    if r == 0:
        return b""
    if r == 1:
        return rng.choice([b"   ", b"\t", b"\r"])
    if r == 2:
        return bytes(rng.choice([x for x in range(256) if x != 10]) for _ in range(rng.randint(1, 60)))
    if r == 3:
        return rng.choice([b"[", b"{\"a\":"]) * rng.randint(1, 50_000)
    if r == 4:
        return rng.choice([b"NaN", b"Infinity", b"-Infinity", b"null", b"1", b'"s"', b"[]", b"{}", b"1e400"])
    if r == 5:
        return _case_line(rng).encode("utf-8", "surrogatepass")[: rng.randint(0, 80)]
    if r == 6:
        return b'{"id": 1, "rule": "softmax", "mesh": [2], "args": [' + b"[" * 3000 + b"]" * 3000 + b"]}"
    if r == 7:
        return b'{"id": "\xe9", "rule": "softmax", "mesh": [2], "args": []}'
    if r == 8:
        return b'{"id": 1, "id": 2, "rule": "add", "mesh": [2]}'
    if r == 9:
        return json.dumps({"id": 9, "rule": "softmax", "mesh": [2],
                           "args": [{"shape": [4], "dims_mapping": list(range(50_000))}, 0]}).encode()
    return _case_line(rng).encode("utf-8", "surrogatepass")


def _expected_id(line: bytes) -> tuple[bool, Any]:
    """(known, id) as the contract says it is echoed: the id if strict JSON, else a string or null."""
    try:
        obj = json.loads(line.decode("utf-8"), parse_constant=lambda s: (_ for _ in ()).throw(ValueError(s)))
    except (ValueError, RecursionError):
        return True, None
    if not isinstance(obj, dict):
        return True, None
    try:
        json.dumps(obj.get("id"), allow_nan=False)
    except ValueError:
        return False, None  # echoed as a string or null
    return True, obj.get("id")


def test_fuzz_batch_through_the_cli() -> None:
    rng = random.Random(20261204)
    golden = _golden_cases()
    lines = []
    for _ in range(2500):
        r = rng.random()
        if r < 0.15:  # a valid case (golden), with an id of any kind: answered among the garbage
            text = json.dumps({**rng.choice(golden), "id": _id(rng)})
            lines.append(text.replace(f'"{_BIG}"', "1e400").encode())
        elif r < 0.65:
            lines.append(_case_line(rng).encode("utf-8", "surrogatepass"))
        else:
            lines.append(_garbage_line(rng))
    rc, out, err = _batch(b"\n".join(lines) + b"\n")
    assert rc == 0
    assert "Traceback" not in err and err == ""
    assert len(out) == len(lines)
    answered = errors = 0
    for line, o in zip(lines, out):
        got = json.loads(o)
        known, want = _expected_id(line)
        if known:
            assert got["id"] == want, (line[:200], got)
        else:
            assert got["id"] is None or isinstance(got["id"], str), (line[:200], got)
        if "error" in got:
            errors += 1
            assert set(got) == {"id", "error", "message"}
            assert isinstance(got["message"], str) and 0 < len(got["message"]) <= MAX_MESSAGE_CHARS
            assert got["error"].endswith("Error")
        else:
            answered += 1
            assert set(got) == {"id", "inputs", "outputs"}
    assert errors > 1000 and answered > 200  # the fuzz reaches both kinds of answer


def test_single_case_json_echoes_an_unechoable_id(capsys: pytest.CaptureFixture[str]) -> None:
    line = json.dumps({**SOFTMAX_1, "id": 5}).replace("5", "1e400", 1)
    assert cli.main(["infer", "--json", line]) == 0
    assert json.loads(capsys.readouterr().out)["id"] == "Infinity"
    bad = json.dumps({**SOFTMAX_1, "mesh": [2**63]})
    assert cli.main(["infer", bad]) == 1
    err = capsys.readouterr().err
    assert "InvalidMeshError" in err and "Traceback" not in err
