"""The plan report's tables fit the terminal (spmdkit.outputs.tables: fit_columns, table_width, fitted):
optional columns left out first, the others wrapped; ``--wide`` (and a pipe) prints everything."""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys

import pytest

from spmdkit.outputs.tables import fit_columns, fitted, print_table, table_width, terminal_width

HEADER = ["phase", "layer", "tensor", "where", "from -> to", "collectives", "times", "bytes/rank", "time"]
ROWS = [["forward", "32 layers", "layers.*.attn_out", "after matmul (layers.*.attn_out)",
         "[dp:S(0), tp:P(sum)] -> [dp:S(0), tp:R]", "all-reduce over tp (4 ranks), 192.0 MiB/rank, 477 us", "x32",
         "6.00 GiB", "15.28 ms"],
        ["optimizer", "-", "layers.*.wq.grad", "before adamw (update layers.*.wq)",
         "[dp:P(sum), tp:S(1)] -> [dp:R, tp:S(1)]", "all-reduce over dp (2 ranks), 8.0 MiB/rank, 29 us", "x32",
         "256.00 MiB", "928 us"]]
OPTIONAL = ("where", "collectives", "phase", "times")


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _words(rows: list[list[str]], cols: list[int]) -> set[str]:
    return {w for r in rows for c in cols for w in r[c].split()}


def test_fit_columns_keeps_everything_when_it_fits() -> None:
    keep, widths, dropped = fit_columns(HEADER, ROWS, None, 3, 4, OPTIONAL)
    assert keep == list(range(9)) and dropped == []
    assert widths == [max(len(h), *(len(r[i]) for r in ROWS)) for i, h in enumerate(HEADER)]
    keep2, widths2, _ = fit_columns(HEADER, ROWS, 1000, 3, 4, OPTIONAL)
    assert (keep2, widths2) == (keep, widths)


@pytest.mark.parametrize("width", [60, 80, 100, 120, 140])
def test_fit_columns_drops_in_order_and_fits(width: int) -> None:
    keep, widths, dropped = fit_columns(HEADER, ROWS, width, 3, 4, OPTIONAL)
    assert sum(widths) + 3 * (len(keep) - 1) + 4 <= width
    assert dropped == list(OPTIONAL[:len(dropped)])  # in the given order, none skipped
    assert [HEADER[c] for c in keep] == [h for h in HEADER if h not in dropped]
    assert all(w >= min(8, len(HEADER[c])) for c, w in zip(keep, widths))
    if width == 140:  # every column fits at half its width or more: all kept, wrapped
        assert dropped == []
    if width == 120:  # the others fit at half their width without "where"
        assert dropped == ["where"]
    if width == 60:
        assert dropped == list(OPTIONAL)


def _lines(text: str) -> list[str]:
    """The lines as they show (colour codes left out)."""
    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", text).rstrip("\n").split("\n")


@pytest.mark.parametrize("width", [60, 80, 120])
def test_rich_table_fits_the_width(width: int) -> None:
    pytest.importorskip("rich")
    out = io.StringIO()
    with table_width(width):
        print_table("Reshards (one row per kind of reshard; repeated layers counted in 'times')", HEADER, ROWS, out,
               optional=OPTIONAL)
    text = out.getvalue()
    assert max(len(ln) for ln in _lines(text)) <= width
    keep, widths, dropped = fit_columns(HEADER, ROWS, width, 3, 4, OPTIONAL)
    note = f"(columns left out to fit the terminal: {', '.join(dropped)}; --wide shows them)"
    assert dropped and " ".join(text.split()).endswith(note)
    # the cells kept are wrapped, not cut: every word that fits its column is printed whole
    for c, w in zip(keep, widths):
        for word in _words(ROWS, [c]):
            if len(word) <= w:
                assert word in text, (HEADER[c], word)


def test_rich_table_unfitted_is_one_line_per_row() -> None:
    pytest.importorskip("rich")
    out = io.StringIO()
    print_table("t", HEADER, ROWS, out, optional=OPTIONAL)
    lines = _lines(out.getvalue())
    assert any(ROWS[0][5] in ln for ln in lines) and any(ROWS[1][3] in ln for ln in lines)
    assert "left out" not in out.getvalue()


