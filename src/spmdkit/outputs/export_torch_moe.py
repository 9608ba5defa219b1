"""The experts of a mixture-of-experts plan in the ``torch`` export (:mod:`spmdkit.outputs.export_torch`).

torch's tensor-parallel styles shard ``nn.Linear`` / ``nn.Embedding``; HF's experts module (transformers
5.x: Mixtral's ``MixtralExperts``) holds fused 3-D banks, ``gate_up_proj [E, 2F, H]`` (each expert's
gate rows, then its up rows) and ``down_proj [E, H, F]``, and loops over the experts in its own forward.
The export writes a ``ParallelStyle`` of its own into the file for it (torch's extension point:
``_apply(module, device_mesh)`` with ``distribute_module`` / ``distribute_tensor``), readable there:

- ``ExpertsTensorParallel`` (a megatron plan: the spmdkit program's ``<experts>.gate_up_proj_gate`` /
  ``_up`` ``[E, H, F]`` sharded on F over tp, ``down_proj_t [E, F, H]`` on F, the experts' rows
  partial over tp all-reduced before they are combined): ``gate_up_proj`` ``Shard(1)`` with its rows
  permuted first so that rank r's chunk is ``[gate_r; up_r]`` (``gate_up_to_hf`` undoes it),
  ``down_proj`` ``Shard(2)``; the input read whole and its gradient all-reduced in the backward;
  the rows' outputs all-reduced, then weighted and summed per token on every rank. The router (the
  block's ``gate``) stays a plain replicated module: every rank routes every token alike.
- under sequence parallel (megatron+sp) the plan gathers the MoE block's tokens from the sequence
  shard before the router and slices its output back (strategies.hf: as torchtitan's
  ``PrepareModuleInputOutput`` on its MoE module and Megatron's all-gather dispatcher): the block
  (the experts module's parent, HF's sparse MoE block) gets ``PrepareModuleInputOutput``, input
  ``Shard(1)`` -> ``Replicate()`` (all-gather; its gradient, whole once the experts' input hook
  has all-reduced theirs, sliced back), output ``Replicate()`` -> ``Shard(1)`` (sliced; its
  gradient all-gathered), a sequence-sharded DTensor for the residual add.

Refused by name (:class:`ExportError`): a stack sharded over a mesh dim other than tp and dp (expert
parallelism over ep), split otherwise than on its ffn axis, rows reduced to anything but
``Replicate()`` (reduce-scattered: a block run on tokens sharded over tp, which the style's
whole-row all-reduce does not do), a block whose tokens or output the plan moves otherwise than
``Shard(d)`` -> ``Replicate()`` -> ``Shard(d)``, a module not holding the fused banks.
"""

from __future__ import annotations

from typing import Any

from spmdkit.outputs.export_common import ExportError, _placement_text
from spmdkit.outputs.export_dtensor import _tp_placement
from spmdkit.program.plan import Plan
from spmdkit.strategies.experts import moe_layers
from spmdkit.strategies.hf_moe import moe_ends, moe_projections

#: the spmdkit program's parts of HF's fused banks (the importer's names): part -> (HF's bank, the
#: part's ffn axis in the program's [E, in, out] layout)
PARTS = {"gate_up_proj_gate": ("gate_up_proj", 2), "gate_up_proj_up": ("gate_up_proj", 2),
         "down_proj_t": ("down_proj", 1)}
STYLE = "ExpertsTensorParallel"


def _rows_reduced_to(plan: Plan, rows: str, tp: int) -> Any:
    """Where the plan reduces the experts' partial output over tp: the first reshard of a tensor
    partial over tp on the way from the down projection to ``rows`` (the rows themselves, or the
    down projection's output before its reshape)."""
    prog = plan.program
    producers = {n: i for i, op in enumerate(prog.ops) for n in op.output_names()}
    chain, n = [], rows
    for _ in range(4):
        chain.append(n)
        i = producers.get(n)
        if i is None or prog.ops[i].rule != "reshape":
            break
        x = prog.ops[i].inputs.get("x")
        if not isinstance(x, str):
            break
        n = x
    for r in plan.reshards:
        if r.tensor in chain and _tp_placement(r.src, tp).is_partial():
            return _tp_placement(r.dst, tp)
    return None


