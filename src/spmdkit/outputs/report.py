"""The ``spmdkit plan`` report: readable text (rich tables where installed) and JSON."""

from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any, TextIO

from spmdkit.core.dist_attr import TensorDistAttr, entry_dims
from spmdkit.cost.band import error_band
from spmdkit.cost.collectives import NcclCostModel
from spmdkit.cost.compute import KernelCollective, kernel_collectives
from spmdkit.cost.devices import expected_max_normal
from spmdkit.cost.measured import COLLECTIVE_OPS
from spmdkit.cost.memory import Memory, fit_verdict, memory_per_device, uneven_shards
from spmdkit.cost.step import StepEstimate
from spmdkit.io.codec import encode_attr
from spmdkit.outputs.tables import print_table
from spmdkit.planner.auto.explain import LayerChoice
from spmdkit.program.layers import Layers, program_layers
from spmdkit.program.plan import Plan, Reshard

#: The reshard table's columns left out first, in this order, where the terminal is too narrow
#: for them all (``--wide`` prints them; the text of the others wraps).
RESHARD_OPTIONAL = ("where", "collectives", "phase", "times")


@functools.lru_cache(maxsize=4096)
def placements(a: TensorDistAttr) -> str:
    """DTensor-style placements per named mesh dim: ``[dp:S(0), tp:R]`` (P(sum) for partial).
    Cached by the (immutable) attribute: a plan's JSON asks it of every tensor, most alike."""
    names = a.mesh.dim_names
    out = []
    for m, nm in enumerate(names):
        p = "R"
        for axis, e in enumerate(a.dims_mapping):
            if m in entry_dims(e):
                p = f"S({axis})"
        for d, r in a.partial:
            if d == m:
                p = f"P({r.value})"
        out.append(f"{nm}:{p}")
    return "[" + ", ".join(out) + "]"


def fmt_bytes(n: float) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


def fmt_time(s: float) -> str:
    if -5e-8 < s < 0:  # a difference of sums that is zero but for rounding: not "-0.0 us"
        s = 0.0
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def _reshard_key(layers: Layers, plan: Plan, r: Reshard) -> tuple[Any, ...]:
    op = plan.program.ops[r.op_index]
    shape = plan.program.tensors[r.tensor].shape if r.tensor in plan.program.tensors else None
    return (layers.tensor_key(r.tensor), layers.op_key(r.op_index, op.name), r.src, r.dst, r.output, op.phase,
            op.rule, shape)


def step_kinds(plan: Plan, phase: str | None = None, kernel: list[KernelCollective] | None = None) -> Counter[str]:
    """Collective kind -> count over the step (local steps left out), the collectives inside
    ops (``kernel``, :func:`spmdkit.cost.compute.kernel_collectives`) included when given.
    With gradient accumulation the forward and backward ones count ``plan.grad_accum`` times,
    a parameter gradient's reduction once."""
    pg = plan.param_grads()
    c: Counter[str] = Counter()
    for r, s in plan.collectives(phase):
        c[s.kind] += plan.repeats(r, pg)
    for k in kernel or ():
        ph = plan.program.ops[k.op_index].phase
        if phase is None or ph == phase:
            c[k.kind] += 1 if ph == "optimizer" else plan.grad_accum
    return c


def _phase_comm(plan: Plan, kernel: list[KernelCollective], phase: str | None) -> tuple[int, float]:
    """(bytes per rank, seconds) of a phase's reshards and collectives inside ops."""
    prog = plan.program
    rs = [r for r in plan.reshards if phase is None or prog.ops[r.op_index].phase == phase]
    ks = [k for k in kernel if phase is None or prog.ops[k.op_index].phase == phase]
    pg = plan.param_grads()
    rep = [plan.repeats(r, pg) for r in rs]
    krep = [1 if prog.ops[k.op_index].phase == "optimizer" else plan.grad_accum for k in ks]
    return (sum(r.bytes_per_rank * n for r, n in zip(rs, rep)) + sum(k.bytes_per_rank * n for k, n in zip(ks, krep)),
            sum(r.time_s * n for r, n in zip(rs, rep)) + sum(k.time_s * n for k, n in zip(ks, krep)))


