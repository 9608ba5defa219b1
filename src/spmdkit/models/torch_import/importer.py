"""The importer's walk of a ``torch.export`` graph (:class:`Importer`): placeholders become
parameters, buffers and inputs, each call node is lowered by its mapping (per call, registered
with :func:`register_aten`, or built in: :mod:`spmdkit.models.torch_import.aten`), a node no
program tensor reaches is evaluated at import time, an unmapped op is refused or (``fallback=
"replicate"``) a ``replicated`` op; then the program is differentiated (training), validated and
returned as an :class:`ImportedProgram` with where its source tensors come from."""

from __future__ import annotations

import operator
import re
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pt

from spmdkit.core.errors import ProgramError
from spmdkit.engine.registry import get_rule, has_rule
from spmdkit.models.torch_import import context
from spmdkit.models.torch_import.aten import BUILTIN
from spmdkit.models.torch_import.aten.loss import fuse_nll
from spmdkit.models.torch_import.aten.moe import Bank
from spmdkit.models.torch_import.context import TORCH_DTYPES, Hook, ImportContext, Name, dtype_name, key, lookup, packet
from spmdkit.models.zoo import Model, ModelConfig, add_optimizer
from spmdkit.program.autodiff import GRADS, Tape
from spmdkit.program.ir import Op, Program, ProgramBuilder, RecordedValue, Tensor, flat_refs

_REGISTRY: dict[str, Hook | str] = {}


def register_aten(op: Any, fn: Hook | str) -> None:
    """Map an ATen op (``"aten.erf"``, ``"aten.erf.default"``, ``torch.ops.aten.erf``) for every
    later import: ``fn(ctx)`` emits spmdkit ops with ``ctx.emit`` and returns the node's value
    (a tensor name; a tuple of them for a multi-output node), or ``fn`` is a rule name taking
    the node's tensor arguments in order (one output, the node's shape)."""
    _REGISTRY[key(op)] = fn


def unregister_aten(op: Any) -> None:
    _REGISTRY.pop(key(op), None)


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
    ``notes``: lines the report prints first (an attention kept spelt out with its mask);
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
        #: the HF MoE blocks lowered to the moe ops (:mod:`spmdkit.models.torch_import.moe`)
        self.moe_blocks: list[Any] = []
        self.notes: list[str] = []  # what the report's first lines say of the import (models/hf_attention.py)
        #: the call torch eager runs for the comparison where it differs from the traced one (a
        #: context-parallel import traces the tokens in zig-zag order: eager runs them in order;
        #: :mod:`spmdkit.models.hf_cp`)
        self.eager_kwargs: dict[str, Any] | None = None
        #: the ranks whose tokens each routed chunk of the MoE blocks is (``cp``, ``tp``, ``cp x
        #: tp``: :func:`spmdkit.models.hf.import_hf`); empty where each sequence is routed whole
        self.moe_chunks_by: str = ""

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


SHAPE_ONLY = {"aten.zeros_like", "aten.ones_like", "aten.full_like", "aten.empty_like", "aten.new_zeros",
               "aten.new_ones", "aten.new_full", "aten.new_empty", "aten.scalar_tensor"}


