"""Use a trained workdir: load its model (`load_model`), evaluate it on the test set
(--mode=eval), or classify a user's images (--mode=predict).

What --mode=predict (`read_images`) and the Python `predict(model, images)` accept is one rule,
`evaluate.model_input`, with the model's image shape (H, W, C) ((28, 28, 1) for Fashion-MNIST):

* .npy arrays and `predict`'s arrays are (H, W, C) for one image, or (N, H, W, C) or
  (N, H * W * C) for N >= 1 images; for grayscale (C = 1) also (H, W) and (N, H, W).
* uint8 pixels are 0..255 and are scaled by 1/255, exactly as training scales them; other
  integer dtypes are accepted only when every value lies in 0..255, and are scaled the same.
* Float pixels must be finite and lie in [0, 1]; they are never rescaled, so 0..255 floats are
  refused with a line that says to divide them by 255 first.
* bool, complex, string, object, structured and date/time arrays are refused.
* Image files (PNG, JPEG, ... anything Pillow reads) must be at most MAX_IMAGE_SIDE pixels on
  each side, checked from the header before decoding, and not a decompression bomb. They are
  converted to the model's channels, each with a note: colour to grayscale for C = 1,
  grayscale to RGB for C = 3 (RGBA for C = 4), alpha dropped, palettes expanded. 8-bit
  pixels are 0..255, 16-bit grayscale is scaled by 1/65535, float (mode F) images follow the
  float rule; another size is resized to (H, W), with a note.

A file that breaks the rule gets one error line naming it and the others are still classified.
"""

from __future__ import annotations

import os
import pathlib
import time
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from absl import logging
from flax import nnx
from PIL import Image

from fmnist_flax import config as config_lib
from fmnist_flax import datasets, ensemble, errors, evaluate, parallel, restore, tables
from fmnist_flax import ema as ema_lib
from fmnist_flax import model as model_lib
from fmnist_flax import workdir as workdir_lib
from fmnist_flax.checkpoint import (
    BEST,
    READ_ATTEMPTS,
    STEP_MARKER,
    Checkpoints,
    StepVanished,
    Unreadable,
    checkpoint_dir,
    complete_steps,
    open_reader,
    saved_item,
)
from fmnist_flax.errors import UserError

MAX_IMAGE_SIDE = 4096  # larger image files are refused before they are decoded
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # grayscale, scaled by 1/65535
PICTURE_MODES = {1: "L", 3: "RGB", 4: "RGBA"}  # the Pillow mode of each channel count
GREY_MODES = ("L", "F", *SIXTEEN_BIT_MODES)  # read as they are, the channel copied for colour
REMOVAL_SECONDS = 1.0  # a rotated-away step's directory is gone this soon after it vanishes
LIST_PAUSE_S = 0.05  # between listings of a rotating run's steps that found none


# What restore_model assumes for a checkpoint written before the `dataset` item existed.
FASHION_MNIST_INFO = {
    "name": "fashion_mnist",
    "title": "Fashion-MNIST",
    "class_names": list(datasets.IDX_DATASETS["fashion_mnist"].class_names),
    "image_shape": [28, 28],
}


def restore_model(
    workdir: str | os.PathLike,
    step: int | str | None = None,
    compute_dtype: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    flag: str = "--workdir",
    member: int | str | None = None,
    ema: bool = False,
) -> tuple[nnx.Module, int, ml_collections.ConfigDict, dict[str, Any]]:
    """Rebuild a workdir's model from its saved config and restore only its parameters.

    Returns the model, the step it was restored from, the config (with `compute_dtype`
    applied) and the dataset's info (name, title, class names, image shape). For an ensemble
    run, `member` picks what the model is (`ensemble.select_member`); `ema`: the model with
    its EMA as parameters (`ema.averaged`; `--ema`). On a `mesh` the
    parameters are read straight into the saved run's layout over it, whatever the device and
    process count of the run that saved them. Every problem is a one-line UserError, raised
    before anything compiles, naming the workdir as `flag`.
    """
    path = pathlib.Path(workdir).expanduser()
    try:
        is_dir, exists = path.is_dir(), path.exists()
    except OSError as exc:  # a name too long for the filesystem, a directory we may not enter
        raise UserError(
            f"{flag} {path} cannot be looked at ({exc.strerror}); pass the directory of a "
            "training run"
        ) from None
    if not is_dir:
        what = "is not a directory" if exists else "does not exist"
        raise UserError(f"{flag} {path} {what}; pass the directory of a training run")
    if not checkpoint_dir(path).is_dir():
        raise UserError(f"{flag} {path} has no checkpoints; train there first")
    checkpoints = open_reader(path)
    try:
        for attempt in range(READ_ATTEMPTS):  # a live run may rotate the chosen step away
            try:
                if step == BEST:
                    restored = _restore_best(checkpoints, compute_dtype, mesh, flag)
                else:
                    restored = _restore_model(checkpoints, step, compute_dtype, mesh, flag)
                chosen = ensemble.select_member(restored, member, checkpoints, flag)
                return _averaged(chosen, path, flag) if ema else chosen
            except StepVanished as gone:
                if step is not None or attempt == READ_ATTEMPTS - 1:
                    raise _vanished(checkpoints.directory / str(gone.step)) from None
                checkpoints.reload()
    finally:
        checkpoints.close()


