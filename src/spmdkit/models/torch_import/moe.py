"""HuggingFace mixture-of-experts blocks found by structure and exported as two opaque ops, so the
importer lowers them to the ops the zoo's MoE uses (:mod:`spmdkit.models.zoo_moe`): router
``matmul`` -> ``softmax`` / ``sigmoid`` -> ``moe_gate_dispatch`` (the batch axis first: [B, E, C, H])
-> the experts' batched GEMMs on ``[E, in, out]`` stacks -> ``moe_combine``
(:mod:`spmdkit.models.torch_import.aten.moe`).

A block is a module with two children: an experts module holding 3-D parameter banks
(``[E, 2F, H]`` gate and up fused, ``[E, H, F]`` down, or transposed) with HF's experts interface
(transformers' ``use_experts_implementation``: ``has_gate``, ``is_transposed``,
``is_concatenated``, ``has_bias``, ``has_post_expert_norm`` and the default ``_apply_gate``), and a
router: a child with a ``[E, H]`` weight and ``top_k`` whose call returns ``(logits, weights,
indices)`` (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3: whatever the classes are called). What the
router computes is found by running it on a probe (random weights and tokens, float32) against
the routings the ops express (:func:`route`): gate values by ``softmax`` or ``sigmoid`` over the
experts, the top ``k`` chosen by those values plus a correction bias (DeepSeek-V3's
``e_score_correction_bias``), optionally group-limited (DeepSeek-V3's ``n_group`` /
``topk_group``), the chosen values renormalised (``norm_topk_prob``) and scaled
(``routed_scaling_factor``). A block whose router matches none, or whose experts use a bias, a
post-expert norm, an interleaved gate / up layout or their own gate, is left to the generic lowering
(HF's grouped matmul), with a warning.

:func:`moe_blocks` finds the blocks; :func:`lowered_moe` (a context manager, around
``torch.export``) replaces their routers' and experts' forwards by ``spmdkit::moe_route`` and
``spmdkit::moe_experts`` (custom ops: torch.export keeps each as one node; their eager bodies are
the routing and the experts computed as HF does, so the patched module still runs). The module
itself is untouched afterwards.
"""

from __future__ import annotations

import contextlib
import math
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

#: the activations the experts lowering emits (config.hidden_act -> (rule, gelu approximate))
ACTIVATIONS = {"silu": ("silu", False), "swish": ("silu", False), "gelu": ("gelu", False),
               "gelu_pytorch_tanh": ("gelu", True), "gelu_new": ("gelu", True), "gelu_fast": ("gelu", True),
               "relu": ("relu", False)}


