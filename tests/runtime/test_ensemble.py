"""Ensembles and sweeps: N members in one program (config.ensemble), each member exactly the
single run it stands for, their outputs, exact resume, and picking a member to use."""

from __future__ import annotations

import json
import re
import shutil

import jax
import numpy as np
import pytest
from conftest import assert_same_models, env_without_device_count, load_config, run_main
from flax import nnx

from fmnist_flax import config as config_lib
from fmnist_flax import load_model, train
from fmnist_flax import model as model_lib
from fmnist_flax.runtime import ensemble as ensemble_lib
from fmnist_flax.runtime import export, inference, parallel, report, tables
from fmnist_flax.runtime.ensemble import Ensemble
from fmnist_flax.runtime.errors import UserError

RATES = (3e-3, 3e-3, 1e-2)  # a sweep of a kind: member 2 has its own learning rate


def ensemble_config(**fields):
    config = load_config("default")
    config.steps, config.log_every, config.report = 100, 10, "none"
    config.checkpoint_every, config.checkpoint_min_interval_secs = 45, 0.0
    config.augment.flip = True  # each member draws its own augmentation too
    config.ensemble.size, config.ensemble.same_data = 3, False
    config.ensemble.learning_rate = RATES
    # One member a pass (the passes in turn inside each chunk, as a CPU runs 8 members two at
    # a time): every test of this file, exact resume included, goes through the passes.
    config.ensemble.members_per_pass = 1
    for name, value in fields.items():
        config[name] = value
    return config


