"""The stages of a run around its loop, for any template: the data placed on the mesh and the
models sized against the machine (`place_data`), the set-up tables (`show_setup`), the
training log (`show_training`), the final evaluation's tables and figures (`evaluate_model`),
then summary.json and report/ (`write_outputs`). The test set is evaluated with the template's
`evaluate` (`inference.use`).
"""

from __future__ import annotations

import contextlib
import functools
import math
import pathlib
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_collections
from flax import nnx

from . import (
    device_batches,
    ensemble,
    inference,
    memory,
    parallel,
    report,
    summaries,
    tables,
)
from . import workdir as workdir_lib
from .data_files import Dataset
from .errors import UserError, warning_line
from .inference import COUNT
from .run import Extension, Run

REPORT_TITLE = "fmnist-flax: {dataset} with Flax NNX, {workdir}"


def claim_workdir(
    workdir: str | pathlib.Path | None, cleanup: contextlib.ExitStack
) -> pathlib.Path:
    """The run's workdir, made (default: a fresh one under runs/) and locked until `cleanup`;
    a fresh one that no output reached is removed then."""
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
    return workdir


def place_data(
    config: ml_collections.ConfigDict,
    dataset: Dataset,
    devices: list[jax.Device] | None,
    member_bytes: memory.MemberBytes,
    step: Callable[..., Any],
    abstract_state: Callable[..., tuple[nnx.Module, nnx.Optimizer]],
) -> device_batches.DeviceData:
    """The data on a mesh over `devices` (default: all), once the models (`member_bytes`) and
    the training step `step` (`memory.step_bytes`) are found to fit beside it."""
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
    return device_data


def show_setup(run: Run) -> None:
    """The set-up tables: versions and layout, the data, the arrays on the device, the model."""
    parallel.say(f"workdir: {run.workdir}")
    if run.start_step:
        parallel.say(f"resuming from checkpoint {run.start_step} in {run.checkpoints.directory}")
    d = run.dataset
    layout = parallel.layout(run.device_data.mesh, run.config.batch_size, run.config.param_sharding)
    versions = {name.capitalize(): v for name, v in workdir_lib.versions().items()}
    run.show("Set-up", tables.setup_table(versions, layout, run.config.compute_dtype))
    if parallel.is_primary() and jax.default_backend() == "cpu":  # a GPU or a TPU is fine
        warning_line(
            f"No GPU found: training on {jax.devices()[0]}; pip install '.[cuda12]' or '.[tpu]'"
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
    evaluate = inference.template().evaluate
    return evaluate(model, *test_set(run), run.config, run.device_data.mesh)


def test_metrics(evaluation: dict[str, Any]) -> dict[str, float]:
    """An evaluation's metrics as a logged row's columns: test_loss, test_accuracy, ..."""
    return {f"test_{k}": v for k, v in metrics_of(evaluation).items() if k != COUNT}


def metrics_of(evaluation: dict[str, Any]) -> dict[str, Any]:
    """An evaluation's metrics and example count, without its predictions and batch sums."""
    return {k: v for k, v in evaluation.items() if k not in ("predictions", "batch_sums")}


def prefixed(prefix: str, metrics: dict[str, Any]) -> dict[str, Any]:
    return {f"{prefix}{k}": v for k, v in metrics.items()}


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
    # A row may lack a value (a row someone else wrote): NaN, drawn as a gap.
    steps, losses, accuracies = (
        [h.get(k, math.nan) for h in run.history] for k in ("step", "loss", "accuracy")
    )
    tested = [h for h in run.history if "test_accuracy" in h]
    test = tuple(
        [h.get(k, math.nan) for h in tested] for k in ("step", "test_loss", "test_accuracy")
    )
    title = run.dataset.title
    run.figure(
        "Training",
        "training_curve.png",
        lambda: report.training_curve(steps, losses, accuracies, title, test),
    )
    run.note(
        "Training",
        f"{len(tested)} test-set evaluations during training; the {run.eval_seconds:.1f} s the "
        "loop waited for them are not counted in the examples/sec above.",
    )


def evaluate_model(run: Run, extensions: Sequence[Extension] = ()) -> dict[str, Any]:
    """The evaluation over the test set (the last step's, when it was evaluated), its tables
    (with the rows `extensions` add) and figures."""
    d = run.dataset
    if run.evaluation and run.evaluation[0] == run.config.steps:  # done at the last step
        full = run.evaluation[1]
    else:
        full = evaluate_test(run, run.model)
    labels = test_set(run)[1]
    counts = inference.confusion_matrix(labels, full["predictions"], d.num_classes)
    result = {"full": metrics_of(full), "confusion": counts}
    if not parallel.is_primary():
        return result
    last = run.history[-1] if run.history else {}
    rows = {k: v for e in extensions for k, v in e.evaluation_rows(run, full).items()}
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
    members = ensemble.members_table_rows(run.config, result["full"], last, COUNT)
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


def write_report(run: Run, test_accuracy: float) -> pathlib.Path | None:
    """report/ with every section, headed by what run it is; a write that fails is one warning
    line, and the run's summary is written without it."""
    directory = run.workdir / workdir_lib.REPORT_DIR
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
            title=REPORT_TITLE.format(dataset=run.dataset.title, workdir=run.workdir.name),
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


def write_summary(
    run: Run, evaluation: dict[str, Any] | None, finished: bool = True
) -> dict[str, Any]:
    """summary.json (process 0): the training rate, each stage's seconds so far (`run.clock`)
    and, once the final evaluation is done (`evaluation`), the test metrics. Written as soon as
    training ends and again before the demonstrations, with `finished` False: a run stopped
    after training keeps its true rate, and the same command finishes the outputs."""
    config, mesh = run.config, run.device_data.mesh
    full = evaluation["full"] if evaluation else {}
    last = run.history[-1] if run.history else {}
    summary = {
        **prefixed("test_", full),
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
        **({"confusion_matrix": evaluation["confusion"].tolist()} if evaluation else {}),
        "stage_seconds": run.clock.totals(),
        "wall_seconds": run.clock.wall(),
        "peak_rss_mb": workdir_lib.peak_rss_mb(),
        "versions": workdir_lib.versions(),
        "config": config.to_dict(),
        **run.summary,
        "finished": finished,
    }
    if parallel.is_primary():
        workdir_lib.write_json(run.workdir / workdir_lib.SUMMARY_FILE, summary)
    return summary


def write_outputs(run: Run, evaluation: dict[str, Any]) -> dict[str, Any]:
    """report/ and the finished summary.json (process 0), then the results where a person
    looks first, and where the run's time went."""
    full = evaluation["full"]
    if not parallel.is_primary():
        return {"test_accuracy": full["accuracy"], "process_index": jax.process_index()}
    report_path = write_report(run, full["accuracy"]) if run.reporting else None
    run.summary["report"] = str(report_path) if report_path else None
    summary = write_summary(run, evaluation)
    print(
        f"test accuracy {full['accuracy']:.4f} on {full['examples']:,} examples",
        f"report: {report_path}" if report_path else "report: none (--report=none)",
        f"workdir: {run.workdir}",
        run.clock.line(),
        sep="\n",
        flush=True,
    )
    return summary