def _averaged(restored: tuple, path: pathlib.Path, flag: str) -> tuple:
    """`restore_model`'s result with the model's EMA of its parameters as the model."""
    model, step, config, info = restored
    if not ema_lib.kept(model):
        raise UserError(
            f"--ema: {flag} {path} kept no average of its parameters (config.ema.decay=0); "
            "leave out --ema, or train with --config.ema.decay=0.999"
        )
    return ema_lib.averaged(model), step, config, {**info, "ema": True}


def _vanished(path: pathlib.Path) -> UserError:
    """The line for a step that went on vanishing as it was read: rotated away by a live run
    (its directory gone once the removal ends), or one that stays incomplete."""
    deadline = time.monotonic() + REMOVAL_SECONDS
    while path.is_dir() and time.monotonic() < deadline:
        time.sleep(REMOVAL_SECONDS / 20)
    if path.is_dir():
        return UserError(
            f"{path} is an incomplete checkpoint (no {STEP_MARKER}) that no run is removing: "
            "left by a run killed while removing it, or put there by hand; move it out of "
            f"{path.parent} (training in this workdir again removes it)"
        )
    return UserError(
        f"checkpoint {path.name} in {path.parent} was removed while being read: the run "
        "training there rotated it away; read a kept step with --step, or wait for that run "
        "to end"
    )


def _restore_best(checkpoints: Checkpoints, compute_dtype, mesh, flag) -> tuple:
    """The model of the best kept evaluated step that can be read; a damaged one is passed
    over with a warning (a reader moves nothing: the training run sets it aside)."""
    ranked = checkpoints.best_steps()
    for step in ranked:
        try:
            return _restore_model(checkpoints, step, compute_dtype, mesh, flag)
        except UserError as exc:  # damaged: its config item, or its arrays
            if step == ranked[-1] or isinstance(
                exc, Unreadable | restore.ShapeMismatch | errors.FileRefused
            ):
                raise
            logging.warning("%s; using the next best checkpoint", exc)
    raise AssertionError("unreachable")


def _listed_steps(checkpoints: Checkpoints) -> list[int]:
    """The steps, listed again while none is: a run rotating its checkpoints may have none
    listed for a moment (the newest not yet finalised, the previous one just removed)."""
    for _ in range(READ_ATTEMPTS):
        steps = checkpoints.steps()
        if steps or not complete_steps(checkpoints.directory):
            return steps
        time.sleep(LIST_PAUSE_S)
        checkpoints.reload()
    return checkpoints.steps()


