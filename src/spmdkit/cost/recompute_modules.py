"""Which forward ops a recomputation policy runs again, per transformer layer: Megatron-Core's
fine-grained selective recomputation (``--recompute selective:M1,M2,...``) and torchtitan's
op-level policy (:func:`op_sac`). :func:`spmdkit.cost.memory_saved.recompute_regions` calls these.

``selective:M1,M2,...`` is Megatron-Core's ``--recompute-granularity selective
--recompute-modules M1 M2 ...`` (``TransformerConfig.recompute_modules``,
megatron/core/transformer/transformer_config.py). The modules (:data:`MODULES`), each found
in a numbered layer's forward ops by structure (rules, parameters, the MoE ops), not by names:

- ``core_attn``: the attention core (``--recompute selective``'s regions: the scores to the
  product with V, or the ``flash_attention`` kernel).
- ``layernorm``: the layer's input_layernorm and pre_mlp_layernorm (TransformerLayer.__init__'s
  ``recompute_input_layernorm`` / ``recompute_pre_mlp_layernorm``, run under
  ``tensor_parallel.CheckpointWithoutOutput``, transformer_layer.py): a normalisation
  (:data:`NORMS`) of the residual stream (its x made before the layer, or by an ``add``);
  a norm of q or of a latent (MLA's q_norm / kv_norm) is not one. Its output and statistics
  are not kept; its input is (the norm's own gradient reads it anyway), so this saves exactly
  the norms' outputs and runs the norms' forward again.
- ``mlp``: the dense MLP (``recompute_mlp``, ``tensor_parallel.checkpoint(self.mlp, ...)``,
  set only where the layer's MLP is not a MoELayer): the forward ops fed by the
  pre-MLP norm's output, less the residual add and Megatron's bias-dropout-add (a ``dropout``
  after the MLP), in a layer without MoE ops (:data:`MOE_OPS`).
- ``moe``: the whole MoE layer (MoELayer's ``moe_layer_recompute``,
  megatron/core/transformer/moe/moe_layer.py, ``tensor_parallel.checkpoint`` of its forward):
  the same ops in a layer with MoE ops (router, dispatch, experts, combine, shared experts).
- ``moe_act``: the routed experts' activation function (``activation_recompute`` of GroupedMLP /
  TEGroupedMLP / SequentialMLP, megatron/core/transformer/moe/experts.py, under
  ``CheckpointWithoutOutput``): the ops between an expert matmul (a parameter of rank >= 3,
  the experts' stacked weights) and the next one.
- ``shared_experts``: the MoE layer's shared experts (SharedExpertMLP,
  megatron/core/transformer/moe/shared_experts.py, ``tensor_parallel.checkpoint`` of its forward
  where ``shared_experts`` is named): the MoE block's ops that neither feed the MoE ops (the
  router) nor are fed by them or by the router.
- ``mla_up_proj``: MLA's up projections to the attention kernel (MLASelfAttention's
  ``recompute_up_proj``, megatron/core/transformer/multi_latent_attention.py,
  ``get_query_key_value_tensors``: ``qkv_up_checkpoint = tensor_parallel.CheckpointWithoutOutput()``
  runs its ``qkv_up_proj_and_rope_apply(q_compressed, kv_compressed, k_pos_emb, ...)``: the q
  and kv up projections, the splits of q / kv per head, the rope of q's and k's rotary parts,
  k's rope part expanded to the heads and the concats, whose query / key / value it does not
  keep): the ops on a path to the attention kernel's inputs back from the kernel, stopping at
  the norms (the latent norms and the input norm stay outside, as the ``q_layernorm`` /
  ``kv_layernorm`` applied before the checkpoint) and at the op that makes a norm's input (the
  split of the kv latent from k's rope part: k_pos_emb is the checkpoint's input); found where
  such a path holds a ``matmul`` of a latent norm's output (a norm not of the residual stream)
  by a parameter: an up projection. The latents and k_pos_emb are kept, q, k and v are not.

A region's outputs are not kept and its inputs are; regions of one layer that share an op or
feed one another are merged (``layernorm`` with ``mlp`` / ``moe``: the norm's output is the
MLP's input, which Megatron's checkpoints then hold as no tensor). A named
module that no layer has (``moe_act`` of a dense model) is refused, not ignored.
"""

from __future__ import annotations

from spmdkit.core.errors import ProgramError
from spmdkit.program.ir import Program

