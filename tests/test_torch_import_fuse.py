"""The torch importer's fusions (spmdkit.models.torch_import.fuse, ``import_module(fuse=True)``):
HF's spelt-out RMSNorm becomes ``fused_rms_norm`` and ``silu(a) * b`` the ``swiglu`` op, the
zoo's kernels; near misses (Gemma's ``(1 + w)`` scale, a mean over another axis, a ``silu`` read
twice) stay as they are; the training step's loss and every gradient equal torch's either way.
And the memory model keeps a product's operand only for the other operand's gradient
(spmdkit.cost.memory_saved.FOR_GRAD_ONLY): ``x * table`` with a table that needs no gradient keeps
the table, not ``x``."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'spmdkit[torch]')")

from torch import nn  # noqa: E402

from spmdkit.cost.memory_saved import saved_activations  # noqa: E402
from spmdkit.execute.single import run_program  # noqa: E402
from spmdkit.models.torch_import import import_module, torch_values  # noqa: E402
from spmdkit.planner.planning import plan_program  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

H, F = 8, 16


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm, as written there."""

    def __init__(self, gemma: bool = False, axis: int = -1) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(H, dtype=torch.float32) * 0.1 + (0.0 if gemma else 1.0))
        self.gemma, self.axis = gemma, axis

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(self.axis, keepdim=True) + 1e-6)
        if self.gemma:
            return (h * (1.0 + self.weight.float())).to(dt)
        return self.weight * h.to(dt)


class Block(nn.Module):
    def __init__(self, gemma: bool = False, axis: int = -1, silu_twice: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.norm = RMSNorm(gemma, axis)
        self.gate = nn.Parameter(torch.randn(F, H, generator=g, dtype=torch.float32) * 0.3)
        self.up = nn.Parameter(torch.randn(F, H, generator=g, dtype=torch.float32) * 0.3)
        self.down = nn.Parameter(torch.randn(H, F, generator=g, dtype=torch.float32) * 0.3)
        self.register_buffer("table", torch.randn(4, H, generator=g, dtype=torch.float32))
        self.silu_twice = silu_twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.norm(x)
        a = nn.functional.silu(nn.functional.linear(n, self.gate))
        m = a * nn.functional.linear(n, self.up)
        if self.silu_twice:
            m = m + a
        y = nn.functional.linear(m, self.down) * self.table  # a product with a table needing no gradient
        return (y * y).mean()


def _x() -> torch.Tensor:
    return torch.randn(2, 4, H, dtype=torch.float32, generator=torch.Generator().manual_seed(1))


def _step(m: nn.Module, fuse: bool) -> tuple[object, set[str]]:
    prog = import_module(m, (_x(),), training=True, optimizer=None, fuse=fuse)
    return prog, {op.rule for op in prog.ops}


def _equals_torch(prog: object, m: nn.Module) -> None:
    x = _x()
    vals = run_program(prog, torch_values(prog, m, (x,)))
    loss = m(x)
    loss.backward()
    assert abs(float(vals[prog.loss]) - loss.item()) <= 1e-6 * abs(loss.item())  # torch in float32, the references in float64
    for p, t in m.named_parameters():
        np.testing.assert_allclose(vals[prog.grads[p]], t.grad.numpy(), rtol=1e-4, atol=1e-7, err_msg=p)


def test_rms_norm_and_swiglu_fuse_and_equal_torch() -> None:
    m = Block()
    prog, rules = _step(m, True)
    assert {"fused_rms_norm", "swiglu"} <= rules and not {"rsqrt", "silu"} & rules
    _, plain = _step(Block(), False)
    assert {"rsqrt", "silu"} <= plain and not {"fused_rms_norm", "swiglu"} & plain
    _equals_torch(prog, m)


def test_a_float64_norm_computed_in_float32_is_not_fused() -> None:
    """HF's norm casts to float32 for its statistics: of a float64 model that is a precision
    loss the fused op (in the input's dtype) would not make, so it stays spelt out."""
    m = Block().double()
    prog = import_module(m, (_x().double(),), training=True, optimizer=None, fuse=True)
    rules = {op.rule for op in prog.ops}
    assert "fused_rms_norm" not in rules and "rsqrt" in rules and "swiglu" in rules


@pytest.mark.parametrize(("kw", "kept"), [({"gemma": True}, "rsqrt"), ({"axis": 1}, "rsqrt"),
                                          ({"silu_twice": True}, "silu")])
def test_near_misses_stay_spelt_out(kw: dict[str, bool], kept: str) -> None:
    """Gemma's (1 + w) scale and a mean over another axis are not RMSNorm; a silu read again
    outside the product is not SwiGLU's: each stays as written, and the step equals torch's."""
    m = Block(**kw)
    prog, rules = _step(m, True)
    assert kept in rules
    assert ("fused_rms_norm" in rules) == (kept != "rsqrt") and ("swiglu" in rules) == (kept != "silu")
    _equals_torch(prog, m)


def test_a_products_operand_is_kept_only_for_the_others_gradient() -> None:
    """``linear(m, down) * table``: the table needs no gradient, so the backward reads the
    linear's output for nothing (its gradient is ``g * table``) and it is not kept; the table is."""
    prog, _ = _step(Block(), True)
    (mul,) = [op for op in prog.ops if op.rule == "multiply" and "table" in op.input_names()]
    out_of_linear = next(n for n in mul.input_names() if n != "table")
    _, plan = plan_program(prog, "dp=1", None)
    kept = {n for lst in saved_activations(plan).tensors.values() for n, _ in lst}
    assert out_of_linear not in kept and mul.output_names()[0] in kept  # y * y reads y for its own gradient
