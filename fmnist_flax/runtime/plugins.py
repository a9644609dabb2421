"""The project's own modules that `config.imports` names: importing them, which runs their
entries apply to, which of them a checkpoint may import, the names their values may not take,
and the after-evaluation hooks called with every fault in one line. A workdir is data: no file
in it, under a `runs/` directory or in the current directory runs as code because a checkpoint
names it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import os
import pathlib
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from . import workdir as workdir_lib
from .checkpoint import CHECKPOINT_DIR, FIELD_RULES, ITEM_FIELDS, STEP_MARKER
from .errors import QUOTE_CHARS, UserError, clip, reason
from .parallel import say

# Every module some config.imports has named in this process: what they register applies only
# to the runs that name them (`applies`).
PLUG_INS: set[str] = set()


def import_modules(names: Any) -> None:
    """Import the project's modules of `config.imports`, so that what they register exists
    (for the runs whose config.imports names them: `applies`)."""
    if isinstance(names, str) or not all(isinstance(n, str) and n for n in names):
        raise UserError(
            f"--config.imports={names!r} must be a tuple of module names, e.g. "
            "--config.imports=\"('my_models',)\""
        )
    PLUG_INS.update(names)
    for name in names:
        try:
            importlib.import_module(name)
        except (Exception, SystemExit) as exc:  # an ImportError, whatever the module raised
            if isinstance(exc, UserError):  # its own one line (a registry's name taken)
                raise UserError(f"--config.imports: importing {name!r}: {exc}") from None
            if isinstance(exc, SystemExit):  # it would end the run with no line
                raise UserError(
                    f"--config.imports: importing {name!r} called sys.exit({exc.code!r}); a "
                    "module of config.imports must not exit"
                ) from None
            raise UserError(
                f"--config.imports: importing {name!r} failed ({type(exc).__name__}: {exc}); "
                "put the module on PYTHONPATH or beside main.py"
            ) from exc


def is_plug_in(module: str | None) -> bool:
    """Whether `module` (None: built in) is a plug-in: a module some config.imports has named,
    or one of its package's."""
    return module is not None and any(_within(module, plug_in) for plug_in in PLUG_INS)


def applies(owner: str | None, imports: Sequence[str]) -> bool:
    """Whether an entry registered by module `owner` (None: built in) applies to a run whose
    config.imports is `imports`: a plug-in's only where `imports` names it; any other's
    everywhere."""
    return not is_plug_in(owner) or any(_within(owner, name) for name in imports)


def _within(module: str, name: str) -> bool:
    """`module` is the module `name` or one of its package's."""
    return module == name or module.startswith(name + ".")


class NotInstalled(UserError):
    """A module a checkpoint names that only the workdir or the current directory holds."""


def pending_imports(names: Any, source: str) -> list[str]:
    """The modules of a checkpoint's saved config.imports (`source` says which checkpoint)
    that are not imported yet."""
    if not isinstance(names, list | tuple) or not all(_is_module_name(n) for n in names):
        raise UserError(
            f"{source}: its saved config.imports {clip(repr(names), QUOTE_CHARS)} is not a list "
            "of module names; read another step with --step"
        )
    return [name for name in names if name not in sys.modules]


def import_recorded(names: list[str], source: str, workdir: pathlib.Path) -> None:
    """Import `pending_imports`' modules, each only if it is installed: found on the import
    path with no file of it (nor of a package above it) in the current directory, `workdir`,
    any other workdir, a `runs/` directory beside an import path entry (the repository's,
    which Python imports as a namespace package) or an entry that holds a workdir
    (PYTHONPATH=runs). A workdir is data: no file in one runs as code because a checkpoint
    names it."""
    if not names:
        return
    data = [os.path.realpath(workdir)]
    with contextlib.suppress(OSError):  # a removed current directory holds nothing
        data.append(os.path.realpath(os.getcwd()))
    entries = {os.path.realpath(entry) for entry in sys.path if entry}  # '': the current one
    data += [os.path.realpath(os.path.join(entry, workdir_lib.RUNS_DIR)) for entry in entries]
    data += [entry for entry in entries if _holds_a_workdir(entry)]
    missing = [name for name in names if not _installed(name, data)]
    if missing:
        raise NotInstalled(
            f"{source} names config.imports {', '.join(missing)}, not found among the "
            "installed modules; a module in the current directory, a workdir or runs/ is "
            "imported only when the command line names it (importing runs its code): if "
            f'you trust it, pass --config.imports="{tuple(missing)!r}"'
        )
    say(f"note: {source} names config.imports {', '.join(names)}; importing them runs their code")
    import_modules(names)


