"""Record files: --mode=prepare's writer, the lazy reader, damaged files, and training and
evaluation from them through Grain."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time
import zipfile
import zlib

import numpy as np
import pytest
from conftest import (
    REPO,
    assert_one_line_error,
    run_main,
    run_main_measured,
    small_arrays,
    within,
)

from fmnist_flax import datasets, evaluate, train
from fmnist_flax.runtime import grain_pipeline, parallel, records
from fmnist_flax.runtime.errors import UserError

RECORDS = "--config.dataset.name=records"
GRAIN = "--config.input_pipeline=grain"


def small_dataset() -> datasets.Dataset:
    """40 train and 12 test random 28x28 images of 10 classes."""
    (train_x, train_y), (test_x, test_y) = small_arrays(40, 1), small_arrays(12, 2)
    return datasets.make_dataset(
        "small",
        "Small",
        [str(k) for k in range(10)],
        (train_x, train_y),
        (test_x, test_y),
        sources=("a", "b"),
        origin="arrays",
    )


def small_set(tmp_path: pathlib.Path, shards: int = 2, name: str = "small") -> pathlib.Path:
    """`small_dataset` written as records in `tmp_path/name`."""
    records.write_dataset(small_dataset(), tmp_path / name, shards)
    return tmp_path / name


def test_prepared_records_read_back_as_the_dataset_they_came_from(real_dataset, fmnist_records):
    loaded = records.load_dataset(fmnist_records)
    assert loaded.info() == {**real_dataset.info(), "name": "records"}  # same fingerprint
    assert sorted(p.name for p in fmnist_records.iterdir())[:2] == ["info.json", "labels.npz"]
    info = json.loads((fmnist_records / "info.json").read_text())
    assert info["splits"]["train"]["shards"][3] == "train-00003-of-00004.records"
    assert info["splits"]["test"]["examples"] == 10_000 and info["image_shape"] == [28, 28, 1]
    np.testing.assert_array_equal(np.asarray(loaded.test_images), real_dataset.test_images)
    np.testing.assert_array_equal(loaded.train_labels, real_dataset.train_labels)
    picks = np.array([59_999, 0, 31_337, 15_000, 14_999])  # across shard boundaries
    np.testing.assert_array_equal(loaded.train_images[picks], real_dataset.train_images[picks])
    pixels, labels = loaded.train_images.source[picks.reshape(5, 1)]
    assert pixels.shape == (5, 1, 784) and labels.shape == (5, 1)
    np.testing.assert_array_equal(labels[:, 0], real_dataset.train_labels[picks])


def test_record_images_slice_lazily_and_index_like_numpy(real_dataset, fmnist_records):
    images, expected = records.load_dataset(fmnist_records).test_images, real_dataset.test_images
    view = images[100:200:3]
    assert isinstance(view, records.RecordImages) and view.shape == (34, 28, 28, 1)
    np.testing.assert_array_equal(np.asarray(view), expected[100:200:3])
    np.testing.assert_array_equal(view[-1], expected[199])
    np.testing.assert_array_equal(view[np.arange(34) % 2 == 0], expected[100:200:6])
    assert len(images[:0]) == 0 and np.asarray(images[:0]).shape == (0, 28, 28, 1)


def test_evaluation_streams_records_to_the_same_result_as_arrays(
    real_dataset, fmnist_records, quick_config
):
    config = quick_config
    model, _ = train.create_train_state(config, (28, 28, 1), 10, parallel.make_mesh())
    loaded = records.load_dataset(fmnist_records)
    streamed = evaluate.evaluate(
        model, loaded.test_images[:3000], loaded.test_labels[:3000], config
    )
    whole = evaluate.evaluate(
        model, real_dataset.test_images[:3000], real_dataset.test_labels[:3000], config
    )
    assert streamed["accuracy"] == whole["accuracy"] and streamed["loss"] == whole["loss"]
    np.testing.assert_array_equal(streamed["predictions"], whole["predictions"])


def test_grain_reads_the_same_batches_from_records_as_from_arrays(real_dataset, fmnist_records):
    from_records = grain_pipeline.train_source(records.load_dataset(fmnist_records))
    assert isinstance(from_records, records.RecordSource)
    blocks = [
        grain_pipeline.process_batches(source, 64, 0, steps_per_block=3, first_block=5)[1]
        for source in (from_records, grain_pipeline.train_source(real_dataset))
    ]
    assert blocks[0][0].shape == (3, 64, 784) and blocks[0][1].shape == (3, 64)
    for a, b in zip(*blocks, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda d: (d / "info.json").unlink(), "info.json is missing"),
        (lambda d: (d / "info.json").write_text("{"), "is not a record set's info"),
        (
            lambda d: (d / "test-00001-of-00002.records").unlink(),
            "test-00001-of-00002.records is missing",
        ),
        (
            lambda d: _truncate(d / "train-00000-of-00002.records"),
            "train-00000-of-00002.records has",
        ),
        (lambda d: (d / "labels.npz").write_bytes(b"junk" * 10), "labels.npz"),
        (lambda d: _rewrite_info(d, image_shape=[14, 14, 1]), "records are not 200 bytes each"),
        (
            lambda d: _rewrite_info(d, image_shape=[-28, -28, 1]),
            r"image_shape \[-28, -28, 1\] is not three positive whole numbers",
        ),
        (lambda d: _rewrite_info(d, source={}), "source {} does not name the dataset it was"),
        (lambda d: _rewrite_info(d, class_names=[1, 2]), "class_names is not a list of names"),
        (
            lambda d: _rewrite_info(d, class_names=[str(k) for k in range(10_001)]),
            "info.json: 10,001 classes; at most 10,000",
        ),
        (
            lambda d: _rewrite_counts(d, [40, 0]),
            "train-00000-of-00002.records holds 20 records but info.json counts 40 for it",
        ),
        (
            lambda d: _rewrite_counts(d, [21, 19]),  # a train count off by one, the sum kept
            "train-00000-of-00002.records holds 20 records but info.json counts 21 for it",
        ),
        (
            lambda d: _rewrite_info(d, image_shape=[14, 56, 1]),  # 784 pixels: scrambled images
            r"train-00000-of-00002.records holds \[28, 28, 1\] images, not the info.json image "
            r"shape \[14, 56, 1\]",
        ),
        (
            lambda d: _swap(d / "train-00000-of-00002.records", d / "train-00001-of-00002.records"),
            "train-00000-of-00002.records is train shard 1 of 2, not train shard 0 of 2",
        ),
        (
            lambda d: _rewrite_info(d, format="fmnist-flax records 1"),
            "record files of an older format",
        ),
    ],
)
def test_damaged_record_sets_are_refused_in_one_line_naming_the_file(tmp_path, damage, expected):
    directory = small_set(tmp_path)
    damage(directory)
    with pytest.raises(UserError, match=expected) as raised:
        records.load_dataset(directory)
    assert "\n" not in str(raised.value) and "--mode=prepare" in str(raised.value)


def _swap(one: pathlib.Path, other: pathlib.Path) -> None:
    one.rename(one.with_name("swap"))
    other.rename(one)
    one.with_name("swap").rename(other)


def test_a_shard_of_another_prepared_set_is_refused_naming_it(tmp_path):
    """Train shard 1 replaced by the same shard of another prepare (inverted images, labels + 3:
    it trained to 0.8198 without a word), the sizes equal."""
    (train_x, train_y), (test_x, test_y) = small_arrays(40, 1), small_arrays(12, 2)
    other = datasets.make_dataset(
        "other",
        "Other",
        [str(k) for k in range(10)],
        (255 - train_x, (train_y + 3) % 10),
        (test_x, test_y),
        sources=("a", "b"),
        origin="arrays",
    )
    records.write_dataset(other, tmp_path / "other", 2)
    directory = small_set(tmp_path)
    shard = "train-00001-of-00002.records"
    shutil.copyfile(tmp_path / "other" / shard, directory / shard)
    with pytest.raises(UserError, match=rf"{shard} is a shard of another record set") as raised:
        records.load_dataset(directory)
    assert "\n" not in str(raised.value) and "--mode=prepare" in str(raised.value)


def test_labels_edited_in_the_middle_are_refused_naming_labels_npz(tmp_path):
    """A test label changed to another class, the file's size unchanged (test accuracy 0.0035
    without a word); with info.json's SHA-256 made to match, the record's own label tells."""
    directory = small_set(tmp_path)
    saved = dict(np.load(directory / "labels.npz"))
    saved["test"][6] = (saved["test"][6] + 1) % 10
    size = (directory / "labels.npz").stat().st_size
    np.savez(directory / "labels.npz", **saved)
    assert (directory / "labels.npz").stat().st_size == size
    with pytest.raises(UserError, match=r"labels\.npz does not match its SHA-256 in info\.json"):
        records.load_dataset(directory)
    info = json.loads((directory / "info.json").read_text())
    info["files"]["labels.npz"]["sha256"] = records._sha256(directory / "labels.npz")
    (directory / "info.json").write_text(json.dumps(info))
    loaded = records.load_dataset(directory)
    with pytest.raises(
        UserError, match=r"test-00001-of-00002\.records: record 6's label"
    ) as raised:
        np.asarray(loaded.test_images)
    assert "differs from labels.npz's" in str(raised.value)


def _truncate(path: pathlib.Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def _rewrite_info(directory: pathlib.Path, **changes) -> None:
    info = json.loads((directory / "info.json").read_text())
    (directory / "info.json").write_text(json.dumps(info | changes))


@pytest.mark.parametrize(
    ("label", "dtype", "message"),
    [
        (2**32 + 1, np.int64, "label 4294967297 at index 5 is outside 0..9"),
        (2**64 - 1, np.uint64, "label 18446744073709551615 at index 5 is outside 0..9"),
        (-1, np.int32, "label -1 at index 5 is outside 0..9"),
    ],
)
def test_edited_labels_are_checked_as_they_are_before_any_cast(tmp_path, label, dtype, message):
    """labels.npz edited in the middle, info.json's sizes made to match: cast to int32 first,
    2**32 + 1 read as class 1 and the others as -1, and trained without a word."""
    directory = small_set(tmp_path)
    saved = dict(np.load(directory / "labels.npz"))
    saved["train"] = saved["train"].astype(dtype)
    saved["train"][5] = label
    np.savez(directory / "labels.npz", **saved)
    info = json.loads((directory / "info.json").read_text())
    info["files"]["labels.npz"]["bytes"] = (directory / "labels.npz").stat().st_size
    (directory / "info.json").write_text(json.dumps(info))
    with pytest.raises(UserError, match=message) as raised:
        records.load_dataset(directory)
    assert "\n" not in str(raised.value) and "labels.npz[train]" in str(raised.value)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("info.json", "fifo"),
        ("info.json", "/dev/zero"),
        ("train-00001-of-00002.records", "fifo"),
        ("labels.npz", "/dev/zero"),
    ],
)
def test_a_record_file_that_is_a_fifo_or_a_device_is_one_line_naming_it(tmp_path, name, kind):
    """Each waited for ever (a FIFO) or was read without end (/dev/zero), or was "missing"."""
    directory = small_set(tmp_path)
    (directory / name).unlink()
    if kind == "fifo":
        os.mkfifo(directory / name)
    else:
        os.symlink(kind, directory / name)
    with within(10), pytest.raises(UserError) as raised:
        records.load_dataset(directory)
    what = "a FIFO" if kind == "fifo" else f"a character device (a symbolic link to {kind})"
    assert str(raised.value).startswith(f"{directory / name} is {what}, not a regular file")
    assert "\n" not in str(raised.value)


def _write_zip(path: pathlib.Path, members: list[tuple[str, int, int, int, bytes]]) -> None:
    """A zip of (name, method, CRC-32, unpacked size, packed bytes) members, written by hand:
    zipfile cannot take bytes packed elsewhere."""
    local, central = b"", b""
    for name, method, crc, size, packed in members:
        raw = name.encode()
        # The fields both headers share: version 2.0, no flags, no date, no extra field.
        shared = struct.pack(
            "<HHHHHIIIHH", 20, 0, method, 0, 0, crc, len(packed), size, len(raw), 0
        )
        central += struct.pack("<IH", 0x02014B50, 20) + shared
        central += struct.pack("<HHHII", 0, 0, 0, 0, len(local)) + raw
        local += struct.pack("<I", 0x04034B50) + shared + raw + packed
    count = len(members)
    end = struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, len(central), len(local), 0)
    path.write_bytes(local + central + end)


def _labels_unpacking_to_gigabytes(blocks: int) -> tuple[int, int, bytes]:
    """A `train.npy` member declaring `blocks` * 4 Mi int32 zeros, deflated: (CRC-32, unpacked
    size, packed bytes). Each 16 MiB of zeros packs to one identical 16 kB block (a full flush
    resets the compressor), so gigabytes take a second to write."""
    header = io.BytesIO()
    shape = (blocks * (4 << 20),)
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<i4", "fortran_order": False, "shape": shape}
    )
    zeros = bytes(16 << 20)
    packer = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = packer.compress(header.getvalue()) + packer.flush(zlib.Z_FULL_FLUSH)
    block = packer.compress(zeros) + packer.flush(zlib.Z_FULL_FLUSH)
    crc = zlib.crc32(header.getvalue())
    for _ in range(blocks):
        crc = zlib.crc32(zeros, crc)
    packed = first + block * blocks + packer.flush(zlib.Z_FINISH)
    return crc, len(header.getvalue()) + len(zeros) * blocks, packed


@pytest.mark.slow
def test_labels_that_unpack_to_gigabytes_are_refused_from_their_header(tmp_path):
    """A 2 MB labels.npz whose train labels unpack to 2 GB (info.json's size made to match):
    read whole before its shape was checked, it took 2.1 GB. Its header is checked against
    info.json's count first: one line, and the process stays small."""
    directory = small_set(tmp_path)
    test = io.BytesIO()
    np.save(test, np.load(directory / "labels.npz")["test"])
    bomb = _labels_unpacking_to_gigabytes(120)
    _write_zip(
        directory / "labels.npz",
        [
            ("train.npy", zipfile.ZIP_DEFLATED, *bomb),
            (
                "test.npy",
                zipfile.ZIP_STORED,
                zlib.crc32(test.getvalue()),
                len(test.getvalue()),
                test.getvalue(),
            ),
        ],
    )
    size = (directory / "labels.npz").stat().st_size
    assert size < 3e6 and bomb[1] > 2e9
    info = json.loads((directory / "info.json").read_text())
    info["files"]["labels.npz"]["bytes"] = size
    (directory / "info.json").write_text(json.dumps(info))
    result, peak, _ = run_main_measured(
        RECORDS,
        f"--data_dir={directory}",
        f"--workdir={tmp_path / 'w'}",
        "--steps=1",
        "--report=none",
    )
    line = assert_one_line_error(
        result, "labels.npz[train]: not 40 integer labels as info.json says (it declares int32 ("
    )
    assert "--mode=prepare" in line
    assert peak < 1 << 30, peak


def test_more_shards_than_examples_are_refused_and_nothing_written(tmp_path):
    """--shards=100000 on 6,000 examples wrote 200,002 files (gigabytes), most of them empty."""
    with pytest.raises(UserError, match=r"--shards=13 is more than the 12 examples of the test "):
        small_set(tmp_path, shards=13)
    assert list(tmp_path.iterdir()) == []
    assert records.load_dataset(small_set(tmp_path, shards=12)).num_classes == 10


def test_a_set_with_no_test_examples_is_refused_when_written_or_loaded(tmp_path):
    """Such a set trained, then ended at its first evaluation in `KeyError: 'accuracy'`."""
    dataset = small_dataset()
    empty = dataclasses.replace(
        dataset, test_images=dataset.test_images[:0], test_labels=dataset.test_labels[:0]
    )
    with pytest.raises(UserError, match=r"^the test split of Small holds no examples; each split"):
        records.write_dataset(empty, tmp_path / "refused")
    assert list(tmp_path.iterdir()) == []
    directory = tmp_path / "empty"  # the writer's own files for it, past write_dataset's check
    directory.mkdir()
    records._write_files(empty, directory, 1)
    with pytest.raises(UserError) as refused:
        records.load_dataset(directory)
    assert str(refused.value) == (
        f"{directory / 'info.json'}: the test split holds no examples; each split needs at "
        "least one: write the records again with --mode=prepare from a dataset that has test "
        "examples"
    )


def test_shards_beyond_the_open_file_limit_are_refused_before_anything_is_read(tmp_path):
    """With `ulimit -n 1024`, --shards=600 was written, then training failed with "Too many
    open files ... the file is damaged"."""
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, limits[1]))
    try:
        with pytest.raises(UserError) as raised:
            records.check_output(tmp_path / "rec", 600)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
    assert str(raised.value) == (
        "--shards=600: reading 1,200 shard files at once needs more open files than this "
        "process may hold (ulimit -n 1024); at most --shards=448, or raise the limit"
    )


