"""The compiled step, the gradient check and short real-data training runs."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_config, run_main
from flax import nnx

from fmnist_flax import input_pipeline, train
from fmnist_flax.model import MLP, create_model
from fmnist_flax.runtime import (
    checkpoint,
    device_batches,
    ensemble,
    inference,
    metrics_writer,
    parallel,
    plugins,
    stopping,
)
from fmnist_flax.runtime.errors import UserError
from fmnist_flax.runtime.schedule import Schedule


def first_batches(real_dataset, count, batch_size=512):
    device_data = device_batches.to_device(real_dataset, batch_size, parallel.make_mesh())
    order = device_batches.epoch_order(0, 0, 60_000)
    batches = [
        input_pipeline.batch_at(
            device_data.train_images, device_data.train_labels, order, i, batch_size, (28, 28, 1)
        )
        for i in range(count)
    ]
    return device_data, order, batches


def test_first_adamw_step_is_near_chance_and_returns_grad_norm(real_dataset, quick_config):
    _, _, [(x, y)] = first_batches(real_dataset, 1)
    model = MLP(rngs=nnx.Rngs(2))
    optimizer = train.create_optimizer(model, quick_config)
    metrics = train.jit_train_step(model, optimizer, x, y, train.Config(quick_config))
    assert 0.0 <= float(metrics["accuracy"]) < 0.3  # the codelab's "~10% on a fresh model"
    assert float(metrics["grad_norm"]) > 0
    assert np.isfinite(float(metrics["loss"]))


# bfloat16 compiles both paths again: the slow tier (the fast one keeps float32).
@pytest.mark.parametrize(
    "compute_dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.slow)]
)
def test_fused_chunks_equal_one_step_per_call(real_dataset, quick_config, compute_dtype):
    """The default path (K steps per compiled call, on-device batches, donated state) gives
    the same parameters, optimizer state and each step's loss and accuracy as calling the
    plain nnx.jit step once per batch, bit for bit, with a row logged at every step (an
    accelerator's schedule: several rows a call). The gradient norm, which the fused path
    computes only at a row's last step (inside a conditional, so XLA may sum in another
    order), agrees to float32 rounding: 1 part in 10^7 measured in bfloat16, asserted within
    1e-6."""
    quick_config.compute_dtype, quick_config.log_every = compute_dtype, 1
    task = train.Config(quick_config)
    schedule = Schedule(quick_config, 117, platform="tpu")
    assert schedule.rows_per_call == 8
    device_data, order, batches = first_batches(real_dataset, 12)
    plain_model = create_model(quick_config, (28, 28, 1), 10)
    plain_opt = train.create_optimizer(plain_model, quick_config)
    plain_rows = []
    for x, y in batches:
        plain_metrics = train.jit_train_step(plain_model, plain_opt, x, y, task)
        plain_rows.append({k: float(v) for k, v in plain_metrics.items()})

    # Laid out on the mesh as the loop lays it: each call then meets the types it compiled for.
    model, optimizer = train.create_train_state(quick_config, (28, 28, 1), 10, device_data.mesh)
    graphdef, state = train.split_state(model, optimizer)
    chunk = train.make_train_chunk(graphdef, task, (28, 28, 1), None, schedule)
    # The sums replicated as a chunk returns them: the three calls share one compilation.
    sums = train.zero_sums(model, task, (28, 28, 1), device_data.mesh)
    images, labels = device_data.train_images, device_data.train_labels
    rows = []
    for start, count in [(0, 5), (5, 1), (6, 6)]:  # chunks of 5, 1, 6 steps
        call = (images, labels, order, start, count, start, None, schedule.cadence)
        state, sums, ended = chunk(state, sums, *call)
        ended = jax.device_get(ended)
        rows += [{k: v[..., j] for k, v in ended.items()} for j in range(count)]
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert all(isinstance(x, jax.Array) for x in variables)  # plain dicts, no nnx.Variable
    nnx.update((model, optimizer), state)
    for a, b in zip(
        jax.tree.leaves(nnx.state((plain_model, plain_opt))),
        jax.tree.leaves(nnx.state((model, optimizer))),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b)
    assert len(rows) == len(plain_rows) == 12
    for row, plain in zip(rows, plain_rows, strict=True):
        for name in ("loss", "accuracy"):
            assert float(row[name]) == plain[name]
        assert float(row["grad_norm"]) == pytest.approx(plain["grad_norm"], rel=1e-6)
    # Each row ended at its step: the running sums start again from zero.
    assert {"loss", "accuracy"} <= set(sums)
    assert all(float(v) == 0.0 for v in sums.values())


def spans_logged(quick_config, real_dataset, tmp_path, platform: str) -> tuple[list, list]:
    """Steps 0..130 as the loop runs them with `platform`'s schedule, each span's rows handed
    to a metrics writer: the rows it wrote and the final state's arrays."""
    from fmnist_flax.runtime import checkpoint

    quick_config.steps, quick_config.log_every, quick_config.checkpoint_every = 130, 10, 1000
    quick_config.batch_size, quick_config.model.hidden = 128, (32,)
    task = train.Config(quick_config)
    schedule = Schedule(quick_config, 60_000 // 128, platform)
    device_data = device_batches.to_device(real_dataset, 128, parallel.make_mesh())
    model, optimizer = train.create_train_state(task, (28, 28, 1), 10, device_data.mesh)
    graphdef, state = train.split_state(model, optimizer)
    chunk = train.make_train_chunk(graphdef, task, (28, 28, 1), device_data.mesh, schedule)
    zeros = train.zero_sums(model, task, (28, 28, 1), device_data.mesh)
    batches = device_batches.DeviceBatches(device_data, task)
    checkpoints = checkpoint.Checkpoints(tmp_path, max_to_keep=1)
    cadence = jax.device_put(schedule.cadence, parallel.replicated(device_data.mesh))
    spans, step = 0, 0
    with metrics_writer.MetricsWriter(
        tmp_path, quick_config, 0, 128, checkpoints, 0.1, zeros=zeros, schedule=schedule
    ) as writer:
        while step < quick_config.steps:
            stop = schedule.next_stop(step)
            for call in batches.chunks(step, stop):
                state, writer.sums, rows = chunk(state, writer.sums, *call, None, cadence)
            writer.write(stop, rows, 0.0)
            step, spans = stop, spans + 1
        writer.flush()
    checkpoints.close()
    return rows_of(tmp_path), jax.tree.leaves(state), spans


def test_an_accelerators_calls_past_logged_steps_log_the_same_rows(
    quick_config, real_dataset, tmp_path
):
    """With an accelerator's schedule each call runs past up to 8 logged steps and returns
    their rows: the rows written and the state trained are the ones of a call per row, bit
    for bit, in fewer calls."""
    one, one_state, one_spans = spans_logged(quick_config, real_dataset, tmp_path / "cpu", "cpu")
    many, state, spans = spans_logged(quick_config, real_dataset, tmp_path / "tpu", "tpu")
    assert [row["step"] for row in one] == [1, *range(10, 131, 10)]
    assert many == one
    for a, b in zip(one_state, state, strict=True):
        np.testing.assert_array_equal(a, b)
    assert spans < one_spans / 3


@pytest.mark.parametrize(
    ("size", "shards", "per_pass", "platform", "expected"),
    [
        (8, 1, 0, "cpu", 2),  # a CPU: two per device, whose optimizer state fits its cache
        (8, 2, 0, "cpu", 4),
        (3, 1, 0, "cpu", 3),  # two do not divide three: all at once, not passes of one
        (8, 1, 0, "gpu", 8),  # an accelerator: every member at once
        (8, 1, 4, "cpu", 4),  # the config's own choice
    ],
)
def test_members_per_pass_follows_the_config_or_the_device(
    quick_config, size, shards, per_pass, platform, expected
):
    quick_config.ensemble.update(size=size, shards=shards, members_per_pass=per_pass)
    assert ensemble.members_per_pass(quick_config, platform) == expected


def trained_members(quick_config, real_dataset, per_pass: int) -> tuple[list, dict, dict]:
    """Four small members on their own data and augmentation, `per_pass` at a time: 6 steps in
    two fused chunks, or with `fused_steps=False`, one step per call. Their state, sums, metrics."""
    quick_config.batch_size, quick_config.augment.flip, quick_config.model.hidden = 64, True, (32,)
    quick_config.ensemble.size, quick_config.ensemble.same_data = 4, False
    quick_config.ensemble.members_per_pass = per_pass
    task = train.Config(quick_config)
    device_data = device_batches.to_device(real_dataset, 64, parallel.make_mesh())
    model, optimizer = train.create_train_state(task, (28, 28, 1), 10, device_data.mesh)
    graphdef, state = train.split_state(model, optimizer)
    chunk = train.make_train_chunk(graphdef, task, (28, 28, 1), device_data.mesh)
    sums = train.zero_sums(model, task, (28, 28, 1), device_data.mesh)  # one compile
    key = input_pipeline.augment_key(task)
    totals = None  # the rows each call ends summed: every step's metrics
    orders = device_batches.epoch_orders(ensemble.data_seeds(task), 0, 60_000)
    data = device_data.train_images, device_data.train_labels, orders
    calls = [(0, 4), (4, 2)] if quick_config.fused_steps else [(i, 1) for i in range(6)]
    for start, count in calls:
        state, sums, rows = chunk(state, sums, *data, start, count, start, key)
        ended = {k: v[..., 0] for k, v in rows.items()}
        totals = ended if totals is None else jax.tree.map(np.add, totals, ended)
    return jax.tree.leaves(state), totals, ended


@pytest.mark.slow  # ensembles, like tests/test_ensemble.py's trained ones: compiles 4 programs
@pytest.mark.parametrize("fused", [True, False])
def test_members_in_passes_train_as_all_members_at_once(real_dataset, quick_config, fused):
    """An ensemble trained two members at a time (the CPU's passes, one after another inside
    each call; unrolled when each call is one step) ends where all four at once do: the same
    parameters, optimizer state, metric sums and last losses to the bit, every member in its
    place. The gradient norm sums in its own order: within 1e-6."""
    quick_config.fused_steps = fused
    state, sums, metrics = trained_members(quick_config, real_dataset, per_pass=2)
    at_once, at_once_sums, at_once_metrics = trained_members(quick_config, real_dataset, 4)
    for a, b in zip(state, at_once, strict=True):
        np.testing.assert_array_equal(a, b)
    for name in ("loss", "accuracy"):
        np.testing.assert_array_equal(sums[name], at_once_sums[name])
        np.testing.assert_array_equal(metrics[name], at_once_metrics[name])
    np.testing.assert_allclose(metrics["grad_norm"], at_once_metrics["grad_norm"], rtol=1e-6)
    assert len(set(np.asarray(metrics["loss"]).tolist())) == 4  # four members, not one four times


def test_chunks_stop_at_log_checkpoint_and_epoch_boundaries(quick_config):
    quick_config.log_every, quick_config.checkpoint_every, quick_config.steps = 25, 100, 400
    stops, step = [], 0
    while step < quick_config.steps:
        step = Schedule(quick_config, 117).next_stop(step)
        stops.append(step)
    assert stops[:6] == [1, 25, 50, 75, 100, 117]
    assert 234 in stops and 351 in stops and stops[-1] == 400
    assert all(s % 25 == 0 or s % 117 == 0 or s == 1 for s in stops)


def test_a_checkpoint_step_is_a_stop_only_where_a_save_is_due(quick_config, tmp_path):
    """On the way to the next stop a checkpoint step is one only where a save is due as far as
    can be told: with a time floor not yet passed, the call runs on to the logged step."""
    quick_config.steps, quick_config.log_every, quick_config.checkpoint_every = 1000, 500, 100
    schedule, stops = Schedule(quick_config, 1000), {}
    for floor in (0.0, 3600.0):
        saves = checkpoint.Checkpoints(
            tmp_path / str(floor), max_to_keep=1, min_interval_secs=floor
        )
        stops[floor] = schedule.next_stop(150, None, saves)
        saves.close()
    assert stops == {0.0: 200, 3600.0: 500}
    assert schedule.next_stop(150) == 200  # no checkpoints: every checkpoint step


@pytest.mark.parametrize(("eval_every", "evaluated"), [(0, [117, 234, 351, 400]), (60, None)])
def test_evaluations_come_each_epoch_or_every_eval_every_steps_and_at_the_end(
    quick_config, eval_every, evaluated
):
    quick_config.log_every, quick_config.steps, quick_config.eval_every = 25, 400, eval_every
    stops, step = [], 0
    while step < quick_config.steps:
        step = Schedule(quick_config, 117).next_stop(step)
        stops.append(step)
    tested = [s for s in stops if Schedule(quick_config, 117).evaluates(s)]
    assert tested == (evaluated or [60, 120, 180, 240, 300, 360, 400])


def rows_of(workdir) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def short_run(quick_config, workdir, fields=None):
    """50 steps, a row every 25, with `fields` ({"optimizer.accumulate": 4, ...}) changed."""
    quick_config.steps, quick_config.log_every, quick_config.eval_examples = 50, 25, 2_000
    quick_config.update_from_flattened_dict(fields or {})
    return train.train_and_evaluate(quick_config, workdir)


class AcceleratorSchedule(Schedule):
    """What the loop does on a TPU or GPU, on this CPU."""

    def __init__(self, config, batches_per_epoch, platform="cpu"):
        super().__init__(config, batches_per_epoch, "tpu")


def test_on_an_accelerator_evaluations_overlap_training_with_the_same_rows(
    quick_config, tmp_path, monkeypatch
):
    """With an accelerator's schedule the evaluations nothing waits for (the first too, its
    program compiled ahead; not the last, which is saved) reach the writer as functions that
    wait for their metrics on its thread; every row and the final state are the same as the
    CPU's loop's."""
    handed = {}
    write = metrics_writer.MetricsWriter.write

    def spy(self, step, rows, eval_seconds, tested=None):
        if tested:
            handed[step] = callable(tested)
        return write(self, step, rows, eval_seconds, tested)

    monkeypatch.setattr(metrics_writer.MetricsWriter, "write", spy)
    quick_config.eval_every = 15
    cpu = short_run(quick_config, tmp_path / "cpu", {"steps": 60, "log_every": 10})
    assert handed == {15: False, 30: False, 45: False, 60: False}
    monkeypatch.setattr(train, "Schedule", AcceleratorSchedule)
    tpu = short_run(quick_config, tmp_path / "tpu", {"steps": 60, "log_every": 10})
    assert handed == {15: True, 30: True, 45: True, 60: False}
    assert rows_of(tmp_path / "tpu") == rows_of(tmp_path / "cpu")
    assert [r["step"] for r in rows_of(tmp_path / "cpu") if "test_loss" in r] == [15, 30, 45, 60]
    assert tpu["test_accuracy"] == cpu["test_accuracy"]


def test_an_after_evaluation_hook_ends_the_run_and_a_resume_stays_there(
    quick_config, tmp_path, registries
):
    """A hook returning True ends the run at that evaluation, saved, its summary written; the
    same call again trains no further."""
    seen = []

    def stop_at_20(step, metrics, run):
        seen.append((step, "test_accuracy" in metrics, run.config.eval_every))
        return step == 20

    train.after_evaluation(stop_at_20)
    quick_config.steps, quick_config.log_every, quick_config.eval_every = 40, 10, 10
    quick_config.eval_examples = 1_000
    summary = train.train_and_evaluate(quick_config, tmp_path / "w")
    assert seen == [(10, True, 10), (20, True, 10)] and summary["stopped_at"] == 20
    rows = rows_of(tmp_path / "w")
    assert rows[-1]["step"] == 20
    assert max(int(p.name) for p in (tmp_path / "w" / "checkpoints").iterdir()) == 20
    assert train.train_and_evaluate(quick_config, tmp_path / "w")["stopped_at"] == 20
    assert rows_of(tmp_path / "w") == rows and len(seen) == 2


def test_a_row_is_the_mean_of_the_steps_since_the_row_before(quick_config, tmp_path, caplog):
    """Logged every 25 steps, a row equals the mean of the rows the same run logs every step
    (the gradient norm stays the row's last step's): summed inside the compiled chunks, and
    carried from one call to the next across a stop that logs nothing (a save at step 30),
    with no second compilation of the chunk for the carried sums."""
    jax.config.update("jax_log_compiles", True)
    try:
        short_run(quick_config, tmp_path / "every25", {"checkpoint_every": 30})
    finally:
        jax.config.update("jax_log_compiles", False)
    compiled = [r for r in caplog.records if "Compiling jit(train_chunk)" in r.getMessage()]
    assert len(compiled) == 1
    short_run(quick_config, tmp_path / "every1", {"log_every": 1})
    every = {row["step"]: row for row in rows_of(tmp_path / "every1")}
    rows = rows_of(tmp_path / "every25")
    assert [row["step"] for row in rows] == [1, 25, 50]
    for row, since in zip(rows[1:], (1, 25), strict=True):
        steps = range(since + 1, row["step"] + 1)  # 24 steps, then 25
        for name in ("loss", "accuracy"):
            mean = np.mean([every[s][name] for s in steps])
            assert row[name] == pytest.approx(mean, rel=1e-6), (row["step"], name)
        assert row["grad_norm"] == pytest.approx(every[row["step"]]["grad_norm"], rel=1e-5)
    assert rows[0] == every[1]  # step 1 is a row of its own


def test_accumulating_4_batches_of_128_trains_like_batches_of_512(quick_config, tmp_path):
    """One update per 4 micro-batches of 128 reads the same 512 examples as a batch of 512
    (the same data order and augmentation draws) and averages their gradients."""
    base = short_run(quick_config, tmp_path / "b512", {"augment.flip": True})
    accumulated = short_run(
        quick_config, tmp_path / "b128x4", {"batch_size": 128, "optimizer.accumulate": 4}
    )
    assert accumulated["steps"] == base["steps"] == 50  # steps count updates
    for a, b in zip(rows_of(tmp_path / "b128x4"), rows_of(tmp_path / "b512"), strict=True):
        assert a["step"] == b["step"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), a["step"]
        assert a["accuracy"] == pytest.approx(b["accuracy"], abs=1e-3)
    assert accumulated["test_accuracy"] == pytest.approx(base["test_accuracy"], abs=1e-3)


def parts(step: int, sums: dict, count: int) -> metrics_writer.Parts:
    """The parts of one row logged at `step`, `count` steps after the row before, its
    gradient norm 0.5."""
    rows = {k: jax.numpy.asarray(v)[None] for k, v in sums.items()}
    return [step], rows | {"grad_norm": jax.numpy.float32([0.5])}, step - count


def test_the_metrics_writer_writes_rows_in_the_background_in_order_until_a_non_finite_loss(
    tmp_path, quick_config
):
    """Rows handed to the writer's thread reach metrics.jsonl in order, an evaluation step's with
    its test metrics; a non-finite loss among them stops the run at the next check, naming
    the last finite row, and nothing after it is written."""
    from fmnist_flax.runtime import checkpoint

    checkpoints = checkpoint.Checkpoints(tmp_path, max_to_keep=1)
    sums = {"loss": jax.numpy.float32(2.0), "accuracy": jax.numpy.float32(1.0)}
    with metrics_writer.MetricsWriter(tmp_path, quick_config, 0, 512, checkpoints, 0.1) as log:
        assert log.queue is not None  # one process: rows go to the writer thread
        for step in (1, 25):
            log.submit(parts(step, sums, 2), 0.0)
        log.submit(parts(50, sums, 2), 0.3, {"test_accuracy": 0.75})
        log.flush()
        assert log.last_finite == 50
        nan = {"loss": jax.numpy.float32(np.nan), "accuracy": jax.numpy.float32(0.0)}
        log.submit(parts(75, nan, 25), 0.0)
        log.submit(parts(100, sums, 25), 0.0)
        with pytest.raises(UserError, match="loss became nan between steps 50 and 75"):
            log.flush()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 25, 50]
    assert rows[1] == {"step": 25, "loss": 1.0, "accuracy": 0.5, "grad_norm": 0.5}
    assert rows[2] == rows[1] | {"step": 50, "test_accuracy": 0.75}
    checkpoints.close()


