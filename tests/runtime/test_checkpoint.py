"""Checkpoints: exact resume, restore for inference, and the faults a real run meets."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import EVERY_DUE_SAVE, REPO, load_config, start_main, wait_for
from flax import nnx

from fmnist_flax import load_model, train
from fmnist_flax.runtime import checkpoint, errors, inference, parallel, restore
from fmnist_flax.runtime.errors import UserError
from fmnist_flax.runtime.schedule import Schedule


def params_of(workdir, step=None):
    model = load_model(workdir, step)
    return jax.tree.leaves(jax.tree.map(np.asarray, model.layers))


def metric_rows(workdir):
    return [json.loads(r) for r in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 200-step run with checkpoints at 100 and 200, shared read-only by several tests."""

    config = load_config("default")
    config.steps = 200
    config.report = "none"
    config.checkpoint_min_interval_secs = 0.0  # a save at each checkpoint_every step
    workdir = tmp_path_factory.mktemp("trained") / "w"
    summary = train.train_and_evaluate(config, workdir)
    return workdir, summary


@pytest.fixture
def quick_verdicts(monkeypatch):
    """A reader watches a step that failed to read for ROTATION_WAIT (1 s) before it calls it
    damaged, in case a live run is rotating it away. Damage these tests make by hand, with no
    run, is watched for two looks (0.1 s): the watch itself is tested with its own waits."""
    monkeypatch.setattr(checkpoint, "ROTATION_WAIT", 2 * checkpoint.ROTATION_PAUSE)


@pytest.mark.slow
def test_400_steps_equal_200_then_resume_to_400_bit_for_bit(quick_config, tmp_path):
    quick_config.steps = 400
    train.train_and_evaluate(quick_config, tmp_path / "one")
    quick_config.steps = 200
    train.train_and_evaluate(quick_config, tmp_path / "two")
    quick_config.steps = 400
    resumed = train.train_and_evaluate(quick_config, tmp_path / "two")
    assert resumed["resumed_from_step"] == 200
    for a, b in zip(params_of(tmp_path / "one"), params_of(tmp_path / "two"), strict=True):
        np.testing.assert_array_equal(a, b)
    one, two = metric_rows(tmp_path / "one"), metric_rows(tmp_path / "two")

    def training(rows):
        return [{k: v for k, v in row.items() if not k.startswith("test_")} for row in rows]

    assert training(one) == training(two)  # every row, 200..400 included, and no duplicates
    # The test set was evaluated at each epoch's end in both, and at step 200 where run two
    # ended before its resume: an evaluation never changes what training computes.
    tested = [row for row in one if "test_accuracy" in row]
    assert [row for row in two if "test_accuracy" in row and row["step"] != 200] == tested
    assert checkpoint.Checkpoints(tmp_path / "two").steps() == [200, 300, 400]  # max_to_keep=3


def test_steps_not_beyond_the_saved_step_is_nothing_to_do(trained, capsys):

    workdir, summary = trained
    config = load_config("default")
    config.steps = 150
    config.report = "none"
    before = (workdir / "metrics.jsonl").read_bytes()
    result = train.train_and_evaluate(config, workdir)
    assert result == json.loads((workdir / "summary.json").read_text())
    assert result["test_accuracy"] == summary["test_accuracy"]
    assert "nothing to do" in capsys.readouterr().out
    assert (workdir / "metrics.jsonl").read_bytes() == before


