"""The run directory: fresh names, refusals, atomic JSON and the metrics log a resume trims."""

from __future__ import annotations

import concurrent.futures
import errno
import json
import math
import os
import threading

import pytest
from conftest import within

from fmnist_flax.runtime import errors, export, inference, workdir
from fmnist_flax.runtime.errors import UserError


def test_a_finished_run_without_checkpoints_is_not_overwritten(tmp_path):
    workdir.write_json(tmp_path / workdir.SUMMARY_FILE, {"test_accuracy": 0.9})
    with pytest.raises(UserError, match="already holds a finished run"):
        workdir.prepare_workdir(tmp_path)
    assert json.loads((tmp_path / workdir.SUMMARY_FILE).read_text()) == {"test_accuracy": 0.9}
    assert not list(tmp_path.glob("*.tmp"))


def test_runs_started_in_the_same_second_get_a_directory_each(tmp_path, monkeypatch):
    """A fresh run makes its directory rather than picking a free name: runs started together
    never share one (the second would be refused as in use)."""
    monkeypatch.chdir(tmp_path)
    barrier = threading.Barrier(8)

    def fresh(_):
        barrier.wait()
        return workdir.prepare_workdir(None)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        made = list(pool.map(fresh, range(8)))
    assert len(set(made)) == 8 and all(path.parent == workdir.RUNS_DIR for path in made)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(p.name for p in made)


def test_a_runs_path_that_can_hold_no_run_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("notes")  # a file where the runs go
    with pytest.raises(UserError, match=r"a run directory in runs/ \(runs is not a directory\)"):
        workdir.prepare_workdir(None)
    assert (tmp_path / "runs").read_text() == "notes"


@pytest.mark.parametrize("written", [None, "metrics.jsonl", "checkpoints/1/x", "tensorboard/e"])
def test_only_a_run_directory_with_nothing_written_is_removed(tmp_path, written):
    (tmp_path / "checkpoints" / "1").mkdir(parents=True)  # what a stop during set-up leaves
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / workdir.LOCK_FILE).write_text("pid 1\n")
    if written:
        (tmp_path / written).write_text("")
    workdir.remove_if_unused(tmp_path)
    assert tmp_path.exists() == bool(written)
    workdir.remove_if_unused(tmp_path / "gone")  # nothing there: nothing to do
    if written:
        assert (tmp_path / written).exists() and (tmp_path / workdir.LOCK_FILE).exists()


def test_a_resumed_metrics_log_keeps_rows_up_to_the_checkpoint_only(tmp_path):
    path = tmp_path / workdir.METRICS_FILE
    log = workdir.MetricsLog(path)
    for step in (1, 25, 50, 75):
        log.write({"step": step, "loss": 1.0 / step})
    log.close()
    workdir.MetricsLog(path, keep_until=50).close()
    assert [row["step"] for row in workdir.read_jsonl(path)] == [1, 25, 50]


def test_the_summary_records_versions_and_memory():
    assert set(workdir.versions()) == {"jax", "flax", "optax"}
    assert workdir.peak_rss_mb() > 10


def test_a_json_write_replaces_a_symlink_and_leaves_its_target_alone(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    link = tmp_path / "out.json"
    link.symlink_to(victim)
    workdir.write_json(link, {"a": 1})
    assert not link.is_symlink() and json.loads(link.read_text()) == {"a": 1}
    assert victim.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "victim.txt"]


@pytest.mark.parametrize("name", ["x" * 300, "null/w"])
def test_a_workdir_the_filesystem_refuses_is_one_line(tmp_path, name):
    if name == "null/w":  # a path through a file
        (tmp_path / "null").write_text("")
    with pytest.raises(UserError, match=r"^--workdir .*"):
        workdir.prepare_workdir(tmp_path / name)


def test_the_lock_holds_whatever_happens_to_the_lock_file(tmp_path):
    """The flock is on the workdir directory itself: deleting `.lock`, or putting a symlink
    in its place, lets no second trainer in, and the symlink's target is never written."""
    held = workdir.Lock(tmp_path)
    assert "pid " in (tmp_path / workdir.LOCK_FILE).read_text()
    (tmp_path / workdir.LOCK_FILE).unlink()
    with pytest.raises(UserError, match="is in use by a training run"):
        workdir.Lock(tmp_path)
    victim = tmp_path.parent / f"{tmp_path.name}-victim.txt"
    victim.write_text("keep me")
    (tmp_path / workdir.LOCK_FILE).symlink_to(victim)
    with pytest.raises(UserError, match=r"is in use by a training run \(another process\)"):
        workdir.Lock(tmp_path)
    held.release()
    again = workdir.Lock(tmp_path)  # released: the next trainer gets it
    assert not (tmp_path / workdir.LOCK_FILE).is_symlink() and victim.read_text() == "keep me"
    again.release()