def test_a_set_with_more_shards_than_open_files_is_not_called_damaged(tmp_path):
    """Written under a higher limit, read under a lower one: the reader's failure to open a
    shard is named as what it is."""
    directory = small_set(tmp_path, shards=12)
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 6, limits[1]))
    try:
        with pytest.raises(UserError) as raised:
            records.load_dataset(directory)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
    assert "cannot be opened: too many open files (12 shards a split" in str(raised.value)
    assert "damaged" not in str(raised.value)
    assert records.load_dataset(directory).num_classes == 10  # every reader it opened closed


def test_prepare_into_a_training_runs_checkpoints_is_refused(tmp_path):
    (tmp_path / "w" / "checkpoints" / "50").mkdir(parents=True)
    (tmp_path / "w" / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match=r"would land in the training run .*'s own checkpoints/"):
        small_set(tmp_path / "w" / "checkpoints", name="99")
    assert [p.name for p in (tmp_path / "w" / "checkpoints").iterdir()] == ["50"]


def test_a_prepare_output_named_with_glob_characters_is_written(tmp_path):
    """Its leftovers were looked for with glob: `**` in the name was a ValueError traceback."""
    assert records.load_dataset(small_set(tmp_path, name="a**b[1]")).num_classes == 10


def _rewrite_counts(directory: pathlib.Path, counts: list[int]) -> None:
    """The train shards' counts changed, their sum kept: once "the file is damaged"."""
    info = json.loads((directory / "info.json").read_text())
    info["splits"]["train"]["counts"] = counts
    (directory / "info.json").write_text(json.dumps(info))


