"""The one exception type for mistakes a user can fix; the CLI prints it as one line."""

import sys


class UserError(Exception):
    """Bad input (flags, files, directories): the message says what is wrong and how to fix it."""


def error_line(message: str) -> None:
    """How every user-facing error reaches the terminal: one line on stderr."""
    print(f"error: {message}", file=sys.stderr, flush=True)


def warning_line(message: str) -> None:
    """An output the run goes on without (TensorBoard, the report): one line on stderr."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def reason(exc: BaseException) -> str:
    """What went wrong, in a few words: the exception's first line, or its type when that
    line says nothing (some libraries' errors print as `<bound method ...>`)."""
    lines = str(exc).strip().splitlines()
    first = lines[0][:200] if lines else ""
    return first if first and not first.startswith("<") else type(exc).__name__
