"""Orbax checkpoints, writing side: the step format, asynchronous saves and their policies
(time floor, newest N, the best evaluation), and the faults a save can meet.

Each step directory under `<workdir>/checkpoints` holds six items: `model` and `optimizer`
(array trees, tensorstore/OCDBT), `progress` (step, data position, the running row),
`config` (the config that built the model), `dataset` (its name, class names and image
shape) and `changes` (accepted config changes), the last four as JSON. Nothing is pickled.
Reading them back (resume, damaged steps) is `restore.py`; loading a model for inference is
`inference.load_model`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import json
import os
import pathlib
import shutil
import tempfile
import threading
import time
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx

from . import errors, library_workarounds
from . import workdir as workdir_lib
from .errors import UserError

CHECKPOINT_DIR = "checkpoints"
DAMAGED_DIR = workdir_lib.DAMAGED_DIR
STEP_MARKER = "_CHECKPOINT_METADATA"  # what Orbax writes in every step it finalises
STEP_FILES = (STEP_MARKER, "commit_success.txt")  # a step's own files besides its items
TREE_METADATA = "_METADATA"  # what Orbax writes in an array item: its tree, shapes and dtypes
# The JSON files of a step Orbax reads whole: its marker, a JSON item's value, an array item's
# tree and sharding.
JSON_FILES = (STEP_MARKER, "metadata", TREE_METADATA, "_sharding")
SPACE_MARGIN = 1.5  # bytes a save needs per byte of state, metadata included, with room to spare
INODES_PER_SAVE = 100  # files and directories a save creates, with room for larger models
BEST_METRIC = "test_accuracy"  # what keep_best and --step=best rank by unless config.best_metric
BEST = "best"  # --step=best
SAVE_NICENESS = 19  # the save threads' CPU priority (nice), the lowest
READ_ATTEMPTS = 20  # a reader of a live run starts over this often when a step is rotated away
ROTATION_WAIT = 1.0  # seconds a reader watches a step that failed to read before it is damage
ROTATION_PAUSE = 0.05  # seconds between two looks at it


ARRAY_ITEMS = ("model", "optimizer")  # array trees
JSON_ITEMS = ("progress", "config", "dataset", "changes")
# The fields a JSON item must hold; one without them is damaged.
ITEM_FIELDS = {
    "progress": ("step", "epoch", "index", "num_batches", "batch_size", "seed"),
    "config": ("model", "compute_dtype", "batch_size", "seed"),
    "dataset": ("name", "class_names", "image_shape"),
    "changes": ("changes",),
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
    floor, write asynchronously; a reader deletes nothing."""
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
        enable_async_checkpointing=True,
    )


def best_metric(config: dict[str, Any] | None) -> str:
    """What keep_best and --step=best rank a run's steps by (higher is better): its config's
    `best_metric` (a metric of each evaluation's row, `val_accuracy`), else BEST_METRIC."""
    return (config or {}).get("best_metric") or BEST_METRIC


