"""The ``triton`` attention kernel's A100 rates (:data:`spmdkit.cost.rates.TRITON_A100`,
:data:`~spmdkit.cost.rates.TRITON_A100_SHAPE`) fitted to the FlashAttention-2 paper's Figure 4 bars
"FlashAttention Triton" (:data:`~spmdkit.cost.rates.TRITON_A100_FIG4`) and nothing else: the
forward + backward pair's non-causal asymptote, its causal share, ``S0`` and ``D0`` of
:func:`spmdkit.cost.rates.attention_efficiency`'s form, least squares in log over the 24 points
(a grid over ``S0`` and ``D0``; the two asymptotes in closed form, the mean log ratio of each
causality). ``python benchmarks/fit_triton_attention.py`` prints the fit and each point.
"""

from __future__ import annotations

import math

from spmdkit.cost.rates import TRITON_A100_FIG4

SEQS = (512, 1024, 2048, 4096, 8192, 16384)
A100_PEAK_TFLOPS = 312.0


def shape(s0: float, d0: float, causal: bool, head_dim: int, seq: int) -> float:
    """``attention_efficiency``'s sequence and head-dim terms (its asymptote 1)."""
    s = seq / 2 if causal else seq
    dsat = min(1.0, (head_dim / (head_dim + d0)) / (128.0 / (128.0 + d0))) if d0 > 0 else 1.0
    return s / (s + s0) * dsat


def fit() -> tuple[float, float, float, float, float]:
    """(error sum of squares in log, non-causal asymptote, causal asymptote, S0, D0)."""
    best: tuple[float, float, float, float, float] | None = None
    for s0 in range(0, 1025, 4):
        for d0 in range(0, 161, 4):
            logs: dict[bool, list[float]] = {False: [], True: []}
            for (causal, hd), bars in TRITON_A100_FIG4.items():
                for seq, tflops in zip(SEQS, bars):
                    logs[causal].append(math.log(tflops / A100_PEAK_TFLOPS) - math.log(shape(s0, d0, causal, hd, seq)))
            means = {k: sum(v) / len(v) for k, v in logs.items()}
            err = sum((x - means[k]) ** 2 for k, v in logs.items() for x in v)
            if best is None or err < best[0]:
                best = (err, math.exp(means[False]), math.exp(means[True]), float(s0), float(d0))
    assert best is not None
    return best


def main() -> None:
    err, a_nc, a_c, s0, d0 = fit()
    n = sum(len(b) for b in TRITON_A100_FIG4.values())
    print(f"pair asymptote {a_nc:.4f} (non-causal), causal share {a_c / a_nc:.3f}, S0 {s0:g}, D0 {d0:g}, "
          f"rms log error {math.sqrt(err / n):.3f}")
    for (causal, hd), bars in TRITON_A100_FIG4.items():
        a = a_c if causal else a_nc
        model = [round(a * shape(s0, d0, causal, hd, s) * A100_PEAK_TFLOPS, 1) for s in SEQS]
        print(f"causal={causal} d={hd}: model {model} paper {list(bars)}")


if __name__ == "__main__":
    main()
