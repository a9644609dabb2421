"""The datasets a config can name: each one a loader registered in DATASETS, reading its files
on the host into one checked `Dataset` of uint8 images (N, H, W, C) and integer labels.

`fashion_mnist` (the default) and `mnist` are four IDX files checked against their published
MD5s; `idx` is any four IDX files in `--data_dir`, unchecked; `arrays` is `train.npz` and
`test.npz` in `--data_dir`. A new source (a folder of PNGs, a TFDS or Hugging Face split) is one
function of `(data_dir, config)` that returns `make_dataset(...)`, decorated with
`@register("its_name")` here or in a module of `config.imports` (for the runs that import it;
its own fields go in the config that uses it, e.g. `config.dataset.size`). Image shape
and the number of classes come from the loaded data, never from constants. Reading and checking
the files is runtime/data_files.py's; its `Dataset` and `make_dataset` are importable from here.
"""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
from collections.abc import Callable

import ml_collections
import numpy as np

from fmnist_flax.runtime import data_files, records
from fmnist_flax.runtime.data_files import (
    ARRAY_FILES,
    CLASSES_FILE,
    STEMS,
    Dataset,
    DatasetSpec,
    IdxFile,
    find_payload,
    make_dataset,
    parse_idx,
    read_class_names,
)
from fmnist_flax.runtime.errors import UserError
from fmnist_flax.runtime.registry import Registry

# --- The registry: config.dataset.name -> a loader ------------------------------------------


@dataclasses.dataclass(frozen=True)
class Source:
    """A registered dataset: `load(data_dir, config)` returns a Dataset or raises a one-line
    UserError. `data_dir` is --data_dir, or None when it is not given; a loader that reads only
    from it says what it must hold in `needs`, and is refused without it before anything is
    read. `config` is the run's, for the fields of its own a source reads."""

    load: Callable[[pathlib.Path | None, ml_collections.ConfigDict], Dataset]
    needs: str | None = None


DATASETS = Registry("dataset")


def register(name: str, needs: str | None = None) -> Callable:
    """`@register("name")` over a loader makes it `--config.dataset.name=name`; pass
    `needs="what --data_dir holds"` when it reads only from --data_dir."""

    def add(load: Callable[[pathlib.Path | None, ml_collections.ConfigDict], Dataset]) -> Callable:
        try:
            inspect.signature(load).bind(None, None)
        except TypeError:
            raise UserError(f"@register({name!r}): a loader takes (data_dir, config)") from None
        DATASETS[name] = Source(load, needs)
        return load

    return add


def get(config: ml_collections.ConfigDict) -> Source:
    """The dataset `config.dataset.name` names; one that reads --data_dir needs it."""
    name = config.dataset.name
    if name not in DATASETS.active(config.imports):
        raise UserError(f"--config.dataset.name={name!r} {DATASETS.absent(name, config.imports)}")
    source = DATASETS.active(config.imports)[name]
    if source.needs and not config.data_dir:
        raise UserError(f"--config.dataset.name={name} needs --data_dir=DIR holding {source.needs}")
    return source


def load(config: ml_collections.ConfigDict, data_dir: str | None = None) -> Dataset:
    """The dataset a config names, from `data_dir` (default `config.data_dir`) or its search."""
    data_dir = data_dir or config.data_dir or None
    path = pathlib.Path(data_dir).expanduser() if data_dir else None
    if path is not None and not path.is_dir():
        raise UserError(f"--data_dir {path} is not a directory")
    return get(config).load(path, config)


# --- IDX files: Fashion-MNIST, MNIST, any four IDX files --------------------------------------


def _published(*md5s: str) -> tuple[IdxFile, ...]:
    """IdxFiles from (gz, raw) MD5 pairs in STEMS order."""
    return tuple(IdxFile(stem, *md5s[2 * i : 2 * i + 2]) for i, stem in enumerate(STEMS))


IDX_DATASETS = {  # name -> where its four files are found and how they are checked
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


def load_dataset(
    spec: DatasetSpec | str = "fashion_mnist",
    data_dir: str | pathlib.Path | None = None,
    *,
    download: bool = True,
) -> Dataset:
    """Find, verify and parse an IDX dataset's four files (see `find_payload`)."""
    spec = IDX_DATASETS[spec] if isinstance(spec, str) else spec
    if data_dir:
        data_dir = pathlib.Path(data_dir).expanduser()
        if not data_dir.is_dir():
            raise UserError(f"--data_dir {data_dir} is not a directory; " + spec.how_to_get())
    found = [find_payload(f, spec, data_dir or None, download) for f in spec.files]
    sources = tuple(source for _, source in found)
    labels = [parse_idx(found[i][0], sources[i], images=False) for i in (1, 3)]
    images = [parse_idx(found[i][0], sources[i], images=True) for i in (0, 2)]
    return make_dataset(
        spec.name,
        f"{data_dir.name} (IDX)" if spec.name == "idx" else spec.title,
        spec.class_names or read_class_names(data_dir, np.concatenate(labels)),
        (images[0], labels[0]),
        (images[1], labels[1]),
        sources=(sources[0], sources[2]),
        origin="IDX files",
        checked=spec.checked,
    )


def _idx_loader(spec: DatasetSpec) -> Callable[[pathlib.Path | None, object], Dataset]:
    return lambda data_dir, config: load_dataset(spec, data_dir)


for _spec in IDX_DATASETS.values():
    _needs = f"the four IDX files ({', '.join(STEMS)}, .gz or raw) and optionally {CLASSES_FILE}"
    register(_spec.name, _needs if _spec.name == "idx" else None)(_idx_loader(_spec))


# --- `arrays`: train.npz and test.npz; `records`: --mode=prepare's record files -------------


@register("arrays", needs=f"{' and '.join(ARRAY_FILES)} (images, labels)")
def load_arrays(data_dir: pathlib.Path, config: ml_collections.ConfigDict) -> Dataset:
    return data_files.load_arrays(data_dir)


@register("records", needs="record files written by --mode=prepare --output=DIR")
def load_records(data_dir: pathlib.Path, config: ml_collections.ConfigDict) -> Dataset:
    return records.load_dataset(data_dir)
