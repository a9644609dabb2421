"""The streamed, vmapped evaluation: every metric of the task over the codelab's trimmed 9,728
and every one of the 10,000, in fixed-size calls."""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from conftest import forward, load_config, run_main
from flax import nnx
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fmnist_flax import evaluate, input_pipeline, task, train
from fmnist_flax import model as model_lib
from fmnist_flax.model import MLP
from fmnist_flax.runtime import inference, parallel
from fmnist_flax.runtime.errors import UserError


@pytest.fixture(scope="module")
def model():
    return MLP(rngs=nnx.Rngs(3))


@pytest.fixture(scope="module")
def config():
    return load_config("default")


@pytest.fixture(scope="module")
def test_logits(model, real_dataset):
    """The model's logits for each of the 10,000 test images, in one plain call."""
    return np.asarray(
        forward(model, jnp.asarray(input_pipeline.prepare_images(real_dataset.test_images)))
    )


def log_softmax(logits):
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def numpy_metrics(logits, labels):
    """Plain per-example metrics in NumPy, the ground truth for the vmapped evaluation."""
    losses = -np.take_along_axis(log_softmax(logits), labels[:, None].astype(np.int64), -1)
    predictions = logits.argmax(-1)
    return float(np.mean(losses)), float(np.mean(predictions == labels)), predictions


def test_full_evaluation_counts_every_test_example_once(model, config, real_dataset, test_logits):
    images, labels = real_dataset.test_images, real_dataset.test_labels
    result = evaluate.evaluate(model, images, labels, config, parallel.make_mesh())
    loss, accuracy, predictions = numpy_metrics(test_logits, labels)
    assert result["examples"] == 10_000
    np.testing.assert_allclose(result["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(result["accuracy"], accuracy, rtol=1e-6)
    np.testing.assert_array_equal(result["predictions"], predictions)


def test_the_codelabs_whole_batches_come_from_the_same_pass(
    model, config, real_dataset, test_logits
):
    """The codelab evaluates only whole batches (19 of 512 = 9,728): the first 19 batches'
    sums of the full evaluation, without evaluating again."""
    images, labels = real_dataset.test_images, real_dataset.test_labels
    full = evaluate.evaluate(model, images, labels, config)
    codelab = inference.means(full["batch_sums"], 19)
    loss, accuracy, _ = numpy_metrics(test_logits[:9_728], labels[:9_728])
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
    codelab = inference.means(result["batch_sums"], 0)
    assert codelab["examples"] == 0 and np.isnan(codelab["accuracy"])


def test_label_smoothing_is_part_of_the_evaluated_loss_as_of_the_trained_one(
    model, config, real_dataset, test_logits
):
    """One definition of the loss (task.py): the test loss is the objective that trains."""
    images, labels = real_dataset.test_images[:512], real_dataset.test_labels[:512]
    plain = evaluate.evaluate(model, images, labels, config)
    config = load_config("default")
    config.label_smoothing = 0.1
    smoothed = evaluate.evaluate(model, images, labels, config)
    targets = np.eye(10)[labels] * 0.9 + 0.1 / 10  # optax.smooth_labels(one_hot, 0.1)
    expected = float(np.mean(-(targets * log_softmax(test_logits[:512])).sum(-1)))
    np.testing.assert_allclose(smoothed["loss"], expected, rtol=1e-5)
    assert smoothed["accuracy"] == plain["accuracy"] and smoothed["loss"] != plain["loss"]


# --- Whole-test-set metrics (task.TEST_SET_METRICS) -------------------------------------------

WHOLE_SET = ("macro_f1", "class_accuracy")


def test_whole_set_metrics_by_hand():
    """Labels 0 0 1 1 2, predicted 0 1 1 1 0, four classes: class 3 never occurs."""
    labels, predictions = np.array([0, 0, 1, 1, 2]), np.array([0, 1, 1, 1, 0])
    columns = task.test_set_metrics(WHOLE_SET, labels, predictions, 4)
    # F1 per class: 2*1/(2+1+1), 2*2/(4+1+0), 0; class 3 is neither a label nor predicted.
    assert columns["macro_f1"] == pytest.approx((0.5 + 0.8 + 0.0) / 3)
    assert [columns[f"class_accuracy_{k}"] for k in range(3)] == [0.5, 1.0, 0.0]
    assert np.isnan(columns["class_accuracy_3"])
    assert list(columns) == ["macro_f1", *(f"class_accuracy_{k}" for k in range(4))]


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("macro_f1", "auc"), "'auc' is not one of macro_f1, class_accuracy"),
        ("macro_f1", "must be a tuple of names"),
    ],
)
def test_unknown_whole_set_metrics_are_one_line(names, expected):
    def config(names):
        return ml_collections.ConfigDict({"test_set_metrics": names, "imports": ()})

    with pytest.raises(UserError, match=expected.replace("(", r"\(")):
        task.check_test_set_metrics(config(names))
    task.check_test_set_metrics(config(WHOLE_SET))
    task.check_test_set_metrics(config(()))