def _layer_of(plan: Plan, r: Reshard) -> str:
    return plan.program.ops[r.op_index].layer or "-"


def reshard_groups(plan: Plan) -> list[dict[str, Any]]:
    """The plan's reshards (shared ones left out), one entry per kind: the same tensor of every
    layer, reshaped alike before or after the same op (``times``: how many; ``bytes_per_rank``
    and ``time_s``: their sum over the step)."""
    prog = plan.program
    layers = program_layers(prog)
    groups: dict[tuple[Any, ...], list[Reshard]] = {}
    for r in plan.reshards:
        if r.shared:
            continue
        groups.setdefault(_reshard_key(layers, plan, r), []).append(r)
    out = []
    for rs in groups.values():
        r = rs[0]
        op = prog.ops[r.op_index]
        where = sorted({_layer_of(plan, x) for x in rs})
        layer = where[0] if len(where) == 1 else f"{len(where)} layers"
        if layer == "optimizer":
            layer = "-"
        out.append({"phase": op.phase, "layer": layer, "tensor": layers.fold(r.tensor),
                    "where": ("after " if r.output else "before ") + f"{op.rule} ({layers.fold(op.name)})",
                    "from_to": f"{placements(r.src)} -> {placements(r.dst)}",
                    "collectives": "; ".join(s.describe() for s in r.plan.steps) or "-", "times": len(rs),
                    "bytes_per_rank": sum(x.bytes_per_rank for x in rs), "time_s": sum(x.time_s for x in rs)})
    return out


def _recomputed_layers(mode: str, layers: Sequence[str]) -> str:
    """The layers a ``full:K`` (the first K: ``layer 0 to layer 4``) or ``every:N`` (every N-th,
    named one by one, ``layer 1, layer 3``, the first 4 of more than 5) recomputes; "" for none."""
    if not layers:
        return ""
    if not mode.startswith("every:"):
        return layers[0] + (f" to {layers[-1]}" if len(layers) > 1 else "")
    if len(layers) <= 5:
        return ", ".join(layers)
    return f"{', '.join(layers[:4])} ... {layers[-1]}, {len(layers)} layers"


def memory_rows(mem: Memory, peak_op: str) -> list[list[str]]:
    """The memory table's rows: what is held for the step, the activation peak, what the backward
    keeps, PyTorch's allocated and reserved peaks, and what the GPU holds besides."""
    rows = [["parameters", fmt_bytes(mem.parameters)], ["gradients", fmt_bytes(mem.gradients)],
            ["optimizer states", fmt_bytes(mem.optimizer_states)],
            ["activations (peak)", f"{fmt_bytes(mem.activation_peak)} (at {peak_op})"]]
    saved = getattr(mem, "saved", None)
    if saved is not None and saved.per_layer:
        per = [b for k, b in saved.per_layer.items() if re.search(r"\d", k)]
        which = _recomputed_layers(saved.recompute, saved.layers)
        rows.append([f"kept for the backward (recompute {saved.recompute}" + (f": {which} recomputed)" if which else ")"),
                     fmt_bytes(saved.total) + (f"; {'' if min(per) == max(per) else 'up to '}"
                                               f"{fmt_bytes(max(per))} per layer" if per else "")])
    rows.append(["allocated (peak, torch max_memory_allocated)", fmt_bytes(mem.total)])
    if mem.allocator_reserve or mem.runtime_overhead:
        rows += [["caching allocator's reserve", fmt_bytes(mem.allocator_reserve)],
                 ["reserved (peak, torch max_memory_reserved)", fmt_bytes(mem.reserved)],
                 ["CUDA context and NCCL buffers", fmt_bytes(mem.runtime_overhead)],
                 ["total on the device", fmt_bytes(mem.device_total)]]
    return rows


def verdict_line(mem: Memory, capacity: int, device: str) -> str:
    """'fits with X GiB headroom' / 'does not fit by X GiB' on ``device`` (``capacity`` bytes),
    for what the GPU must hold (:attr:`spmdkit.cost.memory.Memory.device_total`)."""
    _fits, text = fit_verdict(mem.device_total, capacity)
    return f"{text} on a {device}"


