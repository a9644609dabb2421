"""How a run stops: a signal after training, said once, wherever the main thread is."""

from __future__ import annotations

import os
import signal

import pytest

from fmnist_flax.runtime import checkpoint, stopping


def test_a_signal_after_training_is_never_taken_for_a_librarys_own_failure(tmp_path):
    """After training a signal is raised wherever the main thread is. Code that takes any
    Exception for its own failure swallowed it: JAX's compilation cache read it as a damaged
    entry, deleted the entries and the run went on to its end, exit 0. It now passes through
    such code and is said once, with its exit status."""
    saved = checkpoint.Checkpoints(tmp_path / "checkpoints", max_to_keep=1)
    swallowed = []
    stop = stopping.Stop()
    with stop, pytest.raises(stopping.Interrupted) as stopped, stop.after_training(400, saved):
        try:  # as a library reading a file would
            os.kill(os.getpid(), signal.SIGINT)
            sum(range(100_000))  # the handler runs here, in the main thread
        except Exception as exc:
            swallowed.append(exc)
        swallowed.append("the run went on")
    assert not swallowed and stopped.value.exit_code == 130
    assert str(stopped.value).startswith("SIGINT at step 400: checkpoint 400 saved in ")
    saved.close()
