"""Evaluation: `nnx.vmap` over stacked test batches inside one compiled call (section 10)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fmnist_flax import parallel
from fmnist_flax.errors import UserError
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


def model_input(images: Any, image_shape: tuple[int, int], name: str = "images") -> np.ndarray:
    """The one input rule of `predict` and of --mode=predict's .npy files and PNGs: `images`
    as float32 (N, H * W) in [0, 1], or a one-line UserError that starts with `name`.

    Shapes: (H, W) is one image; (N, H, W) and (N, H * W) are N >= 1 images.
    Pixels: uint8 is 0..255 and is scaled by 1/255 (`PIXEL_SCALE`, as training does); any
    other integer dtype must hold only 0..255 and is scaled the same; floats (16, 32 or 64
    bits) must be finite and already in [0, 1], and are never rescaled (divide 0..255 floats
    by 255 first). bool, complex, string, object, structured and date/time arrays are refused.
    """
    h, w = (int(side) for side in image_shape)
    expected = f"expected ({h}, {w}) or (N, {h}, {w}) or (N, {h * w})"
    try:
        array = np.asarray(images)
    except (ValueError, TypeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{name}: cannot be made into one array ({reason}); {expected}") from None
    if array.dtype.kind == "V" and jnp.issubdtype(array.dtype, jnp.floating):
        array = array.astype(np.float32)  # bfloat16 and other ml_dtypes floats: exact in f32
    kind = array.dtype.kind
    if kind not in "uif":  # timedelta64 counts as an integer for np.issubdtype: go by kind
        raise UserError(
            f"{name}: pixels of dtype {array.dtype} cannot be used; pass uint8 (0..255), "
            "other integers in 0..255 or floats in [0, 1]"
        )
    if array.shape == (h, w):
        array = array[None]
    if not (array.ndim == 3 and array.shape[1:] == (h, w)) and not (
        array.ndim == 2 and array.shape[1] == h * w
    ):
        raise UserError(f"{name}: array shape {array.shape}; {expected}")
    if len(array) == 0:
        raise UserError(f"{name}: no images in it (shape {array.shape}); {expected} with N >= 1")
    if kind == "f":
        finite = np.isfinite(array)
        if not finite.all():
            bad = int(array.size - np.count_nonzero(finite))
            raise UserError(
                f"{name}: {bad} non-finite pixel value{'s' * (bad != 1)} (NaN or infinity); "
                "every pixel must be a number in [0, 1]"
            )
        low, high = array.min(), array.max()
        if low < 0 or high > 1:
            raise UserError(
                f"{name}: float pixels must lie in [0, 1] but these range over "
                f"[{low!s}, {high!s}]; divide 0..255 values by 255 first (or pass them as uint8)"
            )
        x = array.astype(np.float32)
    else:
        if array.dtype != np.uint8:
            low, high = array.min(), array.max()
            if low < 0 or high > 255:
                raise UserError(
                    f"{name}: integer pixels must lie in 0..255 but these range over "
                    f"{low}..{high}; scale them to 0..255 (uint8) or to floats in [0, 1] first"
                )
        x = array.astype(np.float32) * PIXEL_SCALE  # bit for bit what training feeds the model
    return x.reshape(len(x), h * w)


def _image_shape(model: nnx.Module, image_shape: tuple[int, int] | None) -> tuple[int, int]:
    """(H, W) of the images a model takes: the argument, the model's own `image_shape`, or the
    square whose pixel count is the input width of an MLP's first layer."""
    if image_shape is not None:
        return tuple(image_shape)
    if getattr(model, "image_shape", None) is not None:
        return tuple(model.image_shape)
    layers = getattr(model, "layers", None)
    if layers and isinstance(layers[0], nnx.Linear):
        side = math.isqrt(layers[0].in_features)
        if side * side == layers[0].in_features:
            return side, side
    raise UserError(
        f"predict: cannot tell the image size {type(model).__name__} takes; pass image_shape=(H, W)"
    )


def predict(
    model: nnx.Module,
    images: Any,
    mesh: jax.sharding.Mesh | None = None,
    *,
    image_shape: tuple[int, int] | None = None,
) -> np.ndarray:
    """Class probabilities (N, classes) for images shaped (H, W), (N, H, W) or (N, H * W).

    The same rule as --mode=predict (`model_input`): uint8 pixels (0..255) and other integers
    in 0..255 are scaled by 1/255; floats must be finite and already in [0, 1] (they are never
    rescaled: divide 0..255 floats by 255 first). Anything else is a one-line UserError: a
    wrong shape, no images, NaN or infinite pixels, values out of range, a non-numeric dtype.
    (H, W) is the model's `image_shape` or, for the MLP, the square of its input width; pass
    `image_shape` for other models. On a mesh the images are padded to a multiple of its size
    and split along `data`.
    """
    x = model_input(images, _image_shape(model, image_shape))
    if mesh is None:
        return np.asarray(_probabilities(model, jnp.asarray(x)))
    pad = -len(x) % parallel.data_size(mesh)
    x = np.concatenate([x, np.zeros((pad, x.shape[1]), x.dtype)])
    sharded = parallel.shard_host_array(x, parallel.batch_sharding(mesh))
    return parallel.to_host(_probabilities(model, sharded))[: len(x) - pad]
