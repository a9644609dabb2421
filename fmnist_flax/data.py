"""Find, verify, parse and batch Fashion-MNIST (the codelab's sections 2 and 4)."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import hashlib
import pathlib
import struct
import urllib.error
import urllib.request
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh

from fmnist_flax import parallel
from fmnist_flax.errors import UserError

CLASS_NAMES = (
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
)
NUM_CLASSES = len(CLASS_NAMES)
IMAGE_SHAPE = (28, 28)
INPUT_DIM = IMAGE_SHAPE[0] * IMAGE_SHAPE[1]
# uint8 -> [0, 1]. A multiply, not a division: XLA turns x / 255 into x * (1 / 255) anyway, and
# host (NumPy) and device preprocessing must agree to the bit.
PIXEL_SCALE = np.float32(1 / 255)
IMAGES_MAGIC = 2051
LABELS_MAGIC = 2049


@dataclasses.dataclass(frozen=True)
class IdxFile:
    """One of the four published files: its name and the MD5s of the .gz and of its payload."""

    stem: str
    gz_md5: str
    raw_md5: str

    @property
    def gz_name(self) -> str:
        return self.stem + ".gz"


TRAIN_IMAGES = IdxFile(
    "train-images-idx3-ubyte",
    "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
    "f4a8712d7a061bf5bd6d2ca38dc4d50a",
)
TRAIN_LABELS = IdxFile(
    "train-labels-idx1-ubyte",
    "25c81989df183df01b3e8a0aad5dffbe",
    "9018921c3c673c538a1fc5bad174d6f9",
)
TEST_IMAGES = IdxFile(
    "t10k-images-idx3-ubyte",
    "bef4ecab320f06d8554ea6380940ec79",
    "8181f5470baa50b63fa0f6fddb340f0a",
)
TEST_LABELS = IdxFile(
    "t10k-labels-idx1-ubyte",
    "bb300cfdad3c16e7a12a480ee83cd310",
    "15d484375f8d13e6eb1aabb0c3f46965",
)


class DatasetFiles(NamedTuple):
    """The four files of an MNIST-format dataset; another dataset of the format swaps these."""

    train_images: IdxFile
    train_labels: IdxFile
    test_images: IdxFile
    test_labels: IdxFile


FASHION_MNIST = DatasetFiles(TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES, TEST_LABELS)

CACHE_DIR = pathlib.Path.home() / ".cache" / "fmnist-flax"
SYSTEM_DIR = pathlib.Path("/usr/share/datasets/fashion-mnist")
BASE_URL = "https://github.com/zalandoresearch/fashion-mnist/raw/master/data/fashion"
DOWNLOAD_TIMEOUT_S = 30
GZIP_MAGIC = b"\x1f\x8b"

HOW_TO_GET_DATA = (
    "install Debian's package (apt-get install dataset-fashion-mnist), "
    f"pass --data_dir=DIR holding the four files ({', '.join(f.gz_name for f in FASHION_MNIST)}), "
    f"or allow the download from {BASE_URL} into {CACHE_DIR}"
)


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Fashion-MNIST as uint8 arrays, plus where each file was found."""

    train_images: np.ndarray  # (60000, 28, 28) uint8
    train_labels: np.ndarray  # (60000,) uint8
    test_images: np.ndarray  # (10000, 28, 28) uint8
    test_labels: np.ndarray  # (10000,) uint8
    sources: dict[str, str]


def md5_hex(payload: bytes) -> str:
    return hashlib.md5(payload).hexdigest()


def verified_payload(path: pathlib.Path, spec: IdxFile) -> bytes:
    """Return the decompressed IDX bytes of `path`, or raise if it matches no published MD5.

    A .gz is accepted when its own MD5 is the published one or when its payload has the
    published raw MD5 (Debian re-compresses the files); an uncompressed file needs the raw MD5.
    """
    blob = path.read_bytes()
    if blob[:2] == GZIP_MAGIC:
        try:
            payload = gzip.decompress(blob)
        except (OSError, EOFError) as exc:
            raise UserError(f"{path}: not a readable gzip file ({exc}); delete it") from None
        if md5_hex(blob) == spec.gz_md5 or md5_hex(payload) == spec.raw_md5:
            return payload
        expected = f"{spec.gz_md5} (.gz) or payload {spec.raw_md5}"
        actual = f"{md5_hex(blob)}, payload {md5_hex(payload)}"
    else:
        if md5_hex(blob) == spec.raw_md5:
            return blob
        expected, actual = spec.raw_md5, md5_hex(blob)
    raise UserError(
        f"{path}: MD5 mismatch (expected {expected}, got {actual}); "
        "the file is damaged or not the published Fashion-MNIST: delete it or replace it"
    )


def _candidates(directory: pathlib.Path, spec: IdxFile) -> list[pathlib.Path]:
    return [p for p in (directory / spec.gz_name, directory / spec.stem) if p.is_file()]


