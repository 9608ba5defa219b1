"""Each flash-attention kernel's shape on a GPU (:attr:`spmdkit.cost.rates.Rates.attention_shape`:
``S0``, ``D0``, the causal share) fitted to the kernel's own published bars and nothing else:

- ``a100 triton`` and ``h100 triton`` (MPT's pre-MLIR Triton kernel, priced as FlashAttention v1, which
  its docstring compares it with): the flash-attention repo's forward + backward figures on A100 (the
  FlashAttention-2 paper's Figure 4) and H100, "FlashAttention" (:data:`~spmdkit.cost.rates.FA1_A100_FIG4`,
  :data:`~spmdkit.cost.rates.FA1_H100_PAIR`);
- ``a100 triton-fig4``: the same A100 figure's "FlashAttention Triton" (OpenAI's ``triton.ops.flash_attention``,
  not MPT's kernel; :data:`~spmdkit.cost.rates.TRITON_A100_FIG4`), the ``triton`` rates before, kept as a record;
- ``a100 fa2``: the same figure, "FlashAttention-2" (:data:`~spmdkit.cost.rates.FA2_A100_FIG4`);
- ``h100 fa2``: FlashAttention-2 on H100 SXM5, forward + backward (the flash-attention repo's
  assets/flash2_h100_fwd_bwd_benchmark.png, :data:`~spmdkit.cost.rates.FA2_H100_PAIR`) and the
  FlashAttention-3 paper's forward and backward figures, "FlashAttention-2"
  (:data:`~spmdkit.cost.rates.FA3_H100_FWD`, :data:`~spmdkit.cost.rates.FA3_H100_BWD`);
- ``h100 cudnn``: the FlashAttention-3 paper's forward and backward figures, "cuDNN".

The form is :func:`spmdkit.cost.rates.attention_efficiency`'s: an asymptote per pass (forward,
backward, or the forward + backward pair a figure gives: each a free parameter, in closed form)
times ``s / (s + S0)`` (causal: half the sequence) times ``d / (d + D0)`` normalised at 128 (capped
at 1) times the causal share on causal points; least squares in log over the kernel's points (a grid
over ``S0`` and ``D0``; the asymptotes and the causal share in closed form: the share is the
regression of the log residual on causality within each pass). The form caps the head-dim term at
1 above 128, so the head-dim-256 bars (the FlashAttention-3 forward figure's) are printed beside
the fit but not fitted. ``python benchmarks/fit_attention.py`` prints each fit and each point.

Then a held-out check: Transformer Engine's attention benchmark on H100 (SXM5: cuDNN 9.3.0 and
flash-attn 2.4.2; PCIe: cuDNN 9.2.0; :data:`~spmdkit.cost.rates.TE_H100_MS`), each time turned into
TFLOP/s by its config (:func:`te_tflops`) beside the fitted kernel's forward + backward rate at that
config and the preset's (:func:`spmdkit.cost.rates.attention_efficiency` of the H100 preset, no
sustained share), both of the same form. They are not fitted on the default path; ``--with-te``
adds the SXM5 points to the ``h100`` fits (a pass group of their own, ``te``, with its own
asymptote, as the flash-attention repo's forward + backward figure has) and prints the shapes and
preset asymptotes that would give (:func:`with_te_presets`).
"""

from __future__ import annotations

import argparse
import math
from typing import NamedTuple

from spmdkit.cost.rates import (
    FA1_A100_FIG4,
    FA1_H100_PAIR,
    FA2_A100_FIG4,
    FA2_H100_PAIR,
    FA3_H100_BWD,
    FA3_H100_FWD,
    H100_RATES,
    TE_ATTENTION_CONFIGS,
    TE_H100_MS,
    TRITON_A100_FIG4,
    attention_efficiency,
)

SEQS = (512, 1024, 2048, 4096, 8192, 16384)
#: the bf16 / fp16 dense tensor-core peaks the figures' TFLOP/s are fractions of (NVIDIA datasheets)
PEAK = {"a100": 312.0, "h100": 989.5}
#: the bf16 dense tensor-core peaks of the two H100 SKUs Transformer Engine's notebook ran on (NVIDIA's
#: H100 datasheet: SXM 1,979 and PCIe 1,513 TFLOP/s with sparsity): the PCIe card (114 SMs, 350 W)
#: is compared as a fraction of its own peak
TE_PEAK = {"sxm": 989.5, "pcie": 1513.0 / 2}
#: the largest head dim the form models (its head-dim term is capped at 1 above 128)
MAX_HEAD_DIM = 128


class Point(NamedTuple):
    passes: str  # "pair" (forward + backward), "fwd" or "bwd"
    causal: bool
    head_dim: int
    seq: int
    tflops: float


class Fit(NamedTuple):
    sse: float  # error sum of squares in log
    asymptotes: dict[str, float]  # pass -> non-causal asymptote, a fraction of the peak
    share: float  # causal asymptote / non-causal
    s0: float
    d0: float
    n: int

    @property
    def rms(self) -> float:
        return math.sqrt(self.sse / self.n)