def rows_of(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def ensemble(tmp_path_factory):
    """Three members on their own data, member 2 at its own rate: 100 steps, saves at 45, 90
    and 100. Shared read-only; the tests that use it are in the slow tier (it trains 300
    member-steps and compiles the passes)."""
    workdir = tmp_path_factory.mktemp("ensemble") / "w"
    return workdir, train.train_and_evaluate(ensemble_config(), workdir)


@pytest.mark.slow
def test_member_k_is_the_single_run_with_seed_plus_k(ensemble, tmp_path):
    """Member 1 of the vmapped program against a run of its own (seed 1): the same data
    order, augmentation, initialisation and rate. The vmapped matmuls round differently from
    one model's (XLA batches them), so the losses agree to 1e-5, not to the bit; at member
    2's rate (1e-2) the difference grows to 5e-5 by step 100 (docs/performance.md)."""
    workdir, summary = ensemble
    single = ensemble_config(seed=1)
    single.ensemble.size, single.ensemble.learning_rate = 1, ()
    alone = train.train_and_evaluate(single, tmp_path / "alone")
    members, solo = rows_of(workdir), rows_of(tmp_path / "alone")
    assert [r["step"] for r in members] == [r["step"] for r in solo]
    np.testing.assert_allclose([r["loss/1"] for r in members], [r["loss"] for r in solo], rtol=1e-5)
    assert abs(summary["members"][1]["test_accuracy"] - alone["test_accuracy"]) <= 0.002
    assert not isinstance(load_model(tmp_path / "alone"), Ensemble)  # size 1: a model


@pytest.mark.slow
def test_the_summary_names_every_member_its_values_and_the_best(ensemble):
    workdir, summary = ensemble
    members = summary["members"]
    assert [m["member"] for m in members] == [0, 1, 2]
    assert [m["learning_rate"] for m in members] == list(RATES)
    assert [m["seed"] for m in members] == [0, 1, 2]
    accuracies = [m["test_accuracy"] for m in members]
    assert summary["best_member"] == int(np.argmax(accuracies))
    assert all(summary[f"test_accuracy/{k}"] == a for k, a in enumerate(accuracies))
    # The ensemble (the members' mean probabilities) is better than its average member here.
    assert summary["test_accuracy"] > np.mean(accuracies)
    last = rows_of(workdir)[-1]
    assert last["loss"] == pytest.approx(np.mean([last[f"loss/{k}"] for k in range(3)]))


@pytest.mark.slow
def test_each_member_is_a_tensorboard_hparams_session(ensemble):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    workdir, summary = ensemble
    for member in summary["members"]:
        reader = EventAccumulator(str(workdir / "tensorboard" / f"member_{member['member']}"))
        reader.Reload()
        [accuracy] = reader.Scalars("hparam/test_accuracy")
        assert accuracy.value == pytest.approx(member["test_accuracy"]) and accuracy.step == 100
        content = reader.PluginTagToContent("hparams")["_hparams_/session_start_info"]
        start = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
        assert start.hparams["learning_rate"].number_value == pytest.approx(RATES[member["member"]])
        assert start.hparams["seed"].number_value == member["seed"]
    assert (
        "train/loss/2" in EventAccumulator(str(workdir / "tensorboard")).Reload().Tags()["scalars"]
    )


@pytest.mark.slow
def test_a_kill_after_a_non_logged_save_resumes_the_ensemble_exactly(ensemble, tmp_path):
    """Step 45 is not a logged step: the members' running rows travel in its checkpoint."""
    workdir, _ = ensemble
    killed = tmp_path / "killed"
    shutil.copytree(workdir, killed)
    for step in ("90", "100"):
        shutil.rmtree(killed / "checkpoints" / step)
    (killed / "summary.json").unlink()
    resumed = train.train_and_evaluate(ensemble_config(), killed)
    assert resumed["resumed_from_step"] == 45
    assert rows_of(killed) == rows_of(workdir)
    assert_same_models(workdir, killed)


@pytest.mark.slow
def test_member_picks_one_member_the_best_or_the_ensemble(ensemble, real_dataset):
    workdir, summary = ensemble
    images = real_dataset.test_images[:64]
    whole = load_model(workdir)
    assert isinstance(whole, Ensemble) and whole.size == 3
    each = [inference.predict(load_model(workdir, member=k), images) for k in range(3)]
    np.testing.assert_allclose(inference.predict(whole, images), np.mean(each, axis=0), atol=1e-6)
    np.testing.assert_array_equal(
        inference.predict(load_model(workdir, member="best"), images), each[summary["best_member"]]
    )
    assert inference.predict(load_model(workdir, member="ensemble"), images).shape == (64, 10)


@pytest.mark.slow
def test_the_exported_ensemble_runs_with_jax_alone(ensemble, real_dataset, jax_only, tmp_path):
    workdir, _ = ensemble
    artifact = tmp_path / "ensemble.jaxexport"
    meta = export.export_model(workdir, artifact, member="ensemble")
    assert meta["source"]["member"] == "ensemble"
    images = real_dataset.test_images[:5]
    expected = inference.predict(load_model(workdir), images)
    np.testing.assert_allclose(jax_only(artifact, images), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_member_flags_from_the_command_line(ensemble, tmp_path):
    """--member on eval: the best member's accuracy is the summary's; a bad one is one line."""
    workdir, summary = ensemble
    output = tmp_path / "best.json"
    result = run_main("--mode=eval", f"--workdir={workdir}", "--member=best", f"--output={output}")
    assert result.returncode == 0, result.stderr
    evaluated = json.loads(output.read_text())
    assert evaluated["member"] == summary["best_member"]
    assert evaluated["test_accuracy"] == max(m["test_accuracy"] for m in summary["members"])
    bad = run_main("--mode=predict", f"--workdir={workdir}", "--member=7", "--images=x.npy")
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines()[-1] == (
        f"error: --member=7: --workdir {workdir} has members 0..2"
    )


@pytest.mark.slow
def test_member_of_a_single_run_or_a_bad_value_is_one_line(ensemble, tmp_path):
    workdir, _ = ensemble
    with pytest.raises(UserError, match=r"must be a member number, 'best' or 'ensemble'"):
        ensemble_lib.parse_member("first")
    with pytest.raises(UserError, match=r"--member=3: --workdir .* has members 0\.\.2"):
        load_model(workdir, member=3)
    with pytest.raises(UserError, match=r"--member=best: checkpoint 45 in .* was not evaluated"):
        load_model(workdir, step=45, member="best")


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"size": 0}, "--config.ensemble.size=0 must be a whole number of members >= 1"),
        ({"size": 2, "learning_rate": (1e-3,)}, "must be a tuple of 2 values, one per member"),
        ({"size": 2, "weight_decay": (0.1, -1.0)}, "weight_decay: -1.0 must be a finite number"),
        ({"size": 2, "learning_rate": (1e-3, 0.0)}, "learning_rate: 0.0 must be a finite number"),
        ({"size": 2, "shards": 3}, "shards=3 must be a whole number >= 1 that divides"),
        ({"size": 8, "members_per_pass": 3}, "members_per_pass=3 must be 0 (chosen for the"),
        (
            {"size": 8, "shards": 4, "members_per_pass": 2},
            "a multiple of --config.ensemble.shards=4",
        ),
        ({"size": 4, "members_per_pass": -1}, "members_per_pass=-1 must be 0"),
    ],
)
def test_bad_ensemble_values_are_one_line(fields, expected):
    config = load_config("default")
    for name, value in fields.items():
        config.ensemble[name] = value
    with pytest.raises(UserError, match=expected.replace(".", r"\.").replace("(", r"\(")):
        config_lib.validate(config)