#: the modules of ``selective:M1,M2,...`` (Megatron-Core's recompute_modules, every one)
MODULES = ("core_attn", "layernorm", "mlp", "moe", "moe_act", "shared_experts", "mla_up_proj")
#: the normalisation rules (a layer's norms)
NORMS = frozenset({"layer_norm", "rms_norm", "fused_rms_norm"})
#: the ops only a MoE block has
MOE_OPS = frozenset({"moe_gate_dispatch", "moe_combine"})
_PREFIX = "selective:"
_WHAT = {"core_attn": "an attention core", "layernorm": "a norm of the residual stream",
         "mlp": "a dense MLP (a layer with MoE ops has moe)", "moe": "a MoE block (moe_gate_dispatch, moe_combine)",
         "moe_act": "an expert activation (between expert matmuls, weights of rank >= 3)",
         "shared_experts": "shared experts (MoE-block ops apart from the routing)",
         "mla_up_proj": "an MLA up projection (a matmul of a latent norm's output feeding the attention kernel)"}


def recompute_modules(mode: object) -> tuple[str, ...] | None:
    """The modules of ``selective:M1,M2,...`` (in the order given, once each), None for another
    mode; a ProgramError naming ``--recompute`` and the module where one is not in :data:`MODULES`."""
    if not (isinstance(mode, str) and mode.startswith(_PREFIX)):
        return None
    names = [m.strip() for m in mode[len(_PREFIX):].split(",")]
    for m in names:
        if m not in MODULES:
            raise ProgramError(f"--recompute {mode[:80]}: module {m[:40]!r} is not a module; expected modules among "
                               f"{', '.join(MODULES)} (Megatron-Core's --recompute-modules)")
    return tuple(dict.fromkeys(names))


#: the ops whose outputs torchtitan's op-level selective checkpointing saves (besides every
#: other linear layer's matmul): the attention kernels
_SAC_SAVED = frozenset({"flash_attention"})


def op_sac(prog: Program, layer: list[int]) -> list[int]:
    """torchtitan's op-level selective activation checkpointing (``selective_ac_option = "op"``,
    torchtitan/models/llama/parallelize_llama.py): a layer keeps the outputs of its attention
    kernel and of its 1st, 3rd, 5th ... linear-layer matmul (``aten.mm``; every second one is
    recomputed) and runs everything else again in the backward."""
    region: list[int] = []
    mm = 0
    for i in layer:
        op = prog.ops[i]
        y = op.inputs.get("y")
        if op.rule == "matmul" and isinstance(y, str) and prog.tensors[y].kind == "parameter":
            mm += 1
            if mm % 2 == 1:
                continue
        elif op.rule in _SAC_SAVED:
            continue
        region.append(i)
    return region


def _residual_norms(prog: Program, layer: list[int], made_by: dict[str, int]) -> list[int]:
    """The layer's norms of the residual stream (x made before the layer or by an ``add``)."""
    out = []
    for i in layer:
        op = prog.ops[i]
        x = op.inputs.get("x")
        if op.rule in NORMS and isinstance(x, str) and (x not in made_by or prog.ops[made_by[x]].rule == "add"):
            out.append(i)
    return out


def _ffn_block(prog: Program, layer: list[int], norm: int) -> list[int]:
    """The ops fed (within ``layer``) by the pre-MLP norm ``norm``'s output, less those that read
    the residual stream (the norm's input: the residual add) and the dropouts (Megatron's
    bias-dropout-add) with what reads them."""
    resid = prog.ops[norm].inputs["x"]
    reached = {prog.ops[norm].output_names()[0]}
    block = []
    for i in layer:
        op = prog.ops[i]
        if i <= norm or op.rule == "dropout":
            continue
        ins = op.input_names()
        if resid in ins or not any(n in reached for n in ins):
            continue
        block.append(i)
        reached.update(op.output_names())
    return block


def _expert_act(prog: Program, block: list[int]) -> list[int]:
    """The ops of ``block`` on a path from an expert matmul's output to an expert matmul's input
    (an expert matmul: a ``matmul`` whose y is a parameter of rank >= 3)."""
    def expert(i: int) -> bool:
        y = prog.ops[i].inputs.get("y")
        return (prog.ops[i].rule == "matmul" and isinstance(y, str) and prog.tensors[y].kind == "parameter"
                and len(prog.tensors[y].shape) >= 3)
    fed: set[str] = set()
    cand = []
    for i in block:
        if expert(i):
            fed.update(prog.ops[i].output_names())
        elif any(n in fed for n in prog.ops[i].input_names()):
            cand.append(i)
            fed.update(prog.ops[i].output_names())
    need = {n for i in block if expert(i) for n in prog.ops[i].input_names()}
    act = []
    for i in reversed(cand):
        if any(n in need for n in prog.ops[i].output_names()):
            act.append(i)
            need.update(prog.ops[i].input_names())
    return sorted(act)


