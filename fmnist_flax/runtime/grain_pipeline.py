"""`config.input_pipeline = "grain"`: training batches read on the host by a Grain pipeline.

A random-access source over the train set, a seeded shuffle that changes every epoch, whole
global batches, and each process reading only its share of every global batch (rows
[p * B/P, (p+1) * B/P)), assembled into one global array with
`jax.make_array_from_process_local_data`. The source is the in-memory `ArraySource` or, for
data that does not fit, `records.RecordSource` (record files read a batch at a time). Several
steps' batches travel as one block and train in one compiled call. The iterator's position
travels in the Orbax checkpoint, so a killed run resumes mid-epoch exactly. Augmentation stays
on the device, in the compiled step, as in the device pipeline.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh

from . import parallel

if TYPE_CHECKING:  # imported only by the runs that read with Grain: a slow import
    import grain

UNBOUNDED_STEPS = 2**62  # the batches never run out: epochs repeat
MAX_WORKERS = 8  # read threads by default: one per core up to this


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
    source: Any,
    batch_size: int,
    seed: int,
    accumulate: int = 1,
    steps_per_block: int = 1,
    first_block: int = 0,
) -> grain.MapDataset:
    """This process's share of every global batch, in training order, `steps_per_block` steps
    a block: element j holds steps j*K+1..(j+1)*K (K = steps_per_block), (K, share, ...) or
    (K, accumulate, share, ...); the dataset starts at block `first_block`. Each epoch is a
    fresh permutation from (seed, epoch), cut into whole batches (the remainder is dropped);
    a block's records are read in one bulk read, never one by one."""
    import grain

    share = batch_size // jax.process_count()
    first = jax.process_index() * share
    examples = batch_size * accumulate
    per_epoch = len(source) // examples
    if per_epoch < 1:
        raise ValueError(f"{len(source)} records cannot fill one batch of {examples}")

    @functools.lru_cache(maxsize=2)  # the epoch being read, and the next one
    def permutation(epoch: int) -> np.ndarray:
        return np.random.default_rng([seed, epoch]).permutation(len(source))

    def picks(step: int) -> np.ndarray:
        epoch, index = divmod(step, per_epoch)
        return permutation(epoch)[index * examples : (index + 1) * examples]

    def read_block(block: int) -> tuple[np.ndarray, np.ndarray]:
        steps = range(block * steps_per_block, (block + 1) * steps_per_block)
        mine = np.stack([picks(step) for step in steps])
        mine = mine.reshape(steps_per_block, accumulate, batch_size)[..., first : first + share]
        return source[mine[:, 0] if accumulate == 1 else mine]

    return grain.MapDataset.range(first_block, UNBOUNDED_STEPS).map(read_block)


class GrainBatches:
    """The Grain pipeline's training calls: blocks of `steps_per_block` steps' batches, each
    read in one bulk read (by Grain, on its `workers` read threads, `prefetch` blocks ahead but
    at least one per thread) and placed on the devices one block before the step that needs
    it; the fused chunk runs up to a block's steps per call (one with `fused=False`)."""

    def __init__(
        self,
        source: Any,
        batch_size: int,
        seed: int,
        mesh: Mesh,
        state: dict | None = None,
        step: int = 0,
        accumulate: int = 1,
        *,
        workers: int = 0,
        steps_per_block: int = 1,
        prefetch: int = 2,
        fused: bool = True,
    ):
        """`state`: the iterator's saved position ({"next_index": steps done}); without one,
        the batch after `step` (a checkpoint the device pipeline wrote)."""
        import grain

        self.per_block = steps_per_block
        self.fused = fused
        self.next = (state or {"next_index": step})["next_index"]
        block = self.next // steps_per_block  # read from the block that holds the next step
        blocks = process_batches(source, batch_size, seed, accumulate, steps_per_block, block)
        # Grain reads no more blocks at once than its buffer holds: one per thread at least.
        threads = read_threads(workers)
        options = grain.ReadOptions(
            num_threads=threads, prefetch_buffer_size=max(prefetch, threads)
        )
        self.iterator = iter(blocks.to_iter_dataset(options))
        self.sharding = parallel.batch_sharding(mesh, axis=1 + int(accumulate > 1))
        self._blocks: list[tuple[int, jax.Array, jax.Array]] = []  # (first step, x, y)
        self._read_from = block * steps_per_block

    def _place_next(self) -> None:
        images, labels = next(self.iterator)
        x = jax.make_array_from_process_local_data(self.sharding, images)
        y = jax.make_array_from_process_local_data(self.sharding, labels)
        self._blocks.append((self._read_from, x, y))
        self._read_from += self.per_block

    def chunks(self, step: int, stop: int) -> Iterator[tuple[Any, ...]]:
        """(images, labels, None, offset in the block, count, first step) per call for steps
        step+1..stop, each within one block."""
        while step < stop:
            while len(self._blocks) < 2:  # this block and the next, already on the devices
                self._place_next()
            first, x, y = self._blocks[0]
            if step >= first + self.per_block:
                self._blocks.pop(0)
                continue
            count = min(stop - step, first + self.per_block - step) if self.fused else 1
            self.next = step + count
            mesh = self.sharding.mesh
            yield x, y, None, *(parallel.device_int(n, mesh) for n in (step - first, count, step))
            step += count

    def first_call(self, step: int) -> None:
        """None: the first call's arguments come from the first read, inside the loop."""
        return None

    def state(self) -> dict[str, Any]:
        """The iterator's position (steps done), saved in the checkpoint's progress item."""
        return {"data_iterator": {"next_index": self.next}}


def block_steps(config: Any) -> int:
    """Whole steps in `config.grain.block_examples` examples (at least one)."""
    per_step = config.batch_size * config.optimizer.accumulate
    return max(1, config.grain.block_examples // per_step)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def read_threads(workers: int) -> int:
    """`config.grain.workers`, 0 meaning one per core this process may use, at most
    MAX_WORKERS."""
    return workers or min(usable_cores(), MAX_WORKERS)


def train_source(dataset: Any) -> Any:
    """The Grain source of a dataset's train split: its record files when it has them
    (`records.RecordImages`), else its arrays."""
    source = getattr(dataset.train_images, "source", None)
    return source if source is not None else ArraySource(dataset.train_images, dataset.train_labels)


def from_config(
    config: Any, source: Any, mesh: Mesh, state: dict | None = None, step: int = 0
) -> GrainBatches:
    """The run's `GrainBatches`, as `config` (batch size, seed, accumulate, config.grain) says."""
    return GrainBatches(
        source,
        config.batch_size,
        config.seed,
        mesh,
        state,
        step,
        config.optimizer.accumulate,
        workers=config.grain.workers,
        steps_per_block=block_steps(config),
        prefetch=config.grain.prefetch,
        fused=config.fused_steps,
    )


def default_config() -> ml_collections.ConfigDict:
    """How the Grain pipeline reads (input_pipeline=grain); none of it changes the batches."""
    grain = ml_collections.ConfigDict()
    grain.workers = 0  # host threads reading batches (0: one per core, at most 8)
    # Examples read in one bulk read, as a block of whole steps that trains in compiled calls
    # of up to that many steps: larger blocks spread the reader's fixed cost per call.
    grain.block_examples = 16_384
    grain.prefetch = 2  # such blocks read ahead of the step that needs them (>= 1 per worker)
    return grain
