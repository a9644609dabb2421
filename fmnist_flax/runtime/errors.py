"""The one exception type for mistakes a user can fix; the CLI prints it as one line.
`read_file` reads the program's own files, refusing in such a line what it cannot read.

FMNIST_FLAX_DEBUG=1 (or main.py's --debug) adds the full traceback above every error line;
FMNIST_FLAX_DEBUG=0 or false leaves it out.
"""

import contextlib
import errno
import os
import pathlib
import re
import signal
import stat
import sys
import threading
import traceback
import typing
from collections.abc import Callable, Iterator
from typing import Any

DEBUG_VARIABLE = "FMNIST_FLAX_DEBUG"
FALSE_WORDS = ("", "0", "false", "f", "no", "n", "off")  # what turns the variable off
REASON_CHARS = 240  # a library's reason longer than this is shortened at a boundary
QUOTE_CHARS = 60  # how much of a value (a field's, a JSON item's) an error line quotes
ELLIPSIS = " ..."  # where a shortened text leaves something out
FILE_LIMIT = 16 << 20  # the most `read_file` reads of one of the program's own files by default
READ_BYTES = 1 << 20  # what `read_file` reads at once
OWN_FILE_ADVICE = "move it away (or put back the file this program wrote there) and run again"
# A repr that names an object rather than saying anything: TensorStore's errors end in
# `See full TensorStore details: <bound method ...spec of TensorStore({...})>`.
_OBJECT_REPR = re.compile(r"<(bound method|function|built-in|[\w.]+ object at 0x)")
_TENSORSTORE_SPEC = re.compile(r"\s*\[tensorstore_spec='.*$")  # the JSON spec it appends
_LINE_BREAK = re.compile(r"\s*\n\s*")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


class UserError(Exception):
    """Bad input (flags, files, directories): the message says what is wrong and how to fix it."""


# The signals that stop a run with one line, after saving the step training reached: Ctrl-C,
# `kill`, the terminal closing (SIGHUP) and Ctrl-\ (SIGQUIT, which would dump core).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
PIPE_CLOSED_STATUS = 128 + signal.SIGPIPE  # what a shell reports for a writer stopped by SIGPIPE


class Stopped(KeyboardInterrupt):
    """SIGTERM, SIGHUP or SIGQUIT outside training, once `stop_raises` is set: handled
    wherever Ctrl-C is, with its own exit status."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__()
        self.signum = signum


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped(signum)


def stop_raises() -> None:
    """From here on SIGINT raises KeyboardInterrupt and the other STOP_SIGNALS `Stopped` (its
    subclass); training catches them all itself, to save first."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in STOP_SIGNALS[1:]:
        signal.signal(signum, _raise_stopped)


class OutputFailed(UserError):
    """A write to the standard output failed (`GuardedOutput`): one line naming the cause,
    with a closed pipe's exit status for a reader that left, else 1."""

    def __init__(self, cause: OSError, done: str = "stopped; checkpoints saved so far are kept"):
        super().__init__(f"{output_problem(cause)}; {done}")
        self.exit_code = output_status(cause)


def output_problem(cause: OSError) -> str:
    """What went wrong with the standard output, by its cause, in words a user acts on."""
    said = f"{cause.strerror or cause}"
    if cause.errno == errno.EPIPE:
        return "the output was closed by the command reading it (`| head`?)"
    if cause.errno == errno.EBADF:
        return f"the standard output is closed ({said}: started with `>&-`?)"
    if cause.errno == errno.EFBIG:
        return f"the output could not be written ({said}: the file size limit, `ulimit -f`)"
    if cause.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the output could not be written ({said}: a full disk or quota, or /dev/full)"
    if cause.errno == errno.EIO:
        return f"the output could not be written ({said}: its terminal was closed?)"
    return f"the output could not be written ({said})"


def output_status(cause: OSError) -> int:
    """The exit status of a run whose output failed: a pipe's writer's for a reader that
    left, else 1."""
    return PIPE_CLOSED_STATUS if cause.errno == errno.EPIPE else 1


