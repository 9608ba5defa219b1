"""``spmdkit models [NAME ...] [--json] [--wide]``: the catalog of published architectures
(:mod:`spmdkit.models.catalog`), each with its sizes, its parameters as spmdkit counts them from
the built program (:mod:`spmdkit.models.params`), the figure its source publishes and the source.

:func:`spmdkit.cli.build_parser` wires :func:`add_models_command` into its subparsers.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from spmdkit.core.errors import SpmdError
from spmdkit.models import catalog
from spmdkit.models.params import count_params, mismatches
from spmdkit.models.zoo import PRESETS, ModelConfig, preset
from spmdkit.outputs.tables import fitted, print_table, terminal_width


def add_models_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``models`` sub-command to an argparse subparsers object."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "models", help="list the catalog of published architectures (--model NAME)",
        description="The published architectures --model takes by name: their sizes, their parameters as spmdkit "
                    "counts them from the built training step, the figure their source states, and the source.")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help="list only the models whose name or family contains one of these (case-insensitive)")
    p.add_argument("--json", action="store_true", help="one JSON array of the models instead of the table")
    p.add_argument("--wide", action="store_true", help="do not fit the table to the terminal")
    p.set_defaults(fn=run_models)
    return p


def _heads(c: ModelConfig) -> str:
    if c.mla:
        return f"{c.heads} (MLA, kv rank {c.kv_lora_rank})"
    return f"{c.heads}/{c.n_kv}" if c.n_kv != c.heads else str(c.heads)


def _experts(c: ModelConfig) -> str:
    if not c.experts:
        return "-"
    shared = f"+{c.shared_experts}" if c.shared_experts else ""
    return f"{c.experts}{shared} top-{c.top_k}"


def billions(n: float) -> str:
    """A parameter count in billions, two decimals: ``8.03B``, ``1,008.04B``."""
    return f"{n / 1e9:,.2f}B"


def model_rows(filters: list[str] | None = None) -> list[dict[str, Any]]:
    """The catalog's models (those matching ``filters``), each with its config fields, the
    parameters counted from its program and its published figures."""
    out = []
    for name, e in catalog.entries().items():
        if filters and not any(f.lower() in name.lower() or f.lower() in e.family.lower() for f in filters):
            continue
        row: dict[str, Any] = {"name": name, "aliases": list(e.aliases), "family": e.family, "config": dict(e.fields),
                               "params": None, "published": dict(e.published), "published_where": e.where,
                               "active_without_token_embedding": e.active_without_token_embedding,
                               "source": e.source, "notes": e.notes}
        try:
            pc = count_params(preset(name))
            row["params"] = {"total": pc.total, "active": pc.active, "embedding": pc.embedding,
                             "non_embedding": pc.non_embedding, "token_embedding": pc.token_embedding,
                             "mtp": pc.mtp, "mtp_active": pc.mtp_active}
            row["matches_published"] = not mismatches(e, pc)
        except SpmdError as exc:  # an architecture this build of the zoo does not build
            row["error"] = str(exc)
        out.append(row)
    return out


def _with_mtp(n: int, mtp: int) -> str:
    """A count with its multi-token-prediction modules apart (published figures leave them out):
    ``671.03B + 11.61B MTP``."""
    return f"{billions(n - mtp)} + {billions(mtp)} MTP" if mtp else billions(n)


def _published(row: dict[str, Any]) -> str:
    names = {"total": "", "active": "active ", "embedding": "embedding ", "non_embedding": "non-embedding "}
    return ", ".join(f"{names[k]}{v}" for k, v in row["published"].items())


def run_models(ns: argparse.Namespace, out: TextIO | None = None) -> int:
    out = out if out is not None else sys.stdout
    rows = model_rows(list(ns.names))
    if not rows:
        # a preset (tiny-llama, llama-7b, ...) is no catalog model, but --model takes it: say so
        presets = [p for p in PRESETS if p not in catalog.entries()
                   and any(f.lower() in p.lower() for f in ns.names)]
        one = len(presets) == 1
        said = (f"; {', '.join(presets[:8])}{' ...' if len(presets) > 8 else ''} "
                f"{'is a preset' if one else 'are presets'}, which --model takes but this catalog (published "
                f"architectures with their sources) does not list" if presets else "")
        print(f"spmdkit models: no catalog model matches {' '.join(ns.names)[:80]!r}{said} "
              f"({len(catalog.entries())} models: spmdkit models lists them)", file=sys.stderr)
        return 2
    if ns.json:
        out.write(json.dumps(rows) + "\n")
        return 0
    header = ["model", "family", "layers", "hidden", "heads (/kv)", "experts", "params", "active", "published",
              "seq", "source"]
    table = []
    for r in rows:
        c = preset(r["name"])
        p = r["params"]
        total = _with_mtp(p["total"], p["mtp"]) if p else f"not built: {r['error']}"
        active = _with_mtp(p["active"], p["mtp_active"]) if p and c.experts else "-"
        table.append([r["name"] + "".join(f" ({a})" for a in r["aliases"]), r["family"], str(c.layers),
                      str(c.hidden), _heads(c), _experts(c), total, active, _published(r), str(c.seq), r["source"]])
    title = (f"{len(rows)} published architectures (--model NAME; params counted from the built training step; "
             f"published: as the source states them)")
    with fitted(out, terminal_width(out, ns.wide)) as fout:
        print_table(title, header, table, fout, optional=("source", "family", "seq", "active"))
    return 0


__all__ = ["add_models_command", "billions", "model_rows", "run_models"]
