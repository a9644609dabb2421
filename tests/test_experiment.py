"""train_and_evaluate end to end on real data: outputs, determinism, a diverging run."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

from fmnist_flax import checkpoint, experiment, load_model
from fmnist_flax.errors import UserError


def read_metrics(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_a_100_step_real_data_run_learns_and_writes_its_outputs(quick_config, tmp_path):
    summary = experiment.train_and_evaluate(quick_config, tmp_path / "run")
    assert summary["test_accuracy"] >= 0.80
    assert summary["test_examples"] == 10_000
    assert summary["codelab_test_examples"] == 9_728
    assert summary["train_examples_per_sec"] > 0
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in (
        "test_accuracy", "test_loss", "test_examples", "train_examples_per_sec", "steps",
        "batch_size", "compute_dtype", "backend", "num_devices", "versions",
    ):  # fmt: skip
        assert on_disk[key] == summary[key]
    assert set(on_disk["versions"]) == {"jax", "flax", "optax"}
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 25, 50, 75, 100]
    assert set(rows[0]) == {"step", "loss", "accuracy", "grad_norm"}
    assert rows[-1]["loss"] < rows[0]["loss"] / 2
    assert "gradient_check" not in summary  # the codelab's extension was not added


def test_same_seed_gives_bitwise_identical_runs(quick_config, tmp_path):
    quick_config.steps = 30
    quick_config.log_every = 10
    first = experiment.train_and_evaluate(quick_config, tmp_path / "a")
    second = experiment.train_and_evaluate(quick_config, tmp_path / "b")
    assert first["final_train_loss"] == second["final_train_loss"]
    assert read_metrics(tmp_path / "a") == read_metrics(tmp_path / "b")
    quick_config.seed = 1
    other = experiment.train_and_evaluate(quick_config, tmp_path / "c")
    assert other["final_train_loss"] != first["final_train_loss"]


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(quick_config, tmp_path):
    quick_config.steps = 10
    quick_config.checkpoint_every = 10
    experiment.train_and_evaluate(quick_config, tmp_path / "run")
    quick_config.steps = 30
    quick_config.log_every = 1
    quick_config.optimizer.learning_rate = 1e30  # diverges at once
    with pytest.raises(UserError, match=r"the loss became nan between steps 1\d and 1\d") as exc:
        experiment.train_and_evaluate(quick_config, tmp_path / "run", accept_config_change=True)
    assert "\n" not in str(exc.value)
    assert "the last good checkpoint is 10" in str(exc.value)
    assert checkpoint.Checkpoints(tmp_path / "run").steps() == [10]
    model = load_model(tmp_path / "run")
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(nnx.state(model)))
