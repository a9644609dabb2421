"""`config.optimizer` -> an Optax optimizer: one of OPTIMIZERS by name, its learning-rate
schedule and optional global-norm clipping, every field checked in one line.

Gradient accumulation (`accumulate`) is not here: the train step averages the gradients of
its micro-batches and makes one update, so a step is always one update.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import ml_collections
import optax

from fmnist_flax.errors import UserError

SCHEDULES = ("constant", "warmup_cosine")
# Every field of config.optimizer that is not one optimizer's own.
COMMON_FIELDS = (
    "name", "learning_rate", "weight_decay", "clip_norm", "accumulate", "schedule",
    "warmup_steps", "final_fraction",
)  # fmt: skip
# Each optimizer's own fields, as Optax names them. None (or False for `nesterov`) in the
# config leaves Optax's default, so setting a field the chosen optimizer lacks is an error.
OWN_FIELDS = ("momentum", "nesterov", "b1", "b2")


def _l2(build: Callable[..., optax.GradientTransformation]) -> Callable[..., Any]:
    """An optimizer without weight decay of its own, with `weight_decay` added to the gradient
    (L2, as torch's Adam and SGD do it); 0 adds nothing."""

    def with_decay(learning_rate, weight_decay=0.0, **fields):
        tx = build(learning_rate, **fields)
        return optax.chain(optax.add_decayed_weights(weight_decay), tx) if weight_decay else tx

    return with_decay


def _adafactor(learning_rate, weight_decay=0.0, **fields):
    return optax.adafactor(learning_rate, weight_decay_rate=weight_decay or None, **fields)


# config.optimizer.name -> (a builder taking the rate, weight_decay and the own fields, the own
# fields it takes). Add an optimizer here: any function returning an optax transformation.
OPTIMIZERS: dict[str, tuple[Callable[..., Any], tuple[str, ...]]] = {
    "adamw": (optax.adamw, ("b1", "b2", "nesterov")),
    "adam": (_l2(optax.adam), ("b1", "b2", "nesterov")),
    "sgd": (_l2(optax.sgd), ("momentum", "nesterov")),
    "lion": (optax.lion, ("b1", "b2")),
    "adafactor": (_adafactor, ("momentum",)),
}


def learning_rate(config: ml_collections.ConfigDict) -> optax.Schedule | float:
    """The codelab's constant rate, or linear warm-up then cosine decay over `config.steps`."""
    opt = config.optimizer
    if opt.schedule == "constant":
        return opt.learning_rate
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=opt.learning_rate,
        warmup_steps=opt.warmup_steps,
        decay_steps=config.steps,
        end_value=opt.learning_rate * opt.final_fraction,
    )


def own_fields(opt: ml_collections.ConfigDict) -> dict[str, Any]:
    """The chosen optimizer's own fields that are set (not left to Optax's default)."""
    return {f: opt[f] for f in OWN_FIELDS if opt.get(f) not in (None, False)}


def create(config: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """The optimizer `config.optimizer` names, on the config's schedule, clipped when asked.

    The default (adamw, no clipping) is `optax.adamw(rate, weight_decay=...)` itself, the
    codelab's optimizer to the bit.
    """
    opt = config.optimizer
    build, _ = OPTIMIZERS[opt.name]
    tx = build(learning_rate(config), weight_decay=opt.weight_decay, **own_fields(opt))
    if opt.clip_norm:
        tx = optax.chain(optax.clip_by_global_norm(opt.clip_norm), tx)
    return tx


def _number(field: str, value: Any, low: float, high: float = math.inf) -> None:
    """`value` must be a real number with low <= value < high (NaN never is)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value < high:
        bounds = f"in [{low}, {high})" if high < math.inf else f">= {low}"
        raise UserError(f"--config.optimizer.{field}={value!r} must be {bounds}")


def check_config(opt: ml_collections.ConfigDict, steps: int) -> None:
    """Refuse an unknown optimizer or field, a field the optimizer does not take, or a value it
    cannot use: one line each, before anything is built."""
    if opt.name not in OPTIMIZERS:
        raise UserError(
            f"--config.optimizer.name={opt.name!r} is not one of {', '.join(OPTIMIZERS)}"
        )
    for field in opt:
        if field not in (*COMMON_FIELDS, *OWN_FIELDS):
            raise UserError(
                f"--config.optimizer.{field}: config.optimizer has no field {field!r}; its "
                f"fields are {', '.join((*COMMON_FIELDS, *OWN_FIELDS))}"
            )
    takes = OPTIMIZERS[opt.name][1]
    for field, value in own_fields(opt).items():
        if field not in takes:
            raise UserError(
                f"--config.optimizer.{field}={value!r}: optimizer {opt.name!r} does not take "
                f"{field}; its own fields are {', '.join(takes)}"
            )
    if not (isinstance(opt.learning_rate, int | float) and 0 < opt.learning_rate < math.inf):
        raise UserError(f"--learning_rate={opt.learning_rate} must be positive (and finite)")
    _number("weight_decay", opt.weight_decay, 0)
    _number("clip_norm", opt.clip_norm, 0)
    for field in ("momentum", "b1", "b2"):
        if opt.get(field) is not None:
            _number(field, opt[field], 0, 1)
    if not isinstance(opt.nesterov, bool):
        raise UserError(f"--config.optimizer.nesterov={opt.nesterov!r} must be True or False")
    if isinstance(opt.accumulate, bool) or not isinstance(opt.accumulate, int):
        raise UserError(f"--config.optimizer.accumulate={opt.accumulate!r} must be a whole number")
    if opt.accumulate < 1:
        raise UserError(f"--config.optimizer.accumulate={opt.accumulate} must be >= 1")
    if opt.schedule not in SCHEDULES:
        raise UserError(
            f"--config.optimizer.schedule={opt.schedule!r} is not one of {', '.join(SCHEDULES)}"
        )
    if opt.schedule == "warmup_cosine" and not 0 <= opt.warmup_steps < steps:
        raise UserError(
            f"--config.optimizer.warmup_steps={opt.warmup_steps} must be below --steps={steps}"
        )