def _ranges(idx: list[int]) -> str:
    """``[1, 2, 3, 5]`` -> ``layers 1-3, 5``; ``[4]`` -> ``layer 4``."""
    parts: list[str] = []
    last = -2
    for k in idx:
        if parts and k == last + 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{k}"
        else:
            parts.append(str(k))
        last = k
    return ("layer " if len(idx) == 1 else "layers ") + ", ".join(parts)


def _write_sharding(plan: Plan, layers: Layers, out: TextIO) -> None:
    """The first layer's tensors (and the first of each other structure's, a MoE layer after
    dense ones) and those outside the layers in full, then one line for the other layers: sharded
    as the first of their structure, or which tensors are not (a tensor matched to the first
    layer's by :meth:`spmdkit.program.layers.Layers.tensor_key`)."""
    prog = plan.program
    of = layers.tensor_layer
    shown = ("parameter", "activation")
    firsts: dict[int, int] = {}  # structure -> its first layer
    for i, k in enumerate(layers.kind):
        firsts.setdefault(k, i)
    full = sorted(firsts.values())
    rows = [[t.name, t.kind, str(list(t.shape)), placements(plan.attrs[t.name])] for f in full for n, t in
            prog.tensors.items() if of.get(n) == f and t.kind in shown and not t.inplace_of]
    other = [t for n, t in prog.tensors.items() if n not in of and t.kind in ("input", *shown) and not t.inplace_of]
    rows += [[t.name, t.kind, str(list(t.shape)), placements(plan.attrs[t.name])] for t in other]
    more = f", {_ranges(full[1:])} in full (the first of another structure)" if len(full) > 1 else ""
    if rows:
        print_table(f"Sharding (layer 0 in full{more}, and the tensors outside the layers)",
                    ["tensor", "kind", "shape", "placements"], rows, out, optional=("kind",))
    n = len(layers.tags)
    if n > 1 and len(full) == 1:
        base = {layers.tensor_key(t): plan.attrs[t] for t, u in of.items() if u == 0}
        differ = sorted({t for t, u in of.items() if u > 0 and base.get(layers.tensor_key(t)) != plan.attrs[t]})
        if differ:
            out.write(f"layers 1-{n - 1}: {len(differ)} tensors are sharded otherwise than in layer 0, "
                      f"e.g. {', '.join(differ[:5])}\n\n")
        else:
            out.write(f"layers 1-{n - 1}: every tensor sharded as in layer 0\n\n")
        return
    for k, f in sorted(firsts.items(), key=lambda kf: kf[1]):  # each structure against its first layer
        members = [i for i, kk in enumerate(layers.kind) if kk == k and i != f]
        if not members:
            continue
        base = {layers.tensor_key(t): plan.attrs[t] for t, u in of.items() if u == f}
        group = set(members)
        differ = sorted({t for t, u in of.items() if u in group and base.get(layers.tensor_key(t)) != plan.attrs[t]})
        what = _ranges(members)
        if differ:
            out.write(f"{what}: {len(differ)} tensors are sharded otherwise than in layer {f}, "
                      f"e.g. {', '.join(differ[:5])}\n")
        else:
            out.write(f"{what}: every tensor sharded as in layer {f}\n")
    out.write("\n")


