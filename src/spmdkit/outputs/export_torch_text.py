"""The text of the ``torch`` export's file (:mod:`spmdkit.outputs.export_torch`): its docstring header,
its constants (``MESH_DIMS`` ... ``PLAN_COLLECTIVES``, ``DATA_PARALLEL``, ``DP_COLLECTIVES``, with the
collectives the plan issues over tp and FSDP2 over dp, in the terms ``CommDebugMode`` counts), the
helper functions it defines (``_conv1d_as_linear``, ``fused_order``, ``_fused_per_rank``,
``_heads_per_rank``, ``_reduce_partial_grads_once``) and its ``parallelize``."""

from __future__ import annotations

import re
import textwrap
from collections import Counter
from typing import Any

from spmdkit.outputs.export_torch_pp import FUNCOL, pipeline_constants, pipeline_dp_lines
from spmdkit.outputs.export_torch_run import recomputed_collectives
from spmdkit.program.plan import Plan


def tp_collectives(plan: Plan, torch_local: frozenset[str] = frozenset(),
                   scaled: frozenset[str] = frozenset()) -> dict[str, dict[str, int]]:
    """The plan's collectives over tp per phase (forward, backward), by the functional
    collective CommDebugMode counts: the reshards the model's modules run. A parameter gradient
    the plan reduces over tp in its gradient sync (a replicated norm weight under sequence
    parallel: partial over tp) is reduced by DTensor in torch's backward: counted there; those of
    ``torch_local`` (a row layer's bias under sequence parallel: ``_ROW_BIAS_DOC`` says why) are not;
    the reduce-scatter of a lookup in ``scaled`` is torch's all-reduce (``_SCALED_DOC``)."""
    names = plan.mesh.dim_names
    out: dict[str, dict[str, int]] = {}
    for phase in ("forward", "backward"):
        c = Counter(FUNCOL["all_reduce" if s.kind == "reduce_scatter" and r.tensor in scaled else s.kind]
                    if s.kind in FUNCOL else s.kind for r, s in plan.collectives(phase)
                    if any(names[d] == "tp" for d in s.mesh_dims)
                    and not (s.kind == "all_reduce" and r.tensor.removesuffix(".grad") in torch_local))
        if phase == "backward":
            c.update("all_reduce" for r, s in plan.collectives("optimizer")
                     if s.kind == "all_reduce" and any(names[d] == "tp" for d in s.mesh_dims)
                     and r.tensor.removesuffix(".grad") not in torch_local)
        out[phase] = dict(sorted(c.items()))
    return out


def dp_collectives(dp: dict[str, Any] | None, layers: int) -> dict[str, dict[str, int]]:
    """What FSDP2 issues over dp per step, as CommDebugMode counts its c10d ops: one collective per
    group (each block, then the root): ``fully_shard`` all-gathers each group's parameters in the
    forward (``_allgather_base_``), again in the backward where it resharded after the forward
    (the blocks under ZeRO-3; the root keeps its own), and reduce-scatters each group's gradients
    (``_reduce_scatter_base_``); ``replicate`` all-reduces each group's gradients (``allreduce_``).
    The plan counts one collective per parameter: FSDP2 buckets them per group."""
    if dp is None:
        return {}
    groups = layers + 1
    if dp["wrap"] == "replicate":
        return {"forward": {}, "backward": {"allreduce_": groups}}
    back = {"_allgather_base_": layers} if dp["reshard_after_forward"] and layers else {}
    return {"forward": {"_allgather_base_": groups}, "backward": {**back, "_reduce_scatter_base_": groups}}


def file_header(plan: Plan, command: str, dims: tuple[str, ...], shape: tuple[int, ...],
            priced: list[str] | None = None) -> list[str]:
    where = " x ".join(f"{n}={s}" for n, s in zip(dims, shape))
    out = [f'"""The plan of {plan.program.name or "a model"} on mesh {where}, applied with torch\'s own parallel APIs.', ""]
    if command:
        out += ["Written by::", "", "    " + command, ""]
    out += [*(priced or []), ""] if priced else []
    out += ["Use (every rank, under torchrun)::", "",
            "    mesh = init_device_mesh(\"cuda\", MESH_SHAPE, mesh_dim_names=MESH_DIMS)",
            "    model = parallelize(model, mesh)",
            "    with loss_parallel() if LOSS_PARALLEL else contextlib.nullcontext():",
            "        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())",
            "        loss.backward()",
            "",
            "With a pipeline (PIPELINE not None): ``schedule = build_pipeline(model, mesh, loss_fn, device)``, then",
            "``schedule.step(...)`` per step.",
            '"""', ""]
    return out


