"""The entry point of `main.py`, `python -m fmnist_flax` and `fmnist-flax`: SIGINT, SIGTERM,
SIGHUP and SIGQUIT are answered in one line from the first instant this package's code runs,
while the libraries are still imported.

Only the standard library is imported before the command line. Until it takes over
(`errors.stop_raises`), a signal ends the process with `error: SIGTERM while starting ...`
and the signal's exit status: nothing has been written yet. (A signal before that, while the
interpreter itself starts, is the interpreter's: see docs/faults.md.)
"""

from __future__ import annotations

import os
import signal
import sys


def _while_starting(signum: int, frame: object) -> None:
    try:  # stderr may be gone with the terminal (SIGHUP), or closed: the status still tells
        sys.stderr.write(
            f"error: {signal.Signals(signum).name} while starting: nothing was done; run the "
            "same command to start again\n"
        )
        sys.stderr.flush()
    except (OSError, AttributeError):
        pass
    os._exit(128 + signum)


# runtime.errors.STOP_SIGNALS, whose module imports more than a signal should wait for.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def main() -> None:
    for signum in STOP_SIGNALS:
        signal.signal(signum, _while_starting)
    from fmnist_flax import cli

    cli.run()