@pytest.mark.parametrize("shards", [1, 2])
def test_a_corrupted_record_is_refused_when_read_naming_its_file(tmp_path, shards):
    """Record 33 damaged: a read of records from every shard, in any order, is one line
    naming its shard and the record, whichever piece of the read it falls in."""
    directory = small_set(tmp_path, shards=shards)
    shard = directory / f"train-{shards - 1:05d}-of-{shards:05d}.records"
    data = bytearray(shard.read_bytes())
    at = data.find(small_arrays(40, 1)[0][33].tobytes())  # record 33's pixels
    assert at > 0
    data[at + 300 : at + 364] = bytes(64)  # zeros over the middle of the picture
    shard.write_bytes(bytes(data))
    _rewrite_info(directory)  # sizes unchanged: only reading can tell (Riegeli's hashes)
    loaded = records.load_dataset(directory)
    expected = (
        f"{shard} cannot be read (record 33 fails its check); the file is damaged: write the "
        "records again with --mode=prepare"
    )
    with pytest.raises(UserError) as raised:
        np.asarray(loaded.train_images)
    assert str(raised.value) == expected
    source = loaded.train_images.source
    with pytest.raises(UserError) as raised:
        source.read(np.random.default_rng(0).permutation(40))
    assert str(raised.value) == expected
    assert source.read(np.arange(20))[0].shape == (20, 784)  # the undamaged ones still read


