"""Device batches: uint8 train images on the mesh, per-epoch orders, padded test batches."""

from __future__ import annotations

import concurrent.futures

import jax
import numpy as np
import pytest
from conftest import offline

from fmnist_flax import datasets, input_pipeline
from fmnist_flax.runtime import device_batches, parallel
from fmnist_flax.runtime.errors import UserError


def test_device_data_keeps_uint8_train_images_flat_and_no_test_set(real_dataset):
    device_data = device_batches.to_device(real_dataset, 512, parallel.make_mesh())
    assert device_data.train_images.shape == (60_000, 784)  # one row gather per batch
    assert device_data.train_images.dtype == np.uint8  # normalised inside the step
    assert device_data.batches_per_epoch == 117 and device_data.image_shape == (28, 28, 1)
    assert not any(name.startswith("test") for name in vars(device_data))  # streamed instead
    accumulating = device_batches.to_device(real_dataset, 128, parallel.make_mesh(), False, 4)
    assert accumulating.train_images is None  # Grain feeds it
    assert accumulating.examples_per_step == 512 and accumulating.batches_per_epoch == 117


@pytest.mark.parametrize(
    ("seed", "epoch", "n"),
    [(0, 0, 60_000), (0, 3, 60_000), (7, 1, 10), (0, 2, 1), (2**32 - 1, 9, 4096)],
)
def test_the_host_sorted_order_is_jax_random_permutation(seed, epoch, n):
    """NumPy draws the order's keys and sorts them, for speed, but the order must stay JAX's
    permutation to the element, the one an accelerator draws: runs, resumes and documented
    results depend on it (a JAX upgrade that changes its shuffle fails here)."""
    key = jax.random.fold_in(jax.random.key(seed), epoch)
    expected = np.asarray(jax.random.permutation(key, n))
    np.testing.assert_array_equal(np.asarray(device_batches.epoch_order(seed, epoch, n)), expected)
    drawn = device_batches._permutation(np.uint32(seed), epoch, n)  # an accelerator's path
    np.testing.assert_array_equal(np.asarray(drawn), expected)


def test_the_program_compiled_for_an_accelerator_draws_the_same_orders(monkeypatch):
    """On an accelerator the orders come from NumPy until `compile_permutation`'s program is
    compiled, then from it: a run switching mid-way trains on the orders it always did."""
    n = 1234
    numpy_order = np.asarray(device_batches.epoch_order(7, 3, n))
    compiled = concurrent.futures.Future()
    compiled.set_result(device_batches._permutation.lower(np.uint32(0), 0, n).compile())
    monkeypatch.setitem(device_batches._COMPILED, n, compiled)
    device_batches.epoch_order.cache_clear()
    np.testing.assert_array_equal(np.asarray(device_batches.epoch_order(7, 3, n)), numpy_order)


def test_another_prng_setting_gets_its_own_jax_random_permutation():
    """The keys NumPy draws are those of JAX's default PRNG; under another setting (the older,
    non-partitionable threefry) the order is still that setting's `jax.random.permutation`."""
    with jax.threefry_partitionable(False):
        key = jax.random.fold_in(jax.random.key(5), 2)
        expected = np.asarray(jax.random.permutation(key, 1000))
        drawn = np.asarray(device_batches.epoch_order(5, 2, 1000))
    np.testing.assert_array_equal(drawn, expected)
    default = jax.random.permutation(jax.random.fold_in(jax.random.key(5), 2), 1000)
    assert not np.array_equal(expected, np.asarray(default))  # the setting changes the order


def test_each_epoch_gets_a_fresh_seeded_permutation(real_dataset):
    device_data = device_batches.to_device(real_dataset, 512, parallel.make_mesh())
    first = np.asarray(device_batches.epoch_order(0, 0, 60_000))
    np.testing.assert_array_equal(np.sort(first), np.arange(60_000))
    np.testing.assert_array_equal(first, np.asarray(device_batches.epoch_order(0, 0, 60_000)))
    assert not np.array_equal(first, np.asarray(device_batches.epoch_order(0, 1, 60_000)))
    assert not np.array_equal(first, np.asarray(device_batches.epoch_order(1, 0, 60_000)))
    x, y = input_pipeline.batch_at(
        device_data.train_images,
        device_data.train_labels,
        jax.numpy.asarray(first),
        2,
        512,
        (28, 28, 1),
    )
    picks = first[1024:1536]
    np.testing.assert_array_equal(np.asarray(y), real_dataset.train_labels[picks])
    np.testing.assert_array_equal(
        np.asarray(x), input_pipeline.prepare_images(real_dataset.train_images[picks])
    )
    # Accumulating 4 batches of 128 reads the same 512 examples, as (4, 128, ...).
    xs, ys = input_pipeline.batch_at(
        device_data.train_images,
        device_data.train_labels,
        jax.numpy.asarray(first),
        2,
        128,
        (28, 28, 1),
        accumulate=4,
    )
    assert xs.shape == (4, 128, 28, 28, 1) and ys.shape == (4, 128)
    np.testing.assert_array_equal(np.asarray(xs).reshape(x.shape), np.asarray(x))


