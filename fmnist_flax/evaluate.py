"""Evaluation: every metric of the task over a test set, streamed to the devices in fixed-size
compiled calls, each an `nnx.vmap` over its batches (section 10), then the whole-test-set
metrics of `config.test_set_metrics` from every prediction.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from fmnist_flax import input_pipeline, task
from fmnist_flax.runtime import device_batches, ensemble, parallel
from fmnist_flax.runtime.inference import COUNT, means

# Test examples per compiled call at most (whole batches): a call's device memory is this
# many uint8 images and one vmapped forward pass over them, whatever the test set's size.
EVAL_EXAMPLES_PER_CALL = 10_240


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
    key = task.step_key(config, 0)  # what a term asking for a key gets in evaluation

    @nnx.vmap(in_axes=(None, 0, 0, 0))
    def one_batch(model, x, y, m):
        x = input_pipeline.normalize(x)

        def sums(logits, y, m):
            values = task.per_example(logits, y, config, images=x, model=model, key=key)
            return {name: jnp.sum(v * m) for name, v in values.items()}

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


def test_calls(
    images: np.ndarray, labels: np.ndarray, batch_size: int, mesh: jax.sharding.Mesh | None = None
) -> Iterator[tuple[jax.Array, jax.Array, jax.Array]]:
    """The test set as `evaluate_batches` takes it, a call at a time: uint8 images, labels and
    mask of padded whole batches of `batch_size`, placed on the devices (on a `mesh` split
    along `data`) as the call before is dispatched."""
    num_batches = -(-len(labels) // batch_size)
    calls, per_call = _calls(num_batches, batch_size)
    for call in range(calls):
        first = call * per_call * batch_size
        end = first + per_call * batch_size
        chunk = (images[first:end], labels[first:end])
        x, y, mask = input_pipeline.padded_batches(*chunk, batch_size, per_call)
        if mesh is None:
            yield jnp.asarray(x), jnp.asarray(y), jnp.asarray(mask)
        else:
            yield device_batches.shard_batches((x, y, mask), mesh)


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
    The images reach the devices a call at a time (`test_calls`, `batch_size` default the
    config's). The metrics of `config.test_set_metrics` follow, from every prediction (an
    Ensemble's members' as `<name>/k`). No examples give NaN metrics."""
    frozen = ml_collections.FrozenConfigDict(config)
    calls = test_calls(images, labels, batch_size or config.batch_size, mesh)
    outputs = [evaluate_batches(model, *placed, frozen) for placed in calls]
    return summarize(outputs, labels, config, num_classes(model, images, config))


def num_classes(
    model: nnx.Module, images: np.ndarray, config: ml_collections.ConfigDict
) -> int | None:
    """The model's number of classes where `config.test_set_metrics` needs it (else None)."""
    if not test_set_metric_names(config):
        return None
    image = jax.ShapeDtypeStruct((1, *images.shape[1:]), jnp.float32)
    return nnx.eval_shape(lambda m, x: m(x), model, image).shape[-1]


def summarize(
    outputs: list, labels: np.ndarray, config: ml_collections.ConfigDict, classes: int | None
) -> dict[str, Any]:
    """`evaluate`'s result from `evaluate_batches`'s outputs of each call (this waits for them
    to reach the host); `classes`: `num_classes`'s."""
    outputs = parallel.to_host(outputs)
    batch_size = outputs[0][1].shape[-1] if outputs else 1
    num_batches = -(-len(labels) // batch_size)
    batch_sums = {
        name: np.concatenate([sums[name] for sums, *_ in outputs] or [np.zeros(0)])[:num_batches]
        for name in (outputs[0][0] if outputs else {COUNT: None})
    }
    predictions = np.concatenate([p.reshape(-1) for _, p, _ in outputs] or [np.zeros(0, np.int32)])
    predictions = predictions[: len(labels)]
    return {
        **means(batch_sums),
        **whole_set_metrics(labels, predictions, outputs, config, classes),
        "predictions": predictions,
        "batch_sums": batch_sums,
    }


def whole_set_metrics(
    labels: np.ndarray,
    predictions: np.ndarray,
    outputs: list,
    config: ml_collections.ConfigDict,
    classes: int | None,
) -> dict[str, float]:
    """`config.test_set_metrics` of the predictions over `classes` classes, and of each
    member's for an Ensemble (`outputs`: `evaluate_batches`'s per call, on the host); {} when
    it names none or there are no labels."""
    names = test_set_metric_names(config)
    if not names or not len(labels):
        return {}
    imports = config.get("imports", ())
    columns = task.test_set_metrics(names, labels, predictions, classes, imports)
    if outputs[0][2] is not None:  # an Ensemble's: (K, members, B) per call -> (members, N)
        each = np.concatenate([np.concatenate(list(p), axis=1) for *_, p in outputs], axis=1)
        for k, member in enumerate(each[:, : len(labels)]):
            found = task.test_set_metrics(names, labels, member, classes, imports)
            columns |= {ensemble.member_column(n, k): v for n, v in found.items()}
    return columns