def test_a_read_fills_the_buffer_it_is_given_contiguous_or_not(tmp_path):
    """Keys in any order, repeated, across both shards: the pixels land in `out` in the keys'
    order, a contiguous buffer or every other column of a wider one."""
    source = records.load_dataset(small_set(tmp_path)).train_images.source
    images, classes = small_arrays(40, 1)
    images = images.reshape(40, -1)
    keys = np.array([39, 0, 21, 0, 5, 20, 19, 38])
    pixels, labels = source.read(keys, np.empty((8, 784), np.uint8))
    np.testing.assert_array_equal(pixels, images[keys])
    np.testing.assert_array_equal(labels, classes[keys])
    wide = np.zeros((8, 2 * 784), np.uint8)
    source.read(keys, wide[:, ::2])
    np.testing.assert_array_equal(wide[:, ::2], images[keys])
    assert not wide[:, 1::2].any()
    with pytest.raises(ValueError, match=r"out is uint8 \(8, 800\), not uint8 \(8, 784\)"):
        source.read(keys, np.empty((8, 800), np.uint8))


def _mapped_bytes(paths: list[pathlib.Path]) -> int:
    """Bytes of these files' pages mapped into this process (its resident set's share of
    them), from /proc/self/smaps."""
    names = {str(p) for p in paths}
    total, counting = 0, False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and ":" not in fields[0]:  # a mapping's first line
            counting = fields[-1] in names
        elif counting and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def test_reading_holds_at_most_the_mapped_budget_whatever_is_read(
    monkeypatch, real_dataset, fmnist_records
):
    """Random blocks of the 60,000 training records (47 MB of shards) read under a budget of
    8 MiB: after every read, the shards' pages this process holds mapped (the kernel's count,
    from /proc/self/smaps) stay within it, and what is read is the dataset's. Under the
    default budget the same set stays mapped: read again without unmapping anything."""
    for budget in (8 << 20, records.RESIDENT_BYTES):
        monkeypatch.setattr(records, "RESIDENT_BYTES", budget)
        source = records.load_dataset(fmnist_records).train_images.source
        size = sum(p.stat().st_size for p in source.paths)
        rng = np.random.default_rng(0)
        for _ in range(8):
            keys = rng.permutation(len(source))[:16384]
            pixels, labels = source.read(keys)
            np.testing.assert_array_equal(pixels, real_dataset.train_images[keys].reshape(-1, 784))
            np.testing.assert_array_equal(labels, real_dataset.train_labels[keys])
            assert _mapped_bytes(source.paths) <= budget + records.REGION_BYTES
        assert (source._mapped.releases > 0) == (size > budget), (size, budget)


