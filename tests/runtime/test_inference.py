"""--mode=eval and --mode=predict on a trained workdir, as a user runs them."""

from __future__ import annotations

import json
import os
import pathlib
import re
import resource
import shutil
import signal
import struct
import subprocess
import sys
import zlib

import jax
import numpy as np
import pytest
from conftest import REPO, assert_one_line_error, edit_saved_configs, run_main
from flax import nnx
from PIL import Image

from fmnist_flax import CLASS_NAMES, datasets, load_model, predict, train
from fmnist_flax.model import MLP
from fmnist_flax.runtime import checkpoint, inference, records, tables
from fmnist_flax.runtime import workdir as workdir_lib
from fmnist_flax.runtime.errors import UserError
from fmnist_flax.runtime.inference import PIXEL_SCALE
from fmnist_flax.runtime.schedule import Schedule

SHAPES = "expected (28, 28) or (N, 28, 28) or (28, 28, 1) or (N, 28, 28, 1) or (N, 784)"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("inference") / "w"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "main.py"),
            "--steps=60",
            "--report=none",
            f"--workdir={workdir}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return workdir


@pytest.mark.slow
def test_eval_mode_writes_accuracy_loss_and_confusion_counts(
    workdir, real_dataset, tmp_path, capsys
):
    before = sorted(str(p) for p in workdir.rglob("*"))
    report = inference.run_eval(workdir, compute_dtype="bfloat16", output=tmp_path / "e.json")
    printed = capsys.readouterr().out.splitlines()
    assert "9 Ankle boot" in "\n".join(printed)  # class names in full, columns by number
    assert max(len(line) for line in printed) <= 100
    assert json.loads((tmp_path / "e.json").read_text()) == report
    assert sorted(str(p) for p in workdir.rglob("*")) == before  # a reader changes nothing
    counts = np.array(report["confusion_matrix"])
    assert counts.sum() == report["test_examples"] == 10_000
    np.testing.assert_array_equal(counts.sum(axis=1), np.bincount(real_dataset.test_labels))
    assert report["test_accuracy"] == pytest.approx(np.trace(counts) / 10_000)
    assert report["compute_dtype"] == "bfloat16" and report["step"] == 60
    summary = json.loads((workdir / "summary.json").read_text())
    assert abs(report["test_accuracy"] - summary["test_accuracy"]) < 0.01


@pytest.mark.slow
@pytest.mark.parametrize("source", ["arrays", "records"])
def test_eval_on_data_with_more_classes_than_the_model_is_one_line(tmp_path, source):
    """Trained on 3 classes, evaluated on data with 5: once `IndexError: index 3 is out of
    bounds` in the confusion matrix."""
    rng = np.random.default_rng(0)
    for name, classes in (("three", 3), ("five", 5)):
        split = (rng.integers(0, 256, (20, 6, 5), dtype=np.uint8), np.arange(20) % classes)
        if source == "arrays":
            (tmp_path / name).mkdir()
            for file in ("train.npz", "test.npz"):
                np.savez(tmp_path / name / file, images=split[0], labels=split[1])
        else:
            names = [str(k) for k in range(classes)]
            dataset = datasets.make_dataset(
                name, name, names, split, split, sources=("a", "b"), origin="arrays"
            )
            records.write_dataset(dataset, tmp_path / name, shards=1)
    workdir = tmp_path / "w"
    result = run_main(
        "--steps=2",
        "--batch_size=4",
        "--report=none",
        f"--config.dataset.name={source}",
        f"--data_dir={tmp_path / 'three'}",
        f"--workdir={workdir}",
    )
    assert result.returncode == 0, result.stderr
    with pytest.raises(UserError) as exc:
        inference.run_eval(workdir, data_dir=str(tmp_path / "five"))
    message = str(exc.value)
    assert "has 5 classes but the model was trained on 3" in message and "\n" not in message
    assert str(tmp_path / "five") in message


ESCAPES = ("\x1b[2J\x1b[31mred\x1b[0m", "\x1b]0;pwned\x07bell", "left\u202eright")


def test_table_cells_show_control_characters_escaped():
    table = tables.Table.of("Classes", ("", *ESCAPES), [(name, 1, 2, 3) for name in ESCAPES])
    text = table.format()
    assert not any(c in text for c in "\x1b\x07\u202e")
    assert "\\x1b[2J\\x1b[31mred\\x1b[0m" in text and "left\\u202eright" in text
    assert tables.printable("Ankle boot / Überzieher") == "Ankle boot / Überzieher"


def test_an_ensembles_test_value_is_labelled_its_own_not_the_members_mean(tmp_path):
    """The ensemble's test loss (of its mean probabilities) lay outside the members' range
    under a label that read as their mean."""
    row = {"step": 30, "loss": 0.59, "loss/0": 0.58, "loss/1": 0.6}
    row |= {"test_loss": 0.544, "test_loss/0": 0.5554, "test_loss/1": 0.6032}
    with (tmp_path / "log").open("w") as stream:
        tables.ProgressBar(30, stream).update(row)
    line = (tmp_path / "log").read_text()
    assert "  loss 0.5900 (0.5800-0.6000)  " in line  # a training metric: the members' mean
    assert line.endswith("  test_loss 0.5440 ensemble (members 0.5554-0.6032)\n")


