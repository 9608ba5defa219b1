"""The data-parallel gradient buckets as the frameworks fill and launch them (:class:`Reducer`),
with FSDP2's reduce-scatter copy-in on the compute stream; used by the step
(:mod:`spmdkit.cost.step`, :mod:`spmdkit.cost.step_comm`), the pipeline's stages and the fold."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from spmdkit.core.reshard import Step
from spmdkit.cost.collectives import time_of
from spmdkit.program.plan import Plan
from spmdkit.program.runtime import FSDP2

#: DDP's bucket sizes (torch.nn.parallel.DistributedDataParallel: bucket_cap_mb=25, and the
#: first bucket dist._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB)
BUCKET_BYTES = 25 * 1024 * 1024
FIRST_BUCKET_BYTES = 1024 * 1024
#: Megatron-Core DDP's bucket: ``max(40000000, 1000000 * dp_size)`` parameters
#: (DistributedDataParallelConfig.bucket_size, megatron/core/distributed/distributed_data_parallel.py)
MEGATRON_BUCKET_PARAMS = 40_000_000
MEGATRON_BUCKET_PARAMS_PER_DP = 1_000_000
#: bf16 gradients are reduced in fp32 by both frameworks: Megatron-LM forces
#: accumulate_allreduce_grads_in_fp32 for bf16 (megatron/training/arguments.py), torchtitan's
#: FSDP2 MixedPrecisionPolicy has reduce_dtype = mixed_precision_reduce = float32
_REDUCE_ITEMSIZE = {"bfloat16": 4}
#: the parts of a model torchtitan's root FSDP2 module holds (the zoo's layer tags of
#: tok_embeddings, and of norm and output): torchtitan ``apply_fsdp`` (parallelize_llama.py, at
#: 9dec370) calls ``fully_shard`` on each transformer block, the last one with
#: ``reshard_after_forward=False`` ("FSDP would prefetch it immediately"), then on the model; FSDP2
#: does not reshard the root after forward (``FSDPState._lazy_init``: "For the root, do not reshard
#: after forward ... post_forward_mesh_info = None"), and reduce-scatters its gradients in the
#: backward's final callback (``_root_post_backward_final_callback``: its inputs, the token ids,
#: have no gradient to trigger its post-backward hook)
ROOT_LAYERS = ("embedding", "head")


@dataclass(frozen=True)
class Bucket:
    """A bucket of gradient reductions: launched when full (or at the end of the backward)."""

    kind: str
    mesh_dims: tuple[int, ...]
    reduce_type: str
    tensors: int
    bytes: int
    ready_s: float
    start_s: float
    time_s: float

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "mesh_dims": list(self.mesh_dims), "reduce_type": self.reduce_type,
                "tensors": self.tensors, "bytes": self.bytes, "ready_s": self.ready_s, "start_s": self.start_s,
                "time_s": self.time_s}


class Reducer:
    """The data-parallel gradient buckets, as the framework (``plan.runtime.framework``) makes
    them: one open bucket per (kind, mesh dims, reduce type, dtype), filled in the order the
    gradients are made and launched when full on the communication stream, one bucket after the
    other. Megatron-Core DDP: ``max(40M, 1M x dp)`` parameters a bucket; torchtitan: FSDP2
    reduce-scatters each layer's gradients at once (a bucket per layer), its replicate (DDP)
    torch's 1 MiB first bucket then 25 MiB. bf16 gradients are reduced in fp32. Used by
    :func:`estimate_step` and by the pipeline (:mod:`spmdkit.planner.pipeline`). ``hbm_rate``
    (FSDP2 frameworks): each reduce-scatter's copy-in (``foreach_reduce_scatter_copy_in``: its
    gradients read, its reduce-dtype input written) runs on the compute stream from the time its
    launch is seen, before the collective; ``blocked`` sums those seconds until the caller takes them."""

    def __init__(self, plan: Plan, single: bool = False, hbm_rate: float = 0.0) -> None:
        self.single = single  # every gradient in one bucket (Megatron's pipeline ranks > 0)
        self.hbm_rate = hbm_rate if plan.runtime.framework in FSDP2 else 0.0
        self.blocked = 0.0
        self.mesh = plan.mesh
        self.cost = plan.cost
        self.framework = plan.runtime.framework
        #: ``--grad-dtype bf16``: the gradients reduced in bf16, as they are held
        self.reduce_itemsize = {} if plan.runtime.grad_dtype == "bf16" else _REDUCE_ITEMSIZE
        #: Megatron-FSDP ``optim_grads_params`` (ZeRO-3 under ``megatron``): its buckets are its FSDP
        #: units, the TransformerLayers (Megatron-LM 1e057005 megatron/core/distributed/custom_fsdp:
        #: ``_get_parameter_groups`` puts a unit's parameters of one dtype and expert-ness in one
        #: bucket, not split by ``bucket_size``, and groups a unit's buckets of one expert-ness,
        #: ``bucket_group_of_bucket``; ``_post_backward`` hands all the unit's parameters to
        #: ``GradReducePipeline.reduce_gradients`` when its backward is done, which reduce-scatters a
        #: bucket group once all of it is ready, in one ``_coalescing_manager``). The parameters
        #: outside the units (embedding, final norm, output layer) are bucketed by ``bucket_size``
        #: as Megatron-Core's DDP is. Over the mesh dims of a step (the expert parameters' expert
        #: data-parallel group, the others' data-parallel group) that is one reduce-scatter a
        #: layer each. (``single`` keeps every gradient in one bucket, as the caller asks.)
        self.units = self.framework == "megatron" and bool(plan.storage) and not single
        self.buckets: list[Bucket] = []
        self.open: dict[tuple[Any, ...], list[Any]] = {}  # key -> [tensors, bytes, ready, cap, layer]
        self.free = 0.0  # when the communication stream is free
        self.first_cap = FIRST_BUCKET_BYTES
        self.launched: list[float] = []  # when each of ``buckets`` was launched

    def reduced_bytes(self, dtype: str, size: int) -> int:
        """The bytes a gradient of ``size`` bytes in ``dtype`` is reduced in (bf16 in fp32)."""
        itemsize = self.reduce_itemsize.get(dtype, 0)
        return size * itemsize // 2 if itemsize else size

    def _time(self, kind: str, dims: tuple[int, ...], size: int) -> float:
        return time_of(self.cost, kind, dims, size, self.mesh.shape)

    def _cap(self, kind: str, dims: tuple[int, ...], itemsize: int, unit: bool = False) -> float:
        if self.single or unit:
            return math.inf
        if self.framework == "megatron":
            dp = math.prod(self.mesh.shape[d] for d in dims)
            return max(MEGATRON_BUCKET_PARAMS, MEGATRON_BUCKET_PARAMS_PER_DP * dp) * itemsize
        if kind == "reduce_scatter":
            return math.inf  # FSDP2: the layer's gradients at once
        cap, self.first_cap = self.first_cap, BUCKET_BYTES
        return cap

    def _launch(self, key: tuple[Any, ...], now: float, seen: float | None = None) -> None:
        tensors, size, ready, _cap, _layer, held = self.open.pop(key)
        kind, dims, rt, _dt, _root = key
        dur = self._time(kind, dims, size)
        if self.hbm_rate > 0 and kind == "reduce_scatter":  # the copy-in first, after those before it
            copy_in = (held + size) / self.hbm_rate
            now = (now if seen is None else seen) + self.blocked + copy_in
            self.blocked += copy_in
        start = max(now, self.free)
        self.free = start + dur
        self.buckets.append(Bucket(kind, dims, rt, tensors, size, ready, start, dur))
        self.launched.append(now)

    def add(self, dtype: str, s: Step, size: int, now: float, layer: str = "") -> None:
        """A gradient of ``size`` bytes (its own dtype) ready at ``now``, made in ``layer``
        (torchtitan: a :data:`ROOT_LAYERS` gradient waits in the root's bucket for the end;
        Megatron-FSDP: a layer's gradients wait for the layer's backward to end, then go in one
        reduce-scatter a mesh-dims group, :attr:`units`)."""
        rs = s.kind == "reduce_scatter"
        unit = self.units and rs and layer not in ROOT_LAYERS
        fsdp = unit or (self.framework in FSDP2 and rs)
        # torchtitan's root waits for the end; Megatron-FSDP's parameters outside its units
        # (embedding, final norm, output layer) keep Megatron's size buckets, apart from the units'
        root = (fsdp and self.framework == "torchtitan" and layer in ROOT_LAYERS) or (self.units and rs and not unit)
        block = (s.kind, s.mesh_dims, s.reduce_type or "sum", dtype, False)
        key = (*block[:4], root)
        if self.units and rs:
            # Megatron-FSDP: the unit's post-backward hook reduces all its buckets once its
            # backward is done (the first gradient of another layer shows it)
            done = [k for k, v in self.open.items() if k[0] == "reduce_scatter" and not k[4] and v[4] != layer]
            end = max((self.open[k][2] for k in done), default=now)  # the unit's last gradient
            for k in done:
                self.open[k][2] = end
                self._launch(k, end, now)
        b = self.open.get(block)
        if b is not None and fsdp and b[4] != layer:
            self._launch(block, b[2], now)  # the previous layer's gradients are all made
        b = self.open.get(key)
        itemsize = self.reduce_itemsize.get(dtype, 0)
        held, size = size, self.reduced_bytes(dtype, size)
        if b is None:
            b = self.open[key] = [0, 0, now, self._cap(s.kind, s.mesh_dims, itemsize or 2, unit), layer, 0]
        b[0] += 1
        b[1] += size
        b[5] += held
        b[2] = now
        if b[1] >= b[3]:
            self._launch(key, now)

    def flush(self, now: float) -> float:
        """Launch every open bucket (the end of the backward); the time the last one is done
        (and the compute stream's copy-ins: ``blocked``)."""
        for key in sorted(self.open, key=lambda k: k[4]):  # the root's (torchtitan) last
            self._launch(key, now)
        return max(now + self.blocked, self.free)

    def take(self) -> float:
        """The copy-ins' compute seconds since the last take."""
        out, self.blocked = self.blocked, 0.0
        return out


__all__ = ["BUCKET_BYTES", "FIRST_BUCKET_BYTES", "MEGATRON_BUCKET_PARAMS", "MEGATRON_BUCKET_PARAMS_PER_DP", "ROOT_LAYERS",
           "Bucket", "Reducer"]
