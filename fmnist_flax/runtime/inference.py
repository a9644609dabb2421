"""Use a trained workdir: load its model (`load_model`), evaluate it on the test set
(--mode=eval), or classify a user's images (--mode=predict).

What --mode=predict (`read_images`) and the Python `predict(model, images)` accept is one rule,
`model_input`, with the model's image shape (H, W, C) ((28, 28, 1) for Fashion-MNIST):

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
  float rule; another size is resized to (H, W), with a note. An animated or multi-page
  picture is read from its first frame, with a note.

A file that breaks the rule gets one error line naming it and the others are still classified.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import pathlib
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from PIL import Image

from . import ema as ema_lib
from . import ensemble, errors, memory, parallel, plugins, restore, tables
from . import workdir as workdir_lib
from .checkpoint import (
    BEST,
    DAMAGED_DIR,
    READ_ATTEMPTS,
    STEP_MARKER,
    Checkpoints,
    StepVanished,
    Unreadable,
    best_metric,
    checkpoint_dir,
    complete_steps,
    open_reader,
)
from .errors import UserError

MAX_IMAGE_SIDE = 4096  # larger image files are refused before they are decoded
# The copies of the images as float32 that predict holds at once at most: as read and scaled,
# stacked, as the model's input and on the device (a CPU's is the host's memory).
PREDICT_COPIES = 4
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # grayscale, scaled by 1/65535
PICTURE_MODES = {1: "L", 3: "RGB", 4: "RGBA"}  # the Pillow mode of each channel count
GREY_MODES = ("L", "F", *SIXTEEN_BIT_MODES)  # read as they are, the channel copied for colour
REMOVAL_SECONDS = 1.0  # a rotated-away step's directory is gone this soon after it vanishes
LIST_PAUSE_S = 0.05  # between listings of a rotating run's steps that found none

# uint8 -> [0, 1]. A multiply, not a division: XLA turns x / 255 into x * (1 / 255) anyway, and
# host (NumPy) and device preprocessing must agree to the bit.
PIXEL_SCALE = np.float32(1 / 255)


@dataclasses.dataclass(frozen=True)
class Template:
    """What inference calls of the template that trained a model: the runtime imports none of
    its modules; the template's `api.py` hands its own parts to `use` as it is imported."""

    with_defaults: Callable[[dict[str, Any]], ml_collections.ConfigDict]  # a saved config, whole
    create_model: Callable[[ml_collections.ConfigDict, tuple[int, int, int], int], nnx.Module]
    compute_dtypes: tuple[str, ...]  # what --compute_dtype may name
    load_dataset: Callable[[ml_collections.ConfigDict, str | None], Any]  # its test set's Dataset
    evaluate: Callable[..., dict[str, Any]]  # (model, images, labels, config, mesh, batch_size)
    # The dataset (name, title, class_names, image_shape) of a checkpoint that records none:
    # one saved before checkpoints recorded their dataset.
    unrecorded_dataset: dict[str, Any]


_template: Template | None = None


def use(template: Template) -> None:
    """Make `template` the one inference rebuilds, loads and evaluates models with."""
    global _template
    _template = template


def template() -> Template:
    """The template `use` was given."""
    if _template is None:
        raise RuntimeError("no template: the template's api.py calls inference.use(...)")
    return _template


def as_hwc(shape: Sequence[int]) -> tuple[int, int, int]:
    """(H, W, C) of an image shape; (H, W), as checkpoints saved before colour, is grayscale."""
    shape = tuple(int(side) for side in shape)
    return shape if len(shape) == 3 else (*shape, 1)


