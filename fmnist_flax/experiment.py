"""What a training run holds and the stages around its loop: the set-up checks, the tables,
the final evaluation and the outputs (summary.json, report/).

The loop itself is `train.train_and_evaluate`. Extensions (the codelab's demonstrations in
`codelab/demonstrations.py`) add tables, figures and summary entries before and after
training; nothing on the training path imports them, so deleting one leaves a working trainer.
"""

from __future__ import annotations

import contextlib
import functools
import pathlib
import shlex
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from fmnist_flax import config as config_lib
from fmnist_flax import datasets, evaluate, input_pipeline
from fmnist_flax import model as model_lib
from fmnist_flax import optimizer as optimizer_lib
from fmnist_flax.runtime import checkpoint as checkpoint_lib
from fmnist_flax.runtime import (
    data_files,
    device_batches,
    ema,
    ensemble,
    inference,
    memory,
    parallel,
    report,
    summaries,
    tables,
)
from fmnist_flax.runtime import workdir as workdir_lib
from fmnist_flax.runtime.errors import UserError, warning_line

# What a project's extensions and the loop use, under the names they had here.
from fmnist_flax.runtime.run import Extension as Extension
from fmnist_flax.runtime.run import Run as Run
from fmnist_flax.runtime.run import parse_init_from as parse_init_from
from fmnist_flax.runtime.run import start_painter as start_painter


def prepare(
    config: ml_collections.ConfigDict,
    workdir: str | pathlib.Path | None,
    cleanup: contextlib.ExitStack,
    devices: list[jax.Device] | None = None,
    *,
    step: Callable[..., Any],
) -> tuple[pathlib.Path, datasets.Dataset, input_pipeline.DeviceData]:
    """Check everything a user can get wrong, claim the workdir (released on `cleanup`), load
    the data and place it on a mesh over `devices` (default: all). `step`: the training step
    (`train.train_step`), whose memory is checked with the models' (`check_memory`)."""
    config_lib.validate(config)
    memory.check_threads(config)
    datasets.get(config)  # an unknown dataset or a missing --data_dir, before any I/O
    if jax.process_count() > 1 and not workdir:
        raise UserError(
            "a multi-process run needs --workdir=DIR, on a filesystem every process shares"
        )
    fresh = not workdir
    workdir = workdir_lib.prepare_workdir(workdir)
    if parallel.is_primary():  # the processes of one run share it
        cleanup.callback(workdir_lib.Lock(workdir).release)
        if fresh:  # runs first: a run that fails before its first output leaves no directory
            cleanup.callback(workdir_lib.remove_if_unused, workdir)
    dataset = datasets.load(config)
    model_lib.check_config(config.model, dataset.image_shape)
    input_pipeline.check_augment(config.augment, dataset.image_shape)
    mesh = parallel.mesh_for(config, devices)
    on_host = config.input_pipeline == "grain"
    device_data = device_batches.to_device(
        dataset, config.batch_size, mesh, not on_host, config.optimizer.accumulate
    )
    memory.check_memory(
        config,
        dataset,
        mesh,
        member_bytes,
        functools.partial(memory.step_bytes, train_step=step, abstract_state=abstract_state),
    )
    return workdir, dataset, device_data


# --- A model's size, for memory.check_memory ------------------------------------------------------

PROBE_MEMBERS = 8  # members an evaluation call is compiled for to size one member's share


def abstract_state(
    config: ml_collections.ConfigDict, image_shape: tuple[int, int, int], num_classes: int
) -> tuple[nnx.Module, nnx.Optimizer]:
    """One model of the config (with its EMA's twins) and its optimizer as shapes and dtypes
    only (nothing allocated): what the update hooks a step runs will find."""
    model = model_lib.abstract_model(config, image_shape, num_classes)
    if config.ema.decay:
        model = nnx.eval_shape(lambda m: (ema.attach(m, config.ema.decay), m)[1], model)
    optimizer = nnx.eval_shape(
        lambda m: nnx.Optimizer(m, optimizer_lib.create(config), wrt=nnx.Param), model
    )
    return model, optimizer