def _restore_model(
    checkpoints: Checkpoints,
    step: int | str | None,
    compute_dtype: str | None,
    mesh: jax.sharding.Mesh | None,
    flag: str,
) -> tuple[nnx.Module, int, ml_collections.ConfigDict, dict[str, Any]]:
    path = checkpoints.directory.parent
    steps = _listed_steps(checkpoints)
    if not steps:
        raise UserError(f"{flag} {path} has no checkpoints; train there first")
    if step is not None and step not in steps:
        asked = f"--step={step}" if flag == "--workdir" else f"{flag}={path}:{step}"
        raise UserError(f"{asked}: {path} has checkpoints for steps {steps}")
    chosen, saved = checkpoints.saved("config", step)
    if saved is None:
        raise UserError(f"{flag} {path}: no checkpoint has an intact saved config")
    config = config_lib.with_defaults(saved)
    info = checkpoints.saved("dataset", chosen)[1] or FASHION_MNIST_INFO
    if compute_dtype is not None and compute_dtype not in model_lib.COMPUTE_DTYPES:
        raise UserError(
            f"--compute_dtype={compute_dtype!r} is not supported; "
            f"use one of {', '.join(model_lib.COMPUTE_DTYPES)}"
        )
    config.compute_dtype = compute_dtype or config.compute_dtype
    shape = datasets.as_hwc(info["image_shape"])
    classes = len(info["class_names"])
    try:
        if config.compute_dtype not in model_lib.COMPUTE_DTYPES:
            raise UserError(f"compute_dtype={config.compute_dtype!r} is not supported")
        model = model_lib.create_model(config, shape, classes)
        ema_lib.attach(model, config.ema.decay)  # a place for the average it saved
    except UserError as exc:  # the saved config's, not a flag's
        said = str(exc).replace("--config.", "config.")
        raise UserError(
            f"checkpoint {chosen} in {checkpoints.directory}: its saved config builds no model "
            f"here ({said}); read another step with --step"
        ) from None
    if mesh is not None:
        stacked = isinstance(model, ensemble.Ensemble)
        parallel.place_module(model, mesh, config.param_sharding, stacked)
    restored = restore.restore(checkpoints, {"model": nnx.state(model)}, step, at_most=chosen)
    if restored is None:
        raise UserError(f"{flag} {path}: every checkpoint is damaged")
    nnx.update(model, restored["model"])
    model.eval()  # inference: no dropout, BatchNorm on its running statistics
    return model, restored["step"], config, {**info, "image_shape": list(shape)}


def load_model(
    workdir: str | os.PathLike,
    step: int | str | None = None,
    compute_dtype: str | None = None,
    member: int | str | None = None,
    ema: bool = False,
) -> nnx.Module:
    """The trained model of a workdir (newest checkpoint by default; `step="best"`: the best
    test accuracy kept by `config.keep_best`), ready for `predict`.

    Only parameters are read, no optimizer state; `compute_dtype` ('float32' or 'bfloat16')
    overrides the dtype it was trained in. `class_names(workdir)` names its outputs. Of an
    ensemble run: member K (an int), "best" (by test accuracy) or "ensemble" (the default).
    `ema=True`: the EMA of its parameters (a run trained with config.ema.decay > 0).
    """
    return restore_model(workdir, step, compute_dtype, member=member, ema=ema)[0]


def class_names(workdir: str | os.PathLike, step: int | None = None) -> tuple[str, ...]:
    """The class names of the dataset a workdir's model was trained on (its newest step)."""
    directory = checkpoint_dir(workdir)
    steps = sorted(int(p.name) for p in directory.glob("*") if p.name.isdigit())
    if not steps:
        raise UserError(f"--workdir {workdir} has no checkpoints; train there first")
    info = saved_item(directory, steps[-1] if step is None else step, "dataset")
    return tuple((info or FASHION_MNIST_INFO)["class_names"])