def test_checkpoint_holds_progress_and_config_as_json_and_no_pickle(trained):
    workdir, _ = trained
    step_dir = workdir / "checkpoints" / "200"
    progress = json.loads((step_dir / "progress" / "metadata").read_text())
    summary = json.loads((workdir / "summary.json").read_text())
    expected = {
        "step": 200,
        "epoch": 1,
        "index": 83,
        "num_batches": 117,
        "batch_size": 512,
        "seed": 0,
        # the last step is evaluated: its test metrics travel with it, for --step=best
        "test_accuracy": summary["test_accuracy"],
        "test_loss": summary["test_loss"],
    }
    assert {k: progress.get(k) for k in expected} == expected
    # The running row: logged at this step, so the next one starts from nothing. A project's
    # own metrics add sums; every one is zero.
    assert progress["row"]["start"] == 200
    assert {"accuracy", "loss"} <= progress["row"]["sums"].keys()
    assert not any(progress["row"]["sums"].values())
    config = json.loads((step_dir / "config" / "metadata").read_text())
    assert config["model"]["hidden"] == [256, 128]
    for path in workdir.rglob("*"):
        if path.is_file():
            head = path.read_bytes()[:2]
            assert not (head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"))
    sources = "".join(p.read_text() for p in (REPO / "fmnist_flax").glob("*.py"))
    assert re.search(r"import pickle|allow_pickle=True", sources) is None


def test_load_model_restores_params_only_in_any_dtype(trained):
    workdir, _ = trained
    model = load_model(workdir)
    assert model.compute_dtype == np.float32
    bf16 = load_model(workdir, compute_dtype="bfloat16")
    assert bf16.compute_dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(model.layers[0].kernel[...], bf16.layers[0].kernel[...])
    older = load_model(workdir, step=100)
    assert not np.array_equal(model.layers[0].kernel[...], older.layers[0].kernel[...])


@pytest.mark.usefixtures("quick_verdicts")
def test_every_step_damaged_is_one_line_and_the_finished_run_is_kept(trained, tmp_path):
    """With no intact step the same command does not train again from step 0 over the
    finished run's outputs: one line names the steps and how to start over; nothing moves."""
    workdir = tmp_path / "w"
    shutil.copytree(trained[0], workdir)
    for step in (100, 200):
        (workdir / "checkpoints" / str(step) / "model" / "_METADATA").unlink()
    before = {name: (workdir / name).read_bytes() for name in ("metrics.jsonl", "summary.json")}
    config = load_config("default")
    config.update(steps=200, report="none", checkpoint_min_interval_secs=0.0)
    with pytest.raises(UserError) as refused:
        train.train_and_evaluate(config, workdir)
    line = str(refused.value)
    assert line.startswith(
        f"every checkpoint in {workdir / 'checkpoints'} is damaged (steps 100, 200; 200: its "
        "model item has no _METADATA file); nothing was trained, moved or overwritten. To train "
        "again from step 0, pass a fresh --workdir, or remove "
    ), line
    assert "\n" not in line
    assert {name: (workdir / name).read_bytes() for name in before} == before
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["100", "200"]
    assert not (workdir / checkpoint.DAMAGED_DIR).exists()
    with pytest.raises(UserError, match=r"is damaged \(steps 100, 200; 200: [^;]*\)$"):
        load_model(workdir)  # a reader: the same steps, no advice on training


@pytest.mark.usefixtures("quick_verdicts")
def test_a_file_where_damaged_steps_go_is_one_line_and_moves_nothing(trained, tmp_path):
    """It was a FileExistsError traceback."""
    workdir = tmp_path / "w"
    shutil.copytree(trained[0], workdir)
    (workdir / "checkpoints" / "200" / "progress" / "metadata").write_text("null")
    (workdir / checkpoint.DAMAGED_DIR).write_text("mine")
    writer = checkpoint.Checkpoints(workdir)
    try:
        with pytest.raises(UserError) as refused:
            restore.restore(writer, {"progress": None})
    finally:
        writer.close()
    assert str(refused.value) == (
        f"checkpoint 200 in {workdir / 'checkpoints'} is damaged (its progress item is null, "
        f"not a JSON object) and cannot be moved aside: {workdir / checkpoint.DAMAGED_DIR} is a "
        "file; move that file away and run the same command again to resume from the step before"
    )
    assert (workdir / checkpoint.DAMAGED_DIR).read_text() == "mine"
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["100", "200"]


@pytest.mark.usefixtures("quick_verdicts")
def test_damaged_latest_checkpoint_falls_back_with_one_warning(trained, tmp_path, capsys):
    workdir = tmp_path / "w"
    shutil.copytree(trained[0], workdir)
    (data_file,) = [
        p for p in (workdir / "checkpoints" / "200" / "model" / "d").iterdir() if p.is_file()
    ][:1]
    data_file.write_bytes(data_file.read_bytes()[:10])
    _, step, _, _ = inference.restore_model(workdir)  # a reader: the workdir is left as is
    assert step == 100
    assert (workdir / "checkpoints" / "200").is_dir()
    warnings = [line for line in capsys.readouterr().err.splitlines() if "is damaged" in line]
    assert len(warnings) == 1, warnings
    said = f"warning: checkpoint 200 in {workdir / 'checkpoints'} is damaged"
    assert warnings[0].startswith(said)
    writer = checkpoint.Checkpoints(workdir)  # a training run sets the step aside, kept
    try:
        assert restore.restore(writer, {"progress": None})["step"] == 100
    finally:
        writer.close()
    assert (workdir / "damaged_checkpoints" / "200").is_dir()
    assert checkpoint.Checkpoints(workdir, read_only=True).steps() == [100]


@pytest.mark.usefixtures("quick_verdicts")
def test_deleted_data_file_is_detected_too(trained, tmp_path):
    workdir = tmp_path / "w"
    shutil.copytree(trained[0], workdir)
    for path in (workdir / "checkpoints" / "200" / "optimizer" / "d").iterdir():
        path.unlink()

    config = load_config("default")
    config.steps = 210
    config.report = "none"
    summary = train.train_and_evaluate(config, workdir)
    assert summary["resumed_from_step"] == 100


def reader_of_step_200(
    trained, tmp_path
) -> tuple[pathlib.Path, pathlib.Path, checkpoint.Checkpoints]:
    """A copy of the trained run that keeps step 200 only, its checkpoints and a reader."""
    workdir = tmp_path / "w"
    shutil.copytree(trained[0], workdir)
    steps = workdir / "checkpoints"
    shutil.rmtree(steps / "100")
    return workdir, steps, checkpoint.open_reader(workdir)


def test_a_reader_takes_an_item_gone_from_a_step_a_newer_save_replaced_as_rotated_away(
    trained, tmp_path
):
    """A live run keeping one step deletes the old one file by file once a newer one is
    complete: a reader that listed the old step and finds its config gone must start over
    from the newest (it said "no checkpoint has an intact saved config" and stopped)."""
    workdir, steps, reader = reader_of_step_200(trained, tmp_path)
    try:
        assert reader.steps() == [200]
        shutil.copytree(steps / "200", steps / "300")  # the run completes a newer step,
        (steps / "200" / "config" / "metadata").unlink()  # then deletes the old one
        with pytest.raises(checkpoint.StepVanished):
            reader.saved("config")
        with pytest.raises(checkpoint.StepVanished):
            reader.saved("config", 200)
        reader.reload()
        assert reader.saved("config")[0] == 300
    finally:
        reader.close()
    shutil.rmtree(steps / "300")  # no newer step: the item is missing, not rotated away
    with pytest.raises(UserError, match="no checkpoint has an intact saved config"):
        inference.restore_model(workdir)


def test_a_reader_waits_out_a_rotation_caught_half_way(trained, tmp_path):
    """Orbax's deleter can take a rotated step's arrays before its marker, while the newer
    step is not yet marked: a reader whose read failed watches the step for a moment and takes
    it as rotated away once the marker goes (it said "every checkpoint is damaged"). A step
    that stays as it is is damage."""
    _, steps, reader = reader_of_step_200(trained, tmp_path)
    try:
        shutil.rmtree(steps / "200" / "model")  # the arrays gone, the marker still there
        assert not reader.rotated(200)  # one look: damage
        deleter = threading.Timer(0.3, (steps / "200" / checkpoint.STEP_MARKER).unlink)
        deleter.start()
        assert reader.rotated_after_watching(200)  # for ROTATION_WAIT (1 s)
        deleter.join()
        shutil.copytree(trained[0] / "checkpoints" / "200", steps / "300")
        shutil.rmtree(steps / "300" / "model")  # damaged, and nothing removes it
        reader.reload()
        assert not reader.rotated(300, 0.3)
    finally:
        reader.close()


def test_restoring_into_another_architecture_names_the_parameter(trained):

    config = load_config("default")
    config.steps = 300
    config.model.hidden = (512, 128)
    with pytest.raises(UserError) as exc:
        train.train_and_evaluate(config, trained[0], accept_config_change=True)
    message = str(exc.value)
    assert "\n" not in message
    assert "parameter layers.0.bias has shape (256,) in the checkpoint but (512,)" in message
    config.model.hidden = (256,)  # a missing layer
    with pytest.raises(UserError, match=r"layers\.1\.bias has shape \(128,\) .* but \(10,\)"):
        train.train_and_evaluate(config, trained[0], accept_config_change=True)


def a_file(tmp: pathlib.Path) -> pathlib.Path:
    (tmp / "a_file").write_text("")
    return tmp / "a_file"


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda tmp: tmp / "missing", "missing does not exist"),
        (a_file, "a_file is not a directory"),
        (lambda tmp: tmp / ("x" * 300), r"cannot be looked at \(File name too long\)"),
        (lambda tmp: tmp, "has no checkpoints"),
    ],
)
def test_eval_workdir_problems_are_one_line(make, expected, tmp_path):
    with pytest.raises(UserError, match=expected):
        load_model(make(tmp_path))