def test_an_evaluation_waits_for_the_rows_before_to_be_timed_not_written(tmp_path, quick_config):
    """`wait_timed` (before an evaluation's clock starts) returns once every handed-over row's
    values have reached the writer, while it is still writing them: a row timed during the
    evaluation would have the evaluation left out of an interval that never held it."""
    from fmnist_flax.runtime import checkpoint

    checkpoints = checkpoint.Checkpoints(tmp_path, max_to_keep=1)
    sums = {"loss": jax.numpy.float32(2.0), "accuracy": jax.numpy.float32(1.0)}
    release = threading.Event()
    with metrics_writer.MetricsWriter(tmp_path, quick_config, 0, 512, checkpoints, 0.1) as log:
        write = log._write_rows
        log._write_rows = lambda *args: (release.wait(), write(*args))  # a writer held up
        log.submit(parts(25, sums, 25), 0.0)
        waiter = threading.Thread(target=log.wait_timed)
        waiter.start()
        waiter.join(60)
        assert not waiter.is_alive() and log.timed == 25
        assert not (tmp_path / "metrics.jsonl").read_text()  # timed, not yet written
        release.set()
        log.submit(parts(50, sums, 25), 0.1, {"test_accuracy": 0.75})
        log.flush()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [25, 50]
    checkpoints.close()


