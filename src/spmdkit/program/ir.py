"""The program IR: tensors and ops of one training step, a builder, a JSON format, validation.

A :class:`Program` is a list of :class:`Op` in topological order over named :class:`Tensor`
objects. An op names a registered rule (``"matmul"``), binds the rule's tensor parameters
to tensor names (``{"x": "h", "y": "w_q"}``; a vector parameter takes a list), lists its
outputs in the rule's output order and carries the rule's attributes. Tensors have a kind:
``input`` (data fed to the step), ``parameter``, ``activation``, ``gradient`` or
``optimizer_state``; an optimizer's updated parameter names the parameter it overwrites
(``inplace_of``), so it takes no memory of its own.

JSON (``format: spmdkit-program``, ``version: 1``; docs/graph.md)::

    {"format": "spmdkit-program", "version": 1,
     "tensors": [{"name": "x", "shape": [8, 512], "dtype": "float32", "kind": "input"}, ...],
     "ops": [{"rule": "matmul", "name": "fc1", "inputs": {"x": "x", "y": "w1"},
              "outputs": ["h"], "attrs": {"trans_y": false}, "layer": "", "phase": "forward"}],
     "values": {"eps": {"dtype": "float32", "shape": [], "zlib_base64": "..."}}}

``values`` (optional) records the values of source tensors that are part of the step, not data
(an imported module's constants and buffers: masks, epsilons, position ids): little-endian
bytes of ``dtype``, zlib-compressed, base64. The simulator and ``spmdkit run`` use them instead
of drawing random values.

Standard library only.
"""

from __future__ import annotations

import base64
import binascii
import json
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import ProgramError, ShapeMismatchError, SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.spec import DistTensorSpec, SpmdResult
from spmdkit.engine.registry import Rule, get_rule, is_reverse, output_params
from spmdkit.engine.signature import coerce_attr
from spmdkit.io.jsonfile import read_json
from spmdkit.program.shapes import expected_output_shapes

FORMAT = "spmdkit-program"
VERSION = 1
KINDS = ("input", "parameter", "activation", "gradient", "optimizer_state")
PHASES = ("forward", "backward", "optimizer")
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1}

#: Limits on a program's tensors (load_program refuses more): rank, size of one axis, and
#: elements of one tensor (2**62: byte counts and cost estimates stay finite floats).
MAX_RANK = 64
MAX_DIM = 1 << 62
MAX_NUMEL = 1 << 62

#: dtypes a recorded value is stored in (little-endian; numpy's names), and their item sizes
VALUE_DTYPES = {"float64": 8, "float32": 4, "float16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
                "uint8": 1, "bool": 1}

Ref = Any  # a tensor name, None (absent optional), or a list of those (vector parameter)


@dataclass(frozen=True)
class Tensor:
    """A named tensor of the program: global shape, dtype and kind."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    kind: str = "activation"
    inplace_of: str | None = None

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "kind": self.kind}
        if self.inplace_of:
            d["inplace_of"] = self.inplace_of
        return d


@dataclass(frozen=True)
class Op:
    """One op: a rule name, its tensor arguments by parameter name, its outputs in the rule's
    output order, and its attributes. ``layer`` groups ops for reports (``"layer 3"``);
    ``phase`` is forward, backward or optimizer."""

    rule: str
    inputs: Mapping[str, Ref]
    outputs: tuple[Ref, ...]
    attrs: Mapping[str, Any] = field(default_factory=dict)
    name: str = ""
    layer: str = ""
    phase: str = "forward"

    def input_names(self) -> list[str]:
        """The tensor names the op reads, in parameter order (computed once per op: an op is
        frozen and its inputs are never changed in place)."""
        got: tuple[str, ...] | None = self.__dict__.get("_input_names")
        if got is None:
            got = tuple([n for v in self.inputs.values() for n in flat_refs(v) if n is not None])
            object.__setattr__(self, "_input_names", got)
        return list(got)

    def output_names(self) -> list[str]:
        """The tensor names the op makes, in output order (computed once per op)."""
        got: tuple[str, ...] | None = self.__dict__.get("_output_names")
        if got is None:
            got = tuple([n for v in self.outputs for n in flat_refs(v) if n is not None])
            object.__setattr__(self, "_output_names", got)
        return list(got)

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "name": self.name, "inputs": {k: _jsonable(v) for k, v in self.inputs.items()},
                "outputs": [_jsonable(v) for v in self.outputs], "attrs": {k: _jsonable(v) for k, v in
                                                                          self.attrs.items()},
                "layer": self.layer, "phase": self.phase}


@dataclass(frozen=True)
class RecordedValue:
    """The recorded value of a source tensor, standard library only: the dtype it is stored in
    (one of :data:`VALUE_DTYPES`; a bfloat16 constant is stored exactly as float32), its shape
    and its little-endian bytes (``numpy.frombuffer(data, "<" + dtype)`` reads it)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @staticmethod
    def of(array: Any) -> RecordedValue:
        """From a numpy array (or anything with ``dtype``, ``shape`` and ``tobytes``, C order)."""
        name = array.dtype.name
        if name not in VALUE_DTYPES:
            raise ProgramError(f"recorded value: dtype {name} is not one of {', '.join(VALUE_DTYPES)}")
        data = array.astype(array.dtype.newbyteorder("<")).tobytes(order="C")
        return RecordedValue(name, tuple(int(d) for d in array.shape), data)

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape),
                "zlib_base64": base64.b64encode(zlib.compress(self.data, 6)).decode("ascii")}


