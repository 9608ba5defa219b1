"""Import a ``torch.nn.Module`` as a spmdkit :class:`~spmdkit.program.ir.Program`.

``import_module(module, args, kwargs)`` exports the module with ``torch.export.export``
(static shapes from the example inputs; the pre-dispatch ATen graph, so ``linear``,
``layer_norm``, ``rms_norm``, ``scaled_dot_product_attention`` and ``cross_entropy_loss`` keep
their names) and maps every ATen op to registered rules with their Paddle 3.3.1 attributes:

- ``linear`` -> ``matmul(trans_y=True)`` [+ ``add``]; ``mm`` / ``bmm`` / ``matmul`` ->
  ``matmul``; ``addmm`` -> ``matmul`` + ``add``
- ``layer_norm`` -> ``layer_norm`` (``begin_norm_axis``), ``rms_norm`` -> ``fused_rms_norm``
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
``fallback="replicate"`` (a ``replicated`` op, with a warning).

``training=True`` differentiates the imported forward with :class:`spmdkit.program.autodiff.Tape` (the
registered grad rules) and adds an AdamW (or SGD) update per parameter, as the zoo builders do.

:func:`torch_values` gives the source values of an imported program from the module's own
weights and the example inputs (:func:`spmdkit.execute.single.run_program` runs it unsharded on
the simulator's numpy references). Nothing in the spmdkit core imports this module.
"""

from __future__ import annotations

import math
import operator
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from spmdkit.core.errors import ProgramError
from spmdkit.engine.registry import get_rule, has_rule
from spmdkit.models.zoo import Model, ModelConfig, add_optimizer
from spmdkit.program.autodiff import GRADS, Tape
from spmdkit.program.ir import Op, Program, ProgramBuilder, RecordedValue, Tensor, flat_refs

_DTYPES: dict[Any, str] = {
    torch.float64: "float64", torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8",
    torch.bool: "bool",
}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}


def _dtype_name(dt: Any) -> str:
    try:
        return _DTYPES[dt]
    except KeyError:
        raise ProgramError(f"torch import: dtype {dt} has no spmdkit dtype (one of {', '.join(_TORCH_DTYPES)})") from None


class Name(str):
    """A program tensor name as an imported node's value (a plain ``str`` is an attribute)."""

    __slots__ = ()


Hook = Callable[["ImportContext"], Any]
_REGISTRY: dict[str, Hook | str] = {}


def _key(op: Any) -> str:
    """``aten.linear.default`` / ``aten.linear`` / ``linear`` / an OpOverload(Packet) -> the
    key handlers are stored under (the overload's or the packet's name)."""
    if isinstance(op, str):
        s = op.strip()
        if s.startswith("torch.ops."):
            s = s[len("torch.ops."):]
        if "." not in s:
            s = "aten." + s
        return s
    if isinstance(op, torch._ops.OpOverload):
        return f"{op.namespace}.{op._opname}.{op._overloadname}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return str(op._qualified_op_name).replace("::", ".")
    return str(op)


def register_aten(op: Any, fn: Hook | str) -> None:
    """Map an ATen op (``"aten.erf"``, ``"aten.erf.default"``, ``torch.ops.aten.erf``) for every
    later import: ``fn(ctx)`` emits spmdkit ops with ``ctx.emit`` and returns the node's value
    (a tensor name; a tuple of them for a multi-output node), or ``fn`` is a rule name taking
    the node's tensor arguments in order (one output, the node's shape)."""
    _REGISTRY[_key(op)] = fn


def unregister_aten(op: Any) -> None:
    _REGISTRY.pop(_key(op), None)


def _lookup(table: Mapping[str, Any], target: Any) -> Any:
    full = _key(target)
    if full in table:
        return table[full]
    packet = full.rsplit(".", 1)[0] if full.count(".") >= 2 else full
    return table.get(packet)


# -- the imported program ---------------------------------------------------------------------


class ImportedProgram(Program):
    """A Program imported from torch, and where its source tensors come from.

    ``sources``: tensor -> ``("parameter", fqn)``, ``("buffer", fqn)``, ``("input", i)`` (the
    i-th flattened input of the call; ``input_paths`` says where it is in ``(args, kwargs)``) or ``("constant", None)`` (value in ``constants``);
    ``outputs``: the module's (flattened) outputs; ``loss``, ``grads`` (parameter -> gradient)
    and ``optimizer`` (as :class:`spmdkit.models.zoo.Model.optimizer`) for a training import;
    ``origins``: op index -> the ATen node it came from (``aten.linear.default at model.py:12``);
    ``fallbacks``: op index -> (torch callable, args, kwargs) of a ``replicated`` fallback op, so
    :func:`spmdkit.execute.single.run_program` can run it with torch; ``aliases``: a tied parameter's other names ->
    the tensor it is (``head.weight`` -> ``wte.weight``); ``modules``: op index -> (path, class
    name) of the innermost ``nn.Module`` whose forward made it (``("model.layers.0.self_attn.q_proj",
    "Linear")``; absent for ops outside any submodule), so strategies can go by module names;
    ``values`` (as every :class:`~spmdkit.program.ir.Program`): the recorded values of the
    constants and buffers, which the simulator and ``spmdkit run`` use and the JSON keeps."""

    def __init__(self, tensors: Iterable[Tensor], ops: Iterable[Op], name: str = "") -> None:
        super().__init__(tensors, ops, name)
        self.sources: dict[str, tuple[str, Any]] = {}
        self.constants: dict[str, torch.Tensor] = {}
        self.outputs: list[str] = []
        self.loss: str | None = None
        self.grads: dict[str, str] = {}
        self.optimizer: dict[str, tuple[str, tuple[str, ...], str, tuple[str, ...]]] = {}
        self.origins: dict[int, str] = {}
        self.fallbacks: dict[int, tuple[Any, Any, Any]] = {}
        self.aliases: dict[str, str] = {}
        self.input_paths: dict[str, tuple[Any, ...]] = {}
        self.modules: dict[int, tuple[str, str]] = {}

    def input_path(self, name: str) -> str:
        """Where an ``input`` tensor comes from in the call: ``args[0]``, ``kwargs['input_ids']``."""
        path = self.input_paths.get(name)
        if path is None:
            return name
        head, *rest = path
        root = "args" if getattr(head, "idx", 0) == 0 else "kwargs"
        return root + "".join(str(k) for k in rest)

    def parameters(self) -> list[str]:
        """The tensors imported as parameters (their module paths)."""
        return [n for n in self.sources if self.tensors[n].kind == "parameter"]


# -- the per-node context -----------------------------------------------------------------------


def _where(node: Any) -> str:
    st = node.meta.get("stack_trace") or ""
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', st)
    if frames:
        f, line, fn, code = frames[-1]
        return f"{f.rsplit('/', 1)[-1]}:{line} in {fn}: {code.strip()}"
    mod = node.meta.get("nn_module_stack")
    if mod:
        path, typ = list(mod.values())[-1]
        return f"module {path or '<root>'} ({getattr(typ, '__name__', typ)})"
    return "unknown source location"


def _module_of(node: Any) -> tuple[str, str] | None:
    mod = node.meta.get("nn_module_stack")
    if not mod:
        return None
    path, typ = list(mod.values())[-1]
    name = getattr(typ, "__name__", None) or str(typ).rsplit(".", 1)[-1]
    return (str(path), str(name))


def _layer(node: Any) -> str:
    mod = node.meta.get("nn_module_stack")
    if not mod:
        return ""
    path = str(list(mod.values())[-1][0])
    parts = [p for p in path.split(".") if p]
    # a numbered block of a module list (model.layers.3, transformer.h.0, encoder.block.1):
    # the path up to its number, so each transformer layer is one group
    for k, p in enumerate(parts):
        if p.isdigit() and k:
            return ".".join(parts[:k + 1])
    return parts[0] if parts else ""


def _norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


