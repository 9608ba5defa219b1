"""The outer search's space (:mod:`spmdkit.planner.search`): the configurations of N devices.

:class:`Config` (dp, tp, pp, vp, ep, cp, a strategy, a recomputation mode, microbatches and
gradient accumulation) and :func:`_work`, every factorisation ``dp x tp x pp`` (x ``ep`` x
``cp``) of the devices the batch, the heads and the layers allow, each hand strategy, each
micro-batch, and for a pipeline interleaved 1F1B over 2 model chunks where Megatron-LM's
schedule takes it (``m % pp == 0``, two layers a virtual stage; 4 and 8 chunks where they split
the layers evenly: :data:`VIRTUAL`), with the reasons of those
refused before planning.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from spmdkit.core.errors import ProgramError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.cost.memory_saved import recompute_regions
from spmdkit.models.zoo import ModelConfig
from spmdkit.planner.schedules import interleaved_p2p_problem
from spmdkit.program.ir import Program
from spmdkit.program.runtime import Runtime
from spmdkit.strategies.context import hf_cp
from spmdkit.strategies.experts import tp_chunks
from spmdkit.strategies.hf_program import data_inputs
from spmdkit.strategies.strategy import (
    canonical_items,
    parse_mesh,
    parse_strategy,
    tp_comm_overlap_problem,
    tp_problem,
)

#: the sequence length from which a preset's search also splits the sequence over a ``cp`` dim
#: (context parallelism: Llama 3 trained from 8k with cp from 16k up; torchtitan and NeMo from 16k-32k)
LONG_SEQ = 16384


@dataclass(frozen=True)
class Config:
    """One point of the outer search. ``ep`` > 1: expert parallelism carved out of data
    parallelism as Megatron-Core folds it (the batch over ``dp x ep``, the experts over ``ep``)."""

    dp: int
    tp: int
    pp: int = 1
    strategy: str = "dp"      # a --strategy comma list, or "auto"
    recompute: str = "none"
    microbatches: int = 1
    ep: int = 1
    #: context parallelism: the sequence split over a cp dim between dp and tp (1: none)
    cp: int = 1
    #: gradient accumulation without a pipeline: micro-steps per optimizer step (--micro-batch)
    grad_accum: int = 1
    #: model chunks a pipeline rank holds (> 1: Megatron-LM's interleaved 1F1B, virtual stages)
    virtual: int = 1

    @property
    def ep_from_cp(self) -> bool:
        """The expert group carved from the cp ranks (``ep-from=cp`` in the strategy): outside the
        experts ep is one more cp dim, the batch over dp alone."""
        return "ep-from=cp" in self.strategy.split(",")

    @property
    def batch_ranks(self) -> int:
        """The ranks the global batch is split over: ``dp x ep`` (``dp`` with ``ep-from=cp``)."""
        return self.dp * (1 if self.ep_from_cp else self.ep)

    @property
    def sub_mesh_text(self) -> str:
        """The mesh the shardings are planned on (without pp); with ``ep-from=cp`` ep inside cp
        in rank order (Megatron-Core's expert group of consecutive ranks)."""
        ep, cp = (f"ep={self.ep}," if self.ep > 1 else ""), (f"cp={self.cp}," if self.cp > 1 else "")
        return f"dp={self.dp}," + (cp + ep if self.ep_from_cp else ep + cp) + f"tp={self.tp}"

    @property
    def mesh_text(self) -> str:
        return (f"pp={self.pp}," if self.pp > 1 else "") + self.sub_mesh_text

    @property
    def devices(self) -> int:
        return self.dp * self.ep * self.cp * self.tp * self.pp

    def label(self) -> str:
        return (f"dp={self.dp}" + (f" ep={self.ep}" if self.ep > 1 else "") + (f" cp={self.cp}" if self.cp > 1 else "")
                + f" tp={self.tp} pp={self.pp}"
                + (f" vp={self.virtual}" if self.virtual > 1 else "")
                + (f" (m={self.microbatches})" if self.pp > 1 else "")
                + (f" (accum={self.grad_accum})" if self.grad_accum > 1 else "")
                + f" {self.strategy}" + (f" recompute={self.recompute}" if self.recompute != "none" else ""))

    def to_json(self) -> dict[str, Any]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, **({"ep": self.ep} if self.ep > 1 else {}),
                **({"cp": self.cp} if self.cp > 1 else {}),
                **({"grad_accum": self.grad_accum} if self.grad_accum > 1 else {}),
                **({"virtual_stages": self.virtual} if self.virtual > 1 else {}),
                "strategy": self.strategy, "recompute": self.recompute, "microbatches": self.microbatches,
                "mesh": self.mesh_text}


