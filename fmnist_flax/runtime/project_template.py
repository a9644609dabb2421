"""A new project from a template's checkout: the template's package renamed, its configs,
main.py, its own tests and examples, a README stub and a pyproject.toml that depends on this
runtime's distribution at its installed version. No runtime file is copied: the project
imports the runtime as a library, whatever the template's package was called.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import keyword
import pathlib
import re
import shutil
import sys
from collections.abc import Sequence

from .errors import UserError, error_line

# What a template's checkout holds beside its package (copied when present), and the files of
# it that are data, copied as they are.
BESIDE_PACKAGE = ("configs", "tests", "examples", "scripts", "main.py", ".gitignore")
BINARY_SUFFIXES = (".png", ".npy", ".npz", ".jpg", ".jpeg", ".gz")
SKIPPED = ("__pycache__", ".pytest_cache", ".ruff_cache")
# The sections of the template's pyproject.toml a project keeps as they are.
KEPT_TOOLS = ("tool.ruff", "tool.pytest")


@dataclasses.dataclass(frozen=True)
class Template:
    """A template's checkout: `root` holds its `package` and BESIDE_PACKAGE. Paths relative to
    `root`: `never`, what only the template's own repository keeps (its runtime's and docs'
    tests); `optional`, what a project leaves out unless asked for (demonstrations)."""

    root: pathlib.Path
    package: str
    never: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()


RUNTIME = __name__.rpartition(".")[0]  # this library's package: imported, never copied


def create(template: Template, directory: str, name: str, *, with_optional: bool = False) -> str:
    """Write the project `name` into `directory` (new or empty); returns what it did, in one
    line. Every mistake is a UserError before anything is written."""
    target = pathlib.Path(directory).expanduser()
    _check(template, target, name)
    distribution = _distribution(RUNTIME.partition(".")[0])
    skipped = template.never + (() if with_optional else template.optional)
    target.mkdir(parents=True, exist_ok=True)
    sources = [template.root / template.package, *(template.root / p for p in BESIDE_PACKAGE)]
    for source in sources:
        for path in sorted(source.rglob("*")) if source.is_dir() else [source]:
            relative = path.relative_to(template.root)
            if (
                not path.is_file()
                or set(relative.parts) & set(SKIPPED)
                or relative.parts[:2] == (template.package, RUNTIME.rpartition(".")[2])
                or any(relative.is_relative_to(path) for path in skipped)
            ):
                continue
            _copy(path, target / _renamed(str(relative), template.package, name), template, name)
    (target / "pyproject.toml").write_text(_pyproject(template, name, distribution))
    (target / "README.md").write_text(_readme(template, name, distribution))
    return (
        f"wrote {target}: package {name}/ ({_package_lines(target / name):,} lines), configs/, "
        f"main.py, tests/; it depends on {distribution[0]}=={distribution[1]} for the runtime"
    )


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not argparse's usage and message
        error_line(f"{message} (usage: {self.format_usage().strip().removeprefix('usage: ')})")
        sys.exit(2)


def main(template: Template, prog: str, argv: Sequence[str] | None, optional_flag: str) -> None:
    """The command line of a template's `new_project`: DIR, --name=NAME and `--optional_flag`
    (the template's optional parts); every mistake is one line, exit status 2 or 1."""
    parser = _Parser(prog=prog, description="A new project from this template.")
    parser.add_argument("directory", help="the new project's directory (new or empty)")
    parser.add_argument("--name", required=True, help="its package, e.g. my_project")
    parser.add_argument(
        f"--{optional_flag}", action="store_true", help=", ".join(template.optional)
    )
    args = parser.parse_args(argv)
    try:
        done = create(
            template, args.directory, args.name, with_optional=getattr(args, optional_flag)
        )
    except UserError as exc:
        error_line(str(exc))
        sys.exit(1)
    print(done)


def _check(template: Template, target: pathlib.Path, name: str) -> None:
    if not name.isidentifier() or keyword.iskeyword(name) or name != name.lower():
        raise UserError(
            f"--name={name!r}: a project's package name is a lowercase Python identifier, "
            "e.g. --name=my_project"
        )
    if getattr(importlib.util.find_spec(name), "origin", None):  # a namespace package is not
        raise UserError(
            f"--name={name}: a module {name} is importable here already; its imports would be "
            "ambiguous, so pick another name"
        )
    missing = [p for p in ("configs", "tests", "main.py") if not (template.root / p).exists()]
    if missing:
        raise UserError(
            f"a new project is made from the template's checkout, and {template.root} lacks "
            f"{', '.join(missing)}: run it from a clone of the repository (pip install -e .)"
        )
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise UserError(f"{target} exists and is not an empty directory; name a new one")


def _distribution(top_level: str) -> tuple[str, str]:
    """The installed distribution (name, version) that provides the package `top_level`."""
    names = importlib.metadata.packages_distributions().get(top_level, [])
    if not names:
        raise UserError(
            f"no installed distribution provides {top_level}; install the runtime first "
            "(pip install -e . in its checkout)"
        )
    return names[0], importlib.metadata.version(names[0])


def _renamed(text: str, old: str, new: str) -> str:
    """`text` with the template's package `old` (as a module path, a file path and a
    distribution name) renamed `new`, except where it names the runtime library."""
    kept = (RUNTIME, RUNTIME.replace(".", "/"))
    for k, name in enumerate(kept):
        text = text.replace(name, f"\0{k}\0")
    text = re.sub(rf"\b{re.escape(old)}\b", new, text)
    text = text.replace(old.replace("_", "-"), new.replace("_", "-"))
    for k, name in enumerate(kept):
        text = text.replace(f"\0{k}\0", name)
    return text


def _copy(source: pathlib.Path, target: pathlib.Path, template: Template, name: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.suffix in BINARY_SUFFIXES:
        shutil.copyfile(source, target)
    else:
        target.write_text(_renamed(source.read_text(), template.package, name))


def _package_lines(package: pathlib.Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in package.rglob("*.py"))


def _pyproject(template: Template, name: str, distribution: tuple[str, str]) -> str:
    """The project's pyproject.toml: its package, the runtime's distribution pinned, the
    template's ruff and pytest settings."""
    requirement = f"{distribution[0]}{{extra}}=={distribution[1]}"
    source = (template.root / "pyproject.toml").read_text()
    sections = re.split(r"\n(?=\[)", source)
    kept = "\n".join(s for s in sections if s.strip("[").startswith(KEPT_TOOLS))
    return f"""[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "{name.replace("_", "-")}"
version = "0.1.0"
description = "A Flax NNX training project, started from the {distribution[0]} template."
readme = "README.md"
requires-python = ">=3.11"
# The runtime library (checkpoints, run files, writers, mesh, records, export), at the version
# this project started from; jax, flax, optax and orbax come with it.
dependencies = ["{requirement.format(extra="")}"]

[project.optional-dependencies]
cuda12 = ["{requirement.format(extra="[cuda12]")}"]
tpu = ["{requirement.format(extra="[tpu]")}"]
test = ["{requirement.format(extra="[test]")}"]

[project.scripts]
{name.replace("_", "-")} = "{name}.launch:main"

[tool.setuptools.packages.find]
include = ["{name}", "{name}.*"]

{kept.strip()}
"""


def _readme(template: Template, name: str, distribution: tuple[str, str]) -> str:
    dist, version = distribution
    return f"""# {name}

A Flax NNX training project, started from the {dist} template ({version}). `{name}/` is the
template's layer, yours to edit: the model, the task, the config, the data sources, the step
and loop, the evaluation and the command line. The machinery under it (checkpoints, run files,
writers, mesh, records, export) is the `{RUNTIME}` library of the `{dist}` distribution,
pinned in `pyproject.toml`; its public API is `{RUNTIME}.API`.

## Set-up

```bash
python3 -m venv .venv && .venv/bin/pip install -e '.[test]'
.venv/bin/python main.py --steps=400
```

The first line installs `{dist}=={version}` with jax, flax, optax and orbax (from a checkout of
the runtime, install it first: `.venv/bin/pip install -e 'PATH/TO/{dist}[test]'`).

## Tests

```bash
.venv/bin/ruff check . && .venv/bin/ruff format --check . && .venv/bin/python -m pytest -q -n 2
```

The fast tier is `pytest -m "not slow"`.
"""