class ImportContext:
    """What a mapping hook sees for one FX node: ``node``, ``target`` (``"aten.linear.default"``),
    ``args`` / ``kwargs`` (tensors as program tensor names, constants as torch tensors, the rest
    as Python values), and the emitters. ``emit(rule, inputs, outputs=None, **attrs)`` adds an op
    (``outputs``: per output a declared name, None, or ``(name, shape[, dtype])``; default one
    output named after the node with its shape and dtype) and returns its output names."""

    def __init__(self, imp: _Importer, node: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.imp = imp
        self.node = node
        self.name: str = node.name
        self.target: str = _key(node.target)
        self.args = args
        self.kwargs = kwargs
        self.where = _where(node)
        self._k = 0

    # -- arguments and shapes
    def arg(self, i: int, name: str, default: Any = None) -> Any:
        if i < len(self.args):
            return self.args[i]
        return self.kwargs.get(name, default)

    def val(self) -> Any:
        return self.node.meta.get("val")

    def out_shape(self) -> tuple[int, ...]:
        v = self.val()
        if not isinstance(v, torch.Tensor):
            raise ProgramError(f"torch import: {self.target} at {self.where}: no single tensor output")
        return tuple(int(s) for s in v.shape)

    def out_dtype(self) -> str:
        v = self.val()
        return _dtype_name(v.dtype) if isinstance(v, torch.Tensor) else "float32"

    def shape(self, v: Any) -> tuple[int, ...]:
        if isinstance(v, torch.Tensor):
            return tuple(int(s) for s in v.shape)
        return self.imp.b.get(self.tensor(v)).shape

    def dtype(self, v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return _dtype_name(v.dtype)
        return self.imp.b.get(self.tensor(v)).dtype

    def is_tensor(self, v: Any) -> bool:
        return isinstance(v, (Name, torch.Tensor))

    def tensor(self, v: Any, dtype: str | None = None) -> Name:
        """A program tensor for ``v``: a tensor name as is, a torch constant or a Python
        scalar as a constant ``input`` tensor (the scalar 0-d, of ``dtype``)."""
        if isinstance(v, Name):
            return v
        if isinstance(v, str) and self.imp.b.has(v):
            return Name(v)
        return self.imp.constant(v, dtype or self.out_dtype())

    def fresh(self, suffix: str) -> str:
        """A new tensor name derived from the node's."""
        n = f"{self.name}.{suffix}"
        while self.imp.b.has(n):
            self._k += 1
            n = f"{self.name}.{suffix}{self._k}"
        return n

    # -- emitters
    def emit(self, rule: str, inputs: Mapping[str, Any], outputs: Sequence[Any] | None = None, /,
             **attrs: Any) -> list[str | None]:
        if outputs is None:
            outputs = [(self.name, self.out_shape(), self.out_dtype())]
        ins = {k: (tuple(None if x is None else self.tensor(x) for x in v) if isinstance(v, (list, tuple))
                   else (None if v is None else self.tensor(v))) for k, v in inputs.items()}
        return self.imp.emit(self, rule, ins, list(outputs), attrs)

    def emit_nograd(self, rule: str, inputs: Mapping[str, Any], outputs: Sequence[Any], /,
                    **attrs: Any) -> list[str | None]:
        """An op the autodiff does not differentiate through (its outputs carry no gradient:
        indices chosen by topk, say); a training import differentiates the values otherwise."""
        tape, self.imp.tape = self.imp.tape, None
        try:
            return self.emit(rule, inputs, outputs, **attrs)
        finally:
            self.imp.tape = tape

    def emit1(self, rule: str, inputs: Mapping[str, Any], out: Any = None, /, **attrs: Any) -> Name:
        """One op with one output: ``out`` is its name (the node's shape and dtype), ``(name,
        shape, dtype)``, or None (the node's name, shape and dtype)."""
        if out is None or isinstance(out, str):
            spec = (out or self.name, self.out_shape(), self.out_dtype())
        else:
            spec = (out[0], tuple(out[1]), out[2])
        (o,) = self.emit(rule, inputs, [spec], **attrs)
        assert o is not None
        return Name(o)

    def transpose(self, x: Any, perm: Sequence[int], name: str | None = None) -> Name:
        s = self.shape(x)
        return self.emit1("transpose", {"x": x}, (name or self.fresh("t"), [s[p] for p in perm], self.dtype(x)),
                          perm=tuple(perm))

    def reshape(self, x: Any, shape: Sequence[int], name: str | None = None) -> Name:
        if tuple(self.shape(x)) == tuple(shape) and name is None:
            return self.tensor(x)
        return self.emit1("reshape", {"x": x}, (name or self.fresh("r"), shape, self.dtype(x)), shape=tuple(shape))

    def unsupported(self, why: str) -> ProgramError:
        return ProgramError(f"torch import: {self.target} (node {self.name}) at {self.where}: {why}")


# -- the importer ------------------------------------------------------------------------------


_VIEWS = {"aten.view", "aten.reshape", "aten._unsafe_view", "aten.flatten", "aten.unflatten", "aten.view_as",
          "aten.reshape_as"}
_LOG_SOFTMAX = {"aten.log_softmax", "aten._log_softmax"}
_NLL = {"aten.nll_loss", "aten.nll_loss_nd", "aten.nll_loss_forward", "aten.nll_loss2d", "aten.nll_loss2d_forward"}
_SHAPE_ONLY = {"aten.zeros_like", "aten.ones_like", "aten.full_like", "aten.empty_like", "aten.new_zeros",
               "aten.new_ones", "aten.new_full", "aten.new_empty", "aten.scalar_tensor"}


def _packet(target: Any) -> str:
    k = _key(target)
    return k.rsplit(".", 1)[0] if k.count(".") >= 2 else k


class _Importer:
    def __init__(self, ep: Any, name: str, training: bool, mapping: Mapping[Any, Hook | str] | None,
                 fallback: str, buffers: str) -> None:
        if fallback not in ("error", "replicate"):
            raise ProgramError(f"torch import: fallback must be 'error' or 'replicate', got {fallback!r}")
        if buffers not in ("input", "parameter"):
            raise ProgramError(f"torch import: buffers must be 'input' or 'parameter', got {buffers!r}")
        self.ep = ep
        self.b = ProgramBuilder(name)
        self.tape: Tape | None = Tape(self.b) if training else None
        self.mapping = {_key(k): v for k, v in (mapping or {}).items()}
        self.fallback = fallback
        self.buffers = buffers
        self.env: dict[Any, Any] = {}
        self.sources: dict[str, tuple[str, Any]] = {}
        self.constants: dict[str, torch.Tensor] = {}
        self.origins: dict[int, str] = {}
        self.fallbacks: dict[int, tuple[Any, Any, Any]] = {}
        self._const_ids: dict[int, Name] = {}
        self._nconst = 0
        self.skip: set[Any] = set()
        self.fused: dict[Any, Any] = {}
        self.out_names: list[str] = []
        self.aliases: dict[str, str] = {}
        self.input_paths: dict[str, tuple[Any, ...]] = {}
        self.modules: dict[int, tuple[str, str]] = {}
        self._keep: list[Any] = []

    # -- tensors
    def constant(self, v: Any, dtype: str) -> Name:
        if isinstance(v, torch.Tensor):
            key = id(v)
            if key in self._const_ids:
                return self._const_ids[key]
            t = v.detach().clone()
        elif isinstance(v, (bool, int, float)):
            key = -1
            # torch computes half-precision ops with a Python scalar in float32 (its opmath type),
            # so the scalar is not rounded to bfloat16 / float16 (gelu_new's 0.7978845608 would be)
            if dtype in ("bfloat16", "float16") and isinstance(v, float):
                dtype = "float32"
            t = torch.tensor(v, dtype=_TORCH_DTYPES[dtype])
        else:
            raise ProgramError(f"torch import: cannot make a tensor of {type(v).__name__} {v!r}")
        while self.b.has(f"const_{self._nconst}"):
            self._nconst += 1
        n = Name(self.b.tensor(f"const_{self._nconst}", tuple(t.shape), _dtype_name(t.dtype), "input"))
        self._nconst += 1
        self.sources[n] = ("constant", None)
        self.constants[n] = t
        if key != -1:
            self._const_ids[key] = n
            self._keep.append(v)  # keeps the id from being reused
        return n

    def emit(self, ctx: ImportContext, rule: str, inputs: dict[str, Any], outputs: list[Any],
             attrs: dict[str, Any]) -> list[str | None]:
        if not has_rule(rule):
            raise ctx.unsupported(f"maps to rule {rule!r}, which is not registered (see `spmdkit rules`)")
        start = self.b.op_count
        vector_out = any(isinstance(o, list) for o in outputs)
        names = [n for v in inputs.values() for n in flat_refs(v) if n is not None]
        if self.tape is not None and any(n in self.tape.needs_grad for n in names) and _float_out(self.b, outputs):
            vector_in = any(isinstance(v, tuple) for v in inputs.values())
            twice = sorted({n for n in names if names.count(n) > 1 and n in self.tape.needs_grad})
            if twice and rule in GRADS and not vector_in:
                raise ctx.unsupported(f"training: maps to {rule} reading one tensor twice ({', '.join(twice)}), "
                                      f"which the autodiff does not differentiate")
            if rule not in GRADS:
                why = "has no grad rule in the autodiff (spmdkit.program.autodiff.GRADS)"
                raise ctx.unsupported(f"training: maps to {rule}, which {why}; import with training=False, or "
                                      f"map the op otherwise (register_aten / mapping=)")
        if self.tape is not None:
            result: list[Any] = self.tape.op(rule, inputs, outputs, **attrs)
            for n in (x for o in result for x in flat_refs(o)):  # indices, masks, counts carry no gradient
                if n is not None and n in self.tape.needs_grad and not self.b.get(n).dtype.startswith(("float", "bfloat")):
                    self.tape.needs_grad.discard(n)
        elif vector_out:
            outs: list[Any] = []
            for o in outputs:
                if isinstance(o, list):
                    outs.append(tuple(self._declare(x) for x in o))
                else:
                    outs.append(self._declare(o))
            self.b.append_op(Op(rule, dict(inputs), tuple(outs), dict(attrs), str(flat_refs(outs[0])[0] or rule),
                                self.b.layer, self.b.phase))
            result = outs
        else:
            result = self.b.op(rule, inputs, outputs, **attrs)
        mod = _module_of(ctx.node)
        for i in range(start, self.b.op_count):
            self.origins[i] = f"{ctx.target} (node {ctx.name}) at {ctx.where}"
            if mod is not None:
                self.modules[i] = mod
        return result

    def _declare(self, o: Any) -> str | None:
        if o is None or isinstance(o, str):
            return o
        n, shape, *rest = o
        return self.b.tensor(n, shape, rest[0] if rest else "float32", rest[1] if len(rest) > 1 else "activation")

    # -- values
    def resolve(self, a: Any) -> Any:
        import torch.fx

        if isinstance(a, torch.fx.Node):
            if a not in self.env:
                raise ProgramError(f"torch import: node {a.name} is used before it is defined")
            return self.env[a]
        if isinstance(a, (list, tuple)):
            return type(a)(self.resolve(x) for x in a)
        if isinstance(a, dict):
            return {k: self.resolve(v) for k, v in a.items()}
        return a

    @staticmethod
    def _has_name(v: Any) -> bool:
        if isinstance(v, Name):
            return True
        if isinstance(v, (list, tuple)):
            return any(_Importer._has_name(x) for x in v)
        if isinstance(v, dict):
            return any(_Importer._has_name(x) for x in v.values())
        return False

    # -- fusions planned before the walk
    def plan_fusions(self, graph: Any) -> None:
        import torch.fx

        for node in graph.nodes:
            if node.op != "call_function" or _packet(node.target) not in _NLL:
                continue
            src = node.args[0]
            chain = []
            while isinstance(src, torch.fx.Node) and src.op == "call_function" and _packet(src.target) in _VIEWS \
                    and len(src.users) == 1 and isinstance(src.args[0], torch.fx.Node) \
                    and _last(src) == _last(src.args[0]):
                chain.append(src)
                src = src.args[0]
            if not (isinstance(src, torch.fx.Node) and src.op == "call_function" and _packet(src.target) in _LOG_SOFTMAX
                    and len(src.users) == 1):
                continue
            x = src.args[0]
            dim: Any = src.args[1] if len(src.args) > 1 else src.kwargs.get("dim", -1)
            nd = len(src.meta["val"].shape)
            if not isinstance(x, torch.fx.Node) or _norm_dim(int(dim), nd) != nd - 1 \
                    or len(node.args[0].meta["val"].shape) > 2:
                continue
            self.skip.update([src, *chain])
            self.fused[node] = x

    # -- the walk
    def run(self) -> None:
        from torch.export.graph_signature import InputKind, OutputKind

        ep = self.ep
        graph = ep.graph_module.graph
        self.plan_fusions(graph)
        specs = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}
        user_i = 0
        paths = _input_paths(ep)
        out_names: list[str] = []
        first: dict[int, str] = {}
        for sp in ep.graph_signature.input_specs:
            if sp.kind in (InputKind.PARAMETER, InputKind.BUFFER) and sp.target in ep.state_dict:
                key = id(ep.state_dict[sp.target])
                if key in first:
                    self.aliases[str(sp.target)] = first[key]
                else:
                    first[key] = str(sp.target)
        for node in graph.nodes:
            if node.op == "placeholder":
                spec: Any = specs.get(node.name)
                val = node.meta.get("val")
                kind = spec.kind if spec is not None else InputKind.USER_INPUT
                if kind == InputKind.USER_INPUT:
                    if isinstance(val, torch.Tensor):
                        n = self.b.tensor(node.name, tuple(int(s) for s in val.shape), _dtype_name(val.dtype), "input")
                        self.sources[n] = ("input", user_i)
                        if user_i < len(paths) and paths[user_i] is not None:
                            self.input_paths[n] = paths[user_i]
                        self.env[node] = Name(n)
                    else:
                        self.env[node] = val
                    user_i += 1
                elif kind in (InputKind.PARAMETER, InputKind.BUFFER):
                    fqn = str(spec.target)
                    canon = self.aliases.get(fqn)
                    if canon is not None:  # a tied weight: one tensor under its first name
                        self.env[node] = Name(canon)
                        continue
                    shape = tuple(int(s) for s in val.shape)
                    dt = _dtype_name(val.dtype)
                    as_param = kind == InputKind.PARAMETER or self.buffers == "parameter"
                    if as_param and self.tape is not None and val.is_floating_point():
                        n = self.tape.param(fqn, shape, dt)
                    else:
                        n = self.b.tensor(fqn, shape, dt, "parameter" if as_param else "input")
                    self.sources[n] = ("parameter" if kind == InputKind.PARAMETER else "buffer", fqn)
                    self.env[node] = Name(n)
                elif kind == InputKind.CONSTANT_TENSOR:
                    self.env[node] = ep.constants[spec.target]
                else:
                    raise ProgramError(f"torch import: input {node.name} of kind {kind} is not supported")
            elif node.op == "get_attr":
                self.env[node] = getattr(ep.graph_module, str(node.target))
            elif node.op == "call_function":
                if node in self.skip:  # fused into a later node
                    self.env[node] = None
                    continue
                self.b.layer = _layer(node)
                self.env[node] = self.call(node)
            elif node.op == "output":
                flat, _ = torch.utils._pytree.tree_flatten(self.resolve(node.args[0]))
                kinds = [o.kind for o in ep.graph_signature.output_specs]
                if len(kinds) == len(flat):  # the module's outputs, not its buffer mutations
                    flat = [v for v, k in zip(flat, kinds) if k in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT)]
                for v in flat:
                    if isinstance(v, Name):
                        out_names.append(v)
                    elif isinstance(v, torch.Tensor):
                        out_names.append(self.constant(v, _dtype_name(v.dtype)))
            else:
                raise ProgramError(f"torch import: FX node kind {node.op!r} ({node.name}) is not supported")
        self.out_names = out_names

    def call(self, node: Any) -> Any:
        args = self.resolve(tuple(node.args))
        kwargs = self.resolve(dict(node.kwargs))
        target = node.target
        ctx = ImportContext(self, node, args, kwargs)
        if target is operator.getitem:
            seq, i = args
            v = seq[i]
            if v is None:
                raise ctx.unsupported(f"output {i} of {node.args[0].name} is not imported")
            return v
        pk = _packet(target)
        hook = _lookup(self.mapping, target) or _lookup(_REGISTRY, target)
        if hook is None:
            folded = self.fold(node, pk, args, kwargs)
            if folded is not None:
                return folded
            hook = _lookup(_BUILTIN, target)
        if hook is None:
            if self.fallback == "replicate":
                return self.replicate(ctx)
            raise ProgramError(f"torch import: no mapping for aten op {ctx.target} (node {node.name}) at {ctx.where}; "
                               f"map it with register_aten({pk!r}, fn) or mapping={{{pk!r}: fn}}, or import with "
                               f"fallback='replicate'")
        if isinstance(hook, str):
            return _rule_hook(hook)(ctx)
        out = hook(ctx)
        return _wrap(out)

    def fold(self, node: Any, pk: str, args: Any, kwargs: Any) -> Any:
        """Evaluate a node at import time when no program tensor reaches it (or only its shape)."""
        if pk in _SHAPE_ONLY:
            def stand_in(v: Any) -> Any:
                if isinstance(v, Name):
                    t = self.b.get(v)
                    return torch.zeros(t.shape, dtype=_TORCH_DTYPES[t.dtype])
                if isinstance(v, (list, tuple)):
                    return type(v)(stand_in(x) for x in v)
                return v
            args, kwargs = stand_in(args), {k: stand_in(v) for k, v in kwargs.items()}
            if pk in ("aten.empty_like", "aten.new_empty"):  # uninitialised memory: zeros, reproducibly
                with torch.no_grad():
                    out = node.target(*args, **kwargs)
                return out.zero_() if isinstance(out, torch.Tensor) else out
        elif self._has_name(args) or self._has_name(kwargs):
            return None
        if not callable(node.target):
            return None
        with torch.no_grad():
            out = node.target(*args, **kwargs)
        return out

    def replicate(self, ctx: ImportContext) -> Any:
        ins: list[Name] = []

        def collect(v: Any) -> None:
            if isinstance(v, (Name, torch.Tensor)):
                ins.append(ctx.tensor(v))
            elif isinstance(v, (list, tuple)):
                for x in v:
                    collect(x)

        collect(ctx.args)
        collect(list(ctx.kwargs.values()))
        val = ctx.val()
        vals = list(val) if isinstance(val, (list, tuple)) else [val]
        outs: list[Any] = []
        for i, v in enumerate(vals):
            if isinstance(v, torch.Tensor):
                n = ctx.name if len(vals) == 1 else ctx.fresh(str(i))
                outs.append((n, tuple(int(s) for s in v.shape), _dtype_name(v.dtype)))
            else:
                outs.append(None)
        warnings.warn(f"torch import: no mapping for aten op {ctx.target} (node {ctx.name}) at {ctx.where}; it is "
                      f"imported as a `replicated` op (every input and output replicated)", stacklevel=5)
        start = self.b.op_count
        names = ctx.emit("replicated", {"ins": tuple(dict.fromkeys(ins)), "outs": (None,) * len(outs)}, outs)
        self.fallbacks[start] = (ctx.node.target, ctx.args, ctx.kwargs)
        res = [None if n is None else Name(n) for n in names]
        return tuple(res) if isinstance(val, (list, tuple)) else res[0]

    def recorded_values(self, prog: Program) -> dict[str, RecordedValue]:
        """The values of the constants and buffers (what the module recorded), for the simulator
        and ``spmdkit run`` (and a program file: ``values`` in its JSON)."""
        out: dict[str, RecordedValue] = {}
        for n, (kind, where) in self.sources.items():
            if n not in prog.tensors:
                continue
            if kind == "constant":
                v: Any = self.constants.get(n)
            elif kind == "buffer":
                v = self.ep.state_dict.get(where)
                if v is None:
                    v = self.ep.constants.get(where)
            else:
                continue
            if isinstance(v, torch.Tensor):
                out[n] = _recorded(v)
        return out

    def finish(self, loss: Any, optimizer: str | None) -> ImportedProgram:
        b = self.b
        loss_name: str | None = None
        grads: dict[str, str] = {}
        model = Model(ModelConfig(), Program([], []), {}, [], [], {})
        if self.tape is not None:
            loss_name = _pick_loss(self.out_names, b, loss)
            grads = self.tape.backward(loss_name)
            if optimizer:
                add_optimizer(b, model, grads, optimizer)
        prog = b.build(validate=False)
        ip = ImportedProgram(prog.tensors.values(), prog.ops, prog.name)
        ip.sources, ip.constants, ip.outputs = self.sources, self.constants, list(self.out_names)
        ip.loss, ip.grads, ip.optimizer = loss_name, grads, model.optimizer
        ip.origins, ip.fallbacks, ip.aliases = self.origins, self.fallbacks, dict(self.aliases)
        ip.input_paths = dict(self.input_paths)
        ip.modules = dict(self.modules)
        ip.values = self.recorded_values(ip)
        try:
            ip.validate()
        except ProgramError as exc:
            m = re.match(r"op (\d+) ", str(exc))
            origin = ip.origins.get(int(m.group(1))) if m else None
            raise ProgramError(f"{exc} [imported from {origin}]" if origin else str(exc)) from None
        return ip