def parse_memory(text: Any) -> int:
    """``80GB`` / ``80GiB`` / ``512MB`` / ``8e10`` (bytes) / an int -> bytes. GB is 10**9,
    GiB 2**30."""
    if isinstance(text, bool):
        raise ProgramError("--memory: expected a size such as 80GB or 80GiB")
    if isinstance(text, (int, float)):
        v = float(text)
    else:
        t = str(text).strip().replace(" ", "")
        units = {"tib": 1 << 40, "gib": 1 << 30, "mib": 1 << 20, "kib": 1 << 10, "tb": 10**12, "gb": 10**9,
                 "mb": 10**6, "kb": 10**3, "b": 1}
        k = 1
        low = t.lower()
        for u, mult in units.items():
            if low.endswith(u):
                k, t = mult, t[:-len(u)]
                break
        try:
            v = float(t) * k
        except ValueError:
            raise ProgramError(f"--memory {str(text)[:40]!r}: expected a size such as 80GB or 80GiB") from None
    if not (v == v) or not 1 <= v <= 1 << 60:
        raise ProgramError(f"--memory {str(text)[:40]!r}: expected a size from 1 byte to 1 EiB")
    return int(v)


#: context parallelism an import is traced for: (cp ranks, variant, balance) as
#: :func:`spmdkit.strategies.context.hf_cp` gives it (None: no cp, the tokens in order)
CpTrace = tuple[int, str, str] | None

#: an imported program traced again: (sequences, tp chunks, cp) -> the program at that batch, its
#: MoE blocks routing each sequence in that many chunks (:func:`spmdkit.strategies.experts.tp_chunks`;
#: 1: whole), in the cp ranks' token order with cp_attention where ``cp`` is given
#: (:mod:`spmdkit.models.hf_cp`), as ``spmdkit plan --hf`` imports it for one configuration
Reload = Callable[[int, int, CpTrace], Program]


def _cached(reload: Reload) -> Reload:
    """``reload`` tracing the program once per (batch, tp chunks, cp): the configurations that share
    a microbatch, a routing and a cp layout share one import (tracing is slow)."""
    done: dict[tuple[int, int, CpTrace], Program] = {}

    def get(batch: int, chunks: int, cp: CpTrace) -> Program:
        if (batch, chunks, cp) not in done:
            done[(batch, chunks, cp)] = reload(batch, chunks, cp)
        return done[(batch, chunks, cp)]

    return get


def program_for(cfg: Config, prog: Program, sizes: _Sizes, reload: Reload | None) -> tuple[Program, str]:
    """The program ``cfg`` is planned on and what its title says of it (the microbatches, the MoE
    routing): ``prog`` (traced at ``sizes.batch`` sequences, each routed whole), or with ``reload``
    the model traced again at a pipeline's microbatch (``batch / m`` sequences) and, under
    ``megatron,sp,ep,etp=1``, routed in tp chunks (Megatron's ETP = 1 token path,
    :func:`spmdkit.strategies.experts.tp_chunks`), as ``spmdkit plan --hf --strategy`` imports it
    for the same layout; not where ep x tp does not divide the experts (planning refuses that
    for the experts whatever the routing, so it is not traced for); on a cp mesh (a ``,cp``
    strategy) traced in the cp ranks' token order with cp_attention of the strategy's variant
    (:func:`spmdkit.strategies.context.hf_cp`). Without ``reload`` (a program file) ``prog`` as it
    is: a strategy it was not traced for is refused when planned
    (:func:`spmdkit.strategies.experts.check_tp_chunks`, :func:`spmdkit.strategies.context.hf_cp_marks`)."""
    batch = sizes.batch
    if reload is None or not batch:
        return prog, ""
    parts, sub = cfg.strategy.split(","), _sub_mesh(cfg)
    chunks = 1 if cfg.strategy == "auto" else tp_chunks(sub, parts)
    if sizes.experts % (cfg.ep * cfg.tp):
        chunks = 1  # check_ep refuses ETP = 1 here before the routing is looked at
    cp = hf_cp(sub, ["cp"] if cfg.strategy == "auto" else parts, sizes.seq)  # auto: as plan --hf --auto
    micro = cfg.pp > 1 and cfg.microbatches > 1
    if not micro and chunks == 1 and cp is None:
        return prog, ""
    b = batch // cfg.microbatches if micro else batch
    note = (f"; {cfg.microbatches} microbatches of {b}" if micro else "") + \
        (f"; each sequence routed in {chunks} chunks, one a tp rank" if chunks > 1 else "") + \
        (f"; traced for cp over {cp[0]} ranks ({cp[1]}, {cp[2]})" if cp is not None else "")
    return reload(b, chunks, cp), note


