"""The catalog: published architectures as data (``--model NAME``, ``spmdkit models``).

Each family is one JSON file in ``models/catalog/``: ``{"family": ..., "models": [entry, ...]}``,
an entry the :class:`~spmdkit.models.zoo.ModelConfig` fields of the model as its config.json
or paper gives them (fields left out take the arch's defaults; ``batch`` 1 and ``dtype``
bfloat16 unless given; ``seq`` the context the model was trained at), and beside them:
``name`` (and ``aliases``), ``family``, ``source`` (the config.json or paper the sizes come
from), ``published`` (the parameter counts as the source states them: ``total``, ``active``
for MoE, or ``embedding`` / ``non_embedding`` where that is what it states, and ``where``: the
page that states them, and ``active_without_token_embedding``: true where the source's active
count leaves the token embedding out) and ``notes`` (what of the architecture is not modelled).

This module reads the data only (it imports no model code): :func:`spmdkit.models.zoo.preset`
resolves a catalog name through :func:`config_fields`, and :mod:`spmdkit.models.params`
counts a built model's parameters to set beside :attr:`Entry.published`.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from spmdkit.core.errors import ProgramError

#: the keys of an entry that are not ModelConfig fields
META_KEYS = ("name", "aliases", "family", "source", "published", "notes")
#: the figures ``published`` may state
FIGURES = ("total", "active", "embedding", "non_embedding")
#: what an entry's config takes unless it says otherwise
DEFAULTS: Mapping[str, Any] = {"batch": 1, "dtype": "bfloat16"}


@dataclass(frozen=True)
class Entry:
    """One published architecture."""

    name: str
    family: str
    #: the ModelConfig fields (batch, dtype and name filled in)
    fields: Mapping[str, Any]
    source: str
    #: figure name (total, active, embedding, non_embedding) -> the figure as stated ("8.03B")
    published: Mapping[str, str]
    #: the page stating the published figures
    where: str = ""
    notes: str = ""
    aliases: tuple[str, ...] = field(default_factory=tuple)
    #: the source counts active parameters without the token embedding table (a token reads
    #: one row of it: DeepSeek), where others count every parameter of the experts it uses
    active_without_token_embedding: bool = False


def _entry(raw: Any, where: str) -> Entry:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str):
        raise ProgramError(f"catalog {where}: an entry without a name")
    name = raw["name"]
    pub = dict(raw.get("published") or {})
    page = str(pub.pop("where", ""))
    lookup_only = bool(pub.pop("active_without_token_embedding", False))
    bad = [k for k in pub if k not in FIGURES]
    if bad or not pub or not isinstance(raw.get("source"), str):
        raise ProgramError(f"catalog {where} {name}: needs a source and published figures ({', '.join(FIGURES)})")
    for text in pub.values():
        figure(text)
    fields = {**DEFAULTS, **{k: v for k, v in raw.items() if k not in META_KEYS}, "name": name}
    return Entry(name, str(raw.get("family", "")), fields, raw["source"], pub, page, str(raw.get("notes", "")),
                 tuple(raw.get("aliases", ())), lookup_only)


@functools.cache
def entries() -> dict[str, Entry]:
    """Every catalog entry by name, in the files' order (files sorted by name)."""
    out: dict[str, Entry] = {}
    folder = resources.files("spmdkit.models").joinpath("catalog")
    for item in sorted(folder.iterdir(), key=lambda p: p.name):
        if not item.name.endswith(".json"):
            continue
        data = json.loads(item.read_text(encoding="utf-8"))
        for raw in data["models"]:
            e = _entry(raw, item.name)
            for n in (e.name, *e.aliases):
                if n in out:
                    raise ProgramError(f"catalog {item.name}: {n!r} is named twice")
            out[e.name] = e
    return out


@functools.cache
def _aliases() -> dict[str, str]:
    return {a: e.name for e in entries().values() for a in e.aliases}


def lookup(name: str) -> Entry | None:
    """The entry named ``name`` (or one of its aliases), or None."""
    got = entries()
    return got.get(name) or got.get(_aliases().get(name, ""))


def names() -> list[str]:
    """The catalog's names (aliases apart)."""
    return list(entries())


def config_fields(name: str) -> dict[str, Any] | None:
    """The ModelConfig fields of the catalog model ``name``, or None where there is none."""
    e = lookup(name)
    return None if e is None else dict(e.fields)


def matches(text: str, count: float) -> bool:
    """``count`` is the stated figure ``text`` rounded or truncated to its last stated digit
    (sources do both: Qwen's 7.61B is 7.6156B truncated, HF's 7.62B the same count rounded)."""
    value, half = figure(text)
    return abs(count - value) <= half or value <= count < value + 2 * half


def unknown_message(name: str, presets: list[str]) -> str:
    """The error for a ``--model`` name that is neither a preset nor in the catalog: the presets,
    where the catalog is listed, and the closest name."""
    close = difflib.get_close_matches(name, [*presets, *entries(), *_aliases()], n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return (f"--model: no preset {name[:60]!r} nor catalog model (presets: {', '.join(sorted(presets))}; "
            f"`spmdkit models` lists the {len(entries())} catalog models{hint})")


_FIGURE = re.compile(r"^(\d+)(?:\.(\d+))?([KMBT]?)$")
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def figure(text: str) -> tuple[float, float]:
    """(value, half a unit of its last stated digit) of a stated figure: ``"8.03B"`` is
    (8.03e9, 5e6), ``"671B"`` (671e9, 5e8), ``"176247271424"`` (that, 0.5); trailing zeros of a
    whole number are not significant (``"25600M"``: 50M)."""
    m = _FIGURE.match(str(text).replace(",", ""))
    if not m:
        raise ProgramError(f"catalog: published figure {str(text)[:20]!r} is not a number like 8.03B")
    whole, frac, unit = m.group(1), m.group(2) or "", m.group(3)
    scale = _UNITS[unit]
    if frac:
        return int(whole + frac) * scale / 10 ** len(frac), scale / 10 ** len(frac) / 2
    zeros = len(whole) - len(whole.rstrip("0")) if whole.strip("0") else 0
    return float(int(whole) * scale), 10**zeros * scale / 2


__all__ = ["DEFAULTS", "FIGURES", "Entry", "config_fields", "entries", "figure", "lookup", "matches", "names", "unknown_message"]
