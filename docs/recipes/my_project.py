"""The project's own parts: importing this module registers them with the template."""

import math

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fmnist_flax import datasets, model, optimizer


class Logistic(nnx.Module):
    """Logistic regression: one dense layer from the pixels to the classes."""

    def __init__(self, *, image_shape, num_classes, compute_dtype=jnp.float32, rngs):
        self.compute_dtype, self.image_shape = compute_dtype, tuple(image_shape)
        self.dense = nnx.Linear(math.prod(image_shape), num_classes, dtype=compute_dtype, rngs=rngs)

    def __call__(self, x):
        return self.dense(x.reshape(len(x), -1).astype(self.compute_dtype)).astype(jnp.float32)


model.MODELS["logistic"] = Logistic


@datasets.register("stripes")
def load_stripes(data_dir, config):
    """Generated 8x8 images: horizontal or vertical stripes, two classes."""
    rng = np.random.default_rng(0)

    def split(n):
        labels = np.arange(n) % 2
        images = rng.integers(0, 60, (n, 8, 8), dtype=np.uint8)
        images[labels == 0, ::2, :] += 150
        images[labels == 1, :, ::2] += 150
        return images, labels

    names, sources = ["horizontal", "vertical"], ("generated", "generated")
    return datasets.make_dataset(
        "stripes", "stripes", names, split(256), split(64), sources=sources, origin="my_project.py"
    )


@optimizer.register("sgd_plain")
def sgd_plain(learning_rate, weight_decay=0.0, mask=None):
    """SGD with decoupled weight decay where `mask` allows."""
    return optax.chain(optax.add_decayed_weights(weight_decay, mask), optax.sgd(learning_rate))


@optimizer.schedule("halving", over_steps=True)
def halving(opt, steps):
    """The peak rate, halved at the middle of the run."""
    return optax.piecewise_constant_schedule(opt.learning_rate, {steps // 2: 0.5})