def restore_model(
    workdir: str | os.PathLike,
    step: int | str | None = None,
    compute_dtype: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    flag: str = "--workdir",
    member: int | str | None = None,
    ema: bool = False,
    imports: bool = True,
) -> tuple[nnx.Module, int, ml_collections.ConfigDict, dict[str, Any]]:
    """Rebuild a workdir's model from its saved config and restore only its parameters.

    Returns the model, the step it was restored from, the config (with `compute_dtype`
    applied) and the dataset's info (name, title, class names, image shape). For an ensemble
    run, `member` picks what the model is (`ensemble.select_member`); `ema`: the model with
    its EMA as parameters (`ema.averaged`; `--ema`). On a `mesh` the
    parameters are read straight into the saved run's layout over it, whatever the device and
    process count of the run that saved them. `imports`: import the installed modules of the
    saved config.imports (`plugins.import_recorded`); False (--init_from) builds the model from
    what is imported already. Every problem is a one-line UserError, raised before anything
    compiles, naming the workdir as `flag`.
    """
    step = _step_number(step)
    path = pathlib.Path(workdir).expanduser()
    try:
        is_dir, exists, link = path.is_dir(), path.exists(), path.is_symlink()
    except OSError as exc:  # a name too long for the filesystem, a directory we may not enter
        raise UserError(
            f"{flag} {path} cannot be looked at ({exc.strerror}); pass the directory of a "
            "training run"
        ) from None
    if not is_dir:
        what = "is not a directory" if exists else "does not exist"
        if link and not exists:  # to nothing, or a loop
            what = errors.not_a_directory(path) or what
        raise UserError(f"{flag} {path} {what}; pass the directory of a training run")
    if not checkpoint_dir(path).is_dir():
        raise UserError(f"{flag} {path} has no checkpoints; train there first")
    checkpoints = open_reader(path)
    try:
        for attempt in range(READ_ATTEMPTS):  # a live run may rotate the chosen step away
            try:
                if step == BEST:
                    restored = _restore_best(checkpoints, compute_dtype, mesh, flag, imports)
                else:
                    restored = _restore_model(checkpoints, step, compute_dtype, mesh, flag, imports)
                chosen = ensemble.select_member(restored, member, checkpoints, flag)
                return _finite(_averaged(chosen, path, flag) if ema else chosen, path, flag)
            except StepVanished as gone:
                if step is not None or attempt == READ_ATTEMPTS - 1:
                    raise _vanished(checkpoints.directory / str(gone.step)) from None
                checkpoints.reload()
    finally:
        checkpoints.close()


def _step_number(step: Any) -> int | str | None:
    """`step` as restore_model takes it: None (the newest), 'best', or a saved step's number,
    an integer or a string of ASCII digits; anything else (10.0, True, -1) is one line."""
    if step is None or step == BEST:
        return step
    if isinstance(step, str) and errors.is_digits(step):
        return int(step)
    if isinstance(step, numbers.Integral) and not isinstance(step, bool) and step >= 0:
        return int(step)
    raise UserError(
        f"step={step!r} is not a step number: pass a whole number such as 10 (or '10'), "
        f"'{BEST}', or None for the newest"
    )


def _finite(restored: tuple, path: pathlib.Path, flag: str) -> tuple:
    """`restore_model`'s result, refused in one line if its parameters are not all finite: a
    run that diverged (or an edited checkpoint) gives no NaN model to evaluate or export."""
    model, step, _, info = restored
    if not parallel.all_finite(nnx.state(model, nnx.Param)):
        what = "EMA of the parameters" if info.get("ema") else "parameters"
        earlier = f"{flag}={path}:N" if flag == "--init_from" else "--step=N"
        raise UserError(
            f"{flag} {path}: the {what} of step {step} are not all finite; pass {earlier} of "
            "an earlier checkpoint, or train again with a lower --learning_rate"
        )
    return restored


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
            "damaged, left by an earlier version killed while removing it, or put there by "
            f"hand; move it out of {path.parent} (training in this workdir again moves it to "
            f"{DAMAGED_DIR}/ when an older step is intact)"
        )
    return UserError(
        f"checkpoint {path.name} in {path.parent} was removed while being read: the run "
        "training there rotated it away; read a kept step with --step, or wait for that run "
        "to end"
    )