def file_notes(notes: list[str]) -> list[str]:
    seen: list[str] = []
    for n in notes:
        g = re.sub(r"\.\d+\.", ".*.", n)
        g = re.sub(r"(?<=output )\S+", "", g).replace("output  is", "output is")
        if g not in seen:
            seen.append(g)
    return [line for n in seen for line in textwrap.wrap(n, 100, initial_indent="# ", subsequent_indent="#   ")]


def _dp_lines(dp: dict[str, Any] | None, pipe: dict[str, Any] | None = None) -> list[str]:
    """``parallelize``'s data-parallel lines. A pipeline stage whose forward the file writes out
    (GPT-2's: the root's forward is not called, nor its FSDP2 hooks) wraps each module it holds
    outside the blocks as a group of its own."""
    if dp is None:
        return []
    wrap, raf = dp["wrap"], dp["reshard_after_forward"]
    kw = f", reshard_after_forward={raf}" if wrap == "fully_shard" else ""
    out = [f"    dp = mesh[{dp['mesh_dim']!r}]"]
    if dp["layers"]:
        out += [f"    for block in model.get_submodule({dp['layers']!r}):",
                f"        {wrap}(block, mesh=dp{kw})"]
    if pipe is not None and pipe.get("body"):
        out += ["    for name in PIPELINE[\"ends\"]:  # the stage's forward calls them, not the root's",
                "        if not isinstance(model.get_submodule(name), torch.nn.Identity):",
                f"            {wrap}(model.get_submodule(name), mesh=dp{kw})"]
    out.append(f"    {wrap}(model, mesh=dp{', reshard_after_forward=False' if wrap == 'fully_shard' else ''})")
    return out


CONV1D_FN = [
    "", "", "def _conv1d_as_linear(model: torch.nn.Module) -> None:",
    "    \"\"\"Swap each module CONV1D_AS_LINEAR names for the nn.Linear it equals.\"\"\"",
    "    for name, conv in list(model.named_modules()):",
    "        if not any(fnmatch.fnmatchcase(name, p) for p in CONV1D_AS_LINEAR):",
    "            continue",
    "        n_in, n_out = conv.weight.shape",
    "        linear = torch.nn.Linear(n_in, n_out, bias=conv.bias is not None, device=conv.weight.device,",
    "                                 dtype=conv.weight.dtype)",
    "        with torch.no_grad():",
    "            linear.weight.copy_(conv.weight.t())",
    "            if conv.bias is not None:",
    "                linear.bias.copy_(conv.bias)",
    "        owner, leaf = name.rsplit(\".\", 1)",
    "        setattr(model.get_submodule(owner), leaf, linear)"]
#: Without a dp wrap (FSDP2 reduces them over the mesh), a SequenceParallel module's replicated weight
#: gets a Partial gradient over tp, which DTensor keeps as it is: each optimizer op reading it would
#: all-reduce it again (AdamW: 3 a step), where the plan all-reduces it once before the update.
GRADS_ONCE_FN = [
    "", "", "def _reduce_partial_grads_once(model: torch.nn.Module) -> None:",
    "    \"\"\"Each replicated DTensor parameter's Partial gradient (a SequenceParallel norm's weight over",
    "    tp) all-reduced once as it is accumulated, as the plan does, not at each optimizer op reading it.\"\"\"",
    "    from torch.distributed.tensor import DTensor",
    "",
    "    def once(p: torch.Tensor) -> None:",
    "        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):",
    "            p.grad = p.grad.redistribute(placements=p.placements)",
    "",
    "    for p in model.parameters():",
    "        if isinstance(p, DTensor) and all(pl.is_replicate() for pl in p.placements):",
    "            p.register_post_accumulate_grad_hook(once)"]
