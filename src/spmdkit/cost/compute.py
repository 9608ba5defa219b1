"""Compute cost of a plan: FLOPs and bytes per op on one device, roofline time from device
presets, the predicted training step (with and without overlap), tokens/s and MFU, and the
collectives some kernels run inside themselves. Standard library only. docs/devices.md.

Every figure is *per device*, after sharding: an op's tensors have the local (largest-shard)
shapes of the dist attrs the plan gives them (the inputs as the rule requires them, the
outputs as the rule makes them); a partial output costs the same local work as a whole one.

- :func:`op_cost` (plan, op index) -> :class:`OpCost`: FLOPs executed, model FLOPs (the same
  but without recomputation inside a kernel), bytes read and written in device memory, and
  whether the op runs on the tensor cores. Families: matmul ``2mnk`` (batched, transposed,
  their grads ``2mnk`` per input gradient), attention (``4·b·h·sq·sk·d``, halved when causal as
  flash-attention skips masked blocks; the grad ``2.5x`` executed, ``2x`` model), convolutions,
  einsum, and by bytes: elementwise, norms, softmax, losses, embedding / gathers, reductions,
  optimizer updates, copies. A rule not in these tables is *uncovered*: :func:`estimate_step`
  lists it (never a silent zero); :data:`COSTED` names every covered rule.
- :class:`Device` and :data:`DEVICES` (a100-40gb, a100-80gb, h100, h200): dense peak FLOP/s
  per dtype, HBM bandwidth, and the links (NVLink in a node, InfiniBand across nodes) that
  :func:`cost_model` maps onto the per-mesh-dim :class:`spmdkit.core.reshard.CostModel`.
- :func:`kernel_collectives` (plan): all-reduces inside ops (``c_softmax_with_cross_entropy``:
  max, sum of exp and the label logit over the ranks sharing the class axis).
- :func:`estimate_step` (plan, device): roofline time per op ``max(flops/peak, bytes/bw)``,
  communication, data-parallel gradient reductions in DDP buckets (first 1 MiB, then 25 MiB)
  overlapped with the backward, the step time serial and overlapped, tokens/s and MFU.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from spmdkit.core.dist_attr import TensorDistAttr, entry_dims
from spmdkit.core.errors import ProgramError, SpmdError
from spmdkit.core.mesh import ProcessMesh
from spmdkit.core.reshard import CostModel, LinkCost, ReshardPlan, Step
from spmdkit.program.ir import Program

# -- devices ------------------------------------------------------------------------------------

#: dtype of a program tensor -> the peak it computes a tensor-core op at
_PEAK_OF_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}
PEAK_KEYS = ("bf16", "fp16", "tf32", "fp32", "fp64")


@dataclass(frozen=True)
class Link:
    """One class of link: latency (s) and bandwidth per direction per GPU (bytes/s)."""

    alpha_s: float
    bytes_per_s: float

    def cost(self) -> LinkCost:
        return LinkCost(self.alpha_s, 1.0 / self.bytes_per_s)


@dataclass(frozen=True)
class Device:
    """A GPU: dense peak FLOP/s per dtype (tensor cores for bf16 / fp16 / tf32; fp32 and fp64
    the non-tensor rates), HBM bandwidth (bytes/s), memory (bytes), the link within a node and
    the link across nodes, ranks per node. ``tf32``: float32 matmuls run on the tensor cores
    (PyTorch's ``allow_tf32``; off by default as in PyTorch)."""

    name: str
    peak: dict[str, float]
    hbm_bytes_per_s: float
    memory_bytes: int
    intra: Link
    inter: Link
    ranks_per_node: int = 8
    tf32: bool = False

    def matmul_peak(self, dtype: str) -> float:
        key = _PEAK_OF_DTYPE.get(dtype, "fp32")
        if key == "fp32" and self.tf32:
            key = "tf32"
        return self.peak.get(key) or self.peak["fp32"]

    @property
    def vector_peak(self) -> float:
        """The rate of the non-tensor-core ops (elementwise, norms, ...): the fp32 peak."""
        return self.peak["fp32"]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "peak_tflops": {k: v / 1e12 for k, v in self.peak.items()},
                "hbm_gb_per_s": self.hbm_bytes_per_s / 1e9, "memory_gb": self.memory_bytes / 1e9,
                "intra_node": {"latency_us": self.intra.alpha_s * 1e6, "gb_per_s": self.intra.bytes_per_s / 1e9},
                "inter_node": {"latency_us": self.inter.alpha_s * 1e6, "gb_per_s": self.inter.bytes_per_s / 1e9},
                "ranks_per_node": self.ranks_per_node, "tf32": self.tf32}


T = 1e12
G = 1e9
#: NVLink and InfiniBand latencies are not datasheet figures: the planner's defaults
#: (spmdkit.core.reshard: 5 us in a node, 20 us across), docs/devices.md.
_NVLINK3 = Link(5e-6, 300 * G)   # A100 SXM4: NVLink 600 GB/s bidirectional = 300 GB/s each way
_NVLINK4 = Link(5e-6, 450 * G)   # H100 / H200 SXM5: 900 GB/s bidirectional = 450 GB/s each way
_IB_HDR = Link(20e-6, 25 * G)    # DGX A100: one 200 Gb/s HDR InfiniBand port per GPU
_IB_NDR = Link(20e-6, 50 * G)    # DGX H100 / H200: one 400 Gb/s NDR ConnectX-7 port per GPU