def _value_from_json(name: str, obj: Any, prog: Program) -> RecordedValue:
    where = f"values[{name[:100]!r}]"
    if not isinstance(obj, dict) or set(obj) != {"dtype", "shape", "zlib_base64"}:
        raise ProgramError(f"{where}: expected an object with exactly dtype, shape and zlib_base64")
    t = prog.tensors.get(name)
    if t is None:
        raise ProgramError(f"{where}: the program has no tensor {name[:100]!r}")
    dtype, shape, text = obj["dtype"], obj["shape"], obj["zlib_base64"]
    if dtype not in VALUE_DTYPES:
        raise ProgramError(f"{where}: dtype {str(dtype)[:40]!r} is not one of {', '.join(VALUE_DTYPES)}")
    if not isinstance(shape, list) or tuple(shape) != t.shape:
        raise ProgramError(f"{where}: shape {str(shape)[:100]} is not the tensor's {list(t.shape)}")
    if not isinstance(text, str):
        raise ProgramError(f"{where}: zlib_base64 must be a string")
    want = t.numel * VALUE_DTYPES[dtype]
    try:
        d = zlib.decompressobj()
        data = d.decompress(base64.b64decode(text.encode("ascii"), validate=True), want + 1)
    except (binascii.Error, zlib.error, UnicodeEncodeError, ValueError) as exc:
        raise ProgramError(f"{where}: zlib_base64 does not decode: {exc}") from None
    if len(data) != want or not d.eof:
        got = f"{len(data)} bytes" if len(data) < want else \
            f"more than {want} bytes" if len(data) > want else f"{want} bytes, then not the end of the zlib stream"
        raise ProgramError(f"{where}: {got}, expected {want} ({t.numel} values of {dtype})")
    return RecordedValue(dtype, t.shape, data)


def flat_refs(v: Ref) -> list[str | None]:
    """An op slot's tensor names as a list (a list slot as is, one name or None as one item)."""
    if type(v) is str or v is None:
        return [v]
    if isinstance(v, (list, tuple)):
        return list(v)
    return [v]




def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    return v


def _param_grads(prog: Program) -> frozenset[str]:
    return frozenset(n for op in prog.ops if op.phase == "optimizer" for n in op.input_names()
                     if prog.tensors[n].kind == "gradient")


def _param_dtype(prog: Program) -> str:
    counts: dict[str, int] = {}
    for t in prog.tensors.values():
        if t.kind == "parameter":
            counts[t.dtype] = counts.get(t.dtype, 0) + 1
    return max(counts, key=counts.__getitem__) if counts else ""