def test_prepare_writes_a_new_directory_or_nothing(tmp_path):
    small_set(tmp_path, name="taken")
    before = sorted(p.name for p in (tmp_path / "taken").iterdir())
    with pytest.raises(UserError, match="already exists and is not empty"):
        small_set(tmp_path, name="taken")
    assert sorted(p.name for p in (tmp_path / "taken").iterdir()) == before
    (tmp_path / "notes").write_text("mine")  # a file: it was "not empty"
    with pytest.raises(UserError, match=r"notes is a file, not a directory \(prepare writes a"):
        small_set(tmp_path, name="notes")
    assert (tmp_path / "notes").read_text() == "mine"
    (tmp_path / "empty").mkdir()
    assert records.load_dataset(small_set(tmp_path, name="empty")).num_classes == 10
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


@pytest.mark.slow
def test_prepare_then_train_from_records_matches_the_device_pipeline(tmp_path, fmnist_records):
    """--mode=prepare from the command line, then 400 steps through Grain on the records:
    the device pipeline's accuracy within 0.005 (another data order); bad input one line."""
    prepared = run_main("--mode=prepare", f"--output={tmp_path / 'rec'}", "--shards=2")
    assert prepared.returncode == 0, prepared.stderr
    assert "train-00001-of-00002.records" in {p.name for p in (tmp_path / "rec").iterdir()}
    again = run_main("--mode=prepare", f"--output={tmp_path / 'rec'}")
    assert_one_line_error(again, "already exists and is not empty")
    runs = {}
    for name, flags in (
        ("device", ()),
        ("records", (RECORDS, f"--data_dir={fmnist_records}", GRAIN)),
    ):
        result = run_main(f"--workdir={tmp_path / name}", "--report=none", *flags)
        assert result.returncode == 0, result.stderr
        runs[name] = json.loads((tmp_path / name / "summary.json").read_text())
    assert abs(runs["records"]["test_accuracy"] - runs["device"]["test_accuracy"]) <= 0.005
    assert runs["records"]["test_accuracy"] >= 0.86
    shutil.rmtree(tmp_path / "rec")
    missing = run_main(RECORDS, f"--data_dir={tmp_path}", GRAIN, "--report=none")
    assert_one_line_error(missing, "info.json is missing")


