"""Finding, verifying, parsing and batching the data, on small IDX files and the real set."""

from __future__ import annotations

import dataclasses
import gzip
import http.server
import io
import os
import threading
import zipfile

import numpy as np
import pytest
from conftest import idx_bytes, offline, small_arrays, within, write_idx

from fmnist_flax import config as config_lib
from fmnist_flax import datasets
from fmnist_flax.runtime import data_files
from fmnist_flax.runtime.errors import UserError


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_real_debian_files_load_with_the_published_counts_and_balance(real_dataset):
    assert real_dataset.train_images.shape == (60_000, 28, 28, 1)
    assert real_dataset.test_images.shape == (10_000, 28, 28, 1)
    assert real_dataset.train_images.dtype == np.uint8
    assert real_dataset.train_labels.dtype == np.int32 and real_dataset.origin == "IDX files"
    np.testing.assert_array_equal(np.bincount(real_dataset.train_labels), [6_000] * 10)
    np.testing.assert_array_equal(np.bincount(real_dataset.test_labels), [1_000] * 10)


def test_debian_recompressed_gz_is_accepted_by_its_payload_md5():
    fashion = datasets.IDX_DATASETS["fashion_mnist"]
    test_labels = fashion.files[3]
    path = fashion.system_dir / test_labels.gz_name
    assert data_files.md5_hex(path.read_bytes()) != test_labels.gz_md5  # Debian re-compressed it
    payload = data_files.verified_payload(path, test_labels)
    assert data_files.md5_hex(payload) == test_labels.raw_md5


@pytest.mark.parametrize("compress", [True, False])
def test_small_gz_and_raw_files_load(tmp_path, compress):
    images, labels = small_arrays(7)
    name = "x-images-idx3-ubyte" + (".gz" if compress else "")
    spec = write_idx(tmp_path / name, idx_bytes(images), compress=compress)
    payload = data_files.verified_payload(tmp_path / name, spec)
    np.testing.assert_array_equal(datasets.parse_idx(payload, name, images=True), images)
    label_spec = write_idx(tmp_path / "y", idx_bytes(labels), compress=compress)
    payload = data_files.verified_payload(tmp_path / "y", label_spec)
    np.testing.assert_array_equal(datasets.parse_idx(payload, "y", images=False), labels)


def test_small_dataset_loads_from_data_dir(small_dataset_dir, tmp_path_factory):
    directory, spec = small_dataset_dir
    dataset = datasets.load_dataset(offline(spec, tmp_path_factory.mktemp("empty")), directory)
    assert dataset.train_images.shape == (64, 28, 28, 1)
    assert dataset.test_labels.shape == (20,)
    assert dataset.sources[0] == str(directory / spec.files[0].gz_name)
    assert dataset.checked and dataset.num_classes == 10


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero"])
@pytest.mark.parametrize("name", ["idx", "train.npz", "classes.txt"])
def test_a_data_file_that_is_a_fifo_or_a_device_is_named_for_what_it_is(
    small_dataset_dir, tmp_path_factory, name, kind
):
    """An IDX file, an .npz split or classes.txt as a FIFO was "not found" (classes.txt was
    passed over in silence); reading one would wait for ever."""
    directory, spec = small_dataset_dir
    arrays = write_arrays(tmp_path_factory.mktemp("arrays"))
    path = directory / spec.files[1].gz_name if name == "idx" else arrays / name
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink(kind, path)
    with within(10), pytest.raises(UserError) as raised:
        if name == "idx":
            datasets.load_dataset(offline(spec, tmp_path_factory.mktemp("empty")), directory)
        else:
            load_arrays(arrays)
    what = "a FIFO" if kind == "fifo" else f"a character device (a symbolic link to {kind})"
    assert str(raised.value) == (
        f"{path} is {what}, not a regular file; put the data file itself there (a symlink to "
        "one will do)"
    )


def test_wrong_magic_is_refused_naming_the_file():
    images, _ = small_arrays(3)
    with pytest.raises(UserError, match=r"bad-file: IDX magic number 2049, expected 2051") as exc:
        datasets.parse_idx(idx_bytes(images, magic=2049), "bad-file", images=True)
    one_line(exc)


