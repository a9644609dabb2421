"""A test-only model whose blocks are one `nnx.scan` over stacked layers, each `nnx.remat`:
the layout of large models, which must train, resume, evaluate, predict and export. Tests
register it as docs/extending.md "Add a model" says: `MODELS["scanned"] = ScannedMLP`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx


class Block(nnx.Module):
    """One residual dense block: x + gelu(dense(x))."""

    def __init__(self, width: int, compute_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.dense = nnx.Linear(width, width, dtype=compute_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + nnx.gelu(self.dense(x))


class ScannedMLP(nnx.Module):
    """pixels -> width -> `depth` scanned, rematerialised blocks -> classes."""

    def __init__(
        self, width=32, depth=3, *, image_shape, num_classes, compute_dtype=jnp.float32, rngs
    ):
        self.compute_dtype, self.image_shape = compute_dtype, tuple(image_shape)
        self.stem = nnx.Linear(math.prod(image_shape), width, dtype=compute_dtype, rngs=rngs)

        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs: nnx.Rngs) -> Block:
            return Block(width, compute_dtype, rngs)

        self.blocks = blocks(rngs)
        self.head = nnx.Linear(width, num_classes, dtype=compute_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.stem(x.reshape(x.shape[0], -1).astype(self.compute_dtype))

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def through(x: jax.Array, block: Block) -> jax.Array:
            return block(x)

        return self.head(through(x, self.blocks)).astype(jnp.float32)


def config(base: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """`base` with the model set to a small ScannedMLP, registered as "scanned"."""
    base.model = ml_collections.ConfigDict({"name": "scanned", "width": 32, "depth": 3})
    return base
