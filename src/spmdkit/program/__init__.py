"""spmdkit.program: whole-model planning.

``program`` (the IR, builder, JSON format), ``zoo`` (GPT-2 / LLaMA training steps),
``strategy`` (data / tensor / sequence parallel and ZeRO as annotations), ``propagate``
(graph propagation and reshard planning), ``memory`` (bytes per device), ``report`` (the
``spmdkit plan`` report) and ``simulate`` (the end-to-end numeric check, needs numpy).
"""

from spmdkit.program.ir import Op, Program, ProgramBuilder, Tensor, load_program, program_from_json

__all__ = ["Op", "Program", "ProgramBuilder", "Tensor", "load_program", "program_from_json"]