def test_a_member_axis_that_does_not_divide_the_devices_is_one_line():
    with pytest.raises(UserError, match=r"shards=2 does not divide the 1 devices; use a divisor"):
        parallel.make_mesh(jax.devices()[:1], member_shards=2)


def test_ensemble_values_that_clash_with_other_fields_are_one_line():
    config = load_config("default")
    config.ensemble.size, config.ensemble.learning_rate = 2, (1e-3, 1e-2)
    config.optimizer.schedule = "warmup_cosine"
    with pytest.raises(UserError, match=r"per-member rates, which need --config\.optimizer\.sch"):
        config_lib.validate(config)
    config = load_config("default")
    config.ensemble.size, config.ensemble.same_data = 2, False
    config.input_pipeline = "grain"
    with pytest.raises(UserError, match="same_data=False gives each member its own batches"):
        config_lib.validate(config)


def test_the_progress_line_shows_the_members_spread_and_the_table_marks_the_best():
    row = {"step": 5, "loss": 0.5, "loss/0": 0.4, "loss/1": 0.6, "accuracy": 0.8}
    assert tables.metric_names(row) == ["loss", "accuracy"]
    assert tables.spread_cell(row, "loss") == "0.5000 (0.4000-0.6000)"
    assert tables.spread_cell(row, "accuracy") == "80.0%"
    members = [
        {"member": k, "seed": k, "learning_rate": rate, "test_accuracy": acc}
        for k, (rate, acc) in enumerate([(1e-3, 0.8), (3e-3, 0.85)])
    ]
    text = tables.members_table(members, best=1).format()
    assert "1 (best)" in text and "85.00%" in text and "0.003" in text
    log = tables.training_log_table([row, {"step": 1, "loss": 2.0}], 1.0).format()
    assert "0.5000 (0.4000-0.6000)" in log and "2.0000" in log and "Loss/0" not in log


def test_the_members_figure_draws_each_members_curve_and_the_sweep():
    members = [
        {"member": 0, "learning_rate": 1e-3, "test_accuracy": 0.8},
        {"member": 1, "learning_rate": 3e-3, "test_accuracy": 0.85},
    ]
    figure = report.members_figure([1, 10], [[2.0, 1.0], [2.1, 0.9]], members, "Fashion-MNIST")
    curves, sweep = figure.axes
    assert [line.get_label() for line in curves.lines] == ["member 0", "member 1"]
    np.testing.assert_array_equal(curves.lines[1].get_ydata(), [2.1, 0.9])
    assert sweep.get_xscale() == "log"
    np.testing.assert_allclose(sweep.collections[0].get_offsets(), [[1e-3, 0.8], [3e-3, 0.85]])


