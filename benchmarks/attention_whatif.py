"""What the runs would do if the H100 attention fits also took Transformer Engine's measurements
(``benchmarks/fit_attention.py --with-te``): a what-if, not the presets (docs/devices.md, "Transformer
Engine's attention benchmark, held out").

    python benchmarks/attention_whatif.py [--sustained X] fidelity ARGS...
    python benchmarks/attention_whatif.py calibrate ARGS...

The Hopper presets (h100, h200, h800) take :func:`fit_attention.with_te_presets`' shapes and
asymptotes for ``fa2`` and ``cudnn`` (and ``--sustained``, default the preset's), then
``benchmarks/fidelity.py`` or ``benchmarks/calibrate_sustained.py`` runs unchanged with the rest of
the arguments.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import calibrate_sustained
import fidelity
import fit_attention
from spmdkit.cost import devices

HOPPER = ("h100", "h200", "h800")


def patch(sustained: float | None) -> None:
    """Give the Hopper presets the ``--with-te`` shapes and asymptotes (and ``sustained``)."""
    te = fit_attention.with_te_presets()
    for key in HOPPER:
        dev = devices.DEVICES[key]
        r = dev.rates
        shape = {**r.attention_shape, **{k: s for k, (s, _) in te.items()}}
        att = {**r.attention, **{k: a for k, (_, a) in te.items()}}
        r = replace(r, attention_shape=shape, attention=att)
        if sustained is not None:
            r = replace(r, sustained=sustained)
        devices.DEVICES[key] = replace(dev, rates=r)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sustained", type=float, default=None)
    ap.add_argument("tool", choices=("fidelity", "calibrate"))
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    patch(a.sustained)
    for key in HOPPER:
        r = devices.DEVICES[key].rates
        print(f"<!-- {key}: attention {dict(r.attention)}, shape {dict(r.attention_shape)}, sustained {r.sustained} -->")
    sys.argv = [a.tool, *a.rest]
    return fidelity.main() if a.tool == "fidelity" else calibrate_sustained.main()


if __name__ == "__main__":
    raise SystemExit(main())