def test_plain_table_fits_the_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "rich.console", None)  # as if rich were not installed
    out = io.StringIO()
    with table_width(70):
        print_table("Reshards", HEADER, ROWS, out, optional=OPTIONAL)
    text = out.getvalue()
    assert max(len(ln) for ln in _lines(text)) <= 70
    keep, widths, dropped = fit_columns(HEADER, ROWS, 70, 2, 0, OPTIONAL)
    assert "where" in dropped and "(columns left out" in text
    body = text.split("\n", 3)[3]
    for c, w in zip(keep, widths):
        for word in _words(ROWS, [c]):
            if len(word) <= w:
                assert word in body, (HEADER[c], word)
    out = io.StringIO()
    print_table("Reshards", HEADER, ROWS, out, optional=OPTIONAL)  # unfitted: one line per row
    assert len(_lines(out.getvalue())) == 3 + len(ROWS)


def test_fitted_wraps_long_text_lines() -> None:
    out = io.StringIO()
    with fitted(out, 40) as f:
        f.write("short line\n")
        f.write("a long line of words " * 6 + "\n  indented and also long enough" * 2 + " to wrap it over")
    lines = _lines(out.getvalue())
    assert lines[0] == "short line" and max(len(ln) for ln in lines) <= 40
    assert " ".join(ln.strip() for ln in lines[1:]).split() == ("a long line of words " * 6 + "indented and also "
                                                                 "long enough " * 2 + "to wrap it over").split()
    assert lines[-1].startswith("    ")  # an indented line's continuation: two more spaces
    out = io.StringIO()
    with fitted(out, 40) as f:
        f.write("a partial ")
        f.flush()  # a flush does not end the line
        f.write("line\nand an unended one")
    assert out.getvalue() == "a partial line\nand an unended one\n"
    raw = io.StringIO()
    with fitted(raw, None) as f:
        assert f is raw


def test_terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "91")
    assert terminal_width(_Tty()) == 91
    assert terminal_width(_Tty(), wide=True) is None
    assert terminal_width(io.StringIO()) is None  # a pipe or a file: whole lines


def _plan_stdout(monkeypatch: pytest.MonkeyPatch, columns: int, *extra: str) -> str:
    from spmdkit.cli import main

    monkeypatch.setenv("COLUMNS", str(columns))
    buf = _Tty()
    with contextlib.redirect_stdout(buf):
        rc = main(["plan", "--model", "llama-7b", "--layers", "2", "--mesh", "dp=2,tp=4", "--device", "h100",
                   *extra])
    assert rc == 0
    return buf.getvalue()


def test_plan_fits_a_terminal_of_100(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _plan_stdout(monkeypatch, 100)
    lines = _lines(text)
    assert max(len(ln) for ln in lines) <= 100
    assert "columns left out to fit the terminal: where, collectives" in text
    for needed in ("Reshards", "Sharding", "Memory per device", "Predicted step", "step time:", "layers.0.wq"):
        assert needed in text


def test_plan_wide_prints_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _plan_stdout(monkeypatch, 100, "--wide")
    assert max(len(ln) for ln in _lines(text)) > 200 and "\x1b[" in text  # rich's styles on a terminal
    assert "left out" not in text
    assert "all-reduce over tp (4 ranks), 192.0 MiB/rank" in text and "after matmul (layers.*.attn_out)" in text
    # a pipe gets the same whole lines as --wide
    from conftest import cli_stdout

    rc, piped = cli_stdout("plan", "--model", "llama-7b", "--layers", "2", "--mesh", "dp=2,tp=4", "--device", "h100")
    strip = re.compile(r"planned in [\d.]+ s")
    assert rc == 0 and strip.sub("", piped) == strip.sub("", "\n".join(_lines(text)) + "\n")


def test_plan_json_on_a_terminal_is_not_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    text = _plan_stdout(monkeypatch, 60, "--json")
    assert len(_lines(text)) == 1
    json.loads(text)


def test_pipeline_report_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    from spmdkit.cli import main

    monkeypatch.setenv("COLUMNS", "90")
    buf = _Tty()
    with contextlib.redirect_stdout(buf):
        rc = main(["plan", "--model", "llama-7b", "--layers", "4", "--mesh", "pp=2,dp=2,tp=2", "--microbatches", "4",
                   "--device", "h100"])
    assert rc == 0
    assert max(len(ln) for ln in _lines(buf.getvalue())) <= 90
    assert "Stages (per microbatch" in buf.getvalue()


def test_a_time_zero_but_for_rounding_is_not_negative_zero() -> None:
    """--auto on tiny-llama dp=2,tp=2 printed '(-0.0 us of communication exposed)': the step minus the
    compute, zero but for rounding. A rounding-sized negative prints as 0; a real one keeps its sign."""
    from spmdkit.outputs.report import fmt_time

    assert fmt_time(-1e-12) == "0.0 us" and fmt_time(0.0) == "0.0 us"
    assert fmt_time(-2e-6) == "-2.0 us" and fmt_time(1.5e-3) == "1.50 ms"
