#!/usr/bin/env python3
"""Behaviour-equivalence snapshots of an spmdkit tree, for refactors that move code (issue 25).

    equiv.py cases OUT.jsonl [--per-rule N] [--mutations M] [--seed S] [--tree DIR]
    equiv.py snapshot --tree DIR --cases FILE OUT_DIR [--jobs 2]
    equiv.py compare A B [--show N]

``cases`` writes a fixed JSON-lines case file (INTERFACE.md) and, beside it, a fixtures folder
(``OUT.fixtures/``: program JSON files and HF configs that ``plan --program`` / ``plan --hf`` read).
It is run once, on the tree before the refactor, and is the one part that imports that tree's
internals (``spmdkit.sim.cases`` for generated cases, ``spmdkit.program`` and ``spmdkit.models``
for the program fixtures; ``spmdkit.graph`` and ``spmdkit.hf`` on a tree from before issue 25), in a child process whose PYTHONPATH is ``--tree``/src.

``snapshot`` drives a tree through its command line only (``python -m spmdkit ...``, or
``spmdkit.cli.main(argv)`` in worker processes whose PYTHONPATH is DIR/src, one fresh working
folder per command): ``infer --batch --no-cache`` over the case file, ``rules --json``, and a fixed
list of ``plan`` / ``verify`` / ``demo`` / ``infer`` / ``run`` commands; per command its exit
status, stdout, stderr and every file it wrote, normalised as listed in NORMALISATIONS (wall-clock
figures only, plus the snapshot's own folders). ``compare`` compares two snapshots category by
category; exit status 1 when anything differs.

Standard library only (the tree under test needs what it needs: numpy, rich, torch,
transformers, highspy for the commands that use them).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import difflib
import gzip
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
FORMAT = "spmdkit-equiv-snapshot/1"

#: What a snapshot normalises, and nothing else. Each rule: (name, what it replaces).
NORMALISATIONS: list[tuple[str, str]] = [
    ("ansi", "ANSI escape sequences (colours, cursor moves) are removed from stdout, stderr and files"),
    ("planned-in", "'planned in 0.21 s' (plan's wall-clock planning time) -> 'planned in <wall> s'"),
    ("auto-solve", "'solve 1.23 s' / 'solved in 1.23 s' (--auto's HiGHS wall-clock) -> '<wall>'"),
    ("devices-plans-in", "'N plans in 12.3 s' (--devices search wall-clock) -> 'N plans in <wall> s'"),
    ("verify-elapsed", "the '(12.3 s)' at the end of verify's 'total' line -> '(<wall> s)'"),
    ("demo-elapsed", "demo's '(0.12 s, rules and simulator)' -> '(<wall> s, rules and simulator)'"),
    ("json-seconds", "JSON values of the keys plan_seconds, solve_seconds, candidates_seconds and seconds "
                     "(plan/auto/devices/verify wall-clock; objective_seconds and the *_s predictions are kept) "
                     "-> \"<wall>\""),
    ("run-timing", "spmdkit run: the measured columns of the 'time per phase' table (compute, comm, step; "
                   "the predicted columns are kept; the line's spacing is collapsed to single spaces) and the "
                   "numbers inside the JSON 'timing' object -> <wall>"),
    ("paths", "the snapshot's own working folder and the tree's path, where they appear -> <work> / <tree> "
              "(not wall-clock, but they differ between two snapshots by construction)"),
    ("exception", "an exception escaping spmdkit.cli.main in a worker is recorded as 'Traceback: "
                  "Type: message' and exit 1 (the frames name files, which a move changes)"),
]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][A-Za-z0-9]|\x1b[=>]")
_NUM = r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_TEXT_RULES: list[tuple[str, re.Pattern[str], str]] = [
    ("planned-in", re.compile(r"planned in " + _NUM + r" s"), "planned in <wall> s"),
    ("auto-solve", re.compile(r"\bsolve " + _NUM + r" s\b"), "solve <wall> s"),
    ("auto-solve", re.compile(r"\bsolved in " + _NUM + r" s\b"), "solved in <wall> s"),
    ("devices-plans-in", re.compile(r"\bplans in " + _NUM + r" s\)"), "plans in <wall> s)"),
    ("verify-elapsed", re.compile(r"^(total\s.*)\(" + _NUM + r" s\)$", re.M), r"\1(<wall> s)"),
    ("demo-elapsed", re.compile(r"\(" + _NUM + r" s, rules and simulator\)"), "(<wall> s, rules and simulator)"),
    ("json-seconds", re.compile(r'"(plan_seconds|solve_seconds|candidates_seconds|seconds)": ' + _NUM),
     r'"\1": "<wall>"'),
]
_TIMING_KEY = '"timing": {'
_UNIT = r"(?:ns|us|ms|s|min|h)"


def _norm_run_text(text: str, hits: Counter[str]) -> str:
    """spmdkit run's 'time per phase' table: the measured columns (not the predictions)."""
    lines = text.split("\n")
    inside = False
    for i, line in enumerate(lines):
        if line.startswith("time per phase"):
            inside = True
            continue
        if not inside:
            continue
        if not line.startswith("  "):
            inside = False
            continue
        tok = line.split()
        if not tok or tok[0] == "phase":
            continue
        if tok[0] == "step" and len(tok) >= 3:  # step 1.66 s (predicted 390.14 us)
            tok[1:3] = ["<wall>"]
        elif len(tok) == 9 and all(re.fullmatch(_UNIT, t) for t in tok[2::2]):
            tok[1:3] = ["<wall>"]
            tok[4:6] = ["<wall>"]
        else:
            continue
        lines[i] = "  " + " ".join(tok)
        hits["run-timing"] += 1
    return "\n".join(lines)


def _norm_timing_json(text: str, hits: Counter[str]) -> str:
    out: list[str] = []
    pos = 0
    while True:
        k = text.find(_TIMING_KEY, pos)
        if k < 0:
            out.append(text[pos:])
            return "".join(out)
        start = k + len(_TIMING_KEY) - 1
        depth, j = 0, start
        while j < len(text):
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
                if depth == 0:
                    break
            j += 1
        body = re.sub(r"(?<=: )" + _NUM, '"<wall>"', text[start:j + 1])
        hits["run-timing"] += 1
        out.append(text[pos:start])
        out.append(body)
        pos = j + 1


def normalise(text: str, hits: Counter[str], paths: dict[str, str]) -> str:
    """Apply NORMALISATIONS to one output; ``hits`` counts what each rule replaced."""
    text, n = _ANSI.subn("", text)
    hits["ansi"] += n
    for path, token in paths.items():
        if path and path in text:
            hits["paths"] += text.count(path)
            text = text.replace(path, token)
    for name, pat, repl in _TEXT_RULES:
        text, n = pat.subn(repl, text)
        hits[name] += n
    if "time per phase" in text:
        text = _norm_run_text(text, hits)
    if _TIMING_KEY in text:
        text = _norm_timing_json(text, hits)
    return text


# == cases =====================================================================================

REDUCES = ("sum", "avg", "max", "min", "prod", "any", "all")


def _is_tensor(v: Any) -> bool:
    return isinstance(v, dict) and "shape" in v


