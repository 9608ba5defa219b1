"""``--verify``: a plan's strategy (or its searched dist attrs) run at tiny sizes through the simulator.

The planner plans; these check: :func:`verify_strategy` (``plan --verify``: the same strategy
on the same mesh, on the tiny model of the same architecture, simulated end to end against the
unsharded step), :func:`verify_auto` (``plan --auto --verify``: the searched plan's dist attrs
held on that tiny model), :func:`verify_pipeline` (a pipeline: the stages in order, two
microbatches simulated, their losses summing to the whole batch's) and :func:`verify_config`
(the best configuration of ``plan --devices``). Each returns a JSON-able verdict with ``ok``
and a ``text`` for the terminal. Needs numpy, as the whole simulator does.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Mapping
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.models.hf import load_config
from spmdkit.models.zoo import PRESETS, ModelConfig, build_model, is_config_text, model_label, preset, tiny_like
from spmdkit.planner.pipeline import even_split
from spmdkit.planner.pipeline_plan import sub_mesh_text
from spmdkit.planner.pipeline_split import PipelineSpec, op_stages, parse_spec, split_layers
from spmdkit.planner.planning import parse_cost, plan_hf, plan_model
from spmdkit.planner.propagate import propagate
from spmdkit.planner.search_config import Candidate
from spmdkit.program.plan import Plan
from spmdkit.sim.plan import SimReport, loss_name, simulate_plan, source_values
from spmdkit.strategies.context import moe_chunks
from spmdkit.strategies.strategy import parse_mesh, tp_problem


def _lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


def tiny_for_mesh(tiny: str, mesh_text: str, strategy_text: str) -> str:
    """The tiny model ``tiny`` (a preset name or a config's JSON) grown where megatron over the
    mesh's tp dim would not split it evenly (:func:`spmdkit.strategies.strategy.tp_problem`:
    tiny-llama's 4 heads on tp=8): heads, kv heads, FFN, vocabulary (and with ``sp`` the
    sequence) made multiples of tp, the head size kept; with ``ep`` the experts a multiple of
    the ep dim and the batch of ``dp x ep``; ``tiny`` itself where it splits."""
    mesh = parse_mesh(mesh_text)
    sizes = dict(zip(mesh.dim_names, mesh.shape))
    tp = sizes.get("tp", 1)
    st = {x.strip() for x in strategy_text.split(",")}
    sp = "sp" in st
    cfg = preset(tiny)
    grown: dict[str, Any] = {}
    etp1 = "etp=1" in st and "ep" in st
    from_cp = "ep-from=cp" in st and "ep" in st  # ep carved from the cp ranks: a cp dim outside the experts
    if "ep" in st and cfg.experts:
        ep, dp = sizes.get("ep", 1), sizes.get("dp", 1)
        spread = ep * (tp if etp1 else 1)  # etp=1: the experts over ep x tp
        if cfg.experts % spread:
            grown["experts"] = _lcm(cfg.experts, spread)
        ranks = dp * (1 if from_cp else ep)
        if cfg.batch % ranks:
            grown["batch"] = _lcm(cfg.batch, ranks)
    if tp_problem(cfg, tp, sp, etp1) is not None:
        kv = cfg.n_kv if cfg.n_kv % tp == 0 or tp % cfg.n_kv == 0 else _lcm(cfg.n_kv, tp)
        heads = _lcm(_lcm(cfg.heads, tp), kv)
        grown.update({"heads": heads, "kv_heads": None if cfg.kv_lora_rank else kv, "ffn": _lcm(cfg.ffn, tp),
                      "vocab": _lcm(cfg.vocab, tp), "seq": _lcm(cfg.seq, tp) if sp else cfg.seq})
        if not cfg.head_dim:  # the head size follows from the hidden size: kept
            grown["hidden"] = heads * cfg.hdim
        if cfg.experts and cfg.moe_ffn:
            grown["moe_ffn"] = _lcm(cfg.moe_ffn, tp)
    if "cp" in st and sizes.get("cp", 1) > 1:  # context parallel: the sequence into 2 x cp chunks (x tp under sp);
        cp = sizes["cp"] * (sizes.get("ep", 1) if from_cp else 1)  # alltoall: the heads and kv heads over cp x tp
        seq = _lcm(grown.get("seq", cfg.seq), 2 * cp * (tp if sp else 1))
        if seq != cfg.seq:
            grown["seq"] = seq
        if "cp-attention=alltoall" in st and (cfg.n_kv % (cp * tp) or cfg.heads % (cp * tp)):
            kv = _lcm(grown.get("kv_heads") or cfg.n_kv, cp * tp)
            heads = _lcm(grown.get("heads", cfg.heads), kv)
            grown.update({"heads": heads, "kv_heads": kv, "ffn": _lcm(grown.get("ffn", cfg.ffn), tp),
                          "vocab": _lcm(grown.get("vocab", cfg.vocab), tp)})
            if not cfg.head_dim:
                grown["hidden"] = heads * cfg.hdim
    if not grown:
        return tiny
    obj = json.loads(tiny) if is_config_text(tiny) else {"base": tiny}
    what = ", ".join([*([f"tp={tp}"] if "heads" in grown else []), *([f"cp={sizes['cp']}"] if "cp" in st else []),
                      *([f"ep={sizes.get('ep')}"] if "experts" in grown or "batch" in grown else [])])
    obj.update(grown, name=f"{model_label(tiny)} sized for {what}")
    return json.dumps(obj, separators=(",", ":"))


def verify_strategy(model_name: str | None, mesh_text: str, strategy_text: str,
                    cost_text: str | None = None) -> dict[str, Any]:
    """``--verify``: the same strategy on the same mesh, on the tiny model of the same arch as
    ``model_name`` (llama without one), simulated end to end against the unsharded step."""
    tiny = tiny_for_mesh(tiny_like(preset(model_name)) if model_name else "tiny-llama", mesh_text, strategy_text)
    with warnings.catch_warnings():  # the tiny model's notes are not the user's model's
        warnings.simplefilter("ignore", UserWarning)
        _, plan, _ = plan_model(tiny, mesh_text, strategy_text, None, None, cost_text)
    rep = simulate_plan(plan)
    ok = rep.ok
    lines = [f"verify: {model_label(tiny)} with the same mesh and strategy, simulated on {plan.mesh.size} ranks: "
             f"{rep.checked} tensors compared with the unsharded step (loss, every gradient, every update): "
             + ("all equal" if ok else f"{len(rep.failures)} differ")]
    for name, what in rep.failures[:10]:
        lines.append(f"  {name}: {what}")
    return {"ok": ok, "model": model_label(tiny), "checked": rep.checked, "failures": [list(f) for f in rep.failures],
            "loss": rep.loss, "text": "\n".join(lines)}


def _tiny_name(cfg: ModelConfig) -> str:
    return next((n for n, c in PRESETS.items() if c == cfg), "tiny")


def verify_auto(plan: Plan, model_name: str, cost_text: str | None = None, layers: int | None = None) -> dict[str, Any]:
    """``--verify`` of a searched plan: the plan's dist attrs of every tensor the tiny model of
    the same architecture shares with it (by name; not partial ones, not in-place outputs,
    which are held as the tensor they overwrite) annotated on that tiny model, planned by
    propagate on the same mesh and simulated against the unsharded step."""
    tcfg = preset(tiny_like(preset(model_name)))
    if layers:
        tcfg = tcfg.with_(layers=layers)
    tiny = tcfg.name or _tiny_name(tcfg)
    cp_op = next((op for op in plan.program.ops if op.rule == "cp_attention"), None)
    if cp_op is not None and "cp" in plan.mesh.dim_names:  # built for cp: the tiny model too, its sequence in 2 x cp chunks
        ncp = plan.mesh.shape[plan.mesh.dim_index("cp")]
        tcfg = tcfg.with_(cp=ncp, cp_attention=cp_op.attrs["variant"], cp_balance=cp_op.attrs["balance"],
                          seq=_lcm(tcfg.seq, 2 * ncp))
        tcfg = tcfg.with_(moe_chunks=moe_chunks(tcfg, ncp))  # a MoE model: each cp rank routes its own tokens
        tiny += f" built for cp={ncp}"
    vocab_parallel = any(op.rule == "c_softmax_with_cross_entropy" for op in plan.program.ops)
    tmodel = build_model(tcfg, vocab_parallel_loss=vocab_parallel, check_rules=False)
    tp = tmodel.program
    ann = {}
    for n, a in plan.attrs.items():
        t = tp.tensors.get(n)
        if t is None or t.inplace_of or a.partial or len(t.shape) != len(a.dims_mapping):
            continue
        ann[n] = a
    tplan = propagate(tp, plan.mesh, ann, parse_cost(cost_text, plan.mesh))
    held = sum(1 for n, a in ann.items() if tplan.attrs.get(n) == a)
    try:
        rep = simulate_plan(tplan)
    except ProgramError as exc:  # a piece not distributed as the plan says: a failed check, not bad input
        rep = SimReport(0, [("simulation", " ".join(str(exc).split())[:300])])
    ok = rep.ok and held == len(ann)
    lines = [f"verify: {tiny} holding the searched plan's dist attrs of the {len(ann)} tensors it shares with it "
             f"({held} held as chosen), simulated on {tplan.mesh.size} ranks: {rep.checked} tensors compared with the "
             f"unsharded step (loss, every gradient, every update): "
             + ("all equal" if rep.ok else f"{len(rep.failures)} differ")]
    for name, what in rep.failures[:10]:
        lines.append(f"  {name}: {what}")
    return {"ok": ok, "model": tiny, "annotated": len(ann), "held": held, "checked": rep.checked,
            "failures": [list(f) for f in rep.failures], "loss": rep.loss, "text": "\n".join(lines)}


def verify_config(best: Candidate, model_name: str, cost_text: str | None = None) -> dict[str, Any]:
    """``--verify`` of the search's best configuration at tiny sizes: its strategy (or its
    searched dist attrs) on the tiny model of the same architecture, on its mesh (with pp, the
    pipeline check of :func:`verify_pipeline`)."""
    cfg = best.config
    if cfg.strategy == "auto":
        return verify_auto(best.plan, model_name, cost_text)
    if cfg.pp > 1:  # the split planned (an uneven one where the layers do not divide)
        spec, counts = _best_pipeline(best)
        return verify_pipeline(model_name, cfg.mesh_text, spec, cfg.strategy, counts)
    return verify_strategy(model_name, cfg.mesh_text, cfg.strategy, cost_text)


def verify_config_hf(best: Candidate, class_name: str, config: Any, patterns: Any = None,
                     cost_text: str | None = None, fallback: str = "error") -> dict[str, Any]:
    """``--verify`` of the search's best configuration of an ``--hf`` model, as
    :func:`verify_config` a preset's: its strategy on its mesh at a tiny config (:func:`verify_hf`)
    or, with pp, the pipeline check of :func:`verify_pipeline_hf` on the split planned."""
    cfg = best.config
    if cfg.pp > 1:
        spec, counts = _best_pipeline(best)
        return verify_pipeline_hf(class_name, config, cfg.mesh_text, spec, cfg.strategy, patterns, fallback,
                                  counts=counts)
    return verify_hf(class_name, config, cfg.sub_mesh_text, cfg.strategy, patterns, cost_text, fallback=fallback)


def _best_pipeline(best: Candidate) -> tuple[PipelineSpec, tuple[int, ...] | None]:
    """The search's best pipeline configuration as --verify simulates it: its schedule (1F1B, or
    interleaved over its virtual stages) and the layers per virtual stage it was priced with."""
    cfg = best.config
    spec = parse_spec(cfg.pp, microbatches=cfg.pp if cfg.virtual > 1 else 1,
                      virtual=cfg.virtual if cfg.virtual > 1 else None)
    return spec, getattr(best.estimate, "counts", None)



def _pipeline_text(label: str, shape: tuple[Any, ...], failures: list[tuple[str, str]],
                   losses: tuple[str, bool, float, float | None], counts: tuple[int, ...] | None = None) -> str:
    """The pipeline --verify verdict: ``shape`` (layers, stages, stages in order, sub-mesh,
    microbatches, microbatch size, ranks, tensors checked), ``losses`` (how the microbatch losses
    make the batch's: "sum" / "average", whether they do, their total, the batch's loss)."""
    layers, n, ordered, sub, n_mb, b, ranks, checked = shape
    how, agree, total, ref_loss = losses
    split = f" split {', '.join(map(str, counts))}" if counts is not None and len(set(counts)) > 1 else ""
    lines = [f"verify: {label} with {layers} layers in {n} pipeline stages{split} (forward runs stages 0..{n - 1}, backward "
             f"{n - 1}..0, in order: {'yes' if ordered else 'NO'}), each stage on the sub-mesh {sub}, {n_mb} "
             f"microbatches of {b} simulated on {ranks} ranks: {checked} tensors compared with the "
             f"unsharded step (loss, every gradient, every update): "
             + ("all equal" if not failures else f"{len(failures)} differ")
             + f"; the microbatch losses {how} to the whole batch's loss: {'yes' if agree else 'NO'} "
             f"({total:.12g} vs {ref_loss if ref_loss is not None else float('nan'):.12g})"]
    lines += [f"  {name}: {what}" for name, what in failures[:10]]
    return "\n".join(lines)


def _tiny_split(spec: PipelineSpec, counts: tuple[int, ...] | None) -> tuple[int, tuple[int, ...]]:
    """(layers, layers per virtual stage) of the tiny model a pipeline --verify simulates: the
    plan's ``counts`` where they are uneven (``--stages`` with empty end stages or uneven middle
    ones, ``--stages auto``, a balanced split: the tiny model has the plan's layers, split as the
    plan splits them), else ``pp * v`` layers (at least 2), one a stage."""
    n = spec.pp * spec.virtual
    if counts is not None and len(counts) == n and len(set(counts)) > 1:
        return sum(counts), tuple(counts)
    layers = max(2, n)
    return layers, split_layers(layers, PipelineSpec(spec.pp, 1, spec.schedule, spec.virtual,
                                                     tuple(even_split(layers, n)) if layers % n else None))


def verify_pipeline(model_name: str, mesh_text: str, spec: PipelineSpec, strategy: str,
                    counts: tuple[int, ...] | None = None) -> dict[str, Any]:
    """``--verify`` of a pipeline plan of the preset ``model_name`` on ``mesh_text`` (with its pp
    dim): the tiny model of the same arch with ``pp * v`` layers (at least 2), split one layer
    per stage, or with ``counts`` (the plan's layers per virtual stage) where they are uneven
    (``--stages auto``, a balanced split: the tiny model has the plan's layers, split as the plan
    splits them), and planned on the sub-mesh: its ops are checked to run stage after stage
    (forward 0..n-1, backward n-1..0); a step of 2 microbatches is simulated, each microbatch
    on its own half of the batch (every tensor against its unsharded step), and the sum of the
    microbatch losses is compared with the unsharded loss of the whole batch."""
    _pp, sub = sub_mesh_text(parse_mesh(mesh_text))
    tiny = tiny_for_mesh(tiny_like(preset(model_name).with_(dropout=0.0)), sub, strategy)
    n = spec.pp * spec.virtual
    layers, counts = _tiny_split(spec, counts)
    with warnings.catch_warnings():  # the tiny model's notes are not the user's model's
        warnings.simplefilter("ignore", UserWarning)
        model, plan, _ = plan_model(tiny, sub, strategy, {"layers": layers})
    stages = op_stages(plan.program, counts)
    phases = [op.phase for op in plan.program.ops]
    fw = [s for s, ph in zip(stages, phases) if ph == "forward"]
    bw = [s for s, ph in zip(stages, phases) if ph == "backward"]
    ordered = fw == sorted(fw) and bw == sorted(bw, reverse=True) and set(fw) == set(range(n))
    b = model.config.batch
    n_mb = 2
    _, whole, _ = plan_model(tiny, "dp=1", "none", {"layers": layers, "batch": b * n_mb})
    vals = source_values(whole.program, 0)
    ref = simulate_plan(whole, values=vals)  # one rank: the unsharded step of the whole batch
    batched = set(model.token_inputs())
    reps = []
    for i in range(n_mb):
        mine = {k: (v[i * b:(i + 1) * b] if k in batched else v) for k, v in vals.items()}
        reps.append(simulate_plan(plan, values=mine))
    failures = [f for r in reps for f in r.failures]
    losses = [r.loss for r in reps]
    total = sum(x for x in losses if x is not None)
    summed = (ref.loss is not None and None not in losses
              and abs(total - ref.loss) <= 1e-9 * max(1.0, abs(ref.loss)))
    ok = not failures and ordered and summed
    checked = sum(r.checked for r in reps)
    text = _pipeline_text(model_label(tiny), (layers, n, ordered, sub, n_mb, b, plan.mesh.size, checked), failures,
                          ("sum", summed, total, ref.loss), counts)
    return {"ok": ok, "model": model_label(tiny), "layers": layers, "layers_per_stage": list(counts),
            "stages_in_order": ordered, "microbatches": n_mb,
            "losses_sum": summed, "checked": checked, "failures": [list(f) for f in failures], "loss": total,
            "text": text}


# -- HuggingFace models -----------------------------------------------------------------------------

#: the size keys of an HF config, shrunk for --verify (every other key is kept): layers, width,
#: heads, vocabulary, MLP, experts, MLA ranks (the tiny config the issue names: 2 layers, hidden
#: 64, 4 heads, 2 kv heads, vocab 128, intermediate 128)
_LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_decoder_layers", "decoder_layers",
           "encoder_layers")
_HIDDEN = ("hidden_size", "n_embd", "d_model", "dim")
_HEADS = ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads")
_KV = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num")
_TINY = {"vocab_size": 128, "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "d_ff": 128,
         "ffn_hidden_size": 128, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "moe_intermediate_size": 64,
         "shared_expert_intermediate_size": 64, "head_dim": 16, "d_kv": 16, "kv_lora_rank": 16,
         "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}
_AT_MOST = {"num_local_experts": 4, "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
            "max_position_embeddings": 256, "n_positions": 256, "n_ctx": 256}


def tiny_hf_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` (an HF config as a dict) at the tiny size ``--verify`` simulates: its size
    keys shrunk (2 layers, hidden 64, 4 heads; kv heads 1 for multi-query, 2 for grouped, 4
    for multi-head; vocab 128, intermediate 128, at most 4 experts and 2 per token; special
    token ids taken modulo the vocabulary), every other key kept as given, so the model is of
    the same class and kind."""
    out = dict(config)
    heads = next((config[k] for k in _HEADS if isinstance(config.get(k), int)), None)
    for k, v in config.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            continue
        if k in _LAYERS:
            out[k] = min(v, 2)
        elif k in _HIDDEN:
            out[k] = 64
        elif k in _HEADS:
            out[k] = 4
        elif k in _KV:
            out[k] = 1 if v == 1 else (4 if heads is not None and v >= heads else 2)
        elif k in _TINY:
            out[k] = min(v, _TINY[k])
        elif k in _AT_MOST:
            out[k] = min(v, _AT_MOST[k])
    vocab = out.get("vocab_size")
    if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0:
        for k, v in config.items():  # special token ids inside the tiny vocabulary
            if k.endswith("_token_id") and isinstance(v, int) and not isinstance(v, bool) and v >= vocab:
                out[k] = v % vocab
            elif k.endswith("_token_id") and isinstance(v, list) and all(isinstance(x, int) for x in v):
                out[k] = [x % vocab if x >= vocab else x for x in v]
    return out


def verify_hf(class_name: str, config: Any, mesh_text: str, strategy_text: str | None,
              patterns: Any = None, cost_text: str | None = None, seq: int = 16,
              fallback: str = "error") -> dict[str, Any]:
    """``plan --hf --verify``: the same plan (mesh, strategy, ``--tp-plan``) on the HF class
    ``class_name`` at the tiny config :func:`tiny_hf_config` derives from ``config``, imported
    in float32 and simulated end to end against the unsharded step (``batch``: the mesh's
    size, so every mesh dim divides it)."""
    tiny = tiny_hf_config(load_config(config))
    mesh = parse_mesh(mesh_text)
    batch = max(2, mesh.size)
    _prog, _model, _kw, plan = plan_hf(class_name, tiny, mesh_text, strategy_text, "float32", batch, seq,
                                       None, patterns, cost_text, fallback=fallback)
    try:
        rep = simulate_plan(plan)
    except ProgramError as exc:  # a piece not distributed as the plan says: a failed check, not bad input
        rep = SimReport(0, [("simulation", " ".join(str(exc).split())[:300])])
    sizes = ", ".join(f"{k} {tiny[k]}" for k in (*_LAYERS, *_HIDDEN, *_HEADS, *_KV, "vocab_size", "intermediate_size")
                      if k in tiny and k in load_config(config))
    what = f"{class_name} at a tiny config ({sizes}), batch {batch}, seq {seq}"
    lines = [f"verify: {what} with the same mesh and strategy, simulated on {plan.mesh.size} ranks: "
             f"{rep.checked} tensors compared with the unsharded step (loss, every gradient, every update): "
             + ("all equal" if rep.ok else f"{len(rep.failures)} differ")]
    for name, what_ in rep.failures[:10]:
        lines.append(f"  {name}: {what_}")
    return {"ok": rep.ok, "model": class_name, "config": tiny, "checked": rep.checked,
            "failures": [list(f) for f in rep.failures], "loss": rep.loss, "text": "\n".join(lines)}


__all__ = ["tiny_for_mesh", "tiny_hf_config", "verify_auto", "verify_config", "verify_config_hf", "verify_hf", "verify_pipeline", "verify_strategy"]


def _tiny_layers(tiny: dict[str, Any], layers: int) -> dict[str, Any]:
    """``tiny`` with its layer counts (every key of ``_LAYERS`` it has) set to ``layers``."""
    return {k: (layers if k in _LAYERS and isinstance(v, int) and not isinstance(v, bool) else v)
            for k, v in tiny.items()}


def _all_counted(labels: Any) -> Any:
    """``labels`` with the ignored ones (negative: -100) made class 0."""
    return labels.clip(min=0)


def verify_pipeline_hf(class_name: str, config: Any, mesh_text: str, spec: PipelineSpec, strategy: str | None,
                       patterns: Any = None, fallback: str = "error", seq: int = 16,
                       counts: tuple[int, ...] | None = None) -> dict[str, Any]:
    """``plan --hf --verify`` with a pp dim, as :func:`verify_pipeline` checks a preset's: the HF
    class at :func:`tiny_hf_config`'s size with ``pp * v`` layers (at least 2), one a stage, or
    with ``counts`` (the plan's layers per virtual stage) where they are uneven (``--stages
    0,...,0``: an embedding-only first / loss-only last stage, cut by ``op_units(ends=True)``;
    ``--stages auto``, a balanced split) the plan's layers split as the plan splits them,
    planned on the stages' sub-mesh under the same strategy; its ops are checked to run stage after stage
    (forward 0..n-1, backward n-1..0); 2 microbatches are simulated, each on its half of a batch
    (every tensor against its unsharded step), and their losses compared with the whole batch's
    unsharded loss: HF's loss is the mean over the counted tokens, so the labels carry no ignored
    index (each microbatch counts as many tokens) and the whole batch's loss is the mean of the
    microbatches' (their sum for a summed loss)."""
    _pp, sub = sub_mesh_text(parse_mesh(mesh_text))
    n = spec.pp * spec.virtual
    layers, counts = _tiny_split(spec, counts)
    tiny = _tiny_layers(tiny_hf_config(load_config(config)), layers)
    b = max(2, parse_mesh(sub).size)
    n_mb = 2
    with warnings.catch_warnings():  # the tiny model's notes are not the user's model's
        warnings.simplefilter("ignore", UserWarning)
        prog, _m, _kw, plan = plan_hf(class_name, tiny, sub, strategy, "float32", b, seq, None, patterns,
                                      fallback=fallback)
        # the whole batch in the stages' token order (a cp sub-mesh: traced for it, as the flat --verify's
        # program is; then every source the two share, its constants' names included, means the same)
        whole_prog, _m2, _kw2, whole = plan_hf(class_name, tiny, "dp=1", "dp", "float32", b * n_mb, seq,
                                               fallback=fallback, cp_layout=(sub, strategy or "megatron"))
    stages = op_stages(prog, counts)
    phases = [op.phase for op in prog.ops]
    fw = [s for s, ph in zip(stages, phases) if ph == "forward"]
    bw = [s for s, ph in zip(stages, phases) if ph == "backward"]
    ordered = fw == sorted(fw) and bw == sorted(bw, reverse=True) and set(fw) == set(range(n))
    vals = source_values(whole_prog, 0)
    for k in ("labels", "shift_labels"):  # no ignored index: every microbatch counts b x its tokens (cp's
        if k in vals:  # loss reads the labels shifted before the permutation: models/hf_cp.py)
            vals[k] = _all_counted(vals[k])
    ref = simulate_plan(whole, values=vals)
    batched = {k for k, (kind, _) in getattr(whole_prog, "sources", {}).items()
               if kind == "input" and whole_prog.tensors[k].shape[:1] == (b * n_mb,)}
    reps = []
    for i in range(n_mb):
        mine = {k: (v[i * b:(i + 1) * b] if k in batched else v) for k, v in vals.items()
                if k in prog.tensors and prog.tensors[k].kind != "activation"}
        mine = {k: v for k, v in mine.items() if tuple(getattr(v, "shape", ())) == prog.tensors[k].shape}
        reps.append(simulate_plan(plan, values=mine))
    failures = [f for r in reps for f in r.failures]
    losses = [r.loss for r in reps]
    mean = any(op.rule == "divide" and loss_name(prog) in op.output_names() for op in prog.ops)
    total = sum(x for x in losses if x is not None) / (n_mb if mean else 1)
    agree = (ref.loss is not None and None not in losses
             and abs(total - ref.loss) <= 1e-9 * max(1.0, abs(ref.loss)))
    ok = not failures and ordered and agree
    checked = sum(r.checked for r in reps)
    how = "average" if mean else "sum"
    text = _pipeline_text(f"{class_name} at a tiny config", (layers, n, ordered, sub, n_mb, b, plan.mesh.size, checked),
                          failures, (how, agree, total, ref.loss), counts)
    return {"ok": ok, "model": class_name, "config": tiny, "layers": layers, "layers_per_stage": list(counts),
            "stages_in_order": ordered,
            "microbatches": n_mb, "losses_agree": agree, "checked": checked,
            "failures": [list(f) for f in failures], "loss": total, "text": text}
