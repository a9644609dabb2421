"""The command line: flags -> config -> a mode (train, eval, predict, export, benchmark).

Every user mistake, `--config` ones included, exits non-zero with one line.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Sequence

import ml_collections
from absl import app, flags, logging
from ml_collections.config_flags import config_path as config_fields

from fmnist_flax import config as config_lib
from fmnist_flax import datasets, experiment, train
from fmnist_flax.runtime import (
    command_line,
    compilation_cache,
    data_files,
    ensemble,
    errors,
    export,
    inference,
    library_workarounds,
    parallel,
    records,
)
from fmnist_flax.runtime.command_line import exists, fail
from fmnist_flax.runtime.errors import UserError, error_line

DEFAULT_CONFIG = config_lib.__file__  # its get_config(): the codelab's values
# Added to a run whose config.demonstrations is True, while present (delete fmnist_flax/codelab/).
EXTENSIONS = ("fmnist_flax.codelab.demonstrations",)
BENCHMARK_MODULE = "fmnist_flax.codelab.benchmark"  # --mode=benchmark, offered while it exists
BENCHMARK = exists(BENCHMARK_MODULE)
FLAGS = flags.FLAGS
_CONFIG: flags.FlagHolder | None = None  # defined by run(): see define_config_flag
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for the run's outputs; default: a fresh directory under runs/."
)
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache",
    str(data_files.CACHE_ROOT / "jax"),
    "JAX's persistent compilation cache; runs after the first skip most compiling. '' disables.",
)
_MODE = flags.DEFINE_enum(
    "mode",
    "train",
    ["train", "eval", "predict", "export", "prepare", *(["benchmark"] if BENCHMARK else [])],
    "train (resumes from --workdir's checkpoints), eval (the full test set), "
    "predict (classify --images), export (the model as a jax.export artifact, --output), "
    "prepare (write the dataset as record files in --output=DIR)"
    + (" or benchmark (time every training path)." if BENCHMARK else "."),
)
if BENCHMARK:  # its flags exist while the module does
    flags.DEFINE_list("bench_batch_sizes", ["32", "512", "4096"], "benchmark: batch sizes.")
    flags.DEFINE_list("bench_dtypes", ["float32", "bfloat16"], "benchmark: dtypes.")
    flags.DEFINE_integer(
        "bench_steps", None, "benchmark: timed steps per run; default 131072 examples' worth."
    )
    flags.DEFINE_integer("bench_repeats", 3, "benchmark: repeats (median kept).")
    flags.DEFINE_integer(
        "bench_members",
        8,
        "benchmark: members of the ensemble rows (shared and own data); <2 skips.",
    )
    flags.DEFINE_integer(
        "bench_member_shards",
        2,
        "benchmark: also time the ensembles split over this many devices (on a CPU, one "
        "device per core is made for it); 1 skips.",
    )
    flags.DEFINE_integer(
        "bench_whole_run_steps", 400, "benchmark: steps of the whole-run comparison; 0 skips it."
    )
_IMAGES = flags.DEFINE_list(
    "images", [], "predict: pictures (PNG, JPEG, ...) or .npy arrays (H, W[, C]) or (N, H, W[, C])."
)
_OUTPUT = flags.DEFINE_string(
    "output",
    None,
    "eval/predict/benchmark: also write the results to this JSON file; export: the artifact; "
    "prepare: the new directory of record files.",
)
_SHARDS = flags.DEFINE_integer("shards", 4, "prepare: record files per split.")
flags.DEFINE_bool(  # read by errors.debugging() from sys.argv: errors come before parsing
    "debug",
    False,
    f"Print the full traceback above any error line (or set {errors.DEBUG_VARIABLE}=1).",
)
_ACCEPT_CONFIG_CHANGE = flags.DEFINE_bool(
    "accept_config_change",
    False,
    "Resume even though values that change the computation differ from the checkpoint's; "
    "summary.json records each change and its step.",
)
_STEP = flags.DEFINE_string(
    "step",
    None,
    "eval/predict/export: checkpoint step, or 'best' (the best evaluation, kept with "
    "--config.keep_best=True); default the newest.",
)
_MEMBER = flags.DEFINE_string(
    "member",
    None,
    "eval/predict/export of an ensemble run: a member number, 'best' (by test accuracy) or "
    "'ensemble' (the members' mean probabilities, the default).",
)
_EMA = flags.DEFINE_bool(
    "ema",
    False,
    "eval/predict/export: the run's EMA of its parameters instead of the parameters (a run "
    "trained with --config.ema.decay > 0).",
)

# Multi-process runs (jax.distributed): start the same command on every host.
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "Multi-process: host:port of process 0, reachable from all."
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-process: how many in all.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-process: this one's index, 0..N-1.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Multi-process on a cluster JAX detects (SLURM, Open MPI, Kubernetes)."
)
_DISTRIBUTED_TIMEOUT = flags.DEFINE_integer(
    "distributed_timeout", 300, "Multi-process: seconds to wait for every process to join."
)

# Shorthand flags of the design card -> the config field each one overrides.
SHORTHANDS = {
    "compute_dtype": "compute_dtype",
    "steps": "steps",
    "batch_size": "batch_size",
    "learning_rate": "optimizer.learning_rate",
    "seed": "seed",
    "log_every": "log_every",
    "data_dir": "data_dir",
    "checkpoint_every": "checkpoint_every",
    "report": "report",
    "init_from": "init_from",
}
flags.DEFINE_string("compute_dtype", None, "float32 or bfloat16 (params stay float32).")
flags.DEFINE_integer("steps", None, "Number of optimizer updates.")
flags.DEFINE_integer("batch_size", None, "Examples per training and evaluation batch.")
flags.DEFINE_float("learning_rate", None, "The optimizer's (peak) learning rate.")
flags.DEFINE_integer("seed", None, "Seed for the data shuffle and parameter init.")
flags.DEFINE_integer("log_every", None, "Pull metrics to the host every this many steps.")
flags.DEFINE_string("data_dir", None, "Directory holding the dataset's files.")
flags.DEFINE_integer("checkpoint_every", None, "Save a checkpoint every this many steps.")
flags.DEFINE_string("report", None, "full | basic (skip the timing comparisons) | none.")
flags.DEFINE_string(
    "init_from",
    None,
    "Start from another run's model: WORKDIR or WORKDIR:STEP (fine-tuning); an ensemble's "
    "member with @K or @best (WORKDIR:STEP@K).",
)


# The flags each mode reads, besides EVERY_MODE's; any other given is refused in one line.
# A mode marked in CONFIG_MODES also takes --config.FIELD overrides; the others read the run's
# saved config and take only --config.imports (the modules a checkpoint needs).
EVERY_MODE = (
    "mode",
    "config",
    "debug",
    "compilation_cache",
    "coordinator_address",
    "num_processes",
    "process_id",
    "distributed",
    "distributed_timeout",
)
INFERENCE = ("workdir", "step", "compute_dtype", "output", "member", "ema")
MODE_FLAGS = {
    "train": ("workdir", *SHORTHANDS, "accept_config_change"),
    "eval": (*INFERENCE, "data_dir"),
    "predict": (*INFERENCE, "images"),
    "export": INFERENCE,
    "prepare": ("output", "shards", "data_dir"),
    "benchmark": (*SHORTHANDS, "output", *(f for f in FLAGS if f.startswith("bench_"))),
}
CONFIG_MODES = ("train", "prepare", "benchmark")
USAGE = "python main.py [--mode=MODE] [--FLAG=VALUE ...] [--config.FIELD=VALUE ...]"
EXAMPLES = (
    "python main.py --steps=400 --compute_dtype=bfloat16",
    "python main.py --config=configs/mlp_best.py --workdir=runs/best",
    "python main.py --mode=predict --workdir=runs/best --images=examples/shoe.png",
)


def check_mode_flags(argv: Sequence[str], mode: str) -> None:
    """Refuse, in one line, a flag of this module or a --config.FIELD that `mode` does not
    read (`command_line.check_mode_flags`)."""
    given = [f.name for f in FLAGS.get_key_flags_for_module(__name__) if FLAGS[f.name].present]
    command_line.check_mode_flags(
        argv, mode, given, MODE_FLAGS, EVERY_MODE, config_fields_too=mode in CONFIG_MODES
    )


def help_text() -> str:
    """--help: a usage line, examples, then each mode's flags with their defaults (the
    training shorthands' from the default config)."""
    config = config_lib.get_config()
    defaults = {name: config_fields.get_value(field, config) for name, field in SHORTHANDS.items()}
    sections = {
        "train (the default mode; resumes from --workdir's checkpoints)": MODE_FLAGS["train"],
        "eval, predict, export (a trained --workdir)": (*INFERENCE, "images", "data_dir"),
        "prepare (the dataset as record files)": ("output", "shards"),
        **(
            {"benchmark (time every training path)": MODE_FLAGS["benchmark"][len(SHORTHANDS) :]}
            if BENCHMARK
            else {}
        ),
        "every mode": EVERY_MODE,
    }
    return command_line.help_text(USAGE, EXAMPLES, sections, defaults)


