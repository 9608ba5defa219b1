"""Import a ``torch.nn.Module`` as a spmdkit :class:`~spmdkit.program.ir.Program`.

``import_module(module, args, kwargs)`` exports the module with ``torch.export.export``
(static shapes from the example inputs; the pre-dispatch ATen graph, so ``linear``, the norms,
``scaled_dot_product_attention`` and ``cross_entropy_loss`` keep their names) and maps every ATen
op to registered rules with their Paddle 3.3.1 attributes, one module of lowerings per op family
(``aten/<family>.py``, named as :mod:`spmdkit.ops`):

- ``linear`` -> ``matmul(trans_y=True)`` [+ ``add``]; ``mm`` / ``bmm`` / ``matmul`` ->
  ``matmul``; ``addmm`` / ``baddbmm`` -> ``matmul`` + ``add``; ``conv1d`` / ``conv2d`` ->
  ``conv2d`` / ``conv3d``; ``repeat_interleave`` -> ``expand`` between reshapes, ``repeat`` ->
  ``tile``, ``scatter`` -> ``put_along_axis``; complex tensors (``polar``, ``view_as_complex``,
  a complex ``mul``) as their real parts ``[..., 2]``
- the layer and RMS norms -> the ``norm`` family's rules (:mod:`.aten.norm`)
- ``softmax`` / ``log_softmax``, ``embedding``, ``gelu`` / ``silu`` / ``relu`` / ``tanh`` / ``exp``
  / ``rsqrt`` / ... (same names), ``pow`` (2 -> ``square``, 0.5 -> ``sqrt``, -0.5 -> ``rsqrt``, else
  ``elementwise_pow``)
- views (``view`` / ``reshape`` / ``flatten`` / ...) -> ``reshape``; ``permute`` / ``transpose`` /
  ``t`` -> ``transpose``; ``expand``, ``unsqueeze``, ``squeeze``; ``select`` / ``slice`` ->
  ``slice``; ``cat`` -> ``concat``; ``split`` / ``split_with_sizes`` / ``chunk`` -> ``split``
- ``add`` / ``sub`` / ``mul`` / ``div`` on tensors -> ``add`` / ``subtract`` / ``multiply`` /
  ``divide``; with a Python scalar the scalar becomes a 0-d constant input tensor (spmdkit's
  ``scale`` rule carries no factor, so a scale would lose the value); ``neg`` -> ``multiply`` by -1
- ``scaled_dot_product_attention`` -> transposes to Paddle's ``[b, s, h, d]``, ``flash_attention``
  (``causal``; grouped kv heads), transpose back; with a mask or a non-default scale it is spelt
  out (``matmul``, ``multiply``, ``add``, ``softmax``, ``matmul``)
- ``cross_entropy_loss``, and ``nll_loss`` over ``log_softmax`` (through reshapes) ->
  ``cross_entropy_with_softmax`` on the logits, then the reduction (``mean`` / ``sum``)
- ``contiguous`` / ``clone`` / ``alias`` / ``detach`` / ``dropout`` (eval or p=0) / same-dtype casts:
  dropped; other casts -> ``cast``
- nodes that depend on no input (``arange``, ``full``, ``ones_like``, a mask built from
  constants, ...) are evaluated at import time and become constant ``input`` tensors; a graph
  with in-place ops is functionalised first (``run_decompositions({})``).

Parameters become ``parameter`` tensors named by their module path (``blocks.0.ln1.weight``),
buffers ``input`` (or ``parameter``: ``buffers="parameter"``), example inputs ``input`` (integer
token ids ``int64``); other tensors are named after their FX nodes.

An ATen op with no mapping raises :class:`~spmdkit.core.errors.ProgramError` naming the op and
its source line, unless it is mapped (:func:`register_aten`, or ``mapping=`` per call: a hook
``fn(ctx) -> value`` or the name of a rule taking the node's tensor arguments in order) or
``fallback="replicate"`` (``--fallback replicate``: a ``replicated`` op, with a warning; in
training its backward is another ``replicated`` op, and both run the ATen op with torch, the
backward as its vector-Jacobian product).

``training=True`` differentiates the imported forward with :class:`spmdkit.program.autodiff.Tape` (the
registered grad rules) and adds an AdamW (or SGD) update per parameter, as the zoo builders do.

:func:`torch_values` gives the source values of an imported program from the module's own
weights and the example inputs (:func:`spmdkit.execute.single.run_program` runs it unsharded on
the simulator's numpy references). Nothing in the spmdkit core imports this package.

The package: this module (the entry points), :mod:`~spmdkit.models.torch_import.importer` (the
walk of the exported graph, :class:`ImportedProgram`), :mod:`~spmdkit.models.torch_import.context`
(what a lowering sees, :class:`ImportContext`) and :mod:`spmdkit.models.torch_import.aten` (the
lowerings, one module per op family with the file names of :mod:`spmdkit.ops`).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from spmdkit.core.errors import ProgramError
from spmdkit.models.torch_import.aten import mapped_ops
from spmdkit.models.torch_import.aten.attention import cp_mapping
from spmdkit.models.torch_import.context import Hook, ImportContext, Name
from spmdkit.models.torch_import.fuse import fuse as fuse_graph
from spmdkit.models.torch_import.importer import ImportedProgram, Importer, register_aten, unregister_aten
from spmdkit.models.torch_import.layers import expand, layer_kinds, layer_stack, prefix_plan
from spmdkit.models.torch_import.moe import Block, lowered_moe


class _WithLoss(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, loss: Callable[[Any], Any]) -> None:
        super().__init__()
        self.module = module
        self.loss_fn = loss

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.loss_fn(self.module(*args, **kwargs))


def hf_call_kwargs(module: Any, kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """A HuggingFace model's call as a step: ``use_cache=False`` unless given (a KV cache is
    inference state, and torch.export cannot return HF's cache objects)."""
    kw = dict(kwargs or {})
    cfg = getattr(module, "config", None)
    if isinstance(module, torch.nn.Module) and getattr(cfg, "use_cache", None) and "use_cache" not in kw:
        try:
            takes = "use_cache" in inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            takes = False
        if takes:
            kw["use_cache"] = False
    return kw


