"""Check a run's config before any data is read or anything compiles."""

from __future__ import annotations

import ml_collections

from fmnist_flax.errors import UserError
from fmnist_flax.model import COMPUTE_DTYPES, MODELS

REPORT_CHOICES = ("full", "basic", "none")
SCHEDULES = ("constant", "warmup_cosine")


def validate(config: ml_collections.ConfigDict) -> None:
    """Raise UserError naming the first field whose value cannot work."""
    if config.compute_dtype not in COMPUTE_DTYPES:
        raise UserError(
            f"--compute_dtype={config.compute_dtype!r} is not supported; "
            f"use one of {', '.join(COMPUTE_DTYPES)}"
        )
    if config.report not in REPORT_CHOICES:
        raise UserError(f"--report={config.report!r} is not one of {', '.join(REPORT_CHOICES)}")
    for name in ("steps", "batch_size", "log_every", "checkpoint_every", "max_to_keep"):
        if config[name] < 1:
            raise UserError(f"--{name}={config[name]} must be a positive whole number")
    if not config.optimizer.learning_rate > 0:
        raise UserError(f"--learning_rate={config.optimizer.learning_rate} must be positive")
    if config.optimizer.weight_decay < 0:
        raise UserError(
            f"--config.optimizer.weight_decay={config.optimizer.weight_decay} must be >= 0"
        )
    if config.model.get("name", "mlp") not in MODELS:
        raise UserError(
            f"--config.model.name={config.model.name!r} is not one of {', '.join(MODELS)}"
        )
    hidden = tuple(config.model.get("hidden", (1,)))
    if not hidden or any(not isinstance(h, int) or h < 1 for h in hidden):
        raise UserError(
            f"--config.model.hidden={hidden} must be a tuple of positive widths, e.g. '(256, 128)'"
        )
    schedule = config.optimizer.get("schedule", "constant")
    if schedule not in SCHEDULES:
        raise UserError(
            f"--config.optimizer.schedule={schedule!r} is not one of {', '.join(SCHEDULES)}"
        )
    if schedule == "warmup_cosine" and not 0 <= config.optimizer.warmup_steps < config.steps:
        raise UserError(
            f"--config.optimizer.warmup_steps={config.optimizer.warmup_steps} must be below "
            f"--steps={config.steps}"
        )