def _pair(figure: dict[tuple[bool, int], tuple[int, ...]]) -> list[Point]:
    return [Point("pair", c, d, s, t) for (c, d), bars in figure.items() for s, t in zip(SEQS, bars)]


def te_flops(test: str) -> float:
    """The forward + backward FLOPs of Transformer Engine's benchmark config ``test``, the papers'
    count: forward ``4 b h s^2 d``, backward 2.5x it, halved when causal (GQA changes no FLOPs)."""
    b, h, _, d, s, causal, _ = TE_ATTENTION_CONFIGS[test]
    flops = 4.0 * b * h * s * s * d * 3.5
    return flops / 2 if causal else flops


def te_tflops(sku: str, kernel: str, test: str) -> float:
    """TFLOP/s of ``kernel`` on config ``test`` from the time the notebook printed for ``sku``."""
    return te_flops(test) / (TE_H100_MS[sku][(kernel, test)] * 1e-3) / 1e12


def te_points(kernel: str) -> list[Point]:
    """The H100 SXM5 measurements of ``kernel`` as fit points (pass group ``te``; the bias config
    left out: the form has no bias)."""
    out = []
    for k, test in TE_H100_MS["sxm"]:
        _, _, _, d, s, causal, bias = TE_ATTENTION_CONFIGS[test]
        if k == kernel and not bias:
            out.append(Point("te", causal, d, s, te_tflops("sxm", kernel, test)))
    return out


def points(gpu: str, kernel: str, with_te: bool = False) -> list[Point]:
    """Every transcribed point of ``kernel`` on ``gpu`` (head dim 256 included); ``with_te``: the
    Transformer Engine measurements too (h100 only)."""
    if gpu == "a100":
        return _pair({"triton": FA1_A100_FIG4, "triton-fig4": TRITON_A100_FIG4, "fa2": FA2_A100_FIG4}[kernel])
    if kernel == "triton":
        return _pair(FA1_H100_PAIR)
    out = _pair(FA2_H100_PAIR) if kernel == "fa2" else []
    out += [Point("fwd", c, d, s, t) for (k, c, d), bars in FA3_H100_FWD.items() if k == kernel
            for s, t in zip(SEQS, bars)]
    out += [Point("bwd", False, d, s, t) for (k, d), bars in FA3_H100_BWD.items() if k == kernel
            for s, t in zip(SEQS, bars)]
    return out + te_points(kernel) if with_te else out


FITS = (("a100", "triton"), ("h100", "triton"), ("a100", "triton-fig4"), ("a100", "fa2"), ("h100", "fa2"),
        ("h100", "cudnn"))


def shape(s0: float, d0: float, causal: bool, head_dim: int, seq: int) -> float:
    """``attention_efficiency``'s sequence and head-dim terms (its asymptote and share 1)."""
    s = seq / 2 if causal else seq
    dsat = min(1.0, (head_dim / (head_dim + d0)) / (128.0 / (128.0 + d0))) if d0 > 0 else 1.0
    return s / (s + s0) * dsat


def _closed_form(pts: list[Point], r: list[float]) -> tuple[float, dict[str, float], float]:
    """(sse, pass -> log asymptote, log share) minimising ``sum (r - a_pass - g causal)^2``."""
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(pts):
        groups.setdefault(p.passes, []).append(i)
    mr = {k: sum(r[i] for i in ix) / len(ix) for k, ix in groups.items()}
    mc = {k: sum(pts[i].causal for i in ix) / len(ix) for k, ix in groups.items()}
    num = sum((r[i] - mr[k]) * (pts[i].causal - mc[k]) for k, ix in groups.items() for i in ix)
    den = sum((pts[i].causal - mc[k]) ** 2 for k, ix in groups.items() for i in ix)
    g = num / den if den > 0 else 0.0
    a = {k: mr[k] - g * mc[k] for k in groups}
    sse = sum((r[i] - a[p.passes] - g * p.causal) ** 2 for i, p in enumerate(pts))
    return sse, a, g


def fit(gpu: str, kernel: str, with_te: bool = False) -> Fit:
    """The least-squares fit of ``kernel`` on ``gpu`` over its points of head dim <= 128."""
    pts = [p for p in points(gpu, kernel, with_te) if p.head_dim <= MAX_HEAD_DIM]
    logy = [math.log(p.tflops / PEAK[gpu]) for p in pts]
    best: Fit | None = None
    for s0 in range(0, 2049, 4):
        for d0 in range(0, 161, 4):
            r = [y - math.log(shape(s0, d0, p.causal, p.head_dim, p.seq)) for y, p in zip(logy, pts)]
            sse, a, g = _closed_form(pts, r)
            if best is None or sse < best.sse:
                best = Fit(sse, {k: math.exp(v) for k, v in a.items()}, math.exp(g), float(s0), float(d0), len(pts))
    assert best is not None
    return best


def model(f: Fit, p: Point, gpu: str) -> float:
    """The fit's TFLOP/s at ``p``."""
    a = f.asymptotes[p.passes] * (f.share if p.causal else 1.0)
    return a * shape(f.s0, f.d0, p.causal, p.head_dim, p.seq) * PEAK[gpu]


