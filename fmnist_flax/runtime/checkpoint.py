"""Orbax checkpoints, writing side: the step format, asynchronous saves and their policies
(time floor, newest N, the best evaluation), and the faults a save can meet.

Each step directory under `<workdir>/checkpoints` holds seven items: `model` and
`optimizer` (array trees, tensorstore/OCDBT), `progress` (step, data position, the running
row), `config` (the config that built the model), `dataset` (its name, class names and image
shape), `changes` (accepted config changes) and `checksums` (a CRC-32 of each array saved),
the last five as JSON. Nothing is pickled. Reading them back (resume, damaged steps) is
`restore.py`; loading a model for inference is `inference.load_model`.

Rotation moves a step it removes into `ROTATED_DIR` first, in one rename: a step directory
is never left half deleted among the steps, and what that directory holds is the only thing
ever removed (a step that cannot be read is set aside, `restore.set_aside`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import math
import os
import pathlib
import shutil
import tempfile
import threading
import time
import types
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from . import errors, library_workarounds
from . import workdir as workdir_lib
from .errors import UserError
from .tables import path_name

CHECKPOINT_DIR = "checkpoints"
DAMAGED_DIR = workdir_lib.DAMAGED_DIR  # damaged steps are moved here, never deleted
ROTATED_DIR = "rotated_away"  # in checkpoints/: rotation moves a step here, then removes it
STEP_MARKER = "_CHECKPOINT_METADATA"  # what Orbax writes in every step it finalises
STEP_FILES = (STEP_MARKER, "commit_success.txt")  # a step's own files besides its items
TREE_METADATA = "_METADATA"  # what Orbax writes in an array item: its tree, shapes and dtypes
# The small files of a step that Orbax reads whole: its marker, a JSON item's value, an array
# item's tree, sharding and array descriptions (`array_metadatas/process_N`), the commit notes.
SMALL_FILES = (*STEP_FILES, "metadata", TREE_METADATA, "_sharding")
ARRAY_DESCRIPTIONS = "array_metadatas"
MANIFEST = "manifest.ocdbt"  # an OCDBT manifest: its version and the tree's root, read whole
MANIFEST_LIMIT = 1 << 20  # bytes a manifest may hold (this project's hold a few hundred)
DATA_DIR = "d"  # an array item's data files (OCDBT's nodes and the arrays' chunks)
MAX_ITEMSIZE = 16  # bytes an element of any dtype takes (complex128): bounds the data files
LEAF_OVERHEAD = 4096  # bytes of tree nodes and chunk headers a data file may add per array
DATA_OVERHEAD = 1 << 20  # and per item
SPACE_MARGIN = 1.5  # bytes a save needs per byte of state, metadata included, with room to spare
INODES_PER_SAVE = 100  # files and directories a save creates, with room for larger models
BEST_METRIC = "test_accuracy"  # what keep_best and --step=best rank by unless config.best_metric
BEST = "best"  # --step=best
SAVE_NICENESS = 19  # the save threads' CPU priority (nice), the lowest
READ_ATTEMPTS = 20  # a reader of a live run starts over this often when a step is rotated away
ROTATION_WAIT = 1.0  # seconds a reader watches a step that failed to read before it is damage
ROTATION_PAUSE = 0.05  # seconds between two looks at it


ARRAY_ITEMS = ("model", "optimizer")  # array trees
CHECKSUMS = "checksums"  # {item: {array: {"dtype": ..., "crc32": ...}}}, of the saved bytes
JSON_ITEMS = ("progress", "config", "dataset", "changes", CHECKSUMS)
READER_ITEMS = ("config", "dataset")  # the JSON items a reader rebuilds the model from
# The fields a JSON item must hold; one without them is damaged.
ITEM_FIELDS = {
    "progress": ("step", "epoch", "index", "num_batches", "batch_size", "seed"),
    "config": ("model", "compute_dtype", "batch_size", "seed"),
    "dataset": ("name", "class_names", "image_shape"),
    "changes": ("changes",),
    CHECKSUMS: (),
}


# What each field of a JSON item must hold, where present (a field edited by hand, or
# damaged, is named rather than failing later): a test, and what it wants.
FIELD_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    **dict.fromkeys(
        ("step", "epoch", "index", "seed", "stopped_at"), (errors.is_whole, "a whole number >= 0")
    ),
    **dict.fromkeys(
        ("num_batches", "batch_size"), (lambda v: errors.is_whole(v, 1), "a whole number >= 1")
    ),
    **dict.fromkeys(
        ("model", "optimizer", "ensemble", "augment", "grain", "dataset", "row"),
        (lambda v: isinstance(v, dict), "a JSON object"),
    ),
    **dict.fromkeys(("compute_dtype", "name", "title"), (lambda v: isinstance(v, str), "a string")),
    "class_names": (
        lambda v: isinstance(v, list) and bool(v) and all(isinstance(n, str) for n in v),
        "a list of class names",
    ),
    "image_shape": (
        lambda v: (
            isinstance(v, list) and len(v) in (2, 3) and all(errors.is_whole(n, 1) for n in v)
        ),
        "[height, width] or [height, width, channels], each >= 1",
    ),
    "changes": (lambda v: isinstance(v, list), "a list"),
}


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def key_data(tree: Any) -> Any:
    """Typed PRNG keys (dropout's stream) as their raw uint32 data, which Orbax stores."""
    return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def wrap_keys(restored: Any, like: Any) -> Any:
    """The inverse of `key_data`, taking each key's implementation from `like`."""
    return jax.tree.map(
        lambda r, t: jax.random.wrap_key_data(r, impl=jax.random.key_impl(t)) if _is_key(t) else r,
        restored,
        like,
    )


def named_leaves(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> dict[str, Any]:
    """{'layers.0.kernel': leaf, ...}: the leaves of a state (or of a checkpoint's metadata
    tree) by the names a line gives them, nnx.Variable's own `value` field left out."""
    named = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf):
        keys = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path]
        if keys and keys[-1] == "value":
            keys = keys[:-1]
        named[path_name(tuple(keys))] = leaf
    return named