def _recorded(t: torch.Tensor) -> RecordedValue:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: float32 holds it exactly
        t = t.float()
    return RecordedValue.of(t.contiguous().numpy())


def _float_out(b: ProgramBuilder, outputs: Sequence[Any]) -> bool:
    """Whether an op declared with ``outputs`` makes a floating-point tensor (a comparison or
    an index op does not: no gradient flows through it)."""
    for o in outputs:
        for spec in (o if isinstance(o, list) else [o]):
            if spec is None:
                continue
            if isinstance(spec, str):
                dt = b.get(spec).dtype if b.has(spec) else "float32"
            else:
                dt = spec[2] if len(spec) > 2 else "float32"
            if dt.startswith(("float", "bfloat")):
                return True
    return False


def _input_paths(ep: Any) -> list[Any]:
    """Per flattened user input of ``ep``: its key path in ``(args, kwargs)`` (None if unknown)."""
    from torch.utils import _pytree as pt

    spec = getattr(getattr(ep, "call_spec", None), "in_spec", None)
    if spec is None:
        return []
    n = spec.num_leaves
    paths: list[Any] = [None] * n
    for path, i in pt.tree_flatten_with_path(pt.tree_unflatten(list(range(n)), spec))[0]:
        if isinstance(i, int) and 0 <= i < n:
            paths[i] = tuple(path)
    return paths


def _last(node: Any) -> int | None:
    v = node.meta.get("val")
    return int(v.shape[-1]) if isinstance(v, torch.Tensor) and v.ndim else None


def _wrap(v: Any) -> Any:
    if isinstance(v, str) and not isinstance(v, Name):
        return Name(v)
    if isinstance(v, list):
        return [_wrap(x) for x in v]
    if isinstance(v, tuple):
        return tuple(_wrap(x) for x in v)
    return v


def _pick_loss(outs: Sequence[str], b: ProgramBuilder, loss: Any) -> str:
    if isinstance(loss, int) and not isinstance(loss, bool):
        if not -len(outs) <= loss < len(outs):
            raise ProgramError(f"torch import: loss={loss}: the module has {len(outs)} tensor outputs")
        return outs[loss]
    if isinstance(loss, str):
        if not b.has(loss):
            raise ProgramError(f"torch import: loss={loss!r} is not a tensor of the program")
        return loss
    scalars = [o for o in outs if b.get(o).shape == () and b.get(o).dtype.startswith(("float", "bfloat"))]
    if not scalars:
        raise ProgramError("torch import: training=True needs a loss: the module returns no scalar float tensor "
                           "(pass loss=INDEX, a tensor name, or a callable applied to the module's output)")
    return scalars[0]


def _rule_hook(rule: str) -> Hook:
    def hook(ctx: ImportContext) -> Any:
        r = get_rule(rule)
        tensors = [a for a in ctx.args if ctx.is_tensor(a)]
        params = [p for p in r.forward.params if p.is_tensor]
        return ctx.emit1(rule, {p.name: t for p, t in zip(params, tensors)})
    return hook


# -- built-in mappings ----------------------------------------------------------------------------


def _identity(c: ImportContext) -> Any:
    return c.args[0]


def _matmul(c: ImportContext) -> Any:
    return c.emit1("matmul", {"x": c.args[0], "y": c.args[1]})


def _linear(c: ImportContext) -> Any:
    x, w = c.args[0], c.args[1]
    bias = c.arg(2, "bias")
    if bias is None:
        return c.emit1("matmul", {"x": x, "y": w}, trans_y=True)
    mm = c.emit1("matmul", {"x": x, "y": w}, c.fresh("mm"), trans_y=True)
    return c.emit1("add", {"x": mm, "y": bias})