def test_rows_the_writer_fetches_together_share_one_rate(tmp_path, quick_config):
    """While the writer's thread is held up (a save's thread holding the GIL; here, a row
    whose evaluation it waits for), the next rows queue and are fetched together: each was
    timed on its own, the second microseconds after the first, and TensorBoard's
    train/examples_per_sec read 20-100x the true rate. They share the rate of their steps
    over the time since the row before."""
    from fmnist_flax.runtime import checkpoint

    checkpoints = checkpoint.Checkpoints(tmp_path, max_to_keep=1)
    sums = {"loss": jax.numpy.float32(2.0), "accuracy": jax.numpy.float32(1.0)}
    entered, release, held = threading.Event(), threading.Event(), 0.5
    written = []

    def evaluation() -> dict[str, float]:  # one the writer waits for, until released
        entered.set()
        release.wait()
        return {"test_loss": 0.5}

    with metrics_writer.MetricsWriter(tmp_path, quick_config, 0, 512, checkpoints, 0.1) as log:
        write = log._write_rows
        log._write_rows = lambda rows, rate: (written.append(rate), write(rows, rate))
        log.submit(parts(10, sums, 10), 0.0)
        log.flush()  # the first row's interval holds the compilation: no rate
        log.submit(parts(20, sums, 10), 0.0, evaluation)
        assert entered.wait(30)  # the writer holds row 20 alone
        for step in (30, 40):
            log.submit(parts(step, sums, 10), 0.0)
        time.sleep(held)
        release.set()
        log.flush()
    assert len(written) == 3 and written[0] is None  # 10, 20, then 30 and 40 in one write
    # Their 20 steps took at least about the time the writer was held (half of it, allowing
    # for the writer to time row 20 late); each alone, row 40's took microseconds.
    assert 0 < written[2] <= (40 - 20) * 512 / (held / 2), written
    checkpoints.close()


