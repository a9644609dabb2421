"""The template's layer: its modules (`fmnist_flax/*.py`, and `codelab/` while a project keeps
it) use the runtime library (`fmnist_flax.runtime`) through its public API alone
(`fmnist_flax.runtime.API`), nothing outside the codelab imports it, and no module of the
template imports itself through a cycle."""

from __future__ import annotations

import ast
import pathlib

from conftest import REPO

from fmnist_flax.runtime import API

PACKAGE = REPO / "fmnist_flax"  # the template; the runtime is the library below
RUNTIME, CODELAB = "fmnist_flax.runtime", f"{PACKAGE.name}.codelab"


def module_name(path: pathlib.Path) -> str:
    """fmnist_flax/codelab/benchmark.py -> fmnist_flax.codelab.benchmark; a package's
    __init__.py is the package itself."""
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


MODULES = {
    module_name(path): path
    for path in sorted(PACKAGE.rglob("*.py"))
    if "runtime" not in path.relative_to(PACKAGE).parts  # the library, where a checkout has it
}


def imports_of(module: str) -> tuple[set[str], set[tuple[str, str]]]:
    """The template's modules that `module` imports anywhere in its file (inside functions
    too), and the (runtime module, name) pairs it uses: `from RUNTIME.m import name`, and
    `m.name` where `m` is a runtime module it imported."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found, used, runtime_names = set(), set(), {}
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package up
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            for alias in node.names:
                if base == RUNTIME:
                    runtime_names[alias.asname or alias.name] = alias.name
                elif base.startswith(RUNTIME + "."):
                    used.add((base.removeprefix(RUNTIME + "."), alias.name))
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in runtime_names
        ):
            used.add((runtime_names[node.value.id], node.attr))
    return {name for name in found if name in MODULES} - {module}, used


GRAPH = {module: imports_of(module)[0] for module in MODULES}


def test_the_template_uses_the_runtime_through_its_public_api_only():
    """Every name of the runtime the template (and the codelab) uses is in runtime.API: the
    library can change anything else without breaking a project."""
    outside = {
        f"{module} uses {RUNTIME}.{runtime_module}.{name}"
        for module in MODULES
        for runtime_module, name in imports_of(module)[1]
        if name not in API.get(runtime_module, ())
    }
    assert not outside, sorted(outside)
    assert ("model_build", "create_model") in imports_of(f"{PACKAGE.name}.model")[1]


def test_nothing_outside_the_codelab_imports_it():
    found = {
        f"{module} imports {name}"
        for module, names in GRAPH.items()
        if not module.startswith(CODELAB)
        for name in names
        if name.startswith(CODELAB)
    }
    assert not found, sorted(found)


def test_no_module_of_the_template_imports_itself_through_a_cycle():
    def reach(start: str, seen: set[str]) -> set[str]:
        for module in GRAPH[start] - seen:
            seen.add(module)
            reach(module, seen)
        return seen

    cycles = [module for module in GRAPH if module in reach(module, set())]
    assert not cycles, cycles
