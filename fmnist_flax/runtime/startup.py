"""What a command does before its libraries are imported, with the standard library alone: say
on a terminal that it started (`console.status`), and, on a machine with an accelerator, start
its backend on a thread while the libraries import (a TPU's takes seconds).
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys
import threading
from collections.abc import Iterator, Sequence

from . import console

# Device files of a TPU (vfio, accel) or an NVIDIA GPU: an accelerator whose backend is slow to
# start. Flags that must reach JAX before any backend starts (jax.distributed) keep it waiting.
ACCELERATOR_FILES = ("/dev/vfio/*", "/dev/accel*", "/dev/nvidia[0-9]*")
BEFORE_BACKEND_FLAGS = ("--coordinator_address", "--num_processes", "--process_id", "--distributed")


def begin(argv: Sequence[str]) -> None:
    """The command `argv` starts: say so, and start an accelerator's backend early."""
    console.status("starting: importing JAX, Flax, Optax and Orbax")
    if _accelerator() and not any(a.startswith(BEFORE_BACKEND_FLAGS) for a in argv[1:]):
        threading.Thread(target=_start_backend, name="backend", daemon=True).start()


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


@contextlib.contextmanager
def without_ipython() -> Iterator[None]:
    """Libraries imported inside see IPython as not installed, unless it already runs.

    Flax's `nnx.reprlib` (0.12.8) imports IPython at import time to ask whether it runs in a
    notebook; where IPython is installed, that import took seconds on a TPU machine's slow
    disk. Outside IPython (not yet imported) the answer is no either way.
    """
    if "IPython" in sys.modules:
        yield
        return
    sys.modules["IPython"] = None  # type: ignore[assignment]  # `import IPython` fails at once
    try:
        yield
    finally:
        if sys.modules.get("IPython", False) is None:
            del sys.modules["IPython"]
