"""The distributed step against torch eager: torch autograd's loss and parameter gradients of the
imported module on the same inputs and weights (:func:`eager_reference`), compared with the
assembled values of the run (:func:`compare_eager`, an :class:`~spmdkit.execute.check.EagerCheck`)."""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import torch

from spmdkit.core.errors import ProgramError
from spmdkit.execute.check import EagerCheck, RunReport
from spmdkit.models.torch_import import hf_call_kwargs
from spmdkit.sim.mesh import nonfinite_count


def compare_eager(rep: RunReport, dtype: str, ref: dict[str, np.ndarray], loss: str | None,
                   rtol: float, native: dict[str, np.ndarray] | None = None) -> EagerCheck:
    """The distributed step's loss and gradients against torch eager's (float32) autograd: each
    tensor's max error within ``rtol`` of its scale. With ``native`` (torch's own step of a
    float16 / bfloat16 module in its dtype, :func:`eager_reference`): a ReLU input within the
    half dtype's rounding of zero takes the other side of the mask than in float32 and the
    gradient behind it moves (T5), in torch's own half-precision step as in spmdkit's, so a
    gradient is compared by its relative L2 error, within ``rtol`` or twice torch's own
    half-precision step's largest (over the step's gradients), whichever is larger (NaNs and
    shapes as always). The sharding itself
    is checked elementwise against the single-process step in the program's dtype
    (:func:`spmdkit.execute.check.check_torch`)."""
    chk = EagerCheck(dtype, rtol)
    if loss is not None and loss in ref:
        chk.loss = float(np.asarray(ref[loss], dtype=np.float64).sum())
    # a gradient that is zero in exact arithmetic (attention's key bias: softmax ignores a
    # per-query constant) is torch's rounding noise: scales stop at a thousandth of the step's
    # largest gradient
    grads = [float(np.max(np.abs(np.asarray(w, dtype=np.float64)))) for n, w in ref.items()
             if n != loss and np.size(w)]
    floor = 1e-3 * max(grads, default=0.0)

    def rel_l2(g: np.ndarray, w: np.ndarray) -> float:  # the norm stops at the floor's, like the scale
        return float(np.linalg.norm(g - w)) / max(float(np.linalg.norm(w)), floor * math.sqrt(w.size), 1e-300)

    if native is not None:  # torch's own half-precision step against its float32 one, over the gradients
        for name, want in ref.items():
            own_w = native.get(name)
            if name != loss and own_w is not None and np.shape(own_w) == np.shape(want) and np.size(want):
                own = rel_l2(np.asarray(own_w, dtype=np.float64), np.asarray(want, dtype=np.float64))
                if math.isfinite(own):  # torch's own half step overflowing gives no budget
                    chk.native_error = max(chk.native_error, own)
    budget = max(rtol, 2 * chk.native_error)
    for name, want in ref.items():
        w = np.asarray(want, dtype=np.float64)
        got = rep.values.get(name)
        if got is None:
            chk.failures.append((name, "torch eager: the distributed step did not make this tensor"))
            continue
        g = np.asarray(got, dtype=np.float64)
        chk.checked += 1
        if g.shape != w.shape:
            chk.failures.append((name, f"torch eager: shape {list(g.shape)}, torch's {list(w.shape)}"))
            continue
        bad = nonfinite_count(g) + nonfinite_count(w)
        if bad:
            chk.failures.append((name, f"torch eager: {nonfinite_count(g)} non-finite values here, "
                                       f"{nonfinite_count(w)} in torch's"))
            continue
        scale = max(float(np.max(np.abs(w))) if w.size else 0.0, 0.0 if name == loss else floor)
        err = float(np.max(np.abs(g - w))) if w.size else 0.0
        rel = err / scale if scale > 0 else (0.0 if err == 0 else math.inf)
        if native is not None and name != loss and w.size:
            l2 = rel_l2(g, w)
            chk.max_rel_error = max(chk.max_rel_error, l2)
            if l2 > budget:
                chk.failures.append((name, f"torch eager: relative L2 error {l2:.3g}, beyond rtol {rtol:g} and "
                                           f"twice the largest of torch's own half-precision step, "
                                           f"{chk.native_error:.3g} (max error {err:.3g}, {rel:.3g} of its scale)"))
            continue
        chk.max_rel_error = max(chk.max_rel_error, rel)
        if rel > rtol:
            chk.failures.append((name, f"torch eager: max error {err:.3g} is {rel:.3g} of its scale {scale:.3g} "
                                       f"(rtol {rtol:g})"))
    return chk