def test_any_image_size_parses_but_an_empty_side_is_refused():
    payload = idx_bytes(np.zeros((2, 32, 20), np.uint8))
    assert datasets.parse_idx(payload, "f", images=True).shape == (2, 32, 20)
    with pytest.raises(UserError, match="images are 0x28; both sides must be positive"):
        datasets.parse_idx(idx_bytes(np.zeros((2, 0, 28), np.uint8)), "f", images=True)


@pytest.mark.parametrize("cut", [1, 784, 10_000])
def test_truncated_file_is_refused(cut):
    payload = idx_bytes(small_arrays(20)[0])
    with pytest.raises(UserError, match="truncated") as exc:
        datasets.parse_idx(payload[:-cut], "short-file", images=True)
    assert "short-file" in one_line(exc)


def test_trailing_bytes_are_refused():
    with pytest.raises(UserError, match="trailing bytes"):
        datasets.parse_idx(idx_bytes(small_arrays(2)[1]) + b"\0", "f", images=False)


def test_label_out_of_range_is_refused():
    labels = np.array([0, 9, 10, 3], np.uint8)
    parsed = datasets.parse_idx(idx_bytes(labels), "labels", images=False)
    with pytest.raises(UserError, match=r"labels: label 10 at index 2 is outside 0\.\.9"):
        data_files.check_labels(parsed, "labels", 10)


def test_image_and_label_counts_must_agree(small_dataset_dir, tmp_path_factory):
    directory, spec = small_dataset_dir
    _, labels = small_arrays(63)
    bad = write_idx(directory / spec.files[1].gz_name, idx_bytes(labels), compress=True)
    spec = dataclasses.replace(spec, files=(spec.files[0], bad, *spec.files[2:]))
    with pytest.raises(UserError, match=r"images-idx3-ubyte.gz has 64 images but 63 labels") as exc:
        datasets.load_dataset(offline(spec, tmp_path_factory.mktemp("empty")), directory)
    one_line(exc)


@pytest.mark.parametrize("compress", [True, False])
def test_md5_mismatch_is_refused(tmp_path, compress):
    images, _ = small_arrays(4)
    spec = write_idx(tmp_path / "f", idx_bytes(images), compress=compress)
    tampered = bytearray(idx_bytes(images))
    tampered[-1] ^= 1
    (tmp_path / "f").write_bytes(gzip.compress(bytes(tampered)) if compress else bytes(tampered))
    with pytest.raises(UserError, match="MD5 mismatch") as exc:
        data_files.verified_payload(tmp_path / "f", spec)
    assert str(tmp_path / "f") in one_line(exc)


def test_no_data_and_no_network_names_the_three_ways(tmp_path):
    spec = dataclasses.replace(
        datasets.IDX_DATASETS["fashion_mnist"],
        cache_root=tmp_path / "cache",
        system_dir=tmp_path,
        base_url="http://127.0.0.1:9",
    )
    with pytest.raises(UserError) as exc:
        datasets.load_dataset(spec)
    message = one_line(exc)
    for way in ("apt-get install dataset-fashion-mnist", "--data_dir", "download"):
        assert way in message


def test_missing_data_dir_is_refused(tmp_path):
    with pytest.raises(UserError, match="is not a directory"):
        datasets.load_dataset("fashion_mnist", tmp_path / "nope", download=False)


class _Server:
    """A loopback HTTP server that serves `bodies[name]` in turn, one per request."""

    def __init__(self, bodies: dict[str, list[bytes]]):
        requests = self.requests = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                name = self.path.rsplit("/", 1)[-1]
                requests.append(name)
                body = bodies[name].pop(0)
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/data"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def web_spec(tmp_path, url):
    """Fashion-MNIST's spec downloading from a loopback `url` into an empty cache."""
    return dataclasses.replace(
        datasets.IDX_DATASETS["fashion_mnist"],
        cache_root=tmp_path / "cache",
        system_dir=tmp_path / "none",
        base_url=url,
    )


def test_download_with_wrong_md5_is_deleted_and_fetched_once_more(tmp_path):
    _, labels = small_arrays(5)
    good = gzip.compress(idx_bytes(labels))
    spec = write_idx(tmp_path / "src", idx_bytes(labels), compress=False)
    spec = datasets.IdxFile("y-labels", data_files.md5_hex(good), spec.raw_md5)
    server = _Server({"y-labels.gz": [b"\x1f\x8b garbage", good]})
    dataset = web_spec(tmp_path, server.url)
    cache = dataset.cache_dir
    try:
        payload, source = datasets.find_payload(spec, dataset, None, download=True)
    finally:
        server.close()
    assert server.requests == ["y-labels.gz", "y-labels.gz"]
    assert payload == idx_bytes(labels)
    assert source.startswith("http://127.0.0.1")
    assert (cache / "y-labels.gz").read_bytes() == good


