"""Where a run's outputs go: the work directory, its JSON files and what they record."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import pathlib
import resource
import socket
import tempfile
import time
from typing import Any, TextIO

import flax
import jax
import optax

from . import errors
from .errors import UserError, is_digits, warning_line

RUNS_DIR = pathlib.Path("runs")
SUMMARY_FILE = "summary.json"
METRICS_FILE = "metrics.jsonl"
METRICS_LIMIT = 256 << 20  # the most of metrics.jsonl read back (a row is about 100 bytes)
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS)
LOCK_FILE = ".lock"
UMASK = os.umask(0o022)  # the process's umask, read once (reading it means setting it)
os.umask(UMASK)  # held (flock) by the training run that owns the workdir


def prepare_workdir(workdir: str | os.PathLike | None) -> pathlib.Path:
    """Create the run's directory; without one, a fresh `runs/<date>-<time>` is made.

    A directory with checkpoints is resumed; one that holds a finished run without checkpoints
    is refused so its outputs are not overwritten.
    """
    path = pathlib.Path(workdir).expanduser() if workdir else RUNS_DIR
    try:
        if not workdir:
            path = new_run_dir()
        elif (path / SUMMARY_FILE).exists() and not (path / "checkpoints").is_dir():
            raise UserError(
                f"--workdir {path} already holds a finished run ({SUMMARY_FILE}) and no "
                "checkpoints; pass a new --workdir or move that one away"
            )
        path.mkdir(parents=True, exist_ok=True)
        # A unique name: the processes of a multi-process run all probe the same directory.
        tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-").close()
    except OSError as exc:
        reason = _in_the_way(path) or exc.strerror
        if not workdir:
            if path != RUNS_DIR:  # made, then not writable: not left behind
                with contextlib.suppress(OSError):
                    path.rmdir()
            raise UserError(
                f"cannot make a run directory in {RUNS_DIR}/ ({reason}); pass "
                "--workdir=DIR, a directory you can write to"
            ) from None
        raise UserError(
            f"--workdir {path} is not writable ({reason}); pick a directory you can write to"
        ) from None
    return path


def _in_the_way(path: pathlib.Path) -> str | None:
    """What, at `path` or a directory above it, can be no directory, so that the OS says only
    "File exists" or "Not a directory": a file, or a symbolic link to nothing or in a loop
    (named with `errors.not_a_directory`'s words), or None."""
    for place in (path, *path.parents):
        try:
            if place.is_symlink() and not place.exists():
                return f"{place} {errors.not_a_directory(place)}"
            if place.exists() and not place.is_dir():
                return f"{place} is not a directory"
        except OSError:  # a name too long for the filesystem: not a file in the way
            continue
    return None


def new_run_dir() -> pathlib.Path:
    """Make `runs/<date>-<time>`, or `.1`, `.2`, ... after it: made here, not only named, so
    two runs started in the same second never share one."""
    RUNS_DIR.mkdir(exist_ok=True)
    name = time.strftime("%Y%m%d-%H%M%S")
    path, suffix = RUNS_DIR / name, 0
    while True:
        try:
            path.mkdir()
            return path
        except FileExistsError:
            suffix += 1
            path = RUNS_DIR / f"{name}.{suffix}"


def remove_if_unused(path: pathlib.Path) -> None:
    """Remove a run directory with no file but its `.lock` (empty folders aside): a fresh run
    that stops before writing anything leaves nothing behind."""
    with contextlib.suppress(OSError):  # gone, or something appeared in it: it stays
        tree = list(os.walk(path, topdown=False))  # the deepest folders first, `path` last
        if not tree or any(files for _, _, files in tree[:-1]) or set(tree[-1][2]) - {LOCK_FILE}:
            return
        (path / LOCK_FILE).unlink(missing_ok=True)
        for folder, _, _ in tree:
            os.rmdir(folder)


# What a training run owns in its workdir: no --output may land inside these directories or
# over these files (an export over checkpoints/50/model/_METADATA damaged the only checkpoint;
# an eval over report/report.html replaced the report, which the run then did not write again).
REPORT_DIR = "report"
DAMAGED_DIR = "damaged_checkpoints"  # damaged steps are moved here, never deleted
RUN_DIRS = ("checkpoints", "tensorboard", REPORT_DIR, DAMAGED_DIR)
RUN_FILES = (METRICS_FILE, SUMMARY_FILE, LOCK_FILE)


def is_training_workdir(path: pathlib.Path) -> bool:
    """Whether `path` holds a training run: its files, or a step in its checkpoints/."""
    if any((path / name).exists() for name in (*RUN_FILES, "tensorboard")):
        return True
    try:
        return any(is_digits(p.name) for p in (path / "checkpoints").iterdir())
    except OSError:
        return False


def check_not_in_a_run(output: str | os.PathLike) -> None:
    """Refuse an --output (symlinks resolved) inside a training workdir's directories
    (`RUN_DIRS`: checkpoints/, tensorboard/, report/, damaged_checkpoints/) or over its files
    (`RUN_FILES`: metrics.jsonl, summary.json, .lock)."""
    path = pathlib.Path(output).expanduser().absolute()
    with contextlib.suppress(OSError, RuntimeError):  # a symlink loop: the path as given
        path = path.resolve()
    for workdir in path.parents:
        first, *rest = path.relative_to(workdir).parts
        if (first in RUN_DIRS or (first in RUN_FILES and not rest)) and is_training_workdir(
            workdir
        ):
            what = f"{first}/" if first in RUN_DIRS else first
            owned = ", ".join((*(d + "/" for d in RUN_DIRS), *RUN_FILES))
            raise UserError(
                f"--output {output} would land in the training run {workdir}'s own {what}; "
                f"name a path outside what a run owns ({owned})"
            )


def check_output_path(output: str | None) -> None:
    """Refuse an --output that cannot be written or that would overwrite a training run's own
    files, before any work is done."""
    if not output:
        return
    check_not_in_a_run(output)
    path = pathlib.Path(output).expanduser().absolute()
    if path.is_dir():
        raise UserError(
            f"--output {output} is a directory; name a file in it, e.g. {path}/out.json"
        )
    if not path.parent.is_dir():
        raise UserError(f"--output {output}: its directory does not exist")
    if not os.access(path.parent, os.W_OK):
        raise UserError(f"--output {output}: {path.parent} is not writable; pick another place")


def disk_problem(path: pathlib.Path, exc: BaseException | None = None) -> str:
    """'No space left on device; 1.2 MB and 0 inodes free in /w' for a failed write under
    `path`: a filesystem can run out of inodes with megabytes free."""
    reason = getattr(exc, "strerror", None) or (str(exc).splitlines()[0][:160] if exc else "")
    where = path if path.is_dir() else path.parent
    try:
        stats = os.statvfs(where)
        free = f"{stats.f_bavail * stats.f_frsize / 2**20:,.1f} MB"
        if stats.f_files:  # 0: the filesystem has no inode limit
            free += f" and {stats.f_favail:,} inodes"
        where = f"{free} free in {where}"
    except OSError:
        where = f"{where} cannot be examined"
    return f"{reason}; {where}" if reason else where


def remedy(exc: BaseException | None = None) -> str:
    """What to do about a failed write, by its cause (`storage_error`): free space, raise the
    file size limit, or make the place writable."""
    code = getattr(storage_error(exc), "errno", None) if exc else None
    if code == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        now = "" if limit == resource.RLIM_INFINITY else f", {limit:,} bytes now"
        return f"raise the file size limit (ulimit -f{now})"
    if code in (errno.EACCES, errno.EPERM):
        return "make it writable (or run as its owner)"
    if code == errno.EROFS:
        return "make its filesystem writable"
    return "free some space"


def storage_error(exc: BaseException) -> OSError | None:
    """The OSError behind a failed write (no space, no inodes, no permission, read-only), found
    in the exception, its causes, or the message of a library that wraps it in another type."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
            return exc
        for code in STORAGE_ERRNOS:
            if os.strerror(code) in str(exc):
                return OSError(code, os.strerror(code))
        exc = exc.__cause__ or exc.__context__
    return None


def write_atomically(path: pathlib.Path, text: str | bytes) -> None:
    """Write via a uniquely named temporary file in the same directory, then rename: a crash
    or a full disk leaves the old file or the new one, never half of one, and no temporary.
    The temporary is created with O_EXCL and O_NOFOLLOW (mkstemp), so it never follows a
    symlink someone left there. `text` may be bytes (a binary file)."""
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~UMASK)  # mkstemp's 0600 would hide the file from its group
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise


def finite_json(value: Any, **options: Any) -> str:
    """`json.dumps(value)` with every non-finite float written as null: NaN and Infinity are
    not JSON, and other readers refuse them."""

    def finite(value: Any) -> Any:
        if isinstance(value, float):
            return value if math.isfinite(value) else None
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [finite(v) for v in value]
        return value

    return json.dumps(finite(value), allow_nan=False, **options)


def write_json(path: pathlib.Path, value: dict[str, Any]) -> None:
    """Write a JSON file atomically; a failed write is one line that says why."""
    try:
        write_atomically(path, finite_json(value, indent=2, sort_keys=True) + "\n")
    except OSError as exc:
        raise UserError(f"cannot write {path} ({disk_problem(path, exc)})") from None


def read_json(path: pathlib.Path) -> dict[str, Any] | None:
    """A JSON object written by `write_json`, or None when there is none or it cannot be read
    (a crash or someone else left something else there); a FIFO, a device or an oversized
    file is one line (`errors.read_file`)."""
    try:
        value = json.loads(errors.read_file(path))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _is_row(row: Any) -> bool:
    """A metrics row: an object with a whole-number step and numbers (or null, a value that
    was not finite) for its other fields."""
    if not isinstance(row, dict) or type(row.get("step")) is not int:
        return False
    return all(type(v) in (int, float, type(None)) for k, v in row.items() if k != "step")


def read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file, a value written as null (not finite) read as NaN; a
    torn last line (a crash mid-write) or any line that is not a metrics row (bad bytes,
    other types: not written by this project) is left out; a FIFO, a device or an oversized
    file is one line (`errors.read_file`)."""
    try:
        lines = errors.read_file(path, METRICS_LIMIT).decode("utf-8", "replace").splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if _is_row(row):
            rows.append({k: math.nan if v is None else v for k, v in row.items()})
    return rows


class MetricsLog:
    """metrics.jsonl: one JSON object per logged step, flushed as it is written.

    A resumed run keeps the rows up to the step it resumes from and drops later ones (logged
    by a run that died before its next checkpoint) and a torn last line, so each step appears
    once; that rewrite is atomic, so a crash during it loses nothing. The file (or the workdir)
    removed while the run writes it is written again whole, with a warning: the rows are kept
    in memory too.
    """

    def __init__(self, path: pathlib.Path, keep_until: int = 0):
        self.path = path
        if path.is_dir() and not path.is_symlink():
            raise UserError(f"{path} is a directory; move it out of the way and run again")
        self.rows = []
        if keep_until and path.exists():
            self.rows = [row for row in read_jsonl(path) if row["step"] <= keep_until]
        try:
            self._rewrite()
        except OSError as exc:
            raise UserError(f"cannot write {path} ({disk_problem(path, exc)})") from None

    def _rewrite(self) -> None:
        """Write every row so far atomically and append from there."""
        write_atomically(self.path, "".join(finite_json(row) + "\n" for row in self.rows))
        self._file: TextIO = self.path.open("a")

    def write(self, *rows: dict[str, Any]) -> None:
        """Append `rows`: one write and one flush for them all."""
        try:
            if os.fstat(self._file.fileno()).st_nlink == 0:  # unlinked, or replaced by a rename
                self._file.close()
                warning_line(
                    f"{self.path} was removed while this run trained; it is written again with "
                    "every row so far"
                )
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._rewrite()
            self.rows.extend(rows)
            self._file.write("".join(finite_json(row) + "\n" for row in rows))
            self._file.flush()
        except OSError as exc:
            raise UserError(
                f"cannot write {self.path} ({disk_problem(self.path, exc)}); {remedy(exc)} and "
                f"run the same command again: it resumes from the last checkpoint in "
                f"{self.path.parent}, or starts again if none was saved"
            ) from None

    def close(self) -> None:
        with contextlib.suppress(OSError):  # write() has already reported it
            self._file.close()


class Lock:
    """The training run's claim on its workdir: an flock on the workdir directory itself,
    released by the kernel when the process ends however it ends, so a killed run never blocks
    the next. Nothing inside the workdir can be removed or replaced to bypass it (`.lock` only
    tells a second trainer who holds it, and is opened without following a symlink)."""

    def __init__(self, workdir: pathlib.Path):
        self.path = workdir / LOCK_FILE
        self._fd = self._claim(workdir, os.O_RDONLY | os.O_DIRECTORY)
        on_file = self._fd is None  # a filesystem without directory locks (NFS): lock `.lock`
        if on_file:
            self._fd = self._claim(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW)
        if self._fd is None:
            raise UserError(f"cannot lock --workdir {workdir}: its filesystem has no file locks")
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        note = f"pid {os.getpid()} on {socket.gethostname()} since {since}\n".encode()
        try:  # who holds the lock, for the next trainer's message: a new file, never followed
            if on_file:
                os.ftruncate(self._fd, 0)
                os.write(self._fd, note)
                return
            self.path.unlink(missing_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as file:
                file.write(note)
        except OSError:
            pass  # the lock holds without it; only the second trainer's message is poorer

    def _claim(self, path: pathlib.Path, flags: int) -> int | None:
        """An fd of `path` holding an exclusive flock; None if the filesystem cannot lock it."""
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as exc:
            raise UserError(
                f"cannot lock {path} ({disk_problem(path, exc)}); pick a --workdir you can write"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise UserError(
                    f"--workdir {self.path.parent} is in use by a training run "
                    f"({self._holder()}); wait for it to finish, stop it, or pass another --workdir"
                ) from None
            return None
        return fd

    def _holder(self) -> str:
        """What `.lock` says of the holder (a regular file only), or "another process"."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd) as file:
                return file.read(200).strip() or "another process"
        except (OSError, UnicodeDecodeError):
            return "another process"

    def release(self) -> None:
        os.close(self._fd)  # closing drops the flock


def versions() -> dict[str, str]:
    """The library versions a summary records."""
    return {"jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__}


def peak_rss_mb() -> float:
    """This process's peak resident memory. Linux's VmHWM starts afresh at exec, unlike
    ru_maxrss, which a child inherits from the process that started it."""
    try:
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
