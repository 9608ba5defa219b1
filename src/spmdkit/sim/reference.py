"""The machinery of the numpy references: :class:`Reference`, :class:`Ctx`, the table, helpers.

A :class:`Reference` computes an op from named arguments (Paddle's parameter
names: ``{"x": array, "axis": -1}``) and a :class:`Ctx` that says where it runs
(globally, or on one rank with its local shards). The verifier calls it once on
the global arrays and once per rank on the local ones. ``localize`` is the hook
that turns global attributes into the local ones a rank's kernel would get
(identity for most ops: axes, perm, begin_norm_axis stay as they are; a reshape
target in local sizes or an embedding's vocabulary range is computed there).

The references themselves live beside their case generators in :mod:`spmdkit.sim.refs`,
one module per op family (the same module names as :mod:`spmdkit.ops`); each registers its
references here with :func:`register_reference`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spmdkit.core.mesh import ProcessMesh
from spmdkit.engine.registry import by_rule_name

Arrays = dict[str, Any]


@dataclass(frozen=True)
class Ctx:
    """Where a reference runs: ``rank is None`` for the global (unsharded) run."""

    mesh: ProcessMesh
    rank: int | None = None
    coords: tuple[int, ...] | None = None
    in_attrs: dict[str, Any] = field(default_factory=dict)
    shapes: dict[str, Any] = field(default_factory=dict)
    out_ndims: tuple[int | None, ...] = ()
    out_attrs: tuple[Any, ...] = ()
    out_shapes: tuple[Any, ...] = ()
    #: where a kernel itself communicates (c_softmax_with_cross_entropy's class group) and a real
    #: engine runs the rank (the torch.distributed executor): ``comm.all_reduce(array, mesh_dims,
    #: op)`` with op "sum" or "max" over the groups of those mesh dims. None in the simulator.
    comm: Any = None

    @property
    def is_global(self) -> bool:
        return self.rank is None

    def out_ndim(self, i: int) -> int | None:
        return self.out_ndims[i] if i < len(self.out_ndims) else None

    @property
    def nests_vectors(self) -> bool:
        """A run for case generation (global, no output ranks known): an op with a vector output
        next to other outputs returns it as one list (as the reverse case layout reads it), not
        flat (as the verifier assembles the outputs)."""
        return self.is_global and not self.out_ndims


RefFn = Callable[[Arrays, Ctx], Sequence[Any]]


@dataclass(frozen=True)
class Reference:
    """The numpy reference of one op (or grad op).

    ``inputs``: the data tensor parameters it needs; ``optional``: tensor parameters
    it accepts absent (``None``); ``spec_params``: tensor parameters that only
    describe outputs (``outs`` of default_data_parallel); ``outputs``: names of the
    outputs in Paddle's order; ``family``: its case generator's key in ``spmdkit.sim.cases.GENERATORS``;
    ``domains``: value domain per input (real, pos, unit, gt1, prob, nonzero, int,
    nzint, bool); ``prepare``: makes dependent inputs consistent (mean from x, ...).
    """

    name: str
    fn: RefFn
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    family: str
    optional: tuple[str, ...] = ()
    spec_params: tuple[str, ...] = ()
    domains: dict[str, str] = field(default_factory=dict)
    prepare: Callable[[Arrays], None] | None = None
    localize: Callable[[Arrays, Ctx], Arrays] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def tensor_params(self) -> tuple[str, ...]:
        return self.inputs + self.optional + self.spec_params

    def domain(self, name: str) -> str:
        return str(self.domains.get(name, self.meta.get("domain", "real")))

    def run(self, args: Arrays, ctx: Ctx) -> tuple[Any, ...]:
        a = self.localize(args, ctx) if self.localize is not None and not ctx.is_global else args
        out = self.fn(a, ctx)
        return tuple(out)


REFERENCES: dict[str, Reference] = {}


def register_reference(ref: Reference, *aliases: str) -> Reference:
    for n in (ref.name, *aliases):
        REFERENCES[n] = ref
    return ref


def get_reference(name: str) -> Reference | None:
    """The reference for a rule name (or any alias of that rule), None if there is none."""
    return by_rule_name(REFERENCES, name)


def reference_names() -> list[str]:
    """Every name with a reference (including aliases)."""
    return sorted(REFERENCES)


# -- helpers ----------------------------------------------------------------------------------


def as_f64(x: Any) -> np.ndarray:
    """``x`` as a float64 array (the references compute in float64)."""
    return np.asarray(x, dtype=np.float64)


def paddle_axes(axis: Any, ndim: int) -> tuple[int, ...]:
    """Paddle's axis list: empty (or None) = all axes; negatives count from the end."""
    if axis is None:
        return tuple(range(ndim))
    ax = (axis,) if isinstance(axis, int) else tuple(axis)
    if not ax:
        return tuple(range(ndim))
    out = []
    for a in ax:
        a = int(a)
        if a < 0:
            a += ndim
        if not 0 <= a < max(ndim, 1):
            raise ValueError(f"axis {a} out of range for a {ndim}-D tensor")
        out.append(a)
    return tuple(sorted(set(out)))


