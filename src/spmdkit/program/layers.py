"""The transformer layers of a program, found the one way for every model source: from its ops'
``layer`` labels that end in a number (a preset's ``layer 3``, an imported model's
``model.layers.3`` or ``transformer.h.3``, a program file's own). The pipeline cuts between
them (:func:`spmdkit.planner.pipeline_split.op_units`); the report and the HTML page show the first
layer in full and the others as repeats of it (:func:`program_layers`).

A tensor's layer is its producer op's; a tensor no op makes (a parameter, a constant) is in the
layer of the ops that read it, where they are all in one (an optimizer update counts in its
parameter's layer); a gradient is in the layer of what it is the gradient of; a name that carries its layer's index is in that layer (the gradient of
``layers.3``'s output is made by layer 4's backward). Names that carry the layer's index (``layers.3.wq``,
``model.layers.3.self_attn.q_proj.weight``) fold it to ``*``; the others (an imported model's
``linear_10``) are matched to the same tensor of another layer of the same structure by their
place in the layer."""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass, field
from typing import Any

from spmdkit.program.ir import Program

_NUMBERED = re.compile(r"\d+$")
#: an op named for a tensor: ``grad of linear_3``, ``sum of linear_3.grad``
_OF = re.compile(r"^(\w+) of (.+)$")
#: A preset's layer prefix, folded wherever it occurs (``grad of layers.3.wq``).
_ZOO_STEM = r"\blayers\."


def layer_tags(prog: Program) -> list[str]:
    """The program's transformer layers: the distinct ``layer`` labels of its forward ops that
    end in a number (``layer 3`` of a preset, ``model.layers.3`` or ``transformer.h.3`` of an
    imported model, the module path up to its block's number), in the order the forward
    reaches them."""
    seen: dict[str, None] = {}
    for op in prog.ops:
        if op.phase == "forward" and op.layer not in seen and _NUMBERED.search(op.layer):
            seen[op.layer] = None
    return list(seen)


@dataclass
class Layers:
    """A program's layers (:func:`program_layers`)."""

    #: the layer labels, in the order the forward reaches them
    tags: list[str]
    #: each op's layer (an index into ``tags``; -1: outside the layers)
    op_layer: list[int]
    #: each tensor's layer (tensors outside the layers are absent)
    tensor_layer: dict[str, int]
    #: each layer's structure (layers of one structure share the number: their ops' rules alike)
    kind: list[int]
    _fold: re.Pattern[str] = field(repr=False, default=re.compile("(" + _ZOO_STEM + r")(\d+)\."))
    _tensor_place: dict[str, tuple[str, int]] = field(repr=False, default_factory=dict)
    _grad_of: dict[str, str] = field(repr=False, default_factory=dict)
    _stems: tuple[str, ...] = field(repr=False, default=("layers.",))
    _folded: dict[str, str] = field(repr=False, default_factory=dict)
    _names: Any = field(repr=False, default=None)  # the program's tensors
    _outputs: list[list[str]] = field(repr=False, default_factory=list)  # each op's outputs
    _op_place: dict[int, int] = field(repr=False, default_factory=dict)

    def fold(self, name: str) -> str:
        """``name`` with the layer index it carries made ``*``: ``layers.7.wq.grad`` ->
        ``layers.*.wq.grad``, ``model.layers.7.mlp.up_proj.weight`` -> ``model.layers.*.mlp.up_proj.weight``."""
        got = self._folded.get(name)
        if got is None:
            got = self._fold.sub(r"\1*.", name) if any(s in name for s in self._stems) else name
            self._folded[name] = got
        return got

    def tensor_key(self, name: str) -> Any:
        """What ``name`` is in every layer alike: its folded name where it carries the layer index,
        else (where it is in a layer) its layer's structure and its place among the layer's
        tensors, else the name itself."""
        g = self.fold(name)
        if g != name:
            return g
        base = self._grad_of.get(name)
        if base is not None:  # a gradient: by what it is the gradient of
            return ("grad", self.tensor_key(base), name[len(base):])
        if name not in self._tensor_place:
            return g
        return ("#", self.kind[self.tensor_layer[name]], *self._tensor_place[name])

    def op_key(self, index: int, name: str) -> Any:
        """As :meth:`tensor_key`, for the op ``index`` named ``name``: a backward op named for
        its tensor (``grad of linear_10``) by that tensor's key, another op of a layer by the key
        of what it makes, else by its place among its layer's ops of its phase."""
        g = self.fold(name)
        if g != name:
            return g
        m = _OF.match(name)
        if m is not None and self._names is not None and m.group(2) in self._names:
            return (m.group(1), self.tensor_key(m.group(2)))
        outs = self._outputs[index] if index < len(self._outputs) and self.op_layer[index] >= 0 else []
        if outs:  # by what it makes (a backward's places shift where a layer has one op fewer)
            return ("makes", self.tensor_key(outs[0]))
        if index not in self._op_place:
            return g
        return ("#", self.kind[self.op_layer[index]], self._op_place[index])


def _stems(tags: list[str]) -> list[str]:
    """The module paths up to a layer's number (``model.layers.``) of labels that are module paths."""
    return sorted({t[:m.start()] for t in tags if (m := _NUMBERED.search(t)) and t[:m.start()].endswith(".")})


