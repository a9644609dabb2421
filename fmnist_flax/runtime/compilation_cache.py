"""JAX's persistent compilation cache, mended when an entry is damaged; the options of the
programs that are cheap to run.

JAX writes an entry in place. A disk that fills or a process killed while writing leaves it
cut short, and JAX then warns and compiles that program again in every later run, never
rewriting the entry. Here the entry is deleted when JAX reports it, so the compile that
follows saves it whole; a run says one line about the first fault. An entry is also written
to a file of its own first and renamed into place (`write_whole`): another run reading the
cache meanwhile finds it whole or not at all.

JAX's file lock (`jax_compilation_cache_max_size`) is left off: with it, every write reads the
size and access time of every entry (O(entries), under the lock), and fails outright on a
cache written without it.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pathlib
import re
import threading
import warnings

import jax
from jax._src import lru_cache

from .errors import UserError, not_a_directory, warning_line

# Programs that cost little to run and give booleans or figures only shown (the finiteness
# check, the codelab's gradient check) compile with LLVM's lightest optimisation, in about
# half the CPU time. (The initialisation's floats would change at this level; model.py
# compiles it at level 1, which keeps them.)
QUICK_COMPILE = {"xla_backend_optimization_level": 0}

_FAULT = re.compile(r"Error (reading|writing) persistent compilation cache entry for '(.+?)': (.*)")
# Reads that fail without damage: the disk or its permissions, another run's lock (the tests
# turn it on) or another run deleting the entry.
_NOT_DAMAGE = ("OSError", "PermissionError", "FileNotFoundError", "Timeout")


def use(directory: str | pathlib.Path) -> None:
    """Keep every compiled program in `directory` (made if missing) for later runs; a path
    that can be no directory is refused in one line (--compilation_cache)."""
    directory = pathlib.Path(directory).expanduser()
    problem = not_a_directory(directory)
    if problem:
        raise UserError(
            f"--compilation_cache={directory} {problem}; pass a directory (made if missing), "
            "or '' to run without a compilation cache"
        )
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    write_whole()
    shown = warnings.showwarning
    said = False

    def showwarning(message, category, filename, lineno, file=None, line=None):
        nonlocal said
        found = _FAULT.match(str(message))
        if found is None:
            return shown(message, category, filename, lineno, file, line)
        kind, name, why = found.groups()
        if kind == "writing" or not why.startswith(_NOT_DAMAGE):
            drop(directory, name)  # what is left of it, or what cannot be read
        else:
            kind = "using"
        if not said:  # one line a run: the first fault's (one cause usually makes them all)
            said = True
            warning_line(fault_line(kind, directory, why[:200]))

    warnings.showwarning = showwarning


def write_whole() -> None:
    """Have JAX write each entry of a local cache without a size limit (which takes JAX's file
    lock instead) to a file of its own, renamed into place when complete; one that fails is
    removed. Written in place (jax 0.10.2), an entry another process was still writing read
    as damaged: deleted and compiled again, with a warning."""
    put = lru_cache.LRUCache.put
    if getattr(put, "writes_whole", False):
        return

    def put_whole(cache: lru_cache.LRUCache, key: str, value: bytes) -> None:
        if cache.eviction_enabled or not key or not lru_cache._is_local_filesystem(str(cache.path)):
            put(cache, key, value)
            return
        path = os.path.join(cache.path, f"{key}{lru_cache._CACHE_SUFFIX}")
        if os.path.exists(path):
            return
        part = os.path.join(cache.path, f".{key}.{os.getpid()}.{threading.get_ident()}.part")
        try:
            with open(part, "wb") as file:
                file.write(value)
            os.replace(part, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(part)
            raise

    put_whole.writes_whole = True
    lru_cache.LRUCache.put = put_whole


def drop(directory: pathlib.Path, name: str) -> None:
    """Delete program `name`'s entries (and their access times): the next compile of each
    saves it again."""
    entry = re.compile(rf"{re.escape(name)}-[0-9a-f]{{64}}-(cache|atime)")
    for path in directory.glob(f"{glob.escape(name)}-*"):
        if entry.fullmatch(path.name):
            with contextlib.suppress(OSError):  # read-only: JAX's next read fails as this one
                path.unlink()


def fault_line(kind: str, directory: pathlib.Path, why: str) -> str:
    """The one line a run says about a cache it could not read or write."""
    if kind == "reading":
        return (
            f"the compilation cache {directory} held entries cut short (a full disk, a killed "
            "run, or one still writing them); deleted them: this run compiles those programs "
            "again and saves them whole"
        )
    if kind == "using":
        return (
            f"could not use the compilation cache {directory} ({why}); the run goes on and "
            "compiles what it could not read"
        )
    return (
        f"could not save a compiled program in the compilation cache {directory} ({why}); "
        "the run goes on without saving it (--compilation_cache=DIR picks another directory, "
        "'' none)"
    )