@pytest.mark.slow
def test_class_names_with_escape_sequences_are_printed_escaped(tmp_path, capsys):
    """A classes.txt with terminal escape sequences: eval's confusion table and predict's
    lines printed them raw (the screen cleared, the window retitled)."""
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (12, 6, 5), dtype=np.uint8)
    data = tmp_path / "d"
    data.mkdir()
    for file in ("train.npz", "test.npz"):
        np.savez(data / file, images=images, labels=np.arange(12) % 3)
    (data / "classes.txt").write_text("\n".join(ESCAPES) + "\n")
    np.save(tmp_path / "x.npy", images[:3])
    workdir = tmp_path / "w"
    result = run_main(
        "--steps=2",
        "--batch_size=4",
        "--report=none",
        "--config.dataset.name=arrays",
        f"--data_dir={data}",
        f"--workdir={workdir}",
    )
    assert result.returncode == 0, result.stderr
    capsys.readouterr()
    inference.run_eval(workdir)
    inference.run_predict(workdir, [str(tmp_path / "x.npy")])
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x07\u202e")
    assert "\\x1b[2J" in out and "x.npy[0]: " in out


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
    Image.fromarray(real_dataset.test_images[0, ..., 0]).save(tmp_path / "a.png")
    big = np.kron(real_dataset.test_images[1, ..., 0], np.ones((3, 3), np.uint8))
    Image.fromarray(np.stack([big] * 3, -1)).save(tmp_path / "big_rgb.png")
    np.save(tmp_path / "many.npy", real_dataset.test_images[2:5])
    np.save(tmp_path / "wrong.npy", np.zeros((5, 5)))
    (tmp_path / "broken.png").write_bytes(b"not a png")
    images = ["a.png", "big_rgb.png", "many.npy", "wrong.npy", "broken.png", "missing.png"]
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "main.py"),
            "--mode=predict",
            f"--workdir={workdir}",
            "--images=" + ",".join(str(tmp_path / i) for i in images),
            f"--output={tmp_path / 'out.json'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
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
def test_eval_and_predict_say_which_checkpoint_they_read(quick_config, tmp_path, capsys):
    """predict did not say which checkpoint it classified with, and eval showed --step=best
    as "checkpoint 40", which reads as the newest. Both now name it, and why it was picked."""
    quick_config.steps, quick_config.eval_every, quick_config.keep_best = 60, 20, True
    quick_config.checkpoint_every, quick_config.max_to_keep = 20, 1
    workdir = tmp_path / "w"
    train.train_and_evaluate(quick_config, workdir)
    reader = checkpoint.open_reader(workdir)
    best = reader.best_steps()[0]
    reader.close()
    capsys.readouterr()
    shoe = str(REPO / "examples" / "shoe.png")
    inference.run_predict(workdir, [shoe], step="best")
    said = f"checkpoint {best} (best by test_accuracy) of {workdir} (float32):"
    assert capsys.readouterr().out.splitlines()[0] == said
    inference.run_predict(workdir, [shoe], output=str(tmp_path / "p.json"))
    assert capsys.readouterr().out.splitlines()[0] == f"checkpoint 60 of {workdir} (float32):"
    assert json.loads((tmp_path / "p.json").read_text())["step"] == 60
    inference.run_eval(workdir, step="best")
    assert capsys.readouterr().out.splitlines()[0] == said


def marking_module(directory: pathlib.Path, name: str, ran: pathlib.Path) -> pathlib.Path:
    """A module `name`.py in `directory` whose import creates the file it returns."""
    (directory / f"{name}.py").write_text(f"import pathlib\npathlib.Path({str(ran)!r}).touch()\n")
    return ran


def test_a_checkpoint_imports_installed_modules_only_never_the_workdirs_or_the_cwds(
    quick_config, tmp_path, monkeypatch, capsys, forget_modules
):
    """The modules a checkpoint's config.imports names are imported only from the installed
    environment, after one line naming them; one in the workdir or the current directory is
    refused in one line, even on the search path, and nothing at all is imported."""
    quick_config.steps = 2
    workdir = tmp_path / "w"
    train.train_and_evaluate(quick_config, workdir)
    here, site = tmp_path / "here", tmp_path / "site"
    here.mkdir(), site.mkdir()
    places = {"in_workdir": workdir, "in_cwd": here, "installed_plug_in": site}
    ran = {name: marking_module(d, name, tmp_path / f"{name}.ran") for name, d in places.items()}
    forget_modules += list(places)
    monkeypatch.chdir(here)
    for entry in (str(site), str(here), str(workdir), ""):  # as `python -m` or PYTHONPATH=.
        monkeypatch.syspath_prepend(entry)
    for name in ("in_workdir", "in_cwd"):
        edit_saved_configs(workdir, imports=["installed_plug_in", name])
        with pytest.raises(UserError) as refused:
            load_model(workdir)
        assert f"names config.imports {name}, not found among the installed modules" in str(
            refused.value
        )
        assert f"pass --config.imports=\"('{name}',)\"" in str(refused.value)
    assert not any(path.exists() for path in ran.values())
    edit_saved_configs(workdir, imports=["installed_plug_in"])
    capsys.readouterr()
    load_model(workdir)
    assert capsys.readouterr().out == (
        f"note: checkpoint 2 in {workdir / 'checkpoints'} names config.imports "
        "installed_plug_in; importing them runs their code\n"
    )
    assert ran["installed_plug_in"].exists() and not ran["in_workdir"].exists()
    load_model(workdir)  # imported already: no second note
    assert capsys.readouterr().out == ""


