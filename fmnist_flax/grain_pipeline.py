"""`config.input_pipeline = "grain"`: training batches read on the host by a Grain pipeline.

A random-access source over the train set, a seeded shuffle that changes every epoch, whole
global batches, and each process reading only its share of every global batch (rows
[p * B/P, (p+1) * B/P)), assembled into one global array with
`jax.make_array_from_process_local_data`. The train set need not fit on a device: replace
`ArraySource` with a source that reads records from files and nothing else changes. The
iterator's state travels in the Orbax checkpoint, so a killed run resumes mid-epoch exactly.
Augmentation stays on the device, in the compiled step, as in the device pipeline.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grain
import jax
import numpy as np
from jax.sharding import Mesh

from fmnist_flax import parallel

READ_THREADS = 2  # host threads reading batches ahead of the step
PREFETCH = 8  # batches read ahead


class ArraySource:
    """Random access to (image, label) records; indexing with an array reads a batch at once."""

    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images = images.reshape(len(images), -1)  # (N, H * W) uint8, as the step reads
        self.labels = labels.astype(np.int32)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: Any) -> tuple[np.ndarray, np.ndarray]:
        return self.images[index], self.labels[index]


def process_batches(
    source: ArraySource, batch_size: int, seed: int, accumulate: int = 1
) -> grain.MapDataset:
    """This process's share of every global batch, in training order: element k is the share
    of step k + 1's `accumulate` batches, (accumulate, share, ...) when accumulating. Shuffled
    per epoch from `seed`; an epoch's remainder is dropped."""
    share = batch_size // jax.process_count()
    first = jax.process_index() * share

    def read(picks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mine = picks.reshape(accumulate, batch_size)[:, first : first + share]
        return source[mine[0] if accumulate == 1 else mine]

    return (
        grain.MapDataset.range(len(source))
        .shuffle(seed=seed)
        .batch(batch_size * accumulate, drop_remainder=True)
        .repeat(None)
        .map(read)
    )


class GrainBatches:
    """The Grain pipeline's training calls: one step per call, its batch read on the host."""

    def __init__(
        self,
        source: ArraySource,
        batch_size: int,
        seed: int,
        mesh: Mesh,
        state: dict | None = None,
        step: int = 0,
        accumulate: int = 1,
    ):
        """`state`: the iterator's saved position; without one, the batch after `step` (a
        checkpoint the device pipeline wrote)."""
        options = grain.ReadOptions(num_threads=READ_THREADS, prefetch_buffer_size=PREFETCH)
        batches = process_batches(source, batch_size, seed, accumulate)
        self.iterator = iter(batches.to_iter_dataset(options))
        self.iterator.set_state(state or {"next_index": step})
        self.sharding = parallel.batch_sharding(mesh, axis=int(accumulate > 1))

    def chunks(self, step: int, stop: int) -> Iterator[tuple[Any, ...]]:
        """(images, labels, None, 0, 1, step) per step: the batch itself, no order to pick by."""
        for first in range(step, stop):
            images, labels = next(self.iterator)
            x = jax.make_array_from_process_local_data(self.sharding, images)
            y = jax.make_array_from_process_local_data(self.sharding, labels)
            yield x, y, None, 0, 1, first

    def state(self) -> dict[str, Any]:
        """The iterator's position, saved in the checkpoint's progress item."""
        return {"data_iterator": self.iterator.get_state()}