def reduce_axes(a: Arrays, ndim: int) -> tuple[int, ...]:
    """A reduction's axes: Paddle's ``axis`` list (checked even then), all of them with ``reduce_all``."""
    ax = paddle_axes(a.get("axis", ()), ndim)
    return tuple(range(ndim)) if a.get("reduce_all", False) else ax


def norm_axis(axis: Any, ndim: int, any_0d: bool = False) -> int:
    """A reference's axis attribute in [0, ndim) (a 0-d tensor takes 0 or -1, any axis with
    ``any_0d``); ValueError else."""
    a = int(axis)
    if ndim == 0:
        if a not in (0, -1) and not any_0d:
            raise ValueError(f"axis {axis} out of range for a 0-d tensor")
        return 0
    if a < 0:
        a += ndim
    if not 0 <= a < ndim:
        raise ValueError(f"axis {axis} out of range")
    return a


# -- formulas written once for numpy and torch ---------------------------------------------------
# The torch kernels (spmdkit.execute.kernels) run the same formulas on torch tensors: they use the
# methods and operators numpy arrays and torch tensors share (``@``, ``.sum(axis=, keepdims=)``,
# ``.reshape``, ``.swapaxes``, indexing, ``abs``, ``%``) and an :class:`ArrayLib` for the rest.


@dataclass(frozen=True)
class ArrayLib:
    """The array functions whose numpy and torch spellings differ: :data:`NUMPY` (the references,
    in float64) and ``spmdkit.execute.kernels._common.TORCH`` (the program's dtype)."""

    #: an input as the library computes on it (numpy: float64)
    array: Callable[[Any], Any]
    #: (values, like): floats in the dtype angles are computed in, on ``like``'s device
    floats: Callable[[Any, Any], Any]
    #: integer indices (int64)
    ints: Callable[[Any], Any]
    #: (x, like): ``x`` in ``like``'s dtype (numpy: ``x`` as it is, everything is float64)
    cast: Callable[[Any, Any], Any]
    concat: Callable[[list[Any], int], Any]
    stack: Callable[[list[Any], int], Any]
    #: (x, n, axis): every element ``n`` times along ``axis``
    repeat: Callable[[Any, int, int], Any]
    sin: Callable[[Any], Any]
    cos: Callable[[Any], Any]
    sqrt: Callable[[Any], Any]
    maximum: Callable[[Any, Any], Any]


NUMPY = ArrayLib(array=as_f64, floats=lambda v, like: np.asarray(v, dtype=np.float64),
                 ints=lambda v: np.asarray(v, dtype=np.int64), cast=lambda x, like: x, concat=np.concatenate,
                 stack=np.stack, repeat=np.repeat, sin=np.sin, cos=np.cos, sqrt=np.sqrt, maximum=np.maximum)


def sum_to_shape(a: Any, shape: Sequence[int]) -> Any:
    """Sum a broadcast gradient back to ``shape`` (numpy broadcasting rules): a numpy array, a
    torch tensor, or anything else as a numpy array."""
    if not hasattr(a, "ndim"):
        a = np.asarray(a)
    lead = a.ndim - len(shape)
    if lead > 0:
        a = a.sum(axis=tuple(range(lead)))
    ax = tuple(i for i, s in enumerate(shape) if s == 1 and a.shape[i] != 1)
    if ax:
        a = a.sum(axis=ax, keepdims=True)
    return a.reshape(tuple(shape))


__all__ = [
    "NUMPY",
    "REFERENCES",
    "ArrayLib",
    "Arrays",
    "Ctx",
    "RefFn",
    "Reference",
    "as_f64",
    "get_reference",
    "norm_axis",
    "paddle_axes",
    "reduce_axes",
    "reference_names",
    "register_reference",
    "sum_to_shape",
]
