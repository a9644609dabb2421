"""Orbax checkpoints, reading side: restore the newest intact step, set damaged ones aside,
check shapes, and resume a run exactly (model, optimizer, data position, running row).

A step is damaged when a file is missing, cut short or not what a save wrote there: its
marker, a JSON item it needs, its arrays (read back, each is checked against the checksum
saved with it). A reader of a live run (eval, predict, export) never moves anything: it skips
a damaged step and starts over when the trainer rotates the step it was reading away.
"""

from __future__ import annotations

import shutil
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from . import errors, parallel
from .checkpoint import (
    ARRAY_ITEMS,
    CHECKSUMS,
    DAMAGED_DIR,
    Checkpoints,
    ItemDamaged,
    StepVanished,
    check_data_files,
    check_files,
    check_readable,
    checksum_problem,
    every_step_damaged,
    item_problem,
    key_data,
    marker_problem,
    named_leaves,
    saved_item,
    tree_metadata_problem,
    unmarked,
    warn_damaged,
    wrap_keys,
)
from .errors import UserError


class Damaged(UserError):
    """The one step asked for cannot be read: files missing, truncated or not its own."""


class ShapeMismatch(UserError):
    """An array of the checkpoint's item `item` differs in shape or name from its target."""

    def __init__(self, message: str, item: str):
        super().__init__(message)
        self.item = item


def _flat_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """{'layers.0.kernel': (784, 256), ...} for a state or a checkpoint's metadata tree."""
    leaves = named_leaves(tree, is_leaf=lambda x: hasattr(x, "shape"))
    return {name: tuple(leaf.shape) for name, leaf in leaves.items()}


RESTORE_ADVICE = "use the config the checkpoint was trained with"


def check_shapes(
    target: Any, stored: Any, what: str, item: str = "model", advice: str = RESTORE_ADVICE
) -> None:
    """Raise one line naming the first array whose shape differs, or that one side lacks."""
    want, have = _flat_shapes(target), _flat_shapes(stored)
    for name in sorted(want.keys() | have.keys()):
        if want.get(name) != have.get(name):
            saved = have.get(name, "nothing (not in the checkpoint)")
            built = want.get(name, "nothing (not in the model)")
            raise ShapeMismatch(
                f"{what}: parameter {name} has shape {saved} in the checkpoint but {built} in the "
                f"model being restored; {advice}",
                item,
            )


def _json_problem(checkpoints: Checkpoints, step: int, items: tuple[str, ...]) -> str | None:
    """What makes the first of a step's JSON `items` unusable, or None."""
    for item in items:
        try:
            saved_item(checkpoints.directory, step, item)
        except ItemDamaged as damaged:
            return damaged.problem
    return None


def restore_step(checkpoints: Checkpoints, step: int, targets: dict[str, Any]) -> dict[str, Any]:
    """The named items of one step: array items into the shapes of their targets (checked
    first) and against their checksums, JSON items checked for their fields, with the step's
    marker and every other JSON item the command needs (`needed_items`). Any damage raises
    (ValueError or Orbax's); a file that is no regular one, or larger than its kind holds, is
    one line (`check_files`, `check_data_files`)."""
    step_dir = checkpoints.directory / str(step)
    check_files(step_dir)
    arrays = {name: key_data(t) for name, t in targets.items() if name in ARRAY_ITEMS}
    needed = tuple(item for item in checkpoints.needed_items if item not in targets)
    problem = marker_problem(step_dir) or _json_problem(checkpoints, step, needed)
    if problem:
        raise ValueError(problem)
    try:
        recorded = saved_item(checkpoints.directory, step, CHECKSUMS) if arrays else None
    except ItemDamaged as damaged:
        raise ValueError(damaged.problem) from None
    for name in arrays:
        problem = tree_metadata_problem(checkpoints.directory / str(step) / name)
        if problem:
            raise ValueError(problem)
    metadata = checkpoints.manager.item_metadata(step)
    for name, target in arrays.items():
        stored = metadata[name]
        if stored is None:
            raise ValueError(f"item {name} has no metadata")
        check_shapes(target, getattr(stored, "tree", stored), f"checkpoint {step}", name)
        check_data_files(step_dir / name, target)
    args = {
        name: ocp.args.StandardRestore(arrays[name]) if name in arrays else ocp.args.JsonRestore()
        for name in targets
    }
    restored = checkpoints.manager.restore(step, args=ocp.args.Composite(**args))
    for name in targets:
        if name in arrays:
            problem = checksum_problem(name, restored[name], (recorded or {}).get(name))
        else:
            problem = item_problem(name, restored[name])
        if problem:
            raise ValueError(problem)
    return {
        name: wrap_keys(restored[name], targets[name]) if name in arrays else restored[name]
        for name in targets
    }


def set_aside(checkpoints: Checkpoints, step: int, reason: str, instead: int | None) -> None:
    """Move a damaged step out of the way, under a name that never replaces another, and say
    so in one line, with the step used `instead`."""
    if checkpoints.read_only:  # a reader leaves the workdir as it found it
        warn_damaged(checkpoints.directory, step, reason, instead)
        return
    directory = checkpoints.directory
    aside = directory.parent / DAMAGED_DIR
    damaged = aside / str(step)
    try:
        aside.mkdir(exist_ok=True)
        copy = 1
        while damaged.exists():
            damaged = damaged.with_name(f"{step}.{copy}")
            copy += 1
        shutil.move(directory / str(step), damaged)
    except OSError as exc:  # a file where the directory goes, no permission, no space
        problem, fix = (
            ("is a file", "move that file away")
            if aside.is_file()
            else (f"cannot be written ({exc.strerror})", "make it writable")
        )
        raise UserError(
            f"checkpoint {step} in {directory} is damaged ({reason}) and cannot be moved aside: "
            f"{aside} {problem}; {fix} and run the same command again to resume from the step "
            "before"
        ) from None
    checkpoints.forget_score(step)
    checkpoints.reload()
    warn_damaged(directory, step, reason, instead, damaged)


