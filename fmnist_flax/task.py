"""The task: the loss a model is trained on and every metric it is judged by, defined once.

`per_example` gives each metric as one value per example. Training averages them over its
batch (and differentiates `loss`), each logged row over the steps since the row before, and
evaluation (during training, `--mode=eval`) over the test set with padding masked out; the
test set's appear as `test_<name>` in metrics.jsonl, TensorBoard, the tables and the report.
A module of `config.imports` adds a loss term (`@task.loss_term`, `LOSS_TERMS`) or a metric
(`@task.metric`, `METRICS`) with no edit here, for the runs that import it, and every one of
those shows it. A term is `fn(logits, labels, config)`; one that needs more asks for it by a
keyword-only parameter of `EXTRAS`: the batch's `images`, the `model`, a random `key`.

`TEST_SET_METRICS` are the metrics that are not a mean over examples (an F1 score): each is
computed from every test example's label and predicted class at each evaluation, for the
names in `config.test_set_metrics` (none by default), and reaches the same places.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from fmnist_flax.runtime import plugins
from fmnist_flax.runtime.errors import UserError
from fmnist_flax.runtime.registry import Registry

# fn(logits, labels, config, *, images=..., model=..., key=...) -> one float32 value per example.
PerExample = Callable[..., jax.Array]
BUILT_IN = ("loss", "accuracy")
# What a term or metric may ask for by a keyword-only parameter: the batch's images as the model
# sees them (B, H, W, C) in [0, 1], the model (in training, the one being differentiated), and
# a random key (each training step's own; a fixed one in evaluation).
EXTRAS = ("images", "model", "key")
KEY_STREAM = 3  # fold_in index of the loss's key (params 0, dropout 1, augmentation 2)
# Filled by the decorators below, from a module of config.imports: each loss term is added to
# `loss` and shown under its own name; each metric is shown beside `loss` and `accuracy`.
LOSS_TERMS = Registry("loss term", extras=EXTRAS)
METRICS = Registry("metric", extras=EXTRAS)


def _register(registry: Registry, kind: str, name: str):
    if problem := plugins.name_problem(name, (*BUILT_IN, *LOSS_TERMS, *METRICS)):
        raise UserError(
            f"@task.{kind}({name!r}): a name must be one of its own, and {problem} (the project "
            "writes step, epoch and the other progress fields, loss, accuracy, grad_norm, test_*)"
        )

    def add(fn: PerExample) -> PerExample:
        registry[name] = fn
        return fn

    return add


def loss_term(name: str) -> Callable[[PerExample], PerExample]:
    """Register fn(logits, labels, config), one value per example, as a term added to the loss
    that training minimises and evaluation reports, shown under `name` too; keyword-only
    parameters named in EXTRAS receive the images, the model or a key."""
    return _register(LOSS_TERMS, "loss_term", name)


def metric(name: str) -> Callable[[PerExample], PerExample]:
    """Register fn(logits, labels, config), one value per example, as the metric `name`; it
    may ask for EXTRAS as a loss term does."""
    return _register(METRICS, "metric", name)


def per_example(
    logits: jax.Array, labels: jax.Array, config: ml_collections.FrozenConfigDict, **extras: Any
) -> dict[str, jax.Array]:
    """Every metric of a batch, one float32 value per example; `loss` is what training
    minimises (softmax cross-entropy, labels smoothed when `config.label_smoothing` > 0, plus
    each of LOSS_TERMS the run imports; one failing or of another shape is one line). `extras`:
    what a term may ask for (EXTRAS). Names containing `accuracy` are shown as percentages."""
    if config.label_smoothing:
        targets = optax.smooth_labels(
            jax.nn.one_hot(labels, logits.shape[-1]), config.label_smoothing
        )
        loss = optax.softmax_cross_entropy(logits, targets)
    else:
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    imports = config.get("imports", ())
    args = (logits, labels, config)
    terms = LOSS_TERMS.apply(imports, *args, shape=labels.shape, **extras)
    return {
        "loss": functools.reduce(operator.add, terms.values(), loss),
        "accuracy": (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32),
        **terms,
        **METRICS.apply(imports, *args, shape=labels.shape, **extras),
    }


def step_key(config: ml_collections.FrozenConfigDict, step: jax.Array | int) -> jax.Array | None:
    """The key a term or metric asking for `key` gets at `step` (training), or None when none
    of the run's asks for one."""
    imports = config.get("imports", ())
    if not (LOSS_TERMS.asks_for("key", imports) or METRICS.asks_for("key", imports)):
        return None
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(config.seed), KEY_STREAM), step)


