"""The Grain input pipeline: epochs, shares, saved state; and real runs fed by it on 1 device,
8 virtual devices and 2 processes, including a SIGKILL and a resume."""

from __future__ import annotations

import json
import signal

import jax
import numpy as np
import pytest
from conftest import EVERY_DUE_SAVE, run_main

from fmnist_flax import load_model
from fmnist_flax.runtime import grain_pipeline, parallel

from .test_faults import saved_steps, start, wait_for
from .test_parallel import LOSS_RTOL, main_py, start_two_processes

GRAIN = "--config.input_pipeline=grain"


def numbered(n: int) -> grain_pipeline.ArraySource:
    """n records whose every pixel and label is the record's own number."""
    images = np.repeat(np.arange(n, dtype=np.uint8), 4).reshape(n, 2, 2)
    return grain_pipeline.ArraySource(images, np.arange(n))


def labels_of(batches, steps) -> list[list[int]]:
    """Each step's labels, from one-step blocks."""
    return [batches[k][1][0].tolist() for k in steps]


def test_each_epoch_is_a_fresh_permutation_cut_into_whole_batches():
    batches = grain_pipeline.process_batches(numbered(10), batch_size=3, seed=0)
    epochs = [labels_of(batches, range(e * 3, e * 3 + 3)) for e in range(3)]
    for epoch in epochs:
        seen = [label for batch in epoch for label in batch]
        assert len(seen) == len(set(seen)) == 9  # 3 whole batches, the 10th record dropped
        assert batches[0][0].shape == (1, 3, 4)  # a block of one step
    assert epochs[0] != epochs[1] != epochs[2]
    again = grain_pipeline.process_batches(numbered(10), batch_size=3, seed=0)
    assert labels_of(again, range(3)) == epochs[0]  # seeded
    other = grain_pipeline.process_batches(numbered(10), batch_size=3, seed=1)
    assert labels_of(other, range(3)) != epochs[0]


def test_a_block_holds_the_batches_its_steps_read_one_by_one():
    one = grain_pipeline.process_batches(numbered(20), batch_size=3, seed=0)
    blocks = grain_pipeline.process_batches(numbered(20), 3, 0, steps_per_block=4, first_block=2)
    assert len(blocks) == len(one) - 2  # starting at block 2: steps 9..12 first
    for j in range(3):  # crossing epochs (6 steps each)
        images, labels = blocks[j]
        assert images.shape == (4, 3, 4) and labels.shape == (4, 3)
        for k in range(4):
            np.testing.assert_array_equal(labels[k], one[(j + 2) * 4 + k][1][0])
            np.testing.assert_array_equal(images[k], one[(j + 2) * 4 + k][0][0])


def test_accumulated_steps_read_their_micro_batches_as_one_batch_would():
    """With accumulate=K, step k reads the K * B records one batch of K * B would, as
    (K, B, ...) micro-batches; the epoch has as many steps as such batches fit."""
    whole = grain_pipeline.process_batches(numbered(30), batch_size=12, seed=0)
    micro = grain_pipeline.process_batches(numbered(30), batch_size=3, seed=0, accumulate=4)
    for step in range(4):  # two epochs of 2 steps
        images, labels = micro[step]
        assert images.shape == (1, 4, 3, 4) and labels.shape == (1, 4, 3)
        np.testing.assert_array_equal(labels.reshape(-1), whole[step][1][0])
    colour = grain_pipeline.ArraySource(np.zeros((30, 2, 2, 3), np.uint8), np.arange(30))
    fed = grain_pipeline.GrainBatches(colour, 3, 0, parallel.make_mesh(), None, 0, 4)
    [(x, y, *_)] = list(fed.chunks(0, 1))
    assert x.shape == (1, 4, 3, 12) and y.shape == (1, 4, 3)


def test_a_restored_iterator_state_continues_with_the_same_batches():
    """Mid-block too: blocks of 4 steps, stopped after step 11 (inside the third block)."""
    images = np.arange(256, dtype=np.uint8).reshape(64, 2, 2)
    source, mesh = grain_pipeline.ArraySource(images, np.arange(64)), parallel.make_mesh()

    def feed(state):
        return grain_pipeline.GrainBatches(source, 8, 0, mesh, state, steps_per_block=4)

    def steps(chunks) -> list[np.ndarray]:  # each step's batch, in order
        return [np.asarray(x)[i] for x, _, _, at, count, _ in chunks for i in range(at, at + count)]

    first = feed({"next_index": 0})
    assert len(steps(first.chunks(0, 11))) == 11  # into the second epoch (8 batches each)
    state = first.state()["data_iterator"]
    assert state == {"next_index": 11}
    expected = steps(first.chunks(11, 14))
    resumed = steps(feed(state).chunks(11, 14))
    assert len(expected) == 3
    for a, b in zip(expected, resumed, strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == np.uint8 and a.shape == (8, 4)


def test_every_read_thread_gets_a_block_to_read(caplog):
    """Grain reads no more blocks at once than it buffers: with 4 threads and prefetch=1 the
    buffer still holds 4 (Grain warns when it would idle threads) and the blocks come in order."""
    source = numbered(64)
    fed = grain_pipeline.GrainBatches(
        source, 4, 0, parallel.make_mesh(), workers=4, steps_per_block=2, prefetch=1
    )
    labels = [np.asarray(y)[at] for _, y, _, at, _, _ in fed.chunks(0, 8)]
    assert len(labels) == 4  # a call per block of 2 steps
    one = grain_pipeline.process_batches(source, 4, 0)
    np.testing.assert_array_equal(labels[3], one[6][1][0])
    assert not [r for r in caplog.records if "smaller than num_threads" in r.getMessage()]


def on_records(directory) -> tuple[str, str]:
    return "--config.dataset.name=records", f"--data_dir={directory}"


def rows(workdir) -> list[dict]:
    return [json.loads(r) for r in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_grain_trains_to_the_device_pipelines_band_in_400_steps(tmp_path):
    result = run_main(f"--workdir={tmp_path / 'w'}", GRAIN, "--steps=400", "--report=none")
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "w" / "summary.json").read_text())
    assert summary["test_accuracy"] >= 0.86
    assert summary["config"]["input_pipeline"] == "grain"