def _tensor_paths(case: dict[str, Any]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for i, a in enumerate(case["args"]):
        if _is_tensor(a):
            out.append((i,))
        elif isinstance(a, list) and a and all(x is None or _is_tensor(x) for x in a):
            out += [(i, j) for j, x in enumerate(a) if x is not None]
    return out


def _get(case: dict[str, Any], p: tuple[int, ...]) -> Any:
    v = case["args"][p[0]]
    return v[p[1]] if len(p) == 2 else v


def _set(case: dict[str, Any], p: tuple[int, ...], val: Any) -> None:
    if len(p) == 2:
        case["args"][p[0]][p[1]] = val
    else:
        case["args"][p[0]] = val


def _mesh_shape(case: dict[str, Any]) -> list[int]:
    m = case.get("mesh")
    if isinstance(m, dict):
        m = m.get("shape")
    return list(m) if isinstance(m, list) else []


def _set_mesh_shape(case: dict[str, Any], shape: list[int]) -> None:
    if isinstance(case.get("mesh"), dict):
        case["mesh"] = {"shape": shape}
    else:
        case["mesh"] = shape


def _attr_slots(case: dict[str, Any]) -> list[int]:
    out = []
    for i, a in enumerate(case["args"]):
        if _is_tensor(a) or (isinstance(a, list) and a and all(x is None or _is_tensor(x) for x in a)):
            continue
        out.append(i)
    return out


def _pick_tensor(case: dict[str, Any], r: random.Random, min_nd: int = 0) -> dict[str, Any] | None:
    ps = [p for p in _tensor_paths(case) if len(_get(case, p)["shape"]) >= min_nd]
    return _get(case, r.choice(ps)) if ps else None


def _dm(t: dict[str, Any]) -> list[Any]:
    if "dims_mapping" not in t or not isinstance(t["dims_mapping"], list):
        t["dims_mapping"] = [-1] * len(t["shape"])
    dm: list[Any] = t["dims_mapping"]
    return dm


def _mut_size(case: dict[str, Any], r: random.Random) -> bool:
    t = _pick_tensor(case, r, 1)
    if t is None:
        return False
    ax = r.randrange(len(t["shape"]))
    s = t["shape"][ax]
    t["shape"][ax] = r.choice([v for v in (-1, 0, 1, s + 1, 2 * s, 3 * s + 1, 7, 2**31, 2**62) if v != s])
    return True


def _mut_drop_axis(case: dict[str, Any], r: random.Random) -> bool:
    t = _pick_tensor(case, r, 1)
    if t is None:
        return False
    ax = r.randrange(len(t["shape"]))
    del t["shape"][ax]
    if isinstance(t.get("dims_mapping"), list) and len(t["dims_mapping"]) > ax:
        del t["dims_mapping"][ax]
    return True


def _mut_add_axis(case: dict[str, Any], r: random.Random) -> bool:
    t = _pick_tensor(case, r)
    if t is None:
        return False
    pos = r.randint(0, len(t["shape"]))
    t["shape"].insert(pos, r.choice((1, 2, 3, 4, 8)))
    dm = _dm(t)
    used = {d for e in dm for d in (e if isinstance(e, list) else [e]) if isinstance(d, int) and d >= 0}
    free = [d for d in range(len(_mesh_shape(case))) if d not in used]
    dm.insert(pos, r.choice(free) if free and r.random() < 0.5 else -1)
    return True


def _mut_absent(case: dict[str, Any], r: random.Random) -> bool:
    ps = _tensor_paths(case)
    if not ps:
        return False
    _set(case, r.choice(ps), None)
    return True


def _new_attr(v: Any, r: random.Random) -> Any:
    if isinstance(v, bool):
        return r.choice((not v, 0, 1, "true", None))
    if isinstance(v, int):
        return r.choice([x for x in (v + 1, v - 1, -v - 1, 0, -1, 1, 2, 2**31, 2**63, v * 2, 1.5, str(v)) if x != v])
    if isinstance(v, float):
        return r.choice([x for x in (0.0, -1.0, 1.0, 0.5, v * 2, 1e30, -1e-9, 3, "0.5") if x != v])
    if isinstance(v, str):
        return r.choice([x for x in ("", "sum", "mean", "none", "NCHW", "NHWC", "float32", "int64", "x",
                                     v.upper(), v + "_", 3) if x != v])
    if isinstance(v, list):
        w = list(v)
        k = r.randrange(6)
        if k == 0 and w:
            w.pop(r.randrange(len(w)))
        elif k == 1:
            w.insert(r.randint(0, len(w)), r.choice((0, 1, -1, 2, 3)))
        elif k == 2 and w:
            i = r.randrange(len(w))
            w[i] = _new_attr(w[i], r)
        elif k == 3:
            w = []
        elif k == 4:
            return r.choice((0, 1, -1))
        else:
            w = [r.choice((0, 1, -1, 2, -2, 5)) for _ in range(r.randint(1, 4))]
        return w
    if v is None:
        return r.choice((0, 1, -1, [], "", 0.5, True))
    return r.choice((None, 0, [], "x"))


def _mut_attr(case: dict[str, Any], r: random.Random) -> bool:
    slots = _attr_slots(case)
    if not slots:
        return False
    i = r.choice(slots)
    case["args"][i] = _new_attr(case["args"][i], r)
    return True


def _mut_coshard(case: dict[str, Any], r: random.Random) -> bool:
    t = _pick_tensor(case, r, 1)
    if t is None:
        return False
    mesh = _mesh_shape(case)
    if len(mesh) < 2:
        mesh = [*mesh, 2]
        _set_mesh_shape(case, mesh)
    a, b = r.sample(range(len(mesh)), 2)
    dm = _dm(t)
    if r.random() < 0.7:  # keep it legal: the two mesh dims used nowhere else in this tensor
        for i, e in enumerate(dm):
            if e in (a, b):
                dm[i] = -1
            elif isinstance(e, list):
                rest = [d for d in e if d not in (a, b)]
                dm[i] = rest if len(rest) > 1 else (rest[0] if rest else -1)
        if isinstance(t.get("partial"), dict):
            for d in (a, b):
                t["partial"].pop(str(d), None)
        elif isinstance(t.get("partial"), list):
            t["partial"] = [d for d in t["partial"] if d not in (a, b)]
    dm[r.randrange(len(dm))] = [a, b]
    return True


def _mut_partial(case: dict[str, Any], r: random.Random) -> bool:
    t = _pick_tensor(case, r)
    if t is None:
        return False
    nd = len(_mesh_shape(case))
    if nd == 0:
        return False
    d = r.randrange(nd)
    if r.random() < 0.25:
        t["partial"] = [d]
    else:
        red = r.choice(REDUCES) if r.random() < 0.95 else "bogus"
        p: dict[str, Any] = t["partial"] if isinstance(t.get("partial"), dict) else {}
        p[str(d)] = red
        t["partial"] = p
    return True


def _mut_shard(case: dict[str, Any], r: random.Random) -> bool:
    t = _pick_tensor(case, r, 1)
    if t is None:
        return False
    nd = len(_mesh_shape(case))
    dm = _dm(t)
    dm[r.randrange(len(dm))] = r.choice([*range(nd), *range(nd), nd, -2]) if nd else r.choice((0, -2))
    return True


def _mut_replicate(case: dict[str, Any], r: random.Random) -> bool:
    t = _pick_tensor(case, r)
    if t is None:
        return False
    t["dims_mapping"] = [-1] * len(t["shape"])
    t.pop("partial", None)
    return True


def _mut_dm_len(case: dict[str, Any], r: random.Random) -> bool:
    t = _pick_tensor(case, r)
    if t is None:
        return False
    dm = _dm(t)
    if dm and r.random() < 0.5:
        dm.pop()
    else:
        dm.append(-1)
    return True


def _mut_mesh(case: dict[str, Any], r: random.Random) -> bool:
    mesh = _mesh_shape(case)
    n = 1
    for v in mesh:
        n *= max(v, 1)
    k = r.randrange(9)
    if k in (3, 5, 6) and n > 256:  # process ids are listed: only for a small mesh (a line stays short)
        return False
    if k == 0 and mesh:
        _set_mesh_shape(case, mesh[:-1])
    elif k == 1:
        _set_mesh_shape(case, [*mesh, r.choice((1, 2))])
    elif k == 2 and mesh:
        mesh[r.randrange(len(mesh))] = r.choice((0, -1, 1))
        _set_mesh_shape(case, mesh)
    elif k == 3:  # the object form, legal: named dims, process ids reversed
        case["mesh"] = {"shape": mesh, "process_ids": list(range(n))[::-1],
                        "dim_names": [f"d{i}" for i in range(len(mesh))]}
    elif k == 4 and len(mesh) >= 2:
        case["mesh"] = {"shape": mesh, "dim_names": ["dp"] * len(mesh)}
    elif k == 5:
        case["mesh"] = {"shape": mesh, "process_ids": list(range(n + 1))}
    elif k == 6 and n >= 2:
        case["mesh"] = {"shape": mesh, "process_ids": [0] * n}
    elif k == 7:
        case["mesh"] = r.choice(([], [2**11, 2**10], "2x2", [2.5], [[2]], None))
    else:
        case["mesh"] = [*mesh[:-1], 2**21] if mesh else [2**21]
    return True


def _mut_args(case: dict[str, Any], r: random.Random) -> bool:
    a = case["args"]
    if a and r.random() < 0.5:
        case["args"] = a[: len(a) - r.randint(1, min(2, len(a)))]
    else:
        ps = _tensor_paths(case)
        extra = json.loads(json.dumps(_get(case, ps[0]))) if ps and r.random() < 0.5 else r.choice((0, None, "x"))
        case["args"] = [*a, extra]
    return True


def _mut_mode(case: dict[str, Any], r: random.Random) -> bool:
    case["mode"] = "backward" if case.get("mode", "forward") == "forward" else "forward"
    return True


def _mut_vector(case: dict[str, Any], r: random.Random) -> bool:
    vs = [i for i, a in enumerate(case["args"]) if isinstance(a, list) and a and all(
        x is None or _is_tensor(x) for x in a)]
    if not vs:
        return False
    i = r.choice(vs)
    v = case["args"][i]
    k = r.randrange(4)
    if k == 0:
        v.pop(r.randrange(len(v)))
    elif k == 1:
        v.insert(r.randint(0, len(v)), json.loads(json.dumps(r.choice(v))))
    elif k == 2:
        case["args"][i] = []
    else:
        v.reverse()
    return True


def _mut_swap(case: dict[str, Any], r: random.Random) -> bool:
    ps = [p for p in _tensor_paths(case) if len(p) == 1]
    if len(ps) < 2:
        return False
    a, b = r.sample(ps, 2)
    ta, tb = _get(case, a), _get(case, b)
    _set(case, a, tb)
    _set(case, b, ta)
    return True


def _mut_keys(case: dict[str, Any], r: random.Random) -> bool:
    k = r.randrange(4)
    if k == 0:
        case["mdoe"] = case.get("mode", "forward")
    elif k == 1:
        case["rule"] = case["rule"] + "_x"
    elif k == 2:
        case.pop("args")
    else:
        case["mode"] = r.choice(("both", "", "Forward", 1))
    return True


MUTATIONS: dict[str, tuple[Callable[[dict[str, Any], random.Random], bool], int]] = {
    "size": (_mut_size, 6), "drop_axis": (_mut_drop_axis, 3), "add_axis": (_mut_add_axis, 3),
    "absent": (_mut_absent, 3), "attr": (_mut_attr, 6), "coshard": (_mut_coshard, 4),
    "partial": (_mut_partial, 5), "shard": (_mut_shard, 5), "replicate": (_mut_replicate, 2),
    "dm_len": (_mut_dm_len, 1), "mesh": (_mut_mesh, 3), "args": (_mut_args, 1), "mode": (_mut_mode, 1),
    "vector": (_mut_vector, 2), "swap": (_mut_swap, 1), "keys": (_mut_keys, 1),
}
_MUT_NAMES = list(MUTATIONS)
_MUT_WEIGHTS = [MUTATIONS[k][1] for k in _MUT_NAMES]


def mutate(case: dict[str, Any], r: random.Random) -> tuple[dict[str, Any], list[str]] | None:
    """One mutated copy of ``case`` (one mutation, a quarter of the time two)."""
    c = json.loads(json.dumps(case))
    done: list[str] = []
    for _ in range(2 if r.random() < 0.25 else 1):
        for _attempt in range(6):
            name = r.choices(_MUT_NAMES, _MUT_WEIGHTS)[0]
            try:
                ok = MUTATIONS[name][0](c, r)
            except (KeyError, IndexError, TypeError, ValueError):
                ok = False
            if ok:
                done.append(name)
                break
    return (c, done) if done else None


def _finite(v: Any) -> Any:
    if isinstance(v, float) and v != v:
        return 0.0
    if isinstance(v, float) and v in (float("inf"), float("-inf")):
        return 3.0e38 if v > 0 else -3.0e38
    if isinstance(v, list):
        return [_finite(x) for x in v]
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    return v


def _gen_child(a: argparse.Namespace) -> int:
    """(internal, PYTHONPATH = the tree) generated base cases as JSON lines, and the fixtures."""
    import spmdkit.sim.verify  # noqa: F401  (registers every family's generators)
    from spmdkit.engine.registry import all_rules
    from spmdkit.sim.cases import generate_case

    fix = Path(a.fixtures)
    fix.mkdir(parents=True, exist_ok=True)
    manifest = _write_program_fixtures(fix)
    (fix / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    seen: dict[str, Any] = {}
    for r in all_rules().values():
        seen.setdefault(r.name, r)
    out = sys.stdout
    for name in sorted(seen):
        for mode in seen[name].modes:
            for i in range(a.per_rule):
                c = generate_case(name, mode, a.seed, i)
                if c is not None:
                    out.write(json.dumps(c) + "\n")
    out.flush()
    return 0


#: HF models of tests/test_hf.py (tiny configs), by file name: (class, config).
_H = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 128,
      "vocab_size": 256, "max_position_embeddings": 64}
HF_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt2": ("GPT2LMHeadModel", {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "n_positions": 64,
                                 "bos_token_id": 0, "eos_token_id": 0}),
    "llama": ("LlamaForCausalLM", {"num_key_value_heads": 2, **_H}),
    "mistral": ("MistralForCausalLM", {"num_key_value_heads": 2, **_H}),
    "qwen2": ("Qwen2ForCausalLM", {"num_key_value_heads": 1, **_H}),
    "mixtral": ("MixtralForCausalLM", {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
                                       **_H}),
    "gemma": ("GemmaForCausalLM", {"num_key_value_heads": 1, "head_dim": 16, **_H}),
    "gemma2": ("Gemma2ForCausalLM", {"num_key_value_heads": 2, "head_dim": 16, **_H}),
    "gemma3": ("Gemma3ForCausalLM", {"num_key_value_heads": 2, "head_dim": 16, **_H}),
    "phi": ("PhiForCausalLM", {"num_key_value_heads": 4, **_H}),
    "bert": ("BertForMaskedLM", dict(_H)),
    "t5": ("T5ForConditionalGeneration", {"num_layers": 2, "d_model": 64, "num_heads": 4, "d_kv": 16, "d_ff": 128,
                                          "vocab_size": 256, "decoder_start_token_id": 0, "pad_token_id": 0}),
    "vit": ("ViTForImageClassification", {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                                          "intermediate_size": 128, "image_size": 32, "patch_size": 8,
                                          "num_labels": 10}),
}
#: tests/test_auto_search.py's HF_CFG (a 1-layer Llama for --auto / --devices)
HF_SMALL = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64,
            "vocab_size": 64, "max_position_embeddings": 32, "num_key_value_heads": 2}