class ShiftedCopies:
    """`copies` copies of a split's images, copy k shifted k - 2 pixels sideways (mod 5),
    made one image at a time for the writer: the 10x set never sits in memory."""

    def __init__(self, images: np.ndarray, copies: int):
        self.images, self.copies = images, copies
        self.shape = (len(images) * copies, *images.shape[1:])

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, i: int) -> np.ndarray:
        copy, index = divmod(int(i), len(self.images))
        return np.roll(self.images[index], copy % 5 - 2, axis=1)


@pytest.mark.slow
def test_ten_times_the_records_train_in_the_same_memory(tmp_path, real_dataset, fmnist_records):
    """600,000 records (470 MB of files) train 200 steps with a peak RSS within 10% of the
    same run on the 60,000: only labels (4 bytes each) and the batches in flight are held.
    Neither run uses the compilation cache: both compile all they run (compiling costs
    memory; with the cache, whichever run found fewer programs compiled by earlier tests
    held that much more, past the bound). Blocks of 2,048 examples: how many blocks are
    alive at the peak (each read, assembled and placed) depends on the threads' timing, and
    at the default 16,384 that alone could move either run's peak by the bound's whole margin
    on a busy machine; at 2,048 it moves the peaks far less."""
    big = dataclasses.replace(
        real_dataset,
        train_images=ShiftedCopies(real_dataset.train_images, 10),
        train_labels=np.tile(real_dataset.train_labels, 10),
    )
    records.write_dataset(big, tmp_path / "big")
    try:
        peaks = {}
        for name, data in (("small", fmnist_records), ("big", tmp_path / "big")):
            result = run_main(
                f"--workdir={tmp_path / name}",
                RECORDS,
                f"--data_dir={data}",
                GRAIN,
                "--steps=200",
                "--report=none",
                "--compilation_cache=",
                "--config.grain.block_examples=2048",
            )
            assert result.returncode == 0, result.stderr
            summary = json.loads((tmp_path / name / "summary.json").read_text())
            peaks[name] = summary["peak_rss_mb"]
            assert summary["test_accuracy"] > 0.8
        assert (
            json.loads((tmp_path / "big" / "info.json").read_text())["splits"]["train"]["examples"]
            == 600_000
        )
        assert peaks["big"] <= 1.1 * peaks["small"], peaks
    finally:
        shutil.rmtree(tmp_path / "big")


