"""The task: the loss a model is trained on and every metric it is judged by, defined once.

`per_example` gives each metric as one value per example. Training averages them over its
batch (and differentiates `loss`), each logged row over the steps since the row before, and
evaluation (during training, `--mode=eval`) over the test set with padding masked out; the
test set's appear as `test_<name>` in metrics.jsonl, TensorBoard, the tables and the report.
Add a metric or a loss term here and every one of those shows it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax


def per_example(
    logits: jax.Array, labels: jax.Array, config: ml_collections.FrozenConfigDict
) -> dict[str, jax.Array]:
    """Every metric of a batch, one float32 value per example; `loss` is what training
    minimises (softmax cross-entropy, labels smoothed when `config.label_smoothing` > 0).
    Names containing `accuracy` are shown as percentages."""
    if config.label_smoothing:
        targets = optax.smooth_labels(
            jax.nn.one_hot(labels, logits.shape[-1]), config.label_smoothing
        )
        loss = optax.softmax_cross_entropy(logits, targets)
    else:
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return {
        "loss": loss,
        "accuracy": (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32),
    }
