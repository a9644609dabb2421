"""`python -m fmnist_flax.new_project DIR --name=NAME`: a project of the template alone, renamed,
that depends on the runtime library at this version and passes its own tests."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import zipfile

import pytest
from conftest import REPO

from fmnist_flax import new_project
from fmnist_flax.runtime import API
from repository.test_recipes import GUIDE, STEP

MOST_PACKAGE_LINES = 2_600
FAST_TIER = ("-m", "pytest", "-q", "-m", "not slow", "-n", "0", "-p", "no:randomly")


def apply_the_guide(root: pathlib.Path, name: str) -> list[str]:
    """Every file docs/extending.md has a project add or edit (its plug-ins, configs and
    template edits; no command), made in the project at `root` with `fmnist_flax` read as its
    package `name`; returns the paths touched."""
    touched = []
    for step in STEP.finditer(GUIDE.read_text()):
        action, path, anchor, body = step["action"], step["path"], step["anchor"], step["body"]
        if action in ("run", "delete"):
            continue
        renamed = functools.partial(re.sub, r"\bfmnist_flax\b(?!\.runtime)", name)
        if action == "copy":
            body, path = (GUIDE.parent / path).read_text(), path.removeprefix("recipes/")
        target = root / renamed(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        if action in ("copy", "create"):
            target.write_text(renamed(body))
        else:
            lines = target.read_text().splitlines(keepends=True)
            [at] = [k for k, line in enumerate(lines) if anchor in line][:1]
            new = {"insert-before": [body, lines[at]], "insert-after": [lines[at], body]}
            lines[at : at + 1] = new.get(action, [body])
            target.write_text(renamed("".join(lines)))
        touched.append(str(target.relative_to(root)))
    assert {"my_losses.py", "configs/early_stop.py", f"{name}/model.py"} <= set(touched)
    return touched


def make(directory: pathlib.Path, *args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fmnist_flax.new_project", str(directory), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def fresh_venv(directory: pathlib.Path) -> pathlib.Path:
    """A new virtual environment that sees this one's libraries (site-packages on its path, its
    .pth files not run: no editable install of this checkout comes with it); its Python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True)
    [site] = (directory / "lib").glob("python*/site-packages")
    (site / "libraries.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return directory / "bin" / "python"


def pip_install(python: pathlib.Path, requirement: str) -> None:
    """`pip install -e REQUIREMENT` into the environment of `python`."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "-e", requirement],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_a_new_project_installs_beside_the_runtime_and_trains_evaluates_predicts_exports(
    tmp_path,
):
    """As its Done-when says: the project holds no runtime module and at most 2,600 lines of
    package code; in a fresh venv with this repository installed, its own fast tests pass,
    and 50 steps train, then eval, predict and export run, from its own directory."""
    root = tmp_path / "myproj"
    made = make(root, "--name=myproj", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert made.stdout.startswith(f"wrote {root}: package myproj/")
    files = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    runtime_modules = {f"{name}.py" for name in API}
    assert not {f for f in files if pathlib.PurePath(f).name in runtime_modules}
    assert not [f for f in files if "codelab" in f or "runtime" in f or "fmnist" in f]
    assert {"main.py", "myproj/train.py", "configs/default.py", "tests/conftest.py"} <= files
    lines = sum(len((root / f).read_text().splitlines()) for f in files if f.startswith("myproj/"))
    assert lines <= MOST_PACKAGE_LINES
    version = importlib.metadata.version("fmnist-flax")
    assert f'dependencies = ["fmnist-flax=={version}"]' in (root / "pyproject.toml").read_text()

    python = fresh_venv(tmp_path / "venv")
    pip_install(python, f"{REPO}[test]")
    pip_install(python, f"{root}[test]")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def run(*args: str) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [python, *args], cwd=root, env=env, capture_output=True, text=True, timeout=900
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done

    where = run("-c", "import myproj, fmnist_flax.runtime as r; print(myproj.__file__, r.__file__)")
    assert where.stdout.split() == [
        str(root / "myproj/__init__.py"),
        str(REPO / "fmnist_flax/runtime/__init__.py"),
    ]
    # With the guide's recipes applied, its own fast tests pass in one process (that a
    # plug-in touches only the runs that import it is one of them: test_experiment.py).
    apply_the_guide(root, "myproj")
    tier = run(*FAST_TIER)
    assert re.search(r"\d+ passed", tier.stdout) and " failed" not in tier.stdout
    work = root / "runs" / "w"
    trained = run("main.py", "--steps=50", "--log_every=25", "--report=none", f"--workdir={work}")
    assert "test accuracy" in trained.stdout
    run("main.py", "--mode=eval", f"--workdir={work}", f"--output={tmp_path / 'eval.json'}")
    assert json.loads((tmp_path / "eval.json").read_text())["test_examples"] == 10_000
    predicted = run("main.py", "--mode=predict", f"--workdir={work}", "--images=examples/shoe.png")
    assert "shoe.png: Sneaker" in predicted.stdout
    run("main.py", "--mode=export", f"--workdir={work}", f"--output={tmp_path / 'model.jaxexport'}")
    assert (tmp_path / "model.jaxexport").stat().st_size > 0


def test_the_codelab_comes_only_when_asked_for(tmp_path):
    """Without --with_codelab a project has none of the demonstrations; with it, all that the
    template has (its package, tests and scripts), renamed. Never the runtime's or this
    repository's own tests."""
    optional = sorted(
        path.relative_to(REPO).as_posix().replace("fmnist_flax/", "with_demos/", 1)
        for part in ("fmnist_flax/codelab", "tests/codelab", "scripts")
        for path in (REPO / part).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    )
    for name, args in (("plain_one", ()), ("with_demos", ("--with_codelab",))):
        made = make(tmp_path / name, f"--name={name}", *args, cwd=tmp_path)
        assert made.returncode == 0, made.stderr
        root = tmp_path / name
        files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        kept = [f for f in files if f in optional]
        assert kept == (optional if args else [])
        assert not [f for f in files if f.startswith(("tests/runtime", "tests/repository"))]
        for path in root.rglob("*.py"):
            assert "from fmnist_flax import" not in path.read_text(), path


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--name=My-Project"], "--name='My-Project': a project's package name is a lowercase"),
        (["--name=json"], "--name=json: a module json is importable here already"),
        (["--name=class"], "--name='class': a project's package name is a lowercase"),
        ([], "the following arguments are required: --name"),
    ],
)
def test_a_mistake_is_one_line_and_writes_nothing(tmp_path, capsys, args, expected):
    target = tmp_path / "p"
    with pytest.raises(SystemExit) as exited:
        new_project.main([str(target), *args])
    assert exited.value.code != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and expected in err, err
    assert not target.exists()


def test_a_directory_in_use_is_refused(tmp_path, capsys):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        new_project.main([str(tmp_path / "p"), "--name=fine_name"])
    assert "exists and is not an empty directory; name a new one" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "p").iterdir()] == ["notes.txt"]


@pytest.mark.slow
def test_the_wheel_installs_no_top_level_configs_package(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    [wheel] = tmp_path.glob("fmnist_flax-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "fmnist_flax/config.py" in names and "fmnist_flax/__main__.py" in names
    assert {"fmnist_flax/runtime/checkpoint.py", "fmnist_flax/codelab/benchmark.py"} <= set(names)
    assert {name.split("/")[0] for name in names if "dist-info" not in name} == {"fmnist_flax"}