class GuardedOutput:
    """The standard output, whose first failed write (a full disk, /dev/full, `ulimit -f`, a
    reader that left) is said once: from then on the stream writes into /dev/null, and
    `listener` hears of the failure (training then saves the step it reached and stops);
    with no listener, that write raises `OutputFailed`."""

    def __init__(self, stream: typing.TextIO):
        self.stream = stream
        self.failure: OSError | None = None
        self.listener: Callable[[OSError], None] | None = None
        self._lock = threading.Lock()  # the loop and the metrics writer's thread both print

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as exc:
            self._failed(exc)
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as exc:
            self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        """Send the stream, and what its buffer holds, to /dev/null; tell the listener, or
        raise `OutputFailed`, the first time."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = exc
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.stream.fileno())
            os.close(null)
            with contextlib.suppress(OSError):
                self.stream.flush()
        if self.listener is not None:
            self.listener(exc)
        else:
            raise OutputFailed(exc) from exc

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def guard_output() -> GuardedOutput:
    """Put `GuardedOutput` around sys.stdout (once). A standard output closed from the start
    (`>&-`) is refused in one line: nothing could be said, and the first file opened would
    take its place, receiving what is printed."""
    if isinstance(sys.stdout, GuardedOutput):
        return sys.stdout
    if sys.stdout is None:
        raise OutputFailed(
            OSError(errno.EBADF, os.strerror(errno.EBADF)),
            "give it a file or /dev/null (`> run.log`, `> /dev/null`); nothing was done",
        )
    sys.stdout = GuardedOutput(sys.stdout)
    return sys.stdout


@contextlib.contextmanager
def output_listener(listener: Callable[[OSError], None]) -> Iterator[None]:
    """While inside, a failed write to the guarded standard output calls `listener` with its
    cause instead of raising (at once if it failed before); elsewhere, or unguarded, nothing."""
    guard = sys.stdout if isinstance(sys.stdout, GuardedOutput) else None
    if guard is None:
        yield
        return
    previous, guard.listener = guard.listener, listener
    if guard.failure is not None:
        listener(guard.failure)
    try:
        yield
    finally:
        guard.listener = previous


class FileRefused(UserError):
    """`read_file`'s refusal of a FIFO, a device or a socket, or of a file larger than the
    program writes: something put there, not damage a crash leaves, so never skipped as such."""


def is_whole(value: object, least: int = 0) -> bool:
    """Whether a value read from a user (a flag, a JSON file) is a whole number, not a bool,
    of at least `least`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def is_digits(text: str) -> bool:
    """Whether `text` is a whole number in ASCII digits, as `int` reads it: `str.isdigit`
    also accepts '²' and the like, which `int` refuses."""
    return text.isascii() and text.isdigit()


def read_file(path: str | os.PathLike, limit: int = FILE_LIMIT) -> bytes:
    """The bytes of one of the program's own files (its JSON, metrics, headers): a regular file,
    or a symlink to one (`check_regular`), of at most `limit` bytes; a larger one is refused in
    one line naming it, before it fills memory."""
    check_regular(path)  # before opening it: opening a FIFO waits, opening a device can act
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    chunks, size = [], 0
    try:
        held = os.fstat(fd)
        _refuse(path, held.st_mode)  # replaced in between
        size = held.st_size  # too large: refused unread; else read to its end (it may grow)
        read = 0
        while size <= limit and (chunk := os.read(fd, READ_BYTES)):
            chunks.append(chunk)
            read += len(chunk)
            size = max(size, read)
    finally:
        os.close(fd)
    if size > limit:
        raise too_large(path, limit)
    return b"".join(chunks)


def check_size(path: str | os.PathLike, limit: int) -> None:
    """Refuse, unread, a file of more than `limit` bytes (`too_large`): what a library reads
    whole would fill memory first."""
    if os.stat(path).st_size > limit:
        raise too_large(path, limit)


def too_large(path: str | os.PathLike, limit: int) -> FileRefused:
    """The line for one of the program's files that holds more than its kind can."""
    return FileRefused(
        f"{path} holds more than the {limit:,} bytes this program reads of it, far more than "
        "it writes there; move it away (or put back the file it wrote) and run again"
    )


def check_regular(path: str | os.PathLike, advice: str = OWN_FILE_ADVICE) -> None:
    """Refuse, in one line naming it and ending in `advice`, a FIFO, a device or a socket (or
    a symlink to one) where the program reads a file: reading one waits for ever or never
    ends. A missing file or a directory raises the OSError that reading it does."""
    _refuse(path, os.stat(path).st_mode, advice)


def _refuse(path: str | os.PathLike, mode: int, advice: str = OWN_FILE_ADVICE) -> None:
    """`check_regular` of a file of this mode."""
    kind = next((kind for test, kind in _KINDS if test(mode)), "a special file")
    if kind is None:
        return
    if kind == "a directory":
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    link = f" (a symbolic link to {os.readlink(path)})" if os.path.islink(path) else ""
    raise FileRefused(f"{path} is {kind}{link}, not a regular file; {advice}")