class Importer:
    """One walk of an exported graph: each FX node lowered to spmdkit ops (the per-call ``mapping``,
    then :func:`register_aten`'s, then the built-in lowerings of :mod:`spmdkit.models.torch_import.aten`),
    with the autodiff tape when training; :meth:`finish` makes the :class:`ImportedProgram`."""

    def __init__(self, ep: Any, name: str, training: bool, mapping: Mapping[Any, Hook | str] | None,
                 fallback: str, buffers: str) -> None:
        if fallback not in ("error", "replicate"):
            raise ProgramError(f"torch import: fallback must be 'error' or 'replicate', got {fallback!r}")
        if buffers not in ("input", "parameter"):
            raise ProgramError(f"torch import: buffers must be 'input' or 'parameter', got {buffers!r}")
        self.ep = ep
        self.b = ProgramBuilder(name)
        self.tape: Tape | None = Tape(self.b) if training else None
        self.mapping = {key(k): v for k, v in (mapping or {}).items()}
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
            t = torch.tensor(v, dtype=TORCH_DTYPES[dtype])
        else:
            raise ProgramError(f"torch import: cannot make a tensor of {type(v).__name__} {v!r}")
        while self.b.has(f"const_{self._nconst}"):
            self._nconst += 1
        n = Name(self.b.tensor(f"const_{self._nconst}", tuple(t.shape), dtype_name(t.dtype), "input"))
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
            if rule not in GRADS and rule != "replicated":  # a fallback's backward is replicated too
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

    def bank(self, node: Any, fqn: str, shape: tuple[int, ...], dt: str, how: tuple[str, bool, bool], ep: Any) -> Bank:
        """An expert bank (read by ``spmdkit::moe_experts``) as its ``[E, in, out]`` parts, each a
        parameter of its own (``<fqn>_gate`` / ``_up`` of a fused gate_up_proj, ``<fqn>_t`` for a
        transposed one: ``experts.down_proj_t``), its value the module's bank narrowed and transposed (``("parameter_slice",
        (fqn, axis, lo, hi, perm))`` in ``sources``): parameter counts equal the module's."""
        role, gated, transposed = how
        e, a, b = shape
        perm = None if transposed else (0, 2, 1)
        out_axis = 2 if transposed else 1
        n_out = b if transposed else a
        if role == "up" and gated:
            f = n_out // 2
            cuts = [("_gate", 0, f), ("_up", f, n_out)]
        else:
            cuts = [("" if transposed else "_t", 0, n_out)]
        trained = self.tape is not None and val_trained(ep, fqn)
        parts: list[Name] = []
        for suffix, lo, hi in cuts:
            rows = hi - lo
            pshape = (e, a, rows) if transposed else (e, shape[2], rows)
            name = fqn + suffix
            n = self.tape.param(name, pshape, dt) if trained and self.tape is not None else \
                self.b.tensor(name, pshape, dt, "parameter")
            self.sources[n] = ("parameter_slice", (fqn, out_axis, lo, hi, perm)) if suffix else ("parameter", fqn)
            parts.append(Name(n))
        return Bank(tuple(parts))

    # -- values
    def resolve(self, a: Any) -> Any:
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
            return any(Importer._has_name(x) for x in v)
        if isinstance(v, dict):
            return any(Importer._has_name(x) for x in v.values())
        return False


    # -- the walk
    def run(self) -> None:
        ep = self.ep
        graph = ep.graph_module.graph
        fuse_nll(graph, self.skip, self.fused)
        for hook in self.mapping.values():  # a per-call hook may fuse nodes before the walk too
            prepare = getattr(hook, "prepare", None)
            if prepare is not None:
                prepare(graph, self.skip, self.fused)
        specs = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}
        user_i = 0
        paths = _input_paths(ep)
        out_names: list[str] = []
        first: dict[int, str] = {}
        banks = expert_banks(graph)
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
                        n = self.b.tensor(node.name, tuple(int(s) for s in val.shape), dtype_name(val.dtype), "input")
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
                    dt = dtype_name(val.dtype)
                    if node in banks and kind == InputKind.PARAMETER:  # an expert bank: its [E, in, out] parts
                        self.env[node] = self.bank(node, fqn, shape, dt, banks[node], ep)
                        continue
                    as_param = kind == InputKind.PARAMETER or self.buffers == "parameter"
                    frozen = kind == InputKind.PARAMETER and not getattr(ep.state_dict.get(fqn), "requires_grad", True)
                    if as_param and self.tape is not None and val.is_floating_point() and not frozen:  # trained
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
                        out_names.append(self.constant(v, dtype_name(v.dtype)))
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
            if v is None and node.users:
                raise ctx.unsupported(f"output {i} of {node.args[0].name} is not imported")
            return v
        pk = packet(target)
        hook = lookup(self.mapping, target) or lookup(_REGISTRY, target)
        if hook is None:
            folded = self.fold(node, pk, args, kwargs)
            if folded is not None:
                return folded
            hook = lookup(BUILTIN, target)
        if hook is None:
            if self.fallback == "replicate":
                return self.replicate(ctx)
            raise ProgramError(f"torch import: no mapping for aten op {ctx.target} (node {node.name}) at {ctx.where}; "
                               f"map it with register_aten({pk!r}, fn) or mapping={{{pk!r}: fn}}, or import with "
                               f"fallback='replicate' (the command line's --fallback replicate)")
        if isinstance(hook, str):
            return _rule_hook(hook)(ctx)
        out = hook(ctx)
        return _wrap(out)

    def fold(self, node: Any, pk: str, args: Any, kwargs: Any) -> Any:
        """Evaluate a node at import time when no program tensor reaches it (or only its shape)."""
        if pk in SHAPE_ONLY:
            if self._has_name(args) or self._has_name(kwargs):
                filled = self.fill(node, pk, args, kwargs)
                if filled is not None:
                    return filled

            def stand_in(v: Any) -> Any:
                if isinstance(v, Name):
                    t = self.b.get(v)
                    return torch.zeros(t.shape, dtype=TORCH_DTYPES[t.dtype])
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

    def fill(self, node: Any, pk: str, args: Any, kwargs: Any) -> Name | None:
        """A fill of a program tensor's shape (``zeros_like(x)``, ``x.new_empty(...)``) with more
        than :data:`~.context.FOLD_FILL_UP_TO` elements as an op: its 0-d value ``expand``-ed to the
        output's shape, instead of a constant whose value would be recorded (a tensor that can
        grow with batch x seq: DeepSeek-V3's ``key_states = kv.new_empty(...)``). None: fold it."""
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.is_complex() or val.numel() <= context.FOLD_FILL_UP_TO:
            return None
        if pk in ("aten.full_like", "aten.new_full"):
            i = 1 if pk == "aten.full_like" else 2
            value = args[i] if len(args) > i else kwargs.get("fill_value")
        else:
            value = 1 if pk in ("aten.ones_like", "aten.new_ones") else 0  # empty: zeros, reproducibly
        if isinstance(value, (Name, torch.Tensor)) or not isinstance(value, (bool, int, float)):
            return None
        dt = dtype_name(val.dtype)
        scalar = torch.tensor(value, dtype=val.dtype)  # the value as the output's dtype holds it
        ctx = ImportContext(self, node, args, kwargs)
        x = self.constant(scalar, dt)
        return ctx.emit1("expand", {"x": x}, shape=tuple(int(s) for s in val.shape))

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
                outs.append((n, tuple(int(s) for s in v.shape), dtype_name(v.dtype)))
            else:
                outs.append(None)
        warnings.warn(f"torch import: no mapping for aten op {ctx.target} (node {ctx.name}) at {ctx.where}; it is "
                      f"imported as a `replicated` op (every input and output replicated)", stacklevel=5)
        start = self.b.op_count
        names = ctx.emit("replicated", {"ins": tuple(dict.fromkeys(ins)), "outs": (None,) * len(outs)}, outs)
        self.fallbacks[start] = (ctx.node.target, ctx.args, ctx.kwargs)
        res = [None if n is None else Name(n) for n in names]
        return tuple(res) if isinstance(val, (list, tuple)) else res[0]

    def _fallback_grads(self, ops: Sequence[Op], start: int) -> None:
        """The backward of each replicated fallback op (a ``replicated`` op the autodiff emits,
        reading the forward inputs and the output gradients): its torch callable is the
        forward op's vector-Jacobian product by torch autograd (:func:`_vjp`)."""
        made = {n: i for i in self.fallbacks for n in ops[i].output_names()}
        for i in range(start, len(ops)):
            op = ops[i]
            if op.rule != "replicated" or not op.name.startswith("grad of "):
                continue
            fwd = made.get(op.name[len("grad of "):])
            if fwd is None:
                continue
            ins = tuple(n for n in op.inputs["ins"] if n is not None)
            f_op = ops[fwd]
            f_ins = [n for n in f_op.inputs["ins"] if n is not None]
            f_outs = f_op.output_names()
            read = ins[len(f_ins):]  # the output gradients, in the order of the forward's outputs
            cot = [next((g for g in read if g == o + ".grad" or g.startswith(o + ".grad.")), None) for o in f_outs]
            fn, args, kwargs = self.fallbacks[fwd]
            self.fallbacks[i] = (_Vjp(fn, args, kwargs, f_ins, list(op.outputs), cot), tuple(Name(n) for n in ins), {})

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
        start = 0
        model = Model(ModelConfig(), Program([], []), {}, [], [], {})
        if self.tape is not None:
            loss_name = _pick_loss(self.out_names, b, loss)
            start = b.op_count
            grads = self.tape.backward(loss_name)
            if optimizer:
                add_optimizer(b, model, grads, optimizer)
        prog = b.build(validate=False)
        if self.tape is not None and self.fallbacks:
            self._fallback_grads(prog.ops, start)
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


