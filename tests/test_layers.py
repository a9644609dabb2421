"""The package's three layers and the way their imports run: the template (`fmnist_flax/*.py`)
imports the runtime (`fmnist_flax/runtime/`); the runtime imports neither the template nor the
codelab (`fmnist_flax/codelab/`); nothing outside the codelab imports it; no cycle anywhere."""

from __future__ import annotations

import ast
import pathlib

from conftest import REPO

PACKAGE = REPO / "fmnist_flax"
RUNTIME, CODELAB = "fmnist_flax.runtime", "fmnist_flax.codelab"
# The most lines the template's top-level modules hold together, and without the loop
# (train.py).
TEMPLATE_LINES = 2_500
TEMPLATE_BESIDES_LOOP_LINES = 1_650


def module_name(path: pathlib.Path) -> str:
    """fmnist_flax/runtime/checkpoint.py -> fmnist_flax.runtime.checkpoint; a package's
    __init__.py is the package itself."""
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> str:
    for name in (RUNTIME, CODELAB):
        if module == name or module.startswith(name + "."):
            return name
    return "template"


def imports_of(module: str) -> set[str]:
    """The package's modules that `module` imports anywhere in its file (inside functions too):
    `from P import X` names module P.X when it is one, else P itself."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package up
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {name for name in found if name in MODULES} - {module}


GRAPH = {module: imports_of(module) for module in MODULES}


def test_the_layers_hold_the_modules_they_are_for():
    """The runtime's and the template's modules are where they belong (a project may have
    deleted the codelab's folder)."""
    assert {"fmnist_flax.runtime.checkpoint", "fmnist_flax.runtime.inference"} <= MODULES.keys()
    assert {"fmnist_flax.train", "fmnist_flax.model", "fmnist_flax.cli"} <= MODULES.keys()
    # The parser sees the imports it judges: the CLI's of the runtime and of the template.
    assert {"fmnist_flax.runtime.command_line", "fmnist_flax.train"} <= GRAPH["fmnist_flax.cli"]


def test_the_runtime_imports_neither_the_template_nor_the_codelab():
    upward = {
        f"{module} imports {name}"
        for module, names in GRAPH.items()
        if layer(module) == RUNTIME
        for name in names
        if layer(name) != RUNTIME
    }
    assert not upward, sorted(upward)


def test_nothing_outside_the_codelab_imports_it():
    found = {
        f"{module} imports {name}"
        for module, names in GRAPH.items()
        if layer(module) != CODELAB
        for name in names
        if layer(name) == CODELAB
    }
    assert not found, sorted(found)


def test_the_template_stays_short_enough_to_read_in_one_sitting():
    """The template's modules hold at most TEMPLATE_LINES lines together, and those other than
    train.py at most TEMPLATE_BESIDES_LOOP_LINES: generic machinery belongs in runtime/, behind
    a small API."""
    sizes = {path.name: len(path.read_text().splitlines()) for path in PACKAGE.glob("*.py")}
    besides_loop = sum(lines for name, lines in sizes.items() if name != "train.py")
    assert sum(sizes.values()) <= TEMPLATE_LINES, sorted(sizes.items())
    assert besides_loop <= TEMPLATE_BESIDES_LOOP_LINES, sorted(sizes.items())


def test_no_module_of_the_package_imports_itself_through_a_cycle():
    def reach(start: str, seen: set[str]) -> set[str]:
        for module in GRAPH[start] - seen:
            seen.add(module)
            reach(module, seen)
        return seen

    cycles = [module for module in GRAPH if module in reach(module, set())]
    assert not cycles, cycles