def test_download_that_stays_wrong_is_refused_and_not_kept(tmp_path):
    _, labels = small_arrays(5)
    spec = datasets.IdxFile("y-labels", "0" * 32, "1" * 32)
    bad = gzip.compress(idx_bytes(labels))
    server = _Server({"y-labels.gz": [bad, bad, bad]})
    try:
        with pytest.raises(UserError, match="MD5 mismatch"):
            datasets.find_payload(spec, web_spec(tmp_path, server.url), None, download=True)
    finally:
        server.close()
    assert server.requests == ["y-labels.gz", "y-labels.gz"]
    assert list(web_spec(tmp_path, server.url).cache_dir.iterdir()) == []


# --- The `arrays` dataset: train.npz and test.npz --------------------------------------------


def write_arrays(directory, shape=(6, 5, 3), train=12, test=4, classes=3, **extra):
    """train.npz and test.npz of random uint8 images of `shape` and labels 0..classes-1."""
    directory.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for name, n in (("train", train), ("test", test)):
        images = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
        arrays = {"images": images, "labels": np.arange(n) % classes, **extra}
        np.savez(directory / f"{name}.npz", **arrays)
    return directory


def load_arrays(directory):
    config = config_lib.get_config()
    config.dataset.name, config.data_dir = "arrays", str(directory)
    return datasets.load(config)


@pytest.mark.parametrize("shape", [(6, 5, 3), (6, 5, 1), (6, 5)])
def test_arrays_load_colour_or_grey_as_uint8_nhwc(tmp_path, shape):
    directory = write_arrays(tmp_path / "d", shape)
    (directory / "classes.txt").write_text("cat\ndog\nfish\n")
    dataset = load_arrays(directory)
    assert dataset.image_shape == (6, 5, shape[2] if len(shape) == 3 else 1)
    assert dataset.train_images.dtype == np.uint8 and dataset.train_labels.dtype == np.int32
    assert (len(dataset.train_labels), len(dataset.test_labels)) == (12, 4)
    assert dataset.class_names == ("cat", "dog", "fish") and dataset.origin == ".npz files"
    assert dataset.title == "d (arrays)" and dataset.sources[1] == str(directory / "test.npz")
    stored = np.load(directory / "train.npz")["images"]
    np.testing.assert_array_equal(dataset.train_images.reshape(stored.shape), stored)


def test_arrays_without_classes_txt_name_their_classes_by_number(tmp_path):
    assert load_arrays(write_arrays(tmp_path / "d", classes=4)).class_names == ("0", "1", "2", "3")


def test_float_pixels_with_their_range_become_uint8(tmp_path):
    directory = tmp_path / "d"
    directory.mkdir()
    for name in ("train", "test"):
        images = np.linspace(0, 1, 2 * 4 * 4 * 3).reshape(2, 4, 4, 3)
        np.savez(directory / f"{name}.npz", images=images, labels=[0, 1], pixel_range=[0, 1])
    dataset = load_arrays(directory)
    assert dataset.train_images.dtype == np.uint8
    assert dataset.train_images.min() == 0 and dataset.train_images.max() == 255


