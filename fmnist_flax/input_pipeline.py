"""Batches on the devices: each batch gathered, normalised and augmented inside the step.

The train set's placement on the mesh and each epoch's order are runtime/device_batches.py's
(`DeviceData` and `DeviceBatches` are importable from here). Images are (N, H, W, C)
everywhere; normalisation and augmentation work for any channel count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh

from fmnist_flax.runtime import ensemble, parallel
from fmnist_flax.runtime.device_batches import DeviceBatches as DeviceBatches
from fmnist_flax.runtime.device_batches import DeviceData as DeviceData
from fmnist_flax.runtime.errors import UserError
from fmnist_flax.runtime.inference import PIXEL_SCALE


def prepare_images(images: np.ndarray) -> np.ndarray:
    """uint8 (N, H, W, C) -> float32 in [0, 1] on the host, as the codelab does."""
    return images.astype(np.float32) * PIXEL_SCALE


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
    x: np.ndarray, y: np.ndarray, batch_size: int, num_batches: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every example in `num_batches` batches (default: as few as hold them), the rest padded
    with zeros; the mask marks the real ones."""
    num_batches = -(-len(x) // batch_size) if num_batches is None else num_batches
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
    """uint8 pixels -> float32 in [0, 1] on the device, the codelab's scaling."""
    return images.astype(jnp.float32) * PIXEL_SCALE


def batch_at(
    images: jax.Array,
    labels: jax.Array,
    order: jax.Array,
    index: jax.Array | int,
    batch_size: int,
    image_shape: tuple[int, int, int],
    mesh: Mesh | None = None,
    accumulate: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """Update `index` of an epoch's order: `accumulate` batches of `batch_size`, gathered and
    normalised to (B, H, W, C), or (accumulate, B, H, W, C) when accumulating (works inside
    jit too). On a mesh each batch's picks are split along `data` first, so each device
    gathers only its slice."""
    examples = batch_size * accumulate
    picks = jax.lax.dynamic_slice_in_dim(order, index * examples, examples)
    if accumulate > 1:
        picks = picks.reshape(accumulate, batch_size)
    if mesh is not None:
        picks = jax.lax.with_sharding_constraint(
            picks, parallel.batch_sharding(mesh, axis=picks.ndim - 1)
        )
    return normalize(images[picks]).reshape(*picks.shape, *image_shape), labels[picks]


def augment(x: jax.Array, key: jax.Array, max_shift: int, flip: bool) -> jax.Array:
    """Random left-right flips and shifts of up to `max_shift` pixels (zero fill), per image,
    on the device: (..., H, W, C) in and out, any channel count; labels untouched. The leading
    axes are flattened first, so accumulated micro-batches draw what one batch would."""
    images = x.reshape(-1, *x.shape[-3:])
    flip_key, shift_key = jax.random.split(key)
    if flip:
        mirror = jax.random.bernoulli(flip_key, 0.5, (len(images), 1, 1, 1))
        images = jnp.where(mirror, images[:, :, ::-1], images)
    if max_shift:
        pad = ((0, 0), (max_shift, max_shift), (max_shift, max_shift), (0, 0))
        offsets = jax.random.randint(shift_key, (len(images), 2), 0, 2 * max_shift + 1)
        offsets = jnp.concatenate([offsets, jnp.zeros_like(offsets[:, :1])], axis=1)
        images = jax.vmap(lambda image, at: jax.lax.dynamic_slice(image, at, x.shape[-3:]))(
            jnp.pad(images, pad), offsets
        )
    return images.reshape(x.shape)


AUGMENT_STREAM = 2  # fold_in index of the augmentation key (params 0, dropout 1)


def augment_key(config: ml_collections.ConfigDict) -> jax.Array | None:
    """The augmentation stream's key, or None without augmentation (two compiles saved); one
    per member, from seed + k, when an ensemble's members see their own data."""
    if not (config.augment.max_shift or config.augment.flip):
        return None
    seeds = ensemble.data_seeds(config)
    keys = [jax.random.fold_in(jax.random.key(s), AUGMENT_STREAM) for s in seeds]
    return jnp.stack(keys) if len(keys) > 1 else keys[0]


def check_augment(augment: ml_collections.ConfigDict, image_shape: tuple[int, int, int]) -> None:
    """A shift must leave most of an image in its frame: under half its shorter side (a shift
    of 100 pixels on 28 moved every image out, and the run trained to chance)."""
    most = min(image_shape[:2]) // 2 - 1
    if augment.max_shift > most:
        raise UserError(
            f"--config.augment.max_shift={augment.max_shift} can move a {image_shape[0]}x"
            f"{image_shape[1]} image half or more out of its frame; use at most {most} (a few "
            "pixels, e.g. 2)"
        )
