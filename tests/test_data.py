"""Finding, verifying, parsing and batching the data, on small IDX files and the real set."""

from __future__ import annotations

import gzip
import http.server
import threading

import jax
import numpy as np
import pytest
from conftest import idx_bytes, small_arrays, write_idx

from fmnist_flax import data, parallel
from fmnist_flax.errors import UserError


def one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_real_debian_files_load_with_the_published_counts_and_balance(real_dataset):
    assert real_dataset.train_images.shape == (60_000, 28, 28)
    assert real_dataset.test_images.shape == (10_000, 28, 28)
    assert real_dataset.train_images.dtype == np.uint8
    np.testing.assert_array_equal(np.bincount(real_dataset.train_labels), [6_000] * 10)
    np.testing.assert_array_equal(np.bincount(real_dataset.test_labels), [1_000] * 10)


def test_debian_recompressed_gz_is_accepted_by_its_payload_md5():
    path = data.SYSTEM_DIR / data.TEST_LABELS.gz_name
    assert data.md5_hex(path.read_bytes()) != data.TEST_LABELS.gz_md5  # Debian re-compressed it
    payload = data.verified_payload(path, data.TEST_LABELS)
    assert data.md5_hex(payload) == data.TEST_LABELS.raw_md5


@pytest.mark.parametrize("compress", [True, False])
def test_small_gz_and_raw_files_load(tmp_path, compress):
    images, labels = small_arrays(7)
    name = "x-images-idx3-ubyte" + (".gz" if compress else "")
    spec = write_idx(tmp_path / name, idx_bytes(images), compress=compress)
    payload = data.verified_payload(tmp_path / name, spec)
    np.testing.assert_array_equal(data.parse_idx(payload, name, images=True), images)
    label_spec = write_idx(tmp_path / "y", idx_bytes(labels), compress=compress)
    payload = data.verified_payload(tmp_path / "y", label_spec)
    np.testing.assert_array_equal(data.parse_idx(payload, "y", images=False), labels)


def test_small_dataset_loads_from_data_dir(small_dataset_dir, tmp_path_factory):
    directory, files = small_dataset_dir
    empty = tmp_path_factory.mktemp("empty")
    dataset = data.load_dataset(
        directory, files=files, cache_dir=empty, system_dir=empty, base_url=None
    )
    assert dataset.train_images.shape == (64, 28, 28)
    assert dataset.test_labels.shape == (20,)
    assert dataset.sources["train-images-idx3-ubyte"] == str(directory / files[0].gz_name)


def test_wrong_magic_is_refused_naming_the_file():
    images, _ = small_arrays(3)
    with pytest.raises(UserError, match=r"bad-file: IDX magic number 2049, expected 2051") as exc:
        data.parse_idx(idx_bytes(images, magic=2049), "bad-file", images=True)
    one_line(exc)


def test_wrong_image_size_is_refused():
    payload = idx_bytes(np.zeros((2, 32, 32), np.uint8))
    with pytest.raises(UserError, match="images are 32x32, expected 28x28"):
        data.parse_idx(payload, "f", images=True)


@pytest.mark.parametrize("cut", [1, 784, 10_000])
def test_truncated_file_is_refused(cut):
    payload = idx_bytes(small_arrays(20)[0])
    with pytest.raises(UserError, match="truncated") as exc:
        data.parse_idx(payload[:-cut], "short-file", images=True)
    assert "short-file" in one_line(exc)


def test_trailing_bytes_are_refused():
    with pytest.raises(UserError, match="trailing bytes"):
        data.parse_idx(idx_bytes(small_arrays(2)[1]) + b"\0", "f", images=False)


def test_label_out_of_range_is_refused():
    labels = np.array([0, 9, 10, 3], np.uint8)
    with pytest.raises(UserError, match=r"label 10 at index 2 is outside 0\.\.9"):
        data.parse_idx(idx_bytes(labels), "labels", images=False)


def test_image_and_label_counts_must_agree(small_dataset_dir, tmp_path_factory):
    directory, files = small_dataset_dir
    _, labels = small_arrays(63)
    bad = write_idx(directory / files.train_labels.gz_name, idx_bytes(labels), compress=True)
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(UserError, match=r"has 64 images but .* has 63 labels") as exc:
        data.load_dataset(
            directory,
            files=files._replace(train_labels=bad),
            cache_dir=empty,
            system_dir=empty,
            base_url=None,
        )
    one_line(exc)


@pytest.mark.parametrize("compress", [True, False])
def test_md5_mismatch_is_refused(tmp_path, compress):
    images, _ = small_arrays(4)
    spec = write_idx(tmp_path / "f", idx_bytes(images), compress=compress)
    tampered = bytearray(idx_bytes(images))
    tampered[-1] ^= 1
    (tmp_path / "f").write_bytes(gzip.compress(bytes(tampered)) if compress else bytes(tampered))
    with pytest.raises(UserError, match="MD5 mismatch") as exc:
        data.verified_payload(tmp_path / "f", spec)
    assert str(tmp_path / "f") in one_line(exc)