def test_each_npz_maps_its_floats_by_its_own_pixel_range(tmp_path):
    """train.npz spans 0..255 and test.npz 0..1: each is mapped by its own range, not train's."""
    directory = tmp_path / "d"
    directory.mkdir()
    images = np.linspace(0, 1, 2 * 4 * 4).reshape(2, 4, 4)
    np.savez(directory / "train.npz", images=images * 255, labels=[0, 1], pixel_range=[0, 255])
    np.savez(directory / "test.npz", images=images, labels=[0, 1], pixel_range=[0.0, 1.0])
    dataset = load_arrays(directory)
    assert dataset.test_images.max() == 255
    np.testing.assert_array_equal(dataset.test_images, dataset.train_images)


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        (np.array([2**32 + 3, 0], np.int64), "label 4294967299 at index 0 is outside 0..2"),
        (np.array([0, 2**64 - 1], np.uint64), "label 18446744073709551615 at index 1 is outside"),
        (np.array([2**31, 0], np.int64), "label 2147483648 at index 0 is outside 0..2"),
    ],
)
def test_labels_are_checked_as_they_are_before_any_cast(tmp_path, labels, message):
    """Cast to int32 first, these became class 3, -1 and -2**31 (a NaN loss)."""
    directory = write_arrays(tmp_path / "d", train=2, test=2)
    (directory / "classes.txt").write_text("a\nb\nc\n")
    np.savez(directory / "train.npz", images=np.zeros((2, 6, 5), np.uint8), labels=labels)
    with pytest.raises(UserError) as exc:
        load_arrays(directory)
    assert message in one_line(exc) and str(directory / "train.npz") in str(exc.value)


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        (np.array([-1, 0, 1, 2]), "train.npz: label -1 is negative; labels count from 0"),
        (np.array([0.0, 1.0, 2.0, 0.0]), "train.npz: labels of shape (4,) and dtype float64;"),
    ],
)
def test_negative_or_float_labels_without_classes_txt_say_what_is_wrong(tmp_path, labels, message):
    """Not "the labels run up to 0 but -1 of the classes have no example"."""
    directory = write_arrays(tmp_path / "d", train=4, test=4)
    np.savez(directory / "train.npz", images=np.zeros((4, 6, 5), np.uint8), labels=labels)
    with pytest.raises(UserError) as exc:
        load_arrays(directory)
    assert message in one_line(exc) and "run up to" not in str(exc.value)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("missing", "train.npz not found; the arrays dataset needs train.npz and test.npz"),
        ("not npz", "train.npz: cannot read it as an .npz archive"),
        ("no labels", "train.npz has no labels array (it holds images)"),
        ("float", "train.npz: images are float64; pixels must be uint8 (0..255), or floats"),
        ("float out of range", "train.npz: float pixels are not all within its pixel_range"),
        ("bad label", "train.npz: label 7 at index 0 is outside 0..2"),
        ("negative label", "train.npz: label -1 is negative"),
        ("count", "train.npz has 12 images but 3 labels; they must pair"),
        ("empty", "train.npz holds no examples; each split needs at least one"),
        ("shape", "train.npz holds (7, 5, 3) images but"),
        ("objects", "train.npz: cannot read it as an .npz archive"),
        ("many objects", "train.npz: cannot read it as an .npz archive (images holds Python"),
        ("rank", "train.npz: images of shape (12, 90); expected (N, H, W) or (N, H, W, C)"),
        ("no pixel_range values", "train.npz: pixel_range [] (float64) must be two numbers"),
        ("one pixel_range value", "train.npz: pixel_range [1.0] (float64) must be two numbers"),
        ("string pixel_range", "train.npz: pixel_range ['lo', 'hi'] (<U2) must be two numbers"),
        ("npy named npz", "train.npz holds one .npy array, not an .npz archive; save both"),
        ("huge header", "train.npz: images declares shape (100000000000, 28, 28) of uint8"),
    ],
)
def test_bad_array_files_are_one_line_naming_the_file(tmp_path, change, message):
    directory = write_arrays(tmp_path / "d")
    (directory / "classes.txt").write_text("a\nb\nc\n")
    train = directory / "train.npz"
    images = np.zeros((12, 6, 5, 3), np.uint8)
    labels = np.arange(12) % 3
    rewrite = {
        "no labels": {"images": images},
        "float": {"images": images.astype(np.float64), "labels": labels},
        "float out of range": {"images": images + 2.0, "labels": labels, "pixel_range": [0, 1]},
        "bad label": {"images": images, "labels": np.full(12, 7)},
        "negative label": {"images": images, "labels": np.full(12, -1)},
        "count": {"images": images, "labels": labels[:3]},
        "empty": {"images": images[:0], "labels": labels[:0]},
        "shape": {"images": np.zeros((12, 7, 5, 3), np.uint8), "labels": labels},
        "objects": {"images": np.array([object()] * 12), "labels": labels},
        "many objects": {"images": np.full((12, 6, 5, 3), None), "labels": labels},
        "rank": {"images": images.reshape(12, 90), "labels": labels},
    }
    floats = images / 255.0
    rewrite |= {
        "no pixel_range values": {"images": floats, "labels": labels, "pixel_range": []},
        "one pixel_range value": {"images": floats, "labels": labels, "pixel_range": [1.0]},
        "string pixel_range": {"images": floats, "labels": labels, "pixel_range": ["lo", "hi"]},
    }
    if change == "missing":
        train.unlink()
    elif change == "not npz":
        train.write_bytes(b"not a zip")
    elif change == "npy named npz":
        np.save(train.open("wb"), images)
    elif change == "huge header":
        write_declaring(train, (10**11, 28, 28), labels)
    else:
        np.savez(train, **rewrite[change])
    with pytest.raises(UserError) as exc:
        load_arrays(directory)
    assert message in one_line(exc)
    assert str(train) in str(exc.value)