FUSED_FN = [
    "", "", "def fused_order(sizes: tuple[int, ...], tp: int) -> list[int]:",
    "    \"\"\"The order of a fused weight's output features that makes rank r's contiguous block (what",
    "    ColwiseParallel gives it) its share of every part: row i of the reordered weight is row",
    "    order[i] of the original ([q_0 | k_0 | v_0 | q_1 | k_1 | v_1 ...] for GPT-2's c_attn).\"\"\"",
    "    starts = [sum(sizes[:k]) for k in range(len(sizes))]",
    "    return [s + r * (n // tp) + j for r in range(tp) for s, n in zip(starts, sizes) for j in range(n // tp)]",
    "", "", "def _fused_per_rank(model: torch.nn.Module, tp: int) -> None:",
    "    \"\"\"Reorder each FUSED_QKV module's output features (weight rows and bias, fused_order) and make the",
    "    attention module holding it run its rank's heads: HF's GPT2Attention splits c_attn's output by",
    "    split_size (and keeps num_heads): both divided by tp (head_dim stays); Phi3Attention slices",
    "    qkv_proj's by its config's heads and its num_key_value_heads: those divided by tp.\"\"\"",
    "    for name, linear in list(model.named_modules()):",
    "        sizes = next((v for k, v in FUSED_QKV.items() if fnmatch.fnmatchcase(name, k)), None)",
    "        if sizes is None:",
    "            continue",
    "        order = torch.tensor(fused_order(sizes, tp), device=linear.weight.device)",
    "        with torch.no_grad():",
    "            linear.weight.copy_(linear.weight[order])",
    "            if linear.bias is not None:",
    "                linear.bias.copy_(linear.bias[order])",
    "        attention = model.get_submodule(name.rsplit(\".\", 1)[0])",
    "        for attr in (\"split_size\", \"num_heads\"):",
    "            if hasattr(attention, attr):",
    "                if getattr(attention, attr) % tp:",
    "                    raise ValueError(f\"{name}: {attr} {getattr(attention, attr)} is not divisible by tp {tp}\")",
    "                setattr(attention, attr, getattr(attention, attr) // tp)",
    "        if hasattr(attention, \"num_key_value_heads\") and hasattr(attention, \"config\"):",
    "            # Phi-3's attention slices qkv_proj's output at config.num_attention_heads * head_dim and",
    "            # self.num_key_value_heads * head_dim: its own copy of the config, both divided by tp",
    "            conf = copy.copy(attention.config)",
    "            for owner, attr in ((conf, \"num_attention_heads\"), (attention, \"num_key_value_heads\")):",
    "                if getattr(owner, attr) % tp:",
    "                    raise ValueError(f\"{name}: {attr} {getattr(owner, attr)} is not divisible by tp {tp}\")",
    "                setattr(owner, attr, getattr(owner, attr) // tp)",
    "            attention.config = conf"]
VOCAB_FN = [
    "", "", "def _check_vocab(model: torch.nn.Module) -> None:",
    "    \"\"\"The model's input embedding has VOCAB_PADDING's padded rows, as the plan does.\"\"\"",
    "    rows = model.get_input_embeddings().weight.shape[0]",
    "    if rows != VOCAB_PADDING[\"padded_vocab_size\"]:",
    "        raise ValueError(f\"the plan's vocabulary is padded to {VOCAB_PADDING['padded_vocab_size']} rows (VOCAB_PADDING); \"",
    "                         f\"the model's embedding has {rows}: pad it first, e.g. \"",
    "                         f\"model.resize_token_embeddings({VOCAB_PADDING['padded_vocab_size']})\")"]
HEADS_FN = [
    "", "", "def _heads_per_rank(model: torch.nn.Module, tp: int) -> None:",
    "    \"\"\"Each HEADS_PER_RANK module's head counts (num_heads, num_key_value_heads: the attributes it has)",
    "    divided by tp: ColwiseParallel gives the rank its own heads' q / k / v features.\"\"\"",
    "    for name, attention in model.named_modules():",
    "        if not any(fnmatch.fnmatchcase(name, g) for g in HEADS_PER_RANK):",
    "            continue",
    "        for attr in (\"num_heads\", \"num_key_value_heads\"):",
    "            n = getattr(attention, attr, None)",
    "            if isinstance(n, int) and not isinstance(n, bool):",
    "                if n % tp:",
    "                    raise ValueError(f\"{name}: {attr} {n} is not divisible by tp {tp}\")",
    "                setattr(attention, attr, n // tp)"]
