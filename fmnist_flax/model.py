"""The models as Flax NNX modules (the codelab's MLP, section 5), each checking its own fields.

A model's `__init__` takes its config fields, then keyword-only `image_shape` (H, W, C) and
`num_classes` (both from the dataset), `compute_dtype` and `rngs`; `__call__` maps
(B, H, W, C) float32 pixels in [0, 1] to (B, num_classes) float32 logits. An optional
`check_config(fields, image_shape)` classmethod refuses bad values with one line before
anything is built. Parameters may carry logical axis names (`nnx.with_partitioning`, or a
layer's `kernel_metadata={"out_sharding": ...}`): `config.mesh.rules` maps them to mesh axes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from fmnist_flax.runtime import model_build
from fmnist_flax.runtime.errors import UserError
from fmnist_flax.runtime.registry import Registry

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# He-normal as in the codelab: normal(0, 1) * sqrt(2 / fan_in); "normal" is untruncated.
he_normal = jax.nn.initializers.variance_scaling(2.0, "fan_in", "normal")

# The logical axis names of the MLP's and CNN's parameters (config.mesh.rules maps them to mesh
# axes). Their layers alternate between splitting their outputs (`mlp`) and their inputs, as
# Megatron's column- and row-parallel pairs do, so no weight names one mesh axis twice.
EMBED, HIDDEN, CLASSES = "embed", "mlp", "classes"


def layer_axes(count: int) -> list[tuple[str, str]]:
    """(input, output) logical names of a chain of `count` layers ending in the classifier:
    outputs alternate `mlp`, `embed`, ...; each input is the previous layer's output."""
    outputs = [HIDDEN if i % 2 == 0 else EMBED for i in range(count - 1)] + [CLASSES]
    return list(zip([EMBED, *outputs[:-1]], outputs, strict=True))


def annotated(*names: str | None) -> dict[str, Any]:
    """A layer's `kernel_metadata`/`bias_metadata`: one logical axis name per dimension, not
    applied when built (Flax's eager sharding would need a mesh there), so the model builds
    anywhere; `parallel.place` lays it out on the run's mesh."""
    return {"out_sharding": names, "eager_sharding": False}


def _check_widths(field: str, widths: Any) -> None:
    if (
        not isinstance(widths, Sequence)
        or not widths
        or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths)
    ):
        raise UserError(
            f"--config.model.{field}={widths!r} must be a tuple of positive widths, "
            "e.g. '(256, 128)'"
        )


class MLP(nnx.Module):
    """flattened pixels -> hidden... -> classes with GELU; float32 params, math in
    `compute_dtype`, float32 logits."""

    def __init__(
        self,
        hidden: Sequence[int] = (256, 128),
        *,
        image_shape: tuple[int, int, int] = (28, 28, 1),
        num_classes: int = 10,
        compute_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.compute_dtype = compute_dtype
        self.image_shape = tuple(image_shape)
        sizes = (math.prod(image_shape), *hidden, num_classes)
        axes = layer_axes(len(sizes) - 1)
        # Linear's `dtype` casts inputs, kernel and bias to the compute dtype, as the codelab does.
        self.layers = nnx.List(
            nnx.Linear(
                fan_in,
                fan_out,
                dtype=compute_dtype,
                param_dtype=jnp.float32,
                kernel_init=he_normal,
                bias_init=nnx.initializers.zeros,
                kernel_metadata=annotated(name_in, name_out),
                bias_metadata=annotated(name_out),
                rngs=rngs,
            )
            for (fan_in, fan_out), (name_in, name_out) in zip(
                itertools.pairwise(sizes), axes, strict=True
            )
        )

    @classmethod
    def check_config(cls, fields: dict[str, Any], image_shape: tuple[int, int, int]) -> None:
        _check_widths("hidden", fields.get("hidden", (256,)))

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0], -1).astype(self.compute_dtype)
        for layer in self.layers[:-1]:
            x = nnx.gelu(layer(x))
        return self.layers[-1](x).astype(jnp.float32)


