"""The update hooks and the EMA of the parameters: the average itself, its place in the model,
its evaluation beside the raw parameters, exact resumes, FSDP and ensembles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, assert_one_line_error, load_config, run_main
from flax import nnx

from fmnist_flax import config as config_lib
from fmnist_flax import experiment, input_pipeline, predict, train
from fmnist_flax.model import create_model
from fmnist_flax.runtime import ema, export, inference, parallel
from fmnist_flax.runtime.errors import UserError


def small_config(decay: float, hidden: tuple[int, ...] = (16,)):
    config = load_config("default")
    config.model.hidden = hidden
    config.ema.decay = decay
    return config


@pytest.fixture(scope="module")
def batches(real_dataset):
    """Three real batches of 64 examples, normalised as training reads them."""
    x = input_pipeline.prepare_images(real_dataset.train_images[:192])
    y = real_dataset.train_labels[:192].astype(np.int32)
    return [(x[i : i + 64], y[i : i + 64]) for i in range(0, 192, 64)]


def params_and_twins(model: nnx.Module) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Host copies of the parameters and of their twins, in the same order."""
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    twins = dict(nnx.to_flat_state(nnx.state(model, ema.EMA)))
    assert len(twins) == len(params)
    return (
        [np.array(p[...]) for _, p in params],
        [np.array(twins[(*path[:-1], path[-1] + ema.SUFFIX)][...]) for path, _ in params],
    )


def trained(config, batches) -> list[tuple[list[np.ndarray], list[np.ndarray]]]:
    """Parameters and twins after each of `batches`' updates (the nnx.jit step)."""
    model, optimizer = train.create_train_state(config, (28, 28, 1), 10, parallel.make_mesh())
    after = []
    for x, y in batches:
        train.jit_train_step(model, optimizer, x, y, train.Config(config))
        after.append(params_and_twins(model) if config.ema.decay else (params_of(model), []))
    return after


def params_of(model: nnx.Module) -> list[np.ndarray]:
    return [np.array(p[...]) for _, p in nnx.to_flat_state(nnx.state(model, nnx.Param))]