def _is_module_name(name: object) -> bool:
    return isinstance(name, str) and all(part.isidentifier() for part in name.split("."))


def _installed(name: str, data: list[str]) -> bool:
    """Whether the import system finds `name` with every file and directory it would load, its
    packages' included, outside the directories of `data` and of any workdir: found without
    importing anything (a package's `__init__` is code too)."""
    locations = _locations(name)
    return locations is not None and not any(
        _inside(path, data) or _in_a_workdir(path) for path in locations
    )


def _locations(name: str) -> list[str] | None:
    """The files and directories `name` and each package above it load from (None: not
    found): the top-level one's as its finders say, then each package's searched as the
    import system searches its path."""
    parts = name.split(".")
    found: list[str] = []
    search: list[str] = []
    for depth in range(1, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        module = sys.modules.get(prefix)
        spec = getattr(module, "__spec__", None)
        if spec is not None:
            origin, search = spec.origin if spec.has_location else None, _path(spec)
        else:
            try:
                where = _find(prefix) if depth == 1 else _find_in(prefix, search)
            except (ImportError, ValueError):
                return None
            if where is None:
                return None
            origin, search = where
        found += [*([origin] if origin else []), *search]
        if depth < len(parts) and not search:  # not a package: nothing below it
            return None
    return found


def _path(spec: importlib.machinery.ModuleSpec) -> list[str]:
    return list(spec.submodule_search_locations or [])


def _find(name: str) -> tuple[str | None, list[str]] | None:
    """A top-level module's file (None: none) and search path, without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        return None
    return spec.origin if spec.has_location else None, _path(spec)


def _find_in(name: str, search: list[str]) -> tuple[str | None, list[str]] | None:
    """Module `name`'s file and search path in a package whose path is `search`, found as
    the import system finds it (the first entry holding a module or a regular package; else
    every namespace portion), with no package above it imported."""
    portions: list[str] = []
    for entry in search:
        finder = sys.path_importer_cache.get(entry) or _finder(entry)
        spec = finder.find_spec(name) if finder is not None else None
        if spec is None:
            continue
        if spec.loader is not None:
            return spec.origin if spec.has_location else None, _path(spec)
        portions += _path(spec)
    return (None, portions) if portions else None


def _finder(entry: str) -> Any:
    """The finder the import system's path hooks make for a path entry (None: none)."""
    for hook in sys.path_hooks:
        try:
            return hook(entry)
        except ImportError:
            continue
    return None


def _inside(path: str, directories: list[str]) -> bool:
    """Whether `path` (resolved) is one of `directories` (resolved) or inside one."""
    real = os.path.realpath(path)
    return any(real == d or real.startswith(d.rstrip(os.sep) + os.sep) for d in directories)


def _in_a_workdir(path: str) -> bool:
    """Whether a directory holding `path`, or `path` itself, is a run's workdir: it holds a
    metrics.jsonl, a summary.json or a checkpoint step this project wrote."""
    directory = pathlib.Path(os.path.realpath(path))
    return any(_is_workdir(candidate) for candidate in (directory, *directory.parents))


def _holds_a_workdir(entry: str) -> bool:
    """Whether an import path entry holds a workdir among its directories (runs/)."""
    try:
        return any(_is_workdir(child) for child in pathlib.Path(entry).iterdir() if child.is_dir())
    except OSError:  # not a directory (a zip file), or gone
        return False


def _is_workdir(directory: pathlib.Path) -> bool:
    try:
        outputs = (workdir_lib.METRICS_FILE, workdir_lib.SUMMARY_FILE)
        if any((directory / name).is_file() for name in outputs):
            return True
        return any((directory / CHECKPOINT_DIR).glob(f"*/{STEP_MARKER}"))
    except OSError:
        return False


# --- What a plug-in's values may be called, and the after-evaluation hooks ---------------------

TEST_PREFIX = "test_"  # the evaluation's metrics: test_loss, test_accuracy, ...
# The names the project writes itself: a metrics row's step and training values, a checkpoint's
# progress item (whose fields are checked when it is read back) and TensorBoard's train/ tags.
# A plug-in's metric, loss term or after-evaluation value cannot take one, nor a name starting
# with TEST_PREFIX.
PROJECT_NAMES = frozenset(
    {
        *ITEM_FIELDS["progress"],
        *FIELD_RULES,
        "data_iterator",  # Grain's position
        "init_from_step",
        "loss",
        "accuracy",
        "grad_norm",
        "learning_rate",
        "examples_per_sec",
    }
)


def name_problem(name: object, taken: Collection[str] = ()) -> str | None:
    """Why a plug-in's metric, loss term or hook value cannot be called `name` (None: it
    can): not an identifier, a name the project writes (PROJECT_NAMES, TEST_PREFIX...), or
    one of `taken`."""
    if not isinstance(name, str) or not name.isidentifier():
        return f"{clip(repr(name), QUOTE_CHARS)} is not an identifier"
    if name.startswith(TEST_PREFIX):
        return f"{name!r} starts with {TEST_PREFIX} (the evaluation's metrics)"
    if name in PROJECT_NAMES:
        return f"{name!r} is a name the project writes itself"
    if name in taken:
        return f"{name!r} is taken by one of the run's metrics"
    return None


class PluginFailed(UserError):
    """A plug-in failed while the run trained: the loop saves the steps since the last save,
    then stops with this line."""


def failure(exc: BaseException) -> str:
    """What a plug-in's exception (or sys.exit) says, in a few words."""
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r})"
    return f"{type(exc).__name__}: {reason(exc)}"