def _crc32(leaf: Any) -> str:
    """The CRC-32 of an array's bytes, on the host (zlib releases the GIL while it runs)."""
    return f"{zlib.crc32(np.asarray(leaf).reshape(-1).view(np.uint8)):08x}"


def checksums(tree: Any) -> dict[str, dict[str, str]] | None:
    """Each array of an array item's tree by name: its dtype and the CRC-32 of its bytes. None
    where this process does not hold every array whole (a run of several processes): such a
    step records none, and is read without the check."""
    leaves = named_leaves(tree)
    if not all(getattr(leaf, "is_fully_addressable", True) for leaf in leaves.values()):
        return None
    return {name: {"dtype": str(x.dtype), "crc32": _crc32(x)} for name, x in leaves.items()}


def checksum_problem(item: str, restored: Any, recorded: Any) -> str | None:
    """Which array of a restored item differs from the bytes saved (`recorded`, its entry of
    the checksums item; None: a step saved without them), or None. An array restored in
    another dtype than it was saved in was converted, and cannot be compared."""
    if recorded is None:
        return None
    leaves = named_leaves(restored)
    if not all(getattr(leaf, "is_fully_addressable", True) for leaf in leaves.values()):
        return None  # each process holds a part: none can check a whole array
    for name, leaf in leaves.items():
        entry = recorded.get(name)
        if not isinstance(entry, dict) or not isinstance(entry.get("crc32"), str):
            return f"its {CHECKSUMS} item holds no checksum of {item} array {name}"
        if entry.get("dtype") == str(leaf.dtype) and entry["crc32"] != _crc32(leaf):
            return (
                f"its {item} array {name} does not match the checksum saved with it: its bytes "
                "changed since the save"
            )
    return None


def checkpoint_dir(workdir: str | os.PathLike) -> pathlib.Path:
    return pathlib.Path(workdir).expanduser().absolute() / CHECKPOINT_DIR


# --- Policies: when a periodic save is due, which steps are kept --------------------------------
@dataclasses.dataclass
class _KeepBest:
    """An Orbax preservation policy that keeps the step of the best score (`best_metric`).
    Orbax keeps a save's metrics in memory only, so a resumed run would rotate the best step
    away: the scores come from the steps' own progress items instead."""

    scores: dict[int, float]

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        known = {c.step: self.scores[c.step] for c in checkpoints if c.step in self.scores}
        best = max(known, key=lambda step: (known[step], step)) if known else None
        return [c.step == best for c in checkpoints]

    def best(self) -> int | None:
        """The best-scored step, kept or not yet saved."""
        return max(self.scores, key=lambda step: (self.scores[step], step)) if self.scores else None


@dataclasses.dataclass(kw_only=True)
class _TimeFloor(ocp.checkpoint_managers.ContinuousCheckpointingPolicy):
    """Orbax's continuous policy (no save while one is written, none sooner than
    `minimum_interval_secs` after the last), the floor counted from when the last save began
    (`began`, set by `Checkpoints`), or from the run's start: a short run does not save early
    only because nothing is saved yet. Orbax dates a step when its synchronous part ends;
    counted from there, saves began that part's time later than the floor (seconds when the
    cores are busy). Decided on process 0, broadcast."""

    started: datetime.datetime = dataclasses.field(
        default_factory=lambda: datetime.datetime.now(datetime.UTC)
    )
    began: tuple[int, datetime.datetime] | None = None  # (step, when) of the last save begun

    def should_save(self, step: Any, previous_steps: Sequence[Any], *, context: Any) -> bool:
        last = types.SimpleNamespace(step=0, metrics=None, time=self.started)
        if len(previous_steps):
            last = previous_steps[-1]
            if self.began is not None and self.began[0] == last.step:
                last = types.SimpleNamespace(step=last.step, metrics=None, time=self.began[1])
        return super().should_save(step, [last], context=context)


