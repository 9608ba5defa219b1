"""The checks of flags that several commands share: ``--annotate`` (:func:`parse_annotations`),
``--tp-plan`` (:func:`parse_tp_plan`), and the model flags checked into a
:data:`spmdkit.models.source.ModelSource` as ``spmdkit plan`` (under a strategy, ``--auto``
and ``--devices``) checks them; a bad one is a ProgramError naming the flag."""

from __future__ import annotations

import json
import os
from typing import Any

from spmdkit.cli.request import ModelArgs
from spmdkit.core.errors import ProgramError
from spmdkit.models.hf import dtype_name
from spmdkit.models.source import HFModel, ProgramFile
from spmdkit.planner.planning import clip_repr
from spmdkit.strategies.hf_patterns import check_patterns

#: The longest ``--annotate`` dims_mapping text, and the most entries one may have.
MAX_ANNOTATION_CHARS = 4096
MAX_ANNOTATION_RANK = 64


def _dims_mapping_ok(v: Any) -> bool:
    """A list of entries, each an int or a list of ints (co-shard), no bools, bounded size."""
    if not isinstance(v, list) or len(v) > MAX_ANNOTATION_RANK:
        return False
    for e in v:
        if isinstance(e, list):
            if len(e) > MAX_ANNOTATION_RANK or not all(type(x) is int for x in e):
                return False
        elif type(e) is not int:
            return False
    return True


def parse_annotations(items: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """``["x=[0,-1]", ...]`` -> ``{"x": [0, -1]}``; ProgramError naming ``--annotate`` for a
    malformed one (no ``=``, not JSON, too long or nested, not a list of ints / int lists)."""
    out: dict[str, Any] = {}
    for it in items:
        name, eq, dm = it.partition("=")
        name = name.strip()
        if not eq or not name:
            raise ProgramError(f"--annotate {clip_repr(it)}: expected TENSOR=DIMS_MAPPING, e.g. x=[0,-1]")
        if len(dm) > MAX_ANNOTATION_CHARS:
            raise ProgramError(f"--annotate {clip_repr(name)}: the dims_mapping is {len(dm)} characters "
                               f"(at most {MAX_ANNOTATION_CHARS})")
        try:
            v = json.loads(dm)
        except (ValueError, RecursionError):
            raise ProgramError(f"--annotate {clip_repr(it)}: the dims_mapping is not JSON (e.g. [0,-1])") from None
        if not _dims_mapping_ok(v):
            raise ProgramError(f"--annotate {clip_repr(it)}: the dims_mapping must be a list of mesh dims "
                               f"(ints, -1 for none, or lists of ints), at most {MAX_ANNOTATION_RANK} entries")
        out[name] = v
    return out


def parse_tp_plan(text: str | None) -> dict[str, str] | None:
    """``--tp-plan``: a JSON object (or a file holding one) of pattern -> role."""
    if text is None:
        return None
    if not text.lstrip().startswith("{"):
        if not os.path.isfile(text):
            raise ProgramError(f"--tp-plan {clip_repr(text)}: neither a JSON object nor an existing file")
        with open(text, encoding="utf-8") as f:
            text = f.read(1 << 20)
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        raise ProgramError(f"--tp-plan {clip_repr(text)}: not JSON (e.g. {{\"*.k_proj\": \"replicate\"}})") from None
    if not isinstance(obj, dict):
        raise ProgramError("--tp-plan: must be a JSON object of module-name pattern -> role")
    try:
        return dict(check_patterns(obj))
    except ProgramError as exc:
        raise ProgramError(f"--tp-plan: {exc}") from None


# -- the model -----------------------------------------------------------------------------------




def check_one_model(m: ModelArgs) -> None:
    """``--hf`` and ``--program`` exclude each other; ``--hf-config`` needs ``--hf``."""
    if m.hf is not None and m.program:
        raise ProgramError("--hf: give either --hf or --program, not both")
    if m.hf is None and m.hf_config is not None:
        raise ProgramError("--hf-config: configures an --hf model; give --hf CLASS too")
    if m.hf is None and m.fallback is not None:
        raise ProgramError(f"--fallback {m.fallback}: applies to --hf models (the ATen ops an import has no lowering for)")


def hf_source(m: ModelArgs, layers: int | None, batch: int | None, seq: int | None, *, verify: bool = False,
              name_cut: bool = False) -> HFModel:
    """``--hf CLASS`` with its ``--hf-config`` and ``--dtype``, at ``--batch`` x ``--seq``
    (default 2 x 16); ``--layers`` (and ``--verify``) refused. ``name_cut``: the class name in
    the message cut at 40 characters without saying how long it was (``--devices``)."""
    assert m.hf is not None
    if m.hf_config is None:
        shown = repr(m.hf[:40]) if name_cut else clip_repr(m.hf, 40)
        raise ProgramError(f"--hf {shown}: needs --hf-config FILE|JSON (the model's config)")
    for f, v in (("--layers", layers), ("--verify", verify or None)):
        if v is not None:
            raise ProgramError(f"{f}: does not apply to --hf (set num_hidden_layers in --hf-config)")
    dtype = dtype_name("float32" if m.dtype is None else m.dtype)
    return HFModel(m.hf, m.hf_config, dtype, batch or 2, seq or 16, fallback=m.fallback or "error",
                   vocab_divisible_by=m.vocab_divisible_by)


def program_source(m: ModelArgs, layers: int | None, batch: int | None, seq: int | None) -> ProgramFile:
    """``--program FILE``; a preset's size flags refused."""
    assert m.program
    given = [f for f, v in (("--layers", layers), ("--batch", batch), ("--seq", seq)) if v is not None]
    if given:
        raise ProgramError(f"{given[0]}: overrides a preset's size; it does not apply to --program")
    if m.vocab_divisible_by is not None:
        raise ProgramError(f"--make-vocab-size-divisible-by {m.vocab_divisible_by}: pads an --hf model's, a preset's or "
                           f"a --model-config's vocabulary; a --program file's shapes are its own (give its vocabulary "
                           f"axis padded in the file)")
    return ProgramFile(m.program)


__all__ = ["MAX_ANNOTATION_CHARS", "MAX_ANNOTATION_RANK", "check_one_model", "hf_source", "parse_annotations",
           "parse_tp_plan", "program_source"]