def _addmm(c: ImportContext) -> Any:
    bias, m1, m2 = c.args[:3]
    beta, alpha = c.kwargs.get("beta", 1), c.kwargs.get("alpha", 1)
    mm = c.emit1("matmul", {"x": m1, "y": m2}, c.fresh("mm"))
    if alpha != 1:
        mm = c.emit1("multiply", {"x": mm, "y": alpha}, c.fresh("alpha"))
    if beta != 1:
        bias = c.emit1("multiply", {"x": bias, "y": beta}, (c.fresh("beta"), c.shape(bias), c.dtype(bias)))
    return c.emit1("add", {"x": mm, "y": bias})


def _stat_dtype(dt: str) -> str:
    return "float64" if dt == "float64" else "float32"


def _layer_norm(c: ImportContext) -> Any:
    x, ns = c.args[0], c.args[1]
    w, bias = c.arg(2, "weight"), c.arg(3, "bias")
    eps = float(c.arg(4, "eps", 1e-5))
    xs = c.shape(x)
    bna = len(xs) - len(ns)
    sd = _stat_dtype(c.dtype(x))
    outs = [(c.name, xs, c.dtype(x)), (c.fresh("mean"), xs[:bna], sd), (c.fresh("var"), xs[:bna], sd)]
    o, _, _ = c.emit("layer_norm", {"x": x, "scale": w, "bias": bias}, outs, epsilon=eps, begin_norm_axis=bna)
    if c.target.startswith("aten.native_layer_norm"):
        return (Name(str(o)), None, None)
    return Name(str(o))


def _rms_norm(c: ImportContext) -> Any:
    x, ns = c.args[0], c.args[1]
    w = c.arg(2, "weight")
    eps = c.arg(3, "eps")
    xs = c.shape(x)
    if len(ns) != 1:
        raise c.unsupported(f"rms_norm over {len(ns)} trailing dims (fused_rms_norm normalises the last one)")
    if eps is None:
        eps = float(torch.finfo(_TORCH_DTYPES[c.dtype(x)]).eps)
    outs = [(c.name, xs, c.dtype(x)), (c.fresh("invvar"), xs[:-1], _stat_dtype(c.dtype(x)))]
    o, _ = c.emit("fused_rms_norm", {"x": x, "scale": w}, outs, epsilon=float(eps))
    return Name(str(o))


def _softmax_like(rule: str) -> Hook:
    def h(c: ImportContext) -> Any:
        x = c.args[0]
        dim = c.arg(1, "dim", -1)
        return c.emit1(rule, {"x": x}, axis=_norm_dim(int(dim), len(c.shape(x))))
    return h


def _embedding(c: ImportContext) -> Any:
    w, idx = c.args[0], c.args[1]
    pad = c.arg(2, "padding_idx", -1)
    ids = c.tensor(idx, "int64")
    return c.emit1("embedding", {"x": ids, "weight": w}, padding_idx=int(pad) if pad is not None else -1)


def _to_out_shape(rule: str) -> Hook:
    """A view (reshape) or expand to the node's output shape; the input itself where it has it."""

    def conv(c: ImportContext) -> Any:
        x = c.args[0]
        shp = c.out_shape()
        if tuple(c.shape(x)) == shp:
            return c.tensor(x)
        return c.emit1(rule, {"x": x}, shape=shp)

    return conv


_view = _to_out_shape("reshape")


def _permute(c: ImportContext) -> Any:
    x = c.args[0]
    nd = len(c.shape(x))
    perm = tuple(_norm_dim(int(d), nd) for d in c.args[1])
    if perm == tuple(range(nd)):
        return c.tensor(x)
    return c.emit1("transpose", {"x": x}, perm=perm)


def _transpose(c: ImportContext) -> Any:
    x = c.args[0]
    nd = len(c.shape(x))
    if c.target.startswith("aten.t."):
        if nd < 2:
            return c.tensor(x)
        d0, d1 = 0, 1
    else:
        d0, d1 = _norm_dim(int(c.args[1]), nd), _norm_dim(int(c.args[2]), nd)
    if d0 == d1:
        return c.tensor(x)
    perm = list(range(nd))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return c.emit1("transpose", {"x": x}, perm=tuple(perm))


_expand = _to_out_shape("expand")


def _unsqueeze(c: ImportContext) -> Any:
    x, d = c.args[0], int(c.args[1])
    return c.emit1("unsqueeze", {"x": x}, axis=(_norm_dim(d, len(c.shape(x)) + 1),))


def _squeeze(c: ImportContext) -> Any:
    x = c.args[0]
    xs = c.shape(x)
    dims = c.arg(1, "dim")
    if dims is None:
        axes = [i for i, s in enumerate(xs) if s == 1]
    else:
        dl = [dims] if isinstance(dims, int) else list(dims)
        axes = sorted({_norm_dim(int(d), len(xs)) for d in dl if xs[_norm_dim(int(d), len(xs))] == 1})
    if not axes:
        return c.tensor(x)
    return c.emit1("squeeze", {"x": x}, axis=tuple(axes))


def _select(c: ImportContext) -> Any:
    x, dim, i = c.args[0], int(c.args[1]), int(c.args[2])
    xs = c.shape(x)
    dim = _norm_dim(dim, len(xs))
    i = i + xs[dim] if i < 0 else i
    return c.emit1("slice", {"input": x}, axes=(dim,), starts=(i,), ends=(i + 1,), decrease_axis=(dim,))


def _slice(c: ImportContext) -> Any:
    x = c.args[0]
    xs = c.shape(x)
    dim = _norm_dim(int(c.arg(1, "dim", 0)), len(xs))
    start, end, step = c.arg(2, "start"), c.arg(3, "end"), c.arg(4, "step", 1)
    n = xs[dim]
    start = 0 if start is None else int(start)
    end = n if end is None else int(end)
    start = max(0, min(n, start + n if start < 0 else start))
    end = max(0, min(n, end + n if end < 0 else end))
    if int(step) != 1:
        return c.emit1("strided_slice", {"input": x}, axes=(dim,), starts=(start,), ends=(end,), strides=(int(step),))
    if start == 0 and end == n:
        return c.tensor(x)
    return c.emit1("slice", {"input": x}, axes=(dim,), starts=(start,), ends=(end,))


def _cat(c: ImportContext) -> Any:
    xs = [t for t in c.args[0]]
    nd = len(c.out_shape())
    dim = _norm_dim(int(c.arg(1, "dim", 0)), nd)
    xs = [t for t in xs if not (isinstance(t, torch.Tensor) and t.numel() == 0 and t.ndim == 1)]
    if len(xs) == 1:
        return c.tensor(xs[0])
    return c.emit1("concat", {"x": tuple(xs)}, axis=dim)


def _split(c: ImportContext) -> Any:
    x = c.args[0]
    vals = c.val()
    xs = c.shape(x)
    dim_arg = c.arg(2, "dim", 0)
    dim = _norm_dim(int(dim_arg), len(xs))
    sizes = [int(v.shape[dim]) for v in vals]
    if len(sizes) == 1:
        return (c.tensor(x),)
    outs = [[(c.fresh(str(i)), tuple(int(s) for s in v.shape), _dtype_name(v.dtype)) for i, v in enumerate(vals)]]
    (names,) = c.emit("split", {"x": x}, outs, sections=tuple(sizes), axis=dim)
    return tuple(Name(n) for n in names)  # type: ignore[union-attr]


def _binary(rule: str, negate: bool = False) -> Hook:
    """``rule(x, y)`` (``logical_not`` of it where ``negate``); a Python scalar operand becomes a
    0-d constant of the other operand's dtype; arithmetic on mixed dtypes casts to the result's."""

    def h(c: ImportContext) -> Any:
        x, y = c.args[0], c.args[1]
        alpha = c.kwargs.get("alpha", 1)
        if rule == "subtract" and c.target.startswith("aten.rsub"):
            x, y = y, x
        od = c.out_dtype()
        arith = od.startswith(("float", "bfloat")) and od != "bool"
        if alpha != 1:
            y = c.emit1("multiply", {"x": y, "y": alpha},
                        (c.fresh("alpha"), c.shape(y) if c.is_tensor(y) else (), c.out_dtype()))
        if rule == "divide" and not c.is_tensor(y):
            return c.emit1("multiply", {"x": x, "y": 1.0 / float(y)})
        other = x if c.is_tensor(x) else y
        cd = od if arith or not c.is_tensor(other) else c.dtype(other)
        ins = {}
        for k, v in (("x", x), ("y", y)):
            if arith and c.is_tensor(v) and c.dtype(v) != od:
                v = c.emit1("cast", {"x": v}, (c.fresh("cast"), c.shape(v), od), dtype=od)
            ins[k] = v if c.is_tensor(v) else c.tensor(v, cd)
        if negate:
            t = c.emit1(rule, ins, c.fresh("neg"))
            return c.emit1("logical_not", {"x": t})
        if ins["x"] == ins["y"] and rule in ("multiply", "add"):  # x * x, x + x: one read of x
            if rule == "multiply":
                return c.emit1("square", {"x": ins["x"]})
            return c.emit1("multiply", {"x": ins["x"], "y": c.tensor(2.0, od)})
        return c.emit1(rule, ins)
    return h


def _neg(c: ImportContext) -> Any:
    return c.emit1("multiply", {"x": c.args[0], "y": -1.0})


def _unary(rule: str) -> Hook:
    def h(c: ImportContext) -> Any:
        return c.emit1(rule, {"x": c.args[0]})
    return h


def _gelu(c: ImportContext) -> Any:
    approx = c.kwargs.get("approximate", c.args[1] if len(c.args) > 1 else "none")
    return c.emit1("gelu", {"x": c.args[0]}, approximate=approx == "tanh")


def _pow(c: ImportContext) -> Any:
    x, e = c.args[0], c.args[1]
    if c.is_tensor(e) or not c.is_tensor(x):
        return c.emit1("elementwise_pow", {"x": x, "y": e})
    e = float(e)
    if e == 1.0:
        return c.tensor(x)
    named = {2.0: "square", 0.5: "sqrt", -0.5: "rsqrt", -1.0: "reciprocal"}
    if e in named:
        return c.emit1(named[e], {"x": x})
    return c.emit1("elementwise_pow", {"x": x, "y": e})


def _reduce(rule: str) -> Hook:
    def h(c: ImportContext) -> Any:
        x = c.args[0]
        nd = len(c.shape(x))
        dims = c.arg(1, "dim")
        keep = bool(c.arg(2, "keepdim", False))
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            axis: tuple[int, ...] = ()
        else:
            dl = [dims] if isinstance(dims, int) else list(dims)
            axis = tuple(sorted({_norm_dim(int(d), nd) for d in dl}))
        if axis and len(axis) == nd and not keep:
            axis = ()
        return c.emit1(rule, {"x": x}, axis=axis, keep_dim=keep)
    return h


def _cast(c: ImportContext) -> Any:
    x = c.args[0]
    od = c.out_dtype()
    if not c.is_tensor(x) or c.dtype(x) == od:
        return x if not isinstance(x, torch.Tensor) else c.tensor(x)
    return c.emit1("cast", {"x": x}, dtype=od)