def _options(
    *, max_to_keep: int, best: _KeepBest | None, read_only: bool, floor: _TimeFloor
) -> ocp.CheckpointManagerOptions:
    """Orbax's options: keep the newest `max_to_keep` (and `best`'s step), save on the time
    floor, write asynchronously, move a step rotated away into ROTATED_DIR (`clear_rotated`
    removes it); a reader deletes nothing."""
    policies = ocp.checkpoint_managers
    keep = [policies.LatestN(max_to_keep), *([best] if best is not None else [])]
    return ocp.CheckpointManagerOptions(
        preservation_policy=None if read_only else policies.AnyPreservationPolicy(keep),
        save_decision_policy=floor,
        create=False,
        read_only=read_only,
        # Half-written saves of a killed process go away; only the lock holder may do it.
        cleanup_tmp_directories=not read_only,
        enable_background_delete=True,  # rotating old steps away does not stall training
        todelete_subdir=None if read_only else ROTATED_DIR,
        enable_async_checkpointing=True,
    )


def best_metric(config: dict[str, Any] | None) -> str:
    """What keep_best and --step=best rank a run's steps by: its config's `best_metric` (a
    metric of each evaluation's row, `val_accuracy`), else BEST_METRIC."""
    return (config or {}).get("best_metric") or BEST_METRIC


def lower_is_better(metric: str) -> bool:
    """A loss (`test_loss`, `test_ema_loss`, a hook's `val_loss`: a name ending in `loss`) ranks
    lowest first; every other metric highest first."""
    return metric.endswith("loss")


def _score(metric: str, value: Any) -> float | None:
    """A step's rank by `metric` of value `value`, higher better (None: it ranks nowhere: no
    finite number)."""
    if not isinstance(value, float) or not math.isfinite(value):
        return None
    return -value if lower_is_better(metric) else value


def _scores(
    directory: pathlib.Path,
    steps: Sequence[int],
    metric: str | None = None,
    damage: list[UserError] | None = None,
) -> dict[int, float]:
    """Each step saved at an evaluation, its rank (`_score`) by `metric` (default: the one its
    config names) from its progress item; why a step could not be read goes to `damage`."""
    scores = {}
    for step in steps:
        try:
            progress = saved_item(directory, step, "progress") or {}
            name = metric or best_metric(saved_item(directory, step, "config"))
        except errors.FileRefused:
            raise
        except UserError as exc:  # damaged: restore() sets it aside; it ranks nowhere
            if damage is not None:
                damage.append(exc)
            continue
        if (score := _score(name, progress.get(name))) is not None:
            scores[step] = score
    return scores


