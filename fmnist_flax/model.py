"""The codelab's MLP as a Flax NNX module (section 5)."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from fmnist_flax.data import INPUT_DIM, NUM_CLASSES

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


def create_model(config: ml_collections.ConfigDict, seed: int | None = None) -> MLP:
    """Build the MLP a config describes, initialised from `seed` (default: `config.seed`).

    The initialisation is compiled as one program: eagerly, each random op would compile on
    its own, which costs over a second at start-up.
    """
    return _build(
        tuple(config.model.hidden),
        config.compute_dtype,
        jnp.asarray(config.seed if seed is None else seed, jnp.uint32),
    )


@functools.partial(nnx.jit, static_argnums=(0, 1))
def _build(hidden: tuple[int, ...], compute_dtype: str, seed: jax.Array) -> MLP:
    rngs = nnx.Rngs(params=jax.random.key(seed))
    return MLP(hidden, compute_dtype=COMPUTE_DTYPES[compute_dtype], rngs=rngs)


def count_params(model: nnx.Module) -> int:
    """Total number of trainable scalars (235,146 for the codelab's MLP)."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