class Program:
    """Tensors and ops in topological order. Build with :class:`ProgramBuilder` or
    :func:`load_program`; :meth:`validate` checks it against the registered rules."""

    #: (the tokenizer's vocabulary, the padded one, make_vocab_size_divisible_by, tp) of a model
    #: whose vocabulary ``--make-vocab-size-divisible-by`` padded (:func:`spmdkit.models.source.pad_vocab`),
    #: which the exports state; None where not padded. A class default, so that a rewrite that
    #: re-runs ``__init__`` keeps what was set
    vocab_padding: tuple[int, int, int, int] | None = None

    def __init__(self, tensors: Iterable[Tensor], ops: Iterable[Op], name: str = "") -> None:
        self.name = name
        self.tensors: dict[str, Tensor] = {}
        for t in tensors:
            if t.name in self.tensors:
                raise ProgramError(f"program: tensor {t.name!r} is declared twice")
            self.tensors[t.name] = t
        self.ops: list[Op] = list(ops)
        #: recorded values of source tensors (constants, buffers): name -> RecordedValue. An
        #: object re-initialised in place (a rewritten copy of an imported program, made as
        #: ``__dict__`` copy + ``Program.__init__``) keeps those of the tensors it still has.
        kept = getattr(self, "values", None)
        self.values: dict[str, RecordedValue] = \
            {n: v for n, v in kept.items() if n in self.tensors} if isinstance(kept, dict) else {}
        self._derived: dict[str, Any] = {}

    def derived(self, key: str, make: Callable[[Program], Any]) -> Any:
        """``make(self)``, made once per program and kept under ``key``: a table derived from the
        ops and tensors alone (a planner's per-op constants), which every plan of the program
        reads. A program's ops and tensors are not changed once built (a rewrite builds a new
        program, or re-runs ``__init__``, which forgets these tables)."""
        got = self._derived.get(key)
        if got is None:
            got = self._derived[key] = make(self)
        return got

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (and copied) without its :meth:`derived` tables: made again where read."""
        return {**self.__dict__, "_derived": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._derived = {}  # a program pickled before it had tables

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    def tensor(self, name: str) -> Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ProgramError(f"program: no tensor named {name!r}") from None

    def of_kind(self, *kinds: str) -> list[Tensor]:
        return [t for t in self.tensors.values() if t.kind in kinds]

    def param_grads(self) -> frozenset[str]:
        """The gradients the optimizer-phase ops read (the parameter gradients), found once."""
        return self.derived("param_grads", _param_grads)  # type: ignore[no-any-return]

    def param_dtype(self) -> str | None:
        """The dtype most of the parameters have (of dtypes as many, the first declared), None
        without parameters: the precision the program trains in, where no ``--precision`` says
        (the step's peak matmul rate, a recipe's precision)."""
        return self.derived("param_dtype", _param_dtype) or None

    def live_spans(self) -> tuple[dict[str, int], dict[str, int]]:
        """(the op that makes each tensor, the last op that reads it, or makes it if none does),
        by op index, for every tensor an op makes."""
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        for i, op in enumerate(self.ops):
            for n in op.output_names():
                first.setdefault(n, i)
                last.setdefault(n, i)
            for n in op.input_names():
                if n in first:
                    last[n] = i
        return first, last

    # -- validation ---------------------------------------------------------------------------
    @staticmethod
    def _bad_params(where: str, op: Op, rule: Any) -> NoReturn:
        """:meth:`validate`'s error for the op at ``where`` naming a parameter its rule does not
        have (an input that is not a tensor parameter, an attribute that is not an attribute)."""
        params = {p.name: p for p in rule.forward.params}
        for k in op.inputs:
            if k not in params or not params[k].is_tensor:
                raise ProgramError(f"{where}: rule {rule.name} has no tensor parameter {k!r} "
                                   f"({rule.forward.describe()})")
        for k in op.attrs:
            if k not in params or params[k].is_tensor:
                raise ProgramError(f"{where}: rule {rule.name} has no attribute {k!r} ({rule.forward.describe()})")
        raise AssertionError(where)

    def validate(self, mesh: ProcessMesh | None = None, rules: bool = True) -> None:
        """Raise :class:`ProgramError` (naming the op and what is wrong) unless every op names a
        registered rule with its parameters bound, every input is a program input / parameter
        or produced by an earlier op, no tensor is produced twice, and (``rules``) each rule
        accepts the op's shapes with the declared output ranks (checked with every tensor
        replicated; propagation checks them again, so a planner may skip this)."""
        mesh = mesh or ProcessMesh([1])
        for t in self.tensors.values():
            if t.kind not in KINDS:
                raise ProgramError(f"tensor {t.name!r}: unknown kind {t.kind!r} (one of {', '.join(KINDS)})")
            if t.dtype not in DTYPE_BYTES:
                raise ProgramError(f"tensor {t.name!r}: unknown dtype {t.dtype!r}")
            if any((not isinstance(s, int)) or s < 0 for s in t.shape):
                raise ProgramError(f"tensor {t.name!r}: shape {list(t.shape)} must be non-negative ints")
        produced: set[str] = {t.name for t in self.tensors.values()
                              if t.kind in ("input", "parameter", "optimizer_state") and not t.inplace_of}
        made_by: dict[str, str] = {}
        #: per rule name: (the rule, its tensor parameters, its attributes, its required tensors)
        by_rule: dict[str, tuple[Any, frozenset[str], frozenset[str], tuple[str, ...]]] = {}
        for i, op in enumerate(self.ops):
            where = f"op {i} ({op.name or op.rule})"
            if op.phase not in PHASES:
                raise ProgramError(f"{where}: unknown phase {op.phase!r}")
            known = by_rule.get(op.rule)
            if known is None:
                try:
                    rule = get_rule(op.rule)
                except SpmdError as exc:
                    raise ProgramError(f"{where}: {exc}") from None
                fps = rule.forward.params
                known = by_rule[op.rule] = (
                    rule, frozenset(p.name for p in fps if p.is_tensor), frozenset(p.name for p in fps if not p.is_tensor),
                    tuple(p.name for p in fps if p.is_tensor and p.required and p.kind != "T?"))
            rule, tensor_params, attr_params, required = known
            if not (tensor_params.issuperset(op.inputs) and attr_params.issuperset(op.attrs)):
                self._bad_params(where, op, rule)
            for pn in required:
                if op.inputs.get(pn) is None:
                    raise ProgramError(f"{where}: missing tensor argument {pn!r} of rule {rule.name}")
            for n in op.input_names():
                if n not in self.tensors:
                    raise ProgramError(f"{where}: input {n!r} is not a tensor of the program")
                if n not in produced:
                    raise ProgramError(f"{where}: input {n!r} is used before any op produces it (dangling)")
            for n in op.output_names():
                if n not in self.tensors:
                    raise ProgramError(f"{where}: output {n!r} is not a tensor of the program")
                if n in produced:
                    by: str | None = made_by.get(n)
                    raise ProgramError(f"{where}: output {n!r} is already " +
                                       (f"produced by {by}" if by else f"a program {self.tensors[n].kind}"))
                produced.add(n)
                made_by[n] = where
            if not rules:
                continue
            try:
                res = call_rule(self, op, {}, mesh)
            except SpmdError as exc:
                raise ProgramError(f"{where}: rule {rule.name} rejects the op: {type(exc).__name__}: {exc}") from None
            flat = [a for v in res.outputs for a in (v if isinstance(v, tuple) else (v,))]
            out_refs = [n for v in op.outputs for n in flat_refs(v)]
            if len(flat) != len(out_refs):
                raise ProgramError(f"{where}: rule {rule.name} answers {len(flat)} outputs, the op lists "
                                   f"{len(out_refs)}")
            for o, a in zip(out_refs, flat):
                if o is None:
                    continue
                n = o
                if a is not None and a.ndim != len(self.tensors[n].shape):
                    raise ProgramError(f"{where}: output {n!r} has shape {list(self.tensors[n].shape)} but rule "
                                       f"{rule.name} makes a {a.ndim}-D tensor")
            self._check_expected_shapes(op, rule, where, res)
            self._check_output_shapes(op, rule, where, out_refs, mesh)

    def _check_expected_shapes(self, op: Op, rule: Rule, where: str, res: SpmdResult) -> None:
        """Each declared output shape against the shape the op makes from its input shapes and
        attributes (:func:`spmdkit.program.shapes.expected_output_shapes`; axes whose size the
        op does not fix, e.g. nonzero's count, are not compared)."""
        values: dict[str, Any] = {}
        for p in rule.forward.params:
            if p.is_tensor:
                v = op.inputs.get(p.name)
                if isinstance(v, (list, tuple)):
                    values[p.name] = [None if n is None else tuple(self.tensors[n].shape) for n in v]
                else:
                    values[p.name] = None if v is None else tuple(self.tensors[v].shape)
            elif p.name in op.attrs:
                v = op.attrs[p.name]
                try:
                    values[p.name] = v if v is None else coerce_attr(rule.name, p, v)
                except SpmdError:
                    values[p.name] = v
            elif not p.required:
                values[p.name] = p.default
        ndims = [tuple(None if x is None else x.ndim for x in a) if isinstance(a, tuple)
                 else (None if a is None else a.ndim) for a in res.outputs]
        expected = expected_output_shapes(rule, values, ndims)
        for k, (ref, want) in enumerate(zip(op.outputs, expected)):
            if want is None or ref is None:
                continue
            if isinstance(ref, tuple):
                if not isinstance(want, list):
                    continue
                if len(want) != len(ref):
                    raise ProgramError(f"{where}: output {k} of rule {rule.name} is a list of {len(want)} tensors "
                                       f"for these inputs, the op lists {len(ref)}")
                pairs = list(zip(ref, want))
            elif isinstance(want, list):
                continue
            else:
                pairs = [(ref, want)]
            for name, shape in pairs:
                if name is None or shape is None:
                    continue
                have = self.tensors[name].shape
                if len(have) != len(shape) or any(w is not None and w != h for h, w in zip(have, shape)):
                    ins = ", ".join(f"{n} {list(self.tensors[n].shape)}" for n in op.input_names())
                    shown = "[" + ", ".join("?" if w is None else str(w) for w in shape) + "]"
                    raise ProgramError(f"{where}: output {name!r} is declared {list(have)} but the op makes "
                                       f"{shown} (rule {rule.name}, inputs {ins}): the declared output shape "
                                       f"contradicts the op")

    def _check_output_shapes(self, op: Op, rule: Rule, where: str, out_refs: list[str | None],
                             mesh: ProcessMesh) -> None:
        """The declared output shapes against the input shapes, a second way: a rule's reverse
        (backward) mode takes the outputs as arguments and checks every axis the notation ties
        to an input axis (``ShapeMismatchError``), so it is called once with every tensor
        replicated. Rules without a backward mode, and ops with an output the program does
        not keep (``null``), are not checked this way (docs/graph.md)."""
        if not is_reverse(rule) or any(o is None for o in out_refs):
            return  # a grad rule in the backward slot (cummax's) does not take the op's outputs
        try:
            call_rule(self, op, {}, mesh, mode="backward")
        except ShapeMismatchError as exc:
            shapes = ", ".join(f"{n} {list(self.tensors[n].shape)}" for n in out_refs if n is not None)
            raise ProgramError(f"{where}: the declared output shape contradicts rule {rule.name} "
                               f"({shapes}): {exc}") from None
        except SpmdError:
            return  # the reverse rule refuses for another reason: forward already accepted the op

    # -- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        d = {"format": FORMAT, "version": VERSION, "name": self.name,
             "tensors": [t.to_json() for t in self.tensors.values()], "ops": [o.to_json() for o in self.ops]}
        if self.values:
            d["values"] = {n: v.to_json() for n, v in self.values.items()}
        return d

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)


