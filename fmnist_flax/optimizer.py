"""The optimizers (OPTIMIZERS) and learning-rate schedules (SCHEDULES) a config can name.

`@register` adds an optimizer and `@schedule` a schedule, from this module or from any module
imported before the config is checked (a config file can import it). Building a config's
optimizer (`create`: decay mask, rate multipliers, clipping) and checking its fields
(`check_config`) are runtime/optimizers.py's. Gradient accumulation (`accumulate`) is not here:
the train step averages the gradients of its micro-batches and makes one update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import optax

from fmnist_flax.runtime.errors import UserError

# The registries and what builds a config's optimizer, under the names they have here.
from fmnist_flax.runtime.optimizers import DECAY_MASKS as DECAY_MASKS
from fmnist_flax.runtime.optimizers import OPTIMIZERS as OPTIMIZERS
from fmnist_flax.runtime.optimizers import SCHEDULES as SCHEDULES
from fmnist_flax.runtime.optimizers import check_config as check_config
from fmnist_flax.runtime.optimizers import create as create
from fmnist_flax.runtime.optimizers import learning_rate as learning_rate
from fmnist_flax.runtime.optimizers import over_steps as over_steps
from fmnist_flax.runtime.optimizers import register, schedule

# --- Optimizers ------------------------------------------------------------------------------


def _l2(build: Callable[..., optax.GradientTransformation]) -> Callable[..., Any]:
    """An optimizer without weight decay of its own, with `weight_decay` added to the gradient
    (L2, as torch's Adam and SGD do it) where `mask` allows; 0 adds nothing."""

    def with_decay(learning_rate, weight_decay=0.0, mask=None, **fields):
        tx = build(learning_rate, **fields)
        if _is_zero(weight_decay):
            return tx
        return optax.chain(optax.add_decayed_weights(weight_decay, mask), tx)

    return with_decay


def _is_zero(value: Any) -> bool:
    """A Python 0, not an array: an ensemble's injected values are arrays, whatever they hold,
    so the transformation they build has one structure for every member."""
    return isinstance(value, int | float) and not value


register("adamw", takes=("b1", "b2", "nesterov"))(optax.adamw)
register("adam", takes=("b1", "b2", "nesterov"))(_l2(optax.adam))
register("sgd", takes=("momentum", "nesterov"))(_l2(optax.sgd))
register("lion", takes=("b1", "b2"))(optax.lion)


@register("adafactor", takes=("momentum",))
def _adafactor(learning_rate, weight_decay=0.0, mask=None, **fields):
    decay = None if _is_zero(weight_decay) else weight_decay
    return optax.adafactor(learning_rate, weight_decay_rate=decay, weight_decay_mask=mask, **fields)


# --- Schedules -------------------------------------------------------------------------------


def _warmup_steps(opt: ml_collections.ConfigDict, steps: int, least: int = 0) -> int:
    """`warmup_steps`, a whole number in least..steps-1 (the peak is reached in the run)."""
    warmup = opt.warmup_steps
    if isinstance(warmup, bool) or not isinstance(warmup, int) or not least <= warmup < steps:
        raise UserError(
            f"--config.optimizer.warmup_steps={warmup!r} must be below --steps={steps} and a "
            f"whole number >= {least} (--config.optimizer.schedule={opt.schedule})"
        )
    return warmup


@schedule("constant")
def constant(opt: ml_collections.ConfigDict, steps: int) -> float:
    """The codelab's: the rate itself at every step."""
    return opt.learning_rate


@schedule("warmup_cosine", fields=("warmup_steps", "final_fraction"), over_steps=True)
def warmup_cosine(opt: ml_collections.ConfigDict, steps: int) -> optax.Schedule:
    """Linear warm-up from 0 to the peak, then cosine decay to final_fraction x peak at
    --steps."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=opt.learning_rate,
        warmup_steps=_warmup_steps(opt, steps),
        decay_steps=steps,
        end_value=opt.learning_rate * opt.final_fraction,
    )


@schedule("warmup_rsqrt", fields=("warmup_steps",))
def warmup_rsqrt(opt: ml_collections.ConfigDict, steps: int) -> optax.Schedule:
    """Linear warm-up from 0 to the peak, then peak x sqrt(warmup_steps / step): no end, so
    --steps can grow on a resume."""
    warmup, peak = _warmup_steps(opt, steps, least=1), opt.learning_rate

    def rate(count: jax.Array) -> jax.Array:
        return peak * jnp.minimum(count / warmup, jnp.sqrt(warmup / jnp.maximum(count, warmup)))

    return rate


@schedule("one_cycle", fields=("warmup_steps", "final_fraction"), over_steps=True)
def one_cycle(opt: ml_collections.ConfigDict, steps: int) -> optax.Schedule:
    """Linear one-cycle: linear from 0 to the peak over warmup_steps, then linear down to
    final_fraction x peak at --steps."""
    warmup, peak = _warmup_steps(opt, steps), opt.learning_rate
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, peak, warmup),
            optax.linear_schedule(peak, peak * opt.final_fraction, steps - warmup),
        ],
        [warmup],
    )