class _Vjp:
    """A replicated fallback op's backward: called with the values of its ``ins`` (the forward
    inputs, then the output gradients), it reruns the forward torch op with autograd and returns
    the gradient of each forward input the backward op makes (zeros where none flows)."""

    def __init__(self, fn: Any, args: Any, kwargs: Any, f_ins: list[str], outs: list[Any],
                 cot: list[str | None]) -> None:
        self.fn, self.args, self.kwargs, self.f_ins, self.cot = fn, args, kwargs, f_ins, cot
        self.outs = outs  # per forward input: its gradient's name, or None

    def __call__(self, *vals: Any) -> tuple[Any, ...]:
        n_in = len(self.f_ins)
        leaves = {n: v.detach().clone().requires_grad_(v.is_floating_point()) for n, v in zip(self.f_ins, vals)}
        grads_in = dict(zip([c for c in self.cot if c is not None], vals[n_in:]))

        def sub(v: Any) -> Any:
            if isinstance(v, Name):
                return leaves[v]
            if isinstance(v, (list, tuple)):
                return type(v)(sub(x) for x in v)
            return v
        with torch.enable_grad():
            res = self.fn(*sub(self.args), **{k: sub(x) for k, x in self.kwargs.items()})
            res_l = list(res) if isinstance(res, (list, tuple)) else [res]
            pairs = [(r, grads_in[c]) for r, c in zip(res_l, self.cot) if c is not None and isinstance(r, torch.Tensor)
                     and r.requires_grad]
            want = [leaves[n] for n, o in zip(self.f_ins, self.outs) if o is not None]
            got = torch.autograd.grad([r for r, _ in pairs], want, [g.to(r.dtype) for r, g in pairs],
                                      allow_unused=True) if pairs and want else [None] * len(want)
        it = iter(got)
        out: list[Any] = []
        for n, o in zip(self.f_ins, self.outs):
            if o is None:
                out.append(None)
                continue
            g = next(it)
            out.append(torch.zeros_like(leaves[n]) if g is None else g.detach())
        return tuple(out)


