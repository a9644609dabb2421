"""A table of names a config picks from (`config.model.name`, ...), which a project's own
modules add to: a name already taken is refused in one line, so a module of `config.imports`
cannot replace a built-in entry by accident.

API: `Registry(what, entries)`.
"""

from __future__ import annotations

from typing import Any

from fmnist_flax.runtime.errors import UserError


class Registry(dict):
    """A dict whose names, once set, keep their entry: setting one again to another entry is a
    one-line error naming both (to change a built-in, edit the module that defines it)."""

    def __init__(self, what: str, entries: dict[str, Any] | None = None):
        super().__init__(entries or {})
        self.what = what

    def __setitem__(self, name: str, entry: Any) -> None:
        if name in self and self[name] is not entry:
            raise UserError(
                f"{self.what} {name!r} is taken by {_named(self[name])}, so {_named(entry)} "
                f"cannot be registered under it; give it another name"
            )
        super().__setitem__(name, entry)


def _named(entry: Any) -> str:
    return f"{getattr(entry, '__module__', '?')}.{getattr(entry, '__qualname__', repr(entry))}"
