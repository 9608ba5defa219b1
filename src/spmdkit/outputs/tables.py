"""Human-readable tables (rich where installed, plain text otherwise)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import shutil
import textwrap
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

from spmdkit.core.dist_attr import TensorDistAttr, format_dims_mapping
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.registry import all_rules, rule_names


def fmt_attr(a: Any) -> str:
    if a is None:
        return "-"
    if isinstance(a, tuple):
        return "[" + "; ".join(fmt_attr(x) for x in a) + "]"
    assert isinstance(a, TensorDistAttr)
    s = format_dims_mapping(a.dims_mapping)
    if a.partial:
        s += " partial{" + ", ".join(f"{d}: {r.value}" for d, r in a.partial) + "}"
    return s


#: The width tables are fitted to (None: as wide as their cells; set by :func:`table_width`).
_WIDTH: contextvars.ContextVar[int | None] = contextvars.ContextVar("spmdkit_table_width", default=None)
#: The narrowest a kept column is made (its cells wrap inside it), unless its widest cell is narrower.
MIN_COLUMN = 8


@contextlib.contextmanager
def table_width(width: int | None) -> Iterator[None]:
    """Tables written inside fit ``width`` characters (None: every cell in full, one line each)."""
    token = _WIDTH.set(None if width is None else max(20, int(width)))
    try:
        yield
    finally:
        _WIDTH.reset(token)


def terminal_width(out: TextIO, wide: bool = False) -> int | None:
    """The width to fit a report to: the terminal's (``shutil.get_terminal_size``, which honours
    ``COLUMNS``) when ``out`` is a terminal and not ``wide``; None (everything) otherwise, so a
    pipe or a file gets whole lines."""
    if wide:
        return None
    try:
        tty = out.isatty()
    except (AttributeError, ValueError):
        return None
    return shutil.get_terminal_size().columns if tty else None


def fit_columns(header: Sequence[str], rows: Sequence[Sequence[str]], width: int | None, gap: int, edge: int,
                optional: Sequence[str] = ()) -> tuple[list[int], list[int], list[str]]:
    """(the columns kept, their widths, the headers of those left out) for a table of ``header``
    and ``rows`` in ``width`` characters, with ``gap`` characters between columns and ``edge``
    on the two sides together. Every cell in full when it fits (or ``width`` is None); else the
    ``optional`` columns are left out in that order until the rest fit at half their width (a
    cell wrapped on two lines; never narrower than :data:`MIN_COLUMN` or a header word), and the
    room left is shared out to the columns kept in proportion to what they lack (their cells wrap)."""
    natural = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(header)]
    keep = list(range(len(header)))

    def need(cols: list[int], ws: list[int]) -> int:
        return sum(ws[c] for c in cols) + gap * max(0, len(cols) - 1) + edge

    if width is None or need(keep, natural) <= width:
        return keep, [natural[c] for c in keep], []
    narrow = [min(w, max(MIN_COLUMN, *(len(x) for x in h.split()))) if h.split() else min(w, MIN_COLUMN)
              for w, h in zip(natural, header)]
    half = [max(n, -(-w // 2)) for n, w in zip(narrow, natural)]
    dropped: list[str] = []
    for name in optional:
        if need(keep, half) <= width or len(keep) == 1:
            break
        if name in header and header.index(name) in keep:
            keep.remove(header.index(name))
            dropped.append(name)
    ws = {c: narrow[c] for c in keep}
    room = width - need(keep, narrow)
    lack = {c: natural[c] - narrow[c] for c in keep}
    total = sum(lack.values())
    if room > 0 and total > 0:
        for c in keep:
            ws[c] += min(lack[c], room * lack[c] // total)
        left = width - need(keep, [ws.get(c, 0) for c in range(len(header))])
        for c in keep:  # what the rounding down left
            add = min(left, natural[c] - ws[c])
            ws[c] += add
            left -= add
    return keep, [ws[c] for c in keep], dropped


def _wrap(text: str, width: int) -> list[str]:
    if len(text) <= width:
        return [text]
    return textwrap.wrap(text, width, break_long_words=True, break_on_hyphens=False) or [""]


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]], out: TextIO,
           optional: Sequence[str] = ()) -> None:
    """A table on ``out``: rich's where installed, plain text otherwise. Inside
    :func:`table_width` it fits that width (``optional`` columns left out first, in that order,
    and a line naming them; cells wrapped); else every cell is in full."""
    width = _WIDTH.get()
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        keep, widths, dropped = fit_columns(header, rows, width, 2, 0, optional)
        for line in _wrap(title, width) if width else [title]:
            out.write(line + "\n")
        out.write("  ".join(header[c].ljust(w) for c, w in zip(keep, widths)).rstrip() + "\n")
        out.write("  ".join("-" * w for w in widths) + "\n")
        for r in rows:
            cells = [_wrap(r[c], w) for c, w in zip(keep, widths)]
            for k in range(max(len(x) for x in cells)):
                out.write("  ".join((x[k] if k < len(x) else "").ljust(w)
                                    for x, w in zip(cells, widths)).rstrip() + "\n")
        _left_out(dropped, out, width)
        return
    from rich.markup import escape

    keep, widths, dropped = fit_columns(header, rows, width, 3, 4, optional)
    t = Table(title=escape(title), title_justify="left")
    for c, w in zip(keep, widths):
        # cells are text ("[dp:S(0), tp:R]"), not markup; fitted: wrapped at spaces, long words folded
        t.add_column(escape(header[c]), no_wrap=width is None, overflow="fold", width=w if width else None)
    for r in rows:
        t.add_row(*(escape(r[c]) for c in keep))
    if width is None:  # wide enough that no cell is cut or wrapped, whatever the terminal
        Console(file=out, width=max(len(title), sum(widths) + 3 * len(widths) + 1), soft_wrap=True).print(t)
    else:
        Console(file=out, width=width, soft_wrap=False).print(t)
    _left_out(dropped, out, width)


def _left_out(dropped: list[str], out: TextIO, width: int | None) -> None:
    if dropped:
        text = f"(columns left out to fit the terminal: {', '.join(dropped)}; --wide shows them)"
        for line in _wrap(text, width) if width else [text]:
            out.write(line + "\n")


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class _Wrapped:
    """A text stream that wraps each line longer than ``width`` (visible characters: colour
    codes not counted) at spaces, the continuation indented by two, onto ``out``."""

    def __init__(self, out: TextIO, width: int) -> None:
        self.out = out
        self.width = width
        self._part = ""

    def write(self, text: str) -> int:
        lines = (self._part + text).split("\n")
        self._part = lines.pop()
        for line in lines:
            self._line(line)
        return len(text)

    def _line(self, line: str) -> None:
        if len(_ANSI.sub("", line)) <= self.width:
            self.out.write(line + "\n")
            return
        indent = " " * (len(line) - len(line.lstrip(" ")))
        for part in textwrap.wrap(line, self.width, initial_indent="", subsequent_indent=indent + "  ",
                                  break_long_words=True, break_on_hyphens=False):
            self.out.write(part + "\n")

    def flush(self) -> None:
        self.out.flush()  # a partial line stays until its newline (or :meth:`finish`)

    def finish(self) -> None:
        if self._part:
            self._line(self._part)
            self._part = ""
        self.out.flush()

    def isatty(self) -> bool:
        return bool(self.out.isatty())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.out, name)


@contextlib.contextmanager
def fitted(out: TextIO, width: int | None) -> Iterator[TextIO]:
    """``out`` with its tables (:func:`table_width`) and its longer lines fitted to ``width``
    characters; ``out`` itself, unchanged, when ``width`` is None."""
    if width is None:
        yield out
        return
    w = max(20, int(width))
    wrapped = _Wrapped(out, w)
    with table_width(w):
        try:
            yield wrapped  # type: ignore[misc]
        finally:
            wrapped.finish()


def print_result_table(case: Any, result: SpmdResult, out: TextIO) -> None:
    mode = case.rule.mode(case.mode)
    rows: list[list[str]] = []
    tensor_params = [(p, a) for p, a in zip(mode.params, case.args) if p.is_tensor]
    for i, (p, given) in enumerate(tensor_params):
        got = result.inputs[i] if i < len(result.inputs) else None
        shape = _shape(given)
        rows.append(["input", p.name, shape, fmt_attr(_attrs(given)), fmt_attr(got)])
    for i, a in enumerate(result.outputs):
        rows.append(["output", f"out[{i}]", "", "", fmt_attr(a)])
    title = f"{case.rule.name} {case.mode} on mesh {list(case.mesh.shape)}"
    print_table(title, ["", "tensor", "shape", "given", "inferred"], rows, out)


def _shape(t: Any) -> str:
    if isinstance(t, DistTensorSpec):
        return str(list(t.shape))
    if isinstance(t, (list, tuple)):
        return "[" + "; ".join(_shape(x) for x in t) + "]"
    return "-"


def _attrs(t: Any) -> Any:
    if isinstance(t, DistTensorSpec):
        return t.dist_attr
    if isinstance(t, (list, tuple)):
        return tuple(_attrs(x) for x in t)
    return None


def print_rules_table(rows: Sequence[dict[str, Any]], out: TextIO) -> None:
    table = [
        [r["name"], r["canonical"] if r["canonical"] != r["name"] else "", ", ".join(r["modes"]), r["forward"], r["backward"] or "-"]
        for r in rows
    ]
    print_table(f"{len(rows)} registered rule names", ["name", "alias of", "modes", "forward", "backward"], table, out)


def rules_markdown() -> str:
    """The README's table of rules: one row per rule family (the module that defines it),
    generated from the registry (and the simulator's references, when numpy is installed)."""
    try:
        from spmdkit.sim.verify import verifiable_rules  # (imports numpy)

        verified = set(verifiable_rules())
    except ImportError:  # pragma: no cover - numpy missing
        verified = set()
    rules = all_rules()
    fams: dict[str, list[str]] = {}
    for name in rule_names(include_aliases=False):
        fn = rules[name].forward.fn
        while isinstance(fn, functools.partial):  # a rule registered as a partial of a shared body
            fn = fn.func
        mod = fn.__module__.rsplit(".", 1)[-1]
        fams.setdefault(mod, []).append(name)
    lines = [
        "| family | rules (forward + backward) | forward only | grad rules | aliases | simulator-verified |",
        "|---|---|---|---|---|---|",
    ]
    total = [0, 0, 0, 0, 0]
    for fam in sorted(fams):
        names = fams[fam]
        grads = [n for n in names if n.endswith("_grad")]
        both = [n for n in names if n not in grads and rules[n].backward is not None]
        fwd = [n for n in names if n not in grads and rules[n].backward is None]
        aliases = [a for n in names for a in rules[n].aliases]
        ver = [n for n in names if n in verified]
        for i, v in enumerate((both, fwd, grads, aliases, ver)):
            total[i] += len(v)

        def cell(xs: list[str], limit: int = 12) -> str:
            if not xs:
                return "-"
            shown = ", ".join(f"`{x}`" for x in xs[:limit])
            return f"{len(xs)}: {shown}" + (", ..." if len(xs) > limit else "")

        lines.append(f"| {fam} | {cell(both)} | {cell(fwd)} | {cell(grads)} | {cell(aliases)} | "
                     f"{len(ver)} of {len(names)} |")
    lines.append(f"| **all** | {total[0]} | {total[1]} | {total[2]} | {total[3]} | {total[4]} of "
                 f"{sum(len(v) for v in fams.values())} |")
    return "\n".join(lines)
