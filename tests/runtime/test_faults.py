"""Faults a real run meets, caused for real on real processes: a second trainer, a reader of a
live run, a full disk, files that are not ours, permissions, signals at the end, damaged items.

Each asserts the exit code, the one line a user reads, and that nothing saved was lost. Full
disks are tmpfs mounts when the test runs as root (as CI does) and a file-size limit
(RLIMIT_FSIZE, which any user can set) otherwise. Root reads and writes through any permission,
so permission faults run root's process without the capabilities that let it (setpriv).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from conftest import EVERY_DUE_SAVE, REPO, run_main, run_main_measured, start_main, wait_for

from fmnist_flax.runtime import checkpoint

pytestmark = pytest.mark.slow
QUICK = ("--report=none", "--log_every=5", EVERY_DUE_SAVE)
IS_ROOT = os.geteuid() == 0
PIPE_CLOSED = 128 + signal.SIGPIPE  # the status of a pipe's writer whose reader left


def the_error(result: subprocess.CompletedProcess, expected: str, code: int = 1) -> str:
    """The run exited with `code` and said one `error:` line containing `expected`; besides it,
    stderr holds only the no-GPU notice: no traceback, no library's log."""
    assert result.returncode == code, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    others = [line for line in lines if line not in errors and "No GPU found" not in line]
    assert len(errors) == 1 and not others, result.stderr
    assert expected in errors[0], errors[0]
    return errors[0]


def start(workdir: pathlib.Path, *flags: str, **kwargs) -> subprocess.Popen:
    return start_main(workdir, *flags, stdout=subprocess.DEVNULL, **kwargs)


def saved_steps(workdir: pathlib.Path) -> list[int]:
    directory = workdir / "checkpoints"
    if not directory.is_dir():
        return []
    return sorted(
        int(p.name)
        for p in directory.iterdir()
        if p.name.isdigit() and (p / checkpoint.STEP_MARKER).exists()
    )


def freeze_when(
    process: subprocess.Popen, find: Callable[[], list], what: str, timeout: float = 120
) -> list:
    """Freezes `process` (SIGSTOP) at a moment `find()` returns something, and returns what it
    finds once the process is frozen; a moment that passed before the signal landed is let go
    (SIGCONT) and the next one is awaited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if find():
            process.send_signal(signal.SIGSTOP)
            found = find()
            if found:
                return found
            process.send_signal(signal.SIGCONT)
    pytest.fail(f"no {what} was caught in {timeout} s")


def finish(process: subprocess.Popen, signum: int = signal.SIGTERM) -> subprocess.CompletedProcess:
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def sizes(directory: pathlib.Path) -> dict[str, int]:
    return {str(p.relative_to(directory)): p.stat().st_size for p in directory.rglob("*")}


def snapshot(directory: pathlib.Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> pathlib.Path:
    """A finished 20-step run with checkpoints at 10 and 20; tests work on copies of it."""
    workdir = tmp_path_factory.mktemp("faults") / "w"
    result = run_main(f"--workdir={workdir}", "--steps=20", "--checkpoint_every=10", *QUICK)
    assert result.returncode == 0, result.stderr
    return workdir


@pytest.fixture
def copy(trained, tmp_path) -> pathlib.Path:
    shutil.copytree(trained, tmp_path / "w")
    return tmp_path / "w"


def run_bound_by_permissions(*args: str) -> subprocess.CompletedProcess:
    """`main.py ARGS` in a process that file permissions bind: for root, one without the
    capabilities that override them."""
    if not IS_ROOT:
        return run_main(*args)
    setpriv = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]
    return subprocess.run(
        [*setpriv, sys.executable, str(REPO / "main.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@contextlib.contextmanager
def permissions(path: pathlib.Path, mode: int):
    """`path` with `mode` for the block, then as before (so the test's files can be removed)."""
    before = path.stat().st_mode
    path.chmod(mode)
    try:
        yield path
    finally:
        path.chmod(before)


@contextlib.contextmanager
def small_disk(path: pathlib.Path, options: str):
    """A tmpfs of the given size/inode options at `path` (root only)."""
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


# --- Concurrent use -----------------------------------------------------------------------------


def test_a_second_trainer_is_refused_and_a_killed_ones_lock_blocks_nothing(tmp_path):
    workdir = tmp_path / "w"
    first = start(workdir, "--steps=1000000", "--checkpoint_every=50", *QUICK)
    wait_for(lambda: saved_steps(workdir))
    second = run_main(f"--workdir={workdir}", "--steps=10", *QUICK)
    the_error(second, f"--workdir {workdir} is in use by a training run (pid {first.pid} on ")
    first.kill()
    first.wait()
    kept = saved_steps(workdir)
    again = run_main(f"--workdir={workdir}", f"--steps={kept[-1] + 5}", *QUICK)
    assert again.returncode == 0, again.stderr
    assert f"resuming from checkpoint {kept[-1]}" in again.stdout


def test_evaluating_a_live_run_neither_disturbs_it_nor_writes_into_it(tmp_path):
    workdir = tmp_path / "w"
    trainer = start(workdir, "--steps=1000000", "--checkpoint_every=100", *QUICK)
    wait_for(lambda: saved_steps(workdir))
    for attempt in range(3):
        output = tmp_path / f"eval{attempt}.json"
        result = run_main("--mode=eval", f"--workdir={workdir}", f"--output={output}")
        assert result.returncode == 0, result.stderr
        assert json.loads(output.read_text())["test_examples"] == 10_000
    assert trainer.poll() is None, "the trainer died while it was being read"
    stopped = finish(trainer)
    the_error(stopped, "resume by running the same command", code=128 + signal.SIGTERM)
    assert not list(workdir.glob("*.json"))  # readers never write into the workdir


# --- Full disks ---------------------------------------------------------------------------------


def test_a_save_that_fails_mid_write_is_one_line_and_the_run_resumes(copy):
    """The file-size limit makes tensorstore's writes fail in Orbax's threads, as a disk that
    fills during a save does; the earlier checkpoints and metrics.jsonl stay usable."""
    before = snapshot(copy / "checkpoints")

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))

    result = run_main(
        f"--workdir={copy}", "--steps=40", "--checkpoint_every=10", *QUICK, preexec_fn=limit
    )
    line = the_error(result, "could not write checkpoint 30 in ")
    assert "(File too large;" in line and "resume from checkpoint 20" in line
    assert {k: v for k, v in snapshot(copy / "checkpoints").items() if k in before} == before
    resumed = run_main(f"--workdir={copy}", "--steps=40", "--checkpoint_every=10", *QUICK)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming from checkpoint 20" in resumed.stdout
    rows = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 5, 10, 15, 20, 25, 30, 35, 40]