@pytest.mark.parametrize("under", ["run", ""])
def test_unwritable_training_workdir_is_one_line(quick_config, tmp_path, under):
    """A file where the workdir, or a directory above it, must be: named, not "File exists"."""
    (tmp_path / "file").write_text("kept")
    workdir = tmp_path / "file" / under  # "" adds nothing: the file itself
    expected = f"--workdir {workdir} is not writable ({tmp_path / 'file'} is not a directory)"
    with pytest.raises(UserError, match=re.escape(expected)):
        train.train_and_evaluate(quick_config, workdir)
    assert (tmp_path / "file").read_text() == "kept"


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_saves_the_current_step_and_says_how_to_resume(signum, tmp_path):
    workdir = tmp_path / "w"
    process = start_main(
        workdir, "--steps=1000000", "--checkpoint_every=1000000", "--log_every=1000000"
    )
    wait_for(
        lambda: (workdir / "metrics.jsonl").exists() and (workdir / "metrics.jsonl").stat().st_size
    )
    time.sleep(0.5)
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signum
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "resume by running the same command" in lines[0]
    (saved,) = checkpoint.Checkpoints(workdir).steps()
    assert saved > 1 and f"at step {saved}:" in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_before_training_begins_stops_the_set_up_at_once(signum, tmp_path):
    """During the set-up (building, restoring, compiling: minutes for a large model) a signal
    stops the run at once with its line and exit code: nothing trained, nothing lost."""
    workdir = tmp_path / "w"
    process = start_main(workdir, "--config.ensemble.size=8")
    assert process.stdout.readline().startswith("workdir:")  # its signal handlers are set
    sent = time.monotonic()
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert time.monotonic() - sent < 10  # not held until a first step is trained and saved
    assert process.returncode == 128 + signum
    assert "Traceback" not in stderr
    [line] = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert f"{signal.Signals(signum).name} before training began" in line
    assert not (workdir / "checkpoints").exists()  # it left an empty one


@pytest.mark.slow
def test_sigkill_resumes_from_the_last_complete_checkpoint(tmp_path):
    workdir = tmp_path / "w"
    process = start_main(workdir, "--steps=1000000", "--checkpoint_every=20", EVERY_DUE_SAVE)
    checkpoints_dir = workdir / "checkpoints"
    wait_for(
        lambda: (
            checkpoints_dir.is_dir()
            and len([p for p in checkpoints_dir.iterdir() if p.name.isdigit()]) >= 2
        )
    )
    process.kill()
    process.wait()
    complete = checkpoint.Checkpoints(workdir).steps()
    # A save interrupted half-way leaves a temporary directory; make sure there is one.
    shutil.copytree(
        checkpoints_dir / str(complete[-1]),
        checkpoints_dir / f"{complete[-1] + 20}.orbax-checkpoint-tmp-1",
    )
    steps = complete[-1] + 5
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "main.py"),
            f"--workdir={workdir}",
            f"--steps={steps}",
            "--report=none",  # the resume is the test, not the report's figures
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert f"resuming from checkpoint {complete[-1]}" in result.stdout
    assert not [p for p in checkpoints_dir.iterdir() if "tmp" in p.name]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["resumed_from_step"] == complete[-1]


