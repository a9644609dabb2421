"""The entry point of `main.py`, `python -m fmnist_flax` and `fmnist-flax`: the stop signals are
answered in one line from the first instant, while the libraries are still imported.

Only the standard library is imported before the command line. Until it takes over
(`errors.stop_raises`), a signal ends the process with `STARTING`'s line and its exit status.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

STARTED = time.perf_counter()  # the command's start: where summary.json's start-up counts from
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # errors.STOP_...
STARTING = "error: {} while starting: nothing was done; run the same command to start again\n"


def _while_starting(signum: int, frame: object) -> None:
    with contextlib.suppress(OSError):  # stderr may be gone with the terminal (SIGHUP)
        os.write(2, STARTING.format(signal.Signals(signum).name).encode())
    os._exit(128 + signum)


def main() -> None:
    for signum in STOP_SIGNALS:
        signal.signal(signum, _while_starting)
    from fmnist_flax.runtime import startup

    startup.begin(sys.argv)  # a status line at once; an accelerator's backend on a thread
    with startup.without_ipython():
        from fmnist_flax import cli

    cli.run(started=STARTED)