@pytest.mark.skipif(not IS_ROOT, reason="mounting a tmpfs needs root; the test above covers it")
def test_a_full_disk_stops_before_the_save_and_resumes_once_space_is_back(copy, tmp_path):
    with small_disk(tmp_path / "disk", "size=9m") as disk:
        workdir = disk / "w"
        shutil.copytree(copy, workdir)
        shutil.rmtree(workdir / "checkpoints" / "10")
        result = run_main(f"--workdir={workdir}", "--steps=200", "--checkpoint_every=10", *QUICK)
        line = the_error(result, f"in {workdir / 'checkpoints'}, which has ")
        assert (
            " MB and " in line
            and f"free some space and run again with --workdir={workdir} " in line
        )
        kept = saved_steps(workdir)
        assert kept and kept[0] == 20
        for row in (workdir / "metrics.jsonl").read_text().splitlines():
            json.loads(row)  # every line whole
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        resumed = run_main(f"--workdir={workdir}", "--steps=60", "--checkpoint_every=10", *QUICK)
        assert resumed.returncode == 0, resumed.stderr
        assert f"resuming from checkpoint {kept[-1]}" in resumed.stdout


@pytest.mark.skipif(not IS_ROOT, reason="mounting a tmpfs needs root")
def test_a_file_size_limit_is_named_as_such_not_as_a_full_disk(tmp_path):
    """A save failing with EFBIG under `ulimit -f` said "free some space"."""

    def cap_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (200 * 1024, resource.RLIM_INFINITY))

    workdir = tmp_path / "w"
    result = run_main(f"--workdir={workdir}", "--steps=10", *QUICK, preexec_fn=cap_files)
    line = the_error(result, f"could not write checkpoint 10 in {workdir / 'checkpoints'} (File")
    assert "raise the file size limit (ulimit -f, 204,800 bytes now) and run again" in line
    assert "free some space" not in line


def test_no_inodes_left_is_one_line_naming_the_inodes(tmp_path):
    with small_disk(tmp_path / "disk", "size=64m,nr_inodes=40") as disk:
        result = run_main(f"--workdir={disk / 'w'}", "--steps=20", *QUICK)
        line = the_error(result, "inodes free in ")
        assert "needs about" in line and "100 inodes" in line


# --- The compilation cache ---------------------------------------------------------------------


def cached_run(cache: pathlib.Path, workdir: pathlib.Path, bound: bool = False) -> list[str]:
    """A 20-step run compiling into `cache` (bound by file permissions, if asked): it succeeds
    and says nothing but its `warning:` lines, returned."""
    args = (f"--workdir={workdir}", "--steps=20", "--report=none", f"--compilation_cache={cache}")
    result = run_bound_by_permissions(*args) if bound else run_main(*args)
    warned, errors = warnings_and_errors(result.stderr)
    assert result.returncode == 0 and not errors, result.stderr
    return warned


def test_cache_entries_cut_short_are_one_line_and_saved_whole_again(tmp_path):
    """What a kill while JAX writes an entry, or a full disk, leaves: JAX used to warn twice a
    line and compile those programs again in every later run, never rewriting them. A cache
    that cannot be written is one line too."""
    cache = tmp_path / "jax"
    assert cached_run(cache, tmp_path / "a") == []
    for entry in cache.glob("*-cache"):
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    [warned] = cached_run(cache, tmp_path / "b")
    assert f"the compilation cache {cache} held entries cut short" in warned
    assert cached_run(cache, tmp_path / "c") == []  # saved whole: read without a word
    [chunk] = cache.glob("jit_train_chunk-*-cache")
    chunk.unlink()  # to be compiled and saved again, into another user's cache, say
    with permissions(cache, 0o555):
        [warned] = cached_run(cache, tmp_path / "d", bound=True)
    assert f"save a compiled program in the compilation cache {cache} (PermissionError" in warned


@pytest.mark.skipif(not IS_ROOT, reason="mounting a tmpfs needs root; the test above covers it")
def test_a_full_disk_under_the_cache_is_one_line_and_leaves_nothing_cut_short(tmp_path):
    with small_disk(tmp_path / "disk", "size=120k") as disk:
        cache = disk / "jax"
        [warned] = cached_run(cache, tmp_path / "a")
        assert f"could not save a compiled program in the compilation cache {cache} (" in warned
        assert "No space left on device" in warned
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        assert cached_run(cache, tmp_path / "b") == []  # no entry cut short was left behind


# --- Files that are not ours --------------------------------------------------------------------


def test_a_foreign_step_directory_is_refused_and_kept(copy):
    (copy / "checkpoints" / "5").mkdir()
    (copy / "checkpoints" / "5" / "notes.txt").write_text("mine")
    result = run_main(f"--workdir={copy}", "--steps=60", "--checkpoint_every=10", *QUICK)
    the_error(result, f"{copy / 'checkpoints' / '5'} is not a checkpoint this project wrote")
    assert (copy / "checkpoints" / "5" / "notes.txt").read_text() == "mine"


def test_a_step_damaged_twice_is_set_aside_under_a_new_name(copy):
    aside = copy / checkpoint.DAMAGED_DIR / "20"
    aside.mkdir(parents=True)
    (aside / "earlier.txt").write_text("set aside before")
    (copy / "checkpoints" / "20" / "progress" / "metadata").write_text("null")
    result = run_main(f"--workdir={copy}", "--steps=30", "--checkpoint_every=10", *QUICK)
    assert result.returncode == 0, result.stderr
    assert (
        f"warning: checkpoint 20 in {copy / 'checkpoints'} is damaged (its progress item is null"
        in result.stderr
    )
    assert "resuming from checkpoint 10" in result.stdout
    assert (aside / "earlier.txt").read_text() == "set aside before"
    assert (copy / checkpoint.DAMAGED_DIR / "20.1" / checkpoint.STEP_MARKER).exists()


def test_every_step_damaged_is_one_line_and_nothing_the_run_wrote_changes(copy):
    for step in (10, 20):
        (copy / "checkpoints" / str(step) / "progress" / "metadata").write_text("null")
    before = snapshot(copy)
    result = run_main(f"--workdir={copy}", "--steps=20", "--checkpoint_every=10", *QUICK)
    the_error(
        result,
        f"every checkpoint in {copy / 'checkpoints'} is damaged (steps 10, 20; 20: its progress "
        "item is null",
    )
    assert "pass a fresh --workdir" in result.stderr
    after = snapshot(copy)
    assert {k: v for k, v in after.items() if k != ".lock"} == {
        k: v for k, v in before.items() if k != ".lock"
    }