def test_waits_for_rows_after_a_non_finite_one_end_and_stop_the_run(tmp_path, quick_config):
    """Rows handed over after a non-finite one are skipped but still count as timed and
    handled: a wait before an evaluation or a save ends and stops the run, not hangs."""
    from fmnist_flax.runtime import checkpoint

    checkpoints = checkpoint.Checkpoints(tmp_path, max_to_keep=1)
    sums = {"loss": jax.numpy.float32(2.0), "accuracy": jax.numpy.float32(1.0)}
    nan = {"loss": jax.numpy.float32(np.nan), "accuracy": jax.numpy.float32(0.0)}
    raised = []

    def wait(method) -> None:
        try:
            method()
        except UserError as exc:
            raised.append(str(exc))

    with metrics_writer.MetricsWriter(tmp_path, quick_config, 0, 512, checkpoints, 0.1) as log:
        log.submit(parts(25, nan, 25), 0.0)
        for step in (50, 75, 100):
            log.submit(parts(step, sums, 25), 0.0)
        for method in (log.wait_timed, log.flush):
            waiter = threading.Thread(target=wait, args=(method,), daemon=True)
            waiter.start()
            waiter.join(30)
            assert not waiter.is_alive(), f"{method.__name__} still waits"
    assert (
        raised
        == [
            "the loss became nan between steps 0 and 25; training stopped, the last "
            "good checkpoint is none; lower --learning_rate and retry"
        ]
        * 2
    )
    checkpoints.close()


