"""Evaluation: every metric of the task over a test set, streamed to the devices in fixed-size
compiled calls, each an `nnx.vmap` over its batches (section 10), then the whole-test-set
metrics of `config.test_set_metrics` from every prediction; `predict` and its input rule.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from fmnist_flax import datasets, input_pipeline, task
from fmnist_flax.input_pipeline import PIXEL_SCALE
from fmnist_flax.runtime import ensemble, errors, parallel
from fmnist_flax.runtime.errors import UserError

# Test examples per compiled call at most (whole batches): a call's device memory is this
# many uint8 images and one vmapped forward pass over them, whatever the test set's size.
EVAL_EXAMPLES_PER_CALL = 10_240
COUNT = "examples"  # the key of each batch's count of real examples among the sums


@functools.partial(nnx.jit, static_argnames="config")
def evaluate_batches(
    model: nnx.Module,
    images: jax.Array,
    labels: jax.Array,
    mask: jax.Array,
    config: ml_collections.FrozenConfigDict,
) -> tuple[dict[str, jax.Array], jax.Array, jax.Array | None]:
    """Per batch of (K, B) examples, the masked sum of every metric of `task.per_example` and
    the count of real examples; and every example's predicted class. Images are uint8
    (K, B, H, W, C), normalised here; padding (mask 0) counts nowhere. For an Ensemble the
    metrics are the ensemble's, and member k's are added as `<metric>/k`; with whole-test-set
    metrics, each member's predicted classes (K, members, B) come back too (else None)."""
    member_predictions = bool(test_set_metric_names(config))

    def sums(logits, y, m):
        values = task.per_example(logits, y, config)
        return {name: jnp.sum(v * m) for name, v in values.items()}

    @nnx.vmap(in_axes=(None, 0, 0, 0))
    def one_batch(model, x, y, m):
        x = input_pipeline.normalize(x)
        if isinstance(model, ensemble.Ensemble):  # the members' logits, computed once
            each = model.member_logits(x)
            logits = ensemble.combine(each)
            members = jax.vmap(sums, (0, None, None))(each, y, m)
            each_predicted = jnp.argmax(each, axis=-1) if member_predictions else None
        else:
            logits = model(x)
            members, each_predicted = {}, None
        return sums(logits, y, m), members, jnp.argmax(logits, axis=-1), each_predicted

    totals, members, predictions, each_predicted = one_batch(model, images, labels, mask)
    for name, values in members.items():  # (K, members)
        totals |= {ensemble.member_column(name, k): values[:, k] for k in range(values.shape[1])}
    return {**totals, COUNT: jnp.sum(mask, axis=1)}, predictions, each_predicted


def test_set_metric_names(config: ml_collections.ConfigDict) -> tuple[str, ...]:
    """The whole-test-set metrics a config asks for (`task.TEST_SET_METRICS`)."""
    return tuple(config.get("test_set_metrics", ()))