# --- What a save writes, and the faults it can meet ---------------------------------------------
class StepVanished(Exception):
    """A step was removed while being read: a live training run rotated it away."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step


def _arrays(model: nnx.Module, optimizer: nnx.Optimizer) -> dict[str, Any]:
    """The array items of a save: model and optimizer state, typed keys as their raw data."""
    return {"model": key_data(nnx.state(model)), "optimizer": key_data(nnx.state(optimizer))}


@jax.jit
def _snapshot(tree: Any) -> Any:
    """A device copy of the state to save: the next training call donates the original."""
    return jax.tree.map(jnp.copy, tree)


def warm_up(model: nnx.Module, optimizer: nnx.Optimizer) -> None:
    """Compile what a save runs on the training thread, before training's clock starts
    (compiled only: nothing runs, so any thread may call it)."""
    _snapshot.lower(_arrays(model, optimizer)).compile()


def _check_space(directory: pathlib.Path, step: int, arrays: dict[str, Any]) -> None:
    """Refuse a save the disk cannot hold: it would fail in Orbax's threads, with hundreds
    of lines of tracebacks, long after the save was started."""
    need = (
        SPACE_MARGIN
        * sum(x.nbytes for x in jax.tree.leaves(arrays) if hasattr(x, "nbytes"))
        // max(jax.process_count(), 1)
    )
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize
    inodes = stats.f_favail if stats.f_files else INODES_PER_SAVE  # 0 files: no limit
    if free < need or inodes < INODES_PER_SAVE:
        raise UserError(
            f"checkpoint {step} needs about {need / 2**20:,.1f} MB and {INODES_PER_SAVE} "
            f"inodes in {directory}, which has {workdir_lib.disk_problem(directory)}"
            f"; {_resume_hint(directory)}"
        )


def _resume_hint(directory: pathlib.Path, exc: BaseException | None = None) -> str:
    """What to do about a save that failed (for want of space, or `exc`), and where to resume."""
    kept = complete_steps(directory)  # on disk: Orbax's own list may be mid-update
    last = f"checkpoint {kept[-1]}" if kept else "the start (no checkpoint was completed)"
    # The workdir by name: a run given none made a fresh one, which the same command would not.
    return (
        f"{workdir_lib.remedy(exc)} and run again with --workdir={directory.parent} to resume "
        f"from {last}"
    )


def _save_failed(directory: pathlib.Path, step: int, exc: BaseException) -> UserError:
    """The one line for a save that failed in Orbax or tensorstore: what, where, why."""
    library_workarounds.record_failed_save()
    storage = workdir_lib.storage_error(exc)
    if storage is not None:
        reason = workdir_lib.disk_problem(directory, storage)
    else:
        reason = errors.reason(exc)
    return UserError(
        f"could not write checkpoint {step} in {directory} ({reason}); "
        + _resume_hint(directory, storage)
    )


class _SaveThread:
    """Starts a save in a thread of its own, at the lowest CPU priority: Orbax's synchronous
    part (directories, metadata, its writer threads started) then stays off training's."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: UserError | None = None

    def start(self, save: Callable[[], None]) -> None:
        self._thread = threading.Thread(target=self._run, args=(save,), daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def join(self) -> UserError | None:
        """Wait for the save being started; the failure it met, returned once."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread, error, self._error = None, self._error, None
        return error

    def _run(self, save: Callable[[], None]) -> None:
        # Lowest CPU priority for this thread and the writer threads it starts: on a few cores
        # they would take XLA's time; the save has until the next one to finish.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SAVE_NICENESS)
        try:
            save()
        except UserError as error:
            self._error = error


class Checkpoints:
    """An Orbax CheckpointManager for one workdir: what each save writes, and when."""

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        max_to_keep: int = 3,
        keep_best: bool = False,
        read_only: bool = False,
        metadata: dict[str, dict[str, Any]] | None = None,
        min_interval_secs: float = 0.0,
    ):
        """`metadata`: the JSON items every save writes besides progress (config, dataset).

        `min_interval_secs`: `due` skips a save while the last one is being written or began
        less than this many seconds ago (`_TimeFloor`); forced saves always happen.

        A `read_only` reader (eval, predict, load_model) changes nothing in the directory: a
        training run may be writing there. A writer must hold the workdir's lock. `keep_best`
        keeps, besides the newest `max_to_keep`, the best evaluated step (`best_metric`).
        """
        self.directory = checkpoint_dir(workdir)
        self.metadata = metadata or {}
        self.best_metric = best_metric(self.metadata.get("config"))
        self.keep_best = keep_best
        self.read_only = read_only
        self.min_interval_secs = min_interval_secs
        self._saving = 0  # the step of the save in flight, named if it fails
        self._starting = _SaveThread()  # in one process, the save being started
        self._made = not read_only and not self.directory.exists()  # removed if left empty
        if not read_only:
            prepare_directory(self.directory)
        self._best = _KeepBest({})
        self._floor = _TimeFloor(minimum_interval_secs=min_interval_secs)
        options = _options(
            max_to_keep=max_to_keep,
            best=self._best if keep_best else None,
            read_only=read_only,
            floor=self._floor,
        )
        check_markers(self.directory)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                **{name: ocp.StandardCheckpointHandler() for name in ARRAY_ITEMS},
                **{name: ocp.JsonCheckpointHandler() for name in JSON_ITEMS},
            },
        )
        if keep_best:
            self._best.scores.update(_scores(self.directory, self.steps(), self.best_metric))

    @property
    def manager(self) -> ocp.CheckpointManager:
        """The Orbax manager underneath (restore.py reads steps through it)."""
        return self._manager

    def reload(self) -> None:
        """Re-list the steps; a live trainer may remove one while it is being listed."""
        for attempt in range(READ_ATTEMPTS):
            try:
                check_markers(self.directory)
                return self._manager.reload()
            except FileNotFoundError:
                if attempt == READ_ATTEMPTS - 1:
                    raise

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def due(self, step: int) -> bool:
        """Whether a periodic save at `step` should happen: always with no time floor; else
        none still being written and the last one old enough (decided by process 0)."""
        if not self.min_interval_secs:
            return True  # every period, each save waiting for the one before
        if self._starting.busy():  # one process: still starting
            return False
        return self._manager.should_save(step)

    def save(
        self,
        step: int,
        model: nnx.Module,
        optimizer: nnx.Optimizer,
        progress: dict[str, Any],
    ) -> None:
        """Start an asynchronous save; training goes on while it is written.

        The space it needs is checked first. In one process even Orbax's own synchronous
        part runs in a thread of ours, on a device copy of the state that the next training
        call cannot donate away.
        """
        self.wait()  # the previous save is complete (or its failure reported) first
        if not self.directory.is_dir():
            self._make_again(step)
        clear_rotated(self.directory)  # before the space check: what it holds is freed
        arrays = _arrays(model, optimizer)
        _check_space(self.directory, step, arrays)
        self._saving = step
        if (score := _score(self.best_metric, progress.get(self.best_metric))) is not None:
            self._best.scores[step] = score
        json_items = {**self.metadata, "progress": progress}
        if jax.process_count() > 1:  # Orbax's barriers stay on the thread every process shares
            self._start_save(step, arrays, json_items)
            return
        self._starting.start(
            functools.partial(self._start_save, step, _snapshot(arrays), json_items)
        )

    def _make_again(self, step: int) -> None:
        """The checkpoint directory (or the whole workdir) was removed under this run: made
        again and Orbax's list of steps read again (it would list the steps gone), so step
        `step` is saved there and the run keeps its progress."""
        workdir = self.directory.parent
        gone = self.directory if workdir.is_dir() else workdir
        errors.warning_line(
            f"{gone} was removed while this run trained, with what it held; saving step {step} "
            f"in {self.directory} again"
        )
        prepare_directory(self.directory)
        self._manager.reload()

    def _start_save(self, step: int, arrays: dict[str, Any], json_items: dict[str, Any]) -> None:
        self._floor.began = (step, datetime.datetime.now(datetime.UTC))
        sums = {name: checksums(tree) for name, tree in arrays.items()}
        if None not in sums.values():
            json_items = {**json_items, CHECKSUMS: sums}
        try:
            self._manager.save(
                step,
                args=ocp.args.Composite(
                    **{name: ocp.args.StandardSave(tree) for name, tree in arrays.items()},
                    **{name: ocp.args.JsonSave(value) for name, value in json_items.items()},
                ),
                force=True,
            )
        except Exception as exc:  # Orbax and tensorstore raise many types for a failed write
            raise _save_failed(self.directory, step, exc) from None

    def wait(self) -> None:
        """Block until the last save is on disk; a failed one is reported in one line."""
        error = self._starting.join()
        if error is not None:
            raise error
        try:
            self._manager.wait_until_finished()
        except Exception as exc:  # the asynchronous write failed in Orbax's threads
            raise _save_failed(self.directory, self._saving, exc) from None

    def close(self) -> None:
        """Wait for the save in flight and the steps being rotated away, remove what rotation
        moved aside, and a checkpoint directory this run made and saved nothing in."""
        self._starting.join()  # a save still starting (its failure already reported)
        library_workarounds.await_tmp_cleanup(self._manager)
        try:
            self._manager.close()  # waits for the save in flight, raising its failure again
        except Exception as exc:  # Orbax and tensorstore raise many types for a failed write
            if not library_workarounds.abandoned_writes():  # not reported yet: say it, in one line
                raise _save_failed(self.directory, self._saving, exc) from None
        if not self.read_only:
            clear_rotated(self.directory, whole=True)
        if self._made and jax.process_index() == 0:
            with contextlib.suppress(OSError):  # it holds a step (or something else): kept
                self.directory.rmdir()

    @property
    def needed_items(self) -> tuple[str, ...]:
        """The JSON items a step must hold intact to be used: all of them to resume a run,
        those that rebuild the model to read one (eval, predict, export, load_model)."""
        return READER_ITEMS if self.read_only else JSON_ITEMS

    def saved(self, item: str, step: int | None = None) -> tuple[int, dict[str, Any] | None]:
        """(step, JSON `item`) of `step`, or of the newest step whose `needed_items` are intact.
        A reader says which newer ones it passed over; a writer leaves that to restore(),
        which sets them aside. When none is intact: the newest one's damage for a reader, for
        a writer the line that names every step (`every_step_damaged`)."""
        if step is not None:
            return step, self._item(step, item)
        damaged: dict[int, ItemDamaged] = {}
        for candidate in self.steps()[::-1]:
            try:
                read = dict.fromkeys((*self.needed_items, item))  # each once, `item` too
                value = {name: self._item(candidate, name) for name in read}[item]
            except ItemDamaged as exc:
                if self.rotated_after_watching(candidate):
                    raise StepVanished(candidate) from None
                damaged[candidate] = exc
                continue
            if self.read_only:  # an older step than asked for: say so
                for bad, exc in damaged.items():
                    warn_damaged(self.directory, bad, exc.problem, candidate)
            return candidate, value
        if damaged and self.read_only:
            raise next(iter(damaged.values()))
        if damaged:
            raise every_step_damaged(self, {bad: exc.problem for bad, exc in damaged.items()})
        return 0, None

    def _item(self, step: int, item: str) -> dict[str, Any] | None:
        """`saved_item`, where an item missing from a step that a live run is rotating away
        (Orbax deletes it file by file) is that step vanishing, not a step without the item."""
        value = saved_item(self.directory, step, item)
        if value is None and self.rotated(step):
            raise StepVanished(step)
        return value

    def rotated(self, step: int, wait: float = 0.0) -> bool:
        """For a reader, whether `step` looks rotated away by a live training run rather than
        damaged: it is no longer complete, or the run has completed a step newer than any
        this reader listed. A step directory no run of this project left is refused. With
        `wait`, a step that looks intact is looked at again until then: a rotation can be
        caught half way, a step's files going while its marker and the next step's are not
        yet gone and made."""
        if not self.read_only:
            return False
        deadline = time.monotonic() + wait
        while True:
            try:
                if self._looks_rotated(step):
                    return True
            except UserError:  # looks like no checkpoint of ours: refused if it stays so
                if time.monotonic() >= deadline:
                    raise
            if time.monotonic() >= deadline:
                return False
            time.sleep(ROTATION_PAUSE)

    def rotated_after_watching(self, step: int) -> bool:
        """`rotated`, a step that failed to read watched for ROTATION_WAIT seconds."""
        return self.rotated(step, ROTATION_WAIT)

    def _looks_rotated(self, step: int) -> bool:
        path = self.directory / str(step)
        try:
            foreign = path.is_dir() and not (path / STEP_MARKER).exists() and not unmarked(path)
        except FileNotFoundError:  # the run's rotation removed the rest while it was looked at
            foreign = False
        if foreign:
            raise not_a_checkpoint(path)  # what no save or rotation of this project leaves
        done, listed = complete_steps(self.directory), self.steps()
        return step not in done or (bool(listed) and done[-1] > listed[-1])

    def unranked(self, step: int, evaluated: Any) -> UserError | None:
        """With keep_best, the line for an evaluation at `step` whose metrics (and the values
        the after-evaluation hooks added), `evaluated`, lack `best_metric`; else None."""
        if not self.keep_best or not isinstance(evaluated, dict) or self.best_metric in evaluated:
            return None
        return UserError(
            f"--config.best_metric={self.best_metric}: the evaluation at step {step} has no "
            f"such metric; name one it has: {', '.join(sorted(evaluated))}"
        )

    def best_candidate(self) -> int | None:
        """The step keep_best preserves now (the best score saved), or None."""
        return self._best.best()

    def forget_score(self, step: int) -> None:
        """A step set aside ranks no more."""
        self._best.scores.pop(step, None)

    def best_steps(self) -> list[int]:
        """The kept steps saved at an evaluation, best first (`best_metric`), for --step=best
        (a damaged best one is passed over for the next)."""
        damage: list[UserError] = []
        scores = _scores(self.directory, self.steps(), damage=damage)
        if not scores and damage:  # not a run without keep_best: its steps cannot be read
            raise UserError(f"--step=best: {damage[-1]}")
        if not scores:
            raise UserError(
                f"--step=best: no checkpoint in {self.directory} was saved at an evaluation; "
                "train with --config.keep_best=True, or pass a step number"
            )
        return sorted(scores, key=lambda step: (scores[step], step), reverse=True)


def open_reader(workdir: str | os.PathLike) -> Checkpoints:
    """A read-only Checkpoints for a workdir that a live run may be rotating: Orbax lists
    every step as it opens, and a step removed meanwhile is listed again."""
    for attempt in range(READ_ATTEMPTS):
        try:
            with library_workarounds.orbax_notices_dropped():
                return Checkpoints(workdir, read_only=True)
        except PermissionError:
            raise UserError(
                f"{checkpoint_dir(workdir)} cannot be read (permission denied); fix its "
                "permissions (or run as its owner) and run the same command again"
            ) from None
        except FileNotFoundError:
            if attempt == READ_ATTEMPTS - 1:
                raise UserError(
                    f"{checkpoint_dir(workdir)} changed {READ_ATTEMPTS} times while being "
                    "listed: the run training there rotates steps faster than they can be read; "
                    "wait for it to end, or raise its --config.max_to_keep"
                ) from None
    raise AssertionError("unreachable")


def prepare_directory(directory: pathlib.Path) -> None:
    """Create the checkpoint directory (a writer's), remove what a rotation moved aside and
    had not removed yet (`clear_rotated`), and refuse step directories this project did not
    write: Orbax would take them for steps and delete them when rotating. A step of this
    project's without its marker is left to `restore.restore`, which sets it aside."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-").close()
    except OSError as exc:
        raise UserError(
            f"cannot write checkpoints in {directory} ({workdir_lib.disk_problem(directory, exc)});"
            " pick a --workdir you can write to"
        ) from None
    clear_rotated(directory, whole=True)
    for path in sorted(directory.iterdir()):
        if errors.is_digits(path.name) and path.is_dir():
            check_readable(path)
        if errors.is_digits(path.name) and not (path / STEP_MARKER).exists() and not unmarked(path):
            raise not_a_checkpoint(path)


def clear_rotated(directory: pathlib.Path, whole: bool = False) -> None:
    """Remove the steps rotation moved into ROTATED_DIR (process 0): only rotation puts
    anything there, so what is there is what it was removing, also after a kill. `whole`:
    the directory itself too, once no rotation can be moving a step into it."""
    aside = directory / ROTATED_DIR
    if jax.process_index() or not aside.is_dir() or aside.is_symlink():
        return
    for path in aside.iterdir():
        shutil.rmtree(path, ignore_errors=True)
    if whole:
        with contextlib.suppress(OSError):  # a step moved in meanwhile: removed next time
            aside.rmdir()


def not_a_checkpoint(path: pathlib.Path) -> UserError:
    """The line for a step directory this project did not write (put there by hand, or by
    another program)."""
    return UserError(
        f"{path} is not a checkpoint this project wrote (no {STEP_MARKER}); move it out of "
        f"{path.parent}, where the newest {CHECKPOINT_DIR} are rotated away"
    )


def complete_steps(directory: pathlib.Path) -> list[int]:
    """The steps Orbax finished writing in `directory` (its marker file in them), on disk."""
    try:
        return sorted(
            int(p.name)
            for p in directory.iterdir()
            if errors.is_digits(p.name) and (p / STEP_MARKER).exists()
        )
    except OSError:
        return []


def unmarked(path: pathlib.Path) -> bool:
    """Whether a step directory lacks its marker but holds nothing but what this project's
    saves write: a step that lost its marker (damaged), or one an earlier version's rotation
    was removing file by file when its run was killed; never another program's directory."""
    if not path.is_dir() or path.is_symlink() or (path / STEP_MARKER).exists():
        return False
    return {p.name for p in path.iterdir()} <= {*STEP_FILES, *ARRAY_ITEMS, *JSON_ITEMS}


class Unreadable(UserError):
    """A step that permissions keep from being read: the user's to fix, never skipped."""


def check_readable(step_dir: pathlib.Path) -> None:
    """A step that is intact but unreadable here (permissions) is the user's to fix, not
    damage: say so, and leave it where it is."""
    found = [step_dir]
    for root, dirs, files in os.walk(step_dir):
        found += [pathlib.Path(root, name) for name in [*dirs, *files]]
    for path in found:
        readable = os.access(path, os.R_OK) and (not path.is_dir() or os.access(path, os.X_OK))
        if not readable and os.path.lexists(path):  # not merely removed meanwhile
            raise Unreadable(
                f"{path} cannot be read (permission denied); fix its permissions (or run as "
                "its owner) and run the same command again"
            )


def check_markers(directory: pathlib.Path) -> None:
    """Each step's marker a regular file of bounded size (`errors.read_file`) before Orbax lists
    the steps, reading every marker whole: it waits for ever on a FIFO. Anything else Orbax
    reports itself."""
    with contextlib.suppress(OSError):
        steps = [path for path in directory.iterdir() if path.name.isdigit()]
        for path in steps:
            with contextlib.suppress(OSError):  # none, or rotated away meanwhile
                errors.read_file(path / STEP_MARKER)


def check_files(step_dir: pathlib.Path) -> None:
    """Every file of a step regular, and a file Orbax reads whole of no more bytes than its
    kind holds (`size_limit`), before Orbax opens the step: it waits for ever on a FIFO, reads
    a device without end, and a file grown to gigabytes took gigabytes of memory. The data
    files are bounded once the arrays they hold are known (`check_data_files`). A file removed
    meanwhile raises FileNotFoundError, as Orbax's read would."""
    for root, _, names in os.walk(step_dir):
        for name in names:
            path = pathlib.Path(root, name)
            errors.check_regular(path)
            limit = size_limit(path)
            if limit is not None:
                errors.check_size(path, limit)


def size_limit(path: pathlib.Path) -> int | None:
    """The most bytes a file of a step that Orbax reads whole can hold, by its kind: a small
    file `errors.FILE_LIMIT`, an OCDBT manifest MANIFEST_LIMIT; None for any other."""
    if path.name in SMALL_FILES or path.parent.name == ARRAY_DESCRIPTIONS:
        return errors.FILE_LIMIT
    if path.name == MANIFEST:
        return MANIFEST_LIMIT
    return None


def data_limit(tree: Any) -> int:
    """The most bytes one data file of an array item restored into `tree` (whose shapes match
    the item's) can hold: every array of it at MAX_ITEMSIZE bytes an element, with room for
    OCDBT's nodes and chunk headers."""
    leaves = jax.tree.leaves(tree)
    data = sum(leaf.size for leaf in leaves) * MAX_ITEMSIZE
    return data + data // 64 + len(leaves) * LEAF_OVERHEAD + DATA_OVERHEAD


def check_data_files(item_dir: pathlib.Path, tree: Any) -> None:
    """Each data file of an array item no larger than `data_limit(tree)`, before Orbax reads
    it: one larger is no file a save of those arrays wrote, and is refused in one line."""
    limit = data_limit(tree)
    for root, _, names in os.walk(item_dir):
        if pathlib.Path(root).name == DATA_DIR:
            for name in names:
                errors.check_size(pathlib.Path(root, name), limit)


def marker_problem(step_dir: pathlib.Path) -> str | None:
    """What is wrong with a step's marker (missing, not a JSON object), in words, or None:
    Orbax logs a marker it cannot parse with the file's content and uses the step."""
    try:
        value = json.loads(errors.read_file(step_dir / STEP_MARKER))
    except FileNotFoundError:
        if not step_dir.is_dir():
            raise StepVanished(int(step_dir.name)) from None
        return f"it has no {STEP_MARKER} file: a save or removal cut short, or the file removed"
    except ValueError as exc:
        return f"its {STEP_MARKER} file is not valid JSON ({errors.reason(exc)})"
    if not isinstance(value, dict):
        return f"its {STEP_MARKER} file holds no JSON object"
    return None


def _shown(value: Any) -> str:
    """A JSON value as a reason quotes it, cut between words."""
    return errors.clip(json.dumps(value), errors.QUOTE_CHARS)


def item_problem(item: str, value: Any) -> str | None:
    """What makes a restored JSON item unusable (not an object, a field missing or of the
    wrong kind), or None."""
    if not isinstance(value, dict):
        return f"its {item} item is {_shown(value)}, not a JSON object"
    missing = [field for field in ITEM_FIELDS.get(item, ()) if field not in value]
    if missing:
        return f"its {item} item lacks {', '.join(missing)}"
    for field in sorted(value.keys() & FIELD_RULES.keys()):
        fits, wanted = FIELD_RULES[field]
        if not fits(value[field]):
            return f"its {item} item has {field}={_shown(value[field])}, not {wanted}"
    return None


def tree_metadata_problem(item_dir: pathlib.Path) -> str | None:
    """What is wrong with an array item's description of its tree (missing, not JSON), named
    as a file: Orbax reports neither in words."""
    if not item_dir.is_dir() and item_dir.parent.is_dir():
        return f"its {item_dir.name} item is missing"
    path = item_dir / TREE_METADATA
    try:
        json.loads(errors.read_file(path))
    except FileNotFoundError:
        return f"its {item_dir.name} item has no {TREE_METADATA} file"
    except ValueError as exc:
        return f"{path} is not valid JSON ({errors.reason(exc)})"
    except OSError:  # the step vanished, or permissions: restore() tells which
        pass
    return None


class ItemDamaged(UserError):
    """A JSON item of a step that cannot be used: `problem` says why, in words."""

    def __init__(self, directory: pathlib.Path, step: int, problem: str):
        super().__init__(
            f"checkpoint {step} in {directory} is damaged: {problem}; move {directory / str(step)}"
            f" to {directory.parent / DAMAGED_DIR} to use the one before"
        )
        self.problem = problem


def saved_item(directory: pathlib.Path, step: int, item: str) -> dict[str, Any] | None:
    """A JSON item of a checkpoint step (config, dataset), or None if that step has none; one
    that cannot be used raises ItemDamaged."""
    if not (directory / str(step)).is_dir():
        raise StepVanished(step)
    check_readable(directory / str(step))
    path = directory / str(step) / item / "metadata"
    try:
        value = json.loads(errors.read_file(path))
    except FileNotFoundError:
        if not (directory / str(step)).is_dir():
            raise StepVanished(step) from None
        return None
    except (OSError, ValueError) as exc:  # not JSON, not text, or not a file
        problem = f"its {item} item cannot be read as JSON ({errors.reason(exc)})"
    else:
        problem = item_problem(item, value)
    if problem:
        raise ItemDamaged(directory, step, problem)
    return value


def warn_damaged(
    directory: pathlib.Path,
    step: int,
    reason: str,
    instead: int | None,
    moved: pathlib.Path | None = None,
) -> None:
    """The one warning line for a damaged step passed over (process 0): why, where it was
    moved (a writer sets it aside), and the step used `instead`."""
    if jax.process_index():
        return
    line = f"checkpoint {step} in {directory} is damaged ({reason})"
    if moved is not None:
        line += f"; moved it to {moved}"
    if instead is not None:
        line += f"; using checkpoint {instead} instead"
    errors.warning_line(line)


def every_step_damaged(checkpoints: Checkpoints, damaged: dict[int, str]) -> UserError:
    """The line for a checkpoints directory none of whose steps can be read: the steps, the
    newest one's reason and, for a training run, how to start over."""
    directory = checkpoints.directory
    steps = sorted(damaged)
    listed = f"step {steps[0]}" if len(steps) == 1 else f"steps {', '.join(map(str, steps))}"
    line = (
        f"every checkpoint in {directory} is damaged ({listed}; {steps[-1]}: {damaged[steps[-1]]})"
    )
    if checkpoints.read_only:
        return UserError(line)
    return UserError(
        f"{line}; nothing was trained, moved or overwritten. To train again from step 0, pass a "
        f"fresh --workdir, or remove {directory} (this workdir's metrics.jsonl and summary.json "
        "are then replaced)"
    )