def eager_reference(prog: Any, module: Any, args: Any = (), kwargs: dict[str, Any] | None = None,
                    native: bool = False, _dtype: Any = None) -> tuple[Any, ...]:
    """torch eager's training step of ``module`` (an :class:`~spmdkit.models.torch_import.ImportedProgram`'s
    module, called as it was imported): the loss and every parameter's gradient by torch
    autograd, keyed by ``prog``'s tensor names (``prog.loss``, ``prog.grads[param]``). A
    float64 module runs in float64, any other in a float32 copy (a bfloat16 / float16 model on
    its rounded weights: the numpy run computes in float64 and does not round at casts).
    Returns (the dtype torch ran in, the values); with ``native`` and a float16 / bfloat16
    module, a third item: the same values from torch's own step in the module's dtype (how far
    torch's half-precision step is from its float32 one: the error budget of the comparison)."""


    kwargs = getattr(prog, "eager_kwargs", None) or kwargs  # a cp import's natural call (models/hf_cp.py)
    pl = getattr(prog, "loss", None)
    if not isinstance(pl, str):
        raise ProgramError("torch eager: the program has no loss (import it with training=True)")
    outs = list(getattr(prog, "outputs", []))
    if pl not in outs:
        raise ProgramError(f"torch eager: the loss {pl!r} is not an output of the module")
    p0 = next(iter(module.parameters()), None)
    if native and p0 is not None and p0.dtype in (torch.float16, torch.bfloat16):
        own = eager_reference(prog, module, args, kwargs, native=False, _dtype=p0.dtype)[1]
        return (*eager_reference(prog, module, args, kwargs), own)
    dt = _dtype or (torch.float64 if p0 is not None and p0.dtype == torch.float64 else torch.float32)
    m = module if p0 is None or p0.dtype == dt else copy.deepcopy(module).to(dt)

    def cast(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.detach().to(dt)
        if isinstance(v, (list, tuple)):
            return type(v)(cast(x) for x in v)
        if isinstance(v, dict):
            return {k: cast(x) for k, x in v.items()}
        return v

    m.zero_grad(set_to_none=True)
    with torch.enable_grad():
        out = m(*cast(tuple(args)), **cast(hf_call_kwargs(m, kwargs)))
        flat = [v for v in torch.utils._pytree.tree_flatten(out)[0] if isinstance(v, torch.Tensor)]
        if len(flat) != len(outs):
            raise ProgramError(f"torch eager: the module returned {len(flat)} tensors, the program records "
                               f"{len(outs)} outputs")
        lt = flat[outs.index(pl)]
        lt.backward()  # type: ignore[no-untyped-call]
    res: dict[str, np.ndarray] = {pl: lt.detach().double().numpy()}
    named = dict(m.named_parameters(remove_duplicate=False))
    for param, grad in prog.grads.items():
        kind, fqn = prog.sources.get(param, (None, None))
        cut = None
        if kind == "parameter_slice":  # a part of a fused parameter (strategies.hf_fused)
            fqn, *cut = fqn
        elif kind != "parameter":
            continue
        w = named.get(fqn if fqn in named else str(fqn).removeprefix("module."))
        if w is None:
            raise ProgramError(f"torch eager: the module has no parameter {fqn!r}")
        wg = w.grad if w.grad is not None else torch.zeros_like(w)
        if cut:
            wg = wg.narrow(cut[0], cut[1], cut[2] - cut[1])
            if len(cut) > 3 and cut[3]:  # an expert bank's part, [E, in, out] (models.torch_import.moe)
                wg = wg.permute(*cut[3])
        res[grad] = wg.detach().double().numpy()
    m.zero_grad(set_to_none=True)
    return str(dt).removeprefix("torch."), res


__all__ = ["compare_eager", "eager_reference"]
