"""Compiling what the training loop runs first on a thread, while the set-up's tables and the
extensions run on the main one (XLA compiles without the GIL).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from . import checkpoint as checkpoint_lib
from . import parallel


class Compiling(threading.Thread):
    """The thread compiling ahead. `join` returns once it is done, or at once when a stop
    signal came (`stop.signum`): XLA cannot be interrupted, so the thread is a daemon that
    the process does not wait for."""

    def __init__(self, compile_first: Callable[[], None], stop: Any):
        super().__init__(target=compile_first, name="compile-ahead", daemon=True)
        self.stop = stop

    def join(self, timeout: float | None = None) -> None:
        while self.is_alive() and not (self.stop is not None and self.stop.signum):
            super().join(0.1)


_RUNNING: set[concurrent.futures.Future] = set()  # `in_background`'s jobs not yet done
_waits_at_exit = False  # whether `wait_for_compilations` is an exit hook yet


def in_background(job: Callable[[], Any], name: str) -> concurrent.futures.Future:
    """`job` run on a daemon thread, its result in the future returned. The interpreter joins
    a ThreadPoolExecutor's workers before it exits, so a signal's exit waited for a compilation
    nothing can interrupt; it does not wait for a daemon thread (the command line leaves with
    `os._exit`; `wait_for_compilations` covers a process that tears the interpreter down)."""
    global _waits_at_exit
    if not _waits_at_exit:  # from the first job on: importing this module changes nothing
        _waits_at_exit = True
        atexit.register(wait_for_compilations)
    future: concurrent.futures.Future = concurrent.futures.Future()
    _RUNNING.add(future)
    future.add_done_callback(_RUNNING.discard)

    def run() -> None:
        future.set_running_or_notify_cancel()
        try:
            future.set_result(job())
        except BaseException as exc:  # the waiter sees it, as a pool's future would show it
            future.set_exception(exc)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def wait_for_compilations() -> None:
    """At the interpreter's exit, wait for the compilations still running on daemon threads: one
    in XLA while the interpreter tears itself down aborts the process ("terminate called...")."""
    concurrent.futures.wait(list(_RUNNING))


def start(
    train_chunk: Callable[..., Any],
    state: Any,
    sums: dict[str, jax.Array],
    last: tuple[Any, ...],
    first_call: tuple[Any, ...] | None,
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    stop: Any = None,
    also: Sequence[Callable[[], None]] = (),
) -> Compiling:
    """A thread compiling the chunk for `first_call`'s arguments (when they are known before
    the loop) and then `last`, the finiteness check, the save's state copy and each of `also`
    (the evaluation's). It compiles only, never runs: with several processes a run beside the main
    thread's could interleave their collectives. `stop`: a `stopping.Stop` whose signal ends a
    wait for it."""
    params = nnx.state(model, nnx.Param)

    jobs = [
        lambda: parallel.finite.lower(params).compile(),
        lambda: checkpoint_lib.warm_up(model, optimizer),
        *also,
    ]
    if first_call is not None:
        jobs.insert(0, lambda: train_chunk.lower(state, sums, *first_call, *last).compile())

    def compile_first() -> None:  # each program on a thread of its own: XLA compiles apart
        for done in [in_background(job, "compile") for job in jobs]:
            done.result()

    thread = Compiling(compile_first, stop)
    thread.start()
    return thread
