"""A 0-D optional tensor read as absent (how Paddle's callers pass a missing optional).

Paddle's Python callers of flash_attention and the fused ops pass an absent optional
tensor as a 0-D tensor (shape ``[]``) rather than None. :func:`zero_d_absent` wraps a rule
function so that such a tensor in one of the named optional slots is answered exactly as
None would be, except that its own slot gets a replicated 0-D dist attr (dims_mapping
``[]``, Paddle's empty dist attr) instead of None: the tensor was given, so it has an
answer. Only slots where a 0-D tensor can never be a real operand are named (an attention
mask, a seed, sin / cos tables, a bias, k / v of a rotary embedding, ...).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.signature import parse_signature


def zero_d_absent(
    fn: Callable[..., SpmdResult],
    signature: str,
    names: Sequence[str | tuple[str, Callable[[tuple[Any, ...]], bool]]],
    outputs: Sequence[str] = (),
    when: Callable[[tuple[Any, ...]], bool] | None = None,
) -> Callable[..., SpmdResult]:
    """``fn`` with a 0-D tensor in the optional slots ``names`` read as absent.

    ``signature``: the mode's signature (the order of ``fn``'s parameters); ``outputs``: the
    tensor parameters a reverse rule answers in ``outputs`` (the others are answered in
    ``inputs``, in signature order); ``when(args)``: false where a 0-D tensor is real for
    this call (then nothing is changed). A name may come with its own predicate,
    ``(name, pred)``: that slot is read as absent only where ``pred(args)`` holds (an output
    of a reverse rule the op makes only under some attribute)."""
    params = parse_signature(signature)
    tensor_names = [p.name for p in params if p.is_tensor]
    in_names = [n for n in tensor_names if n not in outputs]
    slots: list[tuple[int, bool, int, Any]] = []  # (argument position, in outputs?, answer index, predicate)
    for item in names:
        n, pred = (item, None) if isinstance(item, str) else item
        pos = next(i for i, p in enumerate(params) if p.name == n)
        if params[pos].kind != "T?":
            raise ValueError(f"{n!r} is not an optional tensor in {signature!r}")
        is_out = n in outputs
        slots.append((pos, is_out, list(outputs).index(n) if is_out else in_names.index(n), pred))

    @functools.wraps(fn)
    def wrapped(*args: Any) -> SpmdResult:
        given: list[tuple[bool, int, DistTensorSpec]] = []
        new_args = list(args)
        for pos, is_out, idx, pred in slots:
            t = args[pos] if pos < len(args) else None
            if isinstance(t, DistTensorSpec) and not t.shape and (pred is None or pred(args)):
                given.append((is_out, idx, t))
                new_args[pos] = None
        if not given or (when is not None and not when(tuple(args))):
            return fn(*args)
        res = fn(*new_args)
        ins, outs = list(res.inputs), list(res.outputs)
        for is_out, idx, t in given:
            seq = outs if is_out else ins
            if idx < len(seq) and seq[idx] is None:
                seq[idx] = TensorDistAttr.unchecked(t.dist_attr.mesh, ())
        return SpmdResult(ins, outs)

    return wrapped


def absent_0d(*names: str) -> Callable[[Callable[..., SpmdResult], str, Sequence[str]], Callable[..., SpmdResult]]:
    """A declaration's ``Way(wrap=...)``: :func:`zero_d_absent` over the optional slots ``names``."""
    return lambda fn, signature, outputs: zero_d_absent(fn, signature, names, outputs)


__all__ = ["absent_0d", "zero_d_absent"]
