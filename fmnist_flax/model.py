"""The models as Flax NNX modules (the codelab's MLP, section 5), each checking its own fields.

A model's `__init__` takes its config fields, then keyword-only `image_shape` (H, W, C) and
`num_classes` (both from the dataset), `compute_dtype` and `rngs`; `__call__` maps
(B, H, W, C) float32 pixels in [0, 1] to (B, num_classes) float32 logits. An optional
`check_config(fields, image_shape)` classmethod refuses bad values with one line before
anything is built. Parameters may carry logical axis names (`nnx.with_partitioning`, or a
layer's `kernel_metadata={"out_sharding": ...}`): `config.mesh.rules` maps them to mesh axes.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from fmnist_flax.runtime import errors, parallel
from fmnist_flax.runtime.ensemble import Ensemble, stack
from fmnist_flax.runtime.errors import UserError

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


MODELS = {"mlp": MLP, "cnn": CNN}  # config.model.name -> class; add new models here
BUILT_IN_ARGS = ("image_shape", "num_classes", "compute_dtype", "rngs")  # not config fields


def check_config(
    model_config: ml_collections.ConfigDict, image_shape: tuple[int, int, int]
) -> None:
    """Refuse an unknown model name, a field its constructor does not take, or (through the
    model's own `check_config`) a value it cannot use: one line each, before anything builds."""
    fields = model_config.to_dict()
    name = fields.pop("name", "mlp")
    if name not in MODELS:
        raise UserError(f"--config.model.name={name!r} is not one of {', '.join(MODELS)}")
    cls = MODELS[name]
    parameters = inspect.signature(cls.__init__).parameters
    takes = [p for p in parameters if p not in ("self", *BUILT_IN_ARGS)]
    for field in fields:
        if field not in takes:
            raise UserError(
                f"--config.model.{field}: model {name!r} takes no field {field!r}; its fields "
                f"are {', '.join(takes) or 'none'}"
            )
    if hasattr(cls, "check_config"):
        cls.check_config(fields, tuple(image_shape))


def create_model(
    config: ml_collections.ConfigDict,
    image_shape: tuple[int, int, int],
    num_classes: int,
    seed: int | None = None,
) -> nnx.Module:
    """Build the model a config describes (`config.model.name` and its other fields are the
    constructor's arguments) for the dataset's image shape and classes, initialised from
    `seed` (default: `config.seed`). Its arrays are not yet laid out on a mesh (annotated ones
    included: `parallel.place_module` does that, by `config.mesh.rules`).

    The initialisation is compiled as one program: eagerly, each random op would compile on
    its own, which costs over a second at start-up.
    """
    check_config(config.model, image_shape)
    seed = config.seed if seed is None else seed
    static = static_args(config, image_shape, num_classes)
    size = config.ensemble.size
    try:
        if size == 1:
            return _build(*static, np.uint32(seed))  # a NumPy scalar: no eager conversion
        members = [_build(*static, np.uint32(seed + k)) for k in range(size)]
        return Ensemble(stack(members), size)
    except (TypeError, ValueError) as exc:  # a model without its own check_config
        message = errors.reason(exc)
        raise UserError(
            f"model {static[0]!r} cannot be built from --config.model: {message}"
        ) from None


def static_args(
    config: ml_collections.ConfigDict, image_shape: tuple[int, int, int], num_classes: int
) -> tuple[str, tuple, tuple, str, tuple]:
    """What the init program is compiled for (hashable): the model's name, its fields, the
    data's shape and classes, the compute dtype, the logical axis rules."""
    fields = config.model.to_dict()
    name = fields.pop("name", "mlp")
    kwargs = tuple((k, tuple(v) if isinstance(v, list | tuple) else v) for k, v in fields.items())
    rules = parallel.check_rules(config.mesh.rules)
    return name, kwargs, (tuple(image_shape), int(num_classes)), config.compute_dtype, rules


# The initialisation runs once, so LLVM's lighter optimisation is enough: its compile takes
# about half the time, with the same values to the bit (a test checks).
INIT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1}


def _construct(
    name: str, kwargs: tuple, shape: tuple, compute_dtype: str, rules: tuple, seed: jax.Array
) -> nnx.Module:
    """The model, its annotated Variables unplaced (no mesh is needed to build one: Flax's
    eager sharding is off) and carrying `rules` as their `sharding_rules`, which
    `parallel.place` reads."""
    key = jax.random.key(seed)
    rngs = nnx.Rngs(params=key, dropout=jax.random.fold_in(key, 1))
    image_shape, num_classes = shape
    with nnx.use_eager_sharding(False):
        model = MODELS[name](
            **dict(kwargs),
            image_shape=image_shape,
            num_classes=num_classes,
            compute_dtype=COMPUTE_DTYPES[compute_dtype],
            rngs=rngs,
        )
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable) and node.get_metadata("out_sharding", None):
            node.set_metadata("sharding_rules", rules)
    return model


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4), compiler_options=INIT_COMPILER_OPTIONS)
def _initial_state(*args) -> nnx.State:
    return nnx.state(_construct(*args))


def _build(*args) -> nnx.Module:
    """The model `_construct(*args)` makes, its arrays computed by one compiled program."""
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: _construct(*args)))
    return nnx.merge(graphdef, _initial_state(*args))


def abstract_model(
    config: ml_collections.ConfigDict, image_shape: tuple[int, int, int], num_classes: int
) -> nnx.Module:
    """One model of the config (not an ensemble) as shapes and dtypes only (`nnx.eval_shape`):
    what it would hold, with nothing allocated; `experiment.member_bytes` sizes runs by it."""
    static = static_args(config, image_shape, num_classes)
    return nnx.eval_shape(lambda: _construct(*static, jnp.uint32(0)))
