"""The codelab's pure-PyTree functions, kept as the reference the NNX version mirrors.

Tests prove the NNX model, loss, gradients and optimizer step equal these; the benchmark times
this loop as the baseline. Parameters are a dict {w1, b1, w2, b2, w3, b3} of float32 arrays.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from fmnist_flax import datasets
from fmnist_flax import input_pipeline as pipeline

INPUT_DIM = 28 * 28  # the codelab's Fashion-MNIST images, flattened
NUM_CLASSES = 10
Params = dict[str, jax.Array]
Batch = tuple[jax.Array, jax.Array]


def init_mlp_params(key: jax.Array, hidden1: int = 256, hidden2: int = 128) -> Params:
    """He-normal weights (std sqrt(2 / fan_in)) and zero biases, as the codelab initialises."""
    sizes = (INPUT_DIM, hidden1, hidden2, NUM_CLASSES)
    params = {}
    for i, (key_i, fan_in, fan_out) in enumerate(
        zip(jax.random.split(key, 3), sizes[:-1], sizes[1:], strict=True), start=1
    ):
        params[f"w{i}"] = jax.random.normal(key_i, (fan_in, fan_out)) * math.sqrt(2.0 / fan_in)
        params[f"b{i}"] = jnp.zeros((fan_out,), jnp.float32)
    return params


def mlp(params: Params, x: jax.Array, compute_dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Cast inputs and params to `compute_dtype`, two GELU layers, float32 logits."""
    p = {name: value.astype(compute_dtype) for name, value in params.items()}
    x = x.astype(compute_dtype)
    x = jax.nn.gelu(x @ p["w1"] + p["b1"])
    x = jax.nn.gelu(x @ p["w2"] + p["b2"])
    return (x @ p["w3"] + p["b3"]).astype(jnp.float32)


def loss_with_metrics(
    params: Params, batch: Batch, compute_dtype: jnp.dtype = jnp.float32
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Mean softmax cross-entropy with integer labels; batch accuracy as aux."""
    x, y = batch
    logits = mlp(params, x, compute_dtype)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, axis=-1) == y)}


def cross_entropy_loss(
    params: Params, batch: Batch, compute_dtype: jnp.dtype = jnp.float32
) -> jax.Array:
    """The scalar loss `jax.grad` differentiates."""
    return loss_with_metrics(params, batch, compute_dtype)[0]


def sgd_step(params: Params, batch: Batch, learning_rate: float) -> tuple[Params, jax.Array]:
    """One hand-written SGD update; returns a new tree instead of changing `params`."""
    loss, grads = jax.value_and_grad(cross_entropy_loss)(params, batch)
    return jax.tree.map(lambda p, g: p - learning_rate * g, params, grads), loss


def make_train_step(optimizer: optax.GradientTransformation, compute_dtype: jnp.dtype):
    """The codelab's jitted Optax step: (params, opt_state, batch) -> (params, opt_state, metrics).

    Built per optimizer and dtype, as the codelab closes over them.
    """

    @jax.jit
    def train_step(params, opt_state, batch):
        (loss, aux), grads = jax.value_and_grad(loss_with_metrics, has_aux=True)(
            params, batch, compute_dtype
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        metrics = {"loss": loss, "accuracy": aux["accuracy"], "grad_norm": optax.tree.norm(grads)}
        return optax.apply_updates(params, updates), opt_state, metrics

    return train_step


def params_from_model(model: nnx.Module) -> Params:
    """The NNX MLP's weights as the codelab's dict, for side-by-side comparisons."""
    params = {}
    for i, layer in enumerate(model.layers, start=1):
        params[f"w{i}"] = layer.kernel[...]
        params[f"b{i}"] = layer.bias[...]
    return params


def flat_images(images) -> jax.Array:
    """uint8 (N, 28, 28, 1) -> float32 (N, 784) in [0, 1], the codelab's flattened inputs."""
    return pipeline.prepare_images(images).reshape(len(images), -1)


def run_codelab(
    steps: int = 400, batch_size: int = 512, log_every: int = 25, data_dir: str = ""
) -> dict[str, float]:
    """The codelab's whole job in plain JAX: data, fixed batches, Optax loop, vmapped eval.

    The baseline `python main.py` is measured against (start to exit, peak memory).
    """
    dataset = datasets.load_dataset("fashion_mnist", data_dir or None, download=False)
    x, y = pipeline.shuffle(dataset.train_images, dataset.train_labels, seed=0)
    x_batches, y_batches = jax.device_put(pipeline.fixed_batches(flat_images(x), y, batch_size))
    test_x, test_y = jax.device_put(
        pipeline.fixed_batches(flat_images(dataset.test_images), dataset.test_labels, batch_size)
    )
    tx = optax.adamw(3e-3, weight_decay=1e-4)
    params = init_mlp_params(jax.random.key(3))
    opt_state = tx.init(params)
    step = make_train_step(tx, jnp.float32)
    for i in range(steps):
        j = i % x_batches.shape[0]
        params, opt_state, metrics = step(params, opt_state, (x_batches[j], y_batches[j]))
        if i % log_every == 0 or i == steps - 1:
            jax.device_get(metrics)

    @jax.jit
    def evaluate(params, xs, ys):
        losses, aux = jax.vmap(lambda x, y: loss_with_metrics(params, (x, y)))(xs, ys)
        return jnp.mean(losses), jnp.mean(aux["accuracy"])

    loss, accuracy = evaluate(params, test_x, test_y)
    return {"test_loss": float(loss), "test_accuracy": float(accuracy)}


if __name__ == "__main__":
    import json
    import sys

    from fmnist_flax.runtime.workdir import peak_rss_mb

    args = sys.argv[1:]
    result = run_codelab(steps=int(args[0]) if args else 400, data_dir=args[1] if args[1:] else "")
    result["peak_rss_mb"] = peak_rss_mb()
    print(json.dumps(result))