def _restore_best(checkpoints: Checkpoints, compute_dtype, mesh, flag, imports) -> tuple:
    """The model of the best kept evaluated step that can be read; a damaged one is passed
    over with a warning (a reader moves nothing: the training run sets it aside)."""
    ranked = checkpoints.best_steps()
    for step in ranked:
        try:
            return _restore_model(checkpoints, step, compute_dtype, mesh, flag, imports)
        except UserError as exc:  # damaged: its config item, or its arrays
            refused = Unreadable | restore.ShapeMismatch | plugins.NotInstalled | errors.FileRefused
            if step == ranked[-1] or isinstance(exc, refused):
                raise
            if parallel.is_primary():
                errors.warning_line(f"{exc}; using the next best checkpoint")
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
    imports: bool,
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
    config = template().with_defaults(saved)
    where = f"checkpoint {chosen} in {checkpoints.directory}"
    pending = plugins.pending_imports(config.imports, where)
    if imports:
        plugins.import_recorded(pending, where, path)
    info = checkpoints.saved("dataset", chosen)[1] or template().unrecorded_dataset
    dtypes = template().compute_dtypes
    if compute_dtype is not None and compute_dtype not in dtypes:
        raise UserError(
            f"--compute_dtype={compute_dtype!r} is not supported; use one of {', '.join(dtypes)}"
        )
    config.compute_dtype = compute_dtype or config.compute_dtype
    shape = as_hwc(info["image_shape"])
    classes = len(info["class_names"])
    try:
        if config.compute_dtype not in dtypes:
            raise UserError(f"compute_dtype={config.compute_dtype!r} is not supported")
        model = template().create_model(config, shape, classes)
        ema_lib.attach(model, config.ema.decay)  # a place for the average it saved
    except UserError as exc:  # the saved config's, not a flag's
        said = str(exc).replace("--config.", "config.")
        if pending and not imports:
            raise UserError(
                f"{flag}={path}: {where} builds no model here ({said}) without the modules it "
                f"was trained with, config.imports {', '.join(pending)}; {flag} takes the "
                "parameters only, the run's code comes from its own config: add them to it, "
                f'--config.imports="{tuple(pending)!r}"'
            ) from None
        raise UserError(
            f"{where}: its saved config builds no model here ({said}); read another step with "
            "--step"
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
    evaluation kept by `config.keep_best`, by `config.best_metric`), ready for `predict`.

    Only parameters are read, no optimizer state; `compute_dtype` ('float32' or 'bfloat16')
    overrides the dtype it was trained in. `class_names(workdir)` names its outputs. Of an
    ensemble run: member K (an int), "best" (by test accuracy) or "ensemble" (the default).
    `ema=True`: the EMA of its parameters (a run trained with config.ema.decay > 0).
    """
    return restore_model(workdir, step, compute_dtype, member=member, ema=ema)[0]


def class_names(workdir: str | os.PathLike, step: int | None = None) -> tuple[str, ...]:
    """The class names of the dataset a workdir's model was trained on (its newest step whose
    config and dataset are intact, as `load_model` takes)."""
    directory = checkpoint_dir(workdir)
    steps = sorted(int(p.name) for p in directory.glob("*") if errors.is_digits(p.name))
    if not steps:
        raise UserError(f"--workdir {workdir} has no checkpoints; train there first")
    checkpoints = open_reader(workdir)
    try:
        info = checkpoints.saved("dataset", step)[1]
    finally:
        checkpoints.close()
    return tuple((info or template().unrecorded_dataset)["class_names"])


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
    asked = step
    model, step, config, info = restore_model(
        workdir, step, compute_dtype, mesh, member=member, ema=ema
    )
    dataset = template().load_dataset(config, data_dir)
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
    result = template().evaluate(
        model, dataset.test_images, dataset.test_labels, config, mesh, batch_size
    )
    names = info["class_names"]
    counts = confusion_matrix(dataset.test_labels, result["predictions"], len(names))
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
        source_line(workdir, step, asked, config, info),
        tables.evaluation_table({"test": metrics}).format(),
        tables.Table.of(
            "Confusion matrix (rows: true class, columns: predicted, by the rows' numbers)",
            ("", *(str(k) for k in range(len(names)))),
            [
                (f"{k} {tables.printable(name)}", *row)
                for k, (name, row) in enumerate(zip(names, counts, strict=True))
            ],
        ).format(),
        sep="\n",
    )
    if output:
        workdir_lib.write_json(pathlib.Path(output).expanduser(), report)
    return report


def source_line(
    workdir: str | os.PathLike,
    step: int,
    asked: int | str | None,
    config: ml_collections.ConfigDict,
    info: dict[str, Any],
) -> str:
    """The line eval and predict start with, naming what they read: 'checkpoint 400 of
    runs/w (float32):', with --step=best 'checkpoint 400 (best by test_accuracy) of ...', an
    ensemble's member and the EMA named too."""
    said = f"checkpoint {step}"
    if asked == BEST:
        said += f" (best by {best_metric(config)})"
    if "member" in info:
        said += f", member {info['member']}"
    if info.get("ema"):
        said += ", the EMA of its parameters"
    return f"{said} of {workdir} ({config.compute_dtype}):"