def restore(
    checkpoints: Checkpoints,
    targets: dict[str, Any],
    step: int | None = None,
    at_most: int | None = None,
) -> dict[str, Any] | None:
    """Restore the named items of `step` (default: the newest intact one, no newer than
    `at_most`), or None if none.

    A damaged step is passed over for the next older one, and moved aside with a one-line
    warning once an intact one is found (a writer also sets aside the older steps without a
    marker: no rotation removes one); when every step is damaged nothing is moved and one
    line names them (a run that trained again from step 0 would replace the finished run's
    metrics.jsonl and summary.json). A shape mismatch is the user's to fix and is raised,
    not skipped.
    """
    parallel.sync("restore")  # every process lists the same steps
    checkpoints.reload()
    directory = checkpoints.directory
    steps = checkpoints.steps()
    candidates = [step] if step is not None else [s for s in steps[::-1] if s <= (at_most or s)]
    if step is not None and step not in steps:
        raise UserError(f"no checkpoint for step {step} in {directory}; it has {steps}")
    if at_most is not None and not candidates and steps:  # all newer: it was rotated away
        raise StepVanished(at_most)
    damaged: dict[int, str] = {}  # step -> why it cannot be read, newest first
    for candidate in candidates:
        try:
            restored = restore_step(checkpoints, candidate, targets)
        except UserError:
            raise
        except Exception as exc:  # Orbax and tensorstore raise many types for a bad file
            if not (directory / str(candidate)).is_dir() or checkpoints.rotated_after_watching(
                candidate
            ):
                raise StepVanished(candidate) from None
            check_readable(directory / str(candidate))
            reason = errors.reason(exc)
            if step is not None:
                raise Damaged(f"checkpoint {step} in {directory} is damaged: {reason}") from None
            if jax.process_count() > 1:
                # Each process may read different files (FSDP shards), so the others may be
                # mid-restore: they cannot agree to skip it. Stop with what to do.
                raise UserError(
                    f"checkpoint {candidate} in {directory} cannot be read here ({reason}); "
                    f"move it to {directory.parent / DAMAGED_DIR} and run the same command "
                    "again to resume from the one before"
                ) from None
            damaged[candidate] = reason
            continue
        if not checkpoints.read_only:
            older = [s for s in steps if s < candidate and unmarked(directory / str(s))]
            damaged |= {s: marker_problem(directory / str(s)) for s in older}
        for bad, reason in damaged.items():
            set_aside(checkpoints, bad, reason, candidate)
        return {**restored, "step": candidate}
    if damaged:
        raise every_step_damaged(checkpoints, damaged)
    return None


def resume(
    checkpoints: Checkpoints,
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    expected: dict[str, int],
    optimizer_changed: bool = False,
    restarts_with_it: str = "",
) -> tuple[int, dict[str, Any]]:
    """Restore the newest intact checkpoint into model and optimizer; returns its step (0:
    none) and its progress item. The data position must match `expected` (batch size, seed,
    batches per epoch). When `optimizer_changed` (an accepted change of config.optimizer)
    left the saved optimizer state another shape, the optimizer starts afresh, and the note
    that says so names `restarts_with_it` (what else counts on the optimizer's step)."""
    targets = {"model": nnx.state(model), "optimizer": nnx.state(optimizer), "progress": None}
    try:
        restored = restore(checkpoints, targets)
    except ShapeMismatch as mismatch:
        if not (optimizer_changed and mismatch.item == "optimizer"):
            raise
        del targets["optimizer"]
        restored = restore(checkpoints, targets)
        parallel.say(
            f"note: the optimizer's state in {checkpoints.directory} does not fit the new "
            "config.optimizer; the optimizer starts afresh (moments and schedule from 0)"
            + (f"; {restarts_with_it}" if restarts_with_it else "")
        )
    if restored is None:
        return 0, {}
    saved = restored["progress"]
    for key in ("batch_size", "seed", "num_batches"):
        if saved[key] != expected[key]:
            raise UserError(
                f"{checkpoints.directory} was trained with {key}={saved[key]}, this run has "
                f"{expected[key]}; resume with the same value or use a new --workdir"
            )
    nnx.update(model, restored["model"])
    if "optimizer" in restored:
        nnx.update(optimizer, restored["optimizer"])
    return restored["step"], saved


def check_best(checkpoints: Checkpoints, model: nnx.Module, resumed_step: int) -> None:
    """With keep_best, the best step outlives every rotation: read it once when a run starts
    (unless it is the step just resumed from), and set it aside if it is damaged, so it
    neither blocks --step=best nor stays "best" for ever."""
    best = checkpoints.best_candidate()
    if best is None or best == resumed_step:
        return
    try:
        restore_step(checkpoints, best, {"model": nnx.state(model)})
    except UserError:
        raise
    except Exception as exc:  # Orbax and tensorstore raise many types for a bad file
        check_readable(checkpoints.directory / str(best))
        set_aside(checkpoints, best, errors.reason(exc), None)