_COLLECTIVES_DOC = [
    "#: The collectives the plan issues per training step over tp, as CommDebugMode counts them in the",
    "#: model's forward and backward (get_comm_counts / comm_module_counts): each of the plan's reshards is",
    "#: one collective (all_reduce -> all_reduce, all_gather -> all_gather_into_tensor, reduce_scatter ->",
    "#: reduce_scatter_tensor, all_to_all -> all_to_all_single); a parameter gradient the plan reduces over tp",
    "#: in its gradient sync (a norm weight under sequence parallel) DTensor reduces in the backward. The loss",
    "#: under loss_parallel() runs its own 3 all-reduces outside the model (max, sum of exponentials, the",
    "#: label's logit); the plan counts them inside its vocab-parallel cross entropy, not here."]
_RECOMPUTE_DOC = [
    "#: Counted as torch runs it: the blocks RECOMPUTE_LAYERS checkpoints run their forward again in the backward,",
    "#: and with it the forward collectives over tp made and read inside them (counted again in \"backward\")."]
_SCALED_DOC = [
    "#: Counted as torch runs it: a vocab-parallel embedding that scales its lookup inside its own forward",
    "#: (Gemma's embed_scale, a 0-d tensor) has DTensor all-reduce its partial output there (a partial sum",
    "#: stays partial only through a multiply by a Python number), then RowwiseParallel's output hook keeps",
    "#: this rank's tokens (Shard(1)) with no collective: one all_reduce in the forward where the plan",
    "#: reduce-scatters."]
_ROW_BIAS_DOC = [
    "#: Not counted: the plan's all-reduce of each row layer's bias gradient under sequence parallel. The plan",
    "#: (as Megatron) adds the bias after the reduce-scatter, on its tokens, and all-reduces its gradient over",
    "#: tp; torch's RowwiseParallel adds it before, to the partial sum, and takes its gradient from the",
    "#: all-gathered output gradient (the reduce-scatter's backward), with no collective of its own."]
_ZERO = {0: "plain data parallel: FSDP2's replicate (DDP), gradients all-reduced per group",
         1: "ZeRO-1: torch has none; fully_shard(reshard_after_forward=False) (ZeRO-2-like) instead",
         2: "ZeRO-2: fully_shard(reshard_after_forward=False)",
         3: "ZeRO-3 / FSDP: fully_shard per block and the root"}


