"""The tensor-parallel roles of an imported program's parameters (:mod:`spmdkit.strategies.hf`):
the user's module-name patterns first, then the column / row roles the graph gives the linears of
the numbered blocks (:mod:`spmdkit.strategies.hf_roles`), then the default patterns below, by
module path (a parameter's name without ``.weight`` / ``.bias``, or a tied parameter's other
names), first match wins.

Default patterns (:data:`DEFAULT_PATTERNS`; a pattern is a glob over the module path that
also matches any ``.``-suffix, so ``"q_proj"`` matches ``model.layers.3.self_attn.q_proj``;
a pattern starting ``re:`` is a regular expression, full match):

==========================================================  =========
q_proj k_proj v_proj gate_proj up_proj fc1 c_fc query key    column
value wi wi_0 wi_1 q k v (T5), intermediate.dense (BERT),
c_attn (GPT-2's fused q/k/v, split head-wise),
relative_attention_bias (T5's table: heads over tp)
o_proj down_proj fc2 c_proj wo o out_proj dense              row
(attention.output.dense and output.dense of BERT, Phi's dense)
embed_tokens wte word_embeddings shared lm_head embed_out    vocab
cls.predictions (BERT's decoder bias)
transform.dense, pooler.dense                                replicate
==========================================================  =========

Standard library only.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
import warnings
from collections.abc import Iterable, Mapping

from spmdkit.core.errors import ProgramError
from spmdkit.program.ir import Program
from spmdkit.strategies.hf_fused import fused_parts
from spmdkit.strategies.hf_program import module_paths, parameters
from spmdkit.strategies.hf_roles import BlockRoles, block_roles, weight_of

ROLES = ("column", "row", "vocab", "replicate")

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "c_fc", "query", "key", "value",
           "wi", "wi_0", "wi_1", "q", "k", "v", "w1", "w3")
KV_NAMES = ("k_proj", "v_proj", "key", "value", "k", "v")  # kv projections: replicated when kv heads < tp
_ROW = ("o_proj", "down_proj", "fc2", "c_proj", "wo", "o", "out_proj", "w2")
_VOCAB = ("embed_tokens", "wte", "word_embeddings", "shared", "lm_head", "embed_out", "embed_in",
          "cls.predictions.decoder", "cls.predictions")

#: (pattern, role) in the order they are tried (after the user's).
DEFAULT_PATTERNS: tuple[tuple[str, str], ...] = (
    ("c_attn", "column"),  # fused q/k/v: split head-wise (split_fused_projections)
    ("transform.dense", "replicate"),
    ("pooler.dense", "replicate"),
    ("intermediate.dense", "column"),
    ("relative_attention_bias", "column"),
    ("dense", "row"),
    *((p, "column") for p in _COLUMN),
    *((p, "row") for p in _ROW),
    *((p, "vocab") for p in _VOCAB),
)


def _matches(pattern: str, path: str) -> bool:
    if pattern.startswith("re:"):
        return re.fullmatch(pattern[3:], path) is not None
    return fnmatch.fnmatchcase(path, pattern) or fnmatch.fnmatchcase(path, "*." + pattern)


def check_patterns(patterns: Mapping[str, str] | Iterable[tuple[str, str]] | None) -> list[tuple[str, str]]:
    """The user's patterns as (pattern, role) pairs; ProgramError for a role not in
    :data:`ROLES` or a regular expression that does not compile."""
    items = list(patterns.items() if isinstance(patterns, Mapping) else (patterns or ()))
    out: list[tuple[str, str]] = []
    for k, v in items:
        if not isinstance(k, str) or not k:
            raise ProgramError(f"tp pattern {k!r}: must be a non-empty string (a glob or re:REGEX)")
        if v not in ROLES:
            raise ProgramError(f"tp pattern {k!r}: role {v!r} is not one of {', '.join(ROLES)}")
        if k.startswith("re:"):
            try:
                re.compile(k[3:])
            except re.error as exc:
                raise ProgramError(f"tp pattern {k!r}: not a regular expression: {exc}") from None
        out.append((k, v))
    return out


def warn_unmatched(prog: Program, patterns: list[tuple[str, str]]) -> None:
    """A UserWarning naming each of the user's ``--tp-plan`` patterns that matches no module
    holding a parameter: a misspelt module name decides nothing, and is said so."""
    paths = {path for p in parameters(prog) for path in module_paths(prog, p)}
    names = sorted({path.rsplit(".", 1)[-1] for path in paths if not path.rsplit(".", 1)[-1].isdigit()})
    for k, _ in patterns:
        if any(_matches(k, path) for path in paths):
            continue
        close = difflib.get_close_matches(k.rsplit(".", 1)[-1], names, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"its modules end in {', '.join(names[:8])}"
        warnings.warn(f"--tp-plan: {k!r} matches no module of the model holding a parameter ({hint}): it decides "
                      f"nothing", UserWarning, stacklevel=2)


def role_of(path: str, patterns: Iterable[tuple[str, str]]) -> str | None:
    """The role of the module ``path`` under ``patterns`` (first match), else None."""
    for k, v in patterns:
        if _matches(k, path):
            return v
    return None


def tp_roles(prog: Program, patterns: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
             found: BlockRoles | None = None) -> dict[str, str]:
    """parameter -> role (``column`` / ``row`` / ``vocab``; replicated ones left out): the
    user's ``patterns`` first, then the roles the graph gives the linears of the numbered
    blocks (:func:`spmdkit.strategies.hf_roles.block_roles`; ``found`` when already
    computed), then :data:`DEFAULT_PATTERNS` by module name."""
    user = check_patterns(patterns)
    graph = (found or block_roles(prog)).roles
    out: dict[str, str] = {}
    decided: set[str] = set()
    for p in parameters(prog):
        paths = module_paths(prog, p)
        r = next((r for path in paths if (r := role_of(path, user)) is not None), None)
        part = fused_parts(prog).get(p)
        key = p if p in graph else part.weight if part is not None else paths[0] + ".weight"  # a layer's weight, or its bias
        if r is None and key in graph:
            r = graph[key]
        if r is None:
            r = next((r for path in paths if (r := role_of(path, DEFAULT_PATTERNS)) is not None), None)
        if r is not None:
            decided.add(p)
        if r is not None and r != "replicate":
            out[p] = r
    # a bias nothing above decides goes with its linear (the matmul whose output it is added to):
    # a vocab-parallel LM head's bias (DistilBERT's vocab_projector) sharded as the logits
    producer = {o: op for op in prog.ops if op.phase == "forward" for o in op.output_names()}
    for op in prog.ops:
        b, x = op.inputs.get("y"), op.inputs.get("x")
        if op.phase != "forward" or op.rule != "add" or not isinstance(b, str) or not isinstance(x, str) \
                or b in decided or prog.tensors[b].kind != "parameter" or len(prog.tensors[b].shape) != 1:
            continue
        mm = producer.get(x)
        y = mm.inputs.get("y") if mm is not None and mm.rule == "matmul" else None
        w = weight_of(prog, y, producer) if isinstance(y, str) else None
        role = out.get(w[0]) if w is not None else None
        if role in ("column", "vocab") and prog.tensors[b].shape[-1] == prog.tensors[x].shape[-1]:
            out[b] = role
    return out


__all__ = ["DEFAULT_PATTERNS", "KV_NAMES", "ROLES", "check_patterns", "role_of", "tp_roles", "warn_unmatched"]