def _dropout(c: ImportContext) -> Any:
    p = float(c.arg(1, "p", 0.5))
    train = c.arg(2, "train", True)
    if p == 0.0 or not train:
        return c.args[0]
    raise c.unsupported("dropout in training mode (export the module in eval mode, or p=0)")


def _where_op(c: ImportContext) -> Any:
    cond, x, y = c.args[:3]
    od = c.out_dtype()
    return c.emit1("where", {"condition": c.tensor(cond, "bool"), "x": c.tensor(x, od), "y": c.tensor(y, od)})


def _masked_fill(c: ImportContext) -> Any:
    x, mask, value = c.args[:3]
    od = c.out_dtype()
    if isinstance(value, torch.Tensor):
        value = value.item()
    return c.emit1("where", {"condition": c.tensor(mask, "bool"), "x": c.tensor(value, od), "y": x})


def _gather(c: ImportContext) -> Any:
    x, dim, index = c.args[:3]
    nd = len(c.shape(x))
    return c.emit1("take_along_axis", {"x": x, "index": c.tensor(index, "int64")}, axis=_norm_dim(int(dim), nd))


def _stack(c: ImportContext) -> Any:
    xs = list(c.args[0])
    dim = _norm_dim(int(c.arg(1, "dim", 0)), len(c.out_shape()))
    return c.emit1("stack", {"x": tuple(xs)}, axis=dim)


def _unbind(c: ImportContext) -> Any:
    x = c.args[0]
    xs = c.shape(x)
    dim = _norm_dim(int(c.arg(1, "dim", 0)), len(xs))
    outs = [[(c.fresh(str(i)), tuple(int(s) for s in v.shape), _dtype_name(v.dtype)) for i, v in enumerate(c.val())]]
    (names,) = c.emit("unbind", {"x": x}, outs, axis=dim)
    return tuple(Name(n) for n in names)  # type: ignore[union-attr]


def _tril_triu(c: ImportContext) -> Any:
    x = c.args[0]
    diag = int(c.arg(1, "diagonal", 0))
    return c.emit1("tril_triu", {"x": x}, diagonal=diag, lower=c.target.startswith("aten.tril"))


def _argmax(c: ImportContext) -> Any:
    x = c.args[0]
    dim = c.arg(1, "dim")
    keep = bool(c.arg(2, "keepdim", False))
    if dim is None:
        return c.emit1("argmax", {"x": x}, axis=-1, keepdims=keep, flatten=True)
    return c.emit1("argmax", {"x": x}, axis=_norm_dim(int(dim), len(c.shape(x))), keepdims=keep)


def _cumsum(c: ImportContext) -> Any:
    x = c.args[0]
    return c.emit1("cumsum", {"x": x}, axis=_norm_dim(int(c.arg(1, "dim", -1)), len(c.shape(x))))


def _pad(c: ImportContext) -> Any:
    """``pad`` / ``constant_pad_nd`` (constant mode): torch's pairs run from the last dim back;
    Paddle's ``paddings`` are (before, after) per dim in order. Negative pads crop (a slice
    first); a fill that is not an integer (-inf, 0.5) pads zeros and adds a constant that holds
    the fill where the padding is."""
    x, pads = c.args[0], [int(p) for p in c.arg(1, "pad")]
    mode = c.arg(2, "mode", "constant") if c.target.startswith("aten.pad") else "constant"
    value = c.arg(3, "value") if c.target.startswith("aten.pad") else c.arg(2, "value", 0)
    if mode != "constant":
        raise c.unsupported(f"pad mode {mode!r} (constant only)")
    value = 0.0 if value is None else float(value)
    xs = c.shape(x)
    nd = len(xs)
    per = [(0, 0)] * nd
    for i in range(len(pads) // 2):
        per[nd - 1 - i] = (pads[2 * i], pads[2 * i + 1])
    if any(lo < 0 or hi < 0 for lo, hi in per):  # crop first
        for d, (lo, hi) in enumerate(per):
            if lo < 0 or hi < 0:
                cur = c.shape(x)
                start, end = max(0, -lo), cur[d] - max(0, -hi)
                shp = (*cur[:d], end - start, *cur[d + 1:])
                x = c.emit1("slice", {"input": x}, (c.fresh("crop"), shp, c.dtype(x)), axes=(d,), starts=(start,),
                            ends=(end,))
        per = [(max(lo, 0), max(hi, 0)) for lo, hi in per]
    if all(lo == 0 and hi == 0 for lo, hi in per):
        return c.tensor(x)
    flat = tuple(v for lohi in per for v in lohi)
    if value.is_integer():
        return c.emit1("pad", {"x": x}, paddings=flat, pad_value=int(value))
    padded = c.emit1("pad", {"x": x}, c.fresh("zero_padded"), paddings=flat, pad_value=0)
    fill = torch.full(c.out_shape(), value, dtype=_TORCH_DTYPES[c.out_dtype()])
    fill[tuple(slice(lo, lo + s) for (lo, _), s in zip(per, c.shape(x)))] = 0
    return c.emit1("add", {"x": padded, "y": fill})


def _broadcast_shape(shapes: Sequence[Sequence[int]]) -> list[int]:
    n = max(len(s) for s in shapes)
    out = [1] * n
    for s in shapes:
        for i, d in enumerate(s):
            j = n - len(s) + i
            if d != 1:
                out[j] = d
    return out


def _arith_axis(t: torch.Tensor, bshape: Sequence[int]) -> tuple[int, int] | None:
    """Where a constant index tensor, broadcast to ``bshape``, is ``start + arange(n)`` along one
    axis (and constant along the others): (that axis, start); None otherwise. An axis the
    tensor itself spans is preferred (a size-1 axis matches any constant)."""
    tb = t.expand(*bshape)
    if tb.numel() == 0:
        return None
    start = int(tb.reshape(-1)[0])
    own = [a for a in range(len(bshape)) if a - (len(bshape) - t.ndim) >= 0
           and t.shape[a - (len(bshape) - t.ndim)] == bshape[a]]
    for a in sorted(range(len(bshape)), key=lambda a: (a not in own, bshape[a] == 1)):
        shp = [1] * len(bshape)
        shp[a] = bshape[a]
        want = torch.arange(start, start + bshape[a], dtype=tb.dtype).view(shp).expand(*bshape)
        if torch.equal(tb, want):
            return a, start
    return None


def _index(c: ImportContext) -> Any:
    """``x[i0, i1, ...]`` (advanced indexing; None = a full dim). Constant indices that are
    ranges along the broadcast axes (the HF mask builders) are views: a slice, a transpose and a
    reshape (expand where broadcast); one index tensor is ``index_select`` on its dim (reshaped);
    several are ``gather_nd`` over the indexed dims moved to the front."""
    x = c.args[0]
    idx = list(c.args[1])
    xs = c.shape(x)
    nd = len(xs)
    idx += [None] * (nd - len(idx))
    dims = [d for d, t in enumerate(idx) if t is not None]
    for d in dims:
        t = idx[d]
        dt = c.dtype(t)
        if dt == "bool":
            raise c.unsupported("a boolean mask index (a data-dependent shape)")
        if isinstance(t, torch.Tensor):
            idx[d] = torch.where(t < 0, t + xs[d], t)  # negative indices count from the end
    adjacent = dims == list(range(dims[0], dims[-1] + 1))
    bshape = _broadcast_shape([c.shape(idx[d]) for d in dims])
    out = c.out_shape()
    rest = [d for d in range(nd) if d not in dims]
    pre = [d for d in rest if d < dims[0]] if adjacent else []
    post = [d for d in rest if d not in pre]
    if all(isinstance(idx[d], torch.Tensor) for d in dims):
        found = [_arith_axis(idx[d], bshape) for d in dims]
        axes = [f[0] for f in found if f is not None]
        if all(f is not None for f in found) and len(set(axes)) == len(axes):
            cur: Any = x
            for d, f in zip(dims, found):  # the ranges as slices
                assert f is not None
                a, start = f
                if start != 0 or bshape[a] != xs[d]:
                    shp = list(c.shape(cur))
                    shp[d] = bshape[a]
                    cur = c.emit1("slice", {"input": cur}, (c.fresh("range"), shp, c.dtype(cur)), axes=(d,),
                                  starts=(start,), ends=(start + bshape[a],))
            by_axis = {f[0]: d for d, f in zip(dims, found) if f is not None}
            order = pre + [by_axis[a] for a in sorted(by_axis)] + post
            if order != list(range(nd)):
                cur = c.transpose(cur, order, c.fresh("t"))
            cs = c.shape(cur)
            mid = [cs[len(pre) + sorted(by_axis).index(a)] if a in by_axis else 1 for a in range(len(bshape))]
            shp = [cs[i] for i in range(len(pre))] + mid + [cs[i] for i in range(len(pre) + len(by_axis), nd)]
            cur = c.reshape(cur, shp, c.fresh("r")) if tuple(shp) != tuple(out) else c.reshape(cur, shp)
            if tuple(c.shape(cur)) != tuple(out):
                cur = c.emit1("expand", {"x": cur}, shape=tuple(out))
            return cur
    if len(dims) == 1:
        d = dims[0]
        t = idx[d]
        ts = c.shape(t)
        flat_i = c.reshape(c.tensor(t, "int64"), (math.prod(ts),), c.fresh("flat_index")) if len(ts) != 1 \
            else c.tensor(t, "int64")
        sel_shape = (*xs[:d], math.prod(ts), *xs[d + 1:])
        sel = c.emit1("index_select", {"x": x, "index": flat_i},
                      c.name if tuple(sel_shape) == tuple(out) else (c.fresh("selected"), sel_shape, c.dtype(x)),
                      axis=d)
        return c.reshape(sel, out) if tuple(sel_shape) != tuple(out) else sel
    # gather_nd: indexed dims first, the index [*bshape, k]
    cur = x if dims == list(range(len(dims))) else c.transpose(x, dims + rest, c.fresh("t"))
    parts = []
    for d in dims:
        t = c.tensor(idx[d], "int64")
        if c.dtype(t) != "int64":
            t = c.emit1("cast", {"x": t}, (c.fresh("i64"), c.shape(t), "int64"), dtype="int64")
        ts = c.shape(t)
        if tuple(ts) != tuple(bshape):
            if len(ts) < len(bshape):
                t = c.reshape(t, [1] * (len(bshape) - len(ts)) + list(ts), c.fresh("r"))
            t = c.emit1("expand", {"x": t}, (c.fresh("bcast"), tuple(bshape), "int64"), shape=tuple(bshape))
        parts.append(t)
    nd_index = c.emit1("stack", {"x": tuple(parts)}, (c.fresh("nd_index"), (*bshape, len(dims)), "int64"),
                       axis=len(bshape))
    got_shape = (*bshape, *[xs[d] for d in rest])
    g = c.emit1("gather_nd", {"x": cur, "index": nd_index},
                c.name if tuple(got_shape) == tuple(out) else (c.fresh("gathered"), got_shape, c.dtype(x)))
    if tuple(got_shape) == tuple(out):
        return g
    # adjacent indexed dims after leading dims: move the broadcast block back in place
    nb = len(bshape)
    perm = list(range(nb, nb + len(pre))) + list(range(nb)) + list(range(nb + len(pre), len(got_shape)))
    return c.transpose(g, perm, c.name)


def _broadcast_to(c: ImportContext, v: Any, shape: Sequence[int], dtype: str, name: str | None = None) -> Any:
    """``v`` (a tensor name, a torch constant or a Python scalar) as ``shape`` and ``dtype``:
    constants are made at import time; a program tensor is cast, reshaped and expanded."""
    if not isinstance(v, Name):
        t = v.to(_TORCH_DTYPES[dtype]) if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=_TORCH_DTYPES[dtype])
        return c.tensor(t.expand(*shape).clone())
    if c.dtype(v) != dtype:
        v = c.emit1("cast", {"x": v}, (c.fresh("cast"), c.shape(v), dtype), dtype=dtype)
    vs = c.shape(v)
    if tuple(vs) == tuple(shape):
        return c.tensor(v) if name is None else c.reshape(v, shape, name)
    if len(vs) < len(shape):
        v = c.reshape(v, [1] * (len(shape) - len(vs)) + list(vs), c.fresh("r"))
    return c.emit1("expand", {"x": v}, (name or c.fresh("bcast"), tuple(shape), dtype), shape=tuple(shape))