def write_report(plan: Plan, out: TextIO, title: str = "", memory: Memory | None = None,
                 plan_seconds: float | None = None, estimate: StepEstimate | None = None) -> None:
    prog = plan.program
    mesh = plan.mesh
    mem = memory or memory_per_device(plan)
    dims = " x ".join(f"{n}={s}" for n, s in zip(mesh.dim_names, mesh.shape))
    out.write(f"{title or prog.name}\n")
    out.write(f"mesh {dims} ({mesh.size} ranks); {len(prog.ops)} ops "
              f"({sum(1 for o in prog.ops if o.phase == 'forward')} forward, "
              f"{sum(1 for o in prog.ops if o.phase == 'backward')} backward, "
              f"{sum(1 for o in prog.ops if o.phase == 'optimizer')} optimizer), {len(prog.tensors)} tensors; "
              f"propagation converged in {plan.rounds} sweep(s)"
              + (f", planned in {plan_seconds:.2f} s" if plan_seconds is not None else "") + "\n\n")
    if plan.runtime.fp8 and plan.runtime.framework == "torchtitan":
        r = plan.runtime.float8_recipe or "tensorwise"
        out.write(f"float8: torchao's {r} recipe (--float8-recipe {r}; torchtitan's float8.recipe_name)\n\n")
    uneven = uneven_shards(plan)
    if uneven:  # said first, not only at the end of a long report
        u = uneven[0]
        out.write(f"WARNING: uneven shards: {len(uneven)} tensor axes are not divided evenly by their mesh dims "
                  f"(e.g. {u.tensor} axis {u.axis}, size {u.size} in pieces of {u.largest} down to {u.smallest}); "
                  f"listed under 'Uneven shards' below\n\n")
    # -- sharding of the main tensors: the first layer in full
    _write_sharding(plan, program_layers(prog), out)
    # -- reshards
    rows = [[g["phase"], g["layer"], g["tensor"], g["where"], g["from_to"], g["collectives"], f"x{g['times']}",
             fmt_bytes(g["bytes_per_rank"]), fmt_time(g["time_s"])] for g in reshard_groups(plan)]
    if rows:
        print_table("Reshards (one row per kind of reshard; repeated layers counted in 'times')",
               ["phase", "layer", "tensor", "where", "from -> to", "collectives", "times", "bytes/rank", "time"],
               rows, out, optional=RESHARD_OPTIONAL)
    else:
        out.write("No reshards: every op gets its inputs as their producers made them.\n")
    out.write("\n")
    # -- totals
    kernel = kernel_collectives(plan)
    if kernel:
        groups_k: dict[tuple[Any, ...], list[KernelCollective]] = {}
        for k in kernel:
            groups_k.setdefault((k.rule, prog.ops[k.op_index].phase, k.what, k.mesh_dims), []).append(k)
        rows = [[ph, rule, f"all-reduce ({ks[0].reduce_type}), {what}, over "
                 + "x".join(mesh.dim_names[d] for d in dims), f"x{len(ks)}",
                 fmt_bytes(sum(k.bytes_per_rank for k in ks)), fmt_time(sum(k.time_s for k in ks))]
                for (rule, ph, what, dims), ks in groups_k.items()]
        print_table("Collectives inside ops (the kernel communicates; counted in the totals below)",
               ["phase", "op", "collective", "times", "bytes/rank", "time"], rows, out, optional=("op",))
        out.write("\n")
    rows = []
    for phase in ("forward", "backward", "optimizer", None):
        kinds = step_kinds(plan, phase, kernel)
        b, t = _phase_comm(plan, kernel, phase)
        rows.append([phase or "step", ", ".join(f"{k} x{v}" for k, v in sorted(kinds.items())) or "-",
                     fmt_bytes(b), fmt_time(t)])
    each = "ZeRO's gradients reduce-scattered in each" if plan.microstep_reductions() else "gradients reduced once"
    accum = f"; {plan.grad_accum} micro-steps accumulated, {each}" if plan.grad_accum > 1 else ""
    how = "NCCL's algorithms on the device's links, spmdkit.cost.collectives" if isinstance(plan.cost, NcclCostModel) \
        else "alpha-beta estimate, spmdkit.core.reshard"
    print_table(f"Communication per training step ({how}{accum})",
           ["phase", "collectives", "bytes/rank", "time"], rows, out)
    out.write("\n")
    if estimate is not None:
        write_estimate(estimate, out, plan.runtime.grad_overlap)
        out.write("\n")
    print_table(f"Memory per device (as {mem.framework or 'megatron'} allocates it)", ["", "bytes"],
                memory_rows(mem, prog.ops[mem.peak_op].name if prog.ops else "-"), out)
    if estimate is not None and estimate.device.memory_bytes:
        out.write("memory: " + verdict_line(mem, estimate.device.memory_bytes, estimate.device.name) + "\n")
    if uneven:
        names = plan.mesh.dim_names
        out.write(f"\nUneven shards: {len(uneven)} tensor axes are not divided evenly by their mesh dims; "
                  f"the first ranks hold the larger pieces and the memory above counts the largest shard:\n")
        for u in uneven[:10]:
            over = "x".join(f"{names[d]}={plan.mesh.shape[d]}" for d in u.mesh_dims)
            out.write(f"  {u.tensor} axis {u.axis}: size {u.size} over {over}: pieces of {u.largest} "
                      f"down to {u.smallest}\n")
        if len(uneven) > 10:
            out.write(f"  ... and {len(uneven) - 10} more (--json lists them all)\n")