def _mutates(ep: Any) -> bool:
    for n in ep.graph.nodes:
        schema = getattr(n.target, "_schema", None) if n.op == "call_function" else None
        if schema is not None and schema.is_mutable:
            return True
    return False


def export(module: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
    """``torch.export.export`` with static shapes (an ExportedProgram is passed through)."""
    if isinstance(module, torch.export.ExportedProgram):
        return module
    try:
        return torch.export.export(module, tuple(args), dict(kwargs or {}))
    except Exception as exc:  # export cannot trace it: say so, with torch's reason
        raise ProgramError(f"torch import: torch.export.export failed: {type(exc).__name__}: {exc}") from exc


def import_module(module: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, *, name: str = "",
                  training: bool = False,
                  loss: Any = None, mapping: Mapping[Any, Hook | str] | None = None, fallback: str = "error",
                  buffers: str = "input", optimizer: str | None = "adamw", decompose: bool = False,
                  repeat_layers: bool = False, moe: str | float | None = "dropless",
                  fuse: bool = False, moe_chunks: int = 1) -> ImportedProgram:
    """The module's step as a validated spmdkit Program (see the module docstring), for the
    call ``module(*args, **kwargs)`` (the example inputs: their shapes and dtypes are the
    program's; a HuggingFace model takes ``input_ids=``, ``attention_mask=``, ``labels=``, ...).

    ``training``: add the backward (reverse-mode over the registered grad rules) and, unless
    ``optimizer`` is None, an ``adamw`` (or ``sgd``) update per parameter; ``loss``: which output
    is the loss (an index into the flattened outputs, a tensor name, or a callable applied to
    the module's output, traced with it; default the first scalar float output); ``mapping``:
    per-call hooks (as :func:`register_aten`), which win over the registered and built-in ones;
    ``fallback``: ``"error"`` (an unmapped op raises ProgramError) or ``"replicate"``;
    ``buffers``: ``"input"`` or ``"parameter"``; ``decompose``: run torch's default decompositions
    first (core ATen: ``addmm``, the native norms, ``_softmax``, ...). ``module`` may also be
    a ``torch.export.ExportedProgram``; ``repeat_layers``: export one layer of each kind and
    repeat it to the module's depth (:mod:`spmdkit.models.torch_import.layers`; the same program
    as the full trace, which it falls back to where the layers do not form a plain chain);
    ``moe``: HF's MoE blocks lowered to the zoo's MoE ops (:mod:`.moe`) with this capacity per
    expert and sequence (``"dropless"``: every token, the module's own values; ``"uniform"``: the
    zoo's ``ceil(seq x top_k / experts)``; a float: that times the capacity factor), or None:
    imported as HF computes them (its grouped matmul: every expert on every token);
    ``moe_chunks``: each sequence routed in that many chunks, each on its own (its capacity per
    chunk: context parallelism's, one chunk a cp rank); ``fuse``:
    RMSNorm and SwiGLU spelt out in ATen ops become the zoo's fused ops (:mod:`.fuse`)."""
    modes = {m: m.training for m in module.modules()} if isinstance(module, torch.nn.Module) else {}
    kwargs = hf_call_kwargs(module, kwargs)
    name = name or type(module).__name__
    if callable(loss) and not isinstance(loss, torch.nn.Module) and isinstance(module, torch.nn.Module):
        module = _WithLoss(module, loss)
        loss = None
    if isinstance(module, torch.nn.Module):
        module.eval()  # dropout off, as the simulator and the planner see the step
    blocks: list[Block] = []
    with contextlib.ExitStack() as stack:
        if moe is not None and isinstance(module, torch.nn.Module):
            blocks = stack.enter_context(lowered_moe(module, _tokens(args, kwargs), moe, chunks=moe_chunks))
        try:
            if repeat_layers and isinstance(module, torch.nn.Module):
                prog = _import_repeated(module, tuple(args), kwargs, (decompose, fuse),
                                        (name, training, mapping, fallback, buffers), (loss, optimizer))
                if prog is not None:
                    prog.moe_blocks = blocks
                    return prog
            ep = _prepared(export(module, tuple(args), kwargs), decompose, fuse)
        finally:
            for m, was in modes.items():
                m.train(was)
    imp = Importer(ep, name, training, mapping, fallback, buffers)
    imp.run()
    prog = imp.finish(loss, optimizer)
    prog.moe_blocks = blocks
    return prog


def _tokens(args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[int, int]:
    """(sequences, tokens each) of a call: the first integer tensor of two or more axes (the
    token ids), else the first tensor's first two axes; (1, 1) without one."""
    flat = [v for v in torch.utils._pytree.tree_flatten((tuple(args), dict(kwargs)))[0] if isinstance(v, torch.Tensor)]
    ids = [v for v in flat if v.dim() >= 2 and not v.is_floating_point()] or [v for v in flat if v.dim() >= 2]
    return (int(ids[0].shape[0]), int(ids[0].shape[1])) if ids else (1, 1)


def _prepared(ep: Any, decompose: bool, fuse: bool = False) -> Any:
    if decompose:
        return ep.run_decompositions()
    if _mutates(ep):  # in-place ops (x.add_(1), buffer updates): functionalise, decomposing nothing
        ep = ep.run_decompositions({})
    if fuse:
        fuse_graph(ep)
    return ep


def _import_repeated(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], prep: tuple[bool, bool],
                     walk: tuple[Any, ...], end: tuple[Any, Any]) -> ImportedProgram | None:
    """The module imported from an export of its first layers written out to its depth
    (:mod:`.layers`); None where that does not apply (no layer stack, every layer needed, a
    graph that is not a plain chain of layers, or parameters that differ from the module's)."""
    stack = layer_stack(module)
    if stack is None:
        return None
    path, layers = stack
    n, copies = prefix_plan(layer_kinds(layers))
    if n >= len(layers):
        return None
    parent_path, _, attr = path.rpartition(".")
    parent = module.get_submodule(parent_path)
    parent._modules[attr] = torch.nn.ModuleList(list(layers)[:n])
    try:
        ep = _prepared(export(module, args, kwargs), prep[0])
    finally:
        parent._modules[attr] = layers
    full = expand(ep, module, path, copies)
    if full is None:
        return None
    if prep[1]:  # fused once written out, so that its nodes are named as a full trace's
        fuse_graph(full)
    imp = Importer(full, *walk)
    imp.run()
    prog = imp.finish(*end)
    want = {n: math.prod(tuple(p.shape)) for n, p in module.named_parameters()}
    got: dict[str, int] = {}
    for pn in prog.parameters():  # an expert bank's [E, in, out] parts count as the bank
        kind, where = prog.sources[pn]
        fqn = str(where[0] if kind == "parameter_slice" else where)
        got[fqn] = got.get(fqn, 0) + math.prod(prog.tensors[pn].shape)
    return prog if got == want else None


def torch_values(prog: ImportedProgram, module: Any, args: Sequence[Any] = (),
                 kwargs: Mapping[str, Any] | None = None, *, dtype: Any = None, learning_rate: float = 1e-3
                 ) -> dict[str, Any]:
    """numpy values of every source tensor of ``prog``: the module's own parameters and
    buffers, the call's inputs (``args`` and ``kwargs`` as given to :func:`import_module`), the recorded constants, the loss seed (ones), and for the
    optimizer a learning rate, zero moments and beta powers 0.9 / 0.999. Floats become
    ``dtype`` (default float64, as the simulator computes)."""
    import numpy as np

    fdt = np.dtype(dtype or np.float64)
    state: dict[str, Any] = {}
    if isinstance(module, torch.export.ExportedProgram):
        state.update(module.state_dict)
        state.update(module.constants)
    else:
        if isinstance(module, _WithLoss):
            module = module.module
        state.update(dict(module.named_parameters(remove_duplicate=False)))
        state.update(dict(module.named_buffers(remove_duplicate=False)))
    call = (tuple(args), dict(kwargs or {}))
    flat_in, _ = torch.utils._pytree.tree_flatten(call)
    paths = getattr(prog, "input_paths", {})

    def call_input(name: str, i: int) -> Any:
        path = paths.get(name)
        if path is None:
            return flat_in[i]
        v: Any = call
        try:
            for k in path:
                v = k.get(v)
        except (KeyError, IndexError, AttributeError, TypeError):
            where = prog.input_path(name) if isinstance(prog, ImportedProgram) else name
            raise ProgramError(f"torch_values: input {name!r} ({where}) is not in the given args / kwargs") from None
        return v

    def conv(t: Any) -> Any:
        if isinstance(t, FakeTensor) or (isinstance(t, torch.Tensor) and t.is_meta):
            raise ProgramError("torch_values: the module was imported without its weights (its parameters are fake "
                               "tensors: hf.build(weights=False), or a model too large to build them); build it "
                               "with its weights to run it")
        if isinstance(t, torch.Tensor):
            t = t.detach().cpu()
            a = (t.double() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()  # numpy has no bfloat16
        else:
            a = np.asarray(t)
        return a.astype(fdt) if a.dtype.kind == "f" else a

    out: dict[str, Any] = {}
    made = {n for op in prog.ops for n in op.output_names()}
    for name, t in prog.tensors.items():
        if name in made or t.inplace_of:
            continue
        src = prog.sources.get(name)
        if src is not None:
            kind, where = src
            if kind in ("parameter", "buffer"):
                if where.startswith("module.") and where not in state:
                    where = where[len("module."):]
                if where not in state:
                    raise ProgramError(f"torch_values: the module has no parameter or buffer {where!r}")
                out[name] = conv(state[where])
            elif kind == "parameter_slice":  # a part of a fused parameter (strategies.hf_fused)
                fqn, axis, lo, hi, *perm = where
                if fqn.startswith("module.") and fqn not in state:
                    fqn = fqn[len("module."):]
                if fqn not in state:
                    raise ProgramError(f"torch_values: the module has no parameter {fqn!r}")
                part = state[fqn].narrow(axis, lo, hi - lo)
                out[name] = conv(part.permute(*perm[0]) if perm and perm[0] else part)  # an expert bank's [E, in, out]
            elif kind == "input":
                out[name] = conv(call_input(name, where))
            else:
                out[name] = conv(prog.constants[name])
        elif name.endswith(".grad") and t.kind == "input":
            out[name] = np.ones(t.shape, dtype=fdt)
        elif name == "learning_rate":
            out[name] = np.full(t.shape, learning_rate, dtype=fdt)
        elif name.endswith("beta1_pow"):
            out[name] = np.full(t.shape, 0.9, dtype=fdt)
        elif name.endswith("beta2_pow"):
            out[name] = np.full(t.shape, 0.999, dtype=fdt)
        elif t.kind == "optimizer_state":
            out[name] = np.zeros(t.shape, dtype=fdt)
        else:
            raise ProgramError(f"torch_values: no value known for source tensor {name!r}")
    return out


__all__ = ["ImportContext", "ImportedProgram", "cp_mapping", "Name", "export", "hf_call_kwargs", "import_module", "mapped_ops",
           "register_aten", "torch_values", "unregister_aten"]