def _copy(c: ImportContext) -> Any:
    """Functional ``copy(self, src)``: src broadcast to self's shape in self's dtype."""
    return _broadcast_to(c, c.args[1], c.out_shape(), c.out_dtype(), c.name)


def _fill(c: ImportContext) -> Any:
    """``fill(self, value)``: self's shape and dtype, every element value."""
    return _broadcast_to(c, c.args[1], c.out_shape(), c.out_dtype(), c.name)


def _piece(c: ImportContext, x: Any, d: int, start: int, end: int) -> Any:
    xs = c.shape(x)
    if isinstance(x, torch.Tensor):
        return c.tensor(x.narrow(d, start, end - start).clone())
    shp = (*xs[:d], end - start, *xs[d + 1:])
    return c.emit1("slice", {"input": x}, (c.fresh("keep"), shp, c.dtype(x)), axes=(d,), starts=(start,),
                   ends=(end,))


def _scatter_into(c: ImportContext, x: Any, src: Any, d: int, start: int, end: int) -> Any:
    """x with ``x[..., start:end, ...]`` (along d) replaced by src: a concat of the kept pieces."""
    xs = c.shape(x)
    dt = c.out_dtype()
    src = _broadcast_to(c, src, (*xs[:d], end - start, *xs[d + 1:]), dt)
    if not isinstance(x, Name) and c.dtype(x) != dt:
        x = x.to(_TORCH_DTYPES[dt])
    parts = []
    if start > 0:
        parts.append(_piece(c, x, d, 0, start))
    parts.append(src)
    if end < xs[d]:
        parts.append(_piece(c, x, d, end, xs[d]))
    if len(parts) == 1:
        return c.tensor(parts[0])
    return c.emit1("concat", {"x": tuple(parts)}, axis=d)


def _slice_scatter(c: ImportContext) -> Any:
    x, src = c.args[0], c.args[1]
    xs = c.shape(x)
    d = _norm_dim(int(c.arg(2, "dim", 0)), len(xs))
    start, end, step = c.arg(3, "start"), c.arg(4, "end"), int(c.arg(5, "step", 1))
    n = xs[d]
    start = 0 if start is None else int(start)
    end = n if end is None else int(end)
    start = max(0, min(n, start + n if start < 0 else start))
    end = max(0, min(n, end + n if end < 0 else end))
    if step != 1:
        raise c.unsupported(f"slice_scatter with step {step} (step 1 only)")
    return _scatter_into(c, x, src, d, start, end)


def _select_scatter(c: ImportContext) -> Any:
    x, src = c.args[0], c.args[1]
    xs = c.shape(x)
    d = _norm_dim(int(c.args[2]), len(xs))
    i = int(c.args[3])
    i = i + xs[d] if i < 0 else i
    if isinstance(src, Name):
        ss = c.shape(src)
        src = c.emit1("unsqueeze", {"x": src}, (c.fresh("u"), (*ss[:d], 1, *ss[d:]), c.dtype(src)), axis=(d,))
    elif isinstance(src, torch.Tensor):
        src = src.unsqueeze(d)
    return _scatter_into(c, x, src, d, i, i + 1)


def _topk(c: ImportContext) -> Any:
    x = c.args[0]
    k = int(c.args[1])
    xs = c.shape(x)
    dim = _norm_dim(int(c.arg(2, "dim", -1)), len(xs))
    largest, srt = bool(c.arg(3, "largest", True)), bool(c.arg(4, "sorted", True))
    vals, idx = c.val()
    outs = [(c.fresh("values"), tuple(vals.shape), c.dtype(x)), (c.fresh("indices"), tuple(idx.shape), "int64")]
    if c.imp.tape is None or x not in c.imp.tape.needs_grad:
        v, i = c.emit("topk", {"x": x}, outs, k=k, axis=dim, largest=largest, sorted=srt)
        return (Name(str(v)), Name(str(i)))
    # training: the indices from topk, the values gathered at them (the gradient flows to the
    # chosen entries, as torch's topk backward scatters it)
    _, i = c.emit_nograd("topk", {"x": x}, outs, k=k, axis=dim, largest=largest, sorted=srt)
    v = c.emit1("take_along_axis", {"x": x, "index": i}, (c.fresh("chosen"), tuple(vals.shape), c.dtype(x)), axis=dim)
    return (v, Name(str(i)))


def _sort(c: ImportContext) -> Any:
    """``sort`` / ``argsort`` -> ``argsort`` (sorted values and indices), stable: ties keep their
    order (torch's unstable sort may order ties otherwise; every HF use, MoE routing, undoes
    the permutation it makes, so the result does not depend on the order of ties)."""
    x = c.args[0]
    xs = c.shape(x)
    if c.target.startswith("aten.sort.stable"):
        dim, desc = c.kwargs.get("dim", -1), c.kwargs.get("descending", False)
    else:
        dim, desc = c.arg(1, "dim", -1), c.arg(2, "descending", False)
    dim = _norm_dim(int(dim), len(xs))
    outs = [(c.fresh("sorted"), xs, c.dtype(x)), (c.fresh("indices"), xs, "int64")]
    if c.imp.tape is None or x not in c.imp.tape.needs_grad:
        v, i = c.emit("argsort", {"x": x}, outs, axis=dim, descending=bool(desc), stable=True)
        return Name(str(i)) if c.target.startswith("aten.argsort") else (Name(str(v)), Name(str(i)))
    # training: the permutation from argsort, the sorted values gathered by it (differentiable)
    _, i = c.emit_nograd("argsort", {"x": x}, outs, axis=dim, descending=bool(desc), stable=True)
    if c.target.startswith("aten.argsort"):
        return Name(str(i))
    v = c.emit1("take_along_axis", {"x": x, "index": i}, (c.fresh("sorted_values"), xs, c.dtype(x)), axis=dim)
    return (v, Name(str(i)))


def _histc(c: ImportContext) -> Any:
    """``histc`` of integer values (a cast of an integer tensor, as HF's MoE counts tokens per
    expert) with one bin per integer of [min, max]: the sum over ``one_hot(x - min, bins)``."""
    bins, lo, hi = int(c.arg(1, "bins", 100)), c.arg(2, "min", 0), c.arg(3, "max", 0)
    src = c.node.args[0]
    ints = None
    if getattr(src, "op", None) == "call_function" and _packet(src.target) in ("aten.to", "aten._to_copy"):
        v = src.args[0].meta.get("val") if hasattr(src.args[0], "meta") else None
        if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dtype != torch.bool:
            ints = c.imp.env[src.args[0]]
    if ints is None or float(lo) != int(lo) or float(hi) != int(hi) or bins != int(hi) - int(lo) + 1:
        raise c.unsupported("histc other than one bin per integer value of an integer tensor cast to float")
    ids = c.tensor(ints)
    if c.dtype(ids) != "int64":
        ids = c.emit1("cast", {"x": ids}, (c.fresh("ids"), c.shape(ids), "int64"), dtype="int64")
    if int(lo):
        ids = c.emit1("subtract", {"x": ids, "y": c.tensor(int(lo), "int64")}, (c.fresh("shift"), c.shape(ids), "int64"))
    flat = c.reshape(ids, (math.prod(c.shape(ids)),), c.fresh("flat"))
    n = c.shape(flat)[0]
    oh = c.emit1("one_hot", {"x": flat}, (c.fresh("one_hot"), (n, bins), "float32"), num_classes=bins)
    counts = c.emit1("sum", {"x": oh}, (c.fresh("counts"), (bins,), "float32"), axis=(0,), keep_dim=False)
    if c.out_dtype() == "float32":
        return c.reshape(counts, (bins,), c.name)
    return c.emit1("cast", {"x": counts}, dtype=c.out_dtype())


def _grouped_mm(c: ImportContext) -> Any:
    """A grouped matmul over rows sorted by group: ``out[r] = x[r] @ w[g]`` for the rows r in
    ``[offs[g-1], offs[g])`` (zeros past ``offs[-1]``), HF's ``grouped_mm_fallback`` /
    ``aten._grouped_mm`` (2-D x, 3-D w). As registered rules: every group's matmul on every
    row (``[1, N, H] @ [E, H, O]``, the expert axis shardable), multiplied by the 0/1 mask of
    the rows each group owns (built from ``offs``) and summed over the groups: the same values
    (each row is its group's product plus exact zeros), and differentiable."""
    x, w, offs = c.args[0], c.args[1], c.arg(2, "offs")
    xs, ws = c.shape(x), c.shape(w)
    if len(xs) != 2 or len(ws) != 3 or offs is None:
        raise c.unsupported("a grouped matmul other than 2-D input, 3-D weight and offsets")
    if c.arg(3, "bias") is not None:
        raise c.unsupported("a grouped matmul bias")
    n, e, o = xs[0], ws[0], ws[2]
    dt = c.out_dtype()
    ends = c.tensor(offs)
    if c.dtype(ends) != "int64":
        ends = c.emit1("cast", {"x": ends}, (c.fresh("ends"), (e,), "int64"), dtype="int64")
    if e > 1:
        head = c.emit1("slice", {"input": ends}, (c.fresh("prev"), (e - 1,), "int64"), axes=(0,), starts=(0,),
                       ends=(e - 1,))
        starts: Any = c.emit1("concat", {"x": (c.tensor(torch.zeros(1, dtype=torch.int64)), head)},
                              (c.fresh("starts"), (e,), "int64"), axis=0)
    else:
        starts = c.tensor(torch.zeros(1, dtype=torch.int64))
    rows = c.tensor(torch.arange(n, dtype=torch.int64).view(1, n))
    s2 = c.reshape(starts, (e, 1), c.fresh("starts_col"))
    e2 = c.reshape(ends, (e, 1), c.fresh("ends_col"))
    before = c.emit1("less_than", {"x": rows, "y": s2}, (c.fresh("before"), (e, n), "bool"))
    after = c.emit1("logical_not", {"x": before}, (c.fresh("from_start"), (e, n), "bool"))
    upto = c.emit1("less_than", {"x": rows, "y": e2}, (c.fresh("to_end"), (e, n), "bool"))
    own = c.emit1("logical_and", {"x": after, "y": upto}, (c.fresh("owns"), (e, n), "bool"))
    maskf = c.emit1("cast", {"x": own}, (c.fresh("owns_f"), (e, n), dt), dtype=dt)
    mask3 = c.reshape(maskf, (e, n, 1), c.fresh("owns_col"))
    xb = c.emit1("unsqueeze", {"x": x}, (c.fresh("rows"), (1, n, xs[1]), c.dtype(x)), axis=(0,))
    if c.dtype(w) != c.dtype(x):
        w = c.emit1("cast", {"x": w}, (c.fresh("w"), ws, c.dtype(x)), dtype=c.dtype(x))
    allg = c.emit1("matmul", {"x": xb, "y": w}, (c.fresh("every_group"), (e, n, o), dt))
    mine = c.emit1("multiply", {"x": allg, "y": mask3}, (c.fresh("own_group"), (e, n, o), dt))
    return c.emit1("sum", {"x": mine}, axis=(0,), keep_dim=False)


