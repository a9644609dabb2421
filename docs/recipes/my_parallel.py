"""A patch model whose weights name their axes: config.mesh.rules splits them over devices."""

import jax
import jax.numpy as jnp
from flax import nnx

from fmnist_flax import model

PATCH = 7  # 28x28 images: 16 patches of 7x7 pixels


class Patches(nnx.Module):
    """Patches embedded, one MLP block with a residual, every patch's features to the classes."""

    def __init__(self, embed=64, mlp=128, *, image_shape, num_classes, compute_dtype, rngs):
        self.compute_dtype, self.image_shape = compute_dtype, tuple(image_shape)

        def dense(fan_in, fan_out, axes):
            kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), axes)
            bias = nnx.with_partitioning(nnx.initializers.zeros, axes[1:])
            return nnx.Linear(
                fan_in, fan_out, kernel_init=kernel, bias_init=bias, dtype=compute_dtype, rngs=rngs
            )

        self.embed = dense(PATCH * PATCH * image_shape[2], embed, ("patch", "embed"))
        self.up = dense(embed, mlp, ("embed", "mlp"))
        self.down = dense(mlp, embed, ("mlp", "embed"))
        patches = (image_shape[0] // PATCH) * (image_shape[1] // PATCH)
        self.head = dense(patches * embed, num_classes, ("embed", "classes"))

    def __call__(self, x: jax.Array) -> jax.Array:
        b, h, w, c = x.shape
        x = x.reshape(b, h // PATCH, PATCH, w // PATCH, PATCH, c).transpose(0, 1, 3, 2, 4, 5)
        x = self.embed(x.reshape(b, -1, PATCH * PATCH * c).astype(self.compute_dtype))
        x = x + self.down(nnx.gelu(self.up(x)))
        return self.head(x.reshape(b, -1)).astype(jnp.float32)


model.MODELS["patches"] = Patches
