"""A model's parameter count, from its built program: total, embedding (the token and position
tables and the LM head) and, for a MoE model, active (what one token's forward uses).

The layers of a zoo model past its first ``dense_layers`` are alike, so the count builds
``dense_layers + 1`` and ``dense_layers + 2`` layers (each a second at most) and scales the
difference to the model's depth: the count of a 671B model without building its 61 layers. The
multi-token-prediction modules (``mtp_layers``) are in the total and counted apart too
(``ParamCount.mtp``): DeepSeek-V3 is 671.03B and its MTP module 11.61B (682.64B), the report's
"14B" counting the checkpoint's own copies of the embedding and the head (2 x 0.93B) beside.
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
    #: the multi-token-prediction modules' own parameters (part of ``total``; their embedding
    #: and head are the model's: :mod:`spmdkit.models.zoo_mtp`)
    mtp: int = 0
    #: the part of ``mtp`` one token's forward uses (part of ``active``)
    mtp_active: int = 0

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding


def parameters(prog: Program) -> dict[str, int]:
    """Parameter name -> elements, of a built program (the updated copies apart)."""
    return {n: t.numel for n, t in prog.tensors.items() if t.kind == "parameter" and not t.inplace_of}


def _prefixed(model: Model, prefix: str) -> int:
    """The parameters of ``model`` whose names start with ``prefix``: ``layers.<i>.experts.``, the
    routed experts of layer i (the stacks, one slice an expert; the shared experts and the router
    apart); ``mtp.``, the multi-token-prediction modules'; ``mtp.<k>.experts.``, module k's experts."""
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
        experts = sum(_prefixed(model, f"layers.{i}.experts.") for i in range(cfg.layers) if cfg.is_moe_layer(i))
    else:
        small = build_model(cfg.with_(layers=first), validate=False, check_rules=False)
        big = build_model(cfg.with_(layers=first + period), validate=False, check_rules=False)
        (t1, emb, tok), (t2, _, _) = _counts(small), _counts(big)
        total = t1 + (t2 - t1) * ((cfg.layers - first) // period)
        experts = _prefixed(big, f"layers.{first}.experts.") * (cfg.layers - cfg.dense_layers) if cfg.experts else 0
        model = small
    mtp = _prefixed(model, "mtp.")
    mtp_experts = sum(_prefixed(model, f"mtp.{k}.experts.") for k in range(cfg.mtp_layers))
    experts += mtp_experts
    active = total - experts + experts * cfg.top_k // cfg.experts if cfg.experts else total
    mtp_active = mtp - mtp_experts + mtp_experts * cfg.top_k // cfg.experts if cfg.experts else mtp
    return ParamCount(total, emb, active, tok, mtp, mtp_active)


def as_published(entry: Entry, count: ParamCount) -> dict[str, int]:
    """The figures ``entry`` publishes, as ``count`` gives them (its active count without the
    token embedding where the source counts it so), the multi-token-prediction modules left out:
    the sources count the main model (DeepSeek-V3's 671B / 37B, "14B of the MTP module" beside)."""
    active = count.active - count.mtp_active - (count.token_embedding if entry.active_without_token_embedding else 0)
    got = {"total": count.total - count.mtp, "active": active, "embedding": count.embedding,
           "non_embedding": count.non_embedding - count.mtp}
    return {k: got[k] for k in entry.published}


def mismatches(entry: Entry, count: ParamCount) -> list[tuple[str, str, int]]:
    """(figure, as stated, as counted) of each published figure of ``entry`` that ``count``,
    rounded or truncated to the figure's last stated digit, is not."""
    got = as_published(entry, count)
    return [(k, text, got[k]) for k, text in entry.published.items() if not matches(text, got[k])]


__all__ = ["EMBEDDING_ROLES", "ParamCount", "as_published", "count_params", "mismatches", "parameters"]