def test_no_data_and_no_network_names_the_three_ways(tmp_path):
    with pytest.raises(UserError) as exc:
        data.load_dataset(
            cache_dir=tmp_path / "cache", system_dir=tmp_path, base_url="http://127.0.0.1:9"
        )
    message = one_line(exc)
    for way in ("apt-get install dataset-fashion-mnist", "--data_dir", "download"):
        assert way in message


def test_missing_data_dir_is_refused(tmp_path):
    with pytest.raises(UserError, match="is not a directory"):
        data.load_dataset(tmp_path / "nope", base_url=None)


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


def test_download_with_wrong_md5_is_deleted_and_fetched_once_more(tmp_path):
    _, labels = small_arrays(5)
    good = gzip.compress(idx_bytes(labels))
    spec = write_idx(tmp_path / "src", idx_bytes(labels), compress=False)
    spec = data.IdxFile("y-labels", data.md5_hex(good), spec.raw_md5)
    cache = tmp_path / "cache"
    server = _Server({"y-labels.gz": [b"\x1f\x8b garbage", good]})
    try:
        payload, source = data.find_payload(spec, None, cache, tmp_path / "none", server.url)
    finally:
        server.close()
    assert server.requests == ["y-labels.gz", "y-labels.gz"]
    assert payload == idx_bytes(labels)
    assert source.startswith("http://127.0.0.1")
    assert (cache / "y-labels.gz").read_bytes() == good


def test_download_that_stays_wrong_is_refused_and_not_kept(tmp_path):
    _, labels = small_arrays(5)
    spec = data.IdxFile("y-labels", "0" * 32, "1" * 32)
    bad = gzip.compress(idx_bytes(labels))
    server = _Server({"y-labels.gz": [bad, bad, bad]})
    try:
        with pytest.raises(UserError, match="MD5 mismatch"):
            data.find_payload(spec, None, tmp_path / "cache", tmp_path / "none", server.url)
    finally:
        server.close()
    assert server.requests == ["y-labels.gz", "y-labels.gz"]
    assert list((tmp_path / "cache").iterdir()) == []


def test_device_data_keeps_uint8_train_images_and_covers_the_test_set(real_dataset):
    device_data = data.to_device(real_dataset, 512, parallel.make_mesh())
    assert device_data.train_images.shape == (60_000, 784)
    assert device_data.train_images.dtype == np.uint8  # normalised inside the step
    assert device_data.batches_per_epoch == 117
    assert device_data.test_x.shape == (20, 512, 784)
    assert device_data.codelab_test_batches == 19  # the codelab's 9,728
    assert float(device_data.test_mask.sum()) == 10_000
    np.testing.assert_array_equal(
        np.asarray(device_data.test_y).reshape(-1)[:10_000], real_dataset.test_labels
    )


def test_each_epoch_gets_a_fresh_seeded_permutation(real_dataset):
    device_data = data.to_device(real_dataset, 512, parallel.make_mesh())
    first = np.asarray(data.epoch_order(0, 0, 60_000))
    np.testing.assert_array_equal(np.sort(first), np.arange(60_000))
    np.testing.assert_array_equal(first, np.asarray(data.epoch_order(0, 0, 60_000)))
    assert not np.array_equal(first, np.asarray(data.epoch_order(0, 1, 60_000)))
    assert not np.array_equal(first, np.asarray(data.epoch_order(1, 0, 60_000)))
    x, y = data.batch_at(
        device_data.train_images, device_data.train_labels, jax.numpy.asarray(first), 2, 512
    )
    picks = first[1024:1536]
    np.testing.assert_array_equal(np.asarray(y), real_dataset.train_labels[picks])
    np.testing.assert_array_equal(
        np.asarray(x), data.prepare_images(real_dataset.train_images[picks])
    )


def test_codelab_fixed_batches_drop_the_remainder():
    x = np.arange(10, dtype=np.float32).reshape(5, 2)
    xb, yb = data.fixed_batches(x, np.arange(5), 2)
    assert xb.shape == (2, 2, 2) and yb.dtype == np.int32
    np.testing.assert_array_equal(yb.reshape(-1), [0, 1, 2, 3])


def test_batch_larger_than_the_train_set_is_refused(small_dataset_dir, tmp_path_factory):
    directory, files = small_dataset_dir
    empty = tmp_path_factory.mktemp("empty")
    dataset = data.load_dataset(
        directory, files=files, cache_dir=empty, system_dir=empty, base_url=None
    )
    with pytest.raises(UserError, match="--batch_size=65 is larger than the 64 training"):
        data.to_device(dataset, 65, parallel.make_mesh())


def test_padded_batches_mask_only_the_padding():
    x = np.arange(10, dtype=np.float32).reshape(5, 2)
    y = np.arange(5)
    xb, yb, mask = data.padded_batches(x, y, 2)
    assert xb.shape == (3, 2, 2)
    np.testing.assert_array_equal(mask.reshape(-1), [1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(yb.reshape(-1)[:5], y)
