"""Every config file loads, validates and builds its model; the recipe options do their job."""

from __future__ import annotations

import itertools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import REPO, forward, load_config
from flax import nnx

from fmnist_flax import config as config_lib
from fmnist_flax import input_pipeline, load_model, optimizer, predict, train
from fmnist_flax.model import CNN, MLP, MODELS, create_model
from fmnist_flax.runtime import checkpoint, parallel, restore

CONFIG_NAMES = sorted(p.stem for p in (REPO / "configs").glob("*.py") if p.stem != "__init__")


def test_the_documented_configs_exist():
    assert {"bf16", "cnn", "default", "mlp_best", "smoke"} <= set(CONFIG_NAMES)


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_each_config_loads_validates_builds_and_documents_its_command(name):
    config = load_config(name)
    config_lib.validate(config)
    model = create_model(config, (28, 28, 1), 10)
    assert type(model) is MODELS[config.model.name]
    logits = nnx.eval_shape(lambda m, x: m(x), model, jax.ShapeDtypeStruct((2, 28, 28, 1), float))
    assert logits.shape == (2, 10) and logits.dtype == jnp.float32
    doc = (REPO / "configs" / f"{name}.py").read_text()
    assert f"python main.py --config=configs/{name}.py" in doc


def raw_leaves(tree) -> list:
    """Every array of a state, a typed PRNG key (dropout's stream) as its raw data."""
    return [
        jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        for x in jax.tree.leaves(tree)
    ]


def cnn_smoke(steps):
    config = load_config("cnn")
    config.steps, config.log_every, config.checkpoint_every = steps, 3, 3
    config.checkpoint_min_interval_secs = 0.0
    config.optimizer.warmup_steps = 2
    config.report = "none"
    config.eval_examples = 1_000  # what is checked is the state, not the accuracy
    return config


@pytest.mark.slow
def test_cnn_trains_resumes_exactly_and_restores_for_predict(tmp_path, real_dataset):
    """Dropout's RNG state and BatchNorm's statistics travel in the checkpoint."""
    train.train_and_evaluate(cnn_smoke(6), tmp_path / "one")
    train.train_and_evaluate(cnn_smoke(3), tmp_path / "two")
    resumed = train.train_and_evaluate(cnn_smoke(6), tmp_path / "two", accept_config_change=True)
    assert resumed["resumed_from_step"] == 3
    one, two = load_model(tmp_path / "one"), load_model(tmp_path / "two")
    assert isinstance(one, CNN)

    for a, b in zip(raw_leaves(nnx.state(one)), raw_leaves(nnx.state(two)), strict=True):
        np.testing.assert_array_equal(a, b)
    images = real_dataset.test_images[:8]
    first, again = predict(one, images), predict(one, images)
    np.testing.assert_array_equal(first, again)  # eval mode: no dropout noise
    np.testing.assert_allclose(first.sum(axis=1), 1.0, rtol=1e-5)
    assert checkpoint.Checkpoints(tmp_path / "two").steps() == [3, 6]


def shortened(name: str):
    """A config of configs/ cut to 6 steps, saving at 3 and 6, its schedule intact in shape."""
    config = load_config(name)
    config.steps, config.checkpoint_every, config.log_every = 6, 3, 1
    config.checkpoint_min_interval_secs = 0.0
    config.optimizer.warmup_steps = 2
    config.report = "none"
    config.eval_examples = 1_000  # what is checked is the state, not the accuracy
    return config


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_the_same_command_resumed_is_bit_exact(name, tmp_path):
    """A run killed after its step-3 save and started again with the same command ends where
    the uninterrupted run ends: every array of model and optimizer, every metrics row."""
    direct, killed = tmp_path / "direct", tmp_path / "killed"
    train.train_and_evaluate(shortened(name), direct)
    shutil.copytree(direct, killed)
    shutil.rmtree(killed / "checkpoints" / "6")  # what a kill before the last save leaves
    (killed / "summary.json").unlink()
    resumed = train.train_and_evaluate(shortened(name), killed)
    assert resumed["resumed_from_step"] == 3

    def saved_arrays(workdir):
        model, optimizer = train.create_train_state(
            shortened(name), (28, 28, 1), 10, parallel.make_mesh()
        )
        manager = checkpoint.Checkpoints(workdir, read_only=True)
        try:
            targets = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
            arrays = restore.restore(manager, targets, 6)
        finally:
            manager.close()
        return raw_leaves({k: arrays[k] for k in targets})

    for a, b in zip(saved_arrays(direct), saved_arrays(killed), strict=True):
        np.testing.assert_array_equal(a, b)
    rows = [(w / "metrics.jsonl").read_text().splitlines() for w in (direct, killed)]
    assert rows[0] == rows[1] and [json.loads(r)["step"] for r in rows[0]] == [1, 2, 3, 4, 5, 6]


def test_warmup_cosine_schedule_rises_then_decays():

    config = load_config("mlp_best")
    schedule = optimizer.learning_rate(config)
    peak, warmup = config.optimizer.learning_rate, config.optimizer.warmup_steps
    assert float(schedule(0)) == 0.0
    assert float(schedule(warmup)) == pytest.approx(peak)
    assert float(schedule(warmup // 2)) == pytest.approx(peak / 2, rel=1e-3)
    assert float(schedule(config.steps)) == pytest.approx(peak * config.optimizer.final_fraction)

    assert optimizer.learning_rate(load_config("default")) == 3e-3  # the codelab's constant rate


def shifted(image, dy, dx):
    padded = np.pad(image, 1)
    return padded[1 + dy : 29 + dy, 1 + dx : 29 + dx]


def test_augmentation_moves_pixels_but_keeps_each_image_in_its_row(real_dataset):
    images = real_dataset.test_images[:64]
    x = input_pipeline.prepare_images(images)
    out = np.asarray(input_pipeline.augment(jnp.asarray(x), jax.random.key(0), 1, True))
    assert out.shape == x.shape
    changed = 0
    for image, row in zip(x[..., 0], out, strict=True):
        candidates = [
            shifted(flipped, dy, dx)
            for flipped in (image, image[:, ::-1])
            for dy, dx in itertools.product((-1, 0, 1), repeat=2)
        ]
        assert any(np.array_equal(row.reshape(28, 28), c) for c in candidates)
        changed += not np.array_equal(row.reshape(28, 28), image)
    assert changed > 32  # most images really were moved or mirrored
    again = np.asarray(input_pipeline.augment(jnp.asarray(x), jax.random.key(0), 1, True))
    np.testing.assert_array_equal(out, again)  # same key, same augmentation: resumable


def test_label_smoothing_changes_the_loss_as_defined():
    model = MLP(rngs=nnx.Rngs(0))
    x, y = jnp.ones((4, 28, 28, 1)), jnp.arange(4)
    config = load_config("default")
    loss_fn = nnx.jit(train.loss_fn, static_argnums=3)  # one program (eagerly, each op compiles)
    plain, _ = loss_fn(model, x, y, train.Config(config))
    config.label_smoothing = 0.1
    smooth, _ = loss_fn(model, x, y, train.Config(config))
    logits = np.asarray(forward(model, x), np.float64)
    targets = np.eye(10)[np.asarray(y)] * 0.9 + 0.1 / 10
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    expected = -(targets * log_probs).sum(-1).mean()
    assert float(smooth) == pytest.approx(float(expected), rel=1e-6)
    assert float(smooth) != float(plain)
