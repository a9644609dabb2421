"""The default config (the codelab's values), and the checks of every field.

This file is also the `--config` default: `get_config()` below is loaded by path like any
`configs/*.py`, so the installed package runs from any directory. Generic fields are checked by
`runtime/run_config.py`, model fields by the model itself (`model.check_config`), optimizer
fields by `optimizer.check_config`, dataset fields by `datasets.get`.
"""

from __future__ import annotations

from typing import Any

import ml_collections
from ml_collections import config_dict

from fmnist_flax import optimizer, task
from fmnist_flax.model import COMPUTE_DTYPES
from fmnist_flax.runtime import ensemble as ensemble_lib
from fmnist_flax.runtime import grain_pipeline, run_config
from fmnist_flax.runtime.plugins import import_modules as import_modules
from fmnist_flax.runtime.run_config import OPTIMIZER_FIELDS as OPTIMIZER_FIELDS


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
    config.best_metric = "test_accuracy"  # keep_best ranks by it: *loss lowest first, else highest
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


def validate(config: ml_collections.ConfigDict) -> None:
    """Raise UserError naming the first field whose value cannot work, once the modules of
    `config.imports` are imported: the generic fields are `runtime/run_config.py`'s."""
    import_modules(config.imports)
    run_config.check_fields(config, tuple(COMPUTE_DTYPES))
    optimizer.check_config(config.optimizer, config.steps, config.imports)
    task.check_test_set_metrics(config)
    run_config.check_best_metric(config, task.BUILT_IN, (task.LOSS_TERMS, task.METRICS))
    run_config.check_parts(config)


def with_defaults(saved: dict[str, Any]) -> ml_collections.ConfigDict:
    """A saved config, with each field added since it was saved at its default here."""
    return run_config.with_defaults(saved, get_config().to_dict())
