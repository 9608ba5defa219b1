"""Reading a JSON file with one line of error for every way it can be bad. Standard library only."""

from __future__ import annotations

import json
from typing import Any

from spmdkit.core.errors import SpmdError


def read_json(path: str, what: str, error: type[SpmdError]) -> Any:
    """The JSON value in the file at ``path``; ``error`` (a message starting ``what`` and the
    path) when the file cannot be read, is not UTF-8 text, is not JSON or nests too deeply."""
    where = f"{what} {path!r}"
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:
        raise error(f"{where}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{where} is not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise error(f"{where} is not JSON: {exc}") from None
    except RecursionError:
        raise error(f"{where} nests JSON too deeply") from None
    except ValueError as exc:  # e.g. an integer literal over Python's digit limit
        raise error(f"{where} is not valid JSON: {str(exc)[:200]}") from None
