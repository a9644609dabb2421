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
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import EVERY_DUE_SAVE, REPO, run_main

from fmnist_flax import checkpoint

pytestmark = pytest.mark.slow
QUICK = ("--report=none", "--log_every=5", EVERY_DUE_SAVE)
IS_ROOT = os.geteuid() == 0


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
    return subprocess.Popen(
        [sys.executable, str(REPO / "main.py"), f"--workdir={workdir}", *flags],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, **kwargs,
    )  # fmt: skip


def wait_for(condition, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def saved_steps(workdir: pathlib.Path) -> list[int]:
    directory = workdir / "checkpoints"
    if not directory.is_dir():
        return []
    return sorted(
        int(p.name)
        for p in directory.iterdir()
        if p.name.isdigit() and (p / checkpoint.STEP_MARKER).exists()
    )


def finish(process: subprocess.Popen, signum: int = signal.SIGTERM) -> subprocess.CompletedProcess:
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


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
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


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
        assert " MB and " in line and "free some space and run the same command again" in line
        kept = saved_steps(workdir)
        assert kept and kept[0] == 20
        for row in (workdir / "metrics.jsonl").read_text().splitlines():
            json.loads(row)  # every line whole
        subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True)
        resumed = run_main(f"--workdir={workdir}", "--steps=60", "--checkpoint_every=10", *QUICK)
        assert resumed.returncode == 0, resumed.stderr
        assert f"resuming from checkpoint {kept[-1]}" in resumed.stdout


@pytest.mark.skipif(not IS_ROOT, reason="mounting a tmpfs needs root")
def test_no_inodes_left_is_one_line_naming_the_inodes(tmp_path):
    with small_disk(tmp_path / "disk", "size=64m,nr_inodes=40") as disk:
        result = run_main(f"--workdir={disk / 'w'}", "--steps=20", *QUICK)
        line = the_error(result, "inodes free in ")
        assert "needs about" in line and "100 inodes" in line


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
    assert "checkpoint 20 is damaged (its progress item is null" in result.stderr
    assert "resuming from checkpoint 10" in result.stdout
    assert (aside / "earlier.txt").read_text() == "set aside before"
    assert (copy / checkpoint.DAMAGED_DIR / "20.1" / checkpoint.STEP_MARKER).exists()


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


def test_an_unreadable_step_is_named_and_left_where_it_is(copy):
    step = copy / "checkpoints" / "20"
    with permissions(step, 0o000):
        for mode in ("--mode=train", "--mode=eval"):
            result = run_bound_by_permissions(mode, f"--workdir={copy}", "--steps=30", *QUICK)
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
def test_a_signal_after_training_stops_the_run_and_the_same_command_finishes(signum, tmp_path):
    workdir = tmp_path / "w"
    flags = ("--steps=30", "--report=full", "--log_every=10")
    process = start(workdir, *flags)
    wait_for(lambda: 30 in saved_steps(workdir))  # training is over; evaluation and report run
    stopped = finish(process, signum)
    the_error(stopped, "the summary and report were not written", code=128 + signum)
    assert saved_steps(workdir)[-1] == 30 and not (workdir / "summary.json").exists()
    again = run_main(f"--workdir={workdir}", *flags)
    assert again.returncode == 0, again.stderr
    assert json.loads((workdir / "summary.json").read_text())["resumed_from_step"] == 30


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
