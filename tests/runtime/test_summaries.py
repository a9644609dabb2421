"""TensorBoard event files, read back with TensorBoard's own reader, against metrics.jsonl."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import load_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fmnist_flax import optimizer, train
from fmnist_flax.runtime import summaries

pytestmark = pytest.mark.slow


def short_config(steps: int):
    config = load_config("default")
    config.steps, config.log_every, config.checkpoint_every, config.eval_every = steps, 5, 10, 10
    config.checkpoint_min_interval_secs = 0.0
    config.report = "none"
    return config


def events(workdir) -> EventAccumulator:
    reader = EventAccumulator(str(workdir / summaries.TENSORBOARD_DIR))
    reader.Reload()
    return reader


def scalars(reader: EventAccumulator, tag: str) -> dict[int, float]:
    return {event.step: event.value for event in reader.Scalars(tag)}


def assert_matches_metrics_log(workdir, config) -> None:
    rows = [json.loads(r) for r in (workdir / "metrics.jsonl").read_text().splitlines()]
    reader = events(workdir)
    for name in ("loss", "accuracy", "grad_norm", "test_loss", "test_accuracy"):
        logged = {row["step"]: row[name] for row in rows if name in row}
        written = scalars(reader, summaries.tag(name))
        assert written.keys() == logged.keys(), name
        assert written == pytest.approx(logged, rel=1e-6), name
    rate = optimizer.learning_rate(config)
    assert scalars(reader, "train/learning_rate") == pytest.approx(
        {row["step"]: rate for row in rows}
    )
    speeds = scalars(reader, "train/examples_per_sec")
    # every row but the first of each start, whose interval holds the compilation
    assert speeds.keys() <= {row["step"] for row in rows[1:]} and config.steps in speeds
    assert min(speeds.values()) > 0
    text = reader.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"batch_size": 512' in text


def test_a_run_writes_its_metrics_and_evaluations_to_tensorboard(tmp_path):
    config = short_config(30)
    train.train_and_evaluate(config, tmp_path / "w")
    assert_matches_metrics_log(tmp_path / "w", config)
    tested = scalars(events(tmp_path / "w"), "test/accuracy")
    assert sorted(tested) == [10, 20, 30] and all(0.1 < a < 1 for a in tested.values())


def test_a_resumed_run_drops_the_events_past_its_checkpoint(tmp_path):
    """Killed after the step-20 save (its step-30 events written): the resumed run's events
    replace them, one value per step, as metrics.jsonl has them."""
    config = short_config(30)
    train.train_and_evaluate(config, tmp_path / "w")
    shutil.rmtree(tmp_path / "w" / "checkpoints" / "30")
    (tmp_path / "w" / "summary.json").unlink()
    resumed = train.train_and_evaluate(config, tmp_path / "w")
    assert resumed["resumed_from_step"] == 20
    assert_matches_metrics_log(tmp_path / "w", config)


def test_an_event_file_removed_under_a_run_is_written_again_whole(tmp_path, capsys):
    """tensorboard/ deleted while rows are written: one warning, and the next row writes the
    event file again with every event so far, as TensorBoard's reader sees."""
    config = short_config(30)
    board = summaries.Summaries(tmp_path, config, 0, optimizer.learning_rate(config))
    board.write({"step": 5, "loss": 2.0})
    shutil.rmtree(tmp_path / summaries.TENSORBOARD_DIR)
    board.write({"step": 10, "loss": 1.0})
    board.write({"step": 15, "loss": 0.5})
    board.close()
    assert scalars(events(tmp_path), "train/loss") == {5: 2.0, 10: 1.0, 15: 0.5}
    warnings = [line for line in capsys.readouterr().err.splitlines() if line]
    assert warnings == [
        f"warning: {board.path} was removed while this run trained; it is written again with "
        "every event so far"
    ]
