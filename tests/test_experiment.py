"""train_and_evaluate end to end on real data: outputs, determinism, a diverging run."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from conftest import edit_saved_configs, load_config, run_main
from flax import nnx

from fmnist_flax import experiment, load_model, train
from fmnist_flax.runtime import checkpoint
from fmnist_flax.runtime.errors import UserError


def read_metrics(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_a_100_step_real_data_run_learns_and_writes_its_outputs(quick_config, tmp_path):
    summary = train.train_and_evaluate(quick_config, tmp_path / "run")
    assert summary["test_accuracy"] >= 0.80
    assert summary["test_examples"] == 10_000
    assert not [k for k in summary if k.startswith("codelab")]  # the codelab's extension's
    assert summary["train_examples_per_sec"] > 0
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in (
        "test_accuracy",
        "test_loss",
        "test_examples",
        "train_examples_per_sec",
        "steps",
        "batch_size",
        "compute_dtype",
        "backend",
        "num_devices",
        "versions",
    ):
        assert on_disk[key] == summary[key]
    assert set(on_disk["versions"]) == {"jax", "flax", "optax"}
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 25, 50, 75, 100]
    assert {"step", "loss", "accuracy", "grad_norm"} <= set(rows[0])
    assert not [name for name in rows[0] if name.startswith("test_")]  # step 1 is not evaluated
    assert rows[-1]["loss"] < rows[0]["loss"] / 2
    assert "gradient_check" not in summary  # the codelab's extension was not added
    stages = summary["stage_seconds"]  # where the run's time went, from the call's start
    assert {"data", "model", "compilation", "training", "final evaluation"} <= stages.keys()
    assert sum(stages.values()) == pytest.approx(summary["wall_seconds"], rel=0.01)
    assert summary["finished"] is True


def test_same_seed_gives_bitwise_identical_runs(quick_config, tmp_path):
    quick_config.steps = 30
    quick_config.log_every = 10
    first = train.train_and_evaluate(quick_config, tmp_path / "a")
    second = train.train_and_evaluate(quick_config, tmp_path / "b")
    assert first["final_train_loss"] == second["final_train_loss"]
    assert read_metrics(tmp_path / "a") == read_metrics(tmp_path / "b")
    quick_config.seed = 1
    other = train.train_and_evaluate(quick_config, tmp_path / "c")
    assert other["final_train_loss"] != first["final_train_loss"]


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(quick_config, tmp_path):
    quick_config.steps = 10
    quick_config.checkpoint_every = 10
    train.train_and_evaluate(quick_config, tmp_path / "run")
    quick_config.steps = 30
    quick_config.log_every = 1
    quick_config.optimizer.learning_rate = 1e30  # diverges at once
    with pytest.raises(UserError, match=r"the loss became nan between steps 1\d and 1\d") as exc:
        train.train_and_evaluate(quick_config, tmp_path / "run", accept_config_change=True)
    assert "\n" not in str(exc.value)
    assert "the last good checkpoint is 10" in str(exc.value)
    assert checkpoint.Checkpoints(tmp_path / "run").steps() == [10]
    model = load_model(tmp_path / "run")
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(nnx.state(model)))


def test_init_from_starts_from_another_runs_parameters_with_a_fresh_optimizer(
    quick_config, tmp_path, capsys
):
    quick_config.steps, quick_config.log_every, quick_config.checkpoint_every = 20, 10, 10
    quick_config.eval_examples = 500  # the test set is not what this test is about
    train.train_and_evaluate(quick_config, tmp_path / "base")
    tuned_config = load_config("default")
    tuned_config.update_from_flattened_dict(
        {
            "steps": 10,
            "log_every": 5,
            "report": "none",
            "checkpoint_min_interval_secs": 0.0,
            "init_from": f"{tmp_path / 'base'}:10",
            "optimizer.name": "sgd",
            "optimizer.learning_rate": 0.01,
            "eval_examples": 500,
        }
    )
    train.train_and_evaluate(tuned_config, tmp_path / "tuned")
    summary = json.loads((tmp_path / "tuned" / "summary.json").read_text())
    assert summary["init_from"] == f"{tmp_path / 'base'}:10"
    assert summary["init_from_step"] == 10  # the step it used, also on the terminal
    assert f"initialised from {tmp_path / 'base'}, step 10" in capsys.readouterr().out
    # Its first step starts from the source's step 10, far below a fresh model's first loss.
    base_rows = {row["step"]: row for row in read_metrics(tmp_path / "base")}
    first = read_metrics(tmp_path / "tuned")[0]["loss"]
    assert first < 0.5 * base_rows[1]["loss"] and first == pytest.approx(
        base_rows[10]["loss"], rel=0.5
    )
    # A resumed run goes on from its own checkpoint: the source may be gone.
    shutil.rmtree(tmp_path / "base")
    tuned_config.steps = 15
    resumed = train.train_and_evaluate(tuned_config, tmp_path / "tuned")
    assert resumed["resumed_from_step"] == 10
    assert resumed["init_from_step"] == 10  # kept in the checkpoint's progress


def test_init_from_mistakes_are_one_line(quick_config, tmp_path):
    quick_config.steps, quick_config.eval_examples = 5, 500
    train.train_and_evaluate(quick_config, tmp_path / "base")
    (tmp_path / "empty").mkdir()
    cases = {
        str(tmp_path / "missing"): f"--init_from {tmp_path / 'missing'} does not exist",
        str(tmp_path / "empty"): f"--init_from {tmp_path / 'empty'} has no checkpoints",
        f"{tmp_path / 'base'}:7": f"--init_from={tmp_path / 'base'}:7: {tmp_path / 'base'} has",
    }
    for value, message in cases.items():
        quick_config.init_from = value
        with pytest.raises(UserError, match=re.escape(message)) as exc:
            train.train_and_evaluate(quick_config, tmp_path / f"w{len(value)}")
        assert "\n" not in str(exc.value)
    quick_config.init_from = str(tmp_path / "base")
    quick_config.model.hidden = (64, 32)
    with pytest.raises(UserError, match=r"--init_from=.*: parameter layers\.0\.bias has shape"):
        train.train_and_evaluate(quick_config, tmp_path / "other")


@pytest.mark.slow  # two trainings, the second compiled anew
def test_an_accepted_optimizer_change_starts_the_optimizer_afresh(quick_config, tmp_path, capsys):
    """...and says that the EMA, whose debiasing counts the optimizer's updates, starts again
    from the parameters with it."""
    quick_config.steps, quick_config.checkpoint_every, quick_config.eval_examples = 10, 10, 500
    quick_config.ema.decay = 0.9
    train.train_and_evaluate(quick_config, tmp_path / "w")
    quick_config.steps = 20
    quick_config.optimizer.name = "sgd"
    quick_config.optimizer.momentum = 0.9
    with pytest.raises(UserError, match=r"optimizer\.name 'adamw' -> 'sgd'") as exc:
        train.train_and_evaluate(quick_config, tmp_path / "w")
    assert "--accept_config_change" in str(exc.value)
    summary = train.train_and_evaluate(quick_config, tmp_path / "w", accept_config_change=True)
    assert summary["resumed_from_step"] == 10
    assert (
        "the optimizer starts afresh (moments and schedule from 0); the EMA starts again from "
        "the parameters\n" in capsys.readouterr().out
    )
    changed = {c["field"] for c in summary["config_changes"]}
    assert {"optimizer.name", "optimizer.momentum"} <= changed
    # A rate change keeps the optimizer's state: it still fits.
    quick_config.steps, quick_config.optimizer.learning_rate = 30, 1e-3
    train.train_and_evaluate(quick_config, tmp_path / "w", accept_config_change=True)
    assert "starts afresh" not in capsys.readouterr().out


def test_eval_examples_evaluates_a_prefix_of_the_test_set(quick_config, tmp_path):
    quick_config.steps, quick_config.eval_examples = 5, 1_000
    summary = train.train_and_evaluate(quick_config, tmp_path / "w")
    assert summary["test_examples"] == 1_000
    assert np.array(summary["confusion_matrix"]).sum() == 1_000
    assert not [k for k in summary if k.startswith("final_train_test")]  # test_* hold them


def tiny_arrays(directory, seed, train=64):
    """A small colour `arrays` dataset: 8x8x3 images, 4 classes."""
    directory.mkdir()
    rng = np.random.default_rng(seed)
    for name, n in (("train", train), ("test", 16)):
        images = rng.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8)
        np.savez(directory / f"{name}.npz", images=images, labels=rng.integers(0, 4, n))


@pytest.mark.slow  # two trainings, the second compiled anew
def test_a_resume_on_other_data_is_refused_like_a_config_change(quick_config, tmp_path):
    tiny_arrays(tmp_path / "a", seed=0)
    tiny_arrays(tmp_path / "b", seed=1)  # the same shapes and classes, other images and labels
    tiny_arrays(tmp_path / "c", seed=0, train=80)
    quick_config.update_from_flattened_dict(
        {
            "dataset.name": "arrays",
            "data_dir": str(tmp_path / "a"),
            "batch_size": 16,
            "steps": 4,
            "checkpoint_every": 2,
        }
    )
    train.train_and_evaluate(quick_config, tmp_path / "w")
    quick_config.steps = 8
    quick_config.data_dir = str(tmp_path / "b")
    with pytest.raises(UserError, match=r"dataset\.fingerprint '[0-9a-f]+' -> '[0-9a-f]+'") as exc:
        train.train_and_evaluate(quick_config, tmp_path / "w")
    assert "--accept_config_change" in str(exc.value) and "\n" not in str(exc.value)
    # Another train set size moves the data position: not even accepted.
    quick_config.data_dir = str(tmp_path / "c")
    with pytest.raises(UserError, match=r"dataset\.examples \[64, 16\] -> \[80, 16\]") as exc:
        train.train_and_evaluate(quick_config, tmp_path / "w", accept_config_change=True)
    assert "--accept_config_change" not in str(exc.value)
    quick_config.data_dir, quick_config.batch_size = str(tmp_path / "a"), 32
    with pytest.raises(UserError, match="batch_size 16 -> 32; resume with the saved values") as exc:
        train.train_and_evaluate(quick_config, tmp_path / "w", accept_config_change=True)
    assert "--accept_config_change" not in str(exc.value)
    quick_config.batch_size = 16  # the same data, moved: resumes
    shutil.copytree(tmp_path / "a", tmp_path / "moved")
    quick_config.data_dir = str(tmp_path / "moved")
    assert train.train_and_evaluate(quick_config, tmp_path / "w")["resumed_from_step"] == 4


def test_a_fresh_run_that_fails_before_writing_leaves_no_directory(
    quick_config, tmp_path, monkeypatch
):
    """Without --workdir a run makes runs/<time>; data that fails to load takes it away again,
    while a directory someone named stays."""
    monkeypatch.chdir(tmp_path)
    quick_config.data_dir = str(tmp_path / "missing")
    for named in (None, tmp_path / "named"):
        with pytest.raises(UserError, match="is not a directory"), contextlib.ExitStack() as stack:
            experiment.prepare(quick_config, named, stack, step=train.train_step)
    assert list((tmp_path / "runs").iterdir()) == []
    assert [p.name for p in (tmp_path / "named").iterdir()] == [".lock"]


CLAMPING_HOOK = """
import jax.numpy as jnp
from flax import nnx