def _tensor_from_json(obj: Any, i: int) -> Tensor:
    if not isinstance(obj, dict):
        raise ProgramError(f"tensors[{i}]: expected an object, got {type(obj).__name__}")
    try:
        name = obj["name"]
        shape = obj["shape"]
    except KeyError as exc:
        raise ProgramError(f"tensors[{i}]: missing {exc.args[0]!r}") from None
    if not isinstance(name, str) or not name:
        raise ProgramError(f"tensors[{i}]: name must be a non-empty string")
    if not isinstance(shape, list) or any(not isinstance(s, int) or isinstance(s, bool) for s in shape):
        raise ProgramError(f"tensor {name[:100]!r}: shape must be a list of ints")
    if len(shape) > MAX_RANK or any(not 0 <= s <= MAX_DIM for s in shape):
        raise ProgramError(f"tensor {name[:100]!r}: shape must have at most {MAX_RANK} sizes, each from 0 to "
                           f"{MAX_DIM}")
    n = 1
    for s in shape:
        n *= s
    if n > MAX_NUMEL:
        raise ProgramError(f"tensor {name[:100]!r}: {n} elements, more than {MAX_NUMEL} (the limit)")
    for key in ("dtype", "kind", "inplace_of"):
        if key in obj and not isinstance(obj[key], str) and not (key == "inplace_of" and obj[key] is None):
            raise ProgramError(f"tensor {name[:100]!r}: {key} must be a string")
    unknown = set(obj) - {"name", "shape", "dtype", "kind", "inplace_of"}
    if unknown:
        raise ProgramError(f"tensor {name!r}: unknown fields {sorted(unknown)}")
    return Tensor(name, tuple(shape), str(obj.get("dtype", "float32")), str(obj.get("kind", "activation")),
                  obj.get("inplace_of"))


