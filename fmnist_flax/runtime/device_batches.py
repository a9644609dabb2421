"""The train set on the devices: placed on the mesh once (`to_device`), visited each epoch in
a permutation made from (seed, epoch) (`epoch_order`, exactly `jax.random.permutation`'s), fed
to the compiled step a chunk of steps per call (`DeviceBatches`). The gather and normalisation
of a batch is the template's (`input_pipeline.batch_at`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.sharding import Mesh

from . import compile_ahead, ensemble, parallel
from .data_files import Dataset
from .errors import UserError


@dataclasses.dataclass(frozen=True)
class DeviceData:
    """The train set as training reads it, moved to the devices once; shapes never change.

    Train images stay uint8 (4x less device memory than float32), a copy on every device,
    stored flat (N, H * W * C) so a batch is one row gather; they are normalised and reshaped
    to (B, H, W, C) inside the compiled step. Each update reads `accumulate` batches of
    `batch_size`. The test set stays on the host: evaluation streams it (evaluate.py).
    """

    train_images: jax.Array | None  # (N, H * W * C) uint8; None when Grain feeds the batches
    train_labels: jax.Array | None  # (N,) int32
    batch_size: int
    image_shape: tuple[int, int, int]
    mesh: Mesh
    train_examples: int
    accumulate: int = 1  # batches of batch_size per update (gradient accumulation)

    @property
    def examples_per_step(self) -> int:
        return self.batch_size * self.accumulate

    @property
    def batches_per_epoch(self) -> int:
        """Whole updates per epoch; the remainder of each permutation is dropped."""
        return self.train_examples // self.examples_per_step


def to_device(
    dataset: Dataset, batch_size: int, mesh: Mesh, with_train: bool = True, accumulate: int = 1
) -> DeviceData:
    """Check the batch against the data and the mesh, and put the train set on the mesh once
    (only `with_train`: a host pipeline such as Grain feeds it batch by batch)."""
    examples = batch_size * accumulate
    if examples > len(dataset.train_images):
        per_step = f"--batch_size={batch_size}" + (
            f" x accumulate={accumulate}" if accumulate > 1 else ""
        )
        raise UserError(
            f"{per_step} is larger than the {len(dataset.train_images):,} training examples; "
            "use a smaller batch"
        )
    parallel.check_batch(batch_size, parallel.data_size(mesh))
    placed = (None, None)
    if with_train:
        flat = dataset.train_images.reshape(len(dataset.train_images), -1)
        train = (flat, dataset.train_labels.astype(np.int32))
        placed = [parallel.shard_host_array(a, parallel.replicated(mesh)) for a in train]
    return DeviceData(
        *placed,
        batch_size=batch_size,
        image_shape=dataset.image_shape,
        mesh=mesh,
        train_examples=len(dataset.train_labels),
        accumulate=accumulate,
    )


def shard_batches(stacked: tuple[np.ndarray, ...], mesh: Mesh) -> tuple[jax.Array, ...]:
    """Stacked host batches (num_batches, B, ...) -> arrays split along B over the mesh."""
    return tuple(
        parallel.shard_host_array(a, parallel.batch_sharding(mesh, axis=1)) for a in stacked
    )


# JAX's threefry2x32 (jax/_src/prng.py): 20 rounds in 5 groups of 4 rotations, a schedule of
# three key words. Drawn in NumPy, an epoch's sort keys take no compile (on a cold run's
# main thread) and equal JAX's to the bit (a test checks).
THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
THREEFRY_PARITY = np.uint32(0x1BD11BDA)


def _threefry2x32(key: Sequence[np.ndarray], counts: Any) -> list[np.ndarray]:
    """JAX's threefry2x32 of each uint64 count (its high and low words) under `key` (two uint32
    arrays of one word), in NumPy's wrapping uint32 arithmetic."""
    counts = np.asarray(counts, np.uint64)
    k = (key[0], key[1], key[0] ^ key[1] ^ THREEFRY_PARITY)
    x = [(counts >> np.uint64(32)).astype(np.uint32) + k[0], counts.astype(np.uint32) + k[1]]
    for i in range(5):
        for r in THREEFRY_ROTATIONS[i % 2]:
            x[0] = x[0] + x[1]
            x[1] = x[0] ^ ((x[1] << np.uint32(r)) | (x[1] >> np.uint32(32 - r)))
        x[0] = x[0] + k[(i + 1) % 3]
        x[1] = x[1] + k[(i + 2) % 3] + np.uint32(i + 1)
    return x


def _sort_keys(seed: int, epoch: int, num_examples: int) -> np.ndarray:
    """The random sort keys of `jax.random.permutation(fold_in(key(seed), epoch), n)` under
    JAX's default PRNG (partitionable threefry): one row of uint32 per round of its sort-based
    shuffle (2 rounds for 60,000 examples)."""
    key = _threefry2x32((np.zeros(1, np.uint32), np.full(1, seed, np.uint32)), [epoch])
    rounds = int(np.ceil(3 * np.log(max(1, num_examples)) / np.log(np.iinfo(np.uint32).max)))
    rows = np.empty((rounds, num_examples), np.uint32)
    for row in rows:
        words = _threefry2x32(key, np.arange(2))  # split: the next key, then this round's
        key, subkey = [w[:1] for w in words], [w[1:] for w in words]
        high, low = _threefry2x32(subkey, np.arange(num_examples))  # random.bits
        row[:] = high ^ low
    return rows