class CNN(nnx.Module):
    """A small conv net: [3x3 conv, BatchNorm, GELU, 2x2 max-pool] x len(features), dropout,
    a dense layer and the classifier head. Same dtype policy as the MLP; call `.train()` and
    `.eval()` to switch dropout and BatchNorm between training and inference."""

    def __init__(
        self,
        features: Sequence[int] = (32, 64),
        dense: int = 256,
        dropout: float = 0.25,
        *,
        image_shape: tuple[int, int, int] = (28, 28, 1),
        num_classes: int = 10,
        compute_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.compute_dtype = compute_dtype
        self.image_shape = tuple(image_shape)
        channels = (image_shape[2], *features)
        *conv_axes, dense_axes, head_axes = layer_axes(len(features) + 2)
        self.convs = nnx.List(
            nnx.Conv(
                c_in,
                c_out,
                (3, 3),
                dtype=compute_dtype,
                kernel_metadata=annotated(None, None, name_in, name_out),
                bias_metadata=annotated(name_out),
                rngs=rngs,
            )
            for (c_in, c_out), (name_in, name_out) in zip(
                itertools.pairwise(channels), conv_axes, strict=True
            )
        )
        self.norms = nnx.List(
            nnx.BatchNorm(
                c,
                dtype=compute_dtype,
                scale_metadata=annotated(name_out),
                bias_metadata=annotated(name_out),
                rngs=rngs,
            )
            for c, (_, name_out) in zip(features, conv_axes, strict=True)
        )
        height, width = (side // 2 ** len(features) for side in image_shape[:2])
        self.dense = nnx.Linear(
            height * width * features[-1],
            dense,
            dtype=compute_dtype,
            kernel_metadata=annotated(*dense_axes),
            bias_metadata=annotated(dense_axes[1]),
            rngs=rngs,
        )
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.head = nnx.Linear(
            dense,
            num_classes,
            dtype=compute_dtype,
            kernel_metadata=annotated(*head_axes),
            bias_metadata=annotated(head_axes[1]),
            rngs=rngs,
        )

    @classmethod
    def check_config(cls, fields: dict[str, Any], image_shape: tuple[int, int, int]) -> None:
        features = fields.get("features", (32,))
        _check_widths("features", features)
        height, width = image_shape[:2]
        if 2 ** len(features) > min(height, width):
            raise UserError(
                f"--config.model.features={features!r}: each conv block halves the image's "
                f"height and width, and {len(features)} blocks leave nothing of {height}x{width}"
            )
        dense = fields.get("dense", 1)
        if isinstance(dense, bool) or not isinstance(dense, int) or dense < 1:
            raise UserError(f"--config.model.dense={dense!r} must be a positive width")
        if not 0 <= fields.get("dropout", 0) < 1:
            raise UserError(f"--config.model.dropout={fields['dropout']!r} must be in [0, 1)")

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.compute_dtype)  # NHWC
        for conv, norm in zip(self.convs, self.norms, strict=True):
            x = nnx.max_pool(nnx.gelu(norm(conv(x))), (2, 2), strides=(2, 2))
        x = self.dropout(nnx.gelu(self.dense(x.reshape(x.shape[0], -1))))
        return self.head(x).astype(jnp.float32)


# config.model.name -> class; add new models here, or from a module of config.imports
MODELS = Registry("model", {"mlp": MLP, "cnn": CNN})
BUILT_IN_ARGS = ("image_shape", "num_classes", "compute_dtype", "rngs")  # not config fields


def check_config(config: ml_collections.ConfigDict, image_shape: tuple[int, int, int]) -> None:
    """Refuse a model name MODELS lacks (for this run's config.imports), a field its class
    does not take or a value it refuses (`model_build.check_config`): one line, before
    anything builds."""
    model_build.check_config(MODELS, config, image_shape, BUILT_IN_ARGS)


def create_model(
    config: ml_collections.ConfigDict,
    image_shape: tuple[int, int, int],
    num_classes: int,
    seed: int | None = None,
) -> nnx.Module:
    """The model (or ensemble) `config.model` names, initialised from `seed` (default
    `config.seed`), its arrays not yet laid out on a mesh (`model_build.create_model`)."""
    check_config(config, image_shape)
    models = MODELS.active(config.imports)
    static = model_build.static_args(models, COMPUTE_DTYPES, config, image_shape, num_classes)
    return model_build.create_model(static, config, seed)


def abstract_model(
    config: ml_collections.ConfigDict, image_shape: tuple[int, int, int], num_classes: int
) -> nnx.Module:
    """One model of the config as shapes and dtypes only; `experiment.member_bytes` sizes runs
    by it."""
    models = MODELS.active(config.imports)
    static = model_build.static_args(models, COMPUTE_DTYPES, config, image_shape, num_classes)
    return model_build.abstract_model(static)
