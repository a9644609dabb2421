"""A table of names a config picks from (`config.model.name`, a loss term, a hook), which a
project's own modules add to, one module's entries apart from another's.

Each entry remembers the module that added it. An entry added by a module of `config.imports`
(or a module of its package) applies only to the runs whose `config.imports` names that module;
the entries the registry is made with, and those added by the template's own modules or any
module no config imports (a notebook), apply to every run. A run sees its entries through
`active(imports)`; a name is refused in one line where it would mean two entries for one run: a
name of every run's taken again, one module adding a name twice, or (when the run starts) a run
importing two modules that add the same name.

A registry of functions may let each ask for more than its fixed arguments by keyword-only
parameters named in its `extras` (a loss term asking for the `model`): `call` passes each
function what it asks for.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from . import plugins
from .errors import UserError

BUILT_IN = None  # the owner of the entries a registry is made with
_EVERY: list[weakref.ref[Registry]] = []  # every registry made


def seen_by(imports: Sequence[str] = ()) -> list[tuple[str, str, Any]]:
    """(registry, name, entry) for every entry of every registry that a run whose
    config.imports is `imports` sees: what a value worked out from them depends on."""
    return [
        (table.what, name, entry)
        for table in (ref() for ref in list(_EVERY))
        if table is not None
        for name, entry in table.active(imports).items()
    ]


class Registry(Mapping):
    """Names -> entries, each entry kept with the module that added it. `registry[name] = entry`
    adds one (from a plug-in's top level, or anywhere); `registry[name]` is the entry of a name
    only one module added; a run reads `active(imports)`."""

    def __init__(
        self, what: str, entries: dict[str, Any] | None = None, extras: tuple[str, ...] = ()
    ):
        self.what, self.extras = what, extras
        _EVERY.append(weakref.ref(self))
        self.owned: dict[str, dict[str | None, Any]] = {
            name: {BUILT_IN: entry} for name, entry in (entries or {}).items()
        }

    def __setitem__(self, name: str, entry: Any) -> None:
        owner = _registering_module()
        entries = self.owned.setdefault(name, {})
        # Another entry under the name clashes where both would apply to one run: one that
        # applies to every run, or one of the same module.
        for taken, held in entries.items():
            if held is not entry and (taken == owner or not plugins.is_plug_in(taken)):
                raise UserError(
                    f"{self.what} {name!r} is taken by {_named(held)}, so {_named(entry)} "
                    "cannot be registered under it; give it another name"
                )
        unknown = [p for p in keyword_only(entry) if p not in self.extras] if self.extras else []
        if unknown:
            raise UserError(
                f"{self.what} {name!r}: its keyword-only {', '.join(unknown)} is not one of "
                f"{', '.join(self.extras)} (what it may ask for)"
            )
        if not any(held is entry for held in entries.values()):  # the same one again: kept
            entries[owner] = entry

    def add(self, entry: Any) -> Any:
        """Add `entry` under its module and name (`my_project.clamp`) and return it: the body
        of a decorator that registers what it decorates."""
        self[_named(entry)] = entry
        return entry

    def __delitem__(self, name: str) -> None:
        del self.owned[name]

    def __getitem__(self, name: str) -> Any:
        entries = self.owned[name]
        if len(entries) > 1:
            raise UserError(f"{self.what} {name!r} {_ambiguous(entries)}; use active(imports)")
        return next(iter(entries.values()))

    def __iter__(self) -> Iterator[str]:
        return iter(self.owned)

    def __len__(self) -> int:
        return len(self.owned)

    def owners(self, name: str) -> list[str | None]:
        """The modules that added an entry under `name` (None: built in)."""
        return list(self.owned.get(name, {}))

    def active(self, imports: Sequence[str] = ()) -> dict[str, Any]:
        """The entries a run whose config.imports is `imports` sees, in the order added."""
        seen = {}
        for name, entries in self.owned.items():
            applies = {o: e for o, e in entries.items() if plugins.applies(o, imports)}
            if len(applies) > 1:
                raise UserError(
                    f"{self.what} {name!r} {_ambiguous(applies)}, all imported by this run; "
                    "rename one of them"
                )
            if applies:
                [seen[name]] = applies.values()
        return seen

    def apply(
        self, imports: Sequence[str], *args: Any, shape: tuple[int, ...], **extras: Any
    ) -> dict[str, Any]:
        """Each entry a run with `imports` sees called on `args` with the `extras` it asks for
        (`call`); one that raises or exits, or returns a value of another shape than `shape`,
        is one line naming it."""
        values = {}
        for name, entry in self.active(imports).items():
            try:
                value = call(entry, *args, **extras)
            except UserError:
                raise
            except (Exception, SystemExit) as exc:
                raise UserError(
                    f"{self.what} {name!r} ({_named(entry)}) failed: {plugins.failure(exc)}"
                ) from exc
            if np.shape(value) != shape:
                raise UserError(
                    f"{self.what} {name!r} ({_named(entry)}) returned shape {np.shape(value)}, "
                    f"not {shape}"
                )
            values[name] = value
        return values

    def asks_for(self, extra: str, imports: Sequence[str] = ()) -> bool:
        """Whether an entry a run with `imports` sees asks for `extra`."""
        return any(extra in keyword_only(entry) for entry in self.active(imports).values())

    def absent(self, name: str, imports: Sequence[str] = ()) -> str:
        """Why `name` is missing from `active(imports)`, as the end of an error line: the
        module of config.imports it needs, or the names there are."""
        owner = next((o for o in self.owned.get(name, {}) if o is not BUILT_IN), None)
        if owner is not None and not plugins.applies(owner, imports):
            return (
                f"is registered by {owner}, which this run's config.imports does not name: add "
                f"it, e.g. --config.imports=\"('{owner}',)\""
            )
        return f"is not one of {', '.join(self.active(imports)) or 'none'}"


def call(fn: Callable[..., Any], *args: Any, **extras: Any) -> Any:
    """`fn(*args)`, with those of `extras` it asks for by keyword-only parameters."""
    asked = keyword_only(fn)
    if missing := [name for name in asked if name not in extras]:
        raise UserError(f"{_named(fn)} asks for {', '.join(missing)}, which is not given here")
    return fn(*args, **{name: extras[name] for name in asked})


@functools.cache
def keyword_only(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The names of a function's keyword-only parameters (none for anything else)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a class or a builtin without a signature
        return ()
    return tuple(p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY)


def _registering_module() -> str | None:
    """The module whose top level is running the registration (the nearest `<module>` frame):
    the plug-in that decorates or assigns an entry as it is imported."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name != "<module>":
        frame = frame.f_back
    return frame.f_globals.get("__name__") if frame is not None else None


def _ambiguous(entries: dict[str | None, Any]) -> str:
    return "is registered by " + " and by ".join(
        f"{owner or 'the template'} ({_named(entry)})" for owner, entry in entries.items()
    )


def _named(entry: Any) -> str:
    """An entry as its module and name say it: `my_project.logit_norm`."""
    return f"{getattr(entry, '__module__', '?')}.{getattr(entry, '__qualname__', repr(entry))}"
