"""Human-readable tables (rich where installed, plain text otherwise)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TextIO

from spmdkit.core.dist_attr import TensorDistAttr, format_dims_mapping
from spmdkit.core.spec import DistTensorSpec, SpmdResult


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


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]], out: TextIO) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
        out.write(title + "\n")
        out.write("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip() + "\n")
        out.write("  ".join("-" * w for w in widths) + "\n")
        for r in rows:
            out.write("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")
        return
    from rich.markup import escape

    t = Table(title=escape(title), title_justify="left")
    for h in header:
        t.add_column(escape(h), no_wrap=True)
    for r in rows:
        t.add_row(*(escape(c) for c in r))  # cells are text ("[dp:S(0), tp:R]"), not markup
    # wide enough that no cell is cut or wrapped, whatever the terminal
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    Console(file=out, width=max(len(title), sum(widths) + 3 * len(widths) + 1), soft_wrap=True).print(t)


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
    from spmdkit.rules.registry import all_rules, rule_names

    try:
        from spmdkit.sim.verify import verifiable_rules

        verified = set(verifiable_rules())
    except ImportError:  # pragma: no cover - numpy missing
        verified = set()
    rules = all_rules()
    fams: dict[str, list[str]] = {}
    for name in rule_names(include_aliases=False):
        mod = rules[name].forward.fn.__module__.rsplit(".", 1)[-1]
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
