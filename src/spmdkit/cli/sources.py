"""The model flags checked into a :data:`spmdkit.models.source.ModelSource`, as ``spmdkit plan``
(under a strategy, ``--auto`` and ``--devices``) checks them."""

from __future__ import annotations

from spmdkit.cli.request import ModelArgs
from spmdkit.core.errors import ProgramError
from spmdkit.models.hf import dtype_name
from spmdkit.models.source import HFModel, ProgramFile
from spmdkit.planner.planning import clip_repr


def check_one_model(m: ModelArgs) -> None:
    """``--hf`` and ``--program`` exclude each other; ``--hf-config`` needs ``--hf``."""
    if m.hf is not None and m.program:
        raise ProgramError("--hf: give either --hf or --program, not both")
    if m.hf is None and m.hf_config is not None:
        raise ProgramError("--hf-config: configures an --hf model; give --hf CLASS too")


def hf_source(m: ModelArgs, layers: int | None, batch: int | None, seq: int | None, *, verify: bool = False,
              name_cut: bool = False) -> HFModel:
    """``--hf CLASS`` with its ``--hf-config`` and ``--dtype``, at ``--batch`` x ``--seq``
    (default 2 x 16); ``--layers`` (and ``--verify``) refused. ``name_cut``: the class name in
    the message cut at 40 characters without saying how long it was (``--devices``)."""
    assert m.hf is not None
    if m.hf_config is None:
        shown = repr(m.hf[:40]) if name_cut else clip_repr(m.hf, 40)
        raise ProgramError(f"--hf {shown}: needs --hf-config FILE|JSON (the model's config)")
    for f, v in (("--layers", layers), ("--verify", verify or None)):
        if v is not None:
            raise ProgramError(f"{f}: does not apply to --hf (set num_hidden_layers in --hf-config)")
    dtype = dtype_name("float32" if m.dtype is None else m.dtype)
    return HFModel(m.hf, m.hf_config, dtype, batch or 2, seq or 16)


def program_source(m: ModelArgs, layers: int | None, batch: int | None, seq: int | None) -> ProgramFile:
    """``--program FILE``; a preset's size flags refused."""
    assert m.program
    given = [f for f, v in (("--layers", layers), ("--batch", batch), ("--seq", seq)) if v is not None]
    if given:
        raise ProgramError(f"{given[0]}: overrides a preset's size; it does not apply to --program")
    return ProgramFile(m.program)


__all__ = ["check_one_model", "hf_source", "program_source"]