def saved_at(workdir, step):
    """When Orbax began and finished writing a step, in seconds since the epoch."""
    meta = json.loads((workdir / "checkpoints" / str(step) / "_CHECKPOINT_METADATA").read_text())
    return meta["init_timestamp_nsecs"] / 1e9, meta["commit_timestamp_nsecs"] / 1e9


@pytest.mark.slow
def test_the_time_floor_spaces_saves_and_bounds_what_a_kill_loses(tmp_path):
    """Saves due every 5 steps (milliseconds; without a floor each starts when the last is
    written) but at least FLOOR s apart: each starts FLOOR s after the last, or once
    the last is written if that took longer (then up to SLACK, or that save's own writing time
    on a loaded machine, for the next due step and the save's start), and a
    SIGKILL at a random moment loses what was trained since the newest complete save began:
    at most that bound plus the writing time of the save in progress (the README's bound)."""
    floor, slack = 2.0, 2.0
    workdir = tmp_path / "w"
    process = start_main(
        workdir,
        "--steps=1000000",
        "--checkpoint_every=5",
        "--log_every=1000000",
        f"--config.checkpoint_min_interval_secs={floor}",
        "--config.max_to_keep=1000",
        "--report=none",
    )
    checkpoints_dir = workdir / "checkpoints"
    wait_for(  # complete steps only: a save being written is a "<step>.orbax-checkpoint-tmp-*"
        lambda: (
            checkpoints_dir.is_dir()
            and sum(p.name.isdigit() for p in checkpoints_dir.iterdir()) >= 3
        )
    )
    time.sleep(np.random.default_rng().uniform(0, 2 * floor))
    process.kill()
    killed_at = time.time()
    process.wait()
    steps = checkpoint.Checkpoints(workdir, read_only=True).steps()
    began, ended = np.array([saved_at(workdir, step) for step in steps]).T
    writing = ended - began
    assert len(steps) >= 3 and all(np.diff(steps) >= 5)
    assert np.diff(began).min() >= 0.9 * floor, began  # never sooner than the floor
    # Nor much later than the floor or the write: then SLACK for the next due step and the
    # save's start (the last save's finalizing, Orbax's synchronous part), CPU work like the
    # writing itself, so as slow as that save's writing on a loaded machine (seconds).
    start = np.maximum(slack, writing[1:])
    due = np.maximum(floor, writing[:-1]) + start
    assert all(np.diff(began) <= due), (began, writing)
    assert killed_at - began[-1] <= max(floor, writing[-1]) + slack + writing.max()


def test_the_time_floor_counts_from_when_the_last_save_began():
    """Orbax dates a step when its synchronous part ends (seconds after the save began on a
    loaded machine): counted from there, a save due just past the floor after the last one
    began was skipped and the saves drifted apart by that part (as the slow test above saw)."""
    floor = checkpoint._TimeFloor(minimum_interval_secs=2.0)
    began = datetime.datetime.now(datetime.UTC)
    floor.began = (5, began)
    dated = ocp.checkpoint_manager.CheckpointInfo(5, began + datetime.timedelta(seconds=1.5), None)
    context = ocp.checkpoint_managers.DecisionContext(
        is_saving_in_progress=False,
        reached_preemption=False,
        multiprocessing_options=ocp.options.MultiprocessingOptions(),
    )

    def due_after(seconds, context=context):
        now = ocp.checkpoint_manager.CheckpointInfo(
            10, began + datetime.timedelta(seconds=seconds), None
        )
        return floor.should_save(now, [dated], context=context)

    assert due_after(2.1) and not due_after(1.9)
    assert not due_after(2.1, context=dataclasses.replace(context, is_saving_in_progress=True))
    floor.began = (4, began)  # another step's start: Orbax's date for step 5 stands
    assert not due_after(2.1) and due_after(3.6)


def test_a_run_killed_after_its_last_checkpoint_finishes_its_outputs(quick_config, tmp_path):
    quick_config.steps = 10
    train.train_and_evaluate(quick_config, tmp_path / "w")
    (tmp_path / "w" / "summary.json").unlink()  # as if killed before evaluation
    summary = train.train_and_evaluate(quick_config, tmp_path / "w")
    assert summary["resumed_from_step"] == 10
    assert summary["test_examples"] == 10_000
    assert (tmp_path / "w" / "summary.json").exists()


def test_a_step_that_was_not_saved_is_named_with_the_ones_that_were(trained):
    with pytest.raises(UserError, match=r"--step=150: .* has checkpoints for steps \[100, 200\]"):
        load_model(trained[0], step=150)


def test_keep_best_keeps_the_best_evaluated_step_beside_the_newest(tmp_path):
    """Saves at steps 2..7 with test accuracies 0.5, 0.9, -, 0.6, 0.7, 0.65, max_to_keep=2:
    the newest two and the best (step 3) stay, across a restart; --step=best restores step 3,
    and is one line where no kept step was evaluated."""
    config = load_config("default")
    model, optimizer = train.create_train_state(config, (28, 28, 1), 10, parallel.make_mesh())
    metadata = {"config": config.to_dict(), "dataset": inference.template().unrecorded_dataset}

    def save(steps_and_accuracies):
        manager = checkpoint.Checkpoints(tmp_path, max_to_keep=2, keep_best=True, metadata=metadata)
        for step, accuracy in steps_and_accuracies:
            progress = Schedule(config, 117).progress(step)
            if accuracy is not None:
                progress["test_accuracy"] = accuracy
            manager.save(step, model, optimizer, progress)
        manager.close()
        return manager.steps()

    assert save([(1, None)]) == [1]
    with pytest.raises(UserError, match=r"--step=best: no checkpoint in .* was saved at an eval"):
        inference.restore_model(tmp_path, checkpoint.BEST)
    assert save([(2, 0.5), (3, 0.9), (4, None), (5, 0.6)]) == [3, 4, 5]
    assert save([(6, 0.7), (7, 0.65)]) == [3, 6, 7]
    reader = checkpoint.Checkpoints(tmp_path, read_only=True)
    assert reader.best_steps()[0] == 3
    reader.close()
    assert inference.restore_model(tmp_path, checkpoint.BEST)[1] == 3


