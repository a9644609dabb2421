"""The datasets a config can name: find, verify and parse four IDX files on the host.

`config.dataset.name` picks a `DatasetSpec` from `DATASETS`: `fashion_mnist` (the default) and
`mnist` are checked against their published MD5s; `idx` takes any directory of the four IDX
files from `--data_dir`, unchecked, with class names from its `classes.txt`. Image shape and
the number of classes come from the loaded data, never from constants.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import pathlib
import struct
import urllib.error
import urllib.request

import ml_collections
import numpy as np
from absl import logging

from fmnist_flax.errors import UserError

IMAGES_MAGIC = 2051
LABELS_MAGIC = 2049
GZIP_MAGIC = b"\x1f\x8b"
DOWNLOAD_TIMEOUT_S = 30
CACHE_ROOT = pathlib.Path.home() / ".cache" / "fmnist-flax"
CLASSES_FILE = "classes.txt"  # the `idx` dataset's class names, one per line
# The four files of an MNIST-format dataset, in the order train images, train labels, test
# images, test labels.
STEMS = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
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


def _published(*md5s: str) -> tuple[IdxFile, ...]:
    """IdxFiles from (gz, raw) MD5 pairs in STEMS order."""
    return tuple(IdxFile(stem, *md5s[2 * i : 2 * i + 2]) for i, stem in enumerate(STEMS))


DATASETS = {
    "fashion_mnist": DatasetSpec(
        "fashion_mnist",
        "Fashion-MNIST",
        _published(
            "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "f4a8712d7a061bf5bd6d2ca38dc4d50a",
            "25c81989df183df01b3e8a0aad5dffbe",
            "9018921c3c673c538a1fc5bad174d6f9",
            "bef4ecab320f06d8554ea6380940ec79",
            "8181f5470baa50b63fa0f6fddb340f0a",
            "bb300cfdad3c16e7a12a480ee83cd310",
            "15d484375f8d13e6eb1aabb0c3f46965",
        ),
        (
            "T-shirt/top",
            "Trouser",
            "Pullover",
            "Dress",
            "Coat",
            "Sandal",
            "Shirt",
            "Sneaker",
            "Bag",
            "Ankle boot",
        ),
        system_dir=pathlib.Path("/usr/share/datasets/fashion-mnist"),
        base_url="https://github.com/zalandoresearch/fashion-mnist/raw/master/data/fashion",
        apt_package="dataset-fashion-mnist",
    ),
    "mnist": DatasetSpec(
        "mnist",
        "MNIST",
        _published(
            "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "6bbc9ace898e44ae57da46a324031adb",
            "d53e105ee54ea40749a09fcbcd1e9432",
            "a25bea736e30d166cdddb491f175f624",
            "9fb629c4189551a2d022fa330f9573f3",
            "2646ac647ad5339dbf082846283269ea",
            "ec29112dd5afa0611ce80d1b7f02629c",
            "27ae3e4e09519cfbb04c329615203637",
        ),
        tuple(str(digit) for digit in range(10)),
        base_url="https://storage.googleapis.com/cvdf-datasets/mnist",
    ),
    "idx": DatasetSpec("idx", "IDX dataset", tuple(IdxFile(s) for s in STEMS), None),
}


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A loaded dataset: uint8 arrays, its class names and where each file was found."""

    name: str
    title: str
    class_names: tuple[str, ...]
    train_images: np.ndarray  # (N, H, W) uint8
    train_labels: np.ndarray  # (N,) uint8
    test_images: np.ndarray  # (M, H, W) uint8
    test_labels: np.ndarray  # (M,) uint8
    sources: tuple[str, str, str, str]  # train images, train labels, test images, test labels
    checked: bool  # whether the files matched published MD5s

    @property
    def image_shape(self) -> tuple[int, int]:
        return tuple(self.train_images.shape[1:])

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def info(self) -> dict:
        """What a checkpoint records so a model can be used without the data: JSON-ready."""
        return {
            "name": self.name,
            "title": self.title,
            "class_names": list(self.class_names),
            "image_shape": list(self.image_shape),
        }


