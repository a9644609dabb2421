"""TensorBoard event files of a run: every logged metric, the test metrics, the learning rate,
examples/sec and the config, under <workdir>/tensorboard (process 0 writes them).

`tensorboard --logdir runs` shows every run under runs/ side by side. tensorboardX writes
the files (no TensorFlow); the viewer is the `tensorboard` extra.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import ml_collections
from tensorboardX import SummaryWriter

from fmnist_flax import optimizer

TENSORBOARD_DIR = "tensorboard"
TEST_PREFIX = "test_"  # metrics.jsonl names the evaluation's metrics test_loss, test_accuracy


def tag(name: str) -> str:
    """The TensorBoard tag of a metrics.jsonl field: test_accuracy -> test/accuracy."""
    if name.startswith(TEST_PREFIX):
        return f"test/{name.removeprefix(TEST_PREFIX)}"
    return f"train/{name}"


class Summaries:
    """One run's TensorBoard writer; a resumed run drops the events past its checkpoint."""

    def __init__(self, workdir: pathlib.Path, config: ml_collections.ConfigDict, start_step: int):
        self.writer = SummaryWriter(
            logdir=str(workdir / TENSORBOARD_DIR),
            purge_step=start_step + 1 if start_step else None,
        )
        self.schedule = optimizer.learning_rate(config)
        text = json.dumps(config.to_dict(), indent=2, sort_keys=True)
        self.writer.add_text("config", f"```\n{text}\n```", start_step)

    def write(self, row: dict[str, Any], examples_per_sec: float | None = None) -> None:
        """A metrics.jsonl row at its step, with the rate the step's update used."""
        step = row["step"]
        for name, value in row.items():
            if name != "step":
                self.writer.add_scalar(tag(name), value, step)
        rate = self.schedule(step - 1) if callable(self.schedule) else self.schedule
        self.writer.add_scalar("train/learning_rate", float(rate), step)
        if examples_per_sec is not None:
            self.writer.add_scalar("train/examples_per_sec", examples_per_sec, step)

    def close(self) -> None:
        self.writer.close()
