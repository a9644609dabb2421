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
    "name",
    "learning_rate",
    "weight_decay",
    "clip_norm",
    "accumulate",
    "schedule",
    "warmup_steps",
    "final_fraction",
)
# Each optimizer's own fields, as Optax names them. None (or False for `nesterov`) in the
# config leaves Optax's default, so setting a field the chosen optimizer lacks is an error.
OWN_FIELDS = ("momentum", "nesterov", "b1", "b2")


def _l2(build: Callable[..., optax.GradientTransformation]) -> Callable[..., Any]:
    """An optimizer without weight decay of its own, with `weight_decay` added to the gradient
    (L2, as torch's Adam and SGD do it); 0 adds nothing."""

    def with_decay(learning_rate, weight_decay=0.0, **fields):
        tx = build(learning_rate, **fields)
        if _is_zero(weight_decay):
            return tx
        return optax.chain(optax.add_decayed_weights(weight_decay), tx)

    return with_decay


def _adafactor(learning_rate, weight_decay=0.0, **fields):
    decay = None if _is_zero(weight_decay) else weight_decay
    return optax.adafactor(learning_rate, weight_decay_rate=decay, **fields)


def _is_zero(value: Any) -> bool:
    """A Python 0, not an array: an ensemble's injected values are arrays, whatever they hold,
    so the transformation they build has one structure for every member."""
    return isinstance(value, int | float) and not value


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


def member_hyperparams(config: ml_collections.ConfigDict, member: int) -> dict[str, float]:
    """Ensemble member `member`'s learning rate and weight decay: its own where
    `config.ensemble` lists them, config.optimizer's otherwise."""
    ens = config.ensemble
    opt = config.optimizer
    return {
        field: float(ens[field][member] if ens[field] else opt[field])
        for field in ("learning_rate", "weight_decay")
    }


def create(
    config: ml_collections.ConfigDict, member: int | None = None
) -> optax.GradientTransformation:
    """The optimizer `config.optimizer` names, on the config's schedule, clipped when asked.

    The default (adamw, no clipping) is `optax.adamw(rate, weight_decay=...)` itself, the
    codelab's optimizer to the bit. For ensemble member `member`, its learning rate and
    weight decay are arrays in the optimizer's state (`optax.inject_hyperparams`): stacked,
    the members' values form one array each, and one compiled step serves any sweep.
    """
    opt = config.optimizer
    build, _ = OPTIMIZERS[opt.name]
    own = own_fields(opt)
    if member is None:
        tx = build(learning_rate(config), weight_decay=opt.weight_decay, **own)
    else:  # only these two injected: the others stay Python floats, bit-exact with one run
        values = member_hyperparams(config, member)
        if opt.schedule != "constant":  # one schedule for every member (its peak is shared)
            values["learning_rate"] = learning_rate(config)

        def member_tx(learning_rate, weight_decay):
            return build(learning_rate, weight_decay=weight_decay, **own)

        tx = optax.inject_hyperparams(member_tx)(**values)
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
    if isinstance(opt.final_fraction, bool) or not (
        isinstance(opt.final_fraction, int | float) and 0 <= opt.final_fraction <= 1
    ):  # a negative end rate climbs the loss; NaN or inf ends in a non-finite loss
        raise UserError(
            f"--config.optimizer.final_fraction={opt.final_fraction!r} must be in [0, 1] (the "
            "last rate of warmup_cosine, as a fraction of the peak)"
        )
    if opt.schedule == "warmup_cosine" and not 0 <= opt.warmup_steps < steps:
        raise UserError(
            f"--config.optimizer.warmup_steps={opt.warmup_steps} must be below --steps={steps}"
        )
