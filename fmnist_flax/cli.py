"""The command line: flags -> config -> a mode (train, eval, predict, export, benchmark).

Every user mistake, `--config` ones included, exits non-zero with one line.
"""

from __future__ import annotations

import functools
import importlib
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
    errors,
    library_workarounds,
    parallel,
    records,
)
from fmnist_flax.runtime.command_line import exists, fail

DEFAULT_CONFIG = config_lib.__file__  # its get_config(): the codelab's values
# Added to a run whose config.demonstrations is True, while present (delete fmnist_flax/codelab/).
EXTENSIONS = ("fmnist_flax.codelab.demonstrations",)
BENCHMARK_MODULE = "fmnist_flax.codelab.benchmark"  # --mode=benchmark, offered while it exists
BENCHMARK = exists(BENCHMARK_MODULE)
FLAGS = flags.FLAGS
_CONFIG: flags.FlagHolder | None = None  # defined by run(): see define_config_flag
_STARTED: float | None = None  # when the command started (run's `started`)
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
if BENCHMARK:  # its flags exist while the codelab does
    importlib.import_module("fmnist_flax.codelab.benchmark_flags")
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

command_line.define_inference_flags()
command_line.define_multiprocess_flags()

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
    *command_line.MULTIPROCESS_FLAGS,
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
USAGE = "python main.py [--mode=MODE] [--FLAG=VALUE]... [--config.FIELD=VALUE]..."
EXAMPLES = (
    "python main.py --steps=400 --compute_dtype=bfloat16",
    "python main.py --config=configs/mlp_best.py --workdir=runs/best",
    "python main.py --mode=predict --workdir=runs/best --images=examples/shoe.png",
)


def check_mode_flags(argv: Sequence[str], mode: str) -> None:
    """Refuse, in one line, a flag of a mode or a --config.FIELD that `mode` does not read
    (`command_line.check_mode_flags`)."""
    known = dict.fromkeys([*EVERY_MODE, *(f for names in MODE_FLAGS.values() for f in names)])
    given = [name for name in known if name in FLAGS and FLAGS[name].present]
    command_line.check_mode_flags(
        argv, mode, given, MODE_FLAGS, EVERY_MODE, config_fields_too=mode in CONFIG_MODES
    )


def help_text() -> str:
    """--help: a usage line, examples, each mode's flags with their defaults (the training
    shorthands' from the default config), then the default config's fields as flags."""
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
    return command_line.help_text(USAGE, EXAMPLES, sections, defaults, config)


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
        command_line.start_processes()
        if _MODE.value == "train":
            train.train_and_evaluate(
                config,
                _WORKDIR.value,
                extensions(config),
                accept_config_change=_ACCEPT_CONFIG_CHANGE.value,
                started=_STARTED,
            )
        else:
            run_mode(_MODE.value, config)


def member_devices(mode: str, config: ml_collections.ConfigDict) -> int:
    """The devices a single-process run splits an ensemble's members over (made on a CPU):
    --config.ensemble.shards to train, --bench_member_shards to benchmark; else 1."""
    if command_line.multiprocess():  # each process keeps the devices it has
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
    command_line.run_inference(mode, _WORKDIR.value, _OUTPUT.value)


def prepare(config: ml_collections.ConfigDict) -> None:
    """--mode=prepare: the config's dataset as record files in --output (runtime/records.py)."""
    load = functools.partial(datasets.load, config)
    records.prepare(config.dataset.name, load, _OUTPUT.value, _SHARDS.value)


def run_benchmark(config: ml_collections.ConfigDict) -> None:
    """--mode=benchmark, with its --bench_* flags (the codelab's)."""
    options = importlib.import_module("fmnist_flax.codelab.benchmark_flags").options()
    importlib.import_module(BENCHMARK_MODULE).run_benchmark(config, **options, output=_OUTPUT.value)


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


def run(started: float | None = None) -> None:
    """Entry point of `main.py`, `python -m fmnist_flax` and the `fmnist-flax` script;
    `started`: the time.perf_counter() reading at the command's start."""
    global _STARTED
    _STARTED = started
    library_workarounds.install()
    define_config_flag()
    try:
        app.run(main, flags_parser=parse_flags)
    except SystemExit as done:  # success or one of our error lines: no teardown to wait for
        status = 0 if done.code is None else done.code
        if isinstance(status, int):
            library_workarounds.exit_after_hooks(status)
        raise