@pytest.mark.slow
def test_a_killed_grain_run_resumes_mid_epoch_bit_exact(tmp_path, fmnist_records):
    """From record files, blocks of 32 steps: the kill lands inside a block and an epoch (of
    117 steps: saves every 30 steps fall on neither's end before step 480)."""
    flags = (
        GRAIN,
        "--steps=300",
        "--checkpoint_every=30",
        "--report=none",
        "--log_every=10",
        EVERY_DUE_SAVE,
        *on_records(fmnist_records),
    )
    direct = run_main(f"--workdir={tmp_path / 'direct'}", *flags)
    assert direct.returncode == 0, direct.stderr
    killed = tmp_path / "killed"
    process = start(killed, *flags)
    wait_for(lambda: saved_steps(killed) and saved_steps(killed)[-1] >= 30)
    assert process.poll() is None, "the run ended before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait()
    kept = saved_steps(killed)[-1]
    assert kept % 117, "a mid-epoch checkpoint"  # 117 batches of 512 per epoch
    resumed = run_main(f"--workdir={killed}", *flags)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from checkpoint {kept}" in resumed.stdout
    assert rows(killed) == rows(tmp_path / "direct")
    one, two = (jax.tree.leaves(load_model(w)) for w in (tmp_path / "direct", killed))
    for a, b in zip(one, two, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_grain_on_eight_devices_and_in_two_processes_trains_like_one_device(
    tmp_path, fmnist_records
):
    """From record files: each process reads only its rows of every batch."""
    flags = (
        GRAIN,
        "--steps=30",
        "--log_every=10",
        "--batch_size=256",
        "--report=none",
        *on_records(fmnist_records),
    )
    for name, devices in (("one", 1), ("eight", 8)):
        result = main_py(f"--workdir={tmp_path / name}", *flags, devices=devices)
        assert result.returncode == 0, result.stderr[-3000:]
    processes = start_two_processes(tmp_path / "two", *flags)
    for p in processes:
        _, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
    expected = rows(tmp_path / "one")
    for name in ("eight", "two"):
        got = rows(tmp_path / name)
        assert [r["step"] for r in got] == [r["step"] for r in expected]
        np.testing.assert_allclose(
            [r["loss"] for r in got], [r["loss"] for r in expected], rtol=LOSS_RTOL
        )


@pytest.mark.slow
def test_two_processes_killed_at_once_resume_from_records_exactly(tmp_path, fmnist_records):
    """Both processes SIGKILLed mid-run, then the same two commands: the rows and parameters
    of an uninterrupted two-process run."""
    flags = (
        GRAIN,
        *on_records(fmnist_records),
        "--steps=200",
        "--log_every=10",
        "--batch_size=256",
        "--checkpoint_every=30",
        EVERY_DUE_SAVE,
    )

    def finish(processes) -> str:
        outputs = [p.communicate(timeout=180) for p in processes]
        assert [p.returncode for p in processes] == [0, 0], outputs[0][1][-3000:]
        return outputs[0][0]

    finish(start_two_processes(tmp_path / "direct", *flags))
    killed = tmp_path / "killed"
    processes = start_two_processes(killed, *flags)
    wait_for(lambda: saved_steps(killed) and saved_steps(killed)[-1] >= 30)
    assert all(p.poll() is None for p in processes), "the run ended before it could be killed"
    for p in processes:
        p.send_signal(signal.SIGKILL)
    for p in processes:
        p.wait()
    kept = saved_steps(killed)[-1]
    assert kept < 200
    assert f"resuming from checkpoint {kept}" in finish(start_two_processes(killed, *flags))
    assert rows(killed) == rows(tmp_path / "direct")
    one, two = (jax.tree.leaves(load_model(w)) for w in (tmp_path / "direct", killed))
    for a, b in zip(one, two, strict=True):
        np.testing.assert_array_equal(a, b)