def plan_json(plan: Plan, memory: Memory | None = None, extra: dict[str, Any] | None = None,
              estimate: StepEstimate | None = None) -> dict[str, Any]:
    prog = plan.program
    mem = memory or memory_per_device(plan)
    attrs = plan.attrs
    #: per distinct dist attr its fields, encoded once (most of a model's tensors share a few;
    #: entries share the encoded lists, as nothing but ``json.dumps`` reads this answer)
    encoded: dict[TensorDistAttr, dict[str, Any]] = {}
    tensors = {}
    for n, tensor in prog.tensors.items():
        a = attrs[n]
        e = encoded.get(a)
        if e is None:
            e = encoded[a] = {**encode_attr(a), "placements": placements(a)}
        tensors[n] = {"shape": list(tensor.shape), "dtype": tensor.dtype, "kind": tensor.kind, **e}
    reshards = []
    for r in plan.reshards:
        op = prog.ops[r.op_index]
        reshards.append({"tensor": r.tensor, "op": op.name, "op_index": r.op_index, "phase": op.phase,
                         "layer": op.layer, "output": r.output, "shared": r.shared, "src": encode_attr(r.src),
                         "dst": encode_attr(r.dst), "bytes_per_rank": r.bytes_per_rank, "time_s": r.time_s,
                         "steps": [{"kind": s.kind, "mesh_dims": list(s.mesh_dims),
                                    "bytes_per_rank": s.bytes_per_rank, "time_s": s.time_s} for s in r.plan.steps]})
    kernel = kernel_collectives(plan)
    totals: dict[str, Any] = {}
    for ph in ("forward", "backward", "optimizer", None):
        b, t = _phase_comm(plan, kernel, ph)
        totals[ph or "step"] = {"collectives": dict(step_kinds(plan, ph, kernel)), "bytes_per_rank": b, "time_s": t}
    memory_json = mem.to_json()
    if estimate is not None:
        extra = {**(extra or {}), "step": estimate.to_json()}
        if estimate.device.memory_bytes:  # the text's 'memory: fits with ...' verdict, on the device's memory
            memory_json.update(device_memory=estimate.device.memory_bytes,
                               fits=fit_verdict(mem.device_total, estimate.device.memory_bytes)[0])
    return {"program": prog.name, "mesh": {"shape": list(plan.mesh.shape), "dim_names": list(plan.mesh.dim_names)},
            "rounds": plan.rounds, "ops": len(prog.ops), "grad_accum": plan.grad_accum,
            "runtime": plan.runtime.to_json(), "stored_sharded": sorted(plan.storage), **(extra or {}), "tensors": tensors, "reshards": reshards,
            "totals": totals,
            "kernel_collectives": [k.to_json() for k in kernel], "memory": memory_json, "uneven_shards": [u.to_json() for u in uneven_shards(plan)]}


def fmt_flops(f: float) -> str:
    for unit, k in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if f >= k:
            return f"{f / k:.2f} {unit}"
    return f"{f:.0f} FLOP"


def write_band(device_name: str, out: TextIO, cp: bool = False, moe: bool = False) -> None:
    """The error band of the prediction (:func:`spmdkit.cost.band.error_band`; ``cp``: of a
    context-parallel plan, ``moe``: of one with MoE layers), one line."""
    band = error_band(device_name, cp, moe)
    if band is not None:
        out.write(f"error band: {band.text()}\n")