def test_device_batches_stop_at_an_epoch_and_pass_kept_device_ints(real_dataset, quick_config):
    """Steps 101..130 are two calls, split at the epoch's end (117). Each call's first batch
    index and count are int32s replicated on the mesh and made once per value: a Python int
    would be copied to the device at every call."""
    device_data = device_batches.to_device(real_dataset, 512, parallel.make_mesh())
    batches = input_pipeline.DeviceBatches(device_data, quick_config)
    calls = [*batches.chunks(100, 117), *batches.chunks(117, 130)]
    assert [(int(c[3]), int(c[4]), c[5]) for c in calls] == [(100, 17, 100), (0, 13, 117)]
    for start, count in (call[3:5] for call in calls):
        for n in (start, count):
            assert isinstance(n, jax.Array) and n.dtype == np.int32
            assert n.sharding == parallel.replicated(device_data.mesh)
    again = next(iter(batches.chunks(100, 117)))
    assert again[3] is calls[0][3] and again[4] is calls[0][4]


def test_codelab_fixed_batches_drop_the_remainder():
    x = np.arange(10, dtype=np.float32).reshape(5, 2)
    xb, yb = input_pipeline.fixed_batches(x, np.arange(5), 2)
    assert xb.shape == (2, 2, 2) and yb.dtype == np.int32
    np.testing.assert_array_equal(yb.reshape(-1), [0, 1, 2, 3])


def test_batch_larger_than_the_train_set_is_refused(small_dataset_dir, tmp_path_factory):
    directory, spec = small_dataset_dir
    dataset = datasets.load_dataset(offline(spec, tmp_path_factory.mktemp("empty")), directory)
    with pytest.raises(UserError, match="--batch_size=65 is larger than the 64 training"):
        device_batches.to_device(dataset, 65, parallel.make_mesh())
    with pytest.raises(UserError, match="--batch_size=32 x accumulate=3 is larger than the 64"):
        device_batches.to_device(dataset, 32, parallel.make_mesh(), accumulate=3)


def test_padded_batches_mask_only_the_padding():
    x = np.arange(10, dtype=np.float32).reshape(5, 2)
    y = np.arange(5)
    xb, yb, mask = input_pipeline.padded_batches(x, y, 2)
    assert xb.shape == (3, 2, 2)
    np.testing.assert_array_equal(mask.reshape(-1), [1, 1, 1, 1, 1, 0])
    np.testing.assert_array_equal(yb.reshape(-1)[:5], y)


@pytest.mark.parametrize("channels", [1, 3])
def test_augmentation_flips_and_shifts_any_channel_count(channels):
    """Each image's channels move together: a flip mirrors the width, a shift moves height and
    width with zero fill, and the channel axis is never touched."""
    rng = np.random.default_rng(0)
    x = jax.numpy.asarray(rng.random((64, 6, 5, channels), np.float32))
    key = jax.random.key(1)
    flipped = np.asarray(input_pipeline.augment(x, key, 0, True))
    pairs = list(zip(flipped, np.asarray(x), strict=True))
    mirrored = [np.array_equal(f, i[:, ::-1]) for f, i in pairs]
    same = [np.array_equal(f, i) for f, i in pairs]
    assert all(m or s for m, s in zip(mirrored, same, strict=True)) and 10 < sum(mirrored) < 54
    shifted = np.asarray(input_pipeline.augment(x, key, 1, False))
    for image, moved in zip(np.asarray(x), shifted, strict=True):
        padded = np.pad(image, ((1, 1), (1, 1), (0, 0)))
        assert any(
            np.array_equal(moved, padded[dy : dy + 6, dx : dx + 5])
            for dy in range(3)
            for dx in range(3)
        )
    # Micro-batches (K, B, ...) draw exactly what one batch of K * B would.
    stacked = input_pipeline.augment(x.reshape(4, 16, 6, 5, channels), key, 1, True)
    np.testing.assert_array_equal(
        np.asarray(stacked).reshape(x.shape), np.asarray(input_pipeline.augment(x, key, 1, True))
    )


def test_a_shift_that_moves_half_an_image_out_is_one_line():
    """max_shift=100 on 28-pixel images trained to chance in silence; 13 still leaves most of
    each image in its frame."""
    import ml_collections

    from fmnist_flax.runtime.errors import UserError

    input_pipeline.check_augment(ml_collections.ConfigDict({"max_shift": 13}), (28, 28, 1))
    with pytest.raises(UserError) as exc:
        input_pipeline.check_augment(ml_collections.ConfigDict({"max_shift": 100}), (28, 28, 1))
    assert str(exc.value) == (
        "--config.augment.max_shift=100 can move a 28x28 image half or more out of its frame; "
        "use at most 13 (a few pixels, e.g. 2)"
    )