def parse_flags(argv: Sequence[str]) -> list[str]:
    """absl's parser, with --help listing this project's flags and every mistake in one line."""
    return command_line.parse_flags(
        argv,
        help_text,
        _CONFIG,
        DEFAULT_CONFIG,
        check_mode=lambda: check_mode_flags(argv, _MODE.value),
        refused={  # --mode=benchmark, only while it is not a mode
            "flag --mode=benchmark:": "--mode=benchmark: the benchmark was removed with "
            "fmnist_flax/codelab/"
        },
    )


def main(argv: Sequence[str]) -> None:
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # keep JAX's start-up INFO lines out of the tables
    if len(argv) > 1:
        fail(f"unexpected arguments {' '.join(argv[1:])}; flags look like --steps=400", 2)
    config = _CONFIG.value
    shorthands = {flag: flags.FLAGS[flag].value for flag in SHORTHANDS}
    config.update_from_flattened_dict(
        {SHORTHANDS[flag]: value for flag, value in shorthands.items() if value is not None}
    )
    errors.stop_raises()  # until here, launch answered signals with its one line
    with command_line.one_line_errors():
        if _COMPILATION_CACHE.value:
            compilation_cache.use(_COMPILATION_CACHE.value)
        parallel.make_cpu_devices(member_devices(_MODE.value, config))
        library_workarounds.serial_cpu_dispatch(config.mesh.model)
        parallel.initialize(
            _COORDINATOR.value,
            _NUM_PROCESSES.value,
            _PROCESS_ID.value,
            auto=_DISTRIBUTED.value,
            timeout_s=_DISTRIBUTED_TIMEOUT.value,
        )
        if _MODE.value == "train":
            train.train_and_evaluate(
                config,
                _WORKDIR.value,
                extensions(config),
                accept_config_change=_ACCEPT_CONFIG_CHANGE.value,
            )
        else:
            run_mode(_MODE.value, config)