@pytest.mark.slow
def test_init_from_takes_one_member_or_starts_every_member_from_one_model(ensemble):
    workdir, summary = ensemble
    mesh = parallel.make_mesh()
    config = load_config("default")
    config.init_from = f"{workdir}:100@best"
    model = model_lib.create_model(config, (28, 28, 1), 10)
    train.warm_start(model, config, mesh)
    best = load_model(workdir, member=summary["best_member"])
    for a, b in zip(
        jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(best)), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    config.init_from = str(workdir)
    with pytest.raises(UserError, match=r"is an ensemble of 3; start from one member: --init_"):
        train.warm_start(model, config, mesh)
    config.init_from, config.ensemble.size = f"{workdir}@1", 2
    members = model_lib.create_model(config, (28, 28, 1), 10)
    train.warm_start(members, config, mesh)
    one = jax.tree.leaves(nnx.state(load_model(workdir, member=1), nnx.Param))
    for k in range(2):
        for a, b in zip(jax.tree.leaves(nnx.state(members.member(k), nnx.Param)), one, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_members_split_over_devices_train_like_one_device(ensemble, tmp_path):
    """The same run on 3 CPU devices with a `member` mesh axis (one member each), the devices
    made by main.py for `--config.ensemble.shards=3`: the state is split by member, and the
    members' losses match the one-device run's."""
    workdir, summary = ensemble
    rates = ",".join(str(r) for r in RATES)
    result = run_main(
        f"--workdir={tmp_path / 'split'}",
        "--steps=100",
        "--log_every=10",
        "--report=none",
        "--checkpoint_every=45",
        "--config.checkpoint_min_interval_secs=0",
        "--config.augment.flip=True",
        "--config.ensemble.size=3",
        "--config.ensemble.same_data=False",
        f"--config.ensemble.learning_rate=({rates})",
        "--config.ensemble.shards=3",
        env=env_without_device_count(),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "mesh {'member': 3, 'data': 1} over 3 cpu device(s)" in result.stdout
    assert re.search(r"members\.layers\.0\.kernel +\(3, 784, 256\).*P\(member,\)", result.stdout)
    split, one = rows_of(tmp_path / "split"), rows_of(workdir)
    for k in (0, 1):  # at the default rate; member 2's 1e-2 amplifies rounding (see above)
        np.testing.assert_allclose(
            [r[f"loss/{k}"] for r in split], [r[f"loss/{k}"] for r in one], rtol=1e-5
        )
    assert (
        json.loads((tmp_path / "split" / "summary.json").read_text())["best_member"]
        == (summary["best_member"])
    )


@pytest.mark.slow
def test_an_ensemble_run_writes_the_full_report(tmp_path):
    """The default report: the codelab's timing comparisons time one model (never the
    ensemble's stacked state), and the members' figure joins the report."""
    from fmnist_flax import cli

    config = ensemble_config(steps=10, report="full")
    config.ensemble.size, config.ensemble.learning_rate = 2, (1e-3, 3e-3)
    summary = train.train_and_evaluate(config, tmp_path / "w", cli.extensions(config))
    names = {p.name for p in (tmp_path / "w" / "report").iterdir()}
    assert {"members.png", "dispatch_vs_jit.png", "precision.png"} <= names
    assert [row["mode"] for row in summary["dispatch_vs_jit"]] == ["Python dispatch", "jitted step"]
    assert "Ensemble members (2)" in (tmp_path / "w" / "report" / "report.html").read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("size", "field", "before", "after"),
    [
        (2, "ensemble.learning_rate", (1e-3, 1e-3), (1e-3, 3e-2)),
        (2, "ensemble.weight_decay", (1e-4, 1e-4), (1e-4, 0.5)),
        (2, "optimizer.learning_rate", 1e-3, 3e-2),
        (1, "optimizer.learning_rate", 1e-3, 3e-2),
    ],
)
def test_an_accepted_hyperparameter_change_takes_effect_from_the_resumed_step(
    tmp_path, size, field, before, after
):
    """A resume that accepts a new rate or weight decay trains with it from the saved step:
    an ensemble's per-member values live in the optimizer's state (inject_hyperparams), and
    the checkpoint's must not come back with it. The member that keeps its value trains on
    to the bit as if nothing changed; summary.json records what the run used."""

    def config(value, steps):
        run = ensemble_config()
        run.ensemble.size = size
        run.ensemble.learning_rate = ()
        run.ensemble.same_data = True
        run.steps = steps
        run.checkpoint_every = 10
        run.update_from_flattened_dict({field: value})
        return run

    train.train_and_evaluate(config(before, 10), tmp_path / "same")
    shutil.copytree(tmp_path / "same", tmp_path / "changed")
    train.train_and_evaluate(config(before, 20), tmp_path / "same")
    summary = train.train_and_evaluate(
        config(after, 20), tmp_path / "changed", accept_config_change=True
    )
    rows = {
        name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").open()]
        for name in ("same", "changed")
    }
    assert [r["step"] for r in rows["same"]] == [r["step"] for r in rows["changed"]]
    for same, changed in zip(rows["same"], rows["changed"], strict=True):
        kept = same["step"] <= 10
        assert (same["loss"] == changed["loss"]) == kept, same["step"]
        if size > 1 and field.startswith("ensemble."):  # member 0 kept its value
            assert same["loss/0"] == changed["loss/0"]
    [change] = summary["config_changes"]
    assert (change["field"], change["step"]) == (field, 10)
    assert change["now"] == (list(after) if isinstance(after, tuple) else after)