@dataclass(frozen=True)
class Routing:
    """What a router computes (see the module docstring)."""

    score: str = "softmax"  # or "sigmoid"
    bias: bool = False  # the top k chosen by score + the router's correction bias
    norm: bool = False  # the chosen values divided by their sum
    scale: float = 1.0  # then multiplied by this
    groups: int = 1  # group-limited top-k: the experts in `groups` groups, the top `topk_group` kept
    topk_group: int = 1

    def describe(self) -> str:
        parts = [f"{self.score} gate values"]
        if self.bias:
            parts.append("top-k chosen with the correction bias added")
        if self.groups > 1 and self.topk_group < self.groups:
            parts.append(f"group-limited top-k ({self.groups} groups, {self.topk_group} kept)")
        if self.norm:
            parts.append("the chosen values renormalised")
        if self.scale != 1.0:
            parts.append(f"scaled by {self.scale:g}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Block:
    """One MoE block: its path, its router's and experts' paths, the routing, the experts'
    layout (gated: gate and up fused in one bank; transposed: banks ``[E, in, out]``), the
    activation (rule, approximate), the experts and their top k."""

    path: str
    router: str
    experts: str
    routing: Routing
    gated: bool
    transposed: bool
    act: tuple[str, bool]
    num_experts: int
    top_k: int
    bias_name: str | None = None


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, r: Routing, k: int,
          scores_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits, top-k weights, top-k indices) of tokens ``x`` [T, H] under routing ``r``,
    computed as HF's routers compute them (the scores in ``scores_dtype``: float32 in every HF
    router, :func:`_router_dtypes`)."""
    x2 = x.reshape(-1, x.shape[-1])
    logits = F.linear(x2.to(weight.dtype), weight)
    s = logits.to(scores_dtype)
    scores = torch.softmax(s, dim=-1) if r.score == "softmax" else torch.sigmoid(s)
    choice = scores + bias.float() if r.bias and bias is not None else scores
    if r.groups > 1 and r.topk_group < r.groups:
        e = choice.shape[-1]
        grouped = choice.view(-1, r.groups, e // r.groups)
        gscore = grouped.topk(min(2, e // r.groups), dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(gscore).scatter_(1, torch.topk(gscore, r.topk_group, dim=-1)[1], 1.0)
        mask = keep.unsqueeze(-1).expand(-1, r.groups, e // r.groups).reshape(-1, e)
        choice = choice.masked_fill(mask == 0, float("-inf"))
    idx = torch.topk(choice, k, dim=-1)[1]
    w = scores.gather(1, idx)
    if r.norm:
        w = w / w.sum(dim=-1, keepdim=True)
    return logits, w * r.scale, idx


def experts_forward(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                    act: str, approximate: bool, gated: bool, transposed: bool) -> torch.Tensor:
    """HF's experts (``gate_up_proj`` [E, 2F, H] / ``down_proj`` [E, H, F], ``[E, in, out]`` when
    transposed): each token's chosen experts on it, weighted and summed."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(up.shape[0]):
        tok, pos = torch.where(idx == e)
        if tok.numel() == 0:
            continue
        wu = up[e] if transposed else up[e].t()
        h = x[tok].to(wu.dtype) @ wu
        if gated:
            g, u = h.chunk(2, dim=-1)
            h = _act(g, act, approximate) * u
        else:
            h = _act(h, act, approximate)
        wd = down[e] if transposed else down[e].t()
        y = h @ wd
        out.index_add_(0, tok, (y.float() * w[tok, pos, None].float()))
    return out.to(x.dtype)


def _act(x: torch.Tensor, act: str, approximate: bool) -> torch.Tensor:
    if act == "silu":
        return F.silu(x)
    if act == "gelu":
        return F.gelu(x, approximate="tanh" if approximate else "none")
    return F.relu(x)


# -- the custom ops torch.export keeps whole ---------------------------------------------------------


@torch.library.custom_op("spmdkit::moe_route", mutates_args=())
def moe_route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, score: str, bias_used: bool,
              norm: bool, scale: float, groups: int, topk_group: int, top_k: int, batch: int,
              weights_dtype: torch.dtype, chunks: int, scores_dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r = Routing(score, bias_used, norm, scale, groups, topk_group)
    logits, w, idx = route(x, weight, bias, r, top_k, scores_dtype)
    return logits, w.to(weights_dtype), idx


@moe_route.register_fake
def _moe_route_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, score: str, bias_used: bool,
                    norm: bool, scale: float, groups: int, topk_group: int, top_k: int, batch: int,
                    weights_dtype: torch.dtype, chunks: int, scores_dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = math.prod(x.shape[:-1])
    logits = x.new_empty((t, weight.shape[0]), dtype=weight.dtype)
    return logits, x.new_empty((t, top_k), dtype=weights_dtype), x.new_empty((t, top_k), dtype=torch.int64)


