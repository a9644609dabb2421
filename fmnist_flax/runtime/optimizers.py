"""Optax optimizers by name: the registries a config picks its optimizer and schedule from
(`register`, `schedule`), and `config.optimizer` -> an Optax optimizer (`create`): the rate on
its schedule, weight decay on the parameters `decay_mask` picks, per-group rate multipliers
and optional global-norm clipping, every field checked in one line first (`check_config`).
The template registers its optimizers and schedules in its `optimizer.py`; a module of
`config.imports` adds its own for the runs that import it (`registry.Registry`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import ml_collections
import optax

from . import ensemble, param_groups
from .errors import UserError
from .registry import Registry

# Every field of config.optimizer that is not one optimizer's or one schedule's own.
COMMON_FIELDS = (
    "name",
    "learning_rate",
    "weight_decay",
    "decay_mask",
    "lr_multipliers",
    "clip_norm",
    "accumulate",
    "schedule",
)
# Own fields the checks below bound to [0, 1) (Optax's momenta and decay rates).
FRACTION_FIELDS = ("momentum", "b1", "b2")


class Optimizer(NamedTuple):
    """A registered optimizer: `build(learning_rate, weight_decay=, mask=, **own)` returns the
    Optax transformation; `takes` names its own fields of config.optimizer."""

    build: Callable[..., optax.GradientTransformation]
    takes: tuple[str, ...]


class Schedule(NamedTuple):
    """A registered schedule: `build(config.optimizer, steps)` returns the rate, a number or
    an Optax schedule of the step; `fields` are the fields of config.optimizer it reads;
    `over_steps`: its rates depend on --steps (a resume may not change them)."""

    build: Callable[[ml_collections.ConfigDict, int], optax.ScalarOrSchedule]
    fields: tuple[str, ...]
    over_steps: bool


OPTIMIZERS = Registry("optimizer")  # config.optimizer.name -> Optimizer
SCHEDULES = Registry("schedule")  # config.optimizer.schedule -> Schedule


def register(name: str, takes: tuple[str, ...] = ()) -> Callable:
    """`@register("name", takes=(...))` over a builder makes it `--config.optimizer.name=name`.
    The builder takes the rate (or schedule), `weight_decay`, `mask` (None: decay every
    parameter) and the own fields in `takes` that are set; a field in `takes` must exist in
    config.optimizer (None or False there: the builder's default)."""

    def add(build: Callable[..., optax.GradientTransformation]) -> Callable:
        OPTIMIZERS[name] = Optimizer(build, tuple(takes))
        return build

    return add


def schedule(name: str, fields: tuple[str, ...] = (), over_steps: bool = False) -> Callable:
    """`@schedule("name", fields=(...))` over `build(opt, steps)` makes it
    `--config.optimizer.schedule=name`. `build` reads config.optimizer's `fields` and raises
    UserError naming the flag for a value it cannot use: the check builds it once, so a
    mistake is one line before anything compiles."""

    def add(build: Callable[[ml_collections.ConfigDict, int], optax.ScalarOrSchedule]):
        SCHEDULES[name] = Schedule(build, tuple(fields), over_steps)
        return build

    return add


def learning_rate(config: ml_collections.ConfigDict) -> optax.ScalarOrSchedule:
    """The rate `config.optimizer.schedule` gives: a number (`constant`) or a function of the
    step."""
    opt = config.optimizer
    return SCHEDULES.active(config.imports)[opt.schedule].build(opt, config.steps)


def over_steps(name: Any, imports: Sequence[str] = ()) -> bool:
    """Whether schedule `name`'s rates depend on --steps (one not registered is assumed to)."""
    schedules = SCHEDULES.active(imports)
    return name not in schedules or schedules[name].over_steps


# --- Decay masks (parameter groups by name: runtime/param_groups.py) ------------------------

# config.optimizer.decay_mask -> the mask (params -> a tree of bools) handed to the optimizer;
# None: every parameter is decayed.
DECAY_MASKS = Registry("decay mask", {"all": None, "kernels": param_groups.kernels})


# --- The optimizer of a config ---------------------------------------------------------------


def own_field_names(imports: Sequence[str] = ()) -> tuple[str, ...]:
    """Every optimizer's own fields (of those a run with `imports` sees), each once, in order of
    registration."""
    entries = OPTIMIZERS.active(imports).values()
    return tuple(dict.fromkeys(f for entry in entries for f in entry.takes))


def own_fields(opt: ml_collections.ConfigDict, imports: Sequence[str] = ()) -> dict[str, Any]:
    """The chosen optimizer's own fields that are set (not left to Optax's default)."""
    return {f: opt[f] for f in own_field_names(imports) if opt.get(f) not in (None, False)}


def create(
    config: ml_collections.ConfigDict, member: int | None = None
) -> optax.GradientTransformation:
    """The optimizer `config.optimizer` names, on the config's schedule, decaying the
    parameters of its `decay_mask`, each group's updates scaled, clipped when asked.

    The default (adamw, every parameter decayed, no multipliers, no clipping) is
    `optax.adamw(rate, weight_decay=...)` itself, the codelab's optimizer to the bit. For
    ensemble member `member`, its learning rate and weight decay are arrays in the optimizer's
    state (`optax.inject_hyperparams`): stacked, the members' values form one array each, and
    one compiled step serves any sweep.
    """
    opt = config.optimizer
    build = OPTIMIZERS.active(config.imports)[opt.name].build
    mask = DECAY_MASKS.active(config.imports)[opt.decay_mask]
    fields = {**own_fields(opt, config.imports), "mask": mask}
    rate = learning_rate(config)
    if member is None:
        tx = build(rate, weight_decay=opt.weight_decay, **fields)
    else:  # only these two injected: the others stay Python floats, bit-exact with one run
        values = ensemble.member_hyperparams(config, member)
        if callable(rate):  # one schedule for every member (its peak is shared)
            values["learning_rate"] = rate

        def member_tx(learning_rate, weight_decay):
            return build(learning_rate, weight_decay=weight_decay, **fields)

        tx = optax.inject_hyperparams(member_tx)(**values)
    if opt.lr_multipliers:
        tx = optax.chain(tx, param_groups.scale_groups(opt.lr_multipliers))
    if opt.clip_norm:
        tx = optax.chain(optax.clip_by_global_norm(opt.clip_norm), tx)
    return tx


# --- Checks ----------------------------------------------------------------------------------


def _number(field: str, value: Any, low: float, high: float = math.inf) -> None:
    """`value` must be a real number with low <= value < high (NaN never is)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value < high:
        bounds = f"in [{low}, {high})" if high < math.inf else f">= {low}"
        raise UserError(f"--config.optimizer.{field}={value!r} must be {bounds}")


def check_config(opt: ml_collections.ConfigDict, steps: int, imports: Sequence[str] = ()) -> None:
    """Refuse an unknown optimizer, schedule or field, a field the optimizer does not take, or
    a value it cannot use: one line each, before anything is built. `imports`: the run's
    config.imports, whose modules' optimizers, schedules and masks it may name."""
    if opt.name not in OPTIMIZERS.active(imports):
        raise UserError(
            f"--config.optimizer.name={opt.name!r} {OPTIMIZERS.absent(opt.name, imports)}"
        )
    schedules = SCHEDULES.active(imports)
    schedule_fields = (f for entry in schedules.values() for f in entry.fields)
    known = tuple(dict.fromkeys((*COMMON_FIELDS, *own_field_names(imports), *schedule_fields)))
    for field in opt:
        if field not in known:
            raise UserError(
                f"--config.optimizer.{field}: config.optimizer has no field {field!r}; its "
                f"fields are {', '.join(known)}"
            )
    takes = OPTIMIZERS.active(imports)[opt.name].takes
    for field, value in own_fields(opt, imports).items():
        if field not in takes:
            raise UserError(
                f"--config.optimizer.{field}={value!r}: optimizer {opt.name!r} does not take "
                f"{field}; its own fields are {', '.join(takes)}"
            )
    if not (isinstance(opt.learning_rate, int | float) and 0 < opt.learning_rate < math.inf):
        raise UserError(f"--learning_rate={opt.learning_rate} must be positive (and finite)")
    _number("weight_decay", opt.weight_decay, 0)
    _number("clip_norm", opt.clip_norm, 0)
    for field in FRACTION_FIELDS:
        if opt.get(field) is not None:
            _number(field, opt[field], 0, 1)
    if not isinstance(opt.nesterov, bool):
        raise UserError(f"--config.optimizer.nesterov={opt.nesterov!r} must be True or False")
    if isinstance(opt.accumulate, bool) or not isinstance(opt.accumulate, int):
        raise UserError(f"--config.optimizer.accumulate={opt.accumulate!r} must be a whole number")
    if opt.accumulate < 1:
        raise UserError(f"--config.optimizer.accumulate={opt.accumulate} must be >= 1")
    if opt.schedule not in schedules:
        why = SCHEDULES.absent(opt.schedule, imports)
        raise UserError(f"--config.optimizer.schedule={opt.schedule!r} {why}")
    if isinstance(opt.final_fraction, bool) or not (
        isinstance(opt.final_fraction, int | float) and 0 <= opt.final_fraction <= 1
    ):  # a negative end rate climbs the loss; NaN or inf ends in a non-finite loss
        raise UserError(
            f"--config.optimizer.final_fraction={opt.final_fraction!r} must be in [0, 1] (the "
            "last rate of warmup_cosine or one_cycle, as a fraction of the peak)"
        )
    for field in schedules[opt.schedule].fields:
        if field not in opt:
            raise UserError(
                f"--config.optimizer.schedule={opt.schedule} reads config.optimizer.{field}, "
                "which this config lacks: give it a value in the config's get_config()"
            )
    schedules[opt.schedule].build(opt, steps)  # the schedule's own checks
    if opt.decay_mask not in DECAY_MASKS.active(imports):
        raise UserError(
            f"--config.optimizer.decay_mask={opt.decay_mask!r} "
            f"{DECAY_MASKS.absent(opt.decay_mask, imports)} (the parameters weight decay "
            "applies to)"
        )
    param_groups.check_multipliers(opt.lr_multipliers)
