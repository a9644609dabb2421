"""The command line: flags -> config -> `train_and_evaluate`; user mistakes exit with one line."""

from __future__ import annotations

import os
import pathlib
import sys
from collections.abc import Sequence

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from fmnist_flax import benchmark, data, inference, parallel, train
from fmnist_flax.errors import UserError, error_line

DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parents[1] / "configs" / "default.py"

_CONFIG = config_flags.DEFINE_config_file(
    "config", str(DEFAULT_CONFIG), "Config file; override fields with --config.FIELD=VALUE."
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for the run's outputs; default: a fresh directory under runs/."
)
_COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache",
    str(data.CACHE_DIR / "jax"),
    "JAX's persistent compilation cache; runs after the first skip most compiling. '' disables.",
)
_MODE = flags.DEFINE_enum(
    "mode",
    "train",
    ["train", "eval", "predict", "benchmark"],
    "train (resumes from --workdir's checkpoints), eval (full test set -> eval.json), "
    "predict (classify --images) or benchmark (time every training path).",
)
_BENCH_BATCH_SIZES = flags.DEFINE_list(
    "bench_batch_sizes", ["32", "512", "4096"], "benchmark: batch sizes."
)
_BENCH_DTYPES = flags.DEFINE_list("bench_dtypes", ["float32", "bfloat16"], "benchmark: dtypes.")
_BENCH_STEPS = flags.DEFINE_integer(
    "bench_steps", None, "benchmark: timed steps per run; default 131072 examples' worth."
)
_BENCH_REPEATS = flags.DEFINE_integer("bench_repeats", 3, "benchmark: repeats (median kept).")
_BENCH_WHOLE_RUN_STEPS = flags.DEFINE_integer(
    "bench_whole_run_steps", 400, "benchmark: steps of the whole-run comparison; 0 skips it."
)
_IMAGES = flags.DEFINE_list("images", [], "predict: PNG files or .npy arrays (28x28 or Nx28x28).")
_OUTPUT = flags.DEFINE_string("output", None, "predict/benchmark: also write the results as JSON.")
_STEP = flags.DEFINE_integer("step", None, "eval/predict: checkpoint step; default the newest.")

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
}
flags.DEFINE_string("compute_dtype", None, "float32 or bfloat16 (params stay float32).")
flags.DEFINE_integer("steps", None, "Number of optimizer updates.")
flags.DEFINE_integer("batch_size", None, "Examples per training and evaluation batch.")
flags.DEFINE_float("learning_rate", None, "AdamW learning rate.")
flags.DEFINE_integer("seed", None, "Seed for the data shuffle and parameter init.")
flags.DEFINE_integer("log_every", None, "Pull metrics to the host every this many steps.")
flags.DEFINE_string("data_dir", None, "Directory holding the four Fashion-MNIST .gz files.")
flags.DEFINE_integer("checkpoint_every", None, "Save a checkpoint every this many steps.")
flags.DEFINE_string("report", None, "full | basic (skip the timing comparisons) | none.")


def fail(message: str, code: int) -> None:
    error_line(message)
    if jax.process_count() > 1:
        # Leave at once: the other processes may be waiting in a collective this one will
        # never join, and a normal exit would wait for them at JAX's shutdown barrier.
        sys.stdout.flush()
        os._exit(code)
    sys.exit(code)


def parse_flags(argv: Sequence[str]) -> list[str]:
    """absl's parser, with a bad flag reported in one line instead of a usage dump."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as exc:
        fail(f"{exc} (see --helpfull)", 2)


def main(argv: Sequence[str]) -> None:
    if len(argv) > 1:
        fail(f"unexpected arguments {' '.join(argv[1:])}; flags look like --steps=400", 2)
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # keep JAX's start-up INFO lines out of the tables
    if _COMPILATION_CACHE.value:
        jax.config.update("jax_compilation_cache_dir", _COMPILATION_CACHE.value)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    config = _CONFIG.value
    config.update_from_flattened_dict(
        {
            field: flags.FLAGS[flag].value
            for flag, field in SHORTHANDS.items()
            if flags.FLAGS[flag].value is not None
        }
    )
    try:
        parallel.initialize(
            _COORDINATOR.value,
            _NUM_PROCESSES.value,
            _PROCESS_ID.value,
            auto=_DISTRIBUTED.value,
            timeout_s=_DISTRIBUTED_TIMEOUT.value,
        )
        if _MODE.value == "train":
            train.train_and_evaluate(config, _WORKDIR.value)
        elif _MODE.value == "benchmark":
            try:
                batch_sizes = [int(b) for b in _BENCH_BATCH_SIZES.value]
            except ValueError:
                fail(f"--bench_batch_sizes={','.join(_BENCH_BATCH_SIZES.value)}: whole numbers", 2)
            benchmark.run_benchmark(
                config,
                batch_sizes=batch_sizes,
                dtypes=_BENCH_DTYPES.value,
                steps=_BENCH_STEPS.value,
                repeats=_BENCH_REPEATS.value,
                whole_run_steps=_BENCH_WHOLE_RUN_STEPS.value,
                output=_OUTPUT.value,
            )
        elif not _WORKDIR.value:
            fail(f"--mode={_MODE.value} needs --workdir=DIR of a training run", 2)
        elif _MODE.value == "eval":
            inference.run_eval(
                _WORKDIR.value,
                step=_STEP.value,
                compute_dtype=flags.FLAGS.compute_dtype,
                data_dir=flags.FLAGS.data_dir,
            )
        else:
            _, errors = inference.run_predict(
                _WORKDIR.value,
                _IMAGES.value,
                step=_STEP.value,
                compute_dtype=flags.FLAGS.compute_dtype,
                output=_OUTPUT.value,
            )
            for line in errors:
                error_line(line)
            if errors:
                sys.exit(1)
    except UserError as exc:
        fail(str(exc), getattr(exc, "exit_code", 1))
    except KeyboardInterrupt:
        fail("interrupted; checkpoints saved so far are kept", 130)


def run() -> None:
    """Entry point of `main.py` and the `fmnist-flax` console script."""
    app.run(main, flags_parser=parse_flags)