def ring_note(est: StepEstimate) -> str:
    """Context parallelism's ring attention: its transfers, how much of them the block
    computations hide (spmdkit.cost.context), one line."""
    r = est.ring_json() or {}
    fwd, bwd = r.get("forward") or {}, r.get("backward") or {}
    share = 100 * r.get("exposed_share", 0.0)
    return (f"ring attention over cp={r.get('cp')}: {fmt_time(est.ring_comm_s)} of KV block transfers, "
            f"{fmt_time(est.ring_exposed_s)} exposed ({share:.0f}%); a forward step moves "
            f"{fmt_bytes(fwd.get('block_bytes', 0))} in {fmt_time(fwd.get('step_comm_s', 0.0))} under "
            f"{fmt_time(fwd.get('step_compute_s', 0.0))} of block attention"
            + (f", a backward step {fmt_bytes(bwd.get('block_bytes', 0))} in {fmt_time(bwd.get('step_comm_s', 0.0))}"
               f" under {fmt_time(bwd.get('step_compute_s', 0.0))}" if bwd else ""))


def torch_cp_note(est: StepEstimate) -> str | None:
    """torch's context_parallel's allgather attention (``--framework torchtitan``): the K / V
    all-gather with the query heads, the backward's dK / dV ring (spmdkit.cost.context_torch);
    None where the plan has none."""
    fwd, bwd = est.torch_cp_op("forward"), est.torch_cp_op("backward")
    first = fwd or bwd
    if first is None:
        return None
    text = (f"torch context_parallel over cp={first.cp}: K and V after repeat_kv (x{first.rep}) all-gathered, "
            f"{fmt_bytes(first.gather_bytes)} in {fmt_time(first.gather_s)} under a {fmt_time(first.step_s)} "
            f"local block, {fmt_time(fwd.exposed_s if fwd else 0.0)} exposed a forward op")
    if bwd is not None:
        text += (f"; the backward's fp32 dK / dV ring: {bwd.cp} sends of {fmt_bytes(bwd.dkv_bytes)} in "
                 f"{fmt_time(bwd.dkv_s)} each under {fmt_time(bwd.step_s)} steps, {fmt_time(bwd.exposed_s)} "
                 f"exposed a backward op")
    return text


def context_notes(est: StepEstimate) -> list[str]:
    """The lines on the step's context parallelism, as the report prints them below the step
    (and the HTML page beside its step table): the ring (:func:`ring_note`), torch's
    context_parallel (:func:`torch_cp_note`), the causal imbalance without zig-zag."""
    notes = [ring_note(est)] if est.rings else []
    if est.torch_cp and (t := torch_cp_note(est)) is not None:
        notes.append(t)
    if est.cp_imbalance > 1.0:
        notes.append(f"causal imbalance: without the zig-zag balance the last cp rank computes {est.cp_imbalance:.2f} x "
                     f"the mean attention (every rank waits for it); the zig-zag balance evens it")
    return notes


def moe_load_note(ml: dict[str, Any] | None) -> str | None:
    """``--moe-skew`` / ``--moe-histogram``: the busiest ep rank's tokens over the mean rank's,
    which the step waits for (``ml``: spmdkit.cost.moe.load_summary, a step's or a pipeline's
    ``moe_load``), one line; None under uniform routing."""
    if ml is None:
        return None
    head = f"expert load ({ml['flag']}): "
    if ml["padded"]:
        return head + ("changes nothing: every expert runs its capacity's rows (the model's capacity factor is not 1: "
                       "padded above it, full below it, the tokens past it dropped)")
    if ml["ep"] <= 1:
        return head + ("one rank holds every expert, so its tokens are the mean; its grouped GEMM runs the experts' "
                       "rows as they are (in the step time above)")
    which = f", rank {ml['rank']} (experts {ml['experts'][0]}-{ml['experts'][1]})" if "rank" in ml else ""
    return head + (f"the busiest of the {ml['ep']} ranks the experts are split over{which} receives "
                   f"{ml['load']:.3f} x the mean rank's tokens; its expert GEMMs, activations and all-to-alls carry "
                   f"them in the step time above and the memory (the reshard tables print the uniform bytes)")


