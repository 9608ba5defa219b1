"""A model's parameter count, from its built program: total, embedding (the token and position
tables and the LM head) and, for a MoE model, active (what one token's forward uses).

The layers of a zoo model past its first ``dense_layers`` are alike, so the count builds
``dense_layers + 1`` and ``dense_layers + 2`` layers (each a second at most) and scales the
difference to the model's depth: the count of a 671B model without building its 61 layers.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def _counts(model: Model) -> tuple[int, int]:
    params = parameters(model.program)
    emb = sum(n for p, n in params.items() if model.roles.get(p) in EMBEDDING_ROLES)
    return sum(params.values()), emb


def count_params(cfg: ModelConfig) -> ParamCount:
    """The parameters of ``cfg`` at its full depth (built at two small depths and scaled)."""
    first = cfg.dense_layers + 1 if cfg.experts else 1
    if cfg.layers <= first:
        model = build_model(cfg, validate=False, check_rules=False)
        total, emb = _counts(model)
        experts = sum(_expert_params(model, i) for i in range(cfg.layers) if cfg.is_moe_layer(i))
    else:
        small = build_model(cfg.with_(layers=first), validate=False, check_rules=False)
        big = build_model(cfg.with_(layers=first + 1), validate=False, check_rules=False)
        (t1, emb), (t2, _) = _counts(small), _counts(big)
        total = t1 + (t2 - t1) * (cfg.layers - first)
        experts = _expert_params(big, first) * (cfg.layers - cfg.dense_layers) if cfg.experts else 0
    active = total - experts + experts * cfg.top_k // cfg.experts if cfg.experts else total
    return ParamCount(total, emb, active)


__all__ = ["EMBEDDING_ROLES", "ParamCount", "count_params", "parameters"]
