"""The run directory: fresh names, refusals, atomic JSON and the metrics log a resume trims."""

from __future__ import annotations

import json

import pytest

from fmnist_flax import workdir
from fmnist_flax.errors import UserError


def test_a_finished_run_without_checkpoints_is_not_overwritten(tmp_path):
    workdir.write_json(tmp_path / workdir.SUMMARY_FILE, {"test_accuracy": 0.9})
    with pytest.raises(UserError, match="already holds a finished run"):
        workdir.prepare_workdir(tmp_path)
    assert json.loads((tmp_path / workdir.SUMMARY_FILE).read_text()) == {"test_accuracy": 0.9}
    assert not list(tmp_path.glob("*.tmp"))


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
