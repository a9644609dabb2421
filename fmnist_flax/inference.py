"""Use a trained workdir: evaluate it on the full test set, or classify a user's images.

What --mode=predict (`read_images`) and the Python `predict(model, images)` accept is one rule,
`evaluate.model_input`, with the model's image size (H, W) (28x28 for Fashion-MNIST):

* .npy arrays and `predict`'s arrays are (H, W) for one image, or (N, H, W) or (N, H * W) for
  N >= 1 images.
* uint8 pixels are 0..255 and are scaled by 1/255, exactly as training scales them; other
  integer dtypes are accepted only when every value lies in 0..255, and are scaled the same.
* Float pixels must be finite and lie in [0, 1]; they are never rescaled, so 0..255 floats are
  refused with a line that says to divide them by 255 first.
* bool, complex, string, object, structured and date/time arrays are refused.
* Image files (PNG, JPEG, ... anything Pillow reads) must be at most MAX_IMAGE_SIDE pixels on
  each side, checked from the header before decoding, and not a decompression bomb. 8-bit
  grayscale is 0..255; colour, palette and alpha images are converted to grayscale and 16-bit
  grayscale is scaled by 1/65535, each with a note; another size is resized to (H, W), with a
  note; float (mode F) images follow the float rule.

A file that breaks the rule gets one error line naming it and the others are still classified.
"""

from __future__ import annotations

import os
import pathlib
import warnings
from collections.abc import Sequence
from typing import Any

import ml_collections
import numpy as np
from PIL import Image

from fmnist_flax import checkpoint, datasets, evaluate, input_pipeline, parallel, tables
from fmnist_flax import workdir as workdir_lib
from fmnist_flax.errors import UserError

MAX_IMAGE_SIDE = 4096  # larger image files are refused before they are decoded
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")  # grayscale, scaled by 1/65535