def _write_program_fixtures(fix: Path) -> dict[str, Any]:
    """Program JSON files (zoo programs, a hand-built MLP, broken ones, imported HF models) and HF configs."""
    try:  # the layout since the redesign (issue 25), else the one before it
        from spmdkit.models.zoo import build_model, preset
        from spmdkit.program.ir import ProgramBuilder
    except ImportError:
        from spmdkit.graph.program import ProgramBuilder
        from spmdkit.graph.zoo import build_model, preset

    man: dict[str, Any] = {"programs": {}, "hf": {}, "notes": []}
    b = ProgramBuilder("mlp")
    b.tensor("x", [8, 16], kind="input")
    b.tensor("w1", [16, 32], kind="parameter")
    b.tensor("w2", [32, 16], kind="parameter")
    b.op("matmul", {"x": "x", "y": "w1"}, [("h", [8, 32])], name="fc1")
    b.op("gelu", {"x": "h"}, [("a", [8, 32])], name="act")
    b.op("matmul", {"x": "a", "y": "w2"}, [("y", [8, 16])], name="fc2")
    mlp = b.build(True)
    progs: dict[str, str] = {"mlp": mlp.dumps()}
    for name, layers in (("tiny-gpt2", 1), ("tiny-llama", 2), ("tiny-gpt-dropout", 1)):
        prog = build_model(preset(name).with_(layers=layers), check_rules=False).program
        progs[f"zoo-{name}"] = json.dumps(prog.to_json())
    d = json.loads(progs["mlp"])
    d["ops"][0]["rule"] = "matmulx"
    progs["broken-rule"] = json.dumps(d)
    d = json.loads(progs["mlp"])
    d["ops"][1]["inputs"] = {"x": "nope"}
    progs["broken-dangling"] = json.dumps(d)
    d = json.loads(progs["mlp"])
    d["tensors"][0]["shape"] = [8, 17]
    progs["broken-shape"] = json.dumps(d)
    try:
        import transformers  # noqa: F401
        try:
            from spmdkit.models.hf import import_hf
        except ImportError:
            from spmdkit.hf import import_hf
        for name, (cls, cfg) in HF_MODELS.items():
            try:
                prog, _m, _kw = import_hf(cls, cfg, dtype="float32", training=True)
                progs[f"hf-{name}"] = prog.dumps()
            except Exception as exc:  # recorded: the snapshot then skips that program
                man["notes"].append(f"hf-{name}: import failed: {type(exc).__name__}: {exc}"[:300])
    except ImportError as exc:
        man["notes"].append(f"no HF program fixtures: {exc}")
    for name, text in progs.items():
        (fix / f"{name}.json").write_text(text)
        man["programs"][name] = f"{name}.json"
    hf = fix / "hf"
    hf.mkdir(exist_ok=True)
    for name, (cls, cfg) in HF_MODELS.items():
        (hf / f"{name}.json").write_text(json.dumps(cfg))
        man["hf"][name] = {"class": cls, "config": f"hf/{name}.json"}
    (hf / "small-llama.json").write_text(json.dumps(HF_SMALL))
    man["hf_small"] = "hf/small-llama.json"
    return man


def _child_env(tree: Path, hashseed: str = "0") -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("COLUMNS", "LINES", "FORCE_COLOR", "NO_COLOR", "CLICOLOR", "CLICOLOR_FORCE", "TERM",
                        "MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "PYTHONSTARTUP")}
    env["PYTHONPATH"] = str(tree / "src")
    env["PYTHONHASHSEED"] = hashseed
    env["TERM"] = "dumb"
    env["PYTHONIOENCODING"] = "utf-8"
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    return env


def _spmdkit(tree: Path, *argv: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "spmdkit", *argv], env=_child_env(tree), capture_output=True,
                          text=True, check=False, **kw)


def cmd_cases(a: argparse.Namespace) -> int:
    tree = Path(a.tree).resolve()
    out = Path(a.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    fix = fixtures_dir(out)
    if fix.exists():
        shutil.rmtree(fix)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, str(SCRIPT), "_gen", "--per-rule", str(a.per_rule), "--seed", str(a.seed),
                        "--fixtures", str(fix)], env=_child_env(tree), capture_output=True, text=True, check=False)
    if p.returncode:
        sys.stderr.write(p.stderr)
        print(f"equiv cases: generating on {tree} failed (exit {p.returncode})", file=sys.stderr)
        return 1
    base = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    rules = json.loads(_spmdkit(tree, "rules", "--json").stdout)
    aliases = [(row["name"], row["canonical"]) for row in rules if row["name"] != row["canonical"]]
    counts: Counter[str] = Counter()
    kinds: Counter[str] = Counter()
    by_rule: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    with out.open("w") as f:
        def put(c: Any, what: str) -> None:
            f.write(json.dumps(c) + "\n")
            counts[what] += 1

        for c in base:
            cid = c["id"]
            raw = json.dumps(c)
            if "Infinity" in raw or "NaN" in raw:  # kept as generated (a CaseFormatError), and made finite
                put(c, "generated-nonfinite")
                c = _finite(c)
                c["id"] = cid + "/finite"
            put(c, "generated")
            by_rule[(c["rule"], c["mode"])].append(c)
            r = random.Random(f"{a.seed}:mut:{cid}")
            for k in range(a.mutations):
                m = mutate(c, r)
                if m is None:
                    continue
                mc, names = m
                mc["id"] = f"{cid}/m{k}:{'+'.join(names)}"
                kinds.update(names)
                put(mc, "mutated")
        for alias, canon in aliases:
            for mode in ("forward", "backward"):
                for c in by_rule.get((canon, mode), [])[: a.per_alias]:
                    ac = dict(c, rule=alias, id=f"alias/{alias}/{c['id']}")
                    put(ac, "alias")
        for g in sorted((tree / "tests" / "golden").glob("*.jsonl")):
            for n, line in enumerate(g.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                c = dict(json.loads(line)["case"])
                c["id"] = f"golden/{g.name}:{n}"
                put(c, "golden")
                r = random.Random(f"{a.seed}:golden:{g.name}:{n}")
                m = mutate(c, r)
                if m is not None:
                    m[0]["id"] = f"golden/{g.name}:{n}/m:{'+'.join(m[1])}"
                    kinds.update(m[1])
                    put(m[0], "golden-mutated")
    total = sum(counts.values())
    meta = {"cases": total, "by_source": dict(counts), "mutation_kinds": dict(kinds), "per_rule": a.per_rule,
            "mutations": a.mutations, "per_alias": a.per_alias, "seed": a.seed, "tree": str(tree),
            "tree_commit": _git_head(tree), "rule_modes": len(by_rule), "seconds_to_generate": round(
                time.perf_counter() - t0, 1), "sha256": _sha256_file(out)}
    Path(str(out) + ".meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"equiv cases: {total} lines -> {out} ({json.dumps(dict(counts))}); fixtures {fix}; "
          f"{meta['seconds_to_generate']} s")
    return 0


def fixtures_dir(cases: Path) -> Path:
    name = cases.name[: -len(".jsonl")] if cases.name.endswith(".jsonl") else cases.name
    return cases.with_name(name + ".fixtures")


def _git_head(tree: Path) -> str | None:
    p = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=False).stdout.strip()
    return (p.stdout.strip() + (" (modified)" if dirty else "")) if p.returncode == 0 else None


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# == answer sets ===============================================================================

#: (name, spmdkit argv reading stdin, what the input is). Each set's answers are compared line by line.
ANSWER_SETS: list[tuple[str, list[str], str]] = [
    ("answers", ["infer", "--batch", "--no-cache"], "the case file"),
    ("answers_cached", ["infer", "--batch"], "every 10th line of the case file, twice over (result cache on)"),
    ("answers_raw", ["infer", "--batch"], "RAW_LINES: lines that are not cases (INTERFACE.md: one answer each)"),
]

#: Input lines of infer --batch that are not well-formed cases: each still gets one answer line.
RAW_LINES: list[bytes] = [
    b"\n", b"not json\n", b"\xff\xfe\xfd\n", b"[]\n", b"null\n", b"1\n", b'"relu"\n', b"{}\n",
    b'{"id": 1e400, "rule": "relu", "mesh": [2], "args": [{"shape": [4]}]}\n',
    b'{"id": -1e400, "rule": "nope", "mesh": [2], "args": []}\n',
    b'{"id": NaN, "rule": "relu", "mesh": [2], "args": [{"shape": [4]}]}\n',
    b'{"id": {"a": [1, 2]}, "rule": "relu", "mesh": [2], "args": [{"shape": [4], "dims_mapping": [0]}]}\n',
    b'{"mdoe": "forward", "rule": "relu", "mesh": [2], "args": [{"shape": [4]}]}\n',
    b'{"rule": "relu", "mesh": [2], "args": [{"shape": [4]}]}\r\n',
    b'\xef\xbb\xbf{"rule": "relu", "mesh": [2], "args": [{"shape": [4]}]}\n',
    b'{"rule": "relu", "mesh": [2], "args": [{"shape": [4]}], "rule": "abs"}\n',
    b'{"rule": "relu", "mesh": [1048577], "args": [{"shape": [4]}]}\n',
    b'{"rule": "relu", "mesh": [1024, 1024], "args": [{"shape": [4]}]}\n',
    b'{"rule": "split", "mesh": [2], "args": [{"shape": [8192]}, 8192, 0]}\n',
    b'{"rule": "split_with_num", "mesh": [2], "args": [{"shape": [8192]}, 4097, 0]}\n',
    b'{"rule": "unsqueeze", "mesh": [2], "args": [{"shape": [4]}, [' + b", ".join([b"0"] * 1100) + b"]]}\n",
    b'{"rule": "relu", "mesh": [2], "args": [' + b"[" * 5000 + b"]" * 5000 + b"]}\n",
    b'{"rule": "cast", "mesh": [2], "args": [{"shape": [4]}, {"a": [1, {"b": null}]}]}\n',
    b'{"rule": "relu", "mesh": [2], "args": [{"shape": [99999999999999999999999]}]}\n',
    b'{"rule": "relu", "mesh": [2], "args": [{"shape": [4], "partial": {"0": "median"}}]}\n',
    b'{"rule": "relu", "mesh": [2], "args": [{"shape": [4], "partial": {"0": "sum"}, "dims_mapping": [0]}]}\n',
    b'{"rule": "matmul", "mesh": {"shape": [2, 2], "dim_names": ["dp", "tp"], "process_ids": [3, 2, 1, 0]}, '
    b'"args": [{"shape": [8, 4], "dims_mapping": [0, 1]}, {"shape": [4, 6], "dims_mapping": [1, -1]}]}\n',
    b"{" + b" " * (16 * 2**20 + 10) + b"}\n",  # over the 16 MiB line limit
    b'{"rule": "relu", "mesh": [2], "args": [{"shape": [4]}]}',  # the last line, without a newline
]