def test_metrics_rows_someone_else_wrote_are_left_out_not_a_traceback(tmp_path):
    path = tmp_path / workdir.METRICS_FILE
    path.write_bytes(
        b'{"step": 1, "loss": 2.5}\n\xff\xfe garbage\n{"step": "5", "loss": 1.0}\n'
        b'{"step": 10, "loss": "low"}\n[1, 2]\n{"step": 20, "loss": 0.5}\n{"step": 2'
    )
    assert workdir.read_jsonl(path) == [{"step": 1, "loss": 2.5}, {"step": 20, "loss": 0.5}]
    workdir.MetricsLog(path, keep_until=20).close()
    assert [row["step"] for row in workdir.read_jsonl(path)] == [1, 20]
    path.unlink()
    path.mkdir()
    with pytest.raises(UserError, match=r"metrics\.jsonl is a directory; move it out of the way"):
        workdir.MetricsLog(path, keep_until=20)


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b"\xff\xfe", None])
def test_an_unreadable_summary_reads_as_none(tmp_path, content):
    path = tmp_path / workdir.SUMMARY_FILE
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    assert workdir.read_json(path) is None


def put(path, kind: str) -> str:
    """A FIFO nobody writes, or a symlink to a device, at `path`; what the refusal calls it."""
    if kind == "fifo":
        os.mkfifo(path)
        return "is a FIFO, not a regular file"
    os.symlink(kind, path)
    return f"is a character device (a symbolic link to {kind}), not a regular file"


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "/dev/full"])
def test_a_fifo_or_a_device_where_the_run_reads_its_files_is_one_line_naming_it(tmp_path, kind):
    """Each waited for ever (a FIFO) or read without end until MemoryError (/dev/zero)."""
    metrics, summary = tmp_path / workdir.METRICS_FILE, tmp_path / workdir.SUMMARY_FILE
    said = [put(metrics, kind), put(summary, kind)]
    calls = [
        (metrics, lambda: workdir.read_jsonl(metrics)),
        (metrics, lambda: workdir.MetricsLog(metrics, keep_until=20)),
        (summary, lambda: workdir.read_json(summary)),
    ]
    for path, call in calls:
        with within(10), pytest.raises(UserError) as raised:
            call()
        assert str(raised.value).startswith(f"{path} {said[0]}; move it away"), raised.value
        assert "\n" not in str(raised.value)
    assert metrics.is_fifo() if kind == "fifo" else os.readlink(metrics) == kind  # left as it is


def test_a_file_larger_than_the_program_writes_is_refused_unread(tmp_path):
    """A sparse metrics.jsonl one byte over the limit: refused from its size, none of it read;
    a JSON file over its limit likewise."""
    path = tmp_path / workdir.METRICS_FILE
    with path.open("wb") as file:
        file.truncate(workdir.METRICS_LIMIT + 1)
    with pytest.raises(UserError, match="holds more than the 268,435,456 bytes this program"):
        workdir.read_jsonl(path)
    path.write_text('{"step": 1, "loss": 2.0}\n')
    assert workdir.read_jsonl(path) == [{"step": 1, "loss": 2.0}]
    summary = tmp_path / workdir.SUMMARY_FILE
    summary.write_text("{}" * 6)
    with pytest.raises(UserError, match=r"summary\.json holds more than the 10 bytes"):
        errors.read_file(summary, limit=10)


def test_each_cause_of_a_failed_write_gets_its_own_remedy():
    """A permission error and EFBIG were both told to "free space"."""
    cases = {
        errno.ENOSPC: "free some space",
        errno.EDQUOT: "free some space",
        errno.EFBIG: "raise the file size limit (ulimit -f",
        errno.EACCES: "make it writable (or run as its owner)",
        errno.EPERM: "make it writable (or run as its owner)",
        errno.EROFS: "make its filesystem writable",
    }
    for code, remedy in cases.items():
        wrapped = RuntimeError("the library's words")
        wrapped.__cause__ = OSError(code, os.strerror(code))
        assert workdir.remedy(wrapped).startswith(remedy), (code, workdir.remedy(wrapped))
    assert workdir.remedy(None) == "free some space"  # a save refused before it began