def test_a_checkpoint_never_imports_from_runs_or_any_workdir_on_the_search_path(
    quick_config, tmp_path, monkeypatch, forget_modules
):
    """A repository root on the import path (main.py's directory, or PYTHONPATH) makes its
    runs/ a namespace package: a checkpoint naming `runs.w.evil_mod` (a file dropped into
    a workdir there), `runs.evil_mod`, a module inside another workdir under a search path
    entry, or one in an entry that holds a workdir (PYTHONPATH=shared), is refused in one line
    from any current directory, and nothing is run; a module of the repository's own entry
    outside them is still imported."""
    repo, elsewhere = tmp_path / "repo", tmp_path / "elsewhere"
    workdir = repo / "runs" / "w"
    quick_config.steps = 2
    train.train_and_evaluate(quick_config, workdir)
    other = repo / "shared" / "w2"  # a workdir under a package directory of the entry
    shutil.copytree(workdir, other)
    elsewhere.mkdir()
    ran = {
        "runs.w.evil_mod": marking_module(workdir, "evil_mod", tmp_path / "w.ran"),
        "runs.evil_mod": marking_module(repo / "runs", "evil_mod", tmp_path / "runs.ran"),
        "shared.w2.evil_mod": marking_module(other, "evil_mod", tmp_path / "w2.ran"),
        "loose_mod": marking_module(repo / "shared", "loose_mod", tmp_path / "loose.ran"),
    }
    kept = marking_module(repo, "beside_main", tmp_path / "beside.ran")
    forget_modules += ["runs", "runs.w", "shared", "shared.w2", *ran, "beside_main"]
    monkeypatch.syspath_prepend(str(repo))
    monkeypatch.syspath_prepend(str(repo / "shared"))  # PYTHONPATH=shared, beside w2
    for cwd in (elsewhere, workdir):
        monkeypatch.chdir(cwd)
        for name in ran:
            edit_saved_configs(workdir, imports=[name])
            with pytest.raises(UserError, match=f"names config.imports {name}, not found among"):
                load_model(workdir)
    assert not any(path.exists() for path in ran.values())
    monkeypatch.chdir(elsewhere)
    edit_saved_configs(workdir, imports=["beside_main"])
    load_model(workdir)
    assert kept.exists()


@pytest.mark.slow
def test_eval_of_a_workdir_under_the_repositorys_runs_never_runs_its_module(workdir, tmp_path):
    """`python <repo>/main.py --mode=eval --workdir=<repo>/runs/w`, from another directory or
    from inside the workdir: main.py's directory is on the import path, so `runs.w.evil_mod`
    was imported from the workdir. Now one line, and the module never runs."""
    repo = tmp_path / "repo"
    (repo / "runs").mkdir(parents=True)
    shutil.copy(REPO / "main.py", repo / "main.py")
    copy = repo / "runs" / "w"
    shutil.copytree(workdir, copy)
    edit_saved_configs(copy, imports=["runs.w.evil_mod"])
    ran = marking_module(copy, "evil_mod", tmp_path / "evil_mod.ran")
    for cwd, flag in ((tmp_path, f"--workdir={copy}"), (copy, "--workdir=.")):
        refused = run_main("--mode=eval", flag, cwd=cwd, script=repo / "main.py")
        assert_one_line_error(refused, "names config.imports runs.w.evil_mod, not found among")
    assert not ran.exists()


@pytest.mark.slow
def test_eval_inside_a_workdir_never_runs_a_module_its_checkpoint_names(workdir, tmp_path):
    """`python -m fmnist_flax --mode=eval --workdir=.` inside a workdir whose checkpoint names
    a module the workdir holds: one line, the module not run; named on the command line, it
    is the user's to run."""
    copy = tmp_path / "w"
    shutil.copytree(workdir, copy)
    edit_saved_configs(copy, imports=["this", "evil_mod"])
    ran = marking_module(copy, "evil_mod", tmp_path / "evil_mod.ran")
    command = [sys.executable, "-m", "fmnist_flax", "--mode=eval", "--workdir=."]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    refused = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True)
    assert_one_line_error(refused, "names config.imports evil_mod, not found among the installed")
    assert "Zen of Python" not in refused.stdout and not ran.exists()
    trusted = subprocess.run(
        [*command, "--config.imports=('evil_mod',)"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
    )
    assert trusted.returncode == 0, trusted.stderr
    assert ran.exists()
    assert "names config.imports this; importing them runs their code" in trusted.stdout


@pytest.mark.slow
def test_predict_without_images_or_workdir_is_one_line(tmp_path):
    with pytest.raises(UserError, match="needs --images"):
        inference.run_predict(tmp_path, [])
    result = run_main("--mode=eval")
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "error: --mode=eval needs --workdir=DIR of a training run"
    ]


