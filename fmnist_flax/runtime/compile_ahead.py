"""Compiling what the training loop runs first on a thread, while the set-up's tables and the
extensions run on the main one (XLA compiles without the GIL).

API: `start(train_chunk, state, sums, aug_key, first_call, model, optimizer)`, a thread to
join before the loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from fmnist_flax.runtime import checkpoint as checkpoint_lib
from fmnist_flax.runtime import parallel


def start(
    train_chunk: Callable[..., Any],
    state: Any,
    sums: dict[str, jax.Array],
    aug_key: jax.Array | None,
    first_call: tuple[Any, ...] | None,
    model: nnx.Module,
    optimizer: nnx.Optimizer,
) -> threading.Thread:
    """A thread compiling the chunk for `first_call`'s arguments (when they are known before
    the loop), the finiteness check and the save's state copy. It compiles only, never runs:
    with several processes a run beside the main thread's could interleave their
    collectives."""
    params = nnx.state(model, nnx.Param)

    def compile_first() -> None:
        if first_call is not None:
            train_chunk.lower(state, sums, *first_call, aug_key).compile()
        parallel.finite.lower(params).compile()
        checkpoint_lib.warm_up(model, optimizer)

    thread = threading.Thread(target=compile_first, name="compile-ahead")
    thread.start()
    return thread