def _ref_from_json(v: Any, where: str) -> Ref:
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, list) and all(x is None or isinstance(x, str) for x in v):
        return tuple(v)
    raise ProgramError(f"{where}: a tensor reference must be a name, null or a list of names, got {repr(v)[:100]}")


def _attr_from_json(v: Any) -> Any:
    return tuple(_attr_from_json(x) for x in v) if isinstance(v, list) else v


def _op_from_json(obj: Any, i: int) -> Op:
    if not isinstance(obj, dict):
        raise ProgramError(f"ops[{i}]: expected an object, got {type(obj).__name__}")
    unknown = set(obj) - {"rule", "name", "inputs", "outputs", "attrs", "layer", "phase"}
    if unknown:
        raise ProgramError(f"ops[{i}]: unknown fields {sorted(unknown)}")
    rule = obj.get("rule")
    if not isinstance(rule, str):
        raise ProgramError(f"ops[{i}]: 'rule' must be a rule name")
    ins = obj.get("inputs", {})
    outs = obj.get("outputs", [])
    attrs = obj.get("attrs", {})
    if not isinstance(ins, dict) or not isinstance(outs, list) or not isinstance(attrs, dict):
        raise ProgramError(f"ops[{i}] ({rule}): inputs must be an object, outputs a list, attrs an object")
    where = f"ops[{i}] ({obj.get('name') or rule})"
    return Op(rule, {k: _ref_from_json(v, where) for k, v in ins.items()},
              tuple(_ref_from_json(v, where) for v in outs), {k: _attr_from_json(v) for k, v in attrs.items()},
              str(obj.get("name", "")), str(obj.get("layer", "")), str(obj.get("phase", "forward")))