def test_read_images_takes_pngs_and_arrays_of_the_models_size(tmp_path):
    Image.fromarray(np.full((28, 28), 255, np.uint8)).save(tmp_path / "white.png")
    [(name, pixels)], notes = inference.read_images(tmp_path / "white.png")
    assert name.endswith("white.png") and notes == [] and pixels.max() == 1.0
    Image.fromarray(np.zeros((40, 30, 3), np.uint8)).save(tmp_path / "rgb.png")
    [(_, pixels)], notes = inference.read_images(tmp_path / "rgb.png", (12, 12, 1))
    assert pixels.shape == (12, 12, 1) and len(notes) == 2  # converted and resized, each noted
    np.save(tmp_path / "three.npy", np.zeros((3, 12, 12), np.uint8))
    images, _ = inference.read_images(tmp_path / "three.npy", (12, 12, 1))
    assert [n for n, _ in images][-1].endswith("three.npy[2]")
    with pytest.raises(UserError, match=r"expected \(28, 28\) or \(N, 28, 28\)"):
        inference.read_images(tmp_path / "three.npy")


def test_pictures_take_the_models_channels_with_a_note(tmp_path):
    """For a colour model: RGB as it is, RGBA without its alpha, grayscale copied to each
    channel, another size resized per channel; for a grayscale one, colour converted."""
    rgb = np.random.default_rng(5).integers(0, 256, (8, 6, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "rgb.png")
    Image.fromarray(np.dstack([rgb, np.full((8, 6), 9, np.uint8)])).save(tmp_path / "rgba.png")
    Image.fromarray(rgb[..., 0]).save(tmp_path / "grey.png")
    shape = (8, 6, 3)
    [(_, pixels)], notes = inference.read_images(tmp_path / "rgb.png", shape)
    assert notes == [] and pixels.shape == shape
    np.testing.assert_array_equal(pixels, rgb * np.float32(1 / 255))
    [(name, pixels)], notes = inference.read_images(tmp_path / "rgba.png", shape)
    assert notes == [f"{name}: converted from RGBA to RGB (alpha dropped)"]
    np.testing.assert_array_equal(pixels, rgb * np.float32(1 / 255))
    [(name, pixels)], notes = inference.read_images(tmp_path / "grey.png", shape)
    assert notes == [f"{name}: converted from grayscale (L) to RGB"]
    assert all(np.array_equal(pixels[..., c], pixels[..., 0]) for c in range(3))
    [(name, pixels)], notes = inference.read_images(tmp_path / "rgb.png", (4, 3, 3))
    assert notes == [f"{name}: resized from 6x8 to 3x4"] and pixels.shape == (4, 3, 3)
    assert pixels.min() >= 0 and pixels.max() <= 1
    [(name, pixels)], notes = inference.read_images(tmp_path / "rgba.png", (8, 6, 1))
    assert notes == [f"{name}: converted from RGBA to grayscale (alpha dropped)"]
    assert pixels.shape == (8, 6, 1)
    np.save(tmp_path / "one.npy", rgb)
    np.save(tmp_path / "two.npy", np.stack([rgb, rgb]))
    assert len(inference.read_images(tmp_path / "one.npy", shape)[0]) == 1
    assert len(inference.read_images(tmp_path / "two.npy", shape)[0]) == 2
    with pytest.raises(UserError, match=r"shape \(8, 6, 3\); expected \(8, 6\) or \(N, 8, 6\)"):
        inference.read_images(tmp_path / "one.npy", (8, 6, 1))
    with pytest.raises(UserError, match=r"expected \(4, 6, 3\) or \(N, 4, 6, 3\) or \(N, 72\)"):
        inference.read_images(tmp_path / "one.npy", (4, 6, 3))
    with pytest.raises(UserError, match="2-channel images, which no picture format holds"):
        inference.read_images(tmp_path / "rgb.png", (8, 6, 2))


@pytest.fixture(scope="module")
def model():
    return MLP(rngs=nnx.Rngs(0))  # untrained: 28x28 in, 10 classes out


def refusal(call, *args, **kwargs) -> str:
    """The message of the UserError `call` raises, checked to be one line."""
    with pytest.raises(UserError) as exc:
        call(*args, **kwargs)
    message = str(exc.value)
    assert "\n" not in message
    return message


def images_of(path, shape=(28, 28, 1)) -> np.ndarray:
    """--mode=predict's reading of a file, stacked as run_predict stacks it."""
    named, _ = inference.read_images(path, shape)
    return np.stack([image for _, image in named])


def png_header(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims an 8-bit grayscale image of any size: the claim is all a
    reader sees before it decodes (the one row of pixels it holds would fail to decode)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + data))
        return struct.pack(">I", len(data)) + kind + data + crc

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 9))
        + chunk(b"IEND", b"")
    )


def test_nan_or_infinite_pixels_are_refused_with_their_count(model, tmp_path):
    one = np.full((28, 28), 0.5, np.float32)
    one[3, 4] = np.nan
    np.save(tmp_path / "nan.npy", one)
    three = np.zeros((2, 28, 28), np.float64)
    three[0, 0, 0], three[1, 5, 5], three[1, 6, 6] = np.nan, np.inf, -np.inf
    np.save(tmp_path / "three.npy", three)
    rule = "(NaN or infinity); every pixel must be a number in [0, 1]"
    assert refusal(inference.read_images, tmp_path / "nan.npy") == (
        f"{tmp_path / 'nan.npy'}: 1 non-finite pixel value {rule}"
    )
    assert refusal(inference.read_images, tmp_path / "three.npy") == (
        f"{tmp_path / 'three.npy'}: 3 non-finite pixel values {rule}"
    )
    assert refusal(predict, model, one) == f"images: 1 non-finite pixel value {rule}"
    assert (
        refusal(predict, model, three.reshape(2, 784))
        == f"images: 3 non-finite pixel values {rule}"
    )
    Image.fromarray(one).save(tmp_path / "nan.tiff")  # a float (mode F) image file
    assert refusal(inference.read_images, tmp_path / "nan.tiff") == (
        f"{tmp_path / 'nan.tiff'}: 1 non-finite pixel value {rule}"
    )


