"""The entry point of `main.py`, `python -m fmnist_flax` and `fmnist-flax`: SIGINT and SIGTERM
are answered in one line from the first instant, while the libraries are still imported.

Only the standard library is imported before the command line. Until it takes over
(`errors.stop_raises`), a signal ends the process with `error: SIGTERM while starting ...`
and the signal's exit status: nothing has been written yet. On a terminal a status line says
at once that the command started (`runtime/console.py`). On a machine with an accelerator,
its backend starts on a thread while the libraries are imported: a TPU's takes seconds.
"""

from __future__ import annotations

import glob
import os
import signal
import sys
import threading
import time

STARTED = time.perf_counter()  # the command's start: where summary.json's start-up counts from
# Device files of a TPU (vfio, accel) or an NVIDIA GPU: an accelerator whose backend is slow to
# start. Flags that must reach JAX before any backend starts (jax.distributed) keep it waiting.
ACCELERATOR_FILES = ("/dev/vfio/*", "/dev/accel*", "/dev/nvidia[0-9]*")
BEFORE_BACKEND_FLAGS = ("--coordinator_address", "--num_processes", "--process_id", "--distributed")


def _while_starting(signum: int, frame: object) -> None:
    sys.stderr.write(
        f"error: {signal.Signals(signum).name} while starting: nothing was done; run the same "
        "command to start again\n"
    )
    sys.stderr.flush()
    os._exit(128 + signum)


def main() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _while_starting)
    from fmnist_flax.runtime import console

    console.status("starting: importing JAX, Flax, Optax and Orbax")
    if _accelerator() and not any(a.startswith(BEFORE_BACKEND_FLAGS) for a in sys.argv[1:]):
        threading.Thread(target=_start_backend, name="backend", daemon=True).start()
    from fmnist_flax import cli

    cli.run(started=STARTED)


def _accelerator() -> bool:
    """Whether this machine shows an accelerator's device files (and JAX is not held to the
    CPU)."""
    if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
        return False
    return any(glob.glob(pattern) for pattern in ACCELERATOR_FILES)


def _start_backend() -> None:
    """Start JAX's backends; a failure is left for the command's own first use to report."""
    try:
        import jax

        jax.devices()
    except Exception:
        pass
