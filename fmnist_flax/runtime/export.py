"""--mode=export: a trained model as one serialized `jax.export` artifact that needs only JAX.

The artifact maps uint8 images (batch, H, W, C), any batch size, to float32 class
probabilities (batch, classes), for CPU and CUDA. It holds the parameters as constants and does what
`predict` does to uint8 input (scale by 1/255, the model in eval mode, softmax), so

    exported = jax.export.deserialize(open(FILE, "rb").read())
    probabilities = exported.call(images)

gives `predict`'s probabilities with no Flax, Orbax or project code (JAX reads the file with
the `flatbuffers` package). `FILE.json` beside it names the classes, the input and output
contract and the checkpoint it came from.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from . import inference, parallel
from . import workdir as workdir_lib
from .errors import UserError

PLATFORMS = ("cpu", "cuda")  # lowered for both on any machine: no GPU is needed to export
METADATA_SUFFIX = ".json"  # the metadata is FILE + this, so it never replaces FILE itself


def probabilities_fn(model: nnx.Module) -> Callable[[jax.Array], jax.Array]:
    """A pure function uint8 (batch, H, W, C) -> float32 (batch, classes) probabilities that
    closes over the model's arrays, so exporting it bakes the parameters in as constants.

    It closes over plain arrays and rebuilds the model's Variables inside the trace: a
    transform inside the model (`nnx.scan` over its blocks) refuses Variables made outside.
    """
    graphdef, state = nnx.split(model)
    arrays, structure = jax.tree.flatten(state)

    def probabilities(images: jax.Array) -> jax.Array:
        x = images.astype(jnp.float32) * inference.PIXEL_SCALE
        rebuilt = nnx.merge(graphdef, jax.tree.unflatten(structure, arrays))
        return jax.nn.softmax(rebuilt(x), axis=-1)

    return probabilities


def export_probabilities(
    model: nnx.Module, image_shape: tuple[int, int, int]
) -> jax.export.Exported:
    """`model` (in eval mode) exported for PLATFORMS on uint8 images with a symbolic batch."""
    height, width, channels = (int(side) for side in image_shape)
    shape = jax.export.symbolic_shape(f"batch, {height}, {width}, {channels}")
    images = jax.ShapeDtypeStruct(shape, jnp.uint8)
    return jax.export.export(jax.jit(probabilities_fn(model)), platforms=PLATFORMS)(images)


def export_model(
    workdir: str | os.PathLike,
    output: str | os.PathLike | None,
    *,
    step: int | str | None = None,
    compute_dtype: str | None = None,
    member: int | str | None = None,
    ema: bool = False,
) -> dict[str, Any]:
    """Write a workdir's model (parameters only) to `output` as a serialized `jax.export`
    artifact and its metadata to `output` + METADATA_SUFFIX, both atomically; return the
    metadata. `output` is checked before anything is restored; `ema`: the run's EMA of its
    parameters instead (`--ema`)."""
    if not output:
        raise UserError("--mode=export needs --output=FILE, the artifact to write")
    path = pathlib.Path(output).expanduser()
    meta_path = path.with_name(path.name + METADATA_SUFFIX)
    workdir_lib.check_output_path(str(output))
    workdir_lib.check_output_path(str(meta_path))
    model, step, config, info = inference.restore_model(
        workdir, step, compute_dtype, member=member, ema=ema
    )
    image_shape = [int(side) for side in info["image_shape"]]
    exported = export_probabilities(model, tuple(image_shape))
    names = list(info["class_names"])
    metadata = {
        "format": "jax.export",
        "artifact": path.name,
        "platforms": list(exported.platforms),
        "class_names": names,
        "input": {
            "dtype": "uint8",
            "shape": [None, *image_shape],
            "range": [0, 255],
            "meaning": "images (batch, height, width, channels), any batch size; scaled by "
            "1/255 inside the artifact",
        },
        "output": {
            "dtype": "float32",
            "shape": [None, len(names)],
            "meaning": "class probabilities (softmax), in the order of class_names",
        },
        "source": {
            "workdir": str(pathlib.Path(workdir).expanduser().absolute()),
            "step": step,
            **({"member": info["member"]} if "member" in info else {}),
            **({"ema": True} if ema else {}),
            "dataset": info["name"],
            "model": config.model.get("name", "mlp"),
        },
        "compute_dtype": config.compute_dtype,
        "jax_version": jax.__version__,
        "calling_convention_version": exported.calling_convention_version,
    }
    if parallel.is_primary():
        try:
            workdir_lib.write_atomically(path, bytes(exported.serialize()))
        except OSError as exc:
            raise UserError(
                f"cannot write {path} ({workdir_lib.disk_problem(path, exc)})"
            ) from None
        workdir_lib.write_json(meta_path, metadata)
    return metadata