@pytest.mark.parametrize("item", ["config", "progress"])
@pytest.mark.parametrize("value", ["{}", "null", "[1]"])
def test_a_damaged_json_item_is_one_line_for_a_reader(copy, item, value):
    for step in (10, 20):
        (copy / "checkpoints" / str(step) / item / "metadata").write_text(value)
    result = run_main("--mode=eval", f"--workdir={copy}")
    if item == "config":
        the_error(result, f"checkpoint 20 in {copy / 'checkpoints'} is damaged: its config item")
    else:  # eval reads the parameters only: a damaged progress item does not stop it
        assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("name", "kind", "mode"),
    [
        ("metrics.jsonl", "fifo", "train"),
        ("metrics.jsonl", "/dev/zero", "train"),
        ("summary.json", "fifo", "train"),
        ("summary.json", "/dev/full", "train"),
        ("checkpoints/20/progress/metadata", "fifo", "train"),
        ("checkpoints/20/config/metadata", "/dev/zero", "train"),
        ("checkpoints/20/_CHECKPOINT_METADATA", "fifo", "train"),
        ("checkpoints/20/model/_METADATA", "/dev/zero", "eval"),
    ],
)
def test_a_fifo_or_a_device_among_a_runs_files_is_one_line_and_nothing_is_lost(
    copy, name, kind, mode
):
    """Each waited for ever on the FIFO, or read /dev/zero until 6.3 GB and MemoryError; the
    resume, or the eval, now stops with one line naming the file, and nothing saved moves."""
    path = copy / name
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink(kind, path)
    before = snapshot(copy)
    del before[".lock"]  # who last held the workdir: the refused run
    flags = ("--steps=30", *QUICK) if mode == "train" else ()
    result, peak, seconds = run_main_measured(
        f"--mode={mode}", f"--workdir={copy}", *flags, timeout=120
    )
    what = "a FIFO" if kind == "fifo" else f"a character device (a symbolic link to {kind})"
    the_error(result, f"error: {path} is {what}, not a regular file; move it away")
    assert peak < 2**30 and seconds < 30, (peak, seconds)
    assert snapshot(copy).items() >= before.items() and saved_steps(copy) == [10, 20]
    assert path.is_fifo() if kind == "fifo" else os.readlink(path) == kind


def test_an_unreadable_step_is_named_and_left_where_it_is(copy):
    step = copy / "checkpoints" / "20"
    with permissions(step, 0o000):
        for flags in (("--mode=train", "--steps=30", *QUICK), ("--mode=eval",)):
            result = run_bound_by_permissions(*flags, f"--workdir={copy}")
            the_error(result, "cannot be read (permission denied); fix its permissions")
    assert (step / checkpoint.STEP_MARKER).exists() and not (copy / checkpoint.DAMAGED_DIR).exists()


def test_an_unwritable_checkpoint_directory_is_one_line(copy):
    with permissions(copy / "checkpoints", 0o555):
        result = run_bound_by_permissions(f"--workdir={copy}", "--steps=30", *QUICK)
    the_error(result, f"cannot write checkpoints in {copy / 'checkpoints'} (Permission denied")
    assert saved_steps(copy) == [10, 20]


def test_an_unreadable_data_file_is_one_line(tmp_path):
    data = tmp_path / "data"
    shutil.copytree(pathlib.Path("/usr/share/datasets/fashion-mnist"), data)
    with permissions(data / "train-images-idx3-ubyte.gz", 0o000):
        result = run_bound_by_permissions(f"--workdir={tmp_path / 'w'}", f"--data_dir={data}")
    the_error(result, "train-images-idx3-ubyte.gz")


def test_an_output_in_an_unwritable_directory_is_refused_before_any_work(copy, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    with permissions(locked, 0o500):
        result = run_bound_by_permissions(
            "--mode=predict", f"--workdir={copy}", f"--output={locked / 'p.json'}", "--images=a.png"
        )
    line = the_error(result, f"--output {locked / 'p.json'}")
    assert "not writable" in line and not list(locked.iterdir())


# --- Signals at the end, config changes -----------------------------------------------------------


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_after_training_stops_the_run_at_once_and_the_same_command_finishes(
    signum, tmp_path
):
    """After training a signal stops the run where it is (here in the codelab's timings, left
    unfinished) with its line; summary.json already holds the training rate, and the same
    command finishes the outputs with that rate, never NaN."""
    workdir = tmp_path / "w"
    flags = ("--steps=30", "--report=full", "--log_every=10")
    process = start(workdir, *flags)

    def evaluated() -> bool:  # summary.json, written again before the demonstrations begin
        with contextlib.suppress(OSError, ValueError):
            return "test_accuracy" in json.loads((workdir / "summary.json").read_text())
        return False

    wait_for(evaluated)
    stopped = finish(process, signum)
    the_error(stopped, "its outputs (summary.json, the report) were not finished", 128 + signum)
    early = json.loads((workdir / "summary.json").read_text())
    assert early["finished"] is False and early["train_examples_per_sec"] > 0
    assert "precision" not in early and not (workdir / "report" / "report.html").exists()
    again = run_main(f"--workdir={workdir}", *flags)
    assert again.returncode == 0, again.stderr
    done = json.loads((workdir / "summary.json").read_text())
    assert done["finished"] is True and done["resumed_from_step"] == 30
    assert done["train_examples_per_sec"] == early["train_examples_per_sec"]
    assert "precision" in done and (workdir / "report" / "report.html").is_file()
    assert "nan" not in again.stdout.lower()


def test_a_changed_schedule_length_is_refused_unless_accepted(tmp_path):
    workdir = tmp_path / "w"
    config = (f"--config={REPO / 'configs' / 'mlp_best.py'}", "--config.optimizer.warmup_steps=2")
    first = run_main(f"--workdir={workdir}", *config, "--steps=10", *QUICK)
    assert first.returncode == 0, first.stderr
    refused = run_main(f"--workdir={workdir}", *config, "--steps=20", *QUICK)
    the_error(refused, "trained with other values: steps 10 -> 20; resume with the saved values")
    accepted = run_main(
        f"--workdir={workdir}", *config, "--steps=20", "--accept_config_change", *QUICK
    )
    assert accepted.returncode == 0, accepted.stderr
    changes = json.loads((workdir / "summary.json").read_text())["config_changes"]
    assert changes == [{"step": 10, "field": "steps", "saved": 10, "now": 20}]


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGQUIT])
def test_a_hangup_or_quit_in_training_saves_the_step_reached_like_sigterm(signum, tmp_path):
    """SIGHUP (the terminal closed) and SIGQUIT (Ctrl-\\) ended a run with no line, losing
    every step since the last save and any save in flight. Each now stops it as SIGTERM
    does: the step reached saved, one line, 128 + the signal's number."""
    workdir = tmp_path / "w"
    process = start(workdir, "--steps=5000", "--report=none", "--log_every=5")
    metrics = workdir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 3)
    stopped = finish(process, signum)
    line = the_error(stopped, f"{signal.Signals(signum).name} at step ", code=128 + signum)
    step = int(line.split(" at step ")[1].split(":")[0])
    assert step in saved_steps(workdir), (line, saved_steps(workdir))
    assert f"resume by running the same command with --workdir={workdir}" in line, line