def program_from_json(obj: Any) -> Program:
    """A Program from its JSON object (raises ProgramError on a malformed one)."""
    if not isinstance(obj, dict):
        raise ProgramError("program: expected a JSON object")
    if obj.get("format") != FORMAT:
        raise ProgramError(f"program: 'format' must be {FORMAT!r}, got {obj.get('format')!r}")
    if obj.get("version") != VERSION:
        raise ProgramError(f"program: version {obj.get('version')!r} is not supported (this spmdkit reads {VERSION})")
    tensors = obj.get("tensors")
    ops = obj.get("ops")
    if not isinstance(tensors, list) or not isinstance(ops, list):
        raise ProgramError("program: 'tensors' and 'ops' must be lists")
    prog = Program([_tensor_from_json(t, i) for i, t in enumerate(tensors)],
                   [_op_from_json(o, i) for i, o in enumerate(ops)], str(obj.get("name", "")))
    values = obj.get("values", {})
    if not isinstance(values, dict):
        raise ProgramError("program: 'values' must be an object (tensor name -> recorded value)")
    if values:
        made = {n for op in prog.ops for n in op.output_names()}
        for name, v in values.items():
            if name in made:
                raise ProgramError(f"values[{name[:100]!r}]: an op makes this tensor; only source tensors have "
                                   "recorded values")
            prog.values[name] = _value_from_json(name, v, prog)
    return prog


def load_program(path: str) -> Program:
    """Read and validate a program JSON file."""
    obj = read_json(path, "--program: program file", ProgramError)
    prog = program_from_json(obj)
    prog.validate()
    return prog


# -- calling a rule on an op ------------------------------------------------------------------


def op_layout(op: Op, mode: str = "forward") -> list[tuple[str, Any]]:
    """How the op's rule takes its arguments in ``mode``: per parameter ``("t", name)`` (a tensor
    or None), ``("vec", names)`` (a vector parameter) or ``("a", value)`` (an attribute: the
    op's, or the rule's default). In backward (reverse) mode the rule's output parameters take
    the op's outputs in order."""
    rule = get_rule(op.rule)
    m = rule.mode(mode)
    bound: dict[str, Ref] = dict(op.inputs)
    if mode == "backward":
        for name, v in zip(output_params(rule), op.outputs):
            bound[name] = v
    out: list[tuple[str, Any]] = []
    for p in m.params:
        if p.is_tensor:
            v = bound.get(p.name)
            out.append(("vec" if isinstance(v, (list, tuple)) else "t", v))
        elif p.name in op.attrs:
            out.append(("a", op.attrs[p.name]))
        elif p.required:
            raise ProgramError(f"op {op.name or op.rule}: missing attribute {p.name!r} of rule {rule.name}")
        else:
            out.append(("a", p.default))
    return out