def test_a_signal_ends_a_wait_for_rows_to_be_timed(tmp_path, quick_config, monkeypatch):
    """A row whose values are slow to reach the host keeps the loop waiting before an
    evaluation only until a stop signal comes: the loop then acts on it at its stop."""
    from fmnist_flax.runtime import checkpoint

    checkpoints = checkpoint.Checkpoints(tmp_path, max_to_keep=1)
    sums = {"loss": jax.numpy.float32(2.0), "accuracy": jax.numpy.float32(1.0)}
    release = threading.Event()
    host_rows = metrics_writer.host_rows

    def held(*parts):
        release.wait()
        return host_rows(*parts)

    monkeypatch.setattr(metrics_writer, "host_rows", held)
    stop = stopping.Stop()
    with metrics_writer.MetricsWriter(
        tmp_path, quick_config, 0, 512, checkpoints, 0.1, stop=stop
    ) as log:
        log.submit(parts(25, sums, 25), 0.0)
        waiter = threading.Thread(target=log.wait_timed, daemon=True)
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()  # the row is not timed yet
        stop.signum = signal.SIGINT
        waiter.join(5)
        assert not waiter.is_alive() and log.timed == 0
        release.set()
    assert [row["step"] for row in rows_of(tmp_path)] == [25]  # written once released
    checkpoints.close()


def test_the_metrics_writer_logs_the_running_row_and_starts_the_next(tmp_path, quick_config):
    """`write` logs the rows a call ended since the row before (each its sums' means over its
    steps), as the schedule places them; a checkpoint keeps the running row (`state`), and a
    writer given it goes on from there."""
    from fmnist_flax.runtime import checkpoint

    quick_config.steps, quick_config.log_every = 30, 25
    schedule = Schedule(quick_config, 117)
    checkpoints = checkpoint.Checkpoints(tmp_path, max_to_keep=1)
    zeros = {"loss": jax.numpy.float32(0.0), "accuracy": jax.numpy.float32(0.0)}
    with metrics_writer.MetricsWriter(
        tmp_path, quick_config, 0, 512, checkpoints, 0.1, zeros=zeros, schedule=schedule
    ) as writer:
        ended = {"loss": [3.0, 48.0], "accuracy": [0.0, 19.2], "grad_norm": [0.25, 0.5]}
        writer.write(25, {k: np.float32(v) for k, v in ended.items()}, 0.0)  # rows 1 and 25
        writer.sums = {"loss": jax.numpy.float32(5.0), "accuracy": jax.numpy.float32(2.5)}
        writer.write(27, {}, 0.0)  # no row ends at 26 or 27
        writer.flush()
        saved = writer.state()["row"]
    assert saved == {"start": 25, "sums": {"loss": 5.0, "accuracy": 2.5}}
    with metrics_writer.MetricsWriter(
        tmp_path,
        quick_config,
        27,
        512,
        checkpoints,
        0.1,
        zeros=zeros,
        saved_row=saved,
        schedule=schedule,
    ) as writer:
        assert {k: float(v) for k, v in writer.sums.items()} == {"loss": 5.0, "accuracy": 2.5}
        ended = {"loss": [10.0], "accuracy": [2.5], "grad_norm": [0.5]}
        writer.write(30, {k: np.float32(v) for k, v in ended.items()}, 0.0)
        writer.flush()
    rows = rows_of(tmp_path)
    assert rows == [
        {"step": 1, "loss": 3.0, "accuracy": 0.0, "grad_norm": 0.25},
        {"step": 25, "loss": 2.0, "accuracy": pytest.approx(0.8), "grad_norm": 0.5},
        {"step": 30, "loss": 2.0, "accuracy": 0.5, "grad_norm": 0.5},
    ]
    checkpoints.close()