def val_trained(ep: Any, fqn: str) -> bool:
    return bool(getattr(ep.state_dict.get(fqn), "requires_grad", True))


def expert_banks(graph: Any) -> dict[Any, tuple[str, bool, bool]]:
    """The parameter placeholders ``spmdkit::moe_experts`` reads as expert banks: node -> (``"up"``
    or ``"down"``, gated, transposed)."""
    out: dict[Any, tuple[str, bool, bool]] = {}
    for n in graph.nodes:
        if n.op == "call_function" and packet(n.target) == "spmdkit.moe_experts" and len(n.args) >= 9:
            gated, transposed = bool(n.args[7]), bool(n.args[8])
            for role, a in (("up", n.args[3]), ("down", n.args[4])):
                if isinstance(a, torch.fx.Node) and a.op == "placeholder":
                    out[a] = (role, gated, transposed)
    return out


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
    spec = getattr(getattr(ep, "call_spec", None), "in_spec", None)
    if spec is None:
        return []
    n = spec.num_leaves
    paths: list[Any] = [None] * n
    for path, i in pt.tree_flatten_with_path(pt.tree_unflatten(list(range(n)), spec))[0]:
        if isinstance(i, int) and 0 <= i < n:
            paths[i] = tuple(path)
    return paths


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


__all__ = ["ImportedProgram", "Importer", "register_aten", "unregister_aten"]
