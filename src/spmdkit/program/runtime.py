"""How a plan's step runs beyond its shardings: the precision of the GEMMs, the framework whose
memory and overlap conventions apply, and whether tensor-parallel communication overlaps the
GEMMs. A plan carries one (:attr:`spmdkit.program.plan.Plan.runtime`); the CLI sets it from
``--precision``, ``--framework`` and ``--tp-comm-overlap``. Standard library only.

- ``precision``: ``fp32``, ``bf16``, ``fp16`` or ``fp8``. ``fp8`` is Transformer Engine's (and
  torchao's float8 linears'): the GEMMs of the linear layers run on the fp8 tensor cores, their
  weights kept in bf16 plus fp8 copies, the rest of the model in bf16. None: the program's own
  parameter dtype.
- ``framework``: ``megatron`` (Megatron-LM / NeMo: DDP or the distributed optimizer, fp32 main
  gradients and master weights) or ``torchtitan`` (FSDP2: fp32 sharded parameters and
  gradients, bf16 compute copies gathered per layer).
- ``tp_comm_overlap``: the tensor-parallel all-gathers and reduce-scatters run under the GEMMs
  that consume or produce them (Megatron's ``--tp-comm-overlap``, torch's async TP).
"""

from __future__ import annotations

from dataclasses import dataclass

from spmdkit.core.errors import ProgramError

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
FRAMEWORKS = ("megatron", "torchtitan")

#: a program dtype -> the precision it computes in
_OF_DTYPE = {"float32": "fp32", "float64": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class Runtime:
    """See the module docstring."""

    precision: str | None = None
    framework: str = "megatron"
    tp_comm_overlap: bool = False

    def __post_init__(self) -> None:
        if self.precision is not None and self.precision not in PRECISIONS:
            raise ProgramError(f"--precision {self.precision[:40]!r}: expected one of {', '.join(PRECISIONS)}")
        if self.framework not in FRAMEWORKS:
            raise ProgramError(f"--framework {self.framework[:40]!r}: expected one of {', '.join(FRAMEWORKS)}")

    def precision_of(self, dtype: str) -> str:
        """The precision the step computes in: ``precision`` if given, else the one of ``dtype``
        (the program's parameter dtype)."""
        return self.precision or _OF_DTYPE.get(dtype, "fp32")

    @property
    def fp8(self) -> bool:
        return self.precision == "fp8"

    def to_json(self) -> dict[str, object]:
        return {"precision": self.precision, "framework": self.framework, "tp_comm_overlap": self.tp_comm_overlap}


def parse_precision(text: str | None) -> str | None:
    """``--precision``: one of :data:`PRECISIONS` (``bfloat16`` / ``float16`` / ``float32`` as
    aliases), None when not given."""
    if text is None:
        return None
    key = text.strip().lower()
    key = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float8": "fp8"}.get(key, key)
    if key not in PRECISIONS:
        raise ProgramError(f"--precision {text[:40]!r}: expected one of {', '.join(PRECISIONS)}")
    return key


__all__ = ["FRAMEWORKS", "PRECISIONS", "Runtime", "parse_precision"]
