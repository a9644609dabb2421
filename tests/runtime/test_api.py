"""The runtime as a library: it imports itself relatively and nothing of any template, its
public API (`runtime.API`) names what exists, and the guide's recipes use nothing else."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

from conftest import REPO

from fmnist_flax import runtime
from fmnist_flax.runtime import API

RUNTIME = pathlib.Path(runtime.__file__).parent
MODULES = sorted(path for path in RUNTIME.glob("*.py") if path.name != "__init__.py")


def absolute_imports(path: pathlib.Path) -> list[str]:
    """The absolute imports of `path` that name a package of this repository."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return [name for name in found if name.split(".")[0] == runtime.__name__.split(".")[0]]


def test_the_runtime_imports_itself_relatively_and_no_template():
    """No module of the runtime names the package around it: a project depends on the runtime
    whatever its own package is called, and the runtime never imports a template."""
    named = {path.name: absolute_imports(path) for path in RUNTIME.glob("*.py")}
    assert not {name: found for name, found in named.items() if found}
    for path in RUNTIME.glob("*.py"):
        assert "fmnist_flax" not in path.read_text(), path.name


def test_the_public_api_names_every_module_and_what_exists():
    assert sorted(API) == [path.stem for path in MODULES]
    missing = [
        f"{module}.{name}"
        for module, names in API.items()
        for name in names
        if not hasattr(importlib.import_module(f"{runtime.__name__}.{module}"), name)
    ]
    assert not missing, missing
    for names in API.values():
        assert list(names) == sorted(set(names))  # each once, in order


def test_the_guides_recipes_use_the_public_api_only():
    """What docs/extending.md and docs/recipes/ show a project writing."""
    guide = (REPO / "docs" / "extending.md").read_text()
    code = [block for block in re.findall(r"```python\n(.*?)```", guide, re.S)]
    code += [path.read_text() for path in (REPO / "docs" / "recipes").rglob("*.py")]
    used = set()
    for text in code:
        for module, names in re.findall(r"from fmnist_flax\.runtime\.(\w+) import ([\w, ]+)", text):
            used |= {(module, name.strip()) for name in names.split(",")}
    assert used, "the recipes import something of the runtime"
    outside = sorted(f"{m}.{n}" for m, n in used if n not in API.get(m, ()))
    assert not outside, outside


def test_the_runtime_page_lists_every_module():
    page = (REPO / "docs" / "runtime.md").read_text()
    assert not [path.name for path in MODULES if path.name not in page]
