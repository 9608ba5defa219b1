"""Trace each distinct layer once and repeat it: the import of a deep model at the cost of a
shallow one.

A transformer's blocks are a ``ModuleList`` of layers that compute alike (:func:`layer_stack`
finds it). :func:`layer_kinds` tells them apart by structure (each submodule's class, its
parameters' and buffers' shapes and dtypes, its plain attributes but the layer's index: Gemma's
``attention_type``, a MoE layer's experts); :func:`prefix_plan` picks the shortest run of first
layers where every kind follows every kind it follows in the whole model (Llama: 2 layers;
DeepSeek-V3, 3 dense then MoE: 5; Gemma 2, local / global: 3), and which of those layers each
layer of the model copies. :func:`export_repeated` exports the model with only those layers
(its layer list cut, then restored) and :func:`expand` writes the exported graph out to the full
depth: the copied layers' nodes and parameter placeholders renamed (``model.layers.K.*``, the
module paths in the nodes' metadata too), each copy reading the previous layer's outputs and
the shared tensors before the layers (rotary tables, masks), the nodes named as torch.export
names a full trace (one counter per op name, in graph order). The importer then walks it as it
walks any export, backward and optimizer included, so the program equals the full trace's (the
tests compare them op for op).

The expansion is refused (None: the caller traces the whole model) where the graph is not a
plain chain of layers: a layer reading an earlier layer than the previous one, a node between
two layers, layers' outputs collected after the last one (a router's auxiliary loss over every
layer), a layer's buffer updated in place, or parameters shared between layers."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.fx
from torch.export.graph_signature import InputKind, OutputKind, TensorArgument

#: attributes that hold a layer's index (so every layer would look distinct), not its kind
_INDEX_ATTRS = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "layer_num", "idx", "training"})
_PLAIN = (bool, int, float, str, type(None))
_NAME = re.compile(r"^([a-zA-Z_][0-9a-zA-Z_]*?)(?:_(\d+))?$")  # torch.fx's: a base and a counter


def layer_stack(module: torch.nn.Module) -> tuple[str, torch.nn.ModuleList] | None:
    """(path, list) of the module's layers: its longest ``ModuleList`` of two or more modules of
    one class; None where there is none, or two of that length (an encoder's and a decoder's)."""
    found: list[tuple[str, torch.nn.ModuleList]] = []
    for path, m in module.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) >= 2 and len({type(x) for x in m}) == 1:
            found.append((path, m))
    if not found:
        return None
    longest = max(len(m) for _, m in found)
    top = [(p, m) for p, m in found if len(m) == longest]
    return top[0] if len(top) == 1 else None


def _plain(v: Any) -> bool:
    return isinstance(v, _PLAIN) or (isinstance(v, (tuple, list)) and all(isinstance(x, _PLAIN) for x in v))


def _signature(layer: torch.nn.Module) -> tuple[Any, ...]:
    sig: list[Any] = []
    for path, m in layer.named_modules():
        attrs = tuple(sorted((k, repr(v)) for k, v in vars(m).items()
                             if not k.startswith("_") and k not in _INDEX_ATTRS and _plain(v)))
        sig.append((path, type(m).__qualname__, attrs))
    for name, t in (*layer.named_parameters(remove_duplicate=False), *layer.named_buffers(remove_duplicate=False)):
        sig.append((name, tuple(t.shape), str(t.dtype), bool(t.requires_grad)))
    return tuple(sig)


def layer_kinds(layers: Iterable[torch.nn.Module]) -> list[int]:
    """Each layer's kind: layers of one kind have the same structure (see the module docstring);
    kinds are numbered in the order they first appear."""
    seen: dict[tuple[Any, ...], int] = {}
    return [seen.setdefault(_signature(m), len(seen)) for m in layers]


def prefix_plan(kinds: Sequence[int]) -> tuple[int, list[int]]:
    """(P, copies): the shortest prefix of ``kinds`` holding every (previous kind, kind) pair of
    the sequence, and per layer the layer of that prefix it copies (itself in the prefix; past it,
    the first prefix layer with its pair)."""
    first: dict[tuple[int, int], int] = {}
    last = 0
    for i in range(1, len(kinds)):
        pair = (kinds[i - 1], kinds[i])
        if pair not in first:
            first[pair] = i
            last = i
    n = last + 1 if len(kinds) > 1 else len(kinds)
    copies = [i if i < n else first[(kinds[i - 1], kinds[i])] for i in range(len(kinds))]
    return n, copies


class _Holder:
    """The expanded graph as the importer reads an export's ``graph_module``: ``graph``, and the
    original module's attributes for ``get_attr`` nodes."""

    def __init__(self, graph: torch.fx.Graph, gm: Any) -> None:
        self.graph = graph
        self._gm = gm

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_gm":
            raise AttributeError(name)
        return getattr(self._gm, name)


