"""Record files: any dataset written once as ArrayRecord shards (`--mode=prepare`) and read back
a batch at a time, so that host memory does not grow with the data (`dataset.name=records`).

A directory holds `train-0000k-of-0000n.array_record` and `test-...` shards, `labels.npz` (each
split's labels: 4 bytes an example, kept in memory) and `info.json` (image shape, class names,
counts, sizes, the source and each file's SHA-256). Each record is one example: its label as a
little-endian int32, then its H * W * C uint8 pixels (row-major H, W, C). Records are written
one per chunk (`group_size:1`, uncompressed) for fast random access; Riegeli's chunk hashes
catch a damaged record when it is read.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import pathlib
import resource
import shutil
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from fmnist_flax import errors
from fmnist_flax.errors import UserError

INFO_FILE = "info.json"
LABELS_FILE = "labels.npz"
FORMAT = "fmnist-flax records 1"
RECORD_LAYOUT = "int32 little-endian label, then H*W*C uint8 pixels (row-major H, W, C)"
LABEL_BYTES = 4
SPLITS = ("train", "test")
WRITER_OPTIONS = "group_size:1,uncompressed"  # one record a chunk: random reads stay cheap
READER_OPTIONS = "readahead_buffer_size:0"  # random access: no read-ahead
READ_CHUNK = 8192  # records read at once when a whole split is asked for
SPARE_FILES = 128  # open files left for all but the shards when --shards is checked


def shard_names(split: str, shards: int) -> list[str]:
    return [f"{split}-{k:05d}-of-{shards:05d}.array_record" for k in range(shards)]


def _sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def write_dataset(dataset: Any, output: str | os.PathLike, shards: int = 4) -> dict[str, Any]:
    """Write `dataset` (a datasets.Dataset) as record files in `output`, which must not exist
    or be empty; returns its info. Written into a sibling temporary directory and renamed at
    the end, so a stopped or failed prepare never leaves a half-written record set behind
    (a killed one's temporary directory goes at the next prepare of the same output)."""
    from fmnist_flax import workdir as workdir_lib

    check_output(output, shards)
    smallest = min(SPLITS, key=lambda split: len(getattr(dataset, f"{split}_labels")))
    examples = len(getattr(dataset, f"{smallest}_labels"))
    if shards > examples:  # 100000 shards of 6,000 examples wrote 200,002 files, most empty
        raise UserError(
            f"--shards={shards:,} is more than the {examples:,} examples of the {smallest} split; "
            f"a shard holds at least one: at most --shards={examples:,}"
        )
    out = pathlib.Path(output).expanduser().absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--output {output} already exists and is not empty; name a new directory")
    if not out.parent.is_dir():
        raise UserError(f"--output {output}: its directory {out.parent} does not exist")
    _remove_abandoned(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
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
    except (OSError, RuntimeError, ValueError) as exc:  # the writer's errors are RuntimeErrors
        raise UserError(
            f"--mode=prepare could not write {output} "
            f"({workdir_lib.disk_problem(out.parent, exc)}); nothing was kept"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def check_output(output: str | os.PathLike, shards: int) -> None:
    """Refuse, before anything is read, an --output inside a training run's own files and a
    --shards the reader could not hold open: a split's shards are all open while it is read,
    both splits' at once, under the open-file limit (`ulimit -n`)."""
    from fmnist_flax import workdir as workdir_lib

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
    """Every file of the record set in `tmp`; returns its info."""
    from array_record.python.array_record_module import ArrayRecordWriter

    splits = {}
    labels = {}
    for split in SPLITS:
        images = getattr(dataset, f"{split}_images")
        labels[split] = np.asarray(getattr(dataset, f"{split}_labels"), np.int32)
        names = shard_names(split, shards)
        counts = []
        parts = np.array_split(np.arange(len(images)), shards)
        for name, rows in zip(names, parts, strict=True):
            writer = ArrayRecordWriter(str(tmp / name), WRITER_OPTIONS)
            for i in rows:
                writer.write(labels[split][i].astype("<i4").tobytes() + images[i].tobytes())
            writer.close()
            counts.append(len(rows))
        splits[split] = {"examples": len(images), "shards": names, "counts": counts}
    np.savez(tmp / LABELS_FILE, **labels)
    info = {
        "format": FORMAT,
        "record": RECORD_LAYOUT,
        "name": dataset.name,
        "title": dataset.title,
        "class_names": list(dataset.class_names),
        "image_shape": list(dataset.image_shape),
        "splits": splits,
        "source": {
            "dataset": dataset.name,
            "files": list(dataset.sources),
            "checked": dataset.checked,
        },
        "files": {
            p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(tmp.iterdir())
        },
    }
    (tmp / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return info


def read_info(directory: pathlib.Path) -> dict[str, Any]:
    """`directory`'s info.json, every file it names present at its recorded size."""
    path = directory / INFO_FILE
    if not path.is_file():
        raise UserError(
            f"{path} is missing: --data_dir for dataset.name=records must be a directory that "
            "--mode=prepare --output=DIR wrote"
        )
    try:
        info = json.loads(path.read_text())
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
        if not file.is_file():
            raise UserError(f"{file} is missing; write the records again with --mode=prepare")
        if file.stat().st_size != size:
            raise UserError(
                f"{file} has {file.stat().st_size:,} bytes but {INFO_FILE} says {size:,} "
                "(truncated or replaced); write the records again with --mode=prepare"
            )
    return info


def _short(value: Any) -> str:
    """A JSON value for a one-line message: its repr, cut at 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _whole(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _check_info(info: Any) -> None:
    """Every field of info.json the reader uses, of the type and range prepare writes: a
    ValueError or TypeError saying which is not."""
    if not isinstance(info, dict):
        raise TypeError(f"a JSON {type(info).__name__}, not an object")
    shape = info["image_shape"]
    if not (isinstance(shape, list) and len(shape) == 3 and all(_whole(s, 1) for s in shape)):
        raise ValueError(
            f"image_shape {_short(shape)} is not three positive whole numbers (H, W, C)"
        )
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
    for split in SPLITS:
        entry = info["splits"][split]
        shards, counts = entry["shards"], entry["counts"]
        if not (
            isinstance(shards, list)
            and all(isinstance(s, str) for s in shards)
            and isinstance(counts, list)
            and len(counts) == len(shards)
            and all(_whole(c, 0) for c in counts)
            and _whole(entry["examples"], 0)
        ):
            raise ValueError(f"split {split}'s shards and counts disagree")


class RecordSource:
    """Random access to a split's records: `source[i]` is one (pixels, label), `source[keys]`
    for an index array (any shape) reads every record in bulk, one read per shard, and gives
    (pixels (*keys.shape, H*W*C) uint8, labels (*keys.shape) int32). A Grain data source;
    safe to call from several threads (the readers are opened once, on first use)."""

    def __init__(self, paths: Sequence[pathlib.Path], counts: Sequence[int], pixels: int):
        self.paths = [pathlib.Path(p) for p in paths]
        self.pixels = int(pixels)
        self.counts = [int(c) for c in counts]
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._readers: list[Any] | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getstate__(self) -> dict[str, Any]:  # for worker processes: readers reopen there
        return {**self.__dict__, "_readers": None, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__ |= state | {"_lock": threading.Lock()}

    def _open(self) -> list[Any]:
        from array_record.python.array_record_module import ArrayRecordReader

        with self._lock:
            if self._readers is None:
                readers = []
                try:
                    for path, count in zip(self.paths, self.counts, strict=True):
                        try:
                            readers.append(ArrayRecordReader(str(path), READER_OPTIONS))
                            opened = readers[-1].ok()
                            held = readers[-1].num_records()
                        except Exception as exc:  # the reader's own error types
                            raise _damaged(path, exc) from None
                        if not opened:  # says nothing more: ask the system why
                            raise _unopenable(path, len(self.paths))
                        if held != count:  # not a damaged shard: counts that do not match it
                            raise UserError(
                                f"{path} holds {held:,} records but {INFO_FILE} counts "
                                f"{count:,} for it; the counts do not match the shards: write "
                                "the records again with --mode=prepare"
                            )
                except UserError:
                    for reader in readers:  # one that failed to open raises on close
                        with contextlib.suppress(Exception):
                            reader.close()
                    raise
                self._readers = readers
        return self._readers

    def __getitem__(self, index: Any) -> tuple[np.ndarray, np.ndarray]:
        keys = np.asarray(index, np.int64)
        if keys.ndim == 0:
            pixels, labels = self.read(keys[None])
            return pixels[0], labels[0]
        pixels, labels = self.read(keys.reshape(-1))
        return pixels.reshape(*keys.shape, self.pixels), labels.reshape(keys.shape)

    def read(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(pixels (n, H*W*C), labels (n,)) of the records `keys` (n,), in that order."""
        if len(keys) and (keys.min() < 0 or keys.max() >= len(self)):
            raise IndexError(f"record keys out of range 0..{len(self) - 1}")
        readers = self._open()
        size = LABEL_BYTES + self.pixels
        rows = np.empty((len(keys), size), np.uint8)
        shard = np.searchsorted(self.offsets, keys, side="right") - 1
        for k in np.unique(shard):
            where = np.flatnonzero(shard == k)
            try:
                raw = readers[k].read((keys[where] - self.offsets[k]).tolist())
            except Exception as exc:  # a damaged chunk: the reader's own error types
                raise _damaged(self.paths[k], exc) from None
            joined = b"".join(raw)
            if len(joined) != len(where) * size:
                raise UserError(
                    f"{self.paths[k]}: its records are not {size} bytes each ({LABEL_BYTES} + the "
                    f"{INFO_FILE} image shape); write the records again with --mode=prepare"
                )
            rows[where] = np.frombuffer(joined, np.uint8).reshape(len(where), size)
        labels = rows[:, :LABEL_BYTES].copy().view("<i4").reshape(-1).astype(np.int32)
        return rows[:, LABEL_BYTES:], labels


def _unopenable(path: pathlib.Path, shards: int) -> UserError:
    """Why a shard the reader could not open cannot be opened: too many open files (a set of
    many shards under a low `ulimit -n`) is not a damaged file."""
    try:
        os.close(os.open(path, os.O_RDONLY))
    except OSError as exc:
        if exc.errno == errno.EMFILE:
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            return UserError(
                f"{path} cannot be opened: too many open files ({shards:,} shards a split "
                f"held open, ulimit -n {soft}); raise the limit or write the records again "
                "with fewer --shards"
            )
        return _damaged(path, exc)
    return _damaged(path, RuntimeError("the record reader could not open it"))


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
            out[first : first + READ_CHUNK] = self.source.read(keys[first : first + READ_CHUNK])[0]
        out = out.reshape(self.shape)
        return out if dtype is None else out.astype(dtype)

    def reshape(self, *shape: Any) -> np.ndarray:
        return np.asarray(self).reshape(*shape)


def read_splits(
    directory: pathlib.Path,
) -> tuple[dict[str, Any], dict[str, RecordImages], dict[str, np.ndarray]]:
    """The record set in `directory`: its info, each split's images (`RecordImages`) and
    labels; every file checked against info.json, and the first and last record of each split
    against labels.npz (a wrong image shape or mixed-up files: one line)."""
    info = read_info(directory)
    shape = tuple(info["image_shape"])
    try:
        with np.load(directory / LABELS_FILE) as saved:
            labels = {split: np.asarray(saved[split]) for split in SPLITS}
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(
            f"{directory / LABELS_FILE} cannot be read ({errors.reason(exc)}); "
            "write the records again with --mode=prepare"
        ) from None
    images = {}
    for split in SPLITS:
        entry = info["splits"][split]
        name = f"{directory / LABELS_FILE}[{split}]"
        if labels[split].shape != (entry["examples"],) or labels[split].dtype.kind not in "iu":
            raise UserError(
                f"{name}: not {entry['examples']:,} integer labels as {INFO_FILE} "
                "says; write the records again with --mode=prepare"
            )
        raw = labels[split]  # checked as they are: a cast would make 2**32 + 1 class 1
        outside = np.flatnonzero((raw < 0) | (raw >= len(info["class_names"])))
        if len(outside):
            raise UserError(
                f"{name}: label {raw[outside[0]]} at index {outside[0]} is outside "
                f"0..{len(info['class_names']) - 1}; write the records again with --mode=prepare"
            )
        source = RecordSource(
            [directory / s for s in entry["shards"]], entry["counts"], int(np.prod(shape))
        )
        ends = np.unique([0, len(source) - 1])[: len(source)]
        if not np.array_equal(source[ends][1], labels[split][ends]):
            raise UserError(
                f"{directory}: the {split} records' labels differ from "
                f"{LABELS_FILE}; write the records again with --mode=prepare"
            )
        images[split] = RecordImages(source, shape)
    return info, images, {split: labels[split].astype(np.int32) for split in SPLITS}