def test_keep_best_ranks_by_the_configs_best_metric_and_refuses_one_never_evaluated(tmp_path):
    """With config.best_metric=val_accuracy the best step is the best validation accuracy's,
    not the test accuracy's, for the run and for a reader of its workdir; a metric that an
    evaluation does not have is one line naming the ones it has (`unranked`: the loop says it
    once that step is saved)."""
    config = load_config("default")
    config.best_metric = "val_accuracy"
    model, optimizer = train.create_train_state(config, (28, 28, 1), 10, parallel.make_mesh())
    metadata = {"config": config.to_dict(), "dataset": inference.template().unrecorded_dataset}
    manager = checkpoint.Checkpoints(tmp_path, max_to_keep=1, keep_best=True, metadata=metadata)
    for step, test, val in ((1, 0.9, 0.5), (2, 0.5, 0.8), (3, 0.95, 0.6)):
        progress = Schedule(config, 117).progress(step)
        manager.save(
            step, model, optimizer, progress | {"test_accuracy": test, "val_accuracy": val}
        )
    manager.close()
    assert manager.steps() == [2, 3]
    reader = checkpoint.Checkpoints(tmp_path, read_only=True)
    assert reader.best_steps() == [2, 3]  # by val_accuracy: step 3's test accuracy is higher
    reader.close()
    assert inference.restore_model(tmp_path, checkpoint.BEST)[1] == 2
    config.best_metric = "val_acuracy"
    metadata["config"] = config.to_dict()
    manager = checkpoint.Checkpoints(
        tmp_path / "typo", max_to_keep=1, keep_best=True, metadata=metadata
    )
    evaluated = {"test_accuracy": 0.9, "val_accuracy": 0.9}
    manager.save(4, model, optimizer, Schedule(config, 117).progress(4) | evaluated)
    line = str(manager.unranked(4, evaluated))
    manager.close()
    assert line.startswith("--config.best_metric=val_acuracy: the evaluation at step 4 has no")
    assert line.endswith("name one it has: test_accuracy, val_accuracy")
    assert "\n" not in line and manager.steps() == [4]  # saved, ranked nowhere
    assert manager.unranked(4, {"val_acuracy": 0.9}) is None


def test_step_best_names_the_damage_when_no_step_can_be_ranked(tmp_path):
    """Every step's progress item damaged (a hook's `epoch` of 1.0 once did it): --step=best
    said to train with keep_best=True, which the run had. It names the damage."""
    config = load_config("default")
    model, optimizer = train.create_train_state(config, (28, 28, 1), 10, parallel.make_mesh())
    metadata = {"config": config.to_dict(), "dataset": inference.template().unrecorded_dataset}
    manager = checkpoint.Checkpoints(tmp_path, max_to_keep=2, keep_best=True, metadata=metadata)
    for step in (1, 2):
        progress = Schedule(config, 117).progress(step) | {"test_accuracy": 0.5, "epoch": 1.0}
        manager.save(step, model, optimizer, progress)
    manager.close()
    reader = checkpoint.Checkpoints(tmp_path, read_only=True)
    with pytest.raises(UserError, match=r"^--step=best: checkpoint 2 in .* is damaged: its "):
        reader.best_steps()
    reader.close()


def test_a_checkpoint_directory_removed_under_a_run_is_made_again_at_the_next_save(
    tmp_path, capsys
):
    """`checkpoints/` removed by hand while a run trains (it was a FileNotFoundError traceback
    at the next save): one warning, the directory made again, the next saves listed, kept and
    rotated as before; --step=best and the newest step restore from them."""
    config = load_config("default")
    model, optimizer = train.create_train_state(config, (28, 28, 1), 10, parallel.make_mesh())
    metadata = {"config": config.to_dict(), "dataset": inference.template().unrecorded_dataset}
    manager = checkpoint.Checkpoints(tmp_path, max_to_keep=2, keep_best=True, metadata=metadata)
    accuracies = {1: 0.9, 2: None, 3: 0.5, 4: None, 5: 0.4}

    def save(step):
        progress = Schedule(config, 117).progress(step)
        if accuracies[step] is not None:
            progress["test_accuracy"] = accuracies[step]
        manager.save(step, model, optimizer, progress)

    for step in (1, 2):
        save(step)
    manager.wait()
    shutil.rmtree(manager.directory)
    save(3)
    manager.wait()
    assert manager.steps() == [3]  # Orbax's own list: the removed steps are no longer in it
    for step in (4, 5):
        save(step)
    manager.close()
    warned = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert warned == [
        f"warning: {manager.directory} was removed while this run trained, with what it held; "
        f"saving step 3 in {manager.directory} again"
    ]
    assert manager.steps() == [3, 4, 5]  # the newest two and the best of those saved since
    reader = checkpoint.Checkpoints(tmp_path, read_only=True)
    assert reader.best_steps()[0] == 3
    reader.close()
    assert inference.restore_model(tmp_path)[1] == 5


