"""A dataset's files read and checked on the host: the `Dataset` every source returns (uint8
images (N, H, W, C), int32 labels, class names, where each split came from) and the readers of
IDX files (found, downloaded, MD5-checked, decompressed once) and of .npz archives. Every fault
in a file is one `UserError` line naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import hashlib
import math
import os
import pathlib
import struct
import urllib.error
import urllib.request
import zipfile
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from absl import logging

from . import errors
from .errors import UserError
from .inference import as_hwc

IMAGES_MAGIC = 2051
LABELS_MAGIC = 2049
GZIP_MAGIC = b"\x1f\x8b"
DOWNLOAD_TIMEOUT_S = 30
CACHE_ROOT = pathlib.Path.home() / ".cache" / "fmnist-flax"
PAYLOAD_DIR = "idx"  # decompressed .gz payloads under CACHE_ROOT (cached_payload)
CLASSES_FILE = "classes.txt"  # a directory's class names, one per line (idx, arrays)
# The four files of an MNIST-format dataset, in the order train images, train labels, test
# images, test labels.
STEMS = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
ARRAY_FILES = ("train.npz", "test.npz")  # the `arrays` dataset's two splits
ARRAY_KEYS = ("images", "labels")  # what each must hold; `pixel_range` is optional
NPY_MAGIC = b"\x93NUMPY"  # how an .npy file starts (an .npz is a zip of them)
DEFLATE_MAX_RATIO = 1100  # deflate never packs more than ~1032 bytes into one
DATA_ADVICE = "put the data file itself there (a symlink to one will do)"
# The most classes a dataset may have: the confusion matrix (in summary.json and the report)
# holds one count per pair, 10**8 at this limit. Millions of names trained, wrote gigabytes
# and failed at the confusion matrix.
MAX_CLASSES = 10_000


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A loaded dataset: uint8 images (N, H, W, C), int32 labels, its class names and where
    each split came from. Build one with `make_dataset`, which checks all of it."""

    name: str
    title: str
    class_names: tuple[str, ...]
    train_images: np.ndarray  # (N, H, W, C) uint8
    train_labels: np.ndarray  # (N,) int32
    test_images: np.ndarray  # (M, H, W, C) uint8
    test_labels: np.ndarray  # (M,) int32
    sources: tuple[str, str]  # where the train and the test split were read from
    origin: str  # what they were read from, for the data table: "IDX files", ".npz files"
    checked: bool  # whether the files matched published checksums

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.train_images.shape[1:])

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def info(self) -> dict:
        """What a checkpoint records so a model can be used without the data, and so a resume
        on other data is noticed: JSON-ready."""
        return {
            "name": self.name,
            "title": self.title,
            "class_names": list(self.class_names),
            "image_shape": list(self.image_shape),
            "examples": [len(self.train_labels), len(self.test_labels)],
            "fingerprint": self.fingerprint(),
        }

    def fingerprint(self) -> str:
        """A hash of every label and of ~512 images spread over both splits (milliseconds):
        other files of the same shape give another one."""
        digest = hashlib.sha256()
        for images, labels in (
            (self.train_images, self.train_labels),
            (self.test_images, self.test_labels),
        ):
            digest.update(np.ascontiguousarray(labels, np.int32).tobytes())
            digest.update(np.ascontiguousarray(images[:: max(1, len(images) // 256)]).tobytes())
        return digest.hexdigest()[:16]


# What names the data a run trains on; a resume whose data differs in any is a config change.
IDENTITY = ("name", "image_shape", "class_names", "examples", "fingerprint")


def identity_changes(saved: dict, now: dict) -> list[dict]:
    """The fields of the data's identity (`Dataset.info`) that differ from what a checkpoint
    recorded, as `dataset.<field>` changes; a field it did not record is not compared."""
    if "image_shape" in saved:
        saved = {**saved, "image_shape": list(as_hwc(saved["image_shape"]))}
    return [
        {"field": f"dataset.{key}", "saved": saved[key], "now": now[key]}
        for key in IDENTITY
        if key in saved and saved[key] != now[key]
    ]


def split_images(images: np.ndarray, name: str, pixel_range: Any) -> np.ndarray:
    """A split's images as uint8 (N, H, W, C): (N, H, W) gains C = 1; floats are mapped from
    `pixel_range` (low, high) to 0..255 when the dataset gives one, refused otherwise."""
    if images.ndim == 3:
        images = images[..., None]
    if images.ndim != 4 or not all(images.shape[1:]):
        raise UserError(
            f"{name}: images of shape {images.shape}; expected (N, H, W) or (N, H, W, C) with "
            "every side positive"
        )
    if pixel_range is not None:
        pixel_range = _pixel_range(pixel_range, name)
    if images.dtype.kind == "f" and pixel_range is not None:
        low, high = pixel_range
        inside = np.isfinite(images).all() and low <= images.min() and images.max() <= high
        if not inside:
            raise UserError(
                f"{name}: float pixels are not all within its pixel_range {low}..{high}"
            )
        return np.round((images.astype(np.float64) - low) * (255 / (high - low))).astype(np.uint8)
    if images.dtype != np.uint8:
        raise UserError(
            f"{name}: images are {images.dtype}; pixels must be uint8 (0..255), or floats with "
            "the range they span given (an .npz's pixel_range = [low, high])"
        )
    return images


def _pixel_range(value: Any, name: str) -> tuple[float, float]:
    """A file's `pixel_range`: two finite numbers, low < high, or one line saying what it is."""
    values = np.asarray(value)
    if values.shape == (2,) and values.dtype.kind in "iuf":
        low, high = (float(v) for v in values)
        if np.isfinite([low, high]).all() and low < high:
            return low, high
    shown = values.tolist() if values.size <= 4 else f"{values.size} values"
    raise UserError(
        f"{name}: pixel_range {shown!r} ({values.dtype}) must be two numbers [low, high] with "
        "low < high, the range its float pixels span"
    )


def split_labels(labels: np.ndarray, name: str) -> np.ndarray:
    """A split's labels, as they are (no cast: 2**32 + 3 must not pass as class 3); they must
    be (N,) whole numbers from 0."""
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise UserError(
            f"{name}: labels of shape {labels.shape} and dtype {labels.dtype}; expected (N,) "
            "whole numbers"
        )
    if len(labels) and labels.min() < 0:
        raise UserError(f"{name}: label {labels.min()} is negative; labels count from 0")
    return labels


def make_dataset(
    name: str,
    title: str,
    class_names: Sequence[str],
    train: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
    *,
    sources: tuple[str, str],
    origin: str,
    checked: bool = False,
    pixel_range: Any = None,
) -> Dataset:
    """A Dataset from (images, labels) per split, every rule checked in one line naming the
    split's source: images uint8 (N, H, W[, C]) (floats only with their `pixel_range`), labels
    (N,) in 0..len(class_names) - 1, counts that pair, the same image shape in both splits."""
    check_class_count(len(class_names), f"{sources[0]}:")
    splits = []
    for (images, labels), source in zip((train, test), sources, strict=True):
        images = split_images(np.asarray(images), source, pixel_range)
        labels = split_labels(np.asarray(labels), source)
        if len(images) != len(labels):
            raise UserError(
                f"{source} has {len(images)} images but {len(labels)} labels; they must pair"
            )
        if not len(images):
            raise UserError(f"{source} holds no examples; each split needs at least one")
        check_labels(labels, source, len(class_names))
        splits.append((images, labels.astype(np.int32)))  # in 0..classes - 1: a cast is exact
    (train_x, train_y), (test_x, test_y) = splits
    if train_x.shape[1:] != test_x.shape[1:]:
        raise UserError(
            f"{sources[0]} holds {train_x.shape[1:]} images but {sources[1]} holds "
            f"{test_x.shape[1:]}; train and test images must be the same shape"
        )
    return Dataset(
        name,
        title,
        tuple(class_names),
        train_x,
        train_y,
        test_x,
        test_y,
        tuple(sources),
        origin,
        checked,
    )


def check_labels(labels: np.ndarray, name: str, num_classes: int) -> None:
    """Every label must name one of the classes: whole numbers in 0..num_classes - 1, checked
    as they are, before any cast."""
    labels = np.asarray(labels)
    if labels.dtype.kind not in "iu":
        raise UserError(f"{name}: labels of dtype {labels.dtype}; expected whole numbers")
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        bad = int(np.flatnonzero((labels < 0) | (labels >= num_classes))[0])
        raise UserError(
            f"{name}: label {labels[bad]} at index {bad} is outside 0..{num_classes - 1}"
        )


def _present(path: pathlib.Path) -> bool:
    """Whether a data file is there to read (absent or a directory: not there). A FIFO, a
    device or a socket, which reading would wait on or never finish, is one line naming it."""
    if not path.exists() or path.is_dir():
        return False
    errors.check_regular(path, DATA_ADVICE)
    return True


def read_class_names(data_dir: pathlib.Path, labels: np.ndarray) -> tuple[str, ...]:
    """A directory's classes: classes.txt (one name per line), or 0..max label."""
    path = data_dir / CLASSES_FILE
    if not _present(path):
        count = int(labels.max(initial=0)) + 1
        missing = count - len(np.unique(labels))
        if missing:  # a stray label would silently add classes nothing is labelled with
            raise UserError(
                f"{data_dir}: the labels run up to {count - 1} but {missing} of the classes "
                f"0..{count - 1} have no example; a stray label? Name the classes in "
                f"{path} (one per line) if some really have none"
            )
        check_class_count(count, f"{data_dir}: the labels 0..{count - 1} name")
        return tuple(str(i) for i in range(count))
    try:
        names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read it ({exc}); one class name per line") from None
    if not names:
        raise UserError(f"{path}: no class names in it; one class name per line")
    check_class_count(len(names), f"{path}:")
    return tuple(names)


def check_class_count(count: int, what: str, fix: str = "is it the right file?") -> None:
    """At most MAX_CLASSES classes; `what` starts the line (the file, what says how many)."""
    if count > MAX_CLASSES:
        raise UserError(
            f"{what} {count:,} classes; at most {MAX_CLASSES:,} are supported (the confusion "
            f"matrix holds a count per pair of classes): {fix}"
        )


@dataclasses.dataclass(frozen=True)
class IdxFile:
    """One published file: its name and the MD5s of the .gz and of its payload (None: unchecked)."""

    stem: str
    gz_md5: str | None = None
    raw_md5: str | None = None

    @property
    def gz_name(self) -> str:
        return self.stem + ".gz"


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """Where a dataset's four files are found and how they are checked."""

    name: str
    title: str  # how tables and figures name it
    files: tuple[IdxFile, IdxFile, IdxFile, IdxFile]
    class_names: tuple[str, ...] | None  # None: from classes.txt in the data directory, or 0..N-1
    system_dir: pathlib.Path | None = None  # where a system package installs the files
    base_url: str | None = None  # where to download them; None: never
    apt_package: str | None = None
    cache_root: pathlib.Path = CACHE_ROOT  # downloads go to cache_root/name

    @property
    def checked(self) -> bool:
        return all(f.gz_md5 or f.raw_md5 for f in self.files)

    @property
    def cache_dir(self) -> pathlib.Path:
        return self.cache_root / self.name

    def how_to_get(self) -> str:
        ways = []
        if self.apt_package:
            ways.append(f"install Debian's package (apt-get install {self.apt_package})")
        ways.append(f"pass --data_dir=DIR holding the four files ({', '.join(STEMS)}, .gz or raw)")
        if self.base_url:
            ways.append(f"allow the download from {self.base_url} into {self.cache_dir}")
        return ", ".join(ways[:-1]) + (" or " if len(ways) > 1 else "") + ways[-1]


def md5_hex(payload: bytes) -> str:
    return hashlib.md5(payload).hexdigest()


def _read(path: pathlib.Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror}); check its permissions") from None


def verified_payload(path: pathlib.Path, spec: IdxFile, title: str = "dataset") -> bytes:
    """The decompressed IDX bytes of `path`; raises if it matches none of the published MD5s.

    A .gz is accepted when its own MD5 is the published one or when its payload has the
    published raw MD5 (Debian re-compresses the files); an uncompressed file needs the raw MD5.
    A spec without MD5s accepts any readable file. A .gz is decompressed once: its payload is
    kept by the .gz's MD5 (`cached_payload`).
    """
    blob = _read(path)
    if blob[:2] != GZIP_MAGIC:
        payload, payload_md5 = blob, None
    else:
        payload, payload_md5 = cached_payload(blob, path)
    if not (spec.gz_md5 or spec.raw_md5):
        return payload
    payload_md5 = payload_md5 or md5_hex(payload)
    if payload_md5 == spec.raw_md5 or (payload is not blob and md5_hex(blob) == spec.gz_md5):
        return payload
    raise UserError(
        f"{path}: MD5 mismatch (expected {spec.gz_md5} (.gz) or payload {spec.raw_md5}, got "
        f"payload {payload_md5}); the file is damaged or not the published {title}: "
        "delete it or replace it"
    )


_PAYLOADS: dict[str, tuple[bytes, str]] = {}  # .gz MD5 -> its payload and the payload's MD5
PAYLOADS_KEPT = 8


def cached_payload(blob: bytes, path: pathlib.Path) -> tuple[bytes, str]:
    """A .gz's payload and the payload's MD5, decompressed once: kept in this process and in
    CACHE_ROOT/idx (named by both MD5s and the payload's CRC-32, checked when read), so a
    run reads a file it has seen instead of decompressing it again (most of a second for
    Fashion-MNIST). A cache that cannot be read or written is skipped."""
    key = md5_hex(blob)
    if key in _PAYLOADS:
        return _PAYLOADS[key]
    directory = CACHE_ROOT / PAYLOAD_DIR
    found = _read_payload_file(directory, key)
    if found is None:
        try:
            payload = gzip.decompress(blob)
        except (OSError, EOFError) as exc:
            raise UserError(f"{path}: not a readable gzip file ({exc}); delete it") from None
        found = payload, md5_hex(payload)
        _write_payload_file(directory, key, *found)
    while len(_PAYLOADS) >= PAYLOADS_KEPT:
        _PAYLOADS.pop(next(iter(_PAYLOADS)))
    _PAYLOADS[key] = found
    return found


def _read_payload_file(directory: pathlib.Path, key: str) -> tuple[bytes, str] | None:
    """The payload of the .gz with MD5 `key` from the cache, if it is there and whole."""
    for file in directory.glob(f"{key}.*.idx"):
        try:
            payload = file.read_bytes()
        except OSError:
            return None
        _, payload_md5, crc = file.name.split(".")[:3]
        if f"{zlib.crc32(payload):08x}" == crc:
            return payload, payload_md5
        file.unlink(missing_ok=True)  # cut short or damaged: decompressed and written again
    return None


def _write_payload_file(directory: pathlib.Path, key: str, payload: bytes, payload_md5: str):
    """Keep a payload in the cache, written whole or not at all (another name, then renamed)."""
    target = directory / f"{key}.{payload_md5}.{zlib.crc32(payload):08x}.idx"
    partial = directory / f".{target.name}.{os.getpid()}.part"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(payload)
        os.replace(partial, target)
    except OSError:  # a full disk or a read-only home: the next run decompresses again
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)


def _candidates(directory: pathlib.Path, spec: IdxFile) -> list[pathlib.Path]:
    return [p for p in (directory / spec.gz_name, directory / spec.stem) if _present(p)]


def _download(spec: IdxFile, dataset: DatasetSpec) -> bytes:
    """Fetch one file into the cache; a file with a wrong MD5 is deleted and fetched once more."""
    dataset.cache_dir.mkdir(parents=True, exist_ok=True)
    path = dataset.cache_dir / spec.gz_name
    url = f"{dataset.base_url}/{spec.gz_name}"
    for attempt in (1, 2):
        partial = path.with_suffix(".gz.part")
        try:
            with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
                partial.write_bytes(response.read())
        except (urllib.error.URLError, OSError) as exc:
            partial.unlink(missing_ok=True)
            reason = getattr(exc, "reason", exc)
            raise UserError(
                f"{dataset.title} not found and the download of {url} failed ({reason}); "
                + dataset.how_to_get()
            ) from None
        partial.replace(path)
        try:
            return verified_payload(path, spec, dataset.title)
        except UserError:
            path.unlink()
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def find_payload(
    spec: IdxFile, dataset: DatasetSpec, data_dir: pathlib.Path | None, download: bool
) -> tuple[bytes, str]:
    """Look for one file in data_dir, else the dataset's cache and system directory, else
    download it. Returns the verified IDX payload and where it came from."""
    directories = [data_dir] if data_dir else [dataset.cache_dir, dataset.system_dir]
    for directory in (d for d in directories if d is not None):
        for path in _candidates(directory, spec):
            try:
                return verified_payload(path, spec, dataset.title), str(path)
            except UserError:
                if directory != dataset.cache_dir or not download:
                    raise
                logging.warning("%s is damaged; deleting it and downloading it again", path)
                path.unlink()
    if data_dir or not download or not dataset.base_url:
        where = f"in {data_dir}" if data_dir else "anywhere"
        raise UserError(
            f"{dataset.title} file {spec.stem} (.gz or raw) not found {where}; "
            + dataset.how_to_get()
        )
    return _download(spec, dataset), f"{dataset.base_url}/{spec.gz_name}"


def parse_idx(payload: bytes, name: str, *, images: bool) -> np.ndarray:
    """Parse an IDX payload: (N, H, W) uint8 images or (N,) uint8 labels, every size checked."""
    magic, header = (IMAGES_MAGIC, ">IIII") if images else (LABELS_MAGIC, ">II")
    header_size = struct.calcsize(header)
    if len(payload) < header_size:
        raise UserError(f"{name}: truncated IDX header ({len(payload)} bytes); delete the file")
    found_magic, count, *dims = struct.unpack_from(header, payload)
    if found_magic != magic:
        raise UserError(
            f"{name}: IDX magic number {found_magic}, expected {magic} "
            f"({'images' if images else 'labels'} file); is it the right file?"
        )
    if images and not all(dims):
        raise UserError(f"{name}: images are {dims[0]}x{dims[1]}; both sides must be positive")
    expected = header_size + count * (dims[0] * dims[1] if images else 1)
    if len(payload) != expected:
        problem = "truncated" if len(payload) < expected else "has trailing bytes"
        raise UserError(
            f"{name}: {problem}: header says {count} items = {expected} bytes, "
            f"file has {len(payload)}; delete it and fetch it again"
        )
    array = np.frombuffer(payload, dtype=np.uint8, offset=header_size)
    return array.reshape(count, *dims) if images else array


def read_npz(path: pathlib.Path) -> dict[str, np.ndarray]:
    """The arrays of one .npz split, read whole; any problem is one line naming the file."""
    if not _present(path):
        raise UserError(
            f"{path} not found; the arrays dataset needs {' and '.join(ARRAY_FILES)} in "
            f"--data_dir, each with {' and '.join(ARRAY_KEYS)}"
        )
    try:
        with path.open("rb") as f:
            start = f.read(len(NPY_MAGIC))
        if start == NPY_MAGIC:
            raise UserError(
                f"{path} holds one .npy array, not an .npz archive; save both arrays with "
                "np.savez(path, images=..., labels=...)"
            )
        npz_headers(path)  # every member's size checked before np.load allocates it
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, AttributeError) as exc:
        reason = errors.reason(exc)
        raise UserError(f"{path}: cannot read it as an .npz archive ({reason})") from None
    missing = [key for key in ARRAY_KEYS if key not in arrays]
    if missing:
        raise UserError(
            f"{path} has no {' or '.join(missing)} array (it holds {', '.join(arrays) or 'none'}); "
            "save it with np.savez(path, images=..., labels=...)"
        )
    return arrays


def npz_headers(path: pathlib.Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each array of an .npz archive, by name: its shape and dtype as its .npy header declares
    them, read without loading the array. A header declaring more bytes than the file can hold
    is refused before np.load allocates them: one declaring (1e11, 28, 28) asked for 71.3 TiB.
    A file that is no archive raises OSError, ValueError, EOFError or zipfile.BadZipFile."""
    with zipfile.ZipFile(path) as archive:
        return {
            member.filename[:-4]: _declared(archive, member, path)
            for member in archive.infolist()
            if member.filename.endswith(".npy")
        }


def _declared(
    archive: zipfile.ZipFile, member: zipfile.ZipInfo, path: pathlib.Path
) -> tuple[tuple[int, ...], np.dtype]:
    """An .npz member's declared (shape, dtype), no more bytes than the member can hold."""
    with archive.open(member) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, _, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"{member.filename}: .npy format {version}; save it with np.savez")
        header = f.tell()
    if dtype.hasobject:  # pickled: its size says nothing, and it is never loaded
        raise ValueError(f"{member.filename[:-4]} holds Python objects, which are never loaded")
    declared = math.prod(shape) * dtype.itemsize
    held = member.file_size - header  # the member's size once unpacked, as the zip records it
    if member.compress_type != zipfile.ZIP_STORED:  # deflate packs at most ~1032:1
        held = min(held, member.compress_size * DEFLATE_MAX_RATIO)
    if declared > held:
        raise UserError(
            f"{path}: {member.filename[:-4]} declares shape {shape} of {dtype} ({declared:,} "
            f"bytes) but the file holds {max(held, 0):,}; the file is damaged or cut short"
        )
    return shape, dtype


def load_arrays(data_dir: pathlib.Path) -> Dataset:
    """`DIR/train.npz` and `DIR/test.npz`, each holding `images` uint8 (N, H, W) or
    (N, H, W, C) and `labels` (N,) integers (float images need `pixel_range`, [low, high]);
    class names from `DIR/classes.txt`, or 0..N-1."""
    paths = [data_dir / name for name in ARRAY_FILES]
    splits = []
    for path in paths:  # each file's floats mapped by its own pixel_range
        arrays = read_npz(path)
        images = split_images(np.asarray(arrays["images"]), str(path), arrays.get("pixel_range"))
        splits.append((images, split_labels(np.asarray(arrays["labels"]), str(path))))
    return make_dataset(
        "arrays",
        f"{data_dir.name} (arrays)",
        read_class_names(data_dir, np.concatenate([labels for _, labels in splits])),
        *splits,
        sources=(str(paths[0]), str(paths[1])),
        origin=".npz files",
    )
