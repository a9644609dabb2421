"""Workarounds for how Orbax, tensorstore, asyncio, absl, XLA:CPU and the interpreter behave.

Importing this changes nothing: the command line calls `install()` as it starts, and tests
that drive the library in their own process call `quiet_orbax()`. Each item names the
versions it was written against and why it exists, to be deleted once they no longer need it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging as std_logging
import os
import sys
import threading
from typing import TYPE_CHECKING, Any

import jax
from absl import logging

from . import workdir as workdir_lib

if TYPE_CHECKING:
    import orbax.checkpoint as ocp

_save_failed = threading.Event()  # set once this process has reported a failed save
_exit_status: int | None = None  # set by `exit_after_hooks`: the command is finished


def install() -> None:
    """Every workaround here, for a command-line run: call it once, as the command starts."""
    quiet_orbax()
    atexit.register(_leave)


def serial_cpu_dispatch(model_shards: Any) -> None:
    """With a `model` axis (`model_shards` > 1), have JAX's CPU backend run each program to its
    end before it starts the next, before that backend starts. Its virtual devices share the
    cores: on 8 of them over 2 busy cores, a CNN on (data 4, model 2) stopped in XLA's
    all-reduce rendezvous ("may be stuck", then an abort) every time it was tried, and ran
    to its end with this (jax and jaxlib 0.10.2). GPUs and TPUs are unaffected; a run without a
    `model` axis too."""

    if isinstance(model_shards, int) and model_shards > 1:
        jax.config.update("jax_cpu_enable_async_dispatch", False)


def quiet_orbax() -> None:
    """Orbax's log noise filtered and its abandoned writes' unraisable exceptions dropped."""
    for logger in (logging.get_absl_logger(), std_logging.getLogger("asyncio")):
        logger.addFilter(_OrbaxNoise())  # asyncio: "Task exception was never retrieved"
    sys.unraisablehook = _abandoned_write_hook(sys.unraisablehook)


# --- Orbax's logs (orbax-checkpoint 0.12.8, absl-py 2.5.1, Python 3.11 asyncio) ------------------
# A write that fails for lack of space or permission is logged with its traceback by each of
# Orbax's threads, and once more by asyncio per abandoned task: hundreds of lines after the
# save's caller has said it in one (what, where, how much is free).
class _OrbaxNoise(std_logging.Filter):
    """Drops Orbax's tracebacks of a write that failed for lack of space or permission, any
    of its threads' tracebacks once a failed save has been reported, and _ORBAX_NOTICES."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and _abandoned_read(record, exc):
            return False
        if exc is not None:
            return workdir_lib.storage_error(exc) is None and not _save_failed.is_set()
        return not any(notice in str(record.msg) for notice in _ORBAX_NOTICES)


# Notices Orbax 0.12.8 logs that say nothing here: a reader's manager is read-only by design;
# a step's metadata is missing, unreadable or not JSON (logged at ERROR with the file's content)
# when it is damaged or rotated away, or when a full disk left a failed save's empty, each of
# which checkpoint.py reports in its own line; a save waits for the one before in the
# low-priority saving thread, not in training's; a reader restores the model item alone.
_ORBAX_NOTICES = (
    "read only",
    "read_only=True",
    "Metadata file does not exist",
    "Failed to read Metadata file",
    "Failed to json parse Metadata file",
    "Waiting for previous save to complete",
    "was found in the checkpoint, but could not be",
)


class _Notices(std_logging.Filter):
    def filter(self, record: std_logging.LogRecord) -> bool:
        return not any(notice in str(record.msg) for notice in _ORBAX_NOTICES)


@contextlib.contextmanager
def orbax_notices_dropped() -> Any:
    """_ORBAX_NOTICES dropped while the block runs, where `quiet_orbax` is not installed (a
    notebook's `load_model`): a reader opening a run read-only asked for just that."""
    notices, logger = _Notices(), logging.get_absl_logger()
    logger.addFilter(notices)
    try:
        yield
    finally:
        logger.removeFilter(notices)


