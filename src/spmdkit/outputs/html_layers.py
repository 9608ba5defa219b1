"""The per-layer section of ``spmdkit plan --html`` (:mod:`spmdkit.outputs.html`): each layer's
communication per step by phase (every reshard times its repeats, the collectives inside ops)
and the memory it holds per device (parameters, gradients, optimizer states, the activations the
backward keeps), as stacked bars."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from spmdkit.cost.compute import kernel_collectives
from spmdkit.cost.memory import Memory, held_for_the_step, local_numel
from spmdkit.outputs.html_figures import PHASE_COLOURS, bars_svg
from spmdkit.outputs.report import fmt_bytes, fmt_time
from spmdkit.program.ir import Program
from spmdkit.program.layers import Layers, program_layers
from spmdkit.program.plan import Plan


def _layer_order(prog: Program, layers: Layers) -> Callable[[str], tuple[int, int, str]]:
    """The sort key of a layer label: the embedding and the labels the forward reaches before the
    first layer, the layers in order, the head and the labels after them, the rest by name."""
    index = {t: k for k, t in enumerate(layers.tags)}
    first_layer = next((k for k, u in enumerate(layers.op_layer) if u >= 0), len(prog.ops))
    seen: dict[str, int] = {}
    for k, op in enumerate(prog.ops):
        if op.phase == "forward":
            seen.setdefault(op.layer, k)

    def key(label: str) -> tuple[int, int, str]:
        if label in index:
            return (1, index[label], label)
        if label in ("embedding", "head"):
            return ({"embedding": 0, "head": 2}[label], 0, label)
        at = seen.get(label)
        if at is None:
            return (3, 0, label)
        return (0 if at < first_layer else 2, at + 1, label)

    return key


def tensor_layers(plan: Plan, layers: Layers | None = None) -> dict[str, str]:
    """Tensor -> the layer label it belongs to: its layer's (:func:`spmdkit.program.layers.program_layers`:
    a preset's ``layer N``, an imported model's ``model.layers.N``), else its producer's label,
    else its first reader's outside the optimizer, else that of the longest dotted prefix naming
    a tensor (``embed.moment1`` -> ``embed``'s), else ``other``."""
    prog = plan.program
    layers = layers or program_layers(prog)
    made: dict[str, str] = {}
    read: dict[str, str] = {}
    for op in prog.ops:
        if op.layer and op.layer != "optimizer":
            for n in op.output_names():
                made.setdefault(n, op.layer)
            for n in op.input_names():
                read.setdefault(n, op.layer)
    out: dict[str, str] = {}
    for n in prog.tensors:
        u = layers.tensor_layer.get(n)
        if u is not None:
            out[n] = layers.tags[u]
            continue
        label = made.get(n) or read.get(n)
        p = n
        while label is None and "." in p:
            p = p.rsplit(".", 1)[0]
            label = made.get(p) or read.get(p)
        out[n] = label or "other"
    return out


def layer_table(plan: Plan, memory: Memory) -> list[dict[str, Any]]:
    """Per layer (program order): communication seconds per phase (every reshard times its
    repeats, the collectives inside ops) and bytes held per device: parameters, gradients,
    optimizer states, activations kept for the backward."""
    prog = plan.program
    layers = program_layers(prog)
    of = tensor_layers(plan, layers)
    rows: dict[str, dict[str, Any]] = {}

    def row(label: str) -> dict[str, Any]:
        return rows.setdefault(label, {"layer": label, "forward": 0.0, "backward": 0.0, "optimizer": 0.0,
                                       "parameters": 0, "gradients": 0, "optimizer_states": 0, "activations": 0})

    pg = plan.param_grads()
    for r in plan.reshards:
        if r.shared:
            continue
        op = prog.ops[r.op_index]
        label = op.layer if op.layer and op.layer != "optimizer" else of[r.tensor]
        row(label)[op.phase if op.phase in ("forward", "backward") else "optimizer"] += r.time_s * plan.repeats(r, pg)
    for k in kernel_collectives(plan):
        op = prog.ops[k.op_index]
        row(op.layer or "other")[op.phase if op.phase in ("forward", "backward") else "optimizer"] += (
            k.time_s * (1 if op.phase == "optimizer" else plan.grad_accum))
    held = held_for_the_step(plan)  # as the framework allocates them (plan.runtime)
    for n, (p, g, st) in held.items():
        r_ = row(of[n])
        r_["parameters"] += p
        r_["gradients"] += g
        r_["optimizer_states"] += st
    for n, t in prog.tensors.items():
        if t.kind == "parameter" and not t.inplace_of and n not in held:
            row(of[n])["parameters"] += local_numel(plan.attrs[n], t.shape) * t.itemsize
    saved = getattr(memory, "saved", None)
    if saved is not None:
        for label, b in saved.per_layer.items():
            row(label or "other")["activations"] += b
    return [rows[k] for k in sorted(rows, key=_layer_order(prog, layers))]


def layers_section(plan: Plan, memory: Memory) -> str:
    table = layer_table(plan, memory)
    if not table:
        return ""
    ck = [("forward", PHASE_COLOURS["forward"]), ("backward", PHASE_COLOURS["backward"]),
          ("optimizer", PHASE_COLOURS["optimizer"])]
    mk = [("parameters", "#4e79a7"), ("gradients", "#f28e2b"), ("optimizer_states", "#59a14f"),
          ("activations", "#b07aa1")]
    comm = [(r["layer"], [r[k] for k, _ in ck],
             f"{r['layer']}: " + ", ".join(f"{k} {fmt_time(r[k])}" for k, _ in ck)) for r in table]
    mem = [(r["layer"], [float(r[k]) for k, _ in mk],
            f"{r['layer']}: " + ", ".join(f"{k.replace('_', ' ')} {fmt_bytes(r[k])}" for k, _ in mk)) for r in table]
    return ('<section id="layers"><h2>Per layer</h2><p>Communication per step (every reshard and collective inside '
            'an op, by the phase it runs in; a gradient\'s reduction counts in its layer) and the memory each layer '
            'holds per device (activations: what the backward keeps).</p><div class="row">'
            + bars_svg("layer-comm", "communication time per layer", comm, ck, fmt_time)
            + bars_svg("layer-memory", "memory per layer, per device", mem, mk, fmt_bytes)
            + "</div></section>")


__all__ = ["layer_table", "layers_section", "tensor_layers"]
