"""compilation_cache.drop: which files a damaged program's entries are (the faults themselves,
a full disk and entries cut short, are caused for real in test_faults.py); entries written
whole or not at all; a cache path that can be no directory, named for what it is."""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest

from fmnist_flax.runtime import compilation_cache
from fmnist_flax.runtime.errors import UserError

KEY = "0123456789abcdef" * 4  # JAX names an entry `{module}-{sha256 hex}-cache`


def test_drop_deletes_that_programs_entries_and_access_times_only(tmp_path):
    names = [
        f"jit_[step]-{KEY}-cache",  # glob characters in a program's name are literal
        f"jit_[step]-{KEY}-atime",
        f"jit_s-{KEY}-cache",  # what "[step]" would match as a glob
        f"jit_[step]-extra-{KEY}-cache",  # another program whose name starts alike
        f"jit_[step]-{KEY}-cache.tmp",  # not JAX's
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    compilation_cache.drop(tmp_path, "jit_[step]")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])


WRITE_PAST_A_LIMIT = """
import resource, signal, sys
from jax._src import lru_cache
from fmnist_flax.runtime import compilation_cache
compilation_cache.write_whole()  # what `use` does
cache = lru_cache.LRUCache(sys.argv[1], max_size=-1)
cache.put("jit_f-" + "0" * 64, b"program")
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    cache.put("jit_g-" + "0" * 64, bytes(100_000))  # stops at 4 KiB, as a full disk would
except OSError as exc:
    print(exc.errno)
"""


@pytest.mark.slow
def test_an_entry_appears_whole_under_its_name_or_not_at_all(tmp_path):
    """JAX's cache as `use` leaves it (no size limit, no file lock): a put writes a file of its
    own and renames it, so a process reading the cache never finds an entry half written; one
    stopped part way (past a file size limit here) leaves nothing behind, where JAX's own
    write left the entry cut short."""
    done = subprocess.run(
        [sys.executable, "-c", WRITE_PAST_A_LIMIT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.strip() == str(errno.EFBIG), done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["jit_f-" + "0" * 64 + "-cache"]
    assert (tmp_path / ("jit_f-" + "0" * 64 + "-cache")).read_bytes() == b"program"


def test_a_path_that_can_be_no_directory_is_named_for_what_it_is(tmp_path):
    """Each was reported as "entries cut short" once JAX failed to read from it."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "loop").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    said = {
        "file": "is a file, not a directory",
        "loop": "is a symbolic link loop",
        "file/sub": "lies under a file, not a directory",
        "dangling": f"is a symbolic link to nothing ({tmp_path / 'nowhere'})",
        "missing/made/when/used": None,
        ".": None,
    }
    assert {name: compilation_cache.not_a_directory(tmp_path / name) for name in said} == said
    with pytest.raises(UserError) as refused:  # before JAX's settings are touched
        compilation_cache.use(tmp_path / "loop")
    assert str(refused.value).startswith(f"--compilation_cache={tmp_path / 'loop'} is a symbolic")
