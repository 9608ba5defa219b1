"""spmdkit.models.torch_import: torch modules (a GPT-2 and a LLaMA written in plain torch here, tiny,
random weights) imported as spmdkit Programs: no fallback op, the Program validates, the
simulator's unsharded run of it on the module's own weights reproduces torch's loss (and, for a
training import, every parameter gradient) in float64, propagation under data- and
Megatron-style tensor-parallel annotations converges and its plan simulates soundly; unmapped
ops raise naming the op and its source line, register_aten / mapping= map them, and
fallback="replicate" warns."""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'spmdkit[torch]')")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from spmdkit.core.errors import ProgramError  # noqa: E402
from spmdkit.execute.single import run_program  # noqa: E402
from spmdkit.models.torch_import import (  # noqa: E402
    ImportedProgram,
    import_module,
    register_aten,
    torch_values,
    unregister_aten,
)
from spmdkit.planner.propagate import MAX_ROUNDS, propagate  # noqa: E402
from spmdkit.program.ir import program_from_json  # noqa: E402
from spmdkit.sim.plan import simulate_plan  # noqa: E402
from spmdkit.strategies.strategy import parse_mesh  # noqa: E402

VOCAB, HIDDEN, HEADS, SEQ, BATCH = 64, 16, 4, 8, 2

# -- the models ----------------------------------------------------------------------------------


