"""Writing a file so that a reader never sees half of it: a temporary file in the same folder,
renamed over the target. Standard library only."""

from __future__ import annotations

import os
import tempfile


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all: a temporary file beside it (mode 0644, not
    mkstemp's 0600, so others can read the result as they could a plain write), renamed over it.
    OSError when it cannot be written; the temporary file is removed and any old file is left
    as it was."""
    folder = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        tmp = None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


__all__ = ["write_atomic"]