def ep_overlap_note(est: StepEstimate) -> str | None:
    """``--ep-comm-overlap`` without a pipeline: the merged steps and what they hide, one line;
    None without it."""
    if est.ep_overlap is None:
        return None
    eo = est.ep_overlap
    m = eo["microbatches"]
    return (f"ep all-to-all overlap (--ep-comm-overlap, no pipeline): {m} microbatch{'' if m == 1 else 'es'} as "
            f"Megatron-Core's combined_1f1b_schedule_for_no_pipelining runs them ({eo['merged_steps']} merged "
            f"forward-and-backward step{'' if eo['merged_steps'] == 1 else 's'}, the first forward and the last "
            f"backward alone; a lone backward hides its dispatch's all-to-all under its weight gradients) hide "
            f"{fmt_time(eo['hidden_s'])} of the {fmt_time(m * eo['a2a_s'])} of expert all-to-alls (in the step time "
            f"above)")


def _hbm_measured(d: Any) -> str:
    """The bandwidth ``spmdkit calibrate`` measured, which memory-bound kernels are timed at
    (Device.hbm_rate), beside the datasheet's."""
    got = d.measured.hbm_gb_per_s if d.measured is not None else None
    return "" if got is None else f" ({got:g} GB/s measured, which the memory-bound ops run at)"


def _links_text(d: Any) -> str:
    """The links as the collectives use them: their bandwidths, or in a scope where ``spmdkit
    calibrate`` measured collectives, those ops at the measured points (the collective model
    interpolates them: spmdkit.cost.collectives.collective_time) and the link for the others."""
    points = d.measured.collectives if d.measured is not None else ()
    if not points:
        return f"in a node {d.intra.bytes_per_s / 1e9:g} GB/s, across {d.inter.bytes_per_s / 1e9:g} GB/s per GPU"
    said = []
    for scope, where, link in (("intra_node", "in a node", d.intra), ("inter_node", "across nodes", d.inter)):
        pts = [p for p in points if p.scope == scope]
        ops = sorted({p.op for p in pts}, key=COLLECTIVE_OPS.index)
        bw = f"{link.bytes_per_s / 1e9:g} GB/s per GPU"
        said.append(f"{where} {bw}" if not pts else
                    f"{where} {', '.join(ops)} as measured ({len(pts)} point{'' if len(pts) == 1 else 's'})"
                    + (f", other ops {bw}" if len(ops) < len(COLLECTIVE_OPS) else ""))
    return "; ".join(said)