def answer_inputs(name: str, cases: Path) -> Iterator[bytes]:
    """The input lines of an answer set (also what compare shows beside a differing answer)."""
    if name == "answers":
        with cases.open("rb") as f:
            yield from f
    elif name == "answers_cached":
        for _ in range(2):
            with cases.open("rb") as f:
                for i, line in enumerate(f):
                    if i % 10 == 0:
                        yield line
    elif name == "answers_raw":
        yield from RAW_LINES
    else:
        raise ValueError(name)


# == the command list ==========================================================================


@dataclass
class Cmd:
    id: str
    argv: list[str]
    weight: float = 1.0
    sub: bool = False  # a subprocess of its own (spmdkit run) instead of the in-process worker
    tty: int | None = None  # stdout is a terminal of this many columns
    pin: int | None = None  # run on this worker (spmdkit run: one at a time)


STRATEGIES = ["dp", "megatron", "megatron,sp", "dp,zero1", "zero", "zero3", "fsdp", "megatron,zero1",
              "megatron,zero3", "megatron,sp,zero2", "megatron,sp,fsdp", "sp"]
TINY_PRESETS = ("tiny-llama", "tiny-gpt2", "tiny-gpt-dropout")


def _small(preset: str) -> list[str]:
    return [] if preset in TINY_PRESETS else ["--layers", "2"]


