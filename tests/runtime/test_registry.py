"""Registries: a taken name refused in one line, an entry scoped to the runs whose
config.imports names the module that added it, and functions that ask for extras."""

from __future__ import annotations

import sys

import pytest

from fmnist_flax.runtime import plugins, registry
from fmnist_flax.runtime.errors import UserError
from fmnist_flax.runtime.registry import Registry

PLUG_IN = """
from fmnist_flax.runtime.registry import Registry

def plugged():
    return __name__


def add(table: Registry) -> None:
    table["plugged"] = plugged
"""


@pytest.fixture
def plug_ins(tmp_path, monkeypatch, forget_modules):
    """`make(name)`: a module `name` on the import path whose `add(table)` registers
    `plugged` as its own top level would; the set of known plug-ins restored after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    known = set(plugins.PLUG_INS)

    def make(name: str):
        path = tmp_path.joinpath(*name.split("."))
        path.parent.mkdir(parents=True, exist_ok=True)
        for package in path.parents:
            if package == tmp_path:
                break
            (package / "__init__.py").touch()
        path.with_suffix(".py").write_text(PLUG_IN + "\nimport sys\nadd(sys.modules['_table'])\n")
        forget_modules.append(name)
        return name

    yield make
    plugins.PLUG_INS.intersection_update(known)


def test_a_plug_ins_entry_applies_only_where_config_imports_names_it(plug_ins, monkeypatch):
    table = Registry("thing", {"built_in": abs})
    monkeypatch.setitem(sys.modules, "_table", table)
    plugins.import_modules((plug_ins("my_things"),))
    assert (table.owners("built_in"), table.owners("plugged")) == ([None], ["my_things"])
    assert table.active(("my_things",)) == {
        "built_in": abs,
        "plugged": sys.modules["my_things"].plugged,
    }
    assert table.active(()) == {"built_in": abs}
    assert "registered by my_things, which this run's config.imports does not name" in (
        table.absent("plugged", ())
    )
    assert table.absent("nothing", ()) == "is not one of built_in"


def test_a_plug_in_imported_first_some_other_way_is_scoped_once_a_config_names_it(
    plug_ins, monkeypatch
):
    """A module imported by a test or a notebook before any config names it: its entries
    apply everywhere until then (no config claims it), and to its runs only after."""
    table = Registry("thing")
    monkeypatch.setitem(sys.modules, "_table", table)
    __import__(plug_ins("early_things"))
    assert table.active(()).keys() == {"plugged"}
    plugins.import_modules(("early_things",))
    assert table.active(()) == {}
    assert table.active(("early_things",)).keys() == {"plugged"}


def test_a_module_of_a_named_package_belongs_to_it(plug_ins, monkeypatch):
    table = Registry("thing")
    monkeypatch.setitem(sys.modules, "_table", table)
    plug_ins("my_pkg.losses")
    plugins.import_modules(("my_pkg.losses",))
    assert table.owners("plugged") == ["my_pkg.losses"]
    assert table.active(("my_pkg.losses",)) == table.active(("my_pkg",))
    assert table.active(("my_pkg",))["plugged"]() == "my_pkg.losses"
    assert table.active(("my_pkg_other",)) == {}


def test_entries_added_outside_any_plug_in_apply_everywhere():
    """A notebook's or a test's own registration (no config imports its module)."""
    table = Registry("thing")
    table["mine"] = len
    assert table.active(()) == {"mine": len}
    assert table.active(("anything",)) == {"mine": len}


def test_a_taken_name_is_refused_and_the_same_entry_again_is_not():
    table = Registry("model", {"mlp": dict})
    table["mlp"] = dict
    with pytest.raises(UserError, match=r"^model 'mlp' is taken by builtins.dict, so "):
        table["mlp"] = list
    del table["mlp"]
    table["mlp"] = list
    assert table.owners("mlp") != [None]  # no longer the built-in entry


def test_extras_are_asked_for_by_keyword_only_parameters():
    table = Registry("term", extras=("images", "key"))

    def plain(a, b):
        return a + b

    def wants_key(a, b, *, key):
        return a + b + key

    table["plain"], table["wants_key"] = plain, wants_key
    assert table.asks_for("key") and not table.asks_for("images")
    assert registry.call(plain, 1, 2, key=10, images=100) == 3
    assert registry.call(wants_key, 1, 2, key=10, images=100) == 13
    with pytest.raises(UserError, match="wants_key asks for key, which is not given here"):
        registry.call(wants_key, 1, 2)

    def wants_labels(a, b, *, labels):
        return a

    with pytest.raises(UserError, match=r"its keyword-only labels is not one of images, key"):
        table["wants_labels"] = wants_labels


def test_two_modules_may_add_one_name_for_runs_that_import_one_of_them(plug_ins, monkeypatch):
    """A name two plug-ins add: each run gets the entry of the one it imports, and a run that
    would get two is refused in one line, as is a plug-in's name that a module of every run's
    (a notebook's) takes as well."""
    table = Registry("schedule", {"constant": abs})
    monkeypatch.setitem(sys.modules, "_table", table)
    plugins.import_modules((plug_ins("first_plug_in"), plug_ins("second_plug_in")))
    for name in ("first_plug_in", "second_plug_in"):
        assert table.active((name,))["plugged"]() == name
    assert "plugged" not in table.active(())
    with pytest.raises(UserError, match=r"'plugged' is registered by first_plug_in .* and by "):
        table.active(("first_plug_in", "second_plug_in"))
    with pytest.raises(UserError, match="registered by first_plug_in"):
        table["plugged"]
    table["plugged"] = max  # every run's: clashes in the plug-ins' runs alone
    assert table.active(())["plugged"] is max
    with pytest.raises(UserError, match="all imported by this run; rename one of them"):
        table.active(("first_plug_in",))


def test_a_plug_in_cannot_take_a_name_every_run_has(plug_ins, monkeypatch):
    monkeypatch.setitem(sys.modules, "_table", Registry("schedule", {"plugged": min}))
    with pytest.raises(UserError, match=r"importing 'greedy_plug_in': schedule 'plugged' is taken"):
        plugins.import_modules((plug_ins("greedy_plug_in"),))
