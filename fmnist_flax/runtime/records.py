"""Record files: any dataset written once as fixed-size records (`--mode=prepare`) and read back
a block at a time straight into NumPy buffers, so that host memory does not grow with the data
and reading scales with threads (`dataset.name=records`).

A directory holds `train-0000k-of-0000n.records` and `test-...` shards, `labels.npz` (each
split's labels: 4 bytes an example, kept in memory) and `info.json` (image shape, class names,
counts, sizes, the source, the set's id and labels.npz's SHA-256). A shard is a header (the
set's id, split, shard number, first record, count, image shape: checked against info.json
when the set is loaded), then its records, each its label as a little-endian int32 and its
H * W * C uint8 pixels (row-major H, W, C), zero-padded to a multiple of 8 bytes, then one
uint64 check a record. A block's keys are put in file order (a radix sort), then read from
read-only mappings READ_ROWS records at a time, each piece gathered by one `np.take`, placed in
the block's buffer and its check folded in place (NumPy copies and computes without the GIL: no
Python object a record, and few NumPy calls a block, so a thread seldom waits to take the GIL
back). Each record's check and label is compared with what was written, once for the block (a
damaged record, a shard of another set or edited labels: one line naming the file). The mapped
pages a source holds stay within RESIDENT_BYTES: past it, all are let go at once.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import itertools
import json
import mmap
import os
import pathlib
import resource
import secrets
import shutil
import signal
import threading
import zipfile
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from . import errors, parallel
from .data_files import Dataset, check_class_count, check_labels, npz_headers
from .errors import UserError

INFO_FILE = "info.json"
LABELS_FILE = "labels.npz"
FORMAT = "fmnist-flax records 2"
OLD_FORMATS = ("fmnist-flax records 1",)  # ArrayRecord shards: read a Python bytes a record
RECORD_LAYOUT = (
    "int32 little-endian label, then H*W*C uint8 pixels (row-major H, W, C), zero-padded to a "
    "multiple of 8 bytes; after the records, one little-endian uint64 check a record"
)
SHARD_SUFFIX = ".records"
MAGIC = b"FMNFREC2"  # a shard's first bytes
HEADER_BYTES = 4096  # the magic, then the header's JSON, zero-padded: records start page-aligned
LABEL_BYTES = 4
WORD = np.dtype("<u8")  # a record's check folds its 8-byte words
SPLITS = ("train", "test")
READ_CHUNK = 8192  # records read or written at once when a whole split is asked for
# Records gathered, placed and folded at once. Each NumPy call hands the GIL back and forth, so
# on a many-core host smaller pieces make more threads read less than one.
READ_ROWS = 8192
WINDOW_BYTES = 8 << 20  # the span of a shard one gather reads at most before it is counted
RESIDENT_BYTES = 64 << 20  # mapped shard bytes a source holds before letting them all go
REGION_BYTES = 2 << 20  # the largest folio the kernel maps file pages in: spans count whole ones
SPARE_FILES = 128  # open files left for all but the shards when --shards is checked
# Odd multipliers, one a word position (words swapped or moved within a record change the
# check), and one for the record's number (a record moved to another place does).
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_INDEX_MULTIPLIER = np.uint64(0xD6E8FEB86659FD93)


def shard_names(split: str, shards: int) -> list[str]:
    return [f"{split}-{k:05d}-of-{shards:05d}{SHARD_SUFFIX}" for k in range(shards)]


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def record_bytes(pixels: int) -> int:
    """A record's size in a shard: the label and the pixels, padded to whole 8-byte words."""
    return -(-(LABEL_BYTES + pixels) // WORD.itemsize) * WORD.itemsize


def fold_checks(rows: np.ndarray, index: np.ndarray, salt: int) -> np.ndarray:
    """Each record's check (n,) uint64: its words times their position's odd multiplier, folded
    by XOR, mixed with its number in the split (`index`) and the set's id (`salt`). NumPy
    computes it without the GIL, and every change of a single word alters it. Folds `rows`
    (n, record_bytes) uint8 away (`_fold`)."""
    folded = np.empty(len(rows), WORD)
    _fold(rows, folded)
    return _mix(folded, index, salt)


def _fold(rows: np.ndarray, out: np.ndarray) -> None:
    """Each record's words times their position's multiplier, folded by XOR, into `out` (n,):
    the products overwrite the words of `rows` in place, so no scratch is written (two NumPy
    calls; every caller passes at most READ_ROWS or READ_CHUNK records)."""
    words = rows.view(WORD)
    np.multiply(words, _multipliers(words.shape[1]), out=words)
    np.bitwise_xor.reduce(words, axis=1, out=out)


def _mix(folded: np.ndarray, index: np.ndarray, salt: int) -> np.ndarray:
    """The checks of folded records (`folded`, changed in place): mixed with each record's
    number in the split and the set's id."""
    mixed = np.multiply(index, _INDEX_MULTIPLIER, dtype=np.uint64, casting="unsafe")
    mixed ^= np.uint64(salt)
    return np.bitwise_xor(folded, mixed, out=folded)


@functools.lru_cache(maxsize=8)
def _multipliers(words: int) -> np.ndarray:
    """Each word position's odd multiplier (1-based position times the golden ratio's)."""
    position = np.arange(1, words + 1, dtype=np.uint64)
    multipliers = position * _GOLDEN | np.uint64(1)
    multipliers.flags.writeable = False
    return multipliers


def prepare(
    dataset_name: str, load: Callable[[], Dataset], output: str | None, shards: int
) -> None:
    """--mode=prepare: the dataset `load()` reads (the config's, `dataset_name`) written as
    `shards` record files per split in the new directory `output`."""
    if not output:
        raise UserError("--mode=prepare needs --output=DIR, a new directory for the record files")
    if dataset_name == "records":
        raise UserError("--mode=prepare reads a dataset to write; it already is record files")
    check_output(output, shards)  # before the dataset is read
    try:
        dataset = load()
    except KeyboardInterrupt as exc:  # SIGINT, or SIGTERM (`errors.Stopped`)
        signum = getattr(exc, "signum", signal.SIGINT)
        raise PrepareStopped(
            f"--mode=prepare stopped by {signal.Signals(signum).name} while reading the "
            "dataset; nothing was written",
            signum,
        ) from None
    info = write_dataset(dataset, output, shards)
    counts = ", ".join(f"{s['examples']:,} {name}" for name, s in info["splits"].items())
    parallel.say(
        f"wrote {dataset.title} ({counts} examples) as record files in {output}; train "
        f"on them with --config.dataset.name=records --data_dir={output} "
        "--config.input_pipeline=grain"
    )


class PrepareStopped(UserError):
    """A stop signal (`errors.STOP_SIGNALS`) stopped --mode=prepare; its exit status is 128 +
    the signal's number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class _Signalled(BaseException):
    """Raised by the signal handler while a prepare writes: not an error the writer handles."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _signals_stop_writing() -> Iterator[None]:
    """While active (in the main thread), the first stop signal raises `_Signalled` so the
    temporary directory is removed (SIGTERM's default would leave it); later ones are ignored
    while that happens."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stopping = []

    def handle(signum: int, frame: Any) -> None:
        if not stopping:
            stopping.append(signum)
            raise _Signalled(signum)

    previous = {sig: signal.signal(sig, handle) for sig in errors.STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def write_dataset(dataset: Any, output: str | os.PathLike, shards: int = 4) -> dict[str, Any]:
    """Write `dataset` (a datasets.Dataset) as record files in `output`, which must not exist
    or be empty; returns its info. Written into a sibling temporary directory and renamed at
    the end, so a stopped or failed prepare never leaves a half-written record set behind: a
    stop signal removes it and is one line (`PrepareStopped`); a killed one's goes at the
    next prepare of the same output."""
    from . import workdir as workdir_lib

    check_output(output, shards)
    smallest = min(SPLITS, key=lambda split: len(getattr(dataset, f"{split}_labels")))
    examples = len(getattr(dataset, f"{smallest}_labels"))
    if not examples:
        raise UserError(
            f"the {smallest} split of {dataset.title} holds no examples; each split needs at "
            "least one"
        )
    if shards > examples:  # 100000 shards of 6,000 examples wrote 200,002 files, most empty
        raise UserError(
            f"--shards={shards:,} is more than the {examples:,} examples of the {smallest} split; "
            f"a shard holds at least one: at most --shards={examples:,}"
        )
    out = pathlib.Path(output).expanduser().absolute()
    if out.exists() and not out.is_dir():
        raise UserError(
            f"--output {output} is a file, not a directory (prepare writes a directory of record "
            "files); name a new directory"
        )
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"--output {output} already exists and is not empty; name a new directory")
    if not out.parent.is_dir():
        raise UserError(f"--output {output}: its directory {out.parent} does not exist")
    _remove_abandoned(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    done = False
    try:
        with _signals_stop_writing():
            try:
                tmp.mkdir()
                info = _write_files(dataset, tmp, shards)
                try:
                    tmp.rename(out)  # over an empty directory too; not over a filled one
                except OSError:
                    raise UserError(
                        f"--output {output} was filled by another process meanwhile; "
                        "nothing of this prepare was kept"
                    ) from None
                done = True
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    except _Signalled as stop:
        name = signal.Signals(stop.signum).name
        raise PrepareStopped(
            f"--mode=prepare stopped by {name} after {output} was complete; it is kept"
            if done
            else f"--mode=prepare stopped by {name} while writing {output}; nothing was kept "
            "(its temporary files are removed): run it again to write the records",
            stop.signum,
        ) from None
    except (OSError, RuntimeError, ValueError) as exc:
        raise UserError(
            f"--mode=prepare could not write {output} "
            f"({workdir_lib.disk_problem(out.parent, exc)}); nothing was kept"
        ) from None
    return info


def check_output(output: str | os.PathLike, shards: int) -> None:
    """Refuse, before anything is read, an --output inside a training run's own files and a
    --shards the reader could not hold open: a split's shards are all open while it is read,
    both splits' at once, under the open-file limit (`ulimit -n`)."""
    from . import workdir as workdir_lib

    if shards < 1:
        raise UserError(f"--shards={shards}: must be >= 1")
    workdir_lib.check_not_in_a_run(output)
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and 2 * shards + SPARE_FILES > soft:
        most = max(1, (soft - SPARE_FILES) // 2)
        raise UserError(
            f"--shards={shards:,}: reading {2 * shards:,} shard files at once needs more open "
            f"files than this process may hold (ulimit -n {soft}); at most --shards={most:,}, "
            "or raise the limit"
        )


def _remove_abandoned(out: pathlib.Path) -> None:
    """Temporary directories of prepares of `out` whose process is gone (killed)."""
    for tmp in out.parent.iterdir():  # not glob: a name with * or ** in it is no pattern
        if not tmp.name.startswith(f".{out.name}.tmp-"):
            continue
        pid = tmp.name.rpartition("-")[2]
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except (ValueError, PermissionError):  # not ours to judge: another user's process
            continue


def _write_files(dataset: Any, tmp: pathlib.Path, shards: int) -> dict[str, Any]:
    """Every file of the record set in `tmp`, under a new random set id; returns its info."""
    set_id = secrets.randbits(64)
    shape = [int(s) for s in dataset.image_shape]
    splits = {}
    labels = {}
    for split in SPLITS:
        images = getattr(dataset, f"{split}_images")
        labels[split] = np.asarray(getattr(dataset, f"{split}_labels"), np.int32)
        names = shard_names(split, shards)
        counts = [len(part) for part in np.array_split(np.arange(len(images)), shards)]
        firsts = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        for k, (name, first, count) in enumerate(zip(names, firsts, counts, strict=True)):
            header = {
                "format": FORMAT,
                "set": f"{set_id:016x}",
                "split": split,
                "shard": k,
                "shards": shards,
                "first": first,
                "count": count,
                "image_shape": shape,
                "record_bytes": record_bytes(int(np.prod(shape))),
            }
            _write_shard(tmp / name, header, images, labels[split], set_id)
        splits[split] = {"examples": len(images), "shards": names, "counts": counts}
    np.savez(tmp / LABELS_FILE, **labels)
    info = {
        "format": FORMAT,
        "record": RECORD_LAYOUT,
        "set": f"{set_id:016x}",
        "name": dataset.name,
        "title": dataset.title,
        "class_names": list(dataset.class_names),
        "image_shape": shape,
        "splits": splits,
        "source": {
            "dataset": dataset.name,
            "files": list(dataset.sources),
            "checked": dataset.checked,
        },
        "files": {p.name: {"bytes": p.stat().st_size} for p in sorted(tmp.iterdir())},
    }
    info["files"][LABELS_FILE]["sha256"] = _sha256(tmp / LABELS_FILE)
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _write_shard(
    path: pathlib.Path, header: dict[str, Any], images: Any, labels: np.ndarray, set_id: int
) -> None:
    """One shard: its header, its records (READ_CHUNK at a time), then their checks."""
    first, count, size = header["first"], header["count"], header["record_bytes"]
    pixels = int(np.prod(header["image_shape"]))
    checks = np.empty(count, WORD)
    with path.open("wb") as f:
        f.write((MAGIC + json.dumps(header).encode()).ljust(HEADER_BYTES, b"\0"))
        for start in range(first, first + count, READ_CHUNK):
            stop = min(first + count, start + READ_CHUNK)
            rows = np.zeros((stop - start, size), np.uint8)
            rows[:, :LABEL_BYTES] = labels[start:stop].astype("<i4").view(np.uint8).reshape(-1, 4)
            rows[:, LABEL_BYTES : LABEL_BYTES + pixels] = _images(images, start, stop)
            f.write(rows.data)  # before the checks fold the rows away
            checks[start - first : stop - first] = fold_checks(rows, np.arange(start, stop), set_id)
        f.write(checks.data)


def _images(images: Any, start: int, stop: int) -> np.ndarray:
    """Images start..stop-1 as (n, H*W*C) uint8: a slice of an array, else one by one (a
    lazy sequence that makes each image on request)."""
    if isinstance(images, np.ndarray):
        return images[start:stop].reshape(stop - start, -1)
    return np.stack([np.asarray(images[i]) for i in range(start, stop)]).reshape(stop - start, -1)


def read_info(directory: pathlib.Path) -> dict[str, Any]:
    """`directory`'s info.json, every file it names present at its recorded size."""
    path = directory / INFO_FILE
    try:
        raw = errors.read_file(path)
    except OSError:
        raise UserError(
            f"{path} is missing: --data_dir for dataset.name=records must be a directory that "
            "--mode=prepare --output=DIR wrote"
        ) from None
    try:
        info = json.loads(raw)
        if isinstance(info, dict) and info.get("format") in OLD_FORMATS:
            raise UserError(
                f"{path}: record files of an older format ({info['format']!r}, read a record "
                f"at a time); write them again with --mode=prepare ({FORMAT!r})"
            )
        _check_info(info)
        files = {name: int(f["bytes"]) for name, f in info["files"].items()}
        for split in SPLITS:
            entry = info["splits"][split]
            if sum(entry["counts"]) != entry["examples"] or not set(entry["shards"]) <= set(files):
                raise ValueError(f"split {split}'s shards and counts disagree")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(
            f"{path} is not a record set's info ({errors.reason(exc)}); "
            "write the records again with --mode=prepare"
        ) from None
    if info.get("format") != FORMAT:
        raise UserError(f"{path}: not a {FORMAT!r} info file; write it again with --mode=prepare")
    for name, size in files.items():
        file = directory / name
        try:
            errors.check_regular(file)  # a FIFO would be read (hashed, mapped) for ever
            held = file.stat().st_size
        except OSError:
            raise UserError(
                f"{file} is missing; write the records again with --mode=prepare"
            ) from None
        if held != size:
            raise UserError(
                f"{file} has {held:,} bytes but {INFO_FILE} says {size:,} "
                "(truncated or replaced); write the records again with --mode=prepare"
            )
    return info


def _short(value: Any) -> str:
    """A JSON value for a one-line message: its repr, cut at 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _set_id(value: Any) -> bool:
    """A set id as prepare writes it: 16 lowercase hexadecimal digits."""
    return isinstance(value, str) and len(value) == 16 and set(value) <= set("0123456789abcdef")


def _check_info(info: Any) -> None:
    """Every field of info.json the reader uses, of the type and range prepare writes: a
    ValueError or TypeError saying which is not."""
    if not isinstance(info, dict):
        raise TypeError(f"a JSON {type(info).__name__}, not an object")
    shape = info["image_shape"]
    if not (
        isinstance(shape, list) and len(shape) == 3 and all(errors.is_whole(s, 1) for s in shape)
    ):
        raise ValueError(
            f"image_shape {_short(shape)} is not three positive whole numbers (H, W, C)"
        )
    if not _set_id(info["set"]):
        raise ValueError(f"set {_short(info['set'])} is not a set id (16 hexadecimal digits)")
    names = info["class_names"]
    if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
        raise ValueError("class_names is not a list of names")
    if not isinstance(info["title"], str):
        raise ValueError(f"title {_short(info['title'])} is not a string")
    source = info["source"]
    if not (isinstance(source, dict) and isinstance(source.get("dataset"), str)):
        raise ValueError(f"source {_short(source)} does not name the dataset it was prepared from")
    if not isinstance(source.get("checked"), bool):
        raise ValueError(
            f"source {_short(source)} does not say whether it was checked (true/false)"
        )
    if not isinstance(info["files"][LABELS_FILE]["sha256"], str):
        raise ValueError(f"{LABELS_FILE}'s sha256 is not a string")
    for split in SPLITS:
        entry = info["splits"][split]
        shards, counts = entry["shards"], entry["counts"]
        if not (
            isinstance(shards, list)
            and all(isinstance(s, str) for s in shards)
            and isinstance(counts, list)
            and len(counts) == len(shards)
            and all(errors.is_whole(c, 0) for c in counts)
            and errors.is_whole(entry["examples"], 0)
        ):
            raise ValueError(f"split {split}'s shards and counts disagree")


class RecordSource:
    """Random access to a split's records: `source[i]` is one (pixels, label), `source[keys]`
    for an index array (any shape) reads every record in bulk, one `np.take` per READ_ROWS
    records of a shard and mapped window, and gives (pixels (*keys.shape, H*W*C) uint8,
    labels (*keys.shape) int32). Each record read is checked (its check, and its label against
    labels.npz's, which `read_splits` sets). A Grain data source; safe to call from several
    threads (the shards are mapped once, on first use, or by `check`)."""

    def __init__(
        self,
        paths: Sequence[pathlib.Path],
        counts: Sequence[int],
        image_shape: Sequence[int],
        set_id: str,
        split: str,
    ):
        self.paths = [pathlib.Path(p) for p in paths]
        self.image_shape = [int(s) for s in image_shape]
        self.pixels = int(np.prod(self.image_shape))
        self.record_bytes = record_bytes(self.pixels)
        self.counts = [int(c) for c in counts]
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.set_id, self.split = set_id, split
        self.salt = int(set_id, 16)
        self.labels = np.empty(0, np.int32)  # labels.npz's, once checked (`read_splits`)
        self._maps: list[tuple[mmap.mmap, np.ndarray, np.ndarray]] | None = None
        self._lock = threading.Lock()
        self._mapped = _Mapped(RESIDENT_BYTES)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getstate__(self) -> dict[str, Any]:  # for worker processes: the maps reopen there
        return {**self.__dict__, "_maps": None, "_lock": None, "_mapped": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__ |= state | {"_lock": threading.Lock(), "_mapped": _Mapped(RESIDENT_BYTES)}

    def check(self) -> None:
        """Map every shard now, each header checked against info.json: a wrong shard is one
        line when the set is loaded, not when training first reads it."""
        self._open()

    def _open(self) -> list[tuple[mmap.mmap, np.ndarray, np.ndarray]]:
        with self._lock:
            if self._maps is None:
                opened: list[mmap.mmap] = []
                try:
                    for k, path in enumerate(self.paths):
                        opened.append(self._map(k, path))
                except UserError:
                    for m in opened:
                        m.close()
                    raise
                self._maps = [self._views(k, m) for k, m in enumerate(opened)]
        return self._maps

    def _map(self, k: int, path: pathlib.Path) -> mmap.mmap:
        """Shard k mapped read-only, its header checked."""
        try:
            errors.check_regular(path)  # replaced since `read_info` looked: opening a FIFO waits
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            raise _unopenable(path, len(self.paths), exc) from None
        try:
            self._check_header(k, path, os.pread(fd, HEADER_BYTES, 0), os.fstat(fd).st_size)
            m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)  # holds a duplicate of fd
        except OSError as exc:
            raise _unopenable(path, len(self.paths), exc) from None
        finally:
            os.close(fd)
        m.madvise(mmap.MADV_RANDOM)
        return m

    def _check_header(self, k: int, path: pathlib.Path, raw: bytes, size: int) -> None:
        again = "write the records again with --mode=prepare"
        try:
            if not raw.startswith(MAGIC):
                raise ValueError("it does not begin as a record shard")
            header = json.loads(raw[len(MAGIC) :].rstrip(b"\0"))
            held = (header["set"], header["split"], header["shard"], header["shards"])
            count, first = int(header["count"]), int(header["first"])
            shape, size_each = list(header["image_shape"]), int(header["record_bytes"])
        except (ValueError, KeyError, TypeError) as exc:
            raise _damaged(path, exc) from None
        if held[0] != self.set_id:
            raise UserError(
                f"{path} is a shard of another record set (set {held[0]}, {INFO_FILE} says "
                f"{self.set_id}): shards of different prepares mixed; {again}"
            )
        if held[1:] != (self.split, k, len(self.paths)):
            raise UserError(
                f"{path} is {held[1]} shard {held[2]} of {held[3]}, not {self.split} shard {k} "
                f"of {len(self.paths)} as {INFO_FILE} names it: shards renamed; {again}"
            )
        if count != self.counts[k]:
            raise UserError(
                f"{path} holds {count:,} records but {INFO_FILE} counts {self.counts[k]:,} "
                f"for it; the counts do not match the shards: {again}"
            )
        if first != self.offsets[k]:
            raise UserError(
                f"{path} holds records from {first:,} on but {INFO_FILE}'s counts place it "
                f"at {self.offsets[k]:,}; {again}"
            )
        if size_each != self.record_bytes:
            raise UserError(
                f"{path}: its records are not {LABEL_BYTES + self.pixels} bytes each "
                f"({LABEL_BYTES} + the {INFO_FILE} image shape {self.image_shape}): it holds "
                f"{shape} images; {again}"
            )
        if shape != self.image_shape:
            raise UserError(
                f"{path} holds {shape} images, not the {INFO_FILE} image shape "
                f"{self.image_shape} (the same pixels in another shape); {again}"
            )
        expected = HEADER_BYTES + count * (self.record_bytes + WORD.itemsize)
        if size != expected:
            raise UserError(
                f"{path} has {size:,} bytes but its header says {expected:,} (truncated or "
                f"extended); {again}"
            )

    def _views(self, k: int, m: mmap.mmap) -> tuple[mmap.mmap, np.ndarray, np.ndarray]:
        """Shard k's records (count, record_bytes) and checks (count,), over its mapping."""
        count = self.counts[k]
        rows = np.frombuffer(m, np.uint8, count * self.record_bytes, HEADER_BYTES)
        checks = np.frombuffer(m, WORD, count, HEADER_BYTES + count * self.record_bytes)
        return m, rows.reshape(count, self.record_bytes), checks

    def __getitem__(self, index: Any) -> tuple[np.ndarray, np.ndarray]:
        keys = np.asarray(index, np.int64)
        if keys.ndim == 0:
            pixels, labels = self.read(keys[None])
            return pixels[0], labels[0]
        pixels, labels = self.read(keys.reshape(-1))
        return pixels.reshape(*keys.shape, self.pixels), labels.reshape(keys.shape)

    def read(
        self, keys: np.ndarray, out: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(pixels (n, H*W*C), labels (n,)) of the records `keys` (n,), in that order; the
        pixels into `out` when given. The keys are read in file order, READ_ROWS at a time:
        each piece gathered from its shard, placed in `out` and folded. The checks and labels
        are compared once for the whole block: few NumPy calls a block, so reader threads
        seldom wait for the GIL."""
        keys = np.asarray(keys, np.int64)
        if len(keys) and (keys.min() < 0 or keys.max() >= len(self)):
            raise IndexError(f"record keys out of range 0..{len(self) - 1}")
        maps = self._open()
        pixels = np.empty((len(keys), self.pixels), np.uint8) if out is None else out
        if pixels.shape != (len(keys), self.pixels) or pixels.dtype != np.uint8:
            raise ValueError(
                f"out is {pixels.dtype} {pixels.shape}, not uint8 {len(keys), self.pixels}"
            )
        order = _ascending(keys, len(self))
        ordered = keys[order]
        cuts = np.searchsorted(ordered, self.offsets).tolist()
        rows = np.empty((min(READ_ROWS, len(keys)), self.record_bytes), np.uint8)
        # Each record's check and label as written, and its words folded as they were read.
        stored, folded = np.empty(len(keys), WORD), np.empty(len(keys), WORD)
        held = np.empty(len(keys), np.int32)
        images, in_rows = pixels, rows[:, LABEL_BYTES : LABEL_BYTES + self.pixels]
        if len(keys) and pixels.flags.c_contiguous:  # each image one item: placed in one copy
            images = _void_rows(pixels, 0, self.pixels)
            in_rows = _void_rows(rows, LABEL_BYTES, self.pixels)
        for k in np.flatnonzero(np.diff(cuts)).tolist():
            self._check_size(k, maps[k][0])
            local = ordered[cuts[k] : cuts[k + 1]] - self.offsets[k]
            for start in range(0, len(local), READ_ROWS):
                at = slice(cuts[k] + start, cuts[k] + min(start + READ_ROWS, len(local)))
                part = rows[: at.stop - at.start]
                self._gather(k, maps[k], local[start : start + READ_ROWS], part, stored[at])
                images[order[at]] = in_rows[: len(part)]
                held[at] = part.view("<i4")[:, 0]
                _fold(part, folded[at])  # folds the piece away: placed and its labels taken
        self._verify(ordered, _mix(folded, ordered, self.salt), stored, held)
        return pixels, self.labels[keys]

    def _check_size(self, k: int, m: mmap.mmap) -> None:
        """Shard k's file still the size it had when mapped: a file cut short under a live
        run is one line at its next read, before pages the file no longer holds are touched
        (a bus error, which no Python code can catch; a cut during a read still is one)."""
        size = m.size()  # the file's size now (fstat), not the mapping's
        if size != len(m):
            raise UserError(
                f"{self.paths[k]} changed size while this run read it ({size:,} bytes, "
                f"{len(m):,} when it was opened): cut short or replaced under a live run; what "
                "was saved is kept: put the whole files back and run the same command to resume"
            )

    def _gather(
        self,
        k: int,
        shard: tuple[mmap.mmap, np.ndarray, np.ndarray],
        local: np.ndarray,
        rows: np.ndarray,
        checks: np.ndarray,
    ) -> None:
        """Records `local` (ascending) of shard k into `rows` and their checks into `checks`,
        one `np.take` per WINDOW_BYTES of the file they span, each span counted in the
        mapped bytes (`_Mapped`) as soon as it is read."""
        m, records, stored = shard
        size = records.shape[1]
        per_window = max(1, WINDOW_BYTES // size)
        first, last = int(local[0]), int(local[-1])
        if first // per_window == last // per_window:
            cuts = [0, len(local)]
        else:
            edges = np.arange(first // per_window + 1, last // per_window + 1) * per_window
            cuts = [0, *np.searchsorted(local, edges).tolist(), len(local)]
        for start, stop in itertools.pairwise(cuts):
            if start == stop:
                continue
            records.take(local[start:stop], axis=0, out=rows[start:stop], mode="clip")
            self._mapped.touch(
                (k, 0),
                m,
                HEADER_BYTES + int(local[start]) * size,
                HEADER_BYTES + int(local[stop - 1] + 1) * size,
            )
        stored.take(local, out=checks, mode="clip")
        end = HEADER_BYTES + len(records) * size
        self._mapped.touch((k, 1), m, end + first * WORD.itemsize, end + (last + 1) * WORD.itemsize)

    def _verify(
        self, keys: np.ndarray, checks: np.ndarray, stored: np.ndarray, held: np.ndarray
    ) -> None:
        """The records `keys` against what was written: their `checks` against the `stored`
        ones, then their `held` labels against labels.npz's. A damaged record, or one whose
        label differs, is one line naming its shard."""
        bad = np.flatnonzero(checks != stored)
        if len(bad):
            key = int(keys[bad[0]])
            raise _damaged(self._path_of(key), ValueError(f"record {key} fails its check"))
        wrong = np.flatnonzero(held != self.labels[keys])
        if len(wrong):
            key = int(keys[wrong[0]])
            raise UserError(
                f"{self._path_of(key)}: record {key}'s label {held[wrong[0]]} differs from "
                f"{LABELS_FILE}'s {self.labels[key]}; write the records again with --mode=prepare"
            )

    def _path_of(self, key: int) -> pathlib.Path:
        return self.paths[int(np.searchsorted(self.offsets, key, side="right")) - 1]


def _void_rows(rows: np.ndarray, offset: int, size: int) -> np.ndarray:
    """Bytes offset..offset+size of each row of the C-contiguous uint8 array `rows`, as one
    void item a row (a view): NumPy places such an item in one copy, faster than a row of
    bytes."""
    return np.ndarray((len(rows),), np.dtype((np.void, size)), rows, offset, rows.strides[:1])


def _ascending(keys: np.ndarray, bound: int) -> np.ndarray:
    """The positions of `keys` (each in 0..bound-1) in ascending order: NumPy's radix sort of
    16-bit integers, one pass for each 16 bits `bound` needs (a comparison sort of the int64
    keys takes several times as long)."""
    if bound > 1 << 32:
        return np.argsort(keys, kind="stable")
    order = np.argsort(keys.astype(np.uint16), kind="stable")  # the low 16 bits
    if bound > 1 << 16:
        order = order[np.argsort((keys >> 16).astype(np.uint16)[order], kind="stable")]
    return order


class _Mapped:
    """The spans of shard mappings read since they were last let go, each widened to whole
    REGION_BYTES (the kernel maps file pages in folios of up to that size) and merged per
    (shard, part) into one span. Once they add up to more than `budget` bytes, every span is
    let go at once: the pages a reader holds mapped stay bounded whatever the data's size, and
    reader threads unmap seldom, in few calls, rather than after every window they read."""

    def __init__(self, budget: int):
        self.budget = budget
        self.spans: dict[tuple[int, int], tuple[mmap.mmap, int, int]] = {}
        self.bytes = 0  # the spans' total
        self.releases = 0
        self.lock = threading.Lock()

    def touch(self, key: tuple[int, int], m: mmap.mmap, start: int, stop: int) -> None:
        first = start - start % REGION_BYTES
        stop = min(len(m), -(-stop // REGION_BYTES) * REGION_BYTES)
        with self.lock:
            if key in self.spans:
                _, was_first, was_stop = self.spans[key]
                self.bytes -= was_stop - was_first
                first, stop = min(first, was_first), max(stop, was_stop)
            self.spans[key] = (m, first, stop)
            self.bytes += stop - first
            if self.bytes <= self.budget:
                return
            spans, self.spans, self.bytes = self.spans, {}, 0
            self.releases += 1
        for m, first, stop in spans.values():
            _let_go(m, first, stop)


def _let_go(m: mmap.mmap, start: int, stop: int) -> None:
    """Unmap the pages of bytes start..stop of `m` (page-aligned start) from this process (the
    page cache keeps them; a later read maps them again)."""
    m.madvise(mmap.MADV_DONTNEED, start, stop - start)


def _unopenable(path: pathlib.Path, shards: int, exc: OSError) -> UserError:
    """Why a shard cannot be opened or mapped: too many open files (a set of many shards
    under a low `ulimit -n`) is not a damaged file."""
    if exc.errno == errno.EMFILE:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return UserError(
            f"{path} cannot be opened: too many open files ({shards:,} shards a split "
            f"held open, ulimit -n {soft}); raise the limit or write the records again "
            "with fewer --shards"
        )
    return _damaged(path, exc)


def _damaged(path: pathlib.Path, exc: BaseException) -> UserError:
    return UserError(
        f"{path} cannot be read ({errors.reason(exc)}); the file is damaged: write the records "
        "again with --mode=prepare"
    )


class RecordImages:
    """A split's images as a lazy array: len, shape, dtype and numpy indexing, reading only
    the records asked for. A slice is a view (nothing read); an int or an index array reads
    those records; `np.asarray` reads them all (a split that fits in memory)."""

    dtype = np.dtype(np.uint8)
    ndim = 4

    def __init__(self, source: RecordSource, shape: Sequence[int], keys: Any = None):
        self.source = source
        self.image_shape = tuple(int(s) for s in shape)
        self.keys = range(len(source)) if keys is None else keys

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.keys), *self.image_shape)

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return RecordImages(self.source, self.image_shape, self.keys[index])
        picks = np.asarray(self.keys, np.int64)[index]  # an int, an index or a mask array
        pixels, _ = self.source[picks]
        return pixels.reshape(*np.shape(picks), *self.image_shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        keys = np.asarray(self.keys, np.int64)
        out = np.empty((len(keys), int(np.prod(self.image_shape))), np.uint8)
        for first in range(0, len(keys), READ_CHUNK):
            self.source.read(keys[first : first + READ_CHUNK], out[first : first + READ_CHUNK])
        out = out.reshape(self.shape)
        return out if dtype is None else out.astype(dtype)

    def reshape(self, *shape: Any) -> np.ndarray:
        return np.asarray(self).reshape(*shape)


def read_splits(
    directory: pathlib.Path,
) -> tuple[dict[str, Any], dict[str, RecordImages], dict[str, np.ndarray]]:
    """The record set in `directory`: its info, each split's images (`RecordImages`) and
    labels; every file checked against info.json (each shard by its header: set, place, count
    and image shape; labels.npz by its arrays' headers, then its SHA-256), each record as it
    is read. The shards are checked first: the counts the labels are held to are theirs."""
    info = read_info(directory)
    shape = tuple(info["image_shape"])
    sources = {}
    for split in SPLITS:
        entry = info["splits"][split]
        sources[split] = RecordSource(
            [directory / s for s in entry["shards"]], entry["counts"], shape, info["set"], split
        )
        sources[split].check()
    labels = _read_labels(directory, info)
    for split in SPLITS:
        sources[split].labels = labels[split]
    images = {split: RecordImages(sources[split], shape) for split in SPLITS}
    return info, images, labels


def _read_labels(directory: pathlib.Path, info: dict[str, Any]) -> dict[str, np.ndarray]:
    """Each split's labels from labels.npz, as int32: their headers checked against info.json's
    counts before anything is loaded (a 2 MB file can unpack to gigabytes), then their values
    against the class count and the file against its SHA-256."""
    path = directory / LABELS_FILE
    again = "write the records again with --mode=prepare"
    try:
        declared = npz_headers(path)
        for split in SPLITS:
            examples = info["splits"][split]["examples"]
            shape, dtype = declared.get(split, (None, None))
            if shape != (examples,) or dtype is None or dtype.kind not in "iu":
                held = f"declares {dtype} {shape}" if shape is not None else "has no such array"
                raise UserError(
                    f"{path}[{split}]: not {examples:,} integer labels as {INFO_FILE} says (it "
                    f"{held}); {again}"
                )
        with np.load(path, allow_pickle=False) as saved:
            labels = {split: np.asarray(saved[split]) for split in SPLITS}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as exc:
        raise UserError(f"{path} cannot be read ({errors.reason(exc)}); {again}") from None
    for split in SPLITS:
        raw = labels[split]  # checked as they are: a cast would make 2**32 + 1 class 1
        outside = np.flatnonzero((raw < 0) | (raw >= len(info["class_names"])))
        if len(outside):
            raise UserError(
                f"{path}[{split}]: label {raw[outside[0]]} at index {outside[0]} is outside "
                f"0..{len(info['class_names']) - 1}; {again}"
            )
    if _sha256(path) != info["files"][LABELS_FILE]["sha256"]:
        raise UserError(
            f"{path} does not match its SHA-256 in {INFO_FILE} (labels edited or the file "
            f"replaced); {again}"
        )
    return {split: labels[split].astype(np.int32) for split in SPLITS}


def load_dataset(data_dir: pathlib.Path) -> Dataset:
    """The `records` dataset: record shards that `--mode=prepare` wrote, checked; images stay
    in the files and are read a batch at a time; labels are read whole (4 bytes each)."""
    info, images, labels = read_splits(data_dir)
    for split in SPLITS:  # training would end at its first evaluation
        if not len(labels[split]):
            raise UserError(
                f"{data_dir / INFO_FILE}: the {split} split holds no examples; each split "
                "needs at least one: write the records again with --mode=prepare from a dataset "
                f"that has {split} examples"
            )
    check_class_count(
        len(info["class_names"]),
        f"{data_dir / INFO_FILE}:",
        "write the records again with --mode=prepare",
    )
    for split in SPLITS:
        check_labels(labels[split], f"{data_dir / LABELS_FILE}[{split}]", len(info["class_names"]))
    return Dataset(
        name="records",
        title=info["title"],
        class_names=tuple(info["class_names"]),
        train_images=images["train"],
        train_labels=labels["train"],
        test_images=images["test"],
        test_labels=labels["test"],
        sources=tuple(str(data_dir / f"{split}-*{SHARD_SUFFIX}") for split in SPLITS),
        origin=f"record files (prepared from {info['source']['dataset']})",
        checked=bool(info["source"]["checked"]),
    )
