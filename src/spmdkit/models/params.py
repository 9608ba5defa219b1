"""A model's parameter count, from its built program: total, embedding (the token and position
tables and the LM head) and, for a MoE model, active (what one token's forward uses).

The layers of a zoo model past its first ``dense_layers`` are alike, so the count builds
``dense_layers + 1`` and ``dense_layers + 2`` layers (each a second at most) and scales the
difference to the model's depth: the count of a 671B model without building its 61 layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from spmdkit.models.catalog import Entry, matches
from spmdkit.models.zoo import Model, ModelConfig, build_model
from spmdkit.program.ir import Program

#: the roles of the embedding tables (what a non-embedding count leaves out)
EMBEDDING_ROLES = ("embedding", "position", "head")


@dataclass(frozen=True)
class ParamCount:
    """A model's parameters."""

    total: int
    #: the token and position embeddings and the LM head (untied)
    embedding: int
    #: one token's: the total less the routed experts it is not sent to (the total for a dense model)
    active: int
    #: the token embedding table (part of ``embedding``; the LM head too where tied)
    token_embedding: int = 0

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def parameters(prog: Program) -> dict[str, int]:
    """Parameter name -> elements, of a built program (the updated copies apart)."""
    return {n: t.numel for n, t in prog.tensors.items() if t.kind == "parameter" and not t.inplace_of}


def _expert_params(model: Model, layer: int) -> int:
    """The routed experts' parameters in layer ``layer`` of ``model`` (the stacks
    ``layers.<i>.experts.*``, one slice an expert; the shared experts and the router apart)."""
    prefix = f"layers.{layer}.experts."
    return sum(n for p, n in parameters(model.program).items() if p.startswith(prefix))


def _counts(model: Model) -> tuple[int, int, int]:
    params = parameters(model.program)
    emb = sum(n for p, n in params.items() if model.roles.get(p) in EMBEDDING_ROLES)
    tok = sum(n for p, n in params.items() if model.roles.get(p) == "embedding")
    return sum(params.values()), emb, tok


def count_params(cfg: ModelConfig) -> ParamCount:
    """The parameters of ``cfg`` at its full depth (built at two small depths and scaled: one
    more period of layers, a period of ``full_attention_interval`` layers in a hybrid model)."""
    period = cfg.full_attention_interval or 1
    first = (cfg.dense_layers + 1 if cfg.experts else 1) + period - 1
    if cfg.layers <= first + period or (cfg.layers - first) % period:
        model = build_model(cfg, validate=False, check_rules=False)
        total, emb, tok = _counts(model)
        experts = sum(_expert_params(model, i) for i in range(cfg.layers) if cfg.is_moe_layer(i))
    else:
        small = build_model(cfg.with_(layers=first), validate=False, check_rules=False)
        big = build_model(cfg.with_(layers=first + period), validate=False, check_rules=False)
        (t1, emb, tok), (t2, _, _) = _counts(small), _counts(big)
        total = t1 + (t2 - t1) * ((cfg.layers - first) // period)
        experts = _expert_params(big, first) * (cfg.layers - cfg.dense_layers) if cfg.experts else 0
    active = total - experts + experts * cfg.top_k // cfg.experts if cfg.experts else total
    return ParamCount(total, emb, active, tok)


def as_published(entry: Entry, count: ParamCount) -> dict[str, int]:
    """The figures ``entry`` publishes, as ``count`` gives them (its active count without the
    token embedding where the source counts it so)."""
    active = count.active - (count.token_embedding if entry.active_without_token_embedding else 0)
    got = {"total": count.total, "active": active, "embedding": count.embedding,
           "non_embedding": count.non_embedding}
    return {k: got[k] for k in entry.published}


def mismatches(entry: Entry, count: ParamCount) -> list[tuple[str, str, int]]:
    """(figure, as stated, as counted) of each published figure of ``entry`` that ``count``,
    rounded or truncated to the figure's last stated digit, is not."""
    got = as_published(entry, count)
    return [(k, text, got[k]) for k, text in entry.published.items() if not matches(text, got[k])]


__all__ = ["EMBEDDING_ROLES", "ParamCount", "as_published", "count_params", "mismatches", "parameters"]