# --- Whole-test-set metrics -------------------------------------------------------------------


def class_accuracy(labels: np.ndarray, predictions: np.ndarray, num_classes: int) -> np.ndarray:
    """Each class's accuracy (its recall): the fraction of its examples predicted as it; NaN
    for a class with no test examples."""
    correct = np.bincount(labels[predictions == labels], minlength=num_classes)
    count = np.bincount(labels, minlength=num_classes)
    with np.errstate(invalid="ignore"):
        return correct / count


def macro_f1(labels: np.ndarray, predictions: np.ndarray, num_classes: int) -> float:
    """The unweighted mean of each class's F1, 2 TP / (2 TP + FP + FN), over the classes that
    occur among the labels or the predictions (as scikit-learn's f1_score(average="macro"))."""
    true_positives = np.bincount(labels[predictions == labels], minlength=num_classes)
    either = np.bincount(labels, minlength=num_classes) + np.bincount(
        predictions, minlength=num_classes
    )
    seen = either > 0
    return float(np.mean(2 * true_positives[seen] / either[seen])) if seen.any() else float("nan")


# config.test_set_metrics names -> fn(labels, predictions, num_classes): one number, or one per
# class (the columns `<name>_<class index>`).
TEST_SET_METRICS = Registry(
    "whole-test-set metric",
    {
        "macro_f1": macro_f1,
        "class_accuracy": class_accuracy,
    },
)
CLASS_COLUMN = "{name}_{index}"  # a per-class value's column: class_accuracy_3, never name/k


def check_test_set_metrics(config: ml_collections.ConfigDict) -> None:
    """Refuse anything but a tuple of names in TEST_SET_METRICS, in one line."""
    names = config.test_set_metrics
    example = 'e.g. --config.test_set_metrics=\'("macro_f1", "class_accuracy")\''
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise UserError(f"--config.test_set_metrics={names!r} must be a tuple of names, {example}")
    for name in names:
        if name not in TEST_SET_METRICS.active(config.imports):
            raise UserError(
                f"--config.test_set_metrics: {name!r} "
                f"{TEST_SET_METRICS.absent(name, config.imports)} ({example}; a new one goes in "
                "TEST_SET_METRICS in fmnist_flax/task.py)"
            )


def test_set_metrics(
    names: Sequence[str],
    labels: np.ndarray,
    predictions: np.ndarray,
    num_classes: int,
    imports: Sequence[str] = (),
) -> dict[str, float]:
    """The named TEST_SET_METRICS of every test example's label and predicted class, as
    columns: `name` for one number, `name_<class index>` for a value per class."""
    labels, predictions = np.asarray(labels, np.int64), np.asarray(predictions, np.int64)
    columns = {}
    for name in names:
        metric = TEST_SET_METRICS.active(imports)[name]
        try:
            value = np.asarray(metric(labels, predictions, num_classes), np.float64)
        except (Exception, SystemExit) as exc:  # training saves first, then says this
            what = f"whole-test-set metric {name!r} failed"
            raise plugins.PluginFailed(f"{what}: {plugins.failure(exc)}") from exc
        if value.ndim == 0:
            columns[name] = float(value)
        else:
            columns |= {
                CLASS_COLUMN.format(name=name, index=k): float(v) for k, v in enumerate(value)
            }
    return columns