def test_a_ctrl_c_without_a_workdir_names_the_workdir_to_resume(tmp_path):
    """Without --workdir a run trains in a fresh runs/<date>-<time>, and its Ctrl-C line said
    "run the same command with the same --workdir": the same command started another fresh
    directory. The line now names the --workdir, and the command with it resumes there."""
    flags = ("--steps=5000", "--report=none", "--log_every=5")
    process = subprocess.Popen(
        [sys.executable, str(REPO / "main.py"), *flags],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: len(list(tmp_path.glob("runs/*/metrics.jsonl"))) == 1)
    [workdir] = [path.parent for path in tmp_path.glob("runs/*/metrics.jsonl")]
    stopped = finish(process, signal.SIGINT)
    line = the_error(stopped, "SIGINT at step ", code=130)
    step = int(line.split(" at step ")[1].split(":")[0])
    assert line.endswith(f"resume by running the same command with --workdir={workdir}"), line
    again = run_main(
        *flags[:1], f"--steps={step + 5}", *flags[1:], f"--workdir={workdir}", cwd=tmp_path
    )
    assert again.returncode == 0, again.stderr
    assert f"resuming from checkpoint {step} in {workdir}" in again.stdout
    assert [path.name for path in (tmp_path / "runs").iterdir()] == [workdir.name]


# --- The standard output --------------------------------------------------------------------------


