"""``spmdkit run --engine torch``'s launcher: torch's own (no torch import here).

:func:`launch_torchrun` writes the run's spec to a private folder, starts
``python -m torch.distributed.run --standalone --nproc-per-node N --max-restarts 0 ... --log-dir
LOGS --redirects 3 -m spmdkit.execute.torch_engine SPEC`` (torchrun: its rendezvous, its worker
processes, its fault handling: when a worker fails torchrun ends the others) and reads what the
workers left: rank 0's ``result.json``, or each failed rank's one-line ``error.RANK``, or, of a
rank killed by a signal (a C++ abort), the last lines of its stderr (torchrun's ``--redirects 3``
files, in the same folder). A failure becomes one line (:class:`TorchrunFailed`), those lines
after it; a job still running ``deadline`` seconds after its start is ended (its whole process
group) and named as such.

:func:`torch_report` turns rank 0's facts into the report (every step's loss against torch
eager's, every rank's collectives against the export's ``PLAN_COLLECTIVES``, each rank's memory);
:func:`format_torch_report` writes it as text.
"""

from __future__ import annotations

import ast
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from spmdkit.execute.tolerances import TOLERANCES

#: the loss of a step equals torch eager's when |a - b| <= LOSS_RTOL * max(1, |b|) (float32; a bfloat16 /
#: float16 model's rtol is spmdkit run's tolerance for a tensor of its dtype, ``check.TOLERANCES``: each
#: rank and eager round their own sums in that dtype)
LOSS_RTOL = 2e-5


def loss_rtol(dtype: str) -> float:
    """The relative tolerance of a step's loss against torch eager's for a model trained in ``dtype``:
    :data:`LOSS_RTOL` (float32), :data:`~spmdkit.execute.tolerances.TOLERANCES`' own for bfloat16 and
    float16 (each rank and eager round their own sums in it)."""
    return TOLERANCES[dtype] if dtype in ("bfloat16", "float16") else LOSS_RTOL


#: the worker torchrun runs
WORKER = "spmdkit.execute.torch_engine"
#: what a rank's peak memory is on CPU (the report says it in these words)
MEMORY_NOTE = ("max RSS: the process's peak resident memory (Python, torch's libraries, the model, its "
               "activations); parameters / gradients / optimizer: the bytes of this rank's local shards, "
               "counted tensor by tensor after the last step's update")


class TorchrunFailed(Exception):
    """The job failed: one line naming the rank and its error; for a rank killed by a signal (no
    error of its own written) the last lines of its stderr follow (:func:`rank_stderr_tail`)."""