def _draws_keys_in_numpy() -> bool:
    """JAX's default PRNG, which `_sort_keys` draws; with another, JAX draws the order."""
    threefry = jax.config.jax_default_prng_impl == "threefry2x32"
    return threefry and jax.config.jax_threefry_partitionable


@functools.partial(jax.jit, static_argnums=2)
def _permutation(seed: int, epoch: int, num_examples: int) -> jax.Array:
    """`jax.random.permutation(fold_in(key(seed), epoch), n)`, on the default device."""
    return jax.random.permutation(jax.random.fold_in(jax.random.key(seed), epoch), num_examples)


# An accelerator's permutation program per train-set size, compiled on its own thread
# (`compile_permutation`): a TPU compiles its sort slowly, and the set-up need not wait for it.
_COMPILED: dict[int, Any] = {}


def compile_permutation(num_examples: int) -> None:
    """On an accelerator, compile the permutation of `num_examples` on a thread; until it is
    compiled, `epoch_order` draws the orders with NumPy (the same orders)."""
    if jax.default_backend() != "cpu" and _draws_keys_in_numpy() and num_examples not in _COMPILED:
        _COMPILED[num_examples] = compile_ahead.in_background(
            lambda: _permutation.lower(np.uint32(0), 0, num_examples).compile(), "compile-order"
        )


@functools.lru_cache(maxsize=2)  # the set-up asks for epoch 0's twice (the loop, the codelab)
def epoch_order(seed: int, epoch: int, num_examples: int) -> jax.Array:
    """The permutation of the train set for one epoch, from (seed, epoch): exactly
    `jax.random.permutation`'s (a test checks). An accelerator draws it in its queue, in
    microseconds, once `compile_permutation` compiled the program; on the CPU, and until
    then, NumPy draws its keys and sorts them (XLA's CPU sort is several times slower)."""
    compiled = _COMPILED.get(num_examples)
    if compiled is not None and compiled.done():
        return compiled.result()(np.uint32(seed), epoch)
    if (jax.default_backend() != "cpu" and compiled is None) or not _draws_keys_in_numpy():
        return _permutation(np.uint32(seed), epoch, num_examples)
    order = np.arange(num_examples, dtype=np.int32)
    for keys in _sort_keys(seed, epoch, num_examples):
        order = order[np.argsort(keys, kind="stable")]  # lax.sort_key_val is stable too
    return jnp.asarray(order)


def epoch_orders(seeds: Sequence[int], epoch: int, num_examples: int) -> jax.Array:
    """`epoch_order` for one seed, or stacked, one row per seed (an ensemble's members, each on
    its own data)."""
    orders = [epoch_order(seed, epoch, num_examples) for seed in seeds]
    return jnp.stack(orders) if len(orders) > 1 else orders[0]


class DeviceBatches:
    """The device pipeline's training calls: each epoch's permutation (`epoch_order`) placed on
    the mesh, the batches gathered inside the compiled chunk (`count` steps per call when
    fused). The next epoch's permutation is drawn on a thread while this one trains: on the
    CPU the host sorts it, which would otherwise leave the cores idle at each epoch's end."""

    def __init__(self, data: DeviceData, config: ml_collections.ConfigDict):
        self.data = data
        compile_permutation(data.train_examples)
        self.seeds = ensemble.data_seeds(config)
        self.fused = config.fused_steps
        self.next = 0  # the step the newest call ends at
        self._epoch, self._order_now = None, None
        self._drawer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="epoch-order")
        self._ahead: tuple[int, concurrent.futures.Future[jax.Array]] | None = None

    def _order(self, epoch: int, placed: bool = True) -> jax.Array:
        """The epoch's order, laid out on the mesh when `placed`."""
        order = epoch_orders(self.seeds, epoch, self.data.train_examples)
        return parallel.place(order, self.data.mesh) if placed else order

    def chunks(self, step: int, stop: int) -> Iterator[tuple[Any, ...]]:
        """(images, labels, order, first batch index, count, first step) per call for steps
        step+1..stop, which never cross an epoch's end; the numbers as device ints, which a
        call takes without a copy from the host. When an ensemble's members see their own
        data, the order has one row per member."""
        epoch, index = divmod(step, self.data.batches_per_epoch)
        if epoch != self._epoch:
            ahead, self._ahead = self._ahead, None
            # One process places the next order on the thread too (off the loop's path after
            # an evaluation); several place it here, where every process runs the same
            # programs in the same order.
            one = jax.process_count() == 1
            if ahead is not None and ahead[0] == epoch:
                order = ahead[1].result()
                order = order if one else parallel.place(order, self.data.mesh)
            else:
                order = self._order(epoch)
            self._epoch, self._order_now = epoch, order
            self._ahead = epoch + 1, self._drawer.submit(self._order, epoch + 1, one)
        per_call = stop - step if self.fused else 1
        d = self.data
        count = parallel.device_int(per_call, d.mesh)
        for first in range(step, stop, per_call):
            start = parallel.device_int(index + first - step, d.mesh)
            self.next = first + per_call
            at = parallel.device_int(first, d.mesh)
            yield d.train_images, d.train_labels, self._order_now, start, count, at

    def first_call(self, step: int) -> tuple[Any, ...]:
        """The arguments of the first call after `step`, known before the loop starts: what
        `compile_ahead` compiles (any stop: the count is traced)."""
        return next(iter(self.chunks(step, step + 1)))

    def state(self) -> dict[str, Any]:
        """Nothing to save: the order is a function of (seed, step)."""
        return {}
