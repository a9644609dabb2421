"""The training loop reads in one sitting: `train.train_and_evaluate` names few things of the
package (other modules' names and its own module's helpers together), the machinery behind
runtime objects with plain names."""

from __future__ import annotations

import ast

from conftest import REPO

TRAIN = REPO / "fmnist_flax" / "train.py"
MOST_NAMES = 25


def package_names(path, function: str) -> set[str]:
    """The package's names `function` in `path` refers to: `module.attr` for each attribute of
    an imported package module, each name imported from the package, each of the module's own
    top-level functions, classes and constants."""
    tree = ast.parse(path.read_text())
    modules, imported, own = set(), set(), set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fmnist_flax"):
            for alias in node.names:
                name = alias.asname or alias.name
                is_module = (REPO / (node.module.replace(".", "/")) / f"{alias.name}.py").exists()
                (modules if is_module else imported).add(name)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name != function:
            own.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            own |= {t.id for t in targets if isinstance(t, ast.Name)}
    (loop,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function]
    found = set()
    for node in ast.walk(loop):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ):
            found.add(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id in imported | own:
            found.add(node.id)
    return found


def test_the_counter_sees_the_names_of_a_loop():
    """The count is of the package's names only: modules' attributes, imports, own helpers."""
    names = package_names(TRAIN, "train_and_evaluate")
    assert "experiment.prepare" in names and "make_train_chunk" in names
    assert not {"jax", "nnx", "time", "config"} & names


def test_the_training_loop_names_at_most_25_things_of_the_package():
    names = package_names(TRAIN, "train_and_evaluate")
    assert len(names) <= MOST_NAMES, f"{len(names)} names: {sorted(names)}"