class GPT2Block(nn.Module):
    def __init__(self, fused_qkv: bool) -> None:
        super().__init__()
        h = HIDDEN
        self.fused = fused_qkv
        self.ln1 = nn.LayerNorm(h)
        if fused_qkv:
            self.qkv = nn.Linear(h, 3 * h)
        else:
            self.q, self.k, self.v = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc = nn.Linear(h, 4 * h)
        self.fc2 = nn.Linear(4 * h, h)
        self.register_buffer("mask", torch.full((SEQ, SEQ), -1e4).triu(1).view(1, 1, SEQ, SEQ))

    def forward(self, x: Any) -> Any:
        B, S, H = x.shape
        n = self.ln1(x)
        q, k, v = self.qkv(n).split(H, dim=2) if self.fused else (self.q(n), self.k(n), self.v(n))
        q, k, v = (t.view(B, S, HEADS, H // HEADS).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(att + self.mask[:, :, :S, :S], dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, S, H)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """Token + learned position embeddings, LayerNorm, manual causal softmax attention, GELU MLP,
    head tied to the token embedding, mean cross-entropy."""

    def __init__(self, layers: int = 2, fused_qkv: bool = True) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, HIDDEN)
        self.wpe = nn.Embedding(SEQ, HIDDEN)
        self.blocks = nn.ModuleList([GPT2Block(fused_qkv) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: Any, labels: Any) -> Any:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))


class RMSNorm(nn.Module):
    def __init__(self, h: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(h))

    def forward(self, x: Any) -> Any:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaBlock(nn.Module):
    def __init__(self, kv_heads: int, ffn: int) -> None:
        super().__init__()
        h, hd = HIDDEN, HIDDEN // HEADS
        self.nkv, self.hd = kv_heads, hd
        self.attn_norm = RMSNorm(h)
        self.wq = nn.Linear(h, HEADS * hd, bias=False)
        self.wk = nn.Linear(h, kv_heads * hd, bias=False)
        self.wv = nn.Linear(h, kv_heads * hd, bias=False)
        self.wo = nn.Linear(HEADS * hd, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=1e-5)
        self.w_gate = nn.Linear(h, ffn, bias=False)
        self.w_up = nn.Linear(h, ffn, bias=False)
        self.w_down = nn.Linear(ffn, h, bias=False)

    def forward(self, x: Any) -> Any:
        B, S, H = x.shape
        n = self.attn_norm(x)
        q = self.wq(n).view(B, S, HEADS, self.hd).transpose(1, 2)
        k = self.wk(n).view(B, S, self.nkv, self.hd).transpose(1, 2)
        v = self.wv(n).view(B, S, self.nkv, self.hd).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(a.transpose(1, 2).reshape(B, S, H))
        n = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(n)) * self.w_up(n))


class Llama(nn.Module):
    """Token embedding, RMSNorm (hand-written and nn.RMSNorm), causal SDPA with grouped kv heads,
    SwiGLU MLP, untied head, log_softmax + nll_loss."""

    def __init__(self, layers: int = 2, kv_heads: int = 2, ffn: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([LlamaBlock(kv_heads, ffn) for _ in range(layers)])
        self.norm = RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def logits(self, tokens: Any) -> Any:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))

    def forward(self, tokens: Any, labels: Any) -> Any:
        logp = F.log_softmax(self.logits(tokens), dim=-1)
        return F.nll_loss(logp.flatten(0, 1), labels.flatten())


class Misc(nn.Module):
    """Many small ops at once (addmm, t, chunk, cat, bmm, masked_fill, where, select, slice, ...)."""

    def __init__(self, h: int = 8) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(h, h))
        self.b = nn.Parameter(torch.randn(h))
        self.register_buffer("tri", torch.tril(torch.ones(4, 4)).bool())

    def forward(self, x: Any) -> Any:  # x [2, 4, 8]
        y = torch.addmm(self.b, x.reshape(-1, 8), self.w.t()).view(2, 4, 8)
        y = torch.relu(y) - torch.tanh(x) / 2.0 + (1 - torch.sigmoid(y)) * x.exp() / (x * x + 1)
        a, b = y.chunk(2, dim=-1)
        z = torch.cat([b, -a, a.pow(3)], dim=-1)
        s = torch.bmm(z, z.transpose(1, 2)).masked_fill(~self.tri, float("-inf")).softmax(-1)
        s = torch.where(self.tri, s, torch.zeros_like(s))
        u = s.unsqueeze(1).expand(2, 3, 4, 4).permute(0, 2, 3, 1).contiguous()
        v = u.sum(dim=(1, 3)) + u.mean(-1, keepdim=True).squeeze(-1)[:, 0] + u.select(3, 1)[:, :, 1:3].sum(-1)
        w = torch.sqrt(v.abs() + 1).clone()[:, 1:] + torch.mm(v, torch.ones(4, 4, dtype=v.dtype))[:, :3]
        return w, z.mean()


class MoreOps(nn.Module):
    """stack / unbind, maximum / amax, gather, cumsum, tril / triu, comparisons, where, argmax, a
    strided slice, SDPA spelt out (mask + scale; causal + grouped kv) and as flash attention,
    cross-entropy reductions, nll_loss of log(softmax), any, casts, dropout (eval), nn.RMSNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6))
        self.norm = nn.RMSNorm(6)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: Any, idx: Any, lab: Any) -> Any:  # x [2, 3, 4]; idx, lab [2, 3] in [0, 6)
        y = self.norm(self.drop(x @ self.w))
        a, b = torch.stack([y, y * 2], dim=1).unbind(1)
        m = torch.maximum(a, b - 1).amax(dim=-1)
        c = torch.cumsum(torch.gather(y, 2, idx.unsqueeze(-1)).squeeze(-1), dim=1) + m
        tr = torch.triu(y[:, :, :3], diagonal=1) + torch.tril(y[:, :3, :3])
        f = torch.where((y > 0.1) | (y <= -0.5) | (y == 0) | (y >= 2), y, -y)
        q = y.view(2, 3, 2, 3).transpose(1, 2)
        mask = torch.ones(3, 3, dtype=y.dtype).tril() * 0.5 - 1
        att = F.scaled_dot_product_attention(q, q, q, attn_mask=mask, scale=0.3)
        att2 = F.scaled_dot_product_attention(q, q, q)
        att3 = F.scaled_dot_product_attention(q, q[:, :1], q[:, :1], is_causal=True, scale=0.7, enable_gqa=True)
        flat, fl = y.reshape(-1, 6), lab.reshape(-1)
        ce_none = F.cross_entropy(flat, fl, reduction="none")
        ce_sum = F.cross_entropy(flat, fl, reduction="sum")
        nll = F.nll_loss(torch.log(F.softmax(flat, -1)), fl)
        cast = (y > 0).to(y.dtype) + x.sum(-1)[0].t().t().mean()
        return (c, tr, f, torch.argmax(f, dim=-1), f[:, :, ::2], att, att2, att3, ce_none, ce_sum, nll,
                (y > 1).any(dim=-1), cast)