def test_a_killed_prepares_leftovers_go_and_a_live_ones_stay(tmp_path):
    dead = subprocess.Popen(["true"])  # a process that has exited: its pid is free
    dead.wait()
    abandoned = tmp_path / f".new.tmp-{dead.pid}"
    (abandoned / "half").mkdir(parents=True)
    live = tmp_path / f".new.tmp-{os.getppid()}"  # pytest's parent: alive
    live.mkdir()
    small_set(tmp_path, name="new")
    assert not abandoned.exists() and live.exists()


@pytest.mark.slow
def test_prepare_on_a_full_disk_is_one_line_and_keeps_nothing(tmp_path):
    """A real write failure: files may not grow past 1 MB in this process (RLIMIT_FSIZE)."""

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, 2**20))

    result = run_main("--mode=prepare", f"--output={tmp_path / 'rec'}", preexec_fn=small_files)
    assert_one_line_error(result, "--mode=prepare could not write")
    assert "File too large" in result.stderr and "nothing was kept" in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_prepare_stopped_by_a_signal_removes_its_files_and_says_so(tmp_path, signum):
    """SIGTERM left its temporary directory behind; SIGINT said "checkpoints saved so far are
    kept". Signalled while it writes (its temporary directory there): one line, 128 + signal."""
    process = subprocess.Popen(
        [sys.executable, str(REPO / "main.py"), "--mode=prepare", f"--output={tmp_path / 'rec'}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not list(tmp_path.iterdir()) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    process.send_signal(signum)
    _, err = process.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip()]
    assert process.returncode == 128 + signum, err
    assert lines == [
        f"error: --mode=prepare stopped by {signal.Signals(signum).name} while writing "
        f"{tmp_path / 'rec'}; nothing was kept (its temporary files are removed): run it again "
        "to write the records"
    ]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_ctrl_c_while_prepare_reads_the_dataset_says_nothing_was_written(tmp_path):
    """Ctrl-C before writing began said "checkpoints saved so far are kept". A source of the
    project's own (config.imports) that reads slowly is interrupted while it loads."""
    (tmp_path / "slow_source.py").write_text(
        "import sys, time\n"
        "from fmnist_flax import datasets\n\n\n"
        "@datasets.register('slow')\n"
        "def load_slow(data_dir, config):\n"
        "    print('reading', flush=True)\n"
        "    time.sleep(60)\n"
    )
    process = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "main.py"),
            "--mode=prepare",
            "--config.dataset.name=slow",
            "--config.imports=('slow_source',)",
            f"--output={tmp_path / 'rec'}",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        # Under pytest-xdist SIGINT is ignored, and an ignored signal stays ignored in a child.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline() == "reading\n"
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    done = subprocess.CompletedProcess(process.args, process.returncode, "", err)
    assert process.returncode == 130
    assert_one_line_error(done, "--mode=prepare stopped by SIGINT while reading the dataset")
    assert not (tmp_path / "rec").exists()


@pytest.mark.parametrize("size", [records.HEADER_BYTES + 5 * 800, 0])
def test_a_shard_cut_short_under_a_live_reader_is_one_line_at_its_next_read(tmp_path, size):
    """A shard truncated after it was mapped (a copy over it caught half way): the next read
    says so in one line, naming the file, before touching pages the file no longer holds (a
    bus error would kill the process); the other shard still reads."""
    source = records.load_dataset(small_set(tmp_path)).train_images.source
    assert source.read(np.arange(40))[0].shape == (40, 784)  # both shards mapped and read
    shard = source.paths[1]
    was = shard.stat().st_size
    os.truncate(shard, size)
    with pytest.raises(UserError) as raised:
        source.read(np.arange(15, 25))  # records of both shards
    assert str(raised.value) == (
        f"{shard} changed size while this run read it ({size:,} bytes, {was:,} when it was "
        "opened): cut short or replaced under a live run; what was saved is kept: put the "
        "whole files back and run the same command to resume"
    )
    assert source.read(np.arange(20))[0].shape == (20, 784)  # shard 0 is whole