def _scores(
    directory: pathlib.Path, steps: Sequence[int], metric: str | None = None
) -> dict[int, float]:
    """Each step saved at an evaluation, its `metric` (default: the one its config names)
    from its progress item."""
    scores = {}
    for step in steps:
        try:
            progress = saved_item(directory, step, "progress") or {}
            name = metric or best_metric(saved_item(directory, step, "config"))
        except errors.FileRefused:
            raise
        except UserError:  # damaged: restore() sets it aside; it ranks nowhere
            continue
        if isinstance(progress.get(name), float):
            scores[step] = progress[name]
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
        ranked = self.best_metric in progress
        if self.keep_best and not ranked and any(name.startswith("test_") for name in progress):
            raise UserError(
                f"--config.best_metric={self.best_metric}: the evaluation at step {step} has "
                "no such metric; name one it has: "
                + ", ".join(k for k, v in sorted(progress.items()) if isinstance(v, float))
            )
        if not self.directory.is_dir():
            self._make_again(step)
        arrays = _arrays(model, optimizer)
        _check_space(self.directory, step, arrays)
        self._saving = step
        if ranked:
            self._best.scores[step] = progress[self.best_metric]
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
        self._starting.join()  # a save still starting (its failure already reported)
        library_workarounds.await_tmp_cleanup(self._manager)
        try:
            self._manager.close()  # waits for the save in flight, raising its failure again
        except Exception as exc:  # Orbax and tensorstore raise many types for a failed write
            if not library_workarounds.abandoned_writes():  # not reported yet: say it, in one line
                raise _save_failed(self.directory, self._saving, exc) from None

    def saved(self, item: str, step: int | None = None) -> tuple[int, dict[str, Any] | None]:
        """(step, JSON `item`) of `step`, or of the newest step whose item is intact: restore()
        sets a damaged one aside (or, reading, skips it) with a warning."""
        if step is not None:
            return step, self._item(step, item)
        damage = None
        for candidate in self.steps()[::-1]:
            try:
                value = self._item(candidate, item)
            except (Unreadable, errors.FileRefused):
                raise
            except UserError as exc:
                if self.rotated_after_watching(candidate):
                    raise StepVanished(candidate) from None
                damage = damage or exc
                continue
            if damage:  # an older step than asked for: say so
                logging.warning("%s; using checkpoint %d instead", damage, candidate)
            return candidate, value
        if damage:
            raise damage
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
            foreign = path.is_dir() and not (path / STEP_MARKER).exists() and not half_deleted(path)
        except FileNotFoundError:  # the run's rotation removed the rest while it was looked at
            foreign = False
        if foreign:
            raise not_a_checkpoint(path)  # what no save or rotation of this project leaves
        done, listed = complete_steps(self.directory), self.steps()
        return step not in done or (bool(listed) and done[-1] > listed[-1])

    def best_candidate(self) -> int | None:
        """The step keep_best preserves now (the best score saved), or None."""
        return self._best.best()

    def forget_score(self, step: int) -> None:
        """A step set aside ranks no more."""
        self._best.scores.pop(step, None)

    def best_steps(self) -> list[int]:
        """The kept steps saved at an evaluation, best first (`best_metric`), for --step=best
        (a damaged best one is passed over for the next)."""
        scores = _scores(self.directory, self.steps())
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
    """Create the checkpoint directory (a writer's), and refuse step directories this project
    did not write: Orbax would take them for steps and delete them when rotating."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=directory, prefix=".write-test-").close()
    except OSError as exc:
        raise UserError(
            f"cannot write checkpoints in {directory} ({workdir_lib.disk_problem(directory, exc)});"
            " pick a --workdir you can write to"
        ) from None
    for path in sorted(directory.iterdir()):
        if errors.is_digits(path.name) and path.is_dir():
            check_readable(path)
        if not errors.is_digits(path.name) or (path / STEP_MARKER).exists():
            continue
        if half_deleted(path):  # a kill while Orbax was removing a rotated-away step
            shutil.rmtree(path, ignore_errors=True)  # every process of a run may try
            if not path.exists():
                logging.warning("%s was half deleted when its run stopped; removed it", path)
                continue
        raise not_a_checkpoint(path)


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


def half_deleted(path: pathlib.Path) -> bool:
    """Whether a step directory without its marker holds nothing but what this project's saves
    write (Orbax deletes a rotated step file by file, the marker among the first)."""
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
    """Every file of a step regular, its JSON files of bounded size (`errors.read_file`), before
    Orbax reads them: it waits for ever on a FIFO and reads a device without end. A file
    removed meanwhile raises FileNotFoundError, as Orbax's read would."""
    for root, _, names in os.walk(step_dir):
        for name in names:
            path = pathlib.Path(root, name)
            errors.check_regular(path)
            if name in JSON_FILES:
                errors.read_file(path)


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


def saved_item(directory: pathlib.Path, step: int, item: str) -> dict[str, Any] | None:
    """A JSON item of a checkpoint step (config, dataset), or None if that step has none."""
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
        raise UserError(
            f"checkpoint {step} in {directory} is damaged: {problem}; move {directory / str(step)}"
            f" to {directory.parent / DAMAGED_DIR} to use the one before"
        )
    return value
