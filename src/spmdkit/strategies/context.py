"""Context parallelism (``--strategy ...,cp``; docs/context.md): the sequence over the ``cp`` mesh dim.

Every activation outside attention is sharded on its sequence axis over ``cp`` (the batch over
``dp`` as before): the inputs that carry the sequence (tokens, labels, the learned positions,
the rope tables' rows, an eager model's causal mask rows, ``cp.positions``) are annotated so and
propagation carries it through every position-independent op. Parameters are replicated over
``cp``; their gradients come out partial over ``dp`` and ``cp`` and are reduced over both.
Attention is the model's ``cp_attention`` (the zoo builds it when ``cp > 1``), computed as
``--cp-attention`` says: ``allgather`` (the default, Llama 3's: k and v gathered, cheap with
grouped kv heads), ``ring`` (kv blocks passed round the cp ranks inside the kernel) or
``alltoall`` (DeepSpeed-Ulysses: the sequence traded for the heads by all-to-all). With
``--cp-balance zigzag`` (the default) rank ``i`` holds chunks ``i`` and ``2cp-1-i`` of the
sequence (the tokens are laid out in that order and each carries its position), so causal
attention costs every rank the same.

The strategy text carries the options, so a plan, ``--verify``, ``run`` and the search see the
same: ``cp-attention=ring`` and ``cp-balance=none`` items (the CLI's ``--cp-attention`` /
``--cp-balance`` add them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.models.zoo_config import CP_ATTENTION, CP_BALANCE, Model, ModelConfig

#: the strategy items that carry cp's options
OPTIONS = {"cp-attention": CP_ATTENTION, "cp-balance": CP_BALANCE}
DEFAULTS = {"cp-attention": "allgather", "cp-balance": "zigzag"}


def parse_option(item: str) -> str | None:
    """``cp-attention=ring`` -> the canonical item; None where ``item`` is no cp option;
    ProgramError (naming the flag) for an unknown value."""
    key, eq, value = item.partition("=")
    key = key.strip()
    if not eq or key not in OPTIONS:
        return None
    value = value.strip()
    if value not in OPTIONS[key]:
        raise ProgramError(f"--{key} {value!r}: not one of {', '.join(OPTIONS[key])}")
    return f"{key}={value}"


def options(strategy: Iterable[str]) -> tuple[str, str]:
    """(the cp attention variant, the balance) a parsed strategy asks for."""
    got = dict(DEFAULTS)
    for s in strategy:
        k, eq, v = s.partition("=")
        if eq and k in got:
            got[k] = v
    return got["cp-attention"], got["cp-balance"]


def check_options(items: Iterable[str], mesh: ProcessMesh) -> None:
    """The options need ``cp`` in the strategy, and ``cp`` a ``cp`` mesh dim."""
    st = list(items)
    opts = [s for s in st if "=" in s]
    if opts and "cp" not in st:
        k, _, v = opts[0].partition("=")
        raise ProgramError(f"--{k} {v}: context parallelism is not asked for (add cp to --strategy and a cp dim to "
                           f"--mesh)")
    if "cp" in st and "cp" not in mesh.dim_names:
        raise ProgramError(f"--strategy cp: the mesh has no 'cp' dim (mesh dims: {', '.join(mesh.dim_names)})")


def config_for(cfg: ModelConfig, mesh: ProcessMesh, strategy: Iterable[str]) -> ModelConfig:
    """The zoo config built for the strategy: ``cp`` (the mesh's cp size), the variant and the
    balance set where ``cp`` is asked for, a MoE model routed in cp chunks (:func:`moe_chunks`);
    ``cfg`` otherwise."""
    st = tuple(strategy)
    if "cp" not in st:
        return cfg
    variant, balance = options(st)
    dims = seq_dims(mesh, st)
    n = math.prod(mesh.shape[d] for d in dims)
    built = cfg.with_(cp=n, cp_attention=variant, cp_balance=balance, moe_chunks=moe_chunks(cfg, n))
    if len(dims) > 1:  # ep-from=cp: the config's checks name cp = cp x ep; say the cp and ep the user gave
        try:
            built.check()
        except ProgramError as e:
            raise ProgramError(str(e).replace(f"--mesh cp={n}", f"--mesh {_seq_mesh(mesh, dims)}", 1)) from None
    return built


def seq_dims(mesh: ProcessMesh, strategy: Iterable[str]) -> tuple[int, ...]:
    """The mesh dims the sequence is split over outside the experts under ``cp``, major first:
    ``(cp,)``, or ``(cp, ep)`` with ``ep-from=cp`` (the expert group carved from the cp ranks:
    ep one more cp dim for attention and the dense parts, inside cp in rank order, so that the
    expert group keeps consecutive ranks as Megatron-Core's does); empty without cp."""
    st = set(strategy)
    if "cp" not in st or "cp" not in mesh.dim_names:
        return ()
    cp = mesh.dim_index("cp")
    return (cp, mesh.dim_index("ep")) if "ep-from=cp" in st and "ep" in st else (cp,)


def _seq_mesh(mesh: ProcessMesh, dims: tuple[int, ...]) -> str:
    """``cp=N`` of a message, ``cp=C,ep=E (ep-from=cp: the sequence over cp x ep = N)`` where
    the sequence is split over both (:func:`seq_dims`)."""
    sizes = [mesh.shape[d] for d in dims]
    if len(dims) == 1:
        return f"cp={sizes[0]}"
    return f"cp={sizes[0]},ep={sizes[1]} (ep-from=cp: the sequence over cp x ep = {math.prod(sizes)})"


def seq_entry(dims: tuple[int, ...], *minor: int) -> Any:
    """The entry of a sequence axis over ``dims`` (:func:`seq_dims`) and then ``minor`` (tp under
    sp): one mesh dim, or their co-shard."""
    ds = (*dims, *minor)
    return ds[0] if len(ds) == 1 else ds


def moe_chunks(cfg: ModelConfig, cp: int) -> int:
    """The chunks a MoE model routes each sequence in under ``cp`` ranks: ``cp`` (each cp rank
    routes its own tokens, as Megatron-Core's router and dispatcher see only the rank's share of
    the sequence; under the zig-zag balance a rank's chunk is its two pieces, side by side),
    where the sequence splits so; ``cfg``'s own otherwise (a dense model: 1)."""
    return cp if cfg.experts and cp > 1 and cfg.seq % cp == 0 else cfg.moe_chunks


def auto_config(cfg: ModelConfig | None, mesh: ProcessMesh, items: Iterable[str],
                imported: str | None) -> ModelConfig | None:
    """The zoo config ``--auto`` searches on ``mesh``: with a ``cp`` dim of more than one rank,
    built with ``cp_attention`` (the variant and balance of ``items``, cp's option items:
    ``--cp-attention`` / ``--cp-balance``) so that the search may split the sequence over cp;
    ``cfg`` without one. ProgramError naming the flag: a strategy item that is no cp option
    (``--auto`` chooses the shardings), a ``--program`` file (not built with cp_attention), a
    model the variant cannot split (:func:`cp_problem`). An ``--hf`` model (``cfg`` None) gives
    None: it is imported for cp instead (:func:`hf_cp` of ``["cp", *items]``, the search then
    splitting the sequence of the traced program)."""
    st = list(items)
    other = [s for s in st if parse_option(s) is None]
    if other:
        raise ProgramError("--strategy: does not apply with --auto (the search chooses the shardings)")
    n = mesh.shape[mesh.dim_index("cp")] if "cp" in mesh.dim_names else 1
    if n == 1:
        if st:
            k, _, v = st[0].partition("=")
            raise ProgramError(f"--{k} {v}: context parallelism is not asked for (--auto splits the sequence on a "
                               f"cp mesh dim of more than one rank)")
        return cfg
    if imported == "--hf":
        return None
    if imported is not None or cfg is None:
        raise ProgramError(f"--auto --mesh cp={n}: context parallelism needs the model built or imported with "
                           f"cp_attention; {'a ' + imported + ' file' if imported else 'this model'} is not (give the "
                           f"preset, catalog or --hf model)")
    built = config_for(cfg, mesh, ["cp", *st])
    tp = mesh.shape[mesh.dim_index("tp")] if "tp" in mesh.dim_names else 1
    why = cp_problem(built, n, tp)
    if why is not None:
        raise ProgramError(f"--mesh cp={n}: {why}")
    return built


def cp_groups(mesh: ProcessMesh, strategy: Iterable[str]) -> list[tuple[int, ...]]:
    """The mesh-dim groups whose reductions run as one collective under cp: ``(dp, cp)`` (a
    parameter's gradient, partial over both, all-reduced over the dp x cp ranks at once, as
    Megatron-Core's data-parallel group with context parallelism spans them) and, with ``ep``,
    :func:`data_dims` (a dense parameter's gradient, partial over dp, cp and ep, reduced once
    over them all: Megatron-Core carves ep out of the dp x cp ranks, and its dense data-parallel
    group is every one of them; an expert stack's stays over dp x cp, its expert-data-parallel
    group); none without cp or with one dim alone."""
    st = set(strategy)
    if "cp" not in st or "cp" not in mesh.dim_names:
        return []
    dp = mesh.dim_index("dp") if "dp" in st and "dp" in mesh.dim_names else None
    ep = mesh.dim_index("ep") if "ep" in st and "ep" in mesh.dim_names else None
    cp = mesh.dim_index("cp")
    out: list[tuple[int, ...]] = [(dp, cp)] if dp is not None else []
    if ep is not None:
        out.append(data_dims(dp, cp, ep))
    return out


def data_dims(dp: int | None, cp: int, ep: int | None) -> tuple[int, ...]:
    """The mesh dims of a dense parameter's data-parallel group under cp, major first: ``(dp,
    cp)``, with ``ep`` ``(dp, cp, ep)`` (``dp`` left out without a dp dim)."""
    return tuple(d for d in (dp, cp, ep) if d is not None)


def zero_dims(mesh: ProcessMesh, dp: int | None, cp: int, ep: int | None = None) -> tuple[Any, int]:
    """(the entry, the ranks) ZeRO shards a parameter's states over under cp: the data-parallel
    ranks times the cp ranks ``(dp, cp)`` (Megatron-Core's distributed optimizer shards over
    dp x cp: every one of them holds the whole parameter and reduces its gradient), ``cp`` alone
    without a dp dim; a dense parameter's under ``ep`` (its mesh dim; None for an expert stack)
    over ``(dp, cp, ep)`` (:func:`data_dims`: the gradient reduce-scattered and the parameter
    all-gathered once over them all)."""
    dims = data_dims(dp, cp, ep)
    n = math.prod(mesh.shape[d] for d in dims)
    return (dims[0] if len(dims) == 1 else dims), n


def cp_problem(cfg: ModelConfig, cp: int, tp: int) -> str | None:
    """Why the variant cannot split ``cfg`` over ``cp`` (x ``tp``) ranks, or None: the sequence
    into ``2 x cp`` chunks (zig-zag) or ``cp``; under alltoall the heads and kv heads over
    ``cp x tp`` ranks (each rank attends whole heads)."""
    chunks = 2 * cp if cfg.cp_balance == "zigzag" else cp
    if cfg.seq % chunks:
        how = f"2 x cp = {chunks} chunks (the zig-zag balance)" if cfg.cp_balance == "zigzag" else f"cp = {cp} chunks"
        return f"the sequence of {cfg.seq} tokens does not split into {how}"
    if cfg.cp_attention == "alltoall":
        n = cp * tp
        for count, what in ((cfg.heads, "attention heads"), (cfg.n_kv, "kv heads")):
            if count % n:
                return (f"--cp-attention alltoall moves the sequence onto the heads: cp x tp = {n} does not divide "
                        f"the model's {count} {what}")
    return None


def cp_marks(model: Model, mesh: ProcessMesh, dm: Any, st: set[str], batch: Any, tp: int | None) -> Any:
    """Annotate the sequence inputs over ``cp`` (``dm``: the strategy's marks); the sequence's
    entry (the cp mesh dim, ``(cp, ep)`` with ``ep-from=cp``: :func:`seq_dims`), None without
    cp. ProgramError naming ``--mesh`` / ``--cp-attention`` where the model cannot be split
    (:func:`cp_problem`)."""
    if "cp" not in st:
        return None
    dims = seq_dims(mesh, st)
    cp = seq_entry(dims)  # the cp dim, or (cp, ep) with ep-from=cp
    n = math.prod(mesh.shape[d] for d in dims)
    cfg = model.config
    if n > 1 and cfg.cp != n:
        what = "cp" if len(dims) == 1 else "cp x ep"
        raise ProgramError(f"--mesh cp={mesh.shape[dims[0]]}: the model was built for cp={cfg.cp}, not {what} = {n} "
                           f"(plan it with --strategy ...,cp)")
    why = cp_problem(cfg, n, mesh.shape[tp] if tp is not None else 1)
    if why is not None:
        raise ProgramError(f"--mesh {_seq_mesh(mesh, dims)}: {why}")
    prog = model.program
    ins = model.inputs
    for tok in model.token_inputs():
        dm(tok)[1] = cp
    for key in ("sin", "cos"):
        name = ins.get(key)
        if name is not None:
            dm(name)[-3 if len(prog.tensors[name].shape) == 4 else 0] = cp
    if "causal_mask" in prog.tensors:
        dm("causal_mask")[2] = cp
    if "cp.positions" in prog.tensors:
        dm("cp.positions")[0] = -1 if cfg.cp_attention == "alltoall" else cp
        dm("cp.key_positions")[0] = cp if cfg.cp_attention == "ring" else -1
    _attention_marks(prog, mesh, dm, st, batch, cp, tp)
    return cp


def _attention_marks(prog: Any, mesh: ProcessMesh, dm: Any, st: set[str], batch: Any, cp: Any,
                     tp: int | None) -> None:
    """Attention's boundary held sequence-sharded: alltoall's output traded back by all-to-all,
    the grads of q, k, v back onto the sequence (allgather's partial k / v grads reduce-scattered)."""
    heads = tp if tp is not None and "megatron" in st else None
    for op in prog.ops:
        if op.rule not in ("cp_attention", "cp_attention_grad"):
            continue
        for name in op.outputs[:1] if op.rule == "cp_attention" else op.outputs[:3]:
            if isinstance(name, str):
                d = dm(name)
                h = prog.tensors[name].shape[2]
                d[0], d[1], d[2] = batch, cp, heads if heads is not None and h % mesh.shape[heads] == 0 else -1


def hf_cp(mesh: ProcessMesh, strategy: Iterable[str], seq: int | None = None) -> tuple[int, str, str] | None:
    """(cp ranks, variant, balance) an imported (``--hf``) model is traced for
    (:func:`spmdkit.models.hf.import_hf`'s ``cp``; with ``ep-from=cp`` the cp x ep ranks the
    sequence is split over, :func:`seq_dims`): None without ``cp`` in the strategy or a cp mesh
    dim of more than one rank. ProgramError naming the mesh where ``seq`` (when given) does not
    split into the cp x ep ranks' chunks (without ep-from=cp the import says it of cp alone)."""
    st = tuple(strategy)
    if "cp" not in st or "cp" not in mesh.dim_names or mesh.shape[mesh.dim_index("cp")] < 2:
        return None
    dims = seq_dims(mesh, st)
    n = math.prod(mesh.shape[d] for d in dims)
    variant, balance = options(st)
    chunks = 2 * n if balance == "zigzag" else n
    if seq is not None and len(dims) > 1 and seq % chunks:
        cp, ep = (mesh.shape[d] for d in dims)
        raise ProgramError(f"--mesh cp={cp},ep={ep} with --strategy ep-from=cp: the sequence of {seq} tokens does not "
                           f"split into {'2 x ' if balance == 'zigzag' else ''}cp x ep = {chunks} chunks (the "
                           f"sequence is split over the cp x ep ranks outside the experts)")
    return (n, variant, balance)


def hf_cp_marks(prog: Any, mesh: ProcessMesh, dm: Any, st: set[str], data: Iterable[str], batch: Any,
                tp: int | None) -> Any:
    """``cp_marks`` of an imported program (``import_hf(cp=...)``: its attention ``cp_attention``,
    its call in the cp ranks' token order): the sequence axis (1) of the call's inputs ``data``
    over ``cp`` (``(cp, ep)`` with ``ep-from=cp``: :func:`seq_dims`), the positions of each
    ``cp_attention`` as its variant reads them, attention's boundary as the zoo's; returns the
    sequence's entry (:func:`seq_entry`). ProgramError naming the mesh where the program has no
    cp_attention of that many ranks' order, or alltoall's heads do not divide."""
    if "cp" not in st:
        return None
    dims = seq_dims(mesh, st)
    cp = seq_entry(dims)  # the cp dim, or (cp, ep) with ep-from=cp
    n = math.prod(mesh.shape[d] for d in dims)
    ops = [op for op in prog.ops if op.rule == "cp_attention"]
    if n > 1 and not ops:
        raise ProgramError(f"--mesh cp={n}: the imported program has no cp_attention (import it with cp: "
                           f"--strategy ...,cp on --hf)")
    seq = prog.tensors[ops[0].inputs["q"]].shape[1] if ops else None
    for name in data:
        shape = prog.tensors[name].shape
        if len(shape) >= 2 and shape[1] == seq:
            dm(name)[1] = cp
    size = n * (mesh.shape[tp] if tp is not None else 1)
    for op in ops:
        variant = op.attrs.get("variant")
        if variant == "alltoall":
            for t, what in (("q", "attention heads"), ("k", "kv heads")):
                h = prog.tensors[op.inputs[t]].shape[2]
                if h % size:
                    raise ProgramError(f"--mesh {_seq_mesh(mesh, dims)}: --cp-attention alltoall moves the sequence "
                                       f"onto the heads: "
                                       f"cp x tp = {size} does not divide the model's {h} {what}")
        dm(op.inputs["q_positions"])[0] = -1 if variant == "alltoall" else cp
        dm(op.inputs["k_positions"])[0] = cp if variant == "ring" else -1
    _attention_marks(prog, mesh, dm, st, batch, cp, tp)
    return cp


__all__ = ["DEFAULTS", "OPTIONS", "auto_config", "check_options", "config_for", "cp_groups", "cp_marks", "cp_problem", "data_dims", "hf_cp", "hf_cp_marks", "moe_chunks", "options", "parse_option", "seq_dims", "seq_entry", "zero_dims"]
