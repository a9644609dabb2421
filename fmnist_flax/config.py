"""Check a run's config before any data is read or anything compiles."""

from __future__ import annotations

import ml_collections

from fmnist_flax.errors import UserError
from fmnist_flax.model import COMPUTE_DTYPES, MODELS
from fmnist_flax.parallel import PARAM_SHARDINGS

REPORT_CHOICES = ("full", "basic", "none")
SCHEDULES = ("constant", "warmup_cosine")
MAX_CONV_BLOCKS = 4  # each halves the 28x28 image; a fifth would leave nothing


def validate(config: ml_collections.ConfigDict) -> None:
    """Raise UserError naming the first field whose value cannot work."""
    if config.compute_dtype not in COMPUTE_DTYPES:
        raise UserError(
            f"--compute_dtype={config.compute_dtype!r} is not supported; "
            f"use one of {', '.join(COMPUTE_DTYPES)}"
        )
    if config.report not in REPORT_CHOICES:
        raise UserError(f"--report={config.report!r} is not one of {', '.join(REPORT_CHOICES)}")
    if config.param_sharding not in PARAM_SHARDINGS:
        raise UserError(
            f"--config.param_sharding={config.param_sharding!r} is not one of "
            f"{', '.join(PARAM_SHARDINGS)}"
        )
    for name in ("steps", "batch_size", "log_every", "checkpoint_every", "max_to_keep"):
        if config[name] < 1:
            raise UserError(f"--{name}={config[name]} must be a positive whole number")
    if not config.optimizer.learning_rate > 0:
        raise UserError(f"--learning_rate={config.optimizer.learning_rate} must be positive")
    if config.optimizer.weight_decay < 0:
        raise UserError(
            f"--config.optimizer.weight_decay={config.optimizer.weight_decay} must be >= 0"
        )
    if config.model.name not in MODELS:
        raise UserError(
            f"--config.model.name={config.model.name!r} is not one of {', '.join(MODELS)}"
        )
    for field, most in (("hidden", None), ("features", MAX_CONV_BLOCKS)):
        widths = tuple(config.model.get(field, (1,)))
        if not widths or any(not isinstance(w, int) or w < 1 for w in widths):
            raise UserError(
                f"--config.model.{field}={widths} must be a tuple of positive widths, "
                "e.g. '(256, 128)'"
            )
        if most and len(widths) > most:
            raise UserError(
                f"--config.model.{field}={widths}: at most {most} conv blocks fit 28x28"
            )
    if config.augment.max_shift < 0:
        raise UserError(f"--config.augment.max_shift={config.augment.max_shift} must be >= 0")
    schedule = config.optimizer.schedule
    if schedule not in SCHEDULES:
        raise UserError(
            f"--config.optimizer.schedule={schedule!r} is not one of {', '.join(SCHEDULES)}"
        )
    if schedule == "warmup_cosine" and not 0 <= config.optimizer.warmup_steps < config.steps:
        raise UserError(
            f"--config.optimizer.warmup_steps={config.optimizer.warmup_steps} must be below "
            f"--steps={config.steps}"
        )