def number(value: Any) -> float | None:
    """`value` as a float where it is one real number (a Python, NumPy or JAX scalar), else
    None (a bool, a string, an array of several values)."""
    try:
        array = np.asarray(value)
    except Exception:  # whatever an object's __array__ raises
        return None
    if array.shape != () or array.dtype.kind not in "iuf":
        return None
    return float(array)


EvaluationHook = Callable[[int, dict[str, float], Any], Any]


def after_evaluation(
    hooks: Mapping[str, EvaluationHook],
    step: int,
    tested: dict[str, float],
    run: Any,
    taken: Collection[str],
) -> tuple[dict[str, float], str | None]:
    """Call each hook (name -> hook) with a copy of the evaluation's metrics `tested` at `step`
    and the values the hooks before it added; returns every value they added, each a float,
    and the first hook that asked to end the run (None: none did). A hook that raises or
    exits, returns anything but True, False or None, or adds a value that is no number or
    whose name is `taken` (the run's training metrics) or the project's (`name_problem`) is
    a PluginFailed line naming it."""
    added: dict[str, float] = {}
    stopper = None
    for name, hook in hooks.items():
        given = tested | added
        metrics = dict(given)
        what = f"after-evaluation hook {name}"
        try:
            asked = hook(step, metrics, run)
        except (Exception, SystemExit) as exc:
            raise PluginFailed(f"{what} failed at step {step} ({failure(exc)})") from exc
        if asked is not None and not isinstance(asked, bool | np.bool_):
            raise PluginFailed(
                f"{what} returned {clip(repr(asked), QUOTE_CHARS)} ({type(asked).__name__}) at "
                f"step {step}; it must return True to end the run there, or False or None"
            )
        for key, value in metrics.items():
            if key in given and value is given[key]:
                continue
            problem = name_problem(key, taken)
            if key in given or problem:
                raise PluginFailed(
                    f"{what} set metrics[{clip(repr(key), QUOTE_CHARS)}] at step {step}: "
                    f"{problem or 'an earlier value of the row'}; give it a name of its own, "
                    "e.g. val_loss"
                )
            if (value := number(value)) is None:
                raise PluginFailed(
                    f"{what} set metrics[{key!r}] at step {step} to "
                    f"{clip(repr(metrics[key]), QUOTE_CHARS)} ({type(metrics[key]).__name__}), "
                    "not a number; set a float, e.g. float(value)"
                )
            added[key] = value
        if asked and stopper is None:
            stopper = name
    return added, stopper
