"""The project's own modules that `config.imports` names: importing them, which runs their
entries apply to, and which of them a checkpoint may import. A workdir is data: no file
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
from collections.abc import Sequence
from typing import Any

from . import workdir as workdir_lib
from .checkpoint import CHECKPOINT_DIR, STEP_MARKER
from .errors import QUOTE_CHARS, UserError, clip
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
    any other workdir or a `runs/` directory beside an import path entry (the repository's,
    which Python imports as a namespace package). A workdir is data: no file in one runs as
    code because a checkpoint names it."""
    if not names:
        return
    data = [os.path.realpath(workdir)]
    with contextlib.suppress(OSError):  # a removed current directory holds nothing
        data.append(os.path.realpath(os.getcwd()))
    data += [os.path.realpath(os.path.join(p or ".", workdir_lib.RUNS_DIR)) for p in sys.path]
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


def _is_workdir(directory: pathlib.Path) -> bool:
    try:
        outputs = (workdir_lib.METRICS_FILE, workdir_lib.SUMMARY_FILE)
        if any((directory / name).is_file() for name in outputs):
            return True
        return any((directory / CHECKPOINT_DIR).glob(f"*/{STEP_MARKER}"))
    except OSError:
        return False