def _shared(prog: Program, block: list[int]) -> list[int]:
    """The ops of a MoE ``block`` apart from its routing: those that feed no MoE op (the router
    does) and read nothing a MoE op or the router made (the combine, the aux loss do)."""
    need = {n for i in block if prog.ops[i].rule in MOE_OPS for n in prog.ops[i].input_names()}
    routing = set()
    for i in reversed(block):
        if prog.ops[i].rule in MOE_OPS or any(n in need for n in prog.ops[i].output_names()):
            routing.add(i)
            need.update(prog.ops[i].input_names())
    fed = {n for i in routing for n in prog.ops[i].output_names()}
    out = []
    for i in block:
        if i in routing or any(n in fed for n in prog.ops[i].input_names()):
            fed.update(prog.ops[i].output_names())
        else:
            out.append(i)
    return out


def _mla_up(prog: Program, layer: list[int], made_by: dict[str, int], norms: list[int], core: list[int]) -> list[int]:
    """MLA's up projections to the attention kernel (``core[0]``; module docstring): the layer's
    ops on a path back from the kernel's inputs, stopping at the norms and at the ops that make a
    norm's input; [] where none of them is a ``matmul`` of a latent norm's output by a parameter."""
    if not core:
        return []
    latent = {i for i in layer if prog.ops[i].rule in NORMS and i not in norms}
    stop = latent | set(norms) | {made_by[n] for i in latent for n in prog.ops[i].input_names() if n in made_by}
    latent_out = {prog.ops[i].output_names()[0] for i in latent}
    need = set(prog.ops[core[0]].input_names())
    region = []
    for i in reversed([j for j in layer if j < core[0]]):
        if i not in stop and any(n in need for n in prog.ops[i].output_names()):
            region.append(i)
            need.update(prog.ops[i].input_names())
    up = any(prog.ops[i].rule == "matmul" and prog.ops[i].inputs.get("x") in latent_out
             and prog.tensors[str(prog.ops[i].inputs.get("y"))].kind == "parameter" for i in region)
    return sorted(region) if up else []


def _merged(prog: Program, parts: list[list[int]]) -> list[list[int]]:
    """``parts`` with those that share an op or feed one another merged (op indices sorted)."""
    def outs(s: set[int]) -> set[str]:
        return {n for i in s for n in prog.ops[i].output_names()}

    def ins(s: set[int]) -> set[str]:
        return {n for i in s for n in prog.ops[i].input_names()}

    sets = [set(p) for p in parts if p]
    k = 0
    while k < len(sets):
        a = sets[k]
        other = next((j for j in range(k + 1, len(sets))
                      if a & sets[j] or ins(a) & outs(sets[j]) or ins(sets[j]) & outs(a)), None)
        if other is None:
            k += 1
        else:
            a |= sets.pop(other)
            k = 0  # the grown set against every other again
    return sorted((sorted(s) for s in sets), key=lambda r: r[0])


def module_regions(prog: Program, groups: list[list[int]], modules: tuple[str, ...],
                   cores: list[list[int]], mode: str) -> list[list[int]]:
    """The regions of ``selective:M1,...`` (module docstring): per layer group (its forward ops),
    the ops of each named module, merged where they touch; ``cores``: the attention cores
    (``selective``'s regions). A ProgramError naming ``--recompute`` and a module no layer has."""
    found = dict.fromkeys(modules, False)
    regions: list[list[int]] = []
    for layer in groups:
        made_by = {n: i for i in layer for n in prog.ops[i].output_names()}
        norms = _residual_norms(prog, layer, made_by)
        block = _ffn_block(prog, layer, norms[1]) if len(norms) >= 2 else []
        moe = any(prog.ops[i].rule in MOE_OPS for i in block)
        members = set(layer)
        core = [r for r in cores if r[0] in members]
        parts = {"core_attn": core,
                 "layernorm": [[i] for i in norms],
                 "mlp": [block] if block and not moe else [],
                 "moe": [block] if moe else [],
                 "moe_act": [_expert_act(prog, block)] if moe else [],
                 "shared_experts": [_shared(prog, block)] if moe else [],
                 "mla_up_proj": [_mla_up(prog, layer, made_by, norms, core[0] if core else [])]}
        chosen = []
        for m in modules:
            got = [p for p in parts[m] if p]
            found[m] = found[m] or bool(got)
            chosen += got
        regions += _merged(prog, chosen)
    missing = [m for m, f in found.items() if not f]
    if missing:
        raise ProgramError(f"--recompute {mode[:80]}: module {missing[0]!r}: no numbered layer has "
                           f"{_WHAT[missing[0]]}")
    return regions


__all__ = ["MODULES", "MOE_OPS", "NORMS", "module_regions", "op_sac", "recompute_modules"]
