"""DeepSeek's multi-head latent attention (MLA) in the ``torch`` export (:mod:`spmdkit.outputs.export_torch`).

HF's ``DeepseekV3Attention`` makes one rotary key head for all the query heads: ``kv_a_proj_with_mqa``
(replicated over tp: its output is the compressed kv and that key, ``[kv_lora_rank | qk_rope_head_dim]``)
is split, the key rotated and expanded onto the heads (``expand_kv``), which the column-parallel
``q_b_proj`` / ``kv_b_proj`` shard over tp. Each rank thus uses the whole key on its own heads only,
and the key's gradient is a partial sum over tp: the plan all-reduces it (the backward of its
``expand``). torchtitan's DeepSeek-V3 gets the same reduction from DTensor: its ``attention.wkv_a`` is
``NoParallel(use_local_output=False)``, a replicated DTensor output whose gradient DTensor reduces
(torchtitan 9810191^, torchtitan/models/deepseek_v3/infra/parallelize.py: "so that the intermediate
results k is generated as a DTensor and its gradient is correctly handled by the autograd engine").

torch's styles cannot say it: the split, the rotation and the expand run inside HF's attention forward,
and a replicated DTensor there would meet HF's plain cos / sin. So the file writes a style of its own
(torch's extension point ``ParallelStyle._apply``) for the replicated layer: ``GradAllReduceColumns(start,
stop)``, its output unchanged forward, the gradient of output features ``[start, stop)`` (the key's)
all-reduced over tp backward, one all-reduce a layer where the plan has one.
"""

from __future__ import annotations

from typing import Any

from spmdkit.outputs.export_common import ExportError
from spmdkit.outputs.export_dtensor import _tp_placement
from spmdkit.program.ir import Op, Program
from spmdkit.program.plan import Plan

STYLE = "GradAllReduceColumns"


def _key_columns(prog: Program, plan: Plan, tp: int, x: str, mod: str, producers: dict[str, int],
                 modules: dict[int, tuple[str, str]]) -> tuple[str, int, int] | None:
    """(the replicated layer's module, start, stop): the output features of a replicated linear
    layer inside ``mod`` that ``x`` is computed from through the ops of ``mod`` (a split of the
    layer's last axis, then reshapes, slices, the rotation), or None."""
    seen, frontier = set(), [x]
    for _ in range(12):
        nxt = []
        for n in frontier:
            i = producers.get(n)
            if i is None or n in seen:
                continue
            seen.add(n)
            op = prog.ops[i]
            where = modules.get(i, ("", ""))[0]
            if not (where == mod or where.startswith(mod + ".")):
                continue
            if op.rule == "split":
                found = _split_of_layer(prog, plan, tp, op, n, producers, modules)
                if found is not None:
                    return found
            nxt += [v for v in op.input_names() if v in prog.tensors and prog.tensors[v].kind != "parameter"]
        frontier = nxt
    return None


def _split_of_layer(prog: Program, plan: Plan, tp: int, op: Op, n: str, producers: dict[str, int],
                    modules: dict[int, tuple[str, str]]) -> tuple[str, int, int] | None:
    """The feature range part ``n`` of the ``split`` ``op`` takes from a replicated linear layer's output."""
    y = op.inputs.get("x")
    if not isinstance(y, str) or y not in producers or prog.ops[producers[y]].rule != "matmul":
        return None
    j = producers[y]
    w = prog.ops[j].inputs.get("y")
    nd = len(prog.tensors[y].shape)
    axis = op.attrs.get("axis")
    if not (isinstance(w, str) and prog.tensors[w].kind == "parameter" and len(prog.tensors[w].shape) == 2
            and not _tp_placement(plan.attrs[w], tp).is_shard() and axis in (-1, nd - 1)):
        return None
    sections = list(op.attrs.get("sections") or ())
    k = op.output_names().index(n)
    if len(sections) != len(op.output_names()):
        return None
    start = sum(sections[:k])
    return modules.get(j, ("", ""))[0], start, start + sections[k]


def broadcast_key_styles(plan: Plan, tp: int, producers: dict[str, int],
                         modules: dict[int, tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """Module path -> ``GradAllReduceColumns`` style doc for each tensor the plan broadcasts onto
    heads sharded over tp and whose gradient it all-reduces over tp (the backward of an ``expand``):
    the replicated layer it is split from. ExportError naming the tensor where it is not a part of a
    replicated linear layer's output (nothing for the style to hook)."""
    prog = plan.program
    out: dict[str, dict[str, Any]] = {}
    for r, s in plan.collectives("backward"):
        op = prog.ops[r.op_index]
        if op.rule != "expand_grad" or s.kind != "all_reduce" or tp not in s.mesh_dims:
            continue
        x = op.inputs.get("x")
        i = producers.get(x) if isinstance(x, str) else None
        mod = modules.get(i, ("", ""))[0] if i is not None else ""
        found = _key_columns(prog, plan, tp, x, mod, producers, modules) if mod and isinstance(x, str) else None
        if found is None or not found[0]:
            raise ExportError(f"--export torch: {mod or x}: the plan broadcasts {x}, whole over tp, onto heads sharded "
                              f"over tp (expand) and all-reduces its gradient over tp, and {x} is not a split of a "
                              f"replicated linear layer's output in the module: no module boundary for a style to "
                              f"all-reduce it at; not exported")
        layer, start, stop = found
        doc = {"style": STYLE, "start": start, "stop": stop}
        if out.get(layer, doc) != doc:
            raise ExportError(f"--export torch: {layer}: the plan all-reduces the gradients of two parts of its "
                              f"output ({out[layer]['start']}:{out[layer]['stop']} and {start}:{stop}); the style "
                              f"all-reduces one")
        out[layer] = doc
    return out


STYLE_SOURCE = '''

class GradAllReduceColumns(ParallelStyle):
    """A linear layer replicated over tp whose output features [start, stop) go on to heads sharded
    over tp (DeepSeek's MLA: kv_a_proj_with_mqa's rotary key, expanded onto every query head): each
    rank uses them on its own heads, so their gradient is a partial sum over tp, all-reduced here in
    the backward (the output's forward value unchanged; torch.distributed.tensor.parallel has no
    style for it, this is one, written with its extension point ParallelStyle._apply)."""

    def __init__(self, start: int, stop: int) -> None:
        super().__init__()
        self.start, self.stop = start, stop

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        start, stop = self.start, self.stop

        def hook(mod: torch.nn.Module, inputs: Any, out: torch.Tensor) -> torch.Tensor:
            head, key, tail = out[..., :start], out[..., start:stop], out[..., stop:]
            # forward: the same values; backward: their gradient (partial over tp) all-reduced
            key = DTensor.from_local(key, device_mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()])
            return torch.cat([head, key, tail], dim=-1)

        module.register_forward_hook(hook)
        return module'''


__all__ = ["STYLE", "STYLE_SOURCE", "broadcast_key_styles"]