def build_commands(presets: list[str], rules: list[dict[str, Any]], man: dict[str, Any],
                   cases_sample: list[str]) -> list[Cmd]:
    """The fixed list of commands a snapshot runs (a function of the presets the CLI names, the
    rules it lists and the fixtures)."""
    cmds: list[Cmd] = []

    def add(cid: str, argv: list[str], weight: float = 1.0, **kw: Any) -> None:
        cmds.append(Cmd(cid, argv, weight, **kw))

    add("rules/text", ["rules"])
    add("help/main", ["--help"], 0.2)
    for sc in ("infer", "rules", "verify", "plan", "run", "demo"):
        add(f"help/{sc}", [sc, "--help"], 0.2)
    add("demo", ["demo"], 2)

    # -- presets: the strategy matrix (JSON), small layer counts for the large presets
    for p in presets:
        for s in STRATEGIES:
            for mesh in ("dp=2,tp=2",) + (("dp=4", "tp=4") if p in TINY_PRESETS else ()):
                add(f"plan-json/{p}/{mesh}/{s}", ["plan", "--model", p, "--mesh", mesh, "--strategy", s,
                                                  *_small(p), "--json"], 1)
        # full size, default strategy: JSON and the wide text report, on a device
        add(f"plan-full/{p}/json", ["plan", "--model", p, "--mesh", "dp=2,tp=4", "--json"], 3)
        add(f"plan-full/{p}/text-wide-h100", ["plan", "--model", p, "--mesh", "dp=2,tp=4", "--wide",
                                              "--device", "h100"], 3)
        add(f"plan-text/{p}/dp8-dp", ["plan", "--model", p, "--mesh", "dp=8", "--strategy", "dp", *_small(p)])
        for s in ("megatron,sp", "dp,zero1", "zero3", "megatron,sp,fsdp"):
            add(f"plan-text/{p}/dp=2,tp=4/{s}", ["plan", "--model", p, "--mesh", "dp=2,tp=4", "--strategy", s,
                                                 *_small(p), "--wide"])
        for dev in ("h100", "a100-80gb", "a100-40gb", "h200"):
            add(f"plan-device/{p}/{dev}/json", ["plan", "--model", p, "--mesh", "dp=2,tp=4", *_small(p),
                                                "--device", dev, "--json"])
        for rc in ("selective", "full"):
            add(f"plan-recompute/{p}/{rc}", ["plan", "--model", p, "--mesh", "tp=4", "--strategy", "megatron,sp",
                                             *_small(p), "--device", "a100-80gb", "--recompute", rc, "--wide"])
            add(f"plan-recompute/{p}/{rc}/json", ["plan", "--model", p, "--mesh", "dp=2,tp=2", *_small(p),
                                                  "--device", "h100", "--recompute", rc, "--json"])
    # README / test figures
    add("readme/llama-7b-megatron-h100", ["plan", "--model", "llama-7b", "--mesh", "dp=2,tp=4", "--strategy",
                                          "megatron", "--device", "h100", "--wide"], 3)
    add("readme/gpt-dropout-22b", ["plan", "--model", "gpt-dropout-22b", "--mesh", "tp=8", "--strategy",
                                   "megatron,sp", "--device", "a100-80gb", "--wide"], 3)
    add("readme/llama-7b-zero-dp8", ["plan", "--model", "llama-7b", "--mesh", "dp=8", "--strategy", "zero3",
                                     "--device", "h100", "--json"], 3)
    add("readme/make-demo", ["plan", "--model", "llama-7b", "--mesh", "dp=2,tp=4", "--strategy", "megatron",
                             "--verify", "--wide"], 4)
    # knobs
    knobs = {
        "grad-accum": ["--grad-accum", "4", "--device", "h100"],
        "nodes-of-2": ["--device", "h100", "--nodes-of", "2"],
        "nodes-of-1": ["--nodes-of", "1"],
        "cost": ["--cost", "tp=5us/150GB,dp=20us/25GB"],
        "batch-seq": ["--batch", "3", "--seq", "12"],
        "annotate": ["--annotate", "tokens=[-1,0]"],
        "device-file": ["--device", "../fixtures/device.json"],
        "memory": ["--device", "h100", "--memory", "1GiB"],
    }
    for name, extra in knobs.items():
        for fmt in ("json", "text"):
            add(f"plan-knob/{name}/{fmt}", ["plan", "--model", "tiny-llama", "--mesh", "dp=2,tp=2", *extra,
                                            *(["--json"] if fmt == "json" else ["--wide"])])
    add("plan-knob/llama-7b-grad-accum", ["plan", "--model", "llama-7b", "--layers", "2", "--mesh", "dp=8",
                                          "--strategy", "zero1", "--grad-accum", "4", "--device", "h100", "--json"])
    # terminal widths (a fake terminal on stdout)
    for cols in (80, 100, 160):
        add(f"tty/{cols}/llama-7b", ["plan", "--model", "llama-7b", "--layers", "2", "--mesh", "dp=2,tp=4",
                                     "--device", "h100"], tty=cols)
    add("tty/100/pp", ["plan", "--model", "llama-7b", "--layers", "4", "--mesh", "pp=2,dp=2,tp=2", "--microbatches",
                       "4", "--device", "h100"], tty=100)
    add("tty/100/rules", ["rules"], tty=100)

    # -- pipelines
    for sched in ("gpipe", "1f1b", "interleaved"):
        base = ["plan", "--model", "llama-7b", "--layers", "4", "--mesh", "pp=2,dp=2,tp=2", "--strategy",
                "megatron,sp", "--microbatches", "4", "--schedule", sched, "--device", "h100"]
        add(f"pipeline/llama-7b/{sched}/text", [*base, "--wide"], 2)
        add(f"pipeline/llama-7b/{sched}/json", [*base, "--json"], 2)
    add("pipeline/llama-70b/readme", ["plan", "--model", "llama-70b", "--mesh", "pp=4,dp=8,tp=8", "--strategy",
                                      "megatron,sp", "--microbatches", "16", "--device", "h100", "--wide"], 4)
    add("pipeline/llama-70b/interleaved", ["plan", "--model", "llama-70b", "--mesh", "pp=4,dp=8,tp=8",
                                           "--strategy", "megatron,sp", "--microbatches", "16", "--schedule",
                                           "interleaved", "--virtual-stages", "2", "--device", "h100", "--json"], 4)
    add("pipeline/llama-70b/stages", ["plan", "--model", "llama-70b", "--mesh", "pp=4,dp=8,tp=8", "--strategy",
                                      "megatron,sp", "--microbatches", "16", "--stages", "22,20,20,18", "--device",
                                      "h100", "--wide"], 4)
    add("pipeline/gpt2-small", ["plan", "--model", "gpt2-small", "--mesh", "pp=2,dp=2,tp=2", "--strategy",
                                "megatron,sp", "--microbatches", "4", "--device", "a100-80gb", "--json"], 2)
    add("pipeline/tiny-llama-annotate", ["plan", "--model", "tiny-llama", "--layers", "2", "--mesh",
                                         "pp=2,tp=2,dp=2", "--strategy", "megatron", "--annotate", "tokens=[-1,2]",
                                         "--json"])
    add("pipeline/tiny-gpt2-no-pp-microbatches", ["plan", "--model", "tiny-gpt2", "--mesh", "dp=2,tp=2",
                                                  "--microbatches", "2"])
    add("pipeline/tiny-llama-verify", ["plan", "--model", "tiny-llama", "--mesh", "pp=2,dp=2", "--strategy", "dp",
                                       "--microbatches", "2", "--verify"], 2)
    add("pipeline/recompute", ["plan", "--model", "gpt-dropout-small", "--layers", "4", "--mesh", "pp=2,tp=2",
                               "--strategy", "megatron,sp", "--microbatches", "4", "--device", "a100-80gb",
                               "--recompute", "selective", "--wide"], 2)

    # -- --devices N
    for m, n in (("tiny-llama", 2), ("tiny-llama", 4), ("tiny-gpt2", 4), ("tiny-gpt-dropout", 8)):
        add(f"devices/{m}/{n}/text", ["plan", "--model", m, "--devices", str(n), "--wide"], 5)
        add(f"devices/{m}/{n}/json", ["plan", "--model", m, "--devices", str(n), "--recompute", "none",
                                      "--json"], 4)
    add("devices/tiny-llama/4/auto", ["plan", "--model", "tiny-llama", "--layers", "1", "--devices", "4", "--auto",
                                      "--recompute", "none", "--json"], 8)
    add("devices/tiny-llama/2/memory", ["plan", "--model", "tiny-llama", "--devices", "2", "--memory", "100KiB",
                                        "--json"], 3)
    add("devices/tiny-llama/2/memory-1KB", ["plan", "--model", "tiny-llama", "--devices", "2", "--memory", "1KB",
                                            "--recompute", "none"], 2)
    add("devices/llama-7b-2layers/8", ["plan", "--model", "llama-7b", "--layers", "2", "--devices", "8",
                                       "--device", "h100", "--wide"], 8)

    # -- --auto (HiGHS) on small models
    for m in ("tiny-llama", "tiny-gpt2"):
        for mesh in ("dp=2,tp=2", "dp=4"):
            add(f"auto/{m}/{mesh}/json", ["plan", "--model", m, "--layers", "1", "--mesh", mesh, "--auto",
                                          "--json"], 4)
        add(f"auto/{m}/h100/text", ["plan", "--model", m, "--layers", "2", "--mesh", "dp=2,tp=2", "--auto",
                                    "--device", "h100", "--wide"], 5)
    add("auto/tiny-llama/explain", ["plan", "--model", "tiny-llama", "--layers", "1", "--mesh", "dp=2,tp=2",
                                    "--auto", "--device", "h100", "--explain", "--wide"], 5)
    add("auto/tiny-llama/memory", ["plan", "--model", "tiny-llama", "--layers", "1", "--mesh", "dp=2,tp=2",
                                   "--auto", "--device", "h100", "--memory", "200KiB", "--json"], 5)
    add("auto/tiny-llama/annotate-verify", ["plan", "--model", "tiny-llama", "--layers", "1", "--mesh", "dp=2,tp=2",
                                            "--auto", "--annotate", "tokens=[0,-1]", "--verify", "--json"], 5)
    add("auto/tiny-llama/html", ["plan", "--model", "tiny-llama", "--layers", "1", "--mesh", "dp=2,tp=2", "--auto",
                                 "--device", "h100", "--html", "auto.html"], 5)

    # -- --html, --export
    add("html/tiny-llama", ["plan", "--model", "tiny-llama", "--mesh", "dp=2,tp=2", "--json", "--html", "p.html"], 2)
    add("html/llama-7b-h100", ["plan", "--model", "llama-7b", "--mesh", "dp=2,tp=4", "--device", "h100", "--html",
                               "plan.html"], 4)
    add("html/llama-7b-pp", ["plan", "--model", "llama-7b", "--mesh", "pp=2,dp=2,tp=2", "--layers", "4",
                             "--microbatches", "4", "--device", "h100", "--html", "pp.html"], 3)
    add("html/devices", ["plan", "--model", "tiny-llama", "--devices", "4", "--html", "dev.html"], 5)
    add("html/no-dir", ["plan", "--model", "tiny-llama", "--mesh", "dp=2", "--strategy", "dp", "--html",
                        "no/p.html"])
    add("html/is-dir", ["plan", "--model", "tiny-llama", "--mesh", "dp=2", "--strategy", "dp", "--html", "."])
    for fmt in ("dtensor", "jax", "paddle"):
        for p, mesh, s in (("tiny-llama", "dp=2,tp=2", "megatron"), ("tiny-gpt2", "dp=2,tp=2", "megatron"),
                           ("llama-7b", "dp=2,tp=4", "megatron"), ("tiny-llama", "dp=4", "zero3"),
                           ("tiny-llama", "dp=2,tp=2", "megatron,sp")):
            add(f"export/{fmt}/{p}/{mesh}/{s}", ["plan", "--model", p, *_small(p), "--mesh", mesh, "--strategy", s,
                                                 "--export", fmt, f"plan.{fmt}.json"])
    add("export/onnx", ["plan", "--model", "tiny-llama", "--export", "onnx", "x.json"])

    # -- --verify on the tiny models
    for p in TINY_PRESETS:
        for s in ("dp", "megatron", "megatron,sp", "dp,zero1", "zero", "zero3", "megatron,sp,fsdp",
                  "megatron,zero3"):
            add(f"verify-plan/{p}/{s}", ["plan", "--model", p, "--mesh", "dp=2,tp=2", "--strategy", s, "--verify",
                                         "--json"], 3)
    add("verify-plan/tiny-llama/text", ["plan", "--model", "tiny-llama", "--mesh", "dp=2,tp=2", "--strategy",
                                        "megatron,sp", "--verify", "--wide"], 3)

    # -- programs
    progs = man.get("programs", {})
    for name in sorted(progs):
        path = f"../fixtures/{progs[name]}"
        if name.startswith("broken"):
            add(f"program/{name}", ["plan", "--program", path, "--mesh", "dp=2"])
            continue
        if name == "mlp":
            add("program/mlp/annotate", ["plan", "--program", path, "--mesh", "dp=2,tp=2", "--annotate", "x=[0,-1]",
                                         "--annotate", "w1=[-1,1]", "--annotate", "w2=[1,-1]", "--annotate",
                                         "y=[0,-1]", "--json"])
            add("program/mlp/auto", ["plan", "--program", path, "--mesh", "dp=2,tp=2", "--auto", "--json"], 3)
            add("program/mlp/layers", ["plan", "--program", path, "--mesh", "dp=2", "--layers", "3"])
            add("program/mlp/verify", ["plan", "--program", path, "--mesh", "dp=2", "--verify"])
        strategies = ["none", "dp", "megatron", "megatron,sp", "zero3"] if name.startswith("hf-") else [
            "none", "dp", "megatron"]
        for s in strategies:
            meshes = ("dp=2,tp=2",) + (("tp=4",) if s.startswith("megatron") else ())
            for mesh in meshes:
                argv = ["plan", "--program", path, "--mesh", mesh, "--json"]
                if s != "none":
                    argv += ["--strategy", s]
                add(f"program/{name}/{mesh}/{s}", argv, 2 if name.startswith("hf-") else 1)
        add(f"program/{name}/text", ["plan", "--program", path, "--mesh", "dp=2,tp=2", "--strategy", "megatron"
                                     if name != "mlp" else "dp", "--device", "h100", "--wide"],
            2 if name.startswith("hf-") else 1)
        if name in ("zoo-tiny-gpt2", "hf-llama"):
            add(f"program/{name}/auto", ["plan", "--program", path, "--mesh", "dp=2", "--auto", "--annotate",
                                         "tokens=[0,-1]" if name.startswith("zoo") else "input_ids=[0,-1]",
                                         "--json", "--auto-time-limit", "20"], 6)
            add(f"program/{name}/devices", ["plan", "--program", path, "--devices", "4", "--recompute", "none",
                                            "--json"], 5)

    # -- HF models through --hf (torch.export in the worker)
    for name, hf in sorted(man.get("hf", {}).items()):
        cfg = f"../fixtures/{hf['config']}"
        add(f"hf/{name}/megatron", ["plan", "--hf", hf["class"], "--hf-config", cfg, "--mesh", "dp=2,tp=2",
                                    "--strategy", "megatron", "--json"], 8)
    if "llama" in man.get("hf", {}):
        cfg = "../fixtures/" + man["hf"]["llama"]["config"]
        add("hf/llama/bf16-sp", ["plan", "--hf", "LlamaForCausalLM", "--hf-config", cfg, "--dtype", "bf16",
                                 "--batch", "4", "--mesh", "dp=2,tp=2", "--strategy", "megatron,sp", "--json"], 8)
        add("hf/llama/tp4-text", ["plan", "--hf", "LlamaForCausalLM", "--hf-config", cfg, "--mesh", "tp=4",
                                  "--strategy", "megatron", "--device", "h100", "--wide"], 8)
        add("hf/llama/tp-plan", ["plan", "--hf", "LlamaForCausalLM", "--hf-config", cfg, "--mesh", "dp=2,tp=2",
                                 "--strategy", "megatron", "--tp-plan", '{"*.k_proj": "replicate"}', "--json"], 8)
        add("hf/llama/zero3", ["plan", "--hf", "LlamaForCausalLM", "--hf-config", cfg, "--mesh", "dp=4",
                               "--strategy", "zero3", "--json"], 8)
        add("hf/llama/export-dtensor", ["plan", "--hf", "LlamaForCausalLM", "--hf-config", cfg, "--mesh",
                                        "dp=2,tp=2", "--export", "dtensor", "plan.dtensor.json"], 8)
        add("hf/llama/bad-tp-plan", ["plan", "--hf", "LlamaForCausalLM", "--hf-config", cfg, "--tp-plan",
                                     '{"q_proj": "col"}'], 1)
    if "hf_small" in man:
        inline = json.dumps(HF_SMALL)
        add("hf/small/auto", ["plan", "--hf", "LlamaForCausalLM", "--hf-config", inline, "--batch", "2", "--seq", "8",
                              "--mesh", "dp=2", "--auto", "--device", "h100", "--json", "--auto-time-limit", "20"], 8)
        add("hf/small/devices", ["plan", "--hf", "LlamaForCausalLM", "--hf-config", inline, "--batch", "2", "--seq",
                                 "8", "--devices", "2", "--recompute", "none", "--json"], 8)
        add("hf/small/auto-verify", ["plan", "--hf", "LlamaForCausalLM", "--hf-config", inline, "--mesh", "dp=2",
                                     "--auto", "--verify"], 1)
    for argv in (["--hf", "LlamaForCausalLM"], ["--hf-config", "{}"], ["--hf", "NoSuchModel", "--hf-config", "{}"],
                 ["--hf", "LlamaForCausalLM", "--hf-config", "{oops"],
                 ["--hf", "LlamaForCausalLM", "--hf-config", "missing.json"]):
        add("hf-error/" + " ".join(argv), ["plan", *argv])

    # -- refusals (tests/test_plan_robust.py and friends)
    tiny = ["--model", "tiny-llama"]
    for mesh in ("dp=100000,tp=100000", "dp=99999999999999999999", "dp=\u00b2", "dp=\u0662", "dp=0", "dp=-1",
                 "dp=2,dp=2", "=2", "dp=", "dp", "", ",,", "dp=2.0", "dp=1e3", "d p=2", "dp=2,tp=x", "\u00e9=2",
                 "dp=1048577", "dp=3,tp=3"):
        add(f"error/mesh/{mesh}", ["plan", *tiny, "--mesh", mesh], 0.3)
    for cost in ("tp=5us/0GB", "tp=5us/0.0GB", "tp=5us/GB", "tp=5/150GB", "tp=5us/1.2.3GB", "tp=..us/1GB",
                 "garbage", "tp=5us/150GB,zz=1us/1GB", "7=1us/1GB", "tp=" + "9" * 400 + "us/1GB"):
        add(f"error/cost/{cost[:40]}", ["plan", *tiny, "--mesh", "dp=2,tp=2", "--cost", cost], 0.3)
    for flag, value in (("--layers", "1000000"), ("--layers", "513"), ("--layers", "0"), ("--layers", "-3"),
                        ("--batch", "1e20"), ("--batch", "0"), ("--batch", "-1"), ("--batch", "99999999999999999999"),
                        ("--batch", "\u0663"), ("--seq", "0"), ("--seq", "4.5"), ("--seq", "nan"),
                        ("--grad-accum", "0"), ("--nodes-of", "0"), ("--microbatches", "0"), ("--memory", "lots"),
                        ("--recompute", "partial"), ("--schedule", "zigzag"), ("--device", "tpu"),
                        ("--virtual-stages", "3"), ("--stages", "1,1,1")):
        add(f"error/flag/{flag}={value}", ["plan", *tiny, "--mesh", "dp=2,tp=2", f"{flag}={value}"], 0.3)
    for ann in ("tokens=[0", "tokens", "=[0,-1]", "tokens=[5,5]", "tokens=[0]", 'tokens="x"', "tokens=[true,-1]",
                "tokens=[0.5,-1]", 'tokens={"a":1}', "tokens=[[[0]],-1]", "nope=[0,-1]", "tokens=[-7,-1]",
                "tokens=" + "[" * 1500 + "]" * 1500):
        add(f"error/annotate/{ann[:30]}", ["plan", *tiny, "--mesh", "dp=2,tp=2", "--annotate", ann], 0.3)
    for argv in (["--model", "nope", "--mesh", "dp=2"], ["--model", "gpt5"], [*tiny, "--mesh", "dp=2,tp=2",
                 "--strategy", "x" * 500], [*tiny, "--mesh", "dp=2", "--strategy", "megatron"],
                 [*tiny, "--mesh", "dp=2", "--strategy", "sp"], [*tiny, "--strategy", "zero4"],
                 [*tiny, "--strategy", "zero1,zero3"], [*tiny, "--strategy", "zero3", "--mesh", "tp=2"],
                 [*tiny, "--mesh", "dp=2", "--strategy", "pp"], [*tiny, "--mesh", "dp=2", "--strategy", "dp",
                 "--auto"], [*tiny, "--mesh", "dp=2,tp=2", "--devices", "4"], [*tiny, "--devices", "0"],
                 [*tiny, "--devices", "3", "--auto", "--explain"], [*tiny, "--mesh", "dp=2", "--explain"],
                 [*tiny, "--mesh", "dp=3", "--strategy", "dp", "--verify"], [*tiny, "--mesh", "--x"], [*tiny, "--bogus"],
                 [*tiny, "--layers"], [*tiny, "--mesh", "-x"], ["--program", "absent.json", "--mesh", "dp=2"],
                 [*tiny, "--program", "absent.json"], [*tiny, "--mesh", "pp=2,dp=2", "--schedule", "interleaved",
                 "--microbatches", "3"]):
        add("error/plan/" + " ".join(argv)[:80], ["plan", *argv], 0.3)
    # seeded random plan arguments (tests/test_plan_robust.py's fuzz, our own seed)
    pieces = ["dp", "tp", "=", ",", "2", "3", "0", "-1", "\u00b2", "[", "]", "{", "}", '"', "us", "/", "GB", "e9",
              ".", " ", "x", "9999999999", "tokens", "null", "true", "-", "\u0662", ":", "ms", "TB"]
    r = random.Random(2513)

    def junk() -> str:
        return "".join(r.choice(pieces) for _ in range(r.randint(0, 12)))

    for k in range(120):
        argv = [*tiny, "--mesh=" + r.choice(["dp=2,tp=2", "tp=2", "dp=2", junk()])]
        if r.random() < 0.5:
            argv += ["--cost=" + r.choice(["tp=5us/150GB", junk()])]
        if r.random() < 0.5:
            argv += ["--annotate=" + r.choice(["tokens=", "labels=", ""]) + junk()]
        for flag in ("--layers", "--batch", "--seq"):
            if r.random() < 0.3:
                argv += [f"{flag}={r.choice(['1', '2', '4', junk()])}"]
        add(f"fuzz-plan/{k:03d}", ["plan", *argv], 0.3)

    # -- verify (the simulator) and single infer calls
    canon = sorted({row["canonical"] for row in rules})
    add("verify/all-3-both-json", ["verify", "--cases", "3", "--mode", "both", "--json"], 10)
    sample = canon[::9]
    for i in range(0, len(sample), 8):
        chunk = sample[i:i + 8]
        add(f"verify/sample/{chunk[0]}", ["verify", *chunk, "--cases", "20", "--mode", "both"], 4)
    add("verify/transpose-seed2", ["verify", "transpose", "--cases", "5", "--mode", "both", "--seed", "2"])
    add("verify/transpose_grad-json", ["verify", "transpose_grad", "--cases", "4", "--json"])
    add("verify/unknown", ["verify", "broken_softmax", "--cases", "30", "--mode", "forward"])
    add("verify/matmul-forward", ["verify", "matmul", "--cases", "50", "--mode", "forward"], 2)
    for k, line in enumerate(cases_sample):
        add(f"infer-one/{k:03d}/text", ["infer", line], 0.2)
        add(f"infer-one/{k:03d}/json", ["infer", "--json", line], 0.2)
    add("infer-one/bad-json", ["infer", "{nope"], 0.2)
    add("infer-one/none", ["infer"], 0.2)

    # -- spmdkit run (one process per rank, gloo, numpy kernels: exact), subprocesses on one worker
    for argv in (["--model", "tiny-llama", "--mesh", "dp=2,tp=2", "--strategy", "megatron,sp"],
                 ["--json", "--model", "tiny-gpt2", "--mesh", "dp=2,tp=2", "--strategy", "megatron"],
                 ["--model", "tiny-gpt-dropout", "--mesh", "dp=4", "--strategy", "zero3"]):
        add("run/" + " ".join(argv), ["run", "--kernels", "numpy", *argv], 12, sub=True, pin=0)
    add("run/refused-uneven", ["run", "--kernels", "numpy", "--model", "tiny-llama", "--mesh", "dp=3",
                               "--strategy", "dp"], 2, sub=True, pin=0)
    ids = [c.id for c in cmds]
    dup = [k for k, v in Counter(ids).items() if v > 1]
    assert not dup, dup
    return cmds