def test_a_reader_that_leaves_mid_training_saves_the_step_reached(tmp_path):
    """`main.py | head`: the closed pipe stopped training without saving the step reached,
    everything since the last checkpoint lost. That step is now saved first, the line says
    so with a pipe writer's status (141), and the same command resumes from it."""
    workdir = tmp_path / "w"
    flags = ("--report=none", "--log_every=1")
    process = subprocess.Popen(
        [sys.executable, str(REPO / "main.py"), f"--workdir={workdir}", "--steps=5000", *flags],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in process.stdout:  # `head`: reads the set-up and a few rows of training
        if line.startswith("[") and int(line.split("]")[1].split("/")[0]) >= 20:
            break
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == PIPE_CLOSED, stderr
    stopped = subprocess.CompletedProcess(process.args, process.returncode, "", stderr)
    line = the_error(
        stopped,
        "the output was closed by the command reading it (`| head`?) at step ",
        code=PIPE_CLOSED,
    )
    step = int(line.split(" at step ")[1].split(":")[0])
    assert step >= 20 and saved_steps(workdir) == [step], (line, saved_steps(workdir))
    again = run_main(f"--workdir={workdir}", f"--steps={step + 5}", *flags)
    assert again.returncode == 0, again.stderr
    assert f"resuming from checkpoint {step} in " in again.stdout


@pytest.mark.skipif(not IS_ROOT, reason="mounting a tmpfs needs root; the test above covers it")
def test_a_full_disk_under_the_log_saves_the_step_reached_and_is_one_line(tmp_path):
    """`main.py > log` on a disk that fills mid-training was an `OSError: [Errno 28]`
    traceback (and an abort), everything since the last checkpoint lost. The step reached is
    now saved first, and one line names the cause."""
    workdir = tmp_path / "w"
    with small_disk(tmp_path / "small", "size=16k") as disk, open(disk / "log", "w") as log:
        result = run_writing_to(
            log, f"--workdir={workdir}", "--steps=5000", "--report=none", "--log_every=1"
        )
    line = the_error(
        result, "the output could not be written (No space left on device: a full disk"
    )
    step = int(line.split(" at step ")[1].split(":")[0])
    assert step > 0 and step in saved_steps(workdir), (line, saved_steps(workdir))


def run_writing_to(stdout: Any, *args: str, **kwargs) -> subprocess.CompletedProcess:
    """`main.py ARGS` with its standard output going to `stdout` (a file, or None with a
    `preexec_fn` that closes it), stderr captured."""
    return subprocess.run(
        [sys.executable, str(REPO / "main.py"), *args],
        cwd=REPO,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=300,
        **kwargs,
    )


def close_stdout() -> None:
    os.close(1)


FULL = "(No space left on device: a full disk or quota, or /dev/full)"
UNWRITABLE_OUTPUTS = {  # what runs, where its output goes, what its line says
    "train > /dev/full": ("train", "/dev/full", f"{FULL} before training began: nothing was"),
    "train >&-": ("train", "closed", "the standard output is closed (Bad file descriptor: "),
    "predict > /dev/full": ("predict", "/dev/full", f"{FULL}; stopped"),
    "--help > /dev/full": ("help", "/dev/full", f"{FULL}; stopped"),
}


@pytest.mark.parametrize("case", list(UNWRITABLE_OUTPUTS))
def test_an_output_that_cannot_be_written_is_one_line_naming_its_cause(copy, case):
    """`> /dev/full` was an `OSError: [Errno 28]` traceback and an abort (exit 134), `>&-` an
    `AttributeError` traceback, in training, predict and --help alike."""
    mode, output, expected = UNWRITABLE_OUTPUTS[case]
    flags = {
        "train": (f"--workdir={copy.parent / 'fresh'}", "--report=none"),
        "predict": ("--mode=predict", f"--workdir={copy}", "--images=examples/batch.npy"),
        "help": ("--help",),
    }[mode]
    if output == "closed":
        result = run_writing_to(None, *flags, preexec_fn=close_stdout)
    else:
        with open(output, "w") as sink:
            result = run_writing_to(sink, *flags)
    the_error(result, expected)
    assert saved_steps(copy.parent / "fresh") == []


# --- The files around the checkpoints: TensorBoard, the report, the lock, rotation ----------------


def warnings_and_errors(stderr: str) -> tuple[list[str], list[str]]:
    """The `warning:` and `error:` lines of a run; anything else but the no-GPU notice and
    absl's own warnings fails the test (a traceback, a library's log)."""
    lines = [line for line in stderr.splitlines() if line.strip() and "No GPU found" not in line]
    warned = [line for line in lines if line.startswith("warning: ")]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(warned) + len(errors) == len(lines), stderr
    return warned, errors


def board_events(workdir: pathlib.Path) -> dict[str, list[int]]:
    """Each TensorBoard tag's event steps as TensorBoard's own reader sees them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(workdir / "tensorboard"))
    reader.Reload()
    return {tag: [e.step for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


@pytest.mark.skipif(not IS_ROOT, reason="mounting a tmpfs needs root; the next test covers it")
def test_a_full_disk_under_tensorboard_is_one_warning_and_signals_still_stop_the_run(tmp_path):
    """A 4 KB tmpfs as W/tensorboard fills at once: the run says so once and trains on, and a
    SIGTERM later still stops it with its checkpoint (it used to hang, signals ignored)."""
    workdir = tmp_path / "w"
    workdir.mkdir()
    with small_disk(tmp_path / "disk", "size=4k") as disk:
        (workdir / "tensorboard").symlink_to(disk)
        process = start(workdir, "--steps=1000000", "--checkpoint_every=50", *QUICK)
        wait_for(lambda: len(saved_steps(workdir)) >= 2)
        stopped = finish(process)
    warned, errors = warnings_and_errors(stopped.stderr)
    assert stopped.returncode == 128 + signal.SIGTERM and len(errors) == 1
    assert errors[0].startswith("error: SIGTERM at step ") and len(warned) == 1
    assert f"cannot write TensorBoard events in {workdir / 'tensorboard'} (No space" in warned[0]
    assert "training goes on without them" in warned[0]


@pytest.mark.parametrize("fault", ["a file", "unwritable"])
def test_a_tensorboard_directory_that_cannot_be_written_is_one_warning(tmp_path, fault):
    workdir = tmp_path / "w"
    workdir.mkdir()
    if fault == "a file":
        (workdir / "tensorboard").write_text("not a directory")
        result = run_main(f"--workdir={workdir}", "--steps=10", *QUICK)
    else:
        (workdir / "tensorboard").mkdir(mode=0o555)
        result = run_bound_by_permissions(f"--workdir={workdir}", "--steps=10", *QUICK)
    warned, errors = warnings_and_errors(result.stderr)
    assert result.returncode == 0 and not errors and len(warned) == 1
    assert "cannot write TensorBoard events" in warned[0]
    assert json.loads((workdir / "summary.json").read_text())["steps"] == 10


def test_tensorboard_has_one_event_per_logged_step_after_kills_before_and_after_a_save(tmp_path):
    """Killed before its first save, then after a save with later events written: each rerun
    drops the events past the step it starts from, as metrics.jsonl drops its rows."""
    workdir = tmp_path / "w"
    flags = ("--checkpoint_every=40", "--log_every=5", "--report=none", EVERY_DUE_SAVE)
    rows = workdir / "metrics.jsonl"
    process = start(workdir, "--steps=1000000", "--checkpoint_every=1000000", *flags[1:])
    wait_for(lambda: rows.exists() and len(rows.read_text().splitlines()) >= 8)
    process.kill()
    process.wait()
    assert saved_steps(workdir) == [] and board_events(workdir)["train/loss"][:2] == [1, 5]
    process = start(workdir, "--steps=1000000", *flags)
    wait_for(lambda: saved_steps(workdir) and saved_steps(workdir)[-1] >= 80)
    wait_for(
        lambda: json.loads(rows.read_text().splitlines()[-1])["step"] > saved_steps(workdir)[-1]
    )
    process.kill()
    process.wait()
    done = run_main(f"--workdir={workdir}", "--steps=200", *flags)
    assert done.returncode == 0, done.stderr
    logged = [json.loads(line)["step"] for line in rows.read_text().splitlines()]
    assert logged == sorted(set(logged)) and logged[-1] == 200
    for tag, steps in board_events(workdir).items():
        if tag.startswith("train/") and tag != "train/examples_per_sec":
            assert steps == logged, tag


def rotated_steps(workdir: pathlib.Path) -> list[pathlib.Path]:
    """The steps rotation has moved aside and not yet removed."""
    with contextlib.suppress(FileNotFoundError):  # none, or removed while looked at
        return list((workdir / "checkpoints" / checkpoint.ROTATED_DIR).iterdir())
    return []


def unmarked_steps(workdir: pathlib.Path) -> list[pathlib.Path]:
    with os.scandir(workdir / "checkpoints") as entries:
        paths = [pathlib.Path(e.path) for e in entries if e.name.isdigit()]
    found = []
    for path in paths:
        with contextlib.suppress(FileNotFoundError):  # rotated away while it was looked at
            if checkpoint.unmarked(path):
                found.append(path)
    return found


def test_a_kill_while_a_step_is_rotated_away_leaves_a_workdir_the_same_command_resumes(
    tmp_path,
):
    """Rotation moves a step aside (one rename) before removing it: the test freezes the run
    (SIGSTOP) while a step moved aside is still there and kills it; the same command removes
    it and resumes. No step among the steps is ever without its marker (it was removed file by
    file in place, and the next run removed whatever lacked a marker: a guess)."""
    flags = (
        "--steps=1000000",
        "--checkpoint_every=1",
        EVERY_DUE_SAVE,
        "--report=none",
        "--log_every=50",
    )
    workdir = tmp_path / "w"
    process = start(workdir, *flags)
    wait_for(lambda: len(saved_steps(workdir)) >= 3)
    moved = freeze_when(process, lambda: rotated_steps(workdir), "step moved aside")
    assert not unmarked_steps(workdir)
    process.kill()
    process.wait()
    resumed = start(workdir, *flags)
    wait_for(lambda: max(saved_steps(workdir)) > max(int(p.name) for p in moved) + 3)
    stopped = finish(resumed)
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr
    assert not [line for line in stopped.stderr.splitlines() if "damaged" in line]
    assert "Traceback" not in stopped.stderr and not any(p.exists() for p in moved)
    assert not (workdir / "checkpoints" / checkpoint.ROTATED_DIR).exists()
    assert not unmarked_steps(workdir)
    assert not (workdir / checkpoint.DAMAGED_DIR).exists()


def test_readers_of_a_fast_rotating_run_retry_and_never_print_orbax_tracebacks(tmp_path):
    """max_to_keep=1 and a save every 20 steps: a step lives a fraction of a second, often
    less than a reader takes to read it; each reader starts over from the newest."""
    workdir = tmp_path / "w"
    trainer = start(
        workdir,
        "--steps=100000000",
        "--checkpoint_every=20",
        EVERY_DUE_SAVE,
        "--config.max_to_keep=1",
        "--report=none",
        "--log_every=100",
    )
    wait_for(lambda: saved_steps(workdir))
    images = tmp_path / "x.npy"
    np.save(images, np.zeros((2, 28, 28), np.uint8))
    for mode in ("eval", "predict", "export"):
        given = [f"--images={images}"] if mode == "predict" else []
        read = run_main(
            f"--mode={mode}", f"--workdir={workdir}", *given, f"--output={tmp_path / mode}"
        )
        assert read.returncode == 0, read.stderr
        assert not [line for line in read.stderr.splitlines() if "No GPU found" not in line]
    assert trainer.poll() is None, "the trainer died while it was being read"
    finish(trainer)


def test_a_report_that_cannot_be_written_is_one_warning_and_the_summary_is_written(copy):
    (copy / "report").write_text("a file where report/ goes")
    result = run_main(
        f"--workdir={copy}",
        "--steps=30",
        "--checkpoint_every=10",
        "--report=basic",
        "--log_every=5",
        EVERY_DUE_SAVE,
    )
    warned, errors = warnings_and_errors(result.stderr)
    assert result.returncode == 0 and not errors and len(warned) == 1
    assert f"cannot write the report in {copy / 'report'}" in warned[0]
    summary = json.loads((copy / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["report"] is None


def saves_with_arrays_to_write(workdir: pathlib.Path) -> list[pathlib.Path]:
    """The steps Orbax is writing (a temporary directory) that hold no array data yet."""
    saves = []
    for path in (workdir / "checkpoints").glob("*.orbax-checkpoint-tmp*"):
        with contextlib.suppress(FileNotFoundError):  # finalised while it was being looked at
            if not any(p.parent.name == "d" for p in path.rglob("*")):
                saves.append(path)
    return saves


@pytest.mark.skipif(not IS_ROOT, reason="mounting a tmpfs needs root")
def test_a_disk_another_process_fills_mid_save_is_one_line_naming_the_kept_step(tmp_path):
    """The test freezes the run (SIGSTOP) once a save has begun and before its arrays are
    written, fills the disk, and lets it go on: the save fails half written, whatever the load
    on the machine (a filler racing the run sometimes filled the disk between two saves)."""
    with small_disk(tmp_path / "disk", "size=40m") as disk:
        workdir = disk / "w"
        process = start(workdir, "--steps=1000000", "--checkpoint_every=2", *QUICK)
        wait_for(lambda: len(saved_steps(workdir)) >= 3)
        caught = freeze_when(process, lambda: saves_with_arrays_to_write(workdir), "save")
        filler = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):
            while os.write(filler, b"\0" * 2**20):  # to the last byte: writes end short, then fail
                pass
        os.close(filler)
        process.send_signal(signal.SIGCONT)
        stopped = process.communicate(timeout=120)[1]
        kept = saved_steps(workdir)
        step = int(caught[0].name.split(".")[0])
        line = the_error(
            subprocess.CompletedProcess([], process.returncode, "", stopped),
            f"could not write checkpoint {step} in {workdir / 'checkpoints'} (No space left on",
        )
        assert kept[-1] < step and f"resume from checkpoint {kept[-1]}" in line
        (disk / "filler").unlink()
        resumed = run_main(f"--workdir={workdir}", f"--steps={kept[-1] + 4}", *QUICK)
        assert resumed.returncode == 0, resumed.stderr
        assert f"resuming from checkpoint {kept[-1]}" in resumed.stdout


def test_a_corrupt_summary_is_written_again_by_the_same_command(copy):
    (copy / "summary.json").write_text("{ half a summ")
    result = run_main(f"--workdir={copy}", "--steps=20", "--checkpoint_every=10", *QUICK)
    assert result.returncode == 0, result.stderr
    assert json.loads((copy / "summary.json").read_text())["steps"] == 20


def test_an_unreadable_checkpoint_directory_is_one_line_for_a_reader(copy):
    with permissions(copy / "checkpoints", 0o000):
        result = run_bound_by_permissions("--mode=eval", f"--workdir={copy}")
    the_error(result, f"{copy / 'checkpoints'} cannot be read (permission denied)")


def test_a_damaged_best_step_is_passed_over_for_the_next_best(tmp_path):
    """keep_best keeps the best step beside the newest for ever. Damaged (its model's data
    truncated), --step=best passes over it to the next best, and the next training run sets
    it aside. The oldest kept step is made the best by its saved score, as if accuracy fell."""
    workdir = tmp_path / "w"
    flags = (
        "--config.eval_every=5",
        "--checkpoint_every=5",
        "--config.keep_best=True",
        "--config.max_to_keep=2",
        *QUICK,
    )
    result = run_main(f"--workdir={workdir}", "--steps=20", *flags)
    assert result.returncode == 0, result.stderr
    first = saved_steps(workdir)[0]
    progress = workdir / "checkpoints" / str(first) / "progress" / "metadata"
    progress.write_text(json.dumps({**json.loads(progress.read_text()), "test_accuracy": 1.0}))
    for path in (workdir / "checkpoints" / str(first) / "model" / "d").iterdir():
        path.write_bytes(path.read_bytes()[:10])
    again = run_main(
        "--mode=eval", f"--workdir={workdir}", "--step=best", f"--output={tmp_path / 'b.json'}"
    )
    assert again.returncode == 0, again.stderr
    assert f"checkpoint {first} in " in again.stderr and "using the next best" in again.stderr
    assert json.loads((tmp_path / "b.json").read_text())["step"] != first
    resumed = run_main(f"--workdir={workdir}", "--steps=25", *flags)
    assert resumed.returncode == 0, resumed.stderr
    assert f"warning: checkpoint {first} in {workdir / 'checkpoints'} is damaged" in resumed.stderr
    assert (workdir / checkpoint.DAMAGED_DIR / str(first)).is_dir() and first not in saved_steps(
        workdir
    )
    last = run_main("--mode=eval", f"--workdir={workdir}", "--step=best")
    assert last.returncode == 0 and "damaged" not in last.stderr, last.stderr


def test_an_export_that_uses_an_older_step_than_the_newest_says_so(copy, tmp_path):
    (copy / "checkpoints" / "20" / "config" / "metadata").write_text("[]")
    result = run_main("--mode=export", f"--workdir={copy}", f"--output={tmp_path / 'm'}")
    assert result.returncode == 0, result.stderr
    assert "checkpoint 20 in " in result.stderr and "using checkpoint 10 instead" in result.stderr
    assert "Traceback" not in result.stderr
    meta = json.loads((tmp_path / "m.json").read_text())
    assert meta["source"]["step"] == 10


# Each of these passed the checks and grew until the kernel killed it, minutes later, with no
# line. The child's data is capped at DATA_LIMIT (`ulimit -d`, which the check reads): the
# case does not depend on the host's memory, and a regression fails here, not the host.
DATA_LIMIT = 4 * 2**30
TOO_LARGE = {
    "--config.ensemble.size=1000": "--config.ensemble.size=1000: 1,000 members need about",
    "--config.grain.workers=10000": "--config.grain.workers=10000 is more read threads than",
    "--config.grain.block_examples=2147483647": "keeps 4 blocks of 4,194,303 steps in memory",
    "--config.grain.prefetch=100000": "keeps 100,002 blocks of 32 steps in memory",
}


def run_capped(
    workdir: pathlib.Path, *flags: str, limit: int = resource.RLIMIT_DATA
) -> tuple[subprocess.CompletedProcess, int, float]:
    """main.py with its data (`limit`: or its address space) capped at DATA_LIMIT: the result,
    its own peak RSS in bytes (not the pytest worker's, which Linux would count as the
    child's) and its seconds."""

    def cap() -> None:
        resource.setrlimit(limit, (DATA_LIMIT, DATA_LIMIT))

    return run_main_measured(f"--workdir={workdir}", *flags, preexec_fn=cap)


@pytest.mark.parametrize("flag", list(TOO_LARGE))
def test_sizes_the_machine_cannot_hold_are_one_line_before_anything_grows(flag, tmp_path):
    pipeline = [] if "ensemble" in flag else ["--config.input_pipeline=grain"]
    result, peak, seconds = run_capped(tmp_path / "w", "--steps=1", *QUICK, *pipeline, flag)
    line = the_error(result, TOO_LARGE[flag])
    assert "ulimit -d" in line or "cores" in line, line  # the memory figure it was held to
    assert peak < 2 * 2**30, peak
    assert seconds < 30, seconds


@pytest.mark.parametrize("hidden", [16_000, 40_000])
def test_a_batch_whose_training_step_cannot_fit_is_one_line_before_it_runs(hidden, tmp_path):
    """Batch 60,000 through 16,000 (40,000) units passed the check of the models, then XLA
    asked for 11.5 GB (28.8 GB) when the step ran. Under `ulimit -d` the step's memory is now
    refused from its compiled program, before anything of that size is allocated."""
    flags = ("--steps=1", *QUICK, "--batch_size=60000", f"--config.model.hidden=({hidden},)")
    result, peak, seconds = run_capped(tmp_path / "w", *flags)
    line = the_error(result, "--batch_size=60000: a training step needs about ")
    assert "by XLA's memory analysis" in line and "ulimit -d" in line, line
    assert "use at most about --batch_size=" in line, line
    assert peak < 2 * 2**30, peak
    assert seconds < 30, seconds
    assert saved_steps(tmp_path / "w") == []


BEYOND_ADDRESS_LIMIT = {  # each fits in the memory of a host, not in 4 GiB of address space
    "--batch_size=60000": ("--batch_size=60000", "--config.model.hidden=(16000,)"),
    "--config.ensemble.size=200": ("--config.ensemble.size=200",),
}


@pytest.mark.parametrize("field", list(BEYOND_ADDRESS_LIMIT))
def test_an_address_space_limit_is_one_line_before_anything_grows(field, tmp_path):
    """Under `ulimit -v` (RLIMIT_AS) batch 60,000 through 16,000 units died in the first step
    with XLA's RESOURCE_EXHAUSTED traceback; it is now refused from its compiled program, as
    under `ulimit -d`, and so are 200 members."""
    flags = ("--steps=1", *QUICK, *BEYOND_ADDRESS_LIMIT[field])
    result, peak, seconds = run_capped(tmp_path / "w", *flags, limit=resource.RLIMIT_AS)
    line = the_error(result, f"{field}: ")
    assert "ulimit -v of 4.00 GiB less" in line, line
    assert peak < 2 * 2**30, peak
    assert seconds < 30, seconds
    assert saved_steps(tmp_path / "w") == []


# --- One true line for each (issue 37) ------------------------------------------------------------


@pytest.mark.parametrize("notes", [True, False])
def test_a_foreign_or_stale_step_directory_is_named_for_a_reader(copy, notes):
    """A reader said "the run training there rotated it away" of a directory nobody removes."""
    foreign = copy / "checkpoints" / "999"
    foreign.mkdir()
    if notes:
        (foreign / "notes.txt").write_text("mine")
    result = run_main("--mode=eval", f"--workdir={copy}")
    said = "is not a checkpoint this project wrote" if notes else "is an incomplete checkpoint"
    line = the_error(result, f"{foreign} {said} (no {checkpoint.STEP_MARKER})")
    assert "rotated it away" not in line and foreign.is_dir()


@pytest.mark.parametrize(
    ("damaged", "expected"),
    [
        ("model/d", "Requested byte range"),  # was `See full TensorStore details: <bound method`
        ("model/manifest.ocdbt", "Error decoding manifest"),
    ],
)
def test_a_damaged_step_asked_for_is_named_in_words(copy, damaged, expected):
    step = copy / "checkpoints" / "20"
    target = step / damaged
    for path in target.rglob("*") if target.is_dir() else [target]:
        path.write_bytes(path.read_bytes()[:5])
    line = the_error(run_main("--mode=eval", f"--workdir={copy}", "--step=20"), expected)
    assert line.startswith(f"error: checkpoint 20 in {copy / 'checkpoints'} is damaged: ")
    assert "<" not in line and "tensorstore_spec" not in line


@pytest.mark.parametrize(
    ("item", "field", "value"),
    [
        ("config", "model", None),
        ("dataset", "image_shape", "x"),
        ("dataset", "image_shape", [-1, 784, 1]),
    ],
)
def test_an_edited_json_item_is_one_line_for_predict(copy, tmp_path, item, field, value):
    for step in (10, 20):
        path = copy / "checkpoints" / str(step) / item / "metadata"
        path.write_text(json.dumps({**json.loads(path.read_text()), field: value}))
    images = tmp_path / "x.npy"
    np.save(images, np.zeros((2, 28, 28), np.uint8))
    result = run_main("--mode=predict", f"--workdir={copy}", f"--images={images}")
    the_error(
        result,
        f"checkpoint 20 in {copy / 'checkpoints'} is damaged: its {item} item has "
        f"{field}={json.dumps(value)}, not ",
    )


@pytest.mark.parametrize("what", ["a file", "a symbolic link loop"])
def test_a_compilation_cache_that_can_be_no_directory_is_named(tmp_path, what):
    """It was reported as a cache holding "entries cut short"."""
    cache = tmp_path / "cache"
    if what == "a file":
        cache.write_text("mine")
    else:
        cache.symlink_to(tmp_path / "other")
        (tmp_path / "other").symlink_to(cache)
    result = run_main(f"--workdir={tmp_path / 'w'}", "--steps=2", f"--compilation_cache={cache}")
    the_error(result, f"--compilation_cache={cache} is {what}")
    assert not (tmp_path / "w").exists()  # refused before anything was made


# --- A run that diverges stops ------------------------------------------------------------------

DIVERGING = {
    "lr 5": ["--learning_rate=5"],
    "lr 50": ["--learning_rate=50"],
    "lr 1e30": ["--learning_rate=1e30"],
    "a row every step": ["--learning_rate=5", "--log_every=1", "--config.eval_every=4"],
    "saves every 5": ["--learning_rate=5", "--checkpoint_every=5", EVERY_DUE_SAVE],
}


@pytest.mark.parametrize("flags", list(DIVERGING.values()), ids=list(DIVERGING))
def test_a_diverging_run_stops_with_one_line_keeping_the_last_good_checkpoint(flags, tmp_path):
    """SGD at a rate that makes the loss non-finite between two saves, at a log point or at an
    evaluation: the run exits within 60 s (a wait for the rows after the first non-finite one
    once never ended), naming the step and the last good checkpoint, which is finite."""
    import jax
    from flax import nnx

    from fmnist_flax import load_model

    workdir = tmp_path / "w"
    flags = [f"--workdir={workdir}", "--report=none", "--config.optimizer.name=sgd", *flags]
    result = run_main(*flags, timeout=60)
    line = the_error(result, "training stopped, the last good checkpoint is ")
    kept = saved_steps(workdir)
    assert line.endswith(f"is {kept[-1] if kept else 'none'}; lower --learning_rate and retry")
    if kept:
        model = load_model(workdir)
        assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(nnx.state(model)))


def test_metrics_jsonl_removed_under_a_live_run_is_written_again_whole(tmp_path):
    """A person (or a clean-up script) deletes metrics.jsonl while the run trains: one warning,
    and the finished file holds every logged row once."""
    workdir = tmp_path / "w"
    process = start(workdir, "--steps=1000", "--log_every=5", "--report=none")
    metrics = workdir / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 3)
    metrics.unlink()
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == sorted({1, *range(5, 1001, 5), *range(117, 1001, 117)})  # evaluations too
    assert f"warning: {metrics} was removed while this run trained" in stderr