def not_a_directory(path: pathlib.Path) -> str | None:
    """Why `path` can be no directory (a file, a symbolic link loop or to nothing, a path
    under a file), or None; what only permissions forbid is left to whoever writes there."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:  # made when missing, unless a symbolic link names it
        return f"is a symbolic link to nothing ({os.readlink(path)})" if path.is_symlink() else None
    except NotADirectoryError:
        return "lies under a file, not a directory"
    except OSError as exc:
        return "is a symbolic link loop" if exc.errno == errno.ELOOP else None
    if stat.S_ISDIR(mode):
        return None
    return "is a file, not a directory" if stat.S_ISREG(mode) else "is not a directory"


_KINDS = (
    (stat.S_ISREG, None),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def error_line(message: str) -> None:
    """How every user-facing error reaches the terminal: one line on stderr (a line break
    inside a library's message joins the line); nothing where stderr cannot be written."""
    _say_on_stderr(f"error: {_LINE_BREAK.sub(' ', message.strip())}")


def warning_line(message: str) -> None:
    """An output the run goes on without (TensorBoard, the report): one line on stderr."""
    _say_on_stderr(f"warning: {message}")


def _say_on_stderr(line: str) -> None:
    """`line` on stderr, unless it cannot be written (closed, a terminal hung up, full): then
    there is nowhere to say it, and the exit status tells."""
    if sys.stderr is None:  # closed from the start (`2>&-`): print would use stdout
        return
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


def debugging() -> bool:
    """Whether errors come with their full traceback: FMNIST_FLAX_DEBUG set to anything but
    a false word (0, false, no, off), or --debug on the command line, read from sys.argv: a
    flag mistake is reported before absl has parsed the flags."""
    if os.environ.get(DEBUG_VARIABLE, "").strip().lower() not in FALSE_WORDS:
        return True
    wanted = False
    for arg in sys.argv[1:]:
        name, given, value = arg.lstrip("-").partition("=")
        if name in ("debug", "nodebug"):
            wanted = name == "debug" and (not given or value.lower() in ("true", "t", "1"))
    return wanted


def print_traceback(exc: BaseException | None) -> None:
    """With `debugging()`, `exc`'s whole chain on stderr, oldest first, the causes a one-line
    error hides (`raise ... from None`) included; without an exception, where it was said."""
    if not debugging():
        return
    if exc is None:
        traceback.print_stack(sys._getframe(1), file=sys.stderr)
        return
    chain: list[BaseException] = []
    while exc is not None and exc not in chain:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    for link in reversed(chain):
        text = traceback.format_exception(type(link), link, link.__traceback__, chain=False)
        print("".join(text), file=sys.stderr, end="", flush=True)


def reason(exc: BaseException) -> str:
    """What went wrong, in a few words: the exception's first line (object reprs and
    TensorStore specs cut out), followed by its explicit cause's, shortened at a boundary
    (`shorten`); its type when that says nothing."""
    text = _said(exc)
    if exc.__cause__ is not None:
        said = _said(exc.__cause__)
        text = f"{text}: {said}" if text and said else text or said
    return shorten(text) if text else type(exc).__name__


def _said(exc: BaseException) -> str:
    """An exception's own first line, without object reprs, TensorStore specs, or the
    clause that introduced a repr (`See full TensorStore details:`)."""
    lines = str(exc).strip().splitlines()
    text = _TENSORSTORE_SPEC.sub("", lines[0]) if lines else ""
    found = _OBJECT_REPR.search(text)
    if found:
        kept = _SENTENCE_END.split(text[: found.start()].rstrip())
        text = " ".join(kept[:-1] if kept[-1].endswith(":") else kept)
    return text.strip().rstrip(":").strip()


def shorten(text: str, limit: int = REASON_CHARS) -> str:
    """`text` in at most `limit` characters, never cut inside a word: a chain of nested
    reasons (`what: where: cause`) keeps its first and last links (the cause); prose keeps
    its first sentences; else it ends at a word with an ellipsis."""
    if len(text) <= limit:
        return text
    links = text.split(": ")
    for first in range(2, len(links)):
        shortened = f"{links[0]}:{ELLIPSIS}: {': '.join(links[first:])}"
        if len(shortened) <= limit:
            return shortened
    kept = ""
    for sentence in _SENTENCE_END.split(text):
        if len(kept) + 1 + len(sentence) + len(ELLIPSIS) > limit:
            break
        kept = f"{kept} {sentence}".strip()
    return kept + ELLIPSIS if kept else clip(text, limit)


def clip(text: str, limit: int) -> str:
    """`text` in at most `limit` characters, ending at a word with an ellipsis when cut."""
    if len(text) <= limit:
        return text
    return text[: limit - len(ELLIPSIS)].rsplit(" ", 1)[0] + ELLIPSIS