def _fold_pattern(stems: list[str]) -> re.Pattern[str]:
    alts = [_ZOO_STEM] + [r"(?<![\w.])" + re.escape(s) for s in stems]
    return re.compile("(" + "|".join(alts) + r")(\d+)\.")


def _grad_of(prog: Program, name: str) -> str | None:
    """The tensor ``name`` is the gradient of (``x.grad``, ``x.grad1``, ``x.grad.sum`` -> ``x``),
    where it comes earlier in the program."""
    at = name.find(".grad")
    while at > 0:
        if name[:at] in prog.tensors:
            return name[:at]
        at = name.find(".grad", at + 1)
    return None


#: the last program's layers (the report, the page and the reshard table ask for them in turn)
_LAST: list[tuple[weakref.ref[Program], int, int, Layers]] = []


def program_layers(prog: Program) -> Layers:
    """Each op's and tensor's layer in ``prog``, and each layer's structure (kept for the last
    program asked about, while it has as many ops and tensors)."""
    if _LAST:
        ref, n_ops, n_tensors, got = _LAST[0]
        if ref() is prog and n_ops == len(prog.ops) and n_tensors == len(prog.tensors):
            return got
    layers = _program_layers(prog)
    _LAST[:] = [(weakref.ref(prog), len(prog.ops), len(prog.tensors), layers)]
    return layers


def _program_layers(prog: Program) -> Layers:
    tags = layer_tags(prog)
    index = {t: k for k, t in enumerate(tags)}
    made: dict[str, int] = {}
    readers: dict[str, set[int]] = {}
    opt_readers: dict[str, int] = {}
    op_layer: list[int] = []
    optimizer: list[int] = []
    for k, op in enumerate(prog.ops):
        u = index.get(op.layer, -1)
        op_layer.append(u)
        if op.phase == "optimizer" and u < 0:
            optimizer.append(k)
            continue
        for n in op.input_names():
            readers.setdefault(n, set()).add(u)
        for n in op.output_names():
            made.setdefault(n, u)
    for k in optimizer:  # an update counts in its parameter's layer
        op = prog.ops[k]
        u = next((r for n in op.input_names() if prog.tensors[n].kind == "parameter"
                  and len(r_ := readers.get(n, ())) == 1 and (r := next(iter(r_))) >= 0), -1)
        op_layer[k] = u
        for n in op.input_names():
            opt_readers.setdefault(n, u)
        for n in op.output_names():
            made.setdefault(n, u)
    stems = _stems(tags)
    fold = _fold_pattern(stems)
    numbered: dict[tuple[str, int], int] = {}  # (the label's stem, its number) -> the layer
    for k, t in enumerate(tags):
        m = _NUMBERED.search(t)
        assert m is not None
        numbered.setdefault((t[:m.start()], int(m.group())), k)
    tensor_layer: dict[str, int] = {}
    grad_of: dict[str, str] = {}
    for n, tensor in prog.tensors.items():
        if tensor.kind == "gradient" and (base := _grad_of(prog, n)) is not None:  # the layer of what it is the gradient of
            grad_of[n] = base
            if base in tensor_layer:
                tensor_layer[n] = tensor_layer[base]
            continue
        m = fold.search(n) if "." in n else None  # a name that says its layer (the gradient of a layer's output is made by the next)
        named = None if m is None else numbered.get((m.group(1), int(m.group(2)))) if m.group(1) != "layers." else \
            numbered.get(("layers.", int(m.group(2))), numbered.get(("layer ", int(m.group(2)))))
        if named is None:
            named = made.get(n)
        if named is None:
            rs = readers.get(n)
            named = (next(iter(rs)) if len(rs) == 1 else -1) if rs else opt_readers.get(n, -1)
        if named >= 0:
            tensor_layer[n] = named
    layers = Layers(tags, op_layer, tensor_layer, [], fold, _grad_of=grad_of, _stems=("layers.", *stems),
                    _names=prog.tensors)
    signature: list[list[str]] = [[] for _ in tags]  # the rules of each layer's forward
    place: dict[tuple[int, str], int] = {}
    for k, (op, u) in enumerate(zip(prog.ops, op_layer)):
        if u >= 0:
            if op.phase == "forward":
                signature[u].append(op.rule)
            at = place.get((u, op.phase), 0)
            place[(u, op.phase)] = at + 1
            if layers.fold(op.name) == op.name:
                layers._op_place[k] = at
    kinds: dict[tuple[str, ...], int] = {}
    layers.kind = [kinds.setdefault(tuple(s), len(kinds)) for s in signature]
    made_in: dict[str, str] = {}
    for op in prog.ops:
        outs = op.output_names()
        layers._outputs.append(outs)
        for n in outs:
            made_in.setdefault(n, op.phase)
    count: dict[tuple[int, str], int] = {}  # by the phase that makes it: a backward's places do not shift the forward's
    for n, u in tensor_layer.items():
        if layers.fold(n) == n and n not in grad_of:
            ph = made_in.get(n, "")
            at = count.get((u, ph), 0)
            layers._tensor_place[n] = (ph, at)
            count[(u, ph)] = at + 1
    return layers


__all__ = ["Layers", "layer_tags", "program_layers"]