def write_estimate(est: StepEstimate, out: TextIO, grad_overlap: bool = True) -> None:
    """The predicted step (spmdkit.cost.step.estimate_step) as a table and a few lines
    (``grad_overlap`` False: ``--no-grad-overlap``, the gradient reductions after the backward)."""
    d = est.device
    peak = est.peak / 1e12
    out.write(f"Device: {d.name}, {peak:g} TFLOP/s dense at the program's dtype, HBM "
              f"{d.hbm_bytes_per_s / 1e9:g} GB/s{_hbm_measured(d)}, {d.ranks_per_node} ranks per node "
              f"({_links_text(d)})\n")
    rows = [[ph, fmt_time(est.compute_s.get(ph, 0.0)), fmt_time(est.comm_s.get(ph, 0.0))]
            for ph in ("forward", "backward", "optimizer")]
    if est.recompute != "none":
        rows.append([f"recomputation ({est.recompute})", fmt_time(est.compute_s.get("recompute", 0.0)),
                     fmt_time(est.comm_s.get("recompute", 0.0))])
    rows.append(["collectives inside ops", "-", fmt_time(est.kernel_comm_s)])
    if est.rings:
        rows.append(["ring attention (KV blocks passed round cp)", "-", fmt_time(est.ring_comm_s)])
    nb = len(est.buckets)
    rows.append([f"gradient reductions ({nb} DDP bucket{'' if nb == 1 else 's'})", "-", fmt_time(est.grad_sync_s)])
    rows.append(["total", fmt_time(est.compute_total_s), fmt_time(est.comm_total_s)])
    print_table("Predicted step per device (compute at the rates the GPU reaches, NCCL's collectives, the "
                "framework's overlaps; spmdkit.cost.step)",
           ["", "compute", "communication"], rows, out)
    exposed = est.step_overlap_s - est.compute_total_s
    how = "with the gradient reductions overlapped with the backward" if grad_overlap else \
        "with the framework's overlaps, the gradient reductions after the last backward (--no-grad-overlap)"
    out.write(f"step time: {fmt_time(est.step_serial_s)} serial, {fmt_time(est.step_overlap_s)} {how} "
              f"({fmt_time(exposed)} of communication exposed)\n")
    for line in (moe_load_note(est.moe_load), ep_overlap_note(est)):
        if line is not None:
            out.write(line + "\n")
    if d.slowdown > 1.0:
        share = est.slowest_gpu_s / est.step_overlap_s if est.step_overlap_s > 0 else 0.0
        out.write(f"slowest GPU: the step waits for the slowest of its {d.gpus} GPUs, expected "
                  f"{expected_max_normal(d.gpus):.2f} standard deviations ({100 * d.rates.speed_sd:.2f}% each, "
                  f"efficiency.speed_sd) slower than the median one: its tensor-core kernels {d.slowdown:.4f} x as "
                  f"long, {fmt_time(est.slowest_gpu_s)} of the compute ({100 * share:.1f}% of the step)\n")
    for note in context_notes(est):
        out.write(note + "\n")
    out.write(f"FLOPs per device: {fmt_flops(est.flops_per_device)} executed "
              f"({fmt_time(est.matmul_s)} on the tensor cores); memory traffic {fmt_bytes(est.bytes_per_device)}\n")
    if est.tokens:
        tps = est.tokens_per_s or 0.0
        mfu = est.mfu or 0.0
        out.write(f"tokens/s: {tps:,.0f} ({est.tokens} tokens per step); MFU {100 * mfu:.1f}% "
                  f"(model FLOPs {fmt_flops(est.model_flops)} = 6 x {est.n_params:,} parameters x tokens + "
                  f"{fmt_flops(est.attention_flops)} attention, over {est.ranks} x {peak:g} TFLOP/s)\n")
        write_band(est.device.name, out, est.cp > 1, est.moe)
        if est.recompute != "none":
            out.write(f"recompute {est.recompute}: {fmt_flops(est.recompute_flops_per_device)} per device run again "
                      f"in the backward; HFU {100 * (est.hfu or 0.0):.1f}% (hardware FLOPs "
                      f"{fmt_flops(est.hardware_flops)}: the recomputed matmuls counted too)\n")
    else:
        out.write("tokens/s and MFU: the program names no token input (tokens / input_ids)\n")
    if est.uncovered:
        out.write("NOT COSTED (no FLOP model for these rules: timed by the bytes they read and write alone): "
                  + ", ".join(f"{r} x{n}" for r, n in sorted(est.uncovered.items())) + "\n")


def explain_table(rows: Sequence[LayerChoice]) -> str:
    """``plan --auto --explain``: per layer, the choice and the best plan choosing otherwise there."""
    lines = ["--explain: per layer (identical layers once), the chosen layouts (forward matmul / embedding: "
             "weight -> output dims_mapping, pN = partial over mesh dim N) and the search's objective (predicted "
             "step) of the best choice where one of them is laid out otherwise"]
    w = max(len(r.layer) for r in rows)
    lines.append(f"  {'layer'.ljust(w)}  {'ops':>4}  {'obj. ms':>9}  {'runner-up':>9}  {'+ms':>8}  chosen | runner-up")
    for r in rows:
        alt = "-" if r.runner_up_s is None else f"{r.runner_up_s * 1e3:9.3f}"
        d = "-" if r.runner_up_s is None else f"{(r.runner_up_s - r.objective_s) * 1e3:+8.3f}"
        lines.append(f"  {r.layer.ljust(w)}  {r.ops:>4}  {r.objective_s * 1e3:9.3f}  {alt:>9}  {d:>8}  "
                     f"{r.chosen or '(no matmul)'} | {r.runner_up}")
    return "\n".join(lines)


__all__ = ["write_band", "RESHARD_OPTIONAL", "context_notes", "ep_overlap_note", "moe_load_note", "explain_table", "fmt_bytes", "fmt_flops", "fmt_time", "placements", "plan_json", "reshard_groups",
           "step_kinds", "write_estimate",
           "write_report"]
