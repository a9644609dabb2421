"""The mesh and jax.distributed: 8 virtual CPU devices and 2 local processes, in subprocesses."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import EVERY_DUE_SAVE, REPO

from fmnist_flax import evaluate, inference, parallel
from fmnist_flax.errors import UserError

# Measured on 2 CPU cores, 50 AdamW steps at batch 128: the 8-device runs differ from the
# 1-device run by at most 7e-7 in loss (1.3e-6 relative) and 3.6e-5 in any parameter, from the
# order of float32 sums in the gradient all-reduce. The bounds leave a 5-8x margin.
LOSS_RTOL = 1e-5
PARAM_ATOL = 2e-4


def env_with_devices(count: int) -> dict[str, str]:
    return {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={count}",
        "PYTHONPATH": str(REPO),
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main_py(*flags: str, devices: int = 1, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "main.py"), *flags],
        env=env_with_devices(devices),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_eight_devices_train_like_one_and_arrays_are_really_sharded(tmp_path, pytestconfig):
    cache = pytestconfig.cache.mkdir("jax")
    worker = subprocess.run(
        [sys.executable, str(REPO / "tests" / "mesh_worker.py"), str(tmp_path), str(cache)],
        env=env_with_devices(8),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert worker.returncode == 0, worker.stderr[-3000:]
    one, eight, fsdp = json.loads(worker.stdout)
    assert (one["devices"], eight["devices"], fsdp["devices"]) == (1, 8, 8)
    for run in (eight, fsdp):
        np.testing.assert_allclose(run["losses"], one["losses"], rtol=LOSS_RTOL)
        assert run["params"].keys() == one["params"].keys()
        for name, value in run["params"].items():
            np.testing.assert_allclose(value, one["params"][name], rtol=0, atol=PARAM_ATOL)
        assert run["specs"]["batch"] == "P('data',)"  # each device holds 128 / 8 examples
        assert run["specs"]["test_batches"] == "P(None, 'data')"  # what evaluate streams
        assert run["specs"]["train_images"] == "replicated"
        assert run["restored_equal"]  # Orbax wrote and read the sharded state exactly
        # Evaluation and prediction on the mesh: every test image once, the same answers.
        assert run["test_examples"] == one["test_examples"] == 10_000
        assert run["test_accuracy"] == pytest.approx(one["test_accuracy"], abs=1e-3)
        np.testing.assert_allclose(run["predictions"], one["predictions"], atol=1e-4)
    assert one["specs"]["batch"] == "replicated"  # a 1-device mesh: nothing to split
    assert eight["specs"]["kernel"] == eight["specs"]["kernel_adam_mu"] == "replicated"
    # FSDP splits the (784, 256) kernel and its Adam moments along 784; the (10,) head bias
    # does not divide by 8 and stays replicated.
    assert fsdp["specs"]["kernel"] == fsdp["specs"]["kernel_adam_mu"] == "P('data',)"
    assert fsdp["specs"]["head_bias"] == "replicated"
    assert fsdp["restored_specs"] == ["P('data',)", "replicated"]
    assert one["losses"][-1] < one["losses"][0] / 2


def start_two_processes(workdir, *flags: str) -> list[subprocess.Popen]:
    """main.py as processes 0 and 1 of one run on localhost, 2 CPU devices each."""
    command = [
        sys.executable,
        str(REPO / "main.py"),
        "--report=none",
        f"--workdir={workdir}",
        f"--coordinator_address=127.0.0.1:{free_port()}",
        "--num_processes=2",
        "--distributed_timeout=60",
        *flags,
    ]
    return [
        subprocess.Popen(
            [*command, f"--process_id={i}"],
            env=env_with_devices(2),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (0, 1)
    ]


@pytest.mark.slow
def test_two_processes_train_one_model_and_one_process_restores_it(tmp_path, real_dataset):
    workdir = tmp_path / "run"
    processes = start_two_processes(workdir, "--steps=30", "--log_every=10", "--batch_size=256")
    outputs = [p.communicate(timeout=180) for p in processes]
    for p, (_, err) in zip(processes, outputs, strict=True):
        assert p.returncode == 0, err[-3000:]
    (first_out, _), (second_out, _) = outputs
    assert "the 6 replicated parameter arrays are identical in all 2 processes" in first_out
    assert "mesh {'data': 4} over 4 cpu device(s) in 2 processes" in first_out
    assert "test accuracy" in first_out
    # Process 1 computes but prints no tables (gloo's own connection lines may appear).
    assert "test accuracy" not in second_out and "Set-up" not in second_out

    summary = json.loads((workdir / "summary.json").read_text())
    assert (summary["num_processes"], summary["num_devices"]) == (2, 4)
    assert summary["mesh"] == {"data": 4}
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 10, 20, 30]  # one writer: no duplicated rows

    # The checkpoint both processes wrote restores in this single-device process.
    model, step, config, _ = inference.restore_model(workdir, mesh=parallel.make_mesh())
    assert (step, config.batch_size) == (30, 256)
    result = evaluate.evaluate(
        model, real_dataset.test_images, real_dataset.test_labels, config, parallel.make_mesh()
    )
    assert result["accuracy"] == pytest.approx(summary["test_accuracy"], abs=2e-4)
    assert result["loss"] == pytest.approx(summary["test_loss"], rel=1e-5)


@pytest.mark.slow
def test_a_shard_only_one_process_can_read_stops_both_with_what_to_do(tmp_path):
    """FSDP: each process reads its own shards, so only process 1 meets the damage. Both stop
    at once with one line (no hang), and the fix the line names resumes the run."""
    workdir = tmp_path / "run"
    flags = [
        "--log_every=2",
        "--checkpoint_every=2",
        "--batch_size=64",
        "--config.param_sharding=fsdp",
        EVERY_DUE_SAVE,
    ]
    for p in start_two_processes(workdir, "--steps=4", *flags):
        assert p.wait(timeout=180) == 0
    for shard in (workdir / "checkpoints" / "4" / "model" / "ocdbt.process_1" / "d").iterdir():
        shard.write_bytes(shard.read_bytes()[:10])

    processes = start_two_processes(workdir, "--steps=6", *flags)
    outputs = [p.communicate(timeout=120) for p in processes]
    assert [p.returncode for p in processes] == [1, 1]
    damaged = workdir / "damaged_checkpoints"
    for _, err in outputs:
        last = err.strip().splitlines()[-1]
        assert last.startswith("error: checkpoint 4 in ") and f"move it to {damaged}" in last
    assert "cannot be read here (Encountered error while reading" in outputs[1][1]

    damaged.mkdir()
    (workdir / "checkpoints" / "4").rename(damaged / "4")  # what the error line says to do
    processes = start_two_processes(workdir, "--steps=6", *flags)
    outputs = [p.communicate(timeout=180) for p in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs[0][1][-3000:]
    assert "resuming from checkpoint 2" in outputs[0][0]
    assert json.loads((workdir / "summary.json").read_text())["resumed_from_step"] == 2


@pytest.mark.slow
def test_a_signal_to_one_process_stops_both_at_the_same_saved_step(tmp_path):
    workdir = tmp_path / "run"
    processes = start_two_processes(
        workdir, "--steps=1000000", "--log_every=5", "--checkpoint_every=1000000"
    )
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline and processes[0].poll() is None, "training never began"
        time.sleep(0.2)
    processes[1].send_signal(signal.SIGTERM)  # only process 1 is told to stop
    outputs = [p.communicate(timeout=120) for p in processes]
    assert [p.returncode for p in processes] == [143, 143]
    messages = [err.strip().splitlines()[-1] for _, err in outputs]
    assert messages[0] == messages[1]  # the same step in both
    step = int(messages[0].split(" at step ")[1].split(":")[0])
    assert messages[0].startswith(f"error: SIGTERM at step {step}: checkpoint {step} saved")
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == [str(step)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--process_id=1"], "no coordinator answered at 127.0.0.1:{port} within 2 s"),
        (["--process_id=0"], "not every process joined the run at 127.0.0.1:{port} within 2 s"),
    ],
)
def test_a_missing_peer_fails_in_one_line(tmp_path, flags, expected):
    port = free_port()
    result = main_py(
        f"--coordinator_address=127.0.0.1:{port}",
        "--num_processes=2",
        "--distributed_timeout=2",
        f"--workdir={tmp_path}",
        *flags,
    )
    assert result.returncode == 1
    assert result.stderr.startswith("error: ")
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert expected.format(port=port) in result.stderr


@pytest.mark.slow
def test_indivisible_batch_on_eight_devices_is_one_line(tmp_path):
    result = main_py("--batch_size=100", f"--workdir={tmp_path}", devices=8)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: --batch_size=100 does not divide over 8 devices; use a multiple of 8, "
        "e.g. 96 or 104"
    )


@pytest.mark.parametrize(
    "values, message",
    [
        (("localhost:1234", None, None), "given without --num_processes, --process_id"),
        (("localhost", 2, 0), "must be HOST:PORT"),
        (("localhost:1234", 2, 2), "--process_id=2 must be in 0..1"),
    ],
)
def test_distributed_flags_are_checked_before_joining(values, message):
    with pytest.raises(UserError, match=message):
        parallel.initialize(*values, timeout_s=1)


def test_fsdp_shards_the_largest_dimension_that_divides():
    assert parallel.fsdp_spec((784, 256), 8) == parallel.P(parallel.DATA_AXIS)
    assert parallel.fsdp_spec((100, 256), 8) == parallel.P(None, parallel.DATA_AXIS)
    assert parallel.fsdp_spec((10,), 8) == parallel.P()
    assert parallel.fsdp_spec((784, 256), 1) == parallel.P()
    parallel.check_batch(512, 8)
    with pytest.raises(UserError, match=r"use a multiple of 3, e\.g\. 510 or 513"):
        parallel.check_batch(512, 3)


def test_cpu_devices_are_made_only_when_nobody_chose_a_count(monkeypatch):
    """`make_cpu_devices` leaves a count set by XLA_FLAGS or JAX_NUM_CPU_DEVICES alone, asks
    for nothing at 1, and changes nothing once JAX has started (this process): the mesh check
    then says what is missing. (A fresh process gets its devices: tests/test_ensemble.py.)"""
    import jax

    jax.devices()  # this process's backend is up, with the devices it has
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    assert parallel.make_cpu_devices(3) is None
    monkeypatch.delenv("XLA_FLAGS")
    assert parallel.make_cpu_devices(1) is None
    assert parallel.make_cpu_devices(3) is None  # too late: the backend started
    assert len(jax.devices()) == 1
    with pytest.raises(UserError, match=r"shards=3 does not divide the 1 devices"):
        parallel.make_mesh(member_shards=3)