def slow_step(seconds: float):
    """A compiled `step(x)` of at least `seconds` on this machine, whatever its speed, its
    input, and its measured time."""
    slow = jax.jit(lambda x, n: jax.lax.fori_loop(0, n, lambda i, y: jnp.tanh(y @ y), x))
    x = jnp.eye(256) * 0.5
    n = 1
    while True:
        jax.block_until_ready(slow(x, n))
        began = time.perf_counter()
        jax.block_until_ready(slow(x, n))
        if time.perf_counter() - began > seconds:
            return functools.partial(slow, n=n), x, time.perf_counter() - began
        n *= 2


def test_calls_are_sized_to_the_devices_pace_so_a_signal_waits_little(tmp_path):
    """`Stop.early_step` times the calls: the first two run one step, the second timed at
    once, then a call's steps fit `CALL_SECONDS`, two of them queued at most; on a signal it
    names the step the newest call ends at."""
    step, x, per_step = slow_step(0.02)
    stop = stopping.Stop()
    assert stop.steps_per_call == 1
    reached, sizes = 0, []
    while reached < 80:
        count = stop.steps_per_call
        sizes.append(count)
        out = x
        for _ in range(count):  # a call of `count` steps, queued behind the one before
            out = step(out)
        reached += count
        assert stop.early_step(reached, out) is None
        assert len(stop._in_flight) <= 2
    assert sizes[:2] == [1, 1]
    expected = stopping.CALL_SECONDS / per_step
    assert all(expected / 4 <= size <= expected * 4 for size in sizes[2:]), (sizes, per_step)
    stop.signum = signal.SIGINT
    assert stop.early_step(reached + 1, out) == reached + 1


@pytest.mark.parametrize(("budget", "most"), [(1000.0, 37), (0.0, 1)])
def test_short_calls_queue_up_to_queued_seconds_of_work(monkeypatch, budget, most):
    """Once a step is timed, `Stop.early_step` waits for the oldest calls only while more than
    `QUEUED_SECONDS` of work is queued by its timing: with room for a thousand steps, all 37
    calls after the timed one run ahead of the host (an accelerator's calls of microseconds);
    with none, one at a time."""
    step, x, _ = slow_step(0.01)
    monkeypatch.setattr(stopping, "QUEUED_SECONDS", 0.0)
    stop, out, queued = stopping.Stop(), x, []
    for reached in range(1, 40):  # calls of one step
        out = step(out)
        assert stop.early_step(reached, out) is None
        queued.append(len(stop._in_flight))
        if reached == 2:  # timed at once: the budget in steps of its time
            monkeypatch.setattr(stopping, "QUEUED_SECONDS", budget * stop._step_seconds)
        queued_seconds = stop._queued_seconds(reached)
        assert len(queued) < 3 or queued[-1] == 1 or queued_seconds <= stopping.QUEUED_SECONDS
    assert queued[:2] == [1, 0]
    assert max(queued[2:]) == most and queued[-1] == most, queued


def test_golden_first_steps_on_fixed_real_images(real_dataset):
    """The codelab's model from seed 0 on the first 512 training images of the file: any
    change to the init, the loss, the optimizer or the data scaling moves these numbers."""
    config = load_config("default")
    model, optimizer = train.create_train_state(config, (28, 28, 1), 10, parallel.make_mesh())
    x = input_pipeline.prepare_images(real_dataset.train_images[:512])
    y = real_dataset.train_labels[:512].astype(np.int32)
    first = train.jit_train_step(model, optimizer, x, y, train.Config(config))
    second = train.jit_train_step(model, optimizer, x, y, train.Config(config))
    assert float(first["loss"]) == pytest.approx(2.5092971324920654, rel=1e-5)
    assert float(first["grad_norm"]) == pytest.approx(1.989441990852356, rel=1e-5)
    assert float(first["accuracy"]) == 27 / 512
    assert float(second["loss"]) == pytest.approx(1.9706456661224365, rel=1e-5)
    assert float(second["grad_norm"]) == pytest.approx(2.684241533279419, rel=1e-5)


# --- A plug-in's faults: one line naming it, the steps since the last save saved first ---------

FAULTY = "faulty_plug_in"  # one module name for every variant: the compiled steps are shared


