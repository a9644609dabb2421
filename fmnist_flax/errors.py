"""The one exception type for mistakes a user can fix; the CLI prints it as one line."""

import sys


class UserError(Exception):
    """Bad input (flags, files, directories): the message says what is wrong and how to fix it."""


def error_line(message: str) -> None:
    """How every user-facing error reaches the terminal: one line on stderr."""
    print(f"error: {message}", file=sys.stderr, flush=True)
