"""Device batches: uint8 train images on the mesh, per-epoch orders, padded test batches."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import offline

from fmnist_flax import datasets, input_pipeline, parallel
from fmnist_flax.errors import UserError


def test_device_data_keeps_uint8_train_images_and_covers_the_test_set(real_dataset):
    device_data = input_pipeline.to_device(real_dataset, 512, parallel.make_mesh())
    assert device_data.train_images.shape == (60_000, 784)
    assert device_data.train_images.dtype == np.uint8  # normalised inside the step
    assert device_data.batches_per_epoch == 117
    assert device_data.test_x.shape == (20, 512, 784)
    assert device_data.codelab_test_batches == 19  # the codelab's 9,728
    assert float(device_data.test_mask.sum()) == 10_000
    np.testing.assert_array_equal(
        np.asarray(device_data.test_y).reshape(-1)[:10_000], real_dataset.test_labels
    )


@pytest.mark.parametrize(
    ("seed", "epoch", "n"),
    [(0, 0, 60_000), (0, 3, 60_000), (7, 1, 10), (0, 2, 1), (2**32 - 1, 9, 4096)],
)
def test_the_host_sorted_order_is_jax_random_permutation(seed, epoch, n):
    """The order is sorted by NumPy for speed but must stay JAX's permutation to the element:
    runs, resumes and documented results depend on it (a JAX upgrade that changes its shuffle
    fails here)."""
    key = jax.random.fold_in(jax.random.key(seed), epoch)
    np.testing.assert_array_equal(
        np.asarray(input_pipeline.epoch_order(seed, epoch, n)),
        np.asarray(jax.random.permutation(key, n)),
    )


def test_each_epoch_gets_a_fresh_seeded_permutation(real_dataset):
    device_data = input_pipeline.to_device(real_dataset, 512, parallel.make_mesh())
    first = np.asarray(input_pipeline.epoch_order(0, 0, 60_000))
    np.testing.assert_array_equal(np.sort(first), np.arange(60_000))
    np.testing.assert_array_equal(first, np.asarray(input_pipeline.epoch_order(0, 0, 60_000)))
    assert not np.array_equal(first, np.asarray(input_pipeline.epoch_order(0, 1, 60_000)))
    assert not np.array_equal(first, np.asarray(input_pipeline.epoch_order(1, 0, 60_000)))
    x, y = input_pipeline.batch_at(
        device_data.train_images, device_data.train_labels, jax.numpy.asarray(first), 2, 512
    )
    picks = first[1024:1536]
    np.testing.assert_array_equal(np.asarray(y), real_dataset.train_labels[picks])
    np.testing.assert_array_equal(
        np.asarray(x), input_pipeline.prepare_images(real_dataset.train_images[picks])
    )


def test_codelab_fixed_batches_drop_the_remainder():
    x = np.arange(10, dtype=np.float32).reshape(5, 2)
    xb, yb = input_pipeline.fixed_batches(x, np.arange(5), 2)
    assert xb.shape == (2, 2, 2) and yb.dtype == np.int32
    np.testing.assert_array_equal(yb.reshape(-1), [0, 1, 2, 3])


def test_batch_larger_than_the_train_set_is_refused(small_dataset_dir, tmp_path_factory):
    directory, spec = small_dataset_dir
    dataset = datasets.load_dataset(offline(spec, tmp_path_factory.mktemp("empty")), directory)
    with pytest.raises(UserError, match="--batch_size=65 is larger than the 64 training"):
        input_pipeline.to_device(dataset, 65, parallel.make_mesh())


def test_padded_batches_mask_only_the_padding():
    x = np.arange(10, dtype=np.float32).reshape(5, 2)
    y = np.arange(5)
    xb, yb, mask = input_pipeline.padded_batches(x, y, 2)
    assert xb.shape == (3, 2, 2)
    np.testing.assert_array_equal(mask.reshape(-1), [1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(yb.reshape(-1)[:5], y)
