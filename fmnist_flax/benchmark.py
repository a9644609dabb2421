"""Honest step timing (warm up, then `block_until_ready`): the codelab's sections 7 and 13."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax
import ml_collections
from flax import nnx

from fmnist_flax import data, train
from fmnist_flax.model import create_model

EAGER_STEPS = 20  # the codelab's sizes
JIT_STEPS = 100
PRECISION_STEPS = 100
COMPARISON_SEED = 10  # fresh models, never the trained one
DISTINCT_BATCHES = 8  # timed steps cycle through these, gathered before the clock starts


def time_steps(
    step_fn: Callable[..., train.Metrics],
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    device_data: data.DeviceData,
    steps: int,
) -> dict[str, float]:
    """One untimed warm-up step, then `steps` timed ones until the state is ready.

    Batches come from epoch 0's order, gathered before the clock starts.
    """
    batch_size = device_data.batch_size
    order = data.epoch_order(COMPARISON_SEED, 0, len(device_data.train_labels))
    batches = [
        data.batch_at(device_data.train_images, device_data.train_labels, order, i, batch_size)
        for i in range(min(steps + 1, DISTINCT_BATCHES))
    ]
    jax.block_until_ready(step_fn(model, optimizer, *batches[0]))
    start = time.perf_counter()
    for i in range(steps):
        metrics = step_fn(model, optimizer, *batches[(i + 1) % len(batches)])
    jax.block_until_ready((metrics, nnx.state((model, optimizer))))
    seconds = time.perf_counter() - start
    return {
        "steps": steps,
        "loss": float(metrics["loss"]),
        "accuracy": float(metrics["accuracy"]),
        "seconds": seconds,
        "examples_per_sec": steps * batch_size / seconds,
    }


def _fresh(config: ml_collections.ConfigDict, compute_dtype: str | None = None):
    config = ml_collections.ConfigDict(config.to_dict())
    if compute_dtype:
        config.compute_dtype = compute_dtype
    model = create_model(config, seed=COMPARISON_SEED)
    return model, train.create_optimizer(model, config)


def dispatch_vs_jit(
    config: ml_collections.ConfigDict, device_data: data.DeviceData
) -> list[dict[str, Any]]:
    """Section 7: the same AdamW step run op by op from Python, and compiled with nnx.jit."""
    eager = time_steps(train.train_step_eager, *_fresh(config), device_data, EAGER_STEPS)
    jitted = time_steps(train.train_step, *_fresh(config), device_data, JIT_STEPS)
    return [{"mode": "Python dispatch", **eager}, {"mode": "jitted step", **jitted}]


def precision_comparison(
    config: ml_collections.ConfigDict, device_data: data.DeviceData
) -> list[dict[str, Any]]:
    """Section 13: float32 and bfloat16 compute (params stay float32), fresh init each."""
    return [
        {"dtype": dtype, **time_steps(train.train_step, *_fresh(config, dtype), device_data,
                                      PRECISION_STEPS)}
        for dtype in ("float32", "bfloat16")
    ]  # fmt: skip