def get(config: ml_collections.ConfigDict) -> DatasetSpec:
    """The spec `config.dataset.name` names; the `idx` dataset needs `--data_dir`."""
    name = config.dataset.name
    if name not in DATASETS:
        raise UserError(f"--config.dataset.name={name!r} is not one of {', '.join(DATASETS)}")
    if name == "idx" and not config.data_dir:
        raise UserError(
            "--config.dataset.name=idx needs --data_dir=DIR holding the four IDX files "
            f"({', '.join(STEMS)}, .gz or raw) and optionally {CLASSES_FILE}"
        )
    return DATASETS[name]


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
    A spec without MD5s accepts any readable file.
    """
    blob = _read(path)
    payload = blob
    if blob[:2] == GZIP_MAGIC:
        try:
            payload = gzip.decompress(blob)
        except (OSError, EOFError) as exc:
            raise UserError(f"{path}: not a readable gzip file ({exc}); delete it") from None
    if not (spec.gz_md5 or spec.raw_md5):
        return payload
    if md5_hex(payload) == spec.raw_md5 or (payload is not blob and md5_hex(blob) == spec.gz_md5):
        return payload
    raise UserError(
        f"{path}: MD5 mismatch (expected {spec.gz_md5} (.gz) or payload {spec.raw_md5}, got "
        f"payload {md5_hex(payload)}); the file is damaged or not the published {title}: "
        "delete it or replace it"
    )


def _candidates(directory: pathlib.Path, spec: IdxFile) -> list[pathlib.Path]:
    return [p for p in (directory / spec.gz_name, directory / spec.stem) if p.is_file()]


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


def check_labels(labels: np.ndarray, name: str, num_classes: int) -> None:
    """Every label must name one of the classes."""
    if len(labels) and labels.max() >= num_classes:
        bad = int(np.flatnonzero(labels >= num_classes)[0])
        raise UserError(
            f"{name}: label {labels[bad]} at index {bad} is outside 0..{num_classes - 1}"
        )


def read_class_names(data_dir: pathlib.Path, labels: np.ndarray) -> tuple[str, ...]:
    """The `idx` dataset's classes: classes.txt (one name per line), or 0..max label."""
    path = data_dir / CLASSES_FILE
    if not path.is_file():
        return tuple(str(i) for i in range(int(labels.max(initial=0)) + 1))
    try:
        names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read it ({exc}); one class name per line") from None
    if not names:
        raise UserError(f"{path}: no class names in it; one class name per line")
    return tuple(names)


def load_dataset(
    spec: DatasetSpec | str = "fashion_mnist",
    data_dir: str | pathlib.Path | None = None,
    *,
    download: bool = True,
) -> Dataset:
    """Find, verify and parse the four files; images and labels must agree in count and shape."""
    spec = DATASETS[spec] if isinstance(spec, str) else spec
    if data_dir:
        data_dir = pathlib.Path(data_dir).expanduser()
        if not data_dir.is_dir():
            raise UserError(f"--data_dir {data_dir} is not a directory; " + spec.how_to_get())
    found = [find_payload(f, spec, data_dir or None, download) for f in spec.files]
    sources = tuple(source for _, source in found)
    labels = [parse_idx(found[i][0], sources[i], images=False) for i in (1, 3)]
    class_names = spec.class_names or read_class_names(data_dir, np.concatenate(labels))
    for y, source in zip(labels, sources[1::2], strict=True):
        check_labels(y, source, len(class_names))
    images = [parse_idx(found[i][0], sources[i], images=True) for i in (0, 2)]
    for i, (x, y) in enumerate(zip(images, labels, strict=True)):
        if len(x) != len(y):
            raise UserError(
                f"{sources[2 * i]} has {len(x)} images but {sources[2 * i + 1]} has {len(y)} "
                "labels; the files do not pair"
            )
    if images[0].shape[1:] != images[1].shape[1:]:
        raise UserError(
            f"{sources[0]} holds {images[0].shape[1:]} images but {sources[2]} holds "
            f"{images[1].shape[1:]}; train and test images must be the same size"
        )
    title = f"{data_dir.name} (IDX)" if spec.name == "idx" else spec.title
    return Dataset(
        spec.name, title, class_names, images[0], labels[0], images[1], labels[1],
        sources, spec.checked,
    )  # fmt: skip


def load(config: ml_collections.ConfigDict, data_dir: str | None = None) -> Dataset:
    """The dataset a config names, from `data_dir` (default `config.data_dir`) or its search."""
    return load_dataset(get(config), data_dir or config.data_dir or None)
