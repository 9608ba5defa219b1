"""``spmdkit demo``: the main job on one transformer MLP block, end to end.

A Megatron-style tensor-parallel MLP block (``x + W2 @ gelu(W1 @ layer_norm(x))``) on a
``dp=2 x tp=4`` mesh: the activations are sharded over ``dp`` on the batch axis, ``W1`` is
column-parallel and ``W2`` row-parallel over ``tp``. Each op's SPMD rule infers, from its
inputs' shardings, the shardings the op needs (a difference from what the producer gave is
a reshard) and those of its outputs (with partial status). Every answer is then proved
sound by the numeric simulator: the same call at tiny sizes is sharded on a simulated
8-rank mesh, run rank by rank, assembled and compared with the unsharded op.
"""

from __future__ import annotations

import json
import time
from typing import Any, TextIO

from spmdkit.io.codec import answer_line

_NAMES = ["dp", "tp"]
_MESH: dict[str, Any] = {"shape": [2, 4], "dim_names": _NAMES}
B, S, H, F = 16, 2048, 4096, 16384   # batch, sequence, hidden, FFN size
b, s, h, f = 4, 3, 8, 16             # the same block, small enough to simulate


def _placements(res: dict[str, Any], names: list[str]) -> str:
    """A RES as DTensor-style placements, one per mesh dim: S(axis) / R / P(sum)."""
    dm = res["dims_mapping"]
    out = []
    for m in range(len(names)):
        p = "R"
        for axis, e in enumerate(dm):
            if e == m or (isinstance(e, list) and m in e):
                p = f"S({axis})"
        if str(m) in res.get("partial", {}):
            p = f"P({res['partial'][str(m)]})"
        out.append(f"{names[m]}:{p}")
    return "[" + ", ".join(out) + "]"


def _t(shape: list[int], dm: list[Any], partial: dict[str, str] | None = None) -> dict[str, Any]:
    t: dict[str, Any] = {"shape": shape, "dims_mapping": dm}
    if partial:
        t["partial"] = partial
    return t


def run_demo(out: TextIO) -> int:
    from spmdkit.sim import verify  # (imports numpy)

    names = _NAMES
    out.write("spmdkit demo: a tensor-parallel transformer MLP block, x + W2 @ gelu(W1 @ layer_norm(x))\n")
    out.write(f"mesh dp=2 x tp=4 (8 ranks); x [{B}, {S}, {H}] sharded over dp on the batch axis;\n")
    out.write("W1 column-parallel, W2 row-parallel over tp (Megatron). Each rule infers what its op needs\n")
    out.write("and what it produces; the simulator then proves every answer sound at tiny sizes.\n\n")

    # the activations flow from op to op: each op's input is the previous op's inferred output
    flow: dict[str, dict[str, Any]] = {"x": {"dims_mapping": [0, -1, -1], "partial": {}}}
    reshards: list[str] = []

    def step(label: str, rule: str, args: list[Any], small: list[Any], inputs: list[str], output: str) -> bool:
        case = {"rule": rule, "mesh": _MESH, "args": args}
        res = answer_line(json.dumps(case))
        if "error" in res:
            out.write(f"{label}: {res['error']}: {res['message']}\n")
            return False
        given = [a for a in args if isinstance(a, dict)]
        out.write(f"{label}\n")
        for name, g, need in zip(inputs, given, res["inputs"]):
            gres = {"dims_mapping": g["dims_mapping"], "partial": g.get("partial", {})}
            note = ""
            if gres != need:
                note = "   <- reshard: " + _reshard_text(gres, need, names)
                reshards.append(f"{name} before {rule} ({_reshard_text(gres, need, names)})")
            out.write(f"    in  {name:<8} {g['shape']!s:<20} {_placements(gres, names):<26} needs "
                      f"{_placements(need, names)}{note}\n")
        o = res["outputs"][0]
        out.write(f"    out {output:<8} {'':<20} {_placements(o, names)}\n")
        flow[output] = o
        small_case = {"rule": rule, "mesh": _MESH, "args": small}
        v = verify(rule, small_case)
        out.write(f"    simulator at {[a['shape'] for a in small if isinstance(a, dict)]}: {v.status}\n\n")
        return v.sound

    def act(name: str, shape: list[int]) -> dict[str, Any]:
        r = flow[name]
        return _t(shape, r["dims_mapping"], r.get("partial") or None)

    t0 = time.perf_counter()
    ok = True
    ok &= step("1. layer_norm(x)", "layer_norm",
               [act("x", [B, S, H]), _t([H], [-1]), _t([H], [-1]), 1e-5, 2],
               [act("x", [b, s, h]), _t([h], [-1]), _t([h], [-1]), 1e-5, 2], ["x", "scale", "bias"], "ln")
    ok &= step("2. matmul(ln, W1)   W1 column-parallel", "matmul",
               [act("ln", [B, S, H]), _t([H, F], [-1, 1]), False, False],
               [act("ln", [b, s, h]), _t([h, f], [-1, 1]), False, False], ["ln", "W1"], "h1")
    ok &= step("3. gelu(h1)", "gelu", [act("h1", [B, S, F]), False], [act("h1", [b, s, f]), False], ["h1"], "g")
    ok &= step("4. matmul(g, W2)    W2 row-parallel", "matmul",
               [act("g", [B, S, F]), _t([F, H], [1, -1]), False, False],
               [act("g", [b, s, f]), _t([f, h], [1, -1]), False, False], ["g", "W2"], "h2")
    ok &= step("5. add(x, h2)       residual", "add",
               [act("x", [B, S, H]), act("h2", [B, S, H])],
               [act("x", [b, s, h]), act("h2", [b, s, h])], ["x", "h2"], "y")
    out.write(f"{'every answer sound' if ok else 'UNSOUND ANSWER FOUND'} "
              f"({time.perf_counter() - t0:.2f} s, rules and simulator).\n")
    out.write(f"reshards needed in this forward pass: {len(reshards)}\n")
    for r in reshards:
        out.write(f"    {r}\n")
    out.write("Next: `spmdkit rules` lists every rule; `spmdkit infer '<case>'` runs one; "
              "`spmdkit verify` checks them all.\n")
    return 0 if ok else 1


def _reshard_text(given: dict[str, Any], need: dict[str, Any], names: list[str]) -> str:
    steps = []
    gp, np_ = given.get("partial", {}), need.get("partial", {})
    for m, r in gp.items():
        if m not in np_:
            steps.append(f"all-reduce({r}) over {names[int(m)]}")
    gdm, ndm = given["dims_mapping"], need["dims_mapping"]
    for axis, (g, n) in enumerate(zip(gdm, ndm)):
        if g != n:
            if n == -1:
                steps.append(f"all-gather axis {axis}")
            elif g == -1:
                steps.append(f"slice axis {axis}")
            else:
                steps.append(f"move axis {axis}")
    return ", ".join(steps) or "change"
