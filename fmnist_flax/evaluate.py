"""Evaluation: `nnx.vmap` over stacked test batches inside one compiled call (section 10)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fmnist_flax import parallel
from fmnist_flax.input_pipeline import PIXEL_SCALE


@nnx.jit
def evaluate_batches(
    model: nnx.Module, x_batches: jax.Array, y_batches: jax.Array, mask_batches: jax.Array
) -> dict[str, jax.Array]:
    """Masked sums over (num_batches, B) examples: mean loss, accuracy, count, predictions.

    With an all-ones mask this is the codelab's evaluation; with padding masked out it counts
    every example exactly once.
    """

    @nnx.vmap(in_axes=(None, 0, 0, 0))
    def one_batch(model, x, y, mask):
        logits = model(x)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        predictions = jnp.argmax(logits, axis=-1)
        return jnp.sum(losses * mask), jnp.sum((predictions == y) * mask), predictions

    loss_sums, correct, predictions = one_batch(model, x_batches, y_batches, mask_batches)
    count = jnp.sum(mask_batches)
    return {
        "loss": jnp.sum(loss_sums) / count,
        "accuracy": jnp.sum(correct) / count,
        "examples": count,
        "predictions": predictions,
        "batch_sums": jnp.stack([loss_sums, correct, jnp.sum(mask_batches, axis=1)]),
    }


def evaluate(
    model: nnx.Module, x_batches: jax.Array, y_batches: jax.Array, mask: jax.Array | None = None
) -> dict[str, float | int | np.ndarray]:
    """Evaluate on the host's terms: floats, an int count and the predictions of real examples.

    Without a mask every example counts (the codelab's trimmed batches). An empty stack (a batch
    larger than the test set) gives NaN metrics and zero examples.
    """
    if mask is None:
        mask = jnp.ones(y_batches.shape, jnp.float32)
    if y_batches.shape[0] == 0:
        nan = float("nan")
        return {
            "loss": nan, "accuracy": nan, "examples": 0,
            "predictions": np.zeros(0, np.int32), "batch_sums": np.zeros((3, 0)),
        }  # fmt: skip
    result = parallel.to_host(evaluate_batches(model, x_batches, y_batches, mask))
    real = parallel.to_host(mask).reshape(-1) > 0
    return {
        "loss": float(result["loss"]),
        "accuracy": float(result["accuracy"]),
        "examples": int(result["examples"]),
        "predictions": result["predictions"].reshape(-1)[real],
        "batch_sums": result["batch_sums"],  # (loss sum, correct, count) per batch
    }


def first_batches(result: dict[str, Any], num_batches: int) -> dict[str, float | int]:
    """The metrics of only the first `num_batches` of an evaluation, without evaluating again
    (the codelab's whole batches are the first ones of the padded full set)."""
    loss, correct, count = np.asarray(result["batch_sums"], np.float64)[:, :num_batches].sum(1)
    if not count:
        return {"loss": float("nan"), "accuracy": float("nan"), "examples": 0}
    return {"loss": loss / count, "accuracy": correct / count, "examples": int(count)}


def confusion_matrix(labels: np.ndarray, predictions: np.ndarray, num_classes: int) -> np.ndarray:
    """counts[true, predicted] over every evaluated example."""
    counts = np.zeros((num_classes, num_classes), np.int64)
    np.add.at(counts, (np.asarray(labels), np.asarray(predictions)), 1)
    return counts


@nnx.jit
def _probabilities(model: nnx.Module, x: jax.Array) -> jax.Array:
    return jax.nn.softmax(model(x), axis=-1)


def predict(
    model: nnx.Module, images: np.ndarray, mesh: jax.sharding.Mesh | None = None
) -> np.ndarray:
    """Class probabilities (N, classes) for images shaped (N, H, W) or (N, H * W).

    uint8 pixels are scaled to [0, 1]; float pixels are taken as already in [0, 1]. On a mesh
    the images are padded to a multiple of its size and split along `data`.
    """
    images = np.asarray(images)
    x = images.reshape(len(images), -1)
    x = x.astype(np.float32) * PIXEL_SCALE if x.dtype == np.uint8 else x.astype(np.float32)
    if mesh is None:
        return np.asarray(_probabilities(model, jnp.asarray(x)))
    pad = -len(x) % parallel.data_size(mesh)
    x = np.concatenate([x, np.zeros((pad, x.shape[1]), x.dtype)])
    sharded = parallel.shard_host_array(x, parallel.batch_sharding(mesh))
    return parallel.to_host(_probabilities(model, sharded))[: len(images)]
