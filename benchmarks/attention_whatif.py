"""What the runs would do if the H100 attention fits also took Transformer Engine's measurements
(``benchmarks/fit_attention.py --with-te``): a what-if, not the presets (docs/devices.md, "Transformer
Engine's attention benchmark, held out").

    python benchmarks/attention_whatif.py [--sustained X] fidelity ARGS...
    python benchmarks/attention_whatif.py calibrate ARGS...
    python benchmarks/attention_whatif.py --no-te --kernel nemo2403=fa2 fidelity ARGS...

The Hopper presets (h100, h200, h800) take :func:`fit_attention.with_te_presets`' shapes and
asymptotes for ``fa2`` and ``cudnn`` (``--no-te``: they keep their own), and ``--sustained``
(default the preset's); ``--kernel PREFIX=KERNEL`` (repeatable) plans every run whose id starts
with PREFIX with ``--attention-kernel KERNEL`` (``--except ID`` leaves one out: NeMo-Framework-
Launcher 24.01-24.07's ``env_vars.NVTE_FUSED_ATTN: 0``, "Disable cudnn FA until we've tested it
more", turns Transformer Engine's cuDNN attention off, so it runs flash-attn; 24.07's GPT-3 175B
example turns it back on). Then ``benchmarks/fidelity.py`` or ``benchmarks/calibrate_sustained.py``
runs unchanged with the rest of the arguments.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import calibrate_sustained
import fidelity
import fit_attention
from spmdkit.cost import devices

HOPPER = ("h100", "h200", "h800")


def patch(sustained: float | None, te_fit: bool = True, fa2_fit: bool = False) -> None:
    """Give the Hopper presets the ``--with-te`` shapes and asymptotes (and ``sustained``; with
    ``fa2_fit``, fa2's asymptotes its fit's forward and backward ones)."""
    te = fit_attention.with_te_presets() if te_fit else {}
    if fa2_fit:
        f = fit_attention.fit("h100", "fa2")
        shape = te["fa2"][0] if te else devices.DEVICES["h100"].rates.attention_shape["fa2"]
        te["fa2"] = (shape, (f.asymptotes["fwd"], f.asymptotes["bwd"]))
    for key in HOPPER:
        dev = devices.DEVICES[key]
        r = dev.rates
        shape = {**r.attention_shape, **{k: s for k, (s, _) in te.items()}}
        att = {**r.attention, **{k: a for k, (_, a) in te.items()}}
        r = replace(r, attention_shape=shape, attention=att)
        if sustained is not None:
            r = replace(r, sustained=sustained)
        devices.DEVICES[key] = replace(dev, rates=r)


def kernels(rules: list[str], skip: list[str]) -> None:
    """Append ``--attention-kernel`` to the argv of the runs ``rules`` (PREFIX=KERNEL) name."""
    pairs = [tuple(r.split("=", 1)) for r in rules]
    base = fidelity.foundry_argv

    def argv(row: dict[str, Any], assume: list[str]) -> list[str]:
        out = base(row, assume)
        for prefix, kernel in pairs:
            if str(row["id"]).startswith(prefix) and row["id"] not in skip:
                return [*out, "--attention-kernel", kernel]
        return out

    fidelity.foundry_argv = argv


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sustained", type=float, default=None)
    ap.add_argument("--no-te", action="store_true", help="keep the presets' attention shapes and asymptotes")
    ap.add_argument("--fa2-fit", action="store_true",
                    help="fa2's asymptotes the fit's forward and backward (the FlashAttention-3 paper's "
                         "FlashAttention-2 bars: Dao's build, as pip's flash-attn) instead of torch's SDPA figure")
    ap.add_argument("--kernel", action="append", default=[], metavar="PREFIX=KERNEL")
    ap.add_argument("--except", dest="skip", action="append", default=[], metavar="ID")
    ap.add_argument("tool", choices=("fidelity", "calibrate"))
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    patch(a.sustained, not a.no_te, a.fa2_fit)
    kernels(a.kernel, a.skip)
    for key in HOPPER:
        r = devices.DEVICES[key].rates
        print(f"<!-- {key}: attention {dict(r.attention)}, shape {dict(r.attention_shape)}, sustained {r.sustained} -->")
    sys.argv = [a.tool, *a.rest]
    return fidelity.main() if a.tool == "fidelity" else calibrate_sustained.main()


if __name__ == "__main__":
    raise SystemExit(main())
