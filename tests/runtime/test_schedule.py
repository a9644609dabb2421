"""The steps where the loop's rows end: counted on the device from a phase (`next_row`), as the
host lists them (`Schedule.row_steps`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_config

from fmnist_flax.runtime.schedule import Schedule, next_row, row_phase

WINDOW = 40  # steps a chunk runs here: one compilation for every case


@functools.partial(jax.jit, static_argnames="count")
def rows_ended(first_step, count, cadence):
    """Which of steps first_step+1 .. first_step+count end a row, counted as a chunk does."""

    def step(phase, i):
        ends, phase = next_row(first_step + i + 1, phase, cadence)
        return phase, ends

    return jax.lax.scan(step, row_phase(first_step, cadence), jnp.arange(count))[1]


@pytest.mark.parametrize(
    ("log_every", "eval_every", "steps"), [(50, 0, 400), (7, 30, 95), (1, 3, 60)]
)
def test_rows_counted_on_the_device_end_where_the_host_lists_them(log_every, eval_every, steps):
    config = load_config("default")
    config.update(log_every=log_every, eval_every=eval_every, steps=steps)
    schedule = Schedule(config, batches_per_epoch=117)
    for first_step in (0, 1, 6, 19, steps - WINDOW):  # the last window ends at the last step
        ended = np.asarray(rows_ended(first_step, WINDOW, schedule.cadence))
        counted = [first_step + 1 + int(k) for k in np.flatnonzero(ended)]
        assert counted == schedule.row_steps(first_step, first_step + WINDOW), first_step