# == the worker (PYTHONPATH = the tree) ========================================================


class _Proxy(io.TextIOBase):
    """sys.stdout / sys.stderr of a worker: one object for the whole process (a logging handler
    that keeps it writes to the current command's buffer), the buffer swapped per command."""

    def __init__(self) -> None:
        self.buf = io.StringIO()
        self.tty = False

    def write(self, s: str) -> int:
        return self.buf.write(s)

    def isatty(self) -> bool:
        return self.tty

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        pass

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"


class _CommandTimeout(BaseException):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _CommandTimeout()


def _worker(a: argparse.Namespace) -> int:
    import warnings

    proto = os.fdopen(os.dup(1), "w", encoding="utf-8")
    requests = sys.stdin
    out, err = _Proxy(), _Proxy()
    real_out, real_err = sys.stdout, sys.stderr
    import spmdkit
    from spmdkit.cli import main

    proto.write(json.dumps({"ready": True, "spmdkit": spmdkit.__file__}) + "\n")
    proto.flush()
    signal.signal(signal.SIGALRM, _on_alarm)
    for line in requests:
        req = json.loads(line)
        os.chdir(req["cwd"])
        out.buf, err.buf = io.StringIO(), io.StringIO()
        out.tty = req.get("tty") is not None
        if out.tty:
            os.environ["COLUMNS"] = str(req["tty"])
        fd_files = [tempfile.TemporaryFile(), tempfile.TemporaryFile()]
        saved = [os.dup(1), os.dup(2)]
        os.dup2(fd_files[0].fileno(), 1)
        os.dup2(fd_files[1].fileno(), 2)
        sys.stdout, sys.stderr = out, err
        sys.stdin = io.StringIO("")
        exc_text = None
        t0 = time.perf_counter()
        try:
            signal.alarm(int(req.get("timeout", 600)))
            with warnings.catch_warnings():
                rc: Any = main(list(req["argv"]))
        except SystemExit as e:
            code = e.code
            if code is None:
                rc = 0
            elif isinstance(code, int):
                rc = code
            else:
                err.write(f"{code}\n")
                rc = 1
        except _CommandTimeout:
            rc = "timeout"
            exc_text = "the command ran past the worker's time limit"
        except BaseException as e:
            rc = 1
            exc_text = f"{type(e).__name__}: {e}"
            err.write(f"Traceback: {exc_text}\n")
        finally:
            signal.alarm(0)
            sys.stdout, sys.stderr = real_out, real_err
            with contextlib.suppress(Exception):
                sys.__stdout__.flush()  # type: ignore[union-attr]
                sys.__stderr__.flush()  # type: ignore[union-attr]
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            os.environ.pop("COLUMNS", None)
        raw = []
        for f in fd_files:
            f.seek(0)
            raw.append(f.read().decode("utf-8", "replace"))
            f.close()
        resp = {"rc": rc, "stdout": out.buf.getvalue(), "stderr": err.buf.getvalue(), "fd_stdout": raw[0],
                "fd_stderr": raw[1], "exception": exc_text, "seconds": round(time.perf_counter() - t0, 3)}
        if exc_text is not None:
            resp["traceback_frames"] = traceback.format_exc(limit=-3)[-2000:]
        proto.write(json.dumps(resp) + "\n")
        proto.flush()
    return 0


