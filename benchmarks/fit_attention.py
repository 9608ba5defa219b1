"""Each flash-attention kernel's shape on a GPU (:attr:`spmdkit.cost.rates.Rates.attention_shape`:
``S0``, ``D0``, the causal share) fitted to the kernel's own published bars and nothing else:

- ``a100 triton``: the FlashAttention-2 paper's Figure 4, "FlashAttention Triton" (forward + backward,
  :data:`~spmdkit.cost.rates.TRITON_A100_FIG4`);
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
"""

from __future__ import annotations

import math
from typing import NamedTuple

from spmdkit.cost.rates import FA2_A100_FIG4, FA2_H100_PAIR, FA3_H100_BWD, FA3_H100_FWD, TRITON_A100_FIG4

SEQS = (512, 1024, 2048, 4096, 8192, 16384)
#: the bf16 / fp16 dense tensor-core peaks the figures' TFLOP/s are fractions of (NVIDIA datasheets)
PEAK = {"a100": 312.0, "h100": 989.5}
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


def points(gpu: str, kernel: str) -> list[Point]:
    """Every transcribed point of ``kernel`` on ``gpu`` (head dim 256 included)."""
    if gpu == "a100":
        return _pair({"triton": TRITON_A100_FIG4, "fa2": FA2_A100_FIG4}[kernel])
    out = _pair(FA2_H100_PAIR) if kernel == "fa2" else []
    out += [Point("fwd", c, d, s, t) for (k, c, d), bars in FA3_H100_FWD.items() if k == kernel
            for s, t in zip(SEQS, bars)]
    out += [Point("bwd", False, d, s, t) for (k, d), bars in FA3_H100_BWD.items() if k == kernel
            for s, t in zip(SEQS, bars)]
    return out


FITS = (("a100", "triton"), ("a100", "fa2"), ("h100", "fa2"), ("h100", "cudnn"))


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


def fit(gpu: str, kernel: str) -> Fit:
    """The least-squares fit of ``kernel`` on ``gpu`` over its points of head dim <= 128."""
    pts = [p for p in points(gpu, kernel) if p.head_dim <= MAX_HEAD_DIM]
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


def main() -> None:
    for gpu, kernel in FITS:
        f = fit(gpu, kernel)
        asym = ", ".join(f"{k} {v:.4f}" for k, v in f.asymptotes.items())
        print(f"{gpu} {kernel}: asymptotes (non-causal, of {PEAK[gpu]:g}) {asym}; causal share {f.share:.3f}, "
              f"S0 {f.s0:g}, D0 {f.d0:g}, rms log error {f.rms:.3f} over {f.n} points")
        rows: dict[tuple[str, bool, int], list[tuple[float, float]]] = {}
        for p in points(gpu, kernel):
            rows.setdefault((p.passes, p.causal, p.head_dim), []).append((round(model(f, p, gpu), 1), p.tflops))
        for (passes, causal, hd), mp in rows.items():
            note = "" if hd <= MAX_HEAD_DIM else " (not fitted)"
            print(f"  {passes} causal={causal} d={hd}: model {[m for m, _ in mp]} paper {[q for _, q in mp]}{note}")


if __name__ == "__main__":
    main()
