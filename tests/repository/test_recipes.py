"""What the template promises whoever copies it: one-way imports, a golden first step, a
trainer that survives deleting the codelab, and the guide's recipes working when followed
literally (they are read from docs/extending.md, so the guide cannot rot)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
from conftest import (
    EVERY_DUE_SAVE,
    REPO,
    MainServer,
    assert_one_line_error,
    assert_same_models,
    idx_bytes,
)
from PIL import Image

from fmnist_flax import load_model, predict
from fmnist_flax.runtime import summaries

PACKAGE = REPO / "fmnist_flax"


# --- The template as a user copies it -------------------------------------------------------


def copy_project(tmp_path: pathlib.Path, whole: bool = False) -> pathlib.Path:
    """The package, main.py and configs/ in a fresh directory, as someone copying it has;
    `whole`: every file git tracks (tests, docs, pyproject.toml, scripts) too."""
    root = tmp_path / "project"
    if whole:
        tracked = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split("\0")
        for name in filter(None, tracked):
            if (REPO / name).is_file():
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(REPO / name, root / name)
        return root
    no_bytecode = shutil.ignore_patterns("__pycache__")  # a recipe's edit could keep a size
    shutil.copytree(PACKAGE, root / "fmnist_flax", ignore=no_bytecode)
    shutil.copytree(REPO / "configs", root / "configs", ignore=no_bytecode)
    shutil.copy(REPO / "main.py", root)
    return root


def bare_python(root: pathlib.Path) -> pathlib.Path:
    """A virtual environment beside a copied project with this one's libraries and no install
    of this checkout: site-packages is on its path, but its .pth files (an editable install's
    finder among them) are not run, so its processes and theirs import only the copy."""
    venv = root / ".bare-venv"
    if not venv.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
        [site] = (venv / "lib").glob("python*/site-packages")
        (site / "libraries.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin" / "python"


def isolated(root: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    """`python ARGS` in a copied project, seeing its own package only (`bare_python`); main.py
    forked from a server of the project's own (`conftest.MainServer`), which imports the
    libraries only: the project's files are read by each command, after the test's edits."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if args[0] == "main.py":
        server = MainServer.running(bare_python(root), root, env)
        return server.run(list(args[1:]), root, timeout=600)
    return subprocess.run(
        [bare_python(root), *args], cwd=root, env=env, capture_output=True, text=True
    )


