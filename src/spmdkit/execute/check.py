"""Rank 0's verdict on a distributed run (:class:`RunReport`): every tensor the step made,
assembled from the ranks as the plan distributes it, against the single-process step
(:mod:`spmdkit.execute.single`) with the numpy references, each within ``rtol`` / ``atol``
(:func:`check_numpy`); with the torch kernels, each op's outputs against the op run unsharded
on the inputs its ranks received and each reshard against the value it moved, within
:data:`TOLERANCES` of the dtype (:func:`check_torch`); a NaN never passes. The comparison with torch eager fills
:class:`EagerCheck` (:mod:`spmdkit.execute.eager`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from spmdkit.core.dist_attr import TensorDistAttr
from spmdkit.execute.collectives import Collective
from spmdkit.execute.single import as_dtype, call_fallback, run_torch, to_numpy, to_torch
from spmdkit.execute.tolerances import TOLERANCES
from spmdkit.program.ir import Program
from spmdkit.program.plan import Plan
from spmdkit.sim.mesh import AssembleError, arrays_close, assemble, max_abs_error, nonfinite_count
from spmdkit.sim.plan import flat_values, loss_name, op_io, source_values, unusable
from spmdkit.sim.reference import Ctx


@dataclass
class EagerCheck:
    """The distributed step against torch eager on the same inputs and weights: the loss and
    every parameter gradient of the module computed by torch autograd (in ``dtype``), every
    value finite, each tensor's max abs error within ``rtol`` of its scale: the largest
    magnitude of torch's tensor, for a gradient at least a thousandth of the step's largest
    gradient (a gradient that is zero in exact arithmetic, as attention's key bias, is
    rounding noise in torch's float32)."""
    dtype: str
    rtol: float
    loss: float | None = None
    checked: int = 0
    #: the largest max|spmdkit - torch| / scale over the compared tensors (a gradient's relative
    #: L2 error where torch's own half-precision step was given)
    max_rel_error: float = 0.0
    #: the largest relative L2 error of torch's own half-precision step's gradients against its
    #: float32 ones (0 if not run): twice it (at least ``rtol``) bounds the half-precision comparison
    native_error: float = 0.0
    failures: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class RunReport:
    """Rank 0's verdict on a distributed run."""
    world_size: int
    backend: str
    checked: int = 0
    failures: list[tuple[str, str]] = field(default_factory=list)
    loss: float | None = None
    reference_loss: float | None = None
    max_error: float = 0.0
    collectives: list[Collective] = field(default_factory=list)
    expected: list[Collective] = field(default_factory=list)
    collectives_match: bool = False
    #: tensors with a NaN or infinity in the distributed or the single-process value (failures)
    nonfinite: int = 0
    #: the loss tensor (found by its role: :func:`spmdkit.sim.plan.loss_name`)
    loss_tensor: str | None = None
    #: assembled global values of the tensors asked for (``run_rank(keep=...)``)
    values: dict[str, np.ndarray] = field(default_factory=dict)
    #: the comparison with torch eager (``run_rank(eager=...)``), None where not asked for
    eager: EagerCheck | None = None
    #: the kernels the ranks ran ("numpy" float64 references, or "torch" in the program's dtypes)
    kernels: str = "numpy"
    #: the untimed steps run before the timed one (0: the times include first-call overhead)
    warmup: int = 0
    #: --kernels torch: the largest error of a tensor as a fraction of its scale (:func:`check_torch`)
    max_rel_error: float = 0.0
    #: seconds per phase (forward, backward, optimizer: compute, comm) and of the step (wall),
    #: the slowest rank's
    timing: dict[str, dict[str, float]] = field(default_factory=dict)
    #: the plan's prediction of the same (:func:`spmdkit.execute.report.predicted_timing`) and the device it is for
    predicted: dict[str, dict[str, float]] = field(default_factory=dict)
    predicted_on: str = ""
    #: --kernels torch: (tensor, the dist attr it was moved to) of every reshard result checked
    #: against the value it moved: what a reshard delivered to the ranks (not an op's own copy
    #: kept in the op's layout: :attr:`spmdkit.execute.rank.Rank.kept`)
    moved: list[tuple[str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures and self.collectives_match


class Ran(Protocol):
    """What the checks read of a rank that ran the step: the dist attr each tensor ended up with."""
    made: dict[str, TensorDistAttr]


#: (the largest error by dtype, :data:`spmdkit.execute.tolerances.TOLERANCES`, read by the torch-free launcher too)
FLOOR = 1e-2


def program_dtype(prog: Program) -> str:
    """The dtype a program trains in: its parameters' floating dtype (float32 when it has none)."""
    for t in prog.tensors.values():
        if t.kind == "parameter" and t.dtype in TOLERANCES:
            return str(t.dtype)
    return "float32"


def check_torch(rep: RunReport, plan: Plan, pieces: list[Any], me: Ran, seed: int,
                values: dict[str, Any] | None, device: torch.device) -> dict[str, np.ndarray]:
    """``--kernels torch``: what each rank computed, checked against what it received. Every
    op's outputs, assembled from the ranks as the plan distributes them, against the same torch
    kernel run unsharded (on rank 0's device) on the op's inputs as the ranks held them (each
    input assembled from the pieces the ranks read: their own, or what a reshard brought them);
    every reshard's result, assembled, against the value it moved. So an error does not compound
    through the step (a gradient that is zero in exact arithmetic, Adam's ``lr * sign(g)`` of
    it, a router's near-tie: each op sees the bits the ranks saw), and a wrong kernel, a wrong
    collective or a NaN is still caught where it happens.

    Floats within :data:`TOLERANCES` of their dtype or the program's (its parameters'),
    whichever is looser, of their scale (the reference's largest magnitude, at least
    :data:`FLOOR` of the largest of its kind); integers and booleans exactly where the op's
    inputs are exact (no input summed from partial pieces); a reshard that only moves data
    (from a dist attr with no partial sum) exactly; a NaN, or an infinity the reference does not
    have at the same place, never passes. Returns the assembled values."""
    prog = plan.program
    loss = rep.loss_tensor = loss_name(prog)
    base = TOLERANCES.get(program_dtype(prog), 0.0)

    def tolerance(name: str) -> float:  # a float32 upcast in a bfloat16 model carries bfloat16's error
        return max(TOLERANCES.get(prog.tensors[name].dtype, 0.0), base)

    assembled: dict[str, np.ndarray] = {}
    for name, attr in me.made.items():
        if name not in pieces[0][0]:
            continue
        tol = tolerance(name)
        try:
            assembled[name] = assemble([p[0][name] for p in pieces], attr, prog.tensors[name].shape,
                                       rtol=tol, atol=tol)
        except (AssembleError, KeyError) as exc:
            rep.failures.append((name, f"not distributed as {attr}: {exc}"))
    sources = source_values(prog, seed, values)

    def value(n: str) -> Any:
        return assembled[n] if n in assembled else sources.get(n)

    received = _check_reshards(rep, prog, pieces, me, value, tolerance)
    received.update(_kept_copies(rep, prog, pieces, tolerance))
    ref, inexact = _per_op_references(plan, me, value, received, device)
    largest: dict[str, float] = {}
    for n, g in ref.items():
        if g.dtype.kind == "f" and g.size:
            fin = np.isfinite(g)
            if fin.any():
                k = prog.tensors[n].kind
                largest[k] = max(largest.get(k, 0.0), float(np.max(np.abs(g[fin]))))
    worst = 0.0
    for name, g in ref.items():
        if name not in me.made:
            continue
        rep.checked += 1
        got = assembled.get(name)
        if got is None:
            continue  # a failure above
        if _unusable(rep, prog, name, g, loss):
            continue
        if got.shape != g.shape:
            rep.failures.append((name, f"shape {list(got.shape)}, the op's unsharded run's {list(g.shape)}"))
            continue
        if g.dtype.kind != "f" or got.dtype.kind != "f":
            if name not in inexact and not np.array_equal(got, g):
                rep.failures.append((name, "differs from its op run unsharded on the ranks' inputs (exact: integers "
                                           "or booleans from exact inputs)"))
            continue
        rel = _float_error(rep, name, got, g, largest.get(prog.tensors[name].kind, 0.0), tolerance(name),
                           "its op run unsharded on the ranks' inputs")
        worst = max(worst, rel)
    rep.max_rel_error = max(rep.max_rel_error, worst)
    if loss is not None and loss in ref:
        rep.reference_loss = float(np.asarray(ref[loss], dtype=np.float64).sum())
        if loss in assembled:
            rep.loss = float(np.asarray(assembled[loss], dtype=np.float64).sum())
    return assembled


def _float_error(rep: RunReport, name: str, got: np.ndarray, g: np.ndarray, largest: float, tol: float,
                 against: str) -> float:
    """Compare one float tensor with its reference: a failure beyond ``tol`` of its scale (or a
    non-finite value the reference does not have); returns the error as a share of the scale."""
    both = np.isfinite(g) & np.isfinite(got)
    bad_got = int(np.count_nonzero(~both & (got != g)))  # -inf where the reference has -inf is equal
    if bad_got:
        _nonfinite(rep, name, bad_got, got.size)
        return 0.0
    if not g.size or not both.any():
        return 0.0
    d = got[both].astype(np.float64) - g[both].astype(np.float64)
    err = float(np.max(np.abs(d)))
    rep.max_error = max(rep.max_error, err)
    scale = max(float(np.max(np.abs(g[both]))), FLOOR * largest)
    rel = err / scale if scale > 0 else (0.0 if err == 0 else math.inf)
    if rel > tol:
        rms = float(np.linalg.norm(d) / max(float(np.linalg.norm(g[both].astype(np.float64))), 1e-300))
        rep.failures.append((name, f"differs from {against}: max error {err:.3g} is {rel:.3g} of its scale "
                                   f"{scale:.3g} (tolerance {tol:g}); {int(np.count_nonzero(np.abs(d) > tol * scale))} "
                                   f"of {d.size} elements beyond, relative L2 error {rms:.3g}"))
    return rel


def _check_reshards(rep: RunReport, prog: Program, pieces: list[Any], me: Ran, value: Any,
                    tolerance: Any) -> dict[Any, np.ndarray]:
    """Every reshard's result as the ranks received it, assembled in the dist attr it was moved
    to, against the value it moved (exactly where that value had no partial sum: the move only
    copies data); returns the assembled results by their key (tensor, dist attr, phase)."""
    out: dict[Any, np.ndarray] = {}
    for key in (pieces[0][3] if len(pieces[0]) > 3 else {}):
        n, dst = key[0], key[1]
        tol = tolerance(n)
        try:
            got = assemble([p[3][key] for p in pieces], dst, prog.tensors[n].shape, rtol=tol, atol=tol)
        except (AssembleError, KeyError) as exc:
            rep.failures.append((n, f"moved to {dst}: the ranks' pieces are not distributed so: {exc}"))
            continue
        out[key] = got
        rep.moved.append((n, str(dst)))
        want = value(n)
        if want is None:
            continue
        want = np.asarray(want)
        src = me.made.get(n)
        if got.dtype.kind != "f" or src is None or not src.partial:
            same = np.array_equal(got, want.astype(got.dtype, copy=False), equal_nan=got.dtype.kind == "f")
            if not same:
                rep.failures.append((n, f"moved from {src} to {dst}: the value changed (a move of data: exact)"))
        else:
            _float_error(rep, n, got, want, 0.0, tol, f"the value moved from {src} to {dst}")
    return out


def _kept_copies(rep: RunReport, prog: Program, pieces: list[Any], tolerance: Any) -> dict[Any, np.ndarray]:
    """The ops' own outputs kept in their layout for a later reader of it (nothing moved them),
    assembled in that layout by their key (tensor, dist attr, phase): what those readers read."""
    out: dict[Any, np.ndarray] = {}
    for key in (pieces[0][4] if len(pieces[0]) > 4 else {}):
        n, attr = key[0], key[1]
        tol = tolerance(n)
        try:
            out[key] = assemble([p[4][key] for p in pieces], attr, prog.tensors[n].shape, rtol=tol, atol=tol)
        except (AssembleError, KeyError) as exc:
            rep.failures.append((n, f"kept in its op's layout {attr}: the ranks' pieces are not distributed so: {exc}"))
    return out


def _per_op_references(plan: Plan, me: Ran, value: Any, received: dict[Any, np.ndarray],
                       device: torch.device) -> tuple[dict[str, np.ndarray], set[str]]:
    """Each op's torch kernel run unsharded on its inputs as the ranks held them (what they had,
    or what a reshard brought them, assembled): (every output's value, the outputs of ops that
    read an input summed from partial pieces: not bit-exact)."""
    prog = plan.program
    ref: dict[str, np.ndarray] = {}
    inexact: set[str] = set()
    for op_plan in plan.ops:
        got = _op_reference(plan, op_plan, me, value, received, device)
        if got is None:
            continue  # an input the ranks did not make as planned: a failure already
        outs, summed = got
        io_refs = op_io(op_plan, prog).out_refs
        for k, o in enumerate(io_refs):
            if o is not None and k < len(outs) and outs[k] is not None:
                ref[o] = to_numpy(as_dtype(outs[k], prog.tensors[o].dtype))
                if summed:
                    inexact.add(o)
    return ref, inexact


def _op_reference(plan: Plan, op_plan: Any, me: Ran, value: Any, received: dict[Any, np.ndarray],
                  device: torch.device) -> tuple[list[Any], bool] | None:
    """One op's outputs run unsharded on its inputs as the ranks held them, and whether an
    input was summed from partial pieces; None where an input has no assembled value."""
    prog = plan.program
    io = op_io(op_plan, prog)
    summed = False
    named: dict[str, torch.Tensor] = {}

    def fetch(n: str, req: TensorDistAttr | None) -> torch.Tensor:
        nonlocal summed
        have = me.made.get(n, plan.attrs[n])
        if req is None or req == have:
            arr, attr = value(n), have
        else:
            arr, attr = received.get((n, req, op_plan.op.phase if n in plan.storage else "")), req
        if arr is None:
            raise _Unknown(n)
        summed = summed or bool(attr.partial)
        named[n] = to_torch(np.asarray(arr), prog.tensors[n].dtype, device)
        return named[n]
    try:
        args = io.values(fetch)
    except _Unknown:
        return None
    fb = (getattr(prog, "fallbacks", None) or {}).get(op_plan.index)
    if fb is not None:
        return call_fallback(fb, named.__getitem__), summed
    ctx = Ctx(plan.mesh, None, None, io.in_attrs, io.shapes, io.out_ndims, io.out_attrs)
    return list(flat_values(run_torch(op_plan.op, io, args, ctx))), summed


class _Unknown(Exception):
    """An op input with no assembled value (its failure is reported where it was made)."""


def check_numpy(rep: RunReport, prog: Program, pieces: list[Any], made: dict[str, TensorDistAttr],
                ref: dict[str, np.ndarray], want: set[str], rtol: float, atol: float) -> None:
    """``--kernels numpy``: every tensor of the step (``ref``: the single-process step's), assembled
    from the ranks as ``made`` says it is distributed, within ``rtol`` / ``atol`` of the
    single-process value; keeps the assembled values named in ``want`` (``rep.values``) and the
    loss of both runs."""
    loss = rep.loss_tensor
    for name, g in ref.items():
        attr = made.get(name)
        if attr is None:
            continue
        rep.checked += 1
        try:
            got = assemble([p[0][name] for p in pieces], attr, g.shape, rtol=rtol, atol=atol)
        except (AssembleError, KeyError) as exc:
            rep.failures.append((name, f"not distributed as {attr}: {exc}"))
            continue
        if name in want:
            rep.values[name] = got
        if _unusable(rep, prog, name, g, loss):
            continue
        if got.dtype.kind == "f" and got.shape == g.shape and g.size:
            rep.max_error = max(rep.max_error, max_abs_error(got, g))
        bad_got = nonfinite_count(got)
        if bad_got and got.shape == g.shape:  # the reference's -inf (a masked score) at the same place is equal
            bad_got = int(np.count_nonzero(~np.isfinite(got) & (got != g)))
        if bad_got:
            _nonfinite(rep, name, bad_got, got.size)
        elif not arrays_close(got, g, rtol, atol):
            rep.failures.append((name, "differs from the single-process run"))
    if loss is not None and loss in ref and loss in made:
        rep.reference_loss = float(np.asarray(ref[loss]).sum())
        try:
            got = assemble([p[0][loss] for p in pieces], made[loss], ref[loss].shape, rtol=rtol, atol=atol)
            rep.loss = float(np.asarray(got).sum())
        except (AssembleError, KeyError):
            pass  # already a failure above


def _unusable(rep: RunReport, prog: Program, name: str, g: np.ndarray, loss: str | None) -> bool:
    """A single-process value that is NaN or infinite proves nothing: never a pass (a failure)."""
    bad_ref = unusable(prog, name, g, loss)
    if bad_ref:
        rep.nonfinite += 1
        rep.failures.append((name, f"not checkable: the single-process value has {bad_ref} non-finite values "
                                   f"of {g.size}"))
    return bool(bad_ref)


def _nonfinite(rep: RunReport, name: str, bad: int, size: int) -> None:
    rep.nonfinite += 1
    rep.failures.append((name, f"{bad} non-finite values of {size} where the single-process value is finite"))


__all__ = ["FLOOR", "TOLERANCES", "EagerCheck", "Ran", "RunReport", "check_numpy", "check_torch", "program_dtype"]