from fmnist_flax.train import after_update


@after_update
def clamp(model, optimizer, config):
    for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        param.value = jnp.clip(param.value, -1e-3, 1e-3)
"""


def test_init_from_takes_parameters_only_never_the_sources_modules(
    quick_config, tmp_path, monkeypatch, forget_modules, registries
):
    """The new run's behaviour is its own config's: a source trained with a module that adds
    an update hook lends it no hook (nothing of it is imported); a source whose model only its
    module builds is refused in one line, until the new run's config imports the module."""
    quick_config.steps, quick_config.eval_examples = 5, 500
    base = tmp_path / "base"
    train.train_and_evaluate(quick_config, base)
    site = tmp_path / "site"  # installed: on the search path, outside the current directory
    site.mkdir()
    (site / "clamping_hook.py").write_text(CLAMPING_HOOK)
    (site / "plug_in_models.py").write_text(
        "from fmnist_flax import model\n\nmodel.MODELS['plug_in_mlp'] = model.MLP\n"
    )
    forget_modules += ["clamping_hook", "plug_in_models"]
    monkeypatch.syspath_prepend(str(site))
    edit_saved_configs(base, imports=["clamping_hook"])
    quick_config.init_from = str(base)
    train.train_and_evaluate(quick_config, tmp_path / "tuned")
    assert "clamping_hook" not in sys.modules and "clamping_hook.clamp" not in train.UPDATE_HOOKS
    kernel = load_model(tmp_path / "tuned").layers[0].kernel[...]
    assert float(jnp.abs(kernel).max()) > 1e-2  # never clamped to 1e-3

    saved = json.loads(next(base.glob("checkpoints/*/config/metadata")).read_text())
    edit_saved_configs(
        base, imports=["plug_in_models"], model={**saved["model"], "name": "plug_in_mlp"}
    )
    with pytest.raises(UserError) as refused:
        train.train_and_evaluate(quick_config, tmp_path / "refused")
    assert str(refused.value).startswith(f"--init_from={base}: checkpoint 5 in ")
    assert "without the modules it was trained with, config.imports plug_in_models" in str(
        refused.value
    )
    assert "--config.imports=\"('plug_in_models',)\"" in str(refused.value)
    assert "plug_in_models" not in sys.modules
    quick_config.imports = ("plug_in_models",)
    summary = train.train_and_evaluate(quick_config, tmp_path / "imported")
    assert summary["init_from_step"] == 5