def truncate(path: pathlib.Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


# Damage of several kinds to step 200's model item, and the words that name it (it said
# `See full TensorStore details: <bound method pybind11_detail_function_record...`).
MODEL_DAMAGE = {
    "data cut short": (
        lambda model: [truncate(p, 10) for p in model.rglob("d/*")],
        "Requested byte range",
    ),
    "_METADATA deleted": (lambda model: (model / "_METADATA").unlink(), "has no _METADATA file"),
    "_METADATA cut short": (lambda model: truncate(model / "_METADATA", 20), "is not valid JSON"),
    "manifest cut short": (
        lambda model: truncate(model / "manifest.ocdbt", 5),
        "Error decoding manifest",
    ),
    "item deleted": (shutil.rmtree, "its model item is missing"),
}


@pytest.mark.usefixtures("quick_verdicts")
@pytest.mark.parametrize("damage", MODEL_DAMAGE)
def test_each_kind_of_damage_is_named_in_words(damage, trained, tmp_path):
    workdir = tmp_path / "w"
    shutil.copytree(trained[0], workdir)
    do, expected = MODEL_DAMAGE[damage]
    do(workdir / "checkpoints" / "200" / "model")
    with pytest.raises(restore.Damaged) as exc:
        load_model(workdir, 200)
    line = str(exc.value)
    assert line.startswith(f"checkpoint 200 in {workdir / 'checkpoints'} is damaged: "), line
    assert expected in line and "\n" not in line
    assert "<" not in line and "bound method" not in line and "tensorstore_spec" not in line
    reason = line.split(" is damaged: ", 1)[1]
    assert len(reason) <= errors.REASON_CHARS + 100  # a path besides the library's reason


# Saved JSON items edited by hand, and the field each line names (each was a traceback).
EDITED_ITEMS = [
    ("config", {"model": None}, "is damaged: its config item has model=null, not a JSON object"),
    ("dataset", {"image_shape": "x"}, 'its dataset item has image_shape="x", not [height, width]'),
    ("dataset", {"image_shape": [-1, 784, 1]}, "its dataset item has image_shape=[-1, 784, 1]"),
    ("dataset", {"class_names": 3}, "its dataset item has class_names=3, not a list"),
    ("config", {"ensemble": 5}, "its config item has ensemble=5, not a JSON object"),
    (
        "config",
        {"model": {"name": "mlp", "hidden": "x"}},
        "its saved config builds no model here (config.model.hidden='x' must be",
    ),
]


@pytest.mark.usefixtures("quick_verdicts")
@pytest.mark.parametrize(("item", "edit", "expected"), EDITED_ITEMS)
def test_an_edited_json_item_is_one_line_naming_the_checkpoint_and_field(
    item, edit, expected, trained, tmp_path
):
    workdir = tmp_path / "w"
    shutil.copytree(trained[0], workdir)
    for step in (100, 200):
        path = workdir / "checkpoints" / str(step) / item / "metadata"
        path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    with pytest.raises(UserError) as exc:
        load_model(workdir)
    line = str(exc.value)
    assert line.startswith(f"checkpoint 200 in {workdir / 'checkpoints'}") and expected in line
    assert "--config." not in line  # nothing the user passed is blamed


@pytest.mark.usefixtures("quick_verdicts")
def test_a_foreign_step_directory_is_named_for_a_reader(trained, tmp_path):
    """A reader took it for a step a live run rotated away."""
    workdir = tmp_path / "w"
    shutil.copytree(trained[0], workdir)
    foreign = workdir / "checkpoints" / "999"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match=f"^{re.escape(str(foreign))} is not a checkpoint this"):
        load_model(workdir)
    assert (foreign / "notes.txt").read_text() == "mine"


# --- Damage, never deleted on a guess; bounded reads; checksums (issue 61) ----------------------
def copy_of(trained, tmp_path) -> tuple[pathlib.Path, pathlib.Path]:
    """A copy of the trained run (steps 100 and 200) and its checkpoints directory."""
    workdir = tmp_path / "w"
    shutil.copytree(trained[0], workdir)
    return workdir, workdir / "checkpoints"


def resume_to(workdir: pathlib.Path, steps: int) -> dict:
    config = load_config("default")
    config.update(steps=steps, report="none", checkpoint_min_interval_secs=0.0)
    return train.train_and_evaluate(config, workdir)


