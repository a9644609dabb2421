"""The generic fields of a run's config: their checks (`check_fields`, `check_parts`), a saved
config completed with today's defaults (`with_defaults`), and which changes a resume may make
(`training_changes`, `check_changes`).
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Sequence
from typing import Any

import ml_collections
import numpy as np

from . import data_files, ema, ensemble, optimizers, plugins
from .checkpoint import Checkpoints
from .errors import UserError, is_whole
from .parallel import PARAM_SHARDINGS, check_mesh_config
from .registry import Registry

REPORT_CHOICES = ("full", "basic", "none")
INPUT_PIPELINES = ("device", "grain")
MAX_COUNT = 2**31 - 1  # the optimizer's step counter is an int32
MAX_SEED = 2**32 - 1  # seeds become uint32 PRNG key data
POSITIVE_FIELDS = ("steps", "batch_size", "log_every", "checkpoint_every", "max_to_keep")


def _one_of(flag: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"{flag}={value!r} is not one of {', '.join(choices)}")


def _whole(value: object, least: int, most: int) -> bool:
    """A whole number in least..most; `True` is not one (a config file's `steps = True`)."""
    return is_whole(value, least) and value <= most


def check_fields(config: ml_collections.ConfigDict, compute_dtypes: tuple[str, ...]) -> None:
    """Raise UserError naming the first of the run's own fields whose value cannot work;
    `compute_dtypes`: what --compute_dtype may name."""
    _one_of("--compute_dtype", config.compute_dtype, compute_dtypes)
    _one_of("--report", config.report, REPORT_CHOICES)
    _one_of("--config.param_sharding", config.param_sharding, PARAM_SHARDINGS)
    check_mesh_config(config.mesh)
    _one_of("--config.input_pipeline", config.input_pipeline, INPUT_PIPELINES)
    for name in POSITIVE_FIELDS:
        if not _whole(config[name], 1, MAX_COUNT):
            raise UserError(f"--{name}={config[name]} must be a whole number in 1..{MAX_COUNT:,}")
    if not 0 <= config.checkpoint_min_interval_secs < MAX_COUNT:
        raise UserError(
            f"--config.checkpoint_min_interval_secs={config.checkpoint_min_interval_secs} must "
            "be a number of seconds >= 0 (0: save every --checkpoint_every steps)"
        )
    if not _whole(config.eval_examples, 0, MAX_COUNT):
        raise UserError(
            f"--config.eval_examples={config.eval_examples} must be 0 (the whole test set) or a "
            "number of examples"
        )
    if not _whole(config.eval_every, 0, MAX_COUNT):
        raise UserError(
            f"--config.eval_every={config.eval_every} must be 0 (each epoch) or a number of steps"
        )
    if not _whole(config.seed, 0, MAX_SEED):
        raise UserError(f"--seed={config.seed} must be a whole number in 0..{MAX_SEED:,}")


def check_best_metric(
    config: ml_collections.ConfigDict,
    built_in: Sequence[str],
    registries: Sequence[Registry],
    hooked: bool = True,
) -> None:
    """Refuse, in one line before training, a `config.best_metric` no evaluation will have:
    a test_ name that is none of the evaluation's (`built_in` metrics and those of
    `registries` the run imports, as test_, test_ema_ with an EMA, and its test_set_metrics,
    a per-class one as test_<name>_<k>), or another name that an after-evaluation hook could
    not add (`plugins.name_problem`), or could but the run has none (not `hooked`)."""
    name = config.best_metric
    computed = [*built_in, *(n for registry in registries for n in registry.active(config.imports))]
    names = [*computed, *config.test_set_metrics, *(f"{n}_<k>" for n in config.test_set_metrics)]
    prefixes = (plugins.TEST_PREFIX, *([ema.TEST_PREFIX] if config.ema.decay else []))
    known = [prefix + n for prefix in prefixes for n in names]
    per_class = re.fullmatch(r"(.*_)\d+", name) if isinstance(name, str) else None
    if name in known or (per_class and f"{per_class[1]}<k>" in known):
        return
    hook_value = isinstance(name, str) and not name.startswith(plugins.TEST_PREFIX)
    if not hooked or not hook_value or plugins.name_problem(name, computed):
        raise UserError(
            f"--config.best_metric={name!r} is not a metric of an evaluation during training; "
            f"name one of {', '.join(known)}, or a value an after-evaluation hook of the run's "
            "config.imports adds (e.g. val_accuracy)"
        )


def check_parts(config: ml_collections.ConfigDict) -> None:
    """Raise UserError naming the first field of the loss, the Grain pipeline, augmentation,
    the ensemble or the EMA whose value cannot work; after the optimizer's check (an
    ensemble's rates need a valid schedule)."""
    if not 0 <= config.label_smoothing < 1:
        raise UserError(f"--config.label_smoothing={config.label_smoothing} must be in [0, 1)")
    for name, least in (("workers", 0), ("block_examples", 1), ("prefetch", 1)):
        if not _whole(config.grain[name], least, MAX_COUNT):
            raise UserError(
                f"--config.grain.{name}={config.grain[name]} must be a whole number >= {least}"
            )
    if config.augment.max_shift < 0:
        raise UserError(f"--config.augment.max_shift={config.augment.max_shift} must be >= 0")
    ensemble.check_config(config, MAX_SEED)
    decay = config.ema.decay
    if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0 <= decay < 1:
        raise UserError(
            f"--config.ema.decay={decay!r} must be a number in [0, 1): 0 keeps no average, "
            "e.g. 0.999 averages over about the last 1,000 updates"
        )
    if decay and float(np.float32(decay)) == 1.0:  # the average is kept in float32
        raise UserError(
            f"--config.ema.decay={decay!r} is 1.0 in float32, where the average is kept, so it "
            "would never move; use at most 0.9999999 (e.g. 0.999)"
        )


# Fields a resumed run may change without changing what it computes.
RESUMABLE_FIELDS = (
    "steps",
    "log_every",
    "checkpoint_every",
    "checkpoint_min_interval_secs",
    "eval_every",
    "keep_best",
    "best_metric",
    "max_to_keep",
    "report",
    "demonstrations",
    "data_dir",
    "fused_steps",
    "param_sharding",
    "eval_examples",
    "test_set_metrics",
    "init_from",
    "ensemble.shards",
    "ensemble.members_per_pass",
    "mesh.data",
    "mesh.model",
    "mesh.rules",
    "grain.workers",
    "grain.block_examples",
    "grain.prefetch",
)


# Fields that move the data position a checkpoint saves: a resume cannot change them.
POSITION_FIELDS = (
    "batch_size",
    "seed",
    "optimizer.accumulate",
    "dataset.examples",
    "ensemble.size",
    "ensemble.same_data",
)


def fixed_on_resume(change: dict[str, Any]) -> bool:
    """Whether a resume cannot accept `change` (`training_changes`' item): it moves the data
    position, or turns the EMA on or off (the checkpoint holds no average, or the model none)."""
    if change["field"] == "ema.decay":
        return bool(change["saved"]) != bool(change["now"])
    return change["field"] in POSITION_FIELDS


# Fields that live in the optimizer's state: an accepted change starts the optimizer afresh.
OPTIMIZER_FIELDS = ("optimizer.", "ensemble.learning_rate", "ensemble.weight_decay")


def with_defaults(saved: dict[str, Any], defaults: dict[str, Any]) -> ml_collections.ConfigDict:
    """A saved config, with each field added since it was saved at its value in `defaults`
    (defaults keep the behaviour of the runs before them). The model's fields are the saved
    model's own."""
    merged = copy.deepcopy(defaults)

    def fill(into: dict[str, Any], values: dict[str, Any]) -> None:
        for key, value in values.items():
            if isinstance(value, dict) and isinstance(into.get(key), dict) and key != "model":
                fill(into[key], value)
            else:
                into[key] = value

    fill(merged, saved)
    return ml_collections.ConfigDict(merged)


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:  # through JSON, as the checkpoint stores it: tuples become lists
            flat[f"{prefix}{key}"] = json.loads(json.dumps(value))
    return flat


def training_changes(
    saved: dict[str, Any], now: dict[str, Any], defaults: dict[str, Any]
) -> list[dict[str, Any]]:
    """The fields whose new value would change what a resumed run computes: every field but
    RESUMABLE_FIELDS, and `steps` too under a schedule that decays over it. `saved` is
    completed with `defaults` first (`with_defaults`)."""
    before, after = _flatten(with_defaults(saved, defaults).to_dict()), _flatten(now)
    decays = any(
        optimizers.over_steps(c.get("optimizer.schedule"), c.get("imports") or ())
        for c in (before, after)
    )
    free = set(RESUMABLE_FIELDS) - ({"steps"} if decays else set())
    return [
        {"field": key, "saved": before.get(key), "now": after.get(key)}
        for key in sorted(before.keys() | after.keys())
        if key not in free and before.get(key) != after.get(key)
    ]


def check_changes(
    checkpoints: Checkpoints,
    config: ml_collections.ConfigDict,
    dataset_info: dict[str, Any],
    accept: bool,
    defaults: dict[str, Any],
) -> list[dict[str, Any]]:
    """Refuse to resume with values (or data, `dataset_info`) that change what the run
    computes, in one line naming each; with `accept`, return them (with the earlier accepted
    ones) for the record. Values that move the data position (the batch, the seed, the train
    set's size) cannot be accepted: the saved position would not mean the same examples."""
    step, saved = checkpoints.saved("config")
    if saved is None:
        return []
    earlier = checkpoints.saved("changes", step)[1] or {"changes": []}
    changes = training_changes(saved, config.to_dict(), defaults)
    changes += data_files.identity_changes(
        checkpoints.saved("dataset", step)[1] or {}, dataset_info
    )
    fixed = [c for c in changes if fixed_on_resume(c)]
    if changes and (fixed or not accept):
        listed = ", ".join(f"{c['field']} {c['saved']!r} -> {c['now']!r}" for c in fixed or changes)
        way = "" if fixed else ", or pass --accept_config_change to go on with the new ones"
        raise UserError(
            f"{checkpoints.directory} holds step {step} trained with other values: {listed}; "
            f"resume with the saved values (and data) or pass a new --workdir{way}"
            + (" (summary.json records them)" if way else "")
        )
    return earlier["changes"] + [{"step": step, **c} for c in changes]
