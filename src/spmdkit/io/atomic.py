"""Writing a file so that a reader never sees half of it: a temporary file in the same folder,
renamed over the target, and only over a regular file or a new name: a device node, a FIFO, a
socket, a symbolic link or a folder at the path is refused (:func:`output_problem`), as a
rename would replace it (``--html /dev/null`` run as root would replace the system's
``/dev/null``). Standard library only."""

from __future__ import annotations

import errno
import os
import stat
import tempfile

_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def output_problem(path: str) -> str | None:
    """Why ``path`` cannot be written as an output file (a phrase, e.g. ``"is a FIFO (named
    pipe), not a regular file"``), or None: it is a regular file (not a symbolic link to one)
    or a new name in an existing directory."""
    if not path:
        return "is empty: give a file name"
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        folder = os.path.dirname(os.path.abspath(path))
        return None if os.path.isdir(folder) else f"is in no existing directory ({folder!r} does not exist)"
    except OSError as exc:  # a path through a file (ENOTDIR), too long, not permitted
        return f"cannot write it: {exc.strerror or exc}"
    if stat.S_ISREG(st.st_mode):
        return None
    kind = next((k for test, k in _KINDS if test(st.st_mode)), "not a regular file")
    return f"is {kind}, not a regular file (spmdkit writes a regular file or a new path, never over anything else)"


class NotRegularFile(OSError):
    """An output path that is not a regular file or a new name (:func:`output_problem`); its
    ``strerror`` says what the path is."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(errno.EEXIST, problem, path)


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all: a temporary file beside it (mode 0644, not
    mkstemp's 0600, so others can read the result as they could a plain write; an existing
    file's own mode kept), renamed over it. :class:`NotRegularFile` where the path holds
    anything but a regular file, checked before the temporary file is written and again just
    before the rename; OSError when it cannot be written; the temporary file is removed and
    any old file is left as it was."""
    problem = output_problem(path)
    if problem is not None:
        raise NotRegularFile(path, problem)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            mode = stat.S_IMODE(os.lstat(path).st_mode) & 0o777
        except OSError:
            mode = 0o644
        os.chmod(tmp, mode)
        problem = output_problem(path)  # the path may have changed while the data was written
        if problem is not None:
            raise NotRegularFile(path, problem)
        os.replace(tmp, path)
        tmp = None
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


__all__ = ["NotRegularFile", "output_problem", "write_atomic"]
