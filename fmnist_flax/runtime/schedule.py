"""When the training loop's host looks between compiled chunks, and what it does there: log a
row, evaluate on the test set, save a checkpoint; and where the data order stands at a step.

API: `Schedule(config, batches_per_epoch)` with `next_stop(step)`, `logs(step)`,
`evaluates(step)`, `saves(step, signum, checkpoints)`, `eval_period` and `progress(step)`.
"""

from __future__ import annotations

import ml_collections

from fmnist_flax.runtime import checkpoint as checkpoint_lib


class Schedule:
    """The steps of a run of `config.steps` where the loop stops, from `config`'s `log_every`,
    `eval_every` and `checkpoint_every` and the epoch's length."""

    def __init__(self, config: ml_collections.ConfigDict, batches_per_epoch: int):
        self.config = config
        self.batches_per_epoch = batches_per_epoch
        # Steps between test-set evaluations: `eval_every`, or an epoch when it is 0.
        self.eval_period = config.eval_every or batches_per_epoch

    def next_stop(self, step: int) -> int:
        """The next step where the host must look: a log, checkpoint or evaluation step, an
        epoch's end, the end."""
        if step == 0:
            return 1  # step 1 is logged (and compiles the chunk)
        config = self.config
        periods = (
            config.log_every,
            config.checkpoint_every,
            self.batches_per_epoch,
            self.eval_period,
        )
        return min(*[(step // every + 1) * every for every in periods], config.steps)

    def logs(self, step: int) -> bool:
        return step == 1 or step % self.config.log_every == 0 or step == self.config.steps

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