COUNT = "examples"  # the key of each batch's count of real examples among an evaluation's sums


def means(batch_sums: dict[str, np.ndarray], num_batches: int | None = None) -> dict[str, Any]:
    """Every metric's mean over the first `num_batches` of an evaluation (default all), and
    the example count: the codelab's whole batches are the first ones of the padded set."""
    totals = {name: np.asarray(s, np.float64)[:num_batches].sum() for name, s in batch_sums.items()}
    count = int(totals.pop(COUNT))
    return {
        **{name: total / count if count else float("nan") for name, total in totals.items()},
        COUNT: count,
    }


def confusion_matrix(labels: np.ndarray, predictions: np.ndarray, num_classes: int) -> np.ndarray:
    """counts[true, predicted] over every evaluated example."""
    counts = np.zeros((num_classes, num_classes), np.int64)
    np.add.at(counts, (np.asarray(labels), np.asarray(predictions)), 1)
    return counts


@nnx.jit
def _probabilities(model: nnx.Module, x: jax.Array) -> jax.Array:
    return jax.nn.softmax(model(x), axis=-1)


def model_input(images: Any, image_shape: tuple[int, int, int], name: str = "images") -> np.ndarray:
    """The one input rule of `predict` and of --mode=predict's .npy files and pictures:
    `images` as float32 (N, H, W, C) in [0, 1], or a one-line UserError that starts with `name`.

    Shapes: (H, W, C) is one image, (N, H, W, C) is N >= 1 images, and so is the flat
    (N, H * W * C); for grayscale (C = 1) also (H, W) and (N, H, W).
    Pixels: uint8 is 0..255 and is scaled by 1/255 (`PIXEL_SCALE`, as training does); any
    other integer dtype must hold only 0..255 and is scaled the same; floats (16, 32 or 64
    bits) must be finite and already in [0, 1], and are never rescaled (divide 0..255 floats
    by 255 first). bool, complex, string, object, structured and date/time arrays are refused.
    """
    h, w, c = (int(side) for side in image_shape)
    one = [(h, w, c), *([(h, w)] if c == 1 else [])]
    expected = "expected " + " or ".join(
        ([f"({h}, {w})", f"(N, {h}, {w})"] if c == 1 else [])
        + [f"({h}, {w}, {c})", f"(N, {h}, {w}, {c})", f"(N, {h * w * c})"]
    )
    try:
        array = np.asarray(images)
    except (ValueError, TypeError) as exc:
        reason = errors.reason(exc)
        raise UserError(f"{name}: cannot be made into one array ({reason}); {expected}") from None
    if array.dtype.kind == "V" and jnp.issubdtype(array.dtype, jnp.floating):
        array = array.astype(np.float32)  # bfloat16 and other ml_dtypes floats: exact in f32
    kind = array.dtype.kind
    if kind not in "uif":  # timedelta64 counts as an integer for np.issubdtype: go by kind
        raise UserError(
            f"{name}: pixels of dtype {array.dtype} cannot be used; pass uint8 (0..255), "
            "other integers in 0..255 or floats in [0, 1]"
        )
    if array.shape in one:
        array = array[None]
    if array.ndim < 2 or array.shape[1:] not in (*one, (h * w * c,)):
        raise UserError(f"{name}: array shape {array.shape}; {expected}")
    if len(array) == 0:
        raise UserError(f"{name}: no images in it (shape {array.shape}); {expected} with N >= 1")
    _check_range(array, name)
    x = array.astype(np.float32)
    if kind != "f":
        x = x * PIXEL_SCALE  # bit for bit what training feeds the model
    return x.reshape(len(x), h, w, c)