def _calls(num_batches: int, batch_size: int) -> tuple[int, int]:
    """(calls, batches per call): as few calls as EVAL_EXAMPLES_PER_CALL allows, of equal size
    (so one compilation serves them all) and with as little padding as that leaves."""
    most = max(1, EVAL_EXAMPLES_PER_CALL // batch_size)
    calls = -(-num_batches // most)
    return calls, -(-num_batches // max(calls, 1))


def evaluate(
    model: nnx.Module,
    images: np.ndarray,
    labels: np.ndarray,
    config: ml_collections.ConfigDict,
    mesh: jax.sharding.Mesh | None = None,
    batch_size: int | None = None,
) -> dict[str, Any]:
    """Every metric's mean over uint8 `images` (N, H, W, C) and their labels, on the host's
    terms: floats, the example count, the predictions, and each batch's sums (`batch_sums`).

    The images stay on the host and reach the devices a call at a time, padded to whole
    batches of `batch_size` (default the config's) and masked; on a `mesh` each batch is split
    along `data`. The metrics of `config.test_set_metrics` follow the means, computed from
    every prediction (an Ensemble's members' as `<name>/k`). No examples give NaN metrics.
    """
    frozen = ml_collections.FrozenConfigDict(config)
    batch_size = batch_size or config.batch_size
    num_batches = -(-len(labels) // batch_size)
    calls, per_call = _calls(num_batches, batch_size)
    outputs = []
    for call in range(calls):
        first = call * per_call * batch_size
        end = first + per_call * batch_size
        chunk = (images[first:end], labels[first:end])
        x, y, mask = input_pipeline.padded_batches(*chunk, batch_size, per_call)
        if mesh is None:
            placed = (jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask))
        else:
            placed = input_pipeline.shard_batches((x, y, mask), mesh)
        outputs.append(evaluate_batches(model, *placed, frozen))
    outputs = parallel.to_host(outputs)
    batch_sums = {
        name: np.concatenate([sums[name] for sums, *_ in outputs] or [np.zeros(0)])[:num_batches]
        for name in (outputs[0][0] if outputs else {COUNT: None})
    }
    predictions = np.concatenate([p.reshape(-1) for _, p, _ in outputs] or [np.zeros(0, np.int32)])
    predictions = predictions[: len(labels)]
    return {
        **means(batch_sums),
        **whole_set_metrics(model, images, labels, predictions, outputs, config),
        "predictions": predictions,
        "batch_sums": batch_sums,
    }


def whole_set_metrics(
    model: nnx.Module,
    images: np.ndarray,
    labels: np.ndarray,
    predictions: np.ndarray,
    outputs: list[tuple[Any, Any, Any]],
    config: ml_collections.ConfigDict,
) -> dict[str, float]:
    """`config.test_set_metrics` of the predictions, and of each member's for an Ensemble
    (`outputs`: `evaluate_batches`'s per call); {} when it names none or there are no labels."""
    names = test_set_metric_names(config)
    if not names or not len(labels):
        return {}
    image = jax.ShapeDtypeStruct((1, *images.shape[1:]), jnp.float32)
    num_classes = nnx.eval_shape(lambda m, x: m(x), model, image).shape[-1]
    columns = task.test_set_metrics(names, labels, predictions, num_classes)
    if isinstance(model, ensemble.Ensemble):  # (K, members, B) per call -> (members, N)
        each = np.concatenate([np.concatenate(list(p), axis=1) for *_, p in outputs], axis=1)
        for k, member in enumerate(each[:, : len(labels)]):
            found = task.test_set_metrics(names, labels, member, num_classes)
            columns |= {ensemble.member_column(n, k): v for n, v in found.items()}
    return columns


def means(batch_sums: dict[str, np.ndarray], num_batches: int | None = None) -> dict[str, Any]:
    """Every metric's mean over the first `num_batches` of an evaluation (default all), and
    the example count: the codelab's whole batches are the first ones of the padded set."""
    totals = {name: np.asarray(s, np.float64)[:num_batches].sum() for name, s in batch_sums.items()}
    count = int(totals.pop(COUNT))
    return {
        **{name: total / count if count else float("nan") for name, total in totals.items()},
        COUNT: count,
    }


def confusion_matrix(labels: np.ndarray, predictions: np.ndarray, num_classes: int) -> np.ndarray:
    """counts[true, predicted] over every evaluated example."""
    counts = np.zeros((num_classes, num_classes), np.int64)
    np.add.at(counts, (np.asarray(labels), np.asarray(predictions)), 1)
    return counts


@nnx.jit
def _probabilities(model: nnx.Module, x: jax.Array) -> jax.Array:
    return jax.nn.softmax(model(x), axis=-1)


def model_input(images: Any, image_shape: tuple[int, int, int], name: str = "images") -> np.ndarray:
    """The one input rule of `predict` and of --mode=predict's .npy files and pictures:
    `images` as float32 (N, H, W, C) in [0, 1], or a one-line UserError that starts with `name`.

    Shapes: (H, W, C) is one image, (N, H, W, C) is N >= 1 images, and so is the flat
    (N, H * W * C); for grayscale (C = 1) also (H, W) and (N, H, W).
    Pixels: uint8 is 0..255 and is scaled by 1/255 (`PIXEL_SCALE`, as training does); any
    other integer dtype must hold only 0..255 and is scaled the same; floats (16, 32 or 64
    bits) must be finite and already in [0, 1], and are never rescaled (divide 0..255 floats
    by 255 first). bool, complex, string, object, structured and date/time arrays are refused.
    """
    h, w, c = (int(side) for side in image_shape)
    one = [(h, w, c), *([(h, w)] if c == 1 else [])]
    expected = "expected " + " or ".join(
        ([f"({h}, {w})", f"(N, {h}, {w})"] if c == 1 else [])
        + [f"({h}, {w}, {c})", f"(N, {h}, {w}, {c})", f"(N, {h * w * c})"]
    )
    try:
        array = np.asarray(images)
    except (ValueError, TypeError) as exc:
        reason = errors.reason(exc)
        raise UserError(f"{name}: cannot be made into one array ({reason}); {expected}") from None
    if array.dtype.kind == "V" and jnp.issubdtype(array.dtype, jnp.floating):
        array = array.astype(np.float32)  # bfloat16 and other ml_dtypes floats: exact in f32
    kind = array.dtype.kind
    if kind not in "uif":  # timedelta64 counts as an integer for np.issubdtype: go by kind
        raise UserError(
            f"{name}: pixels of dtype {array.dtype} cannot be used; pass uint8 (0..255), "
            "other integers in 0..255 or floats in [0, 1]"
        )
    if array.shape in one:
        array = array[None]
    if array.ndim < 2 or array.shape[1:] not in (*one, (h * w * c,)):
        raise UserError(f"{name}: array shape {array.shape}; {expected}")
    if len(array) == 0:
        raise UserError(f"{name}: no images in it (shape {array.shape}); {expected} with N >= 1")
    _check_range(array, name)
    x = array.astype(np.float32)
    if kind != "f":
        x = x * PIXEL_SCALE  # bit for bit what training feeds the model
    return x.reshape(len(x), h, w, c)


def _check_range(array: np.ndarray, name: str) -> None:
    """Floats must be finite and in [0, 1]; integers other than uint8 in 0..255."""
    if array.dtype.kind == "f":
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
    elif array.dtype != np.uint8:
        low, high = array.min(), array.max()
        if low < 0 or high > 255:
            raise UserError(
                f"{name}: integer pixels must lie in 0..255 but these range over "
                f"{low}..{high}; scale them to 0..255 (uint8) or to floats in [0, 1] first"
            )


def image_shape_of(model: nnx.Module, image_shape: tuple[int, ...] | None) -> tuple[int, ...]:
    """(H, W, C) of the images a model takes: the argument, or the model's own `image_shape`
    (the built-in models keep the one they were built for)."""
    shape = image_shape if image_shape is not None else getattr(model, "image_shape", None)
    if shape is None:
        raise UserError(
            f"predict: cannot tell the image shape {type(model).__name__} takes; pass "
            "image_shape=(H, W, C)"
        )
    return datasets.as_hwc(shape)


def predict(
    model: nnx.Module,
    images: Any,
    mesh: jax.sharding.Mesh | None = None,
    *,
    image_shape: tuple[int, ...] | None = None,
) -> np.ndarray:
    """Class probabilities (N, classes) for images shaped as `model_input` says: (N, H, W, C)
    or one (H, W, C), and for grayscale also (N, H, W) and (H, W).

    The same rule as --mode=predict (`model_input`): uint8 pixels (0..255) and other integers
    in 0..255 are scaled by 1/255; floats must be finite and already in [0, 1] (they are never
    rescaled: divide 0..255 floats by 255 first). Anything else is a one-line UserError: a
    wrong shape, no images, NaN or infinite pixels, values out of range, a non-numeric dtype.
    (H, W, C) is the model's `image_shape` (the built-in models keep it); pass `image_shape`
    for other models. On a mesh the images are padded to a multiple of its size and split
    along `data`.
    """
    x = model_input(images, image_shape_of(model, image_shape))
    if mesh is None:
        return np.asarray(_probabilities(model, jnp.asarray(x)))
    pad = -len(x) % parallel.data_size(mesh)
    x = np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)])
    sharded = parallel.shard_host_array(x, parallel.batch_sharding(mesh))
    return parallel.to_host(_probabilities(model, sharded))[: len(x) - pad]