def member_bytes(
    config: ml_collections.ConfigDict,
    image_shape: tuple[int, int, int],
    num_classes: int,
    saved_copy: bool = True,
) -> int:
    """What each model of a run holds, sized from abstract shapes (nothing allocated): its
    state, its parameters' gradients and its optimizer's state, with `saved_copy` the host
    copy of state and optimizer a checkpoint writes while training goes on (in the same memory
    on a CPU); for an ensemble also a member's share of an evaluation call, which runs every
    member at once."""
    model, optimizer = abstract_state(config, image_shape, num_classes)
    state = memory.tree_bytes(nnx.state(model)) + memory.tree_bytes(
        nnx.state(optimizer, nnx.OptState)
    )
    held = state * (1 + saved_copy) + memory.tree_bytes(nnx.state(model, nnx.Param))
    if config.ensemble.size > 1:
        held += evaluation_bytes_per_member(config, model, image_shape)
    return held


def evaluation_bytes_per_member(
    config: ml_collections.ConfigDict, model: nnx.Module, image_shape: tuple[int, int, int]
) -> int:
    """One member's share of an ensemble's evaluation call: XLA's memory analysis of the call
    compiled (not run) for up to PROBE_MEMBERS abstract members of `model`; 0 where the
    backend gives no analysis."""
    size = min(config.ensemble.size, PROBE_MEMBERS)
    members = nnx.eval_shape(lambda m: ensemble.Ensemble(ensemble.stack([m] * size), size), model)
    members.eval()
    graphdef, state = nnx.split(members)
    # The most batches one call holds (evaluate._calls), as uint8 images, labels and a mask.
    shape = (max(1, evaluate.EVAL_EXAMPLES_PER_CALL // config.batch_size), config.batch_size)
    frozen = ml_collections.FrozenConfigDict(config)

    def call(state, images, labels, mask):
        return evaluate.evaluate_batches(nnx.merge(graphdef, state), images, labels, mask, frozen)

    inputs = [
        jax.ShapeDtypeStruct((*shape, *image_shape), jnp.uint8),
        jax.ShapeDtypeStruct(shape, jnp.int32),
        jax.ShapeDtypeStruct(shape, jnp.float32),
    ]
    analysis = jax.jit(call).lower(state, *inputs).compile().memory_analysis()
    return analysis.temp_size_in_bytes // size if analysis else 0


def check_config_changes(
    checkpoints: checkpoint_lib.Checkpoints,
    config: ml_collections.ConfigDict,
    dataset: datasets.Dataset,
    accept: bool,
) -> list[dict[str, Any]]:
    """Refuse to resume with values (or data) that change what the run computes, in one line
    naming each; with `accept`, return them (with the earlier accepted ones) for the record.
    Values that move the data position (the batch, the seed, the train set's size) cannot be
    accepted: the saved position would not mean the same examples."""
    step, saved = checkpoints.saved("config")
    if saved is None:
        return []
    earlier = checkpoints.saved("changes", step)[1] or {"changes": []}
    changes = config_lib.training_changes(saved, config.to_dict())
    changes += data_files.identity_changes(
        checkpoints.saved("dataset", step)[1] or {}, dataset.info()
    )
    fixed = [c for c in changes if config_lib.fixed_on_resume(c)]
    if changes and (fixed or not accept):
        listed = ", ".join(f"{c['field']} {c['saved']!r} -> {c['now']!r}" for c in fixed or changes)
        way = "" if fixed else ", or pass --accept_config_change to go on with the new ones"
        raise UserError(
            f"{checkpoints.directory} holds step {step} trained with other values: {listed}; "
            f"resume with the saved values (and data) or pass a new --workdir{way}"
            + (" (summary.json records them)" if way else "")
        )
    return earlier["changes"] + [{"step": step, **c} for c in changes]


def show_setup(run: Run) -> None:
    """The set-up tables: versions and layout, the data, the arrays on the device, the model."""
    parallel.say(f"workdir: {run.workdir}")
    if run.start_step:
        parallel.say(f"resuming from checkpoint {run.start_step} in {run.checkpoints.directory}")
    d = run.dataset
    layout = parallel.layout(run.device_data.mesh, run.config.batch_size, run.config.param_sharding)
    versions = {name.capitalize(): v for name, v in workdir_lib.versions().items()}
    run.show("Set-up", tables.setup_table(versions, layout))
    if parallel.is_primary() and jax.default_backend() == "cpu":  # a GPU or a TPU is fine
        warning_line(
            f"No GPU found: training on {jax.devices()[0]}; install '.[cuda12]' on a GPU host, "
            "'.[tpu]' on a TPU VM"
        )
    run.show("Data", tables.splits_table(d))
    run.figure(
        "Data",
        "examples_per_class.png",
        lambda: report.examples_per_class(d.train_images, d.train_labels, d.class_names, d.title),
    )
    arrays = {k: v for k, v in vars(run.device_data).items() if isinstance(v, jax.Array)}
    run.show("Batches", tables.arrays_table("Data arrays on the device", arrays))
    images, _ = test_set(run)
    run.note(
        "Batches",
        f"The test set ({len(images):,} uint8 images) stays on the host; "
        "evaluation streams it to the devices in fixed-size calls.",
    )
    run.show("Model", tables.params_table(run.model))


def test_set(run: Run) -> tuple[Any, Any]:
    """The test images and labels evaluated: the first `config.eval_examples` (0: all)."""
    count = run.config.eval_examples or len(run.dataset.test_labels)
    return run.dataset.test_images[:count], run.dataset.test_labels[:count]


def evaluate_test(run: Run, model: nnx.Module) -> dict[str, Any]:
    """Every metric of the task over the test set (`test_set`), on the run's mesh."""
    return evaluate.evaluate(model, *test_set(run), run.config, run.device_data.mesh)


def show_training(run: Run) -> None:
    """After the last step: the replicas compared, then (process 0) the training log's table and
    curve, read back from metrics.jsonl (every logged step, resumes included)."""
    compared = parallel.check_replicas(nnx.state(run.model, nnx.Param), "the trained parameters")
    if jax.process_count() > 1:
        parallel.say(
            f"the {compared} replicated parameter arrays are identical in all "
            f"{jax.process_count()} processes"
        )
    if not parallel.is_primary():
        return
    run.history = workdir_lib.read_jsonl(run.workdir / workdir_lib.METRICS_FILE)
    run.show("Training", tables.training_log_table(run.history, run.examples_per_sec))
    steps, losses, accuracies = ([h[k] for h in run.history] for k in ("step", "loss", "accuracy"))
    tested = [h for h in run.history if "test_accuracy" in h]
    test = tuple([h[k] for h in tested] for k in ("step", "test_loss", "test_accuracy"))
    title = run.dataset.title
    run.figure(
        "Training",
        "training_curve.png",
        lambda: report.training_curve(steps, losses, accuracies, title, test),
    )
    run.note(
        "Training",
        f"{len(tested)} test-set evaluations during training took {run.eval_seconds:.1f} s, "
        "not counted in the examples/sec above.",
    )


def test_metrics(evaluation: dict[str, Any]) -> dict[str, float]:
    """An evaluation's metrics as a logged row's columns: test_loss, test_accuracy, ..."""
    return {f"test_{k}": v for k, v in metrics_of(evaluation).items() if k != evaluate.COUNT}


def metrics_of(evaluation: dict[str, Any]) -> dict[str, Any]:
    """An evaluation's metrics and example count, without its predictions and batch sums."""
    return {k: v for k, v in evaluation.items() if k not in ("predictions", "batch_sums")}


def evaluate_model(run: Run) -> dict[str, Any]:
    """The `nnx.vmap` evaluation over the test set, its tables and figures."""
    d = run.dataset
    if run.evaluation and run.evaluation[0] == run.config.steps:  # done at the last step
        full = run.evaluation[1]
    else:
        full = evaluate_test(run, run.model)
    whole_batches = full[evaluate.COUNT] // run.config.batch_size
    codelab = evaluate.means(full["batch_sums"], whole_batches)
    labels = test_set(run)[1]
    counts = inference.confusion_matrix(labels, full["predictions"], d.num_classes)
    result = {"full": metrics_of(full), "codelab": codelab, "confusion": counts}
    if not parallel.is_primary():
        return result
    last = run.history[-1] if run.history else {}
    rows = {"test, codelab (whole batches only)": codelab} if run.config.demonstrations else {}
    rows["test, full (last batch padded, masked)"] = result["full"]
    if "loss" in last:
        since = run.history[-2]["step"] if len(run.history) > 1 else 0
        examples = (last["step"] - since) * run.device_data.examples_per_step
        train_row = {k: v for k, v in last.items() if not k.startswith(("test_", "val_"))}
        train_row.pop("step")
        rows = {
            f"train, steps {since + 1}-{last['step']}": {**train_row, "examples": examples},
            **rows,
        }
    run.show("Evaluation", tables.evaluation_table(rows))
    members = ensemble.members_table_rows(run.config, result["full"], last, evaluate.COUNT)
    if members:
        best = ensemble.best_member(prefixed("test_", result["full"]))
        run.summary |= {"members": members, "best_member": best}
        run.show("Evaluation", tables.members_table(members, best))
        summaries.write_members(run.workdir, members, run.config.steps)
        steps = [h["step"] for h in run.history]
        losses = list(zip(*(ensemble.member_values(h, "loss") for h in run.history), strict=True))
        run.figure(
            "Evaluation",
            "members.png",
            lambda: report.members_figure(steps, losses, members, d.title),
        )
    picks = report.sample_indices(len(labels))
    shown = d.test_images[picks], labels[picks], full["predictions"][picks]
    run.figure(
        "Evaluation", "predictions.png", lambda: report.prediction_grid(*shown, d.class_names)
    )
    run.figure(
        "Evaluation", "confusion_matrix.png", lambda: report.confusion_figure(counts, d.class_names)
    )
    data = run.device_data
    run.show(
        "Device placement",
        tables.placement_table(
            {
                "params": nnx.state(run.model, nnx.Param),
                "optimizer state": nnx.state(run.optimizer, nnx.OptState),
                **(
                    {"train data": (data.train_images, data.train_labels)}
                    if data.train_images is not None
                    else {}
                ),
            }
        ),
    )
    return result


def prefixed(prefix: str, metrics: dict[str, Any]) -> dict[str, Any]:
    return {f"{prefix}{k}": v for k, v in metrics.items()}


def write_report(run: Run, test_accuracy: float) -> pathlib.Path | None:
    """report/ with every section, headed by what run it is; a write that fails is one warning
    line, and the run's summary is written without it."""
    directory = run.workdir / "report"
    steps = run.summary.get("stopped_at", run.config.steps)
    about = {
        "workdir": str(run.workdir),
        "written": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": shlex.join(sys.argv),
        "test accuracy": f"{test_accuracy:.4f} after {steps:,} steps",
        "backend": f"{jax.default_backend()} ({jax.devices()[0].device_kind})",
    }
    try:
        return report.write_report(
            directory,
            title=f"fmnist-flax: {run.dataset.title} with Flax NNX, {run.workdir.name}",
            sections=run.sections,
            config=run.config.to_dict(),
            about=about,
        )
    except OSError as exc:
        warning_line(
            f"cannot write the report in {directory} ({workdir_lib.disk_problem(directory, exc)})"
            "; summary.json is written without it"
        )
        return None


def write_outputs(run: Run, evaluation: dict[str, Any], wall_seconds: float) -> dict[str, Any]:
    """summary.json and report/ (process 0), then the results where a person looks first."""
    full = evaluation["full"]
    codelab = evaluation["codelab"]
    if not parallel.is_primary():
        return {"test_accuracy": full["accuracy"], "process_index": jax.process_index()}
    config = run.config
    mesh = run.device_data.mesh
    report_path = write_report(run, full["accuracy"]) if run.reporting else None
    last = run.history[-1] if run.history else {}
    summary = {
        **prefixed("test_", full),
        **{f"codelab_test_{k}": v for k, v in codelab.items()},
        # The last row's training metrics (its test metrics are the test_* above).
        **{f"final_train_{k}": v for k, v in last.items() if k != "step" and "test_" not in k},
        "train_examples_per_sec": run.examples_per_sec,
        "eval_seconds_during_training": run.eval_seconds,
        "steps": config.steps,
        "resumed_from_step": run.start_step,
        "batch_size": config.batch_size,
        "compute_dtype": config.compute_dtype,
        "seed": config.seed,
        "dataset": run.dataset.info(),
        "backend": jax.default_backend(),
        "num_devices": mesh.size,
        "num_processes": jax.process_count(),
        "mesh": dict(mesh.shape),
        "param_sharding": config.param_sharding,
        "layout": parallel.layout(mesh, config.batch_size, config.param_sharding),
        "param_layouts": parallel.param_layouts(run.model),
        "confusion_matrix": evaluation["confusion"].tolist(),
        "report": str(report_path) if report_path else None,
        "wall_seconds": wall_seconds,
        "peak_rss_mb": workdir_lib.peak_rss_mb(),
        "versions": workdir_lib.versions(),
        "config": config.to_dict(),
        **run.summary,
    }
    workdir_lib.write_json(run.workdir / workdir_lib.SUMMARY_FILE, summary)
    whole = f" ({codelab['accuracy']:.4f} on the codelab's {codelab['examples']:,})"
    print(
        f"test accuracy {full['accuracy']:.4f} on {full['examples']:,} examples"
        + (whole if codelab["examples"] and config.demonstrations else ""),
        f"report: {report_path}" if report_path else "report: none (--report=none)",
        f"workdir: {run.workdir}",
        sep="\n",
        flush=True,
    )
    return summary