class Worker:
    def __init__(self, tree: Path, cwd: Path, hashseed: str) -> None:
        self.tree, self.cwd, self.hashseed = tree, cwd, hashseed
        self.proc: subprocess.Popen[str] | None = None
        self.spmdkit_file = ""

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, str(SCRIPT), "_worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     env=_child_env(self.tree, self.hashseed), cwd=str(self.cwd), bufsize=1)
        assert self.proc.stdout is not None
        hello = self.proc.stdout.readline()
        if not hello:
            raise RuntimeError(f"the worker for {self.tree} did not start (cannot import spmdkit.cli?)")
        self.spmdkit_file = json.loads(hello)["spmdkit"]

    def call(self, argv: list[str], cwd: Path, tty: int | None) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"argv": argv, "cwd": str(cwd), "tty": tty}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            self.proc = None
            return {"rc": f"worker-died({code})", "stdout": "", "stderr": "", "fd_stdout": "", "fd_stderr": "",
                    "exception": "the worker process died"}
        resp: dict[str, Any] = json.loads(line)
        return resp

    def close(self) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def _run_sub(tree: Path, argv: list[str], cwd: Path, hashseed: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "spmdkit", *argv], cwd=str(cwd), env=_child_env(tree, hashseed),
                           capture_output=True, text=True, timeout=300, check=False)
        rc: Any = p.returncode
        so, se = p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, so, se = "timeout", str(e.stdout or ""), str(e.stderr or "")
    return {"rc": rc, "stdout": so, "stderr": se, "fd_stdout": "", "fd_stderr": "", "exception": None,
            "seconds": round(time.perf_counter() - t0, 3)}


def _collect_files(d: Path, hits: Counter[str], paths: dict[str, str]) -> dict[str, Any]:
    files: dict[str, Any] = {}
    for p in sorted(d.rglob("*")):
        if not p.is_file():
            continue
        data = p.read_bytes()
        rec: dict[str, Any] = {"bytes": len(data)}
        try:
            text = data.decode("utf-8")
            rec["text"] = normalise(text, hits, paths)
            rec["sha256"] = hashlib.sha256(rec["text"].encode()).hexdigest()
        except UnicodeDecodeError:
            rec["sha256"] = hashlib.sha256(data).hexdigest()
            rec["base64"] = base64.b64encode(data).decode() if len(data) <= 1 << 20 else None
        files[p.relative_to(d).as_posix()] = rec
    return files


# == snapshot ==================================================================================


def _presets(w: Worker, work: Path) -> tuple[list[str], dict[str, Any]]:
    """The presets the CLI names: the refusal of an unknown --model lists them."""
    d = work / "discover"
    d.mkdir(parents=True, exist_ok=True)
    res = w.call(["plan", "--model", "__equiv_no_such_model__", "--mesh", "dp=2"], d, None)
    m = re.search(r"presets: ([^)]*)\)", res["stderr"])
    if not m:
        h = w.call(["plan", "--help"], d, None)
        m = re.search(r"a preset \(([^)]*)\)", " ".join(h["stdout"].split()))
    if not m:
        raise SystemExit(f"equiv snapshot: cannot find the preset list in: {res['stderr']!r}")
    return sorted(x.strip() for x in m.group(1).split(",") if x.strip()), res