def _check_range(array: np.ndarray, name: str) -> None:
    """Floats must be finite and in [0, 1]; integers other than uint8 in 0..255."""
    if array.dtype.kind == "f":
        finite = np.isfinite(array)
        if not finite.all():
            bad = int(array.size - np.count_nonzero(finite))
            raise UserError(
                f"{name}: {bad} non-finite pixel value{'s' * (bad != 1)} (NaN or infinity); "
                "every pixel must be a number in [0, 1]"
            )
        low, high = array.min(), array.max()
        if low < 0 or high > 1:
            raise UserError(
                f"{name}: float pixels must lie in [0, 1] but these range over "
                f"[{low!s}, {high!s}]; divide 0..255 values by 255 first (or pass them as uint8)"
            )
    elif array.dtype != np.uint8:
        low, high = array.min(), array.max()
        if low < 0 or high > 255:
            raise UserError(
                f"{name}: integer pixels must lie in 0..255 but these range over "
                f"{low}..{high}; scale them to 0..255 (uint8) or to floats in [0, 1] first"
            )


def image_shape_of(model: nnx.Module, image_shape: tuple[int, ...] | None) -> tuple[int, ...]:
    """(H, W, C) of the images a model takes: the argument, or the model's own `image_shape`
    (the built-in models keep the one they were built for)."""
    shape = image_shape if image_shape is not None else getattr(model, "image_shape", None)
    if shape is None:
        raise UserError(
            f"predict: cannot tell the image shape {type(model).__name__} takes; pass "
            "image_shape=(H, W, C)"
        )
    return as_hwc(shape)


def predict(
    model: nnx.Module,
    images: Any,
    mesh: jax.sharding.Mesh | None = None,
    *,
    image_shape: tuple[int, ...] | None = None,
) -> np.ndarray:
    """Class probabilities (N, classes) for images shaped as `model_input` says: (N, H, W, C)
    or one (H, W, C), and for grayscale also (N, H, W) and (H, W).

    The same rule as --mode=predict (`model_input`): uint8 pixels (0..255) and other integers
    in 0..255 are scaled by 1/255; floats must be finite and already in [0, 1] (they are never
    rescaled: divide 0..255 floats by 255 first). Anything else is a one-line UserError: a
    wrong shape, no images, NaN or infinite pixels, values out of range, a non-numeric dtype.
    (H, W, C) is the model's `image_shape` (the built-in models keep it); pass `image_shape`
    for other models. On a mesh the images are padded to a multiple of its size and split
    along `data`.
    """
    x = model_input(images, image_shape_of(model, image_shape))
    if mesh is None:
        return np.asarray(_probabilities(model, jnp.asarray(x)))
    pad = -len(x) % parallel.data_size(mesh)
    x = np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)])
    sharded = parallel.shard_host_array(x, parallel.batch_sharding(mesh))
    return parallel.to_host(_probabilities(model, sharded))[: len(x) - pad]