def a_training_run(path):
    """A workdir as training leaves it: a step's Orbax files, its metrics and summary."""
    (path / "checkpoints" / "50" / "model").mkdir(parents=True)
    (path / "checkpoints" / "50" / "model" / "_METADATA").write_text("orbax")
    (path / "tensorboard").mkdir()
    (path / "report").mkdir()
    (path / "report" / "report.html").write_text("the run's own report")
    for name in (workdir.METRICS_FILE, workdir.SUMMARY_FILE):
        (path / name).write_text("the run's own")
    return path


@pytest.mark.parametrize(
    "inside",
    [
        "checkpoints/50/model/_METADATA",
        "checkpoints/51/x.json",
        "checkpoints",
        "metrics.jsonl",
        "summary.json",
        "tensorboard/eval.json",
        "report/report.html",
        "report",
        "damaged_checkpoints/20/x.json",
        ".lock",
    ],
)
def test_an_output_inside_a_training_runs_own_files_is_refused(tmp_path, inside):
    """An export over checkpoints/50/model/_METADATA damaged the only checkpoint (the next
    run set it aside and started from scratch); an eval over metrics.jsonl replaced its rows."""
    run = a_training_run(tmp_path / "w")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    calls = [
        lambda: export.export_model(run, run / inside),
        lambda: inference.run_eval(run, output=str(run / inside)),
        lambda: inference.run_predict(run, [str(tmp_path / "a.png")], output=str(run / inside)),
    ]
    for call in calls:
        with pytest.raises(UserError) as exc:
            call()
        message = str(exc.value)
        assert f"--output {run / inside} would land in the training run {run}'s own" in message
        assert "\n" not in message
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_an_output_reaching_a_runs_files_through_a_symlink_is_refused(tmp_path):
    run = a_training_run(tmp_path / "w")
    (tmp_path / "link.json").symlink_to(run / workdir.METRICS_FILE)
    (tmp_path / "into").symlink_to(run / "checkpoints")
    for output in (tmp_path / "link.json", tmp_path / "into" / "out.json"):
        with pytest.raises(UserError, match="would land in the training run"):
            workdir.check_output_path(str(output))


def test_outputs_beside_a_run_or_in_a_plain_checkpoints_folder_are_allowed(tmp_path):
    run = a_training_run(tmp_path / "w")
    workdir.check_output_path(str(run / "eval.json"))  # the run's own directory, a new file
    (tmp_path / "mine" / "checkpoints").mkdir(parents=True)  # not a training run's
    workdir.check_output_path(str(tmp_path / "mine" / "checkpoints" / "model.jaxexport"))


def test_json_the_run_writes_has_null_where_a_value_is_not_finite(tmp_path):
    """NaN and Infinity are not JSON: summary.json and metrics.jsonl hold null for them, and
    a row with null is still read back as a row on resume, the null as NaN (a number every
    table and figure can show)."""
    value = {"a": float("nan"), "b": [1.5, float("inf")], "c": {"d": -float("inf")}, "e": 2}
    workdir.write_json(tmp_path / "s.json", value)
    assert json.loads((tmp_path / "s.json").read_text()) == {
        "a": None,
        "b": [1.5, None],
        "c": {"d": None},
        "e": 2,
    }
    log = workdir.MetricsLog(tmp_path / "metrics.jsonl")
    log.write({"step": 5, "loss": 0.5, "macro_f1": float("nan")})
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text() == (
        '{"step": 5, "loss": 0.5, "macro_f1": null}\n'
    )
    kept = workdir.MetricsLog(tmp_path / "metrics.jsonl", keep_until=5)
    kept.close()
    [row] = workdir.read_jsonl(tmp_path / "metrics.jsonl")
    assert row.keys() == {"step", "loss", "macro_f1"} and row["loss"] == 0.5
    assert math.isnan(row["macro_f1"])


@pytest.mark.parametrize("what", ["the file", "the workdir"])
def test_a_metrics_file_removed_under_a_run_is_written_again_whole(tmp_path, capsys, what):
    """metrics.jsonl (or its directory) deleted while rows are appended: the next row writes
    the file again with every row so far, after one warning line; nothing is lost."""
    import shutil

    path = tmp_path / "w" / "metrics.jsonl"
    path.parent.mkdir()
    log = workdir.MetricsLog(path)
    log.write({"step": 1, "loss": 2.0})
    if what == "the file":
        path.unlink()
    else:
        shutil.rmtree(path.parent)
    log.write({"step": 2, "loss": 1.0})
    log.write({"step": 3, "loss": 0.5})
    log.close()
    assert [row["step"] for row in workdir.read_jsonl(path)] == [1, 2, 3]
    warnings = [line for line in capsys.readouterr().err.splitlines() if line]
    assert warnings == [
        f"warning: {path} was removed while this run trained; it is written again with every "
        "row so far"
    ]
