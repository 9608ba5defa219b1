"""Parallel strategies as annotations on a zoo model, over named mesh dims.

``--strategy`` takes a comma list of:

- ``dp``: data parallel over the ``dp`` mesh dim: the batch axis of the inputs (tokens,
  labels, positions) sharded; parameters, their optimizer states and updates replicated over
  ``dp``, so each parameter gradient (partial over ``dp``) is all-reduced before the update.
- ``megatron`` (``tp``): Megatron-LM tensor parallel over ``tp``: q/k/v, gate/up (and GPT-2's
  fc1) column-parallel (output features sharded) with their biases (role ``column_bias``),
  output / down (fc2) projections row-parallel (input features sharded; their biases, role
  ``bias``, replicated), the embedding and the LM head vocab-parallel; the loss is
  ``c_softmax_with_cross_entropy`` over the vocab-sharded logits. A stack of experts
  ``[E, in, out]`` is sharded as one expert's projection (each expert tensor-parallel, as
  Megatron-Core's expert-tensor-parallel = tp); the MoE router and MLA's down projections
  (roles ``router``, ``replicated``) stay replicated, as Megatron keeps them.
- ``sp``: Megatron sequence parallel (with ``megatron``): the residual stream is sharded on
  its sequence axis over ``tp``, the normalised activations that feed the column-parallel
  projections are gathered: the all-reduces become all-gather / reduce-scatter pairs.
- ``zero1`` / ``zero2`` (``zero``) / ``zero3`` (``fsdp``): ZeRO over ``dp``
  (:func:`optimizer_layouts`): optimizer states (moments, fp32 master weights) sharded on
  their first axis not already sharded that ``dp`` divides, or where none does unevenly on
  their largest (:func:`zero_axis`: real ZeRO shards flat buffers by bytes, whatever
  ``dp`` divides); zero1 all-reduces each gradient,
  zero2 reduce-scatters it, zero3 also stores the parameter sharded and gathers it before its
  forward and backward readers (:func:`zero3_storage`). The update runs on the shards; the
  updated parameter is held as the parameter (all-gathered under zero1/2).

``megatron`` alone means ``dp,megatron`` when the mesh has a ``dp`` dim; every strategy
needs its mesh dims (``dp`` / ``tp``) to exist. User annotations (tensor -> dims_mapping)
are applied last and win.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.core.mesh import MAX_MESH_RANKS, ProcessMesh
from spmdkit.models.zoo import Model

STRATEGIES = ("dp", "megatron", "sp", "zero1", "zero2", "zero3")
_ALIASES = {"tp": "megatron", "ddp": "dp", "zero": "zero2", "fsdp": "zero3"}


#: The most ranks a ``--mesh`` may have: the core's limit (2**20, about a million devices),
#: checked here before any mesh is built so the CLI names ``--mesh``.
MAX_RANKS = MAX_MESH_RANKS

_MESH_PART = re.compile(r"([A-Za-z_][A-Za-z0-9_]*) *= *([0-9]{1,9})")


def _cut(text: str, n: int = 80) -> str:
    """``text`` for an error message, cut to about ``n`` characters."""
    return repr(text) if len(text) <= n else repr(text[:n]) + f"... ({len(text)} characters)"


def parse_mesh(text: str) -> ProcessMesh:
    """``"dp=2,tp=4"`` -> a 2x4 mesh with dims named dp and tp. Names are identifiers
    (ASCII letters, digits, ``_``), sizes ASCII decimal ints >= 1, names distinct, at most
    :data:`MAX_RANKS` ranks in all."""
    names: list[str] = []
    sizes: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        m = _MESH_PART.fullmatch(part)
        if m is None or int(m.group(2)) < 1:
            raise ProgramError(f"--mesh {_cut(text)}: {_cut(part, 40)} is not name=size (an identifier, "
                               f"an integer >= 1), e.g. dp=2,tp=4")
        if m.group(1) in names:
            raise ProgramError(f"--mesh {_cut(text)}: dim name {m.group(1)!r} is given twice")
        names.append(m.group(1))
        sizes.append(int(m.group(2)))
        n = 1
        for k in sizes:
            n *= k
        if n > MAX_RANKS:
            raise ProgramError(f"--mesh {_cut(text)}: more than {MAX_RANKS} ranks (the limit)")
    if not sizes:
        raise ProgramError(f"--mesh {_cut(text)}: no mesh dims")
    return ProcessMesh(sizes, dim_names=names)


def parse_strategy(text: str | Iterable[str], mesh: ProcessMesh) -> tuple[str, ...]:
    items = [s.strip() for s in (text.split(",") if isinstance(text, str) else text) if s.strip()]
    out: list[str] = []
    for s in items:
        s = _ALIASES.get(s, s)
        if s == "none":
            continue
        if s not in STRATEGIES:
            raise ProgramError(f"--strategy: unknown strategy {_cut(s, 40)} (one of {', '.join(STRATEGIES)}; "
                               f"tp = megatron, zero = zero2, fsdp = zero3)")
        if s not in out:
            out.append(s)
    if "megatron" in out and "dp" not in out and "dp" in mesh.dim_names:
        out.insert(0, "dp")
    zeros = [s for s in out if s.startswith("zero")]
    if len(zeros) > 1:
        raise ProgramError(f"--strategy: {' and '.join(zeros)}: give one ZeRO stage")
    if zeros and "dp" not in out:
        out.insert(0, "dp")
    for s in out:
        need = "tp" if s in ("megatron", "sp") else "dp"
        if need not in mesh.dim_names:
            raise ProgramError(f"--strategy {s}: the mesh has no {need!r} dim (mesh dims: {', '.join(mesh.dim_names)})")
    if "sp" in out and "megatron" not in out:
        raise ProgramError("--strategy sp: sequence parallel needs megatron (tensor parallel) too")
    return tuple(out)


def strategy_dims(mesh: ProcessMesh, strategy: Iterable[str]) -> tuple[set[str], int | None, int | None]:
    """(the strategies as a set, the dp mesh dim or None, the tp mesh dim or None (megatron))."""
    st = set(strategy)
    return (st, mesh.dim_index("dp") if "dp" in st else None,
            mesh.dim_index("tp") if "megatron" in st else None)


class Marks(dict[str, list[Any]]):
    """Tensor name -> the dims_mapping a strategy is writing; ``marks(name)`` is the tensor's
    (all ``-1`` the first time)."""

    def __init__(self, prog: Any) -> None:
        super().__init__()
        self.prog = prog

    def __call__(self, name: str) -> list[Any]:
        return self.setdefault(name, [-1] * len(self.prog.tensors[name].shape))


def annotate(model: Model, mesh: ProcessMesh, strategy: Iterable[str],
                user: Mapping[str, Any] | None = None) -> dict[str, TensorDistAttr]:
    """Tensor name -> dist attr for the strategies (and the user's own annotations)."""
    prog = model.program
    st, dp, tp = strategy_dims(mesh, strategy)
    out = dm = Marks(prog)

    if dp is not None:
        for key in ("tokens", "labels", "positions"):
            n = model.inputs.get(key)
            if n is not None:
                dm(n)[0] = dp
    if tp is not None:
        for p, role in model.roles.items():
            if role in ("column", "head", "column_bias"):
                dm(p)[-1] = tp  # output features (a stack of experts [E, in, out]: each expert's)
            elif role in ("row", "embedding"):
                dm(p)[-2] = tp  # input features (the vocabulary of a table)
            # norm, position, bias (after a row-parallel projection), router, replicated: replicated
    optimizer_layouts(prog, mesh, model.optimizer, out, st, dp, user)
    if "sp" in st and tp is not None:
        for n in model.residual:
            d = dm(n)
            d[1] = tp
            if dp is not None:
                d[0] = dp
        # gathered copies: the normalised activations the column-parallel projections read, and
        # (backward) the gradients of the row-parallel projections' outputs
        for n in [*model.norm_outputs, *(g for r in model.row_outputs if (g := r + ".grad") in prog.tensors)]:
            d = dm(n)
            if dp is not None:
                d[0] = dp
    attrs = {n: TensorDistAttr(mesh, d) for n, d in out.items()}
    attrs.update(user_attrs(prog, mesh, user))
    return attrs


def zero_stage(strategy: Iterable[str]) -> int:
    """The ZeRO stage a strategy asks for (0: none)."""
    st = set(strategy)
    return max((int(s[4]) for s in st if s in ("zero1", "zero2", "zero3")), default=0)


def zero_axis(shape: Sequence[int], dims_mapping: Sequence[Any], dp: int) -> int | None:
    """The axis ZeRO shards a parameter's states over ``dp`` ranks on: the first axis not
    already sharded that ``dp`` divides; where none does, the largest axis not already sharded
    that has at least ``dp`` elements, split unevenly (the first ranks one element row more).
    Real ZeRO / the distributed optimizer / FSDP shard a flat buffer by bytes (``ceil(numel /
    dp)`` a rank, whatever the shapes); an uneven split of the largest axis holds at most
    ``(dp - 1) / size`` of the tensor more on the fullest rank, and its reduce-scatter and
    all-gather move the same bytes. None where no axis has ``dp`` elements (a tensor too
    small to shard: held whole, as a scalar state)."""
    free = [a for a, e in enumerate(dims_mapping) if e == -1]
    even = next((a for a in free if shape[a] % dp == 0), None)
    if even is not None:
        return even
    big = [a for a in free if shape[a] >= dp]
    return max(big, key=lambda a: shape[a]) if big else None


def optimizer_layouts(prog: Any, mesh: ProcessMesh, optimizer: Mapping[str, tuple[str, tuple[str, ...], str, tuple[str, ...]]],
                      out: dict[str, list[Any]], strategy: Iterable[str], dp: int | None,
                      user: Mapping[str, Any] | None) -> dict[str, TensorDistAttr]:
    """Lay out each parameter's optimizer states in ``out`` (tensor -> dims_mapping, edited in
    place): as the parameter (its layout from ``out``, or the user's pin of it, which wins), and
    under ZeRO (``zero1`` / ``zero2`` / ``zero3``) sharded over ``dp`` on their first axis not
    already sharded that ``dp`` divides. zero1 holds the gradient all-reduced (whole on every
    rank), zero2 and zero3 hold it reduce-scattered like the states. The updated parameter and
    states are not annotated: propagation holds an in-place output as the tensor it overwrites.
    Returns the stored layout of each ZeRO-3 parameter (``propagate(storage=...)``)."""
    stage = zero_stage(strategy)
    pins = user_attrs(prog, mesh, user) if user else {}
    storage: dict[str, TensorDistAttr] = {}
    for p, (g, states, _new, new_states) in optimizer.items():
        pin = pins.get(p)
        base = list(pin.dims_mapping) if pin is not None else list(out.get(p, [-1] * len(prog.tensors[p].shape)))
        for s in (*states, *new_states):
            out[s] = list(base)
        if not stage or dp is None or not states:
            continue
        axis = zero_axis(prog.tensors[p].shape, base, mesh.shape[dp])
        if axis is None:
            continue
        shard = list(base)
        shard[axis] = dp
        for s in (*states, *new_states):
            out[s] = list(shard)
        out[g] = list(base) if stage == 1 else list(shard)
        if stage >= 3:
            storage[p] = TensorDistAttr(mesh, shard)
    return storage


def zero3_storage(optimizer: Mapping[str, tuple[str, tuple[str, ...], str, tuple[str, ...]]],
                  attrs: Mapping[str, TensorDistAttr], strategy: Iterable[str]) -> dict[str, TensorDistAttr]:
    """ZeRO-3 / FSDP: each parameter stored as its optimizer states are laid out (sharded over
    ``dp``), gathered before its forward and backward readers (``propagate(storage=...)``);
    empty below stage 3."""
    if zero_stage(strategy) < 3:
        return {}
    out: dict[str, TensorDistAttr] = {}
    for p, (_g, states, _new, _ns) in optimizer.items():
        a = attrs.get(states[0]) if states else None
        if a is not None and a != attrs.get(p) and not a.partial:
            out[p] = a
    return out


def user_attrs(prog: Any, mesh: ProcessMesh, user: Mapping[str, Any] | None) -> dict[str, TensorDistAttr]:
    """The user's annotations (tensor -> dims_mapping or dist attr) as dist attrs on ``mesh``;
    ProgramError (naming ``--annotate`` and the tensor) for an unknown tensor, a dims_mapping
    the mesh rejects or one whose length is not the tensor's rank."""
    attrs: dict[str, TensorDistAttr] = {}
    for n, a in (user or {}).items():
        if n not in prog.tensors:
            raise ProgramError(f"--annotate {_cut(n, 60)}: the program has no such tensor")
        if not isinstance(a, TensorDistAttr):
            try:
                a = TensorDistAttr(mesh, a)
            except SpmdError as exc:
                raise ProgramError(f"--annotate {n}: {str(exc)[:300]}") from None
        if len(a.dims_mapping) != len(prog.tensors[n].shape):
            raise ProgramError(f"--annotate {n}: dims_mapping has {len(a.dims_mapping)} entries, the tensor "
                               f"has shape {list(prog.tensors[n].shape)}")
        attrs[n] = a
    return attrs


__all__ = ["MAX_RANKS", "STRATEGIES", "annotate", "optimizer_layouts", "parse_mesh", "parse_strategy", "user_attrs", "zero3_storage", "zero_axis", "zero_stage"]