def write_declaring(path, shape, labels):
    """An .npz whose images.npy header declares `shape` over 100 bytes of data."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "|u1", "fortran_order": False, "shape": shape}
    )
    saved_labels = io.BytesIO()
    np.save(saved_labels, labels)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("images.npy", header.getvalue() + bytes(100))
        archive.writestr("labels.npy", saved_labels.getvalue())


def test_a_header_declaring_more_than_a_compressed_member_holds_is_refused(tmp_path):
    """A deflated member's recorded size is checked too: deflate packs at most ~1032:1."""
    directory = write_arrays(tmp_path / "d")
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "|u1", "fortran_order": False, "shape": (10**9, 6, 5)}
    )
    info = zipfile.ZipInfo("images.npy")
    info.compress_type = zipfile.ZIP_DEFLATED
    with zipfile.ZipFile(directory / "train.npz", "w") as archive:
        archive.writestr(info, header.getvalue() + bytes(10**6))  # 1 MB of zeros packs to ~1 KB
    with pytest.raises(UserError, match=r"images declares shape \(1000000000, 6, 5\)") as exc:
        load_arrays(directory)
    one_line(exc)
    np.savez_compressed(directory / "train.npz", images=np.zeros((12, 6, 5, 3), np.uint8),
                        labels=np.arange(12) % 3)  # fmt: skip
    assert load_arrays(directory).train_images.shape == (12, 6, 5, 3)  # real ones still load


def test_more_class_names_than_supported_are_one_line(tmp_path):
    """Millions of names trained, wrote gigabytes and failed in the confusion matrix."""
    directory = write_arrays(tmp_path / "d")
    names = "\n".join(f"c{k}" for k in range(data_files.MAX_CLASSES + 1))
    (directory / "classes.txt").write_text(names)
    with pytest.raises(UserError, match=r"classes.txt: 10,001 classes; at most 10,000") as exc:
        load_arrays(directory)
    one_line(exc)


def test_a_registered_loader_is_a_dataset_name(tmp_path, registries):
    """The registry's promise: one decorated function makes a source the config can name; it
    reads fields of its own from the run's config."""

    @datasets.register("stripes_in_test", needs="nothing at all")
    def load_stripes(data_dir, config):
        side = config.dataset.side
        images = np.zeros((8, side, side, 3), np.uint8)
        images[::2, :, :, 0] = 255
        split = (images, np.arange(8) % 2)
        return datasets.make_dataset(
            "stripes_in_test",
            "Stripes",
            ("red", "black"),
            split,
            split,
            sources=("memory", "memory"),
            origin="memory",
        )

    config = config_lib.get_config()
    config.dataset.name, config.dataset.side = "stripes_in_test", 6
    with pytest.raises(
        UserError, match=r"--config\.dataset\.name=stripes_in_test needs --data_dir=DIR"
    ):
        datasets.load(config)
    config.data_dir = str(tmp_path)
    loaded = datasets.load(config)
    assert loaded.class_names == ("red", "black") and loaded.image_shape == (6, 6, 3)
    config.dataset.name = "stripe_in_test"
    with pytest.raises(
        UserError, match=r"'stripe_in_test' is not one of fashion_mnist, mnist, idx"
    ):
        datasets.get(config)


def write_four(directory, train_labels, test_labels, test_images=4):
    """Four raw IDX files of 4x4 images with the given labels (no classes.txt)."""
    directory.mkdir()
    for stem, labels, n in (
        ("train", train_labels, len(train_labels)),
        ("t10k", test_labels, test_images),
    ):
        images = np.zeros((n, 4, 4), np.uint8)
        (directory / f"{stem}-images-idx3-ubyte").write_bytes(idx_bytes(images))
        (directory / f"{stem}-labels-idx1-ubyte").write_bytes(
            idx_bytes(np.asarray(labels, np.uint8))
        )


