"""compilation_cache.drop: which files a damaged program's entries are (the faults themselves,
a full disk and entries cut short, are caused for real in test_faults.py)."""

from __future__ import annotations

from fmnist_flax import compilation_cache

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