def cmd_snapshot(a: argparse.Namespace) -> int:
    tree = Path(a.tree).resolve()
    cases = Path(a.cases).resolve()
    final = Path(a.out).resolve()
    out = final.with_name(final.name + ".partial")  # renamed to OUT_DIR when complete (a reader never sees half)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    work = out / ".work"
    work.mkdir()
    fix_src = fixtures_dir(cases)
    if fix_src.is_dir():
        shutil.copytree(fix_src, work / "fixtures")
    else:
        (work / "fixtures").mkdir()
    man = json.loads((work / "fixtures" / "manifest.json").read_text()) if (
        work / "fixtures" / "manifest.json").exists() else {}
    (work / "fixtures" / "device.json").write_text(json.dumps({
        "base": "h100", "name": "our H100s", "peak_tflops": {"bf16": 750, "fp32": 60}, "hbm_gb_per_s": 3000,
        "intra_node": {"latency_us": 3, "gb_per_s": 370}, "inter_node": {"latency_us": 8, "gb_per_s": 45},
        "ranks_per_node": 8, "tf32": False}))  # docs/devices.md's example
    paths = {str(work): "<work>", str(tree): "<tree>"}
    hits: Counter[str] = Counter()
    t_start = time.perf_counter()
    timings: dict[str, float] = {}

    # (a) answers, in a process of their own per set, while the workers plan
    infer_meta: dict[str, Any] = {}

    def infer() -> None:
        for name, argv, _what in ANSWER_SETS:
            t0 = time.perf_counter()
            src = work / f"{name}.in"
            with src.open("wb") as f:
                for line in answer_inputs(name, cases):
                    f.write(line)
            with (out / f"{name}.jsonl").open("wb") as f, src.open("rb") as fin:
                p = subprocess.run([sys.executable, "-m", "spmdkit", *argv], stdin=fin, stdout=f,
                                   stderr=subprocess.PIPE, env=_child_env(tree, a.hashseed), cwd=str(work), check=False)
            src.unlink()
            timings[f"infer {name}"] = round(time.perf_counter() - t0, 1)
            infer_meta[name] = {"argv": argv, "rc": p.returncode, "stderr": normalise(
                p.stderr.decode("utf-8", "replace")[-4000:], hits, paths)}

    t_inf = threading.Thread(target=infer)
    if not a.skip_infer:
        t_inf.start()

    workers = [Worker(tree, work, a.hashseed) for _ in range(max(1, a.jobs))]
    for w in workers:
        w.start()
        if not Path(w.spmdkit_file).resolve().is_relative_to(tree):
            raise SystemExit(f"equiv snapshot: the worker imported {w.spmdkit_file}, not the tree {tree}")
    presets, discovery = _presets(workers[0], work)
    rules_res = workers[0].call(["rules", "--json"], work / "discover", None)
    (out / "rules.json").write_text(rules_res["stdout"])
    rules = json.loads(rules_res["stdout"])
    sample = _cases_sample(cases, 40)
    cmds = build_commands(presets, rules, man, sample)
    if a.only:
        cmds = [c for c in cmds if any(c.id.startswith(p) for p in a.only)]
    # a fixed assignment (the order each worker runs in never depends on timing)
    load = [0.0] * len(workers)
    plan: list[list[int]] = [[] for _ in workers]
    for i, c in enumerate(cmds):
        k = c.pin if c.pin is not None and c.pin < len(workers) else min(range(len(workers)), key=lambda j: load[j])
        plan[k].append(i)
        load[k] += c.weight
    results: dict[int, dict[str, Any]] = {}
    lock = threading.Lock()

    def drive(k: int) -> None:
        for i in plan[k]:
            c = cmds[i]
            d = work / ("c-" + hashlib.sha1(c.id.encode()).hexdigest()[:12])  # named by the id, not the position
            d.mkdir()
            res = _run_sub(tree, c.argv, d, a.hashseed) if c.sub else workers[k].call(c.argv, d, c.tty)
            local: Counter[str] = Counter()
            rec = {"id": c.id, "argv": c.argv, "tty": c.tty, "sub": c.sub, "rc": res["rc"],
                   "stdout": normalise(res["stdout"], local, paths), "stderr": normalise(res["stderr"], local, paths),
                   "files": _collect_files(d, local, paths), "exception": res.get("exception")}
            for key in ("fd_stdout", "fd_stderr"):
                if res.get(key):
                    rec[key] = normalise(res[key], local, paths)
            with lock:
                results[i] = rec
                hits.update(local)
            if a.verbose:
                print(f"  [{k}] {res.get('seconds', 0):6.2f} s rc={res['rc']} {c.id}", file=sys.stderr)
            shutil.rmtree(d, ignore_errors=True)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=drive, args=(k,)) for k in range(len(workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    timings["commands"] = round(time.perf_counter() - t0, 1)
    for w in workers:
        w.close()
    if not a.skip_infer:
        t_inf.join()
    with (out / "commands.jsonl.gz").open("wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6,
                                                                      mtime=0) as gz:
        for i in range(len(cmds)):
            gz.write((json.dumps(results[i], sort_keys=True) + "\n").encode())
    n_answers: dict[str, int] = {}
    for name, _argv, _what in ANSWER_SETS if not a.skip_infer else ():
        n_answers[name] = 0
        raw_path = out / f"{name}.jsonl"
        with raw_path.open("rb") as src, (out / f"{name}.jsonl.gz").open("wb") as raw, gzip.GzipFile(
                fileobj=raw, mode="wb", compresslevel=3, mtime=0) as gz:
            for line in src:
                n_answers[name] += 1
                gz.write(line)
        raw_path.unlink()
    shutil.rmtree(work, ignore_errors=True)
    timings["total"] = round(time.perf_counter() - t_start, 1)
    cats = Counter(_category(c.id) for c in cmds)
    meta = {"format": FORMAT, "tree": str(tree), "tree_commit": _git_head(tree), "python": sys.version.split()[0],
            "spmdkit_imported_from": workers[0].spmdkit_file.replace(str(tree), "<tree>"),
            "cases": str(cases), "cases_sha256": _sha256_file(cases), "answers": n_answers,
            "infer": infer_meta, "presets": presets, "commands": len(cmds), "commands_by_category": dict(cats),
            "jobs": len(workers), "hashseed": a.hashseed, "seconds": timings, "normalisations": NORMALISATIONS,
            "normalisation_hits": dict(sorted(hits.items())), "fixtures_notes": man.get("notes", []),
            "discovery": {"argv": ["plan", "--model", "__equiv_no_such_model__", "--mesh", "dp=2"],
                          "stderr": discovery["stderr"]}}
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    if final.exists():
        old = final.with_name(final.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
        out.rename(final)
        shutil.rmtree(old)
    else:
        out.rename(final)
    out = final
    bad = [results[i]["id"] for i in range(len(cmds)) if not isinstance(results[i]["rc"], int)]
    print(f"equiv snapshot: {tree} -> {out}: answers {n_answers}, {len(cmds)} commands "
          f"({', '.join(f'{k} {v}' for k, v in sorted(cats.items()))}); {timings['total']} s "
          f"(commands {timings['commands']} s; {', '.join(f'{k} {v} s' for k, v in timings.items() if k[:5] == 'infer')})")
    if bad:
        print(f"equiv snapshot: {len(bad)} commands did not finish normally: {bad[:10]}", file=sys.stderr)
    return 0


def _cases_sample(cases: Path, n: int) -> list[str]:
    """Every k-th line of the case file (for single `infer` calls): a fixed sample."""
    lines = cases.read_text().splitlines()
    if not lines:
        return []
    step = max(1, len(lines) // n)
    return [lines[i] for i in range(0, len(lines), step)][:n]


def _category(cid: str) -> str:
    return cid.split("/", 1)[0]


# == compare ===================================================================================


def _load_commands(d: Path) -> dict[str, dict[str, Any]]:
    with gzip.open(d / "commands.jsonl.gz", "rt") as f:
        return {r["id"]: r for r in map(json.loads, f)}


def _iter_gz_lines(p: Path) -> Iterator[str]:
    if not p.exists():
        return
    with gzip.open(p, "rt", encoding="utf-8", errors="replace") as f:
        for line in f:
            yield line.rstrip("\n")


def _pretty(text: str) -> list[str]:
    """JSON (a document or JSON lines) indented, for a readable diff; other text as it is."""
    s = text.strip()
    if s[:1] in "{[":
        try:
            return json.dumps(json.loads(s), indent=1).splitlines()
        except ValueError:
            try:
                return [x for line in s.splitlines() for x in json.dumps(json.loads(line), indent=1).splitlines()]
            except ValueError:
                pass
    return text.splitlines()


def _diff(a: str, b: str, what: str, limit: int = 40, width: int = 300) -> str:
    lines = list(difflib.unified_diff(_pretty(a), _pretty(b), f"A {what}", f"B {what}", n=2, lineterm=""))
    cut = [x if len(x) <= width else x[:width] + f"... ({len(x)} chars)" for x in lines[:limit]]
    if len(lines) > limit:
        cut.append(f"... {len(lines) - limit} more diff lines")
    return "\n".join(cut)


@dataclass
class Tally:
    compared: int = 0
    differing: int = 0
    shown: list[str] = field(default_factory=list)
    detail: Counter[str] = field(default_factory=Counter)


def _compare_answers(name: str, a: Path, b: Path, ma: dict[str, Any], show: int) -> Tally:
    t = Tally()
    cases_path = Path(ma.get("cases", ""))
    ia, ib = _iter_gz_lines(a / f"{name}.jsonl.gz"), _iter_gz_lines(b / f"{name}.jsonl.gz")
    ci = (x.decode("utf-8", "replace") for x in answer_inputs(name, cases_path)) if cases_path.is_file() else iter(())
    n = 0
    while True:
        la, lb = next(ia, None), next(ib, None)
        case = next(ci, "").rstrip("\r\n")
        if la is None and lb is None:
            break
        n += 1
        t.compared += 1
        if la == lb:
            continue
        t.differing += 1
        try:
            ja, jb = json.loads(la or "null"), json.loads(lb or "null")
        except ValueError:
            ja, jb = None, None
        if not isinstance(ja, dict) or not isinstance(jb, dict):
            kind = "missing or unreadable line"
        elif ("error" in ja) != ("error" in jb):
            kind = "answer vs error"
        elif "error" in ja and ja["error"] != jb["error"]:
            kind = "error class"
        elif "error" in ja:
            kind = "error message"
        else:
            kind = "answer (dims_mapping / partial)"
        try:
            rule = json.loads(case).get("rule", "?") if case else "?"
        except ValueError:
            rule = "?"
        t.detail[f"{kind}"] += 1
        t.detail[f"rule {rule}"] += 1
        if len(t.shown) < show:
            t.shown.append(f"{name} line {n} ({kind}; rule {rule})\n  input: {case[:600]}\n  A: {(la or '')[:600]}\n"
                           f"  B: {(lb or '')[:600]}")
    return t


def _compare_cmd(ra: dict[str, Any], rb: dict[str, Any], render: bool) -> list[tuple[str, str]]:
    """(which output, diff text: only when ``render``) for each part of a command's record that differs."""
    diffs: list[tuple[str, str]] = []
    if ra["rc"] != rb["rc"]:
        diffs.append(("exit status", f"A {ra['rc']!r}  B {rb['rc']!r}"))
    for key in ("stdout", "stderr", "fd_stdout", "fd_stderr", "exception"):
        va, vb = ra.get(key) or "", rb.get(key) or ""
        if va != vb:
            diffs.append((key, _diff(str(va), str(vb), key) if render else ""))
    fa, fb = ra.get("files", {}), rb.get("files", {})
    for name in sorted(set(fa) | set(fb)):
        if name not in fa or name not in fb:
            diffs.append((f"file {name}", f"only in {'A' if name in fa else 'B'}"))
        elif fa[name].get("sha256") != fb[name].get("sha256"):
            diffs.append((f"file {name}", _diff(fa[name].get("text") or "<binary>", fb[name].get("text") or "<binary>",
                                                name) if render else ""))
    return diffs


def cmd_compare(a: argparse.Namespace) -> int:
    da, db = Path(a.a), Path(a.b)
    ma = json.loads((da / "meta.json").read_text())
    mb = json.loads((db / "meta.json").read_text())
    print(f"A: {da} (tree {ma['tree']} {ma.get('tree_commit')})")
    print(f"B: {db} (tree {mb['tree']} {mb.get('tree_commit')})")
    total_diff = 0
    rows: list[tuple[str, int, int]] = []
    details: list[str] = []

    if ma["cases_sha256"] != mb["cases_sha256"]:
        print("the two snapshots answered different case files: the answers are compared line by line anyway")
        total_diff += 1
        rows.append(("case file", 1, 1))
    for name, argv, _what in ANSWER_SETS:
        if not (da / f"{name}.jsonl.gz").exists() or not (db / f"{name}.jsonl.gz").exists():
            rows.append((f"{name} (missing in {'A' if not (da / f'{name}.jsonl.gz').exists() else 'B'})", 1, 1))
            total_diff += 1
            continue
        t = _compare_answers(name, da, db, ma, a.show)
        rows.append((f"{name} ({' '.join(argv)})", t.compared, t.differing))
        total_diff += t.differing
        if t.differing:
            top = ", ".join(f"{k} {v}" for k, v in t.detail.most_common(12))
            details.append(f"== {name}: {t.differing} of {t.compared} lines differ ({top})\n" + "\n".join(t.shown))

    ra, rb = (da / "rules.json").read_text(), (db / "rules.json").read_text()
    rows.append(("rules --json", 1, int(ra != rb)))
    if ra != rb:
        total_diff += 1
        details.append("== rules --json\n" + _diff(ra, rb, "rules.json"))

    ca, cb = _load_commands(da), _load_commands(db)
    by_cat: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    what_differs: dict[str, Counter[str]] = defaultdict(Counter)
    shown = 0
    for cid in sorted(set(ca) | set(cb), key=lambda k: (_category(k), k)):
        cat = _category(cid)
        by_cat[cat][0] += 1
        if cid not in ca or cid not in cb:
            by_cat[cat][1] += 1
            if shown < a.show:
                details.append(f"== command {cid}: only in {'A' if cid in ca else 'B'}")
                shown += 1
            continue
        render = shown < a.show
        diffs = _compare_cmd(ca[cid], cb[cid], render)
        if diffs:
            by_cat[cat][1] += 1
            what_differs[cat].update(w.split()[0] for w, _ in diffs)
            if render:
                shown += 1
                shown_argv = " ".join(json.dumps(x) if (" " in x or not x) else x for x in ca[cid]["argv"])
                body = "\n".join(f"-- {what}:\n{text}" for what, text in diffs[:4])
                details.append(f"== command {cid}\n   spmdkit {shown_argv[:400]}\n{body}")
    for cat in sorted(by_cat):
        rows.append((f"commands: {cat}", by_cat[cat][0], by_cat[cat][1]))
        total_diff += by_cat[cat][1]
    w = max(len(r[0]) for r in rows)
    print(f"{'category':<{w}}  {'compared':>9}  {'differing':>9}  what differs")
    for name, n, d in rows:
        cat = name[len("commands: "):] if name.startswith("commands: ") else ""
        what = ", ".join(f"{k} {v}" for k, v in sorted(what_differs[cat].items())) if cat in what_differs else ""
        print(f"{name:<{w}}  {n:>9}  {d:>9}  {what}".rstrip())
    print(f"{'total':<{w}}  {sum(r[1] for r in rows):>9}  {sum(r[2] for r in rows):>9}")
    for text in details:
        print()
        print(text)
    print()
    print("IDENTICAL" if total_diff == 0 else f"DIFFERENT: {total_diff} differing items")
    return 0 if total_diff == 0 else 1


# == main ======================================================================================


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="equiv.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    pc = sub.add_parser("cases", help="write the fixed case file (and its fixtures folder); imports --tree's "
                                      "internals (spmdkit.sim.cases, spmdkit.graph, spmdkit.hf) in a child process",
                        description="Write OUT.jsonl: generated cases of every rule and mode "
                                    "(spmdkit.sim.cases.generate_case of --tree, imported in a child process "
                                    "whose PYTHONPATH is TREE/src: the one place this tool uses internals, run "
                                    "once before a refactor), mutations of each (sizes, axes, absent tensors, "
                                    "attributes, co-shards, partials, meshes, argument counts, modes), the aliases' "
                                    "cases and every golden case (tests/golden/*.jsonl) with one mutation each; "
                                    "and OUT.fixtures/ (program JSON files, HF configs) for snapshot's --program "
                                    "and --hf commands.")
    pc.add_argument("out", help="the case file to write (.jsonl)")
    pc.add_argument("--per-rule", type=int, default=150, help="generated cases per rule and mode (default 150)")
    pc.add_argument("--mutations", type=int, default=4, help="mutated copies per generated case (default 4)")
    pc.add_argument("--per-alias", type=int, default=10, help="cases per alias and mode (default 10)")
    pc.add_argument("--seed", type=int, default=0)
    pc.add_argument("--tree", default=str(SCRIPT.parents[1]), help="the tree whose generators are used "
                                                                   "(default: this script's)")
    pc.set_defaults(fn=cmd_cases)

    ps = sub.add_parser("snapshot", help="snapshot a tree's behaviour through its CLI")
    ps.add_argument("--tree", required=True, help="the tree (its src/ goes on PYTHONPATH)")
    ps.add_argument("--cases", required=True, help="the case file from `equiv.py cases`")
    ps.add_argument("out", help="the snapshot folder (replaced)")
    ps.add_argument("--jobs", type=int, default=2, help="worker processes for the commands (default 2)")
    ps.add_argument("--hashseed", default="0", help="PYTHONHASHSEED of every spmdkit process (default 0; 'random' "
                                                    "to look for output that depends on string hashing)")
    ps.add_argument("--only", action="append", help="only commands whose id starts with this (repeatable; debug)")
    ps.add_argument("--skip-infer", action="store_true", help="leave the answers out (debug)")
    ps.add_argument("-v", "--verbose", action="store_true", help="a line per command on stderr")
    ps.set_defaults(fn=cmd_snapshot)

    pm = sub.add_parser("compare", help="compare two snapshots; exit 1 if anything differs")
    pm.add_argument("a")
    pm.add_argument("b")
    pm.add_argument("--show", type=int, default=5, help="differences shown in full per kind (default 5)")
    pm.set_defaults(fn=cmd_compare)

    pg = sub.add_parser("_gen")
    pg.add_argument("--per-rule", type=int, required=True)
    pg.add_argument("--seed", type=int, required=True)
    pg.add_argument("--fixtures", required=True)
    pg.set_defaults(fn=_gen_child)
    pw = sub.add_parser("_worker")
    pw.set_defaults(fn=_worker)
    a = ap.parse_args(argv)
    return int(a.fn(a))


if __name__ == "__main__":
    sys.exit(main())
