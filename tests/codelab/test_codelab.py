"""The codelab's demonstrations: the gradient check and the extension that adds them to a run
(sections 6, 7, 13 and 15 of the report)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_config, run_main
from flax import nnx
from PIL import Image

from fmnist_flax import cli, train
from fmnist_flax.codelab import demonstrations as codelab
from fmnist_flax.model import MLP

TABLE_TITLES = (  # what the codelab adds to the report's tables
    "Gradient tree matches the parameter tree",
    "Python dispatch vs jitted step",
    "Mixed-precision timing after warm-up",
    "Throughput in tokens (projection)",
)
FIGURE_SIZES = {"dispatch_vs_jit.png": (800, 260), "precision.png": (800, 260)}


@pytest.mark.parametrize(
    ("name", "runs_them"),
    [("default", True), ("smoke", True), ("bf16", True), ("mlp_best", False), ("cnn", False)],
)
def test_the_codelabs_configs_ask_for_the_demonstrations_and_others_do_not(name, runs_them):
    assert cli.extensions(load_config(name)) == ([codelab.EXTENSION] if runs_them else [])


@pytest.mark.slow
def test_a_project_config_prints_none_of_the_demonstrations(tmp_path):
    """configs/mlp_best.py (shortened) shows no demonstration table and no codelab test row;
    the codelab's own run still shows them."""
    shorten = ("--steps=30", "--report=none", "--config.log_every=10")
    mlp_best = ("--config=configs/mlp_best.py", "--config.optimizer.warmup_steps=10")
    project = run_main(*mlp_best, *shorten, f"--workdir={tmp_path / 'p'}")
    assert project.returncode == 0, project.stderr
    codelab_run = run_main(*shorten, f"--workdir={tmp_path / 'c'}")
    assert codelab_run.returncode == 0, codelab_run.stderr
    for title in (TABLE_TITLES[0], TABLE_TITLES[3], "codelab"):
        assert title not in project.stdout
        assert title in codelab_run.stdout


def test_gradient_check_reports_matching_trees(quick_config):
    model = MLP(rngs=nnx.Rngs(0))
    x = jnp.ones((4, 28, 28, 1))
    y = jnp.arange(4)
    table, check = codelab.gradient_check(model, x, y, quick_config)
    assert check["trees_match"] and check["grad_vs_value_and_grad"] == 0.0
    assert [row[0] for row in table.rows][-1] == "layers.2.kernel"
    assert check["loss_after_one_sgd_step"] < check["loss"]  # a step downhill
    lines = table.format().splitlines()  # its long title wrapped between words, in 80 columns
    assert max(map(len, lines)) <= 80, lines[:3]
    assert set(table.title.split()) <= set(" ".join(lines).split()), lines[:3]


@pytest.mark.slow
def test_a_full_run_with_the_codelab_adds_its_tables_figures_and_summary(tmp_path):
    config = load_config("default")
    config.steps, config.log_every = 30, 10
    summary = train.train_and_evaluate(config, tmp_path / "w", [codelab.Codelab()])
    assert summary["gradient_check"]["trees_match"]
    assert summary["gradient_check"]["grad_vs_value_and_grad"] == 0.0
    assert [r["mode"] for r in summary["dispatch_vs_jit"]] == ["Python dispatch", "jitted step"]
    for name, size in FIGURE_SIZES.items():
        with Image.open(tmp_path / "w" / "report" / name) as image:
            assert image.size == size, name
            assert np.asarray(image.convert("L"), np.float32).std() > 10, f"{name} looks blank"
    page = (tmp_path / "w" / "report" / "report.html").read_text()
    for title in TABLE_TITLES:
        assert f"<h3>{title}" in page, title
    assert "Projection, not a measurement" in page
    assert f"{summary['train_examples_per_sec'] * codelab.TOKENS_PER_EXAMPLE:,.0f}" in page


@pytest.mark.slow
def test_the_default_run_keeps_the_codelabs_result(tmp_path):
    """`python main.py --steps=400`'s config: the template's changes leave its result as it
    was (0.8728 on all 10,000 test images, 0.8721 on the codelab's whole batches, 9,728)."""
    config = load_config("default")
    config.report = "none"
    summary = train.train_and_evaluate(config, tmp_path / "run", [codelab.Codelab()])
    assert summary["test_accuracy"] == pytest.approx(0.8728, abs=5e-4)
    assert summary["codelab_test_accuracy"] == pytest.approx(0.8721, abs=5e-4)
    assert summary["codelab_test_examples"] == 9_728


@pytest.mark.parametrize(("examples", "whole"), [(1_000, 512), (5, 0)])
def test_the_codelab_row_counts_whole_batches_and_none_is_null_not_nan(
    quick_config, tmp_path, capsys, monkeypatch, examples, whole
):
    """The codelab's metrics cover the whole batches of the evaluated test set; with none to
    average, summary.json holds null for them (NaN is not JSON)."""
    monkeypatch.setenv("COLUMNS", "100")  # a terminal wide enough for its label on one line
    quick_config.steps, quick_config.eval_examples, quick_config.report = 5, examples, "basic"
    train.train_and_evaluate(quick_config, tmp_path / "w", [codelab.Codelab()])
    text = (tmp_path / "w" / "summary.json").read_text()
    summary = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert summary["test_examples"] == examples and summary["codelab_test_examples"] == whole
    assert (summary["codelab_test_accuracy"] is None) == (whole == 0)
    assert "test, codelab (whole batches only)" in capsys.readouterr().out


def test_basic_report_skips_the_timing_comparisons(quick_config, tmp_path):
    quick_config.steps = 5
    quick_config.report = "basic"
    summary = train.train_and_evaluate(quick_config, tmp_path / "w", [codelab.Codelab()])
    names = {p.name for p in (tmp_path / "w" / "report").iterdir()}
    assert names == {
        "examples_per_class.png",
        "training_curve.png",
        "predictions.png",
        "confusion_matrix.png",
        "report.html",
    }
    assert "dispatch_vs_jit" not in summary and "precision" not in summary
    assert summary["gradient_check"]["trees_match"]
