"""The set-up of a training run: everything a user can get wrong checked, in one line each,
before anything is built, then the data placed and the models sized against the machine.

The loop itself is `train.train_and_evaluate`; the stages around it (the tables, the final
evaluation, summary.json and report/) are `runtime/stages.py`'s, importable from here.
Extensions (the codelab's demonstrations in `codelab/demonstrations.py`) add tables, figures and
summary entries before and after training; nothing on the training path imports them, so
deleting one leaves a working trainer.
"""

from __future__ import annotations

import contextlib
import functools
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import ml_collections

from fmnist_flax import config as config_lib
from fmnist_flax import datasets, evaluate, input_pipeline
from fmnist_flax import model as model_lib
from fmnist_flax import optimizer as optimizer_lib
from fmnist_flax.runtime import checkpoint as checkpoint_lib
from fmnist_flax.runtime import memory, run_config, stages
from fmnist_flax.runtime.clock import StageClock

# What a project's extensions and the loop use, under the names they had here.
from fmnist_flax.runtime.run import Extension as Extension
from fmnist_flax.runtime.run import Run as Run
from fmnist_flax.runtime.run import parse_init_from as parse_init_from
from fmnist_flax.runtime.run import start_painter as start_painter
from fmnist_flax.runtime.stages import evaluate_model as evaluate_model
from fmnist_flax.runtime.stages import evaluate_test as evaluate_test
from fmnist_flax.runtime.stages import show_setup as show_setup
from fmnist_flax.runtime.stages import show_training as show_training
from fmnist_flax.runtime.stages import test_metrics as test_metrics
from fmnist_flax.runtime.stages import test_set as test_set
from fmnist_flax.runtime.stages import write_outputs as write_outputs
from fmnist_flax.runtime.stages import write_summary as write_summary

# One model of a config and its optimizer as shapes only, and the bytes each model of a run
# holds: what `memory.check_memory` sizes a run by.
abstract_state = functools.partial(
    memory.abstract_state, abstract_model=model_lib.abstract_model, make_tx=optimizer_lib.create
)
member_bytes = functools.partial(
    memory.member_bytes,
    abstract_state=abstract_state,
    evaluate_batches=evaluate.evaluate_batches,
    examples_per_call=evaluate.EVAL_EXAMPLES_PER_CALL,
)


def prepare(
    config: ml_collections.ConfigDict,
    workdir: str | pathlib.Path | None,
    cleanup: contextlib.ExitStack,
    devices: list[jax.Device] | None = None,
    *,
    step: Callable[..., Any],
    started: float | None = None,
) -> tuple[pathlib.Path, datasets.Dataset, input_pipeline.DeviceData, StageClock]:
    """Check everything a user can get wrong, claim the workdir (released on `cleanup`), load
    the data and place it on a mesh over `devices` (default: all). `step`: the training step
    (`train.train_step`), whose memory is checked with the models' (`memory.check_memory`).
    Returns them with the run's stage clock, started at `started` (`train_and_evaluate`'s)."""
    clock = StageClock(since=started)
    jax.devices()  # JAX's backend, part of the start-up
    clock.stage("data")
    config_lib.validate(config)
    memory.check_threads(config)
    datasets.get(config)  # an unknown dataset or a missing --data_dir, before any I/O
    workdir = stages.claim_workdir(workdir, cleanup)
    dataset = datasets.load(config)
    model_lib.check_config(config, dataset.image_shape)
    input_pipeline.check_augment(config.augment, dataset.image_shape)
    device_data = stages.place_data(config, dataset, devices, member_bytes, step, abstract_state)
    return workdir, dataset, device_data, clock


def check_config_changes(
    checkpoints: checkpoint_lib.Checkpoints,
    config: ml_collections.ConfigDict,
    dataset: datasets.Dataset,
    accept: bool,
) -> list[dict[str, Any]]:
    """Refuse to resume with values (or data) that change what the run computes, unless
    `accept`; returns the changes for the record (`run_config.check_changes`)."""
    defaults = config_lib.get_config().to_dict()
    return run_config.check_changes(checkpoints, config, dataset.info(), accept, defaults)
