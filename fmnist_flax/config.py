"""The default config (the codelab's values) and the checks of its generic fields.

This file is also the `--config` default: `get_config()` below is loaded by path like any
`configs/*.py`, so the installed package runs from any directory. Model fields are checked by
the model itself (`model.check_config`), optimizer fields by `optimizer.check_config`, dataset
fields by `datasets.get`.
"""

from __future__ import annotations

import json
from typing import Any

import ml_collections
import numpy as np
from ml_collections import config_dict

from fmnist_flax import optimizer, task
from fmnist_flax.model import COMPUTE_DTYPES
from fmnist_flax.runtime import ensemble as ensemble_lib
from fmnist_flax.runtime import grain_pipeline
from fmnist_flax.runtime.errors import UserError, is_whole
from fmnist_flax.runtime.parallel import PARAM_SHARDINGS, check_mesh_config
from fmnist_flax.runtime.plugins import import_modules

REPORT_CHOICES = ("full", "basic", "none")
INPUT_PIPELINES = ("device", "grain")
MAX_COUNT = 2**31 - 1  # the optimizer's step counter is an int32
MAX_SEED = 2**32 - 1  # seeds become uint32 PRNG key data
POSITIVE_FIELDS = ("steps", "batch_size", "log_every", "checkpoint_every", "max_to_keep")


def get_config() -> ml_collections.ConfigDict:
    """The codelab's run: MLP 784-256-128-10, AdamW(3e-3, wd 1e-4), batch 512, 400 steps."""
    config = ml_collections.ConfigDict()
    config.seed = 0  # data shuffle and parameter init
    # Modules of your project imported before anything else is checked (e.g. ("my_models",)):
    # what they register (models, datasets, optimizers, schedules, metrics) is then usable here,
    # with no edit to the template. Saved with the run; eval, predict and export import those
    # installed, never a file of the workdir or the current directory (docs/checkpoints.md).
    config.imports = ()
    config.dataset = ml_collections.ConfigDict()
    # fashion_mnist | mnist | idx (any four IDX files) | arrays (train.npz, test.npz): any
    # name registered in fmnist_flax/datasets.py
    config.dataset.name = "fashion_mnist"
    config.data_dir = ""  # "": the dataset's cache, system directory, then download
    config.batch_size = 512  # train and evaluation batches; every step has this shape
    # device: the train set on every device, batches gathered in the step (fastest when it
    # fits); grain: read on the host by Grain (config.grain), each process reading its share
    config.input_pipeline = "device"
    config.grain = grain_pipeline.default_config()  # its fields: runtime/grain_pipeline.py
    config.steps = 400  # optimizer updates; every epoch visits the train set in a fresh order
    config.log_every = 25  # metrics reach the host only at these steps (and the first and last)
    config.compute_dtype = "float32"  # float32 | bfloat16; params always stay float32
    config.checkpoint_every = 100  # Orbax saves every this many steps, at the end and on SIGTERM
    # ...but a due save is skipped while the last one is still being written or began less than
    # this many seconds ago (Orbax's ContinuousCheckpointingPolicy): a kill loses at most this (or
    # the last save's writing time), `checkpoint_every` steps and the save in progress' writing
    # time. 0: every `checkpoint_every` steps.
    config.checkpoint_min_interval_secs = 10.0
    config.eval_every = 0  # test-set evaluation every this many steps (0: each epoch's end)
    config.eval_examples = 0  # evaluate on the first this many test examples (0: all of them)
    config.keep_best = False  # also keep the best evaluation's checkpoint (--step=best)
    config.best_metric = "test_accuracy"  # what keep_best ranks by, higher better: val_accuracy
    config.max_to_keep = 3  # newest checkpoints kept in <workdir>/checkpoints
    config.fused_steps = True  # several steps per compiled call (False: one step per call)
    config.label_smoothing = 0.0  # optax.smooth_labels on the one-hot targets when > 0
    # Metrics of the whole test set's predictions beside the per-example ones, by name in
    # task.TEST_SET_METRICS, e.g. ("macro_f1", "class_accuracy"); () adds none
    config.test_set_metrics = ()
    # Start from another run's model (WORKDIR[:STEP][@MEMBER], STEP a number or `best`): its
    # parameters, a fresh optimizer. Used only when the run starts, not when it resumes.
    config.init_from = ""
    config.augment = ml_collections.ConfigDict()
    config.augment.max_shift = 0  # random shifts of up to this many pixels, on the device
    config.augment.flip = False  # random left-right mirroring, on the device
    config.report = "full"  # full | basic (no extra timing comparisons) | none (no report/)
    # The codelab's demonstrations (gradient check, dispatch vs jit, float32 vs bfloat16,
    # tokens/sec, the whole-batches test row): True in the codelab's configs, False in a
    # project's. Ignored once fmnist_flax/codelab/ is deleted.
    config.demonstrations = True
    config.param_sharding = "replicated"  # replicated | fsdp (split over the `data` mesh axis)
    config.mesh = ml_collections.ConfigDict()
    # Devices each annotated parameter is split over: a `model` mesh axis beside `data` (1: none)
    config.mesh.model = 1
    config.mesh.data = 0  # devices each batch is split over; 0: all those left
    # Logical axis names of annotated parameters (nnx.with_partitioning) -> mesh axis: `model`,
    # `data` or None (replicated); a name left out, or an axis the mesh lacks, is replicated.
    config.mesh.rules = (("mlp", "model"), ("embed", None), ("classes", None))

    config.model = ml_collections.ConfigDict()
    config.model.name = "mlp"  # a key of fmnist_flax.model.MODELS; the other fields are its args
    config.model.hidden = (256, 128)  # hidden layer widths between the pixels and the classes

    config.optimizer = ml_collections.ConfigDict()
    config.optimizer.name = "adamw"  # adamw | adam | sgd | lion | adafactor (optimizer.py)
    config.optimizer.learning_rate = 3e-3  # the peak rate under a schedule
    # Decoupled (adamw, lion, adafactor) or added to the gradient as L2 (adam, sgd).
    config.optimizer.weight_decay = 1e-4
    # all | kernels (dense and convolution weights only: no biases, no normalisation scales)
    config.optimizer.decay_mask = "all"
    # (pattern, multiplier) pairs: a parameter's updates (its rate) times the multiplier of the
    # first pattern found in its name, e.g. (("head", 0.1), ("bias", 2.0)); () leaves them be.
    config.optimizer.lr_multipliers = ()
    # Each optimizer's own fields; None: Optax's default (see optimizer.OPTIMIZERS).
    config.optimizer.momentum = config_dict.placeholder(float)  # sgd, adafactor
    config.optimizer.nesterov = False  # sgd, adam, adamw
    config.optimizer.b1 = config_dict.placeholder(float)  # adam, adamw, lion
    config.optimizer.b2 = config_dict.placeholder(float)  # adam, adamw, lion
    config.optimizer.clip_norm = 0.0  # clip the gradient's global L2 norm to this (0: never)
    # Gradient accumulation: each update averages the gradients of this many batches of
    # batch_size (one update per accumulate x batch_size examples); steps count updates.
    config.optimizer.accumulate = 1
    # constant | warmup_cosine | one_cycle (both decay over `steps`) | warmup_rsqrt (the
    # rate falls as 1/sqrt(step) after the warm-up), or any in optimizer.SCHEDULES
    config.optimizer.schedule = "constant"
    config.optimizer.warmup_steps = 0  # linear warm-up from 0 to the peak over these steps
    # warmup_cosine, one_cycle: the last rate, as a fraction of the peak
    config.optimizer.final_fraction = 0.01
    config.ensemble = ensemble_lib.default_config()  # its fields: runtime/ensemble.py
    config.ema = ml_collections.ConfigDict()
    # An exponential moving average of the parameters, updated after each step, evaluated
    # beside them (test_ema_*) and picked by --ema in eval, predict and export; e.g. 0.999
    # averages over about the last 1,000 updates. 0: none kept.
    config.ema.decay = 0.0
    return config