def file_constants(plan: Plan, doc: dict[str, Any], dims: tuple[str, ...], shape: tuple[int, ...],
               dp: dict[str, Any] | None, n_layers: int, pipe: dict[str, Any] | None,
               by_stage: list[Any] | None, local: frozenset[str] = frozenset(),
               scaled: frozenset[str] = frozenset(), ckpt: str | tuple[str, ...] = ()) -> list[str]:
    lines = ["", "#: the HF class the plan is of (spmdkit run --engine torch --torch-plan refuses another --hf)",
             f"MODEL_CLASS = {plan.program.name or None!r}",
             f"MESH_DIMS = {dims!r}", f"MESH_SHAPE = {shape!r}", f"LOSS_PARALLEL = {bool(doc['loss_parallel'])}"]
    padding = plan.program.vocab_padding
    if padding is not None:  # spmdkit plan --make-vocab-size-divisible-by: the model must be built padded
        vocab, padded, by, tp = padding
        lines += [f"#: The vocabulary as planned: the tokenizer's {vocab} ids padded to {padded} rows (Megatron-LM's",
                  f"#: --make-vocab-size-divisible-by {by} x tp {tp}): the model's embedding and output layer hold the",
                  "#: padded rows (HF: model.resize_token_embeddings(padded_vocab_size), or the config's vocab_size set",
                  "#: to it); their logits enter the softmax, and no token or label is one of them. parallelize",
                  "#: refuses a model of another vocabulary.",
                  f"VOCAB_PADDING = {{'vocab_size': {vocab}, 'padded_vocab_size': {padded}, "
                  f"'make_vocab_size_divisible_by': {by}, 'tp': {tp}}}"]
    if pipe is None:
        counts = tp_collectives(plan, local, scaled)
        again = recomputed_collectives(plan, ckpt, counts.get("forward", {}), FUNCOL)
        if again:
            counts["backward"] = dict(sorted((Counter(counts["backward"]) + Counter(again)).items()))
        lines += ["PIPELINE = None", "", *_COLLECTIVES_DOC, *(_ROW_BIAS_DOC if local else []),
                  *(_SCALED_DOC if scaled else []), *(_RECOMPUTE_DOC if again else []),
                  f"PLAN_COLLECTIVES = {counts!r}", ""]
    else:
        lines += pipeline_constants(pipe, by_stage, _COLLECTIVES_DOC)
    if dp is None:
        return [*lines, "DATA_PARALLEL = None", "DP_COLLECTIVES = {}", ""]
    lines += [f"#: The data-parallel dim: {_ZERO[dp['zero']]}.", f"DATA_PARALLEL = {dp!r}"]
    if pipe is not None:
        return [*lines, *pipeline_dp_lines(pipe, dp)]
    return [*lines, "#: What FSDP2 issues over dp per step (its c10d ops, as CommDebugMode counts them): one collective",
            "#: per group (each block, then the root), not one per parameter as the plan counts them.",
            f"DP_COLLECTIVES = {dp_collectives(dp, n_layers)!r}", ""]


def parallelize_fn(styles: dict[str, Any], after: dict[str, Any], conv: list[str], dp: dict[str, Any] | None,
                    pipe: dict[str, Any] | None, fused: bool = False, once: bool = False,
                    heads: bool = False, checkpoint: bool = False, vocab: bool = False) -> list[str]:
    lines = ["", "", "def parallelize(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:",
             "    \"\"\"Apply the plan to ``model`` on ``mesh`` (MESH_DIMS, MESH_SHAPE); returns the model.\"\"\""]
    if vocab:
        lines.append("    _check_vocab(model)  # the vocabulary padded as planned (VOCAB_PADDING)")
    if conv:
        lines.append("    _conv1d_as_linear(model)")
    if fused:
        lines.append("    _fused_per_rank(model, mesh[\"tp\"].size())  # before ColwiseParallel shards the fused weights")
    if heads:
        lines.append("    _heads_per_rank(model, mesh[\"tp\"].size())")
    if styles:
        use = (lambda n: f"_present(model, {n})") if pipe is not None else (lambda n: n)
        lines += ["    tp = mesh[\"tp\"]", f"    parallelize_module(model, tp, {use('TP_PLAN')})"]
        if after:
            lines.append(f"    parallelize_module(model, tp, {use('TP_PLAN_AFTER')})")
        lines += ["    for alias, kept in TIED.items():  # tie again",
                  "        owner, leaf = alias.rsplit(\".\", 1)",
                  "        src, src_leaf = kept.rsplit(\".\", 1)",
                  *(["        if any(isinstance(model.get_submodule(m), torch.nn.Identity) for m in (owner, src)):",
                     "            continue  # a pipeline stage holding one of them: its own copy (PIPELINE[\"tied\"])"]
                    if pipe is not None else []),
                  "        setattr(model.get_submodule(owner), leaf, getattr(model.get_submodule(src), src_leaf))"]
    if checkpoint:  # after the styles, before the data-parallel wrapping (torchtitan's order)
        lines.append("    _checkpoint_layers(model)")
    if once:
        lines.append("    _reduce_partial_grads_once(model)")
    return [*lines, *_dp_lines(dp, pipe), "    return model", ""]


__all__ = ["CONV1D_FN", "FUSED_FN", "GRADS_ONCE_FN", "HEADS_FN", "VOCAB_FN", "dp_collectives", "file_constants", "file_header",
           "file_notes", "parallelize_fn", "tp_collectives"]
