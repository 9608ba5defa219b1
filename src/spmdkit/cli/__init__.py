"""The ``spmdkit`` command: infer, rules, verify, plan, run, calibrate, models, demo.

argv is parsed once (:func:`build_parser`); ``plan`` and ``run`` then take their typed request
(:mod:`spmdkit.cli.request`). Their modules, which import the planner and the outputs, are
imported when the command runs, so that ``infer`` starts without them.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, TextIO

from spmdkit.cli.calibrate import add_calibrate_command
from spmdkit.cli.models import add_models_command
from spmdkit.cli.request import add_plan_arguments, add_run_arguments, plan_request, run_request
from spmdkit.cli.verify import add_verify_command
from spmdkit.core.errors import CaseFormatError, SpmdError
from spmdkit.engine.memo import release_by_id
from spmdkit.engine.registry import all_rules, set_cache_enabled
from spmdkit.io.codec import answer_text, dumps, echo_id, encode_error, parse_case
from spmdkit.outputs.tables import print_result_table, print_rules_table

#: The longest input line ``infer --batch`` reads (16 MiB); a longer one is answered with a
#: CaseFormatError line and skipped without being held in memory.
MAX_LINE_BYTES = 16 * 2**20


def _batch_lines(src: Any) -> Any:
    """The lines of a binary stream as bytes (``\\n`` ends a line; a last line without one counts),
    an over-long line as ``None``."""
    while True:
        line = src.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        if len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            while True:  # skip the rest of the over-long line
                more = src.readline(MAX_LINE_BYTES)
                if not more or more.endswith(b"\n"):
                    break
            yield None
            continue
        yield line


def _cmd_infer(ns: argparse.Namespace, out: TextIO) -> int:
    if ns.no_cache:
        set_cache_enabled(False)
    if ns.batch and ns.case is not None:  # (it was ignored: the cases read from stdin)
        print("spmdkit infer: --batch reads the cases from stdin (or --input FILE), one a line; give no case "
              "argument with it", file=sys.stderr)
        return 2
    if ns.input is not None and not ns.batch:
        print("spmdkit infer: --input: reads a file of cases with --batch only (give --batch, or the case as an "
              "argument without --input)", file=sys.stderr)
        return 2
    if ns.batch:
        too_long = dumps(encode_error(CaseFormatError(f"line is longer than {MAX_LINE_BYTES} bytes")))
        if ns.input:
            try:
                src: Any = open(ns.input, "rb")
            except OSError as exc:  # (it said "spmdkit: [Errno 2] ...", naming no flag)
                print(f"spmdkit infer: --input {ns.input[:200]!r}: cannot read it: {exc.strerror or exc}",
                      file=sys.stderr)
                return 1
        else:
            src = getattr(sys.stdin, "buffer", None)
            if src is None:  # a text stream without bytes underneath (tests, embedding)
                src = sys.stdin
        try:
            if isinstance(src, io.TextIOBase) or not hasattr(src, "readline"):
                lines: Any = iter(src)
            else:
                lines = _batch_lines(src)
            for line in lines:
                out.write((too_long if line is None else answer_text(line)) + "\n")
        finally:
            if ns.input:
                src.close()
        out.flush()
        return 0
    if ns.case is None:
        print("spmdkit infer: give a case as JSON, or --batch to read JSON lines", file=sys.stderr)
        return 2
    if ns.json:  # one result record, as --batch answers the case's line (one that is not JSON: an error record)
        text = answer_text(ns.case)
        out.write(text + "\n")
        return 1 if "error" in json.loads(text) else 0
    try:
        obj = json.loads(ns.case)
    except ValueError as exc:
        print(f"spmdkit infer: the case is not valid JSON: {exc}", file=sys.stderr)
        return 2
    case_id = echo_id(obj.get("id")) if isinstance(obj, dict) else None
    try:
        case = parse_case(obj)
        result = case.run()
    except Exception as exc:  # (a non-SpmdError is reported as an InternalError, no traceback)
        err = encode_error(exc, case_id)
        print(f"error: {err['error']}: {err['message']}", file=sys.stderr)
        return 1
    print_result_table(case, result, out)
    return 0


def _cmd_rules(ns: argparse.Namespace, out: TextIO) -> int:
    rules = all_rules()
    rows: list[dict[str, Any]] = []
    for name in sorted(rules):
        r = rules[name]
        rows.append(
            {
                "name": name,
                "canonical": r.name,
                "modes": list(r.modes),
                "forward": r.forward.function_name,
                "backward": r.backward.function_name if r.backward else None,
            }
        )
    if ns.json:
        out.write(json.dumps(rows) + "\n")
        return 0
    print_rules_table(rows, out)
    return 0


def _cmd_demo(ns: argparse.Namespace, out: TextIO) -> int:
    from spmdkit.cli.demo import run_demo  # (imports numpy)

    return run_demo(out)


def _cmd_plan(ns: argparse.Namespace, out: TextIO) -> int:
    from spmdkit.cli.plan import run_plan  # (the planner and the outputs: not for infer)

    return run_plan(plan_request(ns), out)


def _cmd_run(ns: argparse.Namespace, out: TextIO, argv: list[str]) -> int:
    from spmdkit.cli.run import run_command  # (the planner and the executor: not for infer)

    return run_command(run_request(ns, argv), out)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``spmdkit plan: error: ... (--help for usage)``, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (--help for usage)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="spmdkit", description="SPMD sharding propagation rules and tools")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    pi = sub.add_parser("infer", help="run one rule call (JSON case, INTERFACE.md)")
    pi.add_argument("case", nargs="?", help="one case as JSON")
    pi.add_argument("--batch", action="store_true", help="read JSON lines from stdin, one result line each")
    pi.add_argument("--json", action="store_true", help="print the result as JSON")
    pi.add_argument("--input", help="with --batch: read this file instead of stdin")
    pi.add_argument("--no-cache", action="store_true",
                    help="answer every case from scratch (no result cache or memo tables: constant memory)")
    pi.set_defaults(fn=_cmd_infer)

    pr = sub.add_parser("rules", help="list every registered rule name and its modes")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(fn=_cmd_rules)

    add_verify_command(sub)

    pp = sub.add_parser("plan", help="plan a model's training step on a mesh: shardings, reshards, memory")
    add_plan_arguments(pp)
    pp.set_defaults(fn=_cmd_plan)

    pn = sub.add_parser("run", help="run a planned training step on torch.distributed, one process per rank "
                                    "(needs spmdkit[torch])")
    add_run_arguments(pn)  # main calls _cmd_run itself, with the arguments after "run"

    add_calibrate_command(sub)  # cli/calibrate.py: measure this machine, write a device file

    add_models_command(sub)  # cli/models.py: the catalog of published architectures

    pd = sub.add_parser("demo", help="a short tour of the main job")
    pd.set_defaults(fn=_cmd_demo)
    return p


def _exit_now(rc: int) -> None:
    """End the process with ``rc`` once its output is flushed, without the interpreter's teardown:
    a ``plan --devices`` search leaves a gigabyte of models, plans and memos (DeepSeek-V3 on 2,048
    devices) that Python would free object by object for 3 s before exiting. ``plan`` has
    written and closed its files (atomically) and joined its worker by then; nothing of it is
    left for an exit handler."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = list(sys.argv[1:] if argv is None else argv)
    ns = parser.parse_args(args)
    ns.argv = args  # the command line as typed (the --html page shows it)
    try:
        if ns.command == "run":
            return _cmd_run(ns, sys.stdout, args[args.index("run") + 1:])
        rc = int(ns.fn(ns, sys.stdout))
        if argv is None and ns.command == "plan":
            _exit_now(rc)
        return rc
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback (a search's worker is stopped by its close)
        print(f"spmdkit: {ns.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        print(f"spmdkit: {exc}", file=sys.stderr)
        return 1
    except SpmdError as exc:
        print(f"spmdkit: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:  # the command's plans are out of reach now: the memos by their ids let them go
        release_by_id()

