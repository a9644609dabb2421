"""Shared fixtures: small IDX files the tests write, the real Debian data, a quick config."""

from __future__ import annotations

import gzip
import hashlib
import pathlib
import struct

import numpy as np
import pytest

from configs import default
from fmnist_flax import data

REPO = pathlib.Path(__file__).resolve().parents[1]


def idx_bytes(array: np.ndarray, magic: int | None = None) -> bytes:
    """An IDX payload for uint8 images (N, H, W) or labels (N,)."""
    if magic is None:
        magic = data.IMAGES_MAGIC if array.ndim == 3 else data.LABELS_MAGIC
    header = struct.pack(f">I{array.ndim}I", magic, *array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_idx(path: pathlib.Path, payload: bytes, *, compress: bool) -> data.IdxFile:
    """Write `payload` (gzipped or raw) and return the spec that publishes its MD5s."""
    stem = path.name.removesuffix(".gz")
    blob = gzip.compress(payload) if compress else payload
    path.write_bytes(blob)
    return data.IdxFile(stem, hashlib.md5(blob).hexdigest(), hashlib.md5(payload).hexdigest())


def small_arrays(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 256, (n, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, n, dtype=np.uint8),
    )


@pytest.fixture
def small_dataset_dir(tmp_path: pathlib.Path) -> tuple[pathlib.Path, data.DatasetFiles]:
    """Four valid small IDX files (train 64, test 20) and the specs with their MD5s."""
    specs = []
    for stem, n, seed in (
        ("train-images-idx3-ubyte", 64, 1),
        ("train-labels-idx1-ubyte", 64, 1),
        ("t10k-images-idx3-ubyte", 20, 2),
        ("t10k-labels-idx1-ubyte", 20, 2),
    ):
        images, labels = small_arrays(n, seed)
        array = images if "images" in stem else labels
        specs.append(write_idx(tmp_path / f"{stem}.gz", idx_bytes(array), compress=True))
    return tmp_path, data.DatasetFiles(*specs)


@pytest.fixture(scope="session")
def real_dataset() -> data.Dataset:
    """The real Fashion-MNIST from Debian's dataset-fashion-mnist (never downloaded in tests)."""
    return data.load_dataset(base_url=None)


@pytest.fixture
def quick_config():
    """The codelab's config, shortened for tests."""
    config = default.get_config()
    config.steps = 100
    config.report = "none"  # the report has its own tests
    return config