def warnings_said(capsys) -> list[str]:
    """The warning lines on stderr since the last look, the no-GPU notice aside."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return [line for line in lines if "No GPU found" not in line]


def files_of(directory: pathlib.Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in directory.rglob("*")
        if p.is_file() and p.name != ".lock"
    }


def unmark(step_dir: pathlib.Path) -> None:
    """What the issue found: a step without its marker and manifests, its items still there."""
    (step_dir / checkpoint.STEP_MARKER).unlink()
    for manifest in step_dir.rglob("manifest.ocdbt"):
        manifest.unlink()


@pytest.mark.usefixtures("quick_verdicts")
def test_a_step_without_its_marker_is_set_aside_never_removed(trained, tmp_path, capsys):
    """It was removed ("half deleted when its run stopped"): a guess, which took the run's
    only checkpoint and trained again from step 0 over its summary."""
    workdir, steps = copy_of(trained, tmp_path)
    unmark(steps / "200")
    held = files_of(steps / "200")
    assert resume_to(workdir, 210)["resumed_from_step"] == 100
    aside = workdir / checkpoint.DAMAGED_DIR / "200"
    assert files_of(aside) == held  # every file, as it was
    assert warnings_said(capsys) == [
        f"warning: checkpoint 200 in {steps} is damaged (it has no {checkpoint.STEP_MARKER} file:"
        f" a save or removal cut short, or the file removed); moved it to {aside}; using "
        "checkpoint 100 instead"
    ]


@pytest.mark.usefixtures("quick_verdicts")
def test_an_only_step_without_its_marker_stops_the_run_and_nothing_changes(trained, tmp_path):
    workdir, steps = copy_of(trained, tmp_path)
    shutil.rmtree(steps / "100")
    unmark(steps / "200")
    before = files_of(workdir)
    with pytest.raises(UserError) as refused:
        resume_to(workdir, 200)
    assert str(refused.value).startswith(
        f"every checkpoint in {steps} is damaged (step 200; 200: it has no "
        f"{checkpoint.STEP_MARKER} file"
    )
    assert "nothing was trained, moved or overwritten" in str(refused.value)
    assert files_of(workdir) == before and not (workdir / checkpoint.DAMAGED_DIR).exists()


def test_rotation_removes_only_what_it_moved_aside_itself(tmp_path):
    """Rotation moves a step into ROTATED_DIR in one rename before removing it: what a kill
    leaves there is removed by the next writer, while a step directory without its marker
    among the steps is left for restore() to set aside."""
    config = load_config("default")
    model, optimizer = train.create_train_state(config, (28, 28, 1), 10, parallel.make_mesh())
    directory = tmp_path / "checkpoints"
    leftover = directory / checkpoint.ROTATED_DIR / "7" / "model"
    leftover.mkdir(parents=True)
    (leftover / "_METADATA").write_text("{}")  # a removal cut short by a kill
    (directory / "5" / "model").mkdir(parents=True)  # a step without its marker
    writer = checkpoint.Checkpoints(tmp_path, max_to_keep=1)
    assert not (directory / checkpoint.ROTATED_DIR).exists()
    assert (directory / "5" / "model").is_dir()
    shutil.rmtree(directory / "5")
    for step in (10, 20, 30):
        writer.save(step, model, optimizer, Schedule(config, 117).progress(step))
        writer.wait()
        on_disk = [p for p in directory.iterdir() if p.name.isdigit()]
        assert all((p / checkpoint.STEP_MARKER).exists() for p in on_disk), on_disk
    writer.close()
    assert sorted(p.name for p in directory.iterdir()) == ["30"]


@pytest.mark.usefixtures("quick_verdicts")
@pytest.mark.parametrize("item", ["dataset", "config"])
@pytest.mark.parametrize("value", ["null", "{}", "{not json"])
def test_a_damaged_json_item_of_the_newest_step_falls_back_to_the_one_before(
    item, value, trained, tmp_path, capsys
):
    """A reader (load_model, class_names) and a training run take step 100, each saying one
    `warning:` line (it was a traceback for `dataset`, an absl line for `config`)."""
    workdir, steps = copy_of(trained, tmp_path)
    (steps / "200" / item / "metadata").write_text(value)
    assert inference.restore_model(workdir)[1] == 100
    assert inference.class_names(workdir)[0] == "T-shirt/top"
    said = warnings_said(capsys)
    assert len(said) == 2 and said[0] == said[1], said  # one line for each of the two reads
    assert said[0].startswith(f"warning: checkpoint 200 in {steps} is damaged (its {item} item ")
    assert said[0].endswith("; using checkpoint 100 instead")
    assert resume_to(workdir, 210)["resumed_from_step"] == 100
    [line] = warnings_said(capsys)
    assert line.startswith(f"warning: checkpoint 200 in {steps} is damaged (its {item} item ")
    assert (workdir / checkpoint.DAMAGED_DIR / "200" / item / "metadata").read_text() == value


# Checkpoint files grown past what their kind can hold (it read each whole: 3.4-6.5 GB for
# 3 GB, then fell back with a JSON error), each with the size that is just too large.
GROWN = {
    "model/array_metadatas/process_0": lambda step: errors.FILE_LIMIT + 1,
    "model/manifest.ocdbt": lambda step: checkpoint.MANIFEST_LIMIT + 1,
    "optimizer/manifest.ocdbt": lambda step: checkpoint.MANIFEST_LIMIT + 1,
    "model/ocdbt.process_0/manifest.ocdbt": lambda step: checkpoint.MANIFEST_LIMIT + 1,
    "model/ocdbt.process_0/d/": lambda step: model_data_limit(step) + 1,
}


def model_data_limit(step: pathlib.Path) -> int:
    """The bound on a data file of a step's model item: its arrays at 16 bytes an element."""
    return checkpoint.data_limit(nnx.state(load_model(step.parents[1], int(step.name))))


def grown_file(step: pathlib.Path, name: str) -> pathlib.Path:
    """`name` under a step, or for a data directory its largest file, grown (sparse)."""
    path = step / name
    if name.endswith("/"):
        path = max(path.iterdir(), key=lambda p: p.stat().st_size)
    os.truncate(path, GROWN[name](step))
    return path


@pytest.mark.parametrize("name", list(GROWN))
def test_a_checkpoint_file_larger_than_its_kind_holds_is_refused_unread(name, trained, tmp_path):
    workdir, steps = copy_of(trained, tmp_path)
    path = grown_file(steps / "200", name)
    assert model_data_limit(steps / "100") < 8 << 20  # 235,146 parameters
    for read in (lambda: load_model(workdir), lambda: resume_to(workdir, 210)):
        with pytest.raises(errors.FileRefused, match=f"^{re.escape(str(path))} holds more than"):
            read()
    assert sorted(p.name for p in steps.iterdir()) == ["100", "200"]
    assert not (workdir / checkpoint.DAMAGED_DIR).exists()


