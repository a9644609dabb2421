"""A status line on a terminal: what a command is doing while nothing else prints (importing
JAX, compiling, a demonstration), each status replacing the last in place, cleared before any
other output. A status shown for a second or more counts its seconds, so the screen never
stands still. Elsewhere (a log file, a pipe) there is none. Imports the standard library alone,
so the entry point can show the first status before JAX is imported.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from typing import Any, TextIO

_shown: list[TextIO] = []  # the stream a status is showing on
_text = ""  # the status showing, and when it was first shown (time.monotonic)
_since = 0.0
_lock = threading.RLock()  # one writer at a time: the status's counter runs on a thread
_counting: list[threading.Thread] = []
_drawing = False  # a status being drawn: the stream it goes through may clear it (the guard)
LOOK_EVERY = 0.25  # seconds between looks at a status that stays: it counts whole seconds


class _Clearing:
    """A terminal stream that clears the status line before it writes anything else."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    def write(self, text: str) -> int:
        with _lock:
            if text and not _drawing:
                clear()
            return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def status(text: str) -> None:
    """Show `text` as the status line, fitted to the terminal, until the next output."""
    global _text, _since
    stream = _terminal()
    if stream is None:
        return
    with _lock:
        _shown[:] = [stream]  # first: a signal's exception may stop the drawing half way
        _text, _since = text, time.monotonic()
        _draw(stream, text)
    if not _counting:
        _counting.append(threading.Thread(target=_count, name="status", daemon=True))
        _counting[0].start()


def _draw(stream: TextIO, text: str, suffix: str = "") -> None:
    global _drawing
    width = shutil.get_terminal_size((80, 24)).columns - 1 - len(suffix)
    _drawing = True
    try:
        stream.write(f"\r{text[:width]}{suffix}\x1b[K")
        stream.flush()
    finally:
        _drawing = False


def _count() -> None:
    """Redraw a status that stays with its seconds, `[3 s]`, until the terminal fails."""
    drawn = (None, 0)
    while True:
        time.sleep(LOOK_EVERY)
        with _lock:
            seconds = int(time.monotonic() - _since)
            if _shown and seconds >= 1 and drawn != (_since, seconds):
                drawn = (_since, seconds)
                try:
                    _draw(_shown[0], _text, f" [{seconds} s]")
                except (OSError, ValueError):  # the terminal is gone, or its stream closed
                    _shown.clear()
                    return


def clear() -> None:
    """Remove the status line, if one shows."""
    with _lock:
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