def test_a_signal_between_one_step_calls_saves_that_step_and_resumes_exactly(tmp_path):
    """With one step a call (the CNN's way), the loop looked for a signal only at the next
    logged step, minutes away for the CNN. It now stops within a call or two, saves that step
    with its row's running sums, and the resumed run logs what an uninterrupted one does."""
    flags = ("--config.fused_steps=False", "--steps=800", "--report=none", EVERY_DUE_SAVE)
    whole = run_main(f"--workdir={tmp_path / 'whole'}", *flags)
    assert whole.returncode == 0, whole.stderr
    process = start(tmp_path / "cut", *flags)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 3)
    signalled = time.monotonic()
    cut = finish(process, signal.SIGINT)
    assert time.monotonic() - signalled < 5
    line = the_error(cut, "SIGINT at step ", code=130)
    step = int(line.split("SIGINT at step ")[1].split(":")[0])
    assert step in saved_steps(tmp_path / "cut")
    resumed = run_main(f"--workdir={tmp_path / 'cut'}", *flags)
    assert resumed.returncode == 0, resumed.stderr
    assert metrics.read_bytes() == (tmp_path / "whole" / "metrics.jsonl").read_bytes()


def test_the_cnn_stops_within_seconds_of_a_signal_mid_epoch(tmp_path):
    """configs/cnn.py trains one step a call and logs every 468 steps: a SIGINT a few seconds
    into training waited for step 468 (minutes on a CPU), printing nothing. It now exits within
    5 s, with the step it reached saved."""
    process = start(tmp_path / "w", "--config=configs/cnn.py", "--report=none")
    metrics = tmp_path / "w" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, timeout=300)
    time.sleep(3)  # mid-epoch: the next logged step is hundreds of steps away
    signalled = time.monotonic()
    stopped = finish(process, signal.SIGINT)
    assert time.monotonic() - signalled < 5
    line = the_error(stopped, "SIGINT at step ", code=130)
    step = int(line.split("SIGINT at step ")[1].split(":")[0])
    assert 1 < step < 468 and saved_steps(tmp_path / "w") == [step]