def test_16_bit_png_is_scaled_by_its_own_range_not_clipped(model, tmp_path):
    eight = np.random.default_rng(0).integers(0, 256, (28, 28), dtype=np.uint8)
    sixteen = eight.astype(np.uint16) * 257  # the same shades at 16 bits: 255 -> 65535
    sixteen[0, 0] = 300  # 8-bit clipping would make this white; it is nearly black
    Image.fromarray(sixteen).save(tmp_path / "deep.png")
    assert Image.open(tmp_path / "deep.png").mode == "I;16"
    [(name, pixels)], notes = inference.read_images(tmp_path / "deep.png")
    assert notes == [f"{name}: 16-bit grayscale (I;16) scaled by 1/65535 to [0, 1]"]
    assert pixels.dtype == np.float32 and pixels[0, 0] == np.float32(300) / np.float32(65535)
    expected = eight.astype(np.float32) * PIXEL_SCALE
    np.testing.assert_allclose(pixels.ravel()[1:], expected.ravel()[1:], atol=1e-7)
    assert len(np.unique(pixels)) > 2  # shades, not a binarised image
    np.testing.assert_allclose(
        predict(model, pixels), predict(model, sixteen.astype(np.float32) / 65535), atol=1e-6
    )


def test_float_pixels_must_lie_in_0_1_and_are_never_rescaled(model, tmp_path):
    pixels = (np.random.default_rng(1).random((2, 28, 28)) * 0.5 + 0.25).astype(np.float32)
    np.save(tmp_path / "good.npy", pixels)
    np.testing.assert_array_equal(images_of(tmp_path / "good.npy")[..., 0], pixels)  # as they are
    pixels[1, 2, 3] = 1.5  # one pixel above 1 used to divide the whole file by 255
    pixels[0, 0, 0] = np.float32(0.1) / 3  # the minimum, shown as float32 shows it
    np.save(tmp_path / "one_above.npy", pixels)
    advice = "divide 0..255 values by 255 first (or pass them as uint8)"
    assert refusal(inference.read_images, tmp_path / "one_above.npy") == (
        f"{tmp_path / 'one_above.npy'}: float pixels must lie in [0, 1] but these range over "
        f"[0.033333335, 1.5]; {advice}"
    )
    assert refusal(predict, model, pixels) == (
        f"images: float pixels must lie in [0, 1] but these range over [0.033333335, 1.5]; {advice}"
    )
    assert refusal(predict, model, np.full((28, 28), 255.0)) == (
        f"images: float pixels must lie in [0, 1] but these range over [255.0, 255.0]; {advice}"
    )
    assert refusal(predict, model, np.full((28, 28), -0.25, np.float16)).startswith(
        "images: float pixels must lie in [0, 1] but these range over [-0.25, -0.25]"
    )


def test_integer_pixels_are_0_to_255_whatever_their_dtype(model, tmp_path):
    u8 = np.random.default_rng(2).integers(0, 256, (3, 28, 28), dtype=np.uint8)
    scaled = u8.astype(np.float32) * PIXEL_SCALE
    for dtype in (np.uint8, np.int16, np.uint16, np.int64):
        np.save(tmp_path / "ints.npy", u8.astype(dtype))
        np.testing.assert_array_equal(
            images_of(tmp_path / "ints.npy").reshape(3, -1), scaled.reshape(3, -1)
        )
        np.testing.assert_array_equal(
            inference.model_input(u8.astype(dtype), (28, 28, 1)), scaled.reshape(3, 28, 28, 1)
        )
    wide = u8.astype(np.uint16)
    wide[0, 0, 0] = 300
    np.save(tmp_path / "wide.npy", wide)
    assert refusal(inference.read_images, tmp_path / "wide.npy") == (
        f"{tmp_path / 'wide.npy'}: integer pixels must lie in 0..255 but these range over "
        f"{u8.min()}..300; scale them to 0..255 (uint8) or to floats in [0, 1] first"
    )
    assert refusal(predict, model, np.full((28, 28), -1, np.int8)) == (
        "images: integer pixels must lie in 0..255 but these range over -1..-1; scale them to "
        "0..255 (uint8) or to floats in [0, 1] first"
    )


def test_bool_complex_string_and_object_pixels_are_refused(model, tmp_path):
    advice = "cannot be used; pass uint8 (0..255), other integers in 0..255 or floats in [0, 1]"
    for array in (
        np.zeros((28, 28), bool),
        np.zeros((28, 28), np.complex64),
        np.full((28, 28), "a"),
        np.zeros((28, 28), "m8[s]"),  # timedelta64 passes np.issubdtype(..., np.integer)
    ):
        np.save(tmp_path / "odd.npy", array)
        assert refusal(inference.read_images, tmp_path / "odd.npy") == (
            f"{tmp_path / 'odd.npy'}: pixels of dtype {array.dtype} {advice}"
        )
        assert refusal(predict, model, array) == f"images: pixels of dtype {array.dtype} {advice}"
    objects = np.empty((28, 28), object)
    objects[...] = 0
    assert refusal(predict, model, objects) == f"images: pixels of dtype object {advice}"
    np.save(tmp_path / "objects.npy", objects, allow_pickle=True)
    assert refusal(inference.read_images, tmp_path / "objects.npy").startswith(
        f"{tmp_path / 'objects.npy'}: cannot read it as a .npy array ("
    )