@dataclasses.dataclass
class _Signature:
    input_specs: list[Any]
    output_specs: list[Any]


@dataclasses.dataclass
class Expanded:
    """An exported program written out to the full depth, with what the importer reads of a
    ``torch.export.ExportedProgram``."""

    graph_module: Any
    graph_signature: _Signature
    state_dict: dict[str, Any]
    constants: dict[str, Any]
    call_spec: Any

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph  # type: ignore[no-any-return]


def _index_of(path: str, prefix: str) -> int | None:
    head = prefix + "."
    if not path.startswith(head):
        return None
    k = path[len(head):].split(".", 1)[0]
    return int(k) if k.isdigit() else None


def _renamed(path: str, prefix: str, old: int, new: int) -> str:
    head = f"{prefix}.{old}"
    if path == head or path.startswith(head + "."):
        return f"{prefix}.{new}" + path[len(head):]
    return path


def _node_layer(node: torch.fx.Node, prefix: str) -> int | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    return _index_of(str(list(stack.values())[-1][0]), prefix)


def _base(name: str) -> str:
    m = _NAME.match(name)
    return m.group(1) if m else name


class _Layout:
    """Where every node of the shallow export belongs: before the layers (None), layer r, or
    after them ("post"); the layers' outputs (their nodes read outside them)."""

    def __init__(self, ep: Any, prefix: str, n: int) -> None:
        self.ok = False
        graph = ep.graph_module.graph
        self.specs = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}
        self.of: dict[torch.fx.Node, Any] = {}
        self.body: list[list[torch.fx.Node]] = [[] for _ in range(n)]
        self.pre: list[torch.fx.Node] = []
        self.post: list[torch.fx.Node] = []
        calls = [x for x in graph.nodes if x.op not in ("placeholder", "output")]
        raw = [_node_layer(x, prefix) for x in calls]
        for j, r in enumerate(raw):  # a node without a module path between two of one layer is that layer's
            if r is None:
                before = next((raw[k] for k in range(j - 1, -1, -1) if raw[k] is not None), None)
                after = next((raw[k] for k in range(j + 1, len(raw)) if raw[k] is not None), None)
                raw[j] = before if before is not None and before == after else None
        seen = -1
        for x, r in zip(calls, raw):
            if r is None:
                part: Any = None if seen < 0 else "post"
                (self.pre if part is None else self.post).append(x)
            else:
                if r < seen or self.post or x.op == "get_attr":
                    return  # a layer after the next one, or a node between two layers
                seen = r
                part = r
                self.body[r].append(x)
            self.of[x] = part
        if seen != n - 1:
            return
        self.places: list[torch.fx.Node] = [x for x in graph.nodes if x.op == "placeholder"]
        for x in self.places:
            spec = self.specs.get(x.name)
            r = None
            if spec is not None and spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                r = _index_of(str(spec.target), prefix)
            elif spec is not None and spec.kind == InputKind.CONSTANT_TENSOR:  # one layer's own constant
                users = {self.of.get(u) for u in x.users}
                r = next(iter(users)) if len(users) == 1 and isinstance(next(iter(users)), int) else None
            self.of[x] = r
        self.output = next(x for x in graph.nodes if x.op == "output")
        self.ok = self._chain(n)

    def _chain(self, n: int) -> bool:
        """Each layer reads only what is before the layers, itself and the previous layer's
        outputs; what follows reads only the last layer's; outputs the same count per layer."""
        self.outs: list[list[torch.fx.Node]] = []
        for r in range(n):
            body = set(self.body[r])
            outs = [x for x in self.body[r] if any(u not in body for u in x.users)]
            for x in self.body[r]:
                for a in x.all_input_nodes:
                    w = self.of.get(a)
                    if w is not None and w != r and w != r - 1:
                        return False
                    if w == r - 1 and a not in self.outs[r - 1]:
                        return False
            for o in outs:
                if any(self.of.get(u) not in (r, r + 1) and not (r == n - 1 and (self.of.get(u) == "post"
                                                                                  or u is self.output))
                       for u in o.users):
                    return False
            if self.outs and len(outs) != len(self.outs[0]):
                return False
            self.outs.append(outs)
        for x in (*self.post, self.output):
            for a in x.all_input_nodes:
                w = self.of.get(a)
                if isinstance(w, int) and (w != n - 1 or a not in self.outs[n - 1]):
                    return False
        return True