def test_a_signal_while_the_setup_compiles_stops_within_seconds(tmp_path):
    """Ctrl-C while the first training program compiles (the CNN, no compilation cache) waited
    for XLA to finish. The wait now ends on the signal: one line, 130, within 5 s."""
    process = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "main.py"),
            f"--workdir={tmp_path / 'w'}",
            *("--config=configs/cnn.py", "--compilation_cache=", "--report=none"),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    for line in process.stdout:  # the set-up's model table: its program is compiling
        if "trainable values" in line:
            break
    signalled = time.monotonic()
    stopped = finish(process, signal.SIGINT)
    assert time.monotonic() - signalled < 5
    the_error(stopped, "SIGINT before training began", code=130)


def test_a_signal_between_slow_fused_calls_stops_within_seconds(tmp_path):
    """Three layers of 2,048 take a fifth of a second a step here, and 25 steps a call queued
    behind each other kept a signal waiting 40 s. Calls are now sized to the devices' pace:
    the run stops within 5 s with the step it reached saved. (SGD, with no moments to save,
    keeps that save a third of Adam's 150 MB: on a disk the other test worker keeps busy,
    writing those took 2-3.6 s of the 5.)"""
    flags = ("--config.model.hidden=(2048, 2048, 2048)", "--config.optimizer.name=sgd")
    process = start(tmp_path / "w", *flags, "--report=none")
    metrics = tmp_path / "w" / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, timeout=300)
    time.sleep(3)
    signalled = time.monotonic()
    stopped = finish(process, signal.SIGINT)
    assert time.monotonic() - signalled < 5
    line = the_error(stopped, "SIGINT at step ", code=130)
    step = int(line.split("SIGINT at step ")[1].split(":")[0])
    assert 1 < step < 400 and step in saved_steps(tmp_path / "w")