def _index_put(c: ImportContext) -> Any:
    x, indices, value = c.args[0], list(c.args[1]), c.args[2]
    acc = bool(c.arg(3, "accumulate", False))
    if any(i is None for i in indices):
        raise c.unsupported("index_put with a None (full-dim) index")
    idx = []
    for t in indices:
        t = c.tensor(t, "int64")
        if c.dtype(t) == "bool":
            raise c.unsupported("index_put with a boolean mask index")
        if c.dtype(t) != "int64":
            t = c.emit1("cast", {"x": t}, (c.fresh("i64"), c.shape(t), "int64"), dtype="int64")
        idx.append(t)
    return c.emit1("index_put", {"x": c.tensor(x), "indices": tuple(idx), "value": c.tensor(value, c.out_dtype())},
                   accumulate=acc)


def _clamp(c: ImportContext) -> Any:
    """``clamp`` / ``clip`` / ``clamp_min`` / ``clamp_max``: ``where(x < lo, lo, x)`` then
    ``where(x > hi, hi, .)``: the gradient reaches x where lo <= x <= hi, as torch's does
    (``maximum`` / ``minimum`` would give it to the bound at a tie); NaN passes through."""
    x = c.args[0]
    if c.target.startswith("aten.clamp_min"):
        lo, hi = c.args[1], None
    elif c.target.startswith("aten.clamp_max"):
        lo, hi = None, c.args[1]
    else:
        lo, hi = c.arg(1, "min"), c.arg(2, "max")
    xs, od = c.shape(x), c.out_dtype()
    cur: Any = x
    for bound, rule, tag in ((lo, "less_than", "lo"), (hi, "greater_than", "hi")):
        if bound is None:
            continue
        b = c.tensor(bound, od)
        out_of = c.emit1(rule, {"x": cur, "y": b}, (c.fresh(f"below_{tag}" if tag == "lo" else f"above_{tag}"),
                                                    xs, "bool"))
        last = tag == "hi" or hi is None
        cur = c.emit1("where", {"condition": out_of, "x": b, "y": cur}, None if last else (c.fresh("clamped"), xs, od))
    return cur if cur is not x else c.tensor(x)


def _isinf(c: ImportContext) -> Any:
    """``isinf(x)``: not (x != inf and x != -inf); ``isnan``: ``x != x``."""
    x = c.args[0]
    xs = c.shape(x)
    if c.target.startswith("aten.isnan"):
        return c.emit1("not_equal", {"x": x, "y": x})
    pos = c.emit1("not_equal", {"x": x, "y": c.tensor(float("inf"), c.dtype(x))}, (c.fresh("not_pos_inf"), xs, "bool"))
    neg = c.emit1("not_equal", {"x": x, "y": c.tensor(float("-inf"), c.dtype(x))}, (c.fresh("not_neg_inf"), xs, "bool"))
    fin = c.emit1("logical_and", {"x": pos, "y": neg}, (c.fresh("not_inf"), xs, "bool"))
    return c.emit1("logical_not", {"x": fin})


def _pair(v: Any, n: int = 2) -> tuple[int, ...]:
    if isinstance(v, int):
        return (v,) * n
    t = tuple(int(x) for x in v)
    return t * n if len(t) == 1 else t