def run_eval(
    workdir: str | os.PathLike,
    *,
    step: int | str | None = None,
    compute_dtype: str | None = None,
    data_dir: str | None = None,
    output: str | None = None,
    member: int | str | None = None,
    ema: bool = False,
) -> dict[str, Any]:
    """Restore parameters only and evaluate every metric of the task (task.py) on the whole
    test set of the dataset the model was trained on, on every device; the results also go to
    `output` (JSON) when given, never into the workdir, which a training run may own. The
    batch is the training batch rounded up to a multiple of the device count."""
    workdir_lib.check_output_path(output)
    mesh = parallel.make_mesh()
    model, step, config, info = restore_model(
        workdir, step, compute_dtype, mesh, member=member, ema=ema
    )
    dataset = datasets.load(config, data_dir)
    if list(dataset.image_shape) != list(info["image_shape"]):
        raise UserError(
            f"the test images are {dataset.image_shape} but the model was trained on "
            f"{tuple(info['image_shape'])}; pass the --data_dir it was trained with"
        )
    if dataset.num_classes > len(info["class_names"]):  # labels the model has no output for
        raise UserError(
            f"the test set ({dataset.sources[1]}) has {dataset.num_classes} classes but the "
            f"model was trained on {len(info['class_names'])}; pass the --data_dir it was "
            "trained with"
        )
    ways = parallel.data_size(mesh)
    batch_size = -(-config.batch_size // ways) * ways
    result = evaluate.evaluate(
        model, dataset.test_images, dataset.test_labels, config, mesh, batch_size
    )
    names = info["class_names"]
    counts = evaluate.confusion_matrix(dataset.test_labels, result["predictions"], len(names))
    metrics = {k: v for k, v in result.items() if k not in ("predictions", "batch_sums")}
    report = {
        "step": step,
        **({"member": info["member"]} if "member" in info else {}),
        **({"ema": True} if ema else {}),
        "compute_dtype": config.compute_dtype,
        **{f"test_{name}": value for name, value in metrics.items()},
        "dataset": info["name"],
        "class_names": list(names),
        "confusion_matrix": counts.tolist(),
    }
    if not parallel.is_primary():
        return report
    print(
        tables.evaluation_table(
            {f"test, checkpoint {step}{' EMA' if ema else ''} ({config.compute_dtype})": metrics}
        ).format(),
        tables.Table.of(
            "Confusion matrix (rows: true class, columns: predicted)",
            ("", *(tables.printable(name)[:7] for name in names)),
            [(name, *row) for name, row in zip(names, counts, strict=True)],
        ).format(),
        sep="\n",
    )
    if output:
        workdir_lib.write_json(pathlib.Path(output).expanduser(), report)
    return report


def read_images(
    path: pathlib.Path, image_shape: tuple[int, int, int] = (28, 28, 1)
) -> tuple[list[tuple[str, np.ndarray]], list[str]]:
    """(name, (H, W, C) float32 in [0, 1]) for each image in a picture or a .npy file, and
    notes. The module docstring's rule decides what is accepted; anything else raises a
    one-line UserError that names the file."""
    name = str(path)
    shape = tuple(int(side) for side in image_shape)
    if path.exists() and not path.is_file():  # reading a FIFO or a device could wait for ever
        raise UserError(f"{name}: not a regular file (a directory, a FIFO or a device)")
    if path.suffix.lower() == ".npy":
        images = evaluate.model_input(_load_npy(path, name), shape, name)
        names = [name] if len(images) == 1 else [f"{name}[{i}]" for i in range(len(images))]
        return list(zip(names, images, strict=True)), []
    notes: list[str] = []
    pixels = _read_picture(path, name, notes, shape[2])
    height, width = pixels.shape[:2]
    x = evaluate.model_input(pixels, (height, width, shape[2]), name)[0]
    if (height, width) != shape[:2]:
        notes.append(f"{name}: resized from {width}x{height} to {shape[1]}x{shape[0]}")
        channels = [
            np.asarray(Image.fromarray(x[..., c]).resize(shape[1::-1], Image.Resampling.BILINEAR))
            for c in range(shape[2])
        ]
        x = np.stack(channels, axis=-1).astype(np.float32).clip(0, 1)  # bilinear overshoots
    return [(name, x)], notes


def _load_npy(path: pathlib.Path, name: str) -> np.ndarray:
    """A .npy file's array, mapped rather than read, so a header that promises more data than
    the file holds is refused before any memory is spent."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as exc:  # NumPy's header parser also raises tokenize.TokenError & co.
        reason = errors.reason(exc)
        raise UserError(f"{name}: cannot read it as a .npy array ({reason})") from None
    if not isinstance(array, np.ndarray):  # np.load opens a zip as an .npz archive
        array.close()
        raise UserError(
            f"{name}: is an .npz archive, not a .npy array; save one array with np.save"
        )
    return array


def _read_picture(path: pathlib.Path, name: str, notes: list[str], channels: int) -> np.ndarray:
    """A picture's pixels at its own size with `channels` channels (last axis): uint8, or
    float32 in [0, 1] for 16-bit grayscale, or float32 as stored for mode F. Size limits are
    checked from the header, before anything is decoded."""
    if channels not in PICTURE_MODES:
        raise UserError(
            f"{name}: the model takes {channels}-channel images, which no picture format holds; "
            "pass them as a .npy array"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as image:
                width, height = image.size
                if not (0 < width <= MAX_IMAGE_SIDE and 0 < height <= MAX_IMAGE_SIDE):
                    raise UserError(
                        f"{name}: {width}x{height} pixels; images larger than "
                        f"{MAX_IMAGE_SIDE}x{MAX_IMAGE_SIDE} are refused, shrink it first"
                    )
                mode = image.mode
                if mode not in (*GREY_MODES, PICTURE_MODES[channels]):
                    image = image.convert(PICTURE_MODES[channels])
                pixels = np.asarray(image)
    except UserError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise UserError(f"{name}: refused as a possible decompression bomb ({exc})") from None
    except Exception as exc:  # Pillow raises many types for malformed files; each is the file's
        reason = errors.reason(exc)
        raise UserError(f"{name}: cannot read it as an image ({reason})") from None
    if mode in SIXTEEN_BIT_MODES:
        pixels = _sixteen_bit(pixels, mode, name, notes)
    pixels = pixels.reshape(*pixels.shape[:2], -1)
    target = "grayscale" if channels == 1 else PICTURE_MODES[channels]
    if mode not in (*GREY_MODES, PICTURE_MODES[channels]):
        dropped = " (alpha dropped)" if "A" in mode and channels < 4 else ""
        notes.append(f"{name}: converted from {mode} to {target}{dropped}")
    elif pixels.shape[2] != channels:  # grayscale for a colour model: the channel copied
        pixels = np.repeat(pixels, channels, axis=2)
        notes.append(f"{name}: converted from grayscale ({mode}) to {target}")
    return pixels


def _sixteen_bit(pixels: np.ndarray, mode: str, name: str, notes: list[str]) -> np.ndarray:
    """16-bit grayscale as float32 in [0, 1], with a note."""
    low, high = int(pixels.min()), int(pixels.max())
    if low < 0 or high > 65535:
        raise UserError(
            f"{name}: {mode} pixels range over {low}..{high}, outside the 0..65535 of a "
            "16-bit image; save it as 8- or 16-bit grayscale"
        )
    notes.append(f"{name}: 16-bit grayscale ({mode}) scaled by 1/65535 to [0, 1]")
    return pixels.astype(np.float32) / np.float32(65535)


def run_predict(
    workdir: str | os.PathLike,
    paths: Sequence[str],
    *,
    step: int | str | None = None,
    compute_dtype: str | None = None,
    output: str | None = None,
    member: int | str | None = None,
    ema: bool = False,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Classify each image; unreadable ones get one line each and the rest are still classified.

    Returns the predictions and the error lines.
    """
    if not paths:
        raise UserError("--mode=predict needs --images=a.png,b.npy,...")
    workdir_lib.check_output_path(output)
    mesh = parallel.make_mesh()
    model, _, _, info = restore_model(workdir, step, compute_dtype, mesh, member=member, ema=ema)
    names = info["class_names"]
    named = []
    failures = []
    for path in paths:
        try:
            images, notes = read_images(pathlib.Path(path), info["image_shape"])
        except UserError as exc:
            errors.print_traceback(exc)  # with --debug
            failures.append(str(exc))
            continue
        named += images
        for note in notes:
            parallel.say(f"note: {note}")
    if len(set(parallel.from_every_process(len(named)))) > 1:
        raise UserError(
            "the processes could read different images from --images; in a multi-process run "
            "every process needs the same files (put them on a filesystem all hosts share)"
        )
    predictions = []
    if named:
        probabilities = evaluate.predict(
            model, np.stack([image for _, image in named]), mesh, image_shape=info["image_shape"]
        )
        for (name, _), probs in zip(named, probabilities, strict=True):
            best = int(np.argmax(probs))
            predictions.append(
                {
                    "image": name,
                    "class": names[best],
                    "class_index": best,
                    "probability": float(probs[best]),
                    "probabilities": [float(p) for p in probs],
                }
            )
            shown = f"{tables.printable(name)}: {tables.printable(names[best])}"
            parallel.say(f"{shown} ({100 * probs[best]:.1f}%)")
    if output and parallel.is_primary():
        workdir_lib.write_json(
            pathlib.Path(output).expanduser(), {"predictions": predictions, "errors": failures}
        )
    return predictions, failures
