"""The codelab's demonstrations: the gradient check and the extension that adds them to a run
(sections 6, 7, 13 and 15 of the report)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_config
from flax import nnx
from PIL import Image

from fmnist_flax import train
from fmnist_flax.codelab import demonstrations as codelab
from fmnist_flax.model import MLP

TABLE_TITLES = (  # what the codelab adds to the report's tables
    "Gradient tree matches the parameter tree",
    "Python dispatch vs jitted step",
    "Mixed-precision timing after warm-up",
    "Throughput in tokens (projection)",
)
FIGURE_SIZES = {"dispatch_vs_jit.png": (800, 260), "precision.png": (800, 260)}


def test_gradient_check_reports_matching_trees(quick_config):
    model = MLP(rngs=nnx.Rngs(0))
    x = jnp.ones((4, 28, 28, 1))
    y = jnp.arange(4)
    table, check = codelab.gradient_check(model, x, y, quick_config)
    assert check["trees_match"] and check["grad_vs_value_and_grad"] == 0.0
    assert [row[0] for row in table.rows][-1] == "layers.2.kernel"
    assert check["loss_after_one_sgd_step"] < check["loss"]  # a step downhill


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