def _download(spec: IdxFile, cache_dir: pathlib.Path, base_url: str) -> bytes:
    """Fetch one file into the cache; a file with a wrong MD5 is deleted and fetched once more."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / spec.gz_name
    url = f"{base_url}/{spec.gz_name}"
    for attempt in (1, 2):
        partial = path.with_suffix(".gz.part")
        try:
            with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
                partial.write_bytes(response.read())
        except (urllib.error.URLError, OSError) as exc:
            partial.unlink(missing_ok=True)
            reason = getattr(exc, "reason", exc)
            raise UserError(
                f"Fashion-MNIST not found and the download of {url} failed ({reason}); "
                + HOW_TO_GET_DATA
            ) from None
        partial.replace(path)
        try:
            return verified_payload(path, spec)
        except UserError:
            path.unlink()
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def find_payload(
    spec: IdxFile,
    data_dir: pathlib.Path | None,
    cache_dir: pathlib.Path,
    system_dir: pathlib.Path,
    base_url: str | None,
) -> tuple[bytes, str]:
    """Look for one file in data_dir, the cache, Debian's directory, then download it.

    Returns the verified IDX payload and where it came from. `base_url=None` never downloads.
    """
    for directory in (d for d in (data_dir, cache_dir, system_dir) if d is not None):
        for path in _candidates(directory, spec):
            try:
                return verified_payload(path, spec), str(path)
            except UserError:
                if directory != cache_dir or base_url is None:
                    raise
                logging.warning("%s is damaged; deleting it and downloading it again", path)
                path.unlink()
    if base_url is None:
        raise UserError(f"Fashion-MNIST file {spec.gz_name} not found; " + HOW_TO_GET_DATA)
    return _download(spec, cache_dir, base_url), f"{base_url}/{spec.gz_name}"


def parse_idx(payload: bytes, name: str, *, images: bool) -> np.ndarray:
    """Parse an IDX payload: (N, 28, 28) uint8 images or (N,) uint8 labels in 0..9, all checked."""
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
    if images and tuple(dims) != IMAGE_SHAPE:
        raise UserError(f"{name}: images are {dims[0]}x{dims[1]}, expected 28x28")
    item_size = INPUT_DIM if images else 1
    expected = header_size + count * item_size
    if len(payload) != expected:
        problem = "truncated" if len(payload) < expected else "has trailing bytes"
        raise UserError(
            f"{name}: {problem}: header says {count} items = {expected} bytes, "
            f"file has {len(payload)}; delete it and fetch it again"
        )
    array = np.frombuffer(payload, dtype=np.uint8, offset=header_size)
    if images:
        return array.reshape(count, *IMAGE_SHAPE)
    if count and array.max() >= NUM_CLASSES:
        bad = int(np.flatnonzero(array >= NUM_CLASSES)[0])
        raise UserError(f"{name}: label {array[bad]} at index {bad} is outside 0..9")
    return array


def load_dataset(
    data_dir: str | pathlib.Path | None = None,
    *,
    files: DatasetFiles = FASHION_MNIST,
    cache_dir: pathlib.Path = CACHE_DIR,
    system_dir: pathlib.Path = SYSTEM_DIR,
    base_url: str | None = BASE_URL,
) -> Dataset:
    """Find, verify and parse the four files; images and labels must agree in count."""
    if data_dir is not None:
        data_dir = pathlib.Path(data_dir).expanduser()
        if not data_dir.is_dir():
            raise UserError(f"--data_dir {data_dir} is not a directory; " + HOW_TO_GET_DATA)
    arrays, sources = [], {}
    for spec in files:
        payload, source = find_payload(spec, data_dir, cache_dir, system_dir, base_url)
        sources[spec.stem] = source
        arrays.append(
            parse_idx(payload, source, images=spec in (files.train_images, files.test_images))
        )
    for images, labels in ((0, 1), (2, 3)):
        if len(arrays[images]) != len(arrays[labels]):
            raise UserError(
                f"{sources[files[images].stem]} has {len(arrays[images])} images but "
                f"{sources[files[labels].stem]} has {len(arrays[labels])} labels; "
                "the files do not pair"
            )
    return Dataset(*arrays, sources)


def prepare_images(images: np.ndarray) -> np.ndarray:
    """uint8 (N, 28, 28) -> float32 (N, 784) in [0, 1], as the codelab does."""
    return (images.astype(np.float32) * PIXEL_SCALE).reshape(len(images), INPUT_DIM)


def shuffle(images: np.ndarray, labels: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One seeded permutation of a split (the codelab shuffles the train set once, seed 0)."""
    order = np.random.default_rng(seed).permutation(len(images))
    return images[order], labels[order]


def fixed_batches(x: np.ndarray, y: np.ndarray, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Drop the trailing examples that do not fill a batch: (num_batches, batch_size, ...)."""
    num_batches = len(x) // batch_size
    usable = num_batches * batch_size
    return (
        x[:usable].reshape(num_batches, batch_size, *x.shape[1:]),
        y[:usable].reshape(num_batches, batch_size).astype(np.int32),
    )


def padded_batches(
    x: np.ndarray, y: np.ndarray, batch_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every example, the last batch padded with zeros; the mask marks the real ones."""
    num_batches = -(-len(x) // batch_size)
    pad = num_batches * batch_size - len(x)
    mask = np.concatenate([np.ones(len(x), np.float32), np.zeros(pad, np.float32)])
    x = np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)])
    y = np.concatenate([y.astype(np.int32), np.zeros(pad, np.int32)])
    return (
        x.reshape(num_batches, batch_size, *x.shape[1:]),
        y.reshape(num_batches, batch_size),
        mask.reshape(num_batches, batch_size),
    )


