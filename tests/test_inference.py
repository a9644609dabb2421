"""--mode=eval and --mode=predict on a trained workdir, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO
from PIL import Image

from fmnist_flax import CLASS_NAMES, inference, load_model, predict
from fmnist_flax.errors import UserError


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("inference") / "w"
    result = subprocess.run(
        [sys.executable, str(REPO / "main.py"), "--steps=60", "--report=none",
         f"--workdir={workdir}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return workdir


@pytest.mark.slow
def test_eval_mode_writes_accuracy_loss_and_confusion_counts(workdir, real_dataset):
    report = inference.run_eval(workdir, compute_dtype="bfloat16")
    saved = json.loads((workdir / "eval.json").read_text())
    assert saved == report
    counts = np.array(report["confusion_matrix"])
    assert counts.sum() == report["test_examples"] == 10_000
    np.testing.assert_array_equal(counts.sum(axis=1), np.bincount(real_dataset.test_labels))
    assert report["test_accuracy"] == pytest.approx(np.trace(counts) / 10_000)
    assert report["compute_dtype"] == "bfloat16" and report["step"] == 60
    summary = json.loads((workdir / "summary.json").read_text())
    assert abs(report["test_accuracy"] - summary["test_accuracy"]) < 0.01


@pytest.mark.slow
def test_load_model_and_predict_api_matches_the_evaluation(workdir, real_dataset):
    model = load_model(workdir)
    probabilities = predict(model, real_dataset.test_images)
    assert probabilities.shape == (10_000, 10)
    np.testing.assert_allclose(probabilities.sum(axis=1), 1, rtol=1e-5)
    accuracy = np.mean(probabilities.argmax(1) == real_dataset.test_labels)
    summary = json.loads((workdir / "summary.json").read_text())
    assert accuracy == pytest.approx(summary["test_accuracy"], abs=1e-6)


@pytest.mark.slow
def test_predict_mode_classifies_readable_images_and_names_the_rest(
    workdir, real_dataset, tmp_path
):
    Image.fromarray(real_dataset.test_images[0]).save(tmp_path / "a.png")
    big = np.kron(real_dataset.test_images[1], np.ones((3, 3), np.uint8))
    Image.fromarray(np.stack([big] * 3, -1)).save(tmp_path / "big_rgb.png")
    np.save(tmp_path / "many.npy", real_dataset.test_images[2:5])
    np.save(tmp_path / "wrong.npy", np.zeros((5, 5)))
    (tmp_path / "broken.png").write_bytes(b"not a png")
    images = ["a.png", "big_rgb.png", "many.npy", "wrong.npy", "broken.png", "missing.png"]
    result = subprocess.run(
        [
            sys.executable, str(REPO / "main.py"), "--mode=predict", f"--workdir={workdir}",
            "--images=" + ",".join(str(tmp_path / i) for i in images),
            f"--output={tmp_path / 'out.json'}",
        ],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 3
    for name in ("wrong.npy", "broken.png", "missing.png"):
        assert sum(name in line for line in errors) == 1
    assert "resized from 84x84 to 28x28" in result.stdout
    assert "converted from RGB to grayscale" in result.stdout
    out = json.loads((tmp_path / "out.json").read_text())
    names = [p["image"].rsplit("/", 1)[-1] for p in out["predictions"]]
    assert names == ["a.png", "big_rgb.png", "many.npy[0]", "many.npy[1]", "many.npy[2]"]
    model = load_model(workdir)
    expected = predict(model, real_dataset.test_images[[0, 2, 3, 4]]).argmax(1)
    got = [out["predictions"][i]["class_index"] for i in (0, 2, 3, 4)]
    assert got == list(expected)
    for p in out["predictions"]:
        assert p["class"] == CLASS_NAMES[p["class_index"]]
        assert 0.0 < p["probability"] <= 1.0
        assert f"{p['class']} (" in result.stdout


@pytest.mark.slow
def test_predict_without_images_or_workdir_is_one_line(tmp_path):
    with pytest.raises(UserError, match="needs --images"):
        inference.run_predict(tmp_path, [])
    result = subprocess.run(
        [sys.executable, str(REPO / "main.py"), "--mode=eval"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "error: --mode=eval needs --workdir=DIR of a training run"
    ]


def test_read_images_takes_pngs_and_arrays_of_the_models_size(tmp_path):
    Image.fromarray(np.full((28, 28), 255, np.uint8)).save(tmp_path / "white.png")
    [(name, pixels)], notes = inference.read_images(tmp_path / "white.png")
    assert name.endswith("white.png") and notes == [] and pixels.max() == 1.0
    Image.fromarray(np.zeros((40, 30, 3), np.uint8)).save(tmp_path / "rgb.png")
    [(_, pixels)], notes = inference.read_images(tmp_path / "rgb.png", (12, 12))
    assert pixels.shape == (12, 12) and len(notes) == 2  # converted and resized, each noted
    np.save(tmp_path / "three.npy", np.zeros((3, 12, 12), np.uint8))
    images, _ = inference.read_images(tmp_path / "three.npy", (12, 12))
    assert [n for n, _ in images][-1].endswith("three.npy[2]")
    with pytest.raises(UserError, match=r"expected \(28, 28\) or \(N, 28, 28\)"):
        inference.read_images(tmp_path / "three.npy")