def pair(fwd: float, bwd: float) -> float:
    """The forward + backward rate of a forward and a backward rate (the backward 2.5x the FLOPs)."""
    return 3.5 / (1.0 / fwd + 2.5 / bwd)


class Check(NamedTuple):
    sku: str
    kernel: str
    test: str
    measured: float  # TFLOP/s
    fitted: float  # the fit's forward + backward TFLOP/s (its forward and backward asymptotes)
    preset: float  # the H100 preset's (attention_efficiency, no sustained share)


def held_out(fits: dict[str, Fit]) -> list[Check]:
    """Every Transformer Engine measurement against ``fits`` (kernel -> h100 fit) and the preset, on
    each SKU's own peak (:data:`TE_PEAK`); the bias config is skipped."""
    out = []
    for sku, times in TE_H100_MS.items():
        for kernel, test in times:
            _, _, _, d, s, causal, bias = TE_ATTENTION_CONFIGS[test]
            if bias:
                continue
            f = fits[kernel]
            p = Point("fwd", causal, d, s, 0.0)
            fitted = pair(model(f, p, "h100"), model(f, p._replace(passes="bwd"), "h100")) / PEAK["h100"]
            preset = pair(attention_efficiency(H100_RATES, kernel, False, s, d, causal),
                          attention_efficiency(H100_RATES, kernel, True, s, d, causal))
            out.append(Check(sku, kernel, test, te_tflops(sku, kernel, test), fitted * TE_PEAK[sku],
                             preset * TE_PEAK[sku]))
    return out


#: the H100 preset asymptotes' cited figures (rates.py ``_FA2_H100``, ``_CUDNN_H100``): kernel ->
#: ((forward TFLOP/s, its sequence), (backward TFLOP/s, its sequence)), non-causal, head dim 128
CITED = {"fa2": ((329.483, 4608), (322.0, 16384)), "cudnn": ((641.9, 16384), (538.5, 16384))}


def with_te_presets() -> dict[str, tuple[tuple[float, float, float], tuple[float, float]]]:
    """kernel -> (shape, (forward, backward) asymptotes) the H100 presets would take from the
    ``--with-te`` fits: the fit's ``S0``, ``D0`` and share, each asymptote its cited figure over the
    new ``s / (s + S0)`` at the cited sequence (as rates.py does)."""
    out = {}
    for kernel, ((fw, fs), (bw, bs)) in CITED.items():
        f = fit("h100", kernel, with_te=True)
        out[kernel] = ((f.s0, f.d0, round(f.share, 3)),
                       (fw / PEAK["h100"] / (fs / (fs + f.s0)), bw / PEAK["h100"] / (bs / (bs + f.s0))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--with-te", action="store_true",
                    help="add Transformer Engine's H100 SXM5 measurements to the h100 fits")
    with_te = ap.parse_args().with_te
    fits: dict[str, Fit] = {}
    for gpu, kernel in FITS:
        f = fit(gpu, kernel, with_te and gpu == "h100")
        if gpu == "h100":
            fits[kernel] = fit(gpu, kernel) if with_te else f
        asym = ", ".join(f"{k} {v:.4f}" for k, v in f.asymptotes.items())
        print(f"{gpu} {kernel}: asymptotes (non-causal, of {PEAK[gpu]:g}) {asym}; causal share {f.share:.3f}, "
              f"S0 {f.s0:g}, D0 {f.d0:g}, rms log error {f.rms:.3f} over {f.n} points")
        rows: dict[tuple[str, bool, int], list[tuple[float, float]]] = {}
        for p in points(gpu, kernel, with_te and gpu == "h100"):
            rows.setdefault((p.passes, p.causal, p.head_dim), []).append((round(model(f, p, gpu), 1), p.tflops))
        for (passes, causal, hd), mp in rows.items():
            note = "" if hd <= MAX_HEAD_DIM else " (not fitted)"
            print(f"  {passes} causal={causal} d={hd}: model {[m for m, _ in mp]} paper {[q for _, q in mp]}{note}")
    print("\nheld out: Transformer Engine's attention benchmark (forward + backward TFLOP/s; the fits "
          "without it; the PCIe card on its own peak)")
    print("| H100 | kernel | config | measured | fitted | fitted / measured | preset | preset / measured |")
    print("|---|---|---|---|---|---|---|---|")
    for c in held_out(fits):
        print(f"| {c.sku} | {c.kernel} | {c.test} | {c.measured:.1f} | {c.fitted:.1f} | {c.fitted / c.measured:.3f} | "
              f"{c.preset:.1f} | {c.preset / c.measured:.3f} |")
    if with_te:
        print("\nthe H100 presets from the fits with Transformer Engine's points (cited asymptotes over the new S0):")
        for kernel, (shape_, (fa, ba)) in with_te_presets().items():
            print(f"  {kernel}: S0 {shape_[0]:g}, D0 {shape_[1]:g}, causal share {shape_[2]:.3f}; "
                  f"asymptotes forward {fa:.4f}, backward {ba:.4f}")


if __name__ == "__main__":
    main()