def normalize(images: jax.Array) -> jax.Array:
    """uint8 pixels (..., 784) -> float32 in [0, 1] on the device, the codelab's scaling."""
    return images.astype(jnp.float32) * PIXEL_SCALE


@dataclasses.dataclass(frozen=True)
class DeviceData:
    """What training and evaluation read, moved to the devices once; shapes never change.

    Train images stay uint8 (4x less device memory than float32), a copy on every device, and
    are normalised inside the compiled step; each epoch visits them in a fresh on-device
    permutation, and each device gathers only its slice of every batch. Test batches are split
    along the mesh's `data` axis.
    """

    train_images: jax.Array  # (60000, 784) uint8
    train_labels: jax.Array  # (60000,) int32
    test_x: jax.Array  # (ceil(10000 / B), B, 784) float32: every test example, last batch padded
    test_y: jax.Array  # (ceil(10000 / B), B) int32
    test_mask: jax.Array  # (ceil(10000 / B), B) float32, 1 for a real example
    batch_size: int
    test_examples: int  # real (unpadded) test examples, known on the host
    mesh: Mesh

    @property
    def batches_per_epoch(self) -> int:
        """Whole batches per epoch; the remainder of each permutation is dropped."""
        return len(self.train_labels) // self.batch_size

    @property
    def codelab_test_batches(self) -> int:
        """The codelab evaluates only whole batches: 19 of 512 = 9,728 of 10,000."""
        return self.test_examples // self.batch_size


def to_device(dataset: Dataset, batch_size: int, mesh: Mesh) -> DeviceData:
    """Flatten, pad the test set into masked batches and put everything on the mesh once."""
    if batch_size > len(dataset.train_images):
        raise UserError(
            f"--batch_size={batch_size} is larger than the {len(dataset.train_images):,} "
            "training examples; use a smaller batch"
        )
    parallel.check_batch(batch_size, parallel.data_size(mesh))
    train_images = dataset.train_images.reshape(len(dataset.train_images), INPUT_DIM)
    train = (train_images, dataset.train_labels.astype(np.int32))
    test = padded_batches(prepare_images(dataset.test_images), dataset.test_labels, batch_size)
    return DeviceData(
        *(parallel.shard_host_array(a, parallel.replicated(mesh)) for a in train),
        *shard_batches(test, mesh),
        batch_size=batch_size,
        test_examples=len(dataset.test_labels),
        mesh=mesh,
    )


def shard_batches(stacked: tuple[np.ndarray, ...], mesh: Mesh) -> tuple[jax.Array, ...]:
    """Stacked host batches (num_batches, B, ...) -> arrays split along B over the mesh."""
    return tuple(
        parallel.shard_host_array(a, parallel.batch_sharding(mesh, axis=1)) for a in stacked
    )


@functools.partial(jax.jit, static_argnums=2)
def epoch_order(seed: int, epoch: int, num_examples: int) -> jax.Array:
    """The permutation of the train set for one epoch, made on the device from (seed, epoch)."""
    key = jax.random.fold_in(jax.random.key(seed), epoch)
    return jax.random.permutation(key, num_examples)


def batch_at(
    images: jax.Array,
    labels: jax.Array,
    order: jax.Array,
    index: jax.Array | int,
    batch_size: int,
    mesh: Mesh | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Batch `index` of an epoch's order, gathered and normalised (works inside jit too).

    On a mesh the picks are split along `data` first, so each device gathers only its slice.
    """
    picks = jax.lax.dynamic_slice_in_dim(order, index * batch_size, batch_size)
    if mesh is not None:
        picks = jax.lax.with_sharding_constraint(picks, parallel.batch_sharding(mesh))
    return normalize(images[picks]), labels[picks]


def augment(x: jax.Array, key: jax.Array, max_shift: int, flip: bool) -> jax.Array:
    """Random left-right flips and shifts of up to `max_shift` pixels (zero fill), per example,
    on the device; (B, 784) in and out, labels untouched."""
    images = x.reshape(len(x), *IMAGE_SHAPE)
    flip_key, shift_key = jax.random.split(key)
    if flip:
        mirror = jax.random.bernoulli(flip_key, 0.5, (len(images), 1, 1))
        images = jnp.where(mirror, images[:, :, ::-1], images)
    if max_shift:
        pad = ((0, 0), (max_shift, max_shift), (max_shift, max_shift))
        offsets = jax.random.randint(shift_key, (len(images), 2), 0, 2 * max_shift + 1)
        images = jax.vmap(lambda image, at: jax.lax.dynamic_slice(image, at, IMAGE_SHAPE))(
            jnp.pad(images, pad), offsets
        )
    return images.reshape(len(images), INPUT_DIM)