def run(root: pathlib.Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`python main.py ARGS` in a copied project."""
    done = isolated(root, "main.py", *args)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def rows_of(workdir: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def summary_of(workdir: pathlib.Path) -> dict:
    return json.loads((workdir / "summary.json").read_text())


QUICK = (
    "--steps=20",
    "--log_every=10",
    "--checkpoint_every=10",
    "--batch_size=128",
    EVERY_DUE_SAVE,
)


# --- docs/extending.md, followed literally ---------------------------------------------------

GUIDE = REPO / "docs" / "extending.md"
RECIPES = GUIDE.parent / "recipes"  # the guide's longer files, each where a project puts it
STEP = re.compile(
    r"<!-- test: (?P<action>[\w-]+) (?P<path>\S+)(?: \| (?P<anchor>.*?))? -->\n"
    r"(?:```\w*\n(?P<body>.*?)```)?",
    re.S,
)


def recipe(name: str) -> str:
    """The text of the guide's section whose heading (any level) starts with `name`, up to the
    next heading of its level or above; `#` lines inside code blocks are not headings."""
    lines = GUIDE.read_text().splitlines(keepends=True)
    fenced, start, level = False, None, 0
    for i, line in enumerate(lines):
        fenced = fenced != line.startswith("```")
        heading = None if fenced else re.match(r"(#+) ", line)
        if heading and start is None and line[heading.end() :].startswith(name):
            start, level = i, len(heading[1])
        elif heading and start is not None and len(heading[1]) <= level:
            return "".join(lines[start:i])
    assert start is not None, f"docs/extending.md has no heading {name!r}"
    return "".join(lines[start:])


def follow(section: str, root: pathlib.Path, **values: str) -> list[subprocess.CompletedProcess]:
    """Apply each annotated code block of a guide section to the project at `root`: create,
    insert before or after the line holding the anchor, or replace that line; `run` executes
    the block's commands (`python main.py ...` or a script an earlier block created, `{NAME}`
    filled from `values`); `delete` carries out its `rm` lines. `copy recipes/PATH` (no
    block) copies the guide's file docs/recipes/PATH to PATH in the project."""
    results = []
    for step in STEP.finditer(section):
        action, anchor, body = step["action"], step["anchor"], step["body"]
        if action == "copy":
            assert f"]({step['path']})" in section, f"the guide links {step['path']} where used"
            source = GUIDE.parent / step["path"]
            target = root / source.relative_to(RECIPES)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, target)
            continue
        assert body is not None, f"{step[0]!r} needs a code block after it"
        if action in ("run", "delete"):
            for line in body.strip().splitlines():
                words = shlex.split(line.format(**values))  # as a shell reads the line
                if action == "delete":
                    assert words[0] == "rm", line
                    for name in words[1:]:
                        target = root / name
                        if name != "-r" and target.is_dir():
                            shutil.rmtree(target)
                        elif target.is_file():
                            target.unlink()
                    continue
                assert words[0] == "python" and (root / words[1]).is_file(), line
                results.append(isolated(root, *words[1:]))
                assert results[-1].returncode == 0, results[-1].stderr[-3000:]
            continue
        path = root / step["path"]
        if action == "create":
            path.write_text(body)
            continue
        lines = path.read_text().splitlines(keepends=True)
        [at] = [i for i, line in enumerate(lines) if anchor in line][:1]
        new = {
            "insert-before": [body, lines[at]],
            "insert-after": [lines[at], body],
            "replace": [body],
        }[action]
        path.write_text("".join(lines[:at] + new + lines[at + 1 :]))
    return results


