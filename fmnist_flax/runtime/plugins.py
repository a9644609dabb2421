"""The project's own modules that `config.imports` names: importing them, which runs their
entries apply to, and which of them a checkpoint may import. A workdir is data: no file in it,
or in the current directory, runs as code because a checkpoint names it.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import pathlib
import sys
from collections.abc import Iterator, Sequence
from typing import Any

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
    path without the current directory and `workdir`. A workdir is data: no file in it or in
    the current directory runs as code because a checkpoint names it."""
    if not names:
        return
    with _installed_path(workdir):
        missing = [name for name in names if not _findable(name)]
        if missing:
            raise NotInstalled(
                f"{source} names config.imports {', '.join(missing)}, not found among the "
                "installed modules; a module in the current directory or the workdir is "
                "imported only when the command line names it (importing runs its code): if "
                f'you trust it, pass --config.imports="{tuple(missing)!r}"'
            )
        say(
            f"note: {source} names config.imports {', '.join(names)}; importing them runs "
            "their code"
        )
        import_modules(names)


def _is_module_name(name: object) -> bool:
    return isinstance(name, str) and all(part.isidentifier() for part in name.split("."))


def _findable(name: str) -> bool:
    """Whether the import system finds `name` (its top-level package unless that is imported
    already), without importing it."""
    top = name.partition(".")[0]
    try:
        return importlib.util.find_spec(name if top in sys.modules else top) is not None
    except (ImportError, ValueError):
        return False


@contextlib.contextmanager
def _installed_path(workdir: pathlib.Path) -> Iterator[None]:
    """sys.path without the entries that are the current directory or `workdir`."""
    left_out = {os.path.realpath(workdir)}
    with contextlib.suppress(OSError):  # a removed current directory: '' finds nothing there
        left_out.add(os.path.realpath(os.getcwd()))
    saved = list(sys.path)
    sys.path[:] = [p for p in saved if p and os.path.realpath(p) not in left_out]
    try:
        yield
    finally:
        sys.path[:] = saved