class Elementwise(nn.Module):
    """Differentiable elementwise and view ops beyond the two decoders."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.b = nn.Parameter(torch.randn(4))

    def forward(self, x: Any) -> Any:  # x [2, 4]
        y = x @ self.w
        y = torch.relu(y) - torch.tanh(y) / (torch.exp(y * 0.1) + 1) + torch.sigmoid(y) * torch.sqrt(y * y + 1)
        y = y.unsqueeze(1).expand(2, 3, 4) + self.b.unsqueeze(0).squeeze(0)
        return (y.pow(3) * 0.01 + F.log_softmax(y, -1) - y + y).sum()


class InPlace(nn.Module):
    """In-place ops and a buffer updated in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(4))

    def forward(self, x: Any) -> Any:
        self.count.add_(1)
        y = self.fc(x)
        y.mul_(2)
        return (y + self.count).sum()


class HardswishMLP(nn.Module):
    """An op the importer does not map itself (aten.hardswish)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Any) -> Any:
        return F.hardswish(self.fc(x)).sum()


# -- helpers -------------------------------------------------------------------------------------


def _data(seed: int = 0) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))


def _model(cls: Any, **kw: Any) -> Any:
    torch.manual_seed(0)
    return cls(**kw).double()


def _sim(prog: ImportedProgram, module: Any, inputs: tuple[Any, ...]) -> dict[str, Any]:
    """The simulator's unsharded run of the imported program on the module's own weights."""
    return run_program(prog, torch_values(prog, module, inputs))


def _rules(prog: ImportedProgram) -> set[str]:
    return {op.rule for op in prog.ops}


def _megatron(prog: ImportedProgram, tp: int = 1, dp: int = 0) -> dict[str, list[int]]:
    """Megatron-LM by parameter name (torch Linear weights are [out, in]): q/k/v, gate/up, fc
    column-parallel (out features over tp), o / down / proj / fc2 row-parallel (in features), the
    embedding and head vocab-parallel; the token / label batch axis over dp."""
    ann: dict[str, list[int]] = {}
    for n, (kind, _) in prog.sources.items():
        t = prog.tensors[n]
        if kind == "input" and t.dtype == "int64" and len(t.shape) == 2:
            ann[n] = [dp, -1]
        if kind != "parameter" or len(t.shape) != 2:
            continue
        leaf = n.split(".")[-2] if "." in n else n
        if leaf in ("wq", "wk", "wv", "w_gate", "w_up", "q", "k", "v", "fc", "embed", "lm_head", "wte", "head"):
            ann[n] = [tp, -1]
        elif leaf in ("wo", "w_down", "proj", "fc2"):
            ann[n] = [-1, tp]
    return ann


# -- imports reproduce torch ---------------------------------------------------------------------


def test_gpt2_imports_and_reproduces_torch_loss() -> None:
    m = _model(GPT2)
    toks, labels = _data()
    prog = import_module(m, (toks, labels))
    prog.validate()
    rules = _rules(prog)
    assert "replicated" not in rules
    assert {"embedding", "layer_norm", "matmul", "split", "softmax", "gelu", "cross_entropy_with_softmax",
            "sum", "divide", "not_equal"} <= rules  # mean over the counted labels
    # the tied head: one parameter, read by the embedding and the head matmul
    assert "wte.weight" in prog.parameters() and "head.weight" not in prog.tensors
    assert prog.aliases == {"head.weight": "wte.weight"}
    assert prog.tensors["idx"].dtype == "int64" and prog.tensors["idx"].kind == "input"
    assert prog.tensors["blocks.0.mask"].kind == "input"
    assert prog.tensors["blocks.0.qkv.weight"].kind == "parameter"
    got = float(_sim(prog, m, (toks, labels))[prog.outputs[0]])
    want = m(toks, labels).item()
    assert abs(got - want) < 1e-9, (got, want)


def test_llama_imports_and_reproduces_torch_loss() -> None:
    m = _model(Llama)
    toks, labels = _data()
    prog = import_module(m, (toks, labels))
    rules = _rules(prog)
    assert "replicated" not in rules
    assert {"flash_attention", "fused_rms_norm", "rsqrt", "square", "silu", "cross_entropy_with_softmax"} <= rules
    assert "log_softmax" not in rules  # log_softmax + nll_loss became one cross_entropy_with_softmax
    fa = [op for op in prog.ops if op.rule == "flash_attention"]
    assert len(fa) == 2 and all(op.attrs["causal"] for op in fa)
    q, k = (prog.tensors[fa[0].inputs[p]].shape for p in ("q", "k"))
    assert q == (BATCH, SEQ, HEADS, HIDDEN // HEADS) and k == (BATCH, SEQ, 2, HIDDEN // HEADS)  # Paddle's [b, s, h, d]
    got = float(_sim(prog, m, (toks, labels))[prog.outputs[0]])
    want = m(toks, labels).item()
    assert abs(got - want) < 1e-9, (got, want)


def test_many_small_ops_reproduce_torch() -> None:
    m = _model(Misc)
    x = torch.randn(2, 4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    prog = import_module(m, (x,))
    assert {"concat", "split", "slice", "where", "expand", "squeeze", "unsqueeze", "subtract", "divide",
            "elementwise_pow", "bitwise_not"} <= _rules(prog)
    vals = _sim(prog, m, (x,))
    for name, want in zip(prog.outputs, m(x)):
        np.testing.assert_allclose(vals[name], want.detach().numpy(), rtol=0, atol=1e-9, equal_nan=False)


def test_more_ops_reproduce_torch() -> None:
    m = _model(MoreOps)
    g = torch.Generator().manual_seed(4)
    inputs = (torch.randn(2, 3, 4, dtype=torch.float64, generator=g), torch.randint(0, 6, (2, 3), generator=g),
              torch.randint(0, 6, (2, 3), generator=g))
    prog = import_module(m, inputs)
    assert m.training and m.drop.training  # exported in eval mode, the module's mode restored
    assert {"stack", "unbind", "maximum", "max", "take_along_axis", "cumsum", "tril_triu", "argmax", "strided_slice",
            "flash_attention", "any", "cast", "fused_rms_norm", "logical_not", "bitwise_or"} <= _rules(prog)
    vals = _sim(prog, m, inputs)
    m.eval()  # the import exports in eval mode (dropout off)
    wants = m(*inputs)
    assert len(prog.outputs) == len(wants)
    for name, want in zip(prog.outputs, wants):
        w = want.detach().numpy()
        assert vals[name].dtype.kind == w.dtype.kind, name
        np.testing.assert_allclose(vals[name].astype(np.float64), w.astype(np.float64), rtol=0, atol=1e-9,
                                   err_msg=name, equal_nan=False)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch's own, in run_decompositions
def test_decomposed_graph_reproduces_torch() -> None:
    m = _model(GPT2)
    toks, labels = _data()
    prog = import_module(m, (toks, labels), decompose=True)  # core ATen: addmm, _softmax, gather, where, ...
    assert "replicated" not in _rules(prog)
    got = float(_sim(prog, m, (toks, labels))[prog.outputs[0]])
    assert abs(got - m(toks, labels).item()) < 1e-9


@pytest.mark.filterwarnings("ignore::FutureWarning")  # torch's own, in run_decompositions
def test_in_place_ops_are_functionalised() -> None:
    m = _model(InPlace)
    x = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    prog = import_module(m, (x,))
    assert len(prog.outputs) == 1  # the buffer update is not an output of the module
    assert abs(float(_sim(prog, m, (x,))[prog.outputs[0]]) - m(x).item()) < 1e-12


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_training_step_gradients_equal_torch(arch: str) -> None:
    m = _model(GPT2, fused_qkv=False) if arch == "gpt2" else _model(Llama)
    toks, labels = _data()
    prog = import_module(m, (toks, labels), training=True)
    phases = {op.phase for op in prog.ops}
    assert phases == {"forward", "backward", "optimizer"}
    params = dict(m.named_parameters())  # tied weights once
    assert set(prog.grads) == set(params)
    assert sum(op.rule == "adamw" for op in prog.ops) == len(params)
    vals = _sim(prog, m, (toks, labels))
    loss = m(toks, labels)
    loss.backward()
    assert prog.loss is not None
    assert abs(float(vals[prog.loss]) - loss.item()) < 1e-9
    for p, g in prog.grads.items():
        want = params[p].grad
        assert want is not None
        np.testing.assert_allclose(vals[g], want.numpy(), rtol=0, atol=1e-9, err_msg=p, equal_nan=False)


def test_elementwise_training_gradients_equal_torch() -> None:
    m = _model(Elementwise)
    x = torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    prog = import_module(m, (x,), training=True)
    assert {"relu_grad", "tanh_grad", "divide_grad", "exp_grad", "sigmoid_grad", "sqrt_grad", "square_grad",
            "expand_grad", "unsqueeze_grad", "squeeze_grad", "elementwise_pow_grad", "log_softmax_grad",
            "subtract_grad"} <= _rules(prog)
    vals = _sim(prog, m, (x,))
    loss = m(x)
    loss.backward()
    assert prog.loss is not None and abs(float(vals[prog.loss]) - loss.item()) < 1e-9
    for p, t in m.named_parameters():
        assert t.grad is not None
        np.testing.assert_allclose(vals[prog.grads[p]], t.grad.numpy(), rtol=0, atol=1e-9, err_msg=p, equal_nan=False)


# -- planning the imported programs ------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("strategy", ["dp", "megatron"])
def test_imported_training_step_plans_and_simulates(arch: str, strategy: str) -> None:
    m = _model(GPT2, fused_qkv=False) if arch == "gpt2" else _model(Llama)
    prog = import_module(m, _data(), training=True)
    mesh = parse_mesh("dp=2,tp=2")
    if strategy == "dp":
        ann = {n: [0, -1] for n, (k, _) in prog.sources.items() if k == "input" and prog.tensors[n].dtype == "int64"
               and len(prog.tensors[n].shape) == 2}
        assert len(ann) == 2
    else:
        ann = _megatron(prog)
    plan = propagate(prog, mesh, ann)
    assert plan.rounds < MAX_ROUNDS  # a backward sweep filled nothing: converged
    # data parallel: every parameter gradient is all-reduced over dp before its update (the
    # position embedding's already in backward, on the [seq, hidden] gradient its lookup reads)
    reduced = {r.tensor for r, s in plan.collectives("optimizer") if s.kind == "all_reduce"}
    assert set(prog.grads.values()) - reduced <= {"wpe.weight.grad"}
    if arch == "gpt2":
        assert any(s.kind == "all_reduce" for _, s in plan.collectives("backward"))
    for op_plan in plan.ops:
        if op_plan.op.rule == "adamw":
            assert not op_plan.required["grad"].partial, op_plan.op.name
    if strategy == "megatron":
        # row-parallel projections: their (partial) outputs are all-reduced in forward
        fwd = {r.tensor for r, s in plan.collectives("forward") if s.kind == "all_reduce"}
        rows = [op.outputs[0] for op in prog.ops if op.rule == "matmul" and op.phase == "forward"
                and ann.get(op.inputs["y"]) == [-1, 1]]
        assert len(rows) == 4 and set(rows) <= fwd
    rep = simulate_plan(plan)
    assert rep.ok, rep.failures[:3]


# -- unmapped ops, hooks, fallback ---------------------------------------------------------------


def test_unmapped_op_raises_naming_op_and_source_line() -> None:
    m = _model(HardswishMLP)
    with pytest.raises(ProgramError) as ei:
        import_module(m, (torch.randn(2, 8, dtype=torch.float64),))
    msg = str(ei.value)
    assert "aten.hardswish" in msg and "test_torch_import.py:" in msg and "F.hardswish" in msg
    assert "register_aten" in msg and "fallback='replicate'" in msg


def test_register_aten_and_per_call_mapping() -> None:
    m = _model(HardswishMLP)
    x = torch.randn(2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    want = m(x).item()
    register_aten("aten.hardswish", lambda ctx: ctx.emit1("hardswish", {"x": ctx.args[0]}))
    try:
        prog = import_module(m, (x,))
    finally:
        unregister_aten("aten.hardswish")
    assert "hardswish" in _rules(prog)
    assert abs(float(_sim(prog, m, (x,))[prog.outputs[0]]) - want) < 1e-12
    prog2 = import_module(m, (x,), mapping={"aten.hardswish.default": "hardswish"})  # a rule name: args in order
    assert abs(float(_sim(prog2, m, (x,))[prog2.outputs[0]]) - want) < 1e-12
    with pytest.raises(ProgramError, match=r"aten\.hardswish"):
        import_module(m, (x,))  # unregistered again


def test_fallback_replicate_warns_and_plans() -> None:
    m = _model(HardswishMLP)
    x = torch.randn(2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with pytest.warns(UserWarning, match=r"aten\.hardswish"):
        prog = import_module(m, (x,), fallback="replicate")
    rep = [op for op in prog.ops if op.rule == "replicated"]
    assert len(rep) == 1
    plan = propagate(prog, parse_mesh("dp=2"), {"x": [0, -1]})
    assert plan.rounds < MAX_ROUNDS
    # the fallback op's input is gathered to replicated
    assert any(r.tensor == rep[0].inputs["ins"][0] for r in plan.reshards)
    # run_program runs the fallback op with torch
    assert abs(float(_sim(prog, m, (x,))[prog.outputs[0]]) - m(x).item()) < 1e-12


def test_training_through_list_ops_equals_torch() -> None:
    """The autodiff differentiates ops with list inputs or outputs: GPT-2's fused qkv
    projection split into q, k, v (split_grad), and chunk / cat / select / slice (split_grad
    with a zero gradient for an unread piece, concat_grad, slice_grad)."""
    m = _model(GPT2, fused_qkv=True)
    toks, labels = _data()
    prog = import_module(m, (toks, labels), training=True)
    assert "split_grad" in _rules(prog)
    vals = _sim(prog, m, (toks, labels))
    loss = m(toks, labels)
    loss.backward()
    assert prog.loss is not None and abs(float(vals[prog.loss]) - loss.item()) < 1e-9
    for p, t in m.named_parameters():
        if p == "head.weight":
            continue  # tied to wte.weight
        assert t.grad is not None
        np.testing.assert_allclose(vals[prog.grads[p]], t.grad.numpy(), rtol=0, atol=1e-9, err_msg=p, equal_nan=False)

    class Pieces(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))

        def forward(self, x: Any) -> Any:
            y = x @ self.w
            a, b, c = y.chunk(4, dim=-1)[:3]  # the fourth piece is never read
            z = torch.cat([c, a * 2.0, b], dim=-1)
            return (z[:, 1:3].sum() + z.select(1, 0).sum()) * 1.0

    m2 = _model(Pieces)
    x = torch.randn(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    prog2 = import_module(m2, (x,), training=True)
    assert {"split_grad", "concat_grad", "slice_grad", "zeros_like"} <= _rules(prog2)
    vals2 = _sim(prog2, m2, (x,))
    loss2 = m2(x)
    loss2.backward()
    assert prog2.loss is not None and abs(float(vals2[prog2.loss]) - loss2.item()) < 1e-9
    assert m2.w.grad is not None
    np.testing.assert_allclose(vals2[prog2.grads["w"]], m2.w.grad.numpy(), rtol=0, atol=1e-9, equal_nan=False)


def test_training_through_an_op_without_grad_rule_raises() -> None:
    class Cum(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x: Any) -> Any:
            return torch.cumsum(x @ self.w, dim=0).sum()

    x = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(ProgramError, match=r"aten\.cumsum.*training.*no grad rule"):
        import_module(_model(Cum), (x,), training=True)


def test_loss_by_index_and_by_callable() -> None:
    m = _model(Llama)
    toks, labels = _data()

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = m

        def forward(self, t: Any, y: Any) -> Any:
            logits = self.m.logits(t)
            return logits, F.cross_entropy(logits.flatten(0, 1), y.flatten())

    both = Both()
    prog = import_module(both, (toks, labels), training=True, loss=1, optimizer=None)
    assert prog.loss == prog.outputs[1] and not any(op.phase == "optimizer" for op in prog.ops)
    want = both(toks, labels)[1].item()
    assert abs(float(_sim(prog, both, (toks, labels))[prog.loss]) - want) < 1e-9

    class Logits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = m

        def forward(self, t: Any) -> Any:
            return self.m.logits(t)

    lg = Logits()
    prog2 = import_module(lg, (toks,), training=True, optimizer="sgd",
                          loss=lambda out: F.cross_entropy(out.flatten(0, 1), labels.flatten()))
    assert sum(op.rule == "sgd" for op in prog2.ops) == len(list(m.parameters()))
    assert abs(float(_sim(prog2, lg, (toks,))[prog2.loss]) - want) < 1e-9


def test_buffers_as_parameters_and_json_round_trip() -> None:
    m = _model(GPT2)
    prog = import_module(m, _data(), buffers="parameter")
    assert prog.tensors["blocks.0.mask"].kind == "parameter"
    again = program_from_json(prog.to_json())
    again.validate()
    assert [op.rule for op in again.ops] == [op.rule for op in prog.ops]


# -- the import gaps of issue 27: each lowering against torch eager, forward and gradients --------------


class ImportGaps(nn.Module):
    """The ATen ops the HF classes of issue 27 reach: repeat_interleave (GPT-J, Cohere), baddbmm
    (BLOOM's ALiBi), polar and complex arithmetic (Llama 4's rope), a strided slice (DeepSeek-V3's
    interleaved rope), a depthwise causal conv1d, tensor_split with an empty tail and softplus
    (Mamba), scatter of a value and of a src (DeepSeek-V3's group mask, Llama 4's router), repeat
    (Llama 4's routed input)."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.w = nn.Parameter(torch.randn(2, 6, 8, generator=g))
        self.conv = nn.Conv1d(8, 8, 3, padding=2, groups=8)
        self.conv2 = nn.Conv1d(8, 4, 2, bias=False)
        self.register_buffer("inv_freq", torch.linspace(0.1, 1.0, 4))

    def forward(self, x: Any) -> Any:
        a = x * self.w  # [2, 6, 8]
        rep = a.repeat_interleave(2, dim=-1)  # [2, 6, 16]
        flat = a[0, :2].repeat_interleave(3)  # dim None: the flattened [48]
        bias = torch.ones(2, 6, 6, dtype=a.dtype)
        scores = bias.baddbmm(a, a.transpose(1, 2), beta=0.5, alpha=0.25)  # [2, 6, 6]
        freqs = torch.arange(6, dtype=a.dtype)[:, None] * self.inv_freq[None, :]  # [6, 4]
        cis = torch.polar(torch.ones_like(freqs), freqs)
        ac = torch.view_as_complex(a.reshape(2, 6, 4, 2))
        rot = torch.view_as_real(ac * cis * 2.0).flatten(2)  # [2, 6, 8]
        even, odd = a[..., ::2], a[..., 1::2]  # strided slices: their grads
        conv = self.conv(a.transpose(1, 2))[..., :6]  # causal: padding k - 1, the tail cut
        conv2 = self.conv2(F.softplus(conv))
        head, tail = torch.tensor_split(conv, [6], dim=2)  # an empty tail
        top = a.topk(2, dim=-1)
        mask = torch.zeros_like(a).scatter(2, top.indices, 1.0)  # value
        routed = torch.full_like(a, -5.0).scatter(2, top.indices, top.values)  # src: its gradient
        tiled = a[0].repeat(2, 1)  # [12, 8]
        parts = [rep, flat, scores, rot, even * odd, conv, conv2, head, mask * a, routed, tiled]
        return sum((t * t).sum() * (k + 1) for k, t in enumerate(parts)) + tail.sum(), rot, scores, routed


def test_import_gaps_equal_torch_eager() -> None:
    m = _model(ImportGaps)
    x = torch.randn(2, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(12))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="torch import")  # a replicated fallback would warn
        prog = import_module(m, (x,), training=True, optimizer=None)
    rules = _rules(prog)
    assert {"strided_slice_grad", "put_along_axis", "put_along_axis_grad", "tile_grad", "softplus_grad",
            "conv3d_grad", "expand_grad", "stack"} <= rules and "replicated" not in rules
    vals = _sim(prog, m, (x,))
    loss, rot, scores, routed = m(x)
    loss.backward()
    for o, want in zip(prog.outputs, (loss, rot, scores, routed)):
        np.testing.assert_allclose(vals[o], want.detach().numpy(), rtol=1e-12, atol=1e-12, err_msg=o)
    for p, t in m.named_parameters():
        assert t.grad is not None and float(t.grad.abs().max()) > 0, p
        np.testing.assert_allclose(vals[prog.grads[p]], t.grad.numpy(), rtol=1e-11, atol=1e-11, err_msg=p)


