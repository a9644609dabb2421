"""The streamed, vmapped evaluation: every metric of the task over the codelab's trimmed 9,728
and every one of the 10,000, in fixed-size calls."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import load_config
from flax import nnx

from fmnist_flax import evaluate, input_pipeline, parallel
from fmnist_flax.model import MLP


@pytest.fixture(scope="module")
def model():
    return MLP(rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def config():
    return load_config("default")


def numpy_metrics(model, images, labels):
    """Plain per-example evaluation, the ground truth for the vmapped one."""
    logits = np.asarray(model(jnp.asarray(input_pipeline.prepare_images(images))))
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels.astype(np.int32))
    predictions = logits.argmax(-1)
    return float(np.mean(losses)), float(np.mean(predictions == labels)), predictions


def test_full_evaluation_counts_every_test_example_once(model, config, real_dataset):
    images, labels = real_dataset.test_images, real_dataset.test_labels
    result = evaluate.evaluate(model, images, labels, config, parallel.make_mesh())
    loss, accuracy, predictions = numpy_metrics(model, images, labels)
    assert result["examples"] == 10_000
    np.testing.assert_allclose(result["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(result["accuracy"], accuracy, rtol=1e-6)
    np.testing.assert_array_equal(result["predictions"], predictions)


def test_the_codelabs_whole_batches_come_from_the_same_pass(model, config, real_dataset):
    """The codelab evaluates only whole batches (19 of 512 = 9,728): the first 19 batches'
    sums of the full evaluation, without evaluating again."""
    images, labels = real_dataset.test_images, real_dataset.test_labels
    full = evaluate.evaluate(model, images, labels, config)
    codelab = evaluate.means(full["batch_sums"], 19)
    loss, accuracy, _ = numpy_metrics(model, images[:9_728], labels[:9_728])
    assert codelab["examples"] == 9_728
    np.testing.assert_allclose(codelab["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(codelab["accuracy"], accuracy, rtol=1e-6)


def test_streaming_in_fixed_size_calls_gives_the_one_call_result(
    model, config, real_dataset, monkeypatch
):
    """A test set larger than one call goes in calls of one shape (one compilation), the last
    padded and masked; the metrics equal a single call's."""
    images, labels = real_dataset.test_images[:3_000], real_dataset.test_labels[:3_000]
    whole = evaluate.evaluate(model, images, labels, config, batch_size=256)
    shapes, call = [], evaluate.evaluate_batches
    monkeypatch.setattr(evaluate, "EVAL_EXAMPLES_PER_CALL", 1_024)
    monkeypatch.setattr(
        evaluate, "evaluate_batches", lambda m, x, *a: shapes.append(x.shape) or call(m, x, *a)
    )
    streamed = evaluate.evaluate(model, images, labels, config, batch_size=256)
    assert shapes == [(4, 256, 28, 28, 1)] * 3  # 12 batches hold 3,000: 3 calls of 4
    assert streamed["examples"] == whole["examples"] == 3_000
    np.testing.assert_allclose(streamed["loss"], whole["loss"], rtol=1e-6)
    np.testing.assert_array_equal(streamed["predictions"], whole["predictions"])


def test_calls_are_as_few_as_the_limit_allows_and_pad_little():
    assert evaluate._calls(20, 512) == (1, 20)  # the default run: one call, no padding
    assert evaluate._calls(21, 512) == (2, 11)  # not 20 + 20
    assert evaluate._calls(1, 4096) == (1, 1)
    assert evaluate._calls(0, 512) == (0, 0)


def test_padding_does_not_change_the_result(config):
    model = MLP(image_shape=(2, 2, 1), rngs=nnx.Rngs(0))
    images = np.random.default_rng(0).integers(0, 256, (5, 2, 2, 1), dtype=np.uint8)
    labels = np.arange(5)
    padded = evaluate.evaluate(model, images, labels, config, batch_size=4)
    exact = evaluate.evaluate(model, images, labels, config, batch_size=5)
    assert padded["examples"] == exact["examples"] == 5
    np.testing.assert_allclose(padded["loss"], exact["loss"], rtol=1e-6)
    np.testing.assert_array_equal(padded["predictions"], exact["predictions"])


def test_no_whole_batch_gives_no_codelab_examples(model, config, real_dataset):
    result = evaluate.evaluate(
        model, real_dataset.test_images[:8], real_dataset.test_labels[:8], config
    )
    assert result["examples"] == 8
    codelab = evaluate.means(result["batch_sums"], 0)
    assert codelab["examples"] == 0 and np.isnan(codelab["accuracy"])


def test_label_smoothing_is_part_of_the_evaluated_loss_as_of_the_trained_one(
    model, config, real_dataset
):
    """One definition of the loss (task.py): the test loss is the objective that trains."""
    images, labels = real_dataset.test_images[:512], real_dataset.test_labels[:512]
    plain = evaluate.evaluate(model, images, labels, config)
    config = load_config("default")
    config.label_smoothing = 0.1
    smoothed = evaluate.evaluate(model, images, labels, config)
    logits = np.asarray(model(jnp.asarray(input_pipeline.prepare_images(images))))
    targets = optax.smooth_labels(np.eye(10)[labels], 0.1)
    expected = float(np.mean(optax.softmax_cross_entropy(logits, targets)))
    np.testing.assert_allclose(smoothed["loss"], expected, rtol=1e-5)
    assert smoothed["accuracy"] == plain["accuracy"] and smoothed["loss"] != plain["loss"]