def _conv2d(c: ImportContext) -> Any:
    """``conv2d`` / ``convolution`` (2-D, not transposed). Stride 1, no padding, dilation 1,
    groups 1: the ``conv2d`` rule (Paddle's Conv2dInferSpmdBase takes no geometry attributes,
    so its program op cannot carry any). Any other geometry: ``conv3d`` over a unit depth axis
    (input and filter unsqueezed at axis 2, the output squeezed), whose rule carries strides,
    paddings, dilations and groups; the same arithmetic, and the same shardings (batch; the
    channels only with groups 1). A bias is added as ``[C_out, 1, 1]``."""
    x, w, bias = c.args[0], c.args[1], c.arg(2, "bias")
    conv = c.target.startswith("aten.convolution")
    if conv and bool(c.arg(6, "transposed", False)):
        raise c.unsupported("a transposed convolution")
    stride = _pair(c.arg(3, "stride", 1))
    padding: Any = c.arg(4, "padding", 0)
    dilation = _pair(c.arg(5, "dilation", 1))
    groups = int(c.arg(8 if conv else 6, "groups", 1))
    xs, ws = c.shape(x), c.shape(w)
    if len(xs) != 4 or len(ws) != 4:
        raise c.unsupported(f"a {len(ws) - 2}-D convolution (2-D with a batch axis only)")
    out = c.out_shape()
    if isinstance(padding, str):  # 'valid' / 'same' (stride 1): the explicit pads torch uses
        if padding == "valid":
            pads: tuple[int, ...] = (0, 0, 0, 0)
        else:
            tot = [d * (k - 1) for d, k in zip(dilation, ws[2:])]
            pads = (tot[0] // 2, tot[0] - tot[0] // 2, tot[1] // 2, tot[1] - tot[1] // 2)
    else:
        p2 = _pair(padding)
        pads = (p2[0], p2[0], p2[1], p2[1])
    dt = c.dtype(x)
    has_bias = bias is not None
    res_name = c.fresh("conv") if has_bias else c.name
    res_shape = (out[0], out[1], out[2], out[3])
    if stride == (1, 1) and not any(pads) and dilation == (1, 1) and groups == 1:
        y = c.emit1("conv2d", {"input": x, "filter": w}, (res_name, res_shape, dt))
    else:
        x5 = c.emit1("unsqueeze", {"x": x}, (c.fresh("input3d"), (xs[0], xs[1], 1, xs[2], xs[3]), dt), axis=(2,))
        w5 = c.emit1("unsqueeze", {"x": w}, (c.fresh("filter3d"), (ws[0], ws[1], 1, ws[2], ws[3]), c.dtype(w)),
                     axis=(2,))
        y5 = c.emit1("conv3d", {"input": x5, "filter": w5}, (c.fresh("conv3d"), (out[0], out[1], 1, out[2], out[3]), dt),
                     strides=(1, *stride), paddings=(0, 0, *pads), dilations=(1, *dilation), groups=groups,
                     padding_algorithm="EXPLICIT", data_format="NCDHW")
        y = c.emit1("squeeze", {"x": y5}, (res_name, res_shape, dt), axis=(2,))
    if not has_bias:
        return y
    b3 = c.reshape(bias, (c.shape(bias)[0], 1, 1), c.fresh("bias"))
    return c.emit1("add", {"x": y, "y": b3})


def _sdpa(c: ImportContext) -> Any:
    q, k, v = c.args[:3]
    mask = c.arg(3, "attn_mask")
    dropout = float(c.arg(4, "dropout_p", 0.0))
    causal = bool(c.arg(5, "is_causal", False))
    scale = c.kwargs.get("scale", c.args[6] if len(c.args) > 6 else None)
    if dropout:
        raise c.unsupported("attention dropout (export in eval mode or with dropout_p=0)")
    qs, ks = c.shape(q), c.shape(k)
    if len(qs) != 4 or len(ks) != 4:
        raise c.unsupported(f"attention on {len(qs)}-D q (4-D [batch, heads, seq, head_dim] only)")
    b_, hq, s, d = qs
    hk = ks[1]
    dt = c.dtype(q)
    default_scale = scale is None or math.isclose(float(scale), 1.0 / math.sqrt(d), rel_tol=1e-12)
    if mask is None and default_scale and hq % hk == 0:
        perm = (0, 2, 1, 3)
        qt, kt, vt = (c.transpose(t, perm, c.fresh(n)) for t, n in ((q, "q"), (k, "k"), (v, "v")))
        vs = c.shape(vt)
        outs = [(c.fresh("bshd"), (b_, s, hq, vs[3]), dt), None, (c.fresh("lse"), (b_, hq, s), "float32"),
                (c.fresh("seed_offset"), (2,), "int64")]
        o, _, _, _ = c.emit("flash_attention", {"q": qt, "k": kt, "v": vt}, outs, causal=causal)
        return c.transpose(o, perm, c.name)
    # spelt out: softmax(q k^T * scale + mask) v
    if hk != hq:
        g = hq // hk

        def rep(t: Any, n: str) -> Name:
            ts = c.shape(t)
            u = c.emit1("unsqueeze", {"x": t}, (c.fresh(n + "u"), (ts[0], ts[1], 1, ts[2], ts[3]), dt), axis=(2,))
            e = c.emit1("expand", {"x": u}, (c.fresh(n + "e"), (ts[0], ts[1], g, ts[2], ts[3]), dt),
                        shape=(ts[0], ts[1], g, ts[2], ts[3]))
            return c.reshape(e, (ts[0], hq, ts[2], ts[3]), c.fresh(n + "rep"))
        k, v = rep(k, "k"), rep(v, "v")
    t_ = c.shape(k)[2]
    sc = c.emit1("matmul", {"x": q, "y": k}, (c.fresh("scores"), (b_, hq, s, t_), dt), trans_y=True)
    sc = c.emit1("multiply", {"x": sc, "y": float(scale) if scale is not None else 1.0 / math.sqrt(d)},
                 (c.fresh("scaled"), (b_, hq, s, t_), dt))
    add: Any = None
    if causal:
        add = torch.zeros(s, t_, dtype=_TORCH_DTYPES[dt]).masked_fill(
            ~torch.ones(s, t_, dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        if isinstance(mask, torch.Tensor):
            m = mask if mask.dtype != torch.bool else torch.zeros(mask.shape, dtype=_TORCH_DTYPES[dt]).masked_fill(
                ~mask, float("-inf"))
            add = m if add is None else add + m
        elif c.dtype(mask) == "bool":  # True = attend: where(mask, scores, -inf)
            if add is not None:
                sc = c.emit1("add", {"x": sc, "y": add}, (c.fresh("causal"), (b_, hq, s, t_), dt))
                add = None
            sc = c.emit1("where", {"condition": mask, "x": sc, "y": c.tensor(float("-inf"), dt)},
                         (c.fresh("masked"), (b_, hq, s, t_), dt))
        else:
            if add is not None:
                sc = c.emit1("add", {"x": sc, "y": add}, (c.fresh("causal"), (b_, hq, s, t_), dt))
                add = None
            add = mask
    if add is not None:
        sc = c.emit1("add", {"x": sc, "y": add}, (c.fresh("masked"), (b_, hq, s, t_), dt))
    pr = c.emit1("softmax", {"x": sc}, (c.fresh("probs"), (b_, hq, s, t_), dt), axis=3)
    return c.emit1("matmul", {"x": pr, "y": v})


def _sdpa_tuple(c: ImportContext) -> Any:
    out = _sdpa(c)
    n = len(c.val()) if isinstance(c.val(), (list, tuple)) else 1
    return (out, *([None] * (n - 1)))


def _ce_core(c: ImportContext, x: Any, target: Any, reduction: int, ignore_index: int, use_softmax: bool) -> Name:
    xs = c.shape(x)
    if len(xs) > 2:  # class dim 1 -> last
        perm = (0, *range(2, len(xs)), 1)
        x = c.transpose(x, perm, c.fresh("classes_last"))
        xs = c.shape(x)
    ts = c.shape(target)
    lab = c.emit1("unsqueeze", {"x": c.tensor(target, "int64")}, (c.fresh("label"), (*ts, 1), "int64"),
                  axis=(len(ts),))
    outs = [(c.fresh("softmax"), xs, c.dtype(x)), (c.fresh("token_loss"), (*ts, 1), c.dtype(x))]
    _, tok = c.emit("cross_entropy_with_softmax", {"x": x, "label": lab}, outs, ignore_index=int(ignore_index),
                    use_softmax=use_softmax)
    if reduction == 0:
        return c.reshape(tok, ts, c.name)
    dt = c.dtype(x)
    if reduction == 2:
        return c.emit1("sum", {"x": tok}, (c.name, (), dt), axis=(), keep_dim=False)
    # mean: over the counted tokens (torch divides by the number of labels != ignore_index;
    # ignored tokens have loss 0)
    total = c.emit1("sum", {"x": tok}, (c.fresh("loss_sum"), (), dt), axis=(), keep_dim=False)
    if isinstance(target, torch.Tensor):
        n = int((target != ignore_index).sum())
        return c.emit1("divide", {"x": total, "y": c.tensor(float(n), dt)}, (c.name, (), dt))
    keep = c.emit1("not_equal", {"x": lab, "y": c.tensor(int(ignore_index), "int64")},
                   (c.fresh("counted"), (*ts, 1), "bool"))
    keepf = c.emit1("cast", {"x": keep}, (c.fresh("counted_f"), (*ts, 1), dt), dtype=dt)
    count = c.emit1("sum", {"x": keepf}, (c.fresh("count"), (), dt), axis=(), keep_dim=False)
    return c.emit1("divide", {"x": total, "y": count}, (c.name, (), dt))


def _loss_args(c: ImportContext, first: int) -> tuple[int, int]:
    weight = c.arg(first, "weight")
    if weight is not None:
        raise c.unsupported("class weights")
    red = int(c.arg(first + 1, "reduction", 1))
    ii = int(c.arg(first + 2, "ignore_index", -100))
    return red, ii


def _cross_entropy(c: ImportContext) -> Any:
    x, target = c.args[0], c.args[1]
    red, ii = _loss_args(c, 2)
    if float(c.arg(5, "label_smoothing", 0.0)):
        raise c.unsupported("label smoothing")
    if c.is_tensor(target) and c.dtype(target).startswith(("float", "bfloat")):
        raise c.unsupported("soft (probability) targets")
    return _ce_core(c, x, target, red, ii, True)


def _nll(c: ImportContext) -> Any:
    x, target = c.args[0], c.args[1]
    red, ii = _loss_args(c, 2)
    logits = c.imp.fused.get(c.node)
    if logits is not None:
        lx = c.imp.env[logits]
        shp = tuple(int(d) for d in c.node.args[0].meta["val"].shape)
        x = c.reshape(lx, shp, c.fresh("logits")) if tuple(c.shape(lx)) != shp else lx
        out = _ce_core(c, x, target, red, ii, True)
    else:
        p = c.emit1("exp", {"x": x}, (c.fresh("probs"), c.shape(x), c.dtype(x)))
        out = _ce_core(c, p, target, red, ii, False)
    if c.target.startswith(("aten.nll_loss_forward", "aten.nll_loss2d_forward")):
        return (out, None)
    return out


def _builtin() -> dict[str, Hook]:
    t: dict[str, Hook] = {}
    for k in ("contiguous", "clone", "alias", "detach", "lift_fresh_copy", "lift_fresh", "_assert_tensor_metadata"):
        t["aten." + k] = _identity
    for k in ("mm", "bmm", "matmul"):
        t["aten." + k] = _matmul
    t["aten.linear"] = _linear
    t["aten.addmm"] = _addmm
    t["aten.layer_norm"] = _layer_norm
    t["aten.native_layer_norm"] = _layer_norm
    t["aten.rms_norm"] = _rms_norm
    t["aten.softmax"] = t["aten._softmax"] = _softmax_like("softmax")
    t["aten.log_softmax"] = t["aten._log_softmax"] = _softmax_like("log_softmax")
    t["aten.embedding"] = _embedding
    for k in _VIEWS:
        t[k] = _view
    t["aten.permute"] = _permute
    t["aten.transpose"] = t["aten.t"] = _transpose
    t["aten.expand"] = t["aten.expand_as"] = _expand
    t["aten.unsqueeze"] = _unsqueeze
    t["aten.squeeze"] = _squeeze
    t["aten.select"] = _select
    t["aten.slice"] = _slice
    t["aten.cat"] = t["aten.concat"] = _cat
    t["aten.split"] = t["aten.split_with_sizes"] = t["aten.chunk"] = _split
    t["aten.add"] = _binary("add")
    t["aten.sub"] = t["aten.rsub"] = _binary("subtract")
    t["aten.mul"] = _binary("multiply")
    t["aten.div"] = _binary("divide")
    t["aten.neg"] = _neg
    for k, r in (("ne", "not_equal"), ("lt", "less_than"), ("gt", "greater_than"), ("logical_and", "logical_and"),
                 ("logical_or", "logical_or"), ("bitwise_and", "bitwise_and"), ("bitwise_or", "bitwise_or"),
                 ("maximum", "maximum"), ("minimum", "minimum"), ("__or__", "bitwise_or"),
                 ("__and__", "bitwise_and"), ("floor_divide", "floor_divide"), ("remainder", "remainder")):
        t["aten." + k] = _binary(r)
    for k, r in (("eq", "not_equal"), ("le", "greater_than"), ("ge", "less_than")):
        t["aten." + k] = _binary(r, negate=True)
    t["aten.gather"] = _gather
    t["aten.stack"] = _stack
    t["aten.unbind"] = _unbind
    t["aten.triu"] = t["aten.tril"] = _tril_triu
    t["aten.argmax"] = _argmax
    t["aten.cumsum"] = _cumsum
    t["aten.amax"] = _reduce("max")
    t["aten.amin"] = _reduce("min")
    t["aten.any"] = _reduce("any")
    t["aten.all"] = _reduce("all")
    for k in ("relu", "tanh", "exp", "rsqrt", "sqrt", "sigmoid", "silu", "log", "abs", "sin", "cos", "erf",
              "reciprocal", "square", "bitwise_not", "logical_not"):
        t["aten." + k] = _unary(k)
    t["aten.gelu"] = _gelu
    t["aten.pow"] = _pow
    t["aten.mean"] = _reduce("mean")
    t["aten.sum"] = _reduce("sum")
    t["aten._to_copy"] = t["aten.to"] = t["aten.type_as"] = _cast
    t["aten.dropout"] = _dropout
    t["aten.where"] = _where_op
    t["aten.masked_fill"] = _masked_fill
    t["aten.pad"] = t["aten.constant_pad_nd"] = _pad
    t["aten.clamp"] = t["aten.clip"] = t["aten.clamp_min"] = t["aten.clamp_max"] = _clamp
    t["aten.isinf"] = t["aten.isnan"] = _isinf
    t["aten.topk"] = _topk
    t["aten.sort"] = t["aten.argsort"] = _sort
    t["aten.histc"] = _histc
    t["transformers.grouped_mm_fallback"] = t["aten._grouped_mm"] = _grouped_mm
    t["aten.index_put"] = _index_put
    t["aten.copy"] = _copy
    t["aten.fill"] = _fill
    t["aten.slice_scatter"] = _slice_scatter
    t["aten.select_scatter"] = _select_scatter
    t["aten.conv2d"] = t["aten.convolution"] = _conv2d
    t["aten.index"] = _index
    t["aten.scaled_dot_product_attention"] = _sdpa
    for k in ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention"):
        t["aten." + k] = _sdpa_tuple
    t["aten.cross_entropy_loss"] = _cross_entropy
    for k in _NLL:
        t[k] = _nll
    return t


_BUILTIN = _builtin()


def mapped_ops() -> list[str]:
    """The ATen ops (packets) the importer maps itself."""
    return sorted(_BUILTIN)


# -- the entry point -------------------------------------------------------------------------------


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
        import inspect

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
                  buffers: str = "input", optimizer: str | None = "adamw", decompose: bool = False
                  ) -> ImportedProgram:
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
    first (core ATen: ``addmm``, ``native_layer_norm``, ``_softmax``, ...). ``module`` may also be
    a ``torch.export.ExportedProgram``."""
    modes = {m: m.training for m in module.modules()} if isinstance(module, torch.nn.Module) else {}
    kwargs = hf_call_kwargs(module, kwargs)
    name = name or type(module).__name__
    if callable(loss) and not isinstance(loss, torch.nn.Module) and isinstance(module, torch.nn.Module):
        module = _WithLoss(module, loss)
        loss = None
    if isinstance(module, torch.nn.Module):
        module.eval()  # dropout off, as the simulator and the planner see the step
    try:
        ep = export(module, tuple(args), kwargs)
    finally:
        for m, was in modes.items():
            m.train(was)
    if decompose:
        ep = ep.run_decompositions()
    elif _mutates(ep):  # in-place ops (x.add_(1), buffer updates): functionalise, decomposing nothing
        ep = ep.run_decompositions({})
    imp = _Importer(ep, name, training, mapping, fallback, buffers)
    imp.run()
    return imp.finish(loss, optimizer)


# -- values (numpy) --------------------------------------------------------------


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


__all__ = ["ImportContext", "ImportedProgram", "Name", "export", "hf_call_kwargs", "import_module", "mapped_ops", "register_aten",
           "torch_values", "unregister_aten"]