# --- Checkpoint damage in one warning line; files grown past their kind (issue 61) ----------
ABSL_LINE = re.compile(r"^[IWEF]\d{4} ")  # an absl log line: W1207 15:29:58.073003 ...

DAMAGE = {
    "a marker that is not JSON": (
        "_CHECKPOINT_METADATA",
        "{garbage in the marker",
        "its _CHECKPOINT_METADATA file is not valid JSON",
    ),
    "a dataset item that is null": ("dataset/metadata", "null", "its dataset item is null"),
    "array descriptions that are not JSON": (
        "model/array_metadatas/process_0",
        "{garbage in the descriptions",
        "Expecting property name",
    ),
}


@pytest.mark.parametrize("mode", ["train", "eval", "predict", "export"])
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_newest_step_is_one_warning_line_and_the_one_before_is_used(
    copy, damage, mode, tmp_path
):
    """It was absl's `W1207 ...` line, or `E1207 ...` lines that printed the file's content;
    a null dataset item stopped every mode (the faults table said it fell back)."""
    name, content, reason = DAMAGE[damage]
    (copy / "checkpoints" / "20" / name).write_text(content)
    np.save(tmp_path / "one.npy", np.zeros((28, 28), np.uint8))
    flags = {
        "train": ["--steps=30", *QUICK],
        "eval": [],
        "predict": [f"--images={tmp_path / 'one.npy'}"],
        "export": [f"--output={tmp_path / 'model.jaxexport'}"],
    }[mode]
    result = run_main(f"--mode={mode}", f"--workdir={copy}", *flags)
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if line.strip()]
    said = [line for line in said if "No GPU found" not in line]
    assert len(said) == 1 and not ABSL_LINE.match(said[0]), result.stderr
    assert said[0].startswith(f"warning: checkpoint 20 in {copy / 'checkpoints'} is damaged (")
    assert reason in said[0] and said[0].endswith("using checkpoint 10 instead"), said[0]
    assert "garbage" not in result.stderr
    moved = (copy / checkpoint.DAMAGED_DIR / "20").is_dir()
    assert moved == (mode == "train") and (f"moved it to {copy}" in said[0]) == moved


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", ["model/array_metadatas/process_0", "model/manifest.ocdbt"])
def test_a_checkpoint_file_grown_to_gigabytes_is_refused_unread(copy, name, mode):
    """3 GB (sparse): it was read whole, 3.4-6.5 GB of memory for 20-27 s, then an absl line
    and, in training, the step moved aside as damaged."""
    path = copy / "checkpoints" / "20" / name
    os.truncate(path, 3 * 2**30)
    before = sizes(copy / "checkpoints")  # not the bytes: reading 3 GB took most of the test
    flags = ("--steps=30", *QUICK) if mode == "train" else ()
    result, peak, seconds = run_main_measured(f"--mode={mode}", f"--workdir={copy}", *flags)
    the_error(result, f"error: {path} holds more than the ")
    assert peak < 2**30 and seconds < 30, (peak, seconds)
    assert not (copy / checkpoint.DAMAGED_DIR).exists()
    assert sizes(copy / "checkpoints") == before
