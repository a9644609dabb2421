"""Use a trained workdir: evaluate it on the full test set, or classify a user's images."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence
from typing import Any

import ml_collections
import numpy as np
from PIL import Image, UnidentifiedImageError

from fmnist_flax import checkpoint, datasets, evaluate, input_pipeline, parallel, tables
from fmnist_flax import workdir as workdir_lib
from fmnist_flax.errors import UserError

EVAL_FILE = "eval.json"


def run_eval(
    workdir: str | os.PathLike,
    *,
    step: int | None = None,
    compute_dtype: str | None = None,
    data_dir: str | None = None,
) -> dict[str, Any]:
    """Restore parameters only and evaluate the whole test set of the dataset the model was
    trained on, on every device; writes eval.json. The batch is the training batch rounded up
    to a multiple of the device count."""
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
    workdir_lib.write_json(pathlib.Path(workdir).expanduser() / EVAL_FILE, report)
    return report


def read_images(
    path: pathlib.Path, image_shape: tuple[int, int] = (28, 28)
) -> tuple[list[tuple[str, np.ndarray]], list[str]]:
    """(name, HxW float32 in [0, 1]) for each image in a PNG/JPEG or .npy file, and notes.

    PNGs of another size are resized and colour ones converted to grayscale, with a note;
    .npy arrays must be (H, W) or (N, H, W). Raises UserError when the file can't be used.
    """
    name, notes, shape = str(path), [], tuple(image_shape)
    h, w = shape
    if path.suffix.lower() == ".npy":
        try:
            array = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise UserError(f"{name}: cannot read it as a .npy array ({exc})") from None
        if array.shape == shape:
            array = array[None]
        if array.ndim != 3 or array.shape[1:] != shape:
            raise UserError(
                f"{name}: array shape {array.shape}; expected ({h}, {w}) or (N, {h}, {w})"
            )
        if not np.issubdtype(array.dtype, np.number):
            raise UserError(f"{name}: array dtype {array.dtype} is not numeric")
        scale = 255.0 if array.dtype == np.uint8 or array.max() > 1 else 1.0
        images = (array.astype(np.float32) / scale).clip(0, 1)
        names = [name] if len(images) == 1 else [f"{name}[{i}]" for i in range(len(images))]
        return list(zip(names, images, strict=True)), notes
    try:
        with Image.open(path) as image:
            if image.mode != "L":
                notes.append(f"{name}: converted from {image.mode} to grayscale")
                image = image.convert("L")
            if image.size != (w, h):
                notes.append(f"{name}: resized from {image.size[0]}x{image.size[1]} to {w}x{h}")
                image = image.resize((w, h), Image.Resampling.BILINEAR)
            pixels = np.asarray(image, np.float32) / 255.0
    except (OSError, UnidentifiedImageError) as exc:
        raise UserError(f"{name}: cannot read it as an image ({exc})") from None
    return [(name, pixels)], notes


def run_predict(
    workdir: str | os.PathLike,
    paths: Sequence[str],
    *,
    step: int | None = None,
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
        probabilities = evaluate.predict(model, np.stack([image for _, image in named]), mesh)
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