#: Dense peaks by dtype: A100 SXM4 (40 and 80 GB alike) and H100 / H200 SXM5 (the same GPU).
_A100_PEAKS = {"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T, "fp64": 9.7 * T}
_H100_PEAKS = {"bf16": 989.5 * T, "fp16": 989.5 * T, "tf32": 494.5 * T, "fp32": 67 * T, "fp64": 34 * T}

#: The presets (docs/devices.md gives the datasheet of every figure; dense, not sparse).
DEVICES: dict[str, Device] = {
    "a100-40gb": Device("NVIDIA A100 SXM4 40GB", dict(_A100_PEAKS), 1555 * G, 40 * 1024**3, _NVLINK3, _IB_HDR),
    "a100-80gb": Device("NVIDIA A100 SXM4 80GB", dict(_A100_PEAKS), 2039 * G, 80 * 1024**3, _NVLINK3, _IB_HDR),
    "h100": Device("NVIDIA H100 SXM5 80GB", dict(_H100_PEAKS), 3350 * G, 80 * 1024**3, _NVLINK4, _IB_NDR),
    "h200": Device("NVIDIA H200 SXM5 141GB", dict(_H100_PEAKS), 4800 * G, 141 * 10**9, _NVLINK4, _IB_NDR),
}
_DEVICE_ALIASES = {"a100": "a100-80gb", "a100-80": "a100-80gb", "a100-40": "a100-40gb", "h100-sxm": "h100",
                   "h100-80gb": "h100", "h200-sxm": "h200", "h200-141gb": "h200"}

_JSON_KEYS = {"name", "peak_tflops", "hbm_gb_per_s", "memory_gb", "intra_node", "inter_node", "ranks_per_node",
              "tf32", "base"}


def _num(what: str, v: Any, positive: bool = True, scale: float = 1.0) -> float:
    """``v * scale`` for a finite number ``v`` (> 0, or >= 0), the product finite too."""
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and (1e-9 <= v <= 1e30 or v == 0)
    x = float(v) * scale if ok else math.nan
    if not ok or not math.isfinite(x) or x < 0 or (positive and x == 0):
        raise ProgramError(f"--device {what}: expected a number from {'1e-9' if positive else '0'} to 1e30, "
                           f"got {json.dumps(v)[:40]}")
    return x


def _link(what: str, v: Any, base: Link) -> Link:
    if not isinstance(v, dict) or set(v) - {"latency_us", "gb_per_s"}:
        raise ProgramError(f"--device {what}: expected an object with latency_us and gb_per_s")
    a = _num(f"{what}.latency_us", v["latency_us"], False, 1e-6) if "latency_us" in v else base.alpha_s
    b = _num(f"{what}.gb_per_s", v["gb_per_s"], True, G) if "gb_per_s" in v else base.bytes_per_s
    return Link(a, b)


def device_from_json(obj: Any) -> Device:
    """A :class:`Device` from its JSON object (the format of :meth:`Device.to_json`; ``base``
    names a preset whose figures the others override). ProgramError naming the field."""
    if not isinstance(obj, dict):
        raise ProgramError("--device: the file must hold a JSON object")
    unknown = sorted(set(obj) - _JSON_KEYS)
    if unknown:
        raise ProgramError(f"--device: unknown field {unknown[0][:40]!r} (fields: {', '.join(sorted(_JSON_KEYS))})")
    base: Device | None = None
    if "base" in obj:
        if not isinstance(obj["base"], str):
            raise ProgramError("--device base: expected a preset name")
        base = preset_device(obj["base"])
    else:
        missing = [k for k in ("peak_tflops", "hbm_gb_per_s") if k not in obj]
        if missing:
            raise ProgramError(f"--device: missing {missing[0]!r} (or give \"base\": a preset to start from)")
    peak = dict(base.peak) if base else {}
    if "peak_tflops" in obj:
        pk = obj["peak_tflops"]
        if not isinstance(pk, dict) or not pk:
            raise ProgramError(f"--device peak_tflops: expected an object of {', '.join(PEAK_KEYS)} -> TFLOP/s")
        for k, v in pk.items():
            if k not in PEAK_KEYS:
                raise ProgramError(f"--device peak_tflops: unknown dtype {str(k)[:20]!r} (one of {', '.join(PEAK_KEYS)})")
            peak[k] = _num(f"peak_tflops.{k}", v, True, T)
    if "fp32" not in peak:
        raise ProgramError("--device peak_tflops: needs fp32 (the rate of the non-tensor-core ops)")
    hbm = _num("hbm_gb_per_s", obj["hbm_gb_per_s"], True, G) if "hbm_gb_per_s" in obj else \
        (base.hbm_bytes_per_s if base else 0.0)
    mem = int(_num("memory_gb", obj["memory_gb"], True, G)) if "memory_gb" in obj else \
        (base.memory_bytes if base else 0)
    intra = _link("intra_node", obj["intra_node"], base.intra if base else _NVLINK4) if "intra_node" in obj \
        else (base.intra if base else _NVLINK4)
    inter = _link("inter_node", obj["inter_node"], base.inter if base else _IB_NDR) if "inter_node" in obj \
        else (base.inter if base else _IB_NDR)
    rpn = obj.get("ranks_per_node", base.ranks_per_node if base else 8)
    if isinstance(rpn, bool) or not isinstance(rpn, int) or not 1 <= rpn <= 1 << 20:
        raise ProgramError(f"--device ranks_per_node: expected an integer from 1 to {1 << 20}")
    tf32 = obj.get("tf32", base.tf32 if base else False)
    if not isinstance(tf32, bool):
        raise ProgramError("--device tf32: expected true or false")
    name = obj.get("name", (base.name + " (modified)") if base else "custom device")
    if not isinstance(name, str):
        raise ProgramError("--device name: expected a string")
    return Device(name[:100], peak, hbm, mem, intra, inter, rpn, tf32)


def preset_device(name: str) -> Device:
    key = _DEVICE_ALIASES.get(name.strip().lower(), name.strip().lower())
    try:
        return DEVICES[key]
    except KeyError:
        raise ProgramError(f"--device {name[:60]!r}: no such preset ({', '.join(DEVICES)}) and not a .json "
                           f"file") from None


def load_device(text: str) -> Device:
    """A preset name (``h100``) or the path of a JSON file (:func:`device_from_json`)."""
    if not text.strip().lower().endswith(".json"):
        return preset_device(text)
    if not os.path.isfile(text):
        raise ProgramError(f"--device {text[:100]!r}: no such file")
    try:
        with open(text, encoding="utf-8") as f:
            raw = f.read(1 << 20)
        obj = json.loads(raw)
    except (OSError, UnicodeDecodeError) as exc:
        raise ProgramError(f"--device {text[:100]!r}: cannot read it ({type(exc).__name__})") from None
    except (ValueError, RecursionError) as exc:
        raise ProgramError(f"--device {text[:100]!r}: not valid JSON ({str(exc)[:80]})") from None
    return device_from_json(obj)


def cost_model(mesh: ProcessMesh, device: Device | None = None, ranks_per_node: int | None = None) -> CostModel:
    """Links per mesh dim: walking from the innermost (last) mesh dim outwards, a dim is in a
    node while the product of the sizes so far is at most ``ranks_per_node`` (the device's by
    default), else across nodes. Without a device, the planner's default links."""
    rpn = ranks_per_node or (device.ranks_per_node if device else 8)
    if device is None:
        return CostModel.default(mesh, intra_node=rpn)
    links: list[LinkCost] = []
    prod = 1
    for size in reversed(mesh.shape):
        prod *= size
        links.append((device.intra if prod <= rpn else device.inter).cost())
    return CostModel(tuple(reversed(links)))


def _retime(s: Step, cost: CostModel, mesh: ProcessMesh) -> Step:
    if s.bytes_per_rank == 0:
        return s
    n = 1
    for d in s.mesh_dims:
        n *= mesh.shape[d]
    k = 2 if s.kind == "all_reduce" else 1
    a = sum(cost.links[d].alpha_s for d in s.mesh_dims) / len(s.mesh_dims)
    b = max(cost.links[d].beta_s_per_byte for d in s.mesh_dims)
    return replace(s, time_s=k * (n - 1) * a + s.bytes_per_rank * b)


def recost(plan: Any, cost: CostModel) -> Any:
    """The plan with every reshard step timed by ``cost`` (same steps and bytes)."""
    from spmdkit.program.plan import Plan, Reshard

    assert isinstance(plan, Plan)
    memo: dict[int, ReshardPlan] = {}
    new: dict[int, Reshard] = {}

    def rp(p: ReshardPlan) -> ReshardPlan:
        q = memo.get(id(p))
        if q is None:
            q = ReshardPlan(tuple(_retime(s, cost, plan.mesh) for s in p.steps))
            memo[id(p)] = q
        return q

    def rs(r: Reshard) -> Reshard:
        x = new.get(id(r))
        if x is None:
            x = replace(r, plan=rp(r.plan))
            new[id(r)] = x
        return x

    ops = [replace(o, reshards=[rs(r) for r in o.reshards]) for o in plan.ops]
    return replace(plan, ops=ops, reshards=[rs(r) for r in plan.reshards], cost=cost)


# -- per-op cost --------------------------------------------------------------------------------


@dataclass(frozen=True)
class OpCost:
    """One op on one device: FLOPs executed, model FLOPs (without a kernel's recomputation),
    bytes read + written in device memory, whether it runs on the tensor cores (at the matmul
    peak of ``dtype``), and whether its rule is costed at all."""

    flops: float
    model_flops: float
    bytes: float
    matmul: bool = False
    dtype: str = "float32"
    covered: bool = True

    def time_s(self, device: Device) -> float:
        peak = device.matmul_peak(self.dtype) if self.matmul else device.vector_peak
        return max(self.flops / peak, self.bytes / device.hbm_bytes_per_s)


_Arg = tuple[tuple[int, ...], int, str]  # local shape, itemsize, dtype


_LOCAL: dict[tuple[tuple[int, ...], TensorDistAttr], tuple[int, ...]] = {}


def _local(shape: tuple[int, ...], attr: TensorDistAttr | None) -> tuple[int, ...]:
    """The largest shard's shape (memoised: a model repeats few (shape, dist attr) pairs)."""
    if attr is None:
        return shape
    got = _LOCAL.get((shape, attr))
    if got is None:
        if len(_LOCAL) > 100_000:
            _LOCAL.clear()
        got = _LOCAL[(shape, attr)] = _local_shape(shape, attr)
    return got


def _local_shape(shape: Sequence[int], attr: TensorDistAttr) -> tuple[int, ...]:
    ms = attr.mesh.shape
    out = []
    for size, e in zip(shape, attr.dims_mapping):
        k = 1
        for d in entry_dims(e):
            k *= ms[d]
        out.append(-(-size // k) if k > 1 else size)
    return tuple(out)


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class _Ctx:
    """An op's local tensors: ``ins[param]`` (a list: a vector parameter has several) and
    ``outs`` (per output position, None where absent)."""

    def __init__(self, plan: Any, i: int) -> None:
        from spmdkit.program.ir import flat_refs

        prog = plan.program
        op = prog.ops[i]
        opp = plan.ops[i]
        self.op = op
        self.ins: dict[str, list[_Arg]] = {}
        for p, v in op.inputs.items():
            names = flat_refs(v)
            req = opp.required.get(p)
            reqs = list(req) if isinstance(req, tuple) else [req] * len(names)
            args = []
            for n, a in zip(names, reqs):
                if n is None:
                    continue
                t = prog.tensors[n]
                args.append((_local(t.shape, a if a is not None else plan.attrs.get(n)), t.itemsize, t.dtype))
            if args:
                self.ins[p] = args
        self.outs: list[_Arg | None] = []
        for k, v in enumerate(op.outputs):
            got = opp.outputs[k] if k < len(opp.outputs) else None
            names = flat_refs(v)
            attrs = list(got) if isinstance(got, tuple) else [got] * len(names)
            for n, a in zip(names, attrs):
                if n is None:
                    self.outs.append(None)
                    continue
                t = prog.tensors[n]
                self.outs.append((_local(t.shape, a if a is not None else plan.attrs.get(n)), t.itemsize, t.dtype))

    def one(self, p: str) -> _Arg | None:
        a = self.ins.get(p)
        return a[0] if a else None

    def attr(self, name: str, default: Any = None) -> Any:
        return self.op.attrs.get(name, default)

    @property
    def in_bytes(self) -> int:
        return sum(_numel(s) * b for args in self.ins.values() for s, b, _ in args)

    @property
    def out_bytes(self) -> int:
        return sum(_numel(o[0]) * o[1] for o in self.outs if o is not None)

    @property
    def out_numel(self) -> int:
        return sum(_numel(o[0]) for o in self.outs if o is not None)

    def first_out(self) -> _Arg | None:
        return next((o for o in self.outs if o is not None), None)

    def dtype(self) -> str:
        for args in self.ins.values():
            for _, _, dt in args:
                return dt
        o = self.first_out()
        return o[2] if o else "float32"


def _k_of(x: _Arg, trans: bool) -> int:
    s = x[0]
    if len(s) == 0:
        return 1
    if len(s) == 1:
        return s[0]
    return s[-2] if trans else s[-1]


def _matmul_out_numel(c: _Ctx) -> int:
    """Elements of the (local) product, from the output if the op lists it, else from x, y."""
    x, y = c.one("x") or c.one("input"), c.one("y") or c.one("weight")
    tx = bool(c.attr("trans_x", False))
    ty = bool(c.attr("trans_y", c.attr("transpose_weight", False)))
    assert x is not None and y is not None
    xs, ys = x[0], y[0]
    m = 1 if len(xs) < 2 else (xs[-1] if tx else xs[-2])
    n = 1 if len(ys) < 2 else (ys[-2] if ty else ys[-1])
    bx, by = xs[:-2], ys[:-2]
    nb = max(len(bx), len(by))
    bx = (1,) * (nb - len(bx)) + tuple(bx)
    by = (1,) * (nb - len(by)) + tuple(by)
    batch = _numel(max(a, b) for a, b in zip(bx, by))
    return batch * m * n


def _matmul(c: _Ctx) -> OpCost:
    x = c.one("x") or c.one("input")
    assert x is not None
    k = _k_of(x, bool(c.attr("trans_x", False)))
    f = 2.0 * _matmul_out_numel(c) * k
    if c.one("bias") is not None:
        f += _matmul_out_numel(c)
    return OpCost(f, f, c.in_bytes + c.out_bytes, True, c.dtype())


def _matmul_grad(c: _Ctx) -> OpCost:
    x = c.one("x") or c.one("input")
    assert x is not None
    k = _k_of(x, bool(c.attr("trans_x", False)))
    grads = sum(1 for o in c.outs[:2] if o is not None)
    f = 2.0 * _matmul_out_numel(c) * k * grads
    return OpCost(f, f, c.in_bytes + c.out_bytes, True, c.dtype())


def _param_grad_add(c: _Ctx) -> OpCost:
    x, dout = c.one("x"), c.one("dout")
    assert x is not None and dout is not None
    k = x[0][-1] if x[0] else 1
    f = 2.0 * _numel(dout[0]) * k
    return OpCost(f, f, c.in_bytes + c.out_bytes, True, c.dtype())


def _attention_fwd_flops(c: _Ctx) -> float:
    """QK^T and PV of flash attention (q [b, sq, h, d], k [b, sk, hk, d], v [b, sk, hk, dv]):
    ``2·b·h·sq·sk·(d + dv)``, halved when causal (the kernel skips the masked blocks)."""
    q, k, v = c.one("q"), c.one("k"), c.one("v")
    assert q is not None and k is not None and v is not None
    b, sq, h, d = q[0][-4], q[0][-3], q[0][-2], q[0][-1]
    sk, dv = k[0][-3], v[0][-1]
    f = 2.0 * b * h * sq * sk * (d + dv)
    return f / 2 if c.attr("causal", False) else f


def _attention(c: _Ctx) -> OpCost:
    f = _attention_fwd_flops(c)
    return OpCost(f, f, c.in_bytes + c.out_bytes, True, c.dtype())


def _attention_grad(c: _Ctx) -> OpCost:
    """The backward recomputes QK^T: five matmuls to the forward's two (2.5x executed), the
    model counts 2x (FlashAttention's own accounting)."""
    f = _attention_fwd_flops(c)
    return OpCost(2.5 * f, 2.0 * f, c.in_bytes + c.out_bytes, True, c.dtype())


def _conv(c: _Ctx) -> OpCost:
    """``2 · out elements · (in channels / groups · kernel elements)`` (filter [m, c/g, ...])."""
    w = c.one("filter")
    o = c.first_out()
    assert w is not None and o is not None
    f = 2.0 * _numel(o[0]) * _numel(w[0][1:])
    return OpCost(f, f, c.in_bytes + c.out_bytes, True, c.dtype())


def _conv_transpose(c: _Ctx) -> OpCost:
    x, w = c.one("input"), c.one("filter")
    assert x is not None and w is not None
    f = 2.0 * _numel(x[0]) * _numel(w[0][1:])
    return OpCost(f, f, c.in_bytes + c.out_bytes, True, c.dtype())


def _conv_transpose_grad(c: _Ctx) -> OpCost:
    x, w = c.one("input"), c.one("filter")
    assert x is not None and w is not None
    grads = sum(1 for o in c.outs[:2] if o is not None)
    f = 2.0 * _numel(x[0]) * _numel(w[0][1:]) * grads
    return OpCost(f, f, c.in_bytes + c.out_bytes, True, c.dtype())


def _conv_grad(c: _Ctx) -> OpCost:
    w, go = c.one("filter"), c.one("output_grad") or c.one("out_grad")
    assert w is not None and go is not None
    grads = sum(1 for o in c.outs[:2] if o is not None)
    f = 2.0 * _numel(go[0]) * _numel(w[0][1:]) * grads
    return OpCost(f, f, c.in_bytes + c.out_bytes, True, c.dtype())


def _einsum_flops(c: _Ctx) -> float | None:
    eq = str(c.attr("equation", ""))
    lhs = eq.split("->")[0]
    terms = lhs.split(",")
    xs = c.ins.get("inputs") or c.ins.get("x") or []
    if "." in eq or len(terms) != len(xs):
        return None
    size: dict[str, int] = {}
    for t, (s, _, _) in zip(terms, xs):
        if len(t) != len(s):
            return None
        for ch, n in zip(t, s):
            size[ch] = max(size.get(ch, 1), n)
    return (2.0 if len(xs) > 1 else 1.0) * _numel(size.values())


def _einsum(c: _Ctx) -> OpCost:
    f = _einsum_flops(c)
    if f is None:
        return OpCost(0.0, 0.0, c.in_bytes + c.out_bytes, covered=False)
    if c.op.rule.endswith("_grad"):
        f *= max(1, sum(1 for o in c.outs if o is not None))
    return OpCost(f, f, c.in_bytes + c.out_bytes, True, c.dtype())


def _by_bytes(per_element: float) -> Any:
    """Memory-bound ops: every input read and output written once; ``per_element`` FLOPs per
    output element (nominal: the roofline time of these is their bytes)."""
    def cost(c: _Ctx) -> OpCost:
        f = per_element * c.out_numel
        return OpCost(f, f, c.in_bytes + c.out_bytes, False, c.dtype())
    return cost


def _gather(c: _Ctx) -> OpCost:
    """Lookups (embedding, index_select, gather, ...): the rows read equal the output written,
    plus the indices."""
    idx = sum(_numel(s) * b for args in c.ins.values() for s, b, dt in args if dt.startswith(("int", "uint")))
    return OpCost(0.0, 0.0, 2 * c.out_bytes + idx, False, c.dtype())


def _scatter_grad(c: _Ctx) -> OpCost:
    """Gradients of lookups: the weight (x) gradient zeroed and written, the output gradient
    read and added into it."""
    og = c.one("out_grad")
    ogb = _numel(og[0]) * og[1] if og else 0
    f = float(_numel(og[0])) if og else 0.0
    return OpCost(f, f, c.out_bytes + 2 * ogb, False, c.dtype())


def _view(c: _Ctx) -> OpCost:
    """Views (reshape, squeeze, ...): metadata only, no kernel."""
    return OpCost(0.0, 0.0, 0.0, False, c.dtype())


def _fill(c: _Ctx) -> OpCost:
    return OpCost(0.0, 0.0, c.out_bytes, False, c.dtype())


def _empty(c: _Ctx) -> OpCost:
    return OpCost(0.0, 0.0, 0.0, False, c.dtype())


_UNARY = """abs acos acosh asin asinh atan atanh ceil celu conj cos cosh digamma elu erf erfinv exp expm1 floor
hardshrink hardsigmoid hardswish hardtanh leaky_relu lgamma log log10 log1p log2 logit logsigmoid mish reciprocal
relu relu6 round rsqrt selu sigmoid sign silu sin sinh softplus softshrink softsign sqrt square stanh swish tan tanh
tanh_shrink thresholded_relu trunc scale cast clip pow bitwise_not logical_not elementwise_unary assign dropout
bernoulli poisson label_smooth""".split()
_BINARY = """add subtract multiply divide elementwise_add elementwise_div elementwise_mul elementwise_binary
elementwise_pow maximum minimum fmax fmin floor_divide remainder trunc_divide heaviside greater_than less_than
not_equal logical_and logical_or logical_xor bitwise_and bitwise_or bitwise_xor where fused_dropout_add""".split()
_REDUCE = """sum mean max min prod all any reduce_base mean_all logsumexp p_norm frobenius_norm squared_l2_norm
numel argmax argmin""".split()
_COPY = """transpose expand expand_as tile concat split split_with_num stack unbind slice strided_slice pad roll
tril_triu triu one_hot cumsum cummax cummin argsort topk unique nonzero index_put scatter
scatter_nd_add put_along_axis coalesce_tensor check_finite_and_unscale update_loss_scaling moe_gate_dispatch
moe_combine""".split()
_VIEWS = "reshape squeeze unsqueeze flatten".split()
_GATHER = "embedding c_embedding index_select gather gather_nd take_along_axis".split()
_SCATTER_GRAD = "embedding_grad c_embedding_grad index_select_grad gather_grad gather_nd_grad " \
                "take_along_axis_grad".split()

#: nominal FLOPs per output element of some memory-bound ops (the rest: 1, views and copies 0)
_PER_ELEMENT = {"gelu": 8, "gelu_grad": 10, "silu": 4, "silu_grad": 6, "swiglu": 5, "swiglu_grad": 8,
                "softmax": 5, "softmax_grad": 3, "log_softmax": 5, "log_softmax_grad": 3,
                "layer_norm": 8, "layer_norm_grad": 12, "fused_rms_norm": 5, "rms_norm_grad": 8,
                "batch_norm": 8, "batch_norm_grad": 12, "group_norm": 8, "group_norm_grad": 12,
                "instance_norm": 8, "instance_norm_grad": 12,
                "fused_rotary_position_embedding": 3, "fused_rotary_position_embedding_grad": 3,
                "cross_entropy_with_softmax": 6, "cross_entropy_with_softmax_grad": 2,
                "c_softmax_with_cross_entropy": 6, "c_softmax_with_cross_entropy_grad": 2,
                "c_softmax_with_multi_label_cross_entropy": 6, "c_softmax_with_multi_label_cross_entropy_grad": 2,
                "adamw": 6, "adam": 5, "sgd": 1, "add_n": 1, "add_n_grad": 0}

_FAMILY: dict[str, Any] = {}
for _n in ("matmul", "bmm", "linear_v2", "fused_gemm_epilogue"):
    _FAMILY[_n] = _matmul
for _n in ("matmul_grad", "bmm_grad", "linear_v2_grad", "fused_gemm_epilogue_grad"):
    _FAMILY[_n] = _matmul_grad
_FAMILY["fused_linear_param_grad_add"] = _param_grad_add
_FAMILY["flash_attention"] = _attention
_FAMILY["flash_attention_grad"] = _attention_grad
for _n in ("conv2d", "conv3d", "depthwise_conv2d"):
    _FAMILY[_n] = _conv
    _FAMILY[_n + "_grad"] = _conv_grad
_FAMILY["conv2d_transpose"] = _conv_transpose
_FAMILY["einsum"] = _einsum
_FAMILY["einsum_grad"] = _einsum
for _n in _VIEWS:
    _FAMILY[_n] = _view
    _FAMILY[_n + "_grad"] = _view
for _n in _GATHER:
    _FAMILY[_n] = _gather
for _n in _SCATTER_GRAD:
    _FAMILY[_n] = _scatter_grad
for _n in ("zeros_like", "ones_like", "full_like", "fill"):
    _FAMILY[_n] = _fill
_FAMILY["empty_like"] = _empty
for _n in [*_UNARY, *_BINARY, *_REDUCE, *_COPY]:
    _FAMILY.setdefault(_n, _by_bytes(0 if _n in _COPY else _PER_ELEMENT.get(_n, 1)))
    _FAMILY.setdefault(_n + "_grad", _by_bytes(0 if _n in _COPY else _PER_ELEMENT.get(_n + "_grad", 1)))
for _n, _k in _PER_ELEMENT.items():
    _FAMILY.setdefault(_n, _by_bytes(_k))
_FAMILY["default_data_parallel"] = _by_bytes(0)
_FAMILY["roi_align"] = _by_bytes(_PER_ELEMENT.get("roi_align", 16))  # 4 bilinear taps per sample
_FAMILY["roi_align_grad"] = _by_bytes(16)
_FAMILY["conv2d_transpose_grad"] = _conv_transpose_grad


def _registered() -> frozenset[str]:
    from spmdkit.engine.registry import has_rule

    for n in [n for n in _FAMILY if not has_rule(n)]:  # a grad name the family tables made up
        del _FAMILY[n]
    return frozenset(_FAMILY)


#: every registered rule with a cost; the others (today: ``replicated``, the importer's stand-in
#: for an op it could not map) are listed as uncovered by :func:`estimate_step`
COSTED = _registered()


def _canonical(rule: str) -> str:
    from spmdkit.engine.registry import get_rule

    try:
        return get_rule(rule).name
    except SpmdError:  # an unknown name is simply not costed
        return rule


def op_cost(plan: Any, i: int) -> OpCost:
    """The cost of op ``i`` of ``plan`` on one device (see the module docstring)."""
    op = plan.program.ops[i]
    fam = _FAMILY.get(op.rule) or _FAMILY.get(_canonical(op.rule))
    c = _Ctx(plan, i)
    if fam is None:
        return OpCost(0.0, 0.0, c.in_bytes + c.out_bytes, False, c.dtype(), covered=False)
    try:
        cost: OpCost = fam(c)
    except (AssertionError, IndexError, TypeError, ValueError):
        return OpCost(0.0, 0.0, c.in_bytes + c.out_bytes, False, c.dtype(), covered=False)
    return cost


# -- collectives inside kernels -----------------------------------------------------------------


@dataclass(frozen=True)
class KernelCollective:
    """A collective an op's kernel runs itself (not a reshard of the plan)."""

    op_index: int
    rule: str
    what: str
    kind: str
    mesh_dims: tuple[int, ...]
    reduce_type: str
    bytes_per_rank: int
    time_s: float

    def to_json(self) -> dict[str, Any]:
        return {"op_index": self.op_index, "rule": self.rule, "what": self.what, "kind": self.kind,
                "mesh_dims": list(self.mesh_dims), "reduce_type": self.reduce_type,
                "bytes_per_rank": self.bytes_per_rank, "time_s": self.time_s}


#: rules whose kernels all-reduce over the mesh dims sharding the class (last) axis of ``x``:
#: (what, reduce type) per all-reduce of a float32 [rows] buffer (Megatron-LM's
#: vocab_parallel_cross_entropy, Paddle's c_softmax_with_cross_entropy kernel)
_CLASS_AXIS_ALLREDUCES = {
    "c_softmax_with_cross_entropy": (("row max of the logits", "max"), ("label logit", "sum"), ("sum of exp", "sum")),
    "c_softmax_with_multi_label_cross_entropy": (("row max of the logits", "max"), ("label logits", "sum"),
                                                 ("sum of exp", "sum")),
}


def kernel_collectives(plan: Any) -> list[KernelCollective]:
    """The all-reduces inside ops, timed with the plan's cost model (one per mesh dim of the
    group: a class axis co-sharded on two dims is reduced over each)."""
    out: list[KernelCollective] = []
    mesh = plan.mesh
    for i, op in enumerate(plan.program.ops):
        spec = _CLASS_AXIS_ALLREDUCES.get(op.rule)
        if spec is None:
            continue
        attr = plan.ops[i].required.get("x")
        name = op.inputs.get("x")
        if not isinstance(attr, TensorDistAttr) or not isinstance(name, str) or not attr.dims_mapping:
            continue
        dims = entry_dims(attr.dims_mapping[-1])
        if not dims:
            continue
        local = _local(plan.program.tensors[name].shape, attr)
        rows = _numel(local[:-1])
        if op.rule == "c_softmax_with_multi_label_cross_entropy":
            lab = op.inputs.get("label")
            if isinstance(lab, str):
                rows = _numel(_local(plan.program.tensors[lab].shape, plan.ops[i].required.get("label")))
        size = 4 * rows
        for what, rt in spec:
            for d in dims:
                n = mesh.shape[d]
                b = round(2 * (n - 1) / n * size)
                link = plan.cost.links[d]
                out.append(KernelCollective(i, op.rule, what, "all_reduce", (d,), rt, b,
                                            2 * (n - 1) * link.alpha_s + b * link.beta_s_per_byte))
    return out


# -- the step -----------------------------------------------------------------------------------

#: DDP's bucket sizes (torch.nn.parallel.DistributedDataParallel: bucket_cap_mb=25, and the
#: first bucket dist._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB)
BUCKET_BYTES = 25 * 1024 * 1024
FIRST_BUCKET_BYTES = 1024 * 1024


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


@dataclass
class StepEstimate:
    """The predicted training step of a plan on a device (seconds, per device)."""

    device: Device
    ranks: int
    compute_s: dict[str, float]
    comm_s: dict[str, float]
    kernel_comm_s: float
    grad_sync_s: float
    buckets: list[Bucket]
    step_serial_s: float
    step_overlap_s: float
    flops_per_device: float
    model_flops_per_device: float
    bytes_per_device: float
    tokens: int | None
    model_flops: float
    n_params: int
    attention_flops: float
    uncovered: dict[str, int]
    matmul_s: float = 0.0
    memory_bound_ops: int = 0
    kernel: list[KernelCollective] = field(default_factory=list)
    #: the tensor-core peak MFU divides by (the program's parameter dtype)
    peak: float = 0.0
    #: activation recomputation (none, selective, full) and the FLOPs per device it re-runs
    recompute: str = "none"
    recompute_flops_per_device: float = 0.0
    #: model FLOPs plus the matmul / attention FLOPs recomputed on every rank (HFU's numerator)
    hardware_flops: float = 0.0
    #: all-gathers run again in the backward (a tensor kept as its producer's shard)
    regathers: int = 0
    #: one micro-step in program order, per op: (op index, start s, blocking communication s
    #: before it, recomputation and re-gathers s before it, its compute s); the gradient buckets
    #: run beside it on their own stream (:attr:`buckets`)
    timeline: list[tuple[int, float, float, float, float]] = field(default_factory=list, repr=False)

    @property
    def compute_total_s(self) -> float:
        return sum(self.compute_s.values())

    @property
    def comm_total_s(self) -> float:
        return sum(self.comm_s.values()) + self.kernel_comm_s + self.grad_sync_s

    @property
    def exposed_comm_s(self) -> float:
        return self.step_overlap_s - self.compute_total_s

    @property
    def tokens_per_s(self) -> float | None:
        return None if not self.tokens else self.tokens / self.step_overlap_s

    @property
    def mfu(self) -> float | None:
        """Model FLOPs per second over the peak of every device (bf16/fp16 tensor-core peak of
        the program's dtype)."""
        if not self.tokens or self.step_overlap_s <= 0:
            return None
        return self.model_flops / (self.step_overlap_s * self.ranks * self.peak)

    @property
    def hfu(self) -> float | None:
        """Hardware FLOPs utilisation: :attr:`hardware_flops` (the recomputed forward matmuls
        counted too, as Korthikanti et al. 2022 count them) over the same peak."""
        if not self.tokens or self.step_overlap_s <= 0:
            return None
        return self.hardware_flops / (self.step_overlap_s * self.ranks * self.peak)

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device.to_json(), "ranks": self.ranks,
                "compute_s": dict(self.compute_s), "compute_total_s": self.compute_total_s,
                "matmul_s": self.matmul_s,
                "comm_s": {**self.comm_s, "inside_ops": self.kernel_comm_s, "gradient_buckets": self.grad_sync_s},
                "comm_total_s": self.comm_total_s, "step_serial_s": self.step_serial_s,
                "step_overlap_s": self.step_overlap_s, "exposed_comm_s": self.exposed_comm_s,
                "flops_per_device": self.flops_per_device, "model_flops_per_device": self.model_flops_per_device,
                "bytes_per_device": self.bytes_per_device, "tokens": self.tokens,
                "tokens_per_s": self.tokens_per_s, "model_flops": self.model_flops, "parameters": self.n_params,
                "attention_flops": self.attention_flops, "peak_flops": self.peak, "mfu": self.mfu,
                "recompute": self.recompute, "recompute_flops_per_device": self.recompute_flops_per_device,
                "hardware_flops": self.hardware_flops, "hfu": self.hfu, "regathers": self.regathers,
                "memory_bound_ops": self.memory_bound_ops,
                "buckets": [b.to_json() for b in self.buckets], "uncovered_rules": dict(self.uncovered)}


def is_grad_sync(plan: Any, r: Any, s: Step, param_grads: frozenset[str]) -> bool:
    """A parameter gradient's reduction: before its optimizer update, or (ZeRO-1/2/3, the
    gradient held reduced) right after the backward op that makes it."""
    prog = plan.program
    if s.kind not in ("all_reduce", "reduce_scatter") or prog.tensors[r.tensor].kind != "gradient":
        return False
    if not r.output:
        return bool(prog.ops[r.op_index].phase == "optimizer")
    return r.tensor in param_grads


def model_flops(plan: Any, tokens: int) -> tuple[float, int, float]:
    """(model FLOPs of the step, N, attention FLOPs) as Narayanan et al. (2021) and PaLM
    (Chowdhery et al. 2022, appendix B) count them: ``6·N·tokens`` with N the parameters a
    matmul reads (an embedding table read only by a lookup does no multiply), plus the
    attention's ``QK^T`` and ``PV`` over the full ``s x s`` square, three times (forward and
    backward): PaLM's ``12·L·H·Q·T`` per token. Global shapes; attention is flash_attention or
    a forward matmul of two batched activations (rank >= 3: an imported program's weights may be
    activations, transposed or split, but are 2-D)."""
    prog = plan.program
    lookups = {"embedding", "c_embedding", "index_select", "gather", "gather_nd", "take_along_axis"}
    read_by: dict[str, set[str]] = {}
    for op in prog.ops:
        if op.phase != "forward":
            continue
        for n in op.input_names():
            read_by.setdefault(n, set()).add(op.rule)
    n_params = 0
    for t in prog.tensors.values():
        if t.kind == "parameter" and not t.inplace_of:
            rules = read_by.get(t.name, set())
            if rules and rules <= lookups:
                continue
            n_params += t.numel
    att = 0.0
    for op in prog.ops:
        if op.phase != "forward":
            continue
        if op.rule == "flash_attention":
            q, k, v = (prog.tensors[op.inputs[p]].shape for p in ("q", "k", "v"))
            att += 2.0 * q[-4] * q[-2] * q[-3] * k[-3] * (q[-1] + v[-1])
        elif op.rule in ("matmul", "bmm"):
            x, y = op.inputs.get("x"), op.inputs.get("y")
            if not isinstance(x, str) or not isinstance(y, str):
                continue
            if prog.tensors[x].kind in ("parameter", "input") or prog.tensors[y].kind in ("parameter", "input"):
                continue
            if len(prog.tensors[x].shape) < 3 or len(prog.tensors[y].shape) < 3:
                continue  # a weight made an activation (transposed, split by megatron_program): not attention
            xs = prog.tensors[x].shape
            out = op.output_names()
            if not out or not xs:
                continue
            k_ = _k_of((xs, 0, ""), bool(op.attrs.get("trans_x", False)))
            att += 2.0 * prog.tensors[out[0]].numel * k_
    att *= 3
    return 6.0 * n_params * tokens + att, n_params, att


def guess_tokens(program: Program) -> int | None:
    """Tokens per step of a program: the elements of its token-id input (``tokens`` or
    ``input_ids``, else the first integer input of rank 2), None if it has none."""
    ins = [t for t in program.tensors.values() if t.kind == "input"]
    for t in ins:
        if t.name in ("tokens", "input_ids"):
            return t.numel
    for t in ins:
        if t.dtype in ("int64", "int32") and len(t.shape) == 2:
            return t.numel
    return None


def estimate_step(plan: Any, device: Device, tokens: int | None = None, recompute: str = "none") -> StepEstimate:
    """The training step of ``plan`` on ``device`` (every rank one such device). Roofline time
    per op; communication from the plan's reshards (timed by the plan's cost model: see
    :func:`recost`) and :func:`kernel_collectives`. Gradient reductions (a parameter gradient
    all-reduced or reduce-scattered before its optimizer update) go into DDP buckets in the
    order the backward makes the gradients; a bucket is launched when full and at the end of
    the backward. Serial: everything one after the other. Overlapped: the buckets run on their
    own stream while the backward computes; every other collective blocks (the optimizer waits
    for own stream while the backward computes; every other collective blocks (the optimizer waits
    for the last bucket). ``recompute`` (none, selective, full; :func:`spmdkit.cost.memory.saved_activations`):
    the recomputed forward ops (and their forward collectives) run again in the backward right
    before the first op that reads their outputs (``compute_s["recompute"]``,
    ``comm_s["recompute"]``); a tensor kept as its producer's shard (sequence parallel's norm
    outputs) is all-gathered again there (``comm_s["backward"]``). MFU counts model FLOPs only,
    so recomputation lowers it; :attr:`StepEstimate.hfu` counts the recomputed matmuls too."""
    prog = plan.program
    kern = kernel_collectives(plan)
    kern_by_op: dict[int, float] = {}
    for k in kern:
        kern_by_op[k.op_index] = kern_by_op.get(k.op_index, 0.0) + k.time_s
    blocking: dict[int, float] = {}
    pending: dict[int, list[tuple[str, Step, int]]] = {}  # producer op -> gradient reductions
    producer: dict[str, int] = {}
    for i, op in enumerate(prog.ops):
        for n in op.output_names():
            producer.setdefault(n, i)
    comm = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    param_grads = plan.param_grads()
    for r in plan.reshards:
        if r.shared:
            continue
        phase = prog.ops[r.op_index].phase
        for s in r.plan.steps:
            if s.bytes_per_rank == 0:
                continue
            if is_grad_sync(plan, r, s, param_grads):
                t = prog.tensors[r.tensor]
                size = _numel(_local(t.shape, s.src)) * t.itemsize
                at = producer.get(r.tensor, r.op_index)
                pending.setdefault(at, []).append((t.dtype, s, size))
            else:
                blocking[r.op_index] = blocking.get(r.op_index, 0.0) + s.time_s
                comm[phase] += s.time_s
    compute = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    uncovered: dict[str, int] = {}
    flops = mflops = nbytes = matmul_s = 0.0
    memory_bound = 0
    times: list[float] = []
    costs: list[OpCost] = []
    for i, op in enumerate(prog.ops):
        c = op_cost(plan, i)
        costs.append(c)
        if not c.covered:
            uncovered[op.rule] = uncovered.get(op.rule, 0) + 1
        t = c.time_s(device)
        times.append(t)
        compute[op.phase] = compute.get(op.phase, 0.0) + t
        flops += c.flops
        mflops += c.model_flops
        nbytes += c.bytes
        if c.matmul:
            matmul_s += t
        if c.bytes / device.hbm_bytes_per_s > c.flops / (device.matmul_peak(c.dtype) if c.matmul else
                                                          device.vector_peak) and t > 0:
            memory_bound += 1
    # -- activation recomputation and the backward's re-gathers
    from spmdkit.cost.memory import rerun_points, saved_activations

    saved = saved_activations(plan, recompute)
    rerun, regather = rerun_points(plan, saved)
    extra_at: dict[int, float] = {}
    re_flops = re_mm_flops = 0.0
    for at, idx in rerun.items():
        for j in idx:
            c = costs[j]
            re_flops += c.flops
            if c.matmul:
                re_mm_flops += c.model_flops
            compute["recompute"] = compute.get("recompute", 0.0) + times[j]
            cm = blocking.get(j, 0.0) + kern_by_op.get(j, 0.0)
            comm["recompute"] = comm.get("recompute", 0.0) + cm
            extra_at[at] = extra_at.get(at, 0.0) + times[j] + cm
    n_regather = 0
    for at, ks in regather.items():
        for ix in ks:
            t_ = plan.reshards[ix].plan.time_s
            n_regather += 1
            comm["backward"] += t_
            extra_at[at] = extra_at.get(at, 0.0) + t_
    flops += re_flops
    # -- buckets, in the order the gradients are made
    mesh = plan.mesh
    buckets: list[Bucket] = []
    open_: dict[tuple[Any, ...], list[Any]] = {}  # key -> [tensors, bytes, ready, cap]
    comm_free = 0.0
    first_cap = FIRST_BUCKET_BYTES

    def bucket_time(kind: str, dims: tuple[int, ...], size: int) -> float:
        n = 1
        for d in dims:
            n *= mesh.shape[d]
        cost: CostModel = plan.cost
        a = sum(cost.links[d].alpha_s for d in dims) / len(dims)
        b = max(cost.links[d].beta_s_per_byte for d in dims)
        if kind == "all_reduce":
            return 2 * (n - 1) * a + round(2 * (n - 1) / n * size) * b
        return (n - 1) * a + round((n - 1) / n * size) * b

    def launch(key: tuple[Any, ...], now: float) -> None:
        nonlocal comm_free
        tensors, size, ready, _cap = open_.pop(key)
        kind, dims, rt, _dt = key
        dur = bucket_time(kind, dims, size)
        start = max(now, comm_free)
        comm_free = start + dur
        buckets.append(Bucket(kind, dims, rt, tensors, size, ready, start, dur))

    clock = 0.0
    serial_compute = 0.0
    timeline: list[tuple[int, float, float, float, float]] = []
    flushed = False
    for i, op in enumerate(prog.ops):
        if op.phase == "optimizer" and not flushed:
            for key in list(open_):
                launch(key, clock)
            clock = max(clock, comm_free)
            flushed = True
        timeline.append((i, clock, blocking.get(i, 0.0) + kern_by_op.get(i, 0.0), extra_at.get(i, 0.0), times[i]))
        clock += blocking.get(i, 0.0) + kern_by_op.get(i, 0.0) + times[i] + extra_at.get(i, 0.0)
        serial_compute += times[i]
        for dt, s, size in pending.get(i, []):
            key = (s.kind, s.mesh_dims, s.reduce_type or "sum", dt)
            b = open_.get(key)
            if b is None:
                b = open_[key] = [0, 0, clock, first_cap]
                first_cap = BUCKET_BYTES
            b[0] += 1
            b[1] += size
            b[2] = clock
            if b[1] >= b[3]:
                launch(key, clock)
    if not flushed:
        for key in list(open_):
            launch(key, clock)
        clock = max(clock, comm_free)
    grad_sync = sum(b.time_s for b in buckets)
    kern_total = sum(k.time_s for k in kern)
    serial = serial_compute + compute.get("recompute", 0.0) + sum(comm.values()) + kern_total + grad_sync
    n_ranks = mesh.size
    mf, n_params, att = model_flops(plan, tokens or 0)
    dtypes = [t.dtype for t in prog.tensors.values() if t.kind == "parameter"]
    main_dtype = max(set(dtypes), key=dtypes.count) if dtypes else "float32"
    accum = getattr(plan, "grad_accum", 1)
    if accum > 1:
        # gradient accumulation: accum - 1 more forward and backward passes before the one above,
        # whose backward overlaps the step's only gradient reductions
        extra = (accum - 1) * (compute["forward"] + compute["backward"] + comm["forward"] + comm["backward"]
                           + kern_total)
        serial += extra
        clock += extra
        for ph in ("forward", "backward"):
            compute[ph] *= accum
            comm[ph] *= accum
        kern_total *= accum
        opt_flops = [op_cost(plan, i) for i, op in enumerate(prog.ops) if op.phase == "optimizer"]
        of, om, ob = (sum(c.flops for c in opt_flops), sum(c.model_flops for c in opt_flops),
                      sum(c.bytes for c in opt_flops))
        flops, mflops, nbytes = (accum * (flops - of) + of, accum * (mflops - om) + om, accum * (nbytes - ob) + ob)
        matmul_s *= accum
        tokens = tokens * accum if tokens else tokens
        mf = mf * accum
    est = StepEstimate(device, n_ranks, compute, comm, kern_total, grad_sync, buckets, serial, clock, flops, mflops,
                       nbytes, tokens, mf if tokens else 0.0, n_params, att * accum, uncovered, matmul_s, memory_bound, kern)
    est.peak = device.matmul_peak(main_dtype)
    est.recompute = recompute
    est.recompute_flops_per_device = re_flops
    est.hardware_flops = (mf + n_ranks * re_mm_flops) if tokens else 0.0
    est.regathers = n_regather
    est.timeline = timeline
    return est


__all__ = ["BUCKET_BYTES", "COSTED", "DEVICES", "Bucket", "Device", "FIRST_BUCKET_BYTES", "KernelCollective", "Link",
           "OpCost", "StepEstimate", "cost_model", "device_from_json", "estimate_step", "guess_tokens",
           "is_grad_sync", "kernel_collectives", "load_device", "model_flops", "op_cost", "preset_device", "recost"]