PLUG_IN = """
import jax.numpy as jnp

from fmnist_flax import task, train

CALLS = []


@task.loss_term("logit_norm")
def logit_norm(logits, labels, config, *, images, model, key):
    noise = 0.0 * jax.random.normal(key, labels.shape)  # asks for a key; adds nothing
    return 1e-3 * jnp.mean(logits**2, axis=-1) + noise + 0.0 * images.mean((1, 2, 3))


@task.metric("confidence")
def confidence(logits, labels, config):
    return jax.nn.softmax(logits).max(-1)


@train.after_evaluation
def record(step, metrics, run):
    CALLS.append(step)
    metrics["val_marker"] = float(step)
"""


def test_a_plug_in_touches_only_the_runs_that_import_it(
    quick_config, tmp_path, monkeypatch, forget_modules, registries
):
    """One process trains a config that imports a loss term, a metric and an after-evaluation
    hook, then the default config: the second run's metrics.jsonl is a fresh process's, byte
    for byte, and the hook never ran for it."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "scoped_plug_in.py").write_text("import jax\n" + PLUG_IN)
    forget_modules.append("scoped_plug_in")
    monkeypatch.syspath_prepend(str(site))
    quick_config.update(steps=20, log_every=10, eval_every=10, eval_examples=1_000)
    plugged = ml_collections.ConfigDict(quick_config.to_dict())
    plugged.imports = ("scoped_plug_in",)
    train.train_and_evaluate(plugged, tmp_path / "plugged")
    plug_in = sys.modules["scoped_plug_in"]
    assert plug_in.CALLS == [10, 20]
    rows = read_metrics(tmp_path / "plugged")
    assert {"logit_norm", "confidence"} <= rows[-1].keys() and rows[-1]["val_marker"] == 20.0
    train.train_and_evaluate(quick_config, tmp_path / "plain")
    assert plug_in.CALLS == [10, 20]  # not for the plain run
    args = ["--steps=20", "--log_every=10", "--report=none", "--checkpoint_every=100"]
    fresh = run_main(
        *args,
        "--config.eval_every=10",
        "--config.eval_examples=1000",
        f"--workdir={tmp_path / 'fresh'}",
    )
    assert fresh.returncode == 0, fresh.stderr
    plain = (tmp_path / "plain" / "metrics.jsonl").read_bytes()
    assert plain == (tmp_path / "fresh" / "metrics.jsonl").read_bytes()
    assert b"logit_norm" not in plain and b"val_marker" not in plain