def test_predict_takes_one_image_a_stack_or_rows_and_refuses_other_shapes(model, tmp_path):
    images = np.random.default_rng(3).integers(0, 256, (3, 28, 28), dtype=np.uint8)
    stack = predict(model, images)
    assert stack.shape == (3, 10)
    np.testing.assert_array_equal(predict(model, images.reshape(3, 784)), stack)
    one = predict(model, images[1])  # a batch of 1: XLA may sum in another order
    np.testing.assert_allclose(one, stack[1:2], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(predict(model, images[1].tolist()), one)
    for shape in ((5, 5), (784,), (3, 28, 28, 2), (2, 783), (28, 29), ()):
        assert refusal(predict, model, np.zeros(shape, np.uint8)) == (
            f"images: array shape {shape}; {SHAPES}"
        )
    np.save(tmp_path / "wrong.npy", np.zeros((2, 5, 5)))
    assert refusal(inference.read_images, tmp_path / "wrong.npy") == (
        f"{tmp_path / 'wrong.npy'}: array shape (2, 5, 5); {SHAPES}"
    )
    assert refusal(predict, model, [np.zeros((28, 28)), np.zeros(3)]).startswith(
        "images: cannot be made into one array ("
    )


def test_an_empty_array_is_refused(model, tmp_path):
    np.save(tmp_path / "empty.npy", np.zeros((0, 28, 28), np.uint8))
    assert refusal(inference.read_images, tmp_path / "empty.npy") == (
        f"{tmp_path / 'empty.npy'}: no images in it (shape (0, 28, 28)); {SHAPES} with N >= 1"
    )
    assert refusal(predict, model, np.zeros((0, 784), np.float32)) == (
        f"images: no images in it (shape (0, 784)); {SHAPES} with N >= 1"
    )


def test_cli_files_and_the_python_api_give_identical_probabilities(model, tmp_path):
    u8 = np.random.default_rng(4).integers(0, 256, (4, 28, 28), dtype=np.uint8)
    for i, image in enumerate(u8):
        Image.fromarray(image).save(tmp_path / f"{i}.png")
    np.save(tmp_path / "all.npy", u8)
    np.save(tmp_path / "rows.npy", u8.reshape(4, 784).astype(np.int32))
    np.save(tmp_path / "floats.npy", u8.astype(np.float32) * PIXEL_SCALE)
    expected = predict(model, u8)
    from_pngs = np.stack([images_of(tmp_path / f"{i}.png")[0] for i in range(4)])
    for read in (
        from_pngs,
        images_of(tmp_path / "all.npy"),
        images_of(tmp_path / "rows.npy"),
        images_of(tmp_path / "floats.npy"),
    ):
        np.testing.assert_array_equal(inference.predict(model, read), expected)
    np.testing.assert_array_equal(predict(model, u8.astype(np.float32) * PIXEL_SCALE), expected)
    np.testing.assert_allclose(predict(model, u8 / 255.0), expected, atol=1e-6)
    np.testing.assert_array_equal(predict(model, u8, image_shape=(28, 28, 1)), expected)


def test_an_animated_picture_is_read_from_its_first_frame_with_a_note(tmp_path):
    """An animated GIF was classified by its first frame without a word; it now says so."""
    frames = [Image.fromarray(np.full((28, 28), value, np.uint8)) for value in (0, 255, 128)]
    frames[0].save(tmp_path / "moving.gif", save_all=True, append_images=frames[1:])
    [(name, pixels)], notes = inference.read_images(tmp_path / "moving.gif")
    converted = f"{name}: converted from P to grayscale"  # a GIF's palette
    assert notes == [f"{name}: 3 frames; only the first is classified", converted]
    assert pixels.max() == 0.0  # the first frame's
    frames[0].save(tmp_path / "still.gif")
    [(name, _)], notes = inference.read_images(tmp_path / "still.gif")
    assert notes == [f"{name}: converted from P to grayscale"]


def test_a_resized_colour_png_is_noted_and_stays_in_0_1(tmp_path):
    rgb = np.random.default_rng(5).integers(0, 256, (40, 30, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(tmp_path / "rgb.png")
    [(name, pixels)], notes = inference.read_images(tmp_path / "rgb.png")
    assert notes == [
        f"{name}: converted from RGB to grayscale",
        f"{name}: resized from 30x40 to 28x28",
    ]
    assert pixels.shape == (28, 28, 1) and pixels.dtype == np.float32
    assert pixels.min() >= 0 and pixels.max() <= 1


def test_oversized_and_decompression_bomb_images_are_refused_before_decoding(tmp_path, monkeypatch):
    (tmp_path / "bomb.png").write_bytes(png_header(100_000, 100_000))  # 10^10 pixels claimed
    message = refusal(inference.read_images, tmp_path / "bomb.png")
    assert re.fullmatch(
        re.escape(f"{tmp_path / 'bomb.png'}: refused as a possible decompression bomb (")
        + r"Image size \(10000000000 pixels\) exceeds limit of \d+ pixels.*\)",
        message,
    ), message
    (tmp_path / "wide.png").write_bytes(png_header(5000, 10))  # under PIL's limits, over ours
    assert refusal(inference.read_images, tmp_path / "wide.png") == (
        f"{tmp_path / 'wide.png'}: 5000x10 pixels; images larger than 4096x4096 are refused, "
        "shrink it first"
    )
    Image.new("L", (40, 40)).save(tmp_path / "modest.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # 1600 pixels: PIL only warns
    message = refusal(inference.read_images, tmp_path / "modest.png")
    assert message.startswith(
        f"{tmp_path / 'modest.png'}: refused as a possible decompression bomb (Image size (1600 "
    ), message


def test_an_array_too_large_to_classify_is_refused_from_its_header(tmp_path):
    """A .npy of 200,000,000 images (a sparse file: 157 GB declared, nothing stored) was a
    MemoryError traceback when its pixels were converted. Its header is now weighed against
    the host's memory before a pixel is read, in one line naming the file; a small one
    after it in the same command is still classified."""
    huge = tmp_path / "huge.npy"
    array = np.lib.format.open_memmap(huge, mode="w+", dtype=np.uint8, shape=(200_000_000, 28, 28))
    del array
    message = refusal(inference.read_images, huge)
    assert message.startswith(f"{huge}: an array of shape (200000000, 28, 28) "), message
    assert "available" in message and "split its images into smaller files" in message, message
    np.save(tmp_path / "small.npy", np.zeros((2, 28, 28), np.uint8))
    assert len(inference.read_images(tmp_path / "small.npy")[0]) == 2


def test_unreadable_files_are_one_line_each(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not a png")
    (tmp_path / "broken.npy").write_bytes(b"not an array")
    valid = tmp_path / "cut.png"
    Image.fromarray(np.random.default_rng(6).integers(0, 256, (28, 28), np.uint8)).save(valid)
    valid.write_bytes(valid.read_bytes()[:400])  # cut inside the pixel data
    np.savez(tmp_path / "archive.npz", a=np.zeros((28, 28), np.uint8))
    (tmp_path / "archive.npz").rename(tmp_path / "archive.npy")
    os.mkfifo(tmp_path / "fifo.png")  # nobody writes to it: reading it would wait for ever
    (tmp_path / "folder.npy").mkdir()
    for name, start in (
        ("fifo.png", "not a regular file (a directory, a FIFO or a device)"),
        ("folder.npy", "not a regular file (a directory, a FIFO or a device)"),
        ("broken.png", "cannot read it as an image ("),
        ("broken.npy", "cannot read it as a .npy array ("),
        ("cut.png", "cannot read it as an image ("),
        ("missing.png", "cannot read it as an image ("),
        ("archive.npy", "is an .npz archive, not a .npy array; save one array with np.save"),
    ):
        assert refusal(inference.read_images, tmp_path / name).startswith(
            f"{tmp_path / name}: {start}"
        )


def test_an_output_that_is_a_directory_is_refused_before_any_work(tmp_path):
    Image.new("L", (28, 28)).save(tmp_path / "a.png")
    message = refusal(
        inference.run_predict,
        tmp_path / "no-such-workdir",
        [str(tmp_path / "a.png")],
        output=str(tmp_path),
    )
    assert message.startswith(f"--output {tmp_path} is a directory")  # not the workdir's error
    message = refusal(
        inference.run_predict,
        tmp_path / "no-such-workdir",
        [str(tmp_path / "a.png")],
        output=str(tmp_path / "missing" / "p.json"),
    )
    assert message.startswith(f"--output {tmp_path / 'missing' / 'p.json'}")


def test_a_failed_output_write_leaves_no_temporary_file(tmp_path):
    output = tmp_path / "p.json"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail: EFBIG
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, limit[1]))
        message = refusal(workdir_lib.write_json, output, {"predictions": ["x" * 1000]})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    assert message.startswith(f"cannot write {output} (File too large")
    assert list(tmp_path.iterdir()) == []


def test_an_output_replaced_by_a_directory_leaves_no_temporary_file(tmp_path):
    output = tmp_path / "p.json"
    output.mkdir()  # appears after check_output_path ran: the rename is what fails
    assert refusal(workdir_lib.write_json, output, {"predictions": []}).startswith(
        f"cannot write {output} ("
    )
    assert [p.name for p in tmp_path.iterdir()] == ["p.json"]


@pytest.fixture(scope="module")
def diverged_workdir(tmp_path_factory, real_dataset):
    """A workdir whose step 1 has finite parameters and a non-finite EMA, and whose step 2 has
    non-finite parameters: what an edited checkpoint or a run that diverged would leave."""
    import jax.numpy as jnp
    from conftest import load_config

    from fmnist_flax import train
    from fmnist_flax.runtime import checkpoint, parallel

    workdir = tmp_path_factory.mktemp("diverged") / "w"
    config = load_config("default")
    config.ema.decay = 0.9
    info = {"config": config.to_dict(), "dataset": real_dataset.info()}
    saved = checkpoint.Checkpoints(workdir, max_to_keep=3, metadata=info)
    model, optimizer = train.create_train_state(
        config, real_dataset.image_shape, real_dataset.num_classes, parallel.mesh_for(config)
    )
    for step, variable in ((1, model.layers[0].kernel_ema), (2, model.layers[0].kernel)):
        variable[...] = jnp.full_like(variable[...], jnp.nan)
        saved.save(step, model, optimizer, Schedule(config, 117).progress(step))
        saved.wait()
    saved.close()
    return workdir


def test_a_model_that_is_not_finite_is_refused_in_one_line(diverged_workdir):
    with pytest.raises(UserError) as exc:
        load_model(diverged_workdir)
    assert str(exc.value) == (
        f"--workdir {diverged_workdir}: the parameters of step 2 are not all finite; pass "
        "--step=N of an earlier checkpoint, or train again with a lower --learning_rate"
    )
    params = nnx.state(load_model(diverged_workdir, step=1), nnx.Param)
    assert all(np.isfinite(a).all() for a in jax.tree.leaves(params))  # its EMA is not
    with pytest.raises(UserError, match="the EMA of the parameters of step 1 are not all finite"):
        load_model(diverged_workdir, step=1, ema=True)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["eval", "predict", "export"])
def test_eval_predict_and_export_of_a_non_finite_model_are_one_line(
    diverged_workdir, mode, tmp_path
):
    np.save(tmp_path / "one.npy", np.zeros((28, 28), np.uint8))
    flags = {
        "eval": [f"--output={tmp_path / 'eval.json'}"],
        "predict": [f"--images={tmp_path / 'one.npy'}"],
        "export": [f"--output={tmp_path / 'model.jaxexport'}"],
    }[mode]
    result = run_main(f"--mode={mode}", f"--workdir={diverged_workdir}", *flags)
    line = assert_one_line_error(result, "the parameters of step 2 are not all finite")
    assert line.startswith(f"error: --workdir {diverged_workdir}: "), line
    assert not list(tmp_path.glob("eval.json")) + list(tmp_path.glob("model.jaxexport"))


@pytest.mark.slow
def test_the_readmes_predict_command_runs_on_the_shipped_examples(workdir, real_dataset):
    """examples/ holds what the README's predict command names, made from the real test set;
    the command runs as written from the repository root (its workdir aside)."""
    shoe = np.asarray(Image.open(REPO / "examples" / "shoe.png"))
    np.testing.assert_array_equal(shoe, real_dataset.test_images[9, ..., 0])
    assert CLASS_NAMES[real_dataset.test_labels[9]] == "Sneaker"
    batch = np.load(REPO / "examples" / "batch.npy")
    np.testing.assert_array_equal(batch, real_dataset.test_images[:8, ..., 0])
    readme = (REPO / "README.md").read_text()
    command = next(line for line in readme.splitlines() if "--mode=predict" in line)
    args = command.split()[2:]  # after `.venv/bin/python main.py`
    args = [f"--workdir={workdir}" if a.startswith("--workdir=") else a for a in args]
    result = run_main(*args)
    assert result.returncode == 0 and not result.stderr.replace("No GPU found", "").count(
        "error"
    ), result.stderr
    lines = result.stdout.splitlines()
    assert len([line for line in lines if line.startswith("examples/")]) == 9, result.stdout


@pytest.mark.slow
def test_a_mostly_bright_picture_gets_a_warning_with_its_result(workdir, real_dataset, tmp_path):
    """A dark garment on white (the negative of what the model learnt) is still classified,
    with one warning line that says to invert it; the test set's own pictures get none."""
    Image.fromarray(255 - real_dataset.test_images[9, ..., 0]).save(tmp_path / "negative.png")
    Image.fromarray(real_dataset.test_images[9, ..., 0]).save(tmp_path / "positive.png")
    paths = f"{tmp_path / 'negative.png'},{tmp_path / 'positive.png'}"
    result = run_main("--mode=predict", f"--workdir={workdir}", f"--images={paths}")
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "negative.png is mostly bright" in warnings[0], result.stderr
    assert "invert the picture" in warnings[0]
    assert len([line for line in result.stdout.splitlines() if ".png: " in line]) == 2


def test_a_checkpoint_that_records_no_dataset_is_read_as_fashion_mnist(tmp_path, real_dataset):
    """Checkpoints saved before they recorded their dataset all trained on Fashion-MNIST: the
    template hands the runtime that dataset's classes and shape for them."""
    from conftest import load_config

    from fmnist_flax.runtime import checkpoint, parallel

    config = load_config("default")
    saved = checkpoint.Checkpoints(tmp_path, max_to_keep=1, metadata={"config": config.to_dict()})
    model, optimizer = train.create_train_state(config, (28, 28, 1), 10, parallel.mesh_for(config))
    saved.save(1, model, optimizer, Schedule(config, 117).progress(1))
    saved.wait()
    saved.close()
    assert inference.class_names(tmp_path) == tuple(real_dataset.class_names) == CLASS_NAMES
    probabilities = predict(load_model(tmp_path), real_dataset.test_images[:2])
    assert probabilities.shape == (2, 10)


@pytest.mark.slow
def test_load_model_in_a_notebook_prints_nothing_when_nothing_is_wrong(workdir):
    """A fresh interpreter (no command line, so no log filters installed): load_model and
    predict print no line, Orbax's notices that a reader is read-only included."""
    script = (
        "import numpy as np\nfrom fmnist_flax import load_model, predict\n"
        f"model = load_model({str(workdir)!r})\n"
        "print(predict(model, np.zeros((2, 28, 28), np.uint8)).shape)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0 and done.stdout == "(2, 10)\n", done.stderr
    assert done.stderr == ""