def run_eval(
    workdir: str | os.PathLike,
    *,
    step: int | str | None = None,
    compute_dtype: str | None = None,
    data_dir: str | None = None,
    output: str | None = None,
) -> dict[str, Any]:
    """Restore parameters only and evaluate the whole test set of the dataset the model was
    trained on, on every device; the results also go to `output` (JSON) when given, never into
    the workdir, which a training run may own. The batch is the training batch rounded up to a
    multiple of the device count."""
    workdir_lib.check_output_path(output)
    mesh = parallel.make_mesh()
    model, step, config, info = checkpoint.restore_model(workdir, step, compute_dtype, mesh)
    if "dataset" not in config:  # a checkpoint older than config.dataset
        config.dataset = ml_collections.ConfigDict({"name": info["name"]})
    dataset = datasets.load(config, data_dir)
    if list(dataset.image_shape) != list(info["image_shape"]):
        raise UserError(
            f"the test images are {dataset.image_shape} but the model was trained on "
            f"{tuple(info['image_shape'])}; pass the --data_dir it was trained with"
        )
    x = input_pipeline.prepare_images(dataset.test_images)
    ways = parallel.data_size(mesh)
    batch_size = -(-config.batch_size // ways) * ways
    batches = input_pipeline.padded_batches(x, dataset.test_labels, batch_size)
    result = evaluate.evaluate(model, *input_pipeline.shard_batches(batches, mesh))
    names = info["class_names"]
    counts = evaluate.confusion_matrix(dataset.test_labels, result["predictions"], len(names))
    report = {
        "step": step,
        "compute_dtype": config.compute_dtype,
        "test_accuracy": result["accuracy"],
        "test_loss": result["loss"],
        "test_examples": result["examples"],
        "dataset": info["name"],
        "class_names": list(names),
        "confusion_matrix": counts.tolist(),
    }
    if not parallel.is_primary():
        return report
    print(
        tables.evaluation_table(
            {f"test, checkpoint {step} ({config.compute_dtype})": result}
        ).format(),
        tables.Table.of(
            "Confusion matrix (rows: true class, columns: predicted)",
            ("", *(name[:7] for name in names)),
            [(name, *row) for name, row in zip(names, counts, strict=True)],
        ).format(),
        sep="\n",
    )
    if output:
        workdir_lib.write_json(pathlib.Path(output).expanduser(), report)
    return report


def read_images(
    path: pathlib.Path, image_shape: tuple[int, int] = (28, 28)
) -> tuple[list[tuple[str, np.ndarray]], list[str]]:
    """(name, HxW float32 in [0, 1]) for each image in an image file or a .npy file, and notes.

    The module docstring's rule decides what is accepted; anything else raises a one-line
    UserError that names the file.
    """
    name, shape = str(path), (int(image_shape[0]), int(image_shape[1]))
    if path.suffix.lower() == ".npy":
        images = evaluate.model_input(_load_npy(path, name), shape, name).reshape(-1, *shape)
        names = [name] if len(images) == 1 else [f"{name}[{i}]" for i in range(len(images))]
        return list(zip(names, images, strict=True)), []
    notes: list[str] = []
    pixels = _read_picture(path, name, notes)
    height, width = pixels.shape
    x = evaluate.model_input(pixels, (height, width), name).reshape(height, width)
    if (height, width) != shape:
        notes.append(f"{name}: resized from {width}x{height} to {shape[1]}x{shape[0]}")
        resized = Image.fromarray(x).resize(shape[::-1], Image.Resampling.BILINEAR)
        x = np.asarray(resized, np.float32).clip(0, 1)  # bilinear can overshoot by an ulp
    return [(name, x)], notes


def _load_npy(path: pathlib.Path, name: str) -> np.ndarray:
    """A .npy file's array, mapped rather than read, so a header that promises more data than
    the file holds is refused before any memory is spent."""
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except Exception as exc:  # NumPy's header parser also raises tokenize.TokenError & co.
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{name}: cannot read it as a .npy array ({reason})") from None
    if not isinstance(array, np.ndarray):  # np.load opens a zip as an .npz archive
        array.close()
        raise UserError(
            f"{name}: is an .npz archive, not a .npy array; save one array with np.save"
        )
    return array


def _read_picture(path: pathlib.Path, name: str, notes: list[str]) -> np.ndarray:
    """An image file's pixels at its own size: uint8 grayscale, or float32 in [0, 1] for
    16-bit grayscale, or float32 as stored for mode F. Size limits are checked from the
    header, before anything is decoded."""
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
                if mode not in ("L", "F", *SIXTEEN_BIT_MODES):
                    image = image.convert("L")
                pixels = np.asarray(image)
    except UserError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise UserError(f"{name}: refused as a possible decompression bomb ({exc})") from None
    except Exception as exc:  # Pillow raises many types for malformed files; each is the file's
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{name}: cannot read it as an image ({reason})") from None
    if mode in SIXTEEN_BIT_MODES:
        low, high = int(pixels.min()), int(pixels.max())
        if low < 0 or high > 65535:
            raise UserError(
                f"{name}: {mode} pixels range over {low}..{high}, outside the 0..65535 of a "
                "16-bit image; save it as 8- or 16-bit grayscale"
            )
        notes.append(f"{name}: 16-bit grayscale ({mode}) scaled by 1/65535 to [0, 1]")
        return pixels.astype(np.float32) / np.float32(65535)
    if mode not in ("L", "F"):
        notes.append(f"{name}: converted from {mode} to grayscale")
    return pixels


def run_predict(
    workdir: str | os.PathLike,
    paths: Sequence[str],
    *,
    step: int | str | None = None,
    compute_dtype: str | None = None,
    output: str | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Classify each image; unreadable ones get one line each and the rest are still classified.

    Returns the predictions and the error lines.
    """
    if not paths:
        raise UserError("--mode=predict needs --images=a.png,b.npy,...")
    workdir_lib.check_output_path(output)
    mesh = parallel.make_mesh()
    model, _, _, info = checkpoint.restore_model(workdir, step, compute_dtype, mesh)
    names = info["class_names"]
    named, errors = [], []
    for path in paths:
        try:
            images, notes = read_images(pathlib.Path(path), tuple(info["image_shape"]))
        except UserError as exc:
            errors.append(str(exc))
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
            parallel.say(f"{name}: {names[best]} ({100 * probs[best]:.1f}%)")
    if output and parallel.is_primary():
        workdir_lib.write_json(
            pathlib.Path(output).expanduser(), {"predictions": predictions, "errors": errors}
        )
    return predictions, errors
