"""A finished command-line run leaves without the interpreter's teardown (~1 s on 2 cores).

After the last exit hook, CPython still frees every module and object of JAX, Orbax and
matplotlib one by one, which nothing reads. The package imports this module first, so its hook
is registered first and runs last: after logging, JAX's and Orbax's clean-up, with every file
closed. It acts only once `cli.run` hands it the exit status; library use never does.
"""

import atexit
import contextlib
import os
import sys

_status: int | None = None


def after_exit_hooks(status: int) -> None:
    """Leave with `status` as soon as the other exit hooks have run."""
    global _status
    _status = status


@atexit.register
def _leave() -> None:
    if _status is None:
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe (`| head`) or stream
            stream.flush()
    os._exit(_status)
