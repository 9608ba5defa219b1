"""How torch's own context parallelism runs a plan's cp (docs/context.md), checked against torch
2.13's ``torch.distributed.tensor.experimental.context_parallel``.

What torch 2.13 offers (``torch/distributed/tensor/experimental/_context_parallel/_attention.py``):

- ``context_parallel(mesh, buffers=[...], buffer_seq_dims=[...], no_restore_buffers=...)``: a
  context manager that shards each buffer in place on its sequence dim over a **1-D** device mesh
  (the cp sub-mesh, ``mesh["cp"]``) and, while it is open, replaces the SDPA kernels
  (``aten._scaled_dot_product_{flash,efficient,cudnn}_attention``) by ring versions over that
  mesh's process group (the query / key sequence on SDPA's dim 2). No attention bias or mask is
  supported (``attn_bias is not supported yet``): only ``is_causal`` or full attention.
- Load balance: with ``_cp_options.enable_load_balance`` (on by default) and the sequence a
  multiple of ``2 x cp``, ``_HeadTailLoadBalancer`` reorders the buffers before sharding so rank
  ``i`` holds chunks ``i`` and ``2cp-1-i``: spmdkit's zig-zag. The buffers are given in natural
  order (torch reorders them); spmdkit's program already holds the tokens in that order, with
  their positions (``cp.positions``), which torch's kernels do not need. Load balancing needs
  ``is_causal=True``; ``--cp-balance none`` is the option set to False.
- ``set_rotate_method("allgather" | "alltoall")``: how the kv shards move. ``"allgather"`` (the
  default) all-gathers k and v once and runs the local blocks against them: spmdkit's
  ``allgather``. ``"alltoall"`` passes each rank's kv block to the next rank at every step with
  one all-to-all (``funcol.permute_tensor``), overlapped with the block's SDPA: spmdkit's
  ``ring``, except that torch has **no send/recv (p2p) ring**: its ring step is a collective.
  Either way torch's backward passes the dK / dV accumulators round the ring by that all-to-all
  (spmdkit's allgather reduce-scatters them instead).
- There is no DeepSpeed-Ulysses (head / sequence all-to-all) method: spmdkit's ``alltoall`` has
  no torch equivalent. Attention that is not SDPA (spmdkit's eager attention: scores by matmul,
  softmax, a mask) is not touched by ``context_parallel``.

:func:`torch_context_parallel` says this for one plan; issue 31's ``--export torch`` and the
DTensor export (``"context_parallel"``) read it.
"""

from __future__ import annotations

from typing import Any

from spmdkit.core.dist_attr import entry_dims
from spmdkit.program.plan import Plan

#: spmdkit's cp_attention variant -> torch's ``set_rotate_method`` (None: torch has none)
ROTATE = {"allgather": "allgather", "ring": "alltoall", "alltoall": None}
#: the torch release this was checked against
TORCH = "2.13"
API = "torch.distributed.tensor.experimental.context_parallel"

_WHY_NOT = {
    "alltoall": "torch's context_parallel has no head/sequence all-to-all (DeepSpeed-Ulysses): the plan's "
                "all-to-alls around attention are not expressible there",
    "eager": "the model's attention is eager (scores by matmul, a causal mask, softmax): torch's context_parallel "
             "replaces the SDPA kernels only",
}
_RING = ("torch's 'alltoall' rotater passes each kv block to the next rank by one all-to-all per step "
         "(funcol.permute_tensor), overlapped with the block's SDPA; torch offers no send/recv (p2p) ring, which "
         "spmdkit's ring kernel uses")


def _cp_buffers(plan: Plan, cp: int) -> dict[str, int]:
    """The data inputs split on the cp mesh dim: name -> their sequence axis (``cp.*`` positions
    left out: torch's kernels mask by the load balancer's layout, not by positions)."""
    out: dict[str, int] = {}
    for t in plan.program.tensors.values():
        a = plan.attrs.get(t.name)
        if t.kind != "input" or a is None or t.name.startswith("cp."):
            continue
        axes = [i for i, e in enumerate(a.dims_mapping) if cp in entry_dims(e)]
        if axes:
            out[t.name] = axes[0]
    return dict(sorted(out.items()))


def torch_context_parallel(plan: Plan) -> dict[str, Any] | None:
    """How torch's ``context_parallel`` runs ``plan``'s context parallelism, or None where the
    plan splits nothing over a ``cp`` mesh dim. Keys: ``api``, ``torch`` (the release checked),
    ``mesh_dim`` ("cp": torch takes the 1-D sub-mesh ``mesh["cp"]``), ``variant`` (spmdkit's
    cp_attention variant, "eager" for attention by matmul), ``supported``, ``rotate_method``
    (``set_rotate_method``'s argument, None where unsupported), ``buffers`` (name -> sequence
    dim: ``context_parallel``'s ``buffers`` / ``buffer_seq_dims``, in natural token order),
    ``sdpa_seq_dim`` (2), ``load_balance`` (torch's head-tail balancer = spmdkit's zig-zag:
    ``_cp_options.enable_load_balance``), ``p2p_ring`` (False: torch has none), ``note``."""
    mesh = plan.mesh
    if "cp" not in mesh.dim_names or mesh.shape[mesh.dim_index("cp")] == 1:
        return None
    cp = mesh.dim_index("cp")
    buffers = _cp_buffers(plan, cp)
    ops = [op for op in plan.program.ops if op.rule == "cp_attention"]
    if not ops and not buffers:
        return None
    variant = str(ops[0].attrs.get("variant", "allgather")) if ops else "eager"
    balance = str(ops[0].attrs.get("balance", "zigzag")) == "zigzag" if ops else False
    rotate = ROTATE.get(variant)
    if rotate is None:
        note = _WHY_NOT[variant]
    else:
        note = f"torch's context_parallel runs SDPA over the sequence by {rotate} (set_rotate_method({rotate!r}))"
        if variant == "ring":
            note += "; " + _RING
    return {"api": API, "torch": TORCH, "mesh_dim": "cp", "variant": variant, "supported": rotate is not None,
            "rotate_method": rotate, "buffers": buffers, "sdpa_seq_dim": 2, "load_balance": balance,
            "p2p_ring": False, "note": note}


__all__ = ["API", "ROTATE", "TORCH", "torch_context_parallel"]
