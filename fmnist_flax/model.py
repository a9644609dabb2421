"""The codelab's MLP as a Flax NNX module (section 5)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from fmnist_flax.data import IMAGE_SHAPE, INPUT_DIM, NUM_CLASSES
from fmnist_flax.errors import UserError

COMPUTE_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}

# He-normal as in the codelab: normal(0, 1) * sqrt(2 / fan_in); "normal" is untruncated.
he_normal = jax.nn.initializers.variance_scaling(2.0, "fan_in", "normal")


class MLP(nnx.Module):
    """784 -> hidden... -> 10 with GELU; float32 params, math in `compute_dtype`, float32 logits."""

    def __init__(
        self,
        hidden: Sequence[int] = (256, 128),
        *,
        compute_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.compute_dtype = compute_dtype
        sizes = (INPUT_DIM, *hidden, NUM_CLASSES)
        # Linear's `dtype` casts inputs, kernel and bias to the compute dtype, as the codelab does.
        self.layers = nnx.List(
            nnx.Linear(
                fan_in,
                fan_out,
                dtype=compute_dtype,
                param_dtype=jnp.float32,
                kernel_init=he_normal,
                bias_init=nnx.initializers.zeros,
                rngs=rngs,
            )
            for fan_in, fan_out in itertools.pairwise(sizes)
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.compute_dtype)
        for layer in self.layers[:-1]:
            x = nnx.gelu(layer(x))
        return self.layers[-1](x).astype(jnp.float32)


class CNN(nnx.Module):
    """A small conv net: [3x3 conv, BatchNorm, GELU, 2x2 max-pool] x len(features), dropout,
    a dense layer and the 10-way head. Same dtype policy as the MLP; call `.train()` and
    `.eval()` to switch dropout and BatchNorm between training and inference."""

    def __init__(
        self,
        features: Sequence[int] = (32, 64),
        dense: int = 256,
        dropout: float = 0.25,
        *,
        compute_dtype: jnp.dtype = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.compute_dtype = compute_dtype
        channels = (1, *features)
        self.convs = nnx.List(
            nnx.Conv(c_in, c_out, (3, 3), dtype=compute_dtype, rngs=rngs)
            for c_in, c_out in itertools.pairwise(channels)
        )
        self.norms = nnx.List(nnx.BatchNorm(c, dtype=compute_dtype, rngs=rngs) for c in features)
        side = IMAGE_SHAPE[0] // 2 ** len(features)
        self.dense = nnx.Linear(side * side * features[-1], dense, dtype=compute_dtype, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.head = nnx.Linear(dense, NUM_CLASSES, dtype=compute_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(len(x), *IMAGE_SHAPE, 1).astype(self.compute_dtype)  # (B, 784) -> NHWC
        for conv, norm in zip(self.convs, self.norms, strict=True):
            x = nnx.max_pool(nnx.gelu(norm(conv(x))), (2, 2), strides=(2, 2))
        x = self.dropout(nnx.gelu(self.dense(x.reshape(len(x), -1))))
        return self.head(x).astype(jnp.float32)


MODELS = {"mlp": MLP, "cnn": CNN}  # config.model.name -> class; add new models here


def create_model(config: ml_collections.ConfigDict, seed: int | None = None) -> nnx.Module:
    """Build the model a config describes (`config.model.name` and its other fields are the
    constructor's arguments), initialised from `seed` (default: `config.seed`).

    The initialisation is compiled as one program: eagerly, each random op would compile on
    its own, which costs over a second at start-up.
    """
    fields = config.model.to_dict()
    name = fields.pop("name", "mlp")
    if name not in MODELS:
        raise UserError(f"--config.model.name={name!r} is not one of {', '.join(MODELS)}")
    kwargs = tuple((k, tuple(v) if isinstance(v, list | tuple) else v) for k, v in fields.items())
    seed = config.seed if seed is None else seed
    return _build(name, kwargs, config.compute_dtype, jnp.asarray(seed, jnp.uint32))


@functools.partial(nnx.jit, static_argnums=(0, 1, 2))
def _build(name: str, kwargs: tuple, compute_dtype: str, seed: jax.Array) -> nnx.Module:
    key = jax.random.key(seed)
    rngs = nnx.Rngs(params=key, dropout=jax.random.fold_in(key, 1))
    return MODELS[name](**dict(kwargs), compute_dtype=COMPUTE_DTYPES[compute_dtype], rngs=rngs)


def count_params(model: nnx.Module) -> int:
    """Total number of trainable scalars (235,146 for the codelab's MLP)."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