def _applicable_modes(prog: Program, modes: list[str], given: bool) -> list[str]:
    """The recomputation modes that apply to ``prog`` (full and selective need numbered layers or
    an attention core): those given are checked (a ProgramError naming ``--recompute``), the
    default ones that do not apply are left out."""
    out = []
    for rc in modes:
        try:
            recompute_regions(prog, rc)
        except ProgramError:
            if given:
                raise
            continue
        out.append(rc)
    return out or ["none"]


def factorizations(n: int, pipeline: bool = True) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) with dp * tp * pp == n (pp == 1 unless ``pipeline``)."""
    out = []
    for pp in range(1, n + 1):
        if n % pp or (pp > 1 and not pipeline):
            continue
        rest = n // pp
        for tp in range(1, rest + 1):
            if rest % tp == 0:
                out.append((rest // tp, tp, pp))
    return sorted(out, key=lambda t: (t[2], t[1], t[0]))


#: the cp attention variants the search tries (strategies.context: allgather is the default)
CP_VARIANTS = (",cp", ",cp,cp-attention=ring", ",cp,cp-attention=alltoall")


def hand_strategies(dp: int, tp: int, ep: int = 1, cp: int = 1, experts: int = 0, from_cp: bool = False) -> list[str]:
    """The hand strategies a (dp, tp) sub-mesh can take (ZeRO only where dp > 1); with ``ep``
    > 1 (a ``dp x ep x tp`` sub-mesh) the same with expert parallelism (``,ep``; megatron's
    experts tensor-parallel over tp: ETP = TP), ZeRO where the data-parallel ranks ``dp x ep``
    are more than one; with ``cp`` > 1 (a ``dp x cp x tp`` sub-mesh) the same with context
    parallelism, each attention variant (``,cp``: allgather, ``,cp,cp-attention=ring``,
    ``,cp,cp-attention=alltoall``; a variant the heads refuse is kept among the refused), ZeRO
    where ``dp x cp`` (the ranks that reduce the gradients) are more than one. With ``experts``
    (the routed experts; 0: not given) that ``ep x tp`` divides, tp > 1 also offers ETP = 1
    (``megatron,sp,ep,etp=1``: each expert whole over the ep x tp ranks, docs/experts.md). ``from_cp``
    (ep carved from the cp ranks, :func:`ep_from_cp_degrees`): ETP = 1 alone (``dp,ep`` on tp = 1,
    ``megatron,sp,ep,etp=1`` where ``ep x tp`` divides the experts), each cp variant,
    ``,ep-from=cp``."""
    zeros = ["", ",zero1", ",zero2", ",zero3"] if dp * ep * cp > 1 else [""]
    bases = ["dp"] if tp == 1 else ["megatron", "megatron,sp"]
    if ep > 1:
        bases = [b + ",ep" for b in bases]
        if tp > 1 and experts and experts % (ep * tp) == 0:
            bases.append("megatron,sp,ep,etp=1")
        if from_cp:
            bases = [b + ",ep-from=cp" for b in bases if tp == 1 or "etp=1" in b]
    if cp > 1:
        bases = [b + v for b in bases for v in CP_VARIANTS]
    return [b + z for b in bases for z in zeros]


def context_degrees(dp_total: int, seq: int | None) -> list[int]:
    """The cp degrees a data-parallel degree ``dp_total`` can give its sequence to: 1, and for a
    sequence of :data:`LONG_SEQ` tokens or more every divisor ``cp`` > 1 of ``dp_total`` whose
    zig-zag chunks divide the sequence (``2 cp`` divides it)."""
    out = [1]
    if seq is not None and seq >= LONG_SEQ:
        out += [c for c in range(2, dp_total + 1) if dp_total % c == 0 and seq % (2 * c) == 0]
    return out


def ep_from_cp_degrees(dp_total: int, seq: int | None, experts: int) -> list[tuple[int, int]]:
    """(ep, cp) of the expert group carved from the context-parallel ranks (``ep-from=cp``): for
    each cp degree ``c`` > 1 of :func:`context_degrees` whose data-parallel ranks ``d = dp_total / c``
    are too few for an expert group ``e`` > 1 (``e > d``: Megatron-Core folds the expert group
    from the data-parallel ranks first, then the cp ranks) that divides ``c`` (leaving a cp dim of
    at least 2) and the experts, the ep dim ``e`` and the cp dim ``c / e``: the sequence is split
    over ``c`` ranks outside the experts as without ep. Empty for a dense model."""
    if not experts:
        return []
    return [(e, c // e) for c in context_degrees(dp_total, seq) if c > 1 for e in expert_degrees(c, experts)
            if 1 < e < c and e > dp_total // c]


def expert_degrees(dp_total: int, experts: int) -> list[int]:
    """The ep degrees a data-parallel degree ``dp_total`` can fold out (Megatron-Core: ``dp x ep``
    = the data-parallel ranks): the divisors of both it and the experts, 1 first."""
    return [e for e in range(1, dp_total + 1) if dp_total % e == 0 and (e == 1 or (experts and experts % e == 0))]


@dataclass(frozen=True)
class _Sizes:
    """What limits the factorisations: the global batch, the attention heads, the layers
    (None where unknown: an imported program has no heads or layers to divide)."""

    batch: int | None
    tokens: int | None
    heads: int | None
    layers: int | None
    #: a pipeline's step in microbatches of one sequence per dp rank (else the step whole, m = 1)
    microbatches: bool = True
    #: the preset's config (tp must split its heads, kv heads, FFN and vocabulary: tp_problem)
    config: ModelConfig | None = None
    #: routed experts (0: a dense model, no ep dim tried)
    experts: int = 0
    #: --micro-batch: sequences per data-parallel rank in one micro-step (None: the whole share
    #: without a pipeline, one sequence a microbatch with one)
    micro: int | None = None
    #: an imported model's sequence, where it can be traced again for cp (a preset's: its config's)
    seq: int | None = None


def program_sizes(prog: Program, layers: int, tokens: int | None, experts: int, reloads: bool) -> _Sizes:
    """The sizes of an imported or a program file's search: the batch its call was traced at (its
    data inputs' first axis); with ``reloads`` (an --hf model traced again per configuration)
    pipelines in microbatches and its sequence (the inputs' second axis: cp tried from
    :data:`LONG_SEQ`, a pipeline's microbatch traced in the cp ranks' token order as a flat plan's step)."""
    shapes = [prog.tensors[n].shape for n in data_inputs(prog) if prog.tensors[n].shape]
    batch = shapes[0][0] if shapes else None
    seq = shapes[0][1] if reloads and shapes and len(shapes[0]) > 1 else None
    return _Sizes(batch, tokens, None, layers or None, reloads, experts=experts, seq=seq)


def _work(devices: int, pipeline: bool, sizes: _Sizes, given: list[str] | None,
          auto: bool, tp_comm_overlap: bool = False, runtime: Runtime | None = None
          ) -> tuple[list[Config], list[tuple[Config, str]]]:
    """The configurations to plan (recomputation "none": the modes are priced on one plan) and
    those refused before planning, with the reason (under ``tp_comm_overlap``, ``--tp-comm-overlap``,
    :func:`~spmdkit.strategies.strategy.tp_comm_overlap_problem`, as ``plan`` refuses it; the
    interleaved schedule ``runtime``'s framework refuses, :func:`~spmdkit.planner.schedules.interleaved_p2p_problem`)."""
    work: list[Config] = []
    refused: list[tuple[Config, str]] = []
    batch = sizes.batch
    seq = sizes.config.seq if sizes.config is not None else sizes.seq
    for dpt, tp, pp in factorizations(devices, pipeline):
        why = None
        uneven = batch is not None and batch % dpt != 0
        if sizes.config is not None and (bad := tp_problem(sizes.config, tp)) is not None:
            why = bad
        elif sizes.heads is not None and sizes.heads % tp:
            why = f"tp={tp} does not divide the {sizes.heads} attention heads"
        elif sizes.layers is not None and sizes.layers < pp:
            why = f"pp={pp}: {sizes.layers} layers cannot fill {pp} stages"
        m = (batch // dpt) if (pp > 1 and batch and sizes.microbatches) else 1
        if uneven or why is not None:
            refused.append((Config(dpt, tp, pp, "*", "none", m),
                            f"dp={dpt} does not divide the batch {batch}" if uneven else str(why)))
        if why is not None:
            continue
        # ep = 1 and cp = 1 first: a dense model's meshes at a short sequence as they were; a batch dp
        # does not divide may still split over dp x cp (the cp ranks share their sequences)
        degrees = [(e, c, False) for e in expert_degrees(dpt, sizes.experts)
                   for c in (context_degrees(dpt, seq) if e == 1 else [1])]
        # then the expert group carved from the cp ranks where dp is too small for it (ep-from=cp)
        degrees += [(e, c, True) for e, c in ep_from_cp_degrees(dpt, seq, sizes.experts)]
        for ep, cp, from_cp in degrees:
            dp = dpt // ep // cp
            ranks = dp if from_cp else dp * ep  # the batch's ranks (ep-from=cp: dp alone)
            if batch is not None and batch % ranks:
                continue
            m = (batch // ranks) if (pp > 1 and batch and sizes.microbatches) else 1
            steps = [(m, 1)] if sizes.micro is None or batch is None else _micro_steps(batch, ranks, pp, sizes.micro)
            if not steps:
                refused.append((Config(dp, tp, pp, "*", "none", m, ep, cp), f"--micro-batch {sizes.micro} x "
                                f"{ranks} data-parallel ranks does not divide the global batch {batch}"))
                continue
            names = list(given) if given is not None else hand_strategies(dp, tp, ep, cp, sizes.experts, from_cp)
            if auto and not from_cp:  # (the exact search chooses shardings on a mesh, not where ep is carved from)
                names.append("auto")
            for s, (m, accum) in ((s, st) for st in steps for s in names):
                cfg = Config(dp, tp, pp, s, "none", m, ep, cp, accum)
                if s != "auto":
                    parts = canonical_items(s)  # (--strategy tp is megatron)
                    if ((tp > 1) != ("megatron" in parts)) or ((ep > 1) != ("ep" in parts)) \
                            or ((cp > 1) != ("cp" in parts)) or from_cp != ("ep-from=cp" in parts):
                        continue  # megatron over tp=1 is dp; ep over ep=1 is dp; an idle ep or tp dim repeats work
                        # (each tp rank the same sequences); the strategies go to the meshes of their own cp (and
                        # their own ep-from)
                    try:
                        parse_strategy(s, _sub_mesh(cfg))
                    except ProgramError as exc:
                        refused.append((cfg, str(exc)))
                        continue
                    why = tp_comm_overlap_problem(parts, s, tp) if tp_comm_overlap else None
                    if why is not None:  # as plan refuses it
                        refused.append((cfg, why))
                        continue
                work.append(cfg)
                if pp > 1 and m % pp == 0 and sizes.config is not None and sizes.layers is not None \
                        and sizes.layers >= 2 * pp:
                    # interleaved 1F1B (Megatron-LM's needs m % pp == 0): 2 chunks a rank, and 4 and
                    # 8 where they split the layers evenly (NeMo's Mixtral-8x7B: pp=4 x vp=8)
                    chunks = [replace(cfg, virtual=v) for v in VIRTUAL if v == 2 or sizes.layers % (pp * v) == 0]
                    why = interleaved_p2p_problem(pp, runtime.p2p_overlap, runtime.framework) if runtime else None
                    if why is None:
                        work += chunks
                    else:  # as plan refuses it
                        refused += [(c, why) for c in chunks]
    return work, refused


#: the model chunks a pipeline rank may hold (interleaved 1F1B's virtual stages) in the search:
#: 2 wherever the layers fill them, 4 and 8 where they divide the layers evenly
VIRTUAL = (2, 4, 8)


#: the micro-batches (sequences per data-parallel rank a forward) a search tries when given a
#: global batch but no micro-batch, beside a rank's whole share without a pipeline
MICRO_BATCHES = (1, 2, 4)


def _micro_steps(batch: int, ranks: int, pp: int, micro: int) -> list[tuple[int, int]]:
    """(microbatches, gradient accumulation) for each micro-batch tried on ``ranks`` data-parallel
    ranks: ``micro`` > 0 that one; 0 every one of :data:`MICRO_BATCHES` (and without a pipeline
    the rank's whole share, no accumulation, first) that divides a rank's share of ``batch``."""
    share = batch // ranks
    sizes = [micro] if micro else ([share] if pp == 1 else []) + [b for b in MICRO_BATCHES if b < share or pp > 1]
    out = []
    for b in dict.fromkeys(sizes):
        if b <= share and share % b == 0:
            out.append((share // b, 1) if pp > 1 else (1, share // b))
    return out


def _sub_mesh(cfg: Config) -> ProcessMesh:
    return parse_mesh(cfg.sub_mesh_text)


__all__ = ["LONG_SEQ", "MICRO_BATCHES", "VIRTUAL", "Config", "Reload", "context_degrees", "ep_from_cp_degrees", "CpTrace", "program_sizes",
           "expert_degrees", "factorizations",
           "parse_memory",
           "hand_strategies", "program_for"]