def test_import_gaps_torch_kernels_equal_the_references() -> None:
    """The torch kernels the new lowerings need (strided_slice and its grad, put_along_axis and
    its grad, tile_grad, softplus_grad) agree with the numpy references on the imported step."""
    from spmdkit.execute.single import global_step

    m = _model(ImportGaps)
    x = torch.randn(2, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(13))
    prog = import_module(m, (x,), training=True, optimizer=None)
    plan = propagate(prog, parse_mesh("dp=1"), {})
    values = torch_values(prog, m, (x,))
    ref = global_step(plan, 0, values)
    got = global_step(plan, 0, values, kernels="torch")
    assert set(got) == set(ref)
    for n, v in ref.items():
        np.testing.assert_allclose(got[n], v, rtol=1e-10, atol=1e-10, err_msg=n)


def test_a_data_dependent_repeat_is_refused() -> None:
    class Rep(nn.Module):
        def forward(self, x: Any) -> Any:
            return x.repeat_interleave(torch.tensor([1, 2, 1]), dim=0)

    with pytest.raises(ProgramError, match=r"aten\.repeat_interleave.*a different repeat per element"):
        import_module(Rep(), (torch.randn(3, 2),))



def test_a_frozen_parameter_is_not_trained() -> None:
    """A parameter with requires_grad=False (Whisper's sinusoidal positions) gets no gradient and
    no update, as in torch's step; the others' gradients equal torch's."""

    class Frozen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Parameter(torch.randn(4, 3), requires_grad=False)
            self.w = nn.Parameter(torch.randn(3, 3))

        def forward(self, x: Any) -> Any:
            return ((x + self.pos) @ self.w).square().mean()

    m = _model(Frozen)
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    prog = import_module(m, (x,), training=True)
    assert set(prog.grads) == {"w"} and "pos.new" not in prog.tensors and prog.tensors["pos"].kind == "parameter"
    vals = _sim(prog, m, (x,))
    m(x).backward()
    np.testing.assert_allclose(vals[prog.grads["w"]], m.w.grad.numpy(), rtol=1e-12, atol=1e-12)
