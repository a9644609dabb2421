"""A status line on a terminal: what a command is doing while nothing else prints (importing
JAX, compiling, a demonstration), each status replacing the last in place, cleared before any
other output. Elsewhere (a log file, a pipe) there is none. Imports the standard library alone,
so the entry point can show the first status before JAX is imported.
"""

from __future__ import annotations

import shutil
import sys
from typing import Any, TextIO

_shown: list[TextIO] = []  # the stream a status is showing on


class _Clearing:
    """A terminal stream that clears the status line before it writes anything else."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:
        if text:
            clear()
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def status(text: str) -> None:
    """Show `text` as the status line, fitted to the terminal, until the next output."""
    stream = _terminal()
    if stream is None:
        return
    width = shutil.get_terminal_size((80, 24)).columns - 1
    stream.write(f"\r{text[:width]}\x1b[K")
    stream.flush()
    _shown[:] = [stream]


def clear() -> None:
    """Remove the status line, if one shows."""
    if _shown:
        stream = _shown.pop()
        stream.write("\r\x1b[K")
        stream.flush()


def _terminal() -> TextIO | None:
    """The terminal stdout writes to (stdout and stderr made to clear the status line first),
    or None when stdout is no terminal."""
    stdout = sys.stdout
    if isinstance(stdout, _Clearing):
        return stdout._stream
    try:
        if not stdout.isatty():
            return None
    except (AttributeError, ValueError):  # a closed or a stand-in stream
        return None
    sys.stdout = _Clearing(stdout)
    if not isinstance(sys.stderr, _Clearing):
        sys.stderr = _Clearing(sys.stderr)
    return stdout