def test_whole_set_metrics_come_from_every_prediction_of_the_evaluation(model, real_dataset):
    """Streamed in calls, the last padded: the columns are those of the returned predictions,
    beside the means; a config without them (the default) gets none."""
    config = load_config("default")
    images, labels = real_dataset.test_images[:1_000], real_dataset.test_labels[:1_000]
    plain = evaluate.evaluate(model, images, labels, config, batch_size=384)
    config.test_set_metrics = WHOLE_SET
    result = evaluate.evaluate(model, images, labels, config, batch_size=384)
    expected = task.test_set_metrics(WHOLE_SET, labels, result["predictions"], 10)
    assert {k: result[k] for k in expected} == expected and len(expected) == 11
    assert set(result) - set(plain) == set(expected)
    assert result["accuracy"] == plain["accuracy"]
    counts = inference.confusion_matrix(labels, result["predictions"], 10)
    np.testing.assert_allclose(
        [result[f"class_accuracy_{k}"] for k in range(10)], counts.diagonal() / counts.sum(1)
    )


def test_an_ensembles_whole_set_metrics_are_its_own_and_each_members(real_dataset):
    """The columns `name` come from the ensemble's predictions, `name/k` from member k's: its
    class accuracies, weighted by the class counts, give its own accuracy `accuracy/k`."""
    config = load_config("default")
    config.test_set_metrics = WHOLE_SET
    config.ensemble.size = 2
    members = model_lib.create_model(config, (28, 28, 1), 10)
    images, labels = real_dataset.test_images[:600], real_dataset.test_labels[:600]
    result = evaluate.evaluate(members, images, labels, config, batch_size=256)
    assert result["macro_f1"] == task.macro_f1(labels, result["predictions"], 10)
    share = np.bincount(labels, minlength=10) / len(labels)
    for k in range(2):
        per_class = [result[f"class_accuracy_{c}/{k}"] for c in range(10)]
        assert np.dot(per_class, share) == pytest.approx(result[f"accuracy/{k}"], abs=1e-12)
        assert 0 < result[f"macro_f1/{k}"] < 1
    assert result["accuracy/0"] != result["accuracy/1"]


WHOLE_SET_CONFIG = """
from fmnist_flax import config as default_config


def get_config():
    config = default_config.get_config()
    config.steps, config.log_every, config.eval_every = 40, 10, 20
    config.report = "basic"
    config.test_set_metrics = ("macro_f1", "class_accuracy")
    return config
"""


@pytest.mark.slow
def test_whole_set_metrics_reach_every_output_of_a_run_and_eval(tmp_path: pathlib.Path):
    """metrics.jsonl at each evaluation, TensorBoard, the tables, the report, summary.json
    and --mode=eval: the same columns, the same values."""
    (tmp_path / "whole_set.py").write_text(WHOLE_SET_CONFIG)
    workdir = tmp_path / "w"
    done = run_main(f"--config={tmp_path / 'whole_set.py'}", f"--workdir={workdir}")
    assert done.returncode == 0, done.stderr
    columns = ["test_macro_f1", *(f"test_class_accuracy_{k}" for k in range(10))]
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    tested = {row["step"]: row for row in rows if "test_loss" in row}
    assert sorted(tested) == [20, 40]
    assert all(set(columns) <= set(row) for row in tested.values())
    assert not any(set(columns) & set(row) for row in rows if row["step"] not in tested)
    assert 0.5 < tested[40]["test_macro_f1"] < 1
    reader = EventAccumulator(str(workdir / "tensorboard"))
    reader.Reload()
    for name in columns:
        written = {e.step: e.value for e in reader.Scalars(f"test/{name.removeprefix('test_')}")}
        assert written == pytest.approx({s: row[name] for s, row in tested.items()}, rel=1e-6)
    for shown in (done.stdout, (workdir / "report" / "report.html").read_text()):
        assert "Test macro f1" in shown and "Class accuracy 9" in shown
    summary = json.loads((workdir / "summary.json").read_text())
    assert {k: summary[k] for k in columns} == {k: tested[40][k] for k in columns}
    evaluated = run_main("--mode=eval", f"--workdir={workdir}", f"--output={tmp_path / 'e.json'}")
    assert evaluated.returncode == 0, evaluated.stderr
    assert "Macro f1" in evaluated.stdout
    report = json.loads((tmp_path / "e.json").read_text())
    assert {k: report[k] for k in columns} == {k: summary[k] for k in columns}


def test_registered_loss_terms_add_to_the_loss_and_metrics_sit_beside_it(quick_config, registries):
    """`@task.loss_term` adds to the loss and shows the term; `@task.metric` adds a metric;
    a name already taken is refused in one line."""
    task.loss_term("twice_in_test")(lambda logits, labels, config: jnp.full(len(labels), 2.0))
    task.metric("top_logit_in_test")(lambda logits, labels, config: logits.max(-1))
    logits, labels = jnp.array([[1.0, 3.0], [2.0, 0.0]]), jnp.array([1, 1])
    values = task.per_example(logits, labels, train.Config(quick_config))
    names = list(values)  # a project's own metrics may sit between, in its task.py
    assert names[:2] == ["loss", "accuracy"] and names[-2:] == [
        "twice_in_test",
        "top_logit_in_test",
    ]
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    np.testing.assert_allclose(values["loss"], cross_entropy + 2.0)
    np.testing.assert_array_equal(values["top_logit_in_test"], [3.0, 2.0])
    for name in ("twice_in_test", "accuracy", "test_top"):
        with pytest.raises(UserError, match=f"@task.metric\\('{name}'\\): a name must be"):
            task.metric(name)