def layout_args(layout: Sequence[tuple[str, Any]], get: Callable[[str], DistTensorSpec]) -> list[Any]:
    """Positional rule arguments from :func:`op_layout`, tensors made by ``get(name)``."""
    args: list[Any] = []
    for kind, v in layout:
        if kind == "a":
            args.append(v)
        elif kind == "t":
            args.append(None if v is None else get(v))
        else:
            args.append([None if n is None else get(n) for n in v])
    return args


def call_rule(prog: Program, op: Op, attrs: Mapping[str, TensorDistAttr | None], mesh: ProcessMesh,
              mode: str = "forward") -> SpmdResult:
    """The op's rule in ``mode`` on its tensors (replicated where ``attrs`` has none)."""
    def get(name: str) -> DistTensorSpec:
        t = prog.tensors[name]
        a = attrs.get(name) or TensorDistAttr.replicated(mesh, len(t.shape))
        return DistTensorSpec(t.shape, a)

    return get_rule(op.rule).infer(mode, *layout_args(op_layout(op, mode), get))


# -- the builder ------------------------------------------------------------------------------


class ProgramBuilder:
    """Build a Program op by op::

        b = ProgramBuilder()
        x = b.tensor("x", [8, 512], kind="input")
        w = b.tensor("w", [512, 2048], kind="parameter")
        (h,) = b.op("matmul", {"x": x, "y": w}, [("h", [8, 2048])])
        prog = b.build()
    """

    def __init__(self, name: str = "") -> None:
        self.name = name
        self._tensors: dict[str, Tensor] = {}
        self._ops: list[Op] = []
        self.layer = ""
        self.phase = "forward"

    def tensor(self, name: str, shape: Sequence[int], dtype: str = "float32", kind: str = "activation",
               inplace_of: str | None = None) -> str:
        if name in self._tensors:
            raise ProgramError(f"builder: tensor {name!r} is declared twice")
        self._tensors[name] = Tensor(name, tuple(int(s) for s in shape), dtype, kind, inplace_of)
        return name

    def has(self, name: str) -> bool:
        return name in self._tensors

    def get(self, name: str) -> Tensor:
        return self._tensors[name]

    def op(self, rule: str, inputs: Mapping[str, Ref], outputs: Sequence[Any], name: str = "",
           **attrs: Any) -> list[str | None]:
        """Add an op; ``outputs``: per output a declared tensor name, None, or ``(name, shape)``
        / ``(name, shape, dtype)`` / ``(name, shape, dtype, kind)`` to declare it here, or a list
        of those for a vector output parameter (split's ``out``)."""
        outs: list[Any] = []
        for o in outputs:
            if isinstance(o, list):  # a vector output parameter (split's out): its items
                outs.append(tuple(self._declare(x) for x in o))
            else:
                outs.append(self._declare(o))
        first = flat_refs(outs[0])[0] if outs and flat_refs(outs[0]) else None
        default = first if first is not None else f"{rule}_{len(self._ops)}"
        self._ops.append(Op(rule, dict(inputs), tuple(outs), dict(attrs), name or default, self.layer, self.phase))
        return outs

    @property
    def op_count(self) -> int:
        """How many ops were added so far (the index the next one gets)."""
        return len(self._ops)

    def append_op(self, op: Op) -> None:
        """Add an op built by the caller, as is (its tensors already declared)."""
        self._ops.append(op)

    def _declare(self, o: Any) -> str | None:
        if o is None or isinstance(o, str):
            return o
        n, shape, *rest = o
        dtype = rest[0] if rest else "float32"
        kind = rest[1] if len(rest) > 1 else ("gradient" if self.phase == "backward" else "activation")
        return self.tensor(n, shape, dtype, kind)

    def build(self, validate: bool = True, rules: bool = True) -> Program:
        prog = Program(self._tensors.values(), self._ops, self.name)
        if validate:
            prog.validate(rules=rules)
        return prog


__all__ = ["DTYPE_BYTES", "FORMAT", "KINDS", "MAX_DIM", "MAX_NUMEL", "MAX_RANK", "Op", "PHASES", "Program", "ProgramBuilder",
           "RecordedValue", "Tensor", "VALUE_DTYPES", "VERSION",
           "call_rule", "flat_refs", "layout_args", "load_program", "op_layout", "program_from_json"]