@torch.library.custom_op("spmdkit::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                act: str, approximate: bool, gated: bool, transposed: bool, capacity: int) -> torch.Tensor:
    return experts_forward(x, idx, w, up, down, act, approximate, gated, transposed)


@moe_experts.register_fake
def _moe_experts_fake(x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                      act: str, approximate: bool, gated: bool, transposed: bool, capacity: int) -> torch.Tensor:
    return torch.empty_like(x)


# -- finding the blocks --------------------------------------------------------------------------------


def _banks(m: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in m.named_parameters(recurse=False) if p.dim() == 3}


def _experts_layout(m: torch.nn.Module) -> tuple[bool, bool, int] | str:
    """(gated, transposed, E) of an experts module with HF's interface, or why it is not lowered."""
    if not hasattr(m, "has_gate") or not hasattr(m, "is_transposed"):
        return "no experts interface"
    banks = _banks(m)
    gated = bool(m.has_gate)
    first = "gate_up_proj" if gated else "up_proj"
    if first not in banks or "down_proj" not in banks:
        return f"no {first} / down_proj banks"
    if getattr(m, "has_bias", False) or getattr(m, "has_post_expert_norm", False):
        return "experts with a bias or a post-expert norm"
    if gated and not getattr(m, "is_concatenated", True):
        return "an interleaved gate / up layout"
    from transformers.integrations.moe import _default_apply_gate

    if gated and getattr(type(m), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        return "its own gate function"
    return gated, bool(m.is_transposed), banks[first].shape[0]


def _activation(m: torch.nn.Module) -> tuple[str, bool] | None:
    cfg = getattr(m, "config", None)
    name = getattr(cfg, "hidden_act", None)
    return ACTIVATIONS.get(name) if isinstance(name, str) else None


def _router_of(parent: torch.nn.Module, experts: torch.nn.Module, e: int) -> tuple[str, torch.nn.Module] | None:
    for name, c in parent.named_children():
        w = getattr(c, "weight", None)
        if c is experts or not isinstance(w, torch.nn.Parameter) or w.dim() != 2 or w.shape[0] != e:
            continue
        if isinstance(getattr(c, "top_k", None), int):
            return name, c
    return None


def _candidates(router: torch.nn.Module, has_bias: bool) -> Iterator[Routing]:
    scale = float(getattr(router, "routed_scaling_factor", 1.0) or 1.0)
    groups = int(getattr(router, "num_group", getattr(router, "n_group", 1)) or 1)
    topk_group = int(getattr(router, "topk_group", groups) or groups)
    for score in ("softmax", "sigmoid"):
        for bias in ((False, True) if has_bias else (False,)):
            for norm in (False, True):
                for sc in dict.fromkeys((scale, 1.0)):
                    for g in dict.fromkeys(((groups, topk_group), (1, 1))):
                        yield Routing(score, bias, norm, sc, *g)


def identify_routing(router: torch.nn.Module, e: int, k: int) -> tuple[Routing, str | None] | None:
    """The routing (and the correction bias buffer's name) that reproduces ``router``'s top-k
    indices and weights on a probe, or None."""
    w = next(p for p in router.parameters(recurse=False) if p.dim() == 2)
    wname = next(n for n, p in router.named_parameters(recurse=False) if p is w)
    bufs = {n: b for n, b in router.named_buffers(recurse=False) if b.dim() == 1 and b.shape[0] == e
            and b.is_floating_point()}
    bias_name = next(iter(bufs), None)
    g = torch.Generator().manual_seed(1234)
    h = w.shape[1]
    x = torch.randn(11, h, generator=g)
    state: dict[str, torch.Tensor] = {wname: torch.randn(e, h, generator=g) / math.sqrt(h)}
    if bias_name is not None:
        state[bias_name] = torch.randn(e, generator=g) * 0.3
    for n, b in router.named_buffers(recurse=False):
        state.setdefault(n, b.detach().clone() if not getattr(b, "is_meta", False) else torch.zeros(b.shape))
    try:
        with torch.no_grad():
            out = torch.func.functional_call(router, state, (x,))
    except Exception:  # a router that cannot run on a probe is not lowered
        return None
    if not isinstance(out, tuple) or len(out) != 3:
        return None
    _, got_w, got_i = out
    if not isinstance(got_i, torch.Tensor) or got_i.shape != (11, k) or got_i.dtype not in (torch.int64, torch.int32):
        return None
    order = torch.argsort(got_i, dim=-1)
    gi, gw = got_i.gather(1, order), got_w.float().gather(1, order)
    for r in _candidates(router, bias_name is not None):
        if r.groups > 1 and (e % r.groups or r.topk_group > r.groups):
            continue
        _, ww, ii = route(x, state[wname], state.get(bias_name) if bias_name else None, r, k)
        o = torch.argsort(ii, dim=-1)
        if torch.equal(ii.gather(1, o), gi.long()) and torch.allclose(ww.gather(1, o), gw, rtol=1e-5, atol=1e-6):
            return r, (bias_name if r.bias else None)
    return None


def _router_key(router: torch.nn.Module, e: int, k: int) -> tuple[Any, ...]:
    """What decides a router's routing: its class, its scalar settings (top_k, groups, scaling,
    normalisation flags), its weight's shape and its buffers' names and shapes; two routers with
    the same key route alike, so one probe answers for both (a router with its own forward or
    hooks is probed on its own)."""
    plain = tuple(sorted((n, v) for n, v in vars(router).items()
                         if not n.startswith("_") and isinstance(v, (bool, int, float, str))))
    shapes = tuple((n, tuple(t.shape)) for n, t in (*router.named_parameters(recurse=False),
                                                      *router.named_buffers(recurse=False)))
    own = "forward" in vars(router) or bool(router._forward_hooks or router._forward_pre_hooks)
    return (type(router), e, k, plain, shapes, id(router) if own else None)  # a patched router: its own probe


def moe_blocks(module: torch.nn.Module, warn: bool = True) -> list[Block]:
    """The MoE blocks of ``module`` (see the module docstring); a block found but not lowerable
    is a warning naming it and why (``warn``)."""
    found: list[Block] = []
    probed: dict[tuple[Any, ...], tuple[Routing, str | None] | None] = {}
    named = dict(module.named_modules())
    for path, m in named.items():
        if not _banks(m) or not hasattr(m, "has_gate"):
            continue
        parent_path = path.rpartition(".")[0] if "." in path else ""
        parent = named.get(parent_path)
        layout = _experts_layout(m)
        why = layout if isinstance(layout, str) else None
        act = _activation(m)
        rt = None
        if why is None and act is None:
            why = f"activation {getattr(getattr(m, 'config', None), 'hidden_act', None)!r}"
        if why is None and parent is not None:
            assert not isinstance(layout, str)
            rt = _router_of(parent, m, layout[2])
            if rt is None:
                why = "no router ([experts, hidden] weight and top_k) beside the experts"
        if why is None and rt is not None:
            assert not isinstance(layout, str) and act is not None
            k = int(getattr(rt[1], "top_k"))  # noqa: B009 - a module attribute mypy reads as a submodule
            key = _router_key(rt[1], layout[2], k)
            if key not in probed:  # one probe per kind of router: the layers of a model share it
                probed[key] = identify_routing(rt[1], layout[2], k)
            ident = probed[key]
            if ident is None:
                why = f"router {type(rt[1]).__name__} computes a routing the ops do not express"
            else:
                rname = f"{parent_path}.{rt[0]}" if parent_path else rt[0]
                found.append(Block(parent_path, rname, path, ident[0], layout[0], layout[1], act, layout[2], k,
                                   ident[1]))
                continue
        if warn and why is not None:
            warnings.warn(f"torch import: MoE block {parent_path or path} ({type(m).__name__}) is imported "
                          f"through HF's grouped matmul (every expert on every token): {why}", stacklevel=3)
    return found


def capacity_of(rule: str | float, seq: int, top_k: int, experts: int) -> int:
    """Tokens an expert takes from one sequence: ``"dropless"`` every token (``seq``), else
    the zoo's ``ceil(seq x top_k / experts x factor)`` (``"uniform"``: factor 1)."""
    if rule == "dropless":
        return seq
    factor = 1.0 if rule == "uniform" else float(rule)
    if not factor > 0:
        raise ValueError(f"MoE capacity factor must be > 0, got {rule!r}")
    return max(1, min(seq, math.ceil(seq * top_k / experts * factor - 1e-9)))


class _Scores(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the dtype of the first gate values (softmax / sigmoid output) a router computes."""
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.dtype: torch.dtype | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.dtype is None and func.overloadpacket in _SCORE_OPS and isinstance(out, torch.Tensor):
            self.dtype = out.dtype
        return out


_SCORE_OPS = (torch.ops.aten._softmax, torch.ops.aten.softmax, torch.ops.aten.sigmoid)


def _router_dtypes(router: torch.nn.Module, dtype: torch.dtype, h: int) -> tuple[torch.dtype, torch.dtype]:
    """The dtypes of ``router``'s top-k weights and of its gate values (its softmax / sigmoid)
    for tokens of ``dtype`` (run on the meta device). They differ: Qwen2/3-MoE and OLMoE take
    ``softmax(logits, dtype=torch.float)``, choose the top k and renormalise in float32, and
    only then cast the weights to the logits' dtype (transformers 5.25,
    module ``transformers.models.qwen3_moe.modeling_qwen3_moe``, ``Qwen3MoeTopKRouter.forward``); Mixtral keeps them
    float32. The scores' dtype is where the top k are chosen: in bfloat16, gate values 2e-3
    apart round equal and the top-k picks another expert than HF's."""
    state = {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in router.named_parameters(recurse=False)}
    state.update({n: torch.zeros(b.shape, dtype=b.dtype, device="meta") for n, b in router.named_buffers(recurse=False)})
    seen = _Scores()
    try:
        with torch.no_grad(), seen:
            out = torch.func.functional_call(router, state, (torch.empty(2, h, dtype=dtype, device="meta"),))
        return out[1].dtype, seen.dtype or torch.float32
    except Exception:  # meta unsupported: float32, as HF's routers compute
        return torch.float32, torch.float32


@contextlib.contextmanager
def lowered_moe(module: torch.nn.Module, tokens: tuple[int, int], capacity: str | float = "uniform",
                blocks: list[Block] | None = None, chunks: int = 1) -> Iterator[list[Block]]:
    """Within: the routers and experts of ``module``'s MoE blocks call the custom ops (see the
    module docstring) for a batch of ``tokens`` = (sequences, tokens each); ``capacity``: as
    :func:`capacity_of`, per routed chunk; ``chunks``: each sequence routed in that many chunks
    of its tokens, each on its own (context parallelism: one a cp rank, the tokens traced in
    the cp ranks' order: :func:`spmdkit.models.hf.import_hf`). Yields the blocks."""
    found = moe_blocks(module) if blocks is None else blocks
    named = dict(module.named_modules())
    batch, seq = tokens
    saved: list[torch.nn.Module] = []
    try:
        for b in found:
            router, experts = named[b.router], named[b.experts]
            wname = next(n for n, p in router.named_parameters(recurse=False) if p.dim() == 2)
            cap = capacity_of(capacity, seq // chunks, b.top_k, b.num_experts)
            wdt, sdt = _router_dtypes(router, next(experts.parameters()).dtype, getattr(router, wname).shape[1])
            router.forward = types.MethodType(_route_call(b, wname, batch, (wdt, sdt), chunks), router)
            experts.forward = types.MethodType(_experts_call(b, cap), experts)
            saved += [router, experts]
        yield found
    finally:
        for m in saved:
            m.__dict__.pop("forward", None)


def _route_call(b: Block, wname: str, batch: int, dts: tuple[torch.dtype, torch.dtype], chunks: int) -> Any:
    r = b.routing

    def forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> Any:
        bias = getattr(self, b.bias_name) if b.bias_name else None
        return torch.ops.spmdkit.moe_route(hidden_states, getattr(self, wname), bias, r.score, r.bias, r.norm,
                                           r.scale, r.groups, r.topk_group, b.top_k, batch, dts[0], chunks, dts[1])
    return forward


def _experts_call(b: Block, cap: int) -> Any:
    def forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        up = self.gate_up_proj if b.gated else self.up_proj
        out: torch.Tensor = torch.ops.spmdkit.moe_experts(hidden_states, top_k_index, top_k_weights, up,
                                                          self.down_proj, b.act[0], b.act[1], b.gated, b.transposed,
                                                          cap)
        return out
    return forward


__all__ = ["ACTIVATIONS", "Block", "Routing", "capacity_of", "experts_forward", "identify_routing", "lowered_moe",
           "moe_blocks", "route"]