def flip_a_bit(step: pathlib.Path, where: float) -> None:
    """One bit of the largest model data file flipped, `where` of the way into it, as a disk
    or a copy would: the file keeps its size, and the arrays read back still decode."""
    data = max((step / "model" / "ocdbt.process_0" / "d").iterdir(), key=lambda p: p.stat().st_size)
    content = bytearray(data.read_bytes())
    content[int(len(content) * where)] ^= 0x10
    data.write_bytes(bytes(content))


@pytest.mark.usefixtures("quick_verdicts")
@pytest.mark.parametrize("where", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_a_flipped_bit_in_a_saved_array_is_damage_and_the_step_before_is_used(
    where, trained, tmp_path, capsys
):
    """Most flips changed a parameter and nothing said so (test_loss 0.6422546 -> 0.6422232)."""
    workdir, steps = copy_of(trained, tmp_path)
    flip_a_bit(steps / "200", where)
    assert inference.restore_model(workdir)[1] == 100
    [line] = warnings_said(capsys)
    assert line.startswith(f"warning: checkpoint 200 in {steps} is damaged ("), line
    assert line.endswith("; using checkpoint 100 instead"), line


@pytest.mark.usefixtures("quick_verdicts")
def test_arrays_that_differ_from_those_saved_are_damage_not_divergence(trained, tmp_path, capsys):
    """Step 200's model item replaced by one holding NaN: it said "not all finite ... train
    again with a lower --learning_rate". Its checksums name the array that changed."""
    workdir, steps = copy_of(trained, tmp_path)
    model = load_model(workdir)
    model.layers[0].kernel[...] = jax.numpy.full_like(model.layers[0].kernel[...], np.nan)
    other = checkpoint.Checkpoints(tmp_path / "other")
    optimizer = train.create_optimizer(model, load_config("default"))
    other.save(200, model, optimizer, Schedule(load_config("default"), 117).progress(200))
    other.close()
    shutil.rmtree(steps / "200" / "model")
    shutil.copytree(other.directory / "200" / "model", steps / "200" / "model")
    assert inference.restore_model(workdir)[1] == 100
    assert warnings_said(capsys) == [
        f"warning: checkpoint 200 in {steps} is damaged (its model array layers.0.kernel does "
        "not match the checksum saved with it: its bytes changed since the save); using "
        "checkpoint 100 instead"
    ]
    with pytest.raises(restore.Damaged, match=r"layers\.0\.kernel does not match the checksum"):
        load_model(workdir, 200)
    resume_to(workdir, 210)
    assert (workdir / checkpoint.DAMAGED_DIR / "200" / "model").is_dir()


def test_each_array_saved_has_a_checksum_and_a_step_saved_without_them_restores(trained, tmp_path):
    workdir, steps = copy_of(trained, tmp_path)
    recorded = json.loads((steps / "200" / checkpoint.CHECKSUMS / "metadata").read_text())
    model = load_model(workdir)
    assert recorded["model"].keys() == checkpoint.named_leaves(nnx.state(model)).keys()
    assert len(recorded["optimizer"]) > 2 * len(recorded["model"])  # Adam's two moments
    assert all(len(entry["crc32"]) == 8 for entry in recorded["model"].values())
    # Saved before checksums, or by several processes: read without the check (step 100's
    # arrays under step 200 restore as step 200's).
    shutil.rmtree(steps / "200" / checkpoint.CHECKSUMS)
    shutil.rmtree(steps / "200" / "model")
    shutil.copytree(steps / "100" / "model", steps / "200" / "model")
    assert inference.restore_model(workdir)[1] == 200


@pytest.mark.parametrize("link", ["to nothing", "loop"])
def test_a_workdir_that_is_a_broken_symbolic_link_is_named_for_what_it_is(
    link, quick_config, tmp_path
):
    """It said "--workdir W is not writable (File exists)"; eval said "does not exist"."""
    workdir = tmp_path / "w"
    workdir.symlink_to(tmp_path / "gone" if link == "to nothing" else workdir)
    what = (
        f"is a symbolic link to nothing ({tmp_path / 'gone'})"
        if link == "to nothing"
        else ("is a symbolic link loop")
    )
    with pytest.raises(UserError, match=re.escape(f"({workdir} {what})")):
        train.train_and_evaluate(quick_config, workdir)
    with pytest.raises(UserError, match=re.escape(f"--workdir {workdir} {what}; pass the")):
        load_model(workdir)
    assert workdir.is_symlink()


@pytest.mark.parametrize(
    ("step", "expected"),
    [("100", 100), (100, 100), (np.int64(200), 200), (10.0, None), (True, None), (-1, None)],
)
def test_load_model_takes_a_step_as_a_whole_number_or_its_digits(step, expected, trained):
    """ "10" said "--step=10: ... has checkpoints for steps [10, 20]"; 10.0 that the step was
    rotated away."""
    if expected is None:
        with pytest.raises(UserError, match=re.escape(f"step={step!r} is not a step number")):
            load_model(trained[0], step)
    else:
        assert inference.restore_model(trained[0], step)[1] == expected


def test_a_checkpoint_directory_made_for_nothing_is_not_left_behind(tmp_path):
    """A run stopped before its first save left an empty checkpoints/ in its --workdir."""
    made = checkpoint.Checkpoints(tmp_path / "new")
    made.close()
    assert not made.directory.exists() and (tmp_path / "new").is_dir()
    (tmp_path / "mine" / "checkpoints").mkdir(parents=True)  # not made by the run: kept
    kept = checkpoint.Checkpoints(tmp_path / "mine")
    kept.close()
    assert kept.directory.is_dir()