def record_failed_save() -> None:
    """A save failed and was reported: what Orbax's threads log from now on is that failure."""
    _save_failed.set()


def abandoned_writes() -> bool:
    """Whether a save failed in this process, leaving Orbax's threads with writes to drop."""
    return _save_failed.is_set()


# --- Abandoned writes and reads (tensorstore 0.1.86, orbax-checkpoint 0.12.8, Python 3.11) -------
def _abandoned_write_hook(previous: Any) -> Any:
    """After a failed save, tensorstore still completes the abandoned writes' futures and
    their callbacks find Orbax's event loop closed; after a failed read (a step rotated away
    under a reader, or damaged), the reads abandoned with it end in coroutines nobody awaits.
    Each would print a traceback as an unraisable exception; the failure itself is reported
    in one line (or the reader starts over from the newest step)."""

    def hook(unraisable: Any) -> None:
        value = unraisable.exc_value
        closed = isinstance(value, RuntimeError) and str(value) == "Event loop is closed"
        abandoned_read = "while reading array index" in str(value)
        if not (closed or abandoned_read):
            previous(unraisable)

    return hook


# The reads abandoned with a failed one that asyncio collects while the process runs are each
# logged by it: "Task exception was never retrieved", with tensorstore's error for the same
# damaged or vanished file, hundreds of lines under the one that names the step.
_READ_ERRORS = ("Error opening", "Error reading", "while reading array index")


def _abandoned_read(record: std_logging.LogRecord, exc: BaseException) -> bool:
    return (
        record.name == "asyncio"
        and record.getMessage().startswith("Task exception was never retrieved")
        and any(error in str(exc) for error in _READ_ERRORS)
    )


# --- Orbax's temporary directories (orbax-checkpoint 0.12.8) ------------------------------------
def await_tmp_cleanup(manager: ocp.CheckpointManager) -> None:
    """Wait for the clean-up of temporary directories a manager starts when it is made: its
    `close()` does not (only a save does), and a run that stops at once (`| head -1`, a
    refused config) would exit with that thread running, which then prints a traceback."""
    getattr(manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()


# --- The interpreter's teardown (Python 3.11) ---------------------------------------------------
# After the last exit hook, CPython frees every module and object of JAX, Orbax and matplotlib
# one by one, which nothing reads: a finished command would wait for it.
def exit_after_hooks(status: int) -> None:
    """Leave with `status` once every exit hook has run, without the interpreter's teardown
    (nor JAX's backends')."""
    global _exit_status
    _exit_status = status
    _without_backend_teardown()
    atexit.unregister(_leave)  # newest, so it runs first: hooks registered since `install`
    atexit.register(_leave)  # would otherwise run before it, then again inside it


def _leave() -> None:
    """Registered by `install` and again by `exit_after_hooks`, after every other exit hook, so
    it runs before them: it runs them (newest first, as the interpreter would), then leaves
    with every file closed."""
    if _exit_status is None:
        return
    atexit.unregister(_leave)
    atexit._run_exitfuncs()  # private: the only way to run the hooks registered before it
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed, or None (`>&-`)
            stream.flush()
    os._exit(_exit_status)


# --- JAX's exit hook (jax 0.10.2) ---------------------------------------------------------------
def _without_backend_teardown() -> None:
    """Drop JAX's exit hook (`jax._src.api.clean_up`) in a process that leaves with `os._exit`:
    it destroys each backend's client, which on a TPU shuts the chip's runtime down for
    seconds; the process's end frees the devices as well. Kept where `jax.distributed` runs:
    its coordination service is shut down by the same hook. Compilations still running on
    daemon threads (`compile_ahead`) are not waited for: no interpreter teardown follows."""
    from jax._src import api, distributed

    if distributed.global_state.client is None:
        atexit.unregister(api.clean_up)
    compile_ahead = sys.modules.get(f"{__package__}.compile_ahead")
    if compile_ahead is not None:
        atexit.unregister(compile_ahead.wait_for_compilations)
