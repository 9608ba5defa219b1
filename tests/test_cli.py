"""The CLI and the JSON-lines contract of INTERFACE.md."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from spmdkit.cli import main
from spmdkit.io.codec import answer_line

CASE = {"id": "c1", "rule": "transpose", "mesh": [2, 3],
        "args": [{"shape": [4, 6, 8], "dims_mapping": [0, -1, 1]}, [2, 0, 1]]}


def run(argv: list[str], capsys: pytest.CaptureFixture[str], stdin: str | None = None,
        monkeypatch: pytest.MonkeyPatch | None = None) -> tuple[int, str, str]:
    if stdin is not None:
        assert monkeypatch is not None
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = main(argv)
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_infer_json_echoes_id(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["infer", "--json", json.dumps(CASE)], capsys)
    assert rc == 0
    res = json.loads(out)
    assert res == {"id": "c1", "inputs": [{"dims_mapping": [0, -1, -1], "partial": {}}],
                   "outputs": [{"dims_mapping": [-1, 0, -1], "partial": {}}]}


def test_infer_table(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["infer", json.dumps(CASE)], capsys)
    assert rc == 0
    assert "transpose" in out and "[-1, 0, -1]" in out


def test_infer_error_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    bad = {**CASE, "args": [{"shape": [4, 6, 8], "dims_mapping": [0, -1, 5]}, [2, 0, 1]]}
    rc, _, err = run(["infer", json.dumps(bad)], capsys)
    assert rc == 1 and "InvalidDimsMappingError" in err and "'x'" in err and "Traceback" not in err
    rc, out, _ = run(["infer", "--json", json.dumps(bad)], capsys)
    assert rc == 1 and json.loads(out)["error"] == "InvalidDimsMappingError"


def test_infer_not_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run(["infer", "{not json"], capsys)
    assert rc == 2 and "not valid JSON" in err
    # --json: one result record, as --batch answers the line (it printed a message on stderr and no JSON)
    rc, out, err = run(["infer", "--json", "{not json"], capsys)
    assert rc == 1 and err == "" and json.loads(out) == {
        "id": None, "error": "CaseFormatError",
        "message": "line is not valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"}
    rc, out, err = run(["infer", "--json", '{"id": NaN, "rule": "relu"}'], capsys)
    assert rc == 1 and json.loads(out)["message"] == "NaN is not a valid JSON number"  # as --batch reads it


def test_infer_batch_takes_no_case_and_input_needs_batch(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # --batch with a case argument read stdin and dropped the case; --input without --batch was ignored
    rc, out, err = run(["infer", "--batch", json.dumps(CASE)], capsys)
    assert rc == 2 and out == "" and err == ("spmdkit infer: --batch reads the cases from stdin (or --input FILE), "
                                             "one a line; give no case argument with it\n")
    cases = tmp_path / "cases.jsonl"
    cases.write_text(json.dumps(CASE) + "\n")
    rc, out, err = run(["infer", "--input", str(cases), json.dumps(CASE)], capsys)
    assert rc == 2 and out == "" and err.startswith("spmdkit infer: --input: reads a file of cases with --batch only")


LINES = [
    json.dumps(CASE),
    "this is not json",
    "[1, 2, 3]",
    json.dumps({"id": 7, "rule": "no_such_rule", "mesh": [2], "args": []}),
    json.dumps({"id": 8, "rule": "transpose2", "mesh": [2], "mode": "sideways", "args": []}),
    json.dumps({"id": 9, "rule": "transpose", "mesh": [0], "args": [{"shape": [4]}, [0]]}),
    json.dumps({"id": 10, "rule": "transpose", "mesh": [2], "args": [{"shape": [4], "dims_mapping": [0]}]}),
    json.dumps({"id": 11, "rule": "transpose", "mesh": [2], "args": [{"shape": "big"}, [0]]}),
    json.dumps({"id": 12, "rule": "add", "mesh": [2], "args": [{"shape": [4], "partial": {"0": "median"}}, {"shape": [4]}]}),
    json.dumps({"id": 13, "rule": "relu", "mesh": {"shape": [2, 2], "dim_names": ["dp", "tp"]},
                "args": [{"shape": [4, 4], "dims_mapping": [0, 1], "partial": []}]}),
    json.dumps({"id": 14, "rule": "transpose", "mesh": [2], "args": [{"shape": [4, 4]}, [0, 1], "extra"]}),
]
EXPECT_ERRORS = [None, "CaseFormatError", "CaseFormatError", "UnknownRuleError", "UnsupportedModeError",
                 "InvalidMeshError", "InvalidArgumentError", "CaseFormatError", "InvalidPartialError", None,
                 "CaseFormatError"]


def test_batch_answers_every_line_in_order(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    rc, out, err = run(["infer", "--batch"], capsys, stdin="\n".join(LINES) + "\n", monkeypatch=monkeypatch)
    assert rc == 0 and err == ""
    res = [json.loads(x) for x in out.splitlines()]
    assert len(res) == len(LINES)
    for r, exp, line in zip(res, EXPECT_ERRORS, LINES):
        if exp is None:
            assert "inputs" in r and "outputs" in r, (line, r)
        else:
            assert r.get("error") == exp, (line, r)
            assert r["message"], r
    assert [r.get("id") for r in res][:1] == ["c1"]
    assert [r.get("id") for r in res][3:] == [7, 8, 9, 10, 11, 12, 13, 14]


def test_batch_from_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "cases.jsonl"
    f.write_text("\n".join(LINES[:3]) + "\n")
    rc, out, _ = run(["infer", "--batch", "--input", str(f)], capsys)
    assert rc == 0 and len(out.splitlines()) == 3


def test_batch_missing_file_is_an_io_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(["infer", "--batch", "--input", str(tmp_path / "nope.jsonl")], capsys)
    assert rc == 1 and out == "" and "nope.jsonl" in err
    # it named no flag ("spmdkit: [Errno 2] ..."): now --input, the path and why
    assert err.strip() == f"spmdkit infer: --input {str(tmp_path / 'nope.jsonl')!r}: cannot read it: No such file or directory"


def test_a_null_mode_is_said_to_be_null(capsys: pytest.CaptureFixture[str]) -> None:
    """"mode": null read as the mode 'None' ("unknown mode 'None'"): the record names the key and null."""
    rc, out, _ = run(["infer", "--json", json.dumps({**CASE, "mode": None})], capsys)
    r = json.loads(out)
    assert rc == 1 and r["error"] == "UnsupportedModeError" and r["id"] == "c1"
    assert r["message"] == "transpose: mode is null: 'forward' or 'backward' (or no 'mode' key: forward)"


def test_answer_line_never_raises() -> None:
    for junk in ["", "null", "{}", '{"rule": 3}', '{"rule": "add", "args": {}}', '{"rule": "add", "mesh": "x"}',
                 '{"rule": "add", "mesh": [2], "args": [{"shape": [1e400]}, {"shape": [2]}]}', "\ud800"]:
        r = answer_line(junk)
        assert "error" in r and r["error"].endswith("Error"), (junk, r)


def test_rules_lists_modes(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["rules", "--json"], capsys)
    rows = {r["name"]: r for r in json.loads(out)}
    assert rc == 0
    assert rows["transpose2"]["canonical"] == "transpose"
    assert rows["transpose"]["modes"] == ["forward", "backward"]
    assert rows["transpose"]["backward"] == "TransposeInferSpmdReverse"
    assert rows["transpose_grad"]["modes"] == ["forward"]
    rc, out, _ = run(["rules"], capsys)
    assert "default_data_parallel" in out


def test_verify_without_cases_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # --cases 0 or -1 verified nothing, printed a total of 0 cases and exited 0 (every rule 'sound')
    for n in ("0", "-1"):
        rc, out, err = run(["verify", "transpose", "--cases", n], capsys)
        assert rc == 2 and out == "" and err == (f"spmdkit verify: --cases {n}: expected at least 1 generated case "
                                                 "per rule and mode\n")


def test_verify_command(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run(["verify", "transpose", "--cases", "6", "--mode", "forward"], capsys)
    assert rc == 0 and "transpose" in out and "total" in out


def test_console_script_runs() -> None:
    exe = Path(sys.executable).parent / "spmdkit"
    p = subprocess.run([str(exe), "infer", "--batch"], input="nope\n", capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and json.loads(p.stdout)["error"] == "CaseFormatError"


def test_ctrl_c_is_one_line_not_a_traceback(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import spmdkit.cli as cli

    def interrupted(*args: object, **kw: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_plan", interrupted)
    rc, out, err = run(["plan", "--model", "tiny-llama", "--mesh", "dp=2"], capsys)
    assert (rc, out, err) == (130, "", "spmdkit: plan: interrupted\n")
