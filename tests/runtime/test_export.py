"""--mode=export: a jax.export artifact that loads and runs with JAX alone, as predict does."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import REPO, assert_one_line_error, assert_same_models, load_config, run_main

from fmnist_flax import CLASS_NAMES, load_model, model, predict, train
from fmnist_flax.runtime import export, inference

from . import scanned_model


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> pathlib.Path:
    workdir = tmp_path_factory.mktemp("export") / "w"
    result = run_main(f"--workdir={workdir}", "--steps=20", "--report=none")
    assert result.returncode == 0, result.stderr
    return workdir


@pytest.fixture(scope="module")
def artifact(workdir, tmp_path_factory) -> tuple[pathlib.Path, subprocess.CompletedProcess]:
    """The workdir exported through the CLI, and that run."""
    path = tmp_path_factory.mktemp("artifact") / "model.jaxexport"
    result = run_main("--mode=export", f"--workdir={workdir}", f"--output={path}")
    assert result.returncode == 0, result.stderr
    return path, result


@pytest.mark.slow
def test_artifact_runs_with_jax_alone_and_matches_predict(
    workdir, artifact, jax_only, real_dataset, tmp_path
):
    path, run = artifact
    assert f"wrote {path}" in run.stdout and "cpu, cuda" in run.stdout
    images = real_dataset.test_images[:16]
    np.save(tmp_path / "images.npy", images)
    got = jax_only(path, images)
    expected = predict(load_model(workdir), images)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    predicted = run_main(
        "--mode=predict",
        f"--workdir={workdir}",
        f"--images={tmp_path / 'images.npy'}",
        f"--output={tmp_path / 'predict.json'}",
    )
    assert predicted.returncode == 0, predicted.stderr
    predictions = json.loads((tmp_path / "predict.json").read_text())["predictions"]
    assert [p["class_index"] for p in predictions] == got.argmax(axis=1).tolist()
    np.testing.assert_allclose(got, [p["probabilities"] for p in predictions], rtol=1e-6, atol=1e-7)


def section_code(page: pathlib.Path, heading: str) -> str:
    """The first ```python block under `heading` in a documentation page, as written."""
    text = page.read_text().split(f"\n{heading}\n", 1)[1]
    return text.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.slow
def test_the_export_snippet_of_the_docs_runs_as_written(artifact, tmp_path):
    """docs/checkpoints.md loaded the artifact and called it on examples/batch.npy, whose
    (8, 28, 28) images the artifact's (batch, 28, 28, 1) refused (a rank mismatch). The
    snippet runs as written, from a directory holding the artifact and the examples."""
    code = section_code(REPO / "docs" / "checkpoints.md", "## Exporting for JAX alone")
    shutil.copy(artifact[0], tmp_path / "model.jaxexport")
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    result = subprocess.run(
        [sys.executable, "-c", code + "\nprint(probabilities.shape, probabilities.dtype)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["(8,", "10)", "float32"]


@pytest.mark.slow
def test_artifact_takes_any_batch_size(workdir, artifact, real_dataset):
    exported = jax.export.deserialize(artifact[0].read_bytes())
    assert exported.platforms == ("cpu", "cuda")
    reference = load_model(workdir)
    for images in (real_dataset.test_images[:1], real_dataset.test_images[16:49]):
        got = np.asarray(exported.call(images))
        assert got.shape == (len(images), 10) and got.dtype == np.float32
        np.testing.assert_allclose(got, predict(reference, images), rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_metadata_beside_the_artifact_names_classes_contract_and_step(workdir, artifact):
    path, _ = artifact
    meta = json.loads(path.with_name(path.name + export.METADATA_SUFFIX).read_text())
    assert meta["class_names"] == list(CLASS_NAMES)
    assert meta["source"] == {
        "workdir": str(workdir),
        "step": 20,
        "dataset": "fashion_mnist",
        "model": "mlp",
    }
    assert meta["input"]["dtype"] == "uint8" and meta["input"]["shape"] == [None, 28, 28, 1]
    assert meta["input"]["range"] == [0, 255]
    assert meta["output"]["dtype"] == "float32" and meta["output"]["shape"] == [None, 10]
    assert meta["platforms"] == ["cpu", "cuda"]
    assert meta["artifact"] == path.name and meta["jax_version"] == jax.__version__


@pytest.mark.slow
def test_export_mistakes_are_one_line(workdir, tmp_path):
    assert_one_line_error(run_main("--mode=export", f"--output={tmp_path / 'm'}"), "--workdir")
    assert_one_line_error(
        run_main("--mode=export", f"--workdir={workdir}"), "--mode=export needs --output=FILE"
    )
    # --output is checked first: the workdir named here does not exist either.
    missing = tmp_path / "missing" / "m.jaxexport"
    assert_one_line_error(
        run_main("--mode=export", f"--workdir={tmp_path / 'nowhere'}", f"--output={missing}"),
        "its directory does not exist",
    )
    assert_one_line_error(
        run_main("--mode=export", f"--workdir={workdir}", f"--output={tmp_path}"),
        "is a directory",
    )
    assert list(tmp_path.iterdir()) == []


def test_cnn_exports_with_a_symbolic_batch():
    config = load_config("cnn")
    cnn = model.create_model(config, (28, 28, 1), 10)
    assert_exports_as_it_predicts(cnn)


def assert_exports_as_it_predicts(net) -> None:
    """The serialised artifact of `net`, run on 3 random images, gives `predict`'s output."""
    net.eval()
    exported = export.export_probabilities(net, (28, 28, 1))
    images = np.random.default_rng(0).integers(0, 256, (3, 28, 28, 1), dtype=np.uint8)
    got = np.asarray(jax.export.deserialize(exported.serialize()).call(images))
    np.testing.assert_allclose(got, predict(net, images), rtol=1e-6, atol=1e-7)


@pytest.fixture
def scanned(registries) -> None:
    """The scanned test model registered as docs/extending.md "Add a model" says."""
    model.MODELS["scanned"] = scanned_model.ScannedMLP


@pytest.mark.parametrize("members", [1, 2])
def test_scanned_models_and_their_ensembles_export(scanned, members):
    """Blocks in an `nnx.scan` refuse Variables closed over from outside the export's trace."""
    config = scanned_model.config(load_config("default"))
    config.ensemble.size = members
    scanned_net = model.create_model(config, (28, 28, 1), 10)
    assert_exports_as_it_predicts(scanned_net)


@pytest.mark.slow
def test_a_scanned_model_trains_resumes_evaluates_predicts_and_exports(
    scanned, jax_only, real_dataset, tmp_path
):
    config = scanned_model.config(load_config("smoke"))
    straight = train.train_and_evaluate(config, tmp_path / "straight")
    config.steps = 10
    train.train_and_evaluate(config, tmp_path / "resumed")
    config.steps = 20
    resumed = train.train_and_evaluate(config, tmp_path / "resumed")
    assert resumed["resumed_from_step"] == 10
    assert_same_models(tmp_path / "straight", tmp_path / "resumed")
    assert resumed["test_accuracy"] == straight["test_accuracy"] > 0.5

    evaluated = inference.run_eval(tmp_path / "resumed")
    assert evaluated["step"] == 20 and evaluated["test_accuracy"] == resumed["test_accuracy"]
    images = real_dataset.test_images[:16]
    np.save(tmp_path / "images.npy", images)
    predictions, failures = inference.run_predict(tmp_path / "resumed", [tmp_path / "images.npy"])
    assert failures == [] and len(predictions) == len(images)

    artifact = tmp_path / "scanned.jaxexport"
    metadata = export.export_model(tmp_path / "resumed", artifact)
    assert metadata["source"]["model"] == "scanned" and metadata["source"]["step"] == 20
    got = jax_only(artifact, images)
    np.testing.assert_allclose(
        got, predict(load_model(tmp_path / "resumed"), images), rtol=1e-6, atol=1e-7
    )
    np.testing.assert_allclose(got, [p["probabilities"] for p in predictions], rtol=1e-6, atol=1e-7)