def expand(ep: Any, module: torch.nn.Module, prefix: str, copies: Sequence[int]) -> Expanded | None:
    """``ep`` (an export of ``module`` with the first ``max(copies) + 1`` layers of its stack at
    ``prefix``) written out to ``len(copies)`` layers, layer i a copy of layer ``copies[i]``; the
    new layers' parameters and buffers are ``module``'s own (the full model's). None where the
    graph is not a plain chain of layers (see the module docstring)."""
    if any(s.kind not in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT) for s in ep.graph_signature.output_specs):
        return None
    n_short = max(copies) + 1
    lay = _Layout(ep, prefix, n_short)
    if not lay.ok:
        return None
    state = {**dict(module.named_parameters(remove_duplicate=False)), **dict(module.named_buffers(remove_duplicate=False))}
    own = [str(s.target) for s in ep.graph_signature.input_specs
           if s.kind == InputKind.PARAMETER and _index_of(str(s.target), prefix) is not None]
    if len({id(state.get(t)) for t in own}) < len(own):
        return None  # parameters shared between layers (or not the module's)
    g = torch.fx.Graph()
    specs: list[Any] = []
    sd, consts = dict(ep.state_dict), dict(ep.constants)
    env: dict[tuple[int, torch.fx.Node], torch.fx.Node] = {}  # (layer, shallow node) -> its node; -1: shared

    def place(x: torch.fx.Node, i: int, r: int) -> bool:
        spec = lay.specs[x.name]
        if i == r:
            new = g.placeholder(x.name)
            specs.append(spec if new.name == x.name else dataclasses.replace(spec, arg=TensorArgument(name=new.name)))
        elif spec.kind == InputKind.CONSTANT_TENSOR:
            target = f"{spec.target}_layer{i}"
            consts[target] = ep.constants[spec.target].detach()
            new = g.placeholder(f"{x.name}_layer{i}")
            specs.append(dataclasses.replace(spec, arg=TensorArgument(name=new.name), target=target))
        else:
            target = _renamed(str(spec.target), prefix, r, i)
            t = state.get(target)
            val = x.meta.get("val")
            if t is None or val is None or tuple(t.shape) != tuple(val.shape) or t.dtype != val.dtype:
                return False
            (sd if spec.target in ep.state_dict else consts)[target] = t
            named = x.name == x.name[:2] + str(spec.target).replace(".", "_")  # p_model_layers_0_..., as export
            new = g.placeholder(x.name[:2] + target.replace(".", "_") if named else target)
            specs.append(dataclasses.replace(spec, arg=TensorArgument(name=new.name), target=target))
        new.meta = dict(x.meta)
        env[(i, x)] = new
        return True

    run: list[torch.fx.Node] = []

    def flush() -> bool:
        for i, r in enumerate(copies):
            if not all(place(x, i, r) for x in run if lay.of[x] == r):
                return False
        run.clear()
        return True

    for x in lay.places:
        if isinstance(lay.of[x], int):
            run.append(x)
            continue
        if run and not flush():
            return None
        new = g.placeholder(x.name)
        new.meta = dict(x.meta)
        specs.append(lay.specs[x.name])
        env[(-1, x)] = new
    if run and not flush():
        return None

    def copy(x: torch.fx.Node, i: int, r: int | None) -> torch.fx.Node:
        def arg(a: torch.fx.Node) -> torch.fx.Node:
            w = lay.of.get(a)
            if w is None or w == "post":
                return env[(-1, a)]
            if r is None or w != r:  # the previous layer's output (after the layers: the last one's)
                k = lay.outs[w].index(a)
                prev = len(copies) - 1 if r is None else i - 1
                return env[(prev, lay.outs[copies[prev]][k])]
            return env[(i, a)]
        args = torch.fx.map_arg(x.args, arg)
        kwargs = torch.fx.map_arg(x.kwargs, arg)
        new = g.create_node(x.op, x.target, args, kwargs, _base(x.name), x.type)  # numbered as a full trace
        new.meta = dict(x.meta)
        if r is not None and i != r and "nn_module_stack" in x.meta:
            new.meta["nn_module_stack"] = {k: (_renamed(str(p), prefix, r, i), t)
                                           for k, (p, t) in x.meta["nn_module_stack"].items()}
        env[(i if r is not None else -1, x)] = new
        return new

    for x in lay.pre:
        copy(x, -1, None)
    for i, r in enumerate(copies):
        for x in lay.body[r]:
            copy(x, i, r)
    for x in (*lay.post, lay.output):
        copy(x, -1, None)
    sig = _Signature(specs, list(ep.graph_signature.output_specs))
    return Expanded(_Holder(g, ep.graph_module), sig, sd, consts, getattr(ep, "call_spec", None))


__all__ = ["Expanded", "expand", "layer_kinds", "layer_stack", "prefix_plan"]