def test_the_twins_hold_the_debiased_average_and_training_is_unchanged(batches):
    """After update t the twin is sum_i d**(t-i) (1 - d) p_i / (1 - d**t), the average of the
    updates' parameters p_1..p_t (the first update's copied whole), and the parameters are
    those of a run without an average, bit for bit."""
    decay = 0.5
    with_ema = trained(small_config(decay), batches)
    without = trained(small_config(0.0), batches)
    for t in range(1, len(batches) + 1):
        params, twins = with_ema[t - 1]
        for a, b in zip(params, without[t - 1][0], strict=True):
            np.testing.assert_array_equal(a, b)
        weights = [decay ** (t - i) * (1 - decay) for i in range(1, t + 1)]
        for k, twin in enumerate(twins):
            expected = sum(w * with_ema[i][0][k] for i, w in enumerate(weights)) / sum(weights)
            np.testing.assert_allclose(twin, expected, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(with_ema[0][1][0], with_ema[0][0][0])  # update 1 copies
    assert not np.array_equal(with_ema[-1][1][0], with_ema[-1][0][0])


def test_hooks_run_after_each_update_and_the_ema_averages_what_they_leave(batches, registries):
    """A hook added with `after_update` runs inside the compiled step; the EMA's update runs
    after it, so the average of clamped parameters is clamped too."""
    limit = 0.01

    @train.after_update
    def clamp(model, optimizer, config):
        for _, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            param[...] = jnp.clip(param[...], -limit, limit)

    assert clamp in train.UPDATE_HOOKS.active().values()
    config = small_config(0.9, hidden=(12,))  # a model no other test compiled a step for
    params, twins = trained(config, batches[:2])[-1]
    assert max(np.abs(p).max() for p in params) == np.float32(limit)
    assert max(np.abs(t).max() for t in twins) <= limit * (1 + 1e-6)  # float32's rounding


def test_no_decay_keeps_no_twins_and_a_decay_one_per_parameter_of_its_shape():
    mesh = parallel.make_mesh()
    plain = train.create_train_state(small_config(0.0), (28, 28, 1), 10, mesh)[0]
    assert not ema.kept(plain) and not nnx.state(plain, ema.EMA)
    model = train.create_train_state(small_config(0.99), (28, 28, 1), 10, mesh)[0]
    params, twins = params_and_twins(model)
    for param, twin in zip(params, twins, strict=True):
        np.testing.assert_array_equal(param, twin)  # they start equal
    # The twins are no parameters: the optimizer's state and the count are the plain model's.
    assert len(nnx.state(model, nnx.Param)) == len(nnx.state(plain, nnx.Param))


def test_averaged_has_the_twins_as_parameters_and_the_models_batch_statistics():
    """For the CNN: the averaged model's Params are the twins, its BatchStat the model's own
    (not averaged); the model itself is left as it was."""
    config = load_config("cnn")
    config.model.features, config.model.dense = (4,), 8
    model = create_model(config, (28, 28, 1), 10)
    ema.attach(model, 0.9)
    for _, twin in nnx.to_flat_state(nnx.state(model, ema.EMA)):
        twin[...] = twin[...] + 1.0
    model.norms[0].mean[...] = jnp.full((4,), 0.25)
    before = params_of(model)
    averaged = ema.averaged(model)
    got, twins = params_and_twins(averaged)
    for a, b in zip(got, twins, strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(before, got, strict=True):
        np.testing.assert_allclose(a + 1.0, b)
    np.testing.assert_array_equal(averaged.norms[0].mean[...], model.norms[0].mean[...])
    for a, b in zip(before, params_of(model), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("decay", [1.0, -0.1, 1.5])
def test_a_decay_outside_0_to_1_is_one_line(decay):
    config = small_config(0.0)
    config.ema.decay = decay
    with pytest.raises(UserError, match=r"--config\.ema\.decay=.* must be a number in \[0, 1\)"):
        config_lib.validate(config)


def test_a_decay_that_is_1_in_float32_is_one_line():
    """0.99999999 passes [0, 1) as a Python float but is 1.0 in the average's float32, where
    it would make the average NaN (0 / 0 in its debiased weight)."""
    config = small_config(0.0)
    config.ema.decay = 0.99999999
    with pytest.raises(UserError, match=r"decay=0\.99999999 is 1\.0 in float32"):
        config_lib.validate(config)
    config.ema.decay = 0.9999999  # the largest that float32 keeps below 1
    config_lib.validate(config)


def test_an_average_that_turns_non_finite_stops_the_run_keeping_the_good_checkpoint(
    quick_config, tmp_path, registries
):
    """A save checks the parameters' EMA as it checks the parameters: an average that is no
    longer finite stops the run in one line, and the last good checkpoint stays."""

    @train.after_update
    def poison_after_step_10(model, optimizer, config):
        twin = model.layers[0].kernel_ema
        bad = jnp.where(optimizer.step[...] > 10, jnp.nan, 0.0)  # after update 11
        twin[...] = twin[...] + bad

    quick_config.ema.decay = 0.9
    quick_config.update(steps=20, log_every=5, checkpoint_every=10, seed=23)  # its own compile
    with pytest.raises(UserError, match="EMA became non-finite between steps 10 and 20") as exc:
        train.train_and_evaluate(quick_config, tmp_path)
    assert str(exc.value).endswith(
        "the last good checkpoint is 10; lower --learning_rate and retry"
    )
    twins = jax.tree.leaves(nnx.state(inference.load_model(tmp_path), ema.EMA))
    assert twins and all(np.isfinite(t).all() for t in twins)


def test_a_parameter_held_in_a_list_is_refused_in_one_line():
    class Listed(nnx.Module):
        def __init__(self):
            self.scales = nnx.List([nnx.Param(jnp.ones(3))])

    with pytest.raises(UserError, match=r"parameter scales\.0 is an item of a List"):
        ema.attach(Listed(), 0.9)


class Keep(experiment.Extension):
    """The run's final model state, on the host."""

    def after_training(self, run: experiment.Run) -> None:
        self.state = jax.tree.map(np.asarray, nnx.state(run.model))


def rows_of(workdir) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_20_steps_equal_10_then_resume_to_20_averages_included(quick_config, tmp_path):
    """The twins travel in the checkpoints: a resumed run ends with the same parameters and
    averages, to the bit; the EMA's test metrics sit beside the raw ones at each evaluation
    and in summary.json."""
    quick_config.ema.decay = 0.9
    quick_config.update(steps=20, log_every=5, checkpoint_every=10, eval_every=10)
    direct, resumed = Keep(), Keep()
    summary = train.train_and_evaluate(quick_config, tmp_path / "one", [direct])
    quick_config.steps = 10
    train.train_and_evaluate(quick_config, tmp_path / "two")
    quick_config.steps = 20
    again = train.train_and_evaluate(quick_config, tmp_path / "two", [resumed])
    assert again["resumed_from_step"] == 10
    twins = jax.tree.leaves(nnx.state(direct.state, ema.EMA))
    assert len(twins) == 6 and all(np.isfinite(t).all() for t in twins)
    for a, b in zip(jax.tree.leaves(direct.state), jax.tree.leaves(resumed.state), strict=True):
        np.testing.assert_array_equal(a, b)
    rows = rows_of(tmp_path / "one")
    assert rows == rows_of(tmp_path / "two")
    tested = [row for row in rows if "test_accuracy" in row]
    assert [row["step"] for row in tested] == [10, 20]
    assert all(set(row) >= {"test_ema_accuracy", "test_ema_loss"} for row in tested)
    assert tested[-1]["test_ema_accuracy"] != tested[-1]["test_accuracy"]
    assert summary["test_ema_accuracy"] == tested[-1]["test_ema_accuracy"] > 0.5
    assert again["test_ema_loss"] == summary["test_ema_loss"]


@pytest.mark.slow
def test_each_ensemble_member_keeps_its_own_average(quick_config, tmp_path):
    quick_config.ema.decay = 0.9
    quick_config.ensemble.size = 2
    quick_config.update(steps=10, log_every=5, checkpoint_every=10, eval_every=10)
    kept = Keep()
    summary = train.train_and_evaluate(quick_config, tmp_path, [kept])
    params = nnx.to_flat_state(nnx.state(kept.state, nnx.Param))
    twins = dict(nnx.to_flat_state(nnx.state(kept.state, ema.EMA)))
    for path, param in params:
        twin = twins[(*path[:-1], path[-1] + ema.SUFFIX)][...]
        assert twin.shape == param[...].shape and twin.shape[0] == 2  # stacked, one per member
        assert not np.array_equal(twin[0], twin[1])  # members from seeds 0 and 1
        assert not np.array_equal(twin, param[...])
    row = rows_of(tmp_path)[-1]
    for name in ("test_ema_accuracy", "test_ema_accuracy/0", "test_ema_accuracy/1"):
        assert 0.5 < row[name] <= 1, name
    assert summary["test_ema_accuracy"] == row["test_ema_accuracy"]
    # --member=1 --ema: member 1 with its own averages as parameters.
    member = params_of(inference.load_model(tmp_path, member=1, ema=True))
    twins = [np.asarray(t[...])[1] for _, t in nnx.to_flat_state(nnx.state(kept.state, ema.EMA))]
    for a, b in zip(member, twins, strict=True):
        np.testing.assert_array_equal(a, b)


FSDP_CHECK = """
import json, sys
from conftest import load_config
from flax import nnx
from fmnist_flax import experiment, train
from fmnist_flax.runtime import ema, parallel

class Shardings(experiment.Extension):
    def after_training(self, run):
        self.pairs = [
            (str(p[...].sharding.spec), str(t[...].sharding.spec))
            for path, p in nnx.to_flat_state(nnx.state(run.model, nnx.Param))
            for t in [getattr(run.model.layers[path[1]], path[2] + ema.SUFFIX)]
        ]

config = load_config("default")
config.update(steps=10, log_every=5, checkpoint_every=10, report="none")
config.param_sharding, config.ema.decay = "fsdp", 0.9
shardings = Shardings()
summary = train.train_and_evaluate(config, sys.argv[1], [shardings])
print(json.dumps({"pairs": shardings.pairs, "mesh": summary["mesh"],
                  "ema": summary["test_ema_accuracy"]}))
"""


@pytest.mark.slow
def test_the_twins_are_sharded_like_their_parameters_under_fsdp(tmp_path):
    """On 2 CPU devices with FSDP each twin has its parameter's sharding (split where the
    parameter is), through training, evaluation and the saves."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    env["PYTHONPATH"] = str(REPO / "tests")
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FSDP_CHECK), str(tmp_path / "w")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["mesh"] == {"data": 2}
    pairs = result["pairs"]
    assert len(pairs) == 6 and all(param == twin for param, twin in pairs)
    assert sum("data" in param for param, _ in pairs) >= 3  # the kernels, at least, are split
    assert 0.5 < result["ema"] <= 1


@pytest.mark.slow
def test_the_ema_flag_picks_the_average_in_eval_predict_export_and_load_model(
    quick_config, tmp_path, jax_only
):
    """--ema's eval is the evaluation logged during training, its predictions are those of
    load_model(ema=True), whose parameters are the saved twins, and its export agrees with
    them within 1e-6; a run that kept no average is refused in one line."""
    quick_config.ema.decay = 0.9
    quick_config.update(steps=10, log_every=5, checkpoint_every=10)
    work = tmp_path / "ema"
    summary = train.train_and_evaluate(quick_config, work)
    model, averaged = inference.load_model(work), inference.load_model(work, ema=True)
    for a, b in zip(params_of(averaged), params_and_twins(model)[1], strict=True):
        np.testing.assert_array_equal(a, b)
    evaluation = inference.run_eval(work, ema=True)
    assert evaluation["ema"] is True
    assert evaluation["test_accuracy"] == summary["test_ema_accuracy"]
    assert evaluation["test_loss"] == pytest.approx(summary["test_ema_loss"], rel=1e-6)
    images = np.random.default_rng(0).integers(0, 256, (4, 28, 28, 1), dtype=np.uint8)
    np.save(tmp_path / "x.npy", images)
    predicted, failed = inference.run_predict(work, [str(tmp_path / "x.npy")], ema=True)
    expected = predict(averaged, images)
    assert not failed
    np.testing.assert_allclose([p["probabilities"] for p in predicted], expected, rtol=1e-6)
    assert np.abs(expected - predict(model, images)).max() > 1e-3
    meta = export.export_model(work, tmp_path / "ema.jaxexport", ema=True)
    assert meta["source"]["ema"] is True
    np.testing.assert_allclose(jax_only(tmp_path / "ema.jaxexport", images), expected, atol=1e-6)

    quick_config.ema.decay = 0.0
    quick_config.steps = 5
    train.train_and_evaluate(quick_config, tmp_path / "plain")
    refused = run_main("--mode=eval", f"--workdir={tmp_path / 'plain'}", "--ema")
    assert_one_line_error(refused, "--ema: --workdir")
    assert "kept no average of its parameters (config.ema.decay=0)" in refused.stderr


def test_a_twin_keeps_its_parameters_axis_names_so_it_is_split_the_same_way():
    """Under a (data 2, model 4) mesh each twin lies as its parameter: the MLP's first kernel
    split along `model` by its outputs, its average too."""
    model = create_model(small_config(0.999, hidden=(256,)), (28, 28, 1), 10)
    ema.attach(model, 0.999)
    mesh = jax.sharding.AbstractMesh((2, 4), (parallel.DATA_AXIS, parallel.MODEL_AXIS))
    for layer in model.layers:
        spec = parallel.leaf_spec(layer.kernel, mesh)
        assert parallel.leaf_spec(layer.kernel_ema, mesh) == spec
    assert parallel.leaf_spec(model.layers[0].kernel_ema, mesh) == jax.P(None, "model")


@pytest.mark.parametrize("before, after", [(0.0, 0.9), (0.9, 0.0)])
def test_turning_the_average_on_or_off_on_resume_is_refused_without_offering_to_accept(
    quick_config, tmp_path, before, after
):
    """The checkpoint holds no average to resume (or the model has no place for the one it
    holds): the line names the change and does not offer --accept_config_change, which could
    not take it."""
    quick_config.update(steps=5, log_every=5, checkpoint_every=5, eval_examples=500)
    quick_config.ema.decay = before
    train.train_and_evaluate(quick_config, tmp_path)
    quick_config.steps, quick_config.ema.decay = 10, after
    with pytest.raises(UserError) as exc:
        train.train_and_evaluate(quick_config, tmp_path, accept_config_change=True)
    assert f"ema.decay {before!r} -> {after!r}; resume with the saved values" in str(exc.value)
    assert "accept_config_change" not in str(exc.value)