def _literals(path: str, names: tuple[str, ...]) -> dict[str, Any]:
    """The module-level literal assignments ``names`` of an exported plan, read from the file's
    text (the file is not run here: it imports torch)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except OSError as exc:
        raise ValueError(f"--torch-plan {path}: cannot be read ({exc.strerror or exc})") from None
    except SyntaxError as exc:
        raise ValueError(f"--torch-plan {path}: not Python (line {exc.lineno}: {exc.msg})") from None
    got: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name in names:
                try:
                    got[name] = ast.literal_eval(node.value)
                except ValueError:
                    raise ValueError(f"--torch-plan {path}: {name} is not a literal") from None
    return got


def export_model_class(path: str) -> str | None:
    """``MODEL_CLASS`` of an exported plan: the HF class it was planned for (None in an export
    written before it was recorded)."""
    got = _literals(path, ("MODEL_CLASS",)).get("MODEL_CLASS")
    return got if isinstance(got, str) else None


def export_vocab_padding(path: str) -> tuple[int, int] | None:
    """(the tokenizer's vocabulary, the padded one) of an exported plan whose vocabulary ``spmdkit plan
    --make-vocab-size-divisible-by`` padded (its ``VOCAB_PADDING``); None where it was not."""
    got = _literals(path, ("VOCAB_PADDING",)).get("VOCAB_PADDING")
    if not isinstance(got, dict):
        return None
    vocab, padded = got.get("vocab_size"), got.get("padded_vocab_size")
    if not (isinstance(vocab, int) and isinstance(padded, int) and 1 <= vocab <= padded):
        raise ValueError(f"--torch-plan {path}: VOCAB_PADDING {got} must give vocab_size <= padded_vocab_size")
    return vocab, padded


def export_mesh(path: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``MESH_DIMS`` and ``MESH_SHAPE`` of an exported plan, read from the file's text (literal
    assignments; the file is not run here: it imports torch)."""
    got = _literals(path, ("MESH_DIMS", "MESH_SHAPE"))
    for name in ("MESH_DIMS", "MESH_SHAPE"):
        if name not in got:
            raise ValueError(f"--torch-plan {path}: defines no {name} (an export of spmdkit plan --export torch)")
    dims, shape = tuple(got["MESH_DIMS"]), tuple(got["MESH_SHAPE"])
    if (len(dims) != len(shape) or not all(isinstance(d, str) for d in dims)
            or not all(isinstance(s, int) and s >= 1 for s in shape)):
        raise ValueError(f"--torch-plan {path}: MESH_DIMS {dims} and MESH_SHAPE {shape} must be names and "
                         "positive sizes, one each")
    return dims, shape


def torchrun_command(nproc: int, spec_path: str, log_dir: str) -> list[str]:
    """The command line that starts the job (torchrun, run as a module of this Python). Each
    worker's stdout and stderr go to torchrun's files under ``log_dir`` (``--redirects 3``:
    ``LOG_DIR/RUN_ID/attempt_0/LOCAL_RANK/stderr.log``), where the launcher reads what a rank
    killed by a signal last wrote (:func:`rank_stderr_tail`)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--max-restarts", "0", "--monitor-interval", "0.1", "--log-dir", log_dir, "--redirects", "3",
            "-m", WORKER, spec_path]


def _pythonpath() -> str:
    """PYTHONPATH for the workers: this spmdkit first, so that they run the same code."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    rest = os.environ.get("PYTHONPATH", "")
    return here + (os.pathsep + rest if rest else "")


def launch_torchrun(spec: dict[str, Any], nproc: int, deadline: float) -> dict[str, Any]:
    """Run the job; rank 0's facts (``torch_engine.run``'s dict) with ``command`` added.
    Raises :class:`TorchrunFailed` (one line) when a rank fails or the job outlives ``deadline``."""
    folder = tempfile.mkdtemp(prefix="spmdkit-torchrun-")
    try:
        spec = dict(spec, out=folder)
        path = os.path.join(folder, "spec.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(spec, f)
        cmd = torchrun_command(nproc, path, os.path.join(folder, "logs"))
        env = dict(os.environ, PYTHONPATH=_pythonpath(), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(v, None)
        log = os.path.join(folder, "torchrun.log")
        with open(log, "wb") as lf:
            proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            rc = _wait(proc, deadline)
        with open(log, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if rc is None:
            raise TorchrunFailed(f"the job did not end within {deadline:g} s (--timeout x (steps + 3)); "
                                 f"ended torchrun and its {nproc} workers" + _errors_suffix(folder))
        result = os.path.join(folder, "result.json")
        if rc != 0 or not os.path.isfile(result):
            if os.environ.get("SPMDKIT_TRACEBACK"):  # the workers' tracebacks (they print them then)
                sys.stderr.write(text)
                for r in range(nproc):
                    sys.stderr.write(f"-- rank {r}'s stderr --\n" + "\n".join(rank_stderr_tail(folder, r, 10**6))
                                     + "\n")
            raise TorchrunFailed(_failure_line(folder, text, rc))
        with open(result, encoding="utf-8") as f:
            got: dict[str, Any] = json.load(f)
        got["command"] = " ".join(["python", *torchrun_command(nproc, "SPEC.json", "LOGS")[1:]])
        return got
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _wait(proc: subprocess.Popen[bytes], deadline: float) -> int | None:
    """torchrun's exit status, or None after ending its process group at ``deadline``. Ctrl-C or
    SIGTERM here ends the group too."""
    try:
        return proc.wait(timeout=deadline)
    except subprocess.TimeoutExpired:
        _end(proc)
        return None
    except BaseException:
        _end(proc)
        raise


def _end(proc: subprocess.Popen[bytes]) -> None:
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
            time.sleep(0.2)  # the workers, in the same group, get the same signal
        except subprocess.TimeoutExpired:
            continue


def _rank_errors(folder: str) -> list[tuple[float, int, str]]:
    """(written at, rank, line) of every worker that wrote its error, the first written first."""
    out = []
    for name in os.listdir(folder):
        m = re.fullmatch(r"error\.(\d+)", name)
        if m:
            p = os.path.join(folder, name)
            with open(p, encoding="utf-8", errors="replace") as f:
                line = f.read().strip().splitlines()
            out.append((os.path.getmtime(p), int(m.group(1)), line[0] if line else "(no message)"))
    return sorted(out)


def _errors_suffix(folder: str) -> str:
    errs = _rank_errors(folder)
    return f"; rank {errs[0][1]}: {errs[0][2]}" if errs else ""


# A rank's error that only says a peer went away (gloo's or NCCL's words): it follows the failure
# that ended that peer, and torchrun may observe it first.
_PEER_LOST = re.compile(r"Connection (?:closed|reset) by peer|Broken pipe|communicator was aborted|"
                        r"remote process exited", re.I)


#: how many of its last stderr lines the failure report quotes of a rank that wrote no error
STDERR_LINES = 25


def rank_stderr_tail(folder: str, rank: int, n: int = STDERR_LINES) -> list[str]:
    """The last ``n`` non-blank lines (each cut to 300 characters) of what ``rank`` wrote to its
    stderr (torchrun's ``--redirects`` file under ``FOLDER/logs``; its Python traceback, a C++
    ``terminate called ...`` / ``what():``, faulthandler's ``Fatal Python error`` and stacks).
    Where faulthandler wrote, the lines start a few before its last ``Fatal Python error`` (the
    C++ message precedes it). Empty when the rank wrote nothing."""
    lines: list[str] = []
    for path in sorted(glob.glob(os.path.join(glob.escape(folder), "logs", "*", "attempt_*", str(rank), "stderr.log"))):
        with open(path, encoding="utf-8", errors="replace") as f:
            lines += [ln.rstrip()[:300] for ln in f if ln.strip() and not ln.startswith("Extension modules:")]
    fatal = [i for i, ln in enumerate(lines) if ln.startswith("Fatal Python error")]
    start = max(0, fatal[-1] - 4) if fatal else len(lines) - n
    return lines[max(0, start):][:n]


def _failure_line(folder: str, log: str, rc: int) -> str:
    """One line: the first rank that wrote an error of its own (not a peer's lost connection), else
    the rank torchrun names as the root cause (its first observed failure: a rank killed by a
    signal writes nothing; then the last lines of its stderr follow, indented), else the first
    rank that wrote any error, else torchrun's own last words."""
    written = _rank_errors(folder)
    errs = {r: line for _t, r, line in written}
    own = [(r, line) for _t, r, line in written if not _PEER_LOST.search(line)]
    if own:
        return f"rank {own[0][0]} failed: {own[0][1]}; torchrun ended every rank (exit {rc})"
    root = re.search(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", log, re.S)
    if root:
        rank, code = int(root.group(1)), int(root.group(2))
        why = errs.get(rank)
        tail = ""
        if why is None:
            sig = re.search(r"Signal (\d+) \((\w+)\) received", log[root.start():])
            why = f"killed by {sig.group(2)}" if sig else f"exit {code}, no error written"
            said = rank_stderr_tail(folder, rank)
            tail = "".join(f"\n  | {ln}" for ln in said) if said else f"\n  (rank {rank} wrote nothing to stderr)"
            tail = f"; its stderr ended:{tail}" if said else tail
        return f"rank {rank} failed: {why}; torchrun ended every rank (exit {rc}){tail}"
    if written:
        return f"rank {written[0][1]} failed: {written[0][2]}; torchrun ended every rank (exit {rc})"
    lines = [ln.strip() for ln in log.splitlines() if ln.strip() and not ln.lstrip().startswith(("File ", "^", "~"))]
    return f"torchrun failed (exit {rc}): {lines[-1][:400] if lines else 'no output'}"


def _fmt_counts(c: dict[str, int] | None) -> str:
    if c is None:
        return "not said by the export (FSDP2 under a pipeline)"
    return ", ".join(f"{k} x{v}" for k, v in sorted(c.items())) or "none"


def _by_ranks(per_rank: list[dict[str, int] | None]) -> str:
    """Each rank's counts, the ranks with equal counts written once: ``all_reduce x16`` when every
    rank's are equal, else ``all_reduce x16 (ranks 0, 1); ... (ranks 2, 3)``."""
    groups: dict[str, list[int]] = {}
    for r, c in enumerate(per_rank):
        groups.setdefault(_fmt_counts(c), []).append(r)
    if len(groups) == 1:
        return next(iter(groups))
    return "; ".join(f"{k} (rank{'s' if len(v) > 1 else ''} {', '.join(map(str, v))})" for k, v in groups.items())


def torch_report(got: dict[str, Any], title: str, rtol: float = LOSS_RTOL) -> dict[str, Any]:
    """The report of a torch-engine run from rank 0's facts: per step the loss (the mean over the
    batch shards of their mean losses: each shard holds the same number of tokens) beside torch
    eager's (equal within ``rtol`` relative), and every rank's collectives beside the plan's;
    ``ok`` when both agree every step."""
    ranks = got["ranks"]
    steps = []
    for s, eager in enumerate(got["eager"]):
        vals = [r["losses"][s] for r in ranks if r["losses"][s] is not None]
        loss = sum(vals) / len(vals) if vals else None
        err = None if loss is None else abs(loss - eager)
        differ = [r["rank"] for r in ranks if r["expected"] is None or r["counts"][s] != r["expected"]]
        steps.append({"step": s + 1, "loss": loss, "eager_loss": eager, "abs_error": err,
                      "loss_within": err is not None and err <= rtol * max(1.0, abs(eager)),
                      "collectives": [r["counts"][s] for r in ranks], "collectives_differ_on_ranks": differ,
                      "collectives_match": not differ})
    same_start = len({r.get("weights_sum") for r in ranks}) == 1
    losses_ok = all(s["loss_within"] for s in steps) and same_start
    coll_ok = all(s["collectives_match"] for s in steps)
    return {"engine": "torch", "title": title, "launcher": "torch.distributed.run", "command": got.get("command"),
            "world_size": got["world_size"], "backend": got["backend"], "mesh": got["mesh"],
            "loss_parallel": got["loss_parallel"], "pipeline": got["pipeline"],
            "ok": losses_ok and coll_ok, "losses_match": losses_ok, "collectives_match": coll_ok,
            "same_initial_weights": same_start,
            "loss": steps[-1]["loss"] if steps else None, "reference_loss": got["eager"][-1] if steps else None,
            "loss_rtol": rtol, "steps": steps, "plan_collectives": [r["expected"] for r in ranks],
            "memory": [{"rank": r["rank"], "max_rss_bytes": r["max_rss_bytes"], **r["state_bytes"],
                        **({"cuda_max_allocated_bytes": r["cuda_max_allocated_bytes"]}
                           if "cuda_max_allocated_bytes" in r else {})} for r in ranks],
            "memory_measured": MEMORY_NOTE, "eager_parameter_bytes": got["eager_parameter_bytes"]}


def _mib(b: int) -> str:
    return f"{b / 2**20:.1f} MiB" if b >= 2**20 else f"{b / 1024:.1f} KiB"


def format_torch_report(rep: dict[str, Any]) -> str:
    first, _, notes = rep["title"].partition("\n")
    lines = [f"spmdkit run --engine torch: {first}; {rep['world_size']} processes under torchrun ({rep['backend']})",
             *notes.splitlines(),
             f"  {'step':<5} {'loss':>14} {'torch eager':>14} {'|diff|':>9}  collectives per rank (CommDebugMode)"]
    for s in rep["steps"]:
        loss = "-" if s["loss"] is None else f"{s['loss']:.8f}"
        err = "-" if s["abs_error"] is None else f"{s['abs_error']:.1e}"
        mark = "" if s["collectives_match"] else f"  NOT the plan's on rank(s) {s['collectives_differ_on_ranks']}"
        lines.append(f"  {s['step']:<5} {loss:>14} {s['eager_loss']:>14.8f} {err:>9}  "
                     f"{_by_ranks(s['collectives'])}{mark}")
    lines.append(f"plan's collectives per step: {_by_ranks(rep['plan_collectives'])}")
    lines.append(f"peak memory per rank ({rep['memory_measured']}; unsharded parameters "
                 f"{_mib(rep['eager_parameter_bytes'])}):")
    lines.append(f"  {'rank':<5} {'max RSS':>11} {'parameters':>11} {'gradients':>11} {'optimizer':>11}")
    for m in rep["memory"]:
        lines.append(f"  {m['rank']:<5} {_mib(m['max_rss_bytes']):>11} {_mib(m['parameters']):>11} "
                     f"{_mib(m['gradients']):>11} {_mib(m['optimizer']):>11}")
    if not rep["same_initial_weights"]:
        lines.append("the ranks' weights differed before the plan was applied (the sums of their parameters)")
    lines.append(("losses equal torch eager's" if rep["losses_match"] else "losses NOT equal to torch eager's")
                 + f" every step (within {rep['loss_rtol']:g} relative); collectives "
                 + ("equal the plan's every step on every rank" if rep["collectives_match"]
                    else "NOT equal to the plan's"))
    return "\n".join(lines)


__all__ = ["LOSS_RTOL", "MEMORY_NOTE", "TorchrunFailed", "export_mesh", "export_model_class", "format_torch_report",
           "launch_torchrun", "loss_rtol", "torch_report", "torchrun_command"]