def _one_of(flag: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"{flag}={value!r} is not one of {', '.join(choices)}")


def _whole(value: object, least: int, most: int) -> bool:
    """A whole number in least..most; `True` is not one (a config file's `steps = True`)."""
    return is_whole(value, least) and value <= most


def validate(config: ml_collections.ConfigDict) -> None:
    """Raise UserError naming the first generic field whose value cannot work."""
    import_modules(config.imports)
    _one_of("--compute_dtype", config.compute_dtype, tuple(COMPUTE_DTYPES))
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
    optimizer.check_config(config.optimizer, config.steps)
    if not 0 <= config.label_smoothing < 1:
        raise UserError(f"--config.label_smoothing={config.label_smoothing} must be in [0, 1)")
    task.check_test_set_metrics(config.test_set_metrics)
    for name, least in (("workers", 0), ("block_examples", 1), ("prefetch", 1)):
        if not _whole(config.grain[name], least, MAX_COUNT):
            raise UserError(
                f"--config.grain.{name}={config.grain[name]} must be a whole number >= {least}"
            )
    if config.augment.max_shift < 0:
        raise UserError(f"--config.augment.max_shift={config.augment.max_shift} must be >= 0")
    ensemble_lib.check_config(config, MAX_SEED)
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


def with_defaults(saved: dict[str, Any]) -> ml_collections.ConfigDict:
    """A saved config, with each field added since it was saved at its default (defaults keep
    the behaviour of the runs before them). The model's fields are the saved model's own."""
    merged = get_config().to_dict()

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


def training_changes(saved: dict[str, Any], now: dict[str, Any]) -> list[dict[str, Any]]:
    """The fields whose new value would change what a resumed run computes: every field but
    RESUMABLE_FIELDS, and `steps` too under a schedule that decays over it."""
    before, after = _flatten(with_defaults(saved).to_dict()), _flatten(now)
    decays = any(optimizer.over_steps(c.get("optimizer.schedule")) for c in (before, after))
    free = set(RESUMABLE_FIELDS) - ({"steps"} if decays else set())
    return [
        {"field": key, "saved": before.get(key), "now": after.get(key)}
        for key in sorted(before.keys() | after.keys())
        if key not in free and before.get(key) != after.get(key)
    ]