def member_devices(mode: str, config: ml_collections.ConfigDict) -> int:
    """The devices a single-process run splits an ensemble's members over (made on a CPU):
    --config.ensemble.shards to train, --bench_member_shards to benchmark; else 1."""
    if _COORDINATOR.value or _DISTRIBUTED.value:  # each process keeps the devices it has
        return 1
    if mode == "benchmark":
        return FLAGS.bench_member_shards
    shards = config.ensemble.shards if mode == "train" else 1
    return shards if isinstance(shards, int) else 1  # validate() explains a bad one


def run_mode(mode: str, config: ml_collections.ConfigDict) -> None:
    """Every mode but training: benchmark, prepare, evaluate, predict or export. The modules of
    the command line's config.imports come first: a run's checkpoints may need them."""
    config_lib.import_modules(config.imports)
    if mode == "benchmark":
        return run_benchmark(config)
    if mode == "prepare":
        return prepare(config)
    if not _WORKDIR.value:
        raise UserError(f"--mode={mode} needs --workdir=DIR of a training run")
    # What eval, predict and export read of the run: which step, member and parameters.
    chosen = {
        "step": command_line.step_flag(_STEP.value),
        "compute_dtype": flags.FLAGS.compute_dtype,
        "member": ensemble.parse_member(_MEMBER.value),
        "ema": _EMA.value,
    }
    if mode == "eval":
        inference.run_eval(
            _WORKDIR.value, data_dir=flags.FLAGS.data_dir, output=_OUTPUT.value, **chosen
        )
    elif mode == "export":
        meta = export.export_model(_WORKDIR.value, _OUTPUT.value, **chosen)
        parallel.say(
            f"wrote {_OUTPUT.value} (step {meta['source']['step']}, for "
            f"{', '.join(meta['platforms'])}) and {_OUTPUT.value}{export.METADATA_SUFFIX}"
        )
    else:
        _, errors = inference.run_predict(
            _WORKDIR.value, _IMAGES.value, output=_OUTPUT.value, **chosen
        )
        for line in errors:
            error_line(line)
        if errors:
            sys.exit(1)


def prepare(config: ml_collections.ConfigDict) -> None:
    """--mode=prepare: the config's dataset as record files in --output (runtime/records.py)."""
    load = functools.partial(datasets.load, config)
    records.prepare(config.dataset.name, load, _OUTPUT.value, _SHARDS.value)


def run_benchmark(config: ml_collections.ConfigDict) -> None:
    benchmark = importlib.import_module(BENCHMARK_MODULE)  # the training path never imports it
    try:
        batch_sizes = [int(b) for b in FLAGS.bench_batch_sizes]
    except ValueError:
        raise UserError(
            f"--bench_batch_sizes={','.join(FLAGS.bench_batch_sizes)}: whole numbers"
        ) from None
    benchmark.run_benchmark(
        config,
        batch_sizes=batch_sizes,
        dtypes=FLAGS.bench_dtypes,
        steps=FLAGS.bench_steps,
        repeats=FLAGS.bench_repeats,
        whole_run_steps=FLAGS.bench_whole_run_steps,
        members=FLAGS.bench_members,
        member_shards=FLAGS.bench_member_shards,
        output=_OUTPUT.value,
    )


def extensions(config: ml_collections.ConfigDict) -> list[experiment.Extension]:
    """One instance of each extension module in EXTENSIONS that exists (its `EXTENSION`), when
    `config.demonstrations` asks for them; none otherwise."""
    if config.demonstrations is not True:
        return []
    return [importlib.import_module(name).EXTENSION for name in EXTENSIONS if exists(name)]


def define_config_flag() -> None:
    """`--config`, defined when the CLI runs (`command_line.define_config_flag`)."""
    global _CONFIG
    _CONFIG = command_line.define_config_flag(DEFAULT_CONFIG)


def run() -> None:
    """Entry point of `main.py`, `python -m fmnist_flax` and the `fmnist-flax` script."""
    library_workarounds.install()
    define_config_flag()
    try:
        app.run(main, flags_parser=parse_flags)
    except SystemExit as done:  # success or one of our error lines: no teardown to wait for
        status = 0 if done.code is None else done.code
        if isinstance(status, int):
            library_workarounds.exit_after_hooks(status)
        raise
