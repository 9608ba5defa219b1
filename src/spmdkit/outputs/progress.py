"""A one-line progress display on a terminal; on a pipe nothing, or (``lines=True``) one line
per phase. Standard library only.

``Progress(label, total)`` writes ``label [#####-----] done/total  elapsed  note`` to its stream
(stderr by default), redrawn in place with a carriage return at most every ``interval`` seconds
(and always on the first and the last step), and erased on :meth:`close`. When the stream is
not a terminal (``stream.isatty()`` false or missing: a pipe, a file, a test's StringIO) it writes
nothing at all, so piped output and ``--json`` stay clean.

    with Progress("searching meshes", total=len(configs)) as bar:
        for c in configs:
            bar.advance(note=str(c))
            ...

A ``Progress`` is also a ``(done, total)`` callback (``propagate(progress=...)``'s).

``phase(text)`` names a phase of the work: on a terminal it becomes the line's note; on a pipe
or a log file, with ``lines=True``, it is written as its own line, ``label: text (elapsed s)``
(``spmdkit plan --devices``: what is searched, what was planned, folded and pruned, the best
planned whole), so a log shows where the time went; without ``lines`` a pipe gets nothing.
"""

from __future__ import annotations

import shutil
import sys
import time
from types import TracebackType
from typing import Any, TextIO


def is_terminal(stream: Any) -> bool:
    """True when ``stream`` says it is a terminal (a missing or failing ``isatty``: no)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class Progress:
    """A progress counter (``total`` known: a bar and a percentage; else a counter)."""

    def __init__(self, label: str, total: int | None = None, stream: TextIO | None = None,
                 interval: float = 0.1, width: int | None = None, lines: bool = False) -> None:
        self.label = label
        self.lines = lines
        self.total = total
        self.done = 0
        self.note = ""
        self.stream: TextIO = stream if stream is not None else sys.stderr
        self.enabled = is_terminal(self.stream)
        self.interval = interval
        self.width = width
        self.t0 = time.perf_counter()
        self._last: float | None = None
        self._shown = 0  # characters on the line now

    # -- updates -------------------------------------------------------------------------------

    def update(self, done: int | None = None, total: int | None = None, note: str | None = None) -> None:
        """Set the count (and the total, and a short note) and redraw when due."""
        if done is not None:
            self.done = done
        if total is not None:
            self.total = total
        if note is not None:
            self.note = note
        if not self.enabled:
            return
        now = time.perf_counter()
        final = self.total is not None and self.done >= self.total
        if self._last is not None and not final and now - self._last < self.interval:
            return
        self._last = now
        self._draw(now)

    def advance(self, n: int = 1, note: str | None = None) -> None:
        self.update(self.done + n, note=note)

    def __call__(self, done: int, total: int) -> None:
        self.update(done, total)

    def phase(self, text: str) -> None:
        """A phase begins or ends: the note on a terminal, a line of its own on a pipe (``lines``)."""
        if self.enabled:
            self.update(note=text)
            return
        if not self.lines:
            return
        try:
            self.stream.write(f"{self.label}: {text} ({time.perf_counter() - self.t0:.1f} s)\n")
            self.stream.flush()
        except (OSError, ValueError):
            self.lines = False

    # -- drawing -------------------------------------------------------------------------------

    def line(self, now: float | None = None) -> str:
        """The text of the line as it would be drawn now."""
        elapsed = (now if now is not None else time.perf_counter()) - self.t0
        cols = self.width or shutil.get_terminal_size((80, 24)).columns
        if self.total:
            frac = min(1.0, max(0.0, self.done / self.total))
            bar = "#" * round(20 * frac) + "-" * (20 - round(20 * frac))
            text = f"{self.label} [{bar}] {self.done}/{self.total} ({100 * frac:.0f}%) {elapsed:.1f} s"
        else:
            text = f"{self.label}: {self.done} {elapsed:.1f} s"
        if self.note:
            text += f"  {self.note}"
        return text[:max(10, cols - 1)]

    def _draw(self, now: float) -> None:
        text = self.line(now)
        pad = max(0, self._shown - len(text))
        try:
            self.stream.write("\r" + text + " " * pad)
            self.stream.flush()
        except (OSError, ValueError):
            self.enabled = False
            return
        self._shown = len(text)

    def clear(self) -> None:
        """Erase the line for a moment (another writer's output comes next); the next update
        draws it again."""
        if self.enabled and self._shown:
            try:
                self.stream.write("\r" + " " * self._shown + "\r")
                self.stream.flush()
            except (OSError, ValueError):
                self.enabled = False
        self._shown = 0
        self._last = None

    def close(self) -> None:
        """Erase the line (a terminal only); further updates write nothing."""
        if self.enabled and self._shown:
            try:
                self.stream.write("\r" + " " * self._shown + "\r")
                self.stream.flush()
            except (OSError, ValueError):
                pass
        self._shown = 0
        self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


__all__ = ["Progress", "is_terminal"]
