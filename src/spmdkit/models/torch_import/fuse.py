"""Fusions of an exported graph into the zoo's fused kernels, before the import walks it
(``import_module(fuse=True)``; :func:`spmdkit.models.hf.import_hf` asks for them).

A HuggingFace model spells out what the frameworks that train it run as one kernel, and the
spelt-out ops keep more for the backward than the kernel does (a float32 copy of the hidden
state, the normalised activation before its weight, ``silu(gate)`` beside ``gate``). Each
pattern below is matched exactly, node by node, on the pre-dispatch ATen graph and replaced by
one node computing the same function; anything else is left as it is:

- RMSNorm (Llama, Mistral, Qwen2, Mixtral, DeepSeek, ...): ``w * (x.float() * rsqrt(mean(x.float()
  ** 2, -1, keepdim) + eps)).to(x.dtype)`` -> ``aten.rms_norm(x, [h], w, eps)``, which the importer
  lowers to ``fused_rms_norm`` (the zoo's norm). The float32 upcast and its downcast are the
  kernel's own precision (it computes its statistics in float32); of a float64 input the cast
  loses precision, so that norm is not fused. Gemma's ``(1 + w)`` scale does not match and stays
  spelt out.
- SwiGLU (the gated MLPs): ``silu(a) * b`` with ``silu(a)`` read by nothing else ->
  ``spmdkit::swiglu(a, b)``, lowered to the zoo's ``swiglu`` op.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten


@torch.library.custom_op("spmdkit::swiglu", mutates_args=())
def swiglu(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``silu(x) * y``: the node a fused SwiGLU becomes in an exported graph."""
    return torch.nn.functional.silu(x) * y


@swiglu.register_fake
def _swiglu_fake(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_ASSERT = aten._assert_tensor_metadata.default
_CASTS = (aten.to.dtype, aten._to_copy.default)


def _users(n: Any) -> list[Any]:
    """``n``'s users other than torch.export's metadata asserts."""
    return [u for u in n.users if u.target is not _ASSERT]


def _only_user(n: Any) -> Any:
    """``n``'s one user (metadata asserts aside), or None."""
    got = _users(n)
    return got[0] if len(got) == 1 else None


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def _is(n: Any, *targets: Any) -> bool:
    return isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target in targets


def _other(mul: Any, one: Any) -> Any:
    """The operand of the binary ``mul`` that is not ``one`` (None when neither or both are)."""
    a, b = mul.args[:2]
    if a is one and b is not one:
        return b
    if b is one and a is not one:
        return a
    return None


def _erase(graph: Any, nodes: list[Any]) -> None:
    """Erase ``nodes`` (latest first) that nothing but metadata asserts reads any more."""
    for n in reversed(nodes):
        if not getattr(n, "_erased", False) and not _users(n):
            for u in list(n.users):
                graph.erase_node(u)
            graph.erase_node(n)


#: the dtypes an RMSNorm's upcast to float32 loses nothing of
_UPCAST = (torch.float32, torch.bfloat16, torch.float16)


def _cast_source(x: Any) -> Any:
    """``x0`` where ``x`` is ``x0`` (float32 or narrower) cast to float32, else ``x``."""
    if _is(x, *_CASTS) and _val(x) is not None and _val(x).dtype == torch.float32 and \
            isinstance(x.args[0], torch.fx.Node) and _val(x.args[0]) is not None and _val(x.args[0]).dtype in _UPCAST:
        return x.args[0]
    return x


def _rms_norm(graph: Any, r: Any) -> bool:
    """Fuse the RMSNorm around ``rsqrt`` node ``r`` (module docstring); whether it did."""
    a = r.args[0]
    if not (_is(a, aten.add.Tensor, aten.add.Scalar) and isinstance(a.args[1], float) and len(_users(a)) == 1):
        return False
    m = a.args[0]
    if not (_is(m, aten.mean.dim) and list(m.args[1]) in ([-1], [len(_val(m).shape) - 1]) and
            (m.args[2] if len(m.args) > 2 else m.kwargs.get("keepdim", False)) and len(_users(m)) == 1):
        return False
    p = m.args[0]
    if not (_is(p, aten.pow.Tensor_Scalar) and p.args[1] == 2 and len(_users(p)) == 1):
        return False
    x = p.args[0]
    n = _only_user(r)
    if n is None or not _is(n, aten.mul.Tensor) or _other(n, r) is not x or set(_users(x)) != {p, n}:
        return False
    c = n
    if len(_users(n)) == 1 and _is(_users(n)[0], *_CASTS):
        c = _users(n)[0]
    o = _only_user(c)
    w = _other(o, c) if o is not None and _is(o, aten.mul.Tensor) else None
    h = _val(x).shape[-1]
    if w is None or w.op != "placeholder" or tuple(_val(w).shape) != (h,):
        return False
    src = _cast_source(x)
    if _val(src).dtype != _val(o).dtype or _val(w).dtype != _val(o).dtype:
        return False
    with graph.inserting_before(o):
        fused = graph.call_function(aten.rms_norm.default, (src, [h], w, float(a.args[1])))
    fused.meta = dict(o.meta)
    o.replace_all_uses_with(fused)
    _erase(graph, [x, p, m, a, r, n, c, o] if src is not x else [p, m, a, r, n, c, o])
    return True


def _swiglu(graph: Any, s: Any) -> bool:
    """Fuse ``silu(a) * b`` at ``silu`` node ``s`` (module docstring); whether it did."""
    mul = _only_user(s)
    b = _other(mul, s) if mul is not None and _is(mul, aten.mul.Tensor) else None
    a = s.args[0]
    if not isinstance(b, torch.fx.Node) or _val(b) is None or _val(a) is None:
        return False
    if tuple(_val(a).shape) != tuple(_val(b).shape) or _val(a).dtype != _val(b).dtype:
        return False
    with graph.inserting_before(mul):
        fused = graph.call_function(torch.ops.spmdkit.swiglu.default, (a, b))
    fused.meta = dict(mul.meta)
    mul.replace_all_uses_with(fused)
    _erase(graph, [s, mul])
    return True


def fuse(ep: Any) -> dict[str, int]:
    """Fuse the patterns of the module docstring in ``ep``'s graph (an ExportedProgram, or
    :class:`~spmdkit.models.torch_import.layers.Expanded`), in place; how many of each."""
    graph = ep.graph_module.graph
    done = {"rms_norm": 0, "swiglu": 0}
    for node in list(graph.nodes):
        if getattr(node, "_erased", False):
            continue
        if _is(node, aten.rsqrt.default):
            done["rms_norm"] += _rms_norm(graph, node)
        elif _is(node, aten.silu.default):
            done["swiglu"] += _swiglu(graph, node)
    if any(done.values()) and hasattr(ep.graph_module, "recompile"):
        ep.graph_module.recompile()
    return done


__all__ = ["fuse", "swiglu"]
