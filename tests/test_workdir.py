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
