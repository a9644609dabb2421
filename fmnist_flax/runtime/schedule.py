"""When the training loop's host looks between compiled chunks, and what it does there: log a
row, evaluate on the test set, save a checkpoint; and where the data order stands at a step.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import ml_collections
import numpy as np

from . import checkpoint as checkpoint_lib

ROWS_PER_CALL = 8  # logged rows one accelerator call may run past (see `Schedule`)


class Schedule:
    """The steps of a run of `config.steps` where the loop stops, from `config`'s `log_every`,
    `eval_every` and `checkpoint_every` and the epoch's length.

    On an accelerator (`platform` not "cpu") the device pipeline's calls run past logged steps,
    up to `ROWS_PER_CALL` of them, returning each one's row: its steps take microseconds, and
    a host stop at each logged step would leave the chip idle. Elsewhere the host stops at
    each one. Equal schedules compile to one training chunk (they are hashable); a chunk reads
    the steps where rows end from `cadence`, an argument, so runs that differ only in
    `steps`, `log_every` or `eval_every` share its compiled program too."""

    def __init__(
        self, config: ml_collections.ConfigDict, batches_per_epoch: int, platform: str = "cpu"
    ):
        self.config = config
        self.batches_per_epoch = batches_per_epoch
        # Steps between test-set evaluations: `eval_every`, or an epoch when it is 0.
        self.eval_period = config.eval_every or batches_per_epoch
        fused_device = config.fused_steps and config.input_pipeline == "device"
        self.accelerated = platform != "cpu" and fused_device
        self.rows_per_call = ROWS_PER_CALL if self.accelerated else 1
        # What `next_row` reads: a compiled chunk takes it as an argument.
        self.cadence = np.array([config.log_every, self.eval_period, config.steps], np.int32)

    def _key(self) -> tuple[int, ...]:
        c = self.config
        return (c.steps, c.log_every, self.eval_period, self.rows_per_call)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schedule) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def next_stop(
        self,
        step: int,
        most: int | None = None,
        checkpoints: checkpoint_lib.Checkpoints | None = None,
    ) -> int:
        """The next step where the host must look: a logged step (on an accelerator, the
        `rows_per_call`-th after `step`), an evaluation step, an epoch's end, the end, a
        checkpoint step (with `checkpoints`, only where a save is due, as far as can be told
        now); at most `most` steps on (None: no bound)."""
        if step == 0:
            return 1  # step 1 is logged (and compiles the chunk)
        config = self.config
        stops = [
            (step // every + 1) * every for every in (self.batches_per_epoch, self.eval_period)
        ]
        # The `rows_per_call`-th logged step: at most that many rows end in one call.
        rows = (step // config.log_every + self.rows_per_call) * config.log_every
        nearest = min(*stops, rows, config.steps, step + (most or config.steps))
        save = (step // config.checkpoint_every + 1) * config.checkpoint_every
        if save < nearest and (checkpoints is None or checkpoints.due(save)):
            return save
        return nearest

    def row_steps(self, after: int, step: int) -> list[int]:
        """The steps after `after`, up to `step`, at which rows are logged."""
        c = self.config
        found = {1, c.steps}
        for every in (c.log_every, self.eval_period):
            found.update(range((after // every + 1) * every, step + 1, every))
        return sorted(s for s in found if after < s <= step)

    def evaluates(self, step: int) -> bool:
        return step % self.eval_period == 0 or step == self.config.steps

    def saves(self, step: int, signum: int, checkpoints: checkpoint_lib.Checkpoints) -> bool:
        """At the end, on a signal, and at each `checkpoint_every` step that the save policy
        allows (`Checkpoints.due`: none being written, the last one old enough)."""
        if step == self.config.steps or signum:
            return True
        return step % self.config.checkpoint_every == 0 and checkpoints.due(step)

    def progress(self, step: int) -> dict[str, int]:
        """Where the data order stands after `step` updates: epoch, index of the next batch."""
        return {
            "step": step,
            "epoch": step // self.batches_per_epoch,
            "index": step % self.batches_per_epoch,
            "num_batches": self.batches_per_epoch,
            "batch_size": self.config.batch_size,
            "seed": self.config.seed,
        }


def row_phase(step: Any, cadence: Any) -> Any:
    """Where `step` stands in the log and evaluation periods of a schedule's `cadence`
    (log_every, the evaluation period, steps): what `next_row` counts on from, step by step,
    inside a compiled chunk (a division there at every step slowed a TPU's loop)."""
    return jnp.stack([step % cadence[0], step % cadence[1]])


def next_row(step: Any, phase: Any, cadence: Any) -> tuple[Any, Any]:
    """Whether a row is logged at `step` (a logged or evaluated step, the first, the last),
    where `phase` is the `row_phase` of the step before; and the phase of `step`."""
    phase = phase + 1
    ends = phase == cadence[:2]
    return ends.any() | (step == 1) | (step == cadence[2]), jnp.where(ends, 0, phase)