def experts_styles(plan: Plan, tp: int | None, modules: dict[int, tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """The experts modules' styles (module path -> style doc) of a plan whose expert stacks are
    sharded over tp (and, under sequence parallel, their MoE blocks' PrepareModuleInputOutput); {} when
    none is. ExportError for what the style does not run (module docstring)."""
    names = plan.mesh.dim_names
    prog = plan.program
    out: dict[str, dict[str, Any]] = {}
    found = moe_projections(prog)
    ends = {prog.ops[m.combine].inputs.get("x"): e for m, e in zip(found, moe_ends(prog, found), strict=True) if e[0]}
    for lay in moe_layers(prog) if any(op.rule == "moe_gate_dispatch" for op in prog.ops) else []:
        sharded = []
        for s in lay.stacks:
            a = plan.attrs[s]
            mod, _, part = s.rpartition(".")
            over = sorted({names[d] for e in a.dims_mapping for d in (e if isinstance(e, tuple) else (e,))
                           if d != -1 and names[d] != "dp"})
            if not over:
                continue
            if over != ["tp"] or tp is None:
                raise ExportError(f"--export torch: {mod}: the plan shards its expert stacks over {', '.join(over)} "
                                  f"({s} {a.dims_mapping}); the export's experts style runs them over tp only "
                                  f"(expert parallelism over ep is not exported yet: --export dtensor states it)")
            pl = _tp_placement(a, tp)
            if part not in PARTS:
                raise ExportError(f"--export torch: {mod}: its expert stack {s} is not one of HF's fused banks "
                                  f"(gate_up_proj [E, 2F, H], down_proj [E, H, F]); the export's experts style "
                                  f"runs those only")
            if not (pl.is_shard() and pl.dim == PARTS[part][1]):
                raise ExportError(f"--export torch: {mod}: the plan holds {s} as {_placement_text(pl)} over tp; the "
                                  f"experts style splits each expert's ffn axis (Shard({PARTS[part][1]}) of it)")
            sharded.append(part)
        if not sharded:
            continue
        mod = lay.stacks[0].rpartition(".")[0]
        if sorted(sharded) != sorted(PARTS):
            raise ExportError(f"--export torch: {mod}: the plan shards {', '.join(sorted(sharded))} over tp and not "
                              f"all of {', '.join(sorted(PARTS))}; the experts style splits them together")
        dst = _rows_reduced_to(plan, lay.rows, tp)  # type: ignore[arg-type]
        if dst is not None and dst.is_shard():
            raise ExportError(f"--export torch: {mod}: the plan reduce-scatters its experts' partial rows {lay.rows} "
                              f"over tp to {_placement_text(dst)} (it runs the MoE block on tokens sharded over "
                              f"tp); the experts style all-reduces whole rows (the block on every token: megatron, "
                              f"with sp, fsdp or zero)")
        if dst is None or not dst.is_replicate():
            raise ExportError(f"--export torch: {mod}: the plan reduces its experts' partial rows {lay.rows} over tp "
                              f"to {'nothing' if dst is None else _placement_text(dst)}; the experts style "
                              f"all-reduces them to Replicate()")
        out[mod] = {"style": STYLE}
        block = _block_style(plan, tp, mod, ends.get(lay.rows)) if tp is not None else None
        if block is not None:
            out[mod.rpartition(".")[0]] = block
    return out


def _made_as(plan: Plan, tp: int, x: str, producers: dict[str, int]) -> Any:
    """The tp placement ``x`` is made in (its producer's output, before any reshard to its readers)."""
    i = producers.get(x)
    if i is None:
        return _tp_placement(plan.attrs[x], tp)
    return _tp_placement(plan.ops[i].outputs[plan.program.ops[i].output_names().index(x)], tp)


def _block_style(plan: Plan, tp: int, experts: str, ends: tuple[list[str], list[str]] | None) -> dict[str, Any] | None:
    """The MoE block's own style under sequence parallel (the experts module's parent: HF's sparse
    MoE block, which runs the router and the experts): the plan gathers the block's tokens from
    the sequence-sharded residual stream before the router and returns its output to sequence
    shards, as torchtitan's ``PrepareModuleInputOutput`` on its MoE module does: input ``Shard(d)``
    -> ``Replicate()`` (all-gather forward; the gradient, whole after the experts' input
    all-reduce, sliced back), output ``Replicate()`` -> ``Shard(d)`` (sliced forward, its gradient
    all-gathered), a ``Shard(d)`` DTensor for the residual add. None without sequence parallel."""
    if ends is None:
        return None
    prog = plan.program
    producers = {n: i for i, op in enumerate(prog.ops) for n in op.output_names()}
    ins, outs = ends
    src, got = _made_as(plan, tp, ins[-1], producers), _tp_placement(plan.attrs[ins[0]], tp)
    dst, made = _tp_placement(plan.attrs[outs[-1]], tp), _made_as(plan, tp, outs[-1], producers)
    if src.is_replicate() and dst.is_replicate():
        return None
    mod = experts.rpartition(".")[0]
    if not (src.is_shard() and got.is_replicate() and made.is_replicate() and dst.is_shard() and src.dim == dst.dim):
        raise ExportError(f"--export torch: {mod}: the plan makes its tokens {ins[-1]} {_placement_text(src)} over tp "
                          f"and reads them {_placement_text(got)}, makes its output {outs[-1]} "
                          f"{_placement_text(made)} and hands it on {_placement_text(dst)}; the export runs a MoE "
                          f"block on every token of the sequence (Shard(1) -> Replicate() before it, back after it)")
    return {"style": "PrepareModuleInputOutput", "input_layouts": _placement_text(src),
            "desired_input_layouts": "Replicate()", "use_local_input": True, "output_layouts": "Replicate()",
            "desired_output_layouts": _placement_text(dst), "use_local_output": False}


STYLE_SOURCE = '''

class ExpertsTensorParallel(ParallelStyle):
    """HF's fused experts module (transformers 5.x: ``gate_up_proj [E, 2F, H]``, each expert's gate rows
    then its up rows; ``down_proj [E, H, F]``; ``act_fn``, ``num_experts``) split over tp on each expert's
    ffn axis F, as the plan splits it (torch.distributed.tensor.parallel has no experts style; this is
    one, written with its extension point ParallelStyle._apply):

    - ``gate_up_proj``: Shard(1) of the bank with its rows permuted first, so that rank r's chunk is
      [gate_r; up_r] (a plain Shard(1) of [gate; up] would give rank 0 all of gate); its global DTensor
      is the permuted bank: ``gate_up_to_hf`` gives HF's layout back (a checkpoint's);
    - ``down_proj``: Shard(2);
    - the input (every token, replicated over tp) is read as it is; its gradient, a partial sum over tp,
      is all-reduced in the backward (the input hook);
    - each (token, chosen expert) row's output, a partial sum over tp, is all-reduced, then weighted by
      the router and summed per token on every rank (the plan combines whole rows, so the router's
      weights get whole gradients).

    The router (the MoE block's ``gate``) stays replicated: every rank routes every token alike.
    """

    def _partition(self, name: str, module: torch.nn.Module, mesh: DeviceMesh) -> None:
        if name:  # the experts module's own banks only (act_fn holds none)
            return
        n = mesh.size()
        bank = module.gate_up_proj.detach()
        e, f2, h = bank.shape
        # [gate; up] -> [gate_0; up_0; gate_1; up_1; ...]: rank r's Shard(1) chunk is [gate_r; up_r]
        bank = bank.view(e, 2, n, f2 // (2 * n), h).transpose(1, 2).reshape(e, f2, h)
        module.register_parameter("gate_up_proj", torch.nn.Parameter(distribute_tensor(bank, mesh, [Shard(1)])))
        module.register_parameter("down_proj",
                                  torch.nn.Parameter(distribute_tensor(module.down_proj.detach(), mesh, [Shard(2)])))

    @staticmethod
    def _input(module: torch.nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        hidden, *rest = inputs
        # forward: the same tensor; backward: its gradient (partial over tp) all-reduced
        hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
        return (hidden, *rest)

    def _apply(self, module: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
        module.tp_mesh = device_mesh
        module.forward = types.MethodType(_experts_tp_forward, module)  # HF's combines inside its expert loop
        return distribute_module(module, device_mesh, self._partition, input_fn=self._input)


def _experts_tp_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """HF's experts forward on this rank's ffn columns: ``hidden_states [T, H]``, the router's
    ``top_k_index`` / ``top_k_weights [T, k]``; returns ``[T, H]``, whole on every rank."""
    gate_up = self.gate_up_proj.to_local()  # [E, 2F/tp, H]: [gate_r; up_r] of each expert
    down = self.down_proj.to_local()  # [E, H, F/tp]
    k = top_k_index.shape[1]
    slots = top_k_index.flatten()
    order = torch.argsort(slots, stable=True)  # the (token, slot) pairs grouped by expert
    tokens = order // k
    counts = torch.bincount(slots, minlength=self.num_experts).tolist()
    x = hidden_states[tokens].split(counts)
    gate, up = torch.cat([torch.nn.functional.linear(x[e], gate_up[e]) for e in range(len(x))]).chunk(2, dim=-1)
    h = (self.act_fn(gate) * up).split(counts)  # [T * k, F/tp]: this rank's columns of each row
    partial = torch.cat([torch.nn.functional.linear(h[e], down[e]) for e in range(len(h))])  # [T * k, H]
    whole = DTensor.from_local(partial, self.tp_mesh, [Partial()], run_check=False)
    whole = whole.redistribute(self.tp_mesh, [Replicate()]).to_local()  # the forward all-reduce
    weighted = whole * top_k_weights.flatten()[order, None]
    return torch.zeros_like(hidden_states).index_add_(0, tokens, weighted.to(hidden_states.dtype))


def gate_up_to_hf(bank: torch.Tensor, tp_size: int) -> torch.Tensor:
    """HF's ``gate_up_proj [E, 2F, H]`` ([gate; up]) from the permuted one ExpertsTensorParallel
    shards (its full_tensor(), or a gradient's)."""
    e, f2, h = bank.shape
    return bank.view(e, tp_size, 2, f2 // (2 * tp_size), h).transpose(1, 2).reshape(e, f2, h)'''


__all__ = ["PARTS", "STYLE", "STYLE_SOURCE", "experts_styles"]