@pytest.fixture
def plug_in(tmp_path, monkeypatch, forget_modules, registries):
    """`write(source)`: a module of the project, FAULTY, holding `source` after the imports
    a plug-in uses, on the import path; returns its name for config.imports."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    forget_modules.append(FAULTY)

    def write(source: str) -> str:
        header = "import sys\nimport jax.numpy as jnp\nimport numpy as np\n"
        header += "from fmnist_flax import task, train\n"
        (site / f"{FAULTY}.py").write_text(header + source)
        return FAULTY

    return write


def hooked_run(quick_config, workdir, imports=None, **fields):
    """30 steps, saved every 10 and evaluated at 15 and 30 on 1,000 test images; `imports`:
    the module config.imports names (None: none)."""
    quick_config.update(steps=30, log_every=5, checkpoint_every=10, eval_every=15)
    quick_config.update(eval_examples=1_000, imports=(imports,) if imports else (), **fields)
    return train.train_and_evaluate(quick_config, workdir)


def saved_steps(workdir) -> list[int]:
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir())


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ("raise RuntimeError('boom')", "failed at step 15 (RuntimeError: boom)"),
        ("sys.exit(3)", "failed at step 15 (it called sys.exit(3))"),
        ("return 'no'", "returned 'no' (str) at step 15; it must return True"),
        ("return np.float32(0.5)", "returned np.float32(0.5) (float32) at step 15"),
        ("return np.ones(3)", "returned array([1., 1., 1.]) (ndarray) at step 15"),
        ("metrics['val_x'] = 'high'", "set metrics['val_x'] at step 15 to 'high' (str), not a"),
        ("metrics['val_x'] = np.ones(3)", "set metrics['val_x'] at step 15 to array"),
        ("metrics['epoch'] = 1.0", "set metrics['epoch'] at step 15: 'epoch' is a name the"),
        ("metrics['test_accuracy'] = 1.0", "set metrics['test_accuracy'] at step 15: 'test_"),
        ("metrics['accuracy'] = 1.0", "set metrics['accuracy'] at step 15: 'accuracy' is a"),
        ("metrics['name'] = 1.0", "set metrics['name'] at step 15: 'name' is a name the"),
    ],
)
def test_a_failing_after_evaluation_hook_is_one_line_the_steps_since_the_save_saved(
    quick_config, tmp_path, plug_in, body, said
):
    """A hook that raises, exits, returns anything but True/False/None, or adds a value that
    is no number or takes a name the project writes (`epoch` made every checkpoint damaged;
    `test_accuracy` and `accuracy` overwrote the row's): one line naming the hook, after
    checkpoint 15 (the steps since the save at 10) is saved, intact, with the row of 15."""
    name = plug_in(f"@train.after_evaluation\ndef check(step, metrics, run):\n    {body}\n")
    with pytest.raises(UserError) as failed:
        hooked_run(quick_config, tmp_path / "w", name)
    line = str(failed.value)
    assert line.startswith(f"after-evaluation hook {FAULTY}.check ") and said in line
    assert f"checkpoint 15 saved in {tmp_path / 'w' / 'checkpoints'}" in line
    assert "\n" not in line
    assert saved_steps(tmp_path / "w") == [10, 15]
    progress = checkpoint.saved_item(tmp_path / "w" / "checkpoints", 15, "progress")
    assert progress["epoch"] == 0 and "test_accuracy" in progress  # intact, its evaluation kept
    rows = rows_of(tmp_path / "w")
    assert rows[-1]["step"] == 15 and rows[-1]["test_accuracy"] == progress["test_accuracy"]
    assert rows[-1]["accuracy"] != 1.0


def test_an_early_stop_is_said_in_one_line_and_the_names_the_project_writes_are_reserved(
    quick_config, tmp_path, plug_in, capsys
):
    """A hook's True (or np.bool_) ends the run with one line; the values it adds (np.float32
    and 0-d arrays taken as floats) are saved. Every field of a saved progress item but the
    evaluation's test_* is one of plugins.PROJECT_NAMES: none is a plug-in's to take."""
    name = plug_in(
        "@train.after_evaluation\ndef check(step, metrics, run):\n"
        "    metrics.update(val_a=np.float32(0.25), val_b=jnp.asarray(2))\n"
        "    return np.bool_(step == 15)\n"
    )
    summary = hooked_run(quick_config, tmp_path / "w", name, keep_best=True)
    assert summary["stopped_at"] == 15
    said = capsys.readouterr().out
    assert f"{FAULTY}.check ended the run at step 15 of 30: an early stop" in said
    progress = checkpoint.saved_item(tmp_path / "w" / "checkpoints", 15, "progress")
    assert progress["val_a"] == 0.25 and progress["val_b"] == 2.0
    written = {k for k in progress if not k.startswith("test_")} - {"val_a", "val_b"}
    assert written <= plugins.PROJECT_NAMES and {"step", "epoch", "row"} <= written


@pytest.mark.slow
def test_a_hook_calling_sys_exit_is_one_line_from_main(tmp_path):
    """`sys.exit(3)` in a hook ended main.py with status 3 and no line, steps 11-15 lost."""
    (tmp_path / "exits.py").write_text(
        "import sys\nfrom fmnist_flax import train\n\n\n@train.after_evaluation\n"
        "def leave(step, metrics, run):\n    sys.exit(3)\n"
    )
    result = run_main(
        "--config=configs/smoke.py",
        "--config.eval_every=15",
        "--config.demonstrations=False",
        "--config.imports=('exits',)",
        f"--workdir={tmp_path / 'w'}",
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])
            ),
        },
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    [line] = [s for s in result.stderr.splitlines() if s.strip() and "No GPU found" not in s]
    assert line.startswith("error: after-evaluation hook exits.leave failed at step 15 (it ")
    assert saved_steps(tmp_path / "w") == [10, 15]


@pytest.mark.parametrize(
    ("source", "said"),
    [
        (
            "@task.metric('step')\ndef m(logits, labels, config):\n    return labels * 0.0\n",
            "importing 'faulty_plug_in': @task.metric('step'): a name must be one of its own, "
            "and 'step' is a name the project writes itself",
        ),
        (
            "@task.loss_term('grad_norm')\ndef m(logits, labels, config):\n    return 0 * labels\n",
            "@task.loss_term('grad_norm'): a name must be one of its own, and 'grad_norm' is a",
        ),
        (
            "@task.metric('wide')\ndef m(logits, labels, config):\n    return logits\n",
            "metric 'wide' (faulty_plug_in.m) returned shape (512, 10), not (512,)",
        ),
        (
            "@task.metric('broken')\ndef m(logits, labels, config):\n    return labels.nope\n",
            "metric 'broken' (faulty_plug_in.m) failed: AttributeError:",
        ),
    ],
)
def test_a_metric_named_as_the_project_writes_or_of_the_wrong_shape_is_one_line_before_training(
    quick_config, tmp_path, plug_in, source, said
):
    """`@task.metric("step")` overwrote each row's step; a metric of (B, 10) values, or one
    that raises, was a traceback. Each is one line naming it before any step is trained."""
    name = plug_in(source)
    with pytest.raises(UserError, match=re.escape(said)) as refused:
        hooked_run(quick_config, tmp_path / "w", name)
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "w" / "checkpoints").exists() or not saved_steps(tmp_path / "w")


def test_a_non_finite_loss_term_is_named(quick_config, tmp_path, plug_in):
    """A loss term of NaN made the loss NaN, said as `lower --learning_rate` alone."""
    name = plug_in(
        "@task.loss_term('bad_term')\ndef m(logits, labels, config):\n"
        "    return jnp.log(labels * 0.0 - 1.0)\n"
    )
    with pytest.raises(UserError) as stopped:
        hooked_run(quick_config, tmp_path / "w", name)
    assert str(stopped.value) == (
        "the loss became nan between steps 0 and 1 (its term bad_term too); training stopped, "
        "the last good checkpoint is none; check the loss term bad_term, or lower "
        "--learning_rate and retry"
    )


def test_values_that_are_not_finite_are_shown_and_kept_not_a_crash(
    quick_config, tmp_path, plug_in, capsys
):
    """A hook's NaN or inf, a metric of 0/0 and a row someone else wrote into metrics.jsonl
    (`{"step": 12, "loss": 1e999}`, no accuracy) crashed the closing table (a TypeError on
    the null they are written as), so no summary.json was written and every rerun crashed.
    They are shown as nan, the run finishes and resumes."""
    name = plug_in(
        "@task.metric('ratio')\ndef ratio(logits, labels, config):\n"
        "    return (labels * 0.0) / (labels * 0.0)\n\n\n"
        "@train.after_evaluation\ndef check(step, metrics, run):\n"
        "    metrics.update(val_nan=float('nan'), val_inf=float('inf'))\n"
    )
    summary = hooked_run(quick_config, tmp_path / "w", name)
    table = capsys.readouterr().out
    assert "Val nan" in table and "Ratio" in table and " nan" in table
    assert np.isnan(summary["final_train_ratio"]) and (tmp_path / "w" / "summary.json").exists()
    lines = (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()
    lines.insert(3, '{"step": 12, "loss": 1e999}')
    (tmp_path / "w" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    summary = hooked_run(quick_config, tmp_path / "w", name, steps=40, eval_every=20)
    assert summary["resumed_from_step"] == 30
    assert [row["step"] for row in rows_of(tmp_path / "w")][2:5] == [10, 12, 15]
    assert "\n  12     nan\n" in capsys.readouterr().out


def test_best_by_test_loss_is_the_lowest_loss_and_a_misspelt_metric_is_refused_before_training(
    quick_config, tmp_path
):
    """keep_best with best_metric=test_loss kept and returned the step of the *highest* test
    loss; a loss (a name ending in `loss`) now ranks lowest first. best_metric=test_acc was
    found at the first evaluation, after the steps since the last save were lost; any name no
    evaluation has is now one line before the workdir is made."""
    quick_config.update(keep_best=True, best_metric="test_loss", max_to_keep=1)
    hooked_run(quick_config, tmp_path / "w", eval_every=10)
    losses = {
        step: checkpoint.saved_item(tmp_path / "w" / "checkpoints", step, "progress")["test_loss"]
        for step in saved_steps(tmp_path / "w")
    }
    assert list(losses) == [30]  # the lowest of 10, 20 and 30: the newest, kept alone
    assert inference.restore_model(tmp_path / "w", checkpoint.BEST)[1] == 30
    for wrong in ("test_acc", "accuracy", "test_ema_loss", "val_accuracy"):
        quick_config.best_metric = wrong
        with pytest.raises(UserError, match=f"^--config.best_metric='{wrong}' is not a metric"):
            hooked_run(quick_config, tmp_path / wrong)
        assert not (tmp_path / wrong / "checkpoints").exists() or not saved_steps(tmp_path / wrong)
    quick_config.update(best_metric="test_class_accuracy_3", test_set_metrics=("class_accuracy",))
    hooked_run(quick_config, tmp_path / "per_class", steps=15)


def test_a_hooks_best_metric_missing_from_its_evaluation_is_one_line_after_the_save(
    quick_config, tmp_path, plug_in
):
    """keep_best by a value a hook adds (val_acuracy, a typo for the hook's val_accuracy)
    cannot be checked before the hook runs: at that evaluation the steps since the last save
    are saved, then one line names what the evaluation has; the fixed name resumes."""
    name = plug_in(
        "@train.after_evaluation\ndef check(step, metrics, run):\n"
        "    metrics['val_accuracy'] = metrics['test_accuracy']\n"
    )
    quick_config.update(keep_best=True, best_metric="val_acuracy")
    with pytest.raises(UserError) as refused:
        hooked_run(quick_config, tmp_path / "w", name)
    assert re.match(  # a project's own metrics may join the list
        r"--config.best_metric=val_acuracy: the evaluation at step 15 has no such metric; name "
        r"one it has: test_accuracy, test_loss, (\w+, )*val_accuracy; checkpoint 15 saved in ",
        str(refused.value),
    )
    assert saved_steps(tmp_path / "w") == [10, 15]
    quick_config.best_metric = "val_accuracy"
    assert hooked_run(quick_config, tmp_path / "w", name)["resumed_from_step"] == 15


def test_a_whole_test_set_metric_that_fails_in_training_is_one_line_after_the_save(
    quick_config, tmp_path, plug_in
):
    """A plug-in's TEST_SET_METRICS entry that raises at an evaluation during training was a
    traceback, the steps since the last save lost."""
    name = plug_in(
        "def broken(labels, predictions, num_classes):\n    return 1 / 0\n\n\n"
        "task.TEST_SET_METRICS['broken'] = broken\n"
    )
    with pytest.raises(UserError) as failed:
        hooked_run(quick_config, tmp_path / "w", name, test_set_metrics=("broken",))
    assert str(failed.value).startswith(
        "whole-test-set metric 'broken' failed: ZeroDivisionError: division by zero; checkpoint "
        "15 saved in "
    )
    assert saved_steps(tmp_path / "w") == [10, 15]
