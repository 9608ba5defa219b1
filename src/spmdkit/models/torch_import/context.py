"""What a lowering of an ATen op sees: :class:`ImportContext` (one FX node's arguments as program
tensor names, constants and Python values, and the emitters that add spmdkit ops), :class:`Name`
(a program tensor name as a node's value), the program dtypes of torch's, and the keys ATen ops
are mapped under (:func:`key`: ``aten.linear.default`` / ``aten.linear``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from spmdkit.core.errors import ProgramError
from spmdkit.program.autodiff import Tape
from spmdkit.program.ir import ProgramBuilder

DTYPES: dict[Any, str] = {
    torch.float64: "float64", torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.int64: "int64", torch.int32: "int32", torch.int16: "int16", torch.int8: "int8", torch.uint8: "uint8",
    torch.bool: "bool",
}
TORCH_DTYPES = {v: k for k, v in DTYPES.items()}
#: a complex tensor is imported as a real one with a trailing axis of 2 (real, imaginary) in
#: the dtype of its parts (Llama 4's rotary tables: ``polar``, ``view_as_complex``, a complex ``mul``)
COMPLEX_PARTS: dict[Any, str] = {torch.complex64: "float32", torch.complex128: "float64", torch.complex32: "float16"}


#: a fill (``zeros_like(x)``, ``x.new_empty(...)``, a scalar broadcast to a program tensor's
#: shape) with more elements than this is imported as its 0-d value ``expand``-ed (an op), not as
#: a constant made at import time: a constant's value is recorded, and an activation-sized one
#: grows with batch x seq (DeepSeek-V3's MLA keys: 1.5 GiB a layer at seq 4096)
FOLD_FILL_UP_TO = 4096


def dtype_name(dt: Any) -> str:
    try:
        return DTYPES[dt]
    except KeyError:
        raise ProgramError(f"torch import: dtype {dt} has no spmdkit dtype (one of {', '.join(TORCH_DTYPES)})") from None


class Name(str):
    """A program tensor name as an imported node's value (a plain ``str`` is an attribute)."""

    __slots__ = ()


Hook = Callable[["ImportContext"], Any]


def key(op: Any) -> str:
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


def lookup(table: Mapping[str, Any], target: Any) -> Any:
    full = key(target)
    if full in table:
        return table[full]
    pk = full.rsplit(".", 1)[0] if full.count(".") >= 2 else full
    return table.get(pk)


def packet(target: Any) -> str:
    k = key(target)
    return k.rsplit(".", 1)[0] if k.count(".") >= 2 else k


def where_of(node: Any) -> str:
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


def norm_dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


class ImporterState(Protocol):
    """What a lowering reads and writes of the importer walking the graph
    (:class:`spmdkit.models.torch_import.importer.Importer`): the program builder, the autodiff
    tape (None unless training), the values of the nodes walked so far, the fused nodes, and the
    makers of constants and ops."""

    b: ProgramBuilder
    tape: Tape | None
    env: dict[Any, Any]
    fused: dict[Any, Any]

    def constant(self, v: Any, dtype: str) -> Name: ...

    def emit(self, ctx: ImportContext, rule: str, inputs: dict[str, Any], outputs: list[Any],
             attrs: dict[str, Any]) -> list[str | None]: ...


class ImportContext:
    """What a mapping hook sees for one FX node: ``node``, ``target`` (``"aten.linear.default"``),
    ``args`` / ``kwargs`` (tensors as program tensor names, constants as torch tensors, the rest
    as Python values), and the emitters. ``emit(rule, inputs, outputs=None, **attrs)`` adds an op
    (``outputs``: per output a declared name, None, or ``(name, shape[, dtype])``; default one
    output named after the node with its shape and dtype) and returns its output names."""

    def __init__(self, imp: ImporterState, node: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.imp = imp
        self.node = node
        self.name: str = node.name
        self.target: str = key(node.target)
        self.args = args
        self.kwargs = kwargs
        self.where = where_of(node)
        self._k = 0

    # -- arguments and shapes
    def arg(self, i: int, name: str, default: Any = None) -> Any:
        if i < len(self.args):
            return self.args[i]
        return self.kwargs.get(name, default)

    def val(self) -> Any:
        return self.node.meta.get("val")

    def out_shape(self) -> tuple[int, ...]:
        """The node's output shape (a complex output's with the trailing 2 of its parts)."""
        v = self.val()
        if not isinstance(v, torch.Tensor):
            raise ProgramError(f"torch import: {self.target} at {self.where}: no single tensor output")
        shp = tuple(int(s) for s in v.shape)
        return (*shp, 2) if v.is_complex() else shp

    def out_dtype(self) -> str:
        v = self.val()
        if isinstance(v, torch.Tensor) and v.dtype in COMPLEX_PARTS:
            return COMPLEX_PARTS[v.dtype]
        return dtype_name(v.dtype) if isinstance(v, torch.Tensor) else "float32"

    def is_complex(self, i: int) -> bool:
        """Whether the node's argument ``i`` is a complex tensor (imported as its real parts)."""
        a: Any = self.node.args[i] if i < len(self.node.args) else None
        v = a.meta.get("val") if hasattr(a, "meta") else a
        return isinstance(v, torch.Tensor) and v.is_complex()

    def shape(self, v: Any) -> tuple[int, ...]:
        if isinstance(v, torch.Tensor):
            return tuple(int(s) for s in v.shape)
        return self.imp.b.get(self.tensor(v)).shape

    def dtype(self, v: Any) -> str:
        if isinstance(v, torch.Tensor):
            return dtype_name(v.dtype)
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


__all__ = ["COMPLEX_PARTS", "DTYPES", "FOLD_FILL_UP_TO", "TORCH_DTYPES", "Hook", "ImportContext", "ImporterState", "Name", "dtype_name", "key", "lookup",
           "norm_dim", "packet", "where_of"]
