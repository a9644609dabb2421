"""The vmapped evaluation: the codelab's trimmed 9,728 and every one of the 10,000."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from fmnist_flax import evaluate, input_pipeline, parallel
from fmnist_flax.model import MLP


@pytest.fixture(scope="module")
def setup(real_dataset):
    return MLP(rngs=nnx.Rngs(3)), input_pipeline.to_device(real_dataset, 512, parallel.make_mesh())


def numpy_metrics(model, images, labels):
    """Plain per-example evaluation, the ground truth for the vmapped one."""
    logits = np.asarray(model(jnp.asarray(input_pipeline.prepare_images(images))))
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels.astype(np.int32))
    predictions = logits.argmax(-1)
    return float(np.mean(losses)), float(np.mean(predictions == labels)), predictions


def test_full_evaluation_counts_every_test_example_once(setup, real_dataset):
    model, batches = setup
    result = evaluate.evaluate(model, batches.test_x, batches.test_y, batches.test_mask)
    loss, accuracy, predictions = numpy_metrics(
        model, real_dataset.test_images, real_dataset.test_labels
    )
    assert result["examples"] == 10_000
    np.testing.assert_allclose(result["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(result["accuracy"], accuracy, rtol=1e-6)
    np.testing.assert_array_equal(result["predictions"], predictions)


def test_codelab_evaluation_drops_the_last_272(setup, real_dataset):
    model, batches = setup
    result = evaluate.evaluate(model, batches.test_x[:19], batches.test_y[:19])
    loss, accuracy, _ = numpy_metrics(
        model, real_dataset.test_images[:9_728], real_dataset.test_labels[:9_728]
    )
    assert result["examples"] == 9_728
    np.testing.assert_allclose(result["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(result["accuracy"], accuracy, rtol=1e-6)


def test_padding_does_not_change_the_result():
    model = MLP(rngs=nnx.Rngs(0))
    x = np.random.default_rng(0).random((5, 784), np.float32)
    y = np.arange(5)
    padded = evaluate.evaluate(model, *map(jnp.asarray, input_pipeline.padded_batches(x, y, 4)))
    exact = evaluate.evaluate(model, *map(jnp.asarray, input_pipeline.padded_batches(x, y, 5)))
    assert padded["examples"] == exact["examples"] == 5
    np.testing.assert_allclose(padded["loss"], exact["loss"], rtol=1e-6)
    np.testing.assert_array_equal(padded["predictions"], exact["predictions"])


def test_a_batch_larger_than_the_test_set_gives_no_codelab_batches():
    model = MLP(rngs=nnx.Rngs(0))
    result = evaluate.evaluate(model, jnp.zeros((0, 8, 784)), jnp.zeros((0, 8), jnp.int32))
    assert result["examples"] == 0 and np.isnan(result["accuracy"])


def test_codelab_metrics_come_from_the_full_evaluation_without_a_second_pass(setup):
    model, batches = setup
    full = evaluate.evaluate(model, batches.test_x, batches.test_y, batches.test_mask)
    derived = evaluate.first_batches(full, batches.codelab_test_batches)
    direct = evaluate.evaluate(model, batches.test_x[:19], batches.test_y[:19])
    assert derived["examples"] == direct["examples"] == 9_728
    np.testing.assert_allclose(derived["loss"], direct["loss"], rtol=1e-6)
    np.testing.assert_allclose(derived["accuracy"], direct["accuracy"], rtol=1e-6)