def idx_config(directory):
    config = config_lib.get_config()
    config.dataset.name, config.data_dir = "idx", str(directory)
    return config


def test_a_stray_label_without_class_names_is_refused_not_a_new_class(tmp_path):
    labels = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9] * 2
    write_four(tmp_path / "stray", [*labels[:-1], 200], [0, 1, 2, 3])
    with pytest.raises(UserError, match=r"labels run up to 200 but 190 of the classes") as exc:
        datasets.load(idx_config(tmp_path / "stray"))
    assert "classes.txt" in one_line(exc)
    write_four(tmp_path / "fine", labels, [0, 1, 2, 3])
    assert datasets.load(idx_config(tmp_path / "fine")).num_classes == 10


def test_an_idx_test_set_without_images_is_one_line(tmp_path):
    write_four(tmp_path / "d", [0, 1, 0, 1], [], test_images=0)
    with pytest.raises(UserError, match="holds no examples; each split needs at least one") as exc:
        datasets.load(idx_config(tmp_path / "d"))
    assert "t10k-images-idx3-ubyte" in one_line(exc)


def test_identity_compares_only_what_a_checkpoint_recorded():
    now = {
        "name": "idx",
        "image_shape": [4, 4, 1],
        "class_names": ["a"],
        "examples": [8, 2],
        "fingerprint": "abc",
    }
    assert data_files.identity_changes({}, now) == []  # a checkpoint without a dataset item
    older = {"name": "idx", "image_shape": [4, 4], "class_names": ["a"]}  # before colour
    assert data_files.identity_changes(older, now) == []
    assert data_files.identity_changes({**older, "fingerprint": "abd"}, now) == [
        {"field": "dataset.fingerprint", "saved": "abd", "now": "abc"}
    ]


def test_a_gz_is_decompressed_once_and_a_damaged_cache_entry_is_written_again(
    tmp_path, monkeypatch
):
    """The payload of a .gz is kept by the .gz's MD5 (in the process and on disk): a damaged
    entry is never returned but written again whole, and a spec is checked on every read."""
    monkeypatch.setattr(data_files, "CACHE_ROOT", tmp_path / "cache")
    monkeypatch.setattr(data_files, "_PAYLOADS", {})
    payload = idx_bytes(np.arange(100, dtype=np.uint8) % 10)
    path = tmp_path / "y.gz"
    path.write_bytes(gzip.compress(payload))
    spec = datasets.IdxFile("y", None, data_files.md5_hex(payload))
    assert data_files.verified_payload(path, spec) == payload
    [entry] = (tmp_path / "cache" / data_files.PAYLOAD_DIR).glob("*.idx")
    assert entry.name.startswith(data_files.md5_hex(path.read_bytes()))
    assert entry.read_bytes() == payload
    monkeypatch.setattr(data_files, "_PAYLOADS", {})  # as a new process finds it
    entry.write_bytes(b"\x07" + payload[1:])
    assert data_files.verified_payload(path, spec) == payload
    [again] = (tmp_path / "cache" / data_files.PAYLOAD_DIR).glob("*.idx")
    assert again.read_bytes() == payload
    other = datasets.IdxFile("y", None, "0" * 32)  # cached or not, another payload is refused
    with pytest.raises(UserError, match="MD5 mismatch"):
        data_files.verified_payload(path, other)
    monkeypatch.setattr(data_files, "_PAYLOADS", {})
    blocked = tmp_path / "file"  # a cache that cannot be made (a file in its place): still loads
    blocked.write_text("")
    monkeypatch.setattr(data_files, "CACHE_ROOT", blocked)
    assert data_files.verified_payload(path, spec) == payload


def test_a_loader_of_the_wrong_shape_is_refused_where_it_is_registered(registries):
    """A loader of `data_dir` alone (before loaders received the config) is one line when its
    module registers it, not a TypeError when a run loads it."""
    with pytest.raises(
        UserError, match=r"^@register\('old_style'\): a loader takes \(data_dir, config\)$"
    ):
        datasets.register("old_style")(lambda data_dir: None)
    assert "old_style" not in datasets.DATASETS