def read_images(
    path: pathlib.Path, image_shape: tuple[int, int, int] = (28, 28, 1), held: int = 0
) -> tuple[list[tuple[str, np.ndarray]], list[str]]:
    """(name, (H, W, C) float32 in [0, 1]) for each image in a picture or a .npy file, and
    notes. The module docstring's rule decides what is accepted; anything else raises a
    one-line UserError that names the file. `held`: the bytes of the images read before, which
    a .npy's images must fit in the host's memory beside (`predict_bytes`)."""
    name = str(path)
    shape = tuple(int(side) for side in image_shape)
    if path.exists() and not path.is_file():  # reading a FIFO or a device could wait for ever
        raise UserError(f"{name}: not a regular file (a directory, a FIFO or a device)")
    if path.suffix.lower() == ".npy":
        array = _load_npy(path, name)
        _check_fits(array, name, held)
        images = model_input(array, shape, name)
        names = [name] if len(images) == 1 else [f"{name}[{i}]" for i in range(len(images))]
        return list(zip(names, images, strict=True)), []
    notes: list[str] = []
    pixels = _read_picture(path, name, notes, shape[2])
    height, width = pixels.shape[:2]
    x = model_input(pixels, (height, width, shape[2]), name)[0]
    if (height, width) != shape[:2]:
        notes.append(f"{name}: resized from {width}x{height} to {shape[1]}x{shape[0]}")
        channels = [
            np.asarray(Image.fromarray(x[..., c]).resize(shape[1::-1], Image.Resampling.BILINEAR))
            for c in range(shape[2])
        ]
        x = np.stack(channels, axis=-1).astype(np.float32).clip(0, 1)  # bilinear overshoots
    return [(name, x)], notes


def predict_bytes(pixels: int) -> int:
    """What classifying `pixels` pixels holds in the host's memory at most: PREDICT_COPIES
    copies of them as float32."""
    return PREDICT_COPIES * pixels * np.dtype(np.float32).itemsize


def _check_fits(array: np.ndarray, name: str, held: int) -> None:
    """Refuse, in one line naming the file, a (mapped, unread) array whose images cannot be
    classified in the host's memory besides `held` bytes: a MemoryError would come later."""
    needed = predict_bytes(array.size)
    host = memory.host_memory()
    if host is None or needed <= host.usable(held):
        return
    raise UserError(
        f"{name}: an array of shape {array.shape} ({array.size:,} pixels) needs about "
        f"{memory.size_text(needed)} to classify (its pixels as float32, {PREDICT_COPIES} "
        f"copies at once), but the host has {host}, of which "
        f"{memory.size_text(max(host.usable(held), 0))} is left for it; split its images "
        "into smaller files"
    )


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
                frames = getattr(image, "n_frames", 1)
                if frames > 1:  # an animation or a multi-page file: the first is decoded
                    notes.append(f"{name}: {frames} frames; only the first is classified")
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


# A mean pixel brighter than any Fashion-MNIST picture's: most likely the negative of what the
# model learnt (a dark object photographed on white).
BRIGHT = 0.75


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
    asked = step
    model, step, config, info = restore_model(
        workdir, step, compute_dtype, mesh, member=member, ema=ema
    )
    parallel.say(source_line(workdir, step, asked, config, info))
    names = info["class_names"]
    named = []
    failures = []
    for path in paths:
        try:
            held = predict_bytes(sum(image.size for _, image in named))
            images, notes = read_images(pathlib.Path(path), info["image_shape"], held)
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
        probabilities = predict(
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
        for name, image in named:
            if image.mean() > BRIGHT and parallel.is_primary():
                errors.warning_line(
                    f"{tables.printable(name)} is mostly bright (mean {image.mean():.2f}); the "
                    "model learnt light objects on a dark background, so its class above is "
                    "likely wrong: invert the picture (255 - pixels) and crop it to the object"
                )
    if output and parallel.is_primary():
        workdir_lib.write_json(
            pathlib.Path(output).expanduser(),
            {"step": step, "predictions": predictions, "errors": failures},
        )
    return predictions, failures