def write_idx_dataset(directory: pathlib.Path, shape=(12, 12), classes=("cat", "dog", "fish")):
    """A small IDX dataset of another image size with its own classes.txt."""
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for stem, n in (("train", 96), ("t10k", 30)):
        labels = np.arange(n) % len(classes)
        images = rng.integers(0, 60, (n, *shape)).astype(np.uint8)
        images[:, : shape[0] // 2 * 1] += (labels * 60).astype(np.uint8)[:, None, None]
        (directory / f"{stem}-images-idx3-ubyte").write_bytes(idx_bytes(images))
        (directory / f"{stem}-labels-idx1-ubyte").write_bytes(idx_bytes(labels.astype(np.uint8)))
    (directory / "classes.txt").write_text("\n".join(classes) + "\n")


def write_png_folders(directory: pathlib.Path) -> None:
    """train/ and test/, a folder of 16x16 RGB PNGs per class: bright or dark squares."""
    rng = np.random.default_rng(1)
    for split, n in (("train", 48), ("test", 16)):
        for label, name in enumerate(("dark", "bright")):
            (directory / split / name).mkdir(parents=True)
            for i in range(n // 2):
                pixels = rng.integers(0, 80, (16, 16, 3), dtype=np.uint8) + 150 * label
                Image.fromarray(pixels.astype(np.uint8)).save(directory / split / name / f"{i}.png")


@pytest.fixture
def project(tmp_path):
    """A copied project, its data directory and the values the guide's commands take."""
    root = copy_project(tmp_path)
    values = {"DATA_DIR": str(root / "data"), "WORKDIR": str(root / "runs")}
    yield root, values
    MainServer.stop(root)


@pytest.mark.slow
def test_the_metric_model_config_and_idx_recipes(project):
    root, values = project
    write_idx_dataset(root / "data" / "pets")
    np.save(root / "pets.npy", np.zeros((2, 12, 12), np.uint8))
    assert follow(recipe("Add a metric"), root, **values) == []
    assert follow(recipe("Add a model"), root, **values) == []
    [config_run] = follow(recipe("Add a config"), root, **values)
    assert "Linear parameters: 7,850 trainable values" in config_run.stdout
    [data_run, _, predict_run] = follow(recipe("Use another IDX dataset"), root, **values)

    for done in (config_run, data_run):
        assert re.search(r"Step +Loss +Accuracy +Grad norm +Top2 accuracy", done.stdout)
        assert "top2_accuracy" in done.stdout  # the progress bar shows it too
    rows = rows_of(root / "runs/pets")
    tested = [row["step"] for row in rows if "test_accuracy" in row]  # each epoch, the end
    epoch = tested[0]
    assert tested == sorted({*range(epoch, 20, epoch), 20})
    assert [row["step"] for row in rows] == sorted({1, 5, 10, 15, 20, *tested})
    assert all(row["accuracy"] <= row["top2_accuracy"] <= 1 for row in rows)
    # The one metric definition reaches the test set: rows, the summary and --mode=eval.
    assert all(r["test_accuracy"] <= r["test_top2_accuracy"] for r in rows if "test_loss" in r)
    assert "Test top2 accuracy" in data_run.stdout
    assert "test_top2_accuracy" in summary_of(root / "runs/pets")
    assert "pets (IDX) loaded from IDX files (3 classes, not MD5-checked)" in data_run.stdout
    assert "(12, 12, 1)" in data_run.stdout
    evaluation = json.loads((root / "runs/pets-eval.json").read_text())
    assert evaluation["class_names"] == ["cat", "dog", "fish"]
    assert evaluation["test_examples"] == 30 and evaluation["test_accuracy"] > 0.5
    assert evaluation["test_accuracy"] <= evaluation["test_top2_accuracy"] <= 1
    assert re.search(r"pets\.npy\[0\]: (cat|dog|fish) \(", predict_run.stdout)
    page = (root / "runs/pets/report/report.html").read_text()
    assert "pets (IDX)" in page and "Fashion-MNIST" not in page.split("<h2>Config")[0]


@pytest.mark.slow
def test_the_ensemble_recipe(project, jax_only):
    """A 4-rate sweep names its best member, which eval and export pick; a seed ensemble
    predicts as one model."""
    root, values = project
    np.save(root / "x.npy", np.zeros((2, 28, 28), np.uint8))
    sweep_run, _, _, _, predict_run = follow(
        recipe("Train an ensemble or a sweep"), root, IMAGES=str(root / "x.npy"), **values
    )
    sweep = summary_of(root / "runs/sweep")
    members = sweep["members"]
    assert [m["learning_rate"] for m in members] == [3e-4, 1e-3, 3e-3, 1e-2]
    accuracies = [m["test_accuracy"] for m in members]
    assert sweep["best_member"] == accuracies.index(max(accuracies))
    assert "Ensemble members (4)" in sweep_run.stdout and "(best)" in sweep_run.stdout
    assert "loss/3" in rows_of(root / "runs/sweep")[-1]
    best = json.loads((root / "runs/sweep-best.json").read_text())
    assert best["member"] == sweep["best_member"] and best["test_accuracy"] == max(accuracies)
    images = np.random.default_rng(0).integers(0, 256, (3, 28, 28, 1), dtype=np.uint8)
    got = jax_only(root / "runs/sweep-best.jaxexport", images)
    expected = predict(load_model(root / "runs/sweep", member="best"), images)
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
    seeds = summary_of(root / "runs/seeds")
    assert seeds["config"]["ensemble"]["same_data"] is False
    assert [m["seed"] for m in seeds["members"]] == [0, 1, 2]
    assert len(re.findall(r"x\.npy\[\d\]: ", predict_run.stdout)) == 2


@pytest.mark.slow
def test_the_loss_term_optimizer_and_fine_tuning_recipes(project):
    root, values = project
    template = {p: p.read_bytes() for p in (root / "fmnist_flax").rglob("*.py")}
    assert len(follow(recipe("Add a loss term"), root, **values)) == 1
    assert {p: p.read_bytes() for p in (root / "fmnist_flax").rglob("*.py")} == template
    sgd_run, rmsprop_run = follow(recipe("Use another optimizer"), root, **values)
    follow(recipe("Fine-tune from another run"), root, **values)
    runs = root / "runs"
    # The same init and first batch as the plain run: the z-loss only adds to the loss.
    z_first, plain_first = rows_of(runs / "z_loss")[0], rows_of(runs / "pretrained")[0]
    assert z_first["loss"] > plain_first["loss"] + 1e-3
    assert z_first["accuracy"] == plain_first["accuracy"]
    # The term is shown under its own name and is all the loss gained.
    assert z_first["loss"] == pytest.approx(plain_first["loss"] + z_first["z_loss"], rel=1e-5)
    assert all(row["test_z_loss"] > 0 for row in rows_of(runs / "z_loss") if "test_loss" in row)
    assert summary_of(runs / "z_loss")["config"]["z_loss"] == 0.01
    sgd = summary_of(runs / "sgd")
    assert sgd["config"]["optimizer"]["name"] == "sgd" and sgd["steps"] == 20
    assert [row["step"] for row in rows_of(runs / "sgd")] == [1, 5, 10, 15, 20]  # updates
    assert sgd["test_accuracy"] > 0.5 and "Training metrics" in sgd_run.stdout + rmsprop_run.stdout
    assert summary_of(runs / "rmsprop")["config"]["optimizer"]["name"] == "rmsprop"
    tuned = summary_of(runs / "finetuned")
    assert tuned["init_from"] == str(runs / "pretrained")
    # It starts where the pretrained run ended, far below a fresh model's first loss.
    assert rows_of(runs / "finetuned")[0]["loss"] < 0.5 * plain_first["loss"]


@pytest.mark.slow
def test_the_distillation_recipe_trains_resumes_evaluates_predicts_and_exports(project, jax_only):
    """A loss term that asks for the images and runs a second, frozen model on them: no
    template edit, and the student trains, resumes, evaluates, predicts and exports."""
    root, values = project
    template = {p: p.read_bytes() for p in (root / "fmnist_flax").rglob("*.py")}
    shoe = REPO / "examples" / "shoe.png"
    runs = follow(recipe("Distil from a trained model"), root, IMAGES=str(shoe), **values)
    assert {p: p.read_bytes() for p in (root / "fmnist_flax").rglob("*.py")} == template
    _, _, resumed, _, predicted, _ = runs
    work = root / "runs" / "student"
    assert "resuming from checkpoint 30" in resumed.stdout
    rows = rows_of(work)
    assert [row["step"] for row in rows] == [1, 20, 30, 40, 60]
    # The teacher's predictions pull the student: the term falls as it learns them, and the
    # loss is the cross-entropy plus the term.
    assert rows[-1]["distill"] < rows[0]["distill"] / 4 and rows[0]["loss"] > rows[0]["distill"]
    summary = summary_of(work)
    assert summary["test_accuracy"] > 0.75 and summary["test_distill"] > 0
    layers = {f"layers.{k}.{name}" for k in (0, 1) for name in ("bias", "kernel")}
    assert summary["param_layouts"].keys() == layers  # the student's 784-64-10 alone
    evaluation = json.loads((root / "runs/student-eval.json").read_text())
    assert evaluation["test_distill"] == pytest.approx(summary["test_distill"], rel=1e-5)
    assert "shoe.png: Sneaker" in predicted.stdout
    with Image.open(shoe) as picture:
        pixels = np.asarray(picture.convert("L"))[None, :, :, None]
    probabilities = jax_only(root / "runs/student.jaxexport", pixels)
    assert probabilities.shape == (1, 10) and probabilities.argmax() == 7  # a sneaker


@pytest.mark.slow
def test_the_early_stopping_recipe_validates_stops_keeps_the_best_and_stays_stopped(project):
    """A data source and an after-evaluation hook of the project's own module, with no
    template edit: a validation split held out of training, its val_* metrics in each
    evaluated row, the run ended before --steps where they stopped improving, the same
    command again training no further, --step=best the best val_accuracy's step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, values = project
    template = {p: p.read_bytes() for p in (root / "fmnist_flax").rglob("*.py")}
    _, again, _ = follow(recipe("Stop early"), root, **values)
    assert {p: p.read_bytes() for p in (root / "fmnist_flax").rglob("*.py")} == template
    work = root / "runs" / "early"
    summary, rows = summary_of(work), rows_of(work)
    assert summary["dataset"]["examples"] == [55_000, 10_000]  # 5,000 held out of training
    tested = [row for row in rows if "test_accuracy" in row]
    assert all(("val_loss" in row) == ("test_loss" in row) for row in rows)
    assert all(row["val_loss"] > 0 and 0 <= row["val_accuracy"] <= 1 for row in tested)
    assert any(row["val_accuracy"] != row["test_accuracy"] for row in tested)  # its own split
    assert summary["stopped_at"] == rows[-1]["step"] == tested[-1]["step"] < summary["steps"]
    # patience 1: better at each evaluation until the first that is not, where it stopped.
    accuracies = [row["val_accuracy"] for row in tested]
    assert accuracies[:-1] == sorted(set(accuracies[:-1])) and accuracies[-1] <= accuracies[-2]
    assert max(int(p.name) for p in (work / "checkpoints").iterdir()) == summary["stopped_at"]
    assert "an after-evaluation hook ended the run there" in again.stdout
    assert rows_of(work) == rows
    best = max(tested, key=lambda row: (row["val_accuracy"], row["step"]))["step"]
    assert (work / "checkpoints" / str(best)).is_dir()
    assert json.loads((root / "runs/early-best.json").read_text())["step"] == best
    events = EventAccumulator(str(work / summaries.TENSORBOARD_DIR))
    events.Reload()
    logged = {event.step: event.value for event in events.Scalars("val/accuracy")}
    assert logged == pytest.approx({row["step"]: row["val_accuracy"] for row in tested})


@pytest.mark.slow
def test_the_colour_recipe_trains_resumes_evaluates_predicts_and_exports(project, jax_only):
    root, values = project
    _, train_run, _, predict_run, _ = follow(
        recipe("Train on colour images from .npz files"), root, **values
    )
    work = root / "runs" / "colours"
    assert "colours (arrays) loaded from .npz files (3 classes" in train_run.stdout
    assert "(32, 32, 3)" in train_run.stdout
    assert json.loads((root / "runs/colours-eval.json").read_text())["test_accuracy"] > 0.9
    assert re.search(r"blue\.png: blue \(", predict_run.stdout)
    assert "grey.png: converted from grayscale (L) to RGB" in predict_run.stdout
    assert re.search(r"grey\.png: (red|green|blue) \(", predict_run.stdout)
    # The artifact runs with JAX alone on (N, 32, 32, 3) uint8, as predict does.
    images = np.load(root / "colours" / "test.npz")["images"][:5]
    got = jax_only(root / "runs" / "colours.jaxexport", images)
    assert got.shape == (5, 3)
    np.testing.assert_allclose(got, predict(load_model(work), images), rtol=1e-6, atol=1e-7)
    # Killed after its step-40 save (not a logged step: the row in progress travels in the
    # checkpoint), the same command resumes and ends exactly where the uninterrupted run ends.
    [command] = [
        line
        for line in recipe("Train on colour images").splitlines()
        if line.startswith("python main.py --config.dataset.name=arrays")
    ]
    args = [a for a in command.format(**values).split()[2:] if not a.startswith("--workdir")]
    args += ["--checkpoint_every=20", EVERY_DUE_SAVE]
    direct, killed = root / "runs" / "direct", root / "runs" / "killed"
    run(root, *args, f"--workdir={direct}")
    shutil.copytree(direct, killed)
    shutil.rmtree(killed / "checkpoints" / "60")
    (killed / "summary.json").unlink()
    assert "resuming from checkpoint 40" in run(root, *args, f"--workdir={killed}").stdout
    assert rows_of(killed) == rows_of(direct)
    assert_same_models(direct, killed)


@pytest.mark.slow
def test_the_data_source_recipe(project):
    root, values = project
    write_png_folders(root / "data" / "shapes")
    done, prepared, from_records = follow(recipe("Add a data source"), root, **values)
    assert "shapes (PNG folders) loaded from PNG folders (2 classes" in done.stdout
    summary = summary_of(root / "runs" / "pngs")
    assert summary["dataset"]["image_shape"] == [16, 16, 3]
    assert summary["dataset"]["class_names"] == ["bright", "dark"]
    assert "as record files in" in prepared.stdout
    assert (root / "data" / "shapes-records" / "train-00001-of-00002.records").is_file()
    assert "record files (prepared from png_folders)" in from_records.stdout
    records = summary_of(root / "runs" / "png-records")
    assert (
        records["dataset"]["name"] == "records" and records["config"]["input_pipeline"] == "grain"
    )
    same = ("image_shape", "class_names", "examples", "fingerprint")  # the very same pictures
    assert {k: records["dataset"][k] for k in same} == {k: summary["dataset"][k] for k in same}


@pytest.mark.slow
def test_deleting_the_demonstrations_leaves_a_working_trainer(tmp_path):
    """The recipe on a copy of the whole repository: training, eval, predict, the report and
    the command line work without the codelab; every remaining test still collects, and the
    tests that could notice (the docs', the command line's) pass. (A project without the codelab
    runs the template's whole fast tier: test_new_project.py.)"""
    root = copy_project(tmp_path, whole=True)
    follow(recipe("Delete the demonstrations"), root)
    assert not (root / "fmnist_flax" / "codelab").exists() and not (root / "scripts").exists()
    work = root / "runs" / "w"
    done = run(root, *QUICK, "--report=basic", f"--workdir={work}")
    where = isolated(root, "-c", "import fmnist_flax; print(fmnist_flax.__file__)").stdout
    assert where.startswith(str(root / "fmnist_flax"))  # the copy, not the install
    summary = summary_of(work)
    assert summary["test_accuracy"] > 0.5 and "gradient_check" not in summary
    assert "Gradient tree" not in done.stdout and "Training metrics" in done.stdout
    names = {p.name for p in (work / "report").iterdir()}
    assert {"training_curve.png", "predictions.png", "confusion_matrix.png"} <= names
    run(root, "--mode=eval", f"--workdir={work}", f"--output={tmp_path / 'eval.json'}")
    assert json.loads((tmp_path / "eval.json").read_text())["test_examples"] == 10_000
    np.save(root / "x.npy", np.zeros((2, 28, 28), np.uint8))
    assert "x.npy[1]:" in run(root, "--mode=predict", f"--workdir={work}", "--images=x.npy").stdout
    assert str(work / "checkpoints") in run(root, *QUICK, "--steps=30", f"--workdir={work}").stdout
    # --mode=benchmark is no longer offered: not in --help, one line if asked for.
    shown = run(root, "--help").stdout
    assert (
        re.search(r"--mode +<train\|eval\|predict\|export\|prepare>:", shown)
        and "--bench_" not in shown
    )
    refused = run(root, "--mode=benchmark", check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().startswith("error: ") and len(refused.stderr.splitlines()) == 1
    assert "the benchmark was removed" in refused.stderr
    # The copy's tests: all collect; the docs' and the command line's fast ones pass.
    options = ("-p", "no:randomly")
    collected = isolated(root, "-m", "pytest", "-q", "--collect-only", *options)
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-2000:]
    assert "tests/codelab" not in collected.stdout
    assert re.search(r"\d+ tests collected", collected.stdout)
    tests = ("tests/repository/test_docs.py", "tests/test_cli.py")
    tier = isolated(root, "-m", "pytest", "-q", "-m", "not slow", "-n", "0", *options, *tests)
    assert tier.returncode == 0, tier.stdout[-3000:] + tier.stderr[-2000:]
    assert re.search(r"\d+ passed", tier.stdout) and " failed" not in tier.stdout


@pytest.mark.slow
def test_the_whole_test_set_metric_recipe(project):
    """One entry in task.py: its column, beside the shipped ones, in the rows of each
    evaluation, the tables, TensorBoard, the summary and --mode=eval."""
    root, values = project
    train_run, eval_run = follow(recipe("Add a whole-test-set metric"), root, **values)
    work = root / "runs" / "whole_set"
    classes = [f"test_class_accuracy_{k}" for k in range(10)]
    tested = [row for row in rows_of(work) if "test_loss" in row]
    assert tested and all("test_macro_f1" in row for row in tested)
    for row in tested:
        assert row["test_worst_class_accuracy"] == min(row[name] for name in classes)
    assert "Test worst class accuracy" in train_run.stdout and "Macro f1" in eval_run.stdout
    events = b"".join(p.read_bytes() for p in (work / "tensorboard").glob("events.out.*"))
    assert b"test/worst_class_accuracy" in events and b"test/class_accuracy_9" in events
    summary = summary_of(work)
    assert summary["test_worst_class_accuracy"] == tested[-1]["test_worst_class_accuracy"]
    evaluation = json.loads((root / "runs/whole_set-eval.json").read_text())
    for name in ("test_macro_f1", "test_worst_class_accuracy", *classes):
        assert evaluation[name] == summary[name], name


@pytest.mark.slow
def test_the_schedule_and_kernels_only_decay_recipe(project):
    """A schedule registered from the project's own module trains on the rates it defines,
    and its own check of its own field is one line; the kernels-only decay and the rate
    multipliers reach the run's record."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, values = project
    follow(recipe("Add a schedule; decay kernels only"), root, **values)

    def rates(workdir: pathlib.Path) -> dict[int, float]:
        reader = EventAccumulator(str(workdir / summaries.TENSORBOARD_DIR))
        reader.Reload()
        return {event.step: event.value for event in reader.Scalars("train/learning_rate")}

    step_decay, rsqrt = root / "runs" / "step_decay", root / "runs" / "rsqrt"
    optimizer = summary_of(step_decay)["config"]["optimizer"]
    assert (optimizer["schedule"], optimizer["halve_every"]) == ("step_decay", 5)
    assert optimizer["decay_mask"] == "kernels" and optimizer["weight_decay"] == 0.05
    # Row k logs the rate of update k, made at count k - 1: halved at counts 5, 10, 15.
    assert rates(step_decay) == pytest.approx({1: 3e-3, 10: 1.5e-3, 20: 3.75e-4})
    assert summary_of(rsqrt)["config"]["optimizer"]["lr_multipliers"] == [["bias", 2.0]]
    # warmup_rsqrt, 5 warm-up steps: 0 at count 0, then the peak times sqrt(5 / count).
    expected = {1: 0.0, 10: 3e-3 * (5 / 9) ** 0.5, 20: 3e-3 * (5 / 19) ** 0.5}
    assert rates(rsqrt) == pytest.approx(expected)
    assert summary_of(rsqrt)["test_accuracy"] > 0.5
    config = "--config=configs/step_decay.py"
    refused = run(root, config, "--config.optimizer.halve_every=0", check=False)
    assert_one_line_error(refused, "--config.optimizer.halve_every=0 must be a whole number >= 1")


@pytest.mark.slow
def test_the_plug_in_recipe_uses_a_projects_own_parts_with_no_template_edit(project):
    """A model, a data source, an optimizer and a schedule from a module of the project's own,
    named in `config.imports`, train and evaluate; the template's files are untouched. The
    eval (a new process) imports the module the command line names, never because the run's
    saved config names it."""
    root, values = project
    before = {p: p.read_bytes() for p in (root / "fmnist_flax").rglob("*.py")}
    follow(recipe("Plug in a module of your own"), root, **values)
    assert {p: p.read_bytes() for p in (root / "fmnist_flax").rglob("*.py")} == before
    summary = summary_of(root / "runs" / "plugged")
    assert summary["config"]["imports"] == ["my_project"]
    assert summary["config"]["model"] == {"name": "logistic"}
    assert summary["test_accuracy"] > 0.9  # stripes: a linear model separates them
    evaluation = json.loads((root / "runs" / "plugged-eval.json").read_text())
    assert evaluation["class_names"] == ["horizontal", "vertical"]
    assert evaluation["test_accuracy"] == summary["test_accuracy"]
    refused = run(
        root, "--config=configs/plugged.py", "--config.imports=('no_such_module',)", check=False
    )
    assert_one_line_error(refused, "--config.imports: importing 'no_such_module' failed")
    unnamed = run(root, "--mode=eval", f"--workdir={root / 'runs' / 'plugged'}", check=False)
    assert_one_line_error(unnamed, "names config.imports my_project, not found among the install")


@pytest.mark.slow
def test_the_update_hook_and_ema_recipes(project, jax_only):
    """A max-norm hook from the project's own module holds every kernel column to its bound
    in the saved model; the EMA's test metrics sit beside the raw ones, and --ema's eval
    and export are the averaged model's, as load_model(ema=True) predicts it."""
    import orbax.checkpoint as ocp

    root, values = project
    follow(recipe("Run code after each update"), root, **values)
    saved = ocp.StandardCheckpointer().restore(root / "runs/max_norm/checkpoints/20/model")
    norms = [np.linalg.norm(layer["kernel"]["value"], axis=0) for layer in saved["layers"].values()]
    assert max(n.max() for n in norms) == pytest.approx(1.0, abs=1e-5)  # it binds, and holds
    follow(recipe("Keep an EMA of the parameters"), root, **values)
    work = root / "runs" / "ema"
    summary = summary_of(work)
    tested = [row for row in rows_of(work) if "test_loss" in row]
    assert tested and all("test_ema_loss" in row for row in tested)
    assert summary["test_ema_accuracy"] == tested[-1]["test_ema_accuracy"] > 0.5
    evaluation = json.loads((root / "runs/ema-eval.json").read_text())
    assert evaluation["test_accuracy"] == summary["test_ema_accuracy"]
    assert evaluation["test_loss"] == pytest.approx(summary["test_ema_loss"], rel=1e-6)
    images = np.random.default_rng(0).integers(0, 256, (3, 28, 28, 1), dtype=np.uint8)
    averaged = predict(load_model(work, ema=True), images)
    np.testing.assert_allclose(jax_only(root / "runs/ema.jaxexport", images), averaged, atol=1e-6)
    assert np.abs(averaged - predict(load_model(work), images)).max() > 1e-3


@pytest.mark.slow
def test_the_model_parallel_recipe_trains_like_one_device_and_moves_between_meshes(
    project, monkeypatch, tmp_path
):
    """The guide's patch model on 8 CPU devices as it says, then mesh_worker.py's runs of it
    in the same copy: (data 2, model 4) within 1e-5 of one device over 50 steps (and 10 more
    resumed on (4, 2)); its checkpoint evaluated, predicting and exported on one device."""
    from runtime.test_parallel import assert_model_parallel, model_parallel_worker

    root, values = project
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    trained, _ = follow(recipe("A model-parallel model"), root, **values)
    assert "mesh {'data': 2, 'model': 4} over 8 cpu device(s)" in trained.stdout
    for name, layout in (("up", r"P\(None, model\)"), ("down", r"P\(model,\)")):
        assert re.search(rf"{name}\.kernel +\([\d, ]+\) .* {layout}", trained.stdout)
    assert re.search(r"embed\.kernel +\(49, 64\) .* replicated", trained.stdout)
    layouts = {"up.kernel": "P(None, 'model')", "down.kernel": "P('model',)"}
    assert layouts.items() <= summary_of(root / "runs/patches")["param_layouts"].items()
    assert json.loads((root / "runs/patches-eval.json").read_text())["test_examples"] == 10_000
    result = model_parallel_worker(
        tmp_path / "worker",
        "patches",
        project=root,
        config_file=root / "configs" / "patches.py",
    )
    assert_model_parallel(result, "patches", {**layouts, "embed.kernel": "replicated"})
